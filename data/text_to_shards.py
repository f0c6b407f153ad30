#!/usr/bin/env python3
"""Turn your own text into the token shards train_gpt.py reads: GPT-2's BPE (tiktoken), on every
core.

Usage (works from any directory):

    python data/text_to_shards.py books/*.txt --out data/books --name books
    python data/text_to_shards.py a.jsonl b.jsonl.gz c.parquet --out data/mine --name mine
    python data/text_to_shards.py --hub HuggingFaceFW/fineweb-edu --hub_config sample-10BT \
        --name edu
    python train_gpt.py --train_files 'data/mine/mine_train_*.bin' \
        --val_files 'data/mine/mine_val_*.bin'

Inputs, read in the order given, each file's documents in file order:
- a text file is one document, its exact text (no newline translation); a gzipped one (`.txt.gz`)
  too;
- `.jsonl`, `.ndjson`, `.json` (and `.gz` of each): JSON Lines, one document per line, in its
  "text" field (--text_field picks another); blank lines are skipped;
- `.parquet`: one document per row, in its "text" column (needs pyarrow, imported only for
  Parquet);
- a folder: the files under it, sorted by path, hidden ones left out;
- or, instead of files, a dataset on the Hugging Face hub: --hub REPO with --hub_config NAME (a
  config of its dataset card, e.g. FineWeb-Edu's sample-10BT) or --hub_files PATTERN... (paths in
  the repository, `*` within one folder, `**` across folders). Files come through huggingface_hub
  into its cache (HF_HOME, HF_TOKEN and HF_ENDPOINT apply as usual), the next one downloading while
  this one is tokenized.
Inputs are regular files: a pipe (`<(zcat ...)`, /dev/stdin from a pipe) or a device is refused,
since a rerun could neither read it again nor tell whether it changed.

Output, in --out (default: data/NAME/ beside this script), the format train_gpt.py reads (see
shards.py): a header of 256 little-endian int32 (20240520, 1, token count), then the tokens as
uint16. Every document is led by <|endoftext|> (50256) and encoded with encode_ordinary, so text
that looks like <|endoftext|> is never the special token. Documents are never split:
NAME_val_000000.bin takes whole documents until it holds at least --val_tokens, then
NAME_train_000001.bin, ... hold at most --shard_tokens each. A document longer than --shard_tokens
is an error (splitting it would cut a document in two). So that no train shard is too small to
hold a batch, a last train shard under half --shard_tokens is evened out with the one before it, at
a document boundary. text_to_shards.json records the inputs and options.

How it works, and why:
- Streaming: the main process reads documents lazily and hands them out in chunks of about 256 KB
  to --workers processes (default: every core), which decode, parse and tokenize them; results are
  taken back in input order, at most 4 chunks per worker in flight, so memory stays bounded
  whatever the corpus size (a document is held whole), and the bytes written are the same for any
  worker count. A worker that dies (the out-of-memory killer) ends the run at once, in one line;
  workers never outlive the main process.
- A shard is written under a hidden temporary name (naming the host and process) and renamed into
  place (os.replace) only once whole, so a shard name only ever holds a complete shard; Ctrl-C
  keeps the shards already finished.
- Rerunning the same command after an interruption keeps the finished shards (when no input has
  changed since: size, modification and change time) and goes on from the first document after them,
  giving the same files as one run. When an input changed since a finished dataset was made, the
  new one is made beside it (in .text_to_shards.next/) and takes its place only once complete, so
  an error or an interruption leaves the old one as it was. A folder holding other shards (another
  NAME, another dataset's inputs or options, or shards this script did not write) is refused
  rather than mixed.
- One run at a time writes a folder: it holds the folder's lock and records itself in
  .text_to_shards.owner; a rerun after a run that was killed takes its lock over, and says so.
- Bad input (an empty or unreadable file, text that is not UTF-8, invalid JSON or a line without
  the field, an id that does not fit 16 bits, a file that changes while it is read) stops the run
  with one `error:` line naming the file and line.
- Exit status: 0 done; 1 an error, said in one line; 2 a bad command line; 130 interrupted.
"""

import argparse
import array
import collections
import contextlib
import ctypes
import dataclasses
import fcntl
import gzip
import hashlib
import json
import multiprocessing
import multiprocessing.connection
import os
import queue
import re
import shutil
import signal
import socket
import stat
import sys
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import hub_errors
import numpy as np
import shards
from gpt2_tokenizer import EOT
from gpt2_tokenizer import TokenizerError
from gpt2_tokenizer import gpt2_encoding

HERE = Path(__file__).resolve().parent
HEADER_BYTES = shards.HEADER_BYTES
MAX_SHARD_TOKENS = shards.MAX_TOKENS
# The trainer's default --val_tokens (10,485,760), plus the 2 tokens its loader reads beyond them
DEFAULT_VAL_TOKENS = 10_485_762
# as FineWeb's shards
DEFAULT_SHARD_TOKENS = 100_000_000
# text per task: ~30 ms of one core's work, so handing it out costs under 1%
CHUNK_BYTES = 1 << 18
IN_FLIGHT_PER_WORKER = 4
MANIFEST = "text_to_shards.json"
# who holds the output folder's lock; removed when the run ends
OWNER = ".text_to_shards.owner"
# where a dataset whose inputs changed is made anew, the old one kept until the new one is complete
STAGING = ".text_to_shards.next"
# the descriptors holding folder locks, which a forked worker process closes
LOCKS = []
# the version the Parquet path was tested with; README says the same
PYARROW = "pyarrow==26.0.1"
JSON_SUFFIXES = (".jsonl", ".ndjson", ".json")
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class InputError(Exception):
    """Bad input: the message names the file and, where one applies, the line."""


class FolderError(Exception):
    """The output folder cannot be used as asked: the message says what to do."""


# Inputs ------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Input:
    # what error lines call it: the path as given, or REPO:PATH on the hub
    label: str
    # what the manifest records: the absolute path, or REPO:PATH
    key: str
    # changes when the content does: [size, mtime_ns], or the hub's [size, sha256]
    stamp: list
    # the local file; for the hub, known once downloaded
    path: Path | None = None
    # for the hub: downloads it, returns the local path
    fetch: Callable[[], Path] | None = None

    @property
    def kind(self):
        """'parquet', 'jsonl' or 'text', from the name."""
        name = self.label.lower().removesuffix(".gz")
        if name.endswith(".parquet"):
            return "parquet"
        return "jsonl" if name.endswith(JSON_SUFFIXES) else "text"

    @property
    def gzipped(self):
        return self.label.lower().endswith(".gz")


