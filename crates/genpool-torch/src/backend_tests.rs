//! Tests of the backend's C functions on the simulated device. Device slots 20-29 are this file's (see
//! the table in `tests.rs` for the others); each test uses its own.

use std::ffi::{c_int, c_void};
use std::ptr::{null, null_mut};
use std::sync::Arc;

use gen_device::sim::{SimDevice, ORDINAL_STRIDE};
use genpool::Config;

use super::*;
use crate::abi::genpool_set_memory_fraction;
use crate::registry::testing;

const MIB: u64 = 1 << 20;

fn sim(index: usize, capacity: u64) -> c_int {
    let dev = Arc::new(
        SimDevice::config()
            .capacity(capacity)
            .ordinal(index)
            .address_offset(index as u64 * ORDINAL_STRIDE)
            .build()
            .unwrap(),
    );
    testing::install(index, dev, Config::default());
    index as c_int
}

fn stream(id: u64) -> cudaStream_t {
    std::ptr::without_provenance_mut(id as usize)
}

fn malloc(size: usize, device: c_int, pool: u64, s: u64) -> Result<*mut c_void, c_int> {
    let mut out = std::ptr::dangling_mut::<c_void>();
    // SAFETY: `out` is valid for one write.
    let rc = unsafe { genpool_backend_malloc(size, device, pool, stream(s), &mut out) };
    if rc == GENPOOL_OK {
        assert!(!out.is_null());
        Ok(out)
    } else {
        assert!(out.is_null(), "a failed allocation stores NULL");
        Err(rc)
    }
}

fn free(ptr: *mut c_void) -> Result<GenpoolFreed, c_int> {
    let mut f = GenpoolFreed::default();
    // SAFETY: `f` is valid for one write.
    match unsafe { genpool_backend_free(ptr, &mut f) } {
        GENPOOL_OK => Ok(f),
        rc => Err(rc),
    }
}

fn stats(device: c_int) -> GenpoolTorchStats {
    let mut s = GenpoolTorchStats::default();
    // SAFETY: `s` is valid for one write.
    assert_eq!(unsafe { genpool_backend_stats(device, &mut s) }, GENPOOL_OK);
    s
}

fn snapshot(device: c_int, pool: u64) -> (Vec<GenpoolSegment>, Vec<GenpoolBlock>) {
    let (mut ns, mut nb) = (0usize, 0usize);
    // SAFETY: NULL arrays with zero capacity; the counts are valid for writes.
    let rc = unsafe {
        genpool_backend_snapshot(device, pool, null_mut(), 0, null_mut(), 0, &mut ns, &mut nb)
    };
    if ns == 0 && nb == 0 {
        assert_eq!(rc, GENPOOL_OK);
        return (Vec::new(), Vec::new());
    }
    assert_eq!(rc, GENPOOL_E_INVALID, "no room: the counts come back");
    let mut segs = vec![GenpoolSegment::default(); ns];
    let mut blocks = vec![GenpoolBlock::default(); nb];
    // SAFETY: the arrays hold `ns` / `nb` elements.
    let rc = unsafe {
        genpool_backend_snapshot(
            device,
            pool,
            segs.as_mut_ptr(),
            ns,
            blocks.as_mut_ptr(),
            nb,
            &mut ns,
            &mut nb,
        )
    };
    assert_eq!(rc, GENPOOL_OK);
    (segs, blocks)
}

