"""evals/ start like the trainer, and the trainer's --hellaswag stops like its training: torchrun's
variables left over, files that are not regular (a named pipe, /dev/zero, a folder), options out of
range, a closed stdout, a download cut midway, a bad byte in a data file, a checkpoint whose
weights or options do not fit its trainer, a stop signal during the HellaSwag after training. Each
case is checked against what the user is left with: the exit code, the last line, stdout, the
files. The checkpoints carry the trainer under test, which the tools are given as --trainer FILE.

    python -m pytest tests/test_evals_faults.py -q
"""
import contextlib
import errno
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import asdict

import helpers
import pytest
import tiktoken
import torch
from helpers import REPO
from helpers import TRAINER
from helpers import finished_log
from helpers import launch_env
from helpers import started

import train_gpt
from evals import common
from evals import hellaswag
from evals import sample

RANKS = helpers.RANKS
# a token per byte, 50256, and ids 256 to 50255 that decode (to 4 bytes) but that no text encodes to
STAND_IN = tiktoken.Encoding(
    "bytes", pat_str=r"[\s\S]", special_tokens={"<|endoftext|>": train_gpt.EOT},
    mergeable_ranks={**{bytes([i]): i for i in range(256)},
                     **{b"\xff\xff" + i.to_bytes(2, "big"): i for i in range(256, train_gpt.EOT)}})
EXAMPLE = json.dumps(dict(ctx="A man", endings=["sat.", "ran."], label=0)) + "\n"
# the trainer under test, as the tools are given it
WITH_TRAINER = ["--trainer", str(TRAINER)]


def save_small_model(path):
    """A small random model of the trainer, saved at path as the trainer saves it (its source
    included); the global generator is left as it was."""
    options = train_gpt.Hyperparameters(num_layers=6, num_heads=1, model_dim=8, bf16_embeds=False)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(0)
        model = train_gpt.GPT.from_args(options)
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, p.size(1) ** -0.5)
    torch.save(dict(step=1, model=model.state_dict(), args=asdict(options),
                    source=TRAINER.read_bytes()), path)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """save_small_model's checkpoint."""
    return save_small_model(tmp_path_factory.mktemp("faults") / "state.pt")


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "val.jsonl"
    path.write_text(EXAMPLE * 2)
    return path


@pytest.fixture(autouse=True)
def stand_in_tokenizer(monkeypatch):
    monkeypatch.setattr(common.gpt2_tokenizer, "gpt2_encoding",
                        lambda tokenizer_file=None: STAND_IN)


def one_error_line(capsys):
    """The one line on stderr (an `error:` line, no traceback); stdout empty."""
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, (out, err)
    assert err.startswith("error: ") and "Traceback" not in err
    return err.strip()


def run_both(checkpoint, data, *options):
    """hellaswag.py and sample.py on the checkpoint with the options: their exit codes."""
    return (hellaswag.main([str(checkpoint), "--data", str(data), *WITH_TRAINER, *options]),
            sample.main([str(checkpoint), "--max_new_tokens", "1", *WITH_TRAINER, *options]))


# --- torchrun's variables left over in a shell ---------------------------------------------------

@pytest.mark.parametrize("variables", [
    dict(RANK="1"),
    # would wait up to 30 minutes for a second process
    dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29512"),
])
def test_leftover_torchrun_variables_are_one_line_on_every_tool(checkpoint, data, capsys,
                                                                monkeypatch, variables):
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert hellaswag.main([str(checkpoint), "--data", str(data), *WITH_TRAINER]) == 1
    line = one_error_line(capsys)
    assert "not started by torchrun" in line and f"`unset {' '.join(variables)}` first" in line
    assert sample.main([str(checkpoint), *WITH_TRAINER]) == 1
    assert one_error_line(capsys) == line


# --- files that are not regular -------------------------------------------------------------------

@contextlib.contextmanager
def named_pipe(path):
    """A named pipe at path, and a writer that serves every reader that opens it (each then sees
    it end at once); yields a dict whose "readers", after the block, counts them."""
    os.mkfifo(path)
    seen = dict(readers=0)
    done = threading.Event()

    def writer():
        while True:
            # blocks until a reader opens the pipe
            os.close(os.open(path, os.O_WRONLY))
            seen["readers"] += 1
            if done.is_set():
                return
    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        # release the writer with a reader of our own
        done.set()
        reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        thread.join(10)
        os.close(reader)
        seen["readers"] -= 1


