//! gen-vmm sleep / wake on the simulated device: every page released with the addresses kept, contents
//! restored from pinned host memory, cached pages and old mappings released, misuse refused.

use std::sync::Arc;

use gen_device::sim::{CallKind, SimDevice};
use gen_device::{Device, DeviceError};
use gen_vmm::{PagePool, PagePoolConfig, Region, VmmError};

const MIB: u64 = 1 << 20;
const PAGE: u64 = 2 * MIB;

fn backed() -> Arc<SimDevice> {
    Arc::new(SimDevice::config().backed(true).build().unwrap())
}

fn pool_with(dev: &Arc<SimDevice>, cfg: PagePoolConfig) -> Arc<PagePool> {
    PagePool::new(dev.clone() as Arc<dyn Device>, cfg).unwrap()
}

fn pattern(len: u64, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 13) as u8)
        .collect()
}

fn read(dev: &SimDevice, at: u64, len: u64) -> Vec<u8> {
    let mut out = vec![0u8; len as usize];
    dev.read(at, &mut out).unwrap();
    out
}

#[test]
fn sleep_with_offload_releases_every_page_and_wake_restores_the_bytes_in_place() {
    let dev = backed();
    let pool = pool_with(&dev, PagePoolConfig::default());
    let r = Region::new(&pool, 64 * MIB, "t").unwrap();
    // Two live blocks (5 pages, one shared), one freed block whose pages stay cached (free-mapped).
    r.commit(0, 3 * MIB, true).unwrap();
    r.commit(3 * MIB, 5 * MIB, true).unwrap();
    r.commit(20 * MIB, 4 * MIB, true).unwrap();
    r.decommit(20 * MIB, 4 * MIB);
    let a = pattern(3 * MIB, 1);
    let b = pattern(5 * MIB, 2);
    dev.write(r.base(), &a).unwrap();
    dev.write(r.base() + 3 * MIB, &b).unwrap();
    let s = pool.stats();
    assert_eq!(
        (s.pages_held, s.pages_in_use, s.pages_free_mapped),
        (6, 4, 2)
    );

    let slept = pool.sleep(true).unwrap();
    assert_eq!(slept.pages_asleep, 4);
    assert_eq!(slept.pages_offloaded, 4);
    assert_eq!(
        slept.pages_released, 6,
        "the live pages and the cached ones"
    );
    assert!(pool.is_asleep());
    let s = pool.stats();
    assert!(s.asleep);
    assert_eq!((s.pages_held, s.pages_asleep, s.pages_offloaded), (0, 4, 4));
    assert_eq!(s.pages_in_use, 4, "references are kept");
    assert_eq!(s.host_bytes, 4 * PAGE);
    assert_eq!(dev.reserved().current, 0, "every physical byte went back");
    assert_eq!(dev.outstanding().mappings, 0);
    assert_eq!(dev.outstanding().phys_handles, 0);
    assert_eq!(
        dev.outstanding().va_reservations,
        1,
        "the address space stays"
    );
    // The memory is not accessible while asleep (a kernel on it would fault).
    assert!(dev.read(r.base(), &mut [0u8; 16]).is_err());
    assert_eq!(r.page_refs(0), 1);

    // Another user takes the memory meanwhile and gives it back.
    let other = dev.phys_create(8 * PAGE).unwrap();
    dev.phys_release(other).unwrap();

    let woken = pool.wake().unwrap();
    assert_eq!((woken.pages_mapped, woken.pages_restored), (4, 4));
    assert!(!pool.is_asleep());
    let s = pool.stats();
    assert!(!s.asleep);
    assert_eq!((s.pages_held, s.pages_in_use, s.pages_asleep), (4, 4, 0));
    assert_eq!(
        s.host_bytes,
        4 * PAGE,
        "the pinned buffer is kept for the next sleep"
    );
    assert_eq!(read(&dev, r.base(), 3 * MIB), a, "same address, same bytes");
    assert_eq!(read(&dev, r.base() + 3 * MIB, 5 * MIB), b);
    // Business as usual: free, commit, and a second cycle reuses the pinned buffer.
    r.decommit(0, 3 * MIB);
    let c = pattern(2 * MIB, 9);
    r.commit(40 * MIB, 2 * MIB, true).unwrap();
    dev.write(r.base() + 40 * MIB, &c).unwrap();
    let before = dev.calls();
    pool.sleep(true).unwrap();
    pool.wake().unwrap();
    assert_eq!(dev.calls().since(&before).get(CallKind::HostAlloc), 0);
    assert_eq!(read(&dev, r.base() + 3 * MIB, 5 * MIB), b);
    assert_eq!(read(&dev, r.base() + 40 * MIB, 2 * MIB), c);
    assert_eq!(pool.release_host().unwrap(), 4 * PAGE);
    assert_eq!(dev.outstanding().host_buffers, 0);
    r.decommit(3 * MIB, 5 * MIB);
    r.decommit(40 * MIB, 2 * MIB);
    drop(r);
    pool.release_unused().unwrap();
    assert_eq!(dev.outstanding().phys_handles, 0);
}

