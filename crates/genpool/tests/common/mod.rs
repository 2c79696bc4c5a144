//! Checks shared by the engine's property tests (`prop.rs`, `trace_mutations.rs`).

use gen_device::sim::SimDevice;
use gen_device::Device;
use genpool::Pool;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

/// Every block has been freed: `trim`, then neither the engine nor the simulated device may hold anything
/// (no byte reserved, no physical handle, no mapping, no driver-pool block).
pub fn trim_and_assert_nothing_held(pool: &Pool, dev: &SimDevice) -> Result<(), TestCaseError> {
    pool.trim();
    prop_assert_eq!(pool.allocated(), 0);
    prop_assert_eq!(pool.live_blocks(), 0);
    prop_assert_eq!(
        pool.reserved_now(),
        0,
        "engine holds memory after free all + trim"
    );
    prop_assert_eq!(
        dev.reserved().current,
        0,
        "device memory held after free all + trim"
    );
    let out = dev.outstanding();
    prop_assert_eq!(out.phys_handles, 0);
    prop_assert_eq!(out.mappings, 0);
    prop_assert_eq!(out.pool_live_blocks, 0);
    Ok(())
}
