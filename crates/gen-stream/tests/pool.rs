//! `DriverPool` on the simulated device: reuse, cross-stream safety with real pool blocks, invalid
//! frees, overflow to the driver, trim, out-of-memory recovery and teardown.

use std::sync::Arc;

use gen_device::sim::{CallKind, SimDevice};
use gen_device::{Device, DeviceError};
use gen_stream::{DriverPool, DriverPoolConfig, InvalidFreeReason, StreamCacheConfig, StreamError};

const G: u64 = 4096; // the simulated pool's granularity in these tests

fn sim(capacity: u64) -> Arc<SimDevice> {
    Arc::new(
        SimDevice::config()
            .granularity(G)
            .capacity(capacity)
            .backed(true)
            .build()
            .unwrap(),
    )
}

fn pool(dev: &Arc<SimDevice>, cfg: DriverPoolConfig) -> DriverPool {
    DriverPool::new(dev.clone() as Arc<dyn Device>, cfg).unwrap()
}

#[test]
fn same_stream_steady_state_makes_no_driver_calls() {
    let dev = sim(1 << 30);
    let s = dev.stream_create().unwrap();
    let p = pool(&dev, DriverPoolConfig::default());
    let a = p.alloc(1000, s).unwrap();
    assert_eq!(p.size_of(a), Some(1024), "rounded to 512");
    p.free(a, s).unwrap();
    let before = dev.calls();
    for _ in 0..100 {
        let b = p.alloc(1024, s).unwrap();
        assert_eq!(b, a);
        p.free(b, s).unwrap();
    }
    assert_eq!(dev.calls().since(&before).total(), 0);
    let st = p.stats();
    assert_eq!((st.allocs, st.frees, st.pool_allocs), (101, 101, 1));
    assert_eq!(
        (st.live_bytes, st.live_blocks, st.cached_bytes),
        (0, 0, 1024)
    );
    assert_eq!(st.cache.hits, 100);
    let usage = st.pool.unwrap();
    assert_eq!((usage.used_current, usage.reserved_high), (G, G));
}

#[test]
fn cross_stream_reuse_waits_for_the_kernel_on_the_freeing_stream() {
    let dev = sim(1 << 30);
    let (s, t) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
    let p = pool(&dev, DriverPoolConfig::default());
    // Both streams in use from the start (no shortcut sync).
    let warm_s = p.alloc(G, s).unwrap();
    let warm_t = p.alloc(G, t).unwrap();

    let a = p.alloc(8 * G, s).unwrap();
    dev.pause_stream(s).unwrap();
    dev.memset_async(a, 0xAB, 8 * G, s).unwrap(); // a long kernel on s writes `a`
    p.free(a, s).unwrap();
    let b = p.alloc(8 * G, t).unwrap();
    assert_ne!(b, a, "a is still in use by s");
    assert_eq!(p.stats().pool_allocs, 4);
    p.free(b, t).unwrap();
    assert_eq!(
        p.alloc(8 * G, s).unwrap(),
        a,
        "s reuses its own block at once"
    );
    p.free(a, s).unwrap();

    dev.resume_stream(s).unwrap();
    // t takes its own block first, then a once the event says s is done.
    let got: Vec<u64> = (0..2).map(|_| p.alloc(8 * G, t).unwrap()).collect();
    assert!(
        got.contains(&a) && got.contains(&b),
        "{got:?} vs a={a:#x} b={b:#x}"
    );
    let mut buf = vec![0u8; 16];
    dev.read(a, &mut buf).unwrap();
    assert_eq!(buf, vec![0xAB; 16]);
    for x in got.into_iter().chain([warm_s, warm_t]) {
        p.free(x, t).unwrap();
    }
    p.close().unwrap();
    assert_eq!(dev.outstanding().pools, 0);
}

