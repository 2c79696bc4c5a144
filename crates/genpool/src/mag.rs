//! Per-thread magazines of freed slab blocks: the short-lived path with fewer of the slab's atomics.
//!
//! A slab block's free and its next allocation cost three locked instructions in the slab — the live
//! flag's swap at the free and a compare-and-swap on the thread's shard of the class's list at each —
//! and on 16 cores those lead the profile at 1 and at 16 threads (session 14). Here a thread that frees a
//! slab block keeps it, still live in the slab's eyes, in a small stack of its own per size class (its
//! [`crate::thread_slot`]), and its next allocation of that class on the same stream takes it back with
//! one swap of the stack's entry; the block's record is taken with a swap at the free
//! (`SlabBook::take_raw`, a load and a store before), now the arbiter of a double free racing the first.
//! Two locked instructions a pair instead of three, and no slab code at all.
//!
//! A stack's entries are whole words — the block's address with the stream it was freed on, as a small
//! tag, in the address's low bits (slab blocks are 512-byte aligned) — so any thread may empty any
//! magazine at any time by swapping entries out ([`Magazines::drain`]: a trim, the out-of-memory path,
//! sleep; before the pool grows, the growing thread's own): the owner takes an entry with a swap too, so each parked block goes
//! to exactly one of them. Only the owner pushes and keeps the stack's length; an entry a drain took
//! reads 0 and is skipped.
//!
//! Stream order makes the reuse safe, as for the slab's per-stream lists: a block is taken back only for
//! the stream it was freed on (during a capture too: the graph keeps the stream's order). The slab counts
//! a parked block as live, so the chunk under it stays committed until a drain: at most [`DEPTH`] blocks
//! per class and thread. Threads past [`crate::thread_slot::SLOTS`] (the shared slot) have no magazine,
//! and blocks freed on more than [`TAGS`] distinct streams of a pool go to the slab.

// Under `--cfg loom` the stacks' and tags' atomics come from loom (the model at the end checks the
// owner's and the drains' swaps); otherwise std's.
#[cfg(loom)]
use loom::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize};
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
#[cfg(not(loom))]
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize};
use std::sync::OnceLock;

use parking_lot::Mutex;

use crate::thread_slot::{Slot, SLOTS};

/// Blocks a magazine holds per size class.
pub(crate) const DEPTH: usize = 16;
/// Distinct streams whose frees a pool's magazines keep (tags `1..=TAGS` in an address's low bits).
pub(crate) const TAGS: usize = 63;
/// The low bits of a slab block's address (512-byte aligned) that carry the tag.
const TAG_MASK: u64 = 511;

/// One class's stack: entries `0..len` (the top last), each `address | tag` or 0 when a drain took it.
#[repr(align(64))]
struct Stack {
    /// Written by the owner only.
    len: AtomicU32,
    words: [AtomicU64; DEPTH],
}

impl Stack {
    fn new() -> Self {
        Stack {
            len: AtomicU32::new(0),
            words: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }

    /// The owner's park of `w` in entry `i` (0 there: past the top, or a hole a drain left). A plain
    /// store; under loom a swap, because loom mis-orders a plain store racing another thread's swap of
    /// the same atomic (tokio-rs/loom#254: the swap may read the old value and a later load still
    /// the older one) — a swap is what loom models faithfully, and in the memory model the store and
    /// the swap order the same way against a drain's swap.
    #[inline]
    fn park(&self, i: usize, w: u64) {
        #[cfg(not(loom))]
        self.words[i].store(w, Release);
        #[cfg(loom)]
        assert_eq!(self.words[i].swap(w, Release), 0, "parked over an entry");
    }
}

/// The streams a pool's magazines have seen, numbered from 1 in order of first sight, never removed.
struct StreamTags {
    ids: [AtomicU64; TAGS],
    count: AtomicUsize,
    reg: Mutex<()>,
}

impl StreamTags {
    fn new() -> Self {
        StreamTags {
            ids: std::array::from_fn(|_| AtomicU64::new(0)),
            count: AtomicUsize::new(0),
            reg: Mutex::new(()),
        }
    }

