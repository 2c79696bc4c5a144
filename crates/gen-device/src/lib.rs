//! The device seam: everything genpool's tiers need from a GPU, behind one trait.
//!
//! Two implementations:
//! - [`CudaDevice`]: the CUDA driver API through cudarc (dynamic loading, so the crate
//!   builds and links on machines with no CUDA; constructing it there is a clear [`DeviceError::NoDriver`]).
//! - [`SimDevice`]: a deterministic host-simulated GPU used by tests, CI and the default
//!   main job.
//!
//! Addresses are plain `u64` device addresses ([`DevicePtr`]); streams are the raw `CUstream` handle as an
//! integer ([`StreamId`], 0 = the legacy default stream), exactly what PyTorch's pluggable-allocator hook
//! hands over. All methods take `&self`: a device is shared by every tier and thread (`Send + Sync`).
//!
//! Device memory is not Rust memory: releasing or unmapping device memory that a kernel still uses is a
//! *device-side* hazard the callers (the tiers) prevent with stream ordering and events; it is never Rust
//! UB, so these methods are safe functions that return errors.

use std::fmt;

use std::os::fd::BorrowedFd;
use std::str::FromStr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

pub mod cuda;
pub mod hash;
pub mod ipc;
pub mod sim;
pub mod testing;

pub use cuda::CudaDevice;
pub use sim::{CallKind, SimCalls, SimConfig, SimDevice, SimOutstanding};

/// Which implementation [`open`] returns.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    /// A [`SimDevice`] with the default configuration (the ordinal is recorded in its props).
    Sim,
    /// A [`CudaDevice`]; errors when no driver or device is present.
    Cuda,
    /// CUDA when a driver and the device are present, else a [`SimDevice`] (with a log line saying why).
    #[default]
    Auto,
}

/// The error of parsing a [`DeviceKind`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown device kind {0:?}: expected \"sim\", \"cuda\" or \"auto\"")]
pub struct ParseDeviceKindError(pub String);

impl FromStr for DeviceKind {
    type Err = ParseDeviceKindError;
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "sim" => Ok(DeviceKind::Sim),
            "cuda" => Ok(DeviceKind::Cuda),
            "auto" => Ok(DeviceKind::Auto),
            _ => Err(ParseDeviceKindError(s.to_string())),
        }
    }
}

impl fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DeviceKind::Sim => "sim",
            DeviceKind::Cuda => "cuda",
            DeviceKind::Auto => "auto",
        })
    }
}

/// Open device `ordinal` of the given kind, shared by the tiers.
///
/// `Auto` falls back to a [`SimDevice`] only when CUDA is absent ([`DeviceError::NoDriver`]); any other
/// CUDA error (an ordinal out of range, a driver failure) is returned, so a misconfigured GPU machine does
/// not silently run on the simulator.
pub fn open(kind: DeviceKind, ordinal: usize) -> Result<Arc<dyn Device>> {
    match kind {
        DeviceKind::Sim => Ok(Arc::new(SimConfig::new().ordinal(ordinal).build()?)),
        DeviceKind::Cuda => Ok(Arc::new(CudaDevice::new(ordinal)?)),
        DeviceKind::Auto => match CudaDevice::new(ordinal) {
            Ok(d) => Ok(Arc::new(d)),
            Err(DeviceError::NoDriver(why)) => {
                log::info!("no CUDA ({why}); using the simulated device");
                Ok(Arc::new(SimConfig::new().ordinal(ordinal).build()?))
            }
            Err(e) => Err(e),
        },
    }
}

/// A device virtual address.
pub type DevicePtr = u64;
/// A stream handle as an integer (`CUstream` cast to `u64`; 0 is the legacy default stream).
pub type StreamId = u64;

/// A physical memory allocation made for virtual-memory mapping (`CUmemGenericAllocationHandle`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PhysHandle(pub u64);

/// A stream-ordered memory pool (`CUmemoryPool`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PoolHandle(pub u64);

