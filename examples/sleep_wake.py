#!/usr/bin/env python3
"""Sleep / wake on a real GPU (issue 22): give memory back without giving up addresses.

    GENPOOL_LIB=target/release/libgenpool_torch.so python3 examples/sleep_wake.py [--weights-gib 6] ...

What it does, in one process, and prints as ONE JSON line at the end (exit code 0 = every check passed;
human-readable progress goes to stderr):

1. installs genpool (``genpool_torch.install()``; ``--no-install`` when the program is already running on
   genpool's backend), builds an MLP whose parameters and Adam state are tagged ``"weights"``
   (``genpool_torch.region``), a KV-cache-like buffer tagged ``"kv"``, and trains it ``--steps`` steps;
2. fills the rest of the GPU with an untagged "filler" so that only ``--margin-gib`` stays free, and starts
   a child process (plain PyTorch, no genpool) that tries to allocate 90 % of the tagged memory: it must
   fail now;
3. ``genpool_torch.sleep(["weights", "kv"], offload=True)``: NVML's used memory must drop by about the
   tagged bytes, every tensor keeps its ``data_ptr()``, an allocation under a sleeping tag raises, and the
   same child must now succeed (it allocates, fills and frees the memory, then exits);
4. ``genpool_torch.wake(...)``: the weights, the Adam state and the KV buffer must be bit-for-bit what they
   were, and ``--steps`` more training steps must give exactly the losses of a reference run that never
   slept (same seed, run afterwards in the same process);
5. times ``--cycles`` sleep+wake cycles per GiB with and without offload, against a vLLM-style baseline
   in the same call: ``cuda.bindings.driver`` ``cuMemCreate``/``cuMemMap``/``cuMemSetAccess`` per 2 MiB
   page over the same bytes, slept by ``cuMemUnmap``/``cuMemRelease`` and woken by creating, mapping and
   setting access again (with offload: ``cuMemcpyDtoH`` to / ``cuMemcpyHtoD`` from a pinned buffer).

Needs torch, nvidia-ml-py (pynvml) and cuda-bindings. Uses only genpool_torch's public Python API.
"""

import argparse
import contextlib
import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# Deterministic cuBLAS, so that the losses of two identical runs are bit-for-bit equal.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

try:
    import genpool_torch as gp
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
    import genpool_torch as gp

GIB = 1 << 30
MIB = 1 << 20
PAGE = 2 * MIB

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--weights-gib", type=float, default=2.0, help="parameters (fp32); Adam state adds 2x")
ap.add_argument("--kv-gib", type=float, default=4.0, help="the KV-cache-like buffer")
ap.add_argument("--width", type=int, default=8192, help="MLP width (layers = weights / width^2)")
ap.add_argument("--batch", type=int, default=512)
ap.add_argument("--steps", type=int, default=10, help="training steps before the sleep and after the wake")
ap.add_argument("--cycles", type=int, default=3, help="timed sleep+wake cycles per mode")
ap.add_argument("--margin-gib", type=float, default=3.0, help="device memory left free by the filler")
ap.add_argument("--no-install", action="store_true", help="genpool is PyTorch's allocator already")
args = ap.parse_args()

if not args.no_install:
    gp.install()
import torch  # noqa: E402
import pynvml  # noqa: E402

torch.use_deterministic_algorithms(True)
torch.backends.cuda.matmul.allow_tf32 = False
dev = torch.device("cuda", 0)
failures = []
result = {"test": "sleep_wake"}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def check(cond, what):
    log(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures.append(what)


def nvml_handle():
    pynvml.nvmlInit()
    props = torch.cuda.get_device_properties(0)
    bus = getattr(props, "pci_bus_id", None)
    if bus is not None:
        dom = getattr(props, "pci_domain_id", 0)
        devid = getattr(props, "pci_device_id", 0)
        bus_id = f"{dom:08x}:{bus:02x}:{devid:02x}.0"
        for arg in (bus_id, bus_id.encode()):
            try:
                return pynvml.nvmlDeviceGetHandleByPciBusId(arg)
            except Exception:  # an older pynvml wants bytes, a newer one str
                pass
    vis = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return pynvml.nvmlDeviceGetHandleByIndex(int(vis) if vis.isdigit() else 0)


NV = None


def nvml_used():
    torch.cuda.synchronize()
    return int(pynvml.nvmlDeviceGetMemoryInfo(NV).used)


# ---- the model ----------------------------------------------------------------------------------------

def build(seed):
    """An MLP of about --weights-gib of fp32 parameters, its Adam optimizer, and a fixed batch."""
    torch.manual_seed(seed)
    layers = max(1, int(args.weights_gib * GIB / 4 / (args.width * args.width)))
    model = torch.nn.Sequential(*[
        m for _ in range(layers)
        for m in (torch.nn.Linear(args.width, args.width, bias=True), torch.nn.GELU())
    ]).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=True)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    x = torch.randn(args.batch, args.width, generator=g).to(dev)
    y = torch.randn(args.batch, args.width, generator=g).to(dev)
    return model, opt, x, y


