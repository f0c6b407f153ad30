"""What the trainer writes and deletes: only its own files (checkpoints of its own rotation), and a
full disk is one line, never a lost run."""
import os
import signal
import subprocess
import sys
import uuid

import pytest
import torch
from helpers import REPO
from helpers import TRAINER
from helpers import finished_log
from helpers import launch_env
from helpers import ranks_of
from helpers import run_process
from helpers import small_shards
from helpers import tiny
from helpers import tiny_run
from helpers import torchrun
from helpers import with_trainer

import train_gpt

# steps of one 128-token sequence, validated on one: the runs here are about files, not the maths
ONE_MICRO_BATCH = ["--batch_size", "128", "--val_tokens", "128"]


@pytest.fixture(scope="module")
def run_among_user_files(markov_shards, tmp_path_factory):
    """A 3-step run checkpointing every step, into a log folder holding a user's files; returns the
    log folder, the run's checkpoint folder, and the user's files."""
    log_dir = tmp_path_factory.mktemp("crowded")
    run_id = uuid.UUID(int=28)
    run_folder = log_dir / str(run_id)
    run_folder.mkdir()
    user = [run_folder / "state_step000400_best.pt", run_folder / "state_step000000.pt",
            run_folder / "state_step000001.pt.bak", run_folder / "notes.txt"]
    for path in user:
        path.write_text(f"{path}: a user's\n")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train_gpt.uuid, "uuid4", lambda: run_id)
        # one 128-token micro-batch a step: what is written is what counts
        code = train_gpt.main(tiny(markov_shards, log_dir, "--num_iterations", "3",
                                   "--val_loss_every", "0", *ONE_MICRO_BATCH,
                                   "--checkpoint_every", "1"))
    torch.set_num_threads(threads)
    assert code == 0
    return log_dir, run_folder, user


@pytest.mark.slow
def test_checkpoint_rotation_deletes_only_the_checkpoints_this_run_wrote(run_among_user_files):
    _, run_folder, user = run_among_user_files
    for path in user:
        assert path.read_text() == f"{path}: a user's\n"
    ours = {"state_step000002.pt", "state_step000003.pt"}  # of 1 to 3, the last two
    assert {p.name for p in run_folder.iterdir()} == ours | {p.name for p in user}


def at_step(monkeypatch, actions):
    """Run actions[step]() just before the stop check of that step."""
    agreed = train_gpt.CleanStop.agreed

    def with_action(self, step):
        actions.get(step, lambda: None)()
        return agreed(self, step)

    monkeypatch.setattr(train_gpt.CleanStop, "agreed", with_action)


