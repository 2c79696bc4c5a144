//! `genpool report --html`: one self-contained page (inline CSS and SVG, no script, no network) per
//! set of traces, drawn from [`Timeline`]s and, when given, the [`Analysis`] of the same trace.
//!
//! Per trace: the strategies' ratios and the recommendation; live and reserved bytes over time, per
//! tier, stacked (with the trace's live bytes as the floor), one point per bucket of ops at the bucket's
//! highest total and a line at its lowest, so no peak falls between points; lifetime histograms per class; the
//! classifier's confusion matrix; the sizes that waste the most. Every drawn series is an SVG `path`
//! or `polyline` with `class="series"`, a `data-series` name and a `data-points` count, so a test (or
//! a reader of the DOM) can check what was drawn.

use std::fmt::Write as _;
use std::io::{self, Write};

use crate::timeline::{Timeline, CLASSES, LIFETIME_BUCKETS};
use crate::{recommend, Analysis};

/// Tier colours, by tier index (slab, extent, stream, buddy; others cycle).
const TIER_COLOURS: [&str; 4] = ["#4e79a7", "#f28e2b", "#59a14f", "#b07aa1"];
/// Class colours: short, mid, long.
const CLASS_COLOURS: [&str; 3] = ["#76b7b2", "#edc948", "#e15759"];

const CSS: &str = "body{font:14px/1.4 system-ui,sans-serif;margin:24px auto;max-width:1000px;color:#222}\
h1{font-size:22px}h2{font-size:18px;margin-top:32px;border-bottom:1px solid #ddd}h3{font-size:15px}\
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}\
th{background:#f4f4f4}td.l,th.l{text-align:left}.best{font-weight:bold}\
.legend span{display:inline-block;margin-right:14px}.sw{display:inline-block;width:12px;height:12px;\
margin-right:4px;vertical-align:-1px}svg{background:#fff;border:1px solid #eee}\
svg text{font:11px system-ui,sans-serif;fill:#444}.axis{stroke:#999;stroke-width:1}\
.grid{stroke:#eee;stroke-width:1}.rec{background:#f6f8fa;border-left:4px solid #4e79a7;padding:8px 12px}\
.bar{display:inline-block;height:10px;background:#e15759}";

/// `s` with `& < > " '` escaped for HTML text and attributes.
pub fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            c => o.push(c),
        }
    }
    o
}

pub use crate::units::human;

/// A "nice" step (1, 2 or 5 × 2^k... in bytes: a power of two or 1.25/2.5/5 × one) giving at most
/// `ticks` ticks up to `max`.
fn nice_step(max: f64, ticks: f64) -> f64 {
    let raw = (max / ticks).max(1.0);
    let p = 2f64.powf(raw.log2().floor());
    [1.0, 1.25, 2.5, 5.0, 8.0]
        .iter()
        .map(|m| m * p)
        .find(|s| *s >= raw)
        .unwrap_or(2.0 * p)
}

struct Frame {
    w: f64,
    h: f64,
    left: f64,
    right: f64,
    top: f64,
    bottom: f64,
    x_max: f64,
    y_max: f64,
}

impl Frame {
    fn x(&self, v: f64) -> f64 {
        self.left + v / self.x_max.max(1.0) * (self.w - self.left - self.right)
    }
    fn y(&self, v: f64) -> f64 {
        self.h - self.bottom - v / self.y_max.max(1.0) * (self.h - self.top - self.bottom)
    }
    /// Axes, grid and byte ticks on y, op ticks on x.
    fn axes(&self, s: &mut String, x_label: &str) {
        let step = nice_step(self.y_max, 5.0);
        let mut v = 0.0;
        while v <= self.y_max * 1.0001 {
            let y = self.y(v);
            let _ = write!(
                s,
                r#"<line class="grid" x1="{:.1}" x2="{:.1}" y1="{y:.1}" y2="{y:.1}"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
                self.left,
                self.w - self.right,
                self.left - 4.0,
                y + 4.0,
                human(v as u64)
            );
            v += step;
        }
        for k in 0..=5 {
            let xv = self.x_max * f64::from(k) / 5.0;
            let x = self.x(xv);
            let _ = write!(
                s,
                r#"<text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                self.h - self.bottom + 14.0,
                xv.round() as u64
            );
        }
        let _ = write!(
            s,
            r#"<line class="axis" x1="{l:.1}" x2="{l:.1}" y1="{t:.1}" y2="{b:.1}"/><line class="axis" x1="{l:.1}" x2="{r:.1}" y1="{b:.1}" y2="{b:.1}"/><text x="{mx:.1}" y="{ly:.1}" text-anchor="middle">{x_label}</text>"#,
            l = self.left,
            r = self.w - self.right,
            t = self.top,
            b = self.h - self.bottom,
            mx = (self.left + self.w - self.right) / 2.0,
            ly = self.h - 4.0,
        );
    }
}

