#!/usr/bin/env bash
# One process per visible GPU (8 on the target node); extra arguments go to train_gpt.py.
#   ./run.sh                         the record configuration
#   ./run.sh --num_iterations 200    any option of `python train_gpt.py --help`
set -euo pipefail
cd "$(dirname "$0")"
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -eq 0 ]; then
    echo "run.sh: no CUDA GPU visible. For a CPU smoke run (under a minute), see README.md:" >&2
    echo "  python train_gpt.py --preset smoke" >&2
    exit 1
fi
exec torchrun --standalone --nproc_per_node="$gpus" train_gpt.py "$@"
