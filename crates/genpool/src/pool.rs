//! The engine: classify, route, serve from a tier's cache or the tier, and keep the books.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering, Ordering::Relaxed};
use std::sync::Arc;

use gen_buddy::{Buddy, BuddyConfig};
use gen_classifier::{Classifier, ClassifierConfig, Features, Lifetime, Stamp};
use gen_device::{Device, StreamId};
use gen_plan::{PlanConfig, PlanServer, PlanServerConfig, Ticket};
use gen_slab::{Slab, SlabConfig};
use gen_stream::{DriverPool, DriverPoolConfig};
use gen_vmm::{Handoff, PagePool, PagePoolConfig, TierError, VmmError};
use parking_lot::Mutex;

use crate::arenas::{Extents, ExtentsConfig, NO_STREAM};
use crate::books::LiveBooks;
use crate::busykeep::BusyKeep;
use crate::config::{Config, LongTier, MidTier, Routing};
use crate::error::{FreeFault, GenpoolError, OomReport, Result, TierUsage};
use crate::headroom::Headroom;
use crate::mag::Magazines;
use crate::meta::{Meta, MetaTable, Removed, NO_THREAD};
use crate::slabbook::{SlabBook, SlabWord};
use crate::stats::{PlanSummary, PoolStats, TierStats};
use crate::tcache::{Kept, ThreadCaches};
pub use crate::tier::Tier;
use crate::tier::{tier_err, Request, TierAlloc};

mod place;

/// Every block is aligned to (and sized in multiples of) this many bytes, as PyTorch's allocator does.
pub const ALIGN: u64 = 512;

/// A caller's statement about an allocation's lifetime, or its call site.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Hint {
    /// An explicit lifetime: overrides the classifier's prediction (which is still scored).
    pub lifetime: Option<Lifetime>,
    /// A call-site tag (e.g. a hash of the allocating frames), used by the classifier as a feature.
    pub site: Option<u64>,
}

impl Hint {
    /// No hint.
    pub const NONE: Hint = Hint {
        lifetime: None,
        site: None,
    };
}

/// A block handed out by [`Pool::alloc`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    /// Device address, 512-byte aligned.
    pub ptr: u64,
    /// Usable bytes (the request rounded up to 512).
    pub size: u64,
    /// The tier that serves it.
    pub tier: Tier,
}

/// A live block as the engine records it ([`Pool::live_detailed`], [`Pool::free_owned`]).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct LiveBlock {
    /// Device address.
    pub ptr: u64,
    /// Bytes it spans (the request rounded up to [`ALIGN`]).
    pub size: u64,
    /// Bytes asked for.
    pub requested: u64,
    /// The stream it was allocated for.
    pub stream: StreamId,
    /// The tier that serves it ([`LiveBlock::tier`]), as a whole word: the block is returned through
    /// a `Result` on PyTorch's free path, and a one-byte field's padding was copied with loads that
    /// straddled the stores of its neighbours — a failed store-to-load forward (~12 cycles) at each
    /// copy (`benches/host/abi_replay.c`, docs/ARCHITECTURE.md "What PyTorch's path adds").
    tier: u64,
}

impl std::fmt::Debug for LiveBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveBlock")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("size", &self.size)
            .field("requested", &self.requested)
            .field("tier", &self.tier())
            .field("stream", &self.stream)
            .finish()
    }
}

impl LiveBlock {
    /// A block at `ptr` of `size` bytes (`requested` asked for) from `tier`, allocated for `stream`.
    pub fn new(ptr: u64, size: u64, requested: u64, tier: Tier, stream: StreamId) -> Self {
        LiveBlock {
            ptr,
            size,
            requested,
            stream,
            tier: tier as u64,
        }
    }

    /// The tier that serves it.
    pub fn tier(&self) -> Tier {
        Tier::ALL[self.tier as usize]
    }

    fn of(ptr: u64, m: &Meta) -> Self {
        Self::new(ptr, m.size, m.size - u64::from(m.slack), m.tier, m.stream)
    }
}

/// One device's generational pool. `Send + Sync`: allocate and free from any thread.
///
/// The engine routes: it classifies each allocation, picks a tier (`TierAlloc`: the slab, the extent
/// arenas of `arenas.rs`, the driver pool, the buddy) or a planned slot of the plan server
/// (`gen_plan::PlanServer`), climbs the release-and-retry ladder when the tier cannot serve, and keeps the
/// books. Each tier, the plan server and the headroom governor (`headroom.rs`) own their state.
///
/// `repr(C)`, in this order: the per-call words (`Hot`), the classifier (whose own per-call fields lead
/// it), then one cache line of the references every call follows (page pool, extent arenas, metadata
/// table, plan server), then the tiers. Rust's default order (by alignment) put these references on
/// three or four lines of a ~5.7 KB struct.
#[repr(C)]
pub struct Pool {
    /// The words every call reads or writes outside its tier, in two cache lines.
    hot: Hot,
    classifier: Classifier,
    // One line (64 bytes): what the hot paths dereference next.
    pages: Arc<PagePool>,
    extents: Extents,
    meta: MetaTable,
    /// Periodic plans for large blocks (see `Config::plan`).
    plan: Option<Box<PlanServer>>,
    // The rest.
    slab: Slab,
    device: Arc<dyn Device>,
    cfg: Config,
    buddy: Buddy,
    stream: Option<DriverPool>,
    /// Who allocates from the buddy and who freed into it (`experimental.long_tier:buddy`; one region
    /// all streams share).
    buddy_handoff: Handoff,
    /// Blocks freed while their ordering could not be made (a capture forbids the device calls), given
    /// back at the first call after it; their bytes in `deferred_bytes`.
    deferred: Mutex<Vec<Deferred>>,
    deferred_bytes: AtomicU64,
    /// Live bytes per tier and their peaks, per thread.
    books: LiveBooks,
    /// Large blocks a thread keeps for its next allocations while several threads allocate at once.
    tcache: ThreadCaches,
    /// Blocks a stream known busy freed itself in the shared arena, kept for its next allocations of
    /// their size (`busykeep.rs`).
    busy_keep: BusyKeep,
    /// Records of the slab's live blocks, per slot.
    slab_book: SlabBook,
    /// Slab blocks a thread freed, kept for its next allocations of their class (`mag.rs`).
    mags: Magazines,
    ooms: AtomicU64,
    retries: AtomicU64,
    invalid_frees: AtomicU64,
    /// See `Pool::mark_iteration`.
    headroom: Headroom,
}

/// A block freed during a capture whose ordering had to wait (see `Pool::give_back_deferred`).
struct Deferred {
    ptr: u64,
    size: u64,
    tier: Tier,
    stream: StreamId,
}

/// VA of a stream's own arena, in multiples of the device's memory (the first stream's arena has eight:
/// streams after the first carry less in the programs measured — a prefetched batch, a serving request —
/// and each arena's page table costs host memory in proportion, ~70 bytes a 2 MiB page). Two was too few:
/// a few small blocks left where large ones had been could leave no hole for a request the device could
/// hold (`engine.rs`, `a_second_streams_arena_fragmented_by_small_blocks_still_serves_a_large_one`).
const STREAM_ARENA_VA: u64 = 4;

