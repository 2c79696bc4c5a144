//! The extent arena over a gen-vmm region on a simulated device.
//!
//! Invariants checked by the property test after every action, against a model that only knows the live
//! `(ptr, size)` pairs:
//! 1. live blocks never overlap, lie inside the arena and start at multiples of 512 B; sizes are the
//!    request rounded to 512 B;
//! 2. `stats()` agrees with the model: live bytes/blocks, peak live, alloc/free counts;
//! 3. committed bytes are exactly the union of the pages touched by live blocks (computed in the model),
//!    agree with the page pool's pages in use, and the peak is the model's peak;
//! 4. `ExtentArena::check` (both free indexes, coalescing, tiling, tally against the region's references);
//! 5. best fit: the block lands where the model's smallest-then-lowest free gap says;
//! 6. after freeing everything nothing is committed and one free extent spans the arena.

use std::sync::Arc;

use gen_device::sim::SimDevice;
use gen_extent::{ExtentArena, ExtentConfig, TierError};
use gen_vmm::{PagePool, VmmError};
use proptest::prelude::*;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const PAGE: u64 = 64 * KIB;

fn setup(limit: Option<u64>) -> (Arc<SimDevice>, Arc<PagePool>) {
    gen_vmm::testing::sim_pages(PAGE, 1 << 30, limit)
}

fn arena(pool: &Arc<PagePool>, va_bytes: u64) -> ExtentArena {
    ExtentArena::new(
        pool,
        ExtentConfig {
            va_bytes,
            name: "test-extent",
            ..ExtentConfig::default()
        },
    )
    .unwrap()
}

fn pages_of(live: &[(u64, u64)]) -> u64 {
    gen_vmm::testing::pages_touched(live, PAGE)
}

