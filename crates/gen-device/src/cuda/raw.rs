//! The only place that calls the CUDA driver (`cudarc::driver::sys`): one thin wrapper per call that turns
//! the `CUresult` into a [`DeviceError`] naming the call.
//!
//! Every call goes through [`guarded`], which catches the panic cudarc's lazy loader raises when
//! `libcuda` or one of its symbols is missing (cudarc `sys::culib()` / `load`) and returns
//! [`DeviceError::NoDriver`] instead: a missing or too-old driver never crashes the process.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;

use cudarc::driver::sys;

use crate::{DeviceError, Result};

pub(super) use sys::{
    CUcontext, CUdevice, CUdeviceptr, CUevent, CUmemGenericAllocationHandle, CUmemoryPool, CUstream,
};

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "cudarc panicked while loading the driver".to_string())
}

/// Run one driver call, turning a loader panic into `NoDriver` and an error code into a `DeviceError`.
fn guarded(call: &'static str, f: impl FnOnce() -> sys::CUresult) -> Result<()> {
    let r = catch_unwind(AssertUnwindSafe(f))
        .map_err(|p| DeviceError::NoDriver(format!("{call}: {}", panic_text(p.as_ref()))))?;
    check(call, r)
}

/// `Ok` for `CUDA_SUCCESS`, else the error for `r`.
pub(super) fn check(call: &'static str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(error(call, r))
    }
}

/// The [`DeviceError`] for a failed call: `OutOfMemory` for `CUDA_ERROR_OUT_OF_MEMORY`, else `Driver`.
pub(super) fn error(call: &'static str, r: sys::CUresult) -> DeviceError {
    if r == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        return DeviceError::OutOfMemory { call, requested: 0 };
    }
    DeviceError::Driver {
        call,
        code: r as i32,
        message: describe(r),
    }
}

/// Set the bytes requested on an `OutOfMemory` error.
pub(super) fn with_requested(e: DeviceError, bytes: u64) -> DeviceError {
    match e {
        DeviceError::OutOfMemory { call, .. } => DeviceError::OutOfMemory {
            call,
            requested: bytes,
        },
        e => e,
    }
}

fn describe(r: sys::CUresult) -> String {
    let text =
        |f: unsafe fn(sys::CUresult, *mut *const c_char) -> sys::CUresult| -> Option<String> {
            let mut s: *const c_char = ptr::null();
            let ok = catch_unwind(AssertUnwindSafe(|| {
                // SAFETY: `s` is a valid out-pointer; the driver stores a pointer to a static string.
                unsafe { f(r, &mut s) }
            }))
            .ok()?;
            if ok != sys::CUresult::CUDA_SUCCESS || s.is_null() {
                return None;
            }
            // SAFETY: on success the driver returned a NUL-terminated static string.
            Some(unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned())
        };
    match (text(sys::cuGetErrorName), text(sys::cuGetErrorString)) {
        (Some(n), Some(s)) => format!("{n}: {s}"),
        (Some(n), None) => n,
        _ => format!("{r:?}"),
    }
}

/// Whether a CUDA driver library can be loaded at all (cudarc's presence check, without panicking).
pub(super) fn driver_present() -> bool {
    catch_unwind(|| {
        // SAFETY: only tries to open candidate library names with libloading and closes them again.
        unsafe { sys::is_culib_present() }
    })
    .unwrap_or(false)
}

// ---- initialization, devices, contexts --------------------------------------------------------------

/// `cuInit(0)`.
pub(super) fn init() -> Result<()> {
    // SAFETY: cuInit takes no pointers and may be called any number of times.
    guarded("cuInit", || unsafe { sys::cuInit(0) })
}

/// `cuDeviceGetCount`.
pub(super) fn device_count() -> Result<usize> {
    let mut n: c_int = 0;
    // SAFETY: `n` is a valid out-pointer.
    guarded("cuDeviceGetCount", || unsafe {
        sys::cuDeviceGetCount(&mut n)
    })?;
    Ok(n.max(0) as usize)
}

