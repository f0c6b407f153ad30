"""NanoGPT speedrun trainer: a GPT-2-small-class model on FineWeb-10B to 3.28 val loss, in one file.
Run: ./run.sh (torchrun, one process per GPU); on a CPU: python train_gpt.py --preset smoke. In data-flow
order: configuration, Muon, kernels, model, masks, data, training loop, main(). Importing it runs nothing."""
import time
LAUNCH_TIME = time.time()  # before the heavy imports: start-up is counted from launch
import argparse, contextlib, glob, hashlib, importlib.metadata, math, os, resource
import shutil, signal, subprocess, sys, tempfile, uuid, zipfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch.nn.parallel import DistributedDataParallel as DDP
try:  # Linux only (no macOS or Windows wheels); without it, --fused_head_loss is off
    import triton, triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:
    triton = None

# Configuration ------------------------------------------------------------------------------------
@dataclass
class Hyperparameters:
    train_files: str = "data/fineweb10B/fineweb_train_*.bin"  # globs of shards, read in sorted name order
    val_files: str = "data/fineweb10B/fineweb_val_*.bin"
    val_tokens: int = 10_485_760  # the first 10,485,760 val tokens, fixed by the record rules
    allow_data_repeat: bool = False  # let a run read the train stream more than once (never a record)
    batch_size: int = 8 * 64 * 1024  # tokens per optimiser step, whatever the number of processes
    max_device_batch_size: int = 64 * 1024  # one packed sequence per forward; longer shares accumulate
    num_iterations: int = 1390
    cooldown_frac: float = 0.4  # last 40% of steps: learning rate decays linearly to 0
    window_start: int = 128  # attention window in tokens at step 0 ...
    window_end: int = 1856  # ... and at the end; // 128 gives 1 to 14 blocks
    vocab_size: int = 50304  # GPT-2's 50257 padded to a multiple of 128
    num_layers: int = 12
    num_heads: int = 6
    model_dim: int = 768
    attention_free_layer: int = 7  # this block has no attention (none if >= num_layers)
    bf16_embeds: bool = True
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
    val_loss_every: int = 125  # 0: only after the last step
    log_dir: str = "logs"
    save_checkpoint: bool = False  # the final state, resumable, in log_dir/<run id>/
    checkpoint_every: int = 0  # a resumable checkpoint every N steps (0: off); a run keeps its last two
    resume: str = ""  # a checkpoint (state_step*.pt) to go on from, its options the defaults
    compile: str = "auto"  # auto: compile on CUDA only (FlexAttention has no CPU backward)
    compile_tuning: bool = False  # inductor's coordinate descent: ~0.5% faster steps, +6 min of compile
    compile_cache: str = ""  # a file: load compiled code from it before compiling, save it after step 1
    regional_compile: bool = False  # each block and the head compiled alone: 4 block forms, not 12
    seed: int = 0
    fused_head_loss: str = "auto"  # softcap, cross-entropy and its gradient in one Triton kernel; auto: CUDA
    head_chunk_rows: int = 0  # fused head: logits this many rows at a time (0: the whole micro-batch at once)
    fused_qkv: bool = False  # q, k, v as one product of the stacked weights (still three matrices for Muon)

def check_hyperparameters(args):  # refuse any value that cannot work, naming the option and its valid range
    mdbs, heads = args.max_device_batch_size, args.num_heads
    # (fields, test of a value, valid range); in order: a test may use the fields checked above it
    rules = [
        ("train_files val_files", lambda v: v != "", "a glob of token shards or 'synthetic'"),
        ("batch_size", lambda v: v > 0 and v % BLOCK_SIZE == 0, f"a positive multiple of {BLOCK_SIZE}"),
        ("max_device_batch_size", lambda v: 0 < v <= 65536 and v % BLOCK_SIZE == 0,
         f"a multiple of {BLOCK_SIZE} from {BLOCK_SIZE} to 65536"),  # whole blocks, within Rotary's table
        ("val_tokens", lambda v: v > 0 and v % mdbs == 0, f"a positive multiple of --max_device_batch_size ({mdbs})"),
        ("num_iterations num_heads", lambda v: v >= 1, "at least 1"),
        ("val_loss_every checkpoint_every head_chunk_rows attention_free_layer muon_momentum_warmup_steps",
         lambda v: v >= 0, "at least 0"),
        ("cooldown_frac", lambda v: 0 <= v <= 1, "from 0 (no decay) to 1 (decay from the first step)"),
        # the window, interpolated between these two, must hold at least one whole block at every step
        ("window_start window_end", lambda v: v >= BLOCK_SIZE, f"at least {BLOCK_SIZE} tokens (one attention block)"),
        ("vocab_size", lambda v: v > EOT, f"at least {EOT + 1}: GPT-2 token ids go up to {EOT} (end of text)"),
        ("num_layers", lambda v: v >= 6 and v % 2 == 0, "even, at least 6 (U-net halves, 3+3 value-embedded layers)"),
        ("model_dim", lambda v: v > 0 and v % (4 * heads) == 0,
         f"a positive multiple of 4 x --num_heads ({4 * heads}): heads of a size divisible by 4 (rotary)"),
        ("embed_lr head_lr scalar_lr muon_lr", lambda v: 0 <= v < math.inf, "finite and at least 0 (0 freezes)"),
        # 1 would never let a gradient into the running averages
        ("adam_beta1 adam_beta2 muon_momentum_start muon_momentum", lambda v: 0 <= v < 1, "at least 0 and below 1"),
        ("adam_eps", lambda v: 0 < v < math.inf, "finite and above 0"),  # Adam divides by sqrt(v) + eps
        ("log_dir", lambda v: v != "" and not os.path.isfile(v), "a folder name (not empty, not an existing file)"),
        ("compile fused_head_loss", lambda v: v in ("auto", "true", "false"), "auto (on with CUDA), true or false"),
        ("fused_head_loss", lambda v: v != "true" or triton is not None, "auto or false: triton, which its "
         "kernel needs, is not installed (`pip install -r requirements.txt` installs it, on Linux only)"),
        ("compile_cache", lambda v: not os.path.isdir(v), "a file name or '' (off), not a folder"),
        ("seed", lambda v: 0 <= v < 2 ** 64, "from 0 to 2**64 - 1 (torch.manual_seed's range)"),
    ]
    for names, valid, allowed in rules:
        for name in names.split():
            if not valid(getattr(args, name)):
                raise UserError(f"--{name} must be {allowed}; got {getattr(args, name)!r}")

# A small model and a short run: under a minute on a 2-core CPU, every part exercised (tests/test_options.py).
# A CPU step is mostly the 50,304-wide head: so few steps, and 8x the record's head lr, to learn in 12 steps.
PRESETS = {"smoke": dict(
    num_layers=8, num_heads=2, model_dim=64, head_lr=0.064, num_iterations=12, val_loss_every=4,
    batch_size=1024, max_device_batch_size=512, val_tokens=4096,  # 2 micro-batches on 1 process; 1 to 8 fit
    window_end=512 + 64,  # 1 to 4 blocks: the whole 512-token sequence at the end
    train_files="synthetic", val_files="synthetic")}  # no download: see markov_stream

