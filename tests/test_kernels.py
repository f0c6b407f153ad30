"""The speed options (issue 9) compute what the plain model computes: each against an independent
reference (the unfused PyTorch expression, float64 where rounding matters), forward and gradient."""
import functools
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import run_trainer
from test_end_to_end import val_losses

import train_gpt
from train_gpt import GPT, CausalSelfAttention, UserError, fused_head_loss


def relative_error(value, reference):
    return ((value.double() - reference).norm() / reference.norm()).item()


def plain_head_loss_float64(x, weight, targets):
    """GPT.forward's head in float64: x W^T with W rounded to x's dtype (as CastedLinear casts it),
    softcap 15 tanh(z / 15), mean cross-entropy; returns the loss and its gradients wrt x and W."""
    x64 = x.detach().double().requires_grad_()
    w64 = weight.detach().type_as(x).double().requires_grad_()
    loss = F.cross_entropy(15 * torch.tanh(x64 @ w64.T / 15), targets)
    return (loss, *torch.autograd.grad(loss, (x64, w64)))


def head_inputs(rows, dim, vocab, logit_scale, seed):
    """bf16 rms-normed rows as the model feeds its head; targets include the first and last token ids,
    a repeated id, the most likely and the least likely token of a row."""
    g = torch.Generator().manual_seed(seed)
    x = F.rms_norm(torch.randn(rows, dim, generator=g), (dim,)).bfloat16().requires_grad_()
    weight = (torch.randn(vocab, dim, generator=g) * logit_scale / dim ** 0.5).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), generator=g)
    logits = x.detach().float() @ weight.detach().T
    targets[:6] = torch.tensor([0, vocab - 1, vocab - 1, 7, logits[4].argmax(), logits[5].argmin()])
    return x, weight, targets


@pytest.mark.parametrize("logit_scale", [3.0, 40.0])  # typical logits, and logits deep in the softcap's saturation
def test_fused_head_loss_and_gradients_match_the_plain_head_in_float64(monkeypatch, logit_scale):
    monkeypatch.setattr(train_gpt, "HEAD_CHUNK_ROWS", 64)
    x, weight, targets = head_inputs(rows=3 * 64 + 37, dim=96, vocab=777, logit_scale=logit_scale, seed=1)
    loss = fused_head_loss(x, weight, targets)  # 4 chunks, the last one shorter
    grad_x, grad_w = torch.autograd.grad(2.5 * loss, (x, weight))  # scaled: backward multiplies by grad_output
    ref_loss, ref_grad_x, ref_grad_w = plain_head_loss_float64(x, weight, targets)
    assert grad_x.dtype == torch.bfloat16 and grad_w.dtype == torch.float32
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-3
    # bf16 logits and gradients of the logits: errors of a few 1e-3 are rounding, not maths
    assert relative_error(grad_x, 2.5 * ref_grad_x) < 1e-2
    assert relative_error(grad_w, 2.5 * ref_grad_w) < 1e-2


def test_fused_head_loss_without_grad_returns_the_same_loss_and_computes_no_gradients(monkeypatch):
    monkeypatch.setattr(train_gpt, "HEAD_CHUNK_ROWS", 50)
    x, weight, targets = head_inputs(rows=130, dim=32, vocab=300, logit_scale=3.0, seed=2)
    with torch.no_grad():
        loss = fused_head_loss(x, weight, targets)
    assert loss.grad_fn is None
    assert loss.item() == fused_head_loss(x, weight, targets).item()
    ref_loss = plain_head_loss_float64(x, weight, targets)[0]
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-3


def test_fused_head_loss_compiles_into_one_graph():
    x, weight, targets = head_inputs(rows=100, dim=32, vocab=200, logit_scale=3.0, seed=3)
    compiled = torch.compile(fused_head_loss, backend="aot_eager", fullgraph=True, dynamic=False)
    loss = compiled(x, weight, targets)
    grads = torch.autograd.grad(loss, (x, weight))
    expected = fused_head_loss(x, weight, targets)
    assert torch.allclose(loss, expected)
    for got, want in zip(grads, torch.autograd.grad(expected, (x, weight))):
        assert torch.allclose(got.float(), want.float())


