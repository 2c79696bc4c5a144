//! [`FreeList`]: a tagged Treiber stack over slot indices.

use crossbeam_utils::CachePadded;

use crate::chain::{Chain, Home};
use crate::links::{
    alloc_links, check_all, link_slice, pack, tagged_pop, tagged_pop_run, tagged_push_chain,
    unpack, NIL,
};
use crate::sync::{AtomicU32, AtomicU64, Ordering};
use crate::FreeListError;

/// A lock-free LIFO free list of slot indices `0..capacity`.
///
/// A tagged Treiber stack: the head is one `AtomicU64` holding the top index and a 32-bit version tag that
/// every push and pop bumps, and each slot has a `u32` link to the slot below it. Nothing is allocated after
/// construction, there is no unsafe code, and since slots are indices (not pointers) a stale read of a link
/// is harmless: the tag makes the CAS that would act on it fail.
///
/// Every operation is lock-free: [`pop`](Self::pop) and [`push`](Self::push) are one CAS when uncontended,
/// [`push_chain`](Self::push_chain) links a whole batch privately and publishes it with one CAS, and
/// [`take_all`](Self::take_all) detaches the whole stack with one atomic read-modify-write.
///
/// # Slot ownership
/// The list does not know which slots are free. A slot must be pushed only by the thread that owns it (it
/// popped it, or never handed it to the list): pushing a slot that is already on a list is a logic error.
/// It cannot cause undefined behaviour, but it can make the same slot come out of [`pop`](Self::pop) twice.
///
/// # ABA
/// A pop that stalls between reading the head and its CAS fails safely unless exactly `2^32` other pushes
/// and pops complete on this list in the meantime and leave the same slot on top.
pub struct FreeList {
    /// `tag << 32 | top`, `top == NIL` when empty.
    head: CachePadded<AtomicU64>,
    links: Box<[AtomicU32]>,
}

impl FreeList {
    /// An empty free list for slots `0..capacity`.
    ///
    /// # Errors
    /// [`FreeListError::CapacityTooLarge`] above [`MAX_CAPACITY`](crate::MAX_CAPACITY);
    /// [`FreeListError::OutOfMemory`] if the `4 * capacity` bytes of links cannot be allocated.
    pub fn new(capacity: usize) -> Result<Self, FreeListError> {
        Ok(Self {
            head: CachePadded::new(AtomicU64::new(pack(NIL, 0))),
            links: alloc_links(capacity, false)?,
        })
    }

    /// A free list holding every slot `0..capacity`; pops return `0, 1, 2, ...` in that order.
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn new_full(capacity: usize) -> Result<Self, FreeListError> {
        let top = if capacity == 0 { NIL } else { 0 };
        Ok(Self {
            head: CachePadded::new(AtomicU64::new(pack(top, 0))),
            links: alloc_links(capacity, true)?,
        })
    }

    /// The number of slots this list can index (`0..capacity`).
    #[inline]
    pub fn capacity(&self) -> usize {
        self.links.len()
    }

    /// Pushes slot `idx` (which the caller owns). Lock-free, never allocates.
    ///
    /// # Panics
    /// If `idx >= capacity()` (a `debug_assert!` names the precondition, the bounds check enforces it in
    /// release builds too). Use [`try_push`](Self::try_push) for untrusted indices.
    #[inline]
    pub fn push(&self, idx: u32) {
        debug_assert!(
            (idx as usize) < self.capacity(),
            "slot index {idx} out of range (capacity {})",
            self.capacity()
        );
        tagged_push_chain(&self.head, &self.links, idx, idx, bump);
    }

    /// Pushes slot `idx`, or reports it out of range.
    ///
    /// # Errors
    /// [`FreeListError::IndexOutOfRange`] if `idx >= capacity()`; nothing is pushed.
    #[inline]
    pub fn try_push(&self, idx: u32) -> Result<(), FreeListError> {
        check_all(&[idx], self.capacity())?;
        tagged_push_chain(&self.head, &self.links, idx, idx, bump);
        Ok(())
    }

