"""Synthetic allocation traces of shapes the captured ones (benches/traces) do not cover, in their format
(benches/traces/README.md), deterministic (fixed seeds): a check of the general case, not a benchmark to
tune on. Made on the fly where they are used (no file in the repository):

  python3 benches/host/synth_traces.py OUTDIR [NAME ...]

  serve8        eight serving streams taking requests at random (batch 1-8, 16-512 tokens), each
                request's activations kept until the stream's next flush, two temporaries a request;
                150 weights on the default stream
  crossfree     a loader stream allocates each batch, the compute stream frees it two steps later (the
                record_stream hand-off), 5-30 activations a step freed in reverse order
  random_sizes  one stream, sizes log-uniform 1 KiB - 256 MiB, random lifetimes (at most 400 live):
                no layout ever repeats
  kvgrow        generate-like decoding: 24 caches grown by one token a step (a new block, then the old
                one freed), a temporary a layer, 60 requests of random batch and prompt lengths

`genpool replay` and `genpool analyze` read the files; so do benches/gpu/torch_replay.py and
benches/host/ops.py.
"""
import gzip
import os
import random
import sys

MIB = 1 << 20


class Trace:
    """Events in program order; each allocation gets an address of its own (addresses are not reused,
    which the format allows)."""

    def __init__(self):
        self.events = []
        self.next_addr = 1 << 40
        self.live = {}

    def alloc(self, size, stream=0):
        size = (size + 511) // 512 * 512
        addr = self.next_addr
        self.next_addr += size + 4096
        self.events.append(("a", addr, size, stream))
        self.live[addr] = (size, stream)
        return addr

    def free(self, addr, stream=None):
        size, own = self.live.pop(addr)
        self.events.append(("f", addr, size, own if stream is None else stream))

    def write(self, path):
        with gzip.open(path, "wt") as f:
            f.write("t_us,action,addr,size,stream,site\n")
            for i, (action, addr, size, stream) in enumerate(self.events):
                f.write(f"{i},{action},{addr},{size},{stream},0\n")


def serve8(seed=1):
    r, t = random.Random(seed), Trace()
    for _ in range(150):
        t.alloc(r.choice([9 * MIB, 2 * MIB, 3 * MIB]))
    streams = [1000 + i for i in range(8)]
    held = {s: [] for s in streams}
    for _ in range(3000):
        s = r.choice(streams)
        if held[s] and r.random() < 0.3:
            for x in held[s]:
                t.free(x)
            held[s] = []
            continue
        seq, batch = r.randint(16, 512), r.randint(1, 8)
        held[s] += [t.alloc(batch * seq * 768 * 2, s) for _ in range(6)]
        for x in [t.alloc(batch * seq * 3072 * 2, s) for _ in range(2)]:
            t.free(x)
    for s in streams:
        for x in held[s]:
            t.free(x)
    return t


def crossfree(seed=2):
    r, t = random.Random(seed), Trace()
    for _ in range(50):
        t.alloc(r.choice([4 * MIB, 16 * MIB, 64 * MIB]))
    queue = []
    for _ in range(2000):
        queue.append(t.alloc(r.choice([12 * MIB, 24 * MIB, 6 * MIB]), 7))
        acts = [t.alloc(r.randint(1, 40) * MIB + r.randint(0, 511) * 512) for _ in range(r.randint(5, 30))]
        for x in reversed(acts):
            t.free(x)
        if len(queue) > 2:
            t.free(queue.pop(0), 0)
    return t


def random_sizes(seed=3):
    r, t = random.Random(seed), Trace()
    live = []
    for _ in range(60000):
        if live and (r.random() < 0.5 or len(live) > 400):
            t.free(live.pop(r.randrange(len(live))))
        else:
            live.append(t.alloc(int(2 ** r.uniform(10, 28))))
    return t


def kvgrow(seed=4):
    r, t = random.Random(seed), Trace()
    for _ in range(100):
        t.alloc(r.choice([2 * MIB, 9 * MIB, 2304 * 1024]))
    for _ in range(60):
        batch, prompt, new = r.randint(1, 16), r.randint(16, 512), r.randint(16, 128)
        caches = [t.alloc(batch * prompt * 64 * 12 * 2) for _ in range(24)]
        for tok in range(new):
            length = prompt + tok + 1
            for layer in range(24):
                grown = t.alloc(batch * length * 64 * 12 * 2)
                tmp = t.alloc(batch * length * 3072)
                t.free(caches[layer])
                caches[layer] = grown
                t.free(tmp)
        for c in caches:
            t.free(c)
    return t


SHAPES = {"serve8": serve8, "crossfree": crossfree, "random_sizes": random_sizes, "kvgrow": kvgrow}


def main(argv):
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    out, names = argv[0], argv[1:] or list(SHAPES)
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        print(f"unknown shape(s): {', '.join(unknown)}; known: {', '.join(SHAPES)}", file=sys.stderr)
        return 2
    os.makedirs(out, exist_ok=True)
    for n in names:
        t = SHAPES[n]()
        path = os.path.join(out, f"{n}.csv.gz")
        t.write(path)
        print(f"{path}: {len(t.events)} events")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
