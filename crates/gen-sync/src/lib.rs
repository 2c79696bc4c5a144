//! The lock genpool's warm path takes: a test-and-test-and-set lock whose release is a plain store.
//!
//! Every extent-arena allocation and free takes three locks — its block record's shard (genpool's
//! metadata table), the arena's best fit (gen-extent) and the page pool's page references (gen-vmm). With
//! `parking_lot`'s mutex both the acquire and the release are locked compare-exchanges (the release must
//! see whether a thread is parked). Measured on the simulated device, single thread: for the record's
//! shard the two were ~85 % of its insert and removal, 15 % of an extent alloc+free (session 13); for the
//! arena's and the page pool's locks (session 19) the plain-store release took resnet50_train 74.7 →
//! 70.8 ns a call, gpt2_generate_kv 69.7 → 67.1, bert_serve_4streams 154.8 → 146.0, the rest within
//! noise (docs/ARCHITECTURE.md, "The warm path's lock").
//!
//! A waiter spins briefly ([`SPINS`]), then yields its time slice ([`YIELDS`] times), then sleeps in
//! short steps ([`NAP`]): no parking, so the release needs no read-modify-write. The shard and the arena
//! are held for tens of nanoseconds; the page pool's lock can be held across driver calls (a page map,
//! a synchronize while pages move), where a waiter's naps keep it from burning a core.

use std::sync::atomic::{
    AtomicBool,
    Ordering::{Acquire, Relaxed, Release},
};

/// Spins before a waiter starts yielding its time slice.
pub const SPINS: u32 = 64;
/// Yields, after the spins, before a waiter starts napping.
pub const YIELDS: u32 = 64;
/// A napping waiter's sleep between looks at the lock.
pub const NAP: std::time::Duration = std::time::Duration::from_micros(20);

/// See the [crate docs](crate).
pub struct RawSpinLock {
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

    /// # Safety
    /// `lock_api::RawMutex::unlock`'s contract: the calling context holds the lock (its guard's drop
    /// is the only caller). A plain release store: no waiter is parked to be woken.
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
                    std::hint::spin_loop();
                } else if spins < SPINS + YIELDS {
                    std::thread::yield_now();
                } else {
                    std::thread::sleep(NAP);
                }
                spins = spins.saturating_add(1);
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

/// A mutex over [`RawSpinLock`] (guards as `lock_api`'s).
pub type SpinMutex<T> = lock_api::Mutex<RawSpinLock, T>;

/// The guard of a [`SpinMutex`].
pub type SpinMutexGuard<'a, T> = lock_api::MutexGuard<'a, RawSpinLock, T>;

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

    #[test]
    fn a_waiter_past_its_spins_and_yields_gets_the_lock_and_sees_the_holders_writes() {
        // Held for far longer than the spins and yields last: the waiter naps, then takes the lock once
        // released and reads what the holder wrote under it.
        let hold = std::time::Duration::from_millis(if cfg!(miri) { 1 } else { 30 });
        let m = Arc::new(SpinMutex::new(0u32));
        let g = m.lock();
        let waiter = {
            let m = m.clone();
            std::thread::spawn(move || *m.lock())
        };
        std::thread::sleep(hold);
        let mut g = g;
        *g = 7;
        drop(g);
        assert_eq!(waiter.join().unwrap(), 7);
    }
}
