"""records/profile_run.py: a real profiled run (its trace and its report in the log), and its
options."""

import json
import os
import re
import time
import warnings
from dataclasses import asdict

import pytest
import torch
from helpers import load_records_script
from helpers import tiny
from torch.optim.optimizer import register_optimizer_step_post_hook

from train_gpt import Hyperparameters

compare = load_records_script("compare")
profile_run = load_records_script("profile_run")

VAL_LINE = re.compile(r"^step:(\d+)/\d+ val_loss:(\d+\.\d{4}) train_time:\d+ms step_avg:\S+ms$")
TRAIN_LINE = re.compile(r"^step:\d+/\d+ train_loss:\d+\.\d{4} train_time:\d+ms step_avg:\S+ms$")
STARTUP_LINE = re.compile(r"^startup: \d+\.\ds from launch to the end of step \d+")


def val_losses(log):
    """Val loss by step; the lines after the header, but the profile's and the checkpoint's, are
    step lines, the startup line and the closing memory line, in the trainer's fixed format."""
    lines = log.read_text().splitlines()
    after_options = lines[lines.index("hyperparameters:") :]
    body = [line for line in after_options if not line.startswith(("profile: ", "checkpoint: "))]
    body = body[body.index("=" * 100) + 1 :]
    assert re.fullmatch(r"peak memory consumption: \d+ MiB", body[-1])
    losses = {}
    for line in body[:-1]:
        if m := VAL_LINE.match(line):
            losses[int(m[1])] = float(m[2])
        else:
            parses = TRAIN_LINE.match(line) or STARTUP_LINE.match(line)
            assert parses, f"line does not parse: {line!r}"
    return losses


@pytest.mark.slow
def test_profiled_run_writes_a_trace_and_the_top_ops_table_into_its_log(smoke_runs):
    """The session's 1-process short run (4 steps) goes through the tool with --steps 1."""
    log = smoke_runs.short(1)
    trace = log.with_suffix(".trace.json")
    stdout = smoke_runs.profiled()["stdout"]
    assert f"trace for Perfetto or chrome://tracing: {trace}" in stdout
    events = json.loads(trace.read_text())["traceEvents"]
    # exactly one train step was recorded, the last: min(12, 4 - 1) = 3 steps of warm-up
    assert sum(e.get("name", "").startswith("ProfilerStep#") for e in events) == 1
    assert any(e.get("name") == "Optimizer.step#Muon.step" for e in events)
    profile = [line for line in log.read_text().splitlines() if line.startswith("profile: ")]
    first = "profile: 1 train step(s) after the first 3 of this process ran under"
    assert profile[0].startswith(first)
    assert any("Name" in line and "Self CPU" in line for line in profile[1:])
    # the step lines and the closing memory line keep the log's fixed format
    losses = val_losses(log)
    assert sorted(losses) == [0, 2, 4] and losses[4] < losses[0]
    # the record tool still reads the log
    run = compare.parse_log(log)
    assert run.final_loss == losses[4] and run.peak_mib > 0


def test_options_other_than_steps_go_to_the_trainer():
    ours, trainer = profile_run.parse_args(["--steps", "3", "--preset", "smoke", "--step", "1"])
    # no abbreviations
    assert ours.steps == 3 and trainer == ["--preset", "smoke", "--step", "1"]
    ours, trainer = profile_run.parse_args(["--num_iterations", "5"])
    assert ours.steps == 1 and trainer == ["--num_iterations", "5"]


def test_fewer_than_one_step_is_refused(capsys):
    with pytest.raises(SystemExit):
        profile_run.parse_args(["--steps", "0"])
    assert "--steps must be at least 1; got 0" in capsys.readouterr().err


def test_a_resumed_runs_options_come_from_its_checkpoint_unless_given(tmp_path):
    checkpoint = tmp_path / "state_step000004.pt"
    saved = Hyperparameters(num_iterations=7, log_dir=str(tmp_path / "x"))
    torch.save(dict(args=asdict(saved)), checkpoint)
    argv = ["--resume", str(checkpoint), "--log_dir", str(tmp_path / "y")]
    args, start = profile_run.trainer_options(argv)
    assert args.num_iterations == 7 and args.log_dir == str(tmp_path / "y")
    # no step saved: the trainer refuses it
    assert start == 0
    torch.save(dict(args=asdict(saved), step=4), checkpoint)
    assert profile_run.trainer_options(argv)[1] == 4
    # the trainer refuses it
    missing, start = profile_run.trainer_options(["--resume", str(tmp_path / "missing.pt")])
    assert missing.num_iterations == Hyperparameters().num_iterations and start == 0


# ------------------------------------------------------------- its own log, resumed, failed


def profile_lines(log):
    return [line for line in log.read_text().splitlines() if line.startswith("profile: ")]


@pytest.mark.slow
def test_a_resumed_run_profiles_the_steps_it_has_left_into_its_own_log(markov_shards, tmp_path,
                                                                       capsys):
    """Resumed at step 2 of 4: 2 train steps left, the first warms up, the second is profiled; the
    log of another run appears in the same --log_dir meanwhile, newer than this run's."""
    import train_gpt

    first = tiny(markov_shards, tmp_path / "first", "--num_iterations", "4", "--checkpoint_every",
                 "2")
    assert train_gpt.main(first) == 0
    (checkpoint,) = (tmp_path / "first").glob("*/state_step000002.pt")
    log_dir = tmp_path / "resumed"
    other = log_dir / "11111111-2222-3333-4444-555555555555.txt"

    def other_run_writes(optimizer, args, kwargs):
        if not other.exists():
            other.write_text("another run's log\n")
            # written after this run's last line
            os.utime(other, (time.time() + 3600, time.time() + 3600))

    hook = register_optimizer_step_post_hook(other_run_writes)
    try:
        argv = ["--steps", "1", "--resume", str(checkpoint), "--log_dir", str(log_dir)]
        code = profile_run.main(argv)
    finally:
        hook.remove()
    assert code == 0, capsys.readouterr().err
    assert other.read_text() == "another run's log\n"
    (log,) = set(log_dir.glob("*.txt")) - {other}
    assert profile_lines(log)[0].startswith("profile: 1 train step(s) after the first 1 ")
    assert log.with_suffix(".trace.json").exists()


@pytest.mark.parametrize(
    "trainer_argv,env,last_line",
    [
        (["--num_iterations", "-4"], {}, "error: --num_iterations must be at least 1; got -4"),
        (["--resume", "missing.pt"], {}, "error: --resume 'missing.pt': cannot read it"),
        ([], {"RANK": ""}, "error: RANK='' set in the environment, but this process was not"),
    ],
)
def test_a_run_the_trainer_refuses_ends_with_its_error_line(
    tmp_path, capsys, monkeypatch, trainer_argv, env, last_line
):
    """No profile line after it, and no warning of torch's about the profiler's schedule."""
    monkeypatch.chdir(tmp_path)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = profile_run.main(["--steps", "2", "--preset", "smoke", *trainer_argv])
    assert code == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith(last_line) and "profile: " not in err
    assert not [w for w in caught if "warmup" in str(w.message)]
