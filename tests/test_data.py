"""Shards, the distributed loader, and the clear errors users get for bad data or configuration."""
import glob
import os
import shutil

import numpy as np
import pytest
import torch

import train_gpt
from train_gpt import DistributedDataLoader, UserError, load_data_shard, write_data_shard


def stream_shards(folder, sizes):
    """Shards whose tokens count up through the whole stream, so every slice says where it came from."""
    start = 0
    for k, size in enumerate(sizes):
        write_data_shard(folder / f"s_train_{k + 1:06d}.bin", (np.arange(start, start + size) % 50000))
        start += size
    return str(folder / "s_train_*.bin")


def test_write_then_load_round_trips(tmp_path):
    tokens = np.array([50256, 0, 1, 65535, 42])
    write_data_shard(tmp_path / "a.bin", tokens)
    assert (tmp_path / "a.bin").stat().st_size == 1024 + 2 * 5
    assert load_data_shard(tmp_path / "a.bin").tolist() == tokens.tolist()


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_rank_slices_tile_the_global_stream_without_gap_or_overlap(tmp_path, world_size):
    pattern = stream_shards(tmp_path, [10_000])
    loaders = [DistributedDataLoader(pattern, r, world_size, torch.device("cpu")) for r in range(world_size)]
    batch = 1024
    for step in range(5):
        parts = [loader.next_batch(batch) for loader in loaders]
        inputs = torch.cat([x for x, _ in parts])
        targets = torch.cat([y for _, y in parts])
        expected = torch.arange(step * batch, step * batch + batch + 1)
        assert inputs.dtype == torch.int32 and targets.dtype == torch.int64
        assert torch.equal(inputs.long(), expected[:-1]) and torch.equal(targets, expected[1:])


def test_loader_moves_to_next_shard_and_wraps_around(tmp_path):
    pattern = stream_shards(tmp_path, [2500, 1100])  # batches of 1000: 2 in shard 1, 1 in shard 2
    loader = DistributedDataLoader(pattern, 0, 1, torch.device("cpu"))
    firsts = [loader.next_batch(1000)[0][0].item() for _ in range(5)]
    assert firsts == [0, 1000, 2500, 0, 1000]  # 2000 + 1001 > 2500: skip to shard 2, then wrap
    loader.reset()
    assert loader.next_batch(1000)[0][0].item() == 0


def test_going_back_to_the_loaded_shard_reads_no_file(tmp_path, monkeypatch):
    pattern = stream_shards(tmp_path, [2500, 1100])
    loader = DistributedDataLoader(pattern, 0, 1, torch.device("cpu"))
    reads = []
    monkeypatch.setattr(train_gpt, "load_data_shard", lambda path, *a: reads.append(path) or torch.arange(9))
    loader.next_batch(1000)
    loader.reset()  # as each evaluation does: back to shard 0, already in memory
    assert reads == [] and loader.next_batch(1000)[0][0].item() == 0
    loader.reset(1)
    loader.reset(0)
    assert reads == [loader.files[1], loader.files[0]]


def test_loader_takes_shards_in_sorted_name_order(tmp_path):
    write_data_shard(tmp_path / "x_train_000002.bin", np.full(3000, 2))
    write_data_shard(tmp_path / "x_train_000001.bin", np.full(3000, 1))
    loader = DistributedDataLoader(str(tmp_path / "x_train_*.bin"), 0, 1, torch.device("cpu"))
    assert loader.files[0].endswith("000001.bin") and loader.next_batch(100)[0][0].item() == 1


def corrupt(path, how):
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
                                       ("truncated", "truncated"), ("header_only_part", "truncated")])
def test_bad_shards_give_an_error_naming_the_file_and_the_problem(tmp_path, how, words):
    path = tmp_path / "bad_train_000001.bin"
    write_data_shard(path, np.arange(500))
    corrupt(path, how)
    with pytest.raises(UserError) as info:
        load_data_shard(path)
    assert str(path) in str(info.value) and words in str(info.value)
    with pytest.raises(UserError):  # the loader checks every shard up front
        DistributedDataLoader(str(tmp_path / "bad_*.bin"), 0, 1, torch.device("cpu"))


# --- errors through main(): one message on stderr, exit code 1, no traceback -----------------------

def run_main(capsys, *argv):
    code = train_gpt.main(list(argv))
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("error: ") and "Traceback" not in err
    return err


@pytest.mark.record18
def test_missing_data_asks_for_as_many_shards_as_the_run_reads(tmp_path, capsys):
    missing = ["--train_files", str(tmp_path / "none_*.bin"), "--log_dir", str(tmp_path / "logs")]
    err = run_main(capsys, "--preset", "smoke", *missing)
    assert "python data/cached_fineweb10B.py 1`" in err and "none_*.bin" in err
    assert not (tmp_path / "logs").exists()  # nothing written before the checks pass
    # the record: 1390 steps of 524,288 tokens = 729M tokens; a 100M-token shard gives 190 whole batches
    err = run_main(capsys, *missing)
    assert "python data/cached_fineweb10B.py 9`" in err and "reads 8 train shards" in err
    err = run_main(capsys, "--num_iterations", "20", *missing)
    assert "python data/cached_fineweb10B.py 1`" in err