/// `cuDeviceGet`.
pub(super) fn device_get(ordinal: c_int) -> Result<CUdevice> {
    let mut d: CUdevice = 0;
    // SAFETY: `d` is a valid out-pointer; the driver validates the ordinal.
    guarded("cuDeviceGet", || unsafe {
        sys::cuDeviceGet(&mut d, ordinal)
    })?;
    Ok(d)
}

/// `cuDeviceGetName`.
pub(super) fn device_name(dev: CUdevice) -> Result<String> {
    let mut buf = [0 as c_char; 256];
    // SAFETY: `buf` is writable for the length passed; the driver validates `dev`.
    guarded("cuDeviceGetName", || unsafe {
        sys::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as c_int, dev)
    })?;
    buf[buf.len() - 1] = 0; // NUL-terminated even if the driver filled the whole buffer

    // SAFETY: `buf` is NUL-terminated (its last byte was just set to 0).
    Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned())
}

/// `cuDeviceTotalMem`.
pub(super) fn device_total_mem(dev: CUdevice) -> Result<u64> {
    let mut n: usize = 0;
    // SAFETY: `n` is a valid out-pointer; the driver validates `dev`.
    guarded("cuDeviceTotalMem", || unsafe {
        sys::cuDeviceTotalMem_v2(&mut n, dev)
    })?;
    Ok(n as u64)
}

/// `cuDeviceGetAttribute`.
pub(super) fn device_attribute(dev: CUdevice, attr: sys::CUdevice_attribute) -> Result<i32> {
    let mut v: c_int = 0;
    // SAFETY: `v` is a valid out-pointer; the driver validates `dev`.
    guarded("cuDeviceGetAttribute", || unsafe {
        sys::cuDeviceGetAttribute(&mut v, attr, dev)
    })?;
    Ok(v)
}

/// `cuDevicePrimaryCtxRetain`.
pub(super) fn primary_ctx_retain(dev: CUdevice) -> Result<CUcontext> {
    let mut ctx: CUcontext = ptr::null_mut();
    // SAFETY: `ctx` is a valid out-pointer; the driver validates `dev`.
    guarded("cuDevicePrimaryCtxRetain", || unsafe {
        sys::cuDevicePrimaryCtxRetain(&mut ctx, dev)
    })?;
    Ok(ctx)
}

/// `cuDevicePrimaryCtxRelease`.
///
/// # Safety
/// Balances one successful [`primary_ctx_retain`] of `dev`; nothing may use the context through this
/// retain afterwards.
pub(super) unsafe fn primary_ctx_release(dev: CUdevice) -> Result<()> {
    // SAFETY: the caller balances a retain.
    guarded("cuDevicePrimaryCtxRelease", || unsafe {
        sys::cuDevicePrimaryCtxRelease_v2(dev)
    })
}

/// Make `ctx` current on this thread unless it already is (`cuCtxGetCurrent` + `cuCtxSetCurrent`).
///
/// # Safety
/// `ctx` is a live context (a retained primary context).
pub(super) unsafe fn ensure_current(ctx: CUcontext) -> Result<()> {
    let mut cur: CUcontext = ptr::null_mut();
    // SAFETY: `cur` is a valid out-pointer.
    guarded("cuCtxGetCurrent", || unsafe {
        sys::cuCtxGetCurrent(&mut cur)
    })?;
    if cur == ctx {
        return Ok(());
    }
    // SAFETY: the caller guarantees `ctx` is live.
    guarded("cuCtxSetCurrent", || unsafe { sys::cuCtxSetCurrent(ctx) })
}

/// `cuCtxSynchronize`. Safe: it only needs a current context (else the driver reports an error).
pub(super) fn ctx_synchronize() -> Result<()> {
    // SAFETY: no arguments.
    guarded("cuCtxSynchronize", || unsafe { sys::cuCtxSynchronize() })
}

/// `cuMemGetInfo`: (free, total).
pub(super) fn mem_get_info() -> Result<(u64, u64)> {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: both are valid out-pointers.
    guarded("cuMemGetInfo", || unsafe {
        sys::cuMemGetInfo_v2(&mut free, &mut total)
    })?;
    Ok((free as u64, total as u64))
}

// ---- plain memory -------------------------------------------------------------------------------------

