//! Short-lived tier: size classes over device chunks with lock-free free lists.
//!
//! A [`Slab`] serves blocks of 1 B ..= [`SlabConfig::max_size`] (4 KiB by default: above a few KiB the
//! extent arena packs tighter — genpool's measured default) from size classes (see
//! [`SizeClasses`] for the spacing and the waste bound: `class - size < max(512, size / 2^B)`, i.e. under
//! 25 % with the default 4 classes per doubling).
//!
//! # Chunks, shared pages
//! The slab's one [`gen_vmm::Region`] is cut into *chunks* of a power-of-two size `C` (64 KiB with the
//! default classes: see [`SlabConfig::chunk_bytes`]), which any class may take: a class that runs dry
//! takes the lowest free chunk, commits ([`gen_vmm::Region::commit`]) the bytes its slots cover (as many
//! whole slots as fit, back to back) and keeps it until [`Slab::reclaim`] finds every slot of it free
//! and decommits it (the chunk goes back to every class), so a burst does not pin memory.
//! With `C` below the page size the classes' chunks share physical pages (the page layer counts each
//! chunk's reference): a class holding `n` live bytes pins at most `n` plus one chunk, and the slab as a
//! whole about one page beyond its live bytes — until session 24 every class had a span of its own and
//! pinned at least one page (2 MiB) of its own, 3–8 MiB over the ten traces' peaks with no more than
//! 1.7 MiB of small blocks live.
//!
//! A slot is found with shifts, a table read and a multiplication, no search: a chunk's owner table
//! entry (class and the class's chunk number) is read from the address's chunk index (`offset >> log2 C`);
//! the slot within the chunk is the offset within the chunk divided by the class size (an exact
//! multiply-shift). A class numbers its slots `k << s | j` (chunk `k` of the class, slot `j` of the
//! chunk, `2^s` the chunk's slots rounded up to a power of two), so its free lists and per-slot flags
//! stay the class's own and the address of slot `k << s | j` is the base of the chunk the class's
//! chunk `k` sits in (a per-class table) plus `j` times the class size.
//!
//! # Free lists and streams
//! Free slots live in lock-free index free lists ([`gen_freelist::FrontCache`]: a Treiber stack with one
//! small stack per thread shard in front). Each class has one list per *stream slot* (a fixed table of
//! [`STREAM_SLOTS`] streams, registered on first sight) plus an *idle* list of slots that are safe on
//! every stream. The stream rules (PyTorch's):
//!
//! - a block freed on stream `S` goes to `S`'s list and is reused at once by allocations on `S` (stream
//!   order makes that safe);
//! - an allocation on `T` whose own list and the idle list are empty *migrates* a batch (up to
//!   [`MIGRATE_BATCH`] slots) from another stream's list: one event is recorded on `S` and the batch waits
//!   in a *pending* list until `event_query` says the event completed, then joins the idle list. Only when
//!   the class would otherwise need new physical pages (memory pressure) does it `event_synchronize`;
//! - while only one stream has ever been seen no event is ever recorded; when a second stream appears,
//!   one `synchronize` makes every earlier free safe and moves those slots to the idle list;
//! - frees on streams beyond the table ([`STREAM_SLOTS`] distinct streams; PyTorch's stream pool hands
//!   out 32 a priority) take a slower path under the class's mutex: the slot waits on a list of its
//!   stream's own, where allocations on that stream take it back at once (stream order), and every
//!   [`MIGRATE_BATCH`] such frees one event is recorded and the batch goes to the pending list (until
//!   session 18: an event for every free).
//!
//! The hot path (`alloc` hitting its stream's list or the idle list; every `free` on a known stream) is
//! lock-free and allocation-free: a size-class computation, a scan of the stream table, one pop or push, and
//! one byte store/swap on the slot's state (which is how double and foreign frees are detected).
//! Everything else (committing a chunk, migrations, reclaim) takes the class's mutex.
//!
//! # Reclaim
//! [`Slab::reclaim`] takes every free list of a class (stream lists, idle list, pending batches), counts the
//! free slots per chunk and decommits chunks all of whose slots it holds. If such a chunk holds a slot that
//! is not yet safe (freed on a stream, or in a pending batch) it first synchronizes the device once; every
//! slot it did not decommit goes back (after a synchronize: all to the idle list). An owner that knows one
//! stream is all that uses the slab ([`Slab::set_one_stream`]: the engine, until its second stream) lets
//! reclaim decommit stream slots without that synchronize: their reuse is stream-ordered, and the page
//! layer moves a decommitted page only through its fences.
//!
//! # Captures
//! While a CUDA graph capture is underway on the device ([`gen_device::Device::captures`]) the slab
//! makes no call a capture forbids: no event is queried or waited for (pending batches wait), no batch
//! migrates (its event could land on the capturing stream), the second stream's synchronize waits
//! (earlier frees stay on the first stream's lists: correct, only slower), reclaim gives nothing back,
//! and a free on a stream beyond the table stays on its stream's own list with no event until the
//! capture is over. Carving new chunks is allowed.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod class;

use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, AtomicUsize};
use std::sync::{Arc, OnceLock};

use gen_device::{Device, EventHandle, StreamId};
use gen_freelist::FrontCache;
use gen_vmm::{PagePool, Region, VmmError};
use parking_lot::Mutex;

use crate::class::Divisor;
pub use crate::class::{SizeClasses, MIN_CLASS};

/// Distinct streams with their own free lists; further streams take the slow overflow path.
pub const STREAM_SLOTS: usize = 8;
/// Most slots moved from one stream to another under one event.
pub const MIGRATE_BATCH: usize = 32;
/// Index of the idle list in a class's list table.
const IDLE: usize = STREAM_SLOTS;

/// Configuration of a [`Slab`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlabConfig {
    /// Largest request served (bytes); the largest class is this rounded up to a class size.
    pub max_size: u64,
    /// Classes per power of two: 1, 2, 4, 8 or 16. The waste bound is `max(512 B, size / this)`.
    pub classes_per_doubling: u32,
    /// Virtual bytes per class: a power of two, at least a page and at least the largest class, at most
    /// 4 GiB. It bounds the live bytes of one class (with `max_slots_per_class`).
    pub class_span: u64,
    /// Most slots per class (host memory: about 5 bytes per slot per stream in use).
    pub max_slots_per_class: u32,
    /// Chunk size (bytes, a power of two at least the largest class and at most `class_span`): the unit a
    /// class takes from the slab's region and commits. 0 = [`SlabConfig::auto_chunk`] (64 KiB for the
    /// default classes: the classes share pages). Below the page size chunks of different classes share
    /// pages; at or above it every chunk has pages of its own (the layout before session 24).
    pub chunk_bytes: u64,
    /// Thread shards of each free list; 0 = the machine's available parallelism (at most 64).
    pub shards: usize,
    /// Most slots a shard caches in front of its list (1..=255).
    pub shard_capacity: usize,
}

