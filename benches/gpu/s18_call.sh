#!/usr/bin/env bash
# Session 18 on the GPU machine (.gpu/ staged by gpu-pack, then benches/gpu/pack_cuda_tests.sh: every
# CUDA test target under a name of its own). Steps (STEPS, comma-separated; all by default):
#   tests  every CUDA test binary of the workspace (gen-device's two, gen-stream's, genpool's two);
#   compat the compatibility suite (benches/gpu/compat.py, 37 probes with session 18's eleven everyday
#          training paths) under COMPAT_MODES (default native,expandable,genpool);
#   cli    the engine's own CUDA replay of the ten traces (PASSES, default 5);
#   torch  torch_replay.py (PyTorch's entry points) native / expandable / genpool on TORCH_TRACES;
#   streams the pool_streams example (small blocks on a stream from a pool of 8 or 32) on the GPU,
#          bin/pool_streams-base (before the slab's batched overflow) and bin/pool_streams taking turns.
# Logs under $OUT; tables last.
set -uo pipefail
STEPS_DEFAULT=tests,compat,cli
. "$(dirname "$0")/env.sh"
begin_call
has compat && compat_suite native,expandable,genpool
has cli && engine_replay_all
if has streams; then
  for r in 1 2 3; do for n in 8 32; do for b in pool_streams-base pool_streams; do
    echo -n "$b round $r: " >> "$OUT/streams.txt"
    GENPOOL_DEVICE=cuda timeout 60 "$G"/bin/$b $n 3000 >> "$OUT/streams.txt" 2>&1
  done; done; done
fi
if has torch; then
  tr=(); for t in ${TORCH_TRACES:-resnet50_train gpt2_generate_kv gpt2_train_fixed gpt2_prefetch}; do tr+=(benches/traces/$t.csv.gz); done
  timeout 300 python3 benches/gpu/torch_replay.py "${tr[@]}" --modes native,expandable,genpool --reps "${REPS:-4}" > "$OUT/torch.jsonl" 2> "$OUT/torch.err"
fi
begin_tables
cat "$OUT/streams.txt" 2>/dev/null
tail -20 "$OUT/torch.jsonl" 2>/dev/null | cut -c1-300
