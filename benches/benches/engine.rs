//! genpool: the engine's hot path per tier, and the short-lived path's thread scaling, on a simulated
//! device (`SimDevice`, no host backing: device calls are bookkeeping only, so what is timed is the
//! engine — classifier, routing, metadata table, tier free lists — and its trips to the device).
//!
//! `cargo bench -p genpool-benches --bench engine` (about 40 s on 2 cores; add `-- --quick` for a
//! faster, rougher pass, or a filter such as `-- engine/warm`).
//!
//! - `engine/warm/<tier>/<size>`: a ring of [`RING`] live blocks of one size, the oldest freed and a new
//!   one allocated each iteration (one alloc + one free per iteration, so criterion's time is ns per
//!   pair). The tier is forced with a lifetime hint and the configuration: `slab` (short hint),
//!   `extent` (short hint, above the slab's largest size), `buddy` (`experimental.long_tier:buddy`, long hint),
//!   `stream` (`experimental.mid_tier:stream`, mid hint: a private stream-ordered driver pool). `slab/mixed` cycles
//!   sizes of 512 B – 4 KiB. Before each run the bench prints the tier that served the ring and how
//!   many device calls one steady-state pair makes (a warm tier should make none).
//! - `engine/classifier/<mode>/<size>`: the same ring with the classifier in charge: `hinted` (short
//!   hint: the prediction is scored but overridden), `predicted` (no hint: the classifier routes) and
//!   `single` (`experimental.routing:single`: lifetime ignored, size alone routes).
//! - `engine/threads/<T>`: T threads each cycling a ring of 16 short-lived blocks of 512 B – 4 KiB on one
//!   stream; every 4th block is handed to the next thread through a bounded queue and freed there (a
//!   cross-thread free; with T = 1 the thread hands blocks to itself). Time is wall time per operation
//!   (an alloc or a free) over all threads: the machine's throughput, so perfect scaling divides it by T.
//!   Thread counts above the machine's cores are run too (oversubscribed: they show contention under
//!   preemption, not parallel speed-up).

use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use crossbeam_queue::ArrayQueue;
use gen_device::sim::SimDevice;
use gen_device::Device;
use genpool::{Config, Hint, Lifetime, Pool, Tier};

/// Live blocks per ring.
const RING: usize = 16;
const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// Short-lived sizes for the mixed ring and the thread bench (all within the slab's default 4 KiB).
const SHORT_SIZES: [u64; 8] = [512, 4096, 1536, 1024, 3584, 2048, 512, 2560];
/// One free in this many is handed to another thread in the thread bench.
const HANDOFF_EVERY: usize = 4;

fn config() -> Criterion {
    Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
}

fn hint(l: Lifetime) -> Hint {
    Hint {
        lifetime: Some(l),
        site: None,
    }
}

/// A pool on a fresh simulated device of 256 GiB (enough for 16 live 64 MiB blocks many times over).
fn pool(conf: &str) -> (Arc<SimDevice>, Pool) {
    let dev = Arc::new(
        SimDevice::config()
            .capacity(256 * GIB)
            .build()
            .expect("sim device"),
    );
    let cfg = Config::parse(conf).expect("bench configuration");
    let pool = Pool::new(dev.clone() as Arc<dyn Device>, cfg).expect("pool");
    (dev, pool)
}

/// A ring of live blocks cycling through `sizes`: each step frees the oldest and allocates the next.
struct Ring<'a> {
    pool: &'a Pool,
    hint: Hint,
    sizes: &'a [u64],
    live: Vec<u64>,
    k: usize,
}

impl<'a> Ring<'a> {
    /// Fill the ring and run it a few laps, so every size class, cache and page is in place.
    fn warm(pool: &'a Pool, hint: Hint, sizes: &'a [u64]) -> (Self, Tier) {
        let first = pool.alloc(sizes[0], 0, hint).expect("first block");
        let mut live = vec![first.ptr];
        live.extend((1..RING).map(|i| {
            pool.alloc(sizes[i % sizes.len()], 0, hint)
                .expect("ring block")
                .ptr
        }));
        let mut ring = Ring {
            pool,
            hint,
            sizes,
            live,
            k: 0,
        };
        for _ in 0..4 * RING {
            ring.step();
        }
        (ring, first.tier)
    }

    #[inline]
    fn step(&mut self) {
        let j = self.k % RING;
        self.pool.free(black_box(self.live[j]), 0).expect("free");
        let size = self.sizes[self.k % self.sizes.len()];
        self.live[j] = self
            .pool
            .alloc(black_box(size), 0, self.hint)
            .expect("alloc")
            .ptr;
        self.k += 1;
    }

    fn finish(self) {
        for p in self.live {
            self.pool.free(p, 0).expect("final free");
        }
    }
}

/// Device calls one steady-state step makes, averaged over `steps`.
fn calls_per_step(dev: &SimDevice, ring: &mut Ring<'_>, steps: usize) -> f64 {
    let before = dev.calls();
    for _ in 0..steps {
        ring.step();
    }
    dev.calls().since(&before).total() as f64 / steps as f64
}

/// Bench one ring as `id` in `g` (named `g_name`), after checking the tier it lands in.
fn bench_ring(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    g_name: &str,
    id: String,
    conf: &str,
    hint: Hint,
    sizes: &[u64],
    expect: Option<Tier>,
) {
    let (dev, pool) = pool(conf);
    let (mut ring, tier) = Ring::warm(&pool, hint, sizes);
    if let Some(want) = expect {
        assert_eq!(tier, want, "{id}: configuration '{conf}' routed elsewhere");
    }
    let calls = calls_per_step(&dev, &mut ring, 1000);
    eprintln!(
        "{}/{id}: tier {}, {calls:.2} device calls per alloc+free pair once warm",
        g_name,
        tier.name()
    );
    g.bench_function(id, |b| b.iter(|| ring.step()));
    ring.finish();
}

