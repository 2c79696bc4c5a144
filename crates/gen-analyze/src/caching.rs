//! A host simulation of PyTorch's `CUDACachingAllocator` (the "native" allocator), with and without
//! `expandable_segments:True`. Pure address arithmetic over simulated segments; nothing is dereferenced.
//!
//! Policies simulated (PyTorch 2.x; no garbage-collection threshold, memory never short, so cached
//! segments are never released; the two knobs of [`Knobs`] as documented for
//! `PYTORCH_CUDA_ALLOC_CONF`):
//!
//! - Requests are rounded up to 512 B ([`ROUND`]); with `roundup_power2_divisions:N` (N ≥ 2) a request
//!   over 512·N B is rounded up to the next of N equal divisions of its power-of-two interval
//!   (1200 MiB with N = 4 → 1280 MiB; exact powers of two stay). A rounded size ≤ 1 MiB ([`SMALL_SIZE`]) goes to the
//!   *small* pool, anything larger to the *large* pool. Pools never lend to each other.
//! - A request is served by the best-fitting free block of its pool *on its stream*: the smallest free
//!   block of at least the rounded size, lowest address among equals.
//! - **Native**: with no fitting block a new segment is taken from the driver (`cudaMalloc`):
//!   2 MiB for small requests, 20 MiB for large ones under 10 MiB ([`MIN_LARGE_ALLOC`]), else the request
//!   rounded up to 2 MiB. A block is split when the rest is ≥ 512 B (small pool) or > 1 MiB (large
//!   pool); freed blocks merge with free neighbours of the same segment. Segments are never freed.
//! - **`max_split_size_mb:M`**: blocks of M MiB or more are "oversize": never split (in the large
//!   pool), never lent to a request under M MiB, and lent to a request of M MiB or more only when they
//!   exceed it by less than 20 MiB.
//! - **Expandable segments**: each (stream, pool) owns one segment of virtual address space that is
//!   mapped from its start in pages of 2 MiB (small pool) or 20 MiB (large pool). With no fitting free
//!   block, the request is placed at the end of the mapped range (starting inside the last block when
//!   that one is free) and just enough pages are mapped to cover it. Best fit treats the free block
//!   at the mapped end as the size it could grow to (`get_free_block`'s "expandable size"): when it
//!   is the best fit, the next larger free block of the pool and stream is taken instead if there is
//!   one, keeping the growable tail for requests nothing else fits. Blocks split when the rest is
//!   ≥ 512 B, in both pools. Pages are never unmapped (PyTorch unmaps only on `empty_cache` or when out
//!   of memory).
//!
//! Reserved bytes are the sum of segment sizes (native) or of mapped pages (expandable), as
//! `torch.cuda.max_memory_reserved()` counts them.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use gen_trace::{ReplayAllocator, ReplayError};

use crate::waste::{Waste, WasteCause, WasteProbe};

/// Rounding of every request and the smallest block (`kMinBlockSize`).
pub const ROUND: u64 = 512;
/// Largest request of the small pool (`kSmallSize`, 1 MiB).
pub const SMALL_SIZE: u64 = 1 << 20;
/// Segment size of the small pool (`kSmallBuffer`, 2 MiB); also the expandable small-pool page.
pub const SMALL_BUFFER: u64 = 2 << 20;
/// Segment size for large requests under [`MIN_LARGE_ALLOC`] (`kLargeBuffer`, 20 MiB); also the
/// expandable large-pool page.
pub const LARGE_BUFFER: u64 = 20 << 20;
/// Large requests from this size on get a segment of their own size (`kMinLargeAlloc`, 10 MiB).
pub const MIN_LARGE_ALLOC: u64 = 10 << 20;
/// Rounding of those segments (`kRoundLarge`, 2 MiB).
pub const ROUND_LARGE: u64 = 2 << 20;

/// Where the simulated address space starts.
const BASE: u64 = 1 << 44;
/// Virtual span of one expandable segment (larger than any real device's memory).
const EXPANDABLE_SPAN: u64 = 1 << 40;
/// Largest request accepted.
const MAX_REQUEST: u64 = 1 << 40;

/// `PYTORCH_CUDA_ALLOC_CONF` settings beyond `expandable_segments`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize)]
pub struct Knobs {
    /// `max_split_size_mb`: blocks of this many MiB or more are never split (`None`: unlimited).
    /// PyTorch requires more than 20.
    pub max_split_size_mb: Option<u32>,
    /// `roundup_power2_divisions` for every size (0 or 1: off; else a power of two).
    pub roundup_power2_divisions: u32,
}

