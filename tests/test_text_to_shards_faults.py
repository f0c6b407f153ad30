"""data/text_to_shards.py when things go wrong around it: a tokenizing worker killed, failing or
stuck, the run stopped by a signal or killed outright (also while its workers start, or when a fork
is refused), an input changed since its shards were made (or while they are made), the swap of new
shards for old interrupted at any moment, a pipe or a device given as input or found in the output
folder, a folder that cannot be listed. Each is checked against what the user is left with: the
exit status, the last line, the files and their bytes, and that no process stays behind. Runs that
a signal must reach, or that could hang, are separate processes (slow); the rest run in this
process.

    python -m pytest tests/test_text_to_shards_faults.py -q"""
import errno
import itertools
import json
import multiprocessing
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import files
import numpy as np
import pytest
import shards
import text_to_shards
import tiktoken
import workers
from helpers import REPO
from helpers import launch_env

WORDS = ["the", "speedrun", "na\u00efve", "token", "shard", "d\u00e9j\u00e0", "42"]
OPTIONS = ["--val_tokens", "300", "--shard_tokens", "5000"]
# documents in each of the two inputs: about 28,000 tokens each, so 12 train shards in all
DOCUMENTS = 150

# the command line in a fresh process, with a one-token-per-byte encoding; each worker writes its
# pid into WORKERS_DIR on its first chunk and then takes SLOW seconds per chunk, so that a test can
# act while the run is in the middle of its work
CHILD = """
import os, signal, sys, time, tiktoken
import text_to_shards
# as a terminal's Python starts, whatever the suite's process left blocked or ignored: Ctrl-C
# raises KeyboardInterrupt, the stop signals arrive
signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
signal.signal(signal.SIGINT, signal.default_int_handler)
ranks = {bytes([b]): b for b in range(256)}
encoding = tiktoken.Encoding("bytes", pat_str=r"\\S+|\\s+", mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 50256})
encode_pieces = text_to_shards.encode_pieces
def slow(task, encoding, text_field):
    mark = os.path.join(os.environ["WORKERS_DIR"], str(os.getpid()))
    if not os.path.exists(mark):
        open(mark, "w").close()
    time.sleep(float(os.environ["SLOW"]))
    return encode_pieces(task, encoding, text_field)
text_to_shards.encode_pieces = slow
text_to_shards.CHUNK_BYTES = 300
sys.exit(text_to_shards.main(sys.argv[1:], encoding=encoding))
"""

# the command line in a fresh process, whose tokenizer, when HOW says so, cannot finish: it raises
# what a Rust panic raises (pyo3's PanicException, no Exception), or it is stuck in a C call that
# holds the GIL, or it waits on nothing; a stuck worker is told after 2 s, not 10
BROKEN_CHILD = """
import ctypes, os, sys, threading, tiktoken
import text_to_shards
try:
    import workers
    workers.STUCK_SECONDS = 2
except ImportError:
    pass
ranks = {bytes([b]): b for b in range(256)}
encoding = tiktoken.Encoding("bytes", pat_str=r"\\S+|\\s+", mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 50256})
class PanicException(BaseException):
    pass
def broken(*args, **kwargs):
    if os.environ["HOW"] == "panics":
        raise PanicException("memory allocation of 5795635 bytes failed")
    if os.environ["HOW"] == "is stuck holding the GIL":
        ctypes.PyDLL(None).pause()
    threading.Event().wait()
if os.environ["HOW"]:
    encoding.encode_ordinary = broken
    encoding.encode_to_numpy = broken
sys.exit(text_to_shards.main(sys.argv[1:], encoding=encoding))
"""


def byte_encoding():
    """The same encoding as CHILD's, for runs in this process."""
    ranks = {bytes([b]): b for b in range(256)}
    return tiktoken.Encoding("bytes", pat_str=r"\S+|\s+", mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 50256})


def write_corpus(path, count, seed=0):
    """`count` JSON Lines documents of 0 to 60 words, seeded."""
    rng = np.random.default_rng(seed)
    lines = [json.dumps({"text": " ".join(rng.choice(WORDS, rng.integers(0, 61)))})
             for _ in range(count)]
    path.write_text("\n".join(lines) + "\n")
    return path


def make(paths, out, *options, workers=1):
    """The command line in this process; its exit status."""
    argv = [*map(str, paths), "--out", str(out), "--name", "corpus", "--workers", str(workers),
            *OPTIONS, *options]
    return text_to_shards.main(argv, encoding=byte_encoding())


