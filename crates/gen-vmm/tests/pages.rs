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

/// A range's inner pages are released and revived in one step when each is the range's alone, and page
/// by page when another range shares some of them: both give the same references and counts.
/// A region of a stream of its own (an extent arena's) defers its last decommit: committing the same
/// pages again next cancels it — no page changes state, nothing is counted as revived — while any other
/// use of the pool sees the decommit applied. A region shared by streams decommits at once.
#[test]
fn the_next_commit_of_the_same_pages_cancels_a_deferred_decommit() {
    let dev = Arc::new(SimDevice::new());
    let pool = pool_with(&dev, PagePoolConfig::default());
    let own = Region::new(&pool, 64 * MIB, "own").unwrap();
    own.set_stream(Some(0));
    own.commit(MIB, 9 * MIB, true).unwrap();
    let before = pool.stats();
    let calls = dev.calls();
    for _ in 0..10 {
        own.decommit(MIB, 9 * MIB);
        own.commit(MIB, 9 * MIB, false).unwrap();
    }
    let s = pool.stats();
    assert_eq!(s.deferrals_cancelled - before.deferrals_cancelled, 10);
    assert_eq!(
        s.revivals, before.revivals,
        "no page went free and came back"
    );
    assert_eq!((s.pages_in_use, s.pages_held), (5, 5));
    assert_eq!(dev.calls().since(&calls).total(), 0, "no driver call");
    // Anything else applies it: the statistics, another range's commit.
    own.decommit(MIB, 9 * MIB);
    let s = pool.stats();
    assert_eq!((s.pages_in_use, s.pages_free_mapped), (0, 5));
    own.commit(MIB, 9 * MIB, false).unwrap();
    own.decommit(MIB, 9 * MIB);
    own.commit(0, 2 * MIB, false).unwrap();
    let s = pool.stats();
    assert_eq!((s.pages_in_use, s.pages_free_mapped), (1, 4));
    assert_eq!(own.page_refs(0), 1);
    assert_eq!(own.page_refs(2 * MIB), 0);
    // A region of no stream of its own: no deferral, every free-and-commit revives.
    let shared = Region::new(&pool, 64 * MIB, "shared").unwrap();
    shared.commit(0, 4 * MIB, true).unwrap();
    let before = pool.stats();
    shared.decommit(0, 4 * MIB);
    shared.commit(0, 4 * MIB, false).unwrap();
    let s = pool.stats();
    assert_eq!(s.deferrals_cancelled, before.deferrals_cancelled);
    assert_eq!(s.revivals - before.revivals, 2);
    // A region dropped with its decommit deferred gives everything back.
    own.decommit(0, 2 * MIB);
    drop(own);
    shared.decommit(0, 4 * MIB);
    drop(shared);
    pool.release_unused().unwrap();
    assert_eq!(pool.stats().pages_held, 0);
}

