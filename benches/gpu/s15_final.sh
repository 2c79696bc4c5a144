#!/usr/bin/env bash
# Session 15's last call: genpool's CUDA tests with this build; the plug-in's entry points through
# benches/host/abi_replay.c on the GPU, the session's start (bin/libgenpool_torch-s14.so) and this build
# (bin/libgenpool_torch.so) loaded side by side in one process and taking turns pass by pass (hosts
# drift); PyTorch's entry points (torch_replay.py) with this build beside native and expandable_segments;
# the engine's own CUDA replay. Logs under $OUT; tables last. Step torch_ab (not a default) adds
# PyTorch's entry points with the session's start and then this build again, genpool alone: call 3 ran
# STEPS=torch,torch_ab,cli (docs/results/s15/call3).
set -uo pipefail
STEPS_DEFAULT=tests,abi,torch,cli
. "$(dirname "$0")/env.sh"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; } > "$OUT/machine.txt" 2>&1
T="gpt2_generate_kv resnet50_train gpt2_train_fixed"
if has tests; then
  timeout 200 "$G"/tests/cuda --include-ignored --test-threads 1 > "$OUT/cuda_tests.log" 2>&1
  echo "cuda tests rc=$?" >> "$OUT/cuda_tests.log"
fi
if has abi; then
  abi_side_by_side libgenpool_torch-s14.so libgenpool_torch.so $T
fi
tr=(benches/traces/bert_serve_4streams.csv.gz benches/traces/gpt2_generate_kv.csv.gz benches/traces/resnet50_train.csv.gz benches/traces/gpt2_train_fixed.csv.gz)
if has torch; then
  timeout 220 python3 benches/gpu/torch_replay.py "${tr[@]}" --modes native,expandable,genpool --reps ${REPS:-6} > "$OUT/torch.jsonl" 2> "$OUT/torch.err"
fi
if has torch_ab; then
  GENPOOL_LIB="$PWD/$G/bin/libgenpool_torch-s14.so" timeout 100 python3 benches/gpu/torch_replay.py "${tr[@]}" --modes genpool --reps ${REPS:-6} > "$OUT/torch_s14.jsonl" 2>> "$OUT/torch.err"
  timeout 100 python3 benches/gpu/torch_replay.py "${tr[@]}" --modes genpool --reps ${REPS:-6} > "$OUT/torch_new2.jsonl" 2>> "$OUT/torch.err"
fi
if has cli; then
  for r in 1 2; do for b in genpool-s14 genpool; do
    timeout 60 "$G"/bin/$b replay "${tr[@]}" benches/traces/gpt2_prefetch.csv.gz --device cuda --passes 5 --json 2>> "$OUT/cli.err" |
      sed "s/^{/{\"bin\":\"$b\",\"round\":$r,/" >> "$OUT/cli.jsonl"
  done; done
fi
cat "$OUT/machine.txt"
grep -E "test result|rc=|FAILED|panicked" "$OUT/cuda_tests.log" 2>/dev/null
cat "$OUT/abi.txt" 2>/dev/null | sed "s#$PWD/$G/bin/##"
python3 - <<'PY'
import json, os
O = os.environ.get("OUT", "out")
for f in ("torch.jsonl", "torch_s14.jsonl", "torch_new2.jsonl"):
    try:
        for l in open(f"{O}/{f}"):
            d = json.loads(l)
            print(f[:-6].ljust(10), d["trace"][:20].ljust(20), d["mode"].ljust(10), d.get("ratio"), d.get("ns_per_op"))
    except FileNotFoundError:
        pass
try:
    for l in open(f"{O}/cli.jsonl"):
        d = json.loads(l); w = d.get("warm_calls", {})
        print("cli", d["round"], d["bin"].ljust(11), d["trace"][:20].ljust(20), round(d["ratio"], 4), round(d["ns_per_op"]), [round(x) for x in d["ns_per_op_passes"]], "maps", w.get("maps"), "syncs", w.get("device_syncs"))
except FileNotFoundError:
    pass
PY
tail -3 "$OUT/abi.err" "$OUT/torch.err" "$OUT/cli.err" 2>/dev/null
