//! Online detection of the iteration period of an allocation stream.
//!
//! Every allocation contributes its position-free key hash (size bucket, stream, device, site). The
//! detector hashes the last [`K`] keys into a k-gram fingerprint and remembers, in a direct-mapped table,
//! where each fingerprint was last seen and the gap before that. A fingerprint that recurs at the same gap
//! twice in a row (within 1/32) *confirms* that gap. Confirmed gaps vote into a few candidates with
//! decaying votes. Inside one training step the same layer repeats (gap = one layer), while k-grams that
//! occur once per step repeat at the step length; the detector therefore adopts the **largest** candidate
//! with at least `votes` confirmations. All state is fixed-size and allocated once.

use crate::mix;

/// Keys per fingerprint.
pub(crate) const K: usize = 8;
const TABLE: usize = 4096;
const CANDS: usize = 8;
const HALVE_EVERY: u64 = 4096;

#[derive(Clone, Copy, Default)]
struct Entry {
    tag: u64,
    last: u64,
    gap: u64,
}

#[derive(Clone, Copy, Default)]
struct Cand {
    gap: u64,
    votes: u32,
}

/// Whether two gaps agree within 1/32.
#[inline]
pub(crate) fn close(a: u64, b: u64) -> bool {
    a.abs_diff(b) <= a.max(b) / 32
}

/// The period detector; one instance per classifier, used under `try_lock`.
pub(crate) struct Detector {
    ring: [u64; K],
    pos: usize,
    seen: u64,
    table: Box<[Entry]>,
    cands: [Cand; CANDS],
    confirmations: u64,
    current: u64,
    min: u64,
    votes: u32,
}

impl Detector {
    pub(crate) fn new(min: u64, votes: u32) -> Self {
        Self {
            ring: [0; K],
            pos: 0,
            seen: 0,
            table: vec![Entry::default(); TABLE].into_boxed_slice(),
            cands: [Cand::default(); CANDS],
            confirmations: 0,
            current: 0,
            min,
            votes,
        }
    }

    /// Feeds one allocation (its clock and position-free key). Returns `Some(period)` when the adopted
    /// period changes.
    pub(crate) fn feed(&mut self, clock: u64, key: u64) -> Option<u64> {
        self.ring[self.pos] = key;
        self.pos = (self.pos + 1) % K;
        self.seen += 1;
        if self.seen < K as u64 {
            return None;
        }
        let mut h = 0x9E37_79B9_7F4A_7C15u64;
        for i in 0..K {
            h = mix(h ^ self.ring[(self.pos + i) % K]);
        }
        let h = h | 1;
        let e = &mut self.table[(h as usize) & (TABLE - 1)];
        if e.tag != h {
            *e = Entry { tag: h, last: clock, gap: 0 };
            return None;
        }
        let gap = clock.wrapping_sub(e.last);
        let confirmed = e.gap != 0 && gap >= self.min && close(gap, e.gap);
        e.gap = gap;
        e.last = clock;
        if !confirmed {
            return None;
        }
        self.vote(gap);
        let mut best = 0;
        for c in &self.cands {
            if c.votes >= self.votes && c.gap > best {
                best = c.gap;
            }
        }
        if best != 0 && (self.current == 0 || !close(best, self.current)) {
            self.current = best;
            return Some(best);
        }
        None
    }

    fn vote(&mut self, gap: u64) {
        self.confirmations += 1;
        if self.confirmations % HALVE_EVERY == 0 {
            for c in &mut self.cands {
                c.votes /= 2;
            }
        }
        if let Some(c) = self.cands.iter_mut().find(|c| c.votes > 0 && close(c.gap, gap)) {
            c.votes += 1;
            return;
        }
        if let Some(c) = self.cands.iter_mut().min_by_key(|c| c.votes) {
            *c = Cand { gap, votes: 1 };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detects_outer_period_not_inner_repeat() {
        // Iteration: a unique 40-key prologue, then 6 repeats of a 30-key "layer", then a 20-key epilogue.
        let mut d = Detector::new(16, 8);
        let mut it = Vec::new();
        it.extend(1000..1040u64);
        for _ in 0..6 {
            it.extend(2000..2030u64);
        }
        it.extend(3000..3020u64);
        let p = it.len() as u64;
        let mut clock = 0;
        let mut adopted = None;
        for _ in 0..10 {
            for &k in &it {
                if let Some(x) = d.feed(clock, mix(k)) {
                    adopted = Some(x);
                }
                clock += 1;
            }
        }
        assert_eq!(adopted, Some(p));
    }

    #[test]
    fn random_stream_has_no_period() {
        let mut d = Detector::new(16, 8);
        let mut x = 12345u64;
        for clock in 0..50_000 {
            x = mix(x);
            assert_eq!(d.feed(clock, x % 1_000_000), None);
        }
    }
}
