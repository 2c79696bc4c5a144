//! Tests of the C functions for CUDA graphs (captures, checkpoints), CUDA IPC and peers, on the
//! simulated device. Device slots 30-39 are this file's (see the table in `tests.rs`); each test uses
//! its own. The capture tests fail without the capture-aware engine: the simulated driver lists every
//! call a capture forbids.

use std::ffi::{c_int, c_void};
use std::ptr::null_mut;
use std::sync::Arc;

use gen_device::sim::{SimDevice, ORDINAL_STRIDE};
use gen_device::Device;
use genpool::Config;

use crate::backend_abi::*;
use crate::graphs::*;
use crate::ipc::*;
use crate::pools;
use crate::registry::testing;

const MIB: u64 = 1 << 20;
const PAGE: u64 = 2 * MIB;

fn sim(index: usize, capacity: u64, backed: bool) -> (Arc<SimDevice>, c_int) {
    let dev = Arc::new(
        SimDevice::config()
            .capacity(capacity)
            .ordinal(index)
            .backed(backed)
            .address_offset(index as u64 * ORDINAL_STRIDE)
            .build()
            .unwrap(),
    );
    testing::install(index, dev.clone(), Config::default());
    (dev, index as c_int)
}

fn stream(id: u64) -> crate::abi::cudaStream_t {
    std::ptr::without_provenance_mut(id as usize)
}

fn malloc(size: usize, device: c_int, pool: u64, s: u64) -> Result<u64, c_int> {
    let mut out = null_mut::<c_void>();
    // SAFETY: `out` is valid for one write.
    match unsafe { genpool_backend_malloc(size, device, pool, stream(s), &mut out) } {
        GENPOOL_OK => Ok(out.addr() as u64),
        rc => Err(rc),
    }
}

fn free(ptr: u64) -> c_int {
    // SAFETY: NULL `freed`: only the status comes back.
    unsafe { genpool_backend_free(std::ptr::without_provenance_mut(ptr as usize), null_mut()) }
}

fn live(device: c_int, pool: u64) -> Vec<GenpoolBlock> {
    let mut n = 0usize;
    // SAFETY: no array, zero capacity; `n` is valid for a write.
    let rc = unsafe { genpool_pool_live(device, pool, null_mut(), 0, &mut n) };
    if n == 0 {
        assert_eq!(rc, GENPOOL_OK);
        return Vec::new();
    }
    assert_eq!(rc, GENPOOL_E_INVALID, "no room: the count comes back");
    let mut v = vec![GenpoolBlock::default(); n];
    // SAFETY: `v` holds `n` blocks.
    let rc = unsafe { genpool_pool_live(device, pool, v.as_mut_ptr(), n, &mut n) };
    assert_eq!(rc, GENPOOL_OK);
    v
}

fn restore(device: c_int, pool: u64, ck: &[GenpoolBlock], cap: usize) -> (c_int, Vec<u64>) {
    let mut freed = vec![0u64; cap];
    let mut n = 0usize;
    // SAFETY: `ck` and `freed` hold the counts passed; `n` is valid for a write.
    let rc = unsafe {
        genpool_pool_restore(
            device,
            pool,
            ck.as_ptr(),
            ck.len(),
            freed.as_mut_ptr(),
            cap,
            &mut n,
        )
    };
    freed.truncate(n.min(cap));
    (rc, freed)
}