fn cases() -> u32 {
    let default = if cfg!(miri) { 4 } else { 64 };
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[test]
fn default_va_is_default_va_times_the_device_memory() {
    let (_dev, pool) = setup(None);
    let a = ExtentArena::new(&pool, ExtentConfig::default()).unwrap();
    assert_eq!(
        a.stats().reserved_va_bytes,
        gen_extent::DEFAULT_VA_TIMES << 30
    );
    // A length that is not a whole number of pages is rounded up.
    let b = arena(&pool, MIB + 1);
    assert_eq!(b.stats().reserved_va_bytes, MIB + PAGE);
    let r = ExtentArena::new(
        &pool,
        ExtentConfig {
            va_bytes: u64::MAX,
            name: "huge",
            ..ExtentConfig::default()
        },
    );
    assert!(matches!(r, Err(TierError::InvalidConfig(_))), "{r:?}");
}

#[test]
fn blocks_pack_back_to_back_and_share_pages() {
    let (_dev, pool) = setup(None);
    let a = arena(&pool, 64 * MIB);
    let sizes = [100 * KIB, 1000, 3 * MIB + 7, 40 * KIB, 512];
    let mut live = Vec::new();
    let mut expect = a.alloc(sizes[0], true).unwrap();
    live.push((expect, sizes[0]));
    for &s in &sizes[1..] {
        expect += live.last().unwrap().1;
        let p = a.alloc(s, true).unwrap();
        assert_eq!(p, expect, "packed right behind the previous block");
        live.push((p, s.div_ceil(512) * 512));
    }
    let s = a.stats();
    assert_eq!(s.committed_bytes, pages_of(&live));
    assert_eq!(
        s.committed_bytes,
        s.live_bytes.div_ceil(PAGE) * PAGE,
        "no page wasted"
    );
    a.check().unwrap();
}

#[test]
fn free_decommits_and_coalesces() {
    let (_dev, pool) = setup(None);
    let a = arena(&pool, 8 * MIB);
    let x = a.alloc(MIB, true).unwrap();
    let y = a.alloc(MIB, true).unwrap();
    let z = a.alloc(MIB, true).unwrap();
    assert_eq!(a.free(y), Ok(MIB));
    assert_eq!(a.stats().committed_bytes, 2 * MIB);
    assert_eq!(a.stats().free_extents, 2);
    // Best fit: a 1 MiB request takes the 1 MiB hole, not the 5 MiB tail.
    assert_eq!(a.alloc(MIB, true), Ok(y));
    a.free(x).unwrap();
    a.free(z).unwrap();
    a.free(y).unwrap();
    let s = a.stats();
    assert_eq!(
        (s.free_extents, s.largest_free_extent, s.committed_bytes),
        (1, 8 * MIB, 0)
    );
    assert_eq!(pool.stats().pages_in_use, 0);
    a.check().unwrap();
}

#[test]
fn would_grow_and_out_of_memory_pass_through_and_change_nothing() {
    let (_dev, pool) = setup(Some(2 * PAGE));
    let a = arena(&pool, 8 * MIB);
    assert_eq!(a.alloc(1000, false), Err(TierError::WouldGrow { pages: 1 }));
    assert_eq!(a.stats().live_blocks, 0);
    let p = a.alloc(PAGE, true).unwrap();
    let before = a.stats();
    let r = a.alloc(2 * PAGE, true);
    assert!(
        matches!(r, Err(TierError::Vmm(VmmError::OutOfMemory { .. }))),
        "{r:?}"
    );
    assert_eq!(a.stats(), before);
    a.free(p).unwrap();
    assert_eq!(
        a.alloc(100, false),
        Ok(p),
        "cached page revived without growing"
    );
    a.check().unwrap();
}

#[test]
fn address_space_exhaustion_and_bad_sizes_are_typed() {
    let (_dev, pool) = setup(None);
    let a = arena(&pool, MIB);
    assert_eq!(a.alloc(0, true), Err(TierError::InvalidSize(0)));
    assert_eq!(
        a.alloc(u64::MAX, true),
        Err(TierError::InvalidSize(u64::MAX))
    );
    let p = a.alloc(MIB / 2, true).unwrap();
    assert_eq!(
        a.alloc(MIB / 2 + 1, true),
        Err(TierError::Exhausted {
            what: "extent address space",
            requested: MIB / 2 + 512,
            available: MIB / 2
        })
    );
    a.free(p).unwrap();
    a.check().unwrap();
}

#[test]
fn invalid_frees_are_typed_and_harmless() {
    let (_dev, pool) = setup(None);
    let a = arena(&pool, 8 * MIB);
    let p = a.alloc(4 * KIB, true).unwrap();
    let before = a.stats();
    for bad in [0, p + 1, p + 512, p + MIB, p - 1, u64::MAX] {
        assert_eq!(
            a.free(bad),
            Err(TierError::InvalidFree {
                ptr: bad,
                reason: "not the start of a live extent"
            }),
            "{bad:#x}"
        );
    }
    assert_eq!(a.stats(), before);
    assert!(a.owns(p) && a.owns(p + 8 * MIB - 1) && !a.owns(p + 8 * MIB) && !a.owns(p - 1));
    assert_eq!(a.block_size(p), Some(4 * KIB));
    assert_eq!(a.free(p), Ok(4 * KIB));
    assert_eq!(
        a.free(p),
        Err(TierError::InvalidFree {
            ptr: p,
            reason: "not the start of a live extent"
        }),
        "double free"
    );
    assert_eq!(a.trim(), 0);
    a.check().unwrap();
}

#[test]
fn drop_with_live_blocks_releases_everything() {
    let (dev, pool) = setup(None);
    {
        let a = arena(&pool, 8 * MIB);
        a.alloc(300 * KIB, true).unwrap();
        a.alloc(3 * MIB, true).unwrap();
    }
    assert_eq!(dev.outstanding().va_reservations, 0);
    assert_eq!(pool.stats().pages_in_use, 0);
}

#[test]
fn concurrent_alloc_free() {
    let (_dev, pool) = setup(None);
    let a = Arc::new(arena(&pool, 1 << 30));
    let rounds = if cfg!(miri) { 20 } else { 2000 };
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let a = a.clone();
            std::thread::spawn(move || {
                let mut mine: Vec<(u64, u64)> = Vec::new();
                for i in 0..rounds {
                    let size = 512 * (1 + (i * 7 + t * 13) % 200);
                    let p = a.alloc(size, true).unwrap();
                    assert!(a.owns(p));
                    mine.push((p, size));
                    if i % 3 == 2 {
                        let (q, s) = mine.swap_remove((i as usize * 5) % mine.len());
                        assert_eq!(a.free(q), Ok(s));
                    }
                }
                mine
            })
        })
        .collect();
    let mut live: Vec<(u64, u64)> = threads
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect();
    live.sort_unstable();
    for w in live.windows(2) {
        assert!(w[0].0 + w[0].1 <= w[1].0, "overlap {:x?}", w);
    }
    let s = a.stats();
    assert_eq!(s.live_blocks, live.len() as u64);
    assert_eq!(s.committed_bytes, pages_of(&live));
    a.check().unwrap();
}

