"""The model's shape facts, its step-0 loss, and that no position sees a later token."""
import math

import pytest
import torch

import train_gpt
from train_gpt import GPT
from train_gpt import Hyperparameters


@pytest.mark.record18
def test_default_model_has_the_records_parameter_count():
    args = Hyperparameters()
    with torch.device("meta"):
        model = GPT(args.vocab_size, args.num_layers, args.num_heads, args.model_dim)
    assert sum(p.numel() for p in model.parameters()) == 275_742_772
    matrices = sum(p.numel() for p in model.blocks.parameters() if p.ndim == 2)
    scalars = sum(p.numel() for p in model.parameters() if p.ndim < 2)
    assert (matrices, scalars) == (82_575_360, 52)
    assert (
        model.embed.weight.dtype == torch.bfloat16 and model.lm_head.weight.dtype == torch.float32
    )


@pytest.mark.record18
def test_block_seven_has_no_attention_and_value_embeddings_follow_012_pattern():
    with torch.device("meta"):
        model = GPT(50304, 12, 6, 768)
    assert [block.attn is None for block in model.blocks] == [i == 7 for i in range(12)]
    assert value_embedding_tables(12) == [0, 1, 2] + [None] * 6 + [0, 1, 2]
    with torch.device("meta"):
        small = GPT(50304, 6, 2, 64)  # fewer than 8 layers: every block has attention
    assert all(block.attn is not None for block in small.blocks)
    assert value_embedding_tables(6) == [0, 1, 2, 0, 1, 2]


def value_embedding_tables(num_layers):
    """Which of the three tables (each filled with its number) each layer's value embedding reads
    (None: none), as the model of that depth builds it."""
    value_embeds = GPT(16, num_layers, 1, 8).value_embeds
    for k, table in enumerate(value_embeds.embed):
        torch.nn.init.constant_(table.weight, k)
    ve = value_embeds(torch.tensor([3]))
    return [None if x is None else int(x[0, 0]) for x in ve]


@pytest.mark.record18
def test_each_attention_layer_has_its_own_copy_of_record_18s_rotary_tables():
    """Each layer's tables: the values of record 18's formula (written again here), in tensors of
    the layer's own."""
    models = [GPT(512, 6, 2, 32), GPT(512, 6, 2, 32)]  # head dimension 16
    quarter = 16 // 4
    angular_freq = (1 / 1024) ** torch.linspace(0, 1, steps=quarter, dtype=torch.float32)
    angular_freq = torch.cat([angular_freq, angular_freq.new_zeros(quarter)])
    theta = torch.einsum("i,j -> ij", torch.arange(65536, dtype=torch.float32), angular_freq)
    rotaries = [block.attn.rotary for model in models for block in model.blocks]
    assert len(rotaries) == 12
    for rotary in rotaries:
        assert torch.equal(rotary.cos, theta.cos()) and torch.equal(rotary.sin, theta.sin())
    # a layer's table changed in place changes no other layer's
    assert len({t.data_ptr() for rotary in rotaries for t in (rotary.cos, rotary.sin)}) == 24
    with torch.device("meta"):
        on_meta = GPT(512, 6, 2, 32)
    assert on_meta.blocks[0].attn.rotary.cos.device.type == "meta"


@pytest.mark.record18
def test_step_zero_loss_is_log_vocab_because_the_head_starts_at_zero():
    torch.manual_seed(0)
    model = GPT(50304, 8, 2, 64)
    # two blocks of 128 tokens: the mean over tokens of ln 50304 is ln 50304 at any length
    tokens = torch.randint(0, 50257, (256,))
    loss = model(tokens.int(), tokens.roll(-1), torch.tensor(2, dtype=torch.int32))
    assert abs(loss.item() - math.log(50304)) < 1e-4


def test_no_position_sees_a_later_token():
    """The logits at positions before t are the same whatever the tokens from t on, for t at a
    sequence's start, inside a block, on a block's edge and at its end; the model's weights random
    (its zero-initialised projections and head would make every logit 0), its window the whole
    sequence of one document."""
    torch.manual_seed(0)
    args = Hyperparameters(vocab_size=1024, num_layers=6, num_heads=2, model_dim=64,
                           bf16_embeds=False)
    model = GPT.from_args(args)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    tokens = torch.randint(0, 1000, (256,), dtype=torch.int32)
    window = torch.tensor(2, dtype=torch.int32)
    with torch.no_grad():
        logits = model(tokens, None, window)
        for t in (1, 100, 128, 255):
            later_changed = torch.cat([tokens[:t], torch.randint(0, 1000, (256 - t,))]).int()
            changed = (model(later_changed, None, window)[:t] - logits[:t]).abs().amax(1) > 1e-6
            assert not changed.any(), (f"attention sees a later token: the logits at position "
                                       f"{int(changed.nonzero()[0])} change with the tokens from "
                                       f"position {t} on")


