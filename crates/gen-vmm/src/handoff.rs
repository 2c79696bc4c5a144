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
//! Pages need no more than this: a page freed in a region whose allocators all waited for S is covered by
//! their later fences, and a region of no stream of its own stamps its pages with S
//! ([`Region::decommit_for`](crate::Region::decommit_for)).

use std::sync::atomic::{AtomicU64, Ordering};

use gen_device::StreamId;
use parking_lot::Mutex;

use crate::{PagePool, VmmError};

/// No sole allocator: none yet, or several.
const NONE: u64 = u64::MAX;

/// Who allocates from a range and who freed into it. See the [module docs](self).
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
        let Parties { allocators, freers } = &mut *p;
        freers.retain(|f| allocators.contains(f));
    }

    fn publish_sole(&self, p: &Parties) {
        let sole = match p.allocators.as_slice() {
            [only] => *only,
            _ => NONE,
        };
        self.sole.store(sole, Ordering::SeqCst);
    }
}

/// Make `stream` wait for `after`'s queued work: on the device, or, when the device cannot order it
/// (a failed event call), by a synchronize. A capture fails with [`VmmError::Capturing`].
fn order(pages: &PagePool, stream: StreamId, after: StreamId) -> Result<(), VmmError> {
    match pages.order_after(stream, after) {
        Ok(()) => Ok(()),
        Err(e @ VmmError::Capturing(_)) => Err(e),
        Err(e) => {
            log::warn!("gen-vmm: ordering stream {stream:#x} after {after:#x} on the device: {e}; synchronizing");
            pages.synchronize()
        }
    }
}
