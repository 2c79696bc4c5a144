//! Property tests against deterministic reference models (one thread).
//!
//! Invariants checked after every action:
//! - `FreeList` is exactly a LIFO stack: every pop, `take_all` and final drain matches a `Vec` model, and
//!   `is_empty` agrees with it; rejected input (`try_push*` out of range) changes nothing.
//! - Conservation (`LocalCache`, `FrontCache`): every slot is either owned by the test or free in the
//!   structure, never both, never neither: pops never return an owned slot, and at the end the structure
//!   gives back exactly the slots the test does not own.
//! - `FrontCache`: no shard ever holds more than its bound.

use proptest::prelude::*;

use super::{assert_permutation, drain};
use crate::{FreeList, FrontCache, LocalCache};

const CAP: usize = 24;

#[derive(Debug, Clone)]
enum Action {
    /// Pop one slot.
    Pop,
    /// Push the owned slot at this position (modulo the owned count).
    Push(usize),
    /// Push up to this many owned slots as one chain.
    PushChain(usize),
    /// `take_all`, keep this many of the yielded slots (the rest go back when the chain drops).
    TakeAll(usize),
    /// An out-of-range index offered to `try_push` / `try_push_chain`.
    PushBad(u32),
    /// Shard (front cache) or flush (caches) selector.
    Flush,
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        6 => Just(Action::Pop),
        6 => any::<usize>().prop_map(Action::Push),
        2 => (0usize..6).prop_map(Action::PushChain),
        1 => (0usize..CAP).prop_map(Action::TakeAll),
        1 => (CAP as u32..=u32::MAX).prop_map(Action::PushBad),
        1 => Just(Action::Flush),
    ]
}

/// Removes and returns the owned slot at `pos % owned.len()`, if any.
fn take_owned(owned: &mut Vec<u32>, pos: usize) -> Option<u32> {
    (!owned.is_empty()).then(|| owned.swap_remove(pos % owned.len()))
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: if cfg!(miri) { 4 } else { 256 },
        // Miri's isolation forbids the file system (`getcwd`) that regression persistence needs.
        failure_persistence: if cfg!(miri) { None } else { ProptestConfig::default().failure_persistence },
        ..ProptestConfig::default()
    })]

    #[test]
    fn freelist_matches_a_vec_stack(full in any::<bool>(), actions in prop::collection::vec(action(), 0..80)) {
        let list = if full { FreeList::new_full(CAP) } else { FreeList::new(CAP) }.unwrap();
        // Model: top of the stack at the end.
        let mut model: Vec<u32> = if full { (0..CAP as u32).rev().collect() } else { Vec::new() };
        let mut owned: Vec<u32> = if full { Vec::new() } else { (0..CAP as u32).collect() };
        for a in actions {
            match a {
                Action::Pop => {
                    let got = list.pop();
                    prop_assert_eq!(got, model.pop());
                    owned.extend(got);
                }
                Action::Push(pos) => {
                    if let Some(idx) = take_owned(&mut owned, pos) {
                        list.push(idx);
                        model.push(idx);
                    }
                }
                Action::PushChain(n) => {
                    let n = n.min(owned.len());
                    let batch: Vec<u32> = owned.drain(..n).collect();
                    list.push_chain(&batch);
                    model.extend(batch.iter().rev());
                }
                Action::TakeAll(keep) => {
                    let mut chain = list.take_all();
                    prop_assert!(list.is_empty());
                    let kept: Vec<u32> = chain.by_ref().take(keep).collect();
                    drop(chain);
                    let split = model.len() - kept.len();
                    let expect: Vec<u32> = model.drain(split..).rev().collect();
                    prop_assert_eq!(&kept, &expect);
                    owned.extend(kept);
                }
                Action::PushBad(idx) => {
                    prop_assert!(list.try_push(idx).is_err());
                    let mut batch = owned.clone();
                    batch.push(idx);
                    prop_assert!(list.try_push_chain(&batch).is_err());
                }
                Action::Flush => {
                    if let Some(idx) = take_owned(&mut owned, 0) {
                        list.try_push(idx).unwrap();
                        model.push(idx);
                    }
                }
            }
            prop_assert_eq!(list.is_empty(), model.is_empty());
        }
        let rest = drain(&list);
        model.reverse();
        prop_assert_eq!(&rest, &model);
        owned.extend(rest);
        assert_permutation(owned, CAP);
    }

    #[test]
    fn local_cache_conserves_slots(actions in prop::collection::vec(action(), 0..120)) {
        let list = FreeList::new_full(CAP).unwrap();
        let mut owned: Vec<u32> = Vec::new();
        {
            let mut cache = LocalCache::<'_, 4>::new(&list);
            for a in actions {
                match a {
                    Action::Pop | Action::TakeAll(_) => match cache.pop() {
                        Some(idx) => {
                            prop_assert!(!owned.contains(&idx), "slot {} handed out twice", idx);
                            owned.push(idx);
                        }
                        None => prop_assert_eq!(owned.len(), CAP),
                    },
                    Action::Push(pos) | Action::PushChain(pos) => {
                        if let Some(idx) = take_owned(&mut owned, pos) {
                            cache.push(idx);
                        }
                    }
                    Action::PushBad(idx) => prop_assert!(cache.try_push(idx).is_err()),
                    Action::Flush => {
                        cache.flush();
                        prop_assert!(cache.is_empty());
                    }
                }
                prop_assert!(cache.len() <= 4);
            }
        }
        owned.extend(drain(&list));
        assert_permutation(owned, CAP);
    }

    #[test]
    fn front_cache_conserves_slots_and_bounds_shards(
        shards in 1usize..4,
        bound in 1usize..4,
        actions in prop::collection::vec((action(), 0usize..8), 0..120),
    ) {
        let fc = FrontCache::new_full(CAP, shards, bound).unwrap();
        let mut owned: Vec<u32> = Vec::new();
        for (a, shard) in actions {
            match a {
                Action::Pop | Action::TakeAll(_) => match fc.pop_at(shard) {
                    Some(idx) => {
                        prop_assert!(!owned.contains(&idx), "slot {} handed out twice", idx);
                        owned.push(idx);
                    }
                    None => prop_assert_eq!(owned.len(), CAP, "None while slots are free"),
                },
                Action::Push(pos) | Action::PushChain(pos) => {
                    if let Some(idx) = take_owned(&mut owned, pos) {
                        fc.push_at(shard, idx);
                    }
                }
                Action::PushBad(idx) => prop_assert!(fc.try_push(idx).is_err()),
                Action::Flush => fc.flush_shards(),
            }
            prop_assert!(fc.shard_depths().all(|d| d <= bound));
            prop_assert_eq!(fc.is_empty(), owned.len() == CAP);
        }
        fc.flush_shards();
        owned.extend(drain(fc.global()));
        assert_permutation(owned, CAP);
    }
}
