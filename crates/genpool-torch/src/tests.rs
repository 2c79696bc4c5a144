//! Tests of the C ABI on the simulated device.
//!
//! All tests share the process-wide registry, so each one uses device slots no other test touches
//! (listed below). Tests that read the process-wide last error hold [`ERRORS`] so no other test
//! overwrites it between the failing call and the read; so do the tests that compare statistics across
//! calls, and the one that calls `genpool_reset` (which trims every device).
//!
//! | slot | test |
//! |---|---|
//! | 0 | `lazy_sim_device_from_registry` (created by the registry itself) |
//! | 1 | `malloc_free_round_trip` |
//! | 2 | `size_zero_and_huge_sizes` |
//! | 3 | `out_of_memory_is_null_and_recoverable` |
//! | 4 | `foreign_and_double_frees_are_refused_once_logged` |
//! | 5 | `many_threads_allocate_and_free` |
//! | 6 | `record_stream_orders_the_free_after_the_other_stream` (`record_stream:wait`) |
//! | 7 | `panics_are_caught_at_the_boundary` |
//! | 8 | `memory_fraction_caps_live_bytes` |
//! | 9 | `stats_json_is_safe_with_short_buffers` |
//! | 10 | `record_stream_falls_back_to_synchronize` |
//! | 11 | `reset_and_trim_release_cached_memory` |
//! | 12, 13 | `sleep_abi::tests` (tags, sleep, wake) |
//! | 14 | `record_stream_holds_the_block_until_the_other_streams_work_is_done` |
//! | 20-29 | `backend_tests` |
//! | 30-39 | `graph_tests` (captures, checkpoints, IPC, peers) |
//! | 63 | `untouched_device_reports_uninitialised` (never allocated on) |

use std::ffi::{c_int, c_void, CStr};
use std::ptr::null_mut;
use std::sync::Arc;

use gen_device::sim::{CallKind, SimDevice};
use gen_device::Device;
use genpool::Config;
use parking_lot::Mutex;
use serde_json::Value;

use crate::registry::testing;
use crate::*;

pub(crate) static ERRORS: Mutex<()> = Mutex::new(());

const NULL_STREAM: cudaStream_t = null_mut();

pub(crate) fn last_error() -> String {
    // SAFETY: a null buffer is allowed.
    let n = unsafe { genpool_last_error(null_mut(), 0) };
    let mut buf = vec![0u8; n + 1];
    // SAFETY: `buf` is valid for `buf.len()` bytes.
    let m = unsafe { genpool_last_error(buf.as_mut_ptr().cast(), buf.len()) };
    assert_eq!(m, n);
    CStr::from_bytes_until_nul(&buf)
        .unwrap()
        .to_str()
        .unwrap()
        .to_string()
}

pub(crate) fn stats(device: c_int) -> Value {
    // SAFETY: a null buffer is allowed.
    let n = unsafe { genpool_stats_json(device, null_mut(), 0) };
    assert!(n > 0, "stats of device {device}");
    let mut buf = vec![0u8; n + 1];
    // SAFETY: `buf` is valid for `buf.len()` bytes.
    let m = unsafe { genpool_stats_json(device, buf.as_mut_ptr().cast(), buf.len()) };
    assert_eq!(m, n);
    serde_json::from_slice(&buf[..n]).unwrap()
}

fn u(v: &Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("{key} missing in {v}"))
}

fn sim(index: usize, capacity: u64) -> (Arc<SimDevice>, c_int) {
    sim_with(index, capacity, Config::default())
}

fn sim_with(index: usize, capacity: u64, cfg: Config) -> (Arc<SimDevice>, c_int) {
    let dev = Arc::new(
        SimDevice::config()
            .capacity(capacity)
            .ordinal(index)
            // Disjoint addresses per slot (as real GPUs): frees are routed by address across devices.
            .address_offset(index as u64 * gen_device::sim::ORDINAL_STRIDE)
            .build()
            .unwrap(),
    );
    testing::install(index, dev.clone(), cfg);
    (dev, index as c_int)
}

fn stream_ptr(id: u64) -> cudaStream_t {
    std::ptr::without_provenance_mut(id as usize)
}