#[test]
fn inner_pages_shared_or_not_count_the_same() {
    let dev = Arc::new(SimDevice::new());
    let pool = pool_with(&dev, PagePoolConfig::default());
    let r = Region::new(&pool, 64 * MIB, "t").unwrap();
    // Pages 0..=4 (10 MiB), and pages 1..=2 once more by a second range inside it.
    r.commit(0, 10 * MIB, true).unwrap();
    r.commit(3 * MIB, 2 * MIB, true).unwrap();
    r.decommit(0, 10 * MIB);
    let refs = |r: &Region| (0..6).map(|p| r.page_refs(p * PAGE)).collect::<Vec<_>>();
    assert_eq!(refs(&r), [0, 1, 1, 0, 0, 0]);
    let s = pool.stats();
    assert_eq!((s.pages_in_use, s.pages_free_mapped), (2, 3));
    // Revived: the inner pages are mixed (1 and 2 in use, 3 free), so page by page.
    let revivals = s.revivals;
    r.commit(0, 10 * MIB, false).unwrap();
    assert_eq!(refs(&r), [1, 2, 2, 1, 1, 0]);
    let s = pool.stats();
    assert_eq!((s.pages_in_use, s.pages_free_mapped), (5, 0));
    assert_eq!(s.revivals - revivals, 3);
    // The second range gone, the inner pages are the outer range's alone: released and revived at once.
    r.decommit(3 * MIB, 2 * MIB);
    r.decommit(0, 10 * MIB);
    assert_eq!(refs(&r), [0; 6]);
    let s = pool.stats();
    assert_eq!((s.pages_in_use, s.pages_free_mapped), (0, 5));
    let before = dev.calls();
    r.commit(MIB, 8 * MIB, false).unwrap();
    assert_eq!(refs(&r), [1, 1, 1, 1, 1, 0]);
    let s = pool.stats();
    assert_eq!((s.pages_in_use, s.pages_free_mapped), (5, 0));
    assert_eq!(s.revivals - revivals, 8);
    assert_eq!(dev.calls().since(&before).total(), 0, "revived in place");
    // A neighbour sharing the last page keeps it when the range goes.
    r.commit(9 * MIB, MIB, false).unwrap();
    r.decommit(MIB, 8 * MIB);
    assert_eq!(refs(&r), [0, 0, 0, 0, 1, 0]);
    assert_eq!(pool.stats().pages_free_mapped, 4);
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
fn a_range_partly_backed_is_taken_whole_or_not_at_all() {
    // Pages 0-1 in use, 2-3 free and mapped, 4 never backed. The warm path takes references on the
    // backed pages as it walks; meeting page 4 it must give them all back — in use stays in use,
    // revived pages go back to the free set — before the general path decides.
    let dev = Arc::new(SimDevice::new());
    let pool = pool_with(&dev, PagePoolConfig::default());
    let r = Region::new(&pool, 64 * MIB, "r").unwrap();
    r.commit(0, 8 * MIB, true).unwrap();
    r.decommit(4 * MIB, 4 * MIB);
    let before = pool.stats();
    assert_eq!((before.pages_in_use, before.pages_free_mapped), (2, 2));
    assert_eq!(
        r.commit(0, 10 * MIB, false),
        Err(VmmError::WouldGrow { pages: 1 }),
        "page 4 needs a new page and none is spare"
    );
    let after = pool.stats();
    assert_eq!(
        (after.pages_in_use, after.pages_free_mapped, after.revivals),
        (2, 2, before.revivals),
        "the refused commit took nothing"
    );
    for (page, refs) in [(0, 1), (1, 1), (2, 0), (3, 0), (4, 0)] {
        assert_eq!(r.page_refs(page * PAGE), refs, "page {page}");
    }
    // The same range with growth: one page created, the free ones revived in place, no move.
    r.commit(0, 10 * MIB, true).unwrap();
    let s = pool.stats();
    assert_eq!(
        (s.pages_in_use, s.pages_free_mapped, s.creates, s.steals),
        (5, 0, 5, 0)
    );
    for (page, refs) in [(0, 2), (1, 2), (2, 1), (3, 1), (4, 1)] {
        assert_eq!(r.page_refs(page * PAGE), refs, "page {page}");
    }
    // Fully backed now: the warm path takes the whole range again.
    r.commit(2 * MIB, 6 * MIB, false).unwrap();
    assert_eq!(r.page_refs(2 * MIB), 3);
    assert_eq!(r.page_refs(6 * MIB), 2);
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

/// A block of many pages freed in `eager_unmap` mode waits for the device once, not once per page.
#[test]
fn eager_unmap_synchronizes_once_per_free() {
    let dev = Arc::new(SimDevice::config().build().unwrap());
    let pool = pool_with(
        &dev,
        PagePoolConfig {
            eager_unmap: true,
            ..Default::default()
        },
    );
    let r = Region::new(&pool, 64 * MIB, "t").unwrap();
    r.commit(0, 16 * MIB, true).unwrap();
    let before = dev.call_counts();
    r.decommit(0, 16 * MIB);
    let after = dev.call_counts();
    assert_eq!(after.unmaps - before.unmaps, 8, "every page unmapped");
    assert_eq!(after.device_syncs - before.device_syncs, 1);
    assert_eq!(pool.stats().pages_free_unmapped, 8);
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
    /// A live range decommitted and committed again at once (regions of a stream of their own: the
    /// commit cancels the deferred decommit).
    Cycle {
        idx: usize,
    },
    /// A live range decommitted, then another committed with no other use of the pool between (the
    /// commit applies the deferred decommit first, and may take its pages).
    Swap {
        idx: usize,
        region: usize,
        offset: u64,
        len: u64,
        grow: bool,
    },
    Release,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..2usize, 0..(60 * MIB), 1..(12 * MIB), any::<bool>())
            .prop_map(|(region, offset, len, grow)| Op::Commit { region, offset, len, grow }),
        3 => any::<usize>().prop_map(|idx| Op::Decommit { idx }),
        2 => any::<usize>().prop_map(|idx| Op::Cycle { idx }),
        2 => (any::<usize>(), 0..2usize, 0..(60 * MIB), 1..(12 * MIB), any::<bool>())
            .prop_map(|(idx, region, offset, len, grow)| Op::Swap { idx, region, offset, len, grow }),
        1 => Just(Op::Release),
    ]
}