def local_inputs(paths, out):
    """Input for each path (a folder: the files under it, sorted), each checked: a regular file,
    readable, not empty."""
    inputs = []
    for given in paths:
        path = Path(given)
        if path.is_dir():
            # hidden files and folders, and the output folder, are not the user's text
            found = sorted(p.relative_to(path).parts for p in path.rglob("*") if listed(p))
            files = [path.joinpath(*parts) for parts in found
                     if not any(part.startswith(".") for part in parts)]
            files = [file for file in files if out.resolve() not in file.resolve().parents]
            if not files:
                raise InputError(f"{given}: an empty folder: no files to read")
        else:
            files = [path]
        for file in files:
            info = regular_file(file)
            try:
                with open(file, "rb") as f:
                    f.read(1)
            except OSError as e:
                raise InputError(f"{file}: cannot read it ({e.strerror})") from None
            if info.st_size == 0:
                raise InputError(f"{file}: empty file: no documents in it; leave it out")
            stamp = [info.st_size, info.st_mtime_ns, info.st_ctime_ns]
            inputs.append(Input(str(file), str(file.resolve()), stamp, file))
    return inputs


def listed(path):
    """Whether a folder's entry is read as an input: files, and what only poses as one (a pipe, a
    device), to be refused; not folders, nor links that lead nowhere."""
    try:
        return not stat.S_ISDIR(path.stat().st_mode)
    except OSError:
        return False


def regular_file(file):
    """The os.stat of `file`, refused in one line unless it is a regular file. Nothing is opened
    first: opening a pipe waits for a writer, a device may never end."""
    try:
        info = os.stat(file)
    except FileNotFoundError:
        raise InputError(f"{file}: no such file") from None
    except OSError as e:
        raise InputError(f"{file}: cannot read it ({e.strerror})") from None
    if stat.S_ISREG(info.st_mode):
        return info
    if stat.S_ISFIFO(info.st_mode) or stat.S_ISSOCK(info.st_mode):
        what = "a pipe" if stat.S_ISFIFO(info.st_mode) else "a socket"
        raise InputError(f"{file}: {what}, not a regular file: its text could be read only once, "
                         "so an interrupted run could not go on, nor a rerun check that it is "
                         "unchanged; save it to a file first (e.g. `zcat in.jsonl.gz > in.jsonl`, "
                         "or pass the .gz file itself)")
    raise InputError(f"{file}: a device or other special file, not a regular file of text; "
                     "pass regular files")


def unchanged(item, info):
    """Raise unless `info` (an os.stat) still matches what the run recorded of a local input."""
    if item.fetch is None and [info.st_size, info.st_mtime_ns, info.st_ctime_ns] != item.stamp:
        raise InputError(f"{item.label}: changed while this run was reading it; rerun the same "
                         "command once it no longer changes")


def read_documents(inputs, text_field, start=(0, 0), on_input=None):
    """Yield (input index, line, kind, payload) for each document from `start` on, lazily: payload
    is the raw bytes of a text file or of a JSON line, or a Parquet cell; line counts from 1 (rows,
    for Parquet)."""
    for index in range(start[0], len(inputs)):
        item = inputs[index]
        if on_input:
            on_input(index)
        if item.path is None:
            item.path = item.fetch()
        first_line = start[1] if index == start[0] else 0
        documents = 0
        if item.kind == "parquet":
            reader = parquet_rows(item, text_field, first_line)
        else:
            reader = file_lines(item, first_line)
        for line, payload in reader:
            documents += 1
            yield index, line, item.kind, payload
        if documents == 0 and first_line == 0:
            empty = {"text": "empty file", "jsonl": "blank lines only", "parquet": "no rows"}
            raise InputError(f"{item.label}: {empty[item.kind]}: no documents in it; leave it out")


def file_lines(item, first_line):
    """(line, bytes) of a text file (one document, line 1) or of each non-blank JSON line; a file
    that changed since the run began is an error."""
    line = 0
    try:
        with open(item.path, "rb") as raw_file:
            unchanged(item, os.fstat(raw_file.fileno()))
            f = gzip.open(raw_file, "rb") if item.gzipped else raw_file
            if item.kind == "text":
                text = f.read()
                unchanged(item, os.fstat(raw_file.fileno()))
                # (an empty one is told by read_documents)
                if text:
                    yield 1, text
                return
            for line, raw in enumerate(f, 1):
                # a byte-order mark, not JSON
                if line == 1 and raw.startswith(b"\xef\xbb\xbf"):
                    raw = raw[3:]
                if line >= first_line and raw.strip():
                    yield line, raw
            unchanged(item, os.fstat(raw_file.fileno()))
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        where = f"line {line + 1}: " if item.kind == "jsonl" and line else ""
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


def parquet_rows(item, text_field, first_row):
    """(row, str or None) of the text column, a batch of rows at a time."""
    pyarrow, parquet = import_pyarrow()
    row = 0
    try:
        unchanged(item, os.stat(item.path))
        table = parquet.ParquetFile(item.path)
        names = table.schema_arrow.names
        if text_field not in names:
            columns = ", ".join(names[:8])
            raise InputError(f"{item.label}: no column {text_field!r} (it has {columns}); "
                             "name the text column with --text_field")
        column_type = table.schema_arrow.field(text_field).type
        is_view = getattr(pyarrow.types, "is_string_view", lambda _: False)
        if not (pyarrow.types.is_string(column_type) or pyarrow.types.is_large_string(column_type)
                or is_view(column_type)):
            raise InputError(f"{item.label}: column {text_field!r} holds {column_type}, not text; "
                             "name the text column with --text_field")
        for batch in table.iter_batches(batch_size=1024, columns=[text_field]):
            values = batch.column(0).to_pylist()
            for value in values:
                row += 1
                if row >= first_row:
                    yield row, value
        unchanged(item, os.stat(item.path))
    except (pyarrow.ArrowException, OSError) as e:
        message = f"{item.label}: not a readable Parquet file ({e}); fetch it again"
        raise InputError(message) from None


