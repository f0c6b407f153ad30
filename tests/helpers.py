"""What the tests share: the background queue, real runs of the trainer and readers of its log,
shards, and the small runs several test files make. The processes' environment and lifetime are in
processes.py; fixtures and pytest's hooks in conftest.py."""
import concurrent.futures
import contextlib
import heapq
import importlib.util
import math
import os
import re
import resource
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from processes import REPO
from processes import WARM_PYTHON
from processes import launch_env
from processes import run_process

import train_gpt

# the profiling tool, which runs the trainer
PROFILE = "records/profile_run.py"
LN_VOCAB = math.log(50304)


def run_trainer(args, nproc=1, timeout=600, threads=None, script="train_gpt.py"):
    """Run train_gpt.py (or a tool wrapping it) as users do: plainly for one process, through
    torchrun for several; `threads` per process, by default the cores shared out."""
    if nproc == 1:
        command = [sys.executable, str(REPO / script), *args]
    else:
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        command = [sys.executable, *launcher, str(REPO / script), *args]
    threads = threads or max(1, (os.cpu_count() or 1) // nproc)
    env = launch_env(OMP_NUM_THREADS=str(threads))
    return run_process(command, timeout, env=env, cwd=REPO)


# Each job's expected seconds (one core, the suite running beside it), from runs on the 2-core AVX2
# EPYC, for the lead to tune. The jobs queued at session start begin longest first, so that the
# queue ends on short ones; a job not listed counts as DEFAULT_JOB_SECONDS. The reference run (7 s)
# comes first, as the launch waits for it.
JOB_SECONDS = {"reference": 60, "smoke_1proc": 48, "launch": 20, "muon_compiled": 13,
               "real_smoke_ab": 12, "failing_rank_under_run_sh": 11, "rank_killed_under_run_sh": 9,
               "option_error_under_run_sh": 8, "compile_twice": 7, "stopped_under_nohup": 4,
               "closed_stdout": 3, "one_trainer": 3, "compare_script": 2}
DEFAULT_JOB_SECONDS = 10


class Job(concurrent.futures.Future):
    """A background job's future. When the tests' thread is about to wait on it, a second worker
    starts taking jobs: that thread's core would idle otherwise. `rank` orders the job among the
    queue's."""

    def __init__(self, background, rank):
        super().__init__()
        self.background = background
        self.rank = rank

    def result(self, timeout=None):
        if not self.done() and threading.current_thread() is threading.main_thread():
            self.background.second_worker()
        return super().result(timeout)


class Background:
    """Subprocess work run once, in a background thread, so that it overlaps the in-process
    tests (which use the other core); keyed by name. The jobs queued while `held()` (the session's
    start) begin longest first (JOB_SECONDS), later ones in the order they come. Once the tests'
    thread waits on a job, a second worker lets two jobs run at once (Job). Each job's wall and CPU
    times are kept for the report at the end of the session."""

    def __init__(self):
        self.futures = {}
        self.seconds = {}
        self.cpu_seconds = {}
        # (queued after the start, minus its expected seconds, its number, key, fn, args, kwargs,
        # future)
        self.queue = []
        self.ready = threading.Condition()
        self.holding = False
        self.workers = [threading.Thread(target=self.work, name="background", daemon=True)]
        self.workers[0].start()

    def second_worker(self):
        """A second thread taking jobs: for when the tests' own thread only waits for them."""
        with self.ready:
            if len(self.workers) == 1:
                worker = threading.Thread(target=self.work, name="background-2", daemon=True)
                self.workers.append(worker)
                worker.start()

    def once(self, key, fn, *args, **kwargs):
        with self.ready:
            if key not in self.futures:
                expected = JOB_SECONDS.get(key, DEFAULT_JOB_SECONDS) if self.holding else 0
                rank = (not self.holding, -expected, len(self.futures))
                future = Job(self, rank)
                self.futures[key] = future
                heapq.heappush(self.queue, (*rank, key, fn, args, kwargs, future))
                self.ready.notify()
            return self.futures[key]

    @contextlib.contextmanager
    def held(self):
        """Jobs queued in the block start when it ends, longest first."""
        with self.ready:
            self.holding = True
        try:
            yield
        finally:
            with self.ready:
                self.holding = False
                self.ready.notify()

    def work(self):
        while True:
            with self.ready:
                while self.holding or not self.queue:
                    self.ready.wait()
                *_, key, fn, args, kwargs, future = heapq.heappop(self.queue)
            if future.set_running_or_notify_cancel():
                settle(future, self.timed, key, fn, *args, **kwargs)

    def cancel_waiting(self):
        """No new runs (after -x, Ctrl-C): the jobs not started are cancelled."""
        with self.ready:
            for *_, future in self.queue:
                future.cancel()
            self.queue.clear()

    def timed(self, key, fn, *args, **kwargs):
        started_at = time.perf_counter()
        cpu_before = children_cpu_seconds() + WARM_PYTHON.cpu_seconds
        try:
            return fn(*args, **kwargs)
        finally:
            self.seconds[key] = time.perf_counter() - started_at
            cpu = children_cpu_seconds() + WARM_PYTHON.cpu_seconds
            self.cpu_seconds[key] = cpu - cpu_before


def settle(future, fn, *args, **kwargs):
    """The future's result is fn's, or what it raised (in a worker's thread: nothing to raise it
    on to)."""
    try:
        future.set_result(fn(*args, **kwargs))
    except BaseException as error:
        future.set_exception(error)


def children_cpu_seconds():
    """CPU time of this process's finished children (the warm interpreter's children are counted
    by WARM_PYTHON): a job's share is about the change over its run
    (a busy machine stretches wall times, less so CPU times); jobs that overlapped (two workers, an
    in-process compile's C++ compilers) share their figures."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


BACKGROUND = Background()


def load_records_script(name):
    """records/NAME.py as a module (records/ is not a package); registered first, as dataclasses
    look their module up in sys.modules."""
    spec = importlib.util.spec_from_file_location(f"records_{name}",
                                                  REPO / "records" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# --- inductor on the CPU -------------------------------------------------------------------------

@contextlib.contextmanager
def inductor_on_the_cpu(**extra):
    """What compiles in the tests: inductor's C++ built from this process, one compiler at a time
    (a pool of compile workers starts more interpreters: on a busy 2-core machine Muon's compiled
    cases took 134 s of wall time instead of about 50); each graph with its kernels as one C++
    library, one g++ run (cpp_wrapper: the masks' and Muon's compiled tests took 63 s of CPU with a
    run per kernel, 52 s with one per graph); the vector instructions the CPU reports taken as
    usable, without building a probe first (4 s of g++); the headers read by each run, not first
    precompiled into a 143 MB file outside inductor's cache folder (8 s, for two runs that then took
    about 3 s less each). The graphs and the kernels' code are inductor's as before; only the glue
    that calls them is C++. With `extra` inductor options. Imported here: inductor is seconds of
    every session's collection."""
    from torch._inductor import config as inductor_config
    options = {"compile_threads": 1, "cpp_wrapper": True, "cpp.vec_isa_ok": True,
               "cpp_cache_precompile_headers": False, **extra}
    with inductor_config.patch(options):
        yield


