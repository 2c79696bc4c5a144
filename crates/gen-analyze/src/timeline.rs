//! What the genpool engine does over one trace, op by op: the data behind `genpool report --html`.
//!
//! [`record_timeline`] replays a trace once through a [`genpool::Pool`] on the simulated device and
//! records
//!
//! - **samples**: every `every` ops, each tier's live and reserved bytes (`Pool::stats`), plus the
//!   trace's live bytes; the exact peaks are kept separately, so sampling never hides them;
//! - **lifetime histograms**: each freed allocation's lifetime in allocations (allocs between its
//!   alloc and its free), bucketed by log2, split by the class the engine's classifier assigns that
//!   lifetime (short, mid, long against its horizons); blocks never freed are counted apart;
//! - the classifier's **confusion matrix** (predicted × actual, counts and bytes) after the run;
//! - **waste by size**: each growth of the engine's peak reservation is charged to the size of the
//!   allocation that caused it; at the end, a size's waste is what was charged to it minus its live
//!   bytes at the moment of the peak. The wastes of all sizes add up to peak reserved − live at peak.

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

/// One sample of the engine's state.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Sample {
    /// Ops replayed so far (the x axis).
    pub op: u64,
    /// Live bytes per tier, in [`Timeline::tiers`] order.
    pub live: Vec<u64>,
    /// Reserved bytes per tier, in [`Timeline::tiers`] order.
    pub reserved: Vec<u64>,
    /// Live bytes of the trace (the physical floor).
    pub trace_live: u64,
    /// Bytes the engine holds from the device (all tiers and cached pages).
    pub engine_reserved: u64,
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
    /// Ops between samples.
    pub every: u64,
    /// Tier names.
    pub tiers: Vec<&'static str>,
    /// Samples, in op order; the first is at op 0, the last at the last op.
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
    /// Sizes by waste, largest first (at most [`Timeline::WASTE_ROWS`]).
    pub waste: Vec<SizeWaste>,
}

impl Timeline {
    /// Rows kept in [`Timeline::waste`].
    pub const WASTE_ROWS: usize = 12;

    /// `peak_reserved / peak_live` (`None` on a trace without allocations).
    pub fn ratio(&self) -> Option<f64> {
        (self.peak_live > 0).then(|| self.peak_reserved as f64 / self.peak_live as f64)
    }
}

/// The log2 bucket of a lifetime (see [`LIFETIME_BUCKETS`]).
pub fn lifetime_bucket(lifetime: u64) -> usize {
    ((u64::BITS - lifetime.leading_zeros()) as usize).min(LIFETIME_BUCKETS - 1)
}

/// Target number of samples when the caller leaves the interval to [`record_timeline`].
pub const DEFAULT_SAMPLES: u64 = 1200;

/// Replays `trace` once through a fresh engine with `cfg` on the simulated device and records a
/// [`Timeline`] (see the module docs). `every` = ops between samples (`None`: about
/// [`DEFAULT_SAMPLES`] samples in all). `progress(done)` is called with the ops replayed so far, every
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
    let sample = |eng: &EngineReplay, op: u64, trace_live: u64| {
        let st = eng.pool().stats();
        Sample {
            op,
            live: st.tiers.iter().map(|t| t.live_bytes).collect(),
            reserved: st.tiers.iter().map(|t| t.reserved).collect(),
            trace_live,
            engine_reserved: st.reserved_current,
        }
    };
    samples.push(sample(&eng, 0, 0));
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
        let done = i as u64 + 1;
        if done % every == 0 || done == ops {
            samples.push(sample(&eng, done, trace_live));
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
        .filter(|w| w.waste() > 0)
        .collect();
    waste.sort_unstable_by(|a, b| b.waste().cmp(&a.waste()).then(a.size.cmp(&b.size)));
    waste.truncate(Timeline::WASTE_ROWS);
    Ok(Timeline {
        trace: trace.name.clone(),
        ops,
        every,
        tiers: st.tiers.iter().map(|t| t.tier).collect(),
        samples,
        peak_live,
        peak_reserved: peak.max(st.reserved_peak),
        peak_op,
        live_at_peak: live_at_peak.values().sum(),
        lifetimes,
        lifetime_bytes,
        never_freed: live.len() as u64,
        confusion_counts: st.confusion_counts,
        confusion_bytes: st.confusion_bytes,
        waste,
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
