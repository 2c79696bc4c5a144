//! PyTorch's allocator statistics (`DeviceStats`), kept per device by the backend's entry points.
//!
//! PyTorch counts allocations, allocated bytes and requested bytes three ways: all blocks, blocks of its
//! "small pool" (≤ 1 MiB) and of its "large pool". The engine counts live bytes and the pages it holds;
//! what PyTorch asks beyond that (requested bytes, the small/large split, counts with peaks, and
//! accumulated totals that a user can reset) is counted here, per thread ([`DeviceCounters`]).
//!
//! `allocated` (the running total since the last reset) is not counted: it is `current + freed - base`,
//! where `base` is `current` at the last `reset_accumulated`.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering::Relaxed};

use genpool::thread_slot;

/// PyTorch's small-pool bound: blocks of at most 1 MiB are "small" (`kSmallSize`).
pub(crate) const SMALL_SIZE: u64 = 1 << 20;

/// One of PyTorch's `Stat`s, as laid out for C (`current`, `peak`, `allocated`, `freed`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GenpoolStat {
    /// Value now.
    pub current: i64,
    /// Highest value since the last peak reset.
    pub peak: i64,
    /// Total added since the last accumulated reset.
    pub allocated: i64,
    /// Total removed since the last accumulated reset.
    pub freed: i64,
}

/// Figures reported per device: for each of PyTorch's three stat types (all, small, large) a count,
/// bytes and requested bytes — index `kind * 3 + which`.
const FIGURES: usize = 9;
/// Figures counted: those of the small and the large pool — index [`counted`]`(kind, which)`. "All" is
/// their sum, computed when read or checked against its peak: a block changes three counted figures
/// instead of six, and a large block folds two shared totals instead of four (PyTorch's free path,
/// `benches/host/abi_replay.c`: gpt2_train_fixed, two thirds of whose blocks are large).
const COUNTED: usize = 6;
const COUNT: usize = 0;
const BYTES: usize = 1;
const REQUESTED: usize = 2;

/// The counted figure of measure `which` in pool `kind` (1 small, 2 large).
#[inline]
const fn counted(kind: usize, which: usize) -> usize {
    (kind - 1) * 3 + which
}

/// A thread's balance of a figure past which it folds into the shared total: counts and bytes (a peak
/// read from a thread's view is within this of the truth per other allocating thread).
const fn fold_at(which: usize) -> i64 {
    if which == COUNT {
        64
    } else {
        1 << 20
    }
}

/// One thread's share of a device's figures ([`genpool::thread_slot`]: written by that thread alone).
#[repr(align(64))]
struct ThreadFigures {
    current: [AtomicI64; COUNTED],
    /// Totals removed, as PyTorch's `freed` (accumulated; the reset is a base, see [`DeviceCounters`]).
    freed: [AtomicI64; COUNTED],
    /// The slot's threads ever added here: a slot that only removes (a thread freeing what others
    /// allocated) folds at once, so the allocating thread's view of a peak stays exact.
    added: AtomicBool,
}

impl ThreadFigures {
    const fn new() -> Self {
        ThreadFigures {
            current: [const { AtomicI64::new(0) }; COUNTED],
            freed: [const { AtomicI64::new(0) }; COUNTED],
            added: AtomicBool::new(false),
        }
    }
}

/// One device's figures (PyTorch's `DeviceStats` counts, bytes and requested bytes, by stat type: 0 all
/// blocks, 1 small, 2 large), counted per thread: each allocation or free updates the three figures of
/// its pool (small or large; "all" is their sum), and with one shared atomic per figure every call of
/// every thread wrote the same lines with locked adds (twelve locked instructions per free). Values read
/// are exact: the shared totals plus every thread's share. A peak is checked at each allocation against
/// the thread's view — the shared total plus its own share — so it is exact when one thread allocates,
/// and within [`fold_at`] per other allocating thread otherwise (the engine's live-byte peaks follow the
/// same rule, `genpool/src/books.rs`).
pub(crate) struct DeviceCounters {
    threads: [ThreadFigures; thread_slot::SLOTS + 1],
    folded: [AtomicI64; COUNTED],
    peak: [AtomicI64; FIGURES],
    /// `current` at the last accumulated reset (PyTorch's `allocated` = current + freed − base).
    base: [AtomicI64; FIGURES],
    /// `freed` at the last accumulated reset.
    freed_base: [AtomicI64; FIGURES],
    /// Allocations refused for want of memory (the engine's own count misses requests larger than the
    /// device, and the memory-fraction cap's refusals).
    pub(crate) ooms: AtomicI64,
}

