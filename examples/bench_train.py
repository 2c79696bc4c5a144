#!/usr/bin/env python3
"""Training step time and peak memory for every (model x allocator), each in a fresh process.

One command on the GPU machine produces the table (about 5-6 minutes on an H200 for the default 4 models x
4 allocators with the gpt2 loss check):

    GENPOOL_LIB=.gpu/bin/libgenpool_torch.so python3 examples/bench_train.py --check-losses \\
        --budget-s 510 --out "$OUT/train"

Every run is examples/train.py in a fresh process (an allocator can only be chosen before CUDA starts):
--warmup untimed steps, then --steps timed ones. Step time: the median, over the timed steps, of the time
between consecutive step-end CUDA events on the compute stream (no host sync inside the loop), and the
mean wall time per timed step. Peak memory: a thread samples NVML every 2 ms (this process's used memory,
or the device's used memory minus its value before CUDA started when NVML does not list the process) or,
without the pynvml module, torch.cuda.mem_get_info() deltas; the same method for every allocator, named in
the table's footnote. See examples/train.py for the details.

As it goes, each result is appended to OUT/results.jsonl (one JSON line per run, loss check or skipped
run) and OUT/table.md is rewritten, so a run cut short by a time limit still leaves everything finished
so far; each run's stderr is kept in OUT/logs/. --budget-s: before each run, the time it needs is
estimated (the longest run of the same model so far, else a default per model; a loss check counts as two
runs) and a run that would end past the budget is skipped and marked so; runs are also cut at the budget.
--table FILE prints the table of an existing results.jsonl.

--repeats R runs every (model, allocator) R times, interleaved (repeat r in --allocators order, the next in
reverse, so drift over the call hits both sides alike): the table then shows medians over the runs and,
below it, each repeat's genpool/native ratio and the host time per step (train.py's median host time to
issue a step: close to the step time where the step is host-bound). Host-bound models (ResNet-50 at batch
64, the small shapes of the random-length models) vary by tens of percent between processes on the same
machine; one pair of runs cannot show a 1 % difference.

--check-losses runs train.py --check-losses for each of --check-models (default gpt2): genpool's first
--check-steps losses must equal native's exactly under deterministic algorithms. Exit status: 0 all ran
and matched, 1 an error or a loss mismatch, 2 some runs were skipped for the budget (none failed).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "train.py"
MODELS = ("gpt2", "gpt2m-varlen", "llama-ckpt", "resnet50")
EXTRA_MODELS = ("gpt2-tiny",)
ALLOCATORS = ("native", "expandable", "async", "genpool")
#: Seconds a run of each model is expected to take on an H200 (process start, imports, model build, 23
#: steps), used for the budget until a run of that model has been timed.
DEFAULT_RUN_S = {"gpt2": 25.0, "gpt2m-varlen": 40.0, "llama-ckpt": 40.0, "resnet50": 25.0, "gpt2-tiny": 15.0}
#: A loss check is two deterministic runs (eager attention, deterministic kernels): a little slower.
CHECK_FACTOR = 2.5
RESULTS = "results.jsonl"
TABLE = "table.md"


def _csv_list(value: str, allowed: Sequence[str], what: str) -> List[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise argparse.ArgumentTypeError(
            f"unknown {what} {', '.join(bad) or '(none given)'}; choose from {', '.join(allowed)}")
    return items


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and check the command line (``SystemExit`` with a message on bad input)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    all_models = MODELS + EXTRA_MODELS
    p.add_argument("--models", type=lambda v: _csv_list(v, all_models, "model"), default=list(MODELS),
                   help=f"comma-separated, from {', '.join(all_models)} (default: {','.join(MODELS)})")
    p.add_argument("--allocators", type=lambda v: _csv_list(v, ALLOCATORS, "allocator"),
                   default=list(ALLOCATORS), help=f"comma-separated (default: {','.join(ALLOCATORS)})")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before them (default 3)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per run (a loss check gets twice)")
    p.add_argument("--budget-s", type=float, default=0,
                   help="seconds for everything; runs that would not fit are skipped (0 = no budget)")
    p.add_argument("--out", type=Path, default=Path("bench_train_out"),
                   help=f"folder for {RESULTS}, {TABLE} and logs/ (default bench_train_out)")
    p.add_argument("--check-losses", action="store_true", help="also compare genpool's losses with native's")
    p.add_argument("--check-models", type=lambda v: _csv_list(v, all_models, "model"), default=["gpt2"],
                   help="models whose losses are checked (default gpt2; resnet50 has no deterministic "
                        "backward)")
    p.add_argument("--check-steps", type=int, default=20)
    p.add_argument("--genpool-conf", default=None, help="GENPOOL_CONF for the genpool runs")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each (model, allocator), interleaved: repeat r runs the allocators in order, "
                        "the next one in reverse (default 1)")
    p.add_argument("--sample-ms", type=float, default=None,
                   help="train.py --sample-ms (NVML sampling interval; 0 = none)")
    p.add_argument("--genpool-timing", action="store_true", help="train.py --genpool-timing for genpool runs")
    p.add_argument("--table", type=Path, default=None, metavar="RESULTS_JSONL",
                   help="print the table of an existing results file and exit")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.sample_ms is not None and args.sample_ms < 0:
        p.error("--sample-ms must not be negative")
    if args.steps < 1 or args.warmup < 0 or args.check_steps < 1:
        p.error("--steps and --check-steps must be at least 1, --warmup at least 0")
    if args.timeout <= 0 or args.budget_s < 0:
        p.error("--timeout must be positive and --budget-s not negative")
    if "resnet50" in args.check_models:
        p.error("resnet50's losses cannot be checked: adaptive_avg_pool2d's CUDA backward is not deterministic")
    return args


def train_cmd(args: argparse.Namespace, model: str, allocator: str) -> List[str]:
    """train.py command line of one timed run."""
    cmd = [sys.executable, str(TRAIN), "--model", model, "--allocator", allocator,
           "--steps", str(args.steps + args.warmup), "--warmup", str(args.warmup), "--json", "--quiet"]
    if args.genpool_conf:
        cmd += ["--genpool-conf", args.genpool_conf]
    if args.sample_ms is not None:
        cmd += ["--sample-ms", f"{args.sample_ms:g}"]
    if args.genpool_timing and allocator == "genpool":
        cmd.append("--genpool-timing")
    return cmd


def check_cmd(args: argparse.Namespace, model: str) -> List[str]:
    """train.py command line of one loss check (native vs genpool, deterministic)."""
    cmd = [sys.executable, str(TRAIN), "--model", model, "--check-losses", "--check-steps", str(args.check_steps)]
    if args.genpool_conf:
        cmd += ["--genpool-conf", args.genpool_conf]
    return cmd


def run(cmd: List[str], timeout: float) -> Tuple[Optional[dict], Optional[str], str]:
    """Run ``cmd`` in a new process group; returns (last JSON line of stdout or None, error or None,
    stderr). On timeout the whole group is killed (train.py --check-losses starts children)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        return None, f"timed out after {timeout:.0f} s", err or ""
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if proc.returncode not in (0, 1) or not lines:
        return None, (err.strip() or out.strip() or f"exit status {proc.returncode}")[-1500:], err
    try:
        return json.loads(lines[-1]), None, err
    except json.JSONDecodeError as e:
        return None, f"bad JSON line from {cmd[1]}: {e}", err


