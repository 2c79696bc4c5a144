//! The engine: classify, route, serve from a tier's cache or the tier, and keep the books.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};

use gen_buddy::{Buddy, BuddyConfig, BuddyError};
use gen_classifier::{Classifier, ClassifierConfig, Features, Lifetime};
use gen_device::{Device, StreamId};
use gen_extent::{ExtentArena, ExtentConfig, ExtentError};
use gen_plan::{Decision, PlanConfig, Planner, Ticket};
use gen_slab::{Slab, SlabConfig, SlabError};
use gen_stream::{StreamCache, StreamCacheConfig, StreamPool, StreamPoolConfig};
use gen_vmm::{PagePool, PagePoolConfig, PageTally, Region, VmmError};

use crate::config::{Config, LongTier, MidTier, Routing};
use crate::error::{FreeFault, GenpoolError, OomReport, Result, TierUsage};
use crate::meta::{Meta, MetaTable, Removed};
use crate::stats::{PlanSummary, PoolStats, TierStats};

/// Every block is aligned to (and sized in multiples of) this many bytes, as PyTorch's allocator does.
pub const ALIGN: u64 = 512;

/// The tiers of the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[repr(u8)]
pub enum Tier {
    /// Short-lived small blocks: size classes over chunks, lock-free free lists.
    Slab = 0,
    /// Large short/mid-lived blocks: best-fit coalescing over page-mapped VA.
    Extent = 1,
    /// Mid-lived blocks through the driver's stream-ordered pool.
    Stream = 2,
    /// Long-lived blocks: exact-fit buddy.
    Buddy = 3,
}

impl Tier {
    /// All tiers, in index order.
    pub const ALL: [Tier; 4] = [Tier::Slab, Tier::Extent, Tier::Stream, Tier::Buddy];
    /// The tier's name.
    pub fn name(self) -> &'static str {
        match self {
            Tier::Slab => "slab",
            Tier::Extent => "extent",
            Tier::Stream => "stream",
            Tier::Buddy => "buddy",
        }
    }
}

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
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LiveBlock {
    /// Device address.
    pub ptr: u64,
    /// Bytes it spans (the request rounded up to [`ALIGN`]).
    pub size: u64,
    /// Bytes asked for.
    pub requested: u64,
    /// The tier that serves it.
    pub tier: Tier,
    /// The stream it was allocated for.
    pub stream: StreamId,
}

impl LiveBlock {
    fn of(ptr: u64, m: &Meta) -> Self {
        LiveBlock {
            ptr,
            size: m.size,
            requested: m.size - u64::from(m.slack),
            tier: m.tier,
            stream: m.stream,
        }
    }
}

#[derive(Default)]
struct TierCounters {
    live: AtomicU64,
    live_peak: AtomicU64,
}

/// One device's generational pool. `Send + Sync`: allocate and free from any thread.
///
/// `repr(C)`, in this order: the per-call words ([`Hot`]), the classifier (whose own per-call fields lead
/// it), then one cache line of the references every call follows (page pool, extent arenas, metadata
/// table, plan, the planner's window clock), then the tiers. Rust's default order (by alignment) put
/// these references on three or four lines of a ~5.7 KB struct.
#[repr(C)]
pub struct Pool {
    /// The words every call reads or writes outside its tier, in two cache lines.
    hot: Hot,
    classifier: Classifier,
    // One line (64 bytes): what the hot paths dereference next.
    pages: Arc<PagePool>,
    /// The extent arenas: one, or one per predicted generation (short, mid, long) with
    /// `extent_generations`. Their address ranges are disjoint; a block is freed to the one owning it.
    extents: Box<[ExtentArena]>,
    meta: MetaTable,
    /// Periodic plans for large blocks (see `Config::plan`): the planner and the range it serves from.
    plan: Option<Box<PlanTier>>,
    /// Large allocations counted by `Pool::planner_awake`, page moves at its last check, its verdict.
    plan_clock: AtomicU64,
    /// Windows in a row with no page moved and no plan in use.
    plan_quiet: AtomicU64,
    // The rest.
    slab: Slab,
    device: Arc<dyn Device>,
    cfg: Config,
    buddy: Buddy,
    stream: Option<StreamPool>,
    extent_cache: StreamCache,
    buddy_cache: StreamCache,
    ooms: AtomicU64,
    retries: AtomicU64,
    invalid_frees: AtomicU64,
    /// See `Pool::mark_iteration`.
    iterations: parking_lot::Mutex<IterationClock>,
    plan_steals: AtomicU64,
    /// Windows in a row the planner was awake with nothing to show: no period recorded, packed, ready
    /// or served (see `Pool::planner_awake`).
    plan_fruitless: AtomicU64,
    /// Windows left to sleep after giving up, whatever moves; the next give-up's length; give-ups.
    plan_snooze: AtomicU64,
    plan_backoff: AtomicU64,
    plan_snoozes: AtomicU64,
    /// With `Config::stream_arenas`: the extent arenas of streams after the first.
    stream_arenas: Option<Box<StreamArenas>>,
}

/// Streams after the first that get an extent arena of their own (see `Config::stream_arenas`).
const STREAM_ARENAS: usize = 4;

/// VA of a stream's own arena, in multiples of the device's memory (the first stream's arena has eight:
/// streams after the first carry little in the programs measured — a prefetched batch, a serving
/// request — and each arena's page table costs host memory in proportion).
const STREAM_ARENA_VA: u64 = 2;

const STREAM_ARENA_NAMES: [&str; STREAM_ARENAS] = [
    "gen-extent/stream-1",
    "gen-extent/stream-2",
    "gen-extent/stream-3",
    "gen-extent/stream-4",
];

/// The extent arenas of streams after the first (`Config::stream_arenas`). A slot's arena is made at its
/// stream's first large allocation and kept; only that stream allocates from it, so a block it frees on
/// that stream goes straight back (stream order), as in the one-stream case. Streams past the slots share
/// `shared`, whose frees always go through the stream caches.
struct StreamArenas {
    /// The stream each slot belongs to (`NO_STREAM`: free), published once the slot's arena is set.
    ids: [AtomicU64; STREAM_ARENAS],
    arenas: [OnceLock<ExtentArena>; STREAM_ARENAS],
    shared: OnceLock<ExtentArena>,
    /// Serializes slot claims (once per stream).
    claim: parking_lot::Mutex<()>,
    va_bytes: u64,
    placement_candidates: usize,
}

