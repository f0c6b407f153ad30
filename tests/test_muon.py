"""Muon's update is orthogonal; Newton-Schulz and Muon's batched step against per-matrix
re-implementations (bf16 and float64), and Muon in 2 and 3 processes against 1."""
import inspect
import os

import pytest
import torch
from helpers import inductor_on_the_cpu
from helpers import launch_env
from helpers import made_once
from helpers import run_process
from helpers import torchrun
from helpers import with_trainer

import train_gpt
from train_gpt import Muon
from train_gpt import newton_schulz_wide


def newton_schulz_float64(G, steps):
    """The same quintic iteration, written independently, in float64 (no bf16 rounding)."""
    X = G.double()
    if X.shape[0] > X.shape[1]:
        X = X.T
    X = X / (torch.linalg.matrix_norm(X) + 1e-7)
    for _ in range(steps):
        A = X @ X.T
        X = 3.4445 * X + (-4.7750 * A + 2.0315 * A @ A) @ X
    return X.T if G.shape[0] > G.shape[1] else X


def newton_schulz_bf16(G, steps):
    """The iteration one 2-D matrix at a time in bf16, op for op as Muon ran it before batching."""
    tall = G.shape[0] > G.shape[1]
    X = (G.T if tall else G).bfloat16()
    X = X / (X.norm() + 1e-7)
    for _ in range(steps):
        A = X @ X.T
        B = -4.7750 * A + 2.0315 * A @ A
        X = 3.4445 * X + B @ X
    return X.T if tall else X


def trainer_newton_schulz(G, steps):
    """The trainer's iteration on one matrix, a tall one as its wide transpose, as Muon stacks
    it."""
    tall = G.shape[0] > G.shape[1]
    X = newton_schulz_wide((G.T if tall else G).bfloat16()[None], steps)[0]
    return X.T if tall else X


def relative_error(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.record18
@pytest.mark.parametrize(
    "shape", [(64, 256), (256, 64), (128, 128)], ids=["wide", "tall", "square"]
)
def test_newton_schulz_matches_float64_iteration(shape):
    torch.manual_seed(0)
    G = torch.randn(shape)
    out = trainer_newton_schulz(G, steps=5)
    assert out.shape == G.shape and out.dtype == torch.bfloat16
    # bf16 keeps ~3 significant digits; five iterations compound that to a few percent
    assert relative_error(out, newton_schulz_float64(G, 5)) < 0.05
    assert relative_error(out, newton_schulz_bf16(G, 5)) < 1e-3  # the same bf16 operations


@pytest.mark.record18
@pytest.mark.parametrize("shape", [(64, 256), (256, 64)], ids=["wide", "tall"])
def test_newton_schulz_roughly_orthogonalises(shape):
    torch.manual_seed(1)
    G = torch.randn(shape)
    singular_values = torch.linalg.svdvals(trainer_newton_schulz(G, steps=5).double())
    assert singular_values.min() > 0.5 and singular_values.max() < 1.3
    # the exact polar factor, for comparison: the direction is what matters
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    cosine = (trainer_newton_schulz(G, 5).double() * (U @ Vh)).sum() / (U @ Vh).norm() ** 2
    assert cosine > 0.8


@pytest.mark.record18
def test_newton_schulz_ignores_the_scale_of_its_input():
    torch.manual_seed(2)
    G = torch.randn(96, 160)
    reference = newton_schulz_float64(G, 5)
    for scale in (1e-3, 7.0, 1e4):
        assert relative_error(trainer_newton_schulz(G * scale, 5), reference) < 0.05


@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (96, 160)], ids=["wide", "tall", "other"])
def test_muons_update_is_orthogonal(shape):
    """Muon's step on one matrix (momentum 0: the update is the gradient G's): whatever its
    iteration, coefficients or scale, the step's singular values lie within a factor of 2 of each
    other (G's own: a factor of 3 and more), and it points along G's polar factor UV^T."""
    torch.manual_seed(1)
    G = torch.randn(shape)
    p = torch.nn.Parameter(torch.zeros(shape))
    p.grad = G.clone()
    Muon([p], lr=1.0, momentum=0.0).step()
    update = -p.detach().double()
    singular_values = torch.linalg.svdvals(update)
    smallest, largest = singular_values.min().item(), singular_values.max().item()
    assert largest < 2 * smallest, (f"Muon's update is not orthogonal: its singular values span "
                                    f"{smallest:.3g} to {largest:.3g}")
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    cosine = (update * (U @ Vh)).sum() / (update.norm() * (U @ Vh).norm())
    assert cosine > 0.9, f"Muon's update is not along the gradient's UV^T: cosine {cosine:.3f}"


