//! [`CudaDevice`]: the [`Device`] trait on the CUDA driver API, through cudarc 0.19 with dynamic loading.
//!
//! Layers, as in cudarc: `cudarc::driver::sys` (generated FFI) → `raw` (this crate's only module that
//! calls the driver: one wrapper per call, errors named after the call, loader panics caught) →
//! [`CudaDevice`] (bookkeeping and handle validation).
//!
//! # Loading and contexts
//! [`CudaDevice::new`] checks that a driver library can be opened at all (cudarc would panic in its lazy
//! loader otherwise; every call is also wrapped in `catch_unwind`, so a missing *symbol* of an old driver
//! is a [`DeviceError::NoDriver`] too), calls `cuInit`, checks the ordinal against `cuDeviceGetCount`
//! ([`DeviceError::InvalidDevice`]) and retains the device's **primary context** — the one the runtime API,
//! and so PyTorch, uses — so stream handles from PyTorch are valid here. Every method first makes that
//! context current on the calling thread if it is not already (`cuCtxGetCurrent`, and `cuCtxSetCurrent`
//! only on a change): a host thread may call any device, and the check costs a thread-local read in the
//! driver. The previous context is not restored (PyTorch calls an allocator with its device already
//! current, so in practice nothing changes).
//!
//! # Handles
//! Physical handles, pools and events are only accepted if this device created them (and has not released
//! them); anything else is [`DeviceError::InvalidArgument`], because the driver does not validate such
//! handles and a stale one could crash it. Stream handles cannot be validated — they come from PyTorch —
//! so a [`StreamId`] must be 0 or a live `CUstream` of this device's primary context (the contract of
//! PyTorch's allocator hook). Streams made by [`Device::stream_create`] are non-blocking.
//!
//! # Accounting
//! [`Device::reserved`] = bytes of plain allocations and physical handles (counted here with atomics) plus
//! the pools' `CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`. A pool's reservation only grows inside
//! `cuMemAllocFromPoolAsync`, so the pool's figure is re-read after each pool allocation and the peak is
//! updated there: the peak never under-reports what the driver held (it may over-report slightly when
//! another pool released memory at a synchronization this device did not see).
//!
//! # Teardown
//! Dropping a `CudaDevice` destroys the events, streams and pools it created and releases its primary
//! context retain; plain allocations, physical handles and reservations belong to the tiers, which release
//! them before (leftovers are logged). Errors during teardown never panic: [`CudaDevice::close`] returns
//! them, `Drop` logs them, and errors recorded while refreshing pool figures inside [`Device::reserved`]
//! (which cannot return an error) are kept for [`CudaDevice::take_errors`] (cudarc's `record_err` idea).

mod raw;

use std::collections::{HashMap, HashSet};
use std::ffi::c_int;
use std::fmt;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

use cudarc::driver::sys;
use parking_lot::{Mutex, RwLock};

use crate::{
    Captures, Device, DeviceError, DeviceProps, DevicePtr, EventHandle, HostHandle, PhysHandle,
    PoolHandle, PoolUsage, Reserved, Result, StreamId,
};

/// A raw driver handle (context, pool, event or stream) held as an integer.
///
/// CUDA handles are opaque pointers owned by the driver and usable from any host thread; this crate
/// stores them as `u64` so the device is `Send + Sync` without wrapping raw pointers.
type Raw = u64;

fn to_ptr<T>(h: Raw) -> *mut T {
    h as usize as *mut T
}

fn usize_of(call: &'static str, v: u64) -> Result<usize> {
    usize::try_from(v).map_err(|_| DeviceError::InvalidArgument {
        call,
        detail: format!("{v:#x} bytes do not fit in usize"),
    })
}

/// The host address of `[offset, offset + bytes)` of pinned buffer `host`, checked against its length.
fn host_range(
    hosts: &HashMap<u64, u64>,
    call: &'static str,
    host: HostHandle,
    offset: u64,
    bytes: u64,
) -> Result<u64> {
    crate::check_host_range(call, host, hosts.get(&host.0).copied(), offset, bytes)?;
    Ok(host.0 + offset)
}

fn inval(call: &'static str, detail: impl Into<String>) -> DeviceError {
    DeviceError::InvalidArgument {
        call,
        detail: detail.into(),
    }
}

