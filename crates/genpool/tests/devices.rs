//! Several simulated devices behind one `Pools`: routing by device, frees routed by address (the pointer
//! only), per-device statistics, threads freeing each other's blocks, peer-use ordering, invalid indices.

use std::sync::mpsc;
use std::sync::Arc;

use gen_device::sim::{CallKind, SimDevice, ORDINAL_STRIDE};
use gen_device::{Device, DeviceError};
use genpool::{
    Config, FreeFault, GenpoolError, Hint, Lifetime, MidTier, Pools, StreamId, Tier, ALIGN,
};
use parking_lot::Mutex;

const MIB: u64 = 1 << 20;
const CAP: u64 = 1 << 30;

/// The simulated devices a factory made, by index.
type Made = Arc<Mutex<Vec<Option<Arc<SimDevice>>>>>;

/// `count` simulated devices with disjoint addresses, each also kept in the returned list so a test can
/// drive its streams.
fn sim_pools(count: usize, cfg: Config) -> (Pools, Made) {
    let made = Arc::new(Mutex::new(vec![None; count]));
    let keep = made.clone();
    let pools = Pools::new(count, cfg, move |i| {
        let dev = Arc::new(
            SimDevice::config()
                .ordinal(i)
                .capacity(CAP)
                .address_offset(i as u64 * ORDINAL_STRIDE)
                .build()?,
        );
        keep.lock()[i] = Some(dev.clone());
        Ok(dev as Arc<dyn Device>)
    });
    (pools, made)
}

fn hint(l: Lifetime) -> Hint {
    Hint {
        lifetime: Some(l),
        site: None,
    }
}

#[test]
fn allocations_come_from_the_named_device() {
    let pools = Pools::sim(4, CAP, Config::default());
    assert_eq!(pools.count(), 4);
    // Nothing is created before first use.
    assert!((0..4).all(|d| pools.existing(d).unwrap().is_none()));
    let mut blocks = Vec::new();
    for d in [2usize, 0, 3, 1, 2] {
        for size in [512u64, 3 * MIB] {
            let b = pools.alloc(d, size, 0, Hint::NONE).unwrap();
            assert_eq!(pools.owner(b.ptr), Some(d));
            for other in 0..4 {
                let held = pools
                    .existing(other)
                    .unwrap()
                    .is_some_and(|p| p.lookup(b.ptr).is_some());
                assert_eq!(held, other == d, "block of device {d} in device {other}");
            }
            assert_eq!(pools.pool(d).unwrap().device().props().ordinal, d);
            blocks.push((d, b));
        }
    }
    for d in 0..4 {
        let s = pools.stats(d).unwrap();
        let expect = blocks.iter().filter(|(o, _)| *o == d).count() as u64;
        assert_eq!(s.num_allocs, expect, "device {d}");
        let bytes: u64 = blocks
            .iter()
            .filter(|(o, _)| *o == d)
            .map(|(_, b)| b.size)
            .sum();
        assert_eq!(s.allocated_current, bytes, "device {d}");
    }
}

#[test]
fn frees_are_routed_by_address() {
    let pools = Pools::sim(4, CAP, Config::default());
    let mut blocks = Vec::new();
    for d in 0..4 {
        for (i, l) in [Lifetime::Short, Lifetime::Mid, Lifetime::Long]
            .into_iter()
            .enumerate()
        {
            let size = (i as u64 + 1) * MIB + 512 * d as u64;
            blocks.push((d, pools.alloc(d, size, 0, hint(l)).unwrap()));
        }
    }
    // Free in an order unrelated to the devices, with the pointer only.
    blocks.reverse();
    blocks.rotate_left(5);
    for (d, b) in &blocks {
        let f = pools.free(b.ptr, 0).unwrap();
        assert_eq!((f.device, f.size, f.deferred), (*d, b.size, false));
        assert_eq!(pools.owner(b.ptr), None);
    }
    for d in 0..4 {
        let s = pools.stats(d).unwrap();
        assert_eq!((s.num_allocs, s.num_frees, s.allocated_current), (3, 3, 0));
    }
    // A second free of a freed block is a double free; foreign and null pointers are refused.
    let (_, b) = blocks[0];
    assert_eq!(
        pools.free(b.ptr, 0),
        Err(GenpoolError::InvalidFree {
            ptr: b.ptr,
            fault: FreeFault::DoubleFree
        })
    );
    for (ptr, fault) in [(0xdead_0000u64, FreeFault::Unknown), (0, FreeFault::Null)] {
        assert_eq!(
            pools.free(ptr, 0),
            Err(GenpoolError::InvalidFree { ptr, fault })
        );
    }
    assert_eq!(pools.all_stats().unrouted_frees, 1);
}