def file_bytes(folder):
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir()) if path.is_file()}


# the processes a test started, each in a session of its own: killed when the test ends
STARTED = []


@pytest.fixture(autouse=True)
def nothing_left_running():
    yield
    for process in STARTED:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.communicate()
    STARTED.clear()


def start(paths, out, tmp_path, workers=2, slow=0.05):
    """The command line in its own process and session, slowed down (its group killed when the
    test ends, should it fail first); (process, folder of worker pids)."""
    workers_dir = tmp_path / f"workers{time.monotonic_ns()}"
    workers_dir.mkdir()
    env = launch_env(PYTHONPATH=str(REPO / "data"), WORKERS_DIR=str(workers_dir), SLOW=str(slow))
    command = [sys.executable, "-c", CHILD, *map(str, paths), "--out", str(out), "--name",
               "corpus", "--workers", str(workers), *OPTIONS]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    STARTED.append(process)
    return process, workers_dir


def worker_pids(process, workers_dir, count):
    """The pids of `count` workers once each has begun its work (within 30 s)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and process.poll() is None:
        pids = [int(name) for name in os.listdir(workers_dir)]
        if len(pids) == count:
            return pids
        time.sleep(0.05)
    raise AssertionError(f"the workers did not start: {process.poll()}")


def alive(pid):
    """Whether `pid` is a live process (a zombie is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def finish(process, timeout=20):
    """Wait for the process (killing its session if it hangs: a failed test leaves nothing
    behind); (exit status, stderr's last line)."""
    try:
        _, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise AssertionError(f"still running {timeout} s on") from None
    return process.returncode, (err.strip().splitlines() or [""])[-1]


def gone(pids, within=10):
    """Whether every one of `pids` has ended within `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(alive(pid) for pid in pids):
            return True
        time.sleep(0.05)
    return False


def write_inputs(folder):
    """The two inputs, DOCUMENTS each."""
    return [write_corpus(folder / "a.jsonl", DOCUMENTS, seed=1),
            write_corpus(folder / "b.jsonl", DOCUMENTS, seed=2)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Inputs that no test changes, and the bytes of the folder that one uninterrupted run makes
    of them (the shards' record names the inputs, not the folder), made once for the tests that
    stop, kill or break runs on them."""
    folder = tmp_path_factory.mktemp("corpus")
    paths = write_inputs(folder)
    assert make(paths, folder / "whole") == 0
    return paths, file_bytes(folder / "whole")


@pytest.fixture
def inputs(tmp_path):
    """Inputs of this test's own, for a test that changes them."""
    return write_inputs(tmp_path)


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")


# Processes ---------------------------------------------------------------------------------------
@needs_proc
@pytest.mark.slow
def test_a_killed_worker_ends_the_run_in_one_line_and_a_rerun_gives_the_same_bytes(tmp_path,
                                                                                    corpus):
    paths, whole = corpus
    out = tmp_path / "out"
    process, workers_dir = start(paths, out, tmp_path)
    victim, other = worker_pids(process, workers_dir, 2)
    began = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    status, last = finish(process)
    assert time.monotonic() - began < 10
    assert status == 1
    assert last.startswith(f"error: a tokenizing worker (pid {victim}) was killed by SIGKILL"), last
    assert "fewer --workers" in last
    assert gone([other])
    assert make(paths, out, workers=2) == 0
    assert file_bytes(out) == whole


@needs_proc
@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stop_signal_ends_the_run_and_its_workers_and_a_rerun_goes_on(tmp_path, corpus, signum):
    paths, whole = corpus
    out = tmp_path / "out"
    process, workers_dir = start(paths, out, tmp_path)
    workers = worker_pids(process, workers_dir, 2)
    # as a terminal sends it: to the whole process group
    os.killpg(process.pid, signum)
    status, last = finish(process)
    assert status == 130
    assert last.startswith(f"interrupted: the finished shards in {out} are kept"), last
    assert gone(workers)
    assert make(paths, out) == 0
    assert file_bytes(out) == whole


@needs_proc
@pytest.mark.slow
def test_workers_end_with_a_killed_run_whose_lock_the_rerun_takes_over(tmp_path, corpus, capsys):
    paths, whole = corpus
    out = tmp_path / "out"
    process, workers_dir = start(paths, out, tmp_path, slow=0.2)
    workers = worker_pids(process, workers_dir, 2)
    os.kill(process.pid, signal.SIGKILL)
    finish(process)
    assert gone(workers)
    capsys.readouterr()
    assert make(paths, out) == 0
    err = capsys.readouterr().err
    owner = f"pid {process.pid} on {socket.gethostname()}"
    assert f"the run that was writing to {out} ({owner}) is gone: taking over its lock" in err
    assert file_bytes(out) == whole


@pytest.mark.slow
def test_a_running_owner_keeps_its_lock(tmp_path, corpus, capsys):
    paths, whole = corpus
    out = tmp_path / "out"
    process, workers_dir = start(paths, out, tmp_path, slow=0.2)
    try:
        worker_pids(process, workers_dir, 2)
        assert make(paths, out) == 1
        last = capsys.readouterr().err.strip().splitlines()[-1]
        owner = f"pid {process.pid} on {socket.gethostname()}"
        expected = f"error: another run ({owner}) is writing to {out}; wait for it to finish, or "
        assert last == expected + "stop it"
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        finish(process)


# Changed inputs ----------------------------------------------------------------------------------
def test_a_bad_line_appended_to_an_input_leaves_the_finished_dataset_as_it_was(tmp_path, inputs,
                                                                               capsys):
    paths = inputs
    out = tmp_path / "out"
    assert make(paths, out) == 0
    whole = file_bytes(out)
    with open(paths[1], "a") as f:
        f.write('{"text": "fine"}\n{"text": unquoted}\n')
    capsys.readouterr()
    assert make(paths, out) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"error: {paths[1]}: line {DOCUMENTS + 2}: not valid JSON"), last
    assert file_bytes(out) == whole
    assert sorted(path.name for path in out.iterdir()) == sorted(whole)


