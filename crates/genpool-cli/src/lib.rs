//! The `genpool` command line, as a library so tests (and other tools) can call [`run`].
//!
//! `genpool replay [TRACE...] [--device sim|cuda|auto] [--passes N] [--json] [--ignore-site]
//! [--allocator NAME]...` replays each trace through each allocator (see `gen_trace::replay`) and
//! prints a table per trace, or with `--json` one JSON object per (trace, allocator) per line. With no
//! TRACE it replays the embedded `resnet50_train` trace.
//!
//! Allocators are made in one place, [`make_allocator`]; [`KNOWN_ALLOCATORS`] and
//! [`DEFAULT_ALLOCATORS`] list them.

pub mod analyze;
pub mod report;

use std::ffi::OsString;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};
use gen_trace::{
    load_bytes, load_path, replay_plan, Bfc, ReferenceBuddy, ReplayAllocator, ReplayError,
    ReplayOptions, ReplayPlan, ReplayReport, Trace, TraceError,
};

/// The trace replayed when none is given: ResNet-50 training, 25,814 events (see `data/`).
pub const EMBEDDED_TRACE: &[u8] = include_bytes!("../data/resnet50_train.csv.gz");
/// The embedded trace's name.
pub const EMBEDDED_NAME: &str = "resnet50_train";

/// Allocators `--allocator` accepts.
pub const KNOWN_ALLOCATORS: &[&str] = &[
    "genpool",
    "genpool-single",
    "genpool-generational",
    "bfc",
    "buddy",
];
/// Allocators replayed when no `--allocator` is given.
pub const DEFAULT_ALLOCATORS: &[&str] = &["genpool"];

/// Where device memory comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DeviceKind {
    /// The deterministic simulated device.
    Sim,
    /// A CUDA GPU.
    Cuda,
    /// CUDA when a driver and a GPU are present, else sim.
    Auto,
}

/// `genpool`: a generational GPU memory pool; replay and report on allocation traces.
#[derive(Debug, Parser)]
#[command(name = "genpool", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Replay allocation traces through allocators; report peak reserved / peak live and ns per op.
    Replay(ReplayArgs),
    /// Simulate PyTorch's and RMM's allocators and genpool on traces; compare with measured ratios.
    Analyze(analyze::AnalyzeArgs),
    /// A report on traces: Markdown, or with `--html FILE` a self-contained page (per-tier timelines,
    /// lifetimes, the confusion matrix, the sizes that waste most).
    Report(report::ReportArgs),
    /// Write synthetic traces of shapes the captured ones do not cover (deterministic): serve8,
    /// crossfree, random_sizes, kvgrow.
    Synth(SynthArgs),
}

/// Arguments of `genpool synth`.
#[derive(Debug, clap::Args)]
pub struct SynthArgs {
    /// Folder to write `NAME.csv.gz` into (made if missing).
    pub out: PathBuf,
    /// Shapes to write (default: all): serve8, crossfree, random_sizes, kvgrow.
    pub shapes: Vec<String>,
}

/// Arguments of `genpool replay`.
#[derive(Debug, clap::Args)]
pub struct ReplayArgs {
    /// Trace files: genpool CSV, RMM log or PyTorch snapshot pickle, gzip'd or not. None: the embedded
    /// resnet50_train trace.
    pub traces: Vec<PathBuf>,
    /// Device the allocators take memory from (the reference allocators bfc and buddy are host-only
    /// address arithmetic and ignore it).
    #[arg(long, value_enum, default_value_t = DeviceKind::Auto)]
    pub device: DeviceKind,
    /// Passes over each trace: pass 1 is checked, passes 2..N are timed (ns/op = their median).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub passes: u32,
    /// Print one JSON object per trace and allocator per line instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Withhold call sites from the allocator (as PyTorch's pluggable-allocator hook does).
    #[arg(long)]
    pub ignore_site: bool,
    /// Allocator to replay through; repeat for several [default: genpool]. `genpool-single` is the engine
    /// routing by size alone (the default routing, whatever `GENPOOL_CONF` says), `genpool-generational`
    /// the engine routing by predicted lifetime too (`experimental.routing:generational`); `bfc` and
    /// `buddy` are host-only reference allocators.
    /// The engine reads its configuration from `GENPOOL_CONF` (`key:value,...`).
    #[arg(long = "allocator", value_name = "NAME")]
    pub allocators: Vec<String>,
}

