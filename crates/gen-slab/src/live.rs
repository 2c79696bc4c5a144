//! Per-slot live flags on cache lines of their own: slot `64 k ..= 64 k + 63` of a class share line `k`.
//!
//! Every allocation stores a slot's flag and every free swaps it, so a line two threads' slots share
//! ping-pongs between their cores. Threads take slots in runs of [`RUN`] (a shard's capacity), and a
//! chunk's slots are handed out from a line boundary (`Slab::carve`), so where the lines start decides
//! whether two threads' runs meet on one: a plain byte array starts wherever the allocator put it, and
//! runs of 63 — the old shard capacity — crossed a line every run. Here line `k` is slots `64 k ..`.

use std::sync::atomic::AtomicU8;

/// Slots per line, and per run a thread takes from a list's global stack.
pub(crate) const RUN: usize = 64;

#[repr(C, align(64))]
struct Line([AtomicU8; RUN]);

/// The live flags of a class's slots (see the [module docs](self)).
pub(crate) struct LiveFlags {
    lines: Box<[Line]>,
}

impl LiveFlags {
    /// Flags for slots `0..capacity`, all 0.
    pub(crate) fn new(capacity: usize) -> Self {
        LiveFlags {
            lines: (0..capacity.div_ceil(RUN))
                .map(|_| Line(std::array::from_fn(|_| AtomicU8::new(0))))
                .collect(),
        }
    }

    /// Slot `slot`'s flag.
    ///
    /// # Panics
    /// If `slot` is beyond the capacity rounded up to a line.
    #[inline]
    pub(crate) fn get(&self, slot: u32) -> &AtomicU8 {
        &self.lines[slot as usize / RUN].0[slot as usize % RUN]
    }

    /// The flags of slots `range`.
    pub(crate) fn range(
        &self,
        range: std::ops::Range<usize>,
    ) -> impl Iterator<Item = &AtomicU8> + '_ {
        range.map(|s| self.get(s as u32))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering::Relaxed;

    #[test]
    fn each_run_of_64_slots_has_a_line_of_its_own() {
        let f = LiveFlags::new(130);
        assert_eq!(f.lines.len(), 3);
        for line in 0..3u32 {
            let first = f.get(line * 64) as *const AtomicU8 as usize;
            assert_eq!(first % 64, 0, "line {line} starts a cache line");
            let last = f.get(line * 64 + 63) as *const AtomicU8 as usize;
            assert_eq!(last - first, 63);
        }
        f.get(129).store(1, Relaxed);
        assert_eq!(f.range(0..130).filter(|b| b.load(Relaxed) != 0).count(), 1);
        assert_eq!(
            f.range(128..130).filter(|b| b.load(Relaxed) != 0).count(),
            1
        );
    }
}
