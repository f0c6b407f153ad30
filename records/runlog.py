"""What the records tools share: which files the paths given name, the trainer's log (its format is
in records/README.md: the source, a line of 100 '=', versions, devices, nvidia-smi's table, the
options, the step lines and the peak memory; logs/<run id>.txt, the run id a uuid), and a table.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import math
import os
import re
import stat
import time
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path

SEPARATOR = "=" * 100

# Loss and step_avg are matched loosely (\S+): a diverged run prints "nan", and the first ten
# steps print "step_avg:nanms". The train loss is in this trainer's logs and in the public
# records' earliest ones; record 18 left it out.
VAL_LINE = re.compile(r"^step:(\d+)/(\d+) val_loss:(\S+) train_time:(\d+)ms step_avg:(\S+)ms$")
TRAIN_LINE = re.compile(r"^step:(\d+)/(\d+) (?:train_loss:(\S+) )?train_time:(\d+)ms step_avg:(\S+)ms$")
PEAK_LINE = re.compile(r"^peak memory consumption: (\d+) MiB$")
# When compiling, ", <s>s of it compiling (...)" and more follow; only the first figure is read.
STARTUP_LINE = re.compile(r"^startup: (\d+(?:\.\d*)?)s from launch to the end of step 1\b")
TORCH_LINE = re.compile(r"^Running PyTorch (\S+)", re.IGNORECASE)
DEVICES_LINE = re.compile(r"^devices: (\d+) x (.+)$")
# A GPU row of nvidia-smi's table, "|   0  NVIDIA H100 80GB HBM3          On  |   00000000:19:00.0":
# the public records' logs have no "devices:" line, so this is where their GPUs are named
SMI_GPU_ROW = re.compile(r"^\|\s+(\d+)\s+(\S.*?)\s+(?:On|Off|N/A)\s+\|")
# The date nvidia-smi prints above its table, when the run started: "Wed Dec 11 10:36:50 2024"
SMI_DATE = re.compile(r"^[A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \d{4}$")
# One option of the configuration section, "  name = value" (an empty value loses its blank)
OPTION_LINE = re.compile(r"^  (\w+) =(?: (.*))?$")
RUN_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
# A resumed run's log names its checkpoint and the run that wrote it; an older trainer's names
# only the checkpoint, by default <log_dir>/<run id>/state_step<N>.pt
RESUMED_LINE = re.compile(rf"^resumed from (.*) at step (\d+)(?: of run ({RUN_ID.pattern}))?(?:[,;]|$)")
# The trainer's last line after a stop signal, or after a failure of its log
STOP_LINE = re.compile(r"^(?:stopped by \S+|error: .*: stopped) after step \d+")
# In the trainer's source at the top of the log: how many first steps it leaves untimed
UNTIMED_LINE = re.compile(r"^UNTIMED_STEPS = (\d+)\s*$")
# Options that change how a run runs or where it writes, not what it trains or how it is
# measured: runs that differ only in these are one configuration.
NOT_CONFIGURATION = frozenset(
    "log_dir seed resume save_checkpoint checkpoint_every hellaswag hellaswag_data tokenizer "
    "compile compile_tuning compile_cache regional_compile fused_head_loss fused_qkv "
    "head_chunk_rows max_device_batch_size profile accept_other_script".split()
)


class Unreadable(Exception):
    """A file that cannot be read; the message names it and says why."""


class LogError(Exception):
    """A file that cannot be used as a finished run; the message says why."""


def read_file(path: Path) -> bytes:
    """The bytes of a file; Unreadable, in one line, for a pipe or a device (left unopened: opening
    one could wait forever), a symlink loop, or a file that cannot be read."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise Unreadable(f"{path} is not a file (a folder, a pipe or a device): it is not "
                             "read; give a file, or leave it out")
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise Unreadable(f"{path} cannot be read ({e.strerror or e}): make it readable, or leave "
                         "it out") from None


def raise_error(error: OSError) -> None:
    """A folder that cannot be listed is never passed over in silence (os.walk's onerror)."""
    raise error


def files_below(folder: Path, suffix: str) -> list[Path]:
    """Every file named *suffix in folder and the folders below it, links followed, each folder
    once (a link back up is not followed round again), sorted."""
    found = []
    seen = set()
    for top, folders, names in os.walk(folder, followlinks=True, onerror=raise_error):
        info = os.stat(top)
        if (info.st_dev, info.st_ino) in seen:
            folders.clear()
            continue
        seen.add((info.st_dev, info.st_ino))
        # anything else by that name (a pipe, a link to nowhere, a loop) is read_file's to refuse
        found += [Path(top, name) for name in names if name.endswith(suffix)]
    return sorted(found)


