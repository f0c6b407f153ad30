"""What the evaluation tools share: start-up, the code that builds a checkpoint's model, tokenizer,
errors. One rule chooses that code: a checkpoint's source runs only when it is this repository's
train_gpt.py byte for byte; else --trainer FILE (the user's copy) builds the model, or, with
--trust_checkpoint_code, the source after a warning. The recorded script path is information only."""
import argparse
import ast
import contextlib
import difflib
import hashlib
import importlib.util
import inspect
import os
import signal
import stat
import sys
import tempfile
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

# the one trainer whose source runs without --trainer or --trust_checkpoint_code
REPOSITORY_TRAINER = REPO / "train_gpt.py"
# the positions of the model's rotary tables: no document may be longer
MAX_POSITIONS = 65536
# the exit code of a process whose output pipe was closed by its reader (128 + SIGPIPE)
CLOSED_OUTPUT = 141
# sha256 of record 18's train_gpt.py (modded-nanogpt 45544f53): its checkpoints carry it as `code`
RECORD18_SHA256 = "dab35b5cfc5adab1df3d5844f46888ac67b10efd469f561b893bda58c5754d46"
# the names of a trainer module that common.py uses; each tool adds its own (TRAINER_NAMES)
TRAINER_NAMES = ("UserError", "check_launch_environment", "setup_device", "start_process_group",
                 "Hyperparameters", "check_hyperparameters", "GPT")
# options about the machine that trained (files, kernels), checked there: defaults stand in here
MACHINE_OPTIONS = {"train_files", "val_files", "log_dir", "hellaswag_data", "tokenizer", "resume",
                   "compile", "compile_cache", "fused_head_loss"}


class EvalError(Exception):
    """A mistake the user can fix: the tools print its message as one `error:` line."""


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):
        raise EvalError(f"{message} (see --help)")


def regular_file(path, option="", read=False):
    """path (its bytes, with read) if a regular file; else refused unopened (a pipe would block)."""
    where = f"{option} {path}".strip()
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise EvalError(f"{where}: not a regular file (a folder, pipe or device): give a file")
        return Path(path).read_bytes() if read else path
    except OSError as e:
        raise EvalError(f"{where}: cannot read it ({e.strerror})") from None


def first_line(error):
    return (str(error).splitlines() or [""])[0]


def sha256(data, digits=64):
    return hashlib.sha256(data).hexdigest()[:digits]


def trainer_of(thing):
    """The trainer module that defined thing's class (a model, its options)."""
    return sys.modules[type(thing).__module__]


def trainer_from_source(source):
    """The module a source (bytes) defines, trainer_<sha256 prefix>, imported once (temp file)."""
    name = f"trainer_{sha256(source, 16)}"
    if name not in sys.modules:
        with tempfile.TemporaryDirectory(prefix="evals-trainer-") as folder:
            path = os.path.join(folder, f"{name}.py")
            Path(path).write_bytes(source)
            spec = importlib.util.spec_from_file_location(name, path)
            # registered first: dataclasses look their module up while it is imported
            module = sys.modules[name] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
    return sys.modules[name]


def add_code_options(parser):
    group = parser.add_argument_group(
        "the code that builds the model",
        "A checkpoint carries the source of the script that wrote it, which would run as code: "
        "without options, only when it is this repository's train_gpt.py byte for byte. For a "
        "fork's checkpoint: --write_source FILE, read FILE, then pass --trainer FILE.")
    choice = group.add_mutually_exclusive_group()
    choice.add_argument("--trainer", metavar="FILE", help="build the model with FILE, your copy "
                        "of the script that wrote the checkpoint")
    choice.add_argument("--trust_checkpoint_code", action="store_true", help="run the source the "
                        "checkpoint carries, whatever it is: only if you trust who made it")
    action = group.add_mutually_exclusive_group()
    action.add_argument("--show_source", action="store_true", help="print how the source the "
                        "checkpoint carries differs from this repository's train_gpt.py, and exit")
    action.add_argument("--write_source", metavar="FILE", help="write the source the checkpoint "
                        "carries to FILE, a new file, and exit; then pass --trainer FILE")


