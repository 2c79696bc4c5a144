//! Unit tests of the classifier's behaviour through its public API.

use super::*;

fn feat(size: u64, site: u64) -> Features {
    Features {
        size,
        stream: 0,
        device: 0,
        site: Some(site),
        hint: None,
    }
}

/// Horizons of the defaults on the allocation clock with the byte clock kept (no byte bound), so
/// outcomes report lifetimes in bytes too.
fn with_bytes(b: ClassifierConfigBuilder) -> ClassifierConfigBuilder {
    let d = ClassifierConfig::default();
    b.short_horizon(Horizon {
        bytes: u64::MAX - 1,
        ..d.short_horizon()
    })
    .mid_horizon(Horizon {
        bytes: u64::MAX - 1,
        ..d.mid_horizon()
    })
}

/// [`plain`] with the default sampled tracking (one allocation in 8 of a warm key).
fn sampled() -> Classifier {
    Classifier::new(
        ClassifierConfig::builder()
            .prior_burst_allocs(0)
            .build()
            .unwrap(),
    )
}

/// A classifier with no burst prior, every allocation tracked and the byte clock
/// kept, so tests control every input and every free is scored.
fn plain() -> Classifier {
    Classifier::new(
        with_bytes(ClassifierConfig::builder())
            .prior_burst_allocs(0)
            .sample_every(1)
            .build()
            .unwrap(),
    )
}

/// Allocates `n` filler blocks of a distinct key and frees each at once (advances the clock by `n`).
fn filler(c: &Classifier, n: u64) {
    for _ in 0..n {
        let s = c.on_alloc(&feat(512, 999));
        c.on_free(&s, 512);
    }
}

#[test]
fn learns_short_and_mid_keys() {
    let c = plain();
    for _ in 0..10 {
        let s = c.on_alloc(&feat(4096, 1));
        let o = c.on_free(&s, 4096).unwrap();
        assert_eq!(o.actual, Lifetime::Short);
        assert_eq!(o.lifetime_allocs, 0);
    }
    assert_eq!(c.on_alloc(&feat(4096, 1)).predicted(), Lifetime::Short);
    for _ in 0..4 {
        let s = c.on_alloc(&feat(1 << 20, 2));
        filler(&c, 100);
        let o = c.on_free(&s, 1 << 20).unwrap();
        assert_eq!(o.actual, Lifetime::Mid);
        assert_eq!(o.lifetime_allocs, 100);
        assert_eq!(o.lifetime_bytes, 100 * 512);
    }
    assert_eq!(c.on_alloc(&feat(1 << 20, 2)).predicted(), Lifetime::Mid);
    // The other key is unaffected.
    assert_eq!(c.on_alloc(&feat(4096, 1)).predicted(), Lifetime::Short);
}

#[test]
fn overdue_short_is_noticed_before_free() {
    let c = plain();
    for _ in 0..10 {
        let s = c.on_alloc(&feat(8192, 7));
        c.on_free(&s, 8192);
    }
    // Three blocks predicted Short stay live for more than two epochs.
    let held: Vec<Stamp> = (0..3).map(|_| c.on_alloc(&feat(8192, 7))).collect();
    assert!(held.iter().all(|s| s.predicted() == Lifetime::Short));
    filler(&c, 200);
    assert_eq!(
        c.stats().overdue_short,
        0,
        "nothing is swept until the key allocates again"
    );
    let next = c.on_alloc(&feat(8192, 7));
    let st = c.stats();
    assert_eq!(st.overdue_short, 3);
    assert_eq!(st.misses_corrected, 1);
    assert_eq!(
        next.predicted(),
        Lifetime::Mid,
        "the key was corrected before any of them was freed"
    );
    // Their frees are scored as misses but not learned twice.
    for s in &held {
        let o = c.on_free(s, 8192).unwrap();
        assert!(o.mispredicted);
        assert_eq!(o.actual, Lifetime::Mid);
    }
    assert_eq!(c.confusion().counts[0][1], 3);
}

#[test]
fn drift_flips_within_a_few_observations() {
    let c = plain();
    for _ in 0..30 {
        let s = c.on_alloc(&feat(65536, 3));
        c.on_free(&s, 65536);
    }
    let mut flips_after = None;
    for i in 1..=10 {
        let s = c.on_alloc(&feat(65536, 3));
        filler(&c, 100);
        c.on_free(&s, 65536);
        if c.on_alloc(&feat(65536, 3)).predicted() == Lifetime::Mid {
            flips_after = Some(i);
            break;
        }
    }
    let n = flips_after.expect("key never flipped");
    assert!(n <= 3, "flipped after {n} observations");
    assert!(c.stats().drift_events >= 1);
}

