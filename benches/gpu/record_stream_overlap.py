#!/usr/bin/env python3
"""Does a block used on a second stream (`Tensor.record_stream`) keep the two streams overlapping?

PyTorch's own allocator never orders one stream after another for `record_stream`: the freed block is
kept out of reuse until an event recorded on the using stream has completed. An allocator that instead
makes the freeing stream wait for the using stream on the device (`cudaStreamWaitEvent`) is correct
too, but it serializes work the program meant to overlap. Two patterns, each a loop of steps whose two
streams run spin kernels (`torch.cuda._sleep`, one block each, so they overlap on any GPU):

- `side`: the step's activation is made on the main stream, read by a side stream that then spins
  (a collective, an offload), recorded there and dropped; the main stream spins as much (compute);
- `prefetch`: the next batch is made and filled on a side stream (a data prefetcher's copy stream),
  the main stream waits for it, records it and spins; the batch is dropped when the next one arrives.

- `serve4`: four serving streams, each allocating a buffer of one of four sizes, spinning a quarter
  of a spin and dropping it on its own stream (no record_stream): blocks freed by one stream may be cut
  again for another. `serve16` (only with `--patterns`): the same with sixteen streams.

Overlapped, a step takes about one spin (`serve4`: a quarter); serialized, two (`serve4`: one). Prints one JSON line per mode and pattern:
ms a step (median of `--reps` timed runs of `--steps` steps), the spin alone, the step over the spin,
peak reserved (the cache emptied before each pattern), and under genpool its device-side stream
waits: record_stream's (`record_stream_waits`) and the engine's own (`page_waits`).

Modes: native, expandable, genpool (its default, `record_stream:hold`), genpool-wait
(`GENPOOL_CONF=record_stream:wait`), `genpool:<entries>` (those `GENPOOL_CONF` entries, `;` between
them: `genpool:experimental.stream_arenas:own`, say).

usage: record_stream_overlap.py [--modes native,genpool,genpool-wait] [--steps 50] [--spin-ms 2] [--reps 5]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MIB = 1 << 20


def spin_cycles(torch, ms):
    """Cycles of `torch.cuda._sleep` that take about `ms` on this device."""
    n = 1_000_000
    torch.cuda._sleep(n)  # warm
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(n)
    b.record()
    b.synchronize()
    return int(n * ms / a.elapsed_time(b))


def side(torch, steps, cycles, size):
    main, s = torch.cuda.current_stream(), torch.cuda.Stream()
    for _ in range(steps):
        x = torch.empty(size // 4, device="cuda")
        x.fill_(1.0)
        s.wait_stream(main)
        with torch.cuda.stream(s):
            torch.cuda._sleep(cycles)
            x.mul_(2.0)
        x.record_stream(s)
        del x
        torch.cuda._sleep(cycles)


def prefetch(torch, steps, cycles, size):
    main, s = torch.cuda.current_stream(), torch.cuda.Stream()

    def load():
        with torch.cuda.stream(s):
            b = torch.empty(size // 4, device="cuda")
            torch.cuda._sleep(cycles)  # the copy
            b.fill_(1.0)
        return b

    nxt = load()
    for _ in range(steps):
        main.wait_stream(s)
        batch = nxt
        batch.record_stream(main)
        nxt = load()
        batch.mul_(2.0)
        torch.cuda._sleep(cycles)  # the step's compute
        del batch
    main.wait_stream(s)
    del nxt


def serve(torch, steps, cycles, size, streams=4):
    """Several serving streams, each allocating its request's buffers, running a kernel and dropping
    them (no record_stream: every block is freed on its own stream). PyTorch's allocator keeps each
    stream's blocks to itself, so the streams never wait for each other; an allocator that hands one
    stream's freed bytes to another must order the two — on the device, a wait between the streams."""
    ss = [torch.cuda.Stream() for _ in range(streams)]
    sizes = [size // 4, size // 2, size, size // 8 * 3]
    for k in range(steps):
        for i, s in enumerate(ss):
            with torch.cuda.stream(s):
                n = sizes[(k * 7 + i * 3) % len(sizes)]
                x = torch.empty(n // 4, device="cuda")
                x.fill_(1.0)
                torch.cuda._sleep(cycles // streams)
                del x
    for s in ss:
        torch.cuda.current_stream().wait_stream(s)


PATTERNS = {
    "side": side,
    "prefetch": prefetch,
    "serve4": serve,
    "serve16": lambda torch, steps, cycles, size: serve(torch, steps, cycles, size, streams=16),
}


def run(mode, steps, spin_ms, reps, size, patterns):
    if mode.startswith("genpool"):
        import genpool_torch
        genpool_torch.install()
    import torch
    torch.cuda.init()
    cycles = spin_cycles(torch, spin_ms)
    for name in patterns:
        fn = PATTERNS[name]
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the pattern's own memory: nothing cached from the one before
        fn(torch, 5, cycles, size)  # warm: the blocks exist, the streams too
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        waits0 = page_waits0 = None
        if mode.startswith("genpool"):
            import genpool_torch
            st0 = genpool_torch.raw_stats()
            waits0 = st0.get("stream_waits")
            page_waits0 = st0.get("pages", {}).get("stream_waits", 0)
        times = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(torch, steps, cycles, size)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3 / steps)
        out = {
            "mode": mode if mode != "genpool" or not os.environ.get("GENPOOL_CONF")
            else f"genpool:{os.environ['GENPOOL_CONF']}",
            "pattern": name,
            "ms_a_step": round(statistics.median(times), 3),
            "ms_min": round(min(times), 3),
            "spin_ms": spin_ms,
            "step_over_spin": round(statistics.median(times) / spin_ms, 2),
            "peak_reserved_mib": round(torch.cuda.max_memory_reserved() / MIB, 1),
        }
        if mode.startswith("genpool"):
            import genpool_torch
            st = genpool_torch.raw_stats()
            # record_stream's orderings (the router's waits), and the engine's own device-side waits
            # (bytes or pages passing between streams: the page pool's `stream_waits`).
            out["record_stream_waits"] = st.get("stream_waits", 0) - (waits0 or 0)
            out["page_waits"] = st.get("pages", {}).get("stream_waits", 0) - (page_waits0 or 0)
            out["sync_fallbacks"] = st.get("sync_fallbacks")
            out["held_back_now"] = st.get("held_back")
            # Allocations a busy stream served from its own kept blocks (`busykeep.rs`).
            out["busy_kept_reuses"] = st.get("busy_kept_reuses")
        print(json.dumps(out), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="native,genpool")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--spin-ms", type=float, default=2.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--size-mib", type=int, default=64)
    ap.add_argument("--patterns", default="side,prefetch,serve4",
                    help="any of " + ",".join(PATTERNS))
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    a = ap.parse_args()
    patterns = a.patterns.split(",")
    unknown = [p for p in patterns if p not in PATTERNS]
    if unknown:
        ap.error(f"unknown patterns {unknown}; known: {', '.join(PATTERNS)}")
    if a.mode:
        run(a.mode, a.steps, a.spin_ms, a.reps, a.size_mib * MIB, patterns)
        return
    status = 0
    for mode in a.modes.split(","):
        env = dict(os.environ)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if mode == "expandable":
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        conf = {"genpool-wait": "record_stream:wait"}.get(mode)
        if mode.startswith("genpool:"):  # genpool:<GENPOOL_CONF entries, ';' between them>
            conf = mode.split(":", 1)[1].replace(";", ",")
        if conf:
            env["GENPOOL_CONF"] = ",".join(filter(None, [env.get("GENPOOL_CONF"), conf]))
        cmd = [sys.executable, os.path.abspath(__file__), "--mode", mode, "--steps", str(a.steps),
               "--spin-ms", str(a.spin_ms), "--reps", str(a.reps), "--size-mib", str(a.size_mib),
               "--patterns", a.patterns]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        sys.stdout.write(res.stdout)
        if res.returncode != 0:
            status = 1
            print(json.dumps({"mode": mode, "error": res.stderr[-600:]}), flush=True)
    sys.exit(status)


if __name__ == "__main__":
    main()
