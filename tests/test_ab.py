"""Tests for records/ab.py: the B/A verdict, alternation, whose flags win, the printed numbers,
failures, stops passed on to the run, and one real A/B of the smoke preset.

    python -m pytest tests/test_ab.py -q
"""

import math
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO
from helpers import TRAINER
from helpers import launch_env
from helpers import load_records_script
from helpers import run_process
from helpers import started

SCRIPT = REPO / "records" / "ab.py"

ab = load_records_script("ab")

# A stand-in trainer that writes a log in the trainer's format in a few milliseconds. Each run
# appends its --tag to the --order file; the run's number (lines already there) shifts its
# ms/step, startup and peak memory, so that no two runs print the same figures. With --stop_with
# SIG, it sends SIG to ab.py as `kill` would (TERM) or a terminal (INT, HUP: to its process group),
# then stops as the trainer does on its own stop signal: after its step (half a second), its stop
# line, its checkpoint, exit code 128 + the signal; then 30 lines more, as torchrun's report of the
# signal follows its workers' stop lines.
FAKE_TRAINER = """\
import argparse, os, signal, sys, time, uuid
from pathlib import Path

p = argparse.ArgumentParser()
for name in ("--tag", "--order", "--log_dir", "--fail", "--stop_with", "--seed"):
    p.add_argument(name, default="")
p.add_argument("--ms", type=float, default=100.0)
p.add_argument("--num_iterations", type=int, default=20)
a = p.parse_args()
order = Path(a.order)
k = len(order.read_text().split()) if order.exists() else 0
with open(order, "a") as f:
    f.write(a.tag + "\\n")
print("loading data", flush=True)
if a.tag == a.fail:
    sys.exit("boom: out of memory")
if a.stop_with:
    received = []
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda signum, frame: received.append(signum))
    stop = getattr(signal, "SIG" + a.stop_with)
    if stop == signal.SIGTERM:
        os.kill(os.getppid(), stop)
    else:
        os.killpg(os.getpgid(os.getppid()), stop)
    deadline = time.monotonic() + 30
    while not received and time.monotonic() < deadline:
        time.sleep(0.05)
    if not received:
        sys.exit("no stop signal came")
    time.sleep(0.5)
    Path(a.log_dir).mkdir(parents=True, exist_ok=True)
    (Path(a.log_dir) / "checkpoint.pt").write_text("state")
    name = signal.Signals(received[0]).name
    print(f"stopped by {name} after step 3; resume with: python x --resume y", file=sys.stderr)
    print("\\n".join(f"  launcher line {i}" for i in range(30)), file=sys.stderr)
    sys.exit(128 + received[0])
n = a.num_iterations
ms = a.ms + 0.37 * k
lines = ["fake source", "=" * 100, "devices: 1 x cpu", "=" * 100, "hyperparameters:",
         f"  seed = {a.seed}", "=" * 100]
for step in range(n + 1):
    timed = max(step - 10, 0)
    times = f"train_time:{timed * ms:.0f}ms step_avg:{ms if timed else float('nan'):.2f}ms"
    if step in (0, n):
        lines.append(f"step:{step}/{n} val_loss:{3.3 + 0.001 * k:.4f} {times}")
    if step < n:
        timed = max(step + 1 - 10, 0)
        avg = ms if timed else float("nan")
        lines.append(f"step:{step + 1}/{n} train_time:{timed * ms:.0f}ms step_avg:{avg:.2f}ms")
    if step == 0:
        lines.append(f"startup: {2.5 + k:.1f}s from launch to the end of step 1")
lines.append(f"peak memory consumption: {1000 + k} MiB")
Path(a.log_dir).mkdir(parents=True, exist_ok=True)
(Path(a.log_dir) / f"{uuid.uuid4()}.txt").write_text("\\n".join(lines) + "\\n")
"""

ROW = re.compile(r"^([AB]\d+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)$")


