"""genpool's PyTorch compatibility suite: many small probes of PyTorch's memory features, each in a process
of its own, under PyTorch's native allocator, expandable_segments and genpool, on a GPU.

usage:  python3 benches/gpu/compat.py [--modes native,expandable,genpool] [--probes a,b] [--jobs 4]
                                      [--json out.jsonl] [--md out.md] [--keep DIR]
A probe passes when it raises nothing and its checks hold; the table marks every probe that passes
under native but not under genpool, and figures both report that disagree. genpool mode runs
``genpool_torch.install()`` first (``GENPOOL_TORCH_BACKEND`` picks allocator / pluggable / auto).
``--probe NAME --mode MODE`` runs one probe in this process (what the runner does in each child).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

MIB = 1 << 20
TIMEOUT = int(os.environ.get("COMPAT_TIMEOUT", "150"))
MODES = {"native": "", "expandable": "expandable_segments:True", "genpool": ""}
PROBES = {}


def probe(fn):
    PROBES[fn.__name__[2:]] = fn
    return fn


def check(cond, what):
    if not cond:
        raise AssertionError(what)


# ----- statistics --------------------------------------------------------------------------------


@probe
def p_memory_stats(torch):
    sizes = (1000, 4096, 3 * MIB, 5 * MIB + 7)
    xs = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
    s = torch.cuda.memory_stats()
    req = s["requested_bytes.all.current"]
    check(req == sum(sizes), f"requested {req} != {sum(sizes)}")
    alloc = torch.cuda.memory_allocated()
    check(alloc >= req, "allocated >= requested")
    check(torch.cuda.memory_reserved() >= alloc, "reserved >= allocated")
    check(s["allocation.all.current"] == 4, f"allocations {s['allocation.all.current']}")
    check(s["allocation.small_pool.current"] == 2 and s["allocation.large_pool.current"] == 2,
          "small/large split")
    check(torch.cuda.max_memory_allocated() >= alloc, "max >= current")
    nested = torch.cuda.memory_stats_as_nested_dict()
    check("allocated_bytes" in nested, "nested dict")
    out = {"requested": req, "allocations": s["allocation.all.current"],
           "small": s["allocation.small_pool.current"]}
    del xs
    out["after_free"] = torch.cuda.memory_allocated()
    check(out["after_free"] == 0, "all freed")
    return out


@probe
def p_stats_agree_with_genpool(torch):
    xs = [torch.empty(n, device="cuda") for n in (10, 1 << 20, 7 << 20)]
    import genpool_torch
    if not genpool_torch.is_installed():
        return {"skipped_native": True}
    g = genpool_torch.memory_stats()
    check(torch.cuda.memory_allocated() == g["allocated_bytes.all.current"],
          f"{torch.cuda.memory_allocated()} vs {g['allocated_bytes.all.current']}")
    check(torch.cuda.memory_reserved() == g["reserved_bytes.all.current"],
          f"reserved {torch.cuda.memory_reserved()} vs {g['reserved_bytes.all.current']}")
    check(torch.cuda.max_memory_allocated() == g["allocated_bytes.all.peak"], "peaks agree")
    del xs
    return {"allocated": torch.cuda.memory_allocated()}


@probe
def p_reset_peak_and_accumulated(torch):
    keep = torch.empty(MIB, dtype=torch.uint8, device="cuda")
    big = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
    del big
    check(torch.cuda.max_memory_allocated() >= 65 * MIB, "peak seen")
    torch.cuda.reset_peak_memory_stats()
    check(torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated(), "peak reset")
    torch.cuda.reset_accumulated_memory_stats()
    s = torch.cuda.memory_stats()
    check(s["allocation.all.allocated"] == 0 and s["allocation.all.freed"] == 0, "accumulated reset")
    x = torch.empty(4096, dtype=torch.uint8, device="cuda")
    del x
    s = torch.cuda.memory_stats()
    check(s["allocation.all.allocated"] == 1 and s["allocation.all.freed"] == 1, "counted again")
    torch.cuda.reset_max_memory_allocated()
    del keep
    return {"peak_after_reset": s["allocated_bytes.all.peak"]}


@probe
def p_memory_summary(torch):
    x = torch.empty(3 * MIB, device="cuda")
    text = torch.cuda.memory_summary()
    check("Allocated memory" in text, "summary table")
    del x
    return {}


@probe
def p_mem_get_info(torch):
    free, total = torch.cuda.mem_get_info()
    check(0 < free <= total, "free <= total")
    return {"total_gib": round(total / 2**30)}


@probe
def p_allocator_backend(torch):
    return {"backend": torch.cuda.get_allocator_backend()}


# ----- everyday features -------------------------------------------------------------------------


@probe
def p_cudnn_benchmark(torch):
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(32, 64, 3, stride=2),
        torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10),
    ).cuda()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    losses = []
    for res in (64, 96, 64, 128):
        x = torch.randn(16, 3, res, res, device="cuda")
        loss = net(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(round(loss.item(), 4))
    return {"losses": losses}


@probe
def p_record_stream(torch):
    s = torch.cuda.Stream()
    x = torch.ones(8 * MIB // 4, device="cuda")
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = x * 2
    x.record_stream(s)
    del x
    z = torch.zeros(8 * MIB // 4, device="cuda")
    torch.cuda.synchronize()
    check(float(y.sum()) == 2 * y.numel(), "side-stream result")
    del z
    return {}


@probe
def p_empty_cache(torch):
    x = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
    del x
    before = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    after = torch.cuda.memory_reserved()
    check(after < before, f"reserved {before} -> {after}")
    return {"released_mib": (before - after) // MIB}


@probe
def p_memory_fraction(torch):
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(0.05)
    check(abs(torch.cuda.get_per_process_memory_fraction() - 0.05) < 1e-9, "fraction read back")
    try:
        torch.empty(int(total * 0.1), dtype=torch.uint8, device="cuda")
        raise AssertionError("allocation past the fraction succeeded")
    except torch.OutOfMemoryError:
        pass
    x = torch.empty(int(total * 0.01), dtype=torch.uint8, device="cuda")
    del x
    return {}


@probe
def p_caching_allocator_alloc(torch):
    p = torch.cuda.caching_allocator_alloc(MIB)
    check(p != 0, "pointer")
    torch.cuda.caching_allocator_delete(p)
    return {}


@probe
def p_bad_device_index(torch):
    try:
        torch.empty(1, device=f"cuda:{torch.cuda.device_count() + 3}")
        raise AssertionError("no error for a missing device")
    except (RuntimeError, AssertionError) as e:
        if isinstance(e, AssertionError):
            raise
    x = torch.empty(1, device="cuda")
    del x
    return {}


@probe
def p_out_of_memory(torch):
    seen = []
    torch._C._cuda_attach_out_of_memory_observer(lambda *a: seen.append(a))
    try:
        torch.empty(1 << 45, dtype=torch.uint8, device="cuda")
        raise AssertionError("32 TiB allocated")
    except torch.OutOfMemoryError as e:
        msg = str(e)
    check(len(seen) >= 1, "observer called")
    check(torch.cuda.memory_stats()["num_ooms"] >= 1, "num_ooms counted")
    x = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
    del x
    return {"names_genpool": "genpool" in msg, "message": msg[:160]}


# ----- history, snapshots, profiler -------------------------------------------------------------


@probe
def p_memory_history_snapshot(torch):
    torch.cuda.memory._record_memory_history(max_entries=10000)
    xs = [torch.empty(n, device="cuda") for n in (100, 300_000, 3 << 20)]
    del xs[0]
    snap = torch.cuda.memory._snapshot()
    segs = snap["segments"]
    check(len(segs) > 0, "segments")
    blocks = [b for s in segs for b in s["blocks"] if b["state"] == "active_allocated"]
    check(len(blocks) >= 2, f"live blocks {len(blocks)}")
    check(any(f["filename"].endswith("compat.py") for b in blocks for f in b.get("frames", [])),
          "stack frames of this file")
    trace = snap["device_traces"][0]
    check(any(e["action"] == "alloc" for e in trace), "alloc events")
    check(any(e["action"] == "free_completed" for e in trace), "free events")
    path = os.path.join(os.environ.get("COMPAT_KEEP", tempfile.gettempdir()),
                        f"snapshot_{os.environ.get('COMPAT_MODE', 'x')}.pickle")
    torch.cuda.memory._dump_snapshot(path)
    from torch.cuda import _memory_viz
    html = _memory_viz.trace_plot(snap)
    check(len(html) > 1000, "memory_viz renders")
    _memory_viz.segment_plot(snap)
    torch.cuda.memory._record_memory_history(enabled=None)
    return {"segments": len(segs), "trace_events": len(trace), "pickle": path}


@probe
def p_oom_snapshot_dump(torch):
    torch.cuda.memory._record_memory_history(max_entries=1000)
    path = os.path.join(tempfile.gettempdir(), f"oom_{os.getpid()}.pickle")
    torch._C._cuda_attach_out_of_memory_observer(
        lambda *a: torch.cuda.memory._dump_snapshot(path))
    keep = torch.empty(MIB, device="cuda")
    try:
        torch.empty(1 << 45, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError:
        pass
    check(os.path.getsize(path) > 0, "snapshot written on OOM")
    del keep
    return {}


@probe
def p_profiler_memory(torch):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], profile_memory=True) as prof:
        x = torch.randn(1024, 1024, device="cuda")
        y = x @ x
        del x, y
    mem = [e for e in prof.events() if e.name == "[memory]"]
    cuda = [e for e in mem if getattr(e, "device_memory_usage", 0) or getattr(e, "cuda_memory_usage", 0)]
    check(len(cuda) >= 2, f"CUDA memory events {len(cuda)} of {len(mem)}")
    return {"memory_events": len(mem)}


# ----- graphs, pools, IPC ------------------------------------------------------------------------


def _graph_model(torch):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(),
                               torch.nn.Linear(2048, 512)).cuda()


def _guards(torch, capture_stream, hidden):
    """Tensors made after a capture, filled with 7: on the current stream and on the capture's (where a
    block the graph freed during the capture would be handed out first), some of the size of the graph's
    hidden activations (`hidden` floats), so that memory the graph still uses, handed out, is caught."""
    sizes = (1000, hidden, hidden, 1 << 18, 1 << 20, 3 << 20)
    out = [torch.full((n,), 7.0, device="cuda") for n in sizes]
    with torch.cuda.stream(capture_stream):
        out += [torch.full((n,), 7.0, device="cuda") for n in sizes]
    torch.cuda.current_stream().wait_stream(capture_stream)
    return out


@probe
def p_cuda_graph_capture(torch):
    model = _graph_model(torch)
    static_in = torch.randn(64, 512, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            model(static_in)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    # Without autograd the hidden activations are freed during the capture (with it, the output keeps
    # them alive): blocks the graph still uses that nobody holds — what must not be handed out.
    with torch.no_grad(), torch.cuda.graph(g, stream=s):
        static_out = model(static_in)
    # Tensors allocated after the capture must never be touched by replays.
    guards = _guards(torch, s, 64 * 2048)
    for i in range(50):
        static_in.copy_(torch.randn(64, 512, device="cuda"))
        g.replay()
    torch.cuda.synchronize()
    ref = model(static_in)
    check(torch.allclose(static_out, ref, atol=1e-5), "replay equals eager")
    check(all(bool((t == 7.0).all()) for t in guards), "memory allocated after the capture untouched")
    return {}


@probe
def p_cuda_graph_shared_pool(torch):
    model = _graph_model(torch)
    x = torch.randn(32, 512, device="cuda")
    with torch.cuda.stream(torch.cuda.Stream()):
        model(x)
    g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g1):
        y1 = model(x)
    with torch.cuda.graph(g2, pool=g1.pool()):
        y2 = model(y1)
    g1.replay()
    g2.replay()
    torch.cuda.synchronize()
    check(torch.allclose(y2, model(model(x)), atol=1e-4), "shared-pool graphs")
    del g1, g2
    return {}


@probe
def p_cuda_graph_capture_pages_pending(torch):
    # The device pool has free pages on two streams (moves would need a synchronize) when a capture
    # needs fresh memory; meanwhile a tensor is made and freed on another stream (the device pool).
    side = torch.cuda.Stream()
    for i in range(6):
        with torch.cuda.stream(side if i % 2 else torch.cuda.current_stream()):
            t = torch.empty((40 + 8 * i) * MIB, dtype=torch.uint8, device="cuda")
            del t
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        warm = torch.empty(24 * MIB, dtype=torch.uint8, device="cuda")  # cached for the side stream
    del warm
    model = _graph_model(torch)
    static_in = torch.randn(1024, 512, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            model(static_in)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        static_out = model(static_in)
        with torch.cuda.stream(side):
            other = torch.empty(24 * MIB, dtype=torch.uint8, device="cuda")
        del other
    guards = _guards(torch, s, 1024 * 2048)
    for _ in range(20):
        static_in.copy_(torch.randn(1024, 512, device="cuda"))
        g.replay()
    torch.cuda.synchronize()
    check(torch.allclose(static_out, model(static_in), atol=1e-4), "replay equals eager")
    check(all(bool((t == 7.0).all()) for t in guards), "memory allocated after the capture untouched")
    return {}


@probe
def p_cuda_graph_unsafe_variant_is_caught(torch):
    # genpool only: with the debug switch the graph's freed blocks are handed out after the capture;
    # the check the graph probes make (guards untouched by replays) must see the corruption.
    import genpool_torch
    if not genpool_torch.is_installed():
        raise AssertionError("genpool's debug switch (not PyTorch's)")
    os.environ["GENPOOL_DEBUG_UNSAFE_GRAPH_POOLS"] = "1"
    model = _graph_model(torch)
    static_in = torch.randn(64, 512, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        model(static_in)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(g, stream=s):
        static_out = model(static_in)
    # The hidden activations (64 x 2048 floats) were freed during the capture (no autograd keeps them):
    # guards land on them.
    guards = _guards(torch, s, 64 * 2048)
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    touched = sum(not bool((t == 7.0).all()) for t in guards)
    check(touched > 0, "the unsafe variant went unnoticed: the guard check does not bite")
    del static_out
    return {"guards_corrupted": touched}


@probe
def p_mempool(torch):
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        x = torch.randn(1 << 20, device="cuda")
    y = torch.randn(1 << 20, device="cuda")
    check(pool.use_count() >= 1, "use count")
    snap = pool.snapshot()
    check(sum(len(s["blocks"]) for s in snap) >= 1, "pool snapshot holds the block")
    addrs = {b_start for s in snap for b_start in [s["address"]]}
    check(all(not (a <= y.data_ptr() < a + s["total_size"]) for s in snap for a in [s["address"]]),
          "a tensor outside the pool is not in it")
    del x, y, pool, addrs
    torch.cuda.synchronize()
    return {}


def _count_checkpoints(torch):
    """Count CUDA graph trees' restores of a pool to a checkpoint (setCheckpointPoolState)."""
    n = [0]
    real = torch._C._cuda_setCheckpointPoolState

    def counted(*a, **k):
        n[0] += 1
        return real(*a, **k)

    torch._C._cuda_setCheckpointPoolState = counted
    return n


