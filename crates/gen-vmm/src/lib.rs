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
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use gen_device::{Device, DeviceError, DevicePtr, EventHandle, PhysHandle, StreamId};

mod freeset;
mod handoff;
mod sleep;
mod tally;
#[cfg(feature = "testing")]
pub mod testing;
mod tier;
use freeset::FreeSet;
use gen_sync::SpinMutex as Mutex;
pub use handoff::{Handoff, Stamp};
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

/// What every commit and decommit reads and writes of a page, eight pages to a cache line (the rest is
/// in [`Page`]). A training loop's steady state revives and frees the same pages on each large block's
/// allocation and free (ResNet-50: ~6 pages per allocation): with the page's 48 bytes in one struct that
/// walk touched a line per page or so; inside PyTorch each is a likely miss.
#[derive(Clone, Copy, Debug, Default)]
struct PageHot {
    refs: u32,
    /// Bit 0: a physical page is mapped here (`Page::handle` is `Some`). Bits 1-31: the fence epoch in
    /// force when the page last became free (see [`Inner::epoch`]), modulo 2^31 — see [`PageHot::warm`].
    word: u32,
}

impl PageHot {
    #[inline]
    fn backed(self) -> bool {
        self.word & 1 != 0
    }

    #[inline]
    fn set_backed(&mut self, backed: bool) {
        self.word = (self.word & !1) | u32::from(backed);
    }

    #[inline]
    fn set_freed(&mut self, epoch: u64) {
        self.word = (self.word & 1) | ((epoch as u32) << 1);
    }

    /// The full epoch the page was last freed at, given the pool's epoch `now` (the page keeps it modulo
    /// 2^31; exact for a page freed within the last 2^31 fences, which every warm page is).
    #[inline]
    fn freed_epoch(self, now: u64) -> u64 {
        let m = u64::from(self.word >> 1);
        let back = (now & 0x7FFF_FFFF).wrapping_sub(m) & 0x7FFF_FFFF;
        now.saturating_sub(back)
    }

    /// Whether the page was freed at an epoch ≥ `done_epoch` (its last users may still run). The epoch is
    /// kept modulo 2^31 and compared within a window of 2^30 fences: a page freed more than 2^30 fences
    /// before `done_epoch` reads as warm, the safe side (it waits for a fence or a synchronize before it
    /// moves); a warm page is at most [`MAX_EPOCH_LAG`] ahead.
    #[inline]
    fn warm(self, done_epoch: u64) -> bool {
        let freed = self.word >> 1;
        let done = (done_epoch as u32) & (u32::MAX >> 1);
        (freed.wrapping_sub(done) & (u32::MAX >> 1)) < (1 << 30)
    }
}

#[cfg(test)]
mod page_hot_tests {
    use super::PageHot;

    #[test]
    fn warm_compares_epochs_across_the_31_bit_wrap() {
        let mut p = PageHot::default();
        p.set_backed(true);
        for base in [
            0u64,
            5,
            (1 << 31) - 3,
            (1 << 31) + 7,
            u64::from(u32::MAX) - 1,
            1 << 40,
        ] {
            p.set_freed(base);
            assert!(p.backed(), "the epoch leaves the mapped bit alone");
            // Freed at or after the completed fences: warm.
            assert!(p.warm(base), "{base}: freed at done_epoch");
            assert!(
                p.warm(base.saturating_sub(3)),
                "{base}: freed after done_epoch"
            );
            assert!(p.warm(base.saturating_sub(257)), "{base}: MAX_FENCES ahead");
            // Freed before them: cold.
            assert!(!p.warm(base + 1), "{base}: one fence later");
            assert!(!p.warm(base + 1_000_000), "{base}: long ago");
        }
        p.set_backed(false);
        p.set_freed(12);
        assert!(!p.backed() && p.warm(12) && !p.warm(13));
    }
}

/// The rest of a page's state (see [`PageHot`]).
#[derive(Clone, Copy, Debug, Default)]
struct Page {
    handle: Option<PhysHandle>,
    /// Regions of no stream of their own (the slab's): the streams whose work used the page's freed
    /// bytes since it was last idle, a bit per entry of [`Inner::stream_fences`] ([`Region::decommit_for`]),
    /// [`UNKNOWN_STREAM`] for a free with no stream. 0: none.
    freed_on: u64,
    /// The address still maps a physical page that a move gave to another address (a *zombie*
    /// mapping); the page has no handle of its own meanwhile.
    zombie: Option<Zombie>,
}

/// An old mapping left at an address by a move (see [`Page::zombie`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Zombie {
    /// Work queued before the move may still use the mapping: it may be unmapped once a fence of this
    /// epoch or later has completed (on `stream`, when set: see [`StreamFences`]).
    epoch: u64,
    /// The stream whose fence covers the mapping's last users (several streams); `None`: the device-wide
    /// fences (one stream) or a synchronize.
    stream: Option<StreamId>,
    /// The physical page it maps (now owned by another address, cached, or mapped nowhere else).
    handle: PhysHandle,
}

struct RegionPages {
    name: &'static str,
    /// The stream all work on this region's blocks runs on, when its owner says so
    /// ([`Region::set_stream`]): with several streams, a page freed here and moved to another region is
    /// ordered after this stream's work by an event instead of a device synchronize.
    stream: Option<StreamId>,
    base: DevicePtr,
    pages: Vec<Page>,
    hot: Vec<PageHot>,
    /// Pages with at least one reference.
    in_use: u64,
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

/// The fences recorded on one stream (several streams: see [`PagePool::settle`]). Epochs come from the
/// pool's one counter ([`Inner::epoch`]), so a page freed at epoch `e` in a region of this stream is
/// idle once a fence of epoch `>= e` recorded here has completed: every fence records everything queued
/// on the stream before it, and the free was queued before.
#[derive(Debug)]
struct StreamFences {
    stream: StreamId,
    /// Recorded, not yet seen complete, oldest first.
    fences: VecDeque<(u64, EventHandle)>,
    /// Everything of this stream stamped with an epoch `< done` is complete.
    done: u64,
    /// `(t, e)`: stream `t` was made to wait on a fence of this stream of epoch `e` (the newest such):
    /// everything of this stream up to `e` is ordered before `t`'s later work, and needs no wait again.
    waited: Vec<(StreamId, u64)>,
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

/// Old mappings kept at least, with [`PagePoolConfig::keep_old_mappings`] (else as many as pages held).
const MIN_OLD_MAPPINGS: u64 = 64;

/// Fences kept outstanding at most, per queue; past this the newest is recorded again instead of a new
/// one (bounds the queue when the device lags far behind, with no host wait).
const MAX_FENCES: usize = 256;

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

    /// Say which stream all device work using this pool's pages runs on (`Some`), or that there may be
    /// several (`None`). With one stream, pages still in use by queued work move without a device
    /// synchronize (see the crate docs). Switching from `Some` to `None` must follow a device
    /// synchronize and [`PagePool::synchronized`], so that nothing moved by aliasing is still pending.
    pub fn set_fence_stream(&self, stream: Option<StreamId>) {
        // Fences recorded on an earlier stream still complete; they simply cover less from now on.
        self.lock().fence_stream = stream;
    }

    /// The stream regime, decided here for every tier over these pages: the first stream seen. Until a
    /// second appears, all work using the pages runs on it ([`set_fence_stream`](Self::set_fence_stream)):
    /// pages still in use move by aliasing, regions' frees need no stamps.
    pub fn one_stream(&self, stream: StreamId) {
        self.set_fence_stream(Some(stream));
    }

