//! [`StreamCache`]: an exact-size, stream-aware recycler of freed device blocks.
//!
//! # Block states
//! A cached block is in exactly one of three places inside its size's entry:
//! - **ready on S** (`lists`): freed on stream S; safe at once on S (stream order), nowhere else;
//! - **pending** (`pending`): a batch moved out of S's ready list after one event was recorded on S; safe
//!   on S at once, on any stream once the event has completed;
//! - **safe** (`safe`): known idle (event completed, or a host-side synchronize covered its free); safe
//!   on every stream.
//!
//! `take(size, T)` looks, in order, at: T's ready list, the safe list, pending batches from T, completed
//! pending batches (one `event_query` each), and finally migrates other streams' ready lists, one stream
//! at a time, into new pending batches (one `event_record` + one `event_query` each) until one turns
//! out complete already; a stream with a batch of that size in flight is skipped. Only the first three
//! are on the hot path and make no driver call.
//!
//! # The one-stream shortcut
//! While a single stream has ever been seen no migration can happen, so no event is ever recorded. When
//! a second stream shows up, every block then cached is pulled out, one `device.synchronize()` makes
//! them all idle and they go to the safe lists. Blocks freed concurrently after the pull stay on their
//! stream's ready list and obey the general rules, so the shortcut never hands out a block early.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use gen_device::{Device, DeviceError, DevicePtr, EventHandle, StreamId};
use parking_lot::Mutex;

use crate::error::Overflow;
use crate::util::{mix, shard_count, Padded, U64Map};

/// Default number of shards.
const DEFAULT_SHARDS: usize = 16;
/// Entries a shard keeps before it first prunes empty ones.
const MIN_PRUNE: usize = 64;
/// Empty vectors a shard keeps for reuse.
const MAX_SPARE_VECS: usize = 256;

/// No stream seen yet.
const MODE_NONE: u8 = 0;
/// Exactly one stream (in `solo`) seen.
const MODE_SOLO: u8 = 1;
/// Two or more streams seen: the general, event-guarded protocol.
const MODE_MULTI: u8 = 2;

/// Configuration of a [`StreamCache`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamCacheConfig {
    /// Most bytes the cache may hold; a [`StreamCache::put`] that would exceed it fails with
    /// [`Overflow`]. 0 = unbounded.
    pub max_cached_bytes: u64,
    /// Number of lock shards (by size); 0 = default (16). Rounded up to a power of two, at most 1024.
    pub shards: usize,
    /// Use the one-stream shortcut (no events while one stream has been seen; one
    /// `device.synchronize()` when the second appears). When false, blocks cached before the second
    /// stream appeared migrate with events like any others.
    pub single_stream_sync: bool,
}

impl Default for StreamCacheConfig {
    fn default() -> Self {
        StreamCacheConfig {
            max_cached_bytes: 0,
            shards: 0,
            single_stream_sync: true,
        }
    }
}

/// Counters of a [`StreamCache`] (monotonic since creation, except the two `cached_*` figures).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamCacheStats {
    /// `take` calls that returned a block.
    pub hits: u64,
    /// `take` calls that returned `None`.
    pub misses: u64,
    /// `put` calls that cached their block.
    pub puts: u64,
    /// `put` calls refused with [`Overflow`].
    pub overflows: u64,
    /// Batches moved from one stream's ready list to a pending list under a new event.
    pub migrations: u64,
    /// Blocks moved by those migrations.
    pub migrated_blocks: u64,
    /// `event_record` calls.
    pub events_recorded: u64,
    /// `event_query` calls.
    pub event_queries: u64,
    /// `synchronize`/`stream_synchronize` calls (one-stream shortcut and drains).
    pub syncs: u64,
    /// Device calls that failed (the latest error: [`StreamCache::take_last_error`]).
    pub device_errors: u64,
    /// Bytes cached now.
    pub cached_bytes: u64,
    /// Blocks cached now.
    pub cached_blocks: u64,
}

