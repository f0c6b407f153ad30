"""Checkpoints are data: every torch.load in evals/ and records/ reads tensors and plain data only,
whatever TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD says, and a checkpoint the trainer wrote is nothing else.
The object planted here appends a line to a file when it is unpickled: the file's existence is the
proof it ran.

    python -m pytest tests/test_checkpoint_code.py -q
"""
import importlib.util
import json

import pytest
import tiktoken
import torch
from helpers import REPO

import train_gpt
from evals import common
from evals import hellaswag
from evals import sample

# a token per byte, 50256, and ids 256 to 50255 that decode (to 4 bytes) but that no text encodes to
TOKENS = [bytes([i]) for i in range(256)]
TOKENS += [b"\xff\xff" + i.to_bytes(2, "big") for i in range(256, train_gpt.EOT)]
STAND_IN = tiktoken.Encoding("stand-in", pat_str=r"[\s\S]",
                             special_tokens={"<|endoftext|>": train_gpt.EOT},
                             mergeable_ranks={token: rank for rank, token in enumerate(TOKENS)})
EXAMPLE = json.dumps(dict(ctx="A man", endings=["sat.", "ran."], label=0)) + "\n"
TOOLS = ["hellaswag", "sample"]


def planted(marker):
    """Two lines of Python that append `ran` to marker when they run."""
    return f"import pathlib\npathlib.Path({str(marker)!r}).open('a').write('ran\\n')\n"


def save(path, entries, **changed):
    """The checkpoint's entries, some changed, saved at path."""
    torch.save({**entries, **changed}, path)
    return path


@pytest.fixture(scope="module")
def written(markov_shards, tmp_path_factory):
    """A checkpoint the trainer wrote: 6 blocks of width 16, one step of one 128-token sequence."""
    folder = tmp_path_factory.mktemp("written")
    train, val, _ = markov_shards
    options = ["--preset", "smoke", "--train_files", train, "--val_files", val,
               "--num_layers", "6", "--model_dim", "16", "--num_heads", "1",
               "--num_iterations", "1", "--val_loss_every", "0", "--batch_size", "128",
               "--max_device_batch_size", "128", "--val_tokens", "128",
               "--save_checkpoint", "true", "--log_dir", str(folder)]
    assert train_gpt.main(options) == 0
    (path,) = folder.glob("*/state_step000001.pt")
    return path


@pytest.fixture(scope="module")
def entries(written):
    """The entries of that checkpoint that the tools read, to be changed and saved again."""
    state = torch.load(written, map_location="cpu", weights_only=True)
    return {name: state[name] for name in ("step", "model", "args", "source", "source_sha256")}


@pytest.fixture(autouse=True)
def stand_in_tokenizer(monkeypatch):
    monkeypatch.setattr(common.gpt2_tokenizer, "gpt2_encoding",
                        lambda tokenizer_file=None: STAND_IN)


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "val.jsonl"
    path.write_text(EXAMPLE * 2)
    return path


def run_tool(tool, checkpoint, data, *options):
    """The tool's main on the checkpoint: its exit code."""
    if tool == "hellaswag":
        return hellaswag.main([str(checkpoint), "--data", str(data), *options])
    return sample.main([str(checkpoint), "--max_new_tokens", "1", *options])


def one_error_line(capsys):
    """The one line on stderr, an `error:` line; stdout empty."""
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, (out, err)
    assert err.startswith("error: ") and "Traceback" not in err
    return err.strip()


# --- pickles: data only ---------------------------------------------------------------------------

class Planted:
    """An object whose unpickling appends `ran` to a file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (exec, (planted(self.marker),))


def same(a, b):
    """Whether two unpickled values are equal, type for type (tensors by their values)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def test_a_checkpoint_the_trainer_wrote_is_tensors_and_plain_data(written):
    data_only = torch.load(written, map_location="cpu", weights_only=True)
    every_object = torch.load(written, map_location="cpu", weights_only=False)
    assert same(data_only, every_object)
    assert isinstance(data_only["source"], bytes) and isinstance(data_only["args"], dict)
    assert common.read_checkpoint(written).keys() == every_object.keys()


@pytest.fixture
def pickle_payload(entries, tmp_path, monkeypatch):
    """(a checkpoint holding a Planted object, its marker), with torch's escape for old files,
    TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1, set."""
    marker = tmp_path / "unpickled.txt"
    checkpoint = save(tmp_path / "state.pt", entries, extra=Planted(marker))
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    return checkpoint, marker


@pytest.mark.parametrize("tool", TOOLS)
def test_a_pickle_payload_is_refused_by_the_tools(pickle_payload, data, capsys, tool):
    checkpoint, marker = pickle_payload
    assert run_tool(tool, checkpoint, data) == 1
    line = one_error_line(capsys)
    assert str(checkpoint) in line and "refused: unpickling it could run code" in line
    assert "corrupt" not in line
    assert not marker.exists()


def test_a_pickle_payload_is_not_run_by_profile_runs_resume_read(pickle_payload):
    checkpoint, marker = pickle_payload
    spec = importlib.util.spec_from_file_location("records_profile_run",
                                                  REPO / "records" / "profile_run.py")
    profile_run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile_run)
    # the options it reads before the trainer runs (which reports a bad checkpoint itself)
    profile_run.trainer_options(["--resume", str(checkpoint)])
    assert not marker.exists()