/// An event (`CUevent`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EventHandle(pub u64);

/// Pinned (page-locked) host memory made by [`Device::host_alloc`] (`cuMemAllocHost`). The device keeps
/// the buffer's length: copies to and from it are checked against it, so no raw host pointer crosses
/// the seam.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HostHandle(pub u64);

/// Static facts about a device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceProps {
    /// Device ordinal (index).
    pub ordinal: usize,
    /// Human-readable name, e.g. "NVIDIA H200" or "SimDevice".
    pub name: String,
    /// Total device memory in bytes.
    pub total_mem: u64,
    /// Granularity of physical allocations and mappings for the VMM path (2 MiB on current GPUs).
    pub vmm_granularity: u64,
    /// Whether the VMM calls (`va_reserve`, `phys_create`, `map`, `unmap`) are available.
    pub supports_vmm: bool,
    /// Whether stream-ordered memory pools are available.
    pub supports_pools: bool,
}

/// Usage figures of a stream-ordered pool, as the driver reports them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolUsage {
    /// `CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`.
    pub reserved_current: u64,
    /// `CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH`.
    pub reserved_high: u64,
    /// `CU_MEMPOOL_ATTR_USED_MEM_CURRENT`.
    pub used_current: u64,
    /// `CU_MEMPOOL_ATTR_USED_MEM_HIGH`.
    pub used_high: u64,
}

/// Bytes held from the driver, now and at peak (see [`Device::reserved`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reserved {
    /// Bytes held now.
    pub current: u64,
    /// Highest value of `current` since the device was opened.
    pub peak: u64,
}

/// Everything that can go wrong at the device seam. Every variant names the call that failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    /// The device (or the simulated device's capacity) cannot satisfy the request right now.
    #[error("{call}: out of device memory ({requested} bytes requested)")]
    OutOfMemory {
        /// The call that failed.
        call: &'static str,
        /// Bytes requested by that call.
        requested: u64,
    },
    /// The driver returned an error.
    #[error("{call}: CUDA driver error {code} ({message})")]
    Driver {
        /// The call that failed.
        call: &'static str,
        /// The `CUresult` code.
        code: i32,
        /// The driver's name/description of the code.
        message: String,
    },
    /// No CUDA driver could be loaded, or no device is present.
    #[error("no CUDA driver or device: {0}")]
    NoDriver(String),
    /// A device ordinal that does not exist.
    #[error("invalid device {ordinal}: {count} device(s) present")]
    InvalidDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// How many devices exist.
        count: usize,
    },
    /// The device does not support this operation (e.g. VMM or memory pools).
    #[error("{0}: not supported by this device")]
    Unsupported(&'static str),
    /// An argument the device rejects (unaligned size, unknown handle, unmapped address ...).
    #[error("{call}: invalid argument: {detail}")]
    InvalidArgument {
        /// The call that failed.
        call: &'static str,
        /// What was wrong.
        detail: String,
    },
    /// An operating-system call failed (the file descriptors of CUDA IPC: `pidfd_open`, `pidfd_getfd`).
    #[error("{call}: {message} (errno {errno})")]
    Os {
        /// The call that failed.
        call: &'static str,
        /// `errno`.
        errno: i32,
        /// What it means here.
        message: String,
    },
}

impl DeviceError {
    /// True for the out-of-memory case, which callers answer by releasing caches and retrying.
    pub fn is_oom(&self) -> bool {
        matches!(self, DeviceError::OutOfMemory { .. })
    }
}

/// Result alias for device calls.
pub type Result<T, E = DeviceError> = std::result::Result<T, E>;

/// The device seam. Object safe: the tiers hold an `Arc<dyn Device>`.
///
/// Sizes passed to the VMM calls must be multiples of [`DeviceProps::vmm_granularity`]; VA and mapping
/// offsets must be aligned to it.
pub trait Device: Send + Sync + fmt::Debug {
    /// Static facts about this device.
    fn props(&self) -> &DeviceProps;