/// A stacked area chart of `values(bucket) → per-tier bytes` at each bucket's highest total, with a
/// line at each bucket's lowest total (`min(bucket)`) and the trace's live bytes drawn over it as a band
/// from its lowest to its highest in each bucket.
fn stacked_chart(
    s: &mut String,
    t: &Timeline,
    what: &str,
    values: &dyn Fn(&crate::timeline::Sample) -> &[u64],
    min: &dyn Fn(&crate::timeline::Sample) -> u64,
) {
    let tiers = t.tiers.len();
    let totals: Vec<u64> = t.samples.iter().map(|x| values(x).iter().sum()).collect();
    let y_max = totals
        .iter()
        .copied()
        .chain(t.samples.iter().map(|x| x.trace_live_max))
        .max()
        .unwrap_or(0)
        .max(t.peak_live) as f64;
    let f = Frame {
        w: 940.0,
        h: 280.0,
        left: 78.0,
        right: 12.0,
        top: 10.0,
        bottom: 34.0,
        x_max: t.ops as f64,
        y_max: y_max * 1.05,
    };
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" role="img" class="chart" data-chart="{what}" width="{w}" height="{h}" viewBox="0 0 {w} {h}">"#,
        w = f.w,
        h = f.h
    );
    f.axes(s, "ops replayed");
    let mut lower = vec![0u64; t.samples.len()];
    for k in 0..tiers {
        let upper: Vec<u64> = t
            .samples
            .iter()
            .zip(&lower)
            .map(|(x, lo)| lo + values(x).get(k).copied().unwrap_or(0))
            .collect();
        if upper.iter().zip(&lower).all(|(u, l)| u == l) {
            continue;
        }
        let mut d = String::new();
        for (i, (x, u)) in t.samples.iter().zip(&upper).enumerate() {
            let _ = write!(
                d,
                "{}{:.1},{:.1}",
                if i == 0 { "M" } else { "L" },
                f.x(x.op as f64),
                f.y(*u as f64)
            );
        }
        for (x, l) in t.samples.iter().zip(&lower).rev() {
            let _ = write!(d, "L{:.1},{:.1}", f.x(x.op as f64), f.y(*l as f64));
        }
        let _ = write!(
            s,
            r#"<path class="series" data-series="{what}-{name}" data-points="{n}" fill="{c}" fill-opacity="0.85" stroke="{c}" stroke-width="0.5" d="{d}Z"><title>{what}, tier {name}</title></path>"#,
            name = t.tiers[k],
            n = t.samples.len(),
            c = TIER_COLOURS[k % TIER_COLOURS.len()],
        );
        lower = upper;
    }
    let mut pts = String::new();
    for x in &t.samples {
        let _ = write!(pts, "{:.1},{:.1} ", f.x(x.op as f64), f.y(min(x) as f64));
    }
    let _ = write!(
        s,
        r##"<polyline class="series" data-series="{what}-total-min" data-points="{n}" fill="none" stroke="#555" stroke-width="0.8" points="{p}"><title>{what}, all tiers: lowest in each bucket</title></polyline>"##,
        n = t.samples.len(),
        p = pts.trim_end()
    );
    let mut d = String::new();
    for (i, x) in t.samples.iter().enumerate() {
        let _ = write!(
            d,
            "{}{:.1},{:.1}",
            if i == 0 { "M" } else { "L" },
            f.x(x.op as f64),
            f.y(x.trace_live_max as f64)
        );
    }
    for x in t.samples.iter().rev() {
        let _ = write!(
            d,
            "L{:.1},{:.1}",
            f.x(x.op as f64),
            f.y(x.trace_live_min as f64)
        );
    }
    let _ = write!(
        s,
        r##"<path class="series" data-series="{what}-trace-live" data-points="{n}" fill="#222" fill-opacity="0.25" stroke="#222" stroke-width="1" d="{d}Z"><title>live bytes of the trace: lowest to highest in each bucket</title></path></svg>"##,
        n = t.samples.len(),
    );
}

