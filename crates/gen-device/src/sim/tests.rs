//! Unit tests of the simulated device: every rule of the module doc, happy paths and each misuse.

use super::*;

const G: u64 = DEFAULT_GRANULARITY;

fn dev() -> SimDevice {
    SimDevice::new()
}

fn backed() -> SimDevice {
    SimConfig::new().backed(true).build().unwrap()
}

fn assert_inval<T: fmt::Debug>(r: Result<T>, call: &str) {
    match r {
        Err(DeviceError::InvalidArgument { call: c, .. }) => assert_eq!(c, call),
        other => panic!("expected InvalidArgument from {call}, got {other:?}"),
    }
}

fn assert_oom<T: fmt::Debug>(r: Result<T>, call: &str) {
    match r {
        Err(DeviceError::OutOfMemory { call: c, .. }) => assert_eq!(c, call),
        other => panic!("expected OutOfMemory from {call}, got {other:?}"),
    }
}

// ---- config ----------------------------------------------------------------------------------------

#[test]
fn config_defaults_and_props() {
    let d = dev();
    let p = d.props();
    assert_eq!(p.total_mem, 80 << 30);
    assert_eq!(p.vmm_granularity, 2 << 20);
    assert_eq!(p.ordinal, 0);
    assert_eq!(p.name, "SimDevice");
    assert!(p.supports_vmm && p.supports_pools);
    assert!(!d.is_backed());

    let d = SimConfig::new()
        .capacity(1 << 30)
        .ordinal(3)
        .name("tiny")
        .granularity(64 << 10)
        .build()
        .unwrap();
    assert_eq!(d.props().total_mem, 1 << 30);
    assert_eq!(d.props().ordinal, 3);
    assert_eq!(d.props().name, "tiny");
    assert_eq!(d.props().vmm_granularity, 64 << 10);
    assert_eq!(d.mem_info().unwrap(), (1 << 30, 1 << 30));
}

#[test]
fn config_rejects_bad_granularity() {
    for g in [0, 1000, 3 << 20, 2048] {
        assert_inval(SimConfig::new().granularity(g).build(), "SimConfig::build");
    }
}

#[test]
fn device_is_send_sync_and_object_safe() {
    fn check<T: Send + Sync>() {}
    check::<SimDevice>();
    let d: std::sync::Arc<dyn Device> = std::sync::Arc::new(dev());
    assert!(d.props().supports_vmm);
}

// ---- plain allocations -------------------------------------------------------------------------------

#[test]
fn mem_alloc_is_aligned_counted_and_in_its_own_space() {
    let d = dev();
    let a = d.mem_alloc(100).unwrap();
    let b = d.mem_alloc(1000).unwrap();
    assert_eq!(a % 256, 0);
    assert_eq!(b % 256, 0);
    assert!((PLAIN_BASE..PLAIN_BASE + SPACE_SIZE).contains(&a));
    assert!(b >= a + 512, "no overlap");
    assert_eq!(d.reserved().current, 512 + 1024);
    d.mem_free(a).unwrap();
    assert_eq!(
        d.reserved(),
        Reserved {
            current: 1024,
            peak: 1536
        }
    );
    d.mem_free(b).unwrap();
    assert_eq!(d.reserved().current, 0);
    assert_eq!(d.outstanding(), SimOutstanding::default());
}

#[test]
fn mem_alloc_misuse_and_capacity() {
    let d = SimConfig::new().capacity(4096).build().unwrap();
    assert_inval(d.mem_alloc(0), "cuMemAlloc");
    assert_oom(d.mem_alloc(4097), "cuMemAlloc");
    assert_oom(d.mem_alloc(u64::MAX), "cuMemAlloc");
    let a = d.mem_alloc(4096).unwrap();
    assert_oom(d.mem_alloc(1), "cuMemAlloc");
    assert_inval(d.mem_free(a + 512), "cuMemFree");
    d.mem_free(a).unwrap();
    assert_inval(d.mem_free(a), "cuMemFree"); // double free
    assert_eq!(d.mem_info().unwrap(), (4096, 4096));
}

#[test]
fn freed_addresses_are_not_reused_soon() {
    let d = dev();
    let a = d.mem_alloc(512).unwrap();
    d.mem_free(a).unwrap();
    let b = d.mem_alloc(512).unwrap();
    assert_ne!(a, b, "next-fit moves on");
}

#[test]
fn address_space_wraps_around_when_exhausted() {
    let mut s = AddrSpace::new(0x1000);
    s.end = 0x1000 + 4 * 0x100; // room for four blocks
    let v: Vec<u64> = (0..4).map(|_| s.alloc(0x100, 0x100).unwrap()).collect();
    assert_eq!(v, vec![0x1000, 0x1100, 0x1200, 0x1300]);
    assert_eq!(s.alloc(0x100, 0x100), None);
    s.free(0x1100);
    assert_eq!(s.alloc(0x100, 0x100), Some(0x1100));
    s.free(0x1000);
    s.free(0x1100);
    assert_eq!(s.alloc(0x200, 0x200), Some(0x1000));
    assert_eq!(s.alloc(0x100, 0x100), None);
}

// ---- VMM -----------------------------------------------------------------------------------------------

#[test]
fn va_reserve_is_aligned_disjoint_and_deterministic() {
    let d = dev();
    let a = d.va_reserve(4 * G, 0).unwrap();
    let b = d.va_reserve(2 * G, 64 * G).unwrap();
    assert_eq!(a, VA_BASE);
    assert_eq!(b % (64 * G), 0);
    assert!(b >= a + 4 * G);
    let d2 = dev();
    assert_eq!(d2.va_reserve(4 * G, 0).unwrap(), a);
    assert_eq!(d2.va_reserve(2 * G, 64 * G).unwrap(), b);
    // VA does not count against memory.
    assert_eq!(d.reserved().current, 0);
}

