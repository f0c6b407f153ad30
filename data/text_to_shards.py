#!/usr/bin/env python3
"""Your own text as the token shards train_gpt.py reads: GPT-2's BPE (tiktoken), on every core.

    python data/text_to_shards.py books/*.txt --out data/books --name books
    python data/text_to_shards.py a.jsonl b.jsonl.gz c.parquet more/ --out data/mine --name mine
    python data/text_to_shards.py --hub HuggingFaceFW/fineweb-edu --hub_config sample-10BT --name edu
    python train_gpt.py --train_files 'data/mine/mine_train_*.bin' --val_files 'data/mine/mine_val_*.bin'

Inputs, read in the order given, each file's documents in file order: a text file is one document
(its exact text; also gzipped), JSON Lines (.jsonl, .ndjson, .json, each also .gz) one per line in
its "text" field (--text_field names another), Parquet one per row (pyarrow, imported only for
it); a folder gives the files under it, sorted by path, hidden ones left out; or a dataset on the
Hugging Face hub, by a config of its card or by path patterns (hub.py). Every path is checked
before it is opened (files.py): a pipe or a device is refused, since a rerun could neither read it
again nor tell whether it changed; a file or folder that cannot be read is an error, never skipped.

Output, in --out (default: data/NAME/ beside this script): shards.py's format. Every document is
led by <|endoftext|> (50256) and encoded as encode_ordinary encodes it, so text that looks like
<|endoftext|> is never the special token. Documents are never split: NAME_val_000000.bin takes
whole documents until it holds at least --val_tokens, then NAME_train_000001.bin, ... hold at most
--shard_tokens each; a short last train shard is evened out with the one before it.

How it works, and why:
- The main process reads the inputs in blocks of whole lines (CHUNK_BYTES) and hands them to
  --workers processes (workers.py), at most WORKERS_PER_CORE per core, which tokenize them: answers
  come in input order, a bounded number in flight, so memory stays flat and the bytes are the same
  for any worker count. A worker that dies, fails or is stuck ends the run in one line.
- A shard is written under a temporary name and renamed into place once whole. text_to_shards.json
  records the inputs (size, modification and change time), the options and the finished shards:
  rerunning the same command after Ctrl-C, SIGTERM or SIGHUP keeps the finished shards and goes on
  after them, giving the same files as one run. A folder holding other shards (another NAME, other
  inputs or options, or shards this script did not write) is refused rather than mixed.
- When an input changed since a dataset was made, the new one is made in STAGING and swapped in
  once complete: an error leaves the old one as it was, and a swap that was interrupted at any
  moment is finished by the next run, whatever its inputs.
- One run at a time writes a folder (files.locked: a lock the kernel releases however a run ends).
- Exit status: 0 done; 1 an error, said in one line; 2 a bad command line; 130 interrupted.
"""

import argparse
import filecmp
import functools
import gzip
import itertools
import json
import os
import re
import shutil
import signal
import sys
import time
import zlib
from pathlib import Path

import files
import hub
import numpy as np
import shards
import workers
from gpt2_tokenizer import EOT
from gpt2_tokenizer import TokenizerError
from gpt2_tokenizer import fingerprint
from gpt2_tokenizer import gpt2_encoding

HERE = Path(__file__).resolve().parent
# The trainer's default --val_tokens (10,485,760), plus the 2 tokens its loader reads beyond them
DEFAULT_VAL_TOKENS = 10_485_762
# as FineWeb's shards
DEFAULT_SHARD_TOKENS = 100_000_000
# text per task: ~30 ms of one core's work, so handing it out costs under 1%
CHUNK_BYTES = 1 << 18
WORKERS_PER_CORE = 2
MANIFEST = "text_to_shards.json"
# where a dataset whose inputs changed is made anew, the old one kept until the new one is complete
STAGING = ".text_to_shards.next"
# the version the Parquet path was tested with; README says the same
PYARROW = "pyarrow==26.0.1"
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
BOM = b"\xef\xbb\xbf"


class UserError(Exception):
    """What the user can fix (bad input, the output folder): the message says what to do."""


class InputError(UserError):
    """Bad input: the message names the file and, where one applies, the line."""


class Interrupted(BaseException):
    """SIGTERM or SIGHUP, stopping the run as Ctrl-C does."""


