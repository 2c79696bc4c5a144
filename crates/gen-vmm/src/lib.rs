//! Page-granular mapped address ranges over a shared cache of physical device pages.
//!
//! Every genpool tier lays its blocks out in a [`Region`]: a range of device *virtual* addresses reserved
//! once (`cuMemAddressReserve`; VA costs nothing). Physical memory is mapped under a region one page (the
//! driver's VMM granularity, 2 MiB) at a time, and only where a live block touches it: [`Region::commit`]
//! adds one reference to each page a block overlaps, [`Region::decommit`] drops it. Two blocks that abut
//! share their boundary page, so a tier that packs blocks tightly holds `live bytes + a few partial pages`
//! of physical memory, however its *address* space is fragmented.
//!
//! All regions of a device draw pages from one [`PagePool`], which never creates a physical page while an
//! existing one is unused:
//!
//! 1. a page whose references drop to zero stays mapped where it is ("free-mapped") — if the same address
//!    is committed again (the next training iteration lays its blocks out the same way) it is revived with
//!    no driver call at all; and a region of a stream of its own leaves its last decommit pending, so
//!    that a block freed and its pages committed again at once (a loop's temporary buffer) never walks
//!    them (any other use of the pool applies the decommit first);
//! 2. a commit that needs a page where none is mapped takes, in order: an unmapped cached handle, a
//!    free-mapped page *stolen* from another address (one `synchronize`, `cuMemUnmap`, `cuMemMap`), and only
//!    then a new physical page from the driver (`cuMemCreate`).
//!
//! Hence the physical memory held is exactly the peak number of pages ever touched at one moment by live
//! blocks — the quantity the tiers minimise by packing — and the steady state costs no driver calls.
//! Callers that cache freed blocks (and so keep their pages referenced) commit with `grow = false` first:
//! [`VmmError::WouldGrow`] tells them to give their caches back before the pool grows.
//!
//! # Moving a page without stopping the device
//!
//! A free-mapped page may still be in use by work queued before its last block was freed, so it cannot
//! simply be unmapped. The pool tells three cases apart, none of which blocks the host on the device in
//! the common case:
//!
//! - **cold**: a *fence* (an event) recorded after the page became free has completed — no queued work
//!   can touch it: unmap, map at the new address.
//! - **warm, one stream** (the engine has seen a single stream, [`PagePool::set_fence_stream`]): the
//!   page's physical memory is *aliased* — mapped at the new address while the old mapping stays until a
//!   fence recorded after the move completes ([`PagePoolStats::aliases`]). Work on the new address is
//!   queued after the old work on the same stream, so stream order keeps the two apart; the old mapping
//!   (a *zombie*: mapped, no longer the page's) is unmapped later, when the fence says it is idle.
//! - **warm, several streams**: the device is synchronized once per commit, as before
//!   ([`PagePoolStats::syncs`]).
//!
//! So in single-stream training a page move costs a map now and an unmap later, never a device
//! synchronize.
//!
//! # Moves undone
//!
//! With [`PagePoolConfig::keep_old_mappings`] the old mapping is not unmapped once idle: it stays,
//! unused (it adds no physical memory: the page is the same). When its address needs a page again while
//! the page it maps is free where it went (or cached unmapped), the page comes back through it — no map,
//! no access change, no unmap, no synchronize with one stream ([`PagePoolStats::returns`]) — and the
//! address it leaves keeps an old mapping in turn. A training loop whose layout alternates between a few
//! arrangements (random sequence lengths, or a best-fit layout that shifts between iterations) moves
//! its pages back and forth this way for free once each arrangement has been seen. Where the page is in
//! use elsewhere, the old mapping is unmapped then (after its fence) and the address gets a page as
//! usual. At most as many old mappings as pages held are kept, the oldest idle ones unmapped first;
//! [`PagePool::release_unused`] and a region's drop unmap them all. Driver calls per move avoided, H200:
//! `cuMemMap` ~3 µs, `cuMemSetAccess` ~23 µs, `cuMemUnmap` ~16 µs (docs/BENCHMARKS.md).
//!
//! # Pages that stay (CUDA graphs)
//!
//! Two situations forbid moving a page away from an address ([`PagePool::pages_stay`]):
//!
//! - **a capture is underway** on the device ([`Device::captures`]): a capture in global mode forbids
//!   synchronizing, querying or waiting for events and unmapping, and a fence recorded on the
//!   capturing stream would join the graph. A commit then revives pages in place, takes cached or old
//!   mappings back with no call, and creates a page where it would have moved one; it records no fence
//!   (one is recorded by the first commit after the capture) and polls none; `release_unused` and
//!   eager unmapping wait. A commit that could only proceed by unmapping fails with
//!   [`VmmError::Capturing`], changing nothing: the capture stays valid.
//! - **the pool keeps its mappings** ([`PagePool::set_keep_mappings`]; a CUDA graph's private pool):
//!   the graph's kernels use the addresses its blocks had while it was captured, whatever became of
//!   those blocks since, so no address may lose its page while the pool lives. Pages are revived in
//!   place or created, never stolen; `release_unused` gives back only unmapped handles.
//!
//! # Sharing pages
//!
//! [`PagePool::export`] hands out a POSIX descriptor per page under a live range (CUDA IPC): a page
//! referenced by a live block never moves, so what the other process maps is what the range shows
//! for as long as the block lives. [`PagePool::grant_peer`] opens every page mapped now, and every one
//! mapped later, to a peer device.

