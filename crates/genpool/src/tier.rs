//! The tiers behind one interface: what the engine's router asks of each (allocate, free, what it holds,
//! give back what it can), with the page-mapped tiers' one error type ([`TierError`]).

use gen_buddy::Buddy;
use gen_classifier::Lifetime;
use gen_device::StreamId;
use gen_slab::Slab;
use gen_stream::{DriverPool, StreamError};
use gen_vmm::TierError;

use crate::error::GenpoolError;

/// The tiers of the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[repr(u8)]
pub enum Tier {
    /// Short-lived small blocks: size classes over chunks, lock-free free lists.
    Slab = 0,
    /// Large short/mid-lived blocks: best-fit coalescing over page-mapped VA (planned blocks, served
    /// from the plan's range, are counted here too).
    Extent = 1,
    /// Mid-lived blocks through the driver's stream-ordered pool.
    Stream = 2,
    /// Long-lived blocks: exact-fit buddy.
    Buddy = 3,
}

impl Tier {
    /// All tiers, in index order.
    pub const ALL: [Tier; 4] = [Tier::Slab, Tier::Extent, Tier::Stream, Tier::Buddy];
    /// The tier's name.
    pub fn name(self) -> &'static str {
        match self {
            Tier::Slab => "slab",
            Tier::Extent => "extent",
            Tier::Stream => "stream",
            Tier::Buddy => "buddy",
        }
    }
}

/// One allocation as the router hands it to a tier.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Request {
    /// Bytes, a multiple of [`crate::ALIGN`].
    pub size: u64,
    /// The predicted lifetime (the extent tier's generation arenas).
    pub class: Lifetime,
    /// The stream the block is used on.
    pub stream: StreamId,
    /// The first stream the engine saw (the extent tier: that stream's arena is the main one).
    pub first_stream: StreamId,
    /// Whether the page pool may grow to serve it.
    pub grow: bool,
}

/// What the router asks of a tier.
pub(crate) trait TierAlloc {
    /// A block for `req`, or why not: [`TierError::WouldGrow`] (try again with `grow`), an exhaustion
    /// ([`TierError::is_exhaustion`]: the release-and-retry ladder), anything else is a fault.
    fn alloc(&self, req: &Request) -> Result<u64, TierError>;
    /// Take back the block at `ptr`, freed on `stream`, for reuse (the engine has decided it is safe).
    fn free(&self, ptr: u64, stream: StreamId) -> Result<(), TierError>;
    /// Bytes held from the device now, and the tier's highest.
    fn reserved(&self) -> (u64, u64);
    /// Give back what the tier holds and no live block needs (empty chunks, regions, spare memory).
    fn trim(&self);
}

impl From<TierError> for GenpoolError {
    fn from(e: TierError) -> Self {
        match e {
            TierError::Vmm(gen_vmm::VmmError::Device(d)) | TierError::Device(d) => {
                GenpoolError::from(d)
            }
            TierError::Vmm(gen_vmm::VmmError::Capturing(what)) => GenpoolError::Capturing(what),
            TierError::Unplaceable { ptr, size, reason } => {
                GenpoolError::Unplaceable { ptr, size, reason }
            }
            other => tier_err(other),
        }
    }
}

/// A tier's or the page layer's error with no device error inside, as the engine reports it.
pub(crate) fn tier_err(e: impl std::fmt::Display) -> GenpoolError {
    GenpoolError::from(gen_device::DeviceError::InvalidArgument {
        call: "tier",
        detail: e.to_string(),
    })
}

impl TierAlloc for Slab {
    #[inline]
    fn alloc(&self, req: &Request) -> Result<u64, TierError> {
        Slab::alloc(self, req.size, req.stream, req.grow)
    }
    fn free(&self, ptr: u64, stream: StreamId) -> Result<(), TierError> {
        Slab::free(self, ptr, stream).map(|_| ())
    }
    fn reserved(&self) -> (u64, u64) {
        let s = self.stats();
        (s.committed_bytes, s.peak_committed_bytes)
    }
    fn trim(&self) {
        if let Err(e) = self.reclaim() {
            log::error!("genpool: slab reclaim: {e}");
        }
    }
}

impl TierAlloc for Buddy {
    #[inline]
    fn alloc(&self, req: &Request) -> Result<u64, TierError> {
        Buddy::alloc(self, req.size, req.grow)
    }
    fn free(&self, ptr: u64, _stream: StreamId) -> Result<(), TierError> {
        Buddy::free(self, ptr).map(|_| ())
    }
    fn reserved(&self) -> (u64, u64) {
        let s = self.stats();
        (s.committed_bytes, s.peak_committed_bytes)
    }
    fn trim(&self) {
        Buddy::trim(self);
    }
}

/// The driver pool's errors in the tiers' terms (its out-of-memory, a device error, is an exhaustion).
fn stream_err(e: StreamError) -> TierError {
    match e {
        StreamError::Device(d) => TierError::Device(d),
        StreamError::InvalidFree { ptr, .. } => TierError::InvalidFree {
            ptr,
            reason: "not a live block of the stream pool",
        },
        StreamError::ZeroSize => TierError::InvalidSize(0),
        StreamError::TooLarge(n) => TierError::InvalidSize(n),
        StreamError::Config(why) => TierError::InvalidConfig(why.into()),
    }
}

impl TierAlloc for DriverPool {
    fn alloc(&self, req: &Request) -> Result<u64, TierError> {
        DriverPool::alloc(self, req.size, req.stream).map_err(stream_err)
    }
    fn free(&self, ptr: u64, stream: StreamId) -> Result<(), TierError> {
        DriverPool::free(self, ptr, stream).map_err(stream_err)
    }
    fn reserved(&self) -> (u64, u64) {
        self.stats()
            .pool
            .map_or((0, 0), |u| (u.reserved_current, u.reserved_high))
    }
    fn trim(&self) {
        if let Err(e) = DriverPool::trim(self, 0) {
            log::error!("genpool: trimming the stream pool: {e}");
        }
    }
}
