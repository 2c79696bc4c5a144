//! Online lifetime classifier: predicts short / mid / long lifetimes and learns from observed frees.
//!
//! # What it sees
//! Only what an allocator receives ([`Features`]): size, device, stream, optionally a call-site tag and
//! an explicit hint, plus the allocation's position in the current iteration (from
//! [`Classifier::mark_iteration`]; with no marks the position plays no part). Two clocks advance on
//! every allocation: the *alloc clock* (allocations so far) and the *byte clock* (bytes allocated so
//! far). A block's lifetime is measured on both, from its allocation to its free, and is
//! [`Short`](Lifetime::Short) if it fits the short [`Horizon`], [`Mid`](Lifetime::Mid) if it fits the
//! mid horizon, [`Long`](Lifetime::Long) otherwise; blocks still live at [`Classifier::finish`] that are
//! older than the short horizon score as Long (they lived for the run).
//!
//! # How it predicts
//! The key is `(size bucket, stream, device, site-or-none, position-in-iteration bucket)`, hashed into a
//! fixed open-addressing table of slots. Each slot holds three class weights in one atomic word; every
//! observation decays them by the forgetting factor and adds one to the observed class, so a key whose
//! behaviour changes flips within about three observations (a *drift event* when the key had history).
//! An unseen key falls back to a coarse key (size bucket only), then to a size prior (large allocations
//! during the first allocations of a run are Long, everything else Short). An explicit hint overrides the
//! prediction; the outcome is still scored and learned. A prediction is two hash mixes, a few probes and
//! a handful of atomic loads; nothing allocates after [`Classifier::new`].
//!
//! # Overdue detection
//! No per-allocation list: each key keeps, per predicted class (Short, Mid), four epoch buckets
//! `(epoch, outstanding count)` where `epoch = alloc clock / horizon`. An allocation predicted Short
//! increments its epoch's bucket; its free decrements it. Whenever the key allocates again, buckets at
//! least two epochs old that still hold outstanding predictions are *overdue* (every such block has lived
//! longer than one horizon, so it cannot be Short any more): they are counted as misses and the key is
//! shifted toward the next longer class right away — before those blocks are ever freed. Their later free
//! is still scored but not learned twice. Reusing a bucket first evicts (and counts) whatever stale
//! epoch it held.
//!
//! # Concurrency
//! All methods take `&self`; state is atomics updated with compare-and-swap (no locks on the prediction
//! path).
//!
//! # No period detection
//! The iteration comes only from marks: the engine marks from `Pool::mark_iteration` (PyTorch's
//! `genpool_torch.step()`) and at each replay pass (`Pool::mark_pass`). The engine's one period detector
//! is gen-plan's (its periodic plans); this crate's own k-gram detector was removed (issue 20): with
//! call sites it bought nothing on the four traces (docs/ARCHITECTURE.md, "Periodic plans").

#![warn(missing_docs)]

mod config;
mod confusion;
mod state;

pub use config::{ClassifierConfig, ClassifierConfigBuilder, ConfigError, Horizon};
pub use confusion::Confusion;

use confusion::AtomicConfusion;
use state::{observe_atomic, EpochBuckets, KeyState};
use std::sync::atomic::{AtomicU64, Ordering};

/// A predicted or observed lifetime class.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Lifetime {
    /// Dies within the short horizon (activations, temporaries).
    Short = 0,
    /// Outlives the short horizon but is freed within the mid horizon (gradients, KV caches, batches).
    Mid = 1,
    /// Lives beyond the mid horizon or for the rest of the run (weights, optimizer state).
    Long = 2,
}

impl Lifetime {
    /// All classes, shortest first.
    pub const ALL: [Lifetime; 3] = [Lifetime::Short, Lifetime::Mid, Lifetime::Long];

    /// 0, 1, 2 for Short, Mid, Long.
    #[inline]
    pub fn index(self) -> usize {
        self as usize
    }

    /// The class of index `i` (0 Short, 1 Mid, anything else Long).
    #[inline]
    pub fn from_index(i: usize) -> Self {
        match i {
            0 => Lifetime::Short,
            1 => Lifetime::Mid,
            _ => Lifetime::Long,
        }
    }

    /// The next longer class (Long stays Long).
    #[inline]
    pub fn longer(self) -> Self {
        Lifetime::from_index(self.index() + 1)
    }
}