/// Freed blocks of one size that were freed on one stream.
struct StreamList {
    stream: StreamId,
    ptrs: Vec<DevicePtr>,
}

/// Blocks moved out of `src`'s ready list, safe everywhere once `event` (recorded on `src` after all
/// their frees) has completed.
struct Pending {
    src: StreamId,
    event: EventHandle,
    ptrs: Vec<DevicePtr>,
}

/// Everything cached of one size.
#[derive(Default)]
struct SizeEntry {
    lists: Vec<StreamList>,
    safe: Vec<DevicePtr>,
    pending: Vec<Pending>,
}

impl SizeEntry {
    fn is_empty(&self) -> bool {
        self.safe.is_empty()
            && self.pending.is_empty()
            && self.lists.iter().all(|l| l.ptrs.is_empty())
    }

    fn blocks(&self) -> usize {
        self.safe.len()
            + self.pending.iter().map(|p| p.ptrs.len()).sum::<usize>()
            + self.lists.iter().map(|l| l.ptrs.len()).sum::<usize>()
    }

    /// Ready list of `stream`, created (with a recycled vector) if absent.
    #[inline]
    fn list_mut(
        &mut self,
        stream: StreamId,
        spare: &mut Vec<Vec<DevicePtr>>,
    ) -> &mut Vec<DevicePtr> {
        let i = match self.lists.iter().position(|l| l.stream == stream) {
            Some(i) => i,
            None => {
                self.lists.push(StreamList {
                    stream,
                    ptrs: spare.pop().unwrap_or_default(),
                });
                self.lists.len() - 1
            }
        };
        &mut self.lists[i].ptrs
    }

    /// Hot-path take: T's ready list, the safe list, pending batches from T. No driver calls.
    #[inline]
    fn take_local(&mut self, stream: StreamId) -> Option<DevicePtr> {
        if let Some(l) = self.lists.iter_mut().find(|l| l.stream == stream) {
            if let Some(p) = l.ptrs.pop() {
                return Some(p);
            }
        }
        if let Some(p) = self.safe.pop() {
            return Some(p);
        }
        self.pending
            .iter_mut()
            .filter(|b| b.src == stream)
            .find_map(|b| b.ptrs.pop())
    }
}

/// Per-shard counters, updated under the shard lock (no atomics on the hot path).
#[derive(Default, Clone, Copy)]
struct ShardStats {
    hits: u64,
    misses: u64,
    puts: u64,
    migrations: u64,
    migrated_blocks: u64,
    events_recorded: u64,
    event_queries: u64,
}

#[derive(Default)]
struct Shard {
    sizes: U64Map<SizeEntry>,
    spare_vecs: Vec<Vec<DevicePtr>>,
    prune_at: usize,
    stats: ShardStats,
}

impl Shard {
    /// The entry of `size`, created if absent. Before the map grows past `prune_at` entries, empty
    /// entries are dropped (their vectors recycled), so a workload with ever-new sizes keeps the map
    /// proportional to what is cached while a steady workload never re-allocates.
    /// Also returns the spare vectors, a disjoint borrow.
    #[inline]
    fn entry(&mut self, size: u64) -> (&mut SizeEntry, &mut Vec<Vec<DevicePtr>>) {
        if self.sizes.len() >= self.prune_at.max(MIN_PRUNE) && !self.sizes.contains_key(&size) {
            self.prune();
        }
        let Shard {
            sizes, spare_vecs, ..
        } = self;
        (sizes.entry(size).or_default(), spare_vecs)
    }

    fn prune(&mut self) {
        let Shard {
            sizes, spare_vecs, ..
        } = self;
        sizes.retain(|_, e| {
            let keep = !e.is_empty();
            if !keep {
                for l in e.lists.drain(..) {
                    if spare_vecs.len() < MAX_SPARE_VECS {
                        spare_vecs.push(l.ptrs);
                    }
                }
            }
            keep
        });
        self.prune_at = (2 * self.sizes.len()).max(MIN_PRUNE);
    }
}

