//! A free extent's stamps, piece by piece (session 26).
//!
//! An extent of a range several streams allocate from carries the [`Stamp`]s of the frees that made it:
//! who freed its bytes and when, for the stream that gets them next to be ordered after (see
//! [`gen_vmm::Handoff::before_use`]). Until session 26 an extent carried one stamp, merged whenever
//! extents coalesced: a block cut from an extent merged from many streams' frees waited for every one
//! of them, although its bytes came from one or two (eight serving streams, `genpool synth serve8`: 5 %
//! of the allocations owed four or more streams and made half of the waits). Now an extent keeps up to
//! [`MAX_PIECES`] pieces — consecutive sub-ranges, each with the stamp of the frees that touched it — and
//! a block is ordered after the pieces it overlaps only. Merging pieces (when an extent would hold more)
//! only makes a stamp name more streams or a later time: the ordering stays safe, it may just be more
//! than the bytes need.

use gen_vmm::Stamp;

use crate::tags::Tags;

/// The most pieces an extent keeps. Coalescing past it merges the two neighbouring pieces whose stamps
/// differ least. Session 26, eight serving streams (simulator): 2 / 3 / 4 / 8 pieces left 15 896 /
/// 14 422 / 13 796 / 13 148 stream waits of one stamp's 18 836, at the same instructions a call; four
/// fill a cache line.
pub(crate) const MAX_PIECES: usize = 4;

/// The stamps of one free extent: piece `i` covers `[at[i], at[i + 1])`, the last piece up to the
/// extent's end (which the extent knows). `at[0]` is the extent's start; pieces are in address order,
/// non-empty, and no two neighbours carry the same stamp. Unused entries have `at` 0 (a piece after the
/// first starts above the extent's start, so never at 0): 64 bytes, a cache line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Pieces {
    at: [u64; MAX_PIECES],
    stamp: [u64; MAX_PIECES],
}

impl Pieces {
    /// One piece from `start` carrying `stamp`.
    #[inline]
    pub(crate) fn one(start: u64, stamp: Stamp) -> Pieces {
        let mut p = Pieces {
            at: [0; MAX_PIECES],
            stamp: [0; MAX_PIECES],
        };
        p.at[0] = start;
        p.stamp[0] = stamp.bits();
        p
    }

    /// How many pieces.
    #[inline]
    fn n(&self) -> usize {
        1 + self.at[1..].iter().filter(|&&a| a != 0).count()
    }

    /// Whether no piece carries a stamp (nothing to order: such extents are not kept).
    #[inline]
    pub(crate) fn is_none(&self) -> bool {
        self.stamp.iter().all(|&s| s == 0)
    }

    /// Where the pieces start (the extent's start).
    #[inline]
    pub(crate) fn start(&self) -> u64 {
        self.at[0]
    }

