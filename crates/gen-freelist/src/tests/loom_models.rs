//! loom models: every interleaving (up to the preemption bound) of small concurrent scenarios.
//!
//! Run: `RUSTFLAGS="--cfg loom -C debug-assertions" LOOM_MAX_PREEMPTIONS=2 cargo test --release
//! -p gen-freelist --lib`.

use loom::sync::Arc;
use loom::thread;

use super::assert_permutation;
use crate::{FreeList, FrontCache, TransferStack};

/// Runs `f` under loom with the preemption bound from `LOOM_MAX_PREEMPTIONS` (default 2).
fn run_model(f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = Some(2);
    }
    builder.check(f);
}

fn drain(list: &FreeList) -> Vec<u32> {
    std::iter::from_fn(|| list.pop()).collect()
}

#[test]
fn concurrent_pops_get_distinct_slots() {
    run_model(|| {
        let list = Arc::new(FreeList::new_full(2).unwrap());
        let l2 = Arc::clone(&list);
        let t = thread::spawn(move || l2.pop());
        let mine = list.pop();
        let theirs = t.join().unwrap();
        let mut got: Vec<u32> = mine.into_iter().chain(theirs).collect();
        assert_eq!(got.len(), 2, "two slots, two pops: both succeed");
        got.extend(drain(&list));
        assert_permutation(got, 2);
    });
}

/// The ABA scenario: one thread pops while another pops A, pops B and pushes A back. With an untagged head
/// the first pop could install B (owned by the other thread) as the top.
#[test]
fn aba_pop_pop_push_is_detected() {
    run_model(|| {
        let list = Arc::new(FreeList::new_full(3).unwrap());
        let l2 = Arc::clone(&list);
        let t = thread::spawn(move || {
            let a = l2.pop();
            let b = l2.pop();
            if let Some(a) = a {
                l2.push(a);
            }
            b
        });
        let mine = list.pop();
        let b = t.join().unwrap();
        let mut got: Vec<u32> = mine.into_iter().chain(b).collect();
        got.extend(drain(&list));
        assert_permutation(got, 3);
    });
}

#[test]
fn push_chain_and_pop_race() {
    run_model(|| {
        let list = Arc::new(FreeList::new(4).unwrap());
        list.push(0);
        let l2 = Arc::clone(&list);
        let t = thread::spawn(move || l2.push_chain(&[1, 2, 3]));
        let popped = list.pop();
        t.join().unwrap();
        assert!(popped.is_some(), "slot 0 was there from the start");
        // Stack order, top first: the popped slot, then the rest. The chain stays contiguous and ordered.
        let got: Vec<u32> = popped.into_iter().chain(drain(&list)).collect();
        let pos = got.iter().position(|&i| i == 1).unwrap();
        assert_eq!(&got[pos..pos + 3], &[1, 2, 3]);
        assert_permutation(got, 4);
    });
}

#[test]
fn take_all_races_push_and_pop() {
    run_model(|| {
        let list = Arc::new(FreeList::new_full(2).unwrap());
        let l2 = Arc::clone(&list);
        let t = thread::spawn(move || {
            let got = l2.pop();
            if let Some(idx) = got {
                l2.push(idx);
            }
        });
        let taken: Vec<u32> = list.take_all().collect();
        t.join().unwrap();
        let mut all = taken;
        all.extend(drain(&list));
        assert_permutation(all, 2);
    });
}

#[test]
fn dropped_chain_returns_rest_while_others_pop() {
    run_model(|| {
        let list = Arc::new(FreeList::new_full(3).unwrap());
        let mut chain = list.take_all();
        let first = chain.next().unwrap();
        let l2 = Arc::clone(&list);
        let t = thread::spawn(move || l2.pop());
        drop(chain);
        let theirs = t.join().unwrap();
        let mut all = vec![first];
        all.extend(theirs);
        all.extend(drain(&list));
        assert_permutation(all, 3);
    });
}

/// A run pop walks links of slots it does not own yet: another thread pops two and pushes one back
/// meanwhile (the ABA shape). The run taken must be slots that were on the stack together, each once.
#[test]
fn pop_run_races_pop_pop_push() {
    run_model(|| {
        let list = Arc::new(FreeList::new_full(4).unwrap());
        let l2 = Arc::clone(&list);
        let t = thread::spawn(move || {
            let a = l2.pop();
            let b = l2.pop();
            if let Some(a) = a {
                l2.push(a);
            }
            b
        });
        let run = list.pop_run(3);
        let theirs = t.join().unwrap();
        assert!(!run.is_empty(), "four slots, at most one held elsewhere");
        let mut all = run;
        all.extend(theirs);
        all.extend(drain(&list));
        assert_permutation(all, 4);
    });
}

/// Two threads take runs from one front cache's global stack and free into their shards.
#[test]
fn front_cache_runs_race() {
    run_model(|| {
        let fc = Arc::new(FrontCache::new_full(4, 2, 2).unwrap());
        let f2 = Arc::clone(&fc);
        let t = thread::spawn(move || {
            let got = f2.pop_near();
            if let Some(i) = got {
                f2.push(i);
            }
            f2.pop_near()
        });
        let mine = fc.pop_near();
        let theirs = t.join().unwrap();
        let mut all: Vec<u32> = mine.into_iter().chain(theirs).collect();
        fc.flush_shards();
        all.extend(drain(fc.global()));
        assert_permutation(all, 4);
    });
}

