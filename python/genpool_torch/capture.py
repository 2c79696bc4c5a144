"""Record real allocation traces from PyTorch programs, in genpool's trace format.

    python -m genpool_torch.capture OUTDIR WORKLOAD... [--steps N] [--max-entries M] [--timeout S]
    python -m genpool_torch.capture --snapshot-pickle PATH

Each workload runs in a fresh process under PyTorch's native caching allocator with
``torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=M)``; at the end
the ``alloc`` and ``free_completed`` events of ``torch.cuda.memory._snapshot()["device_traces"][0]``
become ``OUTDIR/<workload>.csv.gz``: a header ``t_us,action,addr,size,stream,site``, one event a line, in
program order (the format of ``benches/traces/README.md``). Stream handles are kept as PyTorch reports them
(0 = the default stream); ``site`` is the 48-bit BLAKE2b hash of the top 8 Python frames of an
allocation, the same function as gen-trace's ``site_hash`` (0 when the allocation has no frames).
``OUTDIR/<workload>.json`` (and one line of ``OUTDIR/captures.jsonl``) holds the figures: events, peak
live bytes, per-stream counts with the stream's role in the program, step times, PyTorch's own peaks.

Workloads (random-init models from configs, no downloads, bf16 autocast; each captures in well under a
minute on an H200):

``gpt2_prefetch``
    GPT-2 small training, batch 8 x 512-1024 tokens (varies per batch), AdamW. A side stream copies the
    next batch from pinned host memory and builds its labels and attention mask while the current step
    runs; the compute stream ``wait_stream``s on it and ``record_stream``s the batch.
``resnet_copy_overlap``
    torchvision ResNet-50 training, batch 64, channels_last, SGD. The next batch is copied (uint8, pinned)
    and normalised on an H2D stream during the step; loss and accuracy go to pinned host memory on a third
    (D2H) stream and are read one step later.
``bert_serve_4streams``
    BERT-base inference served by 4 threads, each on its own stream, batch 1-32 x 16-512 tokens per
    request (random), results copied back to the host; a step is a round of 4 requests per stream.

Steps run without a host sync between them (the programs' own syncs aside), so frees delayed by
``record_stream`` complete when they would in the real program.

``--snapshot-pickle PATH`` runs a tiny program (a few small tensors on two streams, cross-stream use
with ``record_stream`` and events) and writes ``torch.cuda.memory._dump_snapshot(PATH)`` plus
``<PATH without .pickle>.expected.json``: the events gen-trace's snapshot reader must read from it
(a fixture for that reader; the file is kept well under 200 KB).

The conversion (``convert``, ``site_hash``, ``stream_id``, ``expected_traces``) needs no PyTorch.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import pickle
import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

__all__ = [
    "CaptureError",
    "HEADER",
    "SITE_FRAMES",
    "WORKLOADS",
    "Conversion",
    "site_hash",
    "stream_id",
    "stream_names",
    "convert",
    "write_csv",
    "trace_name",
    "expected_traces",
    "main",
]

#: The CSV header of genpool's trace format.
HEADER = "t_us,action,addr,size,stream,site"
#: How many innermost frames make up a call site (gen-trace's ``SITE_FRAMES``).
SITE_FRAMES = 8
#: Largest fixture ``--snapshot-pickle`` may write.
SNAPSHOT_LIMIT = 200 * 1024

_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1


class CaptureError(ValueError):
    """A snapshot that cannot become a valid trace, or a capture that failed."""


# --------------------------------------------------------------------------------------------------
# Pure conversion (no torch)


def _frame_key(f: Mapping[str, Any]) -> str:
    # As gen-trace reads a pickled frame: a non-string file or name is "", a line that is not a 64-bit
    # integer (a bool included) is 0.
    filename = f.get("filename")
    name = f.get("name")
    line = f.get("line")
    if type(line) is not int or not _I64_MIN <= line <= _I64_MAX:
        line = 0
    return f"{filename if isinstance(filename, str) else ''}:{line}:{name if isinstance(name, str) else ''}"


def site_hash(frames: Optional[Sequence[Mapping[str, Any]]]) -> int:
    """48-bit site of an allocation from its frames (innermost first): BLAKE2b with a 6-byte digest of
    ``"file:line:name|..."`` over the top ``SITE_FRAMES`` frames, read little-endian; 0 without frames.

    Raises ``CaptureError`` when ``frames`` is not a list of dicts."""
    if not frames:
        return 0
    if not isinstance(frames, (list, tuple)):
        raise CaptureError(f"frames is not a list: {type(frames).__name__}")
    top = frames[:SITE_FRAMES]
    for f in top:
        if not isinstance(f, Mapping):
            raise CaptureError(f"a frame is not a dict: {f!r}")
    key = "|".join(_frame_key(f) for f in top)
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=6).digest(), "little")


def _uint(e: Mapping[str, Any], key: str, required: bool) -> int:
    v = e.get(key)
    if v is None:
        if required and key not in e:
            raise CaptureError(f"no `{key}`")
        if required:
            raise CaptureError(f"`{key}` is None")
        return 0
    if isinstance(v, bool):  # gen-trace reads a pickled bool as 0/1
        return int(v)
    if not isinstance(v, int) or v < 0 or v > _I64_MAX:
        raise CaptureError(f"`{key}` is not a non-negative integer: {v!r}")
    return v


def stream_id(event: Mapping[str, Any]) -> int:
    """The stream column of an event: PyTorch's ``cudaStream_t`` handle as an integer, unchanged
    (0 = the default stream, also when the event has no ``stream``). Raises ``CaptureError`` for a
    value gen-trace would reject (negative, not an integer)."""
    return _uint(event, "stream", False)


def stream_names(named: Mapping[str, int], seen: Iterable[int]) -> Dict[int, str]:
    """Role of every stream handle in ``seen``: the name the workload gave it (``named``: name ->
    handle), ``"default"`` for handle 0 unless named, else ``"unnamed"``; names of one handle are
    joined with ``+`` in sorted order."""
    by_handle: Dict[int, List[str]] = {}
    for name, handle in named.items():
        by_handle.setdefault(int(handle), []).append(name)
    out = {}
    for h in sorted(set(seen)):
        if h in by_handle:
            out[h] = "+".join(sorted(by_handle[h]))
        else:
            out[h] = "default" if h == 0 else "unnamed"
    return out


@dataclass
class StreamCounts:
    """Per-stream event counts of a converted trace."""

    allocs: int = 0
    frees: int = 0
    alloc_bytes: int = 0


@dataclass
class Conversion:
    """One device's trace: ``rows`` are ``(t_us, action, addr, size, stream, site)`` with action
    ``"a"`` or ``"f"``, in program order."""

    rows: List[Tuple[int, str, int, int, int, int]] = field(default_factory=list)
    allocs: int = 0
    frees: int = 0
    skipped_frees: int = 0  # free_completed of a block allocated before recording began
    peak_live: int = 0
    live_bytes_at_end: int = 0
    live_at_end: int = 0
    sites: int = 0
    actions: Dict[str, int] = field(default_factory=dict)
    streams: Dict[int, StreamCounts] = field(default_factory=dict)

    def summary(self, named: Optional[Mapping[str, int]] = None) -> Dict[str, Any]:
        """Figures as a JSON-ready dict; ``named`` maps the workload's stream names to handles."""
        names = stream_names(named or {}, self.streams)
        return {
            "trace_events": len(self.rows),
            "trace_allocs": self.allocs,
            "trace_frees": self.frees,
            "skipped_frees": self.skipped_frees,
            "trace_peak_live": self.peak_live,
            "live_at_end": self.live_at_end,
            "live_bytes_at_end": self.live_bytes_at_end,
            "sites": self.sites,
            "actions": dict(sorted(self.actions.items())),
            "streams": [
                {"stream": h, "role": names[h], "allocs": c.allocs, "frees": c.frees,
                 "alloc_bytes": c.alloc_bytes}
                for h, c in sorted(self.streams.items())
            ],
        }