use gen_device::hash::U64Map;
use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use gen_device::{Device, DeviceError, DevicePtr, EventHandle, PhysHandle, StreamId};

mod commit;
mod fences;
mod freeset;
mod handoff;
mod old_mappings;
mod page;
mod region;
mod sleep;
mod tally;
#[cfg(feature = "testing")]
pub mod testing;
mod tier;
use fences::StreamFences;
use freeset::FreeSet;
use gen_sync::SpinMutex as Mutex;
pub use handoff::{Handoff, Stamp};
use page::{Page, PageHot, RegionPages};
pub use region::Region;
pub use sleep::{Slept, Woken};
pub use tally::PageTally;
pub use tier::{check_tiling, TierError};

/// Errors of the page layer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VmmError {
    /// The commit needs new physical pages and the caller asked not to grow (`grow == false`).
    #[error("commit would create {pages} new physical page(s)")]
    WouldGrow {
        /// Pages that would have to be created.
        pages: u64,
    },
    /// The pool's limit or the device cannot provide the pages.
    #[error("out of device memory: {requested} bytes of new pages needed, {reserved} reserved, limit {limit:?}")]
    OutOfMemory {
        /// Bytes of new physical pages the commit needed.
        requested: u64,
        /// Bytes the pool held when it failed.
        reserved: u64,
        /// The pool's configured limit, if any.
        limit: Option<u64>,
    },
    /// A device call failed.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// An offset/length outside the region, or zero length.
    #[error(
        "range [{offset:#x}, +{len:#x}) is not inside region '{region}' of {region_len:#x} bytes"
    )]
    InvalidRange {
        /// Region name.
        region: &'static str,
        /// Offset asked for.
        offset: u64,
        /// Length asked for.
        len: u64,
        /// The region's length.
        region_len: u64,
    },
    /// The device has no virtual-memory management.
    #[error("device does not support virtual memory management")]
    Unsupported,
    /// A commit while the pool is asleep ([`PagePool::sleep`]): its pages are given back to the driver
    /// until [`PagePool::wake`].
    #[error("the page pool is asleep: no page can be committed until it is woken")]
    Asleep,
    /// [`PagePool::sleep`] on a pool that is asleep already.
    #[error("the page pool is asleep already")]
    AlreadyAsleep,
    /// [`PagePool::wake`] on a pool that is not asleep.
    #[error("the page pool is not asleep")]
    NotAsleep,
    /// Serving the request needs what a CUDA graph capture underway forbids (an address unmapped, a
    /// device or event synchronize); nothing changed, the capture stays valid.
    #[error("a CUDA graph capture is underway: {0} would invalidate it")]
    Capturing(&'static str),
    /// [`PagePool::export`] of a range that is not wholly under live blocks of one region.
    #[error("cannot share [{ptr:#x}, +{len:#x}): {reason}")]
    NotShareable {
        /// Start of the range.
        ptr: u64,
        /// Its length.
        len: u64,
        /// Why.
        reason: &'static str,
    },
}

