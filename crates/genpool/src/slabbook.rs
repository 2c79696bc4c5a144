//! What the engine remembers of a slab block, kept per slot beside the slab instead of in the sharded
//! address map ([`crate::meta::MetaTable`]).
//!
//! A slab block's address gives its class and slot with a table read, a shift and a multiply
//! ([`gen_slab::Slab::slot_of`]), so its record needs no hash and no lock: one 16-byte entry, in a table
//! of [`TABLE_SLOTS`] slots made on first use (a power of two, so a slot's table and entry are a shift and
//! a mask — a table per slab chunk needed a division on every call). The thread that allocates a slot writes its entry and the thread
//! that frees it takes it, so with the slab's per-thread free lists a thread reuses its own slots and
//! touches lines no other thread writes; the address map's shard locks, which every thread's every call
//! took, were half of a slab free with two threads. The entries are atomics (never a data race); a free
//! on another thread sees the allocation's writes through whatever handed it the pointer, as with the
//! slab's own `live` flags.
//!
//! A table is kept for the pool's life once made: at most 16 bytes per slot the slab ever
//! carved (3 % of a 512-byte class's bytes, 0.4 % of a 4 KiB class's), host memory.
//!
//! Only blocks without a classifier stamp live here (lifetime routing off, the default); with
//! `experimental.routing:generational` slab blocks carry stamps and stay in the address map.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::OnceLock;

/// Slots per table of entries (16 KiB of entries).
const TABLE_SLOTS: u32 = 1 << TABLE_SHIFT;
const TABLE_SHIFT: u32 = 10;

use gen_classifier::Stamp;
use gen_slab::Slab;

use crate::meta::Meta;
use crate::Tier;

const LIVE: u64 = 1 << 63;

/// One slot's record: the stream and `LIVE | slack << 32 | size`. 16 bytes: four to a cache line (one
/// each measured no better with two threads, and four times the memory a warm pass walks).
#[derive(Default)]
struct Entry {
    stream: AtomicU64,
    word: AtomicU64,
}

struct ClassBook {
    /// Tables of [`TABLE_SLOTS`] entries, made on first use.
    chunks: Box<[OnceLock<Box<[Entry]>>]>,
}

/// Per-slot records of the slab's live blocks. See the [module docs](self).
pub(crate) struct SlabBook {
    classes: Box<[ClassBook]>,
}

impl SlabBook {
    pub(crate) fn new(slab: &Slab) -> Self {
        let classes = slab
            .slot_geometry()
            .into_iter()
            .map(|(slots, _)| ClassBook {
                chunks: (0..slots.div_ceil(TABLE_SLOTS))
                    .map(|_| OnceLock::new())
                    .collect(),
            })
            .collect();
        SlabBook { classes }
    }

    #[inline]
    fn entry(&self, ci: usize, slot: u32) -> Option<&Entry> {
        let c = self.classes.get(ci)?;
        let chunk = c.chunks.get((slot >> TABLE_SHIFT) as usize)?;
        chunk.get()?.get((slot & (TABLE_SLOTS - 1)) as usize)
    }

    #[inline]
    fn entry_or_make(&self, ci: usize, slot: u32) -> Option<&Entry> {
        let c = self.classes.get(ci)?;
        let chunk = c.chunks.get((slot >> TABLE_SHIFT) as usize)?;
        let entries = chunk.get_or_init(|| (0..TABLE_SLOTS).map(|_| Entry::default()).collect());
        entries.get((slot & (TABLE_SLOTS - 1)) as usize)
    }

    /// Record the block at `ptr` (a slot the slab just handed out). False when `ptr` is not a slot of
    /// `slab` (the caller then records it in the address map).
    #[inline]
    pub(crate) fn set(&self, slab: &Slab, ptr: u64, size: u64, slack: u16, stream: u64) -> bool {
        let Some(e) = slab
            .slot_of(ptr)
            .and_then(|(ci, slot)| self.entry_or_make(ci, slot))
        else {
            return false;
        };
        e.stream.store(stream, Relaxed);
        e.word.store(SlabWord::live(size, slack).0, Relaxed);
        true
    }

