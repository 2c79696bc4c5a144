//! [`DriverPool`]: the mid-lived tier over a private stream-ordered pool, with a [`StreamCache`] in front.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use gen_device::{Device, DeviceError, DevicePtr, PoolHandle, PoolUsage, StreamId};
use parking_lot::Mutex;

use crate::cache::{StreamCache, StreamCacheConfig, StreamCacheStats};
use crate::error::{InvalidFreeReason, StreamError};
use crate::util::{mix, shard_count, Padded, U64Map};

/// Default number of shards of the live-pointer map.
const DEFAULT_MAP_SHARDS: usize = 32;

/// Configuration of a [`DriverPool`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverPoolConfig {
    /// The pool's release threshold (`CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`): memory it keeps at a
    /// synchronization point instead of returning it to the driver. `u64::MAX` (the default) keeps
    /// everything; [`DriverPool::trim`] returns it under memory pressure.
    pub release_threshold: u64,
    /// Sizes are rounded up to a multiple of this (a power of two; default 512, PyTorch's rounding),
    /// which lets the exact-size cache serve near-equal requests.
    pub round_to: u64,
    /// The front cache.
    pub cache: StreamCacheConfig,
    /// Shards of the live-pointer map; 0 = default (32).
    pub map_shards: usize,
}

impl Default for DriverPoolConfig {
    fn default() -> Self {
        DriverPoolConfig {
            release_threshold: u64::MAX,
            round_to: 512,
            cache: StreamCacheConfig::default(),
            map_shards: 0,
        }
    }
}

/// Figures of a [`DriverPool`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DriverPoolStats {
    /// Bytes handed out and not freed (rounded sizes).
    pub live_bytes: u64,
    /// Blocks handed out and not freed.
    pub live_blocks: u64,
    /// Bytes in the front cache.
    pub cached_bytes: u64,
    /// Successful `alloc` calls.
    pub allocs: u64,
    /// Successful `free` calls.
    pub frees: u64,
    /// `pool_alloc_async` calls that succeeded (allocations the cache did not serve).
    pub pool_allocs: u64,
    /// `pool_free_async` calls that succeeded (cache overflow and trims).
    pub pool_frees: u64,
    /// Allocations that hit `OutOfMemory` and were retried after a drain and trim.
    pub oom_retries: u64,
    /// [`DriverPool::trim`] calls (including those of the out-of-memory path).
    pub trims: u64,
    /// The driver's view of the pool (`None` if `pool_usage` failed; see
    /// [`DriverPool::take_last_error`]).
    pub pool: Option<PoolUsage>,
    /// The front cache's counters.
    pub cache: StreamCacheStats,
}

/// One pool block known to the tier.
#[derive(Clone, Copy)]
struct Block {
    size: u64,
    /// Stream of the allocation while live; stream of the free while cached.
    stream: StreamId,
    cached: bool,
}

#[derive(Default)]
struct MapShard {
    blocks: U64Map<Block>,
    live_bytes: u64,
    live_blocks: u64,
    allocs: u64,
    frees: u64,
}

/// The mid-lived tier: stream-ordered allocation from a private pool (`cuMemPoolCreate`, never the
/// device's default pool), with a [`StreamCache`] in front so that the steady state makes no driver
/// call.
///
/// - `alloc` = cache take, else `pool_alloc_async(pool, size, stream)`; on `OutOfMemory`:
///   [`trim(0)`](Self::trim) and one retry.
/// - `free` = cache put on the caller's stream, or `pool_free_async` on that stream when the cache is
///   over its bound.
/// - A map of every block the tier holds (live or cached: `ptr → size, stream`) answers
///   [`owns`](Self::owns) and turns unknown and double frees into [`StreamError::InvalidFree`].
///
/// Dropping the pool frees its cached blocks into it and destroys it (`cuMemPoolDestroy`; the driver
/// releases the memory once outstanding stream work is done): free every live block first. [`close`](Self::close) does the same
/// and returns the errors that `Drop` can only log.
pub struct DriverPool {
    device: Arc<dyn Device>,
    pool: PoolHandle,
    cache: StreamCache,
    round_mask: u64,
    map: Box<[Padded<Mutex<MapShard>>]>,
    map_mask: u64,
    pool_allocs: AtomicU64,
    pool_frees: AtomicU64,
    oom_retries: AtomicU64,
    trims: AtomicU64,
    last_error: Mutex<Option<DeviceError>>,
    destroyed: bool,
}

impl std::fmt::Debug for DriverPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DriverPool")
            .field("pool", &self.pool)
            .field("cache", &self.cache)
            .finish_non_exhaustive()
    }
}

