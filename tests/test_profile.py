"""records/profile_run.py: a real profiled run (its trace and its report in the log), and its options."""
import json
from dataclasses import asdict

import pytest
import torch

from conftest import load_records_script, smoke_marked
from test_end_to_end import val_losses
from train_gpt import Hyperparameters

compare, profile_run = load_records_script("compare"), load_records_script("profile_run")


@smoke_marked(("head", False))
def test_profiled_run_writes_a_trace_and_the_top_ops_table_into_its_log(smoke_runs):
    log = smoke_runs.head(fused=False)  # 2 steps through the tool, --steps 1
    trace = log.with_suffix(".trace.json")
    assert f"trace for Perfetto or chrome://tracing: {trace}" in smoke_runs.stdout["head_plain_1proc"]
    events = json.loads(trace.read_text())["traceEvents"]
    # exactly one train step was recorded, the second: min(12, 2 - 1) = 1 step of warm-up
    assert sum(e.get("name", "").startswith("ProfilerStep#") for e in events) == 1
    assert any(e.get("name") == "Optimizer.step#Muon.step" for e in events)
    profile = [line for line in log.read_text().splitlines() if line.startswith("profile: ")]
    assert profile[0].startswith("profile: 1 train step(s) after the first 1 of this process ran under")
    assert any("Name" in line and "Self CPU" in line for line in profile[1:])
    losses = val_losses(log)  # the step lines and the closing memory line keep the log's fixed format
    assert sorted(losses) == [0, 2] and losses[2] < losses[0]
    run = compare.parse_log(log)  # the record tool still reads the log
    assert run.final_loss == losses[2] and run.peak_mib > 0


def test_options_other_than_steps_go_to_the_trainer():
    ours, trainer = profile_run.parse_args(["--steps", "3", "--preset", "smoke", "--step", "1"])
    assert ours.steps == 3 and trainer == ["--preset", "smoke", "--step", "1"]  # no abbreviations
    ours, trainer = profile_run.parse_args(["--num_iterations", "5"])
    assert ours.steps == 1 and trainer == ["--num_iterations", "5"]


def test_fewer_than_one_step_is_refused(capsys):
    with pytest.raises(SystemExit):
        profile_run.parse_args(["--steps", "0"])
    assert "--steps must be at least 1; got 0" in capsys.readouterr().err


def test_a_resumed_runs_options_come_from_its_checkpoint_unless_given(tmp_path):
    checkpoint = tmp_path / "state_step000004.pt"
    torch.save(dict(args=asdict(Hyperparameters(num_iterations=7, log_dir=str(tmp_path / "x")))), checkpoint)
    args = profile_run.trainer_options(["--resume", str(checkpoint), "--log_dir", str(tmp_path / "y")])
    assert args.num_iterations == 7 and args.log_dir == str(tmp_path / "y")
    missing = profile_run.trainer_options(["--resume", str(tmp_path / "missing.pt")])  # the trainer refuses it
    assert missing.num_iterations == Hyperparameters().num_iterations
