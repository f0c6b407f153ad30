"""Muon.step of two versions of the trainer on the default model's matrices, one GPU: CUDA-event
median of 20 steps (compiled iteration), and how far apart their first updates are per matrix.
Usage: python bench_muon.py OLD/train_gpt.py NEW/train_gpt.py"""

import importlib.util
import os
import sys

import torch

os.environ.setdefault("RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")


def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


old = load("tg_old", sys.argv[1])
new = load("tg_new", sys.argv[2])
dev = torch.device("cuda")


def median_ms(fn, reps=20):
    """CUDA-event median of `reps` calls of fn, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(reps)
    ]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) for start, end in events)
    return times[len(times) // 2]


res = {}
for name, mod in (("old", old), ("new", new)):
    torch.manual_seed(0)
    args = mod.Hyperparameters()
    if hasattr(mod.GPT, "from_args"):
        model = mod.GPT.from_args(args)
    else:
        model = mod.GPT(args.vocab_size, args.num_layers, args.num_heads, args.model_dim)
    model = model.to(dev)
    opts = mod.build_optimizers(model, args, compiled=True)
    muon = opts[1]
    mats = [p for p in model.blocks.parameters() if p.ndim == 2]
    g = torch.Generator(device=dev).manual_seed(1)
    for p in mats:
        p.grad = torch.randn(p.shape, device=dev, generator=g) * 1e-3
    before = [p.detach().clone() for p in mats]
    muon.step()
    torch.cuda.synchronize()
    res[name] = [(p.detach() - b).float() for p, b in zip(mats, before)]
    ms = median_ms(muon.step)
    print(f"{name} Muon.step: {ms:.2f} ms (median of 20, compiled NS)", flush=True)
    del model, opts, muon
errs = [((a - b).norm() / b.norm()).item() for a, b in zip(res["new"], res["old"])]
print(
    "first-step update, new vs old, per matrix relative difference: "
    f"max {max(errs):.4f}, mean {sum(errs) / len(errs):.4f}"
)
