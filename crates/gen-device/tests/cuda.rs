//! `CudaDevice` against a real driver. The GPU tests are `#[ignore]`d; run them with
//! `cargo test -p gen-device --test cuda -- --include-ignored`. Each first tries `CudaDevice::new(0)`; when
//! no device opens it fails, saying why.

use gen_device::testing::cuda_device;
use gen_device::{open, CudaDevice, Device, DeviceError, DeviceKind, DevicePtr};

#[test]
fn new_without_a_driver_is_no_driver_or_works() {
    // On a machine without CUDA (CI, this build host) this must be a clean NoDriver, never a crash; on a
    // GPU machine it must open device 0.
    match CudaDevice::new(0) {
        Ok(d) => {
            eprintln!("CUDA present: {:?}", d.props());
            assert!(d.props().total_mem > 0);
        }
        Err(DeviceError::NoDriver(why)) => {
            assert!(!why.is_empty());
            // Asking again is just as clean (the lazy loader is not left half-initialized).
            assert!(matches!(CudaDevice::new(0), Err(DeviceError::NoDriver(_))));
            // Auto falls back to the simulator; Cuda reports the absence.
            let d = open(DeviceKind::Auto, 0).unwrap();
            assert_eq!(d.props().name, "SimDevice");
            assert!(matches!(
                open(DeviceKind::Cuda, 0),
                Err(DeviceError::NoDriver(_))
            ));
        }
        Err(e) => panic!("unexpected error: {e}"),
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn props_and_invalid_ordinal() {
    let d = cuda_device();
    let p = d.props();
    eprintln!("{p:?}");
    assert!(p.supports_vmm && p.supports_pools);
    assert!(p.vmm_granularity.is_power_of_two());
    let (free, total) = d.mem_info().unwrap();
    assert!(free <= total && total > 0);
    assert_eq!(total, p.total_mem);
    match CudaDevice::new(10_000) {
        Err(DeviceError::InvalidDevice {
            ordinal: 10_000,
            count,
        }) => assert!(count >= 1),
        other => panic!("{other:?}"),
    }
    d.close().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn vmm_reserve_create_map_write_read_unmap_release() {
    let d = cuda_device();
    let g = d.props().vmm_granularity;
    let va = d.va_reserve(4 * g, 0).unwrap();
    assert_eq!(va % g, 0);
    let h1 = d.phys_create(g).unwrap();
    let h2 = d.phys_create(2 * g).unwrap();
    assert_eq!(d.reserved().current, 3 * g);
    d.map(va, g, h1).unwrap();
    d.map(va + g, 2 * g, h2).unwrap();
    // A pattern straddling the two mappings.
    let pattern: Vec<u8> = (0..(g as usize)).map(|i| (i * 13 + 1) as u8).collect();
    let at = va + g / 2;
    d.write(at, &pattern).unwrap();
    let mut back = vec![0u8; pattern.len()];
    d.read(at, &mut back).unwrap();
    assert_eq!(back, pattern);
    // Misuse is an error, not a crash.
    assert!(d.map(va, g, h1).is_err(), "already mapped");
    assert!(
        d.map(va + 3 * g, g, h2).is_err(),
        "size differs from the handle"
    );
    assert!(d.va_release(va, 4 * g).is_err(), "still mapped");
    d.unmap(va, 3 * g).unwrap();
    assert!(
        d.read(va, &mut back[..16]).is_err(),
        "use after unmap faults"
    );
    d.phys_release(h1).unwrap();
    d.phys_release(h2).unwrap();
    assert!(matches!(
        d.phys_release(h1),
        Err(DeviceError::InvalidArgument { .. })
    ));
    d.va_release(va, 4 * g).unwrap();
    let r = d.reserved();
    assert_eq!((r.current, r.peak), (0, 3 * g));
    d.close().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn pool_on_two_streams_with_an_event() {
    let d = cuda_device();
    let pool = d.pool_create(u64::MAX).unwrap();
    let s1 = d.stream_create().unwrap();
    let s2 = d.stream_create().unwrap();
    let e = d.event_create().unwrap();
    let a = d.pool_alloc_async(pool, 1 << 20, s1).unwrap();
    d.memset_async(a, 0x7e, 1 << 20, s1).unwrap();
    d.pool_free_async(a, s1).unwrap();
    d.event_record(e, s1).unwrap();
    d.stream_wait_event(s2, e).unwrap();
    let b = d.pool_alloc_async(pool, 1 << 20, s2).unwrap();
    d.memset_async(b, 0x11, 1 << 20, s2).unwrap();
    d.stream_synchronize(s2).unwrap();
    let mut v = vec![0u8; 1 << 20];
    d.read(b, &mut v).unwrap();
    assert!(v.iter().all(|&x| x == 0x11));
    let u = d.pool_usage(pool).unwrap();
    assert!(
        u.reserved_current >= 1 << 20 && u.used_current >= 1 << 20,
        "{u:?}"
    );
    assert!(d.reserved().current >= u.reserved_current);
    assert!(d.reserved().peak >= 1 << 20);
    d.pool_free_async(b, s2).unwrap();
    d.synchronize().unwrap();
    d.pool_trim(pool, 0).unwrap();
    assert_eq!(d.pool_usage(pool).unwrap().reserved_current, 0);
    assert_eq!(d.reserved().current, 0);
    d.event_destroy(e).unwrap();
    d.stream_destroy(s1).unwrap();
    d.stream_destroy(s2).unwrap();
    d.pool_destroy(pool).unwrap();
    assert!(matches!(
        d.pool_destroy(pool),
        Err(DeviceError::InvalidArgument { .. })
    ));
    d.close().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn events_and_stream_waits() {
    let d = cuda_device();
    let s = d.stream_create().unwrap();
    let e = d.event_create().unwrap();
    assert!(d.event_query(e).unwrap(), "never recorded = complete");
    let p = d.mem_alloc(64 << 20).unwrap();
    for _ in 0..16 {
        d.memset_async(p, 1, 64 << 20, s).unwrap();
    }
    d.event_record(e, s).unwrap();
    d.stream_wait_event(0, e).unwrap();
    d.event_synchronize(e).unwrap();
    assert!(d.event_query(e).unwrap());
    d.stream_synchronize(0).unwrap();
    d.synchronize().unwrap();
    let bogus = gen_device::EventHandle(0xdead_beef);
    assert!(matches!(
        d.event_query(bogus),
        Err(DeviceError::InvalidArgument { .. })
    ));
    assert!(matches!(
        d.stream_destroy(0x1234),
        Err(DeviceError::InvalidArgument { .. })
    ));
    d.mem_free(p).unwrap();
    d.event_destroy(e).unwrap();
    d.stream_destroy(s).unwrap();
    d.close().unwrap();
}

/// `stream_query`: an idle stream answers true, one with queued work false (and no wait), true again
/// once that work completes; the legacy stream answers too.
#[test]
#[ignore = "needs a CUDA GPU"]
fn stream_query_tells_idle_from_busy_without_waiting() {
    let d = cuda_device();
    let s = d.stream_create().unwrap();
    assert!(d.stream_query(s).unwrap(), "a new stream is idle");
    let p = d.mem_alloc(256 << 20).unwrap();
    // ~64 GiB of memsets: milliseconds of work on any GPU.
    for _ in 0..256 {
        d.memset_async(p, 1, 256 << 20, s).unwrap();
    }
    let before = d.call_counts();
    assert!(!d.stream_query(s).unwrap(), "work queued: busy");
    let after = d.call_counts();
    assert_eq!(after.stream_queries, before.stream_queries + 1);
    assert_eq!(after.waits, before.waits, "a question, not a wait");
    d.stream_synchronize(s).unwrap();
    assert!(d.stream_query(s).unwrap(), "idle once its work completed");
    d.synchronize().unwrap();
    assert!(d.stream_query(0).unwrap(), "the legacy stream, idle");
    d.mem_free(p).unwrap();
    d.stream_destroy(s).unwrap();
    d.close().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn memset_read_and_plain_alloc() {
    let d = cuda_device();
    let n: u64 = 3 << 20;
    let p: DevicePtr = d.mem_alloc(n).unwrap();
    assert_eq!(p % 256, 0);
    assert_eq!(d.reserved().current, n);
    d.memset_async(p, 0xab, n, 0).unwrap();
    d.memset_async(p + 100, 0xcd, 10, 0).unwrap();
    d.synchronize().unwrap();
    let mut v = vec![0u8; n as usize];
    d.read(p, &mut v).unwrap();
    assert!(v[..100].iter().all(|&x| x == 0xab));
    assert!(v[100..110].iter().all(|&x| x == 0xcd));
    assert!(v[110..].iter().all(|&x| x == 0xab));
    d.mem_free(p).unwrap();
    assert!(matches!(
        d.mem_free(p),
        Err(DeviceError::InvalidArgument { .. })
    ));
    assert!(d.mem_alloc(0).is_err());
    assert_eq!(d.reserved().current, 0);
    d.close().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn huge_phys_create_is_out_of_memory() {
    let d = cuda_device();
    let g = d.props().vmm_granularity;
    let huge = (d.props().total_mem * 4).div_ceil(g) * g;
    match d.phys_create(huge) {
        Err(DeviceError::OutOfMemory { call, requested }) => {
            assert_eq!(call, "cuMemCreate");
            assert_eq!(requested, huge);
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    assert!(d.mem_alloc(huge).unwrap_err().is_oom());
    let pool = d.pool_create(0).unwrap();
    assert!(d.pool_alloc_async(pool, huge, 0).unwrap_err().is_oom());
    // The device still works afterwards.
    let h = d.phys_create(g).unwrap();
    d.phys_release(h).unwrap();
    d.pool_destroy(pool).unwrap();
    assert_eq!(d.reserved().current, 0);
    assert!(d.take_errors().is_empty());
    d.close().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn drop_releases_what_the_device_made() {
    let d = cuda_device();
    let _s = d.stream_create().unwrap();
    let _e = d.event_create().unwrap();
    let _p = d.pool_create(0).unwrap();
    drop(d); // must not panic; errors are logged
    let d = cuda_device();
    d.synchronize().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn usable_from_other_threads() {
    let d = cuda_device();
    let d = std::sync::Arc::new(d);
    let handles: Vec<_> = (0..4)
        .map(|t| {
            let d = d.clone();
            std::thread::spawn(move || {
                // A fresh thread has no current context: the device makes its primary context current.
                let p = d.mem_alloc(4096).unwrap();
                d.write(p, &[t as u8; 4096]).unwrap();
                let mut v = [0u8; 4096];
                d.read(p, &mut v).unwrap();
                assert!(v.iter().all(|&x| x == t as u8));
                d.mem_free(p).unwrap();
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn exported_pages_import_through_a_pidfd_as_the_same_memory() {
    use std::os::fd::AsFd;
    let d = cuda_device();
    let g = d.props().vmm_granularity;
    let va = d.va_reserve(2 * g, 0).unwrap();
    let h = d.phys_create(g).unwrap();
    d.map(va, g, h).unwrap();
    d.write(va + 64, b"across processes").unwrap();
    let fd = d.export_handle(h).unwrap();
    assert_eq!(d.export_handle(h).unwrap(), fd, "one descriptor per handle");
    // The receiver's path: its own copy of the descriptor through a pidfd (here of this process).
    let mine = gen_device::ipc::ProcessFds::open(gen_device::ipc::this_process())
        .unwrap()
        .take(fd)
        .unwrap();
    let imp = d.import_handle(mine.as_fd(), g).unwrap();
    d.map(va + g, g, imp).unwrap();
    let mut out = [0u8; 16];
    d.read(va + g + 64, &mut out).unwrap();
    assert_eq!(&out, b"across processes");
    d.unmap(va, 2 * g).unwrap();
    d.phys_release(imp).unwrap();
    d.phys_release(h).unwrap();
    d.va_release(va, 2 * g).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_device_is_not_its_own_peer_and_peers_must_exist() {
    let d = cuda_device();
    assert!(matches!(
        d.add_peer(0),
        Err(DeviceError::InvalidArgument { .. })
    ));
    assert!(matches!(
        d.add_peer(4096),
        Err(DeviceError::InvalidDevice { .. })
    ));
}
