# Sourced by the GPU-call scripts (benches/gpu/*_call.sh) after they set STEPS_DEFAULT: the staged folder
# ($G, default .gpu), the output folder ($OUT, default out/), the Python path to the package and the
# plug-in's library, the backend's build cache, and `has STEP` for the steps picked by $STEPS.
G=${G:-.gpu}
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" GENPOOL_LIB="$PWD/$G/bin/libgenpool_torch.so"
export GENPOOL_SHIM_DIR=/tmp/genpool_cache
STEPS=${STEPS:-$STEPS_DEFAULT}
has() { [[ ",$STEPS," == *",$1,"* ]]; }
# The carried perf (.gpu/perfb.tar.xz: the build machine's perf with its libraries and loader; the GPU
# machine has none), unpacked once; $PERF runs it through its own loader.
carried_perf() {
  mkdir -p /tmp/pb && [ -x /tmp/pb/perfb/perf ] || tar -C /tmp/pb -xJf "$G"/perfb.tar.xz
  PERF="/tmp/pb/perfb/lib/ld-linux-x86-64.so.2 --library-path /tmp/pb/perfb/lib /tmp/pb/perfb/perf"
}
# The plug-in's entry points with two builds of it loaded side by side in one process, taking turns pass
# by pass (benches/host/abi_replay.c; hosts drift): `abi_side_by_side OLD.so NEW.so TRACE...` (trace
# names under benches/traces), two rounds each, 9 passes; results to $OUT/abi.txt.
abi_side_by_side() {
  local old=$1 new=$2 t r
  shift 2
  ${CC:-cc} -O2 -o /tmp/abi_replay benches/host/abi_replay.c -ldl 2> "$OUT/abi.err" || gcc -O2 -o /tmp/abi_replay benches/host/abi_replay.c -ldl 2>> "$OUT/abi.err"
  for t in "$@"; do
    python3 benches/host/ops.py benches/traces/$t.csv.gz /tmp/$t.ops
    for r in 1 2; do
      echo "$t round $r" >> "$OUT/abi.txt"
      GENPOOL_DEVICE=cuda timeout 60 /tmp/abi_replay /tmp/$t.ops 9 "$PWD/$G/bin/$old" "$PWD/$G/bin/$new" >> "$OUT/abi.txt" 2>> "$OUT/abi.err"
    done
  done
}
# JSON lines on stdin tagged with their build and round: `... | tag_runs NAME ROUND` (ab_table.py reads them).
tag_runs() {
  sed "s/^{/{\"v\":\"$1\",\"round\":$2,/"
}
# The engine's CUDA replay of two builds taking turns trace by trace (hosts drift): `replay_turns ROUNDS
# "TRACE..." NAME1=BIN1 NAME2=BIN2` (trace names under benches/traces, or paths without `.csv.gz` — a
# `genpool synth` shape, say; binaries under $G/bin), 3 passes a run, one JSON line a run tagged with its
# build ("v") and round, to $OUT/cli.jsonl (ab_table.py reads it).
replay_turns() {
  local rounds=$1 traces=$2 r t f vb
  shift 2
  for r in $(seq "$rounds"); do for t in $traces; do for vb in "$@"; do
    f=benches/traces/$t.csv.gz; [[ $t == */* ]] && f=$t.csv.gz
    timeout 40 "$G"/bin/"${vb#*=}" replay "$f" --device cuda --passes 3 --json 2>> "$OUT/cli.err" |
      tag_runs "${vb%%=*}" "$r" >> "$OUT/cli.jsonl"
  done; done; done
}
# Every staged CUDA test binary ($G/tests, benches/gpu/pack_cuda_tests.sh), ignored tests included, one
# thread; logs and each binary's exit status to $OUT/cuda_tests.log.
cuda_tests() {
  local t
  for t in "$G"/tests/*; do
    echo "== $(basename "$t")" >> "$OUT/cuda_tests.log"
    timeout 200 "$t" --include-ignored --test-threads 1 >> "$OUT/cuda_tests.log" 2>&1
    echo "$(basename "$t") rc=$?" >> "$OUT/cuda_tests.log"
  done
}
# The engine's own CUDA replay of the ten traces ($PASSES passes, default 5), one JSON line each to
# $OUT/cli.jsonl (benches/gpu/cli_table.py prints them).
engine_replay_all() {
  local t
  for t in resnet50_train gpt2_generate_kv vit_train_varres gpt2m_train_varlen bert_finetune_varlen gpt2_train_fixed llama_ckpt_varlen resnet_copy_overlap gpt2_prefetch bert_serve_4streams; do
    timeout 90 "$G"/bin/genpool replay benches/traces/$t.csv.gz --device cuda --passes "${PASSES:-5}" --json 2>> "$OUT/cli.err" >> "$OUT/cli.jsonl"
  done
}
# The GPU, its driver, the cores and torch's version, to $OUT/machine.txt.
machine_info() {
  { nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; python3 -c "import torch; print(torch.__version__)"; } > "$OUT/machine.txt" 2>&1
}
# What a session's call does first: the machine, then every CUDA test binary when STEPS has `tests`.
begin_call() {
  machine_info
  if has tests; then cuda_tests; fi
}
# What a call's tables start with: the machine, the CUDA tests' results, the compatibility suite's
# failures and differences, the engine's replay table (each where its step ran).
begin_tables() {
  cat "$OUT/machine.txt"
  grep -E "test result|rc=|FAILED|panicked" "$OUT/cuda_tests.log" 2>/dev/null
  grep -E "^\| |compat:" "$OUT/compat.log" 2>/dev/null | grep -E "fail|REGRESSION|compat:|differ|: native" | head -40
  python3 benches/gpu/cli_table.py
  tail -3 "$OUT/cli.err" 2>/dev/null
}
# The compatibility suite (benches/gpu/compat.py) under $COMPAT_MODES, else the modes given, to
# $OUT/compat.jsonl, compat.md and compat.log.
compat_suite() {
  timeout 420 python3 benches/gpu/compat.py --modes "${COMPAT_MODES:-$1}" --jobs 8 --json "$OUT/compat.jsonl" --md "$OUT/compat.md" > "$OUT/compat.log" 2>&1
}
