"""Line up speedrun logs side by side and judge them the way records are judged.

    python records/compare.py LOG_OR_DIR... [--vs LOG_OR_DIR...] [--target 3.28] [--plot out.png]

A directory stands for every ``*.txt`` below it; a quoted glob (``"logs/ab-1/A*"``) for what it
matches. For each finished run it prints one row (steps, final val loss, train time, ms/step, peak
memory, PyTorch version, devices), then the val loss of all runs at the steps they share, and, with
two or more finished runs of one configuration, a last line

    n=<runs> mean=<mean> std=<std> t=<t> p=<p> target=<target>

where p is a one-sided one-sample t-test that the mean final val loss is below the target.

With ``--vs``, the logs before it are group A, those after it group B (the change). Each group
gets that line, then B against A: the difference of the mean final val losses with its 95%
confidence interval (Welch) and Welch's one-sided t-test that B is lower; when the groups ran
different step counts, the same at the last validation step both ran.

Logs that are unfinished, truncated, diverged, stopped or not logs at all are named on stderr and
left out. Runs of different configurations (steps, batch, data, devices, ...) are not pooled into
one test: the test is refused in one line that names the difference.

The t-tests are SciPy's ``ttest_1samp(values, target, alternative="less")``, as in the speedrun's
record READMEs, and ``ttest_ind(b, a, equal_var=False, alternative="less")``; SciPy is imported
only for them. matplotlib is optional, imported only for ``--plot``.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import math
import os
import re
import socket
import sys
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path

TARGET = 3.28
SEPARATOR = "=" * 100

# The trainer's step lines (records/README.md). Loss and step_avg are matched loosely (\S+)
# because a diverged run prints "nan" and the first ten steps print "step_avg:nanms".
VAL_LINE = re.compile(r"^step:(\d+)/(\d+) val_loss:(\S+) train_time:(\d+)ms step_avg:(\S+)ms$")
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
# One field of the configuration section, "  name = value" (an empty value loses its blank)
OPTION_LINE = re.compile(r"^  (\w+) =(?: (.*))?$")
# A resumed run's log says where it started; its first step after that is not timed either
RESUMED_LINE = re.compile(r"^resumed from .* at step (\d+)\b")
# The trainer's last line after a stop signal, or after a failure of its log
STOP_LINE = re.compile(r"^(?:stopped by \S+|error: .*: stopped) after step \d+")
# In the trainer's source at the top of the log: how many first steps it leaves untimed
UNTIMED_LINE = re.compile(r"^UNTIMED_STEPS = (\d+)\s*$")

# Fields of the configuration that change how a run runs or where it writes, not what it trains
# or how it is measured: runs that differ only in these are one configuration. Every other field,
# the step count and the devices are compared.
NOT_CONFIGURATION = frozenset(
    {
        "log_dir",
        "seed",
        "resume",
        "save_checkpoint",
        "checkpoint_every",
        "hellaswag",
        "hellaswag_data",
        "tokenizer",
        "compile",
        "compile_tuning",
        "compile_cache",
        "regional_compile",
        "fused_head_loss",
        "fused_qkv",
        "head_chunk_rows",
        "max_device_batch_size",
        "profile",
    }
)
# What the val loss is measured on: A and B must share it for their losses to compare
VAL_DATA = ("val_files", "val_tokens")
# Globs of shards, compared by their file names (the folder may differ from machine to machine)
DATA_FILES = ("train_files", "val_files")


class LogError(Exception):
    """A file that cannot be used as a finished run; the message says why."""


class Refusal(Exception):
    """A comparison that would judge what is not there; the message says why and what to do."""


@dataclass
class Run:
    path: Path
    # N of "step:k/N"
    planned: int
    # the last step seen
    steps_done: int
    # step -> val loss, and its train_time
    val_loss: dict[int, float] = field(default_factory=dict)
    val_time_ms: dict[int, float] = field(default_factory=dict)
    # step -> train loss, where the log has it, and its train_time
    train_loss: dict[int, float] = field(default_factory=dict)
    train_loss_time_ms: dict[int, float] = field(default_factory=dict)
    final_loss: float = math.nan
    train_time_ms: float = math.nan
    step_avg_ms: float = math.nan
    peak_mib: int | None = None
    # seconds from launch to the end of step 1, if logged
    startup_s: float | None = None
    torch_version: str = "?"
    devices: str = "?"
    # the configuration section, name -> value as logged (empty for the public records' logs)
    options: dict[str, str] = field(default_factory=dict)
    # the lines of steps up to this one carry no train time (compiling, warming up)
    untimed_through: int = 0
    # the step a resumed run started from (None: a new run)
    resumed_from: int | None = None
    # a digest of the trainer's source at the top of the log
    source_digest: str = ""


# ----------------------------------------------------------------------------- parsing


def _float(text: str, line: str) -> float:
    """A logged number; "nan" and "inf" are numbers too, anything else makes the log odd."""
    try:
        return float(text)
    except ValueError:
        raise LogError(f"odd step line {line[:60]!r}") from None


def _read_lines(path: Path) -> list[str]:
    if path.exists() and not path.is_file():
        # a named pipe or a device would block or never end
        raise LogError("not a regular file")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise LogError(f"cannot read: {e.strerror or e}") from None
    if b"\0" in data:
        raise LogError("not a log (binary file)")
    # A log is text; replacement characters keep a stray byte from becoming a traceback.
    # Trailing blanks (or a CR from a copied file) must not hide a step line.
    text = data.decode("utf-8", errors="replace")
    return [line.rstrip() for line in text.splitlines()]


def _devices_from_smi(rows: list[tuple[str, str]]) -> str:
    """'8 x NVIDIA H100 80GB HBM3' from the GPU rows (index, name) of an nvidia-smi table."""
    names = {}
    for index, name in rows:
        # a table printed twice must not count twice
        names.setdefault(index, name)
    kinds = sorted(set(names.values()))
    return f"{len(names)} x {' / '.join(kinds)}"


def _parse_header(lines: list[str], run: Run) -> None:
    """Fill PyTorch version, devices and configuration from the lines before the steps."""
    smi_rows = []
    in_options = False
    for line in lines:
        if line == "hyperparameters:":
            in_options = True
            continue
        option = OPTION_LINE.match(line) if in_options else None
        if option:
            run.options[option.group(1)] = option.group(2) or ""
            continue
        in_options = False
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
    source = lines[: start - 1]
    body = lines[start:]

    first_step = next((i for i, line in enumerate(body) if line.startswith("step:")), len(body))
    run = Run(path=path, planned=0, steps_done=-1)
    run.source_digest = hashlib.sha256("\n".join(source).encode()).hexdigest()
    _parse_header(body[:first_step], run)

    # steps whose lines say "step_avg:nanms" from the first step line on: not timed yet
    nan_average_through = -1
    timed_seen = False
    line_times = []
    for line in body:
        if m := RESUMED_LINE.match(line):
            run.resumed_from = int(m.group(1))
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
            # blank lines, or anything a later trainer adds
            continue
        step = int(m.group(1))
        planned = int(m.group(2))
        if run.planned and planned != run.planned:
            raise LogError(f"not one run (steps planned as {run.planned} and {planned})")
        if step < run.steps_done:
            raise LogError(f"not one run (step lines go back from step {run.steps_done} to {step})")
        if step > planned:
            raise LogError(f"odd step line {line[:60]!r} (a step past the {planned} planned)")
        run.planned = planned
        run.steps_done = step
        average = _float(m.group(5), line)
        line_times.append((val is not None, step, float(m.group(4))))
        if math.isnan(average) and not timed_seen:
            nan_average_through = step
        else:
            timed_seen = True
        if val:
            run.val_loss[step] = _float(val.group(3), line)
            run.val_time_ms[step] = float(val.group(4))
            # a finished run's ms/step is the one on its last line
            if step == planned:
                run.step_avg_ms = average
        elif m.group(3) is not None:
            run.train_loss[step] = _float(m.group(3), line)
            run.train_loss_time_ms[step] = float(m.group(4))

    _check_finished(run, body)
    run.final_loss = run.val_loss[run.planned]
    run.train_time_ms = run.val_time_ms[run.planned]
    run.untimed_through = max(_untimed_through(run, source), nan_average_through)
    _check_time_goes_forward(run, line_times)
    return run


def _untimed_through(run: Run, source: list[str]) -> int:
    """The last step whose lines carry no train time, as the trainer that wrote the log defines
    it: its first UNTIMED_STEPS steps, and a resumed run's first step (-1: not known, as in the
    public records' logs, where "step_avg:nanms" tells instead)."""
    untimed = -1
    for line in source:
        if m := UNTIMED_LINE.match(line):
            untimed = max(int(m.group(1)), 1)
            break
    if run.resumed_from is not None:
        untimed = max(untimed, run.resumed_from + 1)
    return untimed