    /// A second stream appeared: from now on per-stream fences decide when memory freed on one stream
    /// may serve another. Everything freed under the one-stream regime is made idle by one device
    /// synchronize (a one-time cost, never in a warm pass), so that no page or slot freed then needs an
    /// ordering it was never stamped for. During a capture the synchronize is skipped (it would break
    /// the capture): pages freed so far then stay warm, and move only after the next synchronize.
    /// Returns whether the device was synchronized.
    pub fn several_streams(&self) -> bool {
        self.set_fence_stream(None);
        if self.capturing() {
            log::debug!("gen-vmm: a second stream during a capture; no synchronize");
            return false;
        }
        match self.device.synchronize() {
            Ok(()) => {
                self.synchronized();
                true
            }
            Err(e) => {
                log::error!("gen-vmm: synchronize on a second stream's first use: {e}");
                false
            }
        }
    }

    /// Make future work on `stream` wait for everything queued on `after` so far: a fence recorded on
    /// `after` (or the newest one, when nothing was freed since), waited on by `stream` on the device
    /// (`cuStreamWaitEvent`). No host wait. Nothing to do when they are the same stream.
    ///
    /// Returns the fence's epoch (`None`: the same stream, nothing waited for):
    /// [`order_after_fence`](Self::order_after_fence) with it orders another stream after the same work
    /// with no new fence.
    pub fn order_after(&self, stream: StreamId, after: StreamId) -> Result<Option<u64>, VmmError> {
        if stream == after {
            return Ok(None);
        }
        if self.capturing() {
            return Err(VmmError::Capturing(
                "ordering a stream after another's queued work",
            ));
        }
        let mut g = self.lock();
        let now = g.epoch;
        self.wait_fence(&mut g, stream, after, now).map(Some)
    }

    /// Make future work on `stream` wait for `after`'s work up to the fence of epoch `epoch` (one that
    /// [`order_after`](Self::order_after) returned): no device call when `stream` already waited for a
    /// fence of `after` that recent, or when that work is known complete.
    pub fn order_after_fence(
        &self,
        stream: StreamId,
        after: StreamId,
        epoch: u64,
    ) -> Result<(), VmmError> {
        if stream == after {
            return Ok(());
        }
        let mut g = self.lock();
        if Self::idle(&g, Some(after), epoch) {
            return Ok(());
        }
        if self.capturing() {
            return Err(VmmError::Capturing(
                "ordering a stream after another's queued work",
            ));
        }
        self.wait_fence(&mut g, stream, after, epoch).map(|_| ())
    }

    /// Make `target` wait on the device for a fence of `after` covering epoch `epoch` (the newest one
    /// recorded there if recent enough, else a new one) — unless it already waited for one that covers
    /// it. Returns the epoch of the fence `target` is ordered after.
    fn wait_fence(
        &self,
        g: &mut Inner,
        target: StreamId,
        after: StreamId,
        epoch: u64,
    ) -> Result<u64, VmmError> {
        let i = Self::stream_entry(g, after);
        if let Some(&(_, w)) = g.stream_fences[i]
            .waited
            .iter()
            .find(|&&(t, w)| t == target && w >= epoch)
        {
            return Ok(w);
        }
        let (ev, e) = self.fence_on(g, after, epoch)?;
        self.device.stream_wait_event(target, ev)?;
        g.stats.stream_waits += 1;
        let sf = &mut g.stream_fences[i];
        match sf.waited.iter_mut().find(|(t, _)| *t == target) {
            Some(w) => w.1 = w.1.max(e),
            None => sf.waited.push((target, e)),
        }
        Ok(e)
    }

    /// Synchronize the device (a host wait) and take everything freed so far as idle. For callers whose
    /// device-side ordering failed; nothing on a warm path calls it.
    pub fn synchronize(&self) -> Result<(), VmmError> {
        if self.capturing() {
            return Err(VmmError::Capturing("a device synchronize"));
        }
        let mut g = self.lock();
        let mut synced = false;
        self.sync_all(&mut g, &mut synced)?;
        if let Err(e) = self.reap_zombies(&mut g, false) {
            log::error!("gen-vmm: unmapping old mappings after a synchronize: {e}");
        }
        Ok(())
    }

    /// Tell the pool the device has just been synchronized: every page freed so far is idle, and old
    /// mappings left by moves can go (those past the number kept, with
    /// [`PagePoolConfig::keep_old_mappings`]).
    pub fn synchronized(&self) {
        let mut g = self.lock();
        self.all_complete(&mut g);
        if let Err(e) = self.reap_zombies(&mut g, false) {
            log::error!("gen-vmm: unmapping old mappings after a synchronize: {e}");
        }
    }

    /// Everything queued so far is complete (the caller synchronized the device).
    fn all_complete(&self, g: &mut Inner) {
        g.done_epoch = g.epoch + 1;
        g.epoch += 1;
        while let Some((_, ev)) = g.fences.pop_front() {
            g.spare_events.push(ev);
        }
        let Inner {
            stream_fences,
            spare_events,
            done_epoch,
            ..
        } = g;
        for sf in stream_fences.iter_mut() {
            spare_events.extend(sf.fences.drain(..).map(|(_, ev)| ev));
            sf.done = *done_epoch;
        }
    }

    /// Whether a page or mapping stamped with `epoch` is idle: a device-wide fence (one stream) or a
    /// synchronize has passed it, or a fence of `stream` has.
    fn idle(g: &Inner, stream: Option<StreamId>, epoch: u64) -> bool {
        epoch < g.done_epoch
            || stream.is_some_and(|s| {
                g.stream_fences
                    .iter()
                    .any(|sf| sf.stream == s && epoch < sf.done)
            })
    }

    /// The index of `stream`'s entry in the stream fences, made if new.
    fn stream_entry(g: &mut Inner, stream: StreamId) -> usize {
        match g.stream_fences.iter().position(|sf| sf.stream == stream) {
            Some(i) => i,
            None => {
                g.stream_fences.push(StreamFences {
                    stream,
                    fences: VecDeque::new(),
                    done: 0,
                    waited: Vec::new(),
                });
                g.stream_fences.len() - 1
            }
        }
    }

    /// The [`Page::freed_on`] bit of `stream` (its entry in the stream fences, made if new).
    fn stream_bit(g: &mut Inner, stream: StreamId) -> u64 {
        let i = Self::stream_entry(g, stream);
        if i < 63 {
            1 << i
        } else {
            UNKNOWN_STREAM
        }
    }

    /// The streams of a [`Page::freed_on`] mask, or `None` when it holds [`UNKNOWN_STREAM`].
    fn mask_streams(g: &Inner, mask: u64) -> Option<Vec<StreamId>> {
        if mask & UNKNOWN_STREAM != 0 {
            return None;
        }
        Some(
            (0..63)
                .filter(|i| mask & (1 << i) != 0)
                .filter_map(|i| g.stream_fences.get(i).map(|sf| sf.stream))
                .collect(),
        )
    }

    /// The one stream `mask` names, if it names exactly one known stream (no list built: this runs for
    /// every page a move settles).
    fn mask_stream(g: &Inner, mask: u64) -> Option<StreamId> {
        if mask & UNKNOWN_STREAM != 0 || mask.count_ones() != 1 {
            return None;
        }
        g.stream_fences
            .get(mask.trailing_zeros() as usize)
            .map(|sf| sf.stream)
    }

    /// A fence on `stream` covering everything queued there up to epoch `epoch`: the newest one recorded
    /// there if it is that recent, else a new one. Returns its event and epoch.
    fn fence_on(
        &self,
        g: &mut Inner,
        stream: StreamId,
        epoch: u64,
    ) -> Result<(EventHandle, u64), VmmError> {
        let i = Self::stream_entry(g, stream);
        if let Some(&(e, ev)) = g.stream_fences[i].fences.back() {
            if e >= epoch {
                return Ok((ev, e));
            }
        }
        self.bound_epoch_lag(g)?;
        if g.stream_fences[i].fences.len() >= MAX_FENCES {
            self.poll_fences(g);
        }
        self.push_fence(g, Some(i), stream)
    }

