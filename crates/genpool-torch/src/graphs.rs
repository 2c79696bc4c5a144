//! CUDA graphs: the captures the backend tells the engine of, and CUDA graph trees' checkpoints of a
//! private pool (`torch.compile(mode="reduce-overhead")`).
//!
//! **Captures.** `genpool_capture_begin` / `genpool_capture_end` raise and lower the count of captures
//! underway on a device (`gen_device::Captures`, shared by every engine of the device: its default
//! pool, private pools and tags). While it is raised no engine makes a call that a capture forbids
//! (see `gen_vmm`'s "Pages that stay"). The backend raises it when it first sees an allocation on a
//! capturing stream (PyTorch calls `beginAllocateToPool` just *before* `cudaStreamBeginCapture`) and
//! lowers it at `endAllocateToPool`, after `cudaStreamEndCapture`.
//!
//! **Checkpoints.** Graph trees record a private pool's state after each recording
//! (`getCheckpointState`) and, before recording a new branch of the tree, put the pool back to the state
//! of the node it branches from (`setCheckpointPoolState`): every block live now is freed and every
//! block live in the checkpoint is live again, *at the same address* (the replayed graphs baked them
//! in). `genpool_pool_live` lists a private pool's live blocks (the checkpoint); `genpool_pool_restore`
//! puts them back with [`genpool::Pool::alloc_at`]. As PyTorch's allocator does, the result reports
//! every block that was live as freed and every checkpoint block as allocated (a block in both stays
//! allocated in the engine: it is not freed and placed again).

use std::collections::HashSet;
use std::ffi::c_int;

use crate::abi::{fail, guard};
use crate::backend_abi::{
    code, free, status, GenpoolBlock, COUNTERS, GENPOOL_E_INTERNAL, GENPOOL_E_INVALID, GENPOOL_OK,
};
use crate::error::PluginError;
use crate::pools;
use crate::registry;
use crate::report;

/// A capture began on device `device` (a stream of it is capturing into a CUDA graph): until the
/// matching [`genpool_capture_end`], no engine of the device makes a call a capture forbids.
#[no_mangle]
pub extern "C" fn genpool_capture_begin(device: c_int) -> c_int {
    guard("genpool_capture_begin", GENPOOL_E_INTERNAL, || {
        status(registry::state(device.into()).map(|s| s.pool.device().captures().begin()))
    })
}

/// A capture of device `device` ended. Returns [`GENPOOL_E_INVALID`] when none was underway. Private
/// pools released during the capture whose blocks are all freed are dropped now.
#[no_mangle]
pub extern "C" fn genpool_capture_end(device: c_int) -> c_int {
    guard(
        "genpool_capture_end",
        GENPOOL_E_INTERNAL,
        || match registry::state(device.into()) {
            Ok(s) => {
                if !s.pool.device().captures().end() {
                    report::set_last_error(&format!(
                        "genpool_capture_end: no capture underway on device {device}"
                    ));
                    return GENPOOL_E_INVALID;
                }
                if !s.pool.device().captures().active() {
                    pools::sweep(s.index());
                }
                GENPOOL_OK
            }
            Err(e) => {
                fail(&e);
                code(&e)
            }
        },
    )
}

/// Copy `src` into `dst[..cap]` and its length into `*n`: [`GENPOOL_E_INVALID`] with only `*n` written
/// when it does not fit.
///
/// # Safety
/// `dst` is NULL or valid for `cap` writes; `n` is valid for one write.
unsafe fn copy_out<T: Copy>(src: &[T], dst: *mut T, cap: usize, n: *mut usize) -> c_int {
    // SAFETY: `n` is valid for a write (the caller's contract).
    unsafe { n.write(src.len()) };
    if src.len() > cap || (dst.is_null() && !src.is_empty()) {
        return GENPOOL_E_INVALID;
    }
    if !src.is_empty() {
        // SAFETY: `dst` holds at least `src.len()` elements (checked against the capacity the caller
        // vouched for) and does not overlap Rust's vector.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
    }
    GENPOOL_OK
}

