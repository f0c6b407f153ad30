"""Line up speedrun logs side by side and judge them the way records are judged.

    python records/compare.py LOG_OR_DIR... [--target 3.28] [--plot out.png]

A directory stands for every ``*.txt`` below it. For each finished run it prints one row
(steps, final val loss, train time, ms/step, peak memory, PyTorch version, devices), then the
val loss of all runs at the steps they share, and, with two or more finished runs, a last line

    n=<runs> mean=<mean> std=<std> t=<t> p=<p> target=<target>

where p is a one-sided one-sample t-test that the mean final val loss is below the target.
Logs that are unfinished, truncated or not logs at all are named on stderr and skipped.

The t-test is SciPy's ``ttest_1samp(values, target, alternative="less")``, as in the speedrun's
record READMEs; SciPy is imported only for it. matplotlib is optional, imported only for ``--plot``.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

TARGET = 3.28
SEPARATOR = "=" * 100

# The trainer's step lines (records/README.md). Loss and step_avg are matched loosely (\S+)
# because a diverged run prints "nan" and the first ten steps print "step_avg:nanms".
VAL_LINE = re.compile(
    r"^step:(\d+)/(\d+) val_loss:(\S+) train_time:(\d+)ms step_avg:(\S+)ms$"
)
# The train loss is there in this trainer's logs and in the public records' earliest ones; record
# 18 left it out.
TRAIN_LINE = re.compile(
    r"^step:(\d+)/(\d+) (?:train_loss:(\S+) )?train_time:(\d+)ms step_avg:(\S+)ms$"
)
PEAK_LINE = re.compile(r"^peak memory consumption: (\d+) MiB$")
# When compiling, ", <s>s of it compiling (...)" and more follow; only the first figure is read.
STARTUP_LINE = re.compile(r"^startup: (\d+(?:\.\d*)?)s from launch to the end of step 1\b")
TORCH_LINE = re.compile(r"^Running PyTorch (\S+)", re.IGNORECASE)
DEVICES_LINE = re.compile(r"^devices: (\d+) x (.+)$")
# A GPU row of the nvidia-smi table, e.g.
# "|   0  NVIDIA H100 80GB HBM3          On  |   00000000:19:00.0 Off |"
# (public record logs have no "devices:" line, so this is where their GPUs are named).
SMI_GPU_ROW = re.compile(r"^\|\s+(\d+)\s+(\S.*?)\s+(?:On|Off|N/A)\s+\|")


class LogError(Exception):
    """A file that cannot be used as a finished run; the message says why."""


@dataclass
class Run:
    path: Path
    planned: int  # N of "step:k/N"
    steps_done: int  # last step seen
    val_loss: dict[int, float] = field(default_factory=dict)  # step -> val loss
    val_time_ms: dict[int, float] = field(default_factory=dict)  # step -> train_time
    train_loss: dict[int, float] = field(default_factory=dict)  # step -> train loss, if logged
    train_loss_time_ms: dict[int, float] = field(default_factory=dict)  # step -> train_time
    final_loss: float = math.nan
    train_time_ms: float = math.nan
    step_avg_ms: float = math.nan
    peak_mib: int | None = None
    startup_s: float | None = None  # seconds from launch to the end of step 1, if logged
    torch_version: str = "?"
    devices: str = "?"


# ----------------------------------------------------------------------------- parsing


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


def _read_lines(path: Path) -> list[str]:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise LogError(f"cannot read: {e.strerror or e}") from None
    if b"\0" in data:
        raise LogError("not a log (binary file)")
    # A log is text; replacement characters keep a stray byte from becoming a traceback.
    # Trailing blanks (or a CR from a copied file) must not hide a step line.
    return [
        line.rstrip() for line in data.decode("utf-8", errors="replace").splitlines()
    ]


def _devices_from_smi(rows: list[tuple[str, str]]) -> str:
    """'8 x NVIDIA H100 80GB HBM3' from the GPU rows (index, name) of an nvidia-smi table."""
    names = {}
    for index, name in rows:
        names.setdefault(index, name)  # a table printed twice must not count twice
    kinds = sorted(set(names.values()))
    return f"{len(names)} x {' / '.join(kinds)}"


def _parse_header(lines: list[str], run: Run) -> None:
    """Fill PyTorch version and devices from the lines between the source and the steps."""
    smi_rows = []
    for line in lines:
        if m := TORCH_LINE.match(line):
            run.torch_version = m.group(1)
        elif m := DEVICES_LINE.match(line):
            run.devices = f"{int(m.group(1))} x {m.group(2).strip()}"
        elif m := SMI_GPU_ROW.match(line):
            smi_rows.append((m.group(1), m.group(2)))
    # The trainer's "devices:" line counts the processes actually used, so it wins over
    # nvidia-smi, which lists every GPU in the machine.
    if run.devices == "?" and smi_rows:
        run.devices = _devices_from_smi(smi_rows)


def parse_log(path: str | Path) -> Run:
    """Parse one log into a finished Run, or raise LogError saying why it can't be used."""
    path = Path(path)
    lines = _read_lines(path)
    # The log begins with the trainer's source, whose f-strings look like step lines;
    # everything before the first line of exactly 100 '=' is source and is ignored.
    try:
        start = lines.index(SEPARATOR) + 1
    except ValueError:
        raise LogError("not a log (no line of 100 '=' after the source)") from None
    body = lines[start:]

    first_step = next(
        (i for i, line in enumerate(body) if line.startswith("step:")), len(body)
    )
    run = Run(path=path, planned=0, steps_done=-1)
    _parse_header(body[:first_step], run)

    for line in body[first_step:]:
        if m := PEAK_LINE.match(line):
            run.peak_mib = int(m.group(1))
            continue
        if m := STARTUP_LINE.match(line):
            run.startup_s = float(m.group(1))
            continue
        val = VAL_LINE.match(line)
        m = val or TRAIN_LINE.match(line)
        if not m:
            continue  # blank lines, or anything a later trainer adds
        step, planned = int(m.group(1)), int(m.group(2))
        if run.planned and planned != run.planned:
            raise LogError(
                f"not one run (steps planned as {run.planned} and {planned})"
            )
        run.planned, run.steps_done = planned, max(run.steps_done, step)
        if val:
            run.val_loss[step] = _float(val.group(3))
            run.val_time_ms[step] = float(val.group(4))
            if step == planned:  # a finished run's ms/step is the one on its last line
                run.step_avg_ms = _float(val.group(5))
        elif m.group(3) is not None:
            run.train_loss[step] = _float(m.group(3))
            run.train_loss_time_ms[step] = float(m.group(4))

    _check_finished(run, body)
    run.final_loss = run.val_loss[run.planned]
    run.train_time_ms = run.val_time_ms[run.planned]
    return run


