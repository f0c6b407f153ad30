"""What the records tools share: the trainer's log as they read it, and a table of runs.

A pipe or a device where a log is expected is never opened: it could block, or never end.

The log (records/README.md): the trainer's source, a line of 100 '=', versions, devices and
nvidia-smi, `hyperparameters:` with one `  name = value` line per option, the shard lists, then the
step lines, exactly

    step:{step}/{N} val_loss:{loss:.4f} train_time:{ms:.0f}ms step_avg:{avg:.2f}ms
    step:{step}/{N} train_loss:{loss:.4f} train_time:{ms:.0f}ms step_avg:{avg:.2f}ms

among other lines (startup:, checkpoint:, resumed from ..., stopped by ...), and last
`peak memory consumption: N MiB`.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path

SEPARATOR = "=" * 100

# Loss and step_avg are matched loosely (\S+): a diverged run prints "nan", and the first ten
# steps print "step_avg:nanms". The train loss is in this trainer's logs and in the public
# records' earliest ones; record 18 left it out.
VAL_LINE = re.compile(r"^step:(\d+)/(\d+) val_loss:(\S+) train_time:(\d+)ms step_avg:(\S+)ms$")
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
# One option of the configuration section, "  name = value" (an empty value loses its blank)
OPTION_LINE = re.compile(r"^  (\w+) =(?: (.*))?$")
# A resumed run's log says where it started; its first step after that is not timed either
RESUMED_LINE = re.compile(r"^resumed from .* at step (\d+)\b")
# The trainer's last line after a stop signal, or after a failure of its log
STOP_LINE = re.compile(r"^(?:stopped by \S+|error: .*: stopped) after step \d+")
# In the trainer's source at the top of the log: how many first steps it leaves untimed
UNTIMED_LINE = re.compile(r"^UNTIMED_STEPS = (\d+)\s*$")


class LogError(Exception):
    """A file that cannot be used as a finished run; the message says why."""


def read_file(path: Path) -> bytes:
    """The bytes of a regular file; LogError for anything else, a pipe or a device unopened."""
    if path.exists() and not path.is_file():
        raise LogError("not a regular file")
    try:
        return path.read_bytes()
    except OSError as e:
        raise LogError(f"cannot read: {e.strerror or e}") from None


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


def _float(text: str, line: str) -> float:
    """A logged number; "nan" and "inf" are numbers too, anything else makes the log odd."""
    try:
        return float(text)
    except ValueError:
        raise LogError(f"odd step line {line[:60]!r}") from None


def _read_lines(path: Path) -> list[str]:
    data = read_file(path)
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
    for line in body:
        if m := RESUMED_LINE.match(line):
            run.resumed_from = int(m.group(1))

    # steps whose lines say "step_avg:nanms" from the first step line on: not timed yet
    nan_average_through = -1
    timed_seen = False
    line_times = []
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


def format_table(header: list[str], rows: list[list[str]], right: set[int]) -> str:
    """Align columns in two-space gaps; columns in `right` (the numbers) are right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells):
        aligned = []
        for i, (cell, width) in enumerate(zip(cells, widths)):
            aligned.append(cell.rjust(width) if i in right else cell.ljust(width))
        return "  ".join(aligned).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])