/// `cuMemAlloc`.
pub(super) fn mem_alloc(bytes: usize) -> Result<CUdeviceptr> {
    let mut p: CUdeviceptr = 0;
    // SAFETY: `p` is a valid out-pointer.
    guarded("cuMemAlloc", || unsafe {
        sys::cuMemAlloc_v2(&mut p, bytes)
    })
    .map_err(|e| with_requested(e, bytes as u64))?;
    Ok(p)
}

/// `cuMemFree`.
///
/// # Safety
/// No device work still in flight or queued uses `ptr` (a device-side hazard only; the driver itself
/// validates the pointer).
pub(super) unsafe fn mem_free(ptr: CUdeviceptr) -> Result<()> {
    // SAFETY: the driver looks the pointer up and rejects unknown ones; liveness is the caller's.
    guarded("cuMemFree", || unsafe { sys::cuMemFree_v2(ptr) })
}

// ---- virtual memory management ------------------------------------------------------------------------

fn device_location(ordinal: c_int) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: ordinal,
    }
}

/// Pinned device memory on `ordinal`, exportable as a POSIX file descriptor when `exportable` (CUDA
/// IPC; what PyTorch's expandable segments request too).
fn alloc_prop(ordinal: c_int, exportable: bool) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: if exportable {
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        } else {
            sys::CUmemAllocationHandleType(0)
        },
        location: device_location(ordinal),
        win32HandleMetaData: ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// `cuMemGetAllocationGranularity` (minimum) for pinned memory on `ordinal`.
pub(super) fn granularity(ordinal: c_int) -> Result<u64> {
    let prop = alloc_prop(ordinal, false);
    let mut g: usize = 0;
    // SAFETY: `g` is a valid out-pointer, `prop` a fully initialized property struct.
    guarded("cuMemGetAllocationGranularity", || unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut g,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    })?;
    Ok(g as u64)
}

/// `cuMemAddressReserve`.
pub(super) fn address_reserve(bytes: usize, align: usize) -> Result<CUdeviceptr> {
    let mut p: CUdeviceptr = 0;
    // SAFETY: `p` is a valid out-pointer; no fixed address is requested.
    guarded("cuMemAddressReserve", || unsafe {
        sys::cuMemAddressReserve(&mut p, bytes, align, 0, 0)
    })
    .map_err(|e| with_requested(e, bytes as u64))?;
    Ok(p)
}

/// `cuMemAddressFree`. Safe: the driver validates the range, and a reservation holds no memory.
pub(super) fn address_free(ptr: CUdeviceptr, bytes: usize) -> Result<()> {
    // SAFETY: the driver rejects ranges that are not a reservation.
    guarded("cuMemAddressFree", || unsafe {
        sys::cuMemAddressFree(ptr, bytes)
    })
}

/// `cuMemCreate` of pinned memory on `ordinal` (exportable as a POSIX descriptor when `exportable`).
pub(super) fn mem_create(
    bytes: usize,
    ordinal: c_int,
    exportable: bool,
) -> Result<CUmemGenericAllocationHandle> {
    let prop = alloc_prop(ordinal, exportable);
    let mut h: CUmemGenericAllocationHandle = 0;
    // SAFETY: `h` is a valid out-pointer, `prop` a fully initialized property struct.
    guarded("cuMemCreate", || unsafe {
        sys::cuMemCreate(&mut h, bytes, &prop, 0)
    })
    .map_err(|e| with_requested(e, bytes as u64))?;
    Ok(h)
}

/// `cuMemRelease`.
///
/// # Safety
/// `handle` came from [`mem_create`] and is released once.
pub(super) unsafe fn mem_release(handle: CUmemGenericAllocationHandle) -> Result<()> {
    // SAFETY: the caller guarantees a live handle.
    guarded("cuMemRelease", || unsafe { sys::cuMemRelease(handle) })
}

