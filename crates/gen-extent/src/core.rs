//! The pure offset allocator: best-fit with coalescing over `[0, len)`, no device involved.
//!
//! Free extents are maximal (two free extents never touch: free coalesces with both neighbours) and
//! indexed twice: by `(size, offset)` in a `BTreeSet`, so the best fit — the smallest extent that holds
//! the request, the lowest-addressed among equals — is one range query; and by offset in a `BTreeMap`, so
//! free finds its neighbours in O(log n). An allocation takes the low end of the chosen extent; the
//! remainder stays free. Live blocks are kept in a `HashMap` from offset to size.

use std::collections::{BTreeMap, BTreeSet, HashMap};

/// Allocation granularity and alignment: blocks start at multiples of 512 B, sizes round up to 512 B.
pub const MIN_BLOCK: u64 = 512;

/// Round `size` up to a multiple of [`MIN_BLOCK`]; `None` for 0 or on overflow.
pub fn round_size(size: u64) -> Option<u64> {
    if size == 0 {
        return None;
    }
    size.checked_add(MIN_BLOCK - 1)
        .map(|s| s & !(MIN_BLOCK - 1))
}

/// A best-fit coalescing allocator of offsets in `[0, len)`. Not thread-safe by itself (the arena wraps
/// it in a mutex).
#[derive(Debug)]
pub struct ExtentCore {
    len: u64,
    by_size: BTreeSet<(u64, u64)>,
    by_off: BTreeMap<u64, u64>,
    live: HashMap<u64, u64>,
    live_bytes: u64,
    /// Lowest-address first fit instead of best fit.
    pub first_fit: bool,
}

impl ExtentCore {
    /// A core over `[0, len)` with `len` rounded down to a multiple of 512 B; wholly free.
    pub fn new(len: u64) -> Self {
        let len = len & !(MIN_BLOCK - 1);
        let mut core = ExtentCore {
            len,
            by_size: BTreeSet::new(),
            by_off: BTreeMap::new(),
            live: HashMap::new(),
            live_bytes: 0,
            first_fit: std::env::var_os("GENPOOL_FIRST_FIT").is_some(),
        };
        if len > 0 {
            core.insert_free(0, len);
        }
        core
    }

    /// Length of the managed range in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True when no block is live.
    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    /// Bytes in live blocks (each rounded up to 512 B).
    pub fn live_bytes(&self) -> u64 {
        self.live_bytes
    }

    /// Number of live blocks.
    pub fn live_blocks(&self) -> usize {
        self.live.len()
    }

    /// Number of free extents.
    pub fn free_extents(&self) -> usize {
        self.by_off.len()
    }

    /// Size of the largest free extent (0 when full).
    pub fn largest_free(&self) -> u64 {
        self.by_size.last().map_or(0, |&(s, _)| s)
    }

    /// Allocate `size` bytes (rounded up to 512 B) best-fit; returns the offset, or `None` when no free
    /// extent is large enough (or `size` is 0).
    pub fn alloc(&mut self, size: u64) -> Option<u64> {
        let size = round_size(size)?;
        let (ext_size, off) = if self.first_fit {
            self.by_off
                .iter()
                .find(|&(_, &s)| s >= size)
                .map(|(&o, &s)| (s, o))?
        } else {
            *self.by_size.range((size, 0)..).next()?
        };
        self.remove_free(off, ext_size);
        if ext_size > size {
            self.insert_free(off + size, ext_size - size);
        }
        self.live.insert(off, size);
        self.live_bytes += size;
        Some(off)
    }

    /// Up to `k` placements for `size` bytes (rounded up to 512 B), best fit first: for each of the `k`
    /// smallest free extents that fit, the block at the extent's start and, when the extent is larger, at
    /// its end. Offsets only; nothing changes.
    pub fn candidates(&self, size: u64, k: usize) -> Vec<u64> {
        let Some(size) = round_size(size) else {
            return Vec::new();
        };
        let mut out = Vec::with_capacity(2 * k);
        for &(ext_size, off) in self.by_size.range((size, 0)..).take(k) {
            out.push(off);
            if ext_size > size {
                out.push(off + ext_size - size);
            }
        }
        out
    }

    /// Allocate `size` bytes (rounded up to 512 B) at `offset`, which must lie with the whole block inside
    /// one free extent (as [`candidates`](Self::candidates) returns). Returns `None`, changing nothing,
    /// otherwise.
    pub fn alloc_at(&mut self, offset: u64, size: u64) -> Option<u64> {
        let size = round_size(size)?;
        let (&ext_off, &ext_size) = self.by_off.range(..=offset).next_back()?;
        let end = offset.checked_add(size)?;
        if offset % MIN_BLOCK != 0 || end > ext_off + ext_size {
            return None;
        }
        self.remove_free(ext_off, ext_size);
        if offset > ext_off {
            self.insert_free(ext_off, offset - ext_off);
        }
        if ext_off + ext_size > end {
            self.insert_free(end, ext_off + ext_size - end);
        }
        self.live.insert(offset, size);
        self.live_bytes += size;
        Some(offset)
    }

