//! Several devices behind one router: one [`Pool`] per device index, created on first use, numbered
//! secondary engines beside it, frees routed by address, and uses on other streams ordered before reuse.
//!
//! - [`Pools::alloc`] serves device `d`'s request from `d`'s own engine whatever device the calling
//!   thread has current (the engine never looks at the thread's device). The engine is made by the
//!   router's [`Opener`] (a device factory and a configuration for [`Pools::new`]; the PyTorch plug-in's
//!   own, which reads its environment, for its process-wide router).
//! - [`Pools::free`] takes the pointer only: each device's engines own disjoint address ranges (unified
//!   virtual addressing on CUDA; [`gen_device::sim::ORDINAL_STRIDE`] offsets on the simulator), so the
//!   owner is found by address. Every device keeps the bounding range `[lo, hi)` of the blocks it ever
//!   handed out in two atomics, all devices' side by side; a free takes the first device whose range
//!   holds the pointer, or [`Pools::free_near`]'s guess when its range does. Once two devices' ranges
//!   meet (noticed when a range widens), the owner is decided by [`Pool::lookup`] among the candidates.
//! - **Secondary engines** ([`Engine`], [`Pools::add_engine`]): engines of their own over a device's
//!   device and configuration, numbered by the caller — the plug-in's private pools (CUDA graphs,
//!   `MemPool`s) and tags (sleep / wake). Their blocks and pages serve nobody else; frees find them by
//!   address like the rest (checked first, only while any exists). A released engine
//!   ([`Pools::release_engine`]) takes no allocation and is dropped with its last block.
//! - [`Pools::record_use`] says a block is used on a stream of some device (peer access enabled by the
//!   caller, or a second stream of the owner — PyTorch's `record_stream`). At free, a use on another
//!   stream of the owner is handled as [`RecordStream`] says (`Config::record_stream`): by default as
//!   PyTorch's own allocator does — nothing if that stream is idle (one `cuStreamQuery`), else an
//!   event recorded there and the block held back; with `wait`, the free's stream waits for an event
//!   recorded on that stream (where the event calls fail, the device is synchronized instead). A use
//!   on a *peer* device records an event on the peer's stream and the block is held back. A held-back
//!   block is still live in its engine until its events complete; the next [`Pools::alloc`] or
//!   [`Pools::free`] that finds them complete releases it (a poll that found none complete puts the
//!   next off by 1 … 64 µs), as do [`Pools::poll_deferred`] and [`Pools::flush_deferred`] (which
//!   waits); an allocation that runs out of memory waits for them and retries once. While a capture
//!   is underway nothing is polled or waited for (CUDA refuses it), and a free after uses is ordered by
//!   a wait the graph records.
//!
//! The per-call words — device count, whether any secondary engine, recorded use or held-back block
//! exists, whether ranges meet — share one cache line; while none of those exists the router adds a
//! handful of relaxed loads of that line and the device's range to the engine's own call. The router can
//! live in a `static` ([`Pools::with_opener`] is `const`): slots are an array of [`MAX_DEVICES`].

use std::collections::HashMap;
use std::sync::atomic::{
    fence, AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed, Ordering::SeqCst,
};
use std::sync::{Arc, OnceLock};

use gen_device::{Device, DeviceError, DeviceKind, EventHandle, StreamId};
use parking_lot::{Mutex, RwLock};

use crate::error::{FreeFault, GenpoolError, Result};
use crate::{Block, Config, Hint, LiveBlock, Pool, PoolStats, RecordStream};

/// The most device indices one router serves (its slots are an array).
pub const MAX_DEVICES: usize = 64;

/// Makes the device of an index: `gen_device::open(kind, i)`, or a closure building simulated devices.
pub type DeviceFactory =
    dyn Fn(usize) -> std::result::Result<Arc<dyn Device>, DeviceError> + Send + Sync;

/// How a router makes the engine of a device index, and the errors its callers see.
pub trait Opener: Send + Sync {
    /// What the router's calls return on failure; a failed open is remembered as one.
    type Error: From<GenpoolError> + Clone + Send + Sync;

    /// The engine of device `index` (called once per index: a failure is remembered).
    fn open(&self, index: usize) -> std::result::Result<Pool, Self::Error>;

    /// The error for a device index at or past `count`.
    fn invalid_device(&self, index: usize, count: usize) -> Self::Error {
        GenpoolError::InvalidDevice {
            ordinal: index,
            count,
        }
        .into()
    }
}

/// The [`Opener`] of [`Pools::new`]: a [`DeviceFactory`] and one configuration for every device.
pub struct Factory {
    make: Box<DeviceFactory>,
    cfg: Config,
}

impl Opener for Factory {
    type Error = GenpoolError;

    fn open(&self, index: usize) -> Result<Pool> {
        Pool::new((self.make)(index)?, self.cfg.clone())
    }
}

/// Independently locked shards of the recorded-use table.
const USE_SHARDS: usize = 16;

/// Recorded uses of blocks in one shard: block address → `(device, stream)`s; `None` until first used
/// (so that a router can be built in a `const`).
type UseShard = Mutex<Option<HashMap<u64, Vec<(usize, StreamId)>>>>;

/// The range `[lo, hi)` of the addresses an engine ever handed out: a free is routed to the engine whose
/// range holds its pointer (a pair of relaxed loads).
#[derive(Debug)]
struct AddressBounds {
    /// Lowest address ever handed out (`u64::MAX` before the first).
    lo: AtomicU64,
    /// One past the highest byte ever handed out (0 before the first).
    hi: AtomicU64,
}

impl AddressBounds {
    const fn new() -> Self {
        AddressBounds {
            lo: AtomicU64::new(u64::MAX),
            hi: AtomicU64::new(0),
        }
    }

    /// Widen the range to hold `[ptr, ptr + size)`; true when it grew. Relaxed is enough: a free of
    /// `ptr` on another thread got the pointer through some synchronization after this call, and
    /// coherence makes it see these stores (or later, wider ones).
    #[inline]
    fn note(&self, ptr: u64, size: u64) -> bool {
        let mut grew = false;
        if ptr < self.lo.load(Relaxed) {
            self.lo.fetch_min(ptr, Relaxed);
            grew = true;
        }
        let end = ptr.saturating_add(size);
        if end > self.hi.load(Relaxed) {
            self.hi.fetch_max(end, Relaxed);
            grew = true;
        }
        grew
    }

