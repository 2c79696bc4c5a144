//! Thread scaling of the short-lived path, as a plain program (for profiling; the criterion bench
//! `engine/threads` is the measurement): T threads each cycle a ring of 16 blocks of 512 B – 4 KiB on
//! one stream of one pool, every 4th freed by the next thread. Prints wall ns per operation over all
//! threads and the throughput relative to one thread.
//!
//! `cargo run --release -p genpool --example threads -- [OPS_PER_THREAD] [T...]`; `GENPOOL_HANDOFF=N`
//! hands every Nth block to the next thread instead of every 4th (0: none, every thread frees its own).

use std::sync::{Arc, Barrier};
use std::time::Instant;

use crossbeam_queue::ArrayQueue;
use gen_device::sim::SimDevice;
use gen_device::Device;
use genpool::{Config, Hint, Pool};

const SIZES: [u64; 4] = [512, 1024, 2048, 4096];

fn run(threads: usize, ops: usize, handoff: usize) -> f64 {
    let dev = Arc::new(SimDevice::config().capacity(8 << 30).build().unwrap());
    let pool = Arc::new(Pool::new(dev.clone() as Arc<dyn Device>, Config::default()).unwrap());
    // GENPOOL_POOL_PER_THREAD=1: each thread its own pool (on one device): what sharing costs.
    let own = std::env::var_os("GENPOOL_POOL_PER_THREAD").is_some();
    let pools: Vec<Arc<Pool>> = (0..threads)
        .map(|_| {
            if own {
                Arc::new(Pool::new(dev.clone() as Arc<dyn Device>, Config::default()).unwrap())
            } else {
                pool.clone()
            }
        })
        .collect();
    let queues: Arc<Vec<ArrayQueue<u64>>> =
        Arc::new((0..threads).map(|_| ArrayQueue::new(1 << 16)).collect());
    let start = Arc::new(Barrier::new(threads + 1));
    let hs: Vec<_> = (0..threads)
        .map(|i| {
            let (pool, queues, start) = (pools[i].clone(), queues.clone(), start.clone());
            std::thread::spawn(move || {
                let mut ring = std::collections::VecDeque::with_capacity(16);
                start.wait();
                for k in 0..ops / 2 {
                    let size = SIZES[k % 4];
                    let b = pool.alloc(size, 0, Hint::NONE).unwrap();
                    ring.push_back(b.ptr);
                    if ring.len() > 16 {
                        let p = ring.pop_front().unwrap();
                        if handoff != 0 && k % handoff == 0 {
                            // Handed to the next thread, freed there.
                            if queues[(i + 1) % threads].push(p).is_err() {
                                pool.free(p, 0).unwrap();
                            }
                        } else {
                            pool.free(p, 0).unwrap();
                        }
                    }
                    if handoff != 0 {
                        if let Some(p) = queues[i].pop() {
                            pool.free(p, 0).unwrap();
                        }
                    }
                }
                for p in ring {
                    pool.free(p, 0).unwrap();
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
            pool.free(p, 0).unwrap();
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
    let mut base = None;
    for t in ts {
        let ns = run(t, ops, handoff);
        let b = *base.get_or_insert(ns);
        println!(
            "threads {t:2}: {ns:7.1} ns/op wall, throughput {:.2}x one thread",
            b / ns
        );
    }
}