#[test]
fn stream_tier_blocks_route_where_ranges_overlap() {
    // Device 1's addresses are only 1 TiB above device 0's: with stream-pool blocks below the VMM
    // ranges, the two devices' address ranges overlap and the owner is found by lookup.
    let cfg = Config {
        mid_tier: MidTier::Stream,
        routing: genpool::Routing::Generational,
        ..Config::default()
    };
    let pools = Pools::new(2, cfg, |i| {
        Ok(Arc::new(
            SimDevice::config()
                .ordinal(i)
                .capacity(CAP)
                .address_offset(i as u64 * (1 << 40))
                .build()?,
        ) as Arc<dyn Device>)
    });
    let mut blocks = Vec::new();
    for d in [0usize, 1] {
        for l in [Lifetime::Mid, Lifetime::Long, Lifetime::Short] {
            blocks.push((d, pools.alloc(d, 2 * MIB, 0, hint(l)).unwrap()));
        }
    }
    assert!(blocks.iter().any(|(_, b)| b.tier == Tier::Stream));
    for (d, b) in &blocks {
        assert_eq!(pools.owner(b.ptr), Some(*d));
    }
    for (d, b) in blocks.iter().rev() {
        assert_eq!(pools.free(b.ptr, 0).unwrap().device, *d);
    }
    assert_eq!(pools.stats(0).unwrap().allocated_current, 0);
    assert_eq!(pools.stats(1).unwrap().allocated_current, 0);
}

#[test]
fn invalid_devices_give_clean_errors() {
    let pools = Pools::sim(4, CAP, Config::default());
    let invalid = |ordinal| GenpoolError::InvalidDevice { ordinal, count: 4 };
    assert_eq!(pools.alloc(4, 512, 0, Hint::NONE).unwrap_err(), invalid(4));
    assert_eq!(
        pools.alloc(usize::MAX, 512, 0, Hint::NONE).unwrap_err(),
        invalid(usize::MAX)
    );
    assert_eq!(pools.pool(9).unwrap_err(), invalid(9));
    assert_eq!(pools.existing(4).unwrap_err(), invalid(4));
    assert_eq!(pools.stats(5).unwrap_err(), invalid(5));
    let b = pools.alloc(3, 512, 0, Hint::NONE).unwrap();
    assert_eq!(pools.record_use(b.ptr, 4, 0).unwrap_err(), invalid(4));
    // Nothing changed: the block frees normally.
    assert_eq!(pools.free(b.ptr, 0).unwrap().device, 3);
    assert_eq!(
        GenpoolError::InvalidDevice {
            ordinal: 4,
            count: 4
        }
        .to_string(),
        "invalid device 4: 4 device(s) present"
    );
    let none = Pools::sim(0, CAP, Config::default());
    assert_eq!(
        none.alloc(0, 512, 0, Hint::NONE).unwrap_err(),
        GenpoolError::InvalidDevice {
            ordinal: 0,
            count: 0
        }
    );
}

#[test]
fn a_device_that_fails_to_open_fails_alone() {
    let pools = Pools::new(3, Config::default(), |i| {
        if i == 1 {
            Err(DeviceError::InvalidDevice {
                ordinal: i,
                count: 1,
            })
        } else {
            Ok(Arc::new(
                SimDevice::config()
                    .ordinal(i)
                    .capacity(CAP)
                    .address_offset(i as u64 * ORDINAL_STRIDE)
                    .build()?,
            ) as Arc<dyn Device>)
        }
    });
    for _ in 0..2 {
        assert_eq!(
            pools.alloc(1, 512, 0, Hint::NONE).unwrap_err(),
            GenpoolError::from(DeviceError::InvalidDevice {
                ordinal: 1,
                count: 1
            })
        );
    }
    assert!(pools.existing(1).unwrap().is_none());
    let b = pools.alloc(2, 512, 0, Hint::NONE).unwrap();
    assert_eq!(pools.free(b.ptr, 0).unwrap().device, 2);
    assert_eq!(pools.all_stats().devices[1], None);
}

