#!/usr/bin/env bash
# Session 25's closing check at HEAD: every CUDA test binary, the compatibility suite under native,
# expandable and genpool, then (while REPLAY_UNTIL seconds from the start allow, default 500) the engine's
# CUDA replay of the ten traces, 5 passes. Stage first: ../shared/tools/gpu-pack, then
# benches/gpu/pack_cuda_tests.sh; run with `carry: [".gpu"]`. Logs under $OUT; tables last.
set -uo pipefail
STEPS_DEFAULT=tests,compat,replay
. "$(dirname "$0")/env.sh"
t0=$SECONDS
begin_call
has compat && compat_suite native,expandable,genpool
if has replay; then
  for t in resnet50_train gpt2_generate_kv vit_train_varres gpt2m_train_varlen bert_finetune_varlen gpt2_train_fixed \
      llama_ckpt_varlen resnet_copy_overlap gpt2_prefetch bert_serve_4streams; do
    (( SECONDS - t0 < ${REPLAY_UNTIL:-500} )) || break
    timeout 40 "$G"/bin/genpool replay benches/traces/$t.csv.gz --device cuda --passes 5 --json 2>> "$OUT/cli.err" >> "$OUT/cli.jsonl"
  done
fi
begin_tables
tail -2 "$OUT/compat.log" 2>/dev/null
