"""Faults a user meets in the trainer's data and disk, each checked against what is left: the
exit code, the last line on stderr and in the log, the files. Shards that are folders, pipes or
glob-looking names; shards that change, vanish or turn into folders mid-run (with a checkpoint
where one is due, and a resume once the shard is back); a final checkpoint the disk has no room
for; advice a resume would refuse; an option error under run.sh; a shard changed for one rank of
two; rank 0's log written from two threads; the synthetic stream, the same tokens as the
list-built one it replaced.

Run: `pytest tests/test_trainer_faults.py` (add `-m "not slow"` for the quick ones)."""
import glob
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from conftest import REPO
from conftest import finished_log
from conftest import launch_env
from test_disk import at_step
from test_disk import fill
from test_disk import small_filesystem  # noqa: F401 (a fixture)
from test_launch import needs_no_gpu
from test_launch import run_sh_env
from test_resume import one_thread  # noqa: F401 (a fixture)

import train_gpt

EOT = 50256


def list_built_markov_stream(num_tokens, seed, chain_seed=1234, vocab=256, successors=4):
    """The synthetic stream as it was first written: documents appended to one Python list."""
    table = np.random.default_rng(chain_seed).integers(0, vocab, size=(vocab, successors)).tolist()
    rng = np.random.default_rng(seed)
    tokens = []
    while len(tokens) < num_tokens:
        state = int(rng.integers(vocab))
        choices = rng.integers(successors, size=int(rng.integers(39, 399))).tolist()
        tokens.append(EOT)
        for choice in choices:
            tokens.append(state)
            state = table[state][choice]
    return np.array(tokens[:num_tokens])


@pytest.mark.parametrize("num_tokens", [0, 1, 40, 12_290, 54_321])
@pytest.mark.parametrize("seed,chain_seed", [([0, 1], 0), ([0, 0], 0), ([7, 1], 7), (3, 1234)])
def test_synthetic_stream_is_the_same_tokens_as_the_list_built_one(num_tokens, seed, chain_seed):
    expected = list_built_markov_stream(num_tokens, seed, chain_seed)
    tokens = train_gpt.markov_stream(num_tokens, seed, chain_seed)
    assert tokens.shape == (num_tokens,) and np.array_equal(tokens, expected)
    # two bytes a token, as in a shard, whatever the length
    assert tokens.itemsize == 2


def shards(folder, train_tokens=(600, 600), val_tokens=2000):
    """Train shards of these lengths and one val shard in folder; returns (train glob, val glob)."""
    folder.mkdir(parents=True, exist_ok=True)
    for k, n in enumerate(train_tokens, start=1):
        train_gpt.write_data_shard(folder / f"t_{k:06d}.bin", train_gpt.markov_stream(n, seed=k))
    train_gpt.write_data_shard(folder / "v_000000.bin", train_gpt.markov_stream(val_tokens, seed=0))
    escaped = glob.escape(str(folder))
    return f"{escaped}/t_*", f"{escaped}/v_*"


def tiny_run(train, val, log_dir, *extra):
    """A 6-step run of a tiny model: 600-token shards hold 2 batches, so shard 2 opens at step 2."""
    return ["--preset", "smoke", "--train_files", train, "--val_files", val, "--num_layers", "6",
            "--model_dim", "16", "--num_heads", "1", "--num_iterations", "6",
            "--val_loss_every", "0", "--batch_size", "256", "--max_device_batch_size", "128",
            "--val_tokens", "256",
            "--allow_data_repeat", "true", "--log_dir", str(log_dir), *extra]


def one_line_error(capsys, code):
    """The run's stderr, checked to be one error line and exit code 1."""
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.fixture
def no_hang():
    """A test that would block (opening a pipe) fails after 60 s instead."""
    def timed_out(signum, frame):
        raise TimeoutError("the run blocked")
    previous = signal.signal(signal.SIGALRM, timed_out)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("kind", ["folder", "pipe"])
def test_a_glob_matching_a_folder_or_a_pipe_is_one_line_naming_it(kind, tmp_path, capsys, no_hang):
    train, val = shards(tmp_path / "data")
    odd = tmp_path / "data" / "t_000003.bin"
    if kind == "folder":
        odd.mkdir()
    else:
        os.mkfifo(odd)
    line = one_line_error(capsys, train_gpt.main(tiny_run(train, val, tmp_path / "logs")))
    says = "cannot read this shard (a folder, a pipe or a device, not a token shard)"
    assert line.startswith(f"error: {odd}: {says}")
    assert "--train_files" in line
    assert not (tmp_path / "logs").exists()


def test_a_glob_character_in_a_folder_name_is_named_with_its_escape(tmp_path, capsys):
    folder = tmp_path / "run[1]"
    train, val = shards(folder)
    literal = f"{folder}/t_*"
    line = one_line_error(capsys, train_gpt.main(tiny_run(literal, val, tmp_path / "logs")))
    assert line == (f"error: no data shard matches {literal!r}: [ and ? are glob characters: "
                    f"{train!r} matches them as such")
    assert "cached_fineweb10B" not in line


