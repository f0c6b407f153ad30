"""HellaSwag, zero-shot, for a checkpoint of train_gpt.py: which ending does the model find likely?

    python evals/hellaswag.py logs/<run id>/state_step001390.pt
    torchrun --standalone --nproc_per_node=8 evals/hellaswag.py CHECKPOINT    # split across GPUs
    python evals/hellaswag.py CHECKPOINT --data my.jsonl --limit 500 --tokenizer gpt2.tiktoken
    python evals/hellaswag.py CHECKPOINT --data evals/smoke_hellaswag.jsonl   # offline, a smoke run

Each of an example's candidates is its own document, as in training: 50256, the tokens of the
context (`ctx`), then those of " " + the ending. A candidate's score is the model's loss over its
ending's tokens: `acc` counts the examples whose lowest summed loss is the labelled ending's,
`acc_norm` those whose lowest mean loss per token is (completion style, as llm.c and modded-nanogpt
score it). The candidates are packed into sequences of the model's own document-causal attention,
which never crosses a document, so packing changes only the rounding, which is fp32's: the model is
scored with its bf16 tables cast to fp32. Each candidate is scored whole: the attention window
spans the sequence, so a candidate sees all of itself (training's window, at least 128 tokens, would
change nothing for candidates that short) and nothing else. Every sequence has --sequence_length
tokens (the last one padded with lone 50256s): on a GPU the forward is compiled once for that
shape, which makes FlexAttention a fused kernel (see loss_per_token).

The data: HellaSwag's validation file (10,042 examples) from its authors' repository at a fixed
commit, downloaded once into data/hellaswag/ and checked against the git blob id that commit gives
it, so that a bad download is an error, not a wrong score. --data FILE reads a local JSON Lines
file in HellaSwag's format (ctx, endings, label; other fields are ignored). One such file ships in
evals/smoke_hellaswag.jsonl: 48 examples of everyday sentences written for this repository, to
check a checkpoint's scoring offline (a smoke run's model scores about chance on them), with
--tokenizer FILE (GPT-2's ranks) or tiktoken's own copy of GPT-2's encoding, fetched once online.
The last line printed is `hellaswag: acc_norm=... acc=... n=...`; the line before it says how long
the scoring took.

The model is the checkpoint's own: built by this repository's train_gpt.py when that is the source
the checkpoint carries, or by --trainer FILE, your copy of a fork (see evals/common.py: any other
source stops before any of it runs, unless --trust_checkpoint_code; --show_source prints it against
train_gpt.py, --write_source FILE saves it); the scoring uses that trainer's end-of-text id and
block size. The trainer's --hellaswag hands over its own model and options instead (ForTrainer),
and its log embeds this file's source and common.py's after its own.
"""
import contextlib
import copy
import hashlib
import http.client
import json
import math
import os
import socket
import stat
import sys
import time
import urllib.request
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

# the repository: train_gpt.py and evals/
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from evals import common  # noqa: E402
from evals.common import EvalError  # noqa: E402

# hellaswag_val.jsonl at the last commit of github.com/rowanz/hellaswag (the same in every commit)
URL = ("https://raw.githubusercontent.com/rowanz/hellaswag/"
       "a29ff8e9a04bba4bd6588223785ce105328adc57/data/hellaswag_val.jsonl")
# the id git gives its content there: the sha1 of b"blob <size>\0" followed by the file's bytes
GIT_BLOB_ID = "0f5ee25d72216f12317d5d8a7b92deafa423d81e"
EXAMPLES = 10_042
CACHED = common.REPO / "data" / "hellaswag" / "hellaswag_val.jsonl"
# tokens per forward: their fp32 logits take 1.6 GB (the trainer uses its micro-batch instead)
SEQUENCE_LENGTH = 8192
# the positions of the model's rotary tables, as many as the trainer's micro-batch may have
MAX_SEQUENCE_LENGTH = common.MAX_POSITIONS
# the names of the trainer module that the scoring uses, besides common.py's
TRAINER_NAMES = (*common.TRAINER_NAMES, "EOT", "BLOCK_SIZE")


