//! The pure offset allocator: best-fit with coalescing over `[0, len)`, no device involved.
//!
//! Free extents are maximal (two free extents never touch: free coalesces with both neighbours). They sit
//! in segregated size bins — exact for the smallest sizes, then eight bins per power of two, as in TLSF —
//! with a bitmap of the non-empty bins, so the best fit (the smallest extent that holds the request, the
//! lowest-addressed among equals) is a scan of the request's own bin and, when nothing there fits, of the
//! next non-empty one: anything in a higher bin is larger than anything in a lower one. Boundary tags in
//! one open-addressing table ([`Tags`](crate::tags)) map each block's start (live or free) to its size and
//! each free extent's end to its start, so free finds both neighbours in one lookup each.
//!
//! The policy is exactly the earlier `BTreeSet<(size, offset)>` + `BTreeMap` core's (the tests check the
//! choice against a model of the free extents); the layout is what changed. Inside PyTorch every line the
//! allocator touches is a likely miss (kernel launches and the interpreter run between two calls): the
//! B-trees touched ~15 lines per allocation or free of a large block on ResNet-50's trace (cachegrind with
//! a cold cache, `genpool/examples/coldops.rs`), the bins and tags a handful.

use std::collections::BTreeSet;

use gen_vmm::Stamp;

use crate::pieces::{Pieces, StampTable};
use crate::tags::Tags;

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

/// Size bins: sizes of 1-7 units of 512 B exactly, then 8 bins per power of two.
const NBINS: usize = 512;
const SUB_BITS: u32 = 3;

/// The bin of an extent of `units` × 512 B (`units` ≥ 1).
#[inline]
fn bin_of(units: u64) -> usize {
    if units < (1 << SUB_BITS) {
        units as usize
    } else {
        let fl = 63 - units.leading_zeros();
        let sl = (units >> (fl - SUB_BITS)) as usize & ((1 << SUB_BITS) - 1);
        (1 << SUB_BITS) + ((fl - SUB_BITS) as usize) * (1 << SUB_BITS) + sl
    }
}

/// Tag keys: a block's start (offset | `START`) and a free extent's end (offset | `END`). Offsets are
/// multiples of 512, so the kind lives in the low bits and no key is 0.
const START: u64 = 2;
const END: u64 = 1;
/// A free extent's start tag value: size << 1 with this bit set.
const FREE: u64 = 1;
/// A live block's start tag value: `HAS_BIRTH | units << 2 | birth << BIRTH_SHIFT` — its size in 512-B
/// units (< 2^38, i.e. under 128 TiB) and the low [`BIRTH_BITS`] bits of the core's allocation clock
/// when it was made — or, for a larger block, `units << 2` alone. The birth rides in a line every
/// allocation and free touches anyway, so the block's age costs no lookup of its own.
const HAS_BIRTH: u64 = 2;
const BIRTH_SHIFT: u32 = 40;
/// Bits of a block's birth: ages are exact up to 2^24 − 1 allocations and wrap beyond.
pub const BIRTH_BITS: u32 = 24;
const BIRTH_MASK: u64 = (1 << BIRTH_BITS) - 1;
const UNITS_MASK: u64 = (1 << (BIRTH_SHIFT - 2)) - 1;

/// The size of the live block whose start tag value is `v`.
#[inline]
fn live_size(v: u64) -> u64 {
    let units = if v & HAS_BIRTH != 0 {
        (v >> 2) & UNITS_MASK
    } else {
        v >> 2
    };
    units * MIN_BLOCK
}

/// A bin holding more free extents than this becomes ordered (a `BTreeSet`), and flat again below
/// [`FLAT_AT`]: a flat bin is one or two cache lines to scan in the common case (a few extents per bin),
/// an ordered one keeps a pathological bin (thousands of equal holes) at O(log n) per operation. Tests
/// switch often, so that both forms and the switches run.
const TREE_AT: usize = if cfg!(test) { 4 } else { 64 };
const FLAT_AT: usize = if cfg!(test) { 2 } else { 16 };

/// The free extents of one size bin, as `(size, offset)`.
#[derive(Debug, Clone)]
enum Bin {
    Flat(Vec<(u64, u64)>),
    Tree(BTreeSet<(u64, u64)>),
}

impl Bin {
    fn len(&self) -> usize {
        match self {
            Bin::Flat(v) => v.len(),
            Bin::Tree(t) => t.len(),
        }
    }

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn iter(&self) -> Box<dyn Iterator<Item = &(u64, u64)> + '_> {
        match self {
            Bin::Flat(v) => Box::new(v.iter()),
            Bin::Tree(t) => Box::new(t.iter()),
        }
    }

    fn push(&mut self, e: (u64, u64)) {
        match self {
            Bin::Flat(v) if v.len() < TREE_AT => v.push(e),
            Bin::Flat(v) => {
                let mut t: BTreeSet<(u64, u64)> = v.drain(..).collect();
                t.insert(e);
                *self = Bin::Tree(t);
            }
            Bin::Tree(t) => {
                t.insert(e);
            }
        }
    }

    /// Remove `e` (which must be present).
    fn remove(&mut self, e: (u64, u64)) {
        match self {
            Bin::Flat(v) => {
                let i = v
                    .iter()
                    .position(|&x| x == e)
                    .expect("a tagged free extent is in its bin");
                v.swap_remove(i);
            }
            Bin::Tree(t) => {
                let had = t.remove(&e);
                debug_assert!(had, "a tagged free extent is in its bin");
                if t.len() < FLAT_AT {
                    *self = Bin::Flat(std::mem::take(t).into_iter().collect());
                }
            }
        }
    }

    /// The smallest `(size, offset)` with size ≥ `size`.
    #[inline]
    fn min_fit(&self, size: u64) -> Option<(u64, u64)> {
        match self {
            Bin::Flat(v) => {
                let mut best = None;
                for &e in v {
                    if e.0 >= size && best.is_none_or(|b| e < b) {
                        best = Some(e);
                    }
                }
                best
            }
            Bin::Tree(t) => t.range((size, 0)..).next().copied(),
        }
    }

    fn max_size(&self) -> u64 {
        self.iter().map(|&(s, _)| s).max().unwrap_or(0)
    }
}