# Inputs (read in the run's process) --------------------------------------------------------------
class Input:
    """An input: `label` in error lines (the path as given, or REPO:PATH), `key` in the manifest,
    `stamp` changes when the content does ([size, mtime_ns, ctime_ns], or the hub's [size,
    sha256]); the local file at `path`, or for the hub, once fetch() has downloaded it."""

    def __init__(self, label, key, stamp, path=None, fetch=None):
        self.label = label
        self.key = key
        self.stamp = stamp
        self.path = path
        self.fetch = fetch
        name = label.lower().removesuffix(".gz")
        self.kind = "text"
        if name.endswith(".parquet"):
            self.kind = "parquet"
        elif name.endswith((".jsonl", ".ndjson", ".json")):
            self.kind = "jsonl"


def input_problem(problem):
    """An input's FileProblem as one line that says what to do."""
    if problem.kind in ("pipe", "socket"):
        return (f"{problem}: its text could be read only once, so an interrupted run could not go "
                "on, nor a rerun check that it is unchanged; save it to a file first (e.g. `zcat "
                "in.jsonl.gz > in.jsonl`, or pass the .gz file itself)")
    if problem.special:
        return f"{problem} of text; pass regular files"
    return str(problem)


def local_inputs(paths, out):
    """Input for each path (a folder: the files under it), each a readable, non-empty file."""
    inputs = []
    # the files read so far, by size: a text read twice could put val documents in training too
    by_size = {}
    try:
        for given in paths:
            found = files.files_under(given, leave_out=out) if os.path.isdir(given) else [given]
            if not found and os.path.realpath(given) == os.path.realpath(out):
                raise InputError(f"{given} is the output folder too (--out): pick another --out")
            if not found:
                raise InputError(f"{given}: an empty folder: no files to read")
            for file in map(Path, found):
                info = files.checked(file)
                files.open_checked(file).close()
                if info.st_size == 0:
                    raise InputError(f"{file}: empty file: no documents in it; leave it out")
                for earlier in by_size.setdefault(info.st_size, []):
                    if filecmp.cmp(earlier, file, shallow=False):
                        twice = (f"is read twice (first as {earlier}: given again, or linked to)"
                                 if os.path.samefile(earlier, file)
                                 else f"holds the same bytes as {earlier}")
                        raise InputError(f"{file} {twice}: its documents could be in both the val "
                                         "and the train shards; give each text once")
                by_size[info.st_size].append(file)
                stamp = [info.st_size, info.st_mtime_ns, info.st_ctime_ns]
                inputs.append(Input(str(file), str(file.resolve()), stamp, file))
    except files.FileProblem as e:
        raise InputError(input_problem(e)) from None
    return inputs


def unchanged(item, file):
    """Raise unless the open local input `file` still matches what the run recorded of it."""
    info = os.fstat(file.fileno())
    if len(item.stamp) == 3 and [info.st_size, info.st_mtime_ns, info.st_ctime_ns] != item.stamp:
        raise InputError(f"{item.label}: changed while this run was reading it; rerun the same "
                         "command once it no longer changes")


def pieces(inputs, text_field, start):
    """(input index, first line, kind, payload) from position `start` (input index, line) on,
    lazily: a text file's bytes, a block of JSON lines, or a list of Parquet cells. Lines (rows, for
    Parquet) count from 1."""
    for index in range(start[0], len(inputs)):
        item = inputs[index]
        first = max(start[1], 1) if index == start[0] else 1
        try:
            item.path = item.path or item.fetch()
            with files.open_checked(item.path) as f:
                unchanged(item, f)
                if item.kind == "parquet":
                    yield from parquet_pieces(item, f, index, first, text_field)
                else:
                    yield from file_pieces(item, f, index, first)
                unchanged(item, f)
        except files.FileProblem as e:
            raise InputError(input_problem(e)) from None
        except hub.HubError as e:
            raise InputError(str(e)) from None


