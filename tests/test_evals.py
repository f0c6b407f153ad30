"""evals/: HellaSwag's packed scorer against each candidate scored alone in float64, greedy sampling
against the argmax of full forwards, the download against a stand-in server on 127.0.0.1, a real
smoke run's checkpoint, 2 processes, the trainer's --hellaswag, and the one-line errors. Tokenizers
of our own stand in for GPT-2's: only the run as users make it needs GPT-2's ranks file. The
checkpoints carry the trainer under test, which the tools are given as --trainer FILE."""
import copy
import functools
import http.server
import json
import random
import re
import threading
from dataclasses import asdict
from types import SimpleNamespace

import helpers
import pytest
import tiktoken
import torch
from helpers import REPO
from helpers import TRAINER
from helpers import finished_log
from helpers import launch_env
from helpers import ranks_of
from helpers import run_process
from helpers import torchrun

import train_gpt
from evals import common
from evals import hellaswag
from evals import sample

RANKS = helpers.RANKS
needs_ranks = helpers.needs_ranks
CPU = torch.device("cpu")
# the trainer under test, as the tools are given it
WITH_TRAINER = ["--trainer", str(TRAINER)]
EOT = train_gpt.EOT
END_OF_TEXT = {"<|endoftext|>": EOT}
# a token per byte (ids 0-255), and 50256
BYTES = tiktoken.Encoding("bytes", pat_str=r"[\s\S]", special_tokens=END_OF_TEXT,
                          mergeable_ranks={bytes([i]): i for i in range(256)})
# GPT-2's 50,257 ids, every one of which decodes (a model may draw any): bytes, byte pairs, 50256
PAIRS_LIST = [[b] for b in range(256)] + [[a, b] for a in range(196) for b in range(256)]
PAIRS = tiktoken.Encoding("pairs", pat_str=r"[\s\S]+", special_tokens=END_OF_TEXT,
                          mergeable_ranks={bytes(p): i for i, p in enumerate(PAIRS_LIST[:EOT])})


@functools.cache
def random_model(seed):
    """6 blocks of width 8 (one head) in fp32, every matrix random (the head and the projections
    start at zero); made once per seed (the 50,304-row tables take a while)."""
    torch.manual_seed(seed)
    model = train_gpt.GPT(50304, 6, 1, 8, bf16_embeds=False)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, p.size(1) ** -0.5)
    return model.eval()


def tiny_model(dtype=torch.float64, seed=0):
    """A copy of random_model(seed), in dtype: the same weights in fp32 and in float64."""
    return copy.deepcopy(random_model(seed)).to(dtype)


def write_checkpoint(path, model):
    """The entries of the trainer's checkpoints that the tools read: the weights, the options and
    the trainer's source; saved at the end of the run."""
    options = train_gpt.Hyperparameters(num_layers=6, num_heads=1, model_dim=8, bf16_embeds=False)
    torch.save(dict(step=options.num_iterations, model=model.state_dict(), args=asdict(options),
                    source=TRAINER.read_bytes()), path)
    return path


def load_model(path):
    """The checkpoint's model as the tools build it, with the trainer under test, on the CPU."""
    trainer, checkpoint, _ = common.open_checkpoint(path, str(TRAINER))
    return common.build_model(trainer, checkpoint, path, CPU)[0]


def text(rng, low, high):
    return "".join(rng.choice("abcdefghij klm,.") for _ in range(rng.randint(low, high)))


def random_examples(seed, count, long_every=0):
    """HellaSwag-shaped examples; every long_every-th with a context of 150 to 200 characters."""
    rng = random.Random(seed)
    examples = []
    for i in range(count):
        context = text(rng, 150, 200) if long_every and i % long_every == 0 else text(rng, 5, 60)
        examples.append((context, [text(rng, 1, 30) for _ in range(4)], rng.randrange(4)))
    return examples


