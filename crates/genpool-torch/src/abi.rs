//! The exported C functions. Each one runs inside [`guard`]: a panic is caught, logged and turned into
//! the function's failure value (NULL, 0, or nothing), so no unwinding ever crosses into C++.

use std::ffi::{c_char, c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};

use genpool::{FreeFault, GenpoolError, PoolStats};

use crate::error::PluginError;
use crate::registry::{self, ROUTER};
use crate::report;
use crate::sleep_abi;
use crate::timing;

/// A CUDA stream handle (`cudaStream_t`, i.e. `CUstream`); NULL is the legacy default stream.
#[allow(non_camel_case_types)]
pub type cudaStream_t = *mut c_void;

/// Run `f` with panics caught: a panic is logged, becomes the last error, and `on_panic` is returned.
/// Inlined into each entry point: called, it received the entry point's arguments as a closure built on
/// the stack, whose copy failed store forwarding on every call (`benches/host/abi_replay.c`).
#[inline(always)]
pub(crate) fn guard<T>(call: &'static str, on_panic: T, f: impl FnOnce() -> T) -> T {
    let res = catch_unwind(AssertUnwindSafe(|| {
        #[cfg(test)]
        hooks::maybe_panic(call);
        f()
    }));
    match res {
        Ok(v) => v,
        Err(payload) => {
            let message = if let Some(s) = payload.downcast_ref::<&str>() {
                (*s).to_string()
            } else if let Some(s) = payload.downcast_ref::<String>() {
                s.clone()
            } else {
                "non-string panic payload".to_string()
            };
            let e = PluginError::Panic { call, message };
            log::error!("genpool: {e}");
            report::set_last_error(&e);
            on_panic
        }
    }
}

/// Record a failure: last error, plus a log line (warn for out-of-memory, which PyTorch handles by
/// raising `torch.OutOfMemoryError`; error for everything else).
pub(crate) fn fail(e: &PluginError) {
    report::set_last_error(e);
    match e {
        PluginError::Engine(g) if g.is_oom() => log::warn!("genpool: {e}"),
        PluginError::OverFraction { .. } => log::warn!("genpool: {e}"),
        _ => log::error!("genpool: {e}"),
    }
}

fn stream_id(stream: cudaStream_t) -> u64 {
    stream.addr() as u64
}

/// Allocate `size` bytes on device `device` for use on `stream` (PyTorch's `alloc_fn`). Returns NULL on
/// failure: `size == 0` (no error recorded), an invalid device, out of memory; the reason is available
/// from [`genpool_last_error`]. PyTorch's pluggable hook does not check for NULL: the Python package puts
/// a small C++ wrapper in front that throws `c10::OutOfMemoryError` instead.
#[no_mangle]
pub extern "C" fn genpool_malloc(size: usize, device: c_int, stream: cudaStream_t) -> *mut c_void {
    guard("genpool_malloc", std::ptr::null_mut(), || {
        timing::timed(&timing::MALLOC, || {
            if size == 0 {
                return std::ptr::null_mut();
            }
            // Tagged memory (sleep_abi): one thread-local read when the thread has no tag.
            if let Some(res) =
                sleep_abi::tagged_alloc(size as u64, device.into(), stream_id(stream))
            {
                return match res {
                    Ok(p) => std::ptr::without_provenance_mut(p as usize),
                    Err(e) => {
                        fail(&e);
                        std::ptr::null_mut()
                    }
                };
            }
            match registry::alloc(device.into(), size as u64, stream_id(stream), |p| {
                p.allocated()
            }) {
                // A device address, never dereferenced on the host: an address without provenance.
                Ok(b) => std::ptr::without_provenance_mut(b.ptr as usize),
                Err(e) => {
                    fail(&e);
                    std::ptr::null_mut()
                }
            }
        })
    })
}