class Budget:
    """Seconds left of ``total`` (0 = unlimited) on ``clock``."""

    def __init__(self, total: float, clock: Callable[[], float]):
        self.total = total
        self.clock = clock
        self.start = clock()

    def left(self) -> float:
        """Seconds left (infinity without a budget)."""
        if not self.total:
            return float("inf")
        return self.total - (self.clock() - self.start)

    def skip_reason(self, estimate: float) -> Optional[str]:
        """Why a run estimated at ``estimate`` s must be skipped, or None if it fits."""
        left = self.left()
        if estimate <= left:
            return None
        return f"budget: needs ~{estimate:.0f} s, {max(left, 0):.0f} s of {self.total:.0f} s left"


def estimate_s(model: str, durations: Dict[str, List[float]], check: bool = False) -> float:
    """Expected seconds of a run (or, with ``check``, a loss check) of ``model``: the longest run of it
    so far, else its default."""
    done = durations.get(model)
    base = max(done) if done else DEFAULT_RUN_S.get(model, max(DEFAULT_RUN_S.values()))
    return base * CHECK_FACTOR if check else base


def _ratio(x, base) -> str:
    return f"{x / base:.3f}x" if x and base else "-"


def _mib(x) -> str:
    return f"{x / 2**20:.0f}" if isinstance(x, (int, float)) else "-"


