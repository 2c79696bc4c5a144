//! Boundary tags: an open-addressing map from a tagged offset to a `u64`, one 16-byte slot per entry.
//!
//! The extent core looks up a block's start (live or free) and a free extent's end here. A lookup that
//! hits in its first probe touches one cache line — `std`'s `HashMap` touches two (its control bytes
//! and its bucket) and `BTreeMap` several per level; inside PyTorch, where the allocator's lines are
//! cold between calls, each line is a miss. Linear probing, at most half full, deletion by backward
//! shift (no tombstones), so probe sequences stay short however long the table lives.

/// Empty slot marker. Keys are offsets (multiples of 512) with a kind in the low bits, never 0.
const EMPTY: u64 = 0;

#[derive(Debug, Clone)]
pub(crate) struct Tags {
    slots: Vec<(u64, u64)>,
    mask: usize,
    len: usize,
}

impl Tags {
    pub(crate) fn new() -> Self {
        Tags {
            slots: vec![(EMPTY, 0); 64],
            mask: 63,
            len: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    #[inline]
    fn home(&self, key: u64) -> usize {
        // Fibonacci hashing of the key (its low 9 bits are the kind, offsets are 512-B multiples).
        (key.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32) as usize & self.mask
    }

    /// The slot holding `key`, or `Err(the empty slot where it would go)`.
    #[inline]
    fn find(&self, key: u64) -> Result<usize, usize> {
        debug_assert_ne!(key, EMPTY);
        let mut i = self.home(key);
        loop {
            match self.slots[i].0 {
                k if k == key => return Ok(i),
                EMPTY => return Err(i),
                _ => i = (i + 1) & self.mask,
            }
        }
    }

    /// The value under `key`.
    #[inline]
    pub(crate) fn get(&self, key: u64) -> Option<u64> {
        self.find(key).ok().map(|i| self.slots[i].1)
    }

    /// Insert or overwrite; returns the previous value.
    pub(crate) fn insert(&mut self, key: u64, val: u64) -> Option<u64> {
        if 2 * (self.len + 1) > self.slots.len() {
            self.grow();
        }
        match self.find(key) {
            Ok(i) => Some(std::mem::replace(&mut self.slots[i].1, val)),
            Err(i) => {
                self.slots[i] = (key, val);
                self.len += 1;
                None
            }
        }
    }

    /// Remove `key`; returns its value.
    pub(crate) fn remove(&mut self, key: u64) -> Option<u64> {
        let i = self.find(key).ok()?;
        let val = self.slots[i].1;
        // Backward-shift deletion: pull later entries of the probe run into the hole when their home
        // does not lie cyclically in (hole, j].
        let mut hole = i;
        let mut j = i;
        loop {
            j = (j + 1) & self.mask;
            let (k, _) = self.slots[j];
            if k == EMPTY {
                break;
            }
            let h = self.home(k);
            let stays = if hole <= j {
                hole < h && h <= j
            } else {
                hole < h || h <= j
            };
            if !stays {
                self.slots[hole] = self.slots[j];
                hole = j;
            }
        }
        self.slots[hole] = (EMPTY, 0);
        self.len -= 1;
        Some(val)
    }

    fn grow(&mut self) {
        let doubled = vec![(EMPTY, 0); self.slots.len() * 2];
        let old = std::mem::replace(&mut self.slots, doubled);
        self.mask = self.slots.len() - 1;
        self.len = 0;
        for (k, v) in old {
            if k != EMPTY {
                self.insert(k, v);
            }
        }
    }

    /// Every entry, in no particular order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.slots.iter().copied().filter(|&(k, _)| k != EMPTY)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn matches_a_hashmap_under_random_inserts_and_removes() {
        let mut t = Tags::new();
        let mut m = HashMap::new();
        let mut x: u64 = 0x1234_5678_9abc_def1;
        let n = if cfg!(miri) { 500 } else { 100_000 };
        for _ in 0..n {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            let r = x.wrapping_mul(0x2545_f491_4f6c_dd1d);
            // A small key space so that removes hit and probe runs collide.
            let key = ((r >> 8) % 700) * 512 + 1 + (r & 1);
            match r % 3 {
                0 | 1 => assert_eq!(t.insert(key, r), m.insert(key, r)),
                _ => assert_eq!(t.remove(key), m.remove(&key)),
            }
            assert_eq!(t.len(), m.len());
        }
        for (k, v) in &m {
            assert_eq!(t.get(*k), Some(*v));
        }
        let mut all: Vec<_> = t.iter().collect();
        all.sort_unstable();
        let mut want: Vec<_> = m.into_iter().collect();
        want.sort_unstable();
        assert_eq!(all, want);
    }
}
