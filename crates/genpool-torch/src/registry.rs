//! One engine per device index, created on first use and kept for the life of the process.
//!
//! Each slot is a `OnceLock`: the first call for a device builds its [`Pool`] (or records why it could
//! not), every later call is one acquire load. A failure is cached too — a missing driver does not get
//! better by retrying on every allocation — and logged once when it happens. Pools are never dropped: the
//! process (and with it the CUDA context) ends first, and PyTorch may free tensors during interpreter
//! shutdown in any order.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};

use gen_device::{Device, EventHandle, StreamId};
use genpool::{Config, Hint, Pool};
use parking_lot::Mutex;

use crate::error::PluginError;
use crate::report;

/// The most device indices the plug-in serves (slots are static).
pub const MAX_DEVICES: usize = 64;

/// Which `Device` implementation backs the pools (`GENPOOL_DEVICE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Backend {
    /// The simulated host device (tests, smoke runs without a GPU).
    Sim,
    /// The CUDA driver (the default for the plug-in).
    Cuda,
    /// CUDA if a driver and device are present, else the simulator.
    Auto,
}

impl Backend {
    pub(crate) fn parse(s: &str) -> Result<Backend, PluginError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "sim" => Ok(Backend::Sim),
            "cuda" | "" => Ok(Backend::Cuda),
            "auto" => Ok(Backend::Auto),
            _ => Err(PluginError::BadDeviceKind(s.to_string())),
        }
    }

    fn kind(self) -> gen_device::DeviceKind {
        match self {
            Backend::Sim => gen_device::DeviceKind::Sim,
            Backend::Cuda => gen_device::DeviceKind::Cuda,
            Backend::Auto => gen_device::DeviceKind::Auto,
        }
    }
}

/// One device's engine plus the plug-in's per-device state.
pub(crate) struct DeviceState {
    index: usize,
    pub(crate) pool: Pool,
    /// Spare events for ordering frees after recorded streams (an event can be re-recorded as soon as a
    /// `stream_wait_event` on it was issued: the wait captures the record made before it).
    events: Mutex<Vec<EventHandle>>,
    /// `stream_wait_event`s issued for frees of blocks with recorded streams.
    pub(crate) stream_waits: AtomicU64,
    /// Frees ordered by a whole-device synchronize because an event call failed.
    pub(crate) sync_fallbacks: AtomicU64,
    /// Lowest address this device ever handed out (`u64::MAX` before the first).
    lo: AtomicU64,
    /// One past the highest byte this device ever handed out (0 before the first).
    hi: AtomicU64,
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
static BACKEND: OnceLock<Result<Backend, PluginError>> = OnceLock::new();

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

fn backend() -> Result<Backend, PluginError> {
    BACKEND
        .get_or_init(|| match std::env::var("GENPOOL_DEVICE") {
            Ok(v) => Backend::parse(&v),
            Err(_) => Ok(Backend::Cuda),
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
            open_device(backend, index).map_err(|source| PluginError::Open { index, source })?;
        build(index, device, cfg)
    })();
    if let Err(e) = &res {
        log::error!("genpool: device {index} unavailable: {e}");
    }
    res
}

/// A simulated device of ordinal `index` whose addresses never meet another index's (as GPUs under
/// unified virtual addressing), so a free can be routed by address.
fn sim_device(index: usize) -> Result<Arc<dyn Device>, gen_device::DeviceError> {
    let offset = index as u64 * gen_device::sim::ORDINAL_STRIDE;
    Ok(Arc::new(
        gen_device::sim::SimConfig::new()
            .ordinal(index)
            .address_offset(offset)
            .build()?,
    ))
}

fn open_device(backend: Backend, index: usize) -> Result<Arc<dyn Device>, gen_device::DeviceError> {
    match backend {
        Backend::Sim => sim_device(index),
        Backend::Cuda => gen_device::open(backend.kind(), index),
        Backend::Auto => match gen_device::open(gen_device::DeviceKind::Cuda, index) {
            Err(gen_device::DeviceError::NoDriver(why)) => {
                log::info!("genpool: no CUDA ({why}); using the simulated device");
                sim_device(index)
            }
            other => other,
        },
    }
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
        events: Mutex::new(Vec::new()),
        stream_waits: AtomicU64::new(0),
        sync_fallbacks: AtomicU64::new(0),
        lo: AtomicU64::new(u64::MAX),
        hi: AtomicU64::new(0),
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
        // Relaxed: a free of this block on another thread got the pointer after this call, through
        // some synchronization, and coherence makes it see these stores.
        if ptr < self.lo.load(Relaxed) {
            self.lo.fetch_min(ptr, Relaxed);
        }
        if ptr + size > self.hi.load(Relaxed) {
            self.hi.fetch_max(ptr + size, Relaxed);
        }
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
        self.lo.load(Relaxed) <= addr && addr < self.hi.load(Relaxed)
    }

    /// Make `stream` wait for the work queued so far on each of `others`, so that a block freed on
    /// `stream` is not reused before kernels on those streams are done with it. If an event call fails,
    /// falls back to synchronizing the device; if that fails too the error is returned and the caller
    /// must not free the block.
    pub(crate) fn order_after(
        &self,
        ptr: u64,
        others: &[StreamId],
        stream: StreamId,
    ) -> Result<(), PluginError> {
        let dev = self.pool.device();
        for &other in others.iter().filter(|&&s| s != stream) {
            if let Err(e) = self.wait_one(dev.as_ref(), other, stream) {
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

    fn wait_one(
        &self,
        dev: &dyn Device,
        other: StreamId,
        stream: StreamId,
    ) -> Result<(), gen_device::DeviceError> {
        let spare = self.events.lock().pop();
        let event = match spare {
            Some(e) => e,
            None => dev.event_create()?,
        };
        let res = dev
            .event_record(event, other)
            .and_then(|()| dev.stream_wait_event(stream, event));
        self.events.lock().push(event);
        res
    }
}

/// Test hooks: choose the simulator and install pools on chosen devices.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    /// Make every lazily created device a simulated one (first caller wins; all tests agree).
    pub(crate) fn use_sim() {
        let _ = BACKEND.set(Ok(Backend::Sim));
        assert_eq!(backend(), Ok(Backend::Sim));
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
