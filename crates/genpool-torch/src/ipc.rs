//! CUDA IPC of genpool's memory, and peer devices.
//!
//! genpool's memory is 2 MiB VMM pages (`cuMemCreate`) mapped into reserved address ranges, which
//! `cudaIpcGetMemHandle` cannot export. As PyTorch's expandable segments do, each page under a block
//! is exported as a POSIX file descriptor (`genpool_ipc_export`); the receiving process takes its own
//! copies with `pidfd_getfd`, imports them and maps them back to back in address space of its own
//! (`genpool_ipc_open`), and unmaps and releases them when its tensor dies (`genpool_ipc_close`).
//! While the block lives on the sender's side its pages never move (a referenced page stays under its
//! address), so both processes see the same bytes; PyTorch's IPC refcounting keeps the sender's block
//! alive until the receiver is done with it. The C++ backend writes the byte string PyTorch passes
//! between the processes.
//!
//! `genpool_enable_peer_access` opens every page of every engine of a device (default pool, private
//! pools, tags) to a peer device, now and for pages mapped later (`gen_vmm::PagePool::grant_peer`).

use std::ffi::{c_int, c_void};
use std::os::fd::AsFd;
use std::sync::Arc;

use gen_device::ipc::ProcessFds;
use gen_device::{Device, PhysHandle};
use genpool::{GenpoolError, Pool};
use parking_lot::Mutex;

use crate::abi::{fail, guard};
use crate::backend_abi::{code, status, GENPOOL_E_INTERNAL, GENPOOL_E_INVALID, GENPOOL_OK};
use crate::error::PluginError;
use crate::registry::{self, DeviceState};
use crate::report;

/// Run `f` on the engine (any device, any pool, any tag) holding the live block that starts at `ptr`.
fn with_engine_of<R>(ptr: u64, f: impl FnOnce(&Pool) -> R) -> Option<R> {
    for s in registry::all_existing() {
        if s.pool.lookup(ptr).is_some() {
            return Some(f(s.pool));
        }
        // Private pools and tags: the router's secondary engines.
        if let Some(e) = registry::ROUTER
            .engines(s.index())
            .unwrap_or_default()
            .into_iter()
            .find(|e| e.pool().lookup(ptr).is_some())
        {
            return Some(f(e.pool()));
        }
    }
    None
}

/// What an export gives the other process.
struct Export {
    first_page: u64,
    page_size: u64,
    block_size: u64,
    fds: Vec<c_int>,
}

fn export(ptr: u64) -> Result<Export, PluginError> {
    let not_shareable = |reason: String| PluginError::NotShareable { ptr, reason };
    with_engine_of(ptr, |pool| {
        let b = pool
            .lookup(ptr)
            .ok_or_else(|| not_shareable("freed meanwhile".into()))?;
        let (first_page, fds) = pool
            .page_pool()
            .export(b.ptr, b.size)
            .map_err(|e| not_shareable(e.to_string()))?;
        Ok(Export {
            first_page,
            page_size: pool.page_pool().page_size(),
            block_size: b.size,
            fds,
        })
    })
    .unwrap_or_else(|| {
        Err(not_shareable(
            "not the start of a live block of genpool's".into(),
        ))
    })
}

/// Export the pages under the live block starting at `ptr` for another process (CUDA IPC): a POSIX
/// file descriptor per page into `fds[..cap]` and their count into `*n`, the address of the block's
/// first page into `*first_page`, the page size into `*page_size` and the block's size into
/// `*block_size`. The descriptors stay open (owned by genpool) until their pages go back to the
/// driver; the other process takes copies with `pidfd_getfd` while the block lives. When the
/// descriptors do not fit, [`GENPOOL_E_INVALID`] with only `*n` set (call again with room).
///
/// # Safety
/// `fds` is NULL or valid for `cap` writes; the other pointers are each valid for one write.
#[no_mangle]
pub unsafe extern "C" fn genpool_ipc_export(
    ptr: *const c_void,
    fds: *mut c_int,
    cap: usize,
    n: *mut usize,
    first_page: *mut u64,
    page_size: *mut u64,
    block_size: *mut u64,
) -> c_int {
    guard("genpool_ipc_export", GENPOOL_E_INTERNAL, || {
        if n.is_null() || first_page.is_null() || page_size.is_null() || block_size.is_null() {
            report::set_last_error(&"genpool_ipc_export: NULL out pointer");
            return GENPOOL_E_INVALID;
        }
        match export(ptr.addr() as u64) {
            Ok(e) => {
                // SAFETY: all four are non-null and valid for a write (this function's contract).
                unsafe {
                    n.write(e.fds.len());
                    first_page.write(e.first_page);
                    page_size.write(e.page_size);
                    block_size.write(e.block_size);
                }
                if e.fds.len() > cap || fds.is_null() {
                    return GENPOOL_E_INVALID;
                }
                // SAFETY: `fds` holds at least `e.fds.len()` elements (checked against `cap`).
                unsafe { std::ptr::copy_nonoverlapping(e.fds.as_ptr(), fds, e.fds.len()) };
                GENPOOL_OK
            }
            Err(e) => {
                fail(&e);
                code(&e)
            }
        }
    })
}

