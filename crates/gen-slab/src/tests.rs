//! Unit tests on [`SimDevice`]: errors, stream rules, reclaim, threads.

use std::collections::HashSet;
use std::sync::{mpsc, Arc};

use gen_device::{CallKind, Device, SimDevice};
use gen_vmm::{PagePool, PagePoolConfig};

use super::*;

const MIB: u64 = 1 << 20;

struct Fixture {
    dev: Arc<SimDevice>,
    pool: Arc<PagePool>,
    slab: Slab,
}

fn fixture(cfg: SlabConfig) -> Fixture {
    let dev = Arc::new(SimDevice::new());
    let pool = PagePool::new(dev.clone(), PagePoolConfig::default()).unwrap();
    let slab = Slab::new(&pool, dev.clone(), cfg).unwrap();
    Fixture { dev, pool, slab }
}

/// Under Miri fewer classes (powers of two), smaller spans and slot tables: `Slab::new` builds every
/// class's per-slot state slot by slot, which Miri runs thousands of times slower. 16 MiB still holds the
/// 3000 4 KiB blocks of the reclaim test, and 4096 slots are one chunk of the 512 B class.
fn small_cfg() -> SlabConfig {
    let miri = cfg!(miri);
    SlabConfig {
        classes_per_doubling: if miri { 1 } else { 4 },
        class_span: if miri { 16 * MIB } else { 64 * MIB },
        max_slots_per_class: if miri { 4096 } else { 1 << 14 },
        // Page-sized chunks: one class to a page, as these tests were written (the default's shared
        // pages have tests of their own below).
        chunk_bytes: 2 * MIB,
        ..SlabConfig::wide()
    }
}

/// The default classes (up to 4 KiB) and chunks (64 KiB: 32 to a page, shared by the classes), with
/// small spans (smaller still under Miri, as `small_cfg`).
fn shared_cfg() -> SlabConfig {
    let miri = cfg!(miri);
    SlabConfig {
        class_span: if miri { 16 * MIB } else { 64 * MIB },
        max_slots_per_class: if miri { 4096 } else { 1 << 14 },
        ..SlabConfig::default()
    }
}

#[test]
fn alloc_free_roundtrip_reuses_on_the_same_stream() {
    let f = fixture(small_cfg());
    let s = &f.slab;
    assert_eq!(s.max_size(), MIB);
    let p = s.alloc(1000, 0, true).unwrap();
    assert!(s.owns(p));
    assert_eq!(p % 512, 0);
    assert_eq!(s.free(p, 0).unwrap(), 1024);
    assert_eq!(
        s.alloc(1024, 0, true).unwrap(),
        p,
        "LIFO reuse on the same stream"
    );
    let q = s.alloc(1024, 0, true).unwrap();
    assert_ne!(p, q);
    assert_eq!(q.abs_diff(p), 1024, "slots of a chunk are packed");
    let st = s.stats();
    assert_eq!(st.live_blocks, 2);
    assert_eq!(st.live_bytes, 2048);
    assert_eq!(st.chunks_committed, 1);
    assert_eq!(st.committed_bytes, 2 * MIB);
    s.free(p, 0).unwrap();
    s.free(q, 0).unwrap();
    assert_eq!(s.stats().live_blocks, 0);
}

#[test]
fn bad_frees_are_typed_errors_and_change_nothing() {
    let f = fixture(small_cfg());
    let s = &f.slab;
    let p = s.alloc(4096, 0, true).unwrap();
    let inval = |r: Result<u64, TierError>| matches!(r, Err(TierError::InvalidFree { .. }));
    assert!(inval(s.free(p + 512, 0)), "interior pointer");
    assert!(inval(s.free(0x1234, 0)), "foreign pointer");
    assert!(
        inval(s.free(s.base.wrapping_sub(4096), 0)),
        "just below the slab"
    );
    let end = s.base + s.len;
    assert!(!s.owns(end) && inval(s.free(end, 0)), "just past the slab");
    assert!(
        inval(s.free(p + 4096, 0)),
        "a free slot that was never handed out"
    );
    // In the region, in a chunk no class holds.
    let c = &s.class[s.class_of(4096).unwrap().0];
    let unheld = s.base + (1 << s.chunk_shift);
    assert!(s.owns(unheld) && inval(s.free(unheld, 0)));
    assert_eq!(s.stats().live_blocks, 1);
    assert_eq!(s.free(p, 0).unwrap(), 4096);
    assert!(inval(s.free(p, 0)), "double free");
    assert!(inval(s.free(p, 7)), "double free on another stream");
    assert_eq!(s.stats().live_blocks, 0);
    // The slot is still usable, exactly once: handing out every slot of its chunk (the rest of the
    // carved run comes first, from the thread's shard) gives it back once.
    let n = c.slots_per_chunk as usize;
    let again: Vec<u64> = (0..n).map(|_| s.alloc(4096, 0, true).unwrap()).collect();
    assert_eq!(again.iter().filter(|&&q| q == p).count(), 1);
}