proptest! {
    // PROPTEST_CASES raises the count for a longer soak.
    #![proptest_config(ProptestConfig {
        cases: if cfg!(miri) { 4 } else { std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(64) },
        ..ProptestConfig::default()
    })]

    /// Against a model: refcounts per page equal the number of live ranges touching it; pages held never
    /// exceed the model's peak of touched pages; everything returns when all ranges are decommitted.
    #[test]
    fn page_model(ops in proptest::collection::vec(op(), 1..60), solo in any::<bool>(), keep in any::<bool>(), own in any::<bool>()) {
        let dev = Arc::new(SimDevice::config().capacity(64 * MIB).build().unwrap());
        let pool = pool_with(&dev, PagePoolConfig { keep_old_mappings: keep, ..Default::default() });
        if solo {
            // Moves alias pages and unmap the old mappings once fences complete.
            pool.set_fence_stream(Some(0));
        }
        let regions = [Region::new(&pool, 72 * MIB, "a").unwrap(), Region::new(&pool, 72 * MIB, "b").unwrap()];
        if own {
            // Regions of a stream of their own (an extent arena's): their decommits are deferred.
            for r in &regions {
                r.set_stream(Some(0));
            }
        }
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
                Op::Cycle { idx } => {
                    if !live.is_empty() {
                        let (r, o, l) = live[idx % live.len()];
                        let cancelled = pool.stats().deferrals_cancelled;
                        regions[r].decommit(o, l);
                        // Its pages stay mapped (referenced or free-mapped): no growth is needed.
                        prop_assert!(regions[r].commit(o, l, false).is_ok());
                        prop_assert_eq!(pool.stats().deferrals_cancelled, cancelled + u64::from(own));
                    }
                }
                Op::Swap { idx, region, offset, len, grow } => {
                    if !live.is_empty() {
                        let (r, o, l) = live.swap_remove(idx % live.len());
                        regions[r].decommit(o, l);
                        match regions[region].commit(offset, len, grow) {
                            Ok(()) => live.push((region, offset, len)),
                            Err(VmmError::WouldGrow { .. }) => prop_assert!(!grow),
                            Err(VmmError::OutOfMemory { .. }) => oomed = true,
                            Err(e) => prop_assert!(false, "unexpected {e:?}"),
                        }
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
            prop_assert!(s.zombies <= s.pages_held.max(64) + 16, "{:?}", s);
            // Every mapping the device has is a page's own or an old mapping the pool knows of.
            prop_assert_eq!(dev.outstanding().mappings as u64, s.pages_in_use + s.pages_free_mapped + s.zombies);
        }
        for (r, o, l) in live.drain(..) {
            regions[r].decommit(o, l);
        }
        prop_assert_eq!(pool.stats().pages_in_use, 0);
        pool.release_unused().unwrap();
        let s = pool.stats();
        prop_assert_eq!((s.pages_held, s.zombies), (0, 0));
        prop_assert_eq!(s.syncs, if solo { 0 } else { s.syncs }, "one stream never synchronizes to move a page");
        drop(regions);
        drop(pool);
        let out = dev.outstanding();
        prop_assert_eq!((out.mappings, out.phys_handles), (0, 0), "{:?}", out);
    }
}

/// One stream, its work still queued (the simulated stream is paused, so a synchronize would fail):
/// a page freed moments ago moves to another address without any synchronize — mapped there while its
/// old mapping stays — and the old mapping goes once a fence shows the stream's work done.
#[test]
fn one_stream_moves_a_busy_page_without_synchronizing() {
    let dev = Arc::new(SimDevice::new());
    let pool = pool_with(&dev, PagePoolConfig::default());
    pool.set_fence_stream(Some(0));
    let r = Region::new(&pool, 64 * MIB, "t").unwrap();
    r.commit(0, 4 * MIB, true).unwrap(); // 2 pages
    dev.pause_stream(0).unwrap();
    r.decommit(0, 4 * MIB); // freed with (simulated) work still queued on stream 0
    let before = dev.calls();
    r.commit(32 * MIB, 4 * MIB, true).unwrap(); // needs 2 pages: both moved
    let d = dev.calls().since(&before);
    assert_eq!(d.get(CallKind::Synchronize), 0, "{d:?}");
    assert_eq!((d.get(CallKind::Map), d.get(CallKind::Unmap)), (2, 0));
    assert_eq!(d.get(CallKind::PhysCreate), 0);
    let s = pool.stats();
    assert_eq!((s.steals, s.aliases, s.zombies, s.pages_held), (2, 2, 2, 2));
    assert!(s.fences >= 1);
    // Still busy: another move finds the fence pending and leaves the old mappings alone.
    r.decommit(32 * MIB, 4 * MIB);
    r.commit(48 * MIB, 2 * MIB, true).unwrap();
    assert_eq!(pool.stats().zombies, 3);
    assert_eq!(dev.calls().since(&before).get(CallKind::Unmap), 0);
    // The stream catches up: the next commit that maps a page unmaps the old mappings first.
    dev.resume_stream(0).unwrap();
    r.commit(60 * MIB, 2 * MIB, true).unwrap();
    let s = pool.stats();
    assert_eq!(s.zombies, 0, "{s:?}");
    assert_eq!(s.syncs, 0);
    assert_eq!(s.pages_held, 2);
    assert_eq!(dev.calls().since(&before).get(CallKind::Synchronize), 0);
    r.decommit(48 * MIB, 2 * MIB);
    r.decommit(60 * MIB, 2 * MIB);
    drop(r);
    drop(pool);
    let out = dev.outstanding();
    assert_eq!((out.mappings, out.phys_handles), (0, 0), "{out:?}");
}

