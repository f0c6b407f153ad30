#!/bin/bash
# The first of the two device calls of 2026-11-28 (one H200), run from the repository root as
# `bash .gpu/plan.sh`, with OUT an empty folder for results. .gpu/ held: the two enwiki shards of
# ../shared/data/enwiki, gpt2.tiktoken, hellaswag_standin.jsonl (made by hellaswag_standin.py), the trainer
# of commit 695aa87 as t695.py, attn_bench.py (attn_mask.py here), ../shared/gpu/gpu_unit_checks.py
# and COMMIT (the commit measured). Each result lands in $OUT as soon as it exists.
set -u
export PYTHONUNBUFFERED=1
D=.gpu W=/tmp/w
mkdir -p $W
S=$OUT/summary.txt
log() { echo "== $(date +%T) $*" | tee -a $S; }
pack() { tar czf $OUT/logs.tgz -C $W . 2>/dev/null; }
log "commit $(cat $D/COMMIT)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >> $S
python3 -c "import torch, triton, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, 'triton', triton.__version__)" >> $S
nproc >> $S

log "1 attention"
timeout 170 python3 $D/attn_bench.py $D/enwiki_train_000001.bin $D/t695.py > $W/attn.txt 2>&1
log "attention rc=$?"; grep -E "window|documents|^2\." $W/attn.txt >> $S; pack

COMMON="--train_files $D/enwiki_train_000001.bin --val_files $D/enwiki_val_000000.bin --val_tokens 1048576 --allow_data_repeat true --num_iterations 12 --val_loss_every 0 --seed 0"
log "2+3 HEAD, 12 steps, --hellaswag"
t0=$(date +%s)
TORCH_LOGS=recompiles,graph_breaks timeout 330 torchrun --standalone --nproc_per_node=1 train_gpt.py $COMMON \
  --hellaswag true --hellaswag_data $D/hellaswag_standin.jsonl --tokenizer $D/gpt2.tiktoken --log_dir $W/head > $W/head.out 2>&1
log "HEAD rc=$? wall $(( $(date +%s) - t0 )) s"
grep -cE "Recompiling|recompil" $W/head.out | sed 's/^/recompile lines: /' >> $S
grep -ciE "graph break" $W/head.out | sed 's/^/graph-break lines: /' >> $S
tail -n 12 $W/head.out >> $S; pack

log "3 695aa87, 12 steps"
t0=$(date +%s)
timeout 260 torchrun --standalone --nproc_per_node=1 $D/t695.py $COMMON --log_dir $W/old > $W/old.out 2>&1
log "695aa87 rc=$? wall $(( $(date +%s) - t0 )) s"
tail -n 8 $W/old.out >> $S; pack

log "4 sampling speed"
timeout 90 python3 records/sampling_speed.py --device cuda > $W/sampling.txt 2>&1
log "sampling rc=$?"; cat $W/sampling.txt >> $S; pack
log "4 gpu_unit_checks"
timeout 120 torchrun --standalone --nproc_per_node=1 $D/gpu_unit_checks.py > $W/unit.txt 2>&1
log "unit rc=$?"; grep -E "PASS|FAIL|Error" $W/unit.txt >> $S; pack
log done