#[test]
fn sleep_without_offload_keeps_no_host_copy_and_wake_maps_fresh_pages() {
    let dev = backed();
    let pool = pool_with(&dev, PagePoolConfig::default());
    let r = Region::new(&pool, 64 * MIB, "t").unwrap();
    r.commit(0, 4 * MIB, true).unwrap();
    dev.write(r.base(), &pattern(4 * MIB, 3)).unwrap();
    let before = dev.calls();
    let slept = pool.sleep(false).unwrap();
    assert_eq!((slept.pages_asleep, slept.pages_offloaded), (2, 0));
    let d = dev.calls().since(&before);
    assert_eq!(
        (d.get(CallKind::HostAlloc), d.get(CallKind::CopyToHost)),
        (0, 0)
    );
    assert_eq!(pool.stats().host_bytes, 0);
    let w = pool.wake().unwrap();
    assert_eq!((w.pages_mapped, w.pages_restored), (2, 0));
    // Fresh pages: the simulator's read as zero (CUDA's are undefined).
    assert_eq!(read(&dev, r.base(), 4 * MIB), vec![0u8; 4 * MIB as usize]);
    r.decommit(0, 4 * MIB);
}

#[test]
fn misuse_is_refused_with_typed_errors() {
    let dev = backed();
    let pool = pool_with(&dev, PagePoolConfig::default());
    let r = Region::new(&pool, 64 * MIB, "t").unwrap();
    assert_eq!(pool.wake(), Err(VmmError::NotAsleep), "wake without sleep");
    r.commit(0, 2 * MIB, true).unwrap();
    pool.sleep(false).unwrap();
    assert_eq!(
        pool.sleep(true),
        Err(VmmError::AlreadyAsleep),
        "double sleep"
    );
    // A commit while asleep — new pages, or revival of the asleep page itself — is refused, unchanged.
    assert_eq!(r.commit(10 * MIB, 2 * MIB, true), Err(VmmError::Asleep));
    assert_eq!(r.commit(0, 2 * MIB, true), Err(VmmError::Asleep));
    assert_eq!(r.page_refs(0), 1);
    assert_eq!(pool.stats().pages_held, 0);
    pool.wake().unwrap();
    assert_eq!(pool.wake(), Err(VmmError::NotAsleep), "double wake");
    r.commit(10 * MIB, 2 * MIB, true).unwrap();
    r.decommit(10 * MIB, 2 * MIB);
    r.decommit(0, 2 * MIB);
}

#[test]
fn frees_while_asleep_are_bookkeeping_and_their_pages_are_not_mapped_again() {
    let dev = backed();
    let pool = pool_with(&dev, PagePoolConfig::default());
    let r = Region::new(&pool, 64 * MIB, "t").unwrap();
    r.commit(0, 3 * MIB, true).unwrap(); // pages 0-1
    r.commit(3 * MIB, 3 * MIB, true).unwrap(); // pages 1-2
    let keep = pattern(3 * MIB, 5);
    dev.write(r.base() + 3 * MIB, &keep).unwrap();
    pool.sleep(true).unwrap();
    let before = dev.calls();
    r.decommit(0, 3 * MIB); // page 0 free, page 1 still referenced
    assert_eq!(dev.calls().since(&before).total(), 0, "no driver call");
    let s = pool.stats();
    assert_eq!(
        (s.pages_asleep, s.pages_offloaded, s.pages_in_use),
        (2, 2, 2)
    );
    assert_eq!(s.pages_free_mapped, 0);
    let w = pool.wake().unwrap();
    assert_eq!((w.pages_mapped, w.pages_restored), (2, 2));
    assert_eq!(pool.stats().pages_held, 2);
    assert_eq!(read(&dev, r.base() + 3 * MIB, 3 * MIB), keep);
    assert!(
        dev.read(r.base(), &mut [0u8; 8]).is_err(),
        "the page freed while asleep is not mapped"
    );
    r.decommit(3 * MIB, 3 * MIB);
    // Everything freed while asleep: the wake maps nothing.
    r.commit(0, 2 * MIB, true).unwrap();
    pool.sleep(true).unwrap();
    r.decommit(0, 2 * MIB);
    assert_eq!(pool.stats().pages_offloaded, 0);
    assert_eq!(pool.wake().unwrap().pages_mapped, 0);
}