fn malloc(size: usize, device: c_int, stream: cudaStream_t) -> *mut c_void {
    genpool_malloc(size, device, stream)
}

#[test]
fn lazy_sim_device_from_registry() {
    testing::use_sim();
    let p = malloc(4096, 0, NULL_STREAM);
    assert!(!p.is_null(), "{}", last_error());
    let s = stats(0);
    assert_eq!(s["initialized"], Value::Bool(true));
    assert_eq!(u(&s, "allocated_current"), 4096);
    if std::env::var_os("GENPOOL_TIMING").is_none() {
        // Timing is opt-in (tests/host_timing.rs turns it on in its own process).
        assert_eq!(s["host_timing"], Value::Null);
    }
    genpool_free(p, 4096, 0, NULL_STREAM);
    assert_eq!(u(&stats(0), "allocated_current"), 0);
}

#[test]
fn malloc_free_round_trip() {
    let (dev, d) = sim(1, 8 << 30);
    let s1 = stream_ptr(dev.stream_create().unwrap());
    let sizes = [1usize, 511, 512, 1000, 65536, 3 << 20, 100 << 20];
    let mut blocks = Vec::new();
    for (i, &size) in sizes.iter().enumerate() {
        let stream = if i % 2 == 0 { NULL_STREAM } else { s1 };
        let p = malloc(size, d, stream);
        assert!(!p.is_null(), "{size}: {}", last_error());
        assert_eq!(p.addr() % 512, 0);
        blocks.push((p, size, stream));
    }
    let expect: u64 = sizes.iter().map(|&s| (s as u64).div_ceil(512) * 512).sum();
    let s = stats(d);
    assert_eq!(u(&s, "allocated_current"), expect);
    assert_eq!(u(&s, "num_allocs"), sizes.len() as u64);
    assert_eq!(u(&s, "live_blocks"), sizes.len() as u64);
    assert!(u(&s, "reserved_current") >= expect);
    genpool_mark_iteration(d);
    for (p, size, stream) in blocks {
        genpool_free(p, size, d, stream);
    }
    let s = stats(d);
    assert_eq!(u(&s, "allocated_current"), 0);
    assert_eq!(u(&s, "num_frees"), sizes.len() as u64);
    assert_eq!(u(&s, "allocated_peak"), expect);
    assert_eq!(u(&s, "num_invalid_frees"), 0);
}

#[test]
fn size_zero_and_huge_sizes() {
    let _g = ERRORS.lock();
    let (_dev, d) = sim(2, 1 << 30);
    crate::report::set_last_error(&"sentinel");
    assert!(malloc(0, d, NULL_STREAM).is_null());
    assert_eq!(last_error(), "sentinel", "size 0 is not an error");
    for size in [usize::MAX, 1 << 50, (1 << 30) + 1] {
        assert!(malloc(size, d, NULL_STREAM).is_null(), "{size}");
        assert!(
            last_error().contains("invalid size"),
            "{size}: {}",
            last_error()
        );
    }
    let s = stats(d);
    assert_eq!(u(&s, "allocated_current"), 0);
    assert_eq!(u(&s, "num_allocs"), 0);
    // Still usable.
    let p = malloc(512, d, NULL_STREAM);
    assert!(!p.is_null());
    genpool_free(p, 512, d, NULL_STREAM);
}

#[test]
fn out_of_memory_is_null_and_recoverable() {
    let _g = ERRORS.lock();
    let (_dev, d) = sim(3, 64 << 20);
    let mut live = Vec::new();
    let mut hit_oom = false;
    for _ in 0..64 {
        let p = malloc(8 << 20, d, NULL_STREAM);
        if p.is_null() {
            hit_oom = true;
            break;
        }
        live.push(p);
    }
    assert!(
        hit_oom,
        "64 MiB device served {} blocks of 8 MiB",
        live.len()
    );
    assert!(!live.is_empty());
    assert!(last_error().contains("out of memory"), "{}", last_error());
    assert!(u(&stats(d), "num_ooms") >= 1);
    for p in live.drain(..) {
        genpool_free(p, 8 << 20, d, NULL_STREAM);
    }
    let p = malloc(8 << 20, d, NULL_STREAM);
    assert!(!p.is_null(), "after freeing: {}", last_error());
    genpool_free(p, 8 << 20, d, NULL_STREAM);
    assert_eq!(u(&stats(d), "allocated_current"), 0);
}

