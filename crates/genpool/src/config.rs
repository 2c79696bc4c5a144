//! Engine configuration: a builder, and PyTorch-style `key:value,key:value` strings (`GENPOOL_CONF`).

use std::str::FromStr;

use gen_classifier::ClassifierConfig;
use gen_plan::PlanConfig;

/// Where the streams after the first allocate large blocks (`experimental.stream_arenas`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum StreamArenas {
    /// The streams after the first share one extent arena. A free there makes no device call: it
    /// stamps the bytes with its stream (`gen_vmm::Stamp`), and the stream that allocates them next
    /// waits on the device for the streams named — once per pair of streams per hand-over, never for its
    /// own frees. Pages stay where the blocks are, rather than moving between arenas.
    Shared,
    /// An extent arena for each stream after the first (up to four; later streams share one): a block
    /// freed on the stream that allocates from its arena goes straight back (stream order), and pages
    /// move between the arenas through the page pool as the streams' needs shift.
    Own,
    /// Every stream allocates from the first stream's arena(s), each ordered on the device after the
    /// others' frees at every free (`gen_vmm::Handoff::freed`).
    First,
}

/// How a free orders the reuse of a block used on other streams of its own device (PyTorch's
/// `Tensor.record_stream`; `record_stream` key).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum RecordStream {
    /// PyTorch's own rule: a stream of the uses found idle at the free needs nothing; for each busy one
    /// an event is recorded there, and the block is held back — still live in its engine, out of reuse —
    /// until those events have completed (polled by later calls, waited for before an allocation fails
    /// for lack of memory or the cache is emptied). No stream waits for another, so work the program
    /// meant to overlap still overlaps. During a capture, where no event may be polled, [`Self::Wait`].
    Hold,
    /// The block is reused at once: the freeing stream waits on the device (`cuStreamWaitEvent`) for
    /// the work queued so far on each stream of the uses. No block is held back, but the freeing stream's
    /// later work is ordered after those streams' — the overlap of the two is lost.
    Wait,
}

/// What an allocation in the arena the streams after the first share does with bytes a busy stream
/// freed (`experimental.busy_freers` key).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum BusyFreers {
    /// Pass over them where other bytes serve (bytes owing nothing to the streams a wait found busy,
    /// among 16 best fits, else address space no block used), pass over free pages warm with such a
    /// stream's work (a new page instead, `gen_vmm::PagePool::set_pass_busy`), and place no block
    /// where committing would wait for such a stream (an address whose old mapping's page a busy stream
    /// holds: `gen_vmm::Region::placement_costs`): the streams keep running side by side, each mostly
    /// reusing its own bytes, at the memory that costs. A busy stream is asked again after 1, 3, 7 …
    /// 63 of the checks that would pass it over; found idle, its bytes and pages serve again. Where no
    /// stream is ever busy (every replay) nothing changes: no lock is taken on its account and
    /// placement is best fit's. The default (session 29: four busy serving streams on an H100, 1.99 →
    /// 0.68 ms a step, PyTorch's allocator 0.51).
    Pass,
    /// Take best fit's bytes and the pool's pages, and wait on the device for their last users (the
    /// layout uses the fewest pages; busy streams run one after another where bytes pass between
    /// them). The default until session 29.
    Wait,
}

/// Where mid-lived allocations go.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum MidTier {
    /// The driver's stream-ordered pool (gen-stream, a private `cudaMemPool`).
    Stream,
    /// The extent arena, beside the large short-lived blocks (pages shared with them).
    Extent,
}

/// Where long-lived allocations go.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum LongTier {
    /// The exact-fit buddy (gen-buddy), in regions of its own.
    Buddy,
    /// The extent arena, beside the short-lived blocks (pages shared with them).
    Extent,
}

