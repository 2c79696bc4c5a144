//! Index-based lock-free free lists for genpool's allocator tiers.
//!
//! A tier keeps its blocks in an array of slots and hands out slot indices (`u32`); these types keep track
//! of which slots are free without locks, without allocating after construction and without unsafe code:
//!
//! - [`FreeList`]: a tagged Treiber stack, any thread pushes and pops, plus batch
//!   [`push_chain`](FreeList::push_chain) (one CAS) and [`take_all`](FreeList::take_all) (one RMW).
//! - [`TransferStack`]: push from any thread, detach everything with one `swap` (no ABA tag needed):
//!   remote frees collected by an owner.
//! - [`LocalCache`]: a single-owner bounded array in front of a [`FreeList`], refilled and spilled in
//!   batches: no atomic operation at all on its fast path.
//! - [`FrontCache`]: a shared ([`Sync`]) front end with one small bounded stack per shard (each on its own
//!   cache line) over the same slot links, a thread sticking to one shard: the short path touches only
//!   that thread's cache line.
//!
//! Slots are indices, so a stale read is never a use-after-free; the one hazard of a Treiber stack, ABA, is
//! answered by a version tag packed next to the top index in one 64-bit word.
//!
//! Every type supports up to [`MAX_CAPACITY`] slots (`2^32 - 1`), 4 bytes of links per slot.
//!
//! # Correctness
//! The crate has `#![forbid(unsafe_code)]`. All primitives come from one shim (`sync`), so the same code
//! is model-checked with [loom](https://docs.rs/loom) (`RUSTFLAGS="--cfg loom"`), checked against a
//! reference model with proptest, stress-tested across threads, and run under Miri.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod cache;
mod chain;
mod freelist;
mod links;
mod sync;
mod transfer;

#[cfg(test)]
mod tests;

pub use cache::{FrontCache, LocalCache, MAX_SHARD_CAPACITY};
pub use chain::Chain;
pub use freelist::FreeList;
pub use transfer::TransferStack;

/// The largest capacity of any list: indices are `u32` and `u32::MAX` marks "no slot".
pub const MAX_CAPACITY: usize = u32::MAX as usize;

/// What can go wrong building or feeding a free list. Operations on valid input never fail.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FreeListError {
    /// More slots were requested than `u32` indices can name.
    #[error("capacity {requested} exceeds the maximum of {max} slots")]
    CapacityTooLarge {
        /// The capacity asked for.
        requested: usize,
        /// [`MAX_CAPACITY`].
        max: usize,
    },
    /// The link array (4 bytes per slot) could not be allocated.
    #[error("out of host memory allocating links for {capacity} slots")]
    OutOfMemory {
        /// The capacity asked for.
        capacity: usize,
    },
    /// A slot index is not below the list's capacity.
    #[error("slot index {idx} out of range for capacity {capacity}")]
    IndexOutOfRange {
        /// The offending index.
        idx: u32,
        /// The list's capacity.
        capacity: usize,
    },
    /// A [`FrontCache`] needs at least one shard.
    #[error("a front cache needs at least one shard")]
    NoShards,
    /// A [`FrontCache`] shard must hold between 1 and [`MAX_SHARD_CAPACITY`] slots.
    #[error("shard capacity {requested} must be between 1 and {max}")]
    ShardCapacity {
        /// The per-shard bound asked for.
        requested: usize,
        /// [`MAX_SHARD_CAPACITY`].
        max: usize,
    },
}
