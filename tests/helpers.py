"""What the tests share: the trainer under test, the one way to start a process (and kill all it
started), a result made once per session however many xdist workers ask for it, shards, small
runs, and readers of the trainer's log. Fixtures are in conftest.py."""
import atexit
import contextlib
import fcntl
import glob
import importlib.util
import inspect
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
# the trainer under test: conftest.py sets it (from --trainer) before the test modules are imported
TRAINER = REPO / "train_gpt.py"
LN_VOCAB = math.log(50304)


def import_file(name, path):
    """The Python file at path imported as module `name`, registered first (dataclasses look their
    module up)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def use_trainer(path):
    """The script at path is the trainer under test: imported as `train_gpt`, the module every later
    `import train_gpt` of this process gives, and run by the processes the tests start."""
    global TRAINER
    TRAINER = Path(path).resolve()
    return import_file("train_gpt", TRAINER)


def with_helpers(code):
    """A program's code after `import sys` and this file imported as `helpers` by its path (the
    program's sys.path is left as it is)."""
    return ("import importlib.util\nimport sys\n"
            f"spec = importlib.util.spec_from_file_location('helpers', {__file__!r})\n"
            "helpers = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(helpers)\n"
            + code)


def with_trainer(code):
    """with_helpers(code), the trainer under test imported first as `train_gpt`."""
    return with_helpers(f"helpers.use_trainer({str(TRAINER)!r})\n{code}")


def torchrun(nproc, *args):
    """The command that runs args (a script, its options) as nproc processes under torchrun."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", *map(str, args)]


def exit_as_a_rank(code):
    """A rank's end: its exit code beside its torchrun error file (for ranks_of), and no teardown:
    with torch 2.13 on CPU, a process that used torch.optim and a gloo group sometimes aborts at
    exit ("terminate called without an active exception"), which torchrun would report."""
    Path(os.environ["TORCHELASTIC_ERROR_FILE"]).with_name("exit_code").write_text(str(code))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def ranks_of(log_dir):
    """Each rank's stdout, stderr, last line left for torchrun (None: none) and exit code (None:
    not left) after a launch with `--log-dir log_dir --redirects 3`."""
    ranks = []
    for folder in sorted(Path(log_dir).glob("*/attempt_0/*"), key=lambda path: int(path.name)):
        error, code = folder / "error.json", folder / "exit_code"
        last_line = json.loads(error.read_text())["message"]["message"] if error.exists() else None
        ranks.append(dict(stdout=(folder / "stdout.log").read_text(), last_line=last_line,
                          stderr=(folder / "stderr.log").read_text(),
                          code=int(code.read_text()) if code.exists() else None))
    return ranks


# --- processes: each in a session of its own, killed with all it started -------------------------

# torchrun's variables, which a test may set in this process (monkeypatch)
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                    "MASTER_PORT", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "GROUP_WORLD_SIZE",
                    "ROLE_WORLD_SIZE")
LIVE = set()


def launch_env(**extra):
    """This process's environment without torchrun's variables, with `extra` set."""
    env = {name: value for name, value in os.environ.items()
           if name not in LAUNCH_VARIABLES and not name.startswith("TORCHELASTIC_")}
    return dict(env, **extra)


def kill_tree(process):
    """Kill the process, its group, and every process under it (found through /proc's parent
    links): torchrun starts each worker in a session of its own."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # the fields after the command's closing parenthesis: state, parent, ...
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    tree = [process.pid]
    # grows as it is read: each process's children join the list
    for pid in tree:
        tree += [child for child, parent in parents.items() if parent == pid]
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    for pid in tree[1:]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    LIVE.discard(process)


def start_process(command, **kwargs):
    """subprocess.Popen in a session of its own, its tree killed by kill_tree or, at the latest,
    when this process exits."""
    process = subprocess.Popen(command, start_new_session=True, **kwargs)
    LIVE.add(process)
    return process


@atexit.register
def kill_every_live_process():
    for process in list(LIVE):
        kill_tree(process)


@contextlib.contextmanager
def started(command, **kwargs):
    """start_process for a `with` block: its tree is killed when the block ends, however."""
    process = start_process(command, **kwargs)
    try:
        yield process
    finally:
        kill_tree(process)
        process.wait()