    /// Record a fence on `stream` into a queue (`None`: the device-wide fences; `Some(i)`: stream fences
    /// `i`) at the current epoch, which it then advances: a new event, or — the queue full — its newest
    /// recorded again, here, so that the queue stays bounded without a host wait (the device lags far
    /// behind, or the stream waits on work the host has yet to queue). Stream waits already queued on
    /// that event keep the point it had then (a wait takes an event's latest record at the time of the
    /// call), and its completion now says more (the later epoch), never less than is true: what it
    /// covered stays pending until this point is done. Returns the event and its epoch.
    fn push_fence(
        &self,
        g: &mut Inner,
        queue: Option<usize>,
        stream: StreamId,
    ) -> Result<(EventHandle, u64), VmmError> {
        let e = g.epoch;
        let q = match queue {
            None => &mut g.fences,
            Some(i) => &mut g.stream_fences[i].fences,
        };
        let ev = if q.len() >= MAX_FENCES {
            let back = q.back_mut().expect("a full queue");
            self.device.event_record(back.1, stream)?;
            back.0 = e;
            back.1
        } else {
            let ev = match g.spare_events.pop() {
                Some(ev) => ev,
                None => self.device.event_create()?,
            };
            if let Err(err) = self.device.event_record(ev, stream) {
                g.spare_events.push(ev);
                return Err(err.into());
            }
            q.push_back((e, ev));
            ev
        };
        g.epoch += 1;
        g.stats.fences += 1;
        Ok((ev, e))
    }

    /// The oldest fence has completed: everything freed up to its epoch is idle; its event is reused.
    fn retire_oldest_fence(g: &mut Inner) {
        if let Some((epoch, ev)) = g.fences.pop_front() {
            g.spare_events.push(ev);
            g.done_epoch = g.done_epoch.max(epoch + 1);
        }
    }

    /// Learn which fences have completed (one `event_query` per fence, oldest first, stopping at the first
    /// pending one).
    fn poll_fences(&self, g: &mut Inner) {
        while let Some(&(_, ev)) = g.fences.front() {
            match self.device.event_query(ev) {
                Ok(true) => Self::retire_oldest_fence(g),
                Ok(false) => break,
                Err(e) => {
                    // A fence that cannot be queried is treated as pending; a synchronize clears it.
                    log::debug!("gen-vmm: querying a fence: {e}");
                    break;
                }
            }
        }
        let Inner {
            stream_fences,
            spare_events,
            ..
        } = g;
        for sf in stream_fences.iter_mut() {
            while let Some(&(e, ev)) = sf.fences.front() {
                match self.device.event_query(ev) {
                    Ok(true) => {
                        sf.fences.pop_front();
                        sf.done = sf.done.max(e + 1);
                        spare_events.push(ev);
                    }
                    Ok(false) => break,
                    Err(err) => {
                        log::debug!("gen-vmm: querying a stream's fence: {err}");
                        break;
                    }
                }
            }
        }
    }

    /// Record a fence on the fence stream covering everything queued so far. Returns false when there is
    /// no fence stream or recording failed (the caller then synchronizes instead).
    fn record_fence(&self, g: &mut Inner) -> bool {
        let Some(stream) = g.fence_stream else {
            return false;
        };
        if let Err(e) = self.bound_epoch_lag(g) {
            log::debug!("gen-vmm: bounding the fences' lag: {e}");
            return false;
        }
        match self.push_fence(g, None, stream) {
            Ok(_) => true,
            Err(e) => {
                log::debug!("gen-vmm: recording a fence on stream {stream:#x}: {e}");
                false
            }
        }
    }

    /// Keep the epochs of work not known complete within [`MAX_EPOCH_LAG`] of the newest, the window in
    /// which [`PageHot`] compares them (its epochs are kept modulo 2^31): past it, synchronize. Fences
    /// are recorded again rather than waited for when their queues are full, so only this bounds the
    /// lag; it takes 2^29 fences recorded while none completes.
    fn bound_epoch_lag(&self, g: &mut Inner) -> Result<(), VmmError> {
        // Never during a capture (a synchronize would invalidate it): the bound waits for the next call.
        if g.epoch.saturating_sub(g.done_epoch) >= MAX_EPOCH_LAG && !self.capturing() {
            self.device.synchronize()?;
            g.stats.syncs += 1;
            self.all_complete(g);
        }
        Ok(())
    }

    /// Synchronize the device (once per commit: `synced`) and mark everything idle.
    fn sync_all(&self, g: &mut Inner, synced: &mut bool) -> Result<(), VmmError> {
        if !*synced {
            self.device.synchronize()?;
            g.stats.syncs += 1;
            *synced = true;
            self.all_complete(g);
        }
        Ok(())
    }

    /// Unmap the zombie mappings whose fence has completed, oldest first: all of them (`all`, or without
    /// [`PagePoolConfig::keep_old_mappings`]), else only those past the number kept.
    fn reap_zombies(&self, g: &mut Inner, all: bool) -> Result<(), VmmError> {
        let keep = if all || !self.cfg.keep_old_mappings {
            0
        } else {
            g.stats.pages_held.max(MIN_OLD_MAPPINGS)
        };
        let mut live = g.stats.zombies;
        let mut ready = Vec::new();
        let mut seen = std::collections::HashSet::new();
        while live > keep {
            let Some(&(epoch, rid, pidx)) = g.zombies.front() else {
                break;
            };
            let stream = g.regions[rid as usize]
                .as_ref()
                .and_then(|r| r.pages[pidx as usize].zombie)
                .filter(|z| z.epoch == epoch)
                .and_then(|z| z.stream);
            if !Self::idle(g, stream, epoch) {
                break;
            }
            g.zombies.pop_front();
            // An address can be queued twice with one epoch (a zombie taken back, then made again
            // before any fence): count it once.
            if zombie_epoch(&g.regions, rid, pidx) == Some(epoch) && seen.insert((rid, pidx)) {
                ready.push((rid, pidx));
                live -= 1;
            }
        }
        // Entries of moves since undone stay queued until they reach the front: drop them when they
        // outnumber the live ones (kept mappings may never reach the front).
        if g.zombies.len() as u64 > 2 * g.stats.zombies + 64 {
            let Inner {
                zombies, regions, ..
            } = g;
            zombies.retain(|&(epoch, rid, pidx)| zombie_epoch(regions, rid, pidx) == Some(epoch));
        }
        self.unmap_zombies(g, ready)
    }

