//! The set of free-mapped pages, as `(page index, region id)`, ordered as the steal order needs: the
//! highest page index first (ties: the highest region id).
//!
//! Every block free and every revival adds or removes one entry per page, so this sits on the hot path of
//! large allocations. A two-level bitmap per region makes insert and remove O(1) and finding the highest
//! entry O(pages / 4096) per region (a balanced tree did each in O(log n) with allocation churn).

/// One region's bits: `words[i]` bit `b` is page `64 i + b`; `summary[j]` bit `b` says `words[64 j + b]`
/// is non-zero.
#[derive(Default, Clone, Debug)]
struct Bits {
    words: Vec<u64>,
    summary: Vec<u64>,
    count: u64,
}

impl Bits {
    fn insert(&mut self, p: u32) -> bool {
        let (wi, b) = ((p / 64) as usize, p % 64);
        if wi >= self.words.len() {
            self.words.resize(wi + 1, 0);
            self.summary.resize(self.words.len().div_ceil(64), 0);
        }
        if self.words[wi] & (1 << b) != 0 {
            return false;
        }
        self.words[wi] |= 1 << b;
        self.summary[wi / 64] |= 1 << (wi % 64);
        self.count += 1;
        true
    }

    fn remove(&mut self, p: u32) -> bool {
        let (wi, b) = ((p / 64) as usize, p % 64);
        match self.words.get_mut(wi) {
            Some(w) if *w & (1 << b) != 0 => {
                *w &= !(1 << b);
                if *w == 0 {
                    self.summary[wi / 64] &= !(1 << (wi % 64));
                }
                self.count -= 1;
                true
            }
            _ => false,
        }
    }

    /// Set (`on`) or clear every bit of pages `first..=last`, a word at a time; returns how many changed.
    fn set_run(&mut self, first: u32, last: u32, on: bool) -> u64 {
        let (w0, w1) = ((first / 64) as usize, (last / 64) as usize);
        if on && w1 >= self.words.len() {
            self.words.resize(w1 + 1, 0);
            self.summary.resize(self.words.len().div_ceil(64), 0);
        }
        if w0 >= self.words.len() {
            return 0;
        }
        let mut changed = 0u64;
        for wi in w0..=w1.min(self.words.len() - 1) {
            let lo = if wi == w0 { first % 64 } else { 0 };
            let hi = if wi == w1 { last % 64 } else { 63 };
            let mask = (u64::MAX >> (63 - hi)) & (u64::MAX << lo);
            let w = &mut self.words[wi];
            if on {
                changed += u64::from((mask & !*w).count_ones());
                *w |= mask;
                self.summary[wi / 64] |= 1 << (wi % 64);
            } else {
                changed += u64::from((mask & *w).count_ones());
                *w &= !mask;
                if *w == 0 {
                    self.summary[wi / 64] &= !(1 << (wi % 64));
                }
            }
        }
        if on {
            self.count += changed;
        } else {
            self.count -= changed;
        }
        changed
    }

    fn highest(&self) -> Option<u32> {
        let (si, s) = self
            .summary
            .iter()
            .enumerate()
            .rev()
            .find(|(_, &s)| s != 0)?;
        let wi = si * 64 + (63 - s.leading_zeros() as usize);
        let w = self.words[wi];
        Some((wi * 64) as u32 + (63 - w.leading_zeros()))
    }
}

/// Free-mapped pages of all regions. See the module docs.
#[derive(Default, Debug)]
pub(crate) struct FreeSet {
    regions: Vec<Bits>,
    len: u64,
}

impl FreeSet {
    /// Add `(pidx, rid)`; false when it was there already.
    pub(crate) fn insert(&mut self, (pidx, rid): (u32, u32)) -> bool {
        let r = rid as usize;
        if r >= self.regions.len() {
            self.regions.resize_with(r + 1, Bits::default);
        }
        let added = self.regions[r].insert(pidx);
        self.len += u64::from(added);
        added
    }

    /// Remove `(pidx, rid)`; false when it was not there.
    pub(crate) fn remove(&mut self, &(pidx, rid): &(u32, u32)) -> bool {
        let removed = self
            .regions
            .get_mut(rid as usize)
            .is_some_and(|b| b.remove(pidx));
        self.len -= u64::from(removed);
        removed
    }