def run_process(command, timeout, **kwargs):
    """subprocess.run(command, capture_output=True, text=True, timeout=timeout), whose tree is
    killed when it ends, times out or the test stops."""
    with started(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                 **kwargs) as process:
        stdout, stderr = process.communicate(timeout=timeout)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def made_once(tmp_path_factory, name, make):
    """(folder, result): make(folder) and its JSON result, made once per session. Under xdist the
    first worker to ask makes it while the others wait for its lock (xdist's pattern for session
    fixtures), then they read it; a failed make is tried again by the next to ask."""
    root = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        # the session's folder, above each worker's own
        root = root.parent
    folder = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "result.json").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            (folder / "result.json").write_text(json.dumps(make(folder)))
        return folder, json.loads((folder / "result.json").read_text())


def load_records_script(name):
    """records/NAME.py as a module (records/ is not a package)."""
    return import_file(f"records_{name}", REPO / "records" / f"{name}.py")


@contextlib.contextmanager
def inductor_on_the_cpu(**extra):
    """Inductor's options for what the tests compile, and `extra`: C++ built in this process, one
    g++ run per graph, no probe build, no precompiled headers (143 MB)."""
    from torch._inductor import config as inductor_config
    options = {"compile_threads": 1, "cpp_wrapper": True, "cpp.vec_isa_ok": True,
               "cpp_cache_precompile_headers": False, **extra}
    with inductor_config.patch(options):
        yield


# --- data and small runs --------------------------------------------------------------------------

def stream_shards(folder, sizes):
    """Shards whose tokens count up through the whole stream: a slice says where it came from."""
    import train_gpt
    start = 0
    for k, size in enumerate(sizes):
        tokens = np.arange(start, start + size) % 50000
        train_gpt.write_data_shard(folder / f"s_train_{k + 1:06d}.bin", tokens)
        start += size
    return str(folder / "s_train_*.bin")


def small_shards(folder, train_tokens=(600, 600), val_tokens=2000):
    """Markov train shards of these lengths and one val shard in folder; (train glob, val glob)."""
    import train_gpt
    folder.mkdir(parents=True, exist_ok=True)
    for k, n in enumerate(train_tokens, start=1):
        train_gpt.write_data_shard(folder / f"t_{k:06d}.bin", train_gpt.markov_stream(n, seed=k))
    train_gpt.write_data_shard(folder / "v_000000.bin", train_gpt.markov_stream(val_tokens, seed=0))
    escaped = glob.escape(str(folder))
    return f"{escaped}/t_*", f"{escaped}/v_*"


# the smoke preset at 6 blocks of width 16, one head: a CPU step is mostly the 50,304-wide head
TINY_MODEL = ["--num_layers", "6", "--model_dim", "16", "--num_heads", "1"]
# one step of one 128-token sequence, validated after it
TINY_RUN = ["--preset", "smoke", "--num_iterations", "1", "--val_loss_every", "0", "--batch_size",
            "128", "--max_device_batch_size", "128", "--val_tokens", "128"]


def tiny(markov_shards, log_dir, *extra):
    """TINY_MODEL for 8 steps of 256 tokens (2 micro-batches on 1 process, 1 on each of 2),
    validated every 2 steps on 2 sequences."""
    train, val, _ = markov_shards
    return ["--preset", "smoke", "--train_files", train, "--val_files", val, *TINY_MODEL,
            "--num_iterations", "8", "--val_loss_every", "2", "--batch_size", "256",
            "--max_device_batch_size", "128", "--val_tokens", "256", "--log_dir", str(log_dir),
            *extra]


def tiny_run(train, val, log_dir, *extra):
    """tiny() for 6 steps on small_shards(), validated at the end: a shard holds 2 batches, so
    shard 2 opens at step 2."""
    return tiny((train, val, None), log_dir, "--num_iterations", "6", "--val_loss_every", "0",
                "--allow_data_repeat", "true", *extra)


def run_main(capsys, *argv):
    """main(argv) for a run it must refuse: exit code 1, one `error:` line, no traceback; gives
    stderr."""
    import train_gpt
    code = train_gpt.main(list(argv))
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("error: ") and "Traceback" not in err
    return err


