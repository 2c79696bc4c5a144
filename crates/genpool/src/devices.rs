//! Several devices: one [`Pool`] per device index, created on first use, with frees routed by address.
//!
//! - [`Pools::alloc`] serves device `d`'s request from `d`'s own tiers whatever device the calling thread
//!   has current (the engine never looks at the thread's device).
//! - [`Pools::free`] takes the pointer only: each device's tiers own disjoint address ranges (unified
//!   virtual addressing on CUDA; [`gen_device::sim::ORDINAL_STRIDE`] offsets on the simulator), so the
//!   owner is found by address. Every device keeps the bounding range `[lo, hi)` of the blocks it ever
//!   handed out in two atomics; a free scans those `#devices` ranges (no lock, no allocation). When
//!   exactly one range holds the pointer — always the case on the simulator, and the usual one on a GPU —
//!   that device's pool frees it; when ranges overlap, the candidates' [`Pool::lookup`] decides.
//! - [`Pools::record_use`] says a block is used on a stream of some device (peer access enabled by the
//!   caller, or a second stream of the owner). At free, a use on another stream of the owner makes the
//!   free's stream wait for an event recorded on that stream (as `genpool-torch` does for
//!   `record_stream`); a use on a *peer* device records an event on the peer's stream and the block is
//!   held back — still live in its pool — until that event completes. Held-back blocks are released by
//!   the next [`Pools::alloc`] or [`Pools::free`] that finds their events complete, by
//!   [`Pools::poll_deferred`], or by [`Pools::flush_deferred`] (which waits); an allocation that runs out
//!   of memory waits for them and retries once. While no block has a recorded use and none is held back,
//!   the extra cost of a free is two relaxed loads.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};

use gen_device::{Device, DeviceError, DeviceKind, EventHandle, StreamId};
use parking_lot::Mutex;

use crate::error::{FreeFault, GenpoolError, Result};
use crate::{Block, Config, Hint, Pool, PoolStats};

/// Makes the device of an index: `gen_device::open(kind, i)`, or a closure building simulated devices.
pub type DeviceFactory =
    dyn Fn(usize) -> std::result::Result<Arc<dyn Device>, DeviceError> + Send + Sync;

/// Independently locked shards of the recorded-use table.
const USE_SHARDS: usize = 16;

/// Recorded uses of blocks in one shard: block address → `(device, stream)`s.
type UseShard = Mutex<HashMap<u64, Vec<(usize, StreamId)>>>;

/// One device index: its pool (or why it could not be made) and the address range of its blocks.
struct Slot {
    pool: OnceLock<Result<Pool>>,
    bounds: AddressBounds,
    events: EventSpares,
}

impl Slot {
    fn new() -> Self {
        Slot {
            pool: OnceLock::new(),
            bounds: AddressBounds::new(),
            events: EventSpares::new(),
        }
    }

    fn created(&self) -> Option<&Pool> {
        self.pool.get().and_then(|r| r.as_ref().ok())
    }

    #[inline]
    fn note(&self, ptr: u64, size: u64) {
        self.bounds.note(ptr, size);
    }

    #[inline]
    fn contains(&self, ptr: u64) -> bool {
        self.bounds.contains(ptr)
    }

    fn take_event(&self, dev: &dyn Device) -> std::result::Result<EventHandle, DeviceError> {
        self.events.take(dev)
    }

    fn give_event(&self, event: EventHandle) {
        self.events.give(event);
    }
}

/// The range `[lo, hi)` of the addresses a device ever handed out: a free is routed to the device whose
/// range holds its pointer (`#devices` pairs of relaxed loads). Used by [`Pools`] and by the PyTorch
/// plug-in's registry.
#[derive(Debug)]
pub struct AddressBounds {
    /// Lowest address ever handed out (`u64::MAX` before the first).
    lo: AtomicU64,
    /// One past the highest byte ever handed out (0 before the first).
    hi: AtomicU64,
}

impl Default for AddressBounds {
    fn default() -> Self {
        Self::new()
    }
}

