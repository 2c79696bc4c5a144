//! Reader tests: genpool CSV (validation errors with line numbers, gzip, round trip through the
//! writer), RMM logs, PyTorch snapshot pickles (fixture made by tests/fixtures/make_snapshot.py), and the
//! bundled real traces.
//!
//! Under Miri (`cargo +nightly miri test -p gen-trace`, isolation on) nothing touches the file system: the
//! fixtures are compiled in, and the parts that open files (the bundled traces, a temporary directory, a
//! missing path) are skipped.

use std::io::Write;
use std::path::{Path, PathBuf};

use gen_trace::*;

fn csv(body: &str) -> Result<Vec<Trace>, TraceError> {
    load_bytes("t.csv", format!("{CSV_HEADER}\n{body}").as_bytes())
}

fn gz(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

const SNAPSHOT_SMALL: &[u8] = include_bytes!("fixtures/snapshot_small.pickle");
const SNAPSHOT_SMALL_JSON: &str = include_str!("fixtures/snapshot_small.expected.json");
const SNAPSHOT_BAD_ADDR: &[u8] = include_bytes!("fixtures/snapshot_bad_addr.pickle");
/// Recorded by PyTorch 2.11.0+cu130's `torch.cuda.memory._dump_snapshot` on the H200
/// (`python -m genpool_torch.capture --snapshot-pickle`: a two-stream program with `record_stream`).
const SNAPSHOT_TORCH: &[u8] = include_bytes!("fixtures/snapshot_torch211.pickle");
const SNAPSHOT_TORCH_JSON: &str = include_str!("fixtures/snapshot_torch211.expected.json");

/// `traces` hold exactly the events (kind, time, address, size, stream, call-site hash) of the JSON the
/// capture tool derived from the same snapshot in Python.
fn assert_events_match(traces: &[Trace], expected_json: &str) {
    let expected: serde_json::Value = serde_json::from_str(expected_json).unwrap();
    let expected = expected.as_array().unwrap();
    assert_eq!(
        traces.len(),
        expected.len(),
        "one trace per non-empty device"
    );
    for (t, x) in traces.iter().zip(expected) {
        assert_eq!(t.name, x["name"].as_str().unwrap());
        let xe = x["events"].as_array().unwrap();
        assert_eq!(t.events.len(), xe.len(), "{}", t.name);
        for (e, x) in t.events.iter().zip(xe) {
            let kind = match e.kind {
                EventKind::Alloc => "alloc",
                EventKind::Free => "free",
            };
            assert_eq!(kind, x["kind"].as_str().unwrap());
            assert_eq!(e.t_us, x["t_us"].as_u64().unwrap());
            assert_eq!(e.addr, x["addr"].as_u64().unwrap());
            assert_eq!(e.size, x["size"].as_u64().unwrap());
            assert_eq!(e.stream, x["stream"].as_u64().unwrap());
            assert_eq!(e.site, x["site"].as_u64().unwrap(), "site of {e:?}");
        }
    }
}

/// A snapshot made by the real tool. PyTorch shares frame dicts and strings between events; serde-pickle
/// 1.2.0 read every shared object after its first use as `None` (vendor/serde-pickle/GENPOOL_PATCH.md):
/// every stack after the first was lost. With the fix, every site equals Python's.
#[test]
#[cfg_attr(
    miri,
    ignore = "a minute under Miri; the same reader code runs on the small fixture there"
)]
fn a_real_pytorch_snapshot_reads_as_python_reads_it() {
    let traces = load_fixture("snapshot_torch211.pickle", SNAPSHOT_TORCH).unwrap();
    assert_events_match(&traces, SNAPSHOT_TORCH_JSON);
    let t = &traces[0];
    let allocs = t.events.iter().filter(|e| e.kind == EventKind::Alloc);
    assert!(allocs.clone().count() >= 4);
    assert!(
        allocs.clone().all(|e| e.site != 0),
        "every allocation has its stack"
    );
    let streams: std::collections::BTreeSet<u64> = t.events.iter().map(|e| e.stream).collect();
    assert!(
        streams.len() >= 2,
        "the side stream's blocks are there: {streams:?}"
    );
}