#[derive(Clone, Debug)]
enum Action {
    Alloc(u64),
    Free(usize),
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        5 => (1..16 * KIB).prop_map(Action::Alloc),
        3 => (1..300 * KIB).prop_map(Action::Alloc),
        1 => (1..3 * MIB).prop_map(Action::Alloc),
        8 => any::<usize>().prop_map(Action::Free),
    ]
}

/// The model's best fit: the smallest free gap between live blocks that holds `size`, lowest first.
fn best_fit(live: &[(u64, u64)], base: u64, len: u64, size: u64) -> Option<u64> {
    let mut sorted = live.to_vec();
    sorted.sort_unstable();
    let mut gaps = Vec::new();
    let mut at = base;
    for &(p, s) in &sorted {
        if p > at {
            gaps.push((p - at, at));
        }
        at = p + s;
    }
    if base + len > at {
        gaps.push((base + len - at, at));
    }
    gaps.into_iter()
        .filter(|&(g, _)| g >= size)
        .min()
        .map(|(_, at)| at)
}

/// An arena of `va_bytes` whose old generation takes blocks of sizes whose last block outlived
/// `old_after` allocations (0: none).
fn arena_with_old(pool: &Arc<PagePool>, va_bytes: u64, old_after: u64) -> ExtentArena {
    ExtentArena::new(
        pool,
        ExtentConfig {
            va_bytes,
            name: "test-extent",
            old_after,
            ..ExtentConfig::default()
        },
    )
    .unwrap()
}

#[test]
fn a_size_whose_last_block_survived_goes_to_the_old_range_and_back_when_one_dies_young() {
    let (_dev, pool) = setup(None);
    let len = 16 * MIB;
    let a = arena_with_old(&pool, len, 4);
    let half = len / 2;
    let big = 256 * KIB;
    // A block live throughout: the arena never empties (which would end the run and forget).
    let keep = a.alloc(64 * KIB, true).unwrap();
    let base = keep;
    let w = a.alloc(big, true).unwrap();
    // Four short-lived blocks between: `big`'s block lives 4 allocations.
    for _ in 0..4 {
        let p = a.alloc(8 * KIB, true).unwrap();
        assert!(p < base + half, "a size with no history is young");
        a.free(p).unwrap();
    }
    a.free(w).unwrap();
    let old = a.alloc(big, true).unwrap();
    assert_eq!(old, base + half, "the old range's best fit");
    let s = a.stats();
    assert_eq!(
        (s.old_allocs, s.old_live_bytes, s.old_peak_live_bytes),
        (1, big, big)
    );
    let young = a.alloc(8 * KIB, true).unwrap();
    assert!(young < base + half, "8 KiB blocks died young: young range");
    a.free(old).unwrap();
    assert!(
        a.alloc(big, true).unwrap() < base + half,
        "big's last block lived 1 allocation"
    );
    a.check().unwrap();
    let s = a.stats();
    assert_eq!((s.live_blocks, s.live_bytes), (3, big + 72 * KIB));
    assert_eq!(
        (s.old_allocs, s.old_live_bytes, s.old_peak_live_bytes),
        (1, 0, big)
    );
}

#[test]
fn a_full_range_leaves_the_block_to_the_other_and_forgetting_sends_sizes_young() {
    let (_dev, pool) = setup(None);
    let len = 4 * MIB;
    let a = arena_with_old(&pool, len, 1);
    let half = len / 2;
    let base = a.alloc(512, true).unwrap();
    let filler = a.alloc(half - 512, true).unwrap();
    assert_eq!(filler, base + 512, "the young range is now full");
    // `512` survived one allocation: old. A young size finds the young range full and goes old too.
    a.free(base).unwrap();
    let p = a.alloc(512, true).unwrap();
    assert!(p >= base + half, "512 B survived: the old range ({p:#x})");
    let q = a.alloc(1024, true).unwrap();
    assert!(
        q >= base + half,
        "no room below: the old range takes a young block ({q:#x})"
    );
    // The old range full too: one block that fits nowhere is a typed error.
    assert!(matches!(
        a.alloc(half, true),
        Err(TierError::Exhausted { .. })
    ));
    a.free(filler).unwrap();
    a.free(p).unwrap();
    a.forget_lifetimes();
    let r = a.alloc(512, true).unwrap();
    assert_eq!(r, base, "forgotten: 512 B is young again");
    for p in [q, r] {
        a.free(p).unwrap();
    }
    let s = a.stats();
    assert_eq!(
        (s.live_blocks, s.committed_bytes, s.free_extents),
        (0, 0, 2)
    );
    assert_eq!(s.largest_free_extent, half);
    a.check().unwrap();
}

