//! [`Handoff`]: the stream rule for blocks of a range several streams use — the block-level twin of the
//! page pool's per-stream fences, and built on them.
//!
//! A block freed on stream S may still be used by work queued on S. Inside a range only S allocates from
//! (a stream's own extent arena) stream order makes its reuse safe at once. When another stream T may
//! get it — T allocates from the same range, or S is not the range's allocator at all (a block handed to
//! S and freed there, PyTorch's `record_stream`) — T's work must be ordered after S's. A `Handoff` keeps
//! the streams that *allocate* from its range and those that have *freed* into it, and orders them on
//! the device, never on the host:
//!
//! - a free on S makes every other allocator wait for S's work so far ([`PagePool::order_after`]: one
//!   fence on S, one `cuStreamWaitEvent` per allocator) before the block goes back to the range;
//! - a stream's first allocation from the range makes it wait, once, for every stream that freed into it
//!   before.
//!
//! The common cases cost one atomic load: one allocator freeing its own blocks (a stream's own arena; the
//! first stream's arena while no other stream frees into it) makes no device call. A foreign free costs a
//! fence and a wait, where PyTorch's caching allocator records an event per recorded stream and polls it
//! from the host before the block's next use.
//!
//! **Shared ranges order lazily** ([`Handoff::freed_lazily`], [`Handoff::before_use`]): where several
//! streams allocate from one range all the time (the arena the streams after the first share), ordering
//! every other allocator at every free costs a fence and a wait per allocator per free — more than the
//! blocks' work. There a free makes no device call: it leaves a [`Stamp`] on the freed bytes (which
//! streams freed them, and when, in the handoff's count of frees), the range keeps the stamp on those
//! bytes of the free extent (gen-extent keeps a few pieces an extent, merged past that), and the stream
//! that allocates there waits only for the
//! streams named on the bytes it gets — and only for those it has not already waited for since their
//! free: one fence and one wait per pair of streams per hand-over, none for a block that goes back to
//! the stream that freed it.
//!
//! Pages need no more than this: a page freed in a region whose allocators all waited for S is covered by
//! their later fences, and a region of no stream of its own stamps its pages with S
//! ([`Region::decommit_for`](crate::Region::decommit_for)).

use std::sync::atomic::{AtomicU64, Ordering};

use gen_device::StreamId;
use parking_lot::Mutex;

use crate::{PagePool, VmmError};

/// No sole allocator: none yet, or several.
const NONE: u64 = u64::MAX;

/// Who allocates from a range and who freed into it: the stream rule for blocks of a range several
/// streams use (this file's module docs; docs/ARCHITECTURE.md, "Stream rules").
#[derive(Debug)]
pub struct Handoff {
    /// The range's one allocator when there is exactly one (it is then a known freer too), else `NONE`.
    /// Cleared before any ordering that a concurrent fast path must not miss.
    sole: AtomicU64,
    parties: Mutex<Parties>,
}

#[derive(Debug, Default)]
struct Parties {
    allocators: Vec<StreamId>,
    freers: Vec<StreamId>,
    /// Lazy ordering: the streams that freed with a stamp, by stamp bit (never shrinks: a stamp names
    /// its freers by their place here), each with the time of its latest stamped free. Slot `i` has bit
    /// `i % BITS` ([`BITS`]).
    slots: Vec<(StreamId, u64)>,
    /// Frees stamped so far (a stamp's time).
    seq: u64,
    /// Stamps up to this time need no ordering (the device was synchronized after them).
    synced_seq: u64,
    /// `(t, row)`: stream `t` waited for the work of the freer in slot `i` after every free that freer
    /// stamped up to `row[i]` (0 or past the row's end: never). Indexed by slot, so that a stamp naming
    /// many freers costs a look-up each, not a search (with tens of streams the search was the whole
    /// cost: `a_hundred_streams_allocate_and_hand_blocks_over`).
    ordered: Vec<(StreamId, Vec<u64>)>,
    /// By freer slot, `(time, epoch)`: the newest fence recorded on that freer for this range, after
    /// every free it stamped up to `time` (0: none), at the page pool's `epoch` — another stream needing
    /// no later free of it waits on it.
    fenced: Vec<(u64, u64)>,
}

impl Parties {
    /// The slots among `n` a stamp with freer bits `bits` names, in order: slot `i` has bit `i % BITS`,
    /// so past the bits a stamp names every freer that shares the bit of the one that freed.
    fn named_in(bits: u64, n: usize) -> impl Iterator<Item = usize> {
        (0..n).filter(move |&i| bits & (1 << (i % BITS)) != 0)
    }

    /// `stream`'s row of [`ordered`](Self::ordered), if it has ordered itself after anyone.
    fn row(&self, stream: StreamId) -> Option<usize> {
        self.ordered.iter().position(|(t, _)| *t == stream)
    }