#[test]
fn invalid_frees_and_sizes_are_typed_errors() {
    let dev = sim(1 << 30);
    let s = dev.stream_create().unwrap();
    let p = pool(&dev, DriverPoolConfig::default());
    assert_eq!(p.alloc(0, s), Err(StreamError::ZeroSize));
    assert_eq!(p.alloc(u64::MAX, s), Err(StreamError::TooLarge(u64::MAX)));
    let a = p.alloc(G, s).unwrap();
    assert!(p.owns(a) && !p.owns(a + 1) && !p.owns(0));
    assert_eq!(
        p.free(a + 1, s),
        Err(StreamError::InvalidFree {
            ptr: a + 1,
            reason: InvalidFreeReason::NotOwned
        })
    );
    p.free(a, s).unwrap();
    assert!(p.owns(a), "cached blocks still belong to the tier");
    assert_eq!(p.size_of(a), None);
    assert_eq!(
        p.free(a, s),
        Err(StreamError::InvalidFree {
            ptr: a,
            reason: InvalidFreeReason::AlreadyFree
        })
    );
    p.trim(0).unwrap();
    assert!(!p.owns(a));
    assert_eq!(
        p.free(a, s),
        Err(StreamError::InvalidFree {
            ptr: a,
            reason: InvalidFreeReason::NotOwned
        })
    );
    let bad = DriverPool::new(
        dev.clone() as Arc<dyn Device>,
        DriverPoolConfig {
            round_to: 3,
            ..DriverPoolConfig::default()
        },
    );
    assert!(matches!(bad, Err(StreamError::Config(_))));
}

#[test]
fn over_the_cache_bound_frees_go_to_the_pool_on_the_callers_stream() {
    let dev = sim(1 << 30);
    let s = dev.stream_create().unwrap();
    let cfg = DriverPoolConfig {
        cache: StreamCacheConfig {
            max_cached_bytes: G,
            ..StreamCacheConfig::default()
        },
        ..DriverPoolConfig::default()
    };
    let p = pool(&dev, cfg);
    let (a, b) = (p.alloc(G, s).unwrap(), p.alloc(G, s).unwrap());
    p.free(a, s).unwrap();
    let before = dev.calls();
    p.free(b, s).unwrap();
    assert_eq!(dev.calls().since(&before)[CallKind::PoolFree], 1);
    assert!(!p.owns(b) && p.owns(a));
    let st = p.stats();
    assert_eq!(
        (st.pool_frees, st.cached_bytes, st.cache.overflows),
        (1, G, 1)
    );
}

#[test]
fn trim_returns_cached_memory_to_the_driver() {
    let dev = sim(1 << 30);
    let (s, t) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
    let p = pool(&dev, DriverPoolConfig::default());
    let blocks: Vec<u64> = (0..8)
        .map(|i| p.alloc(G * (1 + i % 2), s).unwrap())
        .collect();
    for (i, &b) in blocks.iter().enumerate() {
        p.free(b, if i % 2 == 0 { s } else { t }).unwrap();
    }
    assert_eq!(dev.reserved().current, 12 * G);
    assert_eq!(p.trim(0).unwrap(), 12 * G);
    let st = p.stats();
    assert_eq!((st.cached_bytes, st.pool_frees, st.trims), (0, 8, 1));
    assert_eq!(st.pool.unwrap().reserved_current, 0);
    assert_eq!(dev.reserved().current, 0);
    assert_eq!(st.pool.unwrap().reserved_high, 12 * G);
}

#[test]
fn out_of_memory_drains_trims_and_retries_once() {
    let dev = sim(16 * G);
    let s = dev.stream_create().unwrap();
    let p = pool(&dev, DriverPoolConfig::default());
    let small: Vec<u64> = (0..16).map(|_| p.alloc(G, s).unwrap()).collect();
    for b in small {
        p.free(b, s).unwrap();
    }
    // The device is full of cached 4 KiB blocks; a 32 KiB block needs them given back.
    let big = p.alloc(8 * G, s).unwrap();
    let st = p.stats();
    assert_eq!((st.oom_retries, st.trims, st.cached_bytes), (1, 1, 0));
    assert_eq!(st.live_bytes, 8 * G);
    // Nothing left to give back: the error comes out, typed.
    let err = p.alloc(16 * G, s).unwrap_err();
    assert!(
        matches!(err, StreamError::Device(ref e) if e.is_oom()),
        "{err:?}"
    );
    assert_eq!(p.stats().oom_retries, 2);
    p.free(big, s).unwrap();
}

