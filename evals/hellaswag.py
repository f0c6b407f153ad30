"""HellaSwag, zero-shot, for a checkpoint of train_gpt.py: which of four endings does the model find likeliest?

    python evals/hellaswag.py logs/<run id>/state_step001390.pt
    torchrun --standalone --nproc_per_node=8 evals/hellaswag.py CHECKPOINT      # examples split across GPUs
    python evals/hellaswag.py CHECKPOINT --data my_hellaswag.jsonl --limit 500 --tokenizer gpt2.tiktoken

Each of an example's candidates is its own document, as in training: 50256, the tokens of the context (`ctx`),
then those of " " + the ending. A candidate's score is the model's loss over its ending's tokens; `acc` counts
the examples whose lowest summed loss is the labelled ending, `acc_norm` those whose lowest mean loss per token
is (completion style, as llm.c and modded-nanogpt score it). Candidates are packed into sequences of the
model's own document-causal attention, which never crosses a document, so packing changes only rounding. Each
candidate lies within the attention window the run ended its training with, so none is cut.

The data: HellaSwag's validation file (10,042 examples) from its authors' repository at a fixed commit,
downloaded once into data/hellaswag/ and checked against the git blob id that commit gives it, so that a bad
download is an error, not a wrong score. --data FILE reads a local JSON Lines file in HellaSwag's format
(ctx, endings, label; other fields ignored). The last line printed is `hellaswag: acc_norm=... acc=... n=...`,
the line before it says how long scoring took.
"""
import argparse
import hashlib
import json
import math
import os
import sys
import time
import urllib.request
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: train_gpt.py, evals/
from evals.common import (BLOCK_SIZE, EOT, REPO, EvalError, encoding, load_model,  # noqa: E402
                          run_main, start_processes, trained_window_blocks)

# hellaswag_val.jsonl at the last commit of github.com/rowanz/hellaswag; the file is the same in every commit
URL = ("https://raw.githubusercontent.com/rowanz/hellaswag/a29ff8e9a04bba4bd6588223785ce105328adc57/"
       "data/hellaswag_val.jsonl")
GIT_BLOB_ID = "0f5ee25d72216f12317d5d8a7b92deafa423d81e"  # sha1 of b"blob <size>\0" + the file's bytes
EXAMPLES = 10_042
CACHED = REPO / "data" / "hellaswag" / "hellaswag_val.jsonl"
SEQUENCE_LENGTH = 8192  # tokens per forward: its fp32 logits are 1.6 GB


