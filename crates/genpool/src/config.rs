//! Engine configuration: a builder, and PyTorch-style `key:value,key:value` strings (`GENPOOL_CONF`).

use std::str::FromStr;

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
    /// By predicted lifetime and size (the design).
    Generational,
    /// Everything but slab-sized blocks to the extent arena, no classifier influence (a baseline that
    /// shows what the lifetime split buys).
    Single,
}

/// A bad configuration key or value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A key the engine does not know.
    #[error("unknown configuration key '{key}' (valid keys: {})", VALID_KEYS.join(", "))]
    UnknownKey {
        /// The key given.
        key: String,
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

/// Every key [`Config::parse`] accepts.
pub const VALID_KEYS: &[&str] = &[
    "slab_max_size",
    "mid_tier",
    "routing",
    "limit",
    "eager_unmap",
    "cache_max_bytes",
    "pool_release_threshold",
    "use_site",
    "short_horizon",
    "mid_horizon",
    "page_slack",
    "page_slack_max",
    "page_keep_old_mappings",
    "move_budget",
    "long_tier",
    "placement_candidates",
    "extent_generations",
    "stream_arenas",
    "plan",
    "plan_max_period",
    "plan_min_moves",
    "plan_pin",
    "plan_background",
];

/// Engine configuration. `Config::default()` is the tuned default; see docs/ARCHITECTURE.md.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Config {
    /// Largest block served by the slab (bytes; default 4 KiB); bigger short-lived blocks go to the
    /// extent arena. Each slab size class pins whole 2 MiB chunks, so on the shared traces classes above
    /// a few KiB cost more pages than the extent arena's tight packing (docs/BENCHMARKS.md).
    pub slab_max_size: u64,
    /// Where mid-lived blocks go.
    pub mid_tier: MidTier,
    /// Where long-lived blocks go (default: the extent arena, which packed long-lived blocks tighter than
    /// the buddy on the shared traces — docs/BENCHMARKS.md; `long_tier:buddy` selects gen-buddy).
    pub long_tier: LongTier,
    /// Routing policy.
    pub routing: Routing,
    /// Cap on the physical memory the engine's pages may hold (`None`: the device's).
    pub limit: Option<u64>,
    /// Unmap pages as soon as they are unused (debugging use-after-free; slower).
    pub eager_unmap: bool,
    /// Bound on bytes held in the exact-size stream-ordered front caches of the extent arena and the buddy
    /// (0 = no front cache: freed blocks go straight back to their tier). Off by default: cached blocks
    /// keep their pages, and on the shared traces a cache cost more in fragmentation and page moves
    /// than it saved (docs/BENCHMARKS.md).
    pub cache_max_bytes: u64,
    /// Release threshold of the mid tier's driver pool.
    pub pool_release_threshold: u64,
    /// Let the classifier use call-site tags when the caller provides them.
    pub use_site: bool,
    /// Classifier: allocations after which a live block is no longer short-lived (0 = classifier default).
    pub short_horizon: u64,
    /// Classifier: allocations after which a live block is no longer mid-lived (0 = classifier default).
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
    /// Give each predicted generation (short / mid / long) its own extent arena — its own range of
    /// address space over the shared page pool — instead of one arena for all.
    pub extent_generations: bool,
    /// Several streams: give each stream after the first an extent arena of its own (up to four; later
    /// streams share one), so that a block freed on the stream that allocates from its arena goes straight
    /// back to it — stream order makes that safe, as with one stream — instead of through the exact-size
    /// stream caches, whose blocks keep their pages. Pages still flow between the arenas through the
    /// page pool. With `extent_generations` the first stream keeps its three generation arenas. Off:
    /// the first stream's arena(s) for every stream, every free through the caches once a second stream
    /// is seen.
    pub stream_arenas: bool,
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
            slab_max_size: 4 << 10,
            mid_tier: MidTier::Extent,
            long_tier: LongTier::Extent,
            routing: Routing::Generational,
            limit: None,
            eager_unmap: false,
            cache_max_bytes: 0,
            pool_release_threshold: u64::MAX,
            use_site: true,
            short_horizon: 0,
            mid_horizon: 0,
            page_slack: 0.0,
            page_slack_max: 0.08,
            page_keep_old_mappings: true,
            move_budget: 0.005,
            placement_candidates: 1,
            extent_generations: false,
            stream_arenas: true,
            plan: true,
            plan_max_period: 8192,
            plan_min_moves: 0.005,
            plan_pin: true,
            plan_background: true,
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
        for entry in s.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let (k, v) = entry
                .split_once(':')
                .ok_or_else(|| ConfigError::Malformed(entry.into()))?;
            c.set(k.trim(), v.trim())?;
        }
        Ok(c)
    }

    /// Set one key from its string form.
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), ConfigError> {
        let bad = |reason: String| ConfigError::BadValue {
            key: key.to_string(),
            value: value.to_string(),
            reason,
        };
        match key {
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
                    _ => return Err(bad("expected 'generational' or 'single'".into())),
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
            "cache_max_bytes" => self.cache_max_bytes = parse_bytes(value).map_err(bad)?,
            "pool_release_threshold" => {
                self.pool_release_threshold = parse_bytes(value).map_err(bad)?
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
            "stream_arenas" => self.stream_arenas = parse_bool(value).map_err(bad)?,
            "page_slack_max" => self.page_slack_max = parse_fraction(value).map_err(bad)?,
            "move_budget" => self.move_budget = parse_fraction(value).map_err(bad)?,
            "page_slack" => self.page_slack = parse_fraction(value).map_err(bad)?,
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
        let c = Config::parse("slab_max_size:256KiB, mid_tier:stream,limit:8G,eager_unmap:true")
            .unwrap();
        assert_eq!(c.slab_max_size, 256 << 10);
        assert_eq!(c.mid_tier, MidTier::Stream);
        assert_eq!(c.limit, Some(8 << 30));
        assert!(c.eager_unmap);
        assert_eq!(Config::parse("").unwrap(), Config::default());
    }

    #[test]
    fn unknown_key_lists_valid_keys() {
        let e = Config::parse("slab_max:1").unwrap_err();
        assert!(matches!(e, ConfigError::UnknownKey { ref key } if key == "slab_max"));
        let msg = e.to_string();
        for k in VALID_KEYS {
            assert!(msg.contains(k), "{msg} should list {k}");
        }
    }

    #[test]
    fn bad_values_are_errors() {
        for s in [
            "slab_max_size:12x",
            "slab_max_size:1",
            "mid_tier:gpu",
            "eager_unmap:maybe",
            "limit:-1",
            "short_horizon:ten",
            "limit:99999999999999999999",
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

    #[test]
    fn byte_units() {
        assert_eq!(parse_bytes("512").unwrap(), 512);
        assert_eq!(parse_bytes("2M").unwrap(), 2 << 20);
        assert_eq!(parse_bytes("1 GiB").unwrap(), 1 << 30);
        assert!(parse_bytes("1Q").is_err());
        assert!(parse_bytes("").is_err());
    }
}
