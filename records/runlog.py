"""What the records tools share: how they read a path, the trainer's log, and a table of runs.

How a path is read, in every tool: it is checked before it is opened. A folder that cannot be
listed, a file that cannot be read, or a pipe or a device where a file is expected (opening one
could block, reading it might never end) is an `Unreadable` error naming it, never a path passed
over without a word.

The log (records/README.md): the trainer's source, a line of 100 '=', versions, devices and
nvidia-smi, `hyperparameters:` with one `  name = value` line per option, the shard lists, then the
step lines, exactly

    step:{step}/{N} val_loss:{loss:.4f} train_time:{ms:.0f}ms step_avg:{avg:.2f}ms
    step:{step}/{N} train_loss:{loss:.4f} train_time:{ms:.0f}ms step_avg:{avg:.2f}ms

among other lines (startup:, checkpoint:, resumed from ..., stopped by ...), and last
`peak memory consumption: N MiB`. The file is logs/<run id>.txt, the run id a uuid.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import math
import os
import re
import stat
import sys
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
# A resumed run's log names its checkpoint, by default <log_dir>/<run id>/state_step<N>.pt
RESUMED_LINE = re.compile(r"^resumed from (.*) at step (\d+)\b")
# The trainer's last line after a stop signal, or after a failure of its log
STOP_LINE = re.compile(r"^(?:stopped by \S+|error: .*: stopped) after step \d+")
# In the trainer's source at the top of the log: how many first steps it leaves untimed
UNTIMED_LINE = re.compile(r"^UNTIMED_STEPS = (\d+)\s*$")
# Options that change how a run runs or where it writes, not what it trains or how it is
# measured: runs that differ only in these are one configuration.
NOT_CONFIGURATION = frozenset(
    "log_dir seed resume save_checkpoint checkpoint_every hellaswag hellaswag_data tokenizer "
    "compile compile_tuning compile_cache regional_compile fused_head_loss fused_qkv "
    "head_chunk_rows max_device_batch_size profile".split()
)
RUN_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


class Unreadable(Exception):
    """A path that cannot be read as asked; the message names it and says why."""


class LogError(Exception):
    """A file that cannot be used as a finished run; the message says why."""


def read_file(path: Path) -> bytes:
    """The bytes of a regular file; Unreadable for anything else, a pipe or a device unopened."""
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISDIR(mode):
            raise Unreadable(f"{path} is a folder, not a file: give a file")
        if not stat.S_ISREG(mode):
            raise Unreadable(f"{path} is a pipe or a device, not a file: it is not read; give a "
                             "file, or leave it out")
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise Unreadable(cannot(path, "read", e)) from None


def cannot(path, what: str, error: OSError) -> str:
    """The line for a path that cannot be listed or read."""
    return f"{path} cannot be {what} ({error.strerror or error}): make it readable, or leave it out"


def keep_any_name_printable() -> None:
    """A path that is not valid in the console's encoding (a log named with a stray byte) prints
    with escapes instead of ending the tool in a UnicodeEncodeError."""
    for stream in (sys.stdout, sys.stderr):
        if getattr(stream, "errors", None) == "strict":
            stream.reconfigure(errors="backslashreplace")


def to_console(line: str) -> None:
    """Print a line on stdout. A console gone away (a closed pipe, a full disk) never ends the
    work going on: stdout writes to os.devnull from then on, and no later print fails. A closed
    pipe's reader took what it wanted; any other failure is told on stderr, once."""
    try:
        print(line, flush=True)
    except OSError as e:
        if not isinstance(e, BrokenPipeError):
            print(f"warning: stdout cannot be written ({e.strerror or e}): what follows is "
                  "dropped; the work goes on", file=sys.stderr, flush=True)
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


class Console:
    """Stdout, which remembers whether writing to it failed (a closed pipe, a full disk)."""

    def __init__(self, stream):
        self.stream = stream
        self.failed = False

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except OSError:
            self.failed = True
            raise

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError:
            self.failed = True
            raise

    def __getattr__(self, name):
        return getattr(self.stream, name)


def run_printing(main) -> int:
    """main()'s exit code, its output flushed. Stdout that went away is no traceback: a closed
    pipe (its reader, as `| head`, took what it wanted) ends quietly with 141, as SIGPIPE would;
    another failure to write (a full disk) is one error line."""
    keep_any_name_printable()
    console = sys.stdout = Console(sys.stdout)
    try:
        code = main()
        console.flush()
        return code
    except OSError as e:
        if not console.failed:
            raise
        # what is left of the output goes nowhere, rather than into a second error at exit
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), console.fileno())
        if isinstance(e, BrokenPipeError):
            return 141
        print(f"error: the output could not be written ({e.strerror or e}): write it elsewhere",
              file=sys.stderr)
        return 1
    finally:
        sys.stdout = console.stream