#[test]
fn foreign_and_double_frees_are_refused_once_logged() {
    let _g = ERRORS.lock();
    let (_dev, d) = sim(4, 1 << 30);
    let p = malloc(4096, d, NULL_STREAM);
    assert!(!p.is_null());
    genpool_free(p, 4096, d, NULL_STREAM);
    genpool_free(p, 4096, d, NULL_STREAM);
    assert!(last_error().contains("double free"), "{}", last_error());
    let foreign: *mut c_void = std::ptr::without_provenance_mut(0xdead_0000);
    genpool_free(foreign, 512, d, NULL_STREAM);
    assert!(
        last_error().contains("not allocated by this pool"),
        "{}",
        last_error()
    );
    genpool_free(foreign, 512, d, NULL_STREAM);
    genpool_free(null_mut(), 0, d, NULL_STREAM);
    let s = stats(d);
    assert_eq!(
        u(&s, "num_invalid_frees"),
        3,
        "double + foreign twice; NULL ignored"
    );
    assert_eq!(u(&s, "num_frees"), 1);
    // Each pointer was logged on its first refusal only.
    assert!(!crate::report::invalid_free(
        d,
        foreign.addr() as u64,
        &"again"
    ));
    assert!(!crate::report::invalid_free(d, p.addr() as u64, &"again"));
    // A free on a device with no pool, and on an invalid device: refused, no crash.
    genpool_free(foreign, 512, 62, NULL_STREAM);
    assert!(last_error().contains("not allocated"), "{}", last_error());
    genpool_free(foreign, 512, -1, NULL_STREAM);
    assert!(
        last_error().contains("invalid device index"),
        "{}",
        last_error()
    );
    assert_eq!(stats(62)["initialized"], Value::Bool(false));
    // The pool still works.
    let q = malloc(4096, d, NULL_STREAM);
    assert!(!q.is_null());
    genpool_free(q, 4096, d, NULL_STREAM);
}

#[test]
fn reported_pointer_set_is_bounded() {
    // Device index 1000 is never a real slot: only the report set sees it.
    let mut logged = 0;
    for i in 0..(crate::report::REPORTED_CAP as u64 + 100) {
        logged += crate::report::invalid_free(1000, i * 512, &"test") as usize;
    }
    assert!(logged <= crate::report::REPORTED_CAP);
    assert!(!crate::report::invalid_free(1000, 0, &"test"));
}

#[test]
fn many_threads_allocate_and_free() {
    let (_dev, d) = sim(5, 16 << 30);
    let threads = 8;
    let iters = if cfg!(miri) {
        50
    } else if cfg!(debug_assertions) {
        1000
    } else {
        3000
    };
    let snapshot = Mutex::new(Vec::new());
    let barrier = std::sync::Barrier::new(threads);
    std::thread::scope(|s| {
        for t in 0..threads {
            let (snapshot, barrier) = (&snapshot, &barrier);
            s.spawn(move || {
                let mut rng = 0x9E37_79B9_7F4A_7C15u64 ^ (t as u64 + 1);
                let mut next = move || {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    rng
                };
                let mut live: Vec<(usize, usize)> = Vec::new();
                for i in 0..iters {
                    if live.len() >= 16 || (!live.is_empty() && next() % 3 == 0) {
                        let (p, size) = live.swap_remove((next() % live.len() as u64) as usize);
                        genpool_free(std::ptr::without_provenance_mut(p), size, d, NULL_STREAM);
                    } else {
                        let size = match next() % 4 {
                            0 => 512 + (next() % 4096) as usize,
                            1 => 64 << 10,
                            2 => (next() % (1 << 20)) as usize + 1,
                            _ => (next() % (8 << 20)) as usize + 1,
                        };
                        let p = malloc(size, d, NULL_STREAM);
                        assert!(!p.is_null());
                        live.push((p.addr(), size));
                    }
                    if i == iters / 2 {
                        snapshot.lock().extend(live.iter().copied());
                        barrier.wait();
                    }
                }
                for (p, size) in live {
                    genpool_free(std::ptr::without_provenance_mut(p), size, d, NULL_STREAM);
                }
            });
        }
    });
    // Blocks live at the same moment never overlap.
    let mut snap = snapshot.into_inner();
    snap.sort_unstable();
    for w in snap.windows(2) {
        assert!(
            w[0].0 + w[0].1 <= w[1].0,
            "overlap: {:#x}+{} and {:#x}",
            w[0].0,
            w[0].1,
            w[1].0
        );
    }
    let s = stats(d);
    assert_eq!(u(&s, "allocated_current"), 0);
    assert_eq!(u(&s, "num_allocs"), u(&s, "num_frees"));
    assert_eq!(u(&s, "num_invalid_frees"), 0);
}