def figures_from_log(log_dir):
    """(step_avg, peak MiB, startup s, final val loss, seed) read from a run's log, independently
    of compare.py: the last step's val line, the startup and peak memory lines, the seed option."""
    (log,) = Path(log_dir).glob("*.txt")
    # the source skipped
    body = log.read_text().split("=" * 100 + "\n", 1)[1]
    last_val = r"^step:(\d+)/\1 val_loss:(\S+) train_time:\d+ms step_avg:(\S+)ms$"
    final = re.findall(last_val, body, re.M)
    peak = re.search(r"^peak memory consumption: (\d+) MiB$", body, re.M)
    startup = re.search(r"^startup: ([\d.]+)s from launch", body, re.M)
    seed = re.search(r"^  seed = (\d+)$", body, re.M)
    (_, loss, avg) = final[-1]
    return float(avg), int(peak[1]), float(startup[1]), float(loss), int(seed[1])


def rows_of(out):
    return {m[1]: m.groups()[1:] for line in out.splitlines() if (m := ROW.match(line))}


def pair_ratios(out_dir, runs):
    """B/A of step_avg for each pair of runs, and their mean, computed from the logs."""
    ratios = [
        figures_from_log(out_dir / f"B{i}")[0] / figures_from_log(out_dir / f"A{i}")[0]
        for i in range(1, runs + 1)
    ]
    mean = sum(ratios) / len(ratios)
    return ratios, mean


@pytest.fixture
def fake(tmp_path):
    script = tmp_path / "fake_trainer.py"
    script.write_text(FAKE_TRAINER)
    return script


# ------------------------------------------------------------------------ the verdict


@pytest.mark.parametrize(
    "ratios,expected",
    [
        ([0.98, 0.99, 0.985], "B faster"),
        ([1.01, 1.03], "B slower"),
        ([0.99, 1.01], "within noise"),
        # a pair with no difference at all
        ([1.0, 0.97], "within noise"),
        ([0.97], "no spread"),
    ],
)
def test_verdict(ratios, expected):
    assert ab.verdict(ratios) == expected


def test_ratio_line():
    assert (
        ab.ratio_line([100.0, 200.0], [98.0, 198.0])
        == "B/A step_avg: mean 0.9850 over 2 pairs, 0.9800..0.9900: B faster"
    )
    assert ab.ratio_line([100.0, 100.0], [99.0, 102.0]).endswith("0.9900..1.0200: within noise")
    one = ab.ratio_line([100.0], [103.0])
    assert one.startswith("B/A step_avg: 1.0300 from one pair") and "no spread" in one
    # runs of 10 steps or fewer
    assert "n/a" in ab.ratio_line([math.nan, 100.0], [100.0, 100.0])


def test_command_lines(tmp_path):
    side = ["train_gpt.py", "--regional_compile", "true"]
    common = ["--num_iterations", "60"]
    one = ab.command(side, common, 1, tmp_path / "A1", seed=0)
    # the side's own flags after those for both: the last of a flag given twice counts
    assert one == [sys.executable, "train_gpt.py", "--seed", "0", *common, "--regional_compile",
                   "true", "--log_dir", str(tmp_path / "A1")]
    # a --seed of the user's comes after the pair's, and wins
    assert ab.command(["x.py"], ["--seed", "7"], 1, tmp_path / "A2", seed=1)[2:6] == [
        "--seed", "1", "--seed", "7"]
    eight = ab.command(side, common, 8, tmp_path / "B1", seed=0)
    assert eight[:6] == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=8",
        "train_gpt.py",
    ]


# ------------------------------------------------------------------ with a fake trainer


