//! Logging, the process-wide last error, and once-per-pointer reports of refused frees.
//!
//! Nothing here is on the hot path: it runs at first use, on failures and on invalid frees.

use std::collections::HashSet;
use std::fmt::Display;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Once;

use parking_lot::Mutex;

/// How many distinct refused pointers are remembered (and logged once each). Past that, refused frees
/// are still counted but logged only by the one line that says the set is full.
pub(crate) const REPORTED_CAP: usize = 4096;

static LOG_INIT: Once = Once::new();
static LAST_ERROR: Mutex<String> = Mutex::new(String::new());
static REPORTED: Mutex<Option<HashSet<(i32, u64)>>> = Mutex::new(None);
static INVALID_FREES: AtomicU64 = AtomicU64::new(0);

/// Start `env_logger` once, if `GENPOOL_LOG` is set (its value is an `env_logger` filter such as
/// `info` or `genpool=debug`). Off by default; a logger installed earlier by the host is left alone.
pub(crate) fn init_logging() {
    LOG_INIT.call_once(|| {
        if let Ok(filter) = std::env::var("GENPOOL_LOG") {
            let _ = env_logger::Builder::new().parse_filters(&filter).try_init();
        }
    });
}

/// Record `err` as the process-wide last error (read by `genpool_last_error`).
pub(crate) fn set_last_error(err: &dyn Display) {
    let mut last = LAST_ERROR.lock();
    last.clear();
    use std::fmt::Write;
    let _ = write!(last, "{err}");
}

/// A copy of the last error message ("" when none).
pub(crate) fn last_error() -> String {
    LAST_ERROR.lock().clone()
}

/// Count a refused free of `ptr` on `device` and log it, once per pointer for the first
/// [`REPORTED_CAP`] pointers. Returns true when this call logged.
pub(crate) fn invalid_free(device: i32, ptr: u64, err: &dyn Display) -> bool {
    INVALID_FREES.fetch_add(1, Relaxed);
    let mut guard = REPORTED.lock();
    let set = guard.get_or_insert_with(HashSet::new);
    if set.contains(&(device, ptr)) {
        return false;
    }
    if set.len() >= REPORTED_CAP {
        if set.len() == REPORTED_CAP {
            // A sentinel entry marks that the "full" line was written.
            set.insert((-1, u64::MAX));
            log::error!(
                "genpool: {REPORTED_CAP} distinct pointers had refused frees; further ones are only counted"
            );
        }
        return false;
    }
    set.insert((device, ptr));
    drop(guard);
    log::error!("genpool: device {device}: {err}");
    true
}

/// Refused frees (foreign, double, null) seen by the plug-in.
pub(crate) fn invalid_frees() -> u64 {
    INVALID_FREES.load(Relaxed)
}

/// Copy `msg` into `buf` as a NUL-terminated C string, `snprintf`-style: at most `len - 1` bytes and a
/// NUL are written (nothing when `buf` is null or `len` is 0). Returns `msg.len()`, the length a buffer
/// needs less its NUL.
///
/// # Safety
/// `buf` is null, or valid for writes of `len` bytes.
pub(crate) unsafe fn copy_out(msg: &str, buf: *mut std::ffi::c_char, len: usize) -> usize {
    if !buf.is_null() && len > 0 {
        let n = msg.len().min(len - 1);
        // SAFETY: the caller guarantees `buf` is valid for `len` bytes and `n + 1 <= len`; `msg` is a
        // distinct Rust string, so the ranges do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(msg.as_ptr(), buf.cast::<u8>(), n);
            *buf.add(n) = 0;
        }
    }
    msg.len()
}