BLOCK_SIZE = 128  # FlexAttention block; sequences are multiples of it
EOT = 50256  # <|endoftext|>, precedes every document

class UserError(Exception):  # one the user can fix: main() prints it, no traceback
    def __init__(self, message, every_rank=False):
        super().__init__(message)
        self.every_rank = every_rank  # it may happen on one rank alone: print it there too

# Muon: MomentUm Orthogonalized by Newton-Schulz (Keller Jordan, 2024) -----------------------------
def newton_schulz_wide(X, steps):  # on a stack of wide or square bf16 matrices, each normalised alone
    a, b, c = 3.4445, -4.7750, 2.0315
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    return X

class Muon(torch.optim.Optimizer):
    """SGD-momentum (Nesterov), the update orthogonalised; gradients come averaged (DDP). Per shape group,
    rank r of W orthogonalises matrices r, r+W, ... as one bf16 batch; all ranks all-gather the results."""
    def __init__(self, params, lr, momentum, nesterov=True, ns_steps=5, compiled=False):
        self.rank, self.world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        params = list(params)
        wide = [tuple(sorted(p.shape)) for p in params]  # a tall matrix is stacked as its wide transpose
        shapes = sorted(set(wide), key=lambda s: (-s[0] * s[1], s))
        groups = [dict(params=[p for p, w in zip(params, wide) if w == s]) for s in shapes]
        super().__init__(groups, dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps))
        # compiled as in record 18; static shapes: one graph per stacked shape, never a recompile per step
        self.iterate = torch.compile(newton_schulz_wide, dynamic=False) if compiled else newton_schulz_wide
        # per group, once, outside the state: this rank's stacked input, zero-padded to even shares (zero
        # orthogonalises to zero), and the gather buffer, whose [r * share, (r + 1) * share) is rank r's
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
        for group, handle, orthogonalised in launched:  # each gather overlapped the later groups' batches
            if handle is not None:
                handle.wait()
            share = len(orthogonalised) // self.world_size
            for i, p in enumerate(group["params"]):  # matrix i is rank i % W's (i // W)-th
                O = orthogonalised[i % self.world_size * share + i // self.world_size]
                scale = max(1, p.size(0) / p.size(1)) ** 0.5  # same RMS step for tall and wide matrices
                p.add_(O.mT if p.size(0) > p.size(1) else O, alpha=-group["lr"] * scale)

    def _stack_updates(self, mine, group, stacked):  # momentum, Nesterov's look-ahead, into the batch
        assert all(p.grad is not None for p in mine), "Muon: a matrix received no gradient"
        for p in mine:
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad)
        grads, buffers, m = [p.grad for p in mine], [self.state[p]["momentum_buffer"] for p in mine], group["momentum"]
        torch._foreach_lerp_(buffers, grads, 1 - m)  # buf = m*buf + (1-m)*g
        updates = torch._foreach_lerp(grads, buffers, m) if group["nesterov"] else buffers
        wide = [u.mT if u.size(0) > u.size(1) else u for u in updates]
        torch._foreach_copy_(stacked[:len(mine)].unbind(), wide)

# Kernels: faster forms of model pieces, equal to their maths up to rounding -----------------------
# --fused_head_loss: z = x W^T by cuBLAS; a Triton kernel reads each row once for the softcap c = 15t,
# t = tanh(z / 15), and the loss logsumexp(c) - c[target], in training overwriting z with d(mean loss)/dz.
if triton is not None:
    @triton.jit
    def softcapped_cross_entropy_kernel(logits, targets, losses, rows, grad_scale, VOCAB: tl.constexpr,
                                        ROWS: tl.constexpr, COLS: tl.constexpr, WRITE_GRAD: tl.constexpr,
                                        TANH_APPROX: tl.constexpr):
        """ROWS x COLS at a time, in fp32; builtins only (without TRITON_INTERPRET, no jit helper runs)."""
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        row_ok = row < rows
        row_start = logits + row.to(tl.int64) * VOCAB
        target = tl.load(targets + row, mask=row_ok, other=0)
        total, c_target = tl.full([ROWS, COLS], 0, tl.float32), tl.full([ROWS, COLS], 0, tl.float32)
        for sweep in tl.static_range(1 + WRITE_GRAD):  # 0: log-sum-exp and loss; 1: the row again, gradient
            for k in range(0, VOCAB, COLS):
                # backwards in sweep 1: the latest reads are still in L2
                start = k if sweep == 0 else (VOCAB - 1) // COLS * COLS - k
                col = start + tl.arange(0, COLS)
                col_ok = (col < VOCAB)[None, :]
                mask = row_ok[:, None] & col_ok
                z = tl.load(row_start[:, None] + col[None, :], mask=mask, other=0,
                            eviction_policy="evict_last")
                if TANH_APPROX:  # CUDA: one instruction instead of exp and reciprocal, which bound the kernel
                    t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f",
                                                  [z.to(tl.float32) * (1 / 15)], dtype=tl.float32, is_pure=True, pack=1)
                else:
                    t = 1 - 2 / (1 + tl.exp(z.to(tl.float32) * (2 / 15)))
                is_target = col[None, :] == target[:, None]
                if sweep == 0:  # c < 15 bounds exp(c - 15) by 1: no running maximum needed
                    total += tl.where(col_ok, tl.exp(15 * t - 15), 0)
                    c_target += tl.where(is_target, 15 * t, 0)
                else:  # d loss/dz = (softmax(c) - onehot(target)) dc/dz, with dc/dz = 1 - t^2
                    p = tl.exp(15 * t - lse[:, None])
                    g = tl.where(is_target, p - 1, p) * (1 - t * t) * grad_scale
                    # streamed past L2, which stays for the reads
                    tl.store(row_start[:, None] + col[None, :], g, mask=mask, cache_modifier=".cs")
            if sweep == 0:
                lse = 15 + tl.log(tl.reduce(total, 1, tl.standard._sum_combine))
                tl.store(losses + row, lse - tl.reduce(c_target, 1, tl.standard._sum_combine), mask=row_ok)

HEAD_LAUNCH_CUDA = dict(ROWS=1, COLS=4096, num_warps=16, TANH_APPROX=True)  # fastest measured on an H100
HEAD_LAUNCH_CPU = dict(ROWS=128, COLS=8192, TANH_APPROX=False)  # the interpreter: numpy on big blocks

