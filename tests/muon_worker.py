"""Muon on fixed parameters and gradients, in whatever world RANK and WORLD_SIZE describe: in
tests/test_muon.py's own process, and in the first part of tests/launch_worker.py's torchrun launch
(the worlds of 3 and 2), the way the trainer itself is launched. And Muon's single-process cases of
tests/test_muon.py, eager there, compiled by inductor in a process of their own (compiled_cases)."""
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


# --- the single-process cases ---------------------------------------------------------------------

# batches (3, 16, 40) (a tall matrix transposed into it) and (2, 24, 24); small, so inductor
# compiles fast
MIXED = [(16, 40), (40, 16), (16, 40), (24, 24), (24, 24)]
# compiled: one stacked shape, one graph (each costs seconds of C++ compile on a CPU); eager covers
# two groups
SHAPES_FOR = {False: MIXED, True: MIXED[:3]}
# lr and momentum of 4 steps, which the training loop sets in each step
SCHEDULE = [(0.05, 0.85), (0.04, 0.9), (0.03, 0.95), (0.02, 0.95)]


def batched_step(compiled):
    """One step (momentum 0: the update is the gradient itself; lr 1: the step is the scaled update)
    on matrices of scales 1e-3 to 10 in one batch; gives (their gradients, their values after)."""
    torch.manual_seed(3)
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES_FOR[compiled]]
    for i, p in enumerate(params):
        p.grad = torch.randn(p.shape) * 10.0 ** (i - 3)
    Muon(params, lr=1.0, momentum=0.0, compiled=compiled).step()
    return [p.grad for p in params], [p.detach() for p in params]


def scheduled_steps(compiled, nesterov):
    """SCHEDULE's steps from random values and gradients; gives (the values at the start, the
    gradients of each step, the values after, the names in each matrix's optimiser state)."""
    torch.manual_seed(4)
    shapes = SHAPES_FOR[compiled]
    start = [torch.randn(shape) for shape in shapes]
    grads_per_step = [[torch.randn(shape) for shape in shapes] for _ in SCHEDULE]
    params = [torch.nn.Parameter(p.clone()) for p in start]
    muon = Muon(params, lr=1.0, momentum=0.0, nesterov=nesterov, compiled=compiled)
    for grads, (lr, m) in zip(grads_per_step, SCHEDULE):
        for group in muon.param_groups:
            group["lr"] = lr
            group["momentum"] = m
        for p, g in zip(params, grads):
            p.grad = g
        muon.step()
    state = [sorted(s) for s in muon.state_dict()["state"].values()]
    return start, grads_per_step, [p.detach() for p in params], state


def compiled_cases(path):
    """Both cases compiled (scheduled_steps with and without Nesterov), as tests compile on the CPU
    (helpers.inductor_on_the_cpu), saved to path: {"batched": ..., True: ..., False: ..., "graphs":
    the number of graphs compiled}."""
    from helpers import inductor_on_the_cpu
    with inductor_on_the_cpu():
        cases = {"batched": batched_step(True)}
        cases.update({nesterov: scheduled_steps(True, nesterov) for nesterov in (True, False)})
    cases["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch.save(cases, path)
