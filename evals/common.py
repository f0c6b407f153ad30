"""What the evaluation tools share: the start-up, the code that builds a checkpoint's model, the
tokenizer, the errors. Nothing of the trainer is imported here: a checkpoint carries the source of
the script that wrote it, and its model is built from that source, imported under a name of its own
(trainer_ and its sha256), only when it is a file the user has: the script the checkpoint records as
its writer, still there with the same bytes; a .py file of this repository; or the file given as
--trainer (the model is then built from that file). Anything else stops the tool before any of it
runs, unless --trust_checkpoint_code. A checkpoint is read as tensors and plain data only
(weights_only=True), so unpickling it runs nothing. The trainer's --hellaswag hands over its own
model."""
import argparse
import ast
import contextlib
import difflib
import hashlib
import importlib.util
import io
import json
import linecache
import os
import pickle
import signal
import stat
import sys
import tempfile
import time
import zipfile
from dataclasses import fields
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
# data/gpt2_tokenizer.py
if str(REPO / "data") not in sys.path:
    sys.path.insert(0, str(REPO / "data"))
import gpt2_tokenizer  # noqa: E402

# what a checkpoint written before checkpoints carried their source is scored with
REPOSITORY_TRAINER = REPO / "train_gpt.py"
# the exit code of a process whose output pipe was closed by its reader (128 + SIGPIPE), as a
# shell's tools end
CLOSED_OUTPUT = 141


class EvalError(Exception):
    """A mistake the user can fix: the tools print its message as one `error:` line."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse's, but a mistake in the options is one `error:` line (an EvalError)."""

    def error(self, message):
        raise EvalError(f"{message} (see --help)")


def regular_file(path, option=""):
    """path, when it names a regular file; anything else is refused without being opened (a named
    pipe would wait for a writer, /dev/zero never ends). option: the flag that gave it, if any."""
    where = f"{option} {path}".strip()
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise EvalError(f"{where}: cannot read it ({e.strerror})") from None
    if not stat.S_ISREG(mode):
        raise EvalError(f"{where}: not a regular file (a folder, a pipe or a device): give a file")
    return path


def trainer_of(thing):
    """The trainer module that defined thing's class (a model, its options): where its constants
    (EOT, BLOCK_SIZE) and functions are read from, whether the trainer handed the model over or it
    was built from a checkpoint's source."""
    return sys.modules[type(thing).__module__]


# the trainers built from sources in this process, by their sha256: each source is imported once
TRAINERS = {}


def trainer_from_source(source):
    """The module a trainer's source (bytes) defines, imported under the name trainer_<sha256
    prefix> from a private temp file (a real file: the trainer reads its own at import, and Triton
    reads its kernels' source), removed once imported; its lines stay known to tracebacks."""
    digest = sha256(source)
    if digest in TRAINERS:
        return TRAINERS[digest]
    name = f"trainer_{digest[:16]}"
    with tempfile.TemporaryDirectory(prefix="evals-trainer-") as folder:
        path = os.path.join(folder, f"{name}.py")
        Path(path).write_bytes(source)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        # dataclasses look their module up while it is imported
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    lines = source.decode("utf-8", errors="replace").splitlines(keepends=True)
    # no modification time: linecache keeps the entry although the file is gone
    linecache.cache[path] = (len(source), None, lines, path)
    TRAINERS[digest] = module
    return module


def add_code_options(parser):
    """The options that choose the code that builds a checkpoint's model, a group of their own in
    --help."""
    group = parser.add_argument_group(
        "the code that builds the model",
        "A checkpoint carries the source of the script that wrote it, which would run as code. The "
        "model is built from it only when it is a file you have: the script the checkpoint records "
        "as its writer, unchanged, or a .py file of this repository. Otherwise the tool stops, "
        "before any of it runs, and says how it differs from this repository's train_gpt.py.")
    choice = group.add_mutually_exclusive_group()
    choice.add_argument("--trainer", metavar="FILE",
                        help="build the model with FILE, your copy of the trainer (a fork whose "
                        "script has moved, say); a warning says when it is not the source the "
                        "checkpoint carries")
    choice.add_argument("--trust_checkpoint_code", action="store_true",
                        help="run the source the checkpoint carries although no file you have "
                        "holds it: only for checkpoints of people you trust")
    group.add_argument("--show_source", action="store_true",
                       help="print how the source the checkpoint carries differs from this "
                       "repository's train_gpt.py (a unified diff) and exit, running none of it")


