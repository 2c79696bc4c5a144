//! The engine on a real GPU. `#[ignore]`d here (no GPU in CI); run on the GPU machine with
//! `--include-ignored`. Each test prints a reason and returns when no CUDA driver is present.

use std::sync::Arc;

use gen_device::cuda::CudaDevice;
use gen_device::{Device, DeviceError};
use genpool::{Config, GenpoolError, Hint, Lifetime, Pool, Tier};

const MIB: u64 = 1 << 20;

fn device() -> Option<Arc<dyn Device>> {
    match CudaDevice::new(0) {
        Ok(d) => Some(Arc::new(d)),
        Err(DeviceError::NoDriver(why)) => {
            eprintln!("SKIP: no CUDA driver or device ({why})");
            None
        }
        Err(e) => panic!("CUDA present but unusable: {e}"),
    }
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
    let Some(dev) = device() else { return };
    for mid in ["extent", "stream"] {
        let pool = Pool::new(
            dev.clone(),
            Config::parse(&format!("mid_tier:{mid},long_tier:buddy,slab_max_size:1M")).unwrap(),
        )
        .unwrap();
        let reqs = [
            (4096, Lifetime::Short, Tier::Slab),
            (700 * 1024, Lifetime::Short, Tier::Slab),
            (37 * MIB + 512, Lifetime::Short, Tier::Extent),
            (
                5 * MIB,
                Lifetime::Mid,
                if mid == "stream" {
                    Tier::Stream
                } else {
                    Tier::Extent
                },
            ),
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
        assert_eq!(pool.reserved_now(), 0, "mid_tier:{mid}");
    }
}

/// A block freed on stream A after a memset queued there is reused on stream B only once A's work is
/// done: B reads A's bytes, never a half-written block.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cross_stream_free_and_reuse() {
    let Some(dev) = device() else { return };
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
    let Some(dev) = device() else { return };
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

/// Out of memory on a capped pool: a typed error with its breakdown, then the pool serves again.
#[test]
#[ignore = "needs a CUDA GPU"]
fn capped_pool_out_of_memory_recovers() {
    let Some(dev) = device() else { return };
    let pool = Pool::new(dev.clone(), Config::parse("limit:256M").unwrap()).unwrap();
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
