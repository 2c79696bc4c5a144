//! [`Region`]: a reserved range of device virtual addresses whose pages are mapped on demand from a
//! [`PagePool`].

use std::fmt;
use std::sync::Arc;

use gen_device::{DevicePtr, StreamId};

use crate::commit::FreedBy;
use crate::{Inner, PagePool, VmmError};

/// A reserved range of device virtual addresses whose pages are mapped on demand from a [`PagePool`].
pub struct Region {
    pool: Arc<PagePool>,
    id: u32,
    name: &'static str,
    base: DevicePtr,
    len: u64,
}

impl fmt::Debug for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Region")
            .field("name", &self.name)
            .field("base", &format_args!("{:#x}", self.base))
            .field("len", &self.len)
            .finish()
    }
}

impl Region {
    /// Reserve `len` bytes of VA (rounded up to whole pages) on the pool's device.
    pub fn new(pool: &Arc<PagePool>, len: u64, name: &'static str) -> Result<Self, VmmError> {
        let page = pool.page;
        if len == 0 {
            return Err(VmmError::InvalidRange {
                region: name,
                offset: 0,
                len: 0,
                region_len: 0,
            });
        }
        let len = len
            .div_ceil(page)
            .checked_mul(page)
            .ok_or(VmmError::InvalidRange {
                region: name,
                offset: 0,
                len,
                region_len: 0,
            })?;
        let base = pool.device.va_reserve(len, page)?;
        let id = pool.register(name, base, len);
        Ok(Region {
            pool: pool.clone(),
            id,
            name,
            base,
            len,
        })
    }

    /// First address of the region.
    pub fn base(&self) -> DevicePtr {
        self.base
    }

    /// Length in bytes (a whole number of pages).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always false: a region has at least one page.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The region's name (for errors and stats).
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The pool this region draws pages from.
    pub fn pool(&self) -> &Arc<PagePool> {
        &self.pool
    }

    /// Say that all device work on this region's blocks runs on `stream` (`None`: several, or unknown).
    /// With several streams in the pool, a page freed here and moved to a region of another stream is
    /// then ordered after this stream's work by an event the other stream waits on — no host wait —
    /// and a page moved here from a region of another stream makes `stream` wait likewise. Pages of
    /// regions with no stream fall back to a device synchronize before they move.
    pub fn set_stream(&self, stream: Option<StreamId>) {
        let mut g = self.pool.lock();
        if let Some(r) = g.regions[self.id as usize].as_mut() {
            r.stream = stream;
        }
    }

    /// Whether `ptr` lies inside the region.
    #[inline]
    pub fn contains(&self, ptr: DevicePtr) -> bool {
        ptr.wrapping_sub(self.base) < self.len
    }

    fn page_range(&self, offset: u64, len: u64) -> Result<(u64, u64), VmmError> {
        let end = offset.checked_add(len);
        match end {
            Some(end) if len > 0 && end <= self.len => {
                Ok((offset / self.pool.page, (end - 1) / self.pool.page))
            }
            _ => Err(VmmError::InvalidRange {
                region: self.name,
                offset,
                len,
                region_len: self.len,
            }),
        }
    }

    /// Back every page overlapping `[offset, offset + len)` with physical memory: one more reference on
    /// each. With `grow == false` fails with [`VmmError::WouldGrow`] rather than create physical pages. On
    /// any error nothing has changed.
    pub fn commit(&self, offset: u64, len: u64, grow: bool) -> Result<(), VmmError> {
        self.commit_counted(offset, len, grow).map(|_| ())
    }

    /// [`commit`](Self::commit), returning the number of the region's pages in use after it (what a tier
    /// that alone commits into the region would otherwise tally itself).
    pub fn commit_counted(&self, offset: u64, len: u64, grow: bool) -> Result<u64, VmmError> {
        let (first, last) = self.page_range(offset, len)?;
        self.pool
            .commit(self.id, first, last, grow, None, true)
            .map(|(in_use, _)| in_use)
    }