/// PyTorch's rule, the default: a block recorded on a busy stream is held out of reuse until an event
/// recorded there at its free completes; the freeing stream never waits; an idle stream needs only a
/// question; empty_cache waits for held blocks and gives their memory back.
#[test]
fn record_stream_holds_the_block_until_the_other_streams_work_is_done() {
    let (dev, d) = sim(14, 4 << 30);
    let (s1, s2) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
    let p = malloc(8 << 20, d, stream_ptr(s1));
    genpool_record_stream(p, stream_ptr(s2));
    genpool_record_stream(p, stream_ptr(s1)); // its own stream: nothing to order
    dev.pause_stream(s2).unwrap(); // a kernel on s2 still uses the block
    let before = dev.calls();
    genpool_free(p, 8 << 20, d, stream_ptr(s1));
    let delta = dev.calls().since(&before);
    assert_eq!(
        (
            delta[CallKind::StreamQuery],
            delta[CallKind::EventRecord],
            delta[CallKind::StreamWaitEvent]
        ),
        (1, 1, 0)
    );
    dev.stream_synchronize(s1)
        .expect("s1 never waits for s2: the streams keep overlapping");
    // Held: still live in the engine (these are the engine's counts; the backend's PyTorch counts,
    // `backend_tests`, drop at the free as PyTorch's own do).
    let s = stats(d);
    assert_eq!(u(&s, "allocated_current"), 8 << 20);
    assert_eq!((u(&s, "held_back"), u(&s, "stream_waits")), (1, 0));
    // While s2 runs its bytes are not handed out again.
    let q = malloc(8 << 20, d, stream_ptr(s1));
    assert_ne!(q, p);
    dev.resume_stream(s2).unwrap();
    dev.stream_synchronize(s2).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1));
    genpool_free(q, 8 << 20, d, stream_ptr(s1));
    assert_eq!(u(&stats(d), "held_back"), 0, "released by a later call");
    // s2 idle at the free: one question, no event, no wait, nothing held.
    let r = malloc(8 << 20, d, stream_ptr(s1));
    assert_eq!(r, p, "the released bytes are best fit's again");
    genpool_record_stream(r, stream_ptr(s2));
    let before = dev.calls();
    genpool_free(r, 8 << 20, d, stream_ptr(s1));
    let delta = dev.calls().since(&before);
    assert_eq!(
        (
            delta[CallKind::StreamQuery],
            delta[CallKind::EventRecord],
            delta[CallKind::StreamWaitEvent]
        ),
        (1, 0, 0)
    );
    // empty_cache waits for held blocks and gives them back.
    let h = malloc(8 << 20, d, stream_ptr(s1));
    genpool_record_stream(h, stream_ptr(s2));
    dev.pause_stream(s2).unwrap();
    genpool_free(h, 8 << 20, d, stream_ptr(s1));
    assert_eq!(u(&stats(d), "held_back"), 1);
    dev.resume_stream(s2).unwrap();
    genpool_reset();
    let s = stats(d);
    assert_eq!((u(&s, "held_back"), u(&s, "reserved_current")), (0, 0));
}