def softcapped_cross_entropy_(logits, targets, grad_scale=None):
    """Per-row losses of 15 tanh(z / 15) for logits z; with grad_scale, z becomes grad_scale * d(sum)/dz.
    CPU: Triton's interpreter (triton.jit chose the compiler at import; TRITON_INTERPRET switches all)."""
    assert logits.is_contiguous() and targets.dtype == torch.int64
    kernel, launch, buffer = softcapped_cross_entropy_kernel, HEAD_LAUNCH_CUDA, logits
    if not logits.is_cuda:  # the interpreter's fp32 -> bf16 truncates: it works in fp32, torch rounds
        kernel, launch, buffer = InterpretedFunction(kernel.fn), HEAD_LAUNCH_CPU, logits.float()
    losses = logits.new_empty(len(logits), dtype=torch.float32)
    with np.errstate(over="ignore"):  # numpy warns of exp(2z / 15) = inf, where tanh saturates as it should
        grid = (triton.cdiv(len(logits), launch["ROWS"]),)
        kernel[grid](buffer, targets.contiguous(), losses, len(logits), grad_scale or 0.0,
                     VOCAB=logits.size(1), WRITE_GRAD=grad_scale is not None, **launch)
    if grad_scale is not None and buffer is not logits:
        logits.copy_(buffer)
    return losses

def matmul(a, b, out_dtype=None):
    """a @ b in out_dtype (a's by default); bf16 on CPU via fp32 (bf16 GEMMs crawl on AVX2), same rounding."""
    if a.device.type == "cpu" and a.dtype == torch.bfloat16:
        return (a.float() @ b.float()).to(out_dtype or a.dtype)
    return a @ b if out_dtype in (None, a.dtype) else torch.mm(a, b, out_dtype=out_dtype)

class FusedHeadLoss(torch.autograd.Function):
    """Forward leaves d(mean loss)/dz in the logits' buffer z; backward scales the small products, never z."""
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

class ChunkedHeadLoss(torch.autograd.Function):  # FusedHeadLoss by row chunks: never all the logits at once
    @staticmethod
    def forward(ctx, x, weight, targets, chunk_rows):
        w, loss, grad_w, grad_x = weight.type_as(x), 0, 0, torch.empty_like(x)
        for xs, ts, gs in zip(x.split(chunk_rows), targets.split(chunk_rows), grad_x.split(chunk_rows)):
            grad_logits = matmul(xs, w.T)
            loss += softcapped_cross_entropy_(grad_logits, ts, grad_scale=1 / len(x)).sum()
            gs.copy_(matmul(grad_logits, w))
            grad_w += matmul(grad_logits.T, xs, out_dtype=torch.float32)  # fp32 products and sums, never bf16
        ctx.save_for_backward(grad_x, grad_w)
        return loss / len(x)

    @staticmethod
    def backward(ctx, grad_loss):  # scales the saved gradients, as FusedHeadLoss scales its products
        return *(grad * grad_loss for grad in ctx.saved_tensors), None, None

# A deliberate graph break: traced, the in-place kernel could be functionalised into a 6.6 GB copy. Not
# torch.compiler.disable: it imports torch._dynamo, which makes a cache folder.
@torch._disable_dynamo
def fused_head_loss(x, weight, targets, chunk_rows=0):
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        if chunk_rows:
            return ChunkedHeadLoss.apply(x, weight, targets, chunk_rows)
        return FusedHeadLoss.apply(x, weight, targets)
    if chunk_rows:  # eval: the loss only, in chunks as in training
        w, parts = weight.type_as(x), zip(x.split(chunk_rows), targets.split(chunk_rows))
        return torch.cat([softcapped_cross_entropy_(matmul(xs, w.T), ts) for xs, ts in parts]).mean()
    return softcapped_cross_entropy_(matmul(x, weight.type_as(x).T), targets).mean()

# The model: a U-net GPT with value embeddings -----------------------------------------------------
def norm(x):
    return F.rms_norm(x, (x.size(-1),))  # no weight

class CastedLinear(nn.Linear):  # bias-free; its fp32 weight is cast to the activations' dtype at use
    def __init__(self, in_features, out_features, zero_init=False):
        super().__init__(in_features, out_features, bias=False)
        if zero_init:
            nn.init.zeros_(self.weight)

    def forward(self, x):
        return matmul(x, self.weight.type_as(x).T)

