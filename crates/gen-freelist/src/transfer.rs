//! [`TransferStack`]: many producers push, one consumer takes everything at once.

use crossbeam_utils::CachePadded;

use crate::chain::{Chain, Home};
use crate::links::{alloc_links, check_all, link_slice, plain_push_chain, NIL};
use crate::sync::{AtomicU32, Ordering};
use crate::FreeListError;

/// A lock-free stack of slot indices with no single-slot pop: producers push (one CAS), a consumer detaches
/// everything with one `swap` ([`take_all`](Self::take_all)). The shape of sharded-slab's remote-free list.
///
/// Because nothing is ever popped individually, the head needs no ABA tag: a push's CAS only has to see the
/// same top it linked below its slot, and that top's identity is all that matters. So the head is a plain
/// `AtomicU32` and `take_all` is a single `swap` (wait-free). Use it where frees from other threads are
/// collected and later reclaimed in bulk by an owner (a slab page's remote frees, a deferred-free queue);
/// use [`crate::FreeList`] where any thread may pop.
///
/// Same slot-ownership rule as [`crate::FreeList`]: push only slots you own, never one already pushed.
pub struct TransferStack {
    head: CachePadded<AtomicU32>,
    links: Box<[AtomicU32]>,
}

impl TransferStack {
    /// An empty stack for slots `0..capacity`.
    ///
    /// # Errors
    /// [`FreeListError::CapacityTooLarge`] above [`MAX_CAPACITY`](crate::MAX_CAPACITY);
    /// [`FreeListError::OutOfMemory`] if the links cannot be allocated.
    pub fn new(capacity: usize) -> Result<Self, FreeListError> {
        Ok(Self {
            head: CachePadded::new(AtomicU32::new(NIL)),
            links: alloc_links(capacity, false)?,
        })
    }

    /// The number of slots this stack can index (`0..capacity`).
    #[inline]
    pub fn capacity(&self) -> usize {
        self.links.len()
    }

    /// Pushes slot `idx` (owned by the caller). Lock-free, never allocates.
    ///
    /// # Panics
    /// If `idx >= capacity()` (`debug_assert!` plus the bounds check). Use [`try_push`](Self::try_push)
    /// for untrusted indices.
    #[inline]
    pub fn push(&self, idx: u32) {
        debug_assert!(
            (idx as usize) < self.capacity(),
            "slot index {idx} out of range (capacity {})",
            self.capacity()
        );
        plain_push_chain(&self.head, &self.links, idx, idx);
    }

    /// Pushes slot `idx`, or reports it out of range.
    ///
    /// # Errors
    /// [`FreeListError::IndexOutOfRange`] if `idx >= capacity()`; nothing is pushed.
    #[inline]
    pub fn try_push(&self, idx: u32) -> Result<(), FreeListError> {
        check_all(&[idx], self.capacity())?;
        plain_push_chain(&self.head, &self.links, idx, idx);
        Ok(())
    }

    /// Pushes every slot of `idxs` with one successful CAS (`idxs[0]` ends on top). Empty: no-op.
    ///
    /// # Panics
    /// If an index is `>= capacity()`. Use [`try_push_chain`](Self::try_push_chain) for untrusted indices.
    #[inline]
    pub fn push_chain(&self, idxs: &[u32]) {
        if let Some((first, last)) = link_slice(&self.links, idxs) {
            plain_push_chain(&self.head, &self.links, first, last);
        }
    }

    /// [`push_chain`](Self::push_chain) after checking every index; nothing is pushed on error.
    ///
    /// # Errors
    /// [`FreeListError::IndexOutOfRange`] naming the first index `>= capacity()`.
    pub fn try_push_chain(&self, idxs: &[u32]) -> Result<(), FreeListError> {
        check_all(idxs, self.capacity())?;
        self.push_chain(idxs);
        Ok(())
    }

    /// Detaches every pushed slot with one `swap` and returns them, most recent first. Slots the chain has
    /// not yielded when dropped are pushed back.
    #[inline]
    pub fn take_all(&self) -> Chain<'_> {
        let top = self.head.swap(NIL, Ordering::Acquire);
        Chain::new(&self.links, Home::Plain(&self.head), top)
    }

    /// Whether the stack was empty at the moment it was looked at (a racy snapshot).
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.head.load(Ordering::Relaxed) == NIL
    }
}

impl std::fmt::Debug for TransferStack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferStack")
            .field("capacity", &self.capacity())
            .field("is_empty", &self.is_empty())
            .finish()
    }
}
