"""Faults a user meets in the trainer's data, each checked against what is left: the exit code,
the last line on stderr and in the log, the files. Shards that are folders, pipes or glob-looking
names, folders a glob cannot list; shards that change (in place too), vanish or turn into folders
mid-run, train and val shards (with a checkpoint where one is due, and a resume once the shard is
back); advice a resume would refuse; a shard changed for one rank of two; a log on a full disk; the
synthetic stream, the same tokens as the list-built one it replaced. (A final checkpoint the disk
has no room for: tests/test_disk.py; a failing rank under run.sh: tests/test_launch.py.)

Run: `pytest tests/test_trainer_faults.py` (add `-m "not slow"` for the quick ones)."""
import os

import numpy as np
import pytest
import torch
from helpers import REPO
from helpers import TRAINER
from helpers import at_step
from helpers import finished_log
from helpers import launch_env
from helpers import ranks_of
from helpers import run_process
from helpers import small_shards
from helpers import tiny_run
from helpers import torchrun
from helpers import with_trainer

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


def one_line_error(capsys, code):
    """The run's stderr, checked to be one error line and exit code 1."""
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.mark.parametrize("kind", ["folder", "pipe"])
def test_a_glob_matching_a_folder_or_a_pipe_is_one_line_naming_it(kind, tmp_path, capsys, no_hang):
    train, val = small_shards(tmp_path / "data")
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


def test_a_folder_the_glob_cannot_list_is_one_line_naming_it(tmp_path, capsys, monkeypatch):
    """data/a/ and data/b/ hold train shards and b cannot be listed (os.scandir refuses it, as it
    would a user without the right: the tests may run as root): one line naming b, never a run on
    a's shards alone."""
    _, val = small_shards(tmp_path / "data" / "a")
    small_shards(tmp_path / "data" / "b")
    blocked = str(tmp_path / "data" / "b")
    scandir = os.scandir

    def refusing(path="."):
        if os.fspath(path).rstrip(os.sep) == blocked:
            raise PermissionError(13, "Permission denied", path)
        return scandir(path)
    monkeypatch.setattr(os, "scandir", refusing)
    pattern = str(tmp_path / "data" / "*" / "t_*")
    line = one_line_error(capsys, train_gpt.main(tiny_run(pattern, val, tmp_path / "logs")))
    assert line == (f"error: {blocked}: cannot list this folder (Permission denied): its shards "
                    "would be left out; make it readable, or narrow --train_files/--val_files")
    assert not (tmp_path / "logs").exists()


def test_a_glob_character_in_a_folder_name_is_named_with_its_escape(tmp_path, capsys):
    folder = tmp_path / "run[1]"
    train, val = small_shards(folder)
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


# in this process: steps of one 128-token micro-batch, 300-token shards holding 2 (shard 2 opens at
# step 2, as in tiny_run's 2-process launch)
ONE_MICRO_BATCH = ["--batch_size", "128", "--val_tokens", "128"]
SMALL_SHARDS = (300, 300)


def replace_with_shorter(path):
    train_gpt.write_data_shard(f"{path}.new", train_gpt.markov_stream(200, seed=9))
    os.replace(f"{path}.new", path)


def replace_with_folder(path):
    os.remove(path)
    os.mkdir(path)


def rewrite_in_place(path):
    """Other tokens written into the same file, of the same size, its modification time put back
    (as a tool that preserves times would leave it)."""
    info = os.stat(path)
    tokens = train_gpt.load_data_shard(path).numpy()[::-1].copy()
    with open(path, "r+b") as f:
        f.seek(train_gpt.HEADER_BYTES)
        f.write(tokens.astype("<u2").tobytes())
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))


CHANGED = "changed since the run started (600 tokens then, 400 now): restore it"
UNREADABLE = "cannot read this shard since the run started"
# a shorter shard: the checkpoint test below
MID_RUN_FAULTS = {
    "deleted": (os.remove, f"{UNREADABLE} (No such file or directory)"),
    "folder": (replace_with_folder, f"{UNREADABLE} (a folder, a pipe or a device"),
    "rewritten": (rewrite_in_place, "changed since the run started (written again, 300 tokens)"),
}


