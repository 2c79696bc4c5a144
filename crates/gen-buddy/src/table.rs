//! A fixed table of address ranges readable without a lock (for [`crate::Buddy::owns`]).
//!
//! Writers hold the buddy's mutex, so there is one writer at a time; each slot is a seqlock: the sequence
//! number is odd while the slot is being rewritten, and a reader retries when it saw an odd number or the
//! number changed under it. A slot is only rewritten when its region is created or released, so a reader
//! asking about a pointer inside a live block (whose region cannot go away) never waits.

use std::sync::atomic::{fence, AtomicU64, AtomicUsize, Ordering};

/// Most regions one buddy can hold at a time.
pub const MAX_REGIONS: usize = 64;

#[derive(Debug, Default)]
struct Slot {
    seq: AtomicU64,
    base: AtomicU64,
    /// 0 = slot unused.
    len: AtomicU64,
}

impl Slot {
    fn contains(&self, ptr: u64) -> bool {
        loop {
            let s1 = self.seq.load(Ordering::Acquire);
            if s1 & 1 == 0 {
                let base = self.base.load(Ordering::Relaxed);
                let len = self.len.load(Ordering::Relaxed);
                fence(Ordering::Acquire);
                if self.seq.load(Ordering::Relaxed) == s1 {
                    return ptr.wrapping_sub(base) < len;
                }
            }
            std::hint::spin_loop();
        }
    }

    /// Rewrite the slot. Callers are serialized by the buddy's mutex.
    fn write(&self, base: u64, len: u64) {
        let s = self.seq.load(Ordering::Relaxed);
        self.seq.store(s.wrapping_add(1), Ordering::Relaxed);
        fence(Ordering::Release);
        self.base.store(base, Ordering::Relaxed);
        self.len.store(len, Ordering::Relaxed);
        self.seq.store(s.wrapping_add(2), Ordering::Release);
    }
}

/// The address ranges of a buddy's regions.
#[derive(Debug)]
pub(crate) struct RangeTable {
    slots: [Slot; MAX_REGIONS],
    /// Slots `[0, used)` may be in use; readers scan only those.
    used: AtomicUsize,
}

impl RangeTable {
    pub(crate) fn new() -> Self {
        RangeTable {
            slots: std::array::from_fn(|_| Slot::default()),
            used: AtomicUsize::new(0),
        }
    }

    /// Whether any registered range contains `ptr`. Lock-free (see the module docs).
    pub(crate) fn contains(&self, ptr: u64) -> bool {
        let used = self.used.load(Ordering::Acquire).min(MAX_REGIONS);
        self.slots[..used].iter().any(|s| s.contains(ptr))
    }

    /// Register `[base, base + len)` (`len > 0`); returns the slot, or `None` when the table is full.
    /// Must be called with the owner's lock held.
    pub(crate) fn insert(&self, base: u64, len: u64) -> Option<usize> {
        let used = self.used.load(Ordering::Relaxed);
        let idx = (0..used)
            .find(|&i| self.slots[i].len.load(Ordering::Relaxed) == 0)
            .or((used < MAX_REGIONS).then_some(used))?;
        self.slots[idx].write(base, len);
        if idx == used {
            self.used.store(used + 1, Ordering::Release);
        }
        Some(idx)
    }

    /// Unregister the range in `slot`. Must be called with the owner's lock held.
    pub(crate) fn remove(&self, slot: usize) {
        if let Some(s) = self.slots.get(slot) {
            s.write(0, 0);
        }
    }
}
