//! Engine statistics, serialisable for the CLI's `--json` and the PyTorch plug-in's `memory_stats()`.

use gen_vmm::PagePoolStats;

/// One tier's figures.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct TierStats {
    /// Tier name.
    pub tier: &'static str,
    /// Allocations served.
    pub allocs: u64,
    /// Frees received.
    pub frees: u64,
    /// Bytes live now.
    pub live_bytes: u64,
    /// Highest live bytes.
    pub live_peak: u64,
    /// Bytes the tier holds from the device now (committed pages, or the driver pool's reservation).
    pub reserved: u64,
    /// Highest `reserved`.
    pub reserved_peak: u64,
}

/// A snapshot of a [`Pool`](crate::Pool)'s statistics.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct PoolStats {
    /// Bytes allocated and not freed.
    pub allocated_current: u64,
    /// Highest `allocated_current`.
    pub allocated_peak: u64,
    /// Bytes held from the device now.
    pub reserved_current: u64,
    /// Highest bytes held from the device (see [`Pool::reserved_peak`](crate::Pool::reserved_peak)).
    pub reserved_peak: u64,
    /// Successful allocations.
    pub num_allocs: u64,
    /// Successful frees.
    pub num_frees: u64,
    /// Allocations that failed with out-of-memory after the release-and-retry.
    pub num_ooms: u64,
    /// Allocations that needed the release-and-retry path.
    pub num_alloc_retries: u64,
    /// Frees refused (unknown, double, null).
    pub num_invalid_frees: u64,
    /// Bytes of freed blocks held out of their tier: freed during a capture, whose return waits for the
    /// capture's end (their handoff's ordering cannot be recorded during it), or kept for their thread's
    /// or busy stream's next allocation of their size.
    pub cached_bytes: u64,
    /// Allocations a stream known busy served from a block it had freed itself (kept out of the shared
    /// arena while it was busy; their bytes, while kept, are in `cached_bytes`).
    pub busy_kept_reuses: u64,
    /// The shared page pool.
    pub pages: PagePoolStats,
    /// The page headroom in force (`page_slack`, grown under the move budget by iteration marks).
    pub page_slack: f64,
    /// Per tier.
    pub tiers: Vec<TierStats>,
    /// Classifier accuracy by count against observed lifetimes.
    pub classifier_accuracy_count: f64,
    /// Classifier accuracy by bytes.
    pub classifier_accuracy_bytes: f64,
    /// Confusion matrix (predicted × actual: short, mid, long), counts.
    pub confusion_counts: [[u64; 3]; 3],
    /// Confusion matrix, bytes.
    pub confusion_bytes: [[u64; 3]; 3],
    /// The periodic planner (see `Config::plan`).
    pub plan: PlanSummary,
    /// The extent arenas' old generations (see `Config::old_generation`).
    pub old_generation: OldGeneration,
    /// Whether the pool is asleep ([`Pool::sleep`](crate::Pool::sleep)): `reserved_current` then
    /// counts only what stays held, `allocated_current` is unchanged.
    pub asleep: bool,
    /// Bytes of pages referenced by live blocks whose physical memory is given back while asleep.
    pub sleeping_bytes: u64,
    /// Of those, bytes whose contents wait in pinned host memory for the wake.
    pub offloaded_bytes: u64,
}

/// What the extent arenas' old generations hold (`old_generation`; all zero when it is 0).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct OldGeneration {
    /// Allocations placed in an old range.
    pub allocs: u64,
    /// Bytes in live blocks of the old ranges now.
    pub live_bytes: u64,
    /// The old ranges' highest live bytes (each arena's own peak, summed).
    pub peak_live_bytes: u64,
}

/// What the periodic planner did (all zero when planning is off).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct PlanSummary {
    /// Whether a plan serves allocations now.
    pub active: bool,
    /// Period of the current plan, in large-block allocations (0: none).
    pub period: u64,
    /// Bytes of the current plan's range.
    pub footprint: u64,
    /// Most bytes of planned blocks alive at one moment of the recorded period.
    pub lower_bound: u64,
    /// Allocations served from the plan.
    pub hits: u64,
    /// Allocations that did not match the plan.
    pub misses: u64,
    /// Allocations that matched but whose slot was not free (served by the tiers).
    pub blocked: u64,
    /// Matching allocations at positions the plan does not cover.
    pub outside: u64,
    /// Plans activated.
    pub activations: u64,
    /// Plans dropped.
    pub deactivations: u64,
    /// Bytes of the plan's range mapped now.
    pub committed: u64,
    /// Whether a period is being recorded or packed now (a plan may follow).
    pub recording: bool,
    /// Recordings (and ready plans) given up because the sequence stopped repeating.
    pub aborted_recordings: u64,
    /// Whether the planner looks at large allocations now (it sleeps, costing nothing, after a few
    /// quiet windows: see `Pool::planner_awake`).
    pub awake: bool,
    /// Times the planner gave up for a while because no period showed up in many windows of large
    /// allocations that moved pages (random shapes).
    pub snoozes: u64,
}
