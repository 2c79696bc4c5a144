//! One engine per device index, created on first use and kept for the life of the process.
//!
//! Each slot is a `OnceLock`: the first call for a device builds its [`Pool`] (or records why it could
//! not), every later call is one acquire load. A failure is cached too — a missing driver does not get
//! better by retrying on every allocation — and logged once when it happens. Pools are never dropped: the
//! process (and with it the CUDA context) ends first, and PyTorch may free tensors during interpreter
//! shutdown in any order.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};

use gen_device::{Device, DeviceKind, StreamId};
use genpool::devices::{AddressBounds, EventSpares};
use genpool::{Config, Hint, Pool};

use crate::error::PluginError;
use crate::report;

/// The most device indices the plug-in serves (slots are static).
pub const MAX_DEVICES: usize = 64;

/// Which `Device` implementation backs the pools (`GENPOOL_DEVICE`: `sim`, `cuda` or `auto`; unset or
/// empty: `cuda`, the plug-in's default — a plug-in loaded into PyTorch without a GPU should fail, not
/// quietly simulate).
pub(crate) fn parse_device_kind(s: &str) -> Result<DeviceKind, PluginError> {
    if s.trim().is_empty() {
        return Ok(DeviceKind::Cuda);
    }
    s.parse()
        .map_err(|_| PluginError::BadDeviceKind(s.to_string()))
}

/// One device's engine plus the plug-in's per-device state.
pub(crate) struct DeviceState {
    index: usize,
    pub(crate) pool: Pool,
    /// Spare events for ordering frees after recorded streams.
    events: EventSpares,
    /// `stream_wait_event`s issued for frees of blocks with recorded streams.
    pub(crate) stream_waits: AtomicU64,
    /// Frees ordered by a whole-device synchronize because an event call failed.
    pub(crate) sync_fallbacks: AtomicU64,
    /// The addresses this device ever handed out (frees are routed by address).
    bounds: AddressBounds,
}

struct Slot {
    state: OnceLock<Result<DeviceState, PluginError>>,
    /// `f64` bits of the memory fraction set by PyTorch; 0 = none.
    fraction: AtomicU64,
}

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY_SLOT: Slot = Slot {
    state: OnceLock::new(),
    fraction: AtomicU64::new(0),
};
static SLOTS: [Slot; MAX_DEVICES] = [EMPTY_SLOT; MAX_DEVICES];
/// Device count reported by PyTorch through `genpool_init` (`usize::MAX` = not told: [`MAX_DEVICES`]
/// bounds the indices).
static DEVICE_COUNT: AtomicUsize = AtomicUsize::new(usize::MAX);
static BACKEND: OnceLock<Result<DeviceKind, PluginError>> = OnceLock::new();

/// Record the device count PyTorch reported; indices at or past it are refused from now on.
pub(crate) fn set_device_count(count: usize) {
    DEVICE_COUNT.store(count.min(MAX_DEVICES), Relaxed);
}

/// The exclusive bound on device indices in force.
pub(crate) fn bound() -> usize {
    DEVICE_COUNT.load(Relaxed).min(MAX_DEVICES)
}

pub(crate) fn check_index(index: i64) -> Result<usize, PluginError> {
    let bound = bound();
    if index < 0 || index as u64 >= bound as u64 {
        return Err(PluginError::InvalidDevice { index, bound });
    }
    Ok(index as usize)
}

fn backend() -> Result<DeviceKind, PluginError> {
    BACKEND
        .get_or_init(|| match std::env::var("GENPOOL_DEVICE") {
            Ok(v) => parse_device_kind(&v),
            Err(_) => Ok(DeviceKind::Cuda),
        })
        .clone()
}

/// The state of device `index`, created on first use.
#[inline]
pub(crate) fn state(index: i64) -> Result<&'static DeviceState, PluginError> {
    let i = check_index(index)?;
    match SLOTS[i].state.get_or_init(|| open(i)) {
        Ok(s) => Ok(s),
        Err(e) => Err(e.clone()),
    }
}

/// The state of device `index` if it was created (and succeeded); never creates one.
pub(crate) fn existing(index: i64) -> Result<Option<&'static DeviceState>, PluginError> {
    let i = check_index(index)?;
    Ok(SLOTS[i].state.get().and_then(|r| r.as_ref().ok()))
}

/// Every device state created so far.
pub(crate) fn all_existing() -> impl Iterator<Item = &'static DeviceState> {
    SLOTS
        .iter()
        .filter_map(|s| s.state.get().and_then(|r| r.as_ref().ok()))
}

fn open(index: usize) -> Result<DeviceState, PluginError> {
    report::init_logging();
    let res = (|| {
        let backend = backend()?;
        let cfg = Config::from_env()?;
        let device =
            genpool::devices::open_device(backend, index, gen_device::sim::DEFAULT_CAPACITY)
                .map_err(|source| PluginError::Open { index, source })?;
        build(index, device, cfg)
    })();
    if let Err(e) = &res {
        log::error!("genpool: device {index} unavailable: {e}");
    }
    res
}

/// The created device whose address range holds `addr`, other than `not` (a free PyTorch issued with
/// another device's index, or one that came through a peer). `#devices` pairs of relaxed loads.
pub(crate) fn owner_by_address(addr: u64, not: usize) -> Option<&'static DeviceState> {
    all_existing().find(|s| s.index != not && s.contains(addr))
}

