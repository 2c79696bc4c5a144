#!/usr/bin/env bash
# Session 17 on the GPU machine (.gpu/ staged by gpu-pack: bin/genpool, bin/libgenpool_torch.so,
# tests/cuda — this session's build). Steps (STEPS, comma-separated; all by default):
#   tests  genpool's CUDA tests (the fence queue now records its newest fence again when full);
#   compat the compatibility suite (benches/gpu/compat.py) under COMPAT_MODES (default genpool);
#   multi  benches/gpu/multi_gpu.py under native, expandable and genpool (needs two GPUs: on one, every
#          probe must fail with "two GPUs needed" under every mode — the harness checked, nothing else);
#   cli    the engine's own CUDA replay of six traces, one run each (ratio, ns/op, warm driver calls).
# Logs under $OUT; tables last.
set -uo pipefail
STEPS_DEFAULT=tests,compat,multi,cli
. "$(dirname "$0")/env.sh"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; python3 -c "import torch; print(torch.__version__)"; } > "$OUT/machine.txt" 2>&1
if has tests; then
  timeout 200 "$G"/tests/cuda --include-ignored --test-threads 1 > "$OUT/cuda_tests.log" 2>&1
  echo "cuda tests rc=$?" >> "$OUT/cuda_tests.log"
fi
if has compat; then
  timeout 300 python3 benches/gpu/compat.py --modes "${COMPAT_MODES:-genpool}" --jobs 8 --json "$OUT/compat.jsonl" --md "$OUT/compat.md" > "$OUT/compat.log" 2>&1
fi
if has multi; then
  timeout 200 python3 benches/gpu/multi_gpu.py --json "$OUT/multi.jsonl" > "$OUT/multi.log" 2>&1
fi
if has cli; then
  for t in resnet50_train gpt2_generate_kv gpt2_train_fixed llama_ckpt_varlen gpt2_prefetch bert_serve_4streams; do
    timeout 60 "$G"/bin/genpool replay benches/traces/$t.csv.gz --device cuda --passes 5 --json 2>> "$OUT/cli.err" >> "$OUT/cli.jsonl"
  done
fi
cat "$OUT/machine.txt"
grep -E "test result|rc=|FAILED|panicked" "$OUT/cuda_tests.log" 2>/dev/null
tail -3 "$OUT/compat.log" 2>/dev/null
grep -E "^\||multi_gpu:" "$OUT/multi.log" 2>/dev/null
python3 benches/gpu/cli_table.py
tail -3 "$OUT/cli.err" 2>/dev/null