#[test]
fn injected_oom_is_retried_and_injected_driver_errors_are_not() {
    let dev = sim(1 << 30);
    let s = dev.stream_create().unwrap();
    let p = pool(&dev, DriverPoolConfig::default());
    dev.fail_next(CallKind::PoolAlloc); // an OutOfMemory for calls with a size
    let a = p.alloc(G, s).unwrap();
    assert_eq!(p.stats().oom_retries, 1);
    dev.fail_next_with(
        CallKind::PoolAlloc,
        DeviceError::Driver {
            call: "cuMemAllocFromPoolAsync",
            code: 1,
            message: "injected".into(),
        },
    );
    assert!(matches!(
        p.alloc(2 * G, s),
        Err(StreamError::Device(DeviceError::Driver { .. }))
    ));
    assert_eq!(p.stats().oom_retries, 1);
    p.free(a, s).unwrap();
}

#[test]
fn close_reports_leaks_and_drop_never_panics() {
    let dev = sim(1 << 30);
    let s = dev.stream_create().unwrap();
    let p = pool(&dev, DriverPoolConfig::default());
    let a = p.alloc(G, s).unwrap();
    let b = p.alloc(G, s).unwrap();
    p.free(b, s).unwrap(); // cached: freed into the pool by close
    let _ = a; // leaked by the caller
    let err = p.close().unwrap_err();
    assert!(err.to_string().contains("live allocation"), "{err}");

    // Drop with only cached blocks: the pool goes away cleanly.
    let p = pool(&dev, DriverPoolConfig::default());
    let c = p.alloc(G, s).unwrap();
    p.free(c, s).unwrap();
    let pools = dev.outstanding().pools;
    drop(p);
    assert_eq!(dev.outstanding().pools, pools - 1);

    // A failing destroy in Drop is logged, not a panic.
    let p = pool(&dev, DriverPoolConfig::default());
    dev.fail_next(CallKind::PoolDestroy);
    drop(p);
}

#[test]
fn unsupported_device_is_a_typed_error() {
    let dev = sim(1 << 30);
    dev.fail_next(CallKind::PoolCreate);
    let r = DriverPool::new(dev.clone() as Arc<dyn Device>, DriverPoolConfig::default());
    assert!(matches!(r, Err(StreamError::Device(_))));
}

#[test]
fn stress_threads_alloc_and_free_on_their_streams() {
    const THREADS: usize = 4;
    let rounds = if cfg!(miri) { 20 } else { 2_000 };
    let dev = sim(1 << 34);
    let p = Arc::new(pool(&dev, DriverPoolConfig::default()));
    let streams: Vec<u64> = (0..THREADS).map(|_| dev.stream_create().unwrap()).collect();
    let handles: Vec<_> = streams
        .iter()
        .enumerate()
        .map(|(i, &s)| {
            let p = p.clone();
            std::thread::spawn(move || {
                let mut live: Vec<u64> = Vec::new();
                let mut x = (i as u64 + 1).wrapping_mul(0x2545_F491_4F6C_DD1D);
                for _ in 0..rounds {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    if x % 3 != 0 || live.is_empty() {
                        let size = 512 << (x % 5);
                        live.push(p.alloc(size, s).unwrap());
                    } else {
                        let b = live.swap_remove((x as usize >> 3) % live.len());
                        p.free(b, s).unwrap();
                    }
                    if live.len() > 32 {
                        for b in live.drain(..16) {
                            p.free(b, s).unwrap();
                        }
                    }
                }
                live
            })
        })
        .collect();
    let mut all = Vec::new();
    for h in handles {
        all.extend(h.join().unwrap());
    }
    let mut sorted = all.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted.len(), all.len(), "a block is live twice");
    let st = p.stats();
    assert_eq!(st.live_blocks, all.len() as u64);
    // The driver sees live and cached blocks as used, each rounded up to its granularity.
    let used = st.pool.unwrap().used_current;
    assert!(used >= st.live_bytes + st.cached_bytes, "{st:?}");
    assert!(
        used <= (st.live_blocks + st.cache.cached_blocks) * 2 * G,
        "{st:?}"
    );
    for b in all {
        p.free(b, streams[0]).unwrap();
    }
    assert_eq!(p.stats().live_bytes, 0);
    let p = Arc::try_unwrap(p).unwrap();
    p.close().unwrap();
    assert_eq!(dev.outstanding().pool_live_blocks, 0);
}
