//! The extent tier: the first stream's arena (or one per predicted generation, `extent_generations`) and,
//! with several streams, the arenas of the streams after the first (`stream_arenas`). Their address
//! ranges are disjoint; a block is freed to the arena owning it.

use std::sync::atomic::{AtomicU64, Ordering, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};

use gen_classifier::Lifetime;
use gen_device::StreamId;
use gen_extent::{ExtentArena, ExtentConfig};
use gen_vmm::{PagePool, TierError};

use crate::tier::{Request, TierAlloc};

/// No stream (a free slot, or no stream seen yet).
pub(crate) const NO_STREAM: u64 = u64::MAX;

/// Streams after the first that get an extent arena of their own (see `Config::stream_arenas`).
const STREAM_ARENAS: usize = 4;

const STREAM_ARENA_NAMES: [&str; STREAM_ARENAS] = [
    "gen-extent/stream-1",
    "gen-extent/stream-2",
    "gen-extent/stream-3",
    "gen-extent/stream-4",
];

/// The extent tier's arenas.
pub(crate) struct Extents {
    /// The first stream's arena, or its three generation arenas (short, mid, long).
    main: Box<[ExtentArena]>,
    /// With `stream_arenas`: the arenas of streams after the first.
    streams: Option<Box<StreamArenas>>,
}

/// How the extent tier is laid out.
pub(crate) struct ExtentsConfig {
    /// One arena per predicted generation for the first stream.
    pub generations: bool,
    /// An arena per stream after the first.
    pub stream_arenas: bool,
    /// VA of the first stream's arena(s), and of each other stream's.
    pub main_va: u64,
    pub stream_va: u64,
    pub placement_candidates: usize,
}

/// The extent arenas of streams after the first. A slot's arena is made at its stream's first large
/// allocation and kept; only that stream allocates from it, so a block it frees on that stream goes
/// straight back (stream order), as in the one-stream case. Streams past the slots share `shared`, whose
/// frees always go through the stream caches.
struct StreamArenas {
    /// The stream each slot belongs to (`NO_STREAM`: free), published once the slot's arena is set.
    ids: [AtomicU64; STREAM_ARENAS],
    arenas: [OnceLock<ExtentArena>; STREAM_ARENAS],
    shared: OnceLock<ExtentArena>,
    /// Serializes slot claims (once per stream).
    claim: parking_lot::Mutex<()>,
    pages: Arc<PagePool>,
    va_bytes: u64,
    placement_candidates: usize,
}

impl StreamArenas {
    /// The arena `stream` allocates from, made on its first use. Out of line: one stream never calls it.
    #[inline(never)]
    fn arena(&self, stream: StreamId) -> Result<&ExtentArena, TierError> {
        if let Some(a) = self.find(stream) {
            return Ok(a);
        }
        let _g = self.claim.lock();
        if let Some(a) = self.find(stream) {
            return Ok(a);
        }
        let cfg = |name| ExtentConfig {
            va_bytes: self.va_bytes,
            placement_candidates: self.placement_candidates,
            name,
        };
        if let Some(i) = self.ids.iter().position(|id| id.load(Relaxed) == NO_STREAM) {
            let a = ExtentArena::new(&self.pages, cfg(STREAM_ARENA_NAMES[i]))?;
            // Only `stream` allocates from it, and a block is freed straight back only on `stream`
            // (others go through the stream caches, made safe before they return).
            a.set_stream(Some(stream));
            if self.arenas[i].set(a).is_err() {
                unreachable!("a free slot has no arena");
            }
            self.ids[i].store(stream, Ordering::Release);
            return Ok(self.arenas[i].get().expect("just set"));
        }
        if let Some(a) = self.shared.get() {
            return Ok(a);
        }
        let a = ExtentArena::new(&self.pages, cfg("gen-extent/streams"))?;
        Ok(self.shared.get_or_init(|| a))
    }

    fn find(&self, stream: StreamId) -> Option<&ExtentArena> {
        let i = self
            .ids
            .iter()
            .position(|id| id.load(Ordering::Acquire) == stream)?;
        self.arenas[i].get()
    }

    /// Every arena made so far, with the one stream that allocates from it (`None`: shared).
    fn all(&self) -> impl Iterator<Item = (&ExtentArena, Option<StreamId>)> {
        self.arenas
            .iter()
            .zip(&self.ids)
            .filter_map(|(a, id)| a.get().map(|a| (a, Some(id.load(Ordering::Acquire)))))
            .chain(self.shared.get().map(|a| (a, None)))
    }
}