/// What the allocator knows about one allocation request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Features {
    /// Requested size in bytes.
    pub size: u64,
    /// Stream handle (0 = default stream).
    pub stream: u64,
    /// Device ordinal.
    pub device: u32,
    /// Call-site tag, when the caller has one (PyTorch's pluggable-allocator hook does not).
    pub site: Option<u64>,
    /// An explicit lifetime hint; overrides the prediction.
    pub hint: Option<Lifetime>,
}

const NO_SLOT: u32 = u32::MAX;
/// One free in this many teaches the coarse size-bucket prior.
const COARSE_SAMPLE: u64 = 4;
const F_SHORT_TRACKED: u8 = 1;
const F_MID_TRACKED: u8 = 2;
/// The allocation is not tracked (see [`ClassifierConfig::sample_every`]): its free teaches nothing.
const F_UNTRACKED: u8 = 4;
/// A free updates `last_free` only when the stored value lags the clock by more than this: the burst
/// prior needs to know that frees happen, not exactly when, and a shared line that every free writes
/// would bounce between threads.
const LAST_FREE_SLACK: u64 = 4;

/// What [`Classifier::on_alloc`] returns and [`Classifier::on_free`] takes back: 24 bytes, `Copy`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stamp {
    slot: u32,
    predicted: Lifetime,
    flags: u8,
    size_class: u16,
    alloc_clock: u64,
    byte_clock: u64,
}

impl Stamp {
    /// A stamp of no allocation (no slot, predicted short, clocks at zero): a filler for containers
    /// that need a value; never passed to [`Classifier::on_free`].
    pub const NONE: Stamp = Stamp {
        slot: NO_SLOT,
        predicted: Lifetime::Short,
        flags: 0,
        size_class: 0,
        alloc_clock: 0,
        byte_clock: 0,
    };

    /// The predicted (or hinted) lifetime.
    #[inline]
    pub fn predicted(&self) -> Lifetime {
        self.predicted
    }
    /// The alloc clock just after this allocation.
    #[inline]
    pub fn alloc_clock(&self) -> u64 {
        self.alloc_clock
    }
    /// The byte clock just after this allocation (0 when no horizon bounds bytes, or untracked).
    #[inline]
    pub fn byte_clock(&self) -> u64 {
        self.byte_clock
    }
    /// Whether this allocation is tracked: its free is measured, scored and learned (see
    /// [`ClassifierConfig::sample_every`]).
    #[inline]
    pub fn is_tracked(&self) -> bool {
        self.flags & F_UNTRACKED == 0
    }
}

/// What a free taught the classifier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// The observed class.
    pub actual: Lifetime,
    /// Allocations made between this block's allocation and its free.
    pub lifetime_allocs: u64,
    /// Bytes allocated between this block's allocation and its free.
    pub lifetime_bytes: u64,
    /// Whether the prediction (or hint) differed from `actual`.
    pub mispredicted: bool,
}

/// Counters describing the classifier's own behaviour.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClassifierStats {
    /// Allocations seen.
    pub allocs: u64,
    /// Frees of tracked allocations (those scored; see [`ClassifierConfig::sample_every`]).
    pub frees: u64,
    /// Keys in the table.
    pub keys: u64,
    /// Allocations whose key found no slot (table full along the probe sequence); they use the prior.
    pub unkeyed: u64,
    /// Allocations predicted Short found still live past the short horizon before being freed.
    pub overdue_short: u64,
    /// Allocations predicted Mid found still live past the mid horizon before being freed.
    pub overdue_mid: u64,
    /// Key corrections made from overdue detections (each shifts the key toward a longer class).
    pub misses_corrected: u64,
    /// Prediction flips of keys with at least `drift_min_obs` observations.
    pub drift_events: u64,
    /// Blocks live at `finish` that were too young to be scored.
    pub censored: u64,
    /// Predictions that came from a hint.
    pub hinted: u64,
}

#[derive(Default)]
struct AtomicStats {
    /// Blocks scored by `finish` (frees = scored − finished).
    finished: AtomicU64,
    keys: AtomicU64,
    unkeyed: AtomicU64,
    overdue_short: AtomicU64,
    overdue_mid: AtomicU64,
    misses_corrected: AtomicU64,
    drift_events: AtomicU64,
    censored: AtomicU64,
    hinted: AtomicU64,
}