#[test]
fn unsupported_sizes_and_bad_configs_are_rejected() {
    let f = fixture(small_cfg());
    for size in [0, MIB + 1, u64::MAX] {
        assert!(matches!(
            f.slab.alloc(size, 0, true),
            Err(TierError::InvalidSize(_))
        ));
        assert_eq!(f.slab.class_of(size), None);
    }
    let bad = [
        SlabConfig {
            classes_per_doubling: 3,
            ..small_cfg()
        },
        SlabConfig {
            classes_per_doubling: 32,
            ..small_cfg()
        },
        SlabConfig {
            max_size: 0,
            ..small_cfg()
        },
        SlabConfig {
            class_span: 3 * MIB,
            ..small_cfg()
        },
        SlabConfig {
            class_span: MIB,
            ..small_cfg()
        },
        SlabConfig {
            class_span: 8 << 30,
            ..small_cfg()
        },
        SlabConfig {
            max_size: 128 * MIB,
            ..small_cfg()
        },
        SlabConfig {
            chunk_bytes: 128 * MIB,
            ..small_cfg()
        },
        SlabConfig {
            max_slots_per_class: 0,
            ..small_cfg()
        },
        SlabConfig {
            shard_capacity: 0,
            ..small_cfg()
        },
        SlabConfig {
            shard_capacity: 4096,
            ..small_cfg()
        },
    ];
    for cfg in bad {
        let r = Slab::new(&f.pool, f.dev.clone(), cfg.clone());
        assert!(
            matches!(r, Err(TierError::InvalidConfig(_))),
            "{cfg:?}: {r:?}"
        );
    }
}

#[test]
fn the_default_classes_share_one_page() {
    let f = fixture(shared_cfg());
    let s = &f.slab;
    assert_eq!(s.max_size(), 4096);
    assert_eq!(1u64 << s.chunk_shift, 64 << 10, "64 KiB chunks");
    // One block of every class: eight chunks, one page.
    let sizes = s.size_classes().sizes().to_vec();
    assert_eq!(sizes.len(), 8);
    let blocks: Vec<(u64, u64)> = sizes
        .iter()
        .map(|&z| (s.alloc(z, 0, true).unwrap(), z))
        .collect();
    let st = s.stats();
    assert_eq!(st.chunks_committed, 8);
    assert_eq!(
        st.committed_bytes,
        2 * MIB,
        "the classes' chunks share one page"
    );
    assert_eq!(f.pool.stats().pages_in_use, 1);
    // Each class's block starts its own chunk; every address maps back to its class and slot.
    let mut chunks = HashSet::new();
    for (ci, &(p, z)) in blocks.iter().enumerate() {
        assert_eq!((p - s.base) % (64 << 10), 0);
        assert!(chunks.insert(p >> 16));
        let (c, slot) = s.slot_of(p).unwrap();
        assert_eq!((c, s.slot_addr(c, slot)), (ci, p));
        assert_eq!(s.class_of(z).unwrap().0, ci);
    }
    // A class's next slots follow in its chunk.
    let (p0, z0) = blocks[5];
    let q = s.alloc(z0, 0, true).unwrap();
    assert_eq!(q, p0 + z0);
    s.free(q, 0).unwrap();
    for &(p, z) in &blocks {
        assert_eq!(s.free(p, 0).unwrap(), z);
    }
    s.set_one_stream(true);
    assert_eq!(s.reclaim().unwrap(), 2 * MIB);
    let st = s.stats();
    assert_eq!((st.chunks_committed, st.committed_bytes), (0, 0));
    assert_eq!(st.peak_committed_bytes, 2 * MIB);
}

#[test]
fn a_chunk_given_back_serves_another_class_and_old_addresses_are_no_blocks() {
    let f = fixture(shared_cfg());
    let s = &f.slab;
    s.set_one_stream(true);
    // 3072 B: 21 slots to a 64 KiB chunk, 1 KiB of tail.
    let a = s.alloc(3072, 0, true).unwrap();
    let b = s.alloc(3072, 0, true).unwrap();
    assert_eq!(b, a + 3072);
    let inval = |r: Result<u64, TierError>| matches!(r, Err(TierError::InvalidFree { .. }));
    assert!(
        inval(s.free(a + 21 * 3072, 0)),
        "the chunk's tail is no slot"
    );
    s.free(a, 0).unwrap();
    s.free(b, 0).unwrap();
    assert_eq!(s.reclaim().unwrap(), 2 * MIB);
    assert!(inval(s.free(b, 0)), "a chunk no class holds");
    assert_eq!(s.slot_of(a), None);
    // The 2 KiB class takes the lowest free chunk: the one just given back.
    let c = s.alloc(2048, 0, true).unwrap();
    assert_eq!(c, a, "the lowest chunk again, now the 2 KiB class's");
    assert_eq!(
        s.slot_of(c).map(|(ci, _)| ci),
        s.class_of(2048).map(|(ci, _)| ci)
    );
    assert!(inval(s.free(b, 0)), "3072 is no 2 KiB slot start");
    assert_eq!(s.free(c, 0).unwrap(), 2048);
    assert_eq!(s.stats().live_blocks, 0);
}

#[test]
fn chunk_sizes_follow_the_classes() {
    let page = 2 * MIB;
    let auto = |max_size: u64| {
        SlabConfig {
            max_size,
            ..SlabConfig::default()
        }
        .auto_chunk(page)
    };
    assert_eq!(auto(4 << 10), 64 << 10);
    assert_eq!(auto(512), 64 << 10);
    assert_eq!(auto(64 << 10), MIB);
    assert_eq!(auto(MIB), 2 * MIB, "a page: one class to a page");
    assert_eq!(auto(64 * MIB), 64 * MIB, "never below the largest class");
    let f = fixture(shared_cfg());
    for chunk_bytes in [96 << 10, 2 << 10, 128 * MIB] {
        let r = Slab::new(
            &f.pool,
            f.dev.clone(),
            SlabConfig {
                chunk_bytes,
                ..shared_cfg()
            },
        );
        assert!(
            matches!(r, Err(TierError::InvalidConfig(_))),
            "chunk_bytes {chunk_bytes}: not a power of two, below the largest class, above the span"
        );
    }
}

