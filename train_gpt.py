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

# -----------------------------------------------------------------------------
# Configuration


@dataclass
class Hyperparameters:
    # data: glob patterns of token shards, taken in sorted file-name order
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
    regional_compile: bool = False  # compile each block and the head on its own: 4 block forms traced, not 12 blocks
    seed: int = 0
    # speed options: off until a GPU has measured them
    fused_head_loss: bool = False  # head + softcap + cross-entropy chunk by chunk, gradients in the forward pass
    fused_qkv: bool = False  # q, k, v as one product of the stacked weights (still three matrices for Muon)
    profile: int = 0  # profile this many train steps after warm-up: trace and top-kernel table in log_dir


def check_hyperparameters(args):
    """Refuse, naming the option and its valid range, any value that cannot work: called before any file,
    process group or model exists. The checks that depend on the process count are in micro_batch_plan."""
    mdbs, heads = args.max_device_batch_size, args.num_heads
    rules = [  # (fields, test of a value, valid range); in order: a test may use the fields checked above it
        ("train_files val_files", lambda v: v != "", "a glob of token shards or 'synthetic'"),
        ("batch_size", lambda v: v > 0 and v % BLOCK_SIZE == 0, f"a positive multiple of {BLOCK_SIZE}"),
        # one packed sequence per forward: whole attention blocks, no longer than Rotary's table
        ("max_device_batch_size", lambda v: 0 < v <= 65536 and v % BLOCK_SIZE == 0,
         f"a multiple of {BLOCK_SIZE} from {BLOCK_SIZE} to 65536"),
        ("val_tokens", lambda v: v > 0 and v % mdbs == 0, f"a positive multiple of --max_device_batch_size ({mdbs})"),
        ("num_iterations num_heads", lambda v: v >= 1, "at least 1"),
        ("val_loss_every attention_free_layer muon_momentum_warmup_steps profile", lambda v: v >= 0, "at least 0"),
        ("cooldown_frac", lambda v: 0 <= v <= 1, "from 0 (no decay) to 1 (decay from the first step)"),
        # the window, interpolated between these two, must hold at least one whole block at every step
        ("window_start window_end", lambda v: v >= BLOCK_SIZE, f"at least {BLOCK_SIZE} tokens (one attention block)"),
        ("vocab_size", lambda v: v > EOT, f"at least {EOT + 1}: GPT-2 token ids go up to {EOT} (end of text)"),
        ("num_layers", lambda v: v >= 6 and v % 2 == 0, "even, at least 6 (U-net halves, 3+3 value-embedded layers)"),
        ("model_dim", lambda v: v > 0 and v % (4 * heads) == 0,
         f"a positive multiple of 4 x --num_heads ({4 * heads}): heads of a size divisible by 4 (rotary)"),
        # 0 is allowed: it freezes that parameter group, an ablation
        ("embed_lr head_lr scalar_lr muon_lr", lambda v: 0 <= v < math.inf, "finite and at least 0"),
        # 1 would never let a gradient into the running averages
        ("adam_beta1 adam_beta2 muon_momentum_start muon_momentum", lambda v: 0 <= v < 1, "at least 0 and below 1"),
        # Adam divides by sqrt(v) + eps, and v stays 0 for a token the batches never hold
        ("adam_eps", lambda v: 0 < v < math.inf, "finite and above 0"),
        ("log_dir", lambda v: v != "" and not os.path.isfile(v), "a folder name (not empty, not an existing file)"),
        ("compile", lambda v: v in ("auto", "true", "false"), "auto, true or false"),
        ("compile_cache", lambda v: not os.path.isdir(v), "a file name or '' (off), not a folder"),
        ("seed", lambda v: 0 <= v < 2 ** 64, "from 0 to 2**64 - 1 (torch.manual_seed's range)"),
    ]
    for names, valid, allowed in rules:
        for name in names.split():
            if not valid(getattr(args, name)):
                raise UserError(f"--{name} must be {allowed}; got {getattr(args, name)!r}")


