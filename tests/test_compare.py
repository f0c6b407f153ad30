"""Tests for records/compare.py and the log reader it shares with ab.py (records/runlog.py): log
parsing, which runs count, the t-tests against SciPy computed here, the report and the plot.

    python -m pytest tests/test_compare.py -q
"""

import builtins
import contextlib
import errno
import io
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
from helpers import LN_VOCAB
from helpers import REPO
from helpers import launch_env
from helpers import load_records_script
from helpers import run_process
from helpers import started
from helpers import tiny

SCRIPT = REPO / "records" / "compare.py"

compare = load_records_script("compare")
# the module compare.py imported (a second copy would have other exception classes)
runlog = compare.runlog

SUMMARY = re.compile(
    r"^n=(\d+) mean=(\d+\.\d{4}) std=(\d+\.\d{4}) t=(-?\d+\.\d{2}) "
    r"p=(\d\.\d{4}|\d\.\d{3}e[-+]\d\d) target=(\S+)$"
)

# A stand-in for the trainer's source at the top of every log. Its f-strings and the
# docstring's example line look like step lines and must not be read as steps.
FAKE_SOURCE = '''\
"""Example output:
step:99/99 val_loss:0.1234 train_time:5ms step_avg:5.00ms
"""
def log(step, N, val_loss, ms, avg):
    print0(f"step:{step}/{N} val_loss:{val_loss:.4f} train_time:{ms:.0f}ms step_avg:{avg:.2f}ms")
    print0("=" * 100)
'''

SMI_TABLE = """\
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 550.54.15              Driver Version: 550.54.15      CUDA Version: 12.4     |
|-----------------------------------------+------------------------+----------------------+
| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |
|=========================================+========================+======================|
{rows}
+-----------------------------------------------------------------------------------------+
| Processes:                                                                              |
|    0   N/A  N/A     12345      C   /usr/bin/python3                            1234MiB |
+-----------------------------------------------------------------------------------------+"""

SMI_ROW = (
    "|   {i}  NVIDIA H100 80GB HBM3          On  |   00000000:{i:02d}:00.0 Off |"
    "                    0 |"
)


def make_log(
    path,
    val,
    planned,
    *,
    ms_per_step=100.0,
    finished=True,
    public=False,
    gpus=8,
    peak=31563,
    torch_version="2.11.0+cu128",
    startup=None,
    train_loss=None,
    options=None,
    launch_ms=None,
    last_line=None,
):
    """Write a log in the trainer's format (records/README.md) and return its path.

    `val` maps step -> val loss; train lines are written for every step in between.
    `public=True` writes the public record logs' header: no "devices:" line and no
    hyperparameters, the GPUs only in nvidia-smi's table. `finished=False` stops after the
    last val step given, as a killed run would. `train_loss`, a function of the step, adds the
    field `train_loss:` to the train lines, as this trainer and the earliest public records write.
    `options` adds configuration lines; `launch_ms` gives the untimed first steps the trainer's
    time since launch (compilation included) instead of 0; `last_line` ends the log.
    """
    sep = "=" * 100
    lines = [FAKE_SOURCE.rstrip("\n"), sep, "Running Python 3.11.7 (main) [GCC 12.2.0]"]
    lines.append(f"Running PyTorch {torch_version} compiled for CUDA 12.8")
    if not public:
        lines.append(f"devices: {gpus} x NVIDIA H100 80GB HBM3")
    lines.append(SMI_TABLE.format(rows="\n".join(SMI_ROW.format(i=i) for i in range(gpus))))
    lines.append(sep)
    if not public:
        lines += [
            "hyperparameters:",
            f"  num_iterations = {planned}",
            "  val_loss_every = 125",
        ]
        lines += [f"  {name} = {value}" for name, value in (options or {}).items()]
        lines += [
            "train shards (1): data/fineweb10B/fineweb_train_000001.bin",
            "val shards (1): data/fineweb10B/fineweb_val_000000.bin",
            sep,
        ]

    def times(step):
        # timing restarts at step 10
        timed = max(step - 10, 0)
        ms = timed * ms_per_step
        if launch_ms is not None and 0 < step <= 10:
            ms = launch_ms + step * ms_per_step
        avg = f"{ms / timed:.2f}" if timed else "nan"
        return f"train_time:{ms:.0f}ms step_avg:{avg}ms"

    last = max(val)
    for step in range(last + 1):
        if step in val:
            lines.append(f"step:{step}/{planned} val_loss:{val[step]:.4f} {times(step)}")
        if step < last:
            loss = "" if train_loss is None else f"train_loss:{train_loss(step + 1):.4f} "
            lines.append(f"step:{step + 1}/{planned} {loss}{times(step + 1)}")
        if step == 0 and startup is not None:
            lines.append(f"startup: {startup}")
    if finished and last == planned and peak is not None:
        lines.append(f"peak memory consumption: {peak} MiB")
    if last_line is not None:
        lines.append(last_line)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def curve(final, planned=40, every=10):
    """Val losses at 0, every, 2*every, ..., planned ending at `final`."""
    steps = list(range(0, planned, every)) + [planned]
    return {s: (10.8258 if s == 0 else final + 1.0 * (planned - s) / planned) for s in steps}


def run_main(capsys, *argv):
    code = compare.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------------------ parsing


def test_parse_trainer_log_reads_steps_and_header(tmp_path):
    log = make_log(tmp_path / "a.txt", curve(3.2785, planned=40), 40, ms_per_step=148.12)
    run = compare.parse_log(log)
    assert (run.planned, run.steps_done) == (40, 40)
    assert run.final_loss == pytest.approx(3.2785)
    # not step 99 from the source
    assert sorted(run.val_loss) == [0, 10, 20, 30, 40]
    assert run.train_time_ms == pytest.approx(round(30 * 148.12))
    assert run.step_avg_ms == pytest.approx(148.12, abs=0.01)
    assert run.peak_mib == 31563
    assert run.torch_version == "2.11.0+cu128"
    assert run.devices == "8 x NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize(
    "startup,seconds",
    [
        # public record logs have no startup line
        (None, None),
        ("4.2s from launch to the end of step 1", 4.2),
        (
            "131.7s from launch to the end of step 1, 118.0s of it compiling "
            "(cache hits/misses: FX graph 0/12, AOT 0/3); compile cache saved",
            131.7,
        ),
    ],
)
def test_startup_seconds(tmp_path, startup, seconds):
    run = compare.parse_log(make_log(tmp_path / "a.txt", curve(3.3), 40, startup=startup))
    assert run.startup_s == seconds
    # the line is not a step line
    assert sorted(run.val_loss) == [0, 10, 20, 30, 40]


def test_devices_line_wins_over_nvidia_smi(tmp_path):
    # A 2-process run on an 8-GPU machine: nvidia-smi lists 8 GPUs, the trainer says 2.
    log = make_log(tmp_path / "a.txt", curve(3.3), 40, gpus=8)
    text = log.read_text().replace("devices: 8 x", "devices: 2 x")
    log.write_text(text)
    assert compare.parse_log(log).devices == "2 x NVIDIA H100 80GB HBM3"


def test_parse_public_log_takes_gpus_from_nvidia_smi(tmp_path):
    log = make_log(tmp_path / "pub.txt", curve(3.279), 40, public=True, gpus=8)
    run = compare.parse_log(log)
    assert run.devices == "8 x NVIDIA H100 80GB HBM3"
    assert run.final_loss == pytest.approx(3.279)


@pytest.mark.parametrize("public", [False, True])
def test_train_loss_is_read_where_the_log_has_it(tmp_path, public):
    def loss(step):
        return 10.8258 / step

    with_loss = make_log(tmp_path / "a.txt", curve(3.3), 40, public=public, train_loss=loss)
    without = compare.parse_log(make_log(tmp_path / "b.txt", curve(3.3), 40, public=public))
    run = compare.parse_log(with_loss)
    assert run.train_loss == {step: round(loss(step), 4) for step in range(1, 41)}
    assert run.train_loss_time_ms[40] == run.val_time_ms[40] == 30 * 100
    assert without.train_loss == {}
    # the rest reads as before
    read_before = ["planned", "steps_done", "val_loss", "final_loss", "train_time_ms"]
    for name in [*read_before, "step_avg_ms", "peak_mib", "devices"]:
        assert getattr(run, name) == getattr(without, name)


def test_finished_without_peak_memory_line_is_still_finished(tmp_path):
    run = compare.parse_log(make_log(tmp_path / "a.txt", curve(3.3), 40, peak=None))
    assert run.peak_mib is None and run.final_loss == pytest.approx(3.3)


