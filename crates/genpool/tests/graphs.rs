//! The engine and CUDA graphs on the simulated device (issue 19): captures (no call a capture forbids,
//! whatever the workload asks: page moves, out-of-memory release, a second stream), pools that keep
//! their mappings, and blocks placed again at their addresses ([`Pool::alloc_at`], graph trees'
//! checkpoints). The simulated driver lists every forbidden call, so the capture tests fail without the
//! capture-aware paths.

use std::sync::Arc;

use gen_device::sim::SimDevice;
use gen_device::{Device, StreamId};
use genpool::config::Routing;
use genpool::{Config, GenpoolError, Hint, Pool};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn sim(capacity: u64, backed: bool) -> Arc<SimDevice> {
    Arc::new(
        SimDevice::config()
            .capacity(capacity)
            .backed(backed)
            .build()
            .unwrap(),
    )
}

fn pool_on(dev: &Arc<SimDevice>, cfg: Config) -> Pool {
    Pool::new(dev.clone() as Arc<dyn Device>, cfg).unwrap()
}

/// A private pool's configuration, as genpool-torch makes it.
fn private() -> Config {
    Config {
        routing: Routing::Extent,
        plan: false,
        ..Config::default()
    }
}

fn begin(dev: &SimDevice, s: StreamId) {
    dev.begin_capture(s).unwrap();
    dev.captures().begin();
}

fn end(dev: &SimDevice) {
    assert!(dev.captures().end());
    dev.end_capture()
        .expect("the capture stayed valid: the engine made no forbidden call");
    assert!(dev.capture_violations().is_empty());
}

/// Everything the engine does on its own initiative during a capture: moving warm pages (several
/// streams: each move would synchronize), the out-of-memory ladder (drains, reclaim, release: each
/// synchronizes), a stream seen for the first time. The capture ends valid.
#[test]
fn a_capture_sees_no_forbidden_call_whatever_the_engine_needs() {
    let dev = sim(GIB, false);
    let pool = pool_on(&dev, Config::default());
    let (s, t) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
    // Warm-up on two streams: free pages all over, several streams seen (moves need a synchronize).
    let mut warm = Vec::new();
    for i in 0..40u64 {
        let st = if i % 2 == 0 { s } else { t };
        warm.push((pool.alloc((3 + i % 5) * MIB, st, Hint::NONE).unwrap(), st));
    }
    for (b, st) in warm.drain(..) {
        pool.free(b.ptr, st).unwrap();
    }
    let u = dev.stream_create().unwrap();
    begin(&dev, s);
    // Sizes laid out elsewhere than the warm-up's: pages are needed at new addresses.
    let mut live = Vec::new();
    for i in 0..20u64 {
        live.push(pool.alloc((7 + i % 3) * MIB + 512, s, Hint::NONE).unwrap());
    }
    for b in live.iter().step_by(2) {
        pool.free(b.ptr, s).unwrap();
    }
    // A stream first seen during the capture.
    let side = pool.alloc(5 * MIB, u, Hint::NONE).unwrap();
    // Out of memory: the ladder would drain, reclaim and release (each synchronizes): refused instead.
    dev.set_capacity(dev.reserved().current);
    match pool.alloc(512 * MIB, s, Hint::NONE) {
        Err(e) => assert!(e.is_oom(), "{e}"),
        Ok(_) => panic!("no memory left"),
    }
    assert_eq!(pool.trim(), 0, "nothing given back during the capture");
    end(&dev);
    // After the capture the ladder works again: the same request is served by giving back the free pages.
    dev.set_capacity(GIB);
    pool.free(side.ptr, u).unwrap();
    for b in live.iter().skip(1).step_by(2) {
        pool.free(b.ptr, s).unwrap();
    }
    assert!(pool.trim() > 0);
}

#[test]
fn a_pool_that_keeps_its_mappings_revives_in_place_and_never_moves() {
    let dev = sim(GIB, true);
    let pool = pool_on(&dev, private());
    pool.page_pool().set_keep_mappings(true);
    let s = dev.stream_create().unwrap();
    let a = pool.alloc(6 * MIB, s, Hint::NONE).unwrap();
    dev.write(a.ptr, b"graph-internal").unwrap();
    pool.free(a.ptr, s).unwrap();
    // A later allocation elsewhere in the pool gets new pages; `a`'s address keeps its page (a graph
    // replaying still writes there).
    let keep = pool.alloc(6 * MIB, s, Hint::NONE).unwrap();
    let b = pool.alloc(20 * MIB, s, Hint::NONE).unwrap();
    pool.free(keep.ptr, s).unwrap();
    assert_eq!(pool.trim(), 0, "the pool's mappings stay");
    let st = pool.page_pool().stats();
    assert_eq!((st.steals, st.unmaps), (0, 0));
    let mut out = [0u8; 14];
    dev.read(a.ptr, &mut out).unwrap();
    assert_eq!(&out, b"graph-internal", "still mapped, bytes intact");
    pool.free(b.ptr, s).unwrap();
}