    /// Whether `stream` (its row `row`) still has to wait for the freer in slot `i` for a stamp of time
    /// `at`; returns that freer and the time its ordering must cover: the stamp's time, or the freer's
    /// last stamped free when that is earlier (a merged stamp keeps only the latest time of its freers).
    fn owes(
        &self,
        row: Option<usize>,
        stream: StreamId,
        at: u64,
        i: usize,
    ) -> Option<(StreamId, u64)> {
        let (s, last) = self.slots[i];
        let need = at.min(last);
        let done = row
            .and_then(|r| self.ordered[r].1.get(i).copied())
            .unwrap_or(0);
        (s != stream && done < need).then_some((s, need))
    }

    /// The freer bits of `stamp` that still count (none for a stamp the last synchronize covers).
    fn live_bits(&self, stamp: Stamp) -> u64 {
        if stamp.seq() <= self.synced_seq {
            0
        } else {
            stamp.freers()
        }
    }
}

/// Stamp bits naming freers: slot `i` has bit `i % BITS`, one freer a bit up to `BITS` streams, past
/// them the streams that share a bit are named together (a user of their bytes waits for each of them).
/// Sharing by residue spreads the freers past the bits evenly: with a hundred streams one free's stamp
/// names about six instead of the 85 a shared last bit named (merged stamps name more: in genpool's
/// `a_hundred_streams_allocate_and_hand_blocks_over`, 145 498 → 90 766 stream waits for 4 000
/// allocations).
const BITS: usize = 16;
const SEQ_BITS: u32 = 48;
const SEQ_MASK: u64 = (1 << SEQ_BITS) - 1;

/// What a lazily ordered free leaves on the bytes it frees: the streams that freed them (a bit per
/// freer, as the handoff numbers them) and the time of the latest of those frees. Ranges keep it on
/// the bytes of their free extents (gen-extent: up to four pieces an extent, the closest merged past
/// that — [`merge`](Stamp::merge) only ever names more); the stream that allocates the bytes hands the
/// stamp of the pieces it gets to [`Handoff::before_use`]. [`Stamp::NONE`]: bytes no stamped free
/// touched, nothing to order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Stamp(u64);

impl Stamp {
    /// Nothing to order.
    pub const NONE: Stamp = Stamp(0);

    /// The stamp of bytes carrying both `self` and `other` (freed by either's streams, as late as the
    /// later of the two).
    #[inline]
    pub fn merge(self, other: Stamp) -> Stamp {
        Stamp(((self.0 | other.0) & !SEQ_MASK) | (self.0 & SEQ_MASK).max(other.0 & SEQ_MASK))
    }

    /// How many freers one of the two stamps names and the other does not: what merging them adds to
    /// either (a range's pieces of stamps merge the neighbours that differ least).
    #[inline]
    pub fn differs_in(self, other: Stamp) -> u32 {
        (self.freers() ^ other.freers()).count_ones()
    }

    /// Whether there is nothing to order.
    #[inline]
    pub fn is_none(self) -> bool {
        self.0 == 0
    }

    /// The stamp as a word (for a range's tables); [`Stamp::from_bits`] reverses it.
    #[inline]
    pub fn bits(self) -> u64 {
        self.0
    }

    /// A stamp kept as [`Stamp::bits`].
    #[inline]
    pub fn from_bits(bits: u64) -> Stamp {
        Stamp(bits)
    }

    fn seq(self) -> u64 {
        self.0 & SEQ_MASK
    }

    fn freers(self) -> u64 {
        self.0 >> SEQ_BITS
    }
}

impl Default for Handoff {
    fn default() -> Self {
        Self::new()
    }
}

impl Handoff {
    /// A range no stream has used yet.
    pub fn new() -> Self {
        Handoff {
            sole: AtomicU64::new(NONE),
            parties: Mutex::new(Parties::default()),
        }
    }

    /// A range `stream` alone allocates from (its own arena).
    pub fn owned_by(stream: StreamId) -> Self {
        let h = Self::new();
        h.seed(stream);
        h
    }

    /// Declare `stream` an allocator of the range and a freer into it with no device call: for the range's
    /// first stream, whose earlier frees were ordered by stream order alone (one stream seen so far).
    pub fn seed(&self, stream: StreamId) {
        let mut p = self.parties.lock();
        if !p.allocators.contains(&stream) {
            p.allocators.push(stream);
        }
        if !p.freers.contains(&stream) {
            p.freers.push(stream);
        }
        self.publish_sole(&p);
    }

