#!/usr/bin/env bash
# Session 14 on the GPU machine (.gpu/ staged: bin/genpool, bin/libgenpool_torch.so, bin/threads-new —
# this session's build — and bin/genpool-s13, bin/threads-s13 — the session's start, 64bcaef). In order of
# what matters if the call is cut: the short-lived path's thread scaling by source (GENPOOL_THREADS_MODE:
# the engine, the slab alone, no allocator, an engine per thread), the engine's replay (start vs now,
# interleaved), PyTorch's entry points (torch_replay.py, with per-pass page counters from torch_diag.py)
# and PyTorch's thread bench. Logs under $OUT; tables last.
set -uo pipefail
STEPS_DEFAULT=threads,replay,torch,tthreads
. "$(dirname "$0")/env.sh"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; python3 -c 'import torch; print("torch", torch.__version__)'; nproc; lscpu | grep -E "Model name|Thread|Core|Socket"; } > "$OUT/machine.txt" 2>&1
if has threads; then
  for r in 1 2; do
    for v in s13:pool new:pool new:slab new:none; do
      b=${v%%:*}; m=${v#*:}
      echo "round $r, $b, mode $m, handoff 0" >> "$OUT/threads.txt"
      GENPOOL_THREADS_MODE=$m GENPOOL_HANDOFF=0 timeout 60 "$G"/bin/threads-$b ${OPS:-2000000} 1 2 4 8 16 >> "$OUT/threads.txt" 2>&1
    done
    for b in s13 new; do
      echo "round $r, $b, mode pool, handoff 4" >> "$OUT/threads.txt"
      GENPOOL_HANDOFF=4 timeout 60 "$G"/bin/threads-$b ${OPS:-2000000} 1 2 4 8 16 >> "$OUT/threads.txt" 2>&1
    done
  done
  for m in pool-per-thread slab-per-thread; do
    echo "new, mode $m, handoff 0" >> "$OUT/threads.txt"
    GENPOOL_THREADS_MODE=$m GENPOOL_HANDOFF=0 timeout 60 "$G"/bin/threads-new ${OPS:-2000000} 1 2 4 8 16 >> "$OUT/threads.txt" 2>&1
  done
fi
T=${TRACES:-"benches/traces/resnet50_train.csv.gz benches/traces/gpt2_generate_kv.csv.gz benches/traces/gpt2_train_fixed.csv.gz benches/traces/gpt2_prefetch.csv.gz benches/traces/bert_serve_4streams.csv.gz"}
if has replay; then
  for r in 1 2; do for b in genpool-s13 genpool; do
    timeout 120 "$G"/bin/$b replay $T --device cuda --passes ${PASSES:-5} --json 2>>"$OUT/replay.err" | python3 -c "
import json,sys
for l in sys.stdin:
  d=json.loads(l); w=d['warm_calls']; print('$r', '$b'.ljust(11), d['trace'][:20].ljust(20), round(d['ratio'],4), round(d['ns_per_op']), [round(x) for x in d['ns_per_op_passes']], 'maps', w.get('maps'), 'syncs', w.get('device_syncs'), 'waits', w.get('waits'))"
  done; done | sort -k3,3 -k2,2 -k1,1 > "$OUT/replay_ab.txt"
fi
if has torch; then
  tr=(benches/traces/bert_serve_4streams.csv.gz benches/traces/gpt2_generate_kv.csv.gz benches/traces/resnet50_train.csv.gz benches/traces/gpt2_train_fixed.csv.gz)
  timeout 200 python3 benches/gpu/torch_replay.py "${tr[@]}" --modes native,expandable,genpool --reps ${REPS:-6} > "$OUT/torch.jsonl" 2> "$OUT/torch.err"
  timeout 100 python3 benches/gpu/torch_diag.py "${tr[@]:1}" --reps 5 > "$OUT/diag.jsonl" 2> "$OUT/diag.err"
fi
if has tthreads; then
  timeout 150 python3 benches/gpu/torch_threads.py --modes native,genpool > "$OUT/tthreads.jsonl" 2> "$OUT/tthreads.err"
fi
cat "$OUT/machine.txt"
grep -E "round|mode|threads  1:|threads  8:|threads 16:" "$OUT/threads.txt" 2>/dev/null
cat "$OUT/replay_ab.txt" 2>/dev/null
python3 - <<'PY'
import json, os
O = os.environ["OUT"]
def rows(f):
    try:
        return [json.loads(l) for l in open(f"{O}/{f}") if l.strip()]
    except FileNotFoundError:
        return []
for d in rows("torch.jsonl"):
    print("torch", d["trace"][:20].ljust(20), d["mode"].ljust(10), d.get("ratio"), d.get("ns_per_op"), d.get("ns_per_op_first_pass"))
for d in rows("diag.jsonl"):
    if "error" in d: print("diag error", d["trace"], d["error"][-300:]); continue
    p = d["pages"]; print("diag", d["trace"][:18].ljust(18), d["pass"], d["ns_per_op"], "maps", p["maps"], "steals", p["steals"])
for d in rows("tthreads.jsonl"):
    print("tthreads", d)
PY