/// Graph trees' checkpoint: the live set of a private pool is recorded, the pool goes on (blocks freed,
/// others allocated over the same addresses), then it is put back: everything live now is freed and the
/// checkpoint's blocks are placed again at their addresses, with their bytes (the pages never left).
#[test]
fn a_checkpoint_restores_blocks_at_their_addresses() {
    let dev = sim(GIB, true);
    let pool = pool_on(&dev, private());
    pool.page_pool().set_keep_mappings(true);
    let s = dev.stream_create().unwrap();
    let sizes = [512u64, 4096, 3 * MIB, 700, 12 * MIB + 512];
    let blocks: Vec<_> = sizes
        .iter()
        .map(|&n| pool.alloc(n, s, Hint::NONE).unwrap())
        .collect();
    for (i, b) in blocks.iter().enumerate() {
        assert_eq!(
            b.tier,
            genpool::Tier::Extent,
            "every block in the extent tier"
        );
        dev.write(b.ptr, &[i as u8 + 1; 64]).unwrap();
    }
    // The checkpoint: blocks 1, 2 and 4 live.
    pool.free(blocks[0].ptr, s).unwrap();
    pool.free(blocks[3].ptr, s).unwrap();
    let checkpoint: Vec<_> = pool.live_detailed();
    assert_eq!(checkpoint.len(), 3);
    // The pool goes on: every block freed, new ones over the same addresses.
    for b in [&blocks[1], &blocks[2], &blocks[4]] {
        pool.free(b.ptr, s).unwrap();
    }
    let others: Vec<_> = (0..3)
        .map(|_| pool.alloc(5 * MIB, s, Hint::NONE).unwrap())
        .collect();
    assert!(
        others.iter().any(|o| checkpoint
            .iter()
            .any(|c| o.ptr < c.ptr + c.size && c.ptr < o.ptr + o.size)),
        "the new blocks overlap the checkpoint's addresses"
    );
    // While they are live the checkpoint's places are taken.
    let c0 = checkpoint[0];
    assert!(matches!(
        pool.alloc_at(c0.ptr, c0.requested, c0.stream),
        Err(GenpoolError::Unplaceable { .. })
    ));
    // Restore: free what is live, place the checkpoint's blocks.
    for o in &others {
        pool.free(o.ptr, s).unwrap();
    }
    for c in &checkpoint {
        let b = pool.alloc_at(c.ptr, c.requested, c.stream).unwrap();
        assert_eq!((b.ptr, b.size), (c.ptr, c.size));
    }
    assert_eq!(
        pool.live_detailed(),
        checkpoint,
        "the same blocks, requests and streams"
    );
    // Nothing wrote over them meanwhile and their pages never left: the bytes are the checkpoint's.
    for (i, b) in blocks
        .iter()
        .enumerate()
        .filter(|(i, _)| [1, 2, 4].contains(i))
    {
        let mut out = [0u8; 64];
        dev.read(b.ptr, &mut out).unwrap();
        assert_eq!(out, [i as u8 + 1; 64], "block {i}");
    }
    // Placed twice, or over a live block: refused, nothing changed.
    assert!(matches!(
        pool.alloc_at(c0.ptr, c0.requested, s),
        Err(GenpoolError::Unplaceable { .. })
    ));
    assert!(matches!(
        pool.alloc_at(c0.ptr + 512, 512, s),
        Err(GenpoolError::Unplaceable { .. })
    ));
    assert!(matches!(
        pool.alloc_at(0x1000, 512, s),
        Err(GenpoolError::Unplaceable { .. })
    ));
    assert!(matches!(
        pool.alloc_at(c0.ptr, 0, s),
        Err(GenpoolError::InvalidSize { .. })
    ));
    assert_eq!(pool.live_blocks(), 3);
    for c in &checkpoint {
        pool.free(c.ptr, s).unwrap();
    }
    assert_eq!(pool.allocated(), 0);
}

#[test]
fn only_a_private_pool_places_blocks() {
    let dev = sim(GIB, false);
    let pool = pool_on(&dev, Config::default());
    let b = pool.alloc(4 * MIB, 0, Hint::NONE).unwrap();
    pool.free(b.ptr, 0).unwrap();
    assert!(matches!(
        pool.alloc_at(b.ptr, 4 * MIB, 0),
        Err(GenpoolError::Unplaceable { .. })
    ));
}