def write_jsonl(path, examples):
    lines = [json.dumps(dict(ctx=c, endings=e, label=label)) + "\n" for c, e, label in examples]
    path.write_text("".join(lines))
    return path


@torch.no_grad()
def score_alone(model, candidate):
    """The loss over the ending, from a forward over the candidate alone: unpadded, no window."""
    tokens, start = candidate
    x = torch.tensor(tokens)
    logits = model(x.int(), None, torch.tensor(10 ** 6, dtype=torch.int32)).double()
    return -logits.log_softmax(-1)[torch.arange(start - 1, len(x) - 1), x[start:]].sum().item()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """tiny_model(torch.float32), saved as the trainer saves it."""
    return write_checkpoint(tmp_path_factory.mktemp("tiny") / "state.pt", tiny_model(torch.float32))


def reference_counts(model, examples, tokenizer):
    """(by mean, by sum) from each candidate scored alone, in float64."""
    rendered = hellaswag.render(examples, tokenizer)
    candidates = [c for example in rendered for c in example]
    sums = torch.tensor([score_alone(model, c) for c in candidates], dtype=torch.float64)
    counts = torch.tensor([len(tokens) - start for tokens, start in candidates])
    labels = [label for *_, label in examples]
    return hellaswag.correct_counts(rendered, labels, sums, counts)


# --- HellaSwag: the scorer ------------------------------------------------------------------------

def test_packing_puts_documents_end_to_end_and_none_across_a_sequence_end():
    # 124 at 260 ends the sequence of 384 exactly; 130 after it would not fit: the next sequence
    places = [(0, 0), (0, 100), (0, 200), (0, 260), (1, 0), (2, 0)]
    assert hellaswag.pack([100, 100, 60, 124, 130, 384], 384) == places


@pytest.mark.slow
def test_packed_scores_equal_each_candidate_scored_alone_in_float64():
    examples = random_examples(seed=29, count=3, long_every=3)
    rendered = hellaswag.render(examples, BYTES)
    candidates = [c for example in rendered for c in example]
    model = tiny_model(torch.float32)
    # bf16 tables, as trained (so bf16 activations, which the scorer casts to fp32)
    for table in [model.embed, *model.value_embeds.embed]:
        table.bfloat16()
    in_float64 = copy.deepcopy(model).double()
    # candidates of up to 216 tokens, across blocks of 128, in sequences of 512
    sums, counts, sequences, tokens = hellaswag.score(model, candidates, CPU, 512)
    assert model.embed.weight.dtype == torch.bfloat16  # the model given is left as it was
    lengths = [len(t) for t, _ in candidates]
    assert sequences > 1 and max(lengths) > 128
    assert tokens == sum(lengths) and counts.tolist() == [len(t) - s for t, s in candidates]
    reference = torch.tensor([score_alone(in_float64, c) for c in candidates], dtype=torch.float64)
    # the same weights in float64 (whose attention and rotary still run in fp32): 1.2e-7 measured
    torch.testing.assert_close(sums, reference, rtol=1e-6, atol=0)
    # labels: the lowest mean, so acc_norm is 1 and acc the share where the lowest sum agrees
    means = (reference / counts).view(-1, 4)
    labels = means.argmin(1).tolist()
    by_sum = (reference.view(-1, 4).argmin(1) == means.argmin(1)).sum().item()
    assert by_sum < len(labels)
    assert hellaswag.correct_counts(rendered, labels, sums, counts) == (len(labels), by_sum)


def test_logits_are_what_the_loss_is_computed_from():
    torch.manual_seed(0)
    # bf16 embeddings, as trained
    model = train_gpt.GPT(50304, 6, 1, 8)
    with torch.no_grad():
        model.lm_head.weight.normal_()
    x = torch.randint(0, 50257, (129,))
    window = torch.tensor(1, dtype=torch.int32)
    with torch.no_grad():
        logits = model(x[:-1].int(), None, window)
        loss = model(x[:-1].int(), x[1:], window)
    assert logits.shape == (128, 50304) and logits.dtype == torch.float32
    assert logits.abs().max() <= 15
    assert torch.nn.functional.cross_entropy(logits, x[1:]) == loss


