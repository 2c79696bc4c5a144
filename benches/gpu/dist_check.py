"""NCCL under one allocator mode, world size 1 on one GPU (a file store, no launcher): a DDP step, an FSDP2
step, and ProcessGroupNCCL's memory-pool registration (a MemPool of NCCL's allocator, ncclMemAlloc, and a
MemPool of the mode's own allocator, each registered with register_mem_pool and used by an all-reduce).
One JSON line: the losses (they must equal across modes) and each check's result.

usage:  python3 benches/gpu/dist_check.py MODE      MODE: native | expandable | genpool
"""

import json
import os
import sys
import tempfile
import traceback


def run(name, fn, out):
    try:
        out[name] = fn()
    except Exception as e:  # noqa: BLE001 - each check's failure is its result
        out[name] = {"error": f"{type(e).__name__}: {e}"[:400]}
        traceback.print_exc(file=sys.stderr)


def model_of(torch):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 16)).cuda()


def batches(torch, n=5):
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(64, 256, generator=gen).cuda(), torch.randn(64, 16, generator=gen).cuda())
            for _ in range(n)]


def train(torch, model, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for x, y in steps:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(round(loss.item(), 6))
    return losses


def main():
    mode = sys.argv[1]
    if mode == "expandable":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if mode == "genpool":
        import genpool_torch
        genpool_torch.install()
    import torch
    import torch.distributed as dist

    store = tempfile.mktemp(prefix="genpool_dist_")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    out = {"mode": mode, "torch": torch.__version__}
    data = batches(torch)

    def ddp():
        from torch.nn.parallel import DistributedDataParallel as DDP
        return {"losses": train(torch, DDP(model_of(torch), device_ids=[0]), data)}

    def fsdp2():
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:
            from torch.distributed._composable.fsdp import fully_shard
        m = model_of(torch)
        for layer in m:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(m)
        return {"losses": train(torch, m, data)}

    backend = dist.group.WORLD._get_backend(torch.device("cuda"))

    def pool_all_reduce(pool):
        with torch.cuda.use_mem_pool(pool):
            t = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
        backend.register_mem_pool(pool)
        try:
            dist.all_reduce(t)
            torch.cuda.synchronize()
            ok = bool((t == torch.arange(1 << 20, dtype=torch.float32, device="cuda")).all())
        finally:
            backend.deregister_mem_pool(pool)
        segments = len(pool.snapshot())
        del t
        return {"ok": ok, "segments": segments}

    def nccl_mem_pool():
        return pool_all_reduce(torch.cuda.MemPool(backend.mem_allocator))

    def own_mem_pool():
        return pool_all_reduce(torch.cuda.MemPool())

    run("ddp", ddp, out)
    run("fsdp2", fsdp2, out)
    run("nccl_mem_pool", nccl_mem_pool, out)
    run("own_mem_pool", own_mem_pool, out)
    dist.destroy_process_group()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