def _median(xs: Sequence[float]) -> Optional[float]:
    xs = sorted(x for x in xs if isinstance(x, (int, float)))
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def _runs_by_key(records: Iterable[Dict[str, Any]]) -> Dict[Tuple[str, str], List[Dict[str, Any]]]:
    runs: Dict[Tuple[str, str], List[Dict[str, Any]]] = {}
    for r in records:
        if r.get("kind") == "run":
            runs.setdefault((r["model"], r["allocator"]), []).append(r)
    return runs


def _summary(rs: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """Median over the successful runs of one (model, allocator) of each figure; None if none ran."""
    ok = [r for r in rs if "skipped" not in r and "error" not in r]
    if not ok:
        return None
    keys = ("median_step_ms", "mean_step_ms", "peak_bytes", "allocator_reserved_peak",
            "allocator_allocated_peak", "median_host_ms")
    out = {k: _median([r.get(k) for r in ok]) for k in keys}
    out["runs"] = len(ok)
    out["peak_method"] = ok[-1].get("peak_method", "?")
    return out


def format_table(records: Iterable[Dict[str, Any]]) -> str:
    """Markdown table of result records (as written to results.jsonl), rows in the order first seen,
    step times and peaks relative to the same model's native run. With several runs of a (model,
    allocator) (--repeats), every figure is the median over its runs, and a second table gives the run
    count and the ratio to native of each repeat (runs of the same repeat index are interleaved: the
    fairest pairs)."""
    records = list(records)
    checks: Dict[str, str] = {}
    for r in records:
        if r.get("kind") == "check":
            checks[r["model"]] = ("skipped" if "skipped" in r else "error" if "error" in r
                                  else "equal" if r.get("ok") else "DIFFER")
    runs = _runs_by_key(records)
    sums = {k: _summary(v) for k, v in runs.items()}
    lines = ["| model | allocator | median step (ms) | vs native | mean step (ms) | peak memory (MiB) "
             "| vs native | allocator reserved / allocated peak (MiB) | losses vs native |",
             "|---|---|---|---|---|---|---|---|---|"]
    methods = set()
    for (model, alloc), rs in runs.items():
        base = sums.get((model, "native")) or {}
        check = checks.get(model, "-") if alloc == "genpool" else ""
        r = sums[(model, alloc)]
        if r is None:
            last = rs[-1]
            if "skipped" in last:
                lines.append(f"| {model} | {alloc} | skipped ({last['skipped']}) ||||||{check} |")
                continue
            msg = ((last.get("error") or "?").strip().splitlines()[-1:] or ["?"])[0].replace("|", "/")[:160]
            lines.append(f"| {model} | {alloc} | error: {msg} ||||||{check} |")
            continue
        methods.add(r["peak_method"])
        mean = r.get("mean_step_ms")
        lines.append(
            f"| {model} | {alloc} | {r['median_step_ms']:.2f} | "
            f"{_ratio(r['median_step_ms'], base.get('median_step_ms'))} | "
            f"{'-' if mean is None else f'{mean:.2f}'} | "
            f"{_mib(r.get('peak_bytes'))} | {_ratio(r.get('peak_bytes'), base.get('peak_bytes'))} | "
            f"{_mib(r.get('allocator_reserved_peak'))} / {_mib(r.get('allocator_allocated_peak'))} | {check} |")
    for model, state in checks.items():
        if (model, "genpool") not in runs:
            lines.append(f"| {model} | genpool (loss check only) |||||||{state} |")
    if methods:
        lines.append("")
        lines.append(f"Peak memory sampled by: {', '.join(sorted(methods))}.")
    if any((s or {}).get("runs", 0) > 1 for s in sums.values()):
        lines += ["", "| model | allocator | runs | median step, per repeat / native's (sorted) "
                  "| median host time per step (ms) | vs native |", "|---|---|---|---|---|---|"]
        for (model, alloc), rs in runs.items():
            r = sums[(model, alloc)]
            if r is None or alloc == "native":
                continue
            native = {x.get("repeat"): x for x in runs.get((model, "native"), []) if "median_step_ms" in x}
            pairs = sorted(x["median_step_ms"] / native[x.get("repeat")]["median_step_ms"]
                           for x in rs if "median_step_ms" in x and x.get("repeat") in native)
            base = sums.get((model, "native")) or {}
            host = r.get("median_host_ms")
            lines.append(f"| {model} | {alloc} | {r['runs']} | {', '.join(f'{p:.3f}' for p in pairs) or '-'} | "
                         f"{'-' if host is None else f'{host:.2f}'} | "
                         f"{_ratio(host, base.get('median_host_ms'))} |")
    return "\n".join(lines) + "\n"


def read_records(path: Path) -> List[Dict[str, Any]]:
    """The records of a results.jsonl (lines that are not JSON objects are ignored)."""
    out = []
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(r, dict):
            out.append(r)
    return out


class Recorder:
    """Appends records to OUT/results.jsonl and rewrites OUT/table.md after each."""

    def __init__(self, out: Path):
        self.out = out
        (out / "logs").mkdir(parents=True, exist_ok=True)
        self.path = out / RESULTS
        self.path.write_text("")
        self.records: List[Dict[str, Any]] = []

    def add(self, record: Dict[str, Any]) -> None:
        """Keep ``record``, append it to the results file and print it."""
        self.records.append(record)
        line = json.dumps(record)
        with open(self.path, "a") as f:
            f.write(line + "\n")
        (self.out / TABLE).write_text(format_table(self.records))
        print(line, flush=True)

    def log(self, name: str, text: str) -> None:
        """Keep a run's stderr."""
        (self.out / "logs" / f"{name}.log").write_text(text)


def main(argv: Optional[Sequence[str]] = None, runner=run, clock: Callable[[], float] = time.monotonic) -> int:
    """Entry point; ``runner`` and ``clock`` are replaceable for tests."""
    args = parse_args(argv)
    if args.table is not None:
        print(format_table(read_records(args.table)), end="")
        return 0
    budget = Budget(args.budget_s, clock)
    rec = Recorder(args.out)
    durations: Dict[str, List[float]] = {}
    failed = skipped = 0

    def timed(cmd, key, name, timeout, est):
        """Run ``cmd`` unless ``est`` exceeds the budget; returns ((result, error, seconds), None) or
        (None, why it was skipped). Its time joins ``durations[key]``."""
        reason = budget.skip_reason(est)
        if reason:
            return None, reason
        t = clock()
        res, err, stderr = runner(cmd, min(timeout, max(budget.left(), 1.0)))
        dt = clock() - t
        durations.setdefault(key, []).append(dt)
        rec.log(name, stderr)
        return (res, err, dt), None

    for model in args.models:
        for rep in range(args.repeats):
            order = args.allocators if rep % 2 == 0 else args.allocators[::-1]
            for alloc in order:
                name = f"{model}-{alloc}" + (f"-{rep}" if args.repeats > 1 else "")
                done, reason = timed(train_cmd(args, model, alloc), model, name, args.timeout,
                                     estimate_s(model, durations))
                extra = {"repeat": rep} if args.repeats > 1 else {}
                if reason:
                    skipped += 1
                    rec.add({"kind": "run", "model": model, "allocator": alloc, "skipped": reason, **extra})
                    continue
                res, err, dt = done
                if res is None:
                    failed += 1
                    res = {"model": model, "allocator": alloc, "error": err}
                res.pop("losses", None)
                res["kind"] = "run"
                res["elapsed_s"] = round(dt, 1)
                res.update(extra)
                rec.add(res)
        if args.check_losses and model in args.check_models:
            done, reason = timed(check_cmd(args, model), f"{model}-check", f"{model}-check",
                                 2 * args.timeout, estimate_s(model, durations, check=True))
            if reason:
                skipped += 1
                rec.add({"kind": "check", "model": model, "skipped": reason})
                continue
            res, err, dt = done
            if res is None:
                res = {"model": model, "error": err}
            failed += not res.get("ok")
            res["kind"] = "check"
            res["elapsed_s"] = round(dt, 1)
            rec.add(res)
    for model in args.check_models if args.check_losses else ():
        if model not in args.models:
            print(f"note: --check-models {model} is not among --models; not checked", file=sys.stderr)

    table = format_table(rec.records)
    print()
    print(table, end="")
    if skipped:
        print(f"\n{skipped} run(s) skipped for the budget of {args.budget_s:.0f} s.")
    return 1 if failed else 2 if skipped else 0


if __name__ == "__main__":
    sys.exit(main())
