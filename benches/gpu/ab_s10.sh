#!/usr/bin/env bash
# Same-run comparison of engine builds on the CUDA replay (A/B/.. twice, interleaved), and the thread
# scaling example with and without cross-thread frees. Run from the repository root with .gpu/bin staged.
set -u
T="benches/traces/resnet50_train.csv.gz benches/traces/gpt2_train_fixed.csv.gz benches/traces/vit_train_varres.csv.gz benches/traces/gpt2_generate_kv.csv.gz"
BINS=${BINS:-genpool-base genpool-s10a genpool genpool-new16}
for r in 1 2; do for b in $BINS; do
  .gpu/bin/$b replay $T --device cuda --passes 5 --json 2>/dev/null | python3 -c "
import json,sys
for l in sys.stdin:
  d=json.loads(l); print('$r', '$b'.ljust(14), d['trace'][:18].ljust(18), round(d['ns_per_op']), [round(x) for x in d['ns_per_op_passes']])"
done; done | sort -k3,3 -k2,2 -k1,1
for h in 4 0; do echo "new, handoff $h"; GENPOOL_HANDOFF=$h .gpu/bin/threads-new 2000000 1 2 4 8 16; done
echo "new, handoff 0, a pool per thread"; GENPOOL_HANDOFF=0 GENPOOL_POOL_PER_THREAD=1 .gpu/bin/threads-new 2000000 1 2 4 8 16
echo "base, handoff 4"; .gpu/bin/threads-base 2000000 1 2 4 8 16
