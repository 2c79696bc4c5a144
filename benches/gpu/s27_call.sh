#!/usr/bin/env bash
# Session 27: every CUDA test binary (benches/gpu/pack_cuda_tests.sh), then the session's start (`base`,
# a56dae5) against the fence and stream questions (`new`: a stream asks whether a fence completed, or the
# freeing stream is idle, before waiting), taking turns (ab.sh, $ROUNDS rounds, default 3): the engine's CUDA replay of serve8,
# bert_serve_4streams and crossfree; PyTorch's entry points on serve8 and bert_serve.
set -uo pipefail
STEPS_DEFAULT=tests
. "$(dirname "$0")/env.sh"
has tests && cuda_tests && grep -E "rc=" "$OUT/cuda_tests.log"
ROUNDS=${ROUNDS:-3} \
REPLAY="${REPLAY:-/tmp/synth/serve8 bert_serve_4streams /tmp/synth/crossfree}" \
TORCH="${TORCH:-/tmp/synth/serve8.csv.gz benches/traces/bert_serve_4streams.csv.gz}" \
  "$(dirname "$0")/ab.sh"