#[test]
fn statistics_follow_pytorchs_definitions() {
    let d = sim(20, 8 << 30);
    let small = malloc(1000, d, 0, 7).unwrap();
    let large = malloc((3 * MIB + 5) as usize, d, 0, 9).unwrap();
    let s = stats(d);
    assert_eq!(s.allocation[0].current, 2);
    assert_eq!((s.allocation[1].current, s.allocation[2].current), (1, 1));
    assert_eq!(s.allocated_bytes[0].current, 1024 + (3 * MIB + 512) as i64);
    assert_eq!(s.requested_bytes[0].current, 1000 + (3 * MIB + 5) as i64);
    assert_eq!(s.active_bytes[0], s.allocated_bytes[0]);
    assert!(s.reserved_bytes[0].current >= s.allocated_bytes[0].current);
    assert!(s.segment[0].current >= 2, "pages held: {:?}", s.segment[0]);
    assert_eq!(s.max_split_size, -1);

    // A free goes back on the block's own stream and says what it was.
    let f = free(large).unwrap();
    assert_eq!(
        (f.device, f.size, f.requested, f.stream, f.pool),
        (d, 3 * MIB + 512, 3 * MIB + 5, 9, 0)
    );
    let s = stats(d);
    assert_eq!(s.allocation[2].current, 0);
    assert_eq!(s.allocation[0].peak, 2);
    assert_eq!((s.allocation[0].allocated, s.allocation[0].freed), (2, 1));
    assert_eq!(s.allocated_bytes[0].peak, 1024 + (3 * MIB + 512) as i64);

    assert_eq!(genpool_backend_reset_peaks(d), GENPOOL_OK);
    let s = stats(d);
    assert_eq!(s.allocated_bytes[0].peak, 1024);
    assert_eq!(s.allocation[0].peak, 1);
    assert_eq!(genpool_backend_reset_accumulated(d), GENPOOL_OK);
    let s = stats(d);
    assert_eq!((s.allocation[0].allocated, s.allocation[0].freed), (0, 0));
    assert_eq!(s.allocation[0].current, 1);

    let (mut live, mut held) = (0u64, 0u64);
    // SAFETY: both are valid for one write.
    let rc = unsafe { genpool_backend_totals(d, &mut live, &mut held) };
    assert_eq!(rc, GENPOOL_OK);
    assert_eq!(live, 1024);
    assert!(held >= 2 * MIB);
    free(small).unwrap();
    assert_eq!(stats(d).allocated_bytes[0].current, 0);
}

#[test]
fn bad_frees_and_bad_arguments_are_refused_safely() {
    let d = sim(21, 1 << 30);
    let p = malloc(4096, d, 0, 0).unwrap();
    free(p).unwrap();
    assert_eq!(free(p), Err(GENPOOL_E_FREE), "double free");
    let foreign = std::ptr::without_provenance_mut::<c_void>(0xdead_0000);
    assert_eq!(free(foreign), Err(GENPOOL_E_FREE), "foreign pointer");
    assert_eq!(
        free(null_mut()),
        Ok(GenpoolFreed::default()),
        "NULL is a no-op"
    );
    assert_eq!(stats(d).allocation[0].current, 0, "nothing changed");
    assert_eq!(malloc(0, d, 0, 0), Err(GENPOOL_E_INVALID));
    assert_eq!(malloc(64, 9999, 0, 0), Err(GENPOOL_E_INVALID), "bad device");
    assert_eq!(
        malloc(64, d, 12345, 0),
        Err(GENPOOL_E_INVALID),
        "unknown pool"
    );
    assert_eq!(malloc(usize::MAX / 2, d, 0, 0), Err(GENPOOL_E_OOM));
    assert_eq!(
        malloc(2 << 30, d, 0, 0),
        Err(GENPOOL_E_OOM),
        "over the device"
    );
    // SAFETY: NULL out pointers are refused, not written.
    unsafe {
        assert_eq!(
            genpool_backend_malloc(64, d, 0, null_mut(), null_mut()),
            GENPOOL_E_INVALID
        );
        assert_eq!(genpool_backend_stats(d, null_mut()), GENPOOL_E_INVALID);
        assert_eq!(genpool_backend_block(null(), null_mut()), GENPOOL_E_FREE);
    }
    // The pool is still usable.
    let p = malloc(1 << 20, d, 0, 0).unwrap();
    free(p).unwrap();
}

