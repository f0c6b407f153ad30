#!/usr/bin/env python3
"""Fetch the GPT-2-tokenized FineWeb shards that train_gpt.py reads.

Usage (works from any directory; shards land beside this script, in data/fineweb10B/):

    python data/cached_fineweb10B.py 9                 # val shard + first 9 train shards, ~2 GB
    python data/cached_fineweb10B.py                   # val + all 103 train shards, ~20 GB
    python data/cached_fineweb10B.py 9 --workers 8     # more downloads at once (default 4)
    python data/cached_fineweb10B.py 9 --dataset finewebedu10B   # a sister dataset, see DATASETS
    python data/cached_fineweb10B.py 9 --dir /scratch/fineweb    # another target folder
    python data/cached_fineweb10B.py 9 --verify        # also re-hash the shards already there

Each shard holds 100M tokens (~200 MB). A record needs 8 training shards (0.73B tokens);
fetching 9 is the usual advice. Rerunning is cheap: it only fetches what is missing.

How it works, and why:
- A shard already in the target folder that passes the format check (magic 20240520,
  version 1, file size = 1024 + 2 x token count) is kept without any network access.
  A file that fails the check is deleted and fetched again. --verify also compares the
  sha256 of every present shard with the one the hub publishes.
- Missing shards come from the Hugging Face hub through huggingface_hub (HF_ENDPOINT, HF_TOKEN
  and HF_HUB_OFFLINE apply as usual): one dataset_info call for the sha256 the hub publishes for
  each shard (an LFS file), then hf_hub_download, a few shards at a time, into <target>/.incoming/,
  where the client writes each file under a temporary name and renames it once complete. Each
  shard is then checked there, format and sha256, and only then renamed into place (files.py). So
  a shard name in the target folder only ever holds a complete, verified file; Ctrl-C, a dropped
  connection or a full disk leave debris only under .incoming/, which every run deletes, and shards
  finished before that are kept. Every file is checked before it is opened: something else at a
  shard's name (a pipe, a folder) is reported, not opened, deleted or replaced. One run at a time
  downloads into a folder (its lock: files.locked).
- Why local_dir and not the hub cache: the cache would keep a second copy of every shard.
- Exit status: 0 when every requested shard is present and valid; 1 when something could not
  be fetched (an `error:` line says why); 2 for a bad command line; 130 when interrupted.
"""

import argparse
import contextlib
import hashlib
import os
import shutil
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import as_completed
from pathlib import Path

import files
import hub
import shards

HERE = Path(__file__).resolve().parent
# hidden, so the trainer's file patterns never match what is in it
STAGING = ".incoming"
HEADER_BYTES = shards.HEADER_BYTES
# --dataset name (also the default folder, data/<name>/): hub repository, file prefix, train shards
DATASETS = {
    "fineweb10B": ("kjj0/fineweb10B-gpt2", "fineweb", 103),
    "finewebedu10B": ("kjj0/finewebedu10B-gpt2", "finewebedu", 99),
    "fineweb100B": ("kjj0/fineweb100B-gpt2", "fineweb", 1030),
}


def problem(path: Path, sha256: str | None = None) -> str | None:
    """What is wrong with the shard at `path`: its header and size, and its sha256 when one is
    given. A FileProblem when it is not a file to read (checked before it is opened)."""
    with files.open_checked(path) as f:
        header = f.read(HEADER_BYTES)
        if why := shards.header_problem(header, f.seek(0, 2)):
            return why
        if sha256 is None:
            return None
        digest = hashlib.sha256(header)
        f.seek(HEADER_BYTES)
        while block := f.read(1 << 24):
            digest.update(block)
    got = digest.hexdigest()
    if got == sha256:
        return None
    return f"sha256 {got[:16]}... is not the hub's {sha256[:16]}..."


def human(n: float) -> str:
    """A byte count as people read it."""
    if n >= 1e9:
        return f"{n / 1e9:.2f} GB"
    if n >= 1e6:
        return f"{n / 1e6:.1f} MB"
    return f"{n:,.0f} bytes"


def usable(path: Path, sha256: str | None = None) -> bool:
    """Whether the shard at `path` is sound; one that is not is deleted, saying why. A FileProblem
    for what is not a file: it is not ours to delete."""
    if why := problem(path, sha256):
        print(f"{path.name}: {why}; deleting it and fetching it again", file=sys.stderr)
        path.unlink()
    return why is None


def fetch_one(repo: str, commit: str, name: str, sha256: str, dest: Path) -> str | None:
    """Download one shard into .incoming/, check it, rename it into place; return an error line, if
    any."""
    from huggingface_hub import hf_hub_download

    # The client writes to a temporary file of its own and gives it this name once complete.
    downloaded = hf_hub_download(repo, name, repo_type="dataset", revision=commit,
                                 local_dir=dest / STAGING)
    path = Path(downloaded)
    if why := problem(path, sha256):
        path.unlink()
        return f"{name} from {repo}: {why}; it was deleted"
    files.put_in_place(path, dest / name)


