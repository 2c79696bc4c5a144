//! `genpool report [TRACE...] [--strategy NAME]... [--out FILE] [--html FILE]`: the analysis of
//! `genpool analyze` over all traces as one Markdown report (ratios, each simulation's error against
//! the ratio measured on the GPU, the worst error per strategy, the recommendations), to stdout or to
//! FILE; or, with `--html FILE`, a self-contained HTML page (inline SVG and CSS, no script, no
//! network): per trace the strategies and the recommendation, live and reserved bytes per tier over
//! time (the engine replayed on the simulated device), lifetime histograms per class, the classifier's
//! confusion matrix and the sizes that waste the most (see `gen_analyze::html`). A progress bar shows
//! on stderr while the engine replays, when stderr is a terminal.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};

use gen_analyze::{record_timeline, AnalyzeError, Strategy};

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
    /// Write the Markdown report to this file instead of stdout.
    #[arg(long, value_name = "FILE", conflicts_with = "html")]
    pub out: Option<PathBuf>,
    /// Write an HTML report (charts of the engine's replay) to this file instead of Markdown.
    #[arg(long, value_name = "FILE")]
    pub html: Option<PathBuf>,
    /// HTML: ops per bucket of the timeline (each drawn at its lowest and highest) [default: about 1200
    /// buckets per trace].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub every: Option<u64>,
}

/// `genpool report`.
pub fn run(a: &ReportArgs, out: &mut dyn Write) -> Result<(), CliError> {
    // The engine's replays (its strategy, the HTML timelines) read GENPOOL_CONF: a bad one fails first.
    let config = crate::engine_config("genpool")?;
    let traces = load_traces(&a.traces)?;
    if let Some(path) = &a.html {
        html(a, &traces, path, config)?;
        eprintln!(
            "genpool: wrote the HTML report on {} trace{} to {}",
            traces.len(),
            if traces.len() == 1 { "" } else { "s" },
            shown(path)
        );
        return Ok(());
    }
    let analyses = analyze_all(&traces, &a.strategies, &Strategy::ALL, &mut |_| Ok(()))?;
    match &a.out {
        Some(path) => {
            write_file(path, &mut |f| gen_analyze::write_report(f, &analyses))?;
            eprintln!("genpool: wrote the Markdown report to {}", shown(path));
        }
        None => gen_analyze::write_report(out, &analyses)?,
    }
    Ok(())
}

/// `path` as the user can find it again: absolute when the current directory is known.
fn shown(path: &Path) -> String {
    std::path::absolute(path)
        .unwrap_or_else(|_| path.to_owned())
        .display()
        .to_string()
}

/// Creates `path` and writes it with `body`; an error names the file.
fn write_file(
    path: &Path,
    body: &mut dyn FnMut(&mut dyn Write) -> std::io::Result<()>,
) -> Result<(), CliError> {
    let err = |source| CliError::Write {
        path: path.to_owned(),
        source,
    };
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).map_err(err)?);
    body(&mut f).map_err(err)?;
    f.flush().map_err(err)
}

fn html(
    a: &ReportArgs,
    traces: &[gen_trace::Trace],
    path: &Path,
    config: genpool::Config,
) -> Result<(), CliError> {
    let defaults = Strategy::default_set();
    let analyses = analyze_all(traces, &a.strategies, &defaults, &mut |_| Ok(()))?;
    let total: u64 = traces.iter().map(|t| t.ops()).sum();
    let progress = std::io::stderr().is_terminal().then(|| {
        let pb = indicatif::ProgressBar::new(total);
        pb.set_style(
            indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} ops  {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        pb
    });
    let mut timelines = Vec::with_capacity(traces.len());
    let mut base = 0;
    for t in traces {
        if let Some(pb) = &progress {
            pb.set_message(t.name.clone());
        }
        let tl = record_timeline(t, config.clone(), a.every, &mut |done| {
            if let Some(pb) = &progress {
                pb.set_position(base + done);
            }
        })
        .map_err(|e| match e {
            AnalyzeError::Replay {
                trace,
                strategy,
                source,
            } => CliError::Replay {
                trace,
                allocator: strategy.to_owned(),
                source,
            },
            e => CliError::Allocator {
                name: "genpool".to_owned(),
                message: e.to_string(),
            },
        })?;
        base += t.ops();
        timelines.push(tl);
    }
    if let Some(pb) = progress {
        pb.finish_and_clear();
    }
    write_file(path, &mut |f| {
        gen_analyze::write_html(f, &timelines, &analyses)
    })
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
