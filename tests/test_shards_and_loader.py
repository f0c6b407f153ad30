"""The shard format and the distributed loader against the global token stream: shards written and
read back, rank slices that tile the stream, shard order, wrap-around, no re-read of the shard in
memory, exactly the batches the data budget counts, damaged shards named, and the synthetic Markov
stream."""
import glob

import numpy as np
import pytest
import torch
from helpers import stream_shards

import train_gpt
from train_gpt import DistributedDataLoader
from train_gpt import UserError
from train_gpt import batches_before_wrap
from train_gpt import load_data_shard
from train_gpt import write_data_shard

CPU = torch.device("cpu")


def test_write_then_load_round_trips(tmp_path):
    tokens = np.array([50256, 0, 1, 65535, 42])
    write_data_shard(tmp_path / "a.bin", tokens)
    assert (tmp_path / "a.bin").stat().st_size == 1024 + 2 * 5
    assert load_data_shard(tmp_path / "a.bin").tolist() == tokens.tolist()


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_rank_slices_tile_the_global_stream_without_gap_or_overlap(tmp_path, world_size):
    pattern = stream_shards(tmp_path, [10_000])
    loaders = [DistributedDataLoader(pattern, rank, world_size, CPU) for rank in range(world_size)]
    batch = 1024
    for step in range(5):
        parts = [loader.next_batch(batch) for loader in loaders]
        inputs = torch.cat([x for x, _ in parts])
        targets = torch.cat([y for _, y in parts])
        expected = torch.arange(step * batch, step * batch + batch + 1)
        assert inputs.dtype == torch.int32 and targets.dtype == torch.int64
        assert torch.equal(inputs.long(), expected[:-1]) and torch.equal(targets, expected[1:])


def test_loader_moves_to_next_shard_and_wraps_around(tmp_path):
    # batches of 1000: 2 in shard 1, 1 in shard 2
    pattern = stream_shards(tmp_path, [2500, 1100])
    loader = DistributedDataLoader(pattern, 0, 1, CPU)
    firsts = [loader.next_batch(1000)[0][0].item() for _ in range(5)]
    # 2000 + 1001 > 2500: skip to shard 2, then wrap
    assert firsts == [0, 1000, 2500, 0, 1000]
    loader.reset()
    assert loader.next_batch(1000)[0][0].item() == 0


def test_going_back_to_the_loaded_shard_reads_no_file(tmp_path):
    pattern = stream_shards(tmp_path, [2500, 1100])
    reads = []

    def recorded_read(path):
        reads.append(path)
        return load_data_shard(path)

    loader = DistributedDataLoader(pattern, 0, 1, CPU, read_shard=recorded_read)
    reads.clear()
    loader.next_batch(1000)
    # as each evaluation does: back to shard 0, already in memory
    loader.reset()
    assert reads == [] and loader.next_batch(1000)[0][0].item() == 0
    loader.reset(1)
    loader.reset(0)
    assert reads == [loader.files[1], loader.files[0]]


def test_loader_takes_shards_in_sorted_name_order(tmp_path):
    write_data_shard(tmp_path / "x_train_000002.bin", np.full(3000, 2))
    write_data_shard(tmp_path / "x_train_000001.bin", np.full(3000, 1))
    loader = DistributedDataLoader(str(tmp_path / "x_train_*.bin"), 0, 1, CPU)
    assert loader.files[0].endswith("000001.bin") and loader.next_batch(100)[0][0].item() == 1


