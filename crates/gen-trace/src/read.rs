//! Readers: genpool's CSV, RMM's `logging_resource_adaptor` CSV, and (in [`crate::snapshot`]) PyTorch
//! snapshot pickles. Input may be gzip'd (detected by its magic bytes, not by the file name); the format
//! is detected from the first bytes (a pickle's `PROTO` opcode, or the CSV header line).
//!
//! The CSV readers are streaming, hand-written line parsers: one reused line buffer, no allocation per
//! event.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use crate::trace::{trace_name, Event, EventKind, Trace, TraceBuilder};
use crate::TraceError;

/// The header line of genpool's CSV format.
pub const CSV_HEADER: &str = "t_us,action,addr,size,stream,site";
/// The header line RMM's `logging_resource_adaptor` writes.
pub const RMM_HEADER: &str = "Thread,Time,Action,Pointer,Size,Stream";

/// A trace file format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TraceFormat {
    /// `t_us,action,addr,size,stream,site` (see `traces/README.md`).
    Csv,
    /// RMM `logging_resource_adaptor` CSV: `Thread,Time,Action,Pointer,Size,Stream`.
    Rmm,
    /// `torch.cuda.memory._dump_snapshot` pickle.
    Snapshot,
}

const BUF: usize = 1 << 16;

/// Loads every trace in the file at `path` (one per device for a snapshot, else one).
pub fn load_path(path: &Path) -> Result<Vec<Trace>, TraceError> {
    let file = path.display().to_string();
    let f = File::open(path)
        .map_err(|e| TraceError::new(&file, 0, None, format!("cannot open: {e}")))?;
    load_reader(&file, &trace_name(path), f)
}

/// Loads every trace in an in-memory file (e.g. an embedded one); `name` names it in errors and reports.
pub fn load_bytes(name: &str, bytes: &[u8]) -> Result<Vec<Trace>, TraceError> {
    load_reader(name, name, bytes)
}

/// Loads every trace from `r`: `file` names it in errors, `name` is the trace name.
pub fn load_reader(file: &str, name: &str, r: impl Read) -> Result<Vec<Trace>, TraceError> {
    let mut raw = BufReader::with_capacity(BUF, r);
    let head = raw.fill_buf().map_err(|e| io_err(file, e))?;
    if head.starts_with(&[0x1f, 0x8b]) {
        let gz = flate2::bufread::MultiGzDecoder::new(raw);
        load_plain(file, name, BufReader::with_capacity(BUF, gz))
    } else {
        load_plain(file, name, raw)
    }
}

fn io_err(file: &str, e: std::io::Error) -> TraceError {
    TraceError::new(file, 0, None, format!("read error: {e}"))
}

fn load_plain(file: &str, name: &str, mut r: impl BufRead) -> Result<Vec<Trace>, TraceError> {
    let head = r.fill_buf().map_err(|e| io_err(file, e))?;
    if head.first() == Some(&0x80) {
        return crate::snapshot::read_snapshot(file, name, r);
    }
    let mut line = Vec::with_capacity(256);
    r.read_until(b'\n', &mut line)
        .map_err(|e| io_err(file, e))?;
    let header = trim(&line);
    if header == RMM_HEADER.as_bytes() {
        Ok(vec![read_rmm_body(file, name, r)?])
    } else if header == CSV_HEADER.as_bytes() {
        Ok(vec![read_csv_body(file, name, r)?])
    } else {
        Err(missing_header(file, header))
    }
}

fn missing_header(file: &str, found: &[u8]) -> TraceError {
    let found = String::from_utf8_lossy(&found[..found.len().min(60)]).into_owned();
    TraceError::new(
        file,
        1,
        None,
        format!(
            "missing header: expected `{CSV_HEADER}` (genpool CSV), `{RMM_HEADER}` (RMM log) or a \
             PyTorch snapshot pickle; found `{found}`"
        ),
    )
}

/// Reads one genpool CSV trace (plain text, header included) from `r`.
pub fn read_csv(file: &str, name: &str, mut r: impl BufRead) -> Result<Trace, TraceError> {
    let mut line = Vec::new();
    r.read_until(b'\n', &mut line)
        .map_err(|e| io_err(file, e))?;
    if trim(&line) != CSV_HEADER.as_bytes() {
        return Err(missing_header(file, trim(&line)));
    }
    read_csv_body(file, name, r)
}

/// Reads one RMM log (plain text, header included) from `r`.
pub fn read_rmm(file: &str, name: &str, mut r: impl BufRead) -> Result<Trace, TraceError> {
    let mut line = Vec::new();
    r.read_until(b'\n', &mut line)
        .map_err(|e| io_err(file, e))?;
    if trim(&line) != RMM_HEADER.as_bytes() {
        return Err(missing_header(file, trim(&line)));
    }
    read_rmm_body(file, name, r)
}

