#!/usr/bin/env bash
# Session 14: where the 16-thread short-lived path loses its scaling, and where PyTorch's path spends its
# time — perf profiles on the GPU machine, which has no perf of its own: .gpu/perfb.tar.xz is this
# (Debian) build machine's perf with its libraries and loader, run through that loader.
set -uo pipefail
STEPS_DEFAULT=x
. "$(dirname "$0")/env.sh"
carried_perf
$PERF --version > "$OUT/perf_probe.txt" 2>&1
cat /proc/sys/kernel/perf_event_paranoid >> "$OUT/perf_probe.txt" 2>&1
prof() { # name, freq, command...
  local n=$1 f=$2; shift 2
  timeout 60 $PERF record -F $f -g -o /tmp/$n.data -- "$@" > "$OUT/$n.run.txt" 2>&1
  $PERF report -i /tmp/$n.data --no-children --percent-limit 0.7 --stdio 2>/dev/null | grep -E "^ +[0-9]" | head -40 > "$OUT/$n.top.txt"
  local top=$(head -1 "$OUT/$n.top.txt" | awk '{print $NF}')
  $PERF annotate -i /tmp/$n.data --stdio -s "$top" 2>/dev/null | grep -E "^\s+[0-9]+\.[0-9]+ :" | sort -rn | head -12 > "$OUT/$n.ann.txt"
  $PERF report -i /tmp/$n.data --no-children --percent-limit 2 --stdio -g caller,0.5,callee --max-stack 6 2>/dev/null | head -150 > "$OUT/$n.calls.txt"
  rm -f /tmp/$n.data
}
# The short-lived path at 1 and 16 threads: the session's start (s13), its engine fast path (fast,
# b677961) and the line-aligned slab runs on top (new), interleaved.
for r in 1 2 3; do for b in s13 fast new; do for m in pool slab; do
  [ "$b:$m" = "s13:slab" ] && continue
  echo "round $r $b $m $(GENPOOL_THREADS_MODE=$m GENPOOL_HANDOFF=0 timeout 30 "$G"/bin/threads-$b 2000000 1 16 2>&1 | tr '\n' ' ')" >> "$OUT/ab16.txt"
done; done; done
for b in s13 new; do echo "$b handoff4 $(GENPOOL_HANDOFF=4 timeout 30 "$G"/bin/threads-$b 2000000 1 16 2>&1 | tr '\n' ' ')" >> "$OUT/ab16.txt"; done
cat "$OUT/ab16.txt"
GENPOOL_THREADS_MODE=slab GENPOOL_HANDOFF=0 prof slab16 4999 "$G"/bin/threads-new 4000000 16
GENPOOL_THREADS_MODE=slab-per-thread GENPOOL_HANDOFF=0 prof slabown16 4999 "$G"/bin/threads-new 4000000 16
GENPOOL_THREADS_MODE=pool GENPOOL_HANDOFF=0 prof pool16 4999 "$G"/bin/threads-new 4000000 16
GENPOOL_THREADS_MODE=slab GENPOOL_HANDOFF=0 prof slab1 4999 "$G"/bin/threads-new 8000000 1
timeout 150 python3 benches/gpu/torch_diag.py --child benches/traces/gpt2_train_fixed.csv.gz 1 > "$OUT/torch_warm.txt" 2>&1  # builds the extensions outside the profile
prof torch_gpt2 2999 python3 benches/gpu/torch_diag.py --child benches/traces/gpt2_train_fixed.csv.gz 5
prof cli_resnet 2999 "$G"/bin/genpool replay benches/traces/resnet50_train.csv.gz --device cuda --passes 20
cat "$OUT/perf_probe.txt"
for n in slab16 slabown16 pool16 slab1 torch_gpt2 cli_resnet; do echo "== $n"; tail -2 "$OUT/$n.run.txt" | cut -c1-200; head -22 "$OUT/$n.top.txt"; head -8 "$OUT/$n.ann.txt"; done
