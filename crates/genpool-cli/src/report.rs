//! `genpool report [TRACE...] [--strategy NAME]... [--out FILE]`: the analysis of `genpool analyze`
//! over all traces as one Markdown report (ratios, each simulation's error against the ratio measured on
//! the GPU, the worst error per strategy), to stdout or to FILE.

use std::io::Write;
use std::path::PathBuf;

use gen_analyze::Strategy;

use crate::analyze::{analyze_all, load_traces, parse_strategy};
use crate::CliError;

/// Arguments of `genpool report`.
#[derive(Debug, clap::Args)]
pub struct ReportArgs {
    /// Trace files (any format `genpool replay` reads). None: the embedded resnet50_train trace.
    pub traces: Vec<PathBuf>,
    /// Strategy to run; repeat for several [default: all]: native, expandable, rmm-pool, genpool.
    #[arg(long = "strategy", value_name = "NAME", value_parser = parse_strategy)]
    pub strategies: Vec<Strategy>,
    /// Write the report to this file instead of stdout.
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
}

/// `genpool report`.
pub fn run(a: &ReportArgs, out: &mut dyn Write) -> Result<(), CliError> {
    let traces = load_traces(&a.traces)?;
    let analyses = analyze_all(&traces, &a.strategies, &mut |_| Ok(()))?;
    match &a.out {
        Some(path) => {
            let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
            gen_analyze::write_report(&mut f, &analyses)?;
            f.flush()?;
        }
        None => gen_analyze::write_report(out, &analyses)?,
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::run as cli;

    #[test]
    fn report_to_stdout_and_to_a_file() {
        let mut out = Vec::new();
        cli(["genpool", "report", "--strategy", "rmm-pool"], &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.starts_with("# genpool analysis"), "{text}");
        assert!(
            text.contains("| resnet50_train | 2.97 GiB | 1.008 (1.008, "),
            "{text}"
        );

        let path = std::env::temp_dir().join(format!("genpool-report-{}.md", std::process::id()));
        let p = path.to_str().unwrap();
        let mut out = Vec::new();
        cli(
            ["genpool", "report", "--strategy", "rmm-pool", "--out", p],
            &mut out,
        )
        .unwrap();
        assert!(out.is_empty());
        let written = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(written, text);
    }
}
