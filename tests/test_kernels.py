"""The speed options compute what the plain model computes: each against an independent
reference (the unfused PyTorch expression, float64 where rounding matters), forward and gradient."""
import functools

import pytest
import torch
import torch.nn.functional as F
from helpers import LN_VOCAB
from helpers import TINY_MODEL
from helpers import finished_log
from helpers import val_losses

import train_gpt
from train_gpt import GPT
from train_gpt import fused_head_loss
from train_gpt import softcapped_cross_entropy_

# the head-loss kernel is Triton's (through its interpreter on CPU); Linux only, as Triton's wheels
# are
NO_TRITON = "triton is not installed (Linux only): the fused head-loss kernel needs it"
needs_triton = pytest.mark.skipif(train_gpt.triton is None, reason=NO_TRITON)


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
    """bf16 rms-normed rows as the model feeds its head; targets include the first and last token
    ids, a repeated id, the most likely and the least likely token of a row."""
    g = torch.Generator().manual_seed(seed)
    x = F.rms_norm(torch.randn(rows, dim, generator=g), (dim,)).bfloat16().requires_grad_()
    weight = (torch.randn(vocab, dim, generator=g) * logit_scale / dim ** 0.5).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), generator=g)
    logits = x.detach().float() @ weight.detach().T
    targets[:6] = torch.tensor([0, vocab - 1, vocab - 1, 7, logits[4].argmax(), logits[5].argmin()])
    return x, weight, targets


def softcapped_losses_float64(logits, targets):
    """Per-row softcap + cross-entropy of the given logits in float64, and the gradient of their
    mean."""
    z = logits.detach().double().requires_grad_()
    losses = F.cross_entropy(15 * torch.tanh(z / 15), targets, reduction="none")
    return losses.detach(), torch.autograd.grad(losses.mean(), z)[0]


# the real vocabulary (its last column chunk is partial); 37 rows: blocks of 16, 16 and 5
@pytest.fixture
def small_row_blocks(monkeypatch):
    monkeypatch.setitem(train_gpt.HEAD_LAUNCH_CPU, "ROWS", 16)


# typical logits, and |z| ~ 1000 where tanh saturates (slow: the interpreted kernel takes about a
# second over the whole vocabulary, and the typical case keeps the fast loop on this kernel)
SCALES = [3.0, pytest.param(1000.0, marks=pytest.mark.slow)]


@pytest.mark.record18
@pytest.mark.parametrize("logit_scale", SCALES)
@needs_triton
def test_kernel_writes_the_loss_gradient_over_the_logits(small_row_blocks, logit_scale):
    x, weight, targets = head_inputs(rows=37, dim=64, vocab=50304, logit_scale=logit_scale, seed=1)
    logits = (x.detach().float() @ weight.detach().bfloat16().float().T).bfloat16()
    ref_losses, ref_grad = softcapped_losses_float64(logits, targets)
    losses = softcapped_cross_entropy_(logits, targets, grad_scale=1 / 37)
    assert losses.dtype == torch.float32
    assert torch.allclose(losses.double(), ref_losses, rtol=1e-5, atol=1e-5)
    assert logits.dtype == torch.bfloat16 and logits.isfinite().all()
    # each element rounded to the nearest bf16: within half a unit in the last place, 2^-8 relative
    # (rounding toward zero would be up to twice that), plus fp32's error in dc/dz = 1 - t^2 (a few
    # 2^-24) over 37 rows
    error_bound = 2 ** -8 * ref_grad.abs() + 2 ** -20 / 37
    assert ((logits.double() - ref_grad).abs() <= error_bound).all()


