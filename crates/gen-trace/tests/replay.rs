//! Replay driver tests: figures on hand-made traces, the instrumented pass catching overlapping and
//! misaligned blocks, errors wrapped with pass and op, leftovers freed between passes, JSON keys.

use gen_trace::*;

fn trace(events: &[(EventKind, u64, u64)]) -> Trace {
    let ev = events
        .iter()
        .enumerate()
        .map(|(i, &(kind, addr, size))| Event {
            t_us: i as u64,
            kind,
            addr,
            size,
            stream: 0,
            site: if kind == EventKind::Alloc { 42 } else { 0 },
        })
        .collect();
    Trace::from_events("t", ev).unwrap()
}

use EventKind::{Alloc as A, Free as F};

/// A wrapper that counts calls and records what the replay passes in.
struct Spy<T> {
    inner: T,
    allocs: u64,
    frees: u64,
    marks: u32,
    ends: u32,
    sites: Vec<Option<u64>>,
    live: u64,
}

impl<T: ReplayAllocator> ReplayAllocator for Spy<T> {
    fn name(&self) -> String {
        format!("spy({})", self.inner.name())
    }
    fn alloc(&mut self, size: u64, stream: u64, site: Option<u64>) -> Result<u64, ReplayError> {
        self.allocs += 1;
        self.live += 1;
        self.sites.push(site);
        self.inner.alloc(size, stream, site)
    }
    fn free(&mut self, ptr: u64, size: u64, stream: u64) -> Result<(), ReplayError> {
        self.frees += 1;
        self.live -= 1;
        self.inner.free(ptr, size, stream)
    }
    fn reserved(&self) -> u64 {
        self.inner.reserved()
    }
    fn peak_reserved(&self) -> u64 {
        self.inner.peak_reserved()
    }
    fn mark_iteration(&mut self) {
        self.marks += 1;
    }
    fn end_pass(&mut self) {
        assert_eq!(self.live, 0, "end_pass comes after every block is freed");
        self.ends += 1;
    }
}

fn spy<T>(inner: T) -> Spy<T> {
    Spy {
        inner,
        allocs: 0,
        frees: 0,
        marks: 0,
        ends: 0,
        sites: Vec::new(),
        live: 0,
    }
}

#[test]
fn replay_protocol_and_figures() {
    // 1 MiB + 512 B live at peak; one block never freed.
    let t = trace(&[
        (A, 0x1000, 1 << 20),
        (A, 0x2000, 512),
        (F, 0x1000, 1 << 20),
        (A, 0x3000, 4096),
        (F, 0x3000, 4096),
    ]);
    let mut s = spy(Bfc::default());
    let opts = ReplayOptions {
        passes: 4,
        ignore_site: false,
    };
    let r = replay(&t, &mut s, &opts).unwrap();
    assert_eq!(
        (s.allocs, s.frees),
        (12, 12),
        "leftovers freed after each pass"
    );
    assert_eq!((s.marks, s.ends), (4, 4));
    assert!(s.sites.iter().all(|&x| x == Some(42)));
    assert_eq!(r.trace, "t");
    assert_eq!(r.allocator, "spy(bfc)");
    assert_eq!(r.device, "host");
    assert_eq!(r.ops, 5);
    assert_eq!(r.peak_live, (1 << 20) + 512);
    assert_eq!(r.peak_reserved, 2 << 20, "one 2 MiB BFC region");
    assert_eq!(r.ratio, Some((2 << 20) as f64 / ((1 << 20) + 512) as f64));
    assert_eq!(r.passes, 4);
    assert_eq!(r.ns_per_op_passes.len(), 3);
    let mut sorted = r.ns_per_op_passes.clone();
    sorted.sort_by(f64::total_cmp);
    assert_eq!(r.ns_per_op, Some(sorted[1]), "median of passes 2..N");

    let mut s = spy(ReferenceBuddy::default());
    let opts = ReplayOptions {
        passes: 1,
        ignore_site: true,
    };
    let r = replay(&t, &mut s, &opts).unwrap();
    assert!(s.sites.iter().all(|&x| x.is_none()));
    assert_eq!((r.ns_per_op, r.ns_per_op_passes.len()), (None, 0));
    assert!(r.ignore_site);

    // Site 0 means "unknown": the allocator gets None even when sites are not ignored.
    let mut unknown = t.clone();
    for e in &mut unknown.events {
        e.site = 0;
    }
    let mut s = spy(ReferenceBuddy::default());
    replay(&unknown, &mut s, &ReplayOptions::default()).unwrap();
    assert!(s.sites.iter().all(|&x| x.is_none()));

    assert_eq!(
        replay(
            &t,
            &mut Bfc::default(),
            &ReplayOptions {
                passes: 0,
                ignore_site: false
            }
        ),
        Err(ReplayError::NoPasses)
    );
}

#[test]
fn report_json_keys() {
    let t = trace(&[(A, 0x1000, 512)]);
    let r = replay(
        &t,
        &mut ReferenceBuddy::default(),
        &ReplayOptions::default(),
    )
    .unwrap();
    let v: serde_json::Value = serde_json::to_value(&r).unwrap();
    for k in [
        "trace",
        "device",
        "ops",
        "peak_live",
        "peak_reserved",
        "ratio",
        "ns_per_op",
        "tiers",
        "classifier",
        "allocator",
        "passes",
        "ns_per_op_passes",
    ] {
        assert!(v.get(k).is_some(), "missing key {k}");
    }
    assert!(v["classifier"].is_null());
    assert_eq!(v["passes"], 5);
}

