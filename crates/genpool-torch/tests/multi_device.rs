//! The C ABI with `GENPOOL_DEVICE=sim` and four simulated devices: allocations come from the device
//! named, frees are routed by address (even with another device's index), statistics are per device, and
//! an index past the device count fails cleanly. One test in its own process: it sets the environment
//! before the plug-in reads it.

use std::ffi::{c_int, CStr};
use std::ptr::null_mut;

use genpool_torch::*;

fn last_error() -> String {
    let mut buf = vec![0u8; 4096];
    // SAFETY: `buf` is valid for `buf.len()` bytes.
    unsafe { genpool_last_error(buf.as_mut_ptr().cast(), buf.len()) };
    CStr::from_bytes_until_nul(&buf)
        .unwrap()
        .to_string_lossy()
        .into_owned()
}

fn stat(device: c_int, key: &str) -> u64 {
    let mut buf = vec![0u8; 1 << 16];
    // SAFETY: `buf` is valid for `buf.len()` bytes.
    let n = unsafe { genpool_stats_json(device, buf.as_mut_ptr().cast(), buf.len()) };
    assert!(n > 0 && n < buf.len(), "stats of device {device}");
    let json = std::str::from_utf8(&buf[..n]).unwrap();
    let at = json
        .find(&format!("\"{key}\":"))
        .unwrap_or_else(|| panic!("{key} in {json}"));
    json[at + key.len() + 3..]
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn four_simulated_devices_through_the_c_abi() {
    // Edition 2021: `set_var` is safe; no other thread of this test binary runs yet.
    std::env::set_var("GENPOOL_DEVICE", "sim");
    genpool_init(4);
    let mut blocks = Vec::new();
    for device in 0..4 as c_int {
        for size in [512usize, 1 << 20, 5 << 20] {
            let p = genpool_malloc(size, device, null_mut());
            assert!(!p.is_null(), "device {device}: {}", last_error());
            blocks.push((device, p));
        }
    }
    let addrs: std::collections::HashSet<usize> = blocks.iter().map(|(_, p)| p.addr()).collect();
    assert_eq!(
        addrs.len(),
        blocks.len(),
        "two devices handed out one address"
    );
    for device in 0..4 {
        assert_eq!(stat(device, "num_allocs"), 3, "device {device}");
        assert_eq!(stat(device, "live_blocks"), 3, "device {device}");
    }
    // Out-of-range indices: NULL and a clean error, nothing allocated.
    for bad in [4 as c_int, 63, -1] {
        assert!(genpool_malloc(512, bad, null_mut()).is_null());
        assert!(
            last_error().contains(&format!("invalid device index {bad}")),
            "{}",
            last_error()
        );
        // SAFETY: a null buffer is allowed.
        assert_eq!(unsafe { genpool_stats_json(bad, null_mut(), 0) }, 0);
    }
    // Free every block with the *next* device's index: routed to its owner by address.
    for (device, p) in &blocks {
        genpool_free(*p, 0, (device + 1) % 4, null_mut());
    }
    for device in 0..4 {
        assert_eq!(stat(device, "num_frees"), 3, "device {device}");
        assert_eq!(stat(device, "allocated_current"), 0, "device {device}");
        assert_eq!(stat(device, "num_invalid_frees"), 0, "device {device}");
    }
    assert_eq!(stat(0, "plugin_invalid_frees"), 0);
    // A second free of one of them is refused and counted, never a crash.
    let (device, p) = blocks[0];
    genpool_free(p, 0, device, null_mut());
    assert_eq!(stat(0, "plugin_invalid_frees"), 1);
}
