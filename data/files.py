"""How the data tools touch files and folders: one rule for each, used by all of them.

- A path is checked before it is opened. A pipe, a socket or a device where a file is expected is
  refused without opening it (opening a pipe waits for a writer; a device may never end). A file
  that cannot be read, or a folder that cannot be listed, is an error naming it, never skipped
  (Python's glob and Path.rglob skip what they cannot list, silently).
- A file is written under a hidden temporary name beside its own (naming the host and process, so
  that no two runs ever write one file), flushed to disk, and renamed into place once whole: its
  name only ever holds a whole file.
- One run at a time writes a folder: it holds the folder's lock (fcntl.flock, which the kernel
  releases when the process ends, however it ends: never stale) and records itself in OWNER, for the
  messages of other runs.
"""

import contextlib
import fcntl
import json
import os
import socket
import stat
import sys
from pathlib import Path

# who holds a folder's lock; removed when the run ends
OWNER = ".lock_owner"


class FileProblem(Exception):
    """A path that cannot be used as the file or folder expected. `kind` says why: "missing",
    "unreadable", "folder", "not a folder", or, for what only poses as a file, "pipe", "socket",
    "device"."""

    POSES_AS_A_FILE = ("pipe", "socket", "device")

    def __init__(self, path, kind, why):
        super().__init__(f"{path}: {why}")
        self.path = path
        self.kind = kind

    @property
    def special(self):
        return self.kind in self.POSES_AS_A_FILE