def log_files(args: list[str]) -> tuple[list[Path], list[str]]:
    """The files that files, folders (every *.txt below) and globs name, each once; and a line
    for each argument that names nothing."""
    paths = {}
    nothing = []
    for arg in args:
        matches = [Path(arg)] if os.path.lexists(arg) else []
        if not matches and glob.has_magic(arg):
            matches = [Path(name) for name in sorted(glob.glob(arg, recursive=True))]
            if not matches:
                nothing.append(f"skipped {arg}: no file or directory matches this pattern")
        elif not matches:
            nothing.append(f"skipped {arg}: no such file or directory")
        for match in matches:
            found = files_below(match, ".txt") if match.is_dir() else [match]
            if match.is_dir() and not found:
                nothing.append(f"skipped {match}: no *.txt logs in this directory")
            for path in found:
                # the same file named twice is read once (realpath, unlike resolve, takes loops)
                paths.setdefault(os.path.realpath(path), path)
    return list(paths.values()), nothing


@dataclass
class Run:
    """A finished run as its log tells it. val_loss and train_loss (where the log has it) map a step
    to its loss, val_time_ms and train_loss_time_ms to its train_time; the final loss, train time
    and ms/step are the last val line's."""
    path: Path
    # N of "step:k/N", and the last step seen
    planned: int
    steps_done: int
    val_loss: dict[int, float] = field(default_factory=dict)
    val_time_ms: dict[int, float] = field(default_factory=dict)
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
    # name -> value as logged; empty: not known (the public records' logs, a log cut down)
    options: dict[str, str] = field(default_factory=dict)
    # the lines of steps up to this one carry no train time (compiling, warming up)
    untimed_through: int = 0
    # the step a resumed run started from (None: a new run)
    resumed_from: int | None = None
    # a digest of the trainer's source at the top of the log
    source_digest: str = ""
    # the run ids this log is a part of: its own (its file name) and, resumed, its checkpoint's run
    run_ids: set[str] = field(default_factory=set)
    # what its step lines measured, (val or train, step, loss, train_time), step_avg left out:
    # a resumed run that only validates logs its run's last val line with another step_avg
    measured: set[tuple] = field(default_factory=set)
    # seconds since the epoch: the date nvidia-smi printed as it started, else its log's mtime
    started: float = 0.0

    def same_run(self, other: Run) -> bool:
        """Whether the two logs are of one run: they share a run id or, unless both are new runs
        with ids of their own, the step lines of one are all in the other's (a renamed copy, a
        copy cut down, a resumed run that only validated) and nothing known of them differs."""
        known = bool(self.options and other.options)
        if self.run_ids & other.run_ids:
            # two resumed from one checkpoint with another configuration (--muon_lr): two runs
            return not known or self.configuration() == other.configuration()
        new_runs = self.resumed_from is None and other.resumed_from is None
        if new_runs and self.run_ids and other.run_ids:
            return False
        if known and self.made_as() != other.made_as():
            return False
        if "?" not in (self.devices, other.devices) and self.devices != other.devices:
            return False
        return self.measured <= other.measured or other.measured <= self.measured

    def made_as(self) -> dict[str, str]:
        """Its options but where it wrote and what it resumed, which differ from run to run."""
        return {k: v for k, v in self.options.items() if k not in ("log_dir", "resume")}

    def configuration(self) -> dict[str, str]:
        """Its options of what it trains and how it is measured."""
        return {k: v for k, v in self.options.items() if k not in NOT_CONFIGURATION}


def count_once(runs: list[Run]) -> list[tuple[Run, Run, str]]:
    """(log, the log kept for its run, how it is the same run) for each log of a run already
    counted: a new run's log is kept before a resumed one's. What a left-out log knows of its run
    (ids, step lines) joins the kept log's, so that a chain of resumed runs is one run."""
    kept = []
    twins = []
    for run in sorted(runs, key=lambda r: -1 if r.resumed_from is None else r.resumed_from):
        twin = next((k for k in kept if k.same_run(run)), None)
        if twin is None:
            kept.append(run)
            continue
        how = "a copy"
        if os.path.realpath(run.path) == os.path.realpath(twin.path):
            how = "the same file"
        elif run.resumed_from is not None:
            how = f"resumed from its checkpoint at step {run.resumed_from}"
        twins.append((run, twin, how))
        twin.run_ids |= run.run_ids
        twin.measured |= run.measured
    return twins


def _parse_header(lines: list[str], run: Run) -> None:
    """Version, devices, options, start date and what it resumed: the lines before the steps."""
    gpus = {}
    in_options = False
    for line in lines:
        option = OPTION_LINE.match(line) if in_options else None
        if option:
            run.options[option.group(1)] = option.group(2) or ""
            continue
        in_options = line == "hyperparameters:"
        if m := TORCH_LINE.match(line):
            run.torch_version = m.group(1)
        elif m := DEVICES_LINE.match(line):
            run.devices = f"{int(m.group(1))} x {m.group(2).strip()}"
        elif m := SMI_GPU_ROW.match(line):
            # a table printed twice must not count twice
            gpus.setdefault(m.group(1), m.group(2))
        elif SMI_DATE.match(line) and not run.started:
            # a line of that shape that is no date is no start
            with contextlib.suppress(ValueError):
                run.started = time.mktime(time.strptime(line, "%a %b %d %H:%M:%S %Y"))
        elif m := RESUMED_LINE.match(line):
            run.resumed_from = int(m.group(2))
            # the run that wrote the checkpoint, or where an older trainer kept it
            written_by = m.group(3) or Path(m.group(1)).parent.name
            if RUN_ID.fullmatch(written_by):
                run.run_ids.add(written_by)
    # The trainer's "devices:" line counts the processes actually used, so it wins over
    # nvidia-smi, which lists every GPU in the machine.
    if run.devices == "?" and gpus:
        run.devices = f"{len(gpus)} x {' / '.join(sorted(set(gpus.values())))}"


