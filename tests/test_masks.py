"""The block mask (FlexAttention) and the dense CPU mask against a mask built token by token."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from train_gpt import BLOCK_SIZE, EOT, build_block_mask, build_dense_mask

SEQ = 4 * BLOCK_SIZE


def reference_mask(tokens, window_blocks):
    """SPEC 6, literally: q sees k iff k <= q, same document, and fewer than window_blocks blocks apart."""
    docs, doc = [], 0
    for t in tokens.tolist():
        doc += t == EOT
        docs.append(doc)
    n = len(docs)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for q in range(n):
        for k in range(q + 1):
            mask[q, k] = docs[k] == docs[q] and q // BLOCK_SIZE - k // BLOCK_SIZE < window_blocks
    return mask


def layout(name, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50000, (SEQ,), generator=gen)
    starts = {
        "short_docs": torch.randint(0, SEQ, (20,), generator=gen).tolist(),  # many docs inside one block
        "spanning_docs": [0, 200, 450],  # documents across block boundaries
        "on_block_edges": [0, BLOCK_SIZE, 2 * BLOCK_SIZE, 3 * BLOCK_SIZE + 5],
        "mid_document_start": [300],  # the sequence starts inside a document
        "one_document": [0],
    }[name]
    tokens[starts] = EOT
    return tokens


LAYOUTS = ["short_docs", "spanning_docs", "on_block_edges", "mid_document_start", "one_document"]


@pytest.fixture(scope="module")
def compiled_flex():
    # eager flex_attention evaluates mask_mod on every pair and ignores the block lists (so the window
    # would vanish); the compiled kernel honours them, as on the GPU
    return torch.compile(flex_attention, dynamic=False)


@pytest.mark.parametrize("name", LAYOUTS)
def test_block_mask_and_dense_mask_match_token_by_token_definition(name, compiled_flex):
    tokens = layout(name)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, SEQ, 32, generator=gen) for _ in range(3))
    for window in (1, 2, 3, 4):
        window_blocks = torch.tensor(window, dtype=torch.int32)
        expected_mask = reference_mask(tokens, window)
        dense = build_dense_mask(tokens, window_blocks)
        assert torch.equal(dense, expected_mask), f"dense mask differs, window {window}"
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=expected_mask)
        flex = compiled_flex(q, k, v, block_mask=build_block_mask(tokens, window_blocks))
        torch.testing.assert_close(flex, expected, rtol=1e-5, atol=1e-5, msg=f"window {window}")


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
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert getattr(narrow, name).shape == getattr(wide, name).shape, name
    assert narrow.kv_num_blocks.sum() + narrow.full_kv_num_blocks.sum() < wide.kv_num_blocks.sum() + wide.full_kv_num_blocks.sum()


def test_growing_window_does_not_recompile_mask_and_attention():
    # as on the GPU: the mask is built inside the compiled region from the window tensor
    from torch._dynamo.testing import CompileCounterWithBackend

    def attend(tokens, q, k, v, window_blocks):
        return flex_attention(q, k, v, block_mask=build_block_mask(tokens, window_blocks))

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(attend, backend=counter, dynamic=False)
    tokens = layout("short_docs", seed=3)
    q, k, v = (torch.randn(1, 2, SEQ, 32, generator=torch.Generator().manual_seed(i)) for i in range(3))
    window_blocks = torch.tensor(1, dtype=torch.int32)
    for window in (1, 2, 3, 4):
        window_blocks.fill_(window)
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=reference_mask(tokens, window))
        torch.testing.assert_close(compiled(tokens, q, k, v, window_blocks), expected, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1