/// A capture into a private pool while the engine has pages to move and too little memory: every call
/// the capture forbids is avoided, the request that cannot be served is a clean out-of-memory, and a
/// pool released during the capture is dropped after it.
#[test]
fn a_capture_through_the_backend_stays_valid() {
    let (dev, d) = sim(30, 1 << 30, false);
    let (s, t) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
    // The default pool on two streams, pages freed all over.
    let warm: Vec<(u64, u64)> = (0..16u64)
        .map(|i| {
            let st = if i % 2 == 0 { s } else { t };
            (malloc(((3 + i % 4) * MIB) as usize, d, 0, st).unwrap(), st)
        })
        .collect();
    for &(p, _) in &warm {
        assert_eq!(free(p), GENPOOL_OK);
    }
    let graph = genpool_pool_create(d);
    let other = genpool_pool_create(d);
    let leftover = malloc(MIB as usize, d, other, s).unwrap();
    dev.begin_capture(s).unwrap();
    assert_eq!(genpool_capture_begin(d), GENPOOL_OK);
    let inside: Vec<u64> = (0..8)
        .map(|i| malloc(((5 + i) * MIB) as usize, d, graph, s).unwrap())
        .collect();
    for p in inside.iter().step_by(2) {
        assert_eq!(free(*p), GENPOOL_OK);
    }
    // Another thread's allocation on the default pool meanwhile, on a stream it never saw.
    let u = dev.stream_create().unwrap();
    let side = malloc((7 * MIB) as usize, d, 0, u).unwrap();
    dev.set_capacity(dev.reserved().current);
    assert_eq!(
        malloc((256 * MIB) as usize, d, graph, s),
        Err(GENPOOL_E_OOM)
    );
    assert_eq!(
        genpool_pool_trim(d, 0),
        0,
        "nothing given back during the capture"
    );
    // A pool released during the capture with its last block then freed: kept until the capture ends.
    assert_eq!(genpool_pool_release(d, other), GENPOOL_OK);
    assert_eq!(free(leftover), GENPOOL_OK);
    assert!(pools::all(30).iter().any(|p| p.id() == other));
    // PyTorch ends the capture (cudaStreamEndCapture), then tells the allocator (endAllocateToPool).
    dev.end_capture().expect("the capture stayed valid");
    assert!(pools::all(30).iter().any(|p| p.id() == other));
    assert_eq!(genpool_capture_end(d), GENPOOL_OK);
    assert!(dev.capture_violations().is_empty());
    assert!(
        !pools::all(30).iter().any(|p| p.id() == other),
        "dropped after"
    );
    assert_eq!(
        genpool_capture_end(d),
        GENPOOL_E_INVALID,
        "no capture underway"
    );
    dev.set_capacity(1 << 30);
    assert_eq!(free(side), GENPOOL_OK);
    for p in inside.iter().skip(1).step_by(2) {
        assert_eq!(free(*p), GENPOOL_OK);
    }
    assert_eq!(genpool_pool_release(d, graph), GENPOOL_OK);
}

/// Graph trees' checkpoint through the C functions: the pool's live blocks are listed, the pool goes on,
/// and the restore frees what is live now and places the checkpoint's blocks again at their addresses,
/// statistics following.
#[test]
fn a_private_pool_goes_back_to_its_checkpoint() {
    let (dev, d) = sim(31, 4 << 30, false);
    let s = dev.stream_create().unwrap();
    let pool = genpool_pool_create(d);
    let a = malloc(1000, d, pool, s).unwrap();
    let b = malloc((3 * MIB) as usize, d, pool, s).unwrap();
    let c = malloc((9 * MIB) as usize, d, pool, s).unwrap();
    let ck = live(d, pool);
    assert_eq!(
        ck.iter().map(|x| x.address).collect::<Vec<_>>(),
        vec![a, b, c]
    );
    assert_eq!(ck[0].requested, 1000);
    assert_eq!(ck[0].stream, s);
    // The pool goes on: b dies, something else takes its place and more.
    assert_eq!(free(b), GENPOOL_OK);
    let e = malloc((2 * MIB) as usize, d, pool, s).unwrap();
    assert_eq!(e, b, "in b's place");
    let allocated_before = live(d, pool).len();
    assert_eq!(allocated_before, 3);
    // No room for the freed list: refused, nothing changed.
    let (rc, _) = restore(d, pool, &ck, 1);
    assert_eq!(rc, GENPOOL_E_INVALID);
    assert_eq!(live(d, pool).len(), 3);
    let (rc, freed) = restore(d, pool, &ck, 8);
    assert_eq!(rc, GENPOOL_OK);
    let mut freed_sorted = freed.clone();
    freed_sorted.sort_unstable();
    let mut want = vec![a, c, e];
    want.sort_unstable();
    assert_eq!(
        freed_sorted, want,
        "every block that was live is reported freed"
    );
    let now = live(d, pool);
    assert_eq!(now, ck, "the checkpoint's blocks, requests and streams");
    let mut st = GenpoolTorchStats::default();
    // SAFETY: `st` is valid for a write.
    assert_eq!(unsafe { genpool_backend_stats(d, &mut st) }, GENPOOL_OK);
    assert_eq!(st.allocation[0].current, 3);
    // The default pool has no checkpoints.
    let (rc, _) = restore(d, 0, &ck, 8);
    assert_eq!(rc, GENPOOL_E_INVALID);
    for p in [a, b, c] {
        assert_eq!(free(p), GENPOOL_OK);
    }
    assert_eq!(genpool_pool_release(d, pool), GENPOOL_OK);
}