/// `cuMemMap` of each handle (each of `bytes` bytes) back to back from `va`, then one `cuMemSetAccess`
/// read-write for every device of `ordinals` (the owner, then its peers) over the whole run; on any
/// error everything mapped here is unmapped again.
///
/// # Safety
/// Every handle is a live handle from [`mem_create`] (or [`import_fd`]) of `bytes` bytes.
pub(super) unsafe fn mem_map_run(
    va: CUdeviceptr,
    bytes: usize,
    handles: &[CUmemGenericAllocationHandle],
    ordinals: &[c_int],
) -> Result<()> {
    let undo = |n: usize| {
        if n > 0 {
            // SAFETY: `[va, va + n * bytes)` was mapped just above and nothing can use it yet.
            let _ = unsafe { mem_unmap(va, n * bytes) };
        }
    };
    for (i, &h) in handles.iter().enumerate() {
        let at = va + (i * bytes) as CUdeviceptr;
        // SAFETY: the caller guarantees a live handle of `bytes`; the driver validates the VA range.
        let r = guarded("cuMemMap", || unsafe { sys::cuMemMap(at, bytes, 0, h, 0) });
        if let Err(e) = r {
            undo(i);
            return Err(e);
        }
    }
    let desc: Vec<sys::CUmemAccessDesc> = ordinals.iter().map(|&o| access_desc(o)).collect();
    // SAFETY: `desc` holds `desc.len()` initialized descriptors; the whole run was just mapped.
    let r = guarded("cuMemSetAccess", || unsafe {
        sys::cuMemSetAccess(va, bytes * handles.len(), desc.as_ptr(), desc.len())
    });
    if let Err(e) = r {
        undo(handles.len());
        return Err(e);
    }
    Ok(())
}