    /// [`commit_for`](Self::commit_for) for a tier that alone commits into the region and orders the
    /// reuse of its own bytes itself (the extent arena several streams share: stamps on its free extents,
    /// [`Handoff::before_use`]): a page revived in place — same address, same physical page — needs no
    /// more ordering than the bytes on it, so only pages moved here or taken back through an old mapping
    /// are ordered after the streams that used them. Returns the number of the region's pages in use
    /// after it (as [`commit_counted`](Self::commit_counted)).
    ///
    /// [`Handoff::before_use`]: crate::Handoff::before_use
    pub fn commit_counted_for(
        &self,
        offset: u64,
        len: u64,
        grow: bool,
        stream: StreamId,
    ) -> Result<u64, VmmError> {
        let (first, last) = self.page_range(offset, len)?;
        self.pool
            .commit(self.id, first, last, grow, Some(stream), false)
            .map(|(in_use, _)| in_use)
    }

    /// [`commit`](Self::commit) for work on `stream`, in a region of no stream of its own (several
    /// streams share it, as the slab's size classes do): a page revived in place or moved here whose last
    /// users ran on another stream (stamped by [`decommit_for`](Self::decommit_for)) and may still be
    /// queued is reused only after `stream` waits on that stream's fence — an event, no host wait. The
    /// caller must hand what it commits to `stream` alone until that stream frees it.
    ///
    /// Returns whether the range's pages may still be in use by queued work (then `stream` was ordered
    /// after it, and what was committed may be used on `stream` alone: another stream would not be);
    /// `false`: on any stream.
    pub fn commit_for(
        &self,
        offset: u64,
        len: u64,
        grow: bool,
        stream: StreamId,
    ) -> Result<bool, VmmError> {
        let (first, last) = self.page_range(offset, len)?;
        self.pool
            .commit(self.id, first, last, grow, Some(stream), true)
            .map(|(_, ordered)| ordered)
    }

    /// Drop one reference from each page overlapping `[offset, offset + len)`; pages left with none become
    /// reusable (revived in place, stolen, or released by [`PagePool::release_unused`]). No driver call.
    ///
    /// In a region of a stream of its own the drop is deferred until the pool's next use, and the next
    /// commit of exactly these pages cancels it (a block freed and its range cut again: neither walks the
    /// pages); whatever else uses the pool first sees it applied.
    pub fn decommit(&self, offset: u64, len: u64) {
        match self.page_range(offset, len) {
            Ok((first, last)) => {
                let pool = &*self.pool;
                let mut g = pool.lock();
                // Deferred where the next commit may cancel it (see `PagePool::commit`): a region of a
                // stream of its own, pages left free staying mapped, the pool awake.
                let defer = pool.leaves_pages_mapped()
                    && g.sleep.is_none()
                    && g.regions[self.id as usize]
                        .as_ref()
                        .is_some_and(|r| r.stream.is_some());
                if defer {
                    g.deferred = Some((self.id, first, last));
                } else {
                    pool.decommit_locked(&mut g, self.id, first, last);
                }
            }
            Err(e) => {
                debug_assert!(false, "{e}");
                log::error!("gen-vmm: decommit: {e}");
            }
        }
    }

    /// [`decommit`](Self::decommit) of a range whose last users ran on `stream` (the caller's word: every
    /// use of the range was on `stream`, or ordered before work queued there): pages left free are
    /// stamped with it, so moving or reviving them for another stream waits on a fence of `stream`
    /// instead of synchronizing the device.
    pub fn decommit_for(&self, offset: u64, len: u64, stream: StreamId) {
        self.decommit_by(offset, len, FreedBy::Stream(stream));
    }

    /// [`decommit`](Self::decommit) of a range no queued work uses any more (the caller's word: a
    /// synchronize, or a completed event recorded after its last use, came since): the pages keep the
    /// streams and free epoch earlier frees left on them, and these bytes add none — so a page a region
    /// of no stream of its own shares (the slab's chunks) is not left with the unknown stream, whose next
    /// reuse on another stream would synchronize the device.
    pub fn decommit_idle(&self, offset: u64, len: u64) {
        self.decommit_by(offset, len, FreedBy::Idle);
    }

    /// The decommit `decommit_for` and `decommit_idle` make, never deferred: `by` says who used the bytes.
    fn decommit_by(&self, offset: u64, len: u64, by: FreedBy) {
        match self.page_range(offset, len) {
            Ok((first, last)) => {
                let mut g = self.pool.lock();
                self.pool
                    .decommit_locked_on(&mut g, self.id, first, last, by);
            }
            Err(e) => {
                debug_assert!(false, "{e}");
                log::error!("gen-vmm: decommit: {e}");
            }
        }
    }