impl Knobs {
    /// Checks the values as PyTorch does: `max_split_size_mb` > 20, divisions 0, 1 or a power of two.
    pub fn validate(&self) -> Result<(), String> {
        if let Some(m) = self.max_split_size_mb {
            if m <= 20 {
                return Err(format!("max_split_size_mb must be > 20, not {m}"));
            }
        }
        let d = self.roundup_power2_divisions;
        if d > 1 && !d.is_power_of_two() {
            return Err(format!(
                "roundup_power2_divisions must be a power of two, not {d}"
            ));
        }
        Ok(())
    }

    /// Whether every knob is at its default.
    pub fn is_default(&self) -> bool {
        self.max_split_size_mb.is_none() && self.roundup_power2_divisions <= 1
    }

    fn max_split(&self) -> u64 {
        self.max_split_size_mb
            .map_or(u64::MAX, |m| u64::from(m) << 20)
    }

    /// The block size PyTorch hands out for a request of `size` bytes (`round_size`).
    pub fn round_size(&self, size: u64) -> u64 {
        let d = u64::from(self.roundup_power2_divisions);
        if size < ROUND {
            ROUND
        } else if d > 1 && size > ROUND * d {
            if size.is_power_of_two() {
                return size;
            }
            let floor = 1u64 << (63 - size.leading_zeros());
            let step = floor / d;
            if step == 0 {
                return floor << 1;
            }
            round_up(size, step)
        } else {
            round_up(size, ROUND)
        }
    }
}

/// Which variant of the caching allocator is simulated.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CachingMode {
    /// Default settings: one `cudaMalloc` segment per growth.
    Native,
    /// `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`.
    Expandable,
}

#[derive(Clone, Copy, Debug)]
struct Block {
    size: u64,
    /// Bytes asked for, while allocated (0 when free).
    req: u64,
    allocated: bool,
    segment: u32,
    small: bool,
    stream: u64,
}

/// One expandable segment's state.
#[derive(Clone, Copy, Debug)]
struct Expandable {
    base: u64,
    /// Bytes mapped from `base`.
    mapped: u64,
    page: u64,
}

/// The simulated caching allocator. See the module docs.
#[derive(Debug)]
pub struct CachingSim {
    mode: CachingMode,
    knobs: Knobs,
    blocks: BTreeMap<u64, Block>,
    /// Free blocks by (small pool?, stream, size, address): the allocator's `BlockComparatorSize` order.
    free: BTreeSet<(bool, u64, u64, u64)>,
    /// Expandable segments by (stream, small pool?) → index into `segs`.
    expandable: HashMap<(u64, bool), u32>,
    segs: Vec<Expandable>,
    segments: u32,
    top: u64,
    reserved: u64,
    peak: u64,
}

fn round_up(x: u64, to: u64) -> u64 {
    x.div_ceil(to) * to
}

impl CachingSim {
    /// An empty allocator in `mode` with default settings.
    pub fn new(mode: CachingMode) -> Self {
        Self::with_knobs(mode, Knobs::default())
    }

    /// An empty allocator in `mode` with `knobs` (assumed valid, see [`Knobs::validate`]).
    pub fn with_knobs(mode: CachingMode, knobs: Knobs) -> Self {
        CachingSim {
            mode,
            knobs,
            blocks: BTreeMap::new(),
            free: BTreeSet::new(),
            expandable: HashMap::new(),
            segs: Vec::new(),
            segments: 0,
            top: BASE,
            reserved: 0,
            peak: 0,
        }
    }

    /// Segments taken from the driver (native) or expandable segments created.
    pub fn segments(&self) -> u32 {
        self.segments
    }

    fn insert_free(&mut self, addr: u64, b: Block) {
        self.free.insert((b.small, b.stream, b.size, addr));
        self.blocks.insert(
            addr,
            Block {
                allocated: false,
                req: 0,
                ..b
            },
        );
    }

    fn remove_free(&mut self, addr: u64, b: &Block) {
        self.free.remove(&(b.small, b.stream, b.size, addr));
    }

