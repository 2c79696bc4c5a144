#!/usr/bin/env bash
# Session 16: per-thread magazines of slab blocks (crates/genpool/src/mag.rs), without and with, on the
# GPU machine's 16 cores (.gpu/bin/threads-base, genpool-nomag, libgenpool_torch-nomag.so: without, at
# ce2708e; threads-new, genpool, libgenpool_torch.so: with, this build). Call 3 ran an earlier naming
# (docs/results/s16/mag/README.md). Steps (STEPS; all by default):
#   threads  the short-lived path (threads example, one engine, own frees) at 1..16 threads, the two
#            builds taking turns, ROUNDS rounds (default 3); then every 4th block freed by the next thread;
#   cli      the engine's CUDA replay of the traces with the most slab calls, taking turns, 4 rounds of 3
#            passes (the last pass counts);
#   tthreads PyTorch's threads (torch_threads.py, genpool mode) with each plug-in, 1 and 16 threads,
#            TROUNDS rounds (default 2), then native once.
# Logs under $OUT; tables last.
set -uo pipefail
STEPS_DEFAULT=threads,cli,tthreads
. "$(dirname "$0")/env.sh"
{ nvidia-smi --query-gpu=name --format=csv,noheader; nproc; } > "$OUT/machine.txt" 2>&1
if has threads; then
  for r in $(seq ${ROUNDS:-3}); do for b in base mag; do
    t=threads-base; [ $b = mag ] && t=threads-new
    echo "round $r $b own" >> "$OUT/threads.txt"
    GENPOOL_THREADS_MODE=pool GENPOOL_HANDOFF=0 timeout 60 "$G"/bin/$t ${OPS:-2000000} 1 2 4 8 16 >> "$OUT/threads.txt" 2>&1
  done; done
  for b in base mag; do
    t=threads-base; [ $b = mag ] && t=threads-new
    echo "round 1 $b handoff4" >> "$OUT/threads.txt"
    GENPOOL_THREADS_MODE=pool GENPOOL_HANDOFF=4 timeout 60 "$G"/bin/$t ${OPS:-2000000} 1 16 >> "$OUT/threads.txt" 2>&1
  done
fi
if has cli; then
  replay_turns 4 "gpt2_generate_kv resnet50_train" base=genpool-nomag mag=genpool
fi
if has tthreads; then
  for r in $(seq ${TROUNDS:-2}); do for v in base mag; do
    lib="$PWD/$G/bin/libgenpool_torch-nomag.so"; [ $v = mag ] && lib="$PWD/$G/bin/libgenpool_torch.so"
    GENPOOL_LIB="$lib" timeout 120 python3 benches/gpu/torch_threads.py --modes genpool --threads 1,16 2>> "$OUT/tthreads.err" |
      tag_runs "$v" "$r" >> "$OUT/tthreads.jsonl"
  done; done
  timeout 120 python3 benches/gpu/torch_threads.py --modes native --threads 1,16 2>> "$OUT/tthreads.err" |
    sed "s/^{/{\"v\":\"native\",/" >> "$OUT/tthreads.jsonl"
fi
cat "$OUT/machine.txt"
grep -E "round|threads  1:|threads 16:" "$OUT/threads.txt" 2>/dev/null
python3 benches/gpu/ab_table.py "$OUT" --cli-last-pass
cat "$OUT/tthreads.jsonl" 2>/dev/null
tail -3 "$OUT/cli.err" "$OUT/tthreads.err" 2>/dev/null
