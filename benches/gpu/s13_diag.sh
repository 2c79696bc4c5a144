set -uo pipefail
STEPS_DEFAULT=x
. benches/gpu/env.sh
T="benches/traces/resnet50_train.csv.gz benches/traces/gpt2_train_fixed.csv.gz benches/traces/gpt2_generate_kv.csv.gz benches/traces/bert_serve_4streams.csv.gz"
which perf gdb valgrind py-spy nsys 2>&1 | head > $OUT/tools.txt
GENPOOL_TIMING=1 timeout 200 python3 benches/gpu/torch_diag.py $T --reps 4 > $OUT/diag_timing.jsonl 2> $OUT/diag.err
timeout 120 python3 benches/gpu/torch_diag.py $T --reps 4 > $OUT/diag.jsonl 2>> $OUT/diag.err
timeout 100 $G/bin/genpool replay $T --device cuda --passes 5 --json --ignore-site > $OUT/cli.jsonl 2>> $OUT/diag.err
cat $OUT/tools.txt; tail -3 $OUT/diag.err
python3 - <<'PY'
import json,os
O=os.environ["OUT"]
for f in ("diag_timing.jsonl","diag.jsonl"):
  print(f)
  prev=None
  for l in open(f"{O}/{f}"):
    d=json.loads(l)
    if "error" in d: print(d); continue
    ht=d.get("host_timing") or {}
    print(d["trace"][:18].ljust(18), d["pass"], d["ns_per_op"], d["pages"], json.dumps(ht)[:300])
for l in open(f"{O}/cli.jsonl"):
  d=json.loads(l); print("cli", d["trace"][:18], round(d["ns_per_op"]), [round(x) for x in d["ns_per_op_passes"]], d["warm_calls"])
PY
