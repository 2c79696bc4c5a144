//! Sleep / wake of the engine on the simulated device (issue 22): every state change, the errors, and a
//! property test interleaving sleep and wake with allocations, frees, trims and iteration marks on
//! several streams, every block's bytes checked after each wake (backed simulator).

use std::collections::BTreeMap;
use std::sync::Arc;

use gen_device::sim::SimDevice;
use gen_device::{CallKind, Device, StreamId};
use genpool::{Config, GenpoolError, Hint, Lifetime, Pool, SleepError, SleepOptions, Tier};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const PAGE: u64 = 2 * MIB;

fn backed(capacity: u64) -> Arc<SimDevice> {
    Arc::new(
        SimDevice::config()
            .capacity(capacity)
            .backed(true)
            .build()
            .unwrap(),
    )
}

fn pool_on(dev: &Arc<SimDevice>, cfg: Config) -> Pool {
    Pool::new(dev.clone() as Arc<dyn Device>, cfg).unwrap()
}

fn hint(l: Lifetime) -> Hint {
    Hint {
        lifetime: Some(l),
        site: None,
    }
}

const OFFLOAD: SleepOptions = SleepOptions {
    offload: true,
    capturing: false,
};
const DISCARD: SleepOptions = SleepOptions {
    offload: false,
    capturing: false,
};

/// Sample offsets of a block: its first and last bytes and one per page it spans.
fn probes(size: u64) -> Vec<u64> {
    let mut v: Vec<u64> = (0..size.div_ceil(PAGE)).map(|k| k * PAGE).collect();
    v.push(size.saturating_sub(16));
    v.retain(|&o| o < size);
    v
}

fn stamp(seed: u64, off: u64) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&seed.to_le_bytes());
    b[8..].copy_from_slice(&off.to_le_bytes());
    b
}

fn fill(dev: &SimDevice, ptr: u64, size: u64, seed: u64) {
    for off in probes(size) {
        let n = (size - off).min(16) as usize;
        dev.write(ptr + off, &stamp(seed, off)[..n]).unwrap();
    }
}

fn check(dev: &SimDevice, ptr: u64, size: u64, seed: u64) -> Result<(), String> {
    for off in probes(size) {
        let n = (size - off).min(16) as usize;
        let mut got = [0u8; 16];
        dev.read(ptr + off, &mut got[..n])
            .map_err(|e| format!("block {ptr:#x}+{off:#x}: {e}"))?;
        if got[..n] != stamp(seed, off)[..n] {
            return Err(format!(
                "block {ptr:#x} (seed {seed}) at +{off:#x}: {:?}",
                &got[..n]
            ));
        }
    }
    Ok(())
}

fn assert_nothing_left(dev: &SimDevice) {
    let o = dev.outstanding();
    assert_eq!(dev.reserved().current, 0, "{o:?}");
    assert_eq!(
        (o.phys_handles, o.mappings, o.host_buffers),
        (0, 0, 0),
        "{o:?}"
    );
}

#[test]
fn sleep_releases_everything_keeps_pointers_and_wake_restores_every_tier() {
    let dev = backed(4 * GIB);
    let pool = pool_on(&dev, Config::default());
    let blocks = [
        pool.alloc(1000, 0, hint(Lifetime::Short)).unwrap(),
        pool.alloc(300 * 1024, 0, hint(Lifetime::Short)).unwrap(),
        pool.alloc(37 * MIB + 5, 0, hint(Lifetime::Short)).unwrap(),
        pool.alloc(64 * MIB, 0, hint(Lifetime::Long)).unwrap(),
    ];
    // A freed block leaves cached memory behind.
    let gone = pool.alloc(20 * MIB, 0, hint(Lifetime::Short)).unwrap();
    pool.free(gone.ptr, 0).unwrap();
    for (i, b) in blocks.iter().enumerate() {
        fill(&dev, b.ptr, b.size, i as u64 + 1);
    }
    let allocated = pool.allocated();
    let held = pool.reserved_now();
    assert!(held > allocated);

    let r = pool.sleep(OFFLOAD).unwrap();
    assert_eq!(r.released_bytes, held);
    assert!(r.trimmed_bytes > 0, "cached memory went first: {r:?}");
    assert_eq!(r.sleeping_bytes, r.offloaded_bytes);
    assert!(r.sleeping_bytes >= allocated);
    assert!(pool.is_asleep());
    let s = pool.stats();
    assert!(s.asleep);
    assert_eq!(s.reserved_current, 0, "reserved drops");
    assert_eq!(s.allocated_current, allocated, "allocated stays");
    assert_eq!(
        (s.sleeping_bytes, s.offloaded_bytes),
        (r.sleeping_bytes, r.offloaded_bytes)
    );
    assert_eq!(dev.reserved().current, 0, "the device holds nothing for us");
    assert_eq!(dev.outstanding().mappings, 0);
    // Every block keeps its pointer.
    for b in &blocks {
        assert_eq!(pool.lookup(b.ptr), Some(*b));
    }
    // Allocation from a sleeping pool is a typed error, for every tier and size.
    for (size, l) in [
        (100, Lifetime::Short),
        (8 * MIB, Lifetime::Short),
        (MIB, Lifetime::Long),
    ] {
        assert_eq!(pool.alloc(size, 0, hint(l)), Err(GenpoolError::Asleep));
    }
    assert_eq!(
        pool.stats().num_allocs,
        5,
        "refused allocations are not counted"
    );

    let w = pool.wake(false).unwrap();
    assert_eq!(w.mapped_bytes, r.sleeping_bytes);
    assert_eq!(w.restored_bytes, r.offloaded_bytes);
    let s = pool.stats();
    assert!(!s.asleep);
    assert_eq!((s.sleeping_bytes, s.offloaded_bytes), (0, 0));
    assert_eq!(s.reserved_current, r.sleeping_bytes);
    for (i, b) in blocks.iter().enumerate() {
        check(&dev, b.ptr, b.size, i as u64 + 1).unwrap();
        assert_eq!(pool.lookup(b.ptr), Some(*b));
    }
    // Business as usual.
    let more = pool.alloc(5 * MIB, 0, Hint::NONE).unwrap();
    pool.free(more.ptr, 0).unwrap();
    for b in &blocks {
        pool.free(b.ptr, 0).unwrap();
    }
    pool.trim();
    assert_eq!(pool.release_offload_buffer().unwrap(), r.offloaded_bytes);
    assert_nothing_left(&dev);
}

