//! A reference best-fit-with-coalescing pool in the manner of TensorFlow's BFC allocator, over a
//! simulated address space (pure address arithmetic; nothing is dereferenced).
//!
//! - Requests are rounded up to [`BFC_ROUND`] (512 B).
//! - Memory comes from the "driver" in *regions*. Growth policy (as TF's `allow_growth`): when no free
//!   chunk fits, a new region of `max(next_region, round_up(request, min_region))` bytes is taken;
//!   `next_region` starts at [`BfcConfig::min_region`] and doubles after each new region, up to
//!   [`BfcConfig::max_region`]. Regions are never given back (TF keeps them too), so `reserved` only
//!   grows; that is what makes BFC's ratio > 1 on traces whose shapes change.
//! - A request takes the smallest free chunk that fits (ties: lowest address) — exact best fit over an
//!   ordered set, where TF approximates it with power-of-two bins. The chunk is split when the rest is
//!   at least [`BFC_ROUND`].
//! - A freed chunk merges with free neighbours in the same region.

use std::collections::{BTreeMap, BTreeSet};

use crate::replay::ReplayAllocator;
use crate::ReplayError;

/// Rounding of every request (and the minimum chunk).
pub const BFC_ROUND: u64 = 512;
/// Where the simulated address space starts.
const BASE: u64 = 0x7f00_0000_0000;
/// Largest request accepted (larger would overflow the simulated address space).
const MAX_REQUEST: u64 = 1 << 46;

/// Region growth policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BfcConfig {
    /// First region size and the granularity of every region (default 2 MiB).
    pub min_region: u64,
    /// Cap of the doubling region size (default 1 GiB).
    pub max_region: u64,
}