/// What every allocation and free reads outside its tier, in one cache line, written only when the
/// streams seen change (and by large allocations' run count). Inside PyTorch the allocator's lines are
/// mostly cold between calls (kernel launches and the interpreter run in between), so each distinct line
/// a call touches costs a miss: spread over the pool's fields (Rust lays them out by size, not by use)
/// these words took ~4-5 lines a call. The live-byte counters, written by every call, are kept per
/// thread elsewhere ([`LiveBooks`]): on this line they made every thread's every call miss.
#[repr(C, align(64))]
struct Hot {
    /// The one stream seen so far (`NO_STREAM` before the first).
    solo_stream: AtomicU64,
    /// Large allocations since the last free (any free): a burst builds long-lived state.
    large_since_free: AtomicU64,
    /// The device's memory: no allocation can be larger.
    max_size: u64,
    /// The slab tier's largest size (copied from it).
    slab_max: u64,
    /// The device's ordinal (a classifier feature; read once, not through the device's vtable per call).
    ordinal: u32,
    /// Copies of the configuration that routing reads on every call.
    routing: Routing,
    long_tier: LongTier,
    use_site: bool,
    /// Whether the stream-ordered tier exists.
    has_stream: bool,
    /// A second stream has been seen: plans stop, and the page pool and the slab keep per-stream fences
    /// (a block's handoff orders streams whatever this says).
    multi_stream: AtomicBool,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("device", &self.device.props().name)
            .field("cfg", &self.cfg)
            .finish()
    }
}

impl Pool {
    /// A pool on `device` with `cfg`.
    pub fn new(device: Arc<dyn Device>, cfg: Config) -> Result<Self> {
        let props = device.props().clone();
        let pages = PagePool::new(
            device.clone(),
            PagePoolConfig {
                limit: cfg.limit,
                eager_unmap: cfg.eager_unmap,
                slack: cfg.page_slack,
                keep_old_mappings: cfg.page_keep_old_mappings,
            },
        )
        .map_err(|e| match e {
            VmmError::Device(d) => GenpoolError::from(d),
            other => tier_err(other),
        })?;
        let page = pages.page_size();
        let defaults = ClassifierConfig::default();
        let mut short = defaults.short_horizon();
        let mut mid = defaults.mid_horizon();
        if cfg.short_horizon > 0 {
            short.allocs = cfg.short_horizon;
        }
        if cfg.mid_horizon > 0 {
            mid.allocs = cfg.mid_horizon;
        }
        let ccfg = ClassifierConfig::builder()
            .short_horizon(short)
            .mid_horizon(mid)
            .use_site(cfg.use_site)
            .build()
            .map_err(|e| crate::config::ConfigError::BadValue {
                key: "short_horizon/mid_horizon".into(),
                value: format!("{}/{}", short.allocs, mid.allocs),
                reason: e.to_string(),
            })?;
        let classifier = Classifier::new(ccfg);
        let slab = Slab::new(
            &pages,
            device.clone(),
            SlabConfig {
                max_size: cfg.slab_max_size,
                ..SlabConfig::default()
            },
        )?;
        // Whole pages of VA, `times` the device's memory.
        let va_of = |times: u64| props.total_mem.saturating_mul(times).div_ceil(page).max(1) * page;
        // An old generation takes half of each arena's VA: twice the VA keeps the young range's.
        let va_times = if cfg.old_generation > 0 { 2 } else { 1 };
        pages.set_pass_busy(cfg.busy_freers == crate::config::BusyFreers::Pass);
        let extents = Extents::new(
            &pages,
            ExtentsConfig {
                generations: cfg.extent_generations,
                stream_arenas: cfg.stream_arenas,
                main_va: va_of(gen_extent::DEFAULT_VA_TIMES * va_times),
                stream_va: va_of(STREAM_ARENA_VA * va_times),
                placement_candidates: cfg.placement_candidates,
                old_after: cfg.old_generation,
                pass_busy: cfg.busy_freers == crate::config::BusyFreers::Pass,
            },
        )?;
        let buddy = Buddy::new(&pages, BuddyConfig::default())?;
        let plan = if cfg.plan {
            // A plan can never map more than the device holds.
            Some(Box::new(
                PlanServer::new(
                    &pages,
                    va_of(1),
                    PlanServerConfig {
                        planner: PlanConfig {
                            max_period: cfg.plan_max_period,
                            background: cfg.plan_background,
                            ..PlanConfig::default()
                        },
                        pin: cfg.plan_pin,
                        min_moves: cfg.plan_min_moves,
                    },
                )
                .map_err(tier_err)?,
            ))
        } else {
            None
        };
        let stream = if props.supports_pools && cfg.mid_tier == MidTier::Stream {
            Some(
                DriverPool::new(
                    device.clone(),
                    DriverPoolConfig {
                        release_threshold: cfg.pool_release_threshold,
                        ..DriverPoolConfig::default()
                    },
                )
                .map_err(tier_err)?,
            )
        } else {
            None
        };
        let slab_book = SlabBook::new(&slab);
        let mags = Magazines::new(slab.class_count(), cfg.magazines);
        let hot = Hot {
            solo_stream: AtomicU64::new(NO_STREAM),
            large_since_free: AtomicU64::new(0),
            max_size: props.total_mem,
            slab_max: slab.max_size(),
            ordinal: props.ordinal as u32,
            routing: cfg.routing,
            long_tier: cfg.long_tier,
            use_site: cfg.use_site,
            has_stream: stream.is_some(),
            multi_stream: AtomicBool::new(false),
        };
        let thread_caches = cfg.thread_caches;
        Ok(Pool {
            buddy_handoff: Handoff::new(),
            deferred: Mutex::new(Vec::new()),
            deferred_bytes: AtomicU64::new(0),
            hot,
            device,
            headroom: Headroom::new(cfg.move_budget, cfg.page_slack_max),
            cfg,
            pages,
            classifier,
            slab,
            extents,
            buddy,
            plan,
            stream,
            meta: MetaTable::new(),
            books: LiveBooks::new(),
            tcache: ThreadCaches::new(thread_caches),
            busy_keep: BusyKeep::default(),
            slab_book,
            mags,
            ooms: AtomicU64::new(0),
            retries: AtomicU64::new(0),
            invalid_frees: AtomicU64::new(0),
        })
    }

