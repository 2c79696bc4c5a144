//! Host cost of the engine's alloc/free with cold caches, as inside a training program: PyTorch runs
//! thousands of instructions (kernel launches, autograd) between two allocator calls, which evicts the
//! allocator's data from L1/L2. A replay that calls the engine back to back (`tiers`) measures it warm.
//!
//!     cargo run --release -p genpool --features replay --example coldops -- TRACE [CONF]
//!
//! `THRASH_KB` (default 2048): bytes of an unrelated buffer touched (one write per 64-B line) before
//! every call; only the engine call itself is timed. `PASSES` (default 3): passes over the trace, the
//! first not counted.

use std::sync::Arc;
use std::time::Instant;

use gen_device::SimDevice;
use gen_trace::{ReplayAllocator, ReplayError};
use genpool::replay::EngineReplay;
use genpool::{Config, Pool};

struct Cold {
    inner: EngineReplay,
    junk: Vec<u64>,
    round: u64,
    counting: bool,
    /// The counted passes' calls: alloc ns, allocs, free ns, frees.
    counted: [u64; 4],
    /// Every call (first pass included), in the same layout — read between passes.
    shared: std::rc::Rc<std::cell::Cell<[u64; 4]>>,
    /// Per tier (slab, extent, other): alloc ns, allocs, free ns, frees.
    by_tier: [[u64; 4]; 3],
    /// Tier of each live block, kept by the harness: looking it up in the engine before a free would warm
    /// the very metadata the timed free reads.
    tiers: std::collections::HashMap<u64, usize>,
}

fn tier_index(pool: &Pool, ptr: u64) -> usize {
    match pool.lookup(ptr).map(|b| b.tier) {
        Some(genpool::Tier::Slab) => 0,
        Some(genpool::Tier::Extent) => 1,
        _ => 2,
    }
}

impl Cold {
    #[inline(never)]
    fn thrash(&mut self) {
        self.round = self.round.wrapping_add(1);
        let r = self.round;
        for w in self.junk.iter_mut().step_by(8) {
            *w = w.wrapping_add(r);
        }
        std::hint::black_box(&self.junk);
    }

    /// Count one call of `ns` nanoseconds: `at` 0 for an allocation, 2 for a free; `tier` when known.
    fn note(&mut self, at: usize, tier: Option<usize>, ns: u64) {
        let mut all = self.shared.get();
        all[at] += ns;
        all[at + 1] += 1;
        self.shared.set(all);
        if self.counting {
            self.counted[at] += ns;
            self.counted[at + 1] += 1;
            if let Some(i) = tier {
                self.by_tier[i][at] += ns;
                self.by_tier[i][at + 1] += 1;
            }
        }
    }
}

impl ReplayAllocator for Cold {
    fn name(&self) -> String {
        self.inner.name()
    }
    fn alloc(&mut self, size: u64, stream: u64, site: Option<u64>) -> Result<u64, ReplayError> {
        self.thrash();
        let t = Instant::now();
        let r = self.inner.alloc(size, stream, site);
        let ns = t.elapsed().as_nanos() as u64;
        let tier = match r {
            Ok(p) => {
                let i = tier_index(self.inner.pool(), p);
                self.tiers.insert(p, i);
                Some(i)
            }
            _ => None,
        };
        self.note(0, tier, ns);
        r
    }
    fn free(&mut self, ptr: u64, size: u64, stream: u64) -> Result<(), ReplayError> {
        let i = self.tiers.remove(&ptr);
        self.thrash();
        let t = Instant::now();
        let r = self.inner.free(ptr, size, stream);
        self.note(2, i, t.elapsed().as_nanos() as u64);
        r
    }
    fn reserved(&self) -> u64 {
        self.inner.reserved()
    }
    fn peak_reserved(&self) -> u64 {
        self.inner.peak_reserved()
    }
    fn mark_iteration(&mut self) {
        self.inner.mark_iteration()
    }
    fn end_pass(&mut self) {
        self.inner.end_pass();
        self.counting = true;
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = args.get(1).expect("usage: coldops TRACE [CONF]");
    let cfg = Config::parse(args.get(2).map_or("", String::as_str)).expect("config");
    let kb: usize = std::env::var("THRASH_KB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2048);
    let passes: u32 = std::env::var("PASSES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    for trace in gen_trace::load_path(std::path::Path::new(path)).expect("trace") {
        let dev = Arc::new(SimDevice::config().capacity(141 << 30).build().unwrap());
        let pool = Pool::new(dev, cfg.clone()).unwrap();
        let mut cold = Cold {
            inner: EngineReplay::new(pool, "genpool"),
            junk: vec![0; kb * 1024 / 8],
            round: 0,
            counting: false,
            counted: [0; 4],
            shared: Default::default(),
            by_tier: [[0; 4]; 3],
            tiers: Default::default(),
        };
        let opts = gen_trace::ReplayOptions {
            passes,
            ignore_site: true,
        };
        let plan = gen_trace::ReplayPlan::new(&trace).unwrap();
        // PER_PASS=1: each pass's own figures (does anything grow over a long run?).
        let per_pass = std::env::var_os("PER_PASS").is_some();
        let shared = cold.shared.clone();
        let mut last = [0u64; 4];
        gen_trace::replay_plan(&plan, &mut cold, &opts, &mut |pass| {
            if per_pass {
                let now = shared.get();
                println!(
                    "  pass {pass}: alloc {:.0} ns  free {:.0} ns",
                    (now[0] - last[0]) as f64 / (now[1] - last[1]).max(1) as f64,
                    (now[2] - last[2]) as f64 / (now[3] - last[3]).max(1) as f64
                );
                last = now;
            }
        })
        .unwrap();
        println!(
            "{}: thrash {kb} KiB  alloc {:.0} ns ({} calls)  free {:.0} ns ({} calls)",
            trace.name,
            cold.counted[0] as f64 / cold.counted[1].max(1) as f64,
            cold.counted[1],
            cold.counted[2] as f64 / cold.counted[3].max(1) as f64,
            cold.counted[3]
        );
        for (name, t) in ["slab", "extent", "other"].iter().zip(cold.by_tier) {
            println!(
                "  {name:6} alloc {:5.0} ns x {:7}  free {:5.0} ns x {:7}",
                t[0] as f64 / t[1].max(1) as f64,
                t[1],
                t[2] as f64 / t[3].max(1) as f64,
                t[3]
            );
        }
    }
}