def read_checkpoint(path):
    """A checkpoint's entries (its tensors mapped, not read), as tensors and plain data only."""
    regular_file(path)
    try:
        # the zip's CRCs catch a flipped byte in the weights, which torch.load misses
        if damaged := zipfile.ZipFile(path).testzip():
            raise ValueError(f"{damaged} fails its CRC check")
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        # record 18's own script saved dict(step, code, model, optimizers): its options are ours
        if "args" not in checkpoint and isinstance(checkpoint.get("code"), str):
            checkpoint["record18"] = checkpoint.pop("code").encode()
        if not {"model", "args"} <= checkpoint.keys() and "record18" not in checkpoint:
            raise KeyError(f"no {'model' if 'model' not in checkpoint else 'args'} in it")
    except OSError as e:
        raise EvalError(f"{path}: cannot read it ({e.strerror or e})") from None
    except Exception as e:
        if "Weights only load failed" in str(e):
            raise EvalError(f"{path}: refused: unpickling it could run code, which no checkpoint "
                            "of train_gpt.py holds: get the file again from whoever made it") from None
        raise EvalError(f"{path}: not a checkpoint written by train_gpt.py, or a corrupt or "
                        f"truncated one ({type(e).__name__}: {first_line(e)})") from None
    return checkpoint


def trainer_code(path, checkpoint, trainer_file=None, trust=False):
    """(the source that builds the model, the line naming it): --trainer FILE; this repository's
    train_gpt.py if the checkpoint carries it or none; with trust, what it carries; else none."""
    source = checkpoint.get("source")
    if trainer_file:
        code = regular_file(trainer_file, "--trainer", read=True)
        if source is not None and code != source:
            warn(f"warning: --trainer {trainer_file} (sha256 {sha256(code, 12)}) is not the source "
                 f"{path} carries (sha256 {sha256(source, 12)}), which is not run")
        return code, f"model: built by {os.path.realpath(trainer_file)} (sha256 {sha256(code, 12)})"
    ours = regular_file(REPOSITORY_TRAINER, read=True)
    built = f"model: built by {REPOSITORY_TRAINER} (sha256 {sha256(ours, 12)})"
    if "record18" in checkpoint:
        if sha256(checkpoint["record18"]) != RECORD18_SHA256:
            raise EvalError(f"{path}: the code it carries (sha256 {sha256(checkpoint['record18'], 12)}"
                            ") is not record 18's script, the one built without --trainer FILE")
        return ours, (f"{built}, record 18's model: the checkpoint is record 18's own script's, "
                      "whose source it carries is not run (--show_source shows it)")
    if source is None:
        warn(f"warning: {path} carries no trainer source: built by this repository's "
             "train_gpt.py, which may not be the model that wrote it")
    if source is None or source == ours:
        return ours, built
    if trust:
        warn(f"warning: {path}: running the trainer source it carries (sha256 {sha256(source)}), "
             "not this repository's train_gpt.py, as --trust_checkpoint_code asks")
        return source, f"model: built by the source {path} carries, trusted"
    raise EvalError(f"{path}: the trainer source it carries (sha256 {sha256(source)}) is not this "
                    "repository's train_gpt.py (--show_source prints how it differs) and would "
                    "run as code: pass --trainer FILE, your copy of the script that wrote it "
                    "(--write_source FILE writes the source it carries, to read), or "
                    "--trust_checkpoint_code to run it if you trust who made it")


