//! Opt-in host timing of the allocation entry points (`GENPOOL_TIMING=1`).
//!
//! Where a training step is host-bound (small models, small batches), every nanosecond spent in the
//! allocation entry points (the pluggable hook's and the backend's) is step time. This measures it where
//! it matters: inside the plug-in, on the real host, under PyTorch's own calls. Off by default — reading the clock twice per call would
//! be a measurable share of a ~100-ns operation; when off, the cost is one relaxed load of a cached flag.
//!
//! Counters are process-wide (all devices): calls, total nanoseconds, the slowest call, and how many
//! calls took longer than [`SLOW_NS`] (page moves, device growth, flushes: the tail that a median hides).

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering::Relaxed};
use std::time::Instant;

/// A call slower than this (ns) is counted as slow.
pub(crate) const SLOW_NS: u64 = 10_000;

/// 0 = not read yet, 1 = off, 2 = on.
static STATE: AtomicU8 = AtomicU8::new(0);

/// One entry point's counters.
pub(crate) struct Counter {
    calls: AtomicU64,
    ns: AtomicU64,
    max_ns: AtomicU64,
    slow: AtomicU64,
}

impl Counter {
    const fn new() -> Self {
        Counter {
            calls: AtomicU64::new(0),
            ns: AtomicU64::new(0),
            max_ns: AtomicU64::new(0),
            slow: AtomicU64::new(0),
        }
    }

    fn add(&self, ns: u64) {
        self.calls.fetch_add(1, Relaxed);
        self.ns.fetch_add(ns, Relaxed);
        if ns > self.max_ns.load(Relaxed) {
            self.max_ns.fetch_max(ns, Relaxed);
        }
        if ns > SLOW_NS {
            self.slow.fetch_add(1, Relaxed);
        }
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "calls": self.calls.load(Relaxed),
            "ns": self.ns.load(Relaxed),
            "max_ns": self.max_ns.load(Relaxed),
            "slow": self.slow.load(Relaxed),
        })
    }
}

/// The allocations' counters (`genpool_malloc` and `genpool_backend_malloc`).
pub(crate) static MALLOC: Counter = Counter::new();
/// The frees' counters (`genpool_free` and `genpool_backend_free`).
pub(crate) static FREE: Counter = Counter::new();

/// Whether timing is on (`GENPOOL_TIMING` set to anything but `0` or empty; read once).
#[inline]
pub(crate) fn enabled() -> bool {
    match STATE.load(Relaxed) {
        0 => {
            let on = std::env::var_os("GENPOOL_TIMING").is_some_and(|v| !v.is_empty() && v != "0");
            STATE.store(if on { 2 } else { 1 }, Relaxed);
            on
        }
        s => s == 2,
    }
}

/// Run `f`, adding its duration to `counter` when timing is on.
#[inline]
pub(crate) fn timed<T>(counter: &Counter, f: impl FnOnce() -> T) -> T {
    if !enabled() {
        return f();
    }
    let t0 = Instant::now();
    let out = f();
    counter.add(t0.elapsed().as_nanos() as u64);
    out
}

/// The counters as a JSON object, or `null` when timing is off.
pub(crate) fn json() -> serde_json::Value {
    if !enabled() {
        return serde_json::Value::Null;
    }
    serde_json::json!({
        "malloc": MALLOC.json(),
        "free": FREE.json(),
        "slow_ns": SLOW_NS,
    })
}
