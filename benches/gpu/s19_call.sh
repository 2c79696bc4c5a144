#!/usr/bin/env bash
# Sessions 19 and 20 on the GPU machine (.gpu/ staged by gpu-pack, then benches/gpu/pack_cuda_tests.sh, plus the
# "before" builds below). Steps (STEPS, comma-separated; default tests,threads,torch):
#   tests   every CUDA test binary of the workspace;
#   threads the engine's lock contention on the host's 16 cores, before / after the warm path's lock
#           (gen-sync): examples `threads` with 512 KiB – 4 MiB blocks (GENPOOL_THREADS_SCALE=1024: the
#           extent arena's and page pool's locks) and `torch_threads_sim`, bin/NAME-base and bin/NAME
#           taking turns, two rounds;
#   torch   PyTorch's entry points (torch_replay.py) on TORCH_TRACES: expandable, then genpool before
#           (.gpu/py_old: the package at the session's start, bin/libgenpool_torch_old.so) and after,
#           taking turns, TORCH_ROUNDS rounds (default 1);
#   tthreads torch_threads.py, native and genpool, 1 and 16 threads;
#   compat  the compatibility suite under COMPAT_MODES (default native,expandable,genpool);
#   cli     the engine's own CUDA replay of the ten traces (PASSES, default 5).
# Logs under $OUT; tables last.
set -uo pipefail
STEPS_DEFAULT=tests,threads,torch
. "$(dirname "$0")/env.sh"
begin_call
if has threads; then
  for r in 1 2; do for b in threads-base threads; do
    [ -x "$G/bin/$b" ] || continue
    echo "$b round $r" >> "$OUT/threads.txt"
    GENPOOL_THREADS_SCALE=1024 timeout 60 "$G"/bin/$b 100000 1 4 16 >> "$OUT/threads.txt" 2>&1
  done; for b in torch_threads_sim-base torch_threads_sim; do
    [ -x "$G/bin/$b" ] || continue
    echo "$b round $r" >> "$OUT/threads.txt"
    timeout 60 "$G"/bin/$b 200000 1 16 >> "$OUT/threads.txt" 2>&1
  done; done
fi
if has torch; then
  tr=(); for t in ${TORCH_TRACES:-resnet50_train gpt2_generate_kv gpt2_train_fixed gpt2_prefetch}; do tr+=(benches/traces/$t.csv.gz); done
  timeout 150 python3 benches/gpu/torch_replay.py "${tr[@]}" --modes "${TORCH_ANCHORS:-expandable}" --reps "${REPS:-4}" > "$OUT/torch.jsonl" 2>> "$OUT/torch.err"
  for r in $(seq "${TORCH_ROUNDS:-1}"); do
    [ -d "$G/py_old" ] && PYTHONPATH="$PWD/$G/py_old" GENPOOL_LIB="$PWD/$G/bin/libgenpool_torch_old.so" GENPOOL_SHIM_DIR=/tmp/genpool_cache_old \
      timeout 150 python3 benches/gpu/torch_replay.py "${tr[@]}" --modes genpool --reps "${REPS:-4}" 2>> "$OUT/torch.err" |
      tag_runs before "$r" >> "$OUT/torch.jsonl"
    timeout 150 python3 benches/gpu/torch_replay.py "${tr[@]}" --modes genpool --reps "${REPS:-4}" 2>> "$OUT/torch.err" |
      tag_runs after "$r" >> "$OUT/torch.jsonl"
  done
fi
if has tthreads; then
  timeout 200 python3 benches/gpu/torch_threads.py --modes native,genpool --threads 1,16 --pairs 100000 > "$OUT/tthreads.jsonl" 2>> "$OUT/tthreads.err"
fi
has compat && compat_suite native,expandable,genpool
has cli && engine_replay_all
begin_tables
cat "$OUT/threads.txt" 2>/dev/null
cut -c1-260 "$OUT/tthreads.jsonl" 2>/dev/null
tail -3 "$OUT/torch.err" 2>/dev/null
cut -c1-330 "$OUT/torch.jsonl" 2>/dev/null
