"""Text from a checkpoint of train_gpt.py: a prompt, and the model's continuation of it.

    python evals/sample.py logs/<run id>/state_step001390.pt --prompt "The capital of France is"
    python evals/sample.py CHECKPOINT --prompt TEXT --max_new_tokens 200 --temperature 0.8 \\
        --top_k 50 --seed 1

The prompt starts a document, as in training: 50256 first. Each new token comes from a full
forward over the document so far (no KV cache), padded after its last token to whole blocks of
128, which causal attention keeps from changing what comes before. At --temperature 0 (the
default) it is the likeliest token (greedy); else a draw from softmax(logits / temperature), among
the --top_k likeliest when given, seeded by --seed. Only the tokenizer's ids are drawn, never the
rows that pad the head to a multiple of 128. The document stays within the attention window the
run ended its training with. stdout gets the prompt and its continuation, decoded, nothing
stripped, and nothing else. The model is the checkpoint's own, built by the trainer whose source it
carries (see evals/common.py), with that trainer's end-of-text id and block size.
"""
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


@torch.no_grad()
def generate(model, prompt, max_new_tokens, window_blocks, vocab, temperature=0.0, top_k=0,
             generator=None):
    """The prompt's tokens followed by max_new_tokens more, each below vocab (the tokenizer's
    number of ids)."""
    # the constants of the trainer that built the model
    trainer = common.trainer_of(model)
    eot = trainer.EOT
    block_size = trainer.BLOCK_SIZE
    device = next(model.parameters()).device
    window = torch.tensor(window_blocks, dtype=torch.int32, device=device)
    tokens = [eot, *prompt]
    for _ in range(max_new_tokens):
        length = math.ceil(len(tokens) / block_size) * block_size
        padded = torch.full((length,), eot, dtype=torch.int32)
        padded[:len(tokens)] = torch.tensor(tokens)
        logits = model(padded.to(device), None, window)[len(tokens) - 1, :vocab]
        if temperature == 0:
            tokens.append(int(logits.argmax()))
            continue
        logits = logits.double() / temperature
        if top_k:
            kth_largest = torch.topk(logits, min(top_k, vocab)).values[-1]
            logits = logits.masked_fill(logits < kth_largest, -math.inf)
        tokens.append(int(torch.multinomial(logits.softmax(-1), 1, generator=generator)))
    return tokens[1:]


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
    parser.add_argument("--tokenizer", help="a tiktoken ranks file of GPT-2's BPE, for offline "
                        "use (default: tiktoken's own, downloaded once)")
    args = parser.parse_args(argv)
    for name in ("max_new_tokens", "top_k"):
        if getattr(args, name) < 0:
            raise EvalError(f"--{name} must be at least 0, got {getattr(args, name)}")
    if not (args.temperature == 0 or MIN_TEMPERATURE <= args.temperature < math.inf):
        raise EvalError(f"--temperature must be 0 (greedy) or from {MIN_TEMPERATURE:.3g} (below, "
                        f"the logits divided by it overflow) to a finite number, got "
                        f"{args.temperature}")
    if not 0 <= args.seed < 2 ** 64:
        raise EvalError(f"--seed must be from 0 to 2**64 - 1, got {args.seed}")
    tokenizer = common.encoding(args.tokenizer)
    trainer, checkpoint = common.open_checkpoint(args.checkpoint)
    rank, world_size, device = common.start_processes(trainer)
    if world_size > 1:
        raise EvalError("sample.py runs in one process: python evals/sample.py ...")
    model, options = common.build_model(trainer, checkpoint, args.checkpoint, device)
    prompt = tokenizer.encode_ordinary(args.prompt)
    window_blocks = common.trained_window_blocks(options)
    window = window_blocks * trainer.BLOCK_SIZE
    if 1 + len(prompt) + args.max_new_tokens > window:
        raise EvalError(f"{trainer.EOT}, the prompt's {len(prompt)} tokens and --max_new_tokens "
                        f"{args.max_new_tokens} exceed the model's attention window of {window} "
                        "tokens (the one it ended its training with): give a shorter prompt or "
                        "fewer new tokens")
    generator = torch.Generator(device).manual_seed(args.seed)
    tokens = generate(model, prompt, args.max_new_tokens, window_blocks, tokenizer.n_vocab,
                      args.temperature, args.top_k, generator)
    common.print_out(tokenizer.decode(tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