def file_pieces(item, raw_file, index, first_line):
    """A text file whole, or a JSON Lines file in blocks of CHUNK_BYTES of whole lines."""
    block = []
    size = 0
    line = first_line
    try:
        f = gzip.GzipFile(fileobj=raw_file) if item.label.lower().endswith(".gz") else raw_file
        if item.kind == "text":
            text = f.read()
            if not text:
                raise InputError(f"{item.label}: empty file: no documents in it; leave it out")
            yield index, 1, "text", text
            return
        blank = True
        for raw in itertools.islice(f, first_line - 1, None):
            if line == 1 and not block:
                raw = raw.removeprefix(BOM)
            block.append(raw)
            size += len(raw)
            blank = blank and raw.isspace()
            if size >= CHUNK_BYTES:
                yield index, line, "jsonl", b"".join(block)
                line += len(block)
                block = []
                size = 0
        if block:
            yield index, line, "jsonl", b"".join(block)
        if blank and first_line == 1:
            raise InputError(f"{item.label}: blank lines only: no documents in it; leave it out")
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        where = f"line {line + len(block)}: " if item.kind == "jsonl" else ""
        message = f"{item.label}: {where}not a whole gzip file ({e}); fetch it again"
        raise InputError(message) from None
    except OSError as e:
        raise InputError(f"{item.label}: cannot read it ({e.strerror or e})") from None


def import_pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise InputError(f"reading Parquet needs pyarrow: `pip install {PYARROW}`") from None
    return pyarrow, pyarrow.parquet


def parquet_pieces(item, f, index, first_row, text_field):
    """The text column's cells (str or None), a batch of rows at a time."""
    pyarrow, parquet = import_pyarrow()
    rows = 0
    try:
        table = parquet.ParquetFile(f)
        names = table.schema_arrow.names
        if text_field not in names:
            raise InputError(f"{item.label}: no column {text_field!r} (it has "
                             f"{', '.join(names[:8])}); name the text column with --text_field")
        column_type = table.schema_arrow.field(text_field).type
        # string, large_string or string_view
        if not str(column_type).startswith(("string", "large_string")):
            raise InputError(f"{item.label}: column {text_field!r} holds {column_type}, not text; "
                             "name the text column with --text_field")
        for batch in table.iter_batches(batch_size=1024, columns=[text_field]):
            cells = batch.column(0).to_pylist()
            skip = max(0, first_row - 1 - rows)
            if skip < len(cells):
                yield index, rows + 1 + skip, "parquet", cells[skip:]
            rows += len(cells)
    except (pyarrow.ArrowException, OSError) as e:
        message = f"{item.label}: not a readable Parquet file ({e}); fetch it again"
        raise InputError(message) from None
    if rows == 0:
        raise InputError(f"{item.label}: no rows: no documents in it; leave it out")


def tasks(stream):
    """Lists of pieces of about CHUNK_BYTES of text each."""
    task = []
    size = 0
    for piece in stream:
        task.append(piece)
        payload = piece[3]
        size += len(payload) if isinstance(payload, bytes) else sum(map(len, filter(None, payload)))
        if size >= CHUNK_BYTES:
            yield task
            task = []
            size = 0
    if task:
        yield task


# Tokenizing (in the worker processes) ------------------------------------------------------------
class DocumentError(Exception):
    def __init__(self, line, message):
        super().__init__(message)
        self.line = line


def encode_pieces(task, encoding, text_field):
    """("ok", tokens as uint16, and each document's token count and position) for a task's
    documents, each led by EOT; ("error", input index, line, message) for the first bad one."""
    eot = np.array([EOT], np.uint32)
    parts = []
    lengths = []
    positions = []
    for index, first_line, kind, payload in task:
        try:
            for line, text in documents(kind, payload, first_line, text_field):
                ids = encode(encoding, text)
                parts += [eot, ids]
                lengths.append(len(ids) + 1)
                positions.append((index, line))
        except DocumentError as e:
            return "error", index, e.line, str(e)
    tokens = np.concatenate(parts) if parts else np.empty(0, np.uint32)
    if tokens.size and tokens.max() >= 2 ** 16:
        at = int(np.argmax(tokens >= 2 ** 16))
        index, line = positions[int(np.searchsorted(np.cumsum(lengths), at, side="right"))]
        message = f"token id {tokens[at]} does not fit the shards' 16 bits: not GPT-2's"
        return "error", index, line, message
    return "ok", tokens.astype("<u2"), lengths, positions


def encode(encoding, text):
    """encode_ordinary's tokens (encode's, no special token allowed: its documented equal) as an
    array, with no Python list in between."""
    try:
        return encoding.encode_to_numpy(text, disallowed_special=())
    except UnicodeEncodeError:
        # a lone surrogate (JSON's "\ud800"), replaced as encode_ordinary replaces it
        text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        return encoding.encode_to_numpy(text, disallowed_special=())