def test_a_changed_input_is_made_beside_the_old_dataset_then_swapped_in(tmp_path, inputs,
                                                                        monkeypatch):
    paths = inputs
    out = tmp_path / "out"
    assert make(paths, out) == 0
    whole = file_bytes(out)
    write_corpus(paths[0], 200, seed=3)
    # what the new inputs give, made in a folder of their own
    assert make(paths, tmp_path / "fresh") == 0
    fresh = file_bytes(tmp_path / "fresh")
    assert fresh != whole
    rename = shards.ShardWriter.rename
    renamed = []

    def interrupted_rename(writer, shard):
        if len(renamed) == 2:
            raise KeyboardInterrupt
        renamed.append(shard.name)
        rename(writer, shard)

    monkeypatch.setattr(shards.ShardWriter, "rename", interrupted_rename)
    assert make(paths, out) == 130
    assert file_bytes(out) == whole
    monkeypatch.setattr(shards.ShardWriter, "rename", rename)
    assert make(paths, out) == 0
    assert file_bytes(out) == fresh
    assert sorted(path.name for path in out.iterdir()) == sorted(fresh)


def test_an_interrupted_swap_is_finished_by_the_rerun(tmp_path, inputs, monkeypatch):
    paths = inputs
    out = tmp_path / "out"
    assert make(paths, out) == 0
    write_corpus(paths[1], 100, seed=4)
    assert make(paths, tmp_path / "fresh") == 0
    replace = os.replace
    moved = []

    def interrupted_replace(source, target):
        if ".text_to_shards.next" in str(source) and str(source).endswith(".bin"):
            if len(moved) == 1:
                raise KeyboardInterrupt
            moved.append(source)
        replace(source, target)

    monkeypatch.setattr(text_to_shards.os, "replace", interrupted_replace)
    assert make(paths, out) == 130
    monkeypatch.setattr(text_to_shards.os, "replace", replace)
    assert make(paths, out) == 0
    assert file_bytes(out) == file_bytes(tmp_path / "fresh")


def test_a_change_that_keeps_size_and_modification_time_is_seen(tmp_path, inputs, capsys):
    paths = inputs
    out = tmp_path / "out"
    assert make(paths, out) == 0
    whole = file_bytes(out)
    before = os.stat(paths[0])
    text = paths[0].read_bytes()
    # one word for another of the same length, and the modification time set back
    changed = text.replace(b"token", b"shard", 1)
    assert changed != text and len(changed) == len(text)
    paths[0].write_bytes(changed)
    os.utime(paths[0], ns=(before.st_atime_ns, before.st_mtime_ns))
    assert make(paths, tmp_path / "fresh") == 0
    capsys.readouterr()
    assert make(paths, out) == 0
    assert "an input changed since the shards" in capsys.readouterr().err
    assert file_bytes(out) == file_bytes(tmp_path / "fresh") != whole


