//! The C functions PyTorch's backend (`python/genpool_torch/csrc/genpool_backend.cpp`, a subclass of
//! `c10::cuda::CUDACachingAllocator::CUDAAllocator`) calls. Unlike the pluggable-allocator hooks in
//! [`crate::abi`], a free needs no stream and no size (the engine remembers the block's stream), and
//! the figures PyTorch's `DeviceStats` wants are counted here (see [`crate::stats`]), so the C++ side
//! keeps no map and takes no lock on the hot path.
//!
//! Every function runs inside [`guard`]: no panic crosses into C++. Failures return a status code
//! ([`GENPOOL_OK`] ...) and leave the reason for `genpool_last_error`.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

use genpool::{GenpoolError, Hint, LiveBlock, Pool, Tier};

use crate::abi::{cudaStream_t, fail, guard};
use crate::error::PluginError;
use crate::pools;
use crate::registry::{self, DeviceState, MAX_DEVICES, ROUTER};
use crate::report;
use crate::sleep_abi;
use crate::stats::{DeviceCounters, GenpoolStat};
use crate::timing;

/// Success.
pub const GENPOOL_OK: c_int = 0;
/// Out of memory (the device, the memory-fraction cap, or a request larger than the device).
pub const GENPOOL_E_OOM: c_int = 1;
/// A bad argument: device index, private pool id, NULL output pointer.
pub const GENPOOL_E_INVALID: c_int = 2;
/// A free of a pointer genpool did not hand out, or freed twice.
pub const GENPOOL_E_FREE: c_int = 3;
/// Anything else (a device call failed, an internal error); the last error says what.
pub const GENPOOL_E_INTERNAL: c_int = 4;
/// The allocation's tag (or the device's default pool) is asleep (`genpool_sleep`).
pub const GENPOOL_E_ASLEEP: c_int = 5;
/// A CUDA graph capture is underway and the call would need what it forbids (nothing changed).
pub const GENPOOL_E_CAPTURING: c_int = 6;

#[allow(clippy::declare_interior_mutable_const)]
const COUNTERS_INIT: DeviceCounters = DeviceCounters::new();
pub(crate) static COUNTERS: [DeviceCounters; MAX_DEVICES] = [COUNTERS_INIT; MAX_DEVICES];
/// `torch.cuda.caching_allocator_enable(False)`: give cached memory back after every free.
static NOT_CACHING: AtomicBool = AtomicBool::new(false);

pub(crate) fn code(e: &PluginError) -> c_int {
    match e {
        PluginError::Engine(g) if g.is_oom() => GENPOOL_E_OOM,
        PluginError::Engine(GenpoolError::InvalidSize { size: 0, .. }) => GENPOOL_E_INVALID,
        PluginError::Engine(GenpoolError::InvalidSize { .. }) => GENPOOL_E_OOM,
        PluginError::OverFraction { .. } => GENPOOL_E_OOM,
        PluginError::Engine(GenpoolError::InvalidFree { .. }) => GENPOOL_E_FREE,
        PluginError::Engine(GenpoolError::Asleep) => GENPOOL_E_ASLEEP,
        PluginError::Engine(GenpoolError::Capturing(_)) => GENPOOL_E_CAPTURING,
        PluginError::InvalidDevice { .. }
        | PluginError::UnknownPool { .. }
        | PluginError::NotShareable { .. }
        | PluginError::Engine(GenpoolError::Unplaceable { .. }) => GENPOOL_E_INVALID,
        _ => GENPOOL_E_INTERNAL,
    }
}

pub(crate) fn status(r: Result<(), PluginError>) -> c_int {
    match r {
        Ok(()) => GENPOOL_OK,
        Err(e) => {
            fail(&e);
            code(&e)
        }
    }
}

/// Every engine of a device: its default pool, then its secondary engines (private pools and tags).
fn each_engine(state: DeviceState, mut f: impl FnMut(&Pool)) {
    f(state.pool);
    for e in ROUTER.engines(state.index()).unwrap_or_default() {
        f(e.pool());
    }
}

/// Bytes held from the driver by every pool of a device now.
fn reserved_now(state: DeviceState) -> u64 {
    let mut held = 0;
    each_engine(state, |p| held += p.reserved_now());
    held
}

