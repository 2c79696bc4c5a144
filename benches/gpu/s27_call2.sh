#!/usr/bin/env bash
# Session 27, second call: what a stream question costs (`device_costs`: cuStreamQuery alone and right
# after a map and an unmap, against the fence and wait it replaces), then the session's start against
# the questions on the cross-stream shape that ran slower with them in the first call (ab.sh, engine
# replay only, 3 rounds).
set -uo pipefail
STEPS_DEFAULT=ab
. "$(dirname "$0")/env.sh"
"$G"/bin/device_costs cuda 2000 > "$OUT/device_costs.txt" 2>&1
ROUNDS=${ROUNDS:-3} REPLAY="${REPLAY:-/tmp/synth/crossfree /tmp/synth/serve8}" TORCH="${TORCH:-}" \
  "$(dirname "$0")/ab.sh"
head -12 "$OUT/device_costs.txt"
