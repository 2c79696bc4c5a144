//! genpool: a generational GPU memory pool.
//!
//! Each allocation's lifetime is predicted ([`gen_classifier`]) and the block is served by the tier
//! built for that generation:
//!
//! | generation | size | tier |
//! |---|---|---|
//! | short | ≤ `slab_max_size` | [`gen_slab`]: size classes over 2 MiB chunks, lock-free free lists |
//! | short (and mid, by default) | larger | [`gen_extent`]: best-fit coalescing over page-mapped VA |
//! | mid (`experimental.mid_tier:stream`) | any | [`gen_stream`]: a private stream-ordered driver pool |
//! | long | any | [`gen_buddy`]: exact-fit buddy over page-mapped VA |
//!
//! All page-mapped tiers draw physical memory from one [`gen_vmm::PagePool`], so the memory held is the
//! peak of pages touched by live blocks. Freed blocks go straight back to their tier; when memory freed on
//! one stream may serve another is decided in one place, gen-vmm (per-stream fences for pages,
//! [`gen_vmm::Handoff`] for blocks handed between streams). See docs/ARCHITECTURE.md.

#![warn(missing_docs)]

mod arenas;
mod books;
mod busykeep;
pub mod config;
pub mod devices;
pub mod error;
mod headroom;
mod mag;
mod meta;
mod pool;
#[cfg(feature = "replay")]
pub mod replay;
mod slabbook;
pub mod sleep;
pub mod stats;
mod tcache;
pub mod thread_slot;
mod tier;

pub use config::{
    BusyFreers, Config, ConfigError, LongTier, MidTier, RecordStream, Routing, StreamArenas,
};
pub use devices::{DeviceFactory, Engine, Factory, Freed, Opener, Pools, PoolsStats, MAX_DEVICES};
pub use error::{FreeFault, GenpoolError, OomReport, Result, TierUsage};
pub use gen_classifier::Lifetime;
pub use gen_device::{Device, DeviceError, StreamId};
pub use pool::{Block, Hint, LiveBlock, Pool, Tier, ALIGN};
pub use sleep::{SleepError, SleepOptions, SleepReport, WakeReport};
pub use stats::{OldGeneration, PlanSummary, PoolStats, TierStats};