fn alloc(
    size: usize,
    device: c_int,
    pool: u64,
    stream: cudaStream_t,
) -> Result<(u64, u64), PluginError> {
    let size = size as u64;
    let stream = stream.addr() as u64;
    let index = registry::slot_index(device.into())?;
    let counters = &COUNTERS[index];
    let b = if pool == 0 && !sleep_abi::tagged() {
        registry::alloc(device.into(), size, stream, |_| counters.live_bytes())?
    } else {
        let (state, private) = pools::resolve(device.into(), pool)?;
        state.check_cap(size, || counters.live_bytes())?;
        match &private {
            Some(p) => p.alloc(size, stream, Hint::NONE)?,
            // A thread inside `genpool_torch.region(tag)` (sleep_abi): the tag's engine.
            None => match sleep_abi::tagged_alloc_block(size, device.into(), stream) {
                Some(res) => res?,
                None => registry::alloc(device.into(), size, stream, |_| counters.live_bytes())?,
            },
        }
    };
    counters.on_alloc(b.size, size);
    Ok((b.ptr, b.size))
}

/// Allocate `size` bytes on device `device` for use on `stream`, from the device's default pool
/// (`pool == 0`) or from private pool `pool` ([`genpool_pool_create`]). On success stores the address in
/// `*out` and returns [`GENPOOL_OK`]; otherwise stores NULL and returns an error code (size 0 is
/// [`GENPOOL_E_INVALID`]).
///
/// # Safety
/// `out` is NULL or valid for one pointer write.
#[no_mangle]
pub unsafe extern "C" fn genpool_backend_malloc(
    size: usize,
    device: c_int,
    pool: u64,
    stream: cudaStream_t,
    out: *mut *mut c_void,
) -> c_int {
    guard("genpool_backend_malloc", GENPOOL_E_INTERNAL, || {
        timing::timed(&timing::MALLOC, || {
            if out.is_null() {
                report::set_last_error(&"genpool_backend_malloc: NULL out pointer");
                return GENPOOL_E_INVALID;
            }
            let res = if size == 0 {
                Err(PluginError::Engine(GenpoolError::InvalidSize {
                    size: 0,
                    reason: "zero-byte allocation",
                }))
            } else {
                alloc(size, device, pool, stream)
            };
            let (ptr, rc) = match res {
                // A device address, never dereferenced on the host: an address without provenance.
                Ok((p, _)) => (std::ptr::without_provenance_mut(p as usize), GENPOOL_OK),
                Err(e) => {
                    fail(&e);
                    let rc = code(&e);
                    if rc == GENPOOL_E_OOM {
                        if let Ok(i) = registry::check_index(device.into()) {
                            COUNTERS[i].ooms.fetch_add(1, Relaxed);
                        }
                    }
                    (std::ptr::null_mut(), rc)
                }
            };
            // SAFETY: `out` is non-null and valid for a write (this function's contract).
            unsafe { out.write(ptr) };
            rc
        })
    })
}

/// What a free gave back, for the profiler and the trace.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GenpoolFreed {
    /// The device the block belonged to.
    pub device: c_int,
    /// Bytes the block spanned.
    pub size: u64,
    /// Bytes asked for at its allocation.
    pub requested: u64,
    /// The stream it was allocated for.
    pub stream: u64,
    /// Its private pool (0: the device's default pool).
    pub pool: u64,
}

#[inline(always)]
pub(crate) fn free(ptr: u64) -> Result<(usize, LiveBlock, u64), PluginError> {
    // Whichever device and engine hold it; uses recorded by `genpool_record_stream` are waited for
    // first (on failure the block stays allocated, leaked: reusing it could race a kernel on them).
    let (f, b) = ROUTER.free_owned(ptr)?;
    COUNTERS[f.device].on_free(b.size, b.requested);
    if NOT_CACHING.load(Relaxed) {
        trim_engine(f.device, f.engine);
    }
    // Tags' blocks belong to the default pool as PyTorch sees it.
    let pool = if pools::is_private(f.engine) {
        f.engine
    } else {
        0
    };
    Ok((f.device, b, pool))
}

/// Give back what engine `id` (0: the default one) of device `index` caches.
fn trim_engine(index: usize, id: u64) -> u64 {
    match id {
        0 => ROUTER.existing(index).ok().flatten().map_or(0, Pool::trim),
        _ => ROUTER
            .engine(index, id)
            .ok()
            .flatten()
            .map_or(0, |e| e.pool().trim()),
    }
}