    /// Take the record of the live block at `ptr` (its free): `None` when there is none (not a slot, or
    /// not live here — the caller then asks the address map).
    #[inline]
    pub(crate) fn take(&self, slab: &Slab, ptr: u64) -> Option<Meta> {
        match self.take_raw(slab, ptr) {
            (0, ..) => None,
            (word, stream, _) => Some(meta(word, stream)),
        }
    }

    /// [`take`](Self::take) as the entry's two words and the block's size class — `(LIVE | slack << 32 |
    /// size, stream, class)`, or `(0, 0, 0)` when there is no record — kept in registers (inlined): the
    /// short-lived free path reads the size and stream from them instead of a [`Meta`] built on the stack
    /// (whose wide reloads of narrow stores stalled the free), and the class without locating the slot
    /// again. [`SlabWord`] reads the word.
    ///
    /// A swap, the arbiter of a double free racing itself: of two threads freeing the same block at
    /// once, one takes the record and the other finds none. (The slab's own `live` flag cannot decide
    /// it: a block kept in a thread's magazine, `mag.rs`, is never freed to the slab.)
    #[inline(always)]
    pub(crate) fn take_raw(&self, slab: &Slab, ptr: u64) -> (u64, u64, usize) {
        let Some((ci, e)) = slab
            .slot_of(ptr)
            .and_then(|(ci, slot)| Some((ci, self.entry(ci, slot)?)))
        else {
            return (0, 0, 0);
        };
        let w = e.word.swap(0, Relaxed);
        if w & LIVE == 0 {
            return (0, 0, 0);
        }
        (w, e.stream.load(Relaxed), ci)
    }

    /// The record of the live block at `ptr`, left in place.
    pub(crate) fn get(&self, slab: &Slab, ptr: u64) -> Option<Meta> {
        let (ci, slot) = slab.slot_of(ptr)?;
        let e = self.entry(ci, slot)?;
        let w = e.word.load(Relaxed);
        (w & LIVE != 0).then(|| meta(w, e.stream.load(Relaxed)))
    }

    /// Every live block recorded here.
    pub(crate) fn snapshot(&self, slab: &Slab) -> Vec<(u64, Meta)> {
        let mut v = Vec::new();
        for (ci, c) in self.classes.iter().enumerate() {
            for (k, chunk) in c.chunks.iter().enumerate() {
                let Some(entries) = chunk.get() else { continue };
                for (i, e) in entries.iter().enumerate() {
                    let w = e.word.load(Relaxed);
                    if w & LIVE != 0 {
                        let slot = k as u32 * TABLE_SLOTS + i as u32;
                        v.push((slab.slot_addr(ci, slot), meta(w, e.stream.load(Relaxed))));
                    }
                }
            }
        }
        v
    }
}

/// An entry's first word, `LIVE | slack << 32 | size` ([`SlabBook::set`], [`SlabBook::take_raw`]).
#[derive(Clone, Copy)]
pub(crate) struct SlabWord(pub(crate) u64);

impl SlabWord {
    /// The word of a live block of `size` bytes (< 4 GiB: a slab class), `slack` of them not asked for.
    #[inline]
    pub(crate) fn live(size: u64, slack: u16) -> Self {
        SlabWord(LIVE | u64::from(slack) << 32 | (size & 0xFFFF_FFFF))
    }

    /// Bytes the block spans.
    #[inline]
    pub(crate) fn size(self) -> u64 {
        self.0 & 0xFFFF_FFFF
    }

    /// Bytes of the span not asked for (the rounding).
    #[inline]
    pub(crate) fn slack(self) -> u16 {
        (self.0 >> 32) as u16
    }

    /// Bytes asked for.
    #[inline]
    pub(crate) fn requested(self) -> u64 {
        self.size() - u64::from(self.slack())
    }
}

/// The engine's record of a slab block from its entry's words.
pub(crate) fn meta(word: u64, stream: u64) -> Meta {
    let w = SlabWord(word);
    Meta {
        size: w.size(),
        tier: Tier::Slab,
        stamp: Stamp::NONE,
        ticket: gen_plan::Ticket::NONE,
        stream,
        slack: w.slack(),
        thread: crate::meta::NO_THREAD,
    }
}