def test_crlf_line_endings_are_read(tmp_path):
    log = make_log(tmp_path / "a.txt", curve(3.3), 40)
    log.write_bytes(log.read_bytes().replace(b"\n", b"\r\n"))
    assert compare.parse_log(log).final_loss == pytest.approx(3.3)


def test_two_runs_in_one_file_are_refused(tmp_path):
    a = make_log(tmp_path / "a.txt", curve(3.3, planned=40), 40).read_text()
    b = make_log(tmp_path / "b.txt", curve(3.3, planned=50), 50).read_text()
    both = tmp_path / "both.txt"
    both.write_text(a + b.split("=" * 100 + "\n")[-1])
    with pytest.raises(runlog.LogError, match="not one run"):
        compare.parse_log(both)


def test_unusable_logs_raise_with_a_reason(tmp_path):
    unfinished = make_log(tmp_path / "unfinished.txt", {0: 10.8, 10: 5.0, 20: 4.0}, 40)
    truncated = make_log(tmp_path / "truncated.txt", curve(3.3), 40, peak=None)
    text = truncated.read_text()
    # cut inside the last line
    truncated.write_text(text[: text.rindex("val_loss:") + 12])
    source_only = tmp_path / "source.txt"
    source_only.write_text(FAKE_SOURCE)
    no_steps = tmp_path / "nosteps.txt"
    no_steps.write_text(FAKE_SOURCE + "=" * 100 + "\nRunning Python 3.11\n")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(bytes(range(256)))
    empty = tmp_path / "empty.txt"
    empty.write_text("")

    expected = {
        unfinished: "unfinished (stopped at step 20 of 40)",
        truncated: "truncated",
        source_only: "not a log",
        no_steps: "no step lines",
        binary: "binary",
        empty: "not a log",
    }
    for path, reason in expected.items():
        with pytest.raises(runlog.LogError, match=re.escape(reason)):
            compare.parse_log(path)


# ----------------------------------------------------------------------------- t-test


@pytest.mark.parametrize(
    "values,target",
    [
        ([3.2785, 3.2791, 3.2779, 3.2801, 3.2788], 3.28),
        # mean above the target: p > 0.5
        ([3.281, 3.279, 3.2805, 3.2795], 3.28),
        # df = 1
        ([3.30, 3.25], 3.28),
        # p far below 1e-4
        ([3.2700, 3.2710, 3.2705, 3.2702, 3.2708, 3.2701], 3.28),
        ([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0], 7.0),
        # record-sized sample
        ([3.28 + 0.002 * math.sin(i) for i in range(80)], 3.2801),
    ],
)
def test_t_test_matches_scipy(values, target):
    # imported where used, here and below: SciPy's statistics are a second of every collection
    from scipy import stats
    mean, std, t, p = compare.t_test_less(values, target)
    ref = stats.ttest_1samp(values, target, alternative="less")
    assert mean == pytest.approx(sum(values) / len(values), rel=1e-12)
    assert std == pytest.approx(stats.tstd(values), rel=1e-10)
    assert t == pytest.approx(ref.statistic, rel=1e-9)
    assert p == pytest.approx(ref.pvalue, rel=1e-8, abs=1e-300)


def pair_with_t(t, target=3.28):
    """Two values with statistic t against `target`: for n = 2, t = (mean - target) / half gap."""
    half_gap = 0.001
    centre = target + t * half_gap
    return [centre - half_gap, centre + half_gap]


def triple_with_t(t, target=3.28):
    """Three values with statistic t: c-h, c, c+h have std h, so t = (c - target) sqrt(3) / h."""
    h = 0.001
    centre = target + t * h / math.sqrt(3)
    return [centre - h, centre, centre + h]


@pytest.mark.parametrize("t", [-30.0, -3.0, -1.0, -0.2, 0.0, 0.5, 2.0, 12.0])
def test_t_test_closed_forms_for_one_and_two_degrees_of_freedom(t):
    # n=2 gives df=1, the Cauchy distribution; n=3 gives df=2, whose CDF is algebraic.
    _, _, t1, p1 = compare.t_test_less(pair_with_t(t))
    assert t1 == pytest.approx(t, abs=1e-6)
    assert p1 == pytest.approx(0.5 + math.atan(t1) / math.pi, rel=1e-12, abs=1e-15)
    _, _, t2, p2 = compare.t_test_less(triple_with_t(t))
    assert t2 == pytest.approx(t, abs=1e-6)
    assert p2 == pytest.approx(0.5 + t2 / (2 * math.sqrt(2 + t2 * t2)), rel=1e-12, abs=1e-15)


def test_t_test_tiny_tail_keeps_relative_precision():
    # df=1 at t near -1e6: p is about 3.18e-7; 1 - (1 - p) would lose digits.
    _, _, t, p = compare.t_test_less([-1 - 1e-6, -1 + 1e-6], 0.0)
    assert t == pytest.approx(-1e6, rel=1e-6)
    # 1/2 + atan(t)/pi, rewritten without cancellation
    exact = math.atan(1 / -t) / math.pi
    assert p == pytest.approx(exact, rel=1e-10)


def test_t_test_with_zero_std_does_not_crash():
    assert compare.t_test_less([3.27, 3.27, 3.27], 3.28)[3] == 0.0
    _, std, t, p = compare.t_test_less([3.29, 3.29], 3.28)
    assert (std, t, p) == (0.0, math.inf, 1.0)
    with pytest.raises(ValueError):
        compare.t_test_less([3.27], 3.28)


@pytest.mark.parametrize(
    "p,text",
    [
        (0.0123, "0.0123"),
        (0.5, "0.5000"),
        (1.0, "1.0000"),
        (0.0001, "0.0001"),
        (2.3e-8, "2.300e-08"),
        (9.87654e-5, "9.877e-05"),
        (0.0, "0.000e+00"),
    ],
)
def test_format_p(p, text):
    assert compare.format_p(p) == text


# ------------------------------------------------------------------------------ report


def test_report_has_rows_shared_steps_and_summary_last(tmp_path, capsys):
    finals = [3.2785, 3.2791, 3.2779]
    logs = [make_log(tmp_path / f"run{i}.txt", curve(f), 40) for i, f in enumerate(finals)]
    # A killed run is named on stderr and left out of the tables and the t-test.
    make_log(tmp_path / "killed.txt", {0: 10.8258, 15: 5.0}, 40, finished=False)
    code, out, err = run_main(capsys, *logs, tmp_path / "killed.txt")
    assert code == 0
    assert "killed.txt" in err and "unfinished" in err and "killed.txt" not in out
    lines = out.strip().splitlines()
    for log in logs:
        assert sum(str(log) in line for line in lines) == 1
    assert re.search(
        r"40/40\s+3\.2785\s+3\.0\s+100\.00\s+31563 MiB\s+2\.11\.0\+cu128\s+8 x NVIDIA H100",
        out,
    )
    shared = [line.split() for line in lines if re.match(r"^\s*\d+(\s+\d+\.\d{4}){3}$", line)]
    assert [row[0] for row in shared] == ["0", "10", "20", "30", "40"]
    assert shared[-1][1:] == ["3.2785", "3.2791", "3.2779"]

    m = SUMMARY.match(lines[-1])
    assert m, lines[-1]
    mean, std, t, p = compare.t_test_less(finals, 3.28)
    assert m.groups() == (
        "3",
        f"{mean:.4f}",
        f"{std:.4f}",
        f"{t:.2f}",
        compare.format_p(p),
        "3.28",
    )


def test_runs_are_listed_in_the_order_they_ran_with_their_seeds(tmp_path, capsys):
    # named against the order they ran (their logs' times): z first, a last
    for i, (name, seed) in enumerate([("z", 2), ("m", 0), ("a", 1)]):
        log = make_log(tmp_path / "ours" / f"{name}.txt", curve(3.28 - i / 1000), 40,
                       options={"seed": str(seed)})
        os.utime(log, (1_700_000_000 + 60 * i,) * 2)
    # the public records' logs: by the date nvidia-smi printed as they started, whatever their
    # files' times
    dates = [("a", "Wed Dec 11 10:36:50 2024", 1), ("b", "Tue Dec 10 09:00:00 2024", 2)]
    for name, date, mtime in dates:
        log = make_log(tmp_path / "public" / f"{name}.txt", curve(3.28 - mtime / 1000), 40,
                       public=True)
        log.write_text(log.read_text().replace("+---", f"{date}\n+---", 1))
        os.utime(log, (1_700_000_000 + mtime,) * 2)
    for folder, expected in [("ours", [("z", "2"), ("m", "0"), ("a", "1")]),
                             ("public", [("b", "?"), ("a", "?")])]:
        code, out, _ = run_main(capsys, tmp_path / folder)
        lines = out.splitlines()
        assert code == 0 and lines[0].split()[:3] == ["#", "file", "seed"]
        rows = [line.split() for line in lines if ".txt " in line]
        assert [(Path(row[1]).stem, row[2]) for row in rows] == expected