def _check_time_goes_forward(run: Run, line_times: list[tuple[bool, int, float]]) -> None:
    """Train time never goes back after timing starts, on the val lines nor on the train lines;
    a log where it does is not one run. line_times: (is a val line, step, ms) of every line."""
    for kind in (True, False):
        timed = [(s, ms) for val, s, ms in line_times if val == kind and s > run.untimed_through]
        for (step, ms), (next_step, next_ms) in zip(timed, timed[1:]):
            if next_ms < ms:
                raise LogError(
                    f"not one run (train_time goes back from {ms:.0f}ms at step {step} "
                    f"to {next_ms:.0f}ms at step {next_step})"
                )


def _check_finished(run: Run, body: list[str]) -> None:
    """A run is finished when it has the val loss line of its last planned step, and it never
    diverged on the way."""
    if run.planned == 0:
        raise LogError("not a log (no step lines)")
    for step in sorted(run.val_loss):
        loss = run.val_loss[step]
        if not math.isfinite(loss):
            raise LogError(f"diverged (val loss {loss} at step {step} of {run.planned})")
    if run.planned in run.val_loss:
        return
    last = next((line for line in reversed(body) if line.strip()), "")
    stop = next((line for line in reversed(body) if STOP_LINE.match(line)), None)
    if stop is not None:
        reason = stop.split(";")[0]
        raise LogError(f"stopped early ({reason}; {run.steps_done} of {run.planned} steps)")
    if last.startswith("step:") and not (VAL_LINE.match(last) or TRAIN_LINE.match(last)):
        raise LogError(f"truncated (last line cut off: {last[:60]!r})")
    raise LogError(f"unfinished (stopped at step {run.steps_done} of {run.planned})")


