//! Large short/mid-lived tier: best-fit coalescing extent arena over one huge page-mapped region.
//!
//! Activations and other large, short- or mid-lived blocks carry most of a training step's bytes. This
//! tier lays them out in a single [`gen_vmm::Region`] reserved once (by default twice the device's memory
//! of VA — address space costs nothing, only committed pages do), with no segments: best fit with
//! coalescing, as in TensorFlow's BFC or PyTorch's large pool, over one address range ([`ExtentCore`]).
//!
//! A block commits exactly its own bytes (`Region::commit(off, round_up(size, 512))`) and decommits them on
//! free. Blocks are packed back to back (512-B alignment, no rounding to pages), so neighbours share
//! their boundary page and the physical memory held is the live bytes plus at most one partial page per
//! free gap. Best fit takes the smallest free extent that holds the request, the lowest-addressed among
//! equals, and places the block at its low end.
//!
//! All methods take `&self`; bookkeeping sits behind one `parking_lot::Mutex`: segregated size bins for the
//! best fit and boundary tags in an open-addressing table for coalescing (see [`ExtentCore`] for why this
//! layout and not ordered trees). [`ExtentArena::owns`] is a plain address-range check with no lock.

mod core;
mod pieces;
mod survivors;
mod tags;

use std::sync::Arc;

use gen_sync::SpinMutex as Mutex;
use gen_vmm::{PagePool, Region, Stamp};

pub use crate::core::{round_size, ExtentCore, BIRTH_BITS, MIN_BLOCK};
use crate::survivors::Survivors;

/// Errors of the extent tier: the page-mapped tiers' one error type.
pub use gen_vmm::TierError;

/// VA of an arena by default, in multiples of the device's memory. VA is free (the GPU's space is 2^48
/// bytes and more): with eight, however the address space fragments, a request that the pages can hold
/// always finds a free extent (with 2× a random-size workload failed a 0.4 GiB request on a 0.5 GiB
/// device with 0.45 GiB free — found by genpool's tests/prop.rs).
pub const DEFAULT_VA_TIMES: u64 = 8;

/// How many best-fitting free extents a placement restricted by stamps ([`ExtentArena::alloc_ordered`]
/// with `usable`: during a capture, bytes needing no ordering) looks through.
pub const CAPTURE_CANDIDATES: usize = 16;

/// Configuration of an [`ExtentArena`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExtentConfig {
    /// Bytes of VA to reserve; 0 = [`DEFAULT_VA_TIMES`] the device's total memory.
    pub va_bytes: u64,
    /// Name given to the region (errors, stats).
    pub name: &'static str,
    /// How many of the best-fitting free extents page-aware placement compares (either end of each);
    /// 0 or 1 = plain best fit.
    pub placement_candidates: usize,
    /// The old generation: a block whose size's last block outlived this many of the arena's
    /// allocations goes to a range of its own, the upper half of the VA (0 = one range for all). Ages
    /// count modulo 2^[`BIRTH_BITS`]: a value from there on never fires.
    pub old_after: u64,
}

impl Default for ExtentConfig {
    fn default() -> Self {
        ExtentConfig {
            va_bytes: 0,
            name: "gen-extent",
            placement_candidates: 1,
            old_after: 0,
        }
    }
}

/// A snapshot of an [`ExtentArena`]'s counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExtentStats {
    /// Bytes in live blocks (each rounded up to 512 B).
    pub live_bytes: u64,
    /// Number of live blocks.
    pub live_blocks: u64,
    /// Bytes of pages touched by live blocks (what this tier holds committed now).
    pub committed_bytes: u64,
    /// Highest `committed_bytes` so far.
    pub peak_committed_bytes: u64,
    /// Highest `live_bytes` so far.
    pub peak_live_bytes: u64,
    /// Free extents.
    pub free_extents: u64,
    /// Largest free extent in bytes.
    pub largest_free_extent: u64,
    /// VA bytes reserved.
    pub reserved_va_bytes: u64,
    /// Successful allocations so far.
    pub allocs: u64,
    /// Successful frees so far.
    pub frees: u64,
    /// Of `allocs`, those placed in the old generation's range ([`ExtentConfig::old_after`]).
    pub old_allocs: u64,
    /// Bytes in live blocks of the old range now.
    pub old_live_bytes: u64,
    /// Highest `old_live_bytes` so far.
    pub old_peak_live_bytes: u64,
}