def convert(events: Sequence[Any]) -> Conversion:
    """Turn one device's ``device_traces`` entry into trace rows, validated as gen-trace validates a
    snapshot: ``alloc`` and ``free_completed`` become ``a``/``f`` rows, every other action is counted
    and skipped; a free of an address that is not live is dropped (``skipped_frees``: the block was
    allocated before recording began or its event left the ring buffer). An allocation of size 0 or at
    a live address, a free whose size differs from the live block's, or a malformed event raise
    ``CaptureError`` naming the event."""
    out = Conversion()
    live: Dict[int, int] = {}
    live_bytes = 0
    sites = set()
    for i, e in enumerate(events):
        try:
            if not isinstance(e, Mapping):
                raise CaptureError("not a dict")
            action = e.get("action")
            if not isinstance(action, str):
                raise CaptureError("no `action` string")
            out.actions[action] = out.actions.get(action, 0) + 1
            if action not in ("alloc", "free_completed"):
                continue
            addr = _uint(e, "addr", True)
            size = _uint(e, "size", True)
            stream = stream_id(e)
            t_us = _uint(e, "time_us", False)
            if action == "alloc":
                site = site_hash(e.get("frames"))
                if size == 0:
                    raise CaptureError("allocation of size 0")
                if addr in live:
                    raise CaptureError(f"allocation at {addr:#x}, which is already live ({live[addr]} bytes)")
                live[addr] = size
                live_bytes += size
                out.peak_live = max(out.peak_live, live_bytes)
                out.allocs += 1
                if site:
                    sites.add(site)
                c = out.streams.setdefault(stream, StreamCounts())
                c.allocs += 1
                c.alloc_bytes += size
                out.rows.append((t_us, "a", addr, size, stream, site))
            else:
                old = live.get(addr)
                if old is None:
                    out.skipped_frees += 1
                    continue
                if old != size:
                    raise CaptureError(f"free of {addr:#x} with size {size}, but the live block has {old} bytes")
                del live[addr]
                live_bytes -= size
                out.frees += 1
                out.streams.setdefault(stream, StreamCounts()).frees += 1
                out.rows.append((t_us, "f", addr, size, stream, 0))
        except CaptureError as err:
            raise CaptureError(f"event {i}: {err}") from None
    out.live_at_end = len(live)
    out.live_bytes_at_end = live_bytes
    out.sites = len(sites)
    return out


