//! The large-block path's floor: one extent block allocated and freed back to back on one stream, so
//! every line touched stays in cache and nothing but the per-call work of the layers is timed —
//! through the engine (the route, the record, the books, best fit and tags, the page references, three
//! locks), then through the extent arena and its page pool alone, which splits the constant between
//! the arena and the engine around it. Simulated device.
//!
//!     cargo run --release -p genpool --example hotpair -- [SIZE_MIB] [PAIRS]
//!
//! Session 18 (2-core build machine): the engine 75–88 ns a call for 1–40 MiB blocks (against 71–139 ns
//! a call in the trace replays: most of a replay's call is this constant, not misses), the arena alone
//! 55.6–58.1 for 8 MiB.

use std::sync::Arc;
use std::time::Instant;

use gen_device::sim::SimDevice;
use gen_extent::{ExtentArena, ExtentConfig};
use gen_vmm::{PagePool, PagePoolConfig};
use genpool::{Config, Hint, Pool};

/// ns a call of `pairs` alloc/free pairs of `pair`, after a tenth as many to warm up.
fn time(pairs: u64, pair: impl Fn()) -> f64 {
    for _ in 0..pairs / 10 {
        pair();
    }
    let t0 = Instant::now();
    for _ in 0..pairs {
        pair();
    }
    t0.elapsed().as_nanos() as f64 / (2 * pairs) as f64
}

fn device() -> Arc<SimDevice> {
    Arc::new(
        SimDevice::config()
            .capacity(80 << 30)
            .build()
            .expect("device"),
    )
}

fn main() {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("a number"))
        .collect();
    let size = args.first().copied().unwrap_or(8) << 20;
    let pairs = args.get(1).copied().unwrap_or(2_000_000);
    let pool = Pool::new(device(), Config::default()).expect("pool");
    let engine = time(pairs, || {
        let p = pool.alloc(size, 0, Hint::default()).expect("alloc").ptr;
        pool.free(p, 0).expect("free");
    });
    let pages = PagePool::new(device(), PagePoolConfig::default()).expect("page pool");
    let arena = ExtentArena::new(&pages, ExtentConfig::default()).expect("arena");
    let alone = time(pairs, || {
        let p = arena.alloc(size, true).expect("alloc");
        arena.free(p).expect("free");
    });
    println!(
        "{} MiB: {engine:.1} ns a call through the engine, {alone:.1} through the arena alone",
        size >> 20
    );
}
