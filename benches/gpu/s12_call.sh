#!/usr/bin/env bash
# Session 12 on the GPU machine (run from the repository root with .gpu/ staged: bin/genpool — this
# session's build — and bin/genpool-base — session 11's start, 1f25bfd — bin/threads-{base,new}
# (crates/genpool/examples/threads.rs), bin/libgenpool_torch.so, tests/cuda (genpool's)). STEPS picks
# steps (default replay,tests,threads: one call of ~7 minutes; then STEPS=compat,torch and
# STEPS=tthreads,sanitize). The replay compares, interleaved, the base, this build with
# `experimental.stream_arenas:own` (an arena per later stream, the default until this session) and this
# build's default (the later streams share one arena, ordered lazily). Logs under $OUT; tables last.
set -uo pipefail
STEPS_DEFAULT=replay,tests,threads
. "$(dirname "$0")/env.sh"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; python3 -c 'import torch; print("torch", torch.__version__)'; nproc; } > "$OUT/machine.txt" 2>&1
T=${TRACES:-"benches/traces/bert_serve_4streams.csv.gz benches/traces/resnet_copy_overlap.csv.gz benches/traces/gpt2_prefetch.csv.gz benches/traces/resnet50_train.csv.gz benches/traces/gpt2_train_fixed.csv.gz benches/traces/gpt2_generate_kv.csv.gz"}
if has replay; then
  for r in $(seq ${RROUNDS:-2}); do for v in base own new; do
    case $v in base) b=genpool-base; c="";; own) b=genpool; c=experimental.stream_arenas:own;; new) b=genpool; c="";; esac
    GENPOOL_CONF=$c timeout 120 "$G"/bin/$b replay $T --device cuda --passes ${PASSES:-5} --json 2>>"$OUT/replay.err" | python3 -c "
import json,sys
for l in sys.stdin:
  d=json.loads(l); w=d['warm_calls']; print('$r', '$v'.ljust(5), d['trace'][:20].ljust(20), round(d['ratio'],4), round(d['ns_per_op']), [round(x) for x in d['ns_per_op_passes']], 'maps', w.get('maps'), 'syncs', w.get('device_syncs'), 'waits', w.get('waits'), 'rec', w.get('event_records'), 'swait', w.get('stream_waits'))"
  done; done | sort -k3,3 -k2,2 -k1,1 > "$OUT/replay_ab.txt"
fi
if has tests; then
  timeout ${TEST_TIMEOUT:-240} "$G"/tests/cuda --include-ignored --test-threads 1 > "$OUT/cuda_tests.log" 2>&1
  echo "cuda tests rc=$?" >> "$OUT/cuda_tests.log"
fi
if has threads; then
  for r in $(seq ${ROUNDS:-1}); do for h in 4 0; do for b in base new; do
    echo "round $r, $b, handoff $h" >> "$OUT/threads.txt"
    GENPOOL_HANDOFF=$h timeout 100 "$G"/bin/threads-$b ${OPS:-2000000} 1 2 4 8 16 >> "$OUT/threads.txt" 2>&1
  done; done; done
  echo "new, handoff 0, a pool per thread" >> "$OUT/threads.txt"
  GENPOOL_HANDOFF=0 GENPOOL_POOL_PER_THREAD=1 timeout 100 "$G"/bin/threads-new ${OPS:-2000000} 1 2 4 8 16 >> "$OUT/threads.txt" 2>&1
fi
if has torch; then
  tr=(benches/traces/bert_serve_4streams.csv.gz benches/traces/gpt2_generate_kv.csv.gz benches/traces/resnet50_train.csv.gz benches/traces/gpt2_train_fixed.csv.gz)
  timeout 260 python3 benches/gpu/torch_replay.py "${tr[@]}" --modes native,expandable,genpool --reps ${REPS:-4} > "$OUT/torch.jsonl" 2> "$OUT/torch.err"
fi
if has tthreads; then
  timeout 150 python3 benches/gpu/torch_threads.py --modes native,genpool > "$OUT/tthreads.jsonl" 2> "$OUT/tthreads.err"
  GENPOOL_CONF=thread_caches:0 timeout 100 python3 benches/gpu/torch_threads.py --modes genpool > "$OUT/tthreads_nocache.jsonl" 2>> "$OUT/tthreads.err"
fi
if has compat; then
  timeout 330 python3 benches/gpu/compat.py --jobs 6 --json "$OUT/compat.jsonl" --md "$OUT/compat.md" > "$OUT/compat.log" 2>&1
fi
if has sanitize; then
  OUT="$OUT/sanitize" STEPS=build,rust,probes bash benches/gpu/s10_sanitize.sh > "$OUT/sanitize.txt" 2>&1
fi
cat "$OUT/machine.txt"
grep -E "test result|rc=|FAILED|panicked" "$OUT/cuda_tests.log" 2>/dev/null
cat "$OUT/sanitize.txt" 2>/dev/null
cat "$OUT/threads.txt" 2>/dev/null
cat "$OUT/torch.jsonl" "$OUT/tthreads.jsonl" "$OUT/tthreads_nocache.jsonl" 2>/dev/null | cut -c1-300
tail -5 "$OUT/compat.log" 2>/dev/null
cat "$OUT/replay_ab.txt" 2>/dev/null