/// A physical handle this device holds.
struct PhysEntry {
    bytes: u64,
    /// Made exportable (`CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR` requested at creation).
    exportable: bool,
    /// Imported from another process's descriptor: its memory is not counted here.
    imported: bool,
    /// The descriptor exported for it, closed (dropped) when the handle is released.
    export: Option<OwnedFd>,
}

/// A CUDA device through the driver API (see the [module documentation](self)).
pub struct CudaDevice {
    props: DeviceProps,
    dev: raw::CUdevice,
    ordinal_c: c_int,
    /// The retained primary context.
    ctx: Raw,
    /// Bytes of plain allocations and physical handles held now, and the peak of `held + pool_sum`.
    held: AtomicU64,
    peak: AtomicU64,
    /// Sum of the pools' last-read `RESERVED_MEM_CURRENT` (updated by wrapping deltas).
    pool_sum: AtomicU64,
    plain: Mutex<HashMap<DevicePtr, u64>>,
    /// Physical handles. `map` holds the read lock across the driver call, release the write lock, so
    /// a handle cannot be released while it is being mapped.
    phys: RwLock<HashMap<u64, PhysEntry>>,
    /// Whether `cuMemCreate` still asks for an exportable handle (cleared, once, when the driver refuses
    /// it: IPC of genpool's memory is then refused with a clear error).
    exportable: AtomicBool,
    /// Devices every new mapping is opened to ([`Device::add_peer`]).
    peers: RwLock<Vec<c_int>>,
    captures: Captures,
    /// Pools and their last-read reserved bytes (same locking discipline as `phys`).
    pools: RwLock<HashMap<Raw, AtomicU64>>,
    events: RwLock<HashSet<Raw>>,
    streams: Mutex<HashSet<Raw>>,
    /// Pinned host buffers (address -> length). Copies hold the lock across the driver call, so a
    /// buffer cannot be freed while a copy uses it.
    hosts: Mutex<HashMap<u64, u64>>,
    errors: Mutex<Vec<DeviceError>>,
    /// Hot-path driver calls made, by kind (see [`crate::CallCounts`]): relaxed counters, one line.
    counts: Counts,
    torn_down: bool,
}

/// The counters behind [`Device::call_counts`].
#[derive(Default)]
#[repr(align(64))]
struct Counts {
    waits: AtomicU64,
    device_syncs: AtomicU64,
    maps: AtomicU64,
    unmaps: AtomicU64,
    creates: AtomicU64,
    event_records: AtomicU64,
    event_queries: AtomicU64,
    stream_queries: AtomicU64,
    stream_waits: AtomicU64,
}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDevice")
            .field("props", &self.props)
            .field("held", &self.held.load(Relaxed))
            .field("pool_reserved", &self.pool_sum.load(Relaxed))
            .finish()
    }
}

impl CudaDevice {
    /// Open device `ordinal`: load the driver, `cuInit`, retain the primary context.
    ///
    /// Errors: [`DeviceError::NoDriver`] when no driver library can be loaded or the driver reports no
    /// device; [`DeviceError::InvalidDevice`] for an ordinal out of range; `Driver` for anything else.
    pub fn new(ordinal: usize) -> Result<Self> {
        if !raw::driver_present() {
            return Err(DeviceError::NoDriver(
                "the CUDA driver library (libcuda.so) could not be loaded".into(),
            ));
        }
        match raw::init() {
            Ok(()) => {}
            Err(DeviceError::Driver { code, message, .. })
                if code == sys::CUresult::CUDA_ERROR_NO_DEVICE as i32
                    || code == sys::CUresult::CUDA_ERROR_STUB_LIBRARY as i32
                    || code == sys::CUresult::CUDA_ERROR_SYSTEM_DRIVER_MISMATCH as i32 =>
            {
                return Err(DeviceError::NoDriver(format!("cuInit: {message}")));
            }
            Err(e) => return Err(e),
        }
        let count = raw::device_count()?;
        if count == 0 {
            return Err(DeviceError::NoDriver(
                "cuDeviceGetCount: no CUDA device present".into(),
            ));
        }
        let ordinal_c = c_int::try_from(ordinal)
            .ok()
            .filter(|_| ordinal < count)
            .ok_or(DeviceError::InvalidDevice { ordinal, count })?;
        let dev = raw::device_get(ordinal_c)?;
        let name = raw::device_name(dev)?;
        let total_mem = raw::device_total_mem(dev)?;
        let vmm = raw::device_attribute(
            dev,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
        )? != 0;
        let pools = raw::device_attribute(
            dev,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED,
        )? != 0;
        let ctx = raw::primary_ctx_retain(dev)?;
        let mut me = CudaDevice {
            props: DeviceProps {
                ordinal,
                name,
                total_mem,
                vmm_granularity: 0,
                supports_vmm: vmm,
                supports_pools: pools,
            },
            dev,
            ordinal_c,
            ctx: ctx as usize as Raw,
            held: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            pool_sum: AtomicU64::new(0),
            plain: Mutex::new(HashMap::new()),
            phys: RwLock::new(HashMap::new()),
            exportable: AtomicBool::new(true),
            peers: RwLock::new(Vec::new()),
            captures: Captures::new(),
            pools: RwLock::new(HashMap::new()),
            events: RwLock::new(HashSet::new()),
            streams: Mutex::new(HashSet::new()),
            hosts: Mutex::new(HashMap::new()),
            errors: Mutex::new(Vec::new()),
            counts: Counts::default(),
            torn_down: false,
        };
        // From here on `me` owns the retain: an error below releases it through Drop.
        me.enter()?;
        if vmm {
            me.props.vmm_granularity = raw::granularity(ordinal_c)?;
        }
        Ok(me)
    }