impl StreamArenas {
    /// The arena `stream` allocates from, made on its first use. Out of line: one stream never calls it.
    #[inline(never)]
    fn arena(&self, pages: &Arc<PagePool>, stream: StreamId) -> Result<&ExtentArena, ExtentError> {
        if let Some(a) = self.find(stream) {
            return Ok(a);
        }
        let _g = self.claim.lock();
        if let Some(a) = self.find(stream) {
            return Ok(a);
        }
        let cfg = |name| ExtentConfig {
            va_bytes: self.va_bytes,
            placement_candidates: self.placement_candidates,
            name,
        };
        if let Some(i) = self.ids.iter().position(|id| id.load(Relaxed) == NO_STREAM) {
            let a = ExtentArena::new(pages, cfg(STREAM_ARENA_NAMES[i]))?;
            if self.arenas[i].set(a).is_err() {
                unreachable!("a free slot has no arena");
            }
            self.ids[i].store(stream, Ordering::Release);
            return Ok(self.arenas[i].get().expect("just set"));
        }
        if let Some(a) = self.shared.get() {
            return Ok(a);
        }
        let a = ExtentArena::new(pages, cfg("gen-extent/streams"))?;
        Ok(self.shared.get_or_init(|| a))
    }

    fn find(&self, stream: StreamId) -> Option<&ExtentArena> {
        let i = self
            .ids
            .iter()
            .position(|id| id.load(Ordering::Acquire) == stream)?;
        self.arenas[i].get()
    }

    /// Every arena made so far, with the one stream that allocates from it (`None`: shared).
    fn all(&self) -> impl Iterator<Item = (&ExtentArena, Option<StreamId>)> {
        self.arenas
            .iter()
            .zip(&self.ids)
            .filter_map(|(a, id)| a.get().map(|a| (a, Some(id.load(Ordering::Acquire)))))
            .chain(self.shared.get().map(|a| (a, None)))
    }
}

/// What every allocation and free reads or writes outside its tier, packed into two cache lines. Inside
/// PyTorch the allocator's lines are mostly cold between calls (kernel launches and the interpreter run in
/// between), so each distinct line a call touches costs a miss: spread over the pool's fields (Rust lays
/// them out by size, not by use) these words took ~4-5 lines a call; here they take two.
#[repr(C, align(64))]
struct Hot {
    /// Live bytes in all tiers, and their peak.
    live: AtomicU64,
    live_peak: AtomicU64,
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
    /// Whether freed extent and buddy blocks go through the exact-size stream caches by configuration.
    caching: bool,
    /// Whether the stream-ordered tier exists.
    has_stream: bool,
    /// A second stream has been seen: buddy frees, and extent frees other than a stream's own into its
    /// own arena (`Config::stream_arenas`), then go through the stream caches, whose event-guarded
    /// migration keeps a block freed on S from reaching T before S's work is done.
    multi_stream: AtomicBool,
    /// Per tier (the second line).
    tiers: [TierCounters; 4],
}

const NO_STREAM: u64 = u64::MAX;

/// Large allocations in a row with no free in between after which the planner's slots are not used, at
/// least (see `Pool::plan_alloc`: the limit is the longest such run of the recorded period, when longer).
const PLAN_BURST: u64 = 8;

/// Large allocations between the planner's wake-up checks (see `Pool::planner_awake`).
const PLAN_WAKE_WINDOW: u64 = 1024;

/// Quiet windows (no page moved, no plan in use) after which the planner sleeps.
const PLAN_QUIET_WINDOWS: u64 = 4;

/// Awake windows in a row with no period found after which the planner gives up for a while even though
/// pages move (random shapes: no period to plan). A period of up to `plan_max_period` (8 192) large
/// allocations is confirmed after about that many plus 2 048 more, ten windows at most.
const PLAN_GIVE_UP_WINDOWS: u64 = 24;

/// Windows the planner sleeps after its first give-up; each give-up in a row doubles it, up to
/// [`PLAN_SNOOZE_MAX`]. A period found resets it.
const PLAN_SNOOZE_FIRST: u64 = 32;
const PLAN_SNOOZE_MAX: u64 = 512;

/// Iteration marks that only start the move-budget clock (see `Pool::mark_iteration`).
const WARM_ITERATIONS: u64 = 3;

/// How much the page headroom grows at a time for an iteration that spent just over its move budget
/// (see `Pool::mark_iteration`); up to [`SLACK_STEPS_MAX`] times that when it spent that many budgets.
const SLACK_STEP: f64 = 0.005;
const SLACK_STEPS_MAX: f64 = 4.0;

/// The move-budget clock of `Pool::mark_iteration`.
#[derive(Default)]
struct IterationClock {
    marks: u64,
    last: Option<std::time::Instant>,
    move_ns: u64,
}

/// The planner and its address range. Planned blocks commit their pages as the extent arena's do (a page
/// referenced by a live block is mapped; a free one stays mapped where the next period's block will
/// revive it unless another commit takes it first), so the plan never holds memory beyond what its live
/// blocks touch. (Pinning the pages to the plan instead removed the page moves but cost memory whenever
/// the arena had to serve unplanned blocks beside it: docs/ARCHITECTURE.md, "Periodic plans".)
struct PlanTier {
    inner: parking_lot::Mutex<PlanInner>,
    region: Region,
}

struct PlanInner {
    planner: Planner,
    /// Pages referenced by live planned blocks (per-block mode).
    tally: PageTally,
    /// `plan_pin`: one bit per page of the range, mapped once and kept while the plan lives.
    pinned: Option<Vec<u64>>,
    pinned_pages: u64,
    peak_pages: u64,
    /// Page moves of the whole pool counted at the ready plan's previous activation point (one period
    /// ago), to measure the moves of the last period.
    moves_at_phase: Option<u64>,
    /// Consecutive periods, up to now, that moved enough pages to serve the plan.
    moving_periods: u32,
}

impl PlanInner {
    /// Pages the plan holds now.
    fn pages(&self) -> u64 {
        if self.pinned.is_some() {
            self.pinned_pages
        } else {
            self.tally.pages()
        }
    }

    /// `plan_pin`: give every pinned page of `region` back to the page pool.
    fn unpin(&mut self, region: &Region) {
        let page = region.pool().page_size();
        if let Some(bits) = self.pinned.as_mut() {
            for (w, word) in bits.iter_mut().enumerate() {
                let taken = std::mem::take(word);
                for b in 0..64 {
                    if taken & (1 << b) != 0 {
                        region.decommit((w as u64 * 64 + b) * page, page);
                    }
                }
            }
            self.pinned_pages = 0;
        }
    }

    /// `plan_pin`, the plan going away: keep references only on the pages that live planned blocks touch
    /// (accounted per block from now on, as without pinning) and give every other pinned page back to the
    /// pool at once, for the tiers to use.
    fn unpin_to_blocks(&mut self, region: &Region) {
        if self.pinned.is_none() {
            return;
        }
        let live = self.planner.live_ranges();
        for (k, &(off, len)) in live.iter().enumerate() {
            // Every page of a live planned block is pinned: this only takes references.
            if let Err(e) = region.commit(off, len, true) {
                log::error!("genpool: keeping a planned block's pages: {e}");
                for &(o, l) in &live[..k] {
                    region.decommit(o, l);
                    self.tally.remove(o, l);
                }
                return;
            }
            self.tally.add(off, len);
        }
        self.unpin(region);
        self.pinned = None;
    }