# Hub ---------------------------------------------------------------------------------------------
def glob_regex(pattern):
    """A path pattern as the hub's dataset configs write them: `*` within one folder, `**` across
    folders, `?` one character, `[0-2]` or `[!a]` one of a set."""
    parts = re.split(r"(\*\*/?|\*|\?|\[!?[^]]+\])", pattern)
    wild = {"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}
    regex = ""
    for part in parts:
        if part.startswith("[") and part.endswith("]") and len(part) > 2:
            regex += "[^" + part[2:] if part.startswith("[!") else part
        else:
            regex += wild.get(part, re.escape(part))
    return re.compile(regex)


def hub_patterns(repo, readme, config, split):
    """The data-file patterns of `config` (its split) in the dataset card at `readme`."""
    from huggingface_hub.repocard import metadata_load

    configs = (metadata_load(readme) or {}).get("configs") or []
    names = [c.get("config_name") for c in configs]
    if config is None:
        chosen = [c for c in configs if c.get("default")]
        chosen = chosen or [c for c in configs if c.get("config_name") == "default"]
    else:
        chosen = [c for c in configs if c.get("config_name") == config]
    if not chosen:
        listed = ", ".join(map(str, names[:12]))
        if len(names) > 12:
            listed += f" and {len(names) - 12} more"
        known = f"its configs: {listed}" if names else "its card names no configs"
        asked = f"no config {config!r}" if config else "no default config"
        raise InputError(f"{repo}: {asked} ({known}); pass --hub_config NAME, or "
                         "--hub_files PATTERN")
    data_files = chosen[0].get("data_files")
    if isinstance(data_files, str):
        data_files = [data_files]
    if data_files and isinstance(data_files[0], dict):
        by_split = {d.get("split"): d.get("path") for d in data_files}
        if split not in by_split:
            splits = ", ".join(map(str, by_split))
            raise InputError(f"{repo}: config {chosen[0].get('config_name')!r} has no split "
                             f"{split!r} (it has {splits}); pass --hub_split")
        data_files = by_split[split]
        data_files = [data_files] if isinstance(data_files, str) else data_files
    if not data_files:
        raise InputError(f"{repo}: config {chosen[0].get('config_name')!r} names no data files; "
                         "pass --hub_files PATTERN")
    return data_files


def hub_error(exc, repo):
    """One line for a failure inside the hub client: the first cause in the chain that we know."""
    from huggingface_hub import constants

    hub = constants.ENDPOINT
    what, cause, status = hub_errors.first_known_cause(exc)
    if what == hub_errors.DENIED:
        return (f"{hub} refused access to {repo} (HTTP {status}): set HF_TOKEN to a token that can "
                "read it")
    if what == hub_errors.NOT_FOUND_REPO:
        return f"the dataset {repo} was not found on {hub} (if it is private, set HF_TOKEN)"
    if what == hub_errors.NOT_FOUND_FILE:
        return f"{repo}: a file is missing on {hub} ({cause}); rerun to list the files again"
    if what == hub_errors.OFFLINE:
        return (f"HF_HUB_OFFLINE is set, so {repo} cannot be listed or downloaded; unset it, "
                "or pass files")
    if what == hub_errors.HTTP_STATUS:
        return f"{hub} answered HTTP {status} about {repo}; rerun the same command to go on"
    if what == hub_errors.UNREACHABLE:
        return (f"cannot reach the hub at {hub} ({type(cause).__name__}): check the network; "
                "HF_ENDPOINT picks a mirror")
    return f"{repo}: {hub_errors.first_line(exc)}"


def hub_inputs(repo, config, split, patterns, revision):
    """Input for each of the dataset's files that `patterns` (or `config`'s) select, in pattern,
    then path order; each downloads when first read, the next one in the background meanwhile."""
    from huggingface_hub import HfApi
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import disable_progress_bars

    # the tokenizing bar says what is downloading
    disable_progress_bars()
    try:
        info = HfApi().dataset_info(repo, revision=revision, files_metadata=True)
        files = {s.rfilename: s for s in info.siblings}
        if not patterns:
            readme = hf_hub_download(repo, "README.md", repo_type="dataset", revision=info.sha)
            patterns = hub_patterns(repo, readme, config, split)
    except InputError:
        raise
    except Exception as e:  # noqa: BLE001 - the client's many errors, told in one line
        raise InputError(hub_error(e, repo)) from None
    selected = []
    for pattern in patterns:
        matched = sorted(name for name in files if glob_regex(pattern).fullmatch(name))
        if not matched:
            raise InputError(f"{repo}: no file matches {pattern!r} (at commit {info.sha[:12]})")
        selected += [name for name in matched if name not in selected]
    # index: (thread, result); daemon threads, so that Ctrl-C need not wait for a download
    downloads = {}

    def download(i):
        if i < len(selected) and i not in downloads:
            result = {}

            def get():
                # one at a time, in order: the file needed first arrives first
                if i - 1 in downloads:
                    downloads[i - 1][0].join()
                try:
                    result["path"] = hf_hub_download(repo, selected[i], repo_type="dataset",
                                                     revision=info.sha)
                except Exception as e:  # noqa: BLE001 - told in one line by fetch
                    result["error"] = e

            downloads[i] = threading.Thread(target=get, daemon=True), result
            downloads[i][0].start()

    def fetcher(i):
        def fetch():
            download(i)
            # while this one is read
            download(i + 1)
            thread, result = downloads[i]
            thread.join()
            if "error" in result:
                raise InputError(f"{repo}:{selected[i]}: {hub_error(result['error'], repo)}")
            return Path(result["path"])
        return fetch

    inputs = []
    for i, name in enumerate(selected):
        lfs = getattr(files[name], "lfs", None)
        stamp = [files[name].size, lfs.sha256 if lfs else files[name].blob_id]
        inputs.append(Input(f"{repo}:{name}", f"{repo}:{name}", stamp, fetch=fetcher(i)))
    return inputs


# Tokenizing (in the worker processes) ------------------------------------------------------------
# each worker's encoding, set by use_encoding
ENCODING = None


def use_encoding(encoding):
    """Make `encoding` the one encode_chunk uses in this process."""
    global ENCODING
    ENCODING = encoding


def utf8_problem(raw, error):
    """Where `raw` stops being UTF-8: its line and column, and the byte."""
    line = raw.count(b"\n", 0, error.start) + 1
    column = error.start - (raw.rfind(b"\n", 0, error.start) + 1) + 1
    byte = raw[error.start]
    return line, f"not UTF-8 (byte 0x{byte:02x} at column {column}); convert the file to UTF-8"


def document_text(kind, payload, text_field):
    """The text of one document, or (line within the file or None, message) for a bad one."""
    if kind == "parquet":
        if not isinstance(payload, str):
            return None, f"the {text_field!r} column is empty (null), not text"
        return payload
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError as e:
        line, message = utf8_problem(payload, e)
        return (line if kind == "text" else None), message
    if kind == "text":
        return text
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        return None, (f"not valid JSON ({e.msg} at column {e.colno}); each line must be one JSON "
                      "object")
    if not isinstance(record, dict):
        return None, f"a JSON {type(record).__name__}, not an object with a {text_field!r} field"
    if text_field not in record:
        fields = ", ".join(map(repr, list(record)[:8])) or "none"
        return None, (f"no {text_field!r} field (fields: {fields}); name the text field with "
                      "--text_field")
    if not isinstance(record[text_field], str):
        value = json.dumps(record[text_field])[:40]
        return None, f"the {text_field!r} field is {value}, not a string"
    return record[text_field]


def encode_chunk(documents, text_field):
    """Tokens of a list of (kind, payload) documents, each led by EOT, as ("ok", uint16 array,
    lengths), or ("error", index in the list, line or None, message) for the first bad one."""
    tokens = []
    lengths = []
    for i, (kind, payload) in enumerate(documents):
        text = document_text(kind, payload, text_field)
        if isinstance(text, tuple):
            return ("error", i, *text)
        ids = ENCODING.encode_ordinary(text)
        tokens.append(EOT)
        tokens.extend(ids)
        lengths.append(len(ids) + 1)
    try:
        return "ok", np.array(tokens, dtype="<u2"), lengths
    except OverflowError:
        # a token id of 2 ** 16 or more: find its document
        ends = np.cumsum(lengths)
        at = next(i for i, token in enumerate(tokens) if token >= 2 ** 16)
        doc = int(np.searchsorted(ends, at, side="right"))
        message = f"token id {tokens[at]} does not fit the shards' 16 bits: not GPT-2's"
        return "error", doc, None, message


def chunked(documents):
    """Lists of documents of about CHUNK_BYTES of text each."""
    chunk = []
    size = 0
    for document in documents:
        chunk.append(document)
        size += len(document[3]) if document[3] is not None else 0
        if size >= CHUNK_BYTES:
            yield chunk
            chunk = []
            size = 0
    if chunk:
        yield chunk


def encoded(chunks, encoding, workers, text_field):
    """(chunk, result of encode_chunk) in input order: in this process for one worker, else on
    worker processes with a bounded number of chunks in flight. A read error comes after the chunks
    before it."""
    if workers == 1:
        use_encoding(encoding)
        for chunk in chunks:
            documents = [(kind, payload) for _, _, kind, payload in chunk]
            yield chunk, encode_chunk(documents, text_field)
        return
    pending = collections.deque()
    read_error = None
    with Workers(workers, encoding, text_field) as pool:
        sent = 0
        try:
            for chunk in chunks:
                documents = [(kind, payload) for _, _, kind, payload in chunk]
                pool.send(sent % workers, documents)
                pending.append((chunk, sent % workers))
                sent += 1
                if len(pending) >= IN_FLIGHT_PER_WORKER * workers:
                    chunk, worker = pending.popleft()
                    yield chunk, pool.receive(worker)
        except InputError as e:
            read_error = e
        while pending:
            chunk, worker = pending.popleft()
            yield chunk, pool.receive(worker)
    if read_error:
        raise read_error


class WorkerError(Exception):
    """A tokenizing process died or failed: the message says which, how, and what to try."""


class Workers:
    """Tokenizing processes, each fed chunks through a pipe of its own, round robin, and answering
    through another, in order.

    A worker never outlives this process: on Linux the kernel kills it when its parent dies
    (PR_SET_PDEATHSIG); everywhere, it stops when its pipe from the parent closes, which the
    parent's death does. A worker that dies is noticed at once (its answer pipe closes), and leaving
    the `with` block, however it is left, kills what is left of them."""

    def __init__(self, count, encoding, text_field):
        self.count = count
        self.processes = []
        self.tasks = []
        self.answers = []
        # Linux: fork, quick to start and nothing to pickle; elsewhere, the platform's default
        if sys.platform.startswith("linux"):
            context = multiprocessing.get_context("fork")
        else:
            context = multiprocessing.get_context()
        forked = context.get_start_method() == "fork"
        try:
            for _ in range(count):
                task_reader, task_writer = context.Pipe(duplex=False)
                answer_reader, answer_writer = context.Pipe(duplex=False)
                # a forked worker holds copies of the parent's pipe ends, the earlier workers' and
                # its own: it closes them, or its task pipe would never close when the parent's end
                # does, and stop() would wait out its 5 s for every worker
                own = [task_writer, answer_reader]
                inherited = self.tasks + self.answers + own if forked else None
                arguments = (task_reader, answer_writer, inherited, os.getpid(), encoding,
                             text_field)
                process = context.Process(target=work, args=arguments, daemon=True)
                process.start()
                task_reader.close()
                answer_writer.close()
                self.processes.append(process)
                self.tasks.append(task_writer)
                self.answers.append(answer_reader)
        except BaseException:
            self.stop()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exception):
        self.stop(gracefully=exception[0] is None)

    def send(self, worker, documents):
        try:
            self.tasks[worker].send(documents)
        except OSError:
            raise WorkerError(self.death(worker)) from None

    def receive(self, worker):
        """The next answer of `worker`: encode_chunk's result."""
        try:
            answer = self.answers[worker].recv()
        except (EOFError, OSError):
            raise WorkerError(self.death(worker)) from None
        if answer[0] == "failed":
            raise WorkerError(f"a tokenizing worker failed ({answer[1]}){self.advice()}")
        return answer

    def death(self, worker):
        """One line: which worker died, how, and what to try."""
        process = self.processes[worker]
        process.join(timeout=5)
        if process.exitcode is not None and process.exitcode < 0:
            how = f"was killed by {signal.Signals(-process.exitcode).name}"
        elif process.exitcode is not None:
            how = f"exited with status {process.exitcode}"
        else:
            how = "stopped answering"
        return f"a tokenizing worker (pid {process.pid}) {how}{self.advice()}"

    def advice(self):
        return (f" (out of memory?): the finished shards are kept; rerun with fewer --workers "
                f"(this run had {self.count}) to go on")

    def stop(self, gracefully=False):
        """End every worker: let them finish their pipes when all went well, else kill them now."""
        for connection in self.tasks:
            connection.close()
        if gracefully:
            for process in self.processes:
                process.join(timeout=5)
        for process in self.processes:
            if process.is_alive():
                process.kill()
        for process in self.processes:
            process.join(timeout=5)
        for connection in self.answers:
            connection.close()


