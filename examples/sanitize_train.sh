#!/usr/bin/env bash
# Three training steps of a tiny GPT-2 with genpool as PyTorch's allocator, under
# `compute-sanitizer --tool memcheck`; prints the sanitizer's error summary (and the first errors).
#
# usage (repository root, on the GPU machine):
#   GENPOOL_LIB=.gpu/bin/libgenpool_torch.so examples/sanitize_train.sh [OUTDIR]
# environment:
#   ALLOCATOR=genpool      native | expandable | async | genpool (native is the control run)
#   TOOL=memcheck          any compute-sanitizer tool (racecheck, initcheck, synccheck ...)
#   STEPS=3                training steps
#   SANITIZER_ARGS=        more compute-sanitizer options, e.g. "--leak-check full"
# Exit status: 0 when the sanitizer reports 0 errors, 1 when it reports errors, 2 when it did not run
# to the end (no summary). The full sanitizer output is kept in OUTDIR/sanitize_<allocator>.log.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-sanitize_out}
alloc=${ALLOCATOR:-genpool}
tool=${TOOL:-memcheck}
steps=${STEPS:-3}
mkdir -p "$out"
log="$out/sanitize_${alloc}.log"
export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"

if ! command -v compute-sanitizer >/dev/null; then
  for d in /usr/local/cuda/bin /usr/local/cuda/compute-sanitizer; do
    [[ -x $d/compute-sanitizer ]] && PATH="$d:$PATH" && break
  done
fi
command -v compute-sanitizer >/dev/null || { echo "sanitize_train: compute-sanitizer not found" >&2; exit 2; }

if [[ $alloc == genpool ]]; then
  # Build the out-of-memory wrapper (a C++ compile, cached) outside the sanitizer, and fail early when
  # the library cannot be loaded.
  python3 - <<'EOF' || { echo "sanitize_train: genpool_torch cannot load its library (set GENPOOL_LIB)" >&2; exit 2; }
import genpool_torch as gp
print("genpool library:", gp.library_path())
try:
    print("out-of-memory wrapper:", gp._oom_shim(gp.library_path()))
except Exception as e:  # install() will try again (and report) under the sanitizer
    print("out-of-memory wrapper not prebuilt:", e)
EOF
fi

# Lazy module loading keeps the sanitizer from patching every kernel of PyTorch up front.
export CUDA_MODULE_LOADING=LAZY
start=$(date +%s)
# shellcheck disable=SC2086
compute-sanitizer --tool "$tool" --target-processes all --print-limit 50 ${SANITIZER_ARGS:-} \
  python3 "$root/examples/train.py" --model gpt2-tiny --allocator "$alloc" --steps "$steps" --warmup 0 \
  >"$log" 2>&1
rc=$?
echo "compute-sanitizer --tool $tool, gpt2-tiny, $steps steps, allocator $alloc: exit $rc after $(( $(date +%s) - start )) s; log $log"
grep -E '^(step|median step)' "$log" | head -n 10
summary=$(grep -E '^========= ERROR SUMMARY' "$log" | tail -n 1)
if [[ -z $summary ]]; then
  echo "no ERROR SUMMARY line: the run did not finish; last lines:"
  tail -n 30 "$log"
  exit 2
fi
errors=$(grep -E '^========= (Invalid|Program hit|Uninitialized|Race|Barrier|Leaked|Malloc|Free|Out-of-range|Misaligned)' "$log" | sort | uniq -c | sort -rn | head -n 20)
[[ -n $errors ]] && printf 'errors by kind:\n%s\n' "$errors"
echo "$summary"
[[ $summary == *" 0 errors"* ]]
