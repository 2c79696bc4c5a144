//! The metadata table's shard lock: a test-and-test-and-set lock whose release is a plain store.
//!
//! Every extent-arena allocation inserts its block's record and every free removes it, each under its
//! shard's lock. With `parking_lot`'s mutex both the acquire and the release are locked
//! compare-exchanges (the release must see whether a thread is parked): measured on the simulated device
//! (single thread, 64 KiB – 8 MiB blocks), the two of them were ~85 % of the record's insert and of its
//! removal, 15 % of an extent alloc+free. A shard is held for a few dozen nanoseconds (a probe in an
//! open-addressing table; rarely its growth) and 64 shards spread the threads, so a waiter spins briefly
//! and then yields its time slice instead of parking, and the release is a store.

use std::sync::atomic::{
    AtomicBool,
    Ordering::{Acquire, Relaxed, Release},
};

/// Spins before a waiter starts yielding its time slice.
const SPINS: u32 = 64;

/// See the [module docs](self).
pub(crate) struct RawSpinLock {
    locked: AtomicBool,
}

// SAFETY: `lock` and `try_lock` succeed only for the thread whose compare-exchange moved `locked` from
// false to true (Acquire: it sees everything the previous holder wrote), so one thread holds the lock at
// a time; `unlock` is called only by the holder (lock_api's contract for `RawMutex::unlock`) and
// publishes its writes with Release. The guard may move to another thread (`GuardSend`): the lock records
// no owner.
unsafe impl lock_api::RawMutex for RawSpinLock {
    #[allow(clippy::declare_interior_mutable_const)]
    const INIT: Self = RawSpinLock {
        locked: AtomicBool::new(false),
    };
    type GuardMarker = lock_api::GuardSend;

    #[inline]
    fn lock(&self) {
        if self
            .locked
            .compare_exchange_weak(false, true, Acquire, Relaxed)
            .is_err()
        {
            self.lock_contended();
        }
    }

    #[inline]
    fn try_lock(&self) -> bool {
        self.locked
            .compare_exchange(false, true, Acquire, Relaxed)
            .is_ok()
    }

    #[inline]
    unsafe fn unlock(&self) {
        self.locked.store(false, Release);
    }
}

impl RawSpinLock {
    #[cold]
    fn lock_contended(&self) {
        let mut spins = 0;
        loop {
            // Wait on a plain load (the line stays shared) until the lock looks free, then try once.
            while self.locked.load(Relaxed) {
                if spins < SPINS {
                    spins += 1;
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
            if self
                .locked
                .compare_exchange_weak(false, true, Acquire, Relaxed)
                .is_ok()
            {
                return;
            }
        }
    }
}

/// A mutex over [`RawSpinLock`].
pub(crate) type SpinMutex<T> = lock_api::Mutex<RawSpinLock, T>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn one_holder_at_a_time() {
        // Each thread adds to a plain counter under the lock by reading and writing it in two steps; any
        // overlap of two holders loses an increment.
        let (threads, rounds) = if cfg!(miri) { (3, 50) } else { (8, 20_000) };
        let m = Arc::new(SpinMutex::new((0u64, 0u64)));
        let hs: Vec<_> = (0..threads)
            .map(|_| {
                let m = m.clone();
                std::thread::spawn(move || {
                    for _ in 0..rounds {
                        let mut g = m.lock();
                        let seen = g.0;
                        std::hint::black_box(&mut *g);
                        g.0 = seen + 1;
                        g.1 += 1;
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        let g = m.lock();
        assert_eq!(*g, (threads * rounds, threads * rounds));
    }

    #[test]
    fn try_lock_fails_while_held_and_succeeds_after() {
        let m = SpinMutex::new(1u32);
        let g = m.lock();
        assert!(m.try_lock().is_none());
        drop(g);
        assert_eq!(*m.try_lock().unwrap(), 1);
    }
}
