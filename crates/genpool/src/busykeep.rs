//! A busy stream's young generation: the blocks a stream known busy allocated and freed itself in the
//! arena the streams after the first share, kept for its own next allocation of the same size.
//!
//! The shared arena hands bytes one stream freed to another, ordered on the device; while the freeing
//! stream is busy (kernels always queued: a serving process), the receiver would wait for its whole
//! queue, so the others pass its leftovers over (`experimental.busy_freers:pass`, docs/ARCHITECTURE.md
//! "Busy serving streams"). Passing over needs bytes that owe nothing, and the arena finds them through
//! the stamps its free extents carry — at most four pieces an extent, so with many busy streams freeing
//! side by side their stamps merge and every candidate owes some busy stream (16 busy streams on the
//! simulator: half the waits stayed). A busy stream's own freed block owes nothing *to it*: stream order
//! makes its reuse on the same stream safe with no device call. So while a stream is known busy its
//! own-stream frees of shared-arena blocks stay out of the arena, here, and its next allocation of that
//! size takes one back — no placement, no page walk, no ordering: PyTorch's per-stream cache, for the
//! one case where genpool's sharing costs the device time.
//!
//! What a kept block costs is memory (its pages stay committed, and no other stream can use them — which
//! passing over costs anyway while the stream is busy), bounded: [`PER_STREAM`] blocks of at most
//! [`MAX_BLOCK`] bytes and [`STREAM_BYTES`] in all a stream, [`MAX_BYTES`] for all streams, the oldest
//! given back past that. Every block goes back to the arena on a trim (`empty_cache`), before sleep, on
//! the out-of-memory path, and at the first allocation that finds no stream known busy any more — not
//! before each growth, as the threads' caches (`tcache.rs`) go: while its stream is busy a kept block's
//! bytes and pages would only be passed over by the others. Nothing is kept during a capture, nor in a
//! replay (no stream is ever busy there: the golden test is unchanged). A stream destroyed while known busy (a question
//! about it then fails, which counts as busy) keeps its blocks until `empty_cache` or memory runs short —
//! as PyTorch's per-stream caches keep a destroyed stream's blocks: no allocator hears of a stream's end.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use gen_device::StreamId;
use parking_lot::Mutex;

use crate::tcache::Kept;

/// Blocks a stream keeps at most.
pub(crate) const PER_STREAM: usize = 4;
/// Largest block kept (bytes).
pub(crate) const MAX_BLOCK: u64 = 256 << 20;
/// Bytes a stream keeps at most.
pub(crate) const STREAM_BYTES: u64 = 512 << 20;
/// Bytes kept at most, all streams.
pub(crate) const MAX_BYTES: u64 = 4 << 30;

/// The blocks busy streams keep (see the [module docs](self)).
#[derive(Default)]
pub(crate) struct BusyKeep {
    /// Bytes kept now: read without the lock (0: nothing to take or drain), written under it.
    bytes: AtomicU64,
    /// Oldest first. Only a pool with busy streams takes this lock.
    kept: Mutex<Vec<Kept>>,
    /// Allocations served from a kept block.
    reuses: AtomicU64,
}

impl BusyKeep {
    /// Whether a block of `size` bytes may be kept (at most [`MAX_BLOCK`]).
    #[inline]
    pub(crate) fn fits(size: u64) -> bool {
        size <= MAX_BLOCK
    }