#[test]
fn old_mappings_and_cached_handles_are_released_by_sleep() {
    let dev = backed();
    let pool = pool_with(
        &dev,
        PagePoolConfig {
            keep_old_mappings: true,
            ..Default::default()
        },
    );
    pool.set_fence_stream(Some(0));
    let r = Region::new(&pool, 64 * MIB, "t").unwrap();
    r.commit(0, 4 * MIB, true).unwrap();
    r.decommit(0, 4 * MIB);
    r.commit(32 * MIB, 4 * MIB, true).unwrap(); // pages move: 0-1 keep old mappings
    assert_eq!(pool.stats().zombies, 2);
    let data = pattern(4 * MIB, 7);
    dev.write(r.base() + 32 * MIB, &data).unwrap();
    let slept = pool.sleep(true).unwrap();
    assert_eq!(slept.old_mappings_unmapped, 2);
    let s = pool.stats();
    assert_eq!((s.zombies, s.pages_held, s.pages_asleep), (0, 0, 2));
    assert_eq!(dev.outstanding().mappings, 0);
    pool.wake().unwrap();
    assert_eq!(read(&dev, r.base() + 32 * MIB, 4 * MIB), data);
    // A region dropped while asleep gives back its references; the wake maps nothing of it.
    let r2 = Region::new(&pool, 16 * MIB, "u").unwrap();
    r2.commit(0, 2 * MIB, true).unwrap();
    pool.sleep(true).unwrap();
    drop(r2);
    let s = pool.stats();
    assert_eq!(
        (s.pages_asleep, s.pages_offloaded, s.pages_in_use),
        (2, 2, 2)
    );
    assert_eq!(pool.wake().unwrap().pages_mapped, 2);
    r.decommit(32 * MIB, 4 * MIB);
}

#[test]
fn a_wake_without_memory_stays_asleep_and_succeeds_later() {
    let dev = backed();
    let pool = pool_with(&dev, PagePoolConfig::default());
    let r = Region::new(&pool, 64 * MIB, "t").unwrap();
    r.commit(0, 6 * MIB, true).unwrap();
    let data = pattern(6 * MIB, 11);
    dev.write(r.base(), &data).unwrap();
    pool.sleep(true).unwrap();
    // Another process holds all but one page's worth.
    dev.set_capacity(PAGE);
    match pool.wake() {
        Err(VmmError::OutOfMemory { .. }) => {}
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    assert!(pool.is_asleep());
    assert_eq!(
        dev.reserved().current,
        0,
        "the attempt's pages were given back"
    );
    assert_eq!(pool.stats().pages_held, 0);
    // A map failure also leaves it asleep.
    dev.set_capacity(80 << 30);
    dev.fail_next(CallKind::Map);
    assert!(matches!(
        pool.wake(),
        Err(VmmError::Device(DeviceError::Driver { .. }))
    ));
    assert!(pool.is_asleep());
    assert_eq!(dev.outstanding().mappings, 0);
    assert_eq!(dev.reserved().current, 0);
    let w = pool.wake().unwrap();
    assert_eq!(w.pages_restored, 3);
    assert_eq!(read(&dev, r.base(), 6 * MIB), data);
    r.decommit(0, 6 * MIB);
}

#[test]
fn a_failed_offload_leaves_the_pool_awake_and_mapped() {
    let dev = backed();
    let pool = pool_with(&dev, PagePoolConfig::default());
    let r = Region::new(&pool, 64 * MIB, "t").unwrap();
    r.commit(0, 4 * MIB, true).unwrap();
    let data = pattern(4 * MIB, 13);
    dev.write(r.base(), &data).unwrap();
    dev.fail_next(CallKind::HostAlloc);
    assert!(matches!(pool.sleep(true), Err(VmmError::Device(e)) if e.is_oom()));
    assert!(!pool.is_asleep());
    dev.fail_next(CallKind::CopyToHost);
    assert!(pool.sleep(true).is_err());
    assert!(!pool.is_asleep());
    assert_eq!(pool.stats().pages_held, 2);
    assert_eq!(read(&dev, r.base(), 4 * MIB), data);
    r.commit(8 * MIB, 2 * MIB, true).unwrap();
    r.decommit(8 * MIB, 2 * MIB);
    r.decommit(0, 4 * MIB);
}

#[test]
fn copies_and_unmaps_go_by_runs_of_consecutive_pages() {
    let dev = backed();
    let pool = pool_with(&dev, PagePoolConfig::default());
    let r = Region::new(&pool, 64 * MIB, "t").unwrap();
    r.commit(0, 8 * MIB, true).unwrap(); // pages 0-3
    r.commit(20 * MIB, 4 * MIB, true).unwrap(); // pages 10-11
    let a = pattern(8 * MIB, 21);
    let b = pattern(4 * MIB, 22);
    dev.write(r.base(), &a).unwrap();
    dev.write(r.base() + 20 * MIB, &b).unwrap();
    let before = dev.calls();
    pool.sleep(true).unwrap();
    let d = dev.calls().since(&before);
    assert_eq!(
        (
            d[CallKind::CopyToHost],
            d[CallKind::Unmap],
            d[CallKind::PhysRelease]
        ),
        (2, 2, 6),
        "two runs: {d:?}"
    );
    let before = dev.calls();
    pool.wake().unwrap();
    let d = dev.calls().since(&before);
    assert_eq!(
        (d[CallKind::CopyFromHost], d[CallKind::PhysCreate]),
        (2, 6),
        "{d:?}"
    );
    assert_eq!(read(&dev, r.base(), 8 * MIB), a);
    assert_eq!(read(&dev, r.base() + 20 * MIB, 4 * MIB), b);
    r.decommit(0, 8 * MIB);
    r.decommit(20 * MIB, 4 * MIB);
}