# --- the data budget, checked from the shard headers before step 1 ----------------------------------

def smoke_on(tmp_path, markov_shards, *argv, train=None, val=None):
    """main() on the smoke model with the given shards, validating on 512 tokens; returns its exit code and the
    log folder."""
    log_dir = tmp_path / "logs"
    code = train_gpt.main(["--preset", "smoke", "--train_files", train or markov_shards[0],
                           "--val_files", val or markov_shards[1], "--log_dir", str(log_dir), "--val_tokens", "512",
                           *argv])
    return code, log_dir


def test_a_train_shard_smaller_than_one_batch_fails_before_step_one(tmp_path, capsys, markov_shards):
    stream_shards(tmp_path, [5000, 1000])  # smoke batch: 1,024 tokens
    err = run_main(capsys, "--preset", "smoke", "--train_files", str(tmp_path / "s_train_*.bin"),
                   "--val_files", markov_shards[1], "--log_dir", str(tmp_path / "logs"))
    assert "s_train_000002.bin" in err and "1,000 tokens" in err and "1,024" in err
    assert not (tmp_path / "logs").exists()


def test_loader_gives_exactly_the_batches_the_budget_counts(tmp_path):
    batch, steps = 1024, 3
    loader = DistributedDataLoader(stream_shards(tmp_path, [steps * batch + 2]), 0, 1, torch.device("cpu"))
    assert loader.batches_before_wrap(batch) == steps
    firsts = [loader.next_batch(batch)[0][0].item() for _ in range(steps + 1)]
    assert firsts == [0, 1024, 2048, 0]  # three batches, then the stream starts over
    short = DistributedDataLoader(stream_shards(tmp_path / "..", [steps * batch + 1]), 0, 1, torch.device("cpu"))
    assert short.batches_before_wrap(batch) == steps - 1
    assert [short.next_batch(batch)[0][0].item() for _ in range(steps)] == [0, 1024, 0]


def test_a_run_that_would_repeat_train_tokens_fails_unless_allowed(tmp_path, capsys, markov_shards):
    run = ["--num_iterations", "2", "--val_loss_every", "0", "--batch_size", "128", "--max_device_batch_size", "128"]
    exact = tmp_path / "exact"
    exact.mkdir()
    code, _ = smoke_on(exact, markov_shards, *run, train=stream_shards(exact, [2 * 128 + 2]))
    assert code == 0  # exactly the tokens present
    short = tmp_path / "short"
    short.mkdir()
    pattern = stream_shards(short, [2 * 128 + 1])  # one token fewer
    err = run_main(capsys, "--preset", "smoke", "--train_files", pattern, "--val_files", markov_shards[1], *run)
    assert "2 batches of 128" in err and "hold 257" in err and "--allow_data_repeat" in err
    code, log_dir = smoke_on(short, markov_shards, *run, "--allow_data_repeat", "true", train=pattern)
    assert code == 0 and "2.00 passes over the train shards" in next(log_dir.glob("*.txt")).read_text()


def test_val_tokens_beyond_the_val_shards_fail_before_step_one(tmp_path, capsys, markov_shards):
    write_data_shard(tmp_path / "v_val_000000.bin", np.arange(4097))  # smoke: 8 batches of 512 need 4,098
    err = run_main(capsys, "--preset", "smoke", "--train_files", markov_shards[0],
                   "--val_files", str(tmp_path / "v_val_*.bin"), "--log_dir", str(tmp_path / "logs"))
    assert "--val_tokens 4,096" in err and "4,097 tokens" in err and "3,584" in err
    assert not (tmp_path / "logs").exists()


def test_a_diverging_run_stops_at_the_first_non_finite_val_loss(tmp_path, capsys, markov_shards):
    code, log_dir = smoke_on(tmp_path, markov_shards, "--embed_lr", "1e300", "--num_iterations", "6",
                             "--val_loss_every", "2", "--batch_size", "128", "--max_device_batch_size", "128")
    err = capsys.readouterr().err
    assert code == 1 and "val loss is nan at step 2" in err and "learning rate" in err
    log = next(log_dir.glob("*.txt")).read_text().splitlines()  # kept, and it says why it ended
    assert log[-2].startswith("step:2/6 val_loss:nan") and log[-1].startswith("error: val loss is nan")