/// How allocations are routed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Routing {
    /// By predicted lifetime and size: the classifier stamps every allocation, short- and mid-lived small
    /// blocks go to the slab, the rest to the extent arena (or the experimental tiers). Measured slower
    /// than `Single` with the same or a higher ratio on every trace (docs/ARCHITECTURE.md, "What lifetime
    /// routing buys"), so no longer the default.
    Generational,
    /// By size alone, no prediction made: blocks up to `slab_max_size` to the slab, the rest to the
    /// extent arena. The default.
    Single,
    /// Every block to the extent arena, whatever its size: the routing of PyTorch's private pools (CUDA
    /// graphs, MemPools), where [`Pool::alloc_at`](crate::Pool::alloc_at) must be able to place any block
    /// again at its address (restoring a graph tree's checkpoint).
    Extent,
}

fn experimental_hint(key: &str) -> String {
    let full = format!("{EXPERIMENTAL}{key}");
    if valid_keys().any(|k| k == full) {
        format!(" (an experimental mode now: `{full}`)")
    } else {
        String::new()
    }
}

/// A bad configuration key or value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A key the engine does not know.
    #[error("unknown configuration key '{key}'{} (valid keys: {})", experimental_hint(key), valid_keys().collect::<Vec<_>>().join(", "))]
    UnknownKey {
        /// The key given.
        key: String,
    },
    /// A key an earlier version accepted, for a mode since removed.
    #[error("configuration key '{key}' was removed: {why}")]
    RemovedKey {
        /// The key given.
        key: String,
        /// Why, and what does its job now.
        why: &'static str,
    },
    /// A value that does not parse or is out of range.
    #[error("bad value '{value}' for configuration key '{key}': {reason}")]
    BadValue {
        /// The key.
        key: String,
        /// The value given.
        value: String,
        /// What is wrong.
        reason: String,
    },
    /// An entry with no `:`.
    #[error("malformed configuration entry '{0}': expected key:value")]
    Malformed(String),
}

/// The prefix of the keys of experimental modes: modes kept for measurements and tests whose numbers
/// did not make them the default (docs/BENCHMARKS.md has the numbers). They may change or go.
pub const EXPERIMENTAL: &str = "experimental.";

/// One configuration key, as documented in docs/CONFIG.md (generated from this table and checked by a
/// test: [`table`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Key {
    /// The key, [`EXPERIMENTAL`] prefix included.
    pub name: &'static str,
    /// What its values are: a unit, or the choices.
    pub unit: &'static str,
    /// Its default, as a value [`Config::parse`] accepts (a test checks it parses to `Config::default()`).
    pub default: &'static str,
    /// What it does.
    pub doc: &'static str,
}

const fn key(
    name: &'static str,
    unit: &'static str,
    default: &'static str,
    doc: &'static str,
) -> Key {
    Key {
        name,
        unit,
        default,
        doc,
    }
}