#[test]
fn would_grow_passes_up_and_nothing_changes() {
    let f = fixture(small_cfg());
    let s = &f.slab;
    assert!(matches!(
        s.alloc(512, 0, false),
        Err(TierError::WouldGrow { pages: 1 })
    ));
    assert_eq!(s.stats().committed_bytes, 0);
    assert_eq!(f.pool.stats().pages_held, 0);
    let p = s.alloc(512, 0, true).unwrap();
    // The rest of the chunk is served without growing.
    for _ in 0..100 {
        s.alloc(512, 0, false).unwrap();
    }
    assert_eq!(f.pool.stats().pages_held, 1);
    s.free(p, 0).unwrap();
}

#[test]
fn class_full_is_reported() {
    let cfg = SlabConfig {
        max_slots_per_class: 4096,
        ..small_cfg()
    };
    let f = fixture(cfg);
    let s = &f.slab;
    // Under Miri a class with fewer slots: 64 KiB, 256 slots in its 16 MiB span.
    let (size, capacity) = if cfg!(miri) {
        (64 << 10, 256)
    } else {
        (512, 4096)
    };
    let mut seen = HashSet::new();
    for _ in 0..capacity {
        assert!(seen.insert(s.alloc(size, 0, true).unwrap()));
    }
    assert!(matches!(
        s.alloc(size, 0, true),
        Err(TierError::Exhausted { requested, available: c, .. }) if requested == size && c == capacity
    ));
    // Another class is unaffected.
    s.alloc(1024, 0, true).unwrap();
    let p = *seen.iter().next().unwrap();
    s.free(p, 0).unwrap();
    assert_eq!(s.alloc(size, 0, true).unwrap(), p);
}

#[test]
fn a_single_stream_never_records_events() {
    let f = fixture(small_cfg());
    let s = &f.slab;
    let before = f.dev.calls();
    let mut live = Vec::new();
    // Under Miri fewer and smaller blocks (its classes have fewer slots: see `small_cfg`).
    let (n, spread) = if cfg!(miri) {
        (200, 64 << 10)
    } else {
        (2000, 256 << 10)
    };
    for i in 0..n {
        live.push(s.alloc(512 + (i * 977) % spread, 5, true).unwrap());
        if i % 3 == 0 {
            let p = live.swap_remove((i as usize * 7) % live.len());
            s.free(p, 5).unwrap();
        }
    }
    for p in live {
        s.free(p, 5).unwrap();
    }
    let d = f.dev.calls().since(&before);
    assert_eq!(d.get(CallKind::EventRecord), 0);
    assert_eq!(d.get(CallKind::EventCreate), 0);
    assert_eq!(d.get(CallKind::Synchronize), 0);
    assert_eq!(s.stats().migrations, 0);
}

#[test]
fn the_second_stream_makes_earlier_frees_safe_with_one_synchronize() {
    let f = fixture(small_cfg());
    let s = &f.slab;
    let t = f.dev.stream_create().unwrap();
    let p = s.alloc(MIB, 0, true).unwrap();
    let q = s.alloc(MIB, 0, true).unwrap();
    s.free(p, 0).unwrap();
    s.free(q, 0).unwrap();
    let before = f.dev.calls();
    let a = s.alloc(MIB, t, true).unwrap();
    let b = s.alloc(MIB, t, true).unwrap();
    assert_eq!(
        HashSet::from([a, b]),
        HashSet::from([p, q]),
        "reused, not new memory"
    );
    let d = f.dev.calls().since(&before);
    assert_eq!(d.get(CallKind::Synchronize), 1);
    assert_eq!(d.get(CallKind::EventRecord), 0);
    assert_eq!(s.stats().committed_bytes, 2 * MIB);
}

/// The stream rule: a block freed on a paused stream S is reused at once on S; on T only once T's work is
/// ordered after S's (T waits on an event recorded on S: `SimDevice::waits_on`) — no host wait.
#[test]
fn a_block_freed_on_a_paused_stream_waits_for_it() {
    let f = fixture(small_cfg());
    let s = &f.slab;
    let (s1, s2) = (
        f.dev.stream_create().unwrap(),
        f.dev.stream_create().unwrap(),
    );
    // Register both streams while nothing is paused; 1 MiB blocks: two per chunk.
    let a1 = s.alloc(MIB, s1, true).unwrap();
    let a2 = s.alloc(MIB, s1, true).unwrap();
    let z = s.alloc(MIB, s2, true).unwrap();
    s.free(z, s2).unwrap();
    let z = s.alloc(MIB, s2, true).unwrap();
    // A long kernel on s1 uses a1 and a2 (queued before their frees).
    f.dev.pause_stream(s1).unwrap();
    f.dev.memset_async(a1, 0, MIB, s1).unwrap();
    f.dev.memset_async(a2, 0, MIB, s1).unwrap();
    // Same stream: at once.
    s.free(a1, s1).unwrap();
    assert_eq!(s.alloc(MIB, s1, true).unwrap(), a1);
    s.free(a1, s1).unwrap();
    s.free(a2, s1).unwrap();
    assert!(!f.dev.waits_on(s2, s1));
    // Other stream: s1's free slots, but only with s2 ordered after s1's queued work.
    let before = f.dev.calls();
    let mut got = Vec::new();
    while !(got.contains(&a1) && got.contains(&a2)) {
        assert!(got.len() < 8, "s1's free blocks never reached s2: {got:x?}");
        got.push(s.alloc(MIB, s2, false).unwrap());
    }
    assert!(
        f.dev.waits_on(s2, s1),
        "s2 took blocks freed on paused s1 without waiting for it"
    );
    let d = f.dev.calls().since(&before);
    assert_eq!(d.get(CallKind::Synchronize), 0, "no host wait");
    assert_eq!(d.get(CallKind::EventSynchronize), 0, "no host wait");
    assert_eq!(d.get(CallKind::StreamWaitEvent), 1, "one batch, one wait");
    assert_eq!(s.stats().migrations, 1);
    assert_eq!(
        s.stats().pending_blocks,
        0,
        "nothing left pending on the host"
    );
    // s2's work now waits for s1: resuming s1 lets both complete.
    f.dev.resume_stream(s1).unwrap();
    assert!(!f.dev.waits_on(s2, s1));
    for p in got {
        s.free(p, s2).unwrap();
    }
    s.free(z, s2).unwrap();
    assert_eq!(s.stats().live_blocks, 0);
}

