"""Shared fixtures: synthetic shards with learnable structure, and real runs of the trainer."""
import concurrent.futures
import ctypes
import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
PROFILE = "records/profile_run.py"  # the profiling tool, which runs the trainer

# CPU steps allocate logits of 100+ MB; glibc maps and zeroes each afresh, which was 40% of a smoke run (page
# faults). Freed memory stays in the heap instead: in this process, and in every process the tests start
MALLOC_KEEP = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2 ** 31 - 1), "MALLOC_TOP_PAD_": str(2 ** 28)}
os.environ.update(MALLOC_KEEP)
for option, name in ((-4, "MALLOC_MMAP_MAX_"), (-1, "MALLOC_TRIM_THRESHOLD_"), (-2, "MALLOC_TOP_PAD_")):
    ctypes.CDLL(None).mallopt(option, int(MALLOC_KEEP[name]))  # M_MMAP_MAX, M_TRIM_THRESHOLD, M_TOP_PAD
sys.path.insert(0, str(REPO))
# The environment of every process the tests start, as it was at session start, without torchrun's variables:
# an in-process test that sets WORLD_SIZE (monkeypatch) while a background run starts must not reach that run.
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "GROUP_RANK", "ROLE_RANK")
SESSION_ENV = {k: v for k, v in os.environ.items()
               if k not in LAUNCH_VARIABLES and not k.startswith("TORCHELASTIC_")}


def launch_env(**extra):
    """The session's environment for a started process, with `extra` set."""
    return dict(SESSION_ENV, **extra)


import train_gpt  # noqa: E402


