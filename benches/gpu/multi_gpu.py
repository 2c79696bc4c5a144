"""PyTorch's memory features across two GPUs under one allocator mode: each device's statistics apart,
copies between the devices (a contiguous one, and a transposed one that a kernel on one device does by
reading the other's memory: peer access to genpool's pages), a model split over the two devices trained a
few steps, DDP over NCCL with one process per GPU, and a CUDA tensor sent to a child process that uses it
on the other device. Needs two GPUs; a probe that finds fewer fails.

usage:  python3 benches/gpu/multi_gpu.py [--modes native,expandable,genpool] [--json out.jsonl]
Each mode runs in a process of its own (``--mode M`` runs one in this process); one JSON line a probe.
A probe passes when it raises nothing and its checks hold; figures that must equal across modes (losses,
checksums) are compared in the table printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compat import MIB, check, install, run_one, summary  # noqa: E402 - the suite's pieces, shared

TIMEOUT = int(os.environ.get("MULTI_GPU_TIMEOUT", "240"))
PROBES = {}


def probe(fn):
    PROBES[fn.__name__[2:]] = fn
    return fn


def need_two(torch):
    check(torch.cuda.device_count() >= 2, f"two GPUs needed, {torch.cuda.device_count()} found")


@probe
def p_two_devices_apart(torch):
    """Each device's statistics count its own blocks only; empty_cache gives both back."""
    need_two(torch)
    base = [torch.cuda.memory_allocated(d) for d in (0, 1)]
    a = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda:0")
    b = torch.empty(96 * MIB, dtype=torch.uint8, device="cuda:1")
    got = [torch.cuda.memory_allocated(d) - base[d] for d in (0, 1)]
    check(got == [64 * MIB, 96 * MIB], f"allocated per device {got}")
    check(all(torch.cuda.memory_reserved(d) >= torch.cuda.memory_allocated(d) for d in (0, 1)),
          "reserved >= allocated on each device")
    check(torch.cuda.memory_stats(1)["allocation.all.current"] >= 1, "device 1 counts its block")
    del a, b
    torch.cuda.empty_cache()
    left = [torch.cuda.memory_reserved(d) for d in (0, 1)]
    check(all(x <= 2 * MIB for x in left), f"reserved after empty_cache {left}")
    free1, total1 = torch.cuda.mem_get_info(1)
    check(0 < free1 <= total1, "mem_get_info(1)")
    return {"allocated_mib": [g // MIB for g in got]}


@probe
def p_peer_copies(torch):
    """Copies between the devices: contiguous (a copy engine), transposed (a kernel reading the peer's
    memory), and back; the values must survive, and a checksum equal across modes."""
    need_two(torch)
    g = torch.Generator(device="cuda:0").manual_seed(7)
    x = torch.randn(2048, 3072, device="cuda:0", generator=g)
    y = x.to("cuda:1")
    check(torch.equal(y.to("cuda:0"), x), "contiguous round trip")
    t = x.t().to("cuda:1")  # non-contiguous source: a copy kernel over peer memory
    check(torch.equal(t.to("cuda:0"), x.t().contiguous()), "transposed copy")
    u = y.t().contiguous().to("cuda:0", non_blocking=True)
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    check(torch.equal(u, x.t()), "non-blocking copy back")
    peer = torch.cuda.can_device_access_peer(0, 1)
    return {"checksum": round(float(t.double().sum().item()), 3), "peer_access": bool(peer)}


@probe
def p_model_split_over_two(torch):
    """A model with one layer on each device trained five steps: losses equal across modes."""
    need_two(torch)
    torch.manual_seed(0)
    l0 = torch.nn.Linear(512, 2048).to("cuda:0")
    l1 = torch.nn.Linear(2048, 16).to("cuda:1")
    opt = torch.optim.SGD(list(l0.parameters()) + list(l1.parameters()), lr=0.05)
    gen = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(5):
        x = torch.randn(128, 512, generator=gen).to("cuda:0")
        y = torch.randn(128, 16, generator=gen).to("cuda:1")
        h = torch.relu(l0(x)).to("cuda:1")
        loss = torch.nn.functional.mse_loss(l1(h), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(round(loss.item(), 5))
    check(all(torch.cuda.memory_allocated(d) > 0 for d in (0, 1)), "both devices hold the model")
    return {"losses": losses}


def _ddp_worker(rank, store, mode, q):
    try:
        install(mode)
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=2,
                                device_id=torch.device("cuda", rank))
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 16)).cuda()
        model = DDP(m, device_ids=[rank])
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(3 + rank)
        losses = []
        for _ in range(5):
            x, y = torch.randn(64, 256, generator=gen).cuda(), torch.randn(64, 16, generator=gen).cuda()
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(round(loss.item(), 5))
        # The replicas stay equal (the all-reduce worked on genpool's memory).
        w = m[0].weight.detach().clone()
        others = [torch.empty_like(w) for _ in range(2)]
        dist.all_gather(others, w)
        same = bool(torch.equal(others[0], others[1]))
        t = torch.full((1 << 20,), float(rank + 1), device="cuda")
        dist.all_reduce(t)
        reduced = bool((t == 3.0).all())
        dist.destroy_process_group()
        q.put({"rank": rank, "losses": losses, "replicas_equal": same, "all_reduce": reduced,
               "backend": __import__("genpool_torch").active_backend() if mode == "genpool" else None})
    except Exception as e:  # noqa: BLE001 - reported to the parent
        q.put({"rank": rank, "error": f"{type(e).__name__}: {e}"[:400]})