fn trim(mut s: &[u8]) -> &[u8] {
    while let [rest @ .., b'\n' | b'\r' | b' ' | b'\t'] = s {
        s = rest;
    }
    while let [b' ' | b'\t', rest @ ..] = s {
        s = rest;
    }
    s
}

/// Splits `line` at commas into `out`; returns how many fields there were (more than `N` are counted,
/// not stored).
fn split<'a, const N: usize>(line: &'a [u8], out: &mut [&'a [u8]; N]) -> usize {
    let mut n = 0;
    for f in line.split(|&b| b == b',') {
        if n < N {
            out[n] = f;
        }
        n += 1;
    }
    n
}

fn parse_dec(s: &[u8]) -> Option<u64> {
    if s.is_empty() || s.len() > 20 {
        return None;
    }
    let mut v: u64 = 0;
    for &b in s {
        let d = b.wrapping_sub(b'0');
        if d > 9 {
            return None;
        }
        v = v.checked_mul(10)?.checked_add(u64::from(d))?;
    }
    Some(v)
}

fn parse_hex(s: &[u8]) -> Option<u64> {
    let s = s
        .strip_prefix(b"0x")
        .or_else(|| s.strip_prefix(b"0X"))
        .unwrap_or(s);
    if s.is_empty() || s.len() > 16 {
        return None;
    }
    let mut v: u64 = 0;
    for &b in s {
        let d = match b {
            b'0'..=b'9' => b - b'0',
            b'a'..=b'f' => b - b'a' + 10,
            b'A'..=b'F' => b - b'A' + 10,
            _ => return None,
        };
        v = (v << 4) | u64::from(d);
    }
    Some(v)
}

fn show(s: &[u8]) -> String {
    String::from_utf8_lossy(&s[..s.len().min(40)]).into_owned()
}

struct Lines<R> {
    r: R,
    buf: Vec<u8>,
    line: u64,
}

impl<R: BufRead> Lines<R> {
    /// The next non-empty line (without its line break), or `None` at the end.
    fn next(&mut self, file: &str) -> Result<Option<(u64, &[u8])>, TraceError> {
        loop {
            self.buf.clear();
            let n = self.r.read_until(b'\n', &mut self.buf).map_err(|e| {
                TraceError::new(file, self.line + 1, None, format!("read error: {e}"))
            })?;
            if n == 0 {
                return Ok(None);
            }
            self.line += 1;
            if !trim(&self.buf).is_empty() {
                return Ok(Some((self.line, trim(&self.buf))));
            }
        }
    }
}

fn read_csv_body(file: &str, name: &str, r: impl BufRead) -> Result<Trace, TraceError> {
    let mut b = TraceBuilder::new(file);
    // Header was line 1.
    let mut lines = Lines {
        r,
        buf: Vec::with_capacity(128),
        line: 1,
    };
    while let Some((line, l)) = lines.next(file)? {
        let f = six_fields(file, line, l, CSV_HEADER)?;
        let num = |i: usize, field: &str| {
            parse_dec(f[i]).ok_or_else(|| {
                TraceError::new(
                    file,
                    line,
                    Some(field),
                    format!("{field}: `{}` is not a non-negative integer", show(f[i])),
                )
            })
        };
        let kind = match f[1] {
            b"a" => EventKind::Alloc,
            b"f" => EventKind::Free,
            other => {
                return Err(TraceError::new(
                    file,
                    line,
                    Some("action"),
                    format!("unknown action `{}` (expected `a` or `f`)", show(other)),
                ))
            }
        };
        let e = Event {
            t_us: num(0, "t_us")?,
            kind,
            addr: num(2, "addr")?,
            size: num(3, "size")?,
            stream: num(4, "stream")?,
            site: num(5, "site")?,
        };
        b.push(e, line)?;
    }
    Ok(b.finish(name))
}

/// Parses RMM's time column: `HH:MM:SS.ffffff` (spdlog `%H:%M:%S.%f`, current RMM) or decimal seconds
/// (`1634567890.123456`, as RMM's docs show). Returns microseconds.
/// The six comma-separated fields of a trace line, or an error naming the line and the expected header.
fn six_fields<'l>(
    file: &str,
    line: u64,
    l: &'l [u8],
    header: &str,
) -> Result<[&'l [u8]; 6], TraceError> {
    let mut f: [&[u8]; 6] = [&[]; 6];
    let n = split(l, &mut f);
    if n != 6 {
        return Err(TraceError::new(
            file,
            line,
            None,
            format!("expected 6 fields ({header}), found {n}"),
        ));
    }
    Ok(f)
}