#[test]
fn reclaim_returns_empty_chunks_and_keeps_partial_ones() {
    let f = fixture(small_cfg());
    let s = &f.slab;
    // 4 KiB class: 512 slots per 2 MiB chunk; 3000 blocks = 6 chunks. Under Miri 64 KiB blocks, 32 a
    // chunk, 188 blocks = 6 chunks.
    let (size, per_chunk) = if cfg!(miri) {
        (64 << 10, 32)
    } else {
        (4096, 512)
    };
    let n = 5 * per_chunk + per_chunk * 7 / 8;
    let ptrs: Vec<_> = (0..n).map(|_| s.alloc(size, 0, true).unwrap()).collect();
    assert_eq!(s.stats().committed_bytes, 12 * MIB);
    assert_eq!(f.pool.stats().pages_in_use, 6);
    // Keep one block alive in the first chunk.
    let keep = ptrs[0];
    for &p in &ptrs[1..] {
        s.free(p, 0).unwrap();
    }
    let before = f.dev.calls();
    let released = s.reclaim().unwrap();
    assert_eq!(released, 10 * MIB);
    // Freed on one stream: decommitted stamped with it (the page layer orders their next user after
    // it), no synchronize.
    assert_eq!(f.dev.calls().since(&before).get(CallKind::Synchronize), 0);
    let st = s.stats();
    assert_eq!(
        (st.chunks_committed, st.committed_bytes, st.live_blocks),
        (1, 2 * MIB, 1)
    );
    assert_eq!(st.free_blocks, per_chunk - 1);
    assert_eq!(f.pool.stats().pages_in_use, 1);
    // Nothing left to reclaim; no further synchronize needed.
    assert_eq!(s.reclaim().unwrap(), 0);
    // Reuse: the free slots of the kept chunk first, then released chunks are recommitted.
    // Two chunks' worth but 24.
    let m = 2 * per_chunk - 24;
    let again: Vec<_> = (0..m).map(|_| s.alloc(size, 0, true).unwrap()).collect();
    let set: HashSet<_> = again.iter().copied().chain([keep]).collect();
    assert_eq!(set.len(), m as usize + 1);
    assert_eq!(s.stats().committed_bytes, 4 * MIB);
    for p in again.into_iter().chain([keep]) {
        s.free(p, 0).unwrap();
    }
    assert_eq!(s.reclaim().unwrap(), 4 * MIB);
    let st = s.stats();
    assert_eq!(
        (st.committed_bytes, st.chunks_committed, st.live_blocks),
        (0, 0, 0)
    );
    assert_eq!(st.peak_committed_bytes, 12 * MIB);
    assert_eq!(f.pool.stats().pages_in_use, 0);
}

#[test]
fn reclaim_of_safe_slots_needs_no_synchronize_and_unsafe_chunks_wait() {
    let f = fixture(small_cfg());
    let s = &f.slab;
    let t = f.dev.stream_create().unwrap();
    let p = s.alloc(1024, 0, true).unwrap();
    s.free(p, 0).unwrap();
    // A second stream: one synchronize moves p to the idle list.
    let x = s.alloc(2048, t, true).unwrap();
    let before = f.dev.calls();
    assert_eq!(s.reclaim().unwrap(), 2 * MIB, "the 1 KiB chunk is all idle");
    assert_eq!(f.dev.calls().since(&before).get(CallKind::Synchronize), 0);
    // A chunk whose slots were all freed on one paused stream goes without a synchronize, its pages
    // stamped with that stream: carved again for another stream, that stream waits for it first.
    f.dev.pause_stream(t).unwrap();
    let r = s.alloc(1 << 16, t, true).unwrap();
    f.dev.memset_async(r, 0, 1 << 16, t).unwrap();
    s.free(r, t).unwrap();
    let before = f.dev.calls();
    assert_eq!(s.reclaim().unwrap(), 2 * MIB);
    assert_eq!(f.dev.calls().since(&before).get(CallKind::Synchronize), 0);
    let r0 = s.alloc(1 << 16, 0, true).unwrap();
    assert_eq!(r0, r, "the class's first chunk is carved again");
    assert!(
        f.dev.waits_on(0, t),
        "stream 0 reuses t's pages ordered after t"
    );
    // The slots carved that way are stream 0's alone: t (paused) gets its own.
    let rt = s.alloc(1 << 16, t, true).unwrap();
    assert_ne!(rt, r0);
    s.free(r0, 0).unwrap();
    s.free(rt, t).unwrap();
    // A chunk with slots of two streams, one of them paused: the other waits on it, no host wait.
    f.dev.resume_stream(t).unwrap();
    let y = s.alloc(2048, 0, true).unwrap();
    f.dev.pause_stream(t).unwrap();
    s.free(y, 0).unwrap();
    s.free(x, t).unwrap();
    let before = f.dev.calls();
    s.reclaim().unwrap();
    let d = f.dev.calls().since(&before);
    assert_eq!(d.get(CallKind::Synchronize), 0);
    f.dev.resume_stream(t).unwrap();
    s.reclaim().unwrap();
    assert_eq!(s.stats().live_blocks, 0);
    assert_eq!(s.stats().committed_bytes, 0);
}

