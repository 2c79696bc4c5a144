//! The plug-in's typed errors. At the C boundary each becomes a NULL / no-op plus a last-error string.

use genpool::{ConfigError, DeviceError, GenpoolError, SleepError};

/// Everything the plug-in can refuse.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PluginError {
    /// A device index that is negative, beyond the count PyTorch reported to `genpool_init`, or beyond
    /// [`MAX_DEVICES`](crate::MAX_DEVICES).
    #[error("invalid device index {index} (valid: 0..{bound})")]
    InvalidDevice {
        /// The index given.
        index: i64,
        /// The exclusive upper bound in force.
        bound: usize,
    },
    /// `GENPOOL_DEVICE` is not one of `sim`, `cuda`, `auto`.
    #[error("bad GENPOOL_DEVICE '{0}': expected sim, cuda or auto")]
    BadDeviceKind(String),
    /// `GENPOOL_CONF` does not parse.
    #[error("bad GENPOOL_CONF: {0}")]
    Config(Box<ConfigError>),
    /// The device could not be opened (no driver, no such GPU ...).
    #[error("cannot open device {index}: {source}")]
    Open {
        /// The device index.
        index: usize,
        /// Why.
        source: Box<DeviceError>,
    },
    /// The engine refused (out of memory, invalid size, invalid free ...).
    #[error(transparent)]
    Engine(#[from] GenpoolError),
    /// The block was used on other streams and the plug-in could not order its free after their work, so
    /// the block is kept (leaked) rather than risk reuse while a kernel still uses it.
    #[error("cannot order the free of {ptr:#x} after its recorded streams: {source}")]
    StreamOrder {
        /// The block.
        ptr: u64,
        /// The device call that failed.
        source: Box<DeviceError>,
    },
    /// An allocation that would take the device's live bytes past the memory-fraction cap.
    #[error("out of memory: {requested} B requested with {allocated} B allocated would exceed the memory-fraction cap of {cap} B")]
    OverFraction {
        /// Bytes requested.
        requested: u64,
        /// Bytes live on the device.
        allocated: u64,
        /// The cap.
        cap: u64,
    },
    /// A private pool id that does not exist (never created, or released) on the device.
    #[error("no private pool {id} on device {device} (never created, or already released)")]
    UnknownPool {
        /// The device index.
        device: usize,
        /// The pool id given.
        id: u64,
    },
    /// A `set_per_process_memory_fraction` value outside `(0, 1]`.
    #[error("invalid memory fraction {0}: expected a value in (0, 1]")]
    BadFraction(f64),
    /// A negative device count from PyTorch's `init_fn`.
    #[error("invalid device count {0}")]
    InvalidDeviceCount(i64),
    /// The statistics could not be serialised.
    #[error("statistics serialisation failed: {0}")]
    Json(String),
    /// A tag name or tag list the plug-in refuses (`genpool_tag_set`, `genpool_sleep`, `genpool_wake`).
    #[error("bad tag: {0}")]
    BadTag(String),
    /// A tag never set with `genpool_tag_set`.
    #[error("unknown tag {0:?} (tags are made by genpool_tag_set / genpool_torch.region)")]
    UnknownTag(String),
    /// A tag's sleep or wake was refused or failed.
    #[error("tag {tag:?}: {source}")]
    Sleep {
        /// The tag.
        tag: String,
        /// Why.
        source: Box<SleepError>,
    },
    /// A block that cannot be sent to another process (CUDA IPC): not a live block of genpool's, or its
    /// pages cannot be exported.
    #[error("cannot share {ptr:#x} with another process: {reason}")]
    NotShareable {
        /// The pointer given.
        ptr: u64,
        /// Why.
        reason: String,
    },
    /// Opening another process's memory (CUDA IPC) failed: taking its descriptors, importing or mapping
    /// them.
    #[error("CUDA IPC: {what}: {source}")]
    Ipc {
        /// The step that failed.
        what: &'static str,
        /// The device or OS error.
        source: Box<DeviceError>,
    },
    /// Opening a device's memory to a peer device failed.
    #[error("giving device {peer} access to device {device}'s memory: {why}")]
    PeerAccess {
        /// The device whose memory is opened.
        device: usize,
        /// The peer.
        peer: usize,
        /// Why.
        why: String,
    },
    /// A Rust panic was caught at the C boundary (a bug; the call failed safely).
    #[error("internal panic in {call}: {message}")]
    Panic {
        /// The exported function.
        call: &'static str,
        /// The panic message.
        message: String,
    },
}

// The rare errors that carry strings are boxed so that every entry point's `Result` stays small (see
// `genpool::GenpoolError`).
impl From<ConfigError> for PluginError {
    fn from(e: ConfigError) -> Self {
        PluginError::Config(Box::new(e))
    }
}