fn parse_rmm_time(s: &[u8]) -> Option<u64> {
    let (whole, frac) = match s.iter().position(|&c| c == b'.') {
        Some(p) => (&s[..p], &s[p + 1..]),
        None => (s, &b""[..]),
    };
    let secs = if whole.contains(&b':') {
        let mut parts = whole.split(|&c| c == b':');
        let h = parse_dec(parts.next()?)?;
        let m = parse_dec(parts.next()?)?;
        let sec = parse_dec(parts.next()?)?;
        if parts.next().is_some() || m >= 60 || sec >= 61 {
            return None;
        }
        h.checked_mul(3600)?.checked_add(m * 60 + sec)?
    } else {
        parse_dec(whole)?
    };
    // Microseconds from up to 9 fraction digits (spdlog's %f has 6).
    if frac.len() > 9 || (!frac.is_empty() && parse_dec(frac).is_none()) {
        return None;
    }
    let mut us = 0u64;
    for i in 0..6 {
        us = us * 10 + frac.get(i).map_or(0, |&c| u64::from(c - b'0'));
    }
    secs.checked_mul(1_000_000)?.checked_add(us)
}

fn read_rmm_body(file: &str, name: &str, r: impl BufRead) -> Result<Trace, TraceError> {
    const DAY_US: u64 = 86_400_000_000;
    let mut b = TraceBuilder::new(file);
    let mut lines = Lines {
        r,
        buf: Vec::with_capacity(128),
        line: 1,
    };
    let (mut day_offset, mut last_t) = (0u64, 0u64);
    while let Some((line, l)) = lines.next(file)? {
        let f = six_fields(file, line, l, RMM_HEADER)?;
        let err = |field: &str, what: &str, v: &[u8]| {
            TraceError::new(
                file,
                line,
                Some(field),
                format!("{field}: `{}` is not {what}", show(v)),
            )
        };
        let kind = match trim(f[2]) {
            b"allocate" => EventKind::Alloc,
            b"free" | b"deallocate" => EventKind::Free,
            b"allocate failure" => continue,
            other => {
                return Err(TraceError::new(
                    file,
                    line,
                    Some("Action"),
                    format!(
                        "unknown action `{}` (expected `allocate`, `free` or `allocate failure`)",
                        show(other)
                    ),
                ))
            }
        };
        if parse_dec(trim(f[0])).is_none() {
            return Err(err("Thread", "a thread id", f[0]));
        }
        let t = parse_rmm_time(trim(f[1]))
            .ok_or_else(|| err("Time", "a time (HH:MM:SS.ffffff or seconds.micros)", f[1]))?;
        // Clock-of-day times wrap at midnight; threads may log slightly out of order, so only a jump
        // back of more than half a day counts as a wrap.
        if t.saturating_add(day_offset).saturating_add(DAY_US / 2) < last_t {
            day_offset = day_offset.saturating_add(DAY_US);
        }
        let t_us = t.saturating_add(day_offset);
        last_t = last_t.max(t_us);
        let addr = parse_hex(trim(f[3])).ok_or_else(|| err("Pointer", "a hex pointer", f[3]))?;
        let size =
            parse_dec(trim(f[4])).ok_or_else(|| err("Size", "a non-negative integer", f[4]))?;
        let stream =
            parse_hex(trim(f[5])).ok_or_else(|| err("Stream", "a hex stream handle", f[5]))?;
        b.push(
            Event {
                t_us,
                kind,
                addr,
                size,
                stream,
                site: 0,
            },
            line,
        )?;
    }
    Ok(b.finish(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers() {
        assert_eq!(parse_dec(b"18446744073709551615"), Some(u64::MAX));
        assert_eq!(parse_dec(b"18446744073709551616"), None);
        assert_eq!(parse_dec(b""), None);
        assert_eq!(parse_dec(b"-1"), None);
        assert_eq!(parse_dec(b"1e3"), None);
        assert_eq!(parse_hex(b"0x7f8A40000400"), Some(0x7f8a_4000_0400));
        assert_eq!(parse_hex(b"0"), Some(0));
        assert_eq!(parse_hex(b"0x"), None);
        assert_eq!(parse_hex(b"(nil)"), None);
        assert_eq!(parse_hex(b"0x1ffffffffffffffff"), None);
    }

    #[test]
    fn rmm_times() {
        assert_eq!(parse_rmm_time(b"00:00:01.000002"), Some(1_000_002));
        assert_eq!(
            parse_rmm_time(b"11:44:54.626548"),
            Some(((11 * 3600 + 44 * 60 + 54) * 1_000_000) + 626_548)
        );
        assert_eq!(
            parse_rmm_time(b"1634567890.123456"),
            Some(1_634_567_890_123_456)
        );
        assert_eq!(parse_rmm_time(b"12.5"), Some(12_500_000));
        assert_eq!(parse_rmm_time(b"11:61:00.0"), None);
        assert_eq!(parse_rmm_time(b"noon"), None);
        assert_eq!(parse_rmm_time(b"1.12345678901"), None);
    }

    #[test]
    fn trims() {
        assert_eq!(trim(b"  a,b \r\n"), b"a,b");
        assert_eq!(trim(b"\n"), b"");
    }
}
