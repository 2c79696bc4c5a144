//! Trace analysis for genpool: what each allocator policy would reserve on a trace, side by side with
//! genpool itself, and with the ratios measured on the GPU (the *anchors*).
//!
//! - [`caching`]: PyTorch's `CUDACachingAllocator`, native and with expandable segments.
//! - [`rmm`]: RAPIDS RMM's fixed-size pool and the anchor script's bisection for its smallest size.
//! - [`analyze`]: runs every [`Strategy`] on one trace → an [`Analysis`]; [`write_report`] renders
//!   analyses as a Markdown report, with the measured [`ANCHORS`] and each simulation's error.
//!
//! Every simulation is host-only address arithmetic, deterministic, and replayed through
//! [`gen_trace::replay`] (so each returned block is checked for overlap and alignment). The ratio is
//! peak reserved / peak live after one pass, as the anchor script measures it
//! (`torch.cuda.max_memory_reserved()` after the first pass).

#![warn(missing_docs)]

pub mod caching;
pub mod driver_pool;
pub mod html;
mod recommend;
mod report;
pub mod rmm;
pub mod timeline;
pub mod units;
pub mod waste;

use gen_trace::{replay_plan, ReplayAllocator, ReplayError, ReplayOptions, ReplayPlan, Trace};

pub use caching::{CachingMode, CachingSim, Knobs};
pub use driver_pool::DriverPoolSim;
pub use html::write_html;
pub use recommend::{recommend, Recommendation};
pub use report::{write_report, write_table};
pub use rmm::{fits, min_fixed_size, RmmPoolSim};
pub use timeline::{record_timeline, Timeline};
pub use waste::{waste_at_peak, PeakMoment, Waste, WasteCause, WasteProbe, WasteSnapshot};

/// An allocator policy the analysis can run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    /// PyTorch's caching allocator, default settings.
    Native,
    /// PyTorch's caching allocator with `expandable_segments:True`.
    Expandable,
    /// PyTorch's caching allocator (native segments) with `max_split_size_mb` and/or
    /// `roundup_power2_divisions` set.
    NativeTuned(Knobs),
    /// PyTorch's `cudaMallocAsync` backend: the driver's stream-ordered pool (a model of an
    /// undocumented policy, see [`driver_pool`]).
    Async,
    /// RMM `pool_memory_resource`, smallest fixed size that replays the trace.
    RmmPool,
    /// The genpool engine on the simulated device.
    Genpool,
}

impl Strategy {
    /// Every strategy, in report order.
    pub const ALL: [Strategy; 4] = [
        Strategy::Native,
        Strategy::Expandable,
        Strategy::RmmPool,
        Strategy::Genpool,
    ];

    /// PyTorch settings tried by default besides `native` and `expandable`: `max_split_size_mb` (a
    /// cap on splitting large cached blocks) and `roundup_power2_divisions` (coarser size classes).
    pub const TORCH_SWEEP: [Strategy; 5] = [
        Strategy::NativeTuned(Knobs {
            max_split_size_mb: Some(64),
            roundup_power2_divisions: 0,
        }),
        Strategy::NativeTuned(Knobs {
            max_split_size_mb: Some(256),
            roundup_power2_divisions: 0,
        }),
        Strategy::NativeTuned(Knobs {
            max_split_size_mb: Some(1024),
            roundup_power2_divisions: 0,
        }),
        Strategy::NativeTuned(Knobs {
            max_split_size_mb: None,
            roundup_power2_divisions: 4,
        }),
        Strategy::NativeTuned(Knobs {
            max_split_size_mb: Some(256),
            roundup_power2_divisions: 4,
        }),
    ];

    /// What `genpool analyze` runs when no strategy is named: [`Strategy::ALL`] and
    /// [`Strategy::TORCH_SWEEP`].
    pub fn default_set() -> Vec<Strategy> {
        Strategy::ALL
            .into_iter()
            .chain(Strategy::TORCH_SWEEP)
            .collect()
    }

    /// Whether the simulation is checked against measured ratios (tests/anchors.rs) and may be
    /// recommended. [`Strategy::Async`] is not: it is an estimate, run only when named.
    pub fn is_validated(self) -> bool {
        self != Strategy::Async
    }

    /// Whether this is a PyTorch caching-allocator setting (a choice made with
    /// `PYTORCH_CUDA_ALLOC_CONF`).
    pub fn is_torch(self) -> bool {
        matches!(
            self,
            Strategy::Native | Strategy::Expandable | Strategy::NativeTuned(_) | Strategy::Async
        )
    }

