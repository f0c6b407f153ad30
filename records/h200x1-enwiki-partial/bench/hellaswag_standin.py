"""A stand-in for HellaSwag's val set where there is no network: 10,042 examples cut from English
Wikipedia val tokens, with HellaSwag-like lengths (a context of 15-100 tokens, four endings of
10-40 each) and random labels, so its accuracy means nothing; its cost is HellaSwag's.

    python hellaswag_standin.py VAL_SHARD GPT2_TIKTOKEN OUT.jsonl     (from the repository root)
"""
import json
import sys

import numpy as np

sys.path.insert(0, ".")
from evals import common  # noqa: E402

shard, ranks, out = sys.argv[1:4]
encoding = common.encoding(ranks)
tokens = np.fromfile(shard, dtype="<u2")[512:]  # after the 1,024-byte header
tokens = tokens[tokens != 50256]
rng = np.random.default_rng(0)
position = 0


def text(count):
    global position
    piece = tokens[position:position + count].tolist()
    position += count
    return encoding.decode(piece).strip() or "x"


with open(out, "w") as f:
    for _ in range(10042):
        context = text(int(rng.integers(15, 101)))
        endings = [text(int(rng.integers(10, 41))) for _ in range(4)]
        f.write(json.dumps(dict(ctx=context, endings=endings, label=int(rng.integers(0, 4)))) + "\n")
print(f"{position:,} tokens used")
