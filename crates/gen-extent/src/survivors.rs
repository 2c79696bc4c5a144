//! What the arena remembers of lifetimes: the sizes whose last freed block outlived
//! [`Survivors::after`] of the arena's allocations — the prediction that sends a block to the old
//! generation's range.
//!
//! Why by size, and why the last block: a block that lives across many allocations (a buffer kept for a
//! whole generation round, a cache kept across steps) placed among the young generation's churn pins a
//! partial page at each of its edges once its neighbours die, for as long as it lives; in a range of its
//! own it sits beside other survivors. Sizes recur (the same tensor shape each round), and a size whose
//! blocks change behaviour flips with its next free. No call site is needed — PyTorch's allocator
//! interface gives none. A block's age comes from the birth its start tag carries
//! ([`ExtentCore::free_aged`](crate::ExtentCore::free_aged)); the table here is [`SLOTS`] words,
//! written only by a survivor or by an old-range block of its size dying young, so the churn of sizes
//! that never survive can neither evict the few that do nor cost a read at its frees.

/// Slots of the survived-size table (direct-mapped; a survivor colliding with another only replaces it,
/// which forgets). 512 bytes: eight lines, of which an allocation reads one.
pub(crate) const SLOTS: usize = 64;

/// A run ends when the arena's live bytes fall below this fraction (1/N) of the run's highest: what is
/// freed then is a program letting go of everything (a model deleted, a replay's pass over), not a
/// lifetime its next blocks will have.
pub(crate) const EMPTIED: u64 = 16;

/// Sizes that survived, learnt from frees. Not thread-safe by itself (the arena's lock covers it).
#[derive(Debug)]
pub(crate) struct Survivors {
    /// A block freed this many allocations or more after its own allocation survived.
    after: u64,
    /// By slot: a size (a multiple of 512) whose last freed block survived, or 0.
    sizes: [u64; SLOTS],
    /// The arena's highest live bytes in this run.
    run_peak: u64,
    /// The arena emptied (below `run_peak / EMPTIED`): everything learnt is forgotten and frees teach
    /// nothing until the next allocation starts a run.
    quiet: bool,
}

#[inline]
fn slot(size: u64) -> usize {
    ((size / crate::MIN_BLOCK).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 58) as usize & (SLOTS - 1)
}

impl Survivors {
    /// Blocks surviving `after` allocations (≥ 1) count as old.
    pub(crate) fn new(after: u64) -> Self {
        Survivors {
            after: after.max(1),
            sizes: [0; SLOTS],
            run_peak: 0,
            quiet: false,
        }
    }

    /// An allocation left the arena with `live` bytes live: the run goes on (or a new one starts after
    /// the arena emptied).
    #[inline]
    pub(crate) fn allocated(&mut self, live: u64) {
        if self.quiet {
            self.quiet = false;
            self.run_peak = 0;
        }
        self.run_peak = self.run_peak.max(live);
    }

    /// Whether the last freed block of `size` (rounded, a multiple of 512) survived.
    #[inline]
    pub(crate) fn predicts_old(&self, size: u64) -> bool {
        self.sizes[slot(size)] == size
    }

    /// A block of `size` was freed `age` allocations after its own (`None`: its age is unknown, which
    /// teaches nothing); `was_old`: it was placed in the old range; `live`: the arena's live bytes
    /// after it. Only a survivor, or a block of the old range that died young, touches the table: a
    /// young block dying young — most frees — reads nothing here (its size cannot be in the table unless
    /// the old range was full when it came). A free that leaves the arena nearly empty (below
    /// `1 / EMPTIED` of the run's highest) ends the run: everything learnt is forgotten, and the frees
    /// until the next allocation teach nothing — the blocks a program keeps for its whole run (weights,
    /// optimizer state), freed when it lets go of everything, would otherwise teach their sizes a
    /// lifetime the next run's first blocks of those sizes (gradients) do not have.
    #[inline]
    pub(crate) fn freed(&mut self, size: u64, age: Option<u64>, was_old: bool, live: u64) {
        if self.quiet {
            return;
        }
        if live < self.run_peak / EMPTIED {
            self.forget();
            self.quiet = true;
            return;
        }
        let Some(age) = age else { return };
        if age >= self.after {
            self.sizes[slot(size)] = size;
        } else if was_old {
            let s = &mut self.sizes[slot(size)];
            if *s == size {
                *s = 0;
            }
        }
    }

    /// Forget every size.
    pub(crate) fn forget(&mut self) {
        self.sizes = [0; SLOTS];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_size_is_old_after_its_last_block_survived_and_young_again_after_one_did_not() {
        let mut s = Survivors::new(3);
        let big = 64 * 512;
        assert!(!s.predicts_old(big), "nothing learnt yet");
        s.freed(512, Some(1), false, 0);
        assert!(!s.predicts_old(512));
        s.freed(big, Some(3), false, 0);
        assert!(s.predicts_old(big), "lived 3 allocations");
        s.freed(big, Some(2), true, 0);
        assert!(
            !s.predicts_old(big),
            "the last block of `big`, in the old range, lived 2"
        );
        s.freed(big, Some(7), false, 0);
        s.freed(big, None, true, 0);
        assert!(s.predicts_old(big), "an unknown age teaches nothing");
        s.forget();
        assert!(!s.predicts_old(big));
    }

    #[test]
    fn sizes_that_die_young_never_evict_a_survivor() {
        let mut s = Survivors::new(2);
        let a = 512;
        let b = (1..1 << 20)
            .map(|i| a + i * 512)
            .find(|&b| slot(b) == slot(a))
            .expect("two sizes share a slot");
        s.freed(a, Some(5), false, 0);
        s.freed(b, Some(1), true, 0);
        assert!(s.predicts_old(a), "b died young: a's slot untouched");
        assert!(!s.predicts_old(b));
        s.freed(b, Some(2), false, 0);
        assert!(s.predicts_old(b));
        assert!(
            !s.predicts_old(a),
            "b survived in a's slot: a forgotten, not mispredicted"
        );
    }

    #[test]
    fn an_arena_that_empties_ends_the_run_and_its_last_frees_teach_nothing() {
        let mut s = Survivors::new(2);
        let (w, g) = (64 * 512, 32 * 512);
        // A run: weights `w` live throughout, 1 MiB at the peak.
        s.allocated(1 << 20);
        s.freed(g, Some(5), false, 1 << 19);
        assert!(s.predicts_old(g), "a survivor within the run teaches");
        // The program lets go of everything: the weights' frees above 1/16 of the peak teach, the one
        // below it ends the run and forgets.
        s.freed(w, Some(9), false, 1 << 18);
        assert!(s.predicts_old(w));
        s.freed(w, Some(9), false, (1 << 16) - 512);
        assert!(
            !s.predicts_old(w) && !s.predicts_old(g),
            "the run ended: forgotten"
        );
        s.freed(w, Some(9), false, 0);
        assert!(!s.predicts_old(w), "the last frees of a run teach nothing");
        // The next allocation starts a run, with a peak of its own.
        s.allocated(4096);
        s.freed(w, Some(9), false, 4096);
        assert!(s.predicts_old(w), "the new run learns");
        s.freed(g, Some(9), false, 255);
        assert!(
            !s.predicts_old(w),
            "below 1/16 of the new run's peak: ended"
        );
    }
}
