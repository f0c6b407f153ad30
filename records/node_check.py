"""Know the node before the run: does it run the trainer's GPU path, and in how long?

    ./run.sh records/node_check.py [--trainer FILE] [--steps K] [TRAINER OPTIONS...]
    torchrun --standalone --nproc_per_node=N records/node_check.py [TRAINER OPTIONS...]
    python records/node_check.py --preset smoke          (one process; on a CPU, with gloo)

The trainer's own model and optimisers, from the same options (a fork checks itself with --trainer
FILE), on every rank:
1. Each device alone: one micro-batch's compiled forward and backward, without communication (CPU
   processes take turns). A rank whose median exceeds the top of the others' run-to-run spread
   (their upper quartiles) by SLOW_MARGIN is named, with what its GPU says of itself.
2. The links: an all-reduce of the gradients' size and Muon's all-gather, in nccl-tests' bus
   bandwidth; on GPUs, one below LINK_FLOOR_GBPS is named.
3. Right answers: after CHECKED_STEPS steps of DDP, Adam and Muon, each rank's weights against rank
   0's, bit for bit; on one batch, the compiled loss against the eager one (of EAGER_TOKENS tokens:
   eager attention holds every score), and each rank's against rank 0's.
4. The real steps: the trainer's main() for K steps (--steps), a checkpoint RESUMED_STEPS before
   the end, and main() resuming from it on every rank; the window held at the schedule's mean.
5. The verdict, stdout's last line: `node check:`, every fault by rank, the projected timed training
   of the run the options describe (its timed steps at step 4's step_avg; validation apart) beside
   record 18's 204.3 s, and the peak memory against the device's. Exit code 0: the node is fit; 1:
   a fault is named; 2: no verdict (an `error:` line says why); 130 or 143: stopped.
Its log, <log_dir>/node_check-<run id>.txt, is the trainer's log of step 4's first run with this
file's source after the trainer's and the check's lines at the end: records/compare.py lists it
beside training runs. The runs' scratch folder in --log_dir goes at the end. --slow_rank and
--perturb_rank are for testing the check itself.
"""

import argparse
import contextlib
import gc
import glob
import importlib.util
import io
import itertools
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

REPOSITORY_TRAINER = Path(__file__).resolve().parents[1] / "train_gpt.py"
# record 18 on 8 H100s: timed training, and a step
RECORD_SECONDS = 204.3
RECORD_STEP_MS = 148.1
# the trainer's steps (--steps), those after its checkpoint, and the check's own steps
STEPS = 30
RESUMED_STEPS = 2
CHECKED_STEPS = 3
# timed forward-and-backward passes per rank
REPEATS = 10
# GPUs of one kind agree within a few percent; CPU processes share cores with everything else
SLOW_MARGIN = dict(cuda=0.05, cpu=0.5)
# all-reduce bus bandwidth in GB/s: NVLink H100 nodes reach about 370 (NCCL's maintainers' figure,
# 480 with NVLink SHARP), PCIe nodes a fraction of the floor
LINK_FLOOR_GBPS = 100
NVLINK_H100_GBPS = 370
EAGER_TOKENS = 2048
# relative: compiled against eager (bf16 kernels round differently), and rank against rank
LOSS_TOLERANCE = 0.01
RANK_TOLERANCE = 0.001
SEPARATOR = "=" * 100
VAL_LINE = re.compile(r"^step:(\d+)/\d+ val_loss:(\S+) train_time:\d+ms step_avg:(\S+)ms$", re.M)
PEAK_LINE = re.compile(r"^peak memory consumption: (\d+) MiB$", re.M)
# the first name of each process group made in this process (fresh_group_names)
GROUP_NAMES = itertools.count(1000, 1000)


