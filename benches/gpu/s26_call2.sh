#!/usr/bin/env bash
# Session 26, second call: every CUDA test binary (benches/gpu/pack_cuda_tests.sh), then the session's
# start (`base`, 9a0ad31) against its end (`new`: stamps piece by piece, old mappings cleared one unmap a
# run), taking turns (ab.sh, 2 rounds): the engine's CUDA replay of bert_serve_4streams,
# gpt2_train_fixed, random_sizes and kvgrow, PyTorch's entry points on random_sizes and bert_serve.
set -uo pipefail
STEPS_DEFAULT=tests
. "$(dirname "$0")/env.sh"
cuda_tests
grep -E "rc=" "$OUT/cuda_tests.log"
ROUNDS=${ROUNDS:-2} \
REPLAY="bert_serve_4streams gpt2_train_fixed /tmp/synth/random_sizes /tmp/synth/kvgrow" \
TORCH="/tmp/synth/random_sizes.csv.gz benches/traces/bert_serve_4streams.csv.gz" \
  "$(dirname "$0")/ab.sh"