/// Free `ptr` on the stream it was allocated for (PyTorch's rule; other streams recorded with
/// [`crate::genpool_record_stream`] are waited for first), on whichever device and pool holds it. Fills
/// `*freed` (when not NULL) and returns [`GENPOOL_OK`]; a pointer genpool did not hand out, or one freed
/// twice, is refused with [`GENPOOL_E_FREE`] (counted, logged once per pointer, nothing changed). NULL is
/// a no-op.
///
/// # Safety
/// `freed` is NULL or valid for one [`GenpoolFreed`] write.
#[no_mangle]
pub unsafe extern "C" fn genpool_backend_free(ptr: *mut c_void, freed: *mut GenpoolFreed) -> c_int {
    guard("genpool_backend_free", GENPOOL_E_INTERNAL, || {
        timing::timed(&timing::FREE, || {
            if ptr.is_null() {
                return GENPOOL_OK;
            }
            let addr = ptr.addr() as u64;
            match free(addr) {
                Ok((device, b, pool)) => {
                    if !freed.is_null() {
                        let f = GenpoolFreed {
                            device: device as c_int,
                            size: b.size,
                            requested: b.requested,
                            stream: b.stream,
                            pool,
                        };
                        // SAFETY: non-null and valid for a write (this function's contract).
                        unsafe { freed.write(f) };
                    }
                    GENPOOL_OK
                }
                Err(e @ PluginError::Engine(GenpoolError::InvalidFree { .. })) => {
                    report::set_last_error(&e);
                    report::invalid_free(-1, addr, &e);
                    GENPOOL_E_FREE
                }
                Err(e) => {
                    fail(&e);
                    code(&e)
                }
            }
        })
    })
}

/// A live block, as [`genpool_backend_block`] and [`genpool_backend_snapshot`] describe it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GenpoolBlock {
    /// Device address.
    pub address: u64,
    /// Bytes it spans (the request rounded up to 512); for a gap in a snapshot's segment, the gap.
    pub size: u64,
    /// Bytes asked for (0 for a gap).
    pub requested: u64,
    /// The stream it was allocated for.
    pub stream: u64,
    /// 1 for a live block, 0 for a gap in a segment.
    pub allocated: u32,
    /// The tier serving it: 0 slab, 1 extent, 2 buddy, 3 driver pool.
    pub tier: u32,
}

fn tier_code(t: Tier) -> u32 {
    match t {
        Tier::Slab => 0,
        Tier::Extent => 1,
        Tier::Buddy => 2,
        Tier::Stream => 3,
    }
}

fn block_of(b: &LiveBlock) -> GenpoolBlock {
    GenpoolBlock {
        address: b.ptr,
        size: b.size,
        requested: b.requested,
        stream: b.stream,
        allocated: 1,
        tier: tier_code(b.tier()),
    }
}

/// Describe the live block starting at `ptr` (any device, any pool) into `*out`. Returns
/// [`GENPOOL_OK`], or [`GENPOOL_E_FREE`] when `ptr` is not the start of a live block of genpool's.
///
/// # Safety
/// `out` is NULL or valid for one [`GenpoolBlock`] write (NULL: only the status is returned).
#[no_mangle]
pub unsafe extern "C" fn genpool_backend_block(
    ptr: *const c_void,
    out: *mut GenpoolBlock,
) -> c_int {
    guard("genpool_backend_block", GENPOOL_E_INTERNAL, || {
        let addr = ptr.addr() as u64;
        let found = ROUTER.lookup(addr).map(|(_, _, b)| b);
        match found {
            Some(b) => {
                if !out.is_null() {
                    // SAFETY: non-null and valid for a write (this function's contract).
                    unsafe { out.write(block_of(&b)) };
                }
                GENPOOL_OK
            }
            None => GENPOOL_E_FREE,
        }
    })
}

