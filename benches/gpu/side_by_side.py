"""Print one side-by-side table from `genpool replay --json` lines and `torch_replay.py` lines.

usage: python3 side_by_side.py genpool.jsonl torch.jsonl [more.jsonl ...]  (markdown on stdout)
Each row is a trace; each column an allocator: "ratio / warm ns per op". Lines that are not JSON, or
that carry an "error", are listed under the table instead.
"""
import json
import sys


def main(paths):
    rows, cols, errors = {}, [], []
    for path in paths:
        try:
            lines = open(path).read().splitlines()
        except OSError as e:
            errors.append(f"{path}: {e}")
            continue
        for line in lines:
            try:
                d = json.loads(line)
            except ValueError:
                continue
            trace = d.get("trace", "?").replace(".csv.gz", "")
            col = d.get("allocator") or d.get("mode") or "?"
            if d.get("ignore_site"):
                col += " (no site)"
            if "error" in d:
                errors.append(f"{trace} / {col}: {d['error'][-300:]}")
                continue
            if col not in cols:
                cols.append(col)
            ns = d.get("ns_per_op")
            cell = f"{d['ratio']:.3f} / {ns:.0f}" if ns is not None else f"{d['ratio']:.3f} / -"
            rows.setdefault(trace, {})[col] = cell
            rows[trace]["peak live"] = f"{d['peak_live'] / 2**30:.2f} GiB"
    head = ["trace", "peak live"] + cols
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for trace in sorted(rows):
        r = rows[trace]
        print("| " + " | ".join([trace] + [r.get(c, "-") for c in head[1:]]) + " |")
    for e in errors:
        print(f"\n- {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