    /// Bytes this process holds from the driver through this `Device` (plain allocations, physical
    /// handles, and what its pools hold), now and at peak. The replay's "peak reserved" never reports less.
    fn reserved(&self) -> Reserved;

    /// `(free, total)` device memory in bytes (`cuMemGetInfo`).
    fn mem_info(&self) -> Result<(u64, u64)>;

    // ---- plain allocation (cuMemAlloc / cuMemFree) ----

    /// Allocate `bytes` of device memory (`cuMemAlloc`), 256-byte aligned or better.
    fn mem_alloc(&self, bytes: u64) -> Result<DevicePtr>;
    /// Release memory from [`Device::mem_alloc`] (`cuMemFree`).
    fn mem_free(&self, ptr: DevicePtr) -> Result<()>;

    // ---- virtual memory management ----

    /// Reserve `bytes` of virtual address space (`cuMemAddressReserve`), aligned to `align` (0 = default).
    fn va_reserve(&self, bytes: u64, align: u64) -> Result<DevicePtr>;
    /// Release a reservation made by [`Device::va_reserve`] (`cuMemAddressFree`). Must be fully unmapped.
    fn va_release(&self, ptr: DevicePtr, bytes: u64) -> Result<()>;
    /// Create `bytes` of physical memory (`cuMemCreate`, pinned device memory on this device).
    fn phys_create(&self, bytes: u64) -> Result<PhysHandle>;
    /// Release physical memory (`cuMemRelease`). Must not be mapped anywhere.
    fn phys_release(&self, handle: PhysHandle) -> Result<()>;
    /// Map the whole of `handle` (of `bytes`) at `va` and make it readable and writable by this device
    /// (`cuMemMap` + `cuMemSetAccess`).
    fn map(&self, va: DevicePtr, bytes: u64, handle: PhysHandle) -> Result<()>;
    /// Unmap `[va, va + bytes)` (`cuMemUnmap`). The range may span several whole mappings (one call for a
    /// run of pages). The physical memory stays alive until released.
    fn unmap(&self, va: DevicePtr, bytes: u64) -> Result<()>;
    /// Map `handles`, each of `bytes`, back to back from `va`, and make the whole run readable and
    /// writable by this device. On error nothing of the run stays mapped. The default maps one handle at
    /// a time with [`Device::map`]; the CUDA device makes one `cuMemMap` per handle and a single
    /// `cuMemSetAccess` for the run.
    fn map_run(&self, va: DevicePtr, bytes: u64, handles: &[PhysHandle]) -> Result<()> {
        for (i, &h) in handles.iter().enumerate() {
            if let Err(e) = self.map(va + i as u64 * bytes, bytes, h) {
                if i > 0 {
                    if let Err(e2) = self.unmap(va, i as u64 * bytes) {
                        log::error!("unmapping a partly mapped run: {e2}");
                    }
                }
                return Err(e);
            }
        }
        Ok(())
    }

    // ---- stream-ordered pools ----

    /// Create a private stream-ordered pool on this device (`cuMemPoolCreate`) with the given release
    /// threshold (`CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`; `u64::MAX` keeps everything cached).
    fn pool_create(&self, release_threshold: u64) -> Result<PoolHandle>;
    /// Destroy a pool (`cuMemPoolDestroy`).
    fn pool_destroy(&self, pool: PoolHandle) -> Result<()>;
    /// Stream-ordered allocation from `pool` on `stream` (`cuMemAllocFromPoolAsync`).
    fn pool_alloc_async(&self, pool: PoolHandle, bytes: u64, stream: StreamId)
        -> Result<DevicePtr>;
    /// Stream-ordered free on `stream` (`cuMemFreeAsync`).
    fn pool_free_async(&self, ptr: DevicePtr, stream: StreamId) -> Result<()>;
    /// Release unused pool memory down to `keep` bytes (`cuMemPoolTrimTo`).
    fn pool_trim(&self, pool: PoolHandle, keep: u64) -> Result<()>;
    /// Reserved/used current and high-water marks of `pool`.
    fn pool_usage(&self, pool: PoolHandle) -> Result<PoolUsage>;