/// Returns the same address for every allocation: the instrumented pass must notice.
struct Overlapping;
impl ReplayAllocator for Overlapping {
    fn name(&self) -> String {
        "overlapping".into()
    }
    fn alloc(&mut self, _: u64, _: u64, _: Option<u64>) -> Result<u64, ReplayError> {
        Ok(0x10_0000)
    }
    fn free(&mut self, _: u64, _: u64, _: u64) -> Result<(), ReplayError> {
        Ok(())
    }
    fn reserved(&self) -> u64 {
        0
    }
    fn peak_reserved(&self) -> u64 {
        0
    }
}

/// Hands out addresses 256 B apart (misaligned every other time), or fails after `budget` allocs.
struct Bump {
    next: u64,
    step: u64,
    budget: u64,
}
impl ReplayAllocator for Bump {
    fn name(&self) -> String {
        "bump".into()
    }
    fn alloc(&mut self, size: u64, _: u64, _: Option<u64>) -> Result<u64, ReplayError> {
        if self.budget == 0 {
            return Err(ReplayError::OutOfMemory { requested: size });
        }
        self.budget -= 1;
        let p = self.next;
        self.next += size.max(self.step);
        Ok(p)
    }
    fn free(&mut self, _: u64, _: u64, _: u64) -> Result<(), ReplayError> {
        Ok(())
    }
    fn reserved(&self) -> u64 {
        self.next
    }
    fn peak_reserved(&self) -> u64 {
        0
    }
}

#[test]
fn instrumented_pass_catches_broken_allocators() {
    let t = trace(&[(A, 0x1000, 512), (A, 0x2000, 512), (F, 0x1000, 512)]);
    let e = replay(&t, &mut Overlapping, &ReplayOptions::default()).unwrap_err();
    assert_eq!(
        e,
        ReplayError::Overlap {
            pass: 1,
            op: 1,
            addr: 0x10_0000,
            size: 512,
            other_addr: 0x10_0000,
            other_size: 512
        }
    );
    // Partial overlap from below: a 1024 B block at 0, then a block at 512.
    let t2 = trace(&[(A, 0x1000, 1024), (A, 0x2000, 512)]);
    let mut b = Bump {
        next: 0,
        step: 512,
        budget: u64::MAX,
    };
    b.next = 0;
    struct Shift(Bump);
    impl ReplayAllocator for Shift {
        fn name(&self) -> String {
            "shift".into()
        }
        fn alloc(&mut self, size: u64, s: u64, site: Option<u64>) -> Result<u64, ReplayError> {
            // First block at 0 (1024 B), second at 512: overlapping the first's tail.
            let p = self.0.alloc(size, s, site)?;
            Ok(if p == 0 { 0 } else { 512 })
        }
        fn free(&mut self, p: u64, size: u64, s: u64) -> Result<(), ReplayError> {
            self.0.free(p, size, s)
        }
        fn reserved(&self) -> u64 {
            0
        }
        fn peak_reserved(&self) -> u64 {
            0
        }
    }
    let e = replay(&t2, &mut Shift(b), &ReplayOptions::default()).unwrap_err();
    assert!(
        matches!(
            e,
            ReplayError::Overlap {
                op: 1,
                addr: 512,
                other_addr: 0,
                other_size: 1024,
                ..
            }
        ),
        "{e:?}"
    );

    let mut b = Bump {
        next: 0,
        step: 256,
        budget: u64::MAX,
    };
    let t3 = trace(&[(A, 0x1000, 256), (A, 0x2000, 256)]);
    let e = replay(&t3, &mut b, &ReplayOptions::default()).unwrap_err();
    assert_eq!(
        e,
        ReplayError::Misaligned {
            pass: 1,
            op: 1,
            addr: 256
        }
    );
    assert!(e.to_string().contains("misaligned"), "{e}");

    // An allocator error in a timed pass names the pass and op.
    let mut b = Bump {
        next: 0,
        step: 512,
        budget: 3,
    };
    let e = replay(&t, &mut b, &ReplayOptions::default()).unwrap_err();
    assert_eq!(
        e,
        ReplayError::Op {
            pass: 2,
            op: 1,
            source: Box::new(ReplayError::OutOfMemory { requested: 512 })
        }
    );
    assert_eq!(
        e.to_string(),
        "pass 2, op 1: out of memory (512 bytes requested)"
    );
}

#[test]
fn hand_built_bad_trace_is_an_error_not_a_panic() {
    let bad = Trace {
        name: "bad".into(),
        events: vec![Event {
            t_us: 0,
            kind: EventKind::Free,
            addr: 0x40,
            size: 512,
            stream: 0,
            site: 0,
        }],
        summary: TraceSummary::default(),
    };
    let e = ReplayPlan::new(&bad).unwrap_err();
    assert!(
        matches!(e, ReplayError::InvalidTrace { event: 0, .. }),
        "{e:?}"
    );
}

#[test]
fn plan_reuses_slots() {
    let t = trace(&[
        (A, 1 << 20, 512),
        (F, 1 << 20, 512),
        (A, 2 << 20, 512),
        (A, 3 << 20, 512),
        (F, 2 << 20, 512),
        (F, 3 << 20, 512),
    ]);
    let p = ReplayPlan::new(&t).unwrap();
    assert_eq!((p.ops(), p.slots(), p.peak_live()), (6, 2, 1024));
}
