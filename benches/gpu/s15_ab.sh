#!/usr/bin/env bash
# Session 15: the session's start and end side by side where hosts are noisy — PyTorch's entry points
# (torch_replay.py, genpool mode) with bin/libgenpool_torch-s14.so and bin/libgenpool_torch.so, and the
# engine's CUDA replay with bin/genpool-s14 and bin/genpool, alternated ROUNDS times; expandable_segments
# and native once per round. VERSIONS (default "s14 new") picks the builds, CLI=0 skips the engine's
# replay. Logs under $OUT; the table (min and median over rounds) last.
set -uo pipefail
STEPS_DEFAULT=x
. "$(dirname "$0")/env.sh"
{ nvidia-smi --query-gpu=name --format=csv,noheader; nproc; } > "$OUT/machine.txt" 2>&1
tr=(benches/traces/gpt2_generate_kv.csv.gz benches/traces/resnet50_train.csv.gz benches/traces/gpt2_train_fixed.csv.gz)
for r in $(seq ${ROUNDS:-3}); do
  for v in ${VERSIONS:-s14 new}; do
    lib="$PWD/$G/bin/libgenpool_torch.so"; [ $v = s14 ] && lib="$PWD/$G/bin/libgenpool_torch-s14.so"
    GENPOOL_LIB="$lib" timeout 80 python3 benches/gpu/torch_replay.py "${tr[@]}" --modes genpool --reps 5 2>> "$OUT/torch.err" |
      tag_runs "$v" "$r" >> "$OUT/torch.jsonl"
    b=genpool; [ $v = s14 ] && b=genpool-s14
    [ "${CLI:-1}" = 0 ] || timeout 40 "$G"/bin/$b replay "${tr[@]}" --device cuda --passes 5 --json 2>> "$OUT/cli.err" |
      tag_runs "$v" "$r" >> "$OUT/cli.jsonl"
  done
  timeout 100 python3 benches/gpu/torch_replay.py "${tr[@]}" --modes native,expandable --reps 5 2>> "$OUT/torch.err" |
    tag_runs anchor "$r" >> "$OUT/torch.jsonl"
done
cat "$OUT/machine.txt"
python3 benches/gpu/ab_table.py "$OUT"
tail -3 "$OUT/torch.err" "$OUT/cli.err" 2>/dev/null
