//! Evaluates the classifier on the real traces in `benches/traces` (or `$GENPOOL_TRACES`), with and
//! without call sites, and times on_alloc + on_free.
//!
//! Each trace is replayed once, marked as one iteration at its start (`common::replay`, as the engine's
//! replays mark each pass): the traces carry no iteration boundaries, so the classifier has no period
//! here and the position in the iteration plays no part (it comes only from iteration marks).
//!
//! `cargo run --release -p gen-classifier --example eval [-- TRACE...]`

#[path = "../tests/common/mod.rs"]
mod common;

use gen_classifier::{Classifier, ClassifierConfig, Features, Lifetime};
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let names: Vec<String> = if args.is_empty() {
        [
            "gpt2_train_fixed.csv.gz",
            "gpt2m_train_varlen.csv.gz",
            "resnet50_train.csv.gz",
            "gpt2_generate_kv.csv.gz",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    } else {
        args
    };
    for name in &names {
        let events = match common::load(name) {
            None => {
                eprintln!("{name}: not found under {}", common::traces_dir().display());
                continue;
            }
            Some(Err(e)) => {
                eprintln!("{name}: {e}");
                std::process::exit(1);
            }
            Some(Ok(ev)) => ev,
        };
        for use_site in [true, false] {
            let t = Instant::now();
            let (c, m) = common::replay(&events, cfg_from_env(), use_site);
            let dt = t.elapsed();
            let st = c.stats();
            println!(
                "== {name} site={} acc_count={:.4} acc_bytes={:.4} long_recall={:.3} period={:?} replay={:.1} ms",
                if use_site { "yes" } else { "no" },
                m.accuracy_count(),
                m.accuracy_bytes(),
                m.recall(Lifetime::Long),
                c.iteration_period(),
                dt.as_secs_f64() * 1e3
            );
            println!(
                "   byte share S/M/L = {:.3}/{:.3}/{:.3}  count share S/M/L = {:.3}/{:.3}/{:.3}",
                m.byte_share(Lifetime::Short),
                m.byte_share(Lifetime::Mid),
                m.byte_share(Lifetime::Long),
                m.count_share(Lifetime::Short),
                m.count_share(Lifetime::Mid),
                m.count_share(Lifetime::Long)
            );
            println!("   {st:?}");
            print!("{m}");
        }
    }
    if std::env::var_os("NOBENCH").is_none() {
        bench();
    }
}

/// Config overrides for tuning: `GC="phase=8,sub=3,decay=0.75,short=64,mid=65536,burst=16,minsize=0"`.
fn cfg_from_env() -> ClassifierConfig {
    let mut b = ClassifierConfig::builder();
    for kv in std::env::var("GC")
        .unwrap_or_default()
        .split(',')
        .filter(|s| !s.is_empty())
    {
        let (k, v) = kv.split_once('=').expect("key=value");
        let n: f64 = v.parse().expect("number");
        b = match k {
            "phase" => b.phase_buckets(n as u32),
            "sub" => b.size_sub_bits(n as u32),
            "decay" => b.decay(n as f32),
            "short" => b.short_horizon(gen_classifier::Horizon {
                allocs: n as u64,
                bytes: u64::MAX,
            }),
            "mid" => b.mid_horizon(gen_classifier::Horizon {
                allocs: n as u64,
                bytes: u64::MAX,
            }),
            "burst" => b.prior_burst_allocs(n as u64),
            "minsize" => b.prior_long_min_size(n as u64),
            "sample" => b.sample_every(n as u32),
            "warm" => b.track_below(n as u32),
            "votes" | "detect" => panic!(
                "GC key {k} was removed: the classifier no longer detects a period (its phase \
                 comes only from iteration marks; docs/ARCHITECTURE.md, \"Periodic plans\")"
            ),
            _ => panic!("unknown key {k}"),
        };
    }
    b.build().expect("valid config")
}

/// 10^6 on_alloc + on_free pairs over a warm, realistic key mix (one thread), configured as the replays
/// (`GC`).
fn bench() {
    let c = Classifier::new(cfg_from_env());
    let sizes = [
        512u64,
        4096,
        3 << 20,
        12 << 20,
        1 << 10,
        96 << 10,
        48 << 20,
        2048,
    ];
    let n = 1_000_000u64;
    let mut ring = [None; 16];
    let run = |c: &Classifier, ring: &mut [Option<(gen_classifier::Stamp, u64)>; 16], n: u64| {
        for i in 0..n {
            let size = sizes[(i % 8) as usize];
            let f = Features {
                size,
                stream: 0,
                device: 0,
                site: Some(i % 5),
                hint: None,
            };
            let s = c.on_alloc(&f);
            let slot = &mut ring[(i % 16) as usize];
            if let Some((old, sz)) = slot.replace((s, size)) {
                std::hint::black_box(c.on_free(&old, sz));
            }
        }
    };
    run(&c, &mut ring, n / 10);
    let t = Instant::now();
    run(&c, &mut ring, n);
    let dt = t.elapsed();
    println!(
        "cost: {n} on_alloc+on_free pairs in {:.1} ms = {:.1} ns per pair, {:.1} ns per call",
        dt.as_secs_f64() * 1e3,
        dt.as_nanos() as f64 / n as f64,
        dt.as_nanos() as f64 / (2 * n) as f64
    );
}
