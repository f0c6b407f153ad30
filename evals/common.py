"""What the evaluation tools share: the start-up, a checkpoint's model built from the source of the
script that wrote it, the tokenizer, the errors. Nothing of the trainer is imported here: a
checkpoint carries its trainer's source, which is imported under a name of its own (trainer_ and
its sha256), and the trainer's --hellaswag hands over its own model. A checkpoint is read as tensors
and plain data only (weights_only=True), so unpickling it runs nothing."""
import argparse
import contextlib
import hashlib
import importlib.util
import json
import linecache
import os
import pickle
import re
import signal
import stat
import sys
import tempfile
import time
import zipfile
from dataclasses import fields
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
    digest = hashlib.sha256(source).hexdigest()
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
    damaged)."""
    refused = re.search(r"WeightsUnpickler error: ([^\n]*)", str(error))
    if not refused:
        return (f"{path}: not a checkpoint written by train_gpt.py, or a corrupt or truncated one "
                f"(UnpicklingError: {first_line(error)})")
    # "Unsupported global: GLOBAL builtins.exec was not an allowed global by default. ..."
    what = refused.group(1).split(" was not ")[0].split(". ")[0]
    return (f"{path}: refused: unpickling it could run code, as it holds more than tensors and "
            f"plain data ({what}), which no checkpoint of train_gpt.py does. Get the file again "
            "from whoever made it; if you made it and trust it, load it with torch.load(..., "
            "weights_only=False) and save its tensors and plain data")


def first_line(error):
    return (str(error).splitlines() or [""])[0]


def open_checkpoint(path):
    """(the trainer module that wrote the checkpoint, its entries): the module is built from the
    source the checkpoint carries, whatever the script's name or folder was. A checkpoint written
    before checkpoints carried it gets this repository's train_gpt.py, with a warning."""
    checkpoint = read_checkpoint(path)
    source = checkpoint.get("source")
    if source is None:
        warn(f"warning: {path} carries no trainer source (written before checkpoints did): "
             f"scored as {REPOSITORY_TRAINER.name} of this repository, which may not be the model "
             "that wrote it")
        try:
            source = REPOSITORY_TRAINER.read_bytes()
        except OSError as e:
            raise EvalError(f"{REPOSITORY_TRAINER}: cannot read it ({e.strerror})") from None
    if isinstance(source, str):
        source = source.encode()
    try:
        trainer = trainer_from_source(source)
    except Exception as e:
        raise EvalError(f"{path}: the trainer source it carries fails to import "
                        f"({type(e).__name__}: {first_line(e)})") from None
    return trainer, checkpoint


def build_model(trainer, checkpoint, path, device):
    """The checkpoint's model, built by its trainer, in eval mode on device, and the run's options
    (those the trainer no longer has left out)."""
    try:
        known = {f.name for f in fields(trainer.Hyperparameters)}
        saved = checkpoint["args"]
        args = trainer.Hyperparameters(**{k: v for k, v in saved.items() if k in known})
        model = trainer.GPT.from_args(args, device)
        model.load_state_dict(checkpoint["model"])
    except Exception as e:
        raise EvalError(f"{path}: its weights do not fit the model its trainer builds "
                        f"({type(e).__name__}: {first_line(e)})") from None
    return model.to(device).eval(), args


def load_model(path, device):
    """The model of a checkpoint that train_gpt.py (or a copy of it) wrote, in eval mode on device,
    and the run's options."""
    trainer, checkpoint = open_checkpoint(path)
    return build_model(trainer, checkpoint, path, device)


def trained_window_blocks(args):
    """The attention window, in blocks, that the run ended its training with."""
    return trainer_of(args).window_blocks_at(args.num_iterations, args)


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


def print_out(text):
    """text to stdout, now: a reader that has gone (`... | head`) is met here, not at exit."""
    print(text, flush=True)


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
