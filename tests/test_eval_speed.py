"""Evaluation at the hardware's speed: HellaSwag in fixed-length sequences (the shape a GPU compiles
once) against each candidate scored alone in float64, and sampling through the model's KV cache
against greedy full forwards of a trained smoke checkpoint, its cost per token, and --num_samples.

    python -m pytest tests/test_eval_speed.py            # the slow test trains the smoke preset

On a CPU the HellaSwag function runs uncompiled: these tests check its padding and fixed length,
and that on CUDA it is the compiled one, not the compiled kernel itself (a GPU's). Checkpoints are
built by the trainer under test (--trainer FILE of pytest)."""
import copy
import functools
import math
import random

import helpers
import numpy as np
import pytest
import tiktoken
import torch
import torch.nn.functional as F
from helpers import TRAINER
from torch.utils.flop_counter import FlopCounterMode

import train_gpt
from evals import common
from evals import hellaswag
from evals import sample

EOT = train_gpt.EOT
# one token per byte (ids 0-255), and 50256
BYTE_TOKENS = tiktoken.Encoding("byte_tokens", pat_str=r"[\s\S]",
                                special_tokens={"<|endoftext|>": EOT},
                                mergeable_ranks={bytes([i]): i for i in range(256)})
GPT2_IDS = 50257
# no window: wider than any document here
UNLIMITED = torch.tensor(1000, dtype=torch.int32)


@functools.cache
def small_model(seed):
    """6 blocks of width 8 (one head), every matrix random, bf16 tables as trained; made once per
    seed. A forward is mostly the 50,304-wide head, whose cost grows with the width."""
    torch.manual_seed(seed)
    model = train_gpt.GPT(50304, 6, 1, 8)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 1).mul_(p.size(1) ** -0.5)
    return model.eval()


def hellaswag_like(seed, count):
    """count examples of a context and 4 endings, random letters, a random label."""
    rng = random.Random(seed)

    def letters(low, high):
        return "".join(rng.choice("abcdefgh ,.") for _ in range(rng.randint(low, high)))
    return [(letters(10, 80), [letters(2, 40) for _ in range(4)], rng.randrange(4))
            for _ in range(count)]


@torch.no_grad()
def alone_in_float64(model, document, ending_start):
    """The summed loss over the ending, from a float64 forward over the document by itself."""
    tokens = torch.tensor(document)
    logits = model(tokens.int(), None, UNLIMITED)
    targets = tokens[ending_start:]
    return F.cross_entropy(logits[ending_start - 1:-1].double(), targets, reduction="sum").item()


@pytest.mark.slow
def test_fixed_length_hellaswag_matches_each_candidate_scored_alone_in_float64(monkeypatch):
    model = small_model(0)
    # 12 candidates of up to 102 tokens: 7 sequences of 128
    examples = hellaswag_like(seed=1, count=3)
    rendered = hellaswag.render(examples, BYTE_TOKENS)
    labels = [label for _, _, label in examples]
    shapes = []
    scorer = hellaswag.loss_per_token

    def recording(model, device):
        losses = scorer(model, device)

        def recorded(tokens, targets, window):
            shapes.append((tuple(tokens.shape), tuple(targets.shape)))
            return losses(tokens, targets, window)
        return recorded
    monkeypatch.setattr(hellaswag, "loss_per_token", recording)
    # 128 tokens a forward: several sequences, the last one mostly padding
    acc_norm, acc, n, details = hellaswag.evaluate(model, rendered, labels, torch.device("cpu"),
                                                   sequence_length=128)
    assert len(shapes) > 2 and set(shapes) == {((128,), (128,))}
    assert f"in {len(shapes)} sequences of up to 128)" in details
    # the reference: each candidate alone, the same weights in float64, no padding, no packing
    in_float64 = copy.deepcopy(model).double()
    by_mean = 0
    by_sum = 0
    for (context, endings, label), candidates in zip(examples, rendered):
        sums = np.array([alone_in_float64(in_float64, *candidate) for candidate in candidates])
        lengths = np.array([len(BYTE_TOKENS.encode_ordinary(" " + e)) for e in endings])
        by_mean += int(np.argmin(sums / lengths)) == label
        by_sum += int(np.argmin(sums)) == label
        if context == examples[0][0]:
            # and the sums themselves, before any argmin
            packed, _, _, _ = hellaswag.score(model, candidates, torch.device("cpu"), 128)
            torch.testing.assert_close(packed, torch.from_numpy(sums), rtol=1e-6, atol=0)
    assert (n, acc_norm, acc) == (3, by_mean / 3, by_sum / 3)