def test_value_embeddings_reach_the_loss_only_in_their_layers():
    # gradients flow to all three value-embedding tables and to every scalar of the U-net
    torch.manual_seed(0)
    # a vocabulary of 1,024 (the tokens' ids are below 1,000): the head's width is not what is
    # checked
    model = GPT(1024, 8, 2, 64, bf16_embeds=False)
    torch.nn.init.normal_(model.lm_head.weight, std=0.02)  # let gradients through the head
    for block in model.blocks:
        for lin in (block.mlp.c_proj, *([block.attn.c_proj] if block.attn else [])):
            torch.nn.init.normal_(lin.weight, std=0.02)
    tokens = torch.randint(0, 1000, (256,))
    model(tokens, tokens.roll(-1), torch.tensor(2, dtype=torch.int32)).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_cpu_linear_rounds_like_a_bf16_matrix_product():
    """On CPU a bf16 CastedLinear multiplies in fp32 (fast without AVX-512); it must round where a
    bf16 product does."""
    torch.manual_seed(0)
    layer = train_gpt.CastedLinear(96, 160)
    x = torch.randn(64, 96).bfloat16().requires_grad_()
    y = layer(x)
    weight = layer.weight.detach().bfloat16().requires_grad_()
    reference = torch.nn.functional.linear(x, weight)  # PyTorch's own bf16 product
    assert y.dtype == torch.bfloat16
    # one bf16 rounding apart at most
    torch.testing.assert_close(y, reference, rtol=8e-3, atol=1e-5)
    g = torch.randn(64, 160).bfloat16()
    grads = torch.autograd.grad(y, (x, layer.weight), g)
    ref_grads = torch.autograd.grad(reference, (x, weight), g)
    assert grads[0].dtype == torch.bfloat16 and grads[1].dtype == torch.float32
    torch.testing.assert_close(grads[0], ref_grads[0], rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(grads[1], ref_grads[1].float(), rtol=8e-3, atol=1e-5)


@pytest.fixture
def dynamo_config_restored(monkeypatch):
    """compile_regions sets dynamo's graph limit for the whole process: put it back after the
    test."""
    import torch._dynamo

    config = torch._dynamo.config
    for name in ("recompile_limit", "fail_on_recompile_limit_hit"):
        monkeypatch.setattr(config, name, getattr(config, name))
    return config


@pytest.mark.slow
def test_regional_compile_traces_four_block_forms_and_the_head(monkeypatch, dynamo_config_restored):
    import functools

    from torch._dynamo.testing import CompileCounter

    import train_gpt

    # counts the graphs Dynamo hands to the backend, then runs them eagerly
    counter = CompileCounter()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=counter))
    torch._dynamo.reset()
    torch.manual_seed(0)
    # 8 layers: blocks 0-2 and 5-6 with value embeddings, 3-4 without, 7 without attention; block
    # 0's input is x0 itself, which Dynamo traces as a form of its own
    model = GPT(1024, 8, 2, 64, bf16_embeds=False)
    for p in model.parameters():  # the zero-initialised projections would hide a skipped block
        torch.nn.init.normal_(p, std=0.05)
    tokens = torch.randint(0, 1024, (257,))
    inputs, targets, window = tokens[:-1], tokens[1:], torch.tensor(2, dtype=torch.int32)
    plain = model(inputs, targets, window)
    regional = train_gpt.compile_regions(model)
    for _ in range(2):  # the second call reuses every graph
        loss = regional(inputs, targets, window)
    assert counter.frame_count == 5  # four block forms and the head, not one graph per block
    torch.testing.assert_close(loss, plain)


def test_auto_options_are_on_with_cuda_and_off_on_a_cpu(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # device objects only: no GPU needed
    assert [train_gpt.switched_on(v, cuda) for v in ("auto", "true", "false")] == [
        True,
        True,
        False,
    ]
    assert [train_gpt.switched_on(v, cpu) for v in ("auto", "true", "false")] == [
        False,
        True,
        False,
    ]
    # fused_head_loss is "auto" by default
    args = Hyperparameters(num_layers=6, num_heads=2, model_dim=64)
    with torch.device("meta"):
        assert GPT.from_args(args, cuda).fused_head_loss == (train_gpt.triton is not None)
        assert not GPT.from_args(args, cpu).fused_head_loss
        # as on macOS and Windows: its kernel needs triton
        monkeypatch.setattr(train_gpt, "triton", None)
        assert not GPT.from_args(args, cuda).fused_head_loss


@pytest.mark.slow
def test_regional_compile_keeps_its_forms_compiled_and_never_falls_back_silently(
    dynamo_config_restored,
):
    """Training and evaluation trace 8 block forms, dynamo's default limit of graphs per function,
    past which it runs the function uncompiled without a word: compile_regions gives the limit
    headroom and makes a form past it an error."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    with torch.device("meta"):
        train_gpt.compile_regions(GPT(1024, 6, 2, 64))
    counter = CompileCounter()
    # one function, a new static shape per call: a new graph each time, 9 in all
    add_one = torch.compile(lambda x: x + 1, backend=counter, dynamic=False)
    for n in range(1, 10):
        add_one(torch.zeros(n))
    assert counter.frame_count == 9
    assert dynamo_config_restored.fail_on_recompile_limit_hit
    torch._dynamo.reset()


@pytest.mark.skipif(train_gpt.triton is None, reason="the fused head needs triton")
def test_fused_head_auto_is_off_on_rocm_builds(monkeypatch):
    """ROCm's GPUs are "cuda" devices too, but cannot build the kernel's PTX instruction."""
    args = Hyperparameters(num_layers=6, num_heads=2, model_dim=64)
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    with torch.device("meta"):
        assert not GPT.from_args(args, cuda).fused_head_loss
        args.fused_head_loss = "true"
        assert GPT.from_args(args, cuda).fused_head_loss