    // ---- streams and events ----

    /// Create a non-blocking stream.
    fn stream_create(&self) -> Result<StreamId>;
    /// Destroy a stream made by [`Device::stream_create`].
    fn stream_destroy(&self, stream: StreamId) -> Result<()>;
    /// Block until all work queued on `stream` is done.
    fn stream_synchronize(&self, stream: StreamId) -> Result<()>;
    /// Create an event (timing disabled).
    fn event_create(&self) -> Result<EventHandle>;
    /// Destroy an event.
    fn event_destroy(&self, event: EventHandle) -> Result<()>;
    /// Record `event` on `stream` (`cuEventRecord`).
    fn event_record(&self, event: EventHandle, stream: StreamId) -> Result<()>;
    /// True when all work captured by the last record of `event` has completed (`cuEventQuery`).
    fn event_query(&self, event: EventHandle) -> Result<bool>;
    /// True when all work queued on `stream` so far has completed (`cuStreamQuery`): a snapshot, no
    /// wait. Not during a capture (the driver refuses it on a capturing stream).
    fn stream_query(&self, stream: StreamId) -> Result<bool>;
    /// Block the host until `event` has completed.
    fn event_synchronize(&self, event: EventHandle) -> Result<()>;
    /// Make future work on `stream` wait for `event` (`cuStreamWaitEvent`).
    fn stream_wait_event(&self, stream: StreamId, event: EventHandle) -> Result<()>;
    /// Block until all work on the device is done (`cuCtxSynchronize`).
    fn synchronize(&self) -> Result<()>;

    // ---- data movement (tests, pattern checks, the replay's touch mode) ----

    /// Copy host bytes to device memory (synchronous).
    fn write(&self, dst: DevicePtr, data: &[u8]) -> Result<()>;
    /// Copy device memory to host bytes (synchronous).
    fn read(&self, src: DevicePtr, out: &mut [u8]) -> Result<()>;
    /// Fill `[dst, dst + len)` with `byte`, stream-ordered on `stream`.
    fn memset_async(&self, dst: DevicePtr, byte: u8, len: u64, stream: StreamId) -> Result<()>;

    // ---- pinned host memory (sleep with offload) ----

    /// Allocate `bytes` of pinned host memory (`cuMemAllocHost`). Not counted in [`Device::reserved`].
    fn host_alloc(&self, bytes: u64) -> Result<HostHandle>;
    /// Release pinned host memory made by [`Device::host_alloc`] (`cuMemFreeHost`).
    fn host_free(&self, host: HostHandle) -> Result<()>;
    /// Copy `bytes` of device memory at `src` into `host` at `offset` (`cuMemcpyDtoH`, synchronous).
    /// A range outside the buffer is [`DeviceError::InvalidArgument`].
    fn copy_to_host(&self, host: HostHandle, offset: u64, src: DevicePtr, bytes: u64)
        -> Result<()>;
    /// Copy `bytes` of `host` from `offset` to device memory at `dst` (`cuMemcpyHtoD`, synchronous).
    fn copy_from_host(
        &self,
        dst: DevicePtr,
        host: HostHandle,
        offset: u64,
        bytes: u64,
    ) -> Result<()>;
    /// Cumulative counts of the hot-path driver calls made through this device (see [`CallCounts`]).
    fn call_counts(&self) -> CallCounts;

    /// Whether `stream` is being captured into a CUDA graph now (`cuStreamIsCapturing`). Mapping and
    /// unmapping memory is illegal during a capture. The default (and the simulator) says no.
    fn stream_is_capturing(&self, stream: StreamId) -> Result<bool> {
        let _ = stream;
        Ok(false)
    }

    // ---- captures (CUDA graphs): what the engine must not call meanwhile ----

