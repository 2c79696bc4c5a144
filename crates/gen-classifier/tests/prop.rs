//! Property test of the stamp / outcome bookkeeping against a reference model.
//!
//! Invariants, after any sequence of allocations, frees (in any order), iteration marks and a final
//! `finish`, under small horizons and tiny tables (so overdue sweeps, bucket eviction and table-full
//! fall-backs all happen):
//! - nothing panics;
//! - every `Outcome` reports the lifetime the model measured on both clocks, `actual` is
//!   `classify(lifetime)` and `mispredicted == (actual != predicted)`;
//! - the confusion matrix equals the model's tally of (predicted, actual), in counts and in bytes;
//! - `stats().allocs`, `stats().frees` and `censored` add up: every allocation is scored at most once.

use gen_classifier::{Classifier, ClassifierConfig, Features, Horizon, Lifetime, Stamp};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Action {
    Alloc {
        size: u64,
        stream: u64,
        site: Option<u64>,
        hint: Option<Lifetime>,
    },
    Free {
        pick: usize,
    },
    Mark,
}

fn lifetime() -> impl Strategy<Value = Lifetime> {
    prop_oneof![
        Just(Lifetime::Short),
        Just(Lifetime::Mid),
        Just(Lifetime::Long)
    ]
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        6 => (0u64..(1 << 22), 0u64..3, proptest::option::of(0u64..6), proptest::option::weighted(0.1, lifetime()))
            .prop_map(|(size, stream, site, hint)| Action::Alloc { size, stream, site, hint }),
        5 => any::<usize>().prop_map(|pick| Action::Free { pick }),
        1 => Just(Action::Mark),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: if cfg!(miri) { 4 } else { 256 }, ..ProptestConfig::default() })]

    #[test]
    fn bookkeeping_adds_up(
        actions in proptest::collection::vec(action(), 0..400),
        short in 1u64..8,
        mid_extra in 1u64..40,
        probes in 1u32..4,
        byte_short in proptest::option::of(1u64..(1 << 24)),
        sample_shift in 0u32..4,
        track_below in 0u32..6,
    ) {
        // With a byte bound on the short horizon the byte clock runs; without one it does not, and
        // outcomes report 0 bytes.
        let bytes_on = byte_short.is_some();
        let sample_every = 1u32 << sample_shift;
        let cfg = ClassifierConfig::builder()
            .short_horizon(Horizon { allocs: short, bytes: byte_short.unwrap_or(u64::MAX) })
            .mid_horizon(Horizon { allocs: short + mid_extra, bytes: u64::MAX })
            .sample_every(sample_every)
            .track_below(track_below)
            .capacity(64)
            .max_probes(probes)
            .build()
            .unwrap();
        let c = Classifier::new(cfg);
        let mut live: Vec<(Stamp, u64, u64, u64)> = Vec::new(); // stamp, size, alloc index, bytes after
        let (mut clock, mut bytes, mut frees) = (0u64, 0u64, 0u64);
        let mut counts = [[0u64; 3]; 3];
        let mut sums = [[0u64; 3]; 3];
        for a in &actions {
            match *a {
                Action::Alloc { size, stream, site, hint } => {
                    let s = c.on_alloc(&Features { size, stream, device: 0, site, hint });
                    if let Some(h) = hint {
                        prop_assert_eq!(s.predicted(), h);
                    }
                    clock += 1;
                    bytes += size;
                    prop_assert_eq!(s.alloc_clock(), clock);
                    if bytes_on {
                        prop_assert_eq!(s.byte_clock(), bytes);
                    }
                    live.push((s, size, clock, bytes));
                }
                Action::Free { pick } if !live.is_empty() => {
                    let (s, size, at, b) = live.swap_remove(pick % live.len());
                    let Some(o) = c.on_free(&s, size) else {
                        prop_assert!(!s.is_tracked());
                        prop_assert!(sample_every > 1, "with sample_every 1 every free is scored");
                        continue;
                    };
                    prop_assert!(s.is_tracked());
                    let lb = if bytes_on { bytes - b } else { 0 };
                    prop_assert_eq!(o.lifetime_allocs, clock - at);
                    prop_assert_eq!(o.lifetime_bytes, lb);
                    prop_assert_eq!(o.actual, c.classify(clock - at, lb));
                    prop_assert_eq!(o.mispredicted, o.actual != s.predicted());
                    counts[s.predicted().index()][o.actual.index()] += 1;
                    sums[s.predicted().index()][o.actual.index()] += size;
                    frees += 1;
                }
                Action::Free { .. } => {}
                Action::Mark => c.mark_iteration(),
            }
        }
        let mut censored = 0;
        for (s, size, at, b) in live.iter().filter(|l| l.0.is_tracked()) {
            let lb = if bytes_on { bytes - b } else { 0 };
            if c.config().short_horizon().fits(clock - at, lb) {
                censored += 1;
            } else {
                counts[s.predicted().index()][Lifetime::Long.index()] += 1;
                sums[s.predicted().index()][Lifetime::Long.index()] += size;
            }
        }
        c.finish(live.iter().map(|(s, size, _, _)| (*s, *size)));
        let m = c.confusion();
        let st = c.stats();
        prop_assert_eq!(m.counts, counts);
        prop_assert_eq!(m.bytes, sums);
        prop_assert_eq!(st.allocs, clock);
        prop_assert_eq!(st.frees, frees);
        prop_assert_eq!(st.censored, censored);
        prop_assert!(st.keys <= 64);
        let live_tracked = live.iter().filter(|l| l.0.is_tracked()).count() as u64;
        prop_assert_eq!(m.total_count() + censored, frees + live_tracked);
    }
}
