#!/usr/bin/env bash
# Issue 21 on the GPU machine (run from the repository root, with .gpu/bin/genpool and, for the PyTorch
# steps, .gpu/bin/libgenpool_torch.so staged): the CUDA replay of every bundled trace through genpool and
# genpool-single (ratio, warm ns/op, the warm passes' driver calls), and PyTorch's entry points
# (benches/gpu/torch_replay.py: native, expandable_segments, genpool's backend). STEPS picks steps
# (default replay,torch). Logs and JSON under $OUT; the table last.
set -uo pipefail
STEPS_DEFAULT=replay,torch
. "$(dirname "$0")/env.sh"
PASSES=${PASSES:-5}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; python3 -c 'import torch; print("torch", torch.__version__)'; nproc; } > "$OUT/machine.txt" 2>&1
all=(benches/traces/*.csv.gz)
if has replay; then
  timeout "${T_REPLAY:-300}" "$G"/bin/genpool replay "${all[@]}" --device cuda --passes "$PASSES" \
    --allocator genpool --allocator genpool-single --json > "$OUT/replay.jsonl" 2> "$OUT/replay.err"
fi
if has torch; then
  tr=(${TORCH_TRACES:-benches/traces/gpt2_generate_kv.csv.gz benches/traces/resnet50_train.csv.gz benches/traces/gpt2_train_fixed.csv.gz benches/traces/bert_serve_4streams.csv.gz})
  timeout "${T_TORCH:-300}" python3 benches/gpu/torch_replay.py "${tr[@]}" --modes native,expandable,genpool --reps 3 > "$OUT/torch.jsonl" 2> "$OUT/torch.err"
fi
cat "$OUT/machine.txt"
tail -3 "$OUT"/*.err 2>/dev/null | tail -12
python3 benches/gpu/replay_table.py "$OUT/replay.jsonl" "$OUT/torch.jsonl"