#[test]
fn threads_free_each_others_blocks() {
    const DEVICES: usize = 4;
    let rounds: usize = if cfg!(miri) { 8 } else { 400 };
    let pools = Arc::new(Pools::sim(DEVICES, CAP, Config::default()));
    let (senders, receivers): (Vec<_>, Vec<_>) = (0..DEVICES)
        .map(|_| mpsc::channel::<(usize, u64)>())
        .unzip();
    let handles: Vec<_> = receivers
        .into_iter()
        .enumerate()
        .map(|(t, rx)| {
            let pools = pools.clone();
            // Thread t allocates on device t and hands every block to thread t + 1.
            let tx = senders[(t + 1) % DEVICES].clone();
            std::thread::spawn(move || {
                let mut freed = 0usize;
                for i in 0..rounds {
                    let size = [512u64, 4096, 3 * MIB][i % 3] + (t as u64) * ALIGN;
                    let stream: StreamId = 0;
                    let b = pools.alloc(t, size, stream, Hint::NONE).unwrap();
                    tx.send((t, b.ptr)).unwrap();
                    while let Ok((owner, ptr)) = rx.try_recv() {
                        assert_eq!(pools.free(ptr, 0).unwrap().device, owner);
                        freed += 1;
                    }
                }
                drop(tx);
                (freed, rx)
            })
        })
        .collect();
    drop(senders);
    let mut left = Vec::new();
    let mut freed = 0;
    for h in handles {
        let (n, rx) = h.join().unwrap();
        freed += n;
        left.push(rx);
    }
    for rx in left {
        for (owner, ptr) in rx.iter() {
            assert_eq!(pools.free(ptr, 0).unwrap().device, owner);
            freed += 1;
        }
    }
    assert_eq!(freed, DEVICES * rounds);
    for d in 0..DEVICES {
        let s = pools.stats(d).unwrap();
        assert_eq!(s.num_allocs, rounds as u64, "device {d}");
        assert_eq!(s.num_frees, rounds as u64, "device {d}");
        assert_eq!(s.allocated_current, 0, "device {d}");
        assert_eq!(s.num_invalid_frees, 0, "device {d}");
    }
}

#[test]
fn a_peer_use_holds_the_block_until_its_work_is_done() {
    let (pools, devs) = sim_pools(2, Config::default());
    let b = pools.alloc(0, 3 * MIB, 0, hint(Lifetime::Short)).unwrap();
    pools.pool(1).unwrap();
    let peer = devs.lock()[1].clone().unwrap();
    let peer_stream = peer.stream_create().unwrap();
    pools.record_use(b.ptr, 1, peer_stream).unwrap();
    // A kernel on the peer is still reading the block.
    peer.pause_stream(peer_stream).unwrap();
    let f = pools.free(b.ptr, 0).unwrap();
    assert_eq!((f.device, f.size, f.deferred), (0, b.size, true));
    // Held back: still live in its pool, not reusable, and a second free is a double free.
    assert_eq!(pools.stats(0).unwrap().allocated_current, b.size);
    assert_eq!(pools.poll_deferred(), 0);
    assert_eq!(
        pools.free(b.ptr, 0).unwrap_err(),
        GenpoolError::InvalidFree {
            ptr: b.ptr,
            fault: FreeFault::DoubleFree
        }
    );
    assert!(pools.record_use(b.ptr, 1, peer_stream).is_err());
    let other = pools.alloc(0, 3 * MIB, 0, hint(Lifetime::Short)).unwrap();
    assert_ne!(other.ptr, b.ptr, "reused while the peer still uses it");
    let s = pools.all_stats();
    assert_eq!((s.deferred_frees, s.deferred_pending), (1, 1));
    // Waiting cannot succeed while the peer's stream is stalled: an error, and the block stays held.
    assert!(pools.flush_deferred().is_err());
    assert_eq!(pools.all_stats().deferred_pending, 1);
    // The kernel finishes: the next call releases the block.
    peer.resume_stream(peer_stream).unwrap();
    pools.free(other.ptr, 0).unwrap();
    assert_eq!(pools.all_stats().deferred_pending, 0);
    let s = pools.stats(0).unwrap();
    assert_eq!((s.num_frees, s.allocated_current), (2, 0));
}

