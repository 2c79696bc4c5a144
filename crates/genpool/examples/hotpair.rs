//! The large-block path's floor: one extent block allocated and freed back to back on one stream, so
//! every line the engine touches stays in cache and nothing but the per-call work of its layers (the
//! route, the record, best fit and tags, the page references, three locks) is timed. Simulated device.
//!
//!     cargo run --release -p genpool --example hotpair -- [SIZE_MIB] [PAIRS]
//!
//! Session 18 (2-core build machine): 80–86 ns a call for 8 MiB, 1 MiB the same, 40 MiB ~100 — against
//! 71–139 ns a call in the trace replays, so most of a replay's call is this constant, not misses.

use std::sync::Arc;
use std::time::Instant;

use gen_device::sim::SimDevice;
use genpool::{Config, Hint, Pool};

fn main() {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("a number"))
        .collect();
    let size = args.first().copied().unwrap_or(8) << 20;
    let pairs = args.get(1).copied().unwrap_or(2_000_000);
    let dev = Arc::new(
        SimDevice::config()
            .capacity(80 << 30)
            .build()
            .expect("device"),
    );
    let pool = Pool::new(dev, Config::default()).expect("pool");
    let pair = || {
        let p = pool.alloc(size, 0, Hint::default()).expect("alloc").ptr;
        pool.free(p, 0).expect("free");
    };
    for _ in 0..pairs / 10 {
        pair();
    }
    let t0 = Instant::now();
    for _ in 0..pairs {
        pair();
    }
    println!(
        "{} MiB: {:.1} ns a call",
        size >> 20,
        t0.elapsed().as_nanos() as f64 / (2 * pairs) as f64
    );
}