def parse_log(path: str | Path) -> Run:
    """Parse one log into a finished Run; LogError says why it cannot be used, Unreadable why it
    cannot be read."""
    path = Path(path)
    data = read_file(path)
    if b"\0" in data:
        raise LogError("not a log (binary file)")
    # A log is text; replacement characters keep a stray byte from becoming a traceback.
    # Trailing blanks (or a CR from a copied file) must not hide a step line.
    lines = [line.rstrip() for line in data.decode("utf-8", errors="replace").splitlines()]
    # The log begins with the trainer's source, whose f-strings look like step lines;
    # everything before the first line of exactly 100 '=' is source and is ignored.
    if SEPARATOR not in lines:
        raise LogError("not a log (no line of 100 '=' after the source)")
    source = lines[: lines.index(SEPARATOR)]
    body = lines[len(source) + 1 :]
    first_step = next((i for i, line in enumerate(body) if line.startswith("step:")), len(body))
    run = Run(path=path, planned=0, steps_done=-1)
    run.source_digest = hashlib.sha256("\n".join(source).encode()).hexdigest()
    if RUN_ID.fullmatch(path.stem):
        run.run_ids.add(path.stem)
    _parse_header(body[:first_step], run)
    run.started = run.started or os.stat(path).st_mtime
    # steps whose lines say "step_avg:nanms" from the first step line on: not timed yet
    nan_average_through = -1
    timed_seen = False
    for line in body[first_step:]:
        if m := PEAK_LINE.match(line):
            run.peak_mib = int(m.group(1))
        elif m := STARTUP_LINE.match(line):
            run.startup_s = float(m.group(1))
        # blank lines, or anything a later trainer adds, are passed over
        elif m := VAL_LINE.match(line) or TRAIN_LINE.match(line):
            _step_line(run, line, m)
            timed_seen = timed_seen or not math.isnan(run.step_avg_ms)
            if not timed_seen:
                nan_average_through = run.steps_done
    _check_finished(run, body)
    run.final_loss = run.val_loss[run.planned]
    run.train_time_ms = run.val_time_ms[run.planned]
    # the trainer's first UNTIMED_STEPS steps, and a resumed run's first step (the public
    # records' logs do not say: "step_avg:nanms" tells instead)
    counts = (max(int(m.group(1)), 1) for line in source if (m := UNTIMED_LINE.match(line)))
    untimed = next(counts, -1)
    if run.resumed_from is not None:
        untimed = max(untimed, run.resumed_from + 1)
    run.untimed_through = max(untimed, nan_average_through)
    # train time never goes back after timing starts, on the val lines nor on the train lines
    for kind in (True, False):
        timed = sorted((s, int(ms)) for val, s, _, ms in run.measured
                       if val == kind and s > run.untimed_through)
        for (step, ms), (next_step, next_ms) in zip(timed, timed[1:]):
            if next_ms < ms:
                raise LogError(f"not one run (train_time goes back from {ms}ms at step {step} "
                               f"to {next_ms}ms at step {next_step})")
    return run


def _step_line(run: Run, line: str, m: re.Match) -> None:
    """Read a val or train line into run; step_avg_ms is the line's (the last line's at the end)."""
    step, planned, loss, ms = int(m.group(1)), int(m.group(2)), m.group(3), float(m.group(4))
    if run.planned and planned != run.planned:
        raise LogError(f"not one run (steps planned as {run.planned} and {planned})")
    if step < run.steps_done:
        raise LogError(f"not one run (step lines go back from step {run.steps_done} to {step})")
    if step > planned:
        raise LogError(f"odd step line {line[:60]!r} (a step past the {planned} planned)")
    run.planned, run.steps_done = planned, step
    run.measured.add((m.re is VAL_LINE, step, loss, m.group(4)))
    # "nan" and "inf" are numbers too: anything else makes the log odd
    try:
        run.step_avg_ms = float(m.group(5))
        loss = None if loss is None else float(loss)
    except ValueError:
        raise LogError(f"odd step line {line[:60]!r}") from None
    if m.re is VAL_LINE:
        run.val_loss[step], run.val_time_ms[step] = loss, ms
    elif loss is not None:
        run.train_loss[step], run.train_loss_time_ms[step] = loss, ms


def _check_finished(run: Run, body: list[str]) -> None:
    """A run is finished when it has the val loss line of its last planned step, and it never
    diverged on the way."""
    if run.planned == 0:
        raise LogError("not a log (no step lines)")
    for step, loss in sorted(run.val_loss.items()):
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
        cells = enumerate(zip(cells, widths))
        aligned = (cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in cells)
        return "  ".join(aligned).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])