/// Busy serving streams through PyTorch's entry points (`raw_alloc_with_stream` / `raw_delete`): each
/// stream's kernels always queued (paused), each allocating one of three sizes a step and dropping it on
/// its own stream. After the first steps no stream waits for another on the device — a busy stream's own
/// frees are kept for it (`busy_kept_reuses`) — and `empty_cache` gives every kept block back.
#[test]
fn busy_serving_streams_keep_their_own_blocks_through_the_entry_points() {
    // (Slot 40: every test installs its device in a slot no other test uses.)
    let (dev, d) = sim(40, 8 << 30);
    // The default stream first (weights, say): the serving streams share the arena after it.
    let w = malloc(64 << 20, d, NULL_STREAM);
    assert!(!w.is_null(), "{}", last_error());
    let streams: Vec<u64> = (0..8).map(|_| dev.stream_create().unwrap()).collect();
    for &s in &streams {
        let p = malloc(1 << 20, d, stream_ptr(s));
        genpool_free(p, 1 << 20, d, stream_ptr(s));
        dev.pause_stream(s).unwrap();
    }
    let sizes = [4usize << 20, 8 << 20, 6 << 20];
    let mut late_waits = 0;
    for k in 0..120 {
        let before = dev.calls();
        for (i, &s) in streams.iter().enumerate() {
            let size = sizes[(k + i) % 3];
            let p = malloc(size, d, stream_ptr(s));
            assert!(!p.is_null(), "{}", last_error());
            genpool_free(p, size, d, stream_ptr(s));
        }
        if k >= 60 {
            late_waits += dev.calls().since(&before)[CallKind::StreamWaitEvent];
        }
    }
    let busy = stats(d);
    assert_eq!(late_waits, 0, "busy streams wait for each other");
    assert!(
        u(&busy, "busy_kept_reuses") > 8 * 100,
        "kept-block reuses: {busy}"
    );
    assert!(u(&busy, "cached_bytes") > 0);
    for &s in &streams {
        dev.resume_stream(s).unwrap();
    }
    genpool_free(w, 64 << 20, d, NULL_STREAM);
    genpool_reset();
    let s = stats(d);
    assert_eq!(
        (
            u(&s, "cached_bytes"),
            u(&s, "allocated_current"),
            u(&s, "reserved_current")
        ),
        (0, 0, 0)
    );
}

/// `record_stream:wait`: the free's stream waits on the device for the other stream instead.
#[test]
fn record_stream_orders_the_free_after_the_other_stream() {
    let (dev, d) = sim_with(6, 4 << 30, Config::parse("record_stream:wait").unwrap());
    let (s1, s2) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
    let p = malloc(1 << 20, d, stream_ptr(s1));
    assert!(!p.is_null());
    genpool_record_stream(p, stream_ptr(s2));
    genpool_record_stream(p, stream_ptr(s2));
    genpool_record_stream(p, stream_ptr(s1)); // its own stream: nothing to wait for
    dev.pause_stream(s2).unwrap(); // a kernel on s2 still uses the block
    let before = dev.calls();
    genpool_free(p, 1 << 20, d, stream_ptr(s1));
    let delta = dev.calls().since(&before);
    assert_eq!(delta[CallKind::EventRecord], 1);
    assert_eq!(delta[CallKind::StreamWaitEvent], 1);
    // s1 now waits for s2's work: it cannot complete while s2 is paused.
    assert!(dev.stream_synchronize(s1).is_err());
    dev.resume_stream(s2).unwrap();
    dev.stream_synchronize(s1).unwrap();
    let s = stats(d);
    assert_eq!(u(&s, "allocated_current"), 0);
    assert_eq!(u(&s, "stream_waits"), 1);

    // A block never recorded: no event traffic. A second recorded one reuses the pooled event.
    let q = malloc(1 << 20, d, stream_ptr(s1));
    let before = dev.calls();
    genpool_free(q, 1 << 20, d, stream_ptr(s1));
    let delta = dev.calls().since(&before);
    assert_eq!(
        delta[CallKind::EventRecord] + delta[CallKind::StreamWaitEvent],
        0
    );
    let r = malloc(4096, d, stream_ptr(s1));
    genpool_record_stream(r, stream_ptr(s2));
    let before = dev.calls();
    genpool_free(r, 4096, d, stream_ptr(s1));
    let delta = dev.calls().since(&before);
    assert_eq!(delta[CallKind::EventCreate], 0);
    assert_eq!(delta[CallKind::StreamWaitEvent], 1);
    assert_eq!(u(&stats(d), "stream_waits"), 2);
}

