"""NanoGPT speedrun: a GPT-2-small-class model trained on FineWeb to 3.28 validation loss, fast.

Record 18 of the public NanoGPT speedrun (2025-01-04), the same maths step for step: 1,390 steps of
524,288 tokens in 3.4 minutes on 8 H100s (148.1 ms a step), val loss 3.2785 (80 runs: 3.2791, std
0.0019). From Keller Jordan's modded-nanogpt, begun as Andrej Karpathy's llm.c GPT-2 (124M) in
PyTorch, and those who raced it down since, each idea credited where it is, in record 18's words.
Run: ./run.sh (torchrun); on a CPU: python train_gpt.py --preset smoke. Importing it runs nothing.
"""
import time

# before the heavy imports: start-up is counted from launch
LAUNCH_TIME = time.time()

import contextlib
import glob
import math
import os
from dataclasses import dataclass
from dataclasses import field

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask
from torch.nn.attention.flex_attention import flex_attention
from torch.nn.parallel import DistributedDataParallel as DDP

# --------------------------------------------------------------------------------------------------
# Configuration

# FlexAttention's block: sequences are multiples of it, and the window is counted in whole blocks
BLOCK_SIZE = 128
# <|endoftext|>, which precedes every document
EOT = 50256

def option(default, *rules, fixed=False, graph=False):
    """A field of Hyperparameters: its rules; fixed: kept on resume; graph: in compiled graphs."""
    return field(default=default, metadata=dict(rules=rules, fixed=fixed, graph=graph))

# Rules of options: a test of the value (and the other options), and the valid values in words
AT_LEAST_0 = (lambda v, args: v >= 0, "at least 0")
AT_LEAST_1 = (lambda v, args: v >= 1, "at least 1")
ABOVE_0 = (lambda v, args: 0 < v < math.inf, "finite and above 0")
# 1 would never let a gradient into the running averages
BELOW_1 = (lambda v, args: 0 <= v < 1, "at least 0 and below 1")
LEARNING_RATE = (lambda v, args: 0 <= v < math.inf, "finite and at least 0 (0 freezes)")
FRACTION = (lambda v, args: 0 <= v <= 1, "from 0 (no decay) to 1 (decay from the first step)")
SHARDS = (lambda v, args: v != "", "a glob of token shards or 'synthetic'")
BLOCKS = (lambda v, args: v > 0 and v % BLOCK_SIZE == 0, f"a positive multiple of {BLOCK_SIZE}")
# one packed sequence per forward, within Rotary's table of 65,536 positions
MICRO_BATCH = (lambda v, args: 0 < v <= 65536 and v % BLOCK_SIZE == 0,
               f"a multiple of {BLOCK_SIZE} from {BLOCK_SIZE} to 65536")
# the window, interpolated between its two ends, must hold a whole block at every step
WINDOW = (lambda v, args: BLOCK_SIZE <= v <= 65536,
          f"from {BLOCK_SIZE} (one attention block) to 65536 tokens (the longest sequence)")
GPT2_VOCAB = (lambda v, args: v > EOT, f"at least {EOT + 1}: GPT-2 token ids go up to {EOT} (end of text)")
U_NET_DEPTH = (lambda v, args: v >= 6 and v % 2 == 0,
               "even, at least 6 (U-net halves, 3+3 value-embedded layers)")
FOLDER = (lambda v, args: v != "" and not os.path.isfile(v),
          "a folder name (not empty, not an existing file)")
SEED = (lambda v, args: 0 <= v < 2 ** 64, "from 0 to 2**64 - 1 (torch.manual_seed's range)")
FILE = (lambda v, args: v == "" or os.path.isfile(v), "an existing file, or '' (downloaded once)")
AUTO = (lambda v, args: v in ("auto", "true", "false"), "auto (on with CUDA), true or false")
NEEDS_TRITON = (lambda v, args: v != "true" or triton is not None,
                "auto or false: triton, which its kernel needs, is not installed (`pip install "
                "-r requirements.txt` installs it, on Linux only)")
NOT_A_FOLDER = (lambda v, args: not os.path.isdir(v), "a file name or '' (off), not a folder")
A_COMPILE_CACHE = (lambda v, args: not os.path.exists(v) or is_compile_cache(v),
                   "a new file or a compile cache this trainer wrote (this file is not a compile "
                   "cache and would be overwritten: pick another name)")

def multiple_of(name, times=1, why=""):
    """The rule: a positive multiple of `times` x another option's value (its words name it)."""
    def valid(value, args):
        return value > 0 and value % (times * getattr(args, name)) == 0

    def words(args):
        factor = f"{times} x " if times > 1 else ""
        reason = f": {why}" if why else ""
        return f"a positive multiple of {factor}--{name} ({times * getattr(args, name)}){reason}"
    return valid, words

HEAD_SIZE = multiple_of("num_heads", 4, "heads of a size divisible by 4 (rotary)")

@dataclass
class Hyperparameters:
    """Every option of a run; the defaults are record 18's. `--NAME VALUE` overrides any of them."""
    # data: globs of token shards, read in sorted name order ("synthetic": generated, no download)
    train_files: str = option("data/fineweb10B/fineweb_train_*.bin", SHARDS)
    val_files: str = option("data/fineweb10B/fineweb_val_*.bin", SHARDS)
    # fixed by the record rules
    val_tokens: int = option(10_485_760, multiple_of("max_device_batch_size"))
    # read the train stream more than once (never a record)
    allow_data_repeat: bool = option(False)
    # batch and schedule: tokens per step, whatever the number of processes
    batch_size: int = option(8 * 64 * 1024, BLOCKS, fixed=True)
    # one packed sequence per forward; a process's longer share is accumulated
    max_device_batch_size: int = option(64 * 1024, MICRO_BATCH, graph=True)
    num_iterations: int = option(1390, AT_LEAST_1, fixed=True)
    # the lr decays linearly to 0 over the last 40% of the steps
    cooldown_frac: float = option(0.4, FRACTION)
    # the attention window in tokens at step 0 and at the end: 1 to 14 blocks of 128
    window_start: int = option(128, WINDOW)
    window_end: int = option(1856, WINDOW)
    # model: GPT-2's 50,257 tokens padded to a multiple of 128
    vocab_size: int = option(50304, GPT2_VOCAB, fixed=True, graph=True)
    num_layers: int = option(12, U_NET_DEPTH, fixed=True, graph=True)
    num_heads: int = option(6, AT_LEAST_1, fixed=True, graph=True)
    model_dim: int = option(768, HEAD_SIZE, fixed=True, graph=True)
    # none if >= num_layers
    attention_free_layer: int = option(7, AT_LEAST_0, fixed=True, graph=True)
    bf16_embeds: bool = option(True, fixed=True, graph=True)
    # optimisers: Adam for the embeddings, the head and the scalars; Muon for the block matrices
    embed_lr: float = option(0.6, LEARNING_RATE)
    head_lr: float = option(0.008, LEARNING_RATE)
    scalar_lr: float = option(0.04, LEARNING_RATE)
    adam_beta1: float = option(0.8, BELOW_1)
    adam_beta2: float = option(0.95, BELOW_1)
    # PyTorch's default, as in record 18 (a later record's 1e-10 measured worse with this schedule)
    adam_eps: float = option(1e-8, ABOVE_0)
    muon_lr: float = option(0.05, LEARNING_RATE)
    muon_momentum_start: float = option(0.85, BELOW_1)
    muon_momentum: float = option(0.95, BELOW_1)
    muon_momentum_warmup_steps: int = option(300, AT_LEAST_0)
    # evaluation and logging; val_loss_every 0: only after the last step
    val_loss_every: int = option(125, AT_LEAST_0)
    log_dir: str = option("logs", FOLDER)
    seed: int = option(0, SEED)
    # after the last step, untimed: HellaSwag's 10,042 examples (downloaded once) or a JSONL file's
    hellaswag: bool = option(False)
    hellaswag_data: str = option("", FILE)
    # for --hellaswag offline: a tiktoken ranks file of GPT-2's BPE ("": tiktoken's, downloaded)
    tokenizer: str = option("", FILE)
    # checkpoints, in log_dir/<run id>/, resumable; a run keeps its last two
    save_checkpoint: bool = option(False)  # at the end
    checkpoint_every: int = option(0, AT_LEAST_0)  # every N steps (0: never)
    resume: str = option("")  # a checkpoint to go on from; its options become the defaults
    # resume a checkpoint another script wrote (a fork, another version), the log says so
    accept_other_script: bool = option(False)
    # compile and kernels; auto: on CUDA only (FlexAttention has no CPU backward)
    compile: str = option("auto", AUTO)
    # inductor's coordinate descent: ~0.5% faster steps for ~6 more minutes of compiling
    compile_tuning: bool = option(False, graph=True)
    # a file of compiled code: loaded before compiling, saved after step 1 (replacing only a cache)
    compile_cache: str = option("", NOT_A_FOLDER, A_COMPILE_CACHE)
    # each block and the head compiled alone
    regional_compile: bool = option(False, graph=True)
    # softcap, cross-entropy and its gradient in one Triton kernel; auto: on with CUDA
    fused_head_loss: str = option("auto", AUTO, NEEDS_TRITON, graph=True)
    # fused head: logits by chunks of rows (0: all at once)
    head_chunk_rows: int = option(0, AT_LEAST_0, graph=True)

# A small model on generated documents (no download), every part in a minute on a 2-core CPU: 12
# steps of 2 micro-batches (mostly the 50,304-wide head), 8x the head lr, a window up to 512 tokens.
PRESETS = {
    "smoke": dict(num_layers=8, num_heads=2, model_dim=64, head_lr=0.064, num_iterations=12,
                  val_loss_every=4, batch_size=1024, max_device_batch_size=512, val_tokens=4096,
                  window_end=512 + 64, train_files="synthetic", val_files="synthetic"),
}

class UserError(Exception):
    """A mistake the user can fix: main() prints its message as one line, without a traceback."""
    def __init__(self, message, every_rank=False):
        super().__init__(message)
        # it may happen on one rank alone: print it there too
        self.every_rank = every_rank

# --------------------------------------------------------------------------------------------------
# Muon: MomentUm Orthogonalized by Newton-Schulz (Keller Jordan, 2024)

def newton_schulz_wide(X, steps):
    """Roughly orthogonalise a stack of wide (or square) bf16 matrices: each step maps each singular
    value s in [0, 1] to p(s) = a s + b s^3 + c s^5 (X -> a X + (b A + c A^2) X, A = X X^T), a as
    steep as the iteration allows, b and c bending [0, 1] into about [0.7, 1.2] (p(1) = 0.70, peak
    1.20 at 0.55), not onto 1: five steps give US'V^T for UV^T, which trains as well, in bf16."""
    a, b, c = 3.4445, -4.7750, 2.0315
    # each matrix alone: spectral norm <= Frobenius norm <= 1
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    return X

