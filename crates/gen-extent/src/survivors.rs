//! What the arena remembers of lifetimes: for each block size, whether the last block of that size
//! outlived [`Survivors::after`] of the arena's allocations — the prediction that sends a block to the
//! old generation's range.
//!
//! Why by size, and why the last block: a block that lives across many allocations (a buffer kept for a
//! whole generation round, a cache kept across steps) placed among the young generation's churn pins a
//! partial page at each of its edges once its neighbours die, for as long as it lives; in a range of its
//! own it sits beside other survivors. Sizes recur (the same tensor shape each round), and a size whose
//! blocks change behaviour flips with its next free. No call site is needed — PyTorch's allocator
//! interface gives none — and the cost is a multiply and one load per allocation, a hash insert and
//! remove per block (measured in docs/ARCHITECTURE.md, "The old generation").

use crate::tags::Tags;

/// Slots of the size → survived table (direct-mapped: a collision overwrites, which only forgets).
const SLOTS: usize = 1024;

/// Key kind of a live block's birth in [`Survivors::born`] (offsets are multiples of 512: never 0).
const BORN: u64 = 2;

/// Lifetimes by size, learnt from frees. Not thread-safe by itself (the arena's lock covers it).
#[derive(Debug)]
pub(crate) struct Survivors {
    /// A block freed this many allocations or more after its own allocation survived.
    after: u64,
    /// Allocations so far (this arena's).
    clock: u64,
    /// Each live block's allocation clock, by offset.
    born: Tags,
    /// By slot of a size: `size | 1` when the last freed block of that size survived, `size` when it
    /// did not, 0 when no block of a size hashing here was freed yet.
    memory: Box<[u64]>,
}

#[inline]
fn slot(size: u64) -> usize {
    ((size / crate::MIN_BLOCK).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 54) as usize & (SLOTS - 1)
}

impl Survivors {
    /// Blocks surviving `after` allocations (≥ 1) count as old.
    pub(crate) fn new(after: u64) -> Self {
        Survivors {
            after: after.max(1),
            clock: 0,
            born: Tags::new(),
            memory: vec![0; SLOTS].into_boxed_slice(),
        }
    }

    /// Whether the last freed block of `size` (rounded, a multiple of 512) survived.
    #[inline]
    pub(crate) fn predicts_old(&self, size: u64) -> bool {
        self.memory[slot(size)] == size | 1
    }

    /// A block was allocated at `offset`.
    #[inline]
    pub(crate) fn allocated(&mut self, offset: u64) {
        self.clock += 1;
        self.born.insert(offset | BORN, self.clock);
    }

    /// The block of `size` at `offset` was freed: remember whether it survived. A block allocated before
    /// the arena remembered (none here) teaches nothing.
    #[inline]
    pub(crate) fn freed(&mut self, offset: u64, size: u64) {
        if let Some(b) = self.born.remove(offset | BORN) {
            let survived = self.clock - b >= self.after;
            self.memory[slot(size)] = size | u64::from(survived);
        }
    }

    /// Forget every size's lesson (live blocks' births stay: their frees still teach).
    pub(crate) fn forget(&mut self) {
        self.memory.fill(0);
    }

    /// Live blocks with a recorded birth (tests).
    #[cfg(test)]
    pub(crate) fn tracked(&self) -> usize {
        self.born.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_size_is_old_after_its_last_block_survived_and_young_again_after_one_did_not() {
        let mut s = Survivors::new(3);
        let (a, big) = (0, 64 * 512);
        assert!(!s.predicts_old(big), "nothing learnt yet");
        s.allocated(a);
        for i in 1..=3 {
            s.allocated(i * big);
            s.freed(i * big, 512);
        }
        assert!(
            !s.predicts_old(512),
            "512-B blocks lived one allocation each"
        );
        s.freed(a, big);
        assert!(
            s.predicts_old(big),
            "the block of `big` lived 3 allocations"
        );
        s.allocated(a);
        s.allocated(big);
        s.freed(a, big);
        assert!(
            !s.predicts_old(big),
            "the last block of `big` lived 1 allocation"
        );
        s.freed(big, 512);
        assert_eq!(s.tracked(), 0);
    }

    #[test]
    fn a_free_of_an_unrecorded_block_teaches_nothing() {
        let mut s = Survivors::new(1);
        s.freed(4096, 4096);
        assert!(!s.predicts_old(4096));
        assert_eq!(s.memory.iter().filter(|&&m| m != 0).count(), 0);
    }

    #[test]
    fn sizes_that_share_a_slot_only_forget_each_other() {
        let mut s = Survivors::new(1);
        let a = 512;
        let b = (1..1 << 20)
            .map(|i| a + i * 512)
            .find(|&b| slot(b) == slot(a))
            .expect("two sizes share a slot");
        s.allocated(0);
        s.allocated(512);
        s.freed(0, a);
        assert!(s.predicts_old(a));
        assert!(!s.predicts_old(b), "b's slot holds a: no prediction for b");
        s.allocated(0);
        s.allocated(1024);
        s.freed(0, b);
        assert!(s.predicts_old(b));
        assert!(
            !s.predicts_old(a),
            "a was overwritten: forgotten, not mispredicted"
        );
    }
}