/// Several streams: a page freed with work still queued is only moved after a synchronize (here the
/// paused stream makes the synchronize fail: the commit fails cleanly), while a page whose fence has
/// completed moves with no synchronize at all.
#[test]
fn several_streams_synchronize_only_for_busy_pages() {
    let dev = Arc::new(SimDevice::new());
    let pool = pool_with(&dev, PagePoolConfig::default());
    let r = Region::new(&pool, 64 * MIB, "t").unwrap();
    r.commit(0, 2 * MIB, true).unwrap();
    dev.pause_stream(0).unwrap();
    // Work queued on the paused stream (an event stands in for a kernel): a synchronize cannot finish.
    let work = dev.event_create().unwrap();
    dev.event_record(work, 0).unwrap();
    r.decommit(0, 2 * MIB);
    assert!(matches!(
        r.commit(32 * MIB, 2 * MIB, true),
        Err(VmmError::Device(_))
    ));
    assert_eq!(r.committed_bytes(), 0, "a failed commit changes nothing");
    assert_eq!(pool.stats().pages_free_mapped, 1, "the page is still there");
    dev.resume_stream(0).unwrap();
    r.commit(32 * MIB, 2 * MIB, true).unwrap();
    let s = pool.stats();
    assert_eq!((s.steals, s.aliases, s.syncs), (1, 0, 1));
    // After that synchronize, a page freed before it is known idle; one freed after is not.
    r.decommit(32 * MIB, 2 * MIB);
    let before = dev.calls();
    r.commit(16 * MIB, 2 * MIB, true).unwrap();
    assert_eq!(dev.calls().since(&before).get(CallKind::Synchronize), 1);
    // Now record the single stream for fences: freed pages become idle as fences complete.
    pool.set_fence_stream(Some(0));
    r.decommit(16 * MIB, 2 * MIB);
    r.commit(20 * MIB, 2 * MIB, true).unwrap(); // aliased (warm), records a fence
    r.decommit(20 * MIB, 2 * MIB);
    pool.set_fence_stream(None); // (the caller synchronizes when going multi-stream)
    dev.synchronize().unwrap();
    dev.event_destroy(work).unwrap();
    pool.synchronized();
    assert_eq!(pool.stats().zombies, 0);
    let before = dev.calls();
    r.commit(40 * MIB, 2 * MIB, true).unwrap(); // freed before the synchronize: cold, no new sync
    assert_eq!(dev.calls().since(&before).get(CallKind::Synchronize), 0);
}

/// A pool on the simulated device with a region for each of two streams A and B, A's first 4 MiB
/// committed.
#[allow(clippy::type_complexity)]
fn two_stream_regions() -> (Arc<SimDevice>, Arc<PagePool>, (u64, u64), (Region, Region)) {
    let dev = Arc::new(SimDevice::new());
    let pool = pool_with(&dev, PagePoolConfig::default());
    let (a, b) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
    let ra = Region::new(&pool, 64 * MIB, "a").unwrap();
    let rb = Region::new(&pool, 64 * MIB, "b").unwrap();
    ra.set_stream(Some(a));
    rb.set_stream(Some(b));
    ra.commit(0, 4 * MIB, true).unwrap();
    (dev, pool, (a, b), (ra, rb))
}

/// Several streams, regions of known streams: a page freed in stream A's region with A's work still
/// queued moves to stream B's region with no host wait — B waits on a fence of A on the device, the page
/// is aliased, and the old mapping goes once that fence completes.
#[test]
fn several_streams_move_a_busy_page_by_ordering_not_synchronizing() {
    let (dev, pool, (a, b), (ra, rb)) = two_stream_regions();
    dev.pause_stream(a).unwrap();
    dev.memset_async(ra.base(), 0, 4 * MIB, a).unwrap(); // A's kernel still uses the pages
    ra.decommit(0, 4 * MIB);
    let before = dev.calls();
    rb.commit(0, 4 * MIB, false).unwrap(); // both pages move from A's region
    let d = dev.calls().since(&before);
    assert_eq!(d.get(CallKind::Synchronize), 0, "{d:?}");
    assert_eq!(d.get(CallKind::EventSynchronize), 0, "{d:?}");
    assert_eq!(
        d.get(CallKind::StreamWaitEvent),
        1,
        "one wait: B, once ordered after A's fence, needs no second wait for the other page: {d:?}"
    );
    assert_eq!(
        d.get(CallKind::EventRecord),
        1,
        "one fence of A covers both"
    );
    assert_eq!(d.get(CallKind::PhysCreate), 0);
    assert!(dev.waits_on(b, a), "B's next work is ordered after A's");
    let s = pool.stats();
    assert_eq!(
        (s.steals, s.aliases, s.syncs, s.stream_waits),
        (2, 2, 0, 1),
        "{s:?}"
    );
    assert_eq!(s.zombies, 2, "A's old mappings stay while A's work runs");
    // A catches up: the fence completes, and the old mappings can go.
    dev.resume_stream(a).unwrap();
    assert!(!dev.waits_on(b, a));
    rb.decommit(0, 4 * MIB);
    drop((ra, rb));
    drop(pool);
    let out = dev.outstanding();
    assert_eq!((out.mappings, out.phys_handles), (0, 0), "{out:?}");
}