def documents(kind, payload, first_line, text_field):
    """(line, text) of each document of a piece; DocumentError for a bad one."""
    if kind == "parquet":
        for row, cell in enumerate(payload, first_line):
            if not isinstance(cell, str):
                raise DocumentError(row, f"the {text_field!r} column is empty (null), not text")
            yield row, cell
        return
    records = payload.split(b"\n") if kind == "jsonl" else [payload]
    for line, raw in enumerate(records, first_line):
        try:
            text = raw.decode()
        except UnicodeDecodeError as e:
            # its line and column, and the byte
            line += raw.count(b"\n", 0, e.start)
            column = e.start - raw.rfind(b"\n", 0, e.start)
            raise DocumentError(line, f"not UTF-8 (byte 0x{raw[e.start]:02x} at column "
                                      f"{column}); convert the file to UTF-8") from None
        if kind == "text":
            yield line, text
        elif raw.strip():
            yield line, json_text(text, text_field, line)


def json_text(record, text_field, line):
    """The text field of one JSON line."""
    try:
        value = json.loads(record)
    except json.JSONDecodeError as e:
        raise DocumentError(line, f"not valid JSON ({e.msg} at column {e.colno}); each line must "
                                  "be one JSON object") from None
    if not isinstance(value, dict):
        raise DocumentError(line, f"a JSON {type(value).__name__}, not an object with a "
                                  f"{text_field!r} field")
    if text_field not in value:
        fields = ", ".join(map(repr, list(value)[:8])) or "none"
        raise DocumentError(line, f"no {text_field!r} field (fields: {fields}); name the text "
                                  "field with --text_field")
    if not isinstance(value[text_field], str):
        shown = json.dumps(value[text_field])[:40]
        raise DocumentError(line, f"the {text_field!r} field is {shown}, not a string")
    return value[text_field]


# The output folder -------------------------------------------------------------------------------
def our_files(folder, name):
    """(This dataset's shards in `folder`, sorted by name, each checked to be a file; the temporary
    files that killed runs left there.)"""
    shard = rf"{re.escape(name)}_(val_000000|train_\d{{6}})\.bin"
    names = files.names_in(folder)
    found = [file for file in names if re.fullmatch(shard, file)]
    for file in found:
        files.checked(folder / file)
    debris = rf"\.({shard}|{re.escape(MANIFEST)}|{re.escape(files.OWNER)})\..+\.tmp"
    return found, [file for file in names if re.fullmatch(debris, file)]


def delete(folder, names):
    for name in names:
        (folder / name).unlink()


def plan(folder, identity, stamps, disposable=False):
    """(The recorded shards that can be kept, in order; whether the dataset is complete; whether its
    inputs changed since it was.) Refuses a folder holding another dataset's shards, unless
    `disposable` (STAGING): there, what does not match is deleted."""
    present, debris = our_files(folder, identity["name"])
    # (the lock says that no run that left them is running)
    delete(folder, debris)
    manifest = files.read_json(folder / MANIFEST)
    if not disposable:
        refuse_others(folder, identity, present, manifest)
    ours = manifest is not None and all(manifest.get(key) == identity[key] for key in identity)
    same = ours and same_stamps(manifest.get("stamps"), stamps)
    if not same:
        # a complete dataset is kept until the new one is: made beside it
        if ours and present and manifest.get("complete") and not disposable:
            return [], False, True
        delete(folder, present)
        return [], False, False
    kept = []
    for shard in manifest.get("shards", []):
        if shards.token_count(folder / shard["file"]) != shard["tokens"]:
            break
        kept.append(shard)
    return kept, bool(manifest.get("complete")) and kept == manifest["shards"], False


def same_stamps(recorded, stamps):
    """Whether no input changed since `recorded` (a manifest's stamps) was taken. A local file's
    stamp is [size, mtime, ctime]: a change of content that keeps size and modification time (set
    back on purpose) still moves the ctime. Older manifests recorded [size, mtime] only."""
    if not isinstance(recorded, list) or len(recorded) != len(stamps):
        return False
    pairs = zip(recorded, stamps)
    return all(isinstance(old, list) and old == new[:len(old)] for old, new in pairs)


