//! The engine on a real GPU. `#[ignore]`d here (no GPU in CI); run on the GPU machine with
//! `--include-ignored`. With no CUDA driver or device each test fails saying why.

use std::sync::Arc;

use gen_device::{Device, EventHandle, StreamId};
use genpool::{Block, Config, GenpoolError, Hint, Lifetime, Pool, Tier};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// The slow work queued on stream A by the stream-order tests: [`SLOW_REPS`] memsets of a
/// [`SLOW_BYTES`] buffer (32 GiB written: about 10 ms on an H200), so that work queued on B right after
/// runs while A is still busy.
const SLOW_BYTES: u64 = 2 * GIB;
/// See [`SLOW_BYTES`].
const SLOW_REPS: usize = 16;
/// The pattern stream A writes into block X after its slow work.
const PAT_A: u8 = 0xA1;
/// The pattern stream B writes into the block it was given.
const PAT_B: u8 = 0xB2;

/// `all_tiers_serve_real_memory`'s pools, each with the tier its mid-lived blocks must come from: the
/// extent arena, then the driver pool.
const ALL_TIERS_CONFS: [(&str, Tier); 2] = [
    (
        "experimental.mid_tier:extent,experimental.long_tier:buddy,slab_max_size:1M",
        Tier::Extent,
    ),
    (
        "experimental.mid_tier:stream,experimental.long_tier:buddy,slab_max_size:1M",
        Tier::Stream,
    ),
];
/// `capped_pool_out_of_memory_recovers`'s pool.
const CAPPED_CONF: &str = "limit:256M";
/// A stream-order case: the pool's configuration, the block's size, its lifetime hint, the tier it must
/// come from.
type Case = (&'static str, u64, Lifetime, Tier);
/// `cross_stream_reuse_waits_for_work_on_the_freeing_stream`: each tier.
const REUSE_CASES: [Case; 4] = [
    ("", 4096, Lifetime::Short, Tier::Slab),
    ("", 8 * MIB, Lifetime::Short, Tier::Extent),
    (
        "experimental.long_tier:buddy",
        MIB,
        Lifetime::Long,
        Tier::Buddy,
    ),
    (
        "experimental.mid_tier:stream",
        MIB,
        Lifetime::Mid,
        Tier::Stream,
    ),
];
/// `foreign_free_orders_the_arena_stream_after_the_last_user`: the first stream's arena, one arena every
/// stream shares, the buddy.
const FOREIGN_FREE_CASES: [Case; 3] = [
    ("", 8 * MIB, Lifetime::Short, Tier::Extent),
    (
        "experimental.stream_arenas:first",
        8 * MIB,
        Lifetime::Short,
        Tier::Extent,
    ),
    (
        "experimental.long_tier:buddy",
        MIB,
        Lifetime::Long,
        Tier::Buddy,
    ),
];

/// Runs everywhere (no device): every configuration the GPU tests build a pool with parses, so a key
/// renamed in the configuration surface fails in CI rather than first on the GPU machine (as the mid
/// tier's did, found on an H100 in session 13).
#[test]
fn the_gpu_tests_configurations_parse() {
    let confs = ALL_TIERS_CONFS
        .iter()
        .map(|c| c.0)
        .chain([CAPPED_CONF])
        .chain(REUSE_CASES.iter().map(|c| c.0))
        .chain(FOREIGN_FREE_CASES.iter().map(|c| c.0));
    for conf in confs {
        if let Err(e) = Config::parse(conf) {
            panic!("'{conf}' does not parse: {e}");
        }
    }
}

/// Device 0 ([`gen_device::testing::cuda_device`]: with none, the calling test fails saying why).
fn device() -> Arc<dyn Device> {
    Arc::new(gen_device::testing::cuda_device())
}

fn hint(l: Lifetime) -> Hint {
    Hint {
        lifetime: Some(l),
        site: None,
    }
}

/// Every tier hands out real device memory: a pattern written to each block reads back intact, and
/// all memory returns after the blocks are freed and the pool trimmed.
#[test]
#[ignore = "needs a CUDA GPU"]
fn all_tiers_serve_real_memory() {
    let dev = device();
    for (conf, mid_tier) in ALL_TIERS_CONFS {
        let pool = Pool::new(dev.clone(), Config::parse(conf).unwrap()).unwrap();
        let reqs = [
            (4096, Lifetime::Short, Tier::Slab),
            (700 * 1024, Lifetime::Short, Tier::Slab),
            (37 * MIB + 512, Lifetime::Short, Tier::Extent),
            (5 * MIB, Lifetime::Mid, mid_tier),
            (3 * MIB + 4096, Lifetime::Long, Tier::Buddy),
            (1536, Lifetime::Long, Tier::Buddy),
        ];
        let mut blocks = Vec::new();
        for (i, &(size, l, tier)) in reqs.iter().enumerate() {
            let b = pool.alloc(size, 0, hint(l)).unwrap();
            assert_eq!(b.tier, tier, "{size} {l:?}");
            let pat = vec![(i as u8 + 1) * 17; b.size as usize];
            dev.write(b.ptr, &pat).unwrap();
            blocks.push((b, pat));
        }
        for (b, pat) in &blocks {
            let mut back = vec![0u8; b.size as usize];
            dev.read(b.ptr, &mut back).unwrap();
            assert!(back == *pat, "block {:?} corrupted", b.tier);
        }
        for (b, _) in blocks {
            pool.free(b.ptr, 0).unwrap();
        }
        pool.trim();
        assert_eq!(pool.reserved_now(), 0, "'{conf}'");
    }
}

/// A block freed on stream A after a memset queued there is reused on stream B only once A's work is
/// done: B reads A's bytes, never a half-written block.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cross_stream_free_and_reuse() {
    let dev = device();
    let pool = Pool::new(dev.clone(), Config::default()).unwrap();
    let (a, b) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
    for size in [64 * 1024, 24 * MIB] {
        let blk = pool.alloc(size, a, hint(Lifetime::Short)).unwrap();
        dev.memset_async(blk.ptr, 0x5a, blk.size, a).unwrap();
        pool.free(blk.ptr, a).unwrap();
        let again = pool.alloc(size, b, hint(Lifetime::Short)).unwrap();
        dev.stream_synchronize(b).unwrap();
        if again.ptr == blk.ptr {
            let mut back = vec![0u8; blk.size as usize];
            dev.read(again.ptr, &mut back).unwrap();
            assert!(
                back.iter().all(|&v| v == 0x5a),
                "reused before stream A finished"
            );
        }
        pool.free(again.ptr, b).unwrap();
    }
    dev.synchronize().unwrap();
}

