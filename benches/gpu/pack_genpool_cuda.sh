#!/usr/bin/env bash
# Stage genpool's CUDA integration tests (crates/genpool/tests/cuda.rs) as .gpu/tests/genpool_cuda, for
# benches/gpu/reliability.sh. Run here (the build machine), from the project root, after
# ../shared/tools/gpu-pack: three crates have a test target named `cuda`, and gpu-pack's copy
# .gpu/tests/cuda is whichever of them came last.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
mkdir -p .gpu/tests
exe=$(cargo test --release -p genpool --test cuda --no-run --message-format=json "$@" 2> /dev/null |
  python3 -c '
import json, sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "cuda":
        print(m["executable"])
')
[[ -n $exe ]] || { echo "pack_genpool_cuda: no test executable built" >&2; exit 1; }
cp "$exe" .gpu/tests/genpool_cuda
strip .gpu/tests/genpool_cuda 2> /dev/null || true
ls -l .gpu/tests/genpool_cuda