    /// `stream` is about to allocate from the range. Its first time it waits (on the device) for every
    /// stream that freed into the range so far, and joins its allocators. One atomic load otherwise.
    ///
    /// Fails only when that wait cannot be ordered on the device nor replaced by a synchronize (a
    /// capture: [`VmmError::Capturing`]; a device error); the stream has not joined then.
    #[inline]
    pub fn enter(&self, pages: &PagePool, stream: StreamId) -> Result<(), VmmError> {
        if self.sole.load(Ordering::SeqCst) == stream {
            return Ok(());
        }
        self.enter_slow(pages, stream)
    }

    #[cold]
    fn enter_slow(&self, pages: &PagePool, stream: StreamId) -> Result<(), VmmError> {
        let mut p = self.parties.lock();
        if p.allocators.contains(&stream) {
            return Ok(());
        }
        // A second allocator: a freer on the fast path must now take the slow one.
        if !p.allocators.is_empty() {
            self.sole.store(NONE, Ordering::SeqCst);
        }
        for &f in p.freers.iter().filter(|&&f| f != stream) {
            if let Err(e) = order(pages, stream, f) {
                self.publish_sole(&p);
                return Err(e);
            }
        }
        p.allocators.push(stream);
        // An allocator's own frees take the fast path while it is alone: count it a freer from now.
        if !p.freers.contains(&stream) {
            p.freers.push(stream);
        }
        self.publish_sole(&p);
        Ok(())
    }

    /// A block of the range was freed on `stream` (and is about to go back to the range): every other
    /// allocator waits (on the device) for `stream`'s work so far. One atomic load when `stream` is the
    /// range's sole allocator.
    ///
    /// On an error (a capture: [`VmmError::Capturing`]; a device error that a synchronize could not
    /// replace) the block must not go back yet: the caller keeps it and frees it later.
    #[inline]
    pub fn freed(&self, pages: &PagePool, stream: StreamId) -> Result<(), VmmError> {
        if self.sole.load(Ordering::SeqCst) == stream {
            return Ok(());
        }
        self.freed_slow(pages, stream)
    }

    #[cold]
    fn freed_slow(&self, pages: &PagePool, stream: StreamId) -> Result<(), VmmError> {
        let mut p = self.parties.lock();
        for &a in p.allocators.iter().filter(|&&a| a != stream) {
            order(pages, a, stream)?;
        }
        if !p.freers.contains(&stream) {
            p.freers.push(stream);
        }
        Ok(())
    }

    /// `stream` allocates from a lazily ordered range: counted among its allocators ([`sole`](Self::sole)),
    /// with no ordering — every free into such a range is stamped, so the bytes a stream gets say whom it
    /// must wait for ([`before_use`](Self::before_use)).
    #[inline]
    pub fn join_lazily(&self, stream: StreamId) {
        if self.sole.load(Ordering::SeqCst) == stream {
            return;
        }
        let mut p = self.parties.lock();
        if !p.allocators.contains(&stream) {
            p.allocators.push(stream);
            self.publish_sole(&p);
        }
    }

    /// A block of a lazily ordered range was freed on `stream`: no device call; returns the stamp its bytes
    /// carry until they are allocated again ([`before_use`](Self::before_use)). Every free is stamped,
    /// the sole allocator's too (a stream that joins later learns from the stamps what to wait for).
    pub fn freed_lazily(&self, stream: StreamId) -> Stamp {
        let mut p = self.parties.lock();
        p.seq += 1;
        debug_assert!(p.seq <= SEQ_MASK);
        let now = p.seq;
        let slot = match p.slots.iter().position(|&(s, _)| s == stream) {
            Some(i) => {
                p.slots[i].1 = now;
                i
            }
            None => {
                p.slots.push((stream, now));
                p.slots.len() - 1
            }
        };
        Stamp((1u64 << (SEQ_BITS + (slot % BITS) as u32)) | (now & SEQ_MASK))
    }

    /// Whether [`before_use`](Self::before_use) of `stamp` by `stream` would need a device call (an
    /// ordering it does not have yet): what a capture, which cannot take one, must avoid.
    pub fn pending(&self, stream: StreamId, stamp: Stamp) -> bool {
        let p = self.parties.lock();
        let (at, row) = (stamp.seq(), p.row(stream));
        let bits = p.live_bits(stamp);
        Parties::named_in(bits, p.slots.len()).any(|i| p.owes(row, stream, at, i).is_some())
    }