    /// The pieces, as `(start, stamp)`.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, Stamp)> + '_ {
        (0..self.n()).map(|i| (self.at[i], Stamp::from_bits(self.stamp[i])))
    }

    /// The stamp of the bytes `[lo, hi)`: the pieces overlapping them, merged.
    #[inline]
    pub(crate) fn over(&self, lo: u64, hi: u64) -> Stamp {
        // A fixed loop over every entry (unused ones carry no stamp): no call, no length.
        let mut s = Stamp::NONE;
        for i in 0..MAX_PIECES {
            let end = match self.at.get(i + 1) {
                Some(&e) if e != 0 => e,
                _ => u64::MAX,
            };
            if self.at[i] < hi && end > lo {
                s = s.merge(Stamp::from_bits(self.stamp[i]));
            }
        }
        s
    }

    /// The pieces of the bytes from `x` on (the piece holding `x` now starts there), for what is left
    /// of an extent whose bytes below `x` were taken. `x` must lie past the pieces' start.
    #[inline]
    pub(crate) fn from(&self, x: u64) -> Pieces {
        debug_assert!(x > self.at[0]);
        // The last piece starting at or below x holds it: pieces `k..` stay, moved to the front.
        let k = self.at[1..].iter().filter(|&&a| a != 0 && a <= x).count();
        let mut p = Pieces {
            at: [0; MAX_PIECES],
            stamp: [0; MAX_PIECES],
        };
        for i in 0..MAX_PIECES - k {
            p.at[i] = self.at[i + k];
            p.stamp[i] = self.stamp[i + k];
        }
        p.at[0] = x;
        p
    }

    /// The pieces of the bytes below `x` (pieces from `x` on dropped, the one holding `x` cut there).
    #[inline]
    pub(crate) fn below(&self, x: u64) -> Pieces {
        debug_assert!(x > self.at[0]);
        let mut p = *self;
        for i in 1..MAX_PIECES {
            if p.at[i] >= x {
                p.at[i] = 0;
                p.stamp[i] = 0;
            }
        }
        p
    }

    /// The pieces of two extents that meet, `self` below `next` (`next` starts where `self` ends),
    /// neighbours with one stamp joined, and past [`MAX_PIECES`] the two neighbours whose stamps differ
    /// least merged (the later pair of equals: best fit cuts blocks from an extent's start, so its
    /// first pieces are kept apart longest).
    #[inline]
    pub(crate) fn join(&self, next: &Pieces) -> Pieces {
        let (n, m) = (self.n(), next.n());
        // The common cases without the general merge: neighbours with one stamp (a single piece from
        // both), or room for every piece.
        if self.stamp[n - 1] == next.stamp[0] {
            if m == 1 {
                return *self;
            }
        } else if n + m <= MAX_PIECES {
            let mut p = *self;
            for j in 0..MAX_PIECES - n {
                p.at[n + j] = next.at[j];
                p.stamp[n + j] = next.stamp[j];
            }
            return p;
        }
        self.join_merging(next)
    }

    /// [`join`](Self::join)'s general case.
    #[cold]
    fn join_merging(&self, next: &Pieces) -> Pieces {
        let mut at = [0u64; 2 * MAX_PIECES];
        let mut st = [0u64; 2 * MAX_PIECES];
        let mut n = 0;
        for (a, s) in self.iter().chain(next.iter()) {
            if n > 0 && st[n - 1] == s.bits() {
                continue;
            }
            at[n] = a;
            st[n] = s.bits();
            n += 1;
        }
        while n > MAX_PIECES {
            let cost = |i: usize| Stamp::from_bits(st[i]).differs_in(Stamp::from_bits(st[i + 1]));
            let i = (0..n - 1).rev().min_by_key(|&i| cost(i)).expect("n > 1");
            st[i] = Stamp::from_bits(st[i])
                .merge(Stamp::from_bits(st[i + 1]))
                .bits();
            at.copy_within(i + 2..n, i + 1);
            st.copy_within(i + 2..n, i + 1);
            n -= 1;
            // The merged piece may now equal a neighbour.
            if i + 1 < n && st[i] == st[i + 1] {
                at.copy_within(i + 2..n, i + 1);
                st.copy_within(i + 2..n, i + 1);
                n -= 1;
            }
            if i > 0 && st[i - 1] == st[i] {
                at.copy_within(i + 1..n, i);
                st.copy_within(i + 1..n, i);
                n -= 1;
            }
        }
        let mut p = Pieces {
            at: [0; MAX_PIECES],
            stamp: [0; MAX_PIECES],
        };
        p.at[..n].copy_from_slice(&at[..n]);
        p.stamp[..n].copy_from_slice(&st[..n]);
        p
    }

    /// The pieces' own invariants for an extent `[start, end)`: `Err` says which fails.
    pub(crate) fn check(&self, start: u64, end: u64) -> Result<(), String> {
        let n = self.n();
        if self.at[0] != start {
            return Err(format!(
                "pieces start at {:#x}, their extent at {start:#x}",
                self.at[0]
            ));
        }
        for i in 1..MAX_PIECES {
            if (i < n) != (self.at[i] != 0) || (i >= n && self.stamp[i] != 0) {
                return Err(format!("piece {i} of {n} used out of turn"));
            }
        }
        for i in 1..n {
            if self.at[i] <= self.at[i - 1] || self.at[i] >= end {
                return Err(format!(
                    "piece {i} at {:#x} out of order or past the end",
                    self.at[i]
                ));
            }
            if self.stamp[i] == self.stamp[i - 1] {
                return Err(format!("pieces {} and {i} carry one stamp", i - 1));
            }
        }
        Ok(())
    }
}

/// The free extents' stamps of a range: each stamped extent's start tag → a slot of [`Pieces`]. The
/// same open-addressing table as the extents' own tags (16-byte slots, one probe mostly): an allocation
/// or a free makes the table calls one stamp per extent made (session 12) and copies a cache line.
/// Measured against a map of pieces (80-byte entries) and against single-piece stamps kept as words
/// with a map beside them for the rest: fewer instructions than either (docs/ARCHITECTURE.md, "Stamps
/// piece by piece").
#[derive(Debug)]
pub(crate) struct StampTable {
    /// Extent start tag → index in `slots`.
    index: Tags,
    slots: Vec<Pieces>,
    /// Indices of `slots` no extent holds.
    spare: Vec<u64>,
}

impl StampTable {
    pub(crate) fn new() -> Self {
        StampTable {
            index: Tags::new(),
            slots: Vec::new(),
            spare: Vec::new(),
        }
    }

    /// The pieces of the free extent at `off` (start tag `key`), taken out (one unstamped piece where
    /// none are kept).
    #[inline]
    pub(crate) fn take(&mut self, off: u64, key: u64) -> Pieces {
        match self.index.remove(key) {
            None => Pieces::one(off, Stamp::NONE),
            Some(i) => {
                self.spare.push(i);
                self.slots[i as usize]
            }
        }
    }

    /// An allocation of `[lo, hi)` from the front of the free extent whose start tag is `key`: the
    /// stamp of those bytes; the pieces from `hi` on stay, in place, under `rest_key` (the start tag of
    /// what is left) — or go, when nothing is left (`rest_key` `None`).
    #[inline]
    pub(crate) fn cut_front(&mut self, key: u64, lo: u64, hi: u64, rest_key: Option<u64>) -> Stamp {
        let Some(i) = self.index.remove(key) else {
            return Stamp::NONE;
        };
        let p = &mut self.slots[i as usize];
        let s = p.over(lo, hi);
        match rest_key {
            Some(k) => {
                *p = p.from(hi);
                if p.is_none() {
                    self.spare.push(i);
                } else {
                    self.index.insert(k, i);
                }
            }
            None => self.spare.push(i),
        }
        s
    }