def read_checkpoint(path):
    """A checkpoint's entries, its tensors mapped from the file, not read (only the weights are
    needed, not the optimiser states beside them). Tensors and plain data only: an object whose
    unpickling would call a function is refused, whatever TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD says."""
    regular_file(path)
    try:
        # the zip's CRCs catch a flipped byte in the weights, which torch.load misses
        if damaged := zipfile.ZipFile(path).testzip():
            raise ValueError(f"{damaged} fails its CRC check")
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        if not {"model", "args"} <= checkpoint.keys():
            raise KeyError(f"no {'model' if 'model' not in checkpoint else 'args'} in it")
    except OSError as e:
        raise EvalError(f"{path}: cannot read it ({e.strerror or e})") from None
    except pickle.UnpicklingError as e:
        raise EvalError(not_data(path, e)) from None
    except Exception as e:
        raise EvalError(f"{path}: not a checkpoint written by train_gpt.py, or a corrupt or "
                        f"truncated one ({type(e).__name__}: {first_line(e)})") from None
    return checkpoint


def not_data(path, error):
    """The line for a checkpoint that torch's weights-only unpickler refused (or whose pickle is
    damaged): every refusal, however torch words it, is this tool's, never torch's advice to load
    it with weights_only=False."""
    message = str(error)
    if "Weights only load failed" not in message:
        return (f"{path}: not a checkpoint written by train_gpt.py, or a corrupt or truncated one "
                f"(UnpicklingError: {first_line(error)})")
    return (f"{path}: refused: unpickling it could run code, as it holds more than tensors and "
            f"plain data ({refused_object(message)}), which no checkpoint of train_gpt.py does. "
            "Get the file again from whoever made it; if you made it and trust it, load it with "
            "torch.load(..., weights_only=False) and save its tensors and plain data")


def refused_object(message):
    """What torch's weights-only unpickler refused, in its words, from its message: the first line
    of it that is not torch's advice (which names weights_only)."""
    # "... WeightsUnpickler error: Unsupported global: GLOBAL builtins.exec was not an allowed
    # global by default. ..."; else the refusal is on a line of its own: "Trying to load
    # unsupported GLOBAL posix.system whose module posix is blocked."
    if "WeightsUnpickler error:" in message:
        message = message.rpartition("WeightsUnpickler error:")[2]
    else:
        message = message.removeprefix("Weights only load failed.")
    for line in message.splitlines():
        line = line.strip()
        if line and "weights_only" not in line:
            return line.split(" was not ")[0].split(". ")[0].rstrip(".")
    return "an object it does not load as data"


def first_line(error):
    return (str(error).splitlines() or [""])[0]


def sha256(data):
    return hashlib.sha256(data).hexdigest()


# the hex digits of a sha256 that name a source in the tools' lines
SHORT_SHA = 12


def carried_source(checkpoint, path):
    """The trainer source the checkpoint carries, as bytes; None when it carries none (written
    before checkpoints did)."""
    source = checkpoint.get("source")
    if isinstance(source, str):
        source = source.encode()
    if source is not None and not isinstance(source, bytes):
        raise EvalError(f"{path}: its source is a {type(source).__name__}, not a script's text: "
                        "not a checkpoint written by train_gpt.py")
    return source


def recorded_script(checkpoint):
    """The path of the script that wrote the checkpoint, as it records it; None when it records
    none (older checkpoints)."""
    script = checkpoint.get("script")
    if isinstance(script, str):
        return script
    return None


