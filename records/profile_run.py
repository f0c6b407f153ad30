"""Where a step's time goes: a train_gpt.py run with some of its train steps under torch.profiler.

    python records/profile_run.py --steps N [TRAINER OPTIONS...]
    torchrun --standalone --nproc_per_node=8 records/profile_run.py --steps N [TRAINER OPTIONS...]

Rank 0 profiles N train steps, after the first min(12, S - N) of the process, which compile and
warm up; S, the train steps it runs, is num_iterations (less the checkpoint's step with --resume).
The trace (CPU and, with CUDA, GPU; for Perfetto or chrome://tracing) goes beside the run's log as
<run id>.trace.json. The log gets `profile: ` lines: which steps ran under the profiler (their
times are not representative) and the 25 ops with the most self time.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

# train_gpt.py is one folder up
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_gpt  # noqa: E402

# at most: the first steps compile, and the following ones settle
WARM_UP_STEPS = 12


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Our --steps, and every other option for the trainer (a trainer option is never
    abbreviated into one of ours)."""
    parser = argparse.ArgumentParser(
        usage="%(prog)s --steps N [TRAINER OPTIONS...]",
        description="Run train_gpt.py with N train steps under torch.profiler; every other option "
        "goes to the trainer.",
        allow_abbrev=False,
    )
    parser.add_argument(
        "--steps", metavar="N", type=int, default=1, help="steps to profile (default 1)"
    )
    ours, trainer_argv = parser.parse_known_args(argv)
    if ours.steps < 1:
        parser.error(f"--steps must be at least 1; got {ours.steps}")
    return ours, trainer_argv


def trainer_options(trainer_argv: list[str]) -> tuple[train_gpt.Hyperparameters, int]:
    """The options as the trainer will see them (with --resume, the checkpoint's where none is
    given), and the step it starts from (the checkpoint's with --resume, else 0)."""
    args = train_gpt.parse_args(trainer_argv)
    start = 0
    if args.resume:
        # a bad checkpoint is the trainer's to report
        with contextlib.suppress(Exception):
            # mmap: the options without reading the tensors; tensors and plain data only, so
            # that unpickling it runs nothing
            state = torch.load(args.resume, map_location="cpu", mmap=True, weights_only=True)
            saved = state["args"]
            args = train_gpt.parse_args(trainer_argv, resumed=saved)
            start = int(state["step"])
    return args, start


def main(argv: list[str] | None = None) -> int:
    ours, trainer_argv = parse_args(sys.argv[1:] if argv is None else argv)
    # any other rank, or a RANK that is not torchrun's (empty, left in a shell): the trainer's,
    # which refuses the latter in one line
    if os.environ.get("RANK", "0") != "0":
        return train_gpt.main(trainer_argv)
    try:
        # for the step count
        trainer_args, start = trainer_options(trainer_argv)
    except SystemExit as e:
        # argparse has said what is wrong
        return int(e.code or 0)
    wait = max(0, min(WARM_UP_STEPS, trainer_args.num_iterations - start - ours.steps))
    # as train_gpt.main does, before the profiler can initialise CUDA
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with warnings.catch_warnings():
        # the steps before are left out instead, and the first line says the times are skewed
        warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
        schedule = torch.profiler.schedule(wait=wait, warmup=0, active=ours.steps, repeat=1)
    # the CPU and, with CUDA, the GPU
    profiler = torch.profiler.profile(schedule=schedule)

    train_steps = 0

    def train_step_done(optimizer, args, kwargs):
        """Muon steps once per train step, last: a train step is done."""
        nonlocal train_steps
        if isinstance(optimizer, train_gpt.Muon):
            train_steps += 1
            profiler.step()

    # this run's log, as the trainer names it (another run may write in the same folder)
    run_logs = []

    class NamedRunLog(train_gpt.RunLog):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if self.master:
                run_logs.append(Path(self.path))

    hook = register_optimizer_step_post_hook(train_step_done)
    trainer_run_log = train_gpt.RunLog
    train_gpt.RunLog = NamedRunLog
    profiler.start()
    try:
        code = train_gpt.main(trainer_argv)
    finally:
        profiler.stop()
        train_gpt.RunLog = trainer_run_log
        hook.remove()
    # fewer if the run ended or stopped early
    profiled = min(ours.steps, max(0, train_steps - wait))
    if not (run_logs and profiled):
        if code:
            # the trainer's own last line says why
            return code
        print(
            f"profile: no train step ran under the profiler ({train_steps} ran in all)",
            file=sys.stderr,
        )
        return 1
    log = run_logs[0]
    trace = log.with_suffix(".trace.json")
    profiler.export_chrome_trace(str(trace))
    kind = "device" if torch.cuda.is_available() else "cpu"
    table = profiler.key_averages().table(sort_by=f"self_{kind}_time_total", row_limit=25)
    first = (
        f"profile: {profiled} train step(s) after the first {wait} of this process ran under the "
        f"profiler, so their times above are not representative; trace for Perfetto or "
        f"chrome://tracing: {trace}"
    )
    print(first)
    with open(log, "a") as f:
        f.writelines(
            f"profile: {line}\n" for line in [first[len("profile: ") :], *table.splitlines()]
        )
    return code


if __name__ == "__main__":
    sys.exit(main())