    /// `stream`'s tag, given one at its first sight; `None` once [`TAGS`] streams have one.
    #[inline]
    fn tag(&self, stream: u64) -> Option<u64> {
        self.known(stream).or_else(|| self.register(stream))
    }

    /// `stream`'s tag if it has one.
    #[inline]
    fn known(&self, stream: u64) -> Option<u64> {
        let n = self.count.load(Acquire);
        (0..n)
            .find(|&i| self.ids[i].load(Relaxed) == stream)
            .map(|i| i as u64 + 1)
    }

    #[cold]
    fn register(&self, stream: u64) -> Option<u64> {
        let _g = self.reg.lock();
        if let Some(t) = self.known(stream) {
            return Some(t);
        }
        let n = self.count.load(Acquire);
        if n == TAGS {
            return None;
        }
        self.ids[n].store(stream, Relaxed);
        // Release: a reader that sees the count sees the id.
        self.count.store(n + 1, Release);
        Some(n as u64 + 1)
    }

    /// The stream of tag `t` (given out by [`tag`](Self::tag)).
    fn stream(&self, t: u64) -> u64 {
        self.ids[(t - 1) as usize].load(Relaxed)
    }
}

/// The magazines of one pool, one per thread slot (made at the slot's first use).
pub(crate) struct Magazines {
    classes: usize,
    slots: Box<[OnceLock<Box<[Stack]>>]>,
    tags: StreamTags,
    /// `false`: no magazines (`magazines:false`).
    on: bool,
}

impl Magazines {
    /// Magazines for a slab of `classes` size classes; `on == false`: none (every call misses).
    pub(crate) fn new(classes: usize, on: bool) -> Self {
        Magazines {
            classes,
            slots: (0..SLOTS).map(|_| OnceLock::new()).collect(),
            tags: StreamTags::new(),
            on,
        }
    }

    /// The calling thread's stack of class `ci`.
    #[inline]
    fn stack(&self, me: Slot, ci: usize) -> Option<&Stack> {
        if !self.on || !me.own {
            return None;
        }
        self.slots
            .get(me.index)?
            .get_or_init(|| (0..self.classes).map(|_| Stack::new()).collect())
            .get(ci)
    }

    /// Park `addr` (a slab block of class `ci`, 512-byte aligned, just freed by the caller on `stream`)
    /// in the calling thread's magazine (`me`: its slot); `false` when there is no room (or no
    /// magazine): free it to the slab instead.
    #[inline]
    pub(crate) fn push(&self, me: Slot, ci: usize, addr: u64, stream: u64) -> bool {
        debug_assert_eq!(addr & TAG_MASK, 0, "slab blocks are 512-byte aligned");
        let Some(s) = self.stack(me, ci) else {
            return false;
        };
        // Only this thread writes the length (`me.own`): a plain load and store.
        let mut n = s.len.load(Relaxed) as usize;
        // Entries a drain took leave holes on top: reuse them.
        while n > 0 && s.words[n - 1].load(Relaxed) == 0 {
            n -= 1;
        }
        if n == DEPTH {
            s.len.store(n as u32, Relaxed);
            return false;
        }
        let Some(tag) = self.tags.tag(stream) else {
            s.len.store(n as u32, Relaxed);
            return false;
        };
        // Release: a drain that swaps the word out sees the block's record taken before it.
        s.park(n, addr | tag);
        s.len.store(n as u32 + 1, Relaxed);
        true
    }

    /// A block of class `ci` the calling thread parked on `stream`, taken back; `None` when its stack is
    /// empty or its top was freed on another stream.
    #[inline]
    pub(crate) fn pop(&self, me: Slot, ci: usize, stream: u64) -> Option<u64> {
        let s = self.stack(me, ci)?;
        let mut n = s.len.load(Relaxed) as usize;
        let got = loop {
            if n == 0 {
                break None;
            }
            let w = s.words[n - 1].load(Relaxed);
            if w == 0 {
                // Taken by a drain.
                n -= 1;
                continue;
            }
            if self.tags.stream(w & TAG_MASK) != stream {
                break None;
            }
            n -= 1;
            // A drain may take it between the load and here: the swap decides.
            if s.words[n].swap(0, Acquire) == w {
                break Some(w & !TAG_MASK);
            }
        };
        s.len.store(n as u32, Relaxed);
        got
    }