#[test]
fn va_misuse() {
    let d = dev();
    assert_inval(d.va_reserve(0, 0), "cuMemAddressReserve");
    assert_inval(d.va_reserve(G + 1, 0), "cuMemAddressReserve");
    assert_inval(d.va_reserve(G, 3 * G), "cuMemAddressReserve");
    assert_oom(d.va_reserve(SPACE_SIZE * 2, 0), "cuMemAddressReserve");
    let a = d.va_reserve(4 * G, 0).unwrap();
    assert_inval(d.va_release(a + G, 3 * G), "cuMemAddressFree");
    assert_inval(d.va_release(a, 2 * G), "cuMemAddressFree");
    let h = d.phys_create(G).unwrap();
    d.map(a + 3 * G, G, h).unwrap();
    assert_inval(d.va_release(a, 4 * G), "cuMemAddressFree"); // still mapped
    d.unmap(a + 3 * G, G).unwrap();
    d.va_release(a, 4 * G).unwrap();
    assert_inval(d.va_release(a, 4 * G), "cuMemAddressFree");
    d.phys_release(h).unwrap();
}

#[test]
fn phys_create_counts_against_capacity() {
    let d = SimConfig::new().capacity(4 * G).build().unwrap();
    assert_inval(d.phys_create(0), "cuMemCreate");
    assert_inval(d.phys_create(G / 2), "cuMemCreate");
    let h1 = d.phys_create(3 * G).unwrap();
    assert_oom(d.phys_create(2 * G), "cuMemCreate");
    let h2 = d.phys_create(G).unwrap();
    assert_ne!(h1, h2);
    assert_eq!(
        d.reserved(),
        Reserved {
            current: 4 * G,
            peak: 4 * G
        }
    );
    assert_eq!(d.mem_info().unwrap(), (0, 4 * G));
    d.phys_release(h1).unwrap();
    assert_inval(d.phys_release(h1), "cuMemRelease");
    assert_inval(d.phys_release(PhysHandle(999)), "cuMemRelease");
    d.phys_release(h2).unwrap();
    assert_eq!(
        d.reserved(),
        Reserved {
            current: 0,
            peak: 4 * G
        }
    );
}

#[test]
fn map_rules() {
    let d = dev();
    let va = d.va_reserve(8 * G, 0).unwrap();
    let h = d.phys_create(2 * G).unwrap();
    let h1 = d.phys_create(G).unwrap();
    assert_inval(d.map(va + 1, 2 * G, h), "cuMemMap"); // unaligned
    assert_inval(d.map(va, G, h), "cuMemMap"); // size differs from the handle
    assert_inval(d.map(va, 3 * G, h), "cuMemMap");
    assert_inval(d.map(va, 2 * G, PhysHandle(77)), "cuMemMap"); // unknown handle
    assert_inval(d.map(va + 7 * G, 2 * G, h), "cuMemMap"); // runs past the reservation
    assert_inval(d.map(VA_BASE + SPACE_SIZE, 2 * G, h), "cuMemMap"); // outside any reservation
    d.map(va + 2 * G, 2 * G, h).unwrap();
    assert_inval(d.map(va + 2 * G, G, h1), "cuMemMap"); // already mapped
    assert_inval(d.map(va + 3 * G, G, h1), "cuMemMap"); // overlaps the tail
    assert_inval(d.phys_release(h), "cuMemRelease"); // mapped
    d.map(va + 4 * G, G, h1).unwrap(); // adjacent is fine
                                       // The same handle may be mapped twice (aliasing), as in CUDA.
    d.map(va + 6 * G, 2 * G, h).unwrap();
    assert_eq!(d.outstanding().mappings, 3);
    d.unmap(va + 6 * G, 2 * G).unwrap();
    assert_inval(d.phys_release(h), "cuMemRelease"); // still mapped once
    d.unmap(va + 2 * G, 3 * G).unwrap(); // one unmap covering two mappings
    d.phys_release(h).unwrap();
    d.phys_release(h1).unwrap();
    d.va_release(va, 8 * G).unwrap();
    assert_eq!(d.outstanding(), SimOutstanding::default());
}

#[test]
fn unmap_must_cover_whole_mappings() {
    let d = dev();
    let va = d.va_reserve(8 * G, 0).unwrap();
    let h = d.phys_create(2 * G).unwrap();
    let h1 = d.phys_create(G).unwrap();
    d.map(va, 2 * G, h).unwrap();
    d.map(va + 3 * G, G, h1).unwrap();
    assert_inval(d.unmap(va, G), "cuMemUnmap"); // half a mapping
    assert_inval(d.unmap(va + G, G), "cuMemUnmap"); // starts inside a mapping
    assert_inval(d.unmap(va, 4 * G), "cuMemUnmap"); // gap at va + 2G
    assert_inval(d.unmap(va + 2 * G, G), "cuMemUnmap"); // nothing mapped
    assert_inval(d.unmap(va, 0), "cuMemUnmap");
    assert_inval(d.unmap(va + 1, G), "cuMemUnmap");
    assert_eq!(d.outstanding().mappings, 2, "failed unmaps change nothing");
    d.unmap(va, 2 * G).unwrap();
    assert_inval(d.unmap(va, 2 * G), "cuMemUnmap"); // double unmap
    d.unmap(va + 3 * G, G).unwrap();
}

// ---- pools -------------------------------------------------------------------------------------------

#[test]
fn pool_alloc_rounds_counts_and_reuses_on_the_same_stream() {
    let d = dev();
    let p = d.pool_create(u64::MAX).unwrap();
    let a = d.pool_alloc_async(p, 1000, 0).unwrap();
    assert!((POOL_BASE..POOL_BASE + SPACE_SIZE).contains(&a));
    assert_eq!(a % G, 0);
    let u = d.pool_usage(p).unwrap();
    assert_eq!(
        u,
        PoolUsage {
            reserved_current: G,
            reserved_high: G,
            used_current: G,
            used_high: G
        }
    );
    assert_eq!(d.reserved().current, G);
    d.pool_free_async(a, 0).unwrap();
    assert_eq!(d.pool_usage(p).unwrap().used_current, 0);
    assert_eq!(d.pool_usage(p).unwrap().reserved_current, G);
    let b = d.pool_alloc_async(p, 2000, 0).unwrap();
    assert_eq!(a, b, "cached block reused");
    assert_eq!(d.calls()[CallKind::PoolAlloc], 2);
    assert_eq!(
        d.reserved(),
        Reserved {
            current: G,
            peak: G
        }
    );
    d.pool_free_async(b, 0).unwrap();
    d.pool_destroy(p).unwrap();
    assert_eq!(d.reserved().current, 0);
    assert_eq!(d.outstanding(), SimOutstanding::default());
}