/// Free `ptr` of device `device` on `stream` (PyTorch's `free_fn`; `size` is the size PyTorch asked for
/// and is not needed). A pointer outside the addresses `device` ever handed out is routed by address to
/// the device that owns it. A pointer this plug-in did not hand out, or one freed twice, is refused: counted,
/// logged once per pointer, never a crash. NULL is ignored.
#[no_mangle]
pub extern "C" fn genpool_free(ptr: *mut c_void, size: usize, device: c_int, stream: cudaStream_t) {
    let _ = size;
    guard("genpool_free", (), || {
        timing::timed(&timing::FREE, || {
            if ptr.is_null() {
                return;
            }
            let addr = ptr.addr() as u64;
            // Whichever device and engine (tags' included) hold it; `device` is a guess (PyTorch may
            // free with another device's index). Uses recorded by `genpool_record_stream` are waited for
            // first: on failure the block stays allocated (leaked) rather than race a kernel.
            let res = registry::check_index(device.into())
                .and_then(|near| ROUTER.free_near(addr, near, stream_id(stream)));
            match res {
                Ok(_) => {}
                Err(e @ PluginError::Engine(GenpoolError::InvalidFree { .. })) => {
                    report::set_last_error(&e);
                    report::invalid_free(device, addr, &e);
                }
                Err(e) => fail(&e),
            }
        })
    })
}

/// PyTorch's `init_fn`, called once when CUDA is initialised with the number of visible devices: device
/// indices at or past it are refused from then on. Pools are still created lazily, per device, on first
/// allocation (so no CUDA context is created on a device the program never uses).
#[no_mangle]
pub extern "C" fn genpool_init(device_count: c_int) {
    guard("genpool_init", (), || {
        report::init_logging();
        match usize::try_from(device_count) {
            Ok(n) => {
                registry::set_device_count(n);
                log::info!("genpool: initialised for {n} device(s)");
            }
            Err(_) => fail(&PluginError::InvalidDeviceCount(device_count.into())),
        }
    })
}

/// PyTorch's `reset_fn`, called by `torch.cuda.empty_cache()`: give back everything cached on every
/// device (live blocks are untouched).
#[no_mangle]
pub extern "C" fn genpool_reset() {
    guard("genpool_reset", (), || {
        // PyTorch's emptyCache waits for the events of blocks freed after uses on other streams
        // first (so they are given back too); genpool's are the held-back blocks. Not during a
        // capture, where no event may be waited for (they stay held).
        if let Err(e) = ROUTER.flush_deferred() {
            log::error!("genpool: empty_cache: waiting for held-back blocks: {e}");
        }
        let released: u64 = ROUTER.trim()
            // Tagged memory (sleep_abi).
            + sleep_abi::trim_all();
        log::info!("genpool: empty_cache released {released} B");
    })
}

/// PyTorch's `memory_fraction_fn` (`torch.cuda.set_per_process_memory_fraction(fraction, device)`): cap
/// the device's live bytes at `fraction` of its memory; allocations past it return NULL. It may be changed
/// at any time; a hard cap on the physical memory the engine holds is `GENPOOL_CONF=limit:<bytes>`. A
/// fraction outside `(0, 1]` is refused (last error set).
#[no_mangle]
pub extern "C" fn genpool_set_memory_fraction(fraction: f64, device: c_int) {
    guard("genpool_set_memory_fraction", (), || {
        if let Err(e) = registry::set_fraction(device.into(), fraction) {
            fail(&e);
        }
    })
}

/// PyTorch's `record_stream_fn` (`Tensor.record_stream(stream)`): the block at `ptr` is used on `stream`
/// too. When it is freed, it is not reused before the work queued on `stream` up to the free has run:
/// by default as PyTorch's own allocator does it — nothing when `stream` is idle then, else an event
/// recorded there and the block held out of reuse until it completes, no stream made to wait
/// (`GENPOOL_CONF=record_stream:wait`: the free's stream waits on the device instead).
#[no_mangle]
pub extern "C" fn genpool_record_stream(ptr: *mut c_void, stream: cudaStream_t) {
    guard("genpool_record_stream", (), || {
        let addr = ptr.addr() as u64;
        // The owner's stream (any engine of the device holding the block): the free waits for it.
        let res = match ROUTER.owner(addr) {
            Some(index) => ROUTER.record_use(addr, index, stream_id(stream)),
            None => Err(GenpoolError::InvalidFree {
                ptr: addr,
                fault: FreeFault::Unknown,
            }
            .into()),
        };
        if let Err(e) = res {
            report::set_last_error(&format_args!("record_stream: {e}"));
            log::warn!("genpool: record_stream on {addr:#x}, a block this plug-in does not hold");
        }
    })
}