    /// Take every parked block out of every magazine (any thread may, at any time): `f(addr, stream)`
    /// for each, once. Returns how many.
    pub(crate) fn drain(&self, mut f: impl FnMut(u64, u64)) -> usize {
        self.slots
            .iter()
            .filter_map(OnceLock::get)
            .map(|stacks| self.take_all(stacks, &mut f))
            .sum()
    }

    /// [`drain`](Self::drain) of one magazine: the calling thread's (`me`).
    pub(crate) fn drain_mine(&self, me: Slot, mut f: impl FnMut(u64, u64)) -> usize {
        match self.slots.get(me.index).and_then(OnceLock::get) {
            Some(stacks) if me.own => self.take_all(stacks, &mut f),
            _ => 0,
        }
    }

    fn take_all(&self, stacks: &[Stack], f: &mut impl FnMut(u64, u64)) -> usize {
        let mut n = 0;
        for e in stacks.iter().flat_map(|s| s.words.iter()) {
            // A plain look first: most entries are empty.
            if e.load(Relaxed) == 0 {
                continue;
            }
            let w = e.swap(0, Acquire);
            if w != 0 {
                f(w & !TAG_MASK, self.tags.stream(w & TAG_MASK));
                n += 1;
            }
        }
        n
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn own(index: usize) -> Slot {
        Slot { index, own: true }
    }

    #[test]
    fn a_block_comes_back_only_on_its_stream_and_class_last_in_first_out() {
        let m = Magazines::new(3, true);
        let me = own(5);
        assert!(m.push(me, 1, 0x1000, 7));
        assert!(m.push(me, 1, 0x2000, 7));
        assert!(m.push(me, 2, 0x3000, 8));
        // Other class, other stream: nothing.
        assert_eq!(m.pop(me, 0, 7), None);
        assert_eq!(m.pop(me, 1, 8), None);
        // Another thread's slot: its own (empty) magazine.
        assert_eq!(m.pop(own(6), 1, 7), None);
        assert_eq!(m.pop(me, 1, 7), Some(0x2000));
        assert_eq!(m.pop(me, 1, 7), Some(0x1000));
        assert_eq!(m.pop(me, 1, 7), None);
        assert_eq!(m.pop(me, 2, 8), Some(0x3000));
        assert_eq!(m.drain(|a, s| panic!("empty, got {a:#x} on {s}")), 0);
    }

    #[test]
    fn a_full_stack_refuses_and_a_shared_slot_has_none() {
        let m = Magazines::new(1, true);
        for i in 0..DEPTH as u64 {
            assert!(m.push(own(0), 0, 0x1000 * (i + 1), 0));
        }
        assert!(!m.push(own(0), 0, 0xdead000, 0), "full");
        let shared = Slot {
            index: crate::thread_slot::SHARED_SLOT,
            own: false,
        };
        assert!(!m.push(shared, 0, 0x1000, 0));
        let off = Magazines::new(1, false);
        assert!(!off.push(own(0), 0, 0x1000, 0));
        assert_eq!(off.pop(own(0), 0, 0), None);
    }

    #[test]
    fn a_drain_takes_every_block_once_and_the_owner_goes_on() {
        let m = Magazines::new(2, true);
        assert!(m.push(own(1), 0, 0x1000, 3));
        assert!(m.push(own(1), 1, 0x2000, 4));
        assert!(m.push(own(2), 0, 0x5000, 3));
        let mut got = Vec::new();
        assert_eq!(m.drain(|a, s| got.push((a, s))), 3);
        got.sort_unstable();
        assert_eq!(got, [(0x1000, 3), (0x2000, 4), (0x5000, 3)]);
        // The owners find holes, skip them, and park again in their place.
        assert_eq!(m.pop(own(1), 0, 3), None);
        for i in 0..DEPTH as u64 {
            assert!(m.push(own(2), 0, 0x10000 * (i + 1), 3), "{i}");
        }
        assert_eq!(m.pop(own(2), 0, 3), Some(0x10000 * DEPTH as u64));
    }

    #[test]
    fn more_streams_than_tags_go_to_the_slab() {
        let m = Magazines::new(1, true);
        for s in 0..TAGS as u64 {
            assert!(m.push(own(0), 0, 0x1000, 100 + s));
            assert_eq!(m.pop(own(0), 0, 100 + s), Some(0x1000));
        }
        assert!(!m.push(own(0), 0, 0x1000, 7), "a stream past the tags");
        assert!(m.push(own(0), 0, 0x1000, 100), "a known one");
    }

    /// Owners popping and pushing while other threads drain: every block parked comes out exactly once,
    /// to its owner or to a drain.
    #[test]
    fn owners_and_drains_racing_never_take_a_block_twice() {
        let m = std::sync::Arc::new(Magazines::new(1, true));
        let rounds: u64 = if cfg!(miri) { 50 } else { 20_000 };
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let drained = std::sync::Arc::new(Mutex::new(Vec::new()));
        let drainer = {
            let (m, stop, drained) = (m.clone(), stop.clone(), drained.clone());
            std::thread::spawn(move || {
                while !stop.load(Relaxed) {
                    m.drain(|a, _| drained.lock().push(a));
                }
            })
        };
        let owners: Vec<_> = (0..2u64)
            .map(|t| {
                let m = m.clone();
                std::thread::spawn(move || {
                    let me = own(10 + t as usize);
                    let (mut mine, mut parked) = (Vec::new(), 0usize);
                    for i in 0..rounds {
                        let addr = ((t << 40) | (i + 1)) << 9;
                        if m.push(me, 0, addr, 1) {
                            parked += 1;
                        }
                        if i % 3 == 0 {
                            if let Some(a) = m.pop(me, 0, 1) {
                                mine.push(a);
                            }
                        }
                    }
                    (mine, parked)
                })
            })
            .collect();
        let (mut all, mut parked) = (Vec::new(), 0);
        for h in owners {
            let (mine, p) = h.join().unwrap();
            all.extend(mine);
            parked += p;
        }
        stop.store(true, Relaxed);
        drainer.join().unwrap();
        m.drain(|a, _| drained.lock().push(a));
        all.extend(drained.lock().iter());
        assert_eq!(all.len(), parked, "every block parked came out once");
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), parked, "a block came out twice");
    }
}