    /// The captures underway on this device that its user told of ([`Captures`]). While one is underway
    /// the engine makes no call a capture forbids (`cuCtxSynchronize`, stream and event synchronizes,
    /// event queries, unmapping): it defers the work or fails with a typed error. Every engine of the
    /// device shares this one count, because they share the device object.
    fn captures(&self) -> &Captures;

    // ---- peers ----

    /// From now on make every new mapping readable and writable by device `peer` as well as this one.
    /// Returns `false` when `peer` had been added before. Mappings made earlier are the caller's to
    /// open to the peer ([`Device::set_peer_access`]).
    fn add_peer(&self, peer: usize) -> Result<bool>;
    /// Make `[va, va + bytes)`, mapped memory of this device, readable and writable by device `peer`
    /// (`cuMemSetAccess`); granularity-aligned.
    fn set_peer_access(&self, va: DevicePtr, bytes: u64, peer: usize) -> Result<()>;

    // ---- sharing physical memory with another process (CUDA IPC) ----

    /// A POSIX file descriptor for physical allocation `handle` (`cuMemExportToShareableHandle`), for
    /// another process to take with `pidfd_getfd` ([`ipc::ProcessFds::take`]). The device keeps the
    /// descriptor open, and returns the same one, until `handle` is released.
    fn export_handle(&self, handle: PhysHandle) -> Result<i32>;
    /// A physical allocation of `bytes` from a file descriptor of this process made by
    /// [`Device::export_handle`] in some process (`cuMemImportFromShareableHandle`). The descriptor
    /// stays the caller's; the handle maps like any other and is released with [`Device::phys_release`]
    /// (the memory lives until every process has released it). Not counted in [`Device::reserved`].
    fn import_handle(&self, fd: BorrowedFd<'_>, bytes: u64) -> Result<PhysHandle>;
}

/// Captures underway on a device (see [`Device::captures`]): a count that the device's user (the
/// PyTorch backend: `beginAllocateToPool` on a capturing stream, `endAllocateToPool`) raises and
/// lowers, read with one relaxed load by the paths that would synchronize.
#[derive(Debug, Default)]
pub struct Captures(AtomicU32);

impl Captures {
    /// No capture underway.
    pub const fn new() -> Self {
        Captures(AtomicU32::new(0))
    }

    /// A capture began.
    pub fn begin(&self) {
        self.0.fetch_add(1, Ordering::AcqRel);
    }

    /// A capture ended. Returns `false`, changing nothing, when none was underway.
    pub fn end(&self) -> bool {
        self.0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok()
    }

    /// Whether any capture is underway.
    #[inline]
    pub fn active(&self) -> bool {
        self.0.load(Ordering::Acquire) != 0
    }

    /// How many captures are underway.
    pub fn count(&self) -> u32 {
        self.0.load(Ordering::Acquire)
    }
}

/// Cumulative counts of the driver calls that cost on an allocator's hot path ([`Device::call_counts`]):
/// a warm pass of a training loop should make none of them. Counted by the device itself, failed calls
/// included, so no layer above can under-report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallCounts {
    /// Host waits of any kind: device, stream and event synchronizes.
    pub waits: u64,
    /// Of the waits, device-wide synchronizes (`cuCtxSynchronize`).
    pub device_syncs: u64,
    /// Pages or runs mapped (`cuMemMap` calls).
    pub maps: u64,
    /// Unmaps (`cuMemUnmap` calls).
    pub unmaps: u64,
    /// Physical pages created (`cuMemCreate`).
    pub creates: u64,
    /// Events recorded (`cuEventRecord`).
    pub event_records: u64,
    /// Event queries (`cuEventQuery`).
    pub event_queries: u64,
    /// Stream queries (`cuStreamQuery`).
    pub stream_queries: u64,
    /// Streams made to wait on an event (`cuStreamWaitEvent`).
    pub stream_waits: u64,
}