def git_blob_id(data):
    """The id git gives a file's content: what GitHub lists for it at a commit."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def download(path=CACHED, url=URL, blob_id=GIT_BLOB_ID):
    """HellaSwag's validation file at path: a cached copy if it checks out, else downloaded, checked, and
    renamed into place (never half a file)."""
    path = Path(path)
    if path.exists():
        if git_blob_id(path.read_bytes()) == blob_id:
            return path
        print(f"{path}: not the expected file; downloading it again", file=sys.stderr)
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            data = response.read()
    except (OSError, ValueError) as e:  # URLError and HTTPError are OSErrors
        raise EvalError(f"cannot download HellaSwag from {url} ({getattr(e, 'reason', e)}); offline, pass "
                        "--data FILE, a copy of hellaswag_val.jsonl") from None
    if (got := git_blob_id(data)) != blob_id:
        raise EvalError(f"the download from {url} is not HellaSwag's validation file ({len(data):,} bytes, git "
                        f"blob id {got[:12]}, expected {blob_id[:12]}); nothing was saved: run again, or pass "
                        "--data FILE")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        temporary.write_bytes(data)
        os.replace(temporary, path)
    except OSError as e:
        raise EvalError(f"cannot save HellaSwag to {path} ({e.strerror}); pass --data FILE") from None
    return path


def read_examples(path, limit=None):
    """(context, endings, label) of each example in a HellaSwag JSON Lines file, the first `limit` ones."""
    examples = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if limit is not None and len(examples) == limit:
                    break
                if line.strip():
                    examples.append(parse_example(line, f"{path}, line {number}"))
    except OSError as e:
        raise EvalError(f"--data {path}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise EvalError(f"--data {path}: not UTF-8 text ({e.reason} at byte {e.start}): not a JSON Lines file") \
            from None
    if not examples:
        raise EvalError(f"--data {path}: no examples in it")
    return examples


def parse_example(line, where):
    try:
        item = json.loads(line)
        context, endings, label = item["ctx"], item["endings"], item["label"]
    except (ValueError, KeyError, TypeError) as e:
        raise EvalError(f"{where}: not a HellaSwag example ({type(e).__name__}: {e}); each line is a JSON object "
                        "with ctx (text), endings (texts) and label (the right ending's index)") from None
    # labels are numbers, or digits in some copies (the hub's); the test split has none
    if isinstance(label, str) and label.isdigit():
        label = int(label)
    texts = isinstance(context, str) and isinstance(endings, list) and all(isinstance(e, str) for e in endings)
    if not texts or len(endings) < 2:
        raise EvalError(f"{where}: ctx must be a text and endings a list of at least 2 texts")
    if type(label) is not int or not 0 <= label < len(endings):
        raise EvalError(f"{where}: label {label!r} is not the index of one of its {len(endings)} endings "
                        "(HellaSwag's test split has no labels: use the validation split)")
    return context, endings, label


def render(examples, tokenizer):
    """Per example, its candidates: the tokens of the document (50256, context, " " + ending) and where the
    ending starts."""
    rendered = []
    for context, endings, _ in examples:
        start = [EOT, *tokenizer.encode_ordinary(context)]
        rendered.append([(start + tokenizer.encode_ordinary(" " + ending), len(start)) for ending in endings])
    return rendered


def pack(lengths, sequence_length, window_blocks):
    """(sequence, offset) for documents of these lengths, in order: none crosses the end of a sequence, and
    none spans more than window_blocks blocks (where one would, it starts at the next block instead)."""
    places, sequence, offset = [], 0, 0
    for length in lengths:
        assert length <= min(sequence_length, window_blocks * BLOCK_SIZE)
        if (offset + length - 1) // BLOCK_SIZE - offset // BLOCK_SIZE >= window_blocks:
            offset = math.ceil(offset / BLOCK_SIZE) * BLOCK_SIZE
        if offset + length > sequence_length:
            sequence, offset = sequence + 1, 0
        places.append((sequence, offset))
        offset += length
    return places


@torch.no_grad()
def score(model, candidates, window_blocks, device, sequence_length=SEQUENCE_LENGTH):
    """Each candidate's summed loss over its ending, and the ending's token count (float64, on the CPU), with
    how the candidates were packed: (sums, counts, sequences, tokens, window in blocks)."""
    lengths = [len(tokens) for tokens, _ in candidates]
    blocks = math.ceil(max(lengths) / BLOCK_SIZE)
    # longer than the trained window: scored whole with a wider one, which changes nothing for the others
    window_blocks = max(window_blocks, blocks)
    sequence_length = max(sequence_length, blocks * BLOCK_SIZE)
    places = pack(lengths, sequence_length, window_blocks)
    window = torch.tensor(window_blocks, dtype=torch.int32, device=device)
    sums = torch.zeros(len(candidates), dtype=torch.float64)
    counts = torch.tensor([len(tokens) - start for tokens, start in candidates], dtype=torch.float64)
    members = [[] for _ in range(places[-1][0] + 1 if places else 0)]
    for i, (sequence, offset) in enumerate(places):
        members[sequence].append((i, offset))
    for sequence in members:
        i, offset = sequence[-1]
        used = math.ceil((offset + len(candidates[i][0])) / BLOCK_SIZE) * BLOCK_SIZE  # the last one: shorter
        # padding: lone 50256s, each a document of its own, after the real tokens
        tokens = torch.full((used,), EOT, dtype=torch.int64)
        rows, owners = [], []
        for i, offset in sequence:
            document, start = candidates[i]
            tokens[offset:offset + len(document)] = torch.tensor(document)
            # the ending's tokens are predicted at the positions just before each
            rows += range(offset + start - 1, offset + len(document) - 1)
            owners += [i] * (len(document) - start)
        tokens = tokens.to(device)
        rows = torch.tensor(rows, device=device)
        logits = model(tokens.to(torch.int32), None, window)
        losses = F.cross_entropy(logits[rows], tokens[rows + 1], reduction="none")
        sums.index_add_(0, torch.tensor(owners), losses.double().cpu())
    return sums, counts, len(members), sum(lengths), window_blocks


def correct_counts(rendered, labels, sums, counts):
    """(by mean loss, by summed loss): how many examples have their labelled ending scored lowest."""
    by_mean = by_sum = 0
    first = 0
    for candidates, label in zip(rendered, labels):
        total = sums[first:first + len(candidates)]
        mean = total / counts[first:first + len(candidates)]
        by_mean += int(mean.argmin()) == label
        by_sum += int(total.argmin()) == label
        first += len(candidates)
    return by_mean, by_sum


def prepare(data=None, tokenizer_file=None, limit=None):
    """The examples, rendered, and their labels: from data (a JSON Lines file) or HellaSwag's, downloaded once."""
    path = Path(data) if data else download()
    examples = read_examples(path, limit)
    if not data and limit is None and len(examples) != EXAMPLES:
        raise EvalError(f"{path}: {len(examples):,} examples, not HellaSwag's {EXAMPLES:,}: delete it and run again")
    return render(examples, encoding(tokenizer_file)), [label for _, _, label in examples]