/// Pages of another process mapped here.
struct Import {
    base: u64,
    len: u64,
    handles: Vec<PhysHandle>,
    device: Arc<dyn Device>,
}

static IMPORTS: Mutex<Vec<Import>> = Mutex::new(Vec::new());

fn ipc(what: &'static str) -> impl Fn(gen_device::DeviceError) -> PluginError {
    move |source| PluginError::Ipc {
        what,
        source: Box::new(source),
    }
}

/// Release what an import made so far: mappings of `mapped` bytes at `va`, the reservation, handles.
fn undo(dev: &dyn Device, va: Option<(u64, u64)>, mapped: bool, handles: &[PhysHandle]) {
    if let Some((va, len)) = va {
        if mapped {
            if let Err(e) = dev.unmap(va, len) {
                log::error!("genpool: unmapping an import: {e}");
            }
        }
        if let Err(e) = dev.va_release(va, len) {
            log::error!("genpool: releasing an import's address range: {e}");
        }
    }
    for &h in handles {
        if let Err(e) = dev.phys_release(h) {
            log::error!("genpool: releasing an imported page: {e}");
        }
    }
}

fn open(state: &DeviceState, pid: i32, page: u64, fds: &[c_int]) -> Result<u64, PluginError> {
    let dev = state.pool.device().clone();
    let gran = dev.props().vmm_granularity;
    if fds.is_empty() || page == 0 || gran == 0 || page % gran != 0 {
        return Err(PluginError::Ipc {
            what: "the handle",
            source: Box::new(gen_device::DeviceError::InvalidArgument {
                call: "genpool_ipc_open",
                detail: format!(
                    "{} pages of {page:#x} bytes (this device maps multiples of {gran:#x})",
                    fds.len()
                ),
            }),
        });
    }
    let sender = ProcessFds::open(pid).map_err(ipc("opening the sending process"))?;
    let mut handles = Vec::with_capacity(fds.len());
    for &fd in fds {
        let res = sender
            .take(fd)
            .map_err(ipc("taking the sender's page descriptor"))
            .and_then(|mine| {
                dev.import_handle(mine.as_fd(), page)
                    .map_err(ipc("importing a page"))
            });
        match res {
            Ok(h) => handles.push(h),
            Err(e) => {
                undo(dev.as_ref(), None, false, &handles);
                return Err(e);
            }
        }
    }
    let len = page * fds.len() as u64;
    let va = match dev.va_reserve(len, page) {
        Ok(va) => va,
        Err(e) => {
            undo(dev.as_ref(), None, false, &handles);
            return Err(ipc("reserving address space")(e));
        }
    };
    if let Err(e) = dev.map_run(va, page, &handles) {
        undo(dev.as_ref(), Some((va, len)), false, &handles);
        return Err(ipc("mapping the pages")(e));
    }
    IMPORTS.lock().push(Import {
        base: va,
        len,
        handles,
        device: dev,
    });
    Ok(va)
}

