#!/usr/bin/env bash
# Session 14's last call: PyTorch's entry points side by side with this session's end (bin/libgenpool_torch.so)
# and its start (bin/libgenpool_torch-s13.so, 64bcaef) on one machine, and the engine's own replay of the
# same traces. Logs under $OUT; the table last.
set -uo pipefail
STEPS_DEFAULT=x
. "$(dirname "$0")/env.sh"
{ nvidia-smi --query-gpu=name --format=csv,noheader; nproc; } > "$OUT/machine.txt" 2>&1
tr=(benches/traces/bert_serve_4streams.csv.gz benches/traces/gpt2_generate_kv.csv.gz benches/traces/resnet50_train.csv.gz benches/traces/gpt2_train_fixed.csv.gz)
timeout 150 python3 benches/gpu/torch_replay.py "${tr[@]}" --modes native,expandable,genpool --reps 6 > "$OUT/torch.jsonl" 2> "$OUT/torch.err"
GENPOOL_LIB="$PWD/$G/bin/libgenpool_torch-s13.so" timeout 80 python3 benches/gpu/torch_replay.py "${tr[@]}" --modes genpool --reps 6 > "$OUT/torch_s13.jsonl" 2>> "$OUT/torch.err"
timeout 40 "$G"/bin/genpool replay "${tr[@]}" --device cuda --passes 5 --json > "$OUT/cli.jsonl" 2> "$OUT/cli.err"
cat "$OUT/machine.txt"
python3 - <<'PY'
import json, os
O = os.environ["OUT"]
for f in ("torch.jsonl", "torch_s13.jsonl"):
    try:
        for l in open(f"{O}/{f}"):
            d = json.loads(l)
            print(f[:-6].ljust(9), d["trace"][:20].ljust(20), d["mode"].ljust(10), d.get("ratio"), d.get("ns_per_op"))
    except FileNotFoundError:
        pass
try:
    for l in open(f"{O}/cli.jsonl"):
        d = json.loads(l); print("cli      ", d["trace"][:20].ljust(20), round(d["ratio"], 4), round(d["ns_per_op"]), [round(x) for x in d["ns_per_op_passes"]])
except FileNotFoundError:
    pass
PY
tail -3 "$OUT/torch.err"
