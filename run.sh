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

# torchrun, ending with the trainer's own last lines: a failed worker's line, which the trainer leaves in
# the error file torchrun gives each worker, is printed again last (the first failure at the very end), in
# place of torchrun's traceback and report; a stop signal ends it quietly with the signal's exit code.
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
    return failure.exitcode if failure.exitcode >= 0 else 128 - failure.exitcode


logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(not_the_failure_report)
# that torchrun has no error file of its own to copy a worker's into
logging.getLogger("torch.distributed.elastic.multiprocessing.errors.error_handler").setLevel(logging.CRITICAL)
if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
    # under nohup: torchrun would catch hang-ups and stop its workers; they stay ignored, by all
    os.environ.setdefault("PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGQUIT")
try:
    main()
except SignalException as stop:
    sys.exit(128 + stop.sigval)
except ChildFailedError as failed:
    recorded = sorted((f for f in failed.failures.values() if os.path.isfile(f.error_file)),
                      key=lambda f: os.path.getmtime(f.error_file))
    lines = [f.message["message"] if isinstance(f.message, dict) else f.message for f in recorded]
    if not recorded:
        rank, first = failed.get_first_failure()
        how = f"by {first.signal_name()}" if first.exitcode < 0 else f"with exit code {first.exitcode}"
        lines = [f"run.sh: rank {rank} ended {how}, without an error line of its own; its output is above"]
    try:
        print(*reversed(list(dict.fromkeys(lines))), sep="\n", file=sys.stderr, flush=True)
    except OSError:
        pass
    sys.exit(exit_code(recorded[0]) if recorded else exit_code(first))
PYTHON
exec python -c "$launcher" --standalone --nproc_per_node="$gpus" train_gpt.py "$@"