fn legend(s: &mut String, t: &Timeline) {
    s.push_str(r#"<p class="legend">"#);
    for (k, name) in t.tiers.iter().enumerate() {
        let used = t.samples.iter().any(|x| {
            x.reserved.get(k).is_some_and(|v| *v > 0) || x.live.get(k).is_some_and(|v| *v > 0)
        });
        let _ = write!(
            s,
            r#"<span><i class="sw" style="background:{}"></i>{}{}</span>"#,
            TIER_COLOURS[k % TIER_COLOURS.len()],
            esc(name),
            if used { "" } else { " (unused)" }
        );
    }
    s.push_str(r##"<span><i class="sw" style="background:#222;opacity:0.4"></i>live bytes of the trace (lowest to highest per bucket)</span><span><i class="sw" style="background:#555;height:1px"></i>all tiers: lowest per bucket</span></p>"##);
}

/// Lifetime histogram: stacked bars by class over log2 lifetime buckets (y: count, square-root scale
/// so that rare long lifetimes stay visible).
fn lifetime_chart(s: &mut String, t: &Timeline) {
    let last = (0..LIFETIME_BUCKETS)
        .rev()
        .find(|&b| (0..3).any(|c| t.lifetimes[c][b] > 0))
        .map_or(1, |b| b + 1);
    let totals: Vec<u64> = (0..last)
        .map(|b| (0..3).map(|c| t.lifetimes[c][b]).sum())
        .collect();
    let max = totals.iter().copied().max().unwrap_or(0).max(1) as f64;
    let (w, h, left, bottom, top) = (940.0, 240.0, 60.0, 36.0, 10.0);
    let bw = (w - left - 10.0) / last as f64;
    let y = |v: f64| h - bottom - v.sqrt() / max.sqrt() * (h - top - bottom);
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" role="img" class="chart" data-chart="lifetimes" width="{w}" height="{h}" viewBox="0 0 {w} {h}">"#
    );
    for frac in [0.0, 0.25, 0.5, 1.0] {
        let v = max * frac * frac;
        let _ = write!(
            s,
            r#"<line class="grid" x1="{left}" x2="{:.1}" y1="{y:.1}" y2="{y:.1}"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
            w - 10.0,
            left - 4.0,
            y(v) + 4.0,
            v.round() as u64,
            y = y(v)
        );
    }
    for c in 0..3 {
        let mut bars = 0;
        let mut body = String::new();
        for b in 0..last {
            let below: u64 = (0..c).map(|k| t.lifetimes[k][b]).sum();
            let n = t.lifetimes[c][b];
            if n == 0 {
                continue;
            }
            bars += 1;
            let (y0, y1) = (y(below as f64), y((below + n) as f64));
            let _ = write!(
                body,
                r#"<rect x="{:.1}" y="{y1:.1}" width="{:.1}" height="{:.1}" fill="{}"><title>{}: {n} allocations ({}) with lifetime {}</title></rect>"#,
                left + b as f64 * bw + 1.0,
                (bw - 2.0).max(1.0),
                (y0 - y1).max(0.5),
                CLASS_COLOURS[c],
                CLASSES[c],
                human(t.lifetime_bytes[c][b]),
                bucket_label(b)
            );
        }
        let _ = write!(
            s,
            r#"<g class="series" data-series="lifetime-{}" data-points="{bars}">{body}</g>"#,
            CLASSES[c]
        );
    }
    for b in 0..last {
        if last <= 24 || b % 2 == 0 {
            let _ = write!(
                s,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                left + (b as f64 + 0.5) * bw,
                h - bottom + 14.0,
                bucket_label(b)
            );
        }
    }
    let _ = write!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">lifetime in allocations (log2 buckets); bar height: count, square-root scale</text></svg>"#,
        (left + w) / 2.0,
        h - 4.0
    );
}

/// `0`, `1`, `2-3`, `4-7`, ... `1K-2K` ...
fn bucket_label(b: usize) -> String {
    fn short(n: u64) -> String {
        match n {
            n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{}M", n >> 20),
            n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{}K", n >> 10),
            n => n.to_string(),
        }
    }
    match b {
        0 => "0".to_owned(),
        1 => "1".to_owned(),
        b => format!("{}+", short(1u64 << (b - 1))),
    }
}

