"""How fast evals/sample.py makes new tokens: its KV cache against a full forward per token.

    python records/sampling_speed.py                    # the default model, random weights
    python records/sampling_speed.py --new_tokens 64 --prompt_tokens 16 --device cuda

Both ways run in this one process on the same model (the default Hyperparameters' 12 blocks of
width 768, bf16 tables, random matrices so that argmax is not degenerate): first a full forward per
new token over the document so far, padded to whole blocks of 128 (how sample.py worked before it
had a cache), then sample.generate (fp32, the cache). It prints the machine, both times, tokens per
second, the ratio, and whether the two greedy texts agree (the full forwards run in bf16, the cache
in fp32: a close call may differ)."""
import argparse
import math
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_gpt  # noqa: E402
from evals import sample  # noqa: E402


def machine(device):
    """The CPU's model name and vector extensions, or the GPU's name."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    flags = ""
    try:
        text = Path("/proc/cpuinfo").read_text()
        name = next(line.split(":", 1)[1].strip() for line in text.splitlines()
                    if line.startswith("model name"))
        flags = next(line for line in text.splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        pass
    extensions = "no AVX2"
    if " avx512f" in flags:
        extensions = "AVX-512"
    elif " avx2" in flags:
        extensions = "AVX2"
    return f"{name}, {extensions}, {torch.get_num_threads()} threads"


@torch.no_grad()
def full_forwards(model, tokens, new_tokens, window, vocab):
    """Greedy tokens, each from a forward over the whole document, padded to whole blocks."""
    tokens = list(tokens)
    device = next(model.parameters()).device
    for _ in range(new_tokens):
        length = math.ceil(len(tokens) / train_gpt.BLOCK_SIZE) * train_gpt.BLOCK_SIZE
        padded = torch.full((length,), train_gpt.EOT, dtype=torch.int32)
        padded[:len(tokens)] = torch.tensor(tokens)
        logits = model(padded.to(device), None, window)[len(tokens) - 1, :vocab]
        tokens.append(int(logits.argmax()))
    return tokens


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def check_arguments(args):
    """The device the options name, or what is wrong with them."""
    if args.new_tokens < 1:
        return f"--new_tokens must be at least 1; got {args.new_tokens}"
    if args.prompt_tokens < 0:
        return f"--prompt_tokens must be at least 0; got {args.prompt_tokens}"
    try:
        device = torch.device(args.device)
    except RuntimeError:
        device = None
    # the clock waits for these two only (synchronize)
    if device is None or device.type not in ("cpu", "cuda"):
        return f"--device {args.device} is not one this tool times; give cpu, or cuda on a GPU machine"
    try:
        torch.zeros(1, device=device)
    except (RuntimeError, AssertionError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        return f"--device {args.device} cannot be used ({reason}); give cpu, or cuda on a GPU machine"
    return device


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--prompt_tokens", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    device = check_arguments(args)
    if isinstance(device, str):
        print(f"error: {device}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    model = train_gpt.GPT.from_args(train_gpt.Hyperparameters(), device).to(device).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, p.size(1) ** -0.5)
    window_blocks = 14
    window = torch.tensor(window_blocks, dtype=torch.int32, device=device)
    prompt = torch.randint(0, 50257, (args.prompt_tokens,)).tolist()
    print(f"machine: {machine(device)}; torch {torch.__version__}")
    timings = {}
    texts = {}
    for name in ("full forwards", "KV cache"):
        synchronize(device)
        started = time.perf_counter()
        if name == "full forwards":
            texts[name] = full_forwards(model, [train_gpt.EOT, *prompt], args.new_tokens, window,
                                        50257)[1:]
        else:
            texts[name] = sample.generate(model, prompt, args.new_tokens, window_blocks, 50257)
        synchronize(device)
        timings[name] = time.perf_counter() - started
        print(f"{name}: {args.new_tokens} new tokens after a {args.prompt_tokens}-token prompt in "
              f"{timings[name]:.2f} s ({args.new_tokens / timings[name]:.2f} tokens/s)")
    ratio = timings["full forwards"] / timings["KV cache"]
    same = texts["full forwards"] == texts["KV cache"]
    agreement = "equal"
    if not same:
        agreement = "differ (bf16 full forwards, the fp32 cache: the numerics, not the cache)"
    print(f"the cache is {ratio:.1f} times faster; greedy texts {agreement}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
