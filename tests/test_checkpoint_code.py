"""Checkpoints are data. evals/hellaswag.py and evals/sample.py run the trainer source a checkpoint
carries only when it is this repository's train_gpt.py byte for byte; with --trainer FILE they build
the model with FILE; otherwise they stop in one line before any of it runs, or run it after a
warning with --trust_checkpoint_code. The script path a checkpoint records is never a place to look
for code. --show_source prints how it differs from train_gpt.py, --write_source FILE saves it; both
run nothing. Every torch.load reads tensors and plain data only, whatever
TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD says. The code planted here appends a line to a file when it runs:
the file's lines count the processes that ran it. The checkpoints carry the trainer under test
(--trainer FILE of pytest), which the tools are given as --trainer.

    python -m pytest tests/test_checkpoint_code.py -q
"""
import ast
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import uuid
from dataclasses import asdict

import helpers
import pytest
import tiktoken
import torch
from helpers import REPO
from helpers import TRAINER
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
# the trainer under test, as the tools are given it
WITH_TRAINER = ["--trainer", str(TRAINER)]
REPOSITORY_TRAINER = REPO / "train_gpt.py"


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


# --- a source that is not this repository's train_gpt.py ---------------------------------------

@pytest.fixture
def in_the_repository():
    """A folder of its own under the repository's logs/ (which git ignores), removed after."""
    folder = REPO / "logs" / f"test-{uuid.uuid4().hex}"
    folder.mkdir(parents=True)
    yield folder
    shutil.rmtree(folder)
    if not any((REPO / "logs").iterdir()):
        (REPO / "logs").rmdir()


@pytest.mark.parametrize("tool", TOOLS)
@pytest.mark.parametrize("how", ["after the docstring", "at the end", "stale source_sha256",
                                 "recorded script is train_gpt.py", "recorded x.py beside it",
                                 "a copy under the repository's logs"])
def test_a_source_that_is_not_the_repository_trainer_is_refused_before_any_of_it_runs(
        entries, data, tmp_path, capsys, monkeypatch, in_the_repository, tool, how):
    marker = tmp_path / "ran.txt"
    source = with_lines(entries["source"], planted(marker), at_end=how != "after the docstring")
    changed = dict(source=source, source_sha256=sha256(source))
    if how == "stale source_sha256":
        # names the honest source
        changed["source_sha256"] = entries["source_sha256"]
    if how == "recorded script is train_gpt.py":
        # this repository's train_gpt.py, whose bytes are not the source's
        changed["script"] = os.path.realpath(REPOSITORY_TRAINER)
    if how == "recorded x.py beside it":
        # a bundle unpacked as it came: its script, relative, beside it in the working directory
        (tmp_path / "x.py").write_bytes(source)
        monkeypatch.chdir(tmp_path)
        changed["script"] = "x.py"
    if how == "a copy under the repository's logs":
        (in_the_repository / "x.py").write_bytes(source)
        changed["script"] = "/elsewhere/x.py"
    checkpoint = save(tmp_path / "state.pt", entries, **changed)
    assert run_tool(tool, checkpoint, data) == 1
    line = one_error_line(capsys)
    assert sha256(source) in line and "not this repository's train_gpt.py" in line
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
    source = with_lines(REPOSITORY_TRAINER.read_bytes(), lines, at_end=False)
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
    for option in ("--trainer FILE", "--trust_checkpoint_code", "--show_source", "--write_source"):
        assert option in out


# --- sources you chose ----------------------------------------------------------------------------

def test_a_fork_runs_only_when_given_as_trainer_wherever_its_script_is(entries, data, tmp_path,
                                                                        capsys):
    marker = tmp_path / "fork_ran.txt"
    fork = tmp_path / "fork" / "my_attempt.py"
    fork.parent.mkdir()
    # the fork's idea: a note that its code built the model
    source = with_lines(entries["source"], planted(marker), at_end=True)
    fork.write_bytes(source)
    # it records its script, there with the same bytes: information, not consent
    checkpoint = save(tmp_path / "state.pt", entries, source=source, source_sha256=sha256(source),
                      script=os.path.realpath(fork))
    for tool in TOOLS:
        assert run_tool(tool, checkpoint, data) == 1
        assert sha256(source) in one_error_line(capsys)
    assert not marker.exists()
    for tool in TOOLS:
        assert run_tool(tool, checkpoint, data, "--trainer", str(fork)) == 0
        err = capsys.readouterr().err
        assert "warning:" not in err and "error:" not in err
        built_by_line(err, os.path.realpath(fork), source)
    # imported once in this process
    assert marker.read_text() == "ran\n"