def holds(path, source):
    """Whether path is a regular file whose bytes are source. Its size is compared first: a device
    or a named pipe is never opened, a large file never read."""
    try:
        status = os.stat(path)
        if not stat.S_ISREG(status.st_mode) or status.st_size != len(source):
            return False
        return Path(path).read_bytes() == source
    # a path with a NUL byte in it is a ValueError
    except (OSError, ValueError):
        return False


def repository_file_holding(source):
    """A .py file of this repository (outside its hidden folders) whose bytes are source, or
    None."""
    for folder, subfolders, names in os.walk(REPO):
        subfolders[:] = sorted(name for name in subfolders if not name.startswith("."))
        for name in sorted(names):
            path = os.path.join(folder, name)
            if name.endswith(".py") and holds(path, source):
                return path
    return None


def unified_diff(old, new, old_name, new_name):
    """The unified diff from old to new (bytes), as lines, each ending in a newline."""
    def lines(source):
        return source.decode("utf-8", errors="replace").splitlines(keepends=True)
    diff = difflib.unified_diff(lines(old), lines(new), old_name, new_name)
    ended = []
    for line in diff:
        if not line.endswith("\n"):
            line += "\n"
        ended.append(line)
    return ended


def changed_lines(diff):
    """(added, removed): the lines a unified diff adds and removes."""
    hunks = [line for line in diff[2:] if not line.startswith("@@")]
    added = sum(line.startswith("+") for line in hunks)
    removed = sum(line.startswith("-") for line in hunks)
    return added, removed


def in_lines(count):
    """count lines, in words."""
    if count == 1:
        return "1 line"
    return f"{count} lines"


def against_repository_trainer(source):
    """In words: how source differs from this repository's train_gpt.py."""
    try:
        ours = REPOSITORY_TRAINER.read_bytes()
    except OSError as e:
        return f"this repository's train_gpt.py cannot be read to compare ({e.strerror})"
    if source == ours:
        return "it is this repository's train_gpt.py, byte for byte"
    added, removed = changed_lines(unified_diff(ours, source, "train_gpt.py", "source"))
    return (f"{in_lines(added + removed)} differ from this repository's train_gpt.py ({added} "
            f"added, {removed} removed)")


def read_trainer_file(trainer_file):
    """The bytes of --trainer FILE."""
    regular_file(trainer_file, "--trainer")
    try:
        return Path(trainer_file).read_bytes()
    except OSError as e:
        raise EvalError(f"--trainer {trainer_file}: cannot read it ({e.strerror})") from None


def trainer_code(path, checkpoint, trainer_file=None, trust=False):
    """(the source that builds the checkpoint's model, the line that says whose it is): the file
    --trainer names; else this repository's train_gpt.py for a checkpoint that carries no source,
    after a warning; else the source it carries when it is a file the user has (the script it
    records, unchanged, or a .py file of this repository), or with trust after a warning. Anything
    else is an EvalError, raised before any of the source runs."""
    source = carried_source(checkpoint, path)
    if trainer_file:
        code = read_trainer_file(trainer_file)
        if source is not None and code != source:
            warn(f"warning: --trainer {trainer_file} (sha256 {sha256(code)[:SHORT_SHA]}) is not "
                 f"the source {path} carries (sha256 {sha256(source)[:SHORT_SHA]}): the model is "
                 f"built by {trainer_file}, with the checkpoint's weights")
        return code, built_by(trainer_file, code, "given as --trainer")
    if source is None:
        warn(f"warning: {path} carries no trainer source (written before checkpoints did): "
             f"scored as {REPOSITORY_TRAINER.name} of this repository, which may not be the model "
             "that wrote it")
        try:
            code = REPOSITORY_TRAINER.read_bytes()
        except OSError as e:
            raise EvalError(f"{REPOSITORY_TRAINER}: cannot read it ({e.strerror})") from None
        return code, built_by(REPOSITORY_TRAINER, code, "this repository's")
    script = recorded_script(checkpoint)
    if script is not None and holds(script, source):
        return source, built_by(script, source, "the script that wrote the checkpoint")
    local = repository_file_holding(source)
    if local is not None:
        return source, built_by(local, source, "a file of this repository")
    if trust:
        warn(f"warning: {path}: running the trainer source it carries (sha256 {sha256(source)}), "
             f"which is no file you have, as --trust_checkpoint_code asks; "
             f"{against_repository_trainer(source)}")
        return source, (f"model: built by the source {path} carries (sha256 "
                        f"{sha256(source)[:SHORT_SHA]}), trusted")
    raise EvalError(refusal(path, source, script))