def collect_paths(args: list[str]) -> tuple[list[Path], list[tuple[str, str]]]:
    """Expand files, directories (every *.txt below them) and globs into log paths.

    Returns (paths, problems), problems being (name, reason) for arguments that lead nowhere.
    """
    paths = []
    problems = []
    seen = set()
    for arg in args:
        p = Path(arg)
        if p.exists():
            matches = [p]
        elif glob.has_magic(arg):
            matches = [Path(name) for name in sorted(glob.glob(arg, recursive=True))]
            if not matches:
                problems.append((arg, "no file or directory matches this pattern"))
        else:
            matches = []
            problems.append((arg, "no such file or directory"))
        for match in matches:
            if match.is_dir():
                found = sorted(q for q in match.rglob("*.txt") if q.is_file())
                if not found:
                    problems.append((str(match), "no *.txt logs in this directory"))
            else:
                found = [match]
            for q in found:
                key = q.resolve()
                # the same log named twice must not count twice
                if key not in seen:
                    seen.add(key)
                    paths.append(q)
    return paths, problems


def configuration(run: Run) -> dict[str, str]:
    """What makes runs comparable: the step count, the devices and every logged option but those
    that only change how the run runs (NOT_CONFIGURATION)."""
    config = {"steps": str(run.planned), "devices": run.devices}
    for name, value in run.options.items():
        # num_iterations is the step count, already there
        if name in NOT_CONFIGURATION or name == "num_iterations":
            continue
        # the same shards in another folder are the same data: their names say which
        if name in DATA_FILES:
            value = value.replace("\\", "/").rsplit("/", 1)[-1]
        config[name] = value
    return config


def config_differences(first: Run, second: Run, names=None) -> list[str]:
    """The fields in which two runs' configurations differ, as 'name a / b' (a field that only
    one log has, as with the public records' logs, is not known to differ)."""
    one = configuration(first)
    other = configuration(second)
    differences = []
    for name in one:
        if names is not None and name not in names:
            continue
        if name in other and one[name] != other[name]:
            differences.append(f"{name} {one[name] or repr('')} / {other[name] or repr('')}")
    return differences


def name_differences(differences: list[str], most: int = 3) -> str:
    """The first few differences, and how many more there are."""
    text = ", ".join(differences[:most])
    if len(differences) > most:
        text += f" and {len(differences) - most} more"
    return text