    /// Whether `ptr` lies in the range.
    #[inline]
    fn contains(&self, ptr: u64) -> bool {
        self.lo.load(Relaxed) <= ptr && ptr < self.hi.load(Relaxed)
    }

    /// Whether two ranges share an address.
    fn meets(&self, other: &AddressBounds) -> bool {
        self.lo.load(SeqCst) < other.hi.load(SeqCst) && other.lo.load(SeqCst) < self.hi.load(SeqCst)
    }
}

/// Spare events of one device, for ordering a free after work on other streams (an event can be
/// re-recorded as soon as a `stream_wait_event` on it was issued: the wait captures the record made
/// before it).
#[derive(Debug)]
struct EventSpares {
    spare: Mutex<Vec<EventHandle>>,
}

impl EventSpares {
    const fn new() -> Self {
        EventSpares {
            spare: Mutex::new(Vec::new()),
        }
    }

    /// A spare event, or a new one of `dev`.
    fn take(&self, dev: &dyn Device) -> std::result::Result<EventHandle, DeviceError> {
        let spare = self.spare.lock().pop();
        match spare {
            Some(e) => Ok(e),
            None => dev.event_create(),
        }
    }

    /// Destroy every spare event (the owner is going away).
    fn destroy_all(&self, dev: &dyn Device) {
        for ev in self.spare.lock().drain(..) {
            if let Err(e) = dev.event_destroy(ev) {
                log::error!("genpool: destroying an event at drop: {e}");
            }
        }
    }

    /// Give `event` back for reuse.
    fn give(&self, event: EventHandle) {
        self.spare.lock().push(event);
    }

    /// Make `stream` of `dev` wait for the work queued so far on its stream `other`.
    fn order_after(
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

/// A secondary engine of a device ([`Pools::add_engine`]): a [`Pool`] of its own over the device and
/// configuration of the device's default engine, under a number its owner chose (never 0, which names
/// the default engine in [`Freed::engine`]).
pub struct Engine {
    id: u64,
    pool: Pool,
    /// The addresses it ever handed out (frees are routed by address).
    bounds: AddressBounds,
    /// Released by its owner: no new allocations; dropped once its last block is freed.
    released: AtomicBool,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("id", &self.id)
            .field("released", &self.is_released())
            .finish_non_exhaustive()
    }
}

impl Engine {
    /// Its number.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The engine itself (statistics, trimming, sleep; allocate through [`Engine::alloc`], which
    /// remembers the block's address for the frees).
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Whether its owner released it ([`Pools::release_engine`]).
    pub fn is_released(&self) -> bool {
        self.released.load(SeqCst)
    }

    /// Allocate from this engine (see [`Pool::alloc`]); [`Pools::free`] finds the block by address.
    pub fn alloc(&self, size: u64, stream: StreamId, hint: Hint) -> Result<Block> {
        let b = self.pool.alloc(size, stream, hint)?;
        self.bounds.note(b.ptr, b.size);
        Ok(b)
    }

    /// Whether the live block `ptr` is this engine's.
    fn owns(&self, ptr: u64) -> bool {
        self.bounds.contains(ptr) && self.pool.lookup(ptr).is_some()
    }
}

/// One device index: its default engine (or why it could not be made), its secondary engines, and what
/// ordering frees after other streams needs.
struct Slot<E> {
    pool: OnceLock<std::result::Result<Pool, E>>,
    engines: RwLock<Vec<Arc<Engine>>>,
    events: EventSpares,
    /// `stream_wait_event`s issued for frees of blocks used on other streams of this device.
    stream_waits: AtomicU64,
    /// Frees ordered by a whole-device synchronize because an event call failed.
    sync_fallbacks: AtomicU64,
    /// Streams of uses asked whether they were idle at a free ([`RecordStream::Hold`]).
    use_queries: AtomicU64,
}

impl<E> Slot<E> {
    const fn new() -> Self {
        Slot {
            pool: OnceLock::new(),
            engines: RwLock::new(Vec::new()),
            events: EventSpares::new(),
            stream_waits: AtomicU64::new(0),
            sync_fallbacks: AtomicU64::new(0),
            use_queries: AtomicU64::new(0),
        }
    }

    #[inline]
    fn created(&self) -> Option<&Pool> {
        self.pool.get().and_then(|r| r.as_ref().ok())
    }
}

/// What every call reads, in one cache line.
#[repr(C, align(64))]
struct Hot {
    /// Device indices served (at most [`MAX_DEVICES`]).
    count: AtomicUsize,
    /// One past the highest index whose default engine was made: routing looks no further.
    high: AtomicUsize,
    /// Secondary engines, all devices together.
    engines: AtomicUsize,
    /// Blocks with recorded uses.
    used_blocks: AtomicUsize,
    /// Blocks held back for work on other streams (peer devices', or the owner's: `record_stream`).
    deferred_len: AtomicUsize,
    /// When the held-back blocks may be polled next (ns on [`clock_ns`]'s clock): a poll that released
    /// nothing puts the next one 1, 2 … [`POLL_BACKOFF_MAX_NS`] / 1 µs µs later (`poll_backoff_ns`
    /// says how far), one that released some lets the next call poll. Relaxed loads and stores: under
    /// threads a poll can only come a little early or late.
    poll_after: AtomicU64,
    poll_backoff_ns: AtomicU64,
    /// Two devices' address ranges meet: frees are routed by lookup among the candidates.
    overlap: AtomicBool,
}

/// Where a block lives: a device's default engine or one of its secondary engines.
enum Home<'a> {
    Default(&'a Pool),
    Engine(Arc<Engine>),
}

impl Home<'_> {
    fn pool(&self) -> &Pool {
        match self {
            Home::Default(p) => p,
            Home::Engine(e) => &e.pool,
        }
    }

    fn id(&self) -> u64 {
        match self {
            Home::Default(_) => 0,
            Home::Engine(e) => e.id,
        }
    }
}

/// The longest a poll of the held-back blocks that released nothing puts off the next (an event query
/// is ~0.2 µs; a block whose event has completed stays held at most this long past it while calls come).
const POLL_BACKOFF_MAX_NS: u64 = 64_000;