@probe
def p_compile_reduce_overhead(torch):
    restores = _count_checkpoints(torch)
    model = _graph_model(torch)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = torch.compile(model, mode="reduce-overhead")
    torch.manual_seed(1)
    losses = []
    # Two batch sizes, alternating after a while: new graphs are recorded after others replayed.
    for i in range(12):
        x = torch.randn(64 if i < 6 or i % 2 else 32, 512, device="cuda")
        loss = step(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(round(loss.item(), 4))
    return {"losses": losses, "restores": restores[0]}


@probe
def p_compile_graph_tree_branches(torch):
    # f then g, replayed; then f then h: h is recorded after f replayed, so graph trees put the pool
    # back to f's checkpoint (setCheckpointPoolState) before recording it.
    restores = _count_checkpoints(torch)

    def f(x):
        return (x * 2 + 1).relu()

    def g(y):
        return y.sin() * 3

    def h(y):
        return y.cos() - y

    fc, gc, hc = (torch.compile(fn, mode="reduce-overhead") for fn in (f, g, h))
    torch.manual_seed(0)  # the same input in every process: the sums compare across modes
    x = torch.randn(1 << 16, device="cuda")
    outs = []
    for i in range(8):
        torch.compiler.cudagraph_mark_step_begin()
        y = fc(x)
        z = (gc if i < 4 else hc)(y)
        ref = (g if i < 4 else h)(f(x))
        check(torch.allclose(z, ref, atol=1e-5), f"step {i}: graph tree output equals eager")
        outs.append(round(float(z.sum()), 2))
    check(restores[0] >= 1, "no checkpoint was restored: the probe did not branch")
    return {"sums": outs, "restores": restores[0]}


def _ipc_child(q, r, install):
    # A child of `torch.multiprocessing` (spawn): PyTorch's allocator unless `install` (genpool's).
    if install:
        import genpool_torch
        genpool_torch.install()
    import torch
    try:
        t = q.get()
        seen = float(t.sum())
        t.add_(1.0)  # written through the shared pages: the sender sees it
        torch.cuda.synchronize()
        r.put(seen)
        r.put(q.get())  # hold the tensor until the sender has looked
    except Exception as e:  # noqa: BLE001 - the sender reports it
        r.put(f"{type(e).__name__}: {e}"[:300])


def _ipc(torch, install_child):
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q, r = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_ipc_child, args=(q, r, install_child))
    t = torch.ones(1 << 20, device="cuda")
    # Share the storage here, so a refusal surfaces in this process rather than in the queue's thread.
    t.untyped_storage()._share_cuda_()
    p.start()
    q.put(t)
    got = r.get(timeout=120)
    check(not isinstance(got, str), f"child failed: {got}")
    check(got == float(1 << 20), f"child saw {got}")
    torch.cuda.synchronize()
    check(float(t.sum()) == 2.0 * (1 << 20), "the child's write is seen by the sender")
    q.put("done")
    r.get(timeout=60)
    p.join(60)
    return {"child": "genpool" if install_child else "native"}


