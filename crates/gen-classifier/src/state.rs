//! Packed per-key learning state and the epoch buckets of the overdue scheme.
//!
//! Both live in single `AtomicU64` words updated with compare-and-swap, so every update is atomic and
//! lock-free and never tears between fields.

use crate::Lifetime;
use std::sync::atomic::{AtomicU64, Ordering};

/// Fixed-point scale of a class weight: one observation adds `SCALE`.
pub(crate) const SCALE: u32 = 4096;
const W_MASK: u64 = 0xFFFF;
const N_SHIFT: u32 = 48;
const C_SHIFT: u32 = 56;

/// Decoded view of a packed key state word.
///
/// Layout: bits 0..48 three 16-bit class weights (Short, Mid, Long; fixed point, `SCALE` = 1.0),
/// bits 48..56 saturating observation count, bits 56..58 the current prediction (argmax).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct KeyState {
    pub w: [u32; 3],
    pub n: u32,
    pub class: Lifetime,
}

impl KeyState {
    pub(crate) fn unpack(v: u64) -> Self {
        Self {
            w: [
                (v & W_MASK) as u32,
                ((v >> 16) & W_MASK) as u32,
                ((v >> 32) & W_MASK) as u32,
            ],
            n: ((v >> N_SHIFT) & 0xFF) as u32,
            class: Lifetime::from_index(((v >> C_SHIFT) & 0x3) as usize),
        }
    }

    pub(crate) fn pack(&self) -> u64 {
        (self.w[0].min(0xFFFF) as u64)
            | ((self.w[1].min(0xFFFF) as u64) << 16)
            | ((self.w[2].min(0xFFFF) as u64) << 32)
            | ((self.n.min(0xFF) as u64) << N_SHIFT)
            | ((self.class.index() as u64) << C_SHIFT)
    }

    /// Decays all weights by `decay_num / 256`, adds one observation of `c`, re-derives the argmax
    /// (ties keep the current class, then prefer the longer one).
    pub(crate) fn observe(mut self, c: Lifetime, decay_num: u32) -> Self {
        for w in &mut self.w {
            *w = (*w * decay_num) >> 8;
        }
        self.w[c.index()] = (self.w[c.index()] + SCALE).min(0xFFFF);
        let prev = if self.n == 0 { c } else { self.class };
        let mut best = prev;
        for cand in [Lifetime::Long, Lifetime::Mid, Lifetime::Short] {
            if self.w[cand.index()] > self.w[best.index()] {
                best = cand;
            }
        }
        self.class = best;
        self.n = (self.n + 1).min(0xFF);
        self
    }
}

/// Atomically applies `times` observations of `c` to `cell`. Returns (old, new) decoded states.
pub(crate) fn observe_atomic(
    cell: &AtomicU64,
    c: Lifetime,
    times: u32,
    decay_num: u32,
) -> (KeyState, KeyState) {
    let mut cur = cell.load(Ordering::Relaxed);
    loop {
        let old = KeyState::unpack(cur);
        let mut new = old;
        for _ in 0..times {
            new = new.observe(c, decay_num);
        }
        let packed = new.pack();
        if packed == cur {
            // Steady state: the observation changes nothing, so the shared line stays read-only.
            return (old, new);
        }
        match cell.compare_exchange_weak(cur, packed, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return (old, new),
            Err(actual) => cur = actual,
        }
    }
}

/// Number of epoch buckets per key and class (epochs are tracked modulo this).
pub(crate) const BUCKETS: usize = 4;
const EPOCH_BITS: u32 = 40;
const EPOCH_MASK: u64 = (1 << EPOCH_BITS) - 1;
const COUNT_MASK: u64 = (1 << (64 - EPOCH_BITS)) - 1;

#[inline]
fn unpack_bucket(v: u64) -> (u64, u64) {
    (v >> (64 - EPOCH_BITS), v & COUNT_MASK)
}

#[inline]
fn pack_bucket(epoch: u64, count: u64) -> u64 {
    ((epoch & EPOCH_MASK) << (64 - EPOCH_BITS)) | count.min(COUNT_MASK)
}

/// `a - b` in the 40-bit epoch space.
#[inline]
fn ediff(a: u64, b: u64) -> u64 {
    a.wrapping_sub(b) & EPOCH_MASK
}