def refuse_others(out, identity, present, manifest):
    """Refuse a folder holding shards of another dataset, or that this script did not write."""
    names = files.names_in(out)
    foreign = [file for file in names if file.endswith(".bin") and file not in present]
    remedy = "pass another --out (a folder holds one dataset's shards)"
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise UserError(f"{out} holds shards of another dataset ({foreign[0]}{more}): {remedy}")
    if not present:
        return
    if MANIFEST not in names:
        raise UserError(f"{out} holds {present[0]}, which this script did not write (no "
                        f"{MANIFEST} there): {remedy}, or move the shards away")
    if manifest is None or not all(key in manifest for key in identity):
        raise UserError(f"{out / MANIFEST} is not the record this script writes: {remedy}, or "
                        "delete that folder to make it again")
    differs = []
    if manifest["name"] != identity["name"]:
        differs.append(f"the name {manifest['name']!r}")
    if manifest["inputs"] != identity["inputs"]:
        differs.append("other inputs")
    for option, value in identity["options"].items():
        if manifest["options"].get(option) != value:
            differs.append(f"--{option} {manifest['options'].get(option)}")
    if differs:
        raise UserError(f"{out} holds shards made with {', '.join(differs)} (see {MANIFEST}): "
                        f"{remedy}, or delete that folder to make it again")


def swap(out, manifest):
    """Put the complete dataset made in STAGING in place of the one in `out`. Every step can be done
    again, so that a swap interrupted at any moment is finished by the next run."""
    for shard in manifest["shards"]:
        if os.path.lexists(out / STAGING / shard["file"]):
            os.replace(out / STAGING / shard["file"], out / shard["file"])
    written = {shard["file"] for shard in manifest["shards"]}
    delete(out, [file for file in our_files(out, manifest["name"])[0] if file not in written])
    files.write_json(out / MANIFEST, manifest)
    shutil.rmtree(out / STAGING)


def swap_pending(out):
    """The manifest of the complete dataset in STAGING, which a swap then began; else None."""
    staged = files.read_json(out / STAGING / MANIFEST) if (out / STAGING).is_dir() else None
    if staged and staged.get("complete") and isinstance(staged.get("shards"), list):
        return staged
    return None


# The run -----------------------------------------------------------------------------------------
def convert(inputs, out, name, encoding, workers=1, val_tokens=DEFAULT_VAL_TOKENS,
            shard_tokens=DEFAULT_SHARD_TOKENS, text_field="text"):
    """Write the shards of `inputs` into `out`, going on from where an interrupted run stopped;
    return the manifest, and the tokens made in this run (None: all were there already). Raises
    UserError (InputError for bad input) for what the user can fix."""
    options = {"val_tokens": val_tokens, "shard_tokens": shard_tokens, "text_field": text_field,
               "tokenizer": fingerprint(encoding)}
    identity = {"name": name, "inputs": [item.key for item in inputs], "options": options}
    stamps = [item.stamp for item in inputs]
    staging = out / STAGING
    with files.locked(out) as lock:
        if staged := swap_pending(out):
            print(f"a run was interrupted while it put new shards in place of the old ones in "
                  f"{out}: finishing that; {out} now holds the new shards only, made from the "
                  "inputs as they were then", file=sys.stderr)
            swap(out, staged)
        kept, complete, changed = plan(out, identity, stamps)
        folder = staging if changed else out
        if changed:
            print(f"an input changed since the shards in {out} were made: making them again "
                  f"in {staging}; the old ones stay until the new ones are complete",
                  file=sys.stderr)
            staging.mkdir(exist_ok=True)
            kept, complete, _ = plan(staging, identity, stamps, disposable=True)
        elif staging.exists():
            shutil.rmtree(staging)
        manifest = {**identity, "stamps": stamps, "shards": kept, "complete": complete}
        if complete:
            return manifest, None
        files.write_json(folder / MANIFEST, manifest)
        try:
            made = run(inputs, folder, manifest, encoding, workers, lock)
        except (InputError, shards.LayoutError) as e:
            if folder == out:
                raise
            shutil.rmtree(staging)
            raise InputError(f"{e}; the shards in {out} are kept as they were, made from the "
                             "inputs before they changed") from None
        written = {shard["file"] for shard in manifest["shards"]}
        # left by an earlier run with more shards
        delete(folder, [file for file in our_files(folder, name)[0] if file not in written])
        manifest["complete"] = True
        files.write_json(folder / MANIFEST, manifest)
        if folder == staging:
            swap(out, manifest)
        return manifest, made