const SNAPSHOT_GENPOOL: &[u8] = include_bytes!("fixtures/snapshot_genpool_backend.pickle");

/// The round trip of genpool's own PyTorch backend: a snapshot `torch.cuda.memory._dump_snapshot` wrote
/// with genpool as PyTorch's allocator (H200, torch 2.11, the compatibility suite's history probe: 100,
/// 300 000 and 3 Mi floats allocated, the first freed) reads back as those events, with their stacks.
#[test]
#[cfg_attr(
    miri,
    ignore = "its long stacks take a while under Miri; the same reader code runs on the small fixture there"
)]
fn a_snapshot_written_through_genpools_backend_reads_back() {
    let traces = load_fixture("snapshot_genpool_backend.pickle", SNAPSHOT_GENPOOL).unwrap();
    assert_eq!(traces.len(), 1);
    let t = &traces[0];
    let allocs: Vec<u64> = t
        .events
        .iter()
        .filter(|e| e.kind == EventKind::Alloc)
        .map(|e| e.size)
        .collect();
    let frees: Vec<u64> = t
        .events
        .iter()
        .filter(|e| e.kind == EventKind::Free)
        .map(|e| e.size)
        .collect();
    assert_eq!(allocs, vec![400, 1_200_000, 12_582_912]);
    assert_eq!(
        frees,
        vec![400],
        "the freed block, at the size it was allocated with"
    );
    assert!(
        t.events
            .iter()
            .filter(|e| e.kind == EventKind::Alloc)
            .all(|e| e.site != 0),
        "every allocation has its stack"
    );
}

/// Loads a fixture through [`load_path`], or under Miri (no file system) from its compiled-in `bytes`
/// under the same file and trace names.
fn load_fixture(file: &str, bytes: &[u8]) -> Result<Vec<Trace>, TraceError> {
    let path = fixtures().join(file);
    if cfg!(miri) {
        load_reader(&path.display().to_string(), &trace_name(&path), bytes)
    } else {
        load_path(&path)
    }
}

/// The real traces bundled in the repository: `$GENPOOL_TRACE_DIR`, else `<workspace>/benches/traces`.
fn bundled_traces() -> PathBuf {
    std::env::var_os("GENPOOL_TRACE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../benches/traces"))
}

#[test]
fn csv_reads_and_summarizes() {
    let t = csv("1,a,1024,512,0,7\n2,a,4096,1024,5,0\n\n3,f,1024,512,0,0\n4,a,8192,512,0,7\n")
        .unwrap()
        .remove(0);
    assert_eq!(t.name, "t.csv");
    assert_eq!(t.events.len(), 4);
    assert_eq!(
        t.events[1],
        Event {
            t_us: 2,
            kind: EventKind::Alloc,
            addr: 4096,
            size: 1024,
            stream: 5,
            site: 0
        }
    );
    let s = &t.summary;
    assert_eq!((s.allocs, s.frees, s.peak_live), (3, 1, 1536));
    assert_eq!((s.live_at_end, s.live_bytes_at_end), (2, 1536));
    assert_eq!(s.streams, vec![0, 5]);
    assert_eq!((s.sites, s.max_size, s.alloc_bytes), (1, 1024, 2048));
}

#[test]
fn csv_crlf_and_gzip_detected_by_magic() {
    let text = format!("{CSV_HEADER}\r\n1,a,512,512,0,0\r\n2,f,512,512,0,0\r\n");
    let plain = load_bytes("x", text.as_bytes()).unwrap();
    // The name says nothing about gzip; the magic bytes do.
    let zipped = load_bytes("x", &gz(text.as_bytes())).unwrap();
    assert_eq!(plain, zipped);
    assert_eq!(plain[0].events.len(), 2);
}