    /// Make the primary context current on this thread.
    fn enter(&self) -> Result<()> {
        // SAFETY: `self.ctx` is the primary context retained in `new` and released only in teardown.
        unsafe { raw::ensure_current(to_ptr(self.ctx)) }
    }

    fn stream(s: StreamId) -> raw::CUstream {
        to_ptr(s)
    }

    fn note_peak(&self) {
        let now = self
            .held
            .load(Relaxed)
            .wrapping_add(self.pool_sum.load(Relaxed));
        self.peak.fetch_max(now, Relaxed);
    }

    /// Re-read one pool's reserved bytes and fold the change into `pool_sum`.
    fn refresh_pool(&self, pool: Raw, slot: &AtomicU64) -> Result<()> {
        // SAFETY: `pool` is in the registry (the caller holds its read lock), so it is live.
        let now = unsafe {
            raw::pool_get_u64(
                to_ptr(pool),
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
            )
        }?;
        let old = slot.swap(now, Relaxed);
        self.pool_sum.fetch_add(now.wrapping_sub(old), Relaxed);
        Ok(())
    }

    fn record(&self, e: DeviceError) {
        self.errors.lock().push(e);
    }

    /// Errors recorded where they could not be returned (inside [`Device::reserved`]), oldest first.
    pub fn take_errors(&self) -> Vec<DeviceError> {
        std::mem::take(&mut *self.errors.lock())
    }

    /// Tear down now and report the first error (see the module doc); `Drop` does the same but logs.
    pub fn close(mut self) -> Result<()> {
        let errs = self.teardown();
        match errs.into_iter().next() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn teardown(&mut self) -> Vec<DeviceError> {
        if self.torn_down {
            return Vec::new();
        }
        self.torn_down = true;
        let mut errs = self.take_errors();
        if let Err(e) = self.enter() {
            errs.push(e);
        }
        for e in self.events.get_mut().drain() {
            // SAFETY: the event was created by this device and is destroyed once (drained).
            if let Err(err) = unsafe { raw::event_destroy(to_ptr(e)) } {
                errs.push(err);
            }
        }
        for s in self.streams.get_mut().drain() {
            // SAFETY: the stream was created by this device and is destroyed once (drained).
            if let Err(err) = unsafe { raw::stream_destroy(to_ptr(s)) } {
                errs.push(err);
            }
        }
        for (p, _) in self.pools.get_mut().drain() {
            // SAFETY: the pool was created by this device and is destroyed once (drained). With
            // allocations outstanding the driver defers the release until they are freed.
            if let Err(err) = unsafe { raw::pool_destroy(to_ptr(p)) } {
                errs.push(err);
            }
        }
        for (h, _) in self.hosts.get_mut().drain() {
            // SAFETY: the buffer was made by `host_alloc` and is freed once (drained); no copy runs (we
            // hold `&mut self`).
            if let Err(err) = unsafe { raw::mem_free_host(h) } {
                errs.push(err);
            }
        }
        let (n_plain, n_phys) = (self.plain.get_mut().len(), self.phys.get_mut().len());
        if n_plain + n_phys > 0 {
            log::warn!(
                "CudaDevice {}: dropped with {n_plain} plain allocation(s) and {n_phys} physical handle(s) still held",
                self.props.ordinal
            );
        }
        // SAFETY: balances the retain in `new`; nothing uses the context through this device any more.
        if let Err(e) = unsafe { raw::primary_ctx_release(self.dev) } {
            errs.push(e);
        }
        errs
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        for e in self.teardown() {
            log::error!("CudaDevice {} teardown: {e}", self.props.ordinal);
        }
    }
}

impl Device for CudaDevice {
    fn props(&self) -> &DeviceProps {
        &self.props
    }

