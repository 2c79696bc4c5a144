//! Fixtures for the GPU tests of the workspace's crates (they run on the GPU machine, `#[ignore]`d in CI).

use crate::{CudaDevice, DeviceError};

/// Device 0, for a GPU test. With no CUDA driver or device, or any other error opening it, the calling
/// test fails, naming itself (its thread's name, which the test harness sets to the test's) and why: a
/// GPU test never passes where no GPU opens.
pub fn cuda_device() -> CudaDevice {
    let thread = std::thread::current();
    let test = thread.name().unwrap_or("this GPU test");
    match CudaDevice::new(0) {
        Ok(d) => d,
        Err(DeviceError::NoDriver(why)) => {
            panic!("{test}: needs a CUDA device, and none opens: no CUDA driver or device ({why})")
        }
        Err(e) => panic!("{test}: CUDA present but unusable: {e}"),
    }
}
