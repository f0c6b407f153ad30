"""A/B timing: is B really faster than A? Run both alternately and compare their ms per step.

    python records/ab.py A B [--runs K] [--nproc N] [--out DIR] [-- FLAGS FOR BOTH...]

A and B are each a trainer script, optionally followed by its own flags, quoted as one argument
(split as a shell would): two copies of the script, or one script with two flag sets. Flags after
"--" go to both; a side's own flags win over them. For example, is a step faster with regional
compilation?

    python records/ab.py train_gpt.py "train_gpt.py --regional_compile true" --runs 3 \\
        -- --num_iterations 200 --val_loss_every 0

The runs alternate A1 B1 A2 B2 ... so that a machine that warms up or slows down over time
weighs on both sides alike. Each pair has a seed of its own (--seed 0 for A1 and B1, 1 for A2 and
B2, ...; a --seed given wins), so that a side's runs are runs, not repeats, and `compare.py` on
their logs judges the change, not the noise of timing alone. Every run uses all visible GPUs
(torchrun --standalone, one process per GPU); without a GPU it is one plain process on the CPU;
--nproc overrides both. Each run gets a fresh --log_dir under the output folder (default
logs/ab-<timestamp>-<process id>/), where its log and its console output (console.log) stay.

Printed: one row per run (seed, ms/step, peak memory, seconds from launch to the end of step 1,
final val loss), a warning where fewer than 50 steps of a run were timed (the trainer's first 10 are
not), then the ratio B/A of ms/step: its mean over the pairs (A1,B1), (A2,B2), ... and the smallest
and largest pair. When that range includes 1 the difference is "within noise".

A stop (SIGTERM, SIGINT as from Ctrl-C, SIGHUP) is passed on to the run going on, which stops
itself after its step (its stop line, and its checkpoint where it writes one); then ab.py says
where it stopped and ends, with no further run.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# records/ is not a package: the tools' shared module is imported from beside this file
sys.path.insert(0, str(Path(__file__).resolve().parent))
import runlog  # noqa: E402

# of a failed run's output
TAIL_LINES = 20
# fewer timed steps than this make a step_avg mostly the noise of the first steps after compiling
MIN_TIMED_STEPS = 50


class RunFailed(Exception):
    """A run that crashed or left no usable log; the message says which and why."""


class Stopped(Exception):
    """A stop signal came: the message says where the A/B stopped."""


class PassOn:
    """Until closed, a stop signal (SIGTERM, SIGINT, and SIGHUP unless ignored, as under nohup)
    is passed on, once, to the run going on, which stops itself. Each run has a session of its
    own, so that a terminal's Ctrl-C reaches it only from here, once: torchrun, given a second
    signal while it stops its workers, would cut their stop short."""

    def __init__(self):
        self.signum = 0
        self.process = None
        self.passed = False
        signums = [signal.SIGTERM, signal.SIGINT]
        hangup = getattr(signal, "SIGHUP", None)
        if hangup is not None and signal.getsignal(hangup) is not signal.SIG_IGN:
            signums.append(hangup)
        self.previous = {signum: signal.signal(signum, self.on_signal) for signum in signums}

    def on_signal(self, signum, frame):
        if not self.signum:
            self.signum = signum
        self.pass_on()

    def pass_on(self):
        if self.signum and self.process is not None and not self.passed:
            self.passed = True
            self.process.send_signal(self.signum)

    def close(self):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def run(self, command: list[str], out) -> int:
        """Run command to its end, output to out; a stop signal reaches it (if it came while the
        command started, as soon as it has)."""
        env = dict(os.environ)
        # torchrun kills its workers this many seconds after passing a stop on (by default 30):
        # time to finish the step and write a checkpoint (read by torch 2.12 and later)
        env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "300")
        self.process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        self.pass_on()
        try:
            return self.process.wait()
        finally:
            self.process = None


def visible_gpus() -> int:
    """How many GPUs torch sees (torch is imported only here, and --nproc avoids it)."""
    import torch

    return torch.cuda.device_count()


def to_console(line: str) -> None:
    """Print a line on stdout. A console gone away (a closed pipe, a full disk) never ends the
    A/B: stdout writes to os.devnull from then on, and no later print fails. A closed pipe's
    reader took what it wanted; any other failure is told on stderr, once."""
    try:
        print(line, flush=True)
    except OSError as e:
        if not isinstance(e, BrokenPipeError):
            print(f"warning: stdout cannot be written ({e.strerror or e}): what follows is "
                  "dropped; the work goes on", file=sys.stderr, flush=True)
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def command(side: list[str], common: list[str], nproc: int, log_dir: Path, seed: int) -> list[str]:
    """The command line of one run: its pair's seed, then the flags for both sides, then the
    side's own, which win (the last of an option given twice counts); --log_dir last, which wins
    over any other."""
    launcher = [sys.executable]
    if nproc > 1:
        # what the torchrun command runs, with this interpreter
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [*launcher, side[0], "--seed", str(seed), *common, *side[1:], "--log_dir", str(log_dir)]


def console_lines(console: Path) -> list[str]:
    """A run's console output, line by line (or why there is none)."""
    try:
        return runlog.read_file(console).decode(errors="replace").splitlines()
    except runlog.Unreadable as e:
        return [str(e)]