    fn reserved(&self) -> Reserved {
        if let Err(e) = self.enter() {
            self.record(e);
        } else {
            let pools = self.pools.read();
            for (&p, slot) in pools.iter() {
                if let Err(e) = self.refresh_pool(p, slot) {
                    self.record(e);
                }
            }
        }
        self.note_peak();
        Reserved {
            current: self
                .held
                .load(Relaxed)
                .wrapping_add(self.pool_sum.load(Relaxed)),
            peak: self.peak.load(Relaxed),
        }
    }

    fn mem_info(&self) -> Result<(u64, u64)> {
        self.enter()?;
        raw::mem_get_info()
    }

    fn mem_alloc(&self, bytes: u64) -> Result<DevicePtr> {
        let call = "cuMemAlloc";
        if bytes == 0 {
            return Err(inval(call, "zero bytes"));
        }
        self.enter()?;
        let p = raw::mem_alloc(usize_of(call, bytes)?)?;
        self.plain.lock().insert(p, bytes);
        self.held.fetch_add(bytes, Relaxed);
        self.note_peak();
        Ok(p)
    }

    fn mem_free(&self, ptr: DevicePtr) -> Result<()> {
        let call = "cuMemFree";
        self.enter()?;
        let mut plain = self.plain.lock();
        let Some(&bytes) = plain.get(&ptr) else {
            return Err(inval(
                call,
                format!("{ptr:#x} is not a live mem_alloc pointer of this device"),
            ));
        };
        // SAFETY: `ptr` is a live allocation of this device; device-side use is the caller's contract.
        unsafe { raw::mem_free(ptr) }?;
        plain.remove(&ptr);
        self.held.fetch_sub(bytes, Relaxed);
        Ok(())
    }

    fn va_reserve(&self, bytes: u64, align: u64) -> Result<DevicePtr> {
        let call = "cuMemAddressReserve";
        self.enter()?;
        raw::address_reserve(usize_of(call, bytes)?, usize_of(call, align)?)
    }

    fn va_release(&self, ptr: DevicePtr, bytes: u64) -> Result<()> {
        self.enter()?;
        raw::address_free(ptr, usize_of("cuMemAddressFree", bytes)?)
    }

    fn phys_create(&self, bytes: u64) -> Result<PhysHandle> {
        let call = "cuMemCreate";
        self.enter()?;
        self.counts.creates.fetch_add(1, Relaxed);
        let n = usize_of(call, bytes)?;
        let mut exportable = self.exportable.load(Relaxed);
        let h = match raw::mem_create(n, self.ordinal_c, exportable) {
            Ok(h) => h,
            Err(e) if exportable && !e.is_oom() => {
                // A driver or platform without POSIX-descriptor export: plain pages from now on.
                log::warn!(
                    "CudaDevice {}: cuMemCreate with an exportable handle failed ({e}); creating \
                     pages without one (CUDA IPC of this device's memory will be refused)",
                    self.props.ordinal
                );
                self.exportable.store(false, Relaxed);
                exportable = false;
                raw::mem_create(n, self.ordinal_c, false)?
            }
            Err(e) => return Err(e),
        };
        self.phys.write().insert(
            h,
            PhysEntry {
                bytes,
                exportable,
                imported: false,
                export: None,
            },
        );
        self.held.fetch_add(bytes, Relaxed);
        self.note_peak();
        Ok(PhysHandle(h))
    }

