//! Private pools: engine instances beside a device's default pool, for PyTorch's `MemPool`s and the
//! private pools of CUDA graphs.
//!
//! A private pool is a secondary engine of the router ([`genpool::Engine`], [`genpool::Pools`]): a
//! [`genpool::Pool`] of its own over the same device, so its blocks, freed or not, are reused only by
//! allocations routed to it, and its pages are its own (what a graph's kernels use stays out of
//! everybody else's reach until the pool is released). A pool released while blocks are still live (a
//! graph's outputs) stays until its last block is freed, then is dropped, which gives its pages back to
//! the driver. Frees find its blocks by address, as every other block's.
//!
//! The router numbers its secondary engines as its owner says: private pools take the ids PyTorch
//! sees (1, 2, ...), tags (`sleep_abi.rs`) the numbers from [`TAG_ENGINES`] up.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::error::PluginError;
use crate::registry::{self, DeviceState, ROUTER};

/// One private pool: its [`genpool::Engine::id`] is the id PyTorch holds.
pub(crate) type PrivatePool = genpool::Engine;

/// The first engine number of tags: private pools' ids stay below it.
pub(crate) const TAG_ENGINES: u64 = 1 << 63;

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Whether engine number `id` is a private pool's (not the default engine's, not a tag's).
pub(crate) fn is_private(id: u64) -> bool {
    id != 0 && id < TAG_ENGINES
}

/// Create a private pool on `state`'s device, with the device pool's configuration.
pub(crate) fn create(state: DeviceState) -> Result<u64, PluginError> {
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    ROUTER.add_engine(state.index(), id)?;
    log::info!("genpool: private pool {id} on device {}", state.index());
    Ok(id)
}

/// The private pool `id` of device `index`, if it exists and is not released.
pub(crate) fn get(index: usize, id: u64) -> Result<Arc<PrivatePool>, PluginError> {
    ROUTER
        .engine(index, id)?
        .filter(|_| is_private(id))
        .ok_or(PluginError::UnknownPool { device: index, id })
}

/// Every private pool of device `index` (released ones included: their blocks are still live).
pub(crate) fn all(index: usize) -> Vec<Arc<PrivatePool>> {
    let mut engines = ROUTER.engines(index).unwrap_or_default();
    engines.retain(|e| is_private(e.id()));
    engines
}

/// Release private pool `id` of device `index`: no allocation reaches it any more; it is dropped now if
/// it holds no live block, else when its last one is freed. Unknown or already released ids are refused.
pub(crate) fn release(index: usize, id: u64) -> Result<(), PluginError> {
    if is_private(id) && ROUTER.release_engine(index, id)? {
        return Ok(());
    }
    Err(PluginError::UnknownPool { device: index, id })
}

/// The state of device `index` and, for `id != 0`, its private pool `id`.
pub(crate) fn resolve(
    index: i64,
    id: u64,
) -> Result<(DeviceState, Option<Arc<PrivatePool>>), PluginError> {
    let state = registry::state(index)?;
    if id == 0 {
        return Ok((state, None));
    }
    Ok((state, Some(get(state.index(), id)?)))
}
