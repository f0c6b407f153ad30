"""NanoGPT speedrun trainer: a GPT-2-small-class model on FineWeb-10B to 3.28 val loss, one file.

Run:   torchrun --standalone --nproc_per_node=8 train_gpt.py      (or ./run.sh)
Smoke: python train_gpt.py --preset smoke   (CPU, minutes; built-in synthetic data unless shards are named)
Reads top to bottom in the order data flows: configuration, Muon, kernels, model, attention masks, data,
training loop, main(). Nothing runs on import; tests import the parts.
"""
import time
LAUNCH_TIME = time.time()  # before the heavy imports: start-up is counted from launch
import argparse
import contextlib
import glob
import hashlib
import importlib.metadata
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import uuid
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch.nn.parallel import DistributedDataParallel as DDP
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# -----------------------------------------------------------------------------
# Configuration


@dataclass
class Hyperparameters:
    # data: glob patterns of shards (SPEC 3), taken in sorted file-name order
    train_files: str = "data/fineweb10B/fineweb_train_*.bin"
    val_files: str = "data/fineweb10B/fineweb_val_*.bin"
    val_tokens: int = 10_485_760  # the first 10,485,760 val tokens, fixed by the record rules
    allow_data_repeat: bool = False  # let a run read the train stream more than once (never a record)
    # batch: tokens per optimiser step, whatever the number of processes
    batch_size: int = 8 * 64 * 1024
    max_device_batch_size: int = 64 * 1024  # one packed sequence per forward; longer shares accumulate
    # schedule
    num_iterations: int = 1390
    cooldown_frac: float = 0.4  # last 40% of steps: learning rate decays linearly to 0
    window_start: int = 128  # attention window in tokens at step 0 ...
    window_end: int = 1856  # ... and at the end; // 128 gives 1 to 14 blocks
    # model
    vocab_size: int = 50304  # GPT-2's 50257 padded to a multiple of 128
    num_layers: int = 12
    num_heads: int = 6
    model_dim: int = 768
    attention_free_layer: int = 7  # this block has no attention (none if >= num_layers)
    bf16_embeds: bool = True
    # optimisers
    embed_lr: float = 0.6
    head_lr: float = 0.008
    scalar_lr: float = 0.04
    adam_beta1: float = 0.8
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8  # PyTorch's default, as in record 18 (a later record's 1e-10 is worse here)
    muon_lr: float = 0.05
    muon_momentum_start: float = 0.85
    muon_momentum: float = 0.95
    muon_momentum_warmup_steps: int = 300
    # evaluation, logging, runtime
    val_loss_every: int = 125  # 0: only after the last step
    log_dir: str = "logs"
    save_checkpoint: bool = False
    compile: str = "auto"  # auto: compile on CUDA only (FlexAttention has no CPU backward)
    compile_tuning: bool = False  # inductor's coordinate descent: ~0.5% faster steps for ~6 more minutes of compile
    compile_cache: str = ""  # a file: load compiled code from it before compiling, save it after step 1
    seed: int = 0
    # speed options: off until a GPU has measured them (issue 9)
    fused_head_loss: bool = False  # head + softcap + cross-entropy chunk by chunk, gradients in the forward pass
    fused_qkv: bool = False  # q, k, v as one product of the stacked weights (still three matrices for Muon)
    flex_kernel_options: str = ""  # JSON object for flex_attention's kernel_options, e.g. '{"bwd_num_warps": 8}'; ignored on CPU
    profile: int = 0  # profile this many train steps after warm-up: trace and top-kernel table in log_dir


# A small model and a short run that finish in minutes on a 2-core CPU; still exercises every part
# (value embeddings, U-net skips, the attention-free block, window growth, accumulation).
PRESETS = {
    "smoke": dict(
        num_layers=8, num_heads=2, model_dim=128,
        batch_size=1024, max_device_batch_size=512,  # 1, 2, 4 or 8 processes all fit
        num_iterations=40, val_loss_every=10, val_tokens=4096,
        window_end=512 + 64,  # 1 to 4 blocks: the whole 512-token sequence at the end
        train_files="synthetic", val_files="synthetic",  # no download: see markov_stream
    ),
}

BLOCK_SIZE = 128  # FlexAttention block; sequences are multiples of it
EOT = 50256  # <|endoftext|>, precedes every document


class UserError(Exception):
    """A problem the user can fix (data, configuration, hardware); main() prints it without a traceback."""


# -----------------------------------------------------------------------------
# Muon: MomentUm Orthogonalized by Newton-Schulz (Keller Jordan, 2024)


