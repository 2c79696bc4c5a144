//! The recommendation of `genpool analyze`: which setting to use on this workload, what it saves, and
//! whether genpool beats it — every claim a number from the simulations.

use crate::{Analysis, Strategy, StrategyResult};

const GIB: f64 = (1u64 << 30) as f64;

/// One strategy as the recommendation quotes it.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Choice {
    /// [`Strategy::label`].
    pub strategy: String,
    /// `PYTORCH_CUDA_ALLOC_CONF` that selects it (PyTorch strategies only; empty = the defaults).
    pub torch_conf: Option<String>,
    /// Simulated peak reserved bytes.
    pub peak_reserved: u64,
    /// Peak reserved / peak live.
    pub ratio: f64,
}

impl Choice {
    fn of(r: &StrategyResult) -> Option<Choice> {
        Some(Choice {
            strategy: r.strategy.label(),
            torch_conf: r.strategy.torch_conf(),
            peak_reserved: r.peak_reserved,
            ratio: r.ratio?,
        })
    }
}

/// Which setting to use and why, in numbers (see [`Recommendation::reasons`]).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Recommendation {
    /// Peak live bytes of the trace.
    pub peak_live: u64,
    /// PyTorch with default settings, if it was run.
    pub torch_default: Option<Choice>,
    /// The PyTorch setting that reserves least, if any was run.
    pub best_torch: Option<Choice>,
    /// Bytes the best PyTorch setting saves at peak over the defaults.
    pub torch_saves_bytes: Option<i64>,
    /// The existing allocator (PyTorch setting or RMM) that reserves least.
    pub best_existing: Option<Choice>,
    /// genpool, if it was run.
    pub genpool: Option<Choice>,
    /// Bytes genpool saves at peak over the best existing allocator (negative: it reserves more).
    pub genpool_saves_bytes: Option<i64>,
    /// What to use: the label of the strategy that reserves least.
    pub use_strategy: Option<String>,
}

fn min_by_ratio<'a>(it: impl Iterator<Item = &'a StrategyResult>) -> Option<&'a StrategyResult> {
    it.filter(|r| r.ratio.is_some())
        .min_by(|a, b| a.peak_reserved.cmp(&b.peak_reserved))
}

/// The recommendation for `analysis` (the same as `analysis.recommendation`).
pub fn recommend(analysis: &Analysis) -> Recommendation {
    recommend_from(analysis.peak_live, &analysis.results)
}

/// Strategies without a validated simulation ([`Strategy::is_validated`]) are left out: an estimate
/// does not make a recommendation.
pub(crate) fn recommend_from(peak_live: u64, results: &[StrategyResult]) -> Recommendation {
    let validated: Vec<StrategyResult> = results
        .iter()
        .filter(|r| r.strategy.is_validated())
        .cloned()
        .collect();
    let results = &validated[..];
    let default = results
        .iter()
        .find(|r| r.strategy == Strategy::Native)
        .and_then(Choice::of);
    let best_torch =
        min_by_ratio(results.iter().filter(|r| r.strategy.is_torch())).and_then(Choice::of);
    let best_existing = min_by_ratio(results.iter().filter(|r| r.strategy != Strategy::Genpool))
        .and_then(Choice::of);
    let genpool = results
        .iter()
        .find(|r| r.strategy == Strategy::Genpool)
        .and_then(Choice::of);
    let torch_saves_bytes = match (&default, &best_torch) {
        (Some(d), Some(b)) => Some(d.peak_reserved as i64 - b.peak_reserved as i64),
        _ => None,
    };
    let genpool_saves_bytes = match (&best_existing, &genpool) {
        (Some(e), Some(g)) => Some(e.peak_reserved as i64 - g.peak_reserved as i64),
        _ => None,
    };
    let use_strategy = min_by_ratio(results.iter()).map(|r| r.strategy.label());
    Recommendation {
        peak_live,
        torch_default: default,
        best_torch,
        torch_saves_bytes,
        best_existing,
        genpool,
        genpool_saves_bytes,
        use_strategy,
    }
}

/// Bytes in binary units (`0.34 GiB` reads better than `348.16 MiB` next to GiB peaks, so GiB from
/// 0.01 GiB up, smaller units below).
fn gib(b: i64) -> String {
    let sign = if b < 0 { "-" } else { "" };
    if b.unsigned_abs() as f64 >= GIB / 100.0 {
        format!("{sign}{:.2} GiB", b.unsigned_abs() as f64 / GIB)
    } else {
        format!("{sign}{}", crate::units::human(b.unsigned_abs()))
    }
}

fn conf(c: &Choice) -> String {
    match c.torch_conf.as_deref() {
        Some("") => "PyTorch's defaults (no PYTORCH_CUDA_ALLOC_CONF)".to_owned(),
        Some(v) => format!("PYTORCH_CUDA_ALLOC_CONF={v}"),
        None => c.strategy.clone(),
    }
}