#[test]
fn a_use_on_another_stream_of_the_owner_orders_the_free() {
    let (pools, devs) = sim_pools(2, Config::default());
    let b = pools.alloc(1, 4096, 0, Hint::NONE).unwrap();
    let dev = devs.lock()[1].clone().unwrap();
    let side = dev.stream_create().unwrap();
    pools.record_use(b.ptr, 1, side).unwrap();
    pools.record_use(b.ptr, 1, side).unwrap();
    // A use on the free's own stream needs nothing.
    pools.record_use(b.ptr, 1, 0).unwrap();
    let f = pools.free(b.ptr, 0).unwrap();
    assert_eq!((f.device, f.deferred), (1, false));
    // `side` is idle: asked once, neither waited for nor held.
    let s = pools.all_stats();
    assert_eq!((s.stream_waits, s.deferred_frees, s.use_queries), (0, 0, 1));
    assert_eq!(pools.stats(1).unwrap().allocated_current, 0);
    // Recording a use of something that is not a live block is refused.
    assert_eq!(
        pools.record_use(b.ptr, 0, 0).unwrap_err(),
        GenpoolError::InvalidFree {
            ptr: b.ptr,
            fault: FreeFault::Unknown
        }
    );
}

#[test]
fn open_sim_gives_disjoint_devices() {
    let pools = Pools::open(gen_device::DeviceKind::Sim, 3, Config::default());
    let ptrs: Vec<u64> = (0..3)
        .map(|d| pools.alloc(d, MIB, 0, Hint::NONE).unwrap().ptr)
        .collect();
    for (d, &p) in ptrs.iter().enumerate() {
        assert_eq!(pools.owner(p), Some(d));
        assert_eq!(pools.free(p, 0).unwrap().device, d);
    }
}

/// Devices opened by kind serve callers whose streams come from elsewhere (the plug-in's: PyTorch makes
/// them with CUDA): on the simulator a stream handle it never made is a stream from its first use, and
/// blocks handed between such streams are ordered as between any two.
#[test]
fn open_sim_takes_the_callers_streams() {
    let pools = Pools::open(gen_device::DeviceKind::Sim, 1, Config::default());
    let (s1, s2) = (0x1, 0x7f00_1234_5600);
    // Each stream's blocks freed on it and cut again for the other stream, which must then wait for it.
    let mut n = 0;
    for round in 0..4u64 {
        for (a, b) in [(s1, s2), (s2, s1)] {
            let x = pools.alloc(0, (24 + round) * MIB, a, Hint::NONE).unwrap();
            pools.free(x.ptr, a).unwrap();
            let y = pools.alloc(0, (24 + round) * MIB, b, Hint::NONE).unwrap();
            pools.free(y.ptr, b).unwrap();
            n += 2;
        }
    }
    let st = pools.pool(0).unwrap().stats();
    assert_eq!(
        (st.allocated_current, st.num_allocs, st.num_frees),
        (0, n, n)
    );
}

