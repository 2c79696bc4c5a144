//! `genpool analyze [TRACE|SNAPSHOT.pickle...] [--strategy NAME]... [--json]`: what each allocator
//! policy would reserve on each trace — PyTorch's caching allocator (native, expandable segments, and
//! native with `max_split_size_mb` / `roundup_power2_divisions`) and RMM's pool, simulated on the
//! host, and the genpool engine on the simulated device — with the ratios measured on the GPU beside
//! them (see `gen_analyze`), what each one's waste at its peak consists of (`waste: {cause: bytes}`
//! and `dominant_waste` in `--json`; a column and one line per strategy in the table), and a
//! recommendation with its reasons in numbers. With no TRACE it
//! analyzes the embedded `resnet50_train` trace. A file that is not a trace (e.g. a pickle that is not
//! a memory snapshot) or that has no allocations exits with code 2 before any work.

use std::io::Write;
use std::path::PathBuf;

use gen_analyze::{analyze, Analysis, AnalyzeError, Strategy};
use gen_trace::{load_bytes, load_path, Trace, TraceError};

use crate::{CliError, EMBEDDED_NAME, EMBEDDED_TRACE};

/// Arguments of `genpool analyze`.
#[derive(Debug, clap::Args)]
pub struct AnalyzeArgs {
    /// Trace files (any format `genpool replay` reads). None: the embedded resnet50_train trace.
    pub traces: Vec<PathBuf>,
    /// Strategy to run; repeat for several [default: native, expandable, rmm-pool, genpool and five
    /// tuned native settings]. A tuned native allocator is written
    /// `native:max_split_size_mb=N,roundup_power2_divisions=M` (either or both). `async` (PyTorch's
    /// cudaMallocAsync backend) is an unvalidated estimate, run only when named, never recommended.
    #[arg(long = "strategy", value_name = "NAME", value_parser = parse_strategy)]
    pub strategies: Vec<Strategy>,
    /// Print one JSON object per trace per line instead of tables (with `recommendation`, and per
    /// strategy `at_peak`, `waste` and `dominant_waste`).
    #[arg(long)]
    pub json: bool,
}

/// Parses a strategy name for clap (an unknown name is a usage error).
pub(crate) fn parse_strategy(s: &str) -> Result<Strategy, String> {
    Strategy::parse(s).map_err(|e| e.to_string())
}

/// The traces named, or the embedded one when none is. A file with no allocations (an empty CSV, a
/// snapshot whose device traces are empty) is bad input: there is nothing to analyze.
pub(crate) fn load_traces(paths: &[PathBuf]) -> Result<Vec<Trace>, CliError> {
    let mut traces = Vec::new();
    if paths.is_empty() {
        traces.extend(load_bytes(EMBEDDED_NAME, EMBEDDED_TRACE)?);
    }
    for p in paths {
        let got = load_path(p)?;
        if got.iter().all(|t| t.summary.allocs == 0) {
            return Err(CliError::Trace(TraceError::new(
                p.display().to_string(),
                0,
                None,
                "no allocations in the trace: nothing to analyze",
            )));
        }
        traces.extend(got.into_iter().filter(|t| t.summary.allocs > 0));
    }
    Ok(traces)
}

/// Runs the strategies asked for (`defaults` when none) on every trace.
pub(crate) fn analyze_all(
    traces: &[Trace],
    strategies: &[Strategy],
    defaults: &[Strategy],
    each: &mut dyn FnMut(&Analysis) -> Result<(), CliError>,
) -> Result<Vec<Analysis>, CliError> {
    let strategies = if strategies.is_empty() {
        defaults
    } else {
        strategies
    };
    let mut out = Vec::with_capacity(traces.len());
    for t in traces {
        let a = analyze(t, strategies).map_err(|e| match e {
            AnalyzeError::Replay {
                trace,
                strategy,
                source,
            } => CliError::Replay {
                trace,
                allocator: strategy.to_owned(),
                source,
            },
            AnalyzeError::Engine(message) => CliError::Allocator {
                name: "genpool".to_owned(),
                message,
            },
            AnalyzeError::EmptyTrace { trace } => CliError::Trace(TraceError::new(
                trace,
                0,
                None,
                "no allocations in the trace: nothing to analyze",
            )),
            e @ (AnalyzeError::UnknownStrategy { .. } | AnalyzeError::BadSetting { .. }) => {
                CliError::Allocator {
                    name: String::new(),
                    message: e.to_string(),
                }
            }
        })?;
        each(&a)?;
        out.push(a);
    }
    Ok(out)
}

