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
//! A private pool routes every block to the extent tier and has no periodic plan
//! (`experimental.routing:extent`, `plan:false`), so that any of its blocks can be placed again at its
//! address ([`genpool::Pool::alloc_at`]: CUDA graph trees restore a pool to a checkpoint), and it keeps
//! its mappings while it lives (`gen_vmm::PagePool::set_keep_mappings`): a graph's kernels use the
//! addresses its blocks had when it was captured, whatever became of those blocks since, so no address
//! of the pool may lose its page. Only an explicit `emptyCache` of the pool, or its release, gives its
//! free pages back. A pool released while a capture is underway is dropped after the capture (dropping
//! unmaps and synchronizes: the router drops no engine during a capture, and `sweep` runs after it).
//!
//! The router numbers its secondary engines as its owner says: private pools take the ids PyTorch
//! sees (1, 2, ...), tags (`sleep_abi.rs`) the numbers from [`TAG_ENGINES`] up.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use genpool::Pool;

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

/// The configuration of a private pool: the device pool's, every block in the extent tier, no plan.
pub(crate) fn private_config(device_pool: &Pool) -> genpool::Config {
    genpool::Config {
        routing: genpool::Routing::Extent,
        plan: false,
        ..device_pool.config().clone()
    }
}

/// Create a private pool on `state`'s device (see the module doc for its configuration).
pub(crate) fn create(state: DeviceState) -> Result<u64, PluginError> {
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    ROUTER.add_engine_with(state.index(), id, |main| {
        let pool = Pool::new(main.device().clone(), private_config(main))?;
        pool.page_pool().set_keep_mappings(true);
        Ok(pool)
    })?;
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
    if let (true, Some(e)) = (is_private(id), ROUTER.engine(index, id)?) {
        // No graph replays from it any more: its free pages may move and go back.
        e.pool().page_pool().set_keep_mappings(false);
        if ROUTER.release_engine(index, id)? {
            return Ok(());
        }
    }
    Err(PluginError::UnknownPool { device: index, id })
}

/// Give back what private pool `p` caches, its free mappings included (an explicit `emptyCache` of the
/// pool: as PyTorch's allocator, what a graph still replaying uses is the caller's to keep). Bytes.
pub(crate) fn trim(p: &PrivatePool) -> u64 {
    let pages = p.pool().page_pool();
    let keep = !p.is_released();
    pages.set_keep_mappings(false);
    let n = p.pool().trim();
    pages.set_keep_mappings(keep);
    n
}

/// Drop the released private pools of device `index` whose blocks are all freed (after a capture).
pub(crate) fn sweep(index: usize) {
    if let Err(e) = ROUTER.sweep_released(index) {
        log::error!("genpool: dropping released pools of device {index}: {e}");
    }
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