fn access_desc(ordinal: c_int) -> sys::CUmemAccessDesc {
    sys::CUmemAccessDesc {
        location: device_location(ordinal),
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
}

/// `cuMemSetAccess`: make `[va, va + bytes)` readable and writable by device `ordinal`. Safe: the driver
/// validates the range (it must be mapped) and only the access of the device named changes.
pub(super) fn mem_set_access(va: CUdeviceptr, bytes: usize, ordinal: c_int) -> Result<()> {
    let desc = access_desc(ordinal);
    // SAFETY: `desc` is one initialized descriptor; the driver validates the range.
    guarded("cuMemSetAccess", || unsafe {
        sys::cuMemSetAccess(va, bytes, &desc, 1)
    })
}

/// `cuMemExportToShareableHandle` as a POSIX file descriptor, owned by the caller.
///
/// # Safety
/// `handle` is a live handle from [`mem_create`] made exportable.
pub(super) unsafe fn export_fd(handle: CUmemGenericAllocationHandle) -> Result<c_int> {
    let mut fd: c_int = -1;
    // SAFETY: for a POSIX descriptor the driver writes one `int` through the pointer; the caller
    // guarantees the handle.
    guarded("cuMemExportToShareableHandle", || unsafe {
        sys::cuMemExportToShareableHandle(
            (&mut fd as *mut c_int).cast::<c_void>(),
            handle,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    })?;
    Ok(fd)
}

/// `cuMemImportFromShareableHandle` of a POSIX file descriptor (which stays the caller's). Safe: the
/// driver validates the descriptor (passed by value, as the API wants it for this handle type).
pub(super) fn import_fd(fd: c_int) -> Result<CUmemGenericAllocationHandle> {
    let mut h: CUmemGenericAllocationHandle = 0;
    // SAFETY: `h` is a valid out-pointer; for POSIX descriptors the "pointer" argument is the descriptor
    // itself cast to a pointer, which the driver never dereferences.
    guarded("cuMemImportFromShareableHandle", || unsafe {
        sys::cuMemImportFromShareableHandle(
            &mut h,
            fd as isize as *mut c_void,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        )
    })?;
    Ok(h)
}

/// `cuMemUnmap`.
///
/// # Safety
/// No device work in flight or queued uses the range (a device-side hazard; the driver validates the range).
pub(super) unsafe fn mem_unmap(va: CUdeviceptr, bytes: usize) -> Result<()> {
    // SAFETY: the driver validates the range; liveness is the caller's.
    guarded("cuMemUnmap", || unsafe { sys::cuMemUnmap(va, bytes) })
}

// ---- pools --------------------------------------------------------------------------------------------

/// `cuMemPoolCreate` (pinned, device `ordinal`).
pub(super) fn pool_create(ordinal: c_int) -> Result<CUmemoryPool> {
    let props = sys::CUmemPoolProps {
        allocType: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        handleTypes: sys::CUmemAllocationHandleType(0),
        location: device_location(ordinal),
        win32SecurityAttributes: ptr::null_mut(),
        maxSize: 0,
        usage: 0,
        reserved: [0; 54],
    };
    let mut pool: CUmemoryPool = ptr::null_mut();
    // SAFETY: `pool` is a valid out-pointer, `props` fully initialized.
    guarded("cuMemPoolCreate", || unsafe {
        sys::cuMemPoolCreate(&mut pool, &props)
    })?;
    Ok(pool)
}

/// `cuMemPoolDestroy`.
///
/// # Safety
/// `pool` is a live pool from [`pool_create`], destroyed once and not used afterwards.
pub(super) unsafe fn pool_destroy(pool: CUmemoryPool) -> Result<()> {
    // SAFETY: the caller guarantees a live pool.
    guarded("cuMemPoolDestroy", || unsafe {
        sys::cuMemPoolDestroy(pool)
    })
}

/// `cuMemPoolSetAttribute` with a 64-bit value.
///
/// # Safety
/// `pool` is live and `attr` takes a `cuuint64_t`.
pub(super) unsafe fn pool_set_u64(
    pool: CUmemoryPool,
    attr: sys::CUmemPool_attribute,
    value: u64,
) -> Result<()> {
    let mut v: sys::cuuint64_t = value;
    // SAFETY: `v` is a valid u64 the driver reads; the caller guarantees pool and attribute type.
    guarded("cuMemPoolSetAttribute", || unsafe {
        sys::cuMemPoolSetAttribute(pool, attr, (&mut v as *mut u64).cast::<c_void>())
    })
}

/// `cuMemPoolGetAttribute` of a 64-bit attribute.
///
/// # Safety
/// `pool` is live and `attr` yields a `cuuint64_t`.
pub(super) unsafe fn pool_get_u64(
    pool: CUmemoryPool,
    attr: sys::CUmemPool_attribute,
) -> Result<u64> {
    let mut v: sys::cuuint64_t = 0;
    // SAFETY: `v` is a valid u64 the driver writes; the caller guarantees pool and attribute type.
    guarded("cuMemPoolGetAttribute", || unsafe {
        sys::cuMemPoolGetAttribute(pool, attr, (&mut v as *mut u64).cast::<c_void>())
    })?;
    Ok(v)
}

/// `cuMemPoolTrimTo`.
///
/// # Safety
/// `pool` is live.
pub(super) unsafe fn pool_trim_to(pool: CUmemoryPool, keep: usize) -> Result<()> {
    // SAFETY: the caller guarantees a live pool.
    guarded("cuMemPoolTrimTo", || unsafe {
        sys::cuMemPoolTrimTo(pool, keep)
    })
}

/// `cuMemAllocFromPoolAsync`.
///
/// # Safety
/// `pool` is live; `stream` is a live stream of the current context (or the null stream).
pub(super) unsafe fn alloc_from_pool_async(
    bytes: usize,
    pool: CUmemoryPool,
    stream: CUstream,
) -> Result<CUdeviceptr> {
    let mut p: CUdeviceptr = 0;
    // SAFETY: `p` is a valid out-pointer; the caller guarantees pool and stream.
    guarded("cuMemAllocFromPoolAsync", || unsafe {
        sys::cuMemAllocFromPoolAsync(&mut p, bytes, pool, stream)
    })
    .map_err(|e| with_requested(e, bytes as u64))?;
    Ok(p)
}

/// `cuMemFreeAsync`.
///
/// # Safety
/// `stream` is a live stream (or the null stream); work using `ptr` is ordered before the free.
pub(super) unsafe fn free_async(ptr: CUdeviceptr, stream: CUstream) -> Result<()> {
    // SAFETY: the caller guarantees the stream; the driver validates the pointer.
    guarded("cuMemFreeAsync", || unsafe {
        sys::cuMemFreeAsync(ptr, stream)
    })
}

// ---- streams and events -------------------------------------------------------------------------------

/// `cuStreamCreate(CU_STREAM_NON_BLOCKING)`.
pub(super) fn stream_create() -> Result<CUstream> {
    let mut s: CUstream = ptr::null_mut();
    let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as c_uint;
    // SAFETY: `s` is a valid out-pointer.
    guarded("cuStreamCreate", || unsafe {
        sys::cuStreamCreate(&mut s, flags)
    })?;
    Ok(s)
}

/// `cuStreamDestroy`.
///
/// # Safety
/// `s` came from [`stream_create`] and is destroyed once.
pub(super) unsafe fn stream_destroy(s: CUstream) -> Result<()> {
    // SAFETY: the caller guarantees a live stream.
    guarded("cuStreamDestroy", || unsafe { sys::cuStreamDestroy_v2(s) })
}

/// `cuStreamSynchronize`.
///
/// # Safety
/// `s` is a live stream or the null stream.
pub(super) unsafe fn stream_synchronize(s: CUstream) -> Result<()> {
    // SAFETY: the caller guarantees the stream.
    guarded("cuStreamSynchronize", || unsafe {
        sys::cuStreamSynchronize(s)
    })
}

/// `cuStreamQuery`: `true` when all work queued on `s` has completed, `false` for
/// `CUDA_ERROR_NOT_READY`.
///
/// # Safety
/// `s` is a live stream or the null stream.
pub(super) unsafe fn stream_query(s: CUstream) -> Result<bool> {
    // SAFETY: the caller guarantees the stream.
    match guarded("cuStreamQuery", || unsafe { sys::cuStreamQuery(s) }) {
        Ok(()) => Ok(true),
        Err(DeviceError::Driver { code, .. })
            if code == sys::CUresult::CUDA_ERROR_NOT_READY as i32 =>
        {
            Ok(false)
        }
        Err(e) => Err(e),
    }
}

/// `cuStreamWaitEvent`.
///
/// # Safety
/// `s` is a live stream or the null stream; `e` a live event.
pub(super) unsafe fn stream_wait_event(s: CUstream, e: CUevent) -> Result<()> {
    // SAFETY: the caller guarantees stream and event.
    guarded("cuStreamWaitEvent", || unsafe {
        sys::cuStreamWaitEvent(s, e, 0)
    })
}

/// `cuEventCreate(CU_EVENT_DISABLE_TIMING)`.
pub(super) fn event_create() -> Result<CUevent> {
    let mut e: CUevent = ptr::null_mut();
    let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint;
    // SAFETY: `e` is a valid out-pointer.
    guarded("cuEventCreate", || unsafe {
        sys::cuEventCreate(&mut e, flags)
    })?;
    Ok(e)
}

/// `cuEventDestroy`.
///
/// # Safety
/// `e` came from [`event_create`] and is destroyed once.
pub(super) unsafe fn event_destroy(e: CUevent) -> Result<()> {
    // SAFETY: the caller guarantees a live event.
    guarded("cuEventDestroy", || unsafe { sys::cuEventDestroy_v2(e) })
}

/// `cuEventRecord`.
///
/// # Safety
/// `e` is a live event; `s` a live stream or the null stream.
pub(super) unsafe fn event_record(e: CUevent, s: CUstream) -> Result<()> {
    // SAFETY: the caller guarantees event and stream.
    guarded("cuEventRecord", || unsafe { sys::cuEventRecord(e, s) })
}

/// `cuEventQuery`: `true` when complete, `false` for `CUDA_ERROR_NOT_READY`.
///
/// # Safety
/// `e` is a live event.
pub(super) unsafe fn event_query(e: CUevent) -> Result<bool> {
    // SAFETY: the caller guarantees the event.
    match guarded("cuEventQuery", || unsafe { sys::cuEventQuery(e) }) {
        Ok(()) => Ok(true),
        Err(DeviceError::Driver { code, .. })
            if code == sys::CUresult::CUDA_ERROR_NOT_READY as i32 =>
        {
            Ok(false)
        }
        Err(e) => Err(e),
    }
}

/// `cuEventSynchronize`.
///
/// # Safety
/// `e` is a live event.
pub(super) unsafe fn event_synchronize(e: CUevent) -> Result<()> {
    // SAFETY: the caller guarantees the event.
    guarded("cuEventSynchronize", || unsafe {
        sys::cuEventSynchronize(e)
    })
}

// ---- data ---------------------------------------------------------------------------------------------

/// `cuMemcpyHtoD` (synchronous). Safe: the host slice is valid and the driver validates the device range.
pub(super) fn memcpy_htod(dst: CUdeviceptr, data: &[u8]) -> Result<()> {
    // SAFETY: `data` is readable for its length; the driver rejects invalid device ranges.
    guarded("cuMemcpyHtoD", || unsafe {
        sys::cuMemcpyHtoD_v2(dst, data.as_ptr().cast(), data.len())
    })
}

/// `cuMemcpyDtoH` (synchronous). Safe: the host slice is valid and the driver validates the device range.
pub(super) fn memcpy_dtoh(out: &mut [u8], src: CUdeviceptr) -> Result<()> {
    // SAFETY: `out` is writable for its length; the driver rejects invalid device ranges.
    guarded("cuMemcpyDtoH", || unsafe {
        sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), src, out.len())
    })
}

