//! The extent tier: the first stream's arena (or one per predicted generation, `extent_generations`) and,
//! with several streams, the arena the streams after the first share (`stream_arenas:shared`, the
//! default) or one arena for each of them (`own`). Their address ranges are disjoint; a block is freed to
//! the arena owning it. Each arena has a [`Handoff`] — gen-vmm's stream rule for blocks — that orders a
//! stream after the frees of others before it can reuse their blocks: at the free in an arena of one
//! stream (a foreign free is rare there), at the allocation in the shared arena (lazily, by the stamps
//! its free extents carry: streams hand blocks to each other there all the time).

use std::sync::atomic::{AtomicU64, Ordering, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};

use gen_classifier::Lifetime;
use gen_device::StreamId;
use gen_extent::{ExtentArena, ExtentConfig};
use gen_vmm::{Handoff, PagePool, TierError, VmmError};

pub(crate) use crate::config::StreamArenas as Layout;

use crate::stats::OldGeneration;
use crate::tier::{Request, TierAlloc};

/// No stream (a free slot, or no stream seen yet).
pub(crate) const NO_STREAM: u64 = u64::MAX;

/// How many best-fitting free extents the shared arena compares for the fewest new pages while several
/// streams allocate from it (`ExtentConfig::placement_candidates`). There best fit's layout follows
/// the streams' interleaving, not a repeating loop, and comparing four placements moved 3× fewer pages
/// on the four serving streams (docs/ARCHITECTURE.md, "Streams after the first share one arena"); with
/// one stream there (a copy or prefetch stream) plain best fit kept its pages in place.
const SHARED_PLACEMENT: usize = 4;

/// Streams after the first that get an extent arena of their own with `stream_arenas:own`.
const STREAM_ARENAS: usize = 4;

const STREAM_ARENA_NAMES: [&str; STREAM_ARENAS] = [
    "gen-extent/stream-1",
    "gen-extent/stream-2",
    "gen-extent/stream-3",
    "gen-extent/stream-4",
];

/// An arena and the streams that allocate from it or freed into it.
struct Owned {
    arena: ExtentArena,
    handoff: Handoff,
}

/// Where a live block's arena is, for its free.
pub(crate) struct Home<'a> {
    pub arena: &'a ExtentArena,
    pub handoff: &'a Handoff,
    /// The arena is shared by several streams with no stream of its own: ordered lazily (its free extents
    /// carry stamps), its freed pages stamped with the freeing stream.
    pub shared: bool,
}

impl Home<'_> {
    /// Free the block at `ptr`, freed on `stream`: in an arena of one stream after ordering its allocator
    /// after `stream` ([`Handoff::freed`]; a capture's error leaves the block out), in the shared arena
    /// with no device call, the bytes stamped ([`Handoff::freed_lazily`]).
    pub fn free(&self, pages: &PagePool, ptr: u64, stream: StreamId) -> Result<u64, TierError> {
        if self.shared {
            let stamp = self.handoff.freed_lazily(stream);
            self.arena.free_stamped(ptr, stream, stamp)
        } else {
            self.handoff.freed(pages, stream).map_err(vmm_err)?;
            self.arena.free(ptr)
        }
    }
}

/// The extent tier's arenas. Two words of the engine's one hot line: the first stream's arenas, which
/// one stream reaches with nothing else read, and the rest behind one pointer.
pub(crate) struct Extents {
    /// The first stream's arena, or its three generation arenas (short, mid, long).
    main: Box<[ExtentArena]>,
    rest: Box<Rest>,
}

/// What only several streams use.
struct Rest {
    /// Who allocates from the main arenas (the first stream; every stream without `stream_arenas`).
    main_handoff: Handoff,
    /// Unless `stream_arenas:first`: the arenas of streams after the first.
    streams: Option<StreamArenas>,
    /// Placement candidates in the shared arena while several streams allocate there.
    shared_placement: usize,
    /// Pass over bytes owed to freers known busy ([`ExtentsConfig::pass_busy`]).
    pass_busy: bool,
    pages: Arc<PagePool>,
}