    /// The strategy's full name with its settings: [`Strategy::name`], or for a tuned native allocator
    /// `native:max_split_size_mb=256,roundup_power2_divisions=4` (the form [`Strategy::parse`] reads).
    pub fn label(self) -> String {
        match self {
            Strategy::NativeTuned(k) => {
                let mut parts = Vec::new();
                if let Some(m) = k.max_split_size_mb {
                    parts.push(format!("max_split_size_mb={m}"));
                }
                if k.roundup_power2_divisions > 1 {
                    parts.push(format!(
                        "roundup_power2_divisions={}",
                        k.roundup_power2_divisions
                    ));
                }
                if parts.is_empty() {
                    "native".to_owned()
                } else {
                    format!("native:{}", parts.join(","))
                }
            }
            s => s.name().to_owned(),
        }
    }

    /// The `PYTORCH_CUDA_ALLOC_CONF` value that selects this strategy, for PyTorch strategies.
    pub fn torch_conf(self) -> Option<String> {
        match self {
            Strategy::Native => Some(String::new()),
            Strategy::Expandable => Some("expandable_segments:True".to_owned()),
            Strategy::NativeTuned(k) => {
                let mut parts = Vec::new();
                if let Some(m) = k.max_split_size_mb {
                    parts.push(format!("max_split_size_mb:{m}"));
                }
                if k.roundup_power2_divisions > 1 {
                    parts.push(format!(
                        "roundup_power2_divisions:{}",
                        k.roundup_power2_divisions
                    ));
                }
                Some(parts.join(","))
            }
            Strategy::Async => Some("backend:cudaMallocAsync".to_owned()),
            Strategy::RmmPool | Strategy::Genpool => None,
        }
    }

    /// The name used on the command line and in reports (`native-tuned` for every tuned setting; see
    /// [`Strategy::label`]).
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Native => "native",
            Strategy::Expandable => "expandable",
            Strategy::NativeTuned(_) => "native-tuned",
            Strategy::Async => "async",
            Strategy::RmmPool => "rmm-pool",
            Strategy::Genpool => "genpool",
        }
    }

    /// The strategy called `name` (see [`Strategy::name`]), or a native allocator with settings:
    /// `native:max_split_size_mb=N,roundup_power2_divisions=M` (either or both; `:` also accepted
    /// in place of `=`, as in `PYTORCH_CUDA_ALLOC_CONF`).
    pub fn parse(name: &str) -> Result<Strategy, AnalyzeError> {
        if let Some(rest) = name.strip_prefix("native:") {
            let bad = |message: String| AnalyzeError::BadSetting {
                name: name.to_owned(),
                message,
            };
            let mut k = Knobs::default();
            for part in rest.split(',').filter(|p| !p.is_empty()) {
                let (key, value) = part
                    .split_once(['=', ':'])
                    .ok_or_else(|| bad(format!("`{part}` is not key=value")))?;
                let v: u32 = value
                    .trim()
                    .parse()
                    .map_err(|_| bad(format!("`{value}` is not a whole number")))?;
                match key.trim() {
                    "max_split_size_mb" => k.max_split_size_mb = Some(v),
                    "roundup_power2_divisions" => k.roundup_power2_divisions = v,
                    other => {
                        return Err(bad(format!(
                            "unknown setting `{other}` (known: max_split_size_mb, roundup_power2_divisions)"
                        )))
                    }
                }
            }
            k.validate().map_err(bad)?;
            return Ok(if k.is_default() {
                Strategy::Native
            } else {
                Strategy::NativeTuned(k)
            });
        }
        Strategy::ALL
            .into_iter()
            .chain([Strategy::Async])
            .find(|s| s.name() == name)
            .ok_or_else(|| AnalyzeError::UnknownStrategy {
                name: name.to_owned(),
            })
    }

    /// The anchor mode of `benches/gpu/torch_replay.py` this strategy simulates, if any.
    pub fn anchor_mode(self) -> Option<&'static str> {
        match self {
            Strategy::Native => Some("native"),
            Strategy::Expandable => Some("expandable"),
            Strategy::Async => Some("async"),
            Strategy::RmmPool => Some("rmm-pool"),
            Strategy::NativeTuned(_) | Strategy::Genpool => None,
        }
    }
}

/// Anchor modes, in the column order of [`ANCHORS`].
pub const ANCHOR_MODES: [&str; 5] = ["native", "expandable", "async", "rmm-pool", "rmm-arena"];