fn stats_value(device: c_int) -> Result<serde_json::Value, PluginError> {
    let state = registry::existing(device.into())?;
    let stats = state.map_or_else(PoolStats::default, |s| s.pool.stats());
    let mut v = serde_json::to_value(&stats).map_err(|e| PluginError::Json(e.to_string()))?;
    if let Some(map) = v.as_object_mut() {
        use serde_json::json;
        map.insert("device".into(), json!(device));
        map.insert("initialized".into(), json!(state.is_some()));
        if let Some(s) = state {
            let props = s.pool.device().props();
            map.insert("device_name".into(), json!(props.name));
            map.insert("total_mem".into(), json!(props.total_mem));
            map.insert("live_blocks".into(), json!(s.pool.live_blocks()));
            map.insert("memory_fraction_cap".into(), json!(s.cap()));
            let (waits, fallbacks) = ROUTER.ordering(s.index())?;
            map.insert("stream_waits".into(), json!(waits));
            let all = ROUTER.all_stats();
            map.insert("held_back".into(), json!(all.deferred_pending));
            map.insert("use_queries".into(), json!(all.use_queries));
            map.insert("sync_fallbacks".into(), json!(fallbacks));
        }
        map.insert(
            "plugin_invalid_frees".into(),
            json!(report::invalid_frees()),
        );
        map.insert(
            "plugin_recorded_blocks".into(),
            json!(ROUTER.recorded_blocks()),
        );
        // Tagged memory (sleep_abi): the tags' engines on this device, summed.
        map.insert("tagged".into(), sleep_abi::device_summary(device.into()));
        // Host time inside genpool_malloc / genpool_free (null unless GENPOOL_TIMING is set).
        map.insert("host_timing".into(), timing::json());
    }
    Ok(v)
}

/// Write device `device`'s statistics as one JSON object into `buf` (`snprintf`-style: at most `len - 1`
/// bytes and a terminating NUL; nothing with a NULL `buf` or `len == 0`). Returns the JSON's length in
/// bytes (call again with a buffer of at least that plus one if it was larger than `len - 1`), or 0 for an
/// invalid device (last error set). A device with no pool yet reports zeros and `"initialized": false`.
///
/// # Safety
/// `buf` is NULL or valid for writes of `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn genpool_stats_json(device: c_int, buf: *mut c_char, len: usize) -> usize {
    guard("genpool_stats_json", 0, || match stats_value(device) {
        // SAFETY: forwarded from this function's contract.
        Ok(v) => unsafe { report::copy_out(&v.to_string(), buf, len) },
        Err(e) => {
            fail(&e);
            0
        }
    })
}

/// Give back what device `device` caches (blocks held for reuse, empty chunks, unused pages). Returns the
/// bytes of reservation released; 0 for a device with no pool or an invalid one (last error set).
#[no_mangle]
pub extern "C" fn genpool_trim(device: c_int) -> u64 {
    guard("genpool_trim", 0, || {
        match registry::existing(device.into()) {
            Ok(Some(s)) => s.pool.trim(),
            Ok(None) => 0,
            Err(e) => {
                fail(&e);
                0
            }
        }
    })
}

/// Tell device `device`'s lifetime classifier a training iteration ended.
#[no_mangle]
pub extern "C" fn genpool_mark_iteration(device: c_int) {
    guard("genpool_mark_iteration", (), || {
        match registry::existing(device.into()) {
            Ok(Some(s)) => s.pool.mark_iteration(),
            Ok(None) => {}
            Err(e) => fail(&e),
        }
    })
}

/// Copy the most recent error message of any thread (`""` when none) into `buf`, `snprintf`-style as
/// [`genpool_stats_json`]. Returns its length in bytes. Process-wide rather than per thread, because
/// PyTorch allocates from its autograd worker threads while Python reads the error on the main one.
///
/// # Safety
/// `buf` is NULL or valid for writes of `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn genpool_last_error(buf: *mut c_char, len: usize) -> usize {
    guard("genpool_last_error", 0, || {
        let msg = report::last_error();
        // SAFETY: forwarded from this function's contract.
        unsafe { report::copy_out(&msg, buf, len) }
    })
}

/// Test-only fault injection inside the boundary.
#[cfg(test)]
pub(crate) mod hooks {
    use std::cell::Cell;

    thread_local! {
        static PANIC_IN: Cell<Option<&'static str>> = const { Cell::new(None) };
    }

    /// Make the next call of `call` on this thread panic inside its guard.
    pub(crate) fn panic_next(call: &'static str) {
        PANIC_IN.with(|p| p.set(Some(call)));
    }

    pub(super) fn maybe_panic(call: &'static str) {
        if PANIC_IN.with(|p| p.get()) == Some(call) {
            PANIC_IN.with(|p| p.set(None));
            panic!("test-injected panic in {call}");
        }
    }
}
