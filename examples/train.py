#!/usr/bin/env python3
"""Train a random-init model for a few steps under a chosen CUDA allocator.

    python3 examples/train.py --model gpt2 --allocator genpool --steps 23 --warmup 3 [--json]
    python3 examples/train.py --model gpt2 --check-losses        # genpool's first 20 losses == native's

Models (random init from configs directly on the GPU, no downloads; bf16 autocast):
  gpt2          GPT-2 small (12 layers), batch 8 x 1024 tokens, AdamW
  gpt2-tiny     GPT-2 with 2 layers, d=128, batch 2 x 128 tokens, AdamW (for compute-sanitizer runs)
  gpt2m-varlen  GPT-2 medium (24 layers), batch 4-16 x 32-1024 tokens (random per step), AdamW
  llama-ckpt    a ~0.3B Llama (12 layers, d=1024, GQA) with gradient checkpointing, batch 4 x 128-2048
                tokens (random per step), AdamW
  resnet50      torchvision ResNet-50, batch 64, 224x224, channels_last, SGD with momentum

Allocators: native (PyTorch's caching allocator), expandable (expandable_segments:True), async
(backend:cudaMallocAsync), genpool (this project, through CUDAPluggableAllocator; the library is found via
GENPOOL_LIB or the repository's target/release), floor (examples/floor_alloc.cpp through the same hook: an
exact-size cache that never frees, one stream only — a measuring instrument for the hook's own cost, not an
allocator to train with).

Step time: no host synchronisation inside the loop (the losses are read after it, as a training loop that
logs asynchronously does). A CUDA event is recorded on the compute stream at the end of every step;
"median_step_ms" is the median over the timed steps (after --warmup) of the time between consecutive
step-end events, so it includes any time the GPU waits for the host (allocator calls included).
"mean_step_ms" is the wall time of the timed steps (synchronize before and after) divided by their number.

Peak device memory is measured the same way for every allocator, from outside the allocator: a thread
samples NVML every 2 ms — this process's used memory (nvmlDeviceGetComputeRunningProcesses) when NVML
lists the process, else the device's used memory minus its value before CUDA was initialised — or, without
NVML (no `pynvml` module), torch.cuda.mem_get_info() deltas from just after CUDA initialisation, sampled
the same way. "peak_method" names how the peak sample was taken. The NVML figures include the CUDA
context and library workspaces, identical across allocators; a reservation held for less than the 2 ms
sampling interval can be missed (the allocator's own "allocator_reserved_peak" is reported beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODELS = ("gpt2", "gpt2m-varlen", "llama-ckpt", "resnet50", "gpt2-tiny")
ALLOCATORS = ("native", "expandable", "async", "genpool", "floor")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=MODELS, default="gpt2")
    p.add_argument("--allocator", choices=ALLOCATORS, default="native")
    p.add_argument("--steps", type=int, default=23, help="steps in all, warmup included")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the step times")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deterministic", action="store_true",
                   help="fixed seeds, torch.use_deterministic_algorithms(True), eager attention")
    p.add_argument("--json", action="store_true", help="print one JSON line at the end")
    p.add_argument("--quiet", action="store_true", help="no per-step lines")
    p.add_argument("--check-losses", action="store_true",
                   help="run native and genpool deterministically in fresh processes; compare the losses")
    p.add_argument("--check-steps", type=int, default=20)
    p.add_argument("--genpool-conf", default=None, help="GENPOOL_CONF for the genpool run")
    p.add_argument("--sample-ms", type=float, default=2.0,
                   help="NVML peak-memory sampling interval in ms (0 = no sampling thread: peak_bytes is null)")
    p.add_argument("--lockstep", action="store_true",
                   help="driven by examples/ab_steps.py: print 'ready', then run one step per 'go' line on stdin, "
                        "synchronize, and print 'step I MS'")
    p.add_argument("--record-trace", type=Path, default=None,
                   help="native only: record every allocation and free (PyTorch's memory history) and write "
                        "them as a genpool trace (gzip'd CSV, benches/traces/README.md) to this path")
    p.add_argument("--genpool-timing", action="store_true",
                   help="GENPOOL_TIMING=1: genpool times its malloc/free calls on the host (a little overhead)")
    args = p.parse_args(argv)
    if args.sample_ms < 0:
        p.error("--sample-ms must not be negative")
    if args.record_trace is not None and args.allocator != "native":
        p.error("--record-trace needs --allocator native (it reads PyTorch's own allocator's history)")
    if args.steps < 1 or args.warmup < 0 or args.check_steps < 1:
        p.error("--steps and --check-steps must be at least 1, --warmup at least 0")
    return args


def configure_allocator_env(args) -> None:
    """Environment that must be in place before torch initialises CUDA."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    extra = {"expandable": "expandable_segments:True", "async": "backend:cudaMallocAsync"}.get(args.allocator)
    if extra:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = f"{conf},{extra}" if conf else extra
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if args.genpool_conf:
        os.environ["GENPOOL_CONF"] = args.genpool_conf
    if args.genpool_timing:
        os.environ["GENPOOL_TIMING"] = "1"