#[test]
fn record_stream_falls_back_to_synchronize() {
    let (dev, d) = sim_with(10, 4 << 30, Config::parse("record_stream:wait").unwrap());
    let (s1, s2) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
    let p = malloc(4096, d, stream_ptr(s1));
    genpool_record_stream(p, stream_ptr(s2));
    dev.fail_next(CallKind::EventRecord);
    let before = dev.calls();
    genpool_free(p, 4096, d, stream_ptr(s1));
    assert_eq!(dev.calls().since(&before)[CallKind::Synchronize], 1);
    let s = stats(d);
    assert_eq!(u(&s, "sync_fallbacks"), 1);
    assert_eq!(u(&s, "allocated_current"), 0, "freed after the synchronize");
}

#[test]
fn panics_are_caught_at_the_boundary() {
    let _g = ERRORS.lock();
    let (_dev, d) = sim(7, 1 << 30);
    crate::abi::hooks::panic_next("genpool_malloc");
    assert!(malloc(4096, d, NULL_STREAM).is_null());
    assert!(
        last_error().contains("internal panic in genpool_malloc"),
        "{}",
        last_error()
    );
    let p = malloc(4096, d, NULL_STREAM);
    assert!(!p.is_null());
    crate::abi::hooks::panic_next("genpool_free");
    genpool_free(p, 4096, d, NULL_STREAM);
    assert!(last_error().contains("internal panic in genpool_free"));
    assert_eq!(
        u(&stats(d), "allocated_current"),
        4096,
        "the panic came before the free"
    );
    genpool_free(p, 4096, d, NULL_STREAM);
    crate::abi::hooks::panic_next("genpool_stats_json");
    // SAFETY: a null buffer is allowed.
    assert_eq!(unsafe { genpool_stats_json(d, null_mut(), 0) }, 0);
    assert_eq!(u(&stats(d), "allocated_current"), 0);
}

#[test]
fn memory_fraction_caps_live_bytes() {
    let _g = ERRORS.lock();
    genpool_set_memory_fraction(0.5, 8);
    let (_dev, d) = sim(8, 256 << 20);
    let s = stats(d);
    assert_eq!(u(&s, "memory_fraction_cap"), 128 << 20);
    let a = malloc(100 << 20, d, NULL_STREAM);
    assert!(!a.is_null(), "{}", last_error());
    assert!(malloc(40 << 20, d, NULL_STREAM).is_null());
    assert!(
        last_error().contains("memory-fraction cap"),
        "{}",
        last_error()
    );
    genpool_set_memory_fraction(1.0, d);
    let b = malloc(40 << 20, d, NULL_STREAM);
    assert!(!b.is_null(), "raised cap: {}", last_error());
    for bad in [0.0, -0.5, 1.5, f64::NAN] {
        crate::report::set_last_error(&"sentinel");
        genpool_set_memory_fraction(bad, d);
        assert!(
            last_error().contains("invalid memory fraction"),
            "{bad}: {}",
            last_error()
        );
    }
    genpool_set_memory_fraction(0.5, 64);
    assert!(last_error().contains("invalid device index"));
    genpool_free(a, 0, d, NULL_STREAM);
    genpool_free(b, 0, d, NULL_STREAM);
}

