#!/usr/bin/env bash
# Session 15: where PyTorch's path spends the ~110 ns a call it adds to the engine's own replay, profiled
# in the steady state only: perf attaches to torch_diag.py's replay (PyTorch's entry points, genpool
# installed) after its third pass, and to the engine's own CUDA replay (`genpool replay`) after its
# warm-up, of the same trace on the same machine. Carried perf as in s14_perf.sh (.gpu/perfb.tar.xz).
set -uo pipefail
STEPS_DEFAULT=x
. "$(dirname "$0")/env.sh"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
carried_perf
K=${K:-benches/traces/gpt2_generate_kv.csv.gz}
{ nvidia-smi --query-gpu=name --format=csv,noheader; nproc; } > "$OUT/machine.txt" 2>&1
timeout 200 python3 benches/gpu/torch_diag.py --child $K 1 > "$OUT/warm.txt" 2>&1
report() { # name
  $PERF report -i /tmp/$1.data --no-children --sort dso --stdio 2>/dev/null | grep -E "^ +[0-9]" | head -12 > "$OUT/$1.dso.txt"
  $PERF report -i /tmp/$1.data --no-children --sort dso,sym --percent-limit 0.3 --stdio 2>/dev/null | grep -E "^ +[0-9]" | head -80 > "$OUT/$1.sym.txt"
  $PERF report -i /tmp/$1.data --children --sort sym --percent-limit 1.5 --stdio -g none 2>/dev/null | grep -E "^ +[0-9]" | head -50 > "$OUT/$1.children.txt"
  $PERF report -i /tmp/$1.data --no-children --sort sym --percent-limit 1 --stdio -g caller,0.5,callee --max-stack 5 2>/dev/null | head -400 > "$OUT/$1.calls.txt"
}
# PyTorch's path: 60 passes; perf attaches once three have run, for 4 s.
python3 benches/gpu/torch_diag.py --child $K 60 > "$OUT/torch_run.txt" 2>&1 &
pid=$!
for _ in $(seq 600); do [ "$(grep -c '"pass"' "$OUT/torch_run.txt")" -ge 3 ] && break; sleep 0.2; done
timeout 20 $PERF record -F 4999 -g -p $pid -o /tmp/torch.data -- sleep 4 > "$OUT/torch_perf.txt" 2>&1
wait $pid
report torch
# The engine's own replay of the same trace: 60 passes, perf from 3 s in, for 4 s.
timeout 60 "$G"/bin/genpool replay $K --device cuda --passes 60 --json > "$OUT/cli_run.jsonl" 2>&1 &
pid=$!
sleep 3
timeout 20 $PERF record -F 4999 -g -p $pid -o /tmp/cli.data -- sleep 4 > "$OUT/cli_perf.txt" 2>&1
wait $pid
report cli
cat "$OUT/machine.txt"
grep '"pass"' "$OUT/torch_run.txt" | python3 -c "
import json,sys
v=[json.loads(l)['ns_per_op'] for l in sys.stdin]; print('torch path ns/op passes', len(v), 'median', sorted(v[3:])[len(v[3:])//2] if len(v)>3 else v)"
python3 -c "
import json
for l in open('$OUT/cli_run.jsonl'):
    try: d=json.loads(l)
    except ValueError: continue
    p=d['ns_per_op_passes']; print('engine ns/op median', round(sorted(p)[len(p)//2]), 'passes', len(p))"
for n in torch cli; do echo "== $n"; cat "$OUT/$n.dso.txt"; cut -c1-140 "$OUT/$n.sym.txt" | head -45; done