    /// Unmap the zombie mappings at `pages` (region, page), whose work is known complete; a run of
    /// consecutive pages per call. On failure they stay zombies, queued again.
    fn unmap_zombies(&self, g: &mut Inner, mut pages: Vec<(u32, u32)>) -> Result<(), VmmError> {
        pages.sort_unstable();
        pages.dedup();
        let mut first_err = None;
        let mut i = 0;
        while i < pages.len() {
            let (rid, p0) = pages[i];
            let mut j = i + 1;
            while j < pages.len() && pages[j] == (rid, p0 + (j - i) as u32) {
                j += 1;
            }
            let r = g.regions[rid as usize].as_mut().expect("registered region");
            let va = r.base + p0 as u64 * self.page;
            match self.device.unmap(va, (j - i) as u64 * self.page) {
                Ok(()) => {
                    for &(_, q) in &pages[i..j] {
                        r.pages[q as usize].zombie = None;
                    }
                    g.stats.unmaps += (j - i) as u64;
                    g.stats.zombies -= (j - i) as u64;
                }
                Err(e) => {
                    // Left as zombies (mapped, no handle): a later synchronize path retries them.
                    for &(_, q) in &pages[i..j] {
                        let z = r.pages[q as usize].zombie.expect("a zombie");
                        g.zombies.push_back((z.epoch, rid, q));
                    }
                    first_err.get_or_insert(VmmError::from(e));
                }
            }
            i = j;
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Make `(rid, pidx)` a zombie mapping of `handle`, which moves elsewhere (or back). `warm`: work
    /// queued before now may still use it (a fence recorded at the end of the commit covers it).
    fn make_zombie(g: &mut Inner, rid: u32, pidx: u32, handle: PhysHandle, how: Settled) {
        let (epoch, stream) = match how {
            Settled::Warm => {
                g.unfenced = true;
                (g.epoch, None)
            }
            Settled::Fenced { stream, epoch } => (epoch, Some(stream)),
            // Idle already: any completed epoch (a page is cold only once some fence has completed).
            Settled::Idle => (g.done_epoch.saturating_sub(1), None),
        };
        let r = g.regions[rid as usize].as_mut().expect("registered region");
        let p = &mut r.pages[pidx as usize];
        debug_assert!(p.handle.is_none() && p.zombie.is_none());
        p.zombie = Some(Zombie {
            epoch,
            stream,
            handle,
        });
        g.zombies.push_back((epoch, rid, pidx));
        g.stats.zombies += 1;
    }

    /// Make the zombie mapping under `(rid, pidx)` go now: waits for its fence (recording one first if
    /// none covers it yet), or synchronizes the device, then unmaps it with every other idle zombie.
    fn clear_zombie(
        &self,
        g: &mut Inner,
        rid: u32,
        pidx: u32,
        synced: &mut bool,
    ) -> Result<(), VmmError> {
        let (epoch, stream) = {
            let r = g.regions[rid as usize].as_ref().expect("registered region");
            match r.pages[pidx as usize].zombie {
                Some(z) => (z.epoch, z.stream),
                None => return Ok(()),
            }
        };
        self.poll_fences(g);
        if let Some(s) = stream.filter(|_| !Self::idle(g, stream, epoch)) {
            // Several streams: wait for the fence of the mapping's stream that covers it.
            let covering = g
                .stream_fences
                .iter()
                .find(|sf| sf.stream == s)
                .and_then(|sf| sf.fences.iter().find(|&&(e, _)| e >= epoch).copied());
            let covering = match covering {
                Some((_, ev)) => Some(ev),
                // No fence of `s` covers it yet: record one (a synchronize if that fails).
                None => self.fence_on(g, s, epoch).ok().map(|(ev, _)| ev),
            };
            match covering {
                Some(ev) => {
                    self.device.event_synchronize(ev)?;
                    g.stats.syncs += 1;
                    self.poll_fences(g);
                }
                None => self.sync_all(g, synced)?,
            }
            if !Self::idle(g, stream, epoch) {
                self.sync_all(g, synced)?;
            }
        } else if epoch >= g.done_epoch && stream.is_none() {
            if epoch >= g.epoch && !self.record_fence(g) {
                self.sync_all(g, synced)?;
            }
            // Wait for the oldest fences up to the one covering this zombie.
            while epoch >= g.done_epoch {
                let Some(&(_, ev)) = g.fences.front() else {
                    self.sync_all(g, synced)?;
                    break;
                };
                self.device.event_synchronize(ev)?;
                Self::retire_oldest_fence(g);
                g.stats.syncs += 1;
            }
        }
        self.reap_zombies(g, false)?;
        if zombie_epoch(&g.regions, rid, pidx).is_some() {
            // Kept (keep_old_mappings) and idle now: this one goes.
            self.unmap_zombies(g, vec![(rid, pidx)])?;
        }
        let r = g.regions[rid as usize].as_ref().expect("registered region");
        debug_assert!(
            r.pages[pidx as usize].zombie.is_none(),
            "an idle zombie is reaped"
        );
        Ok(())
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
        let p = &mut r.pages[pidx as usize];
        let handle = p.handle.expect("free-mapped page has a handle");
        self.device.unmap(va, self.page)?;
        p.handle = None;
        r.hot[pidx as usize].set_backed(false);
        g.owners.remove(&handle.0);
        g.stats.unmaps += 1;
        Ok(handle)
    }

    /// Commit pages `first..=last` of region `rid`; returns the region's pages in use after it.
    /// `revivals`: with a `target`, order it after the streams that freed pages revived in place (a tier
    /// that orders the reuse of its bytes itself passes false).
    fn commit(
        &self,
        rid: u32,
        first: u64,
        last: u64,
        grow: bool,
        target: Option<StreamId>,
        revivals: bool,
    ) -> Result<(u64, bool), VmmError> {
        let mut g = self.inner.lock();
        g.commit_ordered = false;
        // The pages the last decommit left, committed again by the same region (a block freed and its
        // range cut again — a loop's temporary buffer, a KV cache grown into its old place): their
        // references never drop, so neither walk happens and the pages never visit the free set. The
        // state after is the decommit's and this commit's — the same references, in-use counts and
        // peaks (the pages were mapped and referenced throughout; a deferral needs a region of a stream
        // of its own, whose revivals need no ordering). Any other deferred decommit is applied first.
        if g.deferred == Some((rid, first, last)) {
            g.deferred = None;
            g.stats.deferrals_cancelled += 1;
            let in_use = g.regions[rid as usize]
                .as_ref()
                .expect("registered region")
                .in_use;
            return Ok((in_use, false));
        }
        self.apply_deferred(&mut g);
        // Several streams, a region of no stream of its own (the slab's), committed for `target`: a page
        // revived in place whose last block was freed on another stream still warm there is reused
        // only after `target` waits on that stream's fence.
        if let Some(t) = target.filter(|_| revivals && g.fence_stream.is_none()) {
            if g.regions[rid as usize]
                .as_ref()
                .is_some_and(|r| r.stream.is_none())
            {
                self.order_revivals(&mut g, rid, first, last, t)?;
            }
        }
        g.committing_for = target.or(g.regions[rid as usize].as_ref().and_then(|r| r.stream));
        // The common case of a training loop's steady state: every page is backed already (in use, or
        // free and still mapped right here), so the commit only takes references — one walk, no driver
        // call, nothing to plan.
        {
            let r = g.regions[rid as usize].as_ref().expect("registered region");
            // A fold, not `all`: no early exit, so it vectorizes (the warm case reads every page).
            if r.hot[first as usize..=last as usize]
                .iter()
                .fold(true, |ok, p| ok & p.backed())
            {
                let unbacked = take_backed(&mut g, rid, first, last);
                debug_assert!(unbacked.is_empty());
                let in_use = g.regions[rid as usize]
                    .as_ref()
                    .expect("registered region")
                    .in_use;
                return Ok((in_use, g.commit_ordered));
            }
        }
        if g.sleep.is_some() {
            return Err(VmmError::Asleep);
        }
        // Plan: pages that need a physical page mapped under them.
        let need = {
            let r = g.regions[rid as usize].as_ref().expect("registered region");
            r.hot[first as usize..=last as usize]
                .iter()
                .filter(|p| !p.backed())
                .count() as u64
        };
        let own_free_mapped = {
            let r = g.regions[rid as usize].as_ref().expect("registered region");
            r.hot[first as usize..=last as usize]
                .iter()
                .filter(|p| p.refs == 0 && p.backed())
                .count() as u64
        };
        let spare = g.free_handles.len() as u64 + (g.free_mapped.len() - own_free_mapped);
        let to_create = need.saturating_sub(spare);
        if to_create > 0 {
            if !grow {
                return Err(VmmError::WouldGrow { pages: to_create });
            }
            let held = g.stats.pages_held * self.page;
            if let Some(limit) = self.cfg.limit {
                if held + to_create * self.page > limit {
                    return Err(VmmError::OutOfMemory {
                        requested: to_create * self.page,
                        reserved: held,
                        limit: Some(limit),
                    });
                }
            }
        }
        // Steals unmap pages whose last block may have been freed with work still queued: the first
        // steal of this commit synchronizes the device once.
        let mut synced = false;
        // Pass 1: pages already backed (in use, or free-mapped right here) take a reference with no
        // driver call. Doing these first keeps pass 2 from stealing a page this very range will revive.
        let unbacked = take_backed(&mut g, rid, first, last);
        // Pass 2: back the rest. First learn which fences completed and drop the old mappings they free.
        let stay = self.pages_stay();
        if !unbacked.is_empty() && !stay && (!g.fences.is_empty() || !g.zombies.is_empty()) {
            self.poll_fences(&mut g);
            if let Err(e) = self.reap_zombies(&mut g, false) {
                log::error!("gen-vmm: unmapping old mappings: {e}");
            }
        }
        let steals_before = g.stats.steals;
        let t0 = (!unbacked.is_empty()).then(std::time::Instant::now);
        let res = self.back_pages(&mut g, rid, first, last, &unbacked, grow, &mut synced);
        if let Some(t0) = t0.filter(|_| g.stats.steals != steals_before) {
            g.stats.move_ns += t0.elapsed().as_nanos() as u64;
        }
        if self.capturing() {
            // A fence on the capturing stream would join the graph: the first commit after the
            // capture records it (the old mappings stay warm until then).
        } else if std::mem::take(&mut g.unfenced) && !self.record_fence(&mut g) {
            // No fence: the zombies wait for the next synchronize (release, region drop, or a commit that
            // needs one of their addresses).
            log::debug!("gen-vmm: no fence for the old mappings of this commit");
        }
        res.map(|()| {
            let in_use = g.regions[rid as usize]
                .as_ref()
                .expect("registered region")
                .in_use;
            (in_use, g.commit_ordered)
        })
    }

    /// See [`PagePool::commit`]: order `target` after the streams whose work used the bytes of pages
    /// `first..=last` of region `rid` freed since the page was last idle (a fence of each, waited on by
    /// `target`). A page freed with no stream known synchronizes the device.
    fn order_revivals(
        &self,
        g: &mut Inner,
        rid: u32,
        first: u64,
        last: u64,
        target: StreamId,
    ) -> Result<(), VmmError> {
        let mut after: Vec<(StreamId, u64)> = Vec::new();
        let mut unknown = false;
        for q in first..=last {
            let (hot, mask) = {
                let r = g.regions[rid as usize].as_ref().expect("registered region");
                (r.hot[q as usize], r.pages[q as usize].freed_on)
            };
            if mask == 0 {
                continue;
            }
            if !hot.warm(g.done_epoch) {
                // Idle since (a synchronize or the one-stream fences passed it): forget the streams.
                g.regions[rid as usize]
                    .as_mut()
                    .expect("registered region")
                    .pages[q as usize]
                    .freed_on = 0;
                continue;
            }
            let e = hot.freed_epoch(g.epoch);
            match Self::mask_streams(g, mask) {
                None => unknown = true,
                Some(streams) => {
                    for s in streams {
                        match after.iter_mut().find(|(x, _)| *x == s) {
                            Some((_, m)) => *m = (*m).max(e),
                            None => after.push((s, e)),
                        }
                    }
                }
            }
        }
        let capturing = self.capturing();
        if unknown {
            if capturing {
                return Err(VmmError::Capturing("a synchronize before reusing a page"));
            }
            let mut synced = false;
            self.sync_all(g, &mut synced)?;
            return Ok(());
        }
        for (s, e) in after {
            if Self::idle(g, Some(s), e) {
                continue;
            }
            // Still in use by queued work of `s`: the range is `target`'s alone from now on.
            g.commit_ordered = true;
            if s == target {
                continue;
            }
            if capturing {
                // The wait (and a fence on `s`) would join the graph.
                return Err(VmmError::Capturing(
                    "ordering a stream after another's queued work",
                ));
            }
            self.wait_fence(g, target, s, e)?;
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn back_pages(
        &self,
        g: &mut Inner,
        rid: u32,
        first: u64,
        last: u64,
        unbacked: &[u32],
        grow: bool,
        synced: &mut bool,
    ) -> Result<(), VmmError> {
        // Take a physical page for each unbacked page first (counted in use as it is taken, so the
        // headroom rule sees the commit grow), then map them in runs of consecutive pages: one access
        // call per run instead of one per page. A page taken back through its old mapping here needs
        // no map: it is committed at once.
        // Pages to map (`got_at[k]` gets `got[k]`), in `unbacked` order.
        let mut got_at: Vec<u32> = Vec::with_capacity(unbacked.len());
        let mut got: Vec<PhysHandle> = Vec::with_capacity(unbacked.len());
        let mut returned: Vec<u32> = Vec::new();
        let mut fail = None;
        for &pidx in unbacked {
            match self.take_page(g, rid, pidx, grow, synced) {
                Ok(Taken::Mapped(h)) => {
                    let r = g.regions[rid as usize].as_mut().expect("registered region");
                    r.pages[pidx as usize].handle = Some(h);
                    // Its history went with its page (settled before it came here).
                    r.pages[pidx as usize].freed_on = 0;
                    r.hot[pidx as usize].refs = 1;
                    r.hot[pidx as usize].set_backed(true);
                    r.in_use += 1;
                    g.owners.insert(h.0, (rid, pidx));
                    returned.push(pidx);
                }
                Ok(Taken::Unmapped(h)) => {
                    got_at.push(pidx);
                    got.push(h);
                }
                Err(e) => {
                    fail = Some(e);
                    break;
                }
            }
            if fail.is_none() {
                g.stats.pages_in_use += 1;
                g.stats.pages_in_use_peak = g.stats.pages_in_use_peak.max(g.stats.pages_in_use);
            }
        }
        let mut mapped = 0;
        if fail.is_none() {
            let base = g.regions[rid as usize]
                .as_ref()
                .expect("registered region")
                .base;
            let mut i = 0;
            while i < got.len() {
                let mut j = i + 1;
                while j < got.len() && got_at[j] == got_at[j - 1] + 1 {
                    j += 1;
                }
                let va = base + got_at[i] as u64 * self.page;
                if let Err(e) = self.device.map_run(va, self.page, &got[i..j]) {
                    fail = Some(e.into());
                    break;
                }
                let r = g.regions[rid as usize].as_mut().expect("registered region");
                for (&q, &h) in got_at[i..j].iter().zip(&got[i..j]) {
                    r.pages[q as usize].handle = Some(h);
                    r.pages[q as usize].freed_on = 0;
                    r.hot[q as usize].refs = 1;
                    r.hot[q as usize].set_backed(true);
                }
                r.in_use += (j - i) as u64;
                for (&q, &h) in got_at[i..j].iter().zip(&got[i..j]) {
                    g.owners.insert(h.0, (rid, q));
                }
                g.stats.maps += (j - i) as u64;
                mapped = j;
                i = j;
            }
        }
        if let Some(e) = fail {
            // Pages taken but not mapped: keep their handles cached rather than lose them.
            g.stats.pages_in_use -= (got.len() - mapped) as u64;
            g.free_handles.extend_from_slice(&got[mapped..]);
            // Roll back: every page of the range holds one reference from us except the unbacked pages
            // that were neither taken back nor mapped.
            let committed = |q: u32| {
                !unbacked.contains(&q) || returned.contains(&q) || got_at[..mapped].contains(&q)
            };
            for q in first..=last {
                if committed(q as u32) {
                    self.decommit_locked(g, rid, q, q);
                }
            }
            return Err(e);
        }
        Ok(())
    }

    /// A physical page for the unbacked page `pidx` of region `rid` (not mapped yet): a cached handle, a
    /// new one within the headroom, or one moved from another address.
    fn take_page(
        &self,
        g: &mut Inner,
        rid: u32,
        pidx: u32,
        grow: bool,
        synced: &mut bool,
    ) -> Result<Taken, VmmError> {
        debug_assert!(g.regions[rid as usize]
            .as_ref()
            .expect("registered region")
            .pages[pidx as usize]
            .handle
            .is_none());
        // An old mapping left here by a move: take its page back if it is free, else it must go before
        // a page can be mapped.
        if let Some(h) = self.take_back(g, rid, pidx, synced)? {
            return Ok(Taken::Mapped(h));
        }
        let stay = self.pages_stay();
        if stay && zombie_epoch(&g.regions, rid, pidx).is_some() {
            // Its page is in use elsewhere: the old mapping would have to be unmapped first.
            return Err(VmmError::Capturing("unmapping an old mapping"));
        }
        self.clear_zombie(g, rid, pidx, synced)?;
        // Within the headroom (and the limit), a new page is cheaper than moving one.
        let headroom = (g.stats.pages_in_use_peak as f64 * (1.0 + self.slack())).ceil() as u64;
        let under_limit = self
            .cfg
            .limit
            .is_none_or(|l| (g.stats.pages_held + 1) * self.page <= l);
        let create_first = grow && g.stats.pages_held < headroom && under_limit;
        Ok(Taken::Unmapped(if let Some(h) = g.free_handles.pop() {
            h
        } else if stay {
            // No page leaves its address now (a capture, or a graph's pool): a new one.
            if !grow {
                return Err(VmmError::WouldGrow { pages: 1 });
            }
            self.create(g, false, rid, pidx, synced)?
        } else if !create_first {
            match self.steal(g, rid, pidx, synced)? {
                Some(h) => h,
                None => self.create(g, false, rid, pidx, synced)?,
            }
        } else {
            self.create(g, true, rid, pidx, synced)?
        }))
    }

    /// With an old mapping of page `h` left at `(rid, pidx)` by a move: when `h` is free where it is now
    /// (or cached unmapped), take it back here with no driver call — its address there becomes the old
    /// mapping. `None`: no old mapping here, or its page is in use.
    fn take_back(
        &self,
        g: &mut Inner,
        rid: u32,
        pidx: u32,
        synced: &mut bool,
    ) -> Result<Option<PhysHandle>, VmmError> {
        let Some(z) = g.regions[rid as usize]
            .as_ref()
            .expect("registered region")
            .pages[pidx as usize]
            .zombie
        else {
            return Ok(None);
        };
        let h = z.handle;
        if let Some(&(orid, opidx)) = g.owners.get(&h.0) {
            let hot = g.regions[orid as usize]
                .as_ref()
                .expect("registered region")
                .hot[opidx as usize];
            if hot.refs > 0 {
                return Ok(None);
            }
            debug_assert!(hot.backed());
            if self.keep_mappings.load(Relaxed) {
                // Its address there would keep an old mapping, retired (unmapped) later: never in a
                // pool that keeps its mappings.
                return Ok(None);
            }
            if self.capturing() && hot.warm(g.done_epoch) && g.fence_stream.is_none() {
                // Several streams: a warm page moves after the committing stream waits on its last
                // users' fence (or a synchronize), which the capture forbids.
                return Ok(None);
            }
            let target = g.committing_for;
            let how = self.settle(g, orid, opidx, synced, target)?;
            g.free_mapped.remove(&(opidx, orid));
            let left = Self::leave_mapped(g, orid, opidx, how);
            debug_assert_eq!(left, h);
        } else if let Some(i) = g.free_handles.iter().position(|&c| c == h) {
            // Unmapped from its last owner and cached: the old mapping here is its only one.
            g.free_handles.swap_remove(i);
        } else {
            return Ok(None);
        }
        let r = g.regions[rid as usize].as_mut().expect("registered region");
        r.pages[pidx as usize].zombie = None;
        g.stats.zombies -= 1;
        g.stats.returns += 1;
        Ok(Some(h))
    }

    /// How the free page `(rid, pidx)`, about to serve another address for work on `target`, stands with
    /// the work that last used it: idle; warm on the one stream (stream order keeps the two apart); or,
    /// with several streams, warm in a region of a known stream — then `target` is made to wait (on the
    /// device, `cuStreamWaitEvent`) for a fence of that stream covering the page's last free, and the
    /// move needs no host wait. A warm page of a region of no known stream, or for no known target,
    /// synchronizes the device first (once per commit) and is then idle.
    fn settle(
        &self,
        g: &mut Inner,
        rid: u32,
        pidx: u32,
        synced: &mut bool,
        target: Option<StreamId>,
    ) -> Result<Settled, VmmError> {
        let (hot, stream, mask) = {
            let r = g.regions[rid as usize].as_ref().expect("registered region");
            (
                r.hot[pidx as usize],
                r.stream,
                r.pages[pidx as usize].freed_on,
            )
        };
        // A region of no stream: the one stream that used the page's bytes, when the mask names one.
        let stream = stream.or_else(|| Self::mask_stream(g, mask));
        if !hot.warm(g.done_epoch) {
            return Ok(Settled::Idle);
        }
        if g.fence_stream.is_some() {
            return Ok(Settled::Warm);
        }
        let freed = hot.freed_epoch(g.epoch);
        if Self::idle(g, stream, freed) {
            return Ok(Settled::Idle);
        }
        // A page of a shared region whose bytes several streams freed: the streams its mask names.
        let freers = match (stream, target) {
            (None, Some(_)) if mask != 0 => Self::mask_streams(g, mask),
            _ => None,
        };
        match (stream, target, freers) {
            (Some(s), Some(t), _) => {
                g.commit_ordered = true;
                let epoch = if t == s {
                    self.fence_on(g, s, freed)?.1
                } else {
                    self.wait_fence(g, t, s, freed)?
                };
                Ok(Settled::Fenced { stream: s, epoch })
            }
            (None, Some(t), Some(streams)) => {
                // `t` waits for each, and a fence on `t` after those waits covers them all (for the old
                // mapping).
                g.commit_ordered = true;
                for s in streams {
                    if s != t && !Self::idle(g, Some(s), freed) {
                        self.wait_fence(g, t, s, freed)?;
                    }
                }
                let now = g.epoch;
                let (_, epoch) = self.fence_on(g, t, now)?;
                Ok(Settled::Fenced { stream: t, epoch })
            }
            _ => {
                self.sync_all(g, synced)?;
                Ok(Settled::Idle)
            }
        }
    }

    /// Take the physical page of the free page `(rid, pidx)` (out of the free set already) for another
    /// address without unmapping it: the address keeps it as an old mapping. Returns the page.
    fn leave_mapped(g: &mut Inner, rid: u32, pidx: u32, how: Settled) -> PhysHandle {
        let r = g.regions[rid as usize].as_mut().expect("registered region");
        let h = r.pages[pidx as usize]
            .handle
            .take()
            .expect("free-mapped page has a handle");
        r.hot[pidx as usize].set_backed(false);
        g.owners.remove(&h.0);
        Self::make_zombie(g, rid, pidx, h, how);
        h
    }

    /// Unmap the free page with the highest index (never `(rid, pidx)`) and return its handle; `None`
    /// when no page is free. Synchronizes the device once per commit first.
    fn steal(
        &self,
        g: &mut Inner,
        rid: u32,
        pidx: u32,
        synced: &mut bool,
    ) -> Result<Option<PhysHandle>, VmmError> {
        let Some((orid, opidx)) = pop_free_mapped_excluding(g, rid, pidx) else {
            return Ok(None);
        };
        let target = g.committing_for;
        let how = match self.settle(g, orid, opidx, synced, target) {
            Ok(how) => how,
            Err(e) => {
                g.free_mapped.insert((opidx, orid));
                return Err(e);
            }
        };
        let warm = how != Settled::Idle;
        if warm || self.cfg.keep_old_mappings {
            // Warm: alias. The physical page serves the new address from now on (one stream: stream
            // order puts the new work after the old; several: the new stream waits on a fence of the
            // old one); the old mapping stays until a fence covering it completes — or, keeping old
            // mappings, until it is needed (a move back through it costs no driver call).
            let h = Self::leave_mapped(g, orid, opidx, how);
            if warm {
                g.stats.aliases += 1;
            }
            g.stats.steals += 1;
            return Ok(Some(h));
        }
        match self.unmap_page(g, orid, opidx) {
            Ok(h) => {
                g.stats.steals += 1;
                Ok(Some(h))
            }
            Err(e) => {
                // Still mapped and unused: put it back.
                g.free_mapped.insert((opidx, orid));
                Err(e)
            }
        }
    }

    /// A new physical page. When the device is out of memory and `then_steal`, fall back to stealing.
    fn create(
        &self,
        g: &mut Inner,
        then_steal: bool,
        rid: u32,
        pidx: u32,
        synced: &mut bool,
    ) -> Result<PhysHandle, VmmError> {
        match self.device.phys_create(self.page) {
            Ok(h) => {
                g.stats.creates += 1;
                g.stats.pages_held += 1;
                g.stats.pages_peak = g.stats.pages_peak.max(g.stats.pages_held);
                Ok(h)
            }
            Err(e) if e.is_oom() => {
                if then_steal {
                    if let Some(h) = self.steal(g, rid, pidx, synced)? {
                        return Ok(h);
                    }
                }
                Err(VmmError::OutOfMemory {
                    requested: self.page,
                    reserved: g.stats.pages_held * self.page,
                    limit: self.cfg.limit,
                })
            }
            Err(e) => Err(e.into()),
        }
    }

    fn decommit_locked(&self, g: &mut Inner, rid: u32, first: u64, last: u64) {
        self.decommit_locked_on(g, rid, first, last, None);
    }

    /// [`decommit_locked`](Self::decommit_locked), stamping the pages that become free with the stream
    /// their last users ran on (`Some`), for regions of no stream of their own.
    fn decommit_locked_on(
        &self,
        g: &mut Inner,
        rid: u32,
        first: u64,
        last: u64,
        freed_on: Option<StreamId>,
    ) {
        let bit = freed_on.map(|s| Self::stream_bit(g, s));
        // Decided once per call, not per page (a capture check is a call through the device).
        let lazy = self.leaves_pages_mapped();
        let mut eager: Vec<u32> = Vec::new();
        {
            let Inner {
                regions,
                free_mapped,
                stats,
                sleep,
                epoch,
                ..
            } = &mut *g;
            let epoch = *epoch;
            let r = regions[rid as usize].as_mut().expect("registered region");
            let own_stream = r.stream.is_some();
            // Pages left free and mapped join the free set in runs (one bit operation per 64 pages); the
            // in-use counters move once, after the walk.
            let mut run: Option<(u32, u32)> = None;
            let mut released = 0u64;
            let mut walk = first..=last;
            while let Some(pidx) = walk.next() {
                // The pages strictly inside the range at once, when each is this range's alone and
                // mapped (an extent block's inner pages): a check and a fill the compiler vectorizes,
                // one run for the free set, instead of the general walk's branches page by page
                // (simulator: gpt2_train_fixed's blocks span ~20 pages). Anything else — a page another
                // block shares, one asleep — takes the general walk below.
                if pidx == first + 1 && last > first + 1 && lazy {
                    let (a, b) = (pidx as usize, last as usize - 1);
                    if release_sole(&mut r.hot[a..=b], epoch) {
                        let stamp = left_free_stamp(bit, own_stream);
                        if stamp != 0 {
                            for p in &mut r.pages[a..=b] {
                                p.freed_on |= stamp;
                            }
                        }
                        extend_run_by(&mut run, a as u32, b as u32, |x, y| {
                            free_mapped.insert_run(rid, x, y);
                        });
                        released += (b - a + 1) as u64;
                        walk = last..=last;
                        continue;
                    }
                }
                let i = pidx as usize;
                if let Some(bit) = bit {
                    // The bytes freed here were used on that stream: whoever reuses them next waits for it.
                    r.pages[i].freed_on |= bit;
                    r.hot[i].set_freed(epoch);
                }
                let p = &mut r.hot[i];
                if p.refs == 0 {
                    debug_assert!(
                        false,
                        "decommit of an uncommitted page in region '{}'",
                        r.name
                    );
                    log::error!(
                        "gen-vmm: decommit of an uncommitted page {pidx} in region '{}'",
                        r.name
                    );
                    continue;
                }
                p.refs -= 1;
                if p.refs != 0 {
                    continue;
                }
                p.set_freed(epoch);
                let backed = p.backed();
                r.pages[i].freed_on |= left_free_stamp(bit, own_stream);
                released += 1;
                if !backed {
                    // Asleep (a referenced page is backed otherwise): nothing is mapped to free; its
                    // offloaded contents are not needed any more.
                    if let Some(z) = sleep.as_mut() {
                        z.forget(rid, pidx as u32);
                    }
                    continue;
                }
                if lazy {
                    extend_run(&mut run, pidx as u32, |a, b| {
                        free_mapped.insert_run(rid, a, b);
                    });
                } else {
                    eager.push(pidx as u32);
                }
            }
            if let Some((a, b)) = run {
                free_mapped.insert_run(rid, a, b);
            }
            r.in_use -= released;
            stats.pages_in_use -= released;
        }
        if eager.is_empty() {
            return;
        }
        // Unmapping needs the pages' earlier users to be done: one synchronize for all of them.
        let synced = self.device.synchronize().map_err(VmmError::from);
        if synced.is_ok() {
            self.all_complete(g);
        }
        for pidx in eager {
            let res = match &synced {
                Ok(()) => self.unmap_page(g, rid, pidx),
                Err(e) => Err(e.clone()),
            };
            match res {
                Ok(h) => g.free_handles.push(h),
                Err(e) => {
                    log::error!("gen-vmm: eager unmap failed: {e}");
                    g.free_mapped.insert((pidx, rid));
                }
            }
        }
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

/// The [`Page::freed_on`] bits a page a decommit leaves free gets: the freeing stream's bit (whoever
/// reuses it next waits for that stream), else — in a region with no stream of its own — the unknown
/// stream's (its next reuse elsewhere synchronizes), else none (a region of one stream: its stream is
/// the answer). The inner-page step and the page-by-page walk of `decommit_locked_on` both apply it.
#[inline]
fn left_free_stamp(bit: Option<u64>, own_stream: bool) -> u64 {
    match bit {
        Some(bit) => bit,
        None if !own_stream => UNKNOWN_STREAM,
        None => 0,
    }
}

/// Take a reference on every backed page of region `rid`'s `first..=last` (reviving free-mapped ones in
/// place, no driver call); returns the pages with no physical page under them, for the caller to back.
fn take_backed(g: &mut Inner, rid: u32, first: u64, last: u64) -> Vec<u32> {
    let mut unbacked = Vec::new();
    let Inner {
        regions,
        free_mapped,
        stats,
        ..
    } = g;
    let r = regions[rid as usize].as_mut().expect("registered region");
    // Revived pages leave the free set in runs (one bit operation per 64 pages); the counters move once,
    // after the walk (gpt2's extent blocks span ~20 pages: simulator gpt2_train_fixed ~5 % faster).
    let mut run: Option<(u32, u32)> = None;
    let mut revived = 0u64;
    let mut walk = first as u32..=last as u32;
    while let Some(pidx) = walk.next() {
        // The pages strictly inside the range at once when each is free and mapped here (an extent
        // block's inner pages revived in place): as in `decommit_locked_on`.
        if u64::from(pidx) == first + 1 && last > first + 1 {
            let (a, b) = (pidx as usize, last as usize - 1);
            if revive_sole(&mut r.hot[a..=b]) {
                extend_run_by(&mut run, a as u32, b as u32, |x, y| {
                    free_mapped.remove_run(rid, x, y);
                });
                revived += (b - a + 1) as u64;
                walk = last as u32..=last as u32;
                continue;
            }
        }
        let p = &mut r.hot[pidx as usize];
        if p.refs > 0 {
            p.refs += 1;
        } else if p.backed() {
            p.refs = 1;
            revived += 1;
            extend_run(&mut run, pidx, |a, b| {
                free_mapped.remove_run(rid, a, b);
            });
        } else {
            unbacked.push(pidx);
        }
    }
    if let Some((a, b)) = run {
        free_mapped.remove_run(rid, a, b);
    }
    r.in_use += revived;
    stats.revivals += revived;
    stats.pages_in_use += revived;
    stats.pages_in_use_peak = stats.pages_in_use_peak.max(stats.pages_in_use);
    unbacked
}

/// Add page `p` to the run of consecutive pages being collected, handing a run it does not continue to
/// `flush(first, last)` first. The caller flushes what is left at the end.
#[inline]
fn extend_run(run: &mut Option<(u32, u32)>, p: u32, flush: impl FnMut(u32, u32)) {
    extend_run_by(run, p, p, flush);
}

/// [`extend_run`] with the pages `p..=q`.
#[inline]
fn extend_run_by(run: &mut Option<(u32, u32)>, p: u32, q: u32, mut flush: impl FnMut(u32, u32)) {
    *run = match *run {
        Some((a, b)) if b + 1 == p => Some((a, q)),
        Some((a, b)) => {
            flush(a, b);
            Some((p, q))
        }
        None => Some((p, q)),
    };
}

/// If every page of `hot` is mapped and referenced once, drop that reference and stamp each as freed at
/// `epoch` (as the general walk would, page by page) and return `true`; otherwise change nothing and
/// return `false`. Branch-free over the pages, so both loops vectorize.
#[inline]
fn release_sole(hot: &mut [PageHot], epoch: u64) -> bool {
    if !hot
        .iter()
        .fold(true, |ok, p| ok & (p.refs == 1) & p.backed())
    {
        return false;
    }
    let freed = PageHot {
        refs: 0,
        word: 1 | ((epoch as u32) << 1),
    };
    hot.fill(freed);
    true
}

/// If every page of `hot` is mapped and unreferenced, reference each once and return `true`; otherwise
/// change nothing and return `false` (see [`release_sole`]).
#[inline]
fn revive_sole(hot: &mut [PageHot]) -> bool {
    if !hot
        .iter()
        .fold(true, |ok, p| ok & (p.refs == 0) & p.backed())
    {
        return false;
    }
    for p in hot {
        p.refs = 1;
    }
    true
}

/// The epoch of the zombie mapping at `(rid, pidx)`, if there is one (`None` too for a dropped region).
fn zombie_epoch(regions: &[Option<RegionPages>], rid: u32, pidx: u32) -> Option<u64> {
    regions
        .get(rid as usize)
        .and_then(Option::as_ref)
        .and_then(|r| r.pages[pidx as usize].zombie)
        .map(|z| z.epoch)
}

/// Take the free-mapped page with the highest page index (of any region).
fn pop_free_mapped(g: &mut Inner) -> Option<(u32, u32)> {
    g.free_mapped.pop_last().map(|(pidx, rid)| (rid, pidx))
}

/// Take a free-mapped page for a steal; never `(rid, pidx)` itself (an unbacked page is never free).
fn pop_free_mapped_excluding(g: &mut Inner, rid: u32, pidx: u32) -> Option<(u32, u32)> {
    let (orid, opidx) = pop_free_mapped(g)?;
    debug_assert!(
        !(orid == rid && opidx == pidx),
        "an unbacked page is never free-mapped"
    );
    Some((orid, opidx))
}

/// A physical page found for an unbacked page (see `PagePool::take_page`).
enum Taken {
    /// Already mapped at the page's address (taken back through an old mapping).
    Mapped(PhysHandle),
    /// To be mapped there.
    Unmapped(PhysHandle),
}

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
        match self.page_range(offset, len) {
            Ok((first, last)) => {
                let mut g = self.pool.lock();
                self.pool
                    .decommit_locked_on(&mut g, self.id, first, last, Some(stream));
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

    /// [`unbacked_in`](Self::unbacked_in) of each of `ranges`, under one lock: placement policies compare
    /// candidates with it.
    pub fn unbacked_pages(&self, ranges: &[(u64, u64)]) -> Vec<u64> {
        let g = self.pool.lock();
        ranges
            .iter()
            .map(|&(offset, len)| self.unbacked_locked(&g, offset, len))
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

#[cfg(test)]
mod epoch_lag_tests {
    use super::*;
    use gen_device::sim::SimDevice;

    fn pool() -> (Arc<SimDevice>, Arc<PagePool>) {
        let dev = Arc::new(SimDevice::new());
        let pages =
            PagePool::new(dev.clone() as Arc<dyn Device>, PagePoolConfig::default()).unwrap();
        (dev, pages)
    }

    /// Fences recorded again instead of waited for leave only the lag bound to keep the epochs of work
    /// not known complete inside the window pages compare them in: at `MAX_EPOCH_LAG` a fence first
    /// synchronizes (everything is then complete), below it not; during a capture never.
    #[test]
    fn the_epoch_lag_is_bounded_by_one_synchronize_and_never_during_a_capture() {
        let (dev, pages) = pool();
        let (s, t) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
        // Just below the bound: an ordering records a fence, no synchronize.
        {
            let mut g = pages.lock();
            g.epoch = g.done_epoch + MAX_EPOCH_LAG - 1;
        }
        let syncs = dev.call_counts().device_syncs;
        pages.order_after(s, t).unwrap();
        assert_eq!(dev.call_counts().device_syncs, syncs);
        // At the bound: one synchronize, and every earlier epoch is then complete.
        {
            let mut g = pages.lock();
            g.epoch = g.done_epoch + MAX_EPOCH_LAG;
        }
        pages.order_after(s, t).unwrap();
        assert_eq!(dev.call_counts().device_syncs, syncs + 1);
        {
            let g = pages.lock();
            assert!(
                g.epoch - g.done_epoch < 4,
                "all complete after the synchronize"
            );
        }
        // During a capture the bound waits: the device-wide fence records without a synchronize.
        {
            let mut g = pages.lock();
            g.epoch = g.done_epoch + MAX_EPOCH_LAG;
        }
        dev.captures().begin();
        {
            let mut g = pages.lock();
            g.fence_stream = Some(s);
            assert!(pages.record_fence(&mut g), "a fence, no synchronize");
        }
        assert!(dev.captures().end());
        assert_eq!(dev.call_counts().device_syncs, syncs + 1);
    }
}
