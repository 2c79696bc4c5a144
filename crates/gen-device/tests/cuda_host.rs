//! Pinned host memory and copies on a real GPU (issue 22). `#[ignore]`d here; run on the GPU machine with
//! `--include-ignored`. Without a device it fails, saying why.

use gen_device::testing::cuda_device;
use gen_device::{Device, DeviceError, HostHandle};

const PAGE: u64 = 2 << 20;

#[test]
#[ignore = "needs a CUDA device"]
fn pinned_copies_round_trip_and_misuse_is_refused() {
    let d = cuda_device();
    let g = d.props().vmm_granularity;
    assert_eq!(g, PAGE);
    let va = d.va_reserve(2 * g, 0).unwrap();
    let h = d.phys_create(g).unwrap();
    d.map(va, g, h).unwrap();
    let data: Vec<u8> = (0..g).map(|i| (i * 13 + 5) as u8).collect();
    d.write(va, &data).unwrap();
    let host = d.host_alloc(2 * g).unwrap();
    d.copy_to_host(host, g, va, g).unwrap();
    d.unmap(va, g).unwrap();
    d.phys_release(h).unwrap();
    let h2 = d.phys_create(g).unwrap();
    d.map(va + g, g, h2).unwrap();
    d.copy_from_host(va + g, host, g, g).unwrap();
    let mut back = vec![0u8; g as usize];
    d.read(va + g, &mut back).unwrap();
    assert!(back == data, "restored bit for bit at another address");
    assert!(matches!(
        d.copy_to_host(host, g + 1, va + g, g),
        Err(DeviceError::InvalidArgument { .. })
    ));
    assert!(matches!(
        d.copy_from_host(va + g, HostHandle(0xdead_0000), 0, 16),
        Err(DeviceError::InvalidArgument { .. })
    ));
    assert!(
        d.copy_to_host(host, 0, va, 16).is_err(),
        "an unmapped device range"
    );
    assert!(!d.stream_is_capturing(0).unwrap());
    d.host_free(host).unwrap();
    assert!(d.host_free(host).is_err());
    d.unmap(va + g, g).unwrap();
    d.phys_release(h2).unwrap();
    d.va_release(va, 2 * g).unwrap();
}