/// PyTorch's `DeviceStats`, field for field (each array: all blocks, small pool ≤ 1 MiB, large pool).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GenpoolTorchStats {
    /// Live allocations.
    pub allocation: [GenpoolStat; 3],
    /// Segments: physical pages held (2 MiB each); `allocated`/`freed` count pages created/released.
    pub segment: [GenpoolStat; 3],
    /// Active blocks (= allocations: genpool has no block pending a free).
    pub active: [GenpoolStat; 3],
    /// Inactive split blocks (always 0: genpool maps pages only under live blocks).
    pub inactive_split: [GenpoolStat; 3],
    /// Bytes of live blocks (the request rounded up to 512).
    pub allocated_bytes: [GenpoolStat; 3],
    /// Bytes held from the driver (small: the slab tier's pages).
    pub reserved_bytes: [GenpoolStat; 3],
    /// Bytes of active blocks (= allocated bytes).
    pub active_bytes: [GenpoolStat; 3],
    /// Bytes of inactive split blocks (always 0).
    pub inactive_split_bytes: [GenpoolStat; 3],
    /// Bytes asked for.
    pub requested_bytes: [GenpoolStat; 3],
    /// Allocations that needed a release-and-retry.
    pub num_alloc_retries: i64,
    /// Allocations that failed with out-of-memory.
    pub num_ooms: i64,
    /// Device synchronizations the page layer made.
    pub num_sync_all_streams: i64,
    /// Physical pages created (`cuMemCreate`).
    pub num_device_alloc: i64,
    /// Physical pages given back (`cuMemRelease`).
    pub num_device_free: i64,
    /// Largest block size that may be split (-1: any, as PyTorch's default).
    pub max_split_size: i64,
}

fn device_stats(device: c_int) -> Result<GenpoolTorchStats, PluginError> {
    let mut out = GenpoolTorchStats {
        max_split_size: -1,
        ..Default::default()
    };
    let index = registry::check_index(device.into())?;
    let counters = &COUNTERS[index];
    for k in 0..3 {
        let (count, bytes, requested) = counters.read(k);
        out.allocation[k] = count;
        out.active[k] = count;
        out.allocated_bytes[k] = bytes;
        out.active_bytes[k] = bytes;
        out.requested_bytes[k] = requested;
    }
    let Some(state) = registry::existing(device.into())? else {
        return Ok(out);
    };
    let mut stats = Vec::new();
    each_engine(state, |p| stats.push(p.stats()));
    let (mut held, mut created, mut released, mut small, mut retries, mut syncs) =
        (0i64, 0i64, 0i64, 0i64, 0i64, 0i64);
    let (mut reserved, mut peak) = (0i64, 0i64);
    let mut page = 2 << 20;
    for s in stats {
        page = s.pages.page_size as i64;
        held += s.pages.pages_held as i64;
        created += s.pages.creates as i64;
        released += s.pages.releases as i64;
        retries += s.num_alloc_retries as i64;
        syncs += s.pages.syncs as i64;
        reserved += s.reserved_current as i64;
        // Each pool's peak since the last reset; with private pools their sum bounds the device's.
        peak += s.reserved_peak as i64;
        small += s
            .tiers
            .iter()
            .find(|t| t.tier == Tier::Slab.name())
            .map_or(0, |t| t.reserved as i64);
    }
    let peak = peak.max(reserved);
    let seg = GenpoolStat {
        current: held,
        peak: held.max(peak / page.max(1)),
        allocated: created,
        freed: released,
    };
    out.segment = [seg, GenpoolStat::default(), seg];
    out.segment[1].current = small / page.max(1);
    out.segment[2].current = held - out.segment[1].current;
    out.reserved_bytes[0] = GenpoolStat {
        current: reserved,
        peak,
        allocated: created * page,
        freed: released * page,
    };
    out.reserved_bytes[1].current = small;
    out.reserved_bytes[1].peak = small;
    out.reserved_bytes[2].current = reserved - small;
    out.reserved_bytes[2].peak = peak - small;
    out.num_alloc_retries = retries;
    out.num_ooms = counters.ooms.load(Relaxed);
    out.num_sync_all_streams = syncs;
    out.num_device_alloc = created;
    out.num_device_free = released;
    Ok(out)
}