@probe
def p_ddp_two_processes(torch):
    """DDP over NCCL, one process per GPU, five steps: replicas equal, losses equal across modes."""
    need_two(torch)
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    store = tempfile.mktemp(prefix="genpool_ddp_")
    mode = os.environ["MULTI_GPU_MODE"]
    ps = [ctx.Process(target=_ddp_worker, args=(r, store, mode, q)) for r in (0, 1)]
    for p in ps:
        p.start()
    res = sorted((q.get(timeout=180) for _ in ps), key=lambda r: r["rank"])
    for p in ps:
        p.join(30)
    for r in res:
        check("error" not in r, f"rank {r['rank']}: {r.get('error')}")
        check(r["replicas_equal"] and r["all_reduce"], f"rank {r['rank']}: {r}")
    check(all(p.exitcode == 0 for p in ps), f"exit codes {[p.exitcode for p in ps]}")
    return {"losses_rank0": res[0]["losses"], "losses_rank1": res[1]["losses"]}


def _ipc_child(q, r, mode):
    try:
        install(mode)
        import torch
        t = q.get(timeout=60)
        torch.cuda.set_device(1)
        on1 = t.to("cuda:1")  # the sender's device-0 memory, read from device 1
        t.add_(1)  # written in place on device 0: the sender sees it
        torch.cuda.synchronize(0)
        r.put({"sum": float(on1.double().sum().item()), "device": str(t.device)})
    except Exception as e:  # noqa: BLE001
        r.put({"error": f"{type(e).__name__}: {e}"[:400]})


@probe
def p_ipc_to_other_device(torch):
    """A cuda:0 tensor sent to a child (same allocator mode) that copies it to cuda:1 and writes the
    original in place: the child reads the right values, the sender sees the write."""
    need_two(torch)
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q, r = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_ipc_child, args=(q, r, os.environ["MULTI_GPU_MODE"]))
    p.start()
    t = torch.arange(1 << 20, dtype=torch.float32, device="cuda:0")
    q.put(t)
    got = r.get(timeout=120)
    p.join(30)
    check("error" not in got, f"child: {got.get('error')}")
    expect = float((1 << 20) * ((1 << 20) - 1) / 2)
    check(got["sum"] == expect, f"child read {got['sum']}, expected {expect}")
    torch.cuda.synchronize(0)
    check(float(t[5].item()) == 6.0, "the child's in-place write is seen")
    return {"child_sum": got["sum"]}


def run_mode(mode):
    os.environ["MULTI_GPU_MODE"] = mode
    run_one("all", mode, PROBES)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="native,expandable,genpool")
    ap.add_argument("--mode")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.mode:
        run_mode(a.mode)
        return 0
    results = []
    for mode in a.modes.split(","):
        env = dict(os.environ)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        cmd = [sys.executable, os.path.abspath(__file__), "--mode", mode]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env)
            lines = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
            seen = {x["probe"] for x in lines}
            tail = (res.stderr or "")[-300:]
            lines += [{"probe": n, "mode": mode, "ok": False, "error": f"not reported (exit "
                       f"{res.returncode}): {tail}"} for n in PROBES if n not in seen]
        except subprocess.TimeoutExpired:
            lines = [{"probe": n, "mode": mode, "ok": False, "error": f"timeout ({TIMEOUT} s)"}
                     for n in PROBES]
        results += lines
    if a.json:
        with open(a.json, "w") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    return summary("multi_gpu", results, a.modes.split(","), list(PROBES))[1]


if __name__ == "__main__":
    sys.exit(main())
