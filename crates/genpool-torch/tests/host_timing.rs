//! `GENPOOL_TIMING=1`: the plug-in times its own allocation entry points and reports them in the stats
//! JSON. One test in its own process: it sets the environment before the plug-in reads it. (Without the
//! variable, `host_timing` is `null`: the unit tests check that.)

use std::ffi::c_int;
use std::ptr::null_mut;

use genpool_torch::*;

fn stats(device: c_int) -> serde_json::Value {
    let mut buf = vec![0u8; 1 << 16];
    // SAFETY: `buf` is valid for `buf.len()` bytes.
    let n = unsafe { genpool_stats_json(device, buf.as_mut_ptr().cast(), buf.len()) };
    assert!(n > 0 && n < buf.len(), "stats of device {device}");
    serde_json::from_slice(&buf[..n]).unwrap()
}

#[test]
fn timing_counts_every_entry_call() {
    // Edition 2021: `set_var` is safe; no other thread of this test binary runs yet.
    std::env::set_var("GENPOOL_DEVICE", "sim");
    std::env::set_var("GENPOOL_TIMING", "1");
    let mut blocks = Vec::new();
    // Small (slab), large (extent: maps pages on the simulated device) and size 0 (NULL, still a call).
    for size in [512usize, 4096, 3 << 20, 64 << 20, 0] {
        blocks.push(genpool_malloc(size, 0, null_mut()));
    }
    assert!(blocks[..4].iter().all(|p| !p.is_null()));
    assert!(blocks[4].is_null());
    for &p in &blocks {
        genpool_free(p, 0, 0, null_mut());
    }
    // A foreign pointer: refused, logged, and still timed.
    genpool_free(std::ptr::without_provenance_mut(0x1000), 0, 0, null_mut());
    // The PyTorch backend's entry points are timed with the hook's: two blocks, their frees and a NULL
    // free (a no-op, still a call).
    for size in [1024usize, 8 << 20] {
        let mut p = null_mut();
        // SAFETY: `p` is valid for one pointer write; a NULL `freed` is allowed.
        unsafe {
            assert_eq!(genpool_backend_malloc(size, 0, 0, null_mut(), &mut p), 0);
            assert!(!p.is_null());
            assert_eq!(genpool_backend_free(p, null_mut()), 0);
        }
    }
    // SAFETY: NULL is a no-op free.
    unsafe { genpool_backend_free(null_mut(), null_mut()) };

    let t = &stats(0)["host_timing"];
    assert_eq!(t["malloc"]["calls"], 7, "{t}");
    assert_eq!(t["free"]["calls"], 9, "{t}");
    for side in ["malloc", "free"] {
        let ns = t[side]["ns"].as_u64().unwrap();
        let max = t[side]["max_ns"].as_u64().unwrap();
        let slow = t[side]["slow"].as_u64().unwrap();
        assert!(ns > 0 && max > 0 && max <= ns, "{side}: {t}");
        assert!(slow <= 9, "{side}: {t}");
        // A call over the threshold is what `slow` counts, so the slowest one decides whether any is.
        assert_eq!(
            slow > 0,
            max > t["slow_ns"].as_u64().unwrap(),
            "{side}: {t}"
        );
    }
}