#[test]
fn secondary_engines_keep_their_blocks_and_free_by_address() {
    let pools = Pools::sim(2, CAP, Config::default());
    assert!(pools.engines(1).unwrap().is_empty());
    let a = pools.add_engine(1, 7).unwrap();
    // The device's default engine came first; asking again gives the same engine.
    assert!(pools.existing(1).unwrap().is_some());
    assert!(Arc::ptr_eq(&a, &pools.add_engine(1, 7).unwrap()));
    let b = pools.add_engine(1, 9).unwrap();
    assert_eq!(pools.engines(1).unwrap().len(), 2);
    let default = pools.alloc(1, 3 * MIB, 0, Hint::NONE).unwrap();
    let in_a = a.alloc(3 * MIB, 0, Hint::NONE).unwrap();
    let in_b = b.alloc(512, 0, Hint::NONE).unwrap();
    // Each engine's blocks are its own: the default engine and the other engine do not hold them.
    let default_pool = pools.pool(1).unwrap();
    assert!(default_pool.lookup(in_a.ptr).is_none());
    assert!(b.pool().lookup(in_a.ptr).is_none());
    assert_eq!(a.pool().lookup(in_a.ptr).map(|x| x.size), Some(in_a.size));
    for (ptr, engine) in [(in_a.ptr, 7), (in_b.ptr, 9), (default.ptr, 0)] {
        assert_eq!(pools.owner(ptr), Some(1));
        assert_eq!(pools.lookup(ptr).map(|(d, e, _)| (d, e)), Some((1, engine)));
    }
    // Released with a block live: no longer found for allocation, dropped with its last block.
    assert!(pools.release_engine(1, 7).unwrap());
    assert!(!pools.release_engine(1, 7).unwrap(), "released twice");
    assert!(pools.engine(1, 7).unwrap().is_none());
    assert_eq!(
        pools.engines(1).unwrap().len(),
        2,
        "kept while a block lives"
    );
    let f = pools.free(in_a.ptr, 0).unwrap();
    assert_eq!((f.device, f.engine, f.size), (1, 7, in_a.size));
    assert_eq!(
        pools
            .engines(1)
            .unwrap()
            .iter()
            .map(|e| e.id())
            .collect::<Vec<_>>(),
        vec![9]
    );
    assert_eq!(a.pool().live_blocks(), 0);
    // The owned free: the allocation's stream, and what the block was.
    let (f, live) = pools.free_owned(in_b.ptr).unwrap();
    assert_eq!((f.device, f.engine), (1, 9));
    assert_eq!(
        (live.ptr, live.size, live.requested, live.stream),
        (in_b.ptr, 512, 512, 0)
    );
    assert_eq!(
        pools.free(in_b.ptr, 0).unwrap_err(),
        GenpoolError::InvalidFree {
            ptr: in_b.ptr,
            fault: FreeFault::DoubleFree
        },
        "a second free of an engine's block is its engine's double free"
    );
    // A wrong guess costs nothing: the block is found by address.
    assert_eq!(pools.free_near(default.ptr, 0, 0).unwrap().device, 1);
    assert_eq!(
        pools.free_near(default.ptr, 0, 0).unwrap_err(),
        GenpoolError::InvalidFree {
            ptr: default.ptr,
            fault: FreeFault::DoubleFree
        }
    );
    assert_eq!(pools.stats(1).unwrap().num_frees, 1);
}

#[test]
fn recorded_uses_order_frees_of_engine_blocks_and_fall_back_to_synchronize() {
    // `record_stream:wait`: the free's stream waits on the device (the default holds the block).
    let (pools, devs) = sim_pools(1, Config::parse("record_stream:wait").unwrap());
    let e = pools.add_engine(0, 3).unwrap();
    let dev = devs.lock()[0].clone().unwrap();
    let (s1, s2) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
    let b = e.alloc(MIB, s1, Hint::NONE).unwrap();
    pools.record_use(b.ptr, 0, s2).unwrap();
    assert_eq!(pools.recorded_blocks(), 1);
    dev.pause_stream(s2).unwrap();
    let before = dev.calls();
    // The owned free is ordered on the block's own stream, s1, after s2's work.
    let (f, _) = pools.free_owned(b.ptr).unwrap();
    assert_eq!((f.engine, f.deferred), (3, false));
    let delta = dev.calls().since(&before);
    assert_eq!(delta[CallKind::StreamWaitEvent], 1);
    assert!(
        dev.stream_synchronize(s1).is_err(),
        "s1 waits for paused s2"
    );
    dev.resume_stream(s2).unwrap();
    dev.stream_synchronize(s1).unwrap();
    assert_eq!(
        (pools.ordering(0).unwrap(), pools.recorded_blocks()),
        ((1, 0), 0)
    );
    // An event call that fails: the device is synchronized instead, and the block is freed.
    let c = pools.alloc(0, 4096, s1, Hint::NONE).unwrap();
    pools.record_use(c.ptr, 0, s2).unwrap();
    dev.fail_next(CallKind::EventRecord);
    let before = dev.calls();
    pools.free(c.ptr, s1).unwrap();
    assert_eq!(dev.calls().since(&before)[CallKind::Synchronize], 1);
    assert_eq!(pools.ordering(0).unwrap(), (1, 1));
    let s = pools.all_stats();
    assert_eq!(
        (s.stream_waits, s.sync_fallbacks, s.recorded_blocks),
        (1, 1, 0)
    );
    assert_eq!(pools.stats(0).unwrap().allocated_current, 0);
}

/// A router over one simulated device under the default configuration, and two of its streams (the
/// router boxed: it is ~340 KB, and a test thread's stack holds few copies of it).
fn two_streams() -> (Box<Pools>, Arc<SimDevice>, u64, u64) {
    let (pools, devs) = sim_pools(1, Config::default());
    let pools = Box::new(pools);
    pools.pool(0).unwrap();
    let dev = devs.lock()[0].clone().unwrap();
    let (s1, s2) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
    (pools, dev, s1, s2)
}

