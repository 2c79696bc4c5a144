#!/usr/bin/env bash
# Session 16: the session's start (bin/genpool-s15, bin/libgenpool_torch-s15.so, 72e379b) and end
# (bin/genpool, bin/libgenpool_torch.so) side by side on a host whose speed drifts: short runs taking
# turns, many rounds, min and median reported.
#   cli    the engine's CUDA replay, 3 passes a run (the table counts the last), CLI_ROUNDS rounds (default 8);
#   torch  PyTorch's entry points (torch_replay.py, genpool mode) with each build, then native and
#          expandable_segments, TORCH_ROUNDS rounds (default 3).
# Logs under $OUT; the table last.
set -uo pipefail
STEPS_DEFAULT=cli,torch
. "$(dirname "$0")/env.sh"
{ nvidia-smi --query-gpu=name --format=csv,noheader; nproc; } > "$OUT/machine.txt" 2>&1
names="gpt2_train_fixed resnet50_train gpt2_generate_kv llama_ckpt_varlen"
if has cli; then
  replay_turns "${CLI_ROUNDS:-8}" "$names" s15=genpool-s15 new=genpool
fi
if has torch; then
  tr=(benches/traces/gpt2_train_fixed.csv.gz benches/traces/resnet50_train.csv.gz benches/traces/gpt2_generate_kv.csv.gz)
  for r in $(seq ${TORCH_ROUNDS:-3}); do
    for v in s15 new; do
      lib="$PWD/$G/bin/libgenpool_torch.so"; [ $v = s15 ] && lib="$PWD/$G/bin/libgenpool_torch-s15.so"
      GENPOOL_LIB="$lib" timeout 80 python3 benches/gpu/torch_replay.py "${tr[@]}" --modes genpool --reps 5 2>> "$OUT/torch.err" |
        tag_runs "$v" "$r" >> "$OUT/torch.jsonl"
    done
    timeout 100 python3 benches/gpu/torch_replay.py "${tr[@]}" --modes native,expandable --reps 5 2>> "$OUT/torch.err" |
      tag_runs anchor "$r" >> "$OUT/torch.jsonl"
  done
fi
cat "$OUT/machine.txt"
python3 benches/gpu/ab_table.py "$OUT" --cli-last-pass
tail -3 "$OUT/torch.err" "$OUT/cli.err" 2>/dev/null