/// A best-fit coalescing allocator of offsets in `[0, len)`. Not thread-safe by itself (the arena wraps
/// it in a mutex).
#[derive(Debug)]
pub struct ExtentCore {
    /// The range's end (exclusive).
    len: u64,
    /// The range's start: nothing below it is this core's ([`new_range`](Self::new_range)).
    start: u64,
    /// Free extents as `(size, offset)`, by size bin, unordered inside a bin.
    bins: Vec<Bin>,
    /// Non-empty bins.
    nonempty: [u64; NBINS / 64],
    tags: Tags,
    free_count: usize,
    live_count: usize,
    live_bytes: u64,
    /// With [`keep_stamps`](Self::keep_stamps): each free extent's stamps, piece by piece ([`Pieces`],
    /// keyed by the extent's start; none kept for an extent no stamped free touched).
    stamps: Option<StampTable>,
    /// The end of the highest block ever allocated: nothing past it was ever used.
    high: u64,
    /// Lowest-address first fit instead of best fit (a linear scan: for experiments).
    pub first_fit: bool,
    /// Allocations so far (the clock a live block's birth is read on).
    clock: u64,
}

impl ExtentCore {
    /// A core over `[0, len)` with `len` rounded down to a multiple of 512 B; wholly free.
    pub fn new(len: u64) -> Self {
        Self::new_range(0, len)
    }

    /// A core over `[start, end)` — offsets keep their meaning in the whole range, so two cores can
    /// split one region between them (the extent arena's young and old generations) — with `start`
    /// rounded up and `end` down to multiples of 512 B; wholly free (empty when `start` ≥ `end`).
    pub fn new_range(start: u64, end: u64) -> Self {
        // The last 512 B of the address space stay out, so that an end tag (offset | 1) cannot wrap.
        let len = end.min(u64::MAX - MIN_BLOCK) & !(MIN_BLOCK - 1);
        let start = start.min(len).next_multiple_of(MIN_BLOCK).min(len);
        let mut core = ExtentCore {
            len,
            start,
            bins: vec![Bin::Flat(Vec::new()); NBINS],
            nonempty: [0; NBINS / 64],
            tags: Tags::new(),
            free_count: 0,
            live_count: 0,
            live_bytes: 0,
            stamps: None,
            high: start,
            first_fit: std::env::var_os("GENPOOL_FIRST_FIT").is_some(),
            clock: 0,
        };
        if len > start {
            core.insert_free(start, len - start);
        }
        core
    }

    /// Keep [`Stamp`]s on the free extents from now on (a range several streams allocate from, ordered
    /// lazily: see [`gen_vmm::Handoff::before_use`]): a free's stamp stays on the bytes it freed, as a
    /// piece of the extent they join (up to four pieces an extent, the closest neighbours merged past
    /// that: `pieces.rs`); an allocation returns the stamp of the pieces its block overlaps, and what is
    /// left of the extent keeps its own pieces. Extents freed before carry [`Stamp::NONE`].
    pub fn keep_stamps(&mut self) {
        if self.stamps.is_none() {
            self.stamps = Some(StampTable::new());
        }
    }

    /// Allocations so far: the clock live blocks' births and ages are read on.
    pub fn clock(&self) -> u64 {
        self.clock
    }

    /// Set the clock (cores that split one arena run on the arena's one clock).
    pub fn set_clock(&mut self, clock: u64) {
        self.clock = clock;
    }

    /// A live block's start tag value for `size` (a multiple of 512), born now; advances the clock.
    #[inline]
    fn live_tag(&mut self, size: u64) -> u64 {
        self.clock += 1;
        let units = size / MIN_BLOCK;
        if units <= UNITS_MASK {
            HAS_BIRTH | units << 2 | (self.clock & BIRTH_MASK) << BIRTH_SHIFT
        } else {
            units << 2
        }
    }

    /// The age of the live block whose start tag value is `v`, in this core's allocations since it was
    /// made (modulo 2^[`BIRTH_BITS`]); `None` for a block too large to carry its birth.
    #[inline]
    fn age_of(&self, v: u64) -> Option<u64> {
        (v & HAS_BIRTH != 0).then(|| self.clock.wrapping_sub(v >> BIRTH_SHIFT) & BIRTH_MASK)
    }

    /// The stamps of the free extent at `off`, taken out (one unstamped piece where none are kept).
    #[inline]
    fn take_stamps(&mut self, off: u64) -> Pieces {
        match &mut self.stamps {
            Some(t) => t.take(off, off | START),
            None => Pieces::one(off, Stamp::NONE),
        }
    }

    /// Keep `pieces` as the stamps of the free extent they start.
    #[inline]
    fn put_stamps(&mut self, pieces: Pieces) {
        if let Some(t) = &mut self.stamps {
            t.put(pieces, pieces.start() | START);
        }
    }

    /// Allocate `size` bytes (rounded up to 512 B) in address space no block ever used — past the
    /// highest block so far — with [`Stamp::NONE`] whatever stamp the free extent there carries (no free
    /// can have touched those bytes). `None` when the range's end is too close.
    pub fn alloc_unused(&mut self, size: u64) -> Option<(u64, Stamp)> {
        let high = self.high;
        self.alloc_at_stamped(high, size)
            .map(|(off, _)| (off, Stamp::NONE))
    }