def newton_schulz_wide(X, steps):
    """The iteration on a wide or square bf16 matrix; Muon compiles this part (one graph per shape)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    X = X / (X.norm() + 1e-7)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        A = X @ X.T
        B = b * A + c * A @ A
        X = a * X + B @ X
    return X


def zeropower_via_newtonschulz5(G, steps, iterate=newton_schulz_wide):
    """Roughly orthogonalise G: a quintic Newton-Schulz iteration whose coefficients are tuned to push
    singular values towards 1 fast, not exactly (they land near 0.7 to 1.2). Runs in bfloat16."""
    assert G.ndim == 2
    tall = G.size(0) > G.size(1)
    # iterate on the smaller Gram matrix; contiguous, so a tall matrix and its wide twin share one graph
    X = (G.T if tall else G).to(torch.bfloat16, memory_format=torch.contiguous_format)
    X = iterate(X, steps)
    return X.T if tall else X


class Muon(torch.optim.Optimizer):
    """SGD-momentum (Nesterov) whose update is orthogonalised, for the 2-D matrices of the blocks.

    Distributed without sharding the state: parameters are grouped by size; in each chunk of
    world_size parameters rank r orthogonalises the r-th, and all ranks all-gather the bf16 results.
    The gather is asynchronous and applied one chunk later, so it overlaps the next chunk's work.
    Gradients must already be averaged across ranks (DDP does it).
    """

    def __init__(self, params, lr, momentum, nesterov=True, ns_steps=5, compiled=False):
        self.rank = int(os.environ.get("RANK", 0))
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        params = list(params)
        sizes = sorted({p.numel() for p in params}, reverse=True)
        groups = [dict(params=[p for p in params if p.numel() == n]) for n in sizes]
        super().__init__(groups, dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps))
        # compiled as in record 18; static shapes: one graph per matrix shape, never a recompile per step
        self.iterate = torch.compile(newton_schulz_wide, dynamic=False) if compiled else newton_schulz_wide
        # slot r of a group's buffer receives rank r's update; allocated once, outside the state
        # so that checkpoints stay small
        self.gathered = [torch.empty(self.world_size * n, dtype=torch.bfloat16, device=params[0].device) for n in sizes]

    @torch.no_grad()
    def step(self):
        for group, gathered in zip(self.param_groups, self.gathered):
            params = group["params"]
            numel = params[0].numel()
            pending = None
            for start in range(0, len(params), self.world_size):
                mine = start + self.rank
                if mine < len(params):
                    update = self._orthogonalised_update(params[mine], group).flatten()
                else:  # uneven tail: this rank has no matrix in the chunk, it sends zeros
                    update = gathered.new_zeros(numel)
                if pending is not None:  # the buffer is free again only once the last chunk is applied
                    self._apply(*pending, gathered, group["lr"])
                if self.world_size > 1:
                    handle = dist.all_gather_into_tensor(gathered, update, async_op=True)
                else:
                    gathered.copy_(update)
                    handle = None
                pending = (params[start:start + self.world_size], handle)
            self._apply(*pending, gathered, group["lr"])

    def _orthogonalised_update(self, p, group):
        assert p.grad is not None, "Muon: a matrix received no gradient"
        m = group["momentum"]
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad)
        buf = state["momentum_buffer"]
        buf.lerp_(p.grad, 1 - m)  # buf = m*buf + (1-m)*g
        update = p.grad.lerp(buf, m) if group["nesterov"] else buf
        return zeropower_via_newtonschulz5(update, group["ns_steps"], self.iterate)

    @staticmethod
    def _apply(chunk, handle, gathered, lr):
        if handle is not None:
            handle.wait()
        numel = chunk[0].numel()
        for i, p in enumerate(chunk):
            scale = max(1, p.size(0) / p.size(1)) ** 0.5  # same RMS step for tall and wide matrices
            p.add_(gathered[i * numel:(i + 1) * numel].view_as(p), alpha=-lr * scale)


# -----------------------------------------------------------------------------
# Kernels: faster forms of model pieces, each equal up to rounding to the plain expression it replaces
# (tests/test_kernels.py). Before the model, which calls them; used only when an option asks.

# The head's loss (--fused_head_loss). The logits z = x W^T stay a cuBLAS product; one Triton kernel then reads each
# row once for the softcap c = 15 tanh(z / 15) and the loss logsumexp(c) - c[target], and in training overwrites the
# row with d(mean loss)/dz. HBM traffic: one read and one write of the bf16 logits (6.6 GB each per 64K-token
# micro-batch); on an H100 that takes half the time of the compiled plain softcap and cross-entropy.


@triton.jit
def softcapped_cross_entropy_kernel(logits, targets, losses, rows, grad_scale, VOCAB: tl.constexpr, ROWS: tl.constexpr,
                                    COLS: tl.constexpr, WRITE_GRAD: tl.constexpr, TANH_APPROX: tl.constexpr):
    """ROWS rows per program, COLS columns at a time, in fp32; t = tanh(z / 15), c = 15t. Builtins only (tl.full,
    tl.reduce): without TRITON_INTERPRET at import, the interpreter runs no jit helper (tl.zeros, tl.sum)."""
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = row < rows
    row_start = logits + row.to(tl.int64) * VOCAB
    target = tl.load(targets + row, mask=row_ok, other=0)
    total, c_target = tl.full([ROWS, COLS], 0, tl.float32), tl.full([ROWS, COLS], 0, tl.float32)
    for sweep in tl.static_range(1 + WRITE_GRAD):  # 0: log-sum-exp and loss; 1: the row again, gradient
        for k in range(0, VOCAB, COLS):
            start = k if sweep == 0 else (VOCAB - 1) // COLS * COLS - k  # backwards: the latest reads are in L2
            col = start + tl.arange(0, COLS)
            col_ok = (col < VOCAB)[None, :]
            mask = row_ok[:, None] & col_ok
            z = tl.load(row_start[:, None] + col[None, :], mask=mask, other=0, eviction_policy="evict_last")
            if TANH_APPROX:  # CUDA: one instruction instead of exp and reciprocal, which bound the kernel
                t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [z.to(tl.float32) * (1 / 15)],
                                              dtype=tl.float32, is_pure=True, pack=1)
            else:
                t = 1 - 2 / (1 + tl.exp(z.to(tl.float32) * (2 / 15)))
            is_target = col[None, :] == target[:, None]
            if sweep == 0:  # c < 15 bounds exp(c - 15) by 1: no running maximum needed
                total += tl.where(col_ok, tl.exp(15 * t - 15), 0)
                c_target += tl.where(is_target, 15 * t, 0)
            else:  # d loss/dz = (softmax(c) - onehot(target)) dc/dz, with dc/dz = 1 - t^2
                p = tl.exp(15 * t - lse[:, None])
                g = tl.where(is_target, p - 1, p) * (1 - t * t) * grad_scale
                tl.store(row_start[:, None] + col[None, :], g, mask=mask, cache_modifier=".cs")  # L2 stays for reads
        if sweep == 0:
            lse = 15 + tl.log(tl.reduce(total, 1, tl.standard._sum_combine))
            tl.store(losses + row, lse - tl.reduce(c_target, 1, tl.standard._sum_combine), mask=row_ok)


HEAD_LAUNCH_CUDA = dict(ROWS=1, COLS=4096, num_warps=16, TANH_APPROX=True)  # fastest measured on an H100
HEAD_LAUNCH_CPU = dict(ROWS=64, COLS=2048, TANH_APPROX=False)  # the interpreter: numpy on large blocks, no PTX


def softcapped_cross_entropy_(logits, targets, grad_scale=None):
    """Per-row losses of 15 tanh(logits / 15); with grad_scale, logits become grad_scale * d(sum of losses)/d logits.
    CPU: Triton's interpreter (triton.jit chose the compiler at import; TRITON_INTERPRET would switch all kernels)."""
    assert logits.is_contiguous() and targets.dtype == torch.int64
    kernel, launch, buffer = softcapped_cross_entropy_kernel, HEAD_LAUNCH_CUDA, logits
    if not logits.is_cuda:  # the interpreter's fp32 -> bf16 truncates: it works in fp32, torch rounds to nearest
        kernel, launch, buffer = InterpretedFunction(kernel.fn), HEAD_LAUNCH_CPU, logits.float()
    losses = logits.new_empty(len(logits), dtype=torch.float32)
    with np.errstate(over="ignore"):  # numpy warns of exp(2z / 15) = inf, where tanh saturates as it should
        kernel[(triton.cdiv(len(logits), launch["ROWS"]),)](buffer, targets.contiguous(), losses, len(logits),
                                                            grad_scale or 0.0, VOCAB=logits.size(1),
                                                            WRITE_GRAD=grad_scale is not None, **launch)
    if grad_scale is not None and buffer is not logits:
        logits.copy_(buffer)
    return losses


