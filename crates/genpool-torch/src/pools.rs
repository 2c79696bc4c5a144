//! Private pools: engine instances beside a device's default pool, for PyTorch's `MemPool`s and the
//! private pools of CUDA graphs.
//!
//! A private pool is a [`genpool::Pool`] of its own over the same device: its blocks, freed or not, are
//! reused only by allocations routed to it, and its pages are its own (what a graph's kernels use stays
//! out of everybody else's reach until the pool is released). A pool released while blocks are still
//! live (a graph's outputs) stays until its last block is freed, then is dropped, which gives its pages
//! back to the driver.
//!
//! A private pool routes every block to the extent tier and has no periodic plan
//! (`experimental.routing:extent`, `plan:false`), so that any of its blocks can be placed again at its
//! address ([`genpool::Pool::alloc_at`]: CUDA graph trees restore a pool to a checkpoint), and it keeps
//! its mappings while it lives (`gen_vmm::PagePool::set_keep_mappings`): a graph's kernels use the
//! addresses its blocks had when it was captured, whatever became of those blocks since, so no address
//! of the pool may lose its page. Only an explicit `emptyCache` of the pool, or its release, gives its
//! free pages back. A pool released while a capture is underway is dropped after the capture (dropping
//! unmaps and synchronizes).
//!
//! The table is read on every free once any private pool exists, so it is a short vector under a
//! read-write lock; while none exists a free reads one counter.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use genpool::{GenpoolError, LiveBlock, Pool};
use parking_lot::RwLock;

use crate::error::PluginError;
use crate::registry::{self, DeviceState, MAX_DEVICES};

/// One private pool.
pub(crate) struct PrivatePool {
    /// Its id (never 0, which names the device's default pool).
    pub(crate) id: u64,
    pub(crate) pool: Pool,
    /// Released by its owner: no new allocations; dropped once its last block is freed.
    released: AtomicBool,
}

type Table = RwLock<Vec<Arc<PrivatePool>>>;

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY: Table = RwLock::new(Vec::new());
static TABLES: [Table; MAX_DEVICES] = [EMPTY; MAX_DEVICES];
#[allow(clippy::declare_interior_mutable_const)]
const ZERO: AtomicUsize = AtomicUsize::new(0);
static COUNTS: [AtomicUsize; MAX_DEVICES] = [ZERO; MAX_DEVICES];
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// The configuration of a private pool: the device pool's, every block in the extent tier, no plan.
pub(crate) fn private_config(device_pool: &Pool) -> genpool::Config {
    genpool::Config {
        routing: genpool::Routing::Extent,
        plan: false,
        ..device_pool.config().clone()
    }
}

/// Create a private pool on `state`'s device (see the module doc for its configuration).
pub(crate) fn create(state: &DeviceState) -> Result<u64, PluginError> {
    let pool = Pool::new(state.pool.device().clone(), private_config(&state.pool))?;
    pool.page_pool().set_keep_mappings(true);
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let mut t = TABLES[state.index()].write();
    t.push(Arc::new(PrivatePool {
        id,
        pool,
        released: AtomicBool::new(false),
    }));
    COUNTS[state.index()].store(t.len(), Ordering::Release);
    log::info!("genpool: private pool {id} on device {}", state.index());
    Ok(id)
}

/// The private pool `id` of device `index`, if it exists and is not released.
pub(crate) fn get(index: usize, id: u64) -> Result<Arc<PrivatePool>, PluginError> {
    TABLES[index]
        .read()
        .iter()
        .find(|p| p.id == id && !p.released.load(Ordering::Acquire))
        .cloned()
        .ok_or(PluginError::UnknownPool { device: index, id })
}

/// Whether device `index` has any private pool.
#[inline]
pub(crate) fn any(index: usize) -> bool {
    COUNTS[index].load(Ordering::Acquire) != 0
}

/// The private pool of device `index` holding the live block `ptr`, if any.
pub(crate) fn owner(index: usize, ptr: u64) -> Option<Arc<PrivatePool>> {
    TABLES[index]
        .read()
        .iter()
        .find(|p| p.pool.lookup(ptr).is_some())
        .cloned()
}

/// Every private pool of device `index` (released ones included: their blocks are still live).
pub(crate) fn all(index: usize) -> Vec<Arc<PrivatePool>> {
    TABLES[index].read().clone()
}

fn drop_if_done(index: usize, p: &PrivatePool) {
    if p.pool.device().captures().active() {
        // Dropping unmaps and synchronizes: after the capture (`sweep`).
        return;
    }
    if p.released.load(Ordering::Acquire) && p.pool.live_blocks() == 0 {
        let mut t = TABLES[index].write();
        // Checked again under the write lock: no allocation can reach a released pool, and a free of
        // its last block is the only way here.
        if p.pool.live_blocks() == 0 {
            t.retain(|q| q.id != p.id);
            COUNTS[index].store(t.len(), Ordering::Release);
            log::info!("genpool: private pool {} of device {index} dropped", p.id);
        }
    }
}

/// Free `ptr`, a live block of private pool `p` of device `index`, on its own stream.
pub(crate) fn free(index: usize, p: &PrivatePool, ptr: u64) -> Result<LiveBlock, GenpoolError> {
    let b = p.pool.free_owned(ptr)?;
    drop_if_done(index, p);
    Ok(b)
}

/// Release private pool `id` of device `index`: no allocation reaches it any more; it is dropped now if
/// it holds no live block, else when its last one is freed. Unknown or already released ids are refused.
pub(crate) fn release(index: usize, id: u64) -> Result<(), PluginError> {
    let p = get(index, id)?;
    p.released.store(true, Ordering::Release);
    // No graph replays from it any more: its free pages may move and go back.
    p.pool.page_pool().set_keep_mappings(false);
    p.pool.trim();
    drop_if_done(index, &p);
    Ok(())
}

/// Give back what private pool `p` caches, its free mappings included (an explicit `emptyCache` of the
/// pool: as PyTorch's allocator, what a graph still replaying uses is the caller's to keep). Bytes.
pub(crate) fn trim(p: &PrivatePool) -> u64 {
    let pages = p.pool.page_pool();
    let keep = !p.released.load(Ordering::Acquire);
    pages.set_keep_mappings(false);
    let n = p.pool.trim();
    pages.set_keep_mappings(keep);
    n
}

/// Drop the released private pools of device `index` whose blocks are all freed (after a capture).
pub(crate) fn sweep(index: usize) {
    for p in all(index) {
        drop_if_done(index, &p);
    }
}

/// The state of device `index` and, for `id != 0`, its private pool `id`.
pub(crate) fn resolve(
    index: i64,
    id: u64,
) -> Result<(&'static DeviceState, Option<Arc<PrivatePool>>), PluginError> {
    let state = registry::state(index)?;
    if id == 0 {
        return Ok((state, None));
    }
    Ok((state, Some(get(state.index(), id)?)))
}