    /// The device this pool serves.
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }

    /// The physical page pool under every tier (shared: its counters can be read while the pool itself
    /// is borrowed elsewhere, e.g. between the passes of a replay).
    pub fn page_pool(&self) -> &Arc<PagePool> {
        &self.pages
    }

    /// The configuration in force.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The classifier (for its confusion matrix and statistics).
    pub fn classifier(&self) -> &Classifier {
        &self.classifier
    }

    /// Track the streams seen. While one stream has been seen, a free may go straight back to its tier:
    /// only that stream can reuse the block, and stream order makes that safe. The first time a second
    /// stream shows up, the flag is raised first and the device synchronized once, so every free that
    /// went straight back before (its work was queued before it) is complete before any block can reach
    /// the new stream.
    #[inline]
    fn note_stream(&self, stream: StreamId) {
        if self.hot.multi_stream.load(Ordering::Acquire) {
            return;
        }
        let solo = self.hot.solo_stream.load(Relaxed);
        if solo == stream {
            return;
        }
        if solo == NO_STREAM
            && self
                .hot
                .solo_stream
                .compare_exchange(NO_STREAM, stream, Ordering::AcqRel, Relaxed)
                .is_ok()
        {
            // One stream: the page pool may move pages still in use by aliasing them, and the slab
            // reclaims empty chunks without a synchronize (stream order).
            self.pages.one_stream(stream);
            self.slab.set_one_stream(true);
            self.extents.set_first_stream(stream);
            self.buddy_handoff.seed(stream);
            return;
        }
        if self.hot.solo_stream.load(Relaxed) != stream
            && !self.hot.multi_stream.swap(true, Ordering::SeqCst)
        {
            // gen-vmm decides the regime and makes its one synchronize; the slab leaves its one-stream
            // shortcuts first, so that every free they served is covered by it.
            self.slab.set_one_stream(false);
            self.pages.several_streams();
            // Plans serve one stream: stop handing out planned slots (the range goes once drained).
            self.drop_plan();
        }
    }

    /// Refuse zero and impossible sizes ([`GenpoolError::InvalidSize`]).
    #[inline]
    pub(crate) fn check_size(&self, size: u64) -> Result<()> {
        if size == 0 {
            return Err(GenpoolError::InvalidSize {
                size,
                reason: "zero-byte allocation",
            });
        }
        if size > self.hot.max_size {
            return Err(GenpoolError::InvalidSize {
                size,
                reason: "larger than the device's memory",
            });
        }
        Ok(())
    }

    /// Tell the classifier a block it stamped is gone (nothing when lifetime routing is off: no stamp
    /// was made).
    #[inline]
    fn learn(&self, stamp: &Stamp, size: u64) {
        if self.hot.routing == Routing::Generational {
            self.classifier.on_free(stamp, size);
        }
    }

    fn route(&self, size: u64, class: Lifetime) -> Tier {
        let small = size <= self.hot.slab_max;
        match (self.hot.routing, class) {
            (Routing::Extent, _) => Tier::Extent,
            (Routing::Single, _) | (Routing::Generational, Lifetime::Short) => {
                if small {
                    Tier::Slab
                } else {
                    Tier::Extent
                }
            }
            (Routing::Generational, Lifetime::Mid) => {
                if self.hot.has_stream {
                    Tier::Stream
                } else if small {
                    Tier::Slab
                } else {
                    Tier::Extent
                }
            }
            (Routing::Generational, Lifetime::Long) => match self.hot.long_tier {
                LongTier::Buddy => Tier::Buddy,
                LongTier::Extent => Tier::Extent,
            },
        }
    }

    /// Allocate `size` bytes for use on `stream`. Alignment is 512 bytes; the block spans `size` rounded
    /// up to 512. Zero and impossible sizes are [`GenpoolError::InvalidSize`]; when the device is
    /// exhausted the pool first gives back everything it caches and retries once, then fails with
    /// [`GenpoolError::OutOfMemory`] and stays usable.
    pub fn alloc(&self, size: u64, stream: StreamId, hint: Hint) -> Result<Block> {
        self.check_size(size)?;
        // Sleep / wake (crate::sleep): refused before a tier could hand out memory of pages it holds.
        if self.pages.is_asleep() {
            return Err(GenpoolError::Asleep);
        }
        let requested = size;
        let size = size.div_ceil(ALIGN) * ALIGN;
        self.note_stream(stream);
        // The short-lived path: routing by size (the default) sends a slab-sized block to the slab; when
        // the slab serves it without new pages its record goes to the slab's book — no features, no
        // route, no ladder. Anything else (a slab that would grow, a full class) takes the general path.
        if size <= self.hot.slab_max && self.hot.routing == Routing::Single {
            // A block of the class this thread freed last on this stream first (`mag.rs`), else the
            // slab's.
            let me = crate::thread_slot::mine();
            let parked = self
                .slab
                .class_of(size)
                .and_then(|(ci, _)| self.mags.pop(me, ci, stream));
            if let Some(ptr) =
                parked.or_else(|| self.slab.alloc(size, stream, self.pages.slack() > 0.0).ok())
            {
                let word = SlabWord::live(size, (size - requested) as u16);
                self.record(ptr, crate::slabbook::meta(word.0, stream));
                self.books.add_as(me, Tier::Slab as usize, size);
                return Ok(Block {
                    ptr,
                    size,
                    tier: Tier::Slab,
                });
            }
        }
        let features = Features {
            size,
            stream,
            device: self.hot.ordinal,
            site: if self.hot.use_site { hint.site } else { None },
            hint: hint.lifetime,
        };
        // Lifetime routing off (`experimental.routing:single`, and `extent` of private pools): no
        // prediction is made or learned — the baseline that shows what the classifier buys.
        let stamp = if self.hot.routing != Routing::Generational {
            Stamp::NONE
        } else {
            self.classifier.on_alloc(&features)
        };
        let class = stamp.predicted();
        let tier = self.route(size, class);
        if tier == Tier::Extent && self.hot.routing == Routing::Single {
            self.tcache.note_thread();
            if self.tcache.on() && !self.device.captures().active() {
                if let Some(ptr) = self.tcache.take(size, stream) {
                    return Ok(self.hand_out(ptr, size, requested, stream));
                }
            }
            if self.busy_keep.bytes() != 0 {
                if let Some(ptr) = self.take_busy_kept(size, stream) {
                    return Ok(self.hand_out(ptr, size, requested, stream));
                }
            }
        }
        let (mut planned, mut ticket) = (None, Ticket::NONE);
        // The planner sees every large allocation (by size, not by prediction, so the sequence it learns
        // does not change as the classifier learns); a planned slot overrides the route: the plan knows
        // the block's lifetime from the last period.
        if size > self.hot.slab_max && !self.hot.multi_stream.load(Ordering::Acquire) {
            // A heuristic count: a plain load and store (no locked instruction); a race between two
            // threads' large allocations loses one count, which no decision depends on exactly.
            let run = self.hot.large_since_free.load(Relaxed);
            self.hot.large_since_free.store(run + 1, Relaxed);
            if let Some(ps) = self.plan.as_ref().filter(|ps| ps.awake()) {
                (planned, ticket) = ps.alloc(size, run);
            }
        }
        let (ptr, tier) = match planned {
            Some(p) => (p, Tier::Extent),
            None => match self.alloc_in(tier, class, size, stream) {
                Ok(pt) => pt,
                Err(e) => {
                    // The classifier advanced its clocks for an allocation that never happened: score
                    // it as an immediate free so its books stay balanced (and the planner, if it was
                    // recording this one, sees it die at once).
                    self.learn(&stamp, size);
                    self.plan_free(ticket, None);
                    return Err(e);
                }
            },
        };
        let m = Meta {
            size,
            tier,
            stamp,
            ticket,
            stream,
            // < ALIGN: the rounding above.
            slack: (size - requested) as u16,
            thread: self.tcache_thread(tier),
        };
        self.record(ptr, m);
        self.books.add(tier as usize, size);
        Ok(Block { ptr, size, tier })
    }

    /// Remember a live block: a slab block with no stamp in the slab's per-slot book, any other in the
    /// address map.
    #[inline]
    fn record(&self, ptr: u64, m: Meta) {
        if m.tier == Tier::Slab
            && self.hot.routing != Routing::Generational
            && self
                .slab_book
                .set(&self.slab, ptr, m.size, m.slack, m.stream)
        {
            return;
        }
        self.meta.insert(ptr, m);
    }

    /// An extent block the caller has (one a thread's cache kept, `tcache.rs`, or one placed at an
    /// address, `place.rs`), handed out: recorded, with no classifier stamp, and counted.
    fn hand_out(&self, ptr: u64, size: u64, requested: u64, stream: StreamId) -> Block {
        let m = Meta {
            size,
            tier: Tier::Extent,
            stamp: Stamp::NONE,
            ticket: Ticket::NONE,
            stream,
            slack: (size - requested) as u16,
            thread: self.tcache_thread(Tier::Extent),
        };
        self.record(ptr, m);
        self.books.add(Tier::Extent as usize, size);
        Block {
            ptr,
            size,
            tier: Tier::Extent,
        }
    }

    /// What a new block's record says of its allocating thread: its slot while the thread caches are
    /// engaged and the block is an extent block, else [`NO_THREAD`] (no cache will keep it).
    #[inline]
    fn tcache_thread(&self, tier: Tier) -> u8 {
        if tier == Tier::Extent && self.tcache.on() {
            // `index <= SLOTS = 64`.
            crate::thread_slot::mine().index as u8
        } else {
            NO_THREAD
        }
    }

    /// Give a block a thread's cache kept back to its arena (freed by the user already).
    fn give_back_kept(&self, k: Kept) {
        match self.tier_free(Tier::Extent, k.ptr, k.stream) {
            Ok(()) => return,
            Err(TierError::Vmm(VmmError::Capturing(why))) => {
                log::debug!(
                    "genpool: kept block {:#x} deferred during a capture ({why})",
                    k.ptr
                );
            }
            // Its ordering could not be made (a device error): it waits out of its tier with the blocks
            // a capture deferred, retried with them, rather than lost.
            Err(e) => log::error!("genpool: giving back kept block {:#x}: {e}", k.ptr),
        }
        self.defer(Deferred {
            ptr: k.ptr,
            size: k.size,
            tier: Tier::Extent,
            stream: k.stream,
        });
    }

    /// Keep a freed block out of its tier until [`give_back_deferred`](Self::give_back_deferred) can
    /// return it (after a capture, or a retry of an ordering that failed), counted as held.
    fn defer(&self, d: Deferred) {
        let size = d.size;
        self.deferred.lock().push(d);
        self.deferred_bytes.fetch_add(size, Relaxed);
    }

    /// What every free does before its tier sees the block: the run of large allocations since the
    /// last free ends, `stream` is noted (a second stream changes the regime before any reuse), and once
    /// several streams are seen the blocks a capture deferred go back.
    #[inline]
    fn on_free_stream(&self, stream: StreamId) {
        if self.hot.large_since_free.load(Relaxed) != 0 {
            self.hot.large_since_free.store(0, Relaxed);
        }
        self.note_stream(stream);
        if self.hot.multi_stream.load(Relaxed) && self.deferred_bytes.load(Relaxed) != 0 {
            self.give_back_deferred();
        }
    }

    /// A block of `size` bytes `stream` freed while it was busy (`busykeep.rs`), for its allocation now;
    /// none during a capture. Once no stream is known busy any more, every kept block goes back.
    #[cold]
    fn take_busy_kept(&self, size: u64, stream: StreamId) -> Option<u64> {
        if self.device.captures().active() {
            return None;
        }
        if !self.pages.any_known_busy() {
            self.drain_busy_kept();
            return None;
        }
        self.busy_keep.take(size, stream)
    }

    /// Whether the block at `ptr` (an extent block of `size` bytes, not a plan's) freed on `stream`, its
    /// own, is kept for the stream's next allocation of its size (`busykeep.rs`): the pool routes by
    /// size and passes over busy freers, the block is the shared arena's, no capture is underway, and
    /// `stream` is known busy. No lock while no stream is known busy.
    #[inline]
    fn keeps_for_busy(&self, ptr: u64, size: u64, stream: StreamId) -> bool {
        self.pages.any_known_busy() && self.keeps_for_busy_slow(ptr, size, stream)
    }

    #[cold]
    fn keeps_for_busy_slow(&self, ptr: u64, size: u64, stream: StreamId) -> bool {
        BusyKeep::fits(size)
            // Only where the allocation path takes kept blocks back (`alloc`: routing by size).
            && self.hot.routing == Routing::Single
            && self.pages.passes_busy_freers()
            && !self.device.captures().active()
            && self.extents.home(ptr).is_some_and(|h| h.shared)
            && self.pages.known_busy([stream], |_| 1) != 0
    }

    /// Keep the extent block at `ptr` (record `meta`, freed on its own `stream`) for the next
    /// allocation of its size: in the freeing thread's cache (`to_thread`) or for its busy stream
    /// (`busykeep.rs`); the blocks that pushes out go back to the arena. Returns the freed block.
    #[cold]
    fn keep_freed(&self, to_thread: bool, ptr: u64, meta: &Meta, stream: StreamId) -> LiveBlock {
        self.plan_free(meta.ticket, None);
        let block = Kept {
            ptr,
            size: meta.size,
            stream,
        };
        let pushed_out = if to_thread {
            self.tcache.keep(block)
        } else {
            self.busy_keep.keep(block)
        };
        for k in pushed_out {
            self.give_back_kept(k);
        }
        self.books.sub(Tier::Extent as usize, meta.size);
        LiveBlock::of(ptr, meta)
    }

    /// Give every block the busy streams keep back to its arena (a trim, sleep, the out-of-memory
    /// path, or no stream busy any more). Not before each growth, as the threads' caches: while its
    /// stream is busy, a kept block's bytes and pages would only be passed over by the others.
    fn drain_busy_kept(&self) {
        for k in self.busy_keep.drain() {
            self.give_back_kept(k);
        }
    }

    /// Give every block the threads' caches keep back to its arena; returns how many.
    fn drain_thread_caches(&self) -> usize {
        let kept = self.tcache.drain();
        let n = kept.len();
        for k in kept {
            self.give_back_kept(k);
        }
        n
    }

    /// Take a live block's record out (its free). A slab address with no record anywhere that is the
    /// start of a slot is a double free.
    #[inline]
    fn unrecord(&self, ptr: u64) -> Removed {
        if !self.slab.owns(ptr) {
            return self.meta.remove(ptr);
        }
        if let Some(m) = self.slab_book.take(&self.slab, ptr) {
            return Removed::Live(m);
        }
        match self.meta.remove(ptr) {
            Removed::Unknown if self.slab.slot_of(ptr).is_some() => Removed::RecentlyFreed,
            r => r,
        }
    }

    /// A live block's record, left in place.
    fn recorded(&self, ptr: u64) -> Option<Meta> {
        if self.slab.owns(ptr) {
            if let Some(m) = self.slab_book.get(&self.slab, ptr) {
                return Some(m);
            }
        }
        self.meta.get(ptr)
    }

    /// Every live block's record.
    fn records(&self) -> Vec<(u64, Meta)> {
        let mut v = self.meta.snapshot();
        v.extend(self.slab_book.snapshot(&self.slab));
        v
    }

    fn alloc_in(
        &self,
        tier: Tier,
        class: Lifetime,
        size: u64,
        stream: StreamId,
    ) -> Result<(u64, Tier)> {
        // 1. By default without growing the page pool: a free page mapped elsewhere is moved rather than
        //    a new one created. With `page_slack` the page pool itself chooses: create within the
        //    headroom, else move.
        let grow_first = self.pages.slack() > 0.0;
        match self.attempt(tier, class, size, stream, grow_first) {
            Ok(pt) => return Ok(pt),
            Err(e) if e.is_fault() => return Err(e.into()),
            Err(_) => {}
        }
        // 2. Blocks whose free waited for a capture to end, if it has.
        if self.give_back_deferred() > 0 {
            match self.attempt(tier, class, size, stream, false) {
                Ok(pt) => return Ok(pt),
                Err(e) if e.is_fault() => return Err(e.into()),
                Err(_) => {}
            }
        }
        // 3. Blocks the threads' caches keep (their pages are committed), then empty slab chunks (those
        //    free without a synchronize), then grow.
        if self.drain_thread_caches() > 0 {
            match self.attempt(tier, class, size, stream, false) {
                Ok(pt) => return Ok(pt),
                Err(e) if e.is_fault() => return Err(e.into()),
                Err(_) => {}
            }
        }
        // The calling thread's magazine (its parked blocks pin slab chunks); every thread's only when
        // the pool is relieved (below: the out-of-memory path, a trim, sleep), so that one thread's
        // growth does not empty the magazines of threads allocating at once (theirs hold at most 16
        // blocks a class of at most `slab_max_size` bytes).
        self.mags
            .drain_mine(crate::thread_slot::mine(), |a, s| self.unpark(a, s));
        if let Err(e) = self.slab.reclaim_idle() {
            log::error!("genpool: slab reclaim: {e}");
        }
        for grow in [false, true] {
            match self.attempt(tier, class, size, stream, grow) {
                Ok(pt) => return Ok(pt),
                Err(TierError::WouldGrow { .. }) => continue,
                Err(e) if e.is_fault() => return Err(e.into()),
                Err(_) => break,
            }
        }
        // 4. Release everything releasable (a plan's range too, once its blocks are gone) and retry once;
        //    then out of memory.
        self.retries.fetch_add(1, Relaxed);
        self.drop_plan();
        self.relieve(true);
        match self.attempt(tier, class, size, stream, true) {
            Ok(pt) => Ok(pt),
            Err(e) if e.is_fault() => Err(e.into()),
            Err(_) => {
                self.ooms.fetch_add(1, Relaxed);
                // The failed attempt may have created pages before it ran out; give them back so the
                // rest of the process (cuBLAS workspaces, NCCL, ...) can still use the memory.
                if let Err(e) = self.pages.release_unused() {
                    log::error!("genpool: releasing unused pages after out-of-memory: {e}");
                }
                Err(GenpoolError::OutOfMemory(Box::new(self.oom_report(size))))
            }
        }
    }

    /// Free the blocks whose free waited for a capture to end, now that none is underway (each ordered
    /// as its free would have been). Returns the bytes given back to their tiers.
    fn give_back_deferred(&self) -> u64 {
        if self.deferred_bytes.load(Relaxed) == 0 || self.device.captures().active() {
            return 0;
        }
        let blocks = std::mem::take(&mut *self.deferred.lock());
        let mut done = 0u64;
        for d in blocks {
            match self.tier_free(d.tier, d.ptr, d.stream) {
                Ok(()) => {
                    done += d.size;
                    self.deferred_bytes.fetch_sub(d.size, Relaxed);
                }
                Err(TierError::Vmm(VmmError::Capturing(_))) => self.deferred.lock().push(d),
                Err(e) => {
                    // The block stays out of its tier (it cannot be reused unordered); counted as held.
                    log::error!("genpool: freeing {:#x} after a capture: {e}", d.ptr);
                    self.deferred.lock().push(d);
                }
            }
        }
        done
    }

    /// Tell the plan server a block it tracks is gone (`range`: a planned block's).
    fn plan_free(&self, ticket: Ticket, range: Option<(u64, u64)>) {
        if let Some(ps) = &self.plan {
            ps.free(ticket, range);
        }
    }

    /// Stop serving from the plan (its live blocks keep their slots until freed; pinned pages go back
    /// once none is live).
    fn drop_plan(&self) {
        if let Some(ps) = &self.plan {
            ps.drop_plan();
        }
    }

    /// The tier behind `tier` (the stream tier is routed to only when it exists).
    #[inline]
    fn tier(&self, tier: Tier) -> &dyn TierAlloc {
        match tier {
            Tier::Slab => &self.slab,
            Tier::Extent => &self.extents,
            Tier::Buddy => &self.buddy,
            Tier::Stream => self
                .stream
                .as_ref()
                .expect("stream tier routed only when present"),
        }
    }

    /// One try of `tier` (the slab's size class out of slots: the extent arena, which serves any size).
    fn attempt(
        &self,
        tier: Tier,
        class: Lifetime,
        size: u64,
        stream: StreamId,
        grow: bool,
    ) -> std::result::Result<(u64, Tier), TierError> {
        let req = Request {
            size,
            class,
            stream,
            first_stream: self.hot.solo_stream.load(Relaxed),
            grow,
        };
        if tier == Tier::Buddy {
            self.buddy_handoff
                .enter(&self.pages, stream)
                .map_err(TierError::Vmm)?;
        }
        match self.tier(tier).alloc(&req) {
            Ok(p) => Ok((p, tier)),
            Err(TierError::Exhausted { .. }) if tier == Tier::Slab => {
                self.attempt(Tier::Extent, class, size, stream, grow)
            }
            Err(e @ TierError::Exhausted { .. }) => {
                log::warn!("genpool: {e}");
                Err(e)
            }
            Err(e) => Err(e),
        }
    }

    /// Give back everything cached: blocks to their tiers (streams synchronized as needed), empty slab
    /// chunks, the driver pool's spare memory, empty regions, and unused pages to the driver. Nothing
    /// while a capture is underway: every step may synchronize.
    fn relieve(&self, hard: bool) {
        if self.device.captures().active() {
            return;
        }
        self.give_back_deferred();
        self.drain_thread_caches();
        self.drain_busy_kept();
        self.drain_magazines();
        if hard {
            self.slab.trim();
        } else if let Err(e) = self.slab.reclaim_idle() {
            log::error!("genpool: slab reclaim: {e}");
        }
        if hard {
            if let Some(sp) = &self.stream {
                TierAlloc::trim(sp);
            }
            self.extents.trim();
            self.buddy.trim();
            if let Err(e) = self.pages.release_unused() {
                log::error!("genpool: releasing unused pages: {e}");
            }
        }
    }

    /// Free a block on `stream`: it is reusable at once on `stream`, and on other streams once the work
    /// queued on `stream` before this call has completed. Unknown and double frees are refused with
    /// [`GenpoolError::InvalidFree`] and change nothing.
    pub fn free(&self, ptr: u64, stream: StreamId) -> Result<u64> {
        self.free_block(ptr, Some(stream)).map(|b| b.size)
    }

    /// Free a block on the stream it was allocated for (PyTorch's rule: a tensor's memory is reusable on
    /// its allocation stream at once; other streams are ordered through `record_stream`). Returns what
    /// the block was. Refusals as [`free`](Self::free).
    #[inline]
    pub fn free_owned(&self, ptr: u64) -> Result<LiveBlock> {
        self.free_block(ptr, None)
    }

    /// [`free`](Self::free) on `stream`, or [`free_owned`](Self::free_owned) with `None`, returning the
    /// block either way (also the multi-device layer's one path to the engine's free).
    #[inline(always)]
    pub(crate) fn free_block(&self, ptr: u64, stream: Option<StreamId>) -> Result<LiveBlock> {
        if ptr == 0 {
            self.invalid_frees.fetch_add(1, Relaxed);
            return Err(GenpoolError::InvalidFree {
                ptr,
                fault: FreeFault::Null,
            });
        }
        // The short-lived path: a slab block recorded in the slab's per-slot book (lifetime routing
        // off, the default) is freed from its entry's two words, with no record built.
        if self.slab.owns(ptr) {
            let (word, alloc_stream, ci) = self.slab_book.take_raw(&self.slab, ptr);
            if word != 0 {
                return self.free_slab(ptr, ci, stream.unwrap_or(alloc_stream), word, alloc_stream);
            }
        }
        let meta = match self.unrecord(ptr) {
            Removed::Live(m) => m,
            Removed::RecentlyFreed => {
                self.invalid_frees.fetch_add(1, Relaxed);
                return Err(GenpoolError::InvalidFree {
                    ptr,
                    fault: FreeFault::DoubleFree,
                });
            }
            Removed::Unknown => {
                self.invalid_frees.fetch_add(1, Relaxed);
                return Err(GenpoolError::InvalidFree {
                    ptr,
                    fault: FreeFault::Unknown,
                });
            }
        };
        let size = meta.size;
        let stream = stream.unwrap_or(meta.stream);
        self.on_free_stream(stream);
        self.learn(&meta.stamp, size);
        // An own-stream free of an extent block, not a plan's, may be kept for the next allocation of
        // its size: by the freeing thread, while several threads allocate at once (`tcache.rs`; a record
        // names its thread only for an extent block allocated while the caches were engaged, so in a
        // pool routing by size), else for its stream while that stream is known busy and the block is
        // the shared arena's (`busykeep.rs`), rather than leave bytes the other streams would pass over.
        if meta.tier == Tier::Extent && !meta.ticket.is_planned() && stream == meta.stream {
            let to_thread = meta.thread != NO_THREAD
                && ThreadCaches::fits(size)
                && !self.device.captures().active()
                && self.tcache.mine(meta.thread);
            if to_thread || self.keeps_for_busy(ptr, size, stream) {
                return Ok(self.keep_freed(to_thread, ptr, &meta, stream));
            }
        }
        let res = match meta.tier {
            Tier::Extent if meta.ticket.is_planned() => {
                // Served from the plan's range: the slot is free again once the planner knows. Only one
                // stream ever allocates planned slots (see `note_stream`), so stream order makes the
                // reuse safe, as for a tier.
                self.plan_free(meta.ticket, Some((ptr, size)));
                Ok(())
            }
            t => {
                if t == Tier::Extent {
                    self.plan_free(meta.ticket, None);
                }
                match self.tier_free(t, ptr, stream) {
                    Err(TierError::Vmm(VmmError::Capturing(why))) => {
                        // The block's reuse by another stream would need an ordering a capture forbids:
                        // it goes back to its tier at the first call after the capture.
                        log::debug!("genpool: free of {ptr:#x} deferred during a capture ({why})");
                        self.defer(Deferred {
                            ptr,
                            size,
                            tier: t,
                            stream,
                        });
                        Ok(())
                    }
                    r => r.map_err(GenpoolError::from),
                }
            }
        };
        if let Err(e) = res {
            // The tier refused a block our table said was live: an internal inconsistency. Keep the
            // block recorded (nothing is lost) and report it.
            self.record(ptr, meta);
            return Err(e);
        }
        self.books.sub(meta.tier as usize, size);
        Ok(LiveBlock::of(ptr, &meta))
    }

    /// [`free_block`](Self::free_block) of a slab block of class `ci` whose entry in the slab's book was
    /// just taken (`word`, allocated for `alloc_stream`), freed on `stream`: what the general path does for a slab block —
    /// the large-allocation run ends, the stream is noted, blocks a capture deferred go back once several
    /// streams are seen, then the slab — without a classifier stamp, a plan ticket or a thread cache to
    /// consult (a slab block in the book has none).
    #[inline]
    fn free_slab(
        &self,
        ptr: u64,
        ci: usize,
        stream: StreamId,
        word: u64,
        alloc_stream: StreamId,
    ) -> Result<LiveBlock> {
        let w = SlabWord(word);
        self.on_free_stream(stream);
        // Kept for this thread's next allocation of its class on `stream` (`mag.rs`); the slab still
        // counts it live. During a capture too: as the slab's own lists, a magazine gives a block back
        // on the stream it was freed on only, which the captured graph orders as the stream did.
        let me = crate::thread_slot::mine();
        if self.mags.push(me, ci, ptr, stream) {
            self.books.sub_as(me, Tier::Slab as usize, w.size());
            return Ok(LiveBlock::new(
                ptr,
                w.size(),
                w.requested(),
                Tier::Slab,
                alloc_stream,
            ));
        }
        match self.slab.free(ptr, stream) {
            Ok(_) => {}
            Err(TierError::Vmm(VmmError::Capturing(why))) => {
                // As in `free_block`: back to the slab at the first call after the capture. Counted
                // at its class's size, the slot it holds (as a kept block `unpark` defers).
                log::debug!("genpool: free of {ptr:#x} deferred during a capture ({why})");
                self.defer(Deferred {
                    ptr,
                    size: self.slab.size_classes().size(ci),
                    tier: Tier::Slab,
                    stream,
                });
            }
            Err(TierError::InvalidFree { .. }) => {
                // The slab's live flag says the slot is free: a double free racing the first one on
                // another thread (both read the entry live; the slab's swap let one through). The
                // first free owns the slot: refused, nothing changes.
                self.invalid_frees.fetch_add(1, Relaxed);
                return Err(GenpoolError::InvalidFree {
                    ptr,
                    fault: FreeFault::DoubleFree,
                });
            }
            Err(e) => {
                // Refused for another reason (a device error on the slab's overflow path): the block
                // stays recorded, nothing is lost.
                self.record(ptr, crate::slabbook::meta(word, alloc_stream));
                return Err(e.into());
            }
        }
        self.books.sub_as(me, Tier::Slab as usize, w.size());
        Ok(LiveBlock::new(
            ptr,
            w.size(),
            w.requested(),
            Tier::Slab,
            alloc_stream,
        ))
    }

    /// A block a magazine kept (freed by the user already, live in the slab) back to the slab, freed on
    /// `stream`. Refused — a capture's ordering, or a device error on the slab's overflow path — it waits
    /// with the blocks a capture deferred and is retried with them, rather than lost.
    #[cold]
    fn unpark(&self, ptr: u64, stream: StreamId) {
        match self.slab.free(ptr, stream) {
            Ok(_) => return,
            Err(TierError::Vmm(VmmError::Capturing(_))) => {}
            Err(e) => log::error!("genpool: giving back a kept slab block {ptr:#x}: {e}"),
        }
        let size = self
            .slab
            .slot_of(ptr)
            .map_or(0, |(ci, _)| self.slab.size_classes().size(ci));
        self.defer(Deferred {
            ptr,
            size,
            tier: Tier::Slab,
            stream,
        });
    }

    /// Give every block the threads' magazines keep back to the slab; returns how many.
    fn drain_magazines(&self) -> usize {
        self.mags.drain(|a, s| self.unpark(a, s))
    }

    /// Give a block back to its tier. A block of a range several streams use goes back only once the
    /// range's other allocators are ordered after `stream` (its handoff); that ordering's
    /// [`VmmError::Capturing`] leaves the block out.
    fn tier_free(
        &self,
        tier: Tier,
        ptr: u64,
        stream: StreamId,
    ) -> std::result::Result<(), TierError> {
        match tier {
            // One stream: every free is on the first stream, the sole allocator (`note_stream` raised
            // `multi_stream` before any other stream's free got here).
            Tier::Extent if !self.hot.multi_stream.load(Relaxed) => self.extents.free_solo(ptr),
            Tier::Buddy => {
                self.buddy_handoff
                    .freed(&self.pages, stream)
                    .map_err(TierError::Vmm)?;
                self.buddy.free(ptr).map(|_| ())
            }
            t => TierAlloc::free(self.tier(t), ptr, stream),
        }
    }

    /// A training iteration ended (an explicit period mark): the classifier learns the period, and the
    /// page pool's headroom grows (up to `page_slack_max`) when the iteration spent more than
    /// `move_budget` of its wall time moving pages — by half a percent per budget spent, at most two
    /// percent at a time, and not while a plan is recorded or ready to take the moves over. The first
    /// `WARM_ITERATIONS` marks (`headroom.rs`) only start the clock (warm-up lays everything out once).
    pub fn mark_iteration(&self) {
        self.classifier.mark_iteration();
        self.headroom.on_iteration(&self.pages, || {
            self.plan.as_ref().is_some_and(|ps| ps.pending())
        });
    }

    /// A replay pass begins (a whole recorded run, not one iteration of it): the classifier takes it as a
    /// period mark; the move budget does not (a replay has no device work whose time moves could share).
    /// The extent arenas' old generations forget what they learnt of lifetimes, as a new process would:
    /// the replay frees the blocks a trace never frees (weights) before the next pass, and those frees
    /// would teach their sizes a lifetime that the next run's first blocks of the same size (gradients
    /// of a weight's shape) do not have — on resnet_copy_overlap's third pass that cost 0.005 in ratio.
    pub fn mark_pass(&self) {
        self.classifier.mark_iteration();
        self.extents.forget_lifetimes();
    }

    /// Give back everything cached: blocks held for reuse, empty slab chunks, unused pages and the driver
    /// pool's spare memory. Returns the bytes of reservation released.
    pub fn trim(&self) -> u64 {
        let before = self.reserved_now();
        if self.plan.as_ref().is_some_and(|ps| ps.pins()) {
            // Pinned pages are memory held for the next period: a trim gives them back (the plan is
            // dropped; its pages go now, or when its last live block is freed).
            self.drop_plan();
        }
        self.relieve(true);
        before.saturating_sub(self.reserved_now())
    }

    /// Bytes held from the device now: physical pages of every tier plus the driver pool's reservation.
    pub fn reserved_now(&self) -> u64 {
        let pool = self
            .stream
            .as_ref()
            .and_then(|s| s.stats().pool)
            .map_or(0, |u| u.reserved_current);
        self.pages.stats().bytes_held() + pool
    }

    /// Peak bytes held from the device. With the stream tier in use this is the sum of the page pool's
    /// peak and the driver pool's reserved-high — an upper bound of the true peak (never less).
    pub fn reserved_peak(&self) -> u64 {
        let pool = self
            .stream
            .as_ref()
            .and_then(|s| s.stats().pool)
            .map_or(0, |u| u.reserved_high);
        self.pages.stats().bytes_peak() + pool
    }

    /// Start every peak (live bytes, per-tier live bytes, pages held) again from its current value, as
    /// PyTorch's `reset_peak_memory_stats` does. The driver pool's reserved-high (`mid_tier:stream`) is
    /// the driver's own and is not reset.
    pub fn reset_peaks(&self) {
        self.books.reset_peaks();
        self.pages.reset_peak();
    }

    /// Bytes live (allocated and not freed).
    pub fn allocated(&self) -> u64 {
        self.books.total()
    }

    /// Number of live blocks (allocations minus frees, from the per-thread counts: no table is walked).
    pub fn live_blocks(&self) -> usize {
        self.books
            .counts()
            .iter()
            .map(|&(a, f)| a.saturating_sub(f))
            .sum::<u64>() as usize
    }

    /// The tier and size of a live block, if `ptr` is one.
    pub fn lookup(&self, ptr: u64) -> Option<Block> {
        self.recorded(ptr).map(|m| Block {
            ptr,
            size: m.size,
            tier: m.tier,
        })
    }

    /// A live block with everything the engine knows of it, if `ptr` is one.
    pub fn lookup_detailed(&self, ptr: u64) -> Option<LiveBlock> {
        self.recorded(ptr).map(|m| LiveBlock::of(ptr, &m))
    }

    /// Every live block with its request, stream and tier, in address order.
    pub fn live_detailed(&self) -> Vec<LiveBlock> {
        let mut v: Vec<LiveBlock> = self
            .records()
            .into_iter()
            .map(|(ptr, m)| LiveBlock::of(ptr, &m))
            .collect();
        v.sort_unstable_by_key(|b| b.ptr);
        v
    }

    /// Every live block (address order not guaranteed).
    pub fn live(&self) -> Vec<Block> {
        self.meta
            .snapshot()
            .into_iter()
            .map(|(ptr, m)| Block {
                ptr,
                size: m.size,
                tier: m.tier,
            })
            .collect()
    }

    /// Score the blocks still live as the classifier would at the end of a run (for accuracy reports).
    pub fn finish_classifier(&self) {
        if self.hot.routing != Routing::Generational {
            return; // Nothing was stamped.
        }
        let live = self.records();
        self.classifier
            .finish(live.into_iter().map(|(_, m)| (m.stamp, m.size)));
    }

    fn tier_reserved(&self, tier: Tier) -> (u64, u64) {
        match (tier, &self.stream) {
            (Tier::Extent, _) => {
                let (c, p) = self.extents.reserved();
                let (pc, pp) = self.plan.as_ref().map_or((0, 0), |ps| {
                    let s = ps.stats();
                    (s.committed, s.committed_peak)
                });
                (c + pc, p + pp)
            }
            (Tier::Stream, None) => (0, 0),
            (t, _) => self.tier(t).reserved(),
        }
    }

    fn oom_report(&self, requested: u64) -> OomReport {
        OomReport {
            requested,
            live: self.allocated(),
            reserved: self.reserved_now(),
            tiers: Tier::ALL
                .iter()
                .map(|&t| TierUsage {
                    tier: t.name(),
                    live: self.books.live(t as usize),
                    reserved: self.tier_reserved(t).0,
                })
                .collect(),
            largest_free_extent: self.extents.largest_free_extent(),
            device_free: self.device.mem_info().ok().map(|(f, _)| f),
        }
    }

    /// A snapshot of the engine's statistics.
    pub fn stats(&self) -> PoolStats {
        let pages = self.pages.stats();
        let confusion = self.classifier.confusion();
        // (allocations, frees) per tier, counted by the live-block table under its shard locks.
        let counts = self.books.counts();
        PoolStats {
            // Sleep / wake (crate::sleep).
            asleep: pages.asleep,
            sleeping_bytes: pages.pages_asleep * pages.page_size,
            offloaded_bytes: pages.pages_offloaded * pages.page_size,
            allocated_current: self.allocated(),
            allocated_peak: self.books.total_peak(),
            reserved_current: self.reserved_now(),
            reserved_peak: self.reserved_peak(),
            num_allocs: counts.iter().map(|c| c.0).sum(),
            num_frees: counts.iter().map(|c| c.1).sum(),
            num_ooms: self.ooms.load(Relaxed),
            num_alloc_retries: self.retries.load(Relaxed),
            num_invalid_frees: self.invalid_frees.load(Relaxed),
            cached_bytes: self.deferred_bytes.load(Relaxed)
                + self.tcache.bytes()
                + self.busy_keep.bytes(),
            busy_kept_reuses: self.busy_keep.reuses(),
            page_slack: self.pages.slack(),
            pages,
            tiers: Tier::ALL
                .iter()
                .map(|&t| {
                    let (reserved, reserved_peak) = self.tier_reserved(t);
                    TierStats {
                        tier: t.name(),
                        allocs: counts[t as usize].0,
                        frees: counts[t as usize].1,
                        live_bytes: self.books.live(t as usize),
                        live_peak: self.books.peak(t as usize),
                        reserved,
                        reserved_peak,
                    }
                })
                .collect(),
            classifier_accuracy_count: confusion.accuracy_count(),
            classifier_accuracy_bytes: confusion.accuracy_bytes(),
            confusion_counts: confusion.counts,
            confusion_bytes: confusion.bytes,
            old_generation: self.extents.old_generation(),
            plan: self.plan.as_ref().map_or_else(PlanSummary::default, |ps| {
                let g = ps.stats();
                let s = g.planner;
                PlanSummary {
                    active: s.active,
                    period: s.period,
                    footprint: s.footprint,
                    lower_bound: s.lower_bound,
                    hits: s.hits,
                    misses: s.misses,
                    blocked: s.blocked,
                    outside: s.outside,
                    activations: s.activations,
                    deactivations: s.deactivations,
                    committed: g.committed,
                    recording: s.recording,
                    aborted_recordings: s.aborted_recordings,
                    awake: g.awake,
                    snoozes: g.snoozes,
                }
            }),
        }
    }
}

