//! The HTML report's data on a bundled real trace (the Llama-style model, `benches/traces`): the
//! timeline's buckets hold every op's extremes, so the highest point drawn is the exact peak live; the
//! waste rows add up to the total the page states.

use gen_analyze::{record_timeline, write_html, Timeline};
use gen_trace::{load_path, EventKind, Trace};
use std::sync::OnceLock;

fn llama() -> &'static (Trace, Timeline) {
    static T: OnceLock<(Trace, Timeline)> = OnceLock::new();
    T.get_or_init(|| {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../benches/traces/llama_ckpt_varlen.csv.gz");
        let trace = load_path(&path)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
            .remove(0);
        let tl = record_timeline(&trace, genpool::Config::default(), None, &mut |_| {}).unwrap();
        (trace, tl)
    })
}

#[test]
fn buckets_hold_every_ops_extremes_and_the_exact_peak() {
    let (trace, t) = llama();
    // The trace's own peak live (5.69 GiB, benches/traces/README.md) is the highest point of the band.
    assert_eq!(t.peak_live, trace.summary.peak_live);
    assert!((t.peak_live as f64 / (1u64 << 30) as f64 - 5.69).abs() < 0.006);
    let drawn = t.samples.iter().map(|s| s.trace_live_max).max().unwrap();
    assert_eq!(
        drawn, trace.summary.peak_live,
        "the drawn series reaches the peak"
    );
    // Recompute the live bytes after every op and check each lies in its bucket's band, and that each
    // bucket's band is reached by some op in it.
    assert!(t.samples.len() > 1000, "{} buckets", t.samples.len());
    assert_eq!(t.samples.last().unwrap().op, t.ops);
    let mut sizes = std::collections::HashMap::new();
    let mut live = 0u64;
    let mut b = 1;
    let (mut lo, mut hi) = (u64::MAX, 0u64);
    for (i, e) in trace.events.iter().enumerate() {
        match e.kind {
            EventKind::Alloc => {
                sizes.insert(e.addr, e.size);
                live += e.size;
            }
            EventKind::Free => live -= sizes.remove(&e.addr).unwrap(),
        }
        let s = &t.samples[b];
        assert!(
            (s.trace_live_min..=s.trace_live_max).contains(&live),
            "op {i}: {live} outside bucket {b}"
        );
        (lo, hi) = (lo.min(live), hi.max(live));
        if i as u64 + 1 == s.op {
            assert_eq!((lo, hi), (s.trace_live_min, s.trace_live_max), "bucket {b}");
            (lo, hi, b) = (u64::MAX, 0, b + 1);
        }
    }
    assert_eq!(b, t.samples.len());
    for s in &t.samples {
        assert!(s.live_min <= s.live_max() && s.reserved_min <= s.reserved_max());
        assert!(s.engine_reserved <= t.peak_reserved);
    }
    // The engine's live bytes are the trace's: its highest bucket is the peak live too.
    let engine_live = t.samples.iter().map(|s| s.live_max()).max().unwrap();
    assert!(
        engine_live >= t.peak_live,
        "{engine_live} < {}",
        t.peak_live
    );
}

#[test]
fn waste_rows_add_up_to_the_stated_total() {
    let (_, t) = llama();
    assert!(!t.waste.is_empty());
    assert_eq!(
        t.waste_uncharged, 0,
        "every growth charged to an allocation"
    );
    let rows: i64 = t.waste.iter().map(|w| w.waste()).sum::<i64>() + t.waste_other;
    assert_eq!(rows, t.waste_total());
    // The page states that total and shows every row's figure, and they add up.
    let mut page = Vec::new();
    write_html(&mut page, std::slice::from_ref(t), &[]).unwrap();
    let page = String::from_utf8(page).unwrap();
    let table = &page[page.find(r#"<table class="waste">"#).unwrap()..];
    let table = &table[..table.find("</table>").unwrap()];
    let figures: Vec<i64> = table
        .split(r#"data-bytes=""#)
        .skip(1)
        .map(|s| s[..s.find('"').unwrap()].parse().unwrap())
        .collect();
    assert_eq!(
        figures.len(),
        t.waste.len() + 1,
        "the rows, then every other size"
    );
    let stated = &page[page.find(r#"class="waste-total" data-bytes=""#).unwrap()..];
    let stated: i64 = stated.split('"').nth(3).unwrap().parse().unwrap();
    assert_eq!(stated, t.waste_total());
    assert_eq!(figures.iter().sum::<i64>(), stated);
}
