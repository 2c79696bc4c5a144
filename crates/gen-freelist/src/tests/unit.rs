//! Unit tests: the behaviour of each operation on one thread.

use super::{assert_permutation, drain};
use crate::{FreeList, FreeListError, FrontCache, LocalCache, TransferStack, MAX_CAPACITY};

#[test]
fn new_is_empty_and_new_full_pops_in_order() {
    let empty = FreeList::new(8).unwrap();
    assert_eq!(empty.capacity(), 8);
    assert!(empty.is_empty());
    assert_eq!(empty.pop(), None);

    let full = FreeList::new_full(5).unwrap();
    assert!(!full.is_empty());
    assert_eq!(drain(&full), vec![0, 1, 2, 3, 4]);
    assert!(full.is_empty());
}

#[test]
fn zero_capacity_is_valid_and_empty() {
    for list in [FreeList::new(0).unwrap(), FreeList::new_full(0).unwrap()] {
        assert_eq!(list.capacity(), 0);
        assert!(list.is_empty());
        assert_eq!(list.pop(), None);
        assert_eq!(
            list.try_push(0),
            Err(FreeListError::IndexOutOfRange {
                idx: 0,
                capacity: 0
            })
        );
        assert_eq!(list.take_all().count(), 0);
    }
}

#[test]
fn capacity_above_u32_indices_is_an_error() {
    let err = FreeList::new(MAX_CAPACITY + 1).unwrap_err();
    assert_eq!(
        err,
        FreeListError::CapacityTooLarge {
            requested: MAX_CAPACITY + 1,
            max: MAX_CAPACITY
        }
    );
    assert!(FreeList::new_full(usize::MAX).is_err());
    assert!(TransferStack::new(usize::MAX).is_err());
    assert!(FrontCache::new(usize::MAX, 1, 1).is_err());
    assert!(err.to_string().contains("exceeds"));
}

#[test]
fn push_pop_is_lifo() {
    let list = FreeList::new(10).unwrap();
    for i in [3, 7, 1] {
        list.push(i);
    }
    assert_eq!(list.pop(), Some(1));
    list.push(9);
    assert_eq!(drain(&list), vec![9, 7, 3]);
}

#[test]
fn try_push_rejects_out_of_range_and_leaves_list_alone() {
    let list = FreeList::new(4).unwrap();
    list.push(2);
    for bad in [4, 5, u32::MAX] {
        assert_eq!(
            list.try_push(bad),
            Err(FreeListError::IndexOutOfRange {
                idx: bad,
                capacity: 4
            })
        );
    }
    list.try_push(3).unwrap();
    assert_eq!(drain(&list), vec![3, 2]);
}

#[test]
#[should_panic(expected = "out of")] // "out of range" (debug assert) or "index out of bounds" (release)
fn push_out_of_range_panics() {
    FreeList::new(4).unwrap().push(4);
}

#[test]
fn push_chain_publishes_in_slice_order_on_top() {
    let list = FreeList::new(10).unwrap();
    list.push(0);
    list.push_chain(&[5, 6, 7]);
    list.push_chain(&[]);
    list.push_chain(&[9]);
    assert_eq!(drain(&list), vec![9, 5, 6, 7, 0]);
}

#[test]
fn try_push_chain_checks_every_index_first() {
    let list = FreeList::new(4).unwrap();
    assert_eq!(
        list.try_push_chain(&[0, 1, 8, 2]),
        Err(FreeListError::IndexOutOfRange {
            idx: 8,
            capacity: 4
        })
    );
    assert!(list.is_empty());
    list.try_push_chain(&[3, 1]).unwrap();
    assert_eq!(drain(&list), vec![3, 1]);
}

#[test]
fn take_all_detaches_everything_top_first() {
    let list = FreeList::new_full(6).unwrap();
    assert_eq!(list.pop(), Some(0));
    let chain = list.take_all();
    assert!(list.is_empty());
    assert_eq!(chain.collect::<Vec<_>>(), vec![1, 2, 3, 4, 5]);
    assert!(list.is_empty(), "an exhausted chain returns nothing");
    assert_eq!(list.take_all().next(), None);
}

#[test]
fn chain_allows_pushing_yielded_slots_back_while_iterating() {
    let list = FreeList::new_full(4).unwrap();
    let mut seen = Vec::new();
    for idx in list.take_all() {
        seen.push(idx);
        list.push(idx);
    }
    assert_eq!(seen, vec![0, 1, 2, 3]);
    assert_eq!(drain(&list), vec![3, 2, 1, 0]);
}

#[test]
fn dropping_a_chain_early_returns_the_rest() {
    let list = FreeList::new_full(5).unwrap();
    let mut chain = list.take_all();
    assert_eq!(chain.peek(), Some(0));
    assert_eq!(chain.next(), Some(0));
    assert_eq!(chain.next(), Some(1));
    list.push(1);
    drop(chain);
    assert_eq!(drain(&list), vec![2, 3, 4, 1]);
}

