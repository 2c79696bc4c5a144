//! Classifier configuration: horizons, learning rate, table sizes, priors.

use thiserror::Error;

/// A lifetime horizon on both clocks: a block *fits* a horizon when it was freed within `allocs`
/// allocations **and** within `bytes` allocated bytes of its own allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Horizon {
    /// Allocation-clock bound (allocations made after this one, up to and including its free).
    pub allocs: u64,
    /// Byte-clock bound (bytes allocated after this one); `u64::MAX` disables the byte clock.
    pub bytes: u64,
}

impl Horizon {
    /// Whether a lifetime of `allocs` allocations and `bytes` bytes fits inside this horizon.
    #[inline]
    pub fn fits(&self, allocs: u64, bytes: u64) -> bool {
        allocs <= self.allocs && bytes <= self.bytes
    }
}

/// Why a [`ClassifierConfig`] was rejected by [`ClassifierConfigBuilder::build`].
#[derive(Clone, Debug, Error, PartialEq)]
pub enum ConfigError {
    /// A horizon is zero or the short horizon is not strictly inside the mid horizon.
    #[error("horizons must satisfy 0 < short < mid on the allocation clock and 0 < short <= mid on the byte clock (short {short:?}, mid {mid:?})")]
    Horizons {
        /// The rejected short horizon.
        short: Horizon,
        /// The rejected mid horizon.
        mid: Horizon,
    },
    /// The forgetting factor is outside `[0.25, 0.9375]`.
    #[error("decay must lie in [0.25, 0.9375], got {0}")]
    Decay(f32),
    /// The key table capacity is not a power of two in `64..=1 << 24`.
    #[error("table capacity must be a power of two in 64..=16777216, got {0}")]
    Capacity(usize),
    /// The probe limit is outside `1..=64` or larger than the capacity.
    #[error("max_probes must be in 1..=64, got {0}")]
    Probes(u32),
    /// `size_sub_bits` is above 3.
    #[error("size_sub_bits must be at most 3, got {0}")]
    SizeSubBits(u32),
    /// `phase_buckets` is outside `1..=64`.
    #[error("phase_buckets must be in 1..=64, got {0}")]
    PhaseBuckets(u32),
    /// `sample_every` is not a power of two in `1..=256`, or `track_below` is above 255.
    #[error("sample_every must be a power of two in 1..=256 and track_below at most 255, got {0}")]
    Sampling(u32),
}

/// Configuration of a [`Classifier`](crate::Classifier). Build it with [`ClassifierConfig::builder`]
/// (validated) or take [`ClassifierConfig::default`]; the defaults are justified from the real traces in
/// `docs/ARCHITECTURE.md`.
#[derive(Clone, Debug, PartialEq)]
pub struct ClassifierConfig {
    /// Short horizon. Default: 64 allocations, byte clock off.
    pub(crate) short: Horizon,
    /// Mid horizon. Default: 65 536 allocations, byte clock off.
    pub(crate) mid: Horizon,
    /// Forgetting factor applied to a key's class weights before each observation. Default 0.75.
    pub(crate) decay: f32,
    /// Key table slots (power of two). Default 8192.
    pub(crate) capacity: usize,
    /// Linear probes before a key is declared unkeyable (table full). Default 16.
    pub(crate) max_probes: u32,
    /// Sub-buckets per power of two in the size bucket (as bits). Default 2 (four per octave).
    pub(crate) size_sub_bits: u32,
    /// Position-in-iteration buckets once marks give a period (1 = position ignored). Default 8.
    pub(crate) phase_buckets: u32,
    /// Whether the call-site tag takes part in the key. Default true.
    pub(crate) use_site: bool,
    /// An unseen key allocated after at least this many allocations without a free (or before the first
    /// free of the run) is predicted Long: weights and optimizer state are created in such bursts.
    /// Default 16; 0 disables.
    pub(crate) prior_burst_allocs: u64,
    /// Smallest size the burst prior calls Long. Default 0 (any size).
    pub(crate) prior_long_min_size: u64,
    /// Observations a key needs before a flip of its prediction counts as a drift event. Default 4.
    pub(crate) drift_min_obs: u32,
    /// Once a key has [`ClassifierConfig::track_below`] observations, one allocation in this many (a power
    /// of two) is *tracked* — its lifetime measured, scored and learned, its overdue bucket kept; the
    /// others only read the key's prediction. Default 8; 1 tracks every allocation.
    pub(crate) sample_every: u32,
    /// Keys with fewer observations than this track every allocation, so a new key learns at once.
    /// Default 4.
    pub(crate) track_below: u32,
}

impl Default for ClassifierConfig {
    fn default() -> Self {
        Self {
            short: Horizon {
                allocs: 64,
                bytes: u64::MAX,
            },
            mid: Horizon {
                allocs: 1 << 16,
                bytes: u64::MAX,
            },
            decay: 0.75,
            capacity: 8192,
            max_probes: 16,
            size_sub_bits: 2,
            phase_buckets: 8,
            use_site: true,
            prior_burst_allocs: 16,
            prior_long_min_size: 0,
            drift_min_obs: 4,
            sample_every: 8,
            track_below: 4,
        }
    }
}

