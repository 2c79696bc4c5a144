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