impl AddressBounds {
    /// No address yet.
    pub const fn new() -> Self {
        AddressBounds {
            lo: AtomicU64::new(u64::MAX),
            hi: AtomicU64::new(0),
        }
    }

    /// Widen the range to hold `[ptr, ptr + size)`. Relaxed is enough: a free of `ptr` on another thread
    /// got the pointer through some synchronization after this call, and coherence makes it see these
    /// stores (or later, wider ones).
    #[inline]
    pub fn note(&self, ptr: u64, size: u64) {
        if ptr < self.lo.load(Relaxed) {
            self.lo.fetch_min(ptr, Relaxed);
        }
        let end = ptr.saturating_add(size);
        if end > self.hi.load(Relaxed) {
            self.hi.fetch_max(end, Relaxed);
        }
    }

    /// Whether `ptr` lies in the range.
    #[inline]
    pub fn contains(&self, ptr: u64) -> bool {
        self.lo.load(Relaxed) <= ptr && ptr < self.hi.load(Relaxed)
    }
}

/// Spare events of one device, for ordering a free after work on other streams (an event can be
/// re-recorded as soon as a `stream_wait_event` on it was issued: the wait captures the record made
/// before it). Used by [`Pools`] and by the PyTorch plug-in's `record_stream` ordering.
#[derive(Debug, Default)]
pub struct EventSpares {
    spare: Mutex<Vec<EventHandle>>,
}

impl EventSpares {
    /// None yet.
    pub const fn new() -> Self {
        EventSpares {
            spare: Mutex::new(Vec::new()),
        }
    }

    /// A spare event, or a new one of `dev`.
    pub fn take(&self, dev: &dyn Device) -> std::result::Result<EventHandle, DeviceError> {
        let spare = self.spare.lock().pop();
        match spare {
            Some(e) => Ok(e),
            None => dev.event_create(),
        }
    }

    /// Destroy every spare event (the owner is going away).
    pub fn destroy_all(&self, dev: &dyn Device) {
        for ev in self.spare.lock().drain(..) {
            if let Err(e) = dev.event_destroy(ev) {
                log::error!("genpool: destroying an event at drop: {e}");
            }
        }
    }

    /// Give `event` back for reuse.
    pub fn give(&self, event: EventHandle) {
        self.spare.lock().push(event);
    }

    /// Make `stream` of `dev` wait for the work queued so far on its stream `other`: a block freed on
    /// `stream` and used on `other` is then not reused before that work is done.
    pub fn order_after(
        &self,
        dev: &dyn Device,
        other: StreamId,
        stream: StreamId,
    ) -> std::result::Result<(), DeviceError> {
        let ev = self.take(dev)?;
        let res = dev
            .event_record(ev, other)
            .and_then(|()| dev.stream_wait_event(stream, ev));
        self.give(ev);
        res
    }
}

/// A block held back until work on peer devices is done.
struct Deferred {
    owner: usize,
    ptr: u64,
    size: u64,
    stream: StreamId,
    /// `(device, event)`: each recorded on the peer stream that used the block.
    events: Vec<(usize, EventHandle)>,
}

/// What a [`Pools::free`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Freed {
    /// The device that owns the block.
    pub device: usize,
    /// Bytes the block spanned.
    pub size: u64,
    /// True when the block is held back until peer-device work recorded by [`Pools::record_use`]
    /// completes (it is then still counted live in its pool).
    pub deferred: bool,
}

/// Counters of the multi-device layer, plus each device's own statistics.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct PoolsStats {
    /// Per device index: its pool's statistics, `None` for a device with no pool yet (or one that
    /// failed to open).
    pub devices: Vec<Option<PoolStats>>,
    /// Frees whose owner was not found by address.
    pub unrouted_frees: u64,
    /// Stream waits issued for uses on other streams of the owning device.
    pub stream_waits: u64,
    /// Frees held back for peer-device uses, in total.
    pub deferred_frees: u64,
    /// Blocks held back now.
    pub deferred_pending: usize,
}