# --- sampling -------------------------------------------------------------------------------------

def test_greedy_continuation_is_the_argmax_of_full_forwards_over_the_tokenizer_ids():
    model = tiny_model(torch.float32)
    with torch.no_grad():
        # rows that only pad the head: likelier, and never to be drawn
        model.lm_head.weight[50257:] *= 3
    prompt = BYTES.encode_ordinary(text(random.Random(2), 124, 124))
    # from 125 tokens to 131: across a block boundary
    generated = sample.generate(model, prompt, 6, 2, BYTES.n_vocab)
    assert generated[:124] == prompt and len(generated) == 130
    # one full forward over the text, no cache: by causality its row i is the last row of a
    # forward over the first i + 1 tokens alone, so greedy by full forwards chose the new tokens
    # exactly when each is the argmax of the row before it (the last prompt token's first)
    window = torch.tensor(2, dtype=torch.int32)
    with torch.no_grad():
        logits = model(torch.tensor([EOT, *generated[:-1]]).int(), None, window)[124:]
    # a padding row is the likeliest at some step, and never drawn
    assert (logits.argmax(-1) >= 50257).any()
    assert generated[124:] == logits[:, :50257].argmax(-1).tolist()


def test_sampling_draws_tokenizer_ids_reproducibly_and_top_k_1_is_greedy():
    model = tiny_model(torch.float32)
    with torch.no_grad():
        model.lm_head.weight[50257:] *= 3
    prompt = BYTES.encode_ordinary("abc")

    def draw(seed, **options):
        generator = torch.Generator().manual_seed(seed)
        return sample.generate(model, prompt, 3, 1, BYTES.n_vocab, generator=generator, **options)
    hot = draw(0, temperature=5.0)
    assert max(hot) < 50257 and hot == draw(0, temperature=5.0) and hot != draw(1, temperature=5.0)
    assert draw(3, temperature=5.0, top_k=1) == sample.generate(model, prompt, 3, 1, BYTES.n_vocab)


# --- the tools, as users call them ----------------------------------------------------------------

@pytest.fixture
def own_tokenizer(monkeypatch):
    """The tools' tokenizer replaced by ours: no ranks file needed."""
    monkeypatch.setattr(common.gpt2_tokenizer, "gpt2_encoding", lambda tokenizer_file=None: PAIRS)


def test_hellaswag_cli_prints_the_scores_last(checkpoint, tmp_path, capsys, own_tokenizer):
    examples = random_examples(seed=3, count=3)
    data = write_jsonl(tmp_path / "val.jsonl", examples)
    options = ["--data", str(data), "--limit", "2", *WITH_TRAINER]
    assert hellaswag.main([str(checkpoint), *options]) == 0
    lines = capsys.readouterr().out.splitlines()
    # the same weights in float64
    by_mean, by_sum = reference_counts(tiny_model(), examples[:2], PAIRS)
    assert lines[-1] == f"hellaswag: acc_norm={by_mean / 2:.4f} acc={by_sum / 2:.4f} n=2"
    assert lines[-2].startswith("hellaswag: 2 examples in ") and " s on 1 x cpu " in lines[-2]


def test_sample_cli_prints_the_prompt_and_its_continuation(checkpoint, capsys, own_tokenizer):
    model = tiny_model(torch.float32)
    # spaces and a newline at both ends: nothing stripped
    prompt = "  Hello,\n world  "
    assert sample.main([str(checkpoint), "--prompt", prompt, "--max_new_tokens", "5",
                        *WITH_TRAINER]) == 0
    prompt_tokens = PAIRS.encode_ordinary(prompt)
    tokens = sample.generate(model, prompt_tokens, 5, 14, PAIRS.n_vocab)
    assert capsys.readouterr().out == prompt + PAIRS.decode(tokens[len(prompt_tokens):]) + "\n"


