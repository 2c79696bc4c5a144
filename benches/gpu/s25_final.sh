#!/usr/bin/env bash
# Session 25's closing check at HEAD: every CUDA test binary, the compatibility suite under native,
# expandable and genpool, then the engine's CUDA replay of the ten traces, 5 passes. Stage first:
# ../shared/tools/gpu-pack, then benches/gpu/pack_cuda_tests.sh; run with `carry: [".gpu"]`. Logs under
# $OUT; tables last.
set -uo pipefail
STEPS_DEFAULT=tests,compat,replay
. "$(dirname "$0")/env.sh"
begin_call
has compat && compat_suite native,expandable,genpool
has replay && engine_replay_all
begin_tables
tail -2 "$OUT/compat.log" 2>/dev/null