#[test]
fn pool_reuse_is_best_fit() {
    let d = dev();
    let p = d.pool_create(u64::MAX).unwrap();
    let big = d.pool_alloc_async(p, 8 * G, 0).unwrap();
    let mid = d.pool_alloc_async(p, 3 * G, 0).unwrap();
    let small = d.pool_alloc_async(p, G, 0).unwrap();
    for x in [big, mid, small] {
        d.pool_free_async(x, 0).unwrap();
    }
    assert_eq!(d.pool_alloc_async(p, 2 * G, 0).unwrap(), mid);
    assert_eq!(d.pool_alloc_async(p, 1, 0).unwrap(), small);
    assert_eq!(d.pool_alloc_async(p, 4 * G, 0).unwrap(), big);
    let fresh = d.pool_alloc_async(p, G, 0).unwrap();
    assert!(![big, mid, small].contains(&fresh));
    assert_eq!(d.pool_usage(p).unwrap().reserved_current, 13 * G);
}

#[test]
fn pool_cross_stream_reuse_follows_completion() {
    let d = dev();
    let p = d.pool_create(u64::MAX).unwrap();
    let s1 = d.stream_create().unwrap();
    let s2 = d.stream_create().unwrap();
    d.pause_stream(s1).unwrap();
    let a = d.pool_alloc_async(p, G, s1).unwrap();
    d.pool_free_async(a, s1).unwrap();
    // The free on s1 has not completed: s2 must not get the block ...
    let b = d.pool_alloc_async(p, G, s2).unwrap();
    assert_ne!(a, b);
    // ... but s1 itself may (stream order).
    let c = d.pool_alloc_async(p, G, s1).unwrap();
    assert_eq!(c, a);
    d.pool_free_async(c, s1).unwrap();
    d.resume_stream(s1).unwrap();
    // Now the free has completed: any stream may reuse it.
    let e = d.pool_alloc_async(p, G, s2).unwrap();
    assert_eq!(e, a);
    d.pool_free_async(b, s2).unwrap();
    d.pool_free_async(e, s2).unwrap();
}

#[test]
fn pool_never_hands_out_overlapping_live_blocks() {
    // A deterministic pseudo-random workload over three streams, one paused part of the time.
    let d = dev();
    let p = d.pool_create(4 * G).unwrap();
    let streams = [0, d.stream_create().unwrap(), d.stream_create().unwrap()];
    let mut live: Vec<(u64, u64, StreamId)> = Vec::new();
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let steps = if cfg!(miri) { 200 } else { 3000 };
    for i in 0..steps {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if i % 97 == 0 {
            d.pause_stream(streams[1]).unwrap();
        }
        if i % 97 == 50 {
            d.resume_stream(streams[1]).unwrap();
        }
        let s = streams[(x % 3) as usize];
        if live.len() < 20 && (x >> 8) % 2 == 0 {
            let bytes = 1 + (x >> 16) % (5 * G);
            let ptr = d.pool_alloc_async(p, bytes, s).unwrap();
            for &(q, n, _) in &live {
                assert!(
                    ptr + bytes <= q || q + n <= ptr,
                    "overlap {ptr:#x}+{bytes:#x} with {q:#x}+{n:#x}"
                );
            }
            live.push((ptr, bytes, s));
        } else if !live.is_empty() {
            let (ptr, _, _) = live.swap_remove(((x >> 20) % live.len() as u64) as usize);
            d.pool_free_async(ptr, s).unwrap();
        }
        let u = d.pool_usage(p).unwrap();
        assert!(u.used_current <= u.reserved_current);
        assert_eq!(d.reserved().current, u.reserved_current);
    }
    d.resume_stream(streams[1]).unwrap();
    for (ptr, _, s) in live {
        d.pool_free_async(ptr, s).unwrap();
    }
    d.synchronize().unwrap();
    assert!(d.pool_usage(p).unwrap().reserved_current <= 4 * G);
}

#[test]
fn pool_threshold_applies_at_synchronization() {
    let d = dev();
    let p = d.pool_create(2 * G).unwrap();
    let blocks: Vec<u64> = (0..4)
        .map(|_| d.pool_alloc_async(p, G, 0).unwrap())
        .collect();
    for b in &blocks {
        d.pool_free_async(*b, 0).unwrap();
    }
    assert_eq!(
        d.pool_usage(p).unwrap().reserved_current,
        4 * G,
        "nothing released before a sync"
    );
    d.synchronize().unwrap();
    let u = d.pool_usage(p).unwrap();
    assert_eq!(u.reserved_current, 2 * G);
    assert_eq!(u.reserved_high, 4 * G);
    assert_eq!(
        d.reserved(),
        Reserved {
            current: 2 * G,
            peak: 4 * G
        }
    );

    // Stream and event synchronization apply it too; a threshold of 0 empties the pool.
    let p0 = d.pool_create(0).unwrap();
    let s = d.stream_create().unwrap();
    let a = d.pool_alloc_async(p0, G, s).unwrap();
    d.pool_free_async(a, s).unwrap();
    d.stream_synchronize(s).unwrap();
    assert_eq!(d.pool_usage(p0).unwrap().reserved_current, 0);
    let a = d.pool_alloc_async(p0, G, s).unwrap();
    d.pool_free_async(a, s).unwrap();
    let e = d.event_create().unwrap();
    d.event_record(e, s).unwrap();
    d.event_synchronize(e).unwrap();
    assert_eq!(d.pool_usage(p0).unwrap().reserved_current, 0);
}

#[test]
fn pool_threshold_keeps_blocks_whose_free_is_pending() {
    let d = dev();
    let p = d.pool_create(0).unwrap();
    let s = d.stream_create().unwrap();
    let a = d.pool_alloc_async(p, G, s).unwrap();
    d.pause_stream(s).unwrap();
    d.pool_free_async(a, s).unwrap();
    d.stream_synchronize(0).unwrap(); // stream 0 is idle: succeeds, but a's free is pending
    assert_eq!(d.pool_usage(p).unwrap().reserved_current, G);
    d.pool_trim(p, 0).unwrap();
    assert_eq!(d.pool_usage(p).unwrap().reserved_current, G);
    d.resume_stream(s).unwrap();
    d.pool_trim(p, 0).unwrap();
    assert_eq!(d.pool_usage(p).unwrap().reserved_current, 0);
}