/// Ratios (peak reserved / peak live) measured on an H200 with `benches/gpu/torch_replay.py`
/// (torch 2.11.0+cu130, RMM 26.10, 2026-12-02), columns as [`ANCHOR_MODES`].
pub const ANCHORS: [(&str, [f64; 5]); 4] = [
    ("gpt2_train_fixed", [1.125, 1.070, 1.103, 1.070, 1.078]),
    ("gpt2m_train_varlen", [1.092, 1.039, 1.034, 1.039, 1.047]),
    ("gpt2_generate_kv", [1.137, 1.106, 1.150, 1.070, 1.094]),
    ("resnet50_train", [1.126, 1.010, 1.051, 1.008, 1.016]),
];

/// The measured ratio of anchor `mode` on trace `trace`, if there is one.
pub fn anchor(trace: &str, mode: &str) -> Option<f64> {
    let col = ANCHOR_MODES.iter().position(|m| *m == mode)?;
    ANCHORS
        .iter()
        .find(|(t, _)| *t == trace)
        .map(|(_, r)| r[col])
}

/// What can go wrong in an analysis.
#[derive(Debug, thiserror::Error)]
pub enum AnalyzeError {
    /// A strategy name nobody knows.
    #[error("unknown strategy `{name}` (known: native, expandable, rmm-pool, genpool, async, native:max_split_size_mb=N,roundup_power2_divisions=M)")]
    UnknownStrategy {
        /// The name given.
        name: String,
    },
    /// A PyTorch setting that PyTorch would refuse, or that cannot be read.
    #[error("bad setting in `{name}`: {message}")]
    BadSetting {
        /// The strategy as given.
        name: String,
        /// What is wrong.
        message: String,
    },
    /// The trace has no allocations: there is nothing to analyze.
    #[error("{trace}: the trace has no allocations")]
    EmptyTrace {
        /// Trace name.
        trace: String,
    },
    /// The genpool engine could not be made.
    #[error("genpool engine: {0}")]
    Engine(String),
    /// A replay failed.
    #[error("{trace}: {strategy}: {source}")]
    Replay {
        /// Trace name.
        trace: String,
        /// Strategy name.
        strategy: &'static str,
        /// What went wrong.
        source: ReplayError,
    },
}

/// One strategy's result on one trace.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct StrategyResult {
    /// The strategy.
    pub strategy: Strategy,
    /// Most bytes held from the (simulated) device.
    pub peak_reserved: u64,
    /// `peak_reserved / peak_live` (`None` on an empty trace).
    pub ratio: Option<f64>,
    /// The ratio measured on the GPU for this strategy and trace, when known.
    pub measured: Option<f64>,
    /// The moment of peak reservation at which the waste was taken apart (see [`waste`]).
    pub at_peak: PeakMoment,
    /// What the reservation held besides live data at that moment, by cause (bytes; adds up to
    /// `at_peak.reserved − at_peak.live`).
    pub waste: Waste,
    /// The cause with the most bytes in [`StrategyResult::waste`].
    pub dominant_waste: Option<WasteCause>,
}

impl StrategyResult {
    /// Simulated minus measured ratio, when both are known.
    pub fn error(&self) -> Option<f64> {
        Some(self.ratio? - self.measured?)
    }
}

/// Every strategy's result on one trace.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Analysis {
    /// Trace name.
    pub trace: String,
    /// Alloc + free events.
    pub ops: u64,
    /// Streams used.
    pub streams: usize,
    /// Highest sum of live bytes.
    pub peak_live: u64,
    /// One result per strategy asked for, in the order asked.
    pub results: Vec<StrategyResult>,
    /// Which setting to use and why, in numbers.
    pub recommendation: Recommendation,
}

impl Analysis {
    /// The result of `s`, if it was run.
    pub fn result(&self, s: Strategy) -> Option<&StrategyResult> {
        self.results.iter().find(|r| r.strategy == s)
    }
}

/// Memory of the simulated device the engine runs on: an H200's.
pub(crate) const SIM_CAPACITY: u64 = 141 << 30;

/// The engine's configuration for the `genpool` strategy: `GENPOOL_CONF` (`key:value,...`) as in every
/// other use of the engine, the defaults when it is unset.
pub fn engine_config() -> Result<genpool::Config, AnalyzeError> {
    genpool::Config::from_env().map_err(|e| AnalyzeError::Engine(format!("GENPOOL_CONF: {e}")))
}