/// Pages are mapped and unmapped for real (VMM): freeing and reallocating at other sizes moves pages.
#[test]
#[ignore = "needs a CUDA GPU"]
fn vmm_pages_move_between_blocks() {
    let dev = device();
    let pool = Pool::new(dev.clone(), Config::default()).unwrap();
    let x = pool.alloc(64 * MIB, 0, hint(Lifetime::Short)).unwrap();
    pool.free(x.ptr, 0).unwrap();
    // A different layout reuses (steals) the same physical pages rather than growing.
    let y = pool.alloc(30 * MIB, 0, hint(Lifetime::Long)).unwrap();
    let z = pool.alloc(30 * MIB, 0, hint(Lifetime::Short)).unwrap();
    for blk in [y, z] {
        dev.write(blk.ptr, &vec![3u8; blk.size as usize]).unwrap();
    }
    let s = pool.stats();
    assert!(
        s.pages.pages_peak * s.pages.page_size <= 66 * MIB,
        "{:?}",
        s.pages
    );
    pool.free(y.ptr, 0).unwrap();
    pool.free(z.ptr, 0).unwrap();
    pool.trim();
    assert_eq!(pool.reserved_now(), 0);
}

/// One stream, busy: a page freed with work still queued on it moves to a new block without a device
/// synchronize (mapped at the new address while the old mapping stays until a fence completes), the host
/// does not wait for the stream, and stream order keeps the data right: the old block's late pattern
/// lands before the new block's, through the same physical page.
#[test]
#[ignore = "needs a CUDA GPU"]
fn one_stream_moves_busy_pages_without_synchronizing() {
    let dev = device();
    let t = TwoStreams::new(dev.clone());
    let pool = Pool::new(dev.clone(), Config::default()).unwrap();
    let x = pool.alloc(64 * MIB, t.a, hint(Lifetime::Short)).unwrap();
    let keep = pool.alloc(MIB, t.a, hint(Lifetime::Long)).unwrap();
    t.queue_slow_then_pattern(x);
    pool.free(x.ptr, t.a).unwrap();
    // Too big for x's hole: placed past `keep`, on x's pages (moved) and new ones.
    let y = pool.alloc(100 * MIB, t.a, hint(Lifetime::Short)).unwrap();
    let a_was_busy = !t.a_done();
    dev.memset_async(y.ptr, PAT_B, y.size, t.a).unwrap();
    let s = pool.stats().pages;
    eprintln!("pages after the move: {s:?}; stream busy during it: {a_was_busy}");
    assert!(s.aliases >= 30, "x's pages moved by aliasing: {s:?}");
    assert_eq!(s.syncs, 0, "{s:?}");
    if !under_sanitizer() {
        assert!(a_was_busy, "the host waited for the stream");
    }
    let (_, b) = t.settle_and_count(y.ptr, y.size);
    assert_eq!(
        b as u64, y.size,
        "every byte of the new block reads its own pattern"
    );
    pool.free(y.ptr, t.a).unwrap();
    pool.free(keep.ptr, t.a).unwrap();
    pool.trim();
    assert_eq!(pool.reserved_now(), 0);
    assert_eq!(pool.stats().pages.zombies, 0);
}