    /// The stamp of the free extent holding `[offset, offset + size)` ([`Stamp::NONE`] when no stamps
    /// are kept or no free extent holds it). Cheap for a placement at either end of a free extent (as
    /// [`candidates`](Self::candidates) returns).
    pub fn free_stamp(&self, offset: u64, size: u64) -> Stamp {
        let Some(stamps) = &self.stamps else {
            return Stamp::NONE;
        };
        match self.free_extent_holding(offset, offset.saturating_add(size)) {
            Some((start, _)) => stamps.over(start | START, offset, offset.saturating_add(size)),
            None => Stamp::NONE,
        }
    }

    /// The end of the managed range in bytes (its length for a core made by [`new`](Self::new)).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True when no block is live.
    pub fn is_empty(&self) -> bool {
        self.live_count == 0
    }

    /// Bytes in live blocks (each rounded up to 512 B).
    pub fn live_bytes(&self) -> u64 {
        self.live_bytes
    }

    /// Number of live blocks.
    pub fn live_blocks(&self) -> usize {
        self.live_count
    }

    /// Number of free extents.
    pub fn free_extents(&self) -> usize {
        self.free_count
    }

    /// Size of the largest free extent (0 when full).
    pub fn largest_free(&self) -> u64 {
        (0..NBINS / 64)
            .rev()
            .find(|&w| self.nonempty[w] != 0)
            .map_or(0, |w| {
                let b = w * 64 + 63 - self.nonempty[w].leading_zeros() as usize;
                self.bins[b].max_size()
            })
    }

    /// The first non-empty bin at or after `from`.
    #[inline]
    fn next_bin(&self, from: usize) -> Option<usize> {
        let mut w = from / 64;
        if w >= NBINS / 64 {
            return None;
        }
        let mut bits = self.nonempty[w] & (!0u64 << (from % 64));
        loop {
            if bits != 0 {
                return Some(w * 64 + bits.trailing_zeros() as usize);
            }
            w += 1;
            if w == NBINS / 64 {
                return None;
            }
            bits = self.nonempty[w];
        }
    }

    /// The best fit for `size` (rounded): (bin, `(size, offset)`).
    #[inline]
    fn best(&self, size: u64) -> Option<(usize, (u64, u64))> {
        let b = bin_of(size / MIN_BLOCK);
        if let Some(e) = self.bins[b].min_fit(size) {
            return Some((b, e));
        }
        let nb = self.next_bin(b + 1)?;
        self.bins[nb].min_fit(size).map(|e| (nb, e))
    }

    /// Allocate `size` bytes (rounded up to 512 B) best-fit; returns the offset, or `None` when no free
    /// extent is large enough (or `size` is 0).
    pub fn alloc(&mut self, size: u64) -> Option<u64> {
        self.alloc_stamped(size).map(|(off, _)| off)
    }

    /// [`alloc`](Self::alloc), with the stamp of the bytes the block was cut from (see
    /// [`keep_stamps`](Self::keep_stamps)).
    pub fn alloc_stamped(&mut self, size: u64) -> Option<(u64, Stamp)> {
        let size = round_size(size)?;
        let (ext_size, off) = if self.first_fit {
            let (_, o, s) = self
                .free_extents_unordered()
                .filter(|&&(s, _)| s >= size)
                .map(|&(s, o)| (o, o, s))
                .min()?;
            self.unbin(o, s);
            (s, o)
        } else {
            let (_, (s, o)) = self.best(size)?;
            self.unbin(o, s);
            (s, o)
        };
        self.free_count -= 1;
        let stamp = match &mut self.stamps {
            Some(t) => {
                let rest = (ext_size > size).then_some((off + size) | START);
                t.cut_front(off | START, off, off + size, rest)
            }
            None => Stamp::NONE,
        };
        // The start tag turns live in place; the remainder gets a start tag and takes over the end tag.
        let tag = self.live_tag(size);
        self.tags.insert(off | START, tag);
        if ext_size > size {
            let rest = off + size;
            self.tags
                .insert(rest | START, ((ext_size - size) << 1) | FREE);
            self.tags.insert((off + ext_size) | END, rest);
            self.bin(rest, ext_size - size);
            self.free_count += 1;
        } else {
            self.tags.remove((off + ext_size) | END);
        }
        self.live_count += 1;
        self.live_bytes += size;
        self.high = self.high.max(off + size);
        Some((off, stamp))
    }

    /// Where best fit puts `size` bytes (rounded up to 512 B): the start of the smallest free extent
    /// that fits, the lowest of equals — `candidates(size, 1)`'s first placement, with no list built.
    #[inline]
    pub fn best_fit(&self, size: u64) -> Option<u64> {
        let size = round_size(size)?;
        self.best(size).map(|(_, (_, off))| off)
    }

