//! Thread scaling of the short-lived path, as a plain program (for profiling; the criterion bench
//! `engine/threads` is the measurement): T threads each cycle a ring of 16 blocks of 512 B – 4 KiB on
//! one stream of one pool, every 4th freed by the next thread. Prints wall ns per operation over all
//! threads and the throughput relative to one thread.
//!
//! `cargo run --release -p genpool --example threads -- [OPS_PER_THREAD] [T...]`; `GENPOOL_HANDOFF=N`
//! hands every Nth block to the next thread instead of every 4th (0: none, every thread frees its own).
//!
//! `GENPOOL_THREADS_MODE` says what the threads allocate from, to find where scaling is lost:
//! `pool` (the default: one engine), `pool-per-thread` (an engine per thread, on one device; also
//! `GENPOOL_POOL_PER_THREAD=1`), `slab` (the slab tier alone, no engine around it), `slab-per-thread`,
//! and `none` (no allocator: each thread numbers its blocks itself — the harness's own cost and the
//! machine's scaling ceiling for this loop). `GENPOOL_THREADS_SCALE=K` multiplies the sizes by K
//! (1024: 512 KiB – 4 MiB blocks, the extent arena's and page pool's locks under contention).

use std::sync::{Arc, Barrier};
use std::time::Instant;

use crossbeam_queue::ArrayQueue;
use gen_device::sim::SimDevice;
use gen_device::Device;
use gen_slab::{Slab, SlabConfig};
use gen_vmm::{PagePool, PagePoolConfig};
use genpool::{Config, Hint, Pool};

const SIZES: [u64; 4] = [512, 1024, 2048, 4096];

/// What the threads allocate from.
#[derive(Clone)]
enum Source {
    Pool(Arc<Pool>),
    Slab(Arc<Slab>),
    /// No allocator: block addresses are the thread's own count.
    None,
}

impl Source {
    fn build(mode: &str, dev: &Arc<SimDevice>) -> Source {
        let dev = dev.clone() as Arc<dyn Device>;
        match mode {
            "pool" | "pool-per-thread" => {
                Source::Pool(Arc::new(Pool::new(dev, Config::default()).unwrap()))
            }
            "slab" | "slab-per-thread" => {
                let pages = PagePool::new(dev.clone(), PagePoolConfig::default()).unwrap();
                Source::Slab(Arc::new(
                    Slab::new(&pages, dev, SlabConfig::default()).unwrap(),
                ))
            }
            "none" => Source::None,
            m => panic!("GENPOOL_THREADS_MODE: unknown mode {m:?}"),
        }
    }

    #[inline]
    fn alloc(&self, size: u64, next: &mut u64) -> u64 {
        match self {
            Source::Pool(p) => p.alloc(size, 0, Hint::NONE).unwrap().ptr,
            Source::Slab(s) => s.alloc(size, 0, true).unwrap(),
            Source::None => {
                *next += 512;
                *next
            }
        }
    }

    #[inline]
    fn free(&self, ptr: u64) {
        match self {
            Source::Pool(p) => {
                p.free(ptr, 0).unwrap();
            }
            Source::Slab(s) => {
                s.free(ptr, 0).unwrap();
            }
            Source::None => {
                std::hint::black_box(ptr);
            }
        }
    }
}

fn run(threads: usize, ops: usize, handoff: usize, mode: &str) -> f64 {
    let dev = Arc::new(SimDevice::config().capacity(8 << 30).build().unwrap());
    let shared = Source::build(mode, &dev);
    // A source per thread (on one device): what sharing costs.
    let own = mode.ends_with("-per-thread");
    let pools: Vec<Source> = (0..threads)
        .map(|_| {
            if own {
                Source::build(mode, &dev)
            } else {
                shared.clone()
            }
        })
        .collect();
    let scale: u64 = std::env::var("GENPOOL_THREADS_SCALE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1)
        .max(1);
    // The hand-off queues hold the same bytes at every scale (64 Ki blocks of 512 B at scale 1): a
    // thread the OS deschedules lets its queue fill, and at scale 1024 an unbounded share of the
    // device's memory would wait there (16 threads ran the simulated 8 GiB out on the GPU host).
    let depth = ((1u64 << 16) / scale).max(16) as usize;
    let queues: Arc<Vec<ArrayQueue<u64>>> =
        Arc::new((0..threads).map(|_| ArrayQueue::new(depth)).collect());
    let start = Arc::new(Barrier::new(threads + 1));
    let hs: Vec<_> = (0..threads)
        .map(|i| {
            let (pool, queues, start) = (pools[i].clone(), queues.clone(), start.clone());
            std::thread::spawn(move || {
                let mut ring = std::collections::VecDeque::with_capacity(16);
                let mut next = (i as u64) << 40;
                start.wait();
                for k in 0..ops / 2 {
                    let size = SIZES[k % 4] * scale;
                    let p = pool.alloc(size, &mut next);
                    ring.push_back(p);
                    if ring.len() > 16 {
                        let p = ring.pop_front().unwrap();
                        if handoff != 0 && k % handoff == 0 {
                            // Handed to the next thread, freed there.
                            if queues[(i + 1) % threads].push(p).is_err() {
                                pool.free(p);
                            }
                        } else {
                            pool.free(p);
                        }
                    }
                    if handoff != 0 {
                        if let Some(p) = queues[i].pop() {
                            pool.free(p);
                        }
                    }
                }
                for p in ring {
                    pool.free(p);
                }
            })
        })
        .collect();
    let t0 = Instant::now();
    start.wait();
    for h in hs {
        h.join().unwrap();
    }
    let dt = t0.elapsed();
    for q in queues.iter() {
        while let Some(p) = q.pop() {
            shared.free(p);
        }
    }
    dt.as_nanos() as f64 / (threads * ops) as f64
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let ops: usize = args
        .first()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2_000_000);
    let ts: Vec<usize> = if args.len() > 1 {
        args[1..].iter().map(|s| s.parse().unwrap()).collect()
    } else {
        vec![1, 2, 4, 8, 16]
    };
    let handoff = std::env::var("GENPOOL_HANDOFF")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4);
    let mode = match std::env::var("GENPOOL_THREADS_MODE") {
        Ok(m) => m,
        Err(_) if std::env::var_os("GENPOOL_POOL_PER_THREAD").is_some() => "pool-per-thread".into(),
        Err(_) => "pool".into(),
    };
    if mode.ends_with("-per-thread") && handoff != 0 {
        eprintln!("{mode} needs GENPOOL_HANDOFF=0 (a block goes back to the source it came from)");
        std::process::exit(2);
    }
    let mut base = None;
    for t in ts {
        let ns = run(t, ops, handoff, &mode);
        let b = *base.get_or_insert(ns);
        println!(
            "threads {t:2}: {ns:7.1} ns/op wall, throughput {:.2}x one thread",
            b / ns
        );
    }
}
