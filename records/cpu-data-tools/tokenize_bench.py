"""Tokens per second of data/text_to_shards.py against the anchors' loop, back to back on the same
text (a measurement, not a test).

    python records/cpu-data-tools/tokenize_bench.py                 # Wikipedia text, else generated
    python records/cpu-data-tools/tokenize_bench.py --text corpus.jsonl --repeats 3

The anchors' loop is llm.c's dev/data/fineweb.py: a multiprocessing pool mapping tiktoken's
encode_ordinary over the documents (imap, 16 at a time), each led by EOT, into shards. The text is
English Wikipedia when ../shared/data/enwiki/ beside the repository holds its GPT-2 shards (decoded
back to text), else generated words; it is written once as JSON Lines, which every variant reads.
Each variant runs in a process of its own, pinned to one core or to two: the anchors' loop with 1
process, text_to_shards with --workers 1, text_to_shards with --workers 2, the anchors' loop with 2
processes. Each is timed from its first read to its last shard written (the interpreter's start,
imports and the tokenizer's load are left out), and each variant's tokens are checked to be the same
stream.
"""

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
# the data tools under measurement
sys.path.insert(0, str(REPO / "data"))
import files  # noqa: E402
import shards  # noqa: E402
import text_to_shards  # noqa: E402
from gpt2_tokenizer import EOT  # noqa: E402
from gpt2_tokenizer import gpt2_encoding  # noqa: E402

SHARED = REPO.parent / "shared" / "data"
SHARD_TOKENS = 10_000_000
# in each process of the anchors' pool, set before it forks
ENCODING = None


def tokenize(text):
    """llm.c's tokenize(): EOT, then encode_ordinary's tokens, as uint16."""
    tokens = [EOT]
    tokens.extend(ENCODING.encode_ordinary(text))
    tokens = np.array(tokens)
    assert (0 <= tokens).all() and (tokens < 2 ** 16).all()
    return tokens.astype(np.uint16)


def anchors_loop(text, out, processes):
    """The anchors' loop over the JSON Lines file `text`: shards of SHARD_TOKENS, documents split
    across them as llm.c splits them."""
    def documents():
        with open(text, "rb") as f:
            for line in f:
                yield json.loads(line)["text"]

    buffer = np.empty(SHARD_TOKENS, dtype=np.uint16)
    count = 0
    index = 0
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        for tokens in pool.imap(tokenize, documents(), chunksize=16):
            while count + len(tokens) >= SHARD_TOKENS:
                room = SHARD_TOKENS - count
                buffer[count:] = tokens[:room]
                (out / f"anchor_{index:06d}.bin").write_bytes(shards.header(SHARD_TOKENS) +
                                                               buffer.tobytes())
                index += 1
                count = 0
                tokens = tokens[room:]
            buffer[count:count + len(tokens)] = tokens
            count += len(tokens)
    (out / f"anchor_{index:06d}.bin").write_bytes(shards.header(count) + buffer[:count].tobytes())


def ours(text, out, workers):
    item = text_to_shards.local_inputs([text], out)
    text_to_shards.convert(item, out, "ours", ENCODING, workers, val_tokens=100_000,
                           shard_tokens=SHARD_TOKENS)


def stream(out):
    """The tokens of every shard in `out`, in order (ours: the val shard first)."""
    names = sorted(out.glob("*.bin"), key=lambda path: ("_train_" in path.name, path.name))
    return np.concatenate([np.fromfile(path, "<u2", offset=shards.HEADER_BYTES) for path in names])


def variant(args):
    """In the child: pin, load, time one variant; print its tokens and seconds as JSON."""
    global ENCODING
    os.sched_setaffinity(0, args.cores)
    ENCODING = gpt2_encoding(args.tokenizer)
    out = Path(args.out)
    began = time.perf_counter()
    if args.variant == "anchor":
        anchors_loop(args.text, out, args.processes)
    else:
        ours(args.text, out, args.processes)
    seconds = time.perf_counter() - began
    print(json.dumps({"tokens": int(len(stream(out))), "seconds": seconds}))


