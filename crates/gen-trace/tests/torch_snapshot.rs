//! The snapshot reader on a pickle made by the real tool: `torch.cuda.memory._dump_snapshot` of PyTorch
//! 2.11.0+cu130 on the H200 (`python -m genpool_torch.capture --snapshot-pickle`, a two-stream program
//! with `record_stream`), against the events the capture tool derived from the same snapshot in Python.

use gen_trace::{load_bytes, EventKind};

const PICKLE: &[u8] = include_bytes!("fixtures/snapshot_torch211.pickle");
const EXPECTED: &str = include_str!("fixtures/snapshot_torch211.expected.json");

#[test]
fn a_real_pytorch_snapshot_reads_as_python_reads_it() {
    let traces = load_bytes("snapshot_torch211.pickle", PICKLE).unwrap();
    let expected: serde_json::Value = serde_json::from_str(EXPECTED).unwrap();
    let expected = expected.as_array().unwrap();
    assert_eq!(traces.len(), expected.len());
    for (t, x) in traces.iter().zip(expected) {
        let xe = x["events"].as_array().unwrap();
        assert_eq!(t.events.len(), xe.len(), "{}", t.name);
        for (e, x) in t.events.iter().zip(xe) {
            let kind = match e.kind {
                EventKind::Alloc => "alloc",
                EventKind::Free => "free",
            };
            assert_eq!(kind, x["kind"].as_str().unwrap(), "{e:?}");
            assert_eq!(e.t_us, x["t_us"].as_u64().unwrap());
            assert_eq!(e.addr, x["addr"].as_u64().unwrap());
            assert_eq!(e.size, x["size"].as_u64().unwrap());
            assert_eq!(e.stream, x["stream"].as_u64().unwrap());
            // Exactly Python's hash for every event: PyTorch shares frame dicts between events, which
            // serde-pickle 1.2.0 lost after their first use (vendor/serde-pickle/GENPOOL_PATCH.md).
            assert_eq!(e.site, x["site"].as_u64().unwrap(), "site of {e:?}");
        }
        let allocs = t.events.iter().filter(|e| e.kind == EventKind::Alloc);
        assert!(allocs.clone().count() >= 4);
        assert!(
            allocs.clone().all(|e| e.site != 0),
            "every allocation has its stack"
        );
        // The program used a side stream: both streams appear, and every free names a live block.
        let streams: std::collections::BTreeSet<u64> = t.events.iter().map(|e| e.stream).collect();
        assert!(streams.len() >= 2, "{streams:?}");
    }
}
