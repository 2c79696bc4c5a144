#!/usr/bin/env bash
# Session 24, after the arena's end-of-run rule (`survivors.rs`): PyTorch's entry points
# (torch_replay.py, which marks no pass) on the four traces of the 2x target, expandable_segments and
# genpool, ROUNDS rounds (default 2); then the CUDA test binaries. Logs under $OUT; the table last.
set -uo pipefail
STEPS_DEFAULT=tests
. "$(dirname "$0")/env.sh"
machine_info
for r in $(seq "${ROUNDS:-2}"); do
  for t in gpt2_train_fixed gpt2_prefetch gpt2_generate_kv resnet50_train; do
    timeout 90 python3 benches/gpu/torch_replay.py benches/traces/$t.csv.gz --modes expandable,genpool --reps 4 \
      2>> "$OUT/torch.err" | tag_runs head "$r" >> "$OUT/torch.jsonl"
  done
done
has tests && cuda_tests
cat "$OUT/machine.txt"
grep -E "test result|rc=" "$OUT/cuda_tests.log" 2>/dev/null
python3 - "$OUT/torch.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    d = json.loads(l)
    print(d["round"], d["trace"], d["mode"], d["ratio"], d["ns_per_op"])
PY