#[test]
fn reclaim_on_one_stream_decommits_without_synchronize() {
    let f = fixture(small_cfg());
    let s = &f.slab;
    // The owner says one stream is all there is: reclaim makes no synchronize and stamps nothing (the
    // page layer's one-stream fences order every reuse).
    s.set_one_stream(true);
    let p = s.alloc(1024, 0, true).unwrap();
    s.free(p, 0).unwrap();
    let before = f.dev.calls();
    assert_eq!(s.reclaim().unwrap(), 2 * MIB);
    assert_eq!(f.dev.calls().since(&before).get(CallKind::Synchronize), 0);
    assert_eq!(s.stats().committed_bytes, 0);
    assert_eq!(f.pool.stats().pages_in_use, 0);
    // Cleared again (a second stream appeared): chunks of one stream go stamped, still no synchronize;
    // a chunk whose slots sit in a pending batch (a host-polled migration) waits for one.
    s.set_one_stream(false);
    let p = s.alloc(1024, 0, true).unwrap();
    s.free(p, 0).unwrap();
    let before = f.dev.calls();
    assert_eq!(s.reclaim().unwrap(), 2 * MIB);
    assert_eq!(f.dev.calls().since(&before).get(CallKind::Synchronize), 0);
}

#[test]
fn stress_threads_alloc_here_free_there() {
    // 256 MiB per class: 4096 slots of the largest class. Blocks in flight between threads, and slots
    // parked on another stream's list until a migration, can exceed the 1024 of `small_cfg` in a
    // release build, where the threads interleave differently.
    let f = fixture(SlabConfig {
        max_size: 64 << 10,
        // Under Miri 100 steps per thread: 64 MiB is 1024 slots of the largest class.
        class_span: if cfg!(miri) { 64 * MIB } else { 256 * MIB },
        ..small_cfg()
    });
    let slab = Arc::new(f.slab);
    let t1 = f.dev.stream_create().unwrap();
    let threads = 4;
    let iters = if cfg!(miri) { 100 } else { 20_000 };
    let held = Arc::new(parking_lot::Mutex::new(HashSet::new()));
    let (txs, rxs): (Vec<_>, Vec<_>) = (0..threads).map(|_| mpsc::channel::<u64>()).unzip();
    let handles: Vec<_> = rxs
        .into_iter()
        .enumerate()
        .map(|(i, rx)| {
            let slab = slab.clone();
            let held = held.clone();
            let next = txs[(i + 1) % threads].clone();
            let stream = if i % 2 == 0 { 0 } else { t1 };
            std::thread::spawn(move || {
                let mut mine = Vec::new();
                let mut x = 0x9E37_79B9u64 + i as u64;
                for k in 0..iters {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let size = 1 + x % (64 << 10);
                    let p = slab.alloc(size, stream, true).unwrap();
                    assert!(held.lock().insert(p), "address {p:#x} handed out twice");
                    mine.push(p);
                    if k % 3 == 0 {
                        let q = mine.swap_remove((x >> 20) as usize % mine.len());
                        next.send(q).unwrap();
                    }
                    if mine.len() > 64 {
                        let q = mine.swap_remove((x >> 30) as usize % mine.len());
                        assert!(held.lock().remove(&q));
                        slab.free(q, stream).unwrap();
                    }
                    while let Ok(q) = rx.try_recv() {
                        assert!(held.lock().remove(&q));
                        slab.free(q, stream).unwrap();
                    }
                }
                (mine, rx)
            })
        })
        .collect();
    drop(txs);
    let leftovers: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    for (mine, rx) in leftovers {
        for q in mine.into_iter().chain(rx.try_iter()) {
            assert!(held.lock().remove(&q));
            slab.free(q, 0).unwrap();
        }
    }
    assert!(held.lock().is_empty());
    let st = slab.stats();
    assert_eq!(st.live_blocks, 0);
    assert!(st.free_blocks > 0);
    slab.reclaim().unwrap();
    let st = slab.stats();
    assert_eq!((st.committed_bytes, st.chunks_committed), (0, 0));
    assert_eq!(f.pool.stats().pages_in_use, 0);
}

#[test]
fn drop_returns_pages_and_events() {
    let f = fixture(small_cfg());
    let t = f.dev.stream_create().unwrap();
    let p = f.slab.alloc(MIB, 0, true).unwrap();
    let q = f.slab.alloc(MIB, 0, true).unwrap();
    f.slab.alloc(MIB, t, true).unwrap();
    f.slab.free(p, 0).unwrap();
    f.slab.free(q, t).unwrap();
    let Fixture { dev, pool, slab } = f;
    drop(slab);
    assert_eq!(pool.stats().pages_in_use, 0);
    assert_eq!(dev.outstanding().events, 0);
    assert_eq!(dev.outstanding().va_reservations, 0);
}

