//! `StreamCache` on the simulated device: the stream rules, the one-stream shortcut, drains, bounds and
//! a multi-thread stress test.

use std::collections::HashMap;
use std::sync::Arc;

use gen_device::sim::{CallKind, SimDevice};
use gen_device::{Device, EventHandle, StreamId};
use gen_stream::{Overflow, StreamCache, StreamCacheConfig};
use parking_lot::Mutex;

const KB4: u64 = 4096;

fn sim() -> Arc<SimDevice> {
    Arc::new(SimDevice::new())
}

fn cache(dev: &Arc<SimDevice>, cfg: StreamCacheConfig) -> StreamCache {
    StreamCache::new(dev.clone() as Arc<dyn Device>, cfg)
}

/// Queue work on `s` that stays incomplete while `s` is paused: a kernel still using what is freed.
fn busy(dev: &SimDevice, ev: EventHandle, s: StreamId) {
    dev.event_record(ev, s).unwrap();
}

/// Puts the cache in multi-stream mode with nothing cached (no shortcut sync involved).
fn see_streams(c: &StreamCache, streams: &[StreamId]) {
    for &s in streams {
        assert_eq!(c.take(1, s), None);
    }
}

#[test]
fn same_stream_reuse_is_immediate_even_while_the_stream_is_busy() {
    let dev = sim();
    let s = dev.stream_create().unwrap();
    let ev = dev.event_create().unwrap();
    let c = cache(&dev, StreamCacheConfig::default());
    dev.pause_stream(s).unwrap();
    busy(&dev, ev, s);
    c.put(0x1000, KB4, s).unwrap();
    c.put(0x2000, 2 * KB4, s).unwrap();
    assert_eq!(c.cached_bytes(), 3 * KB4);
    assert_eq!(c.take(KB4, s), Some(0x1000));
    assert_eq!(c.take(KB4, s), None, "exact size only");
    assert_eq!(c.take(2 * KB4, s), Some(0x2000));
    assert_eq!(c.cached_bytes(), 0);
    let st = c.stats();
    assert_eq!((st.hits, st.misses, st.puts), (2, 1, 2));
    dev.resume_stream(s).unwrap();
}

#[test]
fn one_stream_fast_path_issues_no_device_calls() {
    let dev = sim();
    let s = dev.stream_create().unwrap();
    let c = cache(&dev, StreamCacheConfig::default());
    let before = dev.calls();
    for round in 0..100u64 {
        for i in 0..8u64 {
            let size = KB4 << (i % 4);
            if c.take(size, s).is_none() {
                c.put(0x10_0000 * (i + 1) + round, size, s).unwrap();
            } else {
                c.put(0x10_0000 * (i + 1), size, s).unwrap();
            }
        }
    }
    let calls = dev.calls().since(&before);
    assert_eq!(calls.total(), 0, "no events, no syncs: {calls:?}");
    let st = c.stats();
    assert_eq!(st.events_recorded + st.event_queries + st.syncs, 0);
}

#[test]
fn second_stream_syncs_once_and_then_reuses_without_events() {
    let dev = sim();
    let (a, b) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
    let c = cache(&dev, StreamCacheConfig::default());
    for i in 0..4u64 {
        c.put(0x1000 * (i + 1), KB4, a).unwrap();
    }
    let before = dev.calls();
    for _ in 0..4 {
        assert!(c.take(KB4, b).is_some());
    }
    let calls = dev.calls().since(&before);
    assert_eq!(calls[CallKind::Synchronize], 1);
    assert_eq!(calls[CallKind::EventRecord], 0);
    assert_eq!(c.stats().syncs, 1);
    // Later second-stream sightings cost nothing more.
    c.put(0x9000, KB4, b).unwrap();
    assert_eq!(c.take(KB4, b), Some(0x9000));
    assert_eq!(dev.calls().since(&before)[CallKind::Synchronize], 1);
}

