"""train_gpt.main() as torchrun runs it, but at step FULL_AT rank 0's log starts failing as on a
full disk (its descriptor becomes /dev/full's). The processes exchange the stop flag at every step
(STOP_CHECK_EVERY = 1).

Run by tests/test_disk.py: `torchrun ... log_full_worker.py FULL_AT TRAINER_OPTIONS...`."""
import os
import sys

import train_gpt

FULL_AT = int(sys.argv.pop(1))
agreed = train_gpt.CleanStop.agreed


def agreed_with_a_full_disk(self, step):
    if step == FULL_AT and os.environ["RANK"] == "0":
        for fd in os.listdir("/proc/self/fd"):
            if os.path.realpath(f"/proc/self/fd/{fd}").endswith(".txt"):
                os.dup2(os.open("/dev/full", os.O_WRONLY), int(fd))
    return agreed(self, step)


train_gpt.STOP_CHECK_EVERY = 1
train_gpt.CleanStop.agreed = agreed_with_a_full_disk
sys.exit(train_gpt.main())
