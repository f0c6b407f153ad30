"""Text from a checkpoint of train_gpt.py: a prompt, and the model's continuation of it.

    python evals/sample.py logs/<run id>/state_step001390.pt --prompt "The capital of France is"
    python evals/sample.py CHECKPOINT --prompt TEXT --max_new_tokens 200 --temperature 0.8 \\
        --top_k 50 --seed 1
    python evals/sample.py CHECKPOINT --prompt TEXT --num_samples 4 --temperature 0.8

The prompt starts a document, as in training: 50256 first. The model's own KV cache (KVCache in the
trainer) keeps each layer's keys and values, so that a new token costs one token's forward, however
long the document: the prompt is one forward, each new token another. The model runs in fp32 (its
bf16 tables cast, as HellaSwag scores it), so that the cache changes only fp32 rounding against full
forwards, where bf16's could flip a close call. At --temperature 0 (the default) a new token is the
likeliest (greedy); else a draw from softmax(logits / temperature), among the --top_k likeliest when
given, seeded by --seed. --num_samples N draws N continuations in one batch (greedy: N equal ones).
Only the tokenizer's ids are drawn, never the rows that pad the head to a multiple of 128. The model
attends as it trained at the checkpoint's step: within its sliding window (1,792 tokens at the end
of record 18's run), over a document of up to 65,536 tokens (its rotary positions); a trainer
without the window's schedule (get_sliding_window_blocks), over the whole document. stdout gets the
prompt and its continuation, decoded, nothing stripped, and nothing else; with several samples, each
one so, after a line `--- sample i of N`. The model is the checkpoint's own, built by this
repository's train_gpt.py when that is the source the checkpoint carries, or by --trainer FILE, your
copy of a fork (see evals/common.py: any other source stops before any of it runs, unless
--trust_checkpoint_code; --show_source prints it against train_gpt.py, --write_source FILE saves
it), with that trainer's end-of-text id, block size and KV cache.
"""
import copy
import math
import sys
from pathlib import Path

import torch

# the repository: train_gpt.py and evals/
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from evals import common  # noqa: E402
from evals.common import EvalError  # noqa: E402

# the smallest temperature that divides any fp32 logit into a finite float64, in which the logits
# are divided (about 1.9e-270); a smaller one but 0 is refused
MIN_TEMPERATURE = torch.finfo(torch.float32).max / torch.finfo(torch.float64).max
# the names of the trainer module that sampling uses, besides common.py's
TRAINER_NAMES = (*common.TRAINER_NAMES, "EOT", "BLOCK_SIZE", "KVCache")


def generate(model, prompt, max_new_tokens, window_blocks, vocab, temperature=0.0, top_k=0,
             generator=None):
    """The prompt's tokens followed by max_new_tokens more, each below vocab (the tokenizer's
    number of ids)."""
    return generate_batch(model, prompt, max_new_tokens, window_blocks, vocab, temperature,
                          top_k, generator)[0]


@torch.no_grad()
def generate_batch(model, prompt, max_new_tokens, window_blocks, vocab, temperature=0.0, top_k=0,
                   generator=None, num_samples=1):
    """num_samples continuations of the prompt, drawn in one batch: each the prompt's tokens
    followed by max_new_tokens more, each below vocab (the tokenizer's number of ids). The model
    runs in fp32 (a copy, unless it is in fp32 already) with its own KV cache."""
    if any(p.dtype != torch.float32 for p in model.parameters()):
        model = copy.deepcopy(model).float()
    device = next(model.parameters()).device
    window = torch.tensor(window_blocks, dtype=torch.int32, device=device)
    # the module that defined the model's class: a fork's model brings its own cache
    trainer = common.trainer_of(model)
    cache = trainer.KVCache(num_samples, 1 + len(prompt) + max_new_tokens, device)
    tokens = torch.tensor([trainer.EOT, *prompt], dtype=torch.int32, device=device)
    tokens = tokens.expand(num_samples, -1)
    new_tokens = tokens
    for _ in range(max_new_tokens):
        # the logits of each sample's last token, after the forward of the tokens not yet cached
        logits = model(new_tokens, None, window, cache)[:, :vocab]
        if temperature == 0:
            new_tokens = logits.argmax(-1, keepdim=True)
        else:
            # in float64: a temperature down to MIN_TEMPERATURE leaves the logits finite
            logits = logits.double() / temperature
            if top_k:
                kth_largest = torch.topk(logits, min(top_k, vocab)).values[:, -1:]
                logits = logits.masked_fill(logits < kth_largest, -math.inf)
            new_tokens = torch.multinomial(logits.softmax(-1), 1, generator=generator)
        new_tokens = new_tokens.int()
        tokens = torch.cat([tokens, new_tokens], 1)
    return tokens[:, 1:].tolist()


