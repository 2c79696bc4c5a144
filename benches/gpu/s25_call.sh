#!/usr/bin/env bash
# Session 25: the general case on the GPU — the synthetic shapes of `genpool synth` (gen_trace::synth:
# eight serving streams, a cross-stream hand-off, random sizes and lifetimes, growing KV caches), made here,
# through the engine's CUDA replay (5 passes) and PyTorch's entry points (torch_replay.py: native,
# expandable_segments, genpool; 4 reps); then every CUDA test binary (STEPS has `tests`). Logs under
# $OUT; the tables last.
set -uo pipefail
STEPS_DEFAULT=synth,tests
. "$(dirname "$0")/env.sh"
machine_info
SYNTH=/tmp/synth
if has synth; then
  "$G"/bin/genpool synth "$SYNTH" > "$OUT/synth.txt" 2>&1
  for t in serve8 crossfree random_sizes kvgrow; do
    timeout 150 "$G"/bin/genpool replay "$SYNTH/$t.csv.gz" --device cuda --passes 5 --json \
      2>> "$OUT/cli.err" >> "$OUT/cli.jsonl"
    timeout 240 python3 benches/gpu/torch_replay.py "$SYNTH/$t.csv.gz" --modes native,expandable,genpool \
      --reps 4 2>> "$OUT/torch.err" >> "$OUT/torch.jsonl"
  done
fi
has tests && cuda_tests
cat "$OUT/machine.txt"
grep -E "test result|rc=" "$OUT/cuda_tests.log" 2>/dev/null | grep -v "rc=0" | grep -v " 0 failed"
grep -c "rc=0" "$OUT/cuda_tests.log" 2>/dev/null
python3 benches/gpu/cli_table.py
python3 - "$OUT/torch.jsonl" <<'PY'
import json, os, sys
if os.path.exists(sys.argv[1]):
    for l in open(sys.argv[1]):
        d = json.loads(l)
        print("torch", d["trace"], d["mode"], d.get("ratio"), d.get("ns_per_op"))
PY
tail -5 "$OUT/torch.err" 2>/dev/null