impl SlabConfig {
    /// The chunk size `chunk_bytes: 0` stands for, with pages of `page` bytes: 16 times the largest class
    /// (rounded up to a power of two) — so that a chunk's unused tail stays under 1/16 of it — at least
    /// 64 KiB (fewer commits), at most a page (where classes share pages), and never below the largest
    /// class. The default classes (up to 4 KiB) get 64 KiB chunks, 32 to a 2 MiB page.
    pub fn auto_chunk(&self, page: u64) -> u64 {
        let top = self.max_size.max(1).next_power_of_two();
        top.max(page.min(top.saturating_mul(16).max(64 << 10)))
    }

    /// The default with classes up to 1 MiB (the slab's own tests and benchmarks exercise large classes).
    pub fn wide() -> Self {
        SlabConfig {
            max_size: 1 << 20,
            ..SlabConfig::default()
        }
    }
}

impl Default for SlabConfig {
    fn default() -> Self {
        SlabConfig {
            max_size: 4 << 10,
            classes_per_doubling: 4,
            class_span: 1 << 30,
            max_slots_per_class: 1 << 18,
            chunk_bytes: 0,
            shards: 0,
            shard_capacity: 63,
        }
    }
}

/// Everything that can go wrong in the slab: the page-mapped tiers' one error type.
pub use gen_vmm::TierError;

/// Counters of one size class.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClassStats {
    /// Class size in bytes.
    pub size: u64,
    /// Live blocks.
    pub live: u64,
    /// Free slots in committed chunks (on a list, pending, or in flight).
    pub free: u64,
    /// Chunks committed now.
    pub chunks: u64,
    /// Slots per chunk.
    pub slots_per_chunk: u64,
    /// Slots of the class (its capacity).
    pub capacity: u64,
}

/// A snapshot of a [`Slab`]'s counters (live counts are exact when no call runs concurrently).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SlabStats {
    /// One entry per class, ascending sizes.
    pub classes: Vec<ClassStats>,
    /// Live blocks over all classes.
    pub live_blocks: u64,
    /// Bytes of live blocks counted at their class size.
    pub live_bytes: u64,
    /// Free slots in committed chunks over all classes.
    pub free_blocks: u64,
    /// Chunks committed now.
    pub chunks_committed: u64,
    /// Bytes of physical pages the slab's chunks reference now (whole pages; a page counts once however
    /// many classes' chunks share it).
    pub committed_bytes: u64,
    /// Highest `committed_bytes` so far.
    pub peak_committed_bytes: u64,
    /// Slots waiting in pending batches for an event.
    pub pending_blocks: u64,
    /// Streams registered in the stream table.
    pub streams: usize,
    /// Batches migrated from one stream to another (each one event record).
    pub migrations: u64,
    /// Frees on streams beyond the table (each one event record).
    pub overflow_frees: u64,
    /// Device synchronizations made by the slab (second stream, reclaim).
    pub synchronizes: u64,
    /// Bytes of pages released by [`Slab::reclaim`] so far.
    pub reclaimed_bytes: u64,
}

/// Slots taken off a stream's list, waiting for the event recorded on that stream after them.
struct Pending {
    event: EventHandle,
    slots: Vec<u32>,
}

/// The slow-path state of a class, under its mutex.
struct ClassSlow {
    /// The class's chunk numbers ever used (numbers `carved..` never were).
    carved: u32,
    /// Whether each used chunk number holds a committed chunk now.
    committed: Vec<bool>,
    /// Chunk numbers whose chunk reclaim decommitted, reused (lowest first) before new numbers.
    released: Vec<u32>,
    /// Migrated batches waiting for their event.
    pending: Vec<Pending>,
    /// Slots freed on streams beyond the stream table, per stream: reused by that stream at once, and
    /// moved to `pending` under one event once [`MIGRATE_BATCH`] have gathered (or by a reclaim, or
    /// under memory pressure). Streams are few (PyTorch's pools: 32 a priority); a linear search.
    overflow: Vec<(StreamId, Vec<u32>)>,
    /// Scratch for `push_chain`.
    scratch: Vec<u32>,
}

/// `repr(C)`: the scalars every allocation and free reads come first, in one cache line (Rust's own order put
/// the 128-byte-aligned lists first and these ~4.6 KB in, on two lines).
#[repr(C)]
struct Class {
    size: u64,
    div: Divisor,
    /// Per chunk number of the class, the region chunk it sits in (valid while committed).
    chunk_at: Box<[AtomicU32]>,
    /// 1 while the slot is live (handed out and not freed); indexed by slot number `k << s | j`.
    live: Box<[AtomicU8]>,
    slots_per_chunk: u32,
    /// `s`: slot numbers of chunk `k` are `k << s ..= k << s | (slots_per_chunk - 1)`.
    slot_shift: u32,
    /// Chunk numbers of the class (`chunks << slot_shift` slot numbers).
    chunks: u32,
    /// Bytes of a chunk the class's slots cover (`slots_per_chunk * size`).
    chunk_len: u64,
    /// Lists `0..STREAM_SLOTS` per stream slot, `IDLE` the idle list; built on first use.
    lists: [OnceLock<FrontCache>; STREAM_SLOTS + 1],
    slow: Mutex<ClassSlow>,
    /// The class's index in the slab's class table (what its chunks' owner entries name).
    index: u32,
}

impl ClassSlow {
    /// The index of `stream`'s overflow list, made empty when it has none.
    fn overflow_of(&mut self, stream: StreamId) -> usize {
        match self.overflow.iter().position(|(s, _)| *s == stream) {
            Some(i) => i,
            None => {
                self.overflow.push((stream, Vec::new()));
                self.overflow.len() - 1
            }
        }
    }
}

impl Class {
    /// The live flags of chunk number `k`'s slots.
    #[inline]
    fn chunk_live(&self, k: usize) -> &[AtomicU8] {
        let first = k << self.slot_shift;
        &self.live[first..first + self.slots_per_chunk as usize]
    }

    /// The chunk number of slot `slot`.
    #[inline]
    fn chunk_of(&self, slot: u32) -> usize {
        (slot >> self.slot_shift) as usize
    }
}

/// The stream table: stream ids of slots `0..count`, registered once, never removed.
struct StreamTable {
    ids: [AtomicU64; STREAM_SLOTS],
    count: AtomicUsize,
    reg: Mutex<()>,
}

impl StreamTable {
    #[inline]
    fn find(&self, stream: StreamId) -> Option<usize> {
        let n = self.count.load(Acquire);
        (0..n).find(|&i| self.ids[i].load(Relaxed) == stream)
    }
}

#[derive(Default)]
struct Counters {
    migrations: AtomicU64,
    overflow_frees: AtomicU64,
    synchronizes: AtomicU64,
    reclaimed: AtomicU64,
}

