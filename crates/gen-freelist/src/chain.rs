//! [`Chain`]: the slots taken off a stack by one `take_all`.

use crate::links::{plain_push_chain, tagged_push_chain, NIL};
use crate::sync::{AtomicU32, AtomicU64, Ordering};

/// Where a [`Chain`] returns the slots it did not yield when it is dropped.
#[derive(Clone, Copy)]
pub(crate) enum Home<'a> {
    /// A tagged head ([`crate::FreeList`]); the tag is bumped by the push.
    Tagged(&'a AtomicU64),
    /// A plain head ([`crate::TransferStack`]).
    Plain(&'a AtomicU32),
}

/// The slots detached by one `take_all` ([`crate::FreeList::take_all`], [`crate::TransferStack::take_all`]),
/// yielded from the former top of the stack to its bottom.
///
/// The chain owns its slots: no other thread can see them any more. Each slot's link is read *before* the
/// slot is yielded, so the caller may push a yielded slot anywhere (even back onto the same stack) while it
/// keeps iterating.
///
/// Dropping a chain before it is exhausted pushes the slots it has not yielded back onto the stack they were
/// taken from (one walk to find the bottom, then one CAS), so no slot is ever lost.
///
/// A chain yields at most `capacity` slots: if a slot was pushed twice (a caller bug that makes the links
/// cyclic) iteration still ends, and the corrupted remainder is not pushed back.
pub struct Chain<'a> {
    links: &'a [AtomicU32],
    home: Home<'a>,
    /// The next slot to yield, or [`NIL`].
    cur: u32,
    /// How many more slots may be yielded (guards against cyclic links).
    budget: usize,
}

impl<'a> Chain<'a> {
    /// A chain starting at `top` over `links`, returning its remainder to `home` when dropped.
    pub(crate) fn new(links: &'a [AtomicU32], home: Home<'a>, top: u32) -> Self {
        Self {
            links,
            home,
            cur: top,
            budget: links.len(),
        }
    }

    /// The chain's next slot without consuming it.
    pub fn peek(&self) -> Option<u32> {
        (self.cur != NIL && self.budget > 0).then_some(self.cur)
    }
}

impl Iterator for Chain<'_> {
    type Item = u32;

    #[inline]
    fn next(&mut self) -> Option<u32> {
        if self.cur == NIL || self.budget == 0 {
            return None;
        }
        let idx = self.cur;
        // Read the link before handing `idx` out: afterwards the caller may push it and rewrite the link.
        self.cur = self.links[idx as usize].load(Ordering::Relaxed);
        self.budget -= 1;
        Some(idx)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        if self.cur == NIL {
            (0, Some(0))
        } else {
            (usize::from(self.budget > 0), Some(self.budget))
        }
    }
}

impl std::iter::FusedIterator for Chain<'_> {}

impl Drop for Chain<'_> {
    fn drop(&mut self) {
        let first = self.cur;
        if first == NIL {
            return;
        }
        // Find the bottom of the remainder. Its links are intact: nobody else owns these slots.
        let mut last = first;
        let mut budget = self.budget;
        loop {
            if budget == 0 {
                // Cyclic links (a slot was pushed twice): returning them would corrupt the stack.
                return;
            }
            budget -= 1;
            let next = self.links[last as usize].load(Ordering::Relaxed);
            if next == NIL {
                break;
            }
            last = next;
        }
        match self.home {
            Home::Tagged(head) => {
                tagged_push_chain(head, self.links, first, last, |tag| {
                    Some(tag.wrapping_add(1))
                });
            }
            Home::Plain(head) => plain_push_chain(head, self.links, first, last),
        }
    }
}

impl std::fmt::Debug for Chain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Chain")
            .field("next", &self.peek())
            .finish_non_exhaustive()
    }
}