proptest! {
    // 64 cases by default (~1 s); PROPTEST_CASES overrides for a longer soak.
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn random_actions_match_the_model(actions in prop::collection::vec(action(), 1..120), old_after in prop_oneof![Just(0u64), 1..4u64]) {
        let (dev, pool) = setup(None);
        let len = 16 * MIB;
        let a = arena_with_old(&pool, len, old_after);
        // With an old generation the arena is two ranges, each laid out best fit.
        let at = if old_after > 0 { len / 2 / PAGE * PAGE } else { len };
        let mut live: Vec<(u64, u64)> = Vec::new();
        let (mut allocs, mut frees, mut peak, mut peak_live) = (0u64, 0u64, 0u64, 0u64);
        let mut base = None;
        for act in actions {
            match act {
                Action::Alloc(size) => {
                    let rounded = size.div_ceil(512) * 512;
                    let in_range = |b: u64, lo: u64, hi: u64| {
                        let l: Vec<(u64, u64)> = live.iter().copied().filter(|&(p, _)| p >= b + lo && p < b + hi).collect();
                        best_fit(&l, b + lo, hi - lo, rounded)
                    };
                    let young = base.and_then(|b| in_range(b, 0, at));
                    let old = base.and_then(|b| (at < len).then(|| in_range(b, at, len)).flatten());
                    let expect = young.or(old);
                    match a.alloc(size, true) {
                        Ok(p) => {
                            let b = *base.get_or_insert(p);
                            prop_assert_eq!(p % 512, 0);
                            prop_assert!(p >= b && p + rounded <= b + len);
                            if base.is_some() && expect.is_some() {
                                prop_assert!(Some(p) == young || Some(p) == old, "not the best fit of either range: {:#x}", p);
                            }
                            prop_assert!(live.iter().all(|&(q, s)| p + rounded <= q || q + s <= p), "overlap at {:#x}", p);
                            live.push((p, rounded));
                            allocs += 1;
                        }
                        Err(TierError::Exhausted { .. }) => prop_assert_eq!(expect, None),
                        Err(e) => return Err(TestCaseError::fail(e.to_string())),
                    }
                }
                Action::Free(i) if !live.is_empty() => {
                    let (p, s) = live.swap_remove(i % live.len());
                    prop_assert_eq!(a.free(p), Ok(s));
                    frees += 1;
                }
                Action::Free(_) => prop_assert!(a.free(0x1000).is_err()),
            }
            let s = a.stats();
            let committed = pages_of(&live);
            let live_bytes: u64 = live.iter().map(|&(_, s)| s).sum();
            peak = peak.max(committed);
            peak_live = peak_live.max(live_bytes);
            prop_assert_eq!(s.live_bytes, live_bytes);
            prop_assert_eq!(s.peak_live_bytes, peak_live);
            prop_assert_eq!(s.live_blocks, live.len() as u64);
            prop_assert_eq!((s.allocs, s.frees), (allocs, frees));
            prop_assert_eq!(s.committed_bytes, committed);
            prop_assert_eq!(s.peak_committed_bytes, peak);
            prop_assert_eq!(pool.stats().pages_in_use * PAGE, committed);
            prop_assert!(live.iter().all(|&(p, _)| a.owns(p)));
            if let Err(e) = a.check() {
                return Err(TestCaseError::fail(e));
            }
        }
        for (p, s) in live.drain(..) {
            prop_assert_eq!(a.free(p), Ok(s));
        }
        let s = a.stats();
        let ranges = if at < len { 2 } else { 1 };
        prop_assert_eq!((s.committed_bytes, s.free_extents, s.largest_free_extent), (0, ranges, at));
        prop_assert_eq!(pool.stats().pages_in_use, 0);
        drop(a);
        prop_assert_eq!(dev.outstanding().va_reservations, 0);
    }
}
