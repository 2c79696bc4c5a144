//! Hot-path cost of `StreamCache` (a hit on the caller's stream and a put) and of `DriverPool`'s cached
//! alloc/free, on the simulated device (the hot path makes no device call, so the device does not
//! matter). `cargo bench -p gen-stream --bench stream_cache`.

use std::hint::black_box;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion};
use gen_device::sim::SimDevice;
use gen_device::Device;
use gen_stream::{DriverPool, DriverPoolConfig, StreamCache, StreamCacheConfig};

fn cache_hot_path(c: &mut Criterion) {
    let dev: Arc<dyn Device> = Arc::new(SimDevice::new());
    let cache = StreamCache::new(dev.clone(), StreamCacheConfig::default());
    let s = 7;
    // A realistic population: 64 sizes, 8 blocks each.
    let sizes: Vec<u64> = (1..=64u64).map(|i| i * 512 * 7).collect();
    for (i, &size) in sizes.iter().enumerate() {
        for j in 0..8u64 {
            cache.put(((i as u64) << 32) | (j << 12), size, s).unwrap();
        }
    }
    let mut k = 0usize;
    c.bench_function("cache take hit + put (one op = half)", |b| {
        b.iter(|| {
            k = (k + 1) & 63;
            let size = sizes[k];
            let p = cache.take(black_box(size), s).unwrap();
            cache.put(black_box(p), size, s).unwrap();
        })
    });
    c.bench_function("cache take miss", |b| {
        b.iter(|| black_box(cache.take(black_box(3), s)))
    });

    let pool = DriverPool::new(dev, DriverPoolConfig::default()).unwrap();
    let live: Vec<u64> = sizes.iter().map(|&sz| pool.alloc(sz, 0).unwrap()).collect();
    for (&p, _) in live.iter().zip(&sizes) {
        pool.free(p, 0).unwrap();
    }
    c.bench_function("pool alloc + free, cached (one op = half)", |b| {
        b.iter(|| {
            k = (k + 1) & 63;
            let p = pool.alloc(black_box(sizes[k]), 0).unwrap();
            pool.free(black_box(p), 0).unwrap();
        })
    });
}

criterion_group!(benches, cache_hot_path);
criterion_main!(benches);