/// Every key [`Config::parse`] accepts: first the ones a user tunes, then the experimental modes.
pub const KEYS: &[Key] = &[
    key("limit", "bytes (K, M, G suffixes)", "0", "Cap on the physical memory the engine's pages may hold; 0 = the device's memory."),
    key("slab_max_size", "bytes, 512 B to 64 MiB", "4K", "Largest block the slab serves; larger short-lived blocks go to the extent arena."),
    key("page_slack", "fraction of the in-use page peak", "0", "Headroom within which a new page is created rather than one moved from another address."),
    key("page_slack_max", "fraction", "0.08", "With iteration marks (`step()`): the most the headroom may grow to keep page moves within `move_budget`; 0 = never grow."),
    key("move_budget", "fraction of an iteration's wall time", "0.005", "With iteration marks: page moves beyond this share of an iteration grow the headroom."),
    key("old_generation", "large allocations, 0 = off, below 8388608", "4096", "Extent arenas: a block whose size's last block outlived this many of its arena's allocations goes to the arena's old range, away from the churn of shorter-lived blocks."),
    key("use_site", "true/false", "true", "Let the classifier (`experimental.routing:generational`) use call-site tags when the caller provides them."),
    key("plan", "true/false", "true", "Periodic plans: detect a repeating iteration, pack it once, serve it in place where the tiers' layout moves pages."),
    key("plan_background", "true/false", "true", "Pack a recorded period on a helper thread; false: on the allocating thread, results depend only on the allocation sequence (reproducible replays)."),
    key("eager_unmap", "true/false", "false", "Unmap pages as soon as they are unused (debugging use-after-free; slower)."),
    key("thread_caches", "allocating threads, 0 = never", "3", "From this many threads allocating large blocks on, each thread keeps its last few freed ones (same size, same stream; at most 4 blocks, 128 MiB) for its next allocations, past the arena's and the page pool's locks."),
    key("magazines", "true/false", "true", "Each thread keeps up to 16 slab blocks per size class it freed for its next allocations of that class on the same stream, past the slab's lock-free lists (emptied on a trim, before growing, and by the thread itself when asked)."),
    key("record_stream", "hold or wait", "hold", "A block used on other streams of its device (`Tensor.record_stream`) and freed: hold — out of reuse until an event recorded on each busy stream of its uses completes (PyTorch's own rule: the streams keep overlapping); wait — reused at once, the freeing stream waiting on the device for those streams."),
    key("experimental.mid_tier", "stream or extent", "extent", "Where mid-lived blocks go: the extent arena, or the driver's stream-ordered pool (`stream` selects `experimental.routing:generational` unless the routing is given)."),
    key("experimental.long_tier", "buddy or extent", "extent", "Where long-lived blocks go: the extent arena, or the exact-fit buddy (`buddy` selects `experimental.routing:generational` unless the routing is given)."),
    key("experimental.routing", "single, generational or extent", "single", "single: by size alone (slab-sized blocks to the slab, the rest to the extent arena), no prediction made; generational: by predicted lifetime too (the classifier on every call; what the experimental tiers and extent_generations need); extent: every block to the extent arena (PyTorch's private pools)."),
    key("experimental.pool_release_threshold", "bytes or max", "max", "Release threshold of the driver pool (`experimental.mid_tier:stream`)."),
    key("experimental.short_horizon", "allocations", "64", "Classifier: allocations after which a live block is no longer short-lived."),
    key("experimental.mid_horizon", "allocations", "65536", "Classifier: allocations after which a live block is no longer mid-lived."),
    key("experimental.page_keep_old_mappings", "true/false", "true", "Leave a moved page's old mapping in place so the move can be undone with no driver call."),
    key("experimental.placement_candidates", "count, 0 to 64", "1", "Extent arena: how many best-fitting free extents to compare for the fewest new pages (0 or 1 = plain best fit)."),
    key("experimental.extent_generations", "true/false", "false", "One extent arena per predicted generation for the first stream (`true` selects `experimental.routing:generational` unless the routing is given)."),
    key("experimental.stream_arenas", "shared, own or first", "shared", "Several streams: the streams after the first share one extent arena, each waiting (on the device) only for the streams that freed the bytes it gets; own: an arena for each (up to four, later ones shared), pages moving between them; first: every stream in the first stream's arena, ordered after the others' frees."),
    key("experimental.busy_freers", "pass or wait", "pass", "Several streams: pass — bytes of the shared stream arena owed to streams a wait found busy, free pages warm with such a stream's work, and addresses whose commit would wait for one are passed over where others (or a new page) serve, and a busy stream keeps its own frees of the shared arena for its next allocations of their size (up to four blocks and 512 MiB a stream; back on `empty_cache`, before out of memory, or once no stream is busy), so busy serving streams keep running side by side at the memory that costs; wait — best fit's bytes and the pool's pages, the allocating stream waiting on the device for their last users."),
    key("experimental.plan_pin", "true/false", "true", "Plans map each page of their range once and keep it while served; false: planned blocks commit their own pages."),
    key("experimental.plan_max_period", "large allocations, 16 to 1048576", "8192", "Longest period the planner looks for."),
    key("experimental.plan_min_moves", "fraction of the plan's footprint", "0.005", "Serve a ready plan only after two periods each moved this much in pages; 0 = as soon as ready."),
];

