#!/usr/bin/env bash
# Session 26, one call: where a page move's time goes (`device_costs`: map and unmap timed apart, an
# unmap with work queued, a map while another thread unmaps), then the stamps kept piece by piece
# (`new`) against one stamp an extent (`base`, the session's start 9a0ad31), taking turns (ab.sh, 2
# rounds: the session's device time was short): the engine's CUDA replay of bert_serve_4streams, serve8
# and crossfree, PyTorch's entry points on serve8 and bert_serve_4streams.
set -uo pipefail
STEPS_DEFAULT=ab
. "$(dirname "$0")/env.sh"
"$G"/bin/device_costs cuda 2000 > "$OUT/device_costs.txt" 2>&1
ROUNDS=${ROUNDS:-2} \
REPLAY="bert_serve_4streams /tmp/synth/serve8 /tmp/synth/crossfree" \
TORCH="/tmp/synth/serve8.csv.gz benches/traces/bert_serve_4streams.csv.gz" \
  "$(dirname "$0")/ab.sh"
tail -20 "$OUT/device_costs.txt"
