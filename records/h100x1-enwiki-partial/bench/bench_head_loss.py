"""GPU check and benchmark of train_gpt.py's fused head loss (--fused_head_loss) against the plain
head.

Usage: python bench_head_loss.py DIR
(DIR holds train_gpt.py; one CUDA GPU; about a minute on an H100)
1. accuracy at 4097 x 50304 (typical and saturated logits) against float64, next to the plain bf16
   path's; the in-place kernel and eval (loss only, logits untouched); a torch.compile'd caller
   (the model's graph break)
2. CUDA-event times (median of 20 after warm-up) of forward+backward at 65536 x 768 -> 50304: the
   plain head compiled as the model is, the fused head, and each loss part alone
3. peak memory of each path and the largest live allocations at that peak (memory history)
"""

import statistics
import sys
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else ".")
import train_gpt  # noqa: E402
from train_gpt import fused_head_loss  # noqa: E402
from train_gpt import softcapped_cross_entropy_  # noqa: E402

DEV = "cuda"
# the head of one micro-batch of the default model: rows x model dim -> vocabulary
ROWS = 65536
DIM = 768
VOCAB = 50304
# path -> dict(ms=..., peak_mib=...)
results = {}


def part(title):
    def wrap(fn):
        print(f"\n=== {title}", flush=True)
        try:
            fn()
        except Exception:
            traceback.print_exc()
            print(f"!!! {title}: FAILED (above)", flush=True)
        return fn

    return wrap