class Rotary(nn.Module):  # RoFormer (Su et al.), half-truncated: half the dimension pairs have frequency 0
    def __init__(self, head_dim, max_seq_len=65536):
        super().__init__()
        freqs = torch.cat([(1 / 1024) ** torch.linspace(0, 1, head_dim // 4), torch.zeros(head_dim // 4)])
        theta = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs)
        self.register_buffer("cos", theta.cos(), persistent=False)
        self.register_buffer("sin", theta.sin(), persistent=False)

    def forward(self, x):  # (batch, seq, heads, head_dim)
        cos, sin = self.cos[None, :x.size(1), None, :], self.sin[None, :x.size(1), None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos + x2 * sin, -x1 * sin + x2 * cos], dim=-1).type_as(x)

class CausalSelfAttention(nn.Module):
    def __init__(self, dim, num_heads, fused_qkv=False):
        super().__init__()
        self.num_heads, self.head_dim, self.fused_qkv = num_heads, dim // num_heads, fused_qkv
        self.q, self.k, self.v = CastedLinear(dim, dim), CastedLinear(dim, dim), CastedLinear(dim, dim)
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
        v = self.lambdas[0] * v
        if value_embed is not None:
            v = v + self.lambdas[1] * value_embed.view_as(v)
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
    def __init__(self, vocab_size, num_layers, num_heads, model_dim, *, attention_free_layer=7,
                 bf16_embeds=True, fused_head_loss=False, fused_qkv=False, head_chunk_rows=0):
        super().__init__()
        self.num_layers, self.fused_head_loss = num_layers, fused_head_loss
        self.head_chunk_rows = head_chunk_rows  # rows of logits at a time in the fused head (0: all)
        self.embed = nn.Embedding(vocab_size, model_dim)
        self.value_embeds = nn.ModuleList(nn.Embedding(vocab_size, model_dim) for _ in range(3))  # see below
        self.blocks = nn.ModuleList(Block(model_dim, num_heads, i != attention_free_layer, fused_qkv)
                                    for i in range(num_layers))
        self.skip_weights = nn.Parameter(torch.ones(num_layers // 2))  # U-net: encoder i feeds decoder
        self.lm_head = CastedLinear(model_dim, vocab_size, zero_init=True)  # untied; step-0 loss = ln(vocab)
        if bf16_embeds:
            for table in [self.embed, *self.value_embeds]:
                table.bfloat16()

    @classmethod
    def from_args(cls, args, device=torch.device("cpu")):
        return cls(args.vocab_size, args.num_layers, args.num_heads, args.model_dim,
                   attention_free_layer=args.attention_free_layer, bf16_embeds=args.bf16_embeds,
                   fused_head_loss=switched_on(args.fused_head_loss, device) and triton is not None,
                   fused_qkv=args.fused_qkv, head_chunk_rows=args.head_chunk_rows)

    def value_embed_index(self, layer):  # tables 0, 1, 2 for the first three layers and the last three
        return layer if layer < 3 else layer - (self.num_layers - 3) if layer >= self.num_layers - 3 else None

    def forward(self, inputs, targets, window_blocks):
        assert inputs.ndim == 1, "one packed sequence per device"
        build_mask = build_block_mask if inputs.is_cuda else build_dense_mask
        mask = build_mask(inputs, window_blocks)
        value_embeds = [table(inputs) for table in self.value_embeds]
        x = x0 = norm(self.embed(inputs)[None])
        half, skips = self.num_layers // 2, []
        for i, block in enumerate(self.blocks):
            if i >= half:  # decoder: take the mirror-image encoder output
                x = x + self.skip_weights[i - half] * skips.pop()
            ve = self.value_embed_index(i)
            x = block(x, None if ve is None else value_embeds[ve], x0, mask)
            if i < half:
                skips.append(x)
        return self.head_loss(norm(x)[0], targets)

    def head_loss(self, x, targets):
        if self.fused_head_loss:  # same maths: softcap, loss and its gradient in one kernel (Kernels)
            return fused_head_loss(x, self.lm_head.weight, targets, self.head_chunk_rows)
        logits = 15 * torch.tanh(self.lm_head(x) / 15)  # logit softcap (as in Gemma 2)
        return F.cross_entropy(logits.float(), targets)

# Attention masks: causal, within one document, inside a sliding window of whole 128-token blocks ---
def listed_rows(first, last, window_blocks):
    """Per q-block (row), counts and lists of the partial and the full kv blocks, from each block's first and
    last doc id (nondecreasing): row q's partial blocks are one run [start, q] or, if q lies in one document,
    [start, full_start) and q; its full ones [full_start, q). Lists are padded with q."""
    q = torch.arange(len(first), device=first.device)[:, None]
    start = torch.maximum(torch.searchsorted(last, first)[:, None], q - window_blocks + 1)  # reaches q's doc
    full_start = torch.maximum(torch.searchsorted(first, first)[:, None], start)  # starts in q's doc
    full_start = torch.where((first == last)[:, None], full_start, q + 1)
    full_count = (q - full_start).clamp(min=0)
    position = q.T  # place in a row's list
    partial = torch.where(position < full_start - start, start + position, q)
    full = torch.where(position < full_count, full_start + position, q)
    partial_count = (q + 1 - start).clamp(min=0) - full_count
    lists = (partial_count[:, 0], partial, full_count[:, 0], full)
    return [t.to(torch.int32)[None, None].contiguous() for t in lists]

def build_block_mask(inputs, window_blocks):  # FlexAttention's block mask, without a sort (compiled, slow)
    docs = (inputs == EOT).cumsum(0)
    first, last = docs[0::BLOCK_SIZE].contiguous(), docs[BLOCK_SIZE - 1::BLOCK_SIZE].contiguous()
    kv_lists, n = listed_rows(first, last, window_blocks), len(first)
    # the q-side lists (backward pass) are the rows of the mirror image, blocks reversed and doc ids negated
    # (its row r is our column n - 1 - r), given to the constructor: from_kv_blocks would sort
    mirrored = listed_rows(-last.flip(0), -first.flip(0), window_blocks)
    q_lists = [t.flip(-1) if t.dim() == 3 else n - 1 - t.flip(-2) for t in mirrored]  # counts, index lists

    def document_causal(b, h, q_idx, kv_idx):  # the per-token test, needed in partial blocks only
        return (q_idx >= kv_idx) & (docs[q_idx] == docs[kv_idx])
    return BlockMask((len(inputs),) * 2, *kv_lists, *q_lists, BLOCK_SIZE=(BLOCK_SIZE,) * 2,
                     mask_mod=document_causal)

def build_dense_mask(inputs, window_blocks):  # the same mask as a dense (T, T) boolean matrix, for CPU
    docs, pos = (inputs == EOT).cumsum(0), torch.arange(len(inputs), device=inputs.device)
    q, k = pos[:, None], pos[None, :]
    return (k <= q) & (k // BLOCK_SIZE > q // BLOCK_SIZE - window_blocks) & (docs[:, None] == docs[None, :])

# Data: token shards and the loader every rank walks in step ---------------------------------------
SHARD_MAGIC, SHARD_VERSION, HEADER_BYTES = 20240520, 1, 256 * 4
REFETCH_HINT = "`python data/cached_fineweb10B.py N` replaces invalid shards"

def fetch_hint(num_iterations, batch_size):  # the command fetching the FineWeb shards a run reads
    needed = -(-num_iterations // max(1, (100_000_000 - 2) // batch_size))  # whole batches in 100M tokens
    # beyond one, a spare shard: the record's usual advice (9 for the 8 that 1390 steps read)
    shards = f"{needed + 1}` (this run reads {needed} train shards)" if needed > 1 else "1`"
    return f"fetch FineWeb with `python data/cached_fineweb10B.py {shards}"

def read_shard_header(path):  # validate a shard's header and size, unread tokens; returns the token count
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(HEADER_BYTES), dtype="<i4")
    if len(header) < 256:
        raise UserError(f"{path}: truncated shard ({size} bytes, under the 1024-byte header); {REFETCH_HINT}")
    if header[0] != SHARD_MAGIC:
        raise UserError(f"{path}: not a token shard (magic {header[0]}, expected {SHARD_MAGIC})")
    if header[1] != SHARD_VERSION:
        raise UserError(f"{path}: unsupported shard version {header[1]} (expected {SHARD_VERSION})")
    num_tokens = int(header[2])
    if size != HEADER_BYTES + 2 * num_tokens:
        raise UserError(f"{path}: header says {num_tokens} tokens ({HEADER_BYTES + 2 * num_tokens} bytes) "
                        f"but the file has {size} bytes (truncated or corrupt); {REFETCH_HINT}")
    return num_tokens

def load_data_shard(path, vocab_size=None):  # with vocab_size, ids checked on the host
    num_tokens = read_shard_header(path)
    # pinned with CUDA, for asynchronous copies to the GPU
    tokens = torch.empty(num_tokens, dtype=torch.uint16, pin_memory=torch.cuda.is_available())
    with open(path, "rb") as f:
        f.seek(HEADER_BYTES)
        if f.readinto(tokens.numpy()) != 2 * num_tokens:
            raise UserError(f"{path}: file changed while reading")
    if vocab_size is not None and num_tokens and (ids := tokens.numpy()).max() >= vocab_size:  # vectorised
        at = int(np.argmax(ids >= vocab_size))  # the first bad id
        raise UserError(f"{path}: token id {ids[at]} at position {at:,} is not below --vocab_size "
                        f"{vocab_size}: shards made with another tokenizer (pass its --vocab_size), or a "
                        "corrupt file (FineWeb: `python data/cached_fineweb10B.py N --verify` replaces it)")
    return tokens

def write_data_shard(path, tokens):
    tokens = np.asarray(tokens)
    assert tokens.ndim == 1 and (tokens.size == 0 or (tokens.min() >= 0 and tokens.max() < 2 ** 16))
    header = np.zeros(256, dtype="<i4")
    header[:3] = SHARD_MAGIC, SHARD_VERSION, len(tokens)
    Path(path).write_bytes(header.tobytes() + tokens.astype("<u2").tobytes())

def markov_stream(num_tokens, seed, chain_seed=1234, vocab=256, successors=4):
    """EOT-led documents of 40 to 399 tokens of a random Markov chain: learnable far below ln(vocab)."""
    table = np.random.default_rng(chain_seed).integers(0, vocab, size=(vocab, successors)).tolist()
    rng, tokens = np.random.default_rng(seed), []
    while len(tokens) < num_tokens:
        state = int(rng.integers(vocab))  # then the length: the order of draws fixes the stream
        choices = rng.integers(successors, size=int(rng.integers(39, 399))).tolist()
        tokens.append(EOT)
        for choice in choices:
            tokens.append(state)
            state = table[state][choice]
    return np.array(tokens[:num_tokens])

def make_writable_folder(folder, option):  # make the folder and write in it: an unusable place fails now
    try:
        os.makedirs(folder, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise UserError(f"{option}: cannot make or write to {folder} ({e.strerror}): pick another") from None

def prepare_shards(args, split, num_tokens):  # a glob; "synthetic": the seeded stream, written by each rank
    pattern = getattr(args, f"{split}_files")
    if pattern != "synthetic":
        return pattern
    name = f"synthetic_{split}_{int(split == 'train'):06d}.bin"
    path = Path(args.log_dir) / f"synthetic-seed{args.seed}" / name
    make_writable_folder(path.parent, "--log_dir")
    tmp = f"{path}.{os.getpid()}.tmp"
    write_data_shard(tmp, markov_stream(num_tokens, [args.seed, int(split == "train")], args.seed))
    os.replace(tmp, path)
    return glob.escape(str(path))

class DistributedDataLoader:  # all ranks walk one global token stream; of each batch, rank r takes share r
    def __init__(self, files_pattern, rank, world_size, device, hint=None, vocab_size=None):
        self.files = sorted(glob.glob(files_pattern))
        if not self.files:
            raise UserError(f"no data shard matches {files_pattern!r}: {hint or fetch_hint(1, 1)}, "
                            "or point --train_files/--val_files at your shards")
        self.sizes = [read_shard_header(path) for path in self.files]  # a bad shard fails now, not hours in
        self.rank, self.world_size, self.device, self.vocab_size = rank, world_size, device, vocab_size
        self.shard = None  # none loaded yet
        self.reset()

    def batches_before_wrap(self, batch_size):  # whole batches, taken as next_batch takes them, before a wrap
        for path, n in zip(self.files, self.sizes):
            if n < batch_size + 2:  # next_batch takes a batch while pos + batch + 1 < tokens
                raise UserError(f"{path}: {n:,} tokens, fewer than one batch of {batch_size:,} + 2 (the last "
                                "target and the loader's margin): use other shards or a smaller batch")
        return sum((n - 2) // batch_size for n in self.sizes)

    def reset(self, shard=0, pos=0):  # to a position in a shard, the first shard's start by default
        if shard != self.shard:  # evaluation goes back to shard 0 each time: it stays loaded, read once
            self.tokens = load_data_shard(self.files[shard], self.vocab_size)
        self.shard, self.pos = shard, pos

    def next_batch(self, batch_size):
        if self.pos + batch_size + 1 >= len(self.tokens):  # build_loaders checked every shard holds a batch
            self.reset((self.shard + 1) % len(self.files))
        share = batch_size // self.world_size
        start = self.pos + self.rank * share
        chunk = self.tokens[start:start + share + 1]
        self.pos += batch_size
        return (chunk[:-1].to(device=self.device, dtype=torch.int32, non_blocking=True),  # inputs, targets
                chunk[1:].to(device=self.device, dtype=torch.int64, non_blocking=True))

# Training loop ------------------------------------------------------------------------------------
UNTIMED_STEPS = 10  # the first steps compile and warm up; train_time starts after them

def lr_multiplier(step, args):  # stable, then linear decay to 0 over the last cooldown_frac of the steps
    remaining = 1 - step / args.num_iterations
    return 1.0 if remaining >= args.cooldown_frac else remaining / args.cooldown_frac

def muon_momentum(step, args):
    frac = min(step / args.muon_momentum_warmup_steps, 1) if args.muon_momentum_warmup_steps else 1
    return (1 - frac) * args.muon_momentum_start + frac * args.muon_momentum

def window_blocks_at(step, args):  # attention window in whole blocks, growing linearly (1 to 14 by default)
    x = step / args.num_iterations
    return int(((1 - x) * args.window_start + x * args.window_end) // BLOCK_SIZE)

def step_avg(train_time_ms, timed_steps):  # mean ms per timed step: the untimed warm-up steps are left out
    return train_time_ms / timed_steps if timed_steps > 0 else float("nan")

def switched_on(option, device):  # auto/true/false; auto: on with CUDA (faster there), off on CPU
    return option == "true" or (option == "auto" and device.type == "cuda")

def micro_batch_plan(args, world_size):  # micro-batch size and count, val batch; checks needing W
    share, val_batch = args.batch_size // world_size, world_size * args.max_device_batch_size
    micro = min(args.max_device_batch_size, share)
    if args.batch_size % world_size:
        raise UserError(f"the global batch of {args.batch_size} tokens does not divide among {world_size} "
                        "processes; use 1, 2, 4 or 8 processes, or a --batch_size divisible by the process count")
    if share % micro or micro % BLOCK_SIZE:
        raise UserError(f"each process's {share} tokens must split into equal micro-batches, multiples of "
                        f"{BLOCK_SIZE} of at most --max_device_batch_size {args.max_device_batch_size}")
    if args.val_tokens % val_batch:
        raise UserError(f"--val_tokens {args.val_tokens} must be a multiple of processes x "
                        f"--max_device_batch_size = {val_batch}")
    return micro, share // micro, val_batch

def nvidia_smi_gpus():  # (name, driver) of each GPU nvidia-smi lists; none without its answer
    query = ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        listed = subprocess.run(query, capture_output=True, text=True, timeout=60, check=True).stdout
        return [line.rpartition(", ")[::2] for line in listed.splitlines() if line.strip()]
    return []

def setup_device():  # rank, world size and device, from torchrun's environment (a single process without it)
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if not torch.cuda.is_available():
        if os.environ.get("CUDA_VISIBLE_DEVICES") != "" and (gpus := nvidia_smi_gpus()):
            raise UserError(
                f"torch {torch.__version__} (CUDA {torch.version.cuda}; None: CPU only) cannot use the "
                f"{len(gpus)} x {gpus[0][0]} nvidia-smi lists (driver {gpus[0][1]}): install a build for "
                "this driver, e.g. `pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/"
                'cu126`, or update the driver; CUDA_VISIBLE_DEVICES="" runs on the CPU on purpose')
        return rank, world_size, torch.device("cpu")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if torch.cuda.device_count() < local_world:
        raise UserError(f"{local_world} processes on this node but {torch.cuda.device_count()} GPUs visible: "
                        f"use --nproc_per_node={torch.cuda.device_count()} (the global batch stays the same)")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if torch.cuda.get_device_capability(device) < (8, 0):  # bf16 matrix units arrived with Ampere
        raise UserError(f"{torch.cuda.get_device_name(device)} has no bf16 support, which this model computes "
                        "in: it needs an Ampere or newer GPU (A100, A10, L4, L40S, RTX 30xx or later, H100)")
    torch.cuda.set_device(device)
    return rank, world_size, device

def build_loaders(args, rank, world_size, device, val_batch):  # and the data budget, from shard headers
    hint = fetch_hint(args.num_iterations, args.batch_size)
    train_pattern = prepare_shards(args, "train", args.num_iterations * args.batch_size + 2)
    train_loader = DistributedDataLoader(train_pattern, rank, world_size, device, hint, args.vocab_size)
    val_pattern = prepare_shards(args, "val", args.val_tokens + 2)
    val_loader = DistributedDataLoader(val_pattern, rank, world_size, device, hint, args.vocab_size)
    for path in val_loader.files[1:]:  # the first is loaded and checked; val shards are few
        load_data_shard(path, args.vocab_size)
    train_paths = {os.path.realpath(path) for path in train_loader.files}
    if in_both := train_paths & {os.path.realpath(path) for path in val_loader.files}:
        raise UserError(f"{min(in_both)} is matched by both --train_files and --val_files: a run must never "
                        "train on its validation data; narrow one of the globs")
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

class RunLog(contextlib.AbstractContextManager):  # rank 0's logs/<uuid>.txt: source, setup, steps, errors
    def __init__(self, args, master):
        self.file, self.run_id = None, str(uuid.uuid4())
        if master:
            make_writable_folder(args.log_dir, "--log_dir")
            self.path = os.path.join(args.log_dir, f"{self.run_id}.txt")
            self.file = open(self.path, "w")
            print(f"logging to {self.path}")
            self.file.write(Path(__file__).read_text() + "\n" + "=" * 100 + "\n")

    def __call__(self, line, console=True):  # console: True (stdout), False or a stream
        if self.file:
            if console:
                print(line, file=None if console is True else console)
            print(line, file=self.file, flush=True)

    def __exit__(self, kind, error, traceback):
        if isinstance(error, UserError):
            self(f"error: {error}", console=False)  # main() prints it
        if self.file:
            self.file.close()

    def header(self, args, world_size, device, train_loader, val_loader, passes, cache_note):
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        lines = [f"Running Python {sys.version}",
                 f"Running PyTorch {torch.__version__} compiled for CUDA {torch.version.cuda}",
                 f"devices: {world_size} x {gpu}"]
        if shutil.which("nvidia-smi"):
            lines.append(subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout.rstrip())
        lines += ["=" * 100, "hyperparameters:", *(f"  {name} = {value}" for name, value in asdict(args).items())]
        lines += [f"{name} shards ({len(loader.files)}): {' '.join(loader.files)}"
                  for name, loader in (("train", train_loader), ("val", val_loader))]
        self("\n".join(lines), console=False)
        synthetic = "synthetic" in (args.train_files, args.val_files)
        source = f"synthetic Markov-chain documents (seed {args.seed}), no download needed; " * synthetic
        self(f"data: {source}train {args.train_files}, val {args.val_files}; "
             f"{args.num_iterations * args.batch_size:,} train tokens read, "
             f"{passes:.2f} passes over the train shards")
        if args.compile_cache:
            self(f"compile cache {args.compile_cache}: {cache_note}")
        self("=" * 100, console=False)

def build_optimizers(model, args, compiled=False):  # fused Adam: embeddings, head, scalars; Muon: matrices
    tables = [model.embed.weight, *(t.weight for t in model.value_embeds)]
    adam_groups = [dict(params=tables, lr=args.embed_lr), dict(params=[model.lm_head.weight], lr=args.head_lr),
                   dict(params=[p for p in model.parameters() if p.ndim < 2], lr=args.scalar_lr)]
    betas = (args.adam_beta1, args.adam_beta2)
    adam = torch.optim.Adam(adam_groups, betas=betas, eps=args.adam_eps, fused=True)
    matrices = [p for p in model.blocks.parameters() if p.ndim == 2]
    muon = Muon(matrices, lr=args.muon_lr, momentum=args.muon_momentum, compiled=compiled)
    for group in (*adam.param_groups, *muon.param_groups):
        group["initial_lr"] = group["lr"]
    return adam, muon

def build_model(args, device, world_size, compiled):  # the model, its optimisers, the (compiled, DDP) module
    torch.manual_seed(args.seed)
    model = GPT.from_args(args, device).to(device)
    adam, muon = build_optimizers(model, args, compiled=compiled)
    train_model = model
    if compiled:
        if args.compile_tuning:  # not in record 18: on an H100, a first compile of 514 s instead of 120 s
            from torch._inductor import config as inductor_config
            inductor_config.coordinate_descent_tuning = True
        train_model = compile_regions(model) if args.regional_compile else torch.compile(model, dynamic=False)
    if world_size > 1:
        train_model = DDP(train_model, device_ids=[device.index] if device.type == "cuda" else None,
                          broadcast_buffers=False, gradient_as_bucket_view=True)
    return model, train_model, adam, muon

def compile_regions(model):  # each block and the head compiled alone: 4 block forms traced, not 12 blocks
    for block in model.blocks:
        block.compile(dynamic=False)
    model.head_loss = torch.compile(model.head_loss, dynamic=False)
    return model

def compile_cache_stamp(device):  # what compiled code depends on: a cache of another stamp is unused
    triton = next((d.version for d in importlib.metadata.distributions(name="triton")), None)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return f"train_gpt compile cache: torch {torch.__version__}, triton {triton}, {gpu}"

def load_compile_cache(path, stamp):  # fill the compile caches from a file; returns what happened
    if not os.path.exists(path):
        return "not found; rank 0 writes it after step 1"
    try:
        header, _, artifacts = Path(path).read_bytes().partition(b"\n")
        made_by, _, digest = header.decode(errors="replace").rpartition(" sha256=")
        if made_by != stamp:
            return (f"rejected: made by {made_by[:150]!r}, this run is {stamp!r}; "
                    "rank 0 replaces it after step 1")
        intact = hashlib.sha256(artifacts).hexdigest() == digest
        if not intact or torch.compiler.load_cache_artifacts(artifacts) is None:
            return "rejected: corrupt or unreadable; rank 0 replaces it after step 1"
    except Exception as e:  # a bad cache costs a compile, never the run
        return f"rejected: {type(e).__name__}: {e}"
    return f"loaded ({len(artifacts) / 2 ** 20:.1f} MiB)"

def save_compile_cache(path, stamp):  # a temp file in the same folder, renamed into place: never half a cache
    tmp, artifacts = f"{path}.{os.getpid()}.tmp", (torch.compiler.save_cache_artifacts() or [b""])[0]
    try:
        header = f"{stamp} sha256={hashlib.sha256(artifacts).hexdigest()}\n"
        Path(tmp).write_bytes(header.encode() + artifacts)
        os.replace(tmp, path)
    except OSError as e:
        return f"not saved: {e}"
    return f"saved ({len(artifacts) / 2 ** 20:.1f} MiB)"

def startup_report(args, compiled, stamp, master, step):  # launch to the first step's end, compile, cache hits
    line = f"startup: {time.time() - LAUNCH_TIME:.1f}s from launch to the end of step {step}"
    if compiled:  # compile time and the caches' own hit counts, from torch._dynamo
        spent = getattr(torch._dynamo.utils, "calculate_time_spent", dict)().get("total_wall_time", math.nan)
        fx, aot = torch._dynamo.utils.counters["inductor"], torch._dynamo.utils.counters["aot_autograd"]
        line += (f", {spent:.1f}s of it compiling (cache hits/misses: FX graph {fx['fxgraph_cache_hit']}/"
                 f"{fx['fxgraph_cache_miss']}, AOT {aot['autograd_cache_hit']}/{aot['autograd_cache_miss']})")
        if master and args.compile_cache:
            line += f"; compile cache {save_compile_cache(args.compile_cache, stamp)}"
    return line

def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()

def stop_if_diverged(val_loss, step):
    if not math.isfinite(val_loss):  # every rank sees the same reduced loss, so all stop here
        raise UserError(f"val loss is {val_loss} at step {step}: training diverged, most likely a learning "
                        "rate too high for this configuration (--muon_lr, --embed_lr, --head_lr, --scalar_lr)")

@contextlib.contextmanager
def out_of_memory_as_error(micro):
    try:
        yield
    except torch.cuda.OutOfMemoryError:
        raise UserError(f"out of GPU memory with micro-batches of {micro:,} tokens: pass "
                        f"--max_device_batch_size {micro // 2} (half usually fits; the global batch and the "
                        "maths stay the same)", every_rank=True) from None

def peak_memory_mib(device):  # CPU: the peak resident set (ru_maxrss is in KiB on Linux)
    return (torch.cuda.max_memory_allocated() // 2 ** 20 if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)

@torch.no_grad()
def evaluate(model, loader, args, val_batch, window_blocks, world_size):
    model.eval()
    loader.reset()
    steps = args.val_tokens // val_batch
    total = sum(model(*loader.next_batch(val_batch), window_blocks) for _ in range(steps)) / steps
    if world_size > 1:
        dist.all_reduce(total)  # gloo has no AVG
        total /= world_size
    model.train()
    return total.item()

STOP_CHECK_EVERY = 5  # steps between exchanges of the stop flag among processes
SOURCE_SHA256 = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
FIXED_OPTIONS = ("vocab_size num_layers num_heads model_dim attention_free_layer bf16_embeds "
                 "batch_size num_iterations").split()  # the model; the data position and the schedules

class CleanStop(contextlib.AbstractContextManager):
    """SIGTERM or SIGINT, while train() runs, sets a flag; ranks all-reduce it every STOP_CHECK_EVERY steps
    on a CPU group, read as the next launches: no host wait, no device sync, all stop after the same step."""
    def __init__(self, world_size):
        self.received, self.pending = 0, (torch.tensor(0), None)
        self.group = dist.new_group(backend="gloo") if world_size > 1 else None
        handler = lambda signum, _: setattr(self, "received", self.received or signum)  # noqa: E731
        self.previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}

    def __exit__(self, kind, error, traceback):  # a pending all-reduce ends with its group: all launched it
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def agreed(self, step):  # the signal that every rank stops on after this step, or 0
        if self.group is None or step % STOP_CHECK_EVERY:
            return 0 if self.group else self.received
        flag, handle = self.pending
        launched = torch.tensor(self.received)
        self.pending = launched, dist.all_reduce(launched, dist.ReduceOp.MAX, group=self.group, async_op=True)
        return int(flag) if handle is None or handle.wait() else 0  # launched STOP_CHECK_EVERY steps ago

def train_shards(args):  # names and token counts ("synthetic": none, its stream is fixed by the options)
    return [f"{os.path.basename(f)}:{read_shard_header(f)}" for f in sorted(glob.glob(args.train_files))]

def load_checkpoint(argv, path):  # a checkpoint, and its options overridden by those given (not all may be)
    try:  # the zip's CRCs catch a flipped byte in tensor data, which torch.load misses
        if damaged := zipfile.ZipFile(path).testzip():
            raise ValueError(f"{damaged} fails its CRC check")
        checkpoint = torch.load(path, map_location="cpu")
        saved, saved_shards = checkpoint["args"], checkpoint["train_shards"]
    except Exception as e:
        raise UserError(f"--resume {path!r} is not a checkpoint, or a corrupt or truncated one "
                        f"({type(e).__name__}: {e}): give another (a run keeps its last two)") from None
    args = parse_args(argv, resumed=saved)
    changed = [name for name, value in asdict(args).items() if value != saved.get(name) and name != "resume"]
    refused = [f"--{n} {saved.get(n)} -> {getattr(args, n)}" for n in changed if n in FIXED_OPTIONS]
    if (shards := train_shards(args)) != saved_shards:
        refused.append(f"train shards (name:tokens) {saved_shards[:3]} -> {shards[:3]}")
    if refused:
        raise UserError(f"--resume {path!r}: {', '.join(refused)} would change the model, the data position "
                        "or the schedules: leave these options as the checkpoint has them")
    changes = ", ".join(f"--{n} {saved.get(n)!r} -> {getattr(args, n)!r}" for n in changed)
    note = f"resumed from {path} at step {checkpoint['step']}{'; options changed: ' * bool(changes)}{changes}"
    return args, dict(checkpoint, note=note)

def resume(checkpoint, log, model, adam, muon, train_loader):  # this rank's part, popped to free the rest
    model.load_state_dict(checkpoint.pop("model"))
    adam.load_state_dict(dict(checkpoint.pop("adam"), param_groups=adam.state_dict()["param_groups"]))
    names, momenta = {p: name for name, p in model.named_parameters()}, checkpoint.pop("muon")
    for p in [p for group in muon.param_groups for p in group["params"][muon.rank::muon.world_size]]:
        muon.state[p]["momentum_buffer"] = momenta[names[p]].to(p.device)
    train_loader.reset(*checkpoint["loader"])
    log(checkpoint["note"])
    if checkpoint["source_sha256"] != SOURCE_SHA256:
        log("warning: resumed by another train_gpt.py than the one that wrote the checkpoint")
    return checkpoint["step"], checkpoint["timing"]

def save_checkpoint(args, log, step, model, adam, muon, train_loader, train_time_ms, timed_steps):
    """Rank 0 writes a temp file renamed into place (never half a checkpoint); a run keeps its last two."""
    names, momenta, t = {p: name for name, p in model.named_parameters()}, {}, time.perf_counter()
    for group in muon.param_groups:
        for i, p in enumerate(group["params"]):  # matrix i is rank i % W's, the one holding its momentum
            momenta[names[p]] = muon.state[p].get("momentum_buffer", torch.zeros_like(p))
            if muon.world_size > 1:
                dist.broadcast(momenta[names[p]], src=i % muon.world_size)
    path = os.path.join(args.log_dir, log.run_id, f"state_step{step:06d}.pt")
    if log.file:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        timing = (train_time_ms if timed_steps else 0.0, timed_steps)  # before the first timed step: none
        torch.save(dict(step=step, model=model.state_dict(), adam=adam.state_dict(), muon=momenta,
                        loader=(train_loader.shard, train_loader.pos), timing=timing, args=asdict(args),
                        source_sha256=SOURCE_SHA256, train_shards=train_shards(args)), f"{path}.tmp")
        os.replace(f"{path}.tmp", path)
        for old in sorted(glob.glob(os.path.join(glob.escape(os.path.dirname(path)), "state_step*.pt")))[:-2]:
            os.remove(old)
        log(f"checkpoint: {path}, {os.path.getsize(path) / 2**20:.1f} MiB in {time.perf_counter() - t:.1f} s")
    return path

def train(args, checkpoint=None):
    rank, world_size, device = setup_device()
    micro, accum_steps, val_batch = micro_batch_plan(args, world_size)
    train_loader, val_loader, passes = build_loaders(args, rank, world_size, device, val_batch)
    compiled, stamp = switched_on(args.compile, device), compile_cache_stamp(device)
    cache_note = "ignored: compile is off"
    if args.compile_cache and compiled:  # every rank loads, before anything compiles
        make_writable_folder(os.path.dirname(args.compile_cache) or ".", "--compile_cache")
        cache_note = load_compile_cache(args.compile_cache, stamp)
    if world_size > 1:
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None)
    with RunLog(args, master=rank == 0) as log, out_of_memory_as_error(micro), CleanStop(world_size) as stop:
        log.header(args, world_size, device, train_loader, val_loader, passes, cache_note)
        model, train_model, adam, muon = build_model(args, device, world_size, compiled)
        start, (timed_ms, timed_before) = (resume(checkpoint, log, model, adam, muon, train_loader)
                                           if checkpoint else (0, (0.0, 0)))
        timed_from = max(start + 1, UNTIMED_STEPS)  # a resumed run's first step compiles: untimed
        # a device tensor, changed in place: the compiled graph sees a new value, never a new constant
        window_blocks = torch.tensor(window_blocks_at(0, args), dtype=torch.int32, device=device)
        N = args.num_iterations
        train_time_ms, t0, saved = timed_ms, time.perf_counter(), None
        for step in range(start, N + 1):
            last_step, timed_steps = step == N, timed_before + max(step - timed_from, 0)
            if step == timed_from:
                train_time_ms, t0 = timed_ms, time.perf_counter()
            window_blocks.fill_(window_blocks_at(step, args))
            stopping = step > start and not last_step and stop.agreed(step)
            every, final = args.checkpoint_every, (stopping or last_step) and args.save_checkpoint
            checkpoint_due = step > start and (final or every > 0 and (stopping or step % every == 0))
            validate = not stopping and (last_step or args.val_loss_every and step % args.val_loss_every == 0)
            if checkpoint_due or validate:
                synchronize(device)  # checkpoints and validation are not train time
                train_time_ms += 1000 * (time.perf_counter() - t0)
                if checkpoint_due:
                    saved = save_checkpoint(args, log, step, model, adam, muon, train_loader, train_time_ms,
                                            timed_steps)
                if validate:
                    val_loss = evaluate(train_model, val_loader, args, val_batch, window_blocks, world_size)
                    log(f"step:{step}/{N} val_loss:{val_loss:.4f} train_time:{train_time_ms:.0f}ms "
                        f"step_avg:{step_avg(train_time_ms, timed_steps):.2f}ms")
                    stop_if_diverged(val_loss, step)
                synchronize(device)
                t0 = time.perf_counter()
            if last_step or stopping:
                break

            inputs, targets = train_loader.next_batch(args.batch_size)
            for i in range(accum_steps):  # gradients are all-reduced once per step, on the last micro-batch
                last_micro = i == accum_steps - 1
                with train_model.no_sync() if world_size > 1 and not last_micro else contextlib.nullcontext():
                    part = slice(i * micro, (i + 1) * micro)
                    (train_model(inputs[part], targets[part], window_blocks) / accum_steps).backward()
            for group in (*adam.param_groups, *muon.param_groups):
                group["lr"] = group["initial_lr"] * lr_multiplier(step, args)
            for group in muon.param_groups:
                group["momentum"] = muon_momentum(step, args)
            adam.step()
            muon.step()
            model.zero_grad(set_to_none=True)
            approx_ms = train_time_ms + 1000 * (time.perf_counter() - t0)  # no sync: approximate
            average = step_avg(approx_ms, timed_steps + (step >= timed_from))
            log(f"step:{step + 1}/{N} train_time:{approx_ms:.0f}ms step_avg:{average:.2f}ms")
            if step == start:  # everything has compiled now: eval at step 0, model and optimisers in step 1
                synchronize(device)
                log(startup_report(args, compiled, stamp, rank == 0, step + 1))
        log(f"peak memory consumption: {peak_memory_mib(device)} MiB")
        if stopping:  # the last line of the log and of stderr
            launcher = f"torchrun --standalone --nproc_per_node={world_size}" if world_size > 1 else "python"
            how = (f"resume with: {launcher} train_gpt.py --resume {saved}" if saved else
                   "no checkpoint was written (--checkpoint_every N or --save_checkpoint true write one)")
            log(f"stopped by {signal.Signals(stopping).name} after step {step}; {how}", console=sys.stderr)
    if world_size > 1:
        dist.barrier()  # no rank tears the process group down while another still writes or reduces
    return 128 + stopping if stopping else 0  # as if the signal had ended the process

# main ---------------------------------------------------------------------------------------------
def parse_bool(text):
    if text.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() in ("1", "true", "yes", "on")

def parse_args(argv=None, resumed=None):
    preset_parser = argparse.ArgumentParser(add_help=False)
    preset_parser.add_argument("--preset", choices=sorted(PRESETS))
    parser = argparse.ArgumentParser(description="NanoGPT speedrun trainer. Every option has a default.",
                                     parents=[preset_parser])
    for f in fields(Hyperparameters):
        parser.add_argument(f"--{f.name}", type=parse_bool if f.type is bool else f.type, default=f.default,
                            metavar=f.type.__name__.upper(), help="default: %(default)s")
    # --preset's values, if any, replace the defaults, and a resumed checkpoint's replace those
    parser.set_defaults(**PRESETS.get(preset_parser.parse_known_args(argv)[0].preset, {}) | (resumed or {}))
    namespace = parser.parse_args(argv)
    return Hyperparameters(**{f.name: getattr(namespace, f.name) for f in fields(Hyperparameters)})

def main(argv=None):
    # before anything initialises CUDA: fewer fragmentation stalls when the window grows
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    args = parse_args(argv)
    try:
        args, checkpoint = load_checkpoint(argv, args.resume) if args.resume else (args, None)
        check_hyperparameters(args)  # every value, before anything is written
        return train(args, checkpoint)
    except UserError as e:
        if int(os.environ.get("RANK", 0)) == 0 or e.every_rank:
            print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

if __name__ == "__main__":
    sys.exit(main())