def open_checkpoint(path, trainer_file=None, trust=False, needs=TRAINER_NAMES):
    """(the trainer module that builds the checkpoint's model, its entries, the line naming it): the
    source trainer_code gives, imported once parsed, it defines each name of needs at top level."""
    checkpoint = read_checkpoint(path)
    source, line = trainer_code(path, checkpoint, trainer_file, trust)
    origin = line.removeprefix("model: built by ")
    try:
        body = ast.parse(source).body
    # a NUL byte is a ValueError
    except (SyntaxError, ValueError) as e:
        body, origin = [], f"{origin}, not Python ({type(e).__name__}: {first_line(e)})"
    defined = set()
    for node in body:
        defined.add(getattr(node, "name", None))
        targets = getattr(node, "targets", None) or [getattr(node, "target", None)]
        defined.update(target.id for target in targets if isinstance(target, ast.Name))
    if missing := [name for name in needs if name not in defined]:
        raise EvalError(f"{path}: its trainer ({origin}) is not a trainer this tool can use: it "
                        f"does not define {', '.join(missing[:4])}; nothing of it was run: pass "
                        "--trainer FILE, a copy of train_gpt.py that defines them")
    try:
        trainer = trainer_from_source(source)
    except Exception as e:
        raise EvalError(f"{path}: its trainer ({origin}) fails to import "
                        f"({type(e).__name__}: {first_line(e)})") from None
    return trainer, checkpoint, line


def show_or_write_source(args):
    """--show_source: the diff from this repository's train_gpt.py to the source the checkpoint
    carries. --write_source FILE: that source, whole, as FILE, a new file. None of it runs."""
    path, target = args.checkpoint, args.write_source
    checkpoint = read_checkpoint(path)
    source = checkpoint.get("source", checkpoint.get("record18"))
    if source is None:
        raise EvalError(f"{path} carries no trainer source: its model is built by this "
                        "repository's train_gpt.py")
    carries = f"{path}: the trainer source it carries (sha256 {sha256(source, 12)})"
    if target is None:
        lines = [text.decode("utf-8", errors="replace").splitlines(keepends=True)
                 for text in (REPOSITORY_TRAINER.read_bytes(), source)]
        diff = [line.rstrip("\n") + "\n" for line in difflib.unified_diff(*lines, "train_gpt.py",
                                                                           "carried source")]
        added, removed = (sum(line[0] == sign for line in diff[2:]) for sign in "+-")
        warn(f"{carries}: {added} lines added and {removed} removed against train_gpt.py")
        if speaks():
            print_out("".join(diff), end="")
        return 0
    if os.path.lexists(target):
        if regular_file(target, "--write_source", read=True) != source:
            raise EvalError(f"--write_source {target}: exists, with other bytes: give a new name")
    else:
        temp = Path(target).with_name(f".{Path(target).name}.{os.getpid()}.tmp")
        try:
            temp.write_bytes(source)
            # unlike a rename, a link never replaces a file made meanwhile
            os.link(temp, target)
        except OSError as e:
            raise EvalError(f"--write_source {target}: cannot write it ({e.strerror})") from None
        finally:
            with contextlib.suppress(OSError):
                temp.unlink()
    warn(f"{carries} is in {target}: read it, then pass --trainer {target}")
    return 0


def run_options(trainer, checkpoint, path):
    """The run's options as its trainer's Hyperparameters (any it lacks left out, after a warning),
    checked by its check_hyperparameters (those of MACHINE_OPTIONS as their defaults)."""
    known = {f.name for f in fields(trainer.Hyperparameters)}
    # none in record 18's checkpoints: its configuration, the trainer's defaults
    saved = checkpoint.get("args", {})
    options = trainer.Hyperparameters(**{k: v for k, v in saved.items() if k in known})
    if unknown := [f"--{name} {saved[name]!r}" for name in saved if name not in known]:
        warn(f"warning: {path}: its options {', '.join(unknown)} are no options of the trainer "
             "that builds its model: left out")
    here = {name: getattr(trainer.Hyperparameters(), name) for name in MACHINE_OPTIONS & known}
    try:
        trainer.check_hyperparameters(replace(options, **here))
    except Exception as e:
        problem = str(e) if isinstance(e, trainer.UserError) else f"{type(e).__name__}: {e}"
        raise EvalError(f"{path}: its saved options are invalid ({first_line(problem)}): its "
                        "trainer would refuse to train with them") from None
    return options