/// Nanoseconds since the first call (a monotonic clock for the poll backoff).
fn clock_ns() -> u64 {
    static EPOCH: OnceLock<std::time::Instant> = OnceLock::new();
    u64::try_from(
        EPOCH
            .get_or_init(std::time::Instant::now)
            .elapsed()
            .as_nanos(),
    )
    .unwrap_or(u64::MAX)
}

/// A block held back until work on other streams — of peer devices, or of its own device under
/// [`RecordStream::Hold`] — is done.
struct Deferred {
    owner: usize,
    engine: Option<Arc<Engine>>,
    ptr: u64,
    size: u64,
    /// The stream to free it on (`None`: its own, [`Pool::free_owned`]).
    stream: Option<StreamId>,
    /// `(device, stream, event)`: each recorded on a stream that used the block, at its free. Events
    /// of one stream complete in the order they were recorded, and the list is in the order of the
    /// frees, so a poll that finds one pending asks no later event of that stream.
    events: Vec<(usize, StreamId, EventHandle)>,
}

/// The held-back blocks, in the order of their frees, and their addresses (a free or a recorded use
/// checks whether its block is held with one look-up, however many are).
struct Held {
    list: Vec<Deferred>,
    ptrs: std::collections::HashSet<u64, HeldHasher>,
}

/// Addresses of held blocks are not attacker-chosen: the default hasher with fixed keys, which a
/// `static` router can build in a const context.
type HeldHasher = std::hash::BuildHasherDefault<std::collections::hash_map::DefaultHasher>;

impl Held {
    const fn new() -> Self {
        Held {
            list: Vec::new(),
            ptrs: std::collections::HashSet::with_hasher(HeldHasher::new()),
        }
    }

    fn holds(&self, ptr: u64) -> bool {
        !self.ptrs.is_empty() && self.ptrs.contains(&ptr)
    }

    fn push(&mut self, d: Deferred) {
        self.ptrs.insert(d.ptr);
        self.list.push(d);
    }
}

/// What a [`Pools::free`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Freed {
    /// The device that owns the block.
    pub device: usize,
    /// The secondary engine that held it ([`Engine::id`]); 0 for the device's default engine.
    pub engine: u64,
    /// Bytes the block spanned.
    pub size: u64,
    /// True when the block is held back until work on other streams recorded by
    /// [`Pools::record_use`] completes (it is then still counted live in its engine).
    pub deferred: bool,
}

/// Counters of the multi-device layer, plus each device's own statistics.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct PoolsStats {
    /// Per device index: its default engine's statistics, `None` for a device with none yet (or one
    /// that failed to open).
    pub devices: Vec<Option<PoolStats>>,
    /// Frees whose owner was not found by address.
    pub unrouted_frees: u64,
    /// Stream waits issued for uses on other streams of the owning device.
    pub stream_waits: u64,
    /// Frees ordered by a device synchronize because an event call failed.
    pub sync_fallbacks: u64,
    /// Streams of uses on the owning device asked at a free whether they were idle
    /// ([`RecordStream::Hold`]; an idle one needs neither a wait nor a hold).
    pub use_queries: u64,
    /// Blocks with recorded uses now.
    pub recorded_blocks: usize,
    /// Frees held back for uses on other streams (peer devices', or the owner's under
    /// [`RecordStream::Hold`]), in total.
    pub deferred_frees: u64,
    /// Blocks held back now.
    pub deferred_pending: usize,
}

/// One engine per device index, created lazily by an [`Opener`], with secondary engines, frees routed
/// by address and recorded uses. `Send + Sync`. See the module doc.
pub struct Pools<O: Opener = Factory> {
    hot: Hot,
    /// Each device's range, side by side (a free reads one or a few of them).
    bounds: [AddressBounds; MAX_DEVICES],
    slots: [Slot<O::Error>; MAX_DEVICES],
    opener: O,
    /// Recorded uses: block address → `(device, stream)`s.
    uses: [UseShard; USE_SHARDS],
    deferred: Mutex<Held>,
    deferred_total: AtomicU64,
    unrouted: AtomicU64,
}

impl<O: Opener> std::fmt::Debug for Pools<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pools")
            .field("count", &self.count())
            .field("made", &self.existing_pools().count())
            .finish_non_exhaustive()
    }
}

fn use_shard(ptr: u64) -> usize {
    ((ptr >> 9).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 60) as usize % USE_SHARDS
}

fn unknown(ptr: u64) -> GenpoolError {
    GenpoolError::InvalidFree {
        ptr,
        fault: FreeFault::Unknown,
    }
}

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

/// A simulated device of ordinal `i` whose addresses never meet another ordinal's. It takes stream
/// handles it did not make as streams ([`gen_device::sim::SimConfig::adopt_streams`]): the router serves
/// callers across a C ABI (the PyTorch plug-in) whose streams come from CUDA, never from this device.
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
            .adopt_streams(true)
            .build()?,
    ))
}

impl Pools<Factory> {
    /// `count` device indices (at most [`MAX_DEVICES`]), each device made by `factory` on its first use
    /// and given a pool with `cfg`. A factory or pool failure is remembered: later calls for that device
    /// return it again.
    pub fn new(
        count: usize,
        cfg: Config,
        factory: impl Fn(usize) -> std::result::Result<Arc<dyn Device>, DeviceError>
            + Send
            + Sync
            + 'static,
    ) -> Self {
        let pools = Pools::with_opener(Factory {
            make: Box::new(factory),
            cfg,
        });
        pools.set_count(count);
        pools
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
}

impl<O: Opener> Pools<O> {
    /// A router of [`MAX_DEVICES`] indices whose engines `opener` makes; `const`, so that it can be a
    /// `static`. Nothing is opened before first use.
    pub const fn with_opener(opener: O) -> Self {
        Pools {
            hot: Hot {
                count: AtomicUsize::new(MAX_DEVICES),
                high: AtomicUsize::new(0),
                engines: AtomicUsize::new(0),
                used_blocks: AtomicUsize::new(0),
                deferred_len: AtomicUsize::new(0),
                poll_after: AtomicU64::new(0),
                poll_backoff_ns: AtomicU64::new(0),
                overlap: AtomicBool::new(false),
            },
            bounds: [const { AddressBounds::new() }; MAX_DEVICES],
            slots: [const { Slot::new() }; MAX_DEVICES],
            opener,
            uses: [const { Mutex::new(None) }; USE_SHARDS],
            deferred: Mutex::new(Held::new()),
            deferred_total: AtomicU64::new(0),
            unrouted: AtomicU64::new(0),
        }
    }

