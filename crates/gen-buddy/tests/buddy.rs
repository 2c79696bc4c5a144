//! The buddy tier over gen-vmm regions on a simulated device.
//!
//! Invariants checked by the property test after every action, against a model that only knows the live
//! `(ptr, size)` pairs:
//! 1. live blocks never overlap and start at multiples of 512 B; sizes are the request rounded to 512 B;
//! 2. `stats()` agrees with the model: live bytes/blocks, alloc/free counts;
//! 3. committed bytes are exactly the union of the pages touched by live blocks (computed in the model),
//!    agree with the page pool's pages in use, and the peak is the model's peak;
//! 4. `Buddy::check` (bitmaps, free lists, tiling, tally against the region's own page references);
//! 5. `owns` holds for every live pointer;
//! 6. after freeing everything nothing is committed, and after `trim` no region (no VA) is held.

use std::sync::Arc;

use gen_buddy::{Buddy, BuddyConfig, TierError, MAX_REGIONS};
use gen_device::sim::SimDevice;
use gen_vmm::{PagePool, VmmError};
use proptest::prelude::*;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const PAGE: u64 = 64 * KIB;

fn setup(limit: Option<u64>) -> (Arc<SimDevice>, Arc<PagePool>) {
    gen_vmm::testing::sim_pages(PAGE, 1 << 30, limit)
}

fn buddy(pool: &Arc<PagePool>, region_len: u64) -> Buddy {
    Buddy::new(
        pool,
        BuddyConfig {
            region_len,
            name: "test-buddy",
        },
    )
    .unwrap()
}

fn pages_of(live: &[(u64, u64)]) -> u64 {
    gen_vmm::testing::pages_touched(live, PAGE)
}

#[test]
fn rejects_bad_config_and_sizes() {
    let (_dev, pool) = setup(None);
    for region_len in [0, 3 * MIB, PAGE / 2, 1 << 63] {
        let r = Buddy::new(
            &pool,
            BuddyConfig {
                region_len,
                name: "bad",
            },
        );
        assert!(
            matches!(r, Err(TierError::InvalidConfig(_))),
            "region_len {region_len:#x}: {r:?}"
        );
    }
    let b = buddy(&pool, MIB);
    assert_eq!(b.alloc(0, true), Err(TierError::InvalidSize(0)));
    assert_eq!(
        b.alloc(u64::MAX, true),
        Err(TierError::InvalidSize(u64::MAX))
    );
    assert_eq!(b.stats().regions, 0);
}

#[test]
fn exact_fit_packs_the_tail_and_commits_only_block_bytes() {
    let (_dev, pool) = setup(None);
    let b = buddy(&pool, 4 * MIB);
    // 1.5 MiB + 512 B takes a 2 MiB buddy block but commits only its 25 pages (1.5 MiB / 64 KiB + 1).
    let a = b.alloc(3 * MIB / 2 + 1, true).unwrap();
    let s = b.stats();
    assert_eq!(s.live_bytes, 3 * MIB / 2 + 512);
    assert_eq!(s.committed_bytes, 25 * PAGE);
    // The tail [1.5 MiB + 512, 2 MiB) went back as aligned pieces of 512 B, 1 KiB, ..., 256 KiB. None
    // below the frontier holds 100 KiB, so it goes at the frontier, right behind the first block,
    // sharing its last page (a run over the 512 B .. 64 KiB pieces and part of the 128 KiB one).
    let c = b.alloc(100 * KIB, true).unwrap();
    assert_eq!(c, a + 3 * MIB / 2 + 512);
    assert_eq!(
        b.stats().committed_bytes,
        pages_of(&[(a, 3 * MIB / 2 + 512), (c, 100 * KIB)])
    );
    assert_eq!(b.stats().regions, 1);
    b.check().unwrap();
    assert_eq!(b.free(a), Ok(3 * MIB / 2 + 512));
    assert_eq!(b.free(c), Ok(100 * KIB));
    assert_eq!(b.stats().committed_bytes, 0);
    b.check().unwrap();
}

#[test]
fn small_blocks_share_pages() {
    let (_dev, pool) = setup(None);
    let b = buddy(&pool, 4 * MIB);
    let mut live = Vec::new();
    for i in 0..200u64 {
        let size = 512 * (1 + i % 23); // 512 B .. 11.5 KiB
        live.push((b.alloc(size, true).unwrap(), size));
    }
    let s = b.stats();
    assert_eq!(s.committed_bytes, pages_of(&live));
    // Packed from address 0 with exact fit: the pages touched are within one page of the live bytes
    // rounded up (the buddy's tail pieces are used smallest-first, so little address space is skipped).
    assert!(
        s.committed_bytes <= (s.live_bytes.div_ceil(PAGE) + 1) * PAGE,
        "committed {} for {} live",
        s.committed_bytes,
        s.live_bytes
    );
    assert_eq!(pool.stats().pages_in_use * PAGE, s.committed_bytes);
    b.check().unwrap();
}