/// `cuMemsetD8Async`.
///
/// # Safety
/// `s` is a live stream or the null stream.
pub(super) unsafe fn memset_d8_async(
    dst: CUdeviceptr,
    byte: u8,
    len: usize,
    s: CUstream,
) -> Result<()> {
    // SAFETY: the caller guarantees the stream; the driver validates the device range.
    guarded("cuMemsetD8Async", || unsafe {
        sys::cuMemsetD8Async(dst, byte, len, s)
    })
}

// ---- pinned host memory, capture status ----------------------------------------------------------------

/// `cuMemAllocHost` of `bytes` (page-locked host memory); returns its address.
pub(super) fn mem_alloc_host(bytes: usize) -> Result<u64> {
    let mut p: *mut c_void = ptr::null_mut();
    // SAFETY: `p` is a valid out-pointer; the driver allocates and returns host memory.
    guarded("cuMemAllocHost", || unsafe {
        sys::cuMemAllocHost_v2(&mut p, bytes)
    })
    .map_err(|e| with_requested(e, bytes as u64))?;
    Ok(p as usize as u64)
}

/// `cuMemFreeHost`.
///
/// # Safety
/// `p` was returned by [`mem_alloc_host`], is not freed yet, and no copy into or out of it is running.
pub(super) unsafe fn mem_free_host(p: u64) -> Result<()> {
    // SAFETY: the caller guarantees `p` is a live pinned allocation.
    guarded("cuMemFreeHost", || unsafe {
        sys::cuMemFreeHost(p as usize as *mut c_void)
    })
}