class Muon(torch.optim.Optimizer):
    """SGD with Nesterov momentum, updates orthogonalised: rank r of W does a group's matrices r,
    r + W, ... as one bf16 batch, all-gathered asynchronously (@YouJiacheng) during the next."""
    def __init__(self, params, lr, momentum, nesterov=True, ns_steps=5, compiled=False):
        self.rank = int(os.environ.get("RANK", 0))
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        params = list(params)
        # a tall matrix is stacked as its wide transpose
        wide = [tuple(sorted(p.shape)) for p in params]
        shapes = sorted(set(wide), key=lambda s: (-s[0] * s[1], s))
        groups = [dict(params=[p for p, w in zip(params, wide) if w == s]) for s in shapes]
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps)
        super().__init__(groups, defaults)
        # compiled as in record 18; static shapes: one graph per stacked shape, none per step
        self.iterate = newton_schulz_wide
        if compiled:
            self.iterate = torch.compile(newton_schulz_wide, dynamic=False)
        # per group, outside the optimiser state: this rank's stacked input, zero-padded to equal
        # shares (zero orthogonalises to zero), and the gather buffer (rank r's share is its r-th)
        shares = [math.ceil(len(g["params"]) / self.world_size) for g in groups]
        self.stacked = [params[0].new_zeros(n, *shape, dtype=torch.bfloat16)
                        for n, shape in zip(shares, shapes)]
        self.gathered = [None] * len(groups)
        if self.world_size > 1:
            self.gathered = [x.new_empty(self.world_size * len(x), *x.shape[1:])
                             for x in self.stacked]

    @torch.no_grad()
    def step(self):
        launched = []
        for group, stacked, gathered in zip(self.param_groups, self.stacked, self.gathered):
            mine = group["params"][self.rank::self.world_size]
            # a group with fewer matrices than ranks leaves some ranks only padding
            if mine:
                self._stack_updates(mine, group, stacked)
            orthogonalised = self.iterate(stacked, group["ns_steps"])
            handle = None
            if self.world_size > 1:
                handle = dist.all_gather_into_tensor(gathered, orthogonalised, async_op=True)
                orthogonalised = gathered
            launched.append((group, handle, orthogonalised))
        for group, handle, orthogonalised in launched:
            if handle is not None:
                handle.wait()
            share = len(orthogonalised) // self.world_size
            for i, p in enumerate(group["params"]):
                # matrix i is rank (i % W)'s, the (i // W)-th of its share
                update = orthogonalised[i % self.world_size * share + i // self.world_size]
                if p.size(0) > p.size(1):
                    update = update.mT
                # the same RMS step size for tall and wide matrices
                scale = max(1, p.size(0) / p.size(1)) ** 0.5
                p.add_(update, alpha=-group["lr"] * scale)

    def _stack_updates(self, mine, group, stacked):
        """Momentum and Nesterov's look-ahead for this rank's matrices, into the stacked batch."""
        assert all(p.grad is not None for p in mine), "Muon: a matrix received no gradient"
        for p in mine:
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad)
        grads = [p.grad for p in mine]
        buffers = [self.state[p]["momentum_buffer"] for p in mine]
        momentum = group["momentum"]
        # buf = m * buf + (1 - m) * g
        torch._foreach_lerp_(buffers, grads, 1 - momentum)
        updates = buffers
        if group["nesterov"]:
            # u = (1 - m) * g + m * buf
            updates = torch._foreach_lerp(grads, buffers, momentum)
        wide = [u.mT if u.size(0) > u.size(1) else u for u in updates]
        torch._foreach_copy_(stacked[:len(mine)].unbind(), wide)

    def state_dict(self):
        """torch's format, with every matrix's momentum, sent by the rank that keeps it (zero before
        the first step): a collective, which every rank calls. It loads on any process count."""
        state = super().state_dict()
        params = [(i, p) for group in self.param_groups for i, p in enumerate(group["params"])]
        for index, (i, p) in enumerate(params):
            momentum = self.state[p].get("momentum_buffer")
            if momentum is None:
                momentum = torch.zeros_like(p)
            if self.world_size > 1:
                dist.broadcast(momentum, src=i % self.world_size)
            state["state"][index] = dict(momentum_buffer=momentum)
        return state

    def load_state_dict(self, state_dict):
        """A state_dict() of any process count: this rank keeps the momenta of its own matrices."""
        owners = [i % self.world_size for g in self.param_groups for i in range(len(g["params"]))]
        state = {i: s for i, s in state_dict["state"].items() if owners[i] == self.rank}
        super().load_state_dict(dict(state_dict, state=state))

# --------------------------------------------------------------------------------------------------
# PyTorch nn.Module definitions for the GPT-2 model

def norm(x):
    return F.rms_norm(x, (x.size(-1),))

def matmul(a, b, out_dtype=None):
    """a @ b in out_dtype (a's by default). bf16 on a CPU goes through fp32, with the same rounding,
    because bf16 matrix products crawl on CPUs without AVX-512."""
    if a.device.type == "cpu" and a.dtype == torch.bfloat16:
        return (a.float() @ b.float()).to(out_dtype or a.dtype)
    if out_dtype in (None, a.dtype):
        return a @ b
    return torch.mm(a, b, out_dtype=out_dtype)

class CastedLinear(nn.Linear):
    def __init__(self, in_features, out_features):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x):
        return matmul(x, self.weight.type_as(x).T)

