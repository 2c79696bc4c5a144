#!/usr/bin/env bash
# Issue 19 on the GPU machine, one call (~8 minutes): run from the repository root with .gpu/ staged
# (../shared/tools/gpu-pack: .gpu/bin/libgenpool_torch.so, .gpu/tests/*). No Rust, no network needed.
#
#   1. build the C++ backend against the machine's torch
#   2. the Rust GPU test of CUDA IPC of pages (gen-device's `cuda` test binary, if that is the one staged)
#   3. compatibility probes of issue 19 under native / expandable_segments / genpool: CUDA graphs (capture
#      with fresh memory, with pages pending on two streams, shared pools, the unsafe variant caught),
#      torch.compile(mode="reduce-overhead") with graph trees' checkpoints, torch.multiprocessing IPC
#      (child on PyTorch's allocator, child on genpool), MemPool
#   4. NCCL, world size 1: DDP, FSDP2, register_mem_pool (ncclMemAlloc MemPool and the mode's own)
#   5. compute-sanitizer memcheck over the graph probes under genpool, racecheck over the capture probe
#   6. training under CUDA graphs: the step captured whole, and reduce-overhead, memory and step time
# Logs under $OUT (default out/); the summary tables last. STEPS picks steps (default: all).
set -uo pipefail
STEPS_DEFAULT=build,rust,compat,dist,memcheck,train
. "$(dirname "$0")/env.sh"
t_start=$(date +%s)
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  c++ --version | head -1
  echo "kernel $(uname -r); yama ptrace_scope $(cat /proc/sys/kernel/yama/ptrace_scope 2>/dev/null || echo absent)"
  git log --oneline -1 2>/dev/null
} > "$OUT/machine.txt" 2>&1

if has build; then
  /usr/bin/time -f "backend build %e s" python3 -c '
import genpool_torch, genpool_torch.backend as b
print(b.build(genpool_torch.library_path()))' > "$OUT/build.log" 2>&1
  tail -3 "$OUT/build.log"
fi

if has rust; then
  for t in "$G"/tests/cuda*; do
    [[ -x $t ]] || continue
    echo "== $t" >> "$OUT/rust_gpu.log"
    timeout 60 "$t" --include-ignored exported_pages a_device_is_not_its_own_peer >> "$OUT/rust_gpu.log" 2>&1
    echo "exit $?" >> "$OUT/rust_gpu.log"
  done
  grep -E "^== |test result|panicked|^exit" "$OUT/rust_gpu.log" 2>/dev/null
fi

PROBES=cuda_graph_capture,cuda_graph_capture_pages_pending,cuda_graph_shared_pool,cuda_graph_unsafe_variant_is_caught,compile_reduce_overhead,compile_graph_tree_branches,ipc_share_tensor,ipc_share_tensor_genpool_child,mempool,memory_stats,empty_cache,record_stream
if has compat; then
  COMPAT_TIMEOUT=${COMPAT_TIMEOUT:-140} timeout "${T_COMPAT:-200}" python3 benches/gpu/compat.py --probes "$PROBES" --jobs "${JOBS:-10}" \
    --json "$OUT/compat.jsonl" --md "$OUT/compat.md" > "$OUT/compat.log" 2>&1
  echo "compat exit $?" >> "$OUT/compat.log"
fi

# memcheck / racecheck (under compute-sanitizer) run beside the NCCL check, which measures no time.
if has memcheck; then
  (
    timeout "${T_MEMCHECK:-90}" compute-sanitizer --tool memcheck --error-exitcode 9 python3 benches/gpu/compat.py \
      --probe cuda_graph_capture,cuda_graph_capture_pages_pending,cuda_graph_shared_pool,mempool,memory_stats \
      --mode genpool > "$OUT/memcheck.log" 2>&1
    echo "memcheck exit $?" >> "$OUT/memcheck.log"
    timeout "${T_RACECHECK:-50}" compute-sanitizer --tool racecheck --error-exitcode 9 python3 benches/gpu/compat.py \
      --probe cuda_graph_capture --mode genpool > "$OUT/racecheck.log" 2>&1
    echo "racecheck exit $?" >> "$OUT/racecheck.log"
  ) &
  sanitizers=$!
fi
if has dist; then
  for m in native genpool; do
    timeout 70 python3 benches/gpu/dist_check.py $m >> "$OUT/dist.jsonl" 2>> "$OUT/dist.err"
  done
fi
if has memcheck; then
  wait "$sanitizers"
  grep -hE "ERROR SUMMARY|RACECHECK SUMMARY|memcheck exit|racecheck exit|\"ok\"" "$OUT/memcheck.log" "$OUT/racecheck.log" | cut -c1-200
fi

if has train; then
  for w in whole compiled; do
    for m in native genpool expandable; do
      [[ $w == compiled && $m == expandable ]] && continue
      timeout 100 python3 benches/gpu/graph_train.py $m $w --steps "${TRAIN_STEPS:-100}" >> "$OUT/train.jsonl" 2>> "$OUT/train.err"
    done
  done
fi

echo "================ issue 19 on the GPU: $(($(date +%s) - t_start)) s ================"
cat "$OUT/machine.txt"
tail -5 "$OUT"/*.err 2>/dev/null | tail -30
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
def lines(name):
    p = os.path.join(out, name)
    if not os.path.exists(p):
        return []
    res = []
    for l in open(p):
        l = l.strip()
        if l.startswith("{"):
            try:
                res.append(json.loads(l))
            except ValueError:
                pass
    return res

dist = {r["mode"]: r for r in lines("dist.jsonl")}
if dist:
    print("\n## NCCL, world size 1 (dist_check.py)")
    print("| check | native | genpool | equal |")
    print("|---|---|---|---|")
    for k in ("ddp", "fsdp2", "nccl_mem_pool", "own_mem_pool"):
        n, g = dist.get("native", {}).get(k), dist.get("genpool", {}).get(k)
        print(f"| {k} | {json.dumps(n)[:90]} | {json.dumps(g)[:90]} | {'YES' if n == g and n and 'error' not in n else 'no'} |")

train = lines("train.jsonl")
if train:
    print("\n## Training under CUDA graphs (graph_train.py)")
    print("| workload | mode | median step ms | p90 ms | NVML peak MiB | max reserved MiB | losses equal native's |")
    print("|---|---|---|---|---|---|---|")
    nat = {r["workload"]: r for r in train if r["mode"] == "native"}
    for r in train:
        n = nat.get(r["workload"])
        eq = "—" if r["mode"] == "native" or not n else ("YES" if r["losses"] == n["losses"] else f"no: {r['losses'][:4]} vs {n['losses'][:4]}")
        print(f"| {r['workload']} | {r['mode']} | {r['median_step_ms']} | {r['p90_step_ms']} | {r['nvml_peak_mib']} | {r['max_reserved_mib']} | {eq} |")
PY
echo; echo "## Compatibility probes (compat.py)"
grep -v "| — | — | — |" "$OUT/compat.md" 2>/dev/null || tail -30 "$OUT/compat.log"
grep -E "^compat:|^compat exit" "$OUT/compat.log" 2>/dev/null