def test_a_named_pipe_is_refused_without_being_opened(checkpoint, data, tmp_path, capsys):
    cases = [("checkpoint", lambda pipe: run_both(pipe, data)),
             ("--data", lambda pipe: (hellaswag.main([str(checkpoint), "--data", str(pipe),
                                                      *WITH_TRAINER]),)),
             ("--tokenizer", lambda pipe: run_both(checkpoint, data, "--tokenizer", str(pipe)))]
    for name, run in cases:
        pipe = tmp_path / f"{name.strip('-')}.fifo"
        with named_pipe(pipe) as seen:
            codes = run(pipe)
            errors = capsys.readouterr().err.splitlines()
        assert seen["readers"] == 0, f"{name}: the pipe was opened"
        assert set(codes) == {1} and len(errors) == len(codes)
        assert all(e.startswith("error: ") and str(pipe) in e and "not a regular file" in e
                   for e in errors), errors


@pytest.mark.parametrize("path", ["/dev/zero", "folder"])
def test_a_device_or_a_folder_is_refused_without_being_read(checkpoint, data, tmp_path, capsys,
                                                            path):
    if path == "folder":
        path = tmp_path
    elif not os.path.exists(path):
        pytest.skip(f"no {path} here")
    assert run_both(path, data) == (1, 1)
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 2 and all(f"{path}: not a regular file" in e for e in errors)
    assert hellaswag.main([str(checkpoint), "--data", str(path)]) == 1
    assert f"--data {path}: not a regular file" in one_error_line(capsys)


# --- options out of range -------------------------------------------------------------------------

@pytest.mark.parametrize("tool,options,message", [
    ("sample", ["--temperature", "1e-300"], "--temperature must be 0 (greedy) or from 1.89e-270"),
    ("sample", ["--temperature", "-1"], "--temperature must be 0"),
    ("sample", ["--temperature", "inf"], "--temperature must be 0"),
    ("sample", ["--temperature", "nan"], "--temperature must be 0"),
    ("sample", ["--seed", "-1"], "--seed must be from 0 to 2**64 - 1"),
    ("sample", ["--seed", str(2 ** 64)], "--seed must be from 0 to 2**64 - 1"),
    ("sample", ["--max_new_tokens", "-1"], "--max_new_tokens must be at least 0"),
    ("sample", ["--top_k", "-1"], "--top_k must be at least 0"),
    ("sample", ["--max_new_tokens", "x"], "argument --max_new_tokens: invalid int value: 'x'"),
    ("hellaswag", ["--limit", "0"], "--limit must be at least 1"),
    ("hellaswag", ["--sequence_length", "0"], "--sequence_length must be a positive multiple"),
    ("hellaswag", ["--sequence_length", "200"], "block size, 128, got 200"),
    # past the positions of the model's rotary tables
    ("hellaswag", ["--sequence_length", "65664"], "up to 65536 (the positions of its rotary tables)"),
    ("hellaswag", ["--no_such_option"], "unrecognized arguments: --no_such_option"),
])
def test_an_option_out_of_range_is_one_line(checkpoint, data, capsys, tool, options, message):
    if tool == "sample":
        assert sample.main([str(checkpoint), *WITH_TRAINER, *options]) == 1
    else:
        assert hellaswag.main([str(checkpoint), "--data", str(data), *WITH_TRAINER, *options]) == 1
    assert message in one_error_line(capsys)


def test_the_smallest_temperature_draws_the_greedy_tokens(checkpoint, capsys):
    # logits of about 1e46 in float64: the likeliest token with probability 1
    options = [str(checkpoint), "--prompt", "Hello", "--max_new_tokens", "4", *WITH_TRAINER]
    assert sample.main(options) == 0
    greedy = capsys.readouterr().out
    for temperature in ("1e-45", "1.9e-270"):
        assert sample.main([*options, "--temperature", temperature]) == 0
        assert capsys.readouterr().out == greedy


# --- a closed stdout, a cut download, a bad byte, torchrun's error file ---------------------------

@pytest.mark.slow
@helpers.needs_ranks
def test_a_closed_stdout_is_quiet(tmp_path):
    """`python evals/sample.py ... | true`: the reader has gone before the text is written."""
    path = tmp_path / "state.pt"
    save_small_model(path)
    command = [sys.executable, str(REPO / "evals" / "sample.py"), str(path),
               "--max_new_tokens", "2", "--tokenizer", str(RANKS), *WITH_TRAINER]
    read, write = os.pipe()
    os.close(read)
    with os.fdopen(write, "wb") as closed, started(
            command, stdout=closed, stderr=subprocess.PIPE, text=True,
            env=launch_env(OMP_NUM_THREADS="1")) as process:
        _, stderr = process.communicate(timeout=300)
    # the one line that names the script that built the model, written before the text
    assert process.returncode == common.CLOSED_OUTPUT and stderr.startswith("model: built by ")
    assert len(stderr.splitlines()) == 1


