//! Fragmentation of the extent arena on synthetic activation-like workloads (simulated device, 2 MiB
//! pages).
//!
//! `cargo run --release -p gen-extent --example extent_fragmentation`
//!
//! Prints, per workload, peak committed bytes / peak live bytes (1.000 = every committed byte is live)
//! and the mean cost of an alloc or free on the simulated device.

use std::sync::Arc;
use std::time::Instant;

use gen_device::sim::SimDevice;
use gen_device::Device;
use gen_extent::{ExtentArena, ExtentConfig};
use gen_vmm::{PagePool, PagePoolConfig};

const MIB: u64 = 1 << 20;

/// xorshift64*: deterministic, dependency-free.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo)
    }
    /// Log-uniform in [lo, hi).
    fn log_uniform(&mut self, lo: u64, hi: u64) -> u64 {
        let (a, b) = ((lo as f64).ln(), (hi as f64).ln());
        let x = a + (b - a) * (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        (x.exp() as u64).max(lo)
    }
}

struct Run {
    arena: ExtentArena,
    live: u64,
    peak_live: u64,
    ops: u64,
    started: Instant,
}

impl Run {
    fn new() -> Self {
        let dev = Arc::new(
            SimDevice::config()
                .capacity(141 << 30)
                .build()
                .expect("sim device"),
        );
        let pool = PagePool::new(dev as Arc<dyn Device>, PagePoolConfig::default()).expect("pool");
        let arena = ExtentArena::new(&pool, ExtentConfig::default()).expect("arena");
        Run {
            arena,
            live: 0,
            peak_live: 0,
            ops: 0,
            started: Instant::now(),
        }
    }
    fn alloc(&mut self, size: u64) -> u64 {
        let p = self.arena.alloc(size, true).expect("alloc");
        self.live += size.div_ceil(512) * 512;
        self.peak_live = self.peak_live.max(self.live);
        self.ops += 1;
        p
    }
    fn free(&mut self, p: u64) {
        self.live -= self.arena.free(p).expect("free");
        self.ops += 1;
    }
    fn report(&self, name: &str) {
        let s = self.arena.stats();
        assert_eq!(s.peak_live_bytes, self.peak_live);
        println!(
            "{name:<46} peak live {:>9.1} MiB  peak committed {:>9.1} MiB  ratio {:.4}  {:>5.0} ns/op",
            self.peak_live as f64 / MIB as f64,
            s.peak_committed_bytes as f64 / MIB as f64,
            s.peak_committed_bytes as f64 / self.peak_live as f64,
            self.started.elapsed().as_nanos() as f64 / self.ops as f64
        );
    }
}

/// One training step of a GPT-like model's activations (bf16): forward saves per-layer activations and
/// makes short-lived temporaries; backward frees them in reverse with its own gradient temporaries.
fn train_step(r: &mut Run, layers: u64, b: u64, t: u64, c: u64, heads: u64) {
    let bt = b * t;
    let act = |n: u64| bt * c * n * 2;
    let mut saved: Vec<Vec<u64>> = Vec::new();
    let mut x = r.alloc(act(1)); // embeddings output
    for _ in 0..layers {
        let mut keep = vec![x];
        let ln1 = r.alloc(act(1));
        let qkv = r.alloc(act(3));
        let scores = r.alloc(b * heads * t * t * 2); // attention scores: temporary
        let probs = r.alloc(b * heads * t * t * 2);
        r.free(scores);
        let attn = r.alloc(act(1));
        r.free(probs);
        let proj = r.alloc(act(1));
        let ln2 = r.alloc(act(1));
        let fc = r.alloc(act(4));
        let gelu = r.alloc(act(4));
        let out = r.alloc(act(1));
        keep.extend([ln1, qkv, attn, proj, ln2, fc, gelu]);
        saved.push(keep);
        x = out;
    }
    let logits = r.alloc(bt * 50257 * 2);
    r.free(x);
    let mut grad = r.alloc(act(1));
    r.free(logits);
    for keep in saved.into_iter().rev() {
        let g_fc = r.alloc(act(4));
        let g_gelu = r.alloc(act(4));
        r.free(g_fc);
        let g_qkv = r.alloc(act(3));
        let scores = r.alloc(b * heads * t * t * 2);
        r.free(scores);
        r.free(g_gelu);
        r.free(g_qkv);
        let g_in = r.alloc(act(1));
        r.free(grad);
        grad = g_in;
        for p in keep {
            r.free(p);
        }
    }
    r.free(grad);
}

fn main() {
    let mut r = Run::new();
    for _ in 0..6 {
        train_step(&mut r, 12, 8, 1024, 768, 12);
    }
    r.report("GPT-2 small step, fixed 8x1024 (6 steps)");

    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut r = Run::new();
    for _ in 0..12 {
        let (b, t) = (rng.range(4, 17), rng.range(32, 1025));
        train_step(&mut r, 24, b, t, 1024, 16);
    }
    r.report("GPT-2 medium step, varlen 4-16 x 32-1024 (12)");

    // Random sizes 1..64 MiB with random lifetimes: keep ~200 live, free a random one per alloc.
    let mut r = Run::new();
    let mut live = Vec::new();
    for _ in 0..50_000 {
        live.push(r.alloc(rng.log_uniform(MIB, 64 * MIB) + rng.range(0, 4096)));
        if live.len() > 200 {
            let victim = live.swap_remove((rng.next() % live.len() as u64) as usize);
            r.free(victim);
        }
    }
    r.report("random 1-64 MiB, ~200 live, random frees (50k)");
}