@pytest.mark.record18
@pytest.mark.parametrize("logit_scale", SCALES)
@needs_triton
def test_fused_head_loss_and_gradients_match_the_plain_head_in_float64(small_row_blocks,
                                                                       logit_scale):
    x, weight, targets = head_inputs(rows=37, dim=64, vocab=50304, logit_scale=logit_scale, seed=1)
    loss = fused_head_loss(x, weight, targets)
    # scaled: backward multiplies by grad_output
    grad_x, grad_w = torch.autograd.grad(2.5 * loss, (x, weight))
    ref_loss, ref_grad_x, ref_grad_w = plain_head_loss_float64(x, weight, targets)
    assert grad_x.dtype == torch.bfloat16 and grad_w.dtype == torch.float32
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-4
    # bf16 logits and gradients of the logits: errors of a few 1e-3 are rounding, not maths
    assert relative_error(grad_x, 2.5 * ref_grad_x) < 1e-2
    assert relative_error(grad_w, 2.5 * ref_grad_w) < 1e-2


@pytest.mark.slow
@needs_triton
def test_upstream_gradient_scales_the_head_gradients_exactly(small_row_blocks):
    """The vocabulary of 777 (a partial last column chunk too): the scaling, not the width, is
    checked, and the interpreted kernel costs about 10 ms a row of 50,304 logits."""
    x, weight, targets = head_inputs(rows=37, dim=16, vocab=777, logit_scale=3.0, seed=2)
    grads = torch.autograd.grad(fused_head_loss(x, weight, targets), (x, weight))
    # as with 8 micro-batches
    scaled = torch.autograd.grad(fused_head_loss(x, weight, targets) / 8, (x, weight))
    for grad, grad_of_eighth in zip(grads, scaled):
        assert torch.equal(grad_of_eighth * 8, grad)  # powers of two scale exactly