#[derive(Default)]
struct Slot {
    key: AtomicU64,
    state: AtomicU64,
    short: EpochBuckets,
    mid: EpochBuckets,
}

/// The splitmix64 finalizer: a fast, well-mixing 64-bit hash step.
#[inline]
pub(crate) fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Size bucket: `sub_bits` sub-buckets per power of two (sizes below `1 << sub_bits` exact). At most 511.
#[inline]
fn size_class(size: u64, sub_bits: u32) -> u16 {
    if size < (1 << sub_bits) {
        return size as u16;
    }
    let log = 63 - size.leading_zeros();
    let sub = (size >> (log - sub_bits)) & ((1 << sub_bits) - 1);
    ((log << sub_bits) as u64 | sub) as u16
}

/// log2 of the epoch length used for a horizon of `allocs` allocations: the horizon rounded up to a power
/// of two, so an allocation two epochs old has certainly lived longer than the horizon.
fn epoch_shift(allocs: u64) -> u32 {
    allocs.max(1).next_power_of_two().trailing_zeros()
}

/// The online lifetime classifier. `Send + Sync`; share it by reference.
#[repr(C, align(64))]
pub struct Classifier {
    // `repr(C)`, in this order: what every allocation and free reads or writes comes in the first two
    // cache lines — the clocks, the key table, and copies of the configuration they consult. Inside
    // PyTorch the classifier's lines are cold between calls, and Rust's own field order (by size) spread
    // these over four or five lines behind the configuration's.
    // Line 0.
    alloc_clock: AtomicU64,
    /// `(phase_buckets << 32) / period` (0 until two marks have given a period): the phase bucket of a
    /// position `pos < period` is `pos * phase_scale >> 32`, a multiply instead of a division per
    /// allocation.
    phase_scale: AtomicU64,
    last_free: AtomicU64,
    period: AtomicU64,
    origin: AtomicU64,
    slots: Box<[Slot]>,
    mask: usize,
    // Line 1: what every allocation reads, then what tracked allocations and frees read.
    byte_clock: AtomicU64,
    use_site: bool,
    /// Whether a horizon bounds bytes (else the byte clock is not kept).
    use_bytes: bool,
    size_sub_bits: u32,
    phase_buckets: u32,
    max_probes: u32,
    track_below: u32,
    /// `sample_every - 1`: an allocation of a warm key is tracked when its hashed clock has these bits 0.
    sample_mask: u64,
    decay_num: u32,
    short_shift: u32,
    mid_shift: u32,
    drift_min_obs: u32,
    // The rest.
    short: Horizon,
    mid: Horizon,
    prior_burst_allocs: u64,
    prior_long_min_size: u64,
    coarse: Box<[AtomicU64]>,
    last_mark: AtomicU64,
    cfg: ClassifierConfig,
    confusion: AtomicConfusion,
    stats: AtomicStats,
}