/// Keys an earlier version accepted, with why they went ([`ConfigError::RemovedKey`]).
pub const REMOVED: &[(&str, &str)] = &[(
    "experimental.cache_max_bytes",
    "the exact-size front caches lost on every trace measured (ratio and ns/op, docs/ARCHITECTURE.md \
     'Front caches') and were removed; blocks freed on another stream are ordered by gen-vmm's Handoff",
)];

/// The configuration table of docs/CONFIG.md, rendered from [`KEYS`].
pub fn table() -> String {
    let mut t =
        String::from("| key | unit / values | default | what it does |\n|---|---|---|---|\n");
    for k in KEYS {
        t.push_str(&format!(
            "| `{}` | {} | `{}` | {} |\n",
            k.name, k.unit, k.default, k.doc
        ));
    }
    t
}

/// Every key [`Config::parse`] accepts (the names of [`KEYS`]).
pub fn valid_keys() -> impl Iterator<Item = &'static str> {
    KEYS.iter().map(|k| k.name)
}

/// Engine configuration. `Config::default()` is the tuned default; see docs/ARCHITECTURE.md.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Config {
    /// Largest block served by the slab (bytes; default 4 KiB); bigger short-lived blocks go to the
    /// extent arena. A class takes chunks of 16× the largest class (at least 64 KiB, at most a page), so
    /// large classes above a few KiB cost more pages than the extent arena's tight packing
    /// (docs/BENCHMARKS.md).
    pub slab_max_size: u64,
    /// Where mid-lived blocks go.
    pub mid_tier: MidTier,
    /// Where long-lived blocks go (default: the extent arena, which packed long-lived blocks tighter than
    /// the buddy on the shared traces — docs/BENCHMARKS.md; `experimental.long_tier:buddy` selects gen-buddy).
    pub long_tier: LongTier,
    /// Routing policy.
    pub routing: Routing,
    /// Cap on the physical memory the engine's pages may hold (`None`: the device's).
    pub limit: Option<u64>,
    /// Unmap pages as soon as they are unused (debugging use-after-free; slower).
    pub eager_unmap: bool,
    /// Release threshold of the mid tier's driver pool.
    pub pool_release_threshold: u64,
    /// Let the classifier use call-site tags when the caller provides them.
    pub use_site: bool,
    /// Classifier: allocations after which a live block is no longer short-lived (default: the classifier's).
    pub short_horizon: u64,
    /// Classifier: allocations after which a live block is no longer mid-lived (default: the classifier's).
    pub mid_horizon: u64,
    /// Page headroom over the peak of pages in use within which a new page is created rather than one
    /// moved from another address (see `gen_vmm::PagePoolConfig::slack`).
    pub page_slack: f64,
    /// With iteration marks ([`crate::Pool::mark_iteration`], the PyTorch plug-in's `step()`): the most the
    /// page headroom may grow to keep page moves within `move_budget`. 0 = never grow.
    pub page_slack_max: f64,
    /// Leave a moved page's old mapping in place, unused, so that a page needed again at an address it
    /// moved from takes it back with no driver call while it is free at its new address (see
    /// `gen_vmm::PagePoolConfig::keep_old_mappings`). Off: old mappings are unmapped once idle.
    pub page_keep_old_mappings: bool,
    /// With iteration marks: the share of an iteration's wall time page moves may take. When an
    /// iteration (after the first three) spends more, the headroom grows by half a percent per budget
    /// spent (at most two percent at a time), up to `page_slack_max` (default 8 %): a page costs 2 MiB
    /// held, a move ~44 µs of the driver's time (H200).
    pub move_budget: f64,
    /// Page-aware placement in the extent arena: how many best-fitting free extents to compare for the
    /// one needing the fewest newly mapped pages (0 or 1 = plain best fit, the default: on the shared
    /// traces comparing 8 or 32 moved as many pages and cost up to 0.02 in ratio — docs/BENCHMARKS.md).
    pub placement_candidates: usize,
    /// The extent arenas' old generation (`gen_extent::ExtentConfig::old_after`): a block whose size's
    /// last block outlived this many of its arena's allocations is placed in the arena's old range, so
    /// that blocks living across many others never sit among short-lived ones and pin partial pages
    /// when those die (docs/ARCHITECTURE.md, "The old generation"). 0 = one range.
    pub old_generation: u64,
    /// Give each predicted generation (short / mid / long) its own extent arena — its own range of
    /// address space over the shared page pool — instead of one arena for all.
    pub extent_generations: bool,
    /// Where streams after the first allocate large blocks (see [`StreamArenas`]). The first stream keeps
    /// its own arena (or, with `extent_generations`, its three generation arenas) whatever this says.
    pub stream_arenas: StreamArenas,
    /// From this many threads allocating large blocks on, each keeps its last few freed large blocks for
    /// itself (`tcache.rs`); 0 = never.
    pub thread_caches: u32,
    /// Each thread keeps slab blocks it freed, per size class, for its next allocations (`mag.rs`).
    pub magazines: bool,
    /// How a free orders the reuse of a block used on other streams of its device (see
    /// [`RecordStream`]; applied by the router, [`crate::Pools`]).
    pub record_stream: RecordStream,
    /// What the shared stream arena does with bytes busy streams freed (see [`BusyFreers`]).
    pub busy_freers: BusyFreers,
    /// Periodic plans (gen-plan): detect a repeating allocation sequence (a training iteration), pack one
    /// period offline and serve it from one mapped range — no search, no page moves in steady state.
    /// Allocations that do not match the plan go to the tiers as usual. Single-stream only. On by
    /// default, with `plan_pin`: a plan is served only where the tiers' own layout moves pages every
    /// period (`plan_min_moves`), and dropped — its idle pages given back — when the sequence leaves it
    /// (docs/ARCHITECTURE.md, "Periodic plans").
    pub plan: bool,
    /// Longest period (in large-block allocations) the planner looks for.
    pub plan_max_period: u64,
    /// With `plan`: serve a ready plan only after two periods in a row have each moved at least this
    /// fraction of the plan's footprint in pages (a plan exists to stop page moves; where the tiers'
    /// layout already repeats in place it would only cost memory). 0 = serve as soon as ready.
    pub plan_min_moves: f64,
    /// With `plan`: map each page of the plan's range once and keep it while the plan is served (no page
    /// work and no page moves in steady state; the range holds every page its period touches, which the
    /// packing keeps at the period's peak of live bytes). Off: planned blocks commit their own pages,
    /// which then flow between the plan's range and the arena.
    pub plan_pin: bool,
    /// With `plan`: pack a recorded period on a helper thread (default) instead of inside the allocation
    /// that ends the recording — packing takes milliseconds to hundreds of them (it is quadratic in the
    /// period's blocks), a stall of the training step on the allocating thread. Off: results depend
    /// only on the allocation sequence (reproducible replays, tests).
    pub plan_background: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            slab_max_size: gen_slab::SlabConfig::default().max_size,
            mid_tier: MidTier::Extent,
            long_tier: LongTier::Extent,
            routing: Routing::Single,
            limit: None,
            eager_unmap: false,
            pool_release_threshold: u64::MAX,
            use_site: true,
            short_horizon: ClassifierConfig::default().short_horizon().allocs,
            mid_horizon: ClassifierConfig::default().mid_horizon().allocs,
            page_slack: 0.0,
            page_slack_max: 0.08,
            page_keep_old_mappings: true,
            move_budget: 0.005,
            placement_candidates: 1,
            old_generation: 4096,
            extent_generations: false,
            stream_arenas: StreamArenas::Shared,
            thread_caches: 3,
            magazines: true,
            record_stream: RecordStream::Hold,
            busy_freers: BusyFreers::Pass,
            plan: true,
            plan_max_period: PlanConfig::default().max_period,
            plan_min_moves: 0.005,
            plan_pin: true,
            plan_background: PlanConfig::default().background,
        }
    }
}

