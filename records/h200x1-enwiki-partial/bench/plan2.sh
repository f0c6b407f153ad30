#!/bin/bash
# The second device call of 2026-11-28 (another H200), laid out as plan.sh. Only step A ran: its
# pack() then tarred and gzipped A's two 2 GB checkpoints, which took the rest of the call's
# time, so B (SIGTERM and resume from the compile cache), C (chunked head) and D (regional
# compile) never started. pack() now leaves out checkpoints, caches and the cache file.
set -u
export PYTHONUNBUFFERED=1
D=.gpu W=/tmp/w
mkdir -p $W
S=$OUT/summary.txt
log() { echo "== $(date +%T) $*" | tee -a $S; }
pack() { tar czf $OUT/logs.tgz -C $W --exclude='*.pt' --exclude=cc.bin --exclude='ic?' --exclude='tc?' . 2>/dev/null; }
command -v python >/dev/null || ln -s "$(command -v python3)" /usr/local/bin/python
log "commit $(cat $D/COMMIT)"; nvidia-smi --query-gpu=name --format=csv,noheader >> $S
COMMON="--train_files $D/enwiki_train_000001.bin --val_files $D/enwiki_val_000000.bin --val_tokens 1048576 --allow_data_repeat true --num_iterations 12 --val_loss_every 0 --seed 0"
lines() { grep -hE "^step:[0-9]+/|^startup|^peak|^stopped|^resum|compile cache" $1/*/*.txt $1/*.txt 2>/dev/null; }

log "A: ./run.sh, 12 steps, --checkpoint_every 6 --compile_cache, empty caches"
t0=$(date +%s)
TORCHINDUCTOR_CACHE_DIR=$W/ic1 TRITON_CACHE_DIR=$W/tc1 timeout 150 ./run.sh $COMMON --checkpoint_every 6 \
  --compile_cache $W/cc.bin --log_dir $W/A > $W/A.out 2>&1
log "A rc=$? wall $(( $(date +%s) - t0 )) s"; lines $W/A >> $S; ls -la $W/cc.bin $W/A/*/ >> $S 2>&1; pack

ck=$(ls $W/A/*/*step000006*.pt 2>/dev/null | head -1)
log "B: ./run.sh --resume $ck with the compile cache file, empty local caches; SIGTERM after step 9"
t0=$(date +%s)
TORCHINDUCTOR_CACHE_DIR=$W/ic2 TRITON_CACHE_DIR=$W/tc2 ./run.sh --resume "$ck" --compile_cache $W/cc.bin \
  --log_dir $W/B > $W/B.out 2>&1 &
pid=$!
for i in $(seq 1 240); do
  sleep 0.5
  grep -qs "^step:9/12" $W/B/*.txt && break
  kill -0 $pid 2>/dev/null || break
done
kill -TERM $pid; log "SIGTERM sent at $(( $(date +%s) - t0 )) s"
wait $pid; log "B rc=$? wall $(( $(date +%s) - t0 )) s"; lines $W/B >> $S; tail -n 3 $W/B.out >> $S; pack

log "C: --head_chunk_rows 8192 (local caches of A)"
TORCHINDUCTOR_CACHE_DIR=$W/ic1 TRITON_CACHE_DIR=$W/tc1 timeout 120 torchrun --standalone --nproc_per_node=1 train_gpt.py \
  $COMMON --head_chunk_rows 8192 --log_dir $W/C > $W/C.out 2>&1
log "C rc=$?"; lines $W/C >> $S; pack

log "D: --regional_compile true, empty caches, TORCH_LOGS=recompiles"
t0=$(date +%s)
TORCH_LOGS=recompiles TORCHINDUCTOR_CACHE_DIR=$W/ic3 TRITON_CACHE_DIR=$W/tc3 timeout 150 torchrun --standalone \
  --nproc_per_node=1 train_gpt.py $COMMON --regional_compile true --log_dir $W/D > $W/D.out 2>&1
log "D rc=$? wall $(( $(date +%s) - t0 )) s"; lines $W/D >> $S
grep -c "Recompiling function" $W/D.out | sed 's/^/recompiles: /' >> $S; grep -E "Recompiling function|cache_size_limit|recompile_limit" $W/D.out | head >> $S; pack
log done