    /// Bytes of pages of this region with at least one reference.
    pub fn committed_bytes(&self) -> u64 {
        let g = self.pool.lock();
        let r = g.regions[self.id as usize]
            .as_ref()
            .expect("registered region");
        debug_assert_eq!(
            r.in_use,
            r.hot.iter().filter(|p| p.refs > 0).count() as u64,
            "pages-in-use count of region '{}'",
            r.name
        );
        r.in_use * self.pool.page
    }

    /// How many of the pages `[offset, offset + len)` overlaps have no physical page mapped under them
    /// (committing the range would have to map that many); `u64::MAX` for a range outside the region.
    pub fn unbacked_in(&self, offset: u64, len: u64) -> u64 {
        let g = self.pool.lock();
        self.unbacked_locked(&g, offset, len)
    }

    /// Whether the pool passes over busy freers ([`PagePool::set_pass_busy`]) and some stream is known
    /// busy now ([`PagePool::any_known_busy`]): placement then asks
    /// [`placement_costs`](Self::placement_costs) even where it would not compare candidates. No lock.
    #[inline]
    pub fn passes_busy(&self) -> bool {
        self.pool.passes_busy_freers() && self.pool.any_known_busy()
    }

    /// Ask the streams known busy again now, past their backoff (one `cuStreamQuery` each): whether any
    /// is idle now (placement's costs may then differ). For placement about to leave every candidate
    /// alone for a busy stream's sake. No lock and no device call while none is known busy.
    pub fn ask_busy_again(&self) -> bool {
        if !self.pool.any_known_busy() {
            return false;
        }
        let mut g = self.pool.lock();
        self.pool.ask_busy_again_locked(&mut g)
    }

    /// [`unbacked_in`](Self::unbacked_in) of each of `ranges`, under one lock (placement compares
    /// candidates with it), for a block for work on `stream` (`None`: the region's own stream), except
    /// that — while the pool passes over busy freers
    /// ([`PagePool::set_pass_busy`]) and some stream is known busy — a range where committing would
    /// wait for a busy stream (an old mapping here still warm, its page in use elsewhere or warm with a
    /// busy stream's work) costs `u64::MAX`: the arena places the block elsewhere while it can. Two
    /// serving streams whose pages once changed hands otherwise hand them back and forth, each move a
    /// wait for the other stream's queued work. Nowhere else (every replay: no stream is ever busy)
    /// does this differ from [`unbacked_in`](Self::unbacked_in).
    pub fn placement_costs(&self, ranges: &[(u64, u64)], stream: Option<StreamId>) -> Vec<u64> {
        let passing = self.passes_busy();
        let mut g = self.pool.lock();
        let target = stream.or(g.regions[self.id as usize]
            .as_ref()
            .expect("registered region")
            .stream);
        ranges
            .iter()
            .map(|&(offset, len)| {
                let unbacked = self.unbacked_locked(&g, offset, len);
                match (target, self.page_range(offset, len)) {
                    (Some(t), Ok((first, last))) if passing && unbacked > 0 => {
                        let waits = (first as u32..=last as u32)
                            .any(|p| self.pool.page_waits_for_busy(&mut g, self.id, p, t));
                        if waits {
                            g.stats.placed_around_busy += 1;
                            u64::MAX
                        } else {
                            unbacked
                        }
                    }
                    _ => unbacked,
                }
            })
            .collect()
    }

    /// [`unbacked_in`](Self::unbacked_in) under the pool's lock, held by the caller.
    fn unbacked_locked(&self, g: &Inner, offset: u64, len: u64) -> u64 {
        let r = g.regions[self.id as usize]
            .as_ref()
            .expect("registered region");
        match self.page_range(offset, len) {
            Ok((first, last)) => r.hot[first as usize..=last as usize]
                .iter()
                .filter(|p| !p.backed())
                .count() as u64,
            Err(_) => u64::MAX,
        }
    }

    /// References held on the page containing `offset` (tests and invariant checks).
    pub fn page_refs(&self, offset: u64) -> u32 {
        let g = self.pool.lock();
        let r = g.regions[self.id as usize]
            .as_ref()
            .expect("registered region");
        r.hot
            .get((offset / self.pool.page) as usize)
            .map_or(0, |p| p.refs)
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if let Err(e) = self.pool.unregister(self.id) {
            log::error!("gen-vmm: dropping region '{}': {e}", self.name);
        }
        if let Err(e) = self.pool.device.va_release(self.base, self.len) {
            log::error!("gen-vmm: releasing the VA of region '{}': {e}", self.name);
        }
    }
}
