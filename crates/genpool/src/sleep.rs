//! Sleep and wake: give an engine's physical memory back to the driver without giving up its addresses.
//!
//! Reinforcement-learning fine-tuning runs a trainer and a rollout engine on the same GPUs and hands the
//! memory back and forth every iteration. Every page-mapped tier of a [`Pool`] lays its blocks out in
//! reserved VA over one [`gen_vmm::PagePool`], so a pool can release every physical page while every
//! live block keeps its pointer:
//!
//! 1. [`Pool::sleep`] first gives back everything cached ([`Pool::trim`]: blocks a capture held back,
//!    empty slab chunks, free-mapped pages, old mappings left by page moves, spare pages of
//!    every arena, stream arenas included), then [`gen_vmm::PagePool::sleep`] unmaps and releases the
//!    pages still referenced by live blocks — with `offload`, after copying their bytes to one pinned
//!    host buffer.
//! 2. While asleep, [`Pool::alloc`] fails with [`GenpoolError::Asleep`](crate::GenpoolError::Asleep)
//!    (checked before any tier, so no tier hands out memory of a page it holds); [`Pool::free`] of a
//!    live block works (bookkeeping only: no page is touched, no driver call); a kernel touching the
//!    pool's memory faults (the addresses are reserved but unmapped) — the caller's contract, as with
//!    vLLM's sleep mode.
//! 3. [`Pool::wake`] maps new pages at the same addresses under every page still referenced and copies
//!    the offloaded bytes back. Pages not offloaded come back with undefined contents (vLLM's level 2).
//!
//! Stats: `reserved_current` drops to what stays held (0 with no stream tier), `allocated_current` is
//! unchanged; [`PoolStats`](crate::PoolStats) has `asleep`, `sleeping_bytes` and `offloaded_bytes`.
//!
//! Refused with a typed [`SleepError`]: a sleep of a pool asleep already, a wake of one awake, either
//! during a CUDA graph capture (mapping calls are illegal then: the caller says so with
//! [`SleepOptions::capturing`], and the device is asked about the legacy stream too), and a sleep of a
//! pool whose stream-ordered tier (`mid_tier:stream`, the driver's own pool) holds live blocks, whose
//! memory the engine cannot unmap.
//!
//! Concurrency: sleep and wake take the page pool's lock; an allocation racing with a sleep on another
//! thread either completes before it (its block sleeps too) or is refused. Callers sleep between phases
//! (PyTorch: after synchronizing), so this only matters for correctness, not for speed.

use gen_device::DeviceError;
use gen_vmm::VmmError;

use crate::Pool;

/// Why a sleep or wake was refused or failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SleepError {
    /// During a CUDA graph capture (mapping and unmapping memory is illegal while a stream captures).
    #[error("sleep/wake refused during a CUDA graph capture")]
    Capturing,
    /// [`Pool::sleep`] of a pool asleep already.
    #[error("the pool is asleep already (double sleep)")]
    AlreadyAsleep,
    /// [`Pool::wake`] of a pool that is not asleep.
    #[error("the pool is not asleep (wake without sleep)")]
    NotAsleep,
    /// The stream-ordered tier (`mid_tier:stream`) holds live blocks in the driver's pool, which the
    /// engine cannot unmap.
    #[error("the stream-ordered tier holds {live} B of live blocks, which cannot sleep (use the default mid_tier)")]
    StreamTier {
        /// Live bytes in that tier.
        live: u64,
    },
    /// The wake could not get its pages (another process holds the memory): the pool stays asleep and
    /// can be woken later.
    #[error("not enough device memory to wake: {requested} B of pages needed")]
    OutOfMemory {
        /// Bytes of pages the wake needed.
        requested: u64,
    },
    /// A device call failed (see [`Pool::sleep`] / [`Pool::wake`] for the state left).
    #[error("device error during sleep/wake: {0}")]
    Device(DeviceError),
}