def work(tasks, answers, inherited, parent, encoding, text_field):
    """A worker process: encode the chunks that come through `tasks`, answer through `answers`,
    until `tasks` closes or the parent is gone."""
    for connection in inherited or []:
        connection.close()
    if inherited is not None:
        for descriptor in LOCKS:
            os.close(descriptor)
    # Ctrl-C and a closed terminal reach the whole process group: the parent alone handles them
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    # a stop signal sent to this process alone kills it (the parent then says so)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    die_with_parent(parent)
    use_encoding(encoding)
    # the pipe from the parent is read at once, so the parent never waits on a send while this
    # process waits for the parent to take its answer
    received = queue.Queue()
    threading.Thread(target=read_tasks, args=(tasks, received), daemon=True).start()
    while (documents := received.get()) is not None:
        try:
            answer = encode_chunk(documents, text_field)
        except Exception as e:  # noqa: BLE001 - MemoryError, say: told to the parent in one line
            answer = ("failed", f"{type(e).__name__}: {e}")
        try:
            answers.send(answer)
        except OSError:
            break
    os._exit(0)


def read_tasks(tasks, received):
    """Move what comes through `tasks` into `received`; None once the pipe closes."""
    try:
        while True:
            received.put(tasks.recv())
    except (EOFError, OSError):
        received.put(None)


