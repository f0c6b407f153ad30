#!/usr/bin/env bash
# ./run.sh [SCRIPT.py] [OPTIONS...]: train_gpt.py, or a fork, with its options, on one process per
# visible GPU, or on the CPU without one; NPROC=N ./run.sh ... asks for N processes
set -euo pipefail
script=train_gpt.py
if [[ "${1-}" == *.py ]]; then
    [ -f "$1" ] || { echo "run.sh: $1: no such script" >&2; exit 1; }
    script=$(realpath "$1") && shift
fi
cd "$(dirname "$0")"
gpus=$(python -c "import torch; print(torch.cuda.device_count())") \
    || { echo "run.sh: python cannot import torch: pip install -r requirements.txt" >&2; exit 1; }
nproc=${NPROC:-$(( gpus > 0 ? gpus : 1 ))}
[[ "$nproc" =~ ^[1-9][0-9]*$ ]] || { echo "run.sh: NPROC=$nproc: give a number of processes" >&2; exit 1; }
# no GPU this torch can use: the trainer runs on the CPU (or says why a GPU it sees cannot be used)
if [ "$gpus" -eq 0 ] && [ "$nproc" -eq 1 ]; then
    exec python "$script" "$@"
fi
# after SIGTERM, SIGINT or SIGHUP, torchrun gives its workers this long to finish their step and
# write a checkpoint (torch 2.12 and later; 2.11 gives 30 s); under nohup hang-ups stay ignored
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-300}"
[ -z "$(trap -p HUP)" ] || export PET_SIGNALS_TO_HANDLE="SIGTERM,SIGINT,SIGQUIT"
exec python -m torch.distributed.run --standalone --nproc_per_node="$nproc" "$script" "$@"