/// Fill `*out` with device `device`'s statistics in PyTorch's terms (zeros for a device not used yet).
///
/// # Safety
/// `out` is valid for one [`GenpoolTorchStats`] write.
#[no_mangle]
pub unsafe extern "C" fn genpool_backend_stats(
    device: c_int,
    out: *mut GenpoolTorchStats,
) -> c_int {
    guard("genpool_backend_stats", GENPOOL_E_INTERNAL, || {
        if out.is_null() {
            report::set_last_error(&"genpool_backend_stats: NULL out pointer");
            return GENPOOL_E_INVALID;
        }
        match device_stats(device) {
            Ok(s) => {
                // SAFETY: non-null and valid for a write (this function's contract).
                unsafe { out.write(s) };
                GENPOOL_OK
            }
            Err(e) => {
                fail(&e);
                code(&e)
            }
        }
    })
}

/// Bytes live and bytes held from the driver on device `device` now (for the profiler's memory events;
/// cheap: no lock for the live bytes).
///
/// # Safety
/// `allocated` and `reserved` are each NULL or valid for one `u64` write.
#[no_mangle]
pub unsafe extern "C" fn genpool_backend_totals(
    device: c_int,
    allocated: *mut u64,
    reserved: *mut u64,
) -> c_int {
    guard("genpool_backend_totals", GENPOOL_E_INTERNAL, || {
        let r = registry::check_index(device.into()).and_then(|i| {
            let live = COUNTERS[i].live_bytes();
            let held = registry::existing(device.into())?.map_or(0, reserved_now);
            Ok((live, held))
        });
        match r {
            Ok((live, held)) => {
                if !allocated.is_null() {
                    // SAFETY: non-null and valid (this function's contract).
                    unsafe { allocated.write(live) };
                }
                if !reserved.is_null() {
                    // SAFETY: non-null and valid (this function's contract).
                    unsafe { reserved.write(held) };
                }
                GENPOOL_OK
            }
            Err(e) => {
                fail(&e);
                code(&e)
            }
        }
    })
}

/// `torch.cuda.reset_peak_memory_stats(device)`: every peak starts again from its current value.
#[no_mangle]
pub extern "C" fn genpool_backend_reset_peaks(device: c_int) -> c_int {
    guard("genpool_backend_reset_peaks", GENPOOL_E_INTERNAL, || {
        status((|| {
            let i = registry::check_index(device.into())?;
            if let Some(s) = registry::existing(device.into())? {
                each_engine(s, Pool::reset_peaks);
            }
            COUNTERS[i].reset_peaks();
            Ok(())
        })())
    })
}

/// `torch.cuda.reset_accumulated_memory_stats(device)`: the running totals start again from zero.
#[no_mangle]
pub extern "C" fn genpool_backend_reset_accumulated(device: c_int) -> c_int {
    guard(
        "genpool_backend_reset_accumulated",
        GENPOOL_E_INTERNAL,
        || status(registry::check_index(device.into()).map(|i| COUNTERS[i].reset_accumulated())),
    )
}

/// The largest block device `device` can hand out now without the process holding more than it may
/// (PyTorch's `cacheInfo`, which cuDNN's benchmark mode uses to size its workspace): the device's free
/// memory plus the physical pages genpool keeps unused (any address can take them), within the memory
/// fraction's cap and `GENPOOL_CONF`'s `limit`. 0 for an invalid device (last error set).
#[no_mangle]
pub extern "C" fn genpool_backend_cache_info(device: c_int) -> u64 {
    guard("genpool_backend_cache_info", 0, || {
        match (|| -> Result<u64, PluginError> {
            let state = registry::state(device.into())?;
            let s = state.pool.page_pool().stats();
            let idle = (s.pages_free_mapped + s.pages_free_unmapped) * s.page_size;
            let free = state
                .pool
                .device()
                .mem_info()
                .map_err(|source| PluginError::Open {
                    index: state.index(),
                    source: Box::new(source),
                })?
                .0;
            let mut best = free + idle;
            if let Some(limit) = state.pool.config().limit {
                best = best.min(limit.saturating_sub(s.bytes_held()) + idle);
            }
            if let Some(cap) = state.cap() {
                best = best.min(cap.saturating_sub(COUNTERS[state.index()].live_bytes()));
            }
            // Whole pages: a block of the result must fit in the pages it can get.
            Ok(best / s.page_size * s.page_size)
        })() {
            Ok(v) => v,
            Err(e) => {
                fail(&e);
                0
            }
        }
    })
}

/// `torch.cuda.caching_allocator_enable(value)`: with 0, what a free leaves cached is given back at once.
#[no_mangle]
pub extern "C" fn genpool_backend_set_caching(enabled: c_int) {
    guard("genpool_backend_set_caching", (), || {
        NOT_CACHING.store(enabled == 0, Relaxed)
    })
}

