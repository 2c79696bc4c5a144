//! The CSV writer (genpool's format, read back by [`read_csv`](crate::read_csv)).

use std::io::{self, BufWriter, Write};
use std::path::Path;

use crate::read::CSV_HEADER;
use crate::trace::{EventKind, Trace};

/// Writes `trace` as genpool CSV (header included) to `w`.
pub fn write_csv(trace: &Trace, w: impl Write) -> io::Result<()> {
    let mut w = BufWriter::with_capacity(1 << 16, w);
    writeln!(w, "{CSV_HEADER}")?;
    for e in &trace.events {
        let a = match e.kind {
            EventKind::Alloc => 'a',
            EventKind::Free => 'f',
        };
        writeln!(
            w,
            "{},{a},{},{},{},{}",
            e.t_us, e.addr, e.size, e.stream, e.site
        )?;
    }
    w.flush()
}

/// Writes `trace` to the file at `path`, gzip'd when the name ends in `.gz`.
pub fn write_csv_path(trace: &Trace, path: &Path) -> io::Result<()> {
    let f = std::fs::File::create(path)?;
    if path.extension().is_some_and(|e| e == "gz") {
        let mut gz = flate2::write::GzEncoder::new(f, flate2::Compression::default());
        write_csv(trace, &mut gz)?;
        gz.finish()?.sync_all()
    } else {
        write_csv(trace, &f)?;
        f.sync_all()
    }
}
