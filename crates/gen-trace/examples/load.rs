//! Loads trace files and prints how long each took: `cargo run --release -p gen-trace --example load
//! -- FILE...`. Decompression alone is timed too, to tell the parser's share from gzip's.

use std::io::Read;
use std::time::Instant;

fn main() {
    for arg in std::env::args().skip(1) {
        let path = std::path::Path::new(&arg);
        let t0 = Instant::now();
        match gen_trace::load_path(path) {
            Ok(traces) => {
                let took = t0.elapsed();
                let events: usize = traces.iter().map(|t| t.events.len()).sum();
                let raw = std::fs::read(path).unwrap_or_default();
                let t1 = Instant::now();
                let mut text = Vec::new();
                let gunzip = if raw.starts_with(&[0x1f, 0x8b]) {
                    flate2::read::MultiGzDecoder::new(&raw[..])
                        .read_to_end(&mut text)
                        .map(|_| t1.elapsed())
                        .ok()
                } else {
                    None
                };
                println!(
                    "{arg}: {events} events in {:.1} ms ({:.0} ns/event); gunzip alone {}",
                    took.as_secs_f64() * 1e3,
                    took.as_secs_f64() * 1e9 / events.max(1) as f64,
                    gunzip.map_or("-".into(), |d| format!("{:.1} ms", d.as_secs_f64() * 1e3)),
                );
            }
            Err(e) => {
                eprintln!("{e}");
                std::process::exit(2);
            }
        }
    }
}