#[test]
fn would_grow_passes_through_and_changes_nothing() {
    let (_dev, pool) = setup(None);
    let b = buddy(&pool, MIB);
    assert_eq!(b.alloc(1000, false), Err(TierError::WouldGrow { pages: 1 }));
    let s = b.stats();
    assert_eq!(
        (s.regions, s.live_blocks, s.committed_bytes, s.allocs),
        (0, 0, 0, 0)
    );
    let p = b.alloc(1000, true).unwrap();
    b.free(p).unwrap();
    // The page is cached by the pool now: no growth needed.
    let q = b.alloc(1000, false).unwrap();
    assert_eq!(q, p, "lowest address reused");
    b.free(q).unwrap();
    b.check().unwrap();
}

#[test]
fn out_of_memory_passes_through_and_changes_nothing() {
    let (_dev, pool) = setup(Some(2 * PAGE));
    let b = buddy(&pool, MIB);
    let p = b.alloc(PAGE, true).unwrap();
    let before = b.stats();
    let r = b.alloc(2 * PAGE, true);
    assert!(
        matches!(r, Err(TierError::Vmm(VmmError::OutOfMemory { .. }))),
        "{r:?}"
    );
    assert_eq!(b.stats(), before);
    b.check().unwrap();
    b.free(p).unwrap();
}

#[test]
fn invalid_frees_are_typed_and_harmless() {
    let (_dev, pool) = setup(None);
    let b = buddy(&pool, MIB);
    assert_eq!(
        b.free(0x1234),
        Err(TierError::InvalidFree {
            ptr: 0x1234,
            reason: "not the start of a live buddy block"
        })
    );
    let p = b.alloc(4 * KIB, true).unwrap();
    let before = b.stats();
    for bad in [p + 1, p + 512, p + 64 * KIB, p - 1, u64::MAX] {
        assert_eq!(
            b.free(bad),
            Err(TierError::InvalidFree {
                ptr: bad,
                reason: "not the start of a live buddy block"
            }),
            "{bad:#x}"
        );
    }
    assert_eq!(b.stats(), before);
    assert_eq!(b.free(p), Ok(4 * KIB));
    assert_eq!(
        b.free(p),
        Err(TierError::InvalidFree {
            ptr: p,
            reason: "not the start of a live buddy block"
        }),
        "double free"
    );
    b.check().unwrap();
}

#[test]
fn oversize_blocks_get_their_own_region_and_trim_releases_empty_ones() {
    let (dev, pool) = setup(None);
    let b = buddy(&pool, MIB);
    let small = b.alloc(10 * KIB, true).unwrap();
    let big = b.alloc(3 * MIB, true).unwrap();
    let s = b.stats();
    assert_eq!(s.regions, 2);
    assert_eq!(s.reserved_va_bytes, MIB + 4 * MIB);
    assert!(b.owns(small) && b.owns(big) && b.owns(big + 4 * MIB - 1));
    // The oversize region's tail serves an ordinary request too.
    let tail = b.alloc(MIB, true).unwrap();
    assert_eq!(tail, big + 3 * MIB);
    b.free(tail).unwrap();
    b.free(big).unwrap();
    // Wholly free, but the only empty region: kept (hysteresis) until trim.
    assert_eq!(b.stats().regions, 2);
    assert_eq!(b.trim(), 4 * MIB);
    assert_eq!(b.stats().regions, 1);
    assert!(!b.owns(big));
    assert!(b.owns(small));
    b.free(small).unwrap();
    assert_eq!(b.trim(), MIB);
    let s = b.stats();
    assert_eq!(
        (s.regions, s.reserved_va_bytes, s.committed_bytes),
        (0, 0, 0)
    );
    assert!(!b.owns(small));
    assert_eq!(dev.outstanding().va_reservations, 0);
    assert_eq!(pool.stats().pages_in_use, 0);
}

#[test]
fn a_second_empty_region_is_released_on_free() {
    let (dev, pool) = setup(None);
    let b = buddy(&pool, MIB);
    let x = b.alloc(MIB, true).unwrap();
    let y = b.alloc(MIB, true).unwrap();
    assert_eq!(b.stats().regions, 2);
    b.free(x).unwrap();
    assert_eq!(b.stats().regions, 2, "first empty region kept");
    b.free(y).unwrap();
    assert_eq!(b.stats().regions, 1, "second empty region released at once");
    assert_eq!(dev.outstanding().va_reservations, 1);
    b.check().unwrap();
}