def parse_args(argv):
    """Our options, and every other one for the trainer (none is abbreviated into ours)."""
    parser = argparse.ArgumentParser(
        usage="%(prog)s [--trainer FILE] [--steps K] [TRAINER OPTIONS...]", allow_abbrev=False,
        description="Check this node on the trainer's own GPU path and project the run's time; "
                    "every other option goes to the trainer.")
    parser.add_argument("--trainer", type=Path, default=REPOSITORY_TRAINER, metavar="FILE",
                        help="the trainer to check (default: the repository's train_gpt.py)")
    parser.add_argument("--steps", type=int, default=STEPS, metavar="K",
                        help=f"the trainer's steps to time, the untimed first ones included "
                             f"(default {STEPS})")
    parser.add_argument("--slow_rank", type=int, metavar="R",
                        help="for testing this check: rank R does its timed work three times")
    parser.add_argument("--perturb_rank", type=int, metavar="R",
                        help="for testing this check: rank R's weights change before the checked "
                             "steps")
    ours, trainer_argv = parser.parse_known_args(argv)
    if not ours.trainer.is_file():
        parser.error(f"--trainer {ours.trainer}: no such file")
    return ours, trainer_argv


def load_trainer(path):
    """The trainer at path as a module of its own (importing it runs nothing)."""
    spec = importlib.util.spec_from_file_location("node_check_trainer", path)
    module = importlib.util.module_from_spec(spec)
    # dataclasses look their module up while it is imported
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def fresh_group_names():
    """Before each process group: names no earlier one had. torch numbers groups from 0 again after
    destroy_process_group, and a group made under an earlier one's names can read that group's
    addresses in torchrun's store (gloo then failed to connect, in testing)."""
    dist.distributed_c10d._world.group_count = next(GROUP_NAMES)


def mean_window(t, args):
    """The attention window's mean over the run, in tokens: it grows linearly from --window_start
    to --window_end, counted in whole blocks of the trainer's (rounded down)."""
    blocks = (args.window_start + args.window_end) / 2 / t.BLOCK_SIZE - 0.5
    return max(1, round(blocks)) * t.BLOCK_SIZE


def timed_ms(work, device, times=1):
    """work() done `times` times: its time in ms, by CUDA events on a GPU, else by the clock."""
    if device.type == "cuda":
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        for _ in range(times):
            work()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    started = time.perf_counter()
    for _ in range(times):
        work()
    return 1000 * (time.perf_counter() - started)


def device_facts(device):
    """What the device says of itself: a GPU's name and memory, and where nvidia-smi answers its
    clocks, temperature, power and memory in use; a CPU's cores and load."""
    if device.type != "cuda":
        return f"cpu, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}"
    props = torch.cuda.get_device_properties(device)
    facts = f"{props.name}, {props.total_memory // 2 ** 20:,} MiB"
    fields = "uuid,clocks.sm,clocks.max.sm,temperature.gpu,power.draw,memory.used"
    query = ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"]
    with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError):
        rows = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True)
        for row in rows.stdout.splitlines():
            uuid, sm, sm_max, celsius, power, used = (value.strip() for value in row.split(","))
            if uuid.removeprefix("GPU-") == str(getattr(props, "uuid", "")).removeprefix("GPU-"):
                facts += f", SM clock {sm} of {sm_max}, {celsius} C, {power}, {used} used"
    return facts