# --- data -----------------------------------------------------------------------------------------

# Documents of one fixed random Markov chain (4 successors per token): the trainer's own synthetic
# data, learnable to about ln 4 = 1.39 nats, far below the unigram entropy (about ln 256 = 5.5)
markov_stream = train_gpt.markov_stream


def unigram_entropy(tokens):
    counts = np.bincount(tokens)
    p = counts[counts > 0] / len(tokens)
    return float(-(p * np.log(p)).sum())


def stream_shards(folder, sizes):
    """Shards whose tokens count up through the whole stream, so every slice says where it came
    from."""
    start = 0
    for k, size in enumerate(sizes):
        tokens = np.arange(start, start + size) % 50000
        train_gpt.write_data_shard(folder / f"s_train_{k + 1:06d}.bin", tokens)
        start += size
    return str(folder / "s_train_*.bin")


def corrupt(path, how):
    """Damage a shard's header (`magic`, `version`) or cut it short (`truncated`,
    `header_only_part`)."""
    data = bytearray(path.read_bytes())
    if how == "magic":
        data[0:4] = np.int32(12345).tobytes()
    elif how == "version":
        data[4:8] = np.int32(7).tobytes()
    elif how == "truncated":
        data = data[:-10]
    elif how == "header_only_part":
        data = data[:100]
    path.write_bytes(bytes(data))


# --- small runs, and main() as users meet it ------------------------------------------------------

# one step of one 128-token sequence, validated after it
TINY_RUN = ["--preset", "smoke", "--num_iterations", "1", "--val_loss_every", "0", "--batch_size",
            "128", "--max_device_batch_size", "128", "--val_tokens", "128"]


