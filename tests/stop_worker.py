"""train_gpt.main() as torchrun runs it, but preempted: at step STOP_AT, rank 0 sends SIGTERM to its
parent (the torchrun agent, which forwards it to every worker) and waits until the signal reached
its own handler. The processes exchange the stop flag at every step (STOP_CHECK_EVERY = 1): all stop
after step STOP_AT + 1.

Run by tests/test_resume.py: `torchrun ... stop_worker.py STOP_AT TRAINER_OPTIONS...`."""
import os
import signal
import sys
import time

import train_gpt

STOP_AT = int(sys.argv.pop(1))
agreed = train_gpt.CleanStop.agreed


def agreed_after_preemption(self, step):
    if step == STOP_AT and os.environ["RANK"] == "0":
        os.kill(os.getppid(), signal.SIGTERM)
        while not self.received:
            time.sleep(0.01)
    return agreed(self, step)


train_gpt.STOP_CHECK_EVERY = 1
train_gpt.CleanStop.agreed = agreed_after_preemption
sys.exit(train_gpt.main())