impl DriverPool {
    /// Create the tier: a private pool on `device` with `cfg.release_threshold`.
    pub fn new(device: Arc<dyn Device>, cfg: DriverPoolConfig) -> Result<Self, StreamError> {
        if cfg.round_to == 0 || !cfg.round_to.is_power_of_two() {
            return Err(StreamError::Config("round_to must be a power of two"));
        }
        if !device.props().supports_pools {
            return Err(DeviceError::Unsupported("pool_create").into());
        }
        let pool = device.pool_create(cfg.release_threshold)?;
        let n = shard_count(cfg.map_shards, DEFAULT_MAP_SHARDS);
        Ok(DriverPool {
            cache: StreamCache::new(Arc::clone(&device), cfg.cache),
            device,
            pool,
            round_mask: cfg.round_to - 1,
            map: (0..n)
                .map(|_| Padded(Mutex::new(MapShard::default())))
                .collect(),
            map_mask: n as u64 - 1,
            pool_allocs: AtomicU64::new(0),
            pool_frees: AtomicU64::new(0),
            oom_retries: AtomicU64::new(0),
            trims: AtomicU64::new(0),
            last_error: Mutex::new(None),
            destroyed: false,
        })
    }

    /// The driver pool.
    pub fn pool(&self) -> PoolHandle {
        self.pool
    }

    /// The front cache.
    pub fn cache(&self) -> &StreamCache {
        &self.cache
    }

    #[inline]
    fn shard(&self, ptr: DevicePtr) -> &Mutex<MapShard> {
        // Masked to at most 1023: the cast cannot truncate.
        &self.map[(mix(ptr) & self.map_mask) as usize]
    }

    /// The size this pool really allocates for a request of `size` bytes.
    pub fn rounded(&self, size: u64) -> Result<u64, StreamError> {
        if size == 0 {
            return Err(StreamError::ZeroSize);
        }
        size.checked_add(self.round_mask)
            .map(|s| s & !self.round_mask)
            .ok_or(StreamError::TooLarge(size))
    }

    /// Allocate `size` bytes for use on `stream` (stream-ordered: usable by work queued on `stream`
    /// from now on).
    pub fn alloc(&self, size: u64, stream: StreamId) -> Result<DevicePtr, StreamError> {
        let size = self.rounded(size)?;
        if let Some(ptr) = self.cache.take(size, stream) {
            let mut g = self.shard(ptr).lock();
            g.blocks.insert(
                ptr,
                Block {
                    size,
                    stream,
                    cached: false,
                },
            );
            g.live_bytes += size;
            g.live_blocks += 1;
            g.allocs += 1;
            return Ok(ptr);
        }
        let ptr = match self.device.pool_alloc_async(self.pool, size, stream) {
            Ok(p) => p,
            Err(e) if e.is_oom() => {
                self.oom_retries.fetch_add(1, Ordering::Relaxed);
                if let Err(t) = self.trim(0) {
                    // Already recorded by `trim`; retry anyway, it may have released part of the cache.
                    log::warn!("gen-stream pool: trim before retry: {t}");
                }
                self.device.pool_alloc_async(self.pool, size, stream)?
            }
            Err(e) => return Err(e.into()),
        };
        self.pool_allocs.fetch_add(1, Ordering::Relaxed);
        let mut g = self.shard(ptr).lock();
        g.blocks.insert(
            ptr,
            Block {
                size,
                stream,
                cached: false,
            },
        );
        g.live_bytes += size;
        g.live_blocks += 1;
        g.allocs += 1;
        Ok(ptr)
    }

