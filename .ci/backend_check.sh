#!/usr/bin/env bash
# Compile-check genpool's C++ PyTorch backend (python/genpool_torch/csrc) against the newest torch on the
# package index and the oldest it supports (2.11), with the CUDA runtime headers from NVIDIA's wheels: no
# GPU, no torch install, only the headers. Usage: .ci/backend_check.sh [WORKDIR]
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-${TMPDIR:-/tmp}/genpool_backend_check}
mkdir -p "$work"
py=$(python3 -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64)
fetch() {  # fetch NAME SPEC: download SPEC's wheel into $work/NAME and unpack it there
  local dir="$work/$1"
  if [[ ! -d $dir/unpacked ]]; then
    mkdir -p "$dir"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
      "${plat[@]}" -d "$dir" "$2"
    mkdir -p "$dir/unpacked"
    # Headers and the version file only (a torch wheel unpacks to gigabytes of libraries).
    python3 - "$dir" <<'PY'
import glob, sys, zipfile
d = sys.argv[1]
for w in glob.glob(f"{d}/*.whl"):
    with zipfile.ZipFile(w) as z:
        z.extractall(f"{d}/unpacked", [n for n in z.namelist() if "/include/" in n or n.endswith("torch/version.py")])
PY
  fi
  echo "$dir/unpacked"
}
cudart=$(fetch cudart "nvidia-cuda-runtime==13.0.*")
crt=$(fetch crt "nvidia-cuda-crt==13.0.*")
cuda_inc=(-I"$cudart/nvidia/cu13/include" -I"$crt/nvidia/cu13/include")
status=0
for spec in "torch" "torch==2.11.0"; do
  tdir=$(fetch "torch_${spec//[=.]/_}" "$spec")/torch
  ver=$(python3 -c "import re,sys; print(re.search(r\"__version__ = '([^']+)'\", open(sys.argv[1]).read()).group(1))" "$tdir/version.py" 2>/dev/null || echo unknown)
  if g++ -std=c++20 -fsyntax-only -Wall -Wextra -Werror -Wno-unused-parameter \
      -I"$tdir/include" -I"$tdir/include/torch/csrc/api/include" "${cuda_inc[@]}" \
      -Icrates/genpool-torch/include python/genpool_torch/csrc/genpool_backend.cpp; then
    echo "backend compiles against torch $ver"
  else
    echo "backend does NOT compile against torch $ver" >&2
    status=1
  fi
done
exit $status
