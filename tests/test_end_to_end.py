"""Real runs of the trainer (smoke preset, CPU): one whole tiny run in this process, 1 process
against 2, the log format, and learning."""
import hashlib
import math

import numpy as np
import pytest
from helpers import LN_VOCAB
from helpers import STARTUP_LINE
from helpers import TINY_MODEL
from helpers import TRAIN_LINE
from helpers import TRAINER
from helpers import finished_log
from helpers import step_lines
from helpers import val_losses

# test_profile.py reads logs with this file's val_losses
__all__ = ["val_losses"]


def unigram_entropy(tokens):
    counts = np.bincount(tokens)
    p = counts[counts > 0] / len(tokens)
    return float(-(p * np.log(p)).sum())


def val_loss_of_checkpoint(checkpoint, val, step):
    """The val loss recomputed from a checkpoint's weights and options, chunk by chunk over the
    first val_tokens + 1 of the tokens `val`, with the window of `step`."""
    import torch

    import train_gpt

    state = torch.load(checkpoint)
    assert state["step"] == step
    assert state["source_sha256"] == hashlib.sha256(TRAINER.read_bytes()).hexdigest()
    args = train_gpt.Hyperparameters(**state["args"])
    model = train_gpt.GPT.from_args(args)
    model.load_state_dict(state["model"])
    val = torch.tensor(val[:args.val_tokens + 1], dtype=torch.int64)
    window = torch.tensor(train_gpt.get_sliding_window_blocks(step, args), dtype=torch.int32)
    chunk = args.max_device_batch_size
    with torch.no_grad():
        losses = [model(val[i:i + chunk].int(), val[i + 1:i + chunk + 1], window)
                  for i in range(0, args.val_tokens, chunk)]
    return torch.stack(losses).mean().item()


def test_one_whole_tiny_smoke_run_in_process(tmp_path):
    """main() from start to finish as `python train_gpt.py --preset smoke` runs it, with no data
    named (its synthetic stream written at start-up), at tiny()'s size: 2 steps of one 128-token
    sequence, validated at every step, a checkpoint at the end. Its log keeps the fixed format, its
    step-0 losses are ln(50,304) (the head starts at zero: uniform logits), it learns, and the
    checkpoint's weights give the final logged val loss again."""
    import train_gpt

    code = train_gpt.main(["--preset", "smoke", *TINY_MODEL, "--num_iterations", "2",
                           "--val_loss_every", "1", "--batch_size", "128",
                           "--max_device_batch_size", "128", "--val_tokens", "128",
                           "--save_checkpoint", "true", "--log_dir", str(tmp_path)])
    assert code == 0
    log = finished_log(tmp_path)
    lines, rest = step_lines(log)
    assert "devices: 1 x cpu" in rest and "  num_iterations = 2" in rest
    assert any(line.startswith("data: synthetic Markov-chain documents (seed 0)") for line in rest)
    losses = val_losses(log)
    assert sorted(losses) == [0, 1, 2]
    assert losses[0] == round(math.log(50304), 4)
    assert lines[1].startswith(f"step:1/2 train_loss:{math.log(50304):.4f} ")
    assert STARTUP_LINE.match(lines[2]) and sum(map(bool, map(STARTUP_LINE.match, lines))) == 1
    assert losses[2] < losses[1] < losses[0]
    # the val tokens it wrote, read here as plain numbers past the 1024-byte header
    val_shard = tmp_path / "synthetic-seed0" / "synthetic_val_000000.bin"
    val = np.fromfile(val_shard, dtype="<u2", offset=1024).astype(np.int64)
    (checkpoint,) = tmp_path.glob(f"{log.stem}/state_step000002.pt")
    assert abs(val_loss_of_checkpoint(checkpoint, val, 2) - losses[2]) < 1e-4


@pytest.mark.slow
def test_log_has_source_header_and_parsable_step_lines(smoke_runs):
    log = smoke_runs.short(1)
    lines, rest = step_lines(log)
    assert rest[2].startswith("Running Python ") and rest[3].startswith("Running PyTorch ")
    assert "devices: 1 x cpu" in rest
    assert "  num_iterations = 4" in rest and any(r.startswith("train shards (2): ") for r in rest)
    steps = [int(TRAIN_LINE.match(x)[1]) for x in lines if TRAIN_LINE.match(x)]
    assert steps == list(range(1, 5))
    # launch-to-first-step, once, right after step 1; it cannot exceed the whole run
    startup = [i for i, line in enumerate(lines) if STARTUP_LINE.match(line)]
    assert len(startup) == 1 and lines[startup[0] - 1].startswith("step:1/4 train_loss:10.8258 ")
    assert 0 < float(STARTUP_LINE.match(lines[startup[0]])[1]) < 600
    assert sorted(val_losses(log)) == [0, 2, 4]
    # timing restarts at step 10: no timed steps yet, so step_avg is nan throughout this short run
    assert all(line.endswith("step_avg:nanms") for line in lines if not STARTUP_LINE.match(line))


@pytest.mark.slow
def test_two_processes_give_the_same_validation_losses_as_one(smoke_runs):
    one, two = val_losses(smoke_runs.short(1)), val_losses(smoke_runs.short(2))
    assert sorted(one) == sorted(two) == [0, 2, 4]
    assert one[0] == two[0] == round(LN_VOCAB, 4)
    # same data, same global batch, same update; only the order of float sums differs
    for step in one:
        assert abs(one[step] - two[step]) < 2e-3, (step, one[step], two[step])
    assert one[4] < one[0] - 1  # and it is not trivially equal because nothing moved


@pytest.mark.slow
def test_two_processes_print_no_deprecation_of_the_calls_torch_2_11_has_no_replacement_for(smoke_runs):
    """torch 2.13 deprecates DDP's broadcast_buffers and dist.all_gather_into_tensor, whose
    replacements 2.11 lacks: their FutureWarnings, on every rank, would only alarm a user."""
    stderr = (smoke_runs.short(2).parents[1] / "stderr.txt").read_text()
    assert "FutureWarning" not in stderr, stderr[-3000:]


@pytest.mark.slow
def test_smoke_run_with_no_data_named_learns_its_synthetic_markov_chain(smoke_runs):
    log = smoke_runs.full()
    _, rest = step_lines(log)
    synthetic = "data: synthetic Markov-chain documents (seed 0), no download needed"
    assert any(line.startswith(synthetic) for line in rest)
    losses = val_losses(log)
    # the val tokens it wrote, read here as plain numbers past the 1024-byte header
    val_shard = log.parent / "synthetic-seed0" / "synthetic_val_000000.bin"
    val = np.fromfile(val_shard, dtype="<u2", offset=1024)
    assert len(val) >= 512 and val[0] == 50256 and val.max() == 50256
    assert val[val != 50256].max() < 256
    entropy = unigram_entropy(val.astype(np.int64))
    final = losses[max(losses)]
    assert losses[0] == round(LN_VOCAB, 4)
    # the chain allows about ln 4 = 1.39 nats; the unigram entropy is about 5.4
    assert final < entropy - 2.5, f"final val loss {final} vs unigram entropy {entropy:.3f}"
    # improves at every evaluation
    assert list(losses.values()) == sorted(losses.values(), reverse=True)


@pytest.mark.slow
def test_checkpoint_is_the_final_model_and_reproduces_the_final_val_loss(smoke_runs, markov_shards):
    log = smoke_runs.short(1)
    (checkpoint,) = log.parent.glob(f"{log.stem}/state_step000004.pt")
    assert abs(val_loss_of_checkpoint(checkpoint, markov_shards[2], 4) - val_losses(log)[4]) < 1e-4