#[test]
fn a_block_placed_during_a_capture_takes_a_new_page_rather_than_a_move() {
    let dev = sim(GIB, false);
    let pool = pool_on(&dev, private());
    let (s, t) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
    let a = pool.alloc(8 * MIB, s, Hint::NONE).unwrap();
    let x = pool.alloc(8 * MIB, t, Hint::NONE).unwrap();
    pool.free(x.ptr, t).unwrap();
    pool.free(a.ptr, s).unwrap();
    let far = pool.alloc(64 * MIB, s, Hint::NONE).unwrap();
    pool.free(far.ptr, s).unwrap();
    begin(&dev, s);
    let b = pool.alloc_at(far.ptr + 32 * MIB, 8 * MIB, s).unwrap();
    end(&dev);
    pool.free(b.ptr, s).unwrap();
}

/// Peers on two simulated devices with disjoint address ranges (`genpool::Pools`): device 1 is given
/// access to device 0's pages, those mapped now and those mapped later; device 1's own pages stay its own.
#[test]
fn a_peer_device_gets_access_to_every_page_mapped_now_and_later() {
    use std::sync::Mutex;
    let made: Arc<Mutex<Vec<Arc<SimDevice>>>> = Arc::new(Mutex::new(Vec::new()));
    let m = made.clone();
    let pools = genpool::Pools::new(2, Config::default(), move |i| {
        let d = Arc::new(
            SimDevice::config()
                .ordinal(i)
                .capacity(GIB)
                .address_offset(i as u64 * gen_device::sim::ORDINAL_STRIDE)
                .build()?,
        );
        m.lock().unwrap().push(d.clone());
        Ok(d as Arc<dyn Device>)
    });
    let a = pools.alloc(0, 6 * MIB, 0, Hint::NONE).unwrap();
    let b = pools.alloc(1, 6 * MIB, 0, Hint::NONE).unwrap();
    let devs = made.lock().unwrap().clone();
    let (d0, d1) = (&devs[0], &devs[1]);
    assert!(!d0.accessible_by(1, a.ptr, a.size));
    assert!(pools.pool(0).unwrap().page_pool().grant_peer(1).unwrap() >= 3);
    assert!(d0.accessible_by(1, a.ptr, a.size));
    let c = pools.alloc(0, 40 * MIB, 0, Hint::NONE).unwrap();
    assert!(d0.accessible_by(1, c.ptr, c.size), "mapped after the grant");
    assert!(
        !d1.accessible_by(0, b.ptr, b.size),
        "device 1's pages are not opened to 0"
    );
    for blk in [a, b, c] {
        pools.free(blk.ptr, 0).unwrap();
    }
}

/// A block handed to another stream and freed there during a capture (the ordering its arena's stream
/// would need — an event on the capturing stream — is what a capture forbids): the free succeeds, the
/// block waits out of its arena (counted in `cached_bytes`), and the first call after the capture gives
/// it back with the ordering made then. The capture stays valid; nothing is lost.
#[test]
fn a_foreign_free_during_a_capture_waits_for_its_end() {
    let dev = sim(GIB, false);
    let pool = pool_on(&dev, Config::default());
    let (s, t) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
    for st in [s, t] {
        let b = pool.alloc(512, st, Hint::NONE).unwrap();
        pool.free(b.ptr, st).unwrap();
    }
    let a = pool.alloc(8 * MIB, s, Hint::NONE).unwrap();
    begin(&dev, t);
    pool.free(a.ptr, t).unwrap();
    assert_eq!(pool.allocated(), 0, "freed for the caller");
    assert_eq!(
        pool.stats().cached_bytes,
        a.size,
        "held until the capture ends"
    );
    end(&dev);
    // t's work is still running (a stream found idle would need no ordering at all).
    dev.pause_stream(t).unwrap();
    let waits = dev.call_counts().stream_waits;
    // The next call after the capture gives it back (ordering s after t then).
    let b = pool.alloc(512, t, Hint::NONE).unwrap();
    pool.free(b.ptr, t).unwrap();
    assert_eq!(pool.stats().cached_bytes, 0);
    assert!(dev.call_counts().stream_waits > waits, "s ordered after t");
    dev.resume_stream(t).unwrap();
    let again = pool.alloc(8 * MIB, s, Hint::NONE).unwrap();
    assert_eq!(again.ptr, a.ptr, "back in s's arena");
    pool.free(again.ptr, s).unwrap();
    dev.synchronize().unwrap();
    pool.trim();
    assert_eq!(pool.reserved_now(), 0);
}
