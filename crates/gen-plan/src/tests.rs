use std::collections::HashMap;

/// The default configuration, packing on the caller's thread: these tests follow the sequence
/// allocation by allocation.
fn foreground() -> PlanConfig {
    PlanConfig {
        background: false,
        ..PlanConfig::default()
    }
}

use super::*;

/// One event of a synthetic program.
#[derive(Clone, Copy, Debug)]
enum Ev {
    Alloc(u32, u64),
    Free(u32),
}

/// A training-like iteration: `layers` identical layers each keeping an activation for backward and
/// making two temporaries, a loss, then backward freeing activations in reverse while gradients appear,
/// and an optimizer step that frees the gradients. Ids are unique per iteration (`base`).
fn iteration(base: u32, layers: u32, scale: u64) -> Vec<Ev> {
    let mut ev = Vec::new();
    let mut id = base;
    let mut next = || {
        id += 1;
        id
    };
    let mut acts = Vec::new();
    for _ in 0..layers {
        let a = next();
        ev.push(Ev::Alloc(a, 4096 * scale));
        let t1 = next();
        ev.push(Ev::Alloc(t1, 3072 * scale));
        let t2 = next();
        ev.push(Ev::Alloc(t2, 1024 * scale));
        ev.push(Ev::Free(t1));
        ev.push(Ev::Free(t2));
        acts.push(a);
    }
    let loss = next();
    ev.push(Ev::Alloc(loss, 8192 * scale));
    ev.push(Ev::Free(loss));
    let mut grads = Vec::new();
    for a in acts.into_iter().rev() {
        let g = next();
        ev.push(Ev::Alloc(g, 2048 * scale));
        let t = next();
        ev.push(Ev::Alloc(t, 5120 * scale));
        ev.push(Ev::Free(t));
        ev.push(Ev::Free(a));
        grads.push(g);
    }
    for g in grads {
        ev.push(Ev::Free(g));
    }
    ev
}

/// Drives a planner like its owner does and checks that planned blocks never overlap live planned ones.
struct Owner {
    planner: Planner,
    live: HashMap<u32, (Ticket, Option<(u64, u64)>)>,
    mapped: bool,
    releases: u32,
    planned_allocs: u64,
    allocs: u64,
    /// Serve a plan as soon as it is ready (an owner may decline, as the engine does while its tiers
    /// move no page).
    serve: bool,
}

impl Owner {
    fn new(cfg: PlanConfig) -> Self {
        Owner {
            planner: Planner::new(cfg),
            live: HashMap::new(),
            mapped: false,
            releases: 0,
            planned_allocs: 0,
            allocs: 0,
            serve: true,
        }
    }

    fn run(&mut self, evs: &[Ev]) {
        for &e in evs {
            match e {
                Ev::Alloc(id, size) => {
                    let d = self.planner.on_alloc(size);
                    self.allocs += 1;
                    let range = match d {
                        Decision::Planned { offset, .. } => {
                            assert!(self.mapped, "planned before activation");
                            self.planned_allocs += 1;
                            let r = (offset, offset + size);
                            assert!(r.1 <= self.planner.stats().footprint);
                            for (other, &(_, o)) in &self.live {
                                if let Some(o) = o {
                                    assert!(r.1 <= o.0 || o.1 <= r.0, "{id} overlaps live {other}");
                                }
                            }
                            Some(r)
                        }
                        Decision::Unplanned { .. } => None,
                    };
                    self.live.insert(id, (d.ticket(), range));
                    if self.planner.take_release() {
                        self.release();
                    }
                    if self.serve && self.planner.wants_activation().is_some() {
                        assert!(!self.mapped);
                        self.mapped = true;
                        self.planner.activate();
                    }
                }
                Ev::Free(id) => {
                    let (t, _) = self.live.remove(&id).expect("live");
                    if t.is_tracked() && self.planner.on_free(t) {
                        self.release();
                    }
                }
            }
        }
    }

    fn release(&mut self) {
        assert!(self.mapped);
        assert!(
            self.live.values().all(|(t, _)| !t.is_planned()),
            "range released with planned blocks live"
        );
        self.mapped = false;
        self.releases += 1;
    }
}

#[test]
fn a_training_loop_is_planned_and_served_from_its_plan() {
    let mut o = Owner::new(PlanConfig {
        confirm: 256,
        max_period: 1024,
        ..foreground()
    });
    // Weights: long-lived, never freed.
    o.run(&[Ev::Alloc(1, 1 << 20), Ev::Alloc(2, 1 << 20)]);
    let per_iter = iteration(0, 12, 1)
        .iter()
        .filter(|e| matches!(e, Ev::Alloc(..)))
        .count() as u64;
    for it in 0..20 {
        o.run(&iteration(1000 * (it + 1), 12, 1));
    }
    let s = o.planner.stats();
    assert!(s.active, "{s:?}");
    assert_eq!(s.period, per_iter, "the iteration, not one layer");
    assert_eq!(s.activations, 1);
    // Once active, every allocation of an iteration is planned.
    let before = o.planned_allocs;
    o.run(&iteration(99_000, 12, 1));
    assert_eq!(
        o.planned_allocs - before,
        per_iter,
        "{:?}",
        o.planner.stats()
    );
    assert!(
        s.footprint as f64 <= 1.05 * s.lower_bound as f64,
        "footprint {} vs bound {}",
        s.footprint,
        s.lower_bound
    );
}

