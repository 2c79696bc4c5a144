#!/usr/bin/env python3
"""Step time of two allocators compared step by step, in two processes run in lock-step.

    GENPOOL_LIB=.gpu/bin/libgenpool_torch.so python3 examples/ab_steps.py --models resnet50,gpt2 \\
        --steps 120 --warmup 20 --out "$OUT/ab"

Why: separate runs of the same program on the same H200 machine differ by 10-30 % in step time (host
clocks and neighbours drift within seconds; ResNet-50 at batch 64 and the small shapes of the
random-length models are host-bound), so one pair of runs cannot show a 1 % difference. Here both
processes (allocator A, allocator B; by default native and genpool) are started side by side on the
same GPU and driven one step at a time, alternating A-B, B-A, ...: each step runs alone (the other
process waits on its stdin), is timed from its start to a synchronize after it (examples/train.py
--lockstep), and is paired with the other process's same step — same shapes (the same seed), seconds
apart. The result per model: the median over the timed steps of the per-step ratio B/A, with a 95 %
bootstrap interval, and the ratio of the total times.

Both orders (the default, --orders both): the pair is run twice, once with B as the second process
started and once with B as the first. On the H200 machine the position alone moved ResNet-50's ratio by
~6 % (2026-12-03: native vs genpool 1.0125 with genpool second, 1.065 with genpool first; native vs the
floor allocator 0.895 and 1.069) — the same allocator is faster as the second process. With both orders
a position effect cancels: the ratio reported is the geometric mean of the two orders' median per-step
ratios B/A (interval: bootstrap of each order's steps), and each order's own median is reported beside it
("position_factor" = sqrt(ratio with B second / ratio with B first): below 1 when the second position is
favoured).

Writes OUT/ab.jsonl (one JSON line per model: the ratios, and each order's step-time lists under "ab" and
"ba") and OUT/ab.md (the
table); each process's stderr in OUT/logs/. Peak memory is not measured here (use bench_train.py: its
sampler thread would run during the other process's steps).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "train.py"
MODELS = ("gpt2", "gpt2m-varlen", "llama-ckpt", "resnet50", "gpt2-tiny")
ALLOCATORS = ("native", "expandable", "async", "genpool", "floor")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="resnet50", help="comma-separated: " + ", ".join(MODELS))
    p.add_argument("--a", default="native", choices=ALLOCATORS, help="baseline allocator (default native)")
    p.add_argument("--b", default="genpool", choices=ALLOCATORS, help="allocator compared (default genpool)")
    p.add_argument("--steps", type=int, default=120, help="timed steps (default 120)")
    p.add_argument("--warmup", type=int, default=20, help="paired steps before them, not counted (default 20)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per model")
    p.add_argument("--genpool-conf", default=None)
    p.add_argument("--genpool-timing", action="store_true",
                   help="GENPOOL_TIMING=1 in the genpool process: its malloc/free host time after every step")
    p.add_argument("--orders", choices=("both", "ab"), default="both",
                   help="both: run the pair with each allocator as the first process and pool the ratios "
                        "(cancels a position effect; default); ab: A first only")
    p.add_argument("--out", type=Path, default=Path("ab_out"))
    args = p.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in args.models if m not in MODELS]
    if bad or not args.models:
        p.error(f"unknown model(s) {bad}; choose from {', '.join(MODELS)}")
    if args.steps < 1 or args.warmup < 0 or args.a == args.b:
        p.error("--steps must be at least 1, --warmup at least 0, and --a and --b must differ")
    return args


def child_cmd(args: argparse.Namespace, model: str, allocator: str) -> List[str]:
    cmd = [sys.executable, str(TRAIN), "--model", model, "--allocator", allocator, "--lockstep",
           "--steps", str(args.steps + args.warmup), "--sample-ms", "0", "--json", "--quiet"]
    if args.genpool_conf and allocator == "genpool":
        cmd += ["--genpool-conf", args.genpool_conf]
    if args.genpool_timing and allocator == "genpool":
        cmd.append("--genpool-timing")
    return cmd


class Child:
    """One lock-step train.py process."""

    def __init__(self, cmd: List[str], log: Path):
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, bufsize=1)
        self.result: Optional[dict] = None

    def expect(self, prefix: str) -> str:
        """The next stdout line starting with ``prefix`` (other lines are skipped)."""
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"process ended (exit status {self.proc.poll()}) waiting for {prefix!r}")
            if line.startswith(prefix):
                return line.strip()

    def step(self) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return float(self.expect("step ").split()[2])

    def finish(self, timeout: float) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write("stop\n")
            self.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        timer = threading.Timer(timeout, self.proc.kill)  # a child that hangs is killed, not waited for
        timer.start()
        try:
            assert self.proc.stdout is not None
            out = self.proc.stdout.read()
            self.proc.wait()
            lines = [x for x in (out or "").splitlines() if x.startswith("{")]
            try:
                self.result = json.loads(lines[-1]) if lines else None
            except json.JSONDecodeError:
                self.result = None
        finally:
            timer.cancel()
            self.proc.stdout.close()
            self.log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass
        self.log.close()


def bootstrap_ci(ratios: Sequence[float], rounds: int = 2000, seed: int = 0) -> tuple:
    """95 % percentile-bootstrap interval of the median of ``ratios``."""
    rng = random.Random(seed)
    n = len(ratios)
    meds = sorted(statistics.median([ratios[rng.randrange(n)] for _ in range(n)]) for _ in range(rounds))
    return meds[int(0.025 * rounds)], meds[int(0.975 * rounds) - 1]


def _timed(a_ms: Sequence[float], b_ms: Sequence[float], warmup: int) -> tuple:
    a, b = list(a_ms[warmup:]), list(b_ms[warmup:])
    n = min(len(a), len(b))
    return a[:n], b[:n]


def summarise(a_ms: Sequence[float], b_ms: Sequence[float], warmup: int) -> Dict[str, float]:
    """Figures over the timed steps (after ``warmup``) of two paired step-time lists."""
    a, b = _timed(a_ms, b_ms, warmup)
    n = len(a)
    if n == 0:
        return {"steps": 0}
    ratios = [y / x for x, y in zip(a, b)]
    lo, hi = bootstrap_ci(ratios)
    return {"steps": n, "median_ratio": statistics.median(ratios), "ci95": [lo, hi],
            "total_ratio": sum(b) / sum(a), "median_a_ms": statistics.median(a),
            "median_b_ms": statistics.median(b)}


def combine_orders(ab: dict, ba: dict, warmup: int, rounds: int = 2000, seed: int = 0) -> Dict[str, float]:
    """B/A from a run with A started first (``ab``: its a side is A) and one with B started first (``ba``:
    its a side is B). A position effect multiplies one order's ratios by some p and the other's by 1/p,
    so the estimate is the geometric mean of the two orders' median per-step ratios; its 95 % interval
    comes from bootstrapping each order's steps."""
    a1, b1 = _timed(ab["a_ms"], ab["b_ms"], warmup)
    b2, a2 = _timed(ba["a_ms"], ba["b_ms"], warmup)
    if not a1 or not a2:
        return {"steps": 0}
    r1 = [y / x for x, y in zip(a1, b1)]  # B started second
    r2 = [y / x for x, y in zip(a2, b2)]  # B started first
    second, first = statistics.median(r1), statistics.median(r2)
    rng = random.Random(seed)

    def resampled(r):
        return statistics.median([r[rng.randrange(len(r))] for _ in r])

    est = sorted((resampled(r1) * resampled(r2)) ** 0.5 for _ in range(rounds))
    a, b = a1 + a2, b1 + b2
    return {"steps": len(a), "median_ratio": (second * first) ** 0.5,
            "ci95": [est[int(0.025 * rounds)], est[int(0.975 * rounds) - 1]],
            "total_ratio": sum(b) / sum(a), "median_a_ms": statistics.median(a),
            "median_b_ms": statistics.median(b), "ratio_b_second": second, "ratio_b_first": first,
            "position_factor": (second / first) ** 0.5}