@pytest.mark.record18
@pytest.mark.slow
@needs_triton
def test_without_grad_the_kernel_computes_the_loss_only_and_leaves_the_logits(small_row_blocks):
    """On a vocabulary of 777, as the test above."""
    x, weight, targets = head_inputs(rows=37, dim=16, vocab=777, logit_scale=3.0, seed=3)
    logits = (x.detach().float() @ weight.detach().bfloat16().float().T).bfloat16()
    before = logits.clone()
    losses = softcapped_cross_entropy_(logits, targets)
    assert torch.equal(logits, before)
    reference = softcapped_losses_float64(logits, targets)[0]
    assert torch.allclose(losses.double(), reference, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        loss = fused_head_loss(x, weight, targets)
    assert loss.grad_fn is None
    assert loss.item() == pytest.approx(fused_head_loss(x, weight, targets).item(), rel=1e-6)
    reference = plain_head_loss_float64(x, weight, targets)[0].item()
    assert loss.item() == pytest.approx(reference, rel=1e-4)


def recorded_kernel_rows(monkeypatch):
    """The row count of every logits block the head kernel is given."""
    kernel = train_gpt.softcapped_cross_entropy_
    rows = []

    def recording_kernel(logits, *args, **kwargs):
        rows.append(len(logits))
        return kernel(logits, *args, **kwargs)

    monkeypatch.setattr(train_gpt, "softcapped_cross_entropy_", recording_kernel)
    return rows


# 37 rows in chunks of 16: 16, 16 and 5; a small vocabulary keeps the interpreter fast
@pytest.mark.record18
@needs_triton
def test_chunked_head_loss_and_gradients_match_float64_and_the_unchunked_head(small_row_blocks,
                                                                              monkeypatch):
    x, weight, targets = head_inputs(rows=37, dim=16, vocab=777, logit_scale=3.0, seed=5)
    whole = fused_head_loss(x, weight, targets)
    whole_grads = torch.autograd.grad(whole, (x, weight))
    rows = recorded_kernel_rows(monkeypatch)
    loss = fused_head_loss(x, weight, targets, chunk_rows=16)
    grad_x, grad_w = torch.autograd.grad(loss, (x, weight))
    assert rows == [16, 16, 5]
    ref_loss, ref_grad_x, ref_grad_w = plain_head_loss_float64(x, weight, targets)
    assert grad_x.dtype == torch.bfloat16 and grad_w.dtype == torch.float32
    # bf16 logits, chunked or not
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-3
    # only the order of the fp32 sum differs
    assert loss.item() == pytest.approx(whole.item(), rel=1e-6)
    assert relative_error(grad_x, ref_grad_x) < 1e-2
    assert relative_error(grad_x, whole_grads[0].double()) < 1e-3  # the same rows' products
    # summed in fp32, never rounded to bf16 as the unchunked product is: closer to float64 (0.002
    # against 0.0027; chunk products rounded to bf16 measured 0.0027 too)
    unchunked_error = relative_error(whole_grads[1], ref_grad_w)
    assert relative_error(grad_w, ref_grad_w) < 0.9 * unchunked_error < 1e-2
    eighth = fused_head_loss(x, weight, targets, chunk_rows=16) / 8
    scaled = torch.autograd.grad(eighth, (x, weight))
    for grad, grad_of_eighth in zip((grad_x, grad_w), scaled):
        assert torch.equal(grad_of_eighth * 8, grad)  # backward multiplies by the upstream gradient


@needs_triton
def test_chunked_head_saves_no_tensor_of_rows_by_vocab_for_backward(small_row_blocks):
    rows, dim, vocab = 37, 16, 777
    x, weight, targets = head_inputs(rows=rows, dim=dim, vocab=vocab, logit_scale=3.0, seed=6)
    largest = {}
    for chunk_rows in (0, 16):
        saved = []

        def pack(tensor):
            saved.append(tensor.numel())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = fused_head_loss(x, weight, targets, chunk_rows=chunk_rows)
        largest[chunk_rows] = max(saved)
        torch.autograd.grad(loss, (x, weight))
    assert largest[0] == rows * vocab  # unchunked: the gradient of the logits
    # chunked: grad_W, the largest of grad_x and grad_W
    assert largest[16] == vocab * dim < rows * vocab / 2


@needs_triton
def test_chunked_eval_loss_equals_the_unchunked_eval_loss(small_row_blocks, monkeypatch):
    x, weight, targets = head_inputs(rows=37, dim=16, vocab=777, logit_scale=3.0, seed=7)
    with torch.no_grad():
        whole = fused_head_loss(x, weight, targets)
        rows = recorded_kernel_rows(monkeypatch)
        chunked = fused_head_loss(x, weight, targets, chunk_rows=16)
    assert rows == [16, 16, 5] and chunked.grad_fn is None
    assert chunked.item() == pytest.approx(whole.item(), rel=1e-6)


@needs_triton
def test_head_chunk_rows_reaches_the_models_fused_head_from_the_command_line(monkeypatch):
    # fast to build
    options = "--preset smoke --vocab_size 1024 --fused_head_loss true --head_chunk_rows 64"
    model = GPT.from_args(train_gpt.parse_args(options.split()))
    rows = recorded_kernel_rows(monkeypatch)
    x = torch.randn(100, 64, dtype=torch.bfloat16, requires_grad=True)
    model.head_loss(x, torch.randint(0, 1024, (100,))).backward()
    assert rows == [64, 36] and x.grad is not None and model.lm_head.weight.grad is not None


@pytest.mark.slow
@needs_triton
def test_fused_head_loss_under_torch_compile_runs_eagerly_and_matches_eager(monkeypatch):
    # the model is compiled on CUDA: fused_head_loss is a graph break there, the graphs around it
    # must still connect
    # vocab: no multiple of 128
    x, weight, targets = head_inputs(rows=100, dim=32, vocab=777, logit_scale=3.0, seed=4)
    h = x.detach().float().requires_grad_()

    def head(h, weight, targets):
        return fused_head_loss(F.rms_norm(h, (h.size(-1),)).bfloat16(), weight, targets)

    compiled = torch.compile(head, backend="aot_eager", dynamic=False)
    kernel = train_gpt.softcapped_cross_entropy_
    compiling = []

    def recording_kernel(*args, **kwargs):
        compiling.append(torch.compiler.is_compiling())
        return kernel(*args, **kwargs)

    monkeypatch.setattr(train_gpt, "softcapped_cross_entropy_", recording_kernel)
    got, want = [compiled(h, weight, targets)], [head(h, weight, targets)]
    assert compiling == [False, False]  # the kernel ran eagerly, not traced into the graph
    got += torch.autograd.grad(got[0], (h, weight))
    want += torch.autograd.grad(want[0], (h, weight))
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
@needs_triton
def test_smoke_run_with_the_fused_head_loss_has_the_plain_runs_val_losses(markov_shards, tmp_path):
    """2 steps of one 128-token sequence through TINY_MODEL, validated after the last, with each
    head: the interpreted kernel costs about 10 ms a row of 50,304 logits, whatever the width."""
    train, val, _ = markov_shards
    logs = {}
    for fused in ("false", "true"):
        options = ["--preset", "smoke", "--train_files", train, "--val_files", val, *TINY_MODEL,
                   "--num_iterations", "2", "--val_loss_every", "0", "--batch_size", "128",
                   "--max_device_batch_size", "128", "--val_tokens", "128",
                   "--fused_head_loss", fused, "--log_dir", str(tmp_path / fused)]
        assert train_gpt.main(options) == 0
        logs[fused] = finished_log(tmp_path / fused)
    plain, fused = val_losses(logs["false"]), val_losses(logs["true"])
    # the head starts at zero: step 0's loss is ln 50,304 on both paths (10.83; 10.56 at step 2)
    assert sorted(plain) == sorted(fused) == [2] and plain[2] < LN_VOCAB - 0.1
    for step in plain:  # the same up to bf16 rounding (the plain path's softcap rounds to bf16)
        assert abs(fused[step] - plain[step]) < 3e-3, (step, fused[step], plain[step])


def small_model_loss_and_grads(float64=False, **options):
    torch.manual_seed(0)
    # a small vocabulary: bf16 products are slow on CPUs without AVX-512
    model = GPT(1024, 8, 2, 64, **options)
    # away from the zero initialisations, so every gradient flows
    for name, p in model.named_parameters():
        if p.ndim == 2 and "embed" not in name:
            torch.nn.init.normal_(p, std=0.5 / p.size(1) ** 0.5)
    if float64:  # the plain model without bf16 rounding (its bf16 embedding tables convert exactly)
        model.double()
    tokens = torch.randint(0, 1024, (513,), generator=torch.Generator().manual_seed(0))
    loss = model(tokens[:-1].int(), tokens[1:], torch.tensor(2, dtype=torch.int32))
    loss.backward()
    return loss.item(), {name: p.grad.double() for name, p in model.named_parameters()}


@functools.cache
def plain_model_in_float64_and_bf16():
    """Shared by the options' tests."""
    return small_model_loss_and_grads(float64=True), small_model_loss_and_grads()


@pytest.mark.slow
@needs_triton
def test_model_with_the_fused_head_is_as_close_to_float64_as_the_plain_model(monkeypatch):
    option = "fused_head_loss"
    (ref_loss, ref_grads), (_, plain_grads) = plain_model_in_float64_and_bf16()
    kernel = train_gpt.softcapped_cross_entropy_
    calls = []
    def counted_kernel(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(train_gpt, "softcapped_cross_entropy_", counted_kernel)
    loss, grads = small_model_loss_and_grads(**{option: True})
    # the option reaches the kernel, once per forward
    assert len(calls) == (option == "fused_head_loss")
    assert abs(loss - ref_loss) / ref_loss < 2e-4
    # same Parameters, so optimisers and checkpoints are unchanged
    assert grads.keys() == ref_grads.keys()
    # bf16 activations round everywhere: the plain model itself is 1% off on each matrix, and up to
    # 70% on a scalar (sums that cancel: at another softcap, the fused head's rounding can triple
    # one), 10% on the scalars together; the option may add rounding of that size, a wrong
    # gradient is far off
    scalars = [name for name, ref in ref_grads.items() if ref.ndim < 2]
    parts = [[name] for name, ref in ref_grads.items() if ref.ndim == 2] + [scalars]
    for names in parts:
        ref, plain, fused = (torch.cat([each[name].flatten() for name in names])
                             for each in (ref_grads, plain_grads, grads))
        plain_error = relative_error(plain, ref)
        error = relative_error(fused, ref)
        assert error < 2 * plain_error + 5e-3, (names, error, plain_error)