/// How the extent tier is laid out.
pub(crate) struct ExtentsConfig {
    /// One arena per predicted generation for the first stream.
    pub generations: bool,
    /// Where streams after the first allocate.
    pub stream_arenas: Layout,
    /// VA of the first stream's arena(s), and of each other stream's.
    pub main_va: u64,
    pub stream_va: u64,
    pub placement_candidates: usize,
    /// Each arena's old generation (`ExtentConfig::old_after`; 0 = none).
    pub old_after: u64,
    /// In the shared arena, pass over bytes owed to freers known busy (`Config::busy_freers`).
    pub pass_busy: bool,
}

/// The extent arenas of streams after the first. With `own`, a slot's arena is made at its stream's
/// first large allocation and kept; only that stream allocates from it, so a block it frees on that
/// stream goes straight back (stream order), as in the one-stream case. Streams past the slots (every
/// stream after the first with `shared`) share `shared`, ordered lazily: a free leaves a stamp on its
/// bytes, and the stream that gets them waits for the streams the stamp names.
struct StreamArenas {
    /// The stream each slot belongs to (`NO_STREAM`: free), published once the slot's arena is set.
    ids: [AtomicU64; STREAM_ARENAS],
    arenas: [OnceLock<Owned>; STREAM_ARENAS],
    shared: OnceLock<Owned>,
    /// Serializes slot claims (once per stream).
    claim: parking_lot::Mutex<()>,
    /// How many slots are used (`STREAM_ARENAS` with `own`, 0 with `shared`).
    own: usize,
    pages: Arc<PagePool>,
    va_bytes: u64,
    placement_candidates: usize,
    old_after: u64,
}

impl StreamArenas {
    /// The arena `stream` allocates from, made on its first use, and whether it is the shared one. Out
    /// of line: one stream never calls it.
    #[inline(never)]
    fn arena(&self, stream: StreamId) -> Result<(&Owned, bool), TierError> {
        if let Some(a) = self.shared.get().filter(|_| self.own == 0) {
            return Ok((a, true));
        }
        if let Some(a) = self.find(stream) {
            return Ok((a, false));
        }
        let _g = self.claim.lock();
        if let Some(a) = self.find(stream) {
            return Ok((a, false));
        }
        let cfg = |name| ExtentConfig {
            va_bytes: self.va_bytes,
            placement_candidates: self.placement_candidates,
            old_after: self.old_after,
            name,
        };
        if let Some(i) = self.ids[..self.own]
            .iter()
            .position(|id| id.load(Relaxed) == NO_STREAM)
        {
            let arena = ExtentArena::new(&self.pages, cfg(STREAM_ARENA_NAMES[i]))?;
            // Only `stream` allocates from it: its own frees go straight back (stream order); a block
            // freed on another stream first orders `stream` after it (the handoff).
            arena.set_stream(Some(stream));
            let owned = Owned {
                arena,
                handoff: Handoff::owned_by(stream),
            };
            if self.arenas[i].set(owned).is_err() {
                unreachable!("a free slot has no arena");
            }
            self.ids[i].store(stream, Ordering::Release);
            return Ok((self.arenas[i].get().expect("just set"), false));
        }
        if let Some(a) = self.shared.get() {
            return Ok((a, true));
        }
        let arena = ExtentArena::new(&self.pages, cfg("gen-extent/streams"))?;
        arena.keep_stamps();
        let owned = self.shared.get_or_init(|| Owned {
            arena,
            handoff: Handoff::new(),
        });
        Ok((owned, true))
    }

    fn find(&self, stream: StreamId) -> Option<&Owned> {
        let i = self
            .ids
            .iter()
            .position(|id| id.load(Ordering::Acquire) == stream)?;
        self.arenas[i].get()
    }

