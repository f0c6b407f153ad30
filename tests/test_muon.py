"""Newton-Schulz against a float64 re-implementation, and Muon in 2 processes against 1."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train_gpt
from muon_worker import SHAPES, STEPS, gradients
from train_gpt import Muon, zeropower_via_newtonschulz5


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


def relative_error(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (128, 128)], ids=["wide", "tall", "square"])
def test_newton_schulz_matches_float64_iteration(shape):
    torch.manual_seed(0)
    G = torch.randn(shape)
    out = zeropower_via_newtonschulz5(G, steps=5)
    assert out.shape == G.shape and out.dtype == torch.bfloat16
    # bf16 keeps ~3 significant digits; five iterations compound that to a few percent
    assert relative_error(out, newton_schulz_float64(G, 5)) < 0.05


@pytest.mark.parametrize("shape", [(64, 256), (256, 64)], ids=["wide", "tall"])
def test_newton_schulz_roughly_orthogonalises(shape):
    torch.manual_seed(1)
    G = torch.randn(shape)
    singular_values = torch.linalg.svdvals(zeropower_via_newtonschulz5(G, steps=5).double())
    assert singular_values.min() > 0.5 and singular_values.max() < 1.3
    # the exact polar factor, for comparison: the direction is what matters
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    cosine = (zeropower_via_newtonschulz5(G, 5).double() * (U @ Vh)).sum() / (U @ Vh).norm() ** 2
    assert cosine > 0.8


def test_newton_schulz_ignores_the_scale_of_its_input():
    torch.manual_seed(2)
    G = torch.randn(96, 160)
    reference = newton_schulz_float64(G, 5)
    for scale in (1e-3, 7.0, 1e4):
        assert relative_error(zeropower_via_newtonschulz5(G * scale, 5), reference) < 0.05


# --- Muon, distributed ------------------------------------------------------------------------

WORKER = Path(__file__).with_name("muon_worker.py")


def run_worker(out_path, nproc):
    """The worker as one process, or as 2 under torchrun with gloo, the way the trainer runs."""
    launcher = [] if nproc == 1 else ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    result = subprocess.run([sys.executable, *launcher, str(WORKER), str(out_path)],
                            capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(out_path)


def muon_reference(shapes, steps):
    """Muon written plainly: one process, one matrix at a time, no chunks and no gathers."""
    torch.manual_seed(0)
    params = [torch.randn(shape) for shape in shapes]
    buffers = [torch.zeros(shape) for shape in shapes]
    for step in range(steps):
        for i, (p, g) in enumerate(zip(params, gradients(step, params))):
            buffers[i] = 0.9 * buffers[i] + 0.1 * g
            update = zeropower_via_newtonschulz5(0.1 * g + 0.9 * buffers[i], 5).float()
            p -= 0.05 * max(1, p.shape[0] / p.shape[1]) ** 0.5 * update
    return params


def test_muon_two_processes_match_one(tmp_path):
    one, two = run_worker(tmp_path / "one.pt", 1), run_worker(tmp_path / "two.pt", 2)
    for a, b in zip(one, two):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    for a, ref in zip(one, muon_reference(SHAPES, STEPS)):
        torch.testing.assert_close(a, ref, rtol=0, atol=2e-3)


def test_muon_groups_by_size_and_reads_world_from_environment(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES]
    optimizer = Muon(params, lr=0.05, momentum=0.95)
    assert (optimizer.rank, optimizer.world_size) == (1, 4)
    assert [len(g["params"]) for g in optimizer.param_groups] == [3, 1, 1]
    assert train_gpt.Muon is Muon
