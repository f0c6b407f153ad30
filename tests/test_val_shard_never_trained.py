"""The val shard is never trained on: every sequence a real run's model trains on is a stretch of
the train shards and none of the val shard; whatever its name, a copy or a hard link of the val
shard among the train shards is refused before anything is written, while a train shard of the
same size but other tokens is used (shards are compared whole)."""
import glob
import os
import shutil

import numpy as np
import pytest
from helpers import run_main

import train_gpt
from train_gpt import write_data_shard


def train_folder_with(tmp_path, markov_shards, extra):
    """The Markov train shards, copied into a folder with one more shard, made by extra(path)."""
    folder = tmp_path / "train"
    folder.mkdir()
    for path in glob.glob(markov_shards[0]):
        shutil.copy(path, folder)
    extra(folder / "markov_train_000003.bin")
    return str(folder / "markov_train_*.bin")


def val_shard(markov_shards):
    return markov_shards[1].replace("*", "000000")


@pytest.mark.parametrize("how", ["copy", "hard link"])
def test_a_copy_or_hard_link_of_the_val_shard_among_the_train_shards_is_refused(
        tmp_path, capsys, markov_shards, how):
    val = val_shard(markov_shards)

    def add_the_val_shard(path):
        if how == "copy":
            shutil.copy(val, path)
        else:
            os.link(val, path)

    pattern = train_folder_with(tmp_path, markov_shards, add_the_val_shard)
    err = run_main(capsys, "--preset", "smoke", "--train_files", pattern, "--val_files",
                   markov_shards[1], "--log_dir", str(tmp_path / "logs"))
    assert err.count("\n") == 1 and "never train on its validation data" in err
    same = f"error: {pattern.replace('*', '000003')} is the val shard {val}, a link or a copy of it"
    assert err.startswith(same)
    assert not (tmp_path / "logs").exists()


def test_a_train_shard_of_the_val_shards_size_but_other_tokens_is_used(tmp_path, markov_shards):
    """A val shard of 1.2 MB, and in the train shards the same tokens but the last: shards are
    compared whole, not by their size or their first MiB."""
    tokens = np.arange(600_000) % 50_000
    write_data_shard(tmp_path / "big_val_000000.bin", tokens)
    tokens[-1] += 1
    pattern = train_folder_with(tmp_path, markov_shards,
                                lambda path: write_data_shard(path, tokens))
    args = train_gpt.parse_args(["--preset", "smoke", "--train_files", pattern,
                                 "--val_files", str(tmp_path / "big_val_*.bin"),
                                 "--log_dir", str(tmp_path / "logs")])
    with train_gpt.Run(args) as run:
        assert len(run.train_loader.files) == 3
        assert run.sizes[run.train_loader.files[2]] == len(tokens)


def as_text(tokens):
    """Token ids between commas: a stretch of the tokens is a substring."""
    return "," + ",".join(map(str, tokens)) + ","


@pytest.mark.slow
def test_the_model_trains_on_stretches_of_the_train_shards_never_of_the_val_shard(smoke_runs,
                                                                                  markov_shards):
    """The tokens of each forward with gradients in the short smoke run (whatever loader fed it),
    against the shards' tokens read here (after their header of 256 int32)."""
    paths = sorted(glob.glob(markov_shards[0]))
    train = as_text(np.concatenate([np.fromfile(path, "<u2", offset=1024) for path in paths]))
    val = as_text(markov_shards[2])
    trained = smoke_runs.profiled()["trained"]
    assert len(trained) == 8, "the 4 steps of 2 micro-batches each are not the forwards recorded"
    for tokens in trained:
        in_val, in_train = as_text(tokens) in val, as_text(tokens) in train
        assert not in_val, "the val shard is trained on: a sequence the model trained on is in it"
        assert in_train, "a sequence the model trained on is not a stretch of the train shards"
