"""Line up speedrun logs side by side and judge them the way records are judged.

    python records/compare.py LOG_OR_DIR... [--vs LOG_OR_DIR...] [--target 3.28] [--plot out.png]

A folder stands for every *.txt below it, a quoted glob for what it matches. One row per finished
run, in the order they ran, the val losses at the steps they share, then, for two or more runs of
one configuration, SciPy's one-sided ttest_1samp(losses, target, alternative="less") as the record
READMEs run it (against 3.28 only for runs validated on FineWeb, unless --target is given). With
--vs, group B against group A: B - A of the final val loss and of the train time with SciPy's Welch
test, ttest_ind(b, a, equal_var=False): its df, 95% interval and p. A run counts once, known by its
run id (a resumed run's log names the run that wrote its checkpoint) or by its step lines.
"""

from __future__ import annotations

import argparse
import math
import signal
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


def load_groups(groups: list[list[str]]) -> tuple[list[list[Run]], list[str]]:
    """Each group's finished runs, each run once, and a line for each log left out. Refusal for a
    run in both groups; runlog.Unreadable for a file that cannot be read."""
    runs = []
    skipped = []
    group_of = {}
    for name, args in zip("AB", groups):
        paths, nothing = runlog.log_files(args)
        skipped += nothing
        for path in paths:
            try:
                runs.append(parse_log(path))
            except runlog.LogError as e:
                skipped.append(f"skipped {path}: {e}")
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
    # in the order they ran
    counted = sorted((r for r in runs if id(r) not in left_out), key=lambda r: (r.started, r.path))
    grouped = [[r for r in counted if group_of[id(r)] == name] for name in "AB"[: len(groups)]]
    return grouped, skipped


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


def check_comparable(groups: list[list[Run]], labels: list[str], allow_unknown: bool) -> str:
    """Raise Refusal naming the first differences when a group's runs are not of one
    configuration, when logs without options are beside logs with them (unless allowed: then
    'run 3 (and N more)' is returned), or when groups A and B are validated on different data."""
    every_run = [run for group in groups for run in group]
    unknown = [label for run, label in zip(every_run, labels) if not run.options]
    more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
    unknown_runs = f"run {unknown[0]}{more}" if 0 < len(unknown) < len(every_run) else ""
    if unknown_runs and not allow_unknown:
        raise Refusal(f"{unknown_runs} records no options (a public record's log, or one cut "
                      "down), so nothing says it ran as the others: it is not pooled with, or "
                      "compared as, a run of known options; compare logs of one kind, or pass "
                      "--allow_unknown_options to compare them by steps and devices only")
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
    return unknown_runs


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
    return statistics.fmean(values), statistics.stdev(values), float(test.statistic), float(test.pvalue)


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
    header = ["#", "file", "seed", "steps", "val loss", "train time (s)", "ms/step", "peak mem",
              "PyTorch", "devices"]
    rows = []
    for label, r in zip(labels, runs):
        peak = "?" if r.peak_mib is None else f"{r.peak_mib} MiB"
        rows.append([label, str(r.path), r.options.get("seed", "?"), f"{r.steps_done}/{r.planned}",
                     f"{r.final_loss:.4f}", f"{r.train_time_ms / 1000:.1f}", f"{r.step_avg_ms:.2f}",
                     peak, r.torch_version, r.devices])
    return runlog.format_table(header, rows, right={0, 2, 3, 4, 5, 6, 7})


def shared_steps_table(runs: list[Run], labels: list[str]) -> str:
    """Val loss at the steps every run evaluated, one column per run (labelled as above)."""
    shared = sorted(set.intersection(*(set(r.val_loss) for r in runs)))
    if not shared:
        return "(the runs share no validation steps)"
    header = ["step"] + [f"run {label}" for label in labels]
    rows = [[str(s)] + [f"{r.val_loss[s]:.4f}" for r in runs] for s in shared]
    return runlog.format_table(header, rows, right=set(range(len(header))))


def target_for(runs: list[Run], given: float | None) -> float | None:
    """The target given; else 3.28, a loss on FineWeb's val data, where every run is validated on
    it (the public records' logs, without options, are); else none."""
    on_fineweb = all("fineweb" in r.options.get("val_files", "fineweb").lower() for r in runs)
    return TARGET if given is None and on_fineweb else given


