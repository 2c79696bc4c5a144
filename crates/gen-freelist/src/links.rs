//! The link array shared by every stack in the crate and the lock-free operations over a packed head word.
//!
//! A stack is a head word plus one `next` link per slot: `links[i]` holds the index of the slot below `i`,
//! or [`NIL`] at the bottom. Only the thread that owns slot `i` (it popped it, or it is about to push it)
//! writes `links[i]`, always before the `Release` CAS that publishes `i`; readers see it through the
//! `Acquire` load of the head that found `i` on top.
//!
//! The tagged head (`u64`) is `meta << 32 | idx`. `idx` is the top slot or [`NIL`]; `meta` changes on every
//! successful push or pop, so a pop whose snapshot `(idx, meta)` is still current when it CASes knows that
//! `idx` stayed on top the whole time and that the `next` it read is still `idx`'s link (the ABA answer of
//! the textbook Treiber stack with a version counter).

use crate::sync::{AtomicU32, AtomicU64, Ordering};
use crate::FreeListError;

/// The "no slot" index: marks an empty head and the bottom of a stack.
pub(crate) const NIL: u32 = u32::MAX;

/// Splits a tagged head word into `(idx, meta)`.
#[inline]
pub(crate) fn unpack(word: u64) -> (u32, u32) {
    (word as u32, (word >> 32) as u32)
}

/// Builds a tagged head word from `(idx, meta)`.
#[inline]
pub(crate) fn pack(idx: u32, meta: u32) -> u64 {
    (u64::from(meta) << 32) | u64::from(idx)
}

/// Allocates `capacity` links. With `full`, slot `i` links to `i + 1` (so a head at 0 pops 0, 1, 2, ...);
/// otherwise every link is [`NIL`]. Allocation failure is reported, never an abort.
pub(crate) fn alloc_links(capacity: usize, full: bool) -> Result<Box<[AtomicU32]>, FreeListError> {
    if capacity > crate::MAX_CAPACITY {
        return Err(FreeListError::CapacityTooLarge {
            requested: capacity,
            max: crate::MAX_CAPACITY,
        });
    }
    let mut links = Vec::new();
    links
        .try_reserve_exact(capacity)
        .map_err(|_| FreeListError::OutOfMemory { capacity })?;
    // `capacity <= MAX_CAPACITY = u32::MAX`, so every `i + 1 < capacity` fits in a `u32`.
    for i in 0..capacity {
        let next = if full && i + 1 < capacity {
            (i + 1) as u32
        } else {
            NIL
        };
        links.push(AtomicU32::new(next));
    }
    Ok(links.into_boxed_slice())
}

/// Pops the top slot of the tagged stack `head`; `next_meta` maps the old `meta` to the new one.
#[inline]
pub(crate) fn tagged_pop(
    head: &AtomicU64,
    links: &[AtomicU32],
    next_meta: impl Fn(u32) -> u32,
) -> Option<u32> {
    let mut cur = head.load(Ordering::Acquire);
    loop {
        let (top, meta) = unpack(cur);
        if top == NIL {
            return None;
        }
        // May be stale if `top` was popped and pushed again since `cur` was read; then `meta` changed
        // and the CAS below fails. `top < links.len()`: only checked indices are ever published.
        let next = links[top as usize].load(Ordering::Relaxed);
        match head.compare_exchange_weak(
            cur,
            pack(next, next_meta(meta)),
            Ordering::Acquire,
            Ordering::Acquire,
        ) {
            Ok(_) => return Some(top),
            Err(actual) => cur = actual,
        }
    }
}