#[test]
#[cfg_attr(
    miri,
    ignore = "long under Miri; the same code paths run in the other tests"
)]
fn a_shape_change_is_served_elsewhere_and_a_new_regime_is_replanned() {
    let mut o = Owner::new(PlanConfig {
        confirm: 256,
        max_period: 1024,
        ..foreground()
    });
    for it in 0..16 {
        o.run(&iteration(1000 * (it + 1), 10, 1));
    }
    assert!(o.planner.stats().active);
    // One odd iteration (a different batch shape): misses, nothing overlaps, the plan survives.
    o.run(&iteration(50_000, 10, 3));
    let s = o.planner.stats();
    assert!(s.misses > 0 && s.active, "{s:?}");
    o.run(&iteration(51_000, 10, 1));
    // A lasting change: the plan is dropped, its range released once drained, and the new shape planned.
    for it in 0..30 {
        o.run(&iteration(100_000 + 1000 * it, 10, 2));
    }
    let s = o.planner.stats();
    assert!(s.deactivations >= 1, "{s:?}");
    assert!(o.releases >= 1);
    assert!(s.active && s.activations >= 2, "{s:?}");
}

#[test]
fn a_block_that_outlives_its_recording_is_not_overwritten() {
    let mut o = Owner::new(PlanConfig {
        confirm: 256,
        max_period: 1024,
        ..foreground()
    });
    for it in 0..16 {
        o.run(&iteration(1000 * (it + 1), 8, 1));
    }
    assert!(o.planner.stats().active);
    // This iteration keeps every activation alive to the end (frees delayed): the checker in `run`
    // asserts no planned block is placed over a live one.
    let mut ev = iteration(70_000, 8, 1);
    let (frees, rest): (Vec<Ev>, Vec<Ev>) = ev.drain(..).partition(|e| matches!(e, Ev::Free(_)));
    o.run(&rest);
    o.run(&frees);
    assert!(o.planner.stats().blocked > 0, "{:?}", o.planner.stats());
    o.run(&iteration(80_000, 8, 1));
}

#[test]
#[cfg_attr(
    miri,
    ignore = "long under Miri; the same code paths run in the other tests"
)]
fn an_aperiodic_sequence_is_never_planned() {
    let mut o = Owner::new(PlanConfig {
        confirm: 256,
        max_period: 1024,
        ..foreground()
    });
    let mut s = 0x2545_f491_4f6c_dd1du64;
    let mut live: Vec<u32> = Vec::new();
    for id in 0..if cfg!(miri) { 2_000 } else { 40_000 } {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        o.run(&[Ev::Alloc(id, 512 * (1 + s % 64))]);
        live.push(id);
        if live.len() > 20 {
            let k = (s >> 20) as usize % live.len();
            o.run(&[Ev::Free(live.swap_remove(k))]);
        }
    }
    let st = o.planner.stats();
    assert_eq!(st.activations, 0, "{st:?}");
    assert_eq!(o.planned_allocs, 0);
}

/// A ready plan the owner does not serve, dropped when the sequence leaves it, is not packed again at
/// once: the planner waits a number of periods that doubles with each such drop (packing is its one
/// costly step).
#[test]
#[cfg_attr(miri, ignore = "long under Miri")]
fn ready_plans_that_lose_the_sequence_back_off() {
    let mut o = Owner::new(PlanConfig {
        confirm: 256,
        max_period: 1024,
        ..foreground()
    });
    o.serve = false;
    let mut base = 0;
    let mut iterations_until_ready = || {
        let mut n = 0;
        while o.planner.stats().period == 0 {
            base += 1000;
            o.run(&iteration(base, 10, 1));
            n += 1;
            assert!(n < 400, "never ready again");
        }
        // Leave the sequence: the ready plan is dropped.
        base += 1000;
        o.run(&iteration(base, 10, 3));
        assert_eq!(o.planner.stats().period, 0);
        n
    };
    let waits: Vec<u32> = (0..4).map(|_| iterations_until_ready()).collect();
    assert!(waits[3] > waits[1] && waits[2] > waits[0], "{waits:?}");
    assert_eq!(o.planner.stats().activations, 0);
}

/// Run whole iterations until the planner is active; with background packing, wait (as a program's
/// time passes) whenever a period is being packed. Returns the iterations run.
fn run_until_active(o: &mut Owner, first_id: u32, max_iters: u32) -> u32 {
    for it in 0..max_iters {
        o.run(&iteration(first_id + 1000 * it, 12, 1));
        if o.planner.stats().active {
            return it + 1;
        }
        if o.planner.packing() {
            // As a program's time passes (a loaded machine may be slow to run the packing thread).
            assert!(
                o.planner.wait_packed(std::time::Duration::from_secs(30)),
                "never packed"
            );
        }
    }
    panic!(
        "not active after {max_iters} iterations: {:?}",
        o.planner.stats()
    );
}