def test_trainer_builds_the_model_from_that_file_and_warns_when_it_differs(entries, data,
                                                                            tmp_path, capsys):
    marker = tmp_path / "ran.txt"
    source = with_lines(entries["source"], planted(marker), at_end=False)
    checkpoint = save(tmp_path / "state.pt", entries, source=source, source_sha256=sha256(source))
    mine = tmp_path / "mine" / TRAINER.name
    mine.parent.mkdir()
    mine.write_bytes(entries["source"])
    assert run_tool("sample", checkpoint, data, "--trainer", str(mine)) == 0
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and sha256(entries["source"])[:12] in warnings[0], err
    assert sha256(source)[:12] in warnings[0]
    built_by_line(err, os.path.realpath(mine), entries["source"])
    assert not marker.exists()


def test_write_source_saves_the_carried_source_for_trainer_and_overwrites_nothing(
        entries, data, tmp_path, capsys):
    marker = tmp_path / "ran.txt"
    source = with_lines(entries["source"], planted(marker), at_end=True)
    checkpoint = save(tmp_path / "state.pt", entries, source=source, source_sha256=sha256(source))
    written = tmp_path / "theirs.py"
    assert sample.main([str(checkpoint), "--write_source", str(written)]) == 0
    # and no temp file beside it
    assert written.read_bytes() == source
    assert sorted(os.listdir(tmp_path)) == ["state.pt", "theirs.py", "val.jsonl"]
    assert f"then pass --trainer {written}" in capsys.readouterr().err
    # again: the same bytes there already, kept
    assert hellaswag.main([str(checkpoint), "--write_source", str(written)]) == 0
    capsys.readouterr()
    mine = tmp_path / "mine.py"
    mine.write_bytes(b"# my own notes\n")
    nowhere = tmp_path / "no_such_folder" / "theirs.py"
    for target, message in [(mine, "exists, with other bytes"), (nowhere, "cannot write it")]:
        assert sample.main([str(checkpoint), "--write_source", str(target)]) == 1
        assert message in one_error_line(capsys)
    assert mine.read_bytes() == b"# my own notes\n" and not nowhere.parent.exists()
    assert not marker.exists()
    assert run_tool("hellaswag", checkpoint, data, "--trainer", str(written)) == 0
    assert marker.read_text() == "ran\n"


# --- files that are not trainers ------------------------------------------------------------------

@pytest.mark.parametrize("tool", TOOLS)
def test_a_trainer_file_that_is_not_a_trainer_is_refused_before_any_of_it_runs(
        entries, data, tmp_path, capsys, tool):
    # any Python file, as Python's own this.py would be, or a checkpoint given in its place
    marker = tmp_path / "ran.txt"
    script = tmp_path / "this.py"
    script.write_text(planted(marker))
    checkpoint = save(tmp_path / "state.pt", entries)
    assert run_tool(tool, checkpoint, data, "--trainer", str(script)) == 1
    # after the warning that it is not the source the checkpoint carries
    line = capsys.readouterr().err.splitlines()[-1]
    assert line.startswith("error: ") and f"its trainer ({script} (sha256" in line
    assert ("is not a trainer this tool can use: it does not define UserError, "
            "check_launch_environment, setup_device, start_process_group; nothing of it was run: "
            "pass --trainer FILE") in line
    assert run_tool(tool, checkpoint, data, "--trainer", str(checkpoint)) == 1
    assert ", not Python (" in capsys.readouterr().err.splitlines()[-1]
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


# --- checkpoints of this repository's train_gpt.py ------------------------------------------------

@pytest.fixture
def repository_checkpoint(tmp_path):
    """The entries of a checkpoint of this repository's train_gpt.py (whatever trainer is under
    test): a small model of its own, random, and its source."""
    source = REPOSITORY_TRAINER.read_bytes()
    trainer = common.trainer_from_source(source)
    options = trainer.Hyperparameters(num_layers=6, num_heads=1, model_dim=8)
    model = trainer.GPT.from_args(options)
    return dict(step=1, model=model.state_dict(), args=asdict(options), source=source)


def test_a_checkpoint_of_this_repository_trainer_needs_no_flag_wherever_it_was_written(
        repository_checkpoint, data, tmp_path, capsys):
    # written on another machine, by the same train_gpt.py
    checkpoint = save(tmp_path / "state.pt", repository_checkpoint,
                      script="/elsewhere/nanogpt/train_gpt.py")
    for tool in TOOLS:
        assert run_tool(tool, checkpoint, data) == 0
        err = capsys.readouterr().err
        assert "warning:" not in err and "error:" not in err
        built_by_line(err, os.path.realpath(REPOSITORY_TRAINER), REPOSITORY_TRAINER.read_bytes())


