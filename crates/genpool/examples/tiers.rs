//! Replay a trace on the simulated device and print, per tier, peak live vs peak reserved.
//! `cargo run --release -p genpool --features replay --example tiers -- TRACE [GENPOOL_CONF]`

use std::sync::Arc;

use gen_device::sim::SimDevice;
use genpool::replay::EngineReplay;
use genpool::{Config, Pool};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = args.get(1).expect("usage: tiers TRACE [CONF]");
    let cfg = Config::parse(args.get(2).map_or("", String::as_str)).expect("config");
    for trace in gen_trace::load_path(std::path::Path::new(path)).expect("trace") {
        let dev = Arc::new(SimDevice::config().capacity(141 << 30).build().unwrap());
        let pool = Pool::new(dev, cfg.clone()).unwrap();
        let mut eng = EngineReplay::new(pool, "genpool");
        let passes: u32 = std::env::var("PASSES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(3);
        let opts = gen_trace::ReplayOptions {
            passes,
            ignore_site: std::env::var_os("IGNORE_SITE").is_some(),
        };
        let plan = gen_trace::ReplayPlan::new(&trace).unwrap();
        let pages = eng.pool().page_pool().clone();
        let r = gen_trace::replay_plan(&plan, &mut eng, &opts, &mut |pass| {
            let s = pages.stats();
            eprintln!(
                "  after pass {pass}: steals {} creates {} revivals {} peak {}",
                s.steals, s.creates, s.revivals, s.pages_peak
            );
        })
        .unwrap();
        let s = eng.pool().stats();
        println!(
            "{}: ratio {:.4}  peak_live {:.3} GiB  peak_reserved {:.3} GiB  ns/op {:.0}  acc {:.3}/{:.3}",
            r.trace,
            r.ratio.unwrap(),
            r.peak_live as f64 / (1u64 << 30) as f64,
            r.peak_reserved as f64 / (1u64 << 30) as f64,
            r.ns_per_op.unwrap_or(0.0),
            s.classifier_accuracy_count,
            s.classifier_accuracy_bytes
        );
        for t in &s.tiers {
            println!(
                "  {:7} allocs {:8}  live_peak {:9.1} MiB  reserved_peak {:9.1} MiB",
                t.tier,
                t.allocs,
                t.live_peak as f64 / 1048576.0,
                t.reserved_peak as f64 / 1048576.0
            );
        }
        println!("  pages {:?}", s.pages);
        println!("  plan {:?}", s.plan);
        println!(
            "  confusion counts {:?}\n  confusion bytes {:?}",
            s.confusion_counts, s.confusion_bytes
        );
    }
}