struct Inner {
    /// The young generation's range (the whole VA when there is no old generation).
    core: ExtentCore,
    /// The old generation, when [`ExtentConfig::old_after`] asks for one (out of line: a young
    /// block's allocation reads one word of it, the survived-size slot).
    old: Option<Box<OldGen>>,
    /// Bytes in live blocks, both ranges (the cores' sum, kept here so that an allocation reads nothing
    /// of the old core).
    live: u64,
    /// The arena's allocations so far: the one clock both cores' blocks are born and aged on (see
    /// [`on_clock`]).
    clock: u64,
    /// Highest count of the region's pages in use after an allocation (the region counts them: this
    /// arena alone commits into it).
    peak_committed_pages: u64,
    peak_live: u64,
    allocs: u64,
    frees: u64,
    old_allocs: u64,
    old_peak_live: u64,
}

/// The old generation: its range (`[at, len)` of the region; the young one is `[0, at)`) and what the
/// arena learns of lifetimes to send blocks there.
struct OldGen {
    core: ExtentCore,
    at: u64,
    survivors: Survivors,
}

impl Inner {
    /// The core whose range holds `off`.
    #[inline]
    fn core_of(&mut self, off: u64) -> &mut ExtentCore {
        match &mut self.old {
            Some(o) if off >= o.at => &mut o.core,
            _ => &mut self.core,
        }
    }

    /// Both cores, the young one first (ranges in address order).
    fn cores(&self) -> impl Iterator<Item = &ExtentCore> {
        std::iter::once(&self.core).chain(self.old.as_deref().map(|o| &o.core))
    }

    /// `f` on the core whose range holds `off`, on the arena's clock ([`on_clock`]).
    #[inline]
    fn at_core<R>(&mut self, off: u64, f: impl FnOnce(&mut ExtentCore) -> R) -> R {
        let Inner {
            core, old, clock, ..
        } = self;
        let core = match old {
            Some(o) if off >= o.at => &mut o.core,
            _ => core,
        };
        on_clock(clock, core, f)
    }
}

/// `f` on `core` set to the arena's `clock`, which then takes the core's (advanced by each allocation):
/// the two cores of an arena with an old generation share one clock, so that a block's age counts the
/// arena's allocations whichever range made them.
#[inline]
fn on_clock<R>(clock: &mut u64, core: &mut ExtentCore, f: impl FnOnce(&mut ExtentCore) -> R) -> R {
    core.set_clock(*clock);
    let r = f(core);
    *clock = core.clock();
    r
}

/// The large-block tier. See the crate docs.
pub struct ExtentArena {
    region: Region,
    // Copies of the region's range for the lock-free `owns`.
    base: u64,
    len: u64,
    page: u64,
    /// See [`ExtentConfig::placement_candidates`].
    placement_candidates: usize,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for ExtentArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExtentArena")
            .field("region", &self.region)
            .field("stats", &self.stats())
            .finish()
    }
}

/// `size` rounded as the arena serves it, or [`TierError::InvalidSize`]. The error is built only on the
/// error path: `round_size(size).ok_or(TierError::InvalidSize(size))?` built it on every call and dropped
/// it through an out-of-line `drop_in_place::<TierError>` (~1.5 % of a call through the plug-in).
#[inline]
fn rounded(size: u64) -> Result<u64, TierError> {
    match round_size(size) {
        Some(r) => Ok(r),
        None => Err(TierError::InvalidSize(size)),
    }
}

impl ExtentArena {
    /// An arena reserving `cfg.va_bytes` bytes of VA (0 = [`DEFAULT_VA_TIMES`] the device's memory) from `pool`'s device.
    pub fn new(pool: &Arc<PagePool>, cfg: ExtentConfig) -> Result<Self, TierError> {
        let page = pool.page_size();
        let want = if cfg.va_bytes == 0 {
            pool.device()
                .props()
                .total_mem
                .saturating_mul(DEFAULT_VA_TIMES)
        } else {
            cfg.va_bytes
        };
        let va_bytes = want
            .checked_next_multiple_of(page.max(1))
            .filter(|&l| l >= MIN_BLOCK)
            .ok_or_else(|| {
                TierError::InvalidConfig(format!("va_bytes {want:#x} unusable with page {page:#x}"))
            })?;
        let region = Region::new(pool, va_bytes, cfg.name)?;
        let (base, len) = (region.base(), region.len());
        // The old generation takes the upper half, from a page boundary; a range too small to split
        // (a page or less) keeps one generation.
        let at = (len / 2) / page.max(1) * page.max(1);
        let old = (cfg.old_after > 0 && at > 0).then(|| {
            Box::new(OldGen {
                core: ExtentCore::new_range(at, len),
                at,
                survivors: Survivors::new(cfg.old_after),
            })
        });
        let young_end = if old.is_some() { at } else { len };
        Ok(ExtentArena {
            region,
            base,
            len,
            page,
            placement_candidates: cfg.placement_candidates,
            inner: Mutex::new(Inner {
                core: ExtentCore::new(young_end),
                old,
                live: 0,
                clock: 0,
                peak_committed_pages: 0,
                peak_live: 0,
                allocs: 0,
                frees: 0,
                old_allocs: 0,
                old_peak_live: 0,
            }),
        })
    }

