//! Per-thread caches of large blocks (`tcache.rs`): engaged only from `thread_caches` allocating threads
//! on, reuse by size and stream on the keeping thread, typed errors for frees of kept blocks, and every
//! kept block given back before the pool grows, on a trim and on the out-of-memory path.

use std::sync::{Arc, Barrier};

use gen_device::sim::SimDevice;
use gen_device::Device;
use genpool::{Config, FreeFault, GenpoolError, Hint, Pool};

const MIB: u64 = 1 << 20;

fn pool(capacity: u64, cfg: &str) -> Arc<Pool> {
    pool_dev(capacity, cfg).0
}

/// A pool over a fresh simulated device, with 64 MiB of pages made and left free (so that the tests'
/// allocations revive pages instead of growing the pool, which gives every kept block back).
fn pool_dev(capacity: u64, cfg: &str) -> (Arc<Pool>, Arc<SimDevice>) {
    let dev = Arc::new(SimDevice::config().capacity(capacity).build().unwrap());
    let p =
        Arc::new(Pool::new(dev.clone() as Arc<dyn Device>, Config::parse(cfg).unwrap()).unwrap());
    let warm = p.alloc(64 * MIB, 0, Hint::NONE).unwrap();
    p.free(warm.ptr, 0).unwrap();
    (p, dev)
}

/// `n` helper threads each allocate (and free) one large block while all of them are alive, so the pool
/// has seen `n` more allocating threads; then `f` runs on the calling thread.
fn with_helpers<T>(pool: &Arc<Pool>, n: usize, f: impl FnOnce() -> T) -> T {
    let (noted, done) = (Arc::new(Barrier::new(n + 1)), Arc::new(Barrier::new(n + 1)));
    let hs: Vec<_> = (0..n)
        .map(|_| {
            let (pool, noted, done) = (pool.clone(), noted.clone(), done.clone());
            std::thread::spawn(move || {
                let b = pool.alloc(3 * MIB, 0, Hint::NONE).unwrap();
                pool.free(b.ptr, 0).unwrap();
                noted.wait();
                done.wait();
            })
        })
        .collect();
    noted.wait();
    let out = f();
    done.wait();
    for h in hs {
        h.join().unwrap();
    }
    out
}

#[test]
fn three_threads_keep_their_blocks_two_do_not() {
    // Two allocating threads (PyTorch's main and autograd threads): nothing kept.
    let p = pool(4 << 30, "");
    with_helpers(&p, 1, || {
        let a = p.alloc(8 * MIB, 0, Hint::NONE).unwrap();
        p.free(a.ptr, 0).unwrap();
        assert_eq!(p.stats().cached_bytes, 0);
    });
    // Three: the freeing thread keeps its block and gets it back for the same size and stream only.
    let p = pool(4 << 30, "");
    with_helpers(&p, 2, || {
        // (A helper's own block may be kept in its cache: count from here.)
        let base = p.stats().cached_bytes;
        let a = p.alloc(8 * MIB, 0, Hint::NONE).unwrap();
        p.free(a.ptr, 0).unwrap();
        assert_eq!(p.stats().cached_bytes, base + 8 * MIB);
        assert_eq!(
            p.stats().allocated_current,
            0,
            "freed, as the caller sees it"
        );
        let other_size = p.alloc(4 * MIB, 0, Hint::NONE).unwrap();
        assert_ne!(other_size.ptr, a.ptr);
        let again = p.alloc(8 * MIB, 0, Hint::NONE).unwrap();
        assert_eq!(again.ptr, a.ptr, "kept for this size");
        assert_eq!(p.stats().cached_bytes, base);
        p.free(again.ptr, 0).unwrap();
        p.free(other_size.ptr, 0).unwrap();
        // Another thread does not get this thread's block.
        let p2 = p.clone();
        let theirs = std::thread::spawn(move || {
            let b = p2.alloc(8 * MIB, 0, Hint::NONE).unwrap();
            p2.free(b.ptr, 0).unwrap();
            b.ptr
        })
        .join()
        .unwrap();
        assert_ne!(theirs, a.ptr);
    });
    // thread_caches:0 never keeps.
    let p = pool(4 << 30, "thread_caches:0");
    with_helpers(&p, 4, || {
        let a = p.alloc(8 * MIB, 0, Hint::NONE).unwrap();
        p.free(a.ptr, 0).unwrap();
        assert_eq!(p.stats().cached_bytes, 0);
    });
}