#[test]
fn block_freed_on_paused_stream_reaches_other_stream_only_after_resume() {
    let dev = sim();
    let (s, t) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
    let ev = dev.event_create().unwrap();
    let c = cache(&dev, StreamCacheConfig::default());
    see_streams(&c, &[s, t]);
    dev.pause_stream(s).unwrap();
    busy(&dev, ev, s); // a kernel on s still uses the blocks
    c.put(0xA000, KB4, s).unwrap();
    c.put(0xB000, KB4, s).unwrap();

    assert_eq!(c.take(KB4, t), None, "s has not finished with it");
    let st = c.stats();
    assert_eq!(
        (st.migrations, st.migrated_blocks, st.events_recorded),
        (1, 2, 1)
    );
    // A second miss queries the batch but records no new event.
    assert_eq!(c.take(KB4, t), None);
    assert_eq!(c.stats().events_recorded, 1);
    // s itself may still reuse them at once: stream order.
    assert_eq!(c.take(KB4, s), Some(0xB000));
    c.put(0xB000, KB4, s).unwrap();

    dev.resume_stream(s).unwrap();
    let got = c.take(KB4, t).expect("event completed");
    assert_eq!(got, 0xA000, "the migrated batch");
    let got2 = c.take(KB4, t).expect("0xB000 migrates now that s is idle");
    assert_eq!(got2, 0xB000);
    assert_eq!(c.cached_bytes(), 0);
}

#[test]
fn shortcut_sync_failing_falls_back_to_events() {
    let dev = sim();
    let (s, t) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
    let ev = dev.event_create().unwrap();
    let c = cache(&dev, StreamCacheConfig::default());
    dev.pause_stream(s).unwrap();
    busy(&dev, ev, s);
    c.put(0xA000, KB4, s).unwrap(); // one stream seen: no event
    assert_eq!(
        dev.calls()[CallKind::EventRecord],
        1,
        "only the test's own record"
    );
    // t appears: the synchronize cannot complete (the sim reports it instead of hanging).
    assert_eq!(c.take(KB4, t), None);
    let st = c.stats();
    assert_eq!((st.syncs, st.device_errors, st.migrations), (1, 1, 1));
    assert!(c.take_last_error().is_some());
    dev.resume_stream(s).unwrap();
    assert_eq!(c.take(KB4, t), Some(0xA000));
}

#[test]
fn shortcut_can_be_turned_off() {
    let dev = sim();
    let (a, b) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
    let cfg = StreamCacheConfig {
        single_stream_sync: false,
        ..StreamCacheConfig::default()
    };
    let c = cache(&dev, cfg);
    c.put(0x1000, KB4, a).unwrap();
    assert_eq!(c.take(KB4, b), Some(0x1000));
    let st = c.stats();
    assert_eq!((st.syncs, st.events_recorded, st.migrations), (0, 1, 1));
}

#[test]
fn migration_skips_a_busy_stream_for_an_idle_one() {
    let dev = sim();
    let (s, u, t) = (
        dev.stream_create().unwrap(),
        dev.stream_create().unwrap(),
        dev.stream_create().unwrap(),
    );
    let ev = dev.event_create().unwrap();
    let c = cache(&dev, StreamCacheConfig::default());
    see_streams(&c, &[s, u, t]);
    dev.pause_stream(s).unwrap();
    busy(&dev, ev, s);
    c.put(0xA000, KB4, s).unwrap();
    c.put(0xB000, KB4, u).unwrap();
    assert_eq!(c.take(KB4, t), Some(0xB000));
    assert_eq!(c.stats().migrations, 2);
    dev.resume_stream(s).unwrap();
    assert_eq!(c.take(KB4, t), Some(0xA000));
}

#[test]
fn drain_makes_everything_safe_first() {
    let dev = sim();
    let (s, t) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
    let ev = dev.event_create().unwrap();
    let c = cache(&dev, StreamCacheConfig::default());
    see_streams(&c, &[s, t]);
    dev.pause_stream(s).unwrap();
    busy(&dev, ev, s);
    c.put(0xA000, KB4, s).unwrap();
    c.put(0xB000, KB4, s).unwrap();
    assert_eq!(c.take(KB4, t), None); // both now in a pending batch
    c.put(0xC000, 2 * KB4, s).unwrap(); // ready on s
    c.put(0xD000, KB4, t).unwrap(); // ready on t (idle)

    // s cannot be made idle: its blocks stay, t's come back.
    let mut got = Vec::new();
    let err = c.drain(&mut |p, size| got.push((p, size))).unwrap_err();
    assert!(err.to_string().contains("cuStreamSynchronize"), "{err}");
    assert_eq!(got, vec![(0xD000, KB4)]);
    assert_eq!(c.cached_bytes(), 4 * KB4);

    dev.resume_stream(s).unwrap();
    let before = dev.calls();
    got.clear();
    let bytes = c.drain(&mut |p, size| got.push((p, size))).unwrap();
    got.sort_unstable();
    assert_eq!(got, vec![(0xA000, KB4), (0xB000, KB4), (0xC000, 2 * KB4)]);
    assert_eq!(bytes, 4 * KB4);
    assert_eq!(c.cached_bytes(), 0);
    assert_eq!(dev.calls().since(&before)[CallKind::StreamSynchronize], 1);
    assert_eq!(c.stats().cached_blocks, 0);
    // Recycled events serve later migrations: no new event is created.
    c.put(0xE000, KB4, s).unwrap();
    let created = dev.calls()[CallKind::EventCreate];
    assert_eq!(c.take(KB4, t), Some(0xE000));
    assert_eq!(dev.calls()[CallKind::EventCreate], created);
}