def _check_finished(run: Run, body: list[str]) -> None:
    """A run is finished when it has the val loss line of its last planned step."""
    if run.planned == 0:
        raise LogError("not a log (no step lines)")
    if run.planned in run.val_loss:
        return
    last = next((line for line in reversed(body) if line.strip()), "")
    if last.startswith("step:") and not (
        VAL_LINE.match(last) or TRAIN_LINE.match(last)
    ):
        raise LogError(f"truncated (last line cut off: {last[:60]!r})")
    raise LogError(f"unfinished (stopped at step {run.steps_done} of {run.planned})")


def collect_paths(args: list[str]) -> tuple[list[Path], list[tuple[str, str]]]:
    """Expand files and directories (every *.txt below them) into log paths.

    Returns (paths, problems), problems being (name, reason) for arguments that lead nowhere.
    """
    paths, problems, seen = [], [], set()
    for arg in args:
        p = Path(arg)
        if p.is_dir():
            found = sorted(q for q in p.rglob("*.txt") if q.is_file())
            if not found:
                problems.append((arg, "no *.txt logs in this directory"))
        elif p.exists():
            found = [p]
        else:
            problems.append((arg, "no such file or directory"))
            found = []
        for q in found:
            key = q.resolve()
            if key not in seen:  # the same log named twice must not count twice
                seen.add(key)
                paths.append(q)
    return paths, problems


# ---------------------------------------------------------------------------- t-test


def t_test_less(
    values: list[float], target: float = TARGET
) -> tuple[float, float, float, float]:
    """One-sided one-sample t-test that the mean of `values` is below `target`.

    Returns (mean, sample std with n-1, t, p). t and p are SciPy's
    ttest_1samp(values, target, alternative="less"), the test the speedrun's record READMEs run.

    Equal values (std 0) make the test degenerate; SciPy would warn about precision loss and
    answer from rounding noise, so this case is decided here: t is -inf/+inf/nan and p is 0 if
    the mean is below the target, else 1.
    """
    n = len(values)
    if n < 2:
        raise ValueError("a t-test needs at least two values")
    if len(set(values)) == 1:
        diff = values[0] - target
        t = math.copysign(math.inf, diff) if diff else math.nan
        return values[0], 0.0, t, 0.0 if diff < 0 else 1.0
    mean = math.fsum(values) / n
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    from scipy import stats  # here, not at the top: parsing logs (records/ab.py) needs no SciPy

    result = stats.ttest_1samp(values, target, alternative="less")
    return mean, std, float(result.statistic), float(result.pvalue)


def format_p(p: float) -> str:
    """4 decimals from 0.0001 up, else 4 significant digits: '0.0123', '2.300e-08'."""
    return f"{p:.4f}" if p >= 1e-4 else f"{p:.3e}"


# --------------------------------------------------------------------------- output