#[test]
fn a_kept_block_freed_again_is_a_double_free_and_other_streams_miss() {
    let (p, dev) = pool_dev(4 << 30, "");
    let (s, t) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
    with_helpers(&p, 2, || {
        let base = p.stats().cached_bytes;
        let a = p.alloc(8 * MIB, s, Hint::NONE).unwrap();
        p.free(a.ptr, s).unwrap();
        assert_eq!(p.stats().cached_bytes, base + 8 * MIB);
        assert!(matches!(
            p.free(a.ptr, s),
            Err(GenpoolError::InvalidFree {
                fault: FreeFault::DoubleFree | FreeFault::Unknown,
                ..
            })
        ));
        // Stream t does not take stream s's block (work queued on s may still use it).
        let b = p.alloc(8 * MIB, t, Hint::NONE).unwrap();
        assert_ne!(b.ptr, a.ptr);
        assert_eq!(p.stats().cached_bytes, base + 8 * MIB);
        p.free(b.ptr, t).unwrap();
        // A block freed on another stream than its own is not kept: it goes back through its arena's
        // ordering (the handoff).
        let c = p.alloc(2 * MIB, s, Hint::NONE).unwrap();
        let kept = p.stats().cached_bytes;
        p.free(c.ptr, t).unwrap();
        assert_eq!(p.stats().cached_bytes, kept);
        assert_eq!(p.stats().allocated_current, 0);
    });
}

#[test]
fn kept_blocks_go_back_before_the_pool_grows_and_on_trim() {
    // Threads keep blocks, then one allocation needs more pages than the pool holds.
    let p = pool(256 * MIB, "");
    with_helpers(&p, 2, || {
        let kept: Vec<u64> = (0..4)
            .map(|_| p.alloc(16 * MIB, 0, Hint::NONE).unwrap().ptr)
            .collect();
        for &k in &kept {
            p.free(k, 0).unwrap();
        }
        assert!(p.stats().cached_bytes >= 64 * MIB);
        let big = p.alloc(200 * MIB, 0, Hint::NONE).unwrap();
        assert_eq!(
            p.stats().cached_bytes,
            0,
            "given back before the pool grew past the device"
        );
        p.free(big.ptr, 0).unwrap();
        let _ = p.alloc(16 * MIB, 0, Hint::NONE).map(|b| p.free(b.ptr, 0));
        p.trim();
        assert_eq!(p.stats().cached_bytes, 0);
        assert_eq!(p.reserved_now(), p.stats().reserved_current);
    });
}

#[test]
fn a_thread_keeps_only_blocks_it_allocated() {
    let p = pool(4 << 30, "");
    with_helpers(&p, 2, || {
        let base = p.stats().cached_bytes;
        // Allocated here, freed by another thread (a consumer): not kept there.
        let a = p.alloc(8 * MIB, 0, Hint::NONE).unwrap();
        let p2 = p.clone();
        std::thread::spawn(move || p2.free(a.ptr, 0).unwrap())
            .join()
            .unwrap();
        assert_eq!(p.stats().cached_bytes, base);
        // Allocated and freed here: kept.
        let b = p.alloc(8 * MIB, 0, Hint::NONE).unwrap();
        p.free(b.ptr, 0).unwrap();
        assert_eq!(p.stats().cached_bytes, base + 8 * MIB);
    });
}

/// Threads allocating and freeing at once with the caches engaged: every block handed out is distinct
/// from every other live one, and the books balance.
#[test]
fn threads_at_once_never_share_a_block() {
    let p = pool(8 << 30, "");
    let threads = 6;
    let start = Arc::new(Barrier::new(threads));
    let hs: Vec<_> = (0..threads)
        .map(|t| {
            let (p, start) = (p.clone(), start.clone());
            std::thread::spawn(move || {
                start.wait();
                let mut live: Vec<(u64, u64)> = Vec::new();
                let mut seen = Vec::new();
                for i in 0..3000usize {
                    if live.len() >= 8 {
                        let (ptr, _) = live.remove((i * 7 + t) % live.len());
                        p.free(ptr, 0).unwrap();
                    }
                    let size = [64 << 10, MIB, 8 * MIB][(i + t) % 3];
                    let b = p.alloc(size, 0, Hint::NONE).unwrap();
                    assert!(
                        live.iter()
                            .all(|&(q, s)| b.ptr + b.size <= q || q + s <= b.ptr),
                        "overlap"
                    );
                    live.push((b.ptr, b.size));
                    seen.push((b.ptr, b.size));
                }
                live
            })
        })
        .collect();
    let mut all: Vec<(u64, u64)> = hs.into_iter().flat_map(|h| h.join().unwrap()).collect();
    all.sort_unstable();
    for w in all.windows(2) {
        assert!(
            w[0].0 + w[0].1 <= w[1].0,
            "two threads hold overlapping blocks"
        );
    }
    for (ptr, _) in all {
        p.free(ptr, 0).unwrap();
    }
    assert_eq!(p.stats().allocated_current, 0);
    p.trim();
    assert_eq!(p.stats().cached_bytes, 0);
}