class Rotary(nn.Module):
    def __init__(self, dim, max_seq_len=65536):
        super().__init__()
        # half-truncate RoPE by @YouJiacheng
        angular_freq = (1 / 1024) ** torch.linspace(0, 1, steps=dim // 4, dtype=torch.float32)
        angular_freq = torch.cat([angular_freq, angular_freq.new_zeros(dim // 4)])
        t = torch.arange(max_seq_len, dtype=torch.float32)
        theta = torch.outer(t, angular_freq)
        self.register_buffer("cos", theta.cos(), persistent=False)
        self.register_buffer("sin", theta.sin(), persistent=False)

    def forward(self, x, start=0):
        """x: (batch, seq, heads, head_dim) at positions start onward (a KVCache's), in fp32."""
        cos = self.cos[None, start:start + x.size(-3), None, :]
        sin = self.sin[None, start:start + x.size(-3), None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        y1 = x1 * cos + x2 * sin
        y2 = x1 * (-sin) + x2 * cos
        return torch.cat((y1, y2), 3).type_as(x)

class CausalSelfAttention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.c_q = CastedLinear(dim, dim)
        self.c_k = CastedLinear(dim, dim)
        self.c_v = CastedLinear(dim, dim)
        self.lambdas = nn.Parameter(torch.tensor([0.5, 0.5]))
        # dim // num_heads = head_dim
        self.rotary = Rotary(dim // num_heads)
        self.c_proj = CastedLinear(dim, dim)
        # zero init suggested by @Grad62304977
        self.c_proj.weight.data.zero_()

    def forward(self, x, ve, block_mask):
        # batch size, sequence length (a KVCache's batch of sequences: x is (1, batch, T, dim))
        B, T = x.size(-3), x.size(-2)
        start = block_mask.tokens.size(1) - T if isinstance(block_mask, KVCache) else 0
        q = self.c_q(x).view(B, T, self.num_heads, -1)
        k = self.c_k(x).view(B, T, self.num_heads, -1)
        v = self.c_v(x).view(B, T, self.num_heads, -1)
        # QK norm @Grad62304977
        q, k = norm(q), norm(k)
        q, k = self.rotary(q, start), self.rotary(k, start)
        if ve is not None:
            # @KoszarskyB & @Grad62304977
            v = self.lambdas[0] * v + self.lambdas[1] * ve.view_as(v)
        else:
            # skip mid-layers token value embeddings by @YouJiacheng
            v = self.lambdas[0] * v
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if isinstance(block_mask, KVCache):
            k, v, block_mask = block_mask.extend(self, k, v)
        scale = q.size(-1) ** -0.5
        if isinstance(block_mask, BlockMask):
            y = flex_attention(q, k, v, block_mask=block_mask, scale=scale)
        else:
            # CPU: the same mask as a dense boolean matrix, and fp32 arithmetic on the bf16 values
            y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                               attn_mask=block_mask, scale=scale).type_as(q)
        # re-assemble all head outputs side by side
        y = y.transpose(1, 2).contiguous().view_as(x)
        y = self.c_proj(y)
        return y

class MLP(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.c_fc = CastedLinear(dim, 4 * dim)
        self.c_proj = CastedLinear(4 * dim, dim)
        # zero init suggested by @Grad62304977
        self.c_proj.weight.data.zero_()

    def forward(self, x):
        x = self.c_fc(x)
        # https://arxiv.org/abs/2109.08668v2; ~1-2% better than GELU; suggested by @SKYLINEZ007 and
        # @Grad62304977
        x = F.relu(x).square()
        x = self.c_proj(x)
        return x

class Block(nn.Module):
    def __init__(self, model_dim, num_heads, use_attn=True):
        super().__init__()
        self.attn = CausalSelfAttention(model_dim, num_heads) if use_attn else None
        self.mlp = MLP(model_dim)
        self.lambdas = nn.Parameter(torch.tensor([1., 0.]))

    def forward(self, x, ve, x0, block_mask):
        x = self.lambdas[0] * x + self.lambdas[1] * x0
        if self.attn is not None:
            x = x + self.attn(norm(x), ve, block_mask)
        x = x + self.mlp(norm(x))
        return x

class ValueEmbedding(nn.Module):
    def __init__(self, vocab_size, model_dim, num_layers=12):
        super().__init__()
        self.num_layers = num_layers
        self.embed = nn.ModuleList([nn.Embedding(vocab_size, model_dim) for _ in range(3)])

    def forward(self, inputs):
        ve = [emb(inputs) for emb in self.embed]
        # 012 ... 012 structure on token value embeddings by @YouJiacheng, improved on @leloykun's
        # U-net structure; 12 layers: [ve0, ve1, ve2, None x 6, ve0, ve1, ve2]
        ve = [ve[0], ve[1], ve[2]] + [None] * (self.num_layers - 6) + [ve[0], ve[1], ve[2]]
        return ve

# --------------------------------------------------------------------------------------------------
# The main GPT-2 model

class GPT(nn.Module):
    # logit softcap (as in Gemma 2): tanh by @Grad62304977, lowered from 30 to 15 by @KoszarskyB;
    # the fused head's kernel takes it from here
    softcap = 15

    def __init__(self, vocab_size, num_layers, num_heads, model_dim, *, attention_free_layer=7,
                 bf16_embeds=True, fused_head_loss=False, head_chunk_rows=0):
        super().__init__()
        self.fused_head_loss = fused_head_loss
        self.head_chunk_rows = head_chunk_rows
        self.embed = nn.Embedding(vocab_size, model_dim)
        # token value embeddings by @KoszarskyB - inspired by @Grad62304977's value residual learning
        # U-net structure on token value embeddings by @leloykun
        self.value_embeds = ValueEmbedding(vocab_size, model_dim, num_layers)
        # skip attention of blocks.7 (the 8th layer) by @YouJiacheng
        self.blocks = nn.ModuleList([Block(model_dim, num_heads, use_attn=(i != attention_free_layer))
                                     for i in range(num_layers)])
        # U-net design by @brendanh0gan
        self.num_encoder_layers = num_layers // 2
        self.num_decoder_layers = num_layers - self.num_encoder_layers
        # Add learnable skip connection weights for decoder layers
        self.skip_weights = nn.Parameter(torch.ones(self.num_decoder_layers))
        self.lm_head = CastedLinear(model_dim, vocab_size)
        # @Grad62304977; the step-0 loss is ln(vocab_size)
        self.lm_head.weight.data.zero_()
        if bf16_embeds:
            for m in self.modules():
                if isinstance(m, nn.Embedding):
                    m.bfloat16()

    @classmethod
    def from_args(cls, args, device=torch.device("cpu")):
        fused_head_loss = fused_head_on(args.fused_head_loss, device)
        return cls(args.vocab_size, args.num_layers, args.num_heads, args.model_dim,
                   attention_free_layer=args.attention_free_layer, bf16_embeds=args.bf16_embeds,
                   fused_head_loss=fused_head_loss, head_chunk_rows=args.head_chunk_rows)

    def forward(self, inputs, targets, sliding_window_num_blocks, cache=None):
        """inputs: one packed sequence of EOT-led documents: the mean loss on targets, or (targets
        None) the softcapped fp32 logits; with a KVCache, (batch, T) after it: the last logits."""
        assert inputs.ndim == 1 or cache is not None, "one packed sequence per device"
        create_block_mask = build_block_mask if inputs.is_cuda else build_dense_mask
        if cache is not None:
            create_block_mask = cache.append
        block_mask = create_block_mask(inputs, sliding_window_num_blocks)

        # use of norm here by @Grad62304977
        x0 = norm(self.embed(inputs[None]))
        x = x0
        ve = self.value_embeds(inputs)
        assert len(ve) == len(self.blocks)
        ve_enc, ve_dec = ve[:self.num_encoder_layers], ve[self.num_encoder_layers:]

        # Store outputs for U-Net skip connections
        skip_connections = []
        # Encoder pass - process only the first half of the blocks
        for i in range(self.num_encoder_layers):
            x = self.blocks[i](x, ve_enc[i], x0, block_mask)
            skip_connections.append(x)
        # Decoder pass - process the remaining blocks with weighted skip connections
        for i in range(self.num_decoder_layers):
            x = x + self.skip_weights[i] * skip_connections.pop()
            # U-net structure on token value embeddings by @leloykun
            x = self.blocks[self.num_encoder_layers + i](x, ve_dec[i], x0, block_mask)

        x = norm(x)
        if cache is not None:
            return self.logits(x[0, :, -1]).float()
        # evaluation and sampling (evals/); training never takes this branch
        if targets is None:
            return self.logits(x[0]).float()
        return self.head_loss(x[0], targets)

    def logits(self, x):
        """The head's logits, softcapped into (-softcap, softcap)."""
        logits = self.lm_head(x)
        return self.softcap * torch.tanh(logits / self.softcap)

    def head_loss(self, x, targets):
        if self.fused_head_loss:
            # the same maths, the softcap, loss and gradient in one kernel (below the fence)
            return fused_head_loss(x, self.lm_head.weight, targets, self.head_chunk_rows, self.softcap)
        return F.cross_entropy(self.logits(x).float(), targets)

class KVCache:
    """For sampling at one token's cost: a batch of sequences' tokens so far and each attention
    layer's keys and values, up to `length` tokens; the layers' mask (x: (1, batch, T, dim))."""
    def __init__(self, batch_size, length, device):
        self.tokens = torch.empty(batch_size, 0, dtype=torch.int32, device=device)
        self.length = length
        self.layers = {}

    def append(self, tokens, sliding_window_num_blocks):
        self.tokens = torch.cat([self.tokens, tokens], 1)
        self.mask = build_dense_mask(self.tokens, sliding_window_num_blocks, -tokens.size(1))[:, None]
        return self

    def extend(self, layer, k, v):
        if layer not in self.layers:
            self.layers[layer] = k.new_empty(2, *k.shape[:2], self.length, k.size(-1))
        end = self.tokens.size(1)
        self.layers[layer][:, :, :, end - k.size(2):end] = torch.stack([k, v])
        return self.layers[layer][0, :, :, :end], self.layers[layer][1, :, :, :end], self.mask

# --------------------------------------------------------------------------------------------------
# Attention masks: causal, within one document, inside a sliding window of whole 128-token blocks

def may_attend(q_idx, kv_idx, docs, sliding_window_num_blocks=None):
    """The mask both below apply: kv_idx <= q_idx, both in one document (docs: each token's), and
    kv_idx's block fewer than sliding_window_num_blocks before q_idx's (None: the lists' job)."""
    causal_mask = q_idx >= kv_idx
    document_mask = docs[q_idx] == docs[kv_idx]
    attend = causal_mask & document_mask
    if sliding_window_num_blocks is not None:
        attend = attend & (kv_idx // BLOCK_SIZE > q_idx // BLOCK_SIZE - sliding_window_num_blocks)
    return attend

def build_dense_mask(inputs, sliding_window_num_blocks, start=0):
    """The mask as a dense (T, T) boolean matrix: the CPU computes attention with it. Of a batch
    (batch, T) of sequences: (batch, T - start, T), the rows of positions start onward."""
    docs = (inputs == EOT).cumsum(inputs.ndim - 1)
    pos = torch.arange(inputs.size(-1), device=inputs.device)
    attend = may_attend
    if inputs.ndim == 2:
        attend = torch.vmap(may_attend, in_dims=(None, None, 0, None))
    return attend(pos[start:, None], pos[None, :], docs, sliding_window_num_blocks)

def dense_to_ordered(docs_low, docs_high, sliding_window_num_blocks):
    """Each query block q's counts and lists of partial and full key blocks (lists padded with q),
    from each block's first and last document id (nondecreasing). A full block (before q, both in
    one document) needs no per-token test. Contiguous documents and a banded window need no sort
    (record 18's): the partial blocks are [start, q], or [start, full_start) and q when q lies in
    one document; the full ones [full_start, q). A window of 3 blocks, block 3 ending document 1:
        block                    0     1     2     3     4
        (docs_low, docs_high)  (1,1) (1,1) (1,1) (1,2) (2,2)
        row 2: full [0, 1], partial [2]         all document 1; only the diagonal needs the test
        row 3: full [],     partial [1, 2, 3]   the window starts at 1; block 3 holds two documents
        row 4: full [],     partial [3, 4]      document 2 begins inside block 3
    """
    q = torch.arange(len(docs_low), device=docs_low.device)[:, None]
    # the first block that reaches q's first document, and is inside the window
    reaches_document = torch.searchsorted(docs_high, docs_low)[:, None]
    start = torch.maximum(reaches_document, q - sliding_window_num_blocks + 1)
    # the first block that starts in q's document, when q lies in one document
    starts_in_document = torch.searchsorted(docs_low, docs_low)[:, None]
    full_start = torch.maximum(starts_in_document, start)
    full_start = torch.where((docs_low == docs_high)[:, None], full_start, q + 1)
    full_num_blocks = (q - full_start).clamp(min=0)
    # a place in a row's list
    position = q.T
    indices = torch.where(position < full_start - start, start + position, q)
    full_indices = torch.where(position < full_num_blocks, full_start + position, q)
    num_blocks = (q + 1 - start).clamp(min=0) - full_num_blocks
    lists = (num_blocks[:, 0], indices, full_num_blocks[:, 0], full_indices)
    return [t.to(torch.int32)[None, None].contiguous() for t in lists]

def build_block_mask(inputs, sliding_window_num_blocks):
    """FlexAttention's BlockMask for the mask above, without a sort (compiled, minutes): use of
    FlexAttention contributed by @KoszarskyB; block-wise sliding window by @YouJiacheng."""
    docs = (inputs == EOT).cumsum(0)
    docs_low = docs[0::BLOCK_SIZE].contiguous()
    docs_high = docs[BLOCK_SIZE - 1::BLOCK_SIZE].contiguous()
    total_num_blocks = len(docs_low)
    kv_lists = dense_to_ordered(docs_low, docs_high, sliding_window_num_blocks)
    # the query-side lists (for the backward), given as from_kv_blocks would sort: the rows of
    # the mirror image (blocks reversed, ids negated), its row r our column total_num_blocks - 1 - r
    q_num_blocks, q_indices, full_q_num_blocks, full_q_indices = dense_to_ordered(
        -docs_high.flip(0), -docs_low.flip(0), sliding_window_num_blocks)
    q_lists = [q_num_blocks.flip(-1), total_num_blocks - 1 - q_indices.flip(-2),
               full_q_num_blocks.flip(-1), total_num_blocks - 1 - full_q_indices.flip(-2)]

    # compiled, FlexAttention applies it in partial blocks only: record 18's document-causal test,
    # the window in the block lists; uncompiled, it ignores the lists: the whole mask, window too
    window = None if torch.compiler.is_compiling() else sliding_window_num_blocks

    def document_causal(b, h, q_idx, kv_idx):
        return may_attend(q_idx, kv_idx, docs, window)

    seq_lengths = (len(inputs), len(inputs))
    return BlockMask(seq_lengths, *kv_lists, *q_lists, BLOCK_SIZE=(BLOCK_SIZE, BLOCK_SIZE),
                     mask_mod=document_causal)

# --------------------------------------------------------------------------------------------------
# Our own simple Distributed Data Loader

def load_data_shard(path):
    """A shard's tokens, read straight into (with CUDA, pinned) memory: avoid pin_memory copy and
    bytes->array copy by @YouJiacheng."""
    num_tokens = read_shard_header(path)
    tokens = torch.empty(num_tokens, dtype=torch.uint16, pin_memory=torch.cuda.is_available())
    with open(path, "rb") as f:
        f.seek(HEADER_BYTES)
        if f.readinto(tokens.numpy()) != 2 * num_tokens:
            raise UserError(f"{path}: file changed while reading")
    return tokens

class DistributedDataLoader:
    """All ranks walk one token stream: rank r takes each batch's r-th share (and one more token,
    the last target), from shards in sorted name order, wrapping around, each read by read_shard."""
    def __init__(self, filename_pattern, rank, world_size, device, read_shard=load_data_shard):
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.read_shard = read_shard
        self.files = sorted(glob.glob(filename_pattern))
        self.current_shard = None
        self.reset()

    def reset(self, shard=0, position=0):
        """Go to a position in a shard (the first's start); a shard in memory is not read again."""
        if shard != self.current_shard:
            self.tokens = self.read_shard(self.files[shard])
        self.current_shard = shard
        self.current_position = position

    def advance(self):
        self.reset((self.current_shard + 1) % len(self.files))

    def next_batch(self, batch_size):
        """This rank's share of the next batch: inputs (int32), targets (int64, shifted by one)."""
        device_batch_size = batch_size // self.world_size
        # load next shard if necessary
        if self.current_position + batch_size + 1 >= len(self.tokens):
            self.advance()
        pos = self.current_position + self.rank * device_batch_size
        device_batch_tokens = self.tokens[pos:pos + device_batch_size + 1]
        # advance current position
        self.current_position += batch_size
        inputs = device_batch_tokens[:-1].to(device=self.device, dtype=torch.int32, non_blocking=True)
        targets = device_batch_tokens[1:].to(device=self.device, dtype=torch.int64, non_blocking=True)
        return inputs, targets

# --------------------------------------------------------------------------------------------------
# Schedules, optimisers and evaluation

def get_lr(step, args):
    """Learning rate schedule: stable then decay (linear to 0 over the last cooldown_frac)."""
    # time remaining in training
    t = 1 - step / args.num_iterations
    if t >= args.cooldown_frac:
        return 1.0
    return t / args.cooldown_frac

def muon_momentum(step, args):
    """Momentum warmup for Muon: linear over the first muon_momentum_warmup_steps steps."""
    frac = 1
    if args.muon_momentum_warmup_steps > 0:
        frac = min(step / args.muon_momentum_warmup_steps, 1)
    return (1 - frac) * args.muon_momentum_start + frac * args.muon_momentum

def get_sliding_window_blocks(step, args):
    """Sliding window size schedule: linear increase over training in chunks of 128, from 128 to
    1792 tokens (1 to 14 blocks). By @fernbear.bsky.social"""
    # training progress
    x = step / args.num_iterations
    return int(((1 - x) * args.window_start + x * args.window_end) // BLOCK_SIZE)

def build_optimizers(model, args, compiled=False):
    """Adam (fused) for the embeddings, the head and the scalars; Muon for the block matrices."""
    # collect the parameters to optimize
    hidden_matrix_params = [p for p in model.blocks.parameters() if p.ndim == 2]
    embed_params = [model.embed.weight, *model.value_embeds.parameters()]
    scalar_params = [p for p in model.parameters() if p.ndim < 2]
    head_params = [model.lm_head.weight]
    # init the optimizer(s)
    optimizer1 = torch.optim.Adam([dict(params=embed_params, lr=args.embed_lr),
                                   dict(params=head_params, lr=args.head_lr),
                                   dict(params=scalar_params, lr=args.scalar_lr)],
                                  betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
                                  fused=True)
    optimizer2 = Muon(hidden_matrix_params, lr=args.muon_lr, momentum=args.muon_momentum,
                      compiled=compiled)
    for group in (*optimizer1.param_groups, *optimizer2.param_groups):
        group["initial_lr"] = group["lr"]
    return optimizer1, optimizer2

@torch.no_grad()
def evaluate(model, val_loader, args, val_batch_size, sliding_window_num_blocks):
    """The mean loss over the first val_tokens validation tokens, the same on every rank."""
    model.eval()
    val_loader.reset()
    # calculate the number of steps to take in the val loop.
    val_steps = args.val_tokens // val_batch_size
    val_loss = sum(model(*val_loader.next_batch(val_batch_size), sliding_window_num_blocks)
                   for _ in range(val_steps)) / val_steps
    if val_loader.world_size > 1:
        # gloo has no AVG
        dist.all_reduce(val_loss)
        val_loss /= val_loader.world_size
    model.train()
    return val_loss.item()

# --------------------------------------------------------------------------------------------------
# Training

def micro_batch_plan(args, world_size):
    """Each process's micro-batch, the micro-batches of a step, and the validation batch."""
    device_batch_size = args.batch_size // world_size
    micro_bs = min(args.max_device_batch_size, device_batch_size)
    return micro_bs, device_batch_size // micro_bs, world_size * args.max_device_batch_size

def build_model(args, run):
    """The model (seeded), its optimisers, and the module that trains (compiled; DDP if several)."""
    torch.manual_seed(args.seed)
    model = GPT.from_args(args, run.device).to(run.device)
    # the fused head only where it computes what GPT.head_loss does (a fork may change that)
    check_fused_head(model, args.fused_head_loss, run.log)
    optimizers = build_optimizers(model, args, compiled=run.compiled)
    ddp_model = model
    if run.compiled and args.regional_compile:
        ddp_model = compile_regions(model)
    elif run.compiled:
        ddp_model = torch.compile(model, dynamic=False)
    if run.world_size > 1:
        device_ids = [run.device.index] if run.device.type == "cuda" else None
        ddp_model = DDP(ddp_model, device_ids=device_ids, broadcast_buffers=False,
                        gradient_as_bucket_view=True)
    return model, ddp_model, optimizers

# the first steps compile and warm up: train time starts after them, as in the record
UNTIMED_STEPS = 10

def train(args, checkpoint=None, stop=None):
    """One run: at each step validation and checkpoints, training, logging; `run` keeps it safe."""
    with Run(args, checkpoint, stop) as run:
        train_loader, val_loader = run.train_loader, run.val_loader
        micro_bs, accum_steps, val_batch_size = micro_batch_plan(args, run.world_size)
        model, ddp_model, optimizers = build_model(args, run)
        optimizer1, optimizer2 = optimizers
        start = run.resume(model, optimizers)
        train_steps = args.num_iterations
        # a device tensor changed in place: the compiled graph sees a new value, not a new constant
        sliding_window_num_blocks = torch.tensor(1, dtype=torch.int32, device=run.device)
        for step in range(start, train_steps + 1):
            sliding_window_num_blocks.fill_(get_sliding_window_blocks(step, args))

            # --------------- VALIDATION SECTION (and checkpoints: not train time) -----------------
            checkpoint_due, validation_due, run_ends = run.due(step)
            if checkpoint_due or validation_due:
                run.clock.pause()
                if checkpoint_due:
                    run.save_checkpoint(step)
                if validation_due:
                    val_loss = evaluate(ddp_model, val_loader, args, val_batch_size,
                                        sliding_window_num_blocks)
                    run.log_val_loss(step, val_loss)
                run.clock.resume()
            # the last step only has the validation loop, so break to avoid training; a stop ends
            # after its checkpoint
            if run_ends:
                break

            # --------------- TRAINING SECTION -----------------
            inputs_train, targets_train = train_loader.next_batch(args.batch_size)
            train_loss = 0
            micro_batches = zip(inputs_train.split(micro_bs), targets_train.split(micro_bs))
            for i, (micro_inputs_train, micro_targets_train) in enumerate(micro_batches):
                # DDP all-reduces the gradients once a step, in the last micro-batch's backward
                gradient_sync = contextlib.nullcontext()
                if run.world_size > 1 and i < accum_steps - 1:
                    gradient_sync = ddp_model.no_sync()
                with gradient_sync:
                    loss = ddp_model(micro_inputs_train, micro_targets_train,
                                     sliding_window_num_blocks)
                    # each loss is its micro-batch's mean: divided by their number, the summed
                    # gradients are the mean over the step's batch, whatever the process count
                    (loss / accum_steps).backward()
                train_loss = train_loss + loss.detach()
            # the learning rate schedule and the momentum warmup for Muon
            for group in (*optimizer1.param_groups, *optimizer2.param_groups):
                group["lr"] = group["initial_lr"] * get_lr(step, args)
            for group in optimizer2.param_groups:
                group["momentum"] = muon_momentum(step, args)
            # step the optimizers
            for opt in optimizers:
                opt.step()
            # null the gradients
            model.zero_grad(set_to_none=True)

            # --------------- LOGGING -----------------
            # rank 0's mean train loss, written without a wait for the device
            run.log_train_loss(step, train_loss / accum_steps)
        # peak memory, then HellaSwag with --hellaswag, outside train time
        run.finish(model)
    return run.exit_code

# ==================================================================================================
# Above: the speedrun; a change to its model, optimiser or schedule needs nothing below the fence.
# Below: operations, which train() reaches through Run, and the fused head's kernels.
# ==================================================================================================

import argparse
import ctypes
import datetime
import filecmp
import functools
import hashlib
import itertools
import json
import re
import resource
import shlex
import signal
import subprocess
import sys
import tempfile
import traceback
import uuid
import warnings
import zipfile
from dataclasses import asdict
from dataclasses import fields
from pathlib import Path

# triton has Linux wheels only; without it (macOS, Windows) --fused_head_loss stays off
try:
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:
    triton = None

# ------------------------------------------------------------------- Fused head (--fused_head_loss)
# z = x W^T by cuBLAS; a Triton kernel reads each row of z once for c = s tanh(z / s) and the loss
# logsumexp(c) - c[target], and in training overwrites z with d(mean loss)/dz (s: GPT.softcap).

if triton is not None:
    @triton.jit
    def softcapped_cross_entropy_kernel(logits, targets, losses, rows, grad_scale,
                                        VOCAB: tl.constexpr, SOFTCAP: tl.constexpr,
                                        ROWS: tl.constexpr, COLS: tl.constexpr,
                                        WRITE_GRAD: tl.constexpr, TANH_APPROX: tl.constexpr):
        """ROWS x COLS at a time, in fp32. Builtins only: a jit helper would not run interpreted."""
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        row_ok = row < rows
        row_start = logits + row.to(tl.int64) * VOCAB
        target = tl.load(targets + row, mask=row_ok, other=0)
        total = tl.full([ROWS, COLS], 0, tl.float32)
        c_target = tl.full([ROWS, COLS], 0, tl.float32)
        # sweep 0: the log-sum-exp and the loss; sweep 1: the row again, for the gradient
        for sweep in tl.static_range(1 + WRITE_GRAD):
            for k in range(0, VOCAB, COLS):
                # sweep 1 goes backwards: the latest reads are still in L2
                start = k if sweep == 0 else (VOCAB - 1) // COLS * COLS - k
                col = start + tl.arange(0, COLS)
                col_ok = (col < VOCAB)[None, :]
                mask = row_ok[:, None] & col_ok
                z = tl.load(row_start[:, None] + col[None, :], mask=mask, other=0,
                            eviction_policy="evict_last")
                if TANH_APPROX:
                    # CUDA: one instruction, instead of the exp and reciprocal that bound the kernel
                    t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f",
                                                  [z.to(tl.float32) * (1 / SOFTCAP)],
                                                  dtype=tl.float32, is_pure=True, pack=1)
                else:
                    t = 1 - 2 / (1 + tl.exp(z.to(tl.float32) * (2 / SOFTCAP)))
                is_target = col[None, :] == target[:, None]
                if sweep == 0:
                    # c < s bounds exp(c - s) by 1: no running maximum is needed
                    total += tl.where(col_ok, tl.exp(SOFTCAP * t - SOFTCAP), 0)
                    c_target += tl.where(is_target, SOFTCAP * t, 0)
                else:
                    # d loss / dz = (softmax(c) - onehot(target)) dc/dz, with dc/dz = 1 - t^2
                    p = tl.exp(SOFTCAP * t - lse[:, None])  # noqa: F821
                    g = tl.where(is_target, p - 1, p) * (1 - t * t) * grad_scale
                    # streamed past L2, which stays for the reads
                    tl.store(row_start[:, None] + col[None, :], g, mask=mask, cache_modifier=".cs")
            if sweep == 0:
                lse = SOFTCAP + tl.log(tl.reduce(total, 1, tl.standard._sum_combine))
                loss = lse - tl.reduce(c_target, 1, tl.standard._sum_combine)
                tl.store(losses + row, loss, mask=row_ok)

# the fastest launch measured on an H100
HEAD_LAUNCH_CUDA = dict(ROWS=1, COLS=4096, num_warps=16, TANH_APPROX=True)
# Triton's interpreter, which runs numpy: big blocks
HEAD_LAUNCH_CPU = dict(ROWS=128, COLS=8192, TANH_APPROX=False)

def softcapped_cross_entropy_(logits, targets, grad_scale=None, softcap=GPT.softcap):
    """Per-row losses of softcap tanh(z / softcap); with grad_scale, z becomes that * d(sum)/dz."""
    assert logits.is_contiguous() and targets.dtype == torch.int64
    kernel = softcapped_cross_entropy_kernel
    launch = HEAD_LAUNCH_CUDA
    buffer = logits
    if not logits.is_cuda:
        # the interpreter's fp32 -> bf16 conversion truncates: it works in fp32, and torch rounds
        kernel = InterpretedFunction(kernel.fn)
        launch = HEAD_LAUNCH_CPU
        buffer = logits.float()
    losses = logits.new_empty(len(logits), dtype=torch.float32)
    # numpy warns of exp(2z / softcap) = inf, where tanh saturates as it should
    with np.errstate(over="ignore"):
        grid = (triton.cdiv(len(logits), launch["ROWS"]),)
        kernel[grid](buffer, targets.contiguous(), losses, len(logits), grad_scale or 0.0,
                     VOCAB=logits.size(1), SOFTCAP=softcap, WRITE_GRAD=grad_scale is not None,
                     **launch)
    if grad_scale is not None and buffer is not logits:
        logits.copy_(buffer)
    return losses

class FusedHeadLoss(torch.autograd.Function):
    """Forward leaves d(mean loss)/dz in the logits' buffer z; backward scales small products."""
    @staticmethod
    def forward(ctx, x, weight, targets, softcap):
        # the logits, until the kernel overwrites them with their gradient
        grad_logits = matmul(x, weight.type_as(x).T)
        loss = softcapped_cross_entropy_(grad_logits, targets, 1 / x.size(0), softcap).mean()
        ctx.save_for_backward(x, weight, grad_logits)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        x, weight, grad_logits = ctx.saved_tensors
        grad_x = matmul(grad_logits, weight.type_as(x)).mul_(grad_loss)
        grad_w = matmul(grad_logits.T, x).float().mul_(grad_loss)
        return grad_x, grad_w, None, None

class ChunkedHeadLoss(torch.autograd.Function):
    """FusedHeadLoss by chunks of rows, never all logits at once: forward computes the gradients."""
    @staticmethod
    def forward(ctx, x, weight, targets, chunk_rows, softcap):
        w = weight.type_as(x)
        loss = 0
        grad_w = 0
        grad_x = torch.empty_like(x)
        chunks = zip(x.split(chunk_rows), targets.split(chunk_rows), grad_x.split(chunk_rows))
        for xs, ts, gs in chunks:
            grad_logits = matmul(xs, w.T)
            loss += softcapped_cross_entropy_(grad_logits, ts, 1 / len(x), softcap).sum()
            gs.copy_(matmul(grad_logits, w))
            grad_w += matmul(grad_logits.T, xs, out_dtype=torch.float32)
        ctx.save_for_backward(grad_x, grad_w)
        return loss / len(x)

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_w = ctx.saved_tensors
        return grad_x * grad_loss, grad_w * grad_loss, None, None, None

# A deliberate graph break: traced, the in-place kernel could be functionalised into a 6.6 GB copy.
# Not torch.compiler.disable: that imports torch._dynamo, which makes a cache folder.
@torch._disable_dynamo
def fused_head_loss(x, weight, targets, chunk_rows=0, softcap=GPT.softcap):
    """The mean softcapped cross-entropy of x W^T, as GPT.head_loss computes it, by the kernel."""
    training = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if training and chunk_rows:
        return ChunkedHeadLoss.apply(x, weight, targets, chunk_rows, softcap)
    if training:
        return FusedHeadLoss.apply(x, weight, targets, softcap)
    # evaluation: the loss only, by chunks as in training (without chunk_rows, one of all rows)
    rows = chunk_rows or len(x)
    w = weight.type_as(x)
    parts = zip(x.split(rows), targets.split(rows))
    losses = [softcapped_cross_entropy_(matmul(xs, w.T), ts, None, softcap) for xs, ts in parts]
    return torch.cat(losses).mean()

def fused_head_on(option, device):
    """--fused_head_loss: auto means on with NVIDIA's CUDA (ROCm's "cuda" lacks tanh.approx.f32)."""
    on_nvidia = device.type == "cuda" and torch.version.hip is None
    return triton is not None and (option == "true" or (option == "auto" and on_nvidia))

# the kernel sums exp(c - softcap) without a running maximum: exact while exp(-2 softcap) is normal
KERNEL_SOFTCAP_LIMIT = 43

def head_matches_kernel(model):
    """Whether GPT.logits and GPT.head_loss are the kernel's maths (on z from -4 to 4 softcaps)."""
    softcap = model.softcap
    if not isinstance(softcap, (int, float)) or not 0 < softcap <= KERNEL_SOFTCAP_LIMIT:
        return False
    z = torch.linspace(-4, 4, 64, device=model.lm_head.weight.device).view(16, 4).T * softcap
    targets = torch.tensor([3, 12, 7, 0], device=z.device)
    expected = softcap * torch.tanh(z / softcap)
    head = (model.lm_head, model.fused_head_loss)
    model.lm_head, model.fused_head_loss = nn.Identity(), False
    try:
        with torch.no_grad():
            logits = model.logits(z).float()
            loss = model.head_loss(z, targets).float()
    # a head that needs more of lm_head than its product computes something else
    except Exception:
        return False
    finally:
        model.lm_head, model.fused_head_loss = head
    same_loss = torch.allclose(loss, F.cross_entropy(expected, targets), rtol=1e-4)
    return same_loss and torch.allclose(logits, expected, rtol=1e-3, atol=1e-3)

def check_fused_head(model, option, log):
    """A fork's head the kernel cannot compute: --fused_head_loss true refused, auto falls back."""
    if not model.fused_head_loss or head_matches_kernel(model):
        return
    reason = ("GPT.logits or GPT.head_loss is not the kernel's softcap tanh(z / softcap) and "
              f"cross-entropy with a numeric GPT.softcap up to {KERNEL_SOFTCAP_LIMIT}")
    if option == "true":
        raise UserError(f"--fused_head_loss true: {reason}: pass --fused_head_loss false")
    model.fused_head_loss = False
    log(f"fused head loss off: {reason}; the plain head computes it")

# ------------------------------------------------------ Checks: the launch, the options, the device

# What torchrun sets for each process; left in a shell, they make a process a rank of no run:
# RANK=1 trains with no log and wrong Muon updates; WORLD_SIZE=2 waits for a process never coming.
TORCHRUN_VARIABLES = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                      "MASTER_PORT", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "GROUP_WORLD_SIZE",
                      "ROLE_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                      "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE"]

def check_launch_environment():
    """Some of torchrun's variables, not all: a leftover in a shell, refused before anything waits."""
    found = [name for name in TORCHRUN_VARIABLES if name in os.environ]
    if found and len(found) < len(TORCHRUN_VARIABLES):
        settings = " ".join(f"{name}={shlex.quote(os.environ[name])}" for name in found)
        raise UserError(f"{settings} set in the environment, but this process was not started by "
                        f"torchrun: for one process, `unset {' '.join(found)}` first; for several, "
                        "launch with ./run.sh or torchrun, which set them", every_rank=True)

def option_facts():
    """{name: dict(rules=, fixed=, graph=)} from option(); a plain field has none of them."""
    plain = dict(rules=(), fixed=False, graph=False)
    return {f.name: dict(plain, **f.metadata) for f in fields(Hyperparameters)}

def check_hyperparameters(args):
    """Refuse a value that cannot work, naming the option and its valid values."""
    checks = [(name, rule) for name, facts in option_facts().items() for rule in facts["rules"]]
    for name, (valid, allowed) in sorted(checks, key=lambda check: callable(check[1][1])):
        value = getattr(args, name)
        if not valid(value, args):
            allowed = allowed(args) if callable(allowed) else allowed
            raise UserError(f"--{name} must be {allowed}; got {value!r}")

def switched_on(option, device):
    """An auto/true/false option: auto means on with CUDA (faster there) and off on a CPU."""
    return option == "true" or (option == "auto" and device.type == "cuda")

def nvidia_smi_gpus():
    """(name, driver) of each GPU that nvidia-smi lists; none when it does not answer."""
    query = ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        answer = subprocess.run(query, capture_output=True, text=True, timeout=60, check=True)
        return [line.rpartition(", ")[::2] for line in answer.stdout.splitlines() if line.strip()]

def setup_device():
    """Rank, world size and device, from torchrun's environment (a single process without it)."""
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if not torch.cuda.is_available():
        gpus = nvidia_smi_gpus() if os.environ.get("CUDA_VISIBLE_DEVICES") != "" else None
        if gpus:
            raise UserError(f"torch {torch.__version__} (CUDA {torch.version.cuda}; None: CPU only) "
                            f"cannot use the {len(gpus)} x {gpus[0][0]} nvidia-smi lists (driver "
                            f"{gpus[0][1]}): install a build for this driver, e.g. `pip install "
                            "torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126`, or "
                            'update the driver; CUDA_VISIBLE_DEVICES="" runs on the CPU on purpose')
        return rank, world_size, torch.device("cpu")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    visible = torch.cuda.device_count()
    if visible < local_world:
        raise UserError(f"{local_world} processes on this node but {visible} GPUs visible: use "
                        f"--nproc_per_node={visible} (NPROC={visible} with ./run.sh; the same maths)")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    # bf16 matrix units arrived with Ampere
    if torch.cuda.get_device_capability(device) < (8, 0):
        raise UserError(f"{torch.cuda.get_device_name(device)} has no bf16 support, which this model "
                        "computes in: use an Ampere or newer GPU (A100, A10, L4, RTX 30xx, H100)")
    torch.cuda.set_device(device)
    return rank, world_size, device

# a process that stops answering (frozen, off the network) ends the run with a line, not silence
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)

def start_process_group(device):
    # torch 2.13 deprecates two calls whose replacements 2.11 lacks: DDP's broadcast_buffers (off
    # for the rotary tables, equal on every rank) and Muon's all_gather_into_tensor
    for call in ("broadcast_buffers", "torch.distributed.all_gather_into_tensor"):
        warnings.filterwarnings("ignore", f"`{call}` is deprecated", FutureWarning)
    nccl = device.type == "cuda"
    dist.init_process_group(backend="nccl" if nccl else "gloo", device_id=device if nccl else None,
                            timeout=COLLECTIVE_TIMEOUT)

def check_batch_plan(args, world_size):
    """The global batch must divide among the processes, and each share into micro-batches."""
    if args.batch_size % world_size:
        counts = [str(n) for n in range(1, 9) if args.batch_size % (n * BLOCK_SIZE) == 0]
        other_batch = "" if args.resume else ", or a --batch_size divisible by the process count"
        raise UserError(f"the global batch of {args.batch_size} tokens does not divide among "
                        f"{world_size} processes; use {', '.join(counts)} processes{other_batch}")
    micro_batch, _, val_batch = micro_batch_plan(args, world_size)
    share = args.batch_size // world_size
    if share % micro_batch or micro_batch % BLOCK_SIZE:
        raise UserError(f"each process's {share} tokens must split into equal micro-batches, "
                        f"multiples of {BLOCK_SIZE} of at most --max_device_batch_size "
                        f"{args.max_device_batch_size}")
    if args.val_tokens % val_batch:
        raise UserError(f"--val_tokens {args.val_tokens} must be a multiple of processes x "
                        f"--max_device_batch_size = {val_batch}")

def keep_freed_memory():
    """On a CPU with glibc, freed memory kept for the next allocation: a step's logits (100+ MB)
    are otherwise mapped, faulted in and unmapped afresh, half a smoke run's time (40 s, not 20)."""
    with contextlib.suppress(OSError, AttributeError):
        # M_TRIM_THRESHOLD: keep up to 1 GiB of freed memory; M_MMAP_MAX: no block mapped alone
        ctypes.CDLL(None).mallopt(-1, 2 ** 30)
        ctypes.CDLL(None).mallopt(-4, 0)

def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()

def peak_memory_mib(device):
    """The GPU's peak allocation; on a CPU, the peak resident set (ru_maxrss is in KiB on Linux)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() // 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024

@contextlib.contextmanager
def out_of_memory_as_error(micro_batch):
    try:
        yield
    except torch.cuda.OutOfMemoryError:
        raise UserError(f"out of GPU memory with micro-batches of {micro_batch:,} tokens: pass "
                        f"--max_device_batch_size {micro_batch // 2} (half usually fits; the "
                        "global batch and the maths stay the same)", every_rank=True) from None

# ------------------------ Data budget: the shards a run reads, whether they suffice, the smoke data

# a shard: a header of 256 little-endian int32 (magic, version, token count), then uint16 tokens
SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_BYTES = 256 * 4
REFETCH_HINT = "`python data/cached_fineweb10B.py N` replaces invalid shards"

def read_shard_header(path):
    """Check a shard's header against its size, without reading the tokens; returns their count."""
    try:
        size = os.path.getsize(path)
        if not os.path.isfile(path):  # a pipe would never end
            raise IsADirectoryError(0, "a folder, a pipe or a device, not a token shard")
        with open(path, "rb") as f:
            # a file shorter than a header reads as zeros: not a shard
            header = np.frombuffer(f.read(HEADER_BYTES).ljust(HEADER_BYTES, b"\0"), dtype="<i4")
    except OSError as e:
        raise UserError(f"{path}: cannot read this shard ({e.strerror}): narrow --train_files or "
                        "--val_files to readable shards") from None
    if (header[0], header[1]) != (SHARD_MAGIC, SHARD_VERSION):
        raise UserError(f"{path}: not a token shard (magic {header[0]}, version {header[1]}; "
                        f"expected {SHARD_MAGIC}, {SHARD_VERSION}); {REFETCH_HINT}")
    num_tokens = int(header[2])
    if size != HEADER_BYTES + 2 * num_tokens:
        raise UserError(f"{path}: header says {num_tokens} tokens ({HEADER_BYTES + 2 * num_tokens} "
                        f"bytes) but the file has {size} bytes (truncated or corrupt); {REFETCH_HINT}")
    return num_tokens

def write_data_shard(path, tokens):
    tokens = np.asarray(tokens)
    assert tokens.ndim == 1 and (tokens.size == 0 or (tokens.min() >= 0 and tokens.max() < 2 ** 16))
    header = np.zeros(256, dtype="<i4")
    header[:3] = SHARD_MAGIC, SHARD_VERSION, len(tokens)
    Path(path).write_bytes(header.tobytes() + tokens.astype("<u2").tobytes())

def read_checked_shard(path, vocab_size):
    """A shard's tokens, every id below the vocabulary size (checked on the host as it is read)."""
    tokens = load_data_shard(path)
    ids = tokens.numpy()
    if len(ids) > 0 and ids.max() >= vocab_size:
        at = int(np.argmax(ids >= vocab_size))
        raise UserError(f"{path}: token id {ids[at]} at position {at:,} is not below --vocab_size "
                        f"{vocab_size}: another tokenizer's shards (pass its --vocab_size), or a "
                        "corrupt file (FineWeb: `python data/cached_fineweb10B.py N --verify`)")
    return tokens

def markov_stream(num_tokens, seed, chain_seed=1234, vocab=256, successors=4):
    """EOT-led documents of 40 to 399 tokens of a Markov chain (learnable far below ln(vocab))."""
    table = np.random.default_rng(chain_seed).integers(0, vocab, size=(vocab, successors)).tolist()
    rng = np.random.default_rng(seed)
    tokens = np.empty(num_tokens, dtype=np.uint16)
    filled = 0
    while filled < num_tokens:
        # the first state, then the length: the order of the draws fixes the stream
        state = int(rng.integers(vocab))
        choices = rng.integers(successors, size=int(rng.integers(39, 399))).tolist()
        document = [EOT]
        for choice in choices:
            document.append(state)
            state = table[state][choice]
        tokens[filled:filled + len(document)] = document[:num_tokens - filled]
        filled += len(document)
    return tokens

def prepare_shards(args, split, num_tokens):
    """A split's glob; "synthetic": a stream each rank writes (train's drawn by the seed)."""
    pattern = getattr(args, f"{split}_files")
    if pattern != "synthetic":
        return pattern
    path = Path(args.log_dir, f"synthetic-seed{args.seed}",
                f"synthetic_{split}_{int(split == 'train'):06d}.bin")
    make_writable_folder(path.parent, "--log_dir")
    seed = [args.seed, 1] if split == "train" else [0, 0]
    try:
        with atomic_write(path) as tmp:
            write_data_shard(tmp, markov_stream(num_tokens, seed, chain_seed=0))
    except OSError as e:
        raise UserError(f"{path}: cannot write this synthetic shard ({e.strerror}): free space") from None
    return glob.escape(str(path))

def fetch_hint(num_iterations, batch_size):
    """The command that fetches the train shards a run reads, and a spare (9 for the record's 8)."""
    needed = math.ceil(num_iterations / max(1, (100_000_000 - 2) // batch_size))
    shards = f"{needed + 1}` (this run reads {needed} train shards)" if needed > 1 else "1`"
    return f"fetch FineWeb with `python data/cached_fineweb10B.py {shards}"

def batches_before_wrap(files, sizes, batch_size):
    """How many whole batches the loader takes from the shards before it wraps around."""
    for path in files:
        # next_batch takes a batch while pos + batch + 1 < tokens
        if sizes[path] < batch_size + 2:
            raise UserError(f"{path}: {sizes[path]:,} tokens, fewer than one batch of "
                            f"{batch_size:,} + 2 (the last target and the loader's margin): use "
                            "other shards or a smaller batch")
    return sum((sizes[path] - 2) // batch_size for path in files)

def check_data(args, train_files, val_files, sizes, val_batch, hint):
    """No val shard among the train shards (nor a link or copy), and tokens enough: the passes."""
    # by its own name, another (a link: one file) or as a copy (shards of the same size, compared)
    for val_path, train_path in itertools.product(val_files, train_files):
        if sizes[train_path] == sizes[val_path] and (
                os.path.samefile(train_path, val_path)
                or filecmp.cmp(train_path, val_path, shallow=False)):
            raise UserError(f"{train_path} is the val shard {val_path}, a link or a copy of it: a "
                            "run must never train on its validation data; narrow --train_files")
    train_batches = batches_before_wrap(train_files, sizes, args.batch_size)
    passes = args.num_iterations / train_batches
    fewer_steps = "" if args.resume else ", lower --num_iterations"
    if passes > 1 and not args.allow_data_repeat:
        raise UserError(f"the run needs {args.num_iterations} batches of {args.batch_size:,} "
                        f"train tokens ({args.num_iterations * args.batch_size:,} tokens) but the "
                        f"train shards hold {sum(sizes[path] for path in train_files):,}, enough "
                        f"for {train_batches} without repeating: {hint}{fewer_steps}, or pass "
                        "--allow_data_repeat true to reuse tokens")
    val_batches = batches_before_wrap(val_files, sizes, val_batch)
    if args.val_tokens // val_batch > val_batches:
        raise UserError(f"--val_tokens {args.val_tokens:,} is more than the val shards hold "
                        f"({sum(sizes[path] for path in val_files):,} tokens, "
                        f"{val_batches * val_batch:,} in whole batches of {val_batch:,}): lower "
                        "--val_tokens, or add val shards")
    return passes

def data_loaders(args, rank, world_size, device):
    """The loaders, headers checked now, ids as each shard is read (val's now); sizes, passes."""
    hint = fetch_hint(args.num_iterations, args.batch_size)
    read_shard = functools.partial(read_checked_shard, vocab_size=args.vocab_size)
    loaders = []
    sizes = {}
    for split, num_tokens in [("train", args.num_iterations * args.batch_size + 2),
                              ("val", args.val_tokens + 2)]:
        pattern = prepare_shards(args, split, num_tokens)
        if not glob.glob(pattern):
            raise UserError(f"no data shard matches {pattern!r}: {hint}, or point --train_files/"
                            "--val_files at your shards")
        loaders.append(DistributedDataLoader(pattern, rank, world_size, device, read_shard))
        sizes.update((path, read_shard_header(path)) for path in loaders[-1].files)
    # the first is read already
    for path in loaders[1].files[1:]:
        read_shard(path)
    val_batch = micro_batch_plan(args, world_size)[2]
    passes = check_data(args, *(loader.files for loader in loaders), sizes, val_batch, hint)
    return *loaders, sizes, passes

# ----- Run log: rank 0's logs/<run id>.txt (this file's source, the set-up), train time, step lines

def to_console(line, stream=None):
    """Print a line on stdout (or stream); a console gone (a closed pipe) becomes os.devnull."""
    stream = stream or sys.stdout
    try:
        print(line, file=stream, flush=True)
    except OSError:
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())

def last_words(line, console=True, code=1):
    """A process's last line, on stderr and with its exit code in torchrun's error file."""
    if console:
        to_console(line, sys.stderr)
    message = dict(message=line, extraInfo=dict(timestamp=str(int(time.time())), exit_code=code))
    with contextlib.suppress(OSError, KeyError):
        Path(os.environ["TORCHELASTIC_ERROR_FILE"]).write_text(json.dumps(dict(message=message)))

def make_writable_folder(folder, option):
    """Make the folder and write in it: an unusable place fails now, naming the option to change."""
    try:
        os.makedirs(folder, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise UserError(f"{option}: cannot make or write to {folder} ({e.strerror}): pick another") from None

@contextlib.contextmanager
def atomic_write(path):
    """A temp path for path's bytes, renamed into place once written: never half a file."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise

class RunLog(contextlib.AbstractContextManager):
    """Rank 0's log (other ranks' calls do nothing); a failed write (a full disk) ends the run."""
    def __init__(self, args, master, hellaswag=None):
        self.file = None
        self.run_id = str(uuid.uuid4())
        self.master = master
        self.args = args
        # the checkpoints this run wrote, (step, path), oldest first: the only files it deletes
        self.checkpoints = []
        self.resume_hint = " or pick another --log_dir"
        if master:
            make_writable_folder(args.log_dir, "--log_dir")
            self.path = os.path.join(args.log_dir, f"{self.run_id}.txt")
            self.file = open(self.path, "w")
            to_console(f"logging to {self.path}")
            self(f"{SOURCE.decode()}{hellaswag.source if hellaswag else ''}\n{'=' * 100}", console=False)
            self.resume_hint = "; no checkpoint was written"

    def __call__(self, line, console=True):
        """Log a line; print it (on the stream given as console) unless console is False."""
        if self.master and console:
            to_console(line, None if console is True else console)
        if self.master and self.file:
            try:
                print(line, file=self.file, flush=True)
            except OSError as e:
                self.close()
                raise UserError(f"cannot write to the log {self.path} ({e.strerror}): free some "
                                f"space{self.resume_hint}") from None

    def close(self):
        if self.file:
            # closing flushes what a failed write left in the buffer, and fails again
            with contextlib.suppress(OSError):
                self.file.close()
            self.file = None

    def __exit__(self, kind, error, trace):
        # main() prints a UserError and a stop's line, Python other errors' tracebacks: all logged
        if isinstance(error, UserError):
            self(f"error: {error}", console=False)
        elif isinstance(error, Stopped):
            self(stopped_before_steps(error.args[0], self.args), console=False)
        elif isinstance(error, Exception):
            self("".join(traceback.format_exception(error)).rstrip(), console=False)
        self.close()

    def header(self, args, world_size, device, loaders, passes, notes):
        """Versions, GPUs, options and shards into the log; the data line on the console too."""
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        lines = [f"Running Python {sys.version}",
                 f"Running PyTorch {torch.__version__} compiled for CUDA {torch.version.cuda}",
                 f"devices: {world_size} x {gpu}"]
        # once a run: only rank 0 writes the log; a broken driver can make nvidia-smi hang
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            if self.file:
                table = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30)
                lines.append(table.stdout.rstrip())
        lines += ["=" * 100, "hyperparameters:"]
        lines += [f"  {name} = {value}" for name, value in asdict(args).items()]
        for name, loader in zip(("train", "val"), loaders):
            lines.append(f"{name} shards ({len(loader.files)}): {' '.join(loader.files)}")
        self("\n".join(lines), console=False)
        source = ""
        if "synthetic" in (args.train_files, args.val_files):
            source = f"synthetic Markov-chain documents (seed {args.seed}), no download needed; "
        self("\n".join([f"data: {source}train {args.train_files}, val {args.val_files}; "
                        f"{args.num_iterations * args.batch_size:,} train tokens read, "
                        f"{passes:.2f} passes over the train shards", *notes]))
        self("=" * 100, console=False)

class TrainClock:
    """Train time as the record measures it, paused around validation and checkpoints; resumable."""
    def __init__(self, device, start, resumed_ms=0.0, resumed_steps=0):
        self.device = device
        self.resumed_ms = resumed_ms
        self.resumed_steps = resumed_steps
        # a resumed run's first step compiles, so it is not timed either
        self.timed_from = max(start + 1, UNTIMED_STEPS)
        self.restart()

    def restart(self):
        self.ms = self.resumed_ms
        self.resume()

    def pause(self):
        synchronize(self.device)
        self.ms += 1000 * (time.perf_counter() - self.t0)
        self.t0 = None

    def resume(self):
        synchronize(self.device)
        self.t0 = time.perf_counter()

    def elapsed_ms(self):
        """Train time so far, without waiting for the device: approximate."""
        return self.ms + 1000 * (time.perf_counter() - self.t0)

    def timed_steps(self, step):
        """How many timed steps have run before step `step`."""
        return self.resumed_steps + max(step - self.timed_from, 0)

    def step_avg(self, step, train_time_ms):
        return train_time_ms / self.timed_steps(step) if self.timed_steps(step) else math.nan

# --------------------------- Compile options (build_model's regional compile) and the compile cache

def compile_regions(model):
    """Each block and the head compiled alone; past 32 graphs (a block has 8): an error."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    for block in model.blocks:
        block.compile(dynamic=False)
    model.head_loss = torch.compile(model.head_loss, dynamic=False)
    return model

# the start of every compile cache's first line: "<header><stamp> sha256=<hex digest>"
COMPILE_CACHE_HEADER = "train_gpt compile cache: "

def compile_cache_stamp(args, world_size, device):
    """What compiled code depends on: versions, device, processes, micro-batch, graph options."""
    triton_version = getattr(triton, "__version__", None)
    # a CPU's kernels are built for its vector instructions: an AVX-512 cache under AVX2 gave NaN
    gpu = (torch.cuda.get_device_name(device) if device.type == "cuda"
           else f"cpu {torch.backends.cpu.get_cpu_capability()}")
    processes = "1 process" if world_size == 1 else f"{world_size} processes"
    graph_options = [name for name, facts in option_facts().items() if facts["graph"]]
    options = ", ".join(f"--{name} {getattr(args, name)}" for name in graph_options)
    return (f"{COMPILE_CACHE_HEADER}torch {torch.__version__}, triton {triton_version}, {gpu}, "
            f"{processes}, micro-batch {micro_batch_plan(args, world_size)[0]}, {options}")

def is_compile_cache(path):
    """Whether a file begins as this trainer's compile caches do: only such a file is replaced."""
    if not os.path.isfile(path):  # a pipe would never end
        return False
    with contextlib.suppress(OSError), open(path, "rb") as f:
        header = re.escape(COMPILE_CACHE_HEADER.encode()) + rb".* sha256=[0-9a-f]{64}\n"
        return re.fullmatch(header, f.readline(4096)) is not None
    return False

def load_compile_cache(path, stamp, compiled=True):
    """Every rank fills its compile caches from path before anything compiles: what happened."""
    if not compiled:
        return "ignored: compile is off"
    make_writable_folder(os.path.dirname(path) or ".", "--compile_cache")
    if not os.path.exists(path):
        return "not found; rank 0 writes it after step 1"
    replaced = "rank 0 replaces it after step 1"
    # a bad cache costs a compile, never the run
    try:
        header, _, artifacts = Path(path).read_bytes().partition(b"\n")
        made_by, _, digest = header.decode(errors="replace").rpartition(" sha256=")
        if made_by != stamp:
            ours = stamp.removeprefix(COMPILE_CACHE_HEADER).split(", ")
            theirs = made_by.removeprefix(COMPILE_CACHE_HEADER).split(", ")
            made_for = ", ".join(item for item in theirs if item not in ours)
            return f"rejected: made for {made_for[:300]}; {replaced}"
        if hashlib.sha256(artifacts).hexdigest() != digest or (
                torch.compiler.load_cache_artifacts(artifacts) is None):
            return f"rejected: corrupt or unreadable; {replaced}"
    except Exception as e:
        return f"rejected: {type(e).__name__}: {e}"
    return f"loaded ({len(artifacts) / 2 ** 20:.1f} MiB)"

def save_compile_cache(path, stamp):
    """Written whole, and never over a file that is not a cache (one put there during the run)."""
    if os.path.exists(path) and not is_compile_cache(path):
        return f"not saved: {path} is not a compile cache now, so it stays as it is"
    artifacts = (torch.compiler.save_cache_artifacts() or [b""])[0]
    header = f"{stamp} sha256={hashlib.sha256(artifacts).hexdigest()}\n"
    try:
        with atomic_write(path) as tmp:
            Path(tmp).write_bytes(header.encode() + artifacts)
    except OSError as e:
        return f"not saved: {e}"
    return f"saved ({len(artifacts) / 2 ** 20:.1f} MiB)"

def startup_report(args, compiled, stamp, master, step):
    """From launch to the end of the first step: the time, the compile time and its cache hits."""
    line = f"startup: {time.time() - LAUNCH_TIME:.1f}s from launch to the end of step {step}"
    if compiled:
        time_spent = getattr(torch._dynamo.utils, "calculate_time_spent", dict)()
        fx = torch._dynamo.utils.counters["inductor"]
        line += (f", {time_spent.get('total_wall_time', math.nan):.1f}s of it compiling (FX graph "
                 f"cache hits/misses: {fx['fxgraph_cache_hit']}/{fx['fxgraph_cache_miss']})")
        if master and args.compile_cache:
            line += f"; compile cache {save_compile_cache(args.compile_cache, stamp)}"
    return line

# ---------------------------- Checkpoints and stopping; HellaSwag after the last step (--hellaswag)

STOP_CHECK_EVERY = 5
# this file, read once: checkpoints carry it (evals/ build their model from it), and its path
SOURCE = Path(__file__).read_bytes()
SOURCE_SHA256 = hashlib.sha256(SOURCE).hexdigest()
SCRIPT = os.path.realpath(__file__)

class Stopped(BaseException):
    """A stop signal (args: its number) with nothing to save, raised at once; not an Exception."""

def stopped_before_steps(signum, args):
    """The last line of a run stopped before its first step ended."""
    kept = f"; {args.resume} is as it was" if args.resume else ""
    return f"stopped by {signal.Signals(signum).name} before the first step ended: nothing to save{kept}"

class CleanStop(contextlib.AbstractContextManager):
    """SIGTERM, SIGINT, SIGHUP unless nohup: at_once, Stopped; else a flag the ranks all-reduce."""
    def __init__(self):
        self.received = 0
        self.at_once = True
        self.pending = (torch.tensor(0), None)
        self.group = None
        signums = [signal.SIGTERM, signal.SIGINT]
        if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
            signums.append(signal.SIGHUP)
        self.previous = {signum: signal.signal(signum, self._on_signal) for signum in signums}

    def _on_signal(self, signum, frame):
        self.received = self.received or signum
        if self.at_once:
            raise Stopped(signum)

    def __exit__(self, kind, error, traceback):
        self.at_once = False
        # a failing rank keeps the flag's handler while it writes its last lines (torchrun
        # SIGTERMs all); a pending all-reduce ends with its group: every rank launched it
        if error is None or self.group is None:
            for signum, handler in self.previous.items():
                signal.signal(signum, handler)

    def agreed(self, step):
        """The signal that all ranks stop on after this step, or 0; called at every step on all."""
        if self.group is None:
            return self.received
        if step % STOP_CHECK_EVERY:
            return 0
        flag, handle = self.pending
        launched = torch.tensor(self.received)
        reduction = dist.all_reduce(launched, dist.ReduceOp.MAX, group=self.group, async_op=True)
        self.pending = (launched, reduction)
        # the flag launched STOP_CHECK_EVERY steps ago
        if handle is None or handle.wait():
            return int(flag)
        return 0

def resume_command(path, world_size):
    """The command that goes on from checkpoint `path`, launched as this run was, in its folder."""
    script_and_options = f"{shlex.quote(os.path.relpath(__file__))} --resume {shlex.quote(path)}"
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return f"python {script_and_options}"
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if per_node == world_size:
        return f"torchrun --standalone --nproc_per_node={world_size} {script_and_options}"
    # the rendezvous options of a multi-node launch are not known here
    return (f"this run's torchrun command (--nnodes={world_size // per_node} --nproc_per_node="
            f"{per_node} and its rendezvous options) on every node, with {script_and_options}; "
            "only this node has the checkpoint: copy it to the same path on the others")

def train_shards(args, files=None, sizes=None):
    """The train shards' name:tokens (none if "synthetic"): of the files given, or of the glob."""
    if args.train_files == "synthetic":
        return []
    files = sorted(glob.glob(args.train_files)) if files is None else files
    counts = [sizes[path] if sizes else read_shard_header(path) for path in files]
    return [f"{os.path.basename(path)}:{n}" for path, n in zip(files, counts)]

def load_checkpoint(argv, path):
    """A checkpoint read as data (nothing in it runs), and its options under the command line's."""
    where = f"--resume {path!r}"
    try:
        if not os.path.isfile(path) and os.path.exists(path):  # a pipe would never end
            raise IsADirectoryError(0, "a folder, a pipe or a device, not a checkpoint file")
        # the zip's CRCs catch a flipped byte in tensor data, which torch.load misses
        damaged = zipfile.ZipFile(path).testzip()
        if damaged:
            raise ValueError(f"{damaged} fails its CRC check")
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        saved = checkpoint["args"]
        saved_shards = checkpoint["train_shards"]
    except OSError as e:
        raise UserError(f"{where}: cannot read it ({e.strerror}): give a checkpoint file (a run "
                        "keeps its last two)") from None
    except Exception as e:
        if "Weights only load failed" in str(e):
            raise UserError(f"{where}: refused: unpickling it could run code, which no checkpoint "
                            "of this trainer holds: resume from one it wrote") from None
        problem = f"{type(e).__name__}: {e}"
        raise UserError(f"{where} is not a checkpoint, or a corrupt or truncated one ({problem}): "
                        "give another (a run keeps its last two)") from None
    # the acceptance of another script is this run's to give, never taken over
    args = parse_args(argv, resumed=dict(saved, accept_other_script=False))
    writer = (f"{os.path.basename(checkpoint.get('script', 'another script'))} (sha256 "
              f"{str(checkpoint.get('source_sha256'))[:12]})")
    other_script = checkpoint.get("source_sha256") != SOURCE_SHA256
    if other_script and not args.accept_other_script:
        raise UserError(f"{where} was written by {writer}, not by this script, "
                        f"{os.path.basename(__file__)} (sha256 {SOURCE_SHA256[:12]}): resume with "
                        "the script that wrote it, or pass --accept_other_script true to go on")
    options = asdict(args)
    changed = [name for name in options if options[name] != saved.get(name)
               and name not in ("resume", "accept_other_script")]
    refused = [f"--{n} {saved.get(n)} -> {getattr(args, n)}" for n in changed if option_facts()[n]["fixed"]]
    shards = train_shards(args)
    if shards != saved_shards:
        refused.append(f"train shards (name:tokens) {saved_shards[:3]} -> {shards[:3]}")
    if args.train_files == "synthetic" and "seed" in changed:
        refused.append(f"--seed {saved.get('seed')} -> {args.seed} (the synthetic train stream)")
    if refused:
        raise UserError(f"--resume {path!r}: {', '.join(refused)} would change the model, the data "
                        "position or the schedules: leave these options as the checkpoint has them")
    if checkpoint["step"] > args.num_iterations:
        raise UserError(f"{where} is at step {checkpoint['step']}, past its --num_iterations "
                        f"{args.num_iterations}: there is no step to go on to")
    note = f"resumed from {path} at step {checkpoint['step']}"
    # the run that wrote it, wherever the checkpoint was copied: a resumed run counts once
    if "run_id" in checkpoint:
        note += f" of run {checkpoint['run_id']}"
    if checkpoint["step"] == args.num_iterations:
        note += ", its last step: nothing to train, its val loss again"
    if other_script:
        note += f", written by {writer}: another script, accepted (--accept_other_script)"
        lacking = [f"--{name} {value!r}" for name, value in saved.items() if name not in options]
        if lacking:
            note += f"; its options this script lacks, not applied: {', '.join(lacking)}"
    if changed:
        changes = ", ".join(f"--{n} {saved.get(n)!r} -> {getattr(args, n)!r}" for n in changed)
        note += f"; options changed: {changes}"
    return args, dict(checkpoint, note=note)

# record 18's checkpoints' names (a compiled model's prefix), and this trainer's before it took them
OLD_NAMES = [(r"^_orig_mod\.", ""), (r"^value_embeds\.(\d)\.", r"value_embeds.embed.\1."),
             (r"\.attn\.([qkv])\.", r".attn.c_\1."), (r"\.(attn|mlp)\.proj\.", r".\1.c_proj."),
             (r"\.mlp\.fc\.", ".mlp.c_fc.")]

def current_names(weights):
    """A checkpoint's weights under this model's names."""
    renamed = {}
    for name, tensor in weights.items():
        for old, new in OLD_NAMES:
            name = re.sub(old, new, name)
        renamed[name] = tensor
    return renamed

def load_state(checkpoint, model, optimizers, where):
    """A checkpoint's weights and optimiser states loaded (each popped: freed), or why not."""
    weights = current_names(checkpoint.pop("model"))
    ours = model.state_dict()
    for name in [*ours, *weights]:
        if name not in weights:
            problem = f"it has no {name}"
        elif name not in ours:
            problem = f"it has {name}, which this model has not"
        elif weights[name].shape != ours[name].shape:
            problem = f"{name} is {list(weights[name].shape)} in it, {list(ours[name].shape)} in this model"
        else:
            continue
        raise UserError(f"{where}: its weights do not fit this model ({problem}): resume with the "
                        "script and options that wrote it")
    model.load_state_dict(weights)
    try:
        for optimizer, state in zip(optimizers, checkpoint.pop("optimizers"), strict=True):
            # the checkpoint's state, this run's settings (its learning rates, ...)
            settings = torch.optim.Optimizer.state_dict(optimizer)["param_groups"]
            optimizer.load_state_dict(dict(state, param_groups=settings))
    except (ValueError, KeyError, IndexError, RuntimeError) as e:
        raise UserError(f"{where}: its optimiser states do not fit this script's optimisers "
                        f"({' '.join(str(e).split())[:200]}): resume with the script that wrote "
                        "it") from None

def write_checkpoint(path, state):
    """Written whole (atomic_write); a failed write's reason (a full disk), or None."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # through a file object: a failed write's OSError is kept (in torch's RuntimeError)
        with atomic_write(path) as tmp, open(tmp, "wb") as f:
            torch.save(state, f)
    except (OSError, RuntimeError) as error:
        cause = error if isinstance(error, OSError) else error.__cause__ or error.__context__
        if not isinstance(cause, OSError):
            raise
        return cause.strerror or str(cause)
    return None

def load_hellaswag(args):
    """With --hellaswag, evals/hellaswag.py's scorer: its examples read now, before any write."""
    if not args.hellaswag:
        return None
    try:
        from evals import hellaswag
        return hellaswag.ForTrainer(args)
    except ImportError as e:
        raise UserError(f"--hellaswag needs the repository's evals/ and data/ folders beside this "
                        f"script, in {Path(__file__).resolve().parent} ({e})") from None

# ---------------------------------------------------- The run: what train() reaches below the fence

class Run(contextlib.AbstractContextManager):
    """What keeps train()'s run safe: stops, set-up, checks, each step's due, log, checkpoints."""
    def __init__(self, args, checkpoint=None, stop=None):
        self.args = args
        self.checkpoint = checkpoint
        self.stop = stop
        self.rank, self.world_size, self.device = setup_device()
        if self.device.type == "cpu":
            keep_freed_memory()
        self.master = self.rank == 0
        self.compiled = switched_on(args.compile, self.device)
        self.step = None
        self.unsaved_step = None
        self.failure = None
        self.stopping, self.stop_signal = False, 0

    def __enter__(self):
        args = self.args
        with contextlib.ExitStack() as stack:
            # first: a stop during the set-up or the first step's compile ends the run at once
            if self.stop is None:
                self.stop = stack.enter_context(CleanStop())
            self.hellaswag = load_hellaswag(args)
            check_batch_plan(args, self.world_size)
            self.train_loader, self.val_loader, self.sizes, passes = data_loaders(
                args, self.rank, self.world_size, self.device)
            self.stamp = compile_cache_stamp(args, self.world_size, self.device)
            if self.compiled and args.compile_tuning:
                # not in record 18: on an H100, a first compile of 514 s, not 120 s, for 0.5% faster
                from torch._inductor import config as inductor_config
                inductor_config.coordinate_descent_tuning = True
            notes = []
            if args.compile_cache:
                cache_note = load_compile_cache(args.compile_cache, self.stamp, self.compiled)
                notes.append(f"compile cache {args.compile_cache}: {cache_note}")
            if self.world_size > 1:
                start_process_group(self.device)
                self.stop.group = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
            self.log = stack.enter_context(RunLog(args, self.master, self.hellaswag))
            stack.enter_context(out_of_memory_as_error(micro_batch_plan(args, self.world_size)[0]))
            self.log.header(args, self.world_size, self.device, (self.train_loader, self.val_loader),
                            passes, notes)
            self.exits = stack.pop_all()
        return self

    def __exit__(self, kind, error, trace):
        if isinstance(error, Exception) and self.stop.received:
            # what a stop signal broke on its way (the compile workers it ends too) is the stop
            self.log("".join(traceback.format_exception(error)).rstrip(), console=False)
            self.stopping, self.stop_signal = True, self.stop.received
            self.log_stop(during=True)
            return self.exits.__exit__(None, None, None) or True
        if self.world_size > 1 and isinstance(error, RuntimeError) and re.search(
                "timed out|timeout", str(error), re.IGNORECASE):
            error = UserError(f"another process of the run stopped answering: a collective waited "
                              f"{COLLECTIVE_TIMEOUT.total_seconds():.0f} s for it during step "
                              f"{self.step}; {self.how_to_go_on(during=True)}")
            self.exits.__exit__(UserError, error, None)
            raise error
        if error is None and (self.stopping or self.failure):
            self.log_stop()
        suppressed = self.exits.__exit__(kind, error, trace)
        if error is None and self.world_size > 1:
            # no rank tears the process group down while another still writes or reduces
            dist.barrier()
        return suppressed

    def resume(self, model, optimizers):
        """Take the model and optimisers (loaded if resuming) to checkpoint: the start step."""
        self.model = model
        self.optimizers = optimizers
        self.start = 0
        timing = (0.0, 0)
        if self.checkpoint is not None:
            load_state(self.checkpoint, model, optimizers, f"--resume {self.args.resume!r}")
            self.train_loader.reset(*self.checkpoint["loader"])
            self.log(self.checkpoint["note"])
            self.start = self.checkpoint["step"]
            timing = self.checkpoint["timing"]
        self.clock = TrainClock(self.device, self.start, *timing)
        # each step's train loss, copied to the host behind an event; (step, time, event) pending
        self.host_losses = torch.zeros(self.args.num_iterations, pin_memory=self.device.type == "cuda")
        self.pending = []
        return self.start

    def due(self, step):
        """Whether this step checkpoints, validates, and ends the run (last step or agreed stop)."""
        args = self.args
        self.step = step
        if step == self.clock.timed_from:
            self.clock.restart()
        self.stop_signal = self.stop.agreed(step)
        last_step = step == args.num_iterations
        self.stopping = self.stop_signal != 0 and step > self.start and not last_step
        final = args.save_checkpoint and (self.stopping or last_step)
        periodic = args.checkpoint_every > 0 and (self.stopping or step % args.checkpoint_every == 0)
        validation = last_step or (args.val_loss_every > 0 and step % args.val_loss_every == 0)
        checkpoint_due = step > self.start and (final or periodic)
        return checkpoint_due, validation and not self.stopping, last_step or self.stopping

    def save_checkpoint(self, step):
        """Every rank takes part (Muon's momenta are broadcast); rank 0 writes it whole and keeps the
        last two. A write that fails (a full disk) is a warning: the last one stays, training goes on."""
        self.write_train_losses(wait=True)
        optimizer_states = [optimizer.state_dict() for optimizer in self.optimizers]
        if not self.master:
            return
        started = time.perf_counter()
        # before the first timed step, no time has been counted
        timed_steps = self.clock.timed_steps(step)
        timing = (self.clock.ms if timed_steps else 0.0, timed_steps)
        loader = self.train_loader
        state = dict(step=step, model=self.model.state_dict(), optimizers=optimizer_states,
                     loader=(loader.current_shard, loader.current_position), timing=timing,
                     args=asdict(self.args), source=SOURCE, source_sha256=SOURCE_SHA256, script=SCRIPT,
                     run_id=self.log.run_id, train_shards=train_shards(self.args, loader.files, self.sizes))
        path = os.path.join(self.args.log_dir, self.log.run_id, f"state_step{step:06d}.pt")
        log = self.log
        reason = write_checkpoint(path, state)
        if reason:
            self.unsaved_step = step
            kept = (f"the last one, {log.checkpoints[-1][1]}, stays" if log.checkpoints
                    else "there is no earlier one")
            log(f"warning: the checkpoint of step {step} could not be written ({reason}: free some "
                f"space in {self.args.log_dir}); {kept}", console=sys.stderr)
            if self.args.save_checkpoint and step == self.args.num_iterations:
                self.failure = f"the final checkpoint could not be written ({reason})"
            return
        log.checkpoints.append((step, path))
        resume = resume_command(path, self.world_size)
        log.resume_hint = f"; the last checkpoint stays: resume with: {resume}"
        # the last two this run wrote are kept: the older ones of its own, and no other file, go
        while len(log.checkpoints) > 2:
            with contextlib.suppress(FileNotFoundError):
                os.remove(log.checkpoints.pop(0)[1])
        seconds = time.perf_counter() - started
        log(f"checkpoint: {path}, {os.path.getsize(path) / 2 ** 20:.1f} MiB in {seconds:.1f} s")

    def log_val_loss(self, step, val_loss):
        self.write_train_losses(wait=True)
        self.log(f"step:{step}/{self.args.num_iterations} val_loss:{val_loss:.4f} train_time:"
                 f"{self.clock.ms:.0f}ms step_avg:{self.clock.step_avg(step, self.clock.ms):.2f}ms")
        # every rank sees the same reduced loss, so all stop here
        if not math.isfinite(val_loss):
            raise UserError(f"val loss is {val_loss} at step {step}: training diverged, most "
                            "likely a learning rate too high for this configuration (--muon_lr, "
                            "--embed_lr, --head_lr, --scalar_lr)")

    def log_train_loss(self, step, loss):
        """The step's line, written once its loss has reached the host: no wait for the device."""
        train_time_ms = self.clock.elapsed_ms()
        self.host_losses[step].copy_(loss, non_blocking=True)
        # on the CPU the copy is done already
        event = torch.cuda.Event() if self.device.type == "cuda" else None
        if event is not None:
            event.record()
        self.pending.append((step, train_time_ms, event))
        self.write_train_losses(wait=False)
        # all has compiled now (validation at step 0, the model and the optimisers in step 1): from
        # here a stop waits for the end of a step, and a checkpoint
        if step == self.start:
            synchronize(self.device)
            self.write_train_losses(wait=True)
            self.log(startup_report(self.args, self.compiled, self.stamp, self.master, step + 1))
            self.stop.at_once = False

    def write_train_losses(self, wait):
        """The step lines whose losses have arrived, in order; all, when wait (the host waits)."""
        while self.pending:
            step, train_time_ms, event = self.pending[0]
            if event is not None and not (wait or event.query()):
                return
            if event is not None:
                event.synchronize()
            self.pending.pop(0)
            # a step before the first timed one (a resumed run's first compiles): no average
            average = (self.clock.step_avg(step + 1, train_time_ms) if step >= self.clock.timed_from
                       else math.nan)
            self.log(f"step:{step + 1}/{self.args.num_iterations} "
                     f"train_loss:{self.host_losses[step].item():.4f} "
                     f"train_time:{train_time_ms:.0f}ms step_avg:{average:.2f}ms")

    def finish(self, model):
        """The peak memory line; then, with --hellaswag, its scores (a stop ends them at once)."""
        self.write_train_losses(wait=True)
        self.log(f"peak memory consumption: {peak_memory_mib(self.device)} MiB")
        if not self.hellaswag or self.stopping:
            return
        self.stop.at_once = True
        try:
            if self.stop.received:
                raise Stopped(self.stop.received)
            self.stopping, self.stop_signal = self.hellaswag.score(model, self.args, self.log,
                                                                   self.stop)
        except Stopped as stopped:
            self.stopping, self.stop_signal = True, stopped.args[0]
        self.stop.at_once = False

    def how_to_go_on(self, during=False):
        """From which checkpoint, with which command, a stopped run goes on."""
        if not self.master:
            return "rank 0's log names its last checkpoint"
        if not self.log.checkpoints and self.unsaved_step is not None:
            return "no checkpoint could be written (see the warning above)"
        if not self.log.checkpoints:
            return "no checkpoint was written (--checkpoint_every N or --save_checkpoint true write one)"
        last_step, last = self.log.checkpoints[-1]
        how = f"resume with: {resume_command(last, self.world_size)}"
        if during or last_step != self.step:
            how = f"from step {last_step}, {how}"
        return how

    def log_stop(self, during=False):
        """The last line: the signal (or failure) that stopped the run, when, and how to go on."""
        when = f"during step {self.step}" if during else f"after step {self.step}"
        if self.stopping and self.step == self.args.num_iterations:
            when += ", in HellaSwag's scoring (no score)"
        stopped_by = (f"error: {self.failure}: stopped" if self.failure
                      else f"stopped by {signal.Signals(self.stop_signal).name}")
        line = f"{stopped_by} {when}; {self.how_to_go_on(during)}"
        self.log(line, console=False)
        last_words(line, self.master, self.exit_code)

    @property
    def exit_code(self):
        """1 when the final checkpoint failed; after a stop signal, 128 + its number."""
        if self.failure:
            return 1
        return 128 + self.stop_signal if self.stopping else 0

# ------------------------------------------------------------------------------- Arguments and main

def parse_bool(text):
    if text.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() in ("1", "true", "yes", "on")

def parse_args(argv=None, resumed=None):
    """Command-line options over defaults: Hyperparameters', then a --preset's, a checkpoint's."""
    preset_parser = argparse.ArgumentParser(add_help=False)
    preset_parser.add_argument("--preset", choices=sorted(PRESETS))
    description = "NanoGPT speedrun trainer. Every option has a default."
    parser = argparse.ArgumentParser(description=description, parents=[preset_parser])
    for f in fields(Hyperparameters):
        kind = parse_bool if f.type is bool else f.type
        parser.add_argument(f"--{f.name}", type=kind, default=f.default,
                            metavar=f.type.__name__.upper(), help="default: %(default)s")
    preset = preset_parser.parse_known_args(argv)[0].preset
    parser.set_defaults(**PRESETS.get(preset, {}) | (resumed or {}))
    namespace = parser.parse_args(argv)
    return Hyperparameters(**{f.name: getattr(namespace, f.name) for f in fields(Hyperparameters)})

def main(argv=None):
    # before anything initialises CUDA: fewer fragmentation stalls as the window grows
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    args = parse_args(argv)
    # once a node (local rank 0), so every node's console has it
    console = int(os.environ.get("LOCAL_RANK", 0)) == 0
    # from here a stop signal ends the run with its line, before step 1 at once
    with CleanStop() as stop:
        try:
            check_launch_environment()
            args, checkpoint = load_checkpoint(argv, args.resume) if args.resume else (args, None)
            # every value, before anything is written
            check_hyperparameters(args)
            return train(args, checkpoint, stop)
        except UserError as e:
            last_words(f"error: {e}", console=console or e.every_rank)
            return 1
        except (Stopped, Exception) as e:
            # a stop, or what it broke on its way (the compile workers it ends too)
            if stop.received:
                last_words(stopped_before_steps(stop.received, args), console=console)
                return 128 + stop.received
            # a beat under torchrun (it polls at 0.1 s): the rank that failed first is seen first
            time.sleep(1 if "TORCHELASTIC_RUN_ID" in os.environ else 0)
            # its traceback follows; the message's first line (C++ errors add a stack) for the rest
            first_line = next(iter(str(e).splitlines()), "")
            last_words(f"error: unexpected {type(e).__name__}: {first_line} (its traceback is "
                       "above)", console=False)
            raise
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

if __name__ == "__main__":
    sys.exit(main())