# --- Muon's batched step -----------------------------------------------------------------------

def aspect_scale(p):
    return max(1, p.shape[0] / p.shape[1]) ** 0.5


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


def compiled_cases(folder):
    """Both cases compiled by inductor (seconds of C++ on a CPU), saved in folder; gives the number
    of graphs compiled."""
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with inductor_on_the_cpu():
        cases = {"batched": batched_step(True)}
        cases.update({nesterov: scheduled_steps(True, nesterov) for nesterov in (True, False)})
    torch.save(cases, folder / "cases.pt")
    return torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before


def compiled_case(request, key):
    """A compiled case's results, made once per session: "batched" (batched_step), scheduled_steps'
    with Nesterov (True) or without (False), or "graphs", the number of graphs they compiled."""
    factory = request.getfixturevalue("tmp_path_factory")
    folder, graphs = made_once(factory, "muon_compiled", compiled_cases)
    if key == "graphs":
        return graphs
    return torch.load(folder / "cases.pt")[key]


COMPILED = pytest.param(True, marks=pytest.mark.slow)


@pytest.mark.record18
@pytest.mark.parametrize("compiled", [False, COMPILED], ids=["eager", "compiled"])
def test_batched_step_gives_each_matrix_its_own_iteration(request, compiled):
    """Matrices of scales 1e-3 to 10 in one batch: each is normalised alone, transposed back, scaled
    alone."""
    if compiled:
        grads, params = compiled_case(request, "batched")
        # compiled, once for all the cases
        assert compiled_case(request, "graphs") == 1
    else:
        grads, params = batched_step(False)
    for grad, p in zip(grads, params):
        update = -p / aspect_scale(p)
        assert relative_error(update, newton_schulz_float64(grad, 5)) < 0.05
        # inductor fuses the elementwise ops, rounding less often: only near float64
        if not compiled:
            assert relative_error(update, newton_schulz_bf16(grad, 5)) < 1e-3


def muon_float64(params, grads_per_step, schedule, nesterov):
    """Muon's whole step in float64, one matrix at a time: momentum, look-ahead, iteration, scale,
    lr."""
    params = [p.double() for p in params]
    buffers = [torch.zeros_like(p) for p in params]
    for grads, (lr, m) in zip(grads_per_step, schedule):
        for p, buf, g in zip(params, buffers, grads):
            buf.mul_(m).add_((1 - m) * g.double())
            update = (1 - m) * g.double() + m * buf if nesterov else buf
            p -= lr * aspect_scale(p) * newton_schulz_float64(update, 5)
    return params


@pytest.mark.record18
@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "plain"])
@pytest.mark.parametrize("compiled", [False, COMPILED], ids=["eager", "compiled"])
def test_muon_step_matches_float64(request, compiled, nesterov):
    if compiled:
        start, grads_per_step, params, state = compiled_case(request, nesterov)
    else:
        start, grads_per_step, params, state = scheduled_steps(False, nesterov)
    reference = muon_float64(start, grads_per_step, SCHEDULE, nesterov)
    for p, p0, ref in zip(params, start, reference):
        assert relative_error(p - p0, ref - p0) < 0.05  # the steps taken, to bf16 accuracy
    # the optimiser state is the momentum alone; the stacked and gather buffers stay outside
    # checkpoints
    assert state == [["momentum_buffer"]] * len(start)


# --- Muon, distributed ------------------------------------------------------------------------

# stacked as 5 of (32, 48), tall ones transposed: shares 3+2 on 2 ranks, 2+2+1 on 3; one (16, 48)
# and two (24, 24): fewer matrices than ranks, so some ranks send only padding
SHAPES = [(32, 48), (48, 32), (32, 48), (32, 48), (48, 32), (48, 16), (24, 24), (24, 24)]
STEPS = 3


def gradients(step, params):
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen) for p in params]