def matmul(a, b):
    """a @ b in a's dtype, as cuBLAS rounds it; on CPU through fp32 (bf16 GEMMs crawl on AVX2 CPUs)."""
    if a.device.type == "cpu" and a.dtype == torch.bfloat16:
        return (a.float() @ b.float()).type_as(a)
    return a @ b


class FusedHeadLoss(torch.autograd.Function):
    """Forward leaves d(mean loss)/d logits in the logits' buffer; backward scales the two small products by the
    upstream gradient, never the logits. Gradients in x's dtype and W's fp32, as autograd makes them."""

    @staticmethod
    def forward(ctx, x, weight, targets):
        grad_logits = matmul(x, weight.type_as(x).T)  # the logits, until the kernel overwrites them
        loss = softcapped_cross_entropy_(grad_logits, targets, grad_scale=1 / x.size(0)).mean()
        ctx.save_for_backward(x, weight, grad_logits)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        x, weight, grad_logits = ctx.saved_tensors
        grad_x = matmul(grad_logits, weight.type_as(x)).mul_(grad_loss) if ctx.needs_input_grad[0] else None
        grad_w = matmul(grad_logits.T, x).float().mul_(grad_loss) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


# A deliberate graph break: traced, the in-place kernel would be functionalised, which may copy the 6.6 GB logits;
# eager reuses the buffer for sure, and the products run on cuBLAS either way. torch.compiler.disable at the first
# call: importing torch._dynamo on import would set TORCHINDUCTOR_CACHE_DIR and make its folder.
@torch._disable_dynamo
def fused_head_loss(x, weight, targets):
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return FusedHeadLoss.apply(x, weight, targets)
    return softcapped_cross_entropy_(matmul(x, weight.type_as(x).T), targets).mean()  # eval: the loss only


# -----------------------------------------------------------------------------
# The model: a U-net GPT with value embeddings


def norm(x):
    return F.rms_norm(x, (x.size(-1),))  # no weight


class CastedLinear(nn.Linear):
    """Bias-free linear whose fp32 weight is cast to the activations' dtype at use."""

    def __init__(self, in_features, out_features, zero_init=False):
        super().__init__(in_features, out_features, bias=False)
        if zero_init:
            nn.init.zeros_(self.weight)

    def forward(self, x):
        if x.device.type == "cpu" and x.dtype == torch.bfloat16:  # same roundings; bf16 GEMMs crawl on AVX2 CPUs
            return F.linear(x.float(), self.weight.type_as(x).float()).type_as(x)
        return F.linear(x, self.weight.type_as(x))


class Rotary(nn.Module):
    """Rotary position embedding (Su et al., RoFormer), half-truncated: half of the dimension pairs
    rotate, the other half have frequency 0 and pass unchanged."""

    def __init__(self, head_dim, max_seq_len=65536):
        super().__init__()
        quarter = head_dim // 4
        freqs = (1 / 1024) ** torch.linspace(0, 1, quarter)
        freqs = torch.cat([freqs, freqs.new_zeros(quarter)])
        theta = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs)
        self.register_buffer("cos", theta.cos(), persistent=False)
        self.register_buffer("sin", theta.sin(), persistent=False)

    def forward(self, x):  # (batch, seq, heads, head_dim)
        cos = self.cos[None, :x.size(1), None, :]
        sin = self.sin[None, :x.size(1), None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos + x2 * sin, -x1 * sin + x2 * cos], dim=-1).type_as(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, dim, num_heads, fused_qkv=False, kernel_options=None):
        super().__init__()
        self.num_heads, self.fused_qkv, self.kernel_options = num_heads, fused_qkv, kernel_options
        self.head_dim = dim // num_heads
        self.q = CastedLinear(dim, dim)
        self.k = CastedLinear(dim, dim)
        self.v = CastedLinear(dim, dim)
        self.lambdas = nn.Parameter(torch.tensor([0.5, 0.5]))  # mix of v and the value embedding
        self.rotary = Rotary(self.head_dim)
        self.proj = CastedLinear(dim, dim, zero_init=True)

    def forward(self, x, value_embed, mask):
        B, T, dim = x.shape
        if self.fused_qkv:  # one product; q, k, v stay three Parameters, so Muon treats each on its own
            qkv = F.linear(x, torch.cat([self.q.weight, self.k.weight, self.v.weight]).type_as(x))
            q, k, v = qkv.view(B, T, 3 * self.num_heads, self.head_dim).chunk(3, dim=2)
        else:
            q, k, v = (lin(x).view(B, T, self.num_heads, self.head_dim) for lin in (self.q, self.k, self.v))
        q, k = self.rotary(norm(q)), self.rotary(norm(k))  # QK-norm (Dehghani et al., 2023)
        if value_embed is not None:
            v = self.lambdas[0] * v + self.lambdas[1] * value_embed.view_as(v)
        else:
            v = self.lambdas[0] * v
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if isinstance(mask, BlockMask):
            y = flex_attention(q, k, v, block_mask=mask, scale=self.head_dim ** -0.5, kernel_options=self.kernel_options)
        else:  # CPU: the same mask as a dense boolean matrix; fp32 arithmetic on the bf16 values, as above
            y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                               scale=self.head_dim ** -0.5).type_as(q)
        return self.proj(y.transpose(1, 2).reshape(B, T, dim))


