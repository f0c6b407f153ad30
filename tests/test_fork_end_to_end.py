"""A fork, end to end: the trainer under test copied under another name into another folder, an idea
of its own added there (a fixed bias on the logits it returns), trains the smoke preset (narrowed,
4 steps) and saves a checkpoint; the repository's evals/hellaswag.py and evals/sample.py, given the
fork as --trainer FILE, score and continue with it as the fork's model: their scores and greedy text
equal those of the fork's own module (each candidate scored alone in float64, greedy by full
forwards), and differ from the original trainer's with the same weights. Also: one trainer module
per process, with --hellaswag and with the tools alone (one process, which forgets the trainer's
and the repository's modules between the two).

    python -m pytest tests/test_fork_end_to_end.py -q
"""
import ast
import copy
import json
import random
import sys

import helpers
import pytest
import tiktoken
import torch
from helpers import REPO
from helpers import TRAINER
from helpers import launch_env
from helpers import run_process
from helpers import with_trainer

import train_gpt
from evals import common
from evals import hellaswag
from evals import sample

RANKS = helpers.RANKS
pytestmark = [pytest.mark.slow, helpers.needs_ranks]
# A tokenizer stand-in: a token per byte (ids 0-255, those of the smoke preset's synthetic data,
# so the model's choices among candidates are its own, not noise), 50256, and ids 256 to 50255
# that decode (to 4 bytes) but that no text encodes to
IN_DOMAIN = tiktoken.Encoding(
    "bytes", pat_str=r"[\s\S]", special_tokens={"<|endoftext|>": train_gpt.EOT},
    mergeable_ranks={**{bytes([i]): i for i in range(256)},
                     **{b"\xff\xff" + i.to_bytes(2, "big"): i for i in range(256, train_gpt.EOT)}})
# the fork's idea, whatever the trainer it copies names its parts: the model it builds adds a fixed
# bias to every logit it returns (its loss, a number, as the trainer's)
FORK_IDEA = """

class GPT(GPT):
    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        if out.ndim == 0:
            return out
        bias = torch.randn(out.size(-1), generator=torch.Generator().manual_seed(55))
        return out + bias.to(out.device)
"""


@pytest.fixture(scope="module")
def fork(markov_shards, tmp_path_factory):
    """(the fork's module, its checkpoint): my_attempt.py, trained in this process on the smoke
    preset, at width 16 over 6 blocks (a step is mostly the 50,304-wide head), for 4 steps of 128
    tokens on the session's Markov shards (after 2, both models' greedy tokens are alike)."""
    folder = tmp_path_factory.mktemp("fork")
    (folder / "my_attempt.py").write_text(TRAINER.read_text() + FORK_IDEA)
    module = helpers.import_file("my_attempt", folder / "my_attempt.py")
    train, val, _ = markov_shards
    options = ["--preset", "smoke", "--train_files", train, "--val_files", val,
               "--num_layers", "6", "--model_dim", "16", "--num_heads", "1",
               "--num_iterations", "4", "--val_loss_every", "0", "--batch_size", "128",
               "--max_device_batch_size", "128", "--val_tokens", "128",
               "--save_checkpoint", "true", "--log_dir", str(folder / "logs")]
    assert module.main(options) == 0
    (checkpoint,) = (folder / "logs").glob("*/state_step000004.pt")
    return module, checkpoint


def model_of(trainer, checkpoint):
    """trainer's model with the checkpoint's weights, built here (not by evals/)."""
    state = torch.load(checkpoint, map_location="cpu")
    options = trainer.Hyperparameters(**state["args"])
    model = trainer.GPT.from_args(options)
    model.load_state_dict(state["model"])
    return model.eval(), options


def in_float64(model):
    """A copy of the model in float64, for the references."""
    return copy.deepcopy(model).double()


@torch.no_grad()
def ending_losses(model64, candidates, endings):
    """Each candidate's summed and mean loss over its ending, from a forward over it alone with
    the model in float64; (sums, means), a row per example of `endings` candidates."""
    window = torch.tensor(10 ** 6, dtype=torch.int32)
    sums = []
    means = []
    for tokens, start in candidates:
        x = torch.tensor(tokens)
        logits = model64(x.int(), None, window).double()
        losses = -logits.log_softmax(-1)[torch.arange(start - 1, len(x) - 1), x[start:]]
        sums.append(losses.sum().item())
        means.append(losses.mean().item())
    return torch.tensor(sums).view(-1, endings), torch.tensor(means).view(-1, endings)