#[test]
fn pool_trim_keeps_at_least_keep() {
    let d = dev();
    let p = d.pool_create(u64::MAX).unwrap();
    let v: Vec<u64> = [G, 2 * G, 4 * G]
        .iter()
        .map(|&n| d.pool_alloc_async(p, n, 0).unwrap())
        .collect();
    let keep_live = d.pool_alloc_async(p, G, 0).unwrap();
    for b in &v {
        d.pool_free_async(*b, 0).unwrap();
    }
    d.synchronize().unwrap();
    assert_eq!(
        d.pool_usage(p).unwrap().reserved_current,
        8 * G,
        "u64::MAX threshold keeps all"
    );
    d.pool_trim(p, 5 * G).unwrap(); // largest first: the 4G block goes
    assert_eq!(d.pool_usage(p).unwrap().reserved_current, 4 * G);
    d.pool_trim(p, 0).unwrap(); // the live block stays
    let u = d.pool_usage(p).unwrap();
    assert_eq!((u.reserved_current, u.used_current), (G, G));
    assert_eq!(d.outstanding().pool_cached_blocks, 0);
    assert_inval(d.pool_destroy(p), "cuMemPoolDestroy"); // a live allocation
    d.pool_free_async(keep_live, 0).unwrap();
    d.pool_destroy(p).unwrap();
    assert_eq!(d.reserved().current, 0);
}

#[test]
fn pool_misuse() {
    let d = SimConfig::new().capacity(2 * G).build().unwrap();
    let p = d.pool_create(u64::MAX).unwrap();
    let bad = PoolHandle(42);
    assert_inval(d.pool_alloc_async(bad, 1, 0), "cuMemAllocFromPoolAsync");
    assert_inval(d.pool_alloc_async(p, 0, 0), "cuMemAllocFromPoolAsync");
    assert_inval(d.pool_alloc_async(p, 1, 12345), "cuMemAllocFromPoolAsync");
    assert_oom(
        d.pool_alloc_async(p, 2 * G + 1, 0),
        "cuMemAllocFromPoolAsync",
    );
    assert_oom(
        d.pool_alloc_async(p, u64::MAX, 0),
        "cuMemAllocFromPoolAsync",
    );
    let a = d.pool_alloc_async(p, G, 0).unwrap();
    assert_inval(d.pool_free_async(a + 1, 0), "cuMemFreeAsync");
    assert_inval(d.pool_free_async(a, 999), "cuMemFreeAsync");
    d.pool_free_async(a, 0).unwrap();
    assert_inval(d.pool_free_async(a, 0), "cuMemFreeAsync"); // double free
    assert_inval(d.pool_trim(bad, 0), "cuMemPoolTrimTo");
    assert_inval(d.pool_usage(bad), "cuMemPoolGetAttribute");
    assert_inval(d.pool_destroy(bad), "cuMemPoolDestroy");
    d.pool_destroy(p).unwrap();
    assert_inval(d.pool_destroy(p), "cuMemPoolDestroy");
    assert_inval(d.pool_alloc_async(p, 1, 0), "cuMemAllocFromPoolAsync");
}

#[test]
fn two_pools_share_the_capacity() {
    let d = SimConfig::new().capacity(3 * G).build().unwrap();
    let p1 = d.pool_create(u64::MAX).unwrap();
    let p2 = d.pool_create(u64::MAX).unwrap();
    let a = d.pool_alloc_async(p1, 2 * G, 0).unwrap();
    d.pool_free_async(a, 0).unwrap();
    // The cached block belongs to p1: p2 cannot use it and the capacity is short.
    assert_oom(d.pool_alloc_async(p2, 2 * G, 0), "cuMemAllocFromPoolAsync");
    d.pool_trim(p1, 0).unwrap();
    let b = d.pool_alloc_async(p2, 2 * G, 0).unwrap();
    d.pool_free_async(b, 0).unwrap();
    assert_eq!(
        d.reserved(),
        Reserved {
            current: 2 * G,
            peak: 2 * G
        }
    );
}

// ---- streams and events ------------------------------------------------------------------------------

#[test]
fn events_complete_immediately_on_running_streams() {
    let d = dev();
    let s = d.stream_create().unwrap();
    assert_ne!(s, 0);
    let e = d.event_create().unwrap();
    assert!(d.event_query(e).unwrap(), "never recorded = complete");
    d.event_synchronize(e).unwrap();
    d.event_record(e, s).unwrap();
    assert!(d.event_query(e).unwrap());
    d.event_record(e, 0).unwrap();
    assert!(d.event_query(e).unwrap());
    d.stream_synchronize(s).unwrap();
    d.stream_synchronize(0).unwrap();
    d.synchronize().unwrap();
    d.event_destroy(e).unwrap();
    d.stream_destroy(s).unwrap();
    assert_eq!(d.outstanding(), SimOutstanding::default());
}

#[test]
fn paused_stream_holds_its_events_and_syncs_fail_instead_of_hanging() {
    let d = dev();
    let s = d.stream_create().unwrap();
    let e = d.event_create().unwrap();
    d.pause_stream(s).unwrap();
    d.stream_synchronize(s).unwrap(); // nothing queued yet
    d.event_record(e, s).unwrap();
    assert!(!d.event_query(e).unwrap());
    assert_inval(d.event_synchronize(e), "cuEventSynchronize");
    assert_inval(d.stream_synchronize(s), "cuStreamSynchronize");
    assert_inval(d.synchronize(), "cuCtxSynchronize");
    d.stream_synchronize(0).unwrap(); // other streams are unaffected
    d.resume_stream(s).unwrap();
    assert!(d.event_query(e).unwrap());
    d.event_synchronize(e).unwrap();
    d.synchronize().unwrap();
}