/// Moved pages come back through their old mappings (the default `page_keep_old_mappings`): x's pages
/// move under y; y is freed with the stream still busy writing it; a block at x's address again takes
/// them back with no map, unmap or synchronize (the pages are mapped there still), and stream order keeps
/// the data right — y's late pattern lands first, through the other address, then the new block's.
#[test]
#[ignore = "needs a CUDA GPU"]
fn moved_pages_come_back_through_their_old_mappings() {
    let dev = device();
    let t = TwoStreams::new(dev.clone());
    let pool = Pool::new(dev.clone(), Config::default()).unwrap();
    let x = pool.alloc(64 * MIB, t.a, hint(Lifetime::Short)).unwrap();
    let keep = pool.alloc(MIB, t.a, hint(Lifetime::Long)).unwrap();
    pool.free(x.ptr, t.a).unwrap();
    // Too big for x's hole: placed past `keep`, on x's pages (moved) and new ones.
    let y = pool.alloc(100 * MIB, t.a, hint(Lifetime::Short)).unwrap();
    let moved = pool.stats().pages;
    assert!(moved.steals >= 30, "x's pages moved: {moved:?}");
    t.queue_slow_then_pattern(y);
    pool.free(y.ptr, t.a).unwrap();
    let x2 = pool.alloc(64 * MIB, t.a, hint(Lifetime::Short)).unwrap();
    let a_was_busy = !t.a_done();
    dev.memset_async(x2.ptr, PAT_B, x2.size, t.a).unwrap();
    let s = pool.stats().pages;
    eprintln!("pages after the way back: {s:?}; stream busy during it: {a_was_busy}");
    assert_eq!(x2.ptr, x.ptr, "best fit puts x2 in x's hole");
    assert!(s.returns - moved.returns >= 30, "{s:?}");
    assert_eq!((s.maps, s.unmaps), (moved.maps, moved.unmaps), "{s:?}");
    assert_eq!(s.syncs, 0, "{s:?}");
    if !under_sanitizer() {
        assert!(a_was_busy, "the host waited for the stream");
    }
    let (_, b) = t.settle_and_count(x2.ptr, x2.size);
    assert_eq!(b as u64, x2.size, "every byte of x2 reads its own pattern");
    pool.free(x2.ptr, t.a).unwrap();
    pool.free(keep.ptr, t.a).unwrap();
    pool.trim();
    assert_eq!(pool.reserved_now(), 0);
    assert_eq!(pool.stats().pages.zombies, 0);
}