/// A shard and the bytes it caches. `bytes` is written only with `lock` held (a plain load + store, no
/// locked instruction) and read without it by [`StreamCache::cached_bytes`].
#[derive(Default)]
struct ShardCell {
    lock: Mutex<Shard>,
    bytes: AtomicU64,
}

impl ShardCell {
    /// Adds `n` to the shard's bytes. Call with `lock` held.
    #[inline]
    fn add(&self, n: u64) {
        let b = self.bytes.load(Ordering::Relaxed);
        self.bytes.store(b.wrapping_add(n), Ordering::Relaxed);
    }

    /// Subtracts `n` from the shard's bytes. Call with `lock` held.
    #[inline]
    fn sub(&self, n: u64) {
        let b = self.bytes.load(Ordering::Relaxed);
        self.bytes.store(b.wrapping_sub(n), Ordering::Relaxed);
    }
}

/// A group of blocks pulled out of the cache by a drain or the one-stream shortcut.
struct Group {
    shard: usize,
    size: u64,
    /// `None`: from a safe list; `Some(s)`: ready on / pending from stream `s`.
    stream: Option<StreamId>,
    /// The pending batch's event, if the group was one.
    event: Option<EventHandle>,
    ptrs: Vec<DevicePtr>,
}

/// A thread-safe, exact-size recycler of freed device blocks keyed by `(stream, size)`, obeying the
/// stream rules: a block freed on S is reused at once on S, and on another stream only after an event
/// recorded on S after its free has completed (see the [crate docs](crate)).
///
/// The cache owns no memory: it holds addresses its caller freed and hands them back through
/// [`take`](Self::take) or [`drain`](Self::drain). It cannot detect a block put twice (the caller's
/// bookkeeping does, e.g. [`DriverPool`](crate::DriverPool)'s live map). Dropping a non-empty cache
/// forgets its blocks (they stay allocated in whatever tier they came from) and destroys its events.
pub struct StreamCache {
    device: Arc<dyn Device>,
    cfg: StreamCacheConfig,
    shards: Box<[Padded<ShardCell>]>,
    shard_mask: u64,
    /// Bytes cached, kept only when the cache is bounded (the bound is checked against it).
    cached: Padded<AtomicU64>,
    mode: AtomicU8,
    solo: AtomicU64,
    /// Serialises the one-stream shortcut against drains.
    transition: Mutex<()>,
    /// Idle events for reuse. Lock order: a shard lock, then this.
    events: Mutex<Vec<EventHandle>>,
    overflows: AtomicU64,
    syncs: AtomicU64,
    device_errors: AtomicU64,
    last_error: Mutex<Option<DeviceError>>,
}

impl std::fmt::Debug for StreamCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamCache")
            .field("cfg", &self.cfg)
            .field("shards", &self.shards.len())
            .field("cached_bytes", &self.cached_bytes())
            .finish_non_exhaustive()
    }
}

impl StreamCache {
    /// A cache in front of blocks of `device`, which it uses for events and synchronization only.
    pub fn new(device: Arc<dyn Device>, cfg: StreamCacheConfig) -> Self {
        let n = shard_count(cfg.shards, DEFAULT_SHARDS);
        let shards = (0..n).map(|_| Padded(ShardCell::default())).collect();
        StreamCache {
            device,
            cfg,
            shards,
            shard_mask: n as u64 - 1,
            cached: Padded(AtomicU64::new(0)),
            mode: AtomicU8::new(MODE_NONE),
            solo: AtomicU64::new(0),
            transition: Mutex::new(()),
            events: Mutex::new(Vec::new()),
            overflows: AtomicU64::new(0),
            syncs: AtomicU64::new(0),
            device_errors: AtomicU64::new(0),
            last_error: Mutex::new(None),
        }
    }