#[test]
fn rerecording_an_event_moves_it() {
    let d = dev();
    let s1 = d.stream_create().unwrap();
    let s2 = d.stream_create().unwrap();
    let e = d.event_create().unwrap();
    d.pause_stream(s1).unwrap();
    d.event_record(e, s1).unwrap();
    assert!(!d.event_query(e).unwrap());
    d.event_record(e, s2).unwrap();
    assert!(d.event_query(e).unwrap(), "only the last record counts");
    d.resume_stream(s1).unwrap();
}

#[test]
fn stream_wait_event_orders_work_across_streams() {
    let d = dev();
    let producer = d.stream_create().unwrap();
    let consumer = d.stream_create().unwrap();
    let e = d.event_create().unwrap();
    let done = d.event_create().unwrap();
    d.pause_stream(producer).unwrap();
    d.event_record(e, producer).unwrap();
    d.stream_wait_event(consumer, e).unwrap();
    d.event_record(done, consumer).unwrap();
    assert!(
        !d.event_query(done).unwrap(),
        "consumer waits for the paused producer"
    );
    assert_inval(d.stream_synchronize(consumer), "cuStreamSynchronize");
    // Recording the event again later does not release the earlier wait.
    d.event_record(e, 0).unwrap();
    assert!(!d.event_query(done).unwrap());
    d.resume_stream(producer).unwrap();
    assert!(d.event_query(done).unwrap());
    d.stream_synchronize(consumer).unwrap();
    // Waiting on a completed or never-recorded event is a no-op.
    let fresh = d.event_create().unwrap();
    d.stream_wait_event(consumer, fresh).unwrap();
    d.stream_wait_event(consumer, e).unwrap();
    d.stream_synchronize(consumer).unwrap();
}

#[test]
fn cross_stream_pool_reuse_through_a_waited_free_after_completion() {
    // Free on a paused stream, then the consumer waits on an event after the free: the block becomes
    // reusable elsewhere once the producer resumes.
    let d = dev();
    let p = d.pool_create(u64::MAX).unwrap();
    let s1 = d.stream_create().unwrap();
    let s2 = d.stream_create().unwrap();
    let e = d.event_create().unwrap();
    let a = d.pool_alloc_async(p, G, s1).unwrap();
    d.pause_stream(s1).unwrap();
    d.pool_free_async(a, s1).unwrap();
    d.event_record(e, s1).unwrap();
    d.stream_wait_event(s2, e).unwrap();
    assert_ne!(d.pool_alloc_async(p, G, s2).unwrap(), a);
    d.resume_stream(s1).unwrap();
    assert_eq!(d.pool_alloc_async(p, G, s2).unwrap(), a);
}

#[test]
fn stream_and_event_misuse() {
    let d = dev();
    let s = d.stream_create().unwrap();
    let e = d.event_create().unwrap();
    let bad_s = 0xdead;
    let bad_e = EventHandle(0xbeef);
    assert_inval(d.stream_destroy(0), "cuStreamDestroy");
    assert_inval(d.stream_destroy(bad_s), "cuStreamDestroy");
    assert_inval(d.stream_synchronize(bad_s), "cuStreamSynchronize");
    assert_inval(d.event_record(bad_e, s), "cuEventRecord");
    assert_inval(d.event_record(e, bad_s), "cuEventRecord");
    assert_inval(d.event_query(bad_e), "cuEventQuery");
    assert_inval(d.event_synchronize(bad_e), "cuEventSynchronize");
    assert_inval(d.event_destroy(bad_e), "cuEventDestroy");
    assert_inval(d.stream_wait_event(bad_s, e), "cuStreamWaitEvent");
    assert_inval(d.stream_wait_event(s, bad_e), "cuStreamWaitEvent");
    assert_inval(d.memset_async(0, 0, 0, bad_s), "cuMemsetD8Async");
    assert_inval(d.pause_stream(bad_s), "SimDevice::pause_stream");
    assert_inval(d.resume_stream(bad_s), "SimDevice::resume_stream");
    d.stream_destroy(s).unwrap();
    assert_inval(d.stream_destroy(s), "cuStreamDestroy");
    assert_inval(d.event_record(e, s), "cuEventRecord");
    d.event_destroy(e).unwrap();
    assert_inval(d.event_query(e), "cuEventQuery");
}

#[test]
fn destroyed_stream_work_still_completes() {
    let d = dev();
    let s = d.stream_create().unwrap();
    let e = d.event_create().unwrap();
    d.pause_stream(s).unwrap();
    d.event_record(e, s).unwrap();
    d.stream_destroy(s).unwrap();
    assert!(!d.event_query(e).unwrap());
    assert_eq!(d.outstanding().streams, 0);
    d.resume_stream(s).unwrap(); // its queued work may still be released
    assert!(d.event_query(e).unwrap());
    d.synchronize().unwrap();
    assert_inval(d.resume_stream(s), "SimDevice::resume_stream"); // now forgotten
}

// ---- data --------------------------------------------------------------------------------------------

#[test]
fn backed_data_goes_through_mappings() {
    let d = backed();
    let va = d.va_reserve(4 * G, 0).unwrap();
    let h1 = d.phys_create(G).unwrap();
    let h2 = d.phys_create(G).unwrap();
    d.map(va, G, h1).unwrap();
    d.map(va + G, G, h2).unwrap();
    // A write straddling two mappings.
    let pattern: Vec<u8> = (0..200_000u32).map(|i| (i * 7 + 3) as u8).collect();
    let at = va + G - 100_000;
    d.write(at, &pattern).unwrap();
    let mut back = vec![0u8; pattern.len()];
    d.read(at, &mut back).unwrap();
    assert_eq!(back, pattern);
    // Unwritten bytes read as zero.
    let mut z = [0xffu8; 16];
    d.read(va + 3 * (G / 2), &mut z).unwrap();
    assert_eq!(z, [0; 16]);
    // Remap h2 elsewhere: its bytes follow the handle.
    d.unmap(va + G, G).unwrap();
    d.map(va + 3 * G, G, h2).unwrap();
    let mut tail = vec![0u8; 100_000];
    d.read(va + 3 * G, &mut tail).unwrap();
    assert_eq!(&tail[..], &pattern[100_000..]);
    // Use after unmap faults, and a faulting access has no partial effect.
    assert_inval(d.read(va + G, &mut z), "cuMemcpyDtoH");
    assert_inval(d.write(va + G - 8, &[1u8; 16]), "cuMemcpyHtoD");
    let mut last = [0u8; 8];
    d.read(va + G - 8, &mut last).unwrap();
    assert_eq!(&last[..], &pattern[100_000 - 8..100_000]);
}

