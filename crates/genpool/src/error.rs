//! The engine's typed errors.

use gen_device::DeviceError;

/// Per-tier figures carried by an out-of-memory error.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct TierUsage {
    /// Tier name (`slab`, `extent`, `stream`, `buddy`).
    pub tier: &'static str,
    /// Bytes live in the tier.
    pub live: u64,
    /// Bytes the tier holds from the device (committed pages, or the driver pool's reservation).
    pub reserved: u64,
}

/// What an out-of-memory error knows about the moment it failed.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct OomReport {
    /// Bytes requested.
    pub requested: u64,
    /// Bytes live in the engine.
    pub live: u64,
    /// Bytes held from the device in total.
    pub reserved: u64,
    /// Per tier.
    pub tiers: Vec<TierUsage>,
    /// Largest free extent in the extent arena's address space that has pages behind it, if known.
    pub largest_free_extent: u64,
    /// The device's free memory as the driver reported it after the retry.
    pub device_free: Option<u64>,
}

impl std::fmt::Display for OomReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "requested {} B; live {} B; reserved {} B (",
            self.requested, self.live, self.reserved
        )?;
        for (i, t) in self.tiers.iter().enumerate() {
            if i > 0 {
                write!(f, ", ")?;
            }
            write!(f, "{}: {} live / {} reserved", t.tier, t.live, t.reserved)?;
        }
        write!(f, "); largest free extent {} B", self.largest_free_extent)?;
        if let Some(free) = self.device_free {
            write!(f, "; device free {free} B")?;
        }
        Ok(())
    }
}

/// Why a free was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FreeFault {
    /// The pointer was never returned by this pool (or was freed and its memory handed out again).
    Unknown,
    /// The pointer was returned by this pool but has already been freed.
    DoubleFree,
    /// A null pointer.
    Null,
}

impl std::fmt::Display for FreeFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FreeFault::Unknown => "not allocated by this pool",
            FreeFault::DoubleFree => "already freed (double free)",
            FreeFault::Null => "null pointer",
        })
    }
}

/// Everything the engine can refuse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GenpoolError {
    /// The device cannot hold the request even after the engine released everything it caches.
    #[error("out of memory: {0}")]
    OutOfMemory(Box<OomReport>),
    /// A size the engine will never serve.
    #[error("invalid size {size}: {reason}")]
    InvalidSize {
        /// The size asked for.
        size: u64,
        /// Why it is refused.
        reason: &'static str,
    },
    /// A free the engine refuses; nothing was changed.
    #[error("invalid free of {ptr:#x}: {fault}")]
    InvalidFree {
        /// The pointer given.
        ptr: u64,
        /// What was wrong.
        fault: FreeFault,
    },
    /// A device index that does not exist.
    #[error("invalid device {ordinal}: {count} device(s) present")]
    InvalidDevice {
        /// Index asked for.
        ordinal: usize,
        /// Devices present.
        count: usize,
    },
    /// A device call failed.
    #[error("device error: {0}")]
    Device(Box<DeviceError>),
    /// A block used on other streams whose free could not be ordered after their work (neither an event
    /// nor a device synchronize worked): it is kept (leaked) rather than risk reuse while a kernel still
    /// uses it.
    #[error("cannot order the free of {ptr:#x} after its recorded streams: {source}")]
    StreamOrder {
        /// The block.
        ptr: u64,
        /// The device call that failed.
        source: Box<DeviceError>,
    },
    /// Bad configuration.
    #[error(transparent)]
    Config(Box<crate::config::ConfigError>),
    /// An allocation from a pool that is asleep ([`Pool::sleep`](crate::Pool::sleep)): its physical
    /// memory is given back until [`Pool::wake`](crate::Pool::wake).
    #[error("the pool is asleep: allocations are refused until it is woken")]
    Asleep,
    /// Serving the call needs what a CUDA graph capture underway forbids (a device or event
    /// synchronize, an unmap); nothing changed and the capture stays valid.
    #[error("a CUDA graph capture is underway: {0} would invalidate it")]
    Capturing(&'static str),
    /// [`Pool::alloc_at`](crate::Pool::alloc_at) cannot place the block where asked.
    #[error("cannot allocate {size} B at {ptr:#x}: {reason}")]
    Unplaceable {
        /// The address asked for.
        ptr: u64,
        /// The size asked for.
        size: u64,
        /// Why not.
        reason: &'static str,
    },
}

// Boxed, the rare errors that carry strings keep every `Result` of the engine's calls small: the hot
// paths return them through several layers, and a 72-byte error made each layer copy ~80 bytes.
impl From<DeviceError> for GenpoolError {
    fn from(e: DeviceError) -> Self {
        GenpoolError::Device(Box::new(e))
    }
}

impl From<crate::config::ConfigError> for GenpoolError {
    fn from(e: crate::config::ConfigError) -> Self {
        GenpoolError::Config(Box::new(e))
    }
}

impl GenpoolError {
    /// True for [`GenpoolError::OutOfMemory`].
    pub fn is_oom(&self) -> bool {
        matches!(self, GenpoolError::OutOfMemory(_))
    }
}

/// Result alias of the engine.
pub type Result<T, E = GenpoolError> = std::result::Result<T, E>;