/// The memory fraction in force on device `device` (1.0 when none was set; -1.0 for an invalid index).
#[no_mangle]
pub extern "C" fn genpool_backend_memory_fraction(device: c_int) -> f64 {
    guard(
        "genpool_backend_memory_fraction",
        -1.0,
        || match registry::check_index(device.into()) {
            Ok(i) => registry::fraction(i).unwrap_or(1.0),
            Err(e) => {
                fail(&e);
                -1.0
            }
        },
    )
}

/// Create a private pool on device `device` (a `torch.cuda.MemPool`, a CUDA graph's pool). Returns its
/// id (never 0), or 0 on failure (last error set).
#[no_mangle]
pub extern "C" fn genpool_pool_create(device: c_int) -> u64 {
    guard("genpool_pool_create", 0, || {
        match registry::state(device.into()).and_then(pools::create) {
            Ok(id) => id,
            Err(e) => {
                fail(&e);
                0
            }
        }
    })
}

/// Release private pool `pool` of device `device`: no allocation reaches it any more; its memory goes
/// back to the driver once its last live block is freed (at once if none is live).
#[no_mangle]
pub extern "C" fn genpool_pool_release(device: c_int, pool: u64) -> c_int {
    guard("genpool_pool_release", GENPOOL_E_INTERNAL, || {
        status(registry::check_index(device.into()).and_then(|i| pools::release(i, pool)))
    })
}

/// Give back what pool `pool` of device `device` caches (`pool == 0`: the default pool; the private
/// pools are left alone). Returns bytes released (0 on failure, last error set).
#[no_mangle]
pub extern "C" fn genpool_pool_trim(device: c_int, pool: u64) -> u64 {
    guard("genpool_pool_trim", 0, || {
        match pools::resolve(device.into(), pool) {
            Ok((s, None)) => s.pool.trim(),
            Ok((_, Some(p))) => pools::trim(&p),
            Err(e) => {
                fail(&e);
                0
            }
        }
    })
}

/// A segment of a snapshot: a run of 2 MiB pages under live blocks of one tier of one pool.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GenpoolSegment {
    /// First byte (page-aligned).
    pub address: u64,
    /// Bytes (whole pages).
    pub total_size: u64,
    /// Bytes of live blocks in it.
    pub allocated_size: u64,
    /// Bytes their requests asked for.
    pub requested_size: u64,
    /// The stream of its first block.
    pub stream: u64,
    /// Its private pool (0: the default pool).
    pub pool: u64,
    /// Index of its first entry in the block array.
    pub first_block: u64,
    /// Entries (live blocks and gaps) in the block array.
    pub n_blocks: u64,
    /// Its tier (codes as [`GenpoolBlock::tier`]).
    pub tier: u32,
    /// 1 unless the tier is the slab (PyTorch's "large" segments).
    pub is_large: u32,
}

/// Segments and blocks of the pools of device `index` selected by `filter` (`None`: all).
pub(crate) fn snapshot(
    state: DeviceState,
    filter: Option<u64>,
) -> (Vec<GenpoolSegment>, Vec<GenpoolBlock>) {
    let page = state.pool.page_pool().page_size();
    let mut engines: Vec<(u64, Vec<LiveBlock>)> = Vec::new();
    if filter.is_none_or(|f| f == 0) {
        engines.push((0, state.pool.live_detailed()));
    }
    for p in pools::all(state.index()) {
        if filter.is_none_or(|f| f == p.id()) {
            engines.push((p.id(), p.pool().live_detailed()));
        }
    }
    let (mut segs, mut blocks) = (Vec::new(), Vec::new());
    for (id, live) in engines {
        for tier in Tier::ALL {
            let mut cur: Option<GenpoolSegment> = None;
            for b in live.iter().filter(|b| b.tier() == tier) {
                let start = b.ptr / page * page;
                let end = (b.ptr + b.size).div_ceil(page) * page;
                match cur.as_mut() {
                    Some(s) if start <= s.address + s.total_size => {
                        let cursor = blocks
                            .last()
                            .map_or(s.address, |l: &GenpoolBlock| l.address + l.size);
                        if b.ptr > cursor {
                            blocks.push(gap(cursor, b.ptr - cursor));
                        }
                        s.total_size = s.total_size.max(end - s.address);
                    }
                    _ => {
                        if let Some(s) = cur.take() {
                            close(s, &mut segs, &mut blocks);
                        }
                        cur = Some(GenpoolSegment {
                            address: start,
                            total_size: end - start,
                            stream: b.stream,
                            pool: id,
                            first_block: blocks.len() as u64,
                            tier: tier_code(tier),
                            is_large: u32::from(tier != Tier::Slab),
                            ..Default::default()
                        });
                        if b.ptr > start {
                            blocks.push(gap(start, b.ptr - start));
                        }
                    }
                }
                let s = cur.as_mut().expect("a segment is open");
                s.allocated_size += b.size;
                s.requested_size += b.requested;
                blocks.push(block_of(b));
            }
            if let Some(s) = cur.take() {
                close(s, &mut segs, &mut blocks);
            }
        }
    }
    (segs, blocks)
}