    /// Number of device indices served.
    #[inline]
    pub fn count(&self) -> usize {
        self.hot.count.load(Relaxed)
    }

    /// Serve `count` device indices from now on (at most [`MAX_DEVICES`]); engines already made stay,
    /// and their blocks are still freed.
    pub fn set_count(&self, count: usize) {
        self.hot.count.store(count.min(MAX_DEVICES), Relaxed);
    }

    #[inline]
    fn slot(&self, device: usize) -> std::result::Result<&Slot<O::Error>, O::Error> {
        let count = self.count();
        if device >= count {
            return Err(self.opener.invalid_device(device, count));
        }
        Ok(&self.slots[device])
    }

    /// Device `device`'s default engine, created on first use.
    #[inline]
    pub fn pool(&self, device: usize) -> std::result::Result<&Pool, O::Error> {
        match self.slot(device)?.pool.get() {
            Some(Ok(p)) => Ok(p),
            _ => self.open_slow(device),
        }
    }

    #[cold]
    fn open_slow(&self, device: usize) -> std::result::Result<&Pool, O::Error> {
        let res = self.slots[device].pool.get_or_init(|| {
            let made = self.opener.open(device);
            if made.is_ok() {
                // Before any of its blocks is handed out: routing looks up to `high`.
                self.hot.high.fetch_max(device + 1, SeqCst);
            }
            made
        });
        match res {
            Ok(p) => Ok(p),
            Err(e) => Err(e.clone()),
        }
    }

    /// Make `pool` device `device`'s default engine (tests, and callers that build engines themselves).
    /// `None` (and `pool` dropped) when the index is invalid or the device already has an engine (or a
    /// remembered failure).
    pub fn install(&self, device: usize, pool: Pool) -> Option<&Pool> {
        if device >= self.count() || self.slots[device].pool.set(Ok(pool)).is_err() {
            return None;
        }
        self.hot.high.fetch_max(device + 1, SeqCst);
        self.slots[device].created()
    }

    /// Device `device`'s default engine if it was created (and succeeded); never creates one.
    pub fn existing(&self, device: usize) -> std::result::Result<Option<&Pool>, O::Error> {
        Ok(self.slot(device)?.created())
    }

    /// Every default engine created so far, with its device index.
    pub fn existing_pools(&self) -> impl Iterator<Item = (usize, &Pool)> {
        let high = self.hot.high.load(SeqCst);
        self.slots[..high]
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.created().map(|p| (i, p)))
    }

    /// Allocate `size` bytes from device `device`'s default engine for use on `stream` (a stream of that
    /// device), whatever the calling thread's current device is. See [`Pool::alloc`]; an out-of-memory
    /// with blocks held back for peer work first waits for that work, releases them and retries once.
    #[inline]
    pub fn alloc(
        &self,
        device: usize,
        size: u64,
        stream: StreamId,
        hint: Hint,
    ) -> std::result::Result<Block, O::Error> {
        self.alloc_admitted(device, size, stream, hint, |_| Ok(()))
    }

    /// [`Pools::alloc`], refused without a change when `admit` refuses it (given the device's engine
    /// before the allocation: a cap on the caller's side).
    #[inline]
    pub fn alloc_admitted(
        &self,
        device: usize,
        size: u64,
        stream: StreamId,
        hint: Hint,
        admit: impl FnOnce(&Pool) -> std::result::Result<(), O::Error>,
    ) -> std::result::Result<Block, O::Error> {
        let pool = self.pool(device)?;
        admit(pool)?;
        if self.hot.deferred_len.load(Relaxed) != 0 {
            self.poll_deferred_due();
        }
        let block = match pool.alloc(size, stream, hint) {
            Err(e) if e.is_oom() && self.hot.deferred_len.load(Relaxed) != 0 => {
                self.release_deferred(true)?;
                pool.alloc(size, stream, hint)?
            }
            other => other?,
        };
        if self.bounds[device].note(block.ptr, block.size) {
            self.widened(device);
        }
        Ok(block)
    }

    /// Device `device`'s range grew: does it meet another device's now? (Cold: ranges grow with the
    /// engines' address space, not with each block.)
    #[cold]
    fn widened(&self, device: usize) {
        if self.hot.overlap.load(Relaxed) {
            return;
        }
        // Pairs with the other device's fence: of two ranges growing into each other at once, at least
        // one of the two checks sees the other's growth.
        fence(SeqCst);
        let high = self.hot.high.load(SeqCst);
        let mine = &self.bounds[device];
        if (0..high).any(|d| d != device && mine.meets(&self.bounds[d])) {
            log::info!("genpool: device {device}'s addresses meet another device's: frees are routed by lookup");
            self.hot.overlap.store(true, SeqCst);
        }
    }

    /// The device whose default engine or secondary engines hold the live block at `ptr`, if any.
    pub fn owner(&self, ptr: u64) -> Option<usize> {
        if self.hot.engines.load(Relaxed) != 0 {
            if let Some((d, _)) = self.engine_of(ptr) {
                return Some(d);
            }
        }
        self.candidates(ptr).find(|&d| {
            self.slots[d]
                .created()
                .is_some_and(|p| p.lookup(ptr).is_some())
        })
    }