impl ClassifierConfig {
    /// A builder starting from the defaults.
    pub fn builder() -> ClassifierConfigBuilder {
        ClassifierConfigBuilder {
            cfg: Self::default(),
        }
    }
    /// The short horizon (default 64 allocations, byte clock off).
    pub fn short_horizon(&self) -> Horizon {
        self.short
    }
    /// The mid horizon (default 65 536 allocations, byte clock off).
    pub fn mid_horizon(&self) -> Horizon {
        self.mid
    }
    /// The forgetting factor (default 0.75).
    pub fn decay(&self) -> f32 {
        self.decay
    }
    /// Key table capacity in slots (default 8192).
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    /// Whether the call-site tag is part of the key (default true).
    pub fn use_site(&self) -> bool {
        self.use_site
    }
    /// Position-in-iteration buckets (default 8).
    pub fn phase_buckets(&self) -> u32 {
        self.phase_buckets
    }
    /// One tracked allocation in this many once a key is warm (default 8; 1 = all).
    pub fn sample_every(&self) -> u32 {
        self.sample_every
    }
}

/// Validated builder for [`ClassifierConfig`]; every setter documents its default.
#[derive(Clone, Debug)]
pub struct ClassifierConfigBuilder {
    cfg: ClassifierConfig,
}

impl ClassifierConfigBuilder {
    /// Short horizon (default `{ allocs: 64, bytes: u64::MAX }`).
    pub fn short_horizon(mut self, h: Horizon) -> Self {
        self.cfg.short = h;
        self
    }
    /// Mid horizon (default `{ allocs: 65536, bytes: u64::MAX }`).
    pub fn mid_horizon(mut self, h: Horizon) -> Self {
        self.cfg.mid = h;
        self
    }
    /// Forgetting factor in `[0.25, 0.9375]` (default 0.75: a key flips after ~3 contrary observations).
    pub fn decay(mut self, d: f32) -> Self {
        self.cfg.decay = d;
        self
    }
    /// Key table capacity, a power of two in `64..=1 << 24` (default 8192).
    pub fn capacity(mut self, c: usize) -> Self {
        self.cfg.capacity = c;
        self
    }
    /// Linear probes per lookup, `1..=64` (default 16).
    pub fn max_probes(mut self, p: u32) -> Self {
        self.cfg.max_probes = p;
        self
    }
    /// Size sub-bucket bits per octave, `0..=3` (default 2).
    pub fn size_sub_bits(mut self, b: u32) -> Self {
        self.cfg.size_sub_bits = b;
        self
    }
    /// Position-in-iteration buckets, `1..=64` (default 8; 1 ignores the position). The position is
    /// counted from the latest [`Classifier::mark_iteration`](crate::Classifier::mark_iteration).
    pub fn phase_buckets(mut self, n: u32) -> Self {
        self.cfg.phase_buckets = n;
        self
    }
    /// Whether the call-site tag is part of the key (default true).
    pub fn use_site(mut self, on: bool) -> Self {
        self.cfg.use_site = on;
        self
    }
    /// Allocations without a free after which unseen keys are predicted Long (default 16; 0 disables).
    pub fn prior_burst_allocs(mut self, n: u64) -> Self {
        self.cfg.prior_burst_allocs = n;
        self
    }
    /// Smallest size the burst prior calls Long (default 0: any size).
    pub fn prior_long_min_size(mut self, n: u64) -> Self {
        self.cfg.prior_long_min_size = n;
        self
    }
    /// Observations before a prediction flip counts as drift (default 4).
    pub fn drift_min_obs(mut self, n: u32) -> Self {
        self.cfg.drift_min_obs = n;
        self
    }
    /// Track one allocation in `n` of a warm key, `n` a power of two in `1..=256` (default 8; 1 tracks
    /// every allocation, as before sampling: tests that compare exact scores use it).
    pub fn sample_every(mut self, n: u32) -> Self {
        self.cfg.sample_every = n;
        self
    }
    /// Observations below which a key tracks every allocation, `0..=255` (default 4).
    pub fn track_below(mut self, n: u32) -> Self {
        self.cfg.track_below = n;
        self
    }
    /// Validates and returns the configuration.
    pub fn build(self) -> Result<ClassifierConfig, ConfigError> {
        let c = self.cfg;
        if c.short.allocs == 0
            || c.short.bytes == 0
            || c.short.allocs >= c.mid.allocs
            || c.short.bytes > c.mid.bytes
        {
            return Err(ConfigError::Horizons {
                short: c.short,
                mid: c.mid,
            });
        }
        if !(0.25..=0.9375).contains(&c.decay) {
            return Err(ConfigError::Decay(c.decay));
        }
        if !c.capacity.is_power_of_two() || !(64..=1 << 24).contains(&c.capacity) {
            return Err(ConfigError::Capacity(c.capacity));
        }
        if !(1..=64).contains(&c.max_probes) {
            return Err(ConfigError::Probes(c.max_probes));
        }
        if c.size_sub_bits > 3 {
            return Err(ConfigError::SizeSubBits(c.size_sub_bits));
        }
        if !(1..=64).contains(&c.phase_buckets) {
            return Err(ConfigError::PhaseBuckets(c.phase_buckets));
        }
        if !c.sample_every.is_power_of_two() || c.sample_every > 256 {
            return Err(ConfigError::Sampling(c.sample_every));
        }
        if c.track_below > 255 {
            return Err(ConfigError::Sampling(c.track_below));
        }
        Ok(c)
    }
}