    /// Every arena made so far, with whether it is the shared one.
    fn all(&self) -> impl Iterator<Item = (&Owned, bool)> {
        self.arenas
            .iter()
            .filter_map(|a| a.get().map(|a| (a, false)))
            .chain(self.shared.get().map(|a| (a, true)))
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
                        old_after: cfg.old_after,
                        name,
                    },
                )
            })
            .collect::<Result<Box<[_]>, _>>()?;
        let own = match cfg.stream_arenas {
            Layout::First => None,
            Layout::Shared => Some(0),
            Layout::Own => Some(STREAM_ARENAS),
        };
        let streams = own.map(|own| StreamArenas {
            ids: std::array::from_fn(|_| AtomicU64::new(NO_STREAM)),
            arenas: std::array::from_fn(|_| OnceLock::new()),
            shared: OnceLock::new(),
            claim: parking_lot::Mutex::new(()),
            own,
            pages: pages.clone(),
            va_bytes: cfg.stream_va,
            placement_candidates: cfg.placement_candidates,
            old_after: cfg.old_after,
        });
        Ok(Extents {
            main,
            rest: Box::new(Rest {
                main_handoff: Handoff::new(),
                streams,
                shared_placement: cfg.placement_candidates.max(SHARED_PLACEMENT),
                pass_busy: cfg.pass_busy,
                pages: pages.clone(),
            }),
        })
    }

    /// The first stream is known: its arenas' blocks are used on it, and it has allocated from and
    /// freed into them with nothing but stream order so far.
    pub fn set_first_stream(&self, stream: StreamId) {
        for a in self.main.iter() {
            a.set_stream(Some(stream));
        }
        self.rest.main_handoff.seed(stream);
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

    /// A new run begins: every arena forgets what it learnt of lifetimes
    /// ([`ExtentArena::forget_lifetimes`]).
    pub fn forget_lifetimes(&self) {
        for a in self.all() {
            a.forget_lifetimes();
        }
    }

    /// Every extent arena: the first stream's (or the generations'), then the stream arenas made so far.
    pub fn all(&self) -> impl Iterator<Item = &ExtentArena> {
        self.main.iter().chain(
            self.rest
                .streams
                .iter()
                .flat_map(|s| s.all().map(|(o, _)| &o.arena)),
        )
    }

    /// A block for a stream other than the first: from the arena the stream allocates from (made on
    /// first use; the first stream's with `stream_arenas:first`). The stream enters the arena's handoff
    /// (ordered after the others' frees its first time); in the shared arena it then waits for the
    /// streams named on the bytes it gets. The first stream is one of the main arenas' allocators from
    /// the start, so it has nothing to enter.
    #[inline(never)]
    fn alloc_other(&self, req: &Request) -> Result<u64, TierError> {
        let rest = &*self.rest;
        let (arena, handoff, shared) = match &rest.streams {
            Some(sa) => sa
                .arena(req.stream)
                .map(|(o, shared)| (&o.arena, &o.handoff, shared))?,
            None => (self.for_class(req.class), &rest.main_handoff, false),
        };
        if !shared {
            handoff.enter(&rest.pages, req.stream).map_err(vmm_err)?;
            return arena.alloc(req.size, req.grow);
        }
        handoff.join_lazily(req.stream);
        // Several streams allocating here: compare a few best fits for the fewest new pages.
        let candidates = if handoff.sole().is_some() {
            1
        } else {
            rest.shared_placement
        };
        let order = |stamp| {
            handoff
                .before_use(&rest.pages, req.stream, stamp)
                .map_err(vmm_err)
        };
        // Freers known busy: bytes that owe them nothing first (among 16 best fits, else address space
        // no block used), so that this stream does not wait on the device for work it never shared;
        // none to be had (no memory for them), the bytes best fit chose, and the wait.
        let busy = if rest.pass_busy && candidates > 1 && rest.pages.any_known_busy() {
            handoff.busy_bits(&rest.pages)
        } else {
            0
        };
        if busy != 0 {
            let owes_none = |stamp| !handoff.owes_any_of(req.stream, stamp, busy);
            match arena.alloc_ordered(
                req.size,
                req.grow,
                req.stream,
                candidates,
                Some(&owes_none),
                order,
            ) {
                // No such bytes (or a capture, whose own fallback follows): best fit's, ordered.
                Err(
                    TierError::Exhausted { .. }
                    | TierError::WouldGrow { .. }
                    | TierError::Vmm(VmmError::Capturing(_)),
                ) => {}
                r => return r,
            }
        }
        match arena.alloc_ordered(req.size, req.grow, req.stream, candidates, None, order) {
            // A capture cannot take the ordering those bytes need: bytes that need none, if any.
            Err(TierError::Vmm(VmmError::Capturing(what))) => {
                let free_of_orders = |stamp| !handoff.pending(req.stream, stamp);
                arena
                    .alloc_ordered(
                        req.size,
                        req.grow,
                        req.stream,
                        candidates,
                        Some(&free_of_orders),
                        order,
                    )
                    .map_err(|e| match e {
                        TierError::Exhausted { .. } => TierError::Vmm(VmmError::Capturing(what)),
                        e => e,
                    })
            }
            r => r,
        }
    }

    /// Free a block while one stream has been seen (its only allocator freeing it: stream order
    /// suffices, no handoff to consult).
    #[inline]
    pub fn free_solo(&self, ptr: u64) -> Result<(), TierError> {
        match self.main.iter().find(|a| a.owns(ptr)) {
            Some(a) => a.free(ptr).map(|_| ()),
            None => Err(TierError::InvalidFree {
                ptr,
                reason: "not in the first stream's extent arenas",
            }),
        }
    }

    /// The arena holding `ptr`, for its free (`None`: in none of them).
    #[inline]
    pub fn home(&self, ptr: u64) -> Option<Home<'_>> {
        // The first stream's arena (or the generations') first: the stream arenas are not looked at
        // unless the block is theirs.
        if let Some(a) = self.main.iter().find(|a| a.owns(ptr)) {
            return Some(Home {
                arena: a,
                handoff: &self.rest.main_handoff,
                shared: false,
            });
        }
        self.home_in_streams(ptr)
    }

    #[inline(never)]
    fn home_in_streams(&self, ptr: u64) -> Option<Home<'_>> {
        self.rest.streams.as_ref().and_then(|sa| {
            sa.all()
                .find(|(o, _)| o.arena.owns(ptr))
                .map(|(o, shared)| Home {
                    arena: &o.arena,
                    handoff: &o.handoff,
                    shared,
                })
        })
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

    /// The old generations of every arena, summed (peaks: the sum of each arena's own).
    pub fn old_generation(&self) -> OldGeneration {
        self.all()
            .map(|a| a.stats())
            .fold(OldGeneration::default(), |o, s| OldGeneration {
                allocs: o.allocs + s.old_allocs,
                live_bytes: o.live_bytes + s.old_live_bytes,
                peak_live_bytes: o.peak_live_bytes + s.old_peak_live_bytes,
            })
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
        // One stream (the common case): decided from the request alone, nothing else read.
        if req.stream == req.first_stream {
            return self.for_class(req.class).alloc(req.size, req.grow);
        }
        self.alloc_other(req)
    }

    /// Free to the arena whose address range holds `ptr`, ordered as [`Home::free`] says.
    fn free(&self, ptr: u64, stream: StreamId) -> Result<(), TierError> {
        let Some(home) = self.home(ptr) else {
            return Err(TierError::InvalidFree {
                ptr,
                reason: "not in any extent arena",
            });
        };
        home.free(&self.rest.pages, ptr, stream).map(|_| ())
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

fn vmm_err(e: VmmError) -> TierError {
    TierError::Vmm(e)
}