#[test]
fn frees_while_asleep_are_accepted_and_touch_no_page() {
    let dev = backed(4 * GIB);
    let pool = pool_on(&dev, Config::default());
    let a = pool.alloc(10 * MIB, 0, Hint::NONE).unwrap();
    let b = pool.alloc(700, 0, Hint::NONE).unwrap();
    let c = pool.alloc(6 * MIB, 0, hint(Lifetime::Long)).unwrap();
    fill(&dev, c.ptr, c.size, 3);
    pool.sleep(OFFLOAD).unwrap();
    let before = dev.calls();
    assert_eq!(pool.free(a.ptr, 0).unwrap(), a.size);
    assert_eq!(pool.free(b.ptr, 0).unwrap(), b.size);
    let d = dev.calls().since(&before);
    assert_eq!(
        (
            d.get(CallKind::Map),
            d.get(CallKind::Unmap),
            d.get(CallKind::PhysCreate)
        ),
        (0, 0, 0),
        "{d:?}"
    );
    // Bad frees while asleep are refused as ever.
    assert!(matches!(
        pool.free(a.ptr, 0),
        Err(GenpoolError::InvalidFree { .. })
    ));
    let s = pool.stats();
    assert_eq!(s.allocated_current, c.size);
    assert_eq!(s.reserved_current, 0);
    assert!(s.sleeping_bytes >= c.size && s.sleeping_bytes < c.size + 2 * PAGE);
    let w = pool.wake(false).unwrap();
    assert_eq!(
        w.mapped_bytes, s.sleeping_bytes,
        "only the pages still referenced"
    );
    assert_eq!(pool.reserved_now(), s.sleeping_bytes);
    check(&dev, c.ptr, c.size, 3).unwrap();
    pool.free(c.ptr, 0).unwrap();
    pool.trim();
    pool.release_offload_buffer().unwrap();
    assert_nothing_left(&dev);
}

#[test]
fn bad_calls_get_typed_errors_and_change_nothing() {
    let dev = backed(4 * GIB);
    let pool = pool_on(&dev, Config::default());
    let a = pool.alloc(3 * MIB, 0, Hint::NONE).unwrap();
    assert_eq!(
        pool.wake(false),
        Err(SleepError::NotAsleep),
        "wake without sleep"
    );
    let capturing = SleepOptions {
        offload: true,
        capturing: true,
    };
    assert_eq!(pool.sleep(capturing), Err(SleepError::Capturing));
    assert!(!pool.is_asleep());
    assert_eq!(pool.reserved_now(), 2 * PAGE, "nothing trimmed or released");
    pool.sleep(DISCARD).unwrap();
    assert_eq!(
        pool.sleep(OFFLOAD),
        Err(SleepError::AlreadyAsleep),
        "double sleep"
    );
    assert_eq!(pool.wake(true), Err(SleepError::Capturing));
    assert!(pool.is_asleep());
    pool.wake(false).unwrap();
    assert_eq!(pool.wake(false), Err(SleepError::NotAsleep), "double wake");
    pool.free(a.ptr, 0).unwrap();

    // The driver's stream-ordered tier cannot sleep its live blocks.
    let sp = pool_on(&dev, Config::parse("experimental.mid_tier:stream").unwrap());
    let m = sp.alloc(4 * MIB, 0, hint(Lifetime::Mid)).unwrap();
    assert_eq!(m.tier, Tier::Stream);
    assert!(matches!(sp.sleep(OFFLOAD), Err(SleepError::StreamTier { live }) if live == m.size));
    assert!(!sp.is_asleep());
    sp.free(m.ptr, 0).unwrap();
    sp.sleep(OFFLOAD).unwrap();
    sp.wake(false).unwrap();
}