/// Map here the pages process `pid` exported with [`genpool_ipc_export`] (`fds[..n]`, its descriptor
/// numbers, each page of `page_size` bytes), back to back on device `device`, readable and writable by
/// it (and its peers). Stores the address of the first page in `*out`. Release with
/// [`genpool_ipc_close`]. The sender must be alive and allowed to be traced by this process (see
/// `gen_device::ipc`); a refusal says which step failed and why.
///
/// # Safety
/// `fds` is valid for `n` reads; `out` is valid for one write.
#[no_mangle]
pub unsafe extern "C" fn genpool_ipc_open(
    device: c_int,
    pid: c_int,
    page_size: u64,
    fds: *const c_int,
    n: usize,
    out: *mut u64,
) -> c_int {
    guard("genpool_ipc_open", GENPOOL_E_INTERNAL, || {
        if out.is_null() || fds.is_null() {
            report::set_last_error(&"genpool_ipc_open: NULL pointer");
            return GENPOOL_E_INVALID;
        }
        // SAFETY: non-null and valid for `n` reads (this function's contract).
        let fds = unsafe { std::slice::from_raw_parts(fds, n) };
        match registry::state(device.into()).and_then(|s| open(&s, pid, page_size, fds)) {
            Ok(va) => {
                // SAFETY: non-null and valid for a write (this function's contract).
                unsafe { out.write(va) };
                GENPOOL_OK
            }
            Err(e) => {
                fail(&e);
                code(&e)
            }
        }
    })
}

fn close(base: u64) -> Result<(), PluginError> {
    let imp = {
        let mut t = IMPORTS.lock();
        let i = t
            .iter()
            .position(|m| m.base == base)
            .ok_or(PluginError::Engine(GenpoolError::InvalidFree {
                ptr: base,
                fault: genpool::FreeFault::Unknown,
            }))?;
        t.swap_remove(i)
    };
    // Work queued on the pages may still run: as PyTorch's expandable segments, synchronize first.
    imp.device
        .synchronize()
        .map_err(ipc("synchronizing before unmapping"))?;
    imp.device
        .unmap(imp.base, imp.len)
        .map_err(ipc("unmapping"))?;
    undo(imp.device.as_ref(), None, false, &imp.handles);
    imp.device
        .va_release(imp.base, imp.len)
        .map_err(ipc("releasing the address range"))
}

/// Unmap and release what [`genpool_ipc_open`] mapped at `base` (the receiver's tensor died).
/// [`GENPOOL_E_INVALID`] (code of an unknown free) for an address no open returned.
#[no_mangle]
pub extern "C" fn genpool_ipc_close(base: u64) -> c_int {
    guard("genpool_ipc_close", GENPOOL_E_INTERNAL, || {
        status(close(base))
    })
}

/// Ranges mapped by [`genpool_ipc_open`] and not closed yet (tests, leak checks).
#[no_mangle]
pub extern "C" fn genpool_ipc_open_count() -> usize {
    guard("genpool_ipc_open_count", 0, || IMPORTS.lock().len())
}

fn grant(device: c_int, peer: c_int) -> Result<u64, PluginError> {
    let state = registry::state(device.into())?;
    let peer_i = registry::check_index(peer.into())?;
    let refused = |why: String| PluginError::PeerAccess {
        device: state.index(),
        peer: peer_i,
        why,
    };
    // The default engine, private pools and tags.
    let engines = std::iter::once(state.pool.page_pool().clone()).chain(
        registry::ROUTER
            .engines(state.index())
            .unwrap_or_default()
            .into_iter()
            .map(|e| e.pool().page_pool().clone()),
    );
    let mut opened = 0;
    for pages in engines {
        opened += pages
            .grant_peer(peer_i)
            .map_err(|e| refused(e.to_string()))?;
    }
    Ok(opened)
}

/// Let device `peer` read and write every page genpool maps on device `device` (PyTorch's
/// `enablePeerAccess(peer, device)`: VMM memory needs `cuMemSetAccess`, not only
/// `cudaDeviceEnablePeerAccess`): the pages of every engine of `device` now, and every page mapped from
/// now on. Idempotent.
#[no_mangle]
pub extern "C" fn genpool_enable_peer_access(device: c_int, peer: c_int) -> c_int {
    guard("genpool_enable_peer_access", GENPOOL_E_INTERNAL, || {
        status(grant(device, peer).map(|n| {
            log::info!(
                "genpool: device {peer} may access device {device}'s memory ({n} pages now)"
            );
        }))
    })
}
