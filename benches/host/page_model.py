#!/usr/bin/env python3
"""A page model of best-fit placement over a trace: how much a lifetime split could buy in memory.

Every block larger than the slab's 4 KiB is placed best fit (smallest free extent that holds it, lowest
address among equals, at the extent's low end) in one of a few address ranges, rounded to 512 B; a 2 MiB
page is held while any live block touches it. The ratio is the peak of held pages over the peak of live
bytes (of those blocks), over one pass. It is not the engine (no slab, no cached pages, one stream), but it
ranks placements the way the engine's replay does (docs/ARCHITECTURE.md, "The old generation").

    python3 benches/host/page_model.py benches/traces/gpt2_generate_kv.csv.gz [...]

prints, per trace: one range; an oracle sending blocks that live >= 20 000 events to a second range; an
oracle with three ranges (< 300, < 20 000, longer); and the engine's rule (`old_generation`): a block goes
to the old range when the last freed block of its size lived >= 4 096 large allocations.
Needs `sortedcontainers` (pip).
"""
import csv
import gzip
import sys

from sortedcontainers import SortedList

PAGE = 2 << 20
SLAB_MAX = 4096


def load(path):
    ev = []
    with gzip.open(path, "rt") as f:
        for r in csv.DictReader(f):
            ev.append((r["action"] == "a", int(r["addr"]), int(r["size"])))
    return ev


class Extents:
    """Free extents of one range: by (size, offset) for best fit, by start and end for coalescing."""

    def __init__(self, length=1 << 40):
        self.by_size = SortedList()
        self.start = {}
        self.end = {}
        self._ins(0, length)

    def _ins(self, o, n):
        self.by_size.add((n, o))
        self.start[o] = n
        self.end[o + n] = o

    def _rem(self, o, n):
        self.by_size.remove((n, o))
        del self.start[o]
        del self.end[o + n]

    def alloc(self, n):
        n_ext, o = self.by_size[self.by_size.bisect_left((n, -1))]
        self._rem(o, n_ext)
        if n_ext > n:
            self._ins(o + n, n_ext - n)
        return o

    def free(self, o, n):
        if o in self.end:
            p = self.end[o]
            pn = self.start[p]
            self._rem(p, pn)
            n += o - p
            o = p
        if o + n in self.start:
            nn = self.start[o + n]
            self._rem(o + n, nn)
            n += nn
        self._ins(o, n)


def run(ev, range_of, nranges):
    """Peak pages / peak live with each allocation (event index, size) placed in range_of(i, size)."""
    ranges = [Extents() for _ in range(nranges)]
    pages, live = {}, {}
    held = live_bytes = peak_held = peak_live = 0
    for i, (is_alloc, addr, size) in enumerate(ev):
        if is_alloc:
            if size <= SLAB_MAX:
                continue
            n = (size + 511) & ~511
            r = range_of(i, size)
            off = ranges[r].alloc(n) + (r << 41)
            live[addr] = (off, n, size, r)
            for p in range(off // PAGE, (off + n - 1) // PAGE + 1):
                c = pages.get(p, 0)
                held += c == 0
                pages[p] = c + 1
            live_bytes += size
            peak_held = max(peak_held, held)
            peak_live = max(peak_live, live_bytes)
        elif addr in live:
            off, n, size, r = live.pop(addr)
            ranges[r].free(off - (r << 41), n)
            live_bytes -= size
            for p in range(off // PAGE, (off + n - 1) // PAGE + 1):
                pages[p] -= 1
                if pages[p] == 0:
                    del pages[p]
                    held -= 1
    return peak_held * PAGE / peak_live


def lifetimes(ev):
    """Events from each allocation to its free (never freed: forever)."""
    life, born = {}, {}
    for i, (is_alloc, addr, _) in enumerate(ev):
        if is_alloc:
            born[addr] = i
        elif addr in born:
            j = born.pop(addr)
            life[j] = i - j
    for j in born.values():
        life[j] = 1 << 62
    return life


def by_size(ev, after=4096):
    """The engine's rule: old when the last freed block of the size lived >= `after` large allocations."""
    survived, born, old = {}, {}, {}
    clock = 0
    for i, (is_alloc, addr, size) in enumerate(ev):
        if is_alloc:
            if size <= SLAB_MAX:
                continue
            clock += 1
            k = (size + 511) & ~511
            old[i] = 1 if survived.get(k, False) else 0
            born[addr] = (clock, k)
        elif addr in born:
            j, k = born.pop(addr)
            survived[k] = clock - j >= after
    return old


def main():
    print("| trace | one range | oracle, 2 ranges | oracle, 3 ranges | by size (old_generation 4096) |")
    print("|---|---|---|---|---|")
    for path in sys.argv[1:]:
        ev = load(path)
        life = lifetimes(ev)
        old = by_size(ev)
        name = path.rsplit("/", 1)[-1].split(".")[0]
        one = run(ev, lambda i, s: 0, 1)
        o2 = run(ev, lambda i, s: int(life[i] >= 20000), 2)
        o3 = run(ev, lambda i, s: 0 if life[i] < 300 else (1 if life[i] < 20000 else 2), 3)
        pred = run(ev, lambda i, s: old[i], 2)
        print(f"| {name} | {one:.4f} | {o2:.4f} | {o3:.4f} | {pred:.4f} |", flush=True)


if __name__ == "__main__":
    main()