impl Default for BfcConfig {
    fn default() -> Self {
        BfcConfig {
            min_region: 2 << 20,
            max_region: 1 << 30,
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Chunk {
    size: u64,
    free: bool,
    region: u32,
}

/// Counts of the pool's state, for tests and diagnostics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReferenceStats {
    /// Regions (BFC) or roots (buddy) taken from the driver.
    pub regions: u64,
    /// Free chunks / blocks.
    pub free_chunks: u64,
    /// Bytes in free chunks.
    pub free_bytes: u64,
    /// Chunks / blocks in use.
    pub used_chunks: u64,
}

/// The BFC reference pool. See the module docs.
#[derive(Debug)]
pub struct Bfc {
    cfg: BfcConfig,
    chunks: BTreeMap<u64, Chunk>,
    free_set: BTreeSet<(u64, u64)>,
    next_region: u64,
    regions: u32,
    top: u64,
    reserved: u64,
    peak: u64,
    free_bytes: u64,
}

impl Default for Bfc {
    fn default() -> Self {
        Bfc::new(BfcConfig::default())
    }
}

fn round_up(x: u64, to: u64) -> Option<u64> {
    x.checked_add(to - 1).map(|v| v / to * to)
}

impl Bfc {
    /// An empty pool (nothing reserved). `min_region` is raised to a multiple of 2 MiB and
    /// `max_region` to at least `min_region`.
    pub fn new(cfg: BfcConfig) -> Self {
        let min_region =
            round_up(cfg.min_region.clamp(2 << 20, 1 << 40), 2 << 20).unwrap_or(2 << 20);
        let cfg = BfcConfig {
            min_region,
            max_region: cfg.max_region.clamp(min_region, 1 << 40),
        };
        Bfc {
            cfg,
            chunks: BTreeMap::new(),
            free_set: BTreeSet::new(),
            next_region: cfg.min_region,
            regions: 0,
            top: BASE,
            reserved: 0,
            peak: 0,
            free_bytes: 0,
        }
    }

    /// Counts of the current state.
    pub fn stats(&self) -> ReferenceStats {
        ReferenceStats {
            regions: u64::from(self.regions),
            free_chunks: self.free_set.len() as u64,
            free_bytes: self.free_bytes,
            used_chunks: (self.chunks.len() - self.free_set.len()) as u64,
        }
    }

    fn grow(&mut self, need: u64) -> Result<(), ReplayError> {
        let oom = ReplayError::OutOfMemory { requested: need };
        let size = round_up(need, self.cfg.min_region)
            .ok_or(oom.clone())?
            .max(self.next_region);
        let region = self.regions.checked_add(1).ok_or(oom.clone())?;
        let addr = self.top;
        // One guard granule between regions, so no two regions are adjacent in address space.
        self.top = addr
            .checked_add(size)
            .and_then(|t| t.checked_add(self.cfg.min_region))
            .ok_or(oom)?;
        self.regions = region;
        self.reserved += size;
        self.peak = self.peak.max(self.reserved);
        self.next_region = (self.next_region * 2).min(self.cfg.max_region);
        self.insert_free(addr, size, region - 1);
        Ok(())
    }

    fn insert_free(&mut self, addr: u64, size: u64, region: u32) {
        self.chunks.insert(
            addr,
            Chunk {
                size,
                free: true,
                region,
            },
        );
        self.free_set.insert((size, addr));
        self.free_bytes += size;
    }

    fn remove_free(&mut self, addr: u64, size: u64) {
        self.free_set.remove(&(size, addr));
        self.chunks.remove(&addr);
        self.free_bytes -= size;
    }
}

impl ReplayAllocator for Bfc {
    fn name(&self) -> String {
        "bfc".to_owned()
    }

    fn alloc(&mut self, size: u64, _stream: u64, _site: Option<u64>) -> Result<u64, ReplayError> {
        if size == 0 || size > MAX_REQUEST {
            return Err(ReplayError::InvalidRequest {
                message: format!("bfc: size {size} outside 1..=2^46"),
            });
        }
        let need = round_up(size, BFC_ROUND).ok_or(ReplayError::OutOfMemory { requested: size })?;
        let found = self.free_set.range((need, 0)..).next().copied();
        let (csize, addr) = match found {
            Some(f) => f,
            None => {
                self.grow(need)?;
                self.free_set
                    .range((need, 0)..)
                    .next()
                    .copied()
                    .ok_or(ReplayError::OutOfMemory { requested: size })?
            }
        };
        let region = self.chunks[&addr].region;
        self.remove_free(addr, csize);
        if csize - need >= BFC_ROUND {
            self.insert_free(addr + need, csize - need, region);
        }
        let used = if csize - need >= BFC_ROUND {
            need
        } else {
            csize
        };
        self.chunks.insert(
            addr,
            Chunk {
                size: used,
                free: false,
                region,
            },
        );
        Ok(addr)
    }

    fn free(&mut self, ptr: u64, _size: u64, _stream: u64) -> Result<(), ReplayError> {
        let chunk = match self.chunks.get(&ptr) {
            Some(c) if !c.free => *c,
            _ => return Err(ReplayError::InvalidFree { ptr }),
        };
        let (mut start, mut size) = (ptr, chunk.size);
        self.chunks.remove(&ptr);
        // Merge with the next chunk if free and in the same region.
        if let Some(next) = self.chunks.get(&(ptr + size)).copied() {
            if next.free && next.region == chunk.region {
                self.remove_free(ptr + size, next.size);
                size += next.size;
            }
        }
        // And with the previous one.
        if let Some((&paddr, &prev)) = self.chunks.range(..ptr).next_back() {
            if prev.free && prev.region == chunk.region && paddr + prev.size == ptr {
                self.remove_free(paddr, prev.size);
                start = paddr;
                size += prev.size;
            }
        }
        self.insert_free(start, size, chunk.region);
        Ok(())
    }

    fn reserved(&self) -> u64 {
        self.reserved
    }

    fn peak_reserved(&self) -> u64 {
        self.peak
    }
}