    /// Add pages `first..=last` of region `rid` (a run: one bit operation per 64 pages, where a free of a
    /// block of many pages made one call per page). Returns how many were not there.
    pub(crate) fn insert_run(&mut self, rid: u32, first: u32, last: u32) -> u64 {
        let r = rid as usize;
        if r >= self.regions.len() {
            self.regions.resize_with(r + 1, Bits::default);
        }
        let added = self.regions[r].set_run(first, last, true);
        self.len += added;
        added
    }

    /// Remove pages `first..=last` of region `rid`; returns how many were there.
    pub(crate) fn remove_run(&mut self, rid: u32, first: u32, last: u32) -> u64 {
        let removed = self
            .regions
            .get_mut(rid as usize)
            .map_or(0, |b| b.set_run(first, last, false));
        self.len -= removed;
        removed
    }

    /// Entries.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// No entry.
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Take the entry with the highest page index (ties: the highest region id).
    pub(crate) fn pop_last(&mut self) -> Option<(u32, u32)> {
        let (pidx, rid) = self
            .regions
            .iter()
            .enumerate()
            .filter(|(_, b)| b.count > 0)
            .filter_map(|(r, b)| b.highest().map(|p| (p, r as u32)))
            .max()?;
        self.remove(&(pidx, rid));
        Some((pidx, rid))
    }

    /// Forget every entry of region `rid`.
    pub(crate) fn remove_region(&mut self, rid: u32) {
        if let Some(b) = self.regions.get_mut(rid as usize) {
            self.len -= b.count;
            *b = Bits::default();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u32, u32),
        Remove(u32, u32),
        InsertRun(u32, u32, u32),
        RemoveRun(u32, u32, u32),
        Pop,
        DropRegion(u32),
    }

    fn op() -> impl Strategy<Value = Op> {
        let page = prop_oneof![
            0..200u32,
            4000..4200u32,
            Just(63u32),
            Just(64u32),
            Just(4095u32)
        ];
        prop_oneof![
            4 => (page.clone(), 0..4u32).prop_map(|(p, r)| Op::Insert(p, r)),
            2 => (page.clone(), 0..4u32).prop_map(|(p, r)| Op::Remove(p, r)),
            2 => (page.clone(), 0..300u32, 0..4u32).prop_map(|(p, n, r)| Op::InsertRun(p, p + n, r)),
            2 => (page, 0..300u32, 0..4u32).prop_map(|(p, n, r)| Op::RemoveRun(p, p + n, r)),
            2 => Just(Op::Pop),
            1 => (0..4u32).prop_map(Op::DropRegion),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: if cfg!(miri) { 8 } else { 256 }, ..ProptestConfig::default() })]
        /// Against the ordered set it replaced: same answers, same order.
        #[test]
        fn matches_an_ordered_set(ops in proptest::collection::vec(op(), 1..200)) {
            let mut f = FreeSet::default();
            let mut m: BTreeSet<(u32, u32)> = BTreeSet::new();
            for op in ops {
                match op {
                    Op::Insert(p, r) => prop_assert_eq!(f.insert((p, r)), m.insert((p, r))),
                    Op::Remove(p, r) => prop_assert_eq!(f.remove(&(p, r)), m.remove(&(p, r))),
                    Op::InsertRun(a, b, r) => {
                        let n = (a..=b).filter(|&p| m.insert((p, r))).count() as u64;
                        prop_assert_eq!(f.insert_run(r, a, b), n);
                    }
                    Op::RemoveRun(a, b, r) => {
                        let n = (a..=b).filter(|&p| m.remove(&(p, r))).count() as u64;
                        prop_assert_eq!(f.remove_run(r, a, b), n);
                    }
                    Op::Pop => prop_assert_eq!(f.pop_last(), m.pop_last()),
                    Op::DropRegion(r) => {
                        f.remove_region(r);
                        m.retain(|&(_, x)| x != r);
                    }
                }
                prop_assert_eq!(f.len(), m.len() as u64);
                prop_assert_eq!(f.is_empty(), m.is_empty());
            }
        }
    }
}