def csv_text(rows: Iterable[Tuple[int, str, int, int, int, int]]) -> str:
    """The trace as CSV text (header and one line per row, newline-terminated)."""
    buf = io.StringIO()
    buf.write(HEADER + "\n")
    for r in rows:
        buf.write("%d,%s,%d,%d,%d,%d\n" % r)
    return buf.getvalue()


def write_csv(path: os.PathLike, rows: Iterable[Tuple[int, str, int, int, int, int]]) -> None:
    """Write the rows as a gzip'd CSV trace (written to a temporary name, then renamed)."""
    path = Path(path)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
        gz.write(csv_text(rows).encode())
    os.replace(tmp, path)


def trace_name(path: os.PathLike) -> str:
    """The name gen-trace gives the trace read from ``path``: the file name without ``.gz``, ``.csv``,
    ``.pickle``, ``.pkl`` and ``.log`` extensions (repeatedly, as gen-trace's ``trace_name``)."""
    name = Path(path).name
    while True:
        before = len(name)
        for ext in (".gz", ".csv", ".pickle", ".pkl", ".log"):
            if len(name) > len(ext) and name.endswith(ext):
                name = name[: -len(ext)]
        if len(name) == before:
            return name


def expected_traces(snapshot: Mapping[str, Any], name: str) -> List[Dict[str, Any]]:
    """What gen-trace's snapshot reader must make of ``snapshot``: one trace per device (named ``name``
    with one device, else ``name:devN``, empty devices left out), events as
    ``{"t_us", "kind", "addr", "size", "stream", "site"}`` with kind ``alloc``/``free``."""
    devices = snapshot.get("device_traces") if isinstance(snapshot, Mapping) else None
    if not isinstance(devices, list):
        raise CaptureError("not a PyTorch memory snapshot: no `device_traces` list")
    out = []
    for d, events in enumerate(devices):
        if not isinstance(events, list):
            raise CaptureError(f"device_traces[{d}] is not a list")
        if not events and len(devices) > 1:
            continue
        try:
            conv = convert(events)
        except CaptureError as e:
            raise CaptureError(f"device {d}: {e}") from None
        evs = [{"t_us": t, "kind": "alloc" if a == "a" else "free", "addr": addr, "size": size,
                "stream": s, "site": site} for (t, a, addr, size, s, site) in conv.rows]
        out.append({"name": name if len(devices) == 1 else f"{name}:dev{d}", "events": evs})
    return out