def check_one_configuration(runs: list[Run], labels: list[str], group: str) -> None:
    """Raise Refusal naming the first difference when the runs are not of one configuration."""
    for run, label in zip(runs[1:], labels[1:]):
        differences = config_differences(runs[0], run)
        if differences:
            raise Refusal(
                f"no t-test{group}: runs {labels[0]} and {label} differ in "
                f"{name_differences(differences)}, and runs of different configurations are not "
                "pooled: compare the logs of one configuration (name them, or their folder)"
            )


# ---------------------------------------------------------------------------- t-tests


def t_test_less(values: list[float], target: float = TARGET) -> tuple[float, float, float, float]:
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
        p = 0.0 if diff < 0 else 1.0
        return values[0], 0.0, t, p
    mean = math.fsum(values) / n
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    # here, not at the top: parsing logs (records/ab.py) needs no SciPy
    from scipy import stats

    result = stats.ttest_1samp(values, target, alternative="less")
    return mean, std, float(result.statistic), float(result.pvalue)


@dataclass
class Welch:
    """B against A: mean(B) - mean(A), its 95% confidence interval with Welch-Satterthwaite's
    degrees of freedom, and Welch's one-sided t-test that B is lower than A."""

    difference: float
    low: float
    high: float
    df: float
    t: float
    p: float


def welch_less(a: list[float], b: list[float]) -> Welch:
    """B against A, as SciPy's ttest_ind(b, a, equal_var=False, alternative="less").

    When both groups are each of equal values, the test is degenerate (no spread to judge by):
    the interval is the difference alone, t is -inf/+inf/nan and p is 0 if B is lower, else 1.
    """
    if len(a) < 2 or len(b) < 2:
        raise ValueError("a two-group t-test needs at least two values in each group")
    mean_a = math.fsum(a) / len(a)
    mean_b = math.fsum(b) / len(b)
    difference = mean_b - mean_a
    # each group's share of the variance of the difference: sample variance / count
    share_a = math.fsum((v - mean_a) ** 2 for v in a) / (len(a) - 1) / len(a)
    share_b = math.fsum((v - mean_b) ** 2 for v in b) / (len(b) - 1) / len(b)
    if len(set(a)) == 1 and len(set(b)) == 1:
        t = math.copysign(math.inf, difference) if difference else math.nan
        p = 0.0 if difference < 0 else 1.0
        return Welch(difference, difference, difference, math.nan, t, p)
    standard_error = math.sqrt(share_a + share_b)
    df = (share_a + share_b) ** 2 / (share_a**2 / (len(a) - 1) + share_b**2 / (len(b) - 1))
    from scipy import stats

    half_width = float(stats.t.ppf(0.975, df)) * standard_error
    result = stats.ttest_ind(b, a, equal_var=False, alternative="less")
    low = difference - half_width
    high = difference + half_width
    return Welch(difference, low, high, df, float(result.statistic), float(result.pvalue))


def format_p(p: float) -> str:
    """4 decimals from 0.0001 up, else 4 significant digits: '0.0123', '2.300e-08'."""
    return f"{p:.4f}" if p >= 1e-4 else f"{p:.3e}"


# --------------------------------------------------------------------------- output


