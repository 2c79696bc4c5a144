#!/usr/bin/env bash
# compute-sanitizer over genpool's CUDA integration tests (crates/genpool/tests/cuda.rs), on the GPU
# machine, from the project root with the folder staged by ../shared/tools/gpu-pack (.gpu/).
#
#   OUT=out benches/gpu/reliability.sh        # about 1-3 minutes; capped below 4 by the timeouts
#
# 1. plain: every test, ignored ones included, no sanitizer. The stream-order pair is checked here:
#    cross_stream_reuse_waits_for_work_on_the_freeing_stream must pass and its broken twin
#    cross_stream_broken_reuse_is_caught must pass too (it asserts that the race it stages is seen).
# 2. memcheck (with leak checking), racecheck (the cross-stream tests only: it is slow and these are the
#    tests with concurrent streams), synccheck: the same tests, one thread, each tool's full log in
#    $OUT/<tool>.log. The broken twin is skipped under the sanitizers (they may serialize streams, so the
#    race it stages cannot happen there) and GENPOOL_UNDER_SANITIZER=1 lets the stream-order test report,
#    rather than fail on, a race window the sanitizer closed (its data check still runs).
# A summary line per tool is printed last (and written to $OUT/summary.txt); the exit status is non-zero
# when any tool reported errors or any test failed.
#
# The test executable: $GENPOOL_CUDA_TEST if set, else the one in $G/tests that lists this file's tests.
# Three crates have a test target named `cuda` (gen-device, gen-stream, genpool) and gpu-pack names the
# copies by target name, so .gpu/tests/cuda may be another crate's: run benches/gpu/pack_cuda_tests.sh
# here after gpu-pack to stage each under a name of its own (genpool's as .gpu/tests/genpool_cuda).
set -uo pipefail
G=${G:-.gpu}
OUT=${OUT:-out}
mkdir -p "$OUT"
MARK=cross_stream_reuse_waits_for_work_on_the_freeing_stream
BROKEN=cross_stream_broken_reuse_is_caught

find_exe() {
  if [[ -n ${GENPOOL_CUDA_TEST:-} ]]; then
    echo "$GENPOOL_CUDA_TEST"
    return 0
  fi
  local f
  for f in "$G"/tests/genpool_cuda "$G"/tests/*; do
    [[ -f $f && -x $f ]] || continue
    # (the list is read whole first: `grep -q` on a pipe would stop the writer, failing under pipefail)
    if [[ $'\n'$(timeout 20 "$f" --list --include-ignored 2> /dev/null)$'\n' == *$'\n'"$MARK: test"$'\n'* ]]; then
      echo "$f"
      return 0
    fi
  done
  return 1
}

if ! exe=$(find_exe); then
  echo "reliability: no test executable in $G/tests lists $MARK; stage it with" \
    "benches/gpu/pack_cuda_tests.sh (or set GENPOOL_CUDA_TEST)" | tee "$OUT/summary.txt" >&2
  exit 2
fi
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  compute-sanitizer --version | tail -n 1
  echo "test executable: $exe"
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

status=0
summary=()

# One line from a run's log: sanitizer errors, libtest's counts, skips for want of a device.
summarize() {
  local name=$1 rc=$2 secs=$3 log=$4 errors result skips verdict
  # memcheck and synccheck end with "ERROR SUMMARY: N errors", racecheck with
  # "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)".
  errors=$(grep -Eo 'ERROR SUMMARY: [0-9]+ error|RACECHECK SUMMARY: [0-9]+ hazard' "$log" |
    grep -Eo '[0-9]+' | tail -n 1)
  result=$(grep -Eo 'test result: [a-zA-Z]+\. [0-9]+ passed; [0-9]+ failed; [0-9]+ ignored' "$log" |
    tail -n 1 | sed 's/^test result: //')
  skips=$(grep -c 'SKIP: ' "$log")
  verdict=ok
  if ((rc == 124 || rc == 137)); then
    verdict=TIMEOUT
  elif [[ -z $result || $result != ok.* ]]; then
    verdict=FAILED
  elif [[ $name != plain && -z $errors ]]; then
    verdict="FAILED (no sanitizer summary)"
  elif [[ -n $errors && $errors != 0 ]]; then
    verdict=ERRORS
  elif ((skips > 0)); then
    verdict="SKIPPED (no GPU)"
  fi
  [[ $verdict == ok ]] || status=1
  summary+=("$(printf '%-10s %-28s errors reported: %-4s tests: %-40s skipped (no device): %s  rc=%s  %ss  log: %s' \
    "$name" "$verdict" "${errors:-n/a}" "${result:-none}" "$skips" "$rc" "$secs" "$log")")
}

# run NAME TIMEOUT [sanitizer args --] test args...
run() {
  local name=$1 limit=$2 t0 rc
  shift 2
  local log="$OUT/$name.log"
  echo "== $name (limit ${limit}s): $*" | tee "$log"
  t0=$SECONDS
  timeout -k 10 "$limit" "$@" >> "$log" 2>&1
  rc=$?
  summarize "$name" "$rc" $((SECONDS - t0)) "$log"
  tail -n 3 "$log"
}

common=(--include-ignored --test-threads=1)
san=(env GENPOOL_UNDER_SANITIZER=1 compute-sanitizer --error-exitcode 86)

run plain "${T_PLAIN:-40}" "$exe" "${common[@]}" --nocapture
run memcheck "${T_MEMCHECK:-90}" \
  "${san[@]}" --tool memcheck --leak-check full "$exe" "${common[@]}" --nocapture --skip "$BROKEN"
run racecheck "${T_RACECHECK:-45}" \
  "${san[@]}" --tool racecheck "$exe" cross_stream "${common[@]}" --nocapture --skip "$BROKEN"
run synccheck "${T_SYNCCHECK:-45}" \
  "${san[@]}" --tool synccheck "$exe" "${common[@]}" --nocapture --skip "$BROKEN"

echo
echo "== reliability summary ($exe)"
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
exit "$status"
