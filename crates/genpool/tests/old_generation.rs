//! The extent arenas' old generation (`old_generation`, docs/ARCHITECTURE.md "The old generation") on
//! real traces, replayed on the simulated device: it lowers the peak where blocks that live across many
//! others would sit among short-lived ones (gpt2_generate_kv's per-round buffers), and a replay's next
//! pass starts with nothing learnt (`Pool::mark_pass`), so the blocks a trace never frees — freed by
//! the replay between passes — teach nothing to the next pass.

use std::path::PathBuf;
use std::sync::Arc;

use gen_device::sim::SimDevice;
use gen_device::Device;
use genpool::replay::EngineReplay;
use genpool::{Config, Pool};

/// The ratio of `trace` over `passes` under `conf`, and the allocations the old ranges took.
fn ratio(trace: &str, conf: &str, passes: u32) -> (f64, u64) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../benches/traces")
        .join(format!("{trace}.csv.gz"));
    let traces = gen_trace::load_path(&path).expect("trace loads");
    let dev = Arc::new(SimDevice::config().capacity(141 << 30).build().unwrap());
    let pool = Pool::new(dev as Arc<dyn Device>, Config::parse(conf).unwrap()).unwrap();
    let mut eng = EngineReplay::new(pool, "genpool");
    let opts = gen_trace::ReplayOptions {
        passes,
        ignore_site: true,
    };
    let r = gen_trace::replay(&traces[0], &mut eng, &opts).expect("replay");
    let old = r.counters.get("old_generation_allocs").copied();
    (
        r.ratio.expect("a ratio"),
        old.expect("the engine reports its old generation"),
    )
}

/// The ratio of `trace` over `passes` with the old generation (the default) and with one range, and
/// the allocations the old ranges took with it (none without: asserted).
fn with_and_without(trace: &str, passes: u32) -> (f64, f64, u64) {
    let (on, old) = ratio(trace, "plan_background:false", passes);
    let (off, none) = ratio(trace, "plan_background:false,old_generation:0", passes);
    assert_eq!(none, 0, "old_generation:0 has no old range");
    (on, off, old)
}

#[test]
fn survivors_in_a_range_of_their_own_lower_generate_kvs_peak() {
    let (on, off, old) = with_and_without("gpt2_generate_kv", 2);
    // 48 round buffers a generate round, 10 rounds, less the first rounds' (nothing learnt yet).
    assert!(old > 600, "{old} allocations in the old ranges");
    assert!(
        on < off - 0.03,
        "old generation {on:.4}, one range {off:.4}"
    );
}

#[test]
fn a_new_pass_does_not_learn_from_the_blocks_the_last_one_never_freed() {
    // Without forgetting at the pass mark, the weights the replay frees after pass 1 teach their sizes
    // "survives", and pass 2's gradients of those shapes land among the weights: 1.005 → 1.010.
    let (on, off, old) = with_and_without("resnet_copy_overlap", 3);
    assert_eq!(
        old, 0,
        "no size of this trace outlives 4 096 allocations but the weights"
    );
    assert!(
        (on - off).abs() < 1e-9,
        "old generation {on:.6}, one range {off:.6}"
    );
}