impl Recommendation {
    /// The recommendation as sentences, each with its numbers.
    pub fn reasons(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(d) = &self.torch_default {
            out.push(format!(
                "With PyTorch's defaults the peak reservation is {:.3}× peak live ({} reserved for {} live, {:.1} % fragmentation).",
                d.ratio,
                gib(d.peak_reserved as i64),
                gib(self.peak_live as i64),
                (d.ratio - 1.0) * 100.0
            ));
        }
        match (
            &self.torch_default,
            &self.best_torch,
            self.torch_saves_bytes,
        ) {
            (Some(_), Some(b), Some(saved)) if saved > 0 => out.push(format!(
                "Best PyTorch setting: {} — ratio {:.3}, {} less reserved at peak.",
                conf(b),
                b.ratio,
                gib(saved)
            )),
            (Some(_), Some(_), Some(_)) => out.push(
                "No PyTorch setting tried reserves less than the defaults on this workload."
                    .to_owned(),
            ),
            (None, Some(b), _) => out.push(format!(
                "Best PyTorch setting tried: {} — ratio {:.3}.",
                conf(b),
                b.ratio
            )),
            _ => {}
        }
        if let (Some(e), Some(t)) = (&self.best_existing, &self.best_torch) {
            if e.strategy != t.strategy && e.peak_reserved < t.peak_reserved {
                out.push(format!(
                    "{} does better still: ratio {:.3}, {} less than the best PyTorch setting (a fixed pool, sized in advance).",
                    e.strategy,
                    e.ratio,
                    gib(t.peak_reserved as i64 - e.peak_reserved as i64)
                ));
            }
        }
        if let (Some(g), Some(e), Some(saved)) =
            (&self.genpool, &self.best_existing, self.genpool_saves_bytes)
        {
            if saved > 0 {
                out.push(format!(
                    "genpool beats it: ratio {:.3} against {:.3} ({}), {} less reserved at peak.",
                    g.ratio,
                    e.ratio,
                    e.strategy,
                    gib(saved)
                ));
            } else {
                out.push(format!(
                    "genpool does not beat it: ratio {:.3} against {:.3} ({}), {} more reserved at peak.",
                    g.ratio,
                    e.ratio,
                    e.strategy,
                    gib(-saved)
                ));
            }
        }
        if let Some(u) = &self.use_strategy {
            out.push(format!("Use: {u}."));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Knobs;

    fn r(strategy: Strategy, peak_reserved: u64) -> StrategyResult {
        StrategyResult {
            strategy,
            peak_reserved,
            ratio: Some(peak_reserved as f64 / (100 * G) as f64),
            measured: None,
            at_peak: Default::default(),
            waste: Default::default(),
            dominant_waste: None,
        }
    }

    const G: u64 = 1 << 30;

    #[test]
    fn picks_the_least_reservation_and_says_by_how_much() {
        let tuned = Strategy::NativeTuned(Knobs {
            max_split_size_mb: Some(256),
            roundup_power2_divisions: 0,
        });
        let results = [
            r(Strategy::Native, 120 * G),
            r(Strategy::Expandable, 110 * G),
            r(tuned, 115 * G),
            r(Strategy::RmmPool, 105 * G),
            r(Strategy::Genpool, 101 * G),
        ];
        let rec = recommend_from(100 * G, &results);
        assert_eq!(rec.best_torch.as_ref().unwrap().strategy, "expandable");
        assert_eq!(rec.torch_saves_bytes, Some(10 * G as i64));
        assert_eq!(rec.best_existing.as_ref().unwrap().strategy, "rmm-pool");
        assert_eq!(rec.genpool_saves_bytes, Some(4 * G as i64));
        assert_eq!(rec.use_strategy.as_deref(), Some("genpool"));
        let text = rec.reasons().join(" ");
        assert!(
            text.contains("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True — ratio"),
            "{text}"
        );
        assert!(text.contains("10.00 GiB less reserved at peak"), "{text}");
        assert!(text.contains("rmm-pool does better still"), "{text}");
        assert!(text.contains("genpool beats it"), "{text}");
        assert!(text.contains("4.00 GiB less"), "{text}");
        assert!(text.contains("20.0 % fragmentation"), "{text}");
    }

    #[test]
    fn says_when_genpool_loses_and_defaults_win() {
        let results = [r(Strategy::Native, 102 * G), r(Strategy::Genpool, 103 * G)];
        let rec = recommend_from(100 * G, &results);
        assert_eq!(rec.torch_saves_bytes, Some(0));
        assert_eq!(rec.genpool_saves_bytes, Some(-(G as i64)));
        assert_eq!(rec.use_strategy.as_deref(), Some("native"));
        let text = rec.reasons().join(" ");
        assert!(
            text.contains("No PyTorch setting tried reserves less"),
            "{text}"
        );
        assert!(text.contains("genpool does not beat it"), "{text}");
        assert!(text.contains("1.00 GiB more"), "{text}");
    }
}