/// The short-lived small-block tier. `Send + Sync`; see the [crate docs](crate).
///
/// `repr(C)`: the class table, base and span geometry that every call reads share the first cache line.
#[repr(C)]
pub struct Slab {
    class: Box<[Class]>,
    base: u64,
    /// Bytes of the region (`owns` is a range check).
    len: u64,
    chunk_shift: u32,
    /// Per region chunk: 0 when no class holds it, else `chunk number << 32 | class index + 1`.
    owner: Box<[AtomicU64]>,
    page: u64,
    shards: usize,
    shard_capacity: usize,
    streams: StreamTable,
    sizes: SizeClasses,
    device: Arc<dyn Device>,
    committed: AtomicU64,
    peak: AtomicU64,
    /// The region's chunks no class holds, and the pages the committed ones reference. Taken after a
    /// class's mutex, never before.
    chunks: Mutex<Chunks>,
    events: Mutex<Vec<EventHandle>>,
    counters: Counters,
    region: Region,
    /// Set by the owner ([`Slab::set_one_stream`]): every user of this slab's memory so far ran on one
    /// stream, and the owner synchronizes the device before a second stream uses it.
    one_stream: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for Slab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slab")
            .field("base", &format_args!("{:#x}", self.base))
            .field("classes", &self.class.len())
            .field("max_size", &self.max_size())
            .finish_non_exhaustive()
    }
}

const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<Slab>();
};

/// The region's chunks no class holds (lowest reused first: it keeps the slab's pages few), and how many
/// committed chunks reference each page.
struct Chunks {
    /// Chunks given back by reclaim.
    free: std::collections::BTreeSet<u32>,
    /// Chunks `next..` were never taken.
    next: u32,
    /// Chunks of the region.
    total: u32,
    /// Per page of the region, the committed chunks on it.
    page_refs: Vec<u32>,
}

impl Chunks {
    /// The lowest chunk no class holds.
    fn take(&mut self) -> Option<u32> {
        if let Some(g) = self.free.pop_first() {
            return Some(g);
        }
        (self.next < self.total).then(|| {
            self.next += 1;
            self.next - 1
        })
    }
}

/// Why carving a new chunk failed without an error worth returning at once.
enum CarveFail {
    Full,
    WouldGrow(u64),
}

