#!/usr/bin/env bash
# Session 28's first GPU call: every CUDA test binary and the compatibility suite under genpool at HEAD
# (session 27's page-move questions, `fab83ac`, never ran on a GPU), then record_stream_overlap.py
# (does a block used on a second stream keep the streams overlapping? native, expandable_segments,
# genpool), then — with a base staged (.gpu/bin/genpool_base, .gpu/base/libgenpool_torch.so) — ab.sh on
# the traces whose page moves now ask first. Stage: ../shared/tools/gpu-pack,
# benches/gpu/pack_cuda_tests.sh, the base; run with `carry: [".gpu"]`. STEPS picks (tests,compat,rs,ab).
set -uo pipefail
STEPS_DEFAULT=tests,compat,rs
. "$(dirname "$0")/env.sh"
machine_info
has tests && cuda_tests && grep -E "rc=" "$OUT/cuda_tests.log"
has compat && compat_suite genpool && tail -1 "$OUT/compat.log"
if has rs; then
  timeout 300 python3 benches/gpu/record_stream_overlap.py --modes "${RS_MODES:-native,expandable,genpool,genpool-wait}" \
    > "$OUT/rs.jsonl" 2> "$OUT/rs.err"
  echo "rs rc=$?"; cat "$OUT/rs.jsonl"; tail -5 "$OUT/rs.err"
fi
if has ab && [ -x "$G/bin/genpool_base" ]; then
  ROUNDS=${ROUNDS:-3} REPLAY="${REPLAY:-bert_serve_4streams gpt2_prefetch resnet_copy_overlap}" \
  TORCH="${TORCH:-benches/traces/bert_serve_4streams.csv.gz}" "$(dirname "$0")/ab.sh"
fi