class MLP(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc = CastedLinear(dim, 4 * dim)
        self.proj = CastedLinear(4 * dim, dim, zero_init=True)

    def forward(self, x):
        return self.proj(F.relu(self.fc(x)).square())  # ReLU² (So et al., Primer, 2021)


class Block(nn.Module):
    def __init__(self, dim, num_heads, has_attention, **attn_options):
        super().__init__()
        self.attn = CausalSelfAttention(dim, num_heads, **attn_options) if has_attention else None
        self.mlp = MLP(dim)
        self.lambdas = nn.Parameter(torch.tensor([1.0, 0.0]))  # mix of the stream and the embedding x0

    def forward(self, x, value_embed, x0, mask):
        x = self.lambdas[0] * x + self.lambdas[1] * x0
        if self.attn is not None:
            x = x + self.attn(norm(x), value_embed, mask)
        return x + self.mlp(norm(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, num_layers, num_heads, model_dim, attention_free_layer=7, bf16_embeds=True,
                 fused_head_loss=False, fused_qkv=False, flex_kernel_options=None):
        super().__init__()
        if num_layers < 6 or num_layers % 2:
            raise UserError(f"num_layers must be even and at least 6 (U-net halves, 3+3 value-embedded layers); got {num_layers}")
        if model_dim % num_heads or (model_dim // num_heads) % 4:
            raise UserError(f"model_dim {model_dim} must split into {num_heads} heads of a size divisible by 4 (rotary)")
        self.num_layers, self.fused_head_loss = num_layers, fused_head_loss
        self.embed = nn.Embedding(vocab_size, model_dim)
        # three value-embedding tables, used by the first three and the last three layers
        self.value_embeds = nn.ModuleList(nn.Embedding(vocab_size, model_dim) for _ in range(3))
        self.blocks = nn.ModuleList(Block(model_dim, num_heads, i != attention_free_layer, fused_qkv=fused_qkv,
                                          kernel_options=flex_kernel_options) for i in range(num_layers))
        self.skip_weights = nn.Parameter(torch.ones(num_layers // 2))  # U-net: encoder i feeds decoder
        self.lm_head = CastedLinear(model_dim, vocab_size, zero_init=True)  # untied; step-0 loss = ln(vocab)
        if bf16_embeds:
            for table in [self.embed, *self.value_embeds]:
                table.bfloat16()

    def value_embed_index(self, layer):
        if layer < 3:
            return layer
        if layer >= self.num_layers - 3:
            return layer - (self.num_layers - 3)
        return None

    def forward(self, inputs, targets, window_blocks):
        assert inputs.ndim == 1, "one packed sequence per device"
        mask = build_block_mask(inputs, window_blocks) if inputs.is_cuda else build_dense_mask(inputs, window_blocks)
        value_embeds = [table(inputs) for table in self.value_embeds]
        x = x0 = norm(self.embed(inputs)[None])
        half = self.num_layers // 2
        skips = []
        for i, block in enumerate(self.blocks):
            if i >= half:  # decoder: take the mirror-image encoder output
                x = x + self.skip_weights[i - half] * skips.pop()
            ve = self.value_embed_index(i)
            x = block(x, None if ve is None else value_embeds[ve], x0, mask)
            if i < half:
                skips.append(x)
        if self.fused_head_loss:  # same maths: softcap, loss and its gradient in one kernel (Kernels)
            return fused_head_loss(norm(x)[0], self.lm_head.weight, targets)
        logits = self.lm_head(norm(x))
        logits = 15 * torch.tanh(logits / 15)  # logit softcap (as in Gemma 2)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets)


# -----------------------------------------------------------------------------
# Attention masks: causal, within one document, inside a sliding window of whole 128-token blocks


def block_pairs(inputs, window_blocks):
    """Block-level facts (SPEC 6). Returns the token document ids and two (q-block, kv-block) boolean
    matrices: `partial` pairs may contain an allowed token pair, `full` pairs contain only allowed ones."""
    docs = (inputs == EOT).cumsum(0)
    first, last = docs[0::BLOCK_SIZE], docs[BLOCK_SIZE - 1::BLOCK_SIZE]  # doc range of each block
    idx = torch.arange(len(first), device=inputs.device)
    q, kv = idx[:, None], idx[None, :]
    partial = (q >= kv) & (q - kv < window_blocks) & (first[:, None] <= last[None, :]) & (first[None, :] <= last[:, None])
    one_doc = first == last
    full = partial & (q > kv) & one_doc[:, None] & one_doc[None, :] & (first[:, None] == first[None, :])
    return docs, partial, full


def build_block_mask(inputs, window_blocks):
    docs, partial, full = block_pairs(inputs, window_blocks)

    def document_causal(b, h, q_idx, kv_idx):  # the per-token test, needed in partial blocks only
        return (q_idx >= kv_idx) & (docs[q_idx] == docs[kv_idx])

    def listed(pairs):  # per q-block: how many kv blocks, and their indices first
        counts = pairs.sum(dim=-1, dtype=torch.int32)
        indices = torch.argsort(pairs, dim=-1, descending=True, stable=True).to(torch.int32)
        return counts[None, None].contiguous(), indices[None, None].contiguous()

    return BlockMask.from_kv_blocks(*listed(partial & ~full), *listed(full),
                                    BLOCK_SIZE=BLOCK_SIZE, mask_mod=document_causal)


def build_dense_mask(inputs, window_blocks):
    """The block mask as a dense (T, T) boolean matrix, for attention on CPU."""
    docs, partial, _ = block_pairs(inputs, window_blocks)
    pos = torch.arange(len(inputs), device=inputs.device)
    in_blocks = partial.repeat_interleave(BLOCK_SIZE, 0).repeat_interleave(BLOCK_SIZE, 1)
    return in_blocks & (pos[:, None] >= pos[None, :]) & (docs[:, None] == docs[None, :])


# -----------------------------------------------------------------------------
# Data: token shards (SPEC 3) and the loader every rank walks in step

SHARD_MAGIC, SHARD_VERSION, HEADER_BYTES = 20240520, 1, 256 * 4
FINEWEB_SHARD_TOKENS = 100_000_000  # each FineWeb train shard on the hub
REFETCH_HINT = "`python data/cached_fineweb10B.py N` replaces invalid shards"


def fetch_hint(num_iterations, batch_size):
    """The command that fetches the FineWeb train shards a run reads (plus the val shard)."""
    needed = -(-num_iterations // ((FINEWEB_SHARD_TOKENS - 2) // batch_size))  # whole batches per shard
    if needed <= 1:
        return "fetch FineWeb with `python data/cached_fineweb10B.py 1`"
    # one spare shard, the record's usual advice (9 for the 8 that 1390 steps read)
    return f"fetch FineWeb with `python data/cached_fineweb10B.py {needed + 1}` (this run reads {needed} train shards)"


def read_shard_header(path):
    """Validate a shard's header and size without reading its tokens; returns the token count."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(HEADER_BYTES), dtype="<i4")
    if len(header) < 256:
        raise UserError(f"{path}: truncated shard ({size} bytes, shorter than the 1024-byte header); {REFETCH_HINT}")
    if header[0] != SHARD_MAGIC:
        raise UserError(f"{path}: not a token shard (magic {header[0]}, expected {SHARD_MAGIC})")
    if header[1] != SHARD_VERSION:
        raise UserError(f"{path}: unsupported shard version {header[1]} (expected {SHARD_VERSION})")
    num_tokens = int(header[2])
    if size != HEADER_BYTES + 2 * num_tokens:
        raise UserError(f"{path}: header says {num_tokens} tokens ({HEADER_BYTES + 2 * num_tokens} bytes) "
                        f"but the file has {size} bytes (truncated or corrupt); {REFETCH_HINT}")
    return num_tokens


def load_data_shard(path):
    num_tokens = read_shard_header(path)
    # pinned host memory makes the per-batch copies to the GPU truly asynchronous
    tokens = torch.empty(num_tokens, dtype=torch.uint16, pin_memory=torch.cuda.is_available())
    with open(path, "rb") as f:
        f.seek(HEADER_BYTES)
        if f.readinto(tokens.numpy()) != 2 * num_tokens:
            raise UserError(f"{path}: file changed while reading")
    return tokens


def write_data_shard(path, tokens):
    tokens = np.asarray(tokens)
    assert tokens.ndim == 1 and (tokens.size == 0 or (tokens.min() >= 0 and tokens.max() < 2 ** 16))
    header = np.zeros(256, dtype="<i4")
    header[:3] = SHARD_MAGIC, SHARD_VERSION, len(tokens)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype("<u2").tobytes())


def markov_stream(num_tokens, seed, chain_seed=1234, vocab=256, successors=4):
    """Documents of 40 to 399 tokens, each led by EOT, walking a random Markov chain over `vocab` tokens with
    `successors` equally likely next tokens: learnable to ln(successors) nats, far below ln(vocab)."""
    table = np.random.default_rng(chain_seed).integers(0, vocab, size=(vocab, successors)).tolist()
    rng, tokens = np.random.default_rng(seed), []
    while len(tokens) < num_tokens:
        state, choices = int(rng.integers(vocab)), rng.integers(successors, size=int(rng.integers(39, 399))).tolist()
        tokens.append(EOT)
        for choice in choices:
            tokens.append(state)
            state = table[state][choice]
    return np.array(tokens[:num_tokens])


def data_files(args, split, num_tokens):
    """The shard pattern of a split. For "synthetic", first write the seeded Markov stream as one shard into
    the log folder; ranks write identical bytes, each renaming its own temp file, so races are harmless."""
    pattern = getattr(args, f"{split}_files")
    if pattern != "synthetic":
        return pattern
    path = Path(args.log_dir) / f"synthetic-seed{args.seed}" / f"synthetic_{split}_{int(split == 'train'):06d}.bin"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    write_data_shard(tmp, markov_stream(num_tokens, [args.seed, int(split == "train")], args.seed))
    os.replace(tmp, path)
    return glob.escape(str(path))


class DistributedDataLoader:
    """All ranks walk one global token stream; of each global batch, rank r takes the r-th share."""

    def __init__(self, files_pattern, rank, world_size, device, hint=None):
        self.files = sorted(glob.glob(files_pattern))
        if not self.files:
            raise UserError(f"no data shard matches {files_pattern!r}: {hint or fetch_hint(1, 1)}, "
                            "or point --train_files/--val_files at your shards")
        self.sizes = [read_shard_header(path) for path in self.files]  # a bad shard fails now, not hours in
        self.rank, self.world_size, self.device = rank, world_size, device
        self.reset()

    def batches_before_wrap(self, batch_size):
        """Whole batches the shards give, in next_batch's way, before the stream starts over."""
        for path, n in zip(self.files, self.sizes):
            if n < batch_size + 2:  # next_batch takes a batch while pos + batch + 1 < tokens
                raise UserError(f"{path}: {n:,} tokens, fewer than one batch of {batch_size:,} + 2 "
                                "(the last target and the loader's margin): use other shards or a smaller batch")
        return sum((n - 2) // batch_size for n in self.sizes)

    def reset(self):
        self._load(0)

    def _load(self, shard):
        self.shard, self.pos = shard, 0
        self.tokens = load_data_shard(self.files[shard])

    def next_batch(self, batch_size):
        if batch_size % self.world_size:
            raise UserError(f"batch of {batch_size} tokens does not divide among {self.world_size} processes")
        if self.pos + batch_size + 1 >= len(self.tokens):
            self._load((self.shard + 1) % len(self.files))
            if batch_size + 1 >= len(self.tokens):
                raise UserError(f"{self.files[self.shard]}: {len(self.tokens)} tokens, fewer than one batch of {batch_size + 1}")
        share = batch_size // self.world_size
        start = self.pos + self.rank * share
        chunk = self.tokens[start:start + share + 1]
        self.pos += batch_size
        inputs = chunk[:-1].to(device=self.device, dtype=torch.int32, non_blocking=True)
        targets = chunk[1:].to(device=self.device, dtype=torch.int64, non_blocking=True)
        return inputs, targets


# -----------------------------------------------------------------------------
# Training loop


def lr_multiplier(step, args):
    """Stable, then linear decay to 0 over the last cooldown_frac of the steps."""
    remaining = 1 - step / args.num_iterations
    return 1.0 if remaining >= args.cooldown_frac else remaining / args.cooldown_frac


def muon_momentum(step, args):
    frac = min(step / args.muon_momentum_warmup_steps, 1) if args.muon_momentum_warmup_steps else 1
    return (1 - frac) * args.muon_momentum_start + frac * args.muon_momentum


def window_blocks_at(step, args):
    """Attention window in whole blocks, growing linearly over training (1 to 14 blocks by default)."""
    x = step / args.num_iterations
    return int(((1 - x) * args.window_start + x * args.window_end) // BLOCK_SIZE)


def step_avg(train_time_ms, steps_done):
    """Mean ms per timed step; the first 10 steps (compilation, warm-up) are not timed."""
    return train_time_ms / (steps_done - 10) if steps_done > 10 else float("nan")


def parse_kernel_options(text):
    """--flex_kernel_options: '' (torch's defaults) or a JSON object of FlexAttention kernel options."""
    try:
        options = json.loads(text) if text else None
    except json.JSONDecodeError as e:
        raise UserError(f"--flex_kernel_options is not valid JSON ({e}); give an object like '{{\"num_warps\": 8}}'")
    if options is not None and not isinstance(options, dict):
        raise UserError(f"--flex_kernel_options must be a JSON object like '{{\"num_warps\": 8}}', got {text!r}")
    return options


def micro_batch_plan(args, world_size):
    """Per-rank micro-batch size and count for the fixed global batch; clear errors where it cannot work."""
    if args.batch_size % world_size:
        raise UserError(f"the global batch of {args.batch_size} tokens does not divide among {world_size} processes; "
                        "use 1, 2, 4 or 8 processes, or a --batch_size divisible by the process count")
    share = args.batch_size // world_size
    micro = min(args.max_device_batch_size, share)
    if share % micro or micro % BLOCK_SIZE:
        raise UserError(f"each process's {share} tokens must split into equal micro-batches of at most "
                        f"--max_device_batch_size {args.max_device_batch_size}, each a multiple of {BLOCK_SIZE}")
    val_batch = world_size * args.max_device_batch_size
    if args.val_tokens % val_batch or args.max_device_batch_size % BLOCK_SIZE:
        raise UserError(f"--val_tokens {args.val_tokens} must be a multiple of processes x --max_device_batch_size "
                        f"= {val_batch} (and that a multiple of {BLOCK_SIZE})")
    return micro, share // micro, val_batch


def build_optimizers(model, args, compiled=False):
    """Adam for embeddings, head and scalars; Muon for the matrices inside the blocks."""
    adam_groups = [
        dict(params=[model.embed.weight, *(t.weight for t in model.value_embeds)], lr=args.embed_lr),
        dict(params=[model.lm_head.weight], lr=args.head_lr),
        dict(params=[p for p in model.parameters() if p.ndim < 2], lr=args.scalar_lr),
    ]
    adam = torch.optim.Adam(adam_groups, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps, fused=True)  # fused: CUDA and CPU
    matrices = [p for p in model.blocks.parameters() if p.ndim == 2]
    muon = Muon(matrices, lr=args.muon_lr, momentum=args.muon_momentum, compiled=compiled)
    optimizers = [adam, muon]
    for opt in optimizers:
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    return optimizers


@torch.no_grad()
def evaluate(model, loader, args, val_batch, window_blocks, world_size):
    model.eval()
    loader.reset()
    steps = args.val_tokens // val_batch
    total = torch.zeros((), device=window_blocks.device)
    for _ in range(steps):
        inputs, targets = loader.next_batch(val_batch)
        total += model(inputs, targets, window_blocks)
    total /= steps
    if world_size > 1:
        dist.all_reduce(total)  # gloo has no AVG
        total /= world_size
    model.train()
    return total.item()


def environment_report(world_size, device):
    lines = [f"Running Python {sys.version}",
             f"Running PyTorch {torch.__version__} compiled for CUDA {torch.version.cuda}",
             f"devices: {world_size} x {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}"]
    if shutil.which("nvidia-smi"):
        lines.append(subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout.rstrip())
    return lines


def load_compile_cache(path, stamp):
    """Fill the local compile caches from a saved file; returns what happened, for the log."""
    if not os.path.exists(path):
        return "not found; rank 0 writes it after step 1"
    try:
        header, _, artifacts = Path(path).read_bytes().partition(b"\n")
        made_by, _, digest = header.decode(errors="replace").rpartition(" sha256=")
        if made_by != stamp:
            return f"rejected: made by {made_by[:150]!r}, this run is {stamp!r}; rank 0 replaces it after step 1"
        if hashlib.sha256(artifacts).hexdigest() != digest or torch.compiler.load_cache_artifacts(artifacts) is None:
            return "rejected: corrupt or unreadable; rank 0 replaces it after step 1"
    except Exception as e:  # a bad cache costs a compile, never the run
        return f"rejected: {type(e).__name__}: {e}"
    return f"loaded ({len(artifacts) / 2 ** 20:.1f} MiB)"


def save_compile_cache(path, stamp):
    """Save what this process compiled: a temp file in the same folder renamed into place, never half a cache."""
    tmp, artifacts = f"{path}.{os.getpid()}.tmp", (torch.compiler.save_cache_artifacts() or [b""])[0]
    try:
        Path(tmp).write_bytes(f"{stamp} sha256={hashlib.sha256(artifacts).hexdigest()}\n".encode() + artifacts)
        os.replace(tmp, path)
    except OSError as e:
        return f"not saved: {e}"
    return f"saved ({len(artifacts) / 2 ** 20:.1f} MiB)"


def train(args):
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    master = rank == 0
    micro, accum_steps, val_batch = micro_batch_plan(args, world_size)
    kernel_options = parse_kernel_options(args.flex_kernel_options)

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        if torch.cuda.device_count() < local_world:
            raise UserError(f"{local_world} processes on this node but {torch.cuda.device_count()} GPUs visible: "
                            f"use --nproc_per_node={torch.cuda.device_count()} (the global batch stays the same)")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    compile_model = args.compile == "true" or (args.compile == "auto" and use_cuda)
    hint = fetch_hint(args.num_iterations, args.batch_size)
    train_loader = DistributedDataLoader(data_files(args, "train", args.num_iterations * args.batch_size + 2),
                                         rank, world_size, device, hint)
    val_loader = DistributedDataLoader(data_files(args, "val", args.val_tokens + 2), rank, world_size, device, hint)
    # the data budget, from the shard headers alone: the loader would wrap around silently
    train_batches = train_loader.batches_before_wrap(args.batch_size)
    passes = args.num_iterations / train_batches
    if passes > 1 and not args.allow_data_repeat:
        raise UserError(f"the run needs {args.num_iterations} batches of {args.batch_size:,} train tokens "
                        f"({args.num_iterations * args.batch_size:,} tokens) but the train shards hold "
                        f"{sum(train_loader.sizes):,}, enough for {train_batches} without repeating: {hint}, "
                        "lower --num_iterations, or pass --allow_data_repeat true to reuse tokens")
    val_batches = val_loader.batches_before_wrap(val_batch)
    if args.val_tokens // val_batch > val_batches:
        raise UserError(f"--val_tokens {args.val_tokens:,} is more than the val shards hold "
                        f"({sum(val_loader.sizes):,} tokens, {val_batches * val_batch:,} in whole batches of "
                        f"{val_batch:,}): lower --val_tokens, or add val shards")
    triton = next((d.version for d in importlib.metadata.distributions(name="triton")), None)
    stamp = (f"train_gpt compile cache: torch {torch.__version__}, triton {triton}, "  # what compiled code depends on
             f"{torch.cuda.get_device_name(device) if use_cuda else 'cpu'}")
    cache_note = "ignored: compile is off"
    if args.compile_cache and compile_model:  # every rank loads, before anything compiles
        cache_note = load_compile_cache(args.compile_cache, stamp)
    if world_size > 1:
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", device_id=device if use_cuda else None)

    log_file, source = None, Path(__file__).read_text()
    if master:
        os.makedirs(args.log_dir, exist_ok=True)
        run_id = str(uuid.uuid4())
        log_path = os.path.join(args.log_dir, f"{run_id}.txt")
        log_file = open(log_path, "w")
        print(f"logging to {log_path}")
        log_file.write(source + "\n" + "=" * 100 + "\n")

    def log(line, console=True):
        if master:
            if console:
                print(line)
            log_file.write(line + "\n")
            log_file.flush()

    for line in environment_report(world_size, device):
        log(line, console=False)
    log("=" * 100, console=False)
    log("hyperparameters:", console=False)
    for name, value in asdict(args).items():
        log(f"  {name} = {value}", console=False)
    log(f"train shards ({len(train_loader.files)}): {' '.join(train_loader.files)}", console=False)
    log(f"val shards ({len(val_loader.files)}): {' '.join(val_loader.files)}", console=False)
    synthetic = "synthetic" in (args.train_files, args.val_files)
    log(f"data: {f'synthetic Markov-chain documents (seed {args.seed}), no download needed; ' * synthetic}"
        f"train {args.train_files}, val {args.val_files}; {args.num_iterations * args.batch_size:,} train tokens "
        f"read, {passes:.2f} passes over the train shards")
    if args.compile_cache:
        log(f"compile cache {args.compile_cache}: {cache_note}")
    log("=" * 100, console=False)

    torch.manual_seed(args.seed)
    raw_model = GPT(args.vocab_size, args.num_layers, args.num_heads, args.model_dim,
                    args.attention_free_layer, args.bf16_embeds, args.fused_head_loss, args.fused_qkv,
                    kernel_options).to(device)
    optimizers = build_optimizers(raw_model, args, compiled=compile_model)
    model = raw_model
    if compile_model:
        if args.compile_tuning:  # record 18 sets no inductor option; H100: first compile 514 s instead of 120 s
            from torch._inductor import config as inductor_config
            inductor_config.coordinate_descent_tuning = True
        model = torch.compile(model, dynamic=False)
    ddp_model = model
    if world_size > 1:
        ddp_model = DDP(model, device_ids=[local_rank] if use_cuda else None,
                        broadcast_buffers=False, gradient_as_bucket_view=True)
    # a device tensor, changed in place: the compiled graph sees a new value, never a new constant
    window_blocks = torch.tensor(window_blocks_at(0, args), dtype=torch.int32, device=device)

    def synchronize():
        if use_cuda:
            torch.cuda.synchronize()

    N = args.num_iterations
    train_time_ms = 0.0
    t0 = time.perf_counter()
    start = max(0, min(12, N - args.profile))  # after warm-up, earlier in short runs
    profiled, profiler = range(start, min(N, start + args.profile)), None
    for step in range(N + 1):
        last_step = step == N
        if step == 10:  # the first steps compile and warm up; the clock restarts here
            train_time_ms = 0.0
            t0 = time.perf_counter()
        if master and args.profile > 0 and step == profiled.start:
            activities = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * use_cuda
            profiler = torch.profiler.profile(activities=activities)
            profiler.start()
        if profiler and step == profiled.stop:
            synchronize()
            profiler.stop()
        window_blocks.fill_(window_blocks_at(step, args))

        if last_step or (args.val_loss_every > 0 and step % args.val_loss_every == 0):
            synchronize()
            train_time_ms += 1000 * (time.perf_counter() - t0)
            val_loss = evaluate(model, val_loader, args, val_batch, window_blocks, world_size)
            log(f"step:{step}/{N} val_loss:{val_loss:.4f} train_time:{train_time_ms:.0f}ms "
                f"step_avg:{step_avg(train_time_ms, step):.2f}ms")
            if not math.isfinite(val_loss):  # every rank sees the same reduced loss, so all stop here
                message = (f"val loss is {val_loss} at step {step}: training diverged, most likely a learning rate "
                           "too high for this configuration (--muon_lr, --embed_lr, --head_lr, --scalar_lr)")
                log(f"error: {message}", console=False)
                if log_file:
                    log_file.close()
                raise UserError(message)
            synchronize()
            t0 = time.perf_counter()
        if last_step:
            break

        inputs, targets = train_loader.next_batch(args.batch_size)
        for i in range(accum_steps):
            last_micro = i == accum_steps - 1
            # gradients are all-reduced once per step, on the last micro-batch
            no_sync = ddp_model.no_sync() if world_size > 1 and not last_micro else contextlib.nullcontext()
            with no_sync:
                part = slice(i * micro, (i + 1) * micro)
                loss = ddp_model(inputs[part], targets[part], window_blocks)
                (loss / accum_steps).backward()
        lr_scale = lr_multiplier(step, args)
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] = group["initial_lr"] * lr_scale
        for group in optimizers[1].param_groups:
            group["momentum"] = muon_momentum(step, args)
        for opt in optimizers:
            opt.step()
        raw_model.zero_grad(set_to_none=True)
        approx_ms = train_time_ms + 1000 * (time.perf_counter() - t0)  # no sync: the step stays asynchronous
        log(f"step:{step + 1}/{N} train_time:{approx_ms:.0f}ms step_avg:{step_avg(approx_ms, step + 1):.2f}ms")
        if step == 0:  # everything has compiled now: eval at step 0, model and optimisers in step 1
            synchronize()
            startup = f"startup: {time.time() - LAUNCH_TIME:.1f}s from launch to the end of step 1"
            if compile_model:  # compile time and the caches' own hit counts, from torch._dynamo
                spent = getattr(torch._dynamo.utils, "calculate_time_spent", dict)().get("total_wall_time", math.nan)
                fx, aot = torch._dynamo.utils.counters["inductor"], torch._dynamo.utils.counters["aot_autograd"]
                startup += (f", {spent:.1f}s of it compiling (cache hits/misses: FX graph {fx['fxgraph_cache_hit']}/"
                            f"{fx['fxgraph_cache_miss']}, AOT {aot['autograd_cache_hit']}/{aot['autograd_cache_miss']})")
                if master and args.compile_cache:
                    startup += f"; compile cache {save_compile_cache(args.compile_cache, stamp)}"
            log(startup)

    if profiler:  # "profile: " lines sit between the step lines and the last line, which stays the peak memory
        trace_path = os.path.join(args.log_dir, f"{run_id}.trace.json")
        profiler.export_chrome_trace(trace_path)
        log(f"profile: {len(profiled)} step(s) from step {profiled.start + 1} ran under the profiler, so the times above "
            f"are not representative; trace for Perfetto or chrome://tracing: {trace_path}")
        table = profiler.key_averages().table(sort_by=f"self_{'device' if use_cuda else 'cpu'}_time_total", row_limit=25)
        for line in table.splitlines():
            log(f"profile: {line}", console=False)
    if use_cuda:
        peak_mib = torch.cuda.max_memory_allocated() // 2 ** 20
    else:  # CPU: peak resident memory of the process (ru_maxrss is in KiB on Linux)
        peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    log(f"peak memory consumption: {peak_mib} MiB")
    if master and args.save_checkpoint:
        ckpt_dir = os.path.join(args.log_dir, run_id)
        os.makedirs(ckpt_dir, exist_ok=True)
        torch.save(dict(step=N, code=source, args=asdict(args), model=raw_model.state_dict(),
                        optimizers=[opt.state_dict() for opt in optimizers]),
                   os.path.join(ckpt_dir, f"state_step{N:06d}.pt"))
    if log_file:
        log_file.close()
    if world_size > 1:
        dist.barrier()  # no rank tears the process group down while another still writes or reduces
    return 0


# -----------------------------------------------------------------------------
# main


def parse_bool(text):
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def parse_args(argv=None):
    preset_parser = argparse.ArgumentParser(add_help=False)
    preset_parser.add_argument("--preset", choices=sorted(PRESETS))
    parser = argparse.ArgumentParser(description="NanoGPT speedrun trainer (SPEC.md). Every option has a default.",
                                     parents=[preset_parser])
    for f in fields(Hyperparameters):
        kind = parse_bool if f.type is bool else f.type
        parser.add_argument(f"--{f.name}", type=kind, default=f.default, metavar=f.type.__name__.upper(),
                            help="default: %(default)s")
    preset = preset_parser.parse_known_args(argv)[0].preset
    if preset:
        parser.set_defaults(**PRESETS[preset])
    namespace = parser.parse_args(argv)
    if namespace.compile not in ("auto", "true", "false"):
        parser.error("--compile must be auto, true or false")
    return Hyperparameters(**{f.name: getattr(namespace, f.name) for f in fields(Hyperparameters)})


def main(argv=None):
    # before anything initialises CUDA: fewer fragmentation stalls when the window grows
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    args = parse_args(argv)
    try:
        return train(args)
    except UserError as e:
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