/// Stream questions, event records and stream waits among the calls `delta` counts.
fn ordering_calls(delta: &gen_device::sim::SimCalls) -> (u64, u64, u64) {
    (
        delta[CallKind::StreamQuery],
        delta[CallKind::EventRecord],
        delta[CallKind::StreamWaitEvent],
    )
}

/// PyTorch's own rule for `record_stream` (the default, `record_stream:hold`): a block used on a busy
/// stream of its device is held out of reuse until an event recorded there at its free completes — the
/// freeing stream never waits for the using one, so the two keep overlapping.
#[test]
fn a_block_used_on_a_busy_stream_is_held_until_that_streams_work_is_done() {
    let (pools, dev, s1, s2) = two_streams();
    let b = pools.alloc(0, 8 * MIB, s1, Hint::NONE).unwrap();
    pools.record_use(b.ptr, 0, s2).unwrap();
    dev.pause_stream(s2).unwrap(); // a kernel on s2 still reads the block
    let before = dev.calls();
    let f = pools.free(b.ptr, s1).unwrap();
    assert!(f.deferred, "held back, not freed");
    let delta = dev.calls().since(&before);
    assert_eq!(
        ordering_calls(&delta),
        (1, 1, 0),
        "asked, an event recorded on s2, no stream made to wait"
    );
    dev.stream_synchronize(s1)
        .expect("s1 does not wait for s2: the streams still overlap");
    assert_eq!(pools.stats(0).unwrap().allocated_current, 8 * MIB);
    assert_eq!(
        pools.free(b.ptr, s1).unwrap_err(),
        GenpoolError::InvalidFree {
            ptr: b.ptr,
            fault: FreeFault::DoubleFree
        },
        "a held block freed again is a double free"
    );
    // While s2 runs, a block of the same size does not get its bytes.
    let c = pools.alloc(0, 8 * MIB, s1, Hint::NONE).unwrap();
    assert!(
        c.ptr + c.size <= b.ptr || b.ptr + b.size <= c.ptr,
        "the held block's bytes were handed out while s2 could still use them"
    );
    assert_eq!(pools.all_stats().deferred_pending, 1);
    // s2's work done: a later call (past the poll's backoff, at most 64 µs) releases the block.
    dev.resume_stream(s2).unwrap();
    dev.stream_synchronize(s2).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1));
    pools.free(c.ptr, s1).unwrap();
    let st = pools.all_stats();
    assert_eq!(
        (
            st.deferred_pending,
            st.deferred_frees,
            st.stream_waits,
            st.use_queries
        ),
        (0, 1, 0, 1)
    );
    assert_eq!(pools.stats(0).unwrap().allocated_current, 0);
    let d = pools.alloc(0, 8 * MIB, s1, Hint::NONE).unwrap();
    assert_eq!(d.ptr, b.ptr, "released: best fit takes its bytes again");
    pools.free(d.ptr, s1).unwrap();
}

/// A stream of the uses that is idle at the free needs neither a hold nor a wait: one question.
#[test]
fn a_block_whose_using_stream_is_idle_is_freed_at_once() {
    let (pools, dev, s1, s2) = two_streams();
    let b = pools.alloc(0, 8 * MIB, s1, Hint::NONE).unwrap();
    pools.record_use(b.ptr, 0, s2).unwrap();
    pools.record_use(b.ptr, 0, s1).unwrap(); // its own stream: nothing to order
    let before = dev.calls();
    let f = pools.free(b.ptr, s1).unwrap();
    assert!(!f.deferred);
    let delta = dev.calls().since(&before);
    assert_eq!(ordering_calls(&delta), (1, 0, 0));
    let d = pools.alloc(0, 8 * MIB, s1, Hint::NONE).unwrap();
    assert_eq!(d.ptr, b.ptr);
    // A failed question is taken as busy: the block is held on an event instead.
    pools.record_use(d.ptr, 0, s2).unwrap();
    dev.fail_next(CallKind::StreamQuery);
    assert!(pools.free(d.ptr, s1).unwrap().deferred);
    assert_eq!(pools.flush_deferred().unwrap(), 1);
    assert_eq!(pools.stats(0).unwrap().allocated_current, 0);
}

