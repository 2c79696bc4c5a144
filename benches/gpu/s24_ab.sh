#!/usr/bin/env bash
# Session 24, second call on the warm machine: the engine's CUDA replay before (session 23's end, staged
# as .gpu/bin/genpool_base) and after the slab's shared pages, taking turns trace by trace, 3 rounds; then
# PyTorch's entry points on gpt2_generate_kv, expandable_segments and genpool with old_generation:4096 / :0
# taking turns, 3 rounds (the old generation's page moves through PyTorch). Logs under $OUT.
set -uo pipefail
STEPS_DEFAULT=ab
. "$(dirname "$0")/env.sh"
machine_info
replay_turns 3 "resnet50_train gpt2_generate_kv vit_train_varres bert_serve_4streams gpt2_train_fixed" \
  base=genpool_base new=genpool
tr=benches/traces/gpt2_generate_kv.csv.gz
for r in 1 2 3; do
  timeout 60 python3 benches/gpu/torch_replay.py $tr --modes expandable --reps 4 2>> "$OUT/torch.err" |
    tag_runs exp "$r" >> "$OUT/torch.jsonl"
  for c in 4096 0; do
    GENPOOL_CONF=old_generation:$c timeout 60 python3 benches/gpu/torch_replay.py $tr --modes genpool --reps 4 \
      2>> "$OUT/torch.err" | tag_runs "og$c" "$r" >> "$OUT/torch.jsonl"
  done
done
python3 benches/gpu/ab_table.py "$OUT" 2>&1 | tail -30
python3 - "$OUT/torch.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    d = json.loads(l)
    print(d.get("v"), d.get("round"), d["mode"], d["ratio"], d["ns_per_op"])
PY