/// Configuration of a [`PagePool`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PagePoolConfig {
    /// Most bytes of physical pages the pool may hold (`None` = as much as the device gives).
    pub limit: Option<u64>,
    /// Headroom, as a fraction of the highest number of pages ever in use at once, within which a commit
    /// that needs a page creates one rather than steal a free page mapped elsewhere. Stealing costs a
    /// device synchronize and an unmap + map; a little headroom lets a training loop whose layout
    /// shifts a little from one iteration to the next settle with no driver call at all. 0 = never
    /// create while a page is free (the tightest memory, the most remapping).
    pub slack: f64,
    /// Unmap a page as soon as its last reference goes (keeping the handle cached) instead of leaving it
    /// mapped for a cheap revival. Slower; makes use-after-free of device memory fault (tests, debugging).
    pub eager_unmap: bool,
    /// Leave the old mapping of a moved page in place (unused, no driver call) instead of unmapping it
    /// once idle, so that a page needed again at an address it left takes it back with no driver call
    /// while it is free at its new address ([`PagePoolStats::returns`]; see the crate docs, "Moves
    /// undone"). At most as many old mappings as pages held are kept (the oldest idle ones go first);
    /// [`PagePool::release_unused`] and a region's drop unmap them all. Off: old mappings are unmapped
    /// as soon as their fence completes.
    pub keep_old_mappings: bool,
}

/// Counters of a [`PagePool`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct PagePoolStats {
    /// Page size in bytes.
    pub page_size: u64,
    /// Physical pages held now (mapped or cached).
    pub pages_held: u64,
    /// Highest `pages_held` so far.
    pub pages_peak: u64,
    /// Pages mapped with at least one reference.
    pub pages_in_use: u64,
    /// Highest `pages_in_use` so far.
    pub pages_in_use_peak: u64,
    /// Pages mapped with no reference (revivable in place, or stealable).
    pub pages_free_mapped: u64,
    /// Unmapped physical handles kept for reuse.
    pub pages_free_unmapped: u64,
    /// `cuMemCreate` calls made.
    pub creates: u64,
    /// Pages mapped (`cuMemMap` calls; a run of consecutive pages shares one `cuMemSetAccess`).
    pub maps: u64,
    /// Pages unmapped (a run of consecutive pages may go in one `cuMemUnmap`).
    pub unmaps: u64,
    /// Pages moved from one address to another.
    pub steals: u64,
    /// Of the moves, those that aliased a page still possibly in use (mapped at the new address, the old
    /// mapping unmapped once a fence completes) instead of synchronizing the device.
    pub aliases: u64,
    /// Free pages left where they were because their last users' stream was busy (a new page made
    /// instead, so that the committing stream need not wait for that stream's work).
    pub passed_busy: u64,
    /// Places considered for a block where committing would wait for a busy stream
    /// ([`Region::placement_costs`]: an address whose old mapping's page a busy stream holds), left
    /// for another where there was one.
    pub placed_around_busy: u64,
    /// Device synchronizations done to move pages (several streams, or a zombie mapping in the way).
    pub syncs: u64,
    /// Several streams: moves of a page still possibly in use by another stream's queued work, ordered
    /// by making the new stream wait on a fence of the old one (`cuStreamWaitEvent`) instead of a
    /// device synchronize.
    pub stream_waits: u64,
    /// Fences (events) recorded to learn when freed pages and old mappings are idle.
    pub fences: u64,
    /// Old mappings left behind by moves and not unmapped yet.
    pub zombies: u64,
    /// Pages needed again at an address they had moved from, taken back there while free at their new
    /// address (or cached unmapped) through the old mapping left in place: a move undone with no driver
    /// call (with [`PagePoolConfig::keep_old_mappings`]). Not counted in `steals`.
    pub returns: u64,
    /// Wall time spent in commits that moved pages (their driver calls included), in nanoseconds.
    pub move_ns: u64,
    /// Pages revived in place with no driver call.
    pub revivals: u64,
    /// Commits that cancelled the decommit just before them (the same pages of the same region): no
    /// page changed state.
    pub deferrals_cancelled: u64,
    /// Pages given back to the driver.
    pub releases: u64,
    /// Whether the pool is asleep ([`PagePool::sleep`]).
    pub asleep: bool,
    /// Pages referenced by live blocks whose physical memory is given back while the pool sleeps (counted
    /// in `pages_in_use` too, not in `pages_held`).
    pub pages_asleep: u64,
    /// Of those, pages whose contents wait in pinned host memory to be restored at wake.
    pub pages_offloaded: u64,
    /// Bytes of pinned host memory held for offloaded contents (kept after a wake for the next sleep).
    pub host_bytes: u64,
}

