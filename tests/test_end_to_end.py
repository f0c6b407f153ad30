"""Real runs of the trainer (smoke preset, CPU): 1 process against 2, the log format, and
learning."""
import hashlib

import numpy as np
import pytest
from helpers import LN_VOCAB
from helpers import SOURCE
from helpers import STARTUP_LINE
from helpers import TRAIN_LINE
from helpers import smoke_marked
from helpers import step_lines
from helpers import unigram_entropy
from helpers import val_losses

# test_profile.py reads logs with this file's val_losses
__all__ = ["val_losses"]
# real runs of the trainer, every test
pytestmark = pytest.mark.slow


@smoke_marked(("short", 1))
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


@smoke_marked(("short", 1), ("short", 2))
def test_two_processes_give_the_same_validation_losses_as_one(smoke_runs):
    one, two = val_losses(smoke_runs.short(1)), val_losses(smoke_runs.short(2))
    assert sorted(one) == sorted(two) == [0, 2, 4]
    assert one[0] == two[0] == round(LN_VOCAB, 4)
    # same data, same global batch, same update; only the order of float sums differs
    for step in one:
        assert abs(one[step] - two[step]) < 2e-3, (step, one[step], two[step])
    assert one[4] < one[0] - 1  # and it is not trivially equal because nothing moved


@smoke_marked(("full",))
def test_smoke_run_with_no_data_named_learns_its_synthetic_markov_chain(smoke_runs):
    log = smoke_runs.full()
    _, rest = step_lines(log)
    synthetic = "data: synthetic Markov-chain documents (seed 0), no download needed"
    assert any(line.startswith(synthetic) for line in rest)
    losses = val_losses(log)
    # the val tokens it wrote, read here as plain numbers past the 1024-byte header
    val_shard = log.parent / "synthetic-seed0" / "synthetic_val_000000.bin"
    val = np.fromfile(val_shard, dtype="<u2", offset=1024)
    assert len(val) >= 1024 and val[0] == 50256 and val.max() == 50256
    assert val[val != 50256].max() < 256
    entropy = unigram_entropy(val.astype(np.int64))
    final = losses[max(losses)]
    assert losses[0] == round(LN_VOCAB, 4)
    # the chain allows about ln 4 = 1.39 nats; the unigram entropy is about 5.4
    assert final < entropy - 2.5, f"final val loss {final} vs unigram entropy {entropy:.3f}"
    # improves at every evaluation
    assert list(losses.values()) == sorted(losses.values(), reverse=True)


@smoke_marked(("short", 1))
def test_checkpoint_is_the_final_model_and_reproduces_the_final_val_loss(smoke_runs, markov_shards):
    import torch

    import train_gpt

    log = smoke_runs.short(1)
    (checkpoint,) = log.parent.glob(f"{log.stem}/state_step000004.pt")
    state = torch.load(checkpoint)
    assert state["step"] == 4
    assert state["source_sha256"] == hashlib.sha256(SOURCE.encode()).hexdigest()
    args = train_gpt.Hyperparameters(**state["args"])
    model = train_gpt.GPT.from_args(args)
    model.load_state_dict(state["model"])
    # the val loss recomputed here, chunk by chunk from the val tokens, must be the logged one
    val = torch.tensor(markov_shards[2][:args.val_tokens + 1], dtype=torch.int64)
    window = torch.tensor(train_gpt.window_blocks_at(4, args), dtype=torch.int32)
    chunk = args.max_device_batch_size
    with torch.no_grad():
        losses = [model(val[i:i + chunk].int(), val[i + 1:i + chunk + 1], window)
                  for i in range(0, args.val_tokens, chunk)]
    assert abs(torch.stack(losses).mean().item() - val_losses(log)[4]) < 1e-4
