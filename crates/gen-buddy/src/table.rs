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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    #[test]
    fn insert_remove_reuse_and_full() {
        let t = RangeTable::new();
        assert!(!t.contains(0));
        let a = t.insert(0x1000, 0x100).unwrap();
        let b = t.insert(0x5000, 0x1000).unwrap();
        assert!(
            t.contains(0x1000) && t.contains(0x10ff) && !t.contains(0x1100) && !t.contains(0xfff)
        );
        assert!(t.contains(0x5fff) && !t.contains(0x6000));
        t.remove(a);
        assert!(!t.contains(0x1000) && t.contains(0x5000));
        assert_eq!(
            t.insert(0x9000, 0x10),
            Some(a),
            "a freed slot is reused first"
        );
        t.remove(a);
        t.remove(b);
        let slots: Vec<usize> = (0..MAX_REGIONS as u64)
            .map(|i| t.insert(i << 20, 1 << 20).unwrap())
            .collect();
        assert_eq!(t.insert(u64::MAX - 10, 1), None, "full");
        assert!(t.contains(((MAX_REGIONS as u64) << 20) - 1));
        t.remove(slots[7]);
        assert!(!t.contains(7 << 20));
        assert_eq!(t.insert(1 << 40, 1), Some(slots[7]));
        t.remove(MAX_REGIONS + 5); // out of range: ignored
    }

    /// One writer keeps rewriting slot 1 while readers check that the untouched range in slot 0 is
    /// always found and that they never see a torn pair (a range mixing two writes).
    #[test]
    fn readers_never_see_torn_ranges() {
        let t = Arc::new(RangeTable::new());
        t.insert(0x10_0000, 0x1000).unwrap();
        let slot = t.insert(0x20_0000, 0x10).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let rounds = if cfg!(miri) { 50 } else { 100_000 };
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let (t, stop) = (t.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut seen = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        assert!(t.contains(0x10_0800));
                        // Written ranges are (0x20_0000 + k·0x1_0000, 0x10) or (0x40_0000_0000, 0x1000_0000):
                        // a torn read (new base, old length) would make this probe hit.
                        assert!(!t.contains(0x40_0000_0000 + 0x20));
                        seen += t.contains(0x20_0000) as u64;
                    }
                    seen
                })
            })
            .collect();
        for k in 0..rounds {
            // Rewrite in place (no removal in between), so consecutive writes differ in both fields.
            if k % 2 == 0 {
                t.slots[slot].write(0x40_0000_0000, 0x10);
            } else {
                t.slots[slot].write(0x20_0000 + (k % 16) * 0x1_0000, 0x1000_0000);
            }
        }
        stop.store(true, Ordering::Relaxed);
        for r in readers {
            r.join().unwrap();
        }
    }
}
