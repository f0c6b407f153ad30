"""What the data tools need of the Hugging Face hub, through huggingface_hub (imported only when
used): one line for a failure inside the client, and a dataset's files, picked by a config of its
card or by path patterns, each downloaded when it is needed and the next one meanwhile, and used
only once its bytes are those the hub publishes the hash of.

The client wraps a failure in its own exceptions (an HTTP error around a connection error, say):
the first cause in the chain that means something to the user is the one to tell.
"""

import errno
import hashlib
import os
import re
import shutil
import threading
from pathlib import Path

NOT_FOUND_REPO = "repository not found"
NOT_FOUND_FILE = "file not found"
DENIED = "access denied"
OFFLINE = "offline mode"
HTTP_STATUS = "http status"
DISK_FULL = "disk full"
UNREACHABLE = "unreachable"
# the HTTP client's errors for a network that does not answer, by name (its exception classes)
NETWORK_ERRORS = ("ConnectError", "ConnectTimeout", "ReadTimeout", "RemoteProtocolError")
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class HubError(Exception):
    """What the hub or its dataset card cannot give: the message says what to do."""


def first_known_cause(exc):
    """(what, the exception found, its HTTP status or 0) for the first cause in `exc`'s chain that
    one of the names above describes, or (None, exc, 0)."""
    from huggingface_hub import errors

    cause = exc
    while cause is not None:
        status = 0
        if isinstance(cause, errors.HfHubHTTPError) and cause.response is not None:
            status = cause.response.status_code
        if status in (401, 403):
            return DENIED, cause, status
        if isinstance(cause, errors.RepositoryNotFoundError):
            return NOT_FOUND_REPO, cause, status
        if isinstance(cause, errors.EntryNotFoundError):
            return NOT_FOUND_FILE, cause, status
        if isinstance(cause, errors.OfflineModeIsEnabled):
            return OFFLINE, cause, status
        if status:
            return HTTP_STATUS, cause, status
        if isinstance(cause, OSError) and cause.errno in DISK_FULL_ERRNOS:
            return DISK_FULL, cause, status
        network = isinstance(cause, (ConnectionError, TimeoutError))
        if network or type(cause).__name__ in NETWORK_ERRORS or transport_error(cause):
            return UNREACHABLE, cause, status
        cause = cause.__cause__ or cause.__context__
    return None, exc, 0


def transport_error(exc):
    """Whether `exc` is one of the HTTP client's (httpx's) transport errors."""
    try:
        from huggingface_hub.utils import httpx
    except ImportError:
        return False
    return isinstance(exc, httpx.TransportError)


def one_line(exc, repo, kept="", folder=None):
    """One line for a failure inside the hub client, saying what to do; then `kept`, what the tool
    kept. `folder`: where the files go, whose free space a full disk tells."""
    from huggingface_hub import constants

    hub = constants.ENDPOINT
    what, cause, status = first_known_cause(exc)
    if what == DENIED:
        line = (f"{hub} refused access to {repo} (HTTP {status}): set HF_TOKEN to a token that can "
                "read it")
    elif what == NOT_FOUND_REPO:
        line = f"the dataset {repo} was not found on {hub} (if it is private, set HF_TOKEN)"
    elif what in (HTTP_STATUS, NOT_FOUND_FILE) and status:
        line = f"{hub} answered HTTP {status} about {repo}: rerun the same command to go on"
    elif what == OFFLINE:
        line = f"HF_HUB_OFFLINE is set, so {repo} cannot be reached: unset it"
    elif what == DISK_FULL and folder is not None:
        free = shutil.disk_usage(folder).free
        line = (f"the disk is full ({cause.strerror}; {free:,} bytes free in {folder}): free some "
                "space, then rerun")
    elif what == DISK_FULL:
        line = f"the disk is full ({cause.strerror}): free some space, then rerun"
    elif what == UNREACHABLE:
        line = (f"cannot reach the hub at {hub} ({type(cause).__name__}: {cause}): check the "
                "network; HF_ENDPOINT picks a mirror")
    else:
        line = f"{repo}: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
    return f"{line}; {kept}" if kept else line