@pytest.mark.slow
@pytest.mark.parametrize("fault", sorted(MID_RUN_FAULTS))
def test_a_shard_that_changes_mid_run_stops_it_naming_the_file(fault, tmp_path, capsys,
                                                              monkeypatch):
    """Shard 2 changes at step 1; the loader opens it at step 2: the run ends there, one line."""
    train, val = small_shards(tmp_path / "data", SMALL_SHARDS)
    shard = tmp_path / "data" / "t_000002.bin"
    change, says = MID_RUN_FAULTS[fault]
    at_step(monkeypatch, {1: lambda: change(shard)})
    options = tiny_run(train, val, tmp_path / "logs", *ONE_MICRO_BATCH)
    line = one_line_error(capsys, train_gpt.main(options))
    assert line.startswith(f"error: {shard}: {says}"), line
    log = finished_log(tmp_path / "logs").read_text().splitlines()
    assert log[-1] == line and "step:1/6 train_loss:" in "\n".join(log)
    # no checkpoint was asked for, none written; the run wrapped to no other shard
    assert not list((tmp_path / "logs").glob("*/*.pt"))


@pytest.mark.slow
def test_a_shard_replaced_mid_run_keeps_a_checkpoint_that_resumes_once_it_is_back(tmp_path, capsys,
                                                                                  monkeypatch):
    train, val = small_shards(tmp_path / "data", SMALL_SHARDS)
    shard = tmp_path / "data" / "t_000002.bin"
    original = shard.read_bytes()
    at_step(monkeypatch, {1: lambda: replace_with_shorter(shard)})
    # 3 steps: the shard opens at step 2, the resume trains step 2 and validates at 3
    options = tiny_run(train, val, tmp_path / "logs", "--save_checkpoint", "true",
                       "--num_iterations", "3", *ONE_MICRO_BATCH)
    line = one_line_error(capsys, train_gpt.main(options))
    assert "changed since the run started (300 tokens then, 200 now): restore it" in line
    log = finished_log(tmp_path / "logs")
    checkpoint = tmp_path / "logs" / log.stem / "state_step000002.pt"
    script = os.path.relpath(TRAINER)
    assert line.endswith(f"restore it, then: python {script} --resume {checkpoint}"), line
    assert log.read_text().splitlines()[-1] == line
    assert torch.load(checkpoint, weights_only=False)["loader"] == (0, 256)
    # the shard back as it was: the resume reads it and finishes
    shard.write_bytes(original)
    monkeypatch.undo()
    assert train_gpt.main(["--resume", str(checkpoint)]) == 0
    assert "step:3/3 val_loss:" in capsys.readouterr().out


@pytest.mark.parametrize("resumed", [False, True])
def test_a_batch_that_does_not_divide_among_processes_advises_only_what_the_run_allows(resumed):
    args = train_gpt.parse_args(["--batch_size", "1024", "--resume", "state.pt" if resumed else ""])
    with pytest.raises(train_gpt.UserError) as error:
        train_gpt.check_batch_plan(args, 3)
    assert "use 1, 2, 4, 8 processes" in str(error.value)
    assert ("--batch_size divisible" in str(error.value)) is not resumed


def test_a_full_disk_closes_the_log_and_records_the_failure_without_an_error(tmp_path):
    args = train_gpt.parse_args(["--log_dir", str(tmp_path)])
    with train_gpt.RunLog(args, master=True) as log:
        log("step:1/2 val_loss:2.0", console=False)

        class FullDisk:
            def write(self, text):
                raise OSError(28, "No space left on device")

            def flush(self):
                pass

            def close(self):
                pass
        log.file.close()
        log.file = FullDisk()
        # the writes go on without an error: the log is closed, the failure recorded
        log("step:2/2 val_loss:1.0", console=False)
        log("peak memory consumption: 1 MiB", console=False)
        assert log.failure == f"cannot write to the log {log.path} (No space left on device)"
    lines = open(log.path).read().splitlines()
    assert lines[-1] == "step:1/2 val_loss:2.0"