/// The same move with A's work done (session 27): the page pool asks whether A is idle
/// (`cuStreamQuery`) instead of fencing A and making B wait — no fence, no wait, no host wait; the pages
/// move as idle pages (not aliased).
#[test]
fn several_streams_move_a_page_whose_stream_is_idle_with_one_question() {
    let (dev, pool, (a, b), (ra, rb)) = two_stream_regions();
    dev.memset_async(ra.base(), 0, 4 * MIB, a).unwrap(); // A's kernel, run to completion
    ra.decommit(0, 4 * MIB);
    let before = dev.calls();
    rb.commit(0, 4 * MIB, false).unwrap(); // both pages move from A's region
    let d = dev.calls().since(&before);
    assert_eq!(
        d.get(CallKind::StreamQuery),
        1,
        "one question covers both pages: {d:?}"
    );
    assert_eq!(
        (
            d.get(CallKind::EventRecord),
            d.get(CallKind::StreamWaitEvent),
            d.get(CallKind::Synchronize),
            d.get(CallKind::EventSynchronize)
        ),
        (0, 0, 0, 0),
        "{d:?}"
    );
    assert!(!dev.waits_on(b, a));
    let s = pool.stats();
    assert_eq!((s.steals, s.aliases, s.stream_waits), (2, 0, 0), "{s:?}");
    rb.decommit(0, 4 * MIB);
    drop((ra, rb));
    drop(pool);
    let out = dev.outstanding();
    assert_eq!((out.mappings, out.phys_handles), (0, 0), "{out:?}");
}

/// A region shared by several streams (the slab's): bytes freed on A (`decommit_for`) and committed again
/// for B make B wait on A's fence; what was committed is then B's alone (`commit_for` says so). With A
/// idle, nothing waits and the range is for any stream.
#[test]
fn a_shared_region_orders_the_next_stream_after_the_last_users() {
    let dev = Arc::new(SimDevice::new());
    let pool = pool_with(&dev, PagePoolConfig::default());
    let (a, b) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
    let r = Region::new(&pool, 64 * MIB, "shared").unwrap();
    assert!(
        !r.commit_for(0, MIB, true, a).unwrap(),
        "fresh pages: any stream"
    );
    dev.pause_stream(a).unwrap();
    dev.memset_async(r.base(), 0, MIB, a).unwrap();
    r.decommit_for(0, MIB, a);
    let before = dev.calls();
    assert!(
        r.commit_for(0, MIB, true, b).unwrap(),
        "busy on A: B's alone"
    );
    let d = dev.calls().since(&before);
    assert_eq!(d.get(CallKind::Synchronize), 0);
    assert_eq!(d.get(CallKind::StreamWaitEvent), 1);
    assert!(dev.waits_on(b, a));
    r.decommit_for(0, MIB, b);
    dev.resume_stream(a).unwrap();
    dev.stream_synchronize(b).unwrap();
    // Both streams' work done and seen done (a fence polled): nothing to order.
    pool.synchronized();
    let before = dev.calls();
    assert!(!r.commit_for(0, MIB, true, a).unwrap());
    assert_eq!(dev.calls().since(&before).get(CallKind::StreamWaitEvent), 0);
    r.decommit(0, MIB);
}

