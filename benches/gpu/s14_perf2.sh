#!/usr/bin/env bash
# Session 14: where PyTorch's path spends the ~110 ns a call it adds to the engine's own replay — a perf
# profile of torch_diag.py's replay of gpt2_generate_kv (494 718 calls a pass) with BLAS/OpenMP helper
# threads off (their spinning filled the first profile). Carried perf as in s14_perf.sh.
set -uo pipefail
STEPS_DEFAULT=x
. "$(dirname "$0")/env.sh"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
carried_perf
K=benches/traces/gpt2_generate_kv.csv.gz
timeout 150 python3 benches/gpu/torch_diag.py --child $K 1 > "$OUT/warm.txt" 2>&1
timeout 120 $PERF record -F 2999 -g -o /tmp/t.data -- python3 benches/gpu/torch_diag.py --child $K 8 > "$OUT/run.txt" 2>&1
$PERF report -i /tmp/t.data --no-children --sort dso --stdio 2>/dev/null | grep -E "^ +[0-9]" | head -15 > "$OUT/dso.txt"
$PERF report -i /tmp/t.data --no-children --sort dso,sym --percent-limit 0.4 --stdio 2>/dev/null | grep -E "^ +[0-9]" | head -60 > "$OUT/sym.txt"
$PERF report -i /tmp/t.data --children --sort sym --percent-limit 2 --stdio -g none 2>/dev/null | grep -E "^ +[0-9]" | head -40 > "$OUT/children.txt"
cut -c1-160 "$OUT/run.txt" | tail -9; cat "$OUT/dso.txt"; cut -c1-150 "$OUT/sym.txt"; cut -c1-150 "$OUT/children.txt"