def small_model_loss_and_grads(float64=False, **options):
    torch.manual_seed(0)
    model = GPT(1024, 8, 2, 64, **options)  # a small vocabulary: bf16 products are slow on CPUs without AVX-512
    for name, p in model.named_parameters():  # away from the zero initialisations, so every gradient flows
        if p.ndim == 2 and "embed" not in name:
            torch.nn.init.normal_(p, std=0.5 / p.size(1) ** 0.5)
    if float64:  # the plain model without bf16 rounding (its bf16 embedding tables convert exactly)
        model.double()
    tokens = torch.randint(0, 1024, (513,), generator=torch.Generator().manual_seed(0))
    loss = model(tokens[:-1].int(), tokens[1:], torch.tensor(2, dtype=torch.int32))
    loss.backward()
    return loss.item(), {name: p.grad.double() for name, p in model.named_parameters()}


@functools.cache
def plain_model_in_float64_and_bf16():  # shared by the options' tests
    return small_model_loss_and_grads(float64=True), small_model_loss_and_grads()


@pytest.mark.parametrize("option", ["fused_head_loss", "fused_qkv"])
def test_model_with_a_speed_option_is_as_close_to_float64_as_the_plain_model(monkeypatch, option):
    (ref_loss, ref_grads), (_, plain_grads) = plain_model_in_float64_and_bf16()
    monkeypatch.setattr(train_gpt, "HEAD_CHUNK_ROWS", 200)  # 512 tokens: chunks of 200, 200, 112
    loss, grads = small_model_loss_and_grads(**{option: True})
    assert abs(loss - ref_loss) / ref_loss < 2e-4
    assert grads.keys() == ref_grads.keys()  # same Parameters, so optimisers and checkpoints are unchanged
    for name, ref in ref_grads.items():
        # bf16 activations round everywhere: the plain model itself is 1% off on matrices and up to 15% on
        # scalars (sums that cancel); the option may add rounding of that size, a wrong gradient is far off
        plain_error = relative_error(plain_grads[name], ref)
        assert relative_error(grads[name], ref) < 2 * plain_error + 5e-3, (name, plain_error)


def test_fused_qkv_attention_matches_three_products_in_float32():
    torch.manual_seed(0)
    plain, fused = CausalSelfAttention(96, 3), CausalSelfAttention(96, 3, fused_qkv=True)
    torch.nn.init.normal_(plain.proj.weight, std=0.1)
    fused.load_state_dict(plain.state_dict())  # same Parameters, same names
    x = torch.randn(1, 256, 96)
    value_embed = torch.randn(256, 96)
    mask = torch.ones(256, 256, dtype=torch.bool).tril()
    outputs, grads = [], []
    for attn in (plain, fused):
        xi = x.clone().requires_grad_()
        y = attn(xi, value_embed, mask)
        (y * torch.linspace(-1, 1, 96)).sum().backward()
        outputs.append(y)
        grads.append([xi.grad] + [p.grad for p in attn.parameters()])
    assert torch.allclose(outputs[0], outputs[1], rtol=1e-5, atol=1e-6)
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_profile_writes_a_trace_and_the_top_ops_table_into_the_log(markov_shards, tmp_path):
    train, val, _ = markov_shards
    # small: fp32 activations, one micro-batch per step, 6 layers of width 64; the speed options run through the CLI too
    result = run_trainer(["--preset", "smoke", "--train_files", train, "--val_files", val, "--log_dir", str(tmp_path),
                          "--bf16_embeds", "false", "--batch_size", "512", "--val_tokens", "512", "--num_layers", "6",
                          "--model_dim", "64", "--num_iterations", "2", "--val_loss_every", "2", "--profile", "1",
                          "--fused_head_loss", "true", "--fused_qkv", "true"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (log,) = tmp_path.glob("*.txt")
    trace = log.with_suffix(".trace.json")
    assert f"trace for Perfetto or chrome://tracing: {trace}" in result.stdout
    assert len(json.loads(trace.read_text())["traceEvents"]) > 100
    profile = [line for line in log.read_text().splitlines() if line.startswith("profile: ")]
    assert profile[0].startswith("profile: 1 step(s) from step 2 ran under the profiler")  # min(12, 2 - 1) = 1
    assert any("Name" in line and "Self CPU" in line for line in profile[1:])
    losses = val_losses(log)  # the step lines and the closing memory line keep the log's fixed format
    assert sorted(losses) == [0, 2] and losses[2] < losses[0]