fn err(body: &str) -> TraceError {
    csv(body).expect_err("malformed input must be rejected")
}

#[test]
fn csv_errors_name_line_field_and_problem() {
    let e = err("1,a,512,512,0,0\n2,x,512,512,0,0\n");
    assert_eq!((e.line, e.field.as_deref()), (3, Some("action")));
    assert_eq!(
        e.to_string(),
        "t.csv:3: unknown action `x` (expected `a` or `f`)"
    );

    let e = err("1,a,512,5x2,0,0\n");
    assert_eq!((e.line, e.field.as_deref()), (2, Some("size")));
    assert!(
        e.to_string()
            .contains("`5x2` is not a non-negative integer"),
        "{e}"
    );

    let e = err("1,a,512,512,0\n");
    assert_eq!(e.line, 2);
    assert!(e.message.contains("expected 6 fields"), "{e}");

    let e = err("1,a,512,512,0,0\n2,f,1024,512,0,0\n");
    assert_eq!((e.line, e.field.as_deref()), (3, Some("addr")));
    assert!(
        e.message.contains("free of 0x400, which is not live"),
        "{e}"
    );

    let e = err("1,a,512,512,0,0\n2,a,512,1024,0,0\n");
    assert_eq!((e.line, e.field.as_deref()), (3, Some("addr")));
    assert!(e.message.contains("already live"), "{e}");

    let e = err("1,a,512,0,0,0\n");
    assert_eq!((e.line, e.field.as_deref()), (2, Some("size")));
    assert!(e.message.contains("size 0"), "{e}");

    let e = err("1,a,512,512,0,0\n2,f,512,1024,0,0\n");
    assert!(e.message.contains("has 512 bytes"), "{e}");

    let e = err("99999999999999999999,a,512,512,0,0\n");
    assert_eq!(e.field.as_deref(), Some("t_us"));

    let e = load_bytes("h.csv", b"1,a,512,512,0,0\n").unwrap_err();
    assert_eq!(e.line, 1);
    assert!(e.to_string().starts_with("h.csv:1: missing header"), "{e}");

    let e = load_bytes("empty.csv", b"").unwrap_err();
    assert!(e.message.contains("missing header"), "{e}");

    // Truncated gzip is a read error, not a panic.
    let mut z = gz(format!("{CSV_HEADER}\n1,a,512,512,0,0\n").as_bytes());
    z.truncate(z.len() / 2);
    let e = load_bytes("z.csv.gz", &z).unwrap_err();
    assert!(e.message.contains("read error"), "{e}");

    if !cfg!(miri) {
        let e = load_path(Path::new("/nonexistent/x.csv")).unwrap_err();
        assert_eq!(e.to_string().split(": ").nth(1), Some("cannot open"));
    }
}