/// Parse a byte size: a plain integer, or with a suffix K, M, G, T (binary: KiB, MiB ... also accepted).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a byte size"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        u => return Err(format!("unknown unit '{u}' in '{s}'")),
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("'{s}' overflows 64 bits"))
}

/// A fraction between 0 and 1 (headrooms, budgets, thresholds).
fn parse_fraction(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .parse()
        .map_err(|_| "expected a fraction, e.g. 0.01".to_string())?;
    if !(0.0..=1.0).contains(&v) {
        return Err("must be between 0 and 1".into());
    }
    Ok(v)
}

fn parse_bool(s: &str) -> Result<bool, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(format!("'{s}' is not a boolean (true/false)")),
    }
}

impl Config {
    /// The default configuration, overridden by the environment variable `GENPOOL_CONF` when set.
    pub fn from_env() -> Result<Self, ConfigError> {
        match std::env::var("GENPOOL_CONF") {
            Ok(s) => Self::parse(&s),
            Err(_) => Ok(Self::default()),
        }
    }

    /// Parse `key:value,key:value` over the defaults. Unknown keys and bad values are errors that list
    /// the valid keys.
    pub fn parse(s: &str) -> Result<Self, ConfigError> {
        let mut c = Config::default();
        let mut routing_given = false;
        for entry in s.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let (k, v) = entry
                .split_once(':')
                .ok_or_else(|| ConfigError::Malformed(entry.into()))?;
            c.set(k.trim(), v.trim())?;
            routing_given |= k.trim() == "experimental.routing";
        }
        // The tiers chosen by predicted lifetime only mean something with lifetime routing: asking for
        // one asks for it (unless the routing is given too).
        if !routing_given && c.wants_lifetime() {
            c.routing = Routing::Generational;
        }
        Ok(c)
    }

    /// Whether a mode that routes by predicted lifetime is selected (`experimental.mid_tier:stream`,
    /// `experimental.long_tier:buddy`, `experimental.extent_generations:true`).
    pub fn wants_lifetime(&self) -> bool {
        self.mid_tier != MidTier::Extent
            || self.long_tier != LongTier::Extent
            || self.extent_generations
    }

    /// Set one key from its string form.
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), ConfigError> {
        let bad = |reason: String| ConfigError::BadValue {
            key: key.to_string(),
            value: value.to_string(),
            reason,
        };
        let name = match key.strip_prefix(EXPERIMENTAL) {
            Some(k) if valid_keys().any(|v| v == key) => k,
            Some(_) => "",
            None if valid_keys().any(|v| v == key) => key,
            None => "",
        };
        match name {
            "slab_max_size" => {
                let v = parse_bytes(value).map_err(bad)?;
                if !(512..=(64 << 20)).contains(&v) {
                    return Err(bad("must be between 512 B and 64 MiB".into()));
                }
                self.slab_max_size = v;
            }
            "mid_tier" => {
                self.mid_tier = match value {
                    "stream" => MidTier::Stream,
                    "extent" => MidTier::Extent,
                    _ => return Err(bad("expected 'stream' or 'extent'".into())),
                }
            }
            "long_tier" => {
                self.long_tier = match value {
                    "buddy" => LongTier::Buddy,
                    "extent" => LongTier::Extent,
                    _ => return Err(bad("expected 'buddy' or 'extent'".into())),
                }
            }
            "routing" => {
                self.routing = match value {
                    "generational" => Routing::Generational,
                    "single" => Routing::Single,
                    "extent" => Routing::Extent,
                    _ => return Err(bad("expected 'generational', 'single' or 'extent'".into())),
                }
            }
            "limit" => {
                let v = parse_bytes(value).map_err(bad)?;
                self.limit = if v == 0 { None } else { Some(v) };
            }
            "eager_unmap" => self.eager_unmap = parse_bool(value).map_err(bad)?,
            "page_keep_old_mappings" => {
                self.page_keep_old_mappings = parse_bool(value).map_err(bad)?
            }
            "pool_release_threshold" => {
                self.pool_release_threshold = if value == "max" {
                    u64::MAX
                } else {
                    parse_bytes(value).map_err(bad)?
                }
            }
            "use_site" => self.use_site = parse_bool(value).map_err(bad)?,
            "short_horizon" => {
                self.short_horizon = value
                    .parse()
                    .map_err(|_| bad("expected an integer".into()))?
            }
            "mid_horizon" => {
                self.mid_horizon = value
                    .parse()
                    .map_err(|_| bad("expected an integer".into()))?
            }
            "old_generation" => {
                let v: u64 = value
                    .parse()
                    .map_err(|_| bad("expected an integer".into()))?;
                // Ages are counted modulo 2^BIRTH_BITS: a longer horizon could never be reached.
                let below = 1u64 << (gen_extent::BIRTH_BITS - 1);
                if v >= below {
                    return Err(bad(format!("must be below {below}")));
                }
                self.old_generation = v;
            }
            "placement_candidates" => {
                let v: usize = value
                    .parse()
                    .map_err(|_| bad("expected an integer".into()))?;
                if v > 64 {
                    return Err(bad("must be at most 64".into()));
                }
                self.placement_candidates = v;
            }
            "plan" => self.plan = parse_bool(value).map_err(bad)?,
            "plan_pin" => self.plan_pin = parse_bool(value).map_err(bad)?,
            "plan_background" => self.plan_background = parse_bool(value).map_err(bad)?,
            "plan_max_period" => {
                let v: u64 = value
                    .parse()
                    .map_err(|_| bad("expected an integer".into()))?;
                if !(16..=(1 << 20)).contains(&v) {
                    return Err(bad("must be between 16 and 1048576".into()));
                }
                self.plan_max_period = v;
            }
            "plan_min_moves" => self.plan_min_moves = parse_fraction(value).map_err(bad)?,
            "extent_generations" => self.extent_generations = parse_bool(value).map_err(bad)?,
            "stream_arenas" => {
                self.stream_arenas = match value {
                    "shared" => StreamArenas::Shared,
                    // `true` and `false` were this key's values until session 12.
                    "own" | "true" => StreamArenas::Own,
                    "first" | "false" => StreamArenas::First,
                    _ => return Err(bad("expected 'shared', 'own' or 'first'".into())),
                }
            }
            "magazines" => self.magazines = parse_bool(value).map_err(bad)?,
            "busy_freers" => {
                self.busy_freers = match value {
                    "pass" => BusyFreers::Pass,
                    "wait" => BusyFreers::Wait,
                    _ => return Err(bad("expected 'pass' or 'wait'".into())),
                }
            }
            "record_stream" => {
                self.record_stream = match value {
                    "hold" => RecordStream::Hold,
                    "wait" => RecordStream::Wait,
                    _ => return Err(bad("expected 'hold' or 'wait'".into())),
                }
            }
            "thread_caches" => {
                self.thread_caches = value
                    .parse()
                    .map_err(|_| bad("expected a count of threads".into()))?
            }
            "page_slack_max" => self.page_slack_max = parse_fraction(value).map_err(bad)?,
            "move_budget" => self.move_budget = parse_fraction(value).map_err(bad)?,
            "page_slack" => self.page_slack = parse_fraction(value).map_err(bad)?,
            _ if REMOVED.iter().any(|(k, _)| *k == key) => {
                return Err(ConfigError::RemovedKey {
                    key: key.to_string(),
                    why: REMOVED
                        .iter()
                        .find(|(k, _)| *k == key)
                        .map_or("", |(_, why)| why),
                })
            }
            _ => {
                return Err(ConfigError::UnknownKey {
                    key: key.to_string(),
                })
            }
        }
        Ok(())
    }
}