class CutServer(http.server.ThreadingHTTPServer):
    """Announces `size` bytes, sends `content` (fewer), and closes the connection."""

    def __init__(self, content, size):
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Length", str(server.size))
                self.end_headers()
                self.wfile.write(server.content)
                self.wfile.flush()
                self.close_connection = True

            def log_message(self, *args):
                pass
        super().__init__(("127.0.0.1", 0), Handler)
        self.content = content
        self.size = size
        self.url = f"http://127.0.0.1:{self.server_port}/hellaswag_val.jsonl"
        # polled every 10 ms for shutdown (0.5 s by default: the wait of every test's end)
        threading.Thread(target=self.serve_forever, args=(0.01,), daemon=True).start()


def test_a_download_cut_midway_is_one_line_and_saves_nothing(checkpoint, tmp_path, capsys,
                                                             monkeypatch):
    full = (EXAMPLE * 50).encode()
    server = CutServer(full[:1000], len(full))
    cached = tmp_path / "data" / "hellaswag" / "hellaswag_val.jsonl"
    blob_id = hellaswag.git_blob_id(full)
    monkeypatch.setattr(hellaswag.download, "__defaults__", (cached, server.url, blob_id, "--data"))
    try:
        assert hellaswag.main([str(checkpoint), *WITH_TRAINER]) == 1
    finally:
        server.shutdown()
        server.server_close()
    line = one_error_line(capsys)
    assert "IncompleteRead" in line and "nothing was saved" in line and "--data FILE" in line
    assert not cached.parent.exists() or not any(cached.parent.iterdir())


def test_the_download_temp_file_names_host_and_process(tmp_path, monkeypatch):
    content = EXAMPLE.encode()
    server = CutServer(content, len(content))
    renamed = []
    real_replace = os.replace

    def replace(source, target):
        renamed.append(os.path.basename(source))
        real_replace(source, target)
    monkeypatch.setattr(hellaswag.os, "replace", replace)
    cached = tmp_path / "hellaswag_val.jsonl"
    try:
        hellaswag.download(cached, server.url, hellaswag.git_blob_id(content))
    finally:
        server.shutdown()
        server.server_close()
    assert cached.read_bytes() == content and os.listdir(tmp_path) == [cached.name]
    assert renamed == [f"{cached.name}.{socket.gethostname()}.{os.getpid()}.tmp"]


def test_a_bad_byte_is_reported_with_its_line(checkpoint, tmp_path, capsys):
    data = tmp_path / "val.jsonl"
    data.write_bytes(EXAMPLE.encode() * 2 + b'{"ctx": "caf\xe9", "endings": ["a", "b"]}\n')
    assert hellaswag.main([str(checkpoint), "--data", str(data), *WITH_TRAINER]) == 1
    assert f"--data {data}, line 3: not UTF-8 text" in one_error_line(capsys)


def test_under_torchrun_the_first_process_of_a_node_prints_the_error_line(checkpoint, data,
                                                                          capsys, monkeypatch,
                                                                          torchrun_worker):
    torchrun_worker()
    assert hellaswag.main([str(checkpoint), "--data", str(data), "--limit", "0"]) == 1
    assert "--limit must be at least 1" in one_error_line(capsys)
    # the second process of a node: the console has the line once
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert sample.main([str(checkpoint), "--top_k", "-1"]) == 1
    assert capsys.readouterr() == ("", "")