/// The live blocks of private pool `pool` of device `device`, in address order, into `out[..cap]`
/// (`requested` and `stream` as the engine recorded them), their count into `*n`. When they do not fit,
/// [`GENPOOL_E_INVALID`] with only `*n` set (call again with room).
///
/// # Safety
/// `out` is NULL or valid for `cap` writes; `n` is valid for one write.
#[no_mangle]
pub unsafe extern "C" fn genpool_pool_live(
    device: c_int,
    pool: u64,
    out: *mut GenpoolBlock,
    cap: usize,
    n: *mut usize,
) -> c_int {
    guard("genpool_pool_live", GENPOOL_E_INTERNAL, || {
        if n.is_null() {
            report::set_last_error(&"genpool_pool_live: NULL count pointer");
            return GENPOOL_E_INVALID;
        }
        let p = match pools::resolve(device.into(), pool) {
            Ok((_, Some(p))) => p,
            Ok((s, None)) => {
                let e = PluginError::UnknownPool {
                    device: s.index(),
                    id: 0,
                };
                fail(&e);
                return code(&e);
            }
            Err(e) => {
                fail(&e);
                return code(&e);
            }
        };
        let live: Vec<GenpoolBlock> = p
            .pool()
            .live_detailed()
            .iter()
            .map(|b| GenpoolBlock {
                address: b.ptr,
                size: b.size,
                requested: b.requested,
                stream: b.stream,
                allocated: 1,
                tier: 1,
            })
            .collect();
        // SAFETY: the caller's contract, passed on.
        unsafe { copy_out(&live, out, cap, n) }
    })
}

fn restore(device: c_int, pool: u64, checkpoint: &[GenpoolBlock]) -> Result<(), PluginError> {
    let (state, p) = match pools::resolve(device.into(), pool)? {
        (s, Some(p)) => (s, p),
        (s, None) => {
            return Err(PluginError::UnknownPool {
                device: s.index(),
                id: 0,
            })
        }
    };
    let live = p.pool().live_detailed();
    // A block live now and in the checkpoint, same size: it stays allocated.
    let kept: HashSet<u64> = {
        let now: std::collections::HashMap<u64, u64> =
            live.iter().map(|b| (b.ptr, b.size)).collect();
        checkpoint
            .iter()
            .filter(|c| now.get(&c.address) == Some(&c.size))
            .map(|c| c.address)
            .collect()
    };
    for b in live.iter().filter(|b| !kept.contains(&b.ptr)) {
        free(b.ptr)?;
    }
    for c in checkpoint.iter().filter(|c| !kept.contains(&c.address)) {
        let requested = if c.requested > 0 { c.requested } else { c.size };
        let b = p.pool().alloc_at(c.address, requested, c.stream)?;
        COUNTERS[state.index()].on_alloc(b.size, requested);
    }
    Ok(())
}

/// Put private pool `pool` of device `device` back to a checkpoint: `blocks[..n_blocks]` are the blocks
/// [`genpool_pool_live`] listed then. Every block live now that is not in the checkpoint is freed, every
/// checkpoint block not live now is allocated again at its address (same request and stream). The
/// addresses of the blocks that were live are written to `freed[..freed_cap]` and their count to
/// `*n_freed` (PyTorch's `CheckpointDelta.ptrs_freed`); when they do not fit nothing is changed and
/// [`GENPOOL_E_INVALID`] is returned with `*n_freed` set. A checkpoint block that cannot be placed
/// (its range taken by a block of another pool, a capture underway that forbids the pages it needs) is
/// an error after the blocks before it were placed.
///
/// # Safety
/// `blocks` is valid for `n_blocks` reads (or NULL with `n_blocks == 0`); `freed` is NULL or valid for
/// `freed_cap` writes; `n_freed` is valid for one write.
#[no_mangle]
pub unsafe extern "C" fn genpool_pool_restore(
    device: c_int,
    pool: u64,
    blocks: *const GenpoolBlock,
    n_blocks: usize,
    freed: *mut u64,
    freed_cap: usize,
    n_freed: *mut usize,
) -> c_int {
    guard("genpool_pool_restore", GENPOOL_E_INTERNAL, || {
        if n_freed.is_null() || (blocks.is_null() && n_blocks > 0) {
            report::set_last_error(&"genpool_pool_restore: NULL pointer");
            return GENPOOL_E_INVALID;
        }
        let checkpoint: &[GenpoolBlock] = if n_blocks == 0 {
            &[]
        } else {
            // SAFETY: non-null and valid for `n_blocks` reads (the caller's contract).
            unsafe { std::slice::from_raw_parts(blocks, n_blocks) }
        };
        let live: Vec<u64> = match pools::resolve(device.into(), pool) {
            Ok((_, Some(p))) => p.pool().live_detailed().iter().map(|b| b.ptr).collect(),
            Ok((_, None)) => Vec::new(),
            Err(e) => {
                fail(&e);
                return code(&e);
            }
        };
        // SAFETY: the caller's contract, passed on.
        let rc = unsafe { copy_out(&live, freed, freed_cap, n_freed) };
        if rc != GENPOOL_OK {
            return rc;
        }
        status(restore(device, pool, checkpoint))
    })
}