#[cfg(test)]
mod layout_tests {
    use super::Hot;
    use std::mem::{align_of, offset_of, size_of};

    #[test]
    fn the_per_call_words_take_one_cache_line() {
        assert_eq!(align_of::<Hot>(), 64);
        assert_eq!(size_of::<Hot>(), 64, "stream flags, routing, bounds");
    }

    #[test]
    fn the_references_every_call_follows_share_one_line() {
        use super::Pool;
        let at = offset_of!(Pool, pages);
        assert_eq!(at % 64, 0, "the line starts on a line");
        assert!(
            offset_of!(Pool, slab) - at <= 64,
            "pages, extents, meta, plan server: one line"
        );
    }
}

#[cfg(test)]
mod slab_path_tests {
    use std::sync::Arc;

    use gen_device::sim::SimDevice;
    use gen_device::Device;

    use super::*;

    fn pool() -> Pool {
        let dev = Arc::new(SimDevice::config().capacity(1 << 30).build().unwrap());
        Pool::new(dev as Arc<dyn Device>, Config::default()).unwrap()
    }

    #[test]
    fn the_short_lived_free_gives_what_the_general_path_gave() {
        let p = pool();
        let b = p.alloc(1000, 7, Hint::NONE).unwrap();
        assert_eq!((b.tier, b.size), (Tier::Slab, 1024));
        assert_eq!(p.allocated(), 1024);
        let lb = p.free_owned(b.ptr).unwrap();
        let want = LiveBlock::new(b.ptr, 1024, 1000, Tier::Slab, 7);
        assert_eq!(lb, want);
        assert_eq!(p.allocated(), 0);
        let s = p.stats();
        assert_eq!((s.num_allocs, s.num_frees, s.num_invalid_frees), (1, 1, 0));
    }

