//! What the genpool engine does over one trace, op by op: the data behind `genpool report --html`.
//!
//! [`record_timeline`] replays a trace once through a [`genpool::Pool`] on the simulated device and
//! records
//!
//! - **buckets** of `every` ops: over each, the lowest and the highest of the tiers' total live and
//!   reserved bytes (`Pool::stats` after every op) and of the trace's live bytes, with each tier's share
//!   at the op where the total was highest — so a chart of the buckets shows every peak exactly;
//! - **lifetime histograms**: each freed allocation's lifetime in allocations (allocs between its
//!   alloc and its free), bucketed by log2, split by the class the engine's classifier assigns that
//!   lifetime (short, mid, long against its horizons); blocks never freed are counted apart;
//! - the classifier's **confusion matrix** (predicted × actual, counts and bytes) after the run;
//! - **waste by size**: each growth of the engine's peak reservation is charged to the size of the
//!   allocation that caused it; at the end, a size's net waste is what was charged to it minus its live
//!   bytes at the moment of the peak (negative for a size that lived in memory other sizes had grown).
//!   The net wastes of all sizes add up to peak reserved − live at peak: the sizes with the largest are
//!   kept as rows, the others summed into [`Timeline::waste_other`].

use std::collections::HashMap;
use std::sync::Arc;

use gen_trace::{EventKind, ReplayAllocator, ReplayError, Trace};
use genpool::replay::EngineReplay;

use crate::AnalyzeError;

/// Number of log2 lifetime buckets: bucket 0 holds lifetime 0, bucket `k` lifetimes in
/// `[2^(k-1), 2^k)`.
pub const LIFETIME_BUCKETS: usize = 41;

/// Class names, in the index order of the classifier (`gen_classifier::Lifetime::index`).
pub const CLASSES: [&str; 3] = ["short", "mid", "long"];

/// One bucket of ops: the engine's state over the ops after the previous bucket's last, up to `op`.
/// The first bucket is the empty pool at op 0.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Sample {
    /// The bucket's last op (ops replayed so far; the x axis).
    pub op: u64,
    /// Live bytes per tier, in [`Timeline::tiers`] order, at the bucket's op where the tiers' total
    /// live bytes were highest (their sum is that highest total).
    pub live: Vec<u64>,
    /// Reserved bytes per tier at the bucket's op where the tiers' total reservation was highest.
    pub reserved: Vec<u64>,
    /// The lowest total live bytes (all tiers) over the bucket.
    pub live_min: u64,
    /// The lowest total reserved bytes (all tiers) over the bucket.
    pub reserved_min: u64,
    /// The lowest live bytes of the trace over the bucket.
    pub trace_live_min: u64,
    /// The highest live bytes of the trace over the bucket (the physical floor's peak).
    pub trace_live_max: u64,
    /// The most bytes the engine held from the device (all tiers and cached pages) over the bucket.
    pub engine_reserved: u64,
}

impl Sample {
    /// The highest total live bytes over the bucket.
    pub fn live_max(&self) -> u64 {
        self.live.iter().sum()
    }

    /// The highest total reserved bytes over the bucket.
    pub fn reserved_max(&self) -> u64 {
        self.reserved.iter().sum()
    }
}

/// The bucket being filled by [`record_timeline`].
struct Bucket(Option<Sample>);

impl Bucket {
    /// Adds the state after one op.
    fn add(&mut self, st: &genpool::PoolStats, trace_live: u64) {
        let live: u64 = st.tiers.iter().map(|t| t.live_bytes).sum();
        let reserved: u64 = st.tiers.iter().map(|t| t.reserved).sum();
        let per = |f: fn(&genpool::TierStats) -> u64| st.tiers.iter().map(f).collect::<Vec<_>>();
        match &mut self.0 {
            None => {
                self.0 = Some(Sample {
                    op: 0,
                    live: per(|t| t.live_bytes),
                    reserved: per(|t| t.reserved),
                    live_min: live,
                    reserved_min: reserved,
                    trace_live_min: trace_live,
                    trace_live_max: trace_live,
                    engine_reserved: st.reserved_current,
                })
            }
            Some(b) => {
                if live > b.live_max() {
                    b.live = per(|t| t.live_bytes);
                }
                if reserved > b.reserved_max() {
                    b.reserved = per(|t| t.reserved);
                }
                b.live_min = b.live_min.min(live);
                b.reserved_min = b.reserved_min.min(reserved);
                b.trace_live_min = b.trace_live_min.min(trace_live);
                b.trace_live_max = b.trace_live_max.max(trace_live);
                b.engine_reserved = b.engine_reserved.max(st.reserved_current);
            }
        }
    }

    /// The bucket ending at `op`, emptied for the next.
    fn take(&mut self, op: u64) -> Option<Sample> {
        self.0.take().map(|mut b| {
            b.op = op;
            b
        })
    }
}