def main(argv=None):
    return common.run_main(lambda: run(argv))


def run(argv):
    parser = common.ArgumentParser(
        description="Continue a prompt with a train_gpt.py checkpoint.")
    parser.add_argument("checkpoint", help="a checkpoint that train_gpt.py wrote (state_step*.pt)")
    parser.add_argument("--prompt", default="",
                        help="the text to continue (default: none, from a document's start)")
    parser.add_argument("--max_new_tokens", type=int, default=100, help="default: %(default)s")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy (default: %(default)s)")
    parser.add_argument("--top_k", type=int, default=0,
                        help="draw among the k likeliest tokens (default 0: among all)")
    parser.add_argument("--seed", type=int, default=0, help="0 to 2**64 - 1 (default: %(default)s)")
    parser.add_argument("--num_samples", type=int, default=1,
                        help="continuations drawn in one batch (default: %(default)s)")
    parser.add_argument("--tokenizer", help="a tiktoken ranks file of GPT-2's BPE, for offline "
                        "use (default: tiktoken's own, downloaded once)")
    common.add_code_options(parser)
    args = parser.parse_args(argv)
    if args.show_source or args.write_source:
        return common.show_or_write_source(args)
    for name in ("max_new_tokens", "top_k"):
        if getattr(args, name) < 0:
            raise EvalError(f"--{name} must be at least 0, got {getattr(args, name)}")
    if args.num_samples < 1:
        raise EvalError(f"--num_samples must be at least 1, got {args.num_samples}")
    if not (args.temperature == 0 or MIN_TEMPERATURE <= args.temperature < math.inf):
        raise EvalError(f"--temperature must be 0 (greedy) or from {MIN_TEMPERATURE:.3g} (below, "
                        f"the logits divided by it overflow) to a finite number, got "
                        f"{args.temperature}")
    if not 0 <= args.seed < 2 ** 64:
        raise EvalError(f"--seed must be from 0 to 2**64 - 1, got {args.seed}")
    tokenizer = common.encoding(args.tokenizer)
    trainer, checkpoint, built_by = common.open_checkpoint(
        args.checkpoint, args.trainer, args.trust_checkpoint_code, TRAINER_NAMES)
    rank, world_size, device = common.start_processes(trainer)
    if world_size > 1:
        raise EvalError("sample.py runs in one process: python evals/sample.py ...")
    prompt = tokenizer.encode_ordinary(args.prompt)
    length = 1 + len(prompt) + args.max_new_tokens
    if length > common.MAX_POSITIONS:
        raise EvalError(f"{trainer.EOT}, the prompt's {len(prompt)} tokens and --max_new_tokens "
                        f"{args.max_new_tokens} exceed the model's {common.MAX_POSITIONS} "
                        "positions: give a shorter prompt or fewer new tokens")
    model, options = common.build_model(trainer, checkpoint, args.checkpoint, device, built_by)
    # the window the checkpoint's step trained with; else the whole document
    window_blocks = math.ceil(length / trainer.BLOCK_SIZE)
    if hasattr(trainer, "get_sliding_window_blocks"):
        step = checkpoint.get("step", options.num_iterations)
        window_blocks = trainer.get_sliding_window_blocks(step, options)
    generator = torch.Generator(device).manual_seed(args.seed)
    # fp32, as generate_batch needs it: converted here rather than copied there
    model.float()
    samples = generate_batch(model, prompt, args.max_new_tokens, window_blocks, tokenizer.n_vocab,
                             args.temperature, args.top_k, generator, args.num_samples)
    texts = [tokenizer.decode(tokens) for tokens in samples]
    if args.num_samples > 1:
        numbered = enumerate(texts, 1)
        texts = [f"--- sample {i} of {args.num_samples}\n{text}" for i, text in numbered]
    common.print_out("\n".join(texts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