def test_runs_validated_on_synthetic_data_get_no_verdict_against_3_28(tmp_path, capsys):
    import statistics
    finals = [1.8405, 1.8412]
    synthetic = {"train_files": "synthetic", "val_files": "synthetic"}
    group_logs(tmp_path / "a", finals, options=synthetic)
    group_logs(tmp_path / "b", [1.8301, 1.8299], options=synthetic)
    code, out, _ = run_main(capsys, tmp_path / "a")
    no_test = (": not tested against 3.28, the target on FineWeb's val data: these runs validated "
               "on synthetic (--target LOSS tests against another)")
    summary = f"n=2 mean={statistics.fmean(finals):.4f} std={statistics.stdev(finals):.4f}"
    assert code == 0 and out.strip().splitlines()[-1] == summary + no_test
    # a target given is tested against
    code, out, _ = run_main(capsys, tmp_path / "a", "--target", "1.9")
    m = SUMMARY.match(out.strip().splitlines()[-1])
    assert code == 0 and m and m.group(6) == "1.9"
    # with --vs, each group's line the same; B against A as ever
    code, out, _ = run_main(capsys, tmp_path / "a", "--vs", tmp_path / "b")
    lines = out.strip().splitlines()
    assert code == 0 and lines[-4] == f"A: {summary}{no_test}"
    assert WELCH_LINE.match(lines[-2])


def test_shared_steps_are_the_intersection(tmp_path):
    a = compare.parse_log(make_log(tmp_path / "a.txt", curve(3.28, 40, every=10), 40))
    b = compare.parse_log(make_log(tmp_path / "b.txt", curve(3.27, 40, every=20), 40))
    table = compare.shared_steps_table([a, b], ["1", "2"])
    assert [line.split()[0] for line in table.splitlines()[2:]] == ["0", "20", "40"]


def test_target_option_changes_the_test(tmp_path, capsys):
    logs = [make_log(tmp_path / f"r{i}.txt", curve(f), 40) for i, f in enumerate([3.30, 3.31])]
    _, out, _ = run_main(capsys, *logs, "--target", "3.5")
    m = SUMMARY.match(out.strip().splitlines()[-1])
    assert m.group(6) == "3.5" and float(m.group(4)) < 0 and float(m.group(5)) < 0.05
    _, out, _ = run_main(capsys, *logs)
    m = SUMMARY.match(out.strip().splitlines()[-1])
    assert m.group(6) == "3.28" and float(m.group(4)) > 0 and float(m.group(5)) > 0.5


def test_equal_losses_give_a_note_and_a_summary(tmp_path, capsys):
    logs = [make_log(tmp_path / f"r{i}.txt", curve(3.27), 40, ms_per_step=100 + i)
            for i in range(2)]
    _, out, _ = run_main(capsys, *logs)
    lines = out.strip().splitlines()
    assert "std 0" in lines[-2]
    assert lines[-1] == "n=2 mean=3.2700 std=0.0000 t=-inf p=0.000e+00 target=3.28"


def test_directory_argument_and_single_run(tmp_path, capsys):
    make_log(tmp_path / "logs" / "sub" / "one.txt", curve(3.28), 40)
    (tmp_path / "logs" / "notes.md").write_text("not a txt, ignored")
    code, out, err = run_main(capsys, tmp_path / "logs", tmp_path / "missing.txt")
    assert code == 0
    assert "one.txt" in out and out.strip().splitlines()[-1] == (
        "n=1 (the t-test needs two or more finished runs)")
    assert "missing.txt: no such file" in err


def test_nothing_usable_is_an_error_not_a_traceback(tmp_path, capsys):
    junk = tmp_path / "junk.txt"
    junk.write_text("hello\n")
    code, _, err = run_main(capsys, junk)
    assert code == 1 and "junk.txt: not a log" in err and "Traceback" not in err


@pytest.mark.slow
def test_command_line_script(tmp_path):
    """records/compare.py run as a script on a folder of two finished logs and one that is not a
    log: no traceback, the test as the last line."""
    for i, final in enumerate([3.27, 3.275]):
        make_log(tmp_path / f"r{i}.txt", curve(final), 40)
    (tmp_path / "broken.txt").write_bytes(b"\xff\xfe garbage")
    proc = run_process([sys.executable, str(SCRIPT), str(tmp_path)], 60, env=launch_env())
    assert proc.returncode == 0, proc.stderr
    assert "broken.txt" in proc.stderr and "Traceback" not in proc.stderr
    assert SUMMARY.match(proc.stdout.strip().splitlines()[-1])
    assert all(str(tmp_path / f"r{i}.txt") in proc.stdout for i in range(2))


@pytest.mark.slow
def test_a_reader_that_goes_away_ends_the_output_quietly(tmp_path):
    """`compare.py logs/ | head -1`: SIGPIPE ends it, as it ends any command-line tool, with no
    traceback."""
    group_logs(tmp_path, [3.27, 3.275])
    with started([sys.executable, str(SCRIPT), str(tmp_path)], stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE, text=True, env=launch_env()) as process:
        # closed before compare.py has printed a line
        process.stdout.close()
        stderr = process.stderr.read()
        process.wait(60)
    assert process.returncode == -signal.SIGPIPE and stderr == ""


# -------------------------------------------------------------------------------- plot


def test_plot_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    logs = [make_log(tmp_path / f"r{i}.txt", curve(f), 40) for i, f in enumerate([3.27, 3.29])]
    out_png = tmp_path / "plot.png"
    code, out, _ = run_main(capsys, *logs, "--plot", out_png)
    assert code == 0 and out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert SUMMARY.match(out.strip().splitlines()[-1])


class RecordingAxes:
    """Stands in for matplotlib's axes: records what is drawn."""

    def __init__(self):
        self.lines = []

    def plot(self, x, y, **style):
        self.lines.append((list(x), list(y), style))
        return [RecordingLine(len(self.lines))]

    def __getattr__(self, name):
        """Titles, labels, limits, legend: not checked here."""
        return lambda *args, **kwargs: None


class RecordingLine:
    def __init__(self, number):
        self.number = number

    def get_color(self):
        return f"C{self.number}"


class RecordingPyplot:
    def __init__(self):
        self.axes = RecordingAxes()

    def subplots(self, **kwargs):
        return RecordingFigure(), self.axes

    def close(self, figure):
        pass


class RecordingFigure:
    def tight_layout(self):
        pass

    def savefig(self, path, **kwargs):
        Path(path).write_bytes(b"")


def test_plot_draws_val_loss_and_the_train_loss_of_every_step(tmp_path):
    def loss(step):
        return 3.3 + 7.5 / step

    with_loss = compare.parse_log(make_log(tmp_path / "a.txt", curve(3.3), 40, train_loss=loss))
    public = compare.parse_log(make_log(tmp_path / "b.txt", curve(3.31), 40, public=True))
    pyplot = RecordingPyplot()
    compare.plot_runs([with_loss, public], 3.28, tmp_path / "p.png", pyplot)
    (val_x, val_y, _), (train_x, train_y, train_style), (public_x, public_y, _) = pyplot.axes.lines
    assert val_y == [with_loss.val_loss[s] for s in sorted(with_loss.val_loss)]
    assert train_y == [round(loss(s), 4) for s in range(1, 41)]
    # train time in seconds
    assert train_x == pytest.approx([max(s - 10, 0) * 0.1 for s in range(1, 41)])
    # the colour of its run's val line
    assert train_style["color"] == "C1"
    assert public_y == [public.val_loss[s] for s in sorted(public.val_loss)]


def test_plot_without_matplotlib_says_so(tmp_path, capsys, monkeypatch):
    # A None entry in sys.modules makes "import matplotlib" raise ImportError.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    log = make_log(tmp_path / "r.txt", curve(3.27), 40)
    code, _, err = run_main(capsys, log, "--plot", tmp_path / "p.png")
    assert code == 2 and "pip install matplotlib" in err
    assert not (tmp_path / "p.png").exists()


# ------------------------------------------------------------------------ smoke runs


@pytest.fixture(scope="session")
def smoke_logs(smoke_runs):
    """Paths of finished logs written by real smoke runs of the trainer (CPU)."""
    return [smoke_runs.short(1), smoke_runs.short(2), smoke_runs.full()]


