#!/usr/bin/env bash
# What session 21 owes the GPU (every start after its first two calls was refused). Stage first, on the
# build machine: ../shared/tools/gpu-pack, benches/gpu/pack_cuda_tests.sh, benches/gpu/pack_perf.sh,
# then copy target/release/examples/threads into .gpu/bin; run here with `carry: [".gpu"]`.
# Steps (STEPS, comma-separated; default train,prof,threads):
#   train   training step time, native vs genpool side by side one step at a time, both start orders
#           (examples/ab_steps.py; TRAIN_MODELS, default gpt2,llama-ckpt,resnet50; TRAIN_STEPS, default 60)
#           — last measured in session 7, before the C++ backend;
#   mem     peak device memory of the same models under native, expandable_segments and genpool
#           (examples/bench_train.py, NVML per process; MEM_MODELS, default gpt2,llama-ckpt);
#   prof    where a call through PyTorch's entry points spends the ~50 ns it adds to the engine's own
#           replay (benches/gpu/s15_prof.sh on gpt2_generate_kv with the carried perf) — the lead for
#           2x expandable_segments on generate_kv and gpt2_prefetch;
#   threads the threads example with 512 KiB - 4 MiB blocks at 1, 4 and 16 threads, its hand-off queues
#           bounded in bytes since session 21.
# Logs under $OUT; tables last.
set -uo pipefail
STEPS_DEFAULT=train,prof,threads
. "$(dirname "$0")/env.sh"
machine_info
if has threads; then
  GENPOOL_THREADS_SCALE=1024 timeout 60 "$G"/bin/threads 100000 1 4 16 > "$OUT/threads.txt" 2>&1
fi
if has train; then
  timeout 480 python3 examples/ab_steps.py --models "${TRAIN_MODELS:-gpt2,llama-ckpt,resnet50}" \
    --steps "${TRAIN_STEPS:-60}" --warmup 10 --timeout 150 --out "$OUT/ab" > "$OUT/ab.log" 2>&1
fi
if has mem; then
  timeout 420 python3 examples/bench_train.py --models "${MEM_MODELS:-gpt2,llama-ckpt}" \
    --allocators native,expandable,genpool --budget-s 400 --out "$OUT/mem" > "$OUT/mem.log" 2>&1
fi
if has prof; then
  mkdir -p "$OUT/prof" && OUT="$OUT/prof" timeout 300 bash benches/gpu/s15_prof.sh > "$OUT/prof.log" 2>&1
fi
cat "$OUT/machine.txt"
cat "$OUT/threads.txt" 2>/dev/null
cat "$OUT/ab/ab.md" 2>/dev/null
cat "$OUT/mem/table.md" 2>/dev/null
head -25 "$OUT/prof/torch.sym.txt" "$OUT/prof/cli.sym.txt" 2>/dev/null
