"""One torchrun launch for the tests that need several processes: the parts the session's tests ask
for, in turn, each a run of its own in the same interpreters (a launch costs one per process, and
torch's import is most of a small run's time). Run as `torchrun ... launch_worker.py PLAN`, PLAN a
JSON file of the parts and their options; each test's `background` mark names launch_part(NAME),
which adds its part before the launch starts, once, on the background queue; the test reads the
part's outcome with outcome(). The parts, in the order they run:
- "muon": Muon on fixed parameters and gradients (tests/muon_worker.py) in the world of 3, then
  ranks 0 and 1 in a new world of 2; rank 2 then leaves (tests/test_muon.py). With this part the
  launch has 3 processes, and the parts below run on the first 2.
- "short": the smoke runs' short run as 2 processes, no fault (SmokeRuns.short(2) in helpers).
- "shard_changed": from step 1 on, rank 0 alone reads 400 tokens in train shard 2's header (its
  node's copy changed); rank 1 reads the shard as it was (tests/test_trainer_faults.py).
- "log_full": at step 2, rank 0's log starts failing as on a full disk (its descriptor becomes
  /dev/full's); the processes exchange the stop flag at every step (tests/test_disk.py).
- "hellaswag": evals/hellaswag.py on 2 processes (tests/test_evals.py).
- "stopped", last, as it ends the launch: the reference run's step-4 checkpoint resumed, preempted
  at step 5: rank 0 sends SIGTERM to its parent (the torchrun agent, which forwards it to every
  worker) and waits until the signal reached its own handler; the flag is exchanged at every step,
  so all stop after step 6 (tests/test_resume.py).
Each part's process groups get names of their own in torchrun's store (a new process would: names
counted from 0 again would read the addresses of the last part's). All but "stopped" run under a
run id of their own (rank 0's store of failed ranks' lines is then theirs alone), with stdout and
stderr in files of their own per rank, and each rank's exit code and error file (the last line
torchrun's report quotes) kept in files, the error file then removed. "stopped" writes to
torchrun's stdout and stderr, and leaves its error file to torchrun."""
import functools
import gc
import glob
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch.distributed as dist
from torch.distributed import distributed_c10d

import train_gpt

REPO = Path(__file__).resolve().parent.parent

PARTS = ("muon", "short", "shard_changed", "log_full", "hellaswag", "stopped")
# the step at which each trainer part's fault comes (on rank 0); "short" has none
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
# the parts the session's tests asked for: each a function giving its options, called when the
# launch starts
PLAN = {}


REFERENCE_LOCK = threading.Lock()


def reference_run(markov_shards, tmp_path_factory):
    """tests/test_resume.py's run not interrupted, made once, in a fork of the warm interpreter (one
    thread): its val losses and its checkpoints (every 4 steps). A background job when the launch
    resumes it (queued first: the launch waits for it), else made when a test asks."""
    from helpers import finished_log
    from helpers import tiny
    from helpers import val_losses
    from processes import WARM_PYTHON
    from processes import worker_env
    with REFERENCE_LOCK:
        if "reference" not in MADE:
            log_dir = tmp_path_factory.mktemp("reference")
            args = tiny(markov_shards, log_dir, "--checkpoint_every", "4")
            code = f"import sys\nimport train_gpt\nsys.exit(train_gpt.main({args!r}))\n"
            result = WARM_PYTHON.run(code, (), 600, env=worker_env(OMP_NUM_THREADS="1"))
            assert result.returncode == 0, result.stderr[-3000:]
            log = finished_log(log_dir)
            checkpoints = sorted((log_dir / log.stem).glob("state_step*.pt"))
            MADE["reference"] = val_losses(log), checkpoints
        return MADE["reference"]


@functools.cache
def launch_part(name):
    """The starter (one per part) for the `background` mark of a test that reads part `name`."""
    return functools.partial(launch, name=name)