#[test]
#[cfg_attr(
    miri,
    ignore = "threads and sleeps; the foreground path is the same code"
)]
fn background_packing_serves_the_same_plan() {
    let cfg = PlanConfig {
        confirm: 256,
        max_period: 1024,
        ..foreground()
    };
    let mut fg = Owner::new(cfg.clone());
    let mut bg = Owner::new(PlanConfig {
        background: true,
        ..cfg
    });
    run_until_active(&mut fg, 1000, 40);
    run_until_active(&mut bg, 1000, 40);
    let (a, b) = (fg.planner.stats(), bg.planner.stats());
    assert_eq!(
        (a.period, a.footprint, a.lower_bound),
        (b.period, b.footprint, b.lower_bound)
    );
    // Served alike: after the iteration of the switch, whole iterations planned (the owner checks no
    // planned block overlaps a live one).
    for o in [&mut fg, &mut bg] {
        o.run(&iteration(400_000, 12, 1));
        let before = o.planned_allocs;
        o.run(&iteration(500_000, 12, 1));
        assert_eq!(
            o.planned_allocs - before,
            a.period,
            "{:?}",
            o.planner.stats()
        );
    }
}

#[test]
#[cfg_attr(
    miri,
    ignore = "threads and sleeps; the foreground path is the same code"
)]
fn a_plan_packed_late_picks_the_sequence_up_where_it_is() {
    let mut o = Owner::new(PlanConfig {
        confirm: 256,
        max_period: 1024,
        background: true,
        ..foreground()
    });
    o.run(&[Ev::Alloc(1, 1 << 20)]);
    let mut it = 0;
    while !o.planner.packing() {
        assert!(it < 40, "never recorded: {:?}", o.planner.stats());
        o.planner.hold_packed = true;
        o.run(&iteration(1000 * (it + 1), 12, 1));
        it += 1;
    }
    // The program goes on for part of an iteration (37 allocations and their frees, an offset that is
    // no multiple of anything in the period) while the plan is "still being packed".
    let next = iteration(1000 * (it + 1), 12, 1);
    let cut = next
        .iter()
        .enumerate()
        .filter(|(_, e)| matches!(e, Ev::Alloc(..)))
        .nth(37)
        .map(|(i, _)| i)
        .unwrap();
    o.run(&next[..cut]);
    assert!(
        o.planner.wait_packed(std::time::Duration::from_secs(30)),
        "never packed"
    );
    o.planner.hold_packed = false;
    o.run(&next[cut..]);
    assert!(!o.planner.packing(), "picked up");
    assert!(o.planner.stats().period > 0, "{:?}", o.planner.stats());
    // It follows from mid-iteration, activates at its phase and then plans whole iterations.
    run_until_active(&mut o, 1000 * (it + 2), 10);
    o.run(&iteration(600_000, 12, 1));
    let before = o.planned_allocs;
    o.run(&iteration(700_000, 12, 1));
    let s = o.planner.stats();
    assert_eq!(o.planned_allocs - before, s.period, "{s:?}");
    assert_eq!(s.aborted_recordings, 0, "{s:?}");
}

#[test]
fn pausing_drops_what_needs_every_allocation_and_detection_starts_again() {
    let mut o = Owner::new(PlanConfig {
        confirm: 256,
        max_period: 1024,
        ..foreground()
    });
    o.serve = false; // an owner whose tiers move no page: plans stay ready, never served
    let mut id = 0;
    let mut iters = 0;
    while !o.planner.stats().recording {
        o.run(&iteration(id, 12, 1));
        id += 1000;
        iters += 1;
        assert!(iters < 40, "no period recorded: {:?}", o.planner.stats());
    }
    let aborted = o.planner.stats().aborted_recordings;
    // Paused mid-recording (blocks of the recording still live): the recording is dropped.
    o.planner.pause();
    let s = o.planner.stats();
    assert!(!s.recording && s.period == 0, "{s:?}");
    assert_eq!(s.aborted_recordings, aborted + 1);
    // The frees of blocks it had recorded are harmless; the loop resumes after a gap and is detected,
    // recorded and packed again into a ready plan.
    while o.planner.stats().period == 0 {
        o.run(&iteration(id, 12, 1));
        id += 1000;
        iters += 1;
        assert!(iters < 80, "never planned again: {:?}", o.planner.stats());
    }
    assert!(!o.planner.stats().active);
    // A ready plan cannot follow the sequence across a pause: dropped too.
    let aborted = o.planner.stats().aborted_recordings;
    o.planner.pause();
    let s = o.planner.stats();
    assert_eq!(s.aborted_recordings, aborted + 1);
    assert_eq!(
        (s.period, s.recording, s.active),
        (0, false, false),
        "{s:?}"
    );
    assert!(o.live.is_empty());
}