    /// Free `ptr` on `stream`: work already queued on `stream` may still use it. The block is reused at
    /// once on `stream`, on other streams only after an event says that work is done.
    pub fn free(&self, ptr: DevicePtr, stream: StreamId) -> Result<(), StreamError> {
        let size = {
            let mut g = self.shard(ptr).lock();
            let b = match g.blocks.get_mut(&ptr) {
                None => {
                    return Err(StreamError::InvalidFree {
                        ptr,
                        reason: InvalidFreeReason::NotOwned,
                    })
                }
                Some(b) if b.cached => {
                    return Err(StreamError::InvalidFree {
                        ptr,
                        reason: InvalidFreeReason::AlreadyFree,
                    })
                }
                Some(b) => b,
            };
            b.cached = true;
            b.stream = stream;
            let size = b.size;
            g.live_bytes -= size;
            g.live_blocks -= 1;
            g.frees += 1;
            size
        };
        if self.cache.put(ptr, size, stream).is_ok() {
            return Ok(());
        }
        // Over the cache's bound: give it back to the pool on the caller's stream.
        self.shard(ptr).lock().blocks.remove(&ptr);
        self.device.pool_free_async(ptr, stream)?;
        self.pool_frees.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Whether `ptr` is a block of this tier (live, or free in its cache).
    pub fn owns(&self, ptr: DevicePtr) -> bool {
        self.shard(ptr).lock().blocks.contains_key(&ptr)
    }

    /// The (rounded) size of the live block at `ptr`.
    pub fn size_of(&self, ptr: DevicePtr) -> Option<u64> {
        let g = self.shard(ptr).lock();
        g.blocks.get(&ptr).filter(|b| !b.cached).map(|b| b.size)
    }

    /// Return cached memory to the driver: every cached block is freed into the pool on the stream it
    /// was freed on (`pool_free_async`, stream-ordered, so no wait is needed first), those streams are
    /// synchronized so that the frees have executed, then `pool_trim(keep)`. Returns the bytes taken
    /// out of the cache.
    ///
    /// Errors are returned after the whole sequence ran as far as it could.
    pub fn trim(&self, keep: u64) -> Result<u64, StreamError> {
        self.trims.fetch_add(1, Ordering::Relaxed);
        let mut first_err: Option<DeviceError> = None;
        let (drained, streams) = self.release_cached(&mut first_err);
        // The frees are stream-ordered: the pool can only release them once they have executed.
        for s in streams {
            if let Err(e) = self.device.stream_synchronize(s) {
                first_err.get_or_insert(e);
            }
        }
        if let Err(e) = self.device.pool_trim(self.pool, keep) {
            first_err.get_or_insert(e);
        }
        match first_err {
            None => Ok(drained),
            Some(e) => {
                self.record_error(e.clone());
                Err(e.into())
            }
        }
    }

    /// Frees every cached block into the pool on the stream it was last freed on. Returns the bytes
    /// released and the streams used; the first failure goes to `first_err`.
    fn release_cached(&self, first_err: &mut Option<DeviceError>) -> (u64, Vec<StreamId>) {
        let mut streams: Vec<StreamId> = Vec::new();
        let mut give_back = |ptr: DevicePtr, _size: u64, pending_on: Option<StreamId>| {
            let recorded = self.shard(ptr).lock().blocks.remove(&ptr).map(|b| b.stream);
            // A cached block is always in the map; it records the stream of its free.
            let stream = recorded.or(pending_on).unwrap_or(0);
            match self.device.pool_free_async(ptr, stream) {
                Ok(()) => {
                    self.pool_frees.fetch_add(1, Ordering::Relaxed);
                    if !streams.contains(&stream) {
                        streams.push(stream);
                    }
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        };
        let drained = self.cache.drain_unsynced(&mut give_back);
        (drained, streams)
    }

    /// Current figures. Makes one `pool_usage` driver call.
    pub fn stats(&self) -> DriverPoolStats {
        let mut s = DriverPoolStats {
            pool_allocs: self.pool_allocs.load(Ordering::Relaxed),
            pool_frees: self.pool_frees.load(Ordering::Relaxed),
            oom_retries: self.oom_retries.load(Ordering::Relaxed),
            trims: self.trims.load(Ordering::Relaxed),
            cache: self.cache.stats(),
            ..DriverPoolStats::default()
        };
        s.cached_bytes = s.cache.cached_bytes;
        for shard in self.map.iter() {
            let g = shard.lock();
            s.live_bytes += g.live_bytes;
            s.live_blocks += g.live_blocks;
            s.allocs += g.allocs;
            s.frees += g.frees;
        }
        s.pool = match self.device.pool_usage(self.pool) {
            Ok(u) => Some(u),
            Err(e) => {
                self.record_error(e);
                None
            }
        };
        s
    }

    /// The most recent device error met where none could be returned (`stats`, the trim inside the
    /// out-of-memory retry), cleared by this call. The cache keeps its own:
    /// [`StreamCache::take_last_error`].
    pub fn take_last_error(&self) -> Option<DeviceError> {
        self.last_error.lock().take()
    }

    fn record_error(&self, e: DeviceError) {
        log::warn!("gen-stream pool: {e}");
        *self.last_error.lock() = Some(e);
    }

    /// Destroy the pool now, returning the error that `Drop` would only log.
    pub fn close(mut self) -> Result<(), StreamError> {
        self.destroy()
    }

    fn destroy(&mut self) -> Result<(), StreamError> {
        if self.destroyed {
            return Ok(());
        }
        self.destroyed = true;
        // Cached blocks are live to the driver: free them (stream-ordered) before destroying.
        let mut first_err = None;
        self.release_cached(&mut first_err);
        let destroyed = self.device.pool_destroy(self.pool);
        match (first_err, destroyed) {
            (Some(e), _) | (None, Err(e)) => Err(e.into()),
            (None, Ok(())) => Ok(()),
        }
    }
}

impl Drop for DriverPool {
    fn drop(&mut self) {
        if let Err(e) = self.destroy() {
            log::error!("gen-stream pool: destroying {:?}: {e}", self.pool);
        }
    }
}
