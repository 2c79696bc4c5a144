#!/usr/bin/env bash
# Session 11 on the GPU machine (run from the repository root with .gpu/ staged: bin/genpool and
# bin/genpool-base — the session's start, for a same-run comparison — bin/threads-{base,new}
# (crates/genpool/examples/threads.rs), bin/libgenpool_torch.so, tests/cuda). STEPS picks steps (default
# threads,tests,replay,sanitize: one call of ~8 minutes; then STEPS=torch,tthreads,compat in a second —
# PyTorch's entry points with genpool's per-thread statistics and large-block caches, and the
# compatibility suite after them). Logs under $OUT; the tables last.
set -uo pipefail
STEPS_DEFAULT=threads,tests,replay,sanitize
. "$(dirname "$0")/env.sh"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; python3 -c 'import torch; print("torch", torch.__version__)'; nproc; } > "$OUT/machine.txt" 2>&1
if has threads; then
  # Interleaved, twice: base then new, each with every 4th block freed by the next thread (the
  # benchmark's default) and with each thread freeing its own; then a pool per thread (the bound).
  for r in 1 2; do for h in 4 0; do for b in base new; do
    echo "round $r, $b, handoff $h" >> "$OUT/threads.txt"
    GENPOOL_HANDOFF=$h timeout 120 "$G"/bin/threads-$b ${OPS:-2000000} 1 2 4 8 16 >> "$OUT/threads.txt" 2>&1
  done; done; done
  echo "new, handoff 0, a pool per thread" >> "$OUT/threads.txt"
  GENPOOL_HANDOFF=0 GENPOOL_POOL_PER_THREAD=1 timeout 120 "$G"/bin/threads-new ${OPS:-2000000} 1 2 4 8 16 >> "$OUT/threads.txt" 2>&1
fi
if has tests; then
  timeout 300 "$G"/tests/cuda --include-ignored --test-threads 1 > "$OUT/cuda_tests.log" 2>&1
  echo "cuda tests rc=$?" >> "$OUT/cuda_tests.log"
fi
T="benches/traces/resnet50_train.csv.gz benches/traces/gpt2_train_fixed.csv.gz benches/traces/vit_train_varres.csv.gz benches/traces/gpt2_generate_kv.csv.gz benches/traces/bert_serve_4streams.csv.gz"
if has replay; then
  for r in 1 2; do for b in genpool-base genpool; do
    timeout 150 "$G"/bin/$b replay $T --device cuda --passes ${PASSES:-5} --json 2>/dev/null | python3 -c "
import json,sys
for l in sys.stdin:
  d=json.loads(l); print('$r', '$b'.ljust(13), d['trace'][:20].ljust(20), round(d['ratio'],4), round(d['ns_per_op']), [round(x) for x in d['ns_per_op_passes']], d['warm_calls'].get('maps'), d['warm_calls'].get('device_syncs'))"
  done; done | sort -k3,3 -k2,2 -k1,1 > "$OUT/replay_ab.txt"
fi
if has sanitize; then
  OUT="$OUT/sanitize" STEPS=build,rust,probes bash benches/gpu/s10_sanitize.sh > "$OUT/sanitize.txt" 2>&1
fi
if has torch; then
  tr=(benches/traces/gpt2_generate_kv.csv.gz benches/traces/resnet50_train.csv.gz benches/traces/gpt2_train_fixed.csv.gz benches/traces/bert_serve_4streams.csv.gz)
  timeout 240 python3 benches/gpu/torch_replay.py "${tr[@]}" --modes native,expandable,genpool --reps 5 > "$OUT/torch.jsonl" 2> "$OUT/torch.err"
fi
if has tthreads; then
  # genpool twice: the default (per-thread caches of large blocks from three allocating threads on)
  # and without them.
  timeout 150 python3 benches/gpu/torch_threads.py --modes native,genpool > "$OUT/tthreads.jsonl" 2> "$OUT/tthreads.err"
  GENPOOL_CONF=thread_caches:0 timeout 100 python3 benches/gpu/torch_threads.py --modes genpool > "$OUT/tthreads_nocache.jsonl" 2>> "$OUT/tthreads.err"
fi
if has compat; then
  timeout 330 python3 benches/gpu/compat.py --jobs 6 --json "$OUT/compat.jsonl" --md "$OUT/compat.md" > "$OUT/compat.log" 2>&1
fi
cat "$OUT/machine.txt"
grep -E "test result|rc=|FAILED|panicked" "$OUT/cuda_tests.log" 2>/dev/null
cat "$OUT/sanitize.txt" 2>/dev/null
cat "$OUT/replay_ab.txt" 2>/dev/null
cat "$OUT/threads.txt" 2>/dev/null
cat "$OUT/torch.jsonl" "$OUT/tthreads.jsonl" "$OUT/tthreads_nocache.jsonl" 2>/dev/null | cut -c1-260
tail -5 "$OUT/compat.log" 2>/dev/null
