#!/usr/bin/env bash
# Run every fuzz target for SECONDS each (default 60) and print the executions per target.
#
#   fuzz/run.sh [SECONDS] [TARGET...]
#
# Needs the nightly toolchain; installs cargo-fuzz if it is missing. Each target starts from its
# committed seeds (fuzz/seeds/<target>: slices of the shared traces, the reader's fixtures) plus the
# corpus grown by earlier runs (fuzz/corpus/<target>, git-ignored). A crash leaves its input under
# fuzz/artifacts/<target>/ and makes the script exit non-zero after the remaining targets have run.
set -uo pipefail
cd "$(dirname "$0")"
secs="${1:-60}"
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    targets=(engine_ops trace_csv trace_rmm trace_snapshot c_abi)
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    echo "fuzz/run.sh: installing cargo-fuzz"
    cargo install cargo-fuzz --locked || exit 1
fi
cargo +nightly fuzz build || exit 1
mkdir -p target/fuzz-logs
status=0
summary=()
for t in "${targets[@]}"; do
    mkdir -p "corpus/$t"
    log="target/fuzz-logs/$t.log"
    # -timeout: an input that runs 10 s counts as a hang; -rss_limit_mb: 2 GiB counts as a leak.
    GENPOOL_DEVICE=sim cargo +nightly fuzz run "$t" "corpus/$t" "seeds/$t" -- \
        -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 >"$log" 2>&1
    rc=$?
    runs=$(grep -oE 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -oE '[0-9]+$' | tail -1)
    cov=$(grep -oE 'cov: [0-9]+' "$log" | tail -1)
    if [ "$rc" -ne 0 ]; then
        status=1
        summary+=("$t: FAILED (exit $rc) after ${runs:-?} executions; see fuzz/$log and fuzz/artifacts/$t/")
        tail -40 "$log"
    else
        summary+=("$t: ${runs:-?} executions in ${secs} s, ${cov:-cov: ?}, corpus $(ls "corpus/$t" | wc -l) inputs, 0 crashes")
    fi
done
echo "== fuzz summary (${secs} s per target) =="
printf '%s\n' "${summary[@]}"
exit $status