def summary_line(runs: list[Run], target: float | None) -> str:
    """The one-sample test against the target; with none, or one run, why there is no test."""
    losses = [r.final_loss for r in runs]
    if len(runs) < 2:
        return "n=1 (the t-test needs two or more finished runs)"
    if target is None:
        data = " | ".join(sorted({r.options.get("val_files", "?") for r in runs}))
        mean, std = statistics.fmean(losses), statistics.stdev(losses)
        return (f"n={len(runs)} mean={mean:.4f} std={std:.4f}: not tested against {TARGET:g}, the "
                f"target on FineWeb's val data: these runs validated on {data} (--target LOSS tests "
                "against another)")
    mean, std, t, p = t_test_less(losses, target)
    test = f"mean={mean:.4f} std={std:.4f} t={t:.2f} p={format_p(p)}"
    return f"n={len(runs)} {test} target={target:g}"


def welch_line(title: str, a: list[float], b: list[float], unit: str = "", lower="lower") -> str:
    """'B against A <title>: B - A = ..., 95% CI ... to ... (Welch df=...), t=... p=...'; losses
    with 5 decimals, seconds (unit " s") with 2."""

    def number(x):
        return f"{x:+.{2 if unit else 5}f}{unit}"

    if len(a) < 2 or len(b) < 2:
        difference = statistics.fmean(b) - statistics.fmean(a)
        return (f"B against A {title}: B - A = {number(difference)}; a test needs two or more "
                f"finished runs in each group (A has {len(a)}, B has {len(b)})")
    w = welch_less(a, b)
    return (f"B against A {title}: B - A = {number(w.difference)}, 95% CI {number(w.low)} to "
            f"{number(w.high)} (Welch df={w.df:.2f}), t={w.t:.2f} p={format_p(w.p)} that B is "
            f"{lower}")


def two_group_report(a: list[Run], b: list[Run], target: float | None) -> list[str]:
    """Each group's line against the target, what differs between them, then B against A at the
    end and, when the groups ran different step counts, at the last validation step both ran; and
    last, B against A in train time."""
    groups = (("A", a), ("B", b))
    lines = [f"{name}: {summary_line(runs, target_for(runs, target))}" for name, runs in groups]
    named = differences(a, b)
    if {r.source_digest for r in a} != {r.source_digest for r in b}:
        named.append("the trainer's source")
    if not all(r.options for r in a + b) and any(r.options for r in a + b):
        named.append("options, which some logs do not record")
    if named:
        lines.append(f"A and B differ in: {', '.join(named)}")
    final_a = [r.final_loss for r in a]
    final_b = [r.final_loss for r in b]
    if min(len(a), len(b)) > 1 and len(set(final_a)) == len(set(final_b)) == 1:
        lines.append("note: each group's final val losses are all equal, so the test is "
                     "degenerate: p is 0 if B is lower, else 1")
    title = f"at step {a[0].planned}"
    if a[0].planned != b[0].planned:
        title = f"at the end (step {a[0].planned} for A, {b[0].planned} for B)"
    lines.append(welch_line(title, final_a, final_b))
    shared = set.intersection(*(set(r.val_loss) for r in a + b)) - {0}
    if a[0].planned != b[0].planned and not shared:
        lines.append("B against A: the groups share no validation step after step 0")
    elif a[0].planned != b[0].planned:
        step = max(shared)
        at_step = [[r.val_loss[step] for r in runs] for runs in (a, b)]
        lines.append(welch_line(f"at step {step}, the last validation step both ran", *at_step))
    times = [[r.train_time_ms / 1000 for r in runs] for runs in (a, b)]
    return [*lines, welch_line("in train time", *times, unit=" s", lower="faster")]


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
    labels A1, B1, ..., a colour and line style per group; the target's line where there is one."""
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
    if target is not None:
        ax.axhline(target, color="gray", linestyle=":", linewidth=1, label=f"target {target:g}")
    # Step 0's loss (ln 50304 = 10.83) would flatten everything else: zoom on the later evals,
    # and on the train losses after the first of them.
    first_eval = min((s for r in runs for s in r.val_loss if s > 0), default=0)
    later = [v for r in runs for s, v in r.val_loss.items() if s > 0 and math.isfinite(v)]
    for r in runs:
        later += [v for s, v in r.train_loss.items() if s >= first_eval and math.isfinite(v)]
    if later:
        low = min(later + ([] if target is None else [target]))
        margin = 0.05 * (max(later) - low) or 0.05
        ax.set_ylim(low - margin, max(later) + margin)
    ax.set_title("loss against train time" + (": A solid, B dashed" if labels else ""))
    ax.set_xlabel(time_label(runs))
    ax.set_ylabel("loss")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=120, format=fmt)
    finally:
        pyplot.close(fig)


