"""The GPU-call scripts' summary table: one markdown row per trace and allocator from `genpool replay
--json` and `torch_replay.py` lines, with the warm passes' driver calls.

usage: python3 benches/gpu/replay_table.py FILE[:TAG] ...   (a missing file is skipped; TAG, if given, is
appended to the allocator's name, e.g. replay_genpool-base.jsonl:base)
"""
import json
import os
import sys


def main(args):
    rows = []
    for a in args:
        path, _, tag = a.partition(":")
        if not os.path.exists(path):
            continue
        for line in open(path):
            try:
                d = json.loads(line)
            except ValueError:
                continue
            w = d.get("warm_calls") or {}
            n = max(d.get("passes", 2) - 1, 1)
            per = lambda k: w.get(k, 0) / n if w else None
            name = (d.get("allocator") or d.get("mode") or "") + (" " + tag if tag else "")
            rows.append((d.get("trace"), name, d.get("ratio"), d.get("ns_per_op"), per("device_syncs"),
                         per("maps"), per("event_records"), per("stream_waits")))
    print("| trace | allocator | ratio | warm ns/op | device syncs / warm pass | maps / warm pass "
          "| event records / warm pass | stream waits / warm pass |")
    print("|---|---|---|---|---|---|---|---|")
    f = lambda x, p: "-" if x is None else (p % x)
    for r in sorted(rows, key=lambda r: (str(r[0]), str(r[1]))):
        print(f"| {r[0]} | {r[1]} | {f(r[2], '%.4f')} | {f(r[3], '%.0f')} | {f(r[4], '%.1f')} | "
              f"{f(r[5], '%.1f')} | {f(r[6], '%.1f')} | {f(r[7], '%.1f')} |")


if __name__ == "__main__":
    main(sys.argv[1:])