/// Whether epoch `e` lies in the past of `cur` (within half the epoch space).
#[inline]
fn older(cur: u64, e: u64) -> bool {
    let d = ediff(cur, e);
    d != 0 && d < (1 << (EPOCH_BITS - 1))
}

/// Outstanding predictions of one class for one key, bucketed by epoch (`clock / horizon`).
#[derive(Debug, Default)]
pub(crate) struct EpochBuckets {
    cells: [AtomicU64; BUCKETS],
}

impl EpochBuckets {
    /// Takes (zeroes) every bucket whose epoch is at least two epochs behind `cur`: those allocations
    /// have lived longer than one horizon. Returns how many were taken.
    pub(crate) fn sweep(&self, cur: u64) -> u64 {
        let cur = cur & EPOCH_MASK;
        let mut taken = 0;
        for cell in &self.cells {
            let mut v = cell.load(Ordering::Relaxed);
            loop {
                let (e, c) = unpack_bucket(v);
                if c == 0 || !older(cur, e) || ediff(cur, e) < 2 {
                    break;
                }
                match cell.compare_exchange_weak(
                    v,
                    pack_bucket(e, 0),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => {
                        taken += c;
                        break;
                    }
                    Err(a) => v = a,
                }
            }
        }
        taken
    }

    /// Records one outstanding prediction in `epoch`. Returns `(tracked, overdue_taken)`: `tracked` is
    /// false when a racing thread already moved the bucket to a newer epoch (then this allocation is not
    /// tracked); `overdue_taken` counts a stale bucket's outstanding predictions that this call evicted.
    pub(crate) fn register(&self, epoch: u64) -> (bool, u64) {
        let epoch = epoch & EPOCH_MASK;
        let cell = &self.cells[(epoch as usize) % BUCKETS];
        let mut v = cell.load(Ordering::Relaxed);
        loop {
            let (e, c) = unpack_bucket(v);
            let (new, taken) = if c == 0 || e == epoch {
                (pack_bucket(epoch, if e == epoch { c + 1 } else { 1 }), 0)
            } else if older(epoch, e) {
                (pack_bucket(epoch, 1), c)
            } else {
                return (false, 0);
            };
            match cell.compare_exchange_weak(v, new, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return (true, taken),
                Err(a) => v = a,
            }
        }
    }

    /// Removes one outstanding prediction of `epoch`. Returns false when it is no longer there (it was
    /// already counted overdue by a sweep).
    pub(crate) fn release(&self, epoch: u64) -> bool {
        let epoch = epoch & EPOCH_MASK;
        let cell = &self.cells[(epoch as usize) % BUCKETS];
        let mut v = cell.load(Ordering::Relaxed);
        loop {
            let (e, c) = unpack_bucket(v);
            if e != epoch || c == 0 {
                return false;
            }
            match cell.compare_exchange_weak(
                v,
                pack_bucket(e, c - 1),
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return true,
                Err(a) => v = a,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_roundtrip() {
        let s = KeyState {
            w: [1, 0xFFFF, 77],
            n: 200,
            class: Lifetime::Mid,
        };
        assert_eq!(KeyState::unpack(s.pack()), s);
    }

    #[test]
    fn observe_flips_within_a_few() {
        let mut s = KeyState::unpack(0);
        for _ in 0..50 {
            s = s.observe(Lifetime::Short, 192);
        }
        assert_eq!(s.class, Lifetime::Short);
        let mut flips = 0;
        while s.class == Lifetime::Short {
            s = s.observe(Lifetime::Long, 192);
            flips += 1;
        }
        assert_eq!(s.class, Lifetime::Long);
        assert!(flips <= 3, "took {flips}");
        assert!(flips >= 2, "took {flips}");
    }

    #[test]
    fn buckets_sweep_after_two_epochs() {
        let b = EpochBuckets::default();
        assert_eq!(b.register(10), (true, 0));
        assert_eq!(b.register(10), (true, 0));
        assert_eq!(b.sweep(11), 0);
        assert!(b.release(10));
        assert_eq!(b.sweep(12), 1);
        assert!(!b.release(10));
        // Stale bucket evicted on reuse.
        assert_eq!(b.register(20), (true, 0));
        assert_eq!(b.register(24), (true, 1));
        // A racing older registration does not clobber a newer epoch.
        assert_eq!(b.register(20), (false, 0));
    }
}