@pytest.mark.slow
def test_smoke_run_logs(smoke_logs, capsys):
    """Logs written by real smoke runs of the trainer parse and compare."""
    assert len(smoke_logs) >= 2
    for log in smoke_logs:
        # raises if unfinished
        run = compare.parse_log(log)
        assert run.steps_done == run.planned and math.isfinite(run.final_loss)
        assert sorted(run.train_loss) == list(range(1, run.planned + 1))
        # the head starts at zero
        assert run.train_loss[1] == round(LN_VOCAB, 4)
        assert run.torch_version != "?" and run.devices != "?"
        assert run.startup_s is not None and run.startup_s > 0
    code, out, err = run_main(capsys, *smoke_logs)
    lines = out.strip().splitlines()
    for log in smoke_logs:
        assert sum(str(log) in line for line in lines) == 1
    # 4 and 12 steps on 1 and 2 processes: shown side by side, never pooled into one test
    assert code == 1 and "differ in" in err and err.count("\n") == 1
    code, out, _ = run_main(capsys, smoke_logs[0])
    lines = out.strip().splitlines()
    assert code == 0 and lines[-1] == "n=1 (the t-test needs two or more finished runs)"


def test_committed_gpu_logs_are_read():
    """Every log under records/ parses; the one-H100 A/B pair and the one-H200 pair read as their
    READMEs' figures say."""
    logs = sorted((REPO / "records").glob("*/*.txt"))
    assert logs, "records/ holds at least the one-H100 runs"
    runs = {log.name: compare.parse_log(log) for log in logs}
    plain = runs["ab-16384-defaults.txt"]
    fused = runs["ab-16384-fused-head-loss.txt"]
    assert (plain.planned, plain.final_loss, plain.step_avg_ms, plain.peak_mib) == (
        20,
        5.4499,
        1163.96,
        10824,
    )
    assert (fused.planned, fused.final_loss, fused.step_avg_ms, fused.peak_mib) == (
        20,
        5.4499,
        1120.39,
        10921,
    )
    assert (plain.startup_s, fused.startup_s) == (64.4, 59.6)
    assert plain.devices == "1 x NVIDIA H100 80GB HBM3" and plain.torch_version == "2.11.0+cu130"
    # the one-H200 pair, e718eb5 against 695aa87, as its README's table gives them
    new, old = runs["e718eb5-12steps-hellaswag.txt"], runs["695aa87-12steps.txt"]
    assert (new.planned, new.final_loss, new.step_avg_ms, new.peak_mib, new.startup_s) == (
        12, 5.8654, 955.08, 32675, 67.8)
    assert (old.planned, old.final_loss, old.step_avg_ms, old.peak_mib, old.startup_s) == (
        12, 5.8652, 1033.15, 32354, 80.5)
    assert new.devices == old.devices == "1 x NVIDIA H200"


# ------------------------------------------------------------------ two groups: B against A

WELCH_LINE = re.compile(
    r"^B against A (?P<title>.*?): B - A = (?P<diff>[-+]\d+\.\d{5}), "
    r"95% CI (?P<low>[-+]\d+\.\d{5}) to (?P<high>[-+]\d+\.\d{5}) "
    r"\(Welch df=(?P<df>\d+\.\d\d)\), t=(?P<t>-?\d+\.\d\d) "
    r"p=(?P<p>\d\.\d{4}|\d\.\d{3}e[-+]\d\d) that B is lower$"
)


def welch_reference(a, b):
    """B - A, its 95% interval and the one-sided test, from numpy's variances and SciPy."""
    from scipy import stats
    a = np.array(a, dtype=np.float64)
    b = np.array(b, dtype=np.float64)
    share_a = a.var(ddof=1) / len(a)
    share_b = b.var(ddof=1) / len(b)
    df = (share_a + share_b) ** 2 / (share_a**2 / (len(a) - 1) + share_b**2 / (len(b) - 1))
    half = stats.t.ppf(0.975, df) * np.sqrt(share_a + share_b)
    diff = b.mean() - a.mean()
    test = stats.ttest_ind(b, a, equal_var=False, alternative="less")
    return diff, diff - half, diff + half, df, test.statistic, test.pvalue


def run_id(i):
    """A new run id, as the trainer names its log (<run id>.txt), that sorts as the i-th."""
    return f"{i:08x}{str(uuid.uuid4())[8:]}"


def group_logs(folder, finals, planned=40, **kwargs):
    """A log per final val loss, each named by a run id of its own as the trainer names them."""
    return [
        make_log(folder / f"{run_id(i)}.txt", curve(final, planned), planned, **kwargs)
        for i, final in enumerate(finals)
    ]


@pytest.mark.parametrize(
    "a,b",
    [
        # B lower
        ([3.2801, 3.2795, 3.2809], [3.2781, 3.2779, 3.2790, 3.2772]),
        # B higher: p above 0.5
        ([3.2790, 3.2810], [3.2805, 3.2815, 3.2800]),
        # unequal variances and counts
        ([3.30, 3.31, 3.29, 3.30, 3.32], [3.28, 3.28, 3.29]),
    ],
)
def test_b_against_a_is_welchs_test_with_its_interval(tmp_path, capsys, a, b):
    group_logs(tmp_path / "a", a)
    group_logs(tmp_path / "b", b)
    code, out, err = run_main(capsys, tmp_path / "a", "--vs", str(tmp_path / "b" / "*.txt"))
    assert code == 0, err
    lines = out.strip().splitlines()
    m = WELCH_LINE.match(lines[-2])
    assert m, lines[-2]
    diff, low, high, df, t, p = welch_reference(a, b)
    assert m["title"] == "at step 40"
    assert float(m["diff"]) == pytest.approx(diff, abs=6e-6)
    assert float(m["low"]) == pytest.approx(low, abs=6e-6)
    assert float(m["high"]) == pytest.approx(high, abs=6e-6)
    assert float(m["df"]) == pytest.approx(df, abs=6e-3)
    assert float(m["t"]) == pytest.approx(t, abs=6e-3)
    assert m["p"] == compare.format_p(p)
    result = compare.welch_less(a, b)
    assert (result.difference, result.low, result.high) == pytest.approx((diff, low, high))
    assert (result.df, result.t, result.p) == pytest.approx((df, t, p), rel=1e-9)
    # each group is judged against the target too, as one group alone would be
    mean_a, std_a, t_a, p_a = compare.t_test_less(a, 3.28)
    assert lines[-4] == (
        f"A: n={len(a)} mean={mean_a:.4f} std={std_a:.4f} t={t_a:.2f} "
        f"p={compare.format_p(p_a)} target=3.28"
    )
    assert lines[-3].startswith(f"B: n={len(b)} ")


TIME_LINE = re.compile(
    r"^B against A in train time: B - A = (?P<diff>[-+]\d+\.\d\d) s, "
    r"95% CI (?P<low>[-+]\d+\.\d\d) s to (?P<high>[-+]\d+\.\d\d) s "
    r"\(Welch df=(?P<df>\d+\.\d\d)\), t=(?P<t>-?\d+\.\d\d) "
    r"p=(?P<p>\d\.\d{4}|\d\.\d{3}e[-+]\d\d) that B is faster$"
)


def test_b_against_a_gives_the_train_time_difference_with_its_test(tmp_path, capsys):
    a = [make_log(tmp_path / "a" / f"{run_id(i)}.txt", curve(f), 40, ms_per_step=ms)
         for i, (f, ms) in enumerate([(3.2801, 100.0), (3.2795, 101.5), (3.2809, 99.2)])]
    b = [make_log(tmp_path / "b" / f"{run_id(i)}.txt", curve(f), 40, ms_per_step=ms)
         for i, (f, ms) in enumerate([(3.2781, 90.3), (3.2779, 92.1), (3.2790, 91.0)])]
    code, out, err = run_main(capsys, tmp_path / "a", "--vs", tmp_path / "b")
    assert code == 0, err

    def seconds(log):
        """The train time of the last val line, as the record counts it, read here."""
        ms = re.search(r"^step:40/40 val_loss:\S+ train_time:(\d+)ms ", log.read_text(), re.M)[1]
        return int(ms) / 1000

    lines = out.strip().splitlines()
    # beside the loss's verdict, last
    assert WELCH_LINE.match(lines[-2])
    m = TIME_LINE.match(lines[-1])
    assert m, lines[-1]
    diff, low, high, df, t, p = welch_reference(list(map(seconds, a)), list(map(seconds, b)))
    assert float(m["diff"]) == pytest.approx(diff, abs=6e-3) and diff < -0.2
    assert float(m["low"]) == pytest.approx(low, abs=6e-3)
    assert float(m["high"]) == pytest.approx(high, abs=6e-3)
    assert float(m["df"]) == pytest.approx(df, abs=6e-3)
    assert float(m["t"]) == pytest.approx(t, abs=6e-3)
    assert m["p"] == compare.format_p(p)