def head_inputs(rows, scale, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = (
        F.rms_norm(torch.randn(rows, DIM, device=DEV, generator=g), (DIM,))
        .bfloat16()
        .requires_grad_()
    )
    weight = (torch.randn(VOCAB, DIM, device=DEV, generator=g) * scale / DIM**0.5).requires_grad_()
    targets = torch.randint(0, VOCAB, (rows,), device=DEV, generator=g)
    return x, weight, targets


def plain_head_loss(x, weight, targets):
    return F.cross_entropy((15 * torch.tanh(F.linear(x, weight.bfloat16()) / 15)).float(), targets)


def float64_reference(x, weight, targets):
    x64 = x.detach().double().requires_grad_()
    w64 = weight.detach().bfloat16().double().requires_grad_()
    z64 = (x64 @ w64.T).detach().requires_grad_()
    loss = F.cross_entropy(15 * torch.tanh(z64 / 15), targets)
    (grad_z,) = torch.autograd.grad(loss, z64)
    grad_x = grad_z @ w64
    grad_w = grad_z.T @ x64
    return loss.item(), grad_x, grad_w, grad_z


def rel(value, reference):
    return ((value.double() - reference).norm() / reference.norm()).item()


@part("1. accuracy against float64, rows = 4097 (not a multiple of any row block), vocab 50304")
def accuracy():
    for name, scale in [("typical (|z| ~ 3)", 3.0), ("saturated (|z| ~ 1000)", 1000.0)]:
        x, weight, targets = head_inputs(4097, scale)
        ref_loss, ref_gx, ref_gw, ref_gz = float64_reference(x, weight, targets)
        for path, fn in [("fused", fused_head_loss), ("plain bf16", plain_head_loss)]:
            loss = fn(x, weight, targets)
            # upstream gradient 1/8, as accumulation
            gx, gw = torch.autograd.grad(loss / 8, (x, weight))
            print(
                f"{name:24s} {path:10s} loss {loss.item():.6f} (float64 {ref_loss:.6f}, rel err "
                f"{abs(loss.item() - ref_loss) / ref_loss:.1e})  "
                f"grad_x rel err {rel(gx * 8, ref_gx):.1e} ({gx.dtype})  "
                f"grad_W rel err {rel(gw * 8, ref_gw):.1e} ({gw.dtype})"
            )
        logits = F.linear(x.detach(), weight.detach().bfloat16())
        before = logits.clone()
        with torch.no_grad():
            eval_loss = fused_head_loss(x, weight, targets).item()
        losses = softcapped_cross_entropy_(logits, targets)
        print(
            f"{'':24s} eval loss {eval_loss:.6f}, loss-only kernel leaves logits unchanged: "
            f"{torch.equal(logits, before)}, mean {losses.mean().item():.6f}"
        )
        softcapped_cross_entropy_(logits, targets, grad_scale=1 / x.size(0))
        print(
            f"{'':24s} in-place d loss/d logits ({logits.dtype}) "
            f"rel err {rel(logits, ref_gz):.1e}, "
            f"finite: {bool(logits.isfinite().all())}"
        )
        del logits, before, ref_gx, ref_gw, ref_gz
    x, weight, targets = head_inputs(4097, 3.0)
    h = x.detach().float().requires_grad_()
    compiled = torch.compile(
        lambda h, w, t: fused_head_loss(F.rms_norm(h, (DIM,)).bfloat16(), w, t), dynamic=False
    )

    def eager(h, w, t):
        return fused_head_loss(F.rms_norm(h, (DIM,)).bfloat16(), w, t)

    got = [compiled(h, weight, targets)]
    got += torch.autograd.grad(got[0], (h, weight))
    want = [eager(h, weight, targets)]
    want += torch.autograd.grad(want[0], (h, weight))
    print(
        "torch.compile'd caller (graph break at fused_head_loss): loss and grads equal eager:",
        [torch.allclose(a, b, rtol=1e-3, atol=1e-6) for a, b in zip(got, want)],
    )


def cuda_time_ms(fn, warmup=3, reps=20):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def top_allocations_at_peak(fn, top=5):
    """Replay the allocator's trace of one call of fn; the live allocations at the largest total."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    fn()
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    live = {}
    total = 0
    peak = 0
    at_peak = []
    for event in snapshot["device_traces"][torch.cuda.current_device()]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
            if total > peak:
                peak = total
                at_peak = list(live.values())
        elif event["action"] in ("free_requested", "free_completed") and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
    lines = [
        f"    peak of allocations made during the call: {peak / 2**20:,.0f} MiB; largest live then:"
    ]
    for event in sorted(at_peak, key=lambda e: -e["size"])[:top]:
        frames = [
            f
            for f in event.get("frames", [])
            if f["filename"].endswith(".py") and "/torch/" not in f["filename"]
        ]
        where = (
            ", ".join(
                f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}" for f in frames[:2]
            )
            or "?"
        )
        lines.append(f"      {event['size'] / 2**20:9,.0f} MiB  {where}")
    return "\n".join(lines)


def measure(path, fn):
    try:
        torch.cuda.synchronize()
        ms = cuda_time_ms(fn)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        results[path] = dict(ms=ms, peak_mib=peak)
        print(f"{path:52s} {ms:8.2f} ms   peak {peak:9,.0f} MiB above inputs", flush=True)
        print(top_allocations_at_peak(fn), flush=True)
    except Exception:
        traceback.print_exc()
        print(f"!!! {path}: FAILED (above)", flush=True)


@part(f"2+3. forward+backward at {ROWS} x {DIM} -> {VOCAB}: CUDA-event median of 20, peak memory")
def timing():
    x, weight, targets = head_inputs(ROWS, 3.0)
    plain = torch.compile(plain_head_loss, dynamic=False)

    def plain_step():
        plain(x, weight, targets).div(8).backward()
        x.grad = weight.grad = None

    def fused_step():
        fused_head_loss(x, weight, targets).div(8).backward()
        x.grad = weight.grad = None

    measure("(a) plain head, torch.compile'd, fwd+bwd", plain_step)
    measure("(b) fused head (cuBLAS + kernel), fwd+bwd", fused_step)

    logits = F.linear(x.detach(), weight.detach().bfloat16())
    z = logits.clone().requires_grad_()
    plain_loss = torch.compile(
        lambda z, t: F.cross_entropy((15 * torch.tanh(z / 15)).float(), t), dynamic=False
    )

    def plain_loss_step():
        plain_loss(z, targets).backward()
        z.grad = None

    measure("(c) plain softcap+CE alone (compiled), fwd+bwd", plain_loss_step)
    measure(
        "(d) kernel alone: loss + in-place gradient",
        lambda: softcapped_cross_entropy_(logits, targets, 1 / ROWS),
    )
    measure(
        "(e) kernel alone: loss only (eval)", lambda: softcapped_cross_entropy_(logits, targets)
    )
    bytes_once = ROWS * VOCAB * logits.element_size()
    for path, moved in [
        ("(d) kernel alone: loss + in-place gradient", 2 * bytes_once),
        ("(e) kernel alone: loss only (eval)", bytes_once),
    ]:
        if path in results:
            written = ""
            if moved > bytes_once:
                written = " with the gradient write"
            print(
                f"{path}: {moved / results[path]['ms'] / 1e6:,.0f} GB/s if the logits are read "
                f"once ({moved / 1e9:.1f} GB{written})"
            )


@part("summary (per micro-batch of 65536 rows; a step is 8 micro-batches)")
def summary():
    print(f"{'path':52s} {'ms':>8s} {'ms/step':>8s} {'peak MiB':>10s}")
    for path, r in results.items():
        print(f"{path:52s} {r['ms']:8.2f} {8 * r['ms']:8.1f} {r['peak_mib']:10,.0f}")
    print(
        f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"triton {__import__('triton').__version__}, launch {train_gpt.HEAD_LAUNCH_CUDA}"
    )