def run(inputs, folder, manifest, encoding, count, lock):
    """Tokenize the inputs from the first document after the kept shards, writing shards as they
    fill; return the count of tokens written."""
    from tqdm import tqdm

    options = manifest["options"]
    finished = manifest["shards"]

    def place(position):
        item = inputs[position[0]]
        return f"{item.label}: {'row' if item.kind == 'parquet' else 'line'} {position[1]}"

    def publish(shard):
        finished.append({"file": shard.name, "tokens": shard.tokens,
                         "documents": len(shard.lengths), "end": list(shard.end)})
        files.write_json(folder / MANIFEST, manifest)

    start = tuple(finished[-1]["end"]) if finished else (0, 1)
    writer = shards.ShardWriter(folder, manifest["name"], options["val_tokens"],
                                options["shard_tokens"], place, publish, len(finished))
    encode_task = functools.partial(encode_pieces, encoding=encoding,
                                    text_field=options["text_field"])
    # forked before tqdm starts its thread
    pool = workers.Workers(count, encode_task, lock, "tokenizing worker")
    bar = tqdm(unit=" docs", file=sys.stderr, smoothing=0.1)
    began = time.perf_counter()
    made = 0
    try:
        for answer in pool.answers(tasks(pieces(inputs, options["text_field"], start))):
            if answer[0] == "error":
                raise InputError(f"{place(answer[1:3])}: {answer[3]}")
            _, tokens, lengths, positions = answer
            offset = 0
            for length, position in zip(lengths, positions):
                writer.add(tokens[offset:offset + length], position)
                offset += length
            made += offset
            rate = made / max(time.perf_counter() - began, 1e-9)
            if positions:
                bar.set_description_str(f"input {positions[-1][0] + 1}/{len(inputs)}",
                                        refresh=False)
            bar.set_postfix_str(f"{made:,} tokens, {rate:,.0f} tokens/s", refresh=False)
            bar.update(len(lengths))
        writer.finish((len(inputs), 0))
        pool.stop(gracefully=True)
    except BaseException:
        pool.stop(gracefully=False)
        writer.discard()
        raise
    finally:
        bar.close()
    return made


def summary(out, manifest, made, seconds, workers):
    """What was made, and the command that trains on it."""
    val = manifest["shards"][0]
    train = manifest["shards"][1:]
    tokens = sum(shard["tokens"] for shard in train)
    documents = sum(shard["documents"] for shard in train)
    plural = "s" if len(train) > 1 else ""
    what = (f"{out}: {val['file']} ({val['tokens']:,} tokens, {val['documents']:,} documents) and "
            f"{len(train)} train shard{plural} ({tokens:,} tokens, {documents:,} documents)")
    if made is None:
        what += ", already made from these inputs"
    else:
        what += (f"; {made:,} tokens made in {seconds:.1f} s on {workers} worker(s), "
                 f"{made / seconds:,.0f} tokens/s")
    name = manifest["name"]
    return (f"{what}\ntrain on them: python train_gpt.py --train_files '{out}/{name}_train_*.bin' "
            f"--val_files '{out}/{name}_val_*.bin'")


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="text_to_shards.py", description="Tokenize text files, JSON Lines, Parquet or a hub "
        "dataset into train_gpt.py's shards.",
        epilog="Example: python data/text_to_shards.py corpus.jsonl.gz --out data/mine --name mine")
    # a bad command line is one line, not the usage and then the error
    parser.error = lambda message: parser.exit(2, f"error: {message}; see --help\n")
    parser.add_argument("inputs", nargs="*", metavar="INPUT", help="text files (a document each), "
                        "JSON Lines (.jsonl, .jsonl.gz), Parquet, folders")
    parser.add_argument("--name", required=True,
                        help="the shards' name: NAME_val_000000.bin, NAME_train_000001.bin, ...")
    parser.add_argument("--out", type=Path,
                        help="output folder (default: data/NAME/ beside this script)")
    parser.add_argument("--val_tokens", type=int, default=DEFAULT_VAL_TOKENS,
                        help="the val shard takes whole documents until it holds this many tokens "
                             "(default: %(default)s, enough for the trainer's default)")
    parser.add_argument("--shard_tokens", type=int, default=DEFAULT_SHARD_TOKENS,
                        help="at most this many tokens per train shard (default: %(default)s)")
    # the cores this process may use
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    most = WORKERS_PER_CORE * (cores or 1)
    parser.add_argument("--workers", type=int, default=cores or 1, help="tokenizing processes "
                        f"(default: every core, %(default)s here; at most {most})")
    parser.add_argument("--tokenizer", metavar="FILE", help="a tiktoken ranks file of GPT-2's BPE "
                        "(gpt2.tiktoken), for use offline")
    parser.add_argument("--text_field", default="text", help="the JSON field or Parquet column "
                        "holding the text (default: %(default)s)")
    hub_options = parser.add_argument_group("a dataset on the Hugging Face hub, instead of INPUTs")
    hub_options.add_argument("--hub", metavar="REPO", help="e.g. HuggingFaceFW/fineweb-edu")
    hub_options.add_argument("--hub_config", metavar="NAME", help="a config of its dataset card, "
                             "e.g. sample-10BT (default: the card's default config)")
    hub_options.add_argument("--hub_split", default="train", help="default: %(default)s")
    hub_options.add_argument("--hub_files", nargs="+", metavar="PATTERN", help="files by path "
                             "instead of a config, e.g. 'sample/10BT/00[0-2]_*.parquet'")
    hub_options.add_argument("--hub_revision", metavar="REV", help="a branch, tag or commit")
    args = parser.parse_args(argv)
    if bool(args.inputs) == bool(args.hub):
        parser.error("give INPUT files or --hub REPO (one of the two)")
    if not args.hub and (args.hub_config or args.hub_files or args.hub_revision):
        parser.error("--hub_config, --hub_files and --hub_revision go with --hub REPO")
    if args.hub_config and args.hub_files:
        parser.error("--hub_config and --hub_files each pick the files: give one of them")
    if not NAME_PATTERN.fullmatch(args.name):
        parser.error(f"--name must be letters, digits, '.', '_' or '-' (it names files); got "
                     f"{args.name!r}")
    for option in ("val_tokens", "shard_tokens"):
        value = getattr(args, option)
        if not 1 <= value <= shards.MAX_TOKENS:
            parser.error(f"--{option} must be between 1 and {shards.MAX_TOKENS:,}; got {value}")
    if not 1 <= args.workers <= most:
        parser.error(f"--workers must be between 1 and {most} ({WORKERS_PER_CORE} per core: more "
                     f"workers than cores add processes, not speed); got {args.workers}")
    args.out = args.out or HERE / args.name
    return args


