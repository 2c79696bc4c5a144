//! PyTorch memory-snapshot pickle reader on arbitrary bytes: never a panic or a hang; every trace it
//! accepts is one the replay can plan.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(traces) = gen_trace::read_snapshot("fuzz.pickle", "fuzz", data) {
        for t in &traces {
            let _ = gen_trace::ReplayPlan::new(t);
        }
    }
});