    fn grow_native(&mut self, size: u64, small: bool, stream: u64) -> (u64, Block) {
        let seg = if small {
            SMALL_BUFFER
        } else if size < MIN_LARGE_ALLOC {
            LARGE_BUFFER
        } else {
            round_up(size, ROUND_LARGE)
        };
        let addr = self.top;
        // A guard gap keeps segments from touching, so no merge can cross them.
        self.top += seg + ROUND_LARGE;
        self.reserved += seg;
        self.peak = self.peak.max(self.reserved);
        let b = Block {
            size: seg,
            req: 0,
            allocated: false,
            segment: self.segments,
            small,
            stream,
        };
        self.segments += 1;
        (addr, b)
    }

    /// Extends the (stream, pool) expandable segment so that a block of `size` fits at its end.
    fn grow_expandable(&mut self, size: u64, small: bool, stream: u64) -> (u64, Block) {
        let ix = match self.expandable.get(&(stream, small)) {
            Some(&ix) => ix,
            None => {
                let ix = self.segs.len() as u32;
                self.segs.push(Expandable {
                    base: self.top,
                    mapped: 0,
                    page: if small { SMALL_BUFFER } else { LARGE_BUFFER },
                });
                self.top += EXPANDABLE_SPAN;
                self.expandable.insert((stream, small), ix);
                self.segments += 1;
                ix
            }
        };
        let seg = self.segs[ix as usize];
        let end = seg.base + seg.mapped;
        // Start inside the last mapped block when it is free.
        let mut start = end;
        if let Some((&a, b)) = self.blocks.range(seg.base..end).next_back() {
            if !b.allocated && a + b.size == end {
                let b = *b;
                self.remove_free(a, &b);
                self.blocks.remove(&a);
                start = a;
            }
        }
        let mapped = round_up(start + size - seg.base, seg.page);
        self.reserved += mapped - seg.mapped;
        self.peak = self.peak.max(self.reserved);
        self.segs[ix as usize].mapped = mapped;
        let b = Block {
            size: seg.base + mapped - start,
            req: 0,
            allocated: false,
            segment: ix,
            small,
            stream,
        };
        (start, b)
    }

    /// Whether the free block at `addr` ends where its expandable segment's mapped range ends, so
    /// that it can grow into unmapped address space.
    fn is_expandable_tail(&self, addr: u64, b: &Block) -> bool {
        self.mode == CachingMode::Expandable && {
            let seg = self.segs[b.segment as usize];
            addr + b.size == seg.base + seg.mapped
        }
    }

    /// `get_free_block`'s choice: the smallest free block of at least `size` in the pool and stream
    /// (lowest address among equals). With expandable segments a block that borders unmapped space
    /// counts, for best fit, as the size it could grow to (its size plus the unmapped rest), so the
    /// next larger free block of the pool and stream is taken instead when there is one.
    fn best_fit(&self, small: bool, stream: u64, size: u64) -> Option<(bool, u64, u64, u64)> {
        let same = |&&(s, st, _, _): &&(bool, u64, u64, u64)| s == small && st == stream;
        let mut it = self.free.range((small, stream, size, 0)..).take_while(same);
        let first = *it.next()?;
        if !self.is_expandable_tail(first.3, &self.blocks[&first.3]) {
            return Some(first);
        }
        // Every other free block is smaller than the tail's expandable size (the unmapped rest of
        // a segment spans more than the device's memory), so the next one in size order wins.
        Some(it.next().copied().unwrap_or(first))
    }

    fn should_split(&self, b: &Block, size: u64) -> bool {
        let rest = b.size - size;
        if b.small || self.mode == CachingMode::Expandable {
            rest >= ROUND
        } else {
            size < self.knobs.max_split() && rest > SMALL_SIZE
        }
    }
}

impl ReplayAllocator for CachingSim {
    fn name(&self) -> String {
        match self.mode {
            CachingMode::Native => "torch-native".to_owned(),
            CachingMode::Expandable => "torch-expandable".to_owned(),
        }
    }