    /// Up to `k` placements for `size` bytes (rounded up to 512 B), best fit first: for each of the `k`
    /// smallest free extents that fit, the block at the extent's start and, when the extent is larger, at
    /// its end. Offsets only; nothing changes.
    pub fn candidates(&self, size: u64, k: usize) -> Vec<u64> {
        let Some(size) = round_size(size) else {
            return Vec::new();
        };
        let mut out = Vec::with_capacity(2 * k);
        let mut place = |(ext_size, off): (u64, u64)| {
            out.push(off);
            if ext_size > size {
                out.push(off + ext_size - size);
            }
        };
        // Bins in size order; within one, its fitting extents in `(size, offset)` order: a flat bin's
        // (at most `TREE_AT`) sorted on the stack, an ordered bin's read in order — no list of every
        // fitting extent built and sorted, no boxed iterator (this runs on the shared arena's
        // allocations whose best fit needs new pages).
        let mut need = k;
        let mut b = bin_of(size / MIN_BLOCK);
        while need > 0 {
            let Some(nb) = self.next_bin(b) else { break };
            match &self.bins[nb] {
                Bin::Flat(v) => {
                    let mut fits = [(0u64, 0u64); TREE_AT];
                    let mut n = 0;
                    for &e in v.iter().filter(|&&(s, _)| s >= size) {
                        fits[n] = e;
                        n += 1;
                    }
                    let fits = &mut fits[..n];
                    fits.sort_unstable();
                    for &e in fits.iter().take(need) {
                        place(e);
                    }
                    need -= n.min(need);
                }
                Bin::Tree(t) => {
                    for &e in t.range((size, 0)..).take(need) {
                        place(e);
                        need -= 1;
                    }
                }
            }
            b = nb + 1;
        }
        out
    }

    /// [`candidates`](Self::candidates), and, in each of those extents that keeps stamp pieces, the
    /// placements at the start and at the end of each piece that fit: where frees of several streams
    /// coalesced into one extent, the bytes one stream freed may lie between others', and neither end
    /// of the extent reaches them. For a placement that must owe some streams nothing (a stamp filter:
    /// busy freers passed over, a capture).
    pub fn candidates_by_piece(&self, size: u64, k: usize) -> Vec<u64> {
        let mut out = self.candidates(size, k);
        let (Some(stamps), Some(size)) = (&self.stamps, round_size(size)) else {
            return out;
        };
        for j in 0..out.len() {
            let start = out[j];
            let Some(v) = self.tags.get(start | START).filter(|v| v & FREE != 0) else {
                continue; // an extent's end placement
            };
            let end = start + (v >> 1);
            let Some(p) = stamps.get(start | START) else {
                continue;
            };
            // Piece boundaries inside the extent: a piece from each, and one up to each.
            for (at, _) in p.iter().skip(1) {
                for o in [Some(at), at.checked_sub(size)].into_iter().flatten() {
                    if o >= start && o + size <= end && !out.contains(&o) {
                        out.push(o);
                    }
                }
            }
        }
        out
    }

    /// The free extent holding `[offset, end)`, if one does.
    fn free_extent_holding(&self, offset: u64, end: u64) -> Option<(u64, u64)> {
        if let Some(v) = self.tags.get(offset | START) {
            return (v & FREE != 0 && offset + (v >> 1) >= end).then_some((offset, v >> 1));
        }
        if let Some(start) = self.tags.get(end | END) {
            return (start <= offset).then_some((start, end - start));
        }
        self.free_extents_unordered()
            .find(|&&(s, o)| o <= offset && end <= o + s)
            .map(|&(s, o)| (o, s))
    }

    /// Allocate `size` bytes (rounded up to 512 B) at `offset`, which must lie with the whole block inside
    /// one free extent (as [`candidates`](Self::candidates) returns). Returns `None`, changing nothing,
    /// otherwise.
    pub fn alloc_at(&mut self, offset: u64, size: u64) -> Option<u64> {
        self.alloc_at_stamped(offset, size).map(|(off, _)| off)
    }

    /// [`alloc_at`](Self::alloc_at), with the stamp of the bytes the block was cut from.
    pub fn alloc_at_stamped(&mut self, offset: u64, size: u64) -> Option<(u64, Stamp)> {
        let size = round_size(size)?;
        let end = offset.checked_add(size)?;
        if offset % MIN_BLOCK != 0 || offset < self.start || end > self.len {
            return None;
        }
        let (ext_off, ext_size) = self.free_extent_holding(offset, end)?;
        self.remove_free(ext_off, ext_size);
        let pieces = self.take_stamps(ext_off);
        let stamp = pieces.over(offset, end);
        if offset > ext_off {
            self.insert_free(ext_off, offset - ext_off);
            self.put_stamps(pieces.below(offset));
        }
        if ext_off + ext_size > end {
            self.insert_free(end, ext_off + ext_size - end);
            self.put_stamps(pieces.from(end));
        }
        let tag = self.live_tag(size);
        self.tags.insert(offset | START, tag);
        self.live_count += 1;
        self.live_bytes += size;
        self.high = self.high.max(end);
        Some((offset, stamp))
    }

    /// Size of the live block starting at `offset`, if any.
    pub fn block_size(&self, offset: u64) -> Option<u64> {
        self.live_tag_at(offset).map(live_size)
    }

    /// The start tag value of the live block at `offset`.
    #[inline]
    fn live_tag_at(&self, offset: u64) -> Option<u64> {
        if offset % MIN_BLOCK != 0 || offset < self.start || offset >= self.len {
            return None;
        }
        self.tags.get(offset | START).filter(|v| v & FREE == 0)
    }

    /// Free the live block starting at `offset` and coalesce it with free neighbours; returns its size,
    /// or `None` (with no effect) when no live block starts there.
    pub fn free(&mut self, offset: u64) -> Option<u64> {
        self.free_stamped(offset, Stamp::NONE)
    }

    /// [`free`](Self::free), leaving `stamp` on the freed bytes: a piece of the extent they join (see
    /// [`keep_stamps`](Self::keep_stamps)).
    pub fn free_stamped(&mut self, offset: u64, stamp: Stamp) -> Option<u64> {
        self.free_aged(offset, stamp).map(|(size, _)| size)
    }