def tiny(markov_shards, log_dir, *extra):
    """6 blocks of width 16 (a CPU step is mostly the 50,304-wide head), 8 steps of 256 tokens: 2
    micro-batches on 1 process, 1 on each of 2; validation every 2 steps, on 2 sequences."""
    train, val, _ = markov_shards
    return ["--preset", "smoke", "--train_files", train, "--val_files", val, "--num_layers", "6",
            "--model_dim", "16", "--num_heads", "1", "--num_iterations", "8", "--val_loss_every",
            "2", "--batch_size", "256", "--max_device_batch_size", "128", "--val_tokens", "256",
            "--log_dir", str(log_dir), *extra]


def run_main(capsys, *argv):
    """main(argv) for a run it must refuse: exit code 1, one `error:` line on stderr, no traceback;
    returns stderr."""
    code = train_gpt.main(list(argv))
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("error: ") and "Traceback" not in err
    return err


def smoke_on(tmp_path, markov_shards, *argv, train=None, val=None):
    """main() on the smoke model with the given shards, validating on 512 tokens; returns its exit
    code and the log folder."""
    log_dir = tmp_path / "logs"
    shards = ["--train_files", train or markov_shards[0], "--val_files", val or markov_shards[1]]
    code = train_gpt.main(["--preset", "smoke", *shards, "--log_dir", str(log_dir),
                           "--val_tokens", "512", *argv])
    return code, log_dir


def at_step(monkeypatch, actions):
    """Run actions[step]() just before the stop check of that step."""
    agreed = train_gpt.CleanStop.agreed

    def with_action(self, step):
        actions.get(step, lambda: None)()
        return agreed(self, step)

    monkeypatch.setattr(train_gpt.CleanStop, "agreed", with_action)