def launch(request, name, argv=None):
    """Adds part `name` to the session's launch (the trainer's parts make their options here;
    "hellaswag" is given its argv) and queues the launch, once; gives its future. A part asked for
    once the launch has started fails its test, saying so."""
    from helpers import BACKGROUND
    from helpers import short_options
    from helpers import tiny
    from processes import run_process
    from processes import worker_env
    assert name in PARTS, f"no part {name!r} in the launch: its parts are {PARTS}"
    future = BACKGROUND.futures.get("launch")
    if name in PLAN:
        return future
    if future is not None and (future.running() or future.done()):
        raise AssertionError(f"part {name!r} was asked for after the launch started: mark its "
                             f"test @pytest.mark.background.with_args(launch_part({name!r}))")
    markov_shards = request.getfixturevalue("markov_shards")
    factory = request.getfixturevalue("tmp_path_factory")
    if future is None:
        MADE["folder"] = factory.mktemp("launch")
        MADE["shards"] = shards(MADE["folder"] / "data")
    folder = MADE["folder"]
    train, val = MADE["shards"]
    if name == "stopped":
        reference = BACKGROUND.once("reference", reference_run, markov_shards, factory)

        def resumed():
            try:
                _, checkpoints = reference.result()
            except Exception as error:
                raise AssertionError("the reference run, resumed by the launch, failed") from error
            return ["--resume", str(checkpoints[0]), "--log_dir", str(folder / "stopped")]
        PLAN[name] = resumed
    else:
        argv = {
            "muon": [str(folder / "muon")],
            "short": ["--preset", "smoke", *short_options(*markov_shards[:2]), "--log_dir",
                      str(folder / "short")],
            "shard_changed": tiny_run(train, val, folder / "shard_changed", "--save_checkpoint",
                                      "true"),
            "log_full": tiny(markov_shards, folder / "log_full", "--val_loss_every", "0",
                             "--checkpoint_every", "2"),
        }.get(name, argv)
        assert argv is not None, f"part {name!r} is given its options"
        PLAN[name] = lambda: argv
    if future is not None:
        return future
    plan = folder / "plan.json"

    def run():
        parts = {part: PLAN[part]() for part in PARTS if part in PLAN}
        plan.write_text(json.dumps(dict(parts=parts, shard=str(folder / "data" / "t_000002.bin"))))
        nproc = 3 if "muon" in parts else 2
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        command = [sys.executable, *launcher, str(REPO / "tests" / "launch_worker.py"), str(plan)]
        return run_process(command, 300, cwd=REPO, env=worker_env(OMP_NUM_THREADS="1"))
    return BACKGROUND.once("launch", run)


def outcome(request, name):
    """A part's outcome, once the launch has ended: its folder, the launch's result, and for all
    but "stopped", each rank's stdout, stderr, exit code and last line left for torchrun (those of
    "stopped" are the launch's)."""
    result = launch_part(name)(request).result()
    folder = Path(result.args[-1]).parent
    ranks = 3 if name == "muon" else 2
    part = SimpleNamespace(log_dir=folder / name, result=result, stdout=[], stderr=[], codes=[],
                           last_lines=[])
    for rank in range(ranks if name != "stopped" else 0):
        if not (folder / f"{name}.rank{rank}.code").exists():
            raise AssertionError(f"rank {rank} did not end part {name!r} of the launch: "
                                 f"{result.stderr[-3000:]}")
        part.stdout.append((folder / f"{name}.rank{rank}.out").read_text())
        part.stderr.append((folder / f"{name}.rank{rank}.err").read_text())
        part.codes.append(int((folder / f"{name}.rank{rank}.code").read_text()))
        error = folder / f"{name}.rank{rank}.error"
        part.last_lines.append(error.read_text() if error.exists() else None)
    return part


# --- the workers' side ----------------------------------------------------------------------------

def fault(name, shard, stop):
    """Rank 0's fault in part `name`: a shard changed, a full disk, a preemption."""
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


