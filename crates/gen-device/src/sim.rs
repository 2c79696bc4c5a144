//! [`SimDevice`]: a deterministic, host-simulated GPU for tests, CI and the default main job.
//!
//! Everything is behind one `parking_lot::Mutex` (the tiers only call the device on slow paths). The
//! simulation is exact about *bookkeeping* — what is reserved, mapped, allocated, which stream work is
//! complete — and checks every argument the driver would reject, returning
//! [`DeviceError::InvalidArgument`] naming the driver call (e.g. `"cuMemMap"`) instead of panicking.
//!
//! # Address spaces
//! Three disjoint address ranges, so a plain pointer can never be mistaken for a VMM or pool address:
//! plain [`Device::mem_alloc`] blocks live at [`PLAIN_BASE`], pool blocks at [`POOL_BASE`], VA reservations
//! at [`VA_BASE`]; each is 16 TiB. Addresses are handed out *next-fit* (a cursor that only moves forward and
//! wraps around at the end), so a freed address is not handed out again soon: a use-after-free shows up as
//! an access to an unallocated address rather than silently hitting a new block. Results are a pure
//! function of the call sequence (no randomness, no clocks, ordered maps only).
//!
//! # Streams and events
//! Each stream is a queue of numbered operations (`memset_async`, `pool_alloc_async`, `pool_free_async`,
//! `event_record`, `stream_wait_event` each enqueue one). Work completes in order and *immediately*, except:
//! - on a stream paused by [`SimDevice::pause_stream`] nothing completes until
//!   [`SimDevice::resume_stream`] (this models a long-running kernel);
//! - a `stream_wait_event` operation completes only once the event's recorded work has completed, so work
//!   queued behind it waits too (a paused producer stalls its consumers).
//!
//! An event record captures "everything enqueued on the stream so far, including this record"; an event
//! never recorded is complete (as in CUDA). `stream_synchronize`, `event_synchronize` and `synchronize` on
//! something that cannot complete without a `resume_stream` return an error instead of hanging (nothing else
//! could ever resume it while the caller blocks). Stream 0 (the legacy default stream) always exists;
//! created streams are non-blocking (no implicit synchronization with stream 0). Data effects
//! (`memset_async`) are applied when the call is made, even on a paused stream.
//!
//! # Stream-ordered pools
//! A pool is a set of blocks, each a whole number of granules (the pool never splits or merges blocks):
//! - `pool_free_async(p, s)` marks the block free, remembering the stream `s` and the position of the free
//!   in `s`'s queue;
//! - `pool_alloc_async(n, s)` reuses the smallest free block of at least `n` bytes (rounded up to the
//!   granularity) whose free is ordered before the allocation: freed on `s` itself (stream order), or freed
//!   on another stream whose free has completed. Otherwise it reserves a new block of `n` rounded up to the
//!   granularity, counted against the capacity. A block handed out is never live twice, so two live pool
//!   allocations never overlap;
//! - the release threshold is applied when the device, a stream or an event is synchronized (as the driver
//!   does): completed free blocks, largest first, are released until the pool's reservation is at most the
//!   threshold. [`Device::pool_trim`] does the same with its `keep` argument;
//! - `used` counts the (rounded) sizes of live blocks; `reserved` all blocks; both with high-water marks;
//! - destroying a pool that still has live allocations is rejected (it catches leaks in the tiers' tests);
//!   its free blocks are released.
//!
//! # Host backing
//! With [`SimConfig::backed`], physical handles, plain blocks and pool blocks own real host bytes, stored
//! sparsely in 64 KiB pages allocated on first write (unwritten bytes read as zero), and
//! [`Device::write`] / [`Device::read`] / [`Device::memset_async`] go through the VA mappings: data written
//! through one mapping of a handle is visible through another. An access touching any byte that is not
//! mapped or allocated (including a pool block that was freed) is an `InvalidArgument` — the simulated
//! device fault — and has no effect. Without backing, `write` and `memset_async` only validate the range and
//! `read` returns [`DeviceError::Unsupported`].
//!
//! # Captures, peers, IPC
//! [`SimDevice::begin_capture`] simulates a CUDA graph capture of one stream in global mode: until
//! [`SimDevice::end_capture`], a call a capture forbids (`synchronize`, `stream_synchronize`,
//! `event_synchronize`, `event_query`, `unmap`) fails with `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` and
//! invalidates the capture, and an event recorded on the capturing stream counts as a violation too
//! (its completion can never be learnt); [`SimDevice::capture_violations`] lists them, so a test sees
//! every call the engine should not have made. This is the driver's side; what the engine was told
//! ([`Device::captures`]) is separate, as on a real GPU.
//!
//! Each mapping records the devices that may access it (this one, the peers added before it was made
//! with [`Device::add_peer`], and those given access later with [`Device::set_peer_access`]):
//! [`SimDevice::accessible_by`] checks a range.
//!
//! [`Device::export_handle`] hands out a real file descriptor (a memfd) standing for the physical
//! allocation; [`Device::import_handle`] on the same device recognises it by its inode and makes a new
//! handle of the same memory (data written through one mapping reads back through the other). The
//! memory lives until its handle and every import are released.
//!
//! # Test hooks
//! [`SimDevice::calls`] counts every device call by [`CallKind`] (failed calls included);
//! [`SimDevice::fail_next`] makes the next call of a kind fail; [`SimDevice::set_capacity`] shrinks or grows
//! the simulated memory; [`SimDevice::outstanding`] counts live objects, for leak checks.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fmt;
use std::ops::Index;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use parking_lot::Mutex;

use crate::{
    Captures, Device, DeviceError, DeviceProps, DevicePtr, EventHandle, HostHandle, PhysHandle,
    PoolHandle, PoolUsage, Reserved, Result, StreamId,
};

/// Base of the addresses returned by [`Device::mem_alloc`].
pub const PLAIN_BASE: u64 = 0x3000_0000_0000;
/// Base of the addresses returned by [`Device::pool_alloc_async`].
pub const POOL_BASE: u64 = 0x5000_0000_0000;
/// Base of the addresses returned by [`Device::va_reserve`].
pub const VA_BASE: u64 = 0x7000_0000_0000;
/// Size of each of the three address ranges (16 TiB).
pub const SPACE_SIZE: u64 = 0x1000_0000_0000;
/// A per-ordinal [`SimConfig::address_offset`] step: `ordinal as u64 * ORDINAL_STRIDE` places each
/// simulated device's three ranges above every lower ordinal's, so several devices never hand out the same
/// address (as real GPUs under unified virtual addressing).
pub const ORDINAL_STRIDE: u64 = 1 << 48;
// One stride apart, no range of one device reaches the next device's lowest range.
const _: () = assert!(VA_BASE + SPACE_SIZE <= PLAIN_BASE + ORDINAL_STRIDE);
/// Alignment (and size rounding) of plain allocations.
pub const PLAIN_ALIGN: u64 = 512;
/// Default capacity: 80 GiB.
pub const DEFAULT_CAPACITY: u64 = 80 << 30;
/// Default VMM granularity: 2 MiB.
pub const DEFAULT_GRANULARITY: u64 = 2 << 20;

const PAGE: u64 = 64 << 10;

// ---------------------------------------------------------------------------------------------------
// Configuration
// ---------------------------------------------------------------------------------------------------

/// Builder for a [`SimDevice`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimConfig {
    capacity: u64,
    ordinal: usize,
    name: String,
    granularity: u64,
    backed: bool,
    address_offset: u64,
    adopt_streams: bool,
    map_latency: std::time::Duration,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            capacity: DEFAULT_CAPACITY,
            ordinal: 0,
            name: "SimDevice".to_string(),
            granularity: DEFAULT_GRANULARITY,
            backed: false,
            address_offset: 0,
            adopt_streams: false,
            map_latency: std::time::Duration::ZERO,
        }
    }
}

