//! Online detection of the iteration period of an allocation stream.
//!
//! Every allocation contributes its position-free key hash (size bucket, stream, device, site). The
//! detector combines the last [`K`] keys into a k-gram fingerprint and remembers, in a direct-mapped table,
//! where each fingerprint was last seen and the gap before that. A fingerprint that recurs at the same gap
//! twice in a row (within 1/32) *confirms* that gap. Confirmed gaps vote into a few candidates whose votes
//! are halved every 4096 confirmations. Inside one training step the same layer repeats (gap = one layer),
//! while k-grams that occur once per step repeat at the step length; the detector therefore adopts the
//! **largest** candidate with at least `votes` confirmations.
//!
//! Concurrency: the detector is a statistical estimator, so it takes no lock and does no read-modify-write:
//! every field is an atomic read and written with relaxed loads and stores. Threads racing on it can lose
//! or mix samples (a torn table entry just fails to confirm), which only adds noise; it can never cause
//! undefined behaviour, and a single thread sees exactly the sequential algorithm. All state is allocated
//! once, in [`Detector::new`].

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Keys per fingerprint.
pub(crate) const K: usize = 8;
const TABLE: usize = 4096;
const CANDS: usize = 8;
const HALVE_EVERY: u64 = 4096;
const GAP_BITS: u32 = 40;
const GAP_MASK: u64 = (1 << GAP_BITS) - 1;
/// Odd multipliers that make the fingerprint depend on key order.
const MUL: [u64; K] = [
    0x9E37_79B9_7F4A_7C15,
    0xC2B2_AE3D_27D4_EB4F,
    0x1656_67B1_9E37_79F9,
    0x85EB_CA77_C2B2_AE63,
    0x27D4_EB2F_1656_67C5,
    0xFF51_AFD7_ED55_8CCD,
    0xC4CE_B9FE_1A85_EC53,
    0x2545_F491_4F6C_DD1D,
];

#[derive(Default)]
struct Entry {
    tag: AtomicU64,
    last: AtomicU64,
    gap: AtomicU64,
}

/// Whether two gaps agree within 1/32.
#[inline]
pub(crate) fn close(a: u64, b: u64) -> bool {
    a.abs_diff(b) <= a.max(b) / 32
}

#[inline]
fn unpack(v: u64) -> (u64, u64) {
    (v & GAP_MASK, v >> GAP_BITS)
}

#[inline]
fn pack(gap: u64, votes: u64) -> u64 {
    (gap & GAP_MASK) | (votes.min((1 << (64 - GAP_BITS)) - 1) << GAP_BITS)
}

/// The period detector (one per classifier).
pub(crate) struct Detector {
    ring: [AtomicU64; K],
    table: Box<[Entry]>,
    cands: [AtomicU64; CANDS],
    confirmations: AtomicU64,
    current: AtomicU64,
    min: u64,
    votes: u64,
}

impl Detector {
    pub(crate) fn new(min: u64, votes: u32) -> Self {
        Self {
            ring: Default::default(),
            table: (0..TABLE).map(|_| Entry::default()).collect(),
            cands: Default::default(),
            confirmations: AtomicU64::new(0),
            current: AtomicU64::new(0),
            min,
            votes: votes as u64,
        }
    }

    /// Feeds one allocation: its alloc clock (0, 1, 2, … in order) and position-free key. Returns
    /// `Some(period)` when the adopted period changes.
    pub(crate) fn feed(&self, clock: u64, key: u64) -> Option<u64> {
        self.ring[(clock as usize) % K].store(key, Relaxed);
        if clock < K as u64 {
            return None;
        }
        let mut h = 0u64;
        for (i, m) in MUL.iter().enumerate() {
            // Oldest key first: position i of the k-gram is clock - (K - 1) + i.
            let k = self.ring[(clock as usize + 1 + i) % K].load(Relaxed);
            h = h.wrapping_add(k.wrapping_mul(*m));
        }
        let h = (h ^ (h >> 29)) | 1;
        let e = &self.table[(h >> 7) as usize & (TABLE - 1)];
        if e.tag.load(Relaxed) != h {
            e.tag.store(h, Relaxed);
            e.last.store(clock, Relaxed);
            e.gap.store(0, Relaxed);
            return None;
        }
        let gap = clock.wrapping_sub(e.last.load(Relaxed));
        let prev = e.gap.load(Relaxed);
        e.gap.store(gap, Relaxed);
        e.last.store(clock, Relaxed);
        if prev == 0 || gap < self.min || gap > GAP_MASK || !close(gap, prev) {
            return None;
        }
        self.vote(gap);
        let mut best = 0;
        for c in &self.cands {
            let (g, v) = unpack(c.load(Relaxed));
            if v >= self.votes && g > best {
                best = g;
            }
        }
        let cur = self.current.load(Relaxed);
        if best != 0 && (cur == 0 || !close(best, cur)) {
            self.current.store(best, Relaxed);
            return Some(best);
        }
        None
    }

    fn vote(&self, gap: u64) {
        let n = self.confirmations.load(Relaxed) + 1;
        self.confirmations.store(n, Relaxed);
        if n % HALVE_EVERY == 0 {
            for c in &self.cands {
                let (g, v) = unpack(c.load(Relaxed));
                c.store(pack(g, v / 2), Relaxed);
            }
        }
        let mut weakest = 0;
        let mut weakest_votes = u64::MAX;
        for (i, c) in self.cands.iter().enumerate() {
            let (g, v) = unpack(c.load(Relaxed));
            if v > 0 && close(g, gap) {
                c.store(pack(g, v + 1), Relaxed);
                return;
            }
            if v < weakest_votes {
                weakest = i;
                weakest_votes = v;
            }
        }
        self.cands[weakest].store(pack(gap, 1), Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mix;

    #[test]
    fn detects_outer_period_not_inner_repeat() {
        // Iteration: a unique 40-key prologue, then 6 repeats of a 30-key "layer", then a 20-key epilogue.
        let d = Detector::new(16, 8);
        let mut it = Vec::new();
        it.extend(1000..1040u64);
        for _ in 0..6 {
            it.extend(2000..2030u64);
        }
        it.extend(3000..3020u64);
        let p = it.len() as u64;
        let mut clock = 0;
        let mut adopted = Vec::new();
        for _ in 0..10 {
            for &k in &it {
                if let Some(x) = d.feed(clock, mix(k)) {
                    adopted.push(x);
                }
                clock += 1;
            }
        }
        // The layer repeat may be adopted first (it gathers votes faster); the step wins once confirmed.
        assert_eq!(adopted.last(), Some(&p));
        assert!(adopted.len() <= 2, "{adopted:?}");
    }

    #[test]
    fn random_stream_has_no_period() {
        let d = Detector::new(16, 8);
        let mut x = 12345u64;
        for clock in 0..if cfg!(miri) { 2_000 } else { 50_000 } {
            x = mix(x);
            assert_eq!(d.feed(clock, x % 1_000_000), None);
        }
    }
}