def train():
    """STEPS steps of the trainer's Muon on SHAPES, in whatever world RANK and WORLD_SIZE describe
    (Muon reads them): in this process, and in each rank of the torchrun launch below."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in SHAPES]
    optimizer = Muon(params, lr=0.05, momentum=0.9)
    for step in range(STEPS):
        for p, g in zip(params, gradients(step, params)):
            p.grad = g
        optimizer.step()
    return [p.detach() for p in params]


@pytest.fixture(scope="module")
def one_process():
    """The worker's training in this process: world size 1, no process group."""
    assert "WORLD_SIZE" not in os.environ
    return train()


def muon_reference(shapes, steps):
    """Muon written plainly: one process, one matrix at a time, no batches and no gathers."""
    torch.manual_seed(0)
    params = [torch.randn(shape) for shape in shapes]
    buffers = [torch.zeros(shape) for shape in shapes]
    for step in range(steps):
        for i, (p, g) in enumerate(zip(params, gradients(step, params))):
            buffers[i] = 0.9 * buffers[i] + 0.1 * g
            update = newton_schulz_bf16(0.1 * g + 0.9 * buffers[i], 5).float()
            p -= 0.05 * max(1, p.shape[0] / p.shape[1]) ** 0.5 * update
    return params


@pytest.mark.record18
def test_muon_one_process_matches_plain_muon(one_process):
    for a, ref in zip(one_process, muon_reference(SHAPES, STEPS)):
        torch.testing.assert_close(a, ref, rtol=0, atol=2e-3)


# a rank of a launch of 3, after train() and what it reads (their source, copied in): train() in
# that world, then in ranks 0 and 1 alone, a world of 2; each world through a store of its own in
# FOLDER, where its rank 0 saves the parameters
MUON_IN_3_AND_2_PROCESSES = """folder = Path(sys.argv[1])
rank = int(os.environ["RANK"])
for world_size in (3, 2):
    if rank < world_size:
        # Muon reads the world from the environment
        os.environ["WORLD_SIZE"] = str(world_size)
        store = torch.distributed.FileStore(str(folder / f"store_{world_size}"), world_size)
        torch.distributed.init_process_group("gloo", store=store, rank=rank,
                                             world_size=world_size)
        params = train()
        if rank == 0:
            torch.save(params, folder / f"{world_size}.pt")
        torch.distributed.destroy_process_group()
helpers.exit_as_a_rank(0)
"""


def muon_in_3_and_2_processes(folder):
    """Muon's parameters in worlds of 3 and 2, in folder as 3.pt and 2.pt."""
    definitions = ["import os", "from pathlib import Path", "import torch",
                   "from train_gpt import Muon", f"SHAPES = {SHAPES!r}", f"STEPS = {STEPS}",
                   inspect.getsource(gradients), inspect.getsource(train), MUON_IN_3_AND_2_PROCESSES]
    (folder / "rank.py").write_text(with_trainer("\n".join(definitions)))
    launch = torchrun(3, folder / "rank.py", folder)
    result = run_process(launch, 300, env=launch_env(OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 3])
def test_muon_processes_match_one(one_process, nproc, tmp_path_factory):
    """Uneven shares and groups smaller than the world (see SHAPES): every matrix is still applied
    once. Under torchrun, as the trainer is launched (one launch for both, made once)."""
    folder, _ = made_once(tmp_path_factory, "muon_processes", muon_in_3_and_2_processes)
    processes = torch.load(folder / f"{nproc}.pt")
    assert len(processes) == len(one_process) == len(SHAPES)
    for a, b in zip(one_process, processes):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_muon_groups_by_shape_and_reads_world_from_environment(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    # the tall (48, 32) joins (32, 48)
    shapes = [(32, 48), (32, 48), (32, 48), (48, 16), (16, 24), (48, 32)]
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    optimizer = Muon(params, lr=0.05, momentum=0.95)
    assert (optimizer.rank, optimizer.world_size) == (1, 4)
    assert [len(g["params"]) for g in optimizer.param_groups] == [4, 1, 1]
    assert optimizer.param_groups[0]["params"][3] is params[5]
    # each rank's share of a group, padded to the largest share, and room for every rank's share
    assert [tuple(x.shape) for x in optimizer.stacked] == [(1, 32, 48), (1, 16, 48), (1, 16, 24)]
    assert [tuple(x.shape) for x in optimizer.gathered] == [(4, 32, 48), (4, 16, 48), (4, 16, 24)]
    assert train_gpt.Muon is Muon