def install_floor(torch):
    """Compile (once, cached next to genpool's wrapper) and install examples/floor_alloc.cpp."""
    import hashlib

    src = (REPO / "examples" / "floor_alloc.cpp").read_text()
    out_dir = Path(os.environ.get("GENPOOL_SHIM_DIR", Path.home() / ".cache" / "genpool_torch"))
    so = out_dir / f"floor_alloc_{hashlib.sha1(src.encode()).hexdigest()[:12]}.so"
    if not so.is_file():
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = so.with_suffix(f".{os.getpid()}.tmp")
        cmd = [os.environ.get("GENPOOL_CXX", "c++"), "-O2", "-shared", "-fPIC", "-std=c++17", "-x", "c++",
               "-", "-o", str(tmp), "-ldl"]
        res = subprocess.run(cmd, input=src, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"compiling floor_alloc.cpp failed: {res.stderr[-2000:]}")
        os.replace(tmp, so)
    alloc = torch.cuda.memory.CUDAPluggableAllocator(str(so), "floor_malloc", "floor_free")
    torch.cuda.memory.change_current_allocator(alloc)


def _delta(after, before):
    """Numeric leaves of ``after`` minus those of ``before`` (nested dicts; other values dropped)."""
    if isinstance(after, dict):
        out = {}
        for k, v in after.items():
            d = _delta(v, (before or {}).get(k) if isinstance(before, dict) else None)
            if d is not None:
                out[k] = d
        return out
    if isinstance(after, (int, float)) and not isinstance(after, bool):
        return after - (before if isinstance(before, (int, float)) else 0)
    return None


class PeakSampler:
    """Peak device memory of this process, sampled from outside the allocator."""

    def __init__(self, device_index: int = 0, interval: float = 0.002):
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = None
        self.method = "none"  # how the peak sample was taken
        self._nvml = None
        try:
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(self._nvml_index(device_index))
            self._baseline = pynvml.nvmlDeviceGetMemoryInfo(self._handle).used
        except Exception:  # no NVML: fall back to cudaMemGetInfo after CUDA init
            self._nvml = None

    @staticmethod
    def _nvml_index(device_index: int) -> int:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible:
            ids = [v.strip() for v in visible.split(",") if v.strip()]
            if device_index < len(ids) and ids[device_index].isdigit():
                return int(ids[device_index])
        return device_index

    def _sample(self) -> tuple:
        """(bytes used now, how it was measured)."""
        if self._nvml is not None:
            pid = os.getpid()
            try:
                for proc in self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle):
                    if proc.pid == pid and proc.usedGpuMemory is not None:
                        return int(proc.usedGpuMemory), "nvml-process"
            except self._nvml.NVMLError:
                pass
            # The process is not listed (e.g. a PID namespace): device used memory minus the baseline.
            used = int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)
            return used - self._baseline, "nvml-device-delta"
        import torch

        free, total = torch.cuda.mem_get_info()
        return total - free - self._baseline, "cuda-mem_get_info-delta"

    def _take(self) -> None:
        value, method = self._sample()
        if value > self.peak:
            self.peak, self.method = value, method

    def start(self) -> None:
        if self._nvml is None:
            import torch

            torch.cuda.init()
            free, total = torch.cuda.mem_get_info()
            self._baseline = total - free  # the context is already in; measured as a delta from here
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._take()
            except Exception:
                pass
            self._stop.wait(self.interval)

    def stop(self) -> int:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._take()
        return self.peak


