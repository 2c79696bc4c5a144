//! Property test: the slab against a reference model, on a [`SimDevice`] with pausable streams.
//!
//! Invariants checked after every action:
//! - an allocation succeeds (the device is large; only a page steal, which synchronizes, can fail while
//!   a stream is paused), is 512-byte aligned, inside the slab, at least as large
//!   as asked, and overlaps no live block;
//! - a block freed on a stream while that stream was paused is never handed to another stream before the
//!   stream resumes (it may go back to the same stream at once), unless that stream's work is ordered
//!   after the paused one's (it waits on an event recorded there, `SimDevice::waits_on`);
//! - `free` of a live block returns its class size; of a freed or interior pointer `InvalidFree`;
//! - `reclaim` succeeds unless a stream is paused (then only `Device` errors), and never changes live
//!   blocks; `stats().live_blocks` / `live_bytes` equal the model's;
//! - at the end, with every block freed and every stream resumed, `reclaim` returns every page.

use std::collections::{BTreeMap, HashMap, HashSet};

use proptest::prelude::*;

use super::*;

#[derive(Clone, Debug)]
enum Action {
    Alloc { size: u64, stream: usize },
    Free { pick: usize, stream: usize },
    BadFree { pick: usize, interior: bool },
    Pause { stream: usize },
    Resume { stream: usize },
    Reclaim,
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        6 => (prop_oneof![3 => 1u64..4096, 2 => 1u64..(64 << 10)], 0usize..3)
            .prop_map(|(size, stream)| Action::Alloc { size, stream }),
        5 => (any::<usize>(), 0usize..3).prop_map(|(pick, stream)| Action::Free { pick, stream }),
        1 => (any::<usize>(), any::<bool>()).prop_map(|(pick, interior)| Action::BadFree { pick, interior }),
        1 => (1usize..3).prop_map(|stream| Action::Pause { stream }),
        1 => (1usize..3).prop_map(|stream| Action::Resume { stream }),
        1 => Just(Action::Reclaim),
    ]
}

/// Under Miri: 2 short programs, no regression file (proptest's file persistence needs the working
/// directory, which Miri's isolation refuses).
fn config() -> ProptestConfig {
    let mut c = ProptestConfig {
        cases: if cfg!(miri) { 2 } else { 64 },
        ..ProptestConfig::default()
    };
    if cfg!(miri) {
        c.failure_persistence = None;
    }
    c
}

/// Actions per program.
const MAX_ACTIONS: usize = if cfg!(miri) { 16 } else { 200 };

proptest! {
    #![proptest_config(config())]

    #[test]
    fn slab_matches_model(actions in prop::collection::vec(action(), 1..MAX_ACTIONS)) {
        // Under Miri fewer classes and slots (see `small_cfg`).
        let miri = cfg!(miri);
        let cfg = SlabConfig {
            max_size: 64 << 10,
            classes_per_doubling: if miri { 1 } else { 4 },
            class_span: if miri { 16 * MIB } else { 64 * MIB },
            max_slots_per_class: if miri { 4096 } else { 1 << 13 },
            shards: 2,
            ..SlabConfig::wide()
        };
        let f = fixture(cfg);
        let s = &f.slab;
        let streams = [0u64, f.dev.stream_create().unwrap(), f.dev.stream_create().unwrap()];
        let mut live: BTreeMap<u64, u64> = BTreeMap::new();
        let mut freed: Vec<u64> = Vec::new();
        // Blocks freed on a paused stream: ptr -> stream index.
        let mut tainted: HashMap<u64, usize> = HashMap::new();
        let mut paused: HashSet<usize> = HashSet::new();
        for a in actions {
            match a {
                Action::Alloc { size, stream } => {
                    let p = match s.alloc(size, streams[stream], true) {
                        Ok(p) => p,
                        // Moving a free page (gen-vmm steals) synchronizes, which cannot complete while a
                        // stream is paused; nothing changed.
                        Err(TierError::Vmm(VmmError::Device(_))) if !paused.is_empty() => continue,
                        Err(e) => return Err(TestCaseError::fail(format!("alloc: {e}"))),
                    };
                    let (_, cls) = s.class_of(size).unwrap();
                    prop_assert!(cls >= size && p % 512 == 0 && s.owns(p));
                    if let Some((&q, &qs)) = live.range(..=p).next_back() {
                        prop_assert!(q + qs <= p, "{p:#x} overlaps live {q:#x}+{qs}");
                    }
                    if let Some((&q, _)) = live.range(p..).next() {
                        prop_assert!(p + cls <= q, "{p:#x}+{cls} overlaps live {q:#x}");
                    }
                    if let Some(&by) = tainted.get(&p) {
                        // Another stream may have it only once its work is ordered after the paused one's
                        // (it waits on an event recorded there: the page layer's ordering, no host wait).
                        prop_assert!(
                            by == stream || f.dev.waits_on(streams[stream], streams[by]),
                            "block freed on paused stream {} given to {} with no wait on it", by, stream
                        );
                    }
                    tainted.remove(&p);
                    live.insert(p, cls);
                }
                Action::Free { pick, stream } => {
                    if live.is_empty() { continue; }
                    let p = *live.keys().nth(pick % live.len()).unwrap();
                    let cls = live.remove(&p).unwrap();
                    if paused.contains(&stream) {
                        // The work that makes the free unsafe elsewhere: queued on the stream before it.
                        f.dev.memset_async(p, 0, cls, streams[stream]).unwrap();
                    }
                    prop_assert_eq!(s.free(p, streams[stream]).unwrap(), cls);
                    if paused.contains(&stream) {
                        tainted.insert(p, stream);
                    }
                    freed.push(p);
                }
                Action::BadFree { pick, interior } => {
                    let p = if interior {
                        if live.is_empty() { continue; }
                        *live.keys().nth(pick % live.len()).unwrap() + 256
                    } else {
                        if freed.is_empty() { continue; }
                        let p = freed[pick % freed.len()];
                        if live.contains_key(&p) { continue; }
                        p
                    };
                    let is_invalid = matches!(s.free(p, 0), Err(TierError::InvalidFree { .. }));
                    prop_assert!(is_invalid);
                }
                Action::Pause { stream } => {
                    f.dev.pause_stream(streams[stream]).unwrap();
                    paused.insert(stream);
                }
                Action::Resume { stream } => {
                    f.dev.resume_stream(streams[stream]).unwrap();
                    paused.remove(&stream);
                    tainted.retain(|_, by| *by != stream);
                }
                Action::Reclaim => match s.reclaim() {
                    Ok(_) => {}
                    Err(TierError::Device(_)) if !paused.is_empty() => {}
                    Err(e) => prop_assert!(false, "reclaim: {e}"),
                },
            }
            let st = s.stats();
            prop_assert_eq!(st.live_blocks, live.len() as u64);
            prop_assert_eq!(st.live_bytes, live.values().sum::<u64>());
        }
        for st in paused.drain() {
            f.dev.resume_stream(streams[st]).unwrap();
        }
        for (p, _) in std::mem::take(&mut live) {
            s.free(p, 0).unwrap();
        }
        s.reclaim().unwrap();
        let st = s.stats();
        prop_assert_eq!((st.committed_bytes, st.chunks_committed, st.live_blocks), (0, 0, 0));
        prop_assert_eq!(f.pool.stats().pages_in_use, 0);
    }
}