#[test]
fn chain_terminates_on_a_double_push() {
    // Pushing a slot twice is a caller bug; it must not make iteration hang.
    let list = FreeList::new(3).unwrap();
    list.push(1);
    list.push(2);
    list.push(1); // 1 -> 2 -> 1 -> ...
    let chain = list.take_all();
    assert!(chain.count() <= 3);
    assert!(list.is_empty(), "a cyclic remainder is not pushed back");
}

#[test]
fn pop_after_take_all_sees_only_slots_pushed_since() {
    let list = FreeList::new_full(3).unwrap();
    let owned = list.pop().unwrap();
    let chain = list.take_all();
    list.push(owned);
    assert_eq!(list.pop(), Some(owned));
    assert_eq!(list.pop(), None);
    assert_eq!(chain.collect::<Vec<_>>(), vec![1, 2]);
}

#[test]
fn large_capacity_is_supported() {
    let cap = if cfg!(miri) { 1 << 10 } else { 1 << 24 };
    let list = FreeList::new_full(cap).unwrap();
    assert_eq!(list.capacity(), cap);
    assert_eq!(list.pop(), Some(0));
    assert_eq!(list.pop(), Some(1));
    let top = (cap - 1) as u32;
    list.push(top);
    assert_eq!(list.pop(), Some(top));
    assert_eq!(
        list.try_push(cap as u32).unwrap_err().to_string(),
        format!("slot index {cap} out of range for capacity {cap}")
    );
}

#[test]
fn transfer_stack_pushes_and_swaps_out() {
    let stack = TransferStack::new(8).unwrap();
    assert!(stack.is_empty());
    assert_eq!(stack.capacity(), 8);
    stack.push(3);
    stack.push_chain(&[5, 6]);
    stack.try_push(7).unwrap();
    assert!(stack.try_push(8).is_err());
    assert!(stack.try_push_chain(&[0, 99]).is_err());
    let mut chain = stack.take_all();
    assert!(stack.is_empty());
    assert_eq!(chain.next(), Some(7));
    assert_eq!(chain.next(), Some(5));
    drop(chain);
    assert_eq!(stack.take_all().collect::<Vec<_>>(), vec![6, 3]);
}

#[test]
fn local_cache_refills_in_list_order_and_flushes_on_drop() {
    let list = FreeList::new_full(100).unwrap();
    {
        let mut cache = LocalCache::<'_, 8>::new(&list);
        assert!(cache.is_empty());
        // Refill moves N/2 = 4 slots, handed out in the list's order.
        let got: Vec<u32> = (0..6).map(|_| cache.pop().unwrap()).collect();
        assert_eq!(got, vec![0, 1, 2, 3, 4, 5]);
        assert_eq!(cache.len(), 2);
        for idx in got {
            cache.push(idx);
        }
        assert_eq!(cache.len(), 8);
        // Full: the next push spills the older half (one chain) to the list.
        cache.push(99);
        assert_eq!(cache.len(), 5);
        assert_eq!(cache.pop(), Some(99));
        assert!(std::ptr::eq(cache.list(), &list));
    }
    assert_permutation(drain(&list), 100);
}

#[test]
fn local_cache_on_an_empty_list_returns_none() {
    let list = FreeList::new(4).unwrap();
    let mut cache: LocalCache<'_> = LocalCache::new(&list);
    assert_eq!(cache.pop(), None);
    assert!(cache.try_push(4).is_err());
    cache.try_push(1).unwrap();
    assert_eq!(cache.pop(), Some(1));
    assert_eq!(cache.pop(), None);
    cache.push(2);
    cache.flush();
    assert!(cache.is_empty());
    assert_eq!(list.pop(), Some(2));
}

#[test]
fn front_cache_rejects_bad_shapes() {
    assert_eq!(
        FrontCache::new(4, 0, 1).unwrap_err(),
        FreeListError::NoShards
    );
    for bad in [0, 256] {
        assert_eq!(
            FrontCache::new(4, 2, bad).unwrap_err(),
            FreeListError::ShardCapacity {
                requested: bad,
                max: 255
            }
        );
    }
    let ok = FrontCache::new(4, 3, 255).unwrap();
    assert_eq!(
        (ok.capacity(), ok.shard_count(), ok.shard_capacity()),
        (4, 3, 255)
    );
    assert!(ok.is_empty());
}

#[test]
fn front_cache_bounds_shards_and_overflows_to_global() {
    let fc = FrontCache::new(16, 2, 3).unwrap();
    for idx in 0..5 {
        fc.push_at(0, idx);
    }
    // 0, 1, 2 filled shard 0; pushing 3 spilled them to the global stack as one chain (top first), and
    // 3 and 4 are in the shard now.
    assert_eq!(fc.shard_depths().collect::<Vec<_>>(), vec![2, 0]);
    assert_eq!(super::drain(fc.global()), vec![2, 1, 0]);
    assert_eq!(fc.pop_at(0), Some(4));
    assert_eq!(fc.shard_depths().collect::<Vec<_>>(), vec![1, 0]);
    fc.push_at(3, 9);
    assert_eq!(
        fc.shard_depths().collect::<Vec<_>>(),
        vec![1, 1],
        "shard index is taken modulo the count"
    );
    assert_eq!(fc.pop_at(1), Some(9));
    // Shard 1 is empty and so is the global stack: it steals from shard 0.
    assert_eq!(fc.pop_at(1), Some(3));
    assert_eq!(fc.pop_at(0), None);
    assert!(fc.is_empty());
}

