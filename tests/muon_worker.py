"""Muon on fixed parameters and gradients, as one process or under torchrun; saves rank 0's result.

Run by tests/test_muon.py: `python tests/muon_worker.py OUT` or through torchrun with 2 processes,
the way the trainer itself is launched.
"""
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from train_gpt import Muon  # noqa: E402

SHAPES = [(32, 48), (32, 48), (32, 48), (48, 16), (16, 24)]  # 3 of one size: uneven over 2 ranks
STEPS = 3


def gradients(step, params):
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen) for p in params]


def main(out_path):
    world_size = int(os.environ.get("WORLD_SIZE", 1))  # Muon reads RANK and WORLD_SIZE itself
    if world_size > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in SHAPES]
    optimizer = Muon(params, lr=0.05, momentum=0.9)
    for step in range(STEPS):
        for p, g in zip(params, gradients(step, params)):
            p.grad = g
        optimizer.step()
    if int(os.environ.get("RANK", 0)) == 0:
        torch.save([p.detach() for p in params], out_path)
    if world_size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    # Leave without interpreter teardown: with torch 2.13 on CPU, a process that used torch.optim
    # and a gloo group sometimes aborts at exit ("terminate called without an active exception"),
    # after its work is done; a 10-line script with SGD and one all-gather shows it too.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