def smoke_on(tmp_path, markov_shards, *argv, train=None, val=None):
    """main() on the smoke model with these shards, validating on 512 tokens; gives its exit code
    and the log folder."""
    import train_gpt
    log_dir = tmp_path / "logs"
    shards = ["--train_files", train or markov_shards[0], "--val_files", val or markov_shards[1]]
    code = train_gpt.main(["--preset", "smoke", *shards, "--log_dir", str(log_dir),
                           "--val_tokens", "512", *argv])
    return code, log_dir


# --- GPT-2's BPE ranks, for the tests that tokenise offline --------------------------------------

RANKS_HINT = ("set GPT2_TIKTOKEN to a gpt2.tiktoken file (GPT-2's BPE ranks, as the openai-whisper "
              "package ships them), or fetch tiktoken's own once online: "
              "python -c \"import tiktoken; tiktoken.get_encoding('gpt2')\"")


def gpt2_ranks():
    """A ranks file of GPT-2's BPE: $GPT2_TIKTOKEN, else one written from tiktoken's cache of its
    "gpt2" encoding (read without a download where the cache holds it); None when neither."""
    if os.environ.get("GPT2_TIKTOKEN"):
        return Path(os.environ["GPT2_TIKTOKEN"]).resolve()
    import base64
    import hashlib
    import tempfile

    import tiktoken_ext.openai_public
    cache = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR")
    cache = Path(cache or Path(tempfile.gettempdir(), "data-gym-cache"))
    urls = re.findall(r'"(https://\S+)"', inspect.getsource(tiktoken_ext.openai_public.gpt2))
    if not urls or not all((cache / hashlib.sha1(url.encode()).hexdigest()).exists() for url in urls):
        return None
    import tiktoken
    ranks = tiktoken.get_encoding("gpt2")._mergeable_ranks
    path = Path(tempfile.gettempdir(), "gpt2-from-tiktoken-cache.tiktoken")
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(f"{base64.b64encode(token).decode()} {rank}\n"
                           for token, rank in sorted(ranks.items(), key=lambda item: item[1])))
    os.replace(tmp, path)
    return path


RANKS = gpt2_ranks()
needs_ranks = pytest.mark.skipif(RANKS is None or not RANKS.is_file(),
                                 reason=f"needs GPT-2's BPE ranks: {RANKS_HINT}")


# --- the trainer's log ----------------------------------------------------------------------------

VAL_LINE = re.compile(
    r"^step:(\d+)/(\d+) val_loss:(\d+\.\d{4}) train_time:(\d+)ms step_avg:(nan|\d+\.\d{2})ms$")
TRAIN_LINE = re.compile(
    r"^step:(\d+)/(\d+) train_loss:(\d+\.\d{4}) train_time:(\d+)ms step_avg:(nan|\d+\.\d{2})ms$")
# the one line besides steps
STARTUP_LINE = re.compile(r"^startup: (\d+\.\d)s from launch to the end of step \d+")
# and lines of options and tools: profile_run.py's report, checkpoints, a resumed run's notes, a
# stopped run's last line, HellaSwag's scores
OPTION_LINES = ("profile: ", "checkpoint: ", "resumed from ", "warning: resumed ", "stopped by ",
                "hellaswag: ")


def finished_log(log_dir):
    """The one log a run wrote into log_dir."""
    logs = sorted(Path(log_dir).glob("*.txt"))
    assert len(logs) == 1, f"expected one log in {log_dir}, found {logs}"
    return logs[0]


def step_lines(log_path):
    """(The step lines, the lines after the source): each step line a val line, a train line or
    the startup line, and the closing memory line left out."""
    text = log_path.read_text()
    source = TRAINER.read_text()
    assert text.startswith(source), f"the log must begin with the exact source of {TRAINER.name}"
    rest = text[len(source):].splitlines()
    assert rest[1] == "=" * 100
    body = rest[rest.index("=" * 100, rest.index("hyperparameters:")) + 1:]
    body = [line for line in body if not line.startswith(OPTION_LINES)]
    assert re.fullmatch(r"peak memory consumption: \d+ MiB", body[-1])
    return body[:-1], rest


def val_losses(log_path):
    """{step: val loss} of a log, every other step line parsed as a train line."""
    lines, _ = step_lines(log_path)
    losses = {}
    for line in lines:
        if m := VAL_LINE.match(line):
            losses[int(m[1])] = float(m[3])
        elif not STARTUP_LINE.match(line):
            assert TRAIN_LINE.match(line), f"line does not parse: {line!r}"
    return losses