@pytest.fixture
def small_filesystem(tmp_path):
    """A 100 MiB tmpfs (which needs root): room for three checkpoints of the tiny model, 28 MiB
    each."""
    folder = tmp_path / "small"
    folder.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=100m", "tmpfs", str(folder)]
    mounted = subprocess.run(mount, capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here: {mounted.stderr.decode().strip()}")
    yield folder
    subprocess.run(["umount", str(folder)], check=True)


def fill(folder, spare):
    """Fill folder's filesystem up to `spare` free bytes."""
    usage = os.statvfs(folder)
    with open(os.path.join(folder, "filler"), "wb") as f:
        os.posix_fallocate(f.fileno(), 0, usage.f_bavail * usage.f_frsize - spare)


@pytest.mark.slow
def test_a_checkpoint_the_disk_has_no_room_for_is_one_warning_and_training_goes_on(
        small_filesystem, markov_shards, capsys, monkeypatch):
    """The disk fills before step 3's checkpoint; SIGTERM at step 4, whose checkpoint fails too: the
    stop line points at step 2's, which stays."""
    log_dir = small_filesystem / "logs"
    at_step(monkeypatch, {3: lambda: fill(small_filesystem, 256 * 1024),
                          4: lambda: signal.raise_signal(signal.SIGTERM)})
    code = train_gpt.main(tiny(markov_shards, log_dir, "--checkpoint_every", "1",
                               "--val_loss_every", "0", *ONE_MICRO_BATCH))
    assert code == 128 + signal.SIGTERM
    log = finished_log(log_dir)
    folder = log_dir / log.stem
    kept = ["state_step000001.pt", "state_step000002.pt"]
    assert sorted(p.name for p in folder.iterdir()) == kept
    err = capsys.readouterr().err.splitlines()
    lines = log.read_text().splitlines()
    for step in (3, 4):
        warning = (f"warning: the checkpoint of step {step} could not be written (No space left "
                   f"on device: free some space in {log_dir}); the last one, "
                   f"{folder / 'state_step000002.pt'}, stays")
        assert warning in lines and warning in err
    assert "step:4/8 train_loss:" in "\n".join(lines)  # trained on after the failed checkpoint
    stop_line = lines[-1]
    assert stop_line == err[-1]
    # the warning above says why step 4's is missing; the stop line goes on from the last one
    assert stop_line.startswith("stopped by SIGTERM after step 4; from step 2, resume with: ")
    assert stop_line.endswith(f" --resume {folder / 'state_step000002.pt'}")
    torch.load(folder / "state_step000002.pt")  # whole


@pytest.mark.slow
def test_a_final_checkpoint_the_disk_has_no_room_for_exits_1(small_filesystem, tmp_path, capsys,
                                                           monkeypatch):
    """2 steps (the run's end is what counts); the disk fills before the final checkpoint."""
    train, val = small_shards(tmp_path / "data")
    log_dir = small_filesystem / "logs"
    at_step(monkeypatch, {2: lambda: fill(small_filesystem, 256 * 1024)})
    options = tiny_run(train, val, log_dir, "--save_checkpoint", "true", "--num_iterations", "2")
    code = train_gpt.main(options)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and "Traceback" not in "\n".join(err)
    full = "(No space left on device"
    assert err[0].startswith(f"warning: the checkpoint of step 2 could not be written {full}")
    assert err[-1].startswith(f"error: the final checkpoint could not be written {full})")
    # no earlier one: the last line sends the user to the warning, not to an option they passed
    assert err[-1].endswith("; no checkpoint could be written (see the warning above)")
    assert not list(log_dir.glob("*/*.pt"))


def test_a_synthetic_shard_the_disk_has_no_room_for_is_one_line(tmp_path, capsys, monkeypatch):
    """The smoke preset writes its synthetic shards into --log_dir first: a full disk there is one
    line, before anything else is written."""
    def no_room(path, tokens):
        raise OSError(28, "No space left on device", path)

    monkeypatch.setattr(train_gpt, "write_data_shard", no_room)
    code = train_gpt.main(["--preset", "smoke", "--log_dir", str(tmp_path / "logs")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1
    assert err[0].startswith("error: ") and "synthetic_train_000001.bin: cannot write this " in err[0]
    assert "(No space left on device): free space" in err[0]


def log_fd(log_dir):
    """The descriptor this process has open on the log in log_dir."""
    for fd in os.listdir("/proc/self/fd"):
        target = os.path.realpath(f"/proc/self/fd/{fd}")
        if target.startswith(str(log_dir)) and target.endswith(".txt"):
            return int(fd)
    raise AssertionError(f"no log open in {log_dir}")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and /dev/full are Linux's")
def test_a_log_that_cannot_be_written_ends_the_run_with_one_line_keeping_the_last_checkpoint(
        markov_shards, tmp_path, capsys, monkeypatch):
    """From step 2 on, writes to the log fail as on a full disk (its descriptor now /dev/full's):
    step 2's checkpoint is written, its line is not, and the run ends there."""
    full = os.open("/dev/full", os.O_WRONLY)
    at_step(monkeypatch, {2: lambda: os.dup2(full, log_fd(tmp_path))})
    try:
        code = train_gpt.main(tiny(markov_shards, tmp_path, "--checkpoint_every", "2",
                                   "--val_loss_every", "0", *ONE_MICRO_BATCH))
    finally:
        os.close(full)
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err
    log = finished_log(tmp_path)
    checkpoint = tmp_path / log.stem / "state_step000002.pt"
    assert err.startswith(f"error: cannot write to the log {log} (No space left on device): free "
                          "some space; the last checkpoint stays: resume with: python ")
    assert err.rstrip().endswith(f" --resume {checkpoint}")
    # all it could write, kept
    assert log.read_text().splitlines()[-1].startswith("step:2/8 train_loss:")
    assert torch.load(checkpoint)["step"] == 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/dev/full is Linux's")
def test_a_log_that_cannot_be_started_is_one_line_before_step_one(markov_shards, tmp_path, capsys,
                                                                 monkeypatch):
    run_id = uuid.UUID(int=3)
    (tmp_path / f"{run_id}.txt").symlink_to("/dev/full")
    monkeypatch.setattr(train_gpt.uuid, "uuid4", lambda: run_id)
    monkeypatch.setattr(train_gpt, "build_model", lambda *args: pytest.fail("the model was built"))
    assert train_gpt.main(tiny(markov_shards, tmp_path)) == 1
    err = capsys.readouterr().err
    log = tmp_path / f"{run_id}.txt"
    assert err == (f"error: cannot write to the log {log} (No space left on device): "
                   "free some space or pick another --log_dir\n")


# a rank of the trainer whose log, on rank 0, fails from step 2 on as on a full disk (its file
# becomes /dev/full)
LOG_FULL_ON_RANK_0 = """import os
import train_gpt
agreed = train_gpt.CleanStop.agreed


def full_after_step_2(self, step):
    if step == 2 and os.environ["RANK"] == "0":
        for fd in os.listdir("/proc/self/fd"):
            if os.path.realpath(f"/proc/self/fd/{fd}").endswith(".txt"):
                os.dup2(os.open("/dev/full", os.O_WRONLY), int(fd))
    return agreed(self, step)


train_gpt.CleanStop.agreed = full_after_step_2
helpers.exit_as_a_rank(train_gpt.main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and /dev/full are Linux's")
def test_a_log_that_cannot_be_written_ends_every_process_with_rank_0s_line(markov_shards, tmp_path):
    """Rank 0's log fails from step 2 on, on 2 processes under torchrun, a checkpoint every 2
    steps: rank 0 ends with its line, which torchrun reports, after step 2's checkpoint (a
    collective: rank 1 sends its Muon momenta); torchrun ends rank 1, and the run ends."""
    log_dir = tmp_path / "log_full"
    options = tiny(markov_shards, log_dir, "--val_loss_every", "0", "--checkpoint_every", "2")
    rank = tmp_path / "rank.py"
    rank.write_text(with_trainer(LOG_FULL_ON_RANK_0))
    launch = torchrun(2, "--log-dir", tmp_path / "ranks", "--redirects", "3", rank, *options)
    result = run_process(launch, 300, cwd=REPO, env=launch_env(OMP_NUM_THREADS="1"))
    ranks = ranks_of(tmp_path / "ranks")
    log = finished_log(log_dir)
    checkpoint = log_dir / log.stem / "state_step000002.pt"
    no_space = f"error: cannot write to the log {log} (No space left on device)"
    line = (f"{no_space}: free some space; the last checkpoint stays: resume with: torchrun "
            f"--standalone --nproc_per_node=2 {os.path.relpath(TRAINER, REPO)} --resume {checkpoint}")
    assert result.returncode != 0 and ranks[0]["code"] == 1 and ranks[0]["last_line"] == line
    assert line in result.stderr
    assert torch.load(checkpoint)["step"] == 2