impl SimConfig {
    /// The defaults: 80 GiB, ordinal 0, name "SimDevice", 2 MiB granularity, no host backing.
    pub fn new() -> Self {
        Self::default()
    }
    /// Total simulated device memory in bytes.
    pub fn capacity(mut self, bytes: u64) -> Self {
        self.capacity = bytes;
        self
    }
    /// Device ordinal reported by `props()`.
    pub fn ordinal(mut self, ordinal: usize) -> Self {
        self.ordinal = ordinal;
        self
    }
    /// Device name reported by `props()`.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }
    /// VMM granularity: a power of two of at least 4 KiB.
    pub fn granularity(mut self, bytes: u64) -> Self {
        self.granularity = bytes;
        self
    }
    /// Give memory real host bytes so `write`/`read`/`memset_async` move data (see the module doc).
    pub fn backed(mut self, on: bool) -> Self {
        self.backed = on;
        self
    }
    /// Shift all three address ranges up by `bytes` (default 0). Devices built with different offsets
    /// (e.g. `ordinal as u64 * ORDINAL_STRIDE`, see [`ORDINAL_STRIDE`]) never hand out the same address.
    pub fn address_offset(mut self, bytes: u64) -> Self {
        self.address_offset = bytes;
        self
    }
    /// Take a stream handle the device has not made as a stream on its first use (default: off, such a
    /// handle is `InvalidArgument`). For a device behind an allocator's C ABI, whose callers make their
    /// streams with CUDA (PyTorch, `benches/host/abi_replay.c`) and have no way to make them here.
    /// [`Device::stream_create`] never hands out a handle already taken.
    pub fn adopt_streams(mut self, on: bool) -> Self {
        self.adopt_streams = on;
        self
    }
    /// Host time each page map takes (default none; the CUDA driver's `cuMemMap` + `cuMemSetAccess`
    /// take ~25 µs a page on an H200): spent spinning, outside the device's lock, so that what the
    /// engine decides from the time its page moves take (the move budget) is decided as on a GPU,
    /// whatever the speed of the build running it.
    pub fn map_latency(mut self, latency: std::time::Duration) -> Self {
        self.map_latency = latency;
        self
    }
    /// Build the device; `InvalidArgument` if the granularity is not a power of two ≥ 4 KiB or no larger
    /// than the address ranges, or if the address offset is not a multiple of the granularity or moves
    /// a range past the end of the 64-bit address space.
    pub fn build(self) -> Result<SimDevice> {
        let g = self.granularity;
        if !g.is_power_of_two() || !(4096..=SPACE_SIZE / 4).contains(&g) {
            return Err(inval(
                "SimConfig::build",
                format!("granularity {g:#x} must be a power of two between 4 KiB and 4 TiB"),
            ));
        }
        let off = self.address_offset;
        if off % g != 0 || (VA_BASE + SPACE_SIZE).checked_add(off).is_none() {
            return Err(inval(
                "SimConfig::build",
                format!(
                    "address offset {off:#x} must be a multiple of the granularity {g:#x} and keep \
                     the address ranges below 2^64"
                ),
            ));
        }
        Ok(SimDevice::from_config(self))
    }
}

// ---------------------------------------------------------------------------------------------------
// Call kinds, counters, faults
// ---------------------------------------------------------------------------------------------------

