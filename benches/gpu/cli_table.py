"""One line a run of `genpool replay --json` (the GPU-call scripts' cli step): trace, ratio, ns a call
(median of the timed passes, then every pass), warm driver calls. usage: cli_table.py [CLI.jsonl]
(default $OUT/cli.jsonl); prints nothing when the file is missing (the step did not run)."""
import json, os, sys

path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.environ.get("OUT", "out"), "cli.jsonl")
if os.path.exists(path):
    for line in open(path):
        d = json.loads(line)
        w = d.get("warm_calls", {})
        print("cli", d["trace"][:20].ljust(20), round(d["ratio"], 4), round(d["ns_per_op"]),
              [round(x) for x in d["ns_per_op_passes"]], "maps", w.get("maps"),
              "syncs", w.get("device_syncs"), "waits", w.get("waits"))