@pytest.mark.slow
def test_alternates_and_prints_the_logs_figures(fake, tmp_path, capsys, monkeypatch):
    # no GPU: one plain process per run
    monkeypatch.setattr(ab, "visible_gpus", lambda: 0)
    order = tmp_path / "order.txt"
    out = tmp_path / "out"
    code = ab.main(
        [f"{fake} --tag A", f"{fake} --tag B --ms 90", "--runs", "3", "--out", str(out),
         "--", "--order", str(order), "--num_iterations", "14"]
    )
    stdout = capsys.readouterr().out
    assert code == 0
    assert order.read_text().split() == ["A", "B"] * 3
    labels = ["A1", "B1", "A2", "B2", "A3", "B3"]
    # one fresh log_dir each
    assert sorted(p.name for p in out.iterdir()) == sorted(labels)

    rows = rows_of(stdout)
    assert list(rows) == labels
    for label in labels:
        avg, peak, startup, loss, seed = figures_from_log(out / label)
        assert rows[label] == (str(seed), f"{avg:.2f}", str(peak), f"{startup:.1f}", f"{loss:.4f}")
        assert (out / label / "console.log").read_text() == "loading data\n"
        # each pair its own seed, the same for both sides
        assert seed == int(label[1:]) - 1
    # 14 steps, the first 10 untimed
    assert "warning: only 4 steps of a run were timed" in stdout

    ratios, mean = pair_ratios(out, 3)
    # 90 + small against 100 + small
    assert all(r < 1 for r in ratios)
    last = stdout.strip().splitlines()[-1]
    assert last == (
        f"B/A step_avg: mean {mean:.4f} over 3 pairs, "
        f"{min(ratios):.4f}..{max(ratios):.4f}: B faster"
    )


@pytest.mark.slow
def test_a_failing_run_stops_with_a_clear_error(fake, tmp_path):
    order = tmp_path / "order.txt"
    out = tmp_path / "out"
    proc = run_process(
        [sys.executable, str(SCRIPT), f"{fake} --tag A", f"{fake} --tag B --fail B",
         "--nproc", "1", "--out", str(out), "--", "--order", str(order)],
        60, env=launch_env(),
    )
    assert proc.returncode == 1
    # nothing runs after the failure
    assert order.read_text().split() == ["A", "B"]
    first = proc.stderr.splitlines()[0]
    assert first.startswith("error: B1 failed with exit code 1: ")
    assert f"{fake} --seed 0 --order {order} --tag B --fail B --log_dir {out / 'B1'}" in first
    assert "boom: out of memory" in proc.stderr and "loading data" in proc.stderr
    assert f"logs kept in {out}" in proc.stderr and "Traceback" not in proc.stderr
    # the finished run's log stays
    assert len(list((out / "A1").glob("*.txt"))) == 1


def synthetic_run(planned, untimed_through):
    return ab.runlog.Run(path=Path("A1/x.txt"), planned=planned, steps_done=planned,
                         untimed_through=untimed_through)


def test_too_few_timed_steps_are_warned():
    # the trainer's first 10 steps are untimed: 60 steps time 50, 59 time 49
    assert ab.timing_warning([synthetic_run(60, 10), synthetic_run(60, 10)]) is None
    warning = ab.timing_warning([synthetic_run(60, 10), synthetic_run(59, 10)])
    assert warning.startswith("warning: only 49 steps of a run were timed (the trainer's first 10 "
                              "are not)")
    assert warning.endswith("give --num_iterations 60 or more")
    assert "only 2 steps" in ab.timing_warning([synthetic_run(12, 10)] * 2)


def test_bad_arguments_are_errors_before_any_run(fake, tmp_path, capsys):
    assert ab.main(["missing.py", str(fake), "--nproc", "1"]) == 2
    assert "A must begin with an existing script" in capsys.readouterr().err
    used = tmp_path / "used"
    (used / "A1").mkdir(parents=True)
    assert ab.main([str(fake), str(fake), "--nproc", "1", "--out", str(used)]) == 2
    assert "is not empty" in capsys.readouterr().err


def test_an_out_that_is_not_a_folder_is_one_line(fake, tmp_path, capsys):
    taken = tmp_path / "notes.txt"
    taken.write_text("mine")
    assert ab.main([str(fake), str(fake), "--nproc", "1", "--out", str(taken)]) == 2
    assert capsys.readouterr().err == (
        f"error: --out {taken} is not a folder; give a new --out folder\n"
    )
    assert taken.read_text() == "mine"