impl Slab {
    /// A slab drawing pages from `pool`, recording events on `device` (the pool's device).
    ///
    /// # Errors
    /// [`TierError::InvalidConfig`] for inconsistent parameters, [`TierError::Vmm`] if the address range
    /// cannot be reserved.
    pub fn new(
        pool: &Arc<PagePool>,
        device: Arc<dyn Device>,
        cfg: SlabConfig,
    ) -> Result<Self, TierError> {
        let bad = |m: String| Err(TierError::InvalidConfig(m));
        let page = pool.page_size();
        let sizes = match SizeClasses::new(cfg.max_size, cfg.classes_per_doubling) {
            Some(s) => s,
            None => {
                return bad(format!(
                "max_size {} must be in 1..=2^40 and classes_per_doubling {} a power of two <= 64",
                cfg.max_size, cfg.classes_per_doubling
            ))
            }
        };
        if cfg.classes_per_doubling > 16 {
            return bad(format!(
                "classes_per_doubling {} is above 16",
                cfg.classes_per_doubling
            ));
        }
        let span = cfg.class_span;
        if !span.is_power_of_two() || span < page || span > 1 << 32 || span < sizes.max_class() {
            return bad(format!(
                "class_span {span:#x} must be a power of two in [page {page:#x}, 4 GiB] and >= the largest \
                 class {:#x}",
                sizes.max_class()
            ));
        }
        let chunk = if cfg.chunk_bytes == 0 {
            cfg.auto_chunk(page)
        } else {
            cfg.chunk_bytes
        };
        if !chunk.is_power_of_two() || chunk < sizes.max_class() || chunk > span {
            return bad(format!(
                "chunk_bytes {chunk:#x} must be a power of two in [the largest class {:#x}, class_span \
                 {span:#x}]",
                sizes.max_class()
            ));
        }
        if cfg.max_slots_per_class == 0 {
            return bad("max_slots_per_class must be at least 1".into());
        }
        if cfg.shard_capacity == 0 || cfg.shard_capacity > gen_freelist::MAX_SHARD_CAPACITY {
            return bad(format!(
                "shard_capacity {} must be in 1..={}",
                cfg.shard_capacity,
                gen_freelist::MAX_SHARD_CAPACITY
            ));
        }
        let shards = if cfg.shards == 0 {
            std::thread::available_parallelism()
                .map_or(4, |n| n.get())
                .min(64)
        } else {
            cfg.shards
        };
        let n = sizes.len() as u64;
        let Some(total) = n.checked_mul(span) else {
            return bad(format!(
                "{n} classes of {span:#x} bytes overflow the address space"
            ));
        };
        let total_chunks = total / chunk;
        if total_chunks > u64::from(u32::MAX) {
            return bad(format!(
                "{total_chunks} chunks of {chunk:#x} bytes: at most 2^32 - 1"
            ));
        }
        let region = Region::new(pool, total, "gen-slab")?;
        let mut class = Vec::with_capacity(sizes.len());
        for (index, &size) in sizes.sizes().iter().enumerate() {
            let spc = chunk / size;
            let slot_shift = spc.next_power_of_two().trailing_zeros();
            // The class's chunks: as many as its span holds, at most `max_slots_per_class` slots.
            let chunks = (span / chunk).min(u64::from(cfg.max_slots_per_class) / spc);
            if chunks == 0 {
                return bad(format!(
                    "max_slots_per_class leaves class {size} without a whole chunk"
                ));
            }
            if chunks << slot_shift > u64::from(u32::MAX) {
                return bad(format!(
                    "class {size}: {chunks} chunks of {spc} slots overflow 32-bit slot numbers"
                ));
            }
            class.push(Class {
                size,
                div: Divisor::new(size),
                chunk_at: (0..chunks).map(|_| AtomicU32::new(0)).collect(),
                slots_per_chunk: spc as u32,
                slot_shift,
                chunks: chunks as u32,
                chunk_len: spc * size,
                index: index as u32,
                lists: Default::default(),
                live: (0..chunks << slot_shift)
                    .map(|_| AtomicU8::new(0))
                    .collect(),
                slow: Mutex::new(ClassSlow {
                    carved: 0,
                    committed: Vec::new(),
                    released: Vec::new(),
                    pending: Vec::new(),
                    overflow: Vec::new(),
                    scratch: Vec::new(),
                }),
            });
        }
        Ok(Slab {
            base: region.base(),
            len: total,
            chunk_shift: chunk.trailing_zeros(),
            owner: (0..total_chunks).map(|_| AtomicU64::new(0)).collect(),
            page,
            sizes,
            class: class.into_boxed_slice(),
            streams: StreamTable {
                ids: Default::default(),
                count: AtomicUsize::new(0),
                reg: Mutex::new(()),
            },
            device,
            shards,
            shard_capacity: cfg.shard_capacity,
            committed: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            chunks: Mutex::new(Chunks {
                free: Default::default(),
                next: 0,
                total: total_chunks as u32,
                page_refs: vec![0; total.div_ceil(page) as usize],
            }),
            events: Mutex::new(Vec::new()),
            counters: Counters::default(),
            region,
            one_stream: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The number of size classes.
    pub fn class_count(&self) -> usize {
        self.class.len()
    }

    /// The largest request served (the largest class size).
    pub fn max_size(&self) -> u64 {
        self.sizes.max_class()
    }

    /// The size classes.
    pub fn size_classes(&self) -> &SizeClasses {
        &self.sizes
    }

    /// The class serving `size`: `(index, class size)`, or `None` for 0 or above [`max_size`](Self::max_size).
    #[inline]
    pub fn class_of(&self, size: u64) -> Option<(usize, u64)> {
        self.sizes.lookup(size)
    }

    /// Whether `ptr` lies in the slab's address range (a range check; it may be a free slot).
    #[inline]
    pub fn owns(&self, ptr: u64) -> bool {
        ptr.wrapping_sub(self.base) < self.len
    }

    /// A block of at least `size` bytes (512-byte aligned) for use on `stream`.
    ///
    /// With `grow == false` it fails with [`TierError::WouldGrow`] rather than make the page pool create
    /// physical pages (the engine then releases caches and retries with `grow == true`).
    ///
    /// # Errors
    /// [`TierError::InvalidSize`], [`TierError::WouldGrow`], [`TierError::Exhausted`], and the
    /// page layer's and device's errors; on any error nothing changed.
    #[inline]
    pub fn alloc(&self, size: u64, stream: StreamId, grow: bool) -> Result<u64, TierError> {
        let Some((ci, _)) = self.sizes.lookup(size) else {
            return Err(TierError::InvalidSize(size));
        };
        let c = &self.class[ci];
        if let Some(t) = self.streams.find(stream) {
            // The thread's own slots first (its shard, then a run from the global stack), on its stream
            // then idle; only then another thread's: taking a neighbour's freed slots interleaves the
            // two threads' slots on shared cache lines (links, live flags, the owner's records).
            let (own, idle) = (c.lists[t].get(), c.lists[IDLE].get());
            let slot = own
                .and_then(FrontCache::pop_near)
                .or_else(|| idle.and_then(FrontCache::pop_near))
                .or_else(|| own.and_then(FrontCache::steal))
                .or_else(|| idle.and_then(FrontCache::steal));
            if let Some(slot) = slot {
                return Ok(self.hand_out(c, slot));
            }
        }
        self.alloc_slow(ci, stream, grow)
    }

    /// Free the block at `ptr` on `stream` (work queued on `stream` may still use it). Returns its class
    /// size.
    ///
    /// # Errors
    /// [`TierError::InvalidFree`] if `ptr` is not a live block of this slab (foreign, interior, or freed
    /// already); device errors on the overflow path. On any error nothing changed.
    #[inline]
    pub fn free(&self, ptr: u64, stream: StreamId) -> Result<u64, TierError> {
        let (_, c, slot) = self.locate(ptr)?;
        let t = match self.streams.find(stream) {
            Some(t) => Some(t),
            None => self.register(stream)?,
        };
        let Some(t) = t else {
            return self.free_overflow(c, ptr, slot, stream);
        };
        let list = match c.lists[t].get() {
            Some(l) => l,
            None => self.init_list(c, t)?,
        };
        if c.live[slot as usize].swap(0, AcqRel) == 0 {
            return Err(TierError::InvalidFree {
                ptr,
                reason: "not allocated (double free?)",
            });
        }
        list.push(slot);
        Ok(c.size)
    }

    /// Decommit every chunk all of whose slots are free, synchronizing the device once first if one of
    /// them was freed on a stream or waits for an event. Returns the bytes of pages the slab no longer
    /// references (physical memory now reusable by other tiers or releasable by the page pool).
    ///
    /// # Errors
    /// A failed device synchronize: chunks that were already safe are still decommitted, the others are
    /// kept, and the first error is returned after every class was processed.
    pub fn reclaim(&self) -> Result<u64, TierError> {
        self.reclaim_with(true)
    }

    /// [`reclaim`](Self::reclaim) without a synchronize: chunks whose slots are not safe without one
    /// (freed on several streams, or in a pending batch) stay. For callers about to take memory from
    /// elsewhere, not out of it.
    pub fn reclaim_idle(&self) -> Result<u64, TierError> {
        self.reclaim_with(false)
    }

    fn reclaim_with(&self, may_sync: bool) -> Result<u64, TierError> {
        if self.capturing() {
            // Reclaim queries events, may order streams or synchronize: after the capture.
            return Ok(0);
        }
        let mut released = 0;
        let mut first_err = None;
        for c in self.class.iter() {
            match self.reclaim_class(c, may_sync && first_err.is_none()) {
                Ok(b) => released += b,
                Err((b, e)) => {
                    released += b;
                    first_err.get_or_insert(e);
                }
            }
        }
        self.counters.reclaimed.fetch_add(released, Relaxed);
        match first_err {
            Some(e) => Err(e),
            None => Ok(released),
        }
    }

    /// Declare whether one stream is all that has used (and, until told otherwise, will use) this slab's
    /// memory. While set, [`reclaim`](Self::reclaim) decommits empty chunks without synchronizing the
    /// device: stream order makes their slots' reuse safe, and the page layer moves their pages only
    /// through its fences. The caller must synchronize the device before a second stream uses the slab,
    /// and clear this first (the engine does both when it sees its second stream). Off by default.
    pub fn set_one_stream(&self, on: bool) {
        self.one_stream.store(on, Release);
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> SlabStats {
        let mut s = SlabStats {
            committed_bytes: self.committed.load(Relaxed),
            peak_committed_bytes: self.peak.load(Relaxed),
            streams: self.streams.count.load(Acquire),
            migrations: self.counters.migrations.load(Relaxed),
            overflow_frees: self.counters.overflow_frees.load(Relaxed),
            synchronizes: self.counters.synchronizes.load(Relaxed),
            reclaimed_bytes: self.counters.reclaimed.load(Relaxed),
            ..SlabStats::default()
        };
        for c in self.class.iter() {
            let g = c.slow.lock();
            let spc = c.slots_per_chunk as usize;
            let mut cs = ClassStats {
                size: c.size,
                slots_per_chunk: spc as u64,
                capacity: u64::from(c.chunks) * spc as u64,
                ..ClassStats::default()
            };
            for (k, _) in g.committed.iter().enumerate().filter(|(_, &on)| on) {
                let live = c
                    .chunk_live(k)
                    .iter()
                    .filter(|b| b.load(Relaxed) != 0)
                    .count();
                cs.chunks += 1;
                cs.live += live as u64;
                cs.free += (spc - live) as u64;
            }
            s.pending_blocks += g.pending.iter().map(|p| p.slots.len() as u64).sum::<u64>();
            s.live_blocks += cs.live;
            s.live_bytes += cs.live * c.size;
            s.free_blocks += cs.free;
            s.chunks_committed += cs.chunks;
            s.classes.push(cs);
        }
        s
    }

    // ---- internals ----

    #[inline]
    fn hand_out(&self, c: &Class, slot: u32) -> u64 {
        // The slot is ours alone (popped from a list): a plain store, no read-modify-write.
        debug_assert_eq!(
            c.live[slot as usize].load(Relaxed),
            0,
            "slot {slot} handed out twice"
        );
        c.live[slot as usize].store(1, Relaxed);
        self.slot_addr_in(c, slot)
    }

    /// The address of slot `slot` of `c`: its chunk's base (the slot was on a list, so its chunk is
    /// committed and `chunk_at` was written before the slot was pushed) plus its place in the chunk.
    #[inline]
    fn slot_addr_in(&self, c: &Class, slot: u32) -> u64 {
        let g = c.chunk_at[(slot >> c.slot_shift) as usize].load(Relaxed);
        let j = slot & ((1 << c.slot_shift) - 1);
        self.base + self.chunk_offset(g) + u64::from(j) * c.size
    }

    /// The class index and slot of `ptr` when it is the start of one of this slab's slots (live or not):
    /// for an owner that keeps per-slot records beside the slab's own.
    #[inline]
    ///
    /// A slot number is the class's own (`k << s | j`, see the [crate docs](crate)); an address in a chunk
    /// no class holds now is no slot.
    pub fn slot_of(&self, ptr: u64) -> Option<(usize, u32)> {
        self.locate(ptr).ok().map(|(ci, _, slot)| (ci, slot))
    }

    /// The address of slot `slot` of class `ci` (both as [`slot_of`](Self::slot_of) gives them; the
    /// slot's chunk must be committed: a live slot's is).
    pub fn slot_addr(&self, ci: usize, slot: u32) -> u64 {
        self.slot_addr_in(&self.class[ci], slot)
    }

    /// Per class, `(slot numbers, slots per chunk)`: the shape of a per-slot record kept beside the slab
    /// (slot numbers run below the first, with gaps: see [`slot_of`](Self::slot_of)).
    pub fn slot_geometry(&self) -> Vec<(u32, u32)> {
        self.class
            .iter()
            .map(|c| (c.chunks << c.slot_shift, c.slots_per_chunk))
            .collect()
    }

    /// Class index, class and slot of `ptr`, which must be the start of a slot of a chunk a class holds.
    #[inline]
    fn locate(&self, ptr: u64) -> Result<(usize, &Class, u32), TierError> {
        let off = ptr.wrapping_sub(self.base);
        let Some(owner) = self.owner.get((off >> self.chunk_shift) as usize) else {
            return Err(TierError::InvalidFree {
                ptr,
                reason: "not a slab address",
            });
        };
        // Acquire: pairs with `carve`'s release, for a pointer handed over without other ordering.
        let o = owner.load(Acquire);
        if o == 0 {
            return Err(TierError::InvalidFree {
                ptr,
                reason: "in no class's chunk (never handed out, or freed and given back)",
            });
        }
        let ci = (o as u32 - 1) as usize;
        let c = &self.class[ci];
        // `chunk <= span <= 2^32`, so the offset within the chunk fits in a u32.
        let within = (off & ((1 << self.chunk_shift) - 1)) as u32;
        if !c.div.divides(within) {
            return Err(TierError::InvalidFree {
                ptr,
                reason: "not the start of a block",
            });
        }
        let j = c.div.div(within);
        if j >= c.slots_per_chunk {
            return Err(TierError::InvalidFree {
                ptr,
                reason: "in a chunk's tail, past its last slot",
            });
        }
        Ok((ci, c, ((o >> 32) as u32) << c.slot_shift | j))
    }

    #[cold]
    fn init_list<'a>(&self, c: &'a Class, t: usize) -> Result<&'a FrontCache, TierError> {
        if let Some(l) = c.lists[t].get() {
            return Ok(l);
        }
        let slots = (c.chunks as usize) << c.slot_shift;
        let l = FrontCache::new(slots, self.shards, self.shard_capacity)
            .map_err(|e| TierError::Host(e.to_string()))?;
        // A racing thread may have set it first: either list is empty and equivalent.
        let _ = c.lists[t].set(l);
        Ok(c.lists[t].get().expect("set above"))
    }

    #[inline]
    fn list<'a>(&self, c: &'a Class, t: usize) -> Result<&'a FrontCache, TierError> {
        match c.lists[t].get() {
            Some(l) => Ok(l),
            None => self.init_list(c, t),
        }
    }