# A small model and a short run that finish in under a minute on a 2-core CPU; still exercises every part
# (value embeddings, U-net skips, the attention-free block, window growth, accumulation: tests/test_options.py).
# Most of a CPU step is the head, 1,024 tokens x 50,304 logits whatever the width: so few steps, and a head
# learning rate 8x the record's, with which the zero-initialised head learns the chain in 12 steps (val loss
# 1.84; with 0.008 this model is still at 2.35 after 40 steps).
PRESETS = {
    "smoke": dict(
        num_layers=8, num_heads=2, model_dim=64, head_lr=0.064,
        batch_size=1024, max_device_batch_size=512,  # 2 micro-batches on 1 process; 1, 2, 4 or 8 processes all fit
        num_iterations=12, val_loss_every=4, val_tokens=4096,
        window_end=512 + 64,  # 1 to 4 blocks: the whole 512-token sequence at the end
        train_files="synthetic", val_files="synthetic",  # no download: see markov_stream
    ),
}

BLOCK_SIZE = 128  # FlexAttention block; sequences are multiples of it
EOT = 50256  # <|endoftext|>, precedes every document


class UserError(Exception):
    """A problem the user can fix (data, configuration, hardware); main() prints it without a traceback,
    on rank 0 only unless it may happen on one rank alone."""

    def __init__(self, message, every_rank=False):
        super().__init__(message)
        self.every_rank = every_rank


# -----------------------------------------------------------------------------
# Muon: MomentUm Orthogonalized by Newton-Schulz (Keller Jordan, 2024)


