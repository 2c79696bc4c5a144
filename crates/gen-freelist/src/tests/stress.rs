//! Multi-thread stress tests: real threads, real contention, exclusive ownership checked per slot.
//!
//! Every slot has an `owned` flag; a thread that gets a slot sets it (it must have been clear: no slot is
//! ever handed to two owners) and clears it before giving the slot back. At the end every slot is free
//! exactly once.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread;

use super::{assert_permutation, drain};
use crate::{FreeList, FrontCache, LocalCache, TransferStack};

const THREADS: usize = 4;
const ROUNDS: usize = if cfg!(miri) { 30 } else { 20_000 };
const CAP: usize = 64;

fn flags(n: usize) -> Vec<AtomicBool> {
    (0..n).map(|_| AtomicBool::new(false)).collect()
}

#[track_caller]
fn acquire(owned: &[AtomicBool], idx: u32) {
    assert!(
        !owned[idx as usize].swap(true, Ordering::Relaxed),
        "slot {idx} handed out twice"
    );
}

fn release(owned: &[AtomicBool], idx: u32) {
    owned[idx as usize].store(false, Ordering::Relaxed);
}

#[test]
fn freelist_pop_push_and_batches_never_double_allocate() {
    let list = FreeList::new_full(CAP).unwrap();
    let owned = flags(CAP);
    thread::scope(|s| {
        for t in 0..THREADS {
            let (list, owned) = (&list, &owned);
            s.spawn(move || {
                let mut held = Vec::with_capacity(8);
                for r in 0..ROUNDS {
                    // Hold up to 8 slots; mix single pushes, chains and take_all.
                    while held.len() < 1 + (r + t) % 8 {
                        match list.pop() {
                            Some(idx) => {
                                acquire(owned, idx);
                                held.push(idx);
                            }
                            None => break,
                        }
                    }
                    for &idx in &held {
                        release(owned, idx);
                    }
                    if r % 3 == 0 {
                        list.push_chain(&held);
                    } else {
                        held.iter().for_each(|&idx| list.push(idx));
                    }
                    held.clear();
                    if r % 97 == t {
                        for idx in list.take_all().take(3) {
                            acquire(owned, idx);
                            release(owned, idx);
                            list.push(idx);
                        }
                    }
                }
            });
        }
    });
    assert_permutation(drain(&list), CAP);
}

#[test]
fn transfer_stack_delivers_every_push_exactly_once() {
    let stack = TransferStack::new(THREADS * ROUNDS.min(2000)).unwrap();
    let per = stack.capacity() / THREADS;
    let received = AtomicUsize::new(0);
    let seen = flags(stack.capacity());
    thread::scope(|s| {
        for t in 0..THREADS {
            let stack = &stack;
            s.spawn(move || {
                for i in 0..per {
                    let idx = (t * per + i) as u32;
                    if i % 5 == 0 {
                        stack.push_chain(&[idx]);
                    } else {
                        stack.push(idx);
                    }
                }
            });
        }
        let (stack, received, seen) = (&stack, &received, &seen);
        s.spawn(move || {
            while received.load(Ordering::Relaxed) < stack.capacity() {
                for idx in stack.take_all() {
                    acquire(seen, idx);
                    received.fetch_add(1, Ordering::Relaxed);
                }
                thread::yield_now();
            }
        });
    });
    assert!(stack.is_empty());
    assert!(seen.iter().all(|f| f.load(Ordering::Relaxed)));
}

#[test]
fn front_cache_threads_never_double_allocate() {
    let fc = FrontCache::new_full(CAP, 2, 4).unwrap();
    let owned = flags(CAP);
    thread::scope(|s| {
        for t in 0..THREADS {
            let (fc, owned) = (&fc, &owned);
            s.spawn(move || {
                let mut held = Vec::with_capacity(8);
                for r in 0..ROUNDS {
                    while held.len() < 1 + (r * 7 + t) % 8 {
                        match fc.pop() {
                            Some(idx) => {
                                acquire(owned, idx);
                                held.push(idx);
                            }
                            None => break,
                        }
                    }
                    for idx in held.drain(..) {
                        release(owned, idx);
                        fc.push(idx);
                    }
                    if r % 501 == t {
                        fc.flush_shards();
                    }
                }
            });
        }
    });
    assert!(fc.shard_depths().all(|d| d <= 4));
    fc.flush_shards();
    assert_permutation(drain(fc.global()), CAP);
}

#[test]
fn local_caches_share_one_list_without_loss() {
    let list = FreeList::new_full(CAP).unwrap();
    let owned = flags(CAP);
    thread::scope(|s| {
        for t in 0..THREADS {
            let (list, owned) = (&list, &owned);
            s.spawn(move || {
                let mut cache = LocalCache::<'_, 8>::new(list);
                let mut held = Vec::with_capacity(12);
                for r in 0..ROUNDS {
                    while held.len() < 1 + (r + t) % 12 {
                        match cache.pop() {
                            Some(idx) => {
                                acquire(owned, idx);
                                held.push(idx);
                            }
                            None => break,
                        }
                    }
                    for idx in held.drain(..) {
                        release(owned, idx);
                        cache.push(idx);
                    }
                }
            });
        }
    });
    assert_permutation(drain(&list), CAP);
}
