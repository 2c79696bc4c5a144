//! gen-vmm on the simulated device: page refcounts, lazy reuse, stealing, limits, rollback.

use std::collections::HashMap;
use std::sync::Arc;

use gen_device::sim::{CallKind, SimDevice};
use gen_device::Device;
use gen_vmm::{PagePool, PagePoolConfig, Region, VmmError};
use proptest::prelude::*;

const MIB: u64 = 1 << 20;
const PAGE: u64 = 2 * MIB;

fn pool_with(dev: &Arc<SimDevice>, cfg: PagePoolConfig) -> Arc<PagePool> {
    PagePool::new(dev.clone() as Arc<dyn Device>, cfg).unwrap()
}

#[test]
fn neighbours_share_boundary_pages() {
    let dev = Arc::new(SimDevice::new());
    let pool = pool_with(&dev, PagePoolConfig::default());
    let r = Region::new(&pool, 64 * MIB, "t").unwrap();
    // Three 3 MiB blocks packed back to back: 9 MiB → 5 pages, not 3 × 2.
    for i in 0..3 {
        r.commit(i * 3 * MIB, 3 * MIB, true).unwrap();
    }
    assert_eq!(r.committed_bytes(), 5 * PAGE);
    assert_eq!(pool.stats().pages_held, 5);
    assert_eq!(
        r.page_refs(2 * MIB),
        2,
        "page 1 is touched by blocks 0 and 1"
    );
    r.decommit(3 * MIB, 3 * MIB);
    // Page 2 ([4, 6) MiB) was touched only by the middle block; pages 0-1 and 3-4 stay.
    assert_eq!(r.committed_bytes(), 4 * PAGE);
    r.decommit(0, 3 * MIB);
    r.decommit(6 * MIB, 3 * MIB);
    assert_eq!(r.committed_bytes(), 0);
    // Lazily kept: still held, free-mapped.
    let s = pool.stats();
    assert_eq!(
        (s.pages_held, s.pages_free_mapped, s.pages_in_use),
        (5, 5, 0)
    );
}

#[test]
fn recommit_in_place_makes_no_driver_call() {
    let dev = Arc::new(SimDevice::new());
    let pool = pool_with(&dev, PagePoolConfig::default());
    let r = Region::new(&pool, 64 * MIB, "t").unwrap();
    r.commit(0, 10 * MIB, true).unwrap();
    r.decommit(0, 10 * MIB);
    let before = dev.calls();
    for _ in 0..100 {
        r.commit(0, 10 * MIB, false).unwrap();
        r.decommit(0, 10 * MIB);
    }
    let d = dev.calls().since(&before);
    assert_eq!(d.total(), 0, "steady state must not call the driver: {d:?}");
    assert_eq!(pool.stats().revivals, 500);
}

#[test]
fn steals_before_growing_and_would_grow_reports() {
    let dev = Arc::new(SimDevice::new());
    let pool = pool_with(&dev, PagePoolConfig::default());
    let a = Region::new(&pool, 64 * MIB, "a").unwrap();
    let b = Region::new(&pool, 64 * MIB, "b").unwrap();
    a.commit(0, 8 * MIB, true).unwrap(); // 4 pages
    a.decommit(0, 8 * MIB);
    // b needs 4 pages: all stolen from a, none created.
    b.commit(0, 8 * MIB, false).unwrap();
    let s = pool.stats();
    assert_eq!((s.pages_held, s.steals, s.creates), (4, 4, 4));
    assert_eq!(dev.calls().get(CallKind::PhysCreate), 4);
    // One more page is needed and none is spare.
    assert_eq!(
        b.commit(8 * MIB, 1, false),
        Err(VmmError::WouldGrow { pages: 1 })
    );
    assert_eq!(
        b.committed_bytes(),
        8 * MIB,
        "a failed commit changes nothing"
    );
    b.commit(8 * MIB, 1, true).unwrap();
    assert_eq!(pool.stats().pages_peak, 5);
}