# --------------------------------------------------------------------------------------------------
# Workloads (need torch and a GPU)


@dataclass
class Workload:
    """A program to record: ``step(i)`` runs iteration ``i``; ``streams`` names the streams it uses
    (name -> ``cudaStream_t`` handle); ``finish()`` waits for outstanding work."""

    step: Callable[[int], None]
    streams: Dict[str, int]
    finish: Callable[[], None] = lambda: None


def _gpt2_prefetch(torch) -> Workload:
    import transformers as tf

    dev = torch.device("cuda", torch.cuda.current_device())
    rng = random.Random(1234)
    gen = torch.Generator().manual_seed(1234)
    with dev:
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    compute = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    # A loader's output: pinned host batches with dynamic padding (the length varies per batch).
    host = [torch.randint(0, 50257, (8, rng.choice((512, 640, 768, 1024))), generator=gen).pin_memory()
            for _ in range(6)]

    def prefetch(i):
        with torch.cuda.stream(side):
            ids = host[i % len(host)].to(dev, non_blocking=True)
            labels = ids.clone()
            labels[:, : rng.randint(1, 64)] = -100  # prompt tokens carry no loss
            mask = torch.ones_like(ids)
        return ids, labels, mask

    pending = [prefetch(0)]

    def step(i):
        compute.wait_stream(side)
        ids, labels, mask = pending[0]
        for t in (ids, labels, mask):
            t.record_stream(compute)
        pending[0] = prefetch(i + 1)  # overlaps with this step
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i % 4 == 3:  # log the loss now and then (the host waits for the step)
            float(loss)

    return Workload(step, {"compute": compute.cuda_stream, "prefetch": side.cuda_stream})