@pytest.mark.slow
def test_hellaswag_forward_is_compiled_on_cuda_and_plain_on_a_cpu():
    model = small_model(0)
    # torch.compile wraps lazily: nothing runs here, so no GPU is needed to see the choice
    on_gpu = hellaswag.loss_per_token(model, torch.device("cuda"))
    on_cpu = hellaswag.loss_per_token(model, torch.device("cpu"))
    assert hasattr(on_gpu, "_torchdynamo_orig_callable")
    assert not hasattr(on_cpu, "_torchdynamo_orig_callable")


# --- sampling -------------------------------------------------------------------------------------

@pytest.fixture
def smoke_checkpoint(smoke_runs):
    """The checkpoint of the session's short smoke run (made once, shared with other tests:
    4 steps of the smoke preset on the Markov shards)."""
    log = smoke_runs.short(1)
    (path,) = log.parent.glob(f"{log.stem}/state_step000004.pt")
    return path


@torch.no_grad()
def greedy_by_full_forwards(model, tokens, count):
    """count greedy tokens, each from a forward over the whole document so far, unpadded."""
    tokens = list(tokens)
    for _ in range(count):
        logits = model(torch.tensor(tokens, dtype=torch.int32), None, UNLIMITED)
        tokens.append(int(logits[-1, :GPT2_IDS].argmax()))
    return tokens


@torch.no_grad()
def argmax_rows_of_a_full_forward(model, document, first):
    """The greedy choice (over GPT-2's ids) at each position from `first` on, read from one
    forward over the whole document, unpadded, no cache, no window: by causality its row i is the
    last row of a forward over the document's first i + 1 tokens alone, so greedy by full forwards
    chose the document's tokens exactly when each equals the choice at the position before it."""
    logits = model(torch.tensor(document, dtype=torch.int32), None, UNLIMITED)
    return logits[first:-1, :GPT2_IDS].argmax(-1).tolist()


@pytest.mark.slow
def test_cached_greedy_text_equals_full_forwards_on_a_trained_checkpoint(smoke_checkpoint):
    trainer, checkpoint, _ = common.open_checkpoint(smoke_checkpoint, str(TRAINER))
    model, _ = common.build_model(trainer, checkpoint, smoke_checkpoint, torch.device("cpu"))
    # in fp32, the numerics the sampler runs in (it would make this copy itself), and so the
    # reference: bf16's rounding could flip a tie
    model.float()
    stream = train_gpt.markov_stream(4000, seed=5).tolist()
    # (prompt, new tokens): short and long prompts, up to 4 blocks; the third crosses a block's
    # edge as it generates (121 to 137 tokens); the last two hold the end of a document and the
    # start of the next (EOT). The chain's next token barely depends on the document
    # before: the test below checks the cache's mask on the logits themselves
    prompts = [(stream[1:1], 12), (stream[1:6], 12), (stream[300:420], 16), (stream[10:500], 21)]
    assert [prompt.count(EOT) > 0 for prompt, _ in prompts] == [False, False, True, True]
    for prompt, new in prompts:
        # as sample.py does: a window of the whole document
        window_blocks = math.ceil((1 + len(prompt) + new) / train_gpt.BLOCK_SIZE)
        generated = sample.generate(model, prompt, new, window_blocks, GPT2_IDS)
        assert generated[:len(prompt)] == prompt and len(generated) == len(prompt) + new
        # the row of the prompt's last token (EOT first) chooses the first new token
        chosen = argmax_rows_of_a_full_forward(model, [EOT, *generated], len(prompt))
        assert generated[len(prompt):] == chosen
    assert 1 + len(prompts[-1][0]) + prompts[-1][1] == 4 * train_gpt.BLOCK_SIZE