def main(argv=None, encoding=None):
    """The command line; returns the exit status. `encoding`: a tiktoken Encoding in place of
    GPT-2's (tests use a tiny one)."""
    args = parse_args(argv)

    def stop(signum, frame):
        raise Interrupted(signum)

    handlers = {signum: signal.signal(signum, stop) for signum in (signal.SIGTERM, signal.SIGHUP)}
    try:
        if args.hub:
            selection = (args.hub, args.hub_config, args.hub_split, args.hub_files,
                         args.hub_revision)
            inputs = [Input(f"{args.hub}:{name}", f"{args.hub}:{name}", stamp, fetch=fetch)
                      for name, stamp, fetch in hub.dataset_files(*selection)]
        else:
            inputs = local_inputs(args.inputs, args.out)
        if any(item.kind == "parquet" for item in inputs):
            import_pyarrow()
        encoding = encoding or gpt2_encoding(args.tokenizer)
        began = time.perf_counter()
        manifest, made = convert(inputs, args.out, args.name, encoding, args.workers,
                                 args.val_tokens, args.shard_tokens, args.text_field)
    except (UserError, shards.LayoutError, TokenizerError, hub.HubError, files.UnusableFolder) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except files.FileProblem as e:
        # in the output folder: the inputs' are InputErrors
        print(f"error: {e}: move it away, or pick another --out", file=sys.stderr)
        return 1
    except workers.WorkerError as e:
        print(f"error: {e} (out of memory?): the finished shards are kept; rerun with fewer "
              f"--workers (this run had {args.workers}) to go on", file=sys.stderr)
        return 1
    except OSError as e:
        # writing the shards: a full disk, say
        print(f"error: cannot write to {args.out} ({e.strerror or e}); the finished shards are "
              "kept: free some space and rerun the same command to go on", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Interrupted):
        if swap_pending(args.out):
            kept = (f"it was putting new shards in place of the old ones in {args.out}: rerun the "
                    "same command to finish that (until then the folder may hold some of each)")
        else:
            kept = f"the finished shards in {args.out} are kept; rerun the same command to go on"
        print(f"\ninterrupted: {kept}", file=sys.stderr)
        return 130
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    print(summary(args.out, manifest, made, time.perf_counter() - began, args.workers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
