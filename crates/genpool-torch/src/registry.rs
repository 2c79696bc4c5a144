//! The plug-in's router: one [`genpool::Pools`] for the process, whose engines the plug-in's
//! [`Opener`] makes from its environment.
//!
//! The router keeps one engine per device index, created on first use (a `OnceLock` per slot: every
//! later call is one acquire load), the secondary engines of private pools (`pools.rs`) and tags
//! (`sleep_abi.rs`), routes frees by address and orders frees after `record_stream`'s streams. A failure
//! to open a device is cached too — a missing driver does not get better by retrying on every
//! allocation — and logged once when it happens. Engines are never dropped with the router: the process
//! (and with it the CUDA context) ends first, and PyTorch may free tensors during interpreter shutdown in
//! any order.
//!
//! What is the plug-in's own: which device implementation (`GENPOOL_DEVICE`), the configuration
//! (`GENPOOL_CONF`), and PyTorch's memory fraction per device.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};

use gen_device::{Device, DeviceKind, StreamId};
use genpool::{Config, Hint, Opener, Pool, Pools};

use crate::error::PluginError;
use crate::report;

/// The most device indices the plug-in serves (slots are static).
pub const MAX_DEVICES: usize = 64;
// A literal for the C header (cbindgen does not read other crates): the router's own bound.
const _: () = assert!(MAX_DEVICES == genpool::MAX_DEVICES);

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

/// Opens the device named by `GENPOOL_DEVICE` with the configuration of `GENPOOL_CONF`.
pub(crate) struct PluginOpener;

impl Opener for PluginOpener {
    type Error = PluginError;

    fn open(&self, index: usize) -> Result<Pool, PluginError> {
        report::init_logging();
        let res = (|| {
            let backend = backend()?;
            let cfg = Config::from_env()?;
            let device =
                genpool::devices::open_device(backend, index, gen_device::sim::DEFAULT_CAPACITY)
                    .map_err(|source| PluginError::Open {
                        index,
                        source: Box::new(source),
                    })?;
            build(index, device, cfg)
        })();
        if let Err(e) = &res {
            log::error!("genpool: device {index} unavailable: {e}");
        }
        res
    }

    fn invalid_device(&self, index: usize, count: usize) -> PluginError {
        PluginError::InvalidDevice {
            index: index as i64,
            bound: count,
        }
    }
}

/// The process-wide router. Its device count is [`MAX_DEVICES`] until PyTorch reports its own through
/// `genpool_init`.
pub(crate) static ROUTER: Pools<PluginOpener> = Pools::with_opener(PluginOpener);

#[allow(clippy::declare_interior_mutable_const)]
const NO_FRACTION: AtomicU64 = AtomicU64::new(0);
/// Per device: `f64` bits of the memory fraction set by PyTorch; 0 = none.
static FRACTION: [AtomicU64; MAX_DEVICES] = [NO_FRACTION; MAX_DEVICES];
static BACKEND: OnceLock<Result<DeviceKind, PluginError>> = OnceLock::new();

/// Record the device count PyTorch reported; indices at or past it are refused from now on.
pub(crate) fn set_device_count(count: usize) {
    ROUTER.set_count(count);
}

/// The exclusive bound on device indices in force.
pub(crate) fn bound() -> usize {
    ROUTER.count()
}

/// `index` as a slot index (no load: the router checks the device count when it is used).
#[inline]
pub(crate) fn slot_index(index: i64) -> Result<usize, PluginError> {
    match usize::try_from(index) {
        Ok(i) if i < MAX_DEVICES => Ok(i),
        _ => Err(PluginError::InvalidDevice {
            index,
            bound: bound(),
        }),
    }
}

/// `index` checked against the device count in force.
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

/// A device index and its default engine.
#[derive(Clone, Copy)]
pub(crate) struct DeviceState {
    index: usize,
    pub(crate) pool: &'static Pool,
}

/// The state of device `index`, its engine created on first use.
#[inline]
pub(crate) fn state(index: i64) -> Result<DeviceState, PluginError> {
    let i = slot_index(index)?;
    ROUTER.pool(i).map(|pool| DeviceState { index: i, pool })
}

/// The state of device `index` if its engine was created (and succeeded); never creates one.
pub(crate) fn existing(index: i64) -> Result<Option<DeviceState>, PluginError> {
    let i = slot_index(index)?;
    Ok(ROUTER
        .existing(i)?
        .map(|pool| DeviceState { index: i, pool }))
}

/// Every device state created so far.
pub(crate) fn all_existing() -> impl Iterator<Item = DeviceState> {
    ROUTER
        .existing_pools()
        .map(|(index, pool)| DeviceState { index, pool })
}

/// Allocate `size` bytes for `stream` from device `index`'s default engine, within the memory-fraction
/// cap (checked against `allocated`, the live bytes the cap counts).
#[inline]
pub(crate) fn alloc(
    index: i64,
    size: u64,
    stream: StreamId,
    allocated: impl FnOnce(&Pool) -> u64,
) -> Result<genpool::Block, PluginError> {
    let i = slot_index(index)?;
    ROUTER.alloc_admitted(i, size, stream, Hint::NONE, |pool| {
        check_cap(i, pool, size, || allocated(pool))
    })
}

fn build(index: usize, device: Arc<dyn Device>, cfg: Config) -> Result<Pool, PluginError> {
    let total = device.props().total_mem;
    let name = device.props().name.clone();
    let pool = Pool::new(device, cfg)?;
    log::info!(
        "genpool: device {index} ({name}, {total} B) ready: {:?}",
        pool.config()
    );
    Ok(pool)
}

pub(crate) fn fraction(index: usize) -> Option<f64> {
    match FRACTION[index].load(Relaxed) {
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
    FRACTION[i].store(fraction.to_bits(), Relaxed);
    Ok(())
}

/// The live-byte cap of device `index` (whose engine is `pool`) from the memory fraction, if one is set.
fn cap_of(index: usize, pool: &Pool) -> Option<u64> {
    fraction(index).map(|f| (f * pool.device().props().total_mem as f64) as u64)
}

/// Refuse an allocation of `size` that would take `allocated` live bytes past device `index`'s
/// memory-fraction cap, if one is set.
#[inline]
fn check_cap(
    index: usize,
    pool: &Pool,
    size: u64,
    allocated: impl FnOnce() -> u64,
) -> Result<(), PluginError> {
    if FRACTION[index].load(Relaxed) != 0 {
        if let Some(cap) = cap_of(index, pool) {
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

impl DeviceState {
    /// The device index.
    pub(crate) fn index(&self) -> usize {
        self.index
    }

    /// The live-byte cap from the memory fraction, if one is set.
    pub(crate) fn cap(&self) -> Option<u64> {
        cap_of(self.index, self.pool)
    }

    /// Refuse an allocation of `size` that would take `allocated` live bytes past the memory-fraction
    /// cap, if one is set.
    #[inline]
    pub(crate) fn check_cap(
        &self,
        size: u64,
        allocated: impl FnOnce() -> u64,
    ) -> Result<(), PluginError> {
        check_cap(self.index, self.pool, size, allocated)
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
    pub(crate) fn install(index: usize, device: Arc<dyn Device>, cfg: Config) -> DeviceState {
        use_sim();
        let pool = build(index, device, cfg).expect("pool over a test device");
        match ROUTER.install(index, pool) {
            Some(pool) => DeviceState { index, pool },
            None => panic!("slot {index} already in use"),
        }
    }
}