#[test]
fn limit_and_device_oom_are_clean_errors() {
    let dev = Arc::new(SimDevice::config().capacity(16 * MIB).build().unwrap());
    let pool = pool_with(
        &dev,
        PagePoolConfig {
            limit: Some(8 * MIB),
            ..Default::default()
        },
    );
    let r = Region::new(&pool, 64 * MIB, "t").unwrap();
    r.commit(0, 6 * MIB, true).unwrap();
    let e = r.commit(6 * MIB, 4 * MIB, true).unwrap_err();
    assert!(
        matches!(e, VmmError::OutOfMemory { limit: Some(_), .. }),
        "{e:?}"
    );
    assert_eq!(r.committed_bytes(), 6 * MIB);
    // Device exhaustion (no pool limit): partial progress is rolled back.
    let pool2 = pool_with(&dev, PagePoolConfig::default());
    let r2 = Region::new(&pool2, 64 * MIB, "t2").unwrap();
    let e = r2.commit(0, 16 * MIB, true).unwrap_err();
    assert!(matches!(e, VmmError::OutOfMemory { .. }), "{e:?}");
    assert_eq!(r2.committed_bytes(), 0);
    // The pages it did create are cached, not lost, and usable.
    r2.commit(0, 2 * MIB, false).unwrap();
    // Releasing unused memory makes room again.
    r.decommit(0, 6 * MIB);
    assert_eq!(pool.release_unused().unwrap(), 6 * MIB);
    assert_eq!(pool.stats().pages_held, 0);
}

#[test]
fn invalid_ranges_are_errors() {
    let dev = Arc::new(SimDevice::new());
    let pool = pool_with(&dev, PagePoolConfig::default());
    let r = Region::new(&pool, 4 * MIB, "t").unwrap();
    assert!(matches!(
        r.commit(0, 0, true),
        Err(VmmError::InvalidRange { .. })
    ));
    assert!(matches!(
        r.commit(3 * MIB, 2 * MIB, true),
        Err(VmmError::InvalidRange { .. })
    ));
    assert!(matches!(
        r.commit(u64::MAX, 2, true),
        Err(VmmError::InvalidRange { .. })
    ));
    assert!(matches!(
        Region::new(&pool, 0, "z"),
        Err(VmmError::InvalidRange { .. })
    ));
}

#[test]
fn injected_map_failure_rolls_back_and_keeps_the_handle() {
    let dev = Arc::new(SimDevice::new());
    let pool = pool_with(&dev, PagePoolConfig::default());
    let r = Region::new(&pool, 64 * MIB, "t").unwrap();
    r.commit(0, 2 * MIB, true).unwrap();
    dev.fail_next(CallKind::Map);
    let e = r.commit(0, 6 * MIB, true).unwrap_err();
    assert!(matches!(e, VmmError::Device(_)), "{e:?}");
    assert_eq!(
        r.page_refs(0),
        1,
        "the pre-existing reference survives the rollback"
    );
    assert_eq!(r.committed_bytes(), 2 * MIB);
    r.commit(0, 6 * MIB, true).unwrap();
    assert_eq!(r.committed_bytes(), 6 * MIB);
    // The handle created for the failed map was cached and reused: 3 pages held, not 4.
    assert_eq!(pool.stats().pages_held, 3);
}

#[test]
fn dropping_regions_returns_everything() {
    let dev = Arc::new(SimDevice::new());
    {
        let pool = pool_with(&dev, PagePoolConfig::default());
        let r = Region::new(&pool, 64 * MIB, "t").unwrap();
        r.commit(MIB, 20 * MIB, true).unwrap();
        r.decommit(MIB, 20 * MIB);
        drop(r);
        assert_eq!(pool.stats().pages_free_unmapped, 11);
    }
    assert_eq!(dev.reserved().current, 0, "pool drop releases every page");
}

#[test]
fn eager_unmap_faults_use_after_free() {
    let dev = Arc::new(SimDevice::config().backed(true).build().unwrap());
    let pool = pool_with(
        &dev,
        PagePoolConfig {
            eager_unmap: true,
            ..Default::default()
        },
    );
    let r = Region::new(&pool, 64 * MIB, "t").unwrap();
    r.commit(0, 4 * MIB, true).unwrap();
    dev.write(r.base(), &[7; 16]).unwrap();
    r.decommit(0, 4 * MIB);
    assert!(
        dev.write(r.base(), &[7; 16]).is_err(),
        "unmapped memory must fault"
    );
}