def checked(path, folder=False):
    """The os.stat of `path`, refused unless it is a regular file (a folder, when `folder`); links
    are followed. Nothing is opened."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            raise FileProblem(path, "missing", "a link to a file that does not exist") from None
        raise FileProblem(path, "missing", "no such folder" if folder else "no such file") from None
    except OSError as e:
        raise FileProblem(path, "unreadable", f"cannot read it ({e.strerror})") from None
    mode = info.st_mode
    if folder and stat.S_ISDIR(mode):
        return info
    if not folder and stat.S_ISREG(mode):
        return info
    if stat.S_ISDIR(mode):
        raise FileProblem(path, "folder", "a folder, not a file")
    if folder:
        raise FileProblem(path, "not a folder", "not a folder")
    if stat.S_ISFIFO(mode):
        raise FileProblem(path, "pipe", "a pipe, not a regular file")
    if stat.S_ISSOCK(mode):
        raise FileProblem(path, "socket", "a socket, not a regular file")
    raise FileProblem(path, "device", "a device or other special file, not a regular file")


def open_checked(path):
    """`path` opened for binary reading once checked. Opened without waiting (O_NONBLOCK), then
    checked again, so that a pipe put in its place meanwhile is refused too."""
    checked(path)
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise FileProblem(path, "unreadable", f"cannot read it ({e.strerror})") from None
    file = os.fdopen(descriptor, "rb")
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        file.close()
        checked(path)
        raise FileProblem(path, "unreadable", "changed while it was opened; try again")
    os.set_blocking(descriptor, True)
    return file


def read_bytes(path):
    with open_checked(path) as f:
        return f.read()


def names_in(folder):
    """The sorted names in `folder`; one that cannot be listed is a FileProblem."""
    try:
        with os.scandir(folder) as entries:
            return sorted(entry.name for entry in entries)
    except OSError as e:
        checked(folder, folder=True)
        raise FileProblem(folder, "unreadable", f"cannot list it ({e.strerror})") from None


def files_under(folder, leave_out=None):
    """Every entry under `folder` that is not a folder, sorted by path (folder by folder), hidden
    ones and the folder `leave_out` left out. Links to folders are followed, once each. A folder
    that cannot be listed is a FileProblem; what only poses as a file is listed, for the reader's
    check to refuse."""
    found = []
    seen = set()
    skip = Path(leave_out).resolve() if leave_out is not None else None

    def walk(current):
        info = checked(current, folder=True)
        if (info.st_dev, info.st_ino) in seen or current.resolve() == skip:
            return
        seen.add((info.st_dev, info.st_ino))
        for name in names_in(current):
            path = current / name
            if name.startswith("."):
                continue
            if os.path.isdir(path):
                walk(path)
            else:
                found.append(path)

    walk(Path(folder))
    return found


def temp_path(path):
    """A hidden name beside `path` for its content until whole."""
    path = Path(path)
    return path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")


def put_in_place(temp, path):
    """Rename the whole file at `temp` to `path`, on disk first."""
    with open(temp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(temp, path)


def read_json(path):
    """The JSON object in `path`, or None where there is none; what only poses as a file there is
    a FileProblem (it is not the tool's to replace)."""
    try:
        record = json.loads(read_bytes(path))
    except FileProblem as e:
        if e.special:
            raise
        return None
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def write_json(path, record):
    write_atomically(path, (json.dumps(record, indent=1) + "\n").encode())


def write_atomically(path, data):
    """Write `data` (bytes) to `path` through a temporary name."""
    temp = temp_path(path)
    try:
        with open(temp, "wb") as f:
            f.write(data)
        put_in_place(temp, path)
    finally:
        temp.unlink(missing_ok=True)


class UnusableFolder(Exception):
    """A folder cannot be made or opened, or another run holds its lock: the message says why, and
    what to do."""


@contextlib.contextmanager
def locked(folder):
    """Hold `folder`'s lock (made if need be) for the `with` block; yields its descriptor, which a
    forked process must close (its copy would hold the lock). A run that finds the record of one
    that was killed says so."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError as e:
        # mkdir says "File exists" of a file where the folder would be
        in_the_way = isinstance(e, (FileExistsError, NotADirectoryError))
        reason = "a file stands in its path" if in_the_way else e.strerror
        raise UnusableFolder(f"cannot use the folder {folder} ({reason}): pick another one")
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        holder = owner(folder)
        if holder:
            print(f"the run that was writing to {folder} (pid {holder[0]} on {holder[1]}) is gone: "
                  "taking over its lock, going on from its finished shards", file=sys.stderr)
        write_json(folder / OWNER, {"host": socket.gethostname(), "pid": os.getpid()})
    except BlockingIOError:
        os.close(descriptor)
        raise UnusableFolder(busy(folder)) from None
    except OSError as e:
        # writing the lock's record: a read-only file system, say
        os.close(descriptor)
        if os.path.isdir(folder / OWNER):
            raise UnusableFolder(f"{folder / OWNER}: a folder, where the lock's record goes: move it "
                                 "away, then rerun") from None
        raise UnusableFolder(f"cannot write to the folder {folder} ({e.strerror}): make it "
                             "writable, or pick another one") from None
    except BaseException:
        os.close(descriptor)
        raise
    try:
        yield descriptor
    finally:
        try:
            (folder / OWNER).unlink(missing_ok=True)
        finally:
            os.close(descriptor)


def owner(folder):
    """(pid, host) of the run recorded as the holder of the folder's lock, or None."""
    try:
        record = read_json(folder / OWNER) or {}
        return int(record["pid"]), str(record["host"])
    except (FileProblem, KeyError, TypeError, ValueError):
        return None


def busy(folder):
    """Why the folder's lock is not ours, and what to do."""
    holder = owner(folder)
    if holder is None:
        return f"another run is writing to {folder}; wait for it to finish"
    pid, host = holder
    if host == socket.gethostname() and not running(pid):
        return (f"the run that was writing to {folder} (pid {pid} on {host}) is gone, but "
                "processes it started still hold the folder's lock: stop them (e.g. `fuser -k "
                f"{folder}`), then rerun")
    return (f"another run (pid {pid} on {host}) is writing to {folder}; wait for it to finish, or "
            "stop it")


def running(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        # not ours to signal, but there
        pass
    return True