/// Out of memory on a capped pool: a typed error with its breakdown, then the pool serves again.
#[test]
#[ignore = "needs a CUDA GPU"]
fn capped_pool_out_of_memory_recovers() {
    let dev = device();
    let pool = Pool::new(dev.clone(), Config::parse(CAPPED_CONF).unwrap()).unwrap();
    let a = pool.alloc(200 * MIB, 0, hint(Lifetime::Short)).unwrap();
    match pool.alloc(100 * MIB, 0, hint(Lifetime::Short)) {
        Err(GenpoolError::OutOfMemory(r)) => {
            assert_eq!(r.requested, 100 * MIB);
            assert!(r.reserved <= 256 * MIB, "{r}");
        }
        other => panic!("expected out of memory, got {other:?}"),
    }
    pool.free(a.ptr, 0).unwrap();
    let b = pool.alloc(100 * MIB, 0, hint(Lifetime::Short)).unwrap();
    pool.free(b.ptr, 0).unwrap();
    pool.trim();
    assert_eq!(pool.reserved_now(), 0);
}

/// Set by `benches/gpu/reliability.sh` when it runs these tests under compute-sanitizer, which may
/// serialize device work: the stream-order test then reports a closed race window instead of failing.
fn under_sanitizer() -> bool {
    std::env::var_os("GENPOOL_UNDER_SANITIZER").is_some()
}

/// Two streams and what the stream-order tests share: the slow-work buffer and an event recorded on A
/// after the slow work (queried to show the race window was open).
struct TwoStreams {
    dev: Arc<dyn Device>,
    a: StreamId,
    b: StreamId,
    big: u64,
    slow_done: EventHandle,
}

impl TwoStreams {
    fn new(dev: Arc<dyn Device>) -> Self {
        let (a, b) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
        let big = dev.mem_alloc(SLOW_BYTES).unwrap();
        let slow_done = dev.event_create().unwrap();
        TwoStreams {
            dev,
            a,
            b,
            big,
            slow_done,
        }
    }

    /// Let `pool` see both streams (a 512 B block on each; 512 B is in no size class the tests use), so
    /// the engine's one-time device synchronization at the second stream's first use happens here and
    /// not during the test: what follows relies on its stream-ordered reuse rules alone.
    fn introduce(&self, pool: &Pool) {
        for s in [self.a, self.b] {
            let w = pool.alloc(512, s, hint(Lifetime::Short)).unwrap();
            pool.free(w.ptr, s).unwrap();
        }
        self.dev.synchronize().unwrap();
    }

    /// Queue the slow work on A, then `PAT_A` over `x` on A, and record `slow_done` after them.
    fn queue_slow_then_pattern(&self, x: Block) {
        self.queue_slow_then(self.a, PAT_A, x);
    }

    /// Queue the slow work on B, then `PAT_B` over `x` on B, and record `slow_done` after them: B is the
    /// block's last user when it is freed next.
    fn queue_slow_then_pattern_on_b(&self, x: Block) {
        self.queue_slow_then(self.b, PAT_B, x);
    }

    /// Queue the slow work on `s`, then `pat` over `x` on `s`, and record `slow_done` after them.
    fn queue_slow_then(&self, s: StreamId, pat: u8, x: Block) {
        for i in 0..SLOW_REPS {
            self.dev
                .memset_async(self.big, i as u8, SLOW_BYTES, s)
                .unwrap();
        }
        self.dev.memset_async(x.ptr, pat, x.size, s).unwrap();
        self.dev.event_record(self.slow_done, s).unwrap();
    }

