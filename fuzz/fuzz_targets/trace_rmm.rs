//! RMM `logging_resource_adaptor` log reader on arbitrary bytes: never a panic or a hang.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match gen_trace::read_rmm("fuzz.rmm.csv", "fuzz", data) {
        Ok(t) => assert!(t.ops() as usize <= data.len()),
        Err(e) => assert!(!e.to_string().is_empty()),
    }
});
