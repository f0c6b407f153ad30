#!/usr/bin/env python3
"""Fetch the GPT-2-tokenized FineWeb shards that train_gpt.py reads.

Usage (works from any directory; shards land beside this script, in data/fineweb10B/):

    python data/cached_fineweb10B.py 9                 # val shard + first 9 train shards, ~2 GB
    python data/cached_fineweb10B.py                   # val + all 103 train shards, ~20 GB
    python data/cached_fineweb10B.py 9 --workers 8     # more downloads at once (default 4)
    python data/cached_fineweb10B.py 9 --dataset finewebedu10B   # a sister dataset, see DATASETS
    python data/cached_fineweb10B.py 9 --dir /scratch/fineweb    # another target folder

Each shard holds 100M tokens (~200 MB). A record needs 8 training shards (0.73B tokens);
fetching 9 is the usual advice. Rerunning is cheap: it only fetches what is missing.

How it works, and why:
- A shard already in the target folder that passes the format check (magic 20240520,
  version 1, file size = 1024 + 2 x token count) is kept without any network access.
  A file that fails the check is deleted and fetched again.
- Files come from the Hugging Face hub through huggingface_hub, so HF_ENDPOINT (mirrors),
  HF_TOKEN and HF_HUB_OFFLINE apply as usual.
- A shard name in the target folder only ever holds a complete, checked file: each download
  goes to <target>/.incoming/ (hf_hub_download with local_dir), is checked there, and is then
  renamed into place with os.replace, which is atomic. Ctrl-C, a dropped connection or a full
  disk leave debris only under .incoming/, which every run deletes.
- Why local_dir and not the hub cache: the cache (HF_HUB_CACHE) would keep a second ~200 MB
  copy of every shard beside the one the trainer reads. With local_dir the hub still reuses a
  copy already in the cache, but never writes a new one. .incoming/ sits inside the target
  folder so the final rename stays on one filesystem (no copy, atomic).
- Exit status: 0 when every requested shard is present and valid; 1 when something could not
  be fetched (the message says why; finished shards are kept); 2 for a bad command line;
  130 when interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import shutil
import signal
import struct
import sys
import threading
import time
from concurrent.futures import CancelledError, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Downloads land here first. Hidden, so the trainer's file patterns never match it.
STAGING = ".incoming"
MAGIC, VERSION, HEADER_BYTES = 20240520, 1, 256 * 4


@dataclass(frozen=True)
class Dataset:
    repo: str  # Hugging Face dataset repository
    prefix: str  # file names: {prefix}_val_000000.bin, {prefix}_train_000001.bin, ...
    train_shards: int


# The key is also the default target folder, data/<key>/.
DATASETS = {
    "fineweb10B": Dataset("kjj0/fineweb10B-gpt2", "fineweb", 103),
    "finewebedu10B": Dataset("kjj0/finewebedu10B-gpt2", "finewebedu", 99),
    "fineweb100B": Dataset("kjj0/fineweb100B-gpt2", "fineweb", 1030),
}


class FetchError(Exception):
    """A failure the user gets as one message (no traceback). Fatal ones stop other downloads."""

    def __init__(self, message: str, fatal: bool = True):
        super().__init__(message)
        self.fatal = fatal


class BadShard(Exception):
    """The file is not a complete shard; the message says what is wrong."""


# ----------------------------------------------------------------------------- shards on disk


def shard_names(ds: Dataset, n: int) -> list[str]:
    return [f"{ds.prefix}_val_000000.bin"] + [
        f"{ds.prefix}_train_{i:06d}.bin" for i in range(1, n + 1)
    ]


def check_shard(path: Path) -> int:
    """Return the token count of a valid shard; raise BadShard otherwise. Reads only the header."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        header = f.read(HEADER_BYTES)
    if len(header) < HEADER_BYTES:
        raise BadShard(f"{size} bytes, shorter than the {HEADER_BYTES}-byte header")
    magic, version, tokens = struct.unpack_from("<3i", header)
    if magic != MAGIC:
        raise BadShard(f"magic number {magic}, expected {MAGIC}")
    if version != VERSION:
        raise BadShard(f"version {version}, expected {VERSION}")
    if tokens < 0 or size != HEADER_BYTES + 2 * tokens:
        raise BadShard(
            f"{size} bytes, but the header promises {tokens} tokens = {HEADER_BYTES + 2 * tokens} bytes"
        )
    return tokens