def test_ctrl_c_in_a_tool_is_one_line_and_130(checkpoint, data, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(hellaswag, "score", interrupted)
    assert hellaswag.main([str(checkpoint), "--data", str(data), *WITH_TRAINER]) == 130
    out, err = capsys.readouterr()
    # after the line that names the script that built the model
    assert out == "" and err.splitlines()[1:] == ["stopped by SIGINT"]


# --- a stop signal during the trainer's HellaSwag -------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_during_the_trainers_hellaswag_stops_it_with_no_score(
        markov_shards, tmp_path, capsys, monkeypatch, signum):
    data = tmp_path / "val.jsonl"
    data.write_text(EXAMPLE * 4)
    real_score = hellaswag.score

    def score_after_a_signal(*args, **kwargs):
        # the signal arrives as the scoring starts
        os.kill(os.getpid(), signum)
        return real_score(*args, **kwargs)
    monkeypatch.setattr(hellaswag, "score", score_after_a_signal)
    train, val, _ = markov_shards
    options = ["--preset", "smoke", "--train_files", train, "--val_files", val,
               "--num_layers", "6", "--model_dim", "16", "--num_heads", "1",
               "--num_iterations", "1", "--val_loss_every", "0", "--batch_size", "128",
               "--max_device_batch_size", "128", "--val_tokens", "128",
               "--save_checkpoint", "true", "--log_dir", str(tmp_path / "logs"),
               "--hellaswag", "true", "--hellaswag_data", str(data)]
    assert train_gpt.main(options) == 128 + signum
    out, err = capsys.readouterr()
    log = finished_log(tmp_path / "logs")
    name = signal.Signals(signum).name
    last = log.read_text().splitlines()[-1]
    assert last.startswith(f"stopped by {name} after step 1, in HellaSwag's scoring (no score); "
                           "resume with: ")
    assert err.splitlines()[-1] == last
    assert "acc_norm=" not in out and "acc_norm=" not in log.read_text().split("=" * 100)[-1]
    assert list(log.parent.glob(f"{log.stem}/state_step000001.pt"))


# --- a cached download that is not a file, a save that fails ---------------------------------------

# no server listens there: a download tried is an error that names it
NO_SERVER = "http://127.0.0.1:9/hellaswag_val.jsonl"


@pytest.mark.parametrize("kind", ["folder", "named pipe", "link to a device"])
def test_a_cached_hellaswag_that_is_not_a_file_is_refused_without_being_read(tmp_path, kind):
    cached = tmp_path / "hellaswag_val.jsonl"
    if kind == "folder":
        cached.mkdir()
    elif kind == "link to a device":
        cached.symlink_to(os.devnull)
    with contextlib.ExitStack() as stack:
        if kind == "named pipe":
            seen = stack.enter_context(named_pipe(cached))
        with pytest.raises(common.EvalError) as refused:
            hellaswag.download(cached, NO_SERVER, hellaswag.GIT_BLOB_ID)
    if kind == "named pipe":
        assert seen["readers"] == 0
    assert str(refused.value) == (f"{cached}: not a regular file (a folder, a pipe or a device) "
                                  "where HellaSwag's download is kept: remove it, and run again "
                                  "to download it")


def test_a_download_that_cannot_be_saved_leaves_no_temp_file(tmp_path, monkeypatch):
    content = EXAMPLE.encode()
    server = CutServer(content, len(content))

    def disk_full(source, target):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(hellaswag.os, "replace", disk_full)
    cached = tmp_path / "hellaswag_val.jsonl"
    try:
        with pytest.raises(common.EvalError, match="cannot save HellaSwag"):
            hellaswag.download(cached, server.url, hellaswag.git_blob_id(content))
    finally:
        server.shutdown()
        server.server_close()
    assert os.listdir(tmp_path) == []


def test_an_example_longer_than_the_models_positions_is_refused():
    examples = [("A man", ["sat.", "ran."], 0), ("x" * 65536, ["sat.", "ran."], 0)]
    with pytest.raises(common.EvalError, match="example 2 of the data: 65,542 tokens"):
        hellaswag.render(examples, STAND_IN)


# --- a stdout that cannot be written, or cannot show the text -------------------------------------

@pytest.mark.parametrize("tool", ["hellaswag", "sample", "show_source"])
def test_a_full_stdout_is_one_error_line(checkpoint, data, tmp_path, capsys, monkeypatch, tool):
    if tool == "show_source":
        # a source with a line more than train_gpt.py: a diff to print
        entries = torch.load(checkpoint, map_location="cpu", weights_only=True)
        checkpoint = tmp_path / "fork.pt"
        torch.save({**entries, "source": entries["source"] + b"# a fork\n"}, checkpoint)
    with open("/dev/full", "w") as full:
        monkeypatch.setattr(sys, "stdout", full)
        if tool == "hellaswag":
            code = hellaswag.main([str(checkpoint), "--data", str(data), *WITH_TRAINER])
        elif tool == "sample":
            code = sample.main([str(checkpoint), "--max_new_tokens", "1", *WITH_TRAINER])
        else:
            code = sample.main([str(checkpoint), "--show_source"])
        err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert err.splitlines()[-1] == ("error: cannot write to stdout (No space left on device): send "
                                    "the output somewhere it can be written")


@pytest.mark.parametrize("failure", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 24.00 GiB"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate "
                 "memory: you tried to allocate 25600000000 bytes. Error code 12")])
