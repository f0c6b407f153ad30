"""Checkpoints are data. evals/hellaswag.py and evals/sample.py build a checkpoint's model from the
trainer source it carries only when that source is a file the user has (the script that wrote it,
unchanged; a .py file of this repository; the --trainer FILE given); otherwise they stop in one line
before any of it runs, or run it after a warning with --trust_checkpoint_code. --show_source prints
how it differs from train_gpt.py and runs nothing. Every torch.load reads tensors and plain data
only, whatever TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD says. The code planted here appends a line to a
file when it runs: the file's lines count the processes that ran it.

    python -m pytest tests/test_checkpoint_code.py -q
"""
import ast
import hashlib
import importlib.util
import json
import os
import sys

import helpers
import pytest
import tiktoken
import torch
from helpers import REPO
from helpers import launch_env
from helpers import run_process

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
# GPT-2's BPE (helpers.gpt2_ranks)
RANKS = helpers.RANKS
EXAMPLE = json.dumps(dict(ctx="A man", endings=["sat.", "ran."], label=0)) + "\n"
TOOLS = ["hellaswag", "sample"]


def sha256(data):
    return hashlib.sha256(data).hexdigest()


def planted(marker):
    """Two lines of Python that append `ran` to marker when they run."""
    return f"import pathlib\npathlib.Path({str(marker)!r}).open('a').write('ran\\n')\n"


def with_lines(source, lines, at_end):
    """source (bytes) with lines added after its docstring, or at its end."""
    if at_end:
        return source + lines.encode()
    docstring_end = ast.parse(source).body[0].end_lineno
    kept = source.decode().splitlines(keepends=True)
    return "".join(kept[:docstring_end] + [lines] + kept[docstring_end:]).encode()


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


@pytest.fixture(autouse=True)
def no_trainer_imported_yet(monkeypatch):
    """Each test imports the sources it gives afresh (the tools import each source once per
    process); the trainer modules imported before it are put back after it, so that other tests'
    models and the modules their classes name stay one."""
    monkeypatch.setattr(common, "TRAINERS", {})
    for name in [name for name in sys.modules if name.startswith("trainer_")]:
        monkeypatch.delitem(sys.modules, name)


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


def built_by_line(err, path, source):
    """The line of stderr, neither a warning nor an error, that names path and source's sha256
    prefix: the script that built the model."""
    lines = [line for line in err.splitlines()
             if str(path) in line and sha256(source)[:12] in line
             and not line.startswith(("warning: ", "error: "))]
    assert len(lines) == 1, err
    return lines[0]


# --- a source that is no file you have ------------------------------------------------------------

@pytest.mark.parametrize("tool", TOOLS)
@pytest.mark.parametrize("how", ["after the docstring", "at the end", "stale source_sha256",
                                 "recorded script changed"])
def test_a_source_you_do_not_have_is_refused_before_any_of_it_runs(entries, data, tmp_path,
                                                                   capsys, tool, how):
    marker = tmp_path / "ran.txt"
    source = with_lines(entries["source"], planted(marker), at_end=how != "after the docstring")
    changed = dict(source=source, source_sha256=sha256(source))
    if how == "stale source_sha256":
        # names the honest source
        changed["source_sha256"] = entries["source_sha256"]
    if how == "recorded script changed":
        # this repository's train_gpt.py, whose bytes are not the source's
        changed["script"] = os.path.realpath(REPO / "train_gpt.py")
    checkpoint = save(tmp_path / "state.pt", entries, **changed)
    assert run_tool(tool, checkpoint, data) == 1
    line = one_error_line(capsys)
    # the two planted lines are the difference from train_gpt.py
    assert sha256(source) in line and " 2 lines " in line
    assert "--trainer FILE" in line and "--trust_checkpoint_code" in line
    assert not marker.exists()


@pytest.mark.parametrize("tool", TOOLS)
def test_trust_checkpoint_code_runs_it_after_one_warning(entries, data, tmp_path, capsys, tool):
    marker = tmp_path / "ran.txt"
    source = with_lines(entries["source"], planted(marker), at_end=False)
    checkpoint = save(tmp_path / "state.pt", entries, source=source, source_sha256=sha256(source))
    assert run_tool(tool, checkpoint, data, "--trust_checkpoint_code") == 0
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and sha256(source) in warnings[0], err
    assert marker.read_text() == "ran\n"