fn engine() -> Result<genpool::replay::EngineReplay, AnalyzeError> {
    let dev = gen_device::sim::SimConfig::new()
        .capacity(SIM_CAPACITY)
        .build()
        .map_err(|e| AnalyzeError::Engine(e.to_string()))?;
    let pool = genpool::Pool::new(std::sync::Arc::new(dev), engine_config()?)
        .map_err(|e| AnalyzeError::Engine(e.to_string()))?;
    Ok(genpool::replay::EngineReplay::new(pool, "genpool"))
}

fn one_pass(plan: &ReplayPlan, a: &mut dyn ReplayAllocator) -> Result<u64, ReplayError> {
    let opts = ReplayOptions {
        passes: 1,
        ignore_site: false,
    };
    replay_plan(plan, a, &opts, &mut |_| {}).map(|r| r.peak_reserved)
}

/// Peak reserved bytes of strategy `s` on `trace` (compiled as `plan`; one pass).
pub fn peak_reserved(trace: &Trace, plan: &ReplayPlan, s: Strategy) -> Result<u64, AnalyzeError> {
    let err = |source| AnalyzeError::Replay {
        trace: trace.name.clone(),
        strategy: s.name(),
        source,
    };
    match s {
        Strategy::Native => one_pass(plan, &mut CachingSim::new(CachingMode::Native)).map_err(err),
        Strategy::Expandable => {
            one_pass(plan, &mut CachingSim::new(CachingMode::Expandable)).map_err(err)
        }
        Strategy::NativeTuned(k) => {
            k.validate().map_err(|message| AnalyzeError::BadSetting {
                name: s.label(),
                message,
            })?;
            one_pass(plan, &mut CachingSim::with_knobs(CachingMode::Native, k)).map_err(err)
        }
        Strategy::Async => one_pass(plan, &mut DriverPoolSim::new()).map_err(err),
        Strategy::RmmPool => min_fixed_size(trace, &RmmPoolSim::new).map_err(err),
        Strategy::Genpool => one_pass(plan, &mut engine()?).map_err(err),
    }
}

/// Strategy `s`'s state at its moment of peak reservation on `trace` (see [`waste`]); `peak` is its
/// peak reservation as [`peak_reserved`] found it (the size of RMM's fixed pool).
pub fn waste_of(trace: &Trace, s: Strategy, peak: u64) -> Result<WasteSnapshot, AnalyzeError> {
    match s {
        Strategy::Native => waste_at_peak(trace, &mut || Ok(CachingSim::new(CachingMode::Native))),
        Strategy::Expandable => {
            waste_at_peak(trace, &mut || Ok(CachingSim::new(CachingMode::Expandable)))
        }
        Strategy::NativeTuned(k) => waste_at_peak(trace, &mut || {
            Ok(CachingSim::with_knobs(CachingMode::Native, k))
        }),
        Strategy::Async => waste_at_peak(trace, &mut || Ok(DriverPoolSim::new())),
        Strategy::RmmPool => waste_at_peak(trace, &mut || {
            Ok(RmmPoolSim::new(
                peak.div_ceil(rmm::BUDGET_ROUND) * rmm::BUDGET_ROUND,
            ))
        }),
        Strategy::Genpool => waste_at_peak(trace, &mut engine),
    }
}

/// Runs `strategies` on `trace`. A trace without allocations is an error ([`AnalyzeError::EmptyTrace`]).
pub fn analyze(trace: &Trace, strategies: &[Strategy]) -> Result<Analysis, AnalyzeError> {
    if trace.summary.allocs == 0 {
        return Err(AnalyzeError::EmptyTrace {
            trace: trace.name.clone(),
        });
    }
    let plan = ReplayPlan::new(trace).map_err(|source| AnalyzeError::Replay {
        trace: trace.name.clone(),
        strategy: "plan",
        source,
    })?;
    let peak_live = plan.peak_live();
    let mut results = Vec::with_capacity(strategies.len());
    for &s in strategies {
        let peak = peak_reserved(trace, &plan, s)?;
        let snap = waste_of(trace, s, peak)?;
        results.push(StrategyResult {
            strategy: s,
            peak_reserved: peak,
            ratio: (peak_live > 0).then(|| peak as f64 / peak_live as f64),
            measured: s.anchor_mode().and_then(|m| anchor(&trace.name, m)),
            at_peak: snap.moment,
            dominant_waste: snap.waste.dominant(),
            waste: snap.waste,
        });
    }
    let recommendation = recommend::recommend_from(peak_live, &results);
    Ok(Analysis {
        trace: trace.name.clone(),
        ops: trace.ops(),
        streams: trace.summary.streams.len(),
        peak_live,
        results,
        recommendation,
    })
}
