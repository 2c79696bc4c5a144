set -uo pipefail
STEPS_DEFAULT=x
. benches/gpu/env.sh
T="benches/traces/resnet50_train.csv.gz benches/traces/gpt2_train_fixed.csv.gz benches/traces/gpt2_generate_kv.csv.gz"
which perf gdb valgrind py-spy nsys 2>&1 | head > $OUT/tools.txt
GENPOOL_TIMING=1 timeout 200 python3 benches/gpu/torch_diag.py $T --reps 4 > $OUT/diag_timing.jsonl 2> $OUT/diag.err
timeout 100 $G/bin/genpool replay $T --device cuda --passes 5 --json --ignore-site > $OUT/cli.jsonl 2>> $OUT/diag.err
for c in page_slack:0.03 page_slack:0.06 page_slack:0.1; do
  GENPOOL_CONF=$c timeout 60 $G/bin/genpool replay benches/traces/bert_serve_4streams.csv.gz --device cuda --passes 5 --json 2>> $OUT/diag.err | python3 -c "
import json,sys
for l in sys.stdin:
  d=json.loads(l); w=d['warm_calls']; print('bert_serve slack=$c', round(d['ratio'],4), round(d['ns_per_op']), [round(x) for x in d['ns_per_op_passes']], 'maps', w.get('maps'), 'rec', w.get('event_records'), 'swait', w.get('stream_waits'), 'syncs', w.get('device_syncs'))"
done > $OUT/slack.txt
cat $OUT/tools.txt; tail -3 $OUT/diag.err; cat $OUT/slack.txt
python3 - <<'PY'
import json,os
O=os.environ["OUT"]
for f in ("diag_timing.jsonl",):
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
# A profile of the PyTorch path (the plug-in keeps its symbol table: strip --strip-debug), where perf exists.
if command -v perf > /dev/null; then
  perf record -F 4999 -g -o $OUT/perf.data -- python3 benches/gpu/torch_diag.py --child benches/traces/gpt2_train_fixed.csv.gz 4 > $OUT/perf_run.txt 2>&1
  perf report -i $OUT/perf.data --no-children --percent-limit 0.7 --stdio 2>/dev/null | grep -E "^ +[0-9]" | head -60 > $OUT/perf_top.txt
  rm -f $OUT/perf.data
  cat $OUT/perf_top.txt
fi
if command -v perf > /dev/null; then
  GENPOOL_HANDOFF=0 perf record -F 2999 -g -o $OUT/perf_t.data -- $G/bin/threads-new 2000000 16 > $OUT/perf_threads_run.txt 2>&1
  perf report -i $OUT/perf_t.data --no-children --percent-limit 0.7 --stdio 2>/dev/null | grep -E "^ +[0-9]" | head -50 > $OUT/perf_threads_top.txt
  rm -f $OUT/perf_t.data
  cat $OUT/perf_threads_run.txt $OUT/perf_threads_top.txt
fi