/// `cuMemcpyDtoH` into raw host memory (synchronous).
///
/// # Safety
/// `[dst, dst + bytes)` is host memory valid for writes and not accessed by anything else meanwhile.
pub(super) unsafe fn memcpy_dtoh_raw(dst: u64, src: CUdeviceptr, bytes: usize) -> Result<()> {
    // SAFETY: the caller guarantees the host range; the driver validates the device range.
    guarded("cuMemcpyDtoH", || unsafe {
        sys::cuMemcpyDtoH_v2(dst as usize as *mut c_void, src, bytes)
    })
}

/// `cuMemcpyHtoD` from raw host memory (synchronous: from pinned memory the copy is complete on return).
///
/// # Safety
/// `[src, src + bytes)` is host memory valid for reads and not written meanwhile.
pub(super) unsafe fn memcpy_htod_raw(dst: CUdeviceptr, src: u64, bytes: usize) -> Result<()> {
    // SAFETY: the caller guarantees the host range; the driver validates the device range.
    guarded("cuMemcpyHtoD", || unsafe {
        sys::cuMemcpyHtoD_v2(dst, src as usize as *const c_void, bytes)
    })
}

/// `cuStreamIsCapturing`: whether `s` is capturing into a graph now (an invalidated capture counts).
///
/// # Safety
/// `s` is a live stream or the null stream.
pub(super) unsafe fn stream_is_capturing(s: CUstream) -> Result<bool> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: `status` is a valid out-pointer; the caller guarantees the stream.
    guarded("cuStreamIsCapturing", || unsafe {
        sys::cuStreamIsCapturing(s, &mut status)
    })?;
    Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}
