"""The optimisers and schedules are record 18's, and compiling them never recompiles per step."""
import pytest
import torch
from helpers import TINY_MODEL

import train_gpt
from train_gpt import GPT
from train_gpt import Muon
from train_gpt import build_optimizers
from train_gpt import get_lr
from train_gpt import muon_momentum
from train_gpt import parse_args


@pytest.mark.record18
def test_optimizer_defaults_are_record_18s():
    args = parse_args([])
    model = GPT(512, 6, 2, 64)
    adam, muon = build_optimizers(model, args)
    assert isinstance(adam, torch.optim.Adam) and isinstance(muon, Muon)
    # PyTorch's default eps
    assert adam.defaults["betas"] == (0.8, 0.95) and adam.defaults["eps"] == 1e-8
    embeds, head, scalars = adam.param_groups
    assert embeds["lr"] == 0.6 and head["lr"] == 0.008 and scalars["lr"] == 0.04
    tables = [model.embed.weight, *(t.weight for t in model.value_embeds.embed)]
    assert [id(p) for p in embeds["params"]] == [id(p) for p in tables]
    assert head["params"] == [model.lm_head.weight]
    assert {id(p) for p in scalars["params"]} == {id(p) for p in model.parameters() if p.ndim < 2}
    assert muon.defaults == dict(lr=0.05, momentum=0.95, nesterov=True, ns_steps=5)
    matrices = {id(p) for p in model.blocks.parameters() if p.ndim == 2}
    assert {id(p) for g in muon.param_groups for p in g["params"]} == matrices
    # every parameter in exactly one optimizer
    owned = [id(p) for opt in (adam, muon) for g in opt.param_groups for p in g["params"]]
    assert sorted(owned) == sorted(id(p) for p in model.parameters())


@pytest.mark.record18
def test_schedules_are_record_18s():
    args = parse_args([])
    assert args.num_iterations == 1390 and args.cooldown_frac == 0.4
    assert [muon_momentum(s, args) for s in (0, 150, 300, 1000)] == pytest.approx(
        [0.85, 0.90, 0.95, 0.95]
    )
    N = args.num_iterations
    # 1 - 834/1390 = 0.4: still flat
    assert get_lr(0, args) == get_lr(834, args) == 1.0
    assert get_lr(1112, args) == pytest.approx((1 - 1112 / N) / 0.4)
    assert get_lr(N, args) == 0


def test_adam_eps_is_one_flag_away():
    adam, _ = build_optimizers(GPT(512, 6, 2, 64), parse_args(["--adam_eps", "1e-10"]))
    assert adam.defaults["eps"] == 1e-10


@pytest.mark.slow
def test_compiled_newton_schulz_compiles_once_per_stacked_shape_and_computes_the_same(monkeypatch):
    """Muon's compiled iteration: tall matrices join their wide twins' batch; later steps, with new
    lr and momentum, reuse the graphs."""
    # imported here: torch._dynamo is seconds of every collection
    from torch._dynamo.testing import CompileCounter
    counter = CompileCounter()  # counts the graphs dynamo compiles, runs them eagerly
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, backend=counter, **kw))
    torch._dynamo.reset()
    # batches (3, 32, 32), (3, 32, 96)
    shapes = [(32, 32), (96, 32), (32, 32), (32, 96), (32, 32), (96, 32)]

    def run(compiled):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
        muon = Muon(params, lr=0.05, momentum=0.9, compiled=compiled)
        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            for group in muon.param_groups:
                group["lr"] = 0.05 / (step + 1)
                group["momentum"] = 0.85 + 0.05 * step
            muon.step()
            # from the first step on: three steps, six matrices, two graphs
            assert counter.frame_count == 2
        return params

    compiled, plain = run(True), run(False)
    for a, b in zip(compiled, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "world_size, stacked",
    [(1, [(24, 768, 3072), (44, 768, 768)]), (8, [(3, 768, 3072), (6, 768, 768)])],
)
@pytest.mark.record18
def test_default_model_stacks_muon_matrices_in_two_batches(monkeypatch, world_size, stacked):
    """The 68 matrices (q, k, v, proj of 11 attention blocks; fc and proj of 12 MLPs): two graphs
    per rank."""
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    args = parse_args([])
    with torch.device("meta"):  # shapes only, no memory
        model = GPT(args.vocab_size, args.num_layers, args.num_heads, args.model_dim)
    muon = Muon(
        [p for p in model.blocks.parameters() if p.ndim == 2],
        lr=args.muon_lr,
        momentum=args.muon_momentum,
    )
    assert [tuple(x.shape) for x in muon.stacked] == stacked


@pytest.mark.slow
def test_no_inductor_option_is_changed_unless_asked(monkeypatch, markov_shards, tmp_path):
    """The compile branch of train(), with torch.compile made a no-op so that it costs nothing on a
    CPU; tiny()'s model (the size is not what is checked)."""
    from torch._inductor import config as inductor_config

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    monkeypatch.setattr(inductor_config, "coordinate_descent_tuning", False)
    run = [
        "--preset",
        "smoke",
        "--train_files",
        markov_shards[0],
        "--val_files",
        markov_shards[1],
        "--num_iterations",
        "1",
        "--val_loss_every",
        "0",
        "--batch_size",
        "128",
        "--max_device_batch_size",
        "128",
        "--val_tokens",
        "128",
        "--compile",
        "true",
        *TINY_MODEL,
        "--log_dir",
        str(tmp_path),
    ]
    assert train_gpt.main(run) == 0 and inductor_config.coordinate_descent_tuning is False
    assert (
        train_gpt.main(run + ["--compile_tuning", "true"]) == 0
        and inductor_config.coordinate_descent_tuning
    )