impl DeviceCounters {
    pub(crate) const fn new() -> Self {
        DeviceCounters {
            threads: [const { ThreadFigures::new() }; thread_slot::SLOTS + 1],
            folded: [const { AtomicI64::new(0) }; COUNTED],
            peak: [const { AtomicI64::new(0) }; FIGURES],
            base: [const { AtomicI64::new(0) }; FIGURES],
            freed_base: [const { AtomicI64::new(0) }; FIGURES],
            ooms: AtomicI64::new(0),
        }
    }

    /// PyTorch's pool of a block: 1 small (≤ 1 MiB), 2 large.
    #[inline]
    fn kind(size: u64) -> usize {
        if size <= SMALL_SIZE {
            1
        } else {
            2
        }
    }

    /// The amounts a block of `size` bytes (`requested` asked for) adds to count, bytes and requested.
    #[inline]
    fn amounts(size: u64, requested: u64) -> [i64; 3] {
        [1, size as i64, requested as i64]
    }

    /// A block of `size` bytes (rounded), `requested` asked for, was handed out.
    #[inline]
    pub(crate) fn on_alloc(&self, size: u64, requested: u64) {
        let me = thread_slot::mine();
        let t = &self.threads[me.index];
        if !t.added.load(Relaxed) {
            t.added.store(true, Relaxed);
        }
        let kind = Self::kind(size);
        for (which, v) in Self::amounts(size, requested).into_iter().enumerate() {
            let c = counted(kind, which);
            let mine = thread_slot::add(&t.current[c], v, me);
            let view = self.folded[c].load(Relaxed) + mine;
            // The other pool's figure of the same measure, for this thread's view of "all".
            let o = counted(3 - kind, which);
            let view_all = view + self.folded[o].load(Relaxed) + t.current[o].load(Relaxed);
            // Peaks rarely move in a loop's steady state: plain loads keep the lines shared.
            for (f, v) in [(kind * 3 + which, view), (which, view_all)] {
                if v > self.peak[f].load(Relaxed) {
                    self.peak[f].fetch_max(v, Relaxed);
                }
            }
            if mine > fold_at(which) {
                self.fold(t, me, c, mine);
            }
        }
    }

    /// A block handed out with [`on_alloc`](Self::on_alloc) came back.
    #[inline]
    pub(crate) fn on_free(&self, size: u64, requested: u64) {
        let me = thread_slot::mine();
        let t = &self.threads[me.index];
        let helper = !t.added.load(Relaxed);
        let kind = Self::kind(size);
        for (which, v) in Self::amounts(size, requested).into_iter().enumerate() {
            let c = counted(kind, which);
            let mine = thread_slot::add(&t.current[c], -v, me);
            thread_slot::add(&t.freed[c], v, me);
            if mine < -fold_at(which) || (helper && mine != 0) {
                self.fold(t, me, c, mine);
            }
        }
    }

    /// Move `amount` (the thread's balance of counted figure `c` as last seen) into the shared total.
    #[cold]
    fn fold(&self, t: &ThreadFigures, me: thread_slot::Slot, c: usize, amount: i64) {
        thread_slot::add(&t.current[c], -amount, me);
        self.folded[c].fetch_add(amount, Relaxed);
    }

    /// The counted figures behind reported figure `f`: its own, or for "all" both pools'.
    fn behind(f: usize) -> impl Iterator<Item = usize> {
        let (kind, which) = (f / 3, f % 3);
        let kinds = if kind == 0 { 1..3 } else { kind..kind + 1 };
        kinds.map(move |k| counted(k, which))
    }

    /// Every thread's share of `field`'s figure `f`.
    fn sum(&self, f: usize, field: impl Fn(&ThreadFigures) -> &[AtomicI64; COUNTED]) -> i64 {
        Self::behind(f)
            .map(|c| {
                self.threads
                    .iter()
                    .map(|t| field(t)[c].load(Relaxed))
                    .sum::<i64>()
            })
            .sum()
    }

    /// Figure `f` now: the shared total (what threads folded) and every thread's share.
    fn current(&self, f: usize) -> i64 {
        Self::behind(f)
            .map(|c| self.folded[c].load(Relaxed))
            .sum::<i64>()
            + self.sum(f, |t| &t.current)
    }

    /// Removed from figure `f` in all (never folded: only `current` feeds peaks).
    fn freed_total(&self, f: usize) -> i64 {
        self.sum(f, |t| &t.freed)
    }

    fn stat(&self, f: usize) -> GenpoolStat {
        let current = self.current(f);
        let freed = self.freed_total(f) - self.freed_base[f].load(Relaxed);
        GenpoolStat {
            current,
            peak: self.peak[f].load(Relaxed).max(current),
            allocated: current + freed - self.base[f].load(Relaxed),
            freed,
        }
    }

    /// Bytes live on the device now (all its pools).
    #[inline]
    pub(crate) fn live_bytes(&self) -> u64 {
        self.current(BYTES).max(0) as u64
    }

