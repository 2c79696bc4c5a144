//! On a real GPU: `DriverPool` alloc/free across two streams, a memset on one and a read after reuse on
//! the other. Run with `cargo test -p gen-stream --test cuda -- --include-ignored` on a CUDA machine
//! (and under `compute-sanitizer --tool memcheck`); without a driver it fails saying why.

use std::sync::Arc;

use gen_device::Device;
use gen_stream::{DriverPool, DriverPoolConfig};

/// Device 0 ([`gen_device::testing::cuda_device`]: with none, the calling test fails saying why).
fn device() -> Arc<dyn Device> {
    Arc::new(gen_device::testing::cuda_device())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cross_stream_reuse_on_a_real_gpu() {
    let dev = device();
    let (s, t) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
    let pool = DriverPool::new(dev.clone(), DriverPoolConfig::default()).unwrap();
    const N: u64 = 8 << 20;

    // Same stream: a freed block comes back at once, and the data written on s is ordered before
    // the reuse.
    let a = pool.alloc(N, s).unwrap();
    dev.memset_async(a, 0x5A, N, s).unwrap();
    pool.free(a, s).unwrap();
    assert_eq!(pool.alloc(N, s).unwrap(), a);
    pool.free(a, s).unwrap();

    // Other stream: the block migrates under an event; once the event has completed t may use it.
    let mut got = None;
    for _ in 0..1000 {
        let b = pool.alloc(N, t).unwrap();
        if b == a {
            got = Some(b);
            break;
        }
        pool.free(b, t).unwrap();
        dev.stream_synchronize(s).unwrap();
    }
    let b = got.expect("the block freed on s reached t after s went idle");
    let mut buf = vec![0u8; 4096];
    dev.stream_synchronize(t).unwrap();
    dev.read(b + N - 4096, &mut buf).unwrap();
    assert!(
        buf.iter().all(|&x| x == 0x5A),
        "memset on s visible after reuse on t"
    );
    dev.memset_async(b, 0xC3, N, t).unwrap();
    dev.stream_synchronize(t).unwrap();
    dev.read(b, &mut buf).unwrap();
    assert!(buf.iter().all(|&x| x == 0xC3));
    pool.free(b, t).unwrap();

    let st = pool.stats();
    assert!(st.cache.hits >= 2, "{st:?}");
    assert!(st.pool.unwrap().reserved_high >= N);
    pool.trim(0).unwrap();
    assert_eq!(pool.stats().pool.unwrap().reserved_current, 0);
    pool.close().unwrap();
    dev.stream_destroy(s).unwrap();
    dev.stream_destroy(t).unwrap();
}