    /// Choose where a block of `rounded` bytes goes and take it from the core. Page-aware best fit
    /// (`candidates` > 1): among the few best-fitting free extents (either end of each), the placement
    /// that needs the fewest pages mapped — reusing address ranges whose pages are still mapped is what
    /// lets a steady state run without moving pages (each move costs an unmap and a map). Ties keep
    /// best-fit order. With `usable`, only placements whose stamp it accepts, among the
    /// [`CAPTURE_CANDIDATES`] best fits at least, else in address space no block ever used. Where
    /// committing a candidate for work on `stream` would wait for a stream known busy
    /// ([`gen_vmm::Region::placement_costs`]; only while the pool passes over busy freers), it is left
    /// alone: another candidate, else address space no block ever used, else it after all. Before best
    /// fit, or every candidate, is given up for that, the busy streams are asked again past their
    /// backoff ([`gen_vmm::Region::ask_busy_again`]): a stream that went idle is busy no more.
    fn place(
        &self,
        core: &mut ExtentCore,
        rounded: u64,
        candidates: usize,
        usable: Option<&dyn Fn(Stamp) -> bool>,
        stream: Option<gen_device::StreamId>,
    ) -> Option<(u64, Stamp)> {
        // Best fit, when it is known to wait for a busy stream (asked once, not again below).
        let mut blocked = None;
        let mut cands = match usable {
            None if candidates <= 1 => {
                // Plain best fit, unless committing there would wait for a busy stream: then the
                // best fits that would not, as below.
                if self.region.passes_busy() {
                    let best = core.best_fit(rounded)?;
                    let waits =
                        || self.region.placement_costs(&[(best, rounded)], stream)[0] == u64::MAX;
                    // Before best fit is given up for a belief (a busy stream's backoff counts
                    // questions, not time), the busy streams are asked again.
                    if waits() && (!self.region.ask_busy_again() || waits()) {
                        blocked = Some(best);
                    }
                }
                if blocked.is_none() {
                    return core.alloc_stamped(rounded);
                }
                core.candidates(rounded, CAPTURE_CANDIDATES)
            }
            None => {
                // The best fit first: when it needs no new page it is the choice (ties keep best-fit
                // order), with one page walk and no list of candidates — most allocations of a steady
                // state. (Listing the candidates once for both cost 163 → 178 ns/op on the simulated
                // serving trace: the rare fallback lists them again instead.)
                let best = core.best_fit(rounded)?;
                if self.region.unbacked_in(best, rounded) == 0 {
                    // Best fit's own cut (the same placement: `ExtentCore::best_fit`), without
                    // looking up the extent holding it again.
                    let placed = core.alloc_stamped(rounded);
                    debug_assert_eq!(placed.map(|(o, _)| o), Some(best));
                    return placed;
                }
                core.candidates(rounded, candidates)
            }
            Some(_) => core.candidates_by_piece(rounded, candidates.max(CAPTURE_CANDIDATES)),
        };
        if let Some(ok) = usable {
            cands.retain(|&o| ok(core.free_stamp(o, rounded)));
            if cands.is_empty() {
                // Bytes no block ever used need no ordering.
                return core.alloc_unused(rounded);
            }
        } else if cands.len() <= 1 && blocked.is_none() {
            return core.alloc_stamped(rounded);
        }
        // The cheapest candidate and its cost; `known`'s cost is `u64::MAX` without asking again (best
        // fit's, found to wait above). The ranges are sized once: a filtered collect grows the vector.
        let cheapest = |known: Option<u64>| {
            let mut ranges: Vec<(u64, u64)> = Vec::with_capacity(cands.len());
            ranges.extend(
                cands
                    .iter()
                    .filter(|&&o| Some(o) != known)
                    .map(|&o| (o, rounded)),
            );
            let mut asked = self.region.placement_costs(&ranges, stream).into_iter();
            cands
                .iter()
                .map(|&o| {
                    // (Ends of one extent may coincide: each place of `known` costs the same.)
                    let cost = if Some(o) == known {
                        u64::MAX
                    } else {
                        asked.next().unwrap_or(u64::MAX)
                    };
                    (o, cost)
                })
                .min_by_key(|&(_, cost)| cost)
        };
        let (mut best, mut cost) = cheapest(blocked)?;
        if cost == u64::MAX && self.region.ask_busy_again() {
            // A stream only believed busy (its backoff, counted in questions, not run out) is idle:
            // the candidates again, now, before address space no block used is taken for its sake.
            (best, cost) = cheapest(None)?;
        }
        if cost == u64::MAX {
            // Each would wait for a busy stream: bytes no block ever used, if any are left.
            if let Some(placed) = core.alloc_unused(rounded) {
                return Some(placed);
            }
        }
        core.alloc_at_stamped(best, rounded)
    }