/// Single-thread alloc+free pair latency on the hot path (run with `--release -- --ignored`).
#[test]
#[ignore]
fn timing_alloc_free_pair() {
    let f = fixture(SlabConfig::wide());
    let s = &f.slab;
    let sizes = [512u64, 4096, 1536, 65536, 300_000];
    // Warm: commit a chunk per class.
    for &z in &sizes {
        let p = s.alloc(z, 0, true).unwrap();
        s.free(p, 0).unwrap();
    }
    let n = 10_000_000u64;
    let t0 = std::time::Instant::now();
    for i in 0..n {
        let p = s.alloc(sizes[(i % 5) as usize], 0, false).unwrap();
        s.free(std::hint::black_box(p), 0).unwrap();
    }
    let pair = t0.elapsed().as_nanos() as f64 / n as f64;
    // 8 live per class in flight: LIFO reuse across a small working set.
    let mut ring = [0u64; 8];
    for (i, r) in ring.iter_mut().enumerate() {
        *r = s.alloc(sizes[i % 5], 0, false).unwrap();
    }
    let t0 = std::time::Instant::now();
    for i in 0..n {
        let k = (i % 8) as usize;
        s.free(ring[k], 0).unwrap();
        ring[k] = s.alloc(sizes[(i % 5) as usize], 0, false).unwrap();
    }
    let ring_pair = t0.elapsed().as_nanos() as f64 / n as f64;
    println!("gen-slab: alloc+free pair {pair:.1} ns (immediate), {ring_pair:.1} ns (8 in flight)");
}

mod props;

/// Reference costs of the free-list primitives on this machine (run with `--release -- --ignored`).
#[test]
#[ignore]
fn timing_reference_primitives() {
    let n = 10_000_000u32;
    let fl = gen_freelist::FreeList::new(1024).unwrap();
    fl.push(1);
    let t0 = std::time::Instant::now();
    for _ in 0..n {
        let i = fl.pop().unwrap();
        fl.push(std::hint::black_box(i));
    }
    let a = t0.elapsed().as_nanos() as f64 / f64::from(n);
    let fc = FrontCache::new(1024, 2, 32).unwrap();
    fc.push(1);
    let t0 = std::time::Instant::now();
    for _ in 0..n {
        let i = fc.pop().unwrap();
        fc.push(std::hint::black_box(i));
    }
    let b = t0.elapsed().as_nanos() as f64 / f64::from(n);
    let x = AtomicU8::new(0);
    let t0 = std::time::Instant::now();
    for _ in 0..n {
        x.store(1, Relaxed);
        std::hint::black_box(x.swap(0, AcqRel));
    }
    let c = t0.elapsed().as_nanos() as f64 / f64::from(n);
    println!("FreeList pop+push {a:.1} ns, FrontCache pop+push {b:.1} ns, store+swap {c:.1} ns");
}

/// Short-path scaling: `T` threads, each alloc+free pairs of 512 B – 64 KiB with 16 live, stream 0
/// (run with `--release -- --ignored`; meaningful only on an otherwise idle machine).
#[test]
#[ignore]
fn timing_thread_scaling() {
    let f = fixture(SlabConfig::wide());
    let slab = Arc::new(f.slab);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pairs = 2_000_000u64;
    // disjoint: thread i uses only class i (no cache line shared between threads' slots).
    for disjoint in [false, true] {
        let mut base = 0.0;
        for threads in [1usize, 2, 4, 8, 16].into_iter().filter(|&t| t <= cores) {
            let barrier = Arc::new(std::sync::Barrier::new(threads + 1));
            let handles: Vec<_> = (0..threads)
                .map(|i| {
                    let slab = slab.clone();
                    let barrier = barrier.clone();
                    std::thread::spawn(move || {
                        let sizes = if disjoint {
                            [512 * (i as u64 + 1); 8]
                        } else {
                            [512u64, 4096, 1536, 65536, 20_000, 8192, 700, 30_000]
                        };
                        let mut ring: Vec<u64> = (0..16)
                            .map(|k| slab.alloc(sizes[(k + i) % 8], 0, true).unwrap())
                            .collect();
                        barrier.wait();
                        for k in 0..pairs as usize {
                            let j = k % 16;
                            slab.free(ring[j], 0).unwrap();
                            ring[j] = slab.alloc(sizes[(k + i) % 8], 0, true).unwrap();
                        }
                        for p in ring {
                            slab.free(p, 0).unwrap();
                        }
                    })
                })
                .collect();
            barrier.wait();
            let t0 = std::time::Instant::now();
            for h in handles {
                h.join().unwrap();
            }
            let rate = (threads as u64 * pairs) as f64 / t0.elapsed().as_secs_f64();
            if threads == 1 {
                base = rate;
            }
            println!(
            "gen-slab: {threads:2} threads{}: {:.1} M pairs/s ({:.1} ns/pair/thread, {:.2}x of 1 thread)",
            if disjoint { " (a class each)" } else { "" },
            rate / 1e6,
            threads as f64 * 1e9 / rate,
            rate / base
        );
        }
    }
}