#[test]
fn drain_unsynced_reports_the_stream_still_using_each_block() {
    let dev = sim();
    let (s, t) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
    let c = cache(&dev, StreamCacheConfig::default());
    c.put(0xA000, KB4, s).unwrap();
    assert_eq!(c.take(KB4 * 2, t), None); // shortcut: 0xA000 becomes safe everywhere
    c.put(0xB000, KB4, t).unwrap();
    let before = dev.calls();
    let mut got = Vec::new();
    let bytes = c.drain_unsynced(&mut |p, size, st| got.push((p, size, st)));
    got.sort_unstable();
    assert_eq!(got, vec![(0xA000, KB4, None), (0xB000, KB4, Some(t))]);
    assert_eq!(bytes, 2 * KB4);
    assert_eq!(dev.calls().since(&before).total(), 0);
}

#[test]
fn bound_refuses_and_recovers() {
    let dev = sim();
    let s = dev.stream_create().unwrap();
    let c = cache(
        &dev,
        StreamCacheConfig {
            max_cached_bytes: 2 * KB4,
            ..StreamCacheConfig::default()
        },
    );
    c.put(0x1000, KB4, s).unwrap();
    c.put(0x2000, KB4, s).unwrap();
    assert_eq!(
        c.put(0x3000, 1, s),
        Err(Overflow {
            size: 1,
            cached: 2 * KB4,
            max: 2 * KB4
        })
    );
    assert_eq!(c.put(0x3000, u64::MAX, s).unwrap_err().size, u64::MAX);
    assert_eq!(c.cached_bytes(), 2 * KB4);
    assert!(c.take(KB4, s).is_some());
    c.put(0x3000, KB4, s).unwrap();
    assert_eq!(c.stats().overflows, 2);
}

#[test]
fn drop_destroys_every_event() {
    let dev = sim();
    let (s, t) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
    let ev = dev.event_create().unwrap();
    {
        let c = cache(&dev, StreamCacheConfig::default());
        see_streams(&c, &[s, t]);
        dev.pause_stream(s).unwrap();
        busy(&dev, ev, s);
        c.put(0xA000, KB4, s).unwrap();
        assert_eq!(c.take(KB4, t), None); // one event in a pending batch
        assert_eq!(dev.outstanding().events, 2);
    }
    assert_eq!(
        dev.outstanding().events,
        1,
        "only the test's own event is left"
    );
    dev.resume_stream(s).unwrap();
}

#[test]
fn many_sizes_are_pruned_and_counted() {
    let dev = sim();
    let s = dev.stream_create().unwrap();
    let c = cache(
        &dev,
        StreamCacheConfig {
            shards: 1,
            ..StreamCacheConfig::default()
        },
    );
    // Ever-new sizes: each put is taken back at once, so empty entries pile up and get pruned.
    for i in 1..=2000u64 {
        c.put(i << 20, i * 512, s).unwrap();
        assert_eq!(c.take(i * 512, s), Some(i << 20));
    }
    c.put(0x1, 512, s).unwrap();
    let st = c.stats();
    assert_eq!((st.cached_blocks, st.cached_bytes), (1, 512));
}

