//! A slot of its own for each thread, for counters that every allocation and free updates: a thread
//! writes only its own slot, so threads allocating at once do not write one cache line, and, since a
//! slot has a single writer, its counters are updated with a plain load and store instead of a locked
//! read-modify-write (which also waits for the core's earlier stores to drain, among them stores to lines
//! other threads share). Readers sum the slots.
//!
//! A thread claims one of [`SLOTS`] slots at its first count and gives it back when it exits (the next
//! thread to claim it continues from its values, so nothing counted is lost). Threads beyond [`SLOTS`]
//! share one more slot, [`SHARED_SLOT`], and count there with atomic adds: correct, only slower. Users:
//! the engine's live bytes and peaks (`books.rs`) and the PyTorch backend's statistics (genpool-torch).

use std::cell::Cell;
use std::sync::atomic::{
    AtomicI64, AtomicU64,
    Ordering::{Acquire, Relaxed, Release},
};

/// Slots a thread can own (one bit each in the claim word).
pub const SLOTS: usize = 64;
/// The slot threads without one of their own share (and a thread whose slot is already given back).
/// Tables of per-thread slots have `SLOTS + 1` entries.
pub const SHARED_SLOT: usize = SLOTS;

/// Which slots a live thread holds as its own (bit `i`: slot `i`).
static CLAIMED: AtomicU64 = AtomicU64::new(0);

/// A thread's slot: `own` when no other live thread writes it; given back when the thread exits.
struct MySlot {
    index: Cell<usize>,
    own: Cell<bool>,
}

impl Drop for MySlot {
    fn drop(&mut self) {
        if self.own.get() {
            // Release: the next thread to claim the slot sees every value written here.
            CLAIMED.fetch_and(!(1u64 << self.index.get()), Release);
        }
    }
}

thread_local! {
    /// This thread's slot (`usize::MAX` until first use).
    static MY_SLOT: MySlot = const { MySlot { index: Cell::new(usize::MAX), own: Cell::new(false) } };
}

#[cold]
fn claim() -> Slot {
    let mut taken = CLAIMED.load(Relaxed);
    while taken != u64::MAX {
        let i = (!taken).trailing_zeros() as usize;
        // Acquire: the values the slot's last owner wrote before giving it back.
        match CLAIMED.compare_exchange_weak(taken, taken | (1 << i), Acquire, Relaxed) {
            Ok(_) => {
                return Slot {
                    index: i,
                    own: true,
                }
            }
            Err(now) => taken = now,
        }
    }
    Slot {
        index: SHARED_SLOT,
        own: false,
    }
}

/// The calling thread's slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    /// Index into a table of `SLOTS + 1` per-thread entries.
    pub index: usize,
    /// No other live thread writes this slot: [`add`] may use a plain load and store.
    pub own: bool,
}

/// The calling thread's slot (claimed at its first call).
#[inline]
pub fn mine() -> Slot {
    MY_SLOT
        .try_with(|m| {
            let i = m.index.get();
            if i != usize::MAX {
                return Slot {
                    index: i,
                    own: m.own.get(),
                };
            }
            let s = claim();
            m.index.set(s.index);
            m.own.set(s.own);
            s
        })
        // The thread is exiting (its slot given back): count through the shared slot.
        .unwrap_or(Slot {
            index: SHARED_SLOT,
            own: false,
        })
}

/// `a += n` on a per-thread counter of `slot`; returns the new value. A plain load and store when the
/// slot is the thread's own (no other writer), else an atomic add.
#[inline]
pub fn add(a: &AtomicI64, n: i64, slot: Slot) -> i64 {
    if slot.own {
        let v = a.load(Relaxed).wrapping_add(n);
        a.store(v, Relaxed);
        v
    } else {
        a.fetch_add(n, Relaxed).wrapping_add(n)
    }
}

/// `a += 1` on a per-thread event count of `slot`.
#[inline]
pub fn count(a: &AtomicU64, slot: Slot) {
    if slot.own {
        a.store(a.load(Relaxed).wrapping_add(1), Relaxed);
    } else {
        a.fetch_add(1, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// More live threads than slots: those without a slot of their own share one with atomic adds
    /// (owners use plain stores); nothing is lost, and slots given back are claimed again.
    #[test]
    fn more_threads_than_slots_count_exactly() {
        let table: Arc<Vec<AtomicI64>> = Arc::new((0..=SLOTS).map(|_| AtomicI64::new(0)).collect());
        for _round in 0..2 {
            let threads = SLOTS + 16;
            let all_alive = Arc::new(std::sync::Barrier::new(threads));
            let hs: Vec<_> = (0..threads)
                .map(|_| {
                    let (table, all_alive) = (table.clone(), all_alive.clone());
                    std::thread::spawn(move || {
                        // Every thread claims before any exits (an exit gives its slot back).
                        let s = mine();
                        all_alive.wait();
                        for _ in 0..2_000 {
                            add(&table[s.index], 3, s);
                            add(&table[s.index], -2, s);
                        }
                        s.own
                    })
                })
                .collect();
            let owners = hs.into_iter().map(|h| h.join().unwrap());
            assert!(
                owners.filter(|&o| !o).count() >= 16,
                "16 threads past the slots share"
            );
        }
        let total: i64 = table.iter().map(|a| a.load(Relaxed)).sum();
        assert_eq!(total, 2 * (SLOTS as i64 + 16) * 2_000);
    }
}