@pytest.mark.parametrize("place", ["{file}/runs", "/proc/no_such_folder/runs"])
def test_an_out_that_cannot_be_made_is_one_line_before_any_run(fake, tmp_path, capsys, place):
    if place.startswith("/proc") and not sys.platform.startswith("linux"):
        pytest.skip("/proc is Linux's")
    (tmp_path / "notes.txt").write_text("mine")
    out = place.format(file=tmp_path / "notes.txt")
    assert ab.main([str(fake), str(fake), "--nproc", "1", "--out", out]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"error: --out {out} cannot be made or written to (")
    assert captured.err.count("\n") == 1 and captured.out == ""
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_an_unbalanced_quote_is_one_line_naming_the_side_before_any_run(fake, tmp_path, capsys):
    out = tmp_path / "out"
    b = f'{fake} --tag "B'
    code = ab.main([str(fake), b, "--nproc", "1", "--out", str(out)])
    assert code == 2
    captured = capsys.readouterr()
    assert captured.err == (
        f"error: B cannot be split as a shell would (no closing quotation): {b!r}; fix its quotes\n"
    )
    assert captured.out == "" and not out.exists()


def test_an_out_another_ab_took_meanwhile_is_one_line_before_any_run(
    fake, tmp_path, capsys, monkeypatch
):
    """Two A/Bs found --out empty at once; the other made its first run's folder first."""
    out = tmp_path / "out"
    order = tmp_path / "order.txt"
    make_temporary_file = ab.tempfile.TemporaryFile

    def other_ab_meanwhile(*args, **kwargs):
        (out / "A1").mkdir(exist_ok=True)
        return make_temporary_file(*args, **kwargs)

    monkeypatch.setattr(ab.tempfile, "TemporaryFile", other_ab_meanwhile)
    code = ab.main([str(fake), str(fake), "--nproc", "1", "--out", str(out), "--",
                    "--order", str(order)])
    assert code == 2
    assert capsys.readouterr().err == (
        f"error: another A/B took --out {out} meanwhile; give each A/B its own --out folder\n"
    )
    assert not order.exists()