    fn alloc(&mut self, size: u64, stream: u64, _site: Option<u64>) -> Result<u64, ReplayError> {
        if size == 0 || size > MAX_REQUEST {
            return Err(ReplayError::InvalidRequest {
                message: format!("torch sim: size {size} outside 1..=2^40"),
            });
        }
        let req = size;
        let size = self.knobs.round_size(size);
        let small = size <= SMALL_SIZE;
        let max_split = self.knobs.max_split();
        let found = self
            .best_fit(small, stream, size)
            // Oversize blocks serve only oversize requests, and only close fits.
            .filter(|&(_, _, bsize, _)| {
                if size < max_split {
                    bsize < max_split
                } else {
                    bsize < size.saturating_add(LARGE_BUFFER)
                }
            });
        let (addr, block) = match found {
            Some((_, _, _, a)) => {
                let b = self.blocks[&a];
                self.remove_free(a, &b);
                (a, b)
            }
            None => match self.mode {
                CachingMode::Native => self.grow_native(size, small, stream),
                CachingMode::Expandable => self.grow_expandable(size, small, stream),
            },
        };
        let used = if self.should_split(&block, size) {
            self.insert_free(
                addr + size,
                Block {
                    size: block.size - size,
                    ..block
                },
            );
            size
        } else {
            block.size
        };
        self.blocks.insert(
            addr,
            Block {
                size: used,
                req,
                allocated: true,
                ..block
            },
        );
        Ok(addr)
    }

    fn free(&mut self, ptr: u64, _size: u64, _stream: u64) -> Result<(), ReplayError> {
        let b = match self.blocks.get(&ptr) {
            Some(b) if b.allocated => *b,
            _ => return Err(ReplayError::InvalidFree { ptr }),
        };
        let (mut start, mut size) = (ptr, b.size);
        if let Some(n) = self.blocks.get(&(ptr + size)).copied() {
            if !n.allocated && n.segment == b.segment && n.small == b.small {
                self.remove_free(ptr + size, &n);
                self.blocks.remove(&(ptr + size));
                size += n.size;
            }
        }
        if let Some((&pa, p)) = self.blocks.range(..ptr).next_back() {
            let p = *p;
            if !p.allocated && p.segment == b.segment && p.small == b.small && pa + p.size == ptr {
                self.remove_free(pa, &p);
                self.blocks.remove(&pa);
                start = pa;
                size += p.size;
            }
        }
        self.blocks.remove(&ptr);
        self.insert_free(start, Block { size, ..b });
        Ok(())
    }

    fn reserved(&self) -> u64 {
        self.reserved
    }

    fn peak_reserved(&self) -> u64 {
        self.peak
    }
}