/// A full shard spills to the global stack while another thread pops (from the global stack or by
/// stealing from that shard): every slot ends up in exactly one place.
#[test]
fn shard_spill_races_pop() {
    run_model(|| {
        let fc = Arc::new(FrontCache::new(3, 2, 1).unwrap());
        let f2 = Arc::clone(&fc);
        let t = thread::spawn(move || f2.pop());
        fc.push_at(0, 0);
        fc.push_at(0, 1);
        fc.push_at(0, 2);
        let theirs = t.join().unwrap();
        let mut all: Vec<u32> = theirs.into_iter().collect();
        fc.flush_shards();
        all.extend(drain(fc.global()));
        assert_permutation(all, 3);
    });
}

#[test]
fn transfer_stack_two_producers_one_consumer() {
    run_model(|| {
        let stack = Arc::new(TransferStack::new(3).unwrap());
        let s1 = Arc::clone(&stack);
        let s2 = Arc::clone(&stack);
        let p1 = thread::spawn(move || s1.push(0));
        let p2 = thread::spawn(move || s2.push_chain(&[1, 2]));
        let mut got: Vec<u32> = stack.take_all().collect();
        p1.join().unwrap();
        p2.join().unwrap();
        got.extend(stack.take_all());
        assert_permutation(got, 3);
    });
}

#[test]
fn front_cache_steal_races_home_pop_and_push() {
    run_model(|| {
        let fc = Arc::new(FrontCache::new(3, 2, 1).unwrap());
        fc.push_at(0, 0);
        fc.push_at(0, 1); // shard 0 holds one slot: this one overflows to the global stack
        let f2 = Arc::clone(&fc);
        let t = thread::spawn(move || {
            let got = f2.pop_at(0);
            f2.push_at(0, 2);
            got
        });
        let stolen = fc.pop_at(1);
        let theirs = t.join().unwrap();
        let mut all: Vec<u32> = stolen.into_iter().chain(theirs).collect();
        assert_eq!(all.len(), 2, "two free slots, two pops");
        fc.flush_shards();
        assert!(fc.shard_depths().all(|d| d == 0));
        all.extend(drain(fc.global()));
        assert_permutation(all, 3);
    });
}

/// A deliberately broken free list for the model below: the head holds the top index alone, with no
/// tag, so a CAS cannot tell "A again" from "A all along". Test-only; never used by the crate.
struct UntaggedStack {
    head: loom::sync::atomic::AtomicU32,
    links: Vec<loom::sync::atomic::AtomicU32>,
}

const UNTAGGED_NONE: u32 = u32::MAX;

impl UntaggedStack {
    /// Holds `0..n`, popping in that order.
    fn new_full(n: u32) -> Self {
        use loom::sync::atomic::AtomicU32;
        let links = (0..n)
            .map(|i| AtomicU32::new(if i + 1 < n { i + 1 } else { UNTAGGED_NONE }))
            .collect();
        UntaggedStack {
            head: AtomicU32::new(if n > 0 { 0 } else { UNTAGGED_NONE }),
            links,
        }
    }

    fn push(&self, idx: u32) {
        use loom::sync::atomic::Ordering;
        let mut cur = self.head.load(Ordering::Relaxed);
        loop {
            self.links[idx as usize].store(cur, Ordering::Relaxed);
            match self
                .head
                .compare_exchange(cur, idx, Ordering::Release, Ordering::Relaxed)
            {
                Ok(_) => return,
                Err(now) => cur = now,
            }
        }
    }

    fn pop(&self) -> Option<u32> {
        use loom::sync::atomic::Ordering;
        let mut cur = self.head.load(Ordering::Acquire);
        loop {
            if cur == UNTAGGED_NONE {
                return None;
            }
            let next = self.links[cur as usize].load(Ordering::Relaxed);
            match self
                .head
                .compare_exchange(cur, next, Ordering::Acquire, Ordering::Acquire)
            {
                Ok(_) => return Some(cur),
                Err(now) => cur = now,
            }
        }
    }
}

/// Proof that the models bite: the same ABA schedule as `aba_pop_pop_push_is_detected`, run on a head
/// without a tag. loom finds the interleaving in which the stalled pop's CAS succeeds against the recycled
/// top and installs a slot the other thread still owns, so a slot is handed out twice and the
/// permutation check panics.
#[test]
#[should_panic(expected = "every slot exactly once")]
fn aba_corrupts_an_untagged_head() {
    run_model(|| {
        let list = Arc::new(UntaggedStack::new_full(3));
        let l2 = Arc::clone(&list);
        let t = thread::spawn(move || {
            let a = l2.pop();
            let b = l2.pop();
            if let Some(a) = a {
                l2.push(a);
            }
            b
        });
        let mine = list.pop();
        let b = t.join().unwrap();
        let mut got: Vec<u32> = mine.into_iter().chain(b).collect();
        got.extend(std::iter::from_fn(|| list.pop()).take(8));
        assert_permutation(got, 3);
    });
}
