set -u
T="benches/traces/resnet50_train.csv.gz benches/traces/gpt2_train_fixed.csv.gz benches/traces/vit_train_varres.csv.gz benches/traces/gpt2_generate_kv.csv.gz"
for r in 1 2; do for b in genpool-base genpool; do
  .gpu/bin/$b replay $T --device cuda --passes 5 --json 2>/dev/null | python3 -c "
import json,sys
for l in sys.stdin:
  d=json.loads(l); print('$r $b', d['trace'][:18].ljust(18), round(d['ns_per_op']), [round(x) for x in d['ns_per_op_passes']])"
done; done
for h in 4 0; do echo "handoff $h"; GENPOOL_HANDOFF=$h .gpu/bin/threads-new 2000000 1 2 4 8 16; done
GENPOOL_HANDOFF=0 .gpu/bin/threads-base 2000000 1 2 4 8 16 2>/dev/null | sed 's/^/base(h4) /'