def build(args, torch, device):
    """(model, optimizer, step_fn) where step_fn(step_index) runs forward+backward and returns the loss."""
    rng = random.Random(args.seed)  # shapes: identical sequence for every allocator
    attn = {"attn_implementation": "eager"} if args.deterministic else {}
    if args.model == "resnet50":
        import torchvision

        with device:  # initialise on the GPU: seconds less per run than on the CPU
            model = torchvision.models.resnet50(weights=None)
        model = model.to(memory_format=torch.channels_last)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        loss_fn = torch.nn.CrossEntropyLoss()

        def step(_i):
            x = torch.randn(64, 3, 224, 224, device=device).to(memory_format=torch.channels_last)
            y = torch.randint(0, 1000, (64,), device=device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_fn(model(x), y)
            loss.backward()
            return loss

        return model, opt, step

    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if args.model == "gpt2":
        cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024, **attn)
        shape = lambda: (8, 1024)  # noqa: E731
    elif args.model == "gpt2-tiny":
        cfg = GPT2Config(n_layer=2, n_embd=128, n_head=4, n_positions=256, **attn)
        shape = lambda: (2, 128)  # noqa: E731
    elif args.model == "gpt2m-varlen":
        cfg = GPT2Config(n_layer=24, n_embd=1024, n_head=16, n_positions=1024, **attn)
        shape = lambda: (rng.choice((4, 8, 12, 16)), rng.randint(32, 1024))  # noqa: E731
    else:
        cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                          num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048, **attn)
        shape = lambda: (4, rng.randint(128, 2048))  # noqa: E731
    with device:  # initialise on the GPU: seconds less per run than on the CPU
        model = LlamaForCausalLM(cfg) if isinstance(cfg, LlamaConfig) else GPT2LMHeadModel(cfg)
    if isinstance(cfg, LlamaConfig):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    vocab = cfg.vocab_size

    def step(_i):
        b, t = shape()
        ids = torch.randint(0, vocab, (b, t), device=device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss

    return model, opt, step


def train(args) -> dict:
    configure_allocator_env(args)
    sampler = PeakSampler(0, args.sample_ms / 1e3) if args.sample_ms else None  # NVML baseline before CUDA
    gp = None
    if args.allocator == "genpool":
        try:
            import genpool_torch as gp
        except ImportError:
            sys.path.insert(0, str(REPO / "python"))
            import genpool_torch as gp
        gp.install()  # before any CUDA use
    import torch

    if args.allocator == "floor":
        install_floor(torch)  # before any CUDA use

    if args.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.cuda.manual_seed_all(args.seed)
    device = torch.device("cuda", 0)
    if sampler is not None:
        sampler.start()
    if args.record_trace is not None:
        torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                                 max_entries=3_000_000)

    model, opt, step_fn = build(args, torch, device)
    if args.lockstep:
        return lockstep(args, torch, gp, opt, step_fn, sampler)
    warmup = args.warmup if args.steps > args.warmup else 0
    loss_tensors, ends, host, per_step = [], [], [], []
    track = gp is not None and args.genpool_timing  # genpool's counters after every step (diagnostics)
    before = gp.raw_stats(0) if gp is not None and warmup == 0 else None
    start = torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    t0 = time.perf_counter()
    for i in range(args.steps):
        if i == warmup and i > 0:  # the timed steps start from an idle GPU
            torch.cuda.synchronize()
            if gp is not None:
                before = gp.raw_stats(0)
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
        h0 = time.perf_counter()
        loss = one_step(gp, opt, step_fn, i)
        loss_tensors.append(loss.detach())
        host.append((time.perf_counter() - h0) * 1e3)
        if track:
            st = gp.raw_stats(0)
            pg, ht = st.get("pages") or {}, st.get("host_timing") or {}
            per_step.append([pg.get("steals", 0), pg.get("creates", 0), pg.get("move_ns", 0),
                             (ht.get("malloc") or {}).get("ns", 0), (ht.get("malloc") or {}).get("slow", 0),
                             round(st.get("page_slack", 0.0), 4)])
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        ends.append((start, end) if i in (0, warmup) else (ends[-1][1], end))
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    losses = [x.item() for x in loss_tensors]
    times = [a.elapsed_time(b) for a, b in ends]  # ms
    peak = sampler.stop() if sampler is not None else None
    if not args.quiet:
        for i, (value, ms) in enumerate(zip(losses, times)):
            print(f"step {i:4d}  loss {value!r}  time {ms:9.2f} ms", flush=True)
    timed = times[warmup:]
    recorded = write_trace(args.record_trace, torch) if args.record_trace is not None else None
    result = {
        "model": args.model,
        "allocator": args.allocator,
        "steps": args.steps,
        "warmup": warmup,
        "deterministic": args.deterministic,
        "median_step_ms": statistics.median(timed),
        "mean_step_ms": wall * 1e3 / len(timed),
        "step_ms": [round(t, 3) for t in timed],
        # Host time to issue each timed step (Python + PyTorch + allocator); a step is host-bound when
        # this is close to its step time.
        "host_step_ms": [round(t, 3) for t in host[warmup:]],
        "median_host_ms": statistics.median(host[warmup:]),
        "peak_bytes": peak,
        "peak_method": sampler.method if sampler is not None else "none",
        "losses": losses,
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
    }
    if recorded is not None:
        result["trace"] = recorded
    if gp is not None:
        s = gp.raw_stats(0)
        result["allocator_reserved_peak"] = s["reserved_peak"]
        result["allocator_allocated_peak"] = s["allocated_peak"]
        result["genpool_ooms"] = s["num_ooms"]
        result["genpool_invalid_frees"] = s["num_invalid_frees"]
        # Page work over the whole run (creates, maps, unmaps, moves, aliases, synchronizes, fences).
        result["genpool_pages"] = s.get("pages")
        result["genpool_plan"] = s.get("plan")
        if s.get("host_timing"):
            result["genpool_host_timing"] = s["host_timing"]
        if per_step:
            # Cumulative after each step: steals, creates, move_ns, malloc ns, slow mallocs, page slack.
            result["genpool_per_step"] = per_step
        if before is not None:
            # The same counters over the timed steps only (page moves, host time in genpool).
            result["genpool_timed"] = _delta({"pages": s.get("pages"), "host_timing": s.get("host_timing")},
                                             {"pages": before.get("pages"),
                                              "host_timing": before.get("host_timing")})
    else:
        try:
            result["allocator_reserved_peak"] = torch.cuda.max_memory_reserved(0)
            result["allocator_allocated_peak"] = torch.cuda.max_memory_allocated(0)
        except Exception:
            pass
    if result.get("allocator_allocated_peak"):
        result["allocator_ratio"] = result["allocator_reserved_peak"] / result["allocator_allocated_peak"]
    print(f"median step {result['median_step_ms']:.2f} ms; peak {(peak or 0) / 2**20:.1f} MiB "
          f"({result['peak_method']}); allocator reserved peak "
          f"{result.get('allocator_reserved_peak', 0) / 2**20:.1f} MiB", file=sys.stderr if args.json else sys.stdout)
    return result


