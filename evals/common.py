"""What the evaluation tools share: a checkpoint's model, the device, the tokenizer, the errors."""
import sys
import zipfile
from dataclasses import fields
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
# the trainer, and data/gpt2_tokenizer.py
for folder in (REPO / "data", REPO):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
import gpt2_tokenizer  # noqa: E402
import train_gpt  # noqa: E402

EOT = train_gpt.EOT
BLOCK_SIZE = train_gpt.BLOCK_SIZE


class EvalError(Exception):
    """A mistake the user can fix: the tools print its message as one `error:` line."""


def load_model(path, device):
    """The model of a checkpoint that train_gpt.py wrote (--save_checkpoint, --checkpoint_every),
    in eval mode on device, and the run's options (those the trainer no longer has left out)."""
    try:
        # the zip's CRCs catch a flipped byte in the weights, which torch.load misses
        if damaged := zipfile.ZipFile(path).testzip():
            raise ValueError(f"{damaged} fails its CRC check")
        # mapped, not read: only the weights are needed, not the optimiser states beside them
        checkpoint = torch.load(path, map_location="cpu", mmap=True)
        known = {f.name for f in fields(train_gpt.Hyperparameters)}
        saved = checkpoint["args"]
        args = train_gpt.Hyperparameters(**{k: v for k, v in saved.items() if k in known})
        model = train_gpt.GPT.from_args(args, device)
        model.load_state_dict(checkpoint["model"])
    except OSError as e:
        raise EvalError(f"{path}: cannot read it ({e.strerror or e})") from None
    except Exception as e:
        reason = (str(e).splitlines() or [""])[0]
        raise EvalError(f"{path}: not a checkpoint written by train_gpt.py, or a corrupt or "
                        f"truncated one ({type(e).__name__}: {reason})") from None
    return model.to(device).eval(), args


def trained_window_blocks(args):
    """The attention window, in blocks of 128 tokens, that the run ended its training with."""
    return train_gpt.window_blocks_at(args.num_iterations, args)


def encoding(tokenizer_file=None):
    """GPT-2's BPE: tiktoken's own (downloaded once), or built from a ranks file (offline)."""
    try:
        return gpt2_tokenizer.gpt2_encoding(tokenizer_file)
    except gpt2_tokenizer.TokenizerError as e:
        raise EvalError(str(e)) from None


def start_processes():
    """Rank, world size and device from torchrun's environment, and the process group when there
    are several processes."""
    try:
        rank, world_size, device = train_gpt.setup_device()
    except train_gpt.UserError as e:
        raise EvalError(str(e)) from None
    if world_size > 1:
        train_gpt.start_process_group(device)
    return rank, world_size, device


def run_main(body):
    """body() as a tool's main: its exit code, or 1 after one `error:` line (from rank 0); the
    process group is torn down either way."""
    try:
        return body()
    except EvalError as e:
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