/// One [`Pool`] per device index, created lazily from a [`DeviceFactory`]. `Send + Sync`.
pub struct Pools {
    slots: Box<[Slot]>,
    factory: Box<DeviceFactory>,
    cfg: Config,
    /// Recorded uses: block address → `(device, stream)`s.
    uses: [UseShard; USE_SHARDS],
    /// Blocks with recorded uses (the free path reads this first).
    used_blocks: AtomicUsize,
    deferred: Mutex<Vec<Deferred>>,
    /// `deferred.len()`, readable without the lock.
    deferred_len: AtomicUsize,
    deferred_total: AtomicU64,
    unrouted: AtomicU64,
    stream_waits: AtomicU64,
}

impl std::fmt::Debug for Pools {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pools")
            .field("count", &self.slots.len())
            .field("cfg", &self.cfg)
            .finish()
    }
}

fn use_shard(ptr: u64) -> usize {
    ((ptr >> 9).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 60) as usize % USE_SHARDS
}

/// A simulated device of ordinal `i` whose addresses never meet another ordinal's.
/// Device `index` of `kind`: CUDA through [`gen_device::open`]; simulated (also `Auto`'s fallback
/// without a driver) with `sim_capacity` bytes and an address range of its own
/// ([`gen_device::sim::ORDINAL_STRIDE`] apart), so frees can be routed by address.
pub fn open_device(
    kind: DeviceKind,
    index: usize,
    sim_capacity: u64,
) -> std::result::Result<Arc<dyn Device>, DeviceError> {
    match kind {
        DeviceKind::Sim => sim_device(index, sim_capacity),
        DeviceKind::Cuda => gen_device::open(DeviceKind::Cuda, index),
        DeviceKind::Auto => match gen_device::open(DeviceKind::Cuda, index) {
            Err(DeviceError::NoDriver(why)) => {
                log::info!("genpool: no CUDA ({why}); using the simulated device");
                sim_device(index, sim_capacity)
            }
            other => other,
        },
    }
}

fn sim_device(i: usize, capacity: u64) -> std::result::Result<Arc<dyn Device>, DeviceError> {
    let off = (i as u64)
        .checked_mul(gen_device::sim::ORDINAL_STRIDE)
        .ok_or_else(|| DeviceError::InvalidArgument {
            call: "Pools::sim",
            detail: format!("ordinal {i} has no address range"),
        })?;
    Ok(Arc::new(
        gen_device::sim::SimConfig::new()
            .ordinal(i)
            .capacity(capacity)
            .address_offset(off)
            .build()?,
    ))
}

impl Pools {
    /// `count` device indices, each device made by `factory` on its first use and given a pool with
    /// `cfg`. A factory or pool failure is remembered: later calls for that device return it again.
    pub fn new(
        count: usize,
        cfg: Config,
        factory: impl Fn(usize) -> std::result::Result<Arc<dyn Device>, DeviceError>
            + Send
            + Sync
            + 'static,
    ) -> Self {
        Pools {
            slots: (0..count).map(|_| Slot::new()).collect(),
            factory: Box::new(factory),
            cfg,
            uses: std::array::from_fn(|_| Mutex::new(HashMap::new())),
            used_blocks: AtomicUsize::new(0),
            deferred: Mutex::new(Vec::new()),
            deferred_len: AtomicUsize::new(0),
            deferred_total: AtomicU64::new(0),
            unrouted: AtomicU64::new(0),
            stream_waits: AtomicU64::new(0),
        }
    }

    /// `count` simulated devices of `capacity` bytes each, with disjoint address ranges.
    pub fn sim(count: usize, capacity: u64, cfg: Config) -> Self {
        Pools::new(count, cfg, move |i| sim_device(i, capacity))
    }

    /// `count` devices of `kind`: CUDA devices through [`gen_device::open`]; simulated ones (also `Auto`'s
    /// fallback without a driver) with the default capacity and disjoint address ranges.
    pub fn open(kind: DeviceKind, count: usize, cfg: Config) -> Self {
        let capacity = gen_device::sim::DEFAULT_CAPACITY;
        Pools::new(count, cfg, move |i| open_device(kind, i, capacity))
    }