impl FromStr for Config {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Config::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_keys_and_units() {
        let c = Config::parse(
            "slab_max_size:256KiB, experimental.mid_tier:stream,limit:8G,eager_unmap:true",
        )
        .unwrap();
        assert_eq!(c.slab_max_size, 256 << 10);
        assert_eq!(c.mid_tier, MidTier::Stream);
        assert_eq!(c.limit, Some(8 << 30));
        assert!(c.eager_unmap);
        assert_eq!(Config::parse("").unwrap(), Config::default());
    }

    #[test]
    fn removed_keys_say_why() {
        let e = Config::parse("experimental.cache_max_bytes:64M").unwrap_err();
        assert!(
            matches!(e, ConfigError::RemovedKey { ref key, .. } if key == "experimental.cache_max_bytes"),
            "{e:?}"
        );
        assert!(e.to_string().contains("Handoff"), "{e}");
    }

    #[test]
    fn unknown_key_lists_valid_keys() {
        let e = Config::parse("slab_max:1").unwrap_err();
        assert!(matches!(e, ConfigError::UnknownKey { ref key } if key == "slab_max"));
        let msg = e.to_string();
        for k in valid_keys() {
            assert!(msg.contains(k), "{msg} should list {k}");
        }
        let e = Config::parse("mid_tier:stream").unwrap_err();
        assert!(
            e.to_string().contains("experimental.mid_tier"),
            "a key moved under the experimental prefix names its new name: {e}"
        );
    }