/// One request size's share of the peak reservation.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct SizeWaste {
    /// Request size in bytes.
    pub size: u64,
    /// Allocations of this size.
    pub allocs: u64,
    /// Growth of the peak reservation charged to allocations of this size.
    pub charged: u64,
    /// Live bytes of this size when the reservation peaked.
    pub live_at_peak: u64,
}

impl SizeWaste {
    /// `charged − live_at_peak` (negative when this size rode on memory others had grown).
    pub fn waste(&self) -> i64 {
        self.charged as i64 - self.live_at_peak as i64
    }
}

/// Everything [`record_timeline`] measured on one trace.
#[derive(Clone, Debug, PartialEq)]
pub struct Timeline {
    /// Trace name.
    pub trace: String,
    /// Alloc + free events.
    pub ops: u64,
    /// Ops per bucket.
    pub every: u64,
    /// Tier names.
    pub tiers: Vec<&'static str>,
    /// Buckets, in op order; the first is the empty pool at op 0, the last ends at the last op.
    pub samples: Vec<Sample>,
    /// Highest live bytes of the trace.
    pub peak_live: u64,
    /// The engine's peak reservation.
    pub peak_reserved: u64,
    /// Ops replayed when the peak reservation was reached.
    pub peak_op: u64,
    /// Live bytes of the trace at that moment.
    pub live_at_peak: u64,
    /// Freed allocations per (actual class, log2 lifetime bucket).
    pub lifetimes: [[u64; LIFETIME_BUCKETS]; 3],
    /// Bytes of those allocations, same indexing.
    pub lifetime_bytes: [[u64; LIFETIME_BUCKETS]; 3],
    /// Allocations never freed.
    pub never_freed: u64,
    /// Classifier confusion matrix, counts, `[predicted][actual]`.
    pub confusion_counts: [[u64; 3]; 3],
    /// Classifier confusion matrix, bytes, `[predicted][actual]`.
    pub confusion_bytes: [[u64; 3]; 3],
    /// Sizes by net waste, largest first (at most [`Timeline::WASTE_ROWS`], only positive ones).
    pub waste: Vec<SizeWaste>,
    /// The net waste of every size not in [`Timeline::waste`], summed (negative when those sizes lived
    /// in memory the listed ones had grown).
    pub waste_other: i64,
    /// Growth of the peak reservation charged to no allocation (0 unless the engine's reservation
    /// peaked during a free). The rows, `waste_other` and this add up to [`Timeline::waste_total`].
    pub waste_uncharged: i64,
}

impl Timeline {
    /// Rows kept in [`Timeline::waste`].
    pub const WASTE_ROWS: usize = 12;

    /// Peak reserved − live bytes at that moment: what the waste rows add up to.
    pub fn waste_total(&self) -> i64 {
        self.peak_reserved as i64 - self.live_at_peak as i64
    }

    /// `peak_reserved / peak_live` (`None` on a trace without allocations).
    pub fn ratio(&self) -> Option<f64> {
        (self.peak_live > 0).then(|| self.peak_reserved as f64 / self.peak_live as f64)
    }
}

/// The log2 bucket of a lifetime (see [`LIFETIME_BUCKETS`]).
pub fn lifetime_bucket(lifetime: u64) -> usize {
    ((u64::BITS - lifetime.leading_zeros()) as usize).min(LIFETIME_BUCKETS - 1)
}

/// Target number of buckets when the caller leaves their width to [`record_timeline`].
pub const DEFAULT_SAMPLES: u64 = 1200;