def fetch(repo: str, dest: Path, names: list[str], args) -> tuple[list[str], list[str]]:
    """Make `names` present and valid in `dest`; return the names downloaded and error lines."""
    # no network for these...
    missing = []
    refused = {}
    for n in names:
        try:
            if not (dest / n).exists() or not usable(dest / n):
                missing.append(n)
        except files.FileProblem as e:
            refused[n] = f"{e}, where a shard should be: move it away, then rerun"
    errors = list(refused.values())
    names = [n for n in names if n not in refused]
    if not missing and not args.verify:
        return [], errors
    from huggingface_hub import HfApi
    from huggingface_hub import constants

    info = HfApi().dataset_info(repo, files_metadata=True)
    # Shards are LFS files: for those the hub publishes size and sha256.
    listing = {f.rfilename: f for f in info.siblings if f.lfs is not None}
    # ... unless asked
    if args.verify:
        missing += [n for n in names if n not in missing and n in listing
                    and not usable(dest / n, listing[n].lfs.sha256)]
    errors += [f"{n} was not found in the dataset {repo} on {constants.ENDPOINT}"
               for n in missing if n not in listing]
    todo = [n for n in names if n in missing and n in listing]
    need = sum(listing[n].size for n in todo)
    free = shutil.disk_usage(dest).free
    if need > free:
        return [], errors + [f"not enough disk space in {dest}: {len(todo)} shards need "
                             f"{human(need)}, {human(free)} is free; free some space or ask for "
                             "fewer shards"]
    staging = dest / STAGING
    # left there by something else: not ours to delete, and the client cannot download into it
    if todo and (staging.is_symlink() or (staging.exists() and not staging.is_dir())):
        return [], errors + [f"{staging}: not a folder, where the downloads are staged: move it "
                             "away, then rerun"]
    kept = f"partial files were removed, the shards already in {dest} are kept"
    with ThreadPoolExecutor(args.workers) as pool:
        jobs = {pool.submit(fetch_one, repo, info.sha, n, listing[n].lfs.sha256, dest): n
                for n in todo}
        for job in as_completed(jobs):
            # likely to fail the rest too: do not start them
            if not job.cancelled() and job.exception():
                why = hub.one_line(job.exception(), repo, kept, dest)
                errors.append(f"{jobs[job]}: {why}")
                pool.shutdown(wait=False, cancel_futures=True)
            elif not job.cancelled() and job.result():
                errors.append(job.result())
    return [n for n in todo if (dest / n).exists()], errors


def run(args) -> int:
    repo, prefix, _ = DATASETS[args.dataset]
    dest = args.dir if args.dir is not None else HERE / args.dataset
    train_names = [f"{prefix}_train_{i:06d}.bin" for i in range(1, args.n + 1)]
    names = [f"{prefix}_val_000000.bin"] + train_names
    start = time.perf_counter()

    def interrupted(signum, frame):
        """Download threads cannot be stopped politely: drop their files, leave now."""
        shutil.rmtree(dest / STAGING, ignore_errors=True)
        (dest / files.OWNER).unlink(missing_ok=True)
        sys.stderr.write("\ninterrupted: finished shards are kept, partial ones discarded; "
                         "rerun to continue\n")
        os._exit(130)

    with contextlib.ExitStack() as stack:
        # two runs must not share .incoming/
        try:
            stack.enter_context(files.locked(dest))
        except files.UnusableFolder as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        # a killed job cleans up like Ctrl-C
        handlers = {signum: signal.signal(signum, interrupted)
                    for signum in (signal.SIGINT, signal.SIGTERM)}
        try:
            return fetch_and_report(repo, dest, names, args, start)
        finally:
            # as they were, for a caller in the same process (the tests)
            for signum, handler in handlers.items():
                signal.signal(signum, handler)


def fetch_and_report(repo: str, dest: Path, names: list[str], args, start: float) -> int:
    """With the folder locked: fetch, then say what is there and what went wrong; the exit
    status."""
    # debris of a killed run
    shutil.rmtree(dest / STAGING, ignore_errors=True)
    try:
        fetched, errors = fetch(repo, dest, names, args)
    except Exception as e:  # noqa: BLE001 - e.g. the hub is unreachable
        fetched = []
        errors = [hub.one_line(e, repo, f"the shards already in {dest} are kept")]
    finally:
        shutil.rmtree(dest / STAGING, ignore_errors=True)
    # all checked by now
    present = [n for n in names if (dest / n).is_file()]
    size = sum((dest / n).stat().st_size for n in present)
    new = sum((dest / n).stat().st_size for n in fetched)
    print(f"{dest}: {len(present)} of {len(names)} shards present (val + {len(names) - 1} train), "
          f"{(size - HEADER_BYTES * len(present)) // 2:,} tokens, {human(size)}; "
          f"downloaded {len(fetched)} ({human(new)}) in {time.perf_counter() - start:.1f} s")
    if len(present) < len(names):
        print("missing: " + ", ".join(n for n in names if n not in present))
    for message in errors:
        print(f"error: {message}", file=sys.stderr)
    return 1 if errors else 0


class OneLineParser(argparse.ArgumentParser):
    """argparse, with a bad command line told in one line."""

    def error(self, message):
        self.exit(2, f"error: {message}; see --help\n")


def folder(text: str) -> Path:
    """--dir's value; an empty one would be the current folder, which nobody asked for."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty: give a folder's path")
    return Path(text)


def main(argv=None) -> int:
    parser = OneLineParser(
        description="Download FineWeb GPT-2 token shards: val + the first N train shards.")
    parser.add_argument("n", nargs="?", type=int,
                        help="number of train shards (default: all of them)")
    parser.add_argument("--dataset", choices=DATASETS, default="fineweb10B",
                        help="default: %(default)s")
    parser.add_argument("--dir", type=folder,
                        help="target folder (default: data/<dataset>/ beside this script)")
    parser.add_argument("--workers", type=int, default=4,
                        help="downloads at once (default: %(default)s)")
    parser.add_argument("--verify", action="store_true",
                        help="also compare present shards' sha256 with the hub's")
    args = parser.parse_args(argv)
    repo, _, train_shards = DATASETS[args.dataset]
    args.n = train_shards if args.n is None else args.n
    if not 0 <= args.n <= train_shards:
        parser.error(f"N must be between 0 and {train_shards} ({repo} has {train_shards} train "
                     f"shards), got {args.n}")
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
