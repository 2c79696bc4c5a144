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
    size.checked_add(MIN_BLOCK - 1).map(|s| s & !(MIN_BLOCK - 1))
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
        let (ext_size, off) = *self.by_size.range((size, 0)..).next()?;
        self.remove_free(off, ext_size);
        if ext_size > size {
            self.insert_free(off + size, ext_size - size);
        }
        self.live.insert(off, size);
        self.live_bytes += size;
        Some(off)
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
            return Err(format!("{} extents by size, {} by offset", self.by_size.len(), self.by_off.len()));
        }
        for (&o, &s) in &self.by_off {
            if !self.by_size.contains(&(s, o)) {
                return Err(format!("free extent ({o:#x}, {s:#x}) missing from the size index"));
            }
            if s == 0 || o % MIN_BLOCK != 0 || s % MIN_BLOCK != 0 {
                return Err(format!("free extent ({o:#x}, {s:#x}) empty or misaligned"));
            }
            if self.by_off.contains_key(&(o + s)) {
                return Err(format!("free extents at {o:#x} and {:#x} not coalesced", o + s));
            }
        }
        let mut all = self.free_ranges();
        all.extend(self.live_ranges());
        all.sort_unstable();
        let mut at = 0;
        for (off, len) in all {
            if off != at {
                return Err(format!("gap or overlap at {at:#x} (next range starts at {off:#x})"));
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
