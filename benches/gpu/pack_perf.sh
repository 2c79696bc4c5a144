#!/usr/bin/env bash
# Stage this build machine's perf for the GPU machine, which has none: .gpu/perfb.tar.xz holds the perf
# binary, every shared library it loads and the dynamic loader (perfb/perf, perfb/lib/), which
# env.sh's `carried_perf` unpacks and runs through that loader (glibc here may be older than there).
# Run from the project root after ../shared/tools/gpu-pack (which empties .gpu).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
perf=$(command -v perf) || { echo "pack_perf: no perf on this machine" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/perfb/lib" .gpu
cp -L "$perf" "$tmp/perfb/perf"
# Every library ldd resolves, and the loader itself (the line without "=>").
ldd "$perf" | awk '/=> \// {print $3} !/=>/ && $1 ~ /^\// {print $1}' | while read -r lib; do
  cp -L "$lib" "$tmp/perfb/lib/"
done
loader=$(ldd "$perf" | awk '!/=>/ && $1 ~ /ld-linux/ {print $1}')
[ -n "$loader" ] && cp -L "$loader" "$tmp/perfb/lib/ld-linux-x86-64.so.2"
tar -C "$tmp" -cJf .gpu/perfb.tar.xz perfb
"$tmp/perfb/lib/ld-linux-x86-64.so.2" --library-path "$tmp/perfb/lib" "$tmp/perfb/perf" --version
du -h .gpu/perfb.tar.xz