@pytest.mark.parametrize("step,window_blocks", [(0, 1), (695, 7), (1390, 14)])
def test_sampling_attends_within_the_window_its_step_trained_with(tmp_path, capsys, monkeypatch,
                                                                  own_tokenizer, step, window_blocks):
    """The window grows from 1 block to 14 over record 18's 1,390 steps: 7 halfway."""
    path = write_checkpoint(tmp_path / "state.pt", tiny_model(torch.float32))
    torch.save(dict(torch.load(path, weights_only=True), step=step), path)
    windows = []

    def generate_batch(model, prompt, max_new_tokens, window, *args):
        windows.append(window)
        return [prompt]
    monkeypatch.setattr(sample, "generate_batch", generate_batch)
    assert sample.main([str(path), "--prompt", "Hi", *WITH_TRAINER]) == 0
    assert windows == [window_blocks]


def error_line(capsys):
    out, err = capsys.readouterr()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("content,message", [
    (None, "cannot read it"),
    ("", "no examples"),
    ('{"ctx": "a", "endings": ["b", "c"], "label": 0}\nnot json\n',
     "line 2: not a HellaSwag example"),
    ('{"ctx": "a", "endings": ["b", "c"]}\n',
     "line 1: not a HellaSwag example (KeyError: 'label')"),
    ('{"ctx": "a", "endings": ["b", "c", "d", "e"], "label": ""}\n', "test split has no labels"),
    ('{"ctx": "a", "endings": "b", "label": 0}\n', "endings a list of at least 2 texts"),
])
def test_a_bad_data_file_is_one_error_line(tmp_path, capsys, own_tokenizer, content, message):
    data = tmp_path / "val.jsonl"
    if content is not None:
        data.write_text(content)
    # the data is read before the checkpoint, which does not exist
    assert hellaswag.main([str(tmp_path / "not_read.pt"), "--data", str(data)]) == 1
    assert message in error_line(capsys)


def test_a_bad_checkpoint_is_one_error_line(checkpoint, tmp_path, capsys, own_tokenizer):
    good = checkpoint.read_bytes()
    data = write_jsonl(tmp_path / "val.jsonl", random_examples(seed=0, count=1))
    middle = len(good) // 2
    damaged = {"missing.pt": None, "text.pt": b"not a checkpoint", "truncated.pt": good[:middle],
               "flipped.pt": good[:middle] + bytes([good[middle] ^ 1]) + good[middle + 1:]}
    for name, content in damaged.items():
        if content is not None:
            (tmp_path / name).write_bytes(content)
        assert hellaswag.main([str(tmp_path / name), "--data", str(data), *WITH_TRAINER]) == 1
        assert name in error_line(capsys)
        assert sample.main([str(tmp_path / name), *WITH_TRAINER]) == 1
        assert name in error_line(capsys)


def test_sampling_past_the_models_positions_is_one_line(checkpoint, capsys, own_tokenizer):
    # 65,535 tokens of "xx" (a pair is a token): with 50256 and one new token, one too many
    prompt = "x" * 2 * 65535
    options = [str(checkpoint), "--prompt", prompt, *WITH_TRAINER, "--max_new_tokens"]
    assert sample.main([*options, "1"]) == 1
    assert "exceed the model's 65536 positions" in error_line(capsys)