fn build(index: usize, device: Arc<dyn Device>, cfg: Config) -> Result<DeviceState, PluginError> {
    let total = device.props().total_mem;
    let name = device.props().name.clone();
    let pool = Pool::new(device, cfg)?;
    log::info!(
        "genpool: device {index} ({name}, {total} B) ready: {:?}",
        pool.config()
    );
    Ok(DeviceState {
        index,
        pool,
        events: EventSpares::new(),
        stream_waits: AtomicU64::new(0),
        sync_fallbacks: AtomicU64::new(0),
        bounds: AddressBounds::new(),
    })
}

pub(crate) fn fraction(index: usize) -> Option<f64> {
    match SLOTS[index].fraction.load(Relaxed) {
        0 => None,
        bits => Some(f64::from_bits(bits)),
    }
}

/// Cap device `index`'s live bytes at `fraction` of its memory (PyTorch's
/// `set_per_process_memory_fraction`); it can be raised or lowered at any time. A hard cap on the pages
/// the engine holds is `GENPOOL_CONF=limit:<bytes>`.
pub(crate) fn set_fraction(index: i64, fraction: f64) -> Result<(), PluginError> {
    let i = check_index(index)?;
    if !(fraction > 0.0 && fraction <= 1.0) {
        return Err(PluginError::BadFraction(fraction));
    }
    SLOTS[i].fraction.store(fraction.to_bits(), Relaxed);
    Ok(())
}

impl DeviceState {
    /// The device index.
    pub(crate) fn index(&self) -> usize {
        self.index
    }

    /// The live-byte cap from the memory fraction, if one is set.
    pub(crate) fn cap(&self) -> Option<u64> {
        fraction(self.index).map(|f| (f * self.pool.device().props().total_mem as f64) as u64)
    }

    /// Refuse an allocation of `size` that would take `allocated` live bytes past the memory-fraction
    /// cap, if one is set.
    #[inline]
    pub(crate) fn check_cap(
        &self,
        size: u64,
        allocated: impl FnOnce() -> u64,
    ) -> Result<(), PluginError> {
        if SLOTS[self.index].fraction.load(Relaxed) != 0 {
            if let Some(cap) = self.cap() {
                let allocated = allocated();
                if allocated.saturating_add(size) > cap {
                    return Err(PluginError::OverFraction {
                        requested: size,
                        allocated,
                        cap,
                    });
                }
            }
        }
        Ok(())
    }

    /// Note that the default pool handed out `[ptr, ptr + size)` (the address bounds frees route by).
    #[inline]
    pub(crate) fn note_range(&self, ptr: u64, size: u64) {
        self.bounds.note(ptr, size);
    }

    /// Allocate through the engine, within the memory-fraction cap.
    #[inline]
    pub(crate) fn alloc(&self, size: u64, stream: StreamId) -> Result<u64, PluginError> {
        self.check_cap(size, || self.pool.allocated())?;
        let b = self.pool.alloc(size, stream, Hint::NONE)?;
        self.note_range(b.ptr, b.size);
        Ok(b.ptr)
    }

    /// Whether `addr` lies in the range of addresses this device ever handed out.
    #[inline]
    pub(crate) fn contains(&self, addr: u64) -> bool {
        self.bounds.contains(addr)
    }

    /// Make `stream` wait for the work queued so far on each of `others`, so that a block freed on
    /// `stream` is not reused before kernels on those streams are done with it. If an event call fails,
    /// falls back to synchronizing the device (not while a capture is underway: then the error is
    /// returned); if that fails too the error is returned and the caller must not free the block.
    pub(crate) fn order_after(
        &self,
        ptr: u64,
        others: &[StreamId],
        stream: StreamId,
    ) -> Result<(), PluginError> {
        let dev = self.pool.device();
        for &other in others.iter().filter(|&&s| s != stream) {
            if let Err(e) = self.events.order_after(dev.as_ref(), other, stream) {
                if dev.captures().active() {
                    // A capture forbids the synchronize: the block stays allocated (leaked).
                    return Err(PluginError::StreamOrder { ptr, source: e });
                }
                log::warn!(
                    "genpool: event ordering for {ptr:#x} failed ({e}); synchronizing the device"
                );
                self.sync_fallbacks.fetch_add(1, Relaxed);
                return dev
                    .synchronize()
                    .map_err(|source| PluginError::StreamOrder { ptr, source });
            }
            self.stream_waits.fetch_add(1, Relaxed);
        }
        Ok(())
    }
}

/// Test hooks: choose the simulator and install pools on chosen devices.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    /// Make every lazily created device a simulated one (first caller wins; all tests agree).
    pub(crate) fn use_sim() {
        let _ = BACKEND.set(Ok(DeviceKind::Sim));
        assert_eq!(backend(), Ok(DeviceKind::Sim));
    }

    /// Install a pool over `device` in slot `index`, which no other test may use.
    pub(crate) fn install(
        index: usize,
        device: Arc<dyn Device>,
        cfg: Config,
    ) -> &'static DeviceState {
        use_sim();
        let state = build(index, device, cfg).expect("pool over a test device");
        assert!(
            SLOTS[index].state.set(Ok(state)).is_ok(),
            "slot {index} already in use"
        );
        match SLOTS[index].state.get() {
            Some(Ok(s)) => s,
            _ => unreachable!("just set"),
        }
    }
}
