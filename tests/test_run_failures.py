"""A run that fails mid-way stops with one line naming the cause and the option to change, and keeps
its log ending with that line: out of GPU memory in a training step (the micro-batch option), a
diverging run (the first non-finite val loss)."""
import pytest
import torch
from helpers import smoke_on

import train_gpt


@pytest.mark.slow
def test_a_diverging_run_stops_at_the_first_non_finite_val_loss(tmp_path, capsys, markov_shards):
    # 6 blocks of width 16 (the size is not what counts), one 128-token validation
    code, log_dir = smoke_on(tmp_path, markov_shards, "--embed_lr", "1e300", "--num_iterations",
                             "6", "--val_loss_every", "2", "--batch_size", "128",
                             "--max_device_batch_size", "128", "--num_layers", "6",
                             "--model_dim", "16", "--num_heads", "1", "--val_tokens", "128")
    err = capsys.readouterr().err
    assert code == 1 and "val loss is nan at step 2" in err and "learning rate" in err
    # kept, and it says why it ended
    log = next(log_dir.glob("*.txt")).read_text().splitlines()
    assert log[-2].startswith("step:2/6 val_loss:nan")
    assert log[-1].startswith("error: val loss is nan")


@pytest.mark.slow
def test_out_of_gpu_memory_in_a_step_is_one_line_naming_the_micro_batch_option(
        tmp_path, capsys, markov_shards, monkeypatch):
    forward = train_gpt.GPT.forward

    def out_of_memory_in_training(self, *args):
        """Evaluation passes, the first training step runs out."""
        if torch.is_grad_enabled():
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.14 GiB")
        return forward(self, *args)

    monkeypatch.setattr(train_gpt.GPT, "forward", out_of_memory_in_training)
    # width 16: the micro-batch (the smoke preset's 512 tokens) is what the line names
    code, log_dir = smoke_on(tmp_path, markov_shards, "--num_layers", "6", "--model_dim", "16",
                             "--num_heads", "1", "--num_iterations", "2")
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("error: out of GPU memory with micro-batches of 512 tokens: "
                          "pass --max_device_batch_size 256")
    # kept, with the val line before it
    log = next(log_dir.glob("*.txt")).read_text().splitlines()
    assert log[-2].startswith("step:0/2 val_loss:") and log[-1] == err.strip()
