"""pytest's fixtures and hooks: synthetic shards with learnable structure, the smoke runs that tests
share, the background queue started at session start (its jobs' wall times printed at the end), and
no process left behind. The shared functions live in tests/helpers.py and tests/processes.py
(started processes), which test modules import."""
import gc
import signal
import socket

import pytest
from processes import WARM_PYTHON
from processes import kill_every_live_group

# The warm interpreter's imports first: they run on the second core while this process imports
# torch and collects the tests on the first (the background queue starts after the collection)
WARM_PYTHON.start()
# torch's import and the test modules' collection with Python's collector off, their objects then
# frozen out of later collections at session start (helpers.imported_frozen, for this process):
# about a second less before the first test, while one core works alone
gc.disable()
from helpers import BACKGROUND  # noqa: E402
from helpers import SmokeRuns  # noqa: E402
from helpers import markov_stream  # noqa: E402

import train_gpt  # noqa: E402


@pytest.fixture(scope="session")
def markov_shards(tmp_path_factory):
    """Two train shards and one val shard of the Markov stream; returns (train glob, val glob, val
    tokens)."""
    folder = tmp_path_factory.mktemp("markov")
    for k in (1, 2):
        tokens = markov_stream(60_000, seed=k)
        train_gpt.write_data_shard(folder / f"markov_train_{k:06d}.bin", tokens)
    val = markov_stream(20_000, seed=0)
    train_gpt.write_data_shard(folder / "markov_val_000000.bin", val)
    return str(folder / "markov_train_*.bin"), str(folder / "markov_val_*.bin"), val


@pytest.fixture(scope="session")
def smoke_runs(markov_shards, tmp_path_factory, request):
    return SmokeRuns(markov_shards, tmp_path_factory, request)


@pytest.fixture(scope="session")
def smoke_logs(smoke_runs):
    """Paths of finished logs written by real smoke runs of the trainer (CPU)."""
    return [smoke_runs.short(1), smoke_runs.short(2), smoke_runs.full()]


@pytest.fixture
def no_hang():
    """A test that would block (opening a pipe, say) fails after 60 s instead."""
    def timed_out(signum, frame):
        raise TimeoutError("the run blocked")
    previous = signal.signal(signal.SIGALRM, timed_out)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def torchrun_worker(monkeypatch):
    """Makes this process look like a worker torchrun started, its agent answering on a port of the
    test's own; with the given variables (RANK=1, say) over those of a 1-process launch."""
    agent = socket.create_server(("127.0.0.1", 0))

    def launched(**variables):
        torchrun = dict(RANK=0, WORLD_SIZE=1, LOCAL_RANK=0, LOCAL_WORLD_SIZE=1,
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=agent.getsockname()[1],
                        TORCHELASTIC_RUN_ID="test", TORCHELASTIC_USE_AGENT_STORE="True")
        for name, value in dict(torchrun, **variables).items():
            monkeypatch.setenv(name, str(value))
    yield launched
    agent.close()


def stop_as_on_ctrl_c(signum, frame):
    """SIGTERM (from `timeout`, say) ends the session as Ctrl-C does: through its teardown, which
    kills the processes the tests started."""
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


def pytest_configure(config):
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, stop_as_on_ctrl_c)


def pytest_collection_modifyitems(items):
    """Stable: the tests awaiting background work come last, when that work has had time to
    finish (and in the order of their jobs, once these are queued: launch_background_work)."""
    items.sort(key=lambda item: item.get_closest_marker("background") is not None)


def skipped(item):
    """Whether a skipif mark skips the test (no triton, say): it needs no runs then."""
    return any(mark.args and mark.args[0] for mark in item.iter_markers("skipif"))


def starters(item):
    """The starters named by a test's `background` marks."""
    return [start for mark in item.iter_markers("background") for start in mark.args]


def in_the_order_of_their_jobs(items, jobs):
    """The tests awaiting background work, in the order in which the last job each awaits starts
    (jobs: each starter's futures): the first find their work done, and their in-process parts run
    beside the last jobs, not after them. pytest has already picked the one after the first test."""
    def last_job(item):
        return max((future.rank for start in starters(item) for future in jobs.get(start, ())),
                   default=())
    first = next((i for i, item in enumerate(items) if starters(item)), len(items))
    first = max(first, 2)
    items[first:] = sorted(items[first:], key=last_job)


@pytest.fixture(scope="session", autouse=True)
def launch_background_work(request):
    """Calls, once each, the starters named by the collected tests' `background` marks, each giving
    its jobs' futures, and orders these tests by them; at the end, no started process is left
    running."""
    gc.freeze()
    gc.enable()
    jobs = {}
    with BACKGROUND.held():
        for item in request.session.items:
            for start in starters(item):
                if start not in jobs and not skipped(item):
                    futures = start(request)
                    futures = futures if isinstance(futures, list) else [futures]
                    jobs[start] = [future for future in futures if future is not None]
    in_the_order_of_their_jobs(request.session.items, jobs)
    # one thread: beside background work, one core each (two threads here, on a busy core, stall
    # at every parallel op, tens of ms); and alone, the small ops of these tests spend a second
    # thread's time spinning (a tiny whole run on the shared 2-core machine: twice the CPU time,
    # and more wall time, with two)
    train_gpt.torch.set_num_threads(1)
    yield
    # after a stop (-x, Ctrl-C): no new runs, and what runs is killed
    BACKGROUND.cancel_waiting()
    kill_every_live_group()


def pytest_terminal_summary(terminalreporter):
    """Each background job's wall time (and its processes' CPU time): they run beside the tests, out
    of `--durations`' sight."""
    if not BACKGROUND.seconds:
        return
    terminalreporter.section("background jobs: wall time (CPU time of their processes)")
    for key, seconds in sorted(BACKGROUND.seconds.items(), key=lambda item: -item[1]):
        cpu = BACKGROUND.cpu_seconds.get(key, 0)
        terminalreporter.write_line(f"{seconds:7.1f}s ({cpu:6.1f}s) {key}")
    total = sum(BACKGROUND.seconds.values())
    cpu = sum(BACKGROUND.cpu_seconds.values())
    terminalreporter.write_line(f"{total:7.1f}s ({cpu:6.1f}s) in all")


def pytest_unconfigure(config):
    """One full collection, then the survivors frozen: pytest's own collections at its end (five)
    and the interpreter's at exit skip torch's objects, seconds of a session that compiled."""
    gc.collect()
    gc.freeze()