#[test]
fn hint_overrides_and_is_scored() {
    let c = plain();
    for _ in 0..10 {
        let s = c.on_alloc(&feat(4096, 1));
        c.on_free(&s, 4096);
    }
    let s = c.on_alloc(&Features {
        hint: Some(Lifetime::Long),
        ..feat(4096, 1)
    });
    assert_eq!(s.predicted(), Lifetime::Long);
    let o = c.on_free(&s, 4096).unwrap();
    assert!(o.mispredicted);
    assert_eq!(o.actual, Lifetime::Short);
    assert_eq!(
        c.confusion().counts[Lifetime::Long.index()][Lifetime::Short.index()],
        1
    );
    assert_eq!(c.stats().hinted, 1);
}

#[test]
fn priors_for_unseen_keys() {
    let c = Classifier::new(ClassifierConfig::builder().sample_every(1).build().unwrap());
    // Before the first free of a run (weights being created): Long.
    assert_eq!(c.on_alloc(&feat(1 << 24, 10)).predicted(), Lifetime::Long);
    let s = c.on_alloc(&feat(3072, 11));
    assert_eq!(s.predicted(), Lifetime::Long);
    c.on_free(&s, 3072);
    // After frees, an unseen key with an unseen size bucket: Short.
    assert_eq!(c.on_alloc(&feat(700, 12)).predicted(), Lifetime::Short);
    // The coarse size bucket teaches unseen keys of the same size (it samples every 4th free).
    for _ in 0..16 {
        let s = c.on_alloc(&feat(96 << 10, 13));
        filler(&c, 100);
        c.on_free(&s, 96 << 10);
    }
    assert_eq!(c.on_alloc(&feat(96 << 10, 14)).predicted(), Lifetime::Mid);
    // A burst of allocations without frees makes unseen keys Long again.
    for i in 0..16 {
        c.on_alloc(&feat(512, 100 + i));
    }
    assert_eq!(c.on_alloc(&feat(96 << 10, 15)).predicted(), Lifetime::Long);
}

#[test]
fn marks_set_the_period() {
    let c = plain();
    assert_eq!(c.iteration_period(), None);
    c.mark_iteration();
    filler(&c, 100);
    assert_eq!(c.iteration_period(), None, "one mark gives no period");
    c.mark_iteration();
    assert_eq!(c.iteration_period(), Some(100));
    filler(&c, 250);
    c.mark_iteration();
    assert_eq!(c.iteration_period(), Some(250));
    c.mark_iteration();
    assert_eq!(
        c.iteration_period(),
        Some(250),
        "two marks with nothing between keep the period"
    );
}

/// Nothing but marks gives a period: a stream that repeats exactly every 100 allocations (which the
/// removed detector adopted within a few iterations) has none without them.
#[test]
fn no_marks_no_period() {
    let c = Classifier::new(ClassifierConfig::default());
    for _ in 0..200 {
        for a in 0..100u64 {
            let s = c.on_alloc(&feat(4096 << (a % 4), a));
            c.on_free(&s, 4096 << (a % 4));
        }
    }
    assert_eq!(c.iteration_period(), None);
}

/// One iteration of 100 allocations: the same features allocated at position 0 (freed at the end of the
/// iteration: Mid) and at position 60 (freed at once: Short). Returns the two predictions of the last of
/// `iterations` iterations.
fn two_phase_loop(c: &Classifier, iterations: usize, marks: bool) -> (Lifetime, Lifetime) {
    let mut last = (Lifetime::Long, Lifetime::Long);
    for _ in 0..iterations {
        if marks {
            c.mark_iteration();
        }
        let held = c.on_alloc(&feat(1 << 20, 5));
        filler(c, 59);
        let brief = c.on_alloc(&feat(1 << 20, 5));
        c.on_free(&brief, 1 << 20);
        filler(c, 39);
        c.on_free(&held, 1 << 20);
        last = (held.predicted(), brief.predicted());
    }
    last
}