impl PagePoolStats {
    /// Bytes of physical memory held now.
    pub fn bytes_held(&self) -> u64 {
        self.pages_held * self.page_size
    }
    /// Highest bytes of physical memory held at one moment.
    pub fn bytes_peak(&self) -> u64 {
        self.pages_peak * self.page_size
    }
}

/// `repr(C)`: the region table and the free set, which every commit and decommit touches, come first (see
/// [`PagePool`]).
#[repr(C)]
struct Inner {
    regions: Vec<Option<RegionPages>>,
    /// Free-mapped pages as (page index, region id). Steals take the highest page index first, so each
    /// region's low addresses — where its tier packs the working set — stay mapped.
    free_mapped: FreeSet,
    /// Epoch of the next fence. A page freed now is stamped with it; it is cold once that fence (or a
    /// later one) has completed.
    epoch: u64,
    stats: PagePoolStats,
    free_handles: Vec<PhysHandle>,
    /// The one stream all work runs on, when the caller says so: fences are recorded there, and warm
    /// pages move by aliasing. `None`: several streams (or unknown); warm pages move after a synchronize.
    fence_stream: Option<StreamId>,
    /// Pages stamped with an epoch `< done_epoch` are cold: their last users are complete.
    done_epoch: u64,
    /// Recorded fences not yet seen complete, oldest first: (epoch, event).
    fences: VecDeque<(u64, EventHandle)>,
    /// Events to reuse for fences.
    spare_events: Vec<EventHandle>,
    /// Zombie mappings in the order they were made: (epoch, region, page). Entries whose page is no
    /// longer a zombie of that epoch are skipped.
    zombies: VecDeque<(u64, u32, u32)>,
    /// Where each physical page mapped as some address's own page is: handle -> (region, page). Kept
    /// for [`PagePoolConfig::keep_old_mappings`] (a move is undone only if the page is free where it is
    /// now); updated on the map / unmap / move paths only, never on a revival.
    /// (gen-device's `u64` hasher: SipHash showed in profiles, ~3.7 % of a GPT-2 replay.)
    owners: U64Map<(u32, u32)>,
    /// A zombie made during this commit may still be in use: the commit records a fence at its end.
    unfenced: bool,
    /// The stream the commit in progress is for (explicit, else its region's): moves into it wait on
    /// the fences of the streams that last used the pages (see [`PagePool::settle`]).
    committing_for: Option<StreamId>,
    /// The commit in progress reused pages still in use by queued work (of `committing_for`, which is
    /// ordered after it by stream order, or of other streams it was made to wait on): what it committed
    /// is safe on `committing_for` alone.
    commit_ordered: bool,
    /// `Some` while the pool is asleep (see [`PagePool::sleep`]).
    sleep: Option<sleep::Sleep>,
    /// Fences per stream, for moves between regions of different streams (several streams).
    stream_fences: Vec<StreamFences>,
    /// A pinned host buffer kept from the last wake for the next offload: (buffer, bytes).
    spare_host: Option<(gen_device::HostHandle, u64)>,
    /// Devices this pool's pages were opened to ([`PagePool::grant_peer`]).
    peers: Vec<usize>,
    /// The last decommit of a region of a stream of its own, `(region, first page, last page)`, not
    /// applied yet: the next commit of exactly those pages cancels it (see [`PagePool::commit`]); any
    /// other use of the pool applies it first ([`PagePool::lock`]).
    deferred: Option<(u32, u64, u64)>,
}

/// How a free page about to serve another address stands with the work that last used it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Settled {
    /// No queued work can use it.
    Idle,
    /// One stream: stream order keeps the new work after the old; a fence recorded at the end of the
    /// commit covers the old mapping.
    Warm,
    /// Several streams: the committing stream was made to wait on this fence of the page's stream (no
    /// host wait); the old mapping is idle once it completes.
    Fenced { stream: StreamId, epoch: u64 },
}

/// [`Page::freed_on`]: freed with no stream known (or past the streams a mask can name): moving or
/// reusing the page for another stream synchronizes the device.
const UNKNOWN_STREAM: u64 = 1 << 63;

/// Epochs of fences recorded past the last known complete at most, before a synchronize (half of
/// [`PageHot::warm`]'s window).
const MAX_EPOCH_LAG: u64 = 1 << 29;

