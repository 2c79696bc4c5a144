#!/usr/bin/env bash
# Session 25: the multi-stream path's host work before (`genpool_base`, .gpu/base/libgenpool_torch.so:
# the session's start, f39948b) and after (best fit's placement with no list built, its own cut, the
# replay's stream list), taking turns: the engine's CUDA replay of the multi-stream traces (3 passes,
# ROUNDS rounds, env.sh's replay_turns), then PyTorch's entry points (torch_replay.py, genpool with either
# library, 4 reps, ROUNDS rounds) on serve8 (`genpool synth`) and bert_serve_4streams. (Session 25's call 3
# ran each replay round before the same round's PyTorch runs, with its own copy of the replay loop.)
# Logs under $OUT; the tables last.
set -uo pipefail
STEPS_DEFAULT=ab
. "$(dirname "$0")/env.sh"
machine_info
SYNTH=/tmp/synth
"$G"/bin/genpool synth "$SYNTH" serve8 > "$OUT/synth.txt" 2>&1
R=${ROUNDS:-2}
replay_turns "$R" "bert_serve_4streams gpt2_prefetch resnet_copy_overlap $SYNTH/serve8" base=genpool_base new=genpool
for r in $(seq "$R"); do
  for t in "$SYNTH/serve8.csv.gz" benches/traces/bert_serve_4streams.csv.gz; do
    for vb in base="$PWD/$G/base/libgenpool_torch.so" new="$PWD/$G/bin/libgenpool_torch.so"; do
      GENPOOL_LIB="${vb#*=}" timeout 120 python3 benches/gpu/torch_replay.py "$t" --modes genpool --reps 4 \
        2>> "$OUT/torch.err" | tag_runs "${vb%%=*}" "$r" >> "$OUT/torch.jsonl"
    done
  done
done
cat "$OUT/machine.txt"
python3 - "$OUT/cli.jsonl" "$OUT/torch.jsonl" <<'PY'
import json, os, sys
for path, kind in zip(sys.argv[1:], ("cli", "torch")):
    if not os.path.exists(path):
        continue
    for l in open(path):
        d = json.loads(l)
        w = d.get("warm_calls", {})
        print(kind, d["round"], d["v"], d["trace"][:20], round(d["ratio"], 4), round(d["ns_per_op"]),
              "maps", w.get("maps"), "waits", w.get("stream_waits"))
PY
tail -3 "$OUT/torch.err" 2>/dev/null