fn warm(c: &mut Criterion) {
    const G: &str = "engine/warm";
    let mut g = c.benchmark_group(G);
    g.throughput(Throughput::Elements(1));
    let short = hint(Lifetime::Short);
    for size in [512, 4 * KIB] {
        let id = format!("slab/{size}");
        bench_ring(&mut g, G, id, "", short, &[size], Some(Tier::Slab));
    }
    let id = "slab/mixed".to_string();
    bench_ring(&mut g, G, id, "", short, &SHORT_SIZES, Some(Tier::Slab));
    for size in [MIB, 64 * MIB] {
        let id = format!("extent/{size}");
        bench_ring(&mut g, G, id, "", short, &[size], Some(Tier::Extent));
    }
    let long = hint(Lifetime::Long);
    for size in [64 * KIB, 4 * MIB] {
        let id = format!("buddy/{size}");
        bench_ring(
            &mut g,
            G,
            id,
            "experimental.long_tier:buddy",
            long,
            &[size],
            Some(Tier::Buddy),
        );
    }
    let mid = hint(Lifetime::Mid);
    for size in [4 * KIB, MIB] {
        let id = format!("stream/{size}");
        bench_ring(
            &mut g,
            G,
            id,
            "experimental.mid_tier:stream",
            mid,
            &[size],
            Some(Tier::Stream),
        );
    }
    g.finish();
}

fn classifier(c: &mut Criterion) {
    const G: &str = "engine/classifier";
    let mut g = c.benchmark_group(G);
    g.throughput(Throughput::Elements(1));
    let modes = [
        ("hinted", "", hint(Lifetime::Short)),
        ("predicted", "", Hint::NONE),
        ("single", "experimental.routing:single", Hint::NONE),
    ];
    for size in [4 * KIB, MIB] {
        for (mode, conf, h) in modes {
            bench_ring(&mut g, G, format!("{mode}/{size}"), conf, h, &[size], None);
        }
    }
    g.finish();
}

/// One worker of the thread bench: `steps` ring steps; every [`HANDOFF_EVERY`]th freed block goes to
/// `outbox` (freed by the next thread), and each step frees one block from `inbox` if there is one.
fn worker(
    pool: &Pool,
    i: usize,
    steps: u64,
    inbox: &ArrayQueue<u64>,
    outbox: &ArrayQueue<u64>,
    start: &Barrier,
    done: &Barrier,
) {
    let short = hint(Lifetime::Short);
    let size = |k: usize| SHORT_SIZES[(k + i) % SHORT_SIZES.len()];
    let mut ring: Vec<u64> = (0..RING)
        .map(|k| pool.alloc(size(k), 0, short).expect("ring block").ptr)
        .collect();
    start.wait();
    for k in 0..steps as usize {
        let j = k % RING;
        let old = ring[j];
        if k % HANDOFF_EVERY != 0 || outbox.push(old).is_err() {
            pool.free(old, 0).expect("free");
        }
        if let Some(p) = inbox.pop() {
            pool.free(p, 0).expect("cross-thread free");
        }
        ring[j] = pool.alloc(size(k), 0, short).expect("alloc").ptr;
    }
    done.wait();
    // Every thread has stopped pushing: free what is left in this thread's inbox, then the ring.
    while let Some(p) = inbox.pop() {
        pool.free(p, 0).expect("cross-thread free");
    }
    for p in ring {
        pool.free(p, 0).expect("final free");
    }
}

fn threads(c: &mut Criterion) {
    let mut g = c.benchmark_group("engine/threads");
    g.throughput(Throughput::Elements(1));
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    eprintln!("engine/threads: {cores} cores available");
    for threads in [1usize, 2, 4, 8, 16] {
        g.bench_with_input(
            BenchmarkId::from_parameter(threads),
            &threads,
            |b, &threads| {
                let (_dev, pool) = pool("");
                let pool = Arc::new(pool);
                b.iter_custom(|iters| {
                    // One iteration = one operation (alloc or free); a step is one of each.
                    let steps = iters.div_ceil(2 * threads as u64).max(1);
                    let queues: Arc<Vec<ArrayQueue<u64>>> =
                        Arc::new((0..threads).map(|_| ArrayQueue::new(4 * RING)).collect());
                    let start = Arc::new(Barrier::new(threads + 1));
                    let done = Arc::new(Barrier::new(threads + 1));
                    let hs: Vec<_> = (0..threads)
                        .map(|i| {
                            let (pool, queues) = (pool.clone(), queues.clone());
                            let (start, done) = (start.clone(), done.clone());
                            std::thread::spawn(move || {
                                let (inbox, outbox) = (&queues[i], &queues[(i + 1) % threads]);
                                worker(&pool, i, steps, inbox, outbox, &start, &done);
                            })
                        })
                        .collect();
                    start.wait();
                    let t0 = Instant::now();
                    done.wait();
                    let elapsed = t0.elapsed();
                    for h in hs {
                        h.join().expect("worker");
                    }
                    assert_eq!(pool.live_blocks(), 0, "every block freed");
                    // Wall time of about `iters` operations over all threads.
                    elapsed.mul_f64(iters as f64 / (2 * steps * threads as u64) as f64)
                })
            },
        );
    }
    g.finish();
}

criterion_group! { name = benches; config = config(); targets = warm, classifier, threads }
criterion_main!(benches);
