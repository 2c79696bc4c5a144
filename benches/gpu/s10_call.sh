#!/usr/bin/env bash
# Session 10 on the GPU machine (run from the repository root with .gpu/ staged: bin/genpool and
# bin/genpool-base — the session's start, for a same-run comparison — bin/libgenpool_torch.so,
# bin/threads-{base,new} (crates/genpool/examples/threads.rs), tests/cuda). STEPS picks steps (default
# tests,threads,replay,torch,tthreads). Logs and JSON under $OUT; the tables last.
set -uo pipefail
STEPS_DEFAULT=tests,threads,replay,torch,tthreads
. "$(dirname "$0")/env.sh"
PASSES=${PASSES:-5}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; python3 -c 'import torch; print("torch", torch.__version__)'; nproc; } > "$OUT/machine.txt" 2>&1
if has tests; then
  timeout 240 "$G"/tests/cuda --include-ignored --test-threads 1 foreign_free cross_stream > "$OUT/cuda_tests.log" 2>&1
  echo "cuda tests rc=$?" >> "$OUT/cuda_tests.log"
fi
if has threads; then
  for b in base new; do
    timeout 120 "$G"/bin/threads-$b ${OPS:-2000000} 1 2 4 8 16 > "$OUT/threads_$b.txt" 2>&1
  done
fi
all=(benches/traces/*.csv.gz)
if has replay; then
  for b in genpool-base genpool; do
    timeout "${T_REPLAY:-200}" "$G"/bin/$b replay "${all[@]}" --device cuda --passes "$PASSES" --json > "$OUT/replay_$b.jsonl" 2> "$OUT/replay_$b.err"
  done
fi
if has torch; then
  tr=(${TORCH_TRACES:-benches/traces/gpt2_generate_kv.csv.gz benches/traces/resnet50_train.csv.gz benches/traces/gpt2_train_fixed.csv.gz benches/traces/bert_serve_4streams.csv.gz})
  timeout "${T_TORCH:-240}" python3 benches/gpu/torch_replay.py "${tr[@]}" --modes native,expandable,genpool --reps 3 > "$OUT/torch.jsonl" 2> "$OUT/torch.err"
fi
if has tthreads; then
  timeout 150 python3 benches/gpu/torch_threads.py --modes native,genpool > "$OUT/tthreads.jsonl" 2> "$OUT/tthreads.err"
fi
cat "$OUT/machine.txt"
grep -E "^test |test result|rc=|A got|B got" "$OUT/cuda_tests.log" 2>/dev/null
for f in "$OUT"/threads_*.txt; do [ -f "$f" ] && { echo "== $f"; cat "$f"; }; done
tail -3 "$OUT"/*.err 2>/dev/null | tail -12
python3 benches/gpu/replay_table.py "$OUT/replay_genpool-base.jsonl:base" "$OUT/replay_genpool.jsonl:new" "$OUT/torch.jsonl"
cat "$OUT/tthreads.jsonl" 2>/dev/null | cut -c1-300
