#!/usr/bin/env bash
# Second GPU call for the PyTorch backend: the compatibility suite, the thread benchmark, conv-net training
# with cudnn.benchmark under three allocators, and compute-sanitizer memcheck over probes under genpool.
# Run from the repository root with .gpu/ staged (see torch_backend_call.sh). Logs under $OUT.
set -uo pipefail
G=${G:-.gpu}
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" GENPOOL_LIB="$PWD/$G/bin/libgenpool_torch.so"
export GENPOOL_SHIM_DIR=/tmp/genpool_cache
python3 -c 'import genpool_torch, genpool_torch.backend as b; print(b.build(genpool_torch.library_path()))' > "$OUT/build.log" 2>&1
COMPAT_TIMEOUT=150 timeout 210 python3 benches/gpu/compat.py --jobs 8 --json "$OUT/compat.jsonl" --md "$OUT/compat.md" --keep /tmp > "$OUT/compat.log" 2>&1
timeout 80 python3 benches/gpu/torch_threads.py --modes native,genpool --pairs 100000 > "$OUT/threads.jsonl" 2> "$OUT/threads.err"
for m in native expandable genpool; do
  timeout 45 python3 benches/gpu/train_conv.py $m --steps 30 >> "$OUT/train.jsonl" 2>> "$OUT/train.err"
done
timeout 130 compute-sanitizer --tool memcheck --error-exitcode 9 python3 benches/gpu/compat.py \
  --probe memory_stats,record_stream,empty_cache,memory_history_snapshot,cudnn_benchmark,cuda_graph_capture,mempool,out_of_memory \
  --mode genpool > "$OUT/memcheck.log" 2>&1; echo "memcheck exit $?" >> "$OUT/memcheck.log"
tail -4 "$OUT"/build.log "$OUT"/threads.err "$OUT"/train.err 2>/dev/null | tail -20
grep -E "ERROR SUMMARY|memcheck exit|\"ok\"" "$OUT/memcheck.log" | cut -c1-300
cat "$OUT/threads.jsonl" "$OUT/train.jsonl"
cat "$OUT/compat.md" 2>/dev/null || grep -c . "$OUT/compat.jsonl"
tail -1 "$OUT/compat.log"
