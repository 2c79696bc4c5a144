//! Behaviour pinned on every trace of the repository: for each `benches/traces/*.csv.gz`, the replay's
//! ratio, the page layer's moves, returns and device synchronizes, and each tier's allocations and peak,
//! on the simulated H200, compared exactly with `tests/golden/traces.txt` (generated from the engine
//! before the issue-20 redesign). A refactor that changes any placement decision changes some number.
//!
//! Regenerate (only for a change meant to alter behaviour, and say so in its commit):
//! `GENPOOL_BLESS=1 cargo test --release -p genpool --test golden`.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;

use gen_device::sim::SimDevice;
use gen_device::Device;
use genpool::replay::EngineReplay;
use genpool::{Config, Pool};

/// The configurations pinned: the default (packing on the allocating thread, so that results depend only
/// on the allocation sequence), and one that routes through every other tier.
const CONFIGS: &[(&str, &str)] = &[
    ("default", "plan_background:false"),
    (
        "tiers",
        "plan_background:false,experimental.routing:generational,experimental.long_tier:buddy,experimental.mid_tier:stream,experimental.extent_generations:true,slab_max_size:64K",
    ),
];

fn traces_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../benches/traces")
}

fn golden_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden/traces.txt")
}

/// One line per (trace, configuration).
fn measure(path: &std::path::Path, label: &str, conf: &str) -> String {
    let trace = gen_trace::load_path(path).expect("trace loads");
    assert_eq!(trace.len(), 1, "one trace per file");
    let trace = &trace[0];
    let dev = Arc::new(SimDevice::config().capacity(141 << 30).build().unwrap());
    let pool = Pool::new(dev as Arc<dyn Device>, Config::parse(conf).unwrap()).unwrap();
    let mut eng = EngineReplay::new(pool, "genpool");
    let opts = gen_trace::ReplayOptions {
        passes: 2,
        ignore_site: false,
    };
    let r = gen_trace::replay(trace, &mut eng, &opts).expect("replay");
    let s = eng.pool().stats();
    let p = &s.pages;
    let mut line = format!(
        "{} {label}: ratio {:.6} live {} reserved {} steals {} returns {} aliases {} syncs {} creates {} maps {} unmaps {} revivals {} plan_hits {} plan_activations {}",
        r.trace,
        r.ratio.unwrap_or(0.0),
        r.peak_live,
        r.peak_reserved,
        p.steals,
        p.returns,
        p.aliases,
        p.syncs,
        p.creates,
        p.maps,
        p.unmaps,
        p.revivals,
        s.plan.hits,
        s.plan.activations,
    );
    for t in &s.tiers {
        write!(
            line,
            " {}[allocs {} frees {} reserved_peak {}]",
            t.tier, t.allocs, t.frees, t.reserved_peak
        )
        .unwrap();
    }
    line
}

#[test]
fn every_trace_replays_exactly_as_recorded_in_the_golden_file() {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(traces_dir())
        .expect("benches/traces exists")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.to_string_lossy().ends_with(".csv.gz"))
        .collect();
    paths.sort();
    assert!(
        paths.len() >= 10,
        "expected the repository's ten traces, found {}",
        paths.len()
    );
    let mut got = String::new();
    for path in &paths {
        for (label, conf) in CONFIGS {
            got.push_str(&measure(path, label, conf));
            got.push('\n');
        }
    }
    if std::env::var_os("GENPOOL_BLESS").is_some() {
        std::fs::create_dir_all(golden_path().parent().unwrap()).unwrap();
        std::fs::write(golden_path(), &got).unwrap();
    }
    let want = std::fs::read_to_string(golden_path()).expect("tests/golden/traces.txt exists");
    let (want_lines, got_lines): (Vec<_>, Vec<_>) = (want.lines().collect(), got.lines().collect());
    for (w, g) in want_lines.iter().zip(&got_lines) {
        assert_eq!(g, w, "behaviour changed (got, then golden)");
    }
    assert_eq!(
        got_lines.len(),
        want_lines.len(),
        "traces or configs added or gone"
    );
}