def write_text(path, tokenizer, megabytes):
    """English Wikipedia's documents (decoded from the GPT-2 shards) or generated words, as JSON
    Lines, up to `megabytes` of text; what it is."""
    enwiki = sorted((SHARED / "enwiki").glob("enwiki_*.bin"))
    budget = megabytes * 1_000_000
    with open(path, "w") as f:
        if enwiki:
            encoding = gpt2_encoding(tokenizer)
            for shard in enwiki:
                tokens = np.fromfile(shard, "<u2", offset=shards.HEADER_BYTES)
                starts = list(np.flatnonzero(tokens == EOT)) + [len(tokens)]
                for a, b in zip(starts, starts[1:]):
                    document = encoding.decode(tokens[a + 1:b].tolist())
                    budget -= len(document.encode())
                    f.write(json.dumps({"text": document}) + "\n")
                    if budget <= 0:
                        return "English Wikipedia (../shared/data/enwiki, decoded)"
            return "English Wikipedia (../shared/data/enwiki, decoded)"
        rng = np.random.default_rng(0)
        words = ["".join(rng.choice(list("etaoinshrdlucmfwypvbgkjqxz"), rng.integers(1, 10)))
                 for _ in range(20_000)]
        # Zipf-like word frequencies
        weights = 1 / np.arange(1, len(words) + 1)
        while budget > 0:
            count = int(rng.integers(20, 2000))
            document = " ".join(rng.choice(words, count, p=weights / weights.sum())) + "."
            budget -= len(document)
            f.write(json.dumps({"text": document}) + "\n")
    return "generated words (no ../shared/data/enwiki here)"


def measure(args, kind, processes, cores, folder):
    """The fastest of args.repeats runs of a variant, each in a process of its own: (tokens,
    seconds, the tokens made)."""
    best = None
    for _ in range(args.repeats):
        out = Path(tempfile.mkdtemp(dir=folder))
        command = [sys.executable, __file__, "--variant", kind, "--processes", str(processes),
                   "--cores", ",".join(map(str, cores)), "--text", args.text, "--out", str(out)]
        if args.tokenizer:
            command += ["--tokenizer", args.tokenizer]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"{kind} with {processes} process(es) failed:\n{done.stderr}")
        measured = json.loads(done.stdout.strip().splitlines()[-1])
        if best is None or measured["seconds"] < best[1]:
            best = measured["tokens"], measured["seconds"], stream(out)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", help="a JSON Lines file to measure on (default: see above)")
    parser.add_argument("--megabytes", type=int, default=60,
                        help="at most this much text when it is made here (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each variant, the fastest counted (default: %(default)s)")
    parser.add_argument("--tokenizer", default=None,
                        help="a tiktoken ranks file of GPT-2's BPE (default: ../shared/data/gpt2/"
                             "gpt2.tiktoken when there, else tiktoken's own)")
    # the child's options
    parser.add_argument("--variant", choices=["anchor", "ours"], help=argparse.SUPPRESS)
    parser.add_argument("--processes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--cores", type=lambda text: set(map(int, text.split(","))),
                        help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    ranks = SHARED / "gpt2" / "gpt2.tiktoken"
    if args.tokenizer is None and ranks.exists():
        args.tokenizer = str(ranks)
    if args.variant:
        variant(args)
        return
    cores = sorted(os.sched_getaffinity(0))[:2]
    plan = [("anchors' loop, 1 process", "anchor", 1),
            ("text_to_shards --workers 1", "ours", 1),
            ("text_to_shards --workers 2", "ours", 2),
            ("anchors' loop, 2 processes", "anchor", 2)]
    with tempfile.TemporaryDirectory() as folder:
        if args.text is None:
            args.text = str(Path(folder) / "text.jsonl")
            what = write_text(args.text, args.tokenizer, args.megabytes)
        else:
            # a pipe would be read once, by the first run only
            files.checked(args.text)
            what = args.text
        print(f"text: {what}, {os.path.getsize(args.text) / 1e6:.1f} MB of JSON Lines; cores "
              f"{cores} of {os.cpu_count()}; {args.repeats} run(s) of each, the fastest counted")
        base = None
        first = None
        for label, kind, processes in plan:
            if processes > len(cores):
                print(f"{label:28s} skipped: one core here")
                continue
            tokens, seconds, made = measure(args, kind, processes, cores[:processes], folder)
            first = made if first is None else first
            assert np.array_equal(made, first), f"{label}: not the same tokens"
            rate = tokens / seconds
            base = base or rate
            print(f"{label:28s} {tokens:,} tokens in {seconds:.2f} s: {rate:,.0f} tokens/s, "
                  f"{rate / base:.2f}x the anchors' loop on 1 core")


if __name__ == "__main__":
    main()