def own_checks(t, args, ours, rank, world, device):
    """Steps 1 to 3 on this rank: what it measured and found, in plain values."""
    micro_batch = t.micro_batch_plan(args, world)[0]
    window = torch.tensor(mean_window(t, args) // t.BLOCK_SIZE, dtype=torch.int32, device=device)
    # the model as the trainer builds it: seeded, compiled (on CUDA by default), in DDP
    torch.manual_seed(args.seed)
    model = t.GPT.from_args(args, device).to(device)
    compiled = t.switched_on(args.compile, device)
    compiled_model = torch.compile(model, dynamic=False) if compiled else model
    train_model = compiled_model
    if world > 1:
        device_ids = [device.index] if device.type == "cuda" else None
        train_model = DDP(compiled_model, device_ids=device_ids, broadcast_buffers=False,
                          gradient_as_bucket_view=True)
    adam, muon = t.build_optimizers(model, args, compiled=compiled)
    # the same random tokens on every rank
    generator = torch.Generator().manual_seed(args.seed)

    def batch(tokens):
        # GPT-2's ids: up to its end of text
        ids = torch.randint(t.EOT + 1, (tokens + 1,), generator=generator)
        return ids[:-1].to(device, torch.int32), ids[1:].to(device, torch.int64)

    inputs, targets = batch(micro_batch)
    no_sync = train_model.no_sync if world > 1 else contextlib.nullcontext

    def forward_backward():
        with no_sync():
            train_model(inputs, targets, window).backward()
        model.zero_grad(set_to_none=True)

    # the first one compiles
    started = time.perf_counter()
    forward_backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    found = dict(first_s=time.perf_counter() - started, facts=device_facts(device), times=[])
    forward_backward()
    work = 3 if rank == ours.slow_rank else 1
    # GPUs all at once, as in a run; CPU processes share cores, so they take turns
    turns = range(world) if device.type == "cpu" and world > 1 else [rank]
    for _ in range(REPEATS):
        for turn in turns:
            if len(turns) > 1:
                dist.barrier()
            if turn == rank:
                found["times"].append(timed_ms(forward_backward, device, work))

    # a micro-batch of validation, for the projection
    val_batch = batch(args.max_device_batch_size)
    train_model.eval()
    with torch.no_grad():
        train_model(*val_batch, window)
        found["eval_ms"] = statistics.median(timed_ms(lambda: train_model(*val_batch, window),
                                                      device) for _ in range(3))
    train_model.train()

    if world > 1:
        # nccl-tests' bus bandwidth (what each link carries): bytes / time, x 2(W-1)/W for an
        # all-reduce, x (W-1)/W for an all-gather (of its output's bytes)
        sizes = [p.numel() * p.element_size() for p in model.parameters()]
        grads = torch.zeros(sum(sizes) // 4, device=device)
        matrices = sum(p.numel() for group in muon.param_groups for p in group["params"])
        share = torch.zeros(math.ceil(matrices / world), dtype=torch.bfloat16, device=device)
        gathered = share.new_empty(world * len(share))
        links = dict(reduce=(lambda: dist.all_reduce(grads), 4 * len(grads), 2),
                     gather=(lambda: dist.all_gather_into_tensor(gathered, share),
                             2 * len(gathered), 1))
        for name, (collective, size, factor) in links.items():
            collective()
            ms = timed_ms(collective, device, REPEATS) / REPEATS
            found[name] = (size / 1e6, size / ms / 1e6 * factor * (world - 1) / world)
        del grads, share, gathered

    if rank == ours.perturb_rank:
        with torch.no_grad():
            next(p for p in model.parameters() if p.dtype == torch.float32).add_(0.01)
    # one batch again and again: the model learns it, and its loss comes to depend on every weight
    for _ in range(CHECKED_STEPS):
        train_model(inputs, targets, window).backward()
        adam.step()
        muon.step()
        model.zero_grad(set_to_none=True)
    found["differ"] = 0.0
    for p in model.parameters() if world > 1 else []:
        theirs = p.detach().clone()
        dist.broadcast(theirs, 0)
        difference = (p.detach().float() - theirs.float()).abs().nan_to_num(math.inf).max()
        found["differ"] = max(found["differ"], difference.item())

    short = (inputs[:EAGER_TOKENS], targets[:EAGER_TOKENS])
    model.eval()
    with torch.no_grad(), warnings.catch_warnings():
        # that eager attention holds every score, which is the point here
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
        found["eager"] = model(*short, window).item()
        found["compiled"] = compiled_model(*short, window).item()
    model.train()
    return found


def faults_found(found, device):
    """Each fault that the ranks' findings show, by rank."""
    faults = []
    tops = [statistics.quantiles(f["times"], n=4)[-1] for f in found]
    for rank, f in enumerate(found):
        median = statistics.median(f["times"])
        others = max(tops[:rank] + tops[rank + 1:], default=math.inf)
        if median > (1 + SLOW_MARGIN[device.type]) * others:
            faults.append(f"rank {rank}: slow alone, {median:.2f} ms a micro-batch against at most "
                          f"{others:.2f} ms on the others ({f['facts']})")
        if f["differ"]:
            faults.append(f"rank {rank}: its weights after {CHECKED_STEPS} steps differ from rank "
                          f"0's (by up to {f['differ']:.3g})")
        if not abs(f["compiled"] - f["eager"]) <= LOSS_TOLERANCE * abs(f["eager"]):
            faults.append(f"rank {rank}: compiled loss {f['compiled']:.4f}, eager {f['eager']:.4f}")
        reference = found[0]["compiled"]
        if not abs(f["compiled"] - reference) <= RANK_TOLERANCE * abs(reference):
            faults.append(f"rank {rank}: loss {f['compiled']:.4f} on the batch where rank 0 "
                          f"computes {reference:.4f}")
    if "reduce" in found[0] and device.type == "cuda" and found[0]["reduce"][1] < LINK_FLOOR_GBPS:
        faults.append(f"links: all-reduce at {found[0]['reduce'][1]:.0f} GB/s bus bandwidth, below "
                      f"{LINK_FLOOR_GBPS} (NVLink H100 nodes: about {NVLINK_H100_GBPS}): a PCIe "
                      "node, or a slow link")
    return faults


def report(found, micro_batch, compiled):
    """The lines of steps 1 to 3, for the console and the log."""
    times = ", ".join(f"rank {r} {statistics.median(f['times']):.2f}" for r, f in enumerate(found))
    first = "the first, compiling" if compiled else "the first"
    lines = [f"each device alone: one micro-batch of {micro_batch:,} tokens forward and backward, "
             f"no communication, median of {REPEATS} in ms: {times}; {first}: "
             f"{found[0]['first_s']:.1f} s"]
    if "reduce" in found[0]:
        (reduce_mb, reduce_bus), (gather_mb, gather_bus) = found[0]["reduce"], found[0]["gather"]
        lines.append(f"links: all-reduce of the gradients' {reduce_mb:,.3g} MB at {reduce_bus:.3g} "
                     f"GB/s bus bandwidth, Muon's all-gather of {gather_mb:,.3g} MB at "
                     f"{gather_bus:.3g} GB/s (NVLink H100 nodes: about {NVLINK_H100_GBPS})")
    weights = "one process"
    if len(found) > 1:
        weights = f"weights differ from rank 0's by up to {max(f['differ'] for f in found):.3g}"
    how = "compiled/eager" if compiled else "compile is off: one computation"
    losses = ", ".join(f"rank {r} {f['compiled']:.4f}/{f['eager']:.4f}"
                       for r, f in enumerate(found))
    lines.append(f"right answers: after {CHECKED_STEPS} steps of DDP, Adam and Muon, {weights}; "
                 f"loss on {min(EAGER_TOKENS, micro_batch):,} tokens ({how}): {losses}")
    return lines + [f"device of rank {r}: {f['facts']}" for r, f in enumerate(found)]


def trainer_run(t, argv):
    """The trainer's main(argv) in this process, imported afresh (its start-up line counts from
    now): its exit code. Its console lines are in its log."""
    fresh_group_names()
    with contextlib.redirect_stdout(io.StringIO()):
        return load_trainer(t.__file__).main(argv)


def real_steps(t, trainer_argv, args, steps, folder, rank):
    """Step 4: on rank 0, the (path, text) of the first run's log and the resumed one's (none on
    the others); the exit code of a run that failed or stopped."""
    window = str(mean_window(t, args))
    # a folder for each rank: each writes a synthetic stream of its own there (where one rank's
    # would replace another's, the trainer could find it changed since it started)
    mine, written = folder / f"rank{rank}", folder / "rank0"
    first = [*trainer_argv, "--num_iterations", str(steps), "--val_loss_every", "0",
             "--checkpoint_every", str(steps - RESUMED_STEPS), "--save_checkpoint", "false",
             "--window_start", window, "--window_end", window, "--hellaswag", "false",
             "--log_dir", str(mine)]
    code = trainer_run(t, first)
    if code:
        return code
    # rank 0 wrote them
    checkpoints, logs = list(written.glob("*/state_step*.pt")), set(written.glob("*.txt"))
    if len(checkpoints) != 1:
        raise t.UserError(f"rank 0's checkpoint is not in {written} on this node: check one node "
                          "(torchrun --standalone)", every_rank=True)
    code = trainer_run(t, ["--resume", str(checkpoints[0]), "--log_dir", str(mine)])
    if code:
        return code
    if rank != 0:
        return []
    (log,), (resumed,) = logs, set(written.glob("*.txt")) - logs
    return [(path, path.read_text()) for path in (log, resumed)]


def projection(t, args, world, step_ms, eval_ms):
    """The projected timed training and validation of the run the options describe, in words."""
    timed = max(args.num_iterations - t.UNTIMED_STEPS, 0)
    every = args.val_loss_every
    # at step 0, every val_loss_every steps, and after the last
    validations = 1
    if every:
        validations = len(set(range(0, args.num_iterations, every)) | {args.num_iterations})
    batches = args.val_tokens // t.micro_batch_plan(args, world)[2]
    train_s, val_s = timed * step_ms / 1000, validations * batches * eval_ms / 1000
    return (f"projected {train_s:,.2f} s of timed training ({timed:,} timed steps x {step_ms:.2f} "
            f"ms; record 18: {RECORD_SECONDS} s at {RECORD_STEP_MS} ms) and {val_s:,.2f} s of "
            f"validation ({validations} x {args.val_tokens:,} tokens)")


def conclude(t, ours, args, world, device, found, faults, lines, logs):
    """Step 5, on rank 0: the last lines of the console, and the log; the exit code."""
    (first, text), (_, resumed) = logs
    steps, first_loss, step_avg = VAL_LINE.findall(text)[-1]
    lines.append(f"real steps: {steps} steps of the trainer, the window held at "
                 f"{mean_window(t, args)} tokens: step_avg {step_avg} ms; checkpoint at step "
                 f"{ours.steps - RESUMED_STEPS}, resumed on every rank: val loss "
                 f"{VAL_LINE.findall(resumed)[-1][1]} (the run it resumes: {first_loss})")
    projected = projection(t, args, world, float(step_avg), max(f["eval_ms"] for f in found))
    device_mib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2 ** 20
    if device.type == "cuda":
        device_mib = torch.cuda.get_device_properties(device).total_memory // 2 ** 20
    state = f"{len(faults)} fault(s): {'; '.join(faults)}" if faults else "fit"
    peak = int(PEAK_LINE.findall(text)[-1])
    verdict = (f"node check: {state}; {projected}; peak memory {peak:,} of {device_mib:,} MiB; "
               f"checked in {time.perf_counter() - ours.started:.0f} s")
    source = text.splitlines()
    at = source.index(SEPARATOR)
    log = Path(args.log_dir) / f"node_check-{first.stem}.txt"
    ours_source = Path(__file__).read_text().splitlines()
    try:
        log.write_text("\n".join([*source[:at], *ours_source, *source[at:], *lines, verdict]) + "\n")
    except OSError as e:
        log = f"{log} could not be written ({e.strerror})"
    print(lines[-1], f"log: {log}", sep="\n")
    print(verdict, flush=True)
    return 1 if faults else 0


def own_checks_on_every_rank(t, ours, args, rank, world, device, folder):
    """Steps 1 to 3, on a process group of the check's own: every rank's findings."""
    if world > 1:
        fresh_group_names()
        t.start_process_group(device)
    micro_batch = t.micro_batch_plan(args, world)[0]
    # out of memory: the trainer's line, which says what to pass
    try:
        with t.out_of_memory_as_error(micro_batch):
            found = [dict(own_checks(t, args, ours, rank, world, device), folder=folder)]
        if world > 1:
            mine, found = found[0], [None] * world
            dist.all_gather_object(found, mine)
        return found
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def check(t, ours, trainer_argv, args, rank, world, device):
    """Steps 1 to 5 on this rank: the exit code."""
    if ours.steps < t.UNTIMED_STEPS + 2:
        raise t.UserError(f"--steps must be at least {t.UNTIMED_STEPS + 2}: the trainer leaves "
                          f"its first {t.UNTIMED_STEPS} untimed")
    for faulty in {ours.slow_rank, ours.perturb_rank} - {None, *range(world)}:
        raise t.UserError(f"there is no rank {faulty} of {world} to make faulty")
    if device.type == "cpu":
        # as the trainer's runs do: a CPU's passes here are timed as its steps there
        t.keep_freed_memory()
    # the trainer's runs' scratch folder: rank 0 makes it, names it to all, and removes it
    folder = None
    if rank == 0:
        try:
            os.makedirs(args.log_dir, exist_ok=True)
            folder = tempfile.mkdtemp(prefix="node_check-", dir=args.log_dir)
        except OSError as e:
            raise t.UserError(f"cannot write in --log_dir {args.log_dir} ({e.strerror}): free "
                              "some space or pick another") from None
    try:
        found = own_checks_on_every_rank(t, ours, args, rank, world, device, folder)
        faults = faults_found(found, device)
        lines = report(found, t.micro_batch_plan(args, world)[0], t.switched_on(args.compile, device))
        if rank == 0:
            print(*lines, sep="\n", flush=True)
        # the check's model and compiled code go before the trainer's runs
        gc.collect()
        if t.switched_on(args.compile, device):
            torch.compiler.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        logs = real_steps(t, trainer_argv, args, ours.steps, Path(found[0]["folder"]), rank)
    finally:
        if folder:
            shutil.rmtree(folder, ignore_errors=True)
    if not isinstance(logs, list):
        # the trainer's last line says what happened; a stop ends the check as it ended the run
        if logs > 1:
            print("node check: stopped in the trainer's run, no verdict (that run was the "
                  "check's: its files are gone)", file=sys.stderr)
            return logs
        faults.append(f"rank {rank}: the trainer's run failed (its error is above)")
        print(f"node check: {len(faults)} fault(s): {'; '.join(faults)}; no projection", flush=True)
        return 1
    # rank 0 says the verdict, and exits last
    if rank != 0:
        return 0
    return conclude(t, ours, args, world, device, found, faults, lines, logs)


def main(argv=None):
    ours, trainer_argv = parse_args(sys.argv[1:] if argv is None else argv)
    ours.started = time.perf_counter()
    t = load_trainer(ours.trainer)
    # as the trainer's main does, before anything initialises CUDA
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    # a stop (torchrun passes Ctrl-C on as SIGTERM) ends the check as Ctrl-C does, its scratch
    # folder removed; the trainer's runs stop on their own
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        args = t.parse_args(trainer_argv)
        if args.resume:
            raise t.UserError("--resume: the check makes its own runs from scratch; leave it out")
        t.check_hyperparameters(args)
        # the trainer says so too, but only after the check's own passes
        for split in ("train", "val"):
            pattern = getattr(args, f"{split}_files")
            if pattern != "synthetic" and not glob.glob(pattern):
                hint = t.fetch_hint(args.num_iterations, args.batch_size)
                raise t.UserError(f"no {split} shard matches {pattern!r}: {hint}, or point "
                                  f"--{split}_files at yours")
        t.check_launch_environment()
        rank, world, device = t.setup_device()
        return check(t, ours, trainer_argv, args, rank, world, device)
    except t.UserError as e:
        if e.every_rank or int(os.environ.get("LOCAL_RANK", 0)) == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("node check: stopped, no verdict", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