def _resnet_copy_overlap(torch) -> Workload:
    import torchvision

    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(1234)
    batch = 64
    with dev:
        model = torchvision.models.resnet50(weights=None)
        mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255
        std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255
    model = model.to(memory_format=torch.channels_last).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    compute = torch.cuda.current_stream()
    h2d, d2h = torch.cuda.Stream(), torch.cuda.Stream()
    images = [torch.randint(0, 256, (batch, 3, 224, 224), dtype=torch.uint8, generator=gen).pin_memory()
              for _ in range(3)]
    labels = [torch.randint(0, 1000, (batch,), generator=gen).pin_memory() for _ in range(3)]
    metrics = torch.zeros(2, 2).pin_memory()  # double-buffered (loss, accuracy) on the host
    in_flight: List[Tuple[Any, int]] = []  # (event, metrics slot) of D2H copies not yet read
    log: List[Tuple[float, float]] = []

    def load(i):
        with torch.cuda.stream(h2d):
            x8 = images[i % len(images)].to(dev, non_blocking=True)
            x = x8.float().sub_(mean).div_(std).contiguous(memory_format=torch.channels_last)
            y = labels[i % len(labels)].to(dev, non_blocking=True)
        return x, y

    pending = [load(0)]

    def read_oldest():
        ev, slot = in_flight.pop(0)
        ev.synchronize()
        log.append((float(metrics[slot, 0]), float(metrics[slot, 1])))

    def step(i):
        compute.wait_stream(h2d)
        x, y = pending[0]
        x.record_stream(compute)
        y.record_stream(compute)
        pending[0] = load(i + 1)  # overlaps with this step
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
            loss = torch.nn.functional.cross_entropy(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        m = torch.stack([loss.detach().float(), (out.argmax(1) == y).float().mean()])
        d2h.wait_stream(compute)
        done = torch.cuda.Event()
        slot = i % 2
        with torch.cuda.stream(d2h):
            metrics[slot].copy_(m, non_blocking=True)
            done.record()
        m.record_stream(d2h)
        in_flight.append((done, slot))
        if len(in_flight) > 1:  # the slot about to be reused was copied a step ago
            read_oldest()

    def finish():
        while in_flight:
            read_oldest()

    return Workload(step, {"compute": compute.cuda_stream, "h2d": h2d.cuda_stream,
                           "d2h": d2h.cuda_stream}, finish)


def _bert_serve_4streams(torch) -> Workload:
    import transformers as tf

    dev = torch.device("cuda", torch.cuda.current_device())
    with dev:
        model = tf.BertModel(tf.BertConfig())
    model.eval()
    streams = [torch.cuda.Stream() for _ in range(4)]

    def serve(k: int, round_: int, errors: List[BaseException]):
        try:
            rng = random.Random(1000 * round_ + k)
            gen = torch.Generator().manual_seed(1000 * round_ + k)
            s = streams[k]
            torch.cuda.set_device(dev)
            with torch.inference_mode(), torch.cuda.stream(s), torch.autocast("cuda", dtype=torch.bfloat16):
                for _ in range(4):  # requests per stream per round
                    b, t = rng.choice((1, 2, 4, 8, 16, 32)), rng.randint(16, 512)
                    ids = torch.randint(0, 30522, (b, t), generator=gen).pin_memory().to(dev, non_blocking=True)
                    mask = torch.ones_like(ids)
                    mask[:, t - rng.randint(0, t // 2):] = 0  # padding of the shorter requests
                    pooled = model(input_ids=ids, attention_mask=mask).pooler_output
                    reply = pooled.float().to("cpu", non_blocking=True)
                    s.synchronize()  # the reply is on the host
                    if tuple(reply.shape) != (b, model.config.hidden_size):
                        raise CaptureError(f"reply of shape {tuple(reply.shape)} for a batch of {b}")
        except BaseException as e:  # re-raised by the caller
            errors.append(e)

    def step(i):
        errors: List[BaseException] = []
        threads = [threading.Thread(target=serve, args=(k, i, errors)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    return Workload(step, {f"serve{k}": s.cuda_stream for k, s in enumerate(streams)})


#: name -> (builder, default steps, one-line description)
WORKLOADS: Dict[str, Tuple[Callable[[Any], Workload], int, str]] = {
    "gpt2_prefetch": (_gpt2_prefetch, 12, "GPT-2 small training, next batch copied/built on a side stream"),
    "resnet_copy_overlap": (_resnet_copy_overlap, 12,
                            "ResNet-50 training, H2D copy stream for the next batch, D2H metrics stream"),
    "bert_serve_4streams": (_bert_serve_4streams, 8, "BERT-base inference, 4 threads on 4 streams, varlen"),
}


def _record(torch, max_entries: int) -> None:
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                             max_entries=max_entries)


def run_child(outdir: Path, name: str, steps: Optional[int], max_entries: int) -> Dict[str, Any]:
    """Record workload ``name`` in this process and write its trace and figures under ``outdir``."""
    import torch

    if not torch.cuda.is_available():
        raise CaptureError("no CUDA device")
    build, default_steps, _ = WORKLOADS[name]
    n = steps if steps is not None else default_steps
    torch.manual_seed(0)
    _record(torch, max_entries)
    t_start = time.perf_counter()
    wl = build(torch)
    torch.cuda.synchronize()
    t_steps = time.perf_counter()
    for i in range(n):
        wl.step(i)  # no host sync between steps: cross-stream frees complete as late as in real training
    wl.finish()
    torch.cuda.synchronize()
    steps_s = time.perf_counter() - t_steps
    # Frees delayed by record_stream become free_completed when PyTorch processes their events.
    torch.cuda.empty_cache()
    wall = time.perf_counter() - t_start
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = snap["device_traces"][torch.cuda.current_device()]
    conv = convert(events)
    write_csv(outdir / f"{name}.csv.gz", conv.rows)
    fig = {"workload": name, "steps": n, "wall_s": round(wall, 3),
           "step_s_mean": round(steps_s / n, 6),
           "max_entries": max_entries, "truncated": len(events) >= max_entries,
           "max_allocated": torch.cuda.max_memory_allocated(),
           "max_reserved": torch.cuda.max_memory_reserved(),
           "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    fig.update(conv.summary(wl.streams))
    (outdir / f"{name}.json").write_text(json.dumps(fig, indent=1) + "\n")
    with open(outdir / "captures.jsonl", "a") as f:
        f.write(json.dumps(fig) + "\n")
    if fig["truncated"]:
        print(f"warning: {name}: {len(events)} events reached max_entries={max_entries}; the oldest were "
              "dropped (raise --max-entries)", file=sys.stderr)
    return fig


def snapshot_pickle(path: Path, max_entries: int = 64) -> Dict[str, Any]:
    """Run the tiny two-stream program, dump its snapshot to ``path`` and the events gen-trace must
    read to ``<path without .pickle>.expected.json``. Returns a summary."""
    import torch

    if not torch.cuda.is_available():
        raise CaptureError("no CUDA device")
    dev = torch.device("cuda", torch.cuda.current_device())
    main_s = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    _record(torch, max_entries)
    a = torch.empty(1000, device=dev)                 # 4000 B -> a 4096 B block
    b = torch.ones(300, device=dev)
    ready = torch.cuda.Event()
    side.wait_stream(main_s)
    with torch.cuda.stream(side):
        c = torch.full((2048,), 1.0, device=dev)      # allocated on the side stream
        d = b * 2                                     # b used on the side stream
        ready.record()
    b.record_stream(side)
    main_s.wait_event(ready)
    c.record_stream(main_s)
    d.record_stream(main_s)
    e = c[:300] + d                                   # side-stream blocks used on the main stream
    big = torch.empty(3 << 20, dtype=torch.uint8, device=dev)  # large pool
    del a, b, c, d, big
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    f = torch.empty(100, device=dev)                  # processes the record_stream events
    del e, f
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._dump_snapshot(str(path))
    torch.cuda.memory._record_memory_history(enabled=None)
    size = path.stat().st_size
    if size > SNAPSHOT_LIMIT:
        raise CaptureError(f"{path} is {size} bytes, over the fixture limit of {SNAPSHOT_LIMIT}")
    with open(path, "rb") as fh:
        snap = pickle.load(fh)
    name = trace_name(path)
    expected = expected_traces(snap, name)
    exp_path = path.with_name(name + ".expected.json")
    exp_path.write_text(json.dumps(expected, indent=1) + "\n")
    return {"snapshot": str(path), "bytes": size, "expected": str(exp_path),
            "events": [len(t["events"]) for t in expected], "torch": torch.__version__}


# --------------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and check the command line (``SystemExit`` with a message on bad input)."""
    p = argparse.ArgumentParser(
        prog="python -m genpool_torch.capture", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("outdir", nargs="?", help="folder for <workload>.csv.gz, <workload>.json, captures.jsonl")
    p.add_argument("workloads", nargs="*", metavar="WORKLOAD",
                   help=f"one or more of {', '.join(WORKLOADS)}, or all")
    p.add_argument("--steps", type=int, default=None, help="iterations (default: per workload)")
    p.add_argument("--max-entries", type=int, default=3_000_000, help="memory history ring buffer size")
    p.add_argument("--timeout", type=int, default=300, help="seconds per workload process")
    p.add_argument("--snapshot-pickle", type=Path, default=None, metavar="PATH",
                   help="write the tiny two-stream snapshot fixture to PATH and exit")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_intermixed_args(argv)
    if args.steps is not None and args.steps < 1:
        p.error("--steps must be at least 1")
    if args.max_entries < 1:
        p.error("--max-entries must be at least 1")
    if args.timeout < 1:
        p.error("--timeout must be at least 1")
    if args.snapshot_pickle is not None:
        if args.outdir or args.workloads:
            p.error("--snapshot-pickle takes no OUTDIR or WORKLOAD")
        return args
    if not args.outdir or not args.workloads:
        p.error("give OUTDIR and at least one WORKLOAD (or --snapshot-pickle PATH)")
    names = list(WORKLOADS) if args.workloads == ["all"] else args.workloads
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown:
        p.error(f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(WORKLOADS)} or all")
    args.workloads = names
    return args


def child_command(args: argparse.Namespace, name: str) -> List[str]:
    """The command line that records ``name`` in a fresh process."""
    cmd = [sys.executable, "-m", "genpool_torch.capture", str(args.outdir), name, "--child",
           "--max-entries", str(args.max_entries)]
    if args.steps is not None:
        cmd += ["--steps", str(args.steps)]
    return cmd


def child_env(environ: Mapping[str, str]) -> Dict[str, str]:
    """Environment of a capture process: this package importable, and PyTorch's native allocator
    (``PYTORCH_CUDA_ALLOC_CONF`` removed: memory history needs the native allocator, and the trace
    should not depend on its options)."""
    env = dict(environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    pkg_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def torch_missing() -> Optional[str]:
    """One line saying that PyTorch is missing, or ``None`` when ``import torch`` can work."""
    import importlib.util

    if importlib.util.find_spec("torch") is not None:
        return None
    return ("capture: PyTorch is not installed in this Python (" + sys.executable + "): pip install torch "
            "(a CUDA build); capturing a trace runs a PyTorch program on a CUDA GPU")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the exit status (0 = every capture written, 2 = PyTorch missing)."""
    args = parse_args(argv)
    missing = torch_missing()
    if missing is not None:
        print(missing, file=sys.stderr)
        return 2
    if args.snapshot_pickle is not None:
        try:
            print(json.dumps(snapshot_pickle(args.snapshot_pickle)))
        except CaptureError as e:
            print(f"capture: {e}", file=sys.stderr)
            return 1
        return 0
    outdir = Path(args.outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    if args.child:
        (name,) = args.workloads
        try:
            print(json.dumps(run_child(outdir, name, args.steps, args.max_entries)), flush=True)
        except CaptureError as e:
            print(f"capture {name}: {e}", file=sys.stderr)
            return 1
        return 0
    failed = 0
    for name in args.workloads:
        t = time.time()
        try:
            r = subprocess.run(child_command(args, name), env=child_env(os.environ), timeout=args.timeout,
                               capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            print(f"[{name}] TIMEOUT after {args.timeout} s", flush=True)
            failed += 1
            continue
        tail = (r.stdout + r.stderr)[-2000:] if r.returncode else r.stdout.strip()[-1500:]
        print(f"[{name}] rc={r.returncode} {time.time() - t:.0f}s\n{tail}", flush=True)
        failed += r.returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