def die_with_parent(parent):
    """Have the kernel kill this process when its parent dies (Linux); exit now if it is gone."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            # PR_SET_PDEATHSIG
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:
        os._exit(1)


# Shards ------------------------------------------------------------------------------------------
def shard_name(name, index):
    return f"{name}_val_{index:06d}.bin" if index == 0 else f"{name}_train_{index:06d}.bin"


class Shard:
    """A shard being written: tokens appended to a hidden temporary file, renamed into place when
    whole."""

    def __init__(self, folder, name, index):
        self.index = index
        self.name = shard_name(name, index)
        self.temp = temp_path(folder / self.name)
        self.file = open(self.temp, "wb")
        # the header is written once the count is known
        self.file.write(bytes(HEADER_BYTES))
        self.tokens = 0
        # each document's token count and position (input index, line), compactly: a shard may
        # hold millions
        self.lengths = array.array("q")
        self.inputs = array.array("q")
        self.lines = array.array("q")
        # the position of the document after the last one here
        self.end = None

    def append(self, tokens, where):
        self.file.write(tokens)
        self.tokens += len(tokens)
        self.lengths.append(len(tokens))
        self.inputs.append(where[0])
        self.lines.append(where[1])

    def close(self):
        if self.tokens > MAX_SHARD_TOKENS:
            raise InputError(f"{self.name} would hold {self.tokens:,} tokens, more than a shard's "
                             f"header can count ({MAX_SHARD_TOKENS:,}): lower --val_tokens")
        self.file.seek(0)
        self.file.write(shards.header(self.tokens))
        self.file.flush()
        # on disk before the rename makes it visible
        os.fsync(self.file.fileno())
        self.file.close()

    def read_into(self, tokens):
        with open(self.temp, "rb") as f:
            f.seek(HEADER_BYTES)
            f.readinto(tokens)

    def rewrite(self, tokens, lengths, inputs, lines, end):
        """Hold these documents instead (used once, to even out the last two shards)."""
        self.file = open(self.temp, "wb")
        self.file.write(bytes(HEADER_BYTES))
        self.file.write(tokens)
        self.tokens = len(tokens)
        self.end = end
        self.lengths = lengths
        self.inputs = inputs
        self.lines = lines
        self.close()

    def discard(self):
        self.file.close()
        self.temp.unlink(missing_ok=True)


def even_split(lengths, limit):
    """How many of these documents go to the first of two shards so that the smaller holds the most,
    each holding at most `limit` tokens (the split they came in is one such)."""
    # the first shard's tokens when split after 1, 2, ... documents
    first = np.cumsum(lengths)[:-1]
    second = first[-1] + lengths[-1] - first
    smaller = np.where((first <= limit) & (second <= limit), np.minimum(first, second), -1)
    return int(np.argmax(smaller)) + 1


class ShardWriter:
    """Documents in, shards out: the val shard until it holds val_tokens, then train shards of at
    most shard_tokens. A finished train shard is held back (whole, under its temporary name) until
    the one after it holds half a shard, so that a short last shard can still be evened out with it.
    """

    def __init__(self, folder, name, val_tokens, shard_tokens, place, publish, first_index=0):
        self.folder = folder
        self.name = name
        self.val_tokens = val_tokens
        self.shard_tokens = shard_tokens
        # place(where): "FILE: line N", for errors
        self.place = place
        # publish(shard): called once it is renamed into place
        self.publish = publish
        self.next_index = first_index
        self.current = self.held = None
        # shards with a temporary file, for discard
        self.unrenamed = set()

    def add(self, tokens, where):
        """One document's tokens (EOT first), found at `where` (input index, line)."""
        current = self.current
        if current is None:
            for_val = self.next_index == 0
        else:
            for_val = current.index == 0 and current.tokens < self.val_tokens
        if not for_val and len(tokens) > self.shard_tokens:
            raise InputError(f"{self.place(where)}: a document of {len(tokens):,} tokens, more "
                             f"than --shard_tokens {self.shard_tokens:,}: documents are never "
                             "split; raise it")
        if current is None:
            self.open()
        elif current.index == 0 and not for_val:
            self.finish_current(where)
            self.open()
        elif current.index > 0 and current.tokens + len(tokens) > self.shard_tokens:
            self.finish_current(where)
            self.open()
        self.current.append(tokens, where)
        # now the last shard cannot be short
        if self.held and self.current.tokens >= self.shard_tokens / 2:
            self.rename(self.held)
            self.held = None

    def open(self):
        self.current = Shard(self.folder, self.name, self.next_index)
        self.unrenamed.add(self.current)
        self.next_index += 1

    def finish_current(self, end):
        shard = self.current
        self.current = None
        shard.end = end
        shard.close()
        if self.held:
            self.rename(self.held)
            self.held = None
        if shard.index == 0:
            self.rename(shard)
        else:
            self.held = shard

    def finish(self, end):
        """At the end of the inputs: even out a short last train shard with the one before; rename
        them."""
        last = self.current
        self.current = None
        # resumed after the last shard: nothing was left
        if last is None and self.next_index > 1:
            return
        if last is None or last.index == 0:
            total = 0 if last is None else last.tokens
            raise InputError(f"the inputs hold {total:,} tokens, all for the val shard "
                             f"(--val_tokens {self.val_tokens:,}), none left to train on: lower "
                             "--val_tokens, or add text")
        last.end = end
        last.close()
        held = self.held
        self.held = None
        # so the last shard holds under half a shard
        if held is not None:
            lengths = held.lengths + last.lengths
            inputs = held.inputs + last.inputs
            lines = held.lines + last.lines
            split = even_split(lengths, self.shard_tokens)
            # under 1.5 shards, once at the end
            tokens = np.empty(held.tokens + last.tokens, dtype="<u2")
            held.read_into(tokens[:held.tokens])
            last.read_into(tokens[held.tokens:])
            cut = sum(lengths[:split])
            held_end = inputs[split], lines[split]
            held.rewrite(tokens[:cut], lengths[:split], inputs[:split], lines[:split], held_end)
            last.rewrite(tokens[cut:], lengths[split:], inputs[split:], lines[split:], end)
            self.rename(held)
        self.rename(last)

    def rename(self, shard):
        os.replace(shard.temp, self.folder / shard.name)
        self.unrenamed.discard(shard)
        self.publish(shard)

    def discard(self):
        """Delete the temporary files (after an error or an interruption)."""
        for shard in self.unrenamed:
            shard.discard()