    /// The devices whose ranges hold `ptr`, lowest index first.
    fn candidates(&self, ptr: u64) -> impl Iterator<Item = usize> + '_ {
        let high = self.hot.high.load(Relaxed);
        (0..high).filter(move |&d| self.bounds[d].contains(ptr))
    }

    /// The device whose range holds `ptr`: `near` when its range does, else the first that does; where
    /// ranges meet, the first candidate whose engine knows the block (else the first candidate, which then
    /// reports the fault).
    #[inline]
    fn route(&self, ptr: u64, near: Option<usize>) -> Option<usize> {
        if self.hot.overlap.load(Relaxed) {
            return self.route_overlapping(ptr);
        }
        if let Some(d) = near.filter(|&d| d < MAX_DEVICES && self.bounds[d].contains(ptr)) {
            return Some(d);
        }
        self.candidates(ptr).next()
    }

    #[cold]
    fn route_overlapping(&self, ptr: u64) -> Option<usize> {
        let first = self.candidates(ptr).next()?;
        self.owner(ptr).or(Some(first))
    }

    /// The secondary engine holding the live block at `ptr`, with its device.
    #[cold]
    fn engine_of(&self, ptr: u64) -> Option<(usize, Arc<Engine>)> {
        self.find_engine(|e| e.owns(ptr))
    }

    /// The first secondary engine (devices in order) that `pred` accepts, with its device.
    fn find_engine(&self, pred: impl Fn(&Engine) -> bool) -> Option<(usize, Arc<Engine>)> {
        let high = self.hot.high.load(SeqCst);
        self.slots[..high].iter().enumerate().find_map(|(d, s)| {
            s.engines
                .read()
                .iter()
                .find(|e| pred(e))
                .map(|e| (d, e.clone()))
        })
    }

    /// Free the block at `ptr` on `stream` (a stream of the owning device), whichever device and engine
    /// own it — found by address. Blocks with uses recorded by [`Pools::record_use`] are ordered after
    /// them (see the module doc). Null, unknown and double frees are [`GenpoolError::InvalidFree`] and
    /// change nothing.
    pub fn free(&self, ptr: u64, stream: StreamId) -> std::result::Result<Freed, O::Error> {
        self.free_in(ptr, None, Some(stream))
            .map(|(f, _)| f)
            .map_err(O::Error::from)
    }

    /// [`Pools::free`] with a guess at the owner (the device the caller was told; a wrong or invalid
    /// guess costs a range check).
    #[inline]
    pub fn free_near(
        &self,
        ptr: u64,
        device: usize,
        stream: StreamId,
    ) -> std::result::Result<Freed, O::Error> {
        self.free_in(ptr, Some(device), Some(stream))
            .map(|(f, _)| f)
            .map_err(O::Error::from)
    }

    /// Free the block at `ptr` on the stream it was allocated for ([`Pool::free_owned`]), wherever it
    /// lives, as [`Pools::free`]; also returns what the block was.
    #[inline(always)]
    pub fn free_owned(&self, ptr: u64) -> std::result::Result<(Freed, LiveBlock), O::Error> {
        self.free_in(ptr, None, None).map_err(O::Error::from)
    }

    // `free_in`, `free_at`, `free_now` and `Pool::free_block` are inlined into the caller: the block comes
    // back through three `Result`s, and each one returned through memory was copied with loads that
    // straddle the stores that wrote it (a failed store forward, ~12 cycles each; PyTorch's raw_delete
    // through `benches/host/abi_replay.c`, simulator: gpt2_generate_kv 100.6 → 98.0 ns a call).
    #[inline(always)]
    fn free_in(
        &self,
        ptr: u64,
        near: Option<usize>,
        stream: Option<StreamId>,
    ) -> Result<(Freed, LiveBlock)> {
        if ptr == 0 {
            return Err(GenpoolError::InvalidFree {
                ptr,
                fault: FreeFault::Null,
            });
        }
        if self.hot.deferred_len.load(Relaxed) != 0 {
            self.check_deferred(ptr)?;
        }
        if self.hot.engines.load(Relaxed) != 0 {
            if let Some((owner, e)) = self.engine_of(ptr) {
                return self.free_at(owner, Home::Engine(e), ptr, stream);
            }
        }
        let Some(owner) = self.route(ptr, near) else {
            return self.free_unrouted(ptr, near, stream);
        };
        // A device with an address range has an engine: its range is noted only after an allocation.
        let pool = self.slots[owner]
            .created()
            .expect("a device with an address range has an engine");
        match self.free_at(owner, Home::Default(pool), ptr, stream) {
            // The success path hands its values straight through (a match arm binding the whole result
            // made it a copy through memory).
            Ok(v) => Ok(v),
            Err(e) => self.free_refused(ptr, owner, stream, e),
        }
    }

    /// The default engine of `owner` refused `ptr`: an unknown pointer there may be another device's
    /// block where ranges meet (freed there); any other refusal stands.
    #[cold]
    fn free_refused(
        &self,
        ptr: u64,
        owner: usize,
        stream: Option<StreamId>,
        e: GenpoolError,
    ) -> Result<(Freed, LiveBlock)> {
        match e {
            GenpoolError::InvalidFree {
                fault: FreeFault::Unknown,
                ..
            } if self.owner(ptr).is_some_and(|d| d != owner) => self.free_rerouted(ptr, stream),
            e => Err(e),
        }
    }

    /// No device's range holds `ptr`: the fault is reported (and counted in its statistics) by a
    /// secondary engine whose range holds it (a double free), else by `near`'s engine if it has one,
    /// else the pointer is unknown to the router.
    #[cold]
    fn free_unrouted(
        &self,
        ptr: u64,
        near: Option<usize>,
        stream: Option<StreamId>,
    ) -> Result<(Freed, LiveBlock)> {
        if let Some((d, e)) = self.find_engine(|e| e.bounds.contains(ptr)) {
            return self.free_at(d, Home::Engine(e), ptr, stream);
        }
        let near = near.filter(|&d| d < MAX_DEVICES);
        if let Some((d, pool)) = near.and_then(|d| Some((d, self.slots[d].created()?))) {
            return self.free_at(d, Home::Default(pool), ptr, stream);
        }
        self.unrouted.fetch_add(1, Relaxed);
        Err(unknown(ptr))
    }

    /// The block was not in the engine its range pointed to (ranges began to meet while the free was
    /// routed): route it by lookup.
    #[cold]
    fn free_rerouted(&self, ptr: u64, stream: Option<StreamId>) -> Result<(Freed, LiveBlock)> {
        let owner = self.owner(ptr).ok_or_else(|| unknown(ptr))?;
        let pool = self.slots[owner].created().ok_or_else(|| unknown(ptr))?;
        self.free_at(owner, Home::Default(pool), ptr, stream)
    }

    /// Free `ptr` in `home`, after its recorded uses if it has any.
    #[inline(always)]
    fn free_at(
        &self,
        owner: usize,
        home: Home<'_>,
        ptr: u64,
        stream: Option<StreamId>,
    ) -> Result<(Freed, LiveBlock)> {
        if self.hot.used_blocks.load(Relaxed) != 0 {
            if let Some(uses) = self.take_uses(ptr) {
                return self.free_after_uses(owner, home, ptr, stream, uses);
            }
        }
        self.free_now(owner, &home, ptr, stream)
    }

    #[inline(always)]
    fn free_now(
        &self,
        owner: usize,
        home: &Home<'_>,
        ptr: u64,
        stream: Option<StreamId>,
    ) -> Result<(Freed, LiveBlock)> {
        let block = home.pool().free_block(ptr, stream)?;
        if let Home::Engine(e) = home {
            self.drop_if_done(owner, e);
        }
        let freed = Freed {
            device: owner,
            engine: home.id(),
            size: block.size,
            deferred: false,
        };
        Ok((freed, block))
    }

    /// A free while blocks are held back: release those whose work is done, and refuse a second free of
    /// one still held.
    #[cold]
    fn check_deferred(&self, ptr: u64) -> Result<()> {
        self.poll_deferred_due();
        if self.deferred.lock().holds(ptr) {
            return Err(GenpoolError::InvalidFree {
                ptr,
                fault: FreeFault::DoubleFree,
            });
        }
        Ok(())
    }

    fn take_uses(&self, ptr: u64) -> Option<Vec<(usize, StreamId)>> {
        let uses = self.uses[use_shard(ptr)].lock().as_mut()?.remove(&ptr)?;
        self.hot.used_blocks.fetch_sub(1, Relaxed);
        Some(uses)
    }

    fn put_uses(&self, ptr: u64, uses: Vec<(usize, StreamId)>) {
        let mut shard = self.uses[use_shard(ptr)].lock();
        if shard
            .get_or_insert_with(HashMap::new)
            .insert(ptr, uses)
            .is_none()
        {
            self.hot.used_blocks.fetch_add(1, Relaxed);
        }
    }

    /// Say that the live block at `ptr` (of any device or engine) is used on `stream` of device
    /// `device`: its free will not let the block be reused before the work queued on that stream up to
    /// the free completes. An invalid device is the opener's invalid-device error; a pointer that is not a
    /// live block is [`GenpoolError::InvalidFree`] with [`FreeFault::Unknown`]; neither changes anything.
    pub fn record_use(
        &self,
        ptr: u64,
        device: usize,
        stream: StreamId,
    ) -> std::result::Result<(), O::Error> {
        self.pool(device)?;
        let deferred = self.hot.deferred_len.load(Relaxed) != 0 && self.deferred.lock().holds(ptr);
        if deferred || self.owner(ptr).is_none() {
            return Err(unknown(ptr).into());
        }
        let mut shard = self.uses[use_shard(ptr)].lock();
        let uses = shard
            .get_or_insert_with(HashMap::new)
            .entry(ptr)
            .or_insert_with(|| {
                self.hot.used_blocks.fetch_add(1, Relaxed);
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
        home: Home<'_>,
        ptr: u64,
        stream: Option<StreamId>,
        uses: Vec<(usize, StreamId)>,
    ) -> Result<(Freed, LiveBlock)> {
        let Some(block) = home.pool().lookup_detailed(ptr) else {
            // Not live (cannot happen while uses are dropped with their block): let the engine say why.
            return self.free_now(owner, &home, ptr, stream);
        };
        let on = stream.unwrap_or(block.stream);
        let owner_dev = home.pool().device().clone();
        // Hold the block for the owner's other streams (PyTorch's rule) unless told to wait, or while a
        // capture is underway: no event may be polled then, and a wait is what the graph can record.
        let hold =
            home.pool().config().record_stream == RecordStream::Hold && !self.capture_underway();
        let mut events = Vec::new();
        let mut synced = false;
        let res = (|| -> Result<()> {
            for &(d, s) in &uses {
                if d == owner {
                    if s == on || synced {
                        continue;
                    }
                    if hold {
                        match self.hold_for(owner, owner_dev.as_ref(), s) {
                            Ok(None) => continue,
                            Ok(Some(ev)) => {
                                events.push((owner, s, ev));
                                continue;
                            }
                            Err(e) => log::debug!(
                                "genpool: holding {ptr:#x} for stream {s:#x} failed ({e}); \
                                 ordering its free after that stream instead"
                            ),
                        }
                    }
                    synced = self.wait_same_device(owner, owner_dev.as_ref(), s, on, ptr)?;
                } else {
                    let peer = self.slots[d]
                        .created()
                        .expect("record_use made the peer's engine")
                        .device()
                        .clone();
                    let ev = self.slots[d].events.take(peer.as_ref())?;
                    if let Err(e) = peer.event_record(ev, s) {
                        self.slots[d].events.give(ev);
                        return Err(e.into());
                    }
                    events.push((d, s, ev));
                }
            }
            Ok(())
        })();
        if let Err(e) = res {
            // Nothing was freed: keep the uses so a retry orders the free again.
            for (d, _, ev) in events {
                self.slots[d].events.give(ev);
            }
            self.put_uses(ptr, uses);
            return Err(e);
        }
        if events.is_empty() {
            return self.free_now(owner, &home, ptr, stream);
        }
        let freed = Freed {
            device: owner,
            engine: home.id(),
            size: block.size,
            deferred: true,
        };
        self.deferred.lock().push(Deferred {
            owner,
            engine: match home {
                Home::Engine(e) => Some(e),
                Home::Default(_) => None,
            },
            ptr,
            size: block.size,
            stream,
            events,
        });
        self.hot.deferred_len.fetch_add(1, Relaxed);
        self.deferred_total.fetch_add(1, Relaxed);
        // Poll at the next chance: the events just recorded may be the only ones held.
        self.hot.poll_after.store(0, Relaxed);
        self.hot.poll_backoff_ns.store(0, Relaxed);
        Ok((freed, block))
    }

    /// What a free under [`RecordStream::Hold`] needs for the owner's stream `other`: nothing when the
    /// stream is idle (every use queued there has run; one `cuStreamQuery`), else an event recorded
    /// there now, to be polled before the block is reused. An error: neither could be had.
    fn hold_for(
        &self,
        owner: usize,
        dev: &dyn Device,
        other: StreamId,
    ) -> Result<Option<EventHandle>> {
        let slot = &self.slots[owner];
        slot.use_queries.fetch_add(1, Relaxed);
        match dev.stream_query(other) {
            Ok(true) => return Ok(None),
            Ok(false) => {}
            // A failed question is taken as busy: the event answers for the stream.
            Err(e) => log::debug!("genpool: asking whether stream {other:#x} is idle: {e}"),
        }
        let ev = slot.events.take(dev)?;
        if let Err(e) = dev.event_record(ev, other) {
            slot.events.give(ev);
            return Err(e.into());
        }
        Ok(Some(ev))
    }

    /// Whether a capture is underway on any device with an engine (no event may be queried or waited
    /// for then: CUDA's global capture mode refuses those calls from every thread, and invalidates the
    /// capture).
    fn capture_underway(&self) -> bool {
        let high = self.hot.high.load(Relaxed).min(MAX_DEVICES);
        self.slots[..high]
            .iter()
            .filter_map(Slot::created)
            .any(|p| p.device().captures().active())
    }

    /// Make `stream` of device `owner` wait for the work queued so far on its stream `other`; where an
    /// event call fails, synchronize the device instead (true: every stream of the device is ordered
    /// now). An error means neither worked: the block must not be freed.
    fn wait_same_device(
        &self,
        owner: usize,
        dev: &dyn Device,
        other: StreamId,
        stream: StreamId,
        ptr: u64,
    ) -> Result<bool> {
        let slot = &self.slots[owner];
        match slot.events.order_after(dev, other, stream) {
            Ok(()) => {
                slot.stream_waits.fetch_add(1, Relaxed);
                Ok(false)
            }
            Err(e) if dev.captures().active() => {
                // The synchronize fallback would invalidate the capture.
                log::error!("genpool: event ordering for {ptr:#x} failed during a capture: {e}");
                Err(GenpoolError::StreamOrder {
                    ptr,
                    source: Box::new(e),
                })
            }
            Err(e) => {
                log::warn!(
                    "genpool: event ordering for {ptr:#x} failed ({e}); synchronizing the device"
                );
                slot.sync_fallbacks.fetch_add(1, Relaxed);
                dev.synchronize()
                    .map_err(|source| GenpoolError::StreamOrder {
                        ptr,
                        source: Box::new(source),
                    })?;
                Ok(true)
            }
        }
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
    pub fn flush_deferred(&self) -> std::result::Result<usize, O::Error> {
        self.release_deferred(true).map_err(O::Error::from)
    }

    /// [`Pools::poll_deferred`] where the backoff allows it: calls while blocks are held back poll
    /// them, but after a poll that released nothing the next waits 1, 2 … 64 µs (the events are still
    /// pending; each question costs a driver call).
    #[cold]
    fn poll_deferred_due(&self) {
        let now = clock_ns();
        if now < self.hot.poll_after.load(Relaxed) {
            return;
        }
        let backoff = if self.poll_deferred() == 0 {
            (self.hot.poll_backoff_ns.load(Relaxed) * 2).clamp(1_000, POLL_BACKOFF_MAX_NS)
        } else {
            0
        };
        self.hot.poll_backoff_ns.store(backoff, Relaxed);
        self.hot
            .poll_after
            .store(now.saturating_add(backoff), Relaxed);
    }

    fn release_deferred(&self, wait: bool) -> Result<usize> {
        if self.capture_underway() {
            // No event may be queried or waited for while a capture runs: the blocks stay held until
            // a call after it.
            return Ok(0);
        }
        let mut held = self.deferred.lock();
        let mut released = 0;
        let mut first_err = None;
        // Streams with an event found pending by this poll: their later events are pending too.
        let mut pending: Vec<(usize, StreamId)> = Vec::new();
        let mut kept = Vec::with_capacity(held.list.len());
        let mut stop = false;
        for d in std::mem::take(&mut held.list) {
            if stop {
                kept.push(d);
                continue;
            }
            let mut done = true;
            for &(dv, s, ev) in &d.events {
                if !wait && pending.contains(&(dv, s)) {
                    done = false;
                    break;
                }
                let dev = self.slots[dv]
                    .created()
                    .expect("a device with an event has an engine")
                    .device();
                let answer = if wait {
                    dev.event_synchronize(ev).map(|()| true)
                } else {
                    dev.event_query(ev)
                };
                match answer {
                    Ok(true) => {}
                    Ok(false) => {
                        pending.push((dv, s));
                        done = false;
                        break;
                    }
                    Err(e) => {
                        first_err.get_or_insert(e);
                        pending.push((dv, s));
                        stop = wait;
                        done = false;
                        break;
                    }
                }
            }
            if !done {
                kept.push(d);
                continue;
            }
            self.hot.deferred_len.fetch_sub(1, Relaxed);
            held.ptrs.remove(&d.ptr);
            for &(dv, _, ev) in &d.events {
                self.slots[dv].events.give(ev);
            }
            let home = match d.engine {
                Some(e) => Home::Engine(e),
                None => Home::Default(
                    self.slots[d.owner]
                        .created()
                        .expect("a held-back block's owner has an engine"),
                ),
            };
            if let Err(e) = self.free_now(d.owner, &home, d.ptr, d.stream) {
                log::error!(
                    "genpool: freeing held-back block {:#x} ({} B): {e}",
                    d.ptr,
                    d.size
                );
            }
            released += 1;
        }
        held.list = kept;
        match first_err {
            Some(e) => Err(e.into()),
            None => Ok(released),
        }
    }

    /// Secondary engine `id` of device `device`, made (over the device's default engine's device and
    /// configuration, the default engine first if need be) unless one with that number is there and not
    /// released. `id` must not be 0.
    pub fn add_engine(&self, device: usize, id: u64) -> std::result::Result<Arc<Engine>, O::Error> {
        self.add_engine_with(device, id, |main| {
            Ok(Pool::new(main.device().clone(), main.config().clone())?)
        })
    }

    /// [`Pools::add_engine`] with the engine built by `build` from the device's default engine (another
    /// configuration, a page pool set up otherwise). `build` runs outside the table's lock; when another
    /// thread adds engine `id` meanwhile, that one is returned and the one built here dropped.
    pub fn add_engine_with(
        &self,
        device: usize,
        id: u64,
        build: impl FnOnce(&Pool) -> std::result::Result<Pool, O::Error>,
    ) -> std::result::Result<Arc<Engine>, O::Error> {
        assert_ne!(id, 0, "engine 0 is the device's default engine");
        if let Some(e) = self.engine(device, id)? {
            return Ok(e);
        }
        let pool = build(self.pool(device)?)?;
        let mut table = self.slots[device].engines.write();
        if let Some(e) = table.iter().find(|e| e.id == id && !e.is_released()) {
            // Made by another thread meanwhile: ours goes.
            return Ok(e.clone());
        }
        let e = Arc::new(Engine {
            id,
            pool,
            bounds: AddressBounds::new(),
            released: AtomicBool::new(false),
        });
        table.push(e.clone());
        self.hot.engines.fetch_add(1, SeqCst);
        log::info!("genpool: engine {id} on device {device}");
        Ok(e)
    }

    /// Secondary engine `id` of device `device` if it exists and is not released.
    pub fn engine(
        &self,
        device: usize,
        id: u64,
    ) -> std::result::Result<Option<Arc<Engine>>, O::Error> {
        Ok(self
            .slot(device)?
            .engines
            .read()
            .iter()
            .find(|e| e.id == id && !e.is_released())
            .cloned())
    }

    /// Every secondary engine of device `device`, released ones included (their blocks are still live).
    pub fn engines(&self, device: usize) -> std::result::Result<Vec<Arc<Engine>>, O::Error> {
        Ok(self.slot(device)?.engines.read().clone())
    }

    /// Release secondary engine `id` of device `device`: no allocation reaches it any more; it gives
    /// back what it caches, and is dropped now if it holds no live block, else when its last one is
    /// freed. Returns false (nothing done) for an unknown or already released engine.
    pub fn release_engine(&self, device: usize, id: u64) -> std::result::Result<bool, O::Error> {
        let Some(e) = self.engine(device, id)? else {
            return Ok(false);
        };
        e.released.store(true, SeqCst);
        e.pool.trim();
        self.drop_if_done(device, &e);
        Ok(true)
    }

    /// Drop the released secondary engines of device `device` that hold no live block (those a free
    /// could not drop then, e.g. while the caller kept them from being dropped).
    pub fn sweep_released(&self, device: usize) -> std::result::Result<(), O::Error> {
        for e in self.engines(device)? {
            self.drop_if_done(device, &e);
        }
        Ok(())
    }

    fn drop_if_done(&self, device: usize, e: &Engine) {
        if e.pool.device().captures().active() {
            // Dropping unmaps and synchronizes, which a capture forbids: after it
            // (`Pools::sweep_released`).
            return;
        }
        if e.is_released() && e.pool.live_blocks() == 0 {
            let mut table = self.slots[device].engines.write();
            // Checked again under the write lock: no allocation can reach a released engine, and a free
            // of its last block is the only way here.
            if e.pool.live_blocks() == 0 {
                let before = table.len();
                table.retain(|x| !std::ptr::eq(&**x, e));
                if table.len() < before {
                    self.hot.engines.fetch_sub(1, SeqCst);
                    log::info!("genpool: engine {} of device {device} dropped", e.id);
                }
            }
        }
    }

    /// Device `device`'s statistics (all zeros for a device with no engine yet).
    pub fn stats(&self, device: usize) -> std::result::Result<PoolStats, O::Error> {
        Ok(self
            .existing(device)?
            .map_or_else(PoolStats::default, Pool::stats))
    }

    /// Stream waits and synchronize fallbacks issued so far to order frees of device `device`'s blocks
    /// after their recorded uses.
    pub fn ordering(&self, device: usize) -> std::result::Result<(u64, u64), O::Error> {
        let s = self.slot(device)?;
        Ok((s.stream_waits.load(Relaxed), s.sync_fallbacks.load(Relaxed)))
    }

    /// Blocks with recorded uses now.
    pub fn recorded_blocks(&self) -> usize {
        self.hot.used_blocks.load(Relaxed)
    }

    /// The live block starting at `ptr`, wherever it lives: its device, its engine (0: the device's
    /// default one) and what it is.
    pub fn lookup(&self, ptr: u64) -> Option<(usize, u64, LiveBlock)> {
        if self.hot.engines.load(Relaxed) != 0 {
            if let Some((d, e)) = self.engine_of(ptr) {
                return e.pool.lookup_detailed(ptr).map(|b| (d, e.id, b));
            }
        }
        self.candidates(ptr).find_map(|d| {
            let b = self.slots[d].created()?.lookup_detailed(ptr)?;
            Some((d, 0, b))
        })
    }

    /// Every device's statistics and the multi-device counters.
    pub fn all_stats(&self) -> PoolsStats {
        let slots = &self.slots[..self.count()];
        let sum = |f: fn(&Slot<O::Error>) -> &AtomicU64| {
            self.slots.iter().map(|s| f(s).load(Relaxed)).sum()
        };
        PoolsStats {
            devices: slots.iter().map(|s| s.created().map(Pool::stats)).collect(),
            unrouted_frees: self.unrouted.load(Relaxed),
            stream_waits: sum(|s| &s.stream_waits),
            sync_fallbacks: sum(|s| &s.sync_fallbacks),
            use_queries: sum(|s| &s.use_queries),
            recorded_blocks: self.hot.used_blocks.load(Relaxed),
            deferred_frees: self.deferred_total.load(Relaxed),
            deferred_pending: self.hot.deferred_len.load(Relaxed),
        }
    }

    /// Release what can be released without waiting, then trim every device's default engine (not the
    /// secondary ones). Returns the bytes of reservation released.
    pub fn trim(&self) -> u64 {
        self.poll_deferred();
        self.existing_pools().map(|(_, p)| p.trim()).sum()
    }
}

impl<O: Opener> Drop for Pools<O> {
    fn drop(&mut self) {
        if let Err(e) = self.release_deferred(true) {
            log::error!("genpool: held-back blocks at drop: {e}");
        }
        for s in self.slots.iter() {
            if let Some(p) = s.created() {
                s.events.destroy_all(p.device().as_ref());
            }
        }
    }
}
