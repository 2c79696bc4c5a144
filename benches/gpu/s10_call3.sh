#!/usr/bin/env bash
# Session 10, last call: the compatibility suite under native / expandable / genpool (the stream-safety
# move touches record_stream and graph captures), PyTorch's entry points and threads, and the thread
# scaling example with the slab's refill batch at 16 (default) and 64 slots. Run from the repository root.
set -uo pipefail
STEPS_DEFAULT=threads,compat,torch,tthreads
. "$(dirname "$0")/env.sh"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; python3 -c 'import torch; print("torch", torch.__version__)'; nproc; } > "$OUT/machine.txt" 2>&1
if has threads; then
  for b in new sc128; do
    for h in 4 0; do echo "$b handoff $h"; GENPOOL_HANDOFF=$h timeout 60 "$G"/bin/threads-$b 2000000 1 2 4 8 16; done
  done > "$OUT/threads.txt" 2>&1
fi
if has compat; then
  timeout 330 python3 benches/gpu/compat.py --jobs 6 --json "$OUT/compat.jsonl" --md "$OUT/compat.md" > "$OUT/compat.log" 2>&1
fi
if has torch; then
  tr=(benches/traces/gpt2_generate_kv.csv.gz benches/traces/resnet50_train.csv.gz benches/traces/gpt2_train_fixed.csv.gz benches/traces/bert_serve_4streams.csv.gz)
  timeout 200 python3 benches/gpu/torch_replay.py "${tr[@]}" --modes native,expandable,genpool --reps 3 > "$OUT/torch.jsonl" 2> "$OUT/torch.err"
fi
if has tthreads; then
  timeout 120 python3 benches/gpu/torch_threads.py --modes native,genpool > "$OUT/tthreads.jsonl" 2> "$OUT/tthreads.err"
fi
cat "$OUT/machine.txt" "$OUT/threads.txt" 2>/dev/null
tail -5 "$OUT/compat.log" 2>/dev/null
cat "$OUT/compat.md" 2>/dev/null
cat "$OUT/torch.jsonl" "$OUT/tthreads.jsonl" 2>/dev/null | cut -c1-260