#[test]
fn private_pools_keep_their_blocks_until_released() {
    let d = sim(22, 8 << 30);
    let id = genpool_pool_create(d);
    assert_ne!(id, 0);
    let a = malloc((8 * MIB) as usize, d, id, 3).unwrap();
    let b = malloc((8 * MIB) as usize, d, 0, 3).unwrap();
    let mut info = GenpoolBlock::default();
    // SAFETY: `info` is valid for one write.
    assert_eq!(unsafe { genpool_backend_block(a, &mut info) }, GENPOOL_OK);
    assert_eq!(
        (info.size, info.requested, info.stream),
        (8 * MIB, 8 * MIB, 3)
    );
    // The snapshot of the private pool holds its block and nothing of the default pool's.
    let (segs, blocks) = snapshot(d, id);
    let live: Vec<u64> = blocks
        .iter()
        .filter(|b| b.allocated == 1)
        .map(|b| b.address)
        .collect();
    assert_eq!(live, vec![a.addr() as u64]);
    assert!(segs.iter().all(|s| s.pool == id));
    // A freed block of the private pool serves the pool's next allocation, not the default pool's.
    let f = free(a).unwrap();
    assert_eq!(f.pool, id);
    let c = malloc((8 * MIB) as usize, d, 0, 3).unwrap();
    assert_ne!(
        c, a,
        "the default pool never gets the private pool's memory"
    );
    let a2 = malloc((8 * MIB) as usize, d, id, 3).unwrap();
    // Released with a live block: no new allocation, the block still frees fine, then the pool is gone.
    assert_eq!(genpool_pool_release(d, id), GENPOOL_OK);
    assert_eq!(malloc(512, d, id, 3), Err(GENPOOL_E_INVALID));
    assert_eq!(
        genpool_pool_release(d, id),
        GENPOOL_E_INVALID,
        "released twice"
    );
    assert_eq!(free(a2).unwrap().pool, id);
    assert!(
        crate::pools::all(d as usize).is_empty(),
        "dropped with its last block"
    );
    free(b).unwrap();
    free(c).unwrap();
    assert_eq!(stats(d).allocation[0].current, 0);
}

#[test]
fn snapshots_tile_page_runs_with_blocks_and_gaps() {
    let d = sim(23, 8 << 30);
    let sizes = [
        512usize,
        3000,
        (5 * MIB) as usize,
        700_000,
        (2 * MIB) as usize,
    ];
    let ptrs: Vec<_> = sizes.iter().map(|&s| malloc(s, d, 0, 1).unwrap()).collect();
    free(ptrs[3]).unwrap();
    let (segs, blocks) = snapshot(d, u64::MAX);
    let page = 2 * MIB;
    let mut live = 0;
    for s in &segs {
        assert_eq!(s.address % page, 0);
        assert_eq!(s.total_size % page, 0);
        let bs = &blocks[s.first_block as usize..(s.first_block + s.n_blocks) as usize];
        assert_eq!(
            bs.iter().map(|b| b.size).sum::<u64>(),
            s.total_size,
            "{s:?}"
        );
        let mut at = s.address;
        for b in bs {
            assert_eq!(b.address, at, "blocks and gaps tile the segment");
            at += b.size;
        }
        let alloc: u64 = bs.iter().filter(|b| b.allocated == 1).map(|b| b.size).sum();
        assert_eq!(alloc, s.allocated_size);
        live += bs.iter().filter(|b| b.allocated == 1).count();
    }
    assert_eq!(live, 4);
    for (i, p) in ptrs.iter().enumerate() {
        if i != 3 {
            free(*p).unwrap();
        }
    }
    assert!(snapshot(d, u64::MAX).0.is_empty());
}

#[test]
fn cache_info_is_what_can_be_had_within_the_cap() {
    let d = sim(24, 4 << 30);
    let all = genpool_backend_cache_info(d);
    assert!(all > 3 << 30 && all <= 4 << 30, "{all}");
    assert_eq!(all % (2 * MIB), 0);
    let p = malloc((512 * MIB) as usize, d, 0, 0).unwrap();
    let after = genpool_backend_cache_info(d);
    assert!(after <= all - 512 * MIB, "{after}");
    free(p).unwrap();
    genpool_set_memory_fraction(0.25, d);
    assert!(genpool_backend_cache_info(d) <= 1 << 30);
    assert_eq!(genpool_backend_memory_fraction(d), 0.25);
    assert_eq!(
        malloc((1100 * MIB) as usize, d, 0, 0),
        Err(GENPOOL_E_OOM),
        "over the cap"
    );
    genpool_set_memory_fraction(1.0, d);
    assert_eq!(genpool_backend_cache_info(9999), 0, "invalid device");
}

