"""What the trainer deletes: only its own files (its own temp files of interrupted writes, once no process owns
them)."""
import os
import socket
import subprocess
import uuid

import pytest
import torch

import train_gpt
from conftest import finished_log
from test_resume import tiny

HOST = socket.gethostname()


def dead_pid():
    """The id of a process that has ended (reaped, so no process has it until the system reuses it)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def temp_name(path, pid, host=HOST):
    """The name the trainer writes PATH's data under before renaming it into place."""
    return f"{path}.{host}.{pid}.tmp"


@pytest.fixture(scope="module")
def run_among_user_files(markov_shards, tmp_path_factory):
    """A 4-step run checkpointing every step, into a log folder holding a user's files and the temp files of
    interrupted writes; returns the log folder, the run's checkpoint folder, and the planted files, by kind."""
    log_dir = tmp_path_factory.mktemp("crowded")
    run_id = uuid.UUID(int=28)
    run_folder = log_dir / str(run_id)
    run_folder.mkdir()
    user = [run_folder / "state_step000400_best.pt", run_folder / "state_step000000.pt",
            run_folder / "state_step000001.pt.bak", run_folder / "notes.txt"]
    other_run = log_dir / str(uuid.UUID(int=7))
    other_run.mkdir()
    dead = dead_pid()
    cache = log_dir / "compile.cache"
    stale = [temp_name(other_run / "state_step000004.pt", dead), temp_name(cache, dead),
             temp_name(log_dir / "synthetic-seed0" / "synthetic_train_000001.bin", dead)]
    # owned by a live process, by another machine's process, unstamped, or not a name the trainer writes
    kept = [temp_name(other_run / "state_step000005.pt", os.getppid()),
            temp_name(other_run / "state_step000006.pt", dead, host=f"not-{HOST}"),
            other_run / "state_step000007.pt.tmp", temp_name(other_run / "notes.txt", dead),
            temp_name(log_dir / "state_step000004.pt", dead)]
    for path in user + stale + kept:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(f"{path}: a user's\n")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train_gpt.uuid, "uuid4", lambda: run_id)
        code = train_gpt.main(tiny(markov_shards, log_dir, "--num_iterations", "4", "--val_loss_every", "0",
                                   "--checkpoint_every", "1", "--compile_cache", str(cache)))
    torch.set_num_threads(threads)
    assert code == 0
    return log_dir, run_folder, dict(user=user, stale=stale, kept=kept)


def test_stale_temp_files_are_removed_only_when_the_trainer_wrote_them_and_their_process_is_gone(
        run_among_user_files):
    log_dir, _, planted = run_among_user_files
    assert not any(os.path.exists(path) for path in planted["stale"])
    for path in planted["kept"]:
        assert open(path).read() == f"{path}: a user's\n"
    line = next(line for line in finished_log(log_dir).read_text().splitlines() if line.startswith("removed "))
    assert line.startswith("removed 3 temp files of interrupted writes: ")
    assert all(str(path) in line for path in planted["stale"])