    /// Number of device indices.
    pub fn count(&self) -> usize {
        self.slots.len()
    }

    fn slot(&self, device: usize) -> Result<&Slot> {
        self.slots.get(device).ok_or(GenpoolError::InvalidDevice {
            ordinal: device,
            count: self.slots.len(),
        })
    }

    /// Device `device`'s pool, created on first use.
    pub fn pool(&self, device: usize) -> Result<&Pool> {
        let slot = self.slot(device)?;
        let res = slot.pool.get_or_init(|| {
            let dev = (self.factory)(device)?;
            Pool::new(dev, self.cfg.clone())
        });
        match res {
            Ok(p) => Ok(p),
            Err(e) => Err(e.clone()),
        }
    }

    /// Device `device`'s pool if it was created (and succeeded); never creates one.
    pub fn existing(&self, device: usize) -> Result<Option<&Pool>> {
        Ok(self.slot(device)?.created())
    }

    /// Allocate `size` bytes from device `device`'s tiers for use on `stream` (a stream of that device),
    /// whatever the calling thread's current device is. See [`Pool::alloc`]; an out-of-memory with
    /// blocks held back for peer work first waits for that work, releases them and retries once.
    pub fn alloc(&self, device: usize, size: u64, stream: StreamId, hint: Hint) -> Result<Block> {
        let pool = self.pool(device)?;
        if self.deferred_len.load(Relaxed) != 0 {
            self.poll_deferred();
        }
        let block = match pool.alloc(size, stream, hint) {
            Err(e) if e.is_oom() && self.deferred_len.load(Relaxed) != 0 => {
                self.flush_deferred()?;
                pool.alloc(size, stream, hint)?
            }
            other => other?,
        };
        self.slots[device].note(block.ptr, block.size);
        Ok(block)
    }

    /// The device whose pool holds the live block at `ptr`, if any. At most `#devices` range checks,
    /// plus pool lookups only where ranges overlap.
    pub fn owner(&self, ptr: u64) -> Option<usize> {
        self.route(ptr).filter(|&d| {
            self.slots[d]
                .created()
                .is_some_and(|p| p.lookup(ptr).is_some())
        })
    }

    /// The device whose range holds `ptr`: the only candidate, or, where ranges overlap, the first whose
    /// pool knows the block (else the first candidate, which then reports the fault).
    #[inline]
    fn route(&self, ptr: u64) -> Option<usize> {
        let mut first = None;
        for (i, s) in self.slots.iter().enumerate() {
            if s.contains(ptr) {
                if first.is_some() {
                    return self.route_overlapping(ptr).or(first);
                }
                first = Some(i);
            }
        }
        first
    }

    #[cold]
    fn route_overlapping(&self, ptr: u64) -> Option<usize> {
        self.slots
            .iter()
            .position(|s| s.contains(ptr) && s.created().is_some_and(|p| p.lookup(ptr).is_some()))
    }

    /// Free the block at `ptr` on `stream` (a stream of the owning device), whichever device owns it —
    /// found by address. Blocks with uses recorded by [`Pools::record_use`] are ordered after them (see
    /// the module doc). Null, unknown and double frees are [`GenpoolError::InvalidFree`] and change
    /// nothing.
    pub fn free(&self, ptr: u64, stream: StreamId) -> Result<Freed> {
        if ptr == 0 {
            return Err(GenpoolError::InvalidFree {
                ptr,
                fault: FreeFault::Null,
            });
        }
        if self.deferred_len.load(Relaxed) != 0 {
            self.poll_deferred();
            if self.deferred.lock().iter().any(|d| d.ptr == ptr) {
                return Err(GenpoolError::InvalidFree {
                    ptr,
                    fault: FreeFault::DoubleFree,
                });
            }
        }
        let Some(owner) = self.route(ptr) else {
            self.unrouted.fetch_add(1, Relaxed);
            return Err(GenpoolError::InvalidFree {
                ptr,
                fault: FreeFault::Unknown,
            });
        };
        // A device's range is non-empty only once its pool handed out a block.
        let pool = self.slots[owner]
            .created()
            .expect("a device with an address range has a pool");
        if self.used_blocks.load(Relaxed) != 0 {
            if let Some(uses) = self.take_uses(ptr) {
                return self.free_after_uses(owner, pool, ptr, stream, uses);
            }
        }
        let size = pool.free(ptr, stream)?;
        Ok(Freed {
            device: owner,
            size,
            deferred: false,
        })
    }

