//! What a warm pass costs in driver calls: replaying a training loop's trace again on the simulated
//! device (passes 2..N, after the first laid everything out), a program makes no host wait of any kind —
//! no device synchronize, no stream or event synchronize — with one stream or several. The replay counts the
//! device's own calls (`ReplayReport::warm_calls`, from `Device::call_counts`), so no layer can hide one.

use std::path::PathBuf;
use std::sync::Arc;

use gen_device::sim::SimDevice;
use gen_device::Device;
use genpool::replay::EngineReplay;
use genpool::{Config, Pool};

fn warm_calls(trace: &str) -> std::collections::BTreeMap<&'static str, u64> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../benches/traces")
        .join(trace);
    let traces = gen_trace::load_path(&path).expect("trace loads");
    let dev = Arc::new(SimDevice::config().capacity(141 << 30).build().unwrap());
    let pool = Pool::new(dev as Arc<dyn Device>, Config::default()).unwrap();
    let mut eng = EngineReplay::new(pool, "genpool");
    let opts = gen_trace::ReplayOptions {
        passes: 3,
        ignore_site: false,
    };
    let r = gen_trace::replay(&traces[0], &mut eng, &opts).expect("replay");
    assert!(r.ratio.unwrap() < 1.08, "{trace}: ratio {:?}", r.ratio);
    r.warm_calls
}

/// The warm passes of `trace` made no host wait of any kind.
fn assert_no_host_wait(trace: &str) {
    let w = warm_calls(trace);
    assert_eq!(w["waits"], 0, "{trace}: {w:?}");
    assert_eq!(w["device_syncs"], 0, "{trace}: {w:?}");
}

#[test]
fn single_stream_warm_passes_make_no_host_wait() {
    // ResNet-50 and GPT-2 repeat their layout in place; GPT-2 medium, Llama and ViT move pages every
    // pass (random shapes), which must not cost a synchronize either: the slab's reclaim and the page
    // layer's moves are stream-ordered with one stream.
    for trace in [
        "resnet50_train.csv.gz",
        "gpt2_train_fixed.csv.gz",
        "gpt2m_train_varlen.csv.gz",
        "llama_ckpt_varlen.csv.gz",
        "vit_train_varres.csv.gz",
    ] {
        assert_no_host_wait(trace);
    }
}

#[test]
fn multi_stream_warm_passes_make_no_host_wait() {
    // A prefetch stream, an H2D copy stream, four serving streams: pages that move between streams'
    // arenas, and slab chunks reclaimed with slots of several streams, are ordered by events the next
    // stream waits on (on the device), never by a synchronize.
    for trace in [
        "gpt2_prefetch.csv.gz",
        "resnet_copy_overlap.csv.gz",
        "bert_serve_4streams.csv.gz",
    ] {
        assert_no_host_wait(trace);
    }
}
