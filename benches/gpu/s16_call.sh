#!/usr/bin/env bash
# Session 16 on the GPU machine (.gpu/ staged by gpu-pack: bin/genpool, bin/libgenpool_torch.so,
# bin/threads-new, tests/cuda — this session's build — and bin/genpool-s15, bin/libgenpool_torch-s15.so —
# its start, 72e379b). Steps (STEPS, comma-separated; all by default):
#   tests  genpool's CUDA tests with this build;
#   cli    the engine's own CUDA replay, session start and end taking turns trace by trace (hosts drift),
#          ROUNDS rounds (default 3), single-stream traces and the two multi-stream ones;
#   abi    the plug-in's entry points (benches/host/abi_replay.c), both builds loaded side by side in
#          one process, taking turns pass by pass;
#   torch  PyTorch's entry points (torch_replay.py): native, expandable_segments and this build;
#   threads the short-lived path at 1 and 16 threads (threads example, engine, own frees).
# Logs under $OUT; tables last.
set -uo pipefail
STEPS_DEFAULT=tests,cli,abi,torch,threads
. "$(dirname "$0")/env.sh"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; } > "$OUT/machine.txt" 2>&1
if has tests; then
  timeout 200 "$G"/tests/cuda --include-ignored --test-threads 1 > "$OUT/cuda_tests.log" 2>&1
  echo "cuda tests rc=$?" >> "$OUT/cuda_tests.log"
fi
cli_traces="resnet50_train gpt2_generate_kv gpt2_train_fixed llama_ckpt_varlen gpt2_prefetch bert_serve_4streams"
if has cli; then
  for r in $(seq ${ROUNDS:-3}); do for t in $cli_traces; do for b in genpool-s15 genpool; do
    timeout 60 "$G"/bin/$b replay benches/traces/$t.csv.gz --device cuda --passes 5 --json 2>> "$OUT/cli.err" |
      sed "s/^{/{\"bin\":\"$b\",\"round\":$r,/" >> "$OUT/cli.jsonl"
  done; done; done
fi
if has abi; then
  abi_side_by_side libgenpool_torch-s15.so libgenpool_torch.so gpt2_generate_kv resnet50_train gpt2_train_fixed
fi
if has torch; then
  tr=(benches/traces/bert_serve_4streams.csv.gz benches/traces/gpt2_generate_kv.csv.gz benches/traces/resnet50_train.csv.gz benches/traces/gpt2_train_fixed.csv.gz)
  timeout 200 python3 benches/gpu/torch_replay.py "${tr[@]}" --modes native,expandable,genpool --reps ${REPS:-6} > "$OUT/torch.jsonl" 2> "$OUT/torch.err"
fi
if has threads; then
  GENPOOL_THREADS_MODE=pool GENPOOL_HANDOFF=0 timeout 60 "$G"/bin/threads-new ${OPS:-2000000} 1 16 > "$OUT/threads.txt" 2>&1
fi
cat "$OUT/machine.txt"
grep -E "test result|rc=|FAILED|panicked" "$OUT/cuda_tests.log" 2>/dev/null
grep -E "threads  1:|threads 16:" "$OUT/threads.txt" 2>/dev/null
cat "$OUT/abi.txt" 2>/dev/null | sed "s#$PWD/$G/bin/##"
python3 - <<'PY'
import json, os, statistics, collections
O = os.environ.get("OUT", "out")
try:
    for l in open(f"{O}/torch.jsonl"):
        d = json.loads(l)
        print("torch", d["trace"][:20].ljust(20), d["mode"].ljust(10), d.get("ratio"), d.get("ns_per_op"))
except FileNotFoundError:
    pass
rows = collections.defaultdict(list)
try:
    for l in open(f"{O}/cli.jsonl"):
        try: d = json.loads(l)
        except ValueError: continue
        w = d.get("warm_calls", {})
        rows[(d["trace"][:20], d["bin"])].append((round(d["ns_per_op"]), round(d["ratio"], 4), w.get("maps"), w.get("device_syncs")))
except FileNotFoundError:
    pass
for k in sorted(rows):
    v = [x[0] for x in rows[k]]
    print("cli", k[0].ljust(20), k[1].ljust(11), "rounds", v, "median", statistics.median(v), "ratio", rows[k][0][1], "maps", rows[k][0][2], "syncs", rows[k][0][3])
PY
tail -3 "$OUT/abi.err" "$OUT/torch.err" "$OUT/cli.err" 2>/dev/null