    /// `stream` is about to use bytes of the range that carry `stamp`: it waits (on the device) for
    /// each stream named there that it has not waited for since that stream's stamped free. No device
    /// call for [`Stamp::NONE`], for bytes `stream` itself freed, or when it already waited.
    ///
    /// Fails only when a needed wait can be neither ordered on the device nor replaced by a synchronize
    /// (a capture: [`VmmError::Capturing`]; a device error): the caller must not use the bytes then.
    pub fn before_use(
        &self,
        pages: &PagePool,
        stream: StreamId,
        stamp: Stamp,
    ) -> Result<(), VmmError> {
        if stamp.is_none() {
            return Ok(());
        }
        let mut guard = self.parties.lock();
        let p = &mut *guard;
        let at = stamp.seq();
        let bits = p.live_bits(stamp);
        let mut row = p.row(stream);
        // One pass over the slots the stamp names (no list built: this runs for most blocks of a
        // shared arena); each ordering covers its own slot only, so none named earlier comes back.
        for i in Parties::named_in(bits, p.slots.len()) {
            let Some((s, need)) = p.owes(row, stream, at, i) else {
                continue;
            };
            // A fence of `s` recorded after the stamped free serves; else a new one.
            let covered = match p.fenced.get(i).copied().filter(|&(t, _)| t >= need) {
                Some((time, epoch)) => match pages.order_after_fence(stream, s, epoch) {
                    Ok(()) => time,
                    Err(e @ VmmError::Capturing(_)) => return Err(e),
                    Err(_) => {
                        order(pages, stream, s)?;
                        p.seq
                    }
                },
                None => {
                    let now = p.seq;
                    if let Some(epoch) = order(pages, stream, s)? {
                        *at_slot(&mut p.fenced, i) = (now, epoch);
                    }
                    now
                }
            };
            let r = *row.get_or_insert_with(|| {
                p.ordered.push((stream, Vec::new()));
                p.ordered.len() - 1
            });
            let done = at_slot(&mut p.ordered[r].1, i);
            *done = (*done).max(covered);
        }
        Ok(())
    }

    /// The stamp bits of the freers known busy now ([`PagePool::known_busy`]: a wait for one found it
    /// busy and its backoff has not run out), for an allocation that would rather take bytes that owe
    /// them nothing ([`owes_any_of`](Self::owes_any_of)). No device call while no stream is known
    /// busy; one `cuStreamQuery` for a freer whose backoff ran out.
    pub fn busy_bits(&self, pages: &PagePool) -> u64 {
        let p = self.parties.lock();
        pages.known_busy(p.slots.iter().map(|&(s, _)| s), |i| 1 << (i % BITS))
    }

    /// Whether `stream` would have to order itself after a freer whose bit is in `busy` to use bytes
    /// carrying `stamp` (no device call).
    pub fn owes_any_of(&self, stream: StreamId, stamp: Stamp, busy: u64) -> bool {
        let p = self.parties.lock();
        let bits = p.live_bits(stamp) & busy;
        if bits == 0 {
            return false;
        }
        let (at, row) = (stamp.seq(), p.row(stream));
        Parties::named_in(bits, p.slots.len()).any(|i| p.owes(row, stream, at, i).is_some())
    }

    /// Whether `stream` may take the fast paths (it is the only allocator).
    pub fn sole(&self) -> Option<StreamId> {
        match self.sole.load(Ordering::SeqCst) {
            NONE => None,
            s => Some(s),
        }
    }

    /// Everything queued so far has completed (the device was synchronized): earlier frees need no
    /// ordering any more. Allocators stay.
    pub fn synchronized(&self) {
        let mut p = self.parties.lock();
        let Parties {
            allocators,
            freers,
            seq,
            synced_seq,
            ..
        } = &mut *p;
        freers.retain(|f| allocators.contains(f));
        *synced_seq = *seq;
    }

    fn publish_sole(&self, p: &Parties) {
        let sole = match p.allocators.as_slice() {
            [only] => *only,
            _ => NONE,
        };
        self.sole.store(sole, Ordering::SeqCst);
    }
}

/// Slot `i` of a table indexed by freer slot, the table grown with empty entries (zero: nothing
/// recorded) to hold it.
fn at_slot<T: Default + Clone>(table: &mut Vec<T>, i: usize) -> &mut T {
    if table.len() <= i {
        table.resize(i + 1, T::default());
    }
    &mut table[i]
}

/// Make `stream` wait for `after`'s queued work: on the device (returns the fence's epoch), or, when the
/// device cannot order it (a failed event call), by a synchronize (`None`). A capture fails with
/// [`VmmError::Capturing`].
fn order(pages: &PagePool, stream: StreamId, after: StreamId) -> Result<Option<u64>, VmmError> {
    match pages.order_after(stream, after) {
        Ok(epoch) => Ok(epoch),
        Err(e @ VmmError::Capturing(_)) => Err(e),
        Err(e) => {
            log::warn!("gen-vmm: ordering stream {stream:#x} after {after:#x} on the device: {e}; synchronizing");
            pages.synchronize().map(|()| None)
        }
    }
}