def test_an_input_changed_while_it_is_read_is_one_line(tmp_path, inputs, capsys):
    paths = inputs
    inputs = text_to_shards.local_inputs(paths, tmp_path / "out")
    with open(paths[1], "a") as f:
        f.write('{"text": "late"}\n')
    with pytest.raises(text_to_shards.InputError, match="changed while this run was reading it"):
        text_to_shards.convert(inputs, tmp_path / "out", "corpus", byte_encoding(), val_tokens=300)


# Inputs that are not files -----------------------------------------------------------------------
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_pipe_as_input_is_refused_in_one_line_without_waiting_on_it(tmp_path, capsys):
    pipe = tmp_path / "pipe.jsonl"
    os.mkfifo(pipe)
    assert make([pipe], tmp_path / "out") == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {pipe}: a pipe, not a regular file: its text could be read only "
                          "once"), err
    assert "\n" not in err


@pytest.mark.parametrize("again", ["the file in its folder", "a link to it", "a copy of it"])
def test_a_text_given_twice_is_refused_before_its_documents_reach_val_and_train(tmp_path, capsys,
                                                                                again):
    folder = tmp_path / "texts"
    folder.mkdir()
    first = write_corpus(folder / "a.jsonl", DOCUMENTS, seed=1)
    write_corpus(folder / "b.jsonl", DOCUMENTS, seed=2)
    second = {"the file in its folder": first, "a link to it": tmp_path / "link.jsonl",
              "a copy of it": tmp_path / "copy.jsonl"}[again]
    if again == "a link to it":
        second.symlink_to(first)
    if again == "a copy of it":
        second.write_bytes(first.read_bytes())
    assert make([folder, second], tmp_path / "out") == 1
    err = capsys.readouterr().err.strip()
    how = f"holds the same bytes as {first}" if again == "a copy of it" else (
        f"is read twice (first as {first}: given again, or linked to)")
    assert err == (f"error: {second} {how}: its documents could be in both the val and the train "
                   "shards; give each text once")
    assert not (tmp_path / "out").exists()


def test_an_input_folder_that_is_the_output_folder_is_named_as_such(tmp_path, inputs, capsys):
    folder = inputs[0].parent
    assert make([folder], folder) == 1
    assert capsys.readouterr().err.strip() == (f"error: {folder} is the output folder too (--out): "
                                               "pick another --out")


def test_a_record_that_is_not_the_tools_says_both_ways_on(tmp_path, inputs, capsys):
    out = tmp_path / "out"
    assert make(inputs, out) == 0
    (out / "text_to_shards.json").write_text("garbage\n")
    capsys.readouterr()
    assert make(inputs, out) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {out / 'text_to_shards.json'} is not the record this script")
    assert err.endswith("pass another --out (a folder holds one dataset's shards), or delete that "
                        "folder to make it again")


@pytest.mark.parametrize("out", ["a_file", "a_file/shards"])
def test_an_output_folder_where_a_file_stands_is_one_line(tmp_path, inputs, capsys, out):
    (tmp_path / "a_file").write_text("kept")
    assert make(inputs, tmp_path / out) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"error: cannot use the folder {tmp_path / out} (a file stands in its path): "
                   "pick another one")
    assert (tmp_path / "a_file").read_text() == "kept"


def test_an_output_folder_that_cannot_be_written_is_one_line(tmp_path, inputs, capsys, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()

    # as on a read-only file system (root writes past permission bits)
    def read_only(path, data):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(files, "write_atomically", read_only)
    assert make(inputs, out) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"error: cannot write to the folder {out} (Read-only file system): make it "
                   "writable, or pick another one")


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_a_device_as_input_is_refused_in_one_line(tmp_path, capsys):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"text": "fine"}\n')
    os.symlink("/dev/zero", folder / "zero.txt")
    for given, refused in [("/dev/zero", "/dev/zero"), (folder, folder / "zero.txt")]:
        assert make([given], tmp_path / "out") == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: {refused}: a device or other special file"), err
        assert "\n" not in err


