"""Muon on fixed parameters and gradients, in whatever world RANK and WORLD_SIZE describe: in
tests/test_muon.py's own process, and in the first part of tests/launch_worker.py's torchrun launch
(the worlds of 3 and 2), the way the trainer itself is launched."""
import torch

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