def test_different_step_counts_are_compared_at_the_last_validation_step_both_ran(tmp_path, capsys):
    a = [3.2801, 3.2795, 3.2809]
    b = [3.2901, 3.2875]
    group_logs(tmp_path / "a", a, planned=40)
    group_logs(tmp_path / "b", b, planned=30)
    code, out, _ = run_main(capsys, tmp_path / "a", "--vs", tmp_path / "b")
    assert code == 0
    lines = out.strip().splitlines()
    at_end = WELCH_LINE.match(lines[-3])
    at_30 = WELCH_LINE.match(lines[-2])
    assert at_end["title"] == "at the end (step 40 for A, 30 for B)"
    assert float(at_end["diff"]) == pytest.approx(welch_reference(a, b)[0], abs=6e-6)
    assert at_30["title"] == "at step 30, the last validation step both ran"
    # curve(): A's val loss at step 30 of 40 is its final + 10/40, as logged with 4 decimals
    a_at_30 = [round(final + 0.25, 4) for final in a]
    diff, low, high, _, t, p = welch_reference(a_at_30, b)
    assert float(at_30["diff"]) == pytest.approx(diff, abs=6e-6)
    assert float(at_30["low"]) == pytest.approx(low, abs=6e-6)
    assert float(at_30["t"]) == pytest.approx(t, abs=6e-3)
    assert at_30["p"] == compare.format_p(p)
    assert "A and B differ in: steps 40 / 30" in out


def test_one_run_per_group_says_a_test_needs_two(tmp_path, capsys):
    a = make_log(tmp_path / "a.txt", curve(3.2801), 40)
    b = make_log(tmp_path / "b.txt", curve(3.2781), 40)
    code, out, _ = run_main(capsys, a, "--vs", b)
    assert code == 0
    loss, time = out.strip().splitlines()[-2:]
    assert loss.startswith("B against A at step 40: B - A = -0.00200")
    assert "a test needs two or more finished runs in each group (A has 1, B has 1)" in loss
    assert time == ("B against A in train time: B - A = +0.00 s; a test needs two or more finished "
                    "runs in each group (A has 1, B has 1)")
    assert "p=" not in out


def test_equal_losses_in_each_group_make_a_degenerate_test_said_so(tmp_path, capsys):
    group_logs(tmp_path / "a", [3.28, 3.28])
    group_logs(tmp_path / "b", [3.27, 3.27])
    code, out, _ = run_main(capsys, tmp_path / "a", "--vs", tmp_path / "b")
    lines = out.strip().splitlines()
    assert code == 0 and "degenerate" in lines[-3]
    assert lines[-2].startswith("B against A at step 40: B - A = -0.01000, 95% CI -0.01000 to")
    assert lines[-2].endswith("t=-inf p=0.000e+00 that B is lower")


def test_a_log_in_both_groups_is_refused(tmp_path, capsys):
    logs = group_logs(tmp_path, [3.28, 3.27])
    code, out, err = run_main(capsys, *logs, "--vs", logs[1])
    assert code == 1 and out == ""
    assert err.strip().splitlines() == [
        f"error: {logs[1]} in A and {logs[1]} in B are the same run (the same file); give each "
        "run to one group"
    ]


def test_a_group_without_finished_runs_is_refused(tmp_path, capsys):
    a = group_logs(tmp_path / "a", [3.28, 3.27])
    code, out, err = run_main(capsys, *a, "--vs", tmp_path / "b*")
    assert code == 1 and out == ""
    assert err.strip().splitlines()[-1] == "error: group B (--vs) has no finished runs to compare"


def test_groups_validated_on_different_data_are_refused(tmp_path, capsys):
    group_logs(tmp_path / "a", [3.28, 3.27], options={"val_files": "fineweb_val_*.bin"})
    group_logs(tmp_path / "b", [3.28, 3.27], options={"val_files": "enwiki_val_*.bin"})
    code, out, err = run_main(capsys, tmp_path / "a", "--vs", tmp_path / "b")
    assert code == 1 and "B against A" not in out
    assert len(err.strip().splitlines()) == 1
    assert err.startswith("error: no test of B against A: they are validated on different data")
    assert "val_files fineweb_val_*.bin / enwiki_val_*.bin" in err


def test_vs_names_an_option_that_only_one_groups_trainer_has(tmp_path, capsys):
    # a fork that adds --mlp_ratio: its logs have a line the original's lack
    group_logs(tmp_path / "a", [3.2801, 3.2795])
    group_logs(tmp_path / "b", [3.2781, 3.2779], options={"mlp_ratio": "2"})
    code, out, _ = run_main(capsys, tmp_path / "a", "--vs", tmp_path / "b")
    assert code == 0
    assert "A and B differ in: mlp_ratio (no such option) / 2\n" in out


def test_vs_names_every_setting_that_differs(tmp_path, capsys):
    changed = {f"option_{i}": str(i) for i in range(12)}
    group_logs(tmp_path / "a", [3.2801, 3.2795], options={"seed": "0", "compile": "auto"})
    group_logs(tmp_path / "b", [3.2781, 3.2779], options={"seed": "0", "compile": "false",
                                                          **changed})
    code, out, _ = run_main(capsys, tmp_path / "a", "--vs", tmp_path / "b")
    (line,) = [line for line in out.splitlines() if line.startswith("A and B differ in: ")]
    named = line.removeprefix("A and B differ in: ").split(", ")
    # how it ran (compile) is a difference too, where it is one; the seed is not
    only_b = [f"{name} (no such option) / {value}" for name, value in changed.items()]
    assert code == 0 and named == ["compile auto / false", *only_b]


def test_runs_of_a_trainer_with_an_option_more_are_not_pooled(tmp_path, capsys):
    first = make_log(tmp_path / "a.txt", curve(3.28), 40)
    second = make_log(tmp_path / "b.txt", curve(3.27), 40, options={"mlp_ratio": "2"})
    code, out, err = run_main(capsys, first, second)
    assert code == 1 and not SUMMARY.search(out)
    difference = "mlp_ratio (no such option) / 2"
    assert err.startswith(f"error: no t-test: runs 1 and 2 differ in {difference},")


def test_logs_without_options_are_never_pooled_or_compared_with_logs_with_them_unasked(tmp_path,
                                                                                     capsys):
    public = group_logs(tmp_path / "a", [3.2801, 3.2795], public=True)
    ours = group_logs(tmp_path / "b", [3.2781, 3.2779], options={"mlp_ratio": "2"})
    refusal = ("records no options (a public record's log, or one cut down), so nothing says it "
               "ran as the others: it is not pooled with, or compared as, a run of known options; "
               "compare logs of one kind, or pass --allow_unknown_options to compare them by steps "
               "and devices only\n")
    # pooled into one test, or compared as group A against B: refused, the tables still shown
    code, out, err = run_main(capsys, *public, *ours)
    assert code == 1 and str(public[0]) in out and not SUMMARY.search(out)
    assert err == f"error: run 1 (and 1 more) {refusal}"
    code, out, err = run_main(capsys, tmp_path / "a", "--vs", tmp_path / "b")
    assert code == 1 and "B against A" not in out and err == f"error: run A1 (and 1 more) {refusal}"
    # asked for: compared by steps and devices, and said so
    code, out, err = run_main(capsys, tmp_path / "a", "--vs", tmp_path / "b",
                              "--allow_unknown_options")
    assert code == 0 and err == ""
    assert ("note: run A1 (and 1 more) records no options: compared by steps and devices only "
            "(--allow_unknown_options)") in out.splitlines()
    assert "A and B differ in: options, which some logs do not record" in out.splitlines()
    assert WELCH_LINE.match(out.strip().splitlines()[-2])
    # logs that all lack options are compared as before, by steps and devices
    code, out, err = run_main(capsys, public[0], "--vs", public[1])
    assert code == 0 and err == "" and "records no options" not in out


# ------------------------------------------------------- configurations, divergence, stops