    /// Allocate `size` bytes (rounded up to 512 B, 512-B aligned), best fit, and commit exactly those
    /// bytes. With `grow == false`, fails with [`TierError::WouldGrow`] rather than create physical
    /// pages. On error nothing changed.
    pub fn alloc(&self, size: u64, grow: bool) -> Result<u64, TierError> {
        let rounded = rounded(size)?;
        let mut g = self.inner.lock();
        let (off, stamp) = self.take(&mut g, rounded, self.placement_candidates, None, None)?;
        self.commit_taken(&mut g, off, rounded, grow, stamp, None)?;
        Ok(self.base + off)
    }

    /// [`alloc`](Self::alloc) in an arena several streams allocate from, ordered lazily
    /// ([`keep_stamps`](Self::keep_stamps)), placed among `candidates` best fits (as
    /// [`ExtentConfig::placement_candidates`]; with `usable`, only where it accepts the stamp, else
    /// [`TierError::Exhausted`]): the block is for work on `stream`; `order` gets the stamp of
    /// the bytes it was cut from, before their pages are committed, and must make `stream` wait for the
    /// streams it names ([`gen_vmm::Handoff::before_use`]). When `order` fails the bytes go back, stamp
    /// and all, and its error is returned. Pages come as for [`gen_vmm::Region::commit_for`]: a warm page
    /// last used on another stream is ordered on the device, not by a synchronize.
    pub fn alloc_ordered(
        &self,
        size: u64,
        grow: bool,
        stream: gen_device::StreamId,
        candidates: usize,
        usable: Option<&dyn Fn(Stamp) -> bool>,
        order: impl FnOnce(Stamp) -> Result<(), TierError>,
    ) -> Result<u64, TierError> {
        let rounded = rounded(size)?;
        let mut g = self.inner.lock();
        let (off, stamp) = self.take(&mut g, rounded, candidates, usable, Some(stream))?;
        if let Err(e) = order(stamp) {
            g.core_of(off).free_stamped(off, stamp);
            return Err(e);
        }
        self.commit_taken(&mut g, off, rounded, grow, stamp, Some(stream))?;
        Ok(self.base + off)
    }

    /// Keep a [`Stamp`] on the free extents from now on: for an arena several streams allocate from,
    /// ordered lazily ([`free_stamped`](Self::free_stamped), [`alloc_ordered`](Self::alloc_ordered)).
    pub fn keep_stamps(&self) {
        let mut g = self.inner.lock();
        g.core.keep_stamps();
        if let Some(o) = &mut g.old {
            o.core.keep_stamps();
        }
    }

    /// Take `rounded` bytes from the core, placed among `candidates` best fits ([`place`](Self::place)).
    #[inline]
    fn take(
        &self,
        g: &mut Inner,
        rounded: u64,
        candidates: usize,
        usable: Option<&dyn Fn(Stamp) -> bool>,
        stream: Option<gen_device::StreamId>,
    ) -> Result<(u64, Stamp), TierError> {
        let Inner {
            core, old, clock, ..
        } = g;
        let mut place = |c: &mut ExtentCore| {
            on_clock(clock, c, |c| {
                self.place(c, rounded, candidates, usable, stream)
            })
        };
        let placed = match old {
            None => place(core),
            Some(o) => {
                // A size whose last block survived goes to the old range; either range, full, leaves
                // the block to the other.
                let (first, second) = if o.survivors.predicts_old(rounded) {
                    (&mut o.core, core)
                } else {
                    (core, &mut o.core)
                };
                place(first).or_else(|| place(second))
            }
        };
        placed.ok_or_else(|| TierError::Exhausted {
            what: "extent address space",
            requested: rounded,
            available: g.cores().map(ExtentCore::largest_free).max().unwrap_or(0),
        })
    }

