"""data/text_to_shards.py when things go wrong around it: a tokenizing worker killed or failing,
the run stopped by a signal or killed outright, an input changed since its shards were made (or
while they are made), a pipe or a device given as input. Each is checked against what the user is
left with: the exit status, the last line, the files and their bytes, and that no process stays
behind. Runs that a signal must reach are separate processes (slow); the rest run in this
process.

    python -m pytest tests/test_text_to_shards_faults.py -q"""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import files
import numpy as np
import pytest
import shards
import text_to_shards
import tiktoken
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
