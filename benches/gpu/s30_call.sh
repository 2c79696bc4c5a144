#!/usr/bin/env bash
# Session 30's GPU calls. STEPS picks (default tests,rs):
#  tests  — every CUDA test binary (stage: ../shared/tools/gpu-pack, benches/gpu/pack_cuda_tests.sh);
#  rs     — record_stream_overlap.py, side / prefetch / serve4 / serve16 under native, genpool (busy
#           streams keep their own frees, `busykeep.rs`) and genpool with `busy_freers:wait`;
#  compat — the compatibility suite under genpool (the default with `busy_freers:pass` never ran it).
# Run with `carry: [".gpu"]`.
set -uo pipefail
STEPS_DEFAULT=tests,rs
. "$(dirname "$0")/env.sh"
machine_info
has tests && cuda_tests && grep -E "rc=" "$OUT/cuda_tests.log"
if has rs; then
  timeout 330 python3 benches/gpu/record_stream_overlap.py --reps "${REPS:-5}" --steps "${RS_STEPS:-200}" \
    --patterns side,prefetch,serve4,serve16 \
    --modes "${RS_MODES:-native,genpool,genpool:experimental.busy_freers:wait}" > "$OUT/rs.jsonl" 2> "$OUT/rs.err"
  echo "rs rc=$?"; tail -3 "$OUT/rs.err"
  python3 - "$OUT/rs.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print(f"{'mode':45} {'pattern':9} {'ms/step':>8} {'min':>7} {'MiB':>8} {'waits':>6} {'kept':>6}")
for r in rows:
    if "error" in r:
        print(r["mode"], "ERROR", r["error"][-200:]); continue
    print(f"{r['mode'][:45]:45} {r['pattern']:9} {r['ms_a_step']:8.3f} {r['ms_min']:7.3f} "
          f"{r['peak_reserved_mib']:8.1f} {str(r.get('page_waits', '-')):>6} {str(r.get('busy_kept_reuses', '-')):>6}")
PY
fi
has compat && compat_suite genpool && tail -1 "$OUT/compat.log"