impl Extents {
    /// The arenas of `cfg` over `pages` (the stream arenas are made later, at their streams' first use).
    pub fn new(pages: &Arc<PagePool>, cfg: ExtentsConfig) -> Result<Self, TierError> {
        let names: &[&'static str] = if cfg.generations {
            &["gen-extent/short", "gen-extent/mid", "gen-extent/long"]
        } else {
            &["gen-extent"]
        };
        let main = names
            .iter()
            .map(|&name| {
                ExtentArena::new(
                    pages,
                    ExtentConfig {
                        va_bytes: cfg.main_va,
                        placement_candidates: cfg.placement_candidates,
                        name,
                    },
                )
            })
            .collect::<Result<Box<[_]>, _>>()?;
        let streams = cfg.stream_arenas.then(|| {
            Box::new(StreamArenas {
                ids: std::array::from_fn(|_| AtomicU64::new(NO_STREAM)),
                arenas: std::array::from_fn(|_| OnceLock::new()),
                shared: OnceLock::new(),
                claim: parking_lot::Mutex::new(()),
                pages: pages.clone(),
                va_bytes: cfg.stream_va,
                placement_candidates: cfg.placement_candidates,
            })
        });
        Ok(Extents { main, streams })
    }

    /// The first stream is known: its arenas' blocks are used on it (blocks freed on other streams come
    /// back to them only through the stream caches, made safe first).
    pub fn set_first_stream(&self, stream: StreamId) {
        for a in self.main.iter() {
            a.set_stream(Some(stream));
        }
    }

    /// The first stream's arena for blocks predicted `class`.
    #[inline]
    fn for_class(&self, class: Lifetime) -> &ExtentArena {
        let i = match class {
            Lifetime::Short => 0,
            Lifetime::Mid => 1,
            Lifetime::Long => 2,
        };
        &self.main[i.min(self.main.len() - 1)]
    }

    /// Every extent arena: the first stream's (or the generations'), then the stream arenas made so far.
    pub fn all(&self) -> impl Iterator<Item = &ExtentArena> {
        self.main
            .iter()
            .chain(self.streams.iter().flat_map(|s| s.all().map(|(a, _)| a)))
    }

    /// The arena a block of `req` comes from: with several streams and stream arenas, the stream's own
    /// (made on first use) unless it is the first stream.
    #[inline]
    fn arena(&self, req: &Request) -> Result<&ExtentArena, TierError> {
        // One stream (the common case): decided from the request alone, the stream arenas not read.
        if req.stream == req.first_stream {
            return Ok(self.for_class(req.class));
        }
        match &self.streams {
            Some(sa) => sa.arena(req.stream),
            None => Ok(self.for_class(req.class)),
        }
    }

    /// Whether a block freed on `stream` may go straight back: the arena holding `ptr` is the one only
    /// `stream` allocates from (`first_stream`'s are the main arenas). Out of line: one stream never
    /// calls it.
    #[inline(never)]
    pub fn home_arena(
        &self,
        ptr: u64,
        stream: StreamId,
        first_stream: StreamId,
    ) -> Option<&ExtentArena> {
        let sa = self.streams.as_ref()?;
        if stream == first_stream {
            return self.main.iter().find(|a| a.owns(ptr));
        }
        sa.all()
            .find(|&(a, home)| home == Some(stream) && a.owns(ptr))
            .map(|(a, _)| a)
    }

    /// Allocate `size` bytes at exactly `ptr` in the arena whose range holds it (see
    /// [`ExtentArena::alloc_at`]).
    pub fn alloc_at(&self, ptr: u64, size: u64) -> Result<u64, TierError> {
        match self.all().find(|a| a.owns(ptr)) {
            Some(a) => a.alloc_at(ptr, size),
            None => Err(TierError::Unplaceable {
                ptr,
                size,
                reason: "not in any extent arena of this pool",
            }),
        }
    }

    /// The largest free extent of any arena.
    pub fn largest_free_extent(&self) -> u64 {
        self.all()
            .map(|a| a.stats().largest_free_extent)
            .max()
            .unwrap_or(0)
    }
}

impl TierAlloc for Extents {
    #[inline]
    fn alloc(&self, req: &Request) -> Result<u64, TierError> {
        self.arena(req)?.alloc(req.size, req.grow)
    }

    /// Free to the arena whose address range holds `ptr`.
    fn free(&self, ptr: u64, _stream: StreamId) -> Result<(), TierError> {
        // The first stream's arena (or the generations') first: the stream arenas are not looked at
        // unless the block is theirs.
        if let Some(a) = self.main.iter().find(|a| a.owns(ptr)) {
            return a.free(ptr).map(|_| ());
        }
        match self
            .streams
            .as_ref()
            .and_then(|sa| sa.all().find(|(a, _)| a.owns(ptr)))
        {
            Some((a, _)) => a.free(ptr).map(|_| ()),
            None => Err(TierError::InvalidFree {
                ptr,
                reason: "not in any extent arena",
            }),
        }
    }

    /// Per-arena peaks occur at different moments: their sum bounds the tier's peak.
    fn reserved(&self) -> (u64, u64) {
        self.all().map(|a| a.stats()).fold((0, 0), |(c, p), s| {
            (c + s.committed_bytes, p + s.peak_committed_bytes)
        })
    }

    fn trim(&self) {
        for a in self.all() {
            a.trim();
        }
    }
}
