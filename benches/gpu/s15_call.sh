#!/usr/bin/env bash
# Session 15: PyTorch's entry points (torch_replay.py) with the session's start (bin/libgenpool_torch-s14.so,
# 0edcc6b) and this build (bin/libgenpool_torch.so) beside native and expandable_segments, and the engine's
# own CUDA replay, start (bin/genpool-s14) and now (bin/genpool), interleaved, on one machine. Logs under
# $OUT; the table last.
set -uo pipefail
STEPS_DEFAULT=torch,cli
. "$(dirname "$0")/env.sh"
{ nvidia-smi --query-gpu=name --format=csv,noheader; nproc; } > "$OUT/machine.txt" 2>&1
tr=(benches/traces/bert_serve_4streams.csv.gz benches/traces/gpt2_generate_kv.csv.gz benches/traces/resnet50_train.csv.gz benches/traces/gpt2_train_fixed.csv.gz)
if has torch; then
  timeout 200 python3 benches/gpu/torch_replay.py "${tr[@]}" --modes native,expandable,genpool --reps ${REPS:-6} > "$OUT/torch.jsonl" 2> "$OUT/torch.err"
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
tail -3 "$OUT/torch.err" "$OUT/cli.err" 2>/dev/null