    fn phys_release(&self, handle: PhysHandle) -> Result<()> {
        let call = "cuMemRelease";
        self.enter()?;
        let mut phys = self.phys.write();
        let Some(e) = phys.get(&handle.0) else {
            return Err(inval(
                call,
                format!("unknown physical handle {:#x}", handle.0),
            ));
        };
        let (bytes, imported) = (e.bytes, e.imported);
        // SAFETY: the handle is live (in the registry) and removed below, so it is released once.
        unsafe { raw::mem_release(handle.0) }?;
        // Dropping the entry closes the descriptor exported for it, if any.
        phys.remove(&handle.0);
        if !imported {
            self.held.fetch_sub(bytes, Relaxed);
        }
        Ok(())
    }

    fn map(&self, va: DevicePtr, bytes: u64, handle: PhysHandle) -> Result<()> {
        self.map_run(va, bytes, std::slice::from_ref(&handle))
    }

    fn map_run(&self, va: DevicePtr, bytes: u64, handles: &[PhysHandle]) -> Result<()> {
        let call = "cuMemMap";
        self.enter()?;
        self.counts.maps.fetch_add(handles.len() as u64, Relaxed);
        let phys = self.phys.read();
        for h in handles {
            match phys.get(&h.0) {
                None => return Err(inval(call, format!("unknown physical handle {:#x}", h.0))),
                Some(e) if e.bytes != bytes => {
                    return Err(inval(
                        call,
                        format!(
                            "size {bytes:#x} differs from the handle's size {:#x}",
                            e.bytes
                        ),
                    ))
                }
                Some(_) => {}
            }
        }
        let raw_handles: Vec<_> = handles.iter().map(|h| h.0).collect();
        // This device and its peers: a page mapped after `add_peer` is open to the peer at once.
        let ordinals: Vec<c_int> = std::iter::once(self.ordinal_c)
            .chain(self.peers.read().iter().copied())
            .collect();
        // SAFETY: every handle is live and of `bytes` bytes; the read lock keeps them from being released.
        unsafe { raw::mem_map_run(va, usize_of(call, bytes)?, &raw_handles, &ordinals) }
    }

    fn unmap(&self, va: DevicePtr, bytes: u64) -> Result<()> {
        self.enter()?;
        self.counts.unmaps.fetch_add(1, Relaxed);
        // SAFETY: the driver validates the range; that no queued work uses it is the tiers' contract.
        unsafe { raw::mem_unmap(va, usize_of("cuMemUnmap", bytes)?) }
    }

    fn pool_create(&self, release_threshold: u64) -> Result<PoolHandle> {
        self.enter()?;
        let pool = raw::pool_create(self.ordinal_c)?;
        // SAFETY: the pool was just created; the release threshold is a cuuint64_t attribute.
        let set = unsafe {
            raw::pool_set_u64(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                release_threshold,
            )
        };
        if let Err(e) = set {
            // SAFETY: the pool was just created, holds nothing and is not registered anywhere.
            if let Err(e2) = unsafe { raw::pool_destroy(pool) } {
                self.record(e2);
            }
            return Err(e);
        }
        let id = pool as usize as Raw;
        self.pools.write().insert(id, AtomicU64::new(0));
        Ok(PoolHandle(id))
    }

    fn pool_destroy(&self, pool: PoolHandle) -> Result<()> {
        let call = "cuMemPoolDestroy";
        self.enter()?;
        let mut pools = self.pools.write();
        let Some(slot) = pools.get(&pool.0) else {
            return Err(inval(call, format!("unknown pool {:#x}", pool.0)));
        };
        // SAFETY: the pool is live (registered) and unregistered below, so it is destroyed once.
        unsafe { raw::pool_destroy(to_ptr(pool.0)) }?;
        let last = slot.load(Relaxed);
        self.pool_sum.fetch_sub(last, Relaxed);
        pools.remove(&pool.0);
        Ok(())
    }

    fn pool_alloc_async(
        &self,
        pool: PoolHandle,
        bytes: u64,
        stream: StreamId,
    ) -> Result<DevicePtr> {
        let call = "cuMemAllocFromPoolAsync";
        if bytes == 0 {
            return Err(inval(call, "zero bytes"));
        }
        self.enter()?;
        let pools = self.pools.read();
        let slot = pools
            .get(&pool.0)
            .ok_or_else(|| inval(call, format!("unknown pool {:#x}", pool.0)))?;
        // SAFETY: the pool is live (the read lock keeps it registered); the stream is the caller's
        // contract (module doc).
        let p = unsafe {
            raw::alloc_from_pool_async(usize_of(call, bytes)?, to_ptr(pool.0), Self::stream(stream))
        }?;
        // The reservation can only have grown inside the allocation: re-read it for the peak.
        match self.refresh_pool(pool.0, slot) {
            Ok(()) => self.note_peak(),
            Err(e) => self.record(e),
        }
        Ok(p)
    }