#[test]
fn tagged_allocations_through_the_backend_sleep_and_wake() {
    let d = sim(25, 8 << 30);
    let tag = c"backend-test-weights";
    // SAFETY: a NUL-terminated string.
    assert_eq!(unsafe { crate::genpool_tag_set(tag.as_ptr()) }, 0);
    let p = malloc((6 * MIB) as usize, d, 0, 0).unwrap();
    // SAFETY: a NULL tag returns the thread to the default tag.
    assert_eq!(unsafe { crate::genpool_tag_set(null()) }, 0);
    assert_eq!(stats(d).allocated_bytes[0].current, (6 * MIB) as i64);
    let awake = stats(d).reserved_bytes[0].current;
    assert!(
        awake >= (6 * MIB) as i64,
        "the tag's pages count as reserved: {awake}"
    );
    // SAFETY: a NUL-terminated list of tags.
    assert_eq!(unsafe { crate::genpool_sleep(tag.as_ptr(), 0) }, 0);
    let asleep = stats(d);
    assert!(
        asleep.reserved_bytes[0].current <= awake - (6 * MIB) as i64,
        "asleep, its pages are given back: {} of {awake}",
        asleep.reserved_bytes[0].current
    );
    assert_eq!(
        asleep.allocated_bytes[0].current,
        (6 * MIB) as i64,
        "allocated stays"
    );
    // SAFETY: as above.
    assert_eq!(unsafe { crate::genpool_tag_set(tag.as_ptr()) }, 0);
    assert_eq!(
        malloc(4096, d, 0, 0),
        Err(GENPOOL_E_ASLEEP),
        "a sleeping tag allocates nothing"
    );
    // SAFETY: as above.
    unsafe {
        assert_eq!(crate::genpool_tag_set(null()), 0);
        assert_eq!(crate::genpool_wake(tag.as_ptr(), 0), 0);
    }
    let f = free(p).unwrap();
    assert_eq!(
        (f.device, f.size),
        (d, 6 * MIB),
        "the tag's block frees through the backend"
    );
    assert_eq!(stats(d).allocated_bytes[0].current, 0);
}

#[test]
fn record_stream_orders_frees_of_private_pool_blocks() {
    use gen_device::sim::CallKind;
    use gen_device::Device;
    let dev = Arc::new(
        SimDevice::config()
            .ordinal(26)
            .address_offset(26 * ORDINAL_STRIDE)
            .build()
            .unwrap(),
    );
    testing::install(26, dev.clone(), Config::default());
    let (s1, s2) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
    let id = genpool_pool_create(26);
    let p = malloc(MIB as usize, 26, id, s1).unwrap();
    // A graph pool's block used on a side stream: the router finds its engine like any other block's.
    crate::genpool_record_stream(p, stream(s2));
    dev.pause_stream(s2).unwrap();
    let before = dev.calls();
    let f = free(p).unwrap();
    assert_eq!((f.pool, f.stream), (id, s1));
    let delta = dev.calls().since(&before);
    assert_eq!(
        (
            delta[CallKind::EventRecord],
            delta[CallKind::StreamWaitEvent]
        ),
        (1, 0),
        "held on an event recorded on s2; s1 made to wait for nothing"
    );
    dev.stream_synchronize(s1).unwrap();
    // Its pool released while the block is held: the engine goes when the block is given back.
    assert_eq!(genpool_pool_release(26, id), GENPOOL_OK);
    dev.resume_stream(s2).unwrap();
    crate::genpool_reset();
    assert!(
        !crate::registry::ROUTER
            .engines(26)
            .unwrap()
            .iter()
            .any(|e| e.id() == id),
        "dropped with its held block"
    );
}