def test_abs_started_in_one_second_write_to_folders_of_their_own(
    fake, tmp_path, capsys, monkeypatch
):
    """The default --out, logs/ab-<timestamp>-<process id>, of two A/B processes."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(ab.time, "strftime", lambda fmt: fmt.replace("%Y%m%d-%H%M%S", "same"))
    for pid in (111, 222):
        monkeypatch.setattr(ab.os, "getpid", lambda: pid)
        code = ab.main([f"{fake} --tag A", f"{fake} --tag B", "--runs", "1", "--nproc", "1",
                        "--", "--order", "order.txt"])
        assert code == 0, capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["ab-same-111", "ab-same-222"]
    assert Path("order.txt").read_text().split() == ["A", "B", "A", "B"]


@pytest.mark.slow
@pytest.mark.parametrize("stdout", ["closed pipe", "full disk"])
def test_stdout_that_goes_away_never_ends_the_ab(fake, tmp_path, stdout):
    """Its reader gone (`| head -1`) or its disk full: every run still runs, no traceback."""
    if stdout == "full disk" and not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    order = tmp_path / "order.txt"
    command = [sys.executable, str(SCRIPT), f"{fake} --tag A", f"{fake} --tag B", "--nproc", "1",
               "--out", str(tmp_path / "out"), "--", "--order", str(order)]
    if stdout == "full disk":
        with open("/dev/full", "w") as full:
            proc = subprocess.run(command, stdout=full, stderr=subprocess.PIPE, text=True,
                                  env=launch_env(), timeout=60)
        stderr = proc.stderr
    else:
        with started(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                     env=launch_env()) as process:
            # closed before ab.py has printed a line
            process.stdout.close()
            stderr = process.stderr.read()
            process.wait(60)
    assert order.read_text().split() == ["A", "B", "A", "B"]
    assert "Traceback" not in stderr and "Error" not in stderr, stderr
    # a full disk is said once; a reader that has gone needs no word
    dropped = "warning: stdout cannot be written (No space left on device): what follows is dropped"
    assert stderr.count(dropped) == (stdout == "full disk"), stderr


# ------------------------------------------------------------------- whose flags, and stops


@pytest.mark.slow
def test_a_sides_own_flags_win_over_those_for_both(fake, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ab, "visible_gpus", lambda: 0)
    order = tmp_path / "order.txt"
    # B abbreviates its flag, as the trainer's options allow: still B's own
    code = ab.main([f"{fake} --tag A", f"{fake} --ta B", "--runs", "1", "--out",
                    str(tmp_path / "out"), "--", "--tag", "both", "--order", str(order)])
    assert code == 0, capsys.readouterr().err
    assert order.read_text().split() == ["A", "B"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["TERM", "INT", "HUP"])
def test_a_stop_reaches_the_run_which_stops_itself(fake, tmp_path, name):
    """SIGTERM to ab.py (kill), SIGINT and SIGHUP to its process group (Ctrl-C, a closed
    terminal): the run gets the signal once and ab.py waits for it to stop itself, its stop line
    and checkpoint written, then says so; no run starts after it."""
    order = tmp_path / "order.txt"
    out = tmp_path / "out"
    proc = run_process(
        [sys.executable, str(SCRIPT), f"{fake} --tag A --stop_with {name}", f"{fake} --tag B",
         "--nproc", "1", "--out", str(out), "--", "--order", str(order)],
        60, env=launch_env(),
    )
    signum = getattr(signal, f"SIG{name}")
    assert proc.returncode == 128 + signum, proc.stderr
    # written half a second after the signal reached it, before it ended
    assert (out / "A1" / "checkpoint.pt").read_text() == "state"
    assert order.read_text().split() == ["A"]
    stop_line = f"stopped by SIG{name} after step 3; resume with: python x --resume y"
    assert proc.stderr.splitlines()[-1] == (
        f"stopped by SIG{name} during A1, which ended with exit code {128 + signum}: "
        f"{stop_line}; logs kept in {out}"
    )
    assert stop_line in (out / "A1" / "console.log").read_text().splitlines()


# ----------------------------------------------------------------- a real smoke A/B


@pytest.mark.slow
def test_real_smoke_ab(tmp_path):
    """One run each of the trainer's smoke preset, shrunk to the fewest steps with a timed one (11:
    timing starts after step 10) of one 128-token block through 6 layers of width 16. B's option is
    one that compiles nothing on a CPU (regional compilation would add seconds of inductor)."""
    small = ["--preset", "smoke", "--num_iterations", "11", "--val_loss_every", "0",
             "--num_layers", "6", "--model_dim", "16", "--num_heads", "1", "--batch_size", "128",
             "--max_device_batch_size", "128", "--val_tokens", "128"]
    out = tmp_path / "out"
    # one thread: on a shared CPU, more threads than free cores make a run many times slower
    # the trainer under test on both sides
    side_b = f"{shlex.quote(str(TRAINER))} --fused_head_loss false"
    proc = run_process(
        [sys.executable, str(SCRIPT), str(TRAINER), side_b, "--runs", "1", "--nproc", "1", "--out",
         str(out), "--", *small],
        300, cwd=REPO, env=launch_env(OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = rows_of(proc.stdout)
    assert list(rows) == ["A1", "B1"]
    for label in rows:
        avg, peak, startup, loss, seed = figures_from_log(out / label)
        assert rows[label] == (str(seed), f"{avg:.2f}", str(peak), f"{startup:.1f}", f"{loss:.4f}")
        assert math.isfinite(avg) and startup > 0
    (ratio,), _ = pair_ratios(out, 1)
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith(f"B/A step_avg: {ratio:.4f} from one pair")