# The output folder -------------------------------------------------------------------------------
def encoding_fingerprint(encoding):
    """What the manifest records of the encoding: its name and a hash of every token's bytes and id.
    """
    digest = hashlib.sha256()
    for token in sorted(encoding.token_byte_values()):
        token_id = encoding.encode_single_token(token)
        digest.update(len(token).to_bytes(4, "little") + token + token_id.to_bytes(4, "little"))
    for special in sorted(encoding.special_tokens_set):
        special_id = encoding.encode_single_token(special)
        digest.update(special.encode() + special_id.to_bytes(4, "little"))
    return f"{encoding.name} {digest.hexdigest()[:16]}"


def temp_path(path):
    """A hidden name beside `path` for its content until whole, naming this host and process, so
    that no two runs (on one machine or sharing a folder) ever write one file."""
    return path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")


def write_json(path, record):
    temp = temp_path(path)
    temp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(temp, path)


def plan(out, identity, stamps, disposable=False):
    """What the folder holds for this dataset: (the recorded shards that can be kept, in order,
    whether the whole dataset is there, whether its inputs changed since). Refuses a folder holding
    other shards, unless `disposable` (the folder where a changed dataset is made anew): there,
    whatever does not match is deleted."""
    present = our_shards(out, identity["name"], *sorted(p.name for p in out.glob("*.bin")))
    if disposable:
        recorded = read_manifest(out)
        if recorded is None or any(recorded.get(key) != identity[key] for key in identity):
            delete(out, present)
            return [], False, False
        manifest = recorded
    else:
        manifest = recorded_manifest(out, identity, present)
        if manifest is None:
            return [], False, False
    if not same_stamps(manifest.get("stamps"), stamps):
        # a finished dataset is kept until the new one is: made beside it
        if present and not disposable and manifest.get("complete"):
            return [], False, True
        delete(out, present)
        return [], False, False
    kept = []
    for shard in manifest.get("shards", []):
        if shards.token_count(out / shard["file"]) != shard["tokens"]:
            break
        kept.append(shard)
    complete = manifest.get("complete") and len(kept) == len(manifest["shards"])
    return kept, complete, False


def same_stamps(recorded, stamps):
    """Whether no input changed since `recorded` (a manifest's stamps) was taken. A local file's
    stamp is [size, mtime, ctime]: a change of content that keeps size and modification time (set
    back on purpose) still moves the ctime. Older manifests recorded [size, mtime] only."""
    if not isinstance(recorded, list) or len(recorded) != len(stamps):
        return False
    pairs = zip(recorded, stamps)
    return all(isinstance(old, list) and old == new[:len(old)] for old, new in pairs)


def recorded_manifest(out, identity, present):
    """The manifest in `out` when it records this dataset, None when there is nothing to keep;
    refuses a folder holding other shards."""
    every = sorted(p.name for p in out.glob("*.bin"))
    foreign = [file for file in every if file not in present]
    remedy = "pass another --out (a folder holds one dataset's shards)"
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise FolderError(f"{out} holds shards of another dataset ({foreign[0]}{more}): {remedy}")
    try:
        manifest = json.loads((out / MANIFEST).read_text())
        recorded = {key: manifest[key] for key in identity}
    except FileNotFoundError:
        if present:
            raise FolderError(f"{out} holds {present[0]}, which this script did not write (no "
                              f"{MANIFEST} there): {remedy}, or move the shards away") from None
        return None
    except (OSError, ValueError, KeyError, TypeError):
        # no shard to keep: the record of a run that stopped before its first shard
        if not present:
            return None
        message = f"{out / MANIFEST} is not the record this script writes: {remedy}"
        raise FolderError(message) from None
    if recorded != identity and present:
        differs = []
        if recorded["name"] != identity["name"]:
            differs.append(f"the name {recorded['name']!r}")
        if recorded["inputs"] != identity["inputs"]:
            differs.append("other inputs")
        for option in identity["options"]:
            if recorded["options"].get(option) != identity["options"][option]:
                differs.append(f"--{option} {recorded['options'].get(option)}")
        raise FolderError(f"{out} holds shards made with {', '.join(differs)} (see {MANIFEST}): "
                          f"{remedy}, or delete that folder to make it again")
    if recorded != identity:
        return None
    return manifest