/// The magazine's race under the model checker: the owner taking and parking blocks while another
/// thread drains. `RUSTFLAGS="--cfg loom" cargo test --release -p genpool --lib loom_models` (.ci/run).
#[cfg(all(test, loom))]
mod loom_models {
    use super::*;

    #[test]
    fn the_owner_and_a_drain_take_each_block_once() {
        loom::model(|| {
            let m = loom::sync::Arc::new(Magazines::new(1, true));
            let me = Slot {
                index: 0,
                own: true,
            };
            assert!(m.push(me, 0, 0x1000, 1));
            assert!(m.push(me, 0, 0x2000, 1));
            let drain = {
                let m = m.clone();
                loom::thread::spawn(move || {
                    let mut got = Vec::new();
                    m.drain(|a, _| got.push(a));
                    got
                })
            };
            let mut all: Vec<u64> = m.pop(me, 0, 1).into_iter().collect();
            let third = m.push(me, 0, 0x3000, 1);
            all.extend(m.pop(me, 0, 1));
            all.extend(drain.join().unwrap());
            m.drain(|a, _| all.push(a));
            all.sort_unstable();
            let want: Vec<u64> = if third {
                vec![0x1000, 0x2000, 0x3000]
            } else {
                vec![0x1000, 0x2000]
            };
            assert_eq!(all, want, "every parked block exactly once");
        });
    }
}
