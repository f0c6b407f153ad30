"""A rank killed mid-run (SIGKILL: the OOM killer, a lost node) under run.sh on two stand-in GPUs
(gloo on the CPU): the surviving rank ends with one line saying another process stopped answering,
rank 0's log ends with that line (not gloo's message), and run.sh's last line names the dead rank.

Run: `pytest tests/test_rank_death.py` (one two-process run, about a minute on two busy cores)."""
import os
import signal
import subprocess
import time

import pytest
from conftest import REPO
from conftest import finished_log
from test_launch import needs_no_gpu
from test_launch import run_sh_env
from test_resume import tiny

STOPPED_ANSWERING = "error: another process of the run stopped answering"


def worker_of_rank(parent, rank):
    """The process id of the torchrun worker of this rank among parent's children."""
    children = subprocess.run(["ps", "--ppid", str(parent), "-o", "pid="], capture_output=True,
                              text=True).stdout.split()
    for pid in children:
        with open(f"/proc/{pid}/environ", "rb") as f:
            if f"RANK={rank}".encode() in f.read().split(b"\0"):
                return int(pid)
    raise AssertionError(f"no worker of rank {rank} among {children}")


@pytest.mark.slow
@needs_no_gpu
def test_a_rank_killed_mid_run_leaves_one_line_on_the_survivor_and_names_the_dead_rank(
        markov_shards, tmp_path):
    env = run_sh_env(tmp_path / "bin", 2)
    options = tiny(markov_shards, tmp_path / "logs", "--num_iterations", "500", "--val_loss_every",
                   "0", "--allow_data_repeat", "true")
    # a session of its own: whatever is left is killed at the end
    proc = subprocess.Popen(["bash", str(REPO / "run.sh"), *options], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        for line in proc.stdout:
            if line.startswith("step:3/500 train_loss:"):
                break
        os.kill(worker_of_rank(proc.pid, 1), signal.SIGKILL)
        killed = time.monotonic()
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert time.monotonic() - killed < 120
    assert proc.returncode == 128 + signal.SIGKILL, err[-3000:]
    assert "Traceback" not in err and "Connection closed by peer" not in err, err[-3000:]
    lines = err.strip().splitlines()
    assert lines[-1] == ("run.sh: rank 1 ended by SIGKILL, without an error line of its own; its "
                         "output is above")
    survivor = lines[-2]
    assert survivor.startswith(f"{STOPPED_ANSWERING} (none left a line: killed, or its node lost")
    assert finished_log(tmp_path / "logs").read_text().splitlines()[-1] == survivor