/// With marks the position in the iteration is part of the key: the block allocated at the start and
/// the one allocated at position 60 (phase buckets 0 and 4 of 8) are learnt apart, each right. Without
/// marks they are one key and get one prediction.
#[test]
fn marks_put_the_phase_in_the_key() {
    let c = plain();
    assert_eq!(
        two_phase_loop(&c, 20, true),
        (Lifetime::Mid, Lifetime::Short)
    );
    assert_eq!(c.iteration_period(), Some(100));
    let (held, brief) = two_phase_loop(&plain(), 20, false);
    assert_eq!(held, brief, "without marks the phase plays no part");
    let one_bucket = Classifier::new(
        with_bytes(ClassifierConfig::builder())
            .prior_burst_allocs(0)
            .sample_every(1)
            .phase_buckets(1)
            .build()
            .unwrap(),
    );
    let (held, brief) = two_phase_loop(&one_bucket, 20, true);
    assert_eq!(held, brief, "one phase bucket ignores the position");
}

#[test]
fn finish_scores_old_blocks_long_and_censors_young() {
    let c = plain();
    let old = c.on_alloc(&feat(1 << 20, 1));
    filler(&c, 100);
    let young = c.on_alloc(&feat(1 << 20, 2));
    c.finish([(old, 1 << 20), (young, 1 << 20)].into_iter());
    let m = c.confusion();
    assert_eq!(m.total_count(), 101);
    assert_eq!(m.counts[old.predicted().index()][Lifetime::Long.index()], 1);
    assert_eq!(c.stats().censored, 1);
    assert_eq!(c.stats().frees, 100);
}

#[test]
fn confusion_math() {
    let m = Confusion {
        counts: [[8, 1, 0], [1, 4, 0], [0, 0, 2]],
        bytes: [[800, 100, 0], [300, 400, 0], [0, 0, 400]],
    };
    assert_eq!(m.total_count(), 16);
    assert!((m.accuracy_count() - 14.0 / 16.0).abs() < 1e-12);
    assert!((m.accuracy_bytes() - 1600.0 / 2000.0).abs() < 1e-12);
    assert!((m.byte_share(Lifetime::Short) - 1100.0 / 2000.0).abs() < 1e-12);
    assert!((m.count_share(Lifetime::Long) - 2.0 / 16.0).abs() < 1e-12);
    assert!((m.recall(Lifetime::Mid) - 0.8).abs() < 1e-12);
    assert!((m.precision(Lifetime::Mid) - 0.8).abs() < 1e-12);
    assert_eq!(Confusion::default().accuracy_count(), 0.0);
    assert!(m.to_string().contains("Short"));
}

#[test]
fn config_validation() {
    let h = |a| Horizon {
        allocs: a,
        bytes: u64::MAX,
    };
    assert!(ClassifierConfig::builder().build().is_ok());
    assert_eq!(
        ClassifierConfig::builder().build().unwrap(),
        ClassifierConfig::default()
    );
    assert!(matches!(
        ClassifierConfig::builder()
            .short_horizon(h(100))
            .mid_horizon(h(100))
            .build(),
        Err(ConfigError::Horizons { .. })
    ));
    assert!(matches!(
        ClassifierConfig::builder().short_horizon(h(0)).build(),
        Err(ConfigError::Horizons { .. })
    ));
    assert_eq!(
        ClassifierConfig::builder().decay(1.0).build(),
        Err(ConfigError::Decay(1.0))
    );
    assert_eq!(
        ClassifierConfig::builder().capacity(1000).build(),
        Err(ConfigError::Capacity(1000))
    );
    assert_eq!(
        ClassifierConfig::builder().max_probes(0).build(),
        Err(ConfigError::Probes(0))
    );
    assert_eq!(
        ClassifierConfig::builder().size_sub_bits(4).build(),
        Err(ConfigError::SizeSubBits(4))
    );
    assert_eq!(
        ClassifierConfig::builder().phase_buckets(0).build(),
        Err(ConfigError::PhaseBuckets(0))
    );
}

#[test]
fn byte_clock_horizon() {
    let c = Classifier::new(
        ClassifierConfig::builder()
            .sample_every(1)
            .short_horizon(Horizon {
                allocs: 64,
                bytes: 1 << 20,
            })
            .build()
            .unwrap(),
    );
    let s = c.on_alloc(&feat(512, 1));
    c.on_alloc(&feat(2 << 20, 2));
    let o = c.on_free(&s, 512).unwrap();
    assert_eq!(o.lifetime_allocs, 1);
    assert_eq!(o.lifetime_bytes, 2 << 20);
    assert_eq!(
        o.actual,
        Lifetime::Mid,
        "short on the alloc clock, not on the byte clock"
    );
}

