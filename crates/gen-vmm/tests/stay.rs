//! Pages that stay (captures, graph pools), sharing pages with another process, and peers, on the
//! simulated device. The capture tests fail without the capture-aware paths: the simulated driver
//! refuses the synchronize, event query or unmap a move would make and lists it.

use std::os::fd::AsFd;
use std::sync::Arc;

use gen_device::ipc::{this_process, ProcessFds};
use gen_device::sim::{CallKind, SimConfig, SimDevice};
use gen_device::Device;
use gen_vmm::{PagePool, PagePoolConfig, Region, VmmError};

const MIB: u64 = 1 << 20;
const PAGE: u64 = 2 * MIB;

fn pool_with(dev: &Arc<SimDevice>, cfg: PagePoolConfig) -> Arc<PagePool> {
    PagePool::new(dev.clone() as Arc<dyn Device>, cfg).unwrap()
}

/// Start a capture of `stream` as the driver sees it and as the engine is told.
fn begin(dev: &SimDevice, stream: u64) {
    dev.begin_capture(stream).unwrap();
    dev.captures().begin();
}

fn end(dev: &SimDevice) {
    assert!(dev.captures().end());
    dev.end_capture()
        .expect("the capture stayed valid: no forbidden call");
}

#[test]
fn a_capture_creates_pages_where_a_move_would_synchronize() {
    for keep_old_mappings in [false, true] {
        let dev = Arc::new(SimDevice::new());
        let pool = pool_with(
            &dev,
            PagePoolConfig {
                keep_old_mappings,
                ..PagePoolConfig::default()
            },
        );
        let a = Region::new(&pool, 64 * MIB, "a").unwrap();
        let b = Region::new(&pool, 64 * MIB, "b").unwrap();
        // Four pages freed with work possibly still queued (no fence stream: several streams), so a
        // move would synchronize the device first.
        a.commit(0, 8 * MIB, true).unwrap();
        a.decommit(0, 8 * MIB);
        let s = dev.stream_create().unwrap();
        begin(&dev, s);
        let before = dev.calls();
        b.commit(0, 8 * MIB, true).unwrap();
        let d = dev.calls().since(&before);
        assert_eq!(d.get(CallKind::Synchronize), 0);
        assert_eq!(d.get(CallKind::Unmap), 0);
        assert_eq!(d.get(CallKind::PhysCreate), 4, "new pages, none moved");
        // Nothing is given back while the capture runs (it would synchronize and unmap).
        assert_eq!(pool.release_unused().unwrap(), 0);
        // A grow-less commit sees that it would need new pages (the free ones elsewhere stay).
        assert!(matches!(
            b.commit(8 * MIB, PAGE, false),
            Err(VmmError::WouldGrow { .. })
        ));
        end(&dev);
        assert!(dev.capture_violations().is_empty());
        let st = pool.stats();
        assert_eq!((st.steals, st.pages_held), (0, 8));
        // After the capture: the four free pages go back to the driver.
        assert_eq!(pool.release_unused().unwrap(), 4 * PAGE);
        b.decommit(0, 8 * MIB);
    }
}

#[test]
fn moves_resume_after_the_capture() {
    let dev = Arc::new(SimDevice::new());
    let pool = pool_with(&dev, PagePoolConfig::default());
    let a = Region::new(&pool, 64 * MIB, "a").unwrap();
    let b = Region::new(&pool, 64 * MIB, "b").unwrap();
    a.commit(0, 4 * MIB, true).unwrap();
    a.decommit(0, 4 * MIB);
    let s = dev.stream_create().unwrap();
    begin(&dev, s);
    end(&dev);
    b.commit(0, 4 * MIB, true).unwrap();
    let st = pool.stats();
    assert_eq!(
        (st.steals, st.creates),
        (2, 2),
        "moved, as without a capture"
    );
}

