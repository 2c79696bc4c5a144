//! gen-slab: the short-lived tier's hot path on a simulated device (no driver calls once warm).
//!
//! `cargo bench -p genpool-benches --bench slab`. Throughput is one element per alloc+free pair, so
//! criterion's time is ns per pair. `pair_1t/*`: one thread, one stream, chunks already committed;
//! `scaling/*`: T threads each doing pairs with 16 blocks live, sizes 512 B – 64 KiB, shared classes.

use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use gen_device::{Device, SimDevice};
use gen_slab::{Slab, SlabConfig};
use gen_vmm::{PagePool, PagePoolConfig};

fn config() -> Criterion {
    Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
}

fn slab() -> Arc<Slab> {
    let dev: Arc<dyn Device> = Arc::new(SimDevice::new());
    let pool = PagePool::new(dev.clone(), PagePoolConfig::default()).expect("page pool");
    Arc::new(Slab::new(&pool, dev, SlabConfig::wide()).expect("slab"))
}

const SIZES: [u64; 8] = [512, 4096, 1536, 65536, 20_000, 8192, 700, 30_000];

fn single_thread(c: &mut Criterion) {
    let mut g = c.benchmark_group("slab/pair_1t");
    g.throughput(Throughput::Elements(1));
    let s = slab();
    for &size in &[512u64, 65536] {
        let p = s.alloc(size, 0, true).unwrap();
        s.free(p, 0).unwrap();
        g.bench_with_input(BenchmarkId::new("same_size", size), &size, |b, &size| {
            b.iter(|| {
                let p = s.alloc(black_box(size), 0, false).unwrap();
                s.free(black_box(p), 0).unwrap();
            })
        });
    }
    // 16 live blocks of mixed classes, the oldest freed and replaced each step.
    let mut ring: Vec<u64> = (0..16)
        .map(|k| s.alloc(SIZES[k % 8], 0, true).unwrap())
        .collect();
    let mut k = 0usize;
    g.bench_function("mixed_16_live", |b| {
        b.iter(|| {
            let j = k % 16;
            s.free(ring[j], 0).unwrap();
            ring[j] = s.alloc(SIZES[k % 8], 0, false).unwrap();
            k += 1;
        })
    });
    for p in ring {
        s.free(p, 0).unwrap();
    }
    g.finish();
}

fn scaling(c: &mut Criterion) {
    let mut g = c.benchmark_group("slab/scaling");
    g.throughput(Throughput::Elements(1));
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    for threads in [1usize, 2, 4, 8, 16].into_iter().filter(|&t| t <= cores) {
        g.bench_with_input(
            BenchmarkId::from_parameter(threads),
            &threads,
            |b, &threads| {
                b.iter_custom(|iters| {
                    let s = slab();
                    let per = iters.div_ceil(threads as u64);
                    let barrier = Arc::new(Barrier::new(threads + 1));
                    let hs: Vec<_> = (0..threads)
                        .map(|i| {
                            let s = s.clone();
                            let barrier = barrier.clone();
                            std::thread::spawn(move || {
                                let mut ring: Vec<u64> = (0..16)
                                    .map(|k| s.alloc(SIZES[(k + i) % 8], 0, true).unwrap())
                                    .collect();
                                barrier.wait();
                                for k in 0..per as usize {
                                    let j = k % 16;
                                    s.free(ring[j], 0).unwrap();
                                    ring[j] = s.alloc(SIZES[(k + i) % 8], 0, true).unwrap();
                                }
                                for p in ring {
                                    s.free(p, 0).unwrap();
                                }
                            })
                        })
                        .collect();
                    barrier.wait();
                    let t0 = Instant::now();
                    for h in hs {
                        h.join().unwrap();
                    }
                    // Wall time of about `iters` pairs over all threads: the machine's throughput.
                    t0.elapsed()
                        .mul_f64(iters as f64 / (per * threads as u64) as f64)
                })
            },
        );
    }
    g.finish();
}

criterion_group! { name = benches; config = config(); targets = single_thread, scaling }
criterion_main!(benches);