/// Everything `genpool` can fail with.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Bad command line (clap's own message, help and version included).
    #[error("{0}")]
    Usage(#[from] clap::Error),
    /// A trace file is unreadable or malformed.
    #[error("{0}")]
    Trace(#[from] TraceError),
    /// `genpool synth` was asked for a shape it does not make.
    #[error("unknown shape `{name}` (known: {})", gen_trace::synth::SHAPES.join(", "))]
    UnknownShape {
        /// The name given.
        name: String,
    },
    /// `--allocator` names no known allocator.
    #[error("unknown allocator `{name}` (known: {})", KNOWN_ALLOCATORS.join(", "))]
    UnknownAllocator {
        /// The name given.
        name: String,
    },
    /// An allocator could not be made on the chosen device.
    #[error("allocator `{name}`: {message}")]
    Allocator {
        /// The allocator.
        name: String,
        /// Why.
        message: String,
    },
    /// A replay failed (the allocator ran out of memory or broke an invariant).
    #[error("{trace}: {allocator}: {source}")]
    Replay {
        /// Trace name.
        trace: String,
        /// Allocator name.
        allocator: String,
        /// What went wrong.
        source: ReplayError,
    },
    /// Writing the output failed.
    #[error("output: {0}")]
    Io(#[from] std::io::Error),
    /// Writing a file named on the command line failed.
    #[error("{}: {source}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        source: std::io::Error,
    },
}

impl CliError {
    /// The process exit code: 2 for bad input (usage, trace files, allocator names), 1 otherwise, 0 for
    /// `--help` / `--version`.
    pub fn exit_code(&self) -> i32 {
        match self {
            CliError::Usage(e) => e.exit_code(),
            CliError::Trace(_)
            | CliError::UnknownAllocator { .. }
            | CliError::UnknownShape { .. } => 2,
            CliError::Allocator { .. }
            | CliError::Replay { .. }
            | CliError::Io(_)
            | CliError::Write { .. } => 1,
        }
    }
}

/// Makes the allocator called `name` on `device`. The one place allocators are made.
pub fn make_allocator(
    name: &str,
    device: DeviceKind,
) -> Result<Box<dyn ReplayAllocator>, CliError> {
    match name {
        "genpool" | "genpool-single" | "genpool-generational" => {
            let mut cfg = engine_config(name)?;
            match name {
                "genpool-single" => cfg.routing = genpool::Routing::Single,
                "genpool-generational" => cfg.routing = genpool::Routing::Generational,
                _ => {}
            }
            let dev = open_device(device).map_err(|e| CliError::Allocator {
                name: name.to_owned(),
                message: e.to_string(),
            })?;
            let pool = genpool::Pool::new(dev, cfg).map_err(|e| CliError::Allocator {
                name: name.to_owned(),
                message: e.to_string(),
            })?;
            Ok(Box::new(genpool::replay::EngineReplay::new(pool, name)))
        }
        // The reference allocators are host-only address arithmetic: the device does not matter to them.
        "bfc" => Ok(Box::new(Bfc::default())),
        "buddy" => Ok(Box::new(ReferenceBuddy::default())),
        _ => Err(CliError::UnknownAllocator {
            name: name.to_owned(),
        }),
    }
}

/// The engine's configuration from `GENPOOL_CONF` (`key:value,...`; unset: the defaults). An unknown key
/// or a bad value is the same error in every command: `allocator `{name}`: GENPOOL_CONF: ...`.
pub fn engine_config(name: &str) -> Result<genpool::Config, CliError> {
    genpool::Config::from_env().map_err(|e| CliError::Allocator {
        name: name.to_owned(),
        message: format!("GENPOOL_CONF: {e}"),
    })
}

/// Memory of the simulated device: an H200's, so that every real trace fits as it did there.
const SIM_CAPACITY: u64 = 141 << 30;

/// Open device 0 of `kind`; `Auto` falls back to the simulated device when CUDA is absent.
fn open_device(
    kind: DeviceKind,
) -> Result<std::sync::Arc<dyn gen_device::Device>, gen_device::DeviceError> {
    let sim = || -> Result<std::sync::Arc<dyn gen_device::Device>, gen_device::DeviceError> {
        Ok(std::sync::Arc::new(
            gen_device::sim::SimConfig::new()
                .capacity(SIM_CAPACITY)
                .build()?,
        ))
    };
    match kind {
        DeviceKind::Sim => sim(),
        DeviceKind::Cuda => gen_device::open(gen_device::DeviceKind::Cuda, 0),
        DeviceKind::Auto => match gen_device::open(gen_device::DeviceKind::Cuda, 0) {
            Ok(d) => Ok(d),
            Err(gen_device::DeviceError::NoDriver(why)) => {
                eprintln!("genpool: no CUDA device ({why}); replaying on the simulated device");
                sim()
            }
            Err(e) => Err(e),
        },
    }
}

/// Parses `args` (program name first) and runs the command, writing results to `out`.
pub fn run<I, T>(args: I, out: &mut dyn Write) -> Result<(), CliError>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = Cli::try_parse_from(args)?;
    match cli.command {
        Command::Replay(a) => replay_cmd(&a, out),
        Command::Analyze(a) => analyze::run(&a, out),
        Command::Report(a) => report::run(&a, out),
        Command::Synth(a) => synth_cmd(&a, out),
    }
}