def _import_pyplot():
    """matplotlib, optional (only --plot needs it), drawing into files only, never a window."""
    try:
        import matplotlib
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
    return pyplot, suffix


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Compare speedrun logs: t-test their final val "
                                     "loss against a target, or group B (--vs) against group A.")
    parser.add_argument("logs", nargs="+", metavar="LOG_OR_DIR", help="log files, directories "
                        "holding *.txt logs, or quoted globs (group A with --vs)")
    parser.add_argument("--vs", nargs="+", action="extend", metavar="LOG_OR_DIR", help="group B: "
                        "is its final val loss lower, its train time shorter, than A's?")
    parser.add_argument("--target", type=float, help=f"val loss to test against (default {TARGET}, "
                        "the record's, for runs validated on FineWeb; no test for others)")
    parser.add_argument("--allow_unknown_options", action="store_true", help="compare logs without "
                        "options (the public records') with logs with them, by steps and devices")
    parser.add_argument("--plot", metavar="FILE.png", type=Path,
                        help="also plot val and train loss against train time (needs matplotlib)")
    return parser.parse_args(argv)


def error(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.target is not None and not math.isfinite(args.target):
        return error(f"--target {args.target} is not a loss; give a number such as 3.28", 2)
    if args.plot:
        # before any work, not after the tables
        try:
            pyplot, plot_format = prepare_plot(args.plot)
        except Refusal as e:
            return error(str(e), 2)

    two_groups = args.vs is not None
    try:
        groups, skipped = load_groups([args.logs] + ([args.vs] if two_groups else []))
    except (Refusal, runlog.Unreadable) as e:
        return error(str(e), 1)
    for line in skipped:
        print(line, file=sys.stderr)
    names = ["group A has", "group B (--vs) has"] if two_groups else ["there are"]
    for name, group in zip(names, groups):
        if not group:
            return error(f"{name} no finished runs to compare", 1)

    every_run = [run for group in groups for run in group]
    labels = [str(i) for i in range(1, len(every_run) + 1)]
    if two_groups:
        labels = [f"{name}{i}" for name, g in zip("AB", groups) for i in range(1, len(g) + 1)]
    print(runs_table(every_run, labels), shared_steps_table(every_run, labels), sep="\n\n",
          end="\n\n")
    if args.plot:
        try:
            plot_runs(every_run, target_for(every_run, args.target), args.plot, pyplot,
                      labels if two_groups else None, plot_format)
        except (OSError, ValueError, RuntimeError) as e:
            return error(f"--plot {args.plot} could not be written: {e}", 1)
        print(f"plot written to {args.plot}")
    try:
        unknown = check_comparable(groups, labels, args.allow_unknown_options)
    except Refusal as e:
        return error(str(e), 1)
    if unknown:
        print(f"note: {unknown} records no options: compared by steps and devices only "
              "(--allow_unknown_options)")
    if two_groups:
        print(*two_group_report(*groups, args.target), sep="\n")
    else:
        runs = groups[0]
        target = target_for(runs, args.target)
        if len(runs) > 1 and target is not None and len({r.final_loss for r in runs}) == 1:
            print("note: all final val losses are equal (std 0), so the t-test is degenerate: p is "
                  "0 if the mean is below the target, else 1")
        print(summary_line(runs, target))
    return 0


if __name__ == "__main__":
    # a reader gone (`| head`) ends the output quietly, as it ends any command-line tool's
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.exit(main())