def test_a_glob_character_is_named_even_where_no_escape_would_match(tmp_path, capsys):
    pattern = f"{tmp_path}/run[1]/t_*"
    line = one_line_error(capsys, train_gpt.main(tiny_run(pattern, pattern, tmp_path / "logs")))
    assert "[ and ? are glob characters: " in line
    assert "run[[]1]/t_*' matches them as such; else fetch FineWeb" in line
    assert "cached_fineweb10B" in line


def replace_with_shorter(path):
    train_gpt.write_data_shard(f"{path}.new", train_gpt.markov_stream(400, seed=9))
    os.replace(f"{path}.new", path)


def replace_with_folder(path):
    os.remove(path)
    os.mkdir(path)


CHANGED = "changed since the run started (600 tokens then, 400 now): restore it"
UNREADABLE = "cannot read this shard since the run started"
# a shorter shard: the checkpoint test below
MID_RUN_FAULTS = {
    "deleted": (os.remove, f"{UNREADABLE} (No such file or directory)"),
    "folder": (replace_with_folder, f"{UNREADABLE} (a folder, a pipe or a device"),
}


@pytest.mark.slow
@pytest.mark.parametrize("fault", sorted(MID_RUN_FAULTS))
@pytest.mark.usefixtures("one_thread")
def test_a_shard_that_changes_mid_run_stops_it_naming_the_file(fault, tmp_path, capsys,
                                                              monkeypatch):
    """Shard 2 changes at step 1; the loader opens it at step 2: the run ends there, one line."""
    train, val = shards(tmp_path / "data")
    shard = tmp_path / "data" / "t_000002.bin"
    change, says = MID_RUN_FAULTS[fault]
    at_step(monkeypatch, {1: lambda: change(shard)})
    line = one_line_error(capsys, train_gpt.main(tiny_run(train, val, tmp_path / "logs")))
    assert line.startswith(f"error: {shard}: {says}"), line
    log = finished_log(tmp_path / "logs").read_text().splitlines()
    assert log[-1] == line and "step:1/6 train_loss:" in "\n".join(log)
    # no checkpoint was asked for, none written; the run wrapped to no other shard
    assert not list((tmp_path / "logs").glob("*/*.pt"))


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_a_shard_replaced_mid_run_keeps_a_checkpoint_that_resumes_once_it_is_back(tmp_path, capsys,
                                                                                  monkeypatch):
    train, val = shards(tmp_path / "data")
    shard = tmp_path / "data" / "t_000002.bin"
    original = shard.read_bytes()
    at_step(monkeypatch, {1: lambda: replace_with_shorter(shard)})
    options = tiny_run(train, val, tmp_path / "logs", "--save_checkpoint", "true")
    line = one_line_error(capsys, train_gpt.main(options))
    log = finished_log(tmp_path / "logs")
    checkpoint = tmp_path / "logs" / log.stem / "state_step000002.pt"
    assert line.endswith(f"restore it, then: python train_gpt.py --resume {checkpoint}"), line
    assert log.read_text().splitlines()[-1] == line
    assert torch.load(checkpoint, weights_only=False)["loader"] == (0, 512)
    # the shard back as it was: the resume reads it and finishes
    shard.write_bytes(original)
    monkeypatch.undo()
    assert train_gpt.main(["--resume", str(checkpoint)]) == 0
    assert "step:6/6 val_loss:" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_a_final_checkpoint_the_disk_has_no_room_for_exits_1(small_filesystem, tmp_path, capsys,  # noqa: F811
                                                           monkeypatch):
    train, val = shards(tmp_path / "data")
    log_dir = small_filesystem / "logs"
    at_step(monkeypatch, {6: lambda: fill(small_filesystem, 256 * 1024)})
    code = train_gpt.main(tiny_run(train, val, log_dir, "--save_checkpoint", "true"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and "Traceback" not in "\n".join(err)
    full = "(No space left on device"
    assert err[0].startswith(f"warning: the checkpoint of step 6 could not be written {full}")
    assert err[-1].startswith(f"error: the final checkpoint could not be written {full})")
    assert not list(log_dir.glob("*/*.pt"))


@pytest.mark.parametrize("resumed", [False, True])
def test_a_batch_that_does_not_divide_among_processes_advises_only_what_the_run_allows(resumed):
    args = train_gpt.parse_args(["--batch_size", "1024", "--resume", "state.pt" if resumed else ""])
    with pytest.raises(train_gpt.UserError) as error:
        train_gpt.micro_batch_plan(args, 3)
    assert "use 1, 2, 4, 8 processes" in str(error.value)
    assert ("--batch_size divisible" in str(error.value)) is not resumed


def test_the_log_is_written_under_a_lock_and_a_full_disk_met_by_another_thread_stops_it_cleanly(
        tmp_path):
    args = train_gpt.parse_args(["--log_dir", str(tmp_path)])
    with train_gpt.RunLog(args, master=True) as log:
        posted = ("rank 1: error: out of memory",)
        writer = threading.Thread(target=log, args=posted, kwargs=dict(console=False))
        with log.lock:
            writer.start()
            time.sleep(0.2)
            # it waits for the lock
            assert writer.is_alive()
        writer.join(timeout=10)
        assert not writer.is_alive()

        class FullDisk:
            def write(self, text):
                raise OSError(28, "No space left on device")

            def flush(self):
                pass

            def close(self):
                pass
        log.file.close()
        log.file = FullDisk()
        writer = threading.Thread(target=log, args=("rank 1: error",), kwargs=dict(console=False))
        writer.start()
        writer.join(timeout=10)
        # the main thread's writes go on without an error: the log is closed, the failure recorded
        log("step:1/2 val_loss:1.0", console=False)
        assert log.failure == f"cannot write to the log {log.path} (No space left on device)"
    lines = open(log.path).read().splitlines()
    assert lines[-1] == "rank 1: error: out of memory"


def run_in_own_session(command, env, timeout=300):
    """Run command in a session of its own: if it outlives the timeout, all of its processes go."""
    proc = subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


# rank 0 writes its error line first, then lingers: torchrun, as rank 1 exits first, ends it with
# SIGTERM
LINGERING_RANK_ZERO = """import os, sys, time
sys.path.insert(0, {repo!r})
import train_gpt
tell_launcher = train_gpt.tell_launcher
def tell_then_linger(line, code=1):
    if os.environ["RANK"] == "1":
        time.sleep(2)
    tell_launcher(line, code)
    if os.environ["RANK"] == "0":
        time.sleep(30)
train_gpt.tell_launcher = tell_then_linger
sys.exit(train_gpt.main())
"""


@pytest.mark.slow
@needs_no_gpu
def test_an_option_error_under_run_sh_exits_1_even_when_torchrun_ends_a_rank_with_sigterm(tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(LINGERING_RANK_ZERO.format(repo=str(REPO)))
    env = run_sh_env(tmp_path / "bin", 2, RUN_SH_SCRIPT=str(worker))
    # 2 processes x 128 tokens do not divide 128 val tokens: an error once the count is known
    options = ["--preset", "smoke", "--val_tokens", "128", "--max_device_batch_size", "128",
               "--batch_size", "256", "--log_dir", str(tmp_path / "logs")]
    result = run_in_own_session(["bash", str(REPO / "run.sh"), *options], env)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1] == ("error: --val_tokens 128 must be a multiple of "
                                              "processes x --max_device_batch_size = 256")


# from step 1 on, rank 0 alone reads 400 tokens in train shard 2's header (its node's copy changed);
# rank 1 reads the shard as it was
SHARD_CHANGED_ON_RANK_ZERO = """import os, sys
sys.path.insert(0, {repo!r})
import train_gpt
agreed = train_gpt.CleanStop.agreed
read_shard_header = train_gpt.read_shard_header
def shorter_on_rank_0(path):
    return 400 if path == {shard!r} else read_shard_header(path)
def change_at_step_1(self, step):
    if step == 1 and os.environ["RANK"] == "0":
        train_gpt.read_shard_header = shorter_on_rank_0
    return agreed(self, step)
train_gpt.CleanStop.agreed = change_at_step_1
sys.exit(train_gpt.main())
"""


@pytest.mark.slow
def test_a_shard_changed_for_one_rank_stops_every_rank_after_a_checkpoint(tmp_path):
    train, val = shards(tmp_path / "data")
    shard = str(tmp_path / "data" / "t_000002.bin")
    worker = tmp_path / "worker.py"
    worker.write_text(SHARD_CHANGED_ON_RANK_ZERO.format(repo=str(REPO), shard=shard))
    options = tiny_run(train, val, tmp_path / "logs", "--save_checkpoint", "true")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(worker), *options]
    result = run_in_own_session(command, launch_env(OMP_NUM_THREADS="1"))
    # plain torchrun adds its own traceback and report (run.sh leaves them out); none of a worker's
    assert result.returncode == 1 and 'train_gpt.py", line' not in result.stderr, result.stderr
    log = finished_log(tmp_path / "logs")
    checkpoint = tmp_path / "logs" / log.stem / "state_step000002.pt"
    last = log.read_text().splitlines()[-1]
    assert last.startswith(f"error: {shard}: {CHANGED}, then: torchrun --standalone "), last
    assert last.endswith(f"--nproc_per_node=2 train_gpt.py --resume {checkpoint}")
    # rank 1 stopped with it, after the same step, and took its part in the checkpoint
    rank_one = f"error: {shard}: another process of the run could not read it again, then: "
    assert rank_one in result.stderr
    assert torch.load(checkpoint, weights_only=False)["step"] == 2
