#!/usr/bin/env bash
# Two builds side by side on one GPU host, taking turns (hosts drift): `base` (.gpu/bin/genpool_base,
# .gpu/base/libgenpool_torch.so) against `new` (.gpu/bin/genpool, .gpu/bin/libgenpool_torch.so). First
# the engine's CUDA replay (3 passes, ROUNDS rounds, env.sh's replay_turns) of REPLAY (names under
# benches/traces or `genpool synth` shapes under /tmp/synth), then PyTorch's entry points
# (torch_replay.py, genpool with either library, 4 reps, ROUNDS rounds) on TORCH. Logs under $OUT; the
# table last. Session 25's A/B is this script with its defaults (s25_ab.sh); session 26's passes its own
# lists (s26_call.sh).
set -uo pipefail
STEPS_DEFAULT=ab
. "$(dirname "$0")/env.sh"
machine_info
SYNTH=/tmp/synth
"$G"/bin/genpool synth "$SYNTH" > "$OUT/synth.txt" 2>&1
R=${ROUNDS:-2}
REPLAY=${REPLAY:-"bert_serve_4streams gpt2_prefetch resnet_copy_overlap $SYNTH/serve8"}
TORCH=${TORCH:-"$SYNTH/serve8.csv.gz benches/traces/bert_serve_4streams.csv.gz"}
replay_turns "$R" "$REPLAY" base=genpool_base new=genpool
for r in $(seq "$R"); do
  for t in $TORCH; do
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
              "maps", w.get("maps"), "waits", w.get("stream_waits"), "records", w.get("event_records"),
              "queries", w.get("event_queries"), "squeries", w.get("stream_queries"))
PY
tail -3 "$OUT/torch.err" 2>/dev/null
