#!/usr/bin/env bash
# The side-by-side replay on a GPU machine, with the genpool binary staged in $G/bin (default .gpu/bin;
# `cargo build --release -p genpool-cli` and copy target/release/genpool there, or set G):
# genpool (CUDA device, with and without call sites) and PyTorch's allocators (benches/gpu/torch_replay.py:
# native, expandable_segments, cudaMallocAsync; RMM pool and arena when wheels are in .gpu/wheels), on the
# same traces, in one run. Logs and JSON lines go to $OUT (default ./out); the table is printed last.
set -uo pipefail
G=${G:-.gpu}
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# The traces: $TRACES (space-separated paths), else the four original ones bundled in benches/traces.
R="$(cd "$(dirname "$0")/../.." && pwd)"
if [[ -n ${TRACES:-} ]]; then
  read -ra traces <<< "$TRACES"
else
  traces=("$R"/benches/traces/{gpt2_generate_kv,gpt2_train_fixed,gpt2m_train_varlen,resnet50_train}.csv.gz)
fi
passes=${PASSES:-3}
reps=${REPS:-3}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; python3 -c 'import torch; print("torch", torch.__version__)'; } > "$OUT/machine.txt" 2>&1
timeout "${T_GENPOOL:-240}" "$G"/bin/genpool replay "${traces[@]}" --device cuda --passes "$passes" --json > "$OUT/genpool.jsonl" 2> "$OUT/genpool.err"
[ "${NOSITE:-1}" = 1 ] && timeout 120 "$G"/bin/genpool replay "${traces[@]}" --device cuda --passes 2 --json --ignore-site > "$OUT/genpool_nosite.jsonl" 2>> "$OUT/genpool.err"
timeout "${T_TORCH:-300}" python3 "$R"/benches/gpu/torch_replay.py "${traces[@]}" --modes native,expandable,async --reps "$reps" > "$OUT/torch.jsonl" 2> "$OUT/torch.err"
if ls "$G"/wheels/*.whl > /dev/null 2>&1 && [ "${RMM:-1}" = 1 ]; then
  pip install -q --no-index --no-deps --target /tmp/rmm "$G"/wheels/*.whl > "$OUT/rmm_install.log" 2>&1
  PYTHONPATH=/tmp/rmm timeout "${RMM_TIMEOUT:-240}" python3 "$R"/benches/gpu/torch_replay.py "${traces[@]}" --modes rmm-pool,rmm-arena --reps "$reps" > "$OUT/rmm.jsonl" 2> "$OUT/rmm.err"
fi
cat "$OUT/machine.txt"
python3 "$(dirname "$0")/side_by_side.py" "$OUT"/genpool.jsonl "$OUT"/genpool_nosite.jsonl "$OUT"/torch.jsonl "$OUT"/rmm.jsonl | tee "$OUT/table.md"