/// During a capture no event may be polled: a free of a block used on another stream is ordered by a
/// wait the graph records, blocks held before the capture stay held (no query), and a call after it
/// releases them.
#[test]
fn during_a_capture_a_recorded_use_is_waited_for_and_nothing_is_polled() {
    let (pools, dev, s1, s2) = two_streams();
    let held = pools.alloc(0, 4 * MIB, s1, Hint::NONE).unwrap();
    pools.record_use(held.ptr, 0, s2).unwrap();
    dev.pause_stream(s2).unwrap();
    assert!(pools.free(held.ptr, s1).unwrap().deferred);
    let b = pools.alloc(0, MIB, s1, Hint::NONE).unwrap();
    pools.record_use(b.ptr, 0, s2).unwrap();
    dev.begin_capture(s1).unwrap();
    dev.captures().begin();
    let before = dev.calls();
    let f = pools.free(b.ptr, s1).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1));
    let c = pools.alloc(0, MIB, s1, Hint::NONE).unwrap();
    let delta = dev.calls().since(&before);
    assert!(!f.deferred, "ordered by a wait during a capture");
    assert_eq!(
        (
            delta[CallKind::StreamWaitEvent],
            delta[CallKind::EventQuery],
            delta[CallKind::StreamQuery]
        ),
        (1, 0, 0)
    );
    assert_eq!(pools.all_stats().deferred_pending, 1, "still held");
    assert!(dev.captures().end());
    dev.end_capture()
        .expect("the capture stayed valid: no forbidden call");
    dev.resume_stream(s2).unwrap();
    dev.stream_synchronize(s2).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1));
    pools.free(c.ptr, s1).unwrap();
    assert_eq!(pools.all_stats().deferred_pending, 0, "released after it");
}

/// A router in a `static`, as the PyTorch plug-in keeps one: simulated devices, fixed capacity.
struct SimOpener;

impl genpool::Opener for SimOpener {
    type Error = GenpoolError;

    fn open(&self, index: usize) -> Result<genpool::Pool, GenpoolError> {
        let dev = SimDevice::config()
            .ordinal(index)
            .capacity(CAP)
            .address_offset(index as u64 * ORDINAL_STRIDE)
            .build()?;
        genpool::Pool::new(Arc::new(dev), Config::default())
    }
}

static STATIC_ROUTER: Pools<SimOpener> = Pools::with_opener(SimOpener);

#[test]
fn a_router_in_a_static_opens_lazily_and_honours_its_count() {
    assert_eq!(STATIC_ROUTER.count(), genpool::MAX_DEVICES);
    assert_eq!(STATIC_ROUTER.existing_pools().count(), 0);
    let b = STATIC_ROUTER.alloc(5, MIB, 0, Hint::NONE).unwrap();
    assert_eq!(
        STATIC_ROUTER
            .existing_pools()
            .map(|(d, _)| d)
            .collect::<Vec<_>>(),
        vec![5]
    );
    STATIC_ROUTER.set_count(2);
    assert_eq!(
        STATIC_ROUTER.alloc(5, MIB, 0, Hint::NONE).unwrap_err(),
        GenpoolError::InvalidDevice {
            ordinal: 5,
            count: 2
        }
    );
    // Blocks of a device past the new count are still freed.
    assert_eq!(STATIC_ROUTER.free(b.ptr, 0).unwrap().device, 5);
}

#[test]
fn an_engine_can_be_built_with_its_own_configuration() {
    let pools = Pools::sim(1, CAP, Config::default());
    let e = pools
        .add_engine_with(0, 4, |main| {
            let cfg = Config {
                plan: false,
                ..main.config().clone()
            };
            genpool::Pool::new(main.device().clone(), cfg)
        })
        .unwrap();
    assert!(!e.pool().config().plan);
    assert!(
        pools.pool(0).unwrap().config().plan,
        "the default engine keeps its own"
    );
    // Asked again, by either call: the same engine.
    assert!(Arc::ptr_eq(&e, &pools.add_engine(0, 4).unwrap()));
    // A released engine with no block is dropped at once; sweeping finds nothing left.
    assert!(pools.release_engine(0, 4).unwrap());
    pools.sweep_released(0).unwrap();
    assert!(pools.engines(0).unwrap().is_empty());
}