/// Replays `trace` once through a fresh engine with `cfg` on the simulated device and records a
/// [`Timeline`] (see the module docs). `every` = ops per bucket (`None`: about [`DEFAULT_SAMPLES`]
/// buckets in all). `progress(done)` is called with the ops replayed so far, every
/// `every` ops and once at the end.
pub fn record_timeline(
    trace: &Trace,
    cfg: genpool::Config,
    every: Option<u64>,
    progress: &mut dyn FnMut(u64),
) -> Result<Timeline, AnalyzeError> {
    let dev = gen_device::sim::SimConfig::new()
        .capacity(crate::SIM_CAPACITY)
        .build()
        .map_err(|e| AnalyzeError::Engine(e.to_string()))?;
    let pool =
        genpool::Pool::new(Arc::new(dev), cfg).map_err(|e| AnalyzeError::Engine(e.to_string()))?;
    let mut eng = EngineReplay::new(pool, "genpool");
    let ops = trace.ops();
    let every = every
        .unwrap_or_else(|| ops.div_ceil(DEFAULT_SAMPLES))
        .max(1);
    let err = |op: usize, source: ReplayError| AnalyzeError::Replay {
        trace: trace.name.clone(),
        strategy: "genpool",
        source: ReplayError::Op {
            pass: 1,
            op,
            source: Box::new(source),
        },
    };

    // Trace address → (engine pointer, alloc clock, byte clock, size, stream).
    let mut live: HashMap<u64, (u64, u64, u64, u64, u64)> = HashMap::new();
    // Size → (allocs, charged, live now).
    let mut by_size: HashMap<u64, (u64, u64, u64)> = HashMap::new();
    let (mut clock, mut byte_clock, mut trace_live) = (0u64, 0u64, 0u64);
    let (mut peak_live, mut peak, mut peak_op) = (0u64, 0u64, 0u64);
    let mut lifetimes = [[0u64; LIFETIME_BUCKETS]; 3];
    let mut lifetime_bytes = [[0u64; LIFETIME_BUCKETS]; 3];
    let mut samples = Vec::with_capacity((ops / every) as usize + 2);
    let mut bucket = Bucket(None);
    bucket.add(&eng.pool().stats(), 0);
    samples.extend(bucket.take(0));
    for (i, e) in trace.events.iter().enumerate() {
        match e.kind {
            EventKind::Alloc => {
                let site = (e.site != 0).then_some(e.site);
                let ptr = eng.alloc(e.size, e.stream, site).map_err(|s| err(i, s))?;
                clock += 1;
                byte_clock += e.size;
                if live
                    .insert(e.addr, (ptr, clock, byte_clock, e.size, e.stream))
                    .is_some()
                {
                    return Err(err(
                        i,
                        ReplayError::InvalidTrace {
                            event: i,
                            message: format!("allocation at live address {:#x}", e.addr),
                        },
                    ));
                }
                trace_live += e.size;
                peak_live = peak_live.max(trace_live);
                let s = by_size.entry(e.size).or_default();
                s.0 += 1;
                s.2 += e.size;
                let now = eng.peak_reserved();
                if now > peak {
                    s.1 += now - peak;
                    peak = now;
                    peak_op = i as u64 + 1;
                }
            }
            EventKind::Free => {
                // A free carries its allocation's size and stream, as in `gen_trace::ReplayPlan`.
                let Some((ptr, at, bytes_at, size, stream)) = live.remove(&e.addr) else {
                    return Err(err(
                        i,
                        ReplayError::InvalidTrace {
                            event: i,
                            message: format!("free of {:#x}, which is not live", e.addr),
                        },
                    ));
                };
                eng.free(ptr, size, stream).map_err(|s| err(i, s))?;
                let (lt, lb) = (clock - at, byte_clock - bytes_at);
                let class = eng.pool().classifier().classify(lt, lb).index();
                let b = lifetime_bucket(lt);
                lifetimes[class][b] += 1;
                lifetime_bytes[class][b] += size;
                trace_live -= size;
                if let Some(s) = by_size.get_mut(&size) {
                    s.2 -= size;
                }
            }
        }
        bucket.add(&eng.pool().stats(), trace_live);
        let done = i as u64 + 1;
        if done % every == 0 || done == ops {
            samples.extend(bucket.take(done));
            progress(done);
        }
    }
    let live_at_peak = live_by_size(&trace.events[..peak_op as usize]);
    let pool = eng.pool();
    pool.finish_classifier();
    let st = pool.stats();
    let mut waste: Vec<SizeWaste> = by_size
        .iter()
        .map(|(&size, &(allocs, charged, _))| SizeWaste {
            size,
            allocs,
            charged,
            live_at_peak: live_at_peak.get(&size).copied().unwrap_or(0),
        })
        .collect();
    waste.sort_unstable_by(|a, b| b.waste().cmp(&a.waste()).then(a.size.cmp(&b.size)));
    let all_sizes: i64 = waste.iter().map(SizeWaste::waste).sum();
    let rows = waste
        .iter()
        .take(Timeline::WASTE_ROWS)
        .take_while(|w| w.waste() > 0)
        .count();
    let waste_other = waste[rows..].iter().map(SizeWaste::waste).sum();
    waste.truncate(rows);
    let peak_reserved = peak.max(st.reserved_peak);
    let live_at_peak_total: u64 = live_at_peak.values().sum();
    Ok(Timeline {
        trace: trace.name.clone(),
        ops,
        every,
        tiers: st.tiers.iter().map(|t| t.tier).collect(),
        samples,
        peak_live,
        peak_reserved,
        peak_op,
        live_at_peak: live_at_peak_total,
        lifetimes,
        lifetime_bytes,
        never_freed: live.len() as u64,
        confusion_counts: st.confusion_counts,
        confusion_bytes: st.confusion_bytes,
        waste,
        waste_other,
        waste_uncharged: peak_reserved as i64 - live_at_peak_total as i64 - all_sizes,
    })
}

/// Live bytes per size after `events` (a prefix of a valid trace).
fn live_by_size(events: &[gen_trace::Event]) -> HashMap<u64, u64> {
    let mut sizes: HashMap<u64, u64> = HashMap::new();
    let mut by_size: HashMap<u64, u64> = HashMap::new();
    for e in events {
        match e.kind {
            EventKind::Alloc => {
                sizes.insert(e.addr, e.size);
                *by_size.entry(e.size).or_default() += e.size;
            }
            EventKind::Free => {
                if let Some(size) = sizes.remove(&e.addr) {
                    if let Some(b) = by_size.get_mut(&size) {
                        *b -= size;
                    }
                }
            }
        }
    }
    by_size
}
