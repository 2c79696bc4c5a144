#!/usr/bin/env bash
# One GPU call for the PyTorch backend (run from the repository root on the GPU machine, with .gpu/ staged:
# .gpu/bin/libgenpool_torch.so and the bundled traces and benches/gpu anchors). Builds the C++ backend against the
# machine's torch, runs the compatibility suite under native / expandable_segments / genpool, and the
# anchors' replay and thread benchmarks through PyTorch's entry points with genpool's backend and with the
# pluggable fallback, conv-net training with cudnn.benchmark under three allocators, and compute-sanitizer
# memcheck over probes under genpool. Logs under $OUT; the tables last. STEPS picks steps (default: all;
# session 8's second call was STEPS=compat,threads,train,memcheck).
set -uo pipefail
STEPS_DEFAULT=build,compat,replay,threads,train,memcheck
. "$(dirname "$0")/env.sh"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; python3 -c 'import torch; print("torch", torch.__version__)'; c++ --version | head -1; } > "$OUT/machine.txt" 2>&1
if has build; then
  /usr/bin/time -f "backend build %e s" python3 -c '
import genpool_torch, genpool_torch.backend as b
print(b.build(genpool_torch.library_path()))' > "$OUT/build.log" 2>&1
  cat "$OUT/build.log" | tail -5
fi
if has compat; then
  timeout "${T_COMPAT:-420}" python3 benches/gpu/compat.py --jobs "${JOBS:-6}" --json "$OUT/compat.jsonl" --md "$OUT/compat.md" --keep /tmp > "$OUT/compat.log" 2>&1
  cp /tmp/snapshot_genpool.pickle "$OUT/" 2>/dev/null
fi
traces=(benches/traces/gpt2_generate_kv.csv.gz benches/traces/gpt2m_train_varlen.csv.gz benches/traces/gpt2_train_fixed.csv.gz benches/traces/resnet50_train.csv.gz)
if has replay; then
  timeout 300 python3 benches/gpu/torch_replay.py "${traces[@]}" --modes native,expandable,genpool --reps 4 > "$OUT/replay.jsonl" 2> "$OUT/replay.err"
  GENPOOL_TORCH_BACKEND=pluggable timeout 200 python3 benches/gpu/torch_replay.py "${traces[@]}" --modes genpool --reps 4 > "$OUT/replay_pluggable.jsonl" 2>> "$OUT/replay.err"
fi
if has threads; then
  timeout 200 python3 benches/gpu/torch_threads.py --modes native,expandable,genpool > "$OUT/threads.jsonl" 2> "$OUT/threads.err"
  GENPOOL_TORCH_BACKEND=pluggable timeout 120 python3 benches/gpu/torch_threads.py --modes genpool > "$OUT/threads_pluggable.jsonl" 2>> "$OUT/threads.err"
fi
if has train; then
  for m in native expandable genpool; do
    timeout 45 python3 benches/gpu/train_conv.py $m --steps 30 >> "$OUT/train.jsonl" 2>> "$OUT/train.err"
  done
fi
if has memcheck; then
  timeout 130 compute-sanitizer --tool memcheck --error-exitcode 9 python3 benches/gpu/compat.py \
    --probe memory_stats,record_stream,empty_cache,memory_history_snapshot,cudnn_benchmark,cuda_graph_capture,mempool,out_of_memory \
    --mode genpool > "$OUT/memcheck.log" 2>&1; echo "memcheck exit $?" >> "$OUT/memcheck.log"
  grep -E "ERROR SUMMARY|memcheck exit" "$OUT/memcheck.log"
fi
cat "$OUT/machine.txt"
tail -3 "$OUT"/*.err 2>/dev/null | tail -20
cat "$OUT/replay.jsonl" "$OUT/replay_pluggable.jsonl" "$OUT/threads.jsonl" "$OUT/threads_pluggable.jsonl" "$OUT/train.jsonl" 2>/dev/null
cat "$OUT/compat.log" 2>/dev/null | tail -40
