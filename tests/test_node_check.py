"""records/node_check.py on CPU processes (gloo) at the smoke preset's tiny width: two fair ranks
pass; a rank slowed on purpose, and one whose weights are perturbed on purpose, are named (one
torchrun launch runs both checks); records/compare.py lists the check's log; the projection of a
smoke run is within 15% of that run's own train time."""
import contextlib
import io
import json
import re
import time

import helpers
import pytest
import torch

# the smoke preset at 6 blocks of width 16: a step of 128 tokens on each of 2 processes
TINY = ["--preset", "smoke", *helpers.TINY_MODEL, "--batch_size", "256", "--max_device_batch_size",
        "128", "--val_tokens", "256"]
CHECKS = {"fair": [], "faulty": ["--slow_rank", "1", "--perturb_rank", "1"]}
# each rank runs both checks, one after the other, in one launch
BOTH_CHECKS = """
import contextlib, io, json, os
node_check = helpers.load_records_script("node_check")
found = {{}}
for name, extra in {checks!r}.items():
    with contextlib.redirect_stdout(io.StringIO()) as out:
        code = node_check.main([*{options!r}, "--log_dir", os.path.join({folder!r}, name), *extra])
    found[name] = dict(code=code, stdout=out.getvalue())
with open(os.path.join({folder!r}, "rank" + os.environ["RANK"] + ".json"), "w") as f:
    json.dump(found, f)
helpers.exit_as_a_rank(0)
"""
VERDICT = re.compile(r"^node check: (.*)$", re.M)


def launch_both_checks(folder):
    options = ["--trainer", str(helpers.TRAINER), "--steps", "12", *TINY]
    script = folder / "both_checks.py"
    script.write_text(helpers.with_helpers(BOTH_CHECKS.format(checks=CHECKS, options=options,
                                                              folder=str(folder))))
    launch = helpers.torchrun(2, "--log-dir", folder / "ranks", "--redirects", "3", script)
    env = helpers.launch_env(OMP_NUM_THREADS="1")
    result = helpers.run_process(launch, 300, cwd=helpers.REPO, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.fixture
def checks(tmp_path_factory):
    """Each rank's exit code and stdout of each check, and the session folder of their logs."""
    folder, ranks = helpers.made_once(tmp_path_factory, "node_checks", launch_both_checks)
    return folder, ranks


def verdict(stdout):
    """The check's last line, which must be its verdict."""
    last = stdout.rstrip("\n").splitlines()[-1]
    assert VERDICT.match(last), stdout[-2000:]
    return last


@pytest.mark.slow
def test_two_fair_ranks_pass(checks):
    _, (rank0, rank1) = checks
    last = verdict(rank0["fair"]["stdout"])
    assert rank0["fair"]["code"] == 0 and rank1["fair"]["code"] == 0, last
    assert last.startswith("node check: fit; projected ") and "fault" not in last
    # the other rank prints nothing: one verdict
    assert rank1["fair"]["stdout"] == ""


def faults_named(checks):
    """What the faulty check's verdict names, which must fail it."""
    _, (rank0, _) = checks
    assert rank0["faulty"]["code"] == 1
    return verdict(rank0["faulty"]["stdout"]).split("; projected")[0]


@pytest.mark.slow
def test_a_slowed_rank_is_named(checks):
    faults = faults_named(checks)
    assert re.search(r"rank 1: slow alone, [\d.]+ ms a micro-batch against at most [\d.]+ ms",
                     faults)
    assert "rank 0: slow" not in faults


@pytest.mark.slow
def test_a_rank_whose_weights_are_perturbed_is_named(checks):
    faults = faults_named(checks)
    assert "rank 1: its weights after 3 steps differ from rank 0's" in faults
    assert "rank 0: its weights" not in faults


@pytest.mark.slow
def test_compare_lists_the_check_beside_training_runs(checks, smoke_runs, capsys):
    folder, (rank0, _) = checks
    (log,) = (folder / "fair").glob("node_check-*.txt")
    step_avg = re.search(r"step_avg ([\d.]+) ms", rank0["fair"]["stdout"])[1]
    run = smoke_runs.short(2)
    compare = helpers.load_records_script("compare")
    compare.main([str(log), str(run)])
    table = capsys.readouterr().out
    assert run.name in table
    row = next(line for line in table.splitlines() if log.name in line)
    assert f"{float(step_avg):.2f}" in row.split() and torch.__version__ in row.split()
    assert row.endswith("2 x cpu") and "12/12" in row.split()


def projection_and_train_time(tmp_path, attempt):
    """A node check on this process and then the smoke run it projects: (projected s, the run's
    train time in s)."""
    import train_gpt
    node_check = helpers.load_records_script("node_check")
    run = [*TINY, "--batch_size", "128", "--val_tokens", "128", "--num_iterations", "40"]
    with contextlib.redirect_stdout(io.StringIO()) as out:
        code = node_check.main(["--trainer", str(helpers.TRAINER), "--steps", "20", *run,
                                "--log_dir", str(tmp_path / f"check{attempt}")])
    assert code == 0, out.getvalue()[-2000:]
    projected = re.search(r"projected ([\d,.]+) s of timed training", out.getvalue())[1]
    logs = tmp_path / f"run{attempt}"
    with contextlib.redirect_stdout(io.StringIO()):
        assert train_gpt.main([*run, "--log_dir", str(logs)]) == 0
    lines, _ = helpers.step_lines(helpers.finished_log(logs))
    train_time = int(helpers.VAL_LINE.match(lines[-1])[4]) / 1000
    return float(projected.replace(",", "")), train_time


@pytest.mark.slow
def test_the_projection_of_a_smoke_run_is_within_15_percent_of_its_train_time(tmp_path,
                                                                             monkeypatch):
    # the check's clock and the trainer's both this process's CPU time, which other processes'
    # load leaves alone (on an idle machine, the wall clock's errors were -2.5% to +1%, measured);
    # a pair measured while they thrashed the caches is measured again
    monkeypatch.setattr(time, "perf_counter", time.process_time)
    pairs = []
    for attempt in range(3):
        projected, train_time = projection_and_train_time(tmp_path, attempt)
        pairs.append(f"{projected:.2f} s projected, {train_time:.2f} s run")
        if abs(projected / train_time - 1) <= 0.15:
            return
    pytest.fail("; ".join(pairs))
