"""Faults a user meets in the trainer's data, each checked against what is left: the exit code,
the last line on stderr, the files. Shards that are folders or pipes; advice a resume would refuse;
the synthetic stream, the same tokens as the list-built one it replaced. (A log or a checkpoint the
disk has no room for: tests/test_disk.py; a failing rank under run.sh: tests/test_launch.py.)

Run: `pytest tests/test_trainer_faults.py` (add `-m "not slow"` for the quick ones)."""
import os

import numpy as np
import pytest
from helpers import small_shards
from helpers import tiny_run

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


@pytest.mark.parametrize("resumed", [False, True])
def test_a_batch_that_does_not_divide_among_processes_advises_only_what_the_run_allows(resumed):
    args = train_gpt.parse_args(["--batch_size", "1024", "--resume", "state.pt" if resumed else ""])
    with pytest.raises(train_gpt.UserError) as error:
        train_gpt.check_batch_plan(args, 3)
    assert "use 1, 2, 4, 8 processes" in str(error.value)
    assert ("--batch_size divisible" in str(error.value)) is not resumed