fn gap(address: u64, size: u64) -> GenpoolBlock {
    GenpoolBlock {
        address,
        size,
        ..Default::default()
    }
}

/// Close segment `s`: a trailing gap up to its end, its block count, and into `segs`.
fn close(mut s: GenpoolSegment, segs: &mut Vec<GenpoolSegment>, blocks: &mut Vec<GenpoolBlock>) {
    let end = s.address + s.total_size;
    let cursor = blocks.last().map_or(s.address, |l| l.address + l.size);
    if cursor < end {
        blocks.push(gap(cursor, end - cursor));
    }
    s.n_blocks = blocks.len() as u64 - s.first_block;
    segs.push(s);
}

/// Snapshot device `device`'s memory: segments (runs of pages under live blocks, per pool and tier, in
/// address order within each) into `segs[..seg_cap]` and their blocks and gaps into
/// `blocks[..block_cap]`. `pool == u64::MAX` takes every pool, else only pool `pool` (0: the default).
/// Stores the counts needed in `*n_segs` and `*n_blocks`; when either exceeds its capacity nothing is
/// written to the arrays and the call returns [`GENPOOL_E_INVALID`] with the counts set (call again with
/// room). A device not used yet has no segments.
///
/// # Safety
/// `segs` is NULL or valid for `seg_cap` writes, `blocks` likewise for `block_cap`; `n_segs` and
/// `n_blocks` are valid for one write each.
#[no_mangle]
pub unsafe extern "C" fn genpool_backend_snapshot(
    device: c_int,
    pool: u64,
    segs: *mut GenpoolSegment,
    seg_cap: usize,
    blocks: *mut GenpoolBlock,
    block_cap: usize,
    n_segs: *mut usize,
    n_blocks: *mut usize,
) -> c_int {
    guard("genpool_backend_snapshot", GENPOOL_E_INTERNAL, || {
        if n_segs.is_null() || n_blocks.is_null() {
            report::set_last_error(&"genpool_backend_snapshot: NULL count pointer");
            return GENPOOL_E_INVALID;
        }
        let (s, b) = match registry::existing(device.into()) {
            Ok(Some(state)) => snapshot(state, (pool != u64::MAX).then_some(pool)),
            Ok(None) => (Vec::new(), Vec::new()),
            Err(e) => {
                fail(&e);
                return code(&e);
            }
        };
        // SAFETY: both are non-null and valid for a write (this function's contract).
        unsafe {
            n_segs.write(s.len());
            n_blocks.write(b.len());
        }
        if s.len() > seg_cap || b.len() > block_cap || (segs.is_null() && !s.is_empty()) {
            return GENPOOL_E_INVALID;
        }
        if blocks.is_null() && !b.is_empty() {
            return GENPOOL_E_INVALID;
        }
        // SAFETY: the arrays hold at least `s.len()` / `b.len()` elements (checked against the
        // capacities the caller vouched for), and Rust's vectors do not overlap them.
        unsafe {
            if !s.is_empty() {
                std::ptr::copy_nonoverlapping(s.as_ptr(), segs, s.len());
            }
            if !b.is_empty() {
                std::ptr::copy_nonoverlapping(b.as_ptr(), blocks, b.len());
            }
        }
        GENPOOL_OK
    })
}

#[cfg(test)]
#[path = "backend_tests.rs"]
mod tests;