def run_pair(cmd_a: List[str], cmd_b: List[str], steps: int, warmup: int, logs: Path, name: str,
             timeout: float) -> dict:
    """Drive two lock-step processes for ``steps + warmup`` steps, alternating which goes first."""
    logs.mkdir(parents=True, exist_ok=True)
    a = Child(cmd_a, logs / f"{name}-a.log")
    b = Child(cmd_b, logs / f"{name}-b.log")
    a_ms: List[float] = []
    b_ms: List[float] = []
    start = time.monotonic()
    try:
        a.expect("ready")
        b.expect("ready")
        for i in range(steps + warmup):
            if time.monotonic() - start > timeout:
                raise RuntimeError(f"timed out after {i} steps")
            first, second = (a, b) if i % 2 == 0 else (b, a)
            t1 = first.step()
            t2 = second.step()
            (a_ms if first is a else b_ms).append(t1)
            (b_ms if second is b else a_ms).append(t2)
    except Exception as e:  # noqa: BLE001 - reported in the record
        a.kill()
        b.kill()
        return {"error": str(e), "a_ms": a_ms, "b_ms": b_ms}
    a.finish(60)
    b.finish(60)
    rec = {"a_ms": a_ms, "b_ms": b_ms, **summarise(a_ms, b_ms, warmup)}
    for side, c in (("a", a), ("b", b)):
        if c.result:
            extra = {k: v for k, v in c.result.items() if k not in ("step_ms", "losses")}
            rec[f"{side}_result"] = extra
            rec[f"{side}_losses"] = c.result.get("losses", [])[:5]
    return rec