#[test]
fn csv_round_trip_through_writer() {
    let t = csv("10,a,1024,512,0,77\n20,a,4096,1536,3,88\n30,f,1024,512,0,0\n")
        .unwrap()
        .remove(0);
    let mut out = Vec::new();
    write_csv(&t, &mut out).unwrap();
    let back = read_csv("back", "t.csv", &out[..]).unwrap();
    assert_eq!(back, t);

    if cfg!(miri) {
        return; // no file system
    }
    let dir = std::env::temp_dir().join(format!("gen-trace-rt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("t.csv.gz");
    write_csv_path(&t, &p).unwrap();
    let bytes = std::fs::read(&p).unwrap();
    assert_eq!(&bytes[..2], &[0x1f, 0x8b], "written gzip'd");
    let mut back = load_path(&p).unwrap().remove(0);
    assert_eq!(back.name, "t");
    back.name = t.name.clone();
    assert_eq!(back, t);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn trace_names() {
    assert_eq!(trace_name(Path::new("/a/b/resnet.csv.gz")), "resnet");
    assert_eq!(trace_name(Path::new("snap.pickle")), "snap");
    assert_eq!(trace_name(Path::new("x.y")), "x.y");
}

#[test]
fn rmm_log() {
    let log = format!(
        "{RMM_HEADER}\n\
         140573312345856,23:59:59.999990,allocate,0x7f8a40000000,1024,0x7f8a38001020\n\
         140573312345856,23:59:59.999995,allocate failure,(nil),1099511627776,0\n\
         140573312345857,00:00:00.000010,allocate,0x7f8a40000400,2048,0\n\
         140573312345856,00:00:00.000020,free,0x7f8a40000000,1024,0x7f8a38001020\n"
    );
    let t = load_bytes("rmm.csv", log.as_bytes()).unwrap().remove(0);
    assert_eq!(t.events.len(), 3, "the failure is skipped");
    let day = 86_400_000_000u64;
    assert_eq!(t.events[0].t_us, day - 10);
    assert_eq!(t.events[1].t_us, day + 10, "midnight wrap");
    assert_eq!(t.events[0].addr, 0x7f8a_4000_0000);
    assert_eq!(t.events[0].stream, 0x7f8a_3800_1020);
    assert_eq!(t.events[2].kind, EventKind::Free);
    assert_eq!(t.summary.peak_live, 3072);

    // The docs' variant: epoch seconds, `deallocate`.
    let log = format!(
        "{RMM_HEADER}\n1,1634567890.123456,allocate,0x1000,8,0x0\n1,1634567890.234567,deallocate,0x1000,8,0x0\n"
    );
    let t = load_bytes("rmm2.csv", log.as_bytes()).unwrap().remove(0);
    assert_eq!(t.events[1].t_us, 1_634_567_890_234_567);

    let e = load_bytes(
        "rmm3.csv",
        format!("{RMM_HEADER}\n1,00:00:01.0,reallocate,0x1000,8,0\n").as_bytes(),
    )
    .unwrap_err();
    assert_eq!((e.line, e.field.as_deref()), (2, Some("Action")));
    let e = load_bytes(
        "rmm4.csv",
        format!("{RMM_HEADER}\n1,00:00:01.0,allocate,0xzz,8,0\n").as_bytes(),
    )
    .unwrap_err();
    assert_eq!(e.field.as_deref(), Some("Pointer"));
    assert!(
        e.to_string().starts_with("rmm4.csv:2: Pointer: `0xzz`"),
        "{e}"
    );
}

#[test]
fn snapshot_fixture_matches_python() {
    let traces = load_fixture("snapshot_small.pickle", SNAPSHOT_SMALL).unwrap();
    assert_events_match(&traces, SNAPSHOT_SMALL_JSON);
    // Sites differ by frames, and only the top 8 frames count (checked against python above).
    assert_ne!(traces[0].events[0].site, traces[0].events[3].site);

    // gzip'd pickles are detected too (a second whole parse: not under Miri, where it takes a minute).
    if !cfg!(miri) {
        assert_eq!(load_bytes("s", &gz(SNAPSHOT_SMALL)).unwrap().len(), 2);
    }
}

#[test]
fn snapshot_errors() {
    let e = load_fixture("snapshot_bad_addr.pickle", SNAPSHOT_BAD_ADDR).unwrap_err();
    assert_eq!((e.line, e.field.as_deref()), (2, Some("addr")));
    assert!(
        e.to_string()
            .contains("snapshot_bad_addr.pickle:2: device 0 event 1"),
        "{e}"
    );

    // A pickle that is not a snapshot, and one that is cut short.
    let e = load_bytes("p", &[0x80, 0x04, 0x4b, 0x07, 0x2e]).unwrap_err();
    assert!(e.message.contains("not a PyTorch memory snapshot"), "{e}");
    let bytes = SNAPSHOT_SMALL;
    let e = load_bytes("cut", &bytes[..bytes.len() / 2]).unwrap_err();
    assert!(e.message.contains("not a readable pickle"), "{e}");
}

#[test]
#[cfg_attr(miri, ignore = "reads the bundled traces")]
fn bundled_traces_load_fast_and_match_readme() {
    let dir = bundled_traces();
    assert!(
        dir.is_dir(),
        "bundled traces not found at {} (set GENPOOL_TRACE_DIR)",
        dir.display()
    );
    // (file, events, peak live in GiB to 2 decimals) from traces/README.md.
    for (f, events, gib) in [
        ("resnet50_train.csv.gz", 25_814, 2.97),
        ("gpt2_train_fixed.csv.gz", 34_839, 12.66),
        ("gpt2m_train_varlen.csv.gz", 133_151, 35.87),
        ("gpt2_generate_kv.csv.gz", 494_718, 0.84),
    ] {
        let t0 = std::time::Instant::now();
        let t = load_path(&dir.join(f)).unwrap().remove(0);
        let took = t0.elapsed();
        eprintln!("{f}: {} events loaded in {took:?}", t.events.len());
        assert_eq!(t.events.len(), events, "{f}");
        let peak = t.summary.peak_live as f64 / (1u64 << 30) as f64;
        assert!((peak - gib).abs() < 0.006, "{f}: peak live {peak:.3} GiB");
        assert_eq!(t.summary.allocs, t.summary.frees + t.summary.live_at_end);
        // Release builds must load the biggest in well under a second (debug gets slack).
        let limit = if cfg!(debug_assertions) { 20.0 } else { 1.0 };
        assert!(took.as_secs_f64() < limit, "{f}: load took {took:?}");
    }
}

/// Found by the `trace_rmm` fuzz target: an hour field so large that `h * 3600` overflowed (a panic in
/// debug builds, a wrong time in release). Now a clean error naming the line, or a trace — never a panic.
#[test]
fn rmm_time_overflow_is_not_a_panic() {
    // The fuzzer's input lies outside the crate: not under Miri (no file system).
    if !cfg!(miri) {
        let bytes = std::fs::read(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../fuzz/regressions/trace_rmm/hour-overflow.rmm.csv"),
        )
        .unwrap();
        match gen_trace::load_bytes("hour-overflow.rmm.csv", &bytes) {
            Ok(_) => {}
            Err(e) => assert!(e.to_string().starts_with("hour-overflow.rmm.csv:"), "{e}"),
        }
    }
    let huge = "Thread,Time,Action,Pointer,Size,Stream\n1,99999999999999999:00:00.0,allocate,0x1000,512,0x0\n";
    let e = gen_trace::load_bytes("huge.csv", huge.as_bytes()).unwrap_err();
    assert_eq!(e.line, 2, "{e}");
}

/// A gzip member whose header carries a header CRC (`FHCRC`), so every header byte after the magic is
/// checked, then `data` deflated, then the trailer (CRC-32 and length of `data`).
fn gz_with_header_crc(data: &[u8]) -> Vec<u8> {
    // magic, CM = deflate, FLG = FHCRC, MTIME, XFL, OS = unknown
    let mut out = vec![0x1f, 0x8b, 8, 0x02, 0x12, 0x34, 0x56, 0x78, 0, 255];
    let mut crc = flate2::Crc::new();
    crc.update(&out);
    out.extend_from_slice(&(crc.sum() as u16).to_le_bytes());
    let mut d = flate2::write::DeflateEncoder::new(out, flate2::Compression::default());
    d.write_all(data).unwrap();
    let mut out = d.finish().unwrap();
    let mut crc = flate2::Crc::new();
    crc.update(data);
    out.extend_from_slice(&crc.sum().to_le_bytes());
    out.extend_from_slice(&(data.len() as u32).to_le_bytes());
    out
}

/// A well-formed CSV trace of `n` allocations, each freed three events later (varied sizes, streams
/// and sites, so that the deflate stream is not trivially repetitive).
fn synthetic_csv(n: u64) -> String {
    let mut s = format!("{CSV_HEADER}\n");
    let mut t = 0;
    for i in 0..n {
        let size = 512 * (1 + (i * 7919) % 97);
        s += &format!(
            "{t},a,{},{size},{},{}\n",
            0x10_0000 + i * 0x10_0000,
            i % 3,
            i * 31 % 11
        );
        t += 1 + i % 5;
        if i >= 3 {
            let j = i - 3;
            let size = 512 * (1 + (j * 7919) % 97);
            s += &format!("{t},f,{},{size},{},0\n", 0x10_0000 + j * 0x10_0000, j % 3);
            t += 1;
        }
    }
    s
}

/// Asserts that `bytes` is refused with a [`TraceError`] that names `name`; returns it.
fn refused(name: &str, bytes: &[u8], what: &str) -> TraceError {
    match load_bytes(name, bytes) {
        Ok(t) => panic!(
            "{what}: accepted ({} events) instead of an error",
            t.first().map_or(0, |t| t.events.len())
        ),
        Err(e) => {
            assert_eq!(e.file, name, "{what}: {e}");
            assert!(
                e.to_string().starts_with(&format!("{name}:")),
                "{what}: {e}"
            );
            e
        }
    }
}

fn is_read_error(e: &TraceError) -> bool {
    e.message.contains("read error")
}

/// Corrupt gzip (issue #6): every header byte after the magic (covered by the header CRC), bytes of the
/// deflate body, every trailer byte (CRC-32 and length), truncations at every trailer position and
/// trailing garbage — each is a [`TraceError`] naming the file, never a panic and never a shortened or
/// altered trace. A second gzip member is read, not dropped.
#[test]
fn corrupt_gzip_is_an_error_naming_the_file() {
    // Miri inflates and parses at a few milliseconds a byte: a short text and a sample of the positions.
    let miri = cfg!(miri);
    let text = synthetic_csv(if miri { 5 } else { 400 });
    let good = gz_with_header_crc(text.as_bytes());
    let original = load_bytes("c.csv.gz", text.as_bytes()).unwrap();
    // The hand-made member is valid: it reads back as the plain text does.
    assert_eq!(load_bytes("c.csv.gz", &good).unwrap(), original);
    let (header, trailer) = (12, 8);
    let body = header..good.len() - trailer;
    assert!(body.len() > 32, "a deflate body worth mutating");
    let flips: &[u8] = if miri { &[0x01] } else { &[0x01, 0x80] };

    // Under Miri: the method, the flags, the time stamp and the header CRC.
    let header_bytes: Vec<usize> = if miri {
        vec![2, 3, 6, 10]
    } else {
        (2..header).collect()
    };
    for pos in header_bytes {
        for &flip in flips {
            let mut z = good.clone();
            z[pos] ^= flip;
            let e = refused("c.csv.gz", &z, &format!("header byte {pos} ^ {flip:#x}"));
            assert!(is_read_error(&e), "header byte {pos}: {e}");
        }
    }
    let mut body_errors = 0;
    let step = (body.len() / if miri { 2 } else { 8 }).max(1);
    for pos in body.clone().step_by(step) {
        let mut z = good.clone();
        z[pos] ^= 0xff;
        // Inside the stream the decoder may hand out garbage before it notices: the CSV parser or the
        // decoder, whichever comes first, refuses it.
        let e = refused("c.csv.gz", &z, &format!("body byte {pos}"));
        body_errors += u32::from(is_read_error(&e) || e.line > 0);
    }
    assert!(body_errors > 0);
    let trailer_bytes: Vec<usize> = if miri {
        vec![body.end, good.len() - 1] // CRC-32, length
    } else {
        (body.end..good.len()).collect()
    };
    for pos in trailer_bytes {
        for &flip in flips {
            let mut z = good.clone();
            z[pos] ^= flip;
            let e = refused("c.csv.gz", &z, &format!("trailer byte {pos} ^ {flip:#x}"));
            assert!(is_read_error(&e), "trailer byte {pos}: {e}");
            assert!(e.message.contains("checksum"), "trailer byte {pos}: {e}");
        }
    }
    // Truncated in the header, just after it, before and inside the trailer.
    let cuts: Vec<usize> = if miri {
        vec![header + 1, body.end]
    } else {
        [3, 11, header + 1, body.end - 1]
            .into_iter()
            .chain(body.end..good.len())
            .collect()
    };
    for len in cuts {
        let e = refused("c.csv.gz", &good[..len], &format!("cut at {len}"));
        assert!(is_read_error(&e), "cut at {len}: {e}");
    }
    // Trailing bytes that are not another gzip member.
    let mut z = good.clone();
    z.extend_from_slice(b"junk");
    let e = refused("c.csv.gz", &z, "trailing garbage");
    assert!(is_read_error(&e), "{e}");
    // A second member continues the text (as `cat a.gz b.gz` does): all of it is read.
    let more = "100000,a,512,512,0,0\n";
    let mut z = good.clone();
    z.extend_from_slice(&gz(more.as_bytes()));
    let t = load_bytes("c.csv.gz", &z).unwrap().remove(0);
    assert_eq!(t.events.len(), original[0].events.len() + 1);
}

/// The same on a real trace as its capture wrote it (`FNAME` set, no header CRC): flags, body and
/// trailer mutated, cut before the trailer. A change in a field that carries no data (the time stamp)
/// reads back the identical trace, so the comparison with the original is not vacuous.
#[test]
#[cfg_attr(miri, ignore = "reads the bundled traces")]
fn corrupt_real_gzip_trace_is_an_error_naming_the_file() {
    let path = bundled_traces().join("resnet50_train.csv.gz");
    let good = std::fs::read(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (set GENPOOL_TRACE_DIR)", path.display()));
    let name = "resnet50_train.csv.gz";
    let original = load_bytes(name, &good).unwrap();
    assert_eq!(good[3] & 0x0a, 0x08, "FNAME set, FHCRC not");
    let mut z = good.clone();
    z[5] ^= 0x01; // MTIME
    assert_eq!(load_bytes(name, &z).unwrap(), original, "mtime is not data");

    let mut cases: Vec<(String, Vec<u8>)> = Vec::new();
    let mut z = good.clone();
    z[2] = 7; // compression method
    cases.push(("CM".into(), z));
    let mut z = good.clone();
    z[3] |= 0x02; // FHCRC claimed: two body bytes read as the header CRC
    cases.push(("FHCRC".into(), z));
    let nul = 10 + good[10..].iter().position(|&b| b == 0).unwrap();
    let mut z = good.clone();
    z[nul] = b'x'; // the file name runs into the body
    cases.push(("FNAME terminator".into(), z));
    let body = nul + 1..good.len() - 8;
    for k in 1..8 {
        let pos = body.start + body.len() * k / 8;
        let mut z = good.clone();
        z[pos] ^= 0xff;
        cases.push((format!("body byte {pos}"), z));
    }
    for pos in body.end..good.len() {
        let mut z = good.clone();
        z[pos] ^= 0x10;
        cases.push((format!("trailer byte {pos}"), z));
    }
    cases.push(("cut before the trailer".into(), good[..body.end].to_vec()));
    cases.push(("cut in the body".into(), good[..body.end - 1000].to_vec()));
    for (what, z) in &cases {
        let e = refused(name, z, what);
        eprintln!("{what}: {e}");
        if what.starts_with("trailer") || what.starts_with("cut") {
            assert!(is_read_error(&e), "{what}: {e}");
        }
    }
}