def format_table(header: list[str], rows: list[list[str]], right: set[int]) -> str:
    """Align columns in two-space gaps; columns in `right` (the numbers) are right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells):
        aligned = []
        for i, (cell, width) in enumerate(zip(cells, widths)):
            aligned.append(cell.rjust(width) if i in right else cell.ljust(width))
        return "  ".join(aligned).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def _num(x: float, fmt: str) -> str:
    return "nan" if math.isnan(x) else format(x, fmt)


def runs_table(runs: list[Run], labels: list[str] | None = None) -> str:
    """One row per run, numbered 1, 2, ... or labelled (A1, B1, ...)."""
    if labels is None:
        labels = [str(i) for i in range(1, len(runs) + 1)]
    header = ["#", "file", "steps", "val loss", "train time (s)", "ms/step", "peak mem"]
    header += ["PyTorch", "devices"]
    rows = []
    for label, r in zip(labels, runs):
        rows.append(
            [
                label,
                str(r.path),
                f"{r.steps_done}/{r.planned}",
                _num(r.final_loss, ".4f"),
                _num(r.train_time_ms / 1000, ".1f"),
                _num(r.step_avg_ms, ".2f"),
                "?" if r.peak_mib is None else f"{r.peak_mib} MiB",
                r.torch_version,
                r.devices,
            ]
        )
    return format_table(header, rows, right={0, 2, 3, 4, 5, 6})


def shared_steps_table(runs: list[Run], labels: list[str] | None = None) -> str:
    """Val loss at the steps every run evaluated, one column per run (numbered as above)."""
    if labels is None:
        labels = [str(i) for i in range(1, len(runs) + 1)]
    shared = sorted(set.intersection(*(set(r.val_loss) for r in runs)))
    if not shared:
        return "(the runs share no validation steps)"
    header = ["step"] + [f"run {label}" for label in labels]
    rows = [[str(s)] + [_num(r.val_loss[s], ".4f") for r in runs] for s in shared]
    return format_table(header, rows, right=set(range(len(header))))


def summary_line(runs: list[Run], target: float) -> str:
    mean, std, t, p = t_test_less([r.final_loss for r in runs], target)
    return (
        f"n={len(runs)} mean={mean:.4f} std={std:.4f} t={t:.2f} p={format_p(p)} target={target:g}"
    )


def welch_line(title: str, a: list[float], b: list[float]) -> str:
    """'B against A <title>: B - A = ..., 95% CI ... to ... (Welch df=...), t=... p=...'."""
    if len(a) < 2 or len(b) < 2:
        difference = math.fsum(b) / len(b) - math.fsum(a) / len(a)
        return (
            f"B against A {title}: B - A = {difference:+.5f}; a test needs two or more "
            f"finished runs in each group (A has {len(a)}, B has {len(b)})"
        )
    result = welch_less(a, b)
    return (
        f"B against A {title}: B - A = {result.difference:+.5f}, 95% CI {result.low:+.5f} to "
        f"{result.high:+.5f} (Welch df={result.df:.2f}), t={result.t:.2f} "
        f"p={format_p(result.p)} that B is lower"
    )


def last_common_step(runs: list[Run]) -> int | None:
    """The last step after step 0 at which every run has a val loss (None: none)."""
    shared = set.intersection(*(set(r.val_loss) for r in runs)) - {0}
    return max(shared) if shared else None


def two_group_report(a: list[Run], b: list[Run], target: float) -> list[str]:
    """Each group's line against the target, then B against A at the end and, when the groups
    ran different step counts, at the last validation step both ran."""
    lines = []
    for name, runs in (("A", a), ("B", b)):
        if len(runs) < 2:
            lines.append(f"{name}: n=1 (the t-test needs two or more finished runs)")
        else:
            lines.append(f"{name}: {summary_line(runs, target)}")
    differences = config_differences(a[0], b[0])
    if a[0].source_digest != b[0].source_digest:
        differences.append("the trainer's source")
    if differences:
        lines.append(f"A and B differ in: {name_differences(differences, most=10)}")
    final_a = [r.final_loss for r in a]
    final_b = [r.final_loss for r in b]
    equal_within = len(set(final_a)) == 1 and len(set(final_b)) == 1
    if min(len(a), len(b)) > 1 and equal_within:
        lines.append(
            "note: each group's final val losses are all equal, so the test is degenerate: "
            "p is 0 if B is lower, else 1"
        )
    steps_a = a[0].planned
    steps_b = b[0].planned
    if steps_a == steps_b:
        title = f"at step {steps_a}"
    else:
        title = f"at the end (step {steps_a} for A, {steps_b} for B)"
    lines.append(welch_line(title, final_a, final_b))
    if steps_a != steps_b:
        step = last_common_step(a + b)
        if step is None:
            lines.append("B against A: the groups share no validation step after step 0")
        else:
            title = f"at step {step}, the last validation step both ran"
            losses_a = [r.val_loss[step] for r in a]
            losses_b = [r.val_loss[step] for r in b]
            lines.append(welch_line(title, losses_a, losses_b))
    return lines


def check_same_val_data(a: list[Run], b: list[Run]) -> None:
    """Val losses measured on different data do not compare: refuse."""
    differences = config_differences(a[0], b[0], names=VAL_DATA)
    if differences:
        raise Refusal(
            f"no test of B against A: they are validated on different data "
            f"({', '.join(differences)}), so their val losses do not compare; compare runs "
            "validated on the same val data"
        )


def plot_times(run: Run, times: dict[int, float]) -> tuple[list[int], list[float]]:
    """The steps to draw and their train time in seconds: lines of the untimed first steps at 0
    (a new run's train time starts after them), left out for a resumed run (its train time
    before them is in its checkpoint, not in the log)."""
    steps = []
    seconds = []
    for step in sorted(times):
        if step > run.untimed_through:
            seconds.append(times[step] / 1000)
        elif run.resumed_from is None:
            seconds.append(0.0)
        else:
            continue
        steps.append(step)
    return steps, seconds


def time_label(runs: list[Run]) -> str:
    """The x axis: train time, and what was done with the untimed first steps."""
    counts = sorted({r.untimed_through for r in runs if r.resumed_from is None})
    if len(counts) == 1 and counts[0] > 0:
        label = f"train time (s); the first {counts[0]} steps (compiling, warming up) are untimed"
    else:
        label = "train time (s); the first steps (compiling, warming up) are untimed"
    if counts:
        label += ", drawn at 0"
    if any(r.resumed_from is not None for r in runs):
        label += "; a resumed run's are left out"
    return label


def plot_runs(runs: list[Run], target: float, out: Path, pyplot, labels=None, fmt=None) -> None:
    """Val loss against train time, one line with markers per run, and the train loss of every
    step, where the log has it, as a thin line of the same colour; the target is dashed. With
    labels (A1, B1, ...), each group has its colour and line style; the file is written whole
    or not at all."""
    fig, ax = pyplot.subplots(figsize=(8, 5))
    groups = sorted({label[0] for label in labels}) if labels else []
    group_style = {"A": dict(color="C0", linestyle="-"), "B": dict(color="C3", linestyle="--")}
    for i, r in enumerate(runs, 1):
        style = {}
        name = f"run {i}"
        if labels:
            name = f"run {labels[i - 1]}"
            style = dict(group_style[labels[i - 1][0]])
        steps, seconds = plot_times(r, r.val_time_ms)
        (val_line,) = ax.plot(
            seconds,
            [r.val_loss[s] for s in steps],
            marker="o",
            markersize=3,
            label=f"{name}: {r.path.name} (val)",
            **style,
        )
        if r.train_loss:
            steps, seconds = plot_times(r, r.train_loss_time_ms)
            train_style = dict(style)
            train_style.setdefault("color", val_line.get_color())
            ax.plot(
                seconds,
                [r.train_loss[s] for s in steps],
                linewidth=0.7,
                alpha=0.5,
                label=f"{name}: train",
                **train_style,
            )
    ax.axhline(target, color="gray", linestyle=":", linewidth=1, label=f"target {target:g}")
    # Step 0's loss (ln 50304 = 10.83) would flatten everything else: zoom on the later evals,
    # and on the train losses after the first of them.
    first_eval = min((s for r in runs for s in r.val_loss if s > 0), default=0)
    later = [v for r in runs for s, v in r.val_loss.items() if s > 0 and math.isfinite(v)]
    for r in runs:
        later += [v for s, v in r.train_loss.items() if s >= first_eval and math.isfinite(v)]
    if later:
        low = min(later + [target])
        high = max(later)
        margin = 0.05 * (high - low) or 0.05
        ax.set_ylim(low - margin, high + margin)
    if groups:
        ax.set_title("loss against train time: A solid, B dashed")
    else:
        ax.set_title("loss against train time")
    ax.set_xlabel(time_label(runs))
    ax.set_ylabel("loss")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    # written aside, then renamed: a failed write leaves no partial file under the name
    temp = out.with_name(f".{out.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    try:
        fig.savefig(temp, dpi=120, format=fmt)
        os.replace(temp, out)
    finally:
        pyplot.close(fig)
        if temp.exists():
            temp.unlink()


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


def check_plot_path(out: Path, pyplot) -> str:
    """The format to save --plot in (its suffix), or raise Refusal before any work is done."""
    if out.exists() and not out.is_file():
        raise Refusal(f"--plot {out} is not a regular file; give a file name")
    suffix = out.suffix[1:].lower()
    supported = pyplot.figure().canvas.get_supported_filetypes()
    pyplot.close("all")
    if not suffix:
        raise Refusal(
            f"--plot {out} has no suffix, so its format is unknown: name the file with one "
            f"(e.g. {str(out).rstrip('.')}.png)"
        )
    if suffix not in supported:
        raise Refusal(
            f"--plot {out}: matplotlib cannot write .{suffix} files; use one of "
            f"{', '.join('.' + s for s in sorted(supported))}"
        )
    folder = out.parent
    if not folder.is_dir():
        raise Refusal(f"--plot {out}: there is no folder {folder}; create it or name another")
    probe = folder / f".{out.name}.{socket.gethostname()}.{os.getpid()}.tmp"
    try:
        probe.open("wb").close()
        probe.unlink()
        if out.exists() and not os.access(out, os.W_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as e:
        raise Refusal(f"--plot {out} cannot be written ({e.strerror or e}); name another") from None
    return suffix


def plot_error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def load_group(args: list[str]) -> tuple[list[Run], list[tuple[str, str]]]:
    """The finished runs of the logs named, and (name, reason) for what was left out."""
    paths, problems = collect_paths(args)
    runs = []
    for path in paths:
        try:
            runs.append(parse_log(path))
        except LogError as e:
            problems.append((str(path), str(e)))
    return runs, problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        usage="%(prog)s LOG_OR_DIR... [--vs LOG_OR_DIR...] [--target 3.28] [--plot FILE.png]",
        description="Compare speedrun logs and t-test their final val loss against a target, "
        "or group B (--vs) against group A.",
    )
    parser.add_argument(
        "logs",
        nargs="+",
        metavar="LOG_OR_DIR",
        help="log files, directories holding *.txt logs, or quoted globs (group A with --vs)",
    )
    parser.add_argument(
        "--vs",
        nargs="+",
        metavar="LOG_OR_DIR",
        help="group B: test whether its final val loss is lower than that of the logs before",
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
    if not math.isfinite(args.target):
        print(
            f"error: --target {args.target} is not a loss; give a number such as 3.28",
            file=sys.stderr,
        )
        return 2

    # --plot fails before any work, not after the tables
    pyplot = None
    plot_format = None
    if args.plot:
        pyplot = _import_pyplot()
        if pyplot is None:
            return plot_error(
                "--plot needs matplotlib, which is not installed "
                "(pip install matplotlib); run without --plot for the tables."
            )
        try:
            plot_format = check_plot_path(args.plot, pyplot)
        except Refusal as e:
            return plot_error(str(e))

    two_groups = args.vs is not None
    runs, problems = load_group(args.logs)
    runs_b = []
    if two_groups:
        runs_b, problems_b = load_group(args.vs)
        problems += problems_b
    for name, reason in problems:
        print(f"skipped {name}: {reason}", file=sys.stderr)
    if two_groups:
        in_a = {r.path.resolve(): r.path for r in runs}
        both = [r.path for r in runs_b if r.path.resolve() in in_a]
        if both:
            print(
                f"error: {both[0]} is in both groups; give each log to one group", file=sys.stderr
            )
            return 1
        for name, group in (("A", runs), ("B (--vs)", runs_b)):
            if not group:
                print(f"error: group {name} has no finished runs to compare", file=sys.stderr)
                return 1
    elif not runs:
        print("no finished runs to compare", file=sys.stderr)
        return 1

    if two_groups:
        labels = [f"A{i}" for i in range(1, len(runs) + 1)]
        labels += [f"B{i}" for i in range(1, len(runs_b) + 1)]
    else:
        labels = None
    every_run = runs + runs_b
    print(runs_table(every_run, labels))
    print()
    print(shared_steps_table(every_run, labels))
    print()
    if args.plot:
        try:
            plot_runs(every_run, args.target, args.plot, pyplot, labels, plot_format)
        except (OSError, ValueError, RuntimeError) as e:
            print(f"error: --plot {args.plot} could not be written: {e}", file=sys.stderr)
            return 1
        print(f"plot written to {args.plot}")
    try:
        if two_groups:
            check_one_configuration(runs, labels[: len(runs)], " in A")
            check_one_configuration(runs_b, labels[len(runs) :], " in B")
            check_same_val_data(runs, runs_b)
        else:
            check_one_configuration(runs, [str(i) for i in range(1, len(runs) + 1)], "")
    except Refusal as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if two_groups:
        for line in two_group_report(runs, runs_b, args.target):
            print(line)
        return 0
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