#[test]
fn a_wake_without_memory_keeps_the_pool_asleep_until_memory_is_back() {
    let dev = backed(GIB);
    let pool = pool_on(&dev, Config::default());
    let a = pool.alloc(100 * MIB, 0, Hint::NONE).unwrap();
    fill(&dev, a.ptr, a.size, 9);
    pool.sleep(OFFLOAD).unwrap();
    // Another process takes nearly all of the device meanwhile.
    let other = dev.phys_create(GIB - 10 * PAGE).unwrap();
    assert!(matches!(
        pool.wake(false),
        Err(SleepError::OutOfMemory { .. })
    ));
    assert!(pool.is_asleep());
    assert_eq!(pool.alloc(MIB, 0, Hint::NONE), Err(GenpoolError::Asleep));
    dev.phys_release(other).unwrap();
    pool.wake(false).unwrap();
    check(&dev, a.ptr, a.size, 9).unwrap();
    pool.free(a.ptr, 0).unwrap();
}

#[test]
fn several_streams_and_their_arenas_sleep_and_wake() {
    let dev = backed(4 * GIB);
    let pool = pool_on(&dev, Config::default());
    let (s1, s2) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
    let mut live = Vec::new();
    for (i, &s) in [0, s1, s2, s1, 0].iter().enumerate() {
        let b = pool
            .alloc((i as u64 + 1) * 5 * MIB + 77, s, Hint::NONE)
            .unwrap();
        fill(&dev, b.ptr, b.size, 100 + i as u64);
        live.push((b, s, 100 + i as u64));
    }
    // A block freed on another stream than the one it was allocated on goes back at once, with no
    // device call: in the arena the streams after the first share, the stream that gets its bytes next
    // waits for s2 then.
    let (b, _, _) = live.remove(1);
    let waits = dev.call_counts().stream_waits;
    pool.free(b.ptr, s2).unwrap();
    assert_eq!(pool.stats().cached_bytes, 0);
    assert_eq!(dev.call_counts().stream_waits, waits, "no wait at the free");
    pool.sleep(OFFLOAD).unwrap();
    let s = pool.stats();
    assert_eq!(
        (s.cached_bytes, s.reserved_current),
        (0, 0),
        "caches drained"
    );
    pool.wake(false).unwrap();
    for &(b, _, seed) in &live {
        check(&dev, b.ptr, b.size, seed).unwrap();
    }
    for (b, s, _) in live {
        pool.free(b.ptr, s).unwrap();
    }
    pool.trim();
    pool.release_offload_buffer().unwrap();
    assert_nothing_left(&dev);
}

#[test]
fn a_pool_dropped_asleep_leaks_nothing() {
    let dev = backed(4 * GIB);
    {
        let pool = pool_on(&dev, Config::default());
        let a = pool.alloc(9 * MIB, 0, Hint::NONE).unwrap();
        let _b = pool.alloc(1234, 0, Hint::NONE).unwrap();
        pool.sleep(OFFLOAD).unwrap();
        pool.free(a.ptr, 0).unwrap();
    }
    let o = dev.outstanding();
    assert_nothing_left(&dev);
    assert_eq!(o.va_reservations, 0, "{o:?}");
}

// ---- property test ---------------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Op {
    Alloc { size: u64, stream: u8, long: bool },
    Free(usize),
    Sleep { offload: bool },
    Wake,
    Trim,
    Mark,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (prop_oneof![1u64..4096, 4096u64..(MIB + 1), MIB..(24 * MIB)], 0u8..3, any::<bool>())
            .prop_map(|(size, stream, long)| Op::Alloc { size, stream, long }),
        4 => any::<usize>().prop_map(Op::Free),
        1 => any::<bool>().prop_map(|offload| Op::Sleep { offload }),
        1 => Just(Op::Wake),
        1 => Just(Op::Trim),
        1 => Just(Op::Mark),
    ]
}

struct Live {
    ptr: u64,
    size: u64,
    stream: StreamId,
    seed: u64,
    /// Its bytes are known (written, or restored by an offloaded sleep).
    known: bool,
}

