//! A reference power-of-two buddy allocator over a simulated address space.
//!
//! Every request is rounded up to a power of two (at least [`BUDDY_MIN_BLOCK`] = 512 B). Memory comes
//! from the "driver" as *roots*: naturally aligned power-of-two blocks of
//! `max(request's block, ReferenceBuddyConfig::min_root)` bytes, taken when no free block of the needed order or
//! larger exists, and never given back. A block is split in halves down to the order needed; a freed
//! block merges with its buddy while the buddy is free, up to its root.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::bfc::ReferenceStats;
use crate::replay::ReplayAllocator;
use crate::ReplayError;

/// Smallest block.
pub const BUDDY_MIN_BLOCK: u64 = 512;
const MIN_ORDER: u32 = 9;
const MAX_ORDER: u32 = 46;
const BASE: u64 = 0x7f00_0000_0000;

/// Root sizing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReferenceBuddyConfig {
    /// Smallest root taken from the driver (rounded up to a power of two; default 2 MiB).
    pub min_root: u64,
}

impl Default for ReferenceBuddyConfig {
    fn default() -> Self {
        ReferenceBuddyConfig { min_root: 2 << 20 }
    }
}

/// The buddy reference allocator. See the module docs.
#[derive(Debug)]
pub struct ReferenceBuddy {
    root_order: u32,
    free: Vec<BTreeSet<u64>>,
    used: HashMap<u64, u32>,
    roots: BTreeMap<u64, u32>,
    top: u64,
    reserved: u64,
    peak: u64,
    free_bytes: u64,
}

impl Default for ReferenceBuddy {
    fn default() -> Self {
        ReferenceBuddy::new(ReferenceBuddyConfig::default())
    }
}

fn order_of(size: u64) -> u32 {
    // ceil(log2(size)), at least MIN_ORDER; size >= 1.
    (64 - (size - 1).leading_zeros()).max(MIN_ORDER)
}

impl ReferenceBuddy {
    /// An empty allocator (nothing reserved).
    pub fn new(cfg: ReferenceBuddyConfig) -> Self {
        ReferenceBuddy {
            root_order: order_of(cfg.min_root.clamp(BUDDY_MIN_BLOCK, 1 << 40)),
            free: (0..=MAX_ORDER).map(|_| BTreeSet::new()).collect(),
            used: HashMap::new(),
            roots: BTreeMap::new(),
            top: BASE,
            reserved: 0,
            peak: 0,
            free_bytes: 0,
        }
    }

    /// Counts of the current state.
    pub fn stats(&self) -> ReferenceStats {
        ReferenceStats {
            regions: self.roots.len() as u64,
            free_chunks: self.free.iter().map(|s| s.len() as u64).sum(),
            free_bytes: self.free_bytes,
            used_chunks: self.used.len() as u64,
        }
    }

    fn new_root(&mut self, order: u32) -> Result<(), ReplayError> {
        let size = 1u64 << order;
        let oom = ReplayError::OutOfMemory { requested: size };
        let addr = self.top.checked_add(size - 1).ok_or(oom.clone())? & !(size - 1);
        self.top = addr.checked_add(size).ok_or(oom)?;
        self.roots.insert(addr, order);
        self.reserved += size;
        self.peak = self.peak.max(self.reserved);
        self.free[order as usize].insert(addr);
        self.free_bytes += size;
        Ok(())
    }
}

impl ReplayAllocator for ReferenceBuddy {
    fn name(&self) -> String {
        "buddy".to_owned()
    }

    fn alloc(&mut self, size: u64, _stream: u64, _site: Option<u64>) -> Result<u64, ReplayError> {
        if size == 0 || size > 1 << MAX_ORDER {
            return Err(ReplayError::InvalidRequest {
                message: format!("buddy: size {size} outside 1..=2^{MAX_ORDER}"),
            });
        }
        let k = order_of(size);
        let j = match (k..=MAX_ORDER).find(|&j| !self.free[j as usize].is_empty()) {
            Some(j) => j,
            None => {
                let r = k.max(self.root_order);
                self.new_root(r)?;
                r
            }
        };
        let addr = self.free[j as usize]
            .pop_first()
            .ok_or(ReplayError::OutOfMemory { requested: size })?;
        // Split down to order k, keeping the low half each time.
        for o in (k..j).rev() {
            self.free[o as usize].insert(addr + (1 << o));
        }
        self.free_bytes -= 1 << k;
        self.used.insert(addr, k);
        Ok(addr)
    }

    fn free(&mut self, ptr: u64, _size: u64, _stream: u64) -> Result<(), ReplayError> {
        let mut k = self
            .used
            .remove(&ptr)
            .ok_or(ReplayError::InvalidFree { ptr })?;
        self.free_bytes += 1 << k;
        let root_order = self.roots.range(..=ptr).next_back().map_or(k, |(_, &o)| o);
        let mut addr = ptr;
        while k < root_order && self.free[k as usize].remove(&(addr ^ (1 << k))) {
            addr &= !(1 << k);
            k += 1;
        }
        self.free[k as usize].insert(addr);
        Ok(())
    }

    fn reserved(&self) -> u64 {
        self.reserved
    }

    fn peak_reserved(&self) -> u64 {
        self.peak
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orders() {
        assert_eq!(order_of(1), 9);
        assert_eq!(order_of(512), 9);
        assert_eq!(order_of(513), 10);
        assert_eq!(order_of(2 << 20), 21);
        assert_eq!(order_of((2 << 20) + 1), 22);
    }

    #[test]
    fn split_and_merge() {
        let mut b = ReferenceBuddy::default();
        let a = b.alloc(512, 0, None).unwrap();
        let c = b.alloc(512, 0, None).unwrap();
        assert_eq!(c, a + 512, "buddies are adjacent");
        assert_eq!(b.reserved(), 2 << 20);
        b.free(a, 512, 0).unwrap();
        b.free(c, 512, 0).unwrap();
        let s = b.stats();
        assert_eq!((s.regions, s.free_chunks, s.used_chunks), (1, 1, 0));
        assert_eq!(s.free_bytes, 2 << 20);
        assert_eq!(b.free(a, 512, 0), Err(ReplayError::InvalidFree { ptr: a }));
        // A block bigger than a root gets a root of its own.
        let big = b.alloc(5 << 20, 0, None).unwrap();
        assert_eq!(big % (8 << 20), 0);
        assert_eq!(b.reserved(), (2 << 20) + (8 << 20));
    }
}