def newton_schulz_wide(X, steps):
    """The iteration on a batch of wide or square bf16 matrices (..., rows <= cols), each normalised on its
    own; Muon compiles this part (one graph per stacked shape)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    return X


def zeropower_via_newtonschulz5(G, steps):
    """Roughly orthogonalise G: a quintic Newton-Schulz iteration whose coefficients are tuned to push
    singular values towards 1 fast, not exactly (they land near 0.7 to 1.2). Runs in bfloat16."""
    assert G.ndim == 2
    tall = G.size(0) > G.size(1)  # iterate on the smaller Gram matrix
    X = newton_schulz_wide((G.mT if tall else G).to(torch.bfloat16)[None], steps)[0]
    return X.mT if tall else X


class Muon(torch.optim.Optimizer):
    """SGD-momentum (Nesterov) whose update is orthogonalised, for the 2-D matrices of the blocks.

    Distributed without sharding the state: parameters are grouped by shape, a tall matrix counted as its
    wide transpose. Of a group, rank r takes matrices r, r+W, r+2W, ... (W = world size) and orthogonalises
    them as one stacked bf16 batch; all ranks all-gather the batches. Each gather is asynchronous and
    applied only after the later groups' batches are computed, so it overlaps them.
    Gradients must already be averaged across ranks (DDP does it).
    """

    def __init__(self, params, lr, momentum, nesterov=True, ns_steps=5, compiled=False):
        self.rank = int(os.environ.get("RANK", 0))
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        params = list(params)
        wide = [tuple(sorted(p.shape)) for p in params]  # a tall matrix is stacked as its wide transpose
        shapes = sorted(set(wide), key=lambda s: (-s[0] * s[1], s))
        groups = [dict(params=[p for p, w in zip(params, wide) if w == s]) for s in shapes]
        super().__init__(groups, dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps))
        # compiled as in record 18; static shapes: one graph per stacked shape, never a recompile per step
        self.iterate = torch.compile(newton_schulz_wide, dynamic=False) if compiled else newton_schulz_wide
        # per group, allocated once and outside the state so that checkpoints stay small: this rank's
        # stacked input, whose zero padding evens the shares (it orthogonalises to zero), and the gather
        # buffer, whose slots [r * share, (r + 1) * share) receive rank r's batch
        shares = [math.ceil(len(g["params"]) / self.world_size) for g in groups]
        self.stacked = [params[0].new_zeros(n, *s, dtype=torch.bfloat16) for n, s in zip(shares, shapes)]
        self.gathered = [x.new_empty(self.world_size * len(x), *x.shape[1:]) if self.world_size > 1 else None
                         for x in self.stacked]

    @torch.no_grad()
    def step(self):
        launched = []
        for group, stacked, gathered in zip(self.param_groups, self.stacked, self.gathered):
            mine = group["params"][self.rank::self.world_size]
            if mine:  # a group with fewer matrices than ranks leaves some ranks only padding
                self._stack_updates(mine, group, stacked)
            orthogonalised, handle = self.iterate(stacked, group["ns_steps"]), None
            if self.world_size > 1:
                handle = dist.all_gather_into_tensor(gathered, orthogonalised, async_op=True)
                orthogonalised = gathered
            launched.append((group, handle, orthogonalised))
        for group, handle, orthogonalised in launched:  # each gather has overlapped the later groups' batches
            if handle is not None:
                handle.wait()
            share = len(orthogonalised) // self.world_size
            for i, p in enumerate(group["params"]):  # matrix i is rank i % W's (i // W)-th
                O = orthogonalised[i % self.world_size * share + i // self.world_size]
                tall = p.size(0) > p.size(1)
                scale = max(1, p.size(0) / p.size(1)) ** 0.5  # same RMS step for tall and wide matrices
                p.add_(O.mT if tall else O, alpha=-group["lr"] * scale)

    def _stack_updates(self, mine, group, stacked):
        """Momentum for this rank's matrices, Nesterov's look-ahead written straight into the batch."""
        assert all(p.grad is not None for p in mine), "Muon: a matrix received no gradient"
        for p in mine:
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad)
        grads = [p.grad for p in mine]
        buffers = [self.state[p]["momentum_buffer"] for p in mine]
        m = group["momentum"]
        torch._foreach_lerp_(buffers, grads, 1 - m)  # buf = m*buf + (1-m)*g
        updates = torch._foreach_lerp(grads, buffers, m) if group["nesterov"] else buffers
        torch._foreach_copy_(stacked[:len(mine)].unbind(), [u.mT if u.size(0) > u.size(1) else u for u in updates])


# -----------------------------------------------------------------------------
# Kernels: faster forms of model pieces, each equal up to rounding to the plain expression it replaces
# (tests/test_kernels.py). Before the model, which calls them; used only when an option asks.

HEAD_CHUNK_ROWS = 8192  # logits alive at once: 8192 x 50304 in bf16 (0.8 GB), not 64K rows in bf16 and fp32 (20 GB)


def softcapped_cross_entropy_chunks(x, weight, targets, with_grads):
    """Mean cross-entropy of the logits 15 tanh(x W^T / 15), a chunk of rows at a time; with_grads, also
    the gradients of that mean with respect to x and W (fp32), so whole logits never exist."""
    w, rows = weight.type_as(x), x.size(0)
    loss = torch.zeros((), device=x.device)
    grad_x, grad_w = [], torch.zeros_like(weight, dtype=torch.float32) if with_grads else None
    for start in range(0, rows, HEAD_CHUNK_ROWS):
        xc, tc = x[start:start + HEAD_CHUNK_ROWS], targets[start:start + HEAD_CHUNK_ROWS, None]
        z = F.linear(xc, w)  # logits in x's dtype, as lm_head computes them; softcap and softmax in fp32
        capped = 15 * torch.tanh(z.float() / 15)
        logp = torch.log_softmax(capped, dim=1)  # compiled: one online-softmax pass, logp itself never stored
        loss -= logp.gather(1, tc).sum()
        if with_grads:  # d mean loss / d z = softcap'(z) (softmax - onehot) / rows, in x's dtype as unfused
            onehot = torch.arange(z.size(1), device=z.device) == tc
            g = ((logp.exp() - onehot.float()) * (1 - (capped / 15) ** 2) / rows).type_as(x)
            grad_x.append(g @ w)
            grad_w += (g.T @ xc).float()
    return loss / rows, torch.cat(grad_x) if with_grads else None, grad_w


class FusedHeadLoss(torch.autograd.Function):
    """Fused linear cross-entropy: the head's loss with its gradients computed in the forward pass."""

    @staticmethod
    def forward(ctx, x, weight, targets):
        loss, grad_x, grad_w = softcapped_cross_entropy_chunks(x, weight, targets, with_grads=True)
        ctx.save_for_backward(grad_x, grad_w)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_w = ctx.saved_tensors
        return grad_x * grad_loss, grad_w * grad_loss, None


