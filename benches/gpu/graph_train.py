"""Training under CUDA graphs, one allocator mode, on a GPU: a training step captured whole in one CUDA graph
(forward, backward, optimizer), or a model compiled with torch.compile(mode="reduce-overhead") (CUDA graph
trees). Step time (median over the timed steps), peak device memory (NVML, this process; and
torch.cuda.max_memory_reserved) and the losses, as one JSON line.

usage:  python3 benches/gpu/graph_train.py MODE WORKLOAD [--steps 200] [--width 2048] [--batch 256]
MODE: native | expandable | genpool (genpool_torch.install())
WORKLOAD: whole (the step in one graph) | compiled (reduce-overhead) | eager (the same step, no graph)
Losses must equal across modes (the same seeds and data): tools compare them, this script reports them.
"""

import argparse
import json
import os
import statistics
import threading
import time


def model_of(torch, width, depth):
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.LayerNorm(width)]
    layers += [torch.nn.Linear(width, 10)]
    return torch.nn.Sequential(*layers).cuda()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode")
    ap.add_argument("workload", choices=["whole", "compiled", "eager"])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warm", type=int, default=20)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--batch", type=int, default=256)
    a = ap.parse_args()
    if a.mode == "expandable":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if a.mode == "genpool":
        import genpool_torch
        genpool_torch.install()
    import pynvml
    import torch

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    peak = [0]
    stop = threading.Event()

    def sample():
        pid = os.getpid()
        while not stop.is_set():
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if p.pid == pid and p.usedGpuMemory:
                    peak[0] = max(peak[0], p.usedGpuMemory)
            time.sleep(0.005)

    threading.Thread(target=sample, daemon=True).start()
    torch.manual_seed(0)
    model = model_of(torch, a.width, a.depth)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=(a.workload == "whole"))
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(a.batch, a.width, generator=gen), torch.randint(10, (a.batch,), generator=gen))
            for _ in range(16)]
    data = [(x.cuda(), y.cuda()) for x, y in data]
    loss_fn = torch.nn.functional.cross_entropy

    def eager_step(x, y):
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    if a.workload == "whole":
        static_x, static_y = data[0][0].clone(), data[0][1].clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):  # warm-up: optimizer state and cuBLAS workspaces before the capture
                opt.zero_grad(set_to_none=True)
                loss_fn(model(static_x), static_y).backward()
                opt.step()
        torch.cuda.current_stream().wait_stream(s)
        opt.zero_grad(set_to_none=True)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static_loss = loss_fn(model(static_x), static_y)
            static_loss.backward()
            opt.step()

        def step(x, y):
            static_x.copy_(x)
            static_y.copy_(y)
            g.replay()
            return static_loss
    elif a.workload == "compiled":
        fwd = torch.compile(model, mode="reduce-overhead")

        def step(x, y):
            torch.compiler.cudagraph_mark_step_begin()
            loss = loss_fn(fwd(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
    else:
        step = eager_step

    times, losses = [], []
    for i in range(a.warm + a.steps):
        x, y = data[i % len(data)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step(x, y)
        torch.cuda.synchronize()
        if i >= a.warm:
            times.append(time.perf_counter() - t0)
        if i % 10 == 0:
            losses.append(round(float(loss), 4))
    stop.set()
    print(json.dumps({
        "mode": a.mode,
        "workload": a.workload,
        "steps": a.steps,
        "median_step_ms": round(1e3 * statistics.median(times), 3),
        "p90_step_ms": round(1e3 * sorted(times)[int(0.9 * len(times))], 3),
        "nvml_peak_mib": peak[0] >> 20,
        "max_reserved_mib": torch.cuda.max_memory_reserved() >> 20,
        "max_allocated_mib": torch.cuda.max_memory_allocated() >> 20,
        "losses": losses,
    }), flush=True)


if __name__ == "__main__":
    main()