    /// A, having just been given `y`, writes `PAT_A` over it while B's slow work should still run; after
    /// a synchronize, the bytes of `y` holding `PAT_A` and `PAT_B`, and whether B was still running when
    /// A wrote. B done already proves nothing, which fails the test (`case` names it) unless under
    /// compute-sanitizer (it serializes the streams).
    fn a_writes_while_b_runs(&self, y: Block, case: &str) -> (usize, usize, bool) {
        let b_running = !self.dev.event_query(self.slow_done).unwrap();
        if !b_running {
            assert!(
                under_sanitizer(),
                "{case}: B finished before A allocated: this run cannot tell a safe engine from an unsafe one"
            );
        }
        self.dev.memset_async(y.ptr, PAT_A, y.size, self.a).unwrap();
        let (n_a, n_b) = self.settle_and_count(y.ptr, y.size);
        (n_a, n_b, b_running)
    }

    /// `y`'s bytes as [`a_writes_while_b_runs`](Self::a_writes_while_b_runs) counted them must all be
    /// A's (none of B's late pattern: A was ordered after B); then `y` is freed on A and the pool, trimmed,
    /// must hold nothing.
    fn assert_a_ordered_then_release(
        &self,
        pool: &Pool,
        y: Block,
        (n_a, n_b): (usize, usize),
        case: &str,
    ) {
        assert_eq!(
            (n_a, n_b),
            (y.size as usize, 0),
            "{case}: A's block holds {n_b} bytes of B's late pattern: A was not ordered after B"
        );
        pool.free(y.ptr, self.a).unwrap();
        self.dev.synchronize().unwrap();
        pool.trim();
        assert_eq!(pool.reserved_now(), 0, "{case}: memory left after trim");
    }

    /// Whether A's queued work (slow work and pattern) has completed.
    fn a_done(&self) -> bool {
        self.dev.event_query(self.slow_done).unwrap()
    }

    /// After a full device synchronization, count the bytes of `[ptr, ptr + len)` equal to `PAT_A` and to
    /// `PAT_B`.
    fn settle_and_count(&self, ptr: u64, len: u64) -> (usize, usize) {
        self.dev.synchronize().unwrap();
        let mut back = vec![0u8; len as usize];
        self.dev.read(ptr, &mut back).unwrap();
        let a = back.iter().filter(|&&v| v == PAT_A).count();
        let b = back.iter().filter(|&&v| v == PAT_B).count();
        (a, b)
    }
}

impl Drop for TwoStreams {
    fn drop(&mut self) {
        let d = &self.dev;
        let r = d
            .synchronize()
            .and_then(|()| d.mem_free(self.big))
            .and_then(|()| d.event_destroy(self.slow_done))
            .and_then(|()| d.stream_destroy(self.a))
            .and_then(|()| d.stream_destroy(self.b));
        if let Err(e) = r {
            eprintln!("stream-order test teardown: {e}");
        }
    }
}