def files_below(folder: Path, suffix: str) -> tuple[list[Path], list[str]]:
    """Every file named *suffix in folder and the folders below it (links followed, each folder
    once), sorted; and for each folder that cannot be listed, a line naming it."""
    found = []
    unlisted = []
    seen = set()
    pending = [Path(folder)]
    while pending:
        current = pending.pop()
        try:
            info = os.stat(current)
            if (info.st_dev, info.st_ino) in seen:
                continue
            seen.add((info.st_dev, info.st_ino))
            with os.scandir(current) as listing:
                entries = list(listing)
        except OSError as e:
            unlisted.append(cannot(current, "listed", e))
            continue
        for entry in entries:
            if entry.is_dir():
                pending.append(Path(entry.path))
            elif entry.name.endswith(suffix):
                # anything else by that name (a pipe, a broken link) is read_file's to refuse
                found.append(Path(entry.path))
    return sorted(found), unlisted


def unlisted_on_the_way(pattern: str) -> list[str]:
    """A line for each folder that glob.glob(pattern) must list and cannot (glob passes over it)."""
    parts = Path(pattern).parts
    unlisted = []
    for i, part in enumerate(parts):
        if not glob.has_magic(part):
            continue
        prefix = os.path.join(*parts[:i]) if i else "."
        folders = glob.glob(prefix, recursive=True) if glob.has_magic(prefix) else [prefix]
        for folder in filter(os.path.isdir, folders):
            if part == "**":
                unlisted += files_below(Path(folder), "")[1]
                continue
            try:
                os.scandir(folder).close()
            except OSError as e:
                unlisted.append(cannot(folder, "listed", e))
    return list(dict.fromkeys(unlisted))


def log_files(args: list[str]) -> tuple[list[Path], list[str], list[str]]:
    """The files that files, folders (every *.txt below) and globs name, each once; a line for
    each argument that names nothing; and a line for each folder that cannot be listed."""
    paths = {}
    nothing = []
    unlisted = []
    for arg in args:
        matches = []
        if os.path.lexists(arg):
            matches = [Path(arg)]
        elif glob.has_magic(arg):
            matches = [Path(name) for name in sorted(glob.glob(arg, recursive=True))]
            unlisted += unlisted_on_the_way(arg)
            if not matches:
                nothing.append(f"skipped {arg}: no file or directory matches this pattern")
        else:
            nothing.append(f"skipped {arg}: no such file or directory")
        for match in matches:
            found = [match]
            if match.is_dir():
                found, unlistable = files_below(match, ".txt")
                unlisted += unlistable
                if not found and not unlistable:
                    nothing.append(f"skipped {match}: no *.txt logs in this directory")
            for path in found:
                # the same file named twice is read once
                paths.setdefault(path.resolve(), path)
    return list(paths.values()), nothing, unlisted


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
    # the run ids this log is a part of: its own (its file name) and, resumed, its checkpoint's
    run_ids: set[str] = field(default_factory=set)
    # what its step lines measured, (val or train, step, loss, train_time), step_avg left out:
    # a resumed run that only validates logs its run's last val line with another step_avg
    measured: set[tuple] = field(default_factory=set)

    def same_run(self, other: Run) -> bool:
        """Whether the two logs are of one run: they share a run id or, unless both are new runs
        with ids of their own, they have one configuration and the step lines of one are all in
        the other's (a renamed copy; a resumed run that only validated its last checkpoint)."""
        if self.run_ids & other.run_ids:
            # two resumed from one checkpoint with another configuration (--muon_lr): two runs
            return self.configuration() == other.configuration()
        new_runs = self.resumed_from is None and other.resumed_from is None
        if new_runs and self.run_ids and other.run_ids:
            return False
        if (self.devices, self.made_as()) != (other.devices, other.made_as()):
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
        if run.path.resolve() == twin.path.resolve():
            how = "the same file"
        elif run.resumed_from is not None:
            how = f"resumed from its checkpoint at step {run.resumed_from}"
        twins.append((run, twin, how))
        twin.run_ids |= run.run_ids
        twin.measured |= run.measured
    return twins


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
    """Parse one log into a finished Run; LogError says why it cannot be used, Unreadable why it
    cannot be read."""
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
    if RUN_ID.fullmatch(path.stem):
        run.run_ids.add(path.stem)
    _parse_header(body[:first_step], run)
    for line in body:
        if m := RESUMED_LINE.match(line):
            run.resumed_from = int(m.group(2))
            checkpoint_folder = Path(m.group(1)).parent.name
            if RUN_ID.fullmatch(checkpoint_folder):
                run.run_ids.add(checkpoint_folder)

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
        run.measured.add((val is not None, step, m.group(3), m.group(4)))
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
