#!/usr/bin/env python3
"""Training step time and peak memory for every (model x allocator), each in a fresh process.

One command on the GPU machine produces the table:

    GENPOOL_LIB=/path/to/libgenpool_torch.so python3 examples/bench_train.py [--steps 30] [--check-losses]

Prints one JSON line per run (as examples/train.py --json prints it) and, last, a Markdown table with the
median step time and the peak device memory (NVML, the same method for every allocator) relative to
PyTorch's native allocator. With --check-losses it also runs train.py --check-losses per transformer
model (genpool's first 20 losses must equal native's exactly under deterministic algorithms).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "train.py"
MODELS = ("gpt2", "gpt2m-varlen", "llama-ckpt", "resnet50")
ALLOCATORS = ("native", "expandable", "async", "genpool")


def run(cmd, timeout):
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout} s"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode not in (0, 1) or not lines:
        return None, (proc.stderr.strip() or proc.stdout.strip())[-1500:]
    return json.loads(lines[-1]), None


def fmt_ratio(x, base):
    return f"{x / base:.3f}x" if x and base else "-"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--allocators", default=",".join(ALLOCATORS))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--timeout", type=int, default=900, help="seconds per run")
    p.add_argument("--check-losses", action="store_true")
    p.add_argument("--genpool-conf", default=None)
    args = p.parse_args(argv)

    results = {}
    for model in args.models.split(","):
        for alloc in args.allocators.split(","):
            cmd = [sys.executable, str(TRAIN), "--model", model, "--allocator", alloc, "--steps",
                   str(args.steps), "--warmup", str(args.warmup), "--json", "--quiet"]
            if args.genpool_conf:
                cmd += ["--genpool-conf", args.genpool_conf]
            res, err = run(cmd, args.timeout)
            if res is None:
                res = {"model": model, "allocator": alloc, "error": err}
            res.pop("losses", None)
            results[(model, alloc)] = res
            print(json.dumps(res), flush=True)

    checks = {}
    if args.check_losses:
        for model in args.models.split(","):
            if model == "resnet50":
                continue  # adaptive_avg_pool2d's CUDA backward has no deterministic implementation
            cmd = [sys.executable, str(TRAIN), "--model", model, "--check-losses"]
            if args.genpool_conf:
                cmd += ["--genpool-conf", args.genpool_conf]
            res, err = run(cmd, 2 * args.timeout)
            checks[model] = "error" if res is None else ("equal" if res.get("ok") else "DIFFER")
            print(json.dumps(res if res is not None else {"check": "losses", "model": model, "error": err}),
                  flush=True)

    print()
    print("| model | allocator | median step (ms) | vs native | peak memory (MiB) | vs native | method |"
          + (" losses vs native |" if checks else ""))
    print("|---|---|---|---|---|---|---|" + ("---|" if checks else ""))
    for model in args.models.split(","):
        base = results.get((model, "native"), {})
        for alloc in args.allocators.split(","):
            r = results[(model, alloc)]
            if "error" in r:
                row = f"| {model} | {alloc} | error: {r['error'].splitlines()[-1] if r['error'] else '?'} |||||"
            else:
                row = (f"| {model} | {alloc} | {r['median_step_ms']:.2f} | "
                       f"{fmt_ratio(r['median_step_ms'], base.get('median_step_ms'))} | "
                       f"{r['peak_bytes'] / 2**20:.0f} | {fmt_ratio(r['peak_bytes'], base.get('peak_bytes'))} | "
                       f"{r['peak_method']} |")
            if checks:
                row += f" {checks.get(model, '-') if alloc == 'genpool' else ''} |"
            print(row)
    failed = any("error" in r for r in results.values()) or any(v != "equal" for v in checks.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
