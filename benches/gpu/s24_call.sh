#!/usr/bin/env bash
# Session 24's one call (what the device budget left after refused starts allows): every CUDA test binary
# at HEAD (the slab's classes now share pages; the page layer keeps a returned page's streams), the
# compatibility suite under native, expandable and genpool (owed since session 22), then — while the
# call's time lasts (REPLAY_UNTIL seconds from the start, default 540) — the engine's CUDA replay of the
# ten traces (those the old generation and the shared slab pages change most first), old_generation:4096
# and :0 taking turns, 5 passes, and PyTorch's entry points on generate_kv. Stage first:
# ../shared/tools/gpu-pack, then benches/gpu/pack_cuda_tests.sh; run with `carry: [".gpu"]`. Logs under
# $OUT; tables last.
set -uo pipefail
STEPS_DEFAULT=tests,compat,replay
. "$(dirname "$0")/env.sh"
t0=$SECONDS
begin_call
has compat && compat_suite native,expandable,genpool
if has replay; then
  for t in gpt2_generate_kv resnet50_train bert_serve_4streams vit_train_varres llama_ckpt_varlen gpt2_train_fixed \
      resnet_copy_overlap gpt2_prefetch bert_finetune_varlen gpt2m_train_varlen; do
    for c in old_generation:4096 old_generation:0; do
      (( SECONDS - t0 < ${REPLAY_UNTIL:-540} )) || break 2
      GENPOOL_CONF=$c timeout 40 "$G"/bin/genpool replay benches/traces/$t.csv.gz --device cuda --passes 5 --json 2>> "$OUT/cli.err" |
        tag_runs "${c#old_generation:}" 1 >> "$OUT/cli.jsonl"
    done
  done
  # PyTorch's entry points on generate_kv (the old generation's page moves), while time is left.
  tr=benches/traces/gpt2_generate_kv.csv.gz
  if (( SECONDS - t0 < ${REPLAY_UNTIL:-540} - 40 )); then
    timeout 40 python3 benches/gpu/torch_replay.py $tr --modes expandable,genpool --reps 4 > "$OUT/torch.jsonl" 2>> "$OUT/torch.err"
  fi
fi
begin_tables
python3 benches/gpu/ab_table.py "$OUT" 2>/dev/null
echo "call seconds: $((SECONDS - t0))"