impl std::fmt::Debug for Classifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Classifier")
            .field("cfg", &self.cfg)
            .field("period", &self.iteration_period())
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl Classifier {
    /// A classifier with all tables allocated up front.
    pub fn new(cfg: ClassifierConfig) -> Self {
        let slots = (0..cfg.capacity).map(|_| Slot::default()).collect();
        let coarse = (0..512).map(|_| AtomicU64::new(0)).collect();
        Self {
            use_site: cfg.use_site,
            size_sub_bits: cfg.size_sub_bits,
            phase_buckets: cfg.phase_buckets,
            max_probes: cfg.max_probes,
            drift_min_obs: cfg.drift_min_obs,
            sample_mask: u64::from(cfg.sample_every.max(1)) - 1,
            track_below: cfg.track_below,
            use_bytes: cfg.short.bytes != u64::MAX || cfg.mid.bytes != u64::MAX,
            short: cfg.short,
            mid: cfg.mid,
            prior_burst_allocs: cfg.prior_burst_allocs,
            prior_long_min_size: cfg.prior_long_min_size,
            decay_num: (cfg.decay * 256.0).round() as u32,
            mask: cfg.capacity - 1,
            slots,
            coarse,
            alloc_clock: AtomicU64::new(0),
            phase_scale: AtomicU64::new(0),
            byte_clock: AtomicU64::new(0),
            period: AtomicU64::new(0),
            origin: AtomicU64::new(0),
            last_mark: AtomicU64::new(u64::MAX),
            last_free: AtomicU64::new(u64::MAX),
            short_shift: epoch_shift(cfg.short.allocs),
            mid_shift: epoch_shift(cfg.mid.allocs),
            confusion: AtomicConfusion::default(),
            stats: AtomicStats::default(),
            cfg,
        }
    }

    /// The configuration in use.
    pub fn config(&self) -> &ClassifierConfig {
        &self.cfg
    }

    /// Classifies an observed lifetime against the horizons.
    pub fn classify(&self, lifetime_allocs: u64, lifetime_bytes: u64) -> Lifetime {
        if self.short.fits(lifetime_allocs, lifetime_bytes) {
            Lifetime::Short
        } else if self.mid.fits(lifetime_allocs, lifetime_bytes) {
            Lifetime::Mid
        } else {
            Lifetime::Long
        }
    }

    fn phase_bucket(&self, clock: u64) -> u64 {
        let scale = self.phase_scale.load(Ordering::Relaxed);
        if scale == 0 {
            return 0;
        }
        let p = self.period.load(Ordering::Relaxed);
        let d = clock.wrapping_sub(self.origin.load(Ordering::Relaxed));
        // Iterations may run longer than the last one: clamp into the last bucket. (A racing mark may
        // store the origin after the clock was read: `d` wraps and clamps too.)
        let pos = d.min(p.saturating_sub(1));
        pos.wrapping_mul(scale) >> 32
    }

    /// Adopt `period` allocations from `origin` (a mark).
    fn set_period(&self, origin: u64, period: u64) {
        let n = u64::from(self.phase_buckets);
        // Positions above 2^32 would overflow the multiply: such periods (billions of allocations an
        // iteration) get no phase.
        let scale = if n > 1 && period > 0 && period < 1 << 32 {
            ((n << 32) / period).max(1)
        } else {
            0
        };
        self.origin.store(origin, Ordering::Relaxed);
        self.period.store(period, Ordering::Relaxed);
        self.phase_scale.store(scale, Ordering::Relaxed);
    }

    /// The slot index of `key` (non-zero), inserting it if absent; `None` when the probe sequence is full.
    fn lookup(&self, key: u64) -> Option<usize> {
        let mut i = key as usize & self.mask;
        for _ in 0..self.max_probes {
            let s = &self.slots[i];
            let k = s.key.load(Ordering::Acquire);
            if k == key {
                return Some(i);
            }
            if k == 0 {
                match s
                    .key
                    .compare_exchange(0, key, Ordering::AcqRel, Ordering::Acquire)
                {
                    Ok(_) => {
                        self.stats.keys.fetch_add(1, Ordering::Relaxed);
                        return Some(i);
                    }
                    Err(k) if k == key => return Some(i),
                    Err(_) => {}
                }
            }
            i = (i + 1) & self.mask;
        }
        None
    }

    fn correct(&self, slot: &Slot, to: Lifetime, taken: u64) {
        if taken == 0 {
            return;
        }
        let ctr = if to == Lifetime::Mid {
            &self.stats.overdue_short
        } else {
            &self.stats.overdue_mid
        };
        ctr.fetch_add(taken, Ordering::Relaxed);
        self.stats.misses_corrected.fetch_add(1, Ordering::Relaxed);
        self.learn_key(slot, to, taken.min(3) as u32);
    }

    fn learn_key(&self, slot: &Slot, c: Lifetime, times: u32) {
        let (old, new) = observe_atomic(&slot.state, c, times, self.decay_num);
        if old.n >= self.drift_min_obs && old.class != new.class {
            self.stats.drift_events.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Predicts the lifetime of a new allocation and advances both clocks. Never allocates.
    pub fn on_alloc(&self, f: &Features) -> Stamp {
        let clock = self.alloc_clock.fetch_add(1, Ordering::Relaxed);
        // The byte clock runs only where a horizon bounds bytes (off by default).
        let bytes = if self.use_bytes {
            self.byte_clock
                .fetch_add(f.size, Ordering::Relaxed)
                .wrapping_add(f.size)
        } else {
            0
        };
        let sc = size_class(f.size, self.size_sub_bits);
        let site = if self.use_site {
            f.site.map_or(0, |s| mix(s ^ 0x5173))
        } else {
            0
        };
        let base = mix(mix((sc as u64) | ((f.device as u64) << 32)) ^ f.stream) ^ site;
        let key = mix(base ^ (self.phase_bucket(clock) << 48)) | 1;
        let Some(i) = self.lookup(key) else {
            self.stats.unkeyed.fetch_add(1, Ordering::Relaxed);
            return self.track(f, clock, bytes, sc, None);
        };
        let slot = &self.slots[i];
        let st = KeyState::unpack(slot.state.load(Ordering::Relaxed));
        // The fast path (most calls): a warm key's prediction is one load. One allocation in
        // `sample_every` (by a hash of the clock, so a loop whose period is a multiple of the rate still
        // samples every key) is tracked: measured, scored and learned.
        let sampled = (clock.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) & self.sample_mask == 0;
        if st.n >= self.track_below && !sampled {
            let predicted = match f.hint {
                Some(h) => h,
                None => st.class,
            };
            return Stamp {
                slot: i as u32,
                predicted,
                flags: F_UNTRACKED,
                size_class: sc,
                alloc_clock: clock.wrapping_add(1),
                byte_clock: bytes,
            };
        }
        self.track(f, clock, bytes, sc, Some(i))
    }

    /// The tracked path of [`on_alloc`](Self::on_alloc): byte clock, overdue sweeps, epoch buckets, priors.
    fn track(
        &self,
        f: &Features,
        clock: u64,
        bytes: u64,
        sc: u16,
        slot_idx: Option<usize>,
    ) -> Stamp {
        let mut learned = None;
        let mut flags = 0;
        let short_epoch = clock >> self.short_shift;
        let mid_epoch = clock >> self.mid_shift;
        let slot = slot_idx.map(|i| &self.slots[i]);
        if let Some(s) = slot {
            self.correct(s, Lifetime::Mid, s.short.sweep(short_epoch));
            self.correct(s, Lifetime::Long, s.mid.sweep(mid_epoch));
            let st = KeyState::unpack(s.state.load(Ordering::Relaxed));
            if st.n > 0 {
                learned = Some(st.class);
            }
        }
        let predicted = match (f.hint, learned) {
            (Some(h), _) => {
                self.stats.hinted.fetch_add(1, Ordering::Relaxed);
                h
            }
            (None, Some(c)) => c,
            (None, None) => {
                let cs = KeyState::unpack(self.coarse[sc as usize].load(Ordering::Relaxed));
                let last_free = self.last_free.load(Ordering::Relaxed);
                let burst = self.prior_burst_allocs != 0
                    && (last_free == u64::MAX
                        || clock.saturating_sub(last_free) >= self.prior_burst_allocs);
                if burst && f.size >= self.prior_long_min_size {
                    Lifetime::Long
                } else if cs.n > 0 {
                    cs.class
                } else {
                    Lifetime::Short
                }
            }
        };
        if let Some(s) = slot {
            let (tracked, taken) = match predicted {
                Lifetime::Short => {
                    let r = s.short.register(short_epoch);
                    self.correct(s, Lifetime::Mid, r.1);
                    (r.0, F_SHORT_TRACKED)
                }
                Lifetime::Mid => {
                    let r = s.mid.register(mid_epoch);
                    self.correct(s, Lifetime::Long, r.1);
                    (r.0, F_MID_TRACKED)
                }
                Lifetime::Long => (false, 0),
            };
            if tracked {
                flags |= taken;
            }
        }
        Stamp {
            slot: slot_idx.map_or(NO_SLOT, |i| i as u32),
            predicted,
            flags,
            size_class: sc,
            alloc_clock: clock.wrapping_add(1),
            byte_clock: bytes,
        }
    }

    /// Learns from a free: measures the lifetime, scores the prediction, updates the key (unless an
    /// overdue sweep already corrected it for this block) and the coarse size bucket of `size`. An
    /// untracked allocation (see [`ClassifierConfig::sample_every`]) teaches nothing: `None`.
    pub fn on_free(&self, s: &Stamp, size: u64) -> Option<Outcome> {
        let now = self.alloc_clock.load(Ordering::Relaxed);
        let last = self.last_free.load(Ordering::Relaxed);
        if last == u64::MAX || now.wrapping_sub(last) > LAST_FREE_SLACK {
            self.last_free.store(now, Ordering::Relaxed);
        }
        if s.flags & F_UNTRACKED != 0 {
            return None;
        }
        let la = now.saturating_sub(s.alloc_clock);
        let lb = self
            .byte_clock
            .load(Ordering::Relaxed)
            .wrapping_sub(s.byte_clock);
        let lb = if lb > 1 << 62 { 0 } else { lb };
        let actual = self.classify(la, lb);
        let mut learn = true;
        if let Some(slot) = self.slots.get(s.slot as usize) {
            let epoch_clock = s.alloc_clock.wrapping_sub(1);
            if s.flags & F_SHORT_TRACKED != 0 {
                learn = slot.short.release(epoch_clock >> self.short_shift);
            } else if s.flags & F_MID_TRACKED != 0 {
                learn = slot.mid.release(epoch_clock >> self.mid_shift);
            }
            if learn {
                self.learn_key(slot, actual, 1);
            }
        }
        // The coarse (size-only) prior learns from one free in COARSE_SAMPLE: it only has to track
        // the class mix of a size bucket, and sampling keeps its shared cache lines mostly read-only.
        if s.alloc_clock % COARSE_SAMPLE == 0 || s.slot == NO_SLOT {
            let sc = size_class(size, self.size_sub_bits);
            observe_atomic(&self.coarse[sc as usize], actual, 1, self.decay_num);
        }
        self.confusion.add(s.predicted, actual, size);
        Some(Outcome {
            actual,
            lifetime_allocs: la,
            lifetime_bytes: lb,
            mispredicted: actual != s.predicted,
        })
    }

    /// Marks the start of a new iteration (e.g. a training step, or a replay pass): the period becomes
    /// the allocation count between the last two marks and the position in the iteration is measured
    /// from the latest mark. Marks are the only source of the phase: until two marks with allocations
    /// between them, every allocation is in phase bucket 0.
    pub fn mark_iteration(&self) {
        let c = self.alloc_clock.load(Ordering::Relaxed);
        let prev = self.last_mark.swap(c, Ordering::Relaxed);
        let period = if prev != u64::MAX && c > prev {
            c - prev
        } else {
            self.period.load(Ordering::Relaxed)
        };
        self.set_period(c, period);
    }

    /// The iteration period in allocations (between the last two marks); `None` while unknown.
    pub fn iteration_period(&self) -> Option<u64> {
        match self.period.load(Ordering::Relaxed) {
            0 => None,
            p => Some(p),
        }
    }

    /// Scores blocks still live at the end of a trace: those older than the short horizon lived for the
    /// run and score as Long; younger ones are counted as censored. Nothing is learned.
    pub fn finish(&self, live: impl Iterator<Item = (Stamp, u64)>) {
        let now = self.alloc_clock.load(Ordering::Relaxed);
        let nowb = self.byte_clock.load(Ordering::Relaxed);
        for (s, size) in live.filter(|(s, _)| s.flags & F_UNTRACKED == 0) {
            let la = now.saturating_sub(s.alloc_clock);
            let lb = nowb.wrapping_sub(s.byte_clock);
            let lb = if lb > 1 << 62 { 0 } else { lb };
            if self.short.fits(la, lb) {
                self.stats.censored.fetch_add(1, Ordering::Relaxed);
            } else {
                self.stats.finished.fetch_add(1, Ordering::Relaxed);
                self.confusion.add(s.predicted, Lifetime::Long, size);
            }
        }
    }

    /// The confusion matrix so far (predicted × actual, counts and bytes).
    pub fn confusion(&self) -> Confusion {
        self.confusion.snapshot()
    }

    /// Counters so far.
    pub fn stats(&self) -> ClassifierStats {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let s = &self.stats;
        ClassifierStats {
            allocs: l(&self.alloc_clock),
            frees: self
                .confusion
                .snapshot()
                .total_count()
                .saturating_sub(l(&s.finished)),
            keys: l(&s.keys),
            unkeyed: l(&s.unkeyed),
            overdue_short: l(&s.overdue_short),
            overdue_mid: l(&s.overdue_mid),
            misses_corrected: l(&s.misses_corrected),
            drift_events: l(&s.drift_events),
            censored: l(&s.censored),
            hinted: l(&s.hinted),
        }
    }
}

#[cfg(test)]
mod tests;