def load_records_script(name):
    """records/NAME.py as a module (records/ is not a package); registered first, as dataclasses look their
    module up in sys.modules."""
    spec = importlib.util.spec_from_file_location(f"records_{name}", REPO / "records" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module

# Documents of one fixed random Markov chain (4 successors per token): the trainer's own synthetic data,
# learnable to about ln 4 = 1.39 nats, far below the unigram entropy (about ln 256 = 5.5)
markov_stream = train_gpt.markov_stream


def unigram_entropy(tokens):
    counts = np.bincount(tokens)
    p = counts[counts > 0] / len(tokens)
    return float(-(p * np.log(p)).sum())


@pytest.fixture(scope="session")
def markov_shards(tmp_path_factory):
    """Two train shards and one val shard of the Markov stream; returns (train glob, val glob, val tokens)."""
    folder = tmp_path_factory.mktemp("markov")
    for k in (1, 2):
        train_gpt.write_data_shard(folder / f"markov_train_{k:06d}.bin", markov_stream(60_000, seed=k))
    val = markov_stream(20_000, seed=0)
    train_gpt.write_data_shard(folder / "markov_val_000000.bin", val)
    return str(folder / "markov_train_*.bin"), str(folder / "markov_val_*.bin"), val


def run_trainer(args, nproc=1, timeout=600, threads=None, script="train_gpt.py"):
    """Run train_gpt.py (or a tool wrapping it) as users do: plainly for one process, through torchrun for
    several; `threads` per process, by default the cores shared out."""
    if nproc == 1:
        cmd = [sys.executable, str(REPO / script), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(REPO / script), *args]
    env = launch_env(OMP_NUM_THREADS=str(threads or max(1, (os.cpu_count() or 1) // nproc)))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


class Background:
    """Subprocess work run once, one job at a time in a thread, so that it overlaps the in-process tests (which
    use the other core); keyed by name."""

    def __init__(self):
        self.pool = concurrent.futures.ThreadPoolExecutor(1)
        self.futures = {}

    def once(self, key, fn, *args, **kwargs):
        if key not in self.futures:
            self.futures[key] = self.pool.submit(fn, *args, **kwargs)
        return self.futures[key]


BACKGROUND = Background()


def pytest_configure(config):
    config.addinivalue_line("markers", "background(start, ...): start(request) launches the test's subprocess "
                            "work at session start; the test runs after the unmarked ones")


def pytest_collection_modifyitems(items):
    # stable: the tests awaiting background work come last, when that work has had time to finish
    items.sort(key=lambda item: item.get_closest_marker("background") is not None)


@pytest.fixture(scope="session", autouse=True)
def launch_background_work(request):
    """Calls, once each, the starters named by the collected tests' `background` marks."""
    def skipped(item):  # a test skipped here (no triton, say) needs no runs
        return any(mark.args and mark.args[0] for mark in item.iter_markers("skipif"))

    marks = [mark for item in request.session.items if not skipped(item) for mark in item.iter_markers("background")]
    starters = [start for mark in marks for start in mark.args]
    for start in dict.fromkeys(starters):
        start(request)
    if starters:
        # one core each: two threads here, on a busy core, stall at every parallel op (tens of ms)
        train_gpt.torch.set_num_threads(1)
    yield
    BACKGROUND.pool.shutdown(wait=False, cancel_futures=True)  # after a stop (-x, Ctrl-C): no new runs


def smoke_marked(*runs):
    """A `background` mark launching SmokeRuns' runs, each (method name, args...), at session start."""
    def start(request):
        smoke_runs = request.getfixturevalue("smoke_runs")
        for method, *args in runs:
            smoke_runs.launch(getattr(smoke_runs, method), *args)
    return pytest.mark.background.with_args(start)


def finished_log(log_dir):
    logs = sorted(Path(log_dir).glob("*.txt"))
    assert len(logs) == 1, f"expected one log in {log_dir}, found {logs}"
    return logs[0]


class SmokeRuns:
    """Smoke-preset runs on the Markov shards, made once per session and shared by the tests."""

    def __init__(self, shards, tmp_path_factory):
        self.train, self.val, _ = shards
        self.tmp = tmp_path_factory
        self.logs, self.stdout = {}, {}
        self.runs, self.launching = {}, False

    def log(self, name, nproc, *extra, script="train_gpt.py"):
        if name not in self.runs:
            log_dir = self.tmp.mktemp(name)
            args = ["--preset", "smoke", "--log_dir", str(log_dir), *extra]
            self.runs[name] = log_dir, BACKGROUND.once(name, run_trainer, args, nproc, threads=1, script=script)
        if self.launching:
            return None
        if name not in self.logs:
            log_dir, run = self.runs[name]
            result = run.result()
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
            self.logs[name], self.stdout[name] = finished_log(log_dir), result.stdout
        return self.logs[name]

    def launch(self, method, *args):
        """Start a run in the background, without waiting for it."""
        self.launching = True
        try:
            method(*args)
        finally:
            self.launching = False

    # the same short run as 1 and as 2 processes on the Markov shards: 4 steps of 256 tokens, 2 micro-batches
    # of 128 on 1 process, 1 on each of 2; it validates on two sequences
    def short(self, nproc):
        extra = ["--save_checkpoint", "true"] if nproc == 1 else []
        return self.log(f"short_{nproc}proc", nproc, "--train_files", self.train, "--val_files", self.val,
                        "--num_iterations", "4", "--val_loss_every", "2", "--batch_size", "256",
                        "--max_device_batch_size", "128", "--val_tokens", "256", *extra)

    # the whole smoke preset's training with no data named (its built-in synthetic stream); validation on 2
    # sequences, not 8: evaluations were a third of the run
    def full(self):
        return self.log("full_1proc", 1, "--val_tokens", "1024")

    # plain and fused head on 2 steps of one 128-token sequence: the interpreted kernel costs about 10 ms a row
    # of 50,304 logits. The plain run goes through records/profile_run.py (the profiler does not change the maths)
    def head(self, fused):
        extra, script = (["--fused_head_loss", "true"], "train_gpt.py") if fused else (["--steps", "1"], PROFILE)
        return self.log(f"head_{'fused' if fused else 'plain'}_1proc", 1, "--train_files", self.train,
                        "--val_files", self.val, "--num_layers", "6", "--num_iterations", "2", "--val_loss_every",
                        "2", "--batch_size", "128", "--max_device_batch_size", "128", "--val_tokens", "128", *extra,
                        script=script)


@pytest.fixture(scope="session")
def smoke_runs(markov_shards, tmp_path_factory):
    return SmokeRuns(markov_shards, tmp_path_factory)


@pytest.fixture(scope="session")
def smoke_logs(smoke_runs):
    """Paths of finished logs written by real smoke runs of the trainer (CPU)."""
    return [smoke_runs.short(1), smoke_runs.short(2), smoke_runs.full()]


LN_VOCAB = math.log(50304)