def result_line(sums, means, labels):
    """The line hellaswag.py prints last, from per-candidate losses."""
    labels = torch.tensor(labels)
    acc_norm = (means.argmin(1) == labels).double().mean().item()
    acc = (sums.argmin(1) == labels).double().mean().item()
    return f"hellaswag: acc_norm={acc_norm:.4f} acc={acc:.4f} n={len(labels)}"


@torch.no_grad()
def greedy(model, prompt, new_tokens, vocab):
    """The prompt and new_tokens more, each the argmax of a full forward over all before it."""
    tokens = [train_gpt.EOT, *prompt]
    window = torch.tensor(10 ** 6, dtype=torch.int32)
    for _ in range(new_tokens):
        logits = model(torch.tensor(tokens).int(), None, window)[-1, :vocab]
        tokens.append(int(logits.argmax()))
    return tokens[1:]


@torch.no_grad()
def next_token_losses(model64, tokens):
    """The loss of each possible next token after tokens, with the model in float64."""
    window = torch.tensor(10 ** 6, dtype=torch.int32)
    return -model64(torch.tensor(tokens).int(), None, window)[-1].double().log_softmax(-1)


def text(rng, length):
    return "".join(chr(rng.randrange(33, 127)) for _ in range(length))


def test_fork_checkpoint_is_scored_and_continued_as_the_fork_model(fork, tmp_path, capsys,
                                                                    monkeypatch):
    fork_module, checkpoint = fork
    fork_file = fork_module.__file__
    assert torch.load(checkpoint, map_location="cpu")["source"] == open(fork_file, "rb").read()
    monkeypatch.setattr(common.gpt2_tokenizer, "gpt2_encoding",
                        lambda tokenizer_file=None: IN_DOMAIN)
    fork_model, _ = model_of(fork_module, checkpoint)
    original_model, _ = model_of(train_gpt, checkpoint)
    fork64 = in_float64(fork_model)
    original64 = in_float64(original_model)
    # Examples of two one-character endings: per context, two characters that the fork's model and
    # the original's (the same weights) rank in opposite orders, labelled with the fork's choice
    rng = random.Random(0)
    examples = []
    for i in range(4):
        context = text(rng, 20)
        tokens = [train_gpt.EOT, *IN_DOMAIN.encode_ordinary(context + " ")]
        # floats, not tensors, for the 94 x 94 comparisons
        fork_losses = next_token_losses(fork64, tokens).tolist()
        original_losses = next_token_losses(original64, tokens).tolist()
        printable = range(33, 127)
        pairs = [(a, b) for a in printable for b in printable
                 if fork_losses[a] < fork_losses[b] and original_losses[a] > original_losses[b]]
        if pairs:
            fork_choice, other = rng.choice(pairs)
            endings = [chr(other), chr(fork_choice)] if i % 2 else [chr(fork_choice), chr(other)]
            examples.append((context, endings, i % 2))
    assert examples, "the fork's and the original's models rank every pair alike"
    rendered = hellaswag.render(examples, IN_DOMAIN, train_gpt.EOT)
    candidates = [c for example in rendered for c in example]
    labels = [label for *_, label in examples]
    fork_line = result_line(*ending_losses(fork64, candidates, 2), labels)
    original_line = result_line(*ending_losses(original64, candidates, 2), labels)
    assert fork_line.startswith("hellaswag: acc_norm=1.0000 ")
    assert original_line.startswith("hellaswag: acc_norm=0.0000 ")
    data = tmp_path / "val.jsonl"
    data.write_text("".join(json.dumps(dict(ctx=c, endings=e, label=label)) + "\n"
                            for c, e, label in examples))
    capsys.readouterr()
    assert hellaswag.main([str(checkpoint), "--data", str(data), "--trainer", fork_file]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == fork_line

    # greedy: a prompt whose continuation differs between the two models, continued by sample.py
    for _ in range(8):
        prompt = IN_DOMAIN.encode_ordinary(text(rng, 20))
        fork_tokens = greedy(fork_model, prompt, 8, IN_DOMAIN.n_vocab)
        original_tokens = greedy(original_model, prompt, 8, IN_DOMAIN.n_vocab)
        if fork_tokens != original_tokens:
            break
    assert fork_tokens != original_tokens, "the same greedy tokens from both models"
    assert sample.main([str(checkpoint), "--prompt", IN_DOMAIN.decode(prompt),
                        "--max_new_tokens", "8", "--trainer", fork_file]) == 0
    assert capsys.readouterr().out == IN_DOMAIN.decode(fork_tokens) + "\n"


# One process: the trainer with --hellaswag, then the tools alone, as in a process of their own:
# the trainer and every module of the repository imported so far (evals, the tokenizer) forgotten
# first, but not those of a virtual environment kept in the repository's folder (torch's, say)
ONE_TRAINER = """import glob
import os
import sys
import sysconfig


def trainers():
    return [name for name, module in sys.modules.items()
            if isinstance(getattr(module, "GPT", None), type)
            and hasattr(module, "Hyperparameters")]


import train_gpt
assert train_gpt.main({options!r}) == 0
print("with --hellaswag:", trainers())
installed = tuple(os.path.join(sysconfig.get_path(name), "") for name in ("purelib", "platlib"))
del sys.modules["train_gpt"]
for name, module in list(sys.modules.items()):
    path = getattr(module, "__file__", None) or ""
    if path.startswith(os.path.join({repo!r}, "")) and not path.startswith(installed):
        del sys.modules[name]
assert trainers() == []
(checkpoint,) = glob.glob({checkpoints!r})
from evals import hellaswag
assert hellaswag.main([checkpoint, "--data", {data!r}, "--tokenizer", {ranks!r},
                       "--trainer", {trainer!r}]) == 0
print("the tools alone:", trainers())
"""


def test_one_trainer_module_per_process_with_hellaswag_and_with_the_tools_alone(markov_shards,
                                                                                 tmp_path):
    """ONE_TRAINER in a process of its own: the tiny model, 1 step of one 128-token sequence, a
    checkpoint and --hellaswag on one example."""
    folder = tmp_path
    train, val, _ = markov_shards
    data = folder / "val.jsonl"
    data.write_text(json.dumps(dict(ctx="The cat", endings=["ran", "sat"], label=0)) + "\n")
    options = ["--preset", "smoke", "--train_files", train, "--val_files", val,
               "--num_layers", "6", "--model_dim", "16", "--num_heads", "1",
               "--num_iterations", "1", "--val_loss_every", "0", "--batch_size", "128",
               "--max_device_batch_size", "128", "--val_tokens", "128",
               "--save_checkpoint", "true", "--log_dir", str(folder / "logs"),
               "--hellaswag", "true", "--hellaswag_data", str(data), "--tokenizer",
               str(RANKS)]
    code = ONE_TRAINER.format(repo=str(REPO), options=options, data=str(data),
                              ranks=str(RANKS), trainer=str(TRAINER),
                              checkpoints=str(folder / "logs" / "*" / "state_step000001.pt"))
    # the repository importable, whatever the working directory
    env = launch_env(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    result = run_process([sys.executable, "-c", with_trainer(code)], 600, cwd=folder, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert [line for line in lines if line.startswith("with --")] == [
        "with --hellaswag: ['train_gpt']"]
    (log,) = (folder / "logs").glob("*.txt")
    text = log.read_text()
    # the trainer's source, then the scorer's, each file named, then the line of 100 '='
    source_end = text.index("\n" + "=" * 100 + "\n")
    assert text.startswith(TRAINER.read_text())
    scorers = ("evals/hellaswag.py", "evals/common.py", "data/gpt2_tokenizer.py", "data/files.py")
    for name in scorers:
        header = f"\n{'-' * 100}\n# {name}, which scored --hellaswag\n"
        at = text.index(header)
        assert at < source_end
        assert text[at + len(header):].startswith((REPO / name).read_text())
    assert text.splitlines()[-1].startswith("hellaswag: acc_norm=")
    # the module built from the checkpoint's source, and no other (train_gpt is not imported)
    (trainer,) = ast.literal_eval(lines[-1].removeprefix("the tools alone: "))
    assert trainer.startswith("trainer_")
