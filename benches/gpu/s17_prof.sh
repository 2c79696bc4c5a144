#!/usr/bin/env bash
# Session 17: why the engine's CUDA replay of gpt2_prefetch (a second stream: no plan, shared-arena
# ordering) costs ~290 ns a call on the H100 host when gpt2_train_fixed costs ~180 and the simulator has
# them the other way round. perf (carried: .gpu/perfb.tar.xz) over 60 passes of each, by DSO and symbol.
set -uo pipefail
STEPS_DEFAULT=x
. "$(dirname "$0")/env.sh"
carried_perf
{ nvidia-smi --query-gpu=name --format=csv,noheader; nproc; } > "$OUT/machine.txt" 2>&1
for t in ${TRACES:-gpt2_prefetch gpt2_train_fixed}; do
  timeout 120 $PERF record -F 4999 -g -o /tmp/$t.data -- "$G"/bin/genpool replay benches/traces/$t.csv.gz --device cuda --passes ${PASSES:-60} --json > "$OUT/$t.run.jsonl" 2> "$OUT/$t.err"
  $PERF report -i /tmp/$t.data --no-children --sort dso --stdio 2>/dev/null | grep -E "^ +[0-9]" | head -8 > "$OUT/$t.dso.txt"
  $PERF report -i /tmp/$t.data --no-children --sort dso,sym --percent-limit 0.4 --stdio -g none 2>/dev/null | grep -E "^ +[0-9]" | head -60 > "$OUT/$t.sym.txt"
done
for t in ${TRACES:-gpt2_prefetch gpt2_train_fixed}; do
  echo "== $t"; python3 -c "
import json,sys
for l in open('$OUT/$t.run.jsonl'):
    if l.startswith('{'):
        d=json.loads(l); print(round(d['ns_per_op']), d['warm_calls'])
"
  cat "$OUT/$t.dso.txt"; head -40 "$OUT/$t.sym.txt"
done
# The many-streams handoff change (this build against an earlier one staged as bin/genpool-start — in call 2, e42bde1): the
# four-stream serving trace, both builds taking turns, two rounds.
if [ -x "$G"/bin/genpool-start ]; then
  for r in 1 2; do for b in genpool-start genpool; do
    echo "$b round $r $(timeout 60 "$G"/bin/$b replay benches/traces/bert_serve_4streams.csv.gz --device cuda --passes 4 --json 2>/dev/null | python3 -c "
import json,sys
d=json.loads(sys.stdin.readline()); print(round(d['ratio'],4), round(d['ns_per_op']), [round(x) for x in d['ns_per_op_passes']], d['warm_calls'])")"
  done; done
fi