macro_rules! call_kinds {
    ($($(#[$doc:meta])* $variant:ident => $name:literal),* $(,)?) => {
        /// A kind of device call, for [`SimDevice::calls`] and [`SimDevice::fail_next`].
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum CallKind {
            $($(#[$doc])* $variant,)*
        }

        impl CallKind {
            /// Every kind, in declaration order.
            pub const ALL: &'static [CallKind] = &[$(CallKind::$variant,)*];

            /// The CUDA driver call this kind models (also the `call` named in its errors).
            pub fn name(self) -> &'static str {
                match self {
                    $(CallKind::$variant => $name,)*
                }
            }
        }
    };
}

call_kinds! {
    /// [`Device::mem_alloc`].
    MemAlloc => "cuMemAlloc",
    /// [`Device::mem_free`].
    MemFree => "cuMemFree",
    /// [`Device::va_reserve`].
    VaReserve => "cuMemAddressReserve",
    /// [`Device::va_release`].
    VaRelease => "cuMemAddressFree",
    /// [`Device::phys_create`].
    PhysCreate => "cuMemCreate",
    /// [`Device::phys_release`].
    PhysRelease => "cuMemRelease",
    /// [`Device::map`].
    Map => "cuMemMap",
    /// [`Device::unmap`].
    Unmap => "cuMemUnmap",
    /// [`Device::pool_create`].
    PoolCreate => "cuMemPoolCreate",
    /// [`Device::pool_destroy`].
    PoolDestroy => "cuMemPoolDestroy",
    /// [`Device::pool_alloc_async`].
    PoolAlloc => "cuMemAllocFromPoolAsync",
    /// [`Device::pool_free_async`].
    PoolFree => "cuMemFreeAsync",
    /// [`Device::pool_trim`].
    PoolTrim => "cuMemPoolTrimTo",
    /// [`Device::pool_usage`].
    PoolUsage => "cuMemPoolGetAttribute",
    /// [`Device::stream_create`].
    StreamCreate => "cuStreamCreate",
    /// [`Device::stream_destroy`].
    StreamDestroy => "cuStreamDestroy",
    /// [`Device::stream_synchronize`].
    StreamSynchronize => "cuStreamSynchronize",
    /// [`Device::event_create`].
    EventCreate => "cuEventCreate",
    /// [`Device::event_destroy`].
    EventDestroy => "cuEventDestroy",
    /// [`Device::event_record`].
    EventRecord => "cuEventRecord",
    /// [`Device::event_query`].
    EventQuery => "cuEventQuery",
    /// [`Device::stream_query`].
    StreamQuery => "cuStreamQuery",
    /// [`Device::event_synchronize`].
    EventSynchronize => "cuEventSynchronize",
    /// [`Device::stream_wait_event`].
    StreamWaitEvent => "cuStreamWaitEvent",
    /// [`Device::synchronize`].
    Synchronize => "cuCtxSynchronize",
    /// [`Device::write`].
    Write => "cuMemcpyHtoD",
    /// [`Device::read`].
    Read => "cuMemcpyDtoH",
    /// [`Device::memset_async`].
    Memset => "cuMemsetD8Async",
    /// [`Device::mem_info`].
    MemInfo => "cuMemGetInfo",
    /// [`Device::host_alloc`].
    HostAlloc => "cuMemAllocHost",
    /// [`Device::host_free`].
    HostFree => "cuMemFreeHost",
    /// [`Device::copy_to_host`].
    CopyToHost => "cuMemcpyDtoH (pinned)",
    /// [`Device::copy_from_host`].
    CopyFromHost => "cuMemcpyHtoD (pinned)",
    /// [`Device::add_peer`] and [`Device::set_peer_access`].
    SetAccess => "cuMemSetAccess",
    /// [`Device::export_handle`].
    Export => "cuMemExportToShareableHandle",
    /// [`Device::import_handle`].
    Import => "cuMemImportFromShareableHandle",
}

impl fmt::Display for CallKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

const N_KINDS: usize = CallKind::ALL.len();

/// Snapshot of how many calls of each kind a [`SimDevice`] has received (failed ones included).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimCalls {
    counts: [u64; N_KINDS],
}

impl SimCalls {
    /// Calls of `kind`.
    pub fn get(&self, kind: CallKind) -> u64 {
        self.counts[kind as usize]
    }
    /// All calls together.
    pub fn total(&self) -> u64 {
        self.counts.iter().sum()
    }
    /// Calls made since `earlier` was taken, kind by kind.
    pub fn since(&self, earlier: &SimCalls) -> SimCalls {
        let mut counts = self.counts;
        for (c, e) in counts.iter_mut().zip(earlier.counts.iter()) {
            *c = c.saturating_sub(*e);
        }
        SimCalls { counts }
    }
}

impl Index<CallKind> for SimCalls {
    type Output = u64;
    fn index(&self, kind: CallKind) -> &u64 {
        &self.counts[kind as usize]
    }
}

/// Live objects of a [`SimDevice`], for leak checks (see [`SimDevice::outstanding`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimOutstanding {
    /// Plain allocations not yet freed.
    pub plain_allocs: usize,
    /// VA reservations not yet released.
    pub va_reservations: usize,
    /// Physical handles not yet released.
    pub phys_handles: usize,
    /// Mappings not yet unmapped.
    pub mappings: usize,
    /// Pools not yet destroyed.
    pub pools: usize,
    /// Pool allocations not yet freed.
    pub pool_live_blocks: usize,
    /// Pool blocks freed but still cached by their pool.
    pub pool_cached_blocks: usize,
    /// Streams created and not destroyed (stream 0 not counted).
    pub streams: usize,
    /// Events created and not destroyed.
    pub events: usize,
    /// Pinned host buffers not yet freed.
    pub host_buffers: usize,
}

// ---------------------------------------------------------------------------------------------------
// Internals
// ---------------------------------------------------------------------------------------------------

fn inval(call: &'static str, detail: impl Into<String>) -> DeviceError {
    DeviceError::InvalidArgument {
        call,
        detail: detail.into(),
    }
}

/// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`, as the driver returns it.
const CAPTURE_UNSUPPORTED: i32 = 900;

fn capture_error(call: &'static str) -> DeviceError {
    DeviceError::Driver {
        call,
        code: CAPTURE_UNSUPPORTED,
        message: "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: operation not permitted when stream is \
                  capturing (SimDevice: the capture is invalidated)"
            .to_string(),
    }
}

fn round_up(x: u64, to: u64) -> Option<u64> {
    debug_assert!(to.is_power_of_two());
    x.checked_add(to - 1).map(|v| v & !(to - 1))
}

/// Sparse host bytes in 64 KiB pages; absent pages read as zero.
#[derive(Default)]
struct Sparse {
    pages: HashMap<u64, Box<[u8]>>,
}

impl Sparse {
    fn page_mut(&mut self, idx: u64) -> &mut [u8] {
        self.pages
            .entry(idx)
            .or_insert_with(|| vec![0u8; PAGE as usize].into_boxed_slice())
    }

    /// Split `[off, off + len)` at page boundaries: (page index, offset in page, length, bytes before).
    fn chunks(off: u64, len: u64) -> impl Iterator<Item = (u64, usize, usize, usize)> {
        let mut pos = off;
        let end = off + len;
        std::iter::from_fn(move || {
            if pos >= end {
                return None;
            }
            let idx = pos / PAGE;
            let in_page = (pos % PAGE) as usize;
            let n = ((PAGE - pos % PAGE).min(end - pos)) as usize;
            let done = (pos - off) as usize;
            pos += n as u64;
            Some((idx, in_page, n, done))
        })
    }

    fn write(&mut self, off: u64, data: &[u8]) {
        for (idx, at, n, done) in Self::chunks(off, data.len() as u64) {
            self.page_mut(idx)[at..at + n].copy_from_slice(&data[done..done + n]);
        }
    }

    fn read(&self, off: u64, out: &mut [u8]) {
        for (idx, at, n, done) in Self::chunks(off, out.len() as u64) {
            match self.pages.get(&idx) {
                Some(p) => out[done..done + n].copy_from_slice(&p[at..at + n]),
                None => out[done..done + n].fill(0),
            }
        }
    }

    fn fill(&mut self, off: u64, byte: u8, len: u64) {
        for (idx, at, n, _) in Self::chunks(off, len) {
            if byte == 0 && !self.pages.contains_key(&idx) {
                continue; // absent pages already read as zero
            }
            self.page_mut(idx)[at..at + n].fill(byte);
        }
    }
}

/// A range of addresses handed out next-fit.
struct AddrSpace {
    base: u64,
    end: u64,
    cursor: u64,
    used: BTreeMap<u64, u64>, // start -> len
}

impl AddrSpace {
    fn new(base: u64) -> Self {
        AddrSpace {
            base,
            end: base + SPACE_SIZE,
            cursor: base,
            used: BTreeMap::new(),
        }
    }

    /// First free, aligned range of `len` at or after `from`, below `self.end`.
    fn find_from(&self, from: u64, len: u64, align: u64) -> Option<u64> {
        let mut at = round_up(from, align)?;
        // A range starting before `at` may still cover it.
        if let Some((&s, &l)) = self.used.range(..at).next_back() {
            if s + l > at {
                at = round_up(s + l, align)?;
            }
        }
        loop {
            let end = at.checked_add(len)?;
            if end > self.end {
                return None;
            }
            match self.used.range(at..end).next() {
                None => return Some(at),
                Some((&s, &l)) => at = round_up(s + l, align)?,
            }
        }
    }

    fn alloc(&mut self, len: u64, align: u64) -> Option<u64> {
        let at = self
            .find_from(self.cursor, len, align)
            .or_else(|| self.find_from(self.base, len, align))?;
        self.used.insert(at, len);
        self.cursor = at + len;
        Some(at)
    }

    fn free(&mut self, at: u64) -> Option<u64> {
        self.used.remove(&at)
    }
}

struct Phys {
    size: u64,
    map_count: u64,
    data: Sparse,
    /// An import ([`Device::import_handle`]): the handle whose memory this is (its `data` is unused).
    source: Option<u64>,
    /// Imports of this handle not yet released.
    imports: u64,
    /// Released while imports of it were live: the memory stays until the last import goes.
    released: bool,
    /// The descriptor [`Device::export_handle`] made for it, closed when it is released.
    export: Option<OwnedFd>,
}

impl Phys {
    fn new(size: u64, source: Option<u64>) -> Self {
        Phys {
            size,
            map_count: 0,
            data: Sparse::default(),
            source,
            imports: 0,
            released: false,
            export: None,
        }
    }
}

/// The mappings that tile `[va, end)` from `va` on, back to back (their starts), and where that run
/// stops: `end` when the range is exactly covered by whole mappings, else the first gap or split.
fn whole_mappings(mappings: &BTreeMap<u64, Mapping>, va: u64, end: u64) -> (Vec<u64>, u64) {
    let mut pos = va;
    let mut covered = Vec::new();
    for (&s, m) in mappings.range(va..end) {
        if s != pos {
            break;
        }
        pos = s + m.size;
        covered.push(s);
    }
    (covered, pos)
}

struct Mapping {
    size: u64,
    handle: u64,
    /// Devices that may access it (ordinals), this one first.
    access: Vec<usize>,
}

/// A simulated capture (see [`SimDevice::begin_capture`]).
#[derive(Default)]
struct Capture {
    /// The capturing stream, while one captures.
    stream: Option<StreamId>,
    /// Calls the capture forbids, made while it ran: the current capture's.
    current: Vec<&'static str>,
    /// Every such call since the device was made.
    all: Vec<&'static str>,
}

/// A memfd: a real file descriptor with an inode of its own, standing for an exported handle.
pub(crate) fn memfd(name: &str) -> Result<OwnedFd> {
    let call = "memfd_create";
    let cname = std::ffi::CString::new(name).map_err(|_| inval(call, "name with a NUL byte"))?;
    // SAFETY: `cname` is a valid NUL-terminated string that outlives the call; no other pointers.
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        let e = std::io::Error::last_os_error();
        return Err(DeviceError::Os {
            call,
            errno: e.raw_os_error().unwrap_or(0),
            message: e.to_string(),
        });
    }
    // SAFETY: `fd` was just opened by the kernel for us and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The (device, inode) identity of an open file.
fn inode_of(call: &'static str, fd: BorrowedFd<'_>) -> Result<(u64, u64)> {
    let meta = std::fs::File::from(fd.try_clone_to_owned().map_err(|e| DeviceError::Os {
        call,
        errno: e.raw_os_error().unwrap_or(0),
        message: e.to_string(),
    })?)
    .metadata()
    .map_err(|e| DeviceError::Os {
        call,
        errno: e.raw_os_error().unwrap_or(0),
        message: e.to_string(),
    })?;
    use std::os::unix::fs::MetadataExt;
    Ok((meta.dev(), meta.ino()))
}

struct PlainBlock {
    size: u64,
    data: Sparse,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BlockState {
    Live,
    /// Freed on `stream`, as operation number `seq` of that stream.
    Free {
        stream: StreamId,
        seq: u64,
    },
}

struct PoolBlock {
    pool: u64,
    size: u64,
    state: BlockState,
    data: Sparse,
}

struct SimMemPool {
    threshold: u64,
    usage: PoolUsage,
    /// Free blocks of this pool, by (size, address).
    free: BTreeSet<(u64, u64)>,
    live: usize,
}

#[derive(Default)]
struct Stream {
    /// Operations enqueued so far (operation numbers start at 1).
    submitted: u64,
    /// Operations completed (a prefix of the queue).
    completed: u64,
    paused: bool,
    destroyed: bool,
    /// `stream_wait_event` operations not yet completed: (operation number, producer stream, producer op).
    waits: VecDeque<(u64, StreamId, u64)>,
}

#[derive(Default)]
struct Event {
    /// The last record: (stream, operation number of the record).
    recorded: Option<(StreamId, u64)>,
}

struct State {
    capacity: u64,
    held: u64,
    peak: u64,
    plain_space: AddrSpace,
    pool_space: AddrSpace,
    va_space: AddrSpace,
    plain: BTreeMap<u64, PlainBlock>,
    reservations: BTreeMap<u64, u64>,
    phys: BTreeMap<u64, Phys>,
    next_phys: u64,
    mappings: BTreeMap<u64, Mapping>,
    pools: BTreeMap<u64, SimMemPool>,
    next_pool: u64,
    blocks: BTreeMap<u64, PoolBlock>,
    streams: BTreeMap<StreamId, Stream>,
    next_stream: u64,
    events: BTreeMap<u64, Event>,
    next_event: u64,
    /// Pinned host buffers: handle -> (length, bytes). Not counted against the device's capacity.
    hosts: BTreeMap<u64, (u64, Sparse)>,
    next_host: u64,
    calls: [u64; N_KINDS],
    faults: Vec<VecDeque<Option<DeviceError>>>,
    capture: Capture,
    /// Devices added by [`Device::add_peer`].
    peers: Vec<usize>,
    /// Exported handles by the identity of their descriptor.
    exports: HashMap<(u64, u64), u64>,
    /// [`SimConfig::adopt_streams`].
    adopt_streams: bool,
}

/// Where a device byte lives.
#[derive(Clone, Copy)]
enum Target {
    Plain(u64),
    Phys(u64),
    Pool(u64),
}

impl State {
    fn new(capacity: u64, offset: u64, adopt_streams: bool) -> Self {
        let mut streams = BTreeMap::new();
        streams.insert(0, Stream::default());
        State {
            capacity,
            held: 0,
            peak: 0,
            plain_space: AddrSpace::new(PLAIN_BASE + offset),
            pool_space: AddrSpace::new(POOL_BASE + offset),
            va_space: AddrSpace::new(VA_BASE + offset),
            plain: BTreeMap::new(),
            reservations: BTreeMap::new(),
            phys: BTreeMap::new(),
            next_phys: 1,
            mappings: BTreeMap::new(),
            pools: BTreeMap::new(),
            next_pool: 1,
            blocks: BTreeMap::new(),
            streams,
            next_stream: 1,
            events: BTreeMap::new(),
            next_event: 1,
            hosts: BTreeMap::new(),
            next_host: 1,
            calls: [0; N_KINDS],
            faults: (0..N_KINDS).map(|_| VecDeque::new()).collect(),
            capture: Capture::default(),
            peers: Vec::new(),
            exports: HashMap::new(),
            adopt_streams,
        }
    }

    /// A call a capture forbids: while one runs, it fails and invalidates the capture.
    fn forbidden_in_capture(&mut self, kind: CallKind) -> Result<()> {
        if self.capture.stream.is_none() {
            return Ok(());
        }
        self.capture.current.push(kind.name());
        self.capture.all.push(kind.name());
        Err(capture_error(kind.name()))
    }

    /// The handle whose bytes `h` shows (itself, or the exported handle it imports).
    fn root(&self, h: u64) -> u64 {
        self.phys.get(&h).and_then(|p| p.source).unwrap_or(h)
    }

    /// Forget a handle that is released and whose imports are all released too.
    fn drop_phys_if_done(&mut self, h: u64) {
        let Some(p) = self.phys.get(&h) else { return };
        if p.released && p.imports == 0 {
            let size = p.size;
            let p = self.phys.remove(&h).expect("checked");
            if let Some(fd) = &p.export {
                if let Ok(id) = inode_of("cuMemRelease", fd.as_fd()) {
                    self.exports.remove(&id);
                }
            }
            self.discharge(size);
        }
    }

    /// Count the call and return an injected fault if one is pending. `requested` is the byte count of
    /// allocating calls (their default injected fault is `OutOfMemory`).
    fn enter(&mut self, kind: CallKind, requested: Option<u64>) -> Result<()> {
        self.calls[kind as usize] += 1;
        match self.faults[kind as usize].pop_front() {
            None => Ok(()),
            Some(Some(e)) => Err(e),
            Some(None) => Err(match requested {
                Some(requested) => DeviceError::OutOfMemory {
                    call: kind.name(),
                    requested,
                },
                None => DeviceError::Driver {
                    call: kind.name(),
                    code: 999,
                    message: "CUDA_ERROR_UNKNOWN (injected by SimDevice::fail_next)".to_string(),
                },
            }),
        }
    }

    fn charge(&mut self, call: &'static str, bytes: u64) -> Result<()> {
        match self.held.checked_add(bytes) {
            Some(h) if h <= self.capacity => {
                self.held = h;
                self.peak = self.peak.max(h);
                Ok(())
            }
            _ => Err(DeviceError::OutOfMemory {
                call,
                requested: bytes,
            }),
        }
    }

    fn discharge(&mut self, bytes: u64) {
        debug_assert!(self.held >= bytes);
        self.held -= bytes;
    }

    fn stream(&mut self, call: &'static str, s: StreamId) -> Result<&Stream> {
        if self.adopt_streams {
            self.streams.entry(s).or_default();
        }
        match self.streams.get(&s) {
            Some(st) if !st.destroyed => Ok(st),
            _ => Err(inval(call, format!("unknown stream {s:#x}"))),
        }
    }

    /// Enqueue one operation on `s` (already validated) and return its number.
    fn enqueue(&mut self, s: StreamId) -> u64 {
        let st = self
            .streams
            .get_mut(&s)
            .expect("stream validated by the caller");
        st.submitted += 1;
        st.submitted
    }

    fn op_done(&self, s: StreamId, seq: u64) -> bool {
        self.streams.get(&s).is_none_or(|st| st.completed >= seq)
    }

    /// Complete every operation that can complete, to a fixed point.
    fn progress(&mut self) {
        loop {
            let mut changed = false;
            let ids: Vec<StreamId> = self.streams.keys().copied().collect();
            for id in ids {
                let st = &self.streams[&id];
                if st.paused || st.completed == st.submitted {
                    continue;
                }
                let mut limit = st.submitted;
                let mut passed = 0;
                for &(pos, dep_s, dep_seq) in &st.waits {
                    if self.op_done(dep_s, dep_seq) {
                        passed += 1;
                    } else {
                        limit = pos - 1;
                        break;
                    }
                }
                let st = self.streams.get_mut(&id).expect("id from keys");
                st.waits.drain(..passed);
                if limit > st.completed {
                    st.completed = limit;
                    changed = true;
                }
            }
            if !changed {
                break;
            }
        }
        // Forget destroyed streams with nothing left in flight. Stream ids are never reused, so an unknown
        // id in `op_done` means "destroyed and complete".
        self.streams
            .retain(|_, st| !(st.destroyed && st.completed == st.submitted));
    }

    fn event_done(&self, e: &Event) -> bool {
        match e.recorded {
            None => true,
            Some((s, seq)) => self.op_done(s, seq),
        }
    }

    fn paused_streams(&self) -> Vec<StreamId> {
        self.streams
            .iter()
            .filter(|(_, s)| s.paused)
            .map(|(&id, _)| id)
            .collect()
    }

    /// Release completed free blocks of `pool`, largest first, until it reserves at most `keep`.
    fn trim_pool(&mut self, pool: u64, keep: u64) {
        let candidates: Vec<(u64, u64)> = match self.pools.get(&pool) {
            Some(p) => p.free.iter().rev().copied().collect(),
            None => return,
        };
        for (size, ptr) in candidates {
            if self.pools[&pool].usage.reserved_current <= keep {
                break;
            }
            let done = match self.blocks[&ptr].state {
                BlockState::Free { stream, seq } => self.op_done(stream, seq),
                BlockState::Live => false,
            };
            if !done {
                continue;
            }
            self.blocks.remove(&ptr);
            self.pool_space.free(ptr);
            let p = self.pools.get_mut(&pool).expect("pool checked above");
            p.free.remove(&(size, ptr));
            p.usage.reserved_current -= size;
            self.discharge(size);
        }
    }

    /// What synchronization does to pools: apply each pool's release threshold.
    fn apply_thresholds(&mut self) {
        let pools: Vec<(u64, u64)> = self
            .pools
            .iter()
            .map(|(&id, p)| (id, p.threshold))
            .collect();
        for (id, threshold) in pools {
            self.trim_pool(id, threshold);
        }
    }

    fn locate(&self, addr: u64) -> Option<(Target, u64, u64)> {
        if let Some((&s, b)) = self.plain.range(..=addr).next_back() {
            if addr < s + b.size {
                return Some((Target::Plain(s), addr - s, s + b.size - addr));
            }
        }
        if let Some((&s, m)) = self.mappings.range(..=addr).next_back() {
            if addr < s + m.size {
                return Some((Target::Phys(m.handle), addr - s, s + m.size - addr));
            }
        }
        if let Some((&s, b)) = self.blocks.range(..=addr).next_back() {
            if addr < s + b.size && b.state == BlockState::Live {
                return Some((Target::Pool(s), addr - s, s + b.size - addr));
            }
        }
        None
    }

    /// Split `[addr, addr + len)` into pieces of device objects; error if any byte is not accessible.
    fn segments(&self, call: &'static str, addr: u64, len: u64) -> Result<Vec<(Target, u64, u64)>> {
        let end = addr
            .checked_add(len)
            .ok_or_else(|| inval(call, format!("range {addr:#x} + {len:#x} overflows")))?;
        let mut out = Vec::new();
        let mut pos = addr;
        while pos < end {
            let (t, off, avail) = self.locate(pos).ok_or_else(|| {
                inval(
                    call,
                    format!("address {pos:#x} is not mapped or allocated (device fault)"),
                )
            })?;
            let n = avail.min(end - pos);
            out.push((t, off, n));
            pos += n;
        }
        Ok(out)
    }

    fn data_mut(&mut self, t: Target) -> &mut Sparse {
        match t {
            Target::Plain(k) => &mut self.plain.get_mut(&k).expect("located").data,
            Target::Phys(k) => {
                let k = self.root(k);
                &mut self.phys.get_mut(&k).expect("located").data
            }
            Target::Pool(k) => &mut self.blocks.get_mut(&k).expect("located").data,
        }
    }

    /// Check `[offset, offset + bytes)` against pinned buffer `host`.
    fn host_range(
        &self,
        call: &'static str,
        host: HostHandle,
        offset: u64,
        bytes: u64,
    ) -> Result<()> {
        let len = self.hosts.get(&host.0).map(|(len, _)| *len);
        crate::check_host_range(call, host, len, offset, bytes)
    }

    fn data(&self, t: Target) -> &Sparse {
        match t {
            Target::Plain(k) => &self.plain[&k].data,
            Target::Phys(k) => &self.phys[&self.root(k)].data,
            Target::Pool(k) => &self.blocks[&k].data,
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// SimDevice
// ---------------------------------------------------------------------------------------------------

/// A deterministic host-simulated GPU (see the [module documentation](self) for the model).
pub struct SimDevice {
    props: DeviceProps,
    backed: bool,
    map_latency: std::time::Duration,
    state: Mutex<State>,
    captures: Captures,
}

impl fmt::Debug for SimDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimDevice")
            .field("props", &self.props)
            .field("backed", &self.backed)
            .field("reserved", &self.reserved())
            .finish()
    }
}

impl Default for SimDevice {
    fn default() -> Self {
        Self::new()
    }
}

impl SimDevice {
    /// A device with the default [`SimConfig`] (80 GiB, 2 MiB granularity, no backing).
    pub fn new() -> Self {
        Self::from_config(SimConfig::default())
    }

    /// Shorthand for `SimConfig::new()`.
    pub fn config() -> SimConfig {
        SimConfig::new()
    }

    fn from_config(c: SimConfig) -> Self {
        SimDevice {
            props: DeviceProps {
                ordinal: c.ordinal,
                name: c.name,
                total_mem: c.capacity,
                vmm_granularity: c.granularity,
                supports_vmm: true,
                supports_pools: true,
            },
            backed: c.backed,
            map_latency: c.map_latency,
            state: Mutex::new(State::new(c.capacity, c.address_offset, c.adopt_streams)),
            captures: Captures::new(),
        }
    }

    /// Simulate the driver capturing `stream` into a CUDA graph (global mode) until
    /// [`SimDevice::end_capture`]: see the module doc. One capture at a time.
    pub fn begin_capture(&self, stream: StreamId) -> Result<()> {
        let call = "cuStreamBeginCapture";
        let mut st = self.state.lock();
        st.stream(call, stream)?;
        if let Some(s) = st.capture.stream {
            return Err(inval(call, format!("stream {s:#x} is capturing already")));
        }
        st.capture.stream = Some(stream);
        st.capture.current.clear();
        Ok(())
    }

    /// End the simulated capture: an error naming the forbidden calls made during it when they
    /// invalidated it (`CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`, as `cuStreamEndCapture` returns).
    pub fn end_capture(&self) -> Result<()> {
        let call = "cuStreamEndCapture";
        let mut st = self.state.lock();
        if st.capture.stream.take().is_none() {
            return Err(inval(call, "no stream is capturing"));
        }
        let bad = std::mem::take(&mut st.capture.current);
        if bad.is_empty() {
            Ok(())
        } else {
            Err(DeviceError::Driver {
                call,
                code: 901,
                message: format!(
                    "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: forbidden calls during the capture: {bad:?}"
                ),
            })
        }
    }

    /// Every call a simulated capture forbade, in order, since the device was made.
    pub fn capture_violations(&self) -> Vec<&'static str> {
        self.state.lock().capture.all.clone()
    }

    /// Whether device `who` may access every byte of `[va, va + len)` (all of it mapped).
    pub fn accessible_by(&self, who: usize, va: DevicePtr, len: u64) -> bool {
        let st = self.state.lock();
        let end = va.saturating_add(len);
        let mut pos = va;
        while pos < end {
            match st.mappings.range(..=pos).next_back() {
                Some((&s, m)) if pos < s + m.size && m.access.contains(&who) => pos = s + m.size,
                _ => return false,
            }
        }
        true
    }

    /// Whether memory has host bytes behind it ([`SimConfig::backed`]).
    pub fn is_backed(&self) -> bool {
        self.backed
    }

    /// Pause `stream`: work enqueued on it from now on stays incomplete until [`SimDevice::resume_stream`].
    pub fn pause_stream(&self, stream: StreamId) -> Result<()> {
        let mut st = self.state.lock();
        st.stream("SimDevice::pause_stream", stream)?;
        st.streams.get_mut(&stream).expect("validated").paused = true;
        Ok(())
    }

    /// Resume a paused stream: its queued work (and work waiting on it) completes.
    pub fn resume_stream(&self, stream: StreamId) -> Result<()> {
        let mut st = self.state.lock();
        // A destroyed stream with work in flight can still be resumed so its work completes.
        match st.streams.get_mut(&stream) {
            Some(s) => s.paused = false,
            None => {
                return Err(inval(
                    "SimDevice::resume_stream",
                    format!("unknown stream {stream:#x}"),
                ))
            }
        }
        st.progress();
        Ok(())
    }

    /// Whether work enqueued on `stream` from now on waits for work of `producer` not yet complete (a
    /// [`Device::stream_wait_event`] on an event recorded there, still pending): what tests check when a
    /// block freed on a paused stream is handed to another stream.
    /// Transitive: a wait on a third stream's operation that itself waits on `producer` counts.
    pub fn waits_on(&self, stream: StreamId, producer: StreamId) -> bool {
        self.waits_past(stream, producer, 0)
    }

    /// Whether work enqueued on `stream` from now on waits for the operation `event` was last recorded
    /// at (or a later one of its stream), that operation not yet complete: [`waits_on`](Self::waits_on)
    /// for one point of the producer's work. False for an event never recorded or already complete.
    pub fn waits_for_event(&self, stream: StreamId, event: EventHandle) -> bool {
        let rec = self
            .state
            .lock()
            .events
            .get(&event.0)
            .and_then(|e| e.recorded);
        match rec {
            Some((producer, seq)) => self.waits_past(stream, producer, seq),
            None => false,
        }
    }

    fn waits_past(&self, stream: StreamId, producer: StreamId, at: u64) -> bool {
        let st = self.state.lock();
        // (stream, up to which of its operations) still to look at.
        let mut todo = vec![(stream, u64::MAX)];
        let mut seen = std::collections::HashSet::new();
        while let Some((s, upto)) = todo.pop() {
            if !seen.insert((s, upto)) {
                continue;
            }
            let Some(ss) = st.streams.get(&s) else {
                continue;
            };
            for &(pos, dep_s, dep_seq) in &ss.waits {
                if pos > upto || st.op_done(dep_s, dep_seq) {
                    continue;
                }
                if dep_s == producer && dep_seq >= at {
                    return true;
                }
                todo.push((dep_s, dep_seq));
            }
        }
        false
    }

    /// How many calls of each kind this device has received.
    pub fn calls(&self) -> SimCalls {
        SimCalls {
            counts: self.state.lock().calls,
        }
    }

    /// Set the simulated memory size. Lowering it below what is held makes later allocations fail with
    /// `OutOfMemory` until enough is released; `props().total_mem` keeps the configured value, `mem_info`
    /// reports the new one.
    pub fn set_capacity(&self, bytes: u64) {
        self.state.lock().capacity = bytes;
    }

    /// Make the next call of `kind` fail without effect: `OutOfMemory` for the allocating kinds
    /// (`MemAlloc`, `VaReserve`, `PhysCreate`, `PoolAlloc`), a `Driver` error (code 999,
    /// `CUDA_ERROR_UNKNOWN`) for the others. Calling it `n` times fails the next `n` calls.
    pub fn fail_next(&self, kind: CallKind) {
        self.state.lock().faults[kind as usize].push_back(None);
    }

    /// Make the next call of `kind` fail with `error`, without effect.
    pub fn fail_next_with(&self, kind: CallKind, error: DeviceError) {
        self.state.lock().faults[kind as usize].push_back(Some(error));
    }

    /// Counts of live objects, for leak checks.
    pub fn outstanding(&self) -> SimOutstanding {
        let st = self.state.lock();
        let cached = st
            .blocks
            .values()
            .filter(|b| b.state != BlockState::Live)
            .count();
        SimOutstanding {
            plain_allocs: st.plain.len(),
            va_reservations: st.reservations.len(),
            phys_handles: st.phys.values().filter(|p| !p.released).count(),
            mappings: st.mappings.len(),
            pools: st.pools.len(),
            pool_live_blocks: st.blocks.len() - cached,
            pool_cached_blocks: cached,
            streams: st
                .streams
                .iter()
                .filter(|(&id, s)| id != 0 && !s.destroyed)
                .count(),
            events: st.events.len(),
            host_buffers: st.hosts.len(),
        }
    }

    fn gran(&self) -> u64 {
        self.props.vmm_granularity
    }

    fn check_gran(&self, call: &'static str, what: &str, v: u64) -> Result<()> {
        if v == 0 || v % self.gran() != 0 {
            return Err(inval(
                call,
                format!(
                    "{what} {v:#x} is not a non-zero multiple of the granularity {:#x}",
                    self.gran()
                ),
            ));
        }
        Ok(())
    }

    fn access(
        &self,
        kind: CallKind,
        addr: u64,
        len: u64,
        stream: Option<StreamId>,
        op: Access<'_>,
    ) -> Result<()> {
        let call = kind.name();
        let mut st = self.state.lock();
        st.enter(kind, None)?;
        if let Some(s) = stream {
            st.stream(call, s)?;
        }
        let segs = st.segments(call, addr, len)?;
        if let Some(s) = stream {
            st.enqueue(s);
            st.progress();
        }
        if !self.backed {
            return match op {
                Access::Read(_) => Err(DeviceError::Unsupported(
                    "cuMemcpyDtoH (SimDevice without backing)",
                )),
                _ => Ok(()),
            };
        }
        let mut done = 0usize;
        match op {
            Access::Write(data) => {
                for (t, off, n) in segs {
                    st.data_mut(t).write(off, &data[done..done + n as usize]);
                    done += n as usize;
                }
            }
            Access::Read(out) => {
                for (t, off, n) in segs {
                    st.data(t).read(off, &mut out[done..done + n as usize]);
                    done += n as usize;
                }
            }
            Access::Fill(byte) => {
                for (t, off, n) in segs {
                    st.data_mut(t).fill(off, byte, n);
                }
            }
        }
        Ok(())
    }
}

enum Access<'a> {
    Write(&'a [u8]),
    Read(&'a mut [u8]),
    Fill(u8),
}

impl Device for SimDevice {
    fn call_counts(&self) -> crate::CallCounts {
        let c = self.calls();
        crate::CallCounts {
            waits: c.get(CallKind::Synchronize)
                + c.get(CallKind::StreamSynchronize)
                + c.get(CallKind::EventSynchronize),
            device_syncs: c.get(CallKind::Synchronize),
            maps: c.get(CallKind::Map),
            unmaps: c.get(CallKind::Unmap),
            creates: c.get(CallKind::PhysCreate),
            event_records: c.get(CallKind::EventRecord),
            event_queries: c.get(CallKind::EventQuery),
            stream_queries: c.get(CallKind::StreamQuery),
            stream_waits: c.get(CallKind::StreamWaitEvent),
        }
    }

    fn props(&self) -> &DeviceProps {
        &self.props
    }

    fn reserved(&self) -> Reserved {
        let st = self.state.lock();
        Reserved {
            current: st.held,
            peak: st.peak,
        }
    }

    fn mem_info(&self) -> Result<(u64, u64)> {
        let mut st = self.state.lock();
        st.enter(CallKind::MemInfo, None)?;
        Ok((st.capacity.saturating_sub(st.held), st.capacity))
    }

    fn mem_alloc(&self, bytes: u64) -> Result<DevicePtr> {
        let call = CallKind::MemAlloc.name();
        let mut st = self.state.lock();
        st.enter(CallKind::MemAlloc, Some(bytes))?;
        if bytes == 0 {
            return Err(inval(call, "zero bytes"));
        }
        let size = round_up(bytes, PLAIN_ALIGN).ok_or(DeviceError::OutOfMemory {
            call,
            requested: bytes,
        })?;
        st.charge(call, size)?;
        let Some(ptr) = st.plain_space.alloc(size, PLAIN_ALIGN) else {
            st.discharge(size);
            return Err(DeviceError::OutOfMemory {
                call,
                requested: bytes,
            });
        };
        st.plain.insert(
            ptr,
            PlainBlock {
                size,
                data: Sparse::default(),
            },
        );
        Ok(ptr)
    }

    fn mem_free(&self, ptr: DevicePtr) -> Result<()> {
        let call = CallKind::MemFree.name();
        let mut st = self.state.lock();
        st.enter(CallKind::MemFree, None)?;
        let b = st
            .plain
            .remove(&ptr)
            .ok_or_else(|| inval(call, format!("{ptr:#x} is not a live mem_alloc pointer")))?;
        st.plain_space.free(ptr);
        st.discharge(b.size);
        Ok(())
    }

    fn va_reserve(&self, bytes: u64, align: u64) -> Result<DevicePtr> {
        let call = CallKind::VaReserve.name();
        let mut st = self.state.lock();
        st.enter(CallKind::VaReserve, Some(bytes))?;
        self.check_gran(call, "size", bytes)?;
        if align != 0 && !align.is_power_of_two() {
            return Err(inval(
                call,
                format!("alignment {align:#x} is not a power of two"),
            ));
        }
        let align = align.max(self.gran());
        let ptr = st
            .va_space
            .alloc(bytes, align)
            .ok_or(DeviceError::OutOfMemory {
                call,
                requested: bytes,
            })?;
        st.reservations.insert(ptr, bytes);
        Ok(ptr)
    }

    fn va_release(&self, ptr: DevicePtr, bytes: u64) -> Result<()> {
        let call = CallKind::VaRelease.name();
        let mut st = self.state.lock();
        st.enter(CallKind::VaRelease, None)?;
        match st.reservations.get(&ptr) {
            None => {
                return Err(inval(
                    call,
                    format!("{ptr:#x} is not the start of a reservation"),
                ))
            }
            Some(&len) if len != bytes => {
                return Err(inval(
                    call,
                    format!("size {bytes:#x} differs from the reserved size {len:#x}"),
                ))
            }
            Some(_) => {}
        }
        if let Some((&m, _)) = st.mappings.range(ptr..ptr + bytes).next() {
            return Err(inval(
                call,
                format!("reservation {ptr:#x} still has a mapping at {m:#x}"),
            ));
        }
        st.reservations.remove(&ptr);
        st.va_space.free(ptr);
        Ok(())
    }

    fn phys_create(&self, bytes: u64) -> Result<PhysHandle> {
        let call = CallKind::PhysCreate.name();
        let mut st = self.state.lock();
        st.enter(CallKind::PhysCreate, Some(bytes))?;
        self.check_gran(call, "size", bytes)?;
        st.charge(call, bytes)?;
        let h = st.next_phys;
        st.next_phys += 1;
        st.phys.insert(h, Phys::new(bytes, None));
        Ok(PhysHandle(h))
    }

    fn phys_release(&self, handle: PhysHandle) -> Result<()> {
        let call = CallKind::PhysRelease.name();
        let mut st = self.state.lock();
        st.enter(CallKind::PhysRelease, None)?;
        match st.phys.get(&handle.0) {
            None => Err(inval(
                call,
                format!("unknown physical handle {:#x}", handle.0),
            )),
            Some(p) if p.released => Err(inval(
                call,
                format!("physical handle {:#x} was released already", handle.0),
            )),
            Some(p) if p.map_count > 0 => Err(inval(
                call,
                format!(
                    "handle {:#x} is still mapped {} time(s)",
                    handle.0, p.map_count
                ),
            )),
            Some(p) => match p.source {
                // An import: its memory is its source's, which may go with it.
                Some(src) => {
                    st.phys.remove(&handle.0);
                    if let Some(s) = st.phys.get_mut(&src) {
                        s.imports -= 1;
                    }
                    st.drop_phys_if_done(src);
                    Ok(())
                }
                None => {
                    st.phys.get_mut(&handle.0).expect("checked").released = true;
                    st.drop_phys_if_done(handle.0);
                    Ok(())
                }
            },
        }
    }

    fn map(&self, va: DevicePtr, bytes: u64, handle: PhysHandle) -> Result<()> {
        let call = CallKind::Map.name();
        if !self.map_latency.is_zero() {
            let t0 = std::time::Instant::now();
            while t0.elapsed() < self.map_latency {
                std::hint::spin_loop();
            }
        }
        let mut st = self.state.lock();
        st.enter(CallKind::Map, None)?;
        self.check_gran(call, "size", bytes)?;
        if va % self.gran() != 0 {
            return Err(inval(
                call,
                format!("address {va:#x} is not aligned to {:#x}", self.gran()),
            ));
        }
        let p = st
            .phys
            .get(&handle.0)
            .filter(|p| !p.released)
            .ok_or_else(|| inval(call, format!("unknown physical handle {:#x}", handle.0)))?;
        if p.size != bytes {
            return Err(inval(
                call,
                format!(
                    "size {bytes:#x} differs from the handle's size {:#x}",
                    p.size
                ),
            ));
        }
        let end = va
            .checked_add(bytes)
            .ok_or_else(|| inval(call, "range overflows"))?;
        let inside = st
            .reservations
            .range(..=va)
            .next_back()
            .is_some_and(|(&s, &l)| end <= s + l);
        if !inside {
            return Err(inval(
                call,
                format!("[{va:#x}, {end:#x}) is not inside one reservation"),
            ));
        }
        let overlaps_prev = st
            .mappings
            .range(..va)
            .next_back()
            .is_some_and(|(&s, m)| s + m.size > va);
        if overlaps_prev || st.mappings.range(va..end).next().is_some() {
            return Err(inval(
                call,
                format!("[{va:#x}, {end:#x}) overlaps an existing mapping"),
            ));
        }
        st.phys.get_mut(&handle.0).expect("checked").map_count += 1;
        let access = std::iter::once(self.props.ordinal)
            .chain(st.peers.iter().copied())
            .collect();
        st.mappings.insert(
            va,
            Mapping {
                size: bytes,
                handle: handle.0,
                access,
            },
        );
        Ok(())
    }

    fn unmap(&self, va: DevicePtr, bytes: u64) -> Result<()> {
        let call = CallKind::Unmap.name();
        let mut st = self.state.lock();
        st.enter(CallKind::Unmap, None)?;
        st.forbidden_in_capture(CallKind::Unmap)?;
        self.check_gran(call, "size", bytes)?;
        let end = va
            .checked_add(bytes)
            .ok_or_else(|| inval(call, "range overflows"))?;
        // The range must be exactly tiled by whole mappings.
        let (covered, pos) = whole_mappings(&st.mappings, va, end);
        if pos != end {
            return Err(inval(
                call,
                format!("[{va:#x}, {end:#x}) is not exactly covered by whole mappings (gap or split at {pos:#x})"),
            ));
        }
        for s in covered {
            let m = st.mappings.remove(&s).expect("collected above");
            st.phys
                .get_mut(&m.handle)
                .expect("a mapped handle is alive")
                .map_count -= 1;
        }
        Ok(())
    }

    fn pool_create(&self, release_threshold: u64) -> Result<PoolHandle> {
        let mut st = self.state.lock();
        st.enter(CallKind::PoolCreate, None)?;
        let id = st.next_pool;
        st.next_pool += 1;
        st.pools.insert(
            id,
            SimMemPool {
                threshold: release_threshold,
                usage: PoolUsage::default(),
                free: BTreeSet::new(),
                live: 0,
            },
        );
        Ok(PoolHandle(id))
    }

    fn pool_destroy(&self, pool: PoolHandle) -> Result<()> {
        let call = CallKind::PoolDestroy.name();
        let mut st = self.state.lock();
        st.enter(CallKind::PoolDestroy, None)?;
        let p = st
            .pools
            .get(&pool.0)
            .ok_or_else(|| inval(call, format!("unknown pool {:#x}", pool.0)))?;
        if p.live > 0 {
            return Err(inval(
                call,
                format!("pool {:#x} still has {} live allocation(s)", pool.0, p.live),
            ));
        }
        let p = st.pools.remove(&pool.0).expect("checked");
        for (size, ptr) in p.free {
            st.blocks.remove(&ptr);
            st.pool_space.free(ptr);
            st.discharge(size);
        }
        Ok(())
    }

    fn pool_alloc_async(
        &self,
        pool: PoolHandle,
        bytes: u64,
        stream: StreamId,
    ) -> Result<DevicePtr> {
        let call = CallKind::PoolAlloc.name();
        let mut st = self.state.lock();
        st.enter(CallKind::PoolAlloc, Some(bytes))?;
        st.stream(call, stream)?;
        if !st.pools.contains_key(&pool.0) {
            return Err(inval(call, format!("unknown pool {:#x}", pool.0)));
        }
        if bytes == 0 {
            return Err(inval(call, "zero bytes"));
        }
        let size = round_up(bytes, self.gran()).ok_or(DeviceError::OutOfMemory {
            call,
            requested: bytes,
        })?;
        st.progress();
        let reuse = st.pools[&pool.0]
            .free
            .range((size, 0)..)
            .copied()
            .find(|&(_, ptr)| match st.blocks[&ptr].state {
                BlockState::Free { stream: fs, seq } => fs == stream || st.op_done(fs, seq),
                BlockState::Live => false,
            });
        let (bsize, ptr) = match reuse {
            Some((bsize, ptr)) => {
                st.pools
                    .get_mut(&pool.0)
                    .expect("checked")
                    .free
                    .remove(&(bsize, ptr));
                st.blocks.get_mut(&ptr).expect("free block exists").state = BlockState::Live;
                (bsize, ptr)
            }
            None => {
                st.charge(call, size)?;
                let Some(ptr) = st.pool_space.alloc(size, self.gran()) else {
                    st.discharge(size);
                    return Err(DeviceError::OutOfMemory {
                        call,
                        requested: bytes,
                    });
                };
                st.blocks.insert(
                    ptr,
                    PoolBlock {
                        pool: pool.0,
                        size,
                        state: BlockState::Live,
                        data: Sparse::default(),
                    },
                );
                let u = &mut st.pools.get_mut(&pool.0).expect("checked").usage;
                u.reserved_current += size;
                u.reserved_high = u.reserved_high.max(u.reserved_current);
                (size, ptr)
            }
        };
        let p = st.pools.get_mut(&pool.0).expect("checked");
        p.live += 1;
        p.usage.used_current += bsize;
        p.usage.used_high = p.usage.used_high.max(p.usage.used_current);
        st.enqueue(stream);
        st.progress();
        Ok(ptr)
    }

    fn pool_free_async(&self, ptr: DevicePtr, stream: StreamId) -> Result<()> {
        let call = CallKind::PoolFree.name();
        let mut st = self.state.lock();
        st.enter(CallKind::PoolFree, None)?;
        st.stream(call, stream)?;
        let (pool, size) = match st.blocks.get(&ptr) {
            Some(b) if b.state == BlockState::Live => (b.pool, b.size),
            _ => {
                return Err(inval(
                    call,
                    format!("{ptr:#x} is not a live pool allocation"),
                ))
            }
        };
        let seq = st.enqueue(stream);
        st.blocks.get_mut(&ptr).expect("checked").state = BlockState::Free { stream, seq };
        let p = st
            .pools
            .get_mut(&pool)
            .expect("a block's pool is alive while the block is live");
        p.live -= 1;
        p.usage.used_current -= size;
        p.free.insert((size, ptr));
        st.progress();
        Ok(())
    }

    fn pool_trim(&self, pool: PoolHandle, keep: u64) -> Result<()> {
        let call = CallKind::PoolTrim.name();
        let mut st = self.state.lock();
        st.enter(CallKind::PoolTrim, None)?;
        if !st.pools.contains_key(&pool.0) {
            return Err(inval(call, format!("unknown pool {:#x}", pool.0)));
        }
        st.progress();
        st.trim_pool(pool.0, keep);
        Ok(())
    }

    fn pool_usage(&self, pool: PoolHandle) -> Result<PoolUsage> {
        let call = CallKind::PoolUsage.name();
        let mut st = self.state.lock();
        st.enter(CallKind::PoolUsage, None)?;
        st.pools
            .get(&pool.0)
            .map(|p| p.usage)
            .ok_or_else(|| inval(call, format!("unknown pool {:#x}", pool.0)))
    }

    fn stream_create(&self) -> Result<StreamId> {
        let mut st = self.state.lock();
        st.enter(CallKind::StreamCreate, None)?;
        // Past any handle adopted meanwhile (SimConfig::adopt_streams).
        while st.streams.contains_key(&st.next_stream) {
            st.next_stream += 1;
        }
        let id = st.next_stream;
        st.next_stream += 1;
        st.streams.insert(id, Stream::default());
        Ok(id)
    }

    fn stream_destroy(&self, stream: StreamId) -> Result<()> {
        let call = CallKind::StreamDestroy.name();
        let mut st = self.state.lock();
        st.enter(CallKind::StreamDestroy, None)?;
        if stream == 0 {
            return Err(inval(call, "the default stream cannot be destroyed"));
        }
        st.stream(call, stream)?;
        // As in CUDA, queued work still completes; the id is forgotten once nothing refers to it.
        st.streams.get_mut(&stream).expect("validated").destroyed = true;
        st.progress();
        Ok(())
    }

    fn stream_synchronize(&self, stream: StreamId) -> Result<()> {
        let call = CallKind::StreamSynchronize.name();
        let mut st = self.state.lock();
        st.enter(CallKind::StreamSynchronize, None)?;
        st.forbidden_in_capture(CallKind::StreamSynchronize)?;
        st.stream(call, stream)?;
        st.progress();
        let s = &st.streams[&stream];
        if s.completed < s.submitted {
            return Err(inval(
                call,
                format!(
                    "stream {stream:#x} would never complete (paused streams: {:?}); would hang",
                    st.paused_streams()
                ),
            ));
        }
        st.apply_thresholds();
        Ok(())
    }

    fn event_create(&self) -> Result<EventHandle> {
        let mut st = self.state.lock();
        st.enter(CallKind::EventCreate, None)?;
        let id = st.next_event;
        st.next_event += 1;
        st.events.insert(id, Event::default());
        Ok(EventHandle(id))
    }

    fn event_destroy(&self, event: EventHandle) -> Result<()> {
        let call = CallKind::EventDestroy.name();
        let mut st = self.state.lock();
        st.enter(CallKind::EventDestroy, None)?;
        st.events
            .remove(&event.0)
            .ok_or_else(|| inval(call, format!("unknown event {:#x}", event.0)))?;
        st.progress();
        Ok(())
    }

    fn event_record(&self, event: EventHandle, stream: StreamId) -> Result<()> {
        let call = CallKind::EventRecord.name();
        let mut st = self.state.lock();
        st.enter(CallKind::EventRecord, None)?;
        st.stream(call, stream)?;
        if !st.events.contains_key(&event.0) {
            return Err(inval(call, format!("unknown event {:#x}", event.0)));
        }
        if st.capture.stream == Some(stream) {
            // Legal for the driver (the record joins the graph), but its completion can never be
            // learnt: an engine recording a fence here is wrong.
            st.capture.all.push("cuEventRecord on the capturing stream");
        }
        let seq = st.enqueue(stream);
        st.events.get_mut(&event.0).expect("checked").recorded = Some((stream, seq));
        st.progress();
        Ok(())
    }

    fn stream_query(&self, stream: StreamId) -> Result<bool> {
        let call = CallKind::StreamQuery.name();
        let mut st = self.state.lock();
        st.enter(CallKind::StreamQuery, None)?;
        st.forbidden_in_capture(CallKind::StreamQuery)?;
        st.stream(call, stream)?;
        st.progress();
        let s = &st.streams[&stream];
        // A paused stream models work in flight (a kernel still running on the bytes freed there),
        // whether or not anything was submitted through the device seam.
        Ok(!s.paused && s.completed >= s.submitted)
    }

    fn event_query(&self, event: EventHandle) -> Result<bool> {
        let call = CallKind::EventQuery.name();
        let mut st = self.state.lock();
        st.enter(CallKind::EventQuery, None)?;
        st.forbidden_in_capture(CallKind::EventQuery)?;
        st.progress();
        let e = st
            .events
            .get(&event.0)
            .ok_or_else(|| inval(call, format!("unknown event {:#x}", event.0)))?;
        Ok(st.event_done(e))
    }

    fn event_synchronize(&self, event: EventHandle) -> Result<()> {
        let call = CallKind::EventSynchronize.name();
        let mut st = self.state.lock();
        st.enter(CallKind::EventSynchronize, None)?;
        st.forbidden_in_capture(CallKind::EventSynchronize)?;
        st.progress();
        let e = st
            .events
            .get(&event.0)
            .ok_or_else(|| inval(call, format!("unknown event {:#x}", event.0)))?;
        if !st.event_done(e) {
            return Err(inval(
                call,
                format!(
                    "event {:#x} would never complete (paused streams: {:?}); would hang",
                    event.0,
                    st.paused_streams()
                ),
            ));
        }
        st.apply_thresholds();
        Ok(())
    }

    fn stream_wait_event(&self, stream: StreamId, event: EventHandle) -> Result<()> {
        let call = CallKind::StreamWaitEvent.name();
        let mut st = self.state.lock();
        st.enter(CallKind::StreamWaitEvent, None)?;
        st.stream(call, stream)?;
        let e = st
            .events
            .get(&event.0)
            .ok_or_else(|| inval(call, format!("unknown event {:#x}", event.0)))?;
        // Waiting on an event never recorded is a no-op, as in CUDA.
        if let Some((dep_s, dep_seq)) = e.recorded {
            let pos = st.enqueue(stream);
            st.streams
                .get_mut(&stream)
                .expect("validated")
                .waits
                .push_back((pos, dep_s, dep_seq));
            st.progress();
        }
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        let call = CallKind::Synchronize.name();
        let mut st = self.state.lock();
        st.enter(CallKind::Synchronize, None)?;
        st.forbidden_in_capture(CallKind::Synchronize)?;
        st.progress();
        if st.streams.values().any(|s| s.completed < s.submitted) {
            return Err(inval(
                call,
                format!(
                    "device work would never complete (paused streams: {:?}); would hang",
                    st.paused_streams()
                ),
            ));
        }
        st.apply_thresholds();
        Ok(())
    }

    fn write(&self, dst: DevicePtr, data: &[u8]) -> Result<()> {
        self.access(
            CallKind::Write,
            dst,
            data.len() as u64,
            None,
            Access::Write(data),
        )
    }

    fn read(&self, src: DevicePtr, out: &mut [u8]) -> Result<()> {
        let len = out.len() as u64;
        self.access(CallKind::Read, src, len, None, Access::Read(out))
    }

    fn memset_async(&self, dst: DevicePtr, byte: u8, len: u64, stream: StreamId) -> Result<()> {
        self.access(CallKind::Memset, dst, len, Some(stream), Access::Fill(byte))
    }

    fn host_alloc(&self, bytes: u64) -> Result<HostHandle> {
        let call = CallKind::HostAlloc.name();
        let mut st = self.state.lock();
        st.enter(CallKind::HostAlloc, Some(bytes))?;
        if bytes == 0 {
            return Err(inval(call, "zero bytes"));
        }
        let h = st.next_host;
        st.next_host += 1;
        st.hosts.insert(h, (bytes, Sparse::default()));
        Ok(HostHandle(h))
    }

    fn host_free(&self, host: HostHandle) -> Result<()> {
        let call = CallKind::HostFree.name();
        let mut st = self.state.lock();
        st.enter(CallKind::HostFree, None)?;
        match st.hosts.remove(&host.0) {
            Some(_) => Ok(()),
            None => Err(inval(call, format!("unknown pinned buffer {:#x}", host.0))),
        }
    }

    fn copy_to_host(
        &self,
        host: HostHandle,
        offset: u64,
        src: DevicePtr,
        bytes: u64,
    ) -> Result<()> {
        let call = CallKind::CopyToHost.name();
        let mut st = self.state.lock();
        st.enter(CallKind::CopyToHost, None)?;
        st.host_range(call, host, offset, bytes)?;
        let segs = st.segments(call, src, bytes)?;
        if !self.backed {
            return Ok(());
        }
        let mut buf = vec![0u8; bytes as usize];
        let mut done = 0usize;
        for (t, off, n) in segs {
            st.data(t).read(off, &mut buf[done..done + n as usize]);
            done += n as usize;
        }
        st.hosts
            .get_mut(&host.0)
            .expect("checked")
            .1
            .write(offset, &buf);
        Ok(())
    }

    fn copy_from_host(
        &self,
        dst: DevicePtr,
        host: HostHandle,
        offset: u64,
        bytes: u64,
    ) -> Result<()> {
        let call = CallKind::CopyFromHost.name();
        let mut st = self.state.lock();
        st.enter(CallKind::CopyFromHost, None)?;
        st.host_range(call, host, offset, bytes)?;
        let segs = st.segments(call, dst, bytes)?;
        if !self.backed {
            return Ok(());
        }
        let mut buf = vec![0u8; bytes as usize];
        st.hosts[&host.0].1.read(offset, &mut buf);
        let mut done = 0usize;
        for (t, off, n) in segs {
            st.data_mut(t).write(off, &buf[done..done + n as usize]);
            done += n as usize;
        }
        Ok(())
    }

    fn captures(&self) -> &Captures {
        &self.captures
    }

    fn add_peer(&self, peer: usize) -> Result<bool> {
        let call = CallKind::SetAccess.name();
        let mut st = self.state.lock();
        st.enter(CallKind::SetAccess, None)?;
        if peer == self.props.ordinal {
            return Err(inval(call, format!("device {peer} cannot be its own peer")));
        }
        if st.peers.contains(&peer) {
            return Ok(false);
        }
        st.peers.push(peer);
        Ok(true)
    }

    fn set_peer_access(&self, va: DevicePtr, bytes: u64, peer: usize) -> Result<()> {
        let call = CallKind::SetAccess.name();
        let mut st = self.state.lock();
        st.enter(CallKind::SetAccess, None)?;
        self.check_gran(call, "size", bytes)?;
        let end = va
            .checked_add(bytes)
            .ok_or_else(|| inval(call, "range overflows"))?;
        let (covered, pos) = whole_mappings(&st.mappings, va, end);
        if pos != end {
            return Err(inval(
                call,
                format!("[{va:#x}, {end:#x}) is not wholly mapped (gap at {pos:#x})"),
            ));
        }
        for s in covered {
            let m = st.mappings.get_mut(&s).expect("collected above");
            if !m.access.contains(&peer) {
                m.access.push(peer);
            }
        }
        Ok(())
    }

    fn export_handle(&self, handle: PhysHandle) -> Result<i32> {
        let call = CallKind::Export.name();
        let mut st = self.state.lock();
        st.enter(CallKind::Export, None)?;
        let p = st
            .phys
            .get(&handle.0)
            .filter(|p| !p.released)
            .ok_or_else(|| inval(call, format!("unknown physical handle {:#x}", handle.0)))?;
        if p.source.is_some() {
            return Err(inval(
                call,
                format!("handle {:#x} is an import; export the original", handle.0),
            ));
        }
        if let Some(fd) = &p.export {
            return Ok(fd.as_raw_fd());
        }
        let fd = memfd("gen-device-sim-export")?;
        let id = inode_of(call, fd.as_fd())?;
        let raw = fd.as_raw_fd();
        st.phys.get_mut(&handle.0).expect("checked").export = Some(fd);
        st.exports.insert(id, handle.0);
        Ok(raw)
    }

    fn import_handle(&self, fd: BorrowedFd<'_>, bytes: u64) -> Result<PhysHandle> {
        let call = CallKind::Import.name();
        let id = inode_of(call, fd)?;
        let mut st = self.state.lock();
        st.enter(CallKind::Import, None)?;
        let src = *st.exports.get(&id).ok_or_else(|| {
            inval(
                call,
                "the descriptor is not an exported handle of this simulated device",
            )
        })?;
        let size = st.phys[&src].size;
        if size != bytes {
            return Err(inval(
                call,
                format!("size {bytes:#x} differs from the exported handle's {size:#x}"),
            ));
        }
        st.phys
            .get_mut(&src)
            .expect("exported handles are live")
            .imports += 1;
        let h = st.next_phys;
        st.next_phys += 1;
        st.phys.insert(h, Phys::new(size, Some(src)));
        Ok(PhysHandle(h))
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod offset_tests {
    use super::*;

    #[test]
    fn address_offsets_keep_devices_disjoint() {
        let devs: Vec<SimDevice> = (0..3u64)
            .map(|i| {
                SimDevice::config()
                    .ordinal(i as usize)
                    .address_offset(i * ORDINAL_STRIDE)
                    .build()
                    .unwrap()
            })
            .collect();
        for (i, d) in devs.iter().enumerate() {
            let off = i as u64 * ORDINAL_STRIDE;
            let va = d.va_reserve(4 << 20, 0).unwrap();
            assert!((VA_BASE + off..VA_BASE + off + SPACE_SIZE).contains(&va));
            let plain = d.mem_alloc(4096).unwrap();
            assert!((PLAIN_BASE + off..PLAIN_BASE + off + SPACE_SIZE).contains(&plain));
            let pool = d.pool_create(0).unwrap();
            let p = d.pool_alloc_async(pool, 4096, 0).unwrap();
            assert!((POOL_BASE + off..POOL_BASE + off + SPACE_SIZE).contains(&p));
        }
    }

    #[test]
    fn bad_address_offsets_are_refused() {
        let unaligned = SimDevice::config().address_offset(4096).build();
        assert!(matches!(
            unaligned,
            Err(DeviceError::InvalidArgument { .. })
        ));
        let overflow = SimDevice::config()
            .address_offset(u64::MAX - (1 << 21) + 1)
            .build();
        assert!(matches!(overflow, Err(DeviceError::InvalidArgument { .. })));
    }
}
