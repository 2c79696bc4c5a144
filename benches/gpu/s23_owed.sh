#!/usr/bin/env bash
# What session 23 owes the GPU (no device time was left to it). Stage first, on the build machine:
# ../shared/tools/gpu-pack, then benches/gpu/pack_cuda_tests.sh; run here with `carry: [".gpu"]`, in two
# calls that fit the 600 s limit: STEPS=tests,oldgen (call 1, ~250 s), then STEPS=compat (call 2, ~420 s).
# Steps (STEPS, comma-separated; default tests,oldgen):
#   tests   every CUDA test binary of the workspace at HEAD (last run: session 21, 25/25 at 77817a0;
#           since then the page layer's split, the extent arena's error path and its old generation);
#   oldgen  the old generation on the GPU (docs/ARCHITECTURE.md "The old generation"): the engine's CUDA
#           replay of the ten traces with the default (old_generation:4096) and with old_generation:0,
#           taking turns trace by trace, 5 passes, OLDGEN_ROUNDS rounds (default 1) — the ratios should
#           be the simulator's (generate_kv 1.0228 / 1.0692, the rest equal), the question is what its
#           page moves (699 -> 1 522 warm maps on generate_kv) cost in ns/op; then PyTorch's entry points
#           (torch_replay.py) on gpt2_generate_kv, expandable and genpool both ways;
#   compat  the compatibility suite under native, expandable and genpool (owed since session 22).
# Logs under $OUT; tables last.
set -uo pipefail
STEPS_DEFAULT=tests,oldgen
. "$(dirname "$0")/env.sh"
begin_call
if has oldgen; then
  for r in $(seq "${OLDGEN_ROUNDS:-1}"); do
    for t in gpt2_generate_kv resnet50_train vit_train_varres gpt2m_train_varlen bert_finetune_varlen gpt2_train_fixed llama_ckpt_varlen resnet_copy_overlap gpt2_prefetch bert_serve_4streams; do
      for c in old_generation:4096 old_generation:0; do
        GENPOOL_CONF=$c timeout 60 "$G"/bin/genpool replay benches/traces/$t.csv.gz --device cuda --passes 5 --json 2>> "$OUT/cli.err" |
          tag_runs "${c#old_generation:}" "$r" >> "$OUT/cli.jsonl"
      done
    done
  done
  tr=benches/traces/gpt2_generate_kv.csv.gz
  timeout 60 python3 benches/gpu/torch_replay.py $tr --modes expandable --reps 4 > "$OUT/torch.jsonl" 2>> "$OUT/torch.err"
  for c in old_generation:4096 old_generation:0; do
    GENPOOL_CONF=$c timeout 60 python3 benches/gpu/torch_replay.py $tr --modes genpool --reps 4 2>> "$OUT/torch.err" |
      tag_runs "${c#old_generation:}" 1 >> "$OUT/torch.jsonl"
  done
fi
has compat && compat_suite native,expandable,genpool
begin_tables
python3 benches/gpu/ab_table.py "$OUT" 2>/dev/null
tail -3 "$OUT/torch.err" 2>/dev/null