#[test]
fn stats_json_is_safe_with_short_buffers() {
    let _g = ERRORS.lock(); // no concurrent genpool_reset may change the figures between calls
    let (_dev, d) = sim(9, 1 << 30);
    let p = malloc(1 << 20, d, NULL_STREAM);
    let full = stats(d);
    let text = full.to_string();
    let n = text.len();
    for len in [1usize, 2, 10, n - 1, n, n + 1] {
        let mut buf = vec![0xAAu8; len + 8];
        // SAFETY: `buf` is valid for `len + 8 >= len` bytes.
        let m = unsafe { genpool_stats_json(d, buf.as_mut_ptr().cast(), len) };
        assert_eq!(m, n, "len {len}");
        let written = len.min(n + 1);
        assert_eq!(buf[written - 1], 0, "NUL at {}", written - 1);
        assert_eq!(&buf[..written - 1], &text.as_bytes()[..written - 1]);
        assert!(
            buf[written..].iter().all(|&b| b == 0xAA),
            "wrote past {len}"
        );
    }
    assert_eq!(
        // SAFETY: len 0 with a non-null pointer writes nothing.
        unsafe { genpool_stats_json(d, [0u8; 1].as_mut_ptr().cast(), 0) },
        n
    );
    assert_eq!(full["device"], d);
    assert_eq!(full["initialized"], true);
    assert_eq!(full["tiers"].as_array().unwrap().len(), 4);
    for key in [
        "allocated_peak",
        "reserved_current",
        "reserved_peak",
        "num_ooms",
        "cached_bytes",
    ] {
        u(&full, key);
    }
    genpool_free(p, 0, d, NULL_STREAM);
}

#[test]
fn invalid_device_indices_are_refused() {
    let _g = ERRORS.lock();
    for d in [-1, MAX_DEVICES as c_int, c_int::MAX, c_int::MIN] {
        assert!(malloc(512, d, NULL_STREAM).is_null());
        assert!(
            last_error().contains("invalid device index"),
            "{d}: {}",
            last_error()
        );
        assert_eq!(genpool_trim(d), 0);
        genpool_mark_iteration(d);
        // SAFETY: a null buffer is allowed.
        assert_eq!(unsafe { genpool_stats_json(d, null_mut(), 0) }, 0);
    }
    genpool_record_stream(std::ptr::without_provenance_mut(0xbad_000), NULL_STREAM);
    assert!(last_error().contains("record_stream"));
}

#[test]
fn init_validates_the_device_count() {
    let _g = ERRORS.lock();
    // The full count keeps every test's slot valid.
    genpool_init(MAX_DEVICES as c_int);
    assert_eq!(crate::registry::bound(), MAX_DEVICES);
    genpool_init(-3);
    assert!(
        last_error().contains("invalid device count -3"),
        "{}",
        last_error()
    );
    assert_eq!(crate::registry::bound(), MAX_DEVICES);
}

#[test]
fn untouched_device_reports_uninitialised() {
    assert_eq!(genpool_trim(63), 0);
    genpool_mark_iteration(63);
    let s = stats(63);
    assert_eq!(s["initialized"], false);
    assert_eq!(u(&s, "allocated_current"), 0);
}

#[test]
fn reset_and_trim_release_cached_memory() {
    let _g = ERRORS.lock();
    let (_dev, d) = sim(11, 4 << 30);
    let blocks: Vec<_> = (0..8).map(|_| malloc(16 << 20, d, NULL_STREAM)).collect();
    for &p in &blocks {
        assert!(!p.is_null());
        genpool_free(p, 0, d, NULL_STREAM);
    }
    let held = u(&stats(d), "reserved_current");
    assert!(held >= 16 << 20, "freed blocks stay cached: {held}");
    genpool_reset();
    let after = u(&stats(d), "reserved_current");
    assert!(after < held, "reset released nothing: {held} -> {after}");
    let p = malloc(16 << 20, d, NULL_STREAM);
    genpool_free(p, 0, d, NULL_STREAM);
    let cached = u(&stats(d), "reserved_current");
    let released = genpool_trim(d);
    assert_eq!(u(&stats(d), "reserved_current"), cached - released);
}

#[test]
fn device_backend_names_parse() {
    use crate::registry::parse_device_kind;
    use gen_device::DeviceKind;
    assert_eq!(parse_device_kind("sim"), Ok(DeviceKind::Sim));
    assert_eq!(parse_device_kind(" CUDA "), Ok(DeviceKind::Cuda));
    assert_eq!(parse_device_kind("auto"), Ok(DeviceKind::Auto));
    assert_eq!(
        parse_device_kind(""),
        Ok(DeviceKind::Cuda),
        "the plug-in's default"
    );
    assert!(matches!(
        parse_device_kind("tpu"),
        Err(PluginError::BadDeviceKind(_))
    ));
}
