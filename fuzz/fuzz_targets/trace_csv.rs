//! genpool's CSV trace reader on arbitrary bytes: plain, through the format detection (which also
//! un-gzips), never a panic, a hang or unbounded memory; every failure is a `TraceError` with a place.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match gen_trace::read_csv("fuzz.csv", "fuzz", data) {
        Ok(t) => assert!(t.ops() as usize <= data.len()),
        Err(e) => assert!(!e.to_string().is_empty()),
    }
    // Auto-detection: gzip by magic bytes, then the CSV, RMM or snapshot reader.
    let _ = gen_trace::load_bytes("fuzz", data);
});