    /// Size of the live block starting at `offset`, if any.
    pub fn block_size(&self, offset: u64) -> Option<u64> {
        self.live.get(&offset).copied()
    }

    /// Free the live block starting at `offset` and coalesce it with free neighbours; returns its size,
    /// or `None` (with no effect) when no live block starts there.
    pub fn free(&mut self, offset: u64) -> Option<u64> {
        let size = self.live.remove(&offset)?;
        self.live_bytes -= size;
        let (mut start, mut end) = (offset, offset + size);
        if let Some((&p_off, &p_size)) = self.by_off.range(..offset).next_back() {
            if p_off + p_size == offset {
                self.remove_free(p_off, p_size);
                start = p_off;
            }
        }
        if let Some(&n_size) = self.by_off.get(&end) {
            self.remove_free(end, n_size);
            end += n_size;
        }
        self.insert_free(start, end - start);
        Some(size)
    }

    fn insert_free(&mut self, off: u64, size: u64) {
        self.by_size.insert((size, off));
        self.by_off.insert(off, size);
    }

    fn remove_free(&mut self, off: u64, size: u64) {
        self.by_size.remove(&(size, off));
        self.by_off.remove(&off);
    }

    /// The free extents as `(offset, length)`, sorted by offset.
    pub fn free_ranges(&self) -> Vec<(u64, u64)> {
        self.by_off.iter().map(|(&o, &s)| (o, s)).collect()
    }

    /// The live blocks as `(offset, length)`, sorted by offset.
    pub fn live_ranges(&self) -> Vec<(u64, u64)> {
        let mut v: Vec<(u64, u64)> = self.live.iter().map(|(&o, &s)| (o, s)).collect();
        v.sort_unstable();
        v
    }