def read_manifest(folder):
    """The manifest in `folder`, or None where there is none or it cannot be read."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def delete(folder, files):
    for file in files:
        (folder / file).unlink()


def our_shards(out, name, *files):
    """Of `files` (default: the folder's), the names of this dataset's shards, sorted."""
    ours = re.compile(rf"{re.escape(name)}_(val_000000|train_\d{{6}})\.bin")
    files = files or [path.name for path in out.glob("*.bin")]
    return sorted(file for file in files if ours.fullmatch(file))


def remove_debris(folder, name):
    """Delete the temporary files of runs that were killed (the lock says none is running)."""
    ours = rf"{re.escape(name)}_(val_000000|train_\d{{6}})\.bin|{re.escape(MANIFEST)}|{OWNER}"
    debris = re.compile(rf"\.({ours})(\..+)?\.tmp")
    for path in folder.glob(".*.tmp"):
        if debris.fullmatch(path.name):
            path.unlink()


def swap(out, staging, manifest):
    """Put the complete dataset made in `staging` in place of the one in `out`; done again after an
    interruption, it finishes what was left."""
    for shard in manifest["shards"]:
        if (staging / shard["file"]).exists():
            os.replace(staging / shard["file"], out / shard["file"])
    written = {shard["file"] for shard in manifest["shards"]}
    delete(out, sorted(set(our_shards(out, manifest["name"])) - written))
    write_json(out / MANIFEST, manifest)
    shutil.rmtree(staging)


def lock(out):
    """Two runs must not write one folder: take its lock, and record this run as its owner. The
    descriptor stays open: the lock ends with the process (worker processes close their copy)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(out, os.O_RDONLY)
    except OSError as e:
        raise FolderError(unusable(out, e)) from None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        owner = read_owner(out)
        if owner is None:
            raise FolderError(f"another run is writing to {out}; wait for it to finish") from None
        if owner_is_gone(out):
            raise FolderError(f"the run that was writing to {out} ({owner}) is gone, but processes "
                              "it started still hold the folder's lock: stop them (e.g. `fuser -k "
                              f"{out}`), then rerun") from None
        raise FolderError(f"another run ({owner}) is writing to {out}; wait for it to finish, "
                          "or stop it") from None
    except OSError as e:
        os.close(descriptor)
        raise FolderError(unusable(out, e)) from None
    LOCKS.append(descriptor)
    owner = read_owner(out)
    if owner is not None:
        print(f"the run that was writing to {out} ({owner}) is gone: taking over its lock, going "
              "on from its finished shards", file=sys.stderr)
    try:
        write_json(out / OWNER, {"host": socket.gethostname(), "pid": os.getpid()})
    except OSError as e:
        LOCKS.remove(descriptor)
        os.close(descriptor)
        raise FolderError(unusable(out, e)) from None
    return descriptor


def unusable(out, error):
    return f"cannot use the output folder {out} ({error.strerror}): pick another --out"


def read_owner(out):
    """Who holds (or held, if it ended without letting go) the folder's lock: 'pid N on HOST'."""
    try:
        owner = json.loads((out / OWNER).read_text())
        return f"pid {int(owner['pid'])} on {owner['host']}"
    except (OSError, ValueError, KeyError, TypeError):
        return None


def owner_is_gone(out):
    """Whether the recorded owner of the folder's lock ran on this host and is no longer alive."""
    try:
        owner = json.loads((out / OWNER).read_text())
        if owner["host"] != socket.gethostname():
            return False
        os.kill(int(owner["pid"]), 0)
    except ProcessLookupError:
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return False


def unlock(out, descriptor):
    try:
        (out / OWNER).unlink(missing_ok=True)
    finally:
        LOCKS.remove(descriptor)
        os.close(descriptor)


# The run -----------------------------------------------------------------------------------------
def progress_bar(inputs):
    from tqdm import tqdm

    return tqdm(desc=f"input 1/{len(inputs)}", unit=" docs", file=sys.stderr, smoothing=0.1)


def convert(inputs, out, name, encoding, workers=1, val_tokens=DEFAULT_VAL_TOKENS,
            shard_tokens=DEFAULT_SHARD_TOKENS, text_field="text"):
    """Write the shards of `inputs` into `out`, going on from where an interrupted run stopped;
    return the manifest, and the tokens made in this run (None: all were there already). Raises
    InputError, FolderError or WorkerError for what the user can fix.

    When an input changed since the shards in `out` were made, the new ones are made beside them
    (in STAGING) and put in their place only once complete: until then, and after an error, `out`
    holds the old dataset as it was."""
    options = {"val_tokens": val_tokens, "shard_tokens": shard_tokens, "text_field": text_field,
               "tokenizer": encoding_fingerprint(encoding)}
    identity = {"name": name, "inputs": [item.key for item in inputs], "options": options}
    stamps = [item.stamp for item in inputs]
    descriptor = lock(out)
    staging = out / STAGING
    try:
        remove_debris(out, name)
        if staging.is_dir():
            remove_debris(staging, name)
            staged = read_manifest(staging)
            finished = {**identity, "complete": True}
            matches = staged is not None and same_stamps(staged.get("stamps"), stamps)
            if matches and all(staged.get(key) == finished[key] for key in finished):
                # an interrupted swap
                swap(out, staging, staged)
                return staged, None
        kept, complete, changed = plan(out, identity, stamps)
        folder = out
        if changed:
            print(f"an input changed since the shards in {out} were made: making them again in "
                  f"{staging}; the old ones stay until the new ones are complete", file=sys.stderr)
            staging.mkdir(exist_ok=True)
            folder = staging
            kept, complete, _ = plan(staging, identity, stamps, disposable=True)
        else:
            shutil.rmtree(staging, ignore_errors=True)
        manifest = {**identity, "stamps": stamps, "shards": kept, "complete": complete}
        if complete:
            return manifest, None
        write_json(folder / MANIFEST, manifest)
        try:
            made = run(inputs, folder, manifest, encoding, workers)
        except InputError:
            if folder == staging:
                # the old dataset stays, as it was
                shutil.rmtree(staging, ignore_errors=True)
            raise
        written = {shard["file"] for shard in manifest["shards"]}
        # left by an earlier run with more shards
        delete(folder, sorted(set(our_shards(folder, name)) - written))
        manifest["complete"] = True
        write_json(folder / MANIFEST, manifest)
        if folder == staging:
            swap(out, staging, manifest)
        return manifest, made
    finally:
        unlock(out, descriptor)


def run(inputs, out, manifest, encoding, workers):
    """Tokenize the inputs from the first document after the kept shards, writing shards as they
    fill; return the count of tokens written."""
    options = manifest["options"]
    finished = manifest["shards"]

    def place(where):
        item = inputs[where[0]]
        return f"{item.label}: {'row' if item.kind == 'parquet' else 'line'} {where[1]}"

    def publish(shard):
        finished.append({"file": shard.name, "tokens": shard.tokens,
                         "documents": len(shard.lengths), "end": list(shard.end)})
        write_json(out / MANIFEST, manifest)

    start = tuple(finished[-1]["end"]) if finished else (0, 0)
    writer = ShardWriter(out, manifest["name"], options["val_tokens"], options["shard_tokens"],
                         place, publish, first_index=len(finished))
    bar = progress_bar(inputs)
    began = time.perf_counter()
    tokens_done = 0

    def on_input(index):
        bar.set_description_str(f"input {index + 1}/{len(inputs)}", refresh=False)

    try:
        documents = read_documents(inputs, options["text_field"], start, on_input)
        results = encoded(chunked(documents), encoding, workers, options["text_field"])
        # closed on the way out, however it is left: its worker processes end with it
        with contextlib.closing(results):
            for chunk, result in results:
                if result[0] == "error":
                    _, i, line, message = result
                    index, document_line = chunk[i][:2]
                    raise InputError(f"{place((index, line or document_line))}: {message}")
                _, tokens, lengths = result
                offset = 0
                for (index, line, _, _), length in zip(chunk, lengths):
                    writer.add(tokens[offset:offset + length], (index, line))
                    offset += length
                tokens_done += offset
                rate = tokens_done / max(time.perf_counter() - began, 1e-9)
                bar.set_postfix_str(f"{tokens_done:,} tokens, {rate:,.0f} tokens/s", refresh=False)
                bar.update(len(chunk))
        writer.finish((len(inputs), 0))
    except BaseException:
        writer.discard()
        raise
    finally:
        bar.close()
    return tokens_done


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


def default_workers():
    try:
        # the cores this process may use
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="text_to_shards.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Tokenize text files, JSON Lines, Parquet or a hub dataset into train_gpt.py's "
                    "shards.",
        epilog="Example: python data/text_to_shards.py corpus.jsonl.gz --out data/mine --name mine")
    parser.add_argument("inputs", nargs="*", metavar="INPUT",
                        help="text files (a document each), JSON Lines (.jsonl, .jsonl.gz), "
                             "Parquet, folders")
    parser.add_argument("--name", required=True,
                        help="the shards' name: NAME_val_000000.bin, NAME_train_000001.bin, ...")
    parser.add_argument("--out", type=Path,
                        help="output folder (default: data/NAME/ beside this script)")
    parser.add_argument("--val_tokens", type=int, default=DEFAULT_VAL_TOKENS,
                        help="the val shard takes whole documents until it holds this many "
                             "tokens (default: %(default)s, enough for the trainer's default "
                             "--val_tokens)")
    parser.add_argument("--shard_tokens", type=int, default=DEFAULT_SHARD_TOKENS,
                        help="at most this many tokens per train shard (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=default_workers(),
                        help="tokenizing processes (default: every core, %(default)s here)")
    parser.add_argument("--tokenizer", metavar="FILE",
                        help="a tiktoken ranks file of GPT-2's BPE (gpt2.tiktoken), for use "
                             "offline")
    parser.add_argument("--text_field", default="text",
                        help="the JSON field or Parquet column holding the text (default: "
                             "%(default)s)")
    hub = parser.add_argument_group("a dataset on the Hugging Face hub, instead of INPUT files")
    hub.add_argument("--hub", metavar="REPO",
                     help="dataset repository, e.g. HuggingFaceFW/fineweb-edu")
    hub.add_argument("--hub_config", metavar="NAME",
                     help="a config of its dataset card, e.g. sample-10BT (default: the card's "
                          "default config)")
    hub.add_argument("--hub_split", default="train",
                     help="the config's split (default: %(default)s)")
    hub.add_argument("--hub_files", nargs="+", metavar="PATTERN",
                     help="files by path instead of a config, e.g. 'sample/10BT/00[0-2]_*.parquet'")
    hub.add_argument("--hub_revision", metavar="REV",
                     help="a branch, tag or commit (default: main)")
    args = parser.parse_args(argv)
    if bool(args.inputs) == bool(args.hub):
        parser.error("give INPUT files or --hub REPO (one of the two)")
    if not args.hub and (args.hub_config or args.hub_files or args.hub_revision):
        parser.error("--hub_config, --hub_files and --hub_revision go with --hub REPO")
    if args.hub_config and args.hub_files:
        parser.error("--hub_config and --hub_files each pick the files: give one of them")
    if not NAME_PATTERN.fullmatch(args.name):
        parser.error("--name must be letters, digits, '.', '_' or '-' (it names files); got "
                     f"{args.name!r}")
    for option in ("val_tokens", "shard_tokens"):
        if not 1 <= getattr(args, option) <= MAX_SHARD_TOKENS:
            value = getattr(args, option)
            parser.error(f"--{option} must be between 1 and {MAX_SHARD_TOKENS:,}; got {value}")
    if args.workers < 1:
        parser.error(f"--workers must be at least 1; got {args.workers}")
    if args.out is None:
        args.out = HERE / args.name
    return args