def run_once(label: str, cmd: list[str], run_dir: Path, stop: PassOn) -> runlog.Run:
    """Run one trainer command, its output going to run_dir/console.log; return its parsed log."""
    if stop.signum:
        raise Stopped(f"stopped by {signal.Signals(stop.signum).name} before {label}")
    # A1 was made when --out was claimed
    run_dir.mkdir(parents=True, exist_ok=True)
    console = run_dir / "console.log"
    to_console(f"{label}: {shlex.join(cmd)}")
    start = time.perf_counter()
    with open(console, "w") as out:
        code = stop.run(cmd, out)
    to_console(f"{label}: finished in {time.perf_counter() - start:.1f} s")
    if stop.signum:
        # its stop line, wherever it is: torchrun's report of the signal follows it
        lines = console_lines(console) or ["no output"]
        last = next((line for line in reversed(lines) if runlog.STOP_LINE.match(line)), lines[-1])
        raise Stopped(f"stopped by {signal.Signals(stop.signum).name} during {label}, which "
                      f"ended with exit code {code}: {last}")
    if code != 0:
        tail = "\n".join("    " + line for line in console_lines(console)[-TAIL_LINES:])
        raise RunFailed(
            f"{label} failed with exit code {code}: {shlex.join(cmd)}\n"
            f"  last lines of its output ({console}):\n{tail}"
        )
    try:
        logs = sorted(path for path in run_dir.iterdir() if path.name.endswith(".txt"))
    except OSError as e:
        raise RunFailed(f"{run_dir} cannot be listed ({e.strerror or e})") from None
    if len(logs) != 1:
        raise RunFailed(
            f"{label} wrote {len(logs)} logs in {run_dir}, expected one: {shlex.join(cmd)}"
        )
    try:
        return runlog.parse_log(logs[0])
    except (runlog.LogError, runlog.Unreadable) as e:
        raise RunFailed(f"{label}'s log {logs[0]}: {e}") from None


def verdict(ratios: list[float]) -> str:
    """'within noise' when the pairs disagree about which side is faster, else who won."""
    if len(ratios) < 2:
        return "no spread"
    if min(ratios) <= 1.0 <= max(ratios):
        return "within noise"
    return "B faster" if max(ratios) < 1.0 else "B slower"


def ratio_line(a_ms: list[float], b_ms: list[float]) -> str:
    """B/A of ms/step for each pair of runs, summarised as mean, min..max and the verdict."""
    ratios = [b / a if a > 0 else math.nan for a, b in zip(a_ms, b_ms)]
    if not all(math.isfinite(r) for r in ratios):
        return "B/A step_avg: n/a (a run has no timed steps; timing starts after step 10)"
    mean = math.fsum(ratios) / len(ratios)
    if len(ratios) == 1:
        return (
            f"B/A step_avg: {mean:.4f} from one pair: "
            "no spread to judge the noise by (use --runs 2 or more)"
        )
    return (
        f"B/A step_avg: mean {mean:.4f} over {len(ratios)} pairs, "
        f"{min(ratios):.4f}..{max(ratios):.4f}: {verdict(ratios)}"
    )


def runs_table(labels: list[str], runs: list[runlog.Run]) -> str:
    """One row per run: its seed (as logged), ms/step, peak memory, seconds to step 1 and final
    val loss."""

    def num(x, fmt):
        return "?" if x is None or math.isnan(x) else format(x, fmt)

    header = ["run", "seed", "step_avg (ms)", "peak mem (MiB)", "launch to step 1 (s)", "val loss"]
    rows = []
    for label, r in zip(labels, runs):
        rows.append([label, r.options.get("seed", "?"), num(r.step_avg_ms, ".2f"),
                     num(r.peak_mib, "d"), num(r.startup_s, ".1f"), num(r.final_loss, ".4f")])
    return runlog.format_table(header, rows, right={1, 2, 3, 4, 5})


def timing_warning(runs: list[runlog.Run]) -> str | None:
    """A warning where a run timed fewer than MIN_TIMED_STEPS steps, or None."""
    untimed = max(max(r.untimed_through, 0) for r in runs)
    timed = min(r.planned for r in runs) - untimed
    if timed >= MIN_TIMED_STEPS:
        return None
    enough = untimed + MIN_TIMED_STEPS
    return (f"warning: only {max(timed, 0)} steps of a run were timed (the trainer's first "
            f"{untimed} are not): with fewer than {MIN_TIMED_STEPS}, step_avg is mostly the noise "
            f"of the first steps after compiling; give --num_iterations {enough} or more")


