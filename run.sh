#!/usr/bin/env bash
# One process per visible GPU (8 on the target node); extra arguments go to train_gpt.py.
#   ./run.sh                         the record configuration
#   ./run.sh --num_iterations 200    any option of `python train_gpt.py --help`
set -euo pipefail
cd "$(dirname "$0")"
if ! gpus=$(python -c "import torch; print(torch.cuda.device_count())"); then
    echo "run.sh: python cannot import torch: pip install -r requirements.txt" >&2
    exit 1
fi
if [ "$gpus" -eq 0 ]; then
    # GPUs this torch cannot use (a CPU-only build, say): the trainer's own check names them and the fix
    listed=$(timeout 60 nvidia-smi -L 2>/dev/null || true)
    if [ "${CUDA_VISIBLE_DEVICES-unset}" != "" ] && grep -q "^GPU" <<< "$listed"; then
        exec python train_gpt.py "$@"
    fi
    echo "run.sh: no CUDA GPU visible. For a CPU smoke run (under a minute), see README.md:" >&2
    echo "  python train_gpt.py --preset smoke" >&2
    exit 1
fi

# After SIGTERM, SIGINT or SIGHUP, torchrun gives its workers this many seconds to finish their step and
# write a checkpoint, then kills them (read by torch 2.12 and later; torch 2.11 always gives 30 s).
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-300}"

# torchrun, ending with the trainer's own last lines. The trainer leaves each worker's last line (an error,
# a stop) and exit code in the error file torchrun gives that worker: when workers fail, their lines are
# printed again, last, the first failure's at the very end, in place of torchrun's traceback and report,
# and run.sh exits with that worker's own code (torchrun's SIGTERM may end it after it wrote its line).
# A worker that died without a line (killed) is named last: the others' lines follow from its death.
# A stop signal that reached torchrun ends it quietly (the workers' stop line is already last), with
# 128 + the signal.
read -r -d '' launcher <<'PYTHON' || true
import logging
import os
import signal
import sys

from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main


def not_the_failure_report(record):
    return not str(record.msg).startswith("failed (exitcode")


def exit_code(failure):
    if isinstance(failure.message, dict) and "exit_code" in failure.message.get("extraInfo", {}):
        return failure.message["extraInfo"]["exit_code"]
    if failure.exitcode < 0:
        return 128 - failure.exitcode
    return failure.exitcode


def unrecorded_line(rank, failure):
    how = f"with exit code {failure.exitcode}"
    if failure.exitcode < 0:
        how = f"by {failure.signal_name()}"
    return f"run.sh: rank {rank} ended {how}, without an error line of its own; its output is above"


def last_line(failure):
    if isinstance(failure.message, dict):
        return failure.message["message"]
    return failure.message


logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(not_the_failure_report)
# it says that torchrun has no error file of its own to copy a worker's into
logging.getLogger("torch.distributed.elastic.multiprocessing.errors.error_handler").setLevel(logging.CRITICAL)
if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
    # under nohup: torchrun would catch a hang-up and stop its workers; it stays ignored, by all
    os.environ.setdefault("PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGQUIT")
try:
    main()
except SignalException as stop:
    sys.exit(128 + stop.sigval)
except ChildFailedError as failed:
    recorded = [f for f in failed.failures.values() if os.path.isfile(f.error_file)]
    recorded.sort(key=lambda f: os.path.getmtime(f.error_file))
    # torchrun's SIGTERM ends the others once one has failed: those are no cause
    unrecorded = [(rank, f) for rank, f in failed.failures.items()
                  if not os.path.isfile(f.error_file) and f.exitcode != -signal.SIGTERM]
    # each line once, where it first appeared; the first failure, the cause of the others, last
    lines = list(dict.fromkeys(last_line(f) for f in recorded))
    lines.reverse()
    if recorded:
        first = recorded[0]
    if unrecorded or not recorded:
        rank, first = (unrecorded or [failed.get_first_failure()])[0]
        lines.append(unrecorded_line(rank, first))
    try:
        print(*lines, sep="\n", file=sys.stderr, flush=True)
    except OSError:
        pass
    sys.exit(exit_code(first))
PYTHON
exec python -c "$launcher" --standalone --nproc_per_node="$gpus" train_gpt.py "$@"
