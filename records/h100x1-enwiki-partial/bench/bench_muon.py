"""Muon.step of two versions of the trainer on the default model's matrices, one GPU: CUDA-event median of 20
steps (compiled iteration), and how far apart their first updates are per matrix.
Usage: python bench_muon.py OLD/train_gpt.py NEW/train_gpt.py"""
import importlib.util, os, sys, torch
os.environ.setdefault("RANK", "0"); os.environ.setdefault("WORLD_SIZE", "1")
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m
old, new = load("tg_old", sys.argv[1]), load("tg_new", sys.argv[2])
dev = torch.device("cuda")
def t(fn, reps=20):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev: a.record(); fn(); b.record()
    torch.cuda.synchronize()
    x = sorted(a.elapsed_time(b) for a, b in ev); return x[len(x) // 2]
res = {}
for name, mod in (("old", old), ("new", new)):
    torch.manual_seed(0)
    args = mod.Hyperparameters()
    model = (mod.GPT.from_args(args) if hasattr(mod.GPT, "from_args") else mod.GPT(args.vocab_size, args.num_layers, args.num_heads, args.model_dim)).to(dev)
    opts = mod.build_optimizers(model, args, compiled=True); muon = opts[1]
    mats = [p for p in model.blocks.parameters() if p.ndim == 2]
    g = torch.Generator(device=dev).manual_seed(1)
    for p in mats: p.grad = torch.randn(p.shape, device=dev, generator=g) * 1e-3
    before = [p.detach().clone() for p in mats]
    muon.step(); torch.cuda.synchronize()
    res[name] = [(p.detach() - b).float() for p, b in zip(mats, before)]
    ms = t(muon.step)
    print(f"{name} Muon.step: {ms:.2f} ms (median of 20, compiled NS)", flush=True)
    del model, opts, muon
errs = [((a - b).norm() / b.norm()).item() for a, b in zip(res["new"], res["old"])]
print(f"first-step update, new vs old, per matrix relative difference: max {max(errs):.4f}, mean {sum(errs)/len(errs):.4f}")