    fn pool_free_async(&self, ptr: DevicePtr, stream: StreamId) -> Result<()> {
        self.enter()?;
        // SAFETY: the stream is the caller's contract (module doc); the driver validates the pointer.
        unsafe { raw::free_async(ptr, Self::stream(stream)) }
    }

    fn pool_trim(&self, pool: PoolHandle, keep: u64) -> Result<()> {
        let call = "cuMemPoolTrimTo";
        self.enter()?;
        let pools = self.pools.read();
        let slot = pools
            .get(&pool.0)
            .ok_or_else(|| inval(call, format!("unknown pool {:#x}", pool.0)))?;
        // SAFETY: the pool is live (registered, read lock held).
        unsafe { raw::pool_trim_to(to_ptr(pool.0), usize_of(call, keep)?) }?;
        self.refresh_pool(pool.0, slot)
    }

    fn pool_usage(&self, pool: PoolHandle) -> Result<PoolUsage> {
        use sys::CUmemPool_attribute::*;
        self.enter()?;
        let pools = self.pools.read();
        if !pools.contains_key(&pool.0) {
            return Err(inval(
                "cuMemPoolGetAttribute",
                format!("unknown pool {:#x}", pool.0),
            ));
        }
        let p = to_ptr(pool.0);
        // SAFETY (all four): the pool is live (registered, read lock held); these attributes are cuuint64_t.
        Ok(PoolUsage {
            // SAFETY: see above.
            reserved_current: unsafe {
                raw::pool_get_u64(p, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)
            }?,
            // SAFETY: see above.
            reserved_high: unsafe { raw::pool_get_u64(p, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH) }?,
            // SAFETY: see above.
            used_current: unsafe { raw::pool_get_u64(p, CU_MEMPOOL_ATTR_USED_MEM_CURRENT) }?,
            // SAFETY: see above.
            used_high: unsafe { raw::pool_get_u64(p, CU_MEMPOOL_ATTR_USED_MEM_HIGH) }?,
        })
    }

    fn stream_create(&self) -> Result<StreamId> {
        self.enter()?;
        let s = raw::stream_create()? as usize as Raw;
        self.streams.lock().insert(s);
        Ok(s)
    }

    fn stream_destroy(&self, stream: StreamId) -> Result<()> {
        let call = "cuStreamDestroy";
        self.enter()?;
        let mut streams = self.streams.lock();
        if !streams.contains(&stream) {
            return Err(inval(
                call,
                format!("stream {stream:#x} was not created by this device"),
            ));
        }
        // SAFETY: the stream was created here and is unregistered below, so it is destroyed once.
        unsafe { raw::stream_destroy(Self::stream(stream)) }?;
        streams.remove(&stream);
        Ok(())
    }

    fn stream_synchronize(&self, stream: StreamId) -> Result<()> {
        self.enter()?;
        self.counts.waits.fetch_add(1, Relaxed);
        // SAFETY: the stream is the caller's contract (module doc).
        unsafe { raw::stream_synchronize(Self::stream(stream)) }
    }

    fn stream_query(&self, stream: StreamId) -> Result<bool> {
        self.enter()?;
        self.counts.stream_queries.fetch_add(1, Relaxed);
        // SAFETY: the stream is the caller's contract (module doc).
        unsafe { raw::stream_query(Self::stream(stream)) }
    }

    fn event_create(&self) -> Result<EventHandle> {
        self.enter()?;
        let e = raw::event_create()? as usize as Raw;
        self.events.write().insert(e);
        Ok(EventHandle(e))
    }

    fn event_destroy(&self, event: EventHandle) -> Result<()> {
        let call = "cuEventDestroy";
        self.enter()?;
        let mut events = self.events.write();
        if !events.contains(&event.0) {
            return Err(inval(call, format!("unknown event {:#x}", event.0)));
        }
        // SAFETY: the event was created here and is unregistered below, so it is destroyed once.
        unsafe { raw::event_destroy(to_ptr(event.0)) }?;
        events.remove(&event.0);
        Ok(())
    }

