//! Error types of this crate.

use gen_device::DeviceError;

/// [`StreamCache::put`](crate::StreamCache::put) refused a block because caching it would take the
/// cache over its byte bound. The caller still owns the block and frees it for real.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("stream cache full: caching {size} more bytes would exceed the {max}-byte bound ({cached} cached)")]
pub struct Overflow {
    /// Size of the refused block.
    pub size: u64,
    /// Bytes cached when it was refused.
    pub cached: u64,
    /// The configured bound ([`StreamCacheConfig::max_cached_bytes`](crate::StreamCacheConfig)).
    pub max: u64,
}

/// Why a free was rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InvalidFreeReason {
    /// The address was never handed out by this pool, or was already given back to the driver.
    NotOwned,
    /// The block is already free (sitting in the cache): a double free.
    AlreadyFree,
}

impl std::fmt::Display for InvalidFreeReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            InvalidFreeReason::NotOwned => "not allocated by this pool",
            InvalidFreeReason::AlreadyFree => "already free (double free)",
        })
    }
}

/// Errors of [`DriverPool`](crate::DriverPool).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StreamError {
    /// A zero-byte allocation.
    #[error("zero-byte allocation")]
    ZeroSize,
    /// The size overflows when rounded up to the pool's granularity.
    #[error("allocation of {0} bytes is too large")]
    TooLarge(u64),
    /// Free of an address this pool does not hold live.
    #[error("invalid free of {ptr:#x}: {reason}")]
    InvalidFree {
        /// The address passed to `free`.
        ptr: u64,
        /// What was wrong with it.
        reason: InvalidFreeReason,
    },
    /// A configuration value that cannot work.
    #[error("invalid configuration: {0}")]
    Config(&'static str),
    /// A device call failed (out of memory after the drain/trim/retry included).
    #[error(transparent)]
    Device(#[from] DeviceError),
}