    #[test]
    fn bad_values_are_errors() {
        for s in [
            "slab_max_size:12x",
            "slab_max_size:1",
            "experimental.mid_tier:gpu",
            "eager_unmap:maybe",
            "limit:-1",
            "experimental.short_horizon:ten",
            "limit:99999999999999999999",
            "old_generation:8388608",
        ] {
            assert!(
                matches!(Config::parse(s), Err(ConfigError::BadValue { .. })),
                "{s}"
            );
        }
        assert!(matches!(
            Config::parse("novalue"),
            Err(ConfigError::Malformed(_))
        ));
    }

    /// Each key's documented default is the default: setting every key to it changes nothing, and
    /// setting it to anything else the table allows would (checked for the experimental prefix too).
    #[test]
    fn documented_defaults_are_the_defaults() {
        for k in KEYS {
            let c = Config::parse(&format!("{}:{}", k.name, k.default))
                .unwrap_or_else(|e| panic!("{}: {e}", k.name));
            assert_eq!(c, Config::default(), "{} default {}", k.name, k.default);
        }
        assert_eq!(KEYS.len(), 27);
        assert!(matches!(
            Config::parse("experimental.limit:1G"),
            Err(ConfigError::UnknownKey { .. })
        ));
    }

    /// docs/CONFIG.md holds the table rendered from `KEYS`.
    #[test]
    fn the_config_doc_is_the_table() {
        let doc =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/CONFIG.md"))
                .expect("docs/CONFIG.md");
        assert!(
            doc.contains(&table()),
            "docs/CONFIG.md is out of date; paste in:\n{}",
            table()
        );
    }

    #[test]
    fn byte_units() {
        assert_eq!(parse_bytes("512").unwrap(), 512);
        assert_eq!(parse_bytes("2M").unwrap(), 2 << 20);
        assert_eq!(parse_bytes("1 GiB").unwrap(), 1 << 30);
        assert!(parse_bytes("1Q").is_err());
        assert!(parse_bytes("").is_err());
    }
}