/// CUDA IPC on one simulated device: the pages under a block are exported, "another process" (this one)
/// takes the descriptors through a pidfd, maps them, reads the block's bytes, and closes them.
#[test]
fn a_block_is_shared_and_opened_through_its_page_descriptors() {
    let (dev, d) = sim(32, 4 << 30, true);
    let p = malloc((5 * MIB) as usize, d, 0, 0).unwrap();
    let _neighbour = malloc((3 * MIB) as usize, d, 0, 0).unwrap();
    dev.write(p + 4 * MIB, b"sent across").unwrap();
    let (mut n, mut first, mut page, mut size) = (0usize, 0u64, 0u64, 0u64);
    let ptr = std::ptr::without_provenance::<c_void>(p as usize);
    // SAFETY: no array, zero capacity; the outs are valid for writes.
    let rc =
        unsafe { genpool_ipc_export(ptr, null_mut(), 0, &mut n, &mut first, &mut page, &mut size) };
    assert_eq!(rc, GENPOOL_E_INVALID, "no room: the count comes back");
    assert_eq!((page, size), (PAGE, 5 * MIB));
    assert!(first <= p && p < first + page);
    let mut fds = vec![-1; n];
    // SAFETY: `fds` holds `n` descriptors.
    let rc = unsafe {
        genpool_ipc_export(
            ptr,
            fds.as_mut_ptr(),
            n,
            &mut n,
            &mut first,
            &mut page,
            &mut size,
        )
    };
    assert_eq!(rc, GENPOOL_OK);
    assert_eq!(n as u64, (p + size).div_ceil(PAGE) - first / PAGE);
    let mut base = 0u64;
    // SAFETY: `fds` holds `n` descriptors, `base` is valid for a write.
    let rc = unsafe {
        genpool_ipc_open(
            d,
            gen_device::ipc::this_process(),
            page,
            fds.as_ptr(),
            n,
            &mut base,
        )
    };
    assert_eq!(rc, GENPOOL_OK);
    assert_eq!(genpool_ipc_open_count(), 1);
    let mut out = [0u8; 11];
    dev.read(base + (p - first) + 4 * MIB, &mut out).unwrap();
    assert_eq!(&out, b"sent across");
    assert_eq!(genpool_ipc_close(base), GENPOOL_OK);
    assert_eq!(genpool_ipc_open_count(), 0);
    assert_eq!(genpool_ipc_close(base), GENPOOL_E_FREE, "closed once");
    // Not a block of genpool's; a dead sender; a descriptor it does not hold.
    let bogus = std::ptr::without_provenance::<c_void>((p + 512) as usize);
    // SAFETY: as above.
    let rc = unsafe {
        genpool_ipc_export(
            bogus,
            fds.as_mut_ptr(),
            n,
            &mut n,
            &mut first,
            &mut page,
            &mut size,
        )
    };
    assert_eq!(rc, GENPOOL_E_INVALID);
    // SAFETY: `fds` holds `n` descriptors, `base` is valid for a write.
    let rc = unsafe { genpool_ipc_open(d, 1 << 23, page, fds.as_ptr(), n, &mut base) };
    assert_eq!(rc, GENPOOL_E_INTERNAL);
    let bad = [1 << 20];
    // SAFETY: one descriptor; `base` is valid for a write.
    let rc = unsafe {
        genpool_ipc_open(
            d,
            gen_device::ipc::this_process(),
            page,
            bad.as_ptr(),
            1,
            &mut base,
        )
    };
    assert_eq!(rc, GENPOOL_E_INTERNAL);
    assert_eq!(
        genpool_ipc_open_count(),
        0,
        "nothing left mapped by the failures"
    );
    assert_eq!(free(p), GENPOOL_OK);
}

/// `enablePeerAccess`: every page of every engine of the device (default and private pools) opens to the
/// peer, and pages mapped later too.
#[test]
fn a_peer_gets_every_engines_pages() {
    let (dev, d) = sim(33, 4 << 30, false);
    let pool = genpool_pool_create(d);
    let a = malloc((6 * MIB) as usize, d, 0, 0).unwrap();
    let b = malloc((3 * MIB) as usize, d, pool, 0).unwrap();
    assert!(!dev.accessible_by(34, a, 6 * MIB));
    assert_eq!(genpool_enable_peer_access(d, 34), GENPOOL_OK);
    assert!(dev.accessible_by(34, a, 6 * MIB));
    assert!(dev.accessible_by(34, b, 3 * MIB));
    assert_eq!(genpool_enable_peer_access(d, 34), GENPOOL_OK, "idempotent");
    let c = malloc((40 * MIB) as usize, d, 0, 0).unwrap();
    assert!(dev.accessible_by(34, c, 40 * MIB), "mapped after: open too");
    assert!(!dev.accessible_by(35, a, 6 * MIB));
    assert_eq!(
        genpool_enable_peer_access(d, 33),
        GENPOOL_E_INTERNAL,
        "not its own peer"
    );
    assert_eq!(genpool_enable_peer_access(d, -1), GENPOOL_E_INVALID);
    for p in [a, b, c] {
        assert_eq!(free(p), GENPOOL_OK);
    }
    assert_eq!(genpool_pool_release(d, pool), GENPOOL_OK);
}