    /// Commit the pages of `[off, off + rounded)`, just taken from the core with `stamp`, for work on
    /// `stream` (`None`: the region's own stream), and keep the books; on error the range goes back to
    /// the core with its stamp (nothing changed).
    fn commit_taken(
        &self,
        g: &mut Inner,
        off: u64,
        rounded: u64,
        grow: bool,
        stamp: Stamp,
        stream: Option<gen_device::StreamId>,
    ) -> Result<(), TierError> {
        let committed = match stream {
            Some(s) => self.region.commit_counted_for(off, rounded, grow, s),
            None => self.region.commit_counted(off, rounded, grow),
        };
        let pages = match committed {
            Ok(pages) => pages,
            Err(e) => {
                g.core_of(off).free_stamped(off, stamp);
                return Err(e.into());
            }
        };
        g.peak_committed_pages = g.peak_committed_pages.max(pages);
        g.live += rounded;
        g.peak_live = g.peak_live.max(g.live);
        g.allocs += 1;
        let live = g.live;
        if let Some(o) = g.old.as_deref_mut() {
            o.survivors.allocated(live);
            if off >= o.at {
                g.old_allocs += 1;
                g.old_peak_live = g.old_peak_live.max(o.core.live_bytes());
            }
        }
        Ok(())
    }

    /// Allocate `size` bytes (rounded up to 512 B) at exactly `ptr` and commit them (creating pages as
    /// needed): restoring blocks a CUDA graph baked in. The whole range must be free in this arena;
    /// otherwise [`TierError::Unplaceable`], with no effect. Returns the rounded size.
    pub fn alloc_at(&self, ptr: u64, size: u64) -> Result<u64, TierError> {
        let rounded = rounded(size)?;
        let unplaceable = |reason| TierError::Unplaceable {
            ptr,
            size: rounded,
            reason,
        };
        if !self.owns(ptr) || ptr - self.base > self.len - rounded.min(self.len) {
            return Err(unplaceable("not inside this arena"));
        }
        if (ptr - self.base) % MIN_BLOCK != 0 {
            return Err(unplaceable("not aligned to 512 bytes"));
        }
        let off = ptr - self.base;
        let mut g = self.inner.lock();
        let Some((_, stamp)) = g.at_core(off, |c| c.alloc_at_stamped(off, rounded)) else {
            return Err(unplaceable(
                "the range is not free (a live block overlaps it)",
            ));
        };
        self.commit_taken(&mut g, off, rounded, true, stamp, None)?;
        Ok(rounded)
    }

    /// Free the block starting at `ptr`: decommit its bytes and coalesce; returns its (rounded) size. A
    /// pointer that is not the start of a live block is [`TierError::InvalidFree`], with no effect.
    pub fn free(&self, ptr: u64) -> Result<u64, TierError> {
        self.free_with(ptr, None, Stamp::NONE)
    }

    /// [`free`](Self::free) for an arena several streams share (no [`set_stream`](Self::set_stream)):
    /// the pages the block leaves free are stamped with `stream`, whose work used it last, so their next
    /// reuse elsewhere waits for that stream only ([`gen_vmm::Region::decommit_for`]); in an arena
    /// ordered lazily ([`keep_stamps`](Self::keep_stamps)) the freed bytes keep `stamp` (from
    /// [`gen_vmm::Handoff::freed_lazily`]) until they are allocated again.
    pub fn free_stamped(
        &self,
        ptr: u64,
        stream: gen_device::StreamId,
        stamp: Stamp,
    ) -> Result<u64, TierError> {
        self.free_with(ptr, Some(stream), stamp)
    }

    fn free_with(
        &self,
        ptr: u64,
        stream: Option<gen_device::StreamId>,
        stamp: Stamp,
    ) -> Result<u64, TierError> {
        if !self.owns(ptr) {
            return Err(TierError::InvalidFree {
                ptr,
                reason: "not the start of a live extent",
            });
        }
        let off = ptr - self.base;
        let mut g = self.inner.lock();
        let Some((size, age)) = g.at_core(off, |c| c.free_aged(off, stamp)) else {
            return Err(TierError::InvalidFree {
                ptr,
                reason: "not the start of a live extent",
            });
        };
        g.live -= size;
        let live = g.live;
        if let Some(o) = &mut g.old {
            o.survivors.freed(size, age, off >= o.at, live);
        }
        match stream {
            Some(s) => self.region.decommit_for(off, size, s),
            None => self.region.decommit(off, size),
        }
        g.frees += 1;
        Ok(size)
    }