@contextlib.contextmanager
def hub_environment(env):
    """os.environ as `env`, and huggingface_hub's constants read from it again, as a fresh process
    reads them on import (HF_ENDPOINT, say); afterwards both as they were, the client's
    connections closed and its progress bars as they were, as at a process's end."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.utils import are_progress_bars_disabled

    bars_off = are_progress_bars_disabled()
    saved = dict(os.environ)
    for name in set(saved) - set(env):
        del os.environ[name]
    os.environ.update(env)
    importlib.reload(constants)
    try:
        yield
    finally:
        huggingface_hub.close_session()
        for name in set(os.environ) - set(saved):
            del os.environ[name]
        os.environ.update(saved)
        importlib.reload(constants)
        if not bars_off:
            huggingface_hub.utils.enable_progress_bars()



# --- the trainer's log ----------------------------------------------------------------------------

SOURCE = (REPO / "train_gpt.py").read_text()
VAL_LINE = re.compile(
    r"^step:(\d+)/(\d+) val_loss:(\d+\.\d{4}) train_time:(\d+)ms step_avg:(nan|\d+\.\d{2})ms$")
TRAIN_LINE = re.compile(
    r"^step:(\d+)/(\d+) train_loss:(\d+\.\d{4}) train_time:(\d+)ms step_avg:(nan|\d+\.\d{2})ms$")
# the one line besides steps
STARTUP_LINE = re.compile(r"^startup: (\d+\.\d)s from launch to the end of step \d+")
# and lines of options and tools: profile_run.py's report, checkpoints, a resumed run's notes, a
# stopped run's last line, HellaSwag's scores
OPTION_LINES = ("profile: ", "checkpoint: ", "resumed from ", "warning: resumed ", "stopped by ",
                "hellaswag: ")


def finished_log(log_dir):
    """The one log a run wrote into log_dir."""
    logs = sorted(Path(log_dir).glob("*.txt"))
    assert len(logs) == 1, f"expected one log in {log_dir}, found {logs}"
    return logs[0]


def step_lines(log_path):
    """The lines after the header; each must be a val line, a train line or the closing memory
    line."""
    text = log_path.read_text()
    assert text.startswith(SOURCE), "the log must begin with the exact source of train_gpt.py"
    rest = text[len(SOURCE):].splitlines()
    assert rest[1] == "=" * 100
    body = rest[rest.index("=" * 100, rest.index("hyperparameters:")) + 1:]
    body = [line for line in body if not line.startswith(OPTION_LINES)]
    assert re.fullmatch(r"peak memory consumption: \d+ MiB", body[-1])
    return body[:-1], rest


def val_losses(log_path):
    """{step: val loss} of a log, every other step line parsed as a train line."""
    lines, _ = step_lines(log_path)
    losses = {}
    for line in lines:
        if m := VAL_LINE.match(line):
            losses[int(m[1])] = float(m[3])
        elif not STARTUP_LINE.match(line):
            assert TRAIN_LINE.match(line), f"line does not parse: {line!r}"
    return losses


# --- smoke runs shared by the tests, on the background queue --------------------------------------

def smoke_marked(*runs):
    """A `background` mark launching SmokeRuns' runs, each (method name, args...), at session
    start."""
    def start(request):
        smoke_runs = request.getfixturevalue("smoke_runs")
        return [smoke_runs.launch(getattr(smoke_runs, method), *args) for method, *args in runs]
    return pytest.mark.background.with_args(start)


def imported_frozen(*modules):
    """Code for the top of a process the tests start: its heaviest imports made with Python's
    collector off, then what they made frozen out of every later collection (collections during
    torch's import, and later full ones, scan its objects again and again): about half a second of
    CPU less per process."""
    imports = "".join(f"import {module}\n" for module in modules)
    return f"import gc\ngc.disable()\n{imports}gc.freeze()\ngc.enable()\n"


# Several runs in one fork of the warm interpreter (a start costs about 3 s of CPU, and the first
# Adam 2 more for torch._dynamo's import): each script runs as `python SCRIPT ARGS...` would run it,
# and its exit code is printed. The runs marked without triton come first, where `import triton`
# fails (as on macOS and Windows) as it did for the interpreter's imports, torch's included; then
# triton is importable again.
RUNS_IN_ONE_PROCESS = """import runpy, sys
for script, argv, without_triton in {runs!r}:
    if without_triton:
        sys.modules["triton"] = None
    elif "triton" in sys.modules and sys.modules["triton"] is None:
        del sys.modules["triton"]
    sys.argv = [script, *argv]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        print("exit code", stop.code, flush=True)
"""

EXIT_CODES = re.compile(r"^exit code (\S+)$", re.M)
# the smoke preset at the size of tiny(): 6 blocks of width 16, one head
TINY_MODEL = ["--num_layers", "6", "--model_dim", "16", "--num_heads", "1"]


def short_options(train, val):
    """The short run on the Markov shards: 4 steps of 256 tokens, 2 micro-batches of 128 on 1
    process, 1 on each of 2; it validates every 2 steps on two sequences; tiny()'s model."""
    return ["--train_files", train, "--val_files", val, *TINY_MODEL, "--num_iterations", "4",
            "--val_loss_every", "2", "--batch_size", "256", "--max_device_batch_size", "128",
            "--val_tokens", "256"]


class SmokeRuns:
    """Smoke-preset runs on the Markov shards, made once per session and shared by the tests. A
    background job is one process (or one torchrun launch); some jobs make several runs."""

    def __init__(self, shards, tmp_path_factory, request):
        self.train, self.val, _ = shards
        self.tmp = tmp_path_factory
        # the session's, for the 2-rank launch
        self.request = request
        self.logs = {}
        self.stdout = {}
        # run name -> (its log folder, its background job, its place among the job's runs)
        self.runs = {}
        # job -> the runs it makes in one process: (name, script, argv, without triton)
        self.plans = {}
        self.results = {}
        self.launching = False

    def log(self, name, nproc, *extra, script="train_gpt.py"):
        """A run of its own: one process, or a torchrun launch of nproc; its log once finished."""
        if name not in self.runs:
            log_dir = self.tmp.mktemp(name)
            args = ["--preset", "smoke", "--log_dir", str(log_dir), *extra]
            BACKGROUND.once(name, run_trainer, args, nproc, threads=1, script=script)
            self.runs[name] = log_dir, name, None
        return self.finished(name)

    def in_one_process(self, key, runs, without_triton=False):
        """Runs, each (name, script, argv), in background job `key`: one interpreter
        (RUNS_IN_ONE_PROCESS), each run logging into a folder of its own. While the session's
        jobs are being queued (held), runs asked for by several tests join one job; the process is
        put together when the job starts."""
        new = [run for run in runs if run[0] not in self.runs]
        if not new:
            return
        for name, script, argv in new:
            self.runs[name] = self.tmp.mktemp(name) / "logs", key, None
            self.plans.setdefault(key, []).append((name, script, argv, without_triton))
        BACKGROUND.once(key, self.run_plan, key)

    def run_plan(self, key):
        """The process of job `key`: its runs without triton first."""
        plan = sorted(self.plans[key], key=lambda run: not run[3])
        runs = []
        for place, (name, script, argv, without_triton) in enumerate(plan):
            log_dir = self.runs[name][0]
            self.runs[name] = log_dir, key, place
            runs.append((script, [*argv, "--log_dir", str(log_dir)], without_triton))
        code = RUNS_IN_ONE_PROCESS.format(runs=runs)
        return WARM_PYTHON.run(code, (), 600, env=launch_env(OMP_NUM_THREADS="1"))

    def one_process_job(self):
        """smoke_1proc while the session's jobs are being queued (runs join it), else a new job."""
        if BACKGROUND.holding or "smoke_1proc" not in BACKGROUND.futures:
            return "smoke_1proc"
        return f"smoke_1proc_{len(self.plans)}"

    def result(self, key):
        """The finished process of background job `key`."""
        if key not in self.results:
            self.results[key] = BACKGROUND.futures[key].result()
        return self.results[key]

    def finished(self, name):
        """While launching, the future of the run's job; else the run's log, once its job has ended
        well."""
        if self.launching:
            return BACKGROUND.futures[self.runs[name][1]]
        if name not in self.logs:
            result = self.result(self.runs[name][1])
            # its place, set when its job started
            log_dir, _, place = self.runs[name]
            tail = result.stdout[-3000:] + result.stderr[-3000:]
            assert result.returncode == 0, tail
            if place is not None:
                # its exit code among those of the runs in that process
                assert EXIT_CODES.findall(result.stdout)[place] == "0", tail
            self.logs[name] = finished_log(log_dir)
            self.stdout[name] = result.stdout
        return self.logs[name]

    def launch(self, method, *args):
        """Start a run in the background, without waiting for it; gives its job's future."""
        self.launching = True
        try:
            return method(*args)
        finally:
            self.launching = False

    def short_options(self):
        return short_options(self.train, self.val)

    def short(self, nproc):
        """The same short run as 1 and as 2 processes (short_options). The 1-process run saves a
        checkpoint at the end and goes through records/profile_run.py, its last step profiled (the
        profiler does not change the maths); it shares its process (one_process_runs). The
        2-process run is a part of tests/launch_worker.py's torchrun launch, before its faults (one
        launch for them all)."""
        if nproc == 2:
            from launch_worker import launch_part
            from launch_worker import outcome
            if self.launching:
                return launch_part("short")(self.request)
            if "short_2proc" not in self.logs:
                short = outcome(self.request, "short")
                assert short.codes == [0, 0], short.stderr
                self.logs["short_2proc"] = finished_log(short.log_dir)
            return self.logs["short_2proc"]
        self.one_process_runs()
        return self.finished("short_1proc")

    def full(self):
        """The whole smoke preset's training with no data named (its built-in synthetic stream), as
        `python train_gpt.py --preset smoke` runs; validation on 1 sequence, not 8: evaluations were
        a third of the run. It shares its process (one_process_runs)."""
        self.one_process_runs()
        return self.finished("full_1proc")

    def without_triton(self):
        """(The refused run's log folder, the finished process) of one_process_runs."""
        self.one_process_runs()
        if self.launching:
            return self.finished("refused_without_triton")
        log_dir, key, _ = self.runs["refused_without_triton"]
        return log_dir, self.result(key)

    def one_process_runs(self):
        """In the session's one process (smoke_1proc) while `import triton` fails (as on macOS and
        Windows; a CPU run never needs it): train_gpt.py refusing --fused_head_loss true, then
        short(1) and full()."""
        refused = [*TINY_RUN, "--fused_head_loss", "true"]
        short = ["--steps", "1", "--preset", "smoke", *self.short_options(), "--save_checkpoint",
                 "true"]
        full = ["--preset", "smoke", "--val_tokens", "512"]
        self.in_one_process(self.one_process_job(),
                            [("refused_without_triton", "train_gpt.py", refused),
                             ("short_1proc", PROFILE, short), ("full_1proc", "train_gpt.py", full)],
                            without_triton=True)

    def head(self, fused):
        """Plain and fused head, one after the other in the session's one process (smoke_1proc,
        after the runs without triton), on 2 steps of one 128-token sequence through tiny()'s
        model, validated after the last: the interpreted kernel costs about 10 ms a row of 50,304
        logits, whatever the width (and at step 0 the head is zero: both give ln 50,304)."""
        common = ["--preset", "smoke", "--train_files", self.train, "--val_files", self.val,
                  *TINY_MODEL, "--num_iterations", "2", "--val_loss_every", "0", "--batch_size",
                  "128", "--max_device_batch_size", "128", "--val_tokens", "128"]
        self.in_one_process(self.one_process_job(), [
            ("head_plain_1proc", "train_gpt.py", [*common, "--fused_head_loss", "false"]),
            ("head_fused_1proc", "train_gpt.py", [*common, "--fused_head_loss", "true"])])
        return self.finished(f"head_{'fused' if fused else 'plain'}_1proc")