    #[test]
    fn a_double_free_racing_itself_is_refused_once() {
        // Two threads free one block at once: the record's swap lets exactly one through (the block may
        // go to that thread's magazine, never to the slab as well); the other is refused as a double
        // free. Afterwards no block is handed out twice.
        let p = std::sync::Arc::new(pool());
        let rounds = if cfg!(miri) { 4 } else { 400 };
        for _ in 0..rounds {
            let b = p.alloc(1000, 0, Hint::NONE).unwrap();
            let both = std::sync::Arc::new(std::sync::Barrier::new(2));
            let hs: Vec<_> = (0..2)
                .map(|_| {
                    let (p, both) = (p.clone(), both.clone());
                    std::thread::spawn(move || {
                        both.wait();
                        p.free(b.ptr, 0)
                    })
                })
                .collect();
            let rs: Vec<_> = hs.into_iter().map(|h| h.join().unwrap()).collect();
            assert_eq!(rs.iter().filter(|r| r.is_ok()).count(), 1, "{rs:?}");
            assert!(rs.iter().any(|r| matches!(
                r,
                Err(GenpoolError::InvalidFree {
                    fault: FreeFault::DoubleFree,
                    ..
                })
            )));
        }
        assert_eq!(p.stats().num_invalid_frees, rounds);
        let live: Vec<u64> = (0..64)
            .map(|_| p.alloc(1000, 0, Hint::NONE).unwrap().ptr)
            .collect();
        let distinct: std::collections::HashSet<_> = live.iter().collect();
        assert_eq!(distinct.len(), live.len());
        for ptr in live {
            p.free(ptr, 0).unwrap();
        }
        assert_eq!(p.allocated(), 0);
    }
}