    /// Hand a planned slot back to the planner (it will not be used), releasing pinned pages when that
    /// was the last block of a dropped plan; the block goes to the tiers.
    fn give_back(&mut self, region: &Region, ticket: Ticket) -> Decision {
        if self.planner.on_free(ticket) {
            self.unpin(region);
        }
        Decision::Unplanned {
            ticket: Ticket::NONE,
        }
    }
}

impl Drop for PlanTier {
    fn drop(&mut self) {
        // The engine is going away: drop the plan's page references so the region unmaps cleanly.
        let g = self.inner.get_mut();
        if g.pinned.is_some() {
            g.unpin(&self.region);
        } else {
            for (off, len) in g.planner.live_ranges() {
                self.region.decommit(off, len);
            }
        }
    }
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("device", &self.device.props().name)
            .field("cfg", &self.cfg)
            .finish()
    }
}

fn tier_err(e: impl std::fmt::Display) -> GenpoolError {
    GenpoolError::Device(gen_device::DeviceError::InvalidArgument {
        call: "tier",
        detail: e.to_string(),
    })
}

/// The outcome of one tier attempt, normalised across tiers.
enum Attempt {
    Ok(u64, Tier),
    WouldGrow,
    Oom,
    Err(GenpoolError),
}

impl From<VmmError> for Attempt {
    fn from(e: VmmError) -> Self {
        match e {
            VmmError::WouldGrow { .. } => Attempt::WouldGrow,
            VmmError::OutOfMemory { .. } => Attempt::Oom,
            VmmError::Device(d) if d.is_oom() => Attempt::Oom,
            VmmError::Device(d) => Attempt::Err(GenpoolError::Device(d)),
            other => Attempt::Err(tier_err(other)),
        }
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
            VmmError::Device(d) => GenpoolError::Device(d),
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
        )
        .map_err(tier_err)?;
        // VA is free (the GPU's space is 2^48 bytes and more): give the extent arena eight times the
        // device's memory, so that however its address space fragments, a request that the pages can hold
        // always finds a free extent (with 2× a random-size workload failed a 0.4 GiB request on a 0.5 GiB
        // device with 0.45 GiB free — found by tests/prop.rs).
        // Whole pages of VA, `times` the device's memory.
        let va_of = |times: u64| props.total_mem.saturating_mul(times).div_ceil(page).max(1) * page;
        let extent_va = va_of(8);
        let names: &[&'static str] = if cfg.extent_generations {
            &["gen-extent/short", "gen-extent/mid", "gen-extent/long"]
        } else {
            &["gen-extent"]
        };
        let extents = names
            .iter()
            .map(|&name| {
                ExtentArena::new(
                    &pages,
                    ExtentConfig {
                        va_bytes: extent_va,
                        placement_candidates: cfg.placement_candidates,
                        name,
                    },
                )
                .map_err(tier_err)
            })
            .collect::<Result<Box<[_]>>>()?;
        let buddy = Buddy::new(&pages, BuddyConfig::default()).map_err(tier_err)?;
        let stream_arenas = cfg.stream_arenas.then(|| {
            Box::new(StreamArenas {
                ids: std::array::from_fn(|_| AtomicU64::new(NO_STREAM)),
                arenas: std::array::from_fn(|_| OnceLock::new()),
                shared: OnceLock::new(),
                claim: parking_lot::Mutex::new(()),
                va_bytes: va_of(STREAM_ARENA_VA),
                placement_candidates: cfg.placement_candidates,
            })
        });
        let plan = if cfg.plan {
            // A plan can never map more than the device holds.
            let va = va_of(1);
            Some(Box::new(PlanTier {
                inner: parking_lot::Mutex::new(PlanInner {
                    planner: Planner::new(PlanConfig {
                        max_period: cfg.plan_max_period,
                        background: cfg.plan_background,
                        ..PlanConfig::default()
                    }),
                    tally: PageTally::dense(page, va / page),
                    pinned: cfg
                        .plan_pin
                        .then(|| vec![0; (va / page).div_ceil(64) as usize]),
                    pinned_pages: 0,
                    peak_pages: 0,
                    moves_at_phase: None,
                    moving_periods: 0,
                }),
                region: Region::new(&pages, va, "gen-plan").map_err(tier_err)?,
            }))
        } else {
            None
        };
        let stream = if props.supports_pools && cfg.mid_tier == MidTier::Stream {
            Some(
                StreamPool::new(
                    device.clone(),
                    StreamPoolConfig {
                        release_threshold: cfg.pool_release_threshold,
                        ..StreamPoolConfig::default()
                    },
                )
                .map_err(tier_err)?,
            )
        } else {
            None
        };
        let cache_cfg = StreamCacheConfig {
            max_cached_bytes: cfg.cache_max_bytes,
            ..StreamCacheConfig::default()
        };
        let hot = Hot {
            live: AtomicU64::new(0),
            live_peak: AtomicU64::new(0),
            solo_stream: AtomicU64::new(NO_STREAM),
            large_since_free: AtomicU64::new(0),
            max_size: props.total_mem,
            slab_max: slab.max_size(),
            ordinal: props.ordinal as u32,
            routing: cfg.routing,
            long_tier: cfg.long_tier,
            use_site: cfg.use_site,
            caching: cfg.cache_max_bytes > 0,
            has_stream: stream.is_some(),
            multi_stream: AtomicBool::new(false),
            tiers: Default::default(),
        };
        Ok(Pool {
            extent_cache: StreamCache::new(device.clone(), cache_cfg.clone()),
            buddy_cache: StreamCache::new(device.clone(), cache_cfg),
            hot,
            device,
            cfg,
            pages,
            classifier,
            slab,
            extents,
            buddy,
            plan,
            stream,
            meta: MetaTable::new(),
            ooms: AtomicU64::new(0),
            retries: AtomicU64::new(0),
            invalid_frees: AtomicU64::new(0),
            iterations: parking_lot::Mutex::new(IterationClock::default()),
            plan_clock: AtomicU64::new(0),
            plan_steals: AtomicU64::new(0),
            plan_quiet: AtomicU64::new(0),
            plan_fruitless: AtomicU64::new(0),
            plan_snooze: AtomicU64::new(0),
            plan_backoff: AtomicU64::new(PLAN_SNOOZE_FIRST),
            plan_snoozes: AtomicU64::new(0),
            stream_arenas,
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
            // One stream: the page pool may move pages still in use by aliasing them (stream order).
            self.pages.set_fence_stream(Some(stream));
            return;
        }
        if self.hot.solo_stream.load(Relaxed) != stream
            && !self.hot.multi_stream.swap(true, Ordering::SeqCst)
        {
            self.pages.set_fence_stream(None);
            match self.device.synchronize() {
                Ok(()) => self.pages.synchronized(),
                Err(e) => log::error!("genpool: synchronize on a second stream's first use: {e}"),
            }
            // Plans serve one stream: stop handing out planned slots (the range goes once drained).
            self.drop_plan();
        }
    }