def evaluate(model, rendered, labels, window_blocks, device, rank=0, world_size=1,
             sequence_length=SEQUENCE_LENGTH):
    """(acc_norm, acc, n, details): this rank scores examples rank, rank + world_size, ...; counts are summed
    over the ranks (every rank must call it). details: a line on what was scored, in what time."""
    started = time.perf_counter()
    mine = slice(rank, None, world_size)
    candidates = [c for example in rendered[mine] for c in example]
    correct = torch.zeros(3, dtype=torch.int64)
    sequences = tokens = 0
    window = window_blocks
    if candidates:
        sums, counts, sequences, tokens, window = score(model, candidates, window_blocks, device, sequence_length)
        correct[:2] = torch.tensor(correct_counts(rendered[mine], labels[mine], sums, counts))
        correct[2] = len(labels[mine])
    if world_size > 1:
        correct = correct.to(device)
        dist.all_reduce(correct)
    by_mean, by_sum, n = correct.tolist()
    details = (f"hellaswag: {n:,} examples in {time.perf_counter() - started:.1f} s on {world_size} x "
               f"{device.type} (rank {rank}: {len(candidates):,} candidates, {tokens:,} tokens in {sequences} "
               f"sequences of up to {max(sequence_length, window * BLOCK_SIZE):,})")
    if window > window_blocks:
        details += (f"; candidates longer than the trained window of {window_blocks} blocks of {BLOCK_SIZE} "
                    f"were scored whole, with a window of {window} blocks")
    return by_mean / n, by_sum / n, n, details


def result_line(acc_norm, acc, n):
    return f"hellaswag: acc_norm={acc_norm:.4f} acc={acc:.4f} n={n}"


def main(argv=None):
    parser = argparse.ArgumentParser(description="Zero-shot HellaSwag accuracy of a train_gpt.py checkpoint.")
    parser.add_argument("checkpoint", help="a checkpoint written by train_gpt.py (state_step*.pt)")
    parser.add_argument("--data", help="a JSON Lines file in HellaSwag's format (default: HellaSwag's "
                        f"validation set, downloaded once into {CACHED.parent.relative_to(REPO)}/)")
    parser.add_argument("--limit", type=int, help="score only the first N examples")
    parser.add_argument("--tokenizer", help="a tiktoken ranks file of GPT-2's BPE, for offline use "
                        "(default: tiktoken's own, downloaded once)")
    parser.add_argument("--sequence_length", type=int, default=SEQUENCE_LENGTH,
                        help="tokens per forward, a multiple of 128 (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        parser.error(f"--limit must be at least 1, got {args.limit}")
    if args.sequence_length < BLOCK_SIZE or args.sequence_length % BLOCK_SIZE:
        parser.error(f"--sequence_length must be a positive multiple of {BLOCK_SIZE}, got {args.sequence_length}")

    def body():
        rank, world_size, device = start_processes()
        rendered, labels = prepare(args.data, args.tokenizer, args.limit)  # first: it is quicker to check
        model, options = load_model(args.checkpoint, device)
        acc_norm, acc, n, details = evaluate(model, rendered, labels, trained_window_blocks(options), device,
                                             rank, world_size, args.sequence_length)
        if rank == 0:
            print(details)
            print(result_line(acc_norm, acc, n))
        return 0
    return run_main(body)


if __name__ == "__main__":
    sys.exit(main())
