"""Line up speedrun logs side by side and judge them the way records are judged.

    python records/compare.py LOG_OR_DIR... [--vs LOG_OR_DIR...] [--target 3.28] [--plot out.png]

A folder stands for every *.txt below it, a quoted glob for what it matches. One row per finished
run, the val losses at the steps they share, then, for two or more runs of one configuration,
SciPy's one-sided ttest_1samp(losses, target, alternative="less"), as the record READMEs run it.
With --vs, group B (after it) against group A: each group's test, every setting they differ in,
and B - A with SciPy's Welch test, ttest_ind(b, a, equal_var=False): its df, 95% interval and p.

A run counts once, known by its run id (its log is <run id>.txt; a resumed run's names the run it
resumed) or by its step lines. A copy, a stopped, diverged or unfinished run, or what is not a log
is named and left out; a path that cannot be read is an error naming it; runs of different
configurations, or one run in both groups, are refused in one line.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import statistics
import sys
from collections import namedtuple
from pathlib import Path

# records/ is not a package: the tools' shared module is imported from beside this file
sys.path.insert(0, str(Path(__file__).resolve().parent))
import runlog  # noqa: E402
from runlog import NOT_CONFIGURATION  # noqa: E402
from runlog import Run  # noqa: E402
from runlog import parse_log  # noqa: E402

TARGET = 3.28
# What the val loss is measured on: A and B must share it for their losses to compare
VAL_DATA = ("val_files", "val_tokens")
# Globs of shards, compared by their file names (the folder may differ from machine to machine)
DATA_FILES = ("train_files", "val_files")


class Refusal(Exception):
    """A comparison that would judge what is not there; the message says why and what to do."""


# ---------------------------------------------------------------- runs and configurations


def load_groups(groups: list[list[str]]) -> tuple[list[list[Run]], list[str], list[str]]:
    """Each group's finished runs, each run once; a line for each log left out; and one for each
    path that cannot be read. Refusal for a run in both groups."""
    runs = []
    skipped = []
    unreadable = []
    group_of = {}
    for name, args in zip("AB", groups):
        paths, nothing, unlisted = runlog.log_files(args)
        skipped += nothing
        unreadable += unlisted
        for path in paths:
            try:
                runs.append(parse_log(path))
            except runlog.LogError as e:
                skipped.append(f"skipped {path}: {e}")
            except runlog.Unreadable as e:
                unreadable.append(str(e))
            else:
                group_of[id(runs[-1])] = name
    left_out = set()
    for run, twin, how in runlog.count_once(runs):
        if group_of[id(run)] != group_of[id(twin)]:
            a, b = sorted([run, twin], key=lambda r: group_of[id(r)])
            raise Refusal(f"{a.path} in A and {b.path} in B are the same run ({how}); give each "
                          "run to one group")
        skipped.append(f"skipped {run.path}: the same run as {twin.path} ({how}); counted once")
        left_out.add(id(run))
    counted = [r for r in runs if id(r) not in left_out]
    grouped = [[r for r in counted if group_of[id(r)] == name] for name in "AB"[: len(groups)]]
    return grouped, skipped, unreadable


def settings(run: Run, configuration: bool = False) -> dict[str, str]:
    """How a run was made: steps, devices, logged options (with `configuration`, only those of what
    it trains and how it is measured); shards by file name, wherever their folder."""
    known = {"steps": str(run.planned), "devices": run.devices}
    for name, value in run.made_as().items():
        if name in DATA_FILES:
            value = value.replace("\\", "/").rsplit("/", 1)[-1]
        # num_iterations is the steps
        if name != "num_iterations" and not (configuration and name in NOT_CONFIGURATION):
            known[name] = value
    return known


def differences(a: list[Run], b: list[Run], names=None, configuration=False) -> list[str]:
    """The settings (or `names`) whose values differ between runs a and runs b, 'name a / b'; an
    option one side's trainer lacks is '(no such option)', unless that side logs no options at all
    (the public records' logs): then nothing is known of them."""
    found = []
    for name in dict.fromkeys(n for run in a + b for n in settings(run, configuration)):
        if names is not None and name not in names:
            continue
        values = []
        for side in (a, b):
            logged = [r for r in side if r.options or name in ("steps", "devices")]
            shown = {settings(r, configuration).get(name, "(no such option)") for r in logged}
            values.append(" | ".join(sorted(value or repr("") for value in shown)))
        if all(values) and values[0] != values[1]:
            found.append(f"{name} {values[0]} / {values[1]}")
    return found


def check_comparable(groups: list[list[Run]], labels: list[str]) -> None:
    """Raise Refusal naming the first differences when a group's runs are not of one
    configuration, or when group A and group B are validated on different data."""
    start = 0
    for name, runs in zip("AB", groups):
        where = f" in {name}" if len(groups) == 2 else ""
        for run, label in zip(runs[1:], labels[start + 1 :]):
            named = differences([runs[0]], [run], configuration=True)
            if len(named) > 3:
                named[2:] = [f"{named[2]} and {len(named) - 3} more"]
            if named:
                raise Refusal(f"no t-test{where}: runs {labels[start]} and {label} differ in "
                              f"{', '.join(named)}, and runs of different configurations are not "
                              "pooled: compare the logs of one configuration (name them, or their "
                              "folder)")
        start += len(runs)
    named = differences(*groups, names=VAL_DATA) if len(groups) == 2 else []
    if named:
        raise Refusal(f"no test of B against A: they are validated on different data "
                      f"({', '.join(named)}), so their val losses do not compare; compare runs "
                      "validated on the same val data")


# ---------------------------------------------------------------------- t-tests, report


def degenerate(difference: float) -> tuple[float, float]:
    """t and p where every value of each group is equal: with no spread to judge by, SciPy would
    warn and answer from rounding noise, so t is -inf/+inf/nan and p is 0 if below, else 1."""
    t = math.copysign(math.inf, difference) if difference else math.nan
    return t, 0.0 if difference < 0 else 1.0


def t_test_less(values: list[float], target: float = TARGET) -> tuple[float, float, float, float]:
    """(mean, sample std, t, p) of SciPy's ttest_1samp(values, target, alternative="less"): the
    one-sided test that the mean is below the target, which the speedrun's record READMEs run."""
    if len(values) < 2:
        raise ValueError("a t-test needs at least two values")
    if len(set(values)) == 1:
        return values[0], 0.0, *degenerate(values[0] - target)
    from scipy import stats
    test = stats.ttest_1samp(values, target, alternative="less")
    mean = statistics.fmean(values)
    return mean, statistics.stdev(values), float(test.statistic), float(test.pvalue)


# B against A: B's mean minus A's, its 95% interval, Welch's df, t, and p that B is lower
Welch = namedtuple("Welch", "difference low high df t p")


def welch_less(a: list[float], b: list[float]) -> Welch:
    """B against A: t, p and df of SciPy's ttest_ind(b, a, equal_var=False, alternative="less"),
    the interval of the two-sided test's confidence_interval(0.95) (the one-sided one reaches to
    -inf); when each group's values are all equal, the interval is the difference alone."""
    difference = statistics.fmean(b) - statistics.fmean(a)
    if len(set(a)) == 1 and len(set(b)) == 1:
        return Welch(difference, difference, difference, math.nan, *degenerate(difference))
    from scipy import stats
    test = stats.ttest_ind(b, a, equal_var=False, alternative="less")
    interval = stats.ttest_ind(b, a, equal_var=False).confidence_interval(0.95)
    numbers = (interval.low, interval.high, test.df, test.statistic, test.pvalue)
    return Welch(difference, *map(float, numbers))


def format_p(p: float) -> str:
    """4 decimals from 0.0001 up, else 4 significant digits: '0.0123', '2.300e-08'."""
    return f"{p:.4f}" if p >= 1e-4 else f"{p:.3e}"


def runs_table(runs: list[Run], labels: list[str]) -> str:
    """One row per run, labelled 1, 2, ... or A1, B1, ...."""
    header = ["#", "file", "steps", "val loss", "train time (s)", "ms/step", "peak mem", "PyTorch",
              "devices"]
    rows = []
    for label, r in zip(labels, runs):
        peak = "?" if r.peak_mib is None else f"{r.peak_mib} MiB"
        rows.append([label, str(r.path), f"{r.steps_done}/{r.planned}", f"{r.final_loss:.4f}",
                     f"{r.train_time_ms / 1000:.1f}", f"{r.step_avg_ms:.2f}", peak,
                     r.torch_version, r.devices])
    return runlog.format_table(header, rows, right={0, 2, 3, 4, 5, 6})


def shared_steps_table(runs: list[Run], labels: list[str]) -> str:
    """Val loss at the steps every run evaluated, one column per run (labelled as above)."""
    shared = sorted(set.intersection(*(set(r.val_loss) for r in runs)))
    if not shared:
        return "(the runs share no validation steps)"
    header = ["step"] + [f"run {label}" for label in labels]
    rows = [[str(s)] + [f"{r.val_loss[s]:.4f}" for r in runs] for s in shared]
    return runlog.format_table(header, rows, right=set(range(len(header))))


def summary_line(runs: list[Run], target: float) -> str:
    mean, std, t, p = t_test_less([r.final_loss for r in runs], target)
    test = f"mean={mean:.4f} std={std:.4f} t={t:.2f} p={format_p(p)}"
    return f"n={len(runs)} {test} target={target:g}"


def welch_line(title: str, a: list[float], b: list[float]) -> str:
    """'B against A <title>: B - A = ..., 95% CI ... to ... (Welch df=...), t=... p=...'."""
    if len(a) < 2 or len(b) < 2:
        difference = statistics.fmean(b) - statistics.fmean(a)
        return (f"B against A {title}: B - A = {difference:+.5f}; a test needs two or more "
                f"finished runs in each group (A has {len(a)}, B has {len(b)})")
    w = welch_less(a, b)
    return (f"B against A {title}: B - A = {w.difference:+.5f}, 95% CI {w.low:+.5f} to "
            f"{w.high:+.5f} (Welch df={w.df:.2f}), t={w.t:.2f} p={format_p(w.p)} that B is lower")


def two_group_report(a: list[Run], b: list[Run], target: float) -> list[str]:
    """Each group's line against the target, what differs between them, then B against A at the
    end and, when the groups ran different step counts, at the last validation step both ran."""
    lines = []
    for name, runs in (("A", a), ("B", b)):
        if len(runs) < 2:
            lines.append(f"{name}: n=1 (the t-test needs two or more finished runs)")
        else:
            lines.append(f"{name}: {summary_line(runs, target)}")
    named = differences(a, b)
    if {r.source_digest for r in a} != {r.source_digest for r in b}:
        named.append("the trainer's source")
    if named:
        lines.append(f"A and B differ in: {', '.join(named)}")
    final_a = [r.final_loss for r in a]
    final_b = [r.final_loss for r in b]
    if min(len(a), len(b)) > 1 and len(set(final_a)) == len(set(final_b)) == 1:
        lines.append("note: each group's final val losses are all equal, so the test is "
                     "degenerate: p is 0 if B is lower, else 1")
    if a[0].planned == b[0].planned:
        return [*lines, welch_line(f"at step {a[0].planned}", final_a, final_b)]
    title = f"at the end (step {a[0].planned} for A, {b[0].planned} for B)"
    lines.append(welch_line(title, final_a, final_b))
    shared = set.intersection(*(set(r.val_loss) for r in a + b)) - {0}
    if not shared:
        return [*lines, "B against A: the groups share no validation step after step 0"]
    step = max(shared)
    title = f"at step {step}, the last validation step both ran"
    return [*lines, welch_line(title, [r.val_loss[step] for r in a], [r.val_loss[step] for r in b])]


# ----------------------------------------------------------------------------- plot


def plot_times(run: Run, times: dict[int, float]) -> tuple[list[int], list[float]]:
    """The steps to draw and their train time in seconds: the untimed first steps at 0, or, in a
    resumed run, left out (their train time is in its checkpoint, not in its log)."""
    steps = [s for s in sorted(times) if s > run.untimed_through or run.resumed_from is None]
    seconds = [times[s] / 1000 if s > run.untimed_through else 0.0 for s in steps]
    return steps, seconds


def time_label(runs: list[Run]) -> str:
    """The x axis: train time, and what was done with the untimed first steps."""
    counts = sorted({r.untimed_through for r in runs if r.resumed_from is None})
    first = "the first steps"
    if len(counts) == 1 and counts[0] > 0:
        first = f"the first {counts[0]} steps"
    label = f"train time (s); {first} (compiling, warming up) are untimed"
    if counts:
        label += ", drawn at 0"
    if any(r.resumed_from is not None for r in runs):
        label += "; a resumed run's are left out"
    return label


def plot_runs(runs: list[Run], target: float, out: Path, pyplot, labels=None, fmt=None) -> None:
    """Val loss against train time per run, and each step's train loss where logged, thinner; with
    labels A1, B1, ..., a colour and line style per group. Written aside, then renamed: whole."""
    fig, ax = pyplot.subplots(figsize=(8, 5))
    group_style = {"A": dict(color="C0", linestyle="-"), "B": dict(color="C3", linestyle="--")}
    for i, r in enumerate(runs):
        name = f"run {labels[i] if labels else i + 1}"
        style = dict(group_style[labels[i][0]]) if labels else {}
        steps, seconds = plot_times(r, r.val_time_ms)
        losses = [r.val_loss[s] for s in steps]
        label = f"{name}: {r.path.name} (val)"
        (val_line,) = ax.plot(seconds, losses, marker="o", markersize=3, label=label, **style)
        if r.train_loss:
            steps, seconds = plot_times(r, r.train_loss_time_ms)
            style.setdefault("color", val_line.get_color())
            losses = [r.train_loss[s] for s in steps]
            ax.plot(seconds, losses, linewidth=0.7, alpha=0.5, label=f"{name}: train", **style)
    ax.axhline(target, color="gray", linestyle=":", linewidth=1, label=f"target {target:g}")
    # Step 0's loss (ln 50304 = 10.83) would flatten everything else: zoom on the later evals,
    # and on the train losses after the first of them.
    first_eval = min((s for r in runs for s in r.val_loss if s > 0), default=0)
    later = [v for r in runs for s, v in r.val_loss.items() if s > 0 and math.isfinite(v)]
    for r in runs:
        later += [v for s, v in r.train_loss.items() if s >= first_eval and math.isfinite(v)]
    if later:
        low = min(later + [target])
        margin = 0.05 * (max(later) - low) or 0.05
        ax.set_ylim(low - margin, max(later) + margin)
    ax.set_title("loss against train time" + (": A solid, B dashed" if labels else ""))
    ax.set_xlabel(time_label(runs))
    ax.set_ylabel("loss")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    temp = out.with_name(f".{out.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    try:
        fig.savefig(temp, dpi=120, format=fmt)
        os.replace(temp, out)
    finally:
        pyplot.close(fig)
        temp.unlink(missing_ok=True)


def _import_pyplot():
    """matplotlib is optional: only --plot needs it."""
    try:
        import matplotlib
        # files only, never a window
        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ImportError:
        return None
    return pyplot


def prepare_plot(out: Path) -> tuple[object, str]:
    """pyplot and the format to save --plot in (its suffix), or Refusal before any work is done."""
    pyplot = _import_pyplot()
    if pyplot is None:
        raise Refusal("--plot needs matplotlib, which is not installed (pip install matplotlib); "
                      "run without --plot for the tables.")
    if out.exists() and not out.is_file():
        raise Refusal(f"--plot {out} is not a regular file; give a file name")
    suffix = out.suffix[1:].lower()
    supported = pyplot.figure().canvas.get_supported_filetypes()
    pyplot.close("all")
    if not suffix:
        raise Refusal(f"--plot {out} has no suffix, so its format is unknown: name the file with "
                      f"one (e.g. {str(out).rstrip('.')}.png)")
    if suffix not in supported:
        names = ", ".join("." + s for s in sorted(supported))
        raise Refusal(f"--plot {out}: matplotlib cannot write .{suffix} files; use one of {names}")
    if not out.parent.is_dir():
        raise Refusal(f"--plot {out}: there is no folder {out.parent}; create it or name another")
    for path in (out.parent, out):
        if path.exists() and not os.access(path, os.W_OK):
            raise Refusal(f"--plot {out} cannot be written (Permission denied); name another")
    return pyplot, suffix


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    usage = "%(prog)s LOG_OR_DIR... [--vs LOG_OR_DIR...] [--target 3.28] [--plot FILE.png]"
    parser = argparse.ArgumentParser(usage=usage, description="Compare speedrun logs and t-test "
                                     "their final val loss against a target, or group B (--vs) "
                                     "against group A.")
    parser.add_argument("logs", nargs="+", metavar="LOG_OR_DIR", help="log files, directories "
                        "holding *.txt logs, or quoted globs (group A with --vs)")
    parser.add_argument("--vs", nargs="+", action="extend", metavar="LOG_OR_DIR", help="group B: "
                        "test whether its final val loss is lower than that of the logs before")
    parser.add_argument("--target", type=float, default=TARGET,
                        help=f"val loss a record must beat (default {TARGET})")
    parser.add_argument("--plot", metavar="FILE.png", type=Path,
                        help="also plot val and train loss against train time (needs matplotlib)")
    return parser.parse_args(argv)


def error(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not math.isfinite(args.target):
        return error(f"--target {args.target} is not a loss; give a number such as 3.28", 2)
    if args.plot:
        # before any work, not after the tables
        try:
            pyplot, plot_format = prepare_plot(args.plot)
        except Refusal as e:
            return error(str(e), 2)

    two_groups = args.vs is not None
    try:
        groups, skipped, unreadable = load_groups([args.logs] + ([args.vs] if two_groups else []))
    except Refusal as e:
        return error(str(e), 1)
    for line in skipped + [f"error: {problem}" for problem in unreadable]:
        print(line, file=sys.stderr)
    if unreadable:
        return 1
    for name, group in zip(("A", "B (--vs)"), groups):
        if not group and two_groups:
            return error(f"group {name} has no finished runs to compare", 1)
        if not group:
            return error("no finished runs to compare", 1)

    every_run = [run for group in groups for run in group]
    labels = [str(i) for i in range(1, len(every_run) + 1)]
    if two_groups:
        labels = [f"{name}{i}" for name, g in zip("AB", groups) for i in range(1, len(g) + 1)]
    print(runs_table(every_run, labels), shared_steps_table(every_run, labels), sep="\n\n",
          end="\n\n")
    if args.plot:
        group_labels = labels if two_groups else None
        try:
            plot_runs(every_run, args.target, args.plot, pyplot, group_labels, plot_format)
        except (OSError, ValueError, RuntimeError) as e:
            return error(f"--plot {args.plot} could not be written: {e}", 1)
        print(f"plot written to {args.plot}")
    try:
        check_comparable(groups, labels)
    except Refusal as e:
        return error(str(e), 1)
    if two_groups:
        print(*two_group_report(*groups, args.target), sep="\n")
        return 0
    runs = groups[0]
    if len(runs) < 2:
        print("(the t-test needs two or more finished runs)")
        return 0
    if len({r.final_loss for r in runs}) == 1:
        print("note: all final val losses are equal (std 0), so the t-test is degenerate: p is 0 "
              "if the mean is below the target, else 1")
    print(summary_line(runs, args.target))
    return 0


if __name__ == "__main__":
    sys.exit(runlog.run_printing(main))