class Interrupted(BaseException):
    """SIGTERM or SIGHUP, stopping the run as Ctrl-C does."""


def main(argv=None, encoding=None):
    """The command line; returns the exit status. `encoding`: a tiktoken Encoding in place of
    GPT-2's (tests use a tiny one)."""
    args = parse_args(argv)

    def stop(signum, frame):
        raise Interrupted(signum)

    handlers = {signum: signal.signal(signum, stop) for signum in (signal.SIGTERM, signal.SIGHUP)}
    began = time.perf_counter()
    try:
        if args.hub:
            inputs = hub_inputs(args.hub, args.hub_config, args.hub_split, args.hub_files,
                                args.hub_revision)
        else:
            inputs = local_inputs(args.inputs, args.out)
        if any(item.kind == "parquet" for item in inputs):
            import_pyarrow()
        encoding = encoding or gpt2_encoding(args.tokenizer)
        manifest, made = convert(inputs, args.out, args.name, encoding, args.workers,
                                 args.val_tokens, args.shard_tokens, args.text_field)
    except (InputError, FolderError, TokenizerError, WorkerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        # writing the shards: a full disk, say
        print(f"error: cannot write to {args.out} ({e.strerror or e}); the finished shards are "
              "kept: free some space and rerun the same command to go on", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Interrupted):
        print(f"\ninterrupted: the finished shards in {args.out} are kept; rerun the same command "
              "to go on", file=sys.stderr)
        return 130
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    print(summary(args.out, manifest, made, time.perf_counter() - began, args.workers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
