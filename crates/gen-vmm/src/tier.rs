//! What a tier built on the page layer (gen-slab, gen-extent, gen-buddy) can fail with: one error type
//! for all of them, so the engine reads one type and no tier repeats the page layer's conversion.

use gen_device::DeviceError;

use crate::VmmError;

/// An error of a page-mapped tier.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TierError {
    /// A configuration the tier cannot work with.
    #[error("invalid tier configuration: {0}")]
    InvalidConfig(String),
    /// A size of 0, one too large to represent after rounding, or one the tier does not serve (the
    /// slab: above its largest class).
    #[error("invalid allocation size {0} for this tier")]
    InvalidSize(u64),
    /// Serving the request needs new physical pages and the caller asked not to grow (passed through
    /// from [`crate::Region::commit`]); the engine gives back what it caches and retries with `grow`.
    #[error("allocation would create {pages} new physical page(s)")]
    WouldGrow {
        /// Pages that would have to be created.
        pages: u64,
    },
    /// The tier's own space is used up whatever the pages: every slot of a slab size class, the extent
    /// arena's address range, the buddy's region slots.
    #[error("{what} exhausted: {requested} requested, {available} available")]
    Exhausted {
        /// What ran out (`slab size class`, `extent address space`, `buddy regions`).
        what: &'static str,
        /// What was asked for (bytes, or the class size).
        requested: u64,
        /// What there was (the largest free extent, the class's slots, the region slots).
        available: u64,
    },
    /// `ptr` is not the start of a live block of this tier (foreign, interior, or freed already).
    #[error("invalid free of {ptr:#x}: {reason}")]
    InvalidFree {
        /// The pointer passed to `free`.
        ptr: u64,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The page layer failed (out of memory included: [`VmmError::OutOfMemory`], or a device error with
    /// [`DeviceError::is_oom`]).
    #[error(transparent)]
    Vmm(VmmError),
    /// A device call of the tier's own (events, synchronize) failed.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// Host memory for the tier's bookkeeping could not be had.
    #[error("host memory: {0}")]
    Host(String),
    /// An allocation at a chosen address (`alloc_at`) that the tier cannot place there.
    #[error("cannot place {size:#x} bytes at {ptr:#x}: {reason}")]
    Unplaceable {
        /// The address asked for.
        ptr: u64,
        /// The size asked for (rounded).
        size: u64,
        /// Why not: the range is taken, or not the tier's.
        reason: &'static str,
    },
}

impl From<VmmError> for TierError {
    fn from(e: VmmError) -> Self {
        match e {
            VmmError::WouldGrow { pages } => TierError::WouldGrow { pages },
            other => TierError::Vmm(other),
        }
    }
}

impl TierError {
    /// Whether the device (or the pool's limit) is out of memory.
    pub fn is_oom(&self) -> bool {
        match self {
            TierError::Vmm(VmmError::OutOfMemory { .. }) => true,
            TierError::Vmm(VmmError::Device(d)) | TierError::Device(d) => d.is_oom(),
            _ => false,
        }
    }

    /// Whether the tier cannot serve the request however the pages are arranged now: out of memory, or
    /// its own space used up ([`TierError::Exhausted`]). The engine's release-and-retry ladder takes over.
    pub fn is_exhaustion(&self) -> bool {
        matches!(self, TierError::Exhausted { .. }) || self.is_oom()
    }

    /// Neither [`TierError::WouldGrow`] nor an exhaustion: a bad request or a broken invariant, which no
    /// release and retry can fix.
    pub fn is_fault(&self) -> bool {
        !matches!(self, TierError::WouldGrow { .. }) && !self.is_exhaustion()
    }
}

/// Whether `ranges` (offset, length) tile `[0, len)` exactly, with no gap and no overlap: the invariant
/// of every tier core's books (free and live ranges together), checked by their `check` methods.
pub fn check_tiling(mut ranges: Vec<(u64, u64)>, len: u64) -> Result<(), String> {
    ranges.sort_unstable();
    let mut at = 0;
    for (off, l) in ranges {
        if off != at {
            return Err(format!(
                "gap or overlap at byte {at:#x} (next range starts at {off:#x})"
            ));
        }
        at = off + l;
    }
    if at != len {
        return Err(format!("ranges end at {at:#x}, core is {len:#x}"));
    }
    Ok(())
}