    fn event_record(&self, event: EventHandle, stream: StreamId) -> Result<()> {
        self.enter()?;
        self.counts.event_records.fetch_add(1, Relaxed);
        let events = self.events.read();
        if !events.contains(&event.0) {
            return Err(inval(
                "cuEventRecord",
                format!("unknown event {:#x}", event.0),
            ));
        }
        // SAFETY: the event is live (registered, read lock held); the stream is the caller's contract.
        unsafe { raw::event_record(to_ptr(event.0), Self::stream(stream)) }
    }

    fn event_query(&self, event: EventHandle) -> Result<bool> {
        self.enter()?;
        self.counts.event_queries.fetch_add(1, Relaxed);
        let events = self.events.read();
        if !events.contains(&event.0) {
            return Err(inval(
                "cuEventQuery",
                format!("unknown event {:#x}", event.0),
            ));
        }
        // SAFETY: the event is live (registered, read lock held).
        unsafe { raw::event_query(to_ptr(event.0)) }
    }

    fn event_synchronize(&self, event: EventHandle) -> Result<()> {
        self.enter()?;
        self.counts.waits.fetch_add(1, Relaxed);
        let events = self.events.read();
        if !events.contains(&event.0) {
            return Err(inval(
                "cuEventSynchronize",
                format!("unknown event {:#x}", event.0),
            ));
        }
        // SAFETY: the event is live (registered, read lock held).
        unsafe { raw::event_synchronize(to_ptr(event.0)) }
    }

    fn stream_wait_event(&self, stream: StreamId, event: EventHandle) -> Result<()> {
        self.enter()?;
        self.counts.stream_waits.fetch_add(1, Relaxed);
        let events = self.events.read();
        if !events.contains(&event.0) {
            return Err(inval(
                "cuStreamWaitEvent",
                format!("unknown event {:#x}", event.0),
            ));
        }
        // SAFETY: the event is live (registered, read lock held); the stream is the caller's contract.
        unsafe { raw::stream_wait_event(Self::stream(stream), to_ptr(event.0)) }
    }

    fn synchronize(&self) -> Result<()> {
        self.enter()?;
        self.counts.waits.fetch_add(1, Relaxed);
        self.counts.device_syncs.fetch_add(1, Relaxed);
        raw::ctx_synchronize()
    }

    fn call_counts(&self) -> crate::CallCounts {
        let c = &self.counts;
        crate::CallCounts {
            waits: c.waits.load(Relaxed),
            device_syncs: c.device_syncs.load(Relaxed),
            maps: c.maps.load(Relaxed),
            unmaps: c.unmaps.load(Relaxed),
            creates: c.creates.load(Relaxed),
            event_records: c.event_records.load(Relaxed),
            event_queries: c.event_queries.load(Relaxed),
            stream_queries: c.stream_queries.load(Relaxed),
            stream_waits: c.stream_waits.load(Relaxed),
        }
    }

    fn write(&self, dst: DevicePtr, data: &[u8]) -> Result<()> {
        self.enter()?;
        raw::memcpy_htod(dst, data)
    }

    fn read(&self, src: DevicePtr, out: &mut [u8]) -> Result<()> {
        self.enter()?;
        raw::memcpy_dtoh(out, src)
    }

    fn host_alloc(&self, bytes: u64) -> Result<HostHandle> {
        let call = "cuMemAllocHost";
        if bytes == 0 {
            return Err(inval(call, "zero bytes"));
        }
        self.enter()?;
        let p = raw::mem_alloc_host(usize_of(call, bytes)?)?;
        self.hosts.lock().insert(p, bytes);
        Ok(HostHandle(p))
    }

    fn host_free(&self, host: HostHandle) -> Result<()> {
        let call = "cuMemFreeHost";
        self.enter()?;
        let mut hosts = self.hosts.lock();
        if !hosts.contains_key(&host.0) {
            return Err(inval(call, format!("unknown pinned buffer {:#x}", host.0)));
        }
        // SAFETY: the buffer is live (registered) and removed below, so it is freed once; copies hold
        // the lock, so none is running.
        unsafe { raw::mem_free_host(host.0) }?;
        hosts.remove(&host.0);
        Ok(())
    }