    fn take_uses(&self, ptr: u64) -> Option<Vec<(usize, StreamId)>> {
        let uses = self.uses[use_shard(ptr)].lock().remove(&ptr)?;
        self.used_blocks.fetch_sub(1, Relaxed);
        Some(uses)
    }

    fn put_uses(&self, ptr: u64, uses: Vec<(usize, StreamId)>) {
        if self.uses[use_shard(ptr)].lock().insert(ptr, uses).is_none() {
            self.used_blocks.fetch_add(1, Relaxed);
        }
    }

    /// Say that the live block at `ptr` (of any device) is used on `stream` of device `device`: its free
    /// will not let the block be reused before the work queued on that stream up to the free completes.
    /// An invalid device is [`GenpoolError::InvalidDevice`]; a pointer that is not a live block is
    /// [`GenpoolError::InvalidFree`] with [`FreeFault::Unknown`]; neither changes anything.
    pub fn record_use(&self, ptr: u64, device: usize, stream: StreamId) -> Result<()> {
        self.pool(device)?;
        let deferred = self.deferred_len.load(Relaxed) != 0
            && self.deferred.lock().iter().any(|d| d.ptr == ptr);
        if deferred || self.owner(ptr).is_none() {
            return Err(GenpoolError::InvalidFree {
                ptr,
                fault: FreeFault::Unknown,
            });
        }
        let mut shard = self.uses[use_shard(ptr)].lock();
        let uses = shard.entry(ptr).or_insert_with(|| {
            self.used_blocks.fetch_add(1, Relaxed);
            Vec::new()
        });
        if !uses.contains(&(device, stream)) {
            uses.push((device, stream));
        }
        Ok(())
    }

    #[cold]
    fn free_after_uses(
        &self,
        owner: usize,
        pool: &Pool,
        ptr: u64,
        stream: StreamId,
        uses: Vec<(usize, StreamId)>,
    ) -> Result<Freed> {
        let Some(block) = pool.lookup(ptr) else {
            // Not live (cannot happen while uses are dropped with their block): let the pool say why.
            let size = pool.free(ptr, stream)?;
            return Ok(Freed {
                device: owner,
                size,
                deferred: false,
            });
        };
        let owner_dev = pool.device().clone();
        let mut peer_events = Vec::new();
        let res = (|| -> Result<()> {
            for &(d, s) in &uses {
                if d == owner {
                    if s != stream {
                        self.wait_same_device(owner, owner_dev.as_ref(), s, stream)?;
                    }
                } else {
                    // `record_use` created the peer's pool.
                    let peer = self.pool(d)?.device().clone();
                    let ev = self.slots[d].take_event(peer.as_ref())?;
                    if let Err(e) = peer.event_record(ev, s) {
                        self.slots[d].give_event(ev);
                        return Err(e.into());
                    }
                    peer_events.push((d, ev));
                }
            }
            Ok(())
        })();
        if let Err(e) = res {
            // Nothing was freed: keep the uses so a retry orders the free again.
            for (d, ev) in peer_events {
                self.slots[d].give_event(ev);
            }
            self.put_uses(ptr, uses);
            return Err(e);
        }
        if peer_events.is_empty() {
            let size = pool.free(ptr, stream)?;
            return Ok(Freed {
                device: owner,
                size,
                deferred: false,
            });
        }
        self.deferred.lock().push(Deferred {
            owner,
            ptr,
            size: block.size,
            stream,
            events: peer_events,
        });
        self.deferred_len.fetch_add(1, Relaxed);
        self.deferred_total.fetch_add(1, Relaxed);
        Ok(Freed {
            device: owner,
            size: block.size,
            deferred: true,
        })
    }