#[test]
fn backed_memset_plain_and_pool() {
    let d = backed();
    let a = d.mem_alloc(300_000).unwrap();
    d.memset_async(a, 0xab, 300_000, 0).unwrap();
    d.memset_async(a + 10, 0, 5, 0).unwrap();
    let mut v = vec![0u8; 300_000];
    d.read(a, &mut v).unwrap();
    assert!(v[..10].iter().all(|&b| b == 0xab));
    assert!(v[10..15].iter().all(|&b| b == 0));
    assert!(v[15..].iter().all(|&b| b == 0xab));
    d.mem_free(a).unwrap();
    assert_inval(d.read(a, &mut v[..1]), "cuMemcpyDtoH"); // use after free

    let p = d.pool_create(u64::MAX).unwrap();
    let s = d.stream_create().unwrap();
    let b = d.pool_alloc_async(p, 4096, s).unwrap();
    d.memset_async(b, 0x5a, 4096, s).unwrap();
    let mut w = [0u8; 4096];
    d.read(b, &mut w).unwrap();
    assert!(w.iter().all(|&x| x == 0x5a));
    d.pool_free_async(b, s).unwrap();
    assert_inval(d.read(b, &mut w), "cuMemcpyDtoH"); // freed pool block faults
    assert_inval(d.memset_async(b, 0, 1, s), "cuMemsetD8Async");
}

#[test]
fn huge_backed_capacity_costs_nothing_until_written() {
    let d = backed();
    let n: u64 = if cfg!(miri) { 1 << 30 } else { 40 << 30 };
    let h = d.phys_create(n).unwrap();
    let va = d.va_reserve(n, 0).unwrap();
    d.map(va, n, h).unwrap();
    d.memset_async(va, 0, n, 0).unwrap(); // zero fill of absent pages allocates nothing
    d.write(va + (n - (1 << 20)), b"hello").unwrap();
    let mut out = [0u8; 5];
    d.read(va + (n - (1 << 20)), &mut out).unwrap();
    assert_eq!(&out, b"hello");
}

#[test]
fn unbacked_data_calls_validate_only() {
    let d = dev();
    let a = d.mem_alloc(1024).unwrap();
    d.write(a, &[1, 2, 3]).unwrap();
    d.memset_async(a, 1, 1024, 0).unwrap();
    let mut out = [0u8; 4];
    assert!(matches!(
        d.read(a, &mut out),
        Err(DeviceError::Unsupported(_))
    ));
    assert_inval(d.write(a + 1020, &[0; 8]), "cuMemcpyHtoD");
    assert_inval(d.memset_async(a, 1, 1025, 0), "cuMemsetD8Async");
    assert_inval(d.write(u64::MAX - 1, &[0; 8]), "cuMemcpyHtoD");
    d.write(a + 4, &[]).unwrap(); // empty access is fine
}

// ---- test hooks --------------------------------------------------------------------------------------

#[test]
fn calls_are_counted_by_kind() {
    let d = dev();
    let before = d.calls();
    let va = d.va_reserve(2 * G, 0).unwrap();
    let h = d.phys_create(G).unwrap();
    d.map(va, G, h).unwrap();
    let _ = d.map(va, G, h); // a failed call counts too
    d.unmap(va, G).unwrap();
    let c = d.calls().since(&before);
    assert_eq!(c.get(CallKind::VaReserve), 1);
    assert_eq!(c.get(CallKind::PhysCreate), 1);
    assert_eq!(c[CallKind::Map], 2);
    assert_eq!(c[CallKind::Unmap], 1);
    assert_eq!(c.total(), 5);
    assert_eq!(CallKind::Map.to_string(), "cuMemMap");
    assert_eq!(CallKind::ALL.len(), N_KINDS);
}