# a rank of the trainer (options after the shard's path) where, from step 1 on, rank 0 alone reads
# 400 tokens in the shard's header (its node's copy changed)
SHARD_CHANGED_ON_RANK_0 = """import os
import helpers
import train_gpt
shard, *options = sys.argv[1:]
agreed = train_gpt.CleanStop.agreed
read_shard_header = train_gpt.read_shard_header


def shorter(path):
    return 400 if path == shard else read_shard_header(path)


def changed_after_step_1(self, step):
    if step == 1 and os.environ["RANK"] == "0":
        train_gpt.read_shard_header = shorter
    return agreed(self, step)


train_gpt.CleanStop.agreed = changed_after_step_1
helpers.exit_as_a_rank(train_gpt.main(options))
"""


@pytest.mark.slow
def test_a_shard_changed_for_one_rank_stops_every_rank_after_a_checkpoint(tmp_path):
    """From step 1 on, rank 0 alone reads 400 tokens in train shard 2's header (its node's copy
    changed), rank 1 the shard as it was: on 2 processes under torchrun."""
    train, val = small_shards(tmp_path / "data")
    shard = str(tmp_path / "data" / "t_000002.bin")
    log_dir = tmp_path / "shard_changed"
    options = tiny_run(train, val, log_dir, "--save_checkpoint", "true")
    rank = tmp_path / "rank.py"
    rank.write_text(with_trainer(SHARD_CHANGED_ON_RANK_0))
    launch = torchrun(2, "--log-dir", tmp_path / "ranks", "--redirects", "3", rank, shard,
                      *options)
    result = run_process(launch, 300, cwd=REPO, env=launch_env(OMP_NUM_THREADS="1"))
    ranks = ranks_of(tmp_path / "ranks")
    stderr = "".join(rank["stderr"] for rank in ranks) + result.stderr
    # each process's main() ends with exit code 1 (torchrun's, then), without a worker's traceback
    codes = [rank["code"] for rank in ranks]
    assert codes == [1, 1] and f'{TRAINER.name}", line' not in stderr, stderr
    log = finished_log(log_dir)
    checkpoint = log_dir / log.stem / "state_step000002.pt"
    last = log.read_text().splitlines()[-1]
    assert last.startswith(f"error: {shard}: {CHANGED}, then: torchrun --standalone "), last
    script = os.path.relpath(TRAINER, REPO)
    assert last.endswith(f"--nproc_per_node=2 {script} --resume {checkpoint}")
    assert ranks[0]["last_line"] == last
    # rank 1 stopped with it, after the same step, and took its part in the checkpoint; its last
    # line, which torchrun's report quotes
    rank_one = f"error: {shard}: another process of the run could not read it again, then: "
    assert ranks[1]["last_line"].startswith(rank_one)
    assert torch.load(checkpoint, weights_only=False)["step"] == 2


@pytest.mark.slow
def test_a_val_shard_that_changes_mid_run_ends_it_after_the_steps_checkpoint(tmp_path, capsys,
                                                                              monkeypatch):
    """Two val shards of 200 tokens: each validation reads both. The second changes at step 1; the
    validation of step 2 meets it, writes step 2's checkpoint, and the line says how to resume."""
    train, _ = small_shards(tmp_path / "data", SMALL_SHARDS)
    for k in (1, 2):
        train_gpt.write_data_shard(tmp_path / "data" / f"w_{k:06d}.bin",
                                   train_gpt.markov_stream(200, seed=10 + k))
    val_shard = tmp_path / "data" / "w_000002.bin"
    at_step(monkeypatch, {1: lambda: replace_with_shorter(val_shard)})
    options = tiny_run(train, str(tmp_path / "data" / "w_*"), tmp_path / "logs", "--num_iterations",
                       "3", "--val_loss_every", "2", "--save_checkpoint", "true",
                       *ONE_MICRO_BATCH, "--val_tokens", "256")
    line = one_line_error(capsys, train_gpt.main(options))
    log = finished_log(tmp_path / "logs")
    checkpoint = tmp_path / "logs" / log.stem / "state_step000002.pt"
    assert line.startswith(f"error: {val_shard}: changed since the run started"), line
    assert line.endswith(f"restore it, then: python train_gpt.py --resume {checkpoint}"), line
    assert torch.load(checkpoint, weights_only=True)["step"] == 2