/// The stream-order rule with a race window that is really open (issue #6). For each tier: block X is
/// allocated on stream A, slow work (32 GiB of memsets) is queued on A, then `PAT_A` over X on A, and X
/// is freed on A through the engine while all of that is still running. Then a block of the same size is
/// allocated on B through the engine and filled with `PAT_B` on B. Whether the engine hands out X, a
/// block overlapping X, or another block, after a device synchronization every byte must read `PAT_B`: a
/// block reused before A's work is done would have A's later `PAT_A` land over B's bytes (the
/// `cross_stream_broken_reuse_is_caught` test shows that this check sees exactly that).
#[test]
#[ignore = "needs a CUDA GPU"]
fn cross_stream_reuse_waits_for_work_on_the_freeing_stream() {
    let dev = device();
    let t = TwoStreams::new(dev.clone());
    for (conf, size, life, tier) in REUSE_CASES {
        let pool = Pool::new(dev.clone(), Config::parse(conf).unwrap()).unwrap();
        t.introduce(&pool);
        let x = pool.alloc(size, t.a, hint(life)).unwrap();
        assert_eq!(x.tier, tier, "'{conf}' {size} {life:?}");
        // The slab: use up the rest of X's 2 MiB chunk on A, so B finds no idle slot of this class and
        // must take slots freed on A (X) through the slab's cross-stream migration, or new memory.
        let fill = if tier == Tier::Slab {
            2 * MIB / size
        } else {
            0
        };
        let fillers: Vec<Block> = (0..fill)
            .map(|_| pool.alloc(size, t.a, hint(life)).unwrap())
            .collect();
        t.queue_slow_then_pattern(x);
        pool.free(x.ptr, t.a).unwrap();
        if t.a_done() {
            let why = format!(
                "{tier:?}: stream A finished its slow work before B allocated, so this run cannot tell \
                 a safe engine from an unsafe one: raise SLOW_BYTES or SLOW_REPS"
            );
            // Under a sanitizer, device work may be serialized with the host: the data check still
            // runs, the window is only reported.
            assert!(under_sanitizer(), "{why}");
            eprintln!("NOTE (sanitizer run): {why}");
        }
        let y = pool.alloc(size, t.b, hint(life)).unwrap();
        let waited_on_host = t.a_done();
        t.dev.memset_async(y.ptr, PAT_B, y.size, t.b).unwrap();
        let (n_a, n_b) = t.settle_and_count(y.ptr, y.size);
        let overlap = y.ptr < x.ptr + x.size && x.ptr < y.ptr + y.size;
        eprintln!(
            "{tier:?}: B got {} ({:#x}, X is {:#x}); when the engine returned, A's work was {}",
            if y.ptr == x.ptr {
                "X itself"
            } else if overlap {
                "a block overlapping X"
            } else {
                "another block"
            },
            y.ptr,
            x.ptr,
            if waited_on_host {
                "done (the engine waited on the host)"
            } else {
                "still running (the engine relied on stream order or event waits)"
            }
        );
        assert_eq!(
            (n_a, n_b),
            (0, y.size as usize),
            "{tier:?}: B's block holds {n_a} bytes of A's pattern and {n_b} of its own out of {}: the \
             engine handed B memory that stream A was still going to write",
            y.size
        );
        pool.free(y.ptr, t.b).unwrap();
        for f in fillers {
            pool.free(f.ptr, t.a).unwrap();
        }
        t.dev.synchronize().unwrap();
        pool.trim();
        assert_eq!(pool.reserved_now(), 0, "{tier:?}: memory left after trim");
    }
}

/// The broken variant: the data check of `cross_stream_reuse_waits_for_work_on_the_freeing_stream` does
/// bite. The same sequence, but the B-side writer uses X's address directly, as an allocator without an
/// event wait would hand it out: A's later `PAT_A` then lands over B's bytes, and this test asserts that
/// the read-back sees it. If the race cannot be observed here (A's work too short, or the streams
/// serialized, as compute-sanitizer may do: `reliability.sh` skips it there) the test fails and says
/// so rather than pass silently.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cross_stream_broken_reuse_is_caught() {
    let dev = device();
    let t = TwoStreams::new(dev.clone());
    let pool = Pool::new(dev.clone(), Config::default()).unwrap();
    t.introduce(&pool);
    // An extent block: its pages stay mapped after the free (the engine keeps them), so writing and
    // reading X's address afterwards touches valid device memory.
    let x = pool.alloc(8 * MIB, t.a, hint(Lifetime::Short)).unwrap();
    assert_eq!(x.tier, Tier::Extent);
    t.queue_slow_then_pattern(x);
    pool.free(x.ptr, t.a).unwrap();
    t.dev.memset_async(x.ptr, PAT_B, x.size, t.b).unwrap();
    let window_open = !t.a_done();
    let (n_a, n_b) = t.settle_and_count(x.ptr, x.size);
    eprintln!(
        "unordered reuse: {n_a} bytes of A's pattern, {n_b} of B's, out of {}",
        x.size
    );
    assert!(
        window_open,
        "stream A finished its slow work before B's write was queued: the race cannot show; raise \
         SLOW_BYTES or SLOW_REPS"
    );
    assert!(
        n_a > 0,
        "race not observable: B's write landed after A's although A was still busy when it was queued \
         (streams serialized, e.g. under compute-sanitizer?): the stream-order test proves nothing on \
         this setup"
    );
    pool.trim();
}