    /// Whether a capture is underway on the device.
    #[inline]
    fn capturing(&self) -> bool {
        self.device.captures().active()
    }

    /// Register `stream` in the stream table: its slot, or `None` when the table is full.
    #[cold]
    fn register(&self, stream: StreamId) -> Result<Option<usize>, TierError> {
        // A full table stays full (slots are never given back): a stream not in it now never will be,
        // so the calls of streams past it skip the registration lock.
        if self.streams.count.load(Acquire) >= STREAM_SLOTS {
            return Ok(self.streams.find(stream));
        }
        let _reg = self.streams.reg.lock();
        if let Some(t) = self.streams.find(stream) {
            return Ok(Some(t));
        }
        let n = self.streams.count.load(Relaxed);
        if n >= STREAM_SLOTS {
            return Ok(None);
        }
        if n == 1 {
            self.second_stream();
        }
        self.streams.ids[n].store(stream, Relaxed);
        self.streams.count.store(n + 1, Release);
        Ok(Some(n))
    }

    /// The first time a second stream appears: one synchronize makes every earlier free (all on the
    /// first stream) safe everywhere, so those slots move to the idle lists. Failing that, they stay on
    /// the first stream's lists (correct, only slower).
    fn second_stream(&self) {
        if self.capturing() {
            // The synchronize that would make earlier frees safe everywhere is forbidden: they stay on
            // the first stream's lists (reused there, or migrated under an event after the capture).
            return;
        }
        let mut moved = Vec::new();
        for (ci, c) in self.class.iter().enumerate() {
            if let Some(l) = c.lists[0].get() {
                l.flush_shards();
                let v: Vec<u32> = l.global().take_all().collect();
                if !v.is_empty() {
                    moved.push((ci, v));
                }
            }
        }
        if moved.is_empty() {
            return;
        }
        // Taken before the synchronize: every one of these frees precedes it.
        let synced = self.device.synchronize();
        if synced.is_ok() {
            self.counters.synchronizes.fetch_add(1, Relaxed);
            self.region.pool().synchronized();
        } else if let Err(e) = &synced {
            log::warn!(
                "gen-slab: synchronize at the second stream failed ({e}); frees stay per stream"
            );
        }
        for (ci, v) in moved {
            let c = &self.class[ci];
            match (&synced, c.lists[IDLE].get()) {
                (Ok(()), Some(idle)) => idle.global().push_chain(&v),
                _ => c.lists[0]
                    .get()
                    .expect("taken from it")
                    .global()
                    .push_chain(&v),
            }
        }
    }