    /// The configuration this cache was built with.
    pub fn config(&self) -> &StreamCacheConfig {
        &self.cfg
    }

    /// The device this cache records events on.
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }

    #[inline]
    fn shard_index(&self, size: u64) -> usize {
        // Masked to at most 1023: the cast cannot truncate.
        (mix(size) & self.shard_mask) as usize
    }

    /// Cache the block `[ptr, ptr + size)` freed on `stream`. Fails with [`Overflow`] when it would take
    /// the cache over [`StreamCacheConfig::max_cached_bytes`]; the caller then frees it for real.
    #[inline]
    pub fn put(&self, ptr: DevicePtr, size: u64, stream: StreamId) -> Result<(), Overflow> {
        self.put_inner(ptr, size, stream, false)
    }

    /// [`put`](Self::put) past the bound: for a caller that may not release the block yet (work on
    /// `stream` may still use it and its tier could hand it to another stream). The bytes still count,
    /// so later bounded puts overflow until a drain or takes bring the cache back under its bound.
    pub fn put_over_bound(&self, ptr: DevicePtr, size: u64, stream: StreamId) {
        // Cannot fail: the bound is not checked.
        let _ = self.put_inner(ptr, size, stream, true);
    }

    fn put_inner(
        &self,
        ptr: DevicePtr,
        size: u64,
        stream: StreamId,
        over_bound: bool,
    ) -> Result<(), Overflow> {
        self.observe(stream);
        let max = self.cfg.max_cached_bytes;
        if max != 0 && over_bound {
            self.cached.fetch_add(size, Ordering::Relaxed);
        } else if max != 0 {
            // Reserve the bytes first, so concurrent puts never overshoot the bound together.
            let fits = |cur: u64| cur.checked_add(size).filter(|&total| total <= max);
            if let Err(cached) =
                self.cached
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, fits)
            {
                self.overflows.fetch_add(1, Ordering::Relaxed);
                return Err(Overflow { size, cached, max });
            }
        }
        let cell = &self.shards[self.shard_index(size)];
        let mut guard = cell.lock.lock();
        cell.add(size);
        let shard = &mut *guard;
        shard.stats.puts += 1;
        let (entry, spare) = shard.entry(size);
        entry.list_mut(stream, spare).push(ptr);
        Ok(())
    }

    /// A cached block of exactly `size` bytes that is safe to use on `stream`, if there is one.
    ///
    /// Blocks freed on `stream` come back at once; blocks freed on other streams only through an
    /// event-guarded migration once their event has completed (which may take a later call).
    #[inline]
    pub fn take(&self, size: u64, stream: StreamId) -> Option<DevicePtr> {
        self.observe(stream);
        let cell = &self.shards[self.shard_index(size)];
        let mut guard = cell.lock.lock();
        let Shard {
            sizes,
            spare_vecs,
            stats,
            ..
        } = &mut *guard;
        let found = match sizes.get_mut(&size) {
            None => None,
            Some(entry) => match entry.take_local(stream) {
                Some(p) => Some(p),
                None => self.take_slow(entry, stream, spare_vecs, stats),
            },
        };
        match found {
            Some(p) => {
                stats.hits += 1;
                cell.sub(size);
                drop(guard);
                if self.cfg.max_cached_bytes != 0 {
                    self.cached.fetch_sub(size, Ordering::Relaxed);
                }
                Some(p)
            }
            None => {
                stats.misses += 1;
                None
            }
        }
    }

    /// The miss path of `take`: poll pending batches, else migrate one other stream's ready list.
    #[cold]
    fn take_slow(
        &self,
        entry: &mut SizeEntry,
        stream: StreamId,
        spare: &mut Vec<Vec<DevicePtr>>,
        stats: &mut ShardStats,
    ) -> Option<DevicePtr> {
        if self.capturing() {
            // Event queries and records (a migration's event could land in the graph) wait.
            return None;
        }
        // 1. Pending batches whose event has completed become safe everywhere.
        let mut i = 0;
        while i < entry.pending.len() {
            stats.event_queries += 1;
            match self.device.event_query(entry.pending[i].event) {
                Ok(true) => {
                    let mut batch = entry.pending.swap_remove(i);
                    entry.safe.append(&mut batch.ptrs);
                    recycle_vec(spare, batch.ptrs);
                    self.events.lock().push(batch.event);
                }
                Ok(false) => i += 1,
                Err(e) => {
                    self.record_error(e);
                    i += 1;
                }
            }
        }
        if let Some(p) = entry.safe.pop() {
            return Some(p);
        }
        // 2. Migrate the ready list of another stream with no batch of this size in flight, one stream
        //    at a time until a batch completes at once (streams are few; each try is one record + one
        //    query, and a stream already in flight is skipped).
        loop {
            let src_index = entry.lists.iter().position(|l| {
                l.stream != stream
                    && !l.ptrs.is_empty()
                    && !entry.pending.iter().any(|b| b.src == l.stream)
            })?;
            let src = entry.lists[src_index].stream;
            let event = self.get_event()?;
            stats.events_recorded += 1;
            if let Err(e) = self.device.event_record(event, src) {
                self.record_error(e);
                self.events.lock().push(event);
                return None;
            }
            let fresh = spare.pop().unwrap_or_default();
            let mut ptrs = std::mem::replace(&mut entry.lists[src_index].ptrs, fresh);
            stats.migrations += 1;
            stats.migrated_blocks += ptrs.len() as u64;
            // The stream is often idle already: one query may complete the migration right away.
            stats.event_queries += 1;
            match self.device.event_query(event) {
                Ok(true) => {
                    entry.safe.append(&mut ptrs);
                    recycle_vec(spare, ptrs);
                    self.events.lock().push(event);
                    return entry.safe.pop();
                }
                other => {
                    if let Err(e) = other {
                        self.record_error(e);
                    }
                    entry.pending.push(Pending { src, event, ptrs });
                }
            }
        }
    }

    /// An idle event: a recycled one or a new one (`None` if the device cannot make one).
    fn get_event(&self) -> Option<EventHandle> {
        if let Some(e) = self.events.lock().pop() {
            return Some(e);
        }
        match self.device.event_create() {
            Ok(e) => Some(e),
            Err(e) => {
                self.record_error(e);
                None
            }
        }
    }

    /// Hand every cached block to `f(ptr, size)`, first making each one idle on the device: the streams
    /// its blocks were freed on are synchronized (one `stream_synchronize` per stream; blocks on the
    /// safe lists need none). For memory pressure and trimming. Returns the bytes handed back.
    ///
    /// If a synchronize fails, the blocks of that stream stay cached and the first error is returned
    /// after every other block has been handed back. `f` runs with no lock of this cache held.
    pub fn drain(&self, f: &mut dyn FnMut(DevicePtr, u64)) -> Result<u64, DeviceError> {
        if self.capturing() {
            return Ok(0);
        }
        let transition = self.transition.lock();
        let groups = self.extract_all();
        // Synchronize each stream that has blocks once.
        let mut streams: Vec<StreamId> = groups.iter().filter_map(|g| g.stream).collect();
        streams.sort_unstable();
        streams.dedup();
        let mut failed: Vec<StreamId> = Vec::new();
        let mut first_err = None;
        for &s in &streams {
            self.syncs.fetch_add(1, Ordering::Relaxed);
            if let Err(e) = self.device.stream_synchronize(s) {
                self.record_error(e.clone());
                first_err.get_or_insert(e);
                failed.push(s);
            }
        }
        // Put back what could not be made safe; keep the rest.
        let mut out = Vec::with_capacity(groups.len());
        for g in groups {
            match g.stream {
                Some(s) if failed.contains(&s) => self.restore(g),
                _ => out.push(g),
            }
        }
        drop(transition);
        let bytes = self.hand_back(out, &mut |p, size, _| f(p, size));
        first_err.map_or(Ok(bytes), Err)
    }

    /// Hand cached blocks to `f(ptr, size)`, largest sizes first, until at least `min_bytes` have been
    /// handed back (or the cache is empty); the rest stay cached. For memory pressure that needs only
    /// part of the cache: large blocks free the most pages per block, and the small ones a training loop
    /// reuses most often stay hot. Each block handed back is safe on every stream the caller may give it
    /// to: while a single stream has been seen none can be handed to another stream before the cache
    /// synchronizes the device on the second stream's first appearance, so no device call is made;
    /// otherwise each stream involved is synchronized once (on failure its blocks stay cached and the
    /// first error is returned). Returns the bytes handed back. `f` runs with no lock of this cache held.
    pub fn drain_at_least(
        &self,
        min_bytes: u64,
        f: &mut dyn FnMut(DevicePtr, u64),
    ) -> Result<u64, DeviceError> {
        if self.capturing() {
            return Ok(0);
        }
        let transition = self.transition.lock();
        let mut groups = self.extract_all();
        groups.sort_unstable_by_key(|g| std::cmp::Reverse(g.size));
        let mut chosen = Vec::new();
        let mut bytes = 0u64;
        for g in groups {
            if bytes < min_bytes && !g.ptrs.is_empty() {
                bytes = bytes.saturating_add(g.size.saturating_mul(g.ptrs.len() as u64));
                chosen.push(g);
            } else {
                self.restore(g);
            }
        }
        let mut first_err = None;
        {
            let mut streams: Vec<StreamId> = chosen.iter().filter_map(|g| g.stream).collect();
            streams.sort_unstable();
            streams.dedup();
            let mut failed: Vec<StreamId> = Vec::new();
            for &s in &streams {
                self.syncs.fetch_add(1, Ordering::Relaxed);
                if let Err(e) = self.device.stream_synchronize(s) {
                    self.record_error(e.clone());
                    first_err.get_or_insert(e);
                    failed.push(s);
                }
            }
            if !failed.is_empty() {
                let (keep, back): (Vec<_>, Vec<_>) = chosen
                    .into_iter()
                    .partition(|g| !g.stream.is_some_and(|s| failed.contains(&s)));
                for g in back {
                    self.restore(g);
                }
                chosen = keep;
            }
        }
        drop(transition);
        let bytes = self.hand_back(chosen, &mut |p, size, _| f(p, size));
        first_err.map_or(Ok(bytes), Err)
    }

    /// Hand every cached block to `f(ptr, size, stream)` as it is, with no device call: `stream` is
    /// `Some(s)` when work queued on `s` (the stream it was freed on) may still use the block, `None`
    /// when it is idle. The caller must release a `Some(s)` block in `s`'s order (e.g.
    /// `pool_free_async(ptr, s)`) or wait for `s` first. Returns the bytes handed back. `f` runs with no
    /// lock of this cache held.
    pub fn drain_unsynced(&self, f: &mut dyn FnMut(DevicePtr, u64, Option<StreamId>)) -> u64 {
        let groups = {
            let _t = self.transition.lock();
            self.extract_all()
        };
        self.hand_back(groups, f)
    }

    /// Pulls every block out of every shard. Called with `transition` held.
    fn extract_all(&self) -> Vec<Group> {
        let mut groups = Vec::new();
        for (si, cell) in self.shards.iter().enumerate() {
            let mut guard = cell.lock.lock();
            let first = groups.len();
            for (&size, entry) in guard.sizes.iter_mut() {
                if !entry.safe.is_empty() {
                    groups.push(Group {
                        shard: si,
                        size,
                        stream: None,
                        event: None,
                        ptrs: std::mem::take(&mut entry.safe),
                    });
                }
                for l in entry.lists.iter_mut().filter(|l| !l.ptrs.is_empty()) {
                    groups.push(Group {
                        shard: si,
                        size,
                        stream: Some(l.stream),
                        event: None,
                        ptrs: std::mem::take(&mut l.ptrs),
                    });
                }
                for b in entry.pending.drain(..) {
                    groups.push(Group {
                        shard: si,
                        size,
                        // A batch emptied by takes on its own stream holds only an event to recycle.
                        stream: (!b.ptrs.is_empty()).then_some(b.src),
                        event: Some(b.event),
                        ptrs: b.ptrs,
                    });
                }
            }
            guard.prune();
            cell.sub(group_bytes(&groups[first..]));
        }
        groups
    }

    /// Gives extracted groups to `f`, uncounts their bytes and recycles their events.
    fn hand_back(
        &self,
        groups: Vec<Group>,
        f: &mut dyn FnMut(DevicePtr, u64, Option<StreamId>),
    ) -> u64 {
        let mut bytes = 0u64;
        let mut idle_events = Vec::new();
        for g in groups {
            for &p in &g.ptrs {
                f(p, g.size, g.stream);
            }
            let n = g.size.wrapping_mul(g.ptrs.len() as u64);
            if self.cfg.max_cached_bytes != 0 {
                self.cached.fetch_sub(n, Ordering::Relaxed);
            }
            bytes = bytes.wrapping_add(n);
            // Re-recording an event whose last record has not completed is allowed (the new record
            // replaces it), so pending events can be reused at once.
            idle_events.extend(g.event);
        }
        self.events.lock().extend(idle_events);
        bytes
    }

    /// Puts a group pulled out by `drain` or the one-stream shortcut back where it came from.
    fn restore(&self, g: Group) {
        let cell = &self.shards[g.shard];
        let mut guard = cell.lock.lock();
        cell.add(g.size.wrapping_mul(g.ptrs.len() as u64));
        let (entry, spare) = guard.entry(g.size);
        match (g.stream, g.event) {
            (Some(src), Some(event)) => entry.pending.push(Pending {
                src,
                event,
                ptrs: g.ptrs,
            }),
            (Some(s), None) => entry.list_mut(s, spare).extend(g.ptrs),
            (None, event) => {
                entry.safe.extend(g.ptrs);
                self.events.lock().extend(event);
            }
        }
    }

    /// Bytes cached now.
    #[inline]
    pub fn cached_bytes(&self) -> u64 {
        self.shards
            .iter()
            .fold(0u64, |a, c| a.wrapping_add(c.bytes.load(Ordering::Relaxed)))
    }

    /// Counters (sums over shards, each read under its lock).
    pub fn stats(&self) -> StreamCacheStats {
        let mut s = StreamCacheStats {
            overflows: self.overflows.load(Ordering::Relaxed),
            syncs: self.syncs.load(Ordering::Relaxed),
            device_errors: self.device_errors.load(Ordering::Relaxed),
            cached_bytes: self.cached_bytes(),
            ..StreamCacheStats::default()
        };
        for cell in self.shards.iter() {
            let g = cell.lock.lock();
            let t = g.stats;
            s.hits += t.hits;
            s.misses += t.misses;
            s.puts += t.puts;
            s.migrations += t.migrations;
            s.migrated_blocks += t.migrated_blocks;
            s.events_recorded += t.events_recorded;
            s.event_queries += t.event_queries;
            s.cached_blocks += g.sizes.values().map(|e| e.blocks() as u64).sum::<u64>();
        }
        s
    }

    /// The most recent device error met on a path that cannot return one (`take`, `put`, `Drop`),
    /// cleared by this call. Such errors turn into misses; [`StreamCacheStats::device_errors`] counts
    /// them.
    pub fn take_last_error(&self) -> Option<DeviceError> {
        self.last_error.lock().take()
    }

    fn record_error(&self, e: DeviceError) {
        log::warn!("gen-stream cache: {e}");
        self.device_errors.fetch_add(1, Ordering::Relaxed);
        *self.last_error.lock() = Some(e);
    }

    /// Whether a CUDA graph capture is underway on the device: the cache then makes no call it forbids
    /// (no event query or record, no synchronize; drains hand back nothing).
    #[inline]
    fn capturing(&self) -> bool {
        self.device.captures().active()
    }

    /// Notes that `stream` is in use; the first sight of a second stream runs the one-stream shortcut.
    #[inline]
    fn observe(&self, stream: StreamId) {
        match self.mode.load(Ordering::Acquire) {
            MODE_MULTI => {}
            MODE_SOLO if self.solo.load(Ordering::Relaxed) == stream => {}
            _ => self.observe_slow(stream),
        }
    }

    #[cold]
    fn observe_slow(&self, stream: StreamId) {
        let _t = self.transition.lock();
        match self.mode.load(Ordering::Acquire) {
            MODE_NONE => {
                self.solo.store(stream, Ordering::Relaxed);
                self.mode.store(MODE_SOLO, Ordering::Release);
            }
            MODE_SOLO if self.solo.load(Ordering::Relaxed) != stream => {
                // From here on, blocks freed on any stream follow the general rules.
                self.mode.store(MODE_MULTI, Ordering::Release);
                if self.cfg.single_stream_sync {
                    self.promote_all();
                }
            }
            _ => {}
        }
    }

    /// The one-stream shortcut: pull every ready block out, synchronize the device once (their frees
    /// all came before it), then publish them as safe everywhere. Called with `transition` held.
    fn promote_all(&self) {
        if self.capturing() {
            // The synchronize is forbidden: cached blocks stay on their streams' lists (correct).
            return;
        }
        let mut groups = Vec::new();
        for (si, cell) in self.shards.iter().enumerate() {
            let mut guard = cell.lock.lock();
            let first = groups.len();
            for (&size, entry) in guard.sizes.iter_mut() {
                for l in entry.lists.iter_mut().filter(|l| !l.ptrs.is_empty()) {
                    groups.push(Group {
                        shard: si,
                        size,
                        stream: Some(l.stream),
                        event: None,
                        ptrs: std::mem::take(&mut l.ptrs),
                    });
                }
            }
            cell.sub(group_bytes(&groups[first..]));
        }
        if groups.is_empty() {
            return;
        }
        self.syncs.fetch_add(1, Ordering::Relaxed);
        let ok = match self.device.synchronize() {
            Ok(()) => true,
            Err(e) => {
                self.record_error(e);
                false
            }
        };
        for mut g in groups {
            if ok {
                g.stream = None;
            }
            self.restore(g);
        }
    }
}

/// Bytes in `groups`.
fn group_bytes(groups: &[Group]) -> u64 {
    groups.iter().fold(0u64, |a, g| {
        a.wrapping_add(g.size.wrapping_mul(g.ptrs.len() as u64))
    })
}

/// Keep an emptied vector (with its capacity) for reuse, up to a bound.
#[inline]
fn recycle_vec(spare: &mut Vec<Vec<DevicePtr>>, mut v: Vec<DevicePtr>) {
    if spare.len() < MAX_SPARE_VECS {
        v.clear();
        spare.push(v);
    }
}

impl Drop for StreamCache {
    fn drop(&mut self) {
        let mut events = std::mem::take(&mut *self.events.lock());
        for cell in self.shards.iter() {
            let mut g = cell.lock.lock();
            for entry in g.sizes.values_mut() {
                events.extend(entry.pending.drain(..).map(|b| b.event));
            }
        }
        for e in events {
            if let Err(err) = self.device.event_destroy(e) {
                // Nobody is left to surface it to.
                log::error!("gen-stream cache: dropping event {e:?}: {err}");
            }
        }
    }
}