fn run(ops: Vec<Op>, cfg: Config) -> Result<(), TestCaseError> {
    let dev = backed(2 * GIB);
    let pool = pool_on(&dev, cfg);
    let streams = [
        0,
        dev.stream_create().unwrap(),
        dev.stream_create().unwrap(),
    ];
    let mut live: BTreeMap<u64, Live> = BTreeMap::new();
    let mut asleep: Option<bool> = None; // Some(offload) while asleep
    let mut seed = 0u64;
    for op in ops {
        match op {
            Op::Alloc { size, stream, long } => {
                let l = if long {
                    Lifetime::Long
                } else {
                    Lifetime::Short
                };
                let s = streams[stream as usize];
                let r = pool.alloc(size, s, hint(l));
                if asleep.is_some() {
                    prop_assert_eq!(r, Err(GenpoolError::Asleep));
                    continue;
                }
                let b = r.map_err(|e| TestCaseError::fail(format!("alloc {size}: {e}")))?;
                seed += 1;
                fill(&dev, b.ptr, b.size, seed);
                live.insert(
                    b.ptr,
                    Live {
                        ptr: b.ptr,
                        size: b.size,
                        stream: s,
                        seed,
                        known: true,
                    },
                );
            }
            Op::Free(i) => {
                if live.is_empty() {
                    continue;
                }
                let &k = live.keys().nth(i % live.len()).expect("non-empty");
                let b = live.remove(&k).expect("present");
                if asleep.is_none() && b.known {
                    check(&dev, b.ptr, b.size, b.seed).map_err(TestCaseError::fail)?;
                }
                prop_assert_eq!(pool.free(b.ptr, b.stream), Ok(b.size));
            }
            Op::Sleep { offload } => {
                let r = pool.sleep(SleepOptions {
                    offload,
                    capturing: false,
                });
                if asleep.is_some() {
                    prop_assert_eq!(r, Err(SleepError::AlreadyAsleep));
                    continue;
                }
                let r = r.map_err(|e| TestCaseError::fail(format!("sleep: {e}")))?;
                prop_assert_eq!(pool.reserved_now(), 0);
                prop_assert_eq!(dev.reserved().current, 0);
                let total: u64 = live.values().map(|b| b.size).sum();
                prop_assert_eq!(pool.allocated(), total);
                prop_assert!(r.sleeping_bytes >= total);
                prop_assert_eq!(
                    r.offloaded_bytes,
                    if offload { r.sleeping_bytes } else { 0 }
                );
                asleep = Some(offload);
            }
            Op::Wake => {
                let r = pool.wake(false);
                let Some(offload) = asleep.take() else {
                    prop_assert_eq!(r, Err(SleepError::NotAsleep));
                    continue;
                };
                r.map_err(|e| TestCaseError::fail(format!("wake: {e}")))?;
                for b in live.values_mut() {
                    if offload && b.known {
                        check(&dev, b.ptr, b.size, b.seed).map_err(TestCaseError::fail)?;
                    } else {
                        // Discarded: undefined bytes; write them again.
                        fill(&dev, b.ptr, b.size, b.seed);
                        b.known = true;
                    }
                }
                prop_assert!(pool.reserved_now() >= pool.allocated());
            }
            Op::Trim => {
                pool.trim();
                if asleep.is_some() {
                    prop_assert_eq!(pool.reserved_now(), 0);
                }
            }
            Op::Mark => pool.mark_iteration(),
        }
        let s = pool.stats();
        prop_assert_eq!(s.asleep, asleep.is_some());
        prop_assert_eq!(
            s.allocated_current,
            live.values().map(|b| b.size).sum::<u64>()
        );
        prop_assert_eq!(s.num_allocs - s.num_frees, live.len() as u64);
        if asleep.is_none() {
            prop_assert_eq!((s.sleeping_bytes, s.offloaded_bytes), (0, 0));
        }
    }
    if asleep.is_some() {
        pool.wake(false)
            .map_err(|e| TestCaseError::fail(format!("final wake: {e}")))?;
    }
    for b in std::mem::take(&mut live).into_values() {
        prop_assert_eq!(pool.free(b.ptr, b.stream), Ok(b.size));
    }
    pool.trim();
    pool.release_offload_buffer()
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let o = dev.outstanding();
    prop_assert_eq!(dev.reserved().current, 0, "{:?}", o);
    prop_assert_eq!(
        (o.phys_handles, o.mappings, o.host_buffers),
        (0, 0, 0),
        "{:?}",
        o
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn sleep_and_wake_interleave_with_everything_else(ops in proptest::collection::vec(op(), 1..80)) {
        run(ops, Config::default())?;
    }

    #[test]
    fn sleep_and_wake_with_old_mappings_off_and_eager_caches(
        ops in proptest::collection::vec(op(), 1..60)
    ) {
        run(ops, Config::parse("experimental.page_keep_old_mappings:false,experimental.stream_arenas:false").unwrap())?;
    }
}
