"""The GPUs a run is given, checked at start-up with one line each (torch's CUDA queries stood in
for): a GPU without bf16 is refused, and so are more processes than GPUs."""
import torch
from helpers import run_main


def test_a_gpu_without_bf16_is_refused_at_start_up(capsys, monkeypatch, markov_shards):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")
    err = run_main(capsys, "--preset", "smoke", "--train_files", markov_shards[0], "--val_files",
                   markov_shards[1])
    assert "Tesla V100-SXM2-16GB has no bf16 support" in err and "Ampere" in err


def test_more_processes_than_gpus_is_refused(capsys, monkeypatch, markov_shards, torchrun_worker):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    torchrun_worker(WORLD_SIZE=8, LOCAL_WORLD_SIZE=8)
    err = run_main(capsys, "--preset", "smoke", "--batch_size", "8192",
                   "--train_files", markov_shards[0], "--val_files", markov_shards[1])
    assert "8 processes" in err and "--nproc_per_node=2" in err
