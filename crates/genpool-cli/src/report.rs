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
