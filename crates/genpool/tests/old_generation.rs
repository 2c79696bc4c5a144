//! The extent arenas' old generation (`old_generation`, docs/ARCHITECTURE.md "The old generation") on
//! real traces, replayed on the simulated device: it lowers the peak where blocks that live across many
//! others would sit among short-lived ones (gpt2_generate_kv's per-round buffers), and a replay's next
//! pass starts with nothing learnt — marked (`Pool::mark_pass`) or not (PyTorch's entry points mark
//! nothing: an arena that empties ends the run) — so the blocks a trace never frees, freed by the
//! replay between passes, teach nothing to the next pass.

use std::path::PathBuf;
use std::sync::Arc;

use gen_device::sim::SimDevice;
use gen_device::Device;
use genpool::replay::EngineReplay;
use genpool::{Config, Pool};

/// The engine's replay with no pass marks: a program driving the engine through PyTorch's entry
/// points, which say nothing of runs (`mark_iteration` — which calls `Pool::mark_pass` — does nothing).
struct Unmarked(EngineReplay);

impl gen_trace::ReplayAllocator for Unmarked {
    fn name(&self) -> String {
        self.0.name()
    }
    fn alloc(
        &mut self,
        size: u64,
        stream: u64,
        site: Option<u64>,
    ) -> Result<u64, gen_trace::ReplayError> {
        self.0.alloc(size, stream, site)
    }
    fn free(&mut self, ptr: u64, size: u64, stream: u64) -> Result<(), gen_trace::ReplayError> {
        self.0.free(ptr, size, stream)
    }
    fn reserved(&self) -> u64 {
        self.0.reserved()
    }
    fn peak_reserved(&self) -> u64 {
        self.0.peak_reserved()
    }
    fn counters(&self) -> Vec<(&'static str, u64)> {
        self.0.counters()
    }
    fn call_counts(&self) -> Vec<(&'static str, u64)> {
        self.0.call_counts()
    }
}

/// The ratio of `trace` over `passes` under `conf`, and the allocations the old ranges took.
fn ratio(trace: &str, conf: &str, passes: u32) -> (f64, u64) {
    ratio_of(trace, conf, passes, true).0
}

/// [`ratio`], with or without the replay's pass marks, and the page maps of the warm passes.
fn ratio_of(trace: &str, conf: &str, passes: u32, marked: bool) -> ((f64, u64), u64) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../benches/traces")
        .join(format!("{trace}.csv.gz"));
    let traces = gen_trace::load_path(&path).expect("trace loads");
    let dev = Arc::new(SimDevice::config().capacity(141 << 30).build().unwrap());
    let pool = Pool::new(dev as Arc<dyn Device>, Config::parse(conf).unwrap()).unwrap();
    let eng = EngineReplay::new(pool, "genpool");
    let opts = gen_trace::ReplayOptions {
        passes,
        ignore_site: true,
    };
    let r = if marked {
        gen_trace::replay(&traces[0], &mut { eng }, &opts)
    } else {
        gen_trace::replay(&traces[0], &mut Unmarked(eng), &opts)
    }
    .expect("replay");
    let old = r.counters.get("old_generation_allocs").copied();
    let maps = r.warm_calls.get("maps").copied();
    (
        (
            r.ratio.expect("a ratio"),
            old.expect("the engine reports its old generation"),
        ),
        maps.expect("the replay counts the warm passes' maps"),
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

#[test]
fn with_no_pass_marks_a_run_ends_when_the_arena_empties() {
    // PyTorch's entry points mark no pass: the weights and optimizer state a replay frees after each
    // pass taught their sizes "survives" (every gradient then went to the old range, 638 -> 2 633 warm
    // page maps and 1.0034 -> 1.0047 on this trace, 3x the time a call through PyTorch on an H100). The
    // arena emptying ends the run instead: the same placement as with the marks.
    let conf = "plan_background:false";
    let marked = ratio_of("gpt2_train_fixed", conf, 3, true);
    let unmarked = ratio_of("gpt2_train_fixed", conf, 3, false);
    assert_eq!(unmarked.0 .1, 0, "nothing learnt from the passes' ends");
    assert!(
        (unmarked.0 .0 - marked.0 .0).abs() < 1e-9 && unmarked.1 == marked.1,
        "unmarked {unmarked:?}, marked {marked:?}"
    );
    // And the old generation still pays within a run on generate_kv, unmarked.
    let ((on, old), _) = ratio_of("gpt2_generate_kv", conf, 2, false);
    let ((off, _), _) = ratio_of(
        "gpt2_generate_kv",
        "plan_background:false,old_generation:0",
        2,
        false,
    );
    assert!(
        old > 600 && on < off - 0.03,
        "old generation {on:.4} ({old} allocations), one range {off:.4}"
    );
}
