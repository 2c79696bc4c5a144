//! Fixtures shared by the tests of the tiers built on the page layer (feature `testing`): a page pool on
//! a simulated device, and the pages a set of live blocks touches.

use std::collections::BTreeSet;
use std::sync::Arc;

use gen_device::sim::SimDevice;
use gen_device::Device;

use crate::{PagePool, PagePoolConfig};

/// A simulated device of `capacity` bytes with pages of `page` bytes, and a page pool on it capped at
/// `limit`.
pub fn sim_pages(page: u64, capacity: u64, limit: Option<u64>) -> (Arc<SimDevice>, Arc<PagePool>) {
    let dev = Arc::new(
        SimDevice::config()
            .granularity(page)
            .capacity(capacity)
            .build()
            .expect("simulated device"),
    );
    let pool = PagePool::new(
        dev.clone() as Arc<dyn Device>,
        PagePoolConfig {
            limit,
            ..PagePoolConfig::default()
        },
    )
    .expect("page pool");
    (dev, pool)
}

/// Bytes of the distinct `page`-sized pages that the blocks `live` (address, size) touch.
pub fn pages_touched(live: &[(u64, u64)], page: u64) -> u64 {
    let pages: BTreeSet<u64> = live
        .iter()
        .flat_map(|&(p, s)| p / page..=(p + s - 1) / page)
        .collect();
    pages.len() as u64 * page
}