/// The streams after the first share one extent arena (the default since session 12), ordered lazily: X
/// is allocated on B (a later stream), B queues slow work and then `PAT_B` over X, and X is freed on B —
/// no device call, its bytes stamped with B. A (another later stream) then allocates the same size, gets
/// X's bytes (one arena, best fit) and writes `PAT_A`. After a synchronize every byte must read `PAT_A`:
/// the engine must have made A wait on the device for B's work when A took the bytes.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_later_stream_taking_anothers_freed_bytes_waits_for_its_work() {
    let dev = device();
    let t = TwoStreams::new(dev.clone());
    let first = dev.stream_create().unwrap();
    let pool = Pool::new(dev.clone(), Config::default()).unwrap();
    // The pool's first stream is `first`: A and B come after it.
    let w = pool.alloc(512, first, hint(Lifetime::Short)).unwrap();
    pool.free(w.ptr, first).unwrap();
    t.introduce(&pool);
    let x = pool.alloc(8 * MIB, t.b, hint(Lifetime::Short)).unwrap();
    t.queue_slow_then_pattern_on_b(x);
    let waits = t.dev.call_counts();
    pool.free(x.ptr, t.b).unwrap();
    let freed = t.dev.call_counts();
    assert_eq!(
        (freed.event_records, freed.stream_waits),
        (waits.event_records, waits.stream_waits),
        "the free makes no device call"
    );
    let y = pool.alloc(8 * MIB, t.a, hint(Lifetime::Short)).unwrap();
    assert_eq!(
        y.ptr, x.ptr,
        "A gets B's bytes: one arena for the later streams"
    );
    let (n_a, n_b, _) = t.a_writes_while_b_runs(y, "the shared arena");
    t.assert_a_ordered_then_release(&pool, y, (n_a, n_b), "the shared arena");
}

/// A block handed to another stream and freed there (PyTorch's `record_stream`, a hand-off): X is
/// allocated on A, B queues slow work and then `PAT_B` over X, and X is freed on B through the engine
/// while that runs. A then allocates the same size (its own arena: X itself, by best
/// fit) and writes `PAT_A` on A. After a synchronize every byte must read `PAT_A`: the engine must have
/// made A wait for B's work (gen-vmm's `Handoff`: a fence on B, a device-side wait by A) — B's late
/// `PAT_B` would otherwise land over A's bytes. For the first stream's arena, one arena every stream
/// shares (`stream_arenas:first`) and the buddy.
#[test]
#[ignore = "needs a CUDA GPU"]
fn foreign_free_orders_the_arena_stream_after_the_last_user() {
    let dev = device();
    let t = TwoStreams::new(dev.clone());
    for (conf, size, life, tier) in FOREIGN_FREE_CASES {
        let pool = Pool::new(dev.clone(), Config::parse(conf).unwrap()).unwrap();
        t.introduce(&pool);
        let x = pool.alloc(size, t.a, hint(life)).unwrap();
        assert_eq!(x.tier, tier, "'{conf}'");
        // B: slow work, then its pattern over X, then the free on B (X's last user).
        t.queue_slow_then_pattern_on_b(x);
        pool.free(x.ptr, t.b).unwrap();
        let y = pool.alloc(size, t.a, hint(life)).unwrap();
        let (n_a, n_b, b_running) = t.a_writes_while_b_runs(y, &format!("'{conf}'"));
        eprintln!(
            "'{conf}' {tier:?}: A got {} while B's work was {}",
            if y.ptr == x.ptr {
                "X itself"
            } else {
                "another block"
            },
            if b_running { "still running" } else { "done" }
        );
        t.assert_a_ordered_then_release(&pool, y, (n_a, n_b), &format!("'{conf}' {tier:?}"));
    }
}