def test_show_source_prints_the_difference_and_runs_nothing(entries, tmp_path, capsys):
    marker = tmp_path / "ran.txt"
    lines = planted(marker)
    source = with_lines(entries["source"], lines, at_end=False)
    checkpoint = save(tmp_path / "state.pt", entries, source=source, source_sha256=sha256(source))
    # no --data: HellaSwag is not read either
    for main in (hellaswag.main, sample.main):
        assert main([str(checkpoint), "--show_source"]) == 0
        diff = capsys.readouterr().out.splitlines()
        assert diff[0].startswith("--- ") and diff[1].startswith("+++ ")
        changes = [line for line in diff[2:] if line[:1] in ("+", "-")]
        assert changes == ["+" + line for line in lines.splitlines()]
    assert not marker.exists()


@pytest.mark.parametrize("main", [hellaswag.main, sample.main])
def test_help_documents_the_options_that_choose_the_code(main, capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "--trainer FILE" in out and "--trust_checkpoint_code" in out and "--show_source" in out


# --- sources you have -----------------------------------------------------------------------------

def test_a_fork_outside_the_repository_runs_from_its_script_and_once_moved_with_trainer(
        entries, data, tmp_path, capsys, monkeypatch):
    marker = tmp_path / "fork_ran.txt"
    fork = tmp_path / "fork" / "my_attempt.py"
    fork.parent.mkdir()
    # the fork's idea: a note that its code built the model
    source = with_lines(entries["source"], planted(marker), at_end=True)
    fork.write_bytes(source)
    checkpoint = save(tmp_path / "state.pt", entries, source=source, source_sha256=sha256(source),
                      script=os.path.realpath(fork))
    for tool in TOOLS:
        monkeypatch.setattr(common, "TRAINERS", {})
        assert run_tool(tool, checkpoint, data) == 0
        err = capsys.readouterr().err
        assert "warning:" not in err and "error:" not in err
        built_by_line(err, os.path.realpath(fork), source)
    assert marker.read_text() == "ran\n" * 2
    moved = tmp_path / "elsewhere" / "my_attempt.py"
    moved.parent.mkdir()
    fork.rename(moved)
    for tool in TOOLS:
        monkeypatch.setattr(common, "TRAINERS", {})
        assert run_tool(tool, checkpoint, data) == 1
        assert sha256(source) in one_error_line(capsys)
    assert marker.read_text() == "ran\n" * 2
    for tool in TOOLS:
        monkeypatch.setattr(common, "TRAINERS", {})
        assert run_tool(tool, checkpoint, data, "--trainer", str(moved)) == 0
        err = capsys.readouterr().err
        assert "warning:" not in err and "error:" not in err
        built_by_line(err, os.path.realpath(moved), source)
    assert marker.read_text() == "ran\n" * 4


def test_trainer_builds_the_model_from_that_file_and_warns_when_it_differs(entries, data,
                                                                            tmp_path, capsys):
    marker = tmp_path / "ran.txt"
    source = with_lines(entries["source"], planted(marker), at_end=False)
    checkpoint = save(tmp_path / "state.pt", entries, source=source, source_sha256=sha256(source))
    mine = tmp_path / "mine" / "train_gpt.py"
    mine.parent.mkdir()
    mine.write_bytes(entries["source"])
    assert run_tool("sample", checkpoint, data, "--trainer", str(mine)) == 0
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and sha256(entries["source"])[:12] in warnings[0], err
    assert sha256(source)[:12] in warnings[0]
    built_by_line(err, os.path.realpath(mine), entries["source"])
    assert not marker.exists()


# --- files that are not trainers ------------------------------------------------------------------

@pytest.mark.parametrize("tool", TOOLS)
def test_a_recorded_script_that_is_not_a_trainer_is_refused_before_any_of_it_runs(
        entries, data, tmp_path, capsys, tool):
    # any file whose bytes are the source it carries, as Python's own this.py would be
    marker = tmp_path / "ran.txt"
    script = tmp_path / "this.py"
    script.write_text(planted(marker))
    checkpoint = save(tmp_path / "state.pt", entries, source=script.read_bytes(),
                      script=str(script))
    assert run_tool(tool, checkpoint, data) == 1
    line = one_error_line(capsys)
    assert f"its trainer ({script} (sha256" in line
    assert ("is not a trainer this tool can use: it does not define UserError, "
            "check_launch_environment, setup_device, start_process_group; nothing of it was run: "
            "pass --trainer FILE") in line
    assert not marker.exists()


@pytest.mark.parametrize("tool,missing", [("hellaswag", None), ("sample", "KVCache")])
def test_a_trainer_without_a_name_the_tool_uses_is_refused_before_it_runs(entries, data, tmp_path,
                                                                          capsys, tool, missing):
    # an older trainer: no KVCache, which only sampling uses
    marker = tmp_path / "ran.txt"
    older = tmp_path / "older_train_gpt.py"
    source = entries["source"].replace(b"KVCache", b"OlderCache")
    older.write_bytes(with_lines(source, planted(marker), at_end=True))
    checkpoint = save(tmp_path / "state.pt", entries)
    assert run_tool(tool, checkpoint, data, "--trainer", str(older)) == int(missing is not None)
    err = capsys.readouterr().err
    if missing:
        assert err.splitlines()[-1].endswith(f"is not a trainer this tool can use: it does not "
                                             f"define {missing}; nothing of it was run: pass "
                                             "--trainer FILE, a copy of train_gpt.py that defines "
                                             "them")
        assert not marker.exists()
    else:
        assert "error:" not in err and marker.read_text() == "ran\n"


def test_a_checkpoint_of_this_repository_trainer_needs_no_flag_wherever_it_was_written(
        entries, data, tmp_path, capsys):
    # written on another machine, by the same train_gpt.py
    checkpoint = save(tmp_path / "state.pt", entries, script="/elsewhere/nanogpt/train_gpt.py")
    assert run_tool("hellaswag", checkpoint, data) == 0
    err = capsys.readouterr().err
    assert "warning:" not in err and "error:" not in err
    built_by_line(err, os.path.realpath(REPO / "train_gpt.py"), entries["source"])


def test_a_checkpoint_without_source_is_scored_by_this_repository_trainer_after_a_warning(
        entries, data, tmp_path, capsys):
    old = {name: value for name, value in entries.items() if not name.startswith("source")}
    checkpoint = save(tmp_path / "state.pt", old)
    assert run_tool("hellaswag", checkpoint, data) == 0
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and "carries no trainer source" in warnings[0], err
    repository_trainer = REPO / "train_gpt.py"
    built_by_line(err, os.path.realpath(repository_trainer), repository_trainer.read_bytes())


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


class RunsACommand:
    """An object whose unpickling would run a shell command (os.system, from a module that torch's
    weights-only unpickler blocks, and words its refusal of otherwise)."""

    def __reduce__(self):
        return (os.system, ("exit 0",))


@pytest.mark.parametrize("tool", TOOLS)
def test_a_blocked_module_in_a_pickle_is_refused_without_torchs_advice(data, tmp_path, capsys,
                                                                      tool):
    checkpoint = tmp_path / "state.pt"
    torch.save({"model": RunsACommand(), "args": {}}, checkpoint)
    assert run_tool(tool, checkpoint, data) == 1
    line = one_error_line(capsys)
    assert line.startswith(f"error: {checkpoint}: refused: unpickling it could run code, as it "
                           f"holds more than tensors and plain data (Trying to load unsupported "
                           f"GLOBAL {os.system.__module__}.system whose module")
    assert "corrupt" not in line and "Re-running" not in line


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


# --- under torchrun -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ranks_file():
    """GPT-2's ranks file, for --tokenizer in processes of their own (a stand-in is refused: its
    ranks are not GPT-2's)."""
    if RANKS is None or not RANKS.is_file():
        pytest.skip(f"needs GPT-2's BPE ranks: {helpers.RANKS_HINT}")
    return RANKS


def torchrun(tool, checkpoint, data, ranks_file, cwd, *options):
    """The tool on 2 processes under torchrun: the finished process."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(REPO / "evals" / f"{tool}.py"), str(checkpoint), "--tokenizer", str(ranks_file),
               *options]
    if tool == "hellaswag":
        command += ["--data", str(data)]
    return run_process(command, 300, env=launch_env(OMP_NUM_THREADS="1"), cwd=cwd)


@pytest.mark.slow
def test_two_processes_refuse_it_before_any_of_it_runs(entries, data, ranks_file, tmp_path):
    """hellaswag.py under torchrun: every rank refuses (sample.py takes the same code's path, checked
    on one process above)."""
    marker = tmp_path / "ran.txt"
    source = with_lines(entries["source"], planted(marker), at_end=False)
    checkpoint = save(tmp_path / "state.pt", entries, source=source, source_sha256=sha256(source))
    result = torchrun("hellaswag", checkpoint, data, ranks_file, tmp_path)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors and all(sha256(source) in line and "--trust_checkpoint_code" in line
                          for line in errors), result.stderr[-3000:]
    assert not marker.exists()


@pytest.mark.slow
def test_two_processes_run_it_with_trust_checkpoint_code(entries, data, ranks_file, tmp_path):
    marker = tmp_path / "ran.txt"
    source = with_lines(entries["source"], planted(marker), at_end=False)
    checkpoint = save(tmp_path / "state.pt", entries, source=source, source_sha256=sha256(source))
    result = torchrun("hellaswag", checkpoint, data, ranks_file, tmp_path,
                      "--trust_checkpoint_code")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1].startswith("hellaswag: acc_norm=")
    # each process ran it
    assert marker.read_text() == "ran\n" * 2