def test_memory_that_runs_out_is_one_line_saying_to_ask_for_less(checkpoint, capsys, monkeypatch,
                                                                  failure):
    def generate_batch(*args, **kwargs):
        raise failure
    monkeypatch.setattr(sample, "generate_batch", generate_batch)
    code = sample.main([str(checkpoint), "--max_new_tokens", "1", "--num_samples", "100000000",
                        *WITH_TRAINER])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert err.splitlines()[-1].startswith("error: out of memory (") and "fewer --num_samples" in err


def test_another_runtime_error_keeps_its_traceback(checkpoint, monkeypatch):
    def generate_batch(*args, **kwargs):
        raise RuntimeError("a bug")
    monkeypatch.setattr(sample, "generate_batch", generate_batch)
    with pytest.raises(RuntimeError, match="a bug"):
        sample.main([str(checkpoint), "--max_new_tokens", "1", *WITH_TRAINER])


# --- a checkpoint's options and weights -----------------------------------------------------------

@pytest.mark.parametrize("changed,message", [
    (dict(num_iterations=0), "(--num_iterations must be at least 1; got 0)"),
    (dict(window_start=-100000), "(--window_start must be from 128 (one attention block) to 65536"),
    (dict(window_end=-100000), "(--window_end must be from 128 (one attention block) to 65536"),
])
def test_a_checkpoint_with_invalid_options_is_one_line(checkpoint, data, tmp_path, capsys,
                                                       changed, message):
    entries = torch.load(checkpoint, map_location="cpu", weights_only=True)
    invalid = tmp_path / "invalid.pt"
    torch.save({**entries, "args": {**entries["args"], **changed}}, invalid)
    assert run_both(invalid, data) == (1, 1)
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 2 and all(line.startswith(f"error: {invalid}: its saved options are "
                                                    f"invalid {message}") for line in errors)


def test_options_the_trainer_lacks_are_named_in_a_warning(checkpoint, tmp_path, capsys):
    entries = torch.load(checkpoint, map_location="cpu", weights_only=True)
    other = tmp_path / "other.pt"
    torch.save({**entries, "args": {**entries["args"], "option_of_another_fork": 3}}, other)
    assert sample.main([str(other), "--max_new_tokens", "1", *WITH_TRAINER]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning:" in line]
    assert len(warnings) == 1 and "--option_of_another_fork 3" in warnings[0]


def test_options_that_ask_for_an_impossible_model_are_named_as_options(checkpoint, data, tmp_path,
                                                                        capsys):
    entries = torch.load(checkpoint, map_location="cpu", weights_only=True)
    invalid = tmp_path / "invalid.pt"
    torch.save({**entries, "args": {**entries["args"], "model_dim": 100, "num_heads": 6}}, invalid)
    assert run_both(invalid, data) == (1, 1)
    for line in capsys.readouterr().err.splitlines():
        assert line.startswith(f"error: {invalid}: its saved options are invalid (")
        assert "--model_dim" in line
    # a trainer whose rules let them through: the model cannot be built with them
    lenient = tmp_path / "lenient.py"
    lenient.write_bytes(TRAINER.read_bytes() + b"\n\ndef check_hyperparameters(args):\n    pass\n")
    torch.save({**entries, "args": {**entries["args"], "num_heads": 0}}, invalid)
    assert sample.main([str(invalid), "--trainer", str(lenient)]) == 1
    line = capsys.readouterr().err.splitlines()[-1]
    assert line.startswith(f"error: {invalid}: its options (") and "--num_heads 0" in line
    assert "ask for a model its trainer cannot build (ZeroDivisionError" in line


def test_weights_that_do_not_fit_name_the_first_mismatch_and_both_shapes(checkpoint, data, tmp_path,
                                                                          capsys):
    entries = torch.load(checkpoint, map_location="cpu", weights_only=True)
    weights = dict(entries["model"])
    # the first matrix, with 8 rows more
    name = next(name for name, tensor in weights.items() if tensor.ndim == 2)
    rows, columns = weights[name].shape
    weights[name] = torch.zeros(rows + 8, columns)
    other = tmp_path / "other.pt"
    torch.save({**entries, "model": weights}, other)
    assert run_both(other, data) == (1, 1)
    for line in capsys.readouterr().err.splitlines():
        assert line.startswith(f"error: {other}: its weights do not fit the model its trainer "
                               f"builds ({name} is ({rows + 8}, {columns}) there, ({rows}, "
                               f"{columns}) in the model): pass --trainer FILE")
    del weights[name]
    torch.save({**entries, "model": weights}, other)
    assert sample.main([str(other), *WITH_TRAINER]) == 1
    assert f"(the model's {name} is not in the checkpoint)" in one_error_line(capsys)
