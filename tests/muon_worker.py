"""Muon on fixed parameters and gradients, as one process or under torchrun; saves rank 0's result.

Run by tests/test_muon.py through one torchrun launch of 3 processes, the way the trainer itself is
launched: Muon in the world of 3, then ranks 0 and 1 in a new world of 2 (rank 2 leaves), each
world's rank 0 saving its result as N.pt in the folder given. The test runs train() in its own
process for the single-process result."""
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from train_gpt import Muon

# stacked as 5 of (32, 48), tall ones transposed: shares 3+2 on 2 ranks, 2+2+1 on 3; one (16, 48)
# and two (24, 24): fewer matrices than ranks, so some ranks send only padding
SHAPES = [(32, 48), (48, 32), (32, 48), (32, 48), (48, 32), (48, 16), (24, 24), (24, 24)]
STEPS = 3


def gradients(step, params):
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen) for p in params]


def train():
    """STEPS steps of Muon on SHAPES; in whatever world RANK and WORLD_SIZE describe (Muon reads
    them)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in SHAPES]
    optimizer = Muon(params, lr=0.05, momentum=0.9)
    for step in range(STEPS):
        for p, g in zip(params, gradients(step, params)):
            p.grad = g
        optimizer.step()
    return [p.detach() for p in params]


def main(out_dir):
    """The world torchrun made, then, with 3 or more processes, ranks 0 and 1 alone: Muon reads the
    world from RANK and WORLD_SIZE, which are set to it, and its gathers use the default group."""
    out_dir = Path(out_dir)
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size > 1:
        dist.init_process_group("gloo")
    params = train()
    if rank == 0:
        torch.save(params, out_dir / f"{world_size}.pt")
    if world_size > 1:
        dist.destroy_process_group()
    if world_size < 3 or rank >= 2:
        return
    os.environ["WORLD_SIZE"] = "2"
    store = dist.FileStore(str(out_dir / "world_of_2.store"), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    params = train()
    if rank == 0:
        torch.save(params, out_dir / "2.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    # Leave without interpreter teardown: with torch 2.13 on CPU, a process that used torch.optim
    # and a gloo group sometimes aborts at exit ("terminate called without an active exception"),
    # after its work is done; a 10-line script with SGD and one all-gather shows it too.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