#[test]
fn front_cache_prefers_home_then_global() {
    let fc = FrontCache::new_full(4, 2, 4).unwrap();
    assert_eq!(fc.pop_at(1), Some(0), "empty shard: from the global stack");
    fc.push_at(1, 0);
    fc.push_at(0, 3);
    assert_eq!(fc.pop_at(1), Some(0));
    assert_eq!(fc.pop_at(1), Some(1));
    assert_eq!(fc.pop_at(0), Some(3));
}

#[test]
fn front_cache_flush_moves_everything_to_global() {
    let fc = FrontCache::new_full(20, 3, 4).unwrap();
    let taken: Vec<u32> = (0..20).map(|i| fc.pop_at(i).unwrap()).collect();
    assert_eq!(fc.pop(), None);
    for (i, &idx) in taken.iter().enumerate() {
        fc.push_at(i % 3, idx);
    }
    // 7, 7 and 6 pushes into shards of 4: each spilled once at its fifth push.
    assert_eq!(fc.shard_depths().collect::<Vec<_>>(), vec![3, 3, 2]);
    fc.flush_shards();
    assert!(fc.shard_depths().all(|d| d == 0));
    assert_permutation(drain(fc.global()), 20);
}

#[test]
fn front_cache_thread_shard_is_stable() {
    let fc = FrontCache::new_full(8, 4, 2).unwrap();
    let home = fc.home_shard();
    assert_eq!(home, fc.home_shard());
    // The first pop takes a run from the global stack: slot 0 now, slot 1 cached in the home shard.
    let idx = fc.pop().unwrap();
    assert_eq!(idx, 0);
    assert_eq!(fc.shard_depths().nth(home), Some(1));
    fc.push(idx);
    assert_eq!(fc.shard_depths().nth(home), Some(2));
    assert_eq!(fc.pop(), Some(idx));
    assert_eq!(fc.pop(), Some(1));
    assert!(fc.try_push(8).is_err());
}

/// A thread's pops from the global stack come as runs of neighbours, so two threads' slots do not
/// interleave; `pop_near` never takes another thread's cached slots, `steal` only those.
#[test]
fn front_cache_runs_keep_threads_slots_apart() {
    let fc = std::sync::Arc::new(FrontCache::new_full(64, 4, 8).unwrap());
    let mine: Vec<u32> = (0..8).map(|_| fc.pop_near().unwrap()).collect();
    assert_eq!(mine, (0..8).collect::<Vec<_>>());
    let fc2 = fc.clone();
    let theirs: Vec<u32> = std::thread::spawn(move || {
        let got: Vec<u32> = (0..3).map(|_| fc2.pop_near().unwrap()).collect();
        // Freed back: cached in that thread's shard (5 run slots left there, then these 3).
        for &i in &got {
            fc2.push(i);
        }
        got
    })
    .join()
    .unwrap();
    assert_eq!(theirs, vec![8, 9, 10]);
    // This thread's shard is empty and pop_near goes to the global stack, never to the other shard.
    assert_eq!(fc.pop_near(), Some(16));
    let depths: Vec<usize> = fc.shard_depths().collect();
    assert_eq!(depths.iter().sum::<usize>(), 7 + 8, "{depths:?}");
    // steal takes from the other thread's shard.
    let stolen = fc.steal().unwrap();
    assert!((8..16).contains(&stolen), "{stolen}");
    // push_run_near caches what fits in the home shard (8 - 7 = 1 here), the rest goes global.
    let home = fc.home_shard();
    let before = fc.shard_depths().nth(home).unwrap();
    assert_eq!(before, 7);
    fc.push_run_near(&mine[..3]);
    assert_eq!(fc.shard_depths().nth(home), Some(8));
    assert_eq!(fc.pop(), Some(mine[0]));
}

#[test]
fn free_list_pop_run_takes_the_top_in_order() {
    let list = FreeList::new_full(10).unwrap();
    assert_eq!(list.pop_run(4), vec![0, 1, 2, 3]);
    assert_eq!(list.pop_run(100), vec![4, 5, 6, 7, 8, 9]);
    assert!(list.pop_run(3).is_empty());
    list.push_chain(&[7, 3]);
    assert_eq!(list.pop_run(1), vec![7]);
    assert_eq!(list.pop(), Some(3));
}

#[test]
fn debug_output_names_the_type() {
    let list = FreeList::new(2).unwrap();
    assert!(format!("{list:?}").starts_with("FreeList"));
    assert!(format!("{:?}", list.take_all()).starts_with("Chain"));
    assert!(format!("{:?}", TransferStack::new(1).unwrap()).starts_with("TransferStack"));
    assert!(format!("{:?}", FrontCache::new(1, 1, 1).unwrap()).starts_with("FrontCache"));
    assert!(format!("{:?}", LocalCache::<'_, 4>::new(&list)).starts_with("LocalCache"));
}
