"""The side-by-side table of the A/B scripts (s15_ab.sh, s16_ab.sh): rows of $OUT/torch.jsonl and
$OUT/cli.jsonl, each tagged with its build ("v") and round, as min, median and every round.

usage: python3 benches/gpu/ab_table.py OUT [--cli-last-pass]

--cli-last-pass: the engine's replays count their last pass only (with few passes a run, the median of
the warm passes would include a first warm pass of page moves).
"""
import collections
import json
import statistics
import sys


def main():
    out = sys.argv[1]
    last_pass = "--cli-last-pass" in sys.argv[2:]
    rows = collections.defaultdict(list)
    for f, kind in (("torch.jsonl", "torch"), ("cli.jsonl", "cli")):
        try:
            lines = open(f"{out}/{f}").readlines()
        except FileNotFoundError:
            continue
        for line in lines:
            try:
                d = json.loads(line)
            except ValueError:
                continue
            mode = d.get("mode", d.get("allocator", ""))
            ns = d.get("ns_per_op")
            if kind == "cli" and last_pass and d.get("ns_per_op_passes"):
                ns = d["ns_per_op_passes"][-1]
            if ns is None or ns < 0:
                continue
            rows[(kind, d["trace"][:18], mode, d["v"])].append((round(ns), d.get("ratio")))
    for k in sorted(rows):
        v = [x[0] for x in rows[k]]
        print(*k, "min", min(v), "median", statistics.median(v), "all", v, "ratio", rows[k][0][1])


if __name__ == "__main__":
    main()
