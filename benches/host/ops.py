"""Turn a trace (CSV, format in benches/traces/README.md) into abi_replay.c's ops file: a u64 count, then
per op (size or 0 for a free, dense slot id, stream index from 1). Frees of addresses the trace never
allocated are dropped, as torch_replay.py drops them."""
import gzip, struct, sys

def main(src, dst):
    ops, slot_of, free_slots, nslots, streams = [], {}, [], 0, {}
    with gzip.open(src, "rt") if src.endswith(".gz") else open(src) as f:
        next(f)
        for line in f:
            _, action, addr, size, stream, _ = line.rstrip("\n").split(",")
            if action == "a":
                slot = free_slots.pop() if free_slots else nslots
                nslots = max(nslots, slot + 1)
                slot_of[addr] = slot
                ops.append((int(size), slot, streams.setdefault(stream, len(streams) + 1)))
            elif addr in slot_of:
                slot = slot_of.pop(addr)
                free_slots.append(slot)
                ops.append((0, slot, 0))
    with open(dst, "wb") as o:
        o.write(struct.pack("<Q", len(ops)))
        for op in ops:
            o.write(struct.pack("<QQQ", *op))

if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