def format_table(header: list[str], rows: list[list[str]], right: set[int]) -> str:
    """Align columns in two-space gaps; columns in `right` (the numbers) are right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells):
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def _num(x: float, fmt: str) -> str:
    return "nan" if math.isnan(x) else format(x, fmt)


def runs_table(runs: list[Run]) -> str:
    header = [
        "#",
        "file",
        "steps",
        "val loss",
        "train time (s)",
        "ms/step",
        "peak mem",
        "PyTorch",
        "devices",
    ]
    rows = [
        [
            str(i),
            str(r.path),
            f"{r.steps_done}/{r.planned}",
            _num(r.final_loss, ".4f"),
            _num(r.train_time_ms / 1000, ".1f"),
            _num(r.step_avg_ms, ".2f"),
            "?" if r.peak_mib is None else f"{r.peak_mib} MiB",
            r.torch_version,
            r.devices,
        ]
        for i, r in enumerate(runs, 1)
    ]
    return format_table(header, rows, right={0, 2, 3, 4, 5, 6})


def shared_steps_table(runs: list[Run]) -> str:
    """Val loss at the steps every run evaluated, one column per run (numbered as above)."""
    shared = sorted(set.intersection(*(set(r.val_loss) for r in runs)))
    if not shared:
        return "(the runs share no validation steps)"
    header = ["step"] + [f"run {i}" for i in range(1, len(runs) + 1)]
    rows = [[str(s)] + [_num(r.val_loss[s], ".4f") for r in runs] for s in shared]
    return format_table(header, rows, right=set(range(len(header))))


def summary_line(runs: list[Run], target: float) -> str:
    mean, std, t, p = t_test_less([r.final_loss for r in runs], target)
    return (
        f"n={len(runs)} mean={mean:.4f} std={std:.4f} t={t:.2f} "
        f"p={format_p(p)} target={target:g}"
    )


def plot_runs(runs: list[Run], target: float, out: Path, pyplot) -> None:
    """Val loss against train time, one line with markers per run, and the train loss of every
    step, where the log has it, as a thin line of the same colour; the target is dashed."""
    fig, ax = pyplot.subplots(figsize=(8, 5))
    for i, r in enumerate(runs, 1):
        steps = sorted(r.val_loss)
        (val_line,) = ax.plot(
            [r.val_time_ms[s] / 1000 for s in steps],
            [r.val_loss[s] for s in steps],
            marker="o",
            markersize=3,
            label=f"run {i}: {r.path.name} (val)",
        )
        if r.train_loss:
            steps = sorted(r.train_loss)
            ax.plot(
                [r.train_loss_time_ms[s] / 1000 for s in steps],
                [r.train_loss[s] for s in steps],
                color=val_line.get_color(),
                linewidth=0.7,
                alpha=0.5,
                label=f"run {i}: train",
            )
    ax.axhline(
        target, color="gray", linestyle="--", linewidth=1, label=f"target {target:g}"
    )
    # Step 0's loss (ln 50304 = 10.83) would flatten everything else: zoom on the later evals,
    # and on the train losses after the first of them.
    first_eval = min((s for r in runs for s in r.val_loss if s > 0), default=0)
    later = [
        v for r in runs for s, v in r.val_loss.items() if s > 0 and math.isfinite(v)
    ]
    later += [
        v
        for r in runs
        for s, v in r.train_loss.items()
        if s >= first_eval and math.isfinite(v)
    ]
    if later:
        low, high = min(later + [target]), max(later)
        margin = 0.05 * (high - low) or 0.05
        ax.set_ylim(low - margin, high + margin)
    ax.set_title("loss against train time")
    ax.set_xlabel("train time (s)")
    ax.set_ylabel("loss")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    pyplot.close(fig)


def _import_pyplot():
    """matplotlib is optional: only --plot needs it."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, never a window
        from matplotlib import pyplot
    except ImportError:
        return None
    return pyplot


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Compare speedrun logs and t-test their final val loss against a target."
    )
    parser.add_argument(
        "logs",
        nargs="+",
        metavar="LOG_OR_DIR",
        help="log files, or directories holding *.txt logs",
    )
    parser.add_argument(
        "--target",
        type=float,
        default=TARGET,
        help=f"val loss a record must beat (default {TARGET})",
    )
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        type=Path,
        help="also plot val and train loss against train time (needs matplotlib)",
    )
    args = parser.parse_args(argv)

    pyplot = None
    if args.plot:  # fail before any work, not after the tables
        pyplot = _import_pyplot()
        if pyplot is None:
            print(
                "error: --plot needs matplotlib, which is not installed "
                "(pip install matplotlib); run without --plot for the tables.",
                file=sys.stderr,
            )
            return 2

    paths, problems = collect_paths(args.logs)
    runs = []
    for path in paths:
        try:
            runs.append(parse_log(path))
        except LogError as e:
            problems.append((str(path), str(e)))
    for name, reason in problems:
        print(f"skipped {name}: {reason}", file=sys.stderr)
    if not runs:
        print("no finished runs to compare", file=sys.stderr)
        return 1

    print(runs_table(runs))
    print()
    print(shared_steps_table(runs))
    print()
    if args.plot:
        plot_runs(runs, args.target, args.plot, pyplot)
        print(f"plot written to {args.plot}")
    if len(runs) < 2:
        print("(the t-test needs two or more finished runs)")
        return 0
    if len({r.final_loss for r in runs}) == 1:
        print(
            "note: all final val losses are equal (std 0), so the t-test is degenerate: "
            "p is 0 if the mean is below the target, else 1"
        )
    print(summary_line(runs, args.target))
    return 0


if __name__ == "__main__":
    sys.exit(main())
