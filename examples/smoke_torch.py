#!/usr/bin/env python3
"""Smoke test of genpool as PyTorch's allocator on a real GPU (exit code 0 = all checks passed).

    GENPOOL_LIB=target/release/libgenpool_torch.so python3 examples/smoke_torch.py

Checks: install before CUDA use; tensors on the default and a side stream; Tensor.record_stream across
streams; a matmul result equal to the one computed on the CPU; torch.cuda.empty_cache() reaching genpool;
set_per_process_memory_fraction capping allocations; an impossible allocation raising
torch.OutOfMemoryError and the pool staying usable; statistics balanced at the end (no invalid frees).
"""

import sys
from pathlib import Path

try:
    import genpool_torch as gp
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
    import genpool_torch as gp

gp.install()
import torch  # noqa: E402

failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


dev = torch.device("cuda", 0)
a_cpu = torch.randn(512, 512)
b_cpu = torch.randn(512, 512)
a, b = a_cpu.to(dev), b_cpu.to(dev)
c = a @ b
check(torch.allclose(c.cpu(), a_cpu @ b_cpu, rtol=1e-3, atol=1e-3), "matmul through genpool blocks")
s = gp.memory_stats()
check(s["allocated_bytes.all.current"] >= 3 * 512 * 512 * 4, f"allocated {s['allocated_bytes.all.current']} B")

side = torch.cuda.Stream()
with torch.cuda.stream(side):
    x = torch.ones(1 << 20, device=dev)
    y = x * 2
torch.cuda.current_stream().wait_stream(side)
y.record_stream(torch.cuda.current_stream())
z = torch.empty(1 << 20, device=dev)
with torch.cuda.stream(side):
    z.copy_(y)
z.record_stream(side)
del x, y
torch.cuda.synchronize()
check(float(z.sum()) == 2.0 * (1 << 20), "cross-stream use with record_stream")
del z
torch.cuda.synchronize()

for _ in range(50):
    t = [torch.empty(int(n), device=dev) for n in torch.randint(1, 1 << 22, (32,))]
    del t
held = gp.memory_reserved()
torch.cuda.empty_cache()
check(gp.memory_reserved() <= held, f"empty_cache: {held} -> {gp.memory_reserved()} B reserved")

total = torch.cuda.get_device_properties(0).total_memory
for what, nbytes in (("larger than the device", 2 * total), ("more than is free", int(0.9 * total))):
    keep = torch.empty(int(0.5 * total), dtype=torch.uint8, device=dev) if nbytes < total else None
    try:
        torch.empty(nbytes, dtype=torch.uint8, device=dev)
        check(False, f"{what}: raises torch.OutOfMemoryError")
    except torch.OutOfMemoryError as e:
        check(True, f"{what}: raises torch.OutOfMemoryError ({str(e)[:100]}...)")
    # Right after a failed allocation (its release-and-retry gave back every cache), genpool should hold
    # little beyond the live blocks: cuBLAS, cuDNN and NCCL allocate outside any allocator.
    free, _ = torch.cuda.mem_get_info()
    raw = gp.raw_stats()
    print(f"     after OOM: genpool live {raw['allocated_current']} B, reserved {raw['reserved_current']} B; "
          f"driver free {free} B")
    check(raw["reserved_current"] - raw["allocated_current"] < total // 10,
          f"{what}: after out-of-memory genpool holds little beyond its live blocks")
    del keep
torch.cuda.empty_cache()
ok = torch.ones(1024, device=dev)
check(float(ok.sum()) == 1024.0, "usable after out-of-memory")

torch.cuda.set_per_process_memory_fraction(0.05, 0)
try:
    torch.empty(int(0.1 * total), dtype=torch.uint8, device=dev)
    check(False, "memory fraction caps allocations")
except torch.OutOfMemoryError:
    check(True, "memory fraction caps allocations")
torch.cuda.set_per_process_memory_fraction(1.0, 0)
big = torch.empty(int(0.1 * total), dtype=torch.uint8, device=dev)
check(big.numel() == int(0.1 * total), "raised fraction allows it again")
del big

with gp.step():
    w = torch.randn(1024, 1024, device=dev, requires_grad=True)
    (w @ w).sum().backward()
    del w
del a, b, c
torch.cuda.synchronize()
raw = gp.raw_stats()
print("     stats:", {k: raw[k] for k in ("allocated_current", "allocated_peak", "reserved_peak", "num_allocs",
                                          "num_frees", "num_ooms", "num_invalid_frees", "stream_waits")})
check(raw["num_invalid_frees"] == 0, "no invalid frees")
check(raw["stream_waits"] >= 1, "record_stream produced stream waits")
print("PASS" if not failures else f"FAILED: {failures}")
sys.exit(1 if failures else 0)