#[test]
fn one_stream_records_no_fence_on_the_capturing_stream() {
    let dev = Arc::new(SimDevice::new());
    let pool = pool_with(
        &dev,
        PagePoolConfig {
            keep_old_mappings: true,
            ..PagePoolConfig::default()
        },
    );
    let s = dev.stream_create().unwrap();
    pool.set_fence_stream(Some(s));
    let a = Region::new(&pool, 64 * MIB, "a").unwrap();
    let b = Region::new(&pool, 64 * MIB, "b").unwrap();
    // A move a → b leaves an old mapping at a; during the capture a needs its page back while it is
    // free at b: taken back with no call, and the fence the move back wants waits for the capture's end.
    a.commit(0, 2 * MIB, true).unwrap();
    a.decommit(0, 2 * MIB);
    b.commit(0, 2 * MIB, true).unwrap();
    b.decommit(0, 2 * MIB);
    assert_eq!(pool.stats().steals, 1);
    begin(&dev, s);
    let before = dev.calls();
    a.commit(0, 2 * MIB, true).unwrap();
    let d = dev.calls().since(&before);
    assert_eq!(d.get(CallKind::EventRecord), 0, "no fence in the graph");
    assert_eq!(d.get(CallKind::EventQuery), 0);
    assert_eq!(d.get(CallKind::Unmap), 0);
    end(&dev);
    assert_eq!(pool.stats().returns, 1);
    // The next commit after the capture records the fence it owes.
    a.commit(4 * MIB, 2 * MIB, true).unwrap();
    assert!(dev.calls().since(&before).get(CallKind::EventRecord) >= 1);
}

#[test]
fn eager_unmapping_waits_for_the_end_of_a_capture() {
    let dev = Arc::new(SimDevice::new());
    let pool = pool_with(
        &dev,
        PagePoolConfig {
            eager_unmap: true,
            ..PagePoolConfig::default()
        },
    );
    let r = Region::new(&pool, 64 * MIB, "r").unwrap();
    r.commit(0, 4 * MIB, true).unwrap();
    let s = dev.stream_create().unwrap();
    begin(&dev, s);
    r.decommit(0, 4 * MIB);
    end(&dev);
    assert_eq!(pool.stats().pages_free_mapped, 2, "kept mapped meanwhile");
}

#[test]
fn a_pool_that_keeps_its_mappings_never_moves_a_page() {
    let dev = Arc::new(SimDevice::new());
    let pool = pool_with(&dev, PagePoolConfig::default());
    pool.set_keep_mappings(true);
    assert!(pool.pages_stay());
    let a = Region::new(&pool, 64 * MIB, "a").unwrap();
    let b = Region::new(&pool, 64 * MIB, "b").unwrap();
    a.commit(0, 8 * MIB, true).unwrap();
    a.decommit(0, 8 * MIB);
    b.commit(0, 8 * MIB, true).unwrap();
    let st = pool.stats();
    assert_eq!((st.steals, st.creates, st.unmaps), (0, 8, 0));
    // Giving back keeps every mapping (a graph may still use those addresses).
    assert_eq!(pool.release_unused().unwrap(), 0);
    assert_eq!(pool.stats().pages_free_mapped, 4);
    // Revived in place, as ever.
    a.commit(0, 8 * MIB, false).unwrap();
    // Released: pages move and go back again.
    a.decommit(0, 8 * MIB);
    pool.set_keep_mappings(false);
    assert_eq!(pool.release_unused().unwrap(), 4 * PAGE);
    b.decommit(0, 8 * MIB);
}