def built_by(script, source, why):
    """The line that names the script that built the model."""
    digest = sha256(source)[:SHORT_SHA]
    return f"model: built by {os.path.realpath(script)} (sha256 {digest}), {why}"


def refusal(path, source, script):
    """The line for a checkpoint whose source is no file the user has."""
    if script is None:
        writer = "it records no script as its writer"
    elif os.path.isfile(script):
        writer = f"the script that wrote it, {script}, has other bytes now"
    else:
        writer = f"the script that wrote it, {script}, is not there"
    return (f"{path}: the trainer source it carries (sha256 {sha256(source)}) is no file you "
            f"have ({writer}, and no .py file of this repository holds it); "
            f"{against_repository_trainer(source)} (--show_source prints them). It would run as "
            "code: pass --trainer FILE to build the model with your own copy of the trainer, or "
            "--trust_checkpoint_code to run the source it carries if you trust who made it")


# the names of a trainer module that common.py uses; each tool adds its own (TRAINER_NAMES)
TRAINER_NAMES = ("UserError", "check_launch_environment", "setup_device", "start_process_group",
                 "Hyperparameters", "check_hyperparameters", "GPT", "window_blocks_at")


def defined_names(statements):
    """The names that statements define at their level (in the branches of an if, a try or a
    with too): what a module of them would have, read without running any of it."""
    names = set()
    for statement in statements:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(statement.name)
        elif isinstance(statement, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = getattr(statement, "targets", None) or [statement.target]
            for target in targets:
                names.update(node.id for node in ast.walk(target) if isinstance(node, ast.Name))
        elif isinstance(statement, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in statement.names)
        elif isinstance(statement, (ast.If, ast.Try, ast.With)):
            branches = [statement.body, getattr(statement, "orelse", []),
                        getattr(statement, "finalbody", [])]
            branches += [handler.body for handler in getattr(statement, "handlers", [])]
            for branch in branches:
                names |= defined_names(branch)
    return names


def check_is_trainer(path, source, line, needs):
    """Refuse, before any of it runs, a source that does not define at its top level every name of
    needs (a file that only has the checkpoint's bytes, a data script, an older trainer): it is
    parsed, not imported."""
    origin = line.removeprefix("model: built by ")
    try:
        tree = ast.parse(source)
    # a NUL byte is a ValueError
    except (SyntaxError, ValueError) as e:
        raise EvalError(f"{path}: its trainer ({origin}) is not Python ({type(e).__name__}: "
                        f"{first_line(e)}); nothing of it was run: pass --trainer FILE, a copy of "
                        "train_gpt.py") from None
    defined = defined_names(tree.body)
    missing = [name for name in needs if name not in defined]
    if missing:
        raise EvalError(f"{path}: its trainer ({origin}) is not a trainer this tool can use: it "
                        f"does not define {', '.join(missing[:4])}; nothing of it was run: pass "
                        "--trainer FILE, a copy of train_gpt.py that defines them")


def open_checkpoint(path, trainer_file=None, trust=False, needs=TRAINER_NAMES):
    """(the trainer module that builds the checkpoint's model, its entries, the line that names
    that trainer's script): the module is imported from the source trainer_code gives, only once
    that source is known to be the user's choice and to define every name of needs (the names the
    tool uses)."""
    checkpoint = read_checkpoint(path)
    source, line = trainer_code(path, checkpoint, trainer_file, trust)
    check_is_trainer(path, source, line, needs)
    try:
        trainer = trainer_from_source(source)
    except Exception as e:
        origin = line.removeprefix("model: built by ")
        raise EvalError(f"{path}: its trainer ({origin}) fails to import "
                        f"({type(e).__name__}: {first_line(e)})") from None
    return trainer, checkpoint, line


def show_source(path):
    """--show_source: how the source the checkpoint carries differs from this repository's
    train_gpt.py, a unified diff on stdout (a line on stderr says how much); none of it runs."""
    checkpoint = read_checkpoint(path)
    source = carried_source(checkpoint, path)
    if source is None:
        raise EvalError(f"{path} carries no trainer source (written before checkpoints did): its "
                        f"model would be built by this repository's {REPOSITORY_TRAINER.name}")
    try:
        ours = REPOSITORY_TRAINER.read_bytes()
    except OSError as e:
        raise EvalError(f"{REPOSITORY_TRAINER}: cannot read it ({e.strerror})") from None
    name = recorded_script(checkpoint) or f"the source {path} carries"
    diff = unified_diff(ours, source, "train_gpt.py", name)
    warn(f"{path}: the trainer source it carries (sha256 {sha256(source)}): "
         f"{against_repository_trainer(source)}")
    if speaks():
        print_out("".join(diff), end="")
    return 0


# options about the machine that trained (its files, folders and kernels), not about the model:
# checked there; here their defaults stand in for them
MACHINE_OPTIONS = ("train_files", "val_files", "log_dir", "hellaswag_data", "tokenizer", "resume",
                   "compile", "compile_cache", "fused_head_loss")


def run_options(trainer, checkpoint, path):
    """The run's options, as its trainer's Hyperparameters (those the trainer no longer has left
    out), checked by its trainer's check_hyperparameters (but those of MACHINE_OPTIONS): a value
    no run could have had is an error, not a traceback or a nonsense score."""
    try:
        known = {f.name for f in fields(trainer.Hyperparameters)}
        saved = checkpoint["args"]
        options = trainer.Hyperparameters(**{k: v for k, v in saved.items() if k in known})
    except Exception as e:
        raise EvalError(f"{path}: its options do not fit its trainer's "
                        f"({type(e).__name__}: {first_line(e)})") from None
    defaults = trainer.Hyperparameters()
    here = {name: getattr(defaults, name) for name in MACHINE_OPTIONS if name in known}
    try:
        trainer.check_hyperparameters(replace(options, **here))
    except Exception as e:
        if isinstance(e, trainer.UserError):
            problem = str(e)
        else:
            problem = f"{type(e).__name__}: {first_line(e)}"
        raise EvalError(f"{path}: its saved options are invalid ({problem}): no run of its "
                        "trainer wrote it so; get the checkpoint again from whoever made it") from None
    return options


def build_model(trainer, checkpoint, path, device, line=None):
    """The checkpoint's model, built by its trainer, in eval mode on device, and the run's options;
    then line (which script built it) on stderr."""
    args = run_options(trainer, checkpoint, path)
    try:
        model = trainer.GPT.from_args(args, device)
        model.load_state_dict(checkpoint["model"])
    except Exception as e:
        raise EvalError(f"{path}: its weights do not fit the model its trainer builds "
                        f"({type(e).__name__}: {first_line(e)})") from None
    if line:
        warn(line)
    return model.to(device).eval(), args


def load_model(path, device, trainer_file=None, trust=False):
    """The model of a checkpoint that train_gpt.py (or a copy of it) wrote, in eval mode on device,
    and the run's options; trainer_file and trust as the tools' --trainer and
    --trust_checkpoint_code."""
    trainer, checkpoint, _ = open_checkpoint(path, trainer_file, trust)
    return build_model(trainer, checkpoint, path, device)


def checkpoint_step(checkpoint, args, path):
    """The step the checkpoint was saved at (a run saves one at its end, or every
    --checkpoint_every steps); num_iterations, its end, when it records none."""
    step = checkpoint.get("step", args.num_iterations)
    if type(step) is not int or not 0 <= step <= args.num_iterations:
        raise EvalError(f"{path}: its step, {step!r}, is not one of its run's 0 to "
                        f"{args.num_iterations}: not a checkpoint written by train_gpt.py")
    return step


def trained_window_blocks(args, step=None):
    """The attention window, in blocks, that the model had at step (by default the end of its
    training)."""
    if step is None:
        step = args.num_iterations
    return trainer_of(args).window_blocks_at(step, args)


def encoding(tokenizer_file=None):
    """GPT-2's BPE: tiktoken's own (downloaded once), or built from a ranks file (offline)."""
    if tokenizer_file:
        regular_file(tokenizer_file, "--tokenizer")
    try:
        return gpt2_tokenizer.gpt2_encoding(tokenizer_file)
    except gpt2_tokenizer.TokenizerError as e:
        raise EvalError(str(e)) from None


def start_processes(trainer):
    """The trainer's own start-up checks (torchrun's variables left over in a shell, the device),
    then rank, world size and device, and the process group when there are several processes."""
    try:
        trainer.check_launch_environment()
        rank, world_size, device = trainer.setup_device()
    except trainer.UserError as e:
        raise EvalError(str(e)) from None
    if world_size > 1:
        trainer.start_process_group(device)
    return rank, world_size, device


def speaks():
    """Whether this process prints the errors and warnings: rank 0 of a process group, else the
    first process on each node under torchrun, else every process (left-over variables)."""
    if dist.is_initialized():
        return dist.get_rank() == 0
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return os.environ.get("LOCAL_RANK", "0") == "0"
    return True


def warn(line):
    if speaks():
        print(line, file=sys.stderr, flush=True)


def tell_launcher(line):
    """The last line into the error file torchrun names for this process, in the format of its
    ErrorHandler: torchrun's report of the failure quotes it, not an empty traceback."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    message = dict(message=line, extraInfo=dict(timestamp=str(int(time.time()))))
    with contextlib.suppress(OSError):
        Path(path).write_text(json.dumps(dict(message=message)))


def print_out(text, end="\n"):
    """text to stdout, now: a reader that has gone (`... | head`) is met here, not at exit; a
    character stdout's encoding cannot show is a replacement character; a stdout that cannot be
    written (a full disk) is an EvalError, and what it kept is dropped."""
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(errors="replace")
    try:
        print(text, end=end, flush=True)
    except BrokenPipeError:
        raise
    except OSError as e:
        # what is still buffered goes nowhere, and exiting does not fail again on it
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise EvalError(f"cannot write to stdout ({e.strerror or e}): send the output somewhere "
                        "it can be written") from None


def run_main(body):
    """body() as a tool's main: its exit code, or 1 after one `error:` line; 130 after Ctrl-C; 141
    and nothing more when stdout's reader has gone. The process group is torn down either way."""
    try:
        return body()
    except EvalError as e:
        line = f"error: {e}"
        warn(line)
        tell_launcher(line)
        return 1
    except (torch.OutOfMemoryError, RuntimeError) as e:
        # a CPU allocation that fails is a RuntimeError of this wording
        if not isinstance(e, torch.OutOfMemoryError) and "can't allocate memory" not in str(e):
            raise
        line = (f"error: out of memory ({first_line(e)[:200]}): ask for less at once, fewer "
                "--num_samples (sample.py) or a shorter --sequence_length (hellaswag.py)")
        warn(line)
        tell_launcher(line)
        return 1
    except KeyboardInterrupt:
        # Ctrl-C: one line, not a traceback, and the shell's code for it
        warn("stopped by SIGINT")
        return 128 + signal.SIGINT
    except BrokenPipeError:
        # what is still buffered for stdout goes nowhere, and exiting does not fail again on it
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return CLOSED_OUTPUT
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
