//! Long-lived tier: exact-fit buddy allocator with bitvec bitmaps over page-mapped regions.
//!
//! Weights, optimizer state and other blocks that live for the whole run go here. The tier lays them out
//! in one or more [`gen_vmm::Region`]s (4 GiB of VA each by default, created on demand; a block larger
//! than that gets a region of its own, sized to the next power of two), each managed by a [`BuddyCore`]:
//!
//! - **exact fit**: a request takes the smallest power-of-two block that holds it and gives the unused
//!   tail straight back as aligned buddy blocks, so a block occupies `round_up(size, 512)` of address
//!   space and the tail serves later requests;
//! - **only the block's bytes are committed** (`Region::commit(off, round_up(size, 512))`), so physical
//!   memory follows the live bytes, not the powers of two; neighbouring blocks share boundary pages;
//! - **low addresses first**: the region whose smallest fitting free block has the lowest order wins
//!   (ties to the lowest address), and inside a region the lowest free block of that order, so long-lived
//!   blocks pack densely and share pages;
//! - a region that becomes wholly free is kept while it is the only empty one (hysteresis against VA
//!   reserve/release churn) and released otherwise; [`Buddy::trim`] releases every empty region.
//!
//! All methods take `&self`; the bookkeeping sits behind one `parking_lot::Mutex` (the engine keeps an
//! exact-size cache in front of this slow path), except [`Buddy::owns`], which reads a seqlock-protected
//! table of region ranges without locking. Every operation is O(log n) in the free blocks of a region
//! (plus O(regions), a handful).
//!
//! The pure offset allocator [`BuddyCore`] has no device dependency and is tested on its own (also under
//! Miri).

mod core;
mod table;

use std::sync::Arc;

use gen_vmm::{PagePool, Region};
use parking_lot::Mutex;

pub use crate::core::{round_size, BuddyCore, CoreError, MAX_ORDER, MIN_BLOCK};
use crate::table::RangeTable;
pub use crate::table::MAX_REGIONS;
use gen_vmm::PageTally;

/// Errors of the buddy tier: the page-mapped tiers' one error type.
pub use gen_vmm::TierError;

/// Configuration of a [`Buddy`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BuddyConfig {
    /// VA length of an ordinary region: a power of two, at least one page. Default 4 GiB.
    pub region_len: u64,
    /// Name given to the regions (errors, stats).
    pub name: &'static str,
}

impl Default for BuddyConfig {
    fn default() -> Self {
        BuddyConfig {
            region_len: 4 << 30,
            name: "gen-buddy",
        }
    }
}

/// A snapshot of a [`Buddy`]'s counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BuddyStats {
    /// Bytes in live blocks (each rounded up to 512 B).
    pub live_bytes: u64,
    /// Number of live blocks.
    pub live_blocks: u64,
    /// Bytes of pages touched by live blocks (what this tier holds committed now).
    pub committed_bytes: u64,
    /// Highest `committed_bytes` so far.
    pub peak_committed_bytes: u64,
    /// Free buddy blocks over all regions.
    pub free_blocks: u64,
    /// Largest free buddy block in bytes.
    pub largest_free_block: u64,
    /// Regions held now.
    pub regions: u64,
    /// VA bytes reserved by those regions.
    pub reserved_va_bytes: u64,
    /// Successful allocations so far.
    pub allocs: u64,
    /// Successful frees so far.
    pub frees: u64,
}

struct Arena {
    region: Region,
    core: BuddyCore,
    tally: PageTally,
    slot: usize,
}

impl Arena {
    fn is_oversize(&self, cfg: &BuddyConfig) -> bool {
        self.core.len() > cfg.region_len
    }
}

struct Inner {
    /// Sorted by base address.
    arenas: Vec<Arena>,
    committed_pages: u64,
    peak_committed_pages: u64,
    allocs: u64,
    frees: u64,
}

/// The long-lived tier. See the crate docs.
pub struct Buddy {
    pool: Arc<PagePool>,
    cfg: BuddyConfig,
    page: u64,
    table: RangeTable,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for Buddy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buddy")
            .field("cfg", &self.cfg)
            .field("stats", &self.stats())
            .finish()
    }
}