fn synth_cmd(a: &SynthArgs, out: &mut dyn Write) -> Result<(), CliError> {
    let names: Vec<&str> = if a.shapes.is_empty() {
        gen_trace::synth::SHAPES.to_vec()
    } else {
        a.shapes.iter().map(String::as_str).collect()
    };
    // Every name checked before anything is written.
    if let Some(bad) = names.iter().find(|n| !gen_trace::synth::SHAPES.contains(n)) {
        return Err(CliError::UnknownShape {
            name: (*bad).to_owned(),
        });
    }
    std::fs::create_dir_all(&a.out).map_err(|source| CliError::Write {
        path: a.out.clone(),
        source,
    })?;
    for name in names {
        let t = gen_trace::synth::shape(name).expect("a known shape");
        let path = a.out.join(format!("{name}.csv.gz"));
        gen_trace::write_csv_path(&t, &path).map_err(|source| CliError::Write {
            path: path.clone(),
            source,
        })?;
        writeln!(out, "{}: {} events", path.display(), t.events.len())?;
    }
    Ok(())
}

fn replay_cmd(a: &ReplayArgs, out: &mut dyn Write) -> Result<(), CliError> {
    let names: Vec<&str> = if a.allocators.is_empty() {
        DEFAULT_ALLOCATORS.to_vec()
    } else {
        a.allocators.iter().map(String::as_str).collect()
    };
    // Check every name before any work.
    for n in &names {
        if !KNOWN_ALLOCATORS.contains(n) {
            return Err(CliError::UnknownAllocator {
                name: (*n).to_owned(),
            });
        }
    }
    // Load (and validate) every trace first, so a bad file fails fast.
    let mut traces: Vec<Trace> = Vec::new();
    if a.traces.is_empty() {
        traces.extend(load_bytes(EMBEDDED_NAME, EMBEDDED_TRACE)?);
    }
    for p in &a.traces {
        traces.extend(load_path(p)?);
    }
    let opts = ReplayOptions {
        passes: a.passes,
        ignore_site: a.ignore_site,
    };
    let progress = (!a.json && std::io::stderr().is_terminal()).then(|| {
        let pb = indicatif::ProgressBar::new(
            traces.len() as u64 * names.len() as u64 * u64::from(a.passes),
        );
        pb.set_style(
            indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} passes  {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        pb
    });
    for t in &traces {
        let plan = ReplayPlan::new(t).map_err(|e| CliError::Replay {
            trace: t.name.clone(),
            allocator: String::new(),
            source: e,
        })?;
        let mut reports = Vec::with_capacity(names.len());
        for n in &names {
            let mut alloc = make_allocator(n, a.device)?;
            if let Some(pb) = &progress {
                pb.set_message(format!("{} / {n}", t.name));
            }
            let report = replay_plan(&plan, alloc.as_mut(), &opts, &mut |_| {
                if let Some(pb) = &progress {
                    pb.inc(1);
                }
            })
            .map_err(|e| CliError::Replay {
                trace: t.name.clone(),
                allocator: (*n).to_owned(),
                source: e,
            })?;
            if a.json {
                serde_json::to_writer(&mut *out, &report).map_err(std::io::Error::from)?;
                writeln!(out)?;
                out.flush()?;
            }
            reports.push(report);
        }
        if !a.json {
            if let Some(pb) = &progress {
                pb.suspend(|| write_table(out, t, &reports))?;
            } else {
                write_table(out, t, &reports)?;
            }
        }
    }
    if let Some(pb) = progress {
        pb.finish_and_clear();
    }
    Ok(())
}

/// `1234567` → `1,234,567`.
fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

use gen_analyze::units::human as bytes;

/// `total / passes`, a whole number when it divides, else with one decimal.
fn per_pass(total: u64, passes: u32) -> String {
    let p = u64::from(passes.max(1));
    if total % p == 0 {
        thousands(total / p)
    } else {
        format!("{}.{}", thousands(total / p), (total % p) * 10 / p)
    }
}

fn opt(v: Option<f64>, prec: usize) -> String {
    v.map_or_else(|| "-".to_owned(), |x| format!("{x:.prec$}"))
}

fn write_table(out: &mut dyn Write, t: &Trace, reports: &[ReplayReport]) -> std::io::Result<()> {
    let s = &t.summary;
    let passes = reports.first().map_or(0, |r| r.passes);
    writeln!(
        out,
        "{}: {} ops ({} allocs, {} frees), {} stream{}, peak live {}, {} pass{}",
        t.name,
        thousands(t.ops()),
        thousands(s.allocs),
        thousands(s.frees),
        s.streams.len(),
        if s.streams.len() == 1 { "" } else { "s" },
        bytes(s.peak_live),
        passes,
        if passes == 1 { "" } else { "es" },
    )?;
    let w = reports
        .iter()
        .map(|r| r.allocator.len())
        .chain([9])
        .max()
        .unwrap_or(9);
    let dw = reports
        .iter()
        .map(|r| r.device.len())
        .chain([6])
        .max()
        .unwrap_or(6);
    writeln!(
        out,
        "  {:<w$}  {:<dw$}  {:>13}  {:>6}  {:>9}",
        "allocator", "device", "peak reserved", "ratio", "ns/op"
    )?;
    for r in reports {
        writeln!(
            out,
            "  {:<w$}  {:<dw$}  {:>13}  {:>6}  {:>9}",
            r.allocator,
            r.device,
            bytes(r.peak_reserved),
            opt(r.ratio, 3),
            opt(r.ns_per_op, 1),
        )?;
        for tier in &r.tiers {
            writeln!(
                out,
                "    tier {:<10} own peak reserved {:>11}, {} allocs a pass{}",
                tier.name,
                bytes(tier.peak_reserved),
                per_pass(tier.allocs, r.passes),
                if r.passes > 1 { "*" } else { "" }
            )?;
        }
        if !r.tiers.is_empty() {
            writeln!(
                out,
                "    (own peak: each tier's highest, reached at its own moment; they need not add up \
                 to the total)"
            )?;
            if r.passes > 1 {
                writeln!(
                    out,
                    "    (* allocs over all passes divided by the passes; the classifier learns \
                     between passes, so a pass's split can differ)"
                )?;
            }
        }
        if let Some(&n) = r.counters.get("old_generation_allocs") {
            writeln!(
                out,
                "    old generation: {} allocations a pass{} to the extent arenas' old ranges, their live peak {}",
                per_pass(n, r.passes),
                if r.passes > 1 { "*" } else { "" },
                bytes(r.counters.get("old_generation_peak_live").copied().unwrap_or(0))
            )?;
        }
        if let Some(c) = &r.classifier {
            writeln!(
                out,
                "    classifier: {:.1} % of tracked allocations, {:.1} % of their bytes predicted right",
                c.accuracy_count * 100.0,
                c.accuracy_bytes * 100.0
            )?;
        }
        if !r.warm_calls.is_empty() && r.passes > 1 {
            let per =
                |k: &str| r.warm_calls.get(k).copied().unwrap_or(0) as f64 / (r.passes - 1) as f64;
            writeln!(
                out,
                "    driver calls per warm pass: {:.1} host waits ({:.1} device synchronizes), {:.1} page maps, \
                 {:.1} unmaps, {:.1} creates, {:.1} event records, {:.1} queries, {:.1} stream waits",
                per("waits"),
                per("device_syncs"),
                per("maps"),
                per("unmaps"),
                per("creates"),
                per("event_records"),
                per("event_queries"),
                per("stream_waits"),
            )?;
        }
    }
    writeln!(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formatting() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1000), "1,000");
        assert_eq!(thousands(494_718), "494,718");
        assert_eq!(thousands(12_345_678), "12,345,678");
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(3 << 29), "1.50 GiB");
        assert_eq!(opt(None, 1), "-");
        assert_eq!(opt(Some(1.23456), 3), "1.235");
        assert_eq!(per_pass(12_906 * 5, 5), "12,906");
        assert_eq!(per_pass(7, 2), "3.5");
        assert_eq!(per_pass(10, 3), "3.3");
    }

    #[test]
    fn allocators_by_name() {
        for n in KNOWN_ALLOCATORS {
            assert_eq!(make_allocator(n, DeviceKind::Sim).unwrap().name(), *n);
        }
        for n in DEFAULT_ALLOCATORS {
            assert!(KNOWN_ALLOCATORS.contains(n));
        }
        let e = make_allocator("tlsf", DeviceKind::Auto).err().unwrap();
        assert_eq!(e.exit_code(), 2);
        assert_eq!(
            e.to_string(),
            "unknown allocator `tlsf` (known: genpool, genpool-single, genpool-generational, bfc, buddy)"
        );
    }

    #[test]
    fn run_embedded_as_json() {
        let mut out = Vec::new();
        run(
            [
                "genpool",
                "replay",
                "--json",
                "--passes",
                "2",
                "--allocator",
                "buddy",
            ],
            &mut out,
        )
        .unwrap();
        let text = String::from_utf8(out).unwrap();
        let v: serde_json::Value = serde_json::from_str(text.trim()).unwrap();
        assert_eq!(v["trace"], EMBEDDED_NAME);
        assert_eq!(v["allocator"], "buddy");
        assert_eq!(v["ops"], 25_814);
    }
}
