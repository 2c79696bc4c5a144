//! Rendering of [`Analysis`] results: a plain table per trace and a Markdown report over many.

use std::io::{self, Write};

use crate::html::human;
use crate::{Analysis, StrategyResult, ANCHORS, ANCHOR_MODES};

fn gib(n: u64) -> String {
    format!("{:.2} GiB", n as f64 / f64::from(1u32 << 30))
}

fn ratio(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_owned(), |x| format!("{x:.3}"))
}

fn signed(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_owned(), |x| format!("{x:+.3}"))
}

/// One trace's results as a plain-text table.
pub fn write_table(out: &mut dyn Write, a: &Analysis) -> io::Result<()> {
    writeln!(
        out,
        "{}: {} ops, {} stream{}, peak live {}",
        a.trace,
        a.ops,
        a.streams,
        if a.streams == 1 { "" } else { "s" },
        gib(a.peak_live)
    )?;
    let w = a
        .results
        .iter()
        .map(|r| r.strategy.label().len())
        .max()
        .unwrap_or(0)
        .max(11);
    writeln!(
        out,
        "  {:<w$}  {:>13}  {:>6}  {:>8}  {:>6}  dominant waste at peak",
        "strategy", "peak reserved", "ratio", "measured", "error"
    )?;
    for r in &a.results {
        let dominant = r.dominant_waste.map_or_else(
            || "-".to_owned(),
            |c| format!("{} {:.0} %", c.name(), r.waste.share(c) * 100.0),
        );
        writeln!(
            out,
            "  {:<w$}  {:>13}  {:>6}  {:>8}  {:>6}  {dominant}",
            r.strategy.label(),
            gib(r.peak_reserved),
            ratio(r.ratio),
            ratio(r.measured),
            signed(r.error()),
        )?;
    }
    writeln!(
        out,
        "  Waste at the moment of peak reservation (reserved − live then, by cause):"
    )?;
    for r in &a.results {
        writeln!(out, "    {:<w$}  {}", r.strategy.label(), waste_line(r))?;
    }
    for r in a.results.iter().filter(|r| !r.strategy.is_validated()) {
        writeln!(
            out,
            "  {} is an unvalidated estimate (see gen-analyze's README): not recommended.",
            r.strategy.label()
        )?;
    }
    for line in a.recommendation.reasons() {
        writeln!(out, "  {line}")?;
    }
    writeln!(out)
}

/// `0.38 GiB of 3.35 GiB: split_fragments 0.25 GiB (66 %), rounding 0.03 GiB (8 %)`.
pub(crate) fn waste_line(r: &StrategyResult) -> String {
    let w = &r.waste;
    if w.total() == 0 {
        return format!("none (all {} reserved is live)", human(r.at_peak.reserved));
    }
    let parts: Vec<String> = w
        .causes()
        .iter()
        .map(|&(c, b)| format!("{} {} ({:.0} %)", c.name(), human(b), w.share(c) * 100.0))
        .collect();
    format!(
        "{} of {}: {}",
        human(w.total()),
        human(r.at_peak.reserved),
        parts.join(", ")
    )
}

/// A Markdown report over `analyses`: one table of ratios (simulated, with the measured anchor and the
/// error beside it), the largest absolute error per strategy, and the measured anchors that have no
/// simulation.
pub fn write_report(out: &mut dyn Write, analyses: &[Analysis]) -> io::Result<()> {
    writeln!(out, "# genpool analysis\n")?;
    writeln!(
        out,
        "Ratio = peak reserved / peak live after one pass. Simulated on the host; \
         *measured* is the H200 anchor (`benches/gpu/torch_replay.py`), shown as `sim (measured, error)`.\n"
    )?;
    let Some(first) = analyses.first() else {
        return writeln!(out, "No traces.");
    };
    let strategies: Vec<_> = first.results.iter().map(|r| r.strategy).collect();
    write!(out, "| trace | peak live |")?;
    for s in &strategies {
        write!(out, " {} |", s.label())?;
    }
    writeln!(out)?;
    write!(out, "|---|---|")?;
    for _ in &strategies {
        write!(out, "---|")?;
    }
    writeln!(out)?;
    let mut worst = vec![None::<f64>; strategies.len()];
    for a in analyses {
        write!(out, "| {} | {} |", a.trace, gib(a.peak_live))?;
        for (i, s) in strategies.iter().enumerate() {
            match a.result(*s) {
                Some(r) => {
                    match (r.measured, r.error()) {
                        (Some(m), Some(e)) => {
                            write!(out, " {} ({m:.3}, {}) |", ratio(r.ratio), signed(Some(e)))?
                        }
                        _ => write!(out, " {} |", ratio(r.ratio))?,
                    }
                    if let Some(e) = r.error() {
                        worst[i] = Some(worst[i].map_or(e.abs(), |w: f64| w.max(e.abs())));
                    }
                }
                None => write!(out, " - |")?,
            }
        }
        writeln!(out)?;
    }
    writeln!(out)?;
    writeln!(
        out,
        "Dominant cause of waste at each strategy's peak reservation (share of reserved − live then; \
         `genpool analyze` lists every cause):\n"
    )?;
    write!(out, "| trace |")?;
    for s in &strategies {
        write!(out, " {} |", s.label())?;
    }
    writeln!(out)?;
    write!(out, "|---|")?;
    for _ in &strategies {
        write!(out, "---|")?;
    }
    writeln!(out)?;
    for a in analyses {
        write!(out, "| {} |", a.trace)?;
        for s in &strategies {
            match a.result(*s).and_then(|r| Some((r, r.dominant_waste?))) {
                Some((r, c)) => write!(
                    out,
                    " {} {:.0} % of {} |",
                    c.name(),
                    r.waste.share(c) * 100.0,
                    human(r.waste.total())
                )?,
                None => write!(out, " - |")?,
            }
        }
        writeln!(out)?;
    }
    writeln!(out)?;
    for a in analyses {
        writeln!(
            out,
            "**{}**: {}\n",
            a.trace,
            a.recommendation.reasons().join(" ")
        )?;
    }
    for (s, w) in strategies.iter().zip(&worst) {
        if let Some(w) = w {
            writeln!(
                out,
                "- {}: largest |error| against the measured anchor {w:.3}",
                s.label()
            )?;
        }
    }
    let simulated: Vec<&str> = strategies.iter().filter_map(|s| s.anchor_mode()).collect();
    let unsimulated: Vec<(usize, &str)> = ANCHOR_MODES
        .iter()
        .enumerate()
        .filter(|(_, m)| !simulated.contains(m))
        .map(|(i, m)| (i, *m))
        .collect();
    if !unsimulated.is_empty() {
        writeln!(out, "\nMeasured anchors without a simulation here:\n")?;
        for a in analyses {
            if let Some((_, row)) = ANCHORS.iter().find(|(t, _)| *t == a.trace) {
                let cells: Vec<String> = unsimulated
                    .iter()
                    .map(|(i, m)| format!("{m} {:.3}", row[*i]))
                    .collect();
                writeln!(out, "- {}: {}", a.trace, cells.join(", "))?;
            }
        }
    }
    Ok(())
}
