#!/usr/bin/env bash
# Stage every CUDA test target of the workspace under a name of its own, .gpu/tests/<package>_<target>
# (gen_device_cuda, gen_device_cuda_host, gen_stream_cuda, genpool_cuda, genpool_cuda_sleep), and drop
# the other test executables gpu-pack staged (the host tests run here; the 64 MiB carry limit). Run here
# (the build machine), from the project root, after ../shared/tools/gpu-pack: three crates have a test
# target named `cuda`, and gpu-pack's copy .gpu/tests/cuda is whichever of them came last.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
rm -rf .gpu/tests && mkdir -p .gpu/tests
cargo test --release --workspace --no-run --message-format=json "$@" 2> /dev/null |
  python3 -c '
import json, shutil, sys
n = 0
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    t = m.get("target", {})
    if m.get("reason") == "compiler-artifact" and m.get("executable") and "test" in t.get("kind", []) \
            and t["name"].startswith("cuda"):
        pkg = m["package_id"].split("#")[0].rsplit("/", 1)[-1].replace("-", "_")
        shutil.copy2(m["executable"], f".gpu/tests/{pkg}_{t['"'"'name'"'"']}")
        n += 1
if n == 0:
    sys.exit("pack_cuda_tests: no CUDA test target built")
'
strip .gpu/tests/* 2> /dev/null || true
ls -l .gpu/tests