    /// Whether freed extent/buddy blocks go through the stream caches now.
    #[inline]
    fn caching_now(&self) -> bool {
        self.hot.caching || self.hot.multi_stream.load(Ordering::SeqCst)
    }

    fn route(&self, size: u64, class: Lifetime) -> Tier {
        let small = size <= self.hot.slab_max;
        match (self.hot.routing, class) {
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
        // Sleep / wake (crate::sleep): refused before a tier could hand out memory of pages it holds.
        if self.pages.is_asleep() {
            return Err(GenpoolError::Asleep);
        }
        let requested = size;
        let size = size.div_ceil(ALIGN) * ALIGN;
        self.note_stream(stream);
        let features = Features {
            size,
            stream,
            device: self.hot.ordinal,
            site: if self.hot.use_site { hint.site } else { None },
            hint: hint.lifetime,
        };
        let stamp = self.classifier.on_alloc(&features);
        let class = stamp.predicted();
        let tier = self.route(size, class);
        let (mut planned, mut ticket) = (None, Ticket::NONE);
        // The planner sees every large allocation (by size, not by prediction, so the sequence it learns
        // does not change as the classifier learns); a planned slot overrides the route: the plan knows
        // the block's lifetime from the last period.
        if size > self.hot.slab_max && !self.hot.multi_stream.load(Ordering::Acquire) {
            // A heuristic count: a plain load and store (no locked instruction); a race between two
            // threads' large allocations loses one count, which no decision depends on exactly.
            let run = self.hot.large_since_free.load(Relaxed);
            self.hot.large_since_free.store(run + 1, Relaxed);
            if let Some(pt) = self.plan.as_ref().filter(|pt| self.planner_awake(pt)) {
                match self.plan_alloc(pt, size, run) {
                    Decision::Planned { offset, ticket: t } => {
                        planned = Some(pt.region.base() + offset);
                        ticket = t;
                    }
                    Decision::Unplanned { ticket: t } => ticket = t,
                }
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
                    self.classifier.on_free(&stamp, size);
                    self.plan_free(ticket, None);
                    return Err(e);
                }
            },
        };
        self.meta.insert(
            ptr,
            Meta {
                size,
                tier,
                stamp,
                ticket,
                stream,
                // < ALIGN: the rounding above.
                slack: (size - requested) as u16,
            },
        );
        let t = &self.hot.tiers[tier as usize];
        let tl = t.live.fetch_add(size, Relaxed) + size;
        // Peaks rarely move in a loop's steady state: a plain load keeps the line shared and skips a
        // locked instruction.
        if tl > t.live_peak.load(Relaxed) {
            t.live_peak.fetch_max(tl, Relaxed);
        }
        let live = self.hot.live.fetch_add(size, Relaxed) + size;
        if live > self.hot.live_peak.load(Relaxed) {
            self.hot.live_peak.fetch_max(live, Relaxed);
        }
        Ok(Block { ptr, size, tier })
    }