    fn copy_to_host(
        &self,
        host: HostHandle,
        offset: u64,
        src: DevicePtr,
        bytes: u64,
    ) -> Result<()> {
        let call = "cuMemcpyDtoH";
        self.enter()?;
        let hosts = self.hosts.lock();
        let at = host_range(&hosts, call, host, offset, bytes)?;
        // SAFETY: `[at, at + bytes)` lies inside a live pinned buffer of this device (checked above),
        // which cannot be freed while the lock is held; the driver validates the device range.
        unsafe { raw::memcpy_dtoh_raw(at, src, usize_of(call, bytes)?) }
    }

    fn copy_from_host(
        &self,
        dst: DevicePtr,
        host: HostHandle,
        offset: u64,
        bytes: u64,
    ) -> Result<()> {
        let call = "cuMemcpyHtoD";
        self.enter()?;
        let hosts = self.hosts.lock();
        let at = host_range(&hosts, call, host, offset, bytes)?;
        // SAFETY: as in `copy_to_host`: the host range is inside a live pinned buffer, locked.
        unsafe { raw::memcpy_htod_raw(dst, at, usize_of(call, bytes)?) }
    }

    fn stream_is_capturing(&self, stream: StreamId) -> Result<bool> {
        self.enter()?;
        // SAFETY: the stream is the caller's contract (module doc).
        unsafe { raw::stream_is_capturing(Self::stream(stream)) }
    }

    fn memset_async(&self, dst: DevicePtr, byte: u8, len: u64, stream: StreamId) -> Result<()> {
        self.enter()?;
        // SAFETY: the stream is the caller's contract (module doc); the driver validates the range.
        unsafe {
            raw::memset_d8_async(
                dst,
                byte,
                usize_of("cuMemsetD8Async", len)?,
                Self::stream(stream),
            )
        }
    }

    fn captures(&self) -> &Captures {
        &self.captures
    }

    fn add_peer(&self, peer: usize) -> Result<bool> {
        let call = "cuMemSetAccess";
        self.enter()?;
        let count = raw::device_count()?;
        let p = c_int::try_from(peer).ok().filter(|_| peer < count).ok_or(
            DeviceError::InvalidDevice {
                ordinal: peer,
                count,
            },
        )?;
        if p == self.ordinal_c {
            return Err(inval(call, format!("device {peer} cannot be its own peer")));
        }
        let mut peers = self.peers.write();
        if peers.contains(&p) {
            return Ok(false);
        }
        peers.push(p);
        Ok(true)
    }

    fn set_peer_access(&self, va: DevicePtr, bytes: u64, peer: usize) -> Result<()> {
        let call = "cuMemSetAccess";
        self.enter()?;
        let p = c_int::try_from(peer).map_err(|_| inval(call, format!("device {peer}")))?;
        raw::mem_set_access(va, usize_of(call, bytes)?, p)
    }

    fn export_handle(&self, handle: PhysHandle) -> Result<i32> {
        let call = "cuMemExportToShareableHandle";
        self.enter()?;
        let mut phys = self.phys.write();
        let Some(e) = phys.get_mut(&handle.0) else {
            return Err(inval(
                call,
                format!("unknown physical handle {:#x}", handle.0),
            ));
        };
        if let Some(fd) = &e.export {
            return Ok(fd.as_raw_fd());
        }
        if e.imported {
            return Err(inval(
                call,
                format!("handle {:#x} was imported; its owner exports it", handle.0),
            ));
        }
        if !e.exportable {
            return Err(DeviceError::Unsupported(
                "cuMemExportToShareableHandle (this driver refused exportable pages)",
            ));
        }
        // SAFETY: the handle is live (registered, write lock held) and was made exportable.
        let fd = unsafe { raw::export_fd(handle.0) }?;
        // SAFETY: the driver just opened `fd` for this process and hands its ownership to us.
        let owned = unsafe { OwnedFd::from_raw_fd(fd) };
        e.export = Some(owned);
        Ok(fd)
    }

    fn import_handle(&self, fd: BorrowedFd<'_>, bytes: u64) -> Result<PhysHandle> {
        self.enter()?;
        let h = raw::import_fd(fd.as_raw_fd())?;
        self.phys.write().insert(
            h,
            PhysEntry {
                bytes,
                exportable: false,
                imported: true,
                export: None,
            },
        );
        Ok(PhysHandle(h))
    }
}