@pytest.mark.slow
def test_a_worker_that_fails_ends_the_run_in_one_line(tmp_path, corpus, capsys, monkeypatch):
    paths, whole = corpus

    def out_of_memory(task, encoding, text_field):
        raise MemoryError("cannot allocate")

    # the forked workers run the patched function
    monkeypatch.setattr(text_to_shards, "encode_pieces", out_of_memory)
    assert make(paths, tmp_path / "out", workers=2) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: a tokenizing worker failed (MemoryError: cannot allocate)"), last
    assert "fewer --workers" in last
    assert not [path for path in (tmp_path / "out").iterdir() if path.suffix == ".tmp"]


@needs_proc
@pytest.mark.slow
def test_a_lock_held_by_what_a_dead_run_left_says_what_to_stop(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    # a process holding the folder's lock whose recorded owner is a run that has ended
    # (-S: no site-packages, a quicker start)
    holder = subprocess.Popen([sys.executable, "-S", "-c", "import fcntl, os, sys, time; "
                               "fcntl.flock(os.open(sys.argv[1], os.O_RDONLY), fcntl.LOCK_EX); "
                               "print('held', flush=True); time.sleep(60)", str(out)],
                              stdout=subprocess.PIPE, text=True)
    ended = subprocess.run([sys.executable, "-S", "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)
    try:
        assert holder.stdout.readline() == "held\n"
        owner = {"host": socket.gethostname(), "pid": int(ended.stdout)}
        (out / files.OWNER).write_text(json.dumps(owner))
        write_corpus(tmp_path / "a.jsonl", 20)
        assert make([tmp_path / "a.jsonl"], out) == 1
        last = capsys.readouterr().err.strip().splitlines()[-1]
        owner_line = f"pid {ended.stdout.strip()} on {socket.gethostname()}"
        expected = f"error: the run that was writing to {out} ({owner_line}) is gone, but processes"
        assert last.startswith(expected), last
    finally:
        holder.kill()
        holder.wait()


def run_broken(paths, out, how="", workers=2, timeout=60):
    """BROKEN_CHILD on the inputs, in a session of its own: (the finished process, its process
    group). A run still going after `timeout` seconds fails the test."""
    env = launch_env(PYTHONPATH=str(REPO / "data"), HOW=how)
    command = [sys.executable, "-c", BROKEN_CHILD, *map(str, paths), "--out", str(out), "--name",
               "corpus", "--workers", str(workers), *OPTIONS]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    STARTED.append(process)
    try:
        out_text, err_text = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running {timeout} s on") from None
    return subprocess.CompletedProcess(command, process.returncode, out_text, err_text), process.pid


def group_alive(group):
    """Whether a process of process group `group` is alive (a zombie is not), within 5 s."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        members = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == group and fields[0] != "Z":
                members.append(stat)
        if not members:
            return False
        time.sleep(0.05)
    return True


# Stuck is not dead -------------------------------------------------------------------------------
@needs_proc
@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("how", ["panics", "is stuck holding the GIL", "is stuck waiting"])
def test_a_worker_that_cannot_finish_ends_the_run_in_one_line_within_seconds(tmp_path, corpus,
                                                                             how, workers):
    paths, whole = corpus
    out = tmp_path / "out"
    began = time.monotonic()
    result, group = run_broken(paths, out, how, workers)
    assert time.monotonic() - began < 20
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    if how == "panics":
        expected = r"error: a tokenizing worker failed \(PanicException: memory allocation"
    else:
        expected = r"error: a tokenizing worker stopped answering \(no worker used the CPU in 2 s\)"
    assert re.match(expected, last), last
    assert f"rerun with fewer --workers (this run had {workers})" in last
    assert not group_alive(group)
    # nothing was written: no shard, no temporary file
    assert not [path for path in out.iterdir() if path.suffix in (".bin", ".tmp")]


# The pool itself: a death seen between tasks, a stop while it forks ------------------------------
def test_a_worker_killed_between_tasks_is_one_error_naming_it():
    pool = workers.Workers(2, abs)
    try:
        assert list(pool.answers([-1, -2])) == [1, 2]
        victim = pool.started()[0]
        os.kill(victim.pid, signal.SIGKILL)
        # the pool sees it before the next task is given (which is where it then says so)
        deadline = time.monotonic() + 10
        while not pool.pool._broken and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(workers.WorkerError, match=rf"\(pid {victim.pid}\) was killed by SIGKILL"):
            list(pool.answers([-3] * 100))
    finally:
        pool.stop(gracefully=False)


class Stop(Exception):
    pass


def raise_stop(signum, frame):
    raise Stop


def test_a_stop_signal_while_the_workers_are_forked_ends_the_forking_and_leaves_no_worker():
    # the forks from here on are counted; the first sends this process a SIGTERM from its at-fork
    # hook, which runs in the middle of the fork
    forks = []
    counting = [True]

    def count_and_signal_the_first():
        if counting:
            forks.append(os.getpid())
            if len(forks) == 1:
                os.kill(os.getpid(), signal.SIGTERM)

    os.register_at_fork(before=count_and_signal_the_first)
    previous = signal.signal(signal.SIGTERM, raise_stop)
    try:
        with pytest.raises(Stop):
            workers.Workers(8, abs)
    finally:
        counting.clear()
        signal.signal(signal.SIGTERM, previous)
    assert len(forks) == 1
    assert multiprocessing.active_children() == []


def test_a_fork_refused_is_one_error_and_leaves_no_worker(monkeypatch):
    fork = os.fork
    forks = []

    def fork_twice():
        forks.append(1)
        if len(forks) == 3:
            raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN))
        return fork()

    monkeypatch.setattr(os, "fork", fork_twice)
    with pytest.raises(workers.WorkerError, match=r"^cannot start a worker \(Resource temporarily"):
        workers.Workers(4, abs)
    assert multiprocessing.active_children() == []


# a run whose workers start slowly, as on a machine under load: each writes its pid into
# WORKERS_DIR as it is forked, then sleeps a second before it starts
SLOW_START = """
import os, sys, time
import workers
def slow_start():
    open(os.path.join(os.environ["WORKERS_DIR"], str(os.getpid())), "w").close()
    time.sleep(1)
os.register_at_fork(after_in_child=slow_start)
workers.Workers(3, abs)
"""


@needs_proc
@pytest.mark.slow
def test_workers_still_starting_when_the_run_is_killed_leave_at_once(tmp_path):
    workers_dir = tmp_path / "workers"
    workers_dir.mkdir()
    env = launch_env(PYTHONPATH=str(REPO / "data"), WORKERS_DIR=str(workers_dir))
    process = subprocess.Popen([sys.executable, "-c", SLOW_START], env=env, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    STARTED.append(process)
    pids = worker_pids(process, workers_dir, 3)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert gone(pids)


# Every path checked before it is opened ----------------------------------------------------------
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
@pytest.mark.slow
@pytest.mark.parametrize("where", ["text_to_shards.json", "corpus_train_000002.bin",
                                   ".text_to_shards.next/text_to_shards.json"])
def test_a_pipe_in_the_output_folder_is_one_line_not_a_hang(tmp_path, corpus, where):
    paths, whole = corpus
    out = tmp_path / "out"
    (out / ".text_to_shards.next").mkdir(parents=True)
    for name, content in whole.items():
        (out / name).write_bytes(content)
    (out / where).unlink(missing_ok=True)
    os.mkfifo(out / where)
    result, _ = run_broken(paths, out, timeout=30)
    assert result.returncode == 1
    assert result.stderr.strip() == (f"error: {out / where}: a pipe, not a regular file: move it "
                                     "away, or pick another --out")
    # nothing was opened, replaced or deleted
    assert (out / where).is_fifo()
    assert {name: content for name, content in file_bytes(out).items()} == {
        name: content for name, content in whole.items() if name != where}


@pytest.mark.parametrize("what", ["a folder that cannot be listed", "a link to nowhere"])
def test_what_an_input_folder_holds_that_cannot_be_read_is_one_line_never_skipped(
        tmp_path, monkeypatch, capsys, what):
    folder = tmp_path / "in"
    for seed, part in enumerate("abc"):
        (folder / part).mkdir(parents=True)
        write_corpus(folder / part / "part.jsonl", 10, seed=seed)
    if what == "a folder that cannot be listed":
        # as for a user without the right to list it: os.scandir is what glob and rglob call too
        scandir = os.scandir

        def denied(path="."):
            if Path(path) == folder / "b":
                raise PermissionError(13, "Permission denied", str(path))
            return scandir(path)

        monkeypatch.setattr(os, "scandir", denied)
        expected = f"error: {folder / 'b'}: cannot list it (Permission denied)"
    else:
        os.symlink(tmp_path / "moved_away.jsonl", folder / "b" / "link.jsonl")
        expected = f"error: {folder / 'b' / 'link.jsonl'}: a link to a file that does not exist"
    assert make([folder], tmp_path / "out") == 1
    assert capsys.readouterr().err.strip() == expected
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*.bin"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root may list any folder")
def test_an_input_folder_without_the_right_to_list_it_is_one_line(tmp_path, capsys):
    folder = tmp_path / "in"
    for part in "ab":
        (folder / part).mkdir(parents=True)
        write_corpus(folder / part / "part.jsonl", 10)
    (folder / "b").chmod(0)
    try:
        assert make([folder], tmp_path / "out") == 1
    finally:
        (folder / "b").chmod(0o755)
    assert capsys.readouterr().err.strip() == (f"error: {folder / 'b'}: cannot list it "
                                               "(Permission denied)")


# A swap of new shards for old, interrupted at any moment -----------------------------------------
def shards_of(folder):
    """The shard files and the shards the record lists (its stamps change as the inputs' times
    do)."""
    listed = json.loads((folder / text_to_shards.MANIFEST).read_text())["shards"]
    return {path.name: path.read_bytes() for path in folder.glob("*.bin")}, listed


@pytest.mark.slow
@pytest.mark.parametrize("rerun", ["the same inputs", "inputs changed again, with a bad line"])
def test_a_swap_interrupted_at_any_moment_is_finished_by_the_next_run(tmp_path, monkeypatch,
                                                                       capsys, rerun):
    paths = [write_corpus(tmp_path / "a.jsonl", 40, seed=1),
             write_corpus(tmp_path / "b.jsonl", 40, seed=2)]
    assert make(paths, tmp_path / "old") == 0
    # the changed inputs make fewer shards: the swap moves some and deletes the others
    write_corpus(paths[1], 10, seed=3)
    assert make(paths, tmp_path / "fresh") == 0
    fresh = shards_of(tmp_path / "fresh")
    assert len(fresh[0]) < len(list((tmp_path / "old").glob("*.bin")))
    changed = paths[1].read_bytes()
    replace = os.replace
    unlink = os.unlink
    rmtree = shutil.rmtree
    for moment in itertools.count():
        out = tmp_path / f"out{moment}"
        shutil.copytree(tmp_path / "old", out)
        staged = out / ".text_to_shards.next" / text_to_shards.MANIFEST
        steps = []

        def step(operation):
            def interrupted(*args, **kwargs):
                # once the new shards are complete, each change to the folders is a moment; the
                # run is interrupted once, before the change of this moment
                if staged.exists() and json.loads(staged.read_text()).get("complete"):
                    steps.append(args[0])
                    if len(steps) == moment + 1:
                        raise KeyboardInterrupt
                return operation(*args, **kwargs)
            return interrupted

        monkeypatch.setattr(os, "replace", step(replace))
        monkeypatch.setattr(os, "unlink", step(unlink))
        monkeypatch.setattr(shutil, "rmtree", step(rmtree))
        status = make(paths, out)
        monkeypatch.setattr(os, "replace", replace)
        monkeypatch.setattr(os, "unlink", unlink)
        monkeypatch.setattr(shutil, "rmtree", rmtree)
        if status == 0:
            # past the last moment: the swap went through
            assert moment > 3 and shards_of(out) == fresh
            break
        assert status == 130
        capsys.readouterr()
        if rerun == "the same inputs":
            assert make(paths, out) == 0
        else:
            paths[1].write_bytes(changed + b'{"text": unquoted}\n')
            assert make(paths, out) == 1
            paths[1].write_bytes(changed)
        err = capsys.readouterr().err
        # whatever the moment, the new shards are in place, whole, and said to be
        assert shards_of(out) == fresh, (moment, steps)
        assert not (out / ".text_to_shards.next").exists()
        if moment < len(fresh[0]):
            assert f"{out} now holds the new shards only" in err, err
        if rerun != "the same inputs":
            last = err.strip().splitlines()[-1]
            assert last.startswith(f"error: {paths[1]}: line 11: not valid JSON"), last
            assert last.endswith(f"the shards in {out} are kept as they were, made from the "
                                 "inputs before they changed"), last

