#!/usr/bin/env bash
# Session 10: compute-sanitizer over what the session changed — memcheck over the CUDA tests of blocks
# handed between streams (the engine alone) and over the PyTorch probes that hand blocks between streams
# or capture (record_stream, the graph probes, MemPool), racecheck over the capture probe. Run from the
# repository root with .gpu/ staged (bin/libgenpool_torch.so, tests/cuda).
set -uo pipefail
STEPS_DEFAULT=build,rust,probes
. "$(dirname "$0")/env.sh"
if has build; then
  python3 -c 'import genpool_torch, genpool_torch.backend as b; print(b.build(genpool_torch.library_path()))' > "$OUT/build.log" 2>&1
  tail -2 "$OUT/build.log"
fi
if has rust; then
  GENPOOL_UNDER_SANITIZER=1 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 "$G"/tests/cuda \
    --include-ignored --test-threads 1 foreign_free cross_stream_reuse_waits > "$OUT/memcheck_rust.log" 2>&1
  echo "memcheck (rust) exit $?" >> "$OUT/memcheck_rust.log"
  grep -E "test result|ERROR SUMMARY|exit|A got|B got|NOTE" "$OUT/memcheck_rust.log"
fi
if has probes; then
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 python3 benches/gpu/compat.py \
    --probe record_stream,cuda_graph_capture,cuda_graph_capture_pages_pending,cuda_graph_shared_pool,mempool \
    --mode genpool > "$OUT/memcheck_probes.log" 2>&1
  echo "memcheck (probes) exit $?" >> "$OUT/memcheck_probes.log"
  timeout 60 compute-sanitizer --tool racecheck --error-exitcode 9 python3 benches/gpu/compat.py \
    --probe cuda_graph_capture --mode genpool > "$OUT/racecheck.log" 2>&1
  echo "racecheck exit $?" >> "$OUT/racecheck.log"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|exit|pass|fail" "$OUT/memcheck_probes.log" "$OUT/racecheck.log" | tail -20
fi