def test_a_checkpoint_without_source_is_scored_by_this_repository_trainer_after_a_warning(
        repository_checkpoint, data, tmp_path, capsys):
    old = {name: value for name, value in repository_checkpoint.items() if name != "source"}
    checkpoint = save(tmp_path / "state.pt", old)
    assert run_tool("hellaswag", checkpoint, data) == 0
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and "carries no trainer source" in warnings[0], err
    built_by_line(err, os.path.realpath(REPOSITORY_TRAINER), REPOSITORY_TRAINER.read_bytes())


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
    assert line.startswith(f"error: {checkpoint}: refused: unpickling it could run code, which no "
                           "checkpoint of train_gpt.py holds")
    assert "corrupt" not in line and "weights_only" not in line


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


# --- record 18's own checkpoints ---------------------------------------------------------------

@pytest.mark.parametrize("tool", TOOLS)
def test_a_checkpoint_in_record_18s_format_with_another_scripts_code_is_refused(
        tmp_path, capsys, tool, data):
    """modded-nanogpt's later records save dict(step, code, model, optimizers) too: the code is not
    record 18's script (its sha256 differs), so its maths may not be ours: one line, nothing run."""
    marker = tmp_path / "ran.txt"
    checkpoint = tmp_path / "state.pt"
    torch.save(dict(step=1390, code=planted(marker), optimizers=[], model={}), checkpoint)
    assert run_tool(tool, checkpoint, data) == 1
    line = one_error_line(capsys)
    assert "is not record 18's script" in line and "--trainer FILE" in line
    assert not marker.exists()


def record18_parameter_names():
    """The parameters of record 18's model, as its script names them: 12 blocks, the 8th without
    attention, three value-embedding tables, the U-net's skip weights."""
    names = ["embed.weight", "skip_weights", "lm_head.weight"]
    names += [f"value_embeds.embed.{k}.weight" for k in range(3)]
    for i in range(12):
        names += [f"blocks.{i}.lambdas", f"blocks.{i}.mlp.c_fc.weight", f"blocks.{i}.mlp.c_proj.weight"]
        if i != 7:
            names += [f"blocks.{i}.attn.{name}" for name in
                      ("lambdas", "c_q.weight", "c_k.weight", "c_v.weight", "c_proj.weight")]
    return names


@pytest.mark.slow
@pytest.mark.record18
def test_record_18s_own_checkpoint_is_scored_and_continued_by_the_repository_trainer(
        tmp_path, capsys, monkeypatch, data):
    """A checkpoint as record 18's script saves at its last step, dict(step, code, model, optimizers),
    its model's names those of the compiled model (prefixed _orig_mod.): the repository's trainer
    builds the model, a line says so, the code it carries never runs (--show_source shows it), and
    its weights give the logits of the same weights loaded by hand into that trainer's model. The
    code stands in for record 18's script, whose sha256 the tools know (its bytes are not here)."""
    trainer = common.trainer_from_source(REPOSITORY_TRAINER.read_bytes())
    torch.manual_seed(0)
    reference = trainer.GPT(50304, 12, 6, 768).eval()
    weights = reference.state_dict()
    assert sorted(weights) == sorted(record18_parameter_names())
    marker = tmp_path / "ran.txt"
    checkpoint = tmp_path / "state_step001390.pt"
    torch.save(dict(step=1390, code=planted(marker), optimizers=[],
                    model={f"_orig_mod.{name}": tensor for name, tensor in weights.items()}),
               checkpoint)
    monkeypatch.setattr(common, "RECORD18_SHA256", sha256(planted(marker).encode()))
    module, entries, line = common.open_checkpoint(str(checkpoint), needs=sample.TRAINER_NAMES)
    assert line.endswith("record 18's model: the checkpoint is record 18's own script's, whose "
                         "source it carries is not run (--show_source shows it)")
    model, options = common.build_model(module, entries, str(checkpoint), torch.device("cpu"))
    assert options == module.Hyperparameters()
    tokens = torch.randint(0, 50257, (128,))
    window = torch.tensor(14, dtype=torch.int32)
    with torch.no_grad():
        assert torch.equal(model(tokens, None, window), reference(tokens, None, window))
    assert sample.main([str(checkpoint), "--max_new_tokens", "2", "--prompt", "A"]) == 0
    assert hellaswag.main([str(checkpoint), "--data", str(data)]) == 0
    assert "record 18's model" in capsys.readouterr().err
    assert hellaswag.main([str(checkpoint), "--show_source"]) == 0
    shown = capsys.readouterr().out.splitlines()
    assert all(f"+{line}" in shown for line in planted(marker).splitlines())
    assert not marker.exists()
