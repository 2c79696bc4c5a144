//! Test helper: reads the real allocation traces (`benches/traces/*.csv.gz`) and replays them
//! through a classifier.
#![allow(dead_code)]

use flate2::read::GzDecoder;
use gen_classifier::{Classifier, ClassifierConfig, Confusion, Features, Lifetime, Stamp};
use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;

/// One trace event.
#[derive(Clone, Copy, Debug)]
pub enum Event {
    /// `a` line.
    Alloc {
        addr: u64,
        size: u64,
        stream: u64,
        site: u64,
    },
    /// `f` line.
    Free { addr: u64 },
}

/// The directory of the traces bundled in `benches/traces` (overridable with `GENPOOL_TRACES`).
pub fn traces_dir() -> PathBuf {
    std::env::var_os("GENPOOL_TRACES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../benches/traces"))
}

/// Parses a gzip CSV trace; `None` when the file is absent. Malformed lines are an error.
pub fn load(name: &str) -> Option<Result<Vec<Event>, String>> {
    let path = traces_dir().join(name);
    let file = std::fs::File::open(&path).ok()?;
    let mut out = Vec::new();
    for (n, line) in BufReader::new(GzDecoder::new(file)).lines().enumerate() {
        let line = match line {
            Ok(l) => l,
            Err(e) => return Some(Err(format!("{}: {e}", path.display()))),
        };
        if n == 0 || line.is_empty() {
            continue;
        }
        let f: Vec<&str> = line.split(',').collect();
        let num = |i: usize| -> Result<u64, String> {
            f.get(i)
                .ok_or_else(|| format!("line {n}: missing column {i}"))?
                .parse::<u64>()
                .map_err(|e| format!("line {n}: column {i}: {e}"))
        };
        let ev = match f.get(1).copied() {
            Some("a") => match (num(2), num(3), num(4), num(5)) {
                (Ok(addr), Ok(size), Ok(stream), Ok(site)) => Event::Alloc {
                    addr,
                    size,
                    stream,
                    site,
                },
                (a, b, c, d) => {
                    let e = [a, b, c, d]
                        .into_iter()
                        .find_map(Result::err)
                        .unwrap_or_default();
                    return Some(Err(e));
                }
            },
            Some("f") => match num(2) {
                Ok(addr) => Event::Free { addr },
                Err(e) => return Some(Err(e)),
            },
            other => return Some(Err(format!("line {n}: bad action {other:?}"))),
        };
        out.push(ev);
    }
    Some(Ok(out))
}

/// Replays `events` through a fresh classifier (site used or ignored), finishing with the live blocks.
/// The pass is marked as an iteration at its start, as the engine's replays do (`Pool::mark_pass`): the
/// CSV traces carry no iteration boundaries (benches/traces/README.md, "Format"), so within one pass
/// the classifier has no period and the position in the iteration plays no part.
/// Returns the classifier and the confusion of *every* allocation's prediction, measured here on the
/// replay's own allocation clock (the classifier scores only the allocations it tracks: one in
/// `sample_every` of a warm key): blocks freed are scored by their lifetime, blocks still live at the
/// end score Long when older than the short horizon (younger ones are left out, as `finish` does).
pub fn replay(events: &[Event], cfg: ClassifierConfig, use_site: bool) -> (Classifier, Confusion) {
    let c = Classifier::new(cfg);
    c.mark_iteration();
    let mut all = Confusion::default();
    let mut clock = 0u64;
    let mut live: HashMap<u64, (Stamp, u64, u64)> = HashMap::with_capacity(1 << 16);
    for ev in events {
        match *ev {
            Event::Alloc {
                addr,
                size,
                stream,
                site,
            } => {
                let f = Features {
                    size,
                    stream,
                    device: 0,
                    site: (use_site && site != 0).then_some(site),
                    hint: None,
                };
                let s = c.on_alloc(&f);
                clock += 1;
                live.insert(addr, (s, size, clock));
            }
            Event::Free { addr } => {
                if let Some((s, size, at)) = live.remove(&addr) {
                    c.on_free(&s, size);
                    let actual = c.classify(clock - at, 0);
                    all.counts[s.predicted().index()][actual.index()] += 1;
                    all.bytes[s.predicted().index()][actual.index()] += size;
                }
            }
        }
    }
    let short = c.config().short_horizon().allocs;
    for (s, size, at) in live.values() {
        if clock - at > short {
            all.counts[s.predicted().index()][Lifetime::Long.index()] += 1;
            all.bytes[s.predicted().index()][Lifetime::Long.index()] += size;
        }
    }
    c.finish(live.into_values().map(|(s, size, _)| (s, size)));
    (c, all)
}