    #[cold]
    fn alloc_slow(&self, ci: usize, stream: StreamId, grow: bool) -> Result<u64, TierError> {
        let c = &self.class[ci];
        let t = match self.streams.find(stream) {
            Some(t) => Some(t),
            None => self.register(stream)?,
        };
        let idle = self.list(c, IDLE)?;
        let own = match t {
            Some(t) => Some(self.list(c, t)?),
            None => None,
        };
        let mut g = c.slow.lock();
        // A stream beyond the table: the slots it freed itself first (stream order makes them safe).
        if t.is_none() {
            let mine = g.overflow.iter_mut().find(|(s, _)| *s == stream);
            if let Some(slot) = mine.and_then(|(_, v)| v.pop()) {
                return Ok(self.hand_out(c, slot));
            }
        }
        // The stream transition or a reclaim may have refilled the lists meanwhile.
        if let Some(slot) = own.and_then(FrontCache::pop).or_else(|| idle.pop()) {
            return Ok(self.hand_out(c, slot));
        }
        let capturing = self.capturing();
        if !capturing && self.poll_pending(&mut g, idle)? {
            if let Some(slot) = idle.pop() {
                return Ok(self.hand_out(c, slot));
            }
        }
        // Another stream's free slots, usable at once: this stream waits (on the device) for that
        // stream's work so far. Not during a capture (the wait would join the graph).
        if let (false, Some(own), Some(t)) = (capturing, own, t) {
            if self.take_ordered(c, own, t, stream) {
                if let Some(slot) = own.pop() {
                    return Ok(self.hand_out(c, slot));
                }
            }
        }
        if !capturing && self.migrate(c, &mut g, t)? && self.poll_pending(&mut g, idle)? {
            if let Some(slot) = idle.pop() {
                return Ok(self.hand_out(c, slot));
            }
        }
        // Several streams: a chunk is carved for this stream (its bytes may have served another stream's
        // slots, of this class or another, still queued there: the page layer makes this stream wait on
        // that one) and its slots go to this stream's list — its overflow list for a stream beyond the
        // table — not the idle one.
        let several = !self.one_stream.load(Acquire) && self.streams.count.load(Acquire) > 1;
        let carve_for = several.then_some((own, stream));
        let fail = match self.carve(c, &mut g, idle, false, carve_for) {
            Ok(slot) => return Ok(self.hand_out(c, slot)),
            Err(Ok(fail)) => fail,
            Err(Err(e)) => return Err(e),
        };
        // Memory pressure: wait for migrated batches (and what streams beyond the table freed) rather
        // than take new memory.
        self.flush_overflow(&mut g);
        if !capturing && self.sync_pending(&mut g, idle) {
            if let Some(slot) = idle.pop() {
                return Ok(self.hand_out(c, slot));
            }
        }
        let fail = match fail {
            CarveFail::WouldGrow(_) if grow => match self.carve(c, &mut g, idle, true, carve_for) {
                Ok(slot) => return Ok(self.hand_out(c, slot)),
                Err(Ok(fail)) => fail,
                Err(Err(e)) => return Err(e),
            },
            fail => fail,
        };
        Err(match fail {
            CarveFail::Full => TierError::Exhausted {
                what: "slab size class",
                requested: c.size,
                available: u64::from(c.chunks) * u64::from(c.slots_per_chunk),
            },
            CarveFail::WouldGrow(pages) => TierError::WouldGrow { pages },
        })
    }

    /// Commit a chunk for class `c` — the lowest chunk of the region no class holds, under the class's
    /// lowest free chunk number — push all its slots but the first to the idle list and return the
    /// first. `Err(Ok(_))`: nothing to commit or it would grow; `Err(Err(_))`: error.
    fn carve(
        &self,
        c: &Class,
        g: &mut ClassSlow,
        idle: &FrontCache,
        grow: bool,
        // `(its list, the stream)`: carve for one stream of several (see `alloc_slow`); no list for a
        // stream beyond the table.
        for_stream: Option<(Option<&FrontCache>, StreamId)>,
    ) -> Result<u32, Result<CarveFail, TierError>> {
        let (k, fresh) = match g.released.last() {
            Some(&k) => (k, false),
            None if g.carved < c.chunks => (g.carved, true),
            None => return Err(Ok(CarveFail::Full)),
        };
        let mut chunks = self.chunks.lock();
        let Some(at) = chunks.take() else {
            return Err(Ok(CarveFail::Full));
        };
        let off = self.chunk_offset(at);
        // `ordered`: the stream was made to wait on another stream's work on these pages — the slots are
        // safe on it alone.
        let committed = match for_stream {
            Some((_, stream)) => self.region.commit_for(off, c.chunk_len, grow, stream),
            None => self.region.commit(off, c.chunk_len, grow).map(|()| false),
        };
        let ordered = match committed {
            Ok(ordered) => ordered,
            Err(e) => {
                chunks.free.insert(at);
                return Err(match e {
                    VmmError::WouldGrow { pages } => Ok(CarveFail::WouldGrow(pages)),
                    e => Err(e.into()),
                });
            }
        };
        let mut new_pages = 0;
        for p in self.pages_of(c, at) {
            let r = &mut chunks.page_refs[p];
            new_pages += u64::from(*r == 0);
            *r += 1;
        }
        drop(chunks);
        if fresh {
            g.carved += 1;
            g.committed.push(true);
        } else {
            g.released.pop();
            g.committed[k as usize] = true;
        }
        c.chunk_at[k as usize].store(at, Relaxed);
        // Release: a free that finds the chunk's owner finds its slots' class (see `locate`).
        self.owner[at as usize].store(u64::from(k) << 32 | (u64::from(c.index) + 1), Release);
        let now = self.committed.fetch_add(new_pages * self.page, Relaxed) + new_pages * self.page;
        self.peak.fetch_max(now, Relaxed);
        let first = k << c.slot_shift;
        g.scratch.clear();
        g.scratch.extend(first + 1..first + c.slots_per_chunk);
        // The carving thread keeps the chunk's first run in its shard (its slots neighbours, not another
        // thread's), the rest is for every thread.
        match for_stream {
            Some((Some(own), _)) if ordered => own.push_run_near(&g.scratch),
            Some((None, stream)) if ordered => {
                let i = g.overflow_of(stream);
                g.overflow[i].1.extend_from_slice(&g.scratch);
            }
            _ => idle.push_run_near(&g.scratch),
        }
        Ok(first)
    }

    /// The offset in the region of region chunk `at`.
    #[inline]
    fn chunk_offset(&self, at: u32) -> u64 {
        u64::from(at) << self.chunk_shift
    }

    /// Page indices (within the region) overlapped by the slots of class `c` in region chunk `at`.
    fn pages_of(&self, c: &Class, at: u32) -> std::ops::RangeInclusive<usize> {
        let start = self.chunk_offset(at);
        (start / self.page) as usize..=((start + c.chunk_len - 1) / self.page) as usize
    }

    /// Move every pending batch whose event completed to the idle list. True if any moved.
    fn poll_pending(&self, g: &mut ClassSlow, idle: &FrontCache) -> Result<bool, TierError> {
        let mut moved = false;
        let mut i = 0;
        while i < g.pending.len() {
            if self.device.event_query(g.pending[i].event)? {
                let p = g.pending.swap_remove(i);
                idle.global().push_chain(&p.slots);
                self.events.lock().push(p.event);
                moved = true;
            } else {
                i += 1;
            }
        }
        Ok(moved)
    }