@pytest.mark.parametrize(
    "kwargs,difference",
    [
        (dict(planned=50), "steps 40 / 50"),
        (dict(options={"batch_size": "262144"}), "batch_size 524288 / 262144"),
        (dict(options={"train_files": "enwiki_*.bin"}), "train_files fineweb_*.bin / enwiki_*.bin"),
        (dict(gpus=1), "devices 8 x NVIDIA H100 80GB HBM3 / 1 x NVIDIA H100 80GB HBM3"),
    ],
)
def test_runs_of_different_configurations_are_not_pooled(tmp_path, capsys, kwargs, difference):
    base = {"batch_size": "524288", "train_files": "fineweb_*.bin"}
    first = make_log(tmp_path / "a.txt", curve(3.28), 40, options=base)
    options = dict(base, **kwargs.pop("options", {}))
    planned = kwargs.pop("planned", 40)
    second = make_log(tmp_path / "b.txt", curve(3.27, planned), planned, options=options, **kwargs)
    code, out, err = run_main(capsys, first, second)
    assert code == 1 and not SUMMARY.search(out)
    # the tables still show both
    assert str(first) in out and str(second) in out
    assert len(err.strip().splitlines()) == 1
    assert err.startswith(f"error: no t-test: runs 1 and 2 differ in {difference},")


def test_runs_that_differ_only_in_how_they_run_are_one_configuration(tmp_path, capsys):
    how = [
        {"seed": "0", "log_dir": "logs/A1", "compile": "auto", "max_device_batch_size": "65536"},
        {"seed": "1", "log_dir": "logs/A2", "compile": "false", "max_device_batch_size": "16384"},
    ]
    # the same shards in another folder
    how[0]["val_files"] = "data/fineweb10B/fineweb_val_*.bin"
    how[1]["val_files"] = "/mnt/shared/fineweb_val_*.bin"
    logs = [
        make_log(tmp_path / f"{i}.txt", curve(f), 40, options=o)
        for i, (f, o) in enumerate(zip([3.28, 3.27], how))
    ]
    code, out, err = run_main(capsys, *logs)
    assert code == 0 and err == "" and SUMMARY.match(out.strip().splitlines()[-1])


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
def test_a_diverged_run_is_named_and_left_out_of_the_test(tmp_path, capsys, bad):
    logs = group_logs(tmp_path, [3.2785, 3.2791, 3.2779])
    # diverged at the last step: the val line is there, its loss is not a number
    text = logs[2].read_text().replace("step:40/40 val_loss:3.2779", f"step:40/40 val_loss:{bad}")
    logs[2].write_text(text)
    code, out, err = run_main(capsys, *logs)
    assert code == 0
    assert f"skipped {logs[2]}: diverged (val loss {float(bad)} at step 40 of 40)" in err
    assert str(logs[2]) not in out
    mean, std, t, p = compare.t_test_less([3.2785, 3.2791], 3.28)
    assert out.strip().splitlines()[-1].startswith(f"n=2 mean={mean:.4f} std={std:.4f} t={t:.2f}")


def test_a_run_diverged_midway_is_named_as_diverged(tmp_path):
    log = make_log(
        tmp_path / "d.txt",
        {0: 10.8258, 10: math.nan},
        40,
        finished=False,
        last_line="error: val loss is nan at step 10: training diverged, most likely ...",
    )
    with pytest.raises(
        runlog.LogError, match=re.escape("diverged (val loss nan at step 10 of 40)")
    ):
        compare.parse_log(log)


def test_a_stopped_run_is_named_as_stopped_and_left_out(tmp_path, capsys):
    logs = group_logs(tmp_path, [3.2785, 3.2791])
    stopped = make_log(
        tmp_path / "stopped.txt",
        {0: 10.8258, 10: 5.0, 20: 4.0},
        40,
        finished=False,
        last_line="stopped by SIGTERM after step 20; no checkpoint was written (...)",
    )
    code, out, err = run_main(capsys, *logs, stopped)
    assert code == 0 and str(stopped) not in out
    assert (
        f"skipped {stopped}: stopped early (stopped by SIGTERM after step 20; 20 of 40 steps)"
        in err
    )
    assert out.strip().splitlines()[-1].startswith("n=2 ")


def test_two_runs_of_the_same_plan_in_one_file_are_refused(tmp_path):
    a = make_log(tmp_path / "a.txt", curve(3.3), 40).read_text()
    both = tmp_path / "both.txt"
    both.write_text(a + a.split("=" * 100 + "\n")[-1])
    with pytest.raises(runlog.LogError, match="not one run .step lines go back from step 40 to 0"):
        compare.parse_log(both)


def test_train_time_going_back_after_timing_started_is_refused(tmp_path):
    log = make_log(tmp_path / "a.txt", curve(3.3), 40)
    log.write_text(
        log.read_text().replace("step:25/40 train_time:1500ms", "step:25/40 train_time:900ms")
    )
    with pytest.raises(runlog.LogError, match="train_time goes back from 1400ms at step 24"):
        compare.parse_log(log)


@pytest.mark.parametrize(
    "bad",
    [
        "step:50/40 val_loss:3.3000 train_time:4000ms step_avg:100.00ms",
        "step:40/40 val_loss:abc train_time:4000ms step_avg:100.00ms",
    ],
)
def test_odd_step_lines_are_refused(tmp_path, bad):
    log = make_log(tmp_path / "a.txt", curve(3.3), 40, last_line=bad)
    with pytest.raises(runlog.LogError, match="odd step line"):
        compare.parse_log(log)


# ------------------------------------------------- every path is read or refused, never passed over


def deny(monkeypatch, *paths):
    """os.scandir and open refuse these paths with EACCES, as the kernel refuses another user's
    folder or file (chmod does not stop root, who may run these tests)."""
    denied = {os.fspath(path) for path in paths}
    real_scandir = os.scandir
    real_open = io.open

    def refused(path):
        return PermissionError(errno.EACCES, "Permission denied", os.fspath(path))

    def scandir(path="."):
        if os.fspath(path) in denied:
            raise refused(path)
        return real_scandir(path)

    def open_file(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and os.fspath(file) in denied:
            raise refused(file)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(os, "scandir", scandir)
    monkeypatch.setattr(io, "open", open_file)
    monkeypatch.setattr(builtins, "open", open_file)


def test_a_folder_that_cannot_be_listed_fails_loudly_not_a_gap(tmp_path, capsys, monkeypatch):
    # the two worst runs in a folder that cannot be listed would leave the test looking good
    group_logs(tmp_path / "logs", [3.2790, 3.2795])
    group_logs(tmp_path / "logs" / "locked", [3.2850, 3.2860])
    deny(monkeypatch, tmp_path / "logs" / "locked")
    with pytest.raises(PermissionError):
        run_main(capsys, tmp_path / "logs")
    assert capsys.readouterr().out == ""


def test_a_log_that_cannot_be_read_is_an_error_not_skipped(tmp_path, capsys, monkeypatch):
    logs = group_logs(tmp_path, [3.2790, 3.2795, 3.2850])
    deny(monkeypatch, logs[2])
    code, out, err = run_main(capsys, tmp_path)
    assert code == 1 and out == ""
    assert err.splitlines() == [
        f"error: {logs[2]} cannot be read (Permission denied): make it readable, or leave it out"
    ]


def test_a_pipe_or_a_device_is_refused_unopened(tmp_path, capsys):
    logs = group_logs(tmp_path / "logs", [3.2790, 3.2795])
    # named, and found in a folder: opening a pipe would wait for a writer that never comes
    fifo = tmp_path / "logs" / "pipe.txt"
    os.mkfifo(fifo)
    how = ("is not a file (a folder, a pipe or a device): it is not read; give a file, or leave "
           "it out")
    for named, refused in (([*logs, fifo], fifo), (["/dev/null", *logs], "/dev/null"),
                           ([tmp_path / "logs"], fifo)):
        code, out, err = run_main(capsys, *named)
        assert code == 1 and out == ""
        assert err.splitlines() == [f"error: {refused} {how}"]


def test_a_folder_holding_a_symlink_loop_is_read_or_refused_in_one_line(tmp_path, capsys, no_hang):
    group_logs(tmp_path / "logs", [3.2790, 3.2801])
    # links back up (each folder is read once: followed round, two would make 2**40 paths), and a
    # loop of two links by no log's name
    (tmp_path / "logs" / "up").symlink_to("..")
    (tmp_path / "logs" / "sub").mkdir()
    (tmp_path / "logs" / "sub" / "top").symlink_to("../..")
    (tmp_path / "logs" / "x1").symlink_to("x2")
    (tmp_path / "logs" / "x2").symlink_to("x1")
    code, out, err = run_main(capsys, tmp_path / "logs")
    assert code == 0 and err == "" and out.strip().splitlines()[-1].startswith("n=2 ")
    # a loop by a log's name cannot be read
    loop = tmp_path / "logs" / "loop.txt"
    loop.symlink_to("loop.txt")
    code, out, err = run_main(capsys, tmp_path / "logs")
    assert code == 1 and out == ""
    assert err == (f"error: {loop} cannot be read (Too many levels of symbolic links): make it "
                   "readable, or leave it out\n")


# ----------------------------------------------------------------------- each run counts once


def test_a_copy_of_a_log_counts_once(tmp_path, capsys):
    logs = group_logs(tmp_path / "logs", [3.2790, 3.2801, 3.2785])
    # records/README.md's way to add a record: the logs copied as the trainer wrote them
    kept = tmp_path / "records" / "2026-01-01_try"
    kept.mkdir(parents=True)
    shutil.copy(logs[0], kept)
    # and one renamed: known by its step lines
    shutil.copy(logs[1], kept / "best.txt")
    code, out, err = run_main(capsys, tmp_path / "logs", tmp_path / "records")
    assert code == 0
    assert err.splitlines() == [
        f"skipped {kept / logs[0].name}: the same run as {logs[0]} (a copy); counted once",
        f"skipped {kept / 'best.txt'}: the same run as {logs[1]} (a copy); counted once",
    ]
    from scipy import stats
    test = stats.ttest_1samp([3.2790, 3.2801, 3.2785], 3.28, alternative="less")
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"n=3 mean=3.2792 std=0.0008 t={test.statistic:.2f} ")