    /// Make `stream` of device `owner` wait for the work queued so far on its stream `other`.
    fn wait_same_device(
        &self,
        owner: usize,
        dev: &dyn Device,
        other: StreamId,
        stream: StreamId,
    ) -> Result<()> {
        self.slots[owner].events.order_after(dev, other, stream)?;
        self.stream_waits.fetch_add(1, Relaxed);
        Ok(())
    }

    /// Release held-back blocks whose peer work has completed. Returns how many were released. An
    /// event query that fails keeps its block held back (logged); [`Pools::flush_deferred`] reports it.
    pub fn poll_deferred(&self) -> usize {
        self.release_deferred(false).unwrap_or_else(|e| {
            log::error!("genpool: releasing held-back blocks: {e}");
            0
        })
    }

    /// Wait for the peer work of every held-back block and release them all. Returns how many were
    /// released; the first device error stops it (the blocks not yet released stay held back).
    pub fn flush_deferred(&self) -> Result<usize> {
        self.release_deferred(true)
    }

    fn release_deferred(&self, wait: bool) -> Result<usize> {
        let mut list = self.deferred.lock();
        let mut released = 0;
        let mut first_err = None;
        let mut i = 0;
        while i < list.len() {
            let done = list[i].events.iter().try_fold(true, |done, &(d, ev)| {
                let dev = self.slots[d]
                    .created()
                    .expect("a peer with an event has a pool")
                    .device();
                if wait {
                    dev.event_synchronize(ev).map(|()| done)
                } else {
                    dev.event_query(ev).map(|c| done && c)
                }
            });
            match done {
                Ok(true) => {
                    let d = list.swap_remove(i);
                    self.deferred_len.fetch_sub(1, Relaxed);
                    for (dev, ev) in d.events {
                        self.slots[dev].give_event(ev);
                    }
                    let pool = self.slots[d.owner]
                        .created()
                        .expect("a held-back block's owner has a pool");
                    if let Err(e) = pool.free(d.ptr, d.stream) {
                        log::error!(
                            "genpool: freeing held-back block {:#x} ({} B): {e}",
                            d.ptr,
                            d.size
                        );
                    }
                    released += 1;
                }
                Ok(false) => i += 1,
                Err(e) => {
                    first_err.get_or_insert(e);
                    if wait {
                        break;
                    }
                    i += 1;
                }
            }
        }
        match first_err {
            Some(e) => Err(e.into()),
            None => Ok(released),
        }
    }

    /// Device `device`'s statistics (all zeros for a device with no pool yet).
    pub fn stats(&self, device: usize) -> Result<PoolStats> {
        Ok(self
            .existing(device)?
            .map_or_else(PoolStats::default, Pool::stats))
    }

    /// Every device's statistics and the multi-device counters.
    pub fn all_stats(&self) -> PoolsStats {
        PoolsStats {
            devices: self
                .slots
                .iter()
                .map(|s| s.created().map(Pool::stats))
                .collect(),
            unrouted_frees: self.unrouted.load(Relaxed),
            stream_waits: self.stream_waits.load(Relaxed),
            deferred_frees: self.deferred_total.load(Relaxed),
            deferred_pending: self.deferred_len.load(Relaxed),
        }
    }

    /// Release what can be released without waiting, then trim every device's pool. Returns the bytes of
    /// reservation released.
    pub fn trim(&self) -> u64 {
        self.poll_deferred();
        self.slots
            .iter()
            .filter_map(Slot::created)
            .map(Pool::trim)
            .sum()
    }
}

impl Drop for Pools {
    fn drop(&mut self) {
        if let Err(e) = self.flush_deferred() {
            log::error!("genpool: held-back blocks at drop: {e}");
        }
        for s in self.slots.iter() {
            if let Some(p) = s.created() {
                s.events.destroy_all(p.device().as_ref());
            }
        }
    }
}