def write_trace(path: Path, torch) -> dict:
    """Write the allocation history recorded since the model was built as a genpool trace at ``path``
    (python/genpool_torch/capture.py's conversion); returns its summary."""
    try:
        from genpool_torch import capture
    except ImportError:
        sys.path.insert(0, str(REPO / "python"))
        from genpool_torch import capture
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    conv = capture.convert(snap["device_traces"][torch.cuda.current_device()])
    path.parent.mkdir(parents=True, exist_ok=True)
    capture.write_csv(path, conv.rows)
    return {"path": str(path), "events": len(conv.rows), "allocs": conv.allocs, "frees": conv.frees,
            "peak_live": conv.peak_live, "skipped_frees": conv.skipped_frees}


def one_step(gp, opt, step_fn, i):
    """Training step ``i`` (forward, backward, optimizer), marked as a genpool iteration when genpool is
    the allocator; returns the loss tensor (not read: no host synchronisation)."""
    with gp.step() if gp is not None else _null():
        loss = step_fn(i)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return loss


def lockstep(args, torch, gp, opt, step_fn, sampler) -> dict:
    """One step per 'go' on stdin, each timed from its start to a synchronize after it (so the time
    holds the host's work and the GPU's); 'stop' or end of input ends the loop. Driven by
    examples/ab_steps.py, which alternates two such processes step by step: adjacent steps of the two
    see the same machine (clocks, neighbours), which separate runs do not."""
    torch.cuda.synchronize()
    print("ready", flush=True)
    losses, times, host, calls = [], [], [], []
    timing = gp is not None and args.genpool_timing
    for i in range(args.steps):
        line = sys.stdin.readline()
        if not line or line.strip() != "go":
            break
        t0 = time.perf_counter()
        loss = one_step(gp, opt, step_fn, i)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        times.append(ms)
        host.append((t1 - t0) * 1e3)
        if timing:
            ht = gp.raw_stats(0).get("host_timing") or {}
            calls.append([(ht.get(k) or {}).get(f, 0) for k in ("malloc", "free") for f in ("calls", "ns")])
        losses.append(loss.detach())
        print(f"step {i} {ms:.4f}", flush=True)
    peak = sampler.stop() if sampler is not None else None
    result = {"model": args.model, "allocator": args.allocator, "lockstep": True, "steps": len(times),
              "step_ms": [round(t, 4) for t in times], "host_ms": [round(t, 4) for t in host],
              "losses": [x.item() for x in losses],
              "peak_bytes": peak, "peak_method": sampler.method if sampler is not None else "none"}
    if gp is not None:
        s = gp.raw_stats(0)
        result["allocator_reserved_peak"] = s["reserved_peak"]
        result["genpool_pages"] = s.get("pages")
        result["genpool_plan"] = s.get("plan")
        if s.get("host_timing"):
            result["genpool_host_timing"] = s["host_timing"]
        if calls:
            # Cumulative after each step: malloc calls, malloc ns, free calls, free ns.
            result["genpool_calls_per_step"] = calls
    return result


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def run_child(args, allocator: str, steps: int, deterministic: bool) -> dict:
    """Run this script in a fresh process (an allocator can only be chosen before CUDA starts)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--model", args.model, "--allocator", allocator,
           "--steps", str(steps), "--seed", str(args.seed), "--json", "--quiet"]
    if deterministic:
        cmd.append("--deterministic")
    if args.genpool_conf:
        cmd += ["--genpool-conf", args.genpool_conf]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"model": args.model, "allocator": allocator, "error": proc.stderr.strip()[-2000:]}
    return json.loads(lines[-1])


def check_losses(args) -> int:
    native = run_child(args, "native", args.check_steps, True)
    genpool = run_child(args, "genpool", args.check_steps, True)
    for r in (native, genpool):
        if "error" in r:
            print(json.dumps({"check": "losses", "model": args.model, "ok": False, "error": r}))
            return 2
    a, b = native["losses"][: args.check_steps], genpool["losses"][: args.check_steps]
    mismatch = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    ok = len(a) == len(b) == args.check_steps and not mismatch
    print(json.dumps({"check": "losses", "model": args.model, "ok": ok, "steps": args.check_steps,
                      "first_mismatch": mismatch[0] if mismatch else None, "native": a, "genpool": b}))
    return 0 if ok else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.check_losses:
        return check_losses(args)
    result = train(args)
    if args.json:
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
