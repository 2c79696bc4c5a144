//! Per-thread caches of large blocks, for pools that several threads allocate from at once.
//!
//! Every extent-arena block goes through two locks — the arena's best fit and the page pool's commit —
//! so threads allocating large blocks at once queue on them: on the simulated device, PyTorch's
//! `torch_threads.py` pattern (4 KiB to 8 MiB, 16 live per thread) ran at 8.7 M pairs/s on one thread and
//! 2.2–2.6 M in all on two. Here a thread that frees a block it may soon ask for again (same size, same
//! stream) keeps it, with its pages, in a small cache of its own ([`crate::thread_slot`]'s slot: no other
//! thread takes that lock but to drain it), and its next allocation of that size on that stream takes it
//! back without either lock. Stream order makes the reuse safe, as for a tier's own-stream reuse.
//!
//! What a cached block costs is memory: its pages stay committed, and best fit cannot use its range
//! (measured in session 9: exact-size caches on one thread lost on every trace, in ratio and ns/op). So
//! the caches engage only once `threads` distinct threads have allocated large blocks from the pool
//! (`thread_caches`, default 3: PyTorch's own training loop allocates from two — the main thread and the
//! autograd engine's — which take turns; a third means threads that allocate at once), hold at most
//! [`ENTRIES`] blocks of at most [`MAX_BLOCK`] bytes and [`MAX_BYTES`] in all per thread, and are
//! drained — every block back to its tier — before the pool would create a page, on a trim
//! (`empty_cache`), before sleep, and on the out-of-memory path.

use std::sync::atomic::{
    AtomicBool, AtomicU64,
    Ordering::{AcqRel, Acquire, Relaxed},
};

use crossbeam_utils::CachePadded;
use gen_device::StreamId;
use parking_lot::Mutex;

use crate::thread_slot::{self, SLOTS};

/// Blocks a thread keeps at most.
pub(crate) const ENTRIES: usize = 4;
/// Largest block kept (bytes).
pub(crate) const MAX_BLOCK: u64 = 64 << 20;
/// Bytes a thread keeps at most.
pub(crate) const MAX_BYTES: u64 = 128 << 20;

/// A block kept for its thread's next allocation of its size on its stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Kept {
    pub(crate) ptr: u64,
    pub(crate) size: u64,
    pub(crate) stream: StreamId,
}

/// One thread's cache: its blocks behind a lock only a drain takes besides the thread, and their bytes
/// beside it (read without the lock by drains and statistics).
#[derive(Default)]
struct Cache {
    bytes: AtomicU64,
    /// Oldest first.
    kept: Mutex<Vec<Kept>>,
}

/// The caches of one pool (see the [module docs](self)).
pub(crate) struct ThreadCaches {
    /// Engage from this many allocating threads on (0: never).
    threads: u32,
    /// Which thread slots have allocated large blocks (bit per slot; the shared slot is bit 63's
    /// neighbour and counts as one more).
    seen: AtomicU64,
    on: AtomicBool,
    /// One per thread slot, each on lines of its own: keeping and taking write nothing another thread
    /// writes.
    caches: Box<[CachePadded<Cache>]>,
}

impl ThreadCaches {
    pub(crate) fn new(threads: u32) -> Self {
        ThreadCaches {
            threads,
            seen: AtomicU64::new(0),
            on: AtomicBool::new(false),
            caches: (0..=SLOTS)
                .map(|_| CachePadded::new(Cache::default()))
                .collect(),
        }
    }

    /// The calling thread allocates a large block: count it among the pool's allocating threads.
    #[inline]
    pub(crate) fn note_thread(&self) {
        if self.threads == 0 || self.on.load(Relaxed) {
            return;
        }
        let slot = thread_slot::mine();
        // The shared slot (threads past the owned ones) counts as slot 63: enough to reach a threshold.
        let bit = 1u64 << slot.index.min(63);
        let seen = self.seen.load(Relaxed);
        if seen & bit != 0 {
            return;
        }
        let now = self.seen.fetch_or(bit, AcqRel) | bit;
        if now.count_ones() >= self.threads {
            self.on.store(true, Relaxed);
            log::debug!(
                "genpool: {} threads allocate large blocks: per-thread caches on",
                now.count_ones()
            );
        }
    }

    /// Whether the caches are engaged.
    #[inline]
    pub(crate) fn on(&self) -> bool {
        self.on.load(Relaxed)
    }

    /// Whether a block whose record names `thread` (see `Meta::thread`) is the calling thread's own: a
    /// thread keeps only blocks it allocated (one that frees what others allocate — a consumer — would
    /// keep blocks it never asks for, and their pages away from everyone else).
    #[inline]
    pub(crate) fn mine(&self, thread: u8) -> bool {
        let me = thread_slot::mine();
        me.own && usize::from(thread) == me.index
    }

    /// Bytes kept now (all threads).
    pub(crate) fn bytes(&self) -> u64 {
        if !self.on() {
            return 0;
        }
        self.caches.iter().map(|c| c.bytes.load(Relaxed)).sum()
    }

