"""Newton-Schulz and Muon's batched step against per-matrix re-implementations (bf16 and float64),
and Muon in 2 and 3 processes against 1."""
import os
from pathlib import Path

import muon_worker
import pytest
import torch
from helpers import BACKGROUND
from launch_worker import launch_part
from launch_worker import outcome
from muon_worker import SCHEDULE
from muon_worker import SHAPES
from muon_worker import STEPS
from muon_worker import gradients
from processes import WARM_PYTHON
from processes import worker_env

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


# --- Muon's batched step -----------------------------------------------------------------------

def aspect_scale(p):
    return max(1, p.shape[0] / p.shape[1]) ** 0.5


# The compiled cases: inductor's C++ on the CPU, seconds of one core, in a fork of the warm
# interpreter on the background queue, beside the in-process tests; in the folder tests/, where
# `python -c` finds muon_worker and helpers
COMPILED_CASES = """import sys
import muon_worker
muon_worker.compiled_cases(sys.argv[1])
"""


def compiled_in_background(request):
    """The compiled cases' results (muon_worker.compiled_cases), once; gives the job's future."""
    tmp = request.getfixturevalue("tmp_path_factory")

    def run():
        path = tmp.mktemp("muon_compiled") / "cases.pt"
        result = WARM_PYTHON.run(COMPILED_CASES, [path], 300, cwd=Path(__file__).resolve().parent,
                                 env=worker_env(OMP_NUM_THREADS="1"))
        assert result.returncode == 0, result.stderr[-3000:]
        return torch.load(path)
    return BACKGROUND.once("muon_compiled", run)


def compiled_case(request, key):
    """A compiled case's results: "batched" (batched_step), or scheduled_steps' with Nesterov (True)
    or without (False)."""
    return compiled_in_background(request).result()[key]


COMPILED = pytest.param(True, marks=[pytest.mark.slow,
                                     pytest.mark.background.with_args(compiled_in_background)])


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
        grads, params = muon_worker.batched_step(False)
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
        start, grads_per_step, params, state = muon_worker.scheduled_steps(False, nesterov)
    reference = muon_float64(start, grads_per_step, SCHEDULE, nesterov)
    for p, p0, ref in zip(params, start, reference):
        assert relative_error(p - p0, ref - p0) < 0.05  # the steps taken, to bf16 accuracy
    # the optimiser state is the momentum alone; the stacked and gather buffers stay outside
    # checkpoints
    assert state == [["momentum_buffer"]] * len(start)


# --- Muon, distributed ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def one_process():
    """The worker's training in this process: world size 1, no process group."""
    assert "WORLD_SIZE" not in os.environ
    return muon_worker.train()


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


@pytest.mark.slow
@pytest.mark.background.with_args(launch_part("muon"))
@pytest.mark.parametrize("nproc", [2, 3])
def test_muon_processes_match_one(request, one_process, nproc):
    """Uneven shares and groups smaller than the world (see SHAPES): every matrix is still applied
    once. In the first part of tests/launch_worker.py's torchrun launch (3 processes, then ranks 0
    and 1 alone)."""
    muon = outcome(request, "muon")
    assert muon.codes == [0, 0, 0], "".join(muon.stderr)[-3000:]
    for a, b in zip(one_process, torch.load(muon.log_dir / f"{nproc}.pt")):
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
