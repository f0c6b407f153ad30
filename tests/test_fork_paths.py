"""A fork runs what it changed: every faster path follows the definitions above the fence.

The fused head (through Triton's interpreter on a CPU) against the plain head at another softcap,
whole and in row chunks; a rewritten GPT.logits or GPT.head_loss caught before the kernel computes
another function; uncompiled flex_attention, which reads only the BlockMask's mask_mod, against the
dense mask, and the per-token test of compiled regions, a broken mask named in words; every
option's facts beside its field, read by the option checks, the resume and the compile cache. Fast,
nothing compiled: `python -m pytest tests/test_fork_paths.py -q`.
"""
import ast
import dataclasses
import hashlib
import inspect
import re
from dataclasses import fields
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_mask
from torch.nn.attention.flex_attention import flex_attention

import train_gpt
from train_gpt import BLOCK_SIZE
from train_gpt import EOT
from train_gpt import GPT
from train_gpt import Hyperparameters
from train_gpt import build_block_mask
from train_gpt import build_dense_mask

# --- attention: the block mask's mask_mod is the whole mask ---------------------------------------

SEQ = 6 * BLOCK_SIZE
# where documents start (an EOT): one document, many short ones, documents across block edges, one
# starting on each edge, and a sequence that starts inside a document
LAYOUTS = {
    "one_document": [0],
    "short_documents": list(range(0, SEQ, 37)),
    "spanning_blocks": [0, 200, 450, 700],
    "on_block_edges": [0, BLOCK_SIZE, 2 * BLOCK_SIZE, 4 * BLOCK_SIZE + 5],
    "mid_document_start": [300],
}


def tokens_of(layout):
    tokens = torch.randint(0, 50000, (SEQ,), generator=torch.Generator().manual_seed(0))
    tokens[LAYOUTS[layout]] = EOT
    return tokens


