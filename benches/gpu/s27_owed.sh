#!/usr/bin/env bash
# What session 27 could not run on a GPU (its device time was spent): every CUDA test binary and the
# compatibility suite under genpool at the session's end (the page-move questions, `fab83ac`, and what
# followed), then — with a base staged (.gpu/bin/genpool_base, .gpu/base/libgenpool_torch.so built at
# `18326b3`, the questions before that follow-up) — the two side by side on the traces whose page moves
# now ask first: bert_serve_4streams, gpt2_prefetch, resnet_copy_overlap (engine replay) and bert_serve
# through PyTorch's entry points (ab.sh, 3 rounds). Stage first: ../shared/tools/gpu-pack, then
# benches/gpu/pack_cuda_tests.sh, then the base; run with `carry: [".gpu"]`.
set -uo pipefail
STEPS_DEFAULT=tests,compat,ab
. "$(dirname "$0")/env.sh"
machine_info
has tests && cuda_tests && grep -E "rc=" "$OUT/cuda_tests.log"
has compat && compat_suite genpool && tail -1 "$OUT/compat.log"
if has ab && [ -x "$G/bin/genpool_base" ]; then
  ROUNDS=${ROUNDS:-3} REPLAY="${REPLAY:-bert_serve_4streams gpt2_prefetch resnet_copy_overlap}" \
  TORCH="${TORCH:-benches/traces/bert_serve_4streams.csv.gz}" "$(dirname "$0")/ab.sh"
fi