/// A capture underway: the second stream's synchronize, migrations, event polls and reclaim wait; the
/// simulated driver sees no forbidden call (it would list it), and the capture ends valid.
#[test]
fn a_capture_makes_the_slab_defer_what_would_synchronize() {
    let f = fixture(small_cfg());
    let s = &f.slab;
    let (t, u) = (
        f.dev.stream_create().unwrap(),
        f.dev.stream_create().unwrap(),
    );
    // Frees on the first stream (0), then a capture of `t`, which the slab sees for the first time.
    let p = s.alloc(MIB, 0, true).unwrap();
    let q = s.alloc(MIB, 0, true).unwrap();
    s.free(p, 0).unwrap();
    s.free(q, 0).unwrap();
    f.dev.begin_capture(t).unwrap();
    f.dev.captures().begin();
    let a = s.alloc(MIB, t, true).unwrap();
    assert!(
        a != p && a != q,
        "stream 0's frees are not safe on t without the synchronize"
    );
    s.free(a, t).unwrap();
    assert_eq!(s.alloc(MIB, t, true).unwrap(), a, "t's own free, at once");
    assert_eq!(s.reclaim().unwrap(), 0, "reclaim waits");
    // Another stream, also new: no migration (its event could land in the graph).
    let b = s.alloc(MIB, u, true).unwrap();
    assert!(b != p && b != q);
    assert!(f.dev.captures().end());
    f.dev
        .end_capture()
        .expect("no forbidden call during the capture");
    assert!(f.dev.capture_violations().is_empty());
    assert_eq!(s.stats().migrations, 0);
    // After it, stream 0's frees reach the other streams again (under an event).
    s.free(b, u).unwrap();
    let mut got = HashSet::new();
    for _ in 0..3 {
        got.insert(s.alloc(MIB, u, true).unwrap());
    }
    assert!(
        got.contains(&p) || got.contains(&q),
        "migrated after the capture"
    );
}

/// Streams beyond the table (PyTorch's stream pool hands out 32 a priority): a free there makes no
/// device call until [`MIGRATE_BATCH`] have gathered on its stream, then one event for all of them; the
/// stream takes its own freed slots back at once; another stream gets them only once that event is
/// complete (the stream rule), here after the paused stream resumes.
#[test]
fn frees_beyond_the_stream_table_record_one_event_a_batch() {
    let f = fixture(small_cfg());
    let s = &f.slab;
    let streams: Vec<u64> = (0..STREAM_SLOTS + 2)
        .map(|_| f.dev.stream_create().unwrap())
        .collect();
    for &st in &streams {
        let p = s.alloc(4096, st, true).unwrap();
        s.free(p, st).unwrap();
    }
    let (u, v) = (streams[STREAM_SLOTS], streams[STREAM_SLOTS + 1]);
    f.dev.pause_stream(u).unwrap();
    let blocks: Vec<u64> = (0..MIGRATE_BATCH)
        .map(|_| s.alloc(4096, u, true).unwrap())
        .collect();
    let before = f.dev.calls();
    for &p in &blocks[..MIGRATE_BATCH - 1] {
        s.free(p, u).unwrap();
    }
    assert_eq!(f.dev.calls().since(&before).get(CallKind::EventRecord), 0);
    // Its own stream takes one back at once, with no device call.
    let again = s.alloc(4096, u, true).unwrap();
    assert_eq!(again, blocks[MIGRATE_BATCH - 2], "the slot it freed last");
    s.free(again, u).unwrap();
    s.free(blocks[MIGRATE_BATCH - 1], u).unwrap();
    let d = f.dev.calls().since(&before);
    assert_eq!(d.get(CallKind::EventRecord), 1, "one event for the batch");
    assert_eq!(d.get(CallKind::Synchronize), 0);
    assert_eq!(s.stats().pending_blocks, MIGRATE_BATCH as u64);
    // The event waits for u's paused work: v gets none of those slots meanwhile.
    let mut on_v: Vec<u64> = (0..MIGRATE_BATCH)
        .map(|_| s.alloc(4096, v, true).unwrap())
        .collect();
    assert!(
        on_v.iter().all(|p| !blocks.contains(p)),
        "a slot freed on u handed to v before u's work completed"
    );
    for p in on_v.drain(..) {
        s.free(p, v).unwrap();
    }
    f.dev.resume_stream(u).unwrap();
    // Complete now (and v's own batch, v being beyond the table too): both leave the pending list at
    // the next look (a reclaim's).
    assert_eq!(s.stats().pending_blocks, 2 * MIGRATE_BATCH as u64);
    s.reclaim_idle().unwrap();
    assert_eq!(s.stats().pending_blocks, 0);
}

/// A free on a stream beyond the table during a capture makes no device call (an event recorded there
/// would join the graph); the slot is reused by its own stream, and its batch's event comes after the
/// capture.
#[test]
fn a_free_beyond_the_stream_table_during_a_capture_makes_no_device_call() {
    let f = fixture(small_cfg());
    let s = &f.slab;
    let streams: Vec<u64> = (0..=STREAM_SLOTS)
        .map(|_| f.dev.stream_create().unwrap())
        .collect();
    let mut blocks = Vec::new();
    for &st in &streams {
        blocks.push((s.alloc(4096, st, true).unwrap(), st));
    }
    let (ptr, last) = *blocks.last().unwrap();
    let more: Vec<u64> = (0..MIGRATE_BATCH)
        .map(|_| s.alloc(4096, last, true).unwrap())
        .collect();
    f.dev.begin_capture(streams[0]).unwrap();
    f.dev.captures().begin();
    let before = f.dev.calls();
    assert_eq!(s.free(ptr, last).unwrap(), 4096);
    for &p in &more {
        s.free(p, last).unwrap();
    }
    assert_eq!(f.dev.calls().since(&before).get(CallKind::EventRecord), 0);
    assert_eq!(s.alloc(4096, last, true).unwrap(), more[MIGRATE_BATCH - 1]);
    assert!(
        matches!(s.free(ptr, last), Err(TierError::InvalidFree { .. })),
        "a double free is still refused"
    );
    assert!(f.dev.captures().end());
    f.dev.end_capture().unwrap();
    // After the capture the gathered batch takes its event at the next flush (a reclaim).
    s.reclaim().unwrap();
    assert_eq!(f.dev.calls().since(&before).get(CallKind::EventRecord), 1);
}