def git_blob_id(data):
    """The id git gives a file's content, as GitHub lists it."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def download(path=CACHED, url=URL, blob_id=GIT_BLOB_ID, data_option="--data"):
    """HellaSwag's validation file at path: the copy there if it checks out, else downloaded,
    checked, and renamed into place (never half a file). data_option: the option that gives a
    local file instead, for the messages."""
    path = Path(path)
    if path.exists():
        if git_blob_id(cached_bytes(path)) == blob_id:
            return path
        print(f"{path}: not the expected file; downloading it again", file=sys.stderr)
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            data = response.read()
    # URLError and HTTPError are OSErrors; a connection cut midway is an IncompleteRead (an
    # HTTPException), or a reset (an OSError)
    except (OSError, ValueError, http.client.HTTPException) as e:
        reason = getattr(e, "reason", None) or f"{type(e).__name__}: {e}"
        raise EvalError(f"cannot download HellaSwag from {url} ({reason}); offline, pass "
                        f"{data_option} FILE, a copy of hellaswag_val.jsonl; nothing was "
                        "saved") from None
    got = git_blob_id(data)
    if got != blob_id:
        raise EvalError(f"the download from {url} is not HellaSwag's validation file "
                        f"({len(data):,} bytes, git blob id {got[:12]}, expected {blob_id[:12]}); "
                        f"nothing was saved: run again, or pass {data_option} FILE")
    # host and process: two nodes that share the folder never write the same temp file
    temporary = path.with_name(f"{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_bytes(data)
        os.replace(temporary, path)
    except OSError as e:
        # a full disk leaves no part of the file behind
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)
        raise EvalError(f"cannot save HellaSwag to {path} ({e.strerror}); pass {data_option} "
                        "FILE") from None
    return path


def cached_bytes(path):
    """The bytes of the copy downloaded before, checked as --data files are: a folder, a named pipe
    or a device there (a link to /dev/zero) is refused without being read."""
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISREG(mode):
            return path.read_bytes()
    except OSError as e:
        raise EvalError(f"{path}: the copy of HellaSwag downloaded before cannot be read "
                        f"({e.strerror}): remove it, and run again to download it") from None
    raise EvalError(f"{path}: not a regular file (a folder, a pipe or a device) where HellaSwag's "
                    "download is kept: remove it, and run again to download it")


def read_examples(path, limit=None, data_option="--data"):
    """(context, endings, label) of the examples in a HellaSwag JSON Lines file; the first
    `limit` ones."""
    examples = []
    common.regular_file(path, data_option)
    try:
        # bytes, decoded line by line: a bad byte is reported with its line
        with open(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                if limit is not None and len(examples) == limit:
                    break
                where = f"{data_option} {path}, line {number}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise EvalError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start} of "
                                    "the line), so not a JSON Lines file") from None
                if line.strip():
                    examples.append(parse_example(line, where))
    except OSError as e:
        raise EvalError(f"{data_option} {path}: cannot read it ({e.strerror})") from None
    if not examples:
        raise EvalError(f"{data_option} {path}: no examples in it")
    return examples


def parse_example(line, where):
    """One line of the file: (context, endings, label), or an error naming the line."""
    try:
        item = json.loads(line)
        context, endings, label = item["ctx"], item["endings"], item["label"]
    except (ValueError, KeyError, TypeError) as e:
        raise EvalError(f"{where}: not a HellaSwag example ({type(e).__name__}: {e}); each line "
                        "is a JSON object with ctx (a text), endings (texts) and label (the index "
                        "of the right ending)") from None
    # labels are numbers, or digits in some copies (the hub's); the test split has none
    if isinstance(label, str) and label.isdigit():
        label = int(label)
    texts = isinstance(endings, list) and all(isinstance(e, str) for e in endings)
    if not isinstance(context, str) or not texts or len(endings) < 2:
        raise EvalError(f"{where}: ctx must be a text and endings a list of at least 2 texts")
    if type(label) is not int or not 0 <= label < len(endings):
        raise EvalError(f"{where}: label {label!r} is not the index of one of its "
                        f"{len(endings)} endings (HellaSwag's test split has no labels: use the "
                        "validation split)")
    return context, endings, label


def render(examples, tokenizer, eot=None):
    """Per example, its candidates: the tokens of the document (eot, the context, " " + the
    ending), and where the ending starts. eot: the trainer's end-of-text id (by default the
    tokenizer's, GPT-2's 50256)."""
    if eot is None:
        eot = tokenizer.eot_token
    rendered = []
    for number, (context, endings, _) in enumerate(examples, 1):
        start = [eot, *tokenizer.encode_ordinary(context)]
        candidates = []
        for ending in endings:
            candidates.append((start + tokenizer.encode_ordinary(" " + ending), len(start)))
        longest = max(len(document) for document, _ in candidates)
        # each candidate is scored whole, at positions the model's rotary tables hold
        if longest > MAX_SEQUENCE_LENGTH:
            raise EvalError(f"example {number} of the data: {longest:,} tokens with its longest "
                            f"ending, more than the model's {MAX_SEQUENCE_LENGTH:,} positions: "
                            "remove it from the data")
        rendered.append(candidates)
    return rendered


def pack(lengths, sequence_length):
    """(sequence, offset) of documents of these lengths, in order, none crossing the end of a
    sequence."""
    places = []
    sequence = 0
    offset = 0
    for length in lengths:
        assert length <= sequence_length
        if offset + length > sequence_length:
            sequence += 1
            offset = 0
        places.append((sequence, offset))
        offset += length
    return places


def loss_per_token(model, device):
    """f(tokens, targets, window) -> the model's loss at every position: the forward and the
    cross-entropy in one function, compiled on a GPU for one fixed sequence length.

    Compiled because FlexAttention is fused only then: torch.nn.attention.flex_attention.
    flex_attention takes the fused path only when torch.compiler.is_dynamo_compiling() (it then
    emits the flex_attention higher-order op for the compiler); called eagerly, it runs that op's
    CompositeExplicitAutograd kernel, sdpa_dense -> math_attention in
    torch/_higher_order_ops/flex_attention.py, which materialises the whole fp32 score matrix of
    each head. Under torch.compile, inductor lowers the op through the register_lowering of
    torch.ops.higher_order.flex_attention in torch/_inductor/kernel/flex/flex_attention.py
    (flex_attention()), which emits the Triton FlexAttention template on CUDA (sm80 and sm90 have
    configurations for fp32 and head dim 128), reading the block mask's lists and never building
    the score matrix. dynamic=False and every sequence the same length: one graph for all.
    In one graph with the forward, the cross-entropy never writes the softcapped logits again.

    On a CPU the same function runs uncompiled (the model's dense-mask attention; compiling on a
    CPU takes minutes): the tests check this path, padding and fixed length included, not the
    compiled one."""
    def losses(tokens, targets, window):
        logits = model(tokens, None, window)
        return F.cross_entropy(logits, targets, reduction="none")
    if device.type == "cuda":
        return torch.compile(losses, dynamic=False)
    return losses


@torch.no_grad()
def score(model, candidates, device, sequence_length=SEQUENCE_LENGTH, should_stop=None):
    """Each candidate's summed loss over its ending and the ending's token count (float64, on the
    CPU), and how they were packed: (sums, counts, sequences, tokens); None as
    soon as should_stop() is true, checked before each sequence. Every sequence is
    sequence_length tokens (or the longest candidate's whole blocks, if longer), the last one
    padded, so that a compiled forward has one shape; a lone sequence, its own blocks."""
    # the constants of the trainer that built the model
    trainer = common.trainer_of(model)
    eot = trainer.EOT
    block_size = trainer.BLOCK_SIZE
    # a copy in fp32 (the bf16 tables cast, so every activation is fp32): packing then changes only
    # fp32 rounding, where bf16's, each candidate at another position, could flip a close call
    model = copy.deepcopy(model).float()
    lengths = [len(tokens) for tokens, _ in candidates]
    sequence_length = max(sequence_length, math.ceil(max(lengths) / block_size) * block_size)
    places = pack(lengths, sequence_length)
    # a window of the whole sequence: each candidate sees all of itself, and nothing else
    window = torch.tensor(sequence_length // block_size, dtype=torch.int32, device=device)
    sums = torch.zeros(len(candidates), dtype=torch.float64)
    ending_lengths = [len(tokens) - start for tokens, start in candidates]
    counts = torch.tensor(ending_lengths, dtype=torch.float64)
    members = [[] for _ in range(places[-1][0] + 1)]
    for i, (sequence, offset) in enumerate(places):
        members[sequence].append((i, offset))
    if len(members) == 1:
        # one sequence (one shape): its whole blocks are enough
        sequence_length = math.ceil((places[-1][1] + lengths[-1]) / block_size) * block_size
    losses_of = loss_per_token(model, device)
    for sequence in members:
        if should_stop and should_stop():
            return None
        # padding: lone eots, each a document of its own, after the real tokens
        tokens = torch.full((sequence_length + 1,), eot, dtype=torch.int64)
        rows = []
        owners = []
        for i, offset in sequence:
            document, start = candidates[i]
            tokens[offset:offset + len(document)] = torch.tensor(document)
            # each of the ending's tokens is predicted at the position before it
            rows += range(offset + start - 1, offset + len(document) - 1)
            owners += [i] * (len(document) - start)
        tokens = tokens.to(device)
        losses = losses_of(tokens[:-1].to(torch.int32), tokens[1:], window)
        sums.index_add_(0, torch.tensor(owners), losses[rows].double().cpu())
    return sums, counts, len(members), sum(lengths)


def correct_counts(rendered, labels, sums, counts):
    """(by mean loss, by summed loss): the examples whose labelled ending scores lowest."""
    by_mean = 0
    by_sum = 0
    first = 0
    for candidates, label in zip(rendered, labels):
        total = sums[first:first + len(candidates)]
        mean = total / counts[first:first + len(candidates)]
        by_mean += int(mean.argmin()) == label
        by_sum += int(total.argmin()) == label
        first += len(candidates)
    return by_mean, by_sum


def read(data=None, limit=None, data_option="--data"):
    """The examples, from data (a JSON Lines file), or HellaSwag's validation set, downloaded
    once."""
    path = Path(data) if data else download(data_option=data_option)
    examples = read_examples(path, limit, data_option)
    if not data and limit is None and len(examples) != EXAMPLES:
        raise EvalError(f"{path}: {len(examples):,} examples, not HellaSwag's {EXAMPLES:,}: "
                        "delete it and run again")
    return examples


def prepare(data=None, tokenizer_file=None, limit=None, data_option="--data", eot=None):
    """The examples (see read), rendered with eot (see render), and their labels."""
    examples = read(data, limit, data_option)
    labels = [label for _, _, label in examples]
    return render(examples, common.encoding(tokenizer_file), eot), labels


class Stopped(Exception):
    """A stop ended the scoring before its end: no score. signal: the stop's signal number, the
    same on every rank."""

    def __init__(self, signal):
        super().__init__(f"stopped by signal {signal}")
        self.signal = signal


def evaluate(model, rendered, labels, device=None, rank=None, world_size=None,
             sequence_length=SEQUENCE_LENGTH, should_stop=None):
    """(acc_norm, acc, n, a line on what was scored in what time). Rank r scores examples r,
    r + world_size, ...; the counts are summed over the ranks, so every rank must call it. device:
    by default the model's; rank and world size: by default the process group's. should_stop: a
    callable giving a stop signal's number or 0, checked before each sequence; when it gave one
    on any rank, every rank raises Stopped after the last collective, and nothing is scored."""
    if device is None:
        device = next(model.parameters()).device
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_initialized() else 1
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    block_size = common.trainer_of(model).BLOCK_SIZE
    started = time.perf_counter()
    mine = slice(rank, None, world_size)
    candidates = [c for example in rendered[mine] for c in example]
    correct = torch.zeros(3, dtype=torch.int64)
    sequences = 0
    tokens = 0
    stop_signal = 0
    if candidates:
        scores = score(model, candidates, device, sequence_length, should_stop)
        if scores is None:
            stop_signal = should_stop()
        else:
            sums, counts, sequences, tokens = scores
            correct[:2] = torch.tensor(correct_counts(rendered[mine], labels[mine], sums, counts))
            correct[2] = len(labels[mine])
    elif should_stop:
        stop_signal = should_stop()
    if world_size > 1:
        correct = correct.to(device)
        dist.all_reduce(correct)
        # every rank stops if one did
        flag = torch.tensor(stop_signal, device=device)
        dist.all_reduce(flag, dist.ReduceOp.MAX)
        stop_signal = int(flag)
    if stop_signal:
        raise Stopped(stop_signal)
    by_mean, by_sum, n = correct.tolist()
    seconds = time.perf_counter() - started
    # score() lengthens the sequences to the longest candidate's whole blocks
    longest = max([len(document) for document, _ in candidates], default=0)
    length = max(sequence_length, math.ceil(longest / block_size) * block_size)
    details = (f"hellaswag: {n:,} examples in {seconds:.1f} s on {world_size} x {device.type} "
               f"(rank {rank}: {len(candidates):,} candidates, {tokens:,} tokens in {sequences} "
               f"sequences of up to {length:,})")
    return by_mean / n, by_sum / n, n, details


def result_line(acc_norm, acc, n):
    return f"hellaswag: acc_norm={acc_norm:.4f} acc={acc:.4f} n={n}"


def logged_source():
    """The source of the code that scores (this file, common.py, the tokenizer's and the file
    checks it uses), each after a line naming it: what the trainer's log embeds after its own."""
    tokenizer = common.gpt2_tokenizer
    sources = (__file__, common.__file__, tokenizer.__file__, tokenizer.files.__file__)
    parts = []
    for path in map(Path, sources):
        path = path.resolve()
        name = path.relative_to(common.REPO).as_posix()
        parts.append(f"\n{'-' * 100}\n# {name}, which scored --hellaswag\n{path.read_text()}")
    return "".join(parts)


class ForTrainer:
    """The trainer's --hellaswag, handed its options: the examples, read and rendered with the
    trainer's end-of-text id at its start-up (a bad file fails, as the trainer's UserError, before
    anything is written), and the source of the code that scores them, which its log embeds after
    its own. The trainer's constants and functions are read from the module that defined args."""

    def __init__(self, args):
        trainer = common.trainer_of(args)
        try:
            self.rendered, self.labels = prepare(args.hellaswag_data or None,
                                                 args.tokenizer or None,
                                                 data_option="--hellaswag_data", eot=trainer.EOT)
        except EvalError as e:
            raise trainer.UserError(f"--hellaswag: {e}") from None
        self.source = logged_source()

    def score(self, model, args, log, stop):
        """The trained model's scores into the trainer's log, outside train time, each rank scoring
        its share in sequences of --max_device_batch_size tokens, as validation, and its peak
        memory as the trainer measures it; (stopping, the signal): a stop signal (stop.received on
        any rank) ends it with no score."""
        device = next(model.parameters()).device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            acc_norm, acc, n, details = evaluate(model, self.rendered, self.labels,
                                                 sequence_length=args.max_device_batch_size,
                                                 should_stop=lambda: stop.received)
        except Stopped as stopped:
            return True, stopped.signal
        log(details)
        log(f"hellaswag: peak memory {common.trainer_of(args).peak_memory_mib(device)} MiB")
        log(result_line(acc_norm, acc, n))
        return False, 0


def main(argv=None):
    return common.run_main(lambda: run(argv))


def run(argv):
    parser = common.ArgumentParser(
        description="Zero-shot HellaSwag accuracy of a train_gpt.py checkpoint.",
        epilog="Offline, a smoke run's checkpoint, say: --data evals/smoke_hellaswag.jsonl (48 "
        "examples of HellaSwag's shape, our own sentences: a check of the scoring, not a "
        "benchmark) with --tokenizer FILE (GPT-2's ranks, gpt2.tiktoken) or with tiktoken's own "
        "copy of GPT-2's encoding, fetched once online.")
    parser.add_argument("checkpoint", help="a checkpoint that train_gpt.py wrote (state_step*.pt)")
    parser.add_argument("--data", help="a JSON Lines file in HellaSwag's format (default: "
                        "HellaSwag's validation set, downloaded once into data/hellaswag/)")
    parser.add_argument("--limit", type=int, help="score only the first N examples")
    parser.add_argument("--tokenizer", help="a tiktoken ranks file of GPT-2's BPE, for offline "
                        "use (default: tiktoken's own, downloaded once)")
    parser.add_argument("--sequence_length", type=int, default=SEQUENCE_LENGTH,
                        help="tokens per forward, a multiple of the model's block size, 128; fewer "
                        "take less GPU memory (default: %(default)s)")
    common.add_code_options(parser)
    args = parser.parse_args(argv)
    if args.show_source or args.write_source:
        return common.show_or_write_source(args)
    if args.limit is not None and args.limit < 1:
        raise EvalError(f"--limit must be at least 1, got {args.limit}")
    if not 1 <= args.sequence_length <= MAX_SEQUENCE_LENGTH:
        raise EvalError(f"--sequence_length must be a positive multiple of the model's block "
                        f"size up to {MAX_SEQUENCE_LENGTH} (the positions of its rotary tables), "
                        f"got {args.sequence_length}")
    # the data first: it is quicker to check than a checkpoint is to load
    examples = read(args.data, args.limit)
    tokenizer = common.encoding(args.tokenizer)
    trainer, checkpoint, built_by = common.open_checkpoint(
        args.checkpoint, args.trainer, args.trust_checkpoint_code, TRAINER_NAMES)
    rank, world_size, device = common.start_processes(trainer)
    if args.sequence_length % trainer.BLOCK_SIZE:
        raise EvalError(f"--sequence_length must be a positive multiple of the model's block "
                        f"size, {trainer.BLOCK_SIZE}, got {args.sequence_length}")
    model, _ = common.build_model(trainer, checkpoint, args.checkpoint, device, built_by)
    rendered = render(examples, tokenizer, trainer.EOT)
    labels = [label for _, _, label in examples]
    try:
        acc_norm, acc, n, details = evaluate(model, rendered, labels, device, rank, world_size,
                                             args.sequence_length)
    except torch.cuda.OutOfMemoryError:
        block_size = trainer.BLOCK_SIZE
        half = max(block_size, args.sequence_length // 2 // block_size * block_size)
        raise EvalError(f"out of GPU memory with sequences of {args.sequence_length:,} tokens: "
                        f"pass --sequence_length {half} (shorter sequences change the scores "
                        "only by fp32 rounding)") from None
    if rank == 0:
        common.print_out(f"{details}\n{result_line(acc_norm, acc, n)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