def glob_regex(pattern):
    """A path pattern as the hub's dataset configs write them: `*` within one folder, `**` across
    folders, `?` one character, `[0-2]` or `[!a]` one of a set."""
    parts = re.split(r"(\*\*/?|\*|\?|\[!?[^]]+\])", pattern)
    wild = {"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}
    regex = ""
    for part in parts:
        wildcard_set = part.startswith("[") and part.endswith("]") and len(part) > 2
        if wildcard_set and part.startswith("[!"):
            regex += "[^" + part[2:]
        elif wildcard_set:
            regex += part
        else:
            regex += wild.get(part, re.escape(part))
    return re.compile(regex)


def card_patterns(repo, readme, config, split):
    """The data-file patterns of `config` (its split; the card's default config when None) in the
    dataset card at `readme`."""
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
        raise HubError(f"{repo}: {asked} ({known}); pass --hub_config NAME, or --hub_files PATTERN")
    name = chosen[0].get("config_name")
    data_files = chosen[0].get("data_files")
    if isinstance(data_files, str):
        data_files = [data_files]
    if data_files and isinstance(data_files[0], dict):
        by_split = {d.get("split"): d.get("path") for d in data_files}
        if split not in by_split:
            splits = ", ".join(map(str, by_split))
            raise HubError(f"{repo}: config {name!r} has no split {split!r} (it has {splits}); "
                           "pass --hub_split")
        data_files = by_split[split]
        data_files = [data_files] if isinstance(data_files, str) else data_files
    if not data_files:
        raise HubError(f"{repo}: config {name!r} names no data files; pass --hub_files PATTERN")
    return data_files


def dataset_files(repo, config, split, patterns, revision):
    """(path in the repository, [size, sha256 or blob id], fetch) for each of the dataset's files
    that `patterns` (else `config`'s) select, in pattern, then path order. fetch() downloads the
    file into the client's cache (one at a time, in order, in daemon threads: Ctrl-C need not wait)
    and starts the next one's download, and returns the local path once its bytes match the
    published hash (checked_download)."""
    from huggingface_hub import HfApi
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import disable_progress_bars

    # the tool's own progress says what is downloading
    disable_progress_bars()
    try:
        info = HfApi().dataset_info(repo, revision=revision, files_metadata=True)
        listing = {sibling.rfilename: sibling for sibling in info.siblings}
        if not patterns:
            readme = hf_hub_download(repo, "README.md", repo_type="dataset", revision=info.sha)
            patterns = card_patterns(repo, readme, config, split)
    except HubError:
        raise
    except Exception as e:  # noqa: BLE001 - the client's many errors, told in one line
        raise HubError(one_line(e, repo)) from None
    selected = []
    for pattern in patterns:
        matched = sorted(name for name in listing if glob_regex(pattern).fullmatch(name))
        if not matched:
            raise HubError(f"{repo}: no file matches {pattern!r} (at commit {info.sha[:12]})")
        selected += [name for name in matched if name not in selected]
    stamps = {}
    for name in selected:
        lfs = getattr(listing[name], "lfs", None)
        stamps[name] = [listing[name].size, lfs.sha256 if lfs else listing[name].blob_id]
    downloads = {}
    results = {}

    def download(i):
        if i - 1 in downloads:
            downloads[i - 1].join()
        try:
            path = hf_hub_download(repo, selected[i], repo_type="dataset", revision=info.sha)
            results[i] = checked_download(repo, selected[i], path, stamps[selected[i]][1])
        except Exception as e:  # noqa: BLE001 - told in one line by fetch
            results[i] = e

    def start(i):
        if i < len(selected) and i not in downloads:
            downloads[i] = threading.Thread(target=download, args=(i,), daemon=True)
            downloads[i].start()

    def fetcher(i):
        def fetch():
            start(i)
            start(i + 1)
            downloads[i].join()
            if isinstance(results[i], HubError):
                raise results[i]
            if isinstance(results[i], Exception):
                raise HubError(f"{repo}:{selected[i]}: {one_line(results[i], repo)}")
            return Path(results[i])
        return fetch

    return [(name, stamps[name], fetcher(i)) for i, name in enumerate(selected)]


def content_hash(path, published):
    """The hash of the file at `path` the hub would publish: its sha256 where `published` is one
    (an LFS file), else its git blob id."""
    if len(published) == 64:
        digest = hashlib.sha256()
    else:
        digest = hashlib.sha1(b"blob %d\0" % os.path.getsize(path))
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def checked_download(repo, name, path, published):
    """`path`, the client's download of `name`, once its bytes are those the hub publishes the hash
    of; else a HubError, the download deleted from the client's cache (so a rerun fetches it
    again)."""
    from huggingface_hub import constants

    # the hub publishes one for every file; a mirror might not: nothing to compare with
    if not published:
        return path
    got = content_hash(path, published)
    if got == published:
        return path
    kind = "sha256" if len(published) == 64 else "git blob id"
    blob = Path(path).resolve()
    Path(path).unlink(missing_ok=True)
    blob.unlink(missing_ok=True)
    raise HubError(f"{repo}:{name}: the bytes downloaded from {constants.ENDPOINT} have {kind} "
                   f"{got[:16]}..., not the published {published[:16]}...; they were deleted: "
                   "rerun to download the file again (if this persists, set HF_ENDPOINT to "
                   "another mirror)")