/// The stream rule with more streams than the table (four beyond it), under random allocations, frees,
/// pauses, resumes and reclaims: a slot freed on a stream whose work is still queued reaches another
/// stream only once that stream waits on it on the device; no slot is handed out twice. Seeded, so a
/// failure names its seed.
#[test]
#[cfg_attr(
    miri,
    ignore = "minutes under Miri (a free list per stream and class); the code it drives is safe Rust, \
              run natively by `cargo test`, and the two overflow tests above run under Miri"
)]
fn many_streams_keep_the_stream_rule_under_random_programs() {
    stream_rule_under_random_programs(small_cfg(), &[1024, 4096], 12);
}

/// The same with the default classes' 64 KiB chunks, which classes share pages in and hand to one
/// another: a chunk given back by one class's reclaim and taken by another class for another stream
/// must order that stream after the first one's queued work on those bytes — whichever address the new
/// blocks start at (the check is by overlapping bytes, not by address).
#[test]
#[cfg_attr(
    miri,
    ignore = "minutes under Miri (a free list per stream and class); the code it drives is safe Rust, \
              run natively by `cargo test`"
)]
fn chunks_passed_between_classes_keep_the_stream_rule() {
    stream_rule_under_random_programs(shared_cfg(), &[512, 1024, 1536, 3072, 4096], 12);
}

/// Random allocations (sizes from `sizes`), frees, pauses, resumes and reclaims over
/// `STREAM_SLOTS + 4` streams, `seeds` seeds: no slot handed out twice, and a block whose bytes
/// overlap bytes freed on a stream that is still paused since is handed to another stream only once
/// that stream waits on it.
fn stream_rule_under_random_programs(cfg: SlabConfig, sizes: &[u64], seeds: u64) {
    for seed in 1..=seeds {
        let f = fixture(cfg.clone());
        let s = &f.slab;
        let streams: Vec<u64> = (0..STREAM_SLOTS + 4)
            .map(|_| f.dev.stream_create().unwrap())
            .collect();
        let n = streams.len();
        let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = move |m: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % m
        };
        let mut paused = vec![false; n];
        // Bumped at each resume: a free made while paused is still queued iff the generation is the same.
        let mut resumed = vec![0u64; n];
        // Live blocks: (ptr, size, stream index).
        let mut live: Vec<(u64, u64, usize)> = Vec::new();
        // Freed byte ranges not reused since: (start, end, stream index, its resume generation if the
        // stream was paused).
        let mut freed: Vec<(u64, u64, usize, Option<u64>)> = Vec::new();
        for step in 0..3000 {
            match next(10) {
                0..=4 => {
                    let si = next(n as u64) as usize;
                    let size = sizes[next(sizes.len() as u64) as usize];
                    let p = s.alloc(size, streams[si], true).unwrap();
                    assert!(
                        !live.iter().any(|&(q, z, _)| q < p + size && p < q + z),
                        "seed {seed} step {step}: {p:#x} overlaps a live block"
                    );
                    // Freed ranges overlapping [p, p + size): checked, then cut down to what the new
                    // block leaves of them (so freed ranges never overlap one another).
                    let mut kept = Vec::with_capacity(freed.len() + 1);
                    for (q, end, fi, g) in std::mem::take(&mut freed) {
                        if end <= p || q >= p + size {
                            kept.push((q, end, fi, g));
                            continue;
                        }
                        if q < p {
                            kept.push((q, p, fi, g));
                        }
                        if end > p + size {
                            kept.push((p + size, end, fi, g));
                        }
                        if let Some(g) = g {
                            if fi != si && paused[fi] && resumed[fi] == g {
                                assert!(
                                    f.dev.waits_on(streams[si], streams[fi]),
                                    "seed {seed} step {step}: bytes at {q:#x} freed on paused \
                                     stream {fi} reached stream {si} at {p:#x} with no wait"
                                );
                            }
                        }
                    }
                    freed = kept;
                    // The block is used by its stream (queued work, incomplete while it is paused).
                    f.dev.memset_async(p, 0, size, streams[si]).unwrap();
                    live.push((p, size, si));
                }
                5..=7 if !live.is_empty() => {
                    let (p, size, si) = live.swap_remove(next(live.len() as u64) as usize);
                    s.free(p, streams[si]).unwrap();
                    freed.push((p, p + size, si, paused[si].then_some(resumed[si])));
                }
                8 => {
                    let si = next(n as u64) as usize;
                    if paused[si] {
                        f.dev.resume_stream(streams[si]).unwrap();
                        paused[si] = false;
                        resumed[si] += 1;
                    } else {
                        f.dev.pause_stream(streams[si]).unwrap();
                        paused[si] = true;
                    }
                }
                _ => {
                    let _ = s.reclaim_idle();
                }
            }
        }
        for (i, &st) in streams.iter().enumerate() {
            if paused[i] {
                f.dev.resume_stream(st).unwrap();
            }
        }
        for (p, _, si) in live {
            s.free(p, streams[si]).unwrap();
        }
        assert_eq!(s.stats().live_blocks, 0, "seed {seed}");
    }
}
