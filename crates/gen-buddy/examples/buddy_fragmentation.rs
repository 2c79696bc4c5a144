//! Fragmentation of the buddy tier on synthetic long-lived workloads (simulated device, 2 MiB pages).
//!
//! `cargo run --release -p gen-buddy --example buddy_fragmentation`
//!
//! Prints, per workload, peak committed bytes / peak live bytes (1.000 = every committed byte is live).

use std::sync::Arc;

use gen_buddy::{Buddy, BuddyConfig};
use gen_device::sim::SimDevice;
use gen_device::Device;
use gen_vmm::{PagePool, PagePoolConfig};

const KIB: u64 = 1 << 10;
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
    /// Log-uniform in [lo, hi).
    fn log_uniform(&mut self, lo: u64, hi: u64) -> u64 {
        let (a, b) = ((lo as f64).ln(), (hi as f64).ln());
        let x = a + (b - a) * (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        (x.exp() as u64).max(lo)
    }
}

/// GPT-style parameter shapes in fp32 bytes: `layers` blocks of hidden size `h`, vocabulary `v`.
fn gpt_params(layers: u64, h: u64, v: u64, ctx: u64) -> Vec<u64> {
    let mut p = vec![v * h * 4, ctx * h * 4];
    for _ in 0..layers {
        p.extend([h * 4, h * 4]); // ln_1
        p.extend([h * 3 * h * 4, 3 * h * 4]); // c_attn
        p.extend([h * h * 4, h * 4]); // attn c_proj
        p.extend([h * 4, h * 4]); // ln_2
        p.extend([h * 4 * h * 4, 4 * h * 4]); // c_fc
        p.extend([4 * h * h * 4, h * 4]); // mlp c_proj
    }
    p.extend([h * 4, h * 4]); // ln_f
    p
}

struct Run {
    buddy: Buddy,
    live: u64,
    peak_live: u64,
}

impl Run {
    fn new() -> Self {
        let dev = Arc::new(
            SimDevice::config()
                .capacity(256 << 30)
                .build()
                .expect("sim device"),
        );
        let pool = PagePool::new(dev as Arc<dyn Device>, PagePoolConfig::default()).expect("pool");
        Run {
            buddy: Buddy::new(&pool, BuddyConfig::default()).expect("buddy"),
            live: 0,
            peak_live: 0,
        }
    }
    fn alloc(&mut self, size: u64) -> u64 {
        let p = self.buddy.alloc(size, true).expect("alloc");
        self.live += size.div_ceil(512) * 512;
        self.peak_live = self.peak_live.max(self.live);
        p
    }
    fn free(&mut self, p: u64) {
        self.live -= self.buddy.free(p).expect("free");
    }
    fn report(&self, name: &str) {
        let s = self.buddy.stats();
        println!(
            "{name:<44} peak live {:>9.1} MiB  peak committed {:>9.1} MiB  ratio {:.4}  regions {}",
            self.peak_live as f64 / MIB as f64,
            s.peak_committed_bytes as f64 / MIB as f64,
            s.peak_committed_bytes as f64 / self.peak_live as f64,
            s.regions
        );
    }
}

fn main() {
    for (name, layers, h, v) in [
        ("GPT-2 small", 12, 768, 50257),
        ("GPT-2 medium", 24, 1024, 50257),
    ] {
        // Parameters, then gradients, then AdamW's two moment buffers: all long-lived.
        let params = gpt_params(layers, h, v, 1024);
        let mut r = Run::new();
        for _ in 0..4 {
            for &s in &params {
                r.alloc(s);
            }
        }
        r.report(&format!("{name}: params+grads+adam (fp32)"));
    }
    // Random long-lived sizes, log-uniform 512 B .. 64 MiB, with 20 % churn (free + realloc).
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut r = Run::new();
    let mut live = Vec::new();
    for i in 0..4000 {
        let size = rng.log_uniform(512, 64 * MIB);
        live.push(r.alloc(size));
        if i % 5 == 4 {
            let victim = live.swap_remove((rng.next() % live.len() as u64) as usize);
            r.free(victim);
        }
    }
    r.report("random log-uniform 512 B..64 MiB, 20 % churn");
    // Many small long-lived blocks (bias/norm-sized), 512 B .. 64 KiB.
    let mut r = Run::new();
    for _ in 0..20_000 {
        let size = rng.log_uniform(512, 64 * KIB);
        r.alloc(size);
    }
    r.report("small blocks 512 B..64 KiB (20k)");
}