def test_out_of_gpu_memory_in_a_step_is_one_line_naming_the_micro_batch_option(tmp_path, capsys, markov_shards,
                                                                              monkeypatch):
    forward = train_gpt.GPT.forward

    def out_of_memory_in_training(self, *args):  # evaluation passes, the first training step runs out
        if torch.is_grad_enabled():
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.14 GiB")
        return forward(self, *args)

    monkeypatch.setattr(train_gpt.GPT, "forward", out_of_memory_in_training)
    code, log_dir = smoke_on(tmp_path, markov_shards, "--num_layers", "6", "--model_dim", "64", "--num_iterations", "2")
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("error: out of GPU memory with micro-batches of 512 tokens: pass --max_device_batch_size 256")
    log = next(log_dir.glob("*.txt")).read_text().splitlines()  # kept, with the val line before it
    assert log[-2].startswith("step:0/2 val_loss:") and log[-1] == err.strip()


def test_a_gpu_without_bf16_is_refused_at_start_up(capsys, monkeypatch, markov_shards):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")
    err = run_main(capsys, "--preset", "smoke", "--train_files", markov_shards[0], "--val_files", markov_shards[1])
    assert "Tesla V100-SXM2-16GB has no bf16 support" in err and "Ampere" in err


def test_full_preset_never_falls_back_to_synthetic_data(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no data/fineweb10B here
    err = run_main(capsys, "--log_dir", str(tmp_path / "logs"))
    assert "fineweb_train_*.bin" in err and "cached_fineweb10B.py" in err
    assert not (tmp_path / "logs").exists()  # no synthetic shard written either


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
    assert np.mean([len(s) for s in successors.values()]) > 3  # and not fewer: the chain is that random


def test_corrupt_shard_through_main(tmp_path, capsys, markov_shards):
    path = tmp_path / "c_train_000001.bin"
    write_data_shard(path, np.arange(5000))
    corrupt(path, "magic")
    err = run_main(capsys, "--preset", "smoke", "--train_files", str(path), "--val_files", markov_shards[1])
    assert "magic" in err and str(path) in err


def test_more_processes_than_gpus_is_refused(capsys, monkeypatch, markov_shards):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # as under torchrun, which also sets TORCHELASTIC_RUN_ID
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    err = run_main(capsys, "--preset", "smoke", "--batch_size", "8192",
                   "--train_files", markov_shards[0], "--val_files", markov_shards[1])
    assert "8 processes" in err and "--nproc_per_node=2" in err


@pytest.mark.record18
def test_every_hyperparameter_is_a_command_line_option(capsys):
    args = train_gpt.parse_args(["--num_iterations", "20", "--bf16_embeds", "false", "--cooldown_frac", "0.5"])
    assert (args.num_iterations, args.bf16_embeds, args.cooldown_frac) == (20, False, 0.5)
    smoke = train_gpt.parse_args(["--preset", "smoke", "--num_layers", "6"])  # explicit options beat the preset
    assert smoke.num_layers == 6 and smoke.model_dim == train_gpt.PRESETS["smoke"]["model_dim"]
    with pytest.raises(SystemExit):
        train_gpt.parse_args(["--help"])
    help_text = capsys.readouterr().out
    for field in train_gpt.fields(train_gpt.Hyperparameters):
        assert f"--{field.name}" in help_text
    assert "default: 1390" in help_text


@pytest.mark.skipif(torch.cuda.is_available(), reason="would start a real run")
def test_run_sh_without_gpu_points_at_the_smoke_preset():
    import subprocess

    from conftest import REPO
    result = subprocess.run(["bash", str(REPO / "run.sh")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "no CUDA GPU" in result.stderr and "--preset smoke" in result.stderr


# --- the val shard never trained on, whatever its name --------------------------------------------

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
def test_a_copy_or_hard_link_of_the_val_shard_among_the_train_shards_is_refused(tmp_path, capsys, markov_shards,
                                                                                  how):
    val = val_shard(markov_shards)
    pattern = train_folder_with(tmp_path, markov_shards,
                                lambda path: shutil.copy(val, path) if how == "copy" else os.link(val, path))
    err = run_main(capsys, "--preset", "smoke", "--train_files", pattern, "--val_files", markov_shards[1],
                   "--log_dir", str(tmp_path / "logs"))
    assert err.count("\n") == 1 and "never train on its validation data" in err
    assert err.startswith(f"error: {pattern.replace('*', '000003')} holds the same tokens as the val shard {val}")
    assert not (tmp_path / "logs").exists()


def test_a_train_shard_of_the_val_shards_size_but_other_tokens_is_used(tmp_path, markov_shards):
    """A val shard of 1.2 MB, and in the train shards the same tokens but the last: shards are compared whole,
    not by their size or their first MiB."""
    tokens = np.arange(600_000) % 50_000
    write_data_shard(tmp_path / "big_val_000000.bin", tokens)
    tokens[-1] += 1
    pattern = train_folder_with(tmp_path, markov_shards, lambda path: write_data_shard(path, tokens))
    args = train_gpt.parse_args(["--preset", "smoke", "--train_files", pattern,
                                 "--val_files", str(tmp_path / "big_val_*.bin")])
    train_loader, _, _ = train_gpt.build_loaders(args, 0, 1, torch.device("cpu"), 512)
    assert len(train_loader.files) == 3 and train_loader.sizes[2] == len(tokens)