    /// Memory pressure: wait for every pending batch's event and move it to the idle list. Batches whose
    /// wait fails stay pending. True if any moved.
    fn sync_pending(&self, g: &mut ClassSlow, idle: &FrontCache) -> bool {
        let mut moved = false;
        let mut i = 0;
        while i < g.pending.len() {
            match self.device.event_synchronize(g.pending[i].event) {
                Ok(()) => {
                    let p = g.pending.swap_remove(i);
                    idle.global().push_chain(&p.slots);
                    self.events.lock().push(p.event);
                    moved = true;
                }
                Err(e) => {
                    log::debug!("gen-slab: waiting for a migrated batch failed: {e}");
                    i += 1;
                }
            }
        }
        moved
    }

    /// Record an event (from the pool, or a new one) on `stream`.
    fn record(&self, stream: StreamId) -> Result<EventHandle, TierError> {
        let pooled = self.events.lock().pop();
        let ev = match pooled {
            Some(ev) => ev,
            None => self.device.event_create()?,
        };
        if let Err(e) = self.device.event_record(ev, stream) {
            self.events.lock().push(ev);
            return Err(e.into());
        }
        Ok(ev)
    }

    /// Take a batch from every other stream's list that has free slots, each under one event recorded on
    /// its stream after the frees. True if any batch was taken.
    /// Move up to [`MIGRATE_BATCH`] free slots of another stream's list to `own` (stream `stream`, slot
    /// `t`), after making `stream` wait on the device for everything queued on that stream so far
    /// ([`gen_vmm::PagePool::order_after`]): a migration with no host wait and nothing pending. False
    /// when no other stream has free slots, or ordering failed (then nothing moved).
    fn take_ordered(&self, c: &Class, own: &FrontCache, t: usize, stream: StreamId) -> bool {
        let n = self.streams.count.load(Acquire);
        for s in (0..n).filter(|&s| s != t) {
            let Some(list) = c.lists[s].get() else {
                continue;
            };
            let batch = pop_batch(list);
            if batch.is_empty() {
                continue;
            }
            let from = self.streams.ids[s].load(Relaxed);
            match self.region.pool().order_after(stream, from) {
                Ok(_) => {
                    own.global().push_chain(&batch);
                    self.counters.migrations.fetch_add(1, Relaxed);
                    return true;
                }
                Err(e) => {
                    log::debug!("gen-slab: ordering stream {stream:#x} after {from:#x}: {e}");
                    list.global().push_chain(&batch);
                    return false;
                }
            }
        }
        false
    }

    fn migrate(&self, c: &Class, g: &mut ClassSlow, own: Option<usize>) -> Result<bool, TierError> {
        let n = self.streams.count.load(Acquire);
        let mut any = false;
        for s in (0..n).filter(|&s| Some(s) != own) {
            let Some(list) = c.lists[s].get() else {
                continue;
            };
            let batch = pop_batch(list);
            if batch.is_empty() {
                continue;
            }
            match self.record(self.streams.ids[s].load(Relaxed)) {
                Ok(event) => {
                    g.pending.push(Pending {
                        event,
                        slots: batch,
                    });
                    self.counters.migrations.fetch_add(1, Relaxed);
                    any = true;
                }
                Err(e) => {
                    list.global().push_chain(&batch);
                    return Err(e);
                }
            }
        }
        Ok(any)
    }

    /// A free on a stream beyond the table: the slot joins its stream's overflow list (reused there at
    /// once); every [`MIGRATE_BATCH`] of them go to the pending list under one event. No device call
    /// during a capture (the batch waits for the next free after it). Never fails but for a double free.
    #[cold]
    fn free_overflow(
        &self,
        c: &Class,
        ptr: u64,
        slot: u32,
        stream: StreamId,
    ) -> Result<u64, TierError> {
        let mut g = c.slow.lock();
        if c.live[slot as usize].swap(0, AcqRel) == 0 {
            return Err(TierError::InvalidFree {
                ptr,
                reason: "not allocated (double free?)",
            });
        }
        let i = g.overflow_of(stream);
        g.overflow[i].1.push(slot);
        self.counters.overflow_frees.fetch_add(1, Relaxed);
        if g.overflow[i].1.len() >= MIGRATE_BATCH && !self.capturing() {
            self.flush_overflow_of(&mut g, i);
        }
        Ok(c.size)
    }

    /// Move every stream's overflow list to the pending list, one event each (not during a capture).
    fn flush_overflow(&self, g: &mut ClassSlow) {
        if self.capturing() {
            return;
        }
        for i in 0..g.overflow.len() {
            if !g.overflow[i].1.is_empty() {
                self.flush_overflow_of(g, i);
            }
        }
    }

    /// Record an event on overflow list `i`'s stream and move its slots to the pending list. When the
    /// event cannot be recorded they stay (reused by their stream; tried again at the next flush).
    fn flush_overflow_of(&self, g: &mut ClassSlow, i: usize) {
        let stream = g.overflow[i].0;
        match self.record(stream) {
            Ok(event) => {
                let slots = std::mem::take(&mut g.overflow[i].1);
                g.pending.push(Pending { event, slots });
            }
            Err(e) => log::debug!("gen-slab: an event for frees beyond the stream table: {e}"),
        }
    }

