//! Host cost of the plug-in's C entry points with cold caches: `genpool_malloc` / `genpool_free` called as
//! PyTorch calls them, on the simulated device, replaying a trace's allocations and frees with an
//! unrelated buffer touched before every call (as PyTorch's own work between two allocator calls evicts
//! the allocator's data). The engine-level counterpart is `genpool/examples/coldops.rs`; the difference
//! between the two is the plug-in's own layer (device lookup, address range, recorded streams, guards).
//!
//!     cargo run --release -p genpool-torch --example coldabi -- TRACE
//!
//! `THRASH_KB` (default 2048), `PASSES` (default 3, the first not counted); `GENPOOL_CONF` as for the
//! plug-in. Streams are ignored (every call on the default stream). `ABI=backend` calls the PyTorch
//! backend's `genpool_backend_malloc` / `genpool_backend_free` instead of the pluggable hooks; `PAGE_STATS=1`
//! prints the page layer's driver-call counters after each pass.

use std::collections::HashMap;
use std::ffi::c_void;
use std::time::Instant;

use gen_trace::EventKind;
use genpool_torch::{
    genpool_backend_free, genpool_backend_malloc, genpool_free, genpool_malloc, genpool_stats_json,
};

fn main() {
    let path = std::env::args().nth(1).expect("usage: coldabi TRACE");
    let env = |k: &str, d: usize| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let (kb, passes) = (env("THRASH_KB", 2048), env("PASSES", 3));
    let backend = std::env::var("ABI").is_ok_and(|v| v == "backend");
    let malloc = |size: usize| -> *mut c_void {
        if !backend {
            return genpool_malloc(size, 0, std::ptr::null_mut());
        }
        let mut p = std::ptr::null_mut();
        // SAFETY: `p` is valid for one pointer write.
        unsafe { genpool_backend_malloc(size, 0, 0, std::ptr::null_mut(), &mut p) };
        p
    };
    let free = |p: *mut c_void, size: usize| {
        if backend {
            // SAFETY: a NULL `freed` is allowed.
            unsafe { genpool_backend_free(p, std::ptr::null_mut()) };
        } else {
            genpool_free(p, size, 0, std::ptr::null_mut());
        }
    };
    // SAFETY: single-threaded at this point; the plug-in reads it when the first pool is created.
    unsafe { std::env::set_var("GENPOOL_DEVICE", "sim") };
    let trace = gen_trace::load_path(std::path::Path::new(&path))
        .expect("trace")
        .remove(0);
    let mut junk = vec![0u64; kb * 1024 / 8];
    let mut round = 0u64;
    let mut thrash = |junk: &mut Vec<u64>| {
        round += 1;
        for w in junk.iter_mut().step_by(8) {
            *w = w.wrapping_add(round);
        }
        std::hint::black_box(&junk);
    };
    // alloc ns, allocs, free ns, frees over the counted passes.
    let mut t = [0u64; 4];
    for pass in 0..passes {
        let mut live: HashMap<u64, (*mut c_void, usize)> = HashMap::new();
        for e in &trace.events {
            match e.kind {
                EventKind::Alloc => {
                    thrash(&mut junk);
                    let t0 = Instant::now();
                    let p = malloc(e.size as usize);
                    let ns = t0.elapsed().as_nanos() as u64;
                    assert!(!p.is_null(), "allocation of {} failed", e.size);
                    live.insert(e.addr, (p, e.size as usize));
                    if pass > 0 {
                        t[0] += ns;
                        t[1] += 1;
                    }
                }
                EventKind::Free => {
                    let Some((p, size)) = live.remove(&e.addr) else {
                        continue;
                    };
                    thrash(&mut junk);
                    let t0 = Instant::now();
                    free(p, size);
                    let ns = t0.elapsed().as_nanos() as u64;
                    if pass > 0 {
                        t[2] += ns;
                        t[3] += 1;
                    }
                }
            }
        }
        for (_, (p, size)) in live {
            free(p, size);
        }
        if std::env::var_os("PAGE_STATS").is_some() {
            // The page layer's driver-call counters after each pass (cumulative).
            let mut buf = vec![0u8; 1 << 16];
            // SAFETY: `buf` is valid for `buf.len()` bytes of writes.
            let n = unsafe { genpool_stats_json(0, buf.as_mut_ptr().cast(), buf.len()) };
            let v: serde_json::Value =
                serde_json::from_slice(&buf[..n.min(buf.len() - 1)]).expect("stats JSON");
            let p = &v["pages"];
            println!(
                "pass {}: maps {} unmaps {} syncs {} stream_waits {} aliases {}",
                pass + 1,
                p["maps"],
                p["unmaps"],
                p["syncs"],
                p["stream_waits"],
                p["aliases"]
            );
        }
    }
    println!(
        "{}: thrash {kb} KiB  {} malloc {} ns ({} calls)  free {} ns ({} calls)",
        trace.name,
        if backend { "backend" } else { "hook" },
        t[0] / t[1].max(1),
        t[1],
        t[2] / t[3].max(1),
        t[3]
    );
}
