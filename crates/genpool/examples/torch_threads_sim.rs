//! The pattern of `benches/gpu/torch_threads.py` (T threads, alloc+free pairs cycling 4 KiB, 64 KiB, 1 MiB
//! and 8 MiB, 16 blocks live per thread, one stream) on one pool over the simulated device: pairs per
//! second and the driver calls (page maps) per pair, to see what the engine costs apart from PyTorch.
//!
//! `cargo run --release -p genpool --example torch_threads_sim -- [PAIRS] [T...]`

use std::sync::{Arc, Barrier};
use std::time::Instant;

use gen_device::sim::SimDevice;
use gen_device::Device;
use genpool::{Config, Hint, Pool};

const SIZES: [u64; 4] = [4096, 65536, 1 << 20, 8 << 20];

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let pairs: usize = args.first().and_then(|s| s.parse().ok()).unwrap_or(100_000);
    let ts: Vec<usize> = if args.len() > 1 {
        args[1..].iter().map(|s| s.parse().unwrap()).collect()
    } else {
        vec![1, 2, 4, 8, 16]
    };
    let dev = Arc::new(SimDevice::config().capacity(140 << 30).build().unwrap());
    let cfg = Config::from_env().unwrap_or_default();
    let pool = Arc::new(Pool::new(dev.clone() as Arc<dyn Device>, cfg).unwrap());
    let body = |pool: &Pool, tid: usize, pairs: usize| {
        let mut live = [0u64; 16];
        for i in 0..pairs {
            let k = (i * 7 + tid) % 16;
            if live[k] != 0 {
                pool.free(live[k], 0).unwrap();
            }
            live[k] = pool.alloc(SIZES[(i + tid) & 3], 0, Hint::NONE).unwrap().ptr;
        }
        for p in live {
            if p != 0 {
                pool.free(p, 0).unwrap();
            }
        }
    };
    body(&pool, 0, pairs);
    for t in ts {
        let before = dev.call_counts();
        let start = Arc::new(Barrier::new(t + 1));
        let hs: Vec<_> = (0..t)
            .map(|tid| {
                let (pool, start) = (pool.clone(), start.clone());
                std::thread::spawn(move || {
                    start.wait();
                    body(&pool, tid, pairs)
                })
            })
            .collect();
        let t0 = Instant::now();
        start.wait();
        for h in hs {
            h.join().unwrap();
        }
        let secs = t0.elapsed().as_secs_f64();
        let after = dev.call_counts();
        let maps = after.maps - before.maps;
        println!(
            "threads {t:2}: {:>9.0} pairs/s, {:.3} page maps per pair, reserved peak {} MiB",
            (t * pairs) as f64 / secs,
            maps as f64 / (t * pairs) as f64,
            pool.stats().reserved_peak >> 20
        );
    }
}
