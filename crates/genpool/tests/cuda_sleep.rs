//! Sleep / wake on a real GPU (issue 22). `#[ignore]`d here (no GPU in CI); run on the GPU machine with
//! `cargo test --release -p genpool --test cuda_sleep -- --include-ignored --nocapture`. Without a device
//! each test fails, saying why.

use std::sync::Arc;
use std::time::Instant;

use gen_device::Device;
use genpool::{Config, GenpoolError, Hint, Lifetime, Pool, SleepOptions};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Device 0 ([`gen_device::testing::cuda_device`]: with none, the calling test fails saying why).
fn device() -> Arc<dyn Device> {
    Arc::new(gen_device::testing::cuda_device())
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed) ^ (i >> 12) as u8)
        .collect()
}

/// Real memory goes back to the driver (`cuMemGetInfo` sees it free) while every block keeps its address,
/// and comes back with its bytes restored from pinned host memory; without offload it comes back mapped.
#[test]
#[ignore = "needs a CUDA device"]
fn sleep_gives_real_memory_back_and_wake_restores_it() {
    let dev = device();
    assert!(!dev.stream_is_capturing(0).unwrap());
    let pool = Pool::new(dev.clone(), Config::default()).unwrap();
    let sizes = [
        (512 * MIB, Lifetime::Long),
        (300 * MIB + 4096, Lifetime::Short),
        (3 * MIB + 512, Lifetime::Long),
        (1000, Lifetime::Short),
        (700 * 1024, Lifetime::Short),
    ];
    let mut blocks = Vec::new();
    for (i, &(size, l)) in sizes.iter().enumerate() {
        let b = pool
            .alloc(
                size,
                0,
                Hint {
                    lifetime: Some(l),
                    site: None,
                },
            )
            .unwrap();
        let pat = pattern(b.size as usize, i as u8 + 1);
        dev.write(b.ptr, &pat).unwrap();
        blocks.push((b, pat));
    }
    let freed = pool.alloc(256 * MIB, 0, Hint::NONE).unwrap();
    pool.free(freed.ptr, 0).unwrap();
    let allocated = pool.allocated();
    dev.synchronize().unwrap();
    let (free_before, _) = dev.mem_info().unwrap();
    let held = pool.reserved_now();

    let t = Instant::now();
    let r = pool
        .sleep(SleepOptions {
            offload: true,
            capturing: false,
        })
        .unwrap();
    let t_sleep = t.elapsed();
    let (free_asleep, _) = dev.mem_info().unwrap();
    assert_eq!(pool.reserved_now(), 0);
    assert_eq!(pool.allocated(), allocated);
    assert_eq!(r.released_bytes, held);
    assert!(
        free_asleep >= free_before + held - 64 * MIB,
        "the driver has the memory back: free {free_before} -> {free_asleep}, held {held}"
    );
    assert_eq!(pool.alloc(MIB, 0, Hint::NONE), Err(GenpoolError::Asleep));
    // Someone else uses the memory meanwhile.
    let other = dev.mem_alloc(held).unwrap();
    dev.memset_async(other, 0x5a, held, 0).unwrap();
    dev.synchronize().unwrap();
    dev.mem_free(other).unwrap();

    let t = Instant::now();
    let w = pool.wake(false).unwrap();
    let t_wake = t.elapsed();
    assert_eq!(w.restored_bytes, r.offloaded_bytes);
    for (b, pat) in &blocks {
        let mut back = vec![0u8; b.size as usize];
        dev.read(b.ptr, &mut back).unwrap();
        assert!(back == *pat, "block {:#x} restored bit for bit", b.ptr);
    }
    let gib = r.sleeping_bytes as f64 / GIB as f64;
    eprintln!(
        "offload cycle: {gib:.3} GiB asleep; sleep {:.1} ms, wake {:.1} ms ({:.1} ms per GiB)",
        t_sleep.as_secs_f64() * 1e3,
        t_wake.as_secs_f64() * 1e3,
        (t_sleep + t_wake).as_secs_f64() * 1e3 / gib
    );

    // Without offload: the pages come back mapped (writable, readable), contents undefined.
    let t = Instant::now();
    pool.sleep(SleepOptions::default()).unwrap();
    pool.wake(false).unwrap();
    eprintln!(
        "discard cycle: {:.1} ms per GiB",
        t.elapsed().as_secs_f64() * 1e3 / gib
    );
    for (b, pat) in &blocks {
        dev.write(b.ptr, pat).unwrap();
        let mut back = vec![0u8; b.size as usize];
        dev.read(b.ptr, &mut back).unwrap();
        assert!(back == *pat);
    }
    for (b, _) in blocks {
        pool.free(b.ptr, 0).unwrap();
    }
    pool.trim();
    assert_eq!(pool.reserved_now(), 0);
    assert!(pool.release_offload_buffer().unwrap() >= r.offloaded_bytes);
}