    /// [`free_stamped`](Self::free_stamped), returning with the size the block's age: how many
    /// allocations this core made since the block's own, modulo 2^[`BIRTH_BITS`] (`None` for a block of
    /// 128 TiB or more, which carries no birth).
    pub fn free_aged(&mut self, offset: u64, stamp: Stamp) -> Option<(u64, Option<u64>)> {
        let tag = self.live_tag_at(offset)?;
        let (size, age) = (live_size(tag), self.age_of(tag));
        // Only a range that keeps stamps builds the freed extent's pieces.
        let mut pieces = self.stamps.is_some().then(|| Pieces::one(offset, stamp));
        self.live_count -= 1;
        self.live_bytes -= size;
        let (mut start, mut end) = (offset, offset + size);
        if let Some(p_off) = self.tags.remove(offset | END) {
            // The free extent before ends here: it absorbs the block (its start tag is rewritten below).
            self.unbin(p_off, offset - p_off);
            self.free_count -= 1;
            self.tags.remove(offset | START);
            start = p_off;
            if let Some(p) = &mut pieces {
                *p = self.take_stamps(p_off).join(p);
            }
        }
        if let Some(v) = self.tags.get(end | START).filter(|v| v & FREE != 0) {
            let n_size = v >> 1;
            self.unbin(end, n_size);
            self.free_count -= 1;
            self.tags.remove(end | START);
            if let Some(p) = &mut pieces {
                *p = p.join(&self.take_stamps(end));
            }
            end += n_size;
        }
        self.tags.insert(start | START, ((end - start) << 1) | FREE);
        self.tags.insert(end | END, start);
        self.bin(start, end - start);
        self.free_count += 1;
        if let Some(p) = pieces {
            self.put_stamps(p);
        }
        Some((size, age))
    }

    /// Put the free extent `(off, size)` in its bin.
    #[inline]
    fn bin(&mut self, off: u64, size: u64) {
        let b = bin_of(size / MIN_BLOCK);
        self.bins[b].push((size, off));
        self.nonempty[b / 64] |= 1 << (b % 64);
    }

    /// Take the free extent `(off, size)` out of its bin.
    fn unbin(&mut self, off: u64, size: u64) {
        let b = bin_of(size / MIN_BLOCK);
        let v = &mut self.bins[b];
        v.remove((size, off));
        if v.is_empty() {
            self.nonempty[b / 64] &= !(1 << (b % 64));
        }
    }

    fn insert_free(&mut self, off: u64, size: u64) {
        self.tags.insert(off | START, (size << 1) | FREE);
        self.tags.insert((off + size) | END, off);
        self.bin(off, size);
        self.free_count += 1;
    }

    fn remove_free(&mut self, off: u64, size: u64) {
        self.tags.remove(off | START);
        self.tags.remove((off + size) | END);
        self.unbin(off, size);
        self.free_count -= 1;
    }

