"""records/profile_run.py: a real profiled run (its trace and its report in the log), and its
options."""

import json
import re
from dataclasses import asdict

import pytest
import torch
from helpers import load_records_script

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
    stdout = smoke_runs.profiled_stdout()
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
    args = profile_run.trainer_options(argv)
    assert args.num_iterations == 7 and args.log_dir == str(tmp_path / "y")
    # the trainer refuses it
    missing = profile_run.trainer_options(["--resume", str(tmp_path / "missing.pt")])
    assert missing.num_iterations == Hyperparameters().num_iterations
