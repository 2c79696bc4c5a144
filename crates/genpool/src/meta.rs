//! Per-block metadata: a sharded map from device address to what the engine knows about the block.

use gen_classifier::Stamp;
use gen_sync::SpinMutex as Mutex;

use crate::Tier;

/// What the engine remembers about a live block.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Meta {
    /// Bytes the block spans (the request rounded up to 512 B).
    pub size: u64,
    /// The tier it came from.
    pub tier: Tier,
    /// The classifier's stamp (prediction and clocks at allocation).
    pub stamp: Stamp,
    /// The planner's ticket: a block served from the plan's range, or one whose lifetime it records.
    pub ticket: gen_plan::Ticket,
    /// The stream it was allocated for (a free on "its own stream" uses it).
    pub stream: gen_device::StreamId,
    /// `size` minus the bytes asked for (< 512: the rounding), so the request is known at free.
    pub slack: u16,
    /// The allocating thread's slot ([`crate::thread_slot`]) for extent blocks — only that thread keeps
    /// the block in its cache when it frees it (`tcache.rs`); [`NO_THREAD`] otherwise.
    pub thread: u8,
}

/// [`Meta::thread`] of a block no thread cache may keep (slab blocks, placed blocks, records rebuilt).
pub(crate) const NO_THREAD: u8 = u8::MAX;

/// Device addresses are 512-byte aligned: multiply the bits above the alignment into a well-mixed hash.
/// Its top [`SHARD_BITS`] bits choose the shard, the bits below them the slot.
#[inline]
fn hash(ptr: u64) -> u64 {
    (ptr >> 9).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

const SHARD_BITS: u32 = 6;
const SHARDS: usize = 1 << SHARD_BITS;
/// Addresses freed recently, per shard, to tell a double free from a foreign pointer.
const RECENT: usize = 32;

/// One entry of [`Table`], a cache line: the key (the address with bit 0 set; 0 = empty) and its meta.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Slot {
    key: u64,
    meta: Meta,
}

// One entry, one cache line: a field added to `Meta` must fit its padding.
const _: () = assert!(std::mem::size_of::<Slot>() == 64);

const EMPTY: Slot = Slot {
    key: 0,
    meta: Meta {
        size: 0,
        tier: Tier::Slab,
        stamp: Stamp::NONE,
        ticket: gen_plan::Ticket::NONE,
        stream: 0,
        slack: 0,
        thread: NO_THREAD,
    },
};

/// An open-addressing map from address to [`Meta`] with the entries inline (linear probing, at most half
/// full, backward-shift deletion: no tombstones). A lookup reads one cache line in the common case; a
/// general-purpose map reads its control bytes and then its bucket, two misses on the allocator's cold
/// path.
struct Table {
    slots: Box<[Slot]>,
    /// Bits of the slot index (`slots.len() == 1 << bits`).
    bits: u32,
    len: usize,
}

impl Table {
    fn new() -> Self {
        Self::with_bits(6)
    }

    fn with_bits(bits: u32) -> Self {
        Table {
            slots: vec![EMPTY; 1 << bits].into_boxed_slice(),
            bits,
            len: 0,
        }
    }

    #[inline]
    fn home(&self, key: u64) -> usize {
        ((hash(key) << SHARD_BITS) >> (64 - self.bits)) as usize
    }

    #[inline]
    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    /// The slot holding `ptr`, or `Err(the empty slot where it would go)`.
    #[inline]
    fn find(&self, ptr: u64) -> Result<usize, usize> {
        let key = ptr | 1;
        let mut i = self.home(key);
        loop {
            match self.slots[i].key {
                k if k == key => return Ok(i),
                0 => return Err(i),
                _ => i = (i + 1) & self.mask(),
            }
        }
    }

    fn insert(&mut self, ptr: u64, meta: Meta) {
        if (self.len + 1) * 2 > self.slots.len() {
            self.grow();
        }
        match self.find(ptr) {
            Ok(i) => self.slots[i].meta = meta,
            Err(i) => {
                self.slots[i] = Slot { key: ptr | 1, meta };
                self.len += 1;
            }
        }
    }

    fn grow(&mut self) {
        let mut bigger = Table::with_bits(self.bits + 1);
        for s in self.slots.iter().filter(|s| s.key != 0) {
            bigger.insert(s.key & !1, s.meta);
        }
        *self = bigger;
    }

    fn get(&self, ptr: u64) -> Option<Meta> {
        self.find(ptr).ok().map(|i| self.slots[i].meta)
    }

    fn remove(&mut self, ptr: u64) -> Option<Meta> {
        let mut hole = self.find(ptr).ok()?;
        let meta = self.slots[hole].meta;
        let mask = self.mask();
        // Backward shift: pull later entries of the probe run into the hole when their home slot does
        // not lie (cyclically) after the hole.
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let key = self.slots[j].key;
            if key == 0 {
                break;
            }
            let home = self.home(key);
            if (j.wrapping_sub(home) & mask) >= (j.wrapping_sub(hole) & mask) {
                self.slots[hole] = self.slots[j];
                hole = j;
            }
        }
        self.slots[hole] = EMPTY;
        self.len -= 1;
        Some(meta)
    }

    fn iter(&self) -> impl Iterator<Item = (u64, Meta)> + '_ {
        self.slots
            .iter()
            .filter(|s| s.key != 0)
            .map(|s| (s.key & !1, s.meta))
    }
}