    /// Check every structural invariant; returns the first violation. O(n log n): tests and debugging.
    pub fn check(&self) -> Result<(), String> {
        if self.by_size.len() != self.by_off.len() {
            return Err(format!(
                "{} extents by size, {} by offset",
                self.by_size.len(),
                self.by_off.len()
            ));
        }
        for (&o, &s) in &self.by_off {
            if !self.by_size.contains(&(s, o)) {
                return Err(format!(
                    "free extent ({o:#x}, {s:#x}) missing from the size index"
                ));
            }
            if s == 0 || o % MIN_BLOCK != 0 || s % MIN_BLOCK != 0 {
                return Err(format!("free extent ({o:#x}, {s:#x}) empty or misaligned"));
            }
            if self.by_off.contains_key(&(o + s)) {
                return Err(format!(
                    "free extents at {o:#x} and {:#x} not coalesced",
                    o + s
                ));
            }
        }
        let mut all = self.free_ranges();
        all.extend(self.live_ranges());
        all.sort_unstable();
        let mut at = 0;
        for (off, len) in all {
            if off != at {
                return Err(format!(
                    "gap or overlap at {at:#x} (next range starts at {off:#x})"
                ));
            }
            at = off + len;
        }
        if at != self.len {
            return Err(format!("ranges end at {at:#x}, core is {:#x}", self.len));
        }
        if self.live.values().sum::<u64>() != self.live_bytes {
            return Err("live byte count out of sync".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_and_alloc_at_place_inside_free_extents() {
        let mut c = ExtentCore::new(64 * 512);
        let a = c.alloc(4 * 512).unwrap();
        let b = c.alloc(8 * 512).unwrap();
        let _keep = c.alloc(512).unwrap();
        c.free(a).unwrap();
        c.free(b).unwrap();
        // Free: [0, 12) units (a and b coalesced) and [13, 64).
        let cands = c.candidates(2 * 512, 2);
        assert_eq!(
            cands,
            vec![0, 10 * 512, 13 * 512, 62 * 512],
            "both ends, best fit first"
        );
        assert_eq!(c.alloc_at(10 * 512, 2 * 512), Some(10 * 512));
        assert_eq!(c.free_ranges(), vec![(0, 10 * 512), (13 * 512, 51 * 512)]);
        // Overlapping a live block, unaligned, or past the end: refused, nothing changed.
        assert_eq!(c.alloc_at(11 * 512, 512), None);
        assert_eq!(c.alloc_at(100, 512), None);
        assert_eq!(c.alloc_at(63 * 512, 2 * 512), None);
        assert_eq!(c.free_ranges(), vec![(0, 10 * 512), (13 * 512, 51 * 512)]);
        c.check().unwrap();
    }

    const U: u64 = MIN_BLOCK;

    /// A tiny deterministic PRNG (xorshift64*), so the stress test needs no dependency and runs under Miri.
    struct Rng(u64);
    impl Rng {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
        }
    }

    #[test]
    fn best_fit_prefers_smallest_then_lowest() {
        let mut c = ExtentCore::new(100 * U);
        let a: Vec<u64> = [10, 3, 10, 5, 10, 3, 10]
            .iter()
            .map(|&n| c.alloc(n * U).unwrap())
            .collect();
        assert_eq!(a, vec![0, 10 * U, 13 * U, 23 * U, 28 * U, 38 * U, 41 * U]);
        // Holes of 3, 5, 3 units (at 10, 23, 38) and the 49-unit tail at 51.
        c.free(a[1]).unwrap();
        c.free(a[3]).unwrap();
        c.free(a[5]).unwrap();
        c.check().unwrap();
        assert_eq!(c.alloc(3 * U), Some(10 * U), "smallest fit, lowest address");
        assert_eq!(
            c.alloc(2 * U),
            Some(38 * U),
            "the remaining 3-unit hole beats the 5-unit one"
        );
        assert_eq!(c.alloc(4 * U), Some(23 * U));
        // The 4-unit block left one unit of the 5-unit hole, which now serves a 1-unit request.
        assert_eq!(c.alloc(1), Some(27 * U));
        assert_eq!(c.alloc(6 * U), Some(51 * U), "only the tail fits");
        c.check().unwrap();
    }

    #[test]
    fn free_coalesces_both_sides() {
        let mut c = ExtentCore::new(30 * U);
        let a = c.alloc(10 * U).unwrap();
        let b = c.alloc(10 * U).unwrap();
        let d = c.alloc(10 * U).unwrap();
        assert_eq!(c.free_extents(), 0);
        assert_eq!(c.alloc(1), None);
        c.free(a).unwrap();
        c.free(d).unwrap();
        assert_eq!(c.free_extents(), 2);
        assert_eq!(c.free(b), Some(10 * U));
        assert_eq!(c.free_ranges(), vec![(0, 30 * U)]);
        assert_eq!(c.largest_free(), 30 * U);
        c.check().unwrap();
    }

    #[test]
    fn invalid_frees_change_nothing() {
        let mut c = ExtentCore::new(64 * U);
        let a = c.alloc(4 * U).unwrap();
        let before = (c.free_ranges(), c.live_ranges());
        for bad in [a + 1, a + U, 4 * U, 63 * U, u64::MAX] {
            assert_eq!(c.free(bad), None, "free({bad:#x})");
        }
        assert_eq!((c.free_ranges(), c.live_ranges()), before);
        assert_eq!(c.free(a), Some(4 * U));
        assert_eq!(c.free(a), None, "double free");
        c.check().unwrap();
    }

    #[test]
    fn degenerate_sizes() {
        let mut c = ExtentCore::new(4 * U + 100);
        assert_eq!(c.len(), 4 * U, "length rounds down to 512 B");
        assert_eq!(c.alloc(0), None);
        assert_eq!(c.alloc(u64::MAX), None);
        assert_eq!(c.alloc(4 * U + 1), None);
        assert_eq!(c.alloc(4 * U), Some(0));
        let mut empty = ExtentCore::new(100);
        assert_eq!(empty.alloc(1), None);
        empty.check().unwrap();
    }

    /// Random alloc/free against a model of live ranges: no overlap, alignment, exact sizes, structure,
    /// and best fit (a failed request means no free extent was large enough).
    #[test]
    fn random_stress_against_model() {
        let (rounds, len) = if cfg!(miri) {
            (300, 512 * U)
        } else {
            (20_000, 8192 * U)
        };
        let mut c = ExtentCore::new(len);
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        let mut live: Vec<(u64, u64)> = Vec::new();
        for i in 0..rounds {
            if live.is_empty() || rng.below(100) < 55 {
                let max = if rng.below(4) == 0 { len / 8 } else { 32 * U };
                let size = 1 + rng.below(max);
                let rounded = round_size(size).unwrap();
                let best = c
                    .free_ranges()
                    .into_iter()
                    .filter(|&(_, s)| s >= rounded)
                    .min_by_key(|&(o, s)| (s, o));
                match c.alloc(size) {
                    Some(off) => {
                        assert_eq!(Some(off), best.map(|(o, _)| o), "not the best fit");
                        assert!(
                            live.iter()
                                .all(|&(o, s)| off + rounded <= o || o + s <= off),
                            "overlap"
                        );
                        live.push((off, rounded));
                    }
                    None => assert_eq!(best, None, "alloc failed with a large enough free extent"),
                }
            } else {
                let (off, size) = live.swap_remove(rng.below(live.len() as u64) as usize);
                assert_eq!(c.free(off), Some(size));
            }
            assert_eq!(c.live_bytes(), live.iter().map(|&(_, s)| s).sum::<u64>());
            if i % if cfg!(miri) { 50 } else { 500 } == 0 {
                c.check().unwrap();
            }
        }
        for (off, size) in live.drain(..) {
            assert_eq!(c.free(off), Some(size));
        }
        c.check().unwrap();
        assert_eq!(c.free_ranges(), vec![(0, len)]);
    }
}
