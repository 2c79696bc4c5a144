#!/usr/bin/env bash
# Session 13: where the time goes on the PyTorch path (torch_diag.py: each pass's page counters and host
# time under PyTorch; the same traces through the engine's own replay), a perf profile of it and of the
# 16-thread short-lived bench where perf exists.
# Needs .gpu/bin/{genpool,libgenpool_torch.so,threads-new} (strip --strip-debug keeps their symbols).
set -uo pipefail
STEPS_DEFAULT=x
. "$(dirname "$0")/env.sh"
T="benches/traces/gpt2_train_fixed.csv.gz benches/traces/resnet50_train.csv.gz"
which perf 2>&1 | head -1 > $OUT/tools.txt
GENPOOL_TIMING=1 timeout 90 python3 benches/gpu/torch_diag.py $T --reps 4 > $OUT/diag_timing.jsonl 2> $OUT/diag.err
timeout 40 $G/bin/genpool replay $T --device cuda --passes 5 --json --ignore-site > $OUT/cli.jsonl 2>> $OUT/diag.err
python3 - <<'PY'
import json,os
O=os.environ["OUT"]
for l in open(f"{O}/diag_timing.jsonl"):
  d=json.loads(l)
  if "error" in d: print(d); continue
  print(d["trace"][:18].ljust(18), d["pass"], d["ns_per_op"], d["pages"], json.dumps(d.get("host_timing"))[:400])
for l in open(f"{O}/cli.jsonl"):
  d=json.loads(l); print("cli", d["trace"][:18], round(d["ns_per_op"]), [round(x) for x in d["ns_per_op_passes"]], d["warm_calls"])
PY
if command -v perf > /dev/null; then
  timeout 60 perf record -F 4999 -g -o $OUT/perf.data -- python3 benches/gpu/torch_diag.py --child benches/traces/gpt2_train_fixed.csv.gz 4 > $OUT/perf_run.txt 2>&1
  perf report -i $OUT/perf.data --no-children --percent-limit 0.8 --stdio 2>/dev/null | grep -E "^ +[0-9]" | head -45 > $OUT/perf_top.txt
  rm -f $OUT/perf.data
  cut -c1-250 $OUT/perf_run.txt; cat $OUT/perf_top.txt
  GENPOOL_HANDOFF=4 timeout 30 perf record -F 2999 -g -o $OUT/perf_t.data -- $G/bin/threads-new 2000000 16 > $OUT/perf_threads_run.txt 2>&1
  perf report -i $OUT/perf_t.data --no-children --percent-limit 1 --stdio 2>/dev/null | grep -E "^ +[0-9]" | head -30 > $OUT/perf_threads_top.txt
  rm -f $OUT/perf_t.data
  cat $OUT/perf_threads_run.txt $OUT/perf_threads_top.txt
fi
tail -3 $OUT/diag.err