    /// Forget what the old generation learnt of sizes' lifetimes (see [`ExtentConfig::old_after`]): a new
    /// run begins (a replay's next pass), whose blocks have none of the last run's history.
    pub fn forget_lifetimes(&self) {
        if let Some(o) = &mut self.inner.lock().old {
            o.survivors.forget();
        }
    }

    /// Say that every block of this arena is used on `stream` (see [`gen_vmm::Region::set_stream`]): with
    /// several streams its pages then move to and from other streams' regions under events, not device
    /// synchronizes.
    pub fn set_stream(&self, stream: Option<gen_device::StreamId>) {
        self.region.set_stream(stream);
    }

    /// Whether `ptr` lies in the arena's address range. Lock-free: a range check for routing frees, not
    /// a liveness check.
    #[inline]
    pub fn owns(&self, ptr: u64) -> bool {
        ptr.wrapping_sub(self.base) < self.len
    }

    /// Size of the live block starting at `ptr`, if there is one.
    pub fn block_size(&self, ptr: u64) -> Option<u64> {
        if !self.owns(ptr) {
            return None;
        }
        let off = ptr - self.base;
        self.inner.lock().core_of(off).block_size(off)
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> ExtentStats {
        let g = self.inner.lock();
        ExtentStats {
            live_bytes: g.cores().map(ExtentCore::live_bytes).sum(),
            live_blocks: g.cores().map(|c| c.live_blocks() as u64).sum(),
            committed_bytes: self.region.committed_bytes(),
            peak_committed_bytes: g.peak_committed_pages * self.page,
            peak_live_bytes: g.peak_live,
            free_extents: g.cores().map(|c| c.free_extents() as u64).sum(),
            largest_free_extent: g.cores().map(ExtentCore::largest_free).max().unwrap_or(0),
            reserved_va_bytes: self.len,
            allocs: g.allocs,
            frees: g.frees,
            old_allocs: g.old_allocs,
            old_live_bytes: g.old.as_deref().map_or(0, |o| o.core.live_bytes()),
            old_peak_live_bytes: g.old_peak_live,
        }
    }

    /// Release what can be released. The arena decommits every block as it is freed and keeps its one
    /// VA range for its lifetime (VA is free; the engine's `owns` routing relies on the range staying
    /// put), so there is never anything to give back here: returns 0. Unused physical pages go back to
    /// the driver through [`PagePool::release_unused`].
    pub fn trim(&self) -> u64 {
        0
    }

    /// Check the arena's invariants (core structure; the region's pages in use are exactly the pages the
    /// live blocks touch).
    /// Expensive; for tests and debugging.
    pub fn check(&self) -> Result<(), String> {
        let g = self.inner.lock();
        for c in g.cores() {
            c.check()?;
        }
        let live: u64 = g.cores().map(ExtentCore::live_bytes).sum();
        if live != g.live {
            return Err(format!(
                "the arena counts {} live bytes, its cores {live}",
                g.live
            ));
        }
        let mut touched = 0u64;
        let mut last_page = None;
        for (off, len) in g.cores().flat_map(ExtentCore::live_ranges) {
            let (first, last) = (off / self.page, (off + len - 1) / self.page);
            // Live ranges are sorted and disjoint: only a range's first page can repeat the last one's.
            let first = if last_page == Some(first) {
                first + 1
            } else {
                first
            };
            touched += (last + 1).saturating_sub(first);
            last_page = Some(last);
        }
        let mapped = self.region.committed_bytes();
        if touched * self.page != mapped {
            return Err(format!(
                "live blocks touch {} B of pages, region says {mapped} B committed",
                touched * self.page
            ));
        }
        Ok(())
    }
}

impl Drop for ExtentArena {
    fn drop(&mut self) {
        // Blocks still live when the arena goes away: drop their page references so the region unmaps
        // cleanly (the engine is shutting down; nothing may use them any more).
        let g = self.inner.get_mut();
        for (off, len) in g.cores().flat_map(ExtentCore::live_ranges) {
            self.region.decommit(off, len);
        }
    }
}