/// `genpool analyze`.
pub fn run(a: &AnalyzeArgs, out: &mut dyn Write) -> Result<(), CliError> {
    // The engine strategy reads GENPOOL_CONF (gen_analyze::engine_config): a bad one fails before any work.
    crate::engine_config("genpool")?;
    let traces = load_traces(&a.traces)?;
    analyze_all(
        &traces,
        &a.strategies,
        &Strategy::default_set(),
        &mut |an| {
            if a.json {
                serde_json::to_writer(&mut *out, an).map_err(std::io::Error::from)?;
                writeln!(out)?;
            } else {
                gen_analyze::write_table(out, an)?;
            }
            out.flush()?;
            Ok(())
        },
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::run as cli;

    #[test]
    fn analyze_embedded_as_json() {
        let mut out = Vec::new();
        cli(
            [
                "genpool",
                "analyze",
                "--json",
                "--strategy",
                "native",
                "--strategy",
                "expandable",
            ],
            &mut out,
        )
        .unwrap();
        let text = String::from_utf8(out).unwrap();
        let v: serde_json::Value = serde_json::from_str(text.trim()).unwrap();
        assert_eq!(v["trace"], crate::EMBEDDED_NAME);
        assert_eq!(v["ops"], 25_814);
        let r = v["results"].as_array().unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(r[0]["strategy"], "native");
        assert_eq!(r[0]["measured"], 1.126);
        assert!((r[0]["ratio"].as_f64().unwrap() - 1.126).abs() <= 0.02);
        assert_eq!(r[1]["strategy"], "expandable");
        for x in r {
            let waste = x["waste"].as_object().unwrap();
            let total: u64 = waste.values().map(|b| b.as_u64().unwrap()).sum();
            let at = &x["at_peak"];
            assert_eq!(
                total,
                at["reserved"].as_u64().unwrap() - at["live"].as_u64().unwrap(),
                "{x}"
            );
            let dominant = x["dominant_waste"].as_str().unwrap();
            assert!(waste
                .values()
                .all(|b| b.as_u64() <= waste[dominant].as_u64()));
        }
    }

    fn fixture(name: &str) -> String {
        format!(
            "{}/../gen-trace/tests/fixtures/{name}",
            env!("CARGO_MANIFEST_DIR")
        )
    }

    #[test]
    fn snapshot_pickle_input_with_a_recommendation() {
        let mut out = Vec::new();
        let p = fixture("snapshot_small.pickle");
        cli(["genpool", "analyze", "--json", &p], &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let v: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
        assert_eq!(v["trace"], "snapshot_small:dev0", "one trace per device");
        let results = v["results"].as_array().unwrap();
        assert_eq!(results.len(), gen_analyze::Strategy::default_set().len());
        let rec = &v["recommendation"];
        assert!(rec["use_strategy"].is_string(), "{rec}");
        assert!(rec["genpool_saves_bytes"].is_i64(), "{rec}");
        assert_eq!(rec["torch_default"]["strategy"], "native");
    }

    #[test]
    fn table_names_tuned_settings_and_gives_reasons() {
        let mut out = Vec::new();
        cli(
            [
                "genpool",
                "analyze",
                "--strategy",
                "native",
                "--strategy",
                "native:max_split_size_mb=256,roundup_power2_divisions=4",
                "--strategy",
                "expandable",
            ],
            &mut out,
        )
        .unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(
            text.contains("native:max_split_size_mb=256,roundup_power2_divisions=4"),
            "{text}"
        );
        assert!(
            text.contains("Best PyTorch setting: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"),
            "{text}"
        );
        assert!(text.contains("GiB less reserved at peak"), "{text}");
        let e = cli(
            [
                "genpool",
                "analyze",
                "--strategy",
                "native:max_split_size_mb=8",
            ],
            &mut Vec::new(),
        )
        .unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(e.to_string().contains("must be > 20"), "{e}");
    }

    #[test]
    fn bad_input_is_a_clear_error() {
        let dir = std::env::temp_dir();
        let empty = dir.join(format!("genpool-empty-{}.csv", std::process::id()));
        std::fs::write(&empty, "t_us,action,addr,size,stream,site\n").unwrap();
        let p = empty.to_str().unwrap().to_owned();
        for cmd in ["analyze", "report"] {
            let e = cli(["genpool", cmd, &p], &mut Vec::new()).unwrap_err();
            assert_eq!(e.exit_code(), 2);
            assert_eq!(
                e.to_string(),
                format!("{p}: no allocations in the trace: nothing to analyze")
            );
        }
        std::fs::remove_file(&empty).unwrap();
        // A pickle that is not a memory snapshot (a list).
        let bad = dir.join(format!("genpool-bad-{}.pickle", std::process::id()));
        std::fs::write(&bad, b"\x80\x04]\x94(K\x01K\x02e.").unwrap();
        let p = bad.to_str().unwrap().to_owned();
        let e = cli(["genpool", "analyze", &p], &mut Vec::new()).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(
            e.to_string().contains("not a PyTorch memory snapshot"),
            "{e}"
        );
        std::fs::remove_file(&bad).unwrap();
    }

    #[test]
    fn unknown_strategy_is_a_usage_error() {
        let e = cli(
            ["genpool", "analyze", "--strategy", "tlsf"],
            &mut Vec::new(),
        )
        .unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(e.to_string().contains("unknown strategy `tlsf`"), "{e}");
        let e = cli(["genpool", "report", "/nonexistent.csv"], &mut Vec::new()).unwrap_err();
        assert_eq!(e.exit_code(), 2);
    }
}
