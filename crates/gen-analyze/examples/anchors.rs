//! Prints every strategy's ratio on the given traces next to the measured anchors:
//! `cargo run --release -p gen-analyze --example anchors -- benches/traces/*.csv.gz`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut out = std::io::stdout();
    for p in std::env::args_os().skip(1) {
        for t in gen_trace::load_path(std::path::Path::new(&p))? {
            let t0 = std::time::Instant::now();
            let a = gen_analyze::analyze(&t, &gen_analyze::Strategy::ALL)?;
            gen_analyze::write_table(&mut out, &a)?;
            eprintln!("  ({:.1} s)", t0.elapsed().as_secs_f64());
        }
    }
    Ok(())
}