#[test]
fn exported_pages_import_as_the_same_bytes() {
    let dev = Arc::new(SimConfig::new().backed(true).build().unwrap());
    let pool = pool_with(&dev, PagePoolConfig::default());
    let r = Region::new(&pool, 64 * MIB, "r").unwrap();
    // A 3 MiB block at 1 MiB: pages 0-1.
    r.commit(MIB, 3 * MIB, true).unwrap();
    dev.write(r.base() + MIB, b"block bytes").unwrap();
    let (first, fds) = pool.export(r.base() + MIB, 3 * MIB).unwrap();
    assert_eq!((first, fds.len()), (r.base(), 2));
    // The receiver: its copies of the descriptors, imported and mapped back to back elsewhere.
    let sender = ProcessFds::open(this_process()).unwrap();
    let va = dev.va_reserve(2 * PAGE, 0).unwrap();
    let mut handles = Vec::new();
    for (i, &fd) in fds.iter().enumerate() {
        let mine = sender.take(fd).unwrap();
        let h = dev.import_handle(mine.as_fd(), PAGE).unwrap();
        dev.map(va + i as u64 * PAGE, PAGE, h).unwrap();
        handles.push(h);
    }
    let mut out = [0u8; 11];
    dev.read(va + MIB, &mut out).unwrap();
    assert_eq!(&out, b"block bytes");
    // A range not under live blocks, across regions, or empty: refused.
    for (ptr, len) in [(r.base() + 8 * MIB, MIB), (r.base(), 0), (1, 1)] {
        assert!(
            matches!(pool.export(ptr, len), Err(VmmError::NotShareable { .. })),
            "{ptr:#x} + {len:#x}"
        );
    }
    dev.unmap(va, 2 * PAGE).unwrap();
    for h in handles {
        dev.phys_release(h).unwrap();
    }
    dev.va_release(va, 2 * PAGE).unwrap();
    r.decommit(MIB, 3 * MIB);
}

#[test]
fn a_peer_gets_every_page_mapped_now_and_later() {
    let dev = Arc::new(SimConfig::new().ordinal(0).build().unwrap());
    let pool = pool_with(&dev, PagePoolConfig::default());
    let r = Region::new(&pool, 64 * MIB, "r").unwrap();
    r.commit(0, 4 * MIB, true).unwrap();
    r.commit(10 * MIB, 2 * MIB, true).unwrap();
    r.decommit(10 * MIB, 2 * MIB); // free but still mapped: opened too
    assert!(!dev.accessible_by(1, r.base(), 4 * MIB));
    assert_eq!(pool.grant_peer(1).unwrap(), 3);
    assert_eq!(pool.grant_peer(1).unwrap(), 0, "granted once");
    assert!(dev.accessible_by(1, r.base(), 4 * MIB));
    assert!(dev.accessible_by(1, r.base() + 10 * MIB, 2 * MIB));
    // Mapped after the grant: open at once.
    r.commit(20 * MIB, 4 * MIB, true).unwrap();
    assert!(dev.accessible_by(1, r.base() + 20 * MIB, 4 * MIB));
    assert!(
        !dev.accessible_by(2, r.base(), 4 * MIB),
        "only the peer asked for"
    );
    assert!(matches!(pool.grant_peer(0), Err(VmmError::Device(_))));
}

#[test]
fn a_commit_that_would_unmap_during_a_capture_fails_and_changes_nothing() {
    let dev = Arc::new(SimDevice::new());
    let pool = pool_with(
        &dev,
        PagePoolConfig {
            keep_old_mappings: true,
            ..PagePoolConfig::default()
        },
    );
    let s = dev.stream_create().unwrap();
    pool.set_fence_stream(Some(s));
    let a = Region::new(&pool, 64 * MIB, "a").unwrap();
    let b = Region::new(&pool, 64 * MIB, "b").unwrap();
    a.commit(0, 2 * MIB, true).unwrap();
    a.decommit(0, 2 * MIB);
    // b takes a's page and keeps it: a's address holds an old mapping of a page in use.
    b.commit(0, 2 * MIB, true).unwrap();
    let before = pool.stats();
    begin(&dev, s);
    assert_eq!(
        a.commit(0, 2 * MIB, true),
        Err(VmmError::Capturing("unmapping an old mapping"))
    );
    end(&dev);
    let after = pool.stats();
    assert_eq!(
        (after.pages_held, after.pages_in_use, after.zombies),
        (before.pages_held, before.pages_in_use, before.zombies)
    );
    // After the capture the same commit goes through (the old mapping is unmapped first).
    a.commit(0, 2 * MIB, true).unwrap();
}
