//! Mid-lived tier: stream-ordered allocation from a private cudaMemPool, with a front cache.
//!
//! Two pieces:
//! - [`StreamCache`]: a thread-safe, exact-size recycler of freed blocks keyed by `(stream, size)`. The
//!   engine puts one in front of its extent and buddy tiers; [`DriverPool`] puts one in front of the
//!   driver pool. Its hot path (a hit on the caller's stream, a put) is one sharded lock and one small
//!   hash lookup, with no driver call and no heap allocation in the steady state.
//! - [`DriverPool`]: the mid-lived tier, a private pool (`cuMemPoolCreate`, never the default pool)
//!   with stream-ordered alloc and free on the caller's stream, trim under memory pressure and a
//!   drain/trim/retry answer to out-of-memory.
//!
//! # Stream rules (PyTorch semantics)
//! A free on stream S means work already queued on S may still use the block. So a freed block is
//! reusable at once on S, but on another stream T only after an event recorded on S *after the free*
//! has completed. Events are not recorded per free (a driver call costs ~0.5 µs, ten times the budget
//! of an operation): blocks are kept per stream, and when T needs a size only S has, S's whole list of
//! that size migrates as one batch under one event, handed out once `event_query` says it completed.
//! `event_synchronize`/`stream_synchronize` happen only in [`StreamCache::drain`] (memory pressure).
//! While one stream has ever been seen no event is needed at all; when a second appears, one
//! `device.synchronize()` makes every earlier free safe everywhere.

#![warn(unsafe_op_in_unsafe_fn)]
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod cache;
mod error;
mod pool;
mod util;

pub use cache::{StreamCache, StreamCacheConfig, StreamCacheStats};
pub use error::{InvalidFreeReason, Overflow, StreamError};
pub use pool::{DriverPool, DriverPoolConfig, DriverPoolStats};