#[test]
fn region_table_full_is_an_error_and_changes_nothing() {
    let (dev, pool) = setup(None);
    let b = buddy(&pool, PAGE);
    let ptrs: Vec<u64> = (0..MAX_REGIONS)
        .map(|_| b.alloc(PAGE, true).unwrap())
        .collect();
    let before = b.stats();
    assert_eq!(
        b.alloc(PAGE, true),
        Err(TierError::Exhausted {
            what: "buddy regions",
            requested: 1,
            available: MAX_REGIONS as u64
        })
    );
    assert_eq!(b.stats(), before);
    assert_eq!(dev.outstanding().va_reservations, MAX_REGIONS);
    for p in ptrs {
        b.free(p).unwrap();
    }
    assert_eq!(b.stats().regions, 1);
    b.alloc(PAGE, true).unwrap();
    b.check().unwrap();
}

#[test]
fn drop_with_live_blocks_releases_everything() {
    let (dev, pool) = setup(None);
    {
        let b = buddy(&pool, MIB);
        b.alloc(300 * KIB, true).unwrap();
        b.alloc(3 * MIB, true).unwrap();
    }
    assert_eq!(dev.outstanding().va_reservations, 0);
    assert_eq!(pool.stats().pages_in_use, 0);
}

#[test]
fn concurrent_alloc_free_and_owns() {
    let (_dev, pool) = setup(None);
    let b = Arc::new(buddy(&pool, 64 * MIB));
    let rounds = if cfg!(miri) { 20 } else { 2000 };
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let b = b.clone();
            std::thread::spawn(move || {
                let mut mine: Vec<(u64, u64)> = Vec::new();
                for i in 0..rounds {
                    let size = 512 * (1 + (i * 7 + t * 13) % 200);
                    let p = b.alloc(size, true).unwrap();
                    assert!(b.owns(p));
                    mine.push((p, size));
                    if i % 3 == 2 {
                        let (q, s) = mine.swap_remove((i as usize * 5) % mine.len());
                        assert_eq!(b.free(q), Ok(s.div_ceil(512) * 512));
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
    let s = b.stats();
    assert_eq!(s.live_blocks, live.len() as u64);
    assert_eq!(s.committed_bytes, pages_of(&live));
    b.check().unwrap();
}

fn cases() -> u32 {
    let default = if cfg!(miri) { 4 } else { 64 };
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[derive(Clone, Debug)]
enum Action {
    Alloc(u64),
    Free(usize),
    Trim,
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        6 => (1..16 * KIB).prop_map(Action::Alloc),
        3 => (1..300 * KIB).prop_map(Action::Alloc),
        1 => (1..3 * MIB).prop_map(Action::Alloc),
        8 => any::<usize>().prop_map(Action::Free),
        1 => Just(Action::Trim),
    ]
}

proptest! {
    // 64 cases by default (~1 s); PROPTEST_CASES overrides for a longer soak.
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn random_actions_match_the_model(actions in prop::collection::vec(action(), 1..120)) {
        let (dev, pool) = setup(None);
        let b = buddy(&pool, MIB);
        let mut live: Vec<(u64, u64)> = Vec::new();
        let (mut allocs, mut frees, mut peak) = (0u64, 0u64, 0u64);
        for a in actions {
            match a {
                Action::Alloc(size) => {
                    let p = b.alloc(size, true).unwrap();
                    let rounded = size.div_ceil(512) * 512;
                    prop_assert_eq!(p % 512, 0);
                    prop_assert!(live.iter().all(|&(q, s)| p + rounded <= q || q + s <= p), "overlap at {:#x}", p);
                    live.push((p, rounded));
                    allocs += 1;
                }
                Action::Free(i) if !live.is_empty() => {
                    let (p, s) = live.swap_remove(i % live.len());
                    prop_assert_eq!(b.free(p), Ok(s));
                    frees += 1;
                }
                Action::Free(_) => prop_assert!(b.free(0x1000).is_err()),
                Action::Trim => { b.trim(); }
            }
            let s = b.stats();
            let committed = pages_of(&live);
            peak = peak.max(committed);
            prop_assert_eq!(s.live_bytes, live.iter().map(|&(_, s)| s).sum::<u64>());
            prop_assert_eq!(s.live_blocks, live.len() as u64);
            prop_assert_eq!((s.allocs, s.frees), (allocs, frees));
            prop_assert_eq!(s.committed_bytes, committed);
            prop_assert_eq!(s.peak_committed_bytes, peak);
            prop_assert_eq!(pool.stats().pages_in_use * PAGE, committed);
            prop_assert!(live.iter().all(|&(p, _)| b.owns(p)));
            if let Err(e) = b.check() {
                return Err(TestCaseError::fail(e));
            }
        }
        for (p, s) in live.drain(..) {
            prop_assert_eq!(b.free(p), Ok(s));
        }
        prop_assert_eq!(b.stats().committed_bytes, 0);
        prop_assert_eq!(pool.stats().pages_in_use, 0);
        b.trim();
        let s = b.stats();
        prop_assert_eq!((s.regions, s.reserved_va_bytes), (0, 0));
        prop_assert_eq!(dev.outstanding().va_reservations, 0);
    }
}