    /// Bytes kept now.
    #[inline]
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes.load(Relaxed)
    }

    /// Allocations served from a kept block so far.
    pub(crate) fn reuses(&self) -> u64 {
        self.reuses.load(Relaxed)
    }

    /// A block of exactly `size` bytes `stream` kept, taken out (the newest of its size).
    #[inline]
    pub(crate) fn take(&self, size: u64, stream: StreamId) -> Option<u64> {
        if self.bytes() == 0 {
            return None;
        }
        let mut kept = self.kept.lock();
        let i = kept
            .iter()
            .rposition(|k| k.size == size && k.stream == stream)?;
        let k = kept.remove(i);
        self.bytes.store(self.bytes() - k.size, Relaxed);
        self.reuses.fetch_add(1, Relaxed);
        Some(k.ptr)
    }

    /// Keep `block` (one that [`fits`](Self::fits)). Returns the blocks it pushed out — its stream's
    /// oldest past [`PER_STREAM`] or [`STREAM_BYTES`], then the oldest of any stream past
    /// [`MAX_BYTES`] — for the caller to give back to the arena.
    pub(crate) fn keep(&self, block: Kept) -> Vec<Kept> {
        debug_assert!(Self::fits(block.size));
        let mut kept = self.kept.lock();
        let mut bytes = self.bytes();
        let mut out = Vec::new();
        let mine = |kept: &[Kept]| {
            kept.iter()
                .filter(|k| k.stream == block.stream)
                .fold((0, 0), |(n, b), k| (n + 1, b + k.size))
        };
        // The stream's oldest, while it keeps as many blocks or bytes as it may.
        while let Some(i) = kept.iter().position(|k| k.stream == block.stream) {
            let (n, b) = mine(&kept);
            if n < PER_STREAM && b + block.size <= STREAM_BYTES {
                break;
            }
            let old = kept.remove(i);
            bytes -= old.size;
            out.push(old);
        }
        while !kept.is_empty() && bytes + block.size > MAX_BYTES {
            let old = kept.remove(0);
            bytes -= old.size;
            out.push(old);
        }
        kept.push(block);
        self.bytes.store(bytes + block.size, Relaxed);
        out
    }

    /// Every kept block, taken out (for the caller to give back to the arena).
    pub(crate) fn drain(&self) -> Vec<Kept> {
        if self.bytes() == 0 {
            return Vec::new();
        }
        let mut kept = self.kept.lock();
        self.bytes.store(0, Relaxed);
        std::mem::take(&mut *kept)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kept(ptr: u64, size: u64, stream: StreamId) -> Kept {
        Kept { ptr, size, stream }
    }

    #[test]
    fn takes_by_size_and_stream_only() {
        let b = BusyKeep::default();
        assert!(b.keep(kept(0x1000, 4 << 20, 1)).is_empty());
        assert!(b.keep(kept(0x9000, 8 << 20, 1)).is_empty());
        assert_eq!(b.bytes(), 12 << 20);
        assert_eq!(b.take(4 << 20, 2), None, "another stream's block");
        assert_eq!(b.take(6 << 20, 1), None, "another size");
        assert_eq!(b.take(4 << 20, 1), Some(0x1000));
        assert_eq!(b.take(4 << 20, 1), None, "taken once");
        assert_eq!((b.bytes(), b.reuses()), (8 << 20, 1));
        assert_eq!(b.drain(), vec![kept(0x9000, 8 << 20, 1)]);
        assert_eq!(b.bytes(), 0);
        assert!(b.drain().is_empty());
    }

    #[test]
    fn a_stream_keeps_its_newest_blocks_within_the_bounds() {
        let b = BusyKeep::default();
        for i in 0..PER_STREAM as u64 + 2 {
            let out = b.keep(kept(i << 30, 1 << 20, 7));
            if i < PER_STREAM as u64 {
                assert!(out.is_empty());
            } else {
                // The stream's oldest goes back.
                assert_eq!(out, vec![kept((i - PER_STREAM as u64) << 30, 1 << 20, 7)]);
            }
        }
        // Another stream's blocks are not pushed out by this one's.
        assert!(b.keep(kept(1 << 40, 1 << 20, 8)).is_empty());
        // Past a stream's bytes, its oldest go (stream 9: two blocks of 256 MiB fill its share).
        assert!(b.keep(kept(3 << 40, MAX_BLOCK, 9)).is_empty());
        assert!(b.keep(kept(4 << 40, MAX_BLOCK, 9)).is_empty());
        assert_eq!(
            b.keep(kept(5 << 40, 1 << 20, 9)),
            vec![kept(3 << 40, MAX_BLOCK, 9)]
        );
        assert_eq!(b.take(MAX_BLOCK, 9), Some(4 << 40), "the newer one stays");
        assert_eq!(b.take(1 << 20, 9), Some(5 << 40));
        assert_eq!(b.bytes(), (PER_STREAM as u64 + 1) << 20);
        // Past the bytes of all streams, the oldest of any stream.
        let many = MAX_BYTES / MAX_BLOCK;
        let mut back = 0;
        for s in 0..many {
            back += b.keep(kept((2 + s) << 40, MAX_BLOCK, 100 + s)).len();
        }
        assert!(b.bytes() <= MAX_BYTES);
        assert_eq!(back, PER_STREAM + 1, "the small blocks went first");
    }
}
