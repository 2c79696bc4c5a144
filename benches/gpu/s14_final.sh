#!/usr/bin/env bash
# Session 14's closing measurement (.gpu/ staged: bin/genpool, bin/libgenpool_torch.so, bin/threads-new,
# tests/cuda — this session's build — and bin/genpool-s13, bin/threads-s13 — its start, 64bcaef): the
# CUDA tests, PyTorch's entry points side by side, the engine's replay (start vs now, interleaved) and
# the short-lived path at 1 and 16 threads. Logs under $OUT; tables last.
set -uo pipefail
STEPS_DEFAULT=tests,torch,replay,threads
. "$(dirname "$0")/env.sh"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; python3 -c 'import torch; print("torch", torch.__version__)'; nproc; } > "$OUT/machine.txt" 2>&1
if has tests; then
  timeout 200 "$G"/tests/cuda --include-ignored --test-threads 1 > "$OUT/cuda_tests.log" 2>&1
  echo "cuda tests rc=$?" >> "$OUT/cuda_tests.log"
fi
if has torch; then
  tr=(benches/traces/bert_serve_4streams.csv.gz benches/traces/gpt2_generate_kv.csv.gz benches/traces/resnet50_train.csv.gz benches/traces/gpt2_train_fixed.csv.gz)
  timeout 200 python3 benches/gpu/torch_replay.py "${tr[@]}" --modes native,expandable,genpool --reps ${REPS:-6} > "$OUT/torch.jsonl" 2> "$OUT/torch.err"
fi
T="benches/traces/resnet50_train.csv.gz benches/traces/gpt2_generate_kv.csv.gz benches/traces/gpt2_train_fixed.csv.gz benches/traces/gpt2_prefetch.csv.gz benches/traces/bert_serve_4streams.csv.gz"
if has replay; then
  for r in 1 2; do for b in genpool-s13 genpool; do
    timeout 100 "$G"/bin/$b replay $T --device cuda --passes 5 --json 2>>"$OUT/replay.err" | python3 -c "
import json,sys
for l in sys.stdin:
  d=json.loads(l); w=d['warm_calls']; print('$r', '$b'.ljust(11), d['trace'][:20].ljust(20), round(d['ratio'],4), round(d['ns_per_op']), [round(x) for x in d['ns_per_op_passes']], 'maps', w.get('maps'), 'syncs', w.get('device_syncs'), 'waits', w.get('waits'))"
  done; done | sort -k3,3 -k2,2 -k1,1 > "$OUT/replay_ab.txt"
fi
if has threads; then
  for r in 1 2; do for b in s13 new; do
    echo "round $r $b $(GENPOOL_HANDOFF=0 timeout 30 "$G"/bin/threads-$b 2000000 1 16 2>&1 | tr '\n' ' ')" >> "$OUT/threads.txt"
  done; done
fi
cat "$OUT/machine.txt"; grep -E "^test result|FAILED|failed|rc=" "$OUT/cuda_tests.log"
cat "$OUT/threads.txt" "$OUT/replay_ab.txt" 2>/dev/null
python3 - <<'PY'
import json, os
O = os.environ["OUT"]
try:
    for l in open(f"{O}/torch.jsonl"):
        d = json.loads(l)
        print("torch", d["trace"][:20].ljust(20), d["mode"].ljust(10), d.get("ratio"), d.get("ns_per_op"), d.get("ns_per_op_first_pass"))
except FileNotFoundError:
    pass
PY