impl Buddy {
    /// A buddy tier drawing pages from `pool`. Reserves no VA until the first allocation.
    pub fn new(pool: &Arc<PagePool>, cfg: BuddyConfig) -> Result<Self, TierError> {
        let page = pool.page_size();
        if !cfg.region_len.is_power_of_two()
            || cfg.region_len < page.max(MIN_BLOCK)
            || BuddyCore::new(cfg.region_len).is_err()
        {
            return Err(TierError::InvalidConfig(format!(
                "region_len {:#x} must be a power of two of at least one page ({page:#x} B) and at most 2^62",
                cfg.region_len
            )));
        }
        Ok(Buddy {
            pool: pool.clone(),
            cfg,
            page,
            table: RangeTable::new(),
            inner: Mutex::new(Inner {
                arenas: Vec::new(),
                committed_pages: 0,
                peak_committed_pages: 0,
                allocs: 0,
                frees: 0,
            }),
        })
    }

    /// The configuration in use.
    pub fn config(&self) -> &BuddyConfig {
        &self.cfg
    }

    /// Allocate `size` bytes (rounded up to 512 B, 512-B aligned) and commit exactly those bytes. With
    /// `grow == false`, fails with [`TierError::WouldGrow`] rather than create physical pages. On error
    /// nothing changed (a region created for the request is released again).
    pub fn alloc(&self, size: u64, grow: bool) -> Result<u64, TierError> {
        let rounded = round_size(size).ok_or(TierError::InvalidSize(size))?;
        let mut g = self.inner.lock();
        // First fit over the regions in address order (each core places at its lowest fitting address).
        let placed = g
            .arenas
            .iter_mut()
            .enumerate()
            .find_map(|(i, a)| a.core.alloc(rounded).map(|off| (i, off)));
        let (idx, off, created) = match placed {
            Some((i, off)) => (i, off, false),
            None => {
                let i = self.add_region(&mut g, rounded)?;
                let off = g.arenas[i]
                    .core
                    .alloc(rounded)
                    .ok_or(TierError::InvalidSize(size))?;
                (i, off, true)
            }
        };
        let arena = &mut g.arenas[idx];
        if let Err(e) = arena.region.commit(off, rounded, grow) {
            arena.core.free(off);
            if created {
                self.remove_region(&mut g, idx);
            }
            return Err(e.into());
        }
        let before = arena.tally.pages();
        arena.tally.add(off, rounded);
        let after = arena.tally.pages();
        let ptr = arena.region.base() + off;
        g.committed_pages += after - before;
        g.peak_committed_pages = g.peak_committed_pages.max(g.committed_pages);
        g.allocs += 1;
        Ok(ptr)
    }

    /// Free the block starting at `ptr`, decommitting its bytes; returns its (rounded) size. A pointer
    /// that is not the start of a live block of this tier is [`TierError::InvalidFree`], with no effect.
    pub fn free(&self, ptr: u64) -> Result<u64, TierError> {
        let mut g = self.inner.lock();
        let idx = g
            .arenas
            .partition_point(|a| a.region.base() <= ptr)
            .checked_sub(1)
            .filter(|&i| g.arenas[i].region.contains(ptr))
            .ok_or(TierError::InvalidFree {
                ptr,
                reason: "not the start of a live buddy block",
            })?;
        let arena = &mut g.arenas[idx];
        let off = ptr - arena.region.base();
        let size = arena.core.free(off).ok_or(TierError::InvalidFree {
            ptr,
            reason: "not the start of a live buddy block",
        })?;
        arena.region.decommit(off, size);
        let before = arena.tally.pages();
        arena.tally.remove(off, size);
        let after = arena.tally.pages();
        let now_empty = arena.core.is_empty();
        g.committed_pages -= before - after;
        g.frees += 1;
        if now_empty {
            // Keep one wholly-free region around; release this one if another is already empty.
            let other_empty = g
                .arenas
                .iter()
                .enumerate()
                .any(|(i, a)| i != idx && a.core.is_empty());
            if other_empty {
                self.remove_region(&mut g, idx);
            }
        }
        Ok(size)
    }

    /// Whether `ptr` lies in one of this tier's regions. Lock-free: an address-range check for routing
    /// frees, not a liveness check.
    #[inline]
    pub fn owns(&self, ptr: u64) -> bool {
        self.table.contains(ptr)
    }