@probe
def p_ipc_share_tensor(torch):
    # The child runs PyTorch's own allocator (as a spawned child does unless it installs genpool).
    return _ipc(torch, False)


@probe
def p_ipc_share_tensor_genpool_child(torch):
    # Both sides under the mode's allocator: genpool sends and genpool opens.
    return _ipc(torch, os.environ.get("COMPAT_MODE") == "genpool")


@probe
def p_sleep_wake_stats(torch):
    # genpool only (native has no sleep): torch.cuda's figures know about sleeping memory.
    import genpool_torch
    if not genpool_torch.is_installed():
        raise AssertionError("genpool's sleep / wake (not PyTorch's)")
    with genpool_torch.region("compat-weights"):
        w = torch.full((64 * MIB // 4,), 3.0, device="cuda")
    reserved, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    genpool_torch.sleep(["compat-weights"], offload=True)
    asleep = torch.cuda.memory_reserved()
    check(asleep <= reserved - 64 * MIB, f"reserved {reserved} -> {asleep} asleep")
    check(torch.cuda.memory_allocated() == allocated, "allocated stays")
    genpool_torch.wake(["compat-weights"])
    check(bool((w == 3.0).all()), "contents back")
    return {"released_mib": (reserved - asleep) // MIB}


# ----- everyday training paths (session 18) ------------------------------------------------------


def _free_port():
    import socket
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        return so.getsockname()[1]


def _train(torch, model, step, steps=6, shapes=(64,)):
    """A few SGD steps of `step` (the model, compiled or wrapped) on seeded inputs; the losses, rounded."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.manual_seed(1)
    losses = []
    for i in range(steps):
        x = torch.randn(shapes[i % len(shapes)], 512, device="cuda")
        loss = step(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(round(loss.item(), 4))
    return losses


@probe
def p_compile_default(torch):
    # torch.compile's default mode (Inductor, no CUDA graphs), two shapes: a recompile in between.
    model = _graph_model(torch)
    return {"losses": _train(torch, model, torch.compile(model), 6, (64, 48))}


@probe
def p_make_graphed_callables(torch):
    # A module graphed forward and backward (torch.cuda.make_graphed_callables) trains as its eager twin.
    import copy
    model = _graph_model(torch)
    twin = copy.deepcopy(model)
    graphed = torch.cuda.make_graphed_callables(model, (torch.randn(64, 512, device="cuda"),))
    losses = _train(torch, model, graphed, 8)
    eager = _train(torch, twin, twin, 8)
    check(all(abs(a - b) <= 1e-3 * max(1.0, abs(b)) for a, b in zip(losses, eager)),
          f"graphed {losses} vs eager {eager}")
    return {"losses": losses}


@probe
def p_storage_resize(torch):
    # FSDP's pattern: a parameter's storage freed with resize_(0) and brought back with resize_(n).
    n = 4 * MIB
    x = torch.arange(n // 4, device="cuda", dtype=torch.float32)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    st = x.untyped_storage()
    st.resize_(0)
    freed = base - torch.cuda.memory_allocated()
    check(freed == n, f"resize_(0) released {freed} bytes, not {n}")
    st.resize_(n)
    check(torch.cuda.memory_allocated() == base, "resize_(n) allocates it again")
    x.copy_(torch.arange(n // 4, device="cuda", dtype=torch.float32))
    st.resize_(2 * n)  # growing keeps the first n bytes
    y = torch.empty(0, device="cuda").set_(st, 0, (n // 4,))
    check(bool((y == torch.arange(n // 4, device="cuda", dtype=torch.float32)).all()),
          "a grown storage keeps its bytes")
    return {"freed": freed, "grown": torch.cuda.memory_allocated() - base}


@probe
def p_accelerator_memory_api(torch):
    # The device-generic API (torch.accelerator.*) reads the same allocator.
    torch.accelerator.reset_peak_memory_stats()
    x = torch.empty(3 * MIB, dtype=torch.uint8, device="cuda")
    a = torch.accelerator.memory_allocated()
    check(a == torch.cuda.memory_allocated(), "accelerator and cuda agree on allocated bytes")
    check(torch.accelerator.max_memory_allocated() >= a, "peak")
    check(torch.accelerator.memory_reserved() >= a, "reserved")
    st = torch.accelerator.memory_stats()
    check(st["allocated_bytes.all.current"] == a, "memory_stats")
    free, total = torch.accelerator.get_memory_info()
    check(0 < free <= total, "memory info")
    del x
    return {"allocated": a}


@probe
def p_memory_snapshot(torch):
    # The public snapshot: a live tensor's block is an active block of a segment that holds it.
    x = torch.empty(5 * MIB, dtype=torch.uint8, device="cuda")
    p = x.data_ptr()
    found = [b for s in torch.cuda.memory_snapshot() for b in s["blocks"]
             if b["state"] == "active_allocated" and b["address"] == p]
    check(len(found) == 1, f"the tensor's block in the snapshot ({len(found)})")
    return {"block_size": found[0]["size"]}


@probe
def p_allocator_settings_at_runtime(torch):
    # Libraries change allocator settings at run time (vLLM turns expandable segments off for its
    # sleep mode): accepted, and the allocator keeps working.
    torch.cuda.memory._set_allocator_settings("garbage_collection_threshold:0.8")
    torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    x = torch.ones(16 * MIB // 4, device="cuda")
    check(float(x.sum()) == x.numel(), "allocations after the settings change")
    return {}


@probe
def p_sdpa_kernels(torch):
    # Flash and memory-efficient attention (their workspaces come from the allocator) agree with math.
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    torch.manual_seed(0)
    q, k, v = (torch.randn(4, 8, 512, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    outs = {}
    for b in (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        with sdpa_kernel(b):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            gq, = torch.autograd.grad(o.float().square().sum(), q)
        outs[b] = (o.float(), gq.float())
    ref = outs[SDPBackend.MATH]
    for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        check(torch.allclose(outs[b][0], ref[0], atol=3e-2), f"{b} output")
        check(torch.allclose(outs[b][1], ref[1], atol=0.5, rtol=5e-2), f"{b} gradient")
    return {}


@probe
def p_amp_checkpoint_scaler(torch):
    # Mixed precision with a gradient scaler and activation checkpointing.
    from torch.utils.checkpoint import checkpoint
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(),
                                                     torch.nn.Linear(1024, 512)) for _ in range(4)).cuda()
    opt = torch.optim.AdamW(blocks.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda")
    torch.manual_seed(1)
    losses = []
    for _ in range(6):
        x = torch.randn(128, 512, device="cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            for b in blocks:
                x = x + checkpoint(b, x, use_reentrant=False)
            loss = x.float().square().mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(round(loss.item(), 3))
    return {"losses": losses}


@probe
def p_streams_churn_correct(torch):
    # Blocks allocated on a side stream, used there, handed to the default stream (record_stream) and
    # freed, while the default stream allocates too: 300 rounds of sizes from 1 to 48 MiB; every result
    # must be exact (a block reused before its last user finished would corrupt one).
    import random
    rng = random.Random(7)
    side = torch.cuda.Stream()
    cur = torch.cuda.current_stream()
    sums, want = [], []
    for i in range(300):
        n = rng.randint(1, 48) * MIB // 4
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            x = torch.full((n,), float(i % 97), device="cuda")
            y = x * 2
        del x
        cur.wait_stream(side)
        y.record_stream(cur)
        sums.append(y.sum())
        want.append(2.0 * (i % 97) * n)
        del y
        w = torch.ones(rng.randint(1, 48) * MIB // 4, device="cuda")
        sums.append(w.sum())
        want.append(float(w.numel()))
        del w
    torch.cuda.synchronize()
    bad = [i for i, (s, w) in enumerate(zip(sums, want)) if float(s) != w]
    check(not bad, f"{len(bad)} wrong results, first at {bad[:3]}")
    return {}


def _dist_init(torch):
    import torch.distributed as dist
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(_free_port())
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    return dist


@probe
def p_ddp_nccl_one_rank(torch):
    # DistributedDataParallel over NCCL with one rank (NCCL's buffers and the reducer's buckets come
    # from the allocator; the process group registers with it).
    dist = _dist_init(torch)
    try:
        model = _graph_model(torch)
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
        losses = _train(torch, model, ddp, 6)
        t = torch.full((1 << 20,), 3.0, device="cuda")
        dist.all_reduce(t)
        check(bool((t == 3.0).all()), "all_reduce over one rank")
    finally:
        dist.destroy_process_group()
    return {"losses": losses}


@probe
def p_fsdp2_one_rank(torch):
    # FSDP2 (fully_shard) over one rank: sharded parameters freed and re-gathered each step (storage
    # resizes, its own streams and events).
    from torch.distributed.fsdp import fully_shard
    dist = _dist_init(torch)
    try:
        model = _graph_model(torch)
        for m in model:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m)
        fully_shard(model)
        losses = _train(torch, model, model, 6)
    finally:
        dist.destroy_process_group()
    return {"losses": losses}


# ----- runner ------------------------------------------------------------------------------------


def install(mode):
    """Make `mode` PyTorch's allocator in this process (before torch touches CUDA)."""
    if mode == "expandable":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = MODES[mode]
    if mode == "genpool":
        import genpool_torch
        genpool_torch.install()


def run_one(names, mode, probes=None):
    """Run the probes `names` (comma-separated; "all") of `probes` (default this suite's) in this
    process under `mode`, one JSON line each."""
    probes = PROBES if probes is None else probes
    os.environ["COMPAT_MODE"] = mode
    install(mode)
    import torch
    for name in (list(probes) if names == "all" else names.split(",")):
        t0 = time.time()
        try:
            figures = probes[name](torch) or {}
            out = {"probe": name, "mode": mode, "ok": True, "figures": figures}
        except Exception as e:  # noqa: BLE001 - a probe's failure is its result
            out = {"probe": name, "mode": mode, "ok": False, "error": f"{type(e).__name__}: {e}"[:400]}
        if mode == "genpool":
            import genpool_torch
            out["genpool_backend"] = genpool_torch.active_backend()
        out["seconds"] = round(time.time() - t0, 2)
        print(json.dumps(out), flush=True)


def spawn(name, mode, keep):
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if keep:
        env["COMPAT_KEEP"] = keep
    cmd = [sys.executable, os.path.abspath(__file__), "--probe", name, "--mode", mode]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env)
    except subprocess.TimeoutExpired:
        return {"probe": name, "mode": mode, "ok": False, "error": f"timeout ({TIMEOUT} s)"}
    for line in reversed(res.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (res.stderr or res.stdout)[-400:]
    return {"probe": name, "mode": mode, "ok": False, "error": f"exit {res.returncode}: {tail}"}


def table(results, modes, names=None):
    """The Markdown table of `results` (probes `names`, default this suite's) and how many probes pass
    under native and fail under genpool; figures both report that differ are noted."""
    by = {(r["probe"], r["mode"]): r for r in results}
    lines = ["| probe | " + " | ".join(modes) + " | note |", "|---|" + "---|" * (len(modes) + 1)]
    regress = 0
    for name in (names or PROBES):
        cells, notes = [], []
        for m in modes:
            r = by.get((name, m))
            cells.append("—" if r is None else ("pass" if r["ok"] else "**fail**"))
            if r is not None and not r["ok"]:
                notes.append(f"{m}: {r['error'][:150]}".replace("\n", " "))
        n, g = by.get((name, "native")), by.get((name, "genpool"))
        if n and g and n["ok"] and not g["ok"]:
            regress += 1
            notes.insert(0, "REGRESSION under genpool")
        if n and g and n["ok"] and g["ok"]:
            for k, v in n.get("figures", {}).items():
                gv = g.get("figures", {}).get(k)
                if k not in ("pickle", "message", "backend") and gv is not None and gv != v:
                    notes.append(f"{k}: native {v}, genpool {gv}")
        lines.append(f"| {name} | " + " | ".join(cells) + " | " + "; ".join(notes).replace("|", "/") + " |")
    return "\n".join(lines), regress


def summary(label, results, modes, names=None):
    """Print the table of `results` and a line of counts; returns the table and the exit status (1 when
    a probe passes under native and fails under genpool)."""
    md, regress = table(results, modes, names)
    print(md)
    print(f"{label}: {sum(r['ok'] for r in results)} passed, {sum(not r['ok'] for r in results)} "
          f"failed; {regress} pass under native and fail under genpool")
    return md, 1 if regress else 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="native,expandable,genpool")
    ap.add_argument("--probes", default="")
    ap.add_argument("--probe")
    ap.add_argument("--mode")
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--json")
    ap.add_argument("--md")
    ap.add_argument("--keep", default="")
    a = ap.parse_args()
    if a.probe:
        run_one(a.probe, a.mode)
        return 0
    modes = a.modes.split(",")
    names = a.probes.split(",") if a.probes else list(PROBES)
    jobs = [(n, m) for n in names for m in modes]
    stream = open(a.json, "w") if a.json else None

    def one(nm):
        r = spawn(nm[0], nm[1], a.keep)
        if stream:  # each result as it comes: a run cut short keeps what it did
            stream.write(json.dumps(r) + "\n")
            stream.flush()
        print(json.dumps(r), flush=True)
        return r

    # The slow probes first, so they overlap the rest.
    slow = ("compile_reduce_overhead", "compile_graph_tree_branches", "ipc_share_tensor",
            "ipc_share_tensor_genpool_child", "cudnn_benchmark", "compile_default", "fsdp2_one_rank",
            "ddp_nccl_one_rank", "make_graphed_callables")
    jobs.sort(key=lambda nm: nm[0] not in slow)
    with ThreadPoolExecutor(a.jobs) as ex:
        results = list(ex.map(one, jobs))
    if stream:
        stream.close()
    md, rc = summary("compat", results, modes)
    if a.md:
        with open(a.md, "w") as f:
            f.write(md + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
