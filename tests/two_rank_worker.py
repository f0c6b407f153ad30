"""One torchrun launch of 2 processes for a plain run and three faults in turn, each a
train_gpt.main() of its own: a launch costs 3 interpreters, each run a few steps. Run as `torchrun
... two_rank_worker.py PLAN`, PLAN a JSON file of each scenario's options; the tests start it with
two_rank_launch(), once, on the background queue, and read each scenario's outcome with scenario().
- "short": the smoke runs' short run as 2 processes, no fault (SmokeRuns.short(2) in helpers).
- "shard_changed": from step 1 on, rank 0 alone reads 400 tokens in train shard 2's header (its
  node's copy changed); rank 1 reads the shard as it was (tests/test_trainer_faults.py).
- "log_full": at step 2, rank 0's log starts failing as on a full disk (its descriptor becomes
  /dev/full's); the processes exchange the stop flag at every step (tests/test_disk.py).
- "stopped", last, as it ends the launch: the reference run's step-4 checkpoint resumed, preempted
  at step 5: rank 0 sends SIGTERM to its parent (the torchrun agent, which forwards it to every
  worker) and waits until the signal reached its own handler; the flag is exchanged at every step,
  so all stop after step 6 (tests/test_resume.py).
Each scenario's process groups get names of their own in torchrun's store (a new process would:
names counted from 0 again would read the addresses of the last scenario's). All but the last run
under a run id of their own (rank 0's store of failed ranks' lines is then theirs alone), with
stdout and stderr in files of their own per rank, and each rank's exit code and error file (the last
line torchrun's report quotes) kept in files, the error file then removed. The last writes to
torchrun's stdout and stderr, and leaves its error file to torchrun."""
import gc
import glob
import json
import os
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from torch.distributed import distributed_c10d

import train_gpt

REPO = Path(__file__).resolve().parent.parent

SCENARIOS = ("short", "shard_changed", "log_full", "stopped")
# the step at which each scenario's fault comes (on rank 0); "short" has none
FAULT_AT = {"shard_changed": 1, "log_full": 2, "stopped": 5}


def shards(folder, train_tokens=(600, 600), val_tokens=2000):
    """Train shards of these lengths and one val shard in folder; returns (train glob, val glob)."""
    folder.mkdir(parents=True, exist_ok=True)
    for k, n in enumerate(train_tokens, start=1):
        train_gpt.write_data_shard(folder / f"t_{k:06d}.bin", train_gpt.markov_stream(n, seed=k))
    train_gpt.write_data_shard(folder / "v_000000.bin", train_gpt.markov_stream(val_tokens, seed=0))
    escaped = glob.escape(str(folder))
    return f"{escaped}/t_*", f"{escaped}/v_*"


def tiny_run(train, val, log_dir, *extra):
    """A 6-step run of a tiny model: 600-token shards hold 2 batches, so shard 2 opens at step 2."""
    return ["--preset", "smoke", "--train_files", train, "--val_files", val, "--num_layers", "6",
            "--model_dim", "16", "--num_heads", "1", "--num_iterations", "6",
            "--val_loss_every", "0", "--batch_size", "256", "--max_device_batch_size", "128",
            "--val_tokens", "256",
            "--allow_data_repeat", "true", "--log_dir", str(log_dir), *extra]


# --- the tests' side (helpers, which imports pytest, imported there only: not in the workers) ----

MADE = {}


def reference_run(markov_shards, tmp_path_factory):
    """tests/test_resume.py's run not interrupted, in this process (on one thread), made once: its
    val losses and its checkpoints (every 4 steps)."""
    from helpers import finished_log
    from helpers import tiny
    from helpers import val_losses
    if "reference" not in MADE:
        log_dir = tmp_path_factory.mktemp("reference")
        threads = train_gpt.torch.get_num_threads()
        train_gpt.torch.set_num_threads(1)
        try:
            code = train_gpt.main(tiny(markov_shards, log_dir, "--checkpoint_every", "4"))
        finally:
            train_gpt.torch.set_num_threads(threads)
        assert code == 0
        log = finished_log(log_dir)
        checkpoints = sorted((log_dir / log.stem).glob("state_step*.pt"))
        MADE["reference"] = val_losses(log), checkpoints
    return MADE["reference"]