    fn alloc_in(
        &self,
        tier: Tier,
        class: Lifetime,
        size: u64,
        stream: StreamId,
    ) -> Result<(u64, Tier)> {
        // Hot path: a cached block of exactly this size, safe on this stream.
        let cached = match tier {
            _ if !self.caching_now() => None,
            Tier::Extent => self.extent_cache.take(size, stream),
            Tier::Buddy => self.buddy_cache.take(size, stream),
            _ => None,
        };
        if let Some(p) = cached {
            return Ok((p, tier));
        }
        // 1. By default without growing the page pool: a free page mapped elsewhere is moved rather than
        //    a new one created, and cached blocks are given back before the pool grows. With `page_slack`
        //    (and no cached blocks) the page pool itself chooses: create within the headroom, else move.
        let caches_hold_pages = self.caching_now()
            && self.extent_cache.cached_bytes() + self.buddy_cache.cached_bytes() > 0;
        let grow_first = self.pages.slack() > 0.0 && !caches_hold_pages;
        match self.attempt(tier, class, size, stream, grow_first) {
            Attempt::Ok(p, t) => return Ok((p, t)),
            Attempt::Err(e) => return Err(e),
            Attempt::WouldGrow | Attempt::Oom => {}
        }
        // 2. Give cached blocks back to their tiers, largest first, a growing amount at a time, so that
        //    their pages can serve this request; stop as soon as it fits. A partial drain keeps the
        //    small, hot sizes cached and the layout of the rest stable (no page churn).
        let mut want = size.max(self.pages.page_size());
        loop {
            let cached = self.extent_cache.cached_bytes() + self.buddy_cache.cached_bytes();
            if cached == 0 {
                break;
            }
            if self.drain_caches(want) == 0 {
                // What is cached cannot be made safe now (its streams are busy): grow instead.
                break;
            }
            match self.attempt(tier, class, size, stream, false) {
                Attempt::Ok(p, t) => return Ok((p, t)),
                Attempt::Err(e) => return Err(e),
                Attempt::WouldGrow | Attempt::Oom => want = want.saturating_mul(2),
            }
        }
        // 3. Empty slab chunks, then grow.
        if let Err(e) = self.slab.reclaim() {
            log::error!("genpool: slab reclaim: {e}");
        }
        for grow in [false, true] {
            match self.attempt(tier, class, size, stream, grow) {
                Attempt::Ok(p, t) => return Ok((p, t)),
                Attempt::Err(e) => return Err(e),
                Attempt::WouldGrow => continue,
                Attempt::Oom => break,
            }
        }
        // 4. Release everything releasable (a plan's range too, once its blocks are gone) and retry once;
        //    then out of memory.
        self.retries.fetch_add(1, Relaxed);
        self.drop_plan();
        self.relieve(true);
        match self.attempt(tier, class, size, stream, true) {
            Attempt::Ok(p, t) => Ok((p, t)),
            Attempt::Err(e) => Err(e),
            Attempt::WouldGrow | Attempt::Oom => {
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

    /// Return at least `bytes` of cached blocks (largest first; `u64::MAX` = all) to their tiers, the
    /// extent arena's first, each made safe first (its freeing stream synchronized). Returns the bytes
    /// returned.
    fn drain_caches(&self, bytes: u64) -> u64 {
        let mut done = 0u64;
        let caches: [(&StreamCache, &dyn Fn(u64)); 2] = [
            (&self.extent_cache, &|p| {
                if let Err(e) = self.extent_free(p) {
                    log::error!("genpool: returning a cached block to the extent arena: {e}");
                }
            }),
            (&self.buddy_cache, &|p| {
                if let Err(e) = self.buddy.free(p) {
                    log::error!("genpool: returning a cached block to the buddy: {e}");
                }
            }),
        ];
        for (cache, free) in caches {
            if done >= bytes {
                break;
            }
            match cache.drain_at_least(bytes - done, &mut |p, _| free(p)) {
                Ok(n) => done += n,
                Err(e) => log::error!("genpool: draining a stream cache: {e}"),
            }
        }
        done
    }

    /// Whether the planner should see this large allocation. After [`PLAN_QUIET_WINDOWS`] windows of
    /// [`PLAN_WAKE_WINDOW`] large allocations in which the tiers moved no page and no plan was in use it
    /// sleeps, costing one counter increment per large allocation (a plan could only cost memory there:
    /// ResNet-50's layout repeats in place); the first window that moves a page wakes it. Falling asleep
    /// drops a period being recorded or packed and a ready plan (`Planner::pause`): they need every
    /// allocation, and one that never moved a page would not be served anyway. (Recording used to keep
    /// the planner awake, and on a loop whose period it kept re-recording — ResNet-50 in the simulator —
    /// that cost ~0.4 µs per large allocation for hundreds of iterations.) And where pages move but no
    /// period shows up in [`PLAN_GIVE_UP_WINDOWS`] awake windows (random shapes: GPT-2 medium's, ~0.25 µs
    /// per large allocation for nothing) it gives up for [`PLAN_SNOOZE_FIRST`] windows, doubling with each
    /// give-up in a row, then looks again.
    fn planner_awake(&self, pt: &PlanTier) -> bool {
        // A window clock: a plain load and store (no locked instruction on every large allocation); a
        // race can repeat or skip one count, moving a window check by one allocation.
        let n = self.plan_clock.load(Relaxed);
        self.plan_clock.store(n.wrapping_add(1), Relaxed);
        if n % PLAN_WAKE_WINDOW == 0 {
            let steals = self.pages.stats().steals;
            let moving = steals > self.plan_steals.swap(steals, Relaxed);
            let snooze = self.plan_snooze.load(Relaxed);
            if snooze > 0 {
                // Given up for a while: wake when it is over, to look for a period again.
                self.plan_snooze.store(snooze - 1, Relaxed);
                if snooze == 1 {
                    self.plan_quiet.store(0, Relaxed);
                }
                return false;
            }
            let awake = self.plan_quiet.load(Relaxed) < PLAN_QUIET_WINDOWS;
            // With `plan_min_moves:0` plans are served without waiting for moves, so a period being
            // recorded or packed, or a ready plan, keeps the planner awake to follow the sequence to the
            // plan's activation point.
            let mut g = pt.inner.lock();
            let s = g.planner.stats();
            let serving = s.active || s.planned_live > 0;
            let has_period = s.recording || s.period > 0;
            let busy = serving || (self.cfg.plan_min_moves == 0.0 && has_period);
            // Awake while pages move but no period shows up (random shapes): after a while the planner
            // costs more than it can win; it gives up for a growing number of windows.
            if serving || has_period {
                self.plan_fruitless.store(0, Relaxed);
                self.plan_backoff.store(PLAN_SNOOZE_FIRST, Relaxed);
            } else if awake && self.plan_fruitless.fetch_add(1, Relaxed) + 1 >= PLAN_GIVE_UP_WINDOWS
            {
                self.plan_fruitless.store(0, Relaxed);
                let backoff = self.plan_backoff.load(Relaxed);
                self.plan_backoff
                    .store((backoff * 2).min(PLAN_SNOOZE_MAX), Relaxed);
                self.plan_snooze.store(backoff, Relaxed);
                self.plan_snoozes.fetch_add(1, Relaxed);
                self.plan_quiet.store(PLAN_QUIET_WINDOWS, Relaxed);
                g.planner.pause();
                return false;
            }
            if moving || busy {
                self.plan_quiet.store(0, Relaxed);
            } else if self.plan_quiet.fetch_add(1, Relaxed) + 1 == PLAN_QUIET_WINDOWS {
                g.planner.pause();
            }
        }
        self.plan_quiet.load(Relaxed) < PLAN_QUIET_WINDOWS
    }

    /// One large-block allocation through the planner: the plan's slot (its pages committed), or where
    /// the tiers should serve it. `run`: large allocations since the last free. A run longer than any in
    /// the recorded period — state being built (weights, optimizer moments), which would squat on a
    /// planned slot for good — is not planned; a forward pass's own runs (GPT-2: dozens) are.
    fn plan_alloc(&self, pt: &PlanTier, size: u64, run: u64) -> Decision {
        let mut g = pt.inner.lock();
        g.planner.note_run(run);
        let misses = g.planner.misses();
        let d = g.planner.on_alloc(size);
        if g.pinned_pages > 0 && g.planner.misses() > misses {
            // The sequence left the plan (a new phase of the program): every allocation it does not
            // cover would grow the tiers beside pages pinned for blocks that may not come. Drop the plan
            // and give its idle pages back now; a new plan is learnt if the sequence repeats again.
            g.planner.deactivate();
            g.unpin_to_blocks(&pt.region);
        }
        // Longer than any run of the recorded period (and than PLAN_BURST): state being built.
        let burst = run >= g.planner.max_run().map_or(0, |m| m + 1).max(PLAN_BURST);
        if g.planner.take_release() {
            g.unpin(&pt.region);
        }
        if let Some(footprint) = g.planner.wants_activation() {
            // A plan exists to stop page moves: serve it only once two whole periods in a row have each
            // moved at least `plan_min_moves` (1/200) of its footprint (one period of moves is a
            // transient: a new phase settling). Where the tiers' layout already repeats in place
            // (ResNet-50) the plan stays ready and unused, costing neither memory nor moves.
            let min_moves = self.cfg.plan_min_moves;
            let moves = self.pages.stats().steals;
            let moved = g.moves_at_phase.replace(moves).map(|m| moves - m);
            let moving = moved.is_some_and(|m| {
                (m * self.pages.page_size()) as f64 >= min_moves * footprint as f64
            });
            g.moving_periods = if moving { g.moving_periods + 1 } else { 0 };
            if min_moves == 0.0 || g.moving_periods >= 2 {
                g.planner.activate();
                if self.cfg.plan_pin && g.pinned.is_none() && g.tally.pages() == 0 {
                    // Pinned again after a dropped plan's blocks are all gone.
                    let n = (pt.region.len() / self.pages.page_size()).div_ceil(64) as usize;
                    g.pinned = Some(vec![0; n]);
                }
            }
        }
        match d {
            Decision::Planned { ticket, .. } if burst => g.give_back(&pt.region, ticket),
            Decision::Planned { offset, ticket } => {
                let mapped = if g.pinned.is_some() {
                    self.pin(pt, &mut g, offset, size)
                } else {
                    pt.region
                        .commit(offset, size, true)
                        .map(|()| g.tally.add(offset, size))
                };
                match mapped {
                    Ok(()) => {
                        g.peak_pages = g.peak_pages.max(g.pages());
                        d
                    }
                    Err(e) => {
                        // No page for it now: give the slot back; the tiers' out-of-memory path takes
                        // over.
                        log::debug!("genpool: planned slot not mapped: {e}");
                        g.give_back(&pt.region, ticket)
                    }
                }
            }
            other => other,
        }
    }

    /// `plan_pin`: map (once) the pages of `[offset, offset + size)` that the plan has not pinned yet.
    fn pin(
        &self,
        pt: &PlanTier,
        g: &mut PlanInner,
        offset: u64,
        size: u64,
    ) -> std::result::Result<(), VmmError> {
        let page = self.pages.page_size();
        let (first, last) = (offset / page, (offset + size - 1) / page);
        let Some(bits) = g.pinned.as_mut() else {
            return Ok(());
        };
        let pinned = |bits: &Vec<u64>, p: u64| bits[(p / 64) as usize] & (1 << (p % 64)) != 0;
        let mut p = first;
        while p <= last {
            if pinned(bits, p) {
                p += 1;
                continue;
            }
            let mut q = p;
            while q < last && !pinned(bits, q + 1) {
                q += 1;
            }
            pt.region.commit(p * page, (q - p + 1) * page, true)?;
            for x in p..=q {
                bits[(x / 64) as usize] |= 1 << (x % 64);
            }
            g.pinned_pages += q - p + 1;
            p = q + 1;
        }
        Ok(())
    }

    /// Tell the planner a block it tracks is gone; a planned block's pages are decommitted.
    fn plan_free(&self, ticket: Ticket, range: Option<(u64, u64)>) {
        if !ticket.is_tracked() {
            return;
        }
        if let Some(pt) = &self.plan {
            let mut g = pt.inner.lock();
            if let (Some((ptr, size)), None) = (range, &g.pinned) {
                let off = ptr - pt.region.base();
                pt.region.decommit(off, size);
                g.tally.remove(off, size);
            }
            if g.planner.on_free(ticket) {
                g.unpin(&pt.region);
            }
        }
    }

    /// Stop serving from the plan (its live blocks keep their slots until freed; pinned pages go back
    /// once none is live).
    fn drop_plan(&self) {
        if let Some(pt) = &self.plan {
            let mut g = pt.inner.lock();
            if g.planner.deactivate() {
                g.unpin(&pt.region);
            } else {
                g.unpin_to_blocks(&pt.region);
            }
        }
    }

    /// The extent arena for blocks predicted `class`.
    #[inline]
    fn extent_for(&self, class: Lifetime) -> &ExtentArena {
        let i = match class {
            Lifetime::Short => 0,
            Lifetime::Mid => 1,
            Lifetime::Long => 2,
        };
        &self.extents[i.min(self.extents.len() - 1)]
    }

    /// Every extent arena: the first stream's (or the generations'), then the stream arenas made so far.
    fn extent_arenas(&self) -> impl Iterator<Item = &ExtentArena> {
        self.extents.iter().chain(
            self.stream_arenas
                .iter()
                .flat_map(|s| s.all().map(|(a, _)| a)),
        )
    }

    /// The arena an extent block of `class` allocated on `stream` comes from: with several streams and
    /// stream arenas, the stream's own (made on first use) unless it is the first stream.
    #[inline]
    fn extent_arena(
        &self,
        class: Lifetime,
        stream: StreamId,
    ) -> std::result::Result<&ExtentArena, ExtentError> {
        // One stream (the common case): decided from the hot line alone, the pool's tail not read.
        if stream == self.hot.solo_stream.load(Relaxed) {
            return Ok(self.extent_for(class));
        }
        match &self.stream_arenas {
            Some(sa) => sa.arena(&self.pages, stream),
            None => Ok(self.extent_for(class)),
        }
    }

    /// Free an extent block to the arena whose address range holds it.
    fn extent_free(&self, ptr: u64) -> std::result::Result<u64, ExtentError> {
        // The first stream's arena (or the generations') first: the stream arenas are not looked at (a
        // cache line of the pool's tail) unless the block is theirs.
        if let Some(a) = self.extents.iter().find(|a| a.owns(ptr)) {
            return a.free(ptr);
        }
        match self
            .stream_arenas
            .as_ref()
            .and_then(|sa| sa.all().find(|(a, _)| a.owns(ptr)))
        {
            Some((a, _)) => a.free(ptr),
            None => Err(ExtentError::InvalidFree { ptr }),
        }
    }

    /// With several streams and stream arenas: the arena holding `ptr` if `stream` is the one stream that
    /// allocates from it (a free there may go straight back). Out of line: one stream never calls it.
    #[inline(never)]
    fn own_extent_arena(&self, ptr: u64, stream: StreamId) -> Option<&ExtentArena> {
        let sa = self.stream_arenas.as_ref()?;
        if stream == self.hot.solo_stream.load(Relaxed) {
            return self.extents.iter().find(|a| a.owns(ptr));
        }
        sa.all()
            .find(|&(a, home)| home == Some(stream) && a.owns(ptr))
            .map(|(a, _)| a)
    }

    fn attempt(
        &self,
        tier: Tier,
        class: Lifetime,
        size: u64,
        stream: StreamId,
        grow: bool,
    ) -> Attempt {
        match tier {
            Tier::Slab => match self.slab.alloc(size, stream, grow) {
                Ok(p) => Attempt::Ok(p, Tier::Slab),
                Err(SlabError::WouldGrow { .. }) => Attempt::WouldGrow,
                Err(SlabError::Vmm(e)) => e.into(),
                // A size class out of address space: the extent arena serves any size.
                Err(SlabError::ClassFull { .. }) => {
                    self.attempt(Tier::Extent, class, size, stream, grow)
                }
                Err(e) => Attempt::Err(tier_err(e)),
            },
            Tier::Extent => match self
                .extent_arena(class, stream)
                .and_then(|a| a.alloc(size, grow))
            {
                Ok(p) => Attempt::Ok(p, Tier::Extent),
                Err(ExtentError::WouldGrow { .. }) => Attempt::WouldGrow,
                Err(ExtentError::Vmm(e)) => e.into(),
                Err(e @ ExtentError::OutOfAddressSpace { .. }) => {
                    log::warn!("genpool: {e}");
                    Attempt::Oom
                }
                Err(e) => Attempt::Err(tier_err(e)),
            },
            Tier::Buddy => match self.buddy.alloc(size, grow) {
                Ok(p) => Attempt::Ok(p, Tier::Buddy),
                Err(BuddyError::WouldGrow { .. }) => Attempt::WouldGrow,
                Err(BuddyError::Vmm(e)) => e.into(),
                Err(e) => Attempt::Err(tier_err(e)),
            },
            Tier::Stream => {
                let sp = self
                    .stream
                    .as_ref()
                    .expect("stream tier routed only when present");
                match sp.alloc(size, stream) {
                    Ok(p) => Attempt::Ok(p, Tier::Stream),
                    Err(gen_stream::StreamError::Device(d)) if d.is_oom() => Attempt::Oom,
                    Err(e) => Attempt::Err(tier_err(e)),
                }
            }
        }
    }

    /// Give back everything cached: blocks to their tiers (streams synchronized as needed), empty slab
    /// chunks, the driver pool's spare memory, empty regions, and unused pages to the driver.
    fn relieve(&self, hard: bool) {
        self.drain_caches(u64::MAX);
        if let Err(e) = self.slab.reclaim() {
            log::error!("genpool: slab reclaim: {e}");
        }
        if hard {
            if let Some(sp) = &self.stream {
                if let Err(e) = sp.trim(0) {
                    log::error!("genpool: trimming the stream pool: {e}");
                }
            }
            for a in self.extent_arenas() {
                a.trim();
            }
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
        self.free_in(ptr, Some(stream)).map(|b| b.size)
    }

    /// Free a block on the stream it was allocated for (PyTorch's rule: a tensor's memory is reusable on
    /// its allocation stream at once; other streams are ordered through `record_stream`). Returns what
    /// the block was. Refusals as [`free`](Self::free).
    pub fn free_owned(&self, ptr: u64) -> Result<LiveBlock> {
        self.free_in(ptr, None)
    }

    fn free_in(&self, ptr: u64, stream: Option<StreamId>) -> Result<LiveBlock> {
        if ptr == 0 {
            self.invalid_frees.fetch_add(1, Relaxed);
            return Err(GenpoolError::InvalidFree {
                ptr,
                fault: FreeFault::Null,
            });
        }
        let meta = match self.meta.remove(ptr) {
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
        if self.hot.large_since_free.load(Relaxed) != 0 {
            self.hot.large_since_free.store(0, Relaxed);
        }
        self.note_stream(stream);
        self.classifier.on_free(&meta.stamp, size);
        let res = match meta.tier {
            Tier::Slab => self.slab.free(ptr, stream).map(|_| ()).map_err(tier_err),
            Tier::Extent if meta.ticket.is_planned() => {
                // Served from the plan's range: the slot is free again once the planner knows. Only one
                // stream ever allocates planned slots (see `note_stream`), so stream order makes the
                // reuse safe, as for a tier.
                self.plan_free(meta.ticket, Some((ptr, size)));
                Ok(())
            }
            Tier::Extent => {
                self.plan_free(meta.ticket, None);
                // Several streams: back to the arena that only `stream` allocates from, when the block is
                // there — stream order makes its reuse safe at once, as with one stream (no cache holding
                // the block's pages). One stream: `cache_or_free` frees straight back anyway.
                let own = if self.hot.multi_stream.load(Ordering::Acquire) && !self.hot.caching {
                    self.own_extent_arena(ptr, stream)
                } else {
                    None
                };
                match own {
                    Some(a) => a.free(ptr).map(|_| ()).map_err(tier_err),
                    None => self.cache_or_free(&self.extent_cache, ptr, size, stream, |p| {
                        self.extent_free(p).map(|_| ()).map_err(tier_err)
                    }),
                }
            }
            Tier::Buddy => self.cache_or_free(&self.buddy_cache, ptr, size, stream, |p| {
                self.buddy.free(p).map(|_| ()).map_err(tier_err)
            }),
            Tier::Stream => {
                let sp = self
                    .stream
                    .as_ref()
                    .expect("stream tier present for its blocks");
                sp.free(ptr, stream).map(|_| ()).map_err(tier_err)
            }
        };
        if let Err(e) = res {
            // The tier refused a block our table said was live: an internal inconsistency. Keep the
            // block recorded (nothing is lost) and report it.
            self.meta.restore(ptr, meta);
            return Err(e);
        }
        self.hot.tiers[meta.tier as usize]
            .live
            .fetch_sub(size, Relaxed);
        self.hot.live.fetch_sub(size, Relaxed);
        Ok(LiveBlock::of(ptr, &meta))
    }

    fn cache_or_free(
        &self,
        cache: &StreamCache,
        ptr: u64,
        size: u64,
        stream: StreamId,
        free: impl FnOnce(u64) -> Result<()>,
    ) -> Result<()> {
        if !self.caching_now() {
            return free(ptr);
        }
        match cache.put(ptr, size, stream) {
            Ok(()) => Ok(()),
            Err(_) if self.hot.multi_stream.load(Ordering::SeqCst) => {
                // Over the cache's bound, but the tier could hand the block to another stream while work
                // queued on `stream` still uses it: keep it cached (past the bound) until a drain makes it
                // safe, rather than block this free on the stream.
                cache.put_over_bound(ptr, size, stream);
                Ok(())
            }
            // One stream: stream order makes the tier's reuse safe.
            Err(_) => free(ptr),
        }
    }

    /// A training iteration ended (an explicit period mark): the classifier learns the period, and the
    /// page pool's headroom grows (up to `page_slack_max`) when the iteration spent more than
    /// `move_budget` of its wall time moving pages — by half a percent per budget spent, at most two
    /// percent at a time, and not while a plan is recorded or ready to take the moves over. The first
    /// [`WARM_ITERATIONS`] marks only start the clock (warm-up lays everything out once).
    pub fn mark_iteration(&self) {
        self.classifier.mark_iteration();
        let now = std::time::Instant::now();
        let move_ns = self.pages.stats().move_ns;
        let mut it = self.iterations.lock();
        it.marks += 1;
        if let Some(last) = it.last.filter(|_| it.marks > WARM_ITERATIONS) {
            let spent = move_ns.saturating_sub(it.move_ns) as f64;
            let elapsed = now.duration_since(last).as_nanos() as f64;
            let slack = self.pages.slack();
            let budget = self.cfg.move_budget * elapsed;
            // A plan being recorded, or ready and waiting for moves to prove it is needed, fixes them
            // itself (GPT-2: it activates a few iterations later and moves stop): headroom bought
            // meanwhile would be held for nothing.
            let plan_pending = self.plan.as_ref().is_some_and(|pt| {
                let s = pt.inner.lock().planner.stats();
                s.recording || (s.period > 0 && !s.active)
            });
            if spent > budget && slack < self.cfg.page_slack_max && !plan_pending {
                let step = SLACK_STEP * (spent / budget).min(SLACK_STEPS_MAX);
                let grown = (slack + step).min(self.cfg.page_slack_max);
                self.pages.set_slack(grown);
                log::debug!(
                    "genpool: page moves took {:.1} % of an iteration: page headroom {:.3} -> {grown:.3}",
                    100.0 * spent / elapsed,
                    slack
                );
            }
        }
        it.last = Some(now);
        it.move_ns = move_ns;
    }

    /// A replay pass begins (a whole recorded run, not one iteration of it): the classifier takes it as a
    /// period mark; the move budget does not (a replay has no device work whose time moves could share).
    pub fn mark_pass(&self) {
        self.classifier.mark_iteration();
    }

    /// Give back everything cached: blocks held for reuse, empty slab chunks, unused pages and the driver
    /// pool's spare memory. Returns the bytes of reservation released.
    pub fn trim(&self) -> u64 {
        let before = self.reserved_now();
        if self.cfg.plan_pin {
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
        self.hot
            .live_peak
            .store(self.hot.live.load(Relaxed), Relaxed);
        for t in self.hot.tiers.iter() {
            t.live_peak.store(t.live.load(Relaxed), Relaxed);
        }
        self.pages.reset_peak();
    }

    /// Counters of the extent arena's and the buddy's front caches.
    pub fn cache_stats(&self) -> [gen_stream::StreamCacheStats; 2] {
        [self.extent_cache.stats(), self.buddy_cache.stats()]
    }

    /// Bytes live (allocated and not freed).
    pub fn allocated(&self) -> u64 {
        self.hot.live.load(Relaxed)
    }

    /// Number of live blocks.
    pub fn live_blocks(&self) -> usize {
        self.meta.len()
    }

    /// The tier and size of a live block, if `ptr` is one.
    pub fn lookup(&self, ptr: u64) -> Option<Block> {
        self.meta.get(ptr).map(|m| Block {
            ptr,
            size: m.size,
            tier: m.tier,
        })
    }

    /// A live block with everything the engine knows of it, if `ptr` is one.
    pub fn lookup_detailed(&self, ptr: u64) -> Option<LiveBlock> {
        self.meta.get(ptr).map(|m| LiveBlock::of(ptr, &m))
    }

    /// Every live block with its request, stream and tier, in address order.
    pub fn live_detailed(&self) -> Vec<LiveBlock> {
        let mut v: Vec<LiveBlock> = self
            .meta
            .snapshot()
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
        let live = self.meta.snapshot();
        self.classifier
            .finish(live.into_iter().map(|(_, m)| (m.stamp, m.size)));
    }

    fn tier_reserved(&self, tier: Tier) -> (u64, u64) {
        match tier {
            Tier::Slab => {
                let s = self.slab.stats();
                (s.committed_bytes, s.peak_committed_bytes)
            }
            Tier::Extent => {
                // Per-arena peaks occur at different moments: their sum bounds the tier's peak.
                let (c, p) = self
                    .extent_arenas()
                    .map(|a| a.stats())
                    .fold((0, 0), |(c, p), s| {
                        (c + s.committed_bytes, p + s.peak_committed_bytes)
                    });
                let (pc, pp) = self.plan.as_ref().map_or((0, 0), |pt| {
                    let g = pt.inner.lock();
                    let page = self.pages.page_size();
                    (g.pages() * page, g.peak_pages * page)
                });
                (c + pc, p + pp)
            }
            Tier::Buddy => {
                let s = self.buddy.stats();
                (s.committed_bytes, s.peak_committed_bytes)
            }
            Tier::Stream => self
                .stream
                .as_ref()
                .and_then(|s| s.stats().pool)
                .map_or((0, 0), |u| (u.reserved_current, u.reserved_high)),
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
                    live: self.hot.tiers[t as usize].live.load(Relaxed),
                    reserved: self.tier_reserved(t).0,
                })
                .collect(),
            largest_free_extent: self
                .extent_arenas()
                .map(|a| a.stats().largest_free_extent)
                .max()
                .unwrap_or(0),
            device_free: self.device.mem_info().ok().map(|(f, _)| f),
        }
    }

    /// A snapshot of the engine's statistics.
    pub fn stats(&self) -> PoolStats {
        let pages = self.pages.stats();
        let confusion = self.classifier.confusion();
        // (allocations, frees) per tier, counted by the live-block table under its shard locks.
        let counts = self.meta.counts();
        PoolStats {
            // Sleep / wake (crate::sleep).
            asleep: pages.asleep,
            sleeping_bytes: pages.pages_asleep * pages.page_size,
            offloaded_bytes: pages.pages_offloaded * pages.page_size,
            allocated_current: self.allocated(),
            allocated_peak: self.hot.live_peak.load(Relaxed),
            reserved_current: self.reserved_now(),
            reserved_peak: self.reserved_peak(),
            num_allocs: counts.iter().map(|c| c.0).sum(),
            num_frees: counts.iter().map(|c| c.1).sum(),
            num_ooms: self.ooms.load(Relaxed),
            num_alloc_retries: self.retries.load(Relaxed),
            num_invalid_frees: self.invalid_frees.load(Relaxed),
            cached_bytes: self.extent_cache.cached_bytes() + self.buddy_cache.cached_bytes(),
            page_slack: self.pages.slack(),
            pages,
            tiers: Tier::ALL
                .iter()
                .map(|&t| {
                    let c = &self.hot.tiers[t as usize];
                    let (reserved, reserved_peak) = self.tier_reserved(t);
                    TierStats {
                        tier: t.name(),
                        allocs: counts[t as usize].0,
                        frees: counts[t as usize].1,
                        live_bytes: c.live.load(Relaxed),
                        live_peak: c.live_peak.load(Relaxed),
                        reserved,
                        reserved_peak,
                    }
                })
                .collect(),
            classifier_accuracy_count: confusion.accuracy_count(),
            classifier_accuracy_bytes: confusion.accuracy_bytes(),
            confusion_counts: confusion.counts,
            confusion_bytes: confusion.bytes,
            plan: self.plan.as_ref().map_or_else(PlanSummary::default, |pt| {
                let g = pt.inner.lock();
                let s = g.planner.stats();
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
                    committed: g.pages() * self.pages.page_size(),
                    recording: s.recording,
                    aborted_recordings: s.aborted_recordings,
                    awake: self.plan_quiet.load(Relaxed) < PLAN_QUIET_WINDOWS,
                    snoozes: self.plan_snoozes.load(Relaxed),
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
    fn the_per_call_words_take_two_cache_lines() {
        assert_eq!(align_of::<Hot>(), 64);
        assert_eq!(
            offset_of!(Hot, tiers),
            64,
            "line 0: counters, stream flags, routing"
        );
        assert_eq!(size_of::<Hot>(), 128, "line 1: the per-tier counters");
    }

    #[test]
    fn the_references_every_call_follows_share_one_line() {
        use super::Pool;
        let at = offset_of!(Pool, pages);
        assert_eq!(at % 64, 0, "the line starts on a line");
        assert_eq!(
            offset_of!(Pool, slab) - at,
            64,
            "pages, extents, meta, plan, plan clocks: one line"
        );
    }
}
