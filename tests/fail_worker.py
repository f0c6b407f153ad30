"""train_gpt.main() as torchrun runs it, but rank 1 runs out of memory in Muon's step of train step
FAIL_AT (the exception a GPU raises, which the trainer turns into its one-line error), while rank 0
goes on into the step's all-gather with it.

Run by tests/test_launch.py, through run.sh: `... fail_worker.py FAIL_AT TRAINER_OPTIONS...`."""
import gc
import os
import sys

# the imports with the collector off, then their objects out of later collections, as
# helpers.imported_frozen does (about half a second of CPU)
gc.disable()
import torch  # noqa: E402
import torch._dynamo  # noqa: E402, F401

import train_gpt  # noqa: E402

gc.freeze()
gc.enable()

FAIL_AT = int(sys.argv.pop(1))
muon_step = train_gpt.Muon.step
steps = []


def muon_step_out_of_memory_on_rank_1(self):
    steps.append(len(steps) + 1)
    if len(steps) == FAIL_AT and os.environ["RANK"] == "1":
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.14 GiB")
    return muon_step(self)


train_gpt.Muon.step = muon_step_out_of_memory_on_rank_1
code = train_gpt.main()
# leave without a last full collection over torch's objects (about a second of CPU)
gc.freeze()
sys.exit(code)