def run_part(name, folder, body):
    """body() as part `name`: its process groups named from the part's own count; all parts but
    "stopped" with their output in files of their own per rank, under a run id of their own, and
    their exit code and the last line left for torchrun kept in files."""
    rank = os.environ["RANK"]
    # the default group is named by this count (0 in a new process), the others after it
    distributed_c10d._world.group_count = 100 * PARTS.index(name)
    if name == "stopped":
        return body()
    run_id = os.environ["TORCHELASTIC_RUN_ID"]
    os.environ["TORCHELASTIC_RUN_ID"] = f"{run_id}-{name}"
    saved = [os.dup(1), os.dup(2)]
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    for fd, kind in ((1, "out"), (2, "err")):
        target = os.open(folder / f"{name}.rank{rank}.{kind}", flags)
        os.dup2(target, fd)
        os.close(target)
    try:
        code = body()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
        os.environ["TORCHELASTIC_RUN_ID"] = run_id
    (folder / f"{name}.rank{rank}.code").write_text(str(code))
    error_file = Path(os.environ["TORCHELASTIC_ERROR_FILE"])
    if error_file.exists():
        message = json.loads(error_file.read_text())["message"]["message"]
        (folder / f"{name}.rank{rank}.error").write_text(message)
        error_file.unlink()
    return code


def trainer_part(name, argv, shard):
    """main(argv) with rank 0's fault at its step."""
    rank = os.environ["RANK"]
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
    try:
        return train_gpt.main(argv)
    finally:
        train_gpt.CleanStop.agreed = agreed
        train_gpt.read_shard_header = read_shard_header
        train_gpt.STOP_CHECK_EVERY = stop_check_every


def muon_part(out_dir):
    """Muon in the world torchrun made (3), then ranks 0 and 1 alone in a new world of 2 (its
    groups named after the first's), each world's rank 0 saving its result as N.pt in out_dir. Muon
    reads the world from RANK and WORLD_SIZE, which are set to it, and its gathers use the default
    group; the trainer's parts after it read the world of 2 the same way."""
    import muon_worker
    Path(out_dir).mkdir(exist_ok=True)
    rank = int(os.environ["RANK"])
    for world_size in (3, 2):
        if rank < world_size:
            os.environ["WORLD_SIZE"] = os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
            dist.init_process_group("gloo")
            params = muon_worker.train()
            if rank == 0:
                train_gpt.torch.save(params, Path(out_dir) / f"{world_size}.pt")
            dist.destroy_process_group()
            distributed_c10d._world.group_count = 100 * PARTS.index("muon") + 50
    return 0


def main(plan_path):
    """The plan's parts in turn; rank 2 leaves after "muon". Its exit code: the last part's."""
    plan = json.loads(Path(plan_path).read_text())
    folder = Path(plan_path).parent
    code = 0
    for name, argv in plan["parts"].items():
        if name == "muon":
            code = run_part(name, folder, lambda: muon_part(*argv))
            if int(os.environ["RANK"]) >= 2:
                break
        elif name == "hellaswag":
            from evals import hellaswag
            code = run_part(name, folder, lambda: hellaswag.main(argv))
        else:
            code = run_part(name, folder, lambda: trainer_part(name, argv, plan["shard"]))
    return code


if __name__ == "__main__":
    # torch._dynamo (which the first optimiser imports) with the collector off, then every object so
    # far out of later collections, as helpers.imported_frozen does
    gc.disable()
    import torch._dynamo  # noqa: F401
    gc.freeze()
    gc.enable()
    code = main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without interpreter teardown: its last full collection over torch's objects is about a
    # second of CPU; and with torch 2.13 on CPU, a process that used torch.optim and a gloo group
    # sometimes aborts at exit ("terminate called without an active exception"), after its work
    # is done, which torchrun would take for a failure.
    os._exit(code)