def two_rank_launch(request):
    """The starter of the `background` marks of the tests that read the launch, queued once; the
    launch waits for the reference run (whose checkpoint the last scenario resumes), made in this
    thread once the session's first jobs have started. A reference that fails fails the launch's
    tests, not the session."""
    from helpers import BACKGROUND
    from helpers import run_process
    from helpers import short_options
    from helpers import tiny
    from helpers import worker_env
    if "two_rank_launch" in BACKGROUND.futures:
        return BACKGROUND.futures["two_rank_launch"]
    markov_shards = request.getfixturevalue("markov_shards")
    factory = request.getfixturevalue("tmp_path_factory")
    reference = BACKGROUND.in_main_thread(lambda: reference_run(markov_shards, factory))
    folder = factory.mktemp("two_rank_launch")
    train, val = shards(folder / "data")
    plan = folder / "plan.json"
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    command = [sys.executable, *launcher, str(REPO / "tests" / "two_rank_worker.py"), str(plan)]

    def run():
        try:
            _, checkpoints = reference.result()
        except Exception as error:
            raise AssertionError("the reference run, resumed by the launch, failed") from error
        argv = {
            "short": ["--preset", "smoke", *short_options(*markov_shards[:2]), "--log_dir",
                      str(folder / "short")],
            "shard_changed": tiny_run(train, val, folder / "shard_changed", "--save_checkpoint",
                                      "true"),
            "log_full": tiny(markov_shards, folder / "log_full", "--val_loss_every", "0",
                             "--checkpoint_every", "2"),
            "stopped": ["--resume", str(checkpoints[0]), "--log_dir", str(folder / "stopped")],
        }
        plan.write_text(json.dumps(dict(argv=argv, shard=str(folder / "data" / "t_000002.bin"))))
        return run_process(command, 300, cwd=REPO, env=worker_env(OMP_NUM_THREADS="1"))
    return BACKGROUND.once("two_rank_launch", run)


def scenario(request, name):
    """A scenario's outcome, once the launch has ended: its log folder, the launch's result, and
    for all but the last, each rank's stderr, exit code and last line left for torchrun (the last
    scenario's are the launch's)."""
    result = two_rank_launch(request).result()
    folder = Path(result.args[-1]).parent
    outcome = SimpleNamespace(log_dir=folder / name, result=result, stderr=[], codes=[],
                              last_lines=[])
    if name != SCENARIOS[-1]:
        for rank in (0, 1):
            outcome.stderr.append((folder / f"{name}.rank{rank}.err").read_text())
            outcome.codes.append(int((folder / f"{name}.rank{rank}.code").read_text()))
            error = folder / f"{name}.rank{rank}.error"
            outcome.last_lines.append(error.read_text() if error.exists() else None)
    return outcome


# --- the workers' side ----------------------------------------------------------------------------

def fault(name, shard, stop):
    """Rank 0's fault in scenario `name`: a shard changed, a full disk, a preemption."""
    if name == "shard_changed":
        read_shard_header = train_gpt.read_shard_header

        def shorter(path):
            return 400 if path == shard else read_shard_header(path)
        train_gpt.read_shard_header = shorter
    elif name == "log_full":
        for fd in os.listdir("/proc/self/fd"):
            if os.path.realpath(f"/proc/self/fd/{fd}").endswith(".txt"):
                os.dup2(os.open("/dev/full", os.O_WRONLY), int(fd))
    else:
        os.kill(os.getppid(), signal.SIGTERM)
        while not stop.received:
            time.sleep(0.01)


def run_scenario(name, argv, folder, shard):
    """main(argv) with rank 0's fault at its step; the first scenarios' output in files of their
    own."""
    rank = os.environ["RANK"]
    # the default group is named by this count (0 in a new process), the others after it
    distributed_c10d._world.group_count = 100 * SCENARIOS.index(name)
    agreed = train_gpt.CleanStop.agreed
    read_shard_header = train_gpt.read_shard_header

    def agreed_after_the_fault(self, step):
        if step == FAULT_AT.get(name) and rank == "0":
            fault(name, shard, self)
        return agreed(self, step)

    train_gpt.CleanStop.agreed = agreed_after_the_fault
    stop_check_every = train_gpt.STOP_CHECK_EVERY
    if name in ("log_full", "stopped"):
        train_gpt.STOP_CHECK_EVERY = 1
    own_output = name != SCENARIOS[-1]
    if own_output:
        run_id = os.environ["TORCHELASTIC_RUN_ID"]
        os.environ["TORCHELASTIC_RUN_ID"] = f"{run_id}-{name}"
        saved = [os.dup(1), os.dup(2)]
        for fd, kind in ((1, "out"), (2, "err")):
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
            target = os.open(folder / f"{name}.rank{rank}.{kind}", flags)
            os.dup2(target, fd)
            os.close(target)
    try:
        code = train_gpt.main(argv)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        train_gpt.CleanStop.agreed = agreed
        train_gpt.read_shard_header = read_shard_header
        train_gpt.STOP_CHECK_EVERY = stop_check_every
        if own_output:
            for fd, copy in zip((1, 2), saved):
                os.dup2(copy, fd)
                os.close(copy)
            os.environ["TORCHELASTIC_RUN_ID"] = run_id
    if own_output:
        (folder / f"{name}.rank{rank}.code").write_text(str(code))
        error_file = Path(os.environ["TORCHELASTIC_ERROR_FILE"])
        if error_file.exists():
            message = json.loads(error_file.read_text())["message"]["message"]
            (folder / f"{name}.rank{rank}.error").write_text(message)
            error_file.unlink()
    return code


def main(plan_path):
    plan = json.loads(Path(plan_path).read_text())
    code = 0
    for name in SCENARIOS:
        code = run_scenario(name, plan["argv"][name], Path(plan_path).parent, plan["shard"])
    return code


if __name__ == "__main__":
    code = main(sys.argv[1])
    # leave without a last full collection over torch's objects (about a second of CPU)
    gc.freeze()
    sys.exit(code)