#[test]
fn fail_next_injects_one_fault_without_effect() {
    let d = dev();
    d.fail_next(CallKind::PhysCreate);
    assert_oom(d.phys_create(G), "cuMemCreate");
    assert_eq!(d.reserved().current, 0);
    let h = d.phys_create(G).unwrap();
    let va = d.va_reserve(G, 0).unwrap();
    d.fail_next(CallKind::Map);
    d.fail_next(CallKind::Map);
    for _ in 0..2 {
        match d.map(va, G, h) {
            Err(DeviceError::Driver { call, code, .. }) => {
                assert_eq!((call, code), ("cuMemMap", 999))
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(d.outstanding().mappings, 0);
    d.map(va, G, h).unwrap();
    d.fail_next_with(CallKind::Unmap, DeviceError::Unsupported("cuMemUnmap"));
    assert_eq!(d.unmap(va, G), Err(DeviceError::Unsupported("cuMemUnmap")));
    d.unmap(va, G).unwrap();
    // Every allocating kind defaults to OutOfMemory.
    let p = d.pool_create(0).unwrap();
    d.fail_next(CallKind::PoolAlloc);
    assert_oom(d.pool_alloc_async(p, 1, 0), "cuMemAllocFromPoolAsync");
    d.fail_next(CallKind::MemAlloc);
    assert_oom(d.mem_alloc(1), "cuMemAlloc");
    d.fail_next(CallKind::VaReserve);
    assert_oom(d.va_reserve(G, 0), "cuMemAddressReserve");
    d.fail_next(CallKind::Synchronize);
    assert!(d.synchronize().is_err());
    d.synchronize().unwrap();
}

#[test]
fn set_capacity_models_exhaustion() {
    let d = dev();
    let h = d.phys_create(4 * G).unwrap();
    d.set_capacity(3 * G);
    assert_eq!(d.mem_info().unwrap(), (0, 3 * G));
    assert!(d.phys_create(G).unwrap_err().is_oom());
    d.phys_release(h).unwrap();
    let h = d.phys_create(3 * G).unwrap();
    d.phys_release(h).unwrap();
    assert_eq!(
        d.props().total_mem,
        80 << 30,
        "props keep the configured size"
    );
}

#[test]
fn shared_across_threads() {
    let d = std::sync::Arc::new(SimConfig::new().backed(true).build().unwrap());
    let n = if cfg!(miri) { 4 } else { 200 };
    let handles: Vec<_> = (0..4u8)
        .map(|t| {
            let d = d.clone();
            std::thread::spawn(move || {
                let s = d.stream_create().unwrap();
                let p = d.pool_create(0).unwrap();
                for i in 0..n {
                    let a = d.pool_alloc_async(p, 1 + i * 1000, s).unwrap();
                    d.write(a, &[t; 64]).unwrap();
                    let mut back = [0u8; 64];
                    d.read(a, &mut back).unwrap();
                    assert_eq!(back, [t; 64]);
                    d.pool_free_async(a, s).unwrap();
                }
                d.stream_synchronize(s).unwrap();
                d.pool_destroy(p).unwrap();
                d.stream_destroy(s).unwrap();
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(d.reserved().current, 0);
    assert_eq!(d.outstanding(), SimOutstanding::default());
}

#[test]
fn map_run_maps_a_run_and_undoes_a_partial_one() {
    let d = dev();
    let g = d.props().vmm_granularity;
    let va = d.va_reserve(4 * g, 0).unwrap();
    let hs: Vec<_> = (0..3).map(|_| d.phys_create(g).unwrap()).collect();
    d.map_run(va, g, &hs).unwrap();
    assert_eq!(d.outstanding().mappings, 3);
    // One unmap for the whole run.
    d.unmap(va, 3 * g).unwrap();
    assert_eq!(d.outstanding().mappings, 0);
    // The second handle is bad: the first mapping is undone, nothing stays mapped.
    let bad = PhysHandle(0xdead_beef);
    assert_inval(d.map_run(va, g, &[hs[0], bad, hs[1]]), "cuMemMap");
    assert_eq!(d.outstanding().mappings, 0);
    for h in hs {
        d.phys_release(h).unwrap();
    }
    d.va_release(va, 4 * g).unwrap();
}

// ---- pinned host memory ------------------------------------------------------------------------------

#[test]
fn pinned_host_copies_round_trip_through_a_mapping() {
    let d = backed();
    let va = d.va_reserve(2 * G, 0).unwrap();
    let h = d.phys_create(G).unwrap();
    d.map(va, G, h).unwrap();
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
    d.write(va + 100, &data).unwrap();
    let host = d.host_alloc(2 * G).unwrap();
    assert_eq!(d.outstanding().host_buffers, 1);
    assert_eq!(
        d.reserved().current,
        G,
        "pinned memory is not device memory"
    );
    d.copy_to_host(host, G, va, G).unwrap();
    // Overwrite the device copy, then restore it from the host buffer at another mapping.
    d.memset_async(va, 0xee, G, 0).unwrap();
    d.unmap(va, G).unwrap();
    d.phys_release(h).unwrap();
    let h2 = d.phys_create(G).unwrap();
    d.map(va + G, G, h2).unwrap();
    d.copy_from_host(va + G, host, G, G).unwrap();
    let mut out = vec![0u8; data.len()];
    d.read(va + G + 100, &mut out).unwrap();
    assert_eq!(out, data);
    // Misuse: outside the buffer, unknown buffer, unmapped device range; nothing changes.
    assert_inval(
        d.copy_to_host(host, G + 1, va + G, G),
        "cuMemcpyDtoH (pinned)",
    );
    assert_inval(
        d.copy_from_host(va + G, host, u64::MAX, 2),
        "cuMemcpyHtoD (pinned)",
    );
    assert_inval(
        d.copy_to_host(HostHandle(999), 0, va + G, 16),
        "cuMemcpyDtoH (pinned)",
    );
    assert_inval(d.copy_to_host(host, 0, va, 16), "cuMemcpyDtoH (pinned)");
    assert_inval(d.host_alloc(0), "cuMemAllocHost");
    d.host_free(host).unwrap();
    assert_inval(d.host_free(host), "cuMemFreeHost");
    assert_eq!(d.outstanding().host_buffers, 0);
    d.fail_next(CallKind::HostAlloc);
    assert_oom(d.host_alloc(G), "cuMemAllocHost");
    assert!(!d.stream_is_capturing(0).unwrap());
    d.unmap(va + G, G).unwrap();
    d.phys_release(h2).unwrap();
    d.va_release(va, 2 * G).unwrap();
}

// ---- captures, peers, IPC ------------------------------------------------------------------------------

#[test]
fn a_capture_refuses_what_it_forbids_and_is_invalidated() {
    let d = dev();
    let s = d.stream_create().unwrap();
    let other = d.stream_create().unwrap();
    let ev = d.event_create().unwrap();
    let va = d.va_reserve(2 * G, 0).unwrap();
    let h = d.phys_create(G).unwrap();
    d.map(va, G, h).unwrap();
    d.begin_capture(s).unwrap();
    assert_inval(d.begin_capture(other), "cuStreamBeginCapture");
    // Allowed: creating and mapping memory, events on other streams, memsets.
    let h2 = d.phys_create(G).unwrap();
    d.map(va + G, G, h2).unwrap();
    d.event_record(ev, other).unwrap();
    d.memset_async(va, 1, 16, s).unwrap();
    assert!(d.capture_violations().is_empty());
    // Forbidden: each fails with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED.
    for r in [
        d.synchronize(),
        d.stream_synchronize(other),
        d.event_synchronize(ev),
        d.event_query(ev).map(|_| ()),
        d.unmap(va + G, G),
    ] {
        match r {
            Err(DeviceError::Driver { code, .. }) => assert_eq!(code, 900),
            other => panic!("expected a capture error, got {other:?}"),
        }
    }
    d.event_record(ev, s).unwrap();
    assert_eq!(
        d.capture_violations(),
        vec![
            "cuCtxSynchronize",
            "cuStreamSynchronize",
            "cuEventSynchronize",
            "cuEventQuery",
            "cuMemUnmap",
            "cuEventRecord on the capturing stream"
        ]
    );
    match d.end_capture() {
        Err(DeviceError::Driver { code, message, .. }) => {
            assert_eq!(code, 901);
            assert!(message.contains("cuCtxSynchronize"), "{message}");
        }
        other => panic!("expected an invalidated capture, got {other:?}"),
    }
    assert_inval(d.end_capture(), "cuStreamEndCapture");
    // After the capture everything works again; a clean capture ends clean.
    d.synchronize().unwrap();
    d.unmap(va, 2 * G).unwrap();
    d.begin_capture(s).unwrap();
    d.memset_async(va, 1, 0, s).ok();
    d.end_capture().unwrap();
    // The engine's count is separate from the driver's view.
    assert!(!d.captures().active());
}

#[test]
fn peers_get_access_to_new_mappings_and_to_old_ones_on_request() {
    let d = SimConfig::new().ordinal(1).build().unwrap();
    let va = d.va_reserve(4 * G, 0).unwrap();
    let (h0, h1) = (d.phys_create(G).unwrap(), d.phys_create(G).unwrap());
    d.map(va, G, h0).unwrap();
    assert!(d.accessible_by(1, va, G), "the owner");
    assert!(!d.accessible_by(0, va, G), "no peer yet");
    assert_inval(d.add_peer(1), "cuMemSetAccess");
    assert!(d.add_peer(0).unwrap());
    assert!(!d.add_peer(0).unwrap(), "added once");
    assert!(
        !d.accessible_by(0, va, G),
        "old mappings are the caller's to open"
    );
    d.set_peer_access(va, G, 0).unwrap();
    assert!(d.accessible_by(0, va, G));
    d.map(va + G, G, h1).unwrap();
    assert!(
        d.accessible_by(0, va, 2 * G),
        "a new mapping is open to the peer"
    );
    assert!(
        !d.accessible_by(0, va, 3 * G),
        "an unmapped page is nobody's"
    );
    assert_inval(d.set_peer_access(va, 3 * G, 0), "cuMemSetAccess");
    d.unmap(va, 2 * G).unwrap();
    d.phys_release(h0).unwrap();
    d.phys_release(h1).unwrap();
    d.va_release(va, 4 * G).unwrap();
}

#[test]
fn an_exported_handle_imports_as_the_same_memory_until_all_are_released() {
    let d = backed();
    let va = d.va_reserve(2 * G, 0).unwrap();
    let h = d.phys_create(G).unwrap();
    d.map(va, G, h).unwrap();
    d.write(va + 100, b"shared page").unwrap();
    let fd = d.export_handle(h).unwrap();
    assert_eq!(d.export_handle(h).unwrap(), fd, "one descriptor per handle");
    // Another "process" takes its own copy of the descriptor, then imports it.
    let mine = crate::ipc::ProcessFds::open(crate::ipc::this_process())
        .unwrap()
        .take(fd)
        .unwrap();
    assert_inval(
        d.import_handle(mine.as_fd(), 2 * G),
        "cuMemImportFromShareableHandle",
    );
    let imp = d.import_handle(mine.as_fd(), G).unwrap();
    assert_ne!(imp, h);
    assert_inval(d.export_handle(imp), "cuMemExportToShareableHandle");
    d.map(va + G, G, imp).unwrap();
    let mut out = [0u8; 11];
    d.read(va + G + 100, &mut out).unwrap();
    assert_eq!(&out, b"shared page");
    // The owner lets go: the memory stays while the import lives.
    let held = d.reserved().current;
    d.unmap(va, G).unwrap();
    d.phys_release(h).unwrap();
    assert_eq!(d.reserved().current, held, "kept for the import");
    assert_eq!(d.outstanding().phys_handles, 1);
    d.write(va + G, b"still here").unwrap();
    d.unmap(va + G, G).unwrap();
    d.phys_release(imp).unwrap();
    assert_eq!(d.reserved().current, held - G, "gone with the last handle");
    assert_eq!(d.outstanding().phys_handles, 0);
    assert_inval(d.phys_release(imp), "cuMemRelease");
    // A descriptor that is no export of this device.
    let stranger = memfd("not-an-export").unwrap();
    assert_inval(
        d.import_handle(stranger.as_fd(), G),
        "cuMemImportFromShareableHandle",
    );
    d.va_release(va, 2 * G).unwrap();
}

// ---- streams made elsewhere ------------------------------------------------------------------------

#[test]
fn a_stream_handle_not_made_here_is_refused_unless_adopted() {
    let d = dev();
    let e = d.event_create().unwrap();
    assert_inval(d.event_record(e, 0x1234), "cuEventRecord");
    assert_inval(d.stream_wait_event(0x1234, e), "cuStreamWaitEvent");

    let d = SimConfig::new().adopt_streams(true).build().unwrap();
    let e = d.event_create().unwrap();
    // CUDA's legacy-stream handle and an arbitrary one: streams from their first use, ordered as any.
    d.pause_stream(0x1).unwrap();
    d.event_record(e, 0x1).unwrap();
    d.stream_wait_event(0x1234, e).unwrap();
    assert!(d.waits_for_event(0x1234, e));
    d.resume_stream(0x1).unwrap();
    assert!(!d.waits_for_event(0x1234, e));
    // A stream made here never takes a handle adopted before it.
    d.event_record(e, 1).unwrap();
    d.event_record(e, 2).unwrap();
    let made = d.stream_create().unwrap();
    assert!(
        ![0, 1, 2, 0x1234].contains(&made),
        "stream_create handed out {made:#x}"
    );
}

#[test]
fn map_latency_is_spent_on_each_page_map() {
    let lat = std::time::Duration::from_millis(2);
    let d = SimDevice::config().map_latency(lat).build().unwrap();
    let g = d.props().vmm_granularity;
    let va = d.va_reserve(4 * g, g).unwrap();
    let hs: Vec<PhysHandle> = (0..3).map(|_| d.phys_create(g).unwrap()).collect();
    let t0 = std::time::Instant::now();
    d.map_run(va, g, &hs).unwrap();
    assert!(
        t0.elapsed() >= 3 * lat,
        "three pages, three latencies: {:?}",
        t0.elapsed()
    );
    // Unmapped and released as any mapping.
    d.unmap(va, 3 * g).unwrap();
    for h in hs {
        d.phys_release(h).unwrap();
    }
    assert_eq!(d.outstanding().mappings, 0);
}
