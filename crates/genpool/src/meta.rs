//! Per-block metadata: a sharded map from device address to what the engine knows about the block.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use gen_classifier::Stamp;
use parking_lot::Mutex;

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
}

/// Device addresses are 512-byte aligned: multiply-shift them into a well-mixed 64-bit hash.
#[derive(Default, Clone, Copy)]
pub(crate) struct AddrHasher(u64);

impl Hasher for AddrHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ b as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    #[inline]
    fn write_u64(&mut self, v: u64) {
        self.0 = (v >> 9).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type Map = HashMap<u64, Meta, BuildHasherDefault<AddrHasher>>;

const SHARDS: usize = 64;
/// Addresses freed recently, per shard, to tell a double free from a foreign pointer.
const RECENT: usize = 32;

struct Shard {
    live: Map,
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
                    live: Map::default(),
                    recent: [0; RECENT],
                    next: 0,
                }))
            })
            .collect();
        MetaTable { shards }
    }

    #[inline]
    fn shard(&self, ptr: u64) -> &Mutex<Shard> {
        // Use bits above the 512-byte alignment, mixed so neighbouring blocks spread out.
        let h = (ptr >> 9).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 58;
        &self.shards[h as usize % SHARDS]
    }

    #[inline]
    pub(crate) fn insert(&self, ptr: u64, meta: Meta) {
        let mut s = self.shard(ptr).lock();
        s.live.insert(ptr, meta);
    }

    #[inline]
    pub(crate) fn remove(&self, ptr: u64) -> Removed {
        let mut s = self.shard(ptr).lock();
        match s.live.remove(&ptr) {
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
        self.shard(ptr).lock().live.get(&ptr).copied()
    }

    /// Every live block (for end-of-run scoring and invariant checks).
    pub(crate) fn snapshot(&self) -> Vec<(u64, Meta)> {
        let mut v = Vec::new();
        for s in self.shards.iter() {
            v.extend(s.lock().live.iter().map(|(&p, &m)| (p, m)));
        }
        v
    }

    pub(crate) fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().live.len()).sum()
    }
}