def resumed_copy(log, path, checkpoint, step_avg="99.99"):
    """The log of a run resumed from `checkpoint` at its last step, which only validates: its
    header, its note, the last val line again (with another step_avg, as the trainer prints it)."""
    text = log.read_text()
    header, steps = text.split("step:0/", 1)
    last_val = [line for line in steps.splitlines() if " val_loss:" in line][-1]
    last_val = re.sub(r"step_avg:\S+ms", f"step_avg:{step_avg}ms", last_val)
    path.parent.mkdir(parents=True, exist_ok=True)
    step = last_val.split("/")[1].split()[0]
    path.write_text(f"{header}resumed from {checkpoint} at step {step}\n{last_val}\n"
                    "peak memory consumption: 20000 MiB\n")
    return path


def test_a_resumed_run_that_only_validates_counts_once(tmp_path, capsys):
    logs = group_logs(tmp_path / "logs", [3.2790, 3.2801, 3.2785])
    # resumed from the run's own checkpoint folder (logs/<run id>/), and from one moved away
    checkpoint = tmp_path / "logs" / logs[0].stem / "state_step000040.pt"
    again = resumed_copy(logs[0], tmp_path / "later" / f"{run_id(7)}.txt", checkpoint)
    moved = resumed_copy(logs[1], tmp_path / "later" / f"{run_id(8)}.txt", tmp_path / "x.pt")
    code, out, err = run_main(capsys, tmp_path / "logs", tmp_path / "later")
    assert code == 0
    how = "(resumed from its checkpoint at step 40); counted once"
    assert err.splitlines() == [
        f"skipped {again}: the same run as {logs[0]} {how}",
        f"skipped {moved}: the same run as {logs[1]} {how}",
    ]
    assert out.strip().splitlines()[-1].startswith("n=3 mean=3.2792 ")


def test_branches_resumed_from_one_checkpoint_with_other_settings_are_two_runs(tmp_path, capsys):
    # both go on from the checkpoint of run 0 at step 40, one with another --muon_lr
    base = group_logs(tmp_path / "a", [3.2790], options={"muon_lr": "0.05"})[0]
    branch = make_log(tmp_path / "b" / f"{run_id(1)}.txt", curve(3.2750), 40,
                      options={"muon_lr": "0.02"})
    checkpoint = tmp_path / "a" / base.stem / "state_step000040.pt"
    text = branch.read_text().replace("step:0/", f"resumed from {checkpoint} at step 40\nstep:0/", 1)
    branch.write_text(text)
    code, out, err = run_main(capsys, base, "--vs", branch)
    assert code == 0 and "same run" not in err
    assert "B - A = -0.00400" in out and "muon_lr 0.05 / 0.02" in out
    # the same settings: one run, counted once
    again = resumed_copy(base, tmp_path / "c" / f"{run_id(2)}.txt", checkpoint)
    code, out, err = run_main(capsys, base, again)
    assert code == 0 and "the same run as" in err


def test_vs_given_twice_puts_both_in_group_b(tmp_path, capsys):
    a = group_logs(tmp_path / "a", [3.2790, 3.2801])
    b = group_logs(tmp_path / "b", [3.2781, 3.2779])
    code, out, _ = run_main(capsys, *a, "--vs", b[0], "--vs", b[1])
    assert code == 0
    assert str(b[0]) in out and str(b[1]) in out and "B2" in out


def test_the_same_runs_as_a_and_b_refuse_the_test(tmp_path, capsys):
    logs = group_logs(tmp_path / "a", [3.2790, 3.2801, 3.2785])
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    code, out, err = run_main(capsys, tmp_path / "a", "--vs", tmp_path / "b")
    assert code == 1 and out == ""
    assert err.splitlines() == [
        f"error: {logs[0]} in A and {tmp_path / 'b' / logs[0].name} in B are the same run (a "
        "copy); give each run to one group"
    ]


def test_two_runs_with_equal_lines_are_two_runs(tmp_path, capsys):
    # two deterministic runs too short to be timed log the same lines: their ids tell them apart
    one = make_log(tmp_path / f"{run_id(0)}.txt", curve(3.27), 40)
    other = tmp_path / f"{run_id(1)}.txt"
    shutil.copy(one, other)
    code, out, err = run_main(capsys, one, other)
    assert code == 0 and err == ""
    assert out.strip().splitlines()[-1].startswith("n=2 ")


def cut_down(log, path):
    """A copy of the log without its options, as cut down by hand: no `hyperparameters:` block."""
    lines = log.read_text().splitlines()
    start = lines.index("hyperparameters:")
    end = next(i for i in range(start + 1, len(lines)) if not lines[i].startswith("  "))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines[:start] + lines[end:]) + "\n")
    return path


def test_a_log_cut_down_to_its_steps_is_the_same_run_as_its_full_log(tmp_path, capsys):
    logs = group_logs(tmp_path / "logs", [3.2790, 3.2801], options={"seed": "0"})
    # renamed, and under its run id in another folder
    renamed = cut_down(logs[0], tmp_path / "cut" / "best.txt")
    kept_name = cut_down(logs[1], tmp_path / "cut" / logs[1].name)
    code, out, err = run_main(capsys, tmp_path / "logs", tmp_path / "cut")
    assert code == 0
    assert err.splitlines() == [
        f"skipped {kept_name}: the same run as {logs[1]} (a copy); counted once",
        f"skipped {renamed}: the same run as {logs[0]} (a copy); counted once",
    ]
    assert out.strip().splitlines()[-1].startswith(f"n=2 mean={(3.2790 + 3.2801) / 2:.4f} ")


def resumed_at(path, step, note, ms_per_step):
    """The log of a run resumed at `step` (its resumed line `note`): step lines after it only, at
    another speed than the run it went on from."""
    log = make_log(path, curve(3.2790), 40, ms_per_step=ms_per_step)
    head, steps = log.read_text().split("step:0/40 val_loss", 1)
    steps = ("step:0/40 val_loss" + steps).splitlines()
    kept = [s for s in steps if not s.startswith("step:") or int(s[5:].split("/")[0]) > step]
    log.write_text(f"{head}{note}\n" + "\n".join(kept) + "\n")
    return log