/// Pops up to `max` (≥ 1) slots from the top of the tagged stack `head` with one successful CAS: returns
/// `(first, last, n)`, the popped chain `first -> ... -> last` of `n` slots as it was linked on the stack
/// (`links[last]` still names the slot below it: the caller relinks it), or `None` if the stack was empty.
/// `next_meta` maps the old `meta` to the new one.
///
/// The walk reads links of slots that are not the caller's yet: another thread may pop and push them
/// meanwhile, but then `meta` changed and the CAS fails, so a successful CAS means the chain walked was
/// the stack's top the whole time.
#[inline]
pub(crate) fn tagged_pop_run(
    head: &AtomicU64,
    links: &[AtomicU32],
    max: u32,
    next_meta: impl Fn(u32) -> u32,
) -> Option<(u32, u32, u32)> {
    let mut cur = head.load(Ordering::Acquire);
    loop {
        let (top, meta) = unpack(cur);
        if top == NIL {
            return None;
        }
        let (mut last, mut n) = (top, 1);
        // Every link ever stored is a checked index or NIL, so `last` stays in range.
        let mut next = links[last as usize].load(Ordering::Relaxed);
        while n < max && next != NIL {
            last = next;
            n += 1;
            next = links[last as usize].load(Ordering::Relaxed);
        }
        match head.compare_exchange_weak(
            cur,
            pack(next, next_meta(meta)),
            Ordering::Acquire,
            Ordering::Acquire,
        ) {
            Ok(_) => return Some((top, last, n)),
            Err(actual) => cur = actual,
        }
    }
}

/// Pushes the already linked chain `first ..= last` (whose bottom link, `links[last]`, this function sets)
/// onto the tagged stack `head` with one successful CAS. `next_meta` maps the old `meta` to the new one, or
/// returns `None` to refuse the push (a bounded stack that is full); then `false` is returned.
#[inline]
pub(crate) fn tagged_push_chain(
    head: &AtomicU64,
    links: &[AtomicU32],
    first: u32,
    last: u32,
    next_meta: impl Fn(u32) -> Option<u32>,
) -> bool {
    let mut cur = head.load(Ordering::Relaxed);
    loop {
        let (top, meta) = unpack(cur);
        let Some(meta) = next_meta(meta) else {
            return false;
        };
        links[last as usize].store(top, Ordering::Relaxed);
        match head.compare_exchange_weak(
            cur,
            pack(first, meta),
            Ordering::Release,
            Ordering::Relaxed,
        ) {
            Ok(_) => return true,
            Err(actual) => cur = actual,
        }
    }
}

/// Links `idxs[0] -> idxs[1] -> ... -> idxs[n-1]` (the bottom link is set by the push itself) and returns
/// `(first, last)`, or `None` for an empty slice.
///
/// # Panics
/// If an index is `>= links.len()`.
#[inline]
pub(crate) fn link_slice(links: &[AtomicU32], idxs: &[u32]) -> Option<(u32, u32)> {
    let (&first, &last) = (idxs.first()?, idxs.last()?);
    for pair in idxs.windows(2) {
        links[pair[0] as usize].store(pair[1], Ordering::Relaxed);
    }
    assert!(
        (last as usize) < links.len(),
        "slot index {last} out of range (capacity {})",
        links.len()
    );
    Some((first, last))
}

/// Returns the first index of `idxs` that is `>= capacity`, if any.
#[inline]
pub(crate) fn check_all(idxs: &[u32], capacity: usize) -> Result<(), FreeListError> {
    match idxs.iter().find(|&&i| i as usize >= capacity) {
        Some(&idx) => Err(FreeListError::IndexOutOfRange { idx, capacity }),
        None => Ok(()),
    }
}

/// Pushes the chain `first ..= last` (its inner links already set) onto the untagged stack `head`.
#[inline]
pub(crate) fn plain_push_chain(head: &AtomicU32, links: &[AtomicU32], first: u32, last: u32) {
    let mut top = head.load(Ordering::Relaxed);
    loop {
        links[last as usize].store(top, Ordering::Relaxed);
        match head.compare_exchange_weak(top, first, Ordering::Release, Ordering::Relaxed) {
            Ok(_) => return,
            Err(actual) => top = actual,
        }
    }
}