impl From<VmmError> for SleepError {
    fn from(e: VmmError) -> Self {
        match e {
            VmmError::AlreadyAsleep => SleepError::AlreadyAsleep,
            VmmError::NotAsleep => SleepError::NotAsleep,
            VmmError::OutOfMemory { requested, .. } => SleepError::OutOfMemory { requested },
            VmmError::Device(d) => SleepError::Device(d),
            other => SleepError::Device(DeviceError::InvalidArgument {
                call: "sleep",
                detail: other.to_string(),
            }),
        }
    }
}

/// How to sleep.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SleepOptions {
    /// Copy the bytes of every live block's pages to pinned host memory first, to restore them at wake.
    pub offload: bool,
    /// A CUDA graph capture is in progress (the caller knows: PyTorch's
    /// `torch.cuda.is_current_stream_capturing()`): refused with [`SleepError::Capturing`].
    pub capturing: bool,
}

/// What [`Pool::sleep`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SleepReport {
    /// Bytes of reservation given back by the trim before the pages slept (cached memory).
    pub trimmed_bytes: u64,
    /// Bytes of reservation given back in all (`reserved_current` before minus after).
    pub released_bytes: u64,
    /// Bytes of pages referenced by live blocks, now asleep.
    pub sleeping_bytes: u64,
    /// Of those, bytes copied to pinned host memory.
    pub offloaded_bytes: u64,
}

/// What [`Pool::wake`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WakeReport {
    /// Bytes of pages mapped again.
    pub mapped_bytes: u64,
    /// Of those, bytes restored from pinned host memory.
    pub restored_bytes: u64,
}

impl Pool {
    /// Give every physical page of this pool back to the driver, keeping every live block's address
    /// (see the [module docs](self)). On error the pool is awake and unchanged except that cached memory
    /// may have been trimmed — but for a device failure while unmapping, after which it is asleep with
    /// the pages that failed still mapped (a wake handles both).
    pub fn sleep(&self, opts: SleepOptions) -> Result<SleepReport, SleepError> {
        if opts.capturing || self.device().captures().active() || self.legacy_stream_capturing() {
            return Err(SleepError::Capturing);
        }
        let pages = self.page_pool();
        if pages.is_asleep() {
            return Err(SleepError::AlreadyAsleep);
        }
        if let Some(t) = self.stats().tiers.iter().find(|t| t.tier == "stream") {
            if t.live_bytes > 0 {
                return Err(SleepError::StreamTier { live: t.live_bytes });
            }
        }
        let before = self.reserved_now();
        let trimmed_bytes = self.trim();
        let slept = pages.sleep(opts.offload)?;
        let page = pages.page_size();
        let report = SleepReport {
            trimmed_bytes,
            released_bytes: before.saturating_sub(self.reserved_now()),
            sleeping_bytes: slept.pages_asleep * page,
            offloaded_bytes: slept.pages_offloaded * page,
        };
        log::info!("genpool: asleep: {report:?}");
        Ok(report)
    }

    /// Map the pages of every live block again at the same addresses and restore the offloaded bytes.
    /// `capturing`: a CUDA graph capture is in progress (refused). Out of memory leaves the pool asleep.
    pub fn wake(&self, capturing: bool) -> Result<WakeReport, SleepError> {
        if capturing || self.device().captures().active() || self.legacy_stream_capturing() {
            return Err(SleepError::Capturing);
        }
        let pages = self.page_pool();
        let w = pages.wake()?;
        let page = pages.page_size();
        let report = WakeReport {
            mapped_bytes: w.pages_mapped * page,
            restored_bytes: w.pages_restored * page,
        };
        log::info!("genpool: awake: {report:?}");
        Ok(report)
    }

    /// Whether the pool is asleep.
    pub fn is_asleep(&self) -> bool {
        self.page_pool().is_asleep()
    }

    /// Free the pinned host buffer kept from the last wake for the next offload; returns its bytes.
    pub fn release_offload_buffer(&self) -> Result<u64, SleepError> {
        Ok(self.page_pool().release_host()?)
    }

    /// Whether the device reports a capture on the legacy default stream (an error asking counts as no:
    /// the caller's flag is the authority).
    fn legacy_stream_capturing(&self) -> bool {
        match self.device().stream_is_capturing(0) {
            Ok(c) => c,
            Err(e) => {
                log::debug!("genpool: asking about a capture on the legacy stream: {e}");
                false
            }
        }
    }
}
