//! Live bytes per tier and their peaks, and allocation and free counts, counted per thread so that threads allocating at once do not all
//! write one cache line.
//!
//! Every allocation and free changes the live bytes of its tier. A single atomic per figure (what the
//! engine had) puts every thread's every call on the same line: on the short-lived path that line's
//! ping-pong was 30 % of a free with two threads, and throughput fell as threads were added (0.59× one
//! thread's with two, on the 2-core build machine; 0.66× with 16 on the H200 host).
//!
//! Here each thread adds to a slot of its own ([`crate::thread_slot`]: one line per slot, plain stores
//! by its one writer), and a slot whose balance passes ±[`FOLD`] bytes folds it into a shared total
//! (rarely written). The live bytes are the shared total plus every slot — exact whenever read.
//!
//! A peak is checked at each allocation against the thread's own view: the shared total plus its own
//! slot. That is exact when one thread allocates — every other slot is then zero: a thread that has
//! only freed here (a helper freeing what another allocated) folds its balance at once — and within
//! [`FOLD`] bytes per other allocating thread otherwise. Summing every slot instead, or only near a
//! peak, made each allocation read the other threads' lines: measured, that cost more than the shared
//! counter it replaced (a thread's live bytes are often far below `FOLD`, so "near the peak" was always).
//! PyTorch's own statistics (`torch.cuda.max_memory_allocated`) are kept by genpool-torch, not here.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};

use crate::thread_slot::{self, Slot, SLOTS};

/// A slot's balance past which it folds into the shared total.
pub(crate) const FOLD: i64 = 1 << 20;
/// Tiers counted (the engine's four).
pub(crate) const TIERS: usize = 4;

#[repr(align(64))]
#[derive(Default)]
struct Counts {
    by_tier: [AtomicI64; TIERS],
    /// Allocations and frees counted by this slot's threads, per tier.
    allocs: [AtomicU64; TIERS],
    frees: [AtomicU64; TIERS],
}

#[repr(align(64))]
#[derive(Default)]
struct Shared {
    folded: [AtomicI64; TIERS],
}

#[repr(align(64))]
#[derive(Default)]
struct Peaks {
    total: AtomicU64,
    by_tier: [AtomicU64; TIERS],
}

/// Live bytes per tier and in all, with peaks. See the [module docs](self).
pub(crate) struct LiveBooks {
    slots: Box<[Counts]>,
    shared: Shared,
    peaks: Peaks,
}

impl LiveBooks {
    pub(crate) fn new() -> Self {
        LiveBooks {
            slots: (0..=SLOTS).map(|_| Counts::default()).collect(),
            shared: Shared::default(),
            peaks: Peaks::default(),
        }
    }

    /// `bytes` more live in `tier`.
    #[inline]
    pub(crate) fn add(&self, tier: usize, bytes: u64) {
        self.add_as(thread_slot::mine(), tier, bytes);
    }

    /// [`add`](Self::add) for a caller that has its thread's slot at hand.
    #[inline]
    pub(crate) fn add_as(&self, me: Slot, tier: usize, bytes: u64) {
        let slot = &self.slots[me.index];
        let n = bytes as i64;
        thread_slot::count(&slot.allocs[tier], me);
        let mine = thread_slot::add(&slot.by_tier[tier], n, me);
        // The thread's view of the tier: the shared total and its own slot.
        let est = self.shared.folded[tier].load(Relaxed) + mine;
        let t = est.max(0) as u64;
        // Peaks rarely move in a loop's steady state: a plain load keeps the line shared.
        if t > self.peaks.by_tier[tier].load(Relaxed) {
            self.peaks.by_tier[tier].fetch_max(t, Relaxed);
        }
        let total = (0..TIERS)
            .filter(|&i| i != tier)
            .map(|i| self.shared.folded[i].load(Relaxed) + slot.by_tier[i].load(Relaxed))
            .sum::<i64>()
            .saturating_add(est)
            .max(0) as u64;
        if total > self.peaks.total.load(Relaxed) {
            self.peaks.total.fetch_max(total, Relaxed);
        }
        if mine > FOLD {
            self.fold(slot, me, tier, mine);
        }
    }

    /// `bytes` fewer live in `tier`.
    #[inline]
    pub(crate) fn sub(&self, tier: usize, bytes: u64) {
        self.sub_as(thread_slot::mine(), tier, bytes);
    }

    /// [`sub`](Self::sub) for a caller that has its thread's slot at hand.
    #[inline]
    pub(crate) fn sub_as(&self, me: Slot, tier: usize, bytes: u64) {
        let slot = &self.slots[me.index];
        let n = bytes as i64;
        thread_slot::count(&slot.frees[tier], me);
        let mine = thread_slot::add(&slot.by_tier[tier], -n, me);
        // A slot that never allocated (a thread freeing what others allocated) keeps no balance: other
        // threads' views stay exact.
        if mine < -FOLD || (mine < 0 && slot.allocs.iter().all(|a| a.load(Relaxed) == 0)) {
            self.fold(slot, me, tier, mine);
        }
    }

