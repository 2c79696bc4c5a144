//! PyTorch's allocator statistics (`DeviceStats`), kept per device by the backend's entry points.
//!
//! PyTorch counts allocations, allocated bytes and requested bytes three ways: all blocks, blocks of its
//! "small pool" (≤ 1 MiB) and of its "large pool". The engine counts live bytes and the pages it holds;
//! what PyTorch asks beyond that (requested bytes, the small/large split, counts with peaks, and
//! accumulated totals that a user can reset) is counted here, with relaxed atomics: one add per figure on
//! allocation, a subtraction and an add on free, and a peak that is stored only when it moves.
//!
//! `allocated` (the running total since the last reset) is not counted: it is `current + freed - base`,
//! where `base` is `current` at the last `reset_accumulated`.

use std::sync::atomic::{AtomicI64, Ordering::Relaxed};

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

/// A counter with its peak and accumulated totals.
#[derive(Default)]
struct Counter {
    current: AtomicI64,
    peak: AtomicI64,
    freed: AtomicI64,
    base: AtomicI64,
}

impl Counter {
    const fn new() -> Self {
        Counter {
            current: AtomicI64::new(0),
            peak: AtomicI64::new(0),
            freed: AtomicI64::new(0),
            base: AtomicI64::new(0),
        }
    }

    #[inline]
    fn add(&self, v: i64) {
        let now = self.current.fetch_add(v, Relaxed) + v;
        if now > self.peak.load(Relaxed) {
            self.peak.fetch_max(now, Relaxed);
        }
    }

    #[inline]
    fn sub(&self, v: i64) {
        self.current.fetch_sub(v, Relaxed);
        self.freed.fetch_add(v, Relaxed);
    }

    fn read(&self) -> GenpoolStat {
        let current = self.current.load(Relaxed);
        let freed = self.freed.load(Relaxed);
        GenpoolStat {
            current,
            peak: self.peak.load(Relaxed).max(current),
            allocated: current + freed - self.base.load(Relaxed),
            freed,
        }
    }

    fn reset_peak(&self) {
        self.peak.store(self.current.load(Relaxed), Relaxed);
    }

    fn reset_accumulated(&self) {
        self.base.store(self.current.load(Relaxed), Relaxed);
        self.freed.store(0, Relaxed);
    }
}

/// Counts, bytes and requested bytes of one of PyTorch's stat types.
struct Kind {
    count: Counter,
    bytes: Counter,
    requested: Counter,
}

impl Kind {
    const fn new() -> Self {
        Kind {
            count: Counter::new(),
            bytes: Counter::new(),
            requested: Counter::new(),
        }
    }
}

/// One device's figures: index 0 all blocks, 1 small, 2 large (PyTorch's `StatType`).
#[repr(align(64))]
pub(crate) struct DeviceCounters {
    kinds: [Kind; 3],
    /// Allocations refused for want of memory (the engine's own count misses requests larger than the
    /// device, and the memory-fraction cap's refusals).
    pub(crate) ooms: AtomicI64,
}

impl DeviceCounters {
    pub(crate) const fn new() -> Self {
        DeviceCounters {
            kinds: [Kind::new(), Kind::new(), Kind::new()],
            ooms: AtomicI64::new(0),
        }
    }

    #[inline]
    fn split(size: u64) -> usize {
        if size <= SMALL_SIZE {
            1
        } else {
            2
        }
    }

    /// A block of `size` bytes (rounded), `requested` asked for, was handed out.
    #[inline]
    pub(crate) fn on_alloc(&self, size: u64, requested: u64) {
        for k in [0, Self::split(size)] {
            let k = &self.kinds[k];
            k.count.add(1);
            k.bytes.add(size as i64);
            k.requested.add(requested as i64);
        }
    }

    /// A block handed out with [`on_alloc`](Self::on_alloc) came back.
    #[inline]
    pub(crate) fn on_free(&self, size: u64, requested: u64) {
        for k in [0, Self::split(size)] {
            let k = &self.kinds[k];
            k.count.sub(1);
            k.bytes.sub(size as i64);
            k.requested.sub(requested as i64);
        }
    }

    /// Bytes live on the device now (all its pools).
    #[inline]
    pub(crate) fn live_bytes(&self) -> u64 {
        self.kinds[0].bytes.current.load(Relaxed).max(0) as u64
    }

    /// `(count, bytes, requested)` stats for PyTorch's stat type `i` (0 all, 1 small, 2 large).
    pub(crate) fn read(&self, i: usize) -> (GenpoolStat, GenpoolStat, GenpoolStat) {
        let k = &self.kinds[i];
        (k.count.read(), k.bytes.read(), k.requested.read())
    }

    pub(crate) fn reset_peaks(&self) {
        for k in &self.kinds {
            k.count.reset_peak();
            k.bytes.reset_peak();
            k.requested.reset_peak();
        }
    }

    pub(crate) fn reset_accumulated(&self) {
        for k in &self.kinds {
            k.count.reset_accumulated();
            k.bytes.reset_accumulated();
            k.requested.reset_accumulated();
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
}