def test_a_run_resumed_from_a_copied_checkpoint_counts_once(tmp_path, capsys):
    logs = group_logs(tmp_path / "logs", [3.2790, 3.2801])
    # run 0's checkpoint of step 20 copied to ck/mine.pt, resumed: the log names the run that wrote
    # it (by its id, the checkpoint's folder being no run's); then that run's own, of step 30
    resumed = resumed_at(tmp_path / "logs" / f"{run_id(5)}.txt", 20, f"resumed from ck/mine.pt at "
                         f"step 20 of run {logs[0].stem}, written by x.py (sha256 0123456789ab): "
                         "another script, accepted (--accept_other_script); options changed: "
                         "--log_dir 'a' -> 'b'", ms_per_step=101)
    again = resumed_at(tmp_path / "logs" / f"{run_id(6)}.txt", 30, "resumed from /mnt/x.pt at "
                       f"step 30 of run {resumed.stem}", ms_per_step=102)
    # and run 1's final checkpoint, copied, validated again with HellaSwag
    checked = resumed_copy(logs[1], tmp_path / "logs" / f"{run_id(7)}.txt", "final.pt")
    text = checked.read_text().replace(" at step 40\n", f" at step 40 of run {logs[1].stem}\n")
    checked.write_text(text.replace("  val_loss_every = 125\n", "  val_loss_every = 125\n"
                                    "  hellaswag = True\n"))
    code, out, err = run_main(capsys, tmp_path / "logs")
    assert code == 0
    assert err.splitlines() == [
        f"skipped {resumed}: the same run as {logs[0]} (resumed from its checkpoint at step 20); "
        "counted once",
        f"skipped {again}: the same run as {logs[0]} (resumed from its checkpoint at step 30); "
        "counted once",
        f"skipped {checked}: the same run as {logs[1]} (resumed from its checkpoint at step 40); "
        "counted once",
    ]
    assert out.strip().splitlines()[-1].startswith(f"n=2 mean={(3.2790 + 3.2801) / 2:.4f} ")


@pytest.mark.slow
def test_a_real_run_resumed_from_a_copied_checkpoint_counts_once(markov_shards, tmp_path, capsys):
    import train_gpt
    with contextlib.redirect_stdout(io.StringIO()):
        assert train_gpt.main(tiny(markov_shards, tmp_path / "logs", "--num_iterations", "4",
                                   "--checkpoint_every", "2")) == 0
        (first,) = (tmp_path / "logs").glob("*.txt")
        (tmp_path / "ck").mkdir()
        shutil.copy(first.with_suffix("") / "state_step000002.pt", tmp_path / "ck" / "mine.pt")
        assert train_gpt.main(["--resume", str(tmp_path / "ck" / "mine.pt"), "--log_dir",
                               str(tmp_path / "logs")]) == 0
    (resumed,) = set((tmp_path / "logs").glob("*.txt")) - {first}
    code, out, err = run_main(capsys, tmp_path / "logs")
    assert code == 0 and str(first) in out and str(resumed) not in out
    assert err == (f"skipped {resumed}: the same run as {first} (resumed from its checkpoint at "
                   "step 2); counted once\n")


# ------------------------------------------------------------------------ plot: time axis


class LabelledAxes(RecordingAxes):
    def set_xlabel(self, label):
        self.xlabel = label


class LabelledPyplot(RecordingPyplot):
    """A pyplot that records what is drawn, and can say which formats it writes."""

    def __init__(self):
        self.axes = LabelledAxes()

    def figure(self):
        canvas = type(
            "Canvas", (), {"get_supported_filetypes": lambda self: {"png": "", "pdf": ""}}
        )
        return type("Figure", (), {"canvas": canvas()})()

    def close(self, figure):
        pass


def test_plot_is_monotone_in_time_with_the_untimed_steps_at_zero(tmp_path):
    # as the trainer writes it: the first 10 step lines carry the time since launch
    log = make_log(tmp_path / "a.txt", curve(3.3), 40, launch_ms=60_000, train_loss=lambda s: 4.0)
    run = compare.parse_log(log)
    assert run.train_loss_time_ms[10] == 61_000 and run.train_loss_time_ms[11] == 100
    pyplot = LabelledPyplot()
    compare.plot_runs([run], 3.28, tmp_path / "p.png", pyplot)
    (val_x, _, _), (train_x, _, _) = pyplot.axes.lines
    # train time as the trainer defines it: nothing before step 10 is timed
    assert train_x == pytest.approx([max(s - 10, 0) * 0.1 for s in range(1, 41)])
    assert val_x == pytest.approx([0.0, 0.0, 1.0, 2.0, 3.0])
    assert "the first 10 steps" in pyplot.axes.xlabel and "untimed" in pyplot.axes.xlabel


def test_the_logs_own_untimed_steps_count_is_used(tmp_path):
    # a fork that times from step 20: its source says so, and its lines up to 20 are untimed
    log = make_log(tmp_path / "a.txt", curve(3.3), 40, launch_ms=60_000, train_loss=lambda s: 4.0)
    text = log.read_text().replace("def log(", "UNTIMED_STEPS = 20\ndef log(", 1)
    for step in range(11, 21):
        text = text.replace(
            f"step:{step}/40 train_loss:4.0000 train_time:{(step - 10) * 100}ms",
            f"step:{step}/40 train_loss:4.0000 train_time:{70_000 + step}ms",
        )
    log.write_text(text)
    run = compare.parse_log(log)
    assert run.untimed_through == 20
    pyplot = LabelledPyplot()
    compare.plot_runs([run], 3.28, tmp_path / "p.png", pyplot)
    _, (train_x, _, _) = pyplot.axes.lines
    assert train_x[:20] == [0.0] * 20 and train_x[20:] == sorted(train_x[20:])


def test_a_resumed_runs_untimed_steps_are_left_out_of_the_plot(tmp_path):
    # resumed at step 20: its log starts there, and its first step compiles, untimed
    log = make_log(tmp_path / "a.txt", curve(3.3), 40, train_loss=lambda s: 4.0)
    head, steps = log.read_text().split("step:0/40 val_loss", 1)
    steps = ("step:0/40 val_loss" + steps).splitlines()
    kept = [s for s in steps if not s.startswith("step:") or int(s[5:].split("/")[0]) >= 20]
    log.write_text(head + "resumed from state.pt at step 20\n" + "\n".join(kept) + "\n")
    run = compare.parse_log(log)
    pyplot = LabelledPyplot()
    compare.plot_runs([run], 3.28, tmp_path / "p.png", pyplot)
    (val_x, _, _), (train_x, _, _) = pyplot.axes.lines
    assert val_x == pytest.approx([2.0, 3.0])
    assert train_x == pytest.approx([(s - 10) * 0.1 for s in range(22, 41)])
    assert "left out" in pyplot.axes.xlabel


def test_plot_draws_the_two_groups_apart(tmp_path, capsys, monkeypatch):
    pyplot = LabelledPyplot()
    monkeypatch.setattr(compare, "_import_pyplot", lambda: pyplot)
    group_logs(tmp_path / "a", [3.28, 3.27], train_loss=lambda s: 4.0)
    group_logs(tmp_path / "b", [3.26, 3.25])
    code, out, _ = run_main(
        capsys, tmp_path / "a", "--vs", tmp_path / "b", "--plot", tmp_path / "p.png"
    )
    assert code == 0 and f"plot written to {tmp_path / 'p.png'}" in out
    styles = [
        (style["label"], style.get("linestyle"), style.get("color"))
        for _, _, style in pyplot.axes.lines
    ]
    a_styles = {(ls, color) for label, ls, color in styles if label.startswith("run A")}
    b_styles = {(ls, color) for label, ls, color in styles if label.startswith("run B")}
    assert len(a_styles) == len(b_styles) == 1 and a_styles != b_styles
    # A: val and train of each run; B: val only
    assert len(styles) == 6


@pytest.mark.parametrize(
    "name,message",
    [
        ("missing/p.png", "there is no folder"),
        (
            "curves",
            "has no suffix, so its format is unknown: name the file with one (e.g. {path}.png)",
        ),
        ("curves.txt", "matplotlib cannot write .txt files; use one of .pdf, .png"),
    ],
)
def test_a_plot_that_cannot_be_written_is_refused_before_any_work(
    tmp_path, capsys, monkeypatch, name, message
):
    monkeypatch.setattr(compare, "_import_pyplot", lambda: LabelledPyplot())
    (tmp_path / "folder").mkdir()
    logs = group_logs(tmp_path / "logs", [3.28, 3.27])
    path = tmp_path / name
    code, out, err = run_main(capsys, *logs, "--plot", path)
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [err.strip()]
    assert err.startswith(f"error: --plot {path}") and message.format(path=path) in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "logs"]


def test_a_real_plot_of_two_groups_is_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    group_logs(tmp_path / "a", [3.28, 3.27], launch_ms=60_000)
    group_logs(tmp_path / "b", [3.26, 3.25])
    out_png = tmp_path / "p.png"
    code, _, err = run_main(capsys, tmp_path / "a", "--vs", tmp_path / "b", "--plot", out_png)
    assert code == 0, err
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "p.png"]


@pytest.mark.parametrize("target", ["nan", "inf"])
def test_a_target_that_is_not_a_loss_is_refused(tmp_path, capsys, target):
    logs = group_logs(tmp_path, [3.28, 3.27])
    code, out, err = run_main(capsys, *logs, "--target", target)
    assert code == 2 and out == ""
    assert err == f"error: --target {float(target)} is not a loss; give a number such as 3.28\n"
