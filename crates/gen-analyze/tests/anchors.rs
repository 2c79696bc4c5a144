//! The simulations against the ratios measured on the H200 (`gen_analyze::ANCHORS`).
//!
//! `resnet50_train` (embedded in genpool-cli) always runs; the other three traces are read from
//! `benches/traces` and run under `--include-ignored` (a few seconds in release, ~1 min in debug).

use gen_analyze::{analyze, Strategy};

/// The bound on |simulated − measured|.
const TOLERANCE: f64 = 0.02;

fn check(trace: &gen_trace::Trace) {
    let a = analyze(
        trace,
        &[Strategy::Native, Strategy::Expandable, Strategy::RmmPool],
    )
    .unwrap();
    for r in &a.results {
        assert_eq!(
            r.waste.total(),
            r.at_peak.reserved - r.at_peak.live,
            "{} {}: waste causes add up",
            a.trace,
            r.strategy.name()
        );
        let err = r.error().expect("every trace here has measured anchors");
        assert!(
            err.abs() <= TOLERANCE,
            "{} {}: simulated {:.4}, measured {:.4}",
            a.trace,
            r.strategy.name(),
            r.ratio.unwrap(),
            r.measured.unwrap()
        );
    }
}

/// The `cudaMallocAsync` model is not validated (the driver's placement policy is undocumented):
/// this bounds its known error on the shared traces (crate README), so a change to it shows here.
const ASYNC_KNOWN_ERROR: f64 = 0.08;

fn check_async(trace: &gen_trace::Trace) {
    let a = analyze(trace, &[Strategy::Native, Strategy::Async]).unwrap();
    let r = a.result(Strategy::Async).unwrap();
    let err = r.error().expect("measured");
    assert!(
        err.abs() <= ASYNC_KNOWN_ERROR,
        "{} async: simulated {:.4}, measured {:.4}",
        a.trace,
        r.ratio.unwrap(),
        r.measured.unwrap()
    );
    assert_eq!(r.waste.total(), r.at_peak.reserved - r.at_peak.live);
    // Never recommended, even where it looks best.
    assert_ne!(a.recommendation.use_strategy.as_deref(), Some("async"));
    assert!(a.recommendation.best_torch.as_ref().unwrap().strategy != "async");
}

#[test]
fn resnet50_within_tolerance() {
    let bytes = include_bytes!("../../genpool-cli/data/resnet50_train.csv.gz");
    let t = gen_trace::load_bytes("resnet50_train", bytes).unwrap();
    check(&t[0]);
    check_async(&t[0]);
}

#[test]
#[ignore = "slow in debug builds (~1 min); .ci/run runs it in release"]
fn shared_traces_within_tolerance() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../benches/traces");
    for name in ["gpt2_train_fixed", "gpt2m_train_varlen", "gpt2_generate_kv"] {
        let p = dir.join(format!("{name}.csv.gz"));
        let t = gen_trace::load_path(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        check(&t[0]);
        check_async(&t[0]);
    }
}

#[test]
fn genpool_strategy_runs_and_beats_native() {
    let bytes = include_bytes!("../../genpool-cli/data/resnet50_train.csv.gz");
    let t = gen_trace::load_bytes("resnet50_train", bytes).unwrap();
    let a = analyze(&t[0], &[Strategy::Native, Strategy::Genpool]).unwrap();
    let native = a.result(Strategy::Native).unwrap();
    let genpool = a.result(Strategy::Genpool).unwrap();
    assert!(genpool.measured.is_none());
    assert!(genpool.peak_reserved >= a.peak_live);
    assert!(genpool.ratio.unwrap() < native.ratio.unwrap());
}

#[test]
fn report_names_every_strategy_and_the_unsimulated_anchors() {
    let bytes = include_bytes!("../../genpool-cli/data/resnet50_train.csv.gz");
    let t = gen_trace::load_bytes("resnet50_train", bytes).unwrap();
    let a = analyze(&t[0], &[Strategy::Native, Strategy::RmmPool]).unwrap();
    let mut out = Vec::new();
    gen_analyze::write_report(&mut out, &[a]).unwrap();
    let text = String::from_utf8(out).unwrap();
    assert!(
        text.contains("| trace | peak live | native | rmm-pool |"),
        "{text}"
    );
    assert!(
        text.contains("| resnet50_train | 2.97 GiB | 1.125 (1.126, -0.001) |"),
        "{text}"
    );
    assert!(
        text.contains(
            "| resnet50_train | idle_segments 53 % of 381.31 MiB | free_holes 99 % of 25.31 MiB |"
        ),
        "{text}"
    );
    assert!(
        text.contains("resnet50_train: expandable 1.010, async 1.051, rmm-arena 1.016"),
        "{text}"
    );
    let mut empty = Vec::new();
    gen_analyze::write_report(&mut empty, &[]).unwrap();
    assert!(String::from_utf8(empty).unwrap().ends_with("No traces.\n"));
}

#[test]
fn strategy_names_round_trip() {
    for s in Strategy::ALL {
        assert_eq!(Strategy::parse(s.name()).unwrap(), s);
    }
    assert_eq!(
        Strategy::parse("tlsf").unwrap_err().to_string(),
        "unknown strategy `tlsf` (known: native, expandable, rmm-pool, genpool, async, native:max_split_size_mb=N,roundup_power2_divisions=M)"
    );
    for s in gen_analyze::Strategy::TORCH_SWEEP {
        assert_eq!(Strategy::parse(&s.label()).unwrap(), s);
    }
    assert_eq!(Strategy::parse("native:").unwrap(), Strategy::Native);
    assert!(Strategy::parse("native:max_split_size_mb=x").is_err());
    assert!(Strategy::parse("native:garbage_collection_threshold=1").is_err());
    assert_eq!(gen_analyze::anchor("resnet50_train", "async"), Some(1.051));
    assert_eq!(gen_analyze::anchor("resnet50_train", "tlsf"), None);
    assert_eq!(gen_analyze::anchor("bert", "native"), None);
}