def table(records: List[dict]) -> str:
    lines = ["| model | A | B | timed steps | median step A / B (ms) | median of per-step B/A | 95 % interval "
             "| total time B/A | B second / B first |", "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['a']} | {r['b']} | error: {r['error'][:120]} ||||||")
            continue
        orders = (f"{r['ratio_b_second']:.4f} / {r['ratio_b_first']:.4f}" if "ratio_b_first" in r
                  else "B second only")
        lines.append(f"| {r['model']} | {r['a']} | {r['b']} | {r['steps']} | {r['median_a_ms']:.2f} / "
                     f"{r['median_b_ms']:.2f} | {r['median_ratio']:.4f} | {r['ci95'][0]:.4f}–{r['ci95'][1]:.4f} "
                     f"| {r['total_ratio']:.4f} | {orders} |")
    return "\n".join(lines) + "\n"


def measure(args: argparse.Namespace, model: str) -> dict:
    """One model: the pair in one order, or both orders pooled (``--orders both``)."""
    cmd_a, cmd_b = child_cmd(args, model, args.a), child_cmd(args, model, args.b)
    logs = args.out / "logs"
    ab = run_pair(cmd_a, cmd_b, args.steps, args.warmup, logs, f"{model}-ab", args.timeout)
    if args.orders == "ab" or "error" in ab:
        return ab
    ba = run_pair(cmd_b, cmd_a, args.steps, args.warmup, logs, f"{model}-ba", args.timeout)
    if "error" in ba:
        return {"error": f"B first: {ba['error']}", "ab": ab, "ba": ba}
    return {**combine_orders(ab, ba, args.warmup), "ab": ab, "ba": ba}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    records = []
    path = args.out / "ab.jsonl"
    path.write_text("")
    for model in args.models:
        rec = measure(args, model)
        rec.update({"model": model, "a": args.a, "b": args.b, "warmup": args.warmup})
        records.append(rec)
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        (args.out / "ab.md").write_text(table(records))
        print(table([rec]).splitlines()[-1], flush=True)
    print()
    print(table(records), end="")
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