/// One device's cache of physical pages, shared by every [`Region`] on it. See the crate docs.
///
/// `repr(C)`, in this order: what every allocation reads (the headroom, the page size) shares its first
/// cache line with the lock and the region table that every commit touches next.
#[repr(C)]
pub struct PagePool {
    /// Headroom in force, as `f64` bits (starts at [`PagePoolConfig::slack`]; see
    /// [`PagePool::set_slack`]). Read without the lock by callers deciding whether to grow.
    slack: AtomicU64,
    page: u64,
    /// Whether the pool is asleep ([`PagePool::sleep`]); read without the lock by allocators that must
    /// refuse before handing out memory from pages they already hold.
    asleep: AtomicBool,
    /// See [`PagePool::set_keep_mappings`].
    keep_mappings: AtomicBool,
    /// See [`PagePool::set_pass_busy`].
    pass_busy: AtomicBool,
    /// How many streams are known busy (their stream fences' `busy` is not 0; kept by
    /// `learn_idle`): read without the lock, so that while none is (every replay) the passing paths
    /// take no lock and change nothing.
    busy_streams: AtomicU32,
    inner: Mutex<Inner>,
    device: Arc<dyn Device>,
    cfg: PagePoolConfig,
}

impl fmt::Debug for PagePool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PagePool")
            .field("page", &self.page)
            .field("stats", &self.stats())
            .finish()
    }
}

impl PagePool {
    /// A pool on `device`. Fails with [`VmmError::Unsupported`] when the device has no VMM.
    pub fn new(device: Arc<dyn Device>, cfg: PagePoolConfig) -> Result<Arc<Self>, VmmError> {
        let props = device.props();
        if !props.supports_vmm || props.vmm_granularity == 0 {
            return Err(VmmError::Unsupported);
        }
        let page = props.vmm_granularity;
        let slack = cfg.slack;
        Ok(Arc::new(PagePool {
            device,
            page,
            cfg,
            inner: Mutex::new(Inner {
                regions: Vec::new(),
                free_mapped: FreeSet::default(),
                free_handles: Vec::new(),
                stats: PagePoolStats {
                    page_size: page,
                    ..Default::default()
                },
                fence_stream: None,
                epoch: 1,
                done_epoch: 0,
                fences: VecDeque::new(),
                spare_events: Vec::new(),
                zombies: VecDeque::new(),
                owners: U64Map::default(),
                unfenced: false,
                committing_for: None,
                commit_ordered: false,
                stream_fences: Vec::new(),
                sleep: None,
                spare_host: None,
                peers: Vec::new(),
                deferred: None,
            }),
            asleep: AtomicBool::new(false),
            keep_mappings: AtomicBool::new(false),
            pass_busy: AtomicBool::new(false),
            busy_streams: AtomicU32::new(0),
            slack: AtomicU64::new(slack.to_bits()),
        }))
    }