    /// Reclaim one class. `may_sync`: whether a device synchronize may be attempted. On a failed
    /// synchronize returns the bytes released anyway and the error.
    fn reclaim_class(&self, c: &Class, may_sync: bool) -> Result<u64, (u64, TierError)> {
        let mut g = c.slow.lock();
        if g.carved == 0 {
            return Ok(0);
        }
        // Slots freed on streams beyond the table wait for an event like any pending batch (a slot on an
        // overflow list is in no list reclaim takes: its chunk would stay).
        self.flush_overflow(&mut g);
        // Only a chunk none of whose slots is live can go: when every committed chunk still has a live
        // slot (the common case when an allocation is about to take memory elsewhere), nothing below
        // could be reclaimed — skip taking every list apart. A racing free or allocation changes no
        // outcome: a slot between its list and its live flag is in neither, so its chunk stays either way.
        let may_be_empty = |k: usize| c.chunk_live(k).iter().all(|b| b.load(Relaxed) == 0);
        if g.pending.is_empty()
            && !g
                .committed
                .iter()
                .enumerate()
                .any(|(k, &on)| on && may_be_empty(k))
        {
            return Ok(0);
        }
        // Origin of each taken slot: a stream slot, IDLE (safe), or PENDING (its batch's event).
        const PENDING: u8 = u8::MAX;
        let mut taken: Vec<(u32, u8)> = Vec::new();
        for (t, l) in c.lists.iter().enumerate() {
            if let Some(l) = l.get() {
                l.flush_shards();
                taken.extend(l.global().take_all().map(|s| (s, t as u8)));
            }
        }
        let pending = std::mem::take(&mut g.pending);
        let mut still_pending = Vec::new();
        for p in pending {
            match self.device.event_query(p.event) {
                Ok(true) => {
                    taken.extend(p.slots.iter().map(|&s| (s, IDLE as u8)));
                    self.events.lock().push(p.event);
                }
                _ => {
                    taken.extend(p.slots.iter().map(|&s| (s, PENDING)));
                    still_pending.push(p);
                }
            }
        }
        let spc = c.slots_per_chunk;
        let mut free_in = vec![0u32; g.carved as usize];
        let mut unsafe_in = vec![false; g.carved as usize];
        // One stream (`set_one_stream`): its slots are reused in stream order, and the page layer moves
        // a decommitted page only through its fences — no synchronize for them.
        let one_stream = self.one_stream.load(Acquire);
        for &(s, o) in &taken {
            let k = c.chunk_of(s);
            free_in[k] += 1;
            unsafe_in[k] |= o == PENDING || (o != IDLE as u8 && !one_stream);
        }
        let full = |k: usize| g.committed[k] && free_in[k] == spc;
        // Several streams: when every stream slot of the empty chunks came from one stream (no pending
        // batch among them), their pages are decommitted stamped with it — the page layer orders any
        // later user after that stream's fence — and need no synchronize.
        // Per chunk: the stream lists its slots came from (a bit per list), and whether one sits in a
        // pending batch. Several streams: an empty chunk with no pending slot goes without a
        // synchronize, its pages stamped with one of those streams — the others' work ordered before
        // that stream's by an event it waits on (`PagePool::order_after`), when there are others.
        let mut lists_in = vec![0u16; free_in.len()];
        let mut pending_in = vec![false; free_in.len()];
        let mut stamp: Vec<Option<StreamId>> = vec![None; free_in.len()];
        if !one_stream {
            for &(s, o) in &taken {
                let k = c.chunk_of(s);
                if o == PENDING {
                    pending_in[k] = true;
                } else if o != IDLE as u8 {
                    lists_in[k] |= 1 << o;
                }
            }
            let pool = self.region.pool();
            for k in 0..free_in.len() {
                if !full(k) || pending_in[k] || lists_in[k] == 0 {
                    continue;
                }
                let anchor = lists_in[k].trailing_zeros() as usize;
                let anchor_stream = self.streams.ids[anchor].load(Acquire);
                let mut ordered = true;
                for t in (anchor + 1..STREAM_SLOTS).filter(|&t| lists_in[k] & (1 << t) != 0) {
                    let other = self.streams.ids[t].load(Acquire);
                    if let Err(e) = pool.order_after(anchor_stream, other) {
                        log::debug!("gen-slab: ordering streams for a reclaim: {e}");
                        ordered = false;
                        break;
                    }
                }
                if ordered {
                    stamp[k] = Some(anchor_stream);
                    unsafe_in[k] = false;
                }
            }
        }
        let mut err = None;
        let mut synced = false;
        if may_sync && (0..free_in.len()).any(|k| full(k) && unsafe_in[k]) {
            match self.device.synchronize() {
                Ok(()) => {
                    synced = true;
                    self.counters.synchronizes.fetch_add(1, Relaxed);
                    // Every page freed so far is idle: the page layer need not wait for them again.
                    self.region.pool().synchronized();
                }
                Err(e) => err = Some(TierError::from(e)),
            }
        }
        let reclaim: Vec<bool> = (0..free_in.len())
            .map(|k| full(k) && (synced || !unsafe_in[k]))
            .collect();
        // Give back what is not decommitted: after a synchronize everything is safe.
        let idle = c.lists[IDLE].get();
        let mut back: [Vec<u32>; STREAM_SLOTS + 1] = Default::default();
        for &(s, o) in &taken {
            if reclaim[c.chunk_of(s)] || (o == PENDING && !synced) {
                continue;
            }
            let dest = if synced { IDLE } else { o as usize };
            back[dest].push(s);
        }
        if synced {
            for p in still_pending {
                self.events.lock().push(p.event);
            }
        } else {
            g.pending = still_pending;
        }
        for (t, v) in back.iter().enumerate() {
            if !v.is_empty() {
                // Every list a slot came from exists; IDLE exists once anything was carved.
                let l = if t == IDLE { idle } else { c.lists[t].get() };
                l.expect("list of a taken slot").global().push_chain(v);
            }
        }
        let mut freed_pages = 0u64;
        let mut chunks = self.chunks.lock();
        for k in (0..reclaim.len()).filter(|&k| reclaim[k]) {
            debug_assert!(c.chunk_live(k).iter().all(|b| b.load(Relaxed) == 0));
            let at = c.chunk_at[k].load(Relaxed);
            let (off, len) = (self.chunk_offset(at), c.chunk_len);
            // Idle bytes: after the synchronize, or (several streams) every slot on the idle list — a
            // plain decommit would leave the unknown stream on a page other chunks share, and its next
            // reuse for a stream would synchronize the device for nothing.
            let idle = synced || (!one_stream && lists_in[k] == 0 && !pending_in[k]);
            match stamp[k].filter(|_| !synced) {
                Some(stream) => self.region.decommit_for(off, len, stream),
                None if idle => self.region.decommit_idle(off, len),
                None => self.region.decommit(off, len),
            }
            // No slot of the chunk is live or on a list: no free can name it rightly any more.
            self.owner[at as usize].store(0, Relaxed);
            g.committed[k] = false;
            g.released.push(k as u32);
            for p in self.pages_of(c, at) {
                chunks.page_refs[p] -= 1;
                freed_pages += u64::from(chunks.page_refs[p] == 0);
            }
            chunks.free.insert(at);
        }
        drop(chunks);
        // Reuse low chunks first (keeps the class's footprint compact).
        g.released.sort_unstable_by(|a, b| b.cmp(a));
        let bytes = freed_pages * self.page;
        self.committed.fetch_sub(bytes, Relaxed);
        match err {
            Some(e) => Err((bytes, e)),
            None => Ok(bytes),
        }
    }
}

/// Up to [`MIGRATE_BATCH`] free slots off `list` (a migration's batch).
fn pop_batch(list: &FrontCache) -> Vec<u32> {
    let mut batch = Vec::new();
    while batch.len() < MIGRATE_BATCH {
        match list.pop() {
            Some(slot) => batch.push(slot),
            None => break,
        }
    }
    batch
}

impl Drop for Slab {
    fn drop(&mut self) {
        for c in self.class.iter_mut() {
            let g = c.slow.get_mut();
            for p in g.pending.drain(..) {
                if let Err(e) = self.device.event_destroy(p.event) {
                    log::error!("gen-slab: destroying an event at drop: {e}");
                }
            }
            for (k, _) in g.committed.iter().enumerate().filter(|(_, &on)| on) {
                let at = c.chunk_at[k].load(Relaxed);
                // (`chunk_offset` by hand: the classes are borrowed mutably here.)
                self.region
                    .decommit(u64::from(at) << self.chunk_shift, c.chunk_len);
            }
        }
        for ev in self.events.get_mut().drain(..) {
            if let Err(e) = self.device.event_destroy(ev) {
                log::error!("gen-slab: destroying an event at drop: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod layout_tests {
    use super::{Class, Slab};
    use std::mem::offset_of;

    #[test]
    fn the_per_call_fields_share_a_line() {
        assert!(
            offset_of!(Class, chunks) + 4 <= 64,
            "class scalars in the first line"
        );
        assert!(
            offset_of!(Slab, page) + 8 <= 64,
            "the slab's class table, base and span in one line"
        );
    }
}