fn confusion(s: &mut String, t: &Timeline) {
    s.push_str(r#"<table class="confusion"><tr><th class="l">predicted ↓ / actual →</th>"#);
    for c in CLASSES {
        let _ = write!(s, "<th>{c}</th>");
    }
    s.push_str("<th>predicted right</th></tr>");
    let total: u64 = t.confusion_counts.iter().flatten().sum();
    for (p, row) in t.confusion_counts.iter().enumerate() {
        let n: u64 = row.iter().sum();
        let _ = write!(s, r#"<tr><th class="l">{}</th>"#, CLASSES[p]);
        for (a, v) in row.iter().enumerate() {
            let frac = if total == 0 {
                0.0
            } else {
                *v as f64 / total as f64
            };
            let _ = write!(
                s,
                r#"<td style="background:rgba({},{:.3})" title="{}">{v}</td>"#,
                if a == p { "89,161,79" } else { "225,87,89" },
                frac.sqrt().min(1.0) * 0.8,
                human(t.confusion_bytes[p][a])
            );
        }
        let _ = write!(
            s,
            "<td>{}</td></tr>",
            if n == 0 {
                "-".to_owned()
            } else {
                format!("{:.1} %", row[p] as f64 * 100.0 / n as f64)
            }
        );
    }
    let right: u64 = (0..3).map(|i| t.confusion_counts[i][i]).sum();
    let _ = write!(
        s,
        "</table><p>{} of {} allocations scored, {:.1} % predicted right (bytes: hover a cell).</p>",
        right,
        total,
        if total == 0 {
            0.0
        } else {
            right as f64 * 100.0 / total as f64
        }
    );
}

/// `n` bytes with a sign (`−` for negative).
fn signed(n: i64) -> String {
    if n < 0 {
        format!("−{}", human(n.unsigned_abs()))
    } else {
        human(n as u64)
    }
}

fn waste_table(s: &mut String, t: &Timeline) {
    let total = t.waste_total();
    let _ = write!(
        s,
        "<p>Each growth of genpool's peak reservation is charged to the size of the allocation that \
         caused it; a size's net waste is what was charged to it minus its live bytes when the \
         reservation peaked (op {}, {} live) — negative for a size whose blocks lived in memory other \
         sizes had grown. The rows below (the sizes with the largest net waste, then every other size \
         together) add up to peak reserved − live at the peak: <b class=\"waste-total\" data-bytes=\"{total}\">{}</b>.</p>",
        t.peak_op,
        human(t.live_at_peak),
        signed(total)
    );
    s.push_str(
        r#"<table class="waste"><tr><th>size</th><th>allocations</th><th>peak growth charged</th><th>live at peak</th><th class="l">net waste</th></tr>"#,
    );
    let top = t.waste.first().map_or(1, |w| w.waste().max(1));
    let row = |s: &mut String, size: &str, allocs: &str, charged: &str, live: &str, w: i64| {
        let _ = write!(
            s,
            r#"<tr><td>{size}</td><td>{allocs}</td><td>{charged}</td><td>{live}</td><td class="l" data-bytes="{w}"><i class="bar" style="width:{:.0}px"></i> {}</td></tr>"#,
            w.max(0) as f64 / top as f64 * 200.0,
            signed(w)
        );
    };
    for w in &t.waste {
        row(
            s,
            &human(w.size),
            &w.allocs.to_string(),
            &human(w.charged),
            &human(w.live_at_peak),
            w.waste(),
        );
    }
    row(s, "every other size", "", "", "", t.waste_other);
    if t.waste_uncharged != 0 {
        row(s, "growth during frees", "", "", "", t.waste_uncharged);
    }
    s.push_str("</table>");
}

fn analysis_section(s: &mut String, a: &Analysis) {
    s.push_str(r#"<table class="strategies"><tr><th class="l">strategy</th><th>peak reserved</th><th>ratio</th><th>measured on H200</th></tr>"#);
    let best = a
        .results
        .iter()
        .filter_map(|r| r.ratio)
        .fold(f64::INFINITY, f64::min);
    for r in &a.results {
        let _ = write!(
            s,
            r#"<tr{}><td class="l">{}</td><td>{}</td><td>{}</td><td>{}</td></tr>"#,
            if r.ratio == Some(best) {
                r#" class="best""#
            } else {
                ""
            },
            esc(&r.strategy.label()),
            human(r.peak_reserved),
            r.ratio.map_or("-".to_owned(), |v| format!("{v:.3}")),
            r.measured.map_or("-".to_owned(), |v| format!("{v:.3}")),
        );
    }
    s.push_str("</table>");
    let rec = recommend(a);
    let _ = write!(s, r#"<div class="rec"><b>Recommendation.</b> "#);
    for line in rec.reasons() {
        let _ = write!(s, "{} ", esc(&line));
    }
    s.push_str("</div>");
}

/// Writes the HTML report of `timelines`; `analyses` (matched by trace name) add the strategies' table
/// and the recommendation.
pub fn write_html(
    out: &mut dyn Write,
    timelines: &[Timeline],
    analyses: &[Analysis],
) -> io::Result<()> {
    let mut s = String::with_capacity(1 << 20);
    let _ = write!(
        s,
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>genpool report</title>\
         <meta name=\"viewport\" content=\"width=device-width\"><style>{CSS}</style></head><body>\
         <h1>genpool report</h1><p>Each trace replayed once through the genpool engine on the \
         simulated device (an H200's 141 GiB); other strategies simulated on the host (see \
         <code>genpool analyze</code>). Ratio = peak reserved / peak live.</p>"
    );
    if timelines.is_empty() {
        s.push_str("<p>No traces.</p>");
    }
    for t in timelines {
        let _ = write!(
            s,
            r#"<section class="trace" data-trace="{name}"><h2>{name}</h2><p>{} ops, peak live {}, genpool peak reserved {} (ratio {}) at op {}; the charts show {} buckets of {} ops, each drawn at its highest total (the stacked tiers) and its lowest (the thin line), so every peak is drawn exactly.</p>"#,
            t.ops,
            human(t.peak_live),
            human(t.peak_reserved),
            t.ratio().map_or("-".to_owned(), |r| format!("{r:.3}")),
            t.peak_op,
            t.samples.len(),
            t.every,
            name = esc(&t.trace)
        );
        if let Some(a) = analyses.iter().find(|a| a.trace == t.trace) {
            s.push_str("<h3>Strategies</h3>");
            analysis_section(&mut s, a);
        }
        s.push_str("<h3>Reserved bytes per tier (stacked)</h3>");
        legend(&mut s, t);
        stacked_chart(&mut s, t, "reserved", &|x| &x.reserved, &|x| x.reserved_min);
        s.push_str("<h3>Live bytes per tier (stacked)</h3>");
        stacked_chart(&mut s, t, "live", &|x| &x.live, &|x| x.live_min);
        s.push_str("<h3>Lifetimes per generation</h3><p class=\"legend\">");
        for (c, name) in CLASSES.iter().enumerate() {
            let n: u64 = t.lifetimes[c].iter().sum();
            let _ = write!(
                s,
                r#"<span><i class="sw" style="background:{}"></i>{name}: {n}</span>"#,
                CLASS_COLOURS[c]
            );
        }
        let _ = write!(s, "<span>never freed: {}</span></p>", t.never_freed);
        lifetime_chart(&mut s, t);
        s.push_str("<h3>Classifier confusion matrix (allocations)</h3>");
        confusion(&mut s, t);
        s.push_str("<h3>Sizes that waste the most</h3>");
        waste_table(&mut s, t);
        s.push_str("</section>");
    }
    s.push_str("</body></html>\n");
    out.write_all(s.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaping_and_units() {
        assert_eq!(
            esc(r#"<a href="x">&'"#),
            "&lt;a href=&quot;x&quot;&gt;&amp;&#39;"
        );
        assert_eq!(human(512), "512 B");
        assert_eq!(human(3 << 29), "1.50 GiB");
        assert_eq!(bucket_label(0), "0");
        assert_eq!(bucket_label(1), "1");
        assert_eq!(bucket_label(2), "2+");
        assert_eq!(bucket_label(12), "2K+");
        assert_eq!(bucket_label(22), "2M+");
    }

    #[test]
    fn nice_steps_cover_the_range() {
        for max in [1.0, 1000.0, 3e9, 12.66 * 1073741824.0] {
            let s = nice_step(max, 5.0);
            assert!(s * 5.0 >= max / 1.0001, "{max}: {s}");
            assert!(s * 5.0 <= max * 5.0 + 8.0, "{max}: {s}");
        }
    }
}
