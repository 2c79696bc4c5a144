//! gen-freelist: cost of one free-slot round trip (pop + push) per structure, batches, and thread scaling.
//!
//! `cargo bench -p genpool-benches --bench freelist`. Throughput is one element per pop+push pair, so
//! criterion's time is ns per pair. Baselines: `crossbeam_queue::ArrayQueue` and `Mutex<Vec<u32>>`.

use std::hint::black_box;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use crossbeam_queue::ArrayQueue;
use gen_freelist::{FreeList, FrontCache, LocalCache, TransferStack};

const CAP: usize = 1 << 16;

fn config() -> Criterion {
    Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
}

/// One thread: pop a slot and push it back.
fn single_thread(c: &mut Criterion) {
    let mut g = c.benchmark_group("freelist/pair_1t");
    g.throughput(Throughput::Elements(1));

    let list = FreeList::new_full(CAP).unwrap();
    g.bench_function("FreeList", |b| {
        b.iter(|| {
            let idx = list.pop().unwrap();
            list.push(black_box(idx));
        })
    });

    let list = FreeList::new_full(CAP).unwrap();
    let mut cache = LocalCache::<'_, 64>::new(&list);
    g.bench_function("LocalCache64", |b| {
        b.iter(|| {
            let idx = cache.pop().unwrap();
            cache.push(black_box(idx));
        })
    });
    drop(cache);

    let fc = FrontCache::new_full(CAP, 16, 64).unwrap();
    g.bench_function("FrontCache16x64", |b| {
        b.iter(|| {
            let idx = fc.pop().unwrap();
            fc.push(black_box(idx));
        })
    });

    let q = ArrayQueue::new(CAP);
    (0..CAP as u32).for_each(|i| q.push(i).unwrap());
    g.bench_function("crossbeam_ArrayQueue", |b| {
        b.iter(|| {
            let idx = q.pop().unwrap();
            q.push(black_box(idx)).unwrap();
        })
    });

    let m = Mutex::new((0..CAP as u32).collect::<Vec<_>>());
    g.bench_function("Mutex_Vec", |b| {
        b.iter(|| {
            let idx = m.lock().unwrap().pop().unwrap();
            m.lock().unwrap().push(black_box(idx));
        })
    });
    g.finish();
}

/// Batches of 32 slots: one `push_chain` then one `take_all` walk (FreeList, TransferStack) versus 32
/// single pushes and pops.
fn batches(c: &mut Criterion) {
    const B: usize = 32;
    let idxs: Vec<u32> = (0..B as u32).collect();
    let mut g = c.benchmark_group("freelist/batch32");
    g.throughput(Throughput::Elements(B as u64));

    let list = FreeList::new(CAP).unwrap();
    g.bench_function("FreeList_push_chain+take_all", |b| {
        b.iter(|| {
            list.push_chain(black_box(&idxs));
            black_box(list.take_all().fold(0u32, |a, i| a ^ i))
        })
    });
    g.bench_function("FreeList_push+pop_x32", |b| {
        b.iter(|| {
            idxs.iter().for_each(|&i| list.push(black_box(i)));
            black_box((0..B).fold(0u32, |a, _| a ^ list.pop().unwrap()))
        })
    });

    let ts = TransferStack::new(CAP).unwrap();
    g.bench_function("TransferStack_push_x32+take_all", |b| {
        b.iter(|| {
            idxs.iter().for_each(|&i| ts.push(black_box(i)));
            black_box(ts.take_all().fold(0u32, |a, i| a ^ i))
        })
    });
    g.finish();
}

/// T threads each doing `iters` pop+push pairs on one shared structure; reported time is wall time per
/// pair per thread (so perfect scaling keeps it flat).
fn scaling(c: &mut Criterion) {
    let mut g = c.benchmark_group("freelist/pair_mt");
    g.throughput(Throughput::Elements(1));
    let max = std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .max(2);
    let threads: Vec<usize> = [1, 2, 4, 8, 16].into_iter().filter(|&t| t <= max).collect();

    for &t in &threads {
        let list = FreeList::new_full(CAP).unwrap();
        g.bench_with_input(BenchmarkId::new("FreeList", t), &t, |b, &t| {
            b.iter_custom(|iters| {
                run_threads(t, |_| {
                    for _ in 0..iters {
                        let idx = list.pop().unwrap();
                        list.push(black_box(idx));
                    }
                })
            })
        });

        let fc = FrontCache::new_full(CAP, max.max(16), 64).unwrap();
        g.bench_with_input(BenchmarkId::new("FrontCache", t), &t, |b, &t| {
            b.iter_custom(|iters| {
                run_threads(t, |k| {
                    for _ in 0..iters {
                        let idx = fc.pop_at(k).unwrap();
                        fc.push_at(k, black_box(idx));
                    }
                })
            })
        });

        let list = FreeList::new_full(CAP).unwrap();
        g.bench_with_input(BenchmarkId::new("LocalCache64", t), &t, |b, &t| {
            b.iter_custom(|iters| {
                run_threads(t, |_| {
                    let mut cache = LocalCache::<'_, 64>::new(&list);
                    for _ in 0..iters {
                        let idx = cache.pop().unwrap();
                        cache.push(black_box(idx));
                    }
                })
            })
        });

        let q = ArrayQueue::new(CAP);
        (0..CAP as u32).for_each(|i| q.push(i).unwrap());
        g.bench_with_input(BenchmarkId::new("crossbeam_ArrayQueue", t), &t, |b, &t| {
            b.iter_custom(|iters| {
                run_threads(t, |_| {
                    for _ in 0..iters {
                        let idx = q.pop().unwrap();
                        q.push(black_box(idx)).unwrap();
                    }
                })
            })
        });

        let m = Mutex::new((0..CAP as u32).collect::<Vec<_>>());
        g.bench_with_input(BenchmarkId::new("Mutex_Vec", t), &t, |b, &t| {
            b.iter_custom(|iters| {
                run_threads(t, |_| {
                    for _ in 0..iters {
                        let idx = m.lock().unwrap().pop().unwrap();
                        m.lock().unwrap().push(black_box(idx));
                    }
                })
            })
        });
    }
    g.finish();
}

/// Runs `work(k)` on threads `k = 0..t` at once and returns the wall time from the common start to the
/// last finish.
fn run_threads(t: usize, work: impl Fn(usize) + Sync) -> Duration {
    let barrier = std::sync::Barrier::new(t + 1);
    std::thread::scope(|s| {
        for k in 0..t {
            let (barrier, work) = (&barrier, &work);
            s.spawn(move || {
                barrier.wait();
                work(k);
            });
        }
        barrier.wait();
        let start = Instant::now();
        // Leaving the scope joins every thread.
        start
    })
    .elapsed()
}

criterion_group! {
    name = benches;
    config = config();
    targets = single_thread, batches, scaling
}
criterion_main!(benches);
