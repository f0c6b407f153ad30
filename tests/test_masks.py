"""The attention masks against masks computed token by token: the FlexAttention block lists (kv side
and q side, partial and full) at many lengths, layouts and windows, the dense CPU mask, and the
compiled mask, which must hold no sort."""
import time

import pytest
import torch
import torch.nn.functional as F
from helpers import inductor_on_the_cpu
from torch._functorch import config as functorch_config
from torch.nn.attention.flex_attention import flex_attention

from train_gpt import BLOCK_SIZE
from train_gpt import EOT
from train_gpt import build_block_mask
from train_gpt import build_dense_mask

SEQ = 4 * BLOCK_SIZE
WINDOWS = range(1, 15)  # 1 to 14 blocks, the trainer's schedule
SORTS = {"sort", "argsort", "msort", "topk", "kthvalue", "median", "nanmedian", "mode", "unique",
         "unique_consecutive", "_unique", "_unique2", "unique_dim"}


def reference_mask(tokens, window_blocks):
    """Literally: q sees k iff k <= q, same document, and fewer than window_blocks blocks apart."""
    docs = []
    doc = 0
    for t in tokens.tolist():
        doc += t == EOT
        docs.append(doc)
    docs = torch.tensor(docs)
    q = torch.arange(len(docs))[:, None]
    k = torch.arange(len(docs))[None, :]
    return (k <= q) & (docs[k] == docs[q]) & (q // BLOCK_SIZE - k // BLOCK_SIZE < window_blocks)


def layout(name, seed=0, length=SEQ):
    """SEQ (or `length`) tokens with documents laid out as `name` in the first SEQ tokens."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50000, (length,), generator=gen)
    starts = {
        # many docs inside one block
        "short_docs": torch.randint(0, SEQ, (20,), generator=gen).tolist(),
        "spanning_docs": [0, 200, 450],  # documents across block boundaries
        "on_block_edges": [0, BLOCK_SIZE, 2 * BLOCK_SIZE, 3 * BLOCK_SIZE + 5],
        "mid_document_start": [300],  # the sequence starts inside a document
        "one_document": [0],
    }[name]
    tokens[starts] = EOT
    return tokens


LAYOUTS = ["short_docs", "spanning_docs", "on_block_edges", "mid_document_start", "one_document"]


def test_block_mask_lists_full_blocks_without_per_token_test():
    tokens = layout("on_block_edges")  # block 0 is all one document, so is block 1
    tokens[[BLOCK_SIZE, 2 * BLOCK_SIZE, 3 * BLOCK_SIZE + 5]] = 1  # now one document throughout
    mask = build_block_mask(tokens, torch.tensor(4, dtype=torch.int32))
    full = mask.full_kv_num_blocks[0, 0].tolist()
    partial = mask.kv_num_blocks[0, 0].tolist()
    assert full == [0, 1, 2, 3]  # every block strictly below the diagonal, in one document
    assert partial == [1, 1, 1, 1]  # the diagonal blocks need the causal test
    assert mask.full_kv_indices[0, 0, 3, :3].tolist() == [0, 1, 2]


def test_window_change_keeps_the_same_mask_shapes():
    # the window lives in the block lists' values, not their shapes: no recompilation when it grows
    tokens = layout("spanning_docs")
    narrow, wide = (build_block_mask(tokens, torch.tensor(w, dtype=torch.int32)) for w in (1, 4))
    for side in ("kv", "full_kv", "q", "full_q"):
        for name in (f"{side}_num_blocks", f"{side}_indices"):
            assert getattr(narrow, name).shape == getattr(wide, name).shape, name
    assert (
        narrow.kv_num_blocks.sum() + narrow.full_kv_num_blocks.sum()
        < wide.kv_num_blocks.sum() + wide.full_kv_num_blocks.sum()
    )


# --- the block lists against block pairs derived from the token pairs, lengths 1,024 to 16,384 ---


def long_layout(name, length, seed=0):
    """`length` tokens with documents laid out as `name` (EOT leads each document)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50000, (length,), generator=gen)

    def anywhere(count):
        return torch.randint(0, length, (count,), generator=gen)

    starts = {
        "one_document": torch.tensor([0]),
        # no EOT at 0: the first document began earlier
        "mid_document_start": torch.tensor([length // 3 + 5]),
        "short_docs": anywhere(length // 30),  # several documents in every block
        "long_docs": anywhere(max(1, length // 2500)),  # documents spanning many blocks
        "on_block_edges": torch.arange(0, length, BLOCK_SIZE * 3),  # documents of exactly 3 blocks
        "every_block_edge": torch.arange(0, length, BLOCK_SIZE),  # one document per block
        # a block's last token
        "on_last_tokens": torch.cat(
            [
                torch.arange(BLOCK_SIZE - 1, length, BLOCK_SIZE * 2),
                # opens a document, the sequence's last too
                torch.tensor([length - 1]),
            ]
        ),
        "mixed": torch.cat(
            [
                anywhere(3),
                torch.randint(0, length // 4, (length // 40,), generator=gen),
                # short ones, then long ones
                torch.arange(length // 2, length, BLOCK_SIZE * 5),
            ]
        ),
        "random": anywhere(int(torch.randint(1, length // 8, (1,), generator=gen))),
    }[name]
    tokens[starts] = EOT
    return tokens


LONG_LAYOUTS = [
    "one_document",
    "mid_document_start",
    "short_docs",
    "long_docs",
    "on_block_edges",
    "every_block_edge",
    "on_last_tokens",
    "mixed",
    "random",
]


def reference_block_pairs(tokens):
    """Per (q-block, kv-block), from the token pairs: whether any / every token pair is causal and
    within one document; and whether both blocks lie entirely in one and the same document. The
    window depends on the blocks only, so it is applied later; pairs more than 14 blocks apart,
    outside every window, are left False."""
    docs = (tokens == EOT).cumsum(0, dtype=torch.int32).view(-1, BLOCK_SIZE)
    pos = torch.arange(len(tokens), dtype=torch.int32).view(-1, BLOCK_SIZE)
    n = len(docs)
    any_allowed = torch.zeros(n, n, dtype=torch.bool)
    all_allowed = torch.zeros(n, n, dtype=torch.bool)
    # q-block = kv-block + distance, every token pair of each
    for distance in range(min(n, max(WINDOWS))):
        q = torch.arange(distance, n)
        kv = torch.arange(n - distance)
        allowed = (
            (pos[kv, None, :] <= pos[q, :, None]) & (docs[kv, None, :] == docs[q, :, None])
        ).flatten(1)
        any_allowed[q, kv], all_allowed[q, kv] = allowed.any(1), allowed.all(1)
    one_doc = docs.min(1).values == docs.max(1).values
    same_doc = one_doc[:, None] & one_doc[None, :] & (docs[:, None, 0] == docs[None, :, 0])
    return any_allowed, all_allowed, same_doc


def reference_lists(pairs, window):
    """Expected (partial-not-full, full) block sets as (q-block, kv-block) boolean matrices."""
    assert window <= max(WINDOWS)
    any_allowed, all_allowed, same_doc = pairs
    n = len(any_allowed)
    q = torch.arange(n)[:, None]
    kv = torch.arange(n)[None, :]
    in_window = q - kv < window
    partial = any_allowed & in_window  # some token pair allowed
    full = (q > kv) & in_window & same_doc
    assert not (full & ~all_allowed).any()  # so a full block needs no per-token test
    return partial & ~full, full


def listed(counts, indices):
    """How many times each column appears among a row's first `count` entries, as an (n, n)
    matrix."""
    n = indices.shape[-1]
    assert counts.shape == (1, 1, n) and indices.shape == (1, 1, n, n)
    assert counts.dtype == indices.dtype == torch.int32 and indices.is_contiguous()
    assert ((indices >= 0) & (indices < n)).all()  # even past a row's count
    counts = counts[0, 0].long()
    indices = indices[0, 0].long()
    present = torch.arange(n)[None, :] < counts[:, None]
    rows = torch.arange(n)[:, None].expand(n, n)
    times = torch.zeros(n, n, dtype=torch.long)
    return times.index_put_(
        (rows[present], indices[present]),
        torch.ones(int(present.sum()), dtype=torch.long),
        accumulate=True,
    )


def assert_lists_match(mask, pairs, window, context):
    partial, full = reference_lists(pairs, window)
    n = len(partial)
    assert mask.seq_lengths == (n * BLOCK_SIZE, n * BLOCK_SIZE) and mask.BLOCK_SIZE == (
        BLOCK_SIZE,
        BLOCK_SIZE,
    )
    for side, expected_partial, expected_full in (("kv", partial, full), ("q", partial.T, full.T)):
        got_partial = listed(getattr(mask, f"{side}_num_blocks"), getattr(mask, f"{side}_indices"))
        got_full = listed(
            getattr(mask, f"full_{side}_num_blocks"), getattr(mask, f"full_{side}_indices")
        )
        assert torch.equal(got_partial, expected_partial.long()), (
            f"{side}-side partial blocks, {context}"
        )
        assert torch.equal(got_full, expected_full.long()), f"{side}-side full blocks, {context}"


@pytest.mark.parametrize(
    "length",
    [
        1024,
        *(pytest.param(length, marks=pytest.mark.slow) for length in (2048, 3072, 4096, 8192,
                                                                      16384)),
    ],
)
def test_block_lists_equal_the_token_level_blocks(length):
    for name in LONG_LAYOUTS:
        # a second placement of the random layouts at the two shortest lengths
        for seed in range(2 if length <= 2048 else 1):
            tokens = long_layout(name, length, seed)
            pairs = reference_block_pairs(tokens)
            for window in WINDOWS:
                mask = build_block_mask(tokens, torch.tensor(window, dtype=torch.int32))
                assert_lists_match(mask, pairs, window, f"{name}, seed {seed}, window {window}")


def op_names(graph_module):
    """Base names of the ops a graph calls: `sort` for aten.sort.stable, `argsort` for
    torch.argsort."""
    names = set()
    for node in graph_module.graph.nodes:
        if node.op == "call_method":
            names.add(node.target)
        elif node.op == "call_function":
            target = node.target
            names.add(
                target._opname
                if isinstance(target, torch._ops.OpOverload)
                else getattr(target, "__name__", "")
            )
    return names


def test_the_documented_example_of_the_block_lists():
    # dense_to_ordered's docstring: five blocks, a window of 3; document 2 starts inside block 3. Read the
    # full and partial blocks of each row off the token-level mask, then compare with the lists and
    # the text.
    tokens = torch.full((5 * BLOCK_SIZE,), 7)
    tokens[[0, 3 * BLOCK_SIZE + 50]] = EOT
    reference = reference_mask(tokens, 3)
    mask = build_block_mask(tokens, torch.tensor(3, dtype=torch.int32))
    documented = {2: ([0, 1], [2]), 3: ([], [1, 2, 3]), 4: ([], [3, 4])}
    for row, (full, partial) in documented.items():
        blocks = reference[row * BLOCK_SIZE : (row + 1) * BLOCK_SIZE].view(
            BLOCK_SIZE, 5, BLOCK_SIZE
        )
        seen = [k for k in range(5) if blocks[:, k].any()]
        whole = [k for k in seen if blocks[:, k].all()]
        assert (whole, sorted(set(seen) - set(whole))) == (full, partial)
        full_count = int(mask.full_kv_num_blocks[0, 0, row])
        partial_count = int(mask.kv_num_blocks[0, 0, row])
        assert sorted(mask.full_kv_indices[0, 0, row, :full_count].tolist()) == full
        assert sorted(mask.kv_indices[0, 0, row, :partial_count].tolist()) == partial


# --- mask and attention compiled once, as on the GPU, for every layout and window ---------------

# 16 blocks: windows of 1 to 14 blocks all differ
COMPILED_LENGTH = 16 * BLOCK_SIZE


class RecordingInductor:
    """Inductor as torch.compile's backend, counting the frames it compiles and keeping each graph
    it is given: the one dynamo traced, and the one inductor lowers (after decompositions)."""

    def __init__(self):
        self.frames = 0
        self.graphs = []

    def __call__(self, graph_module, example_inputs):
        self.frames += 1
        self.graphs.append(graph_module)
        # imported here: inductor's compiler is seconds of every session's collection otherwise
        from torch._inductor.compile_fx import compile_fx
        return compile_fx(graph_module, example_inputs, inner_compile=self.lower)

    def lower(self, graph_module, example_inputs, *args, **kwargs):
        from torch._inductor.compile_fx import compile_fx_inner
        self.graphs.append(graph_module)
        return compile_fx_inner(graph_module, example_inputs, *args, **kwargs)


def attend(tokens, q, k, v, window_blocks, eager_mask):
    """As the model attends on the GPU: with the mask built inside the compiled region from the
    window tensor, and with a mask built outside it (regional compilation builds it eagerly, then
    calls the compiled blocks). Eager flex_attention evaluates mask_mod on every pair and ignores
    the block lists (so the window would vanish); the compiled kernel honours them."""
    block_mask = build_block_mask(tokens, window_blocks)
    attention = flex_attention(q, k, v, block_mask=block_mask)
    return attention, flex_attention(q, k, v, block_mask=eager_mask), block_mask


def random_qkv(length):
    """Two heads (the mask's one head broadcast to both) of dimension 16: the kernel's work per call
    is most of a layout's time, and the dimension is not what is checked."""
    return [
        torch.randn(1, 2, length, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)
    ]


@pytest.fixture(scope="module")
def compiled_attention():
    """attend() compiled once, with the FX graph and AOT caches off (a cached graph would not be
    lowered again), but inductor's kernel cache on, so that its C++ kernels, already built or built
    now, are shared with later runs; every test below reuses it. Gives the compiled function and its
    backend."""
    backend = RecordingInductor()
    compiled = torch.compile(attend, backend=backend, dynamic=False)
    # as the trainer feeds them
    tokens = long_layout("mixed", COMPILED_LENGTH, seed=5).to(torch.int32)
    window_blocks = torch.tensor(1, dtype=torch.int32)
    eager_mask = build_block_mask(tokens, window_blocks)
    started = time.perf_counter()
    uncached = {"fx_graph_cache": False, "fx_graph_remote_cache": False}
    with inductor_on_the_cpu(**uncached), functorch_config.patch(enable_autograd_cache=False):
        compiled(tokens, *random_qkv(COMPILED_LENGTH), window_blocks, eager_mask)
    print(f"compiled mask and attention in {time.perf_counter() - started:.1f} s")
    return compiled, backend


@pytest.mark.slow
def test_compiled_mask_and_attention_hold_no_sort(compiled_attention):
    """A sort in the compiled graph can take forever to compile (a known PyTorch problem): none may
    be in the traced graph nor in the graph inductor lowers."""
    _, backend = compiled_attention
    # one traced graph, lowered once
    assert backend.frames == 1 and len(backend.graphs) == 2
    for graph in backend.graphs:
        # the names are read
        assert "cumsum" in op_names(graph)
        assert not op_names(graph) & SORTS, f"sort in the compiled mask: {op_names(graph) & SORTS}"


# the long layouts but two that repeat short ones: one_document makes the very mask of the short one
# (an EOT at 0 alone), mid_document_start the same case (one EOT after the start: in block 5, the
# short one's in block 2)
COMPILED_LONG_LAYOUTS = [name for name in LONG_LAYOUTS
                         if name not in ("one_document", "mid_document_start")]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,long",
    [(name, False) for name in LAYOUTS] + [(name, True) for name in COMPILED_LONG_LAYOUTS],
    ids=[*LAYOUTS, *(f"long_{name}" for name in COMPILED_LONG_LAYOUTS)],
)
def test_compiled_mask_and_attention_match_the_token_by_token_definition_in_one_compile(
    compiled_attention, name, long
):
    """For every window, compiled in place (no recompilation as the window grows, nor for another
    layout): the block lists against the token-level blocks; for the short layouts' documents and
    the long mixed ones, the dense CPU mask against the token-by-token mask and attention through
    the block mask (built inside the compiled region, and outside it) against dense attention, with
    windows of 1 to 4 blocks and 14."""
    compiled, backend = compiled_attention
    if long:
        tokens = long_layout(name, COMPILED_LENGTH, seed=1)
    else:
        tokens = layout(name, length=COMPILED_LENGTH)
    tokens = tokens.to(torch.int32)
    q, k, v = random_qkv(COMPILED_LENGTH)
    pairs = reference_block_pairs(tokens)
    window_blocks = torch.tensor(1, dtype=torch.int32)
    for window in WINDOWS:
        window_blocks.fill_(window)
        eager_mask = build_block_mask(tokens, window_blocks)
        attention, with_eager_mask, mask = compiled(tokens, q, k, v, window_blocks, eager_mask)
        assert_lists_match(mask, pairs, window, f"compiled, window {window}")
        if window in (1, 2, 3, 4, 14) and (not long or name == "mixed"):
            expected_mask = reference_mask(tokens, window)
            dense = build_dense_mask(tokens, window_blocks)
            # above the diagonal: a query's later keys
            assert not dense.triu(1).any(), f"attention sees a later token, window {window}"
            assert torch.equal(dense, expected_mask), f"dense mask differs, window {window}"
            expected = F.scaled_dot_product_attention(q, k, v, attn_mask=expected_mask)
            torch.testing.assert_close(attention, expected, rtol=1e-5, atol=1e-5,
                                       msg=f"window {window}")
            torch.testing.assert_close(with_eager_mask, expected, rtol=1e-5, atol=1e-5,
                                       msg=f"mask built outside, window {window}")
    assert backend.frames == 1


def test_inside_a_compiled_region_mask_mod_is_record_18s_document_causal_test(monkeypatch):
    """Built as the compiled model builds it, the mask's per-token test is record 18's (causal, one
    document): the window is the block lists' alone, which the compiled tests above check against
    the dense mask. Built outside, it holds the window too, as uncompiled FlexAttention needs."""
    tokens = layout("one_document", length=4 * BLOCK_SIZE)
    window_blocks = torch.tensor(1, dtype=torch.int32)
    # same document, causal, three blocks apart: outside a window of one block
    q, k = torch.tensor(3 * BLOCK_SIZE + 5), torch.tensor(7)
    outside = build_block_mask(tokens, window_blocks)
    assert not outside.mask_mod(0, 0, q, k) and outside.mask_mod(0, 0, k, k)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    inside = build_block_mask(tokens, window_blocks)
    assert inside.mask_mod(0, 0, q, k) and not inside.mask_mod(0, 0, k, q)
    # the lists are the same: only the per-token test differs
    lists = [(a, b) for a, b in zip(inside.as_tuple(), outside.as_tuple()) if torch.is_tensor(a)]
    assert len(lists) == 8 and all(torch.equal(a, b) for a, b in lists)