    /// The pool's state, a deferred decommit applied first: every use of the pool sees the pages as the
    /// decommit left them, but for a commit (which may cancel it) and the next decommit, which take the
    /// lock themselves.
    #[inline]
    fn lock(&self) -> gen_sync::SpinMutexGuard<'_, Inner> {
        let mut g = self.inner.lock();
        self.apply_deferred(&mut g);
        g
    }

    /// Apply the deferred decommit, if there is one.
    #[inline]
    fn apply_deferred(&self, g: &mut Inner) {
        if let Some((rid, first, last)) = g.deferred.take() {
            self.decommit_locked(g, rid, first, last);
        }
    }

    /// The page size (the device's VMM granularity).
    pub fn page_size(&self) -> u64 {
        self.page
    }

    /// The device the pages come from.
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }

    /// The pool's configuration.
    pub fn config(&self) -> &PagePoolConfig {
        &self.cfg
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> PagePoolStats {
        let g = self.lock();
        let mut s = g.stats;
        s.pages_free_mapped = g.free_mapped.len();
        s.pages_free_unmapped = g.free_handles.len() as u64;
        s.asleep = g.sleep.is_some();
        if let Some(z) = &g.sleep {
            s.pages_asleep = z.pages;
            s.pages_offloaded = z.slots.len() as u64;
        }
        s.host_bytes = g.sleep.as_ref().and_then(|z| z.host).map_or(0, |(_, b)| b)
            + g.spare_host.map_or(0, |(_, b)| b);
        s
    }

    /// Start the peak of pages held again from the pages held now (PyTorch's `reset_peak_memory_stats`).
    pub fn reset_peak(&self) {
        let mut g = self.lock();
        g.stats.pages_peak = g.stats.pages_held;
    }

    /// Never move a page away from its address from now on (`true`), or again allow it (`false`):
    /// see the crate docs, "Pages that stay". A CUDA graph's pool keeps its mappings while the graph
    /// may replay.
    pub fn set_keep_mappings(&self, keep: bool) {
        self.keep_mappings.store(keep, Relaxed);
    }

    /// Several streams: leave a free page where it is — and make a new one, within the limit and the
    /// device's memory — rather than move it (or take it back through an old mapping) for a stream that
    /// would have to wait on the device for a *busy* stream's work on it (one a wait or a question
    /// found busy, until its backoff runs out). Off by default (the engine's
    /// `experimental.busy_freers:pass` turns it on): busy serving streams then keep to pages of their
    /// own, at the memory that costs. No stream is ever found busy in a replay.
    pub fn set_pass_busy(&self, on: bool) {
        self.pass_busy.store(on, Relaxed);
    }

    /// Whether the pool passes over busy freers ([`set_pass_busy`](Self::set_pass_busy)); no lock.
    #[inline]
    pub fn passes_busy_freers(&self) -> bool {
        self.pass_busy.load(Relaxed)
    }

    /// Whether no page may leave its address now: a capture is underway on the device, or the pool
    /// keeps its mappings (see the crate docs, "Pages that stay").
    #[inline]
    pub fn pages_stay(&self) -> bool {
        self.keep_mappings.load(Relaxed) || self.capturing()
    }

    /// Whether pages a decommit leaves free stay mapped (the default) rather than being unmapped at once
    /// (`eager_unmap`, and not while pages must stay).
    #[inline]
    fn leaves_pages_mapped(&self) -> bool {
        !self.cfg.eager_unmap || self.pages_stay()
    }

    /// Whether a capture is underway on the device (what the device's user told it).
    #[inline]
    fn capturing(&self) -> bool {
        self.device.captures().active()
    }

    /// Give every unused page (free-mapped or cached) back to the driver. Synchronizes the device first
    /// (a free-mapped page may still be in use by work queued before its block was freed). Returns bytes.
    /// While a capture is underway nothing is given back (0); while the pool keeps its mappings only
    /// unmapped cached pages are.
    pub fn release_unused(&self) -> Result<u64, VmmError> {
        if self.capturing() {
            return Ok(0);
        }
        let mut g = self.lock();
        if self.keep_mappings.load(Relaxed) {
            return self.release_handles(&mut g);
        }
        if g.free_mapped.is_empty() && g.free_handles.is_empty() && g.zombies.is_empty() {
            return Ok(0);
        }
        if !g.free_mapped.is_empty() || !g.zombies.is_empty() {
            self.device.synchronize()?;
            self.all_complete(&mut g);
            self.reap_zombies(&mut g, true)?;
        }
        while let Some((rid, pidx)) = pop_free_mapped(&mut g) {
            let handle = self.unmap_page(&mut g, rid, pidx)?;
            g.free_handles.push(handle);
        }
        self.release_handles(&mut g)
    }

    /// Give the cached unmapped pages back to the driver; returns bytes.
    fn release_handles(&self, g: &mut Inner) -> Result<u64, VmmError> {
        let mut released = 0u64;
        while let Some(h) = g.free_handles.pop() {
            if let Err(e) = self.device.phys_release(h) {
                g.free_handles.push(h);
                return Err(e.into());
            }
            g.stats.pages_held -= 1;
            g.stats.releases += 1;
            released += self.page;
        }
        Ok(released)
    }

    /// A POSIX file descriptor for each page under `[ptr, ptr + len)` (CUDA IPC; see the crate docs,
    /// "Sharing pages"), first page first, and the address of the first page. The range must lie in one
    /// region with every page referenced (under live blocks): such a page never moves, so the
    /// descriptors show the range for as long as its blocks live. The device keeps each descriptor
    /// open until the page is given back to the driver.
    pub fn export(&self, ptr: DevicePtr, len: u64) -> Result<(DevicePtr, Vec<i32>), VmmError> {
        let bad = |reason| VmmError::NotShareable { ptr, len, reason };
        if len == 0 {
            return Err(bad("empty range"));
        }
        let end = ptr.checked_add(len).ok_or(bad("range overflows"))?;
        let g = self.lock();
        if g.sleep.is_some() {
            return Err(bad("the pool is asleep"));
        }
        let r = g
            .regions
            .iter()
            .flatten()
            .find(|r| ptr >= r.base && end <= r.base + r.pages.len() as u64 * self.page)
            .ok_or(bad("not inside one region of this pool"))?;
        let first = (ptr - r.base) / self.page;
        let last = (end - 1 - r.base) / self.page;
        let mut fds = Vec::with_capacity((last - first + 1) as usize);
        for pidx in first..=last {
            let (hot, page) = (r.hot[pidx as usize], r.pages[pidx as usize]);
            let h = match page.handle {
                Some(h) if hot.refs > 0 => h,
                _ => return Err(bad("a page of the range is not under a live block")),
            };
            fds.push(self.device.export_handle(h)?);
        }
        Ok((r.base + first * self.page, fds))
    }

    /// Open every page mapped now, and every page mapped from now on, to device `peer`
    /// (`cuMemSetAccess`; PyTorch's `enablePeerAccess`). Returns the pages opened now (0 when `peer`
    /// had access already).
    pub fn grant_peer(&self, peer: usize) -> Result<u64, VmmError> {
        // Under the lock: every map happens under it too, so a page is mapped either before the walk
        // (and opened by it) or after `add_peer` (and opened by the map).
        let mut g = self.lock();
        if g.peers.contains(&peer) {
            return Ok(0);
        }
        // The device may know the peer already (another pool on it asked): its maps open to it anyway.
        self.device.add_peer(peer)?;
        g.peers.push(peer);
        let mut opened = 0;
        for r in g.regions.iter().flatten() {
            let mapped = |i: usize| r.pages[i].handle.is_some() || r.pages[i].zombie.is_some();
            let mut i = 0;
            while i < r.pages.len() {
                if !mapped(i) {
                    i += 1;
                    continue;
                }
                let mut j = i + 1;
                while j < r.pages.len() && mapped(j) {
                    j += 1;
                }
                let va = r.base + i as u64 * self.page;
                self.device
                    .set_peer_access(va, (j - i) as u64 * self.page, peer)?;
                opened += (j - i) as u64;
                i = j;
            }
        }
        Ok(opened)
    }

    /// The page headroom in force (see [`PagePoolConfig::slack`]).
    pub fn slack(&self) -> f64 {
        f64::from_bits(self.slack.load(Relaxed))
    }

    /// Change the page headroom: pages are created rather than moved while the pool holds fewer than
    /// `(1 + slack) ×` its peak of pages in use. Negative or non-finite values count as 0.
    pub fn set_slack(&self, slack: f64) {
        let s = if slack.is_finite() {
            slack.max(0.0)
        } else {
            0.0
        };
        self.slack.store(s.to_bits(), Relaxed);
    }

    fn register(&self, name: &'static str, base: DevicePtr, len: u64) -> u32 {
        let mut g = self.lock();
        let rp = RegionPages {
            name,
            stream: None,
            base,
            pages: vec![Page::default(); (len / self.page) as usize],
            hot: vec![PageHot::default(); (len / self.page) as usize],
            in_use: 0,
        };
        if let Some(i) = g.regions.iter().position(Option::is_none) {
            g.regions[i] = Some(rp);
            i as u32
        } else {
            g.regions.push(Some(rp));
            (g.regions.len() - 1) as u32
        }
    }

    /// Unmap one free-mapped page (refs == 0) and return its handle. The page is left unbacked.
    fn unmap_page(&self, g: &mut Inner, rid: u32, pidx: u32) -> Result<PhysHandle, VmmError> {
        let r = g.regions[rid as usize].as_mut().expect("registered region");
        let va = r.base + pidx as u64 * self.page;
        debug_assert_eq!(r.hot[pidx as usize].refs, 0);
        debug_assert!(
            r.pages[pidx as usize].handle.is_some(),
            "free-mapped page has a handle"
        );
        self.device.unmap(va, self.page)?;
        g.stats.unmaps += 1;
        Ok(detach(g, rid, pidx))
    }

    fn unregister(&self, rid: u32) -> Result<(), VmmError> {
        let mut g = self.lock();
        let (base, n, mapped) = {
            let r = g.regions[rid as usize].as_ref().expect("registered region");
            let mapped = r
                .pages
                .iter()
                .any(|p| p.handle.is_some() || p.zombie.is_some());
            (r.base, r.pages.len(), mapped)
        };
        let mut first_err = None;
        // Mapped pages (own or zombie) may still be used by queued work: one synchronize first.
        if mapped {
            match self.device.synchronize() {
                Ok(()) => self.all_complete(&mut g),
                Err(e) => {
                    first_err.get_or_insert(VmmError::from(e));
                }
            }
        }
        for pidx in 0..n {
            let (p, refs) = {
                let r = g.regions[rid as usize].as_ref().expect("registered region");
                (r.pages[pidx], r.hot[pidx].refs)
            };
            if p.zombie.is_some() {
                // An old mapping left by an aliasing move.
                match self.device.unmap(base + pidx as u64 * self.page, self.page) {
                    Ok(()) => {
                        g.stats.unmaps += 1;
                        g.stats.zombies -= 1;
                    }
                    Err(e) => {
                        first_err.get_or_insert(VmmError::from(e));
                    }
                }
                let r = g.regions[rid as usize].as_mut().expect("registered region");
                r.pages[pidx].zombie = None;
            }
            if p.handle.is_none() {
                if refs > 0 {
                    // Asleep: no physical page under it.
                    let r = g.regions[rid as usize].as_mut().expect("registered region");
                    log::error!(
                        "gen-vmm: region '{}' dropped with page {pidx} still referenced (asleep)",
                        r.name
                    );
                    r.hot[pidx] = PageHot::default();
                    g.stats.pages_in_use -= 1;
                    if let Some(z) = g.sleep.as_mut() {
                        z.forget(rid, pidx as u32);
                    }
                }
                continue;
            }
            let r = g.regions[rid as usize].as_ref().expect("registered region");
            if refs > 0 {
                log::error!(
                    "gen-vmm: region '{}' dropped with page {pidx} still referenced",
                    r.name
                );
            } else {
                g.free_mapped.remove(&(pidx as u32, rid));
            }
            let r = g.regions[rid as usize].as_mut().expect("registered region");
            r.pages[pidx].handle = None;
            r.hot[pidx] = PageHot::default();
            g.owners.remove(&p.handle.expect("checked above").0);
            match self.device.unmap(base + pidx as u64 * self.page, self.page) {
                Ok(()) => {
                    g.stats.unmaps += 1;
                    g.free_handles.push(p.handle.expect("checked above"));
                }
                Err(e) => {
                    first_err.get_or_insert(VmmError::from(e));
                }
            }
            if refs > 0 {
                g.stats.pages_in_use -= 1;
            }
        }
        g.regions[rid as usize] = None;
        g.free_mapped.remove_region(rid);
        g.zombies.retain(|&(_, r, _)| r != rid);
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Drop for PagePool {
    fn drop(&mut self) {
        let g = self.inner.get_mut();
        for (_, ev) in g.fences.drain(..) {
            g.spare_events.push(ev);
        }
        for ev in g.spare_events.drain(..) {
            if let Err(e) = self.device.event_destroy(ev) {
                log::error!("gen-vmm: destroying a fence event at drop failed: {e}");
            }
        }
        for h in g.free_handles.drain(..) {
            if let Err(e) = self.device.phys_release(h) {
                log::error!("gen-vmm: releasing a page at drop failed: {e}");
            }
        }
        let hosts = g.sleep.take().and_then(|z| z.host).into_iter();
        for (h, _) in hosts.chain(g.spare_host.take()) {
            if let Err(e) = self.device.host_free(h) {
                log::error!("gen-vmm: freeing a pinned buffer at drop failed: {e}");
            }
        }
    }
}

/// Take the free-mapped page with the highest page index (of any region).
fn pop_free_mapped(g: &mut Inner) -> Option<(u32, u32)> {
    g.free_mapped.pop_last().map(|(pidx, rid)| (rid, pidx))
}

/// Page `(rid, pidx)`'s address no longer holds its physical page (unmapped, or left as an old mapping
/// by the caller): take the handle out of the page and out of `owners`, and mark the page unbacked.
/// Returns the handle.
pub(crate) fn detach(g: &mut Inner, rid: u32, pidx: u32) -> PhysHandle {
    let r = g.regions[rid as usize].as_mut().expect("registered region");
    let h = r.pages[pidx as usize]
        .handle
        .take()
        .expect("a backed page has a handle");
    r.hot[pidx as usize].set_backed(false);
    g.owners.remove(&h.0);
    h
}