#[derive(Debug, Clone)]
enum Op {
    Commit {
        region: usize,
        offset: u64,
        len: u64,
        grow: bool,
    },
    Decommit {
        idx: usize,
    },
    Release,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..2usize, 0..(60 * MIB), 1..(12 * MIB), any::<bool>())
            .prop_map(|(region, offset, len, grow)| Op::Commit { region, offset, len, grow }),
        3 => any::<usize>().prop_map(|idx| Op::Decommit { idx }),
        1 => Just(Op::Release),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: if cfg!(miri) { 4 } else { 64 }, ..ProptestConfig::default() })]

    /// Against a model: refcounts per page equal the number of live ranges touching it; pages held never
    /// exceed the model's peak of touched pages; everything returns when all ranges are decommitted.
    #[test]
    fn page_model(ops in proptest::collection::vec(op(), 1..60)) {
        let dev = Arc::new(SimDevice::config().capacity(64 * MIB).build().unwrap());
        let pool = pool_with(&dev, PagePoolConfig::default());
        let regions = [Region::new(&pool, 72 * MIB, "a").unwrap(), Region::new(&pool, 72 * MIB, "b").unwrap()];
        let mut live: Vec<(usize, u64, u64)> = Vec::new();
        let mut peak_touched = 0u64;
        // A commit that fails half-way keeps the pages it created cached (not lost), so the held peak
        // can exceed the touched peak only after an out-of-memory.
        let mut oomed = false;
        for op in ops {
            match op {
                Op::Commit { region, offset, len, grow } => {
                    match regions[region].commit(offset, len, grow) {
                        Ok(()) => live.push((region, offset, len)),
                        Err(VmmError::WouldGrow { .. }) => prop_assert!(!grow),
                        Err(VmmError::OutOfMemory { .. }) => oomed = true,
                        Err(e) => prop_assert!(false, "unexpected {e:?}"),
                    }
                }
                Op::Decommit { idx } => {
                    if !live.is_empty() {
                        let (r, o, l) = live.swap_remove(idx % live.len());
                        regions[r].decommit(o, l);
                    }
                }
                Op::Release => { pool.release_unused().unwrap(); }
            }
            let mut refs: HashMap<(usize, u64), u32> = HashMap::new();
            for &(r, o, l) in &live {
                for p in o / PAGE..=(o + l - 1) / PAGE {
                    *refs.entry((r, p)).or_default() += 1;
                }
            }
            for (&(r, p), &n) in &refs {
                prop_assert_eq!(regions[r].page_refs(p * PAGE), n);
            }
            peak_touched = peak_touched.max(refs.len() as u64);
            let s = pool.stats();
            prop_assert_eq!(s.pages_in_use, refs.len() as u64);
            prop_assert!(oomed || s.pages_peak <= peak_touched, "held peak {} > touched peak {}", s.pages_peak, peak_touched);
            prop_assert_eq!(s.pages_held, s.pages_in_use + s.pages_free_mapped + s.pages_free_unmapped);
        }
        for (r, o, l) in live.drain(..) {
            regions[r].decommit(o, l);
        }
        prop_assert_eq!(pool.stats().pages_in_use, 0);
        pool.release_unused().unwrap();
        prop_assert_eq!(pool.stats().pages_held, 0);
    }
}

#[test]
fn slack_creates_within_headroom_instead_of_moving_pages() {
    for (slack, want_steals, want_held) in [(0.0, 4, 4), (1.0, 0, 8)] {
        let dev = Arc::new(SimDevice::new());
        let pool = pool_with(
            &dev,
            PagePoolConfig {
                slack,
                ..Default::default()
            },
        );
        let r = Region::new(&pool, 64 * MIB, "t").unwrap();
        r.commit(0, 8 * MIB, true).unwrap(); // 4 pages in use: the in-use peak
        r.decommit(0, 8 * MIB);
        r.commit(32 * MIB, 8 * MIB, true).unwrap(); // 4 pages elsewhere
        let s = pool.stats();
        assert_eq!(
            (s.steals, s.pages_held),
            (want_steals, want_held),
            "slack {slack}"
        );
        // Either way, with grow == false the pool only moves pages.
        r.decommit(32 * MIB, 8 * MIB);
        r.commit(16 * MIB, 4 * MIB, false).unwrap();
        assert_eq!(pool.stats().pages_held, want_held);
    }
}