/// Bytes of a shared region nothing queued uses any more (`decommit_idle`: the slab's chunks whose slots
/// were all idle) leave no stream on their page, so its next use for a stream — while another stream,
/// paused, has work queued elsewhere — neither synchronizes nor waits. A plain decommit there leaves the
/// unknown stream, whose reuse synchronizes (here: cannot, and the commit fails cleanly).
#[test]
fn idle_bytes_of_a_shared_page_order_nothing() {
    let dev = Arc::new(SimDevice::new());
    let pool = pool_with(&dev, PagePoolConfig::default());
    let (a, b) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
    let r = Region::new(&pool, 64 * MIB, "shared").unwrap();
    // Two chunks on one page; the first's bytes are idle when it goes.
    r.commit_for(0, 64 << 10, true, a).unwrap();
    r.commit_for(64 << 10, 64 << 10, true, a).unwrap();
    dev.pause_stream(a).unwrap();
    dev.memset_async(r.base() + (64 << 10), 0, 64 << 10, a)
        .unwrap();
    r.decommit_idle(0, 64 << 10);
    let before = dev.calls();
    assert!(
        !r.commit_for(0, 64 << 10, true, b).unwrap(),
        "idle bytes: for any stream"
    );
    let d = dev.calls().since(&before);
    assert_eq!(
        (
            d.get(CallKind::Synchronize),
            d.get(CallKind::StreamWaitEvent)
        ),
        (0, 0)
    );
    // The same with a plain decommit: the unknown stream's bytes would need a synchronize, which the
    // paused stream forbids.
    r.decommit(0, 64 << 10);
    r.decommit(64 << 10, 64 << 10);
    assert!(r.commit_for(0, 64 << 10, true, b).is_err());
    dev.resume_stream(a).unwrap();
    r.commit_for(0, 64 << 10, true, b).unwrap();
    r.decommit(0, 64 << 10);
}

/// A page's stream bits name frees whose work may still run; once a synchronize showed that work done,
/// the next free on the page replaces them instead of adding to them. Here a plain decommit leaves the
/// unknown stream; the next commit for A synchronizes for it (correct: unknown work) — and then, with A's
/// own work freed on the page while A is paused, a commit for B must wait on A's fence alone, not
/// synchronize again for the unknown stream's long-finished work (until session 24 the bits only grew).
#[test]
fn stream_bits_of_completed_frees_are_dropped_at_the_next_free() {
    let dev = Arc::new(SimDevice::new());
    let pool = pool_with(&dev, PagePoolConfig::default());
    let (a, b) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
    let r = Region::new(&pool, 64 * MIB, "shared").unwrap();
    r.commit_for(0, 64 << 10, true, a).unwrap();
    dev.memset_async(r.base(), 0, 64 << 10, a).unwrap();
    r.decommit(0, 64 << 10); // the page left free with the unknown stream
    let before = dev.calls();
    r.commit_for(0, 64 << 10, true, a).unwrap();
    assert_eq!(
        dev.calls().since(&before).get(CallKind::Synchronize),
        1,
        "unknown work: one synchronize"
    );
    dev.pause_stream(a).unwrap();
    dev.memset_async(r.base(), 0, 64 << 10, a).unwrap();
    r.decommit_for(0, 64 << 10, a);
    let before = dev.calls();
    assert!(
        r.commit_for(0, 64 << 10, true, b).unwrap(),
        "ordered after A: B's alone"
    );
    let d = dev.calls().since(&before);
    assert_eq!(
        d.get(CallKind::Synchronize),
        0,
        "no synchronize for work long done"
    );
    assert!(dev.waits_on(b, a));
    dev.resume_stream(a).unwrap();
    r.decommit(0, 64 << 10);
}