    /// Keep `pieces` for the free extent they start (`key`: its start tag); nothing for unstamped ones.
    #[inline]
    pub(crate) fn put(&mut self, pieces: Pieces, key: u64) {
        if pieces.is_none() {
            return;
        }
        let i = match self.spare.pop() {
            Some(i) => {
                self.slots[i as usize] = pieces;
                i
            }
            None => {
                self.slots.push(pieces);
                self.slots.len() as u64 - 1
            }
        };
        self.index.insert(key, i);
    }

    /// The pieces of the free extent whose start tag is `key`, if it has stamped ones.
    #[inline]
    pub(crate) fn get(&self, key: u64) -> Option<&Pieces> {
        self.index.get(key).map(|i| &self.slots[i as usize])
    }

    /// The stamp of the bytes `[lo, hi)` of the free extent whose start tag is `key`.
    #[inline]
    pub(crate) fn over(&self, key: u64, lo: u64, hi: u64) -> Stamp {
        self.index
            .get(key)
            .map_or(Stamp::NONE, |i| self.slots[i as usize].over(lo, hi))
    }

    /// Every kept extent's pieces: `(start tag, pieces)`; `Err` when two extents share a slot or the
    /// spare slots do not make up the rest.
    pub(crate) fn all(&self) -> Result<Vec<(u64, Pieces)>, String> {
        let mut used = vec![false; self.slots.len()];
        let mut out = Vec::new();
        for (k, i) in self.index.iter() {
            match used.get_mut(i as usize) {
                Some(u) if !*u => *u = true,
                _ => return Err(format!("stamp slot {i} shared or out of range")),
            }
            out.push((k, self.slots[i as usize]));
        }
        for &i in &self.spare {
            match used.get_mut(i as usize) {
                Some(u) if !*u => *u = true,
                _ => return Err(format!("spare stamp slot {i} in use or listed twice")),
            }
        }
        if used.iter().any(|&u| !u) {
            return Err("a stamp slot neither used nor spare".into());
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gen_vmm::Handoff;

    /// Distinct stamps, as a handoff makes them: stream `k` frees once.
    fn stamps(k: usize) -> Vec<Stamp> {
        let h = Handoff::default();
        (0..k).map(|i| h.freed_lazily(100 + i as u64)).collect()
    }

    #[test]
    fn a_block_is_ordered_after_the_pieces_it_overlaps_only() {
        let s = stamps(3);
        let p = Pieces::one(0, s[0])
            .join(&Pieces::one(100, s[1]))
            .join(&Pieces::one(200, s[2]));
        p.check(0, 300).unwrap();
        assert_eq!(p.over(0, 100), s[0]);
        assert_eq!(p.over(0, 101), s[0].merge(s[1]));
        assert_eq!(p.over(150, 250), s[1].merge(s[2]));
        assert_eq!(p.over(250, 300), s[2]);
        // What is left after a cut keeps its own pieces.
        let rest = p.from(150);
        rest.check(150, 300).unwrap();
        assert_eq!(rest.over(150, 200), s[1]);
        assert_eq!(rest.over(200, 300), s[2]);
        let left = p.below(150);
        left.check(0, 150).unwrap();
        assert_eq!(left.over(0, 150), s[0].merge(s[1]));
        assert_eq!(p.below(100), Pieces::one(0, s[0]));
        assert_eq!(p.from(200), Pieces::one(200, s[2]));
    }

    #[test]
    fn neighbours_with_one_stamp_join_and_past_the_limit_the_closest_merge() {
        let s = stamps(MAX_PIECES + 2);
        let same = Pieces::one(0, s[0]).join(&Pieces::one(64, s[0]));
        assert_eq!(same, Pieces::one(0, s[0]));
        let mut p = Pieces::one(0, s[0]);
        for (i, &st) in s.iter().enumerate().skip(1) {
            p = p.join(&Pieces::one(i as u64 * 64, st));
            p.check(0, (i as u64 + 1) * 64).unwrap();
        }
        // Never more than the limit, and every byte still ordered after (at least) its own frees.
        for (i, &st) in s.iter().enumerate() {
            let got = p.over(i as u64 * 64, i as u64 * 64 + 1);
            assert_eq!(got.merge(st), got, "piece {i} lost its freer");
        }
        // The first pieces stay apart longest.
        assert_eq!(p.over(0, 64), s[0]);
        // Unstamped bytes stay unstamped where no stamp merged into them.
        let q = Pieces::one(0, Stamp::NONE).join(&Pieces::one(64, s[1]));
        assert_eq!(q.over(0, 64), Stamp::NONE);
        assert!(!q.is_none());
        assert!(Pieces::one(0, Stamp::NONE).is_none());
    }
}