/// Threads on their own streams put and take a shared population of blocks; every block must be held
/// by at most one owner at a time, and nothing may be lost.
#[test]
fn stress_many_threads_many_streams() {
    const THREADS: u64 = 4;
    const PER_THREAD: u64 = 64;
    let rounds: u64 = if cfg!(miri) { 50 } else { 5_000 };
    let dev = sim();
    let c = Arc::new(cache(&dev, StreamCacheConfig::default()));
    let sizes = [512u64, 4096, 65536];
    // Owner of each block: None = cached.
    let owner: Arc<Mutex<HashMap<u64, Option<u64>>>> = Arc::new(Mutex::new(HashMap::new()));
    let streams: Vec<StreamId> = (0..THREADS).map(|_| dev.stream_create().unwrap()).collect();
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let (c, owner, stream) = (c.clone(), owner.clone(), streams[t as usize]);
            std::thread::spawn(move || {
                let mut held: Vec<(u64, u64)> = (0..PER_THREAD)
                    .map(|i| {
                        let p = ((t + 1) << 32) | (i << 12);
                        owner.lock().insert(p, Some(t));
                        (p, sizes[(i % 3) as usize])
                    })
                    .collect();
                let mut x = t.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
                for _ in 0..rounds {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    if x % 2 == 0 && !held.is_empty() {
                        let (p, size) = held.swap_remove((x as usize / 2) % held.len());
                        let prev = owner.lock().insert(p, None);
                        assert_eq!(prev, Some(Some(t)));
                        c.put(p, size, stream).unwrap();
                    } else {
                        let size = sizes[(x as usize / 2) % 3];
                        if let Some(p) = c.take(size, stream) {
                            let prev = owner.lock().insert(p, Some(t));
                            assert_eq!(prev, Some(None), "block {p:#x} handed out twice");
                            held.push((p, size));
                        }
                    }
                }
                held
            })
        })
        .collect();
    let mut held_total = 0u64;
    for h in handles {
        held_total += h.join().unwrap().len() as u64;
    }
    let mut drained = 0u64;
    c.drain(&mut |p, _| {
        drained += 1;
        assert_eq!(owner.lock().get(&p), Some(&None));
    })
    .unwrap();
    assert_eq!(drained + held_total, THREADS * PER_THREAD);
    assert_eq!(c.cached_bytes(), 0);
    let st = c.stats();
    assert!(st.hits > 0 && st.puts > 0, "{st:?}");
}

#[test]
fn put_over_bound_keeps_the_block_and_counts_it() {
    let dev = sim();
    let c = cache(
        &dev,
        StreamCacheConfig {
            max_cached_bytes: 4096,
            ..StreamCacheConfig::default()
        },
    );
    c.put(0x1000, 4096, 0).unwrap();
    assert!(c.put(0x3000, 4096, 0).is_err(), "bounded put overflows");
    c.put_over_bound(0x3000, 4096, 0);
    assert_eq!(c.cached_bytes(), 8192);
    assert!(c.put(0x5000, 512, 0).is_err(), "still over the bound");
    let mut got = vec![c.take(4096, 0).unwrap(), c.take(4096, 0).unwrap()];
    got.sort_unstable();
    assert_eq!(got, vec![0x1000, 0x3000]);
    c.put(0x5000, 512, 0).unwrap();
}

/// A capture underway: a block freed on another stream is not migrated (no event record, no query), the
/// second stream's shortcut synchronize waits, drains hand back nothing; afterwards all resumes.
#[test]
fn a_capture_defers_migrations_shortcuts_and_drains() {
    let dev = sim();
    let (s, t) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
    let c = cache(&dev, StreamCacheConfig::default());
    c.put(0x1000, KB4, s).unwrap();
    dev.begin_capture(t).unwrap();
    dev.captures().begin();
    assert_eq!(
        c.take(KB4, t),
        None,
        "s's free is not safe on t without an event"
    );
    assert_eq!(c.take(KB4, s), Some(0x1000), "s's own, at once");
    c.put(0x1000, KB4, s).unwrap();
    assert_eq!(c.drain(&mut |_, _| panic!("nothing drained")).unwrap(), 0);
    assert_eq!(
        c.drain_at_least(KB4, &mut |_, _| panic!("nothing drained"))
            .unwrap(),
        0
    );
    assert!(dev.captures().end());
    dev.end_capture().expect("no forbidden call");
    assert!(dev.capture_violations().is_empty());
    assert_eq!(
        c.take(KB4, t),
        Some(0x1000),
        "migrated once the capture ended"
    );
}