    /// A block of exactly `size` bytes the calling thread kept for `stream`, taken out of its cache.
    #[inline]
    pub(crate) fn take(&self, size: u64, stream: StreamId) -> Option<u64> {
        let c = &self.caches[thread_slot::mine().index];
        let mut kept = c.kept.lock();
        let i = kept
            .iter()
            .rposition(|k| k.size == size && k.stream == stream)?;
        let k = kept.remove(i);
        c.bytes.store(c.bytes.load(Relaxed) - k.size, Relaxed);
        Some(k.ptr)
    }

    /// Whether a block of `size` bytes may be kept (at most [`MAX_BLOCK`]).
    #[inline]
    pub(crate) fn fits(size: u64) -> bool {
        size <= MAX_BLOCK
    }

    /// Keep `block` (one that [`fits`](Self::fits)) in the calling thread's cache. Returns the blocks it
    /// pushed out (the oldest, past [`ENTRIES`] or [`MAX_BYTES`]), for the caller to give back.
    pub(crate) fn keep(&self, block: Kept) -> Vec<Kept> {
        debug_assert!(Self::fits(block.size));
        let c = &self.caches[thread_slot::mine().index];
        let mut kept = c.kept.lock();
        // Under the lock, so a plain store: only the lock's holder changes it.
        let mut bytes = c.bytes.load(Relaxed);
        let mut out = Vec::new();
        while !kept.is_empty() && (kept.len() >= ENTRIES || bytes + block.size > MAX_BYTES) {
            let old = kept.remove(0);
            bytes -= old.size;
            out.push(old);
        }
        kept.push(block);
        c.bytes.store(bytes + block.size, Relaxed);
        out
    }

    /// Every kept block of every thread, taken out (for the caller to give back to its tier).
    pub(crate) fn drain(&self) -> Vec<Kept> {
        if !self.on() {
            return Vec::new();
        }
        let mut out = Vec::new();
        for c in self.caches.iter() {
            if c.bytes.load(Acquire) == 0 {
                continue;
            }
            let mut kept = c.kept.lock();
            c.bytes.store(0, Relaxed);
            out.append(&mut kept);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kept(ptr: u64, size: u64, stream: StreamId) -> Kept {
        Kept { ptr, size, stream }
    }

    #[test]
    fn engages_at_the_thread_count_and_keeps_by_size_and_stream() {
        use std::sync::{Arc, Barrier};
        let t = Arc::new(ThreadCaches::new(3));
        t.note_thread();
        assert!(!t.on(), "one thread");
        // The second thread stays alive (an exited thread's slot is claimed again by the next one).
        let (noted, done) = (Arc::new(Barrier::new(2)), Arc::new(Barrier::new(2)));
        let (t2, n2, d2) = (t.clone(), noted.clone(), done.clone());
        let second = std::thread::spawn(move || {
            t2.note_thread();
            n2.wait();
            d2.wait();
        });
        noted.wait();
        t.note_thread();
        assert!(!t.on(), "two threads (PyTorch's main and autograd threads)");
        let t3 = t.clone();
        std::thread::spawn(move || t3.note_thread()).join().unwrap();
        assert!(t.on(), "a third thread");
        done.wait();
        second.join().unwrap();

        assert_eq!(t.keep(kept(0x1000, 1 << 20, 7)), vec![]);
        assert_eq!(t.take(1 << 20, 8), None, "another stream");
        assert_eq!(t.take(2 << 20, 7), None, "another size");
        let t4 = t.clone();
        assert_eq!(
            std::thread::spawn(move || t4.take(1 << 20, 7))
                .join()
                .unwrap(),
            None,
            "another thread's cache"
        );
        assert_eq!(t.bytes(), 1 << 20);
        assert_eq!(t.take(1 << 20, 7), Some(0x1000));
        assert_eq!(t.take(1 << 20, 7), None, "taken once");
        assert_eq!(t.bytes(), 0);
    }

    #[test]
    fn bounded_by_entries_bytes_and_block_size_and_drained_whole() {
        let t = ThreadCaches::new(1);
        t.note_thread();
        assert!(t.on());
        assert!(!ThreadCaches::fits(MAX_BLOCK + 512));
        assert!(ThreadCaches::fits(MAX_BLOCK));
        for i in 0..ENTRIES as u64 {
            assert_eq!(t.keep(kept(0x10 + i, 4096, 0)), vec![]);
        }
        // One more pushes the oldest out.
        assert_eq!(t.keep(kept(0x99, 4096, 0)), vec![kept(0x10, 4096, 0)]);
        // Bytes: two 64 MiB blocks fill it; the rest go.
        let out = t.keep(kept(0xA0, MAX_BLOCK, 0));
        assert_eq!(out.len(), 1);
        let out = t.keep(kept(0xB0, MAX_BLOCK, 0));
        assert_eq!(out.len(), ENTRIES - 1, "{out:?}");
        assert_eq!(t.bytes(), 2 * MAX_BLOCK);
        let all = t.drain();
        assert_eq!(
            all,
            vec![kept(0xA0, MAX_BLOCK, 0), kept(0xB0, MAX_BLOCK, 0)]
        );
        assert_eq!(t.bytes(), 0);
        assert!(t.drain().is_empty());
    }

    #[test]
    fn zero_threads_never_engages() {
        let t = ThreadCaches::new(0);
        t.note_thread();
        assert!(!t.on());
    }
}