    /// Pops the most recently pushed slot, or `None` if the list was empty when looked at.
    #[inline]
    pub fn pop(&self) -> Option<u32> {
        tagged_pop(&self.head, &self.links, |tag| tag.wrapping_add(1))
    }

    /// Pops up to `max` slots (≥ 1) with one successful CAS, in the order [`pop`](Self::pop) would return
    /// them; empty when the list was empty when looked at. Slots pushed in ascending order by
    /// [`push_chain`](Self::push_chain) come back as one run of neighbours.
    pub fn pop_run(&self, max: usize) -> Vec<u32> {
        let max = max.clamp(1, u32::MAX as usize) as u32;
        match tagged_pop_run(&self.head, &self.links, max, |tag| tag.wrapping_add(1)) {
            None => Vec::new(),
            Some((first, _, n)) => {
                // The chain is ours now: its links are stable.
                let mut out = Vec::with_capacity(n as usize);
                let mut at = first;
                for _ in 0..n {
                    out.push(at);
                    at = self.links[at as usize].load(Ordering::Relaxed);
                }
                out
            }
        }
    }

    /// Pushes the chain `first ..= last`, already linked through this list's links and owned by the
    /// caller (e.g. slots detached from a front cache's shard), with one successful CAS.
    pub(crate) fn push_linked(&self, first: u32, last: u32) {
        tagged_push_chain(&self.head, &self.links, first, last, bump);
    }

    /// Pushes every slot of `idxs` with one successful CAS: the slots are linked privately first, then the
    /// whole batch is published at once. Afterwards `idxs[0]` is on top (it pops first), `idxs[n-1]` lowest
    /// of the batch. An empty slice does nothing. The slots must be distinct and owned by the caller.
    ///
    /// # Panics
    /// If an index is `>= capacity()`; slots linked before the bad one are then neither pushed nor lost to
    /// other threads (they were never published). Use [`try_push_chain`](Self::try_push_chain) for
    /// untrusted indices.
    #[inline]
    pub fn push_chain(&self, idxs: &[u32]) {
        if let Some((first, last)) = link_slice(&self.links, idxs) {
            tagged_push_chain(&self.head, &self.links, first, last, bump);
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

    /// Detaches the whole stack with one atomic read-modify-write and returns it as a [`Chain`] (top
    /// first). Slots the chain has not yielded when it is dropped are pushed back.
    ///
    /// The RMW is a `fetch_or` that sets the top to "empty" and keeps the tag: the next push or pop bumps it,
    /// so a pop that read the old head still fails its CAS.
    #[inline]
    pub fn take_all(&self) -> Chain<'_> {
        let (top, _) = unpack(self.head.fetch_or(u64::from(NIL), Ordering::Acquire));
        Chain::new(&self.links, Home::Tagged(&self.head), top)
    }

    /// Whether the list was empty at the moment it was looked at (a racy snapshot).
    #[inline]
    pub fn is_empty(&self) -> bool {
        unpack(self.head.load(Ordering::Relaxed)).0 == NIL
    }

    /// The links, shared with the shard stacks of a [`crate::FrontCache`] built over this list.
    pub(crate) fn links(&self) -> &[AtomicU32] {
        &self.links
    }

    /// The tagged head word, for [`crate::FrontCache::flush_shards`].
    pub(crate) fn head(&self) -> &AtomicU64 {
        &self.head
    }
}

/// The tag update of a push: always accepted, tag + 1.
#[inline]
fn bump(tag: u32) -> Option<u32> {
    Some(tag.wrapping_add(1))
}

impl std::fmt::Debug for FreeList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FreeList")
            .field("capacity", &self.capacity())
            .field("is_empty", &self.is_empty())
            .finish()
    }
}