@pytest.mark.slow
def test_cached_logits_equal_full_forward_rows_across_documents_and_the_window():
    model = small_model(5).float()
    # three documents; a window of 1 block, which cuts the last (240 to 299) at 256
    tokens = torch.randint(0, 256, (300,), dtype=torch.int32)
    tokens[[0, 90, 240]] = EOT
    window = torch.tensor(1, dtype=torch.int32)
    cache = train_gpt.KVCache(2, 300, torch.device("cpu"))
    with torch.no_grad():
        full = model(tokens, None, window)
        # a batch of 2 equal sequences: 230 tokens at once (two documents), then one at a time,
        # across the third document's start and the window's edge
        rows = [model(tokens[None, :230].expand(2, -1), None, window, cache)]
        for position in range(230, 300):
            rows.append(model(tokens[None, position:position + 1].expand(2, -1), None, window,
                              cache))
    cached = torch.stack(rows, 1)
    assert cached.shape == (2, 71, 50304)
    torch.testing.assert_close(cached, full[None, 229:].expand(2, -1, -1), rtol=1e-5, atol=1e-5)


def test_a_new_token_costs_one_tokens_forward_however_long_the_document():
    model = small_model(2).float()

    def decode_flops(length):
        """Multiply-adds of the forward that adds one token to a cached document of length."""
        cache = train_gpt.KVCache(1, length + 1, torch.device("cpu"))
        document = torch.randint(0, 256, (1, length), dtype=torch.int32)
        with torch.no_grad():
            model(document, None, UNLIMITED, cache)
            with FlopCounterMode(display=False) as counter:
                model(document[:, -1:], None, UNLIMITED, cache)
        return counter.get_total_flops()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.randint(0, 256, (512,), dtype=torch.int32), None, UNLIMITED)
    full_forward = counter.get_total_flops()
    short = decode_flops(8)
    long = decode_flops(500)
    # the matrices' work is one token's; only attention's reads of the cache grow
    assert long < 1.1 * short and long < full_forward / 400


@pytest.mark.slow
def test_samples_drawn_in_one_batch_are_seeded_and_greedy_ones_equal():
    model = small_model(3).float()
    prompt = [10, 20, 30]

    def draw(seed, **options):
        generator = torch.Generator().manual_seed(seed)
        return sample.generate_batch(model, prompt, 4, 1, GPT2_IDS, generator=generator,
                                     **options)
    greedy = draw(0, num_samples=3)
    single = sample.generate(model, prompt, 4, 1, GPT2_IDS)
    assert greedy == [single] * 3
    assert single == greedy_by_full_forwards(model, [EOT, *prompt], 4)[1:]
    hot = draw(0, num_samples=4, temperature=3.0)
    assert hot == draw(0, num_samples=4, temperature=3.0) and hot != draw(1, num_samples=4,
                                                                          temperature=3.0)
    assert all(t[:3] == prompt and max(t) < GPT2_IDS for t in hot) and len(set(map(tuple, hot))) > 1
    assert draw(5, num_samples=2, temperature=3.0, top_k=1) == [single] * 2


RANKS = helpers.RANKS


@helpers.needs_ranks
def test_sample_cli_prints_each_of_num_samples(tmp_path, capsys):
    options = train_gpt.Hyperparameters(num_layers=6, num_heads=1, model_dim=8)
    path = tmp_path / "state.pt"
    torch.save(dict(step=1, model=small_model(4).state_dict(), args=vars(options),
                    source=TRAINER.read_bytes()), path)
    command = [str(path), "--prompt", "Hi", "--max_new_tokens", "3", "--tokenizer", str(RANKS),
               "--trainer", str(TRAINER)]
    assert sample.main([*command, "--num_samples", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0::2] == [f"--- sample {i} of 3" for i in (1, 2, 3)]
    # greedy: three equal texts, each the prompt and its continuation
    assert len(set(lines[1::2])) == 1 and lines[1].startswith("Hi")
    # one error line, as for every option
    assert sample.main([*command, "--num_samples", "0"]) == 1
    assert "--num_samples must be at least 1" in capsys.readouterr().err