def parse_args(argv: list[str]) -> argparse.Namespace:
    """A, B and our options; everything after the first "--" is for the trainer, so argparse
    never sees it."""
    common = []
    if "--" in argv:
        split = argv.index("--")
        common = argv[split + 1 :]
        argv = argv[:split]
    parser = argparse.ArgumentParser(
        usage="%(prog)s A B [--runs K] [--nproc N] [--out DIR] [-- FLAGS FOR BOTH...]",
        description="Time two trainer commands A and B, run alternately; print B/A of ms/step.\n"
        'Flags after "--" go to both; a side\'s own flags win over them.',
        epilog='example:\n  %(prog)s train_gpt.py "train_gpt.py --regional_compile true" '
        "-- --num_iterations 100",
        # keeps the example on one line
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "a", metavar="A", help='script and its own flags, one argument: "train_gpt.py --x 1"'
    )
    parser.add_argument("b", metavar="B", help="the same for B")
    parser.add_argument(
        "--runs", metavar="K", type=int, default=2, help="runs of each side (default 2)"
    )
    parser.add_argument(
        "--nproc", metavar="N", type=int, help="processes per run (default: GPUs seen, else 1)"
    )
    parser.add_argument(
        "--out", metavar="DIR", type=Path, help="output folder (default logs/ab-<timestamp>-<pid>)"
    )
    args = parser.parse_args(argv)
    args.common = common
    if args.runs < 1 or (args.nproc is not None and args.nproc < 1):
        parser.error("--runs and --nproc must be at least 1")
    return args


def check_arguments(args: argparse.Namespace) -> str | None:
    """What is wrong with the sides' scripts or the output folder, or None."""
    for name, spec in (("A", args.a), ("B", args.b)):
        try:
            side = shlex.split(spec)
        except ValueError as e:
            problem = str(e).lower()
            return f"{name} cannot be split as a shell would ({problem}): {spec!r}; fix its quotes"
        if not side or not os.path.lexists(side[0]):
            return f"{name} must begin with an existing script: {spec!r}"
        try:
            runlog.read_file(Path(side[0]))
        except runlog.Unreadable as e:
            return f"{name}'s script {e}"
    if args.out.exists() and not args.out.is_dir():
        return f"--out {args.out} is not a folder; give a new --out folder"
    if args.out.exists():
        try:
            with os.scandir(args.out) as listing:
                used = next(listing, None) is not None
        except OSError as e:
            return f"--out {args.out} cannot be listed ({e.strerror or e}); give a new --out folder"
        if used:
            return f"{args.out} is not empty; give a new --out folder"
    # made now: a place that cannot hold the runs' logs fails before the first run
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=args.out).close()
        # claimed: of two A/Bs that found it empty at once, one makes its first run's folder
        (args.out / "A1").mkdir()
    except FileExistsError:
        return f"another A/B took --out {args.out} meanwhile; give each A/B its own --out folder"
    except OSError as e:
        reason = e.strerror or e
        if isinstance(e, NotADirectoryError):
            reason = "a file stands in its path"
        return f"--out {args.out} cannot be made or written to ({reason}); give another --out folder"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    # the process id: two A/Bs started in one second write apart
    args.out = args.out or Path("logs") / time.strftime(f"ab-%Y%m%d-%H%M%S-{os.getpid()}")
    problem = check_arguments(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    sides = {"A": shlex.split(args.a), "B": shlex.split(args.b)}
    labels = []
    runs = []
    # from here a stop ends the A/B cleanly, however early
    stop = PassOn()
    try:
        nproc = args.nproc or max(1, visible_gpus())
        to_console(f"{args.runs} run(s) each of A and B, alternating, {nproc} process(es) per run; "
                   f"pair k with --seed k-1")
        to_console(f"logs in {args.out}")
        for i in range(1, args.runs + 1):
            for name, side in sides.items():
                label = f"{name}{i}"
                cmd = command(side, args.common, nproc, args.out / label, seed=i - 1)
                runs.append(run_once(label, cmd, args.out / label, stop))
                labels.append(label)
    except RunFailed as e:
        print(f"error: {e}\nlogs kept in {args.out}", file=sys.stderr)
        return 1
    except Stopped as e:
        print(f"{e}; logs kept in {args.out}", file=sys.stderr)
        return 128 + stop.signum
    finally:
        stop.close()

    to_console("")
    to_console(runs_table(labels, runs))
    if len({r.planned for r in runs}) > 1:
        to_console("note: the runs planned different step counts, so their losses do not compare")
    warning = timing_warning(runs)
    if warning:
        to_console(warning)
    to_console("")
    step_avg = [r.step_avg_ms for r in runs]
    # the runs are A1 B1 A2 B2 ...
    to_console(ratio_line(step_avg[0::2], step_avg[1::2]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
