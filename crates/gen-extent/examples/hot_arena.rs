//! The extent arena alone (with its page pool) on the large-block path's floor: one block allocated and
//! freed back to back, every line in cache, simulated device. Against `genpool/examples/hotpair.rs` (the
//! same through the engine) it splits a call's constant between the arena and the engine around it.
//!
//!     cargo run --release -p gen-extent --example hot_arena -- [SIZE_MIB] [PAIRS]
//!
//! Session 18 (2-core build machine, 8 MiB): 55.6–57.9 ns a call here, 82.3–86.4 through the engine.

use std::sync::Arc;
use std::time::Instant;

use gen_device::sim::SimDevice;
use gen_extent::{ExtentArena, ExtentConfig};
use gen_vmm::{PagePool, PagePoolConfig};

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
    let pool = PagePool::new(dev, PagePoolConfig::default()).expect("page pool");
    let arena = ExtentArena::new(&pool, ExtentConfig::default()).expect("arena");
    let pair = || {
        let p = arena.alloc(size, true).expect("alloc");
        arena.free(p).expect("free");
    };
    for _ in 0..pairs / 10 {
        pair();
    }
    let t0 = Instant::now();
    for _ in 0..pairs {
        pair();
    }
    println!(
        "{} MiB, the arena alone: {:.1} ns a call",
        size >> 20,
        t0.elapsed().as_nanos() as f64 / (2 * pairs) as f64
    );
}