def test_loader_gives_exactly_the_batches_the_budget_counts(tmp_path):
    batch = 1024
    steps = 3
    loader = DistributedDataLoader(stream_shards(tmp_path, [steps * batch + 2]), 0, 1, CPU)
    assert batches_before_wrap(loader.files, {loader.files[0]: steps * batch + 2}, batch) == steps
    firsts = [loader.next_batch(batch)[0][0].item() for _ in range(steps + 1)]
    # three batches, then the stream starts over
    assert firsts == [0, 1024, 2048, 0]
    short_pattern = stream_shards(tmp_path / "..", [steps * batch + 1])
    short = DistributedDataLoader(short_pattern, 0, 1, CPU)
    assert batches_before_wrap(short.files, {short.files[0]: steps * batch + 1}, batch) == steps - 1
    assert [short.next_batch(batch)[0][0].item() for _ in range(steps)] == [0, 1024, 0]


def corrupt(path, how):
    """Damage a shard's header (magic, version) or cut it short (truncated, header_only_part)."""
    data = bytearray(path.read_bytes())
    if how == "magic":
        data[0:4] = np.int32(12345).tobytes()
    elif how == "version":
        data[4:8] = np.int32(7).tobytes()
    elif how == "truncated":
        data = data[:-10]
    elif how == "header_only_part":
        data = data[:100]
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how,words", [("magic", "magic"), ("version", "version"),
                                       ("truncated", "truncated"),
                                       ("header_only_part", "truncated")])
def test_bad_shards_give_an_error_naming_the_file_and_the_problem(tmp_path, how, words):
    path = tmp_path / "bad_train_000001.bin"
    write_data_shard(path, np.arange(500))
    corrupt(path, how)
    with pytest.raises(UserError) as info:
        load_data_shard(path)
    assert str(path) in str(info.value) and words in str(info.value)
    # the loader checks every shard up front
    with pytest.raises(UserError):
        DistributedDataLoader(str(tmp_path / "bad_*.bin"), 0, 1, CPU)


def test_synthetic_stream_is_seeded_documents_of_a_four_successor_chain():
    eot = 50256
    tokens = train_gpt.markov_stream(20_000, seed=[0, 1], chain_seed=0)
    assert len(tokens) == 20_000 and tokens[0] == eot
    assert np.array_equal(tokens, train_gpt.markov_stream(20_000, seed=[0, 1], chain_seed=0))
    assert not np.array_equal(tokens, train_gpt.markov_stream(20_000, seed=[0, 0], chain_seed=0))
    starts = np.flatnonzero(tokens == eot)
    lengths = np.diff(starts)
    assert lengths.min() >= 40 and lengths.max() <= 399
    successors = {}
    for a, b in zip(tokens[:-1], tokens[1:]):
        if a != eot and b != eot:
            successors.setdefault(int(a), set()).add(int(b))
    assert max(len(s) for s in successors.values()) <= 4 and max(successors) < 256
    # and not fewer: the chain is that random
    assert np.mean([len(s) for s in successors.values()]) > 3


def successors(tokens):
    """Each token's successors in a stream (across documents' boundaries left out)."""
    pairs = {}
    for a, b in zip(tokens[:-1].tolist(), tokens[1:].tolist()):
        if a != 50256 and b != 50256:
            pairs.setdefault(a, set()).add(b)
    return pairs


def test_the_synthetic_val_stream_is_the_same_for_every_seed_and_the_train_chain_too(tmp_path):
    """Runs of two seeds are scored on the same val text, and each trains on that text's chain."""
    shards = {}
    for seed in (0, 7):
        args = train_gpt.parse_args(["--preset", "smoke", "--seed", str(seed),
                                     "--log_dir", str(tmp_path)])
        shards[seed] = [load_data_shard(glob.glob(train_gpt.prepare_shards(args, split, 20_000))[0])
                        for split in ("train", "val")]
    (train_0, val_0), (train_7, val_7) = shards[0], shards[7]
    assert torch.equal(val_0, val_7) and not torch.equal(train_0, train_7)
    # one chain: chain seed 0's table of 4 successors per token (markov_stream's definition)
    table = np.random.default_rng(0).integers(0, 256, size=(256, 4))
    for stream in (val_0, train_0, train_7):
        for token, nexts in successors(stream.numpy()).items():
            assert nexts <= set(table[token].tolist()), token
