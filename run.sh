#!/usr/bin/env bash
# ./run.sh [SCRIPT.py] [OPTIONS...]: train_gpt.py, or a fork, on one process per visible GPU
set -euo pipefail
script=train_gpt.py
if [[ "${1-}" == *.py ]]; then
    [ -f "$1" ] || { echo "run.sh: $1: no such script" >&2; exit 1; }
    script=$(realpath "$1") && shift
fi
cd "$(dirname "$0")"
gpus=$(python -c "import torch; print(torch.cuda.device_count())") \
    || { echo "run.sh: python cannot import torch: pip install -r requirements.txt" >&2; exit 1; }
if [ "$gpus" -eq 0 ]; then
    # GPUs this torch cannot use (a CPU-only build, say): the trainer's own check names the fix
    listed=$(timeout 60 nvidia-smi -L 2>/dev/null || true)
    if [ "${CUDA_VISIBLE_DEVICES-unset}" != "" ] && grep -q ^GPU <<< "$listed"; then
        exec python "$script" "$@"
    fi
    echo "run.sh: no CUDA GPU visible; a CPU smoke run: python ${script##*/} --preset smoke" >&2
    exit 1
fi
# after SIGTERM, SIGINT or SIGHUP, torchrun gives its workers this long to finish their step and
# write a checkpoint (torch 2.12 and later; 2.11 gives 30 s); under nohup hang-ups stay ignored
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-300}"
[ -z "$(trap -p HUP)" ] || export PET_SIGNALS_TO_HANDLE="SIGTERM,SIGINT,SIGQUIT"
exec python -m torch.distributed.run --standalone --nproc_per_node="$gpus" "$script" "$@"