    /// `(count, bytes, requested)` stats for PyTorch's stat type `i` (0 all, 1 small, 2 large).
    pub(crate) fn read(&self, i: usize) -> (GenpoolStat, GenpoolStat, GenpoolStat) {
        (
            self.stat(i * 3 + COUNT),
            self.stat(i * 3 + BYTES),
            self.stat(i * 3 + REQUESTED),
        )
    }

    pub(crate) fn reset_peaks(&self) {
        for f in 0..FIGURES {
            self.peak[f].store(self.current(f), Relaxed);
        }
    }

    pub(crate) fn reset_accumulated(&self) {
        for f in 0..FIGURES {
            self.base[f].store(self.current(f), Relaxed);
            self.freed_base[f].store(self.freed_total(f), Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_split_peaks_and_resets_as_pytorch_does() {
        let c = DeviceCounters::new();
        c.on_alloc(512, 100);
        c.on_alloc(4 << 20, (4 << 20) - 7);
        let (n, b, r) = c.read(0);
        assert_eq!((n.current, n.peak, n.allocated, n.freed), (2, 2, 2, 0));
        assert_eq!(b.current, 512 + (4 << 20));
        assert_eq!(r.current, 100 + (4 << 20) - 7);
        let (small, _, _) = c.read(1);
        let (large, lb, _) = c.read(2);
        assert_eq!((small.current, large.current), (1, 1));
        assert_eq!(lb.current, 4 << 20);
        c.on_free(4 << 20, (4 << 20) - 7);
        let (n, b, _) = c.read(0);
        assert_eq!((n.current, n.peak, n.allocated, n.freed), (1, 2, 2, 1));
        assert_eq!(b.peak, 512 + (4 << 20));
        c.reset_peaks();
        assert_eq!(c.read(0).1.peak, 512);
        c.reset_accumulated();
        let (n, _, _) = c.read(0);
        assert_eq!((n.current, n.allocated, n.freed), (1, 0, 0));
        c.on_alloc(1024, 1000);
        c.on_free(1024, 1000);
        let (n, b, _) = c.read(0);
        assert_eq!((n.current, n.allocated, n.freed), (1, 1, 1));
        assert_eq!((b.allocated, b.freed), (1024, 1024));
        assert_eq!(c.live_bytes(), 512);
    }

    /// Threads allocating and freeing at once: the figures read afterwards are exact; a thread that only
    /// frees (PyTorch's autograd thread freeing what the main thread allocated) keeps the allocating
    /// thread's peaks exact.
    #[test]
    fn threads_count_exactly_and_helper_frees_keep_peaks_exact() {
        let c = std::sync::Arc::new(DeviceCounters::new());
        let hs: Vec<_> = (0..8u64)
            .map(|i| {
                let c = c.clone();
                std::thread::spawn(move || {
                    for k in 0..20_000u64 {
                        let size = 512 * (1 + (k + i) % 4096);
                        c.on_alloc(size, size - 3);
                        c.on_free(size, size - 3);
                    }
                    c.on_alloc(2 << 20, 2 << 20);
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        let (n, b, r) = c.read(0);
        assert_eq!(
            (n.current, b.current, r.current),
            (8, 8 * (2 << 20), 8 * (2 << 20))
        );
        assert_eq!(n.freed, 8 * 20_000);
        assert_eq!(c.read(2).0.current, 8);
        assert_eq!(c.live_bytes(), 8 * (2 << 20));

        // One allocating thread (this one), frees on a helper thread: the peak is the true one.
        // Sizes on both sides of PyTorch's small/large bound: "all" is counted as the two pools' sum, and
        // its peak, like each pool's, must be the true one.
        let c = std::sync::Arc::new(DeviceCounters::new());
        let (mut live, mut peak) = ([0i64; 3], [0i64; 3]);
        let mut held = Vec::new();
        for k in 0..400u64 {
            if k % 3 != 2 || held.is_empty() {
                let size = 512 * (1 + (k * 37) % 3000);
                c.on_alloc(size, size);
                held.push(size);
                for kind in [0, DeviceCounters::kind(size)] {
                    live[kind] += size as i64;
                    peak[kind] = peak[kind].max(live[kind]);
                }
            } else {
                let size = held.swap_remove((k as usize * 7) % held.len());
                for kind in [0, DeviceCounters::kind(size)] {
                    live[kind] -= size as i64;
                }
                let c2 = c.clone();
                std::thread::spawn(move || c2.on_free(size, size))
                    .join()
                    .unwrap();
            }
            for kind in 0..3 {
                let (_, b, _) = c.read(kind);
                assert_eq!(
                    (b.current, b.peak),
                    (live[kind], peak[kind]),
                    "step {k}, stat type {kind}"
                );
            }
        }
    }
}
