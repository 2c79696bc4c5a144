//! Streams recorded on live blocks by `genpool_record_stream` (PyTorch's `Tensor.record_stream`).
//!
//! The engine's free takes one stream; a block also used on other streams must not be reused before
//! their work is done. The plug-in remembers, per block, the extra streams it was recorded on, and at
//! free makes the free's stream wait for them (see `DeviceState::order_after`).
//!
//! Blocks with recorded streams are rare (communication and prefetch streams). A free first reads one
//! counter of blocks that have any; while it is zero — the common case — the free takes no lock and
//! touches no map. Otherwise the entry is looked up in one of [`SHARDS`] mutex-protected maps.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use gen_device::StreamId;
use parking_lot::Mutex;

/// Number of independently locked shards.
pub(crate) const SHARDS: usize = 64;

/// One shard: extra streams per block, keyed by (device index, address); `None` until first used.
type Shard = Mutex<Option<HashMap<(usize, u64), Vec<StreamId>>>>;

/// Extra streams recorded per block, keyed by (device index, address).
pub(crate) struct Recorded {
    shards: [Shard; SHARDS],
    blocks: AtomicUsize,
}

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY_SHARD: Shard = Mutex::new(None);

/// The process-wide table.
pub(crate) static RECORDED: Recorded = Recorded::new();

fn shard_of(ptr: u64) -> usize {
    // Blocks are at least 512-byte aligned: drop those bits, then mix.
    ((ptr >> 9).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 58) as usize % SHARDS
}

impl Recorded {
    /// An empty table.
    pub(crate) const fn new() -> Self {
        Recorded {
            shards: [EMPTY_SHARD; SHARDS],
            blocks: AtomicUsize::new(0),
        }
    }

    /// Remember that block `ptr` of `device` is in use on `stream` (once per stream).
    pub(crate) fn record(&self, device: usize, ptr: u64, stream: StreamId) {
        let mut shard = self.shards[shard_of(ptr)].lock();
        let streams = shard
            .get_or_insert_with(HashMap::new)
            .entry((device, ptr))
            .or_insert_with(|| {
                self.blocks.fetch_add(1, Ordering::Release);
                Vec::new()
            });
        if !streams.contains(&stream) {
            streams.push(stream);
        }
    }

    /// Remove and return the streams recorded on `ptr` of `device`, if any. Lock-free while no block has
    /// recorded streams.
    #[inline]
    pub(crate) fn take(&self, device: usize, ptr: u64) -> Option<Vec<StreamId>> {
        if self.blocks.load(Ordering::Acquire) == 0 {
            return None;
        }
        let streams = self.shards[shard_of(ptr)]
            .lock()
            .as_mut()?
            .remove(&(device, ptr))?;
        self.blocks.fetch_sub(1, Ordering::Release);
        Some(streams)
    }

    /// Blocks that currently have recorded streams.
    pub(crate) fn blocks(&self) -> usize {
        self.blocks.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_take_round_trip() {
        let r = Recorded::new();
        assert_eq!(r.take(0, 0x1000), None);
        r.record(0, 0x1000, 7);
        r.record(0, 0x1000, 7);
        r.record(0, 0x1000, 9);
        r.record(1, 0x1000, 5);
        assert_eq!(r.blocks(), 2);
        assert_eq!(r.take(0, 0x1000), Some(vec![7, 9]));
        assert_eq!(r.take(0, 0x1000), None);
        assert_eq!(r.blocks(), 1);
        assert_eq!(r.take(1, 0x1000), Some(vec![5]));
        assert_eq!(r.blocks(), 0);
    }

    #[test]
    fn shards_spread() {
        let mut seen = [false; SHARDS];
        for i in 0..4096u64 {
            seen[shard_of(0x7000_0000_0000 + i * 512)] = true;
        }
        assert!(seen.iter().filter(|&&s| s).count() > SHARDS / 2);
    }
}