impl WasteProbe for CachingSim {
    /// Allocated blocks: what they hold beyond the request is [`WasteCause::Rounding`] (the rounded
    /// request size, and any remainder not split off), except in a block of `max_split_size_mb` or
    /// more, where what exceeds a fresh segment for the request (rounded up to 2 MiB) is
    /// [`WasteCause::Oversize`]. Free blocks: native — a whole free
    /// segment is [`WasteCause::IdleSegments`], any other free block
    /// [`WasteCause::SplitFragments`]; expandable — the free block at a segment's mapped end is
    /// [`WasteCause::MappedTail`], any other [`WasteCause::FreeHoles`].
    fn waste(&self, _live: u64) -> Waste {
        let max_split = self.knobs.max_split();
        let mut parts = Vec::with_capacity(self.blocks.len());
        let mut prev: Option<(u64, &Block)> = None;
        let mut it = self.blocks.iter().peekable();
        while let Some((&addr, b)) = it.next() {
            if b.allocated {
                let rounded = self.knobs.round_size(b.req).min(b.size);
                if self.mode == CachingMode::Native && b.size >= max_split {
                    // What a fresh segment for this request would have held is rounding; the
                    // rest is there because a larger cached block was lent whole.
                    let fresh = round_up(rounded, ROUND_LARGE).min(b.size);
                    parts.push((WasteCause::Rounding, fresh - b.req));
                    parts.push((WasteCause::Oversize, b.size - fresh));
                } else {
                    parts.push((WasteCause::Rounding, b.size - b.req));
                }
            } else if self.mode == CachingMode::Expandable {
                let cause = if self.is_expandable_tail(addr, b) {
                    WasteCause::MappedTail
                } else {
                    WasteCause::FreeHoles
                };
                parts.push((cause, b.size));
            } else {
                // Blocks of one segment are contiguous, so a block alone in its segment has no
                // neighbour in address order with the same segment.
                let shares = |n: Option<&Block>| n.is_some_and(|n| n.segment == b.segment);
                let alone = !shares(prev.map(|(_, p)| p)) && !shares(it.peek().map(|(_, n)| *n));
                let cause = if alone {
                    WasteCause::IdleSegments
                } else {
                    WasteCause::SplitFragments
                };
                parts.push((cause, b.size));
            }
            prev = Some((addr, b));
        }
        Waste::from_parts(parts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn native_segment_sizes() {
        let mut a = CachingSim::new(CachingMode::Native);
        a.alloc(11 * MIB, 0, None).unwrap();
        assert_eq!(a.reserved(), 12 * MIB, "≥ 10 MiB: rounded up to 2 MiB");
        a.alloc(1, 0, None).unwrap();
        assert_eq!(
            a.reserved(),
            12 * MIB + SMALL_BUFFER,
            "small request: a 2 MiB segment"
        );
        // The 1 MiB rest of the 12 MiB segment was not split off, so this needs a new segment.
        a.alloc(MIB + 512, 0, None).unwrap();
        assert_eq!(
            a.reserved(),
            12 * MIB + SMALL_BUFFER + LARGE_BUFFER,
            "large < 10 MiB: 20 MiB"
        );
        assert_eq!(a.segments(), 3);
        // The 20 MiB segment still has 19 MiB free: a 5 MiB request fits there.
        a.alloc(5 * MIB, 0, None).unwrap();
        assert_eq!(a.segments(), 3);
    }

    #[test]
    fn native_split_rules_and_reuse() {
        let mut a = CachingSim::new(CachingMode::Native);
        // 12 MiB + 1.5 MiB → segment of 14 MiB; the rest (0.5 MiB) is ≤ 1 MiB: not split off.
        let p = a.alloc(12 * MIB + 3 * MIB / 2, 0, None).unwrap();
        let q = a.alloc(2 * MIB, 0, None).unwrap();
        assert_eq!(a.segments(), 2, "the unsplit rest is not lent out");
        a.free(p, 0, 0).unwrap();
        // Best fit: the 14 MiB block, not the 18 MiB rest of the 20 MiB segment.
        assert_eq!(a.alloc(13 * MIB, 0, None).unwrap(), p);
        a.free(q, 0, 0).unwrap();
        // The 20 MiB segment coalesced back into one block.
        assert_eq!(a.alloc(20 * MIB - 512, 0, None).unwrap(), q);
        assert_eq!(a.segments(), 2);
        assert_eq!(a.peak_reserved(), 14 * MIB + 20 * MIB);
    }

    #[test]
    fn streams_do_not_share() {
        let mut a = CachingSim::new(CachingMode::Native);
        let p = a.alloc(4096, 1, None).unwrap();
        a.free(p, 4096, 1).unwrap();
        a.alloc(4096, 2, None).unwrap();
        assert_eq!(a.segments(), 2);
        assert_eq!(a.alloc(4096, 1, None).unwrap(), p);
    }

    #[test]
    fn expandable_maps_pages_at_the_end() {
        let mut a = CachingSim::new(CachingMode::Expandable);
        let p = a.alloc(3 * MIB, 0, None).unwrap();
        assert_eq!(a.reserved(), LARGE_BUFFER);
        // Fits in the mapped rest of the first page.
        let q = a.alloc(17 * MIB, 0, None).unwrap();
        assert_eq!(q, p + 3 * MIB);
        assert_eq!(a.reserved(), LARGE_BUFFER);
        // No room: one more 20 MiB page, the block starting at the old end.
        let r = a.alloc(2 * MIB, 0, None).unwrap();
        assert_eq!(r, p + 20 * MIB);
        assert_eq!(a.reserved(), 2 * LARGE_BUFFER);
        // The free tail (18 MiB) is extended rather than skipped: 30 MiB needs one more page.
        let s = a.alloc(30 * MIB, 0, None).unwrap();
        assert_eq!(s, r + 2 * MIB);
        assert_eq!(a.reserved(), 3 * LARGE_BUFFER);
        // Small requests have their own segment with 2 MiB pages.
        a.alloc(512, 0, None).unwrap();
        assert_eq!(a.reserved(), 3 * LARGE_BUFFER + SMALL_BUFFER);
        assert_eq!(a.segments(), 2);
    }

    #[test]
    fn expandable_best_fit_keeps_the_growable_tail() {
        let mut a = CachingSim::new(CachingMode::Expandable);
        let p = a.alloc(10 * MIB, 0, None).unwrap();
        let q = a.alloc(3 * MIB / 2, 0, None).unwrap();
        a.free(p, 0, 0).unwrap();
        // Free: the 10 MiB hole at p and the 8.5 MiB tail at q + 1.5 MiB. Plain best fit would take
        // the tail; PyTorch counts the tail as what it can grow to and takes the hole.
        assert_eq!(a.alloc(8 * MIB, 0, None).unwrap(), p);
        // Now the tail is the only block that fits: it is used, no page is mapped.
        assert_eq!(a.alloc(8 * MIB, 0, None).unwrap(), q + 3 * MIB / 2);
        assert_eq!(a.reserved(), LARGE_BUFFER);
        // Native segments have no tail: plain best fit.
        let mut n = CachingSim::new(CachingMode::Native);
        let p = n.alloc(10 * MIB, 0, None).unwrap();
        let big = n.alloc(12 * MIB, 0, None).unwrap();
        n.free(p, 0, 0).unwrap();
        n.free(big, 0, 0).unwrap();
        assert_eq!(n.alloc(9 * MIB, 0, None).unwrap(), p);
    }

    #[test]
    fn roundup_power2_divisions() {
        let k = Knobs {
            max_split_size_mb: None,
            roundup_power2_divisions: 4,
        };
        assert_eq!(k.round_size(1), 512);
        assert_eq!(k.round_size(2000), 2048, "≤ 512·4: plain 512 rounding");
        assert_eq!(k.round_size(1200 * MIB), 1280 * MIB);
        assert_eq!(k.round_size(1024 * MIB), 1024 * MIB, "powers of two stay");
        assert_eq!(k.round_size(1025 * MIB), 1280 * MIB);
        assert_eq!(k.round_size(5000), 5120, "4096..8192 in steps of 1024");
        assert_eq!(Knobs::default().round_size(5000), 5120);
        assert_eq!(
            Knobs::default().round_size(1200 * MIB + 1),
            1200 * MIB + 512
        );
        let mut a = CachingSim::with_knobs(CachingMode::Native, k);
        a.alloc(1200 * MIB, 0, None).unwrap();
        assert_eq!(a.reserved(), 1280 * MIB);
    }

    #[test]
    fn max_split_size_keeps_oversize_blocks_whole() {
        let k = Knobs {
            max_split_size_mb: Some(64),
            roundup_power2_divisions: 0,
        };
        let mut a = CachingSim::with_knobs(CachingMode::Native, k);
        let big = a.alloc(100 * MIB, 0, None).unwrap();
        a.free(big, 0, 0).unwrap();
        // A small request does not take the oversize block: a new 20 MiB segment.
        a.alloc(4 * MIB, 0, None).unwrap();
        assert_eq!(a.segments(), 2);
        // An oversize request within 20 MiB of it takes it whole (no split).
        let p = a.alloc(90 * MIB, 0, None).unwrap();
        assert_eq!(p, big);
        a.free(p, 0, 0).unwrap();
        // Too small a fit (≥ 20 MiB over): a new segment.
        a.alloc(70 * MIB, 0, None).unwrap();
        assert_eq!(a.segments(), 3);
        assert_eq!(a.reserved(), 100 * MIB + 20 * MIB + 70 * MIB);
        // Without the knob, the 100 MiB block would have been split for the 4 MiB request.
        let mut d = CachingSim::new(CachingMode::Native);
        let big = d.alloc(100 * MIB, 0, None).unwrap();
        d.free(big, 0, 0).unwrap();
        assert_eq!(d.alloc(4 * MIB, 0, None).unwrap(), big);
        assert_eq!(d.segments(), 1);
    }

    #[test]
    fn knobs_are_validated() {
        assert!(Knobs::default().validate().is_ok());
        let bad = Knobs {
            max_split_size_mb: Some(20),
            roundup_power2_divisions: 0,
        };
        assert!(bad.validate().unwrap_err().contains("> 20"));
        let bad = Knobs {
            max_split_size_mb: None,
            roundup_power2_divisions: 3,
        };
        assert!(bad.validate().unwrap_err().contains("power of two"));
    }

    #[test]
    fn bad_input_is_an_error() {
        for mode in [CachingMode::Native, CachingMode::Expandable] {
            let mut a = CachingSim::new(mode);
            assert!(matches!(
                a.alloc(0, 0, None),
                Err(ReplayError::InvalidRequest { .. })
            ));
            assert!(matches!(
                a.alloc(u64::MAX, 0, None),
                Err(ReplayError::InvalidRequest { .. })
            ));
            let p = a.alloc(512, 0, None).unwrap();
            a.free(p, 512, 0).unwrap();
            assert_eq!(a.free(p, 512, 0), Err(ReplayError::InvalidFree { ptr: p }));
            assert_eq!(
                a.free(p + 512, 512, 0),
                Err(ReplayError::InvalidFree { ptr: p + 512 })
            );
        }
    }
}
