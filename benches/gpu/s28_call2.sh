#!/usr/bin/env bash
# Session 28's second look at busy serving streams (record_stream_overlap.py's `serve4`): genpool's
# default (the streams after the first share one arena) against per-stream arenas and the first
# stream's arena for all, beside PyTorch's native allocator. Run with `carry: [".gpu"]`.
set -uo pipefail
STEPS_DEFAULT=rs
. "$(dirname "$0")/env.sh"
machine_info
timeout 300 python3 benches/gpu/record_stream_overlap.py --reps 3 \
  --modes "${RS_MODES:-native,genpool,genpool:experimental.busy_freers:pass,genpool:experimental.stream_arenas:own}" \
  > "$OUT/rs2.jsonl" 2> "$OUT/rs2.err"
echo "rs rc=$?"; cat "$OUT/machine.txt" "$OUT/rs2.jsonl"; tail -3 "$OUT/rs2.err"