    /// Move `amount` (the slot's balance as last seen) from the slot into the shared total. Another
    /// thread sharing the slot may change it meanwhile: only what was moved is subtracted.
    #[cold]
    fn fold(&self, slot: &Counts, me: Slot, tier: usize, amount: i64) {
        thread_slot::add(&slot.by_tier[tier], -amount, me);
        self.shared.folded[tier].fetch_add(amount, Relaxed);
    }

    /// Live bytes in `tier` now (every slot read).
    pub(crate) fn live(&self, tier: usize) -> u64 {
        let s: i64 = self
            .slots
            .iter()
            .map(|s| s.by_tier[tier].load(Relaxed))
            .sum();
        (self.shared.folded[tier].load(Relaxed) + s).max(0) as u64
    }

    /// Allocations and frees so far, per tier, as `(allocs, frees)`.
    pub(crate) fn counts(&self) -> [(u64, u64); TIERS] {
        let mut out = [(0, 0); TIERS];
        for s in self.slots.iter() {
            for (t, o) in out.iter_mut().enumerate() {
                o.0 += s.allocs[t].load(Relaxed);
                o.1 += s.frees[t].load(Relaxed);
            }
        }
        out
    }

    /// Live bytes in all tiers now.
    pub(crate) fn total(&self) -> u64 {
        (0..TIERS).map(|t| self.live(t)).sum()
    }

    /// The peak of `tier`'s live bytes.
    pub(crate) fn peak(&self, tier: usize) -> u64 {
        self.peaks.by_tier[tier].load(Relaxed)
    }

    /// The peak of all live bytes.
    pub(crate) fn total_peak(&self) -> u64 {
        self.peaks.total.load(Relaxed)
    }

    /// Start every peak again from the live bytes now.
    pub(crate) fn reset_peaks(&self) {
        for t in 0..TIERS {
            self.peaks.by_tier[t].store(self.live(t), Relaxed);
        }
        self.peaks.total.store(self.total(), Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn one_thread_is_exact() {
        let b = LiveBooks::new();
        let mut live = [0i64; TIERS];
        let (mut peak, mut tier_peak) = (0i64, [0i64; TIERS]);
        let mut x = 12345u64;
        for _ in 0..100_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let t = (x % TIERS as u64) as usize;
            let n = (x >> 8) % (3 << 20);
            if x & (1 << 40) != 0 || live[t] < n as i64 {
                b.add(t, n);
                live[t] += n as i64;
            } else {
                b.sub(t, n);
                live[t] -= n as i64;
            }
            peak = peak.max(live.iter().sum());
            tier_peak[t] = tier_peak[t].max(live[t]);
            assert_eq!(b.live(t), live[t] as u64);
        }
        assert_eq!(b.total(), live.iter().sum::<i64>() as u64);
        assert_eq!(b.total_peak(), peak as u64);
        for (t, &p) in tier_peak.iter().enumerate() {
            assert_eq!(b.peak(t), p as u64);
        }
        b.reset_peaks();
        assert_eq!(b.total_peak(), b.total());
    }

    /// One thread allocates; frees also come from helper threads that only free (the engine's property
    /// test frees on threads of their own): peaks stay exact.
    #[test]
    fn frees_on_helper_threads_keep_exact_peaks() {
        let b = Arc::new(LiveBooks::new());
        let (mut live, mut peak) = (0i64, 0i64);
        let mut held: Vec<u64> = Vec::new();
        let mut x = 99u64;
        for round in 0..3000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if x % 3 != 0 || held.is_empty() {
                let n = 512 * (1 + (x >> 20) % 4096);
                b.add(0, n);
                held.push(n);
                live += n as i64;
                peak = peak.max(live);
            } else {
                let n = held.swap_remove((x >> 7) as usize % held.len());
                live -= n as i64;
                if x % 2 == 0 {
                    let b2 = b.clone();
                    std::thread::spawn(move || b2.sub(0, n)).join().unwrap();
                } else {
                    b.sub(0, n);
                }
            }
            assert_eq!(b.total(), live as u64, "round {round}");
            assert_eq!(b.total_peak(), peak as u64, "round {round}");
        }
    }

    #[test]
    fn threads_balance_exactly_and_peaks_stay_within_the_fold() {
        let b = Arc::new(LiveBooks::new());
        let threads = 8;
        let hs: Vec<_> = (0..threads)
            .map(|i| {
                let b = b.clone();
                std::thread::spawn(move || {
                    for k in 0..50_000u64 {
                        let n = 512 * (1 + (k + i) % 8);
                        b.add(0, n);
                        b.sub(0, n);
                    }
                    // Each thread leaves 3 MiB live (folded in part).
                    b.add(0, 3 << 20);
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        assert_eq!(b.live(0), threads * (3 << 20));
        let peak = b.total_peak();
        assert!(peak <= threads * (3 << 20) + threads * 4096, "{peak}");
        assert!(
            peak + (threads - 1) * FOLD as u64 >= threads * (3 << 20),
            "{peak}"
        );
    }
}