@needs_ranks
def test_the_shipped_examples_score_a_checkpoint_offline_as_help_says(checkpoint, capsys):
    data = REPO / "evals" / "smoke_hellaswag.jsonl"
    examples = hellaswag.read_examples(data)
    assert len(examples) >= 24 and all(len(endings) == 4 for _, endings, _ in examples)
    assert {label for *_, label in examples} == {0, 1, 2, 3}
    with pytest.raises(SystemExit):
        hellaswag.main(["--help"])
    usage = " ".join(capsys.readouterr().out.split())
    assert "--data evals/smoke_hellaswag.jsonl" in usage and "--tokenizer FILE" in usage
    # every example renders with GPT-2's BPE; the first 12 are scored
    assert len(hellaswag.render(examples, common.encoding(RANKS))) == len(examples)
    assert hellaswag.main([str(checkpoint), "--data", str(data), "--tokenizer", str(RANKS),
                           "--limit", "12", *WITH_TRAINER]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith(" n=12")


# --- the download ---------------------------------------------------------------------------------

class StandIn(http.server.ThreadingHTTPServer):
    """Serves `content` at every path, and counts the requests."""

    def __init__(self, content):
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                server.requests += 1
                self.send_response(200)
                self.send_header("Content-Length", str(len(server.content)))
                self.end_headers()
                self.wfile.write(server.content)

            def log_message(self, *args):
                pass
        super().__init__(("127.0.0.1", 0), Handler)
        self.content = content
        self.requests = 0
        self.url = f"http://127.0.0.1:{self.server_port}/hellaswag_val.jsonl"
        # polled every 10 ms for shutdown (0.5 s by default: the wait of every test's end)
        threading.Thread(target=self.serve_forever, args=(0.01,), daemon=True).start()


def test_download_is_checked_saved_once_and_a_bad_one_leaves_nothing(tmp_path):
    good = write_jsonl(tmp_path / "source.jsonl", random_examples(seed=4, count=3)).read_bytes()
    blob_id = hellaswag.git_blob_id(good)
    # what `git hash-object` prints for a file holding "hello\n"
    assert hellaswag.git_blob_id(b"hello\n") == "ce013625030ba8dba906f756967f9e9ca394464a"
    cached = tmp_path / "data" / "hellaswag" / "hellaswag_val.jsonl"
    # one byte changed, the size the same
    server = StandIn(good[:-1] + b"X")
    bad_download = "not HellaSwag's validation file .* nothing was saved"
    with pytest.raises(common.EvalError, match=bad_download):
        hellaswag.download(cached, server.url, blob_id)
    assert not cached.parent.exists() or not any(cached.parent.iterdir())
    server.content = good
    assert hellaswag.download(cached, server.url, blob_id).read_bytes() == good
    server.shutdown()
    server.server_close()
    # checked, and used without the network
    assert hellaswag.download(cached, server.url, blob_id) == cached and server.requests == 2
    # a damaged copy is fetched again, here from a server that is down
    cached.write_bytes(good[:100])
    with pytest.raises(common.EvalError, match="cannot download HellaSwag .* pass --data FILE"):
        hellaswag.download(cached, server.url, blob_id)


# --- real checkpoints, processes and the trainer --------------------------------------------------

@pytest.mark.slow
def test_tools_read_a_checkpoint_the_trainer_wrote(smoke_runs, tmp_path, capsys, own_tokenizer):
    log = smoke_runs.short(1)
    (checkpoint,) = log.parent.glob(f"{log.stem}/state_step*.pt")
    examples = random_examples(seed=5, count=2)
    data = write_jsonl(tmp_path / "val.jsonl", examples)
    assert hellaswag.main([str(checkpoint), "--data", str(data), *WITH_TRAINER]) == 0
    # its bf16 tables are scored in fp32: as in float64, but for 1e-7 of rounding
    model = load_model(checkpoint)
    by_mean, by_sum = reference_counts(model.double(), examples, PAIRS)
    result = f"hellaswag: acc_norm={by_mean / 2:.4f} acc={by_sum / 2:.4f} n=2"
    assert capsys.readouterr().out.splitlines()[-1] == result
    assert sample.main([str(checkpoint), "--prompt", "Once upon", "--max_new_tokens", "3",
                        *WITH_TRAINER]) == 0
    assert capsys.readouterr().out.startswith("Once upon")


@pytest.mark.slow
@needs_ranks
def test_two_processes_score_as_one(tmp_path):
    """The tool on 2 processes under torchrun, each rank's output in files of its own."""
    checkpoint = write_checkpoint(tmp_path / "state.pt", tiny_model(torch.float32, seed=1))
    data = write_jsonl(tmp_path / "val.jsonl", random_examples(seed=6, count=3))
    launch = torchrun(2, "--log-dir", tmp_path / "ranks", "--redirects", "3",
                      REPO / "evals" / "hellaswag.py", checkpoint, "--data", data, "--tokenizer",
                      RANKS, *WITH_TRAINER)
    result = run_process(launch, 300, cwd=REPO, env=launch_env(OMP_NUM_THREADS="1"))
    ranks = ranks_of(tmp_path / "ranks")
    part = SimpleNamespace(stdout=[rank["stdout"] for rank in ranks],
                           stderr=[rank["stderr"] for rank in ranks])
    # torchrun's exit code is 0 when every rank's is
    assert result.returncode == 0, part.stderr[0][-3000:] + part.stderr[1][-3000:]
    rendered, labels = hellaswag.prepare(data, RANKS)
    acc_norm, acc, n, _ = hellaswag.evaluate(load_model(checkpoint), rendered, labels, CPU)
    # rank 0 prints the counts summed over both; rank 1 prints nothing
    lines = part.stdout[0].splitlines()
    assert lines[-1] == hellaswag.result_line(acc_norm, acc, n) and n == 3
    assert " on 2 x cpu " in lines[-2] and part.stdout[1] == ""


@pytest.mark.slow
def test_trainer_scores_hellaswag_after_the_last_step(markov_shards, tmp_path, capsys,
                                                      own_tokenizer):
    examples = random_examples(seed=7, count=3)
    data = write_jsonl(tmp_path / "val.jsonl", examples)
    train, val, _ = markov_shards
    # 6 blocks of width 16, 1 step of one 128-token sequence
    options = ["--preset", "smoke", "--train_files", train, "--val_files", val, "--num_layers", "6",
               "--model_dim", "16", "--num_heads", "1", "--num_iterations", "1",
               "--val_loss_every", "0", "--batch_size", "128", "--max_device_batch_size", "128",
               "--val_tokens", "128", "--save_checkpoint", "true", "--log_dir",
               str(tmp_path / "logs"), "--hellaswag", "true"]
    assert train_gpt.main([*options, "--hellaswag_data", str(data)]) == 0
    log = finished_log(tmp_path / "logs")
    lines = log.read_text().splitlines()
    # after the last val line, which holds the train time, and the training's peak memory line;
    # HellaSwag's own peak before its scores
    assert lines[-5].startswith("step:1/1 val_loss:") and lines[-4].startswith("peak memory")
    # in sequences of --max_device_batch_size tokens
    assert lines[-3].startswith("hellaswag: 3 examples in ")
    assert "sequences of up to 128)" in lines[-3]
    assert re.fullmatch(r"hellaswag: peak memory \d+ MiB", lines[-2])
    model = load_model(next(log.parent.glob(f"{log.stem}/state_step000001.pt")))
    by_mean, by_sum = reference_counts(model.double(), examples, PAIRS)
    assert lines[-1] == f"hellaswag: acc_norm={by_mean / 3:.4f} acc={by_sum / 3:.4f} n=3"
    # a file that is not HellaSwag's format stops the run before anything is written
    (tmp_path / "bad.jsonl").write_text("not json\n")
    capsys.readouterr()
    assert train_gpt.main([*options, "--log_dir", str(tmp_path / "none"), "--hellaswag_data",
                           str(tmp_path / "bad.jsonl")]) == 1
    assert "error: --hellaswag: " in error_line(capsys)
    assert not (tmp_path / "none").exists()
