//! Property tests of the reference allocators ([`Bfc`], [`ReferenceBuddy`]).
//!
//! Invariants, for any sequence of allocs and frees:
//! 1. every returned address is aligned to [`MIN_ALIGN`];
//! 2. no two live blocks overlap (checked against a reference model: a map of live ranges);
//! 3. `reserved() >= ` live bytes, and `peak_reserved() >= reserved()`;
//! 4. freeing an address that is not live is `InvalidFree`, and changes nothing;
//! 5. after everything is freed, all memory is back: free bytes == reserved, one free chunk per
//!    region (BFC) / root (buddy), and a block as large as the largest region fits without growth.

use std::collections::BTreeMap;

use gen_trace::*;
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Action {
    Alloc(u64),
    Free(usize),
    BadFree(u64),
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        5 => prop_oneof![1u64..4096, 4096u64..(1 << 20), (1u64 << 20)..(9 << 20)].prop_map(Action::Alloc),
        4 => any::<usize>().prop_map(Action::Free),
        1 => any::<u64>().prop_map(Action::BadFree),
    ]
}

fn check<A: ReplayAllocator>(
    a: &mut A,
    actions: &[Action],
    stats: impl Fn(&A) -> ReferenceStats,
) -> Result<(), TestCaseError> {
    let mut live: BTreeMap<u64, u64> = BTreeMap::new();
    let mut live_bytes = 0u64;
    for act in actions {
        match *act {
            Action::Alloc(size) => {
                let p = a.alloc(size, 0, None).unwrap();
                prop_assert_eq!(p % MIN_ALIGN, 0);
                if let Some((&s, &z)) = live.range(..=p).next_back() {
                    prop_assert!(s + z <= p, "overlap with [{s:#x}, +{z})");
                }
                if let Some((&s, _)) = live.range(p..).next() {
                    prop_assert!(p + size <= s, "overlap with block at {s:#x}");
                }
                live.insert(p, size);
                live_bytes += size;
            }
            Action::Free(i) if !live.is_empty() => {
                let (&p, &size) = live.iter().nth(i % live.len()).unwrap();
                live.remove(&p);
                live_bytes -= size;
                a.free(p, size, 0).unwrap();
            }
            Action::Free(_) => {}
            Action::BadFree(p) => {
                if !live.contains_key(&p) {
                    let before = stats(a);
                    prop_assert_eq!(a.free(p, 512, 0), Err(ReplayError::InvalidFree { ptr: p }));
                    prop_assert_eq!(stats(a), before);
                }
            }
        }
        prop_assert!(a.reserved() >= live_bytes);
        prop_assert!(a.peak_reserved() >= a.reserved());
        prop_assert_eq!(stats(a).used_chunks, live.len() as u64);
    }
    for (&p, &size) in &live {
        a.free(p, size, 0).unwrap();
    }
    let s = stats(a);
    prop_assert_eq!(s.free_bytes, a.reserved());
    prop_assert_eq!(s.free_chunks, s.regions);
    prop_assert_eq!(s.used_chunks, 0);
    Ok(())
}

fn cases() -> u32 {
    if cfg!(miri) {
        4
    } else {
        128
    }
}

/// Actions per program (fewer under Miri, which runs each step thousands of times slower).
fn program_len() -> usize {
    if cfg!(miri) {
        24
    } else {
        200
    }
}

/// Under Miri (isolation on) no regression file is read or written: proptest's file persistence needs
/// the working directory.
fn config() -> ProptestConfig {
    let mut c = ProptestConfig {
        cases: cases(),
        ..ProptestConfig::default()
    };
    if cfg!(miri) {
        c.failure_persistence = None;
    }
    c
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn bfc_invariants(actions in prop::collection::vec(action(), 0..program_len())) {
        let mut a = Bfc::default();
        check(&mut a, &actions, Bfc::stats)?;
        // Every region is whole again: a block the size of the first (smallest) region fits.
        if a.reserved() > 0 {
            let r = a.reserved();
            a.alloc(2 << 20, 0, None).unwrap();
            prop_assert_eq!(a.reserved(), r);
        }
    }

    #[test]
    fn buddy_invariants(actions in prop::collection::vec(action(), 0..program_len())) {
        let mut a = ReferenceBuddy::default();
        check(&mut a, &actions, ReferenceBuddy::stats)?;
        if a.reserved() > 0 {
            let r = a.reserved();
            a.alloc(2 << 20, 0, None).unwrap();
            prop_assert_eq!(a.reserved(), r);
        }
    }
}

#[test]
fn bfc_region_growth_doubles_up_to_the_cap() {
    let mut a = Bfc::new(BfcConfig {
        min_region: 2 << 20,
        max_region: 8 << 20,
    });
    // Each fill of the current regions takes a new one: 2, 4, 8, 8 MiB.
    let mut sizes = Vec::new();
    let mut last = 0;
    for _ in 0..22 {
        a.alloc(1 << 20, 0, None).unwrap();
        if a.reserved() != last {
            sizes.push((a.reserved() - last) >> 20);
            last = a.reserved();
        }
    }
    assert_eq!(sizes, vec![2, 4, 8, 8]);
    // A request bigger than the next region gets a region of its own size (rounded to 2 MiB).
    a.alloc(19 << 20, 0, None).unwrap();
    assert_eq!((a.reserved() - last) >> 20, 20);
    assert!(matches!(
        a.alloc(0, 0, None),
        Err(ReplayError::InvalidRequest { .. })
    ));
    assert!(matches!(
        a.alloc(u64::MAX, 0, None),
        Err(ReplayError::InvalidRequest { .. })
    ));
}

#[test]
fn bfc_best_fit_and_coalescing() {
    let mut a = Bfc::default();
    let x = a.alloc(4096, 0, None).unwrap();
    let y = a.alloc(1024, 0, None).unwrap();
    let z = a.alloc(8192, 0, None).unwrap();
    let _w = a.alloc(512, 0, None).unwrap();
    assert_eq!((y, z), (x + 4096, x + 5120));
    a.free(x, 4096, 0).unwrap();
    a.free(z, 8192, 0).unwrap();
    // 4 KiB hole and 8 KiB hole: a 3 KiB request goes to the smaller.
    assert_eq!(a.alloc(3072, 0, None).unwrap(), x);
    a.free(x, 3072, 0).unwrap();
    a.free(y, 1024, 0).unwrap();
    // x, y, z merged into one 13 KiB chunk.
    assert_eq!(a.alloc(13 << 10, 0, None).unwrap(), x);
}