def scan(dest: Path, names: list[str]) -> list[str]:
    """Return the names still to fetch; delete files that are there but not valid shards."""
    missing = []
    for name in names:
        path = dest / name
        if not path.exists():
            missing.append(name)
            continue
        try:
            check_shard(path)
        except (BadShard, OSError) as e:
            print(
                f"{name}: not a valid shard ({e}); deleting it and fetching it again",
                file=sys.stderr,
            )
            try:
                path.unlink()
            except OSError as err:
                raise FetchError(
                    f"cannot delete the invalid shard {show(path)}: {err.strerror}"
                ) from None
            missing.append(name)
    return missing


@contextlib.contextmanager
def folder_lock(dest: Path):
    """Keep two runs from sharing one .incoming/ folder (the lock dies with the process)."""
    try:
        import fcntl
    except ImportError:  # not on POSIX: no lock
        yield
        return
    fd = os.open(dest, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FetchError(
                f"another run is already downloading into {show(dest)}; wait for it to finish"
            ) from None
        yield
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- the hub


def endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def probe(ds: Dataset, name: str) -> int | None:
    """One HEAD request without retries, so an unreachable hub is reported at once (the
    downloads themselves retry for ~20 s per file). Returns the file size when known."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError

    try:
        meta = get_hf_file_metadata(
            hf_hub_url(ds.repo, name, repo_type="dataset"), retry_on_errors=False
        )
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else 0
        if status >= 500 or status == 429:  # maybe transient: the downloads retry
            return None
        raise
    return meta.size


def fetch_one(ds: Dataset, name: str, dest: Path, progress_class) -> int:
    """Download one shard into .incoming/, check it, rename it into place. Returns its tokens."""
    from huggingface_hub import hf_hub_download

    path = Path(
        hf_hub_download(
            ds.repo,
            name,
            repo_type="dataset",
            local_dir=dest / STAGING,
            tqdm_class=progress_class,
        )
    )
    try:
        try:
            tokens = check_shard(path)
        except BadShard as e:
            raise FetchError(
                f"{name} from {ds.repo} on {endpoint()} is not a valid shard ({e}); it was not kept",
                fatal=False,
            ) from None
        with open(path, "rb") as f:  # on disk before the rename makes it visible
            os.fsync(f.fileno())
        os.replace(path, dest / name)
        return tokens
    finally:
        # Removes a rejected file; after the rename this is a no-op.
        path.unlink(missing_ok=True)


def transport_errors() -> tuple[type[BaseException], ...]:
    """Exception types meaning "could not talk to the server", whichever HTTP library the hub uses."""
    import importlib

    types: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module, attr in [
        ("httpx2", "TransportError"),
        ("httpx", "TransportError"),
        ("requests", "RequestException"),
    ]:
        try:
            types.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError):
            pass
    return tuple(types)


def explain(exc: BaseException, name: str, ds: Dataset, dest: Path) -> FetchError:
    """Map an exception from fetching `name` to a message for the user."""
    from huggingface_hub import errors as hf

    remote_not_found = getattr(hf, "RemoteEntryNotFoundError", hf.EntryNotFoundError)
    kept = (
        f"Shards already in {show(dest)} are kept; rerun the same command to continue."
    )
    chain, seen = [exc], set()
    while chain:
        e = chain.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, FetchError):
            return e
        if isinstance(e, hf.OfflineModeIsEnabled):
            return FetchError(
                f"HF_HUB_OFFLINE is set, so {name} cannot be downloaded. {kept}"
            )
        if isinstance(e, remote_not_found) and not isinstance(
            e, hf.LocalEntryNotFoundError
        ):
            return FetchError(
                f"{name} was not found in the dataset {ds.repo} on {endpoint()}.",
                fatal=False,
            )
        if isinstance(e, hf.RepositoryNotFoundError):
            return FetchError(
                f"the dataset {ds.repo} was not found on {endpoint()} (or it needs a token: set HF_TOKEN). {kept}"
            )
        if isinstance(e, hf.HfHubHTTPError) and e.response is not None:
            status = e.response.status_code
            if status in (401, 403):
                return FetchError(
                    f"{endpoint()} refused access to {ds.repo} (HTTP {status}); check HF_TOKEN. {kept}"
                )
            return FetchError(
                f"the hub at {endpoint()} answered HTTP {status} while sending {name}. {kept}"
            )
        if isinstance(e, OSError) and e.errno in (
            errno.ENOSPC,
            errno.EDQUOT,
            errno.EFBIG,
        ):
            free = shutil.disk_usage(dest).free
            return FetchError(
                f"the disk is full while writing {name} ({e.strerror}; {human(free)} free in {show(dest)}). "
                f"The partial file was removed. {kept} Free some space or ask for fewer shards."
            )
        if isinstance(e, transport_errors()):
            return FetchError(
                f"cannot reach the Hugging Face hub at {endpoint()} ({e or type(e).__name__}). "
                f"{kept} (HF_ENDPOINT selects a mirror.)"
            )
        chain += [e.__cause__, e.__context__]
    # The hub's own size check: the body was shorter than announced.
    if isinstance(exc, OSError) and "Consistency check failed" in str(exc):
        return FetchError(
            f"the download of {name} was cut short; nothing was kept. {kept}"
        )
    return FetchError(f"{name}: {type(exc).__name__}: {exc}. {kept}")


# ----------------------------------------------------------------------------- downloading


def byte_counter(bar, lock: threading.Lock, size_guess: int | None):
    """A tqdm class for hf_hub_download that adds every file's bytes to our one bytes bar."""
    from tqdm import tqdm

    class Counter(tqdm):
        def __init__(self, *args, **kwargs):
            # The hub's per-file bar stays hidden.
            kwargs.pop("disable", None)
            super().__init__(*args, disable=True, **kwargs)
            # Swap this file's share of the estimated total for its real size.
            size = kwargs.get("total")
            if size and size_guess and bar.total:
                with lock:
                    bar.total += size - size_guess
                    bar.refresh()

        def update(self, n=1):
            with lock:
                bar.update(n)

        # Presence of these makes the hub's xet path count bytes once, not twice.
        def update_transfer(self, n=1):
            pass

        def set_transfer_postfix_str(self, *args, **kwargs):
            pass

    return Counter


def download_all(
    ds: Dataset, names: list[str], dest: Path, workers: int, size_guess: int | None
) -> list[str]:
    """Fetch `names` a few at a time. Returns error messages (empty when all went well)."""
    from huggingface_hub import constants
    from tqdm import tqdm

    quiet = bool(constants.HF_HUB_DISABLE_PROGRESS_BARS)
    shards = tqdm(
        total=len(names), unit="shard", desc="shards", position=0, disable=quiet
    )
    total = size_guess * len(names) if size_guess else None
    nbytes = tqdm(
        total=total, unit="B", unit_scale=True, desc="bytes ", position=1, disable=quiet
    )
    counter = byte_counter(nbytes, threading.Lock(), size_guess)
    errors: list[str] = []
    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        futures = {
            pool.submit(fetch_one, ds, name, dest, counter): name for name in names
        }
        for future in as_completed(futures):
            try:
                future.result()
                shards.update()
            except CancelledError:
                continue
            except Exception as e:  # noqa: BLE001 - every failure becomes a message
                err = explain(e, futures[future], ds, dest)
                if str(err) not in errors:
                    errors.append(str(err))
                if err.fatal:  # the same cause would fail the rest: do not start them
                    for f in futures:
                        f.cancel()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        nbytes.close()
        shards.close()
    return errors


# ----------------------------------------------------------------------------- main


def human(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1000 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1000
    raise AssertionError


def show(path: Path) -> str:
    """A path as the user would type it: relative to the current folder when inside it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve())) or "."
    except ValueError:
        return str(path)


def summary(dest: Path, names: list[str], fetched: list[str], seconds: float) -> str:
    present, tokens, nbytes, new_bytes = [], 0, 0, 0
    for name in names:
        path = dest / name
        with contextlib.suppress(OSError, BadShard):
            tokens += check_shard(path)
            nbytes += path.stat().st_size
            new_bytes += path.stat().st_size if name in fetched else 0
            present.append(name)
    rate = f" ({new_bytes / 1e6 / seconds:.1f} MB/s)" if new_bytes else ""
    lines = [
        (
            f"{show(dest)}: {len(present)} of {len(names)} shards present (val + {len(names) - 1} train), "
            f"{tokens:,} tokens, {human(nbytes)}; "
            f"downloaded {len(fetched)} ({human(new_bytes)}) in {seconds:.1f} s{rate}"
        )
    ]
    if len(present) < len(names):
        lines.append("missing: " + ", ".join(n for n in names if n not in present))
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="Download FineWeb GPT-2 token shards (val + the first N train shards).",
        epilog="Example: python data/cached_fineweb10B.py 9   (enough for a record, ~2 GB)",
    )
    parser.add_argument(
        "n", nargs="?", type=int, help="number of train shards (default: all of them)"
    )
    parser.add_argument(
        "--dataset", choices=DATASETS, default="fineweb10B", help="default: %(default)s"
    )
    parser.add_argument(
        "--dir",
        type=Path,
        help="target folder (default: data/<dataset>/ beside this script)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=4,
        help="downloads at once (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    ds = DATASETS[args.dataset]
    if args.n is None:
        args.n = ds.train_shards
    if not 0 <= args.n <= ds.train_shards:
        parser.error(
            f"N must be between 0 and {ds.train_shards} ({ds.repo} has {ds.train_shards} train shards), got {args.n}"
        )
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    return args


def probe_or_fail(ds: Dataset, name: str, dest: Path) -> int | None:
    """probe(), with problems that doom the whole run raised as FetchError."""
    try:
        return probe(ds, name)
    except Exception as e:  # noqa: BLE001 - mapped to a message like download errors
        err = explain(e, name, ds, dest)
        if err.fatal:
            raise err from None
        return None  # e.g. this one file is missing: the downloads report it


def check_space(dest: Path, size: int | None, count: int) -> None:
    """Refuse to start what cannot finish, before paying for the bandwidth."""
    need, free = (size or 0) * count, shutil.disk_usage(dest).free
    if need > free:
        raise FetchError(
            f"not enough disk space in {show(dest)}: {count} shards need about "
            f"{human(need)}, {human(free)} is free. "
            "Free some space or ask for fewer shards."
        )


def run(args) -> int:
    ds = DATASETS[args.dataset]
    dest = args.dir if args.dir is not None else HERE / args.dataset
    names = shard_names(ds, args.n)
    start = time.perf_counter()
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FetchError(
            f"cannot create the target folder {show(dest)}: {e.strerror}"
        ) from None
    errors: list[str] = []
    missing: list[str] = []
    with folder_lock(dest):
        # Debris of an interrupted run.
        shutil.rmtree(dest / STAGING, ignore_errors=True)
        missing = scan(dest, names)
        try:
            if missing:
                size = probe_or_fail(ds, missing[0], dest)
                check_space(dest, size, len(missing))
                workers = min(args.workers, len(missing))
                errors = download_all(ds, missing, dest, workers, size)
        except FetchError as e:
            errors = [str(e)]
        finally:
            shutil.rmtree(dest / STAGING, ignore_errors=True)
    fetched = [n for n in missing if (dest / n).exists()]
    print(summary(dest, names, fetched, time.perf_counter() - start), flush=True)
    for message in errors:
        print(f"error: {message}", file=sys.stderr)
    return 1 if errors else 0


def interrupted(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        dest = args.dir if args.dir is not None else HERE / args.dataset
        shutil.rmtree(dest / STAGING, ignore_errors=True)
        print(
            f"\ninterrupted: partial downloads were discarded; complete shards in {show(dest)} are kept. "
            "Rerun the same command to continue.",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        # Download threads cannot be stopped politely; do not wait for them.
        os._exit(130)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, interrupted)  # a killed job cleans up like Ctrl-C
    sys.exit(main())
