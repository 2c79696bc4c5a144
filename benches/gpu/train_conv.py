"""Train a torchvision conv net with cudnn.benchmark=True at random resolutions, under one allocator mode, on
a GPU: step time and peak device memory (NVML, this process) as one JSON line.

usage:  python3 benches/gpu/train_conv.py MODE [--steps 40] [--model resnet18] [--batch 32]
MODE: native | expandable | genpool (genpool_torch.install(); GENPOOL_TORCH_BACKEND picks the backend)
"""

import argparse
import json
import os
import statistics
import threading
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--batch", type=int, default=32)
    a = ap.parse_args()
    if a.mode == "expandable":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if a.mode == "genpool":
        import genpool_torch
        genpool_torch.install()
    import pynvml
    import torch
    import torchvision

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
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    model = getattr(torchvision.models, a.model)(num_classes=100).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    resolutions = (128, 160, 192, 224)
    times, losses = [], []
    for i in range(a.steps):
        res = resolutions[int(torch.randint(len(resolutions), (1,), generator=gen))]
        x = torch.randn(a.batch, 3, res, res, generator=gen).cuda()
        y = torch.randint(100, (a.batch,), generator=gen).cuda()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(round(loss.item(), 4))
    stop.set()
    time.sleep(0.02)
    warm = times[len(resolutions) * 2:]  # after each resolution's benchmark pass
    out = {
        "mode": a.mode, "model": a.model, "batch": a.batch, "steps": a.steps,
        "median_step_ms": round(statistics.median(warm) * 1e3, 3),
        "nvml_peak_mib": peak[0] // (1 << 20),
        "max_reserved_mib": torch.cuda.max_memory_reserved() // (1 << 20),
        "max_allocated_mib": torch.cuda.max_memory_allocated() // (1 << 20),
        "first_losses": losses[:8],
    }
    if a.mode == "genpool":
        import genpool_torch
        out["backend"] = genpool_torch.active_backend()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