#[test]
fn full_table_falls_back_to_prior() {
    let c = Classifier::new(
        ClassifierConfig::builder()
            .sample_every(1)
            .capacity(64)
            .max_probes(1)
            .build()
            .unwrap(),
    );
    for i in 0..1000 {
        let s = c.on_alloc(&feat(512, i));
        c.on_free(&s, 512);
    }
    let st = c.stats();
    assert!(st.keys <= 64);
    assert!(st.unkeyed > 0);
    assert_eq!(st.frees, 1000);
}

#[test]
fn foreign_stamp_does_not_panic() {
    let big = plain();
    let small = Classifier::new(
        ClassifierConfig::builder()
            .capacity(64)
            .sample_every(1)
            .build()
            .unwrap(),
    );
    filler(&big, 1000);
    let mut stamps = Vec::new();
    for i in 0..200 {
        stamps.push(big.on_alloc(&feat(512, i)));
    }
    for s in &stamps {
        small.on_free(s, 512);
    }
    assert_eq!(small.stats().frees, 200);
}

#[test]
fn shared_between_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Classifier>();
    let c = Classifier::new(ClassifierConfig::builder().sample_every(1).build().unwrap());
    let per = if cfg!(miri) { 50 } else { 20_000 };
    std::thread::scope(|sc| {
        for t in 0..4u64 {
            let c = &c;
            sc.spawn(move || {
                let mut held = Vec::with_capacity(8);
                for i in 0..per {
                    held.push(c.on_alloc(&Features {
                        size: 512 << (i % 6),
                        stream: t,
                        device: 0,
                        site: None,
                        hint: None,
                    }));
                    if held.len() == 8 {
                        for (j, s) in held.drain(..).enumerate() {
                            c.on_free(&s, 512 << ((i + 1 - 8 + j as u64) % 6));
                        }
                    }
                }
            });
        }
    });
    let st = c.stats();
    assert_eq!(st.allocs, 4 * per);
    assert_eq!(st.frees, 4 * per);
    assert_eq!(c.confusion().total_count(), 4 * per);
}

#[test]
fn the_per_call_fields_fill_the_first_two_cache_lines() {
    use std::mem::{align_of, offset_of};
    assert_eq!(align_of::<Classifier>(), 64);
    assert_eq!(
        offset_of!(Classifier, byte_clock),
        64,
        "line 0: the allocation clock, the phase, the key table"
    );
    assert!(
        offset_of!(Classifier, drift_min_obs) + 4 <= 128,
        "line 1: the copied configuration"
    );
}

#[test]
fn a_warm_key_tracks_one_allocation_in_sample_every() {
    let c = sampled();
    assert_eq!(c.config().sample_every(), 8);
    let n = 8000;
    let mut tracked = 0;
    for _ in 0..n {
        let s = c.on_alloc(&feat(4096, 1));
        if c.on_free(&s, 4096).is_some() {
            tracked += 1;
        }
    }
    // The first `track_below` (4) allocations of the key are all tracked, then about one in eight.
    assert!(
        (n / 8 - n / 40..=n / 8 + n / 40).contains(&tracked),
        "{tracked} of {n} tracked"
    );
    assert_eq!(c.confusion().total_count(), tracked);
    // Untracked allocations still get the key's prediction.
    assert_eq!(c.on_alloc(&feat(4096, 1)).predicted(), Lifetime::Short);
}

#[test]
fn a_key_that_turns_mid_is_learnt_from_its_samples() {
    let c = sampled();
    for _ in 0..100 {
        let s = c.on_alloc(&feat(1 << 20, 7));
        c.on_free(&s, 1 << 20);
    }
    assert_eq!(c.on_alloc(&feat(1 << 20, 7)).predicted(), Lifetime::Short);
    // Now every block of the key lives 100 allocations: within a few tracked samples it is Mid.
    let mut flipped = None;
    for i in 0..400 {
        let s = c.on_alloc(&feat(1 << 20, 7));
        filler(&c, 100);
        c.on_free(&s, 1 << 20);
        if c.on_alloc(&feat(1 << 20, 7)).predicted() == Lifetime::Mid {
            flipped = Some(i);
            break;
        }
    }
    let i = flipped.expect("a key whose blocks all live 100 allocations never turned Mid");
    assert!(i < 200, "turned Mid only after {i} blocks");
}

#[test]
fn sampling_rates_are_validated() {
    for bad in [0, 3, 512] {
        assert!(matches!(
            ClassifierConfig::builder().sample_every(bad).build(),
            Err(ConfigError::Sampling(_))
        ));
    }
    assert!(ClassifierConfig::builder().sample_every(1).build().is_ok());
    assert!(ClassifierConfig::builder()
        .sample_every(256)
        .build()
        .is_ok());
}
