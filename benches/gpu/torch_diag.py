"""Where the time goes when a trace replays through PyTorch's entry points under genpool.

The same loop as torch_replay.py (its C++ replay through raw_alloc_with_stream / raw_delete, its trace
loader), genpool installed, and after each pass the engine's page-layer counters of that pass (maps,
unmaps, aliases, synchronizes, host waits, stream waits, move_ns) and — with GENPOOL_TIMING=1 — the host
time inside genpool's entry points. One JSON line per pass; compare with `genpool replay --json`'s
warm_calls for the same trace (the engine without PyTorch).

usage:  GENPOOL_TIMING=1 python3 torch_diag.py TRACE.csv.gz [TRACE...] [--reps 4]
"""
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

KEYS = ("maps", "unmaps", "aliases", "syncs", "stream_waits", "fences", "revivals", "steals", "move_ns")


def child(path, reps):
    import torch
    import genpool_torch
    import torch_replay as tr
    from torch.utils.cpp_extension import load_inline

    genpool_torch.install()
    ext = load_inline("torch_replay_ext", tr.CPP, with_cuda=True, verbose=False)
    sizes, ids, stream_ix, nslots, _ = tr.load_ops(path)
    s = torch.tensor(sizes, dtype=torch.int64)
    i = torch.tensor(ids, dtype=torch.int64)
    handles = [torch.cuda.current_stream().cuda_stream] + [
        torch.cuda.Stream().cuda_stream for _ in range(max(stream_ix, default=0))]
    st = torch.tensor([handles[k] for k in stream_ix], dtype=torch.int64)
    torch.cuda.init()
    torch.cuda.synchronize()
    before = genpool_torch.raw_stats()
    for r in range(reps):
        ns = ext.replay(s, i, st, nslots, True)
        after = genpool_torch.raw_stats()
        pages = {k: after["pages"].get(k, 0) - before["pages"].get(k, 0) for k in KEYS}
        print(json.dumps({"trace": os.path.basename(path), "pass": r + 1, "ns_per_op": round(ns, 1),
                          "ops": len(sizes), "pages": pages, "stream_waits_plugin": after.get("stream_waits"),
                          "sync_fallbacks": after.get("sync_fallbacks"),
                          "host_timing": after.get("host_timing")}), flush=True)
        before = after


def main():
    args = sys.argv[1:]
    if args and args[0] == "--child":
        return child(args[1], int(args[2]))
    reps, traces = 4, []
    while args:
        a = args.pop(0)
        if a == "--reps":
            reps = int(args.pop(0))
        else:
            traces.append(a)
    for path in traces:
        r = subprocess.run([sys.executable, __file__, "--child", path, str(reps)], capture_output=True,
                           text=True, timeout=600)
        print(r.stdout.strip() or json.dumps({"trace": os.path.basename(path), "error": r.stderr[-800:]}),
              flush=True)


if __name__ == "__main__":
    main()
