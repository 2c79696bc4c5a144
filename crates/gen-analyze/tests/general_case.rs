//! The general case: on the synthetic shapes the captured traces do not cover (`gen_trace::synth`:
//! eight serving streams, a cross-stream hand-off, random sizes and lifetimes, growing KV caches),
//! genpool holds less than every simulated anchor, and close to the live bytes.

use gen_analyze::{analyze, Strategy};

#[test]
fn genpool_holds_less_than_every_anchor_on_the_synthetic_shapes() {
    let anchors = [Strategy::Native, Strategy::Expandable, Strategy::RmmPool];
    for name in gen_trace::synth::SHAPES {
        let t = gen_trace::synth::shape(name).unwrap();
        let mut strategies = anchors.to_vec();
        strategies.push(Strategy::Genpool);
        let a = analyze(&t, &strategies).unwrap();
        let ratio = |s| a.result(s).unwrap().ratio.unwrap();
        let g = ratio(Strategy::Genpool);
        for s in anchors {
            assert!(
                g < ratio(s),
                "{name}: genpool {g:.4} not below {} {:.4}",
                s.label(),
                ratio(s)
            );
        }
        assert!(g <= 1.03, "{name}: genpool's ratio {g:.4}");
    }
}