    /// Size of the live block starting at `ptr`, if there is one.
    pub fn block_size(&self, ptr: u64) -> Option<u64> {
        let g = self.inner.lock();
        let a = g.arenas.iter().find(|a| a.region.contains(ptr))?;
        a.core.block_size(ptr - a.region.base())
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> BuddyStats {
        let g = self.inner.lock();
        let mut s = BuddyStats {
            committed_bytes: g.committed_pages * self.page,
            peak_committed_bytes: g.peak_committed_pages * self.page,
            regions: g.arenas.len() as u64,
            allocs: g.allocs,
            frees: g.frees,
            ..BuddyStats::default()
        };
        for a in &g.arenas {
            s.live_bytes += a.core.live_bytes();
            s.live_blocks += a.core.live_blocks() as u64;
            s.free_blocks += a.core.free_blocks() as u64;
            s.largest_free_block = s.largest_free_block.max(a.core.largest_free());
            s.reserved_va_bytes += a.region.len();
        }
        s
    }

    /// Release every wholly-free region (its VA goes back to the driver; its pages were already
    /// decommitted). Returns the VA bytes released.
    pub fn trim(&self) -> u64 {
        let mut g = self.inner.lock();
        let mut released = 0;
        let mut i = 0;
        while i < g.arenas.len() {
            if g.arenas[i].core.is_empty() {
                released += g.arenas[i].region.len();
                self.remove_region(&mut g, i);
            } else {
                i += 1;
            }
        }
        released
    }

    /// Check the tier's invariants (each core's structure, the page tally against the region's own page
    /// references, the range table). Expensive (scans every bitmap); for tests and debugging.
    pub fn check(&self) -> Result<(), String> {
        let g = self.inner.lock();
        let mut pages = 0;
        for (i, a) in g.arenas.iter().enumerate() {
            a.core.check().map_err(|e| format!("region {i}: {e}"))?;
            let tallied = a.tally.pages() * self.page;
            let mapped = a.region.committed_bytes();
            if tallied != mapped {
                return Err(format!(
                    "region {i}: tally {tallied} B committed, region says {mapped} B"
                ));
            }
            if !self.table.contains(a.region.base())
                || !self.table.contains(a.region.base() + a.core.len() - 1)
            {
                return Err(format!("region {i} missing from the range table"));
            }
            if i > 0 && g.arenas[i - 1].region.base() >= a.region.base() {
                return Err("regions not sorted by base".into());
            }
            pages += a.tally.pages();
        }
        if pages != g.committed_pages {
            return Err(format!(
                "committed pages {} recorded, {pages} in regions",
                g.committed_pages
            ));
        }
        Ok(())
    }

    /// Create a region for a request of `rounded` bytes that fits nowhere; returns its index.
    fn add_region(&self, g: &mut Inner, rounded: u64) -> Result<usize, TierError> {
        let len = rounded
            .checked_next_power_of_two()
            .map(|p| p.max(self.cfg.region_len))
            .filter(|&l| l <= MIN_BLOCK << MAX_ORDER)
            .ok_or(TierError::InvalidSize(rounded))?;
        let core = BuddyCore::new(len).map_err(|_| TierError::InvalidSize(rounded))?;
        // Hysteresis: an empty region that cannot serve this request only costs VA; let it go first.
        let mut i = 0;
        while i < g.arenas.len() {
            if g.arenas[i].core.is_empty() {
                self.remove_region(g, i);
            } else {
                i += 1;
            }
        }
        let region = Region::new(&self.pool, len, self.cfg.name)?;
        let slot = self
            .table
            .insert(region.base(), len)
            .ok_or(TierError::Exhausted {
                what: "buddy regions",
                requested: 1,
                available: MAX_REGIONS as u64,
            })?;
        let arena = Arena {
            region,
            core,
            tally: PageTally::new(self.page),
            slot,
        };
        let idx = g
            .arenas
            .partition_point(|a| a.region.base() < arena.region.base());
        g.arenas.insert(idx, arena);
        Ok(idx)
    }

    fn remove_region(&self, g: &mut Inner, idx: usize) {
        let arena = g.arenas.remove(idx);
        self.table.remove(arena.slot);
        log::debug!(
            "{}: releasing region at {:#x} ({} B, oversize: {})",
            self.cfg.name,
            arena.region.base(),
            arena.core.len(),
            arena.is_oversize(&self.cfg)
        );
        drop(arena);
    }
}

impl Drop for Buddy {
    fn drop(&mut self) {
        // Blocks still live when the tier goes away: drop their page references so the regions unmap
        // cleanly (the engine is shutting down; nothing may use them any more).
        let g = self.inner.get_mut();
        for a in &g.arenas {
            for (off, len) in a.core.live_ranges() {
                a.region.decommit(off, len);
            }
        }
    }
}