def fused_head_loss(x, weight, targets):
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return FusedHeadLoss.apply(x, weight, targets)
    return softcapped_cross_entropy_chunks(x, weight, targets, with_grads=False)[0]  # eval: no gradients


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
    def __init__(self, dim, num_heads, fused_qkv=False):
        super().__init__()
        self.num_heads, self.fused_qkv = num_heads, fused_qkv
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
            y = flex_attention(q, k, v, block_mask=mask, scale=self.head_dim ** -0.5)
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
    def __init__(self, dim, num_heads, has_attention, fused_qkv=False):
        super().__init__()
        self.attn = CausalSelfAttention(dim, num_heads, fused_qkv) if has_attention else None
        self.mlp = MLP(dim)
        self.lambdas = nn.Parameter(torch.tensor([1.0, 0.0]))  # mix of the stream and the embedding x0

    def forward(self, x, value_embed, x0, mask):
        x = self.lambdas[0] * x + self.lambdas[1] * x0
        if self.attn is not None:
            x = x + self.attn(norm(x), value_embed, mask)
        return x + self.mlp(norm(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, num_layers, num_heads, model_dim, *, attention_free_layer=7, bf16_embeds=True,
                 fused_head_loss=False, fused_qkv=False):
        super().__init__()
        if num_layers < 6 or num_layers % 2:
            raise UserError(f"num_layers must be even and at least 6 (U-net halves, 3+3 value-embedded layers); got {num_layers}")
        if model_dim % num_heads or (model_dim // num_heads) % 4:
            raise UserError(f"model_dim {model_dim} must split into {num_heads} heads of a size divisible by 4 (rotary)")
        self.num_layers, self.fused_head_loss = num_layers, fused_head_loss
        self.embed = nn.Embedding(vocab_size, model_dim)
        # three value-embedding tables, used by the first three and the last three layers
        self.value_embeds = nn.ModuleList(nn.Embedding(vocab_size, model_dim) for _ in range(3))
        self.blocks = nn.ModuleList(Block(model_dim, num_heads, i != attention_free_layer, fused_qkv)
                                    for i in range(num_layers))
        self.skip_weights = nn.Parameter(torch.ones(num_layers // 2))  # U-net: encoder i feeds decoder
        self.lm_head = CastedLinear(model_dim, vocab_size, zero_init=True)  # untied; step-0 loss = ln(vocab)
        if bf16_embeds:
            for table in [self.embed, *self.value_embeds]:
                table.bfloat16()

    @classmethod
    def from_args(cls, args):
        return cls(args.vocab_size, args.num_layers, args.num_heads, args.model_dim,
                   attention_free_layer=args.attention_free_layer, bf16_embeds=args.bf16_embeds,
                   fused_head_loss=args.fused_head_loss, fused_qkv=args.fused_qkv)

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
        return self.head_loss(norm(x)[0], targets)

    def head_loss(self, x, targets):
        if self.fused_head_loss:  # same maths, without materialising the logits
            return fused_head_loss(x, self.lm_head.weight, targets)
        logits = self.lm_head(x)
        logits = 15 * torch.tanh(logits / 15)  # logit softcap (as in Gemma 2)
        return F.cross_entropy(logits.float(), targets)


# -----------------------------------------------------------------------------
# Attention masks: causal, within one document, inside a sliding window of whole 128-token blocks


def listed_rows(first, last, window_blocks):
    """Per q-block (row), the kv blocks to visit, by arithmetic on each block's first and last doc id (both
    nondecreasing): counts and index lists of the partial-not-full and of the full blocks. Documents are contiguous
    and the window is a band, so row q's partial blocks are one run [start, q]; if q lies in one document, its full
    blocks are the run [full_start, q), the others [start, full_start) and q. Entries past a row's count repeat q."""
    q = torch.arange(len(first), device=first.device)[:, None]
    start = torch.maximum(torch.searchsorted(last, first)[:, None], q - window_blocks + 1)  # reaches q's first doc
    full_start = torch.maximum(torch.searchsorted(first, first)[:, None], start)  # starts in q's doc
    full_start = torch.where((first == last)[:, None], full_start, q + 1)
    full_count = (q - full_start).clamp(min=0)
    position = q.T  # place in a row's list
    partial = torch.where(position < full_start - start, start + position, q)
    full = torch.where(position < full_count, full_start + position, q)
    partial_count = (q + 1 - start).clamp(min=0) - full_count
    return [t.to(torch.int32)[None, None].contiguous() for t in (partial_count[:, 0], partial, full_count[:, 0], full)]


def build_block_mask(inputs, window_blocks):
    """The FlexAttention mask, built without a sort: compiled, one can take forever (PyTorch issues 182060, 138514)."""
    docs = (inputs == EOT).cumsum(0)
    first, last = docs[0::BLOCK_SIZE].contiguous(), docs[BLOCK_SIZE - 1::BLOCK_SIZE].contiguous()
    kv_lists, n = listed_rows(first, last, window_blocks), len(first)
    # the q-side lists (backward pass) are the rows of the mirror image, blocks reversed and doc ids negated: its
    # row r is our column n - 1 - r. Given to the constructor, as from_kv_blocks would derive them with a sort
    mirrored = listed_rows(-last.flip(0), -first.flip(0), window_blocks)
    q_lists = [t.flip(-1) if t.dim() == 3 else n - 1 - t.flip(-2) for t in mirrored]  # counts, index lists

    def document_causal(b, h, q_idx, kv_idx):  # the per-token test, needed in partial blocks only
        return (q_idx >= kv_idx) & (docs[q_idx] == docs[kv_idx])

    return BlockMask((len(inputs),) * 2, *kv_lists, *q_lists, BLOCK_SIZE=(BLOCK_SIZE,) * 2, mask_mod=document_causal)


def build_dense_mask(inputs, window_blocks):
    """The same mask as a dense (T, T) boolean matrix, token by token, for attention on CPU."""
    docs = (inputs == EOT).cumsum(0)
    pos = torch.arange(len(inputs), device=inputs.device)
    q, k = pos[:, None], pos[None, :]
    return (k <= q) & (k // BLOCK_SIZE > q // BLOCK_SIZE - window_blocks) & (docs[:, None] == docs[None, :])


# -----------------------------------------------------------------------------
# Data: token shards and the loader every rank walks in step

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


def prepare_shards(args, split, num_tokens):
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

UNTIMED_STEPS = 10  # the first steps compile and warm up; train_time starts after them


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
    """Mean ms per timed step; the untimed warm-up steps are left out."""
    return train_time_ms / (steps_done - UNTIMED_STEPS) if steps_done > UNTIMED_STEPS else float("nan")


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


def setup_device():
    """Rank, world size and device, from torchrun's environment (a single process without it)."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if not torch.cuda.is_available():
        return rank, world_size, torch.device("cpu")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if torch.cuda.device_count() < local_world:
        raise UserError(f"{local_world} processes on this node but {torch.cuda.device_count()} GPUs visible: "
                        f"use --nproc_per_node={torch.cuda.device_count()} (the global batch stays the same)")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if torch.cuda.get_device_capability(device) < (8, 0):  # bf16 matrix units arrived with Ampere
        raise UserError(f"{torch.cuda.get_device_name(device)} has no bf16 support, which this model computes in: "
                        "it needs an Ampere or newer GPU (A100, A10, L4, L40S, RTX 30xx or later, H100)")
    torch.cuda.set_device(device)
    return rank, world_size, device


def build_loaders(args, rank, world_size, device, val_batch):
    """Train and val loaders, with the data budget checked from the shard headers before step 1:
    the loader itself would wrap around silently."""
    hint = fetch_hint(args.num_iterations, args.batch_size)
    train_loader = DistributedDataLoader(prepare_shards(args, "train", args.num_iterations * args.batch_size + 2),
                                         rank, world_size, device, hint)
    val_loader = DistributedDataLoader(prepare_shards(args, "val", args.val_tokens + 2), rank, world_size, device, hint)
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
    return train_loader, val_loader, passes


class RunLog:
    """Rank 0's log, logs/<uuid>.txt: the exact source, the environment and configuration, then the step lines.
    The one place that opens, writes and closes it; an error that stops the run is its last line."""

    def __init__(self, args, master):
        self.file, self.run_id = None, str(uuid.uuid4())
        if master:
            os.makedirs(args.log_dir, exist_ok=True)
            self.path = os.path.join(args.log_dir, f"{self.run_id}.txt")
            self.file = open(self.path, "w")
            print(f"logging to {self.path}")
            self.file.write(Path(__file__).read_text() + "\n" + "=" * 100 + "\n")

    def __call__(self, line, console=True):
        if self.file:
            if console:
                print(line)
            self.file.write(line + "\n")
            self.file.flush()

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if isinstance(error, UserError):
            self(f"error: {error}", console=False)  # main() prints it
        if self.file:
            self.file.close()

    def header(self, args, world_size, device, train_loader, val_loader, passes, cache_note):
        self("\n".join([*environment_report(world_size, device), "=" * 100, "hyperparameters:"]), console=False)
        for name, value in asdict(args).items():
            self(f"  {name} = {value}", console=False)
        for name, loader in (("train", train_loader), ("val", val_loader)):
            self(f"{name} shards ({len(loader.files)}): {' '.join(loader.files)}", console=False)
        synthetic = "synthetic" in (args.train_files, args.val_files)
        self(f"data: {f'synthetic Markov-chain documents (seed {args.seed}), no download needed; ' * synthetic}"
             f"train {args.train_files}, val {args.val_files}; {args.num_iterations * args.batch_size:,} train tokens "
             f"read, {passes:.2f} passes over the train shards")
        if args.compile_cache:
            self(f"compile cache {args.compile_cache}: {cache_note}")
        self("=" * 100, console=False)


def environment_report(world_size, device):
    lines = [f"Running Python {sys.version}",
             f"Running PyTorch {torch.__version__} compiled for CUDA {torch.version.cuda}",
             f"devices: {world_size} x {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}"]
    if shutil.which("nvidia-smi"):
        lines.append(subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout.rstrip())
    return lines


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
    for opt in (adam, muon):
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    return adam, muon


def build_model(args, device, world_size, compiled):
    """The model, its optimisers, and the (compiled, DDP-wrapped) module the loop calls."""
    torch.manual_seed(args.seed)
    model = GPT.from_args(args).to(device)
    adam, muon = build_optimizers(model, args, compiled=compiled)
    train_model = model
    if compiled:
        if args.compile_tuning:  # record 18 sets no inductor option; H100: first compile 514 s instead of 120 s
            from torch._inductor import config as inductor_config
            inductor_config.coordinate_descent_tuning = True
        train_model = compile_regions(model) if args.regional_compile else torch.compile(model, dynamic=False)
    if world_size > 1:
        train_model = DDP(train_model, device_ids=[device.index] if device.type == "cuda" else None,
                          broadcast_buffers=False, gradient_as_bucket_view=True)
    return model, train_model, adam, muon


def compile_regions(model):
    """Regional compilation: each block compiled on its own, so Dynamo traces four block forms (the first, whose
    input is x0 itself; with value embeddings; without; without attention) instead of all twelve blocks as one
    graph; the head and its loss too. Blocks of one form share compiled code; the embeddings and mask run eagerly."""
    for block in model.blocks:
        block.compile(dynamic=False)
    model.head_loss = torch.compile(model.head_loss, dynamic=False)
    return model


def compile_cache_stamp(device):
    """What compiled code depends on; a cache file made under another stamp is not used."""
    triton = next((d.version for d in importlib.metadata.distributions(name="triton")), None)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return f"train_gpt compile cache: torch {torch.__version__}, triton {triton}, {gpu}"


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


def startup_report(args, compiled, stamp, master):
    """Seconds from launch to the end of step 1 and, when compiling, the compile share and cache hits."""
    line = f"startup: {time.time() - LAUNCH_TIME:.1f}s from launch to the end of step 1"
    if compiled:  # compile time and the caches' own hit counts, from torch._dynamo
        spent = getattr(torch._dynamo.utils, "calculate_time_spent", dict)().get("total_wall_time", math.nan)
        fx, aot = torch._dynamo.utils.counters["inductor"], torch._dynamo.utils.counters["aot_autograd"]
        line += (f", {spent:.1f}s of it compiling (cache hits/misses: FX graph {fx['fxgraph_cache_hit']}/"
                 f"{fx['fxgraph_cache_miss']}, AOT {aot['autograd_cache_hit']}/{aot['autograd_cache_miss']})")
        if master and args.compile_cache:
            line += f"; compile cache {save_compile_cache(args.compile_cache, stamp)}"
    return line


class StepProfiler:
    """--profile N: rank 0 runs N train steps after warm-up under torch.profiler; the trace goes beside the
    log and the top kernels into it as "profile:" lines, before the last line (the peak memory)."""

    def __init__(self, args, device, master):
        start = max(0, min(12, args.num_iterations - args.profile))  # after warm-up, earlier in short runs
        self.steps = range(start, min(args.num_iterations, start + args.profile)) if master else range(0)
        self.device, self.profiler = device, None

    def at(self, step):
        if self.steps and step == self.steps.start:
            cuda = [torch.profiler.ProfilerActivity.CUDA] * (self.device.type == "cuda")
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, *cuda])
            self.profiler.start()
        if self.profiler and step == self.steps.stop:
            synchronize(self.device)
            self.profiler.stop()

    def report(self, log):
        if not self.profiler:
            return
        trace_path = os.path.join(os.path.dirname(log.path), f"{log.run_id}.trace.json")
        self.profiler.export_chrome_trace(trace_path)
        log(f"profile: {len(self.steps)} step(s) from step {self.steps.start + 1} ran under the profiler, so the times "
            f"above are not representative; trace for Perfetto or chrome://tracing: {trace_path}")
        kind = "device" if self.device.type == "cuda" else "cpu"
        for line in self.profiler.key_averages().table(sort_by=f"self_{kind}_time_total", row_limit=25).splitlines():
            log(f"profile: {line}", console=False)


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def stop_if_diverged(val_loss, step):
    if not math.isfinite(val_loss):  # every rank sees the same reduced loss, so all stop here
        raise UserError(f"val loss is {val_loss} at step {step}: training diverged, most likely a learning rate "
                        "too high for this configuration (--muon_lr, --embed_lr, --head_lr, --scalar_lr)")


@contextlib.contextmanager
def out_of_memory_as_error(micro):
    try:
        yield
    except torch.cuda.OutOfMemoryError:
        raise UserError(f"out of GPU memory with micro-batches of {micro:,} tokens: pass --max_device_batch_size "
                        f"{micro // 2} (half usually fits; the global batch and the maths stay the same)",
                        every_rank=True) from None


def peak_memory_mib(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() // 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024  # CPU: peak resident memory (KiB on Linux)


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


def save_checkpoint(args, log, model, optimizers):
    folder = os.path.join(args.log_dir, log.run_id)
    os.makedirs(folder, exist_ok=True)
    torch.save(dict(step=args.num_iterations, code=Path(__file__).read_text(), args=asdict(args),
                    model=model.state_dict(), optimizers=[opt.state_dict() for opt in optimizers]),
               os.path.join(folder, f"state_step{args.num_iterations:06d}.pt"))


def train(args):
    rank, world_size, device = setup_device()
    micro, accum_steps, val_batch = micro_batch_plan(args, world_size)
    train_loader, val_loader, passes = build_loaders(args, rank, world_size, device, val_batch)
    compiled = args.compile == "true" or (args.compile == "auto" and device.type == "cuda")
    stamp = compile_cache_stamp(device)
    cache_note = "ignored: compile is off"
    if args.compile_cache and compiled:  # every rank loads, before anything compiles
        cache_note = load_compile_cache(args.compile_cache, stamp)
    if world_size > 1:
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None)

    with RunLog(args, master=rank == 0) as log, out_of_memory_as_error(micro):
        log.header(args, world_size, device, train_loader, val_loader, passes, cache_note)
        model, train_model, adam, muon = build_model(args, device, world_size, compiled)
        # a device tensor, changed in place: the compiled graph sees a new value, never a new constant
        window_blocks = torch.tensor(window_blocks_at(0, args), dtype=torch.int32, device=device)
        profiler = StepProfiler(args, device, master=rank == 0)
        N = args.num_iterations
        train_time_ms, t0 = 0.0, time.perf_counter()
        for step in range(N + 1):
            last_step = step == N
            if step == UNTIMED_STEPS:
                train_time_ms, t0 = 0.0, time.perf_counter()
            profiler.at(step)
            window_blocks.fill_(window_blocks_at(step, args))

            if last_step or (args.val_loss_every > 0 and step % args.val_loss_every == 0):
                synchronize(device)  # validation is not train time
                train_time_ms += 1000 * (time.perf_counter() - t0)
                val_loss = evaluate(train_model, val_loader, args, val_batch, window_blocks, world_size)
                log(f"step:{step}/{N} val_loss:{val_loss:.4f} train_time:{train_time_ms:.0f}ms "
                    f"step_avg:{step_avg(train_time_ms, step):.2f}ms")
                stop_if_diverged(val_loss, step)
                synchronize(device)
                t0 = time.perf_counter()
            if last_step:
                break

            inputs, targets = train_loader.next_batch(args.batch_size)
            for i in range(accum_steps):
                # gradients are all-reduced once per step, on the last micro-batch
                last_micro = i == accum_steps - 1
                no_sync = train_model.no_sync() if world_size > 1 and not last_micro else contextlib.nullcontext()
                with no_sync:
                    part = slice(i * micro, (i + 1) * micro)
                    (train_model(inputs[part], targets[part], window_blocks) / accum_steps).backward()
            for opt in (adam, muon):
                for group in opt.param_groups:
                    group["lr"] = group["initial_lr"] * lr_multiplier(step, args)
            for group in muon.param_groups:
                group["momentum"] = muon_momentum(step, args)
            adam.step()
            muon.step()
            model.zero_grad(set_to_none=True)
            approx_ms = train_time_ms + 1000 * (time.perf_counter() - t0)  # no sync: the step stays asynchronous
            log(f"step:{step + 1}/{N} train_time:{approx_ms:.0f}ms step_avg:{step_avg(approx_ms, step + 1):.2f}ms")
            if step == 0:  # everything has compiled now: eval at step 0, model and optimisers in step 1
                synchronize(device)
                log(startup_report(args, compiled, stamp, master=rank == 0))

        profiler.report(log)
        log(f"peak memory consumption: {peak_memory_mib(device)} MiB")
        if rank == 0 and args.save_checkpoint:
            save_checkpoint(args, log, model, (adam, muon))
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
    parser = argparse.ArgumentParser(description="NanoGPT speedrun trainer. Every option has a default.",
                                     parents=[preset_parser])
    for f in fields(Hyperparameters):
        kind = parse_bool if f.type is bool else f.type
        parser.add_argument(f"--{f.name}", type=kind, default=f.default, metavar=f.type.__name__.upper(),
                            help="default: %(default)s")
    preset = preset_parser.parse_known_args(argv)[0].preset
    if preset:
        parser.set_defaults(**PRESETS[preset])
    namespace = parser.parse_args(argv)
    return Hyperparameters(**{f.name: getattr(namespace, f.name) for f in fields(Hyperparameters)})


def main(argv=None):
    # before anything initialises CUDA: fewer fragmentation stalls when the window grows
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    args = parse_args(argv)
    try:
        check_hyperparameters(args)  # every value, before anything is written
        return train(args)
    except UserError as e:
        if int(os.environ.get("RANK", 0)) == 0 or e.every_rank:
            print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