    /// Every free extent as `(size, offset)`, bin by bin through the bitmap (empty bins are skipped).
    fn free_extents_unordered(&self) -> impl Iterator<Item = &(u64, u64)> + '_ {
        let mut next = self.next_bin(0);
        std::iter::from_fn(move || {
            let b = next?;
            next = self.next_bin(b + 1);
            Some(b)
        })
        .flat_map(|b| self.bins[b].iter())
    }

    /// The free extents as `(offset, length)`, sorted by offset.
    pub fn free_ranges(&self) -> Vec<(u64, u64)> {
        let mut v: Vec<(u64, u64)> = self
            .free_extents_unordered()
            .map(|&(s, o)| (o, s))
            .collect();
        v.sort_unstable();
        v
    }

    /// The live blocks as `(offset, length)`, sorted by offset.
    pub fn live_ranges(&self) -> Vec<(u64, u64)> {
        let mut v: Vec<(u64, u64)> = self
            .tags
            .iter()
            .filter(|&(k, v)| k & (MIN_BLOCK - 1) == START && v & FREE == 0)
            .map(|(k, v)| (k & !(MIN_BLOCK - 1), live_size(v)))
            .collect();
        v.sort_unstable();
        v
    }

    /// Check every structural invariant; returns the first violation. O(n log n): tests and debugging.
    pub fn check(&self) -> Result<(), String> {
        let frees = self.free_ranges();
        if frees.len() != self.free_count {
            return Err(format!(
                "{} extents in bins, count says {}",
                frees.len(),
                self.free_count
            ));
        }
        for (b, bin) in self.bins.iter().enumerate() {
            let bit = self.nonempty[b / 64] & (1 << (b % 64)) != 0;
            if bit == bin.is_empty() {
                return Err(format!(
                    "bin {b}: bitmap says non-empty {bit}, holds {}",
                    bin.len()
                ));
            }
            for &(s, o) in bin.iter() {
                if s == 0 || o % MIN_BLOCK != 0 || s % MIN_BLOCK != 0 {
                    return Err(format!("free extent ({o:#x}, {s:#x}) empty or misaligned"));
                }
                if bin_of(s / MIN_BLOCK) != b {
                    return Err(format!("free extent ({o:#x}, {s:#x}) in bin {b}"));
                }
                if self.tags.get(o | START) != Some((s << 1) | FREE) {
                    return Err(format!(
                        "free extent ({o:#x}, {s:#x}) without its start tag"
                    ));
                }
                if self.tags.get((o + s) | END) != Some(o) {
                    return Err(format!("free extent ({o:#x}, {s:#x}) without its end tag"));
                }
                if self
                    .tags
                    .get((o + s) | START)
                    .is_some_and(|v| v & FREE != 0)
                {
                    return Err(format!(
                        "free extents at {o:#x} and {:#x} not coalesced",
                        o + s
                    ));
                }
            }
        }
        let lives = self.live_ranges();
        if lives.len() != self.live_count {
            return Err(format!(
                "{} live tags, count says {}",
                lives.len(),
                self.live_count
            ));
        }
        if self.tags.len() != 2 * frees.len() + lives.len() {
            return Err(format!(
                "{} tags for {} free extents and {} live blocks",
                self.tags.len(),
                frees.len(),
                lives.len()
            ));
        }
        if lives.iter().map(|&(_, s)| s).sum::<u64>() != self.live_bytes {
            return Err("live byte count out of sync".into());
        }
        if let Some(stamps) = &self.stamps {
            for (key, p) in stamps.all()? {
                let off = key & !(MIN_BLOCK - 1);
                let Some(&(_, size)) = frees.iter().find(|&&(o, _)| o == off) else {
                    return Err(format!("stamps at {off:#x}, not a free extent's start"));
                };
                if p.is_none() {
                    return Err(format!("unstamped pieces kept at {off:#x}"));
                }
                p.check(off, off + size)
                    .map_err(|e| format!("stamps of the free extent at {off:#x}: {e}"))?;
            }
        }
        let mut all = frees;
        all.extend(lives);
        if self.start > 0 {
            all.push((0, self.start));
        }
        gen_vmm::check_tiling(all, self.len)?;
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

    /// Three streams' frees side by side coalesce into one extent: its ends are the first and the
    /// last stream's bytes, and only the placements by piece reach the middle one's.
    #[test]
    fn candidates_by_piece_reach_bytes_between_others() {
        let s: Vec<Stamp> = (1..=3)
            .map(|i| Stamp::from_bits((1 << (48 + i)) | i as u64))
            .collect();
        let mut c = ExtentCore::new(64 * U);
        c.keep_stamps();
        let blocks: Vec<u64> = (0..3).map(|_| c.alloc(4 * U).unwrap()).collect();
        let _keep = c.alloc(U).unwrap();
        for (&b, &st) in blocks.iter().zip(&s) {
            c.free_stamped(b, st).unwrap();
        }
        assert_eq!(
            c.free_ranges()[0],
            (0, 12 * U),
            "one extent of three pieces"
        );
        let ends = c.candidates(4 * U, 4);
        assert!(ends.iter().all(|&o| c.free_stamp(o, 4 * U) != s[1]));
        let by_piece = c.candidates_by_piece(4 * U, 4);
        assert_eq!(
            &by_piece[..ends.len()],
            &ends[..],
            "the ends first, in best-fit order"
        );
        assert!(by_piece.contains(&(4 * U)), "{by_piece:?}");
        assert_eq!(c.free_stamp(4 * U, 4 * U), s[1]);
        assert_eq!(c.alloc_at_stamped(4 * U, 4 * U), Some((4 * U, s[1])));
        c.check().unwrap();
        // Every placement offered lies inside a free extent.
        for o in c.candidates_by_piece(2 * U, 4) {
            assert!(c
                .free_ranges()
                .iter()
                .any(|&(a, n)| a <= o && o + 2 * U <= a + n));
        }
    }

    /// Stamps stay on the free extents, piece by piece: carried by what is left of a split extent, kept
    /// apart when extents coalesce (a block cut from a coalesced extent is ordered after the frees of
    /// its own bytes only), returned with the block cut from them; bytes past the highest block ever
    /// allocated carry none whatever the extent there says.
    #[test]
    fn stamps_follow_the_free_extents() {
        let (s1, s2) = (
            Stamp::from_bits((1 << 48) | 5),
            Stamp::from_bits((2 << 48) | 9),
        );
        let mut c = ExtentCore::new(64 * U);
        c.keep_stamps();
        let a = c.alloc(4 * U).unwrap();
        let b = c.alloc(4 * U).unwrap();
        let _keep = c.alloc(U).unwrap();
        assert_eq!(c.free_stamped(a, s1), Some(4 * U));
        assert_eq!(c.alloc_stamped(2 * U), Some((0, s1)), "cut from a's extent");
        assert_eq!(c.free_stamp(2 * U, 2 * U), s1, "the rest keeps the stamp");
        c.free_stamped(b, s2);
        let both = s1.merge(s2);
        assert_eq!(both.bits(), (3 << 48) | 9, "both freers, the later time");
        assert_eq!(c.free_stamp(2 * U, 6 * U), both, "coalesced, both pieces");
        assert_eq!(c.free_stamp(2 * U, 2 * U), s1, "coalesced, a's bytes");
        assert_eq!(c.free_stamp(4 * U, 4 * U), s2, "coalesced, b's bytes");
        assert_eq!(
            c.alloc_at_stamped(4 * U, U),
            Some((4 * U, s2)),
            "b's bytes only"
        );
        assert_eq!(c.free_stamp(2 * U, 2 * U), s1, "left piece");
        assert_eq!(c.free_stamp(5 * U, 3 * U), s2, "right piece");
        c.check().unwrap();
        // Best fit across two pieces: both stamps; what is left keeps the second's.
        c.free_stamped(4 * U, s1).unwrap();
        assert_eq!(c.free_stamp(2 * U, 3 * U), s1, "one piece again");
        assert_eq!(c.alloc_stamped(4 * U), Some((2 * U, both)));
        assert_eq!(c.free_stamp(6 * U, 2 * U), s2);
        c.check().unwrap();
        // A plain free joins stamped neighbours: their stamps stay on their bytes, none on its own.
        c.free(2 * U).unwrap();
        assert_eq!(c.free_stamp(2 * U, 4 * U), Stamp::NONE);
        assert_eq!(c.free_stamp(2 * U, 6 * U), s2);
        // Everything freed: one extent, stamped where stamped frees were; but past the highest block
        // nothing was ever used.
        c.free(0).unwrap();
        c.free_stamped(9 * U - U, s2).unwrap();
        assert_eq!(c.free_ranges(), vec![(0, 64 * U)]);
        assert_eq!(c.free_stamp(0, U), Stamp::NONE);
        assert_eq!(c.free_stamp(0, 64 * U), s2);
        assert_eq!(c.alloc_unused(2 * U), Some((9 * U, Stamp::NONE)));
        c.check().unwrap();
        // Without stamps kept, everything reads NONE.
        let mut plain = ExtentCore::new(8 * U);
        let p = plain.alloc(U).unwrap();
        plain.free_stamped(p, s1).unwrap();
        assert_eq!(plain.alloc_stamped(U), Some((0, Stamp::NONE)));
    }

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

    /// Random frees with random stamps, allocations best fit and at either end of a candidate extent:
    /// every block's stamp names each freer of each of its bytes since they were last allocated, no
    /// earlier than that free (the ordering is safe however pieces merge), and the core's invariants
    /// hold throughout. A model keeps each 512-byte unit's stamp.
    #[test]
    #[cfg_attr(
        miri,
        ignore = "~18 minutes under Miri for safe code (gen-extent has no unsafe); the pieces' own tests run there"
    )]
    fn piecewise_stamps_name_every_freer_of_a_blocks_bytes() {
        const UNITS: u64 = 256;
        let (mut named, mut exact) = (0u32, 0u32);
        for seed in 1..=20u64 {
            let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
            let mut c = ExtentCore::new(UNITS * U);
            c.keep_stamps();
            let mut unit = vec![Stamp::NONE; UNITS as usize];
            let mut live: Vec<(u64, u64)> = Vec::new();
            let mut seq = 0u64;
            let (mut merged_waits, mut exact_waits) = (0u32, 0u32);
            for _ in 0..400 {
                if live.is_empty() || rng.below(100) < 55 {
                    let size = (1 + rng.below(12)) * U;
                    let got = if rng.below(3) == 0 {
                        let cands = c.candidates(size, 4);
                        if cands.is_empty() {
                            None
                        } else {
                            let at = cands[rng.below(cands.len() as u64) as usize];
                            c.alloc_at_stamped(at, size)
                        }
                    } else {
                        c.alloc_stamped(size)
                    };
                    let Some((off, stamp)) = got else { continue };
                    let mut want = Stamp::NONE;
                    for u in off / U..(off + size) / U {
                        want = want.merge(unit[u as usize]);
                        unit[u as usize] = Stamp::NONE;
                    }
                    assert_eq!(
                        stamp.merge(want),
                        stamp,
                        "seed {seed}: {stamp:?} misses {want:?}"
                    );
                    merged_waits += stamp.differs_in(Stamp::NONE);
                    exact_waits += want.differs_in(Stamp::NONE);
                    live.push((off, size));
                } else {
                    let (off, size) = live.swap_remove(rng.below(live.len() as u64) as usize);
                    let stamp = if rng.below(4) == 0 {
                        Stamp::NONE
                    } else {
                        seq += 1;
                        Stamp::from_bits((1 << (48 + rng.below(16))) | seq)
                    };
                    assert_eq!(c.free_stamped(off, stamp), Some(size));
                    for u in off / U..(off + size) / U {
                        unit[u as usize] = stamp;
                    }
                }
                c.check().unwrap();
            }
            named += merged_waits;
            exact += exact_waits;
        }
        // Pieces merge past their limit, so a block may name more freers than its bytes had; with one
        // stamp an extent (the design before pieces) these programs name 4.6 times as many, with two
        // pieces 2.5 times, with four 1.5 times.
        assert!(
            named <= 2 * exact,
            "{named} freers named for {exact} that freed the bytes"
        );
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

    /// `best_fit` names the placement `candidates(size, 1)` lists first and `alloc` takes, over random
    /// layouts (flat bins and ordered ones alike).
    #[test]
    fn best_fit_is_the_first_candidate_and_what_alloc_takes() {
        let mut r = Rng(0x9e37_79b9_7f4a_7c15);
        let mut c = ExtentCore::new(4096 * U);
        let mut live = Vec::new();
        let rounds = if cfg!(miri) { 200 } else { 20_000 };
        for _ in 0..rounds {
            let size = (1 + r.below(64)) * U - r.below(2) * (U / 2);
            let first = c.candidates(size, 1).first().copied();
            assert_eq!(c.best_fit(size), first, "size {size}");
            if live.len() < 300 && r.below(3) != 0 {
                if let Some(off) = c.alloc(size) {
                    assert_eq!(Some(off), first);
                    live.push(off);
                }
            } else if !live.is_empty() {
                let i = r.below(live.len() as u64) as usize;
                c.free(live.swap_remove(i)).unwrap();
            }
        }
        assert_eq!(c.best_fit(0), None);
        c.check().unwrap();
    }

    /// `candidates` lists what listing every fitting extent of each bin, sorted, would (the form it
    /// replaced), for every `k`, over random layouts whose bins go flat and ordered (`TREE_AT` is 4 in
    /// tests).
    #[test]
    fn candidates_match_the_sorted_list_of_fitting_extents() {
        fn reference(c: &ExtentCore, size: u64, k: usize) -> Vec<u64> {
            let size = round_size(size).unwrap();
            let mut fits: Vec<(u64, u64)> = Vec::new();
            let mut b = bin_of(size / MIN_BLOCK);
            while fits.len() < k {
                let Some(nb) = c.next_bin(b) else { break };
                let at = fits.len();
                fits.extend(c.bins[nb].iter().filter(|&&(s, _)| s >= size));
                fits[at..].sort_unstable();
                b = nb + 1;
            }
            fits.truncate(k);
            let mut out = Vec::new();
            for (ext, off) in fits {
                out.push(off);
                if ext > size {
                    out.push(off + ext - size);
                }
            }
            out
        }
        let mut r = Rng(0x2545_f491_4f6c_dd1d);
        let mut c = ExtentCore::new(8192 * U);
        let mut live = Vec::new();
        let rounds = if cfg!(miri) { 100 } else { 10_000 };
        for _ in 0..rounds {
            let size = (1 + r.below(40)) * U;
            for k in [1, 2, 4, 9] {
                assert_eq!(
                    c.candidates(size, k),
                    reference(&c, size, k),
                    "k {k} size {size}"
                );
            }
            if live.len() < 400 && r.below(2) == 0 {
                if let Some(off) = c.alloc(size) {
                    live.push(off);
                }
            } else if !live.is_empty() {
                let i = r.below(live.len() as u64) as usize;
                c.free(live.swap_remove(i)).unwrap();
            }
        }
    }

    #[test]
    fn many_equal_holes_keep_best_fit_lowest_first() {
        // A thousand equal holes land in one bin (ordered past `TREE_AT`): best fit still takes the
        // lowest; filling them all and freeing them again coalesces back to one extent.
        let n = if cfg!(miri) { 40 } else { 1000 };
        let mut c = ExtentCore::new(2 * n * 3 * U + 8 * U);
        let blocks: Vec<u64> = (0..2 * n).map(|_| c.alloc(3 * U).unwrap()).collect();
        for &b in blocks.iter().step_by(2) {
            c.free(b).unwrap();
        }
        c.check().unwrap();
        assert_eq!(c.free_extents() as u64, n + 1);
        for (i, &b) in blocks.iter().step_by(2).enumerate() {
            assert_eq!(c.alloc(2 * U), Some(b), "hole {i}: the lowest equal hole");
        }
        c.check().unwrap();
        for &b in &blocks {
            c.free(b).unwrap();
        }
        for (i, &b) in blocks.iter().step_by(2).enumerate() {
            assert_eq!(c.free(b), None, "block {i} freed twice");
        }
        c.check().unwrap();
        assert_eq!(c.free_extents(), 1);
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
    fn a_blocks_age_is_the_allocations_since_its_own_and_wraps_at_birth_bits() {
        let mut c = ExtentCore::new(1 << 30);
        let a = c.alloc(512).unwrap();
        let b = c.alloc(1000).unwrap();
        c.alloc(512).unwrap();
        assert_eq!(c.free_aged(a, Stamp::NONE), Some((512, Some(2))));
        assert_eq!(c.free_aged(b, Stamp::NONE), Some((1024, Some(1))));
        assert_eq!(c.free_aged(b, Stamp::NONE), None, "already free");
        // A birth just below the wrap, aged across it.
        c.set_clock((1 << BIRTH_BITS) - 2);
        let w = c.alloc(4096).unwrap();
        for _ in 0..3 {
            c.alloc(512).unwrap();
        }
        assert_eq!(c.clock(), (1 << BIRTH_BITS) + 2);
        assert_eq!(c.block_size(w), Some(4096));
        assert_eq!(c.free_aged(w, Stamp::NONE), Some((4096, Some(3))));
        c.check().unwrap();
    }

    #[test]
    fn a_block_too_large_for_a_birth_keeps_its_size_and_has_no_age() {
        let mut c = ExtentCore::new(1 << 50);
        let huge = (UNITS_MASK + 1) * MIN_BLOCK;
        let h = c.alloc(huge).unwrap();
        let s = c.alloc(512).unwrap();
        assert_eq!(c.block_size(h), Some(huge));
        assert_eq!(c.live_ranges(), vec![(h, huge), (s, 512)]);
        c.check().unwrap();
        assert_eq!(c.free_aged(h, Stamp::NONE), Some((huge, None)));
        assert_eq!(c.free_aged(s, Stamp::NONE), Some((512, Some(0))));
        assert_eq!(c.free_ranges(), vec![(0, 1 << 50)]);
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
                let mut fits: Vec<(u64, u64)> = c
                    .free_ranges()
                    .into_iter()
                    .filter(|&(_, s)| s >= rounded)
                    .map(|(o, s)| (s, o))
                    .collect();
                fits.sort_unstable();
                let best = fits.first().map(|&(s, o)| (o, s));
                if i % 7 == 0 {
                    // The k best fits, both ends of each, best first; then a placement at one of them
                    // (or strictly inside an extent) through `alloc_at`.
                    let want: Vec<u64> = fits
                        .iter()
                        .take(3)
                        .flat_map(|&(s, o)| {
                            std::iter::once(o).chain((s > rounded).then_some(o + s - rounded))
                        })
                        .collect();
                    let cands = c.candidates(size, 3);
                    assert_eq!(cands, want, "candidates");
                    if let Some(&(s, o)) = fits.get(rng.below(fits.len().max(1) as u64) as usize) {
                        let inside = o + MIN_BLOCK * rng.below((s - rounded) / MIN_BLOCK + 1);
                        assert_eq!(c.alloc_at(inside, size), Some(inside), "alloc_at inside");
                        assert!(
                            live.iter()
                                .all(|&(lo, ls)| inside + rounded <= lo || lo + ls <= inside),
                            "overlap"
                        );
                        live.push((inside, rounded));
                        // Overlapping the block just placed: refused.
                        assert_eq!(c.alloc_at(inside, MIN_BLOCK), None);
                        continue;
                    }
                }
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
