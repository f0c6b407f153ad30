"""The data a run needs, checked from the shard headers before step 1: missing shards name the
download command for as many as the run reads, a train shard smaller than one batch, a run that
would repeat train tokens (unless allowed), val tokens beyond the val shards, a damaged shard, and
the full preset that never falls back to synthetic data."""
import numpy as np
import pytest
from helpers import run_main
from helpers import smoke_on
from helpers import stream_shards

from train_gpt import write_data_shard


@pytest.mark.record18
def test_missing_data_asks_for_as_many_shards_as_the_run_reads(tmp_path, capsys):
    missing = ["--train_files", str(tmp_path / "none_*.bin"), "--log_dir", str(tmp_path / "logs")]
    err = run_main(capsys, "--preset", "smoke", *missing)
    assert "python data/cached_fineweb10B.py 1`" in err and "none_*.bin" in err
    # nothing written before the checks pass
    assert not (tmp_path / "logs").exists()
    # the record: 1390 steps of 524,288 tokens = 729M tokens; a 100M-token shard gives 190 whole
    # batches
    err = run_main(capsys, *missing)
    assert "python data/cached_fineweb10B.py 9`" in err and "reads 8 train shards" in err
    err = run_main(capsys, "--num_iterations", "20", *missing)
    assert "python data/cached_fineweb10B.py 1`" in err


def test_a_train_shard_smaller_than_one_batch_fails_before_step_one(tmp_path, capsys,
                                                                    markov_shards):
    # smoke batch: 1,024 tokens
    stream_shards(tmp_path, [5000, 1000])
    err = run_main(capsys, "--preset", "smoke", "--train_files", str(tmp_path / "s_train_*.bin"),
                   "--val_files", markov_shards[1], "--log_dir", str(tmp_path / "logs"))
    assert "s_train_000002.bin" in err and "1,000 tokens" in err and "1,024" in err
    assert not (tmp_path / "logs").exists()


@pytest.mark.slow
def test_a_run_that_would_repeat_train_tokens_fails_unless_allowed(tmp_path, capsys,
                                                                   markov_shards):
    # the model's size is not what counts: 6 blocks of width 16, one 128-token validation
    run = ["--num_iterations", "2", "--val_loss_every", "0", "--batch_size", "128",
           "--max_device_batch_size", "128", "--num_layers", "6", "--model_dim", "16",
           "--num_heads", "1", "--val_tokens", "128"]
    exact = tmp_path / "exact"
    exact.mkdir()
    code, _ = smoke_on(exact, markov_shards, *run, train=stream_shards(exact, [2 * 128 + 2]))
    # exactly the tokens present
    assert code == 0
    short = tmp_path / "short"
    short.mkdir()
    # one token fewer
    pattern = stream_shards(short, [2 * 128 + 1])
    err = run_main(capsys, "--preset", "smoke", "--train_files", pattern, "--val_files",
                   markov_shards[1], *run)
    assert "2 batches of 128" in err and "hold 257" in err and "--allow_data_repeat" in err
    code, log_dir = smoke_on(short, markov_shards, *run, "--allow_data_repeat", "true",
                             train=pattern)
    log = next(log_dir.glob("*.txt")).read_text()
    assert code == 0 and "2.00 passes over the train shards" in log


def test_val_tokens_beyond_the_val_shards_fail_before_step_one(tmp_path, capsys, markov_shards):
    # smoke: 8 batches of 512 need 4,098
    write_data_shard(tmp_path / "v_val_000000.bin", np.arange(4097))
    err = run_main(capsys, "--preset", "smoke", "--train_files", markov_shards[0],
                   "--val_files", str(tmp_path / "v_val_*.bin"),
                   "--log_dir", str(tmp_path / "logs"))
    assert "--val_tokens 4,096" in err and "4,097 tokens" in err and "3,584" in err
    assert not (tmp_path / "logs").exists()


def test_a_corrupt_shard_through_main_is_one_line_naming_it(tmp_path, capsys, markov_shards):
    path = tmp_path / "c_train_000001.bin"
    write_data_shard(path, np.arange(5000))
    # a damaged magic number
    path.write_bytes(np.int32(12345).tobytes() + path.read_bytes()[4:])
    err = run_main(capsys, "--preset", "smoke", "--train_files", str(path), "--val_files",
                   markov_shards[1])
    assert "magic" in err and str(path) in err


def test_full_preset_never_falls_back_to_synthetic_data(tmp_path, capsys, monkeypatch):
    # no data/fineweb10B here
    monkeypatch.chdir(tmp_path)
    err = run_main(capsys, "--log_dir", str(tmp_path / "logs"))
    assert "fineweb_train_*.bin" in err and "cached_fineweb10B.py" in err
    # no synthetic shard written either
    assert not (tmp_path / "logs").exists()