def reference_mask(tokens, window_blocks):
    """Written here from the definition: q sees k when k <= q, both are in one document, and k's
    block is fewer than window_blocks blocks before q's."""
    docs = torch.cumsum(tokens == EOT, 0)
    q = torch.arange(len(tokens))[:, None]
    k = q.T
    return (k <= q) & (docs[k] == docs[q]) & (q // BLOCK_SIZE - k // BLOCK_SIZE < window_blocks)


def mask_fault(mask, expected):
    """What the mask gets wrong against the expected one, in words (None: nothing): a later token
    seen, else another token seen that must not be, else one missed."""
    seen = (mask & ~expected).nonzero().tolist()
    later = [(q, k) for q, k in seen if k > q]
    missed = (~mask & expected).nonzero().tolist()
    if later:
        return "attention sees a later token: query {} sees key {}".format(*later[0])
    if seen:
        return ("attention sees a token of another document or outside the window: query {} sees "
                "key {}").format(*seen[0])
    if missed:
        return "attention misses a token it must see: query {}, key {}".format(*missed[0])
    return None


@pytest.mark.parametrize("layout", LAYOUTS)
def test_uncompiled_flex_attention_with_the_block_mask_applies_the_dense_mask(layout):
    """Uncompiled (`--compile false`), flex_attention ignores the block lists and evaluates
    mask_mod on every pair: the window must be in it."""
    tokens = tokens_of(layout)
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, SEQ, 16, generator=generator) for _ in range(3))
    for window in (1, 2, 3, 6):
        window_blocks = torch.tensor(window, dtype=torch.int32)
        expected_mask = reference_mask(tokens, window)
        fault = mask_fault(build_dense_mask(tokens, window_blocks), expected_mask)
        assert fault is None, f"the dense mask, window {window}: {fault}"
        block_mask = build_block_mask(tokens, window_blocks)
        token_mask = create_mask(block_mask.mask_mod, 1, 1, SEQ, SEQ, device="cpu")[0, 0]
        fault = mask_fault(token_mask, expected_mask)
        assert fault is None, f"mask_mod alone, window {window}: {fault}"
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=expected_mask)
        got = flex_attention(q, k, v, block_mask=block_mask)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=f"window {window}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_in_a_compiled_region_the_per_token_test_is_causal_and_within_one_document(monkeypatch,
                                                                                   layout):
    """Compiled (on GPUs), FlexAttention applies mask_mod in the partial blocks and the window
    lives in the block lists: mask_mod, built as in a compiled region, is the mask of one document
    up to the query, with no window."""
    tokens = tokens_of(layout)
    with monkeypatch.context() as patched:
        patched.setattr(torch.compiler, "is_compiling", lambda: True)
        block_mask = build_block_mask(tokens, torch.tensor(1, dtype=torch.int32))
    token_mask = create_mask(block_mask.mask_mod, 1, 1, SEQ, SEQ, device="cpu")[0, 0]
    fault = mask_fault(token_mask, reference_mask(tokens, SEQ // BLOCK_SIZE))
    assert fault is None, f"mask_mod in a compiled region: {fault}"


# --- the fused head follows GPT.softcap and GPT.logits --------------------------------------------

needs_triton = pytest.mark.skipif(train_gpt.triton is None, reason="triton is not installed (Linux "
                                  "only): the fused head-loss kernel needs it")


def head_case(vocab=777, rows=37, dim=16, logit_scale=60.0):
    """bf16 rows as the model feeds its head, and a head whose logits reach +-3 logit_scale: far
    into tanh's bend for a softcap of 15 and of 30 alike."""
    generator = torch.Generator().manual_seed(2)
    x = F.rms_norm(torch.randn(rows, dim, generator=generator), (dim,)).bfloat16()
    weight = torch.randn(vocab, dim, generator=generator) * logit_scale / dim ** 0.5
    targets = torch.randint(0, vocab, (rows,), generator=generator)
    return x, weight, targets


def float64_head(x, weight, targets, softcap):
    """softcap tanh(z / softcap) and the mean cross-entropy in float64, with W rounded to bf16 as
    CastedLinear casts it; the loss and its gradients wrt x and W."""
    x64 = x.double().requires_grad_()
    w64 = weight.bfloat16().double().requires_grad_()
    loss = F.cross_entropy(softcap * torch.tanh(x64 @ w64.T / softcap), targets)
    return (loss.item(), *torch.autograd.grad(loss, (x64, w64)))


def model_head(model, x, weight, targets, fused_head_loss=False, head_chunk_rows=0):
    """GPT.head_loss of the model with this head, the plain or the fused one (whole, or by chunks
    of rows): the loss and its gradients wrt x and W."""
    model.fused_head_loss = fused_head_loss
    model.head_chunk_rows = head_chunk_rows
    with torch.no_grad():
        model.lm_head.weight.copy_(weight)
    x = x.clone().requires_grad_()
    loss = model.head_loss(x, targets)
    return (loss.item(), *torch.autograd.grad(loss, (x, model.lm_head.weight)))


def relative_error(value, reference):
    return ((value.double() - reference).norm() / reference.norm()).item()


@needs_triton
def test_fused_head_whole_and_in_row_chunks_follows_a_forks_softcap(monkeypatch):
    monkeypatch.setattr(GPT, "softcap", 30)
    x, weight, targets = head_case()
    # one model for every path: GPT.head_loss reads its options at each call
    model = GPT(len(weight), 6, 1, x.size(1))
    if not train_gpt.head_matches_kernel(model):
        pytest.skip("this GPT's head is not softcap tanh(z / softcap): its fused head stays off")
    reference = float64_head(x, weight, targets, softcap=30)
    # the test can tell the two softcaps apart
    record_softcap = float64_head(x, weight, targets, softcap=15)
    assert abs(record_softcap[0] - reference[0]) > 0.1 * reference[0]
    plain = model_head(model, x, weight, targets)
    # the whole 37 rows at once, and in chunks of 24 rows (a full one and a partial one)
    for chunk_rows in (0, 24):
        fused = model_head(model, x, weight, targets, fused_head_loss=True,
                           head_chunk_rows=chunk_rows)
        for path in (plain, fused):
            loss, grad_x, grad_w = path
            assert abs(loss - reference[0]) < 1e-3 * reference[0]
            # bf16 inputs and logits: errors of a few 1e-3 are rounding, a wrong softcap is far off
            assert relative_error(grad_x, reference[1]) < 1e-2
            assert relative_error(grad_w, reference[2]) < 1e-2
        assert abs(fused[0] - plain[0]) < 1e-3 * plain[0], f"chunks of {chunk_rows}"
        assert relative_error(fused[2], plain[2].double()) < 1e-2, f"chunks of {chunk_rows}"


def sigmoid_logits(self, x):
    """Another squashing into (-softcap, softcap)."""
    return self.softcap * (2 * torch.sigmoid(self.lm_head(x) / self.softcap) - 1)


def own_softcap_logits(self, x):
    """A softcap changed in GPT.logits only, not in GPT.softcap (twice that, whatever it is)."""
    return 2 * self.softcap * torch.tanh(self.lm_head(x) / (2 * self.softcap))


def label_smoothed_head_loss(self, x, targets):
    if self.fused_head_loss:
        return train_gpt.fused_head_loss(x, self.lm_head.weight, targets, 0, self.softcap)
    return F.cross_entropy(self.logits(x).float(), targets, label_smoothing=0.1)


# what a fork may change above the fence, and what the kernel cannot compute
REWRITES = {
    "logits_squashed_otherwise": ("logits", sigmoid_logits),
    "logits_with_a_softcap_of_their_own": ("logits", own_softcap_logits),
    "head_loss_label_smoothed": ("head_loss", label_smoothed_head_loss),
    "softcap_beyond_the_kernels_range": ("softcap", 50),
    "softcap_learned": ("softcap", torch.nn.Parameter(torch.tensor(15.0))),
}


@pytest.fixture(scope="module")
def small_gpt():
    """GPT(512, 6, 1, 16), built once (its 6 rotary tables take a while): a fork's rewrites and
    softcaps are the class's, read at each call."""
    return GPT(512, 6, 1, 16)


@pytest.fixture
def fused_model(small_gpt):
    """small_gpt with its fused head on, as GPT(..., fused_head_loss=True) builds it."""
    small_gpt.fused_head_loss = True
    return small_gpt


class LogLines(list):
    def __call__(self, line):
        self.append(line)


@pytest.mark.record18
@needs_triton
def test_the_records_head_and_a_forks_softcap_keep_the_fused_kernel(monkeypatch, fused_model):
    model = fused_model
    for softcap in (15, 30, 7.5):
        monkeypatch.setattr(GPT, "softcap", softcap)
        state = model.state_dict()
        rng = torch.get_rng_state()
        log = LogLines()
        train_gpt.check_fused_head(model, "true", log)
        assert model.fused_head_loss and log == []
        # the check leaves the model and the random stream as they were
        assert isinstance(model.lm_head, train_gpt.CastedLinear)
        assert list(model.state_dict()) == list(state) and torch.equal(torch.get_rng_state(), rng)


@needs_triton
@pytest.mark.parametrize("rewrite", REWRITES)
def test_a_head_the_kernel_does_not_compute_is_refused_or_runs_plain(monkeypatch, fused_model,
                                                                    rewrite):
    name, value = REWRITES[rewrite]
    monkeypatch.setattr(GPT, name, value)
    model = fused_model
    assert not train_gpt.head_matches_kernel(model)
    log = LogLines()
    with pytest.raises(train_gpt.UserError) as refusal:
        train_gpt.check_fused_head(model, "true", log)
    message = str(refusal.value)
    assert message.startswith("--fused_head_loss true: ") and "\n" not in message
    assert "--fused_head_loss false" in message and model.fused_head_loss and log == []
    train_gpt.check_fused_head(model, "auto", log)
    assert not model.fused_head_loss and len(log) == 1
    assert log[0].startswith("fused head loss off: ") and "\n" not in log[0]


@needs_triton
def test_a_run_asking_for_the_fused_head_of_a_rewritten_logits_stops_at_start_up(
        monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(GPT, "logits", sigmoid_logits)
    # the smoke preset, narrowed: the model is built before the check
    argv = ["--preset", "smoke", "--num_layers", "6", "--model_dim", "16", "--num_heads", "1",
            "--fused_head_loss", "true", "--log_dir", str(tmp_path)]
    assert train_gpt.main(argv) == 1
    out, err = capsys.readouterr()
    assert err.startswith("error: --fused_head_loss true: GPT.logits or GPT.head_loss ")
    assert err.count("\n") == 1 and "step:" not in out


# --- one edit per option: its facts beside its field ----------------------------------------------

def test_every_option_is_one_line_with_named_rules_and_the_stamp_follows_the_fields():
    """One line per option in the dataclass, its rules named (no lambda in the class), and the
    compile stamp names the options that shape graphs in the order of their fields."""
    tree = ast.parse(inspect.getsource(Hyperparameters))
    body = tree.body[0].body
    options = [node for node in body if isinstance(node, ast.AnnAssign)]
    assert [node.target.id for node in options] == [f.name for f in fields(Hyperparameters)]
    for node in options:
        assert node.lineno == node.end_lineno, f"--{node.target.id}: its field takes more lines"
    assert not any(isinstance(node, ast.Lambda) for node in ast.walk(tree.body[0]))
    stamp = train_gpt.compile_cache_stamp(Hyperparameters(), 1, torch.device("cpu"))
    named = re.findall(r"--(\w+) ", stamp)
    graph = [f.name for f in fields(Hyperparameters) if f.metadata.get("graph")]
    assert named == graph and "vocab_size" in named and "seed" not in named


# the option a fork adds in the tests below, one no trainer has (a fork may have --mlp_ratio)
NEW = "tested_ratio"


def fork_with_one_more_option(monkeypatch, declared):
    """Hyperparameters with one more option, --tested_ratio, added as a fork adds one: one field
    `tested_ratio: int = <declared>`, nothing else."""
    assert NEW not in {f.name for f in fields(Hyperparameters)}
    forked = dataclasses.make_dataclass("Hyperparameters", [(NEW, int, declared)],
                                        bases=(Hyperparameters,))
    monkeypatch.setattr(train_gpt, "Hyperparameters", forked)


def saved_checkpoint(path, args):
    """What load_checkpoint reads of a checkpoint: its options, its train shards, its optimisers'
    states (none here), and the digest of the script that wrote it (this one)."""
    digest = hashlib.sha256(Path(train_gpt.__file__).read_bytes()).hexdigest()
    torch.save(dict(args=dataclasses.asdict(args), train_shards=[], step=4, optimizers=[],
                    source_sha256=digest), path)
    return str(path)


def test_an_option_added_as_one_field_is_checked_fixed_on_resume_and_stamped(
        monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    declared = train_gpt.option(4, train_gpt.AT_LEAST_1, fixed=True, graph=True)
    fork_with_one_more_option(monkeypatch, declared)
    assert train_gpt.main(["--preset", "smoke", f"--{NEW}", "0", "--log_dir", "logs"]) == 1
    assert capsys.readouterr().err == f"error: --{NEW} must be at least 1; got 0\n"
    assert not (tmp_path / "logs").exists()
    path = saved_checkpoint(tmp_path / "state.pt", train_gpt.parse_args(["--preset", "smoke"]))
    with pytest.raises(train_gpt.UserError, match=rf": --{NEW} 4 -> 8 would change the model"):
        train_gpt.load_checkpoint(["--resume", path, f"--{NEW}", "8"], path)
    stamps = [train_gpt.compile_cache_stamp(train_gpt.parse_args([f"--{NEW}", ratio]), 1,
                                            torch.device("cpu")) for ratio in ("4", "8")]
    assert stamps[0].endswith(f", --{NEW} 4") and stamps[1].endswith(f", --{NEW} 8")


def test_an_option_added_as_a_plain_field_is_an_option_with_no_rule(monkeypatch, tmp_path):
    """`tested_ratio: int = 4`, without option(): a command-line option, checked by no rule, which
    a resumed run may change, and no part of the compile stamp."""
    monkeypatch.chdir(tmp_path)
    fork_with_one_more_option(monkeypatch, 4)
    args = train_gpt.parse_args(["--preset", "smoke", f"--{NEW}", "0"])
    train_gpt.check_hyperparameters(args)
    assert getattr(args, NEW) == 0
    path = saved_checkpoint(tmp_path / "state.pt", train_gpt.parse_args(["--preset", "smoke"]))
    resumed, checkpoint = train_gpt.load_checkpoint(["--resume", path, f"--{NEW}", "8"], path)
    assert getattr(resumed, NEW) == 8 and f"--{NEW} 4 -> 8" in checkpoint["note"]
    stamp = train_gpt.compile_cache_stamp(args, 1, torch.device("cpu"))
    assert NEW not in stamp


def other_value(value):
    """A value unlike this one, of its type."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 2
    return value + "_other"


def test_a_resumed_run_refuses_a_change_of_exactly_the_fixed_options(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    args = train_gpt.parse_args(["--preset", "smoke"])
    path = saved_checkpoint(tmp_path / "state.pt", args)
    for f in fields(Hyperparameters):
        if f.name in ("resume", "accept_other_script"):
            continue
        old = getattr(args, f.name)
        new = other_value(old)
        argv = ["--resume", path, f"--{f.name}", str(new)]
        # the seed draws the smoke preset's synthetic train stream
        if f.name == "seed":
            with pytest.raises(train_gpt.UserError) as refusal:
                train_gpt.load_checkpoint(argv, path)
            assert (f": --seed {old} -> {new} (the synthetic train stream) would change the model"
                    in str(refusal.value))
        elif f.metadata["fixed"]:
            with pytest.raises(train_gpt.UserError) as refusal:
                train_gpt.load_checkpoint(argv, path)
            assert f": --{f.name} {old} -> {new} would change the model" in str(refusal.value)
        else:
            resumed, checkpoint = train_gpt.load_checkpoint(argv, path)
            assert getattr(resumed, f.name) == new
            assert f"options changed: --{f.name} {old!r} -> {new!r}" in checkpoint["note"]