def train(model, opt, x, y, steps, tag):
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        # Adam's state (made at the first step) belongs with the weights.
        with gp.region(tag) if tag else contextlib.nullcontext():
            opt.step()
        losses.append(float(loss))
    opt.zero_grad(set_to_none=True)
    return losses


def state_tensors(model, opt):
    out = [p.data for p in model.parameters()]
    for st in opt.state.values():
        out += [v for v in st.values() if torch.is_tensor(v) and v.is_cuda]
    return out


CHILD = r"""
import sys, torch
n = int(sys.argv[1])
try:
    t = torch.empty(n, dtype=torch.uint8, device="cuda")
    t.fill_(7)
    torch.cuda.synchronize()
    ok = int(t[-1]) == 7
    del t
    sys.exit(0 if ok else 4)
except torch.OutOfMemoryError:
    sys.exit(3)
"""


def child_alloc(nbytes):
    """A separate process (plain PyTorch, no genpool) allocates and fills `nbytes`; True if it could."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GENPOOL")}
    r = subprocess.run([sys.executable, "-c", CHILD, str(nbytes)], env=env, capture_output=True, text=True)
    if r.returncode not in (0, 3):
        log(f"child exited {r.returncode}: {r.stderr[-2000:]}")
    return r.returncode == 0


# ---- the vLLM-style baseline ---------------------------------------------------------------------------

def baseline(nbytes, cycles):
    """cuMemCreate / cuMemMap / cuMemSetAccess per 2 MiB page over `nbytes`, then `cycles` sleep+wake
    cycles (unmap + release; create + map + set access), without and with offload. Seconds per cycle."""
    from cuda.bindings import driver as cu

    def ok(r):
        err = r[0] if isinstance(r, tuple) else r
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver error {err}")
        return r[1] if isinstance(r, tuple) and len(r) == 2 else r

    ok(cu.cuInit(0))
    torch.cuda.synchronize()  # torch's primary context is current on this thread
    ordinal = torch.cuda.current_device()
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = ordinal
    desc = cu.CUmemAccessDesc()
    desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = ordinal
    desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    n = max(1, nbytes // PAGE)
    size = n * PAGE
    base = int(ok(cu.cuMemAddressReserve(size, PAGE, 0, 0)))
    vas = [cu.CUdeviceptr(base + i * PAGE) for i in range(n)]

    def wake():
        hs = []
        for va in vas:
            h = ok(cu.cuMemCreate(PAGE, prop, 0))
            ok(cu.cuMemMap(va, PAGE, 0, h, 0))
            ok(cu.cuMemSetAccess(va, PAGE, [desc], 1))
            hs.append(h)
        return hs

    def sleep(hs):
        for va, h in zip(vas, hs):
            ok(cu.cuMemUnmap(va, PAGE))
            ok(cu.cuMemRelease(h))

    host = int(ok(cu.cuMemAllocHost(size)))  # pinned, outside the timing (PyTorch caches pinned memory)
    hs = wake()
    times = {"discard": [], "offload": []}
    for mode in ("discard", "offload"):
        # A discarding cycle leaves the contents undefined: the offloaded ones start from a known pattern.
        ok(cu.cuMemsetD8(cu.CUdeviceptr(base), 0x42, size))
        for _ in range(cycles):
            ok(cu.cuCtxSynchronize())
            t0 = time.perf_counter()
            if mode == "offload":
                for i, va in enumerate(vas):
                    ok(cu.cuMemcpyDtoH(host + i * PAGE, va, PAGE))
            sleep(hs)
            hs = wake()
            if mode == "offload":
                for i, va in enumerate(vas):
                    ok(cu.cuMemcpyHtoD(va, host + i * PAGE, PAGE))
            ok(cu.cuCtxSynchronize())
            times[mode].append(time.perf_counter() - t0)
    ok(cu.cuMemcpyDtoH(host, cu.CUdeviceptr(base + size - 16), 16))
    restored = ctypes.string_at(host, 16) == b"\x42" * 16
    sleep(hs)
    ok(cu.cuMemAddressFree(cu.CUdeviceptr(base), size))
    ok(cu.cuMemFreeHost(host))
    return size, times, restored


# ---- the run ------------------------------------------------------------------------------------------

def main():
    global NV
    NV = nvml_handle()
    torch.cuda.init()
    total = torch.cuda.get_device_properties(0).total_memory
    result["device"] = torch.cuda.get_device_name(0)

    with gp.region("weights"):
        model, opt, x, y = build(seed=1234)
    with gp.region("kv"):
        kv = torch.empty(int(args.kv_gib * GIB) // 2, dtype=torch.float16, device=dev)
        torch.manual_seed(7)
        kv.normal_()  # in place: no temporary
    losses_a = train(model, opt, x, y, args.steps, "weights")
    tensors = state_tensors(model, opt) + [kv]
    tagged_bytes = sum(t.numel() * t.element_size() for t in tensors)
    result["tagged_gib"] = round(tagged_bytes / GIB, 3)
    ptrs = [t.data_ptr() for t in tensors]
    snapshot = [t.detach().cpu() for t in tensors]
    log(f"tagged {tagged_bytes / GIB:.2f} GiB in {len(tensors)} tensors; losses {losses_a[0]:.6f} .. {losses_a[-1]:.6f}")

    # Fill the GPU so that the child cannot get the tagged memory unless it is released.
    gp.empty_cache()
    torch.cuda.synchronize()
    free, _ = torch.cuda.mem_get_info()
    filler_bytes = max(0, free - int(args.margin_gib * GIB))
    filler = torch.empty(filler_bytes, dtype=torch.uint8, device=dev) if filler_bytes else None
    child_bytes = int(0.9 * tagged_bytes)
    result["child_gib"] = round(child_bytes / GIB, 3)
    ok_before = child_alloc(child_bytes)
    check(not ok_before, f"before sleep a plain-PyTorch process cannot get {child_bytes / GIB:.2f} GiB")

    used_awake = nvml_used()
    t0 = time.perf_counter()
    gp.sleep(["weights", "kv"], offload=True)
    t_sleep = time.perf_counter() - t0
    used_asleep = nvml_used()
    dropped = used_awake - used_asleep
    result["nvml_used_awake_gib"] = round(used_awake / GIB, 3)
    result["nvml_used_asleep_gib"] = round(used_asleep / GIB, 3)
    check(dropped >= 0.97 * tagged_bytes, f"NVML used dropped by {dropped / GIB:.2f} GiB (tagged {tagged_bytes / GIB:.2f})")
    check(set(gp.sleeping()) >= {"weights", "kv"}, f"sleeping() = {gp.sleeping()}")
    check([t.data_ptr() for t in tensors] == ptrs, "every tensor keeps its pointer while asleep")
    info = {t["name"]: t for t in gp.tags_info()["tags"]}
    check(all(d["reserved_current"] == 0 for n in ("weights", "kv") for d in info[n]["devices"]),
          "the tags reserve nothing while asleep")
    try:
        with gp.region("weights"):
            torch.empty(1024, device=dev)
        check(False, "an allocation under a sleeping tag raises")
    except RuntimeError as e:
        check("asleep" in str(e), f"an allocation under a sleeping tag raises: {str(e)[:120]}")
    ok_asleep = child_alloc(child_bytes)
    check(ok_asleep, f"while asleep another process allocates {child_bytes / GIB:.2f} GiB")

    t0 = time.perf_counter()
    gp.wake(["weights", "kv"])
    t_wake = time.perf_counter() - t0
    result["first_cycle_s"] = round(t_sleep + t_wake, 4)
    check([t.data_ptr() for t in tensors] == ptrs, "same pointers after wake")
    same = all(torch.equal(a, t.detach().cpu()) for a, t in zip(snapshot, tensors))
    check(same, "weights, Adam state and KV buffer are bit for bit what they were")
    del snapshot
    # Training needs room for its gradients and activations again.
    del filler
    gp.empty_cache()
    losses_b = train(model, opt, x, y, args.steps, "weights")

    # Timed cycles (the pinned buffer is kept between offloaded cycles).
    gib = tagged_bytes / GIB
    genpool_times = {}
    for mode, offload in (("discard", False), ("offload", True)):
        ts = []
        for _ in range(args.cycles):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            gp.sleep(["weights", "kv"], offload=offload)
            gp.wake(["weights", "kv"])
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        genpool_times[mode] = ts
    # (A discarding cycle leaves the contents undefined: nothing below reads them; the reference run
    # builds its own model.)
    del model, opt, kv, tensors, x, y
    gp.empty_cache()
    torch.cuda.synchronize()

    base_bytes, base_times, base_restored = baseline(tagged_bytes, args.cycles)
    check(base_restored, "baseline offload restores its bytes")

    # Reference run: the same training, never asleep.
    model, opt, x, y = build(seed=1234)
    ref = train(model, opt, x, y, 2 * args.steps, None)
    equal = ref == losses_a + losses_b
    check(equal, "losses after the wake equal a run that never slept")
    result["losses_equal"] = equal
    result["max_loss_diff"] = max(abs(a - b) for a, b in zip(ref, losses_a + losses_b))
    result["losses"] = [round(v, 8) for v in losses_a + losses_b]
    del model, opt, x, y

    def per_gib(ts, nbytes):
        ts = sorted(ts)
        return round(ts[len(ts) // 2] / (nbytes / GIB) * 1e3, 2)

    result["genpool_ms_per_gib"] = {m: per_gib(ts, tagged_bytes) for m, ts in genpool_times.items()}
    result["vllm_style_ms_per_gib"] = {m: per_gib(ts, base_bytes) for m, ts in base_times.items()}
    result["genpool_over_vllm_style"] = {
        m: round(result["genpool_ms_per_gib"][m] / result["vllm_style_ms_per_gib"][m], 3)
        for m in genpool_times
    }
    result["cycle_bytes_gib"] = round(gib, 3)
    result["total_mem_gib"] = round(total / GIB, 2)
    result["checks_failed"] = failures
    result["ok"] = not failures
    print(json.dumps(result), flush=True)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