struct Shard {
    live: Table,
    recent: [u64; RECENT],
    next: usize,
}

/// The live-block table, sharded by address so threads rarely meet on one lock.
pub(crate) struct MetaTable {
    shards: Box<[crossbeam_utils::CachePadded<Mutex<Shard>>]>,
}

/// Outcome of a removal.
pub(crate) enum Removed {
    Live(Meta),
    RecentlyFreed,
    Unknown,
}

impl MetaTable {
    pub(crate) fn new() -> Self {
        let shards = (0..SHARDS)
            .map(|_| {
                crossbeam_utils::CachePadded::new(Mutex::new(Shard {
                    live: Table::new(),
                    recent: [0; RECENT],
                    next: 0,
                }))
            })
            .collect();
        MetaTable { shards }
    }

    #[inline]
    fn shard(&self, ptr: u64) -> &Mutex<Shard> {
        &self.shards[(hash(ptr | 1) >> (64 - SHARD_BITS)) as usize]
    }

    #[inline]
    pub(crate) fn insert(&self, ptr: u64, meta: Meta) {
        self.shard(ptr).lock().live.insert(ptr, meta);
    }

    #[inline]
    pub(crate) fn remove(&self, ptr: u64) -> Removed {
        let mut s = self.shard(ptr).lock();
        match s.live.remove(ptr) {
            Some(m) => {
                let i = s.next;
                s.recent[i] = ptr;
                s.next = (i + 1) % RECENT;
                Removed::Live(m)
            }
            None if s.recent.contains(&ptr) => Removed::RecentlyFreed,
            None => Removed::Unknown,
        }
    }

    /// Look a live block up without removing it.
    pub(crate) fn get(&self, ptr: u64) -> Option<Meta> {
        self.shard(ptr).lock().live.get(ptr)
    }

    /// Every live block (for end-of-run scoring and invariant checks).
    pub(crate) fn snapshot(&self) -> Vec<(u64, Meta)> {
        let mut v = Vec::new();
        for s in self.shards.iter() {
            v.extend(s.lock().live.iter());
        }
        v
    }

    /// Live blocks in the table (the engine counts its blocks per thread: `Pool::live_blocks`).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().live.len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn meta(size: u64) -> Meta {
        Meta {
            size,
            tier: Tier::Extent,
            stamp: Stamp::NONE,
            ticket: gen_plan::Ticket::NONE,
            stream: 0,
            slack: 0,
            thread: NO_THREAD,
        }
    }

    /// The open-addressing table agrees with a HashMap through growth and backward-shift deletions,
    /// with addresses that collide on purpose (2 MiB apart: the low bits of their hash are equal).
    #[test]
    fn table_matches_a_hash_map() {
        let mut t = Table::new();
        let mut m: HashMap<u64, u64> = HashMap::new();
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let steps = if cfg!(miri) { 2_000 } else { 200_000 };
        for i in 0..steps {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let ptr = 0x7f00_0000_0000 + (x % 4096) * if i % 2 == 0 { 512 } else { 2 << 20 };
            match x % 3 {
                0 | 1 => {
                    t.insert(ptr, meta(x % 1000));
                    m.insert(ptr, x % 1000);
                }
                _ => assert_eq!(t.remove(ptr).map(|v| v.size), m.remove(&ptr)),
            }
            if i % 997 == 0 {
                assert_eq!(t.len, m.len());
                for (&p, &s) in &m {
                    assert_eq!(t.get(p).map(|v| v.size), Some(s));
                }
            }
        }
        let mut all: Vec<u64> = t.iter().map(|(p, _)| p).collect();
        all.sort_unstable();
        let mut want: Vec<u64> = m.keys().copied().collect();
        want.sort_unstable();
        assert_eq!(all, want);
        assert!(t.get(0x1000).is_none() && t.remove(0x1000).is_none());
    }

    #[test]
    fn removal_tells_double_frees_from_foreign_pointers() {
        let t = MetaTable::new();
        t.insert(0x10_0000, meta(512));
        assert!(matches!(t.remove(0x10_0000), Removed::Live(m) if m.size == 512));
        assert!(matches!(t.remove(0x10_0000), Removed::RecentlyFreed));
        assert!(matches!(t.remove(0x20_0000), Removed::Unknown));
        assert_eq!(t.len(), 0);
    }

    #[test]
    fn a_block_taken_out_can_be_put_back() {
        let t = MetaTable::new();
        for i in 0..100u64 {
            t.insert(0x10_0000 + i * 512, meta(512));
        }
        for i in 0..40u64 {
            assert!(matches!(t.remove(0x10_0000 + i * 512), Removed::Live(_)));
        }
        let Removed::Live(m) = t.remove(0x10_0000 + 50 * 512) else {
            panic!("live")
        };
        t.insert(0x10_0000 + 50 * 512, m);
        assert!(matches!(t.remove(0x10_0000), Removed::RecentlyFreed));
        assert_eq!(t.len(), 60);
        assert!(t.get(0x10_0000 + 50 * 512).is_some());
    }
}