impl CallCounts {
    /// Counts made since `earlier`, field by field.
    pub fn since(&self, earlier: &CallCounts) -> CallCounts {
        CallCounts {
            waits: self.waits.saturating_sub(earlier.waits),
            device_syncs: self.device_syncs.saturating_sub(earlier.device_syncs),
            maps: self.maps.saturating_sub(earlier.maps),
            unmaps: self.unmaps.saturating_sub(earlier.unmaps),
            creates: self.creates.saturating_sub(earlier.creates),
            event_records: self.event_records.saturating_sub(earlier.event_records),
            event_queries: self.event_queries.saturating_sub(earlier.event_queries),
            stream_queries: self.stream_queries.saturating_sub(earlier.stream_queries),
            stream_waits: self.stream_waits.saturating_sub(earlier.stream_waits),
        }
    }

    /// The counts as `(name, value)` pairs, in declaration order (for reports).
    pub fn pairs(&self) -> [(&'static str, u64); 9] {
        [
            ("waits", self.waits),
            ("device_syncs", self.device_syncs),
            ("maps", self.maps),
            ("unmaps", self.unmaps),
            ("creates", self.creates),
            ("event_records", self.event_records),
            ("event_queries", self.event_queries),
            ("stream_queries", self.stream_queries),
            ("stream_waits", self.stream_waits),
        ]
    }
}

/// The check both devices make before a pinned-buffer copy: `host` is a live buffer (`len` is its size,
/// `None` for an unknown handle) and `[offset, offset + bytes)` lies inside it.
pub(crate) fn check_host_range(
    call: &'static str,
    host: HostHandle,
    len: Option<u64>,
    offset: u64,
    bytes: u64,
) -> Result<()> {
    let invalid = |detail: String| DeviceError::InvalidArgument { call, detail };
    let Some(len) = len else {
        return Err(invalid(format!("unknown pinned buffer {:#x}", host.0)));
    };
    match offset.checked_add(bytes) {
        Some(end) if end <= len => Ok(()),
        _ => Err(invalid(format!(
            "[{offset:#x}, +{bytes:#x}) is outside the pinned buffer of {len:#x} bytes"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_kind_parses_and_prints() {
        for (s, k) in [
            ("sim", DeviceKind::Sim),
            ("CUDA", DeviceKind::Cuda),
            (" auto ", DeviceKind::Auto),
        ] {
            let parsed: DeviceKind = s.parse().unwrap();
            assert_eq!(parsed, k);
            assert_eq!(parsed.to_string().parse::<DeviceKind>().unwrap(), k);
        }
        assert_eq!(
            "gpu".parse::<DeviceKind>(),
            Err(ParseDeviceKindError("gpu".into()))
        );
        assert_eq!(DeviceKind::default(), DeviceKind::Auto);
    }

    #[test]
    fn open_sim_records_the_ordinal() {
        let d = open(DeviceKind::Sim, 2).unwrap();
        assert_eq!(d.props().ordinal, 2);
        assert_eq!(d.props().name, "SimDevice");
        let p = d.mem_alloc(1).unwrap();
        d.mem_free(p).unwrap();
    }

    #[test]
    fn captures_count_and_refuse_an_end_without_a_begin() {
        let c = Captures::new();
        assert!(!c.active());
        assert!(!c.end(), "no capture underway");
        c.begin();
        c.begin();
        assert_eq!(c.count(), 2);
        assert!(c.end());
        assert!(c.active());
        assert!(c.end());
        assert!(!c.active());
        assert!(!c.end());
        assert_eq!(c.count(), 0);
    }

    #[test]
    fn errors_name_the_call_and_classify_oom() {
        let e = DeviceError::OutOfMemory {
            call: "cuMemCreate",
            requested: 4096,
        };
        assert!(e.is_oom());
        assert_eq!(
            e.to_string(),
            "cuMemCreate: out of device memory (4096 bytes requested)"
        );
        assert!(!DeviceError::Unsupported("x").is_oom());
    }
}