/// A block lands on an address whose old mapping (left by an aliasing move) is still busy: the pool
/// waits for that fence, not for the whole device, then maps. With the stream paused the wait cannot
/// end: the commit fails cleanly and succeeds once the stream runs.
#[test]
fn committing_over_a_busy_old_mapping_waits_for_its_fence() {
    let dev = Arc::new(SimDevice::new());
    let pool = pool_with(&dev, PagePoolConfig::default());
    pool.set_fence_stream(Some(0));
    let r = Region::new(&pool, 64 * MIB, "t").unwrap();
    r.commit(0, 2 * MIB, true).unwrap();
    dev.pause_stream(0).unwrap();
    r.decommit(0, 2 * MIB);
    r.commit(32 * MIB, 2 * MIB, true).unwrap(); // the page moves; page 0 keeps a zombie mapping
    assert_eq!(pool.stats().zombies, 1);
    // Page 0 again: a new page is needed there, and the old mapping must go first.
    let e = r.commit(0, 2 * MIB, true);
    assert!(matches!(e, Err(VmmError::Device(_))), "{e:?}");
    assert_eq!(
        pool.stats().pages_held,
        1,
        "nothing created by the failed commit"
    );
    dev.resume_stream(0).unwrap();
    r.commit(0, 2 * MIB, true).unwrap();
    // The commit first learnt that the fence completed, so the old mapping went with no wait at all.
    let s = pool.stats();
    assert_eq!((s.zombies, s.pages_held, s.syncs), (0, 2, 0), "{s:?}");
    assert_eq!(dev.calls().get(CallKind::Synchronize), 0);
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

fn keeping() -> PagePoolConfig {
    PagePoolConfig {
        keep_old_mappings: true,
        ..Default::default()
    }
}

/// Keeping old mappings: a page moved away and needed again at its first address comes back through the
/// mapping it left there — no map, no unmap, no synchronize — its address in between becoming the old
/// mapping; the data written through either address is the same physical memory.
#[test]
fn moved_pages_come_back_through_their_old_mappings() {
    let dev = Arc::new(SimDevice::config().backed(true).build().unwrap());
    let pool = pool_with(&dev, keeping());
    pool.set_fence_stream(Some(0));
    let r = Region::new(&pool, 64 * MIB, "t").unwrap();
    r.commit(0, 4 * MIB, true).unwrap(); // pages 0-1
    r.decommit(0, 4 * MIB);
    r.commit(32 * MIB, 4 * MIB, true).unwrap(); // pages 0-1 move to 16-17; 0-1 keep old mappings
    let s = pool.stats();
    assert_eq!((s.steals, s.zombies, s.returns, s.unmaps), (2, 2, 0, 0));
    // A pattern through every byte of the new address (which page went where is the pool's business).
    let pattern: Vec<u8> = (0..4 * MIB).map(|i| (i / PAGE) as u8 + 7).collect();
    dev.write(r.base() + 32 * MIB, &pattern).unwrap();
    r.decommit(32 * MIB, 4 * MIB);
    let before = dev.calls();
    r.commit(0, 4 * MIB, true).unwrap(); // back at 0-1 through the old mappings
    let d = dev.calls().since(&before);
    assert_eq!(
        (
            d.get(CallKind::Map),
            d.get(CallKind::Unmap),
            d.get(CallKind::Synchronize),
            d.get(CallKind::PhysCreate)
        ),
        (0, 0, 0, 0),
        "{d:?}"
    );
    let s = pool.stats();
    assert_eq!(
        (s.steals, s.returns, s.zombies, s.pages_held, s.pages_in_use),
        (2, 2, 2, 2, 2)
    );
    let mut back = vec![0u8; 4 * MIB as usize];
    dev.read(r.base(), &mut back).unwrap();
    // Each page came back to the address it left, which the move had filled highest page first.
    let mut halves: Vec<&[u8]> = back.chunks(PAGE as usize).collect();
    halves.reverse();
    assert!(
        halves.concat() == pattern,
        "the same physical pages, at the addresses they left"
    );
    // And forth again: 16-17 take their pages back the same way.
    r.decommit(0, 4 * MIB);
    r.commit(32 * MIB, 4 * MIB, true).unwrap();
    assert_eq!(dev.calls().since(&before).get(CallKind::Map), 0);
    assert_eq!(pool.stats().returns, 4);
    // Releasing unmaps the old mappings too: nothing is left mapped.
    r.decommit(32 * MIB, 4 * MIB);
    pool.release_unused().unwrap();
    let s = pool.stats();
    assert_eq!((s.pages_held, s.zombies), (0, 0), "{s:?}");
    assert_eq!(dev.outstanding().mappings, 0);
}

/// A pool keeping old mappings on one stream, with a region whose first `pages` pages were committed,
/// freed and then moved to page 16 on (committed there, still in use): old mappings of pages in use
/// elsewhere at 0..pages.
fn moved_and_in_use(dev: &Arc<SimDevice>, pages: u64) -> (Arc<PagePool>, Region) {
    let pool = pool_with(dev, keeping());
    pool.set_fence_stream(Some(0));
    let r = Region::new(&pool, 64 * MIB, "t").unwrap();
    r.commit(0, pages * PAGE, true).unwrap();
    r.decommit(0, pages * PAGE);
    r.commit(32 * MIB, pages * PAGE, true).unwrap();
    (pool, r)
}

/// An old mapping whose page is in use at its new address cannot bring it back: it is unmapped, and the
/// address gets another page (here a new one: nothing else is free).
#[test]
fn an_old_mapping_of_a_page_in_use_makes_way() {
    let dev = Arc::new(SimDevice::new());
    let (pool, r) = moved_and_in_use(&dev, 1); // page 0 moves to 16, still in use there
    let before = dev.calls();
    r.commit(0, 2 * MIB, true).unwrap();
    let d = dev.calls().since(&before);
    assert_eq!(
        (
            d.get(CallKind::Unmap),
            d.get(CallKind::PhysCreate),
            d.get(CallKind::Map)
        ),
        (1, 1, 1),
        "{d:?}"
    );
    let s = pool.stats();
    assert_eq!((s.returns, s.zombies, s.pages_held), (0, 0, 2), "{s:?}");
    r.decommit(0, 2 * MIB);
    r.decommit(32 * MIB, 2 * MIB);
}

/// A commit over several old mappings whose pages are in use elsewhere clears them together: one unmap
/// call for the run of consecutive addresses (session 26), not one a page; the moved pages' bytes stay
/// where they were moved, and the new pages at the old addresses are usable.
#[test]
fn old_mappings_in_the_way_go_in_one_unmap_a_run() {
    let dev = Arc::new(SimDevice::config().backed(true).build().unwrap());
    let (pool, r) = moved_and_in_use(&dev, 4); // pages 0-3 move to 16-19, still in use there
    let pattern: Vec<u8> = (0..8 * MIB).map(|i| (i / MIB) as u8 + 3).collect();
    dev.write(r.base() + 32 * MIB, &pattern).unwrap();
    assert_eq!(pool.stats().zombies, 4);
    let before = dev.calls();
    r.commit(0, 8 * MIB, true).unwrap(); // the old mappings at 0-3 must go; four new pages
    let d = dev.calls().since(&before);
    assert_eq!(
        (
            d.get(CallKind::Unmap),
            d.get(CallKind::PhysCreate),
            d.get(CallKind::Synchronize)
        ),
        (1, 4, 0),
        "{d:?}"
    );
    let s = pool.stats();
    assert_eq!(
        (s.zombies, s.unmaps, s.pages_held, s.pages_in_use),
        (0, 4, 8, 8),
        "{s:?}"
    );
    let mut back = vec![0u8; 8 * MIB as usize];
    dev.read(r.base() + 32 * MIB, &mut back).unwrap();
    assert!(back == pattern, "the moved pages kept their bytes");
    dev.write(r.base(), &pattern).unwrap();
    dev.read(r.base(), &mut back).unwrap();
    assert!(back == pattern, "the old addresses have pages of their own");
    r.decommit(0, 8 * MIB);
    r.decommit(32 * MIB, 8 * MIB);
}

/// A page unmapped from its last owner and cached (its region dropped) still comes back through an old
/// mapping left in another region, with no driver call.
#[test]
fn a_cached_page_comes_back_through_its_old_mapping() {
    let dev = Arc::new(SimDevice::new());
    let pool = pool_with(&dev, keeping());
    let a = Region::new(&pool, 16 * MIB, "a").unwrap();
    let b = Region::new(&pool, 16 * MIB, "b").unwrap();
    a.commit(0, 2 * MIB, true).unwrap();
    a.decommit(0, 2 * MIB);
    b.commit(0, 2 * MIB, true).unwrap(); // a's page moves to b; a keeps an old mapping of it
    b.decommit(0, 2 * MIB);
    drop(b); // unmaps b's page and caches its handle
    assert_eq!(pool.stats().pages_free_unmapped, 1);
    let before = dev.calls();
    a.commit(0, 2 * MIB, true).unwrap();
    let d = dev.calls().since(&before);
    assert_eq!(
        (d.get(CallKind::Map), d.get(CallKind::Unmap)),
        (0, 0),
        "{d:?}"
    );
    let s = pool.stats();
    assert_eq!((s.returns, s.zombies, s.pages_free_unmapped), (1, 0, 0));
    a.decommit(0, 2 * MIB);
    drop(a);
    drop(pool);
    let out = dev.outstanding();
    assert_eq!((out.mappings, out.phys_handles), (0, 0), "{out:?}");
}

/// Old mappings kept are bounded: past the pages held (at least 64), the oldest idle ones are unmapped.
#[test]
fn old_mappings_kept_are_bounded() {
    let dev = Arc::new(SimDevice::new());
    let pool = pool_with(&dev, keeping());
    let r = Region::new(&pool, 1024 * MIB, "t").unwrap();
    // Two pages walk through 200 addresses: each step leaves two old mappings behind.
    for k in 0..200u64 {
        r.commit(k * 4 * MIB, 4 * MIB, true).unwrap();
        r.decommit(k * 4 * MIB, 4 * MIB);
        pool.synchronized(); // idle: old mappings may go
    }
    let s = pool.stats();
    assert_eq!(s.pages_held, 2);
    assert!(s.zombies <= 64, "{s:?}");
    assert!(s.unmaps >= 2 * 199 - 64, "{s:?}");
    assert_eq!(
        dev.outstanding().mappings as u64,
        s.pages_free_mapped + s.zombies
    );
}

/// Several streams: a page taken back while work queued before its last free may still run (on any
/// stream) waits for one synchronize first, as a move would.
#[test]
fn several_streams_take_a_busy_page_back_after_one_synchronize() {
    let dev = Arc::new(SimDevice::new());
    let pool = pool_with(&dev, keeping());
    let r = Region::new(&pool, 64 * MIB, "t").unwrap();
    r.commit(0, 2 * MIB, true).unwrap();
    r.decommit(0, 2 * MIB);
    pool.synchronized();
    r.commit(32 * MIB, 2 * MIB, true).unwrap(); // cold: moves with no synchronize
    assert_eq!(pool.stats().syncs, 0);
    r.decommit(32 * MIB, 2 * MIB); // freed after the last synchronize: warm
    let before = dev.calls();
    r.commit(0, 2 * MIB, true).unwrap();
    let d = dev.calls().since(&before);
    assert_eq!(
        (d.get(CallKind::Synchronize), d.get(CallKind::Map)),
        (1, 0),
        "{d:?}"
    );
    assert_eq!(pool.stats().returns, 1);
    r.decommit(0, 2 * MIB);
}
