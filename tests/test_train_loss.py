"""Every step's train loss in the log: the values real smoke runs wrote against the losses a plain
loop computes on the same batches, from the same initial weights, with the same optimisers."""
import re

import pytest
import torch
from helpers import LN_VOCAB

import train_gpt

# real runs of the trainer, every test
pytestmark = pytest.mark.slow

TRAIN_LOSS = re.compile(r"^step:(\d+)/\d+ train_loss:(\d+\.\d{4}) ")


def logged_train_losses(log):
    matches = map(TRAIN_LOSS.match, log.read_text().splitlines())
    return {int(m[1]): float(m[2]) for m in matches if m}


def plain_loop_losses(args, steps):
    """Each step's list of micro-batch losses: the model built and stepped in a loop of its own."""
    torch.manual_seed(args.seed)
    model = train_gpt.GPT.from_args(args)
    adam, muon = train_gpt.build_optimizers(model, args)
    loader = train_gpt.DistributedDataLoader(args.train_files, 0, 1, torch.device("cpu"))
    micro_batch = args.max_device_batch_size
    accum_steps = args.batch_size // micro_batch
    losses = []
    for step in range(steps):
        window = torch.tensor(train_gpt.get_sliding_window_blocks(step, args), dtype=torch.int32)
        inputs, targets = loader.next_batch(args.batch_size)
        step_losses = []
        for start in range(0, args.batch_size, micro_batch):
            part = slice(start, start + micro_batch)
            loss = model(inputs[part], targets[part], window)
            (loss / accum_steps).backward()
            step_losses.append(loss.item())
        for group in (*adam.param_groups, *muon.param_groups):
            group["lr"] = group["initial_lr"] * train_gpt.get_lr(step, args)
        for group in muon.param_groups:
            group["momentum"] = train_gpt.muon_momentum(step, args)
        adam.step()
        muon.step()
        model.zero_grad(set_to_none=True)
        losses.append(step_losses)
    return losses


@pytest.fixture(scope="module")
def plain_loop(smoke_runs):
    """The plain loop's losses for the short smoke run's options (from its checkpoint), over its
    first 2 steps: the first, from the initial weights, and the second, after an update (Muon's
    bf16 iterations make each step on a CPU cost a second)."""
    log = smoke_runs.short(1)
    (checkpoint,) = log.parent.glob(f"{log.stem}/state_step*.pt")
    args = train_gpt.Hyperparameters(**torch.load(checkpoint)["args"])
    assert args.batch_size == 2 * args.max_device_batch_size  # 2 micro-batches on 1 process
    return plain_loop_losses(args, steps=2)


def test_one_process_logs_the_mean_over_its_micro_batches(smoke_runs, plain_loop):
    logged = logged_train_losses(smoke_runs.short(1))
    assert sorted(logged) == [1, 2, 3, 4] and logged[1] == round(LN_VOCAB, 4)
    for step, micro_losses in enumerate(plain_loop, 1):
        # printed to 4 decimals
        assert logged[step] == pytest.approx(sum(micro_losses) / 2, abs=6e-5), (
            f"step {step}: the logged train loss is not the plain loop's on the train shards")
    assert logged[4] < logged[2] < logged[1]


def test_two_processes_log_rank_0s_micro_batch(smoke_runs, plain_loop):
    logged = logged_train_losses(smoke_runs.short(2))
    for step, (first, _) in enumerate(plain_loop, 1):
        # rank 0 takes the first half of each batch; 2 processes sum the gradients in another order
        # than 1, which Muon's bf16 iteration can amplify (the val losses allow 2e-3; these
        # measured within the printing's 5e-5)
        assert logged[step] == pytest.approx(first, abs=2e-3), (
            f"step {step}: rank 0's logged train loss is not the plain loop's on its micro-batch")
    # so the halves are told apart
    assert abs(plain_loop[1][0] - plain_loop[1][1]) > 1e-2
