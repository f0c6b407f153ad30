"""Compiled FlexAttention, forward and backward, on one 65,536-token micro-batch of real text, with
two masks over the same block lists: record 18's (mask_mod document-causal, the window in the block
lists: what train_gpt.py builds inside a compiled region) and the window inside mask_mod too (what it
builds outside one; what the compiled path had before the redesign). Also 695aa87's builder (sorted
block lists). Windows of 1, 7, 14 blocks; outputs and gradients compared; median CUDA-event times.

    python attn_mask.py TRAIN_SHARD OLD_TRAINER.py     (from the repository root, on a GPU)
"""
import importlib.util
import sys
from pathlib import Path
from unittest import mock

import torch
from torch.nn.attention.flex_attention import flex_attention

sys.path.insert(0, str(Path.cwd()))
import train_gpt as tg  # noqa: E402

spec = importlib.util.spec_from_file_location("old", sys.argv[2])
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)

torch._dynamo.config.cache_size_limit = 64
dev = torch.device("cuda")
print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(dev), flush=True)
tokens = tg.load_data_shard(sys.argv[1])[:65536].to(dev, torch.int32)
print(f"documents in the micro-batch: {int((tokens == tg.EOT).sum())}", flush=True)
T, H, D = 65536, 6, 128
gen = torch.Generator(device=dev).manual_seed(0)
q, k, v = (torch.randn(1, H, T, D, device=dev, generator=gen).bfloat16().requires_grad_() for _ in range(3))
g = torch.randn(1, H, T, D, device=dev, generator=gen).bfloat16()


def timed(fn, reps=20):
    for _ in range(3):
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    t = sorted(a.elapsed_time(b) for a, b in ev)
    return t[len(t) // 2]


def masks(w):
    window = torch.tensor(w, dtype=torch.int32, device=dev)
    with mock.patch.object(torch.compiler, "is_compiling", lambda: True):
        record18 = tg.build_block_mask(tokens, window)
    in_mask_mod = tg.build_block_mask(tokens, window)
    return {"record18": record18, "window_in_mask_mod": in_mask_mod,
            "695aa87": old.build_block_mask(tokens, window)}


attend = torch.compile(flex_attention, dynamic=False)
for w in (1, 7, 14):
    results = {}
    for name, m in masks(w).items():
        def fwd():
            with torch.no_grad():
                return attend(q, k, v, block_mask=m, scale=D ** -0.5)

        def fwdbwd():
            q.grad = k.grad = v.grad = None
            out = attend(q, k, v, block_mask=m, scale=D ** -0.5)
            out.backward(g)
            return out

        out = fwdbwd()
        grads = [out.detach().clone(), q.grad.clone(), k.grad.clone(), v.grad.clone()]
        results[name] = (timed(fwd), timed(fwdbwd), grads)
    ref = results["record18"]
    for name, (f, fb, grads) in results.items():
        equal = all(torch.equal(a, b) for a, b in zip(grads, ref[2]))
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads, ref[2]))
        print(f"window {w:2d} {name:18s} fwd {f:7.3f} ms  fwd+bwd {fb:7.3f} ms  "
              f"vs record18: fwd x{f / ref[0]:.3f} fwd+bwd x{fb / ref[1]:.3f}  "
              f"out+grads equal: {equal} (max abs diff {diff:.2e})", flush=True)