def build_model(trainer, checkpoint, path, device, line=None):
    """The checkpoint's model in eval mode on device and the run's options; then line on stderr."""
    args = run_options(trainer, checkpoint, path)
    try:
        model = trainer.GPT.from_args(args, device)
    except Exception as e:
        # the options named as the model's arguments (its constructor's)
        named = [f"--{n} {getattr(args, n)}" for n in inspect.signature(trainer.GPT).parameters
                 if hasattr(args, n)]
        raise EvalError(f"{path}: its options ({' '.join(named)}) ask for a model its trainer "
                        f"cannot build ({type(e).__name__}: {first_line(e)})") from None
    # under the trainer's names, where it renames older checkpoints' (record 18's among them)
    saved = getattr(trainer, "current_names", dict)(checkpoint["model"])
    ours = model.state_dict()
    mismatches = [f"{n} is {tuple(saved[n].shape)} there, {tuple(ours[n].shape)} in the model"
                  for n in ours if n in saved and saved[n].shape != ours[n].shape]
    mismatches += [f"the model's {n} is not in the checkpoint" for n in ours if n not in saved]
    mismatches += [f"the checkpoint's {n} is not in the model" for n in saved if n not in ours]
    if mismatches:
        raise EvalError(f"{path}: its weights do not fit the model its trainer builds "
                        f"({mismatches[0]}): pass --trainer FILE, the script that wrote it")
    model.load_state_dict(saved)
    if line:
        warn(line)
    return model.to(device).eval(), args


def encoding(tokenizer_file=None):
    """GPT-2's BPE: tiktoken's own (downloaded once), or built from a ranks file (offline)."""
    try:
        return gpt2_tokenizer.gpt2_encoding(tokenizer_file and regular_file(tokenizer_file, "--tokenizer"))
    except gpt2_tokenizer.TokenizerError as e:
        raise EvalError(str(e)) from None


def start_processes(trainer):
    """Rank, world size, device (a group for several); leftover launcher variables refused."""
    try:
        trainer.check_launch_environment()
        rank, world_size, device = trainer.setup_device()
    except trainer.UserError as e:
        raise EvalError(str(e)) from None
    if world_size > 1:
        trainer.start_process_group(device)
    return rank, world_size, device


def speaks():
    """Whether this process prints: rank 0 of a group, the first on each node under torchrun."""
    if dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("LOCAL_RANK", "0") == "0" or "TORCHELASTIC_RUN_ID" not in os.environ


def warn(line):
    if speaks():
        print(line, file=sys.stderr, flush=True)


def print_out(text, end="\n"):
    """text to stdout, now (a reader gone is met here); a full disk is an EvalError."""
    try:
        print(text, end=end, flush=True)
    except OSError as e:
        # what is still buffered goes nowhere, and exiting does not fail again on it
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        if isinstance(e, BrokenPipeError):
            raise
        raise EvalError(f"cannot write to stdout ({e.strerror or e}): send the output somewhere "
                        "it can be written") from None


def run_main(body):
    """body()'s exit code; 1 after one `error:` line, 130 after Ctrl-C, 141 if stdout is closed."""
    try:
        return body()
    except (EvalError, RuntimeError) as e:
        line = f"error: {e}"
        # out of memory: a CPU allocation that fails is a RuntimeError of this wording
        if isinstance(e, torch.OutOfMemoryError) or "can't allocate memory" in str(e):
            line = (f"error: out of memory ({first_line(e)[:200]}): ask for less at once, fewer "
                    "--num_samples (sample.py) or a shorter --sequence_length (hellaswag.py)")
        elif not isinstance(e, EvalError):
            raise
        warn(line)
        return 1
    except KeyboardInterrupt:
        warn("stopped by SIGINT")
        return 128 + signal.SIGINT
    except BrokenPipeError:
        return CLOSED_OUTPUT
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
