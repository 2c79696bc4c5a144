//! What the memory an allocator holds but does not use consists of, at its peak reservation.
//!
//! [`waste_at_peak`] replays a trace twice through fresh copies of one allocator. The first pass finds
//! *the moment of peak reservation*: of the ops after which the reservation is at its highest, the one
//! holding the fewest bytes only for reuse ([`WasteProbe::held_for_reuse`]), then the one with the most
//! live bytes (the fullest the allocator ever is at its peak, so the excess seen there is as close as
//! the trace allows to peak reserved − peak live, the excess the ratio measures). The first rule is
//! genpool's: it creates a page only while it holds fewer than its peak of pages in use (or none of
//! those it holds is free), so its reservation is set at that peak — pages cached later, when fewer are
//! in use, are its consequence, not its cause (gpt2_generate_kv: 4 cached pages at the fullest moment,
//! none at the peak of pages in use, whose excess is page edges). The
//! second pass stops right after that op and takes the allocator's state apart ([`WasteProbe`]): every
//! reserved byte that holds no live byte of the trace is charged to exactly one [`WasteCause`], so the
//! causes add up to reserved − live at that moment.

use std::collections::HashMap;

use gen_trace::{EventKind, ReplayAllocator, ReplayError, Trace};
use genpool::replay::EngineReplay;
use serde::ser::SerializeMap;

/// Why a reserved byte holds no live data.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WasteCause {
    /// Bytes of handed-out blocks beyond the request: 512 B (or 256 B) granularity,
    /// `roundup_power2_divisions` classes, and remainders too small to split off (≤ 1 MiB in
    /// PyTorch's large pool, e.g. the rest of a segment rounded up to 2 MiB).
    Rounding,
    /// `max_split_size_mb`: oversize blocks lent whole to a smaller oversize request.
    Oversize,
    /// Native segments: free blocks in a segment that also holds live blocks — split remainders the
    /// requests that came later did not fit.
    SplitFragments,
    /// Native segments: whole cached segments with nothing live (held from an earlier phase).
    IdleSegments,
    /// Free blocks between live ones: free-but-mapped holes of an expandable segment, holes of a
    /// fixed pool.
    FreeHoles,
    /// Expandable segments: free mapped space at the end of a segment (pages are mapped 2 MiB /
    /// 20 MiB at a time, and unmapped only by `empty_cache`).
    MappedTail,
    /// A fixed pool's free space past its last live block: its sizing slack.
    PoolTail,
    /// genpool: free slots of committed slab chunks (and the rest of the pages they are on).
    SlabClasses,
    /// genpool: the parts of pages touched by live blocks that no live block covers (partially used
    /// pages at block edges).
    PageEdges,
    /// genpool: blocks freed during a capture, held out of their tier (with their pages) until it ends.
    FrontCache,
    /// genpool: physical pages held with no live block on them, kept for reuse.
    CachedPages,
    /// genpool: memory of the stream tier's driver pool (`cudaMemPool`) not in live blocks.
    DriverPool,
}

impl WasteCause {
    /// The name used in tables and JSON (`split_fragments`).
    pub fn name(self) -> &'static str {
        match self {
            WasteCause::Rounding => "rounding",
            WasteCause::Oversize => "oversize",
            WasteCause::SplitFragments => "split_fragments",
            WasteCause::IdleSegments => "idle_segments",
            WasteCause::FreeHoles => "free_holes",
            WasteCause::MappedTail => "mapped_tail",
            WasteCause::PoolTail => "pool_tail",
            WasteCause::SlabClasses => "slab_classes",
            WasteCause::PageEdges => "page_edges",
            WasteCause::FrontCache => "front_cache",
            WasteCause::CachedPages => "cached_pages",
            WasteCause::DriverPool => "driver_pool",
        }
    }
}

/// Bytes per cause, largest first; causes with no bytes are left out. Serializes as a JSON object
/// `{cause: bytes}`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Waste(Vec<(WasteCause, u64)>);

impl Waste {
    /// Sums `parts` per cause (a cause may appear several times) and orders them, largest first
    /// (ties by cause order).
    pub fn from_parts(parts: impl IntoIterator<Item = (WasteCause, u64)>) -> Waste {
        let mut v: Vec<(WasteCause, u64)> = Vec::new();
        for (c, b) in parts {
            match v.iter_mut().find(|(x, _)| *x == c) {
                Some((_, acc)) => *acc += b,
                None => v.push((c, b)),
            }
        }
        v.retain(|&(_, b)| b > 0);
        v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        Waste(v)
    }

    /// (cause, bytes), largest first.
    pub fn causes(&self) -> &[(WasteCause, u64)] {
        &self.0
    }

    /// Bytes charged to `cause`.
    pub fn bytes(&self, cause: WasteCause) -> u64 {
        self.0
            .iter()
            .find(|(c, _)| *c == cause)
            .map_or(0, |&(_, b)| b)
    }

    /// All bytes charged.
    pub fn total(&self) -> u64 {
        self.0.iter().map(|&(_, b)| b).sum()
    }

    /// The cause with the most bytes (`None` when nothing is wasted).
    pub fn dominant(&self) -> Option<WasteCause> {
        self.0.first().map(|&(c, _)| c)
    }

    /// `cause`'s share of [`Waste::total`], 0 to 1 (0 when nothing is wasted).
    pub fn share(&self, cause: WasteCause) -> f64 {
        match self.total() {
            0 => 0.0,
            t => self.bytes(cause) as f64 / t as f64,
        }
    }
}

impl serde::Serialize for Waste {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (c, b) in &self.0 {
            m.serialize_entry(c.name(), b)?;
        }
        m.end()
    }
}

/// The moment of peak reservation (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct PeakMoment {
    /// Ops replayed by then (the snapshot follows op number `op`, counting from 1).
    pub op: u64,
    /// Bytes reserved then.
    pub reserved: u64,
    /// Live bytes of the trace then.
    pub live: u64,
}

/// One allocator's state at its moment of peak reservation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WasteSnapshot {
    /// When.
    pub moment: PeakMoment,
    /// `moment.reserved − moment.live`, by cause.
    pub waste: Waste,
}

/// An allocator whose unused reservation can be taken apart by [`WasteCause`].
pub trait WasteProbe: ReplayAllocator {
    /// Reserved bytes that hold no live data, by cause, when the trace's live bytes are `live` (the
    /// sum of the sizes asked for by the blocks live now). The parts add up to
    /// `reserved() − live`.
    fn waste(&self, live: u64) -> Waste;

    /// Of the reserved bytes, those held now only to be reused (genpool's pages with no live block on
    /// them): among the moments of peak reservation the one with the fewest is taken apart, as it shows
    /// what made the reservation that high. Default: none.
    fn held_for_reuse(&self) -> u64 {
        0
    }
}

impl WasteProbe for EngineReplay {
    fn held_for_reuse(&self) -> u64 {
        let p = self.pool().stats().pages;
        (p.pages_free_mapped + p.pages_free_unmapped) * p.page_size
    }

    fn waste(&self, live: u64) -> Waste {
        let st = self.pool().stats();
        let page = st.pages.page_size;
        let cached_pages = (st.pages.pages_free_mapped + st.pages.pages_free_unmapped) * page;
        let in_use = st.pages.bytes_held().saturating_sub(cached_pages);
        let tier = |name: &str| st.tiers.iter().find(|t| t.tier == name);
        let (slab_live, slab_committed) =
            tier("slab").map_or((0, 0), |t| (t.live_bytes, t.reserved));
        let (pool_live, pool_reserved) =
            tier("stream").map_or((0, 0), |t| (t.live_bytes, t.reserved));
        // Pages in use hold the slab's chunks, and the extent arena's and the buddy's live and
        // cached blocks; what is left of them are the unused parts of partially used pages.
        let paged_live = st
            .allocated_current
            .saturating_sub(slab_live)
            .saturating_sub(pool_live);
        let page_edges = in_use
            .saturating_sub(slab_committed)
            .saturating_sub(paged_live)
            .saturating_sub(st.cached_bytes);
        Waste::from_parts([
            (
                WasteCause::Rounding,
                st.allocated_current.saturating_sub(live),
            ),
            (
                WasteCause::SlabClasses,
                slab_committed.saturating_sub(slab_live),
            ),
            (WasteCause::PageEdges, page_edges),
            (WasteCause::FrontCache, st.cached_bytes),
            (WasteCause::CachedPages, cached_pages),
            (
                WasteCause::DriverPool,
                pool_reserved.saturating_sub(pool_live),
            ),
        ])
    }
}

fn op_err(op: usize, e: ReplayError) -> ReplayError {
    ReplayError::Op {
        pass: 1,
        op,
        source: Box::new(e),
    }
}

/// Replays `trace` through `a` as one instrumented pass of [`gen_trace::replay`] does (an iteration
/// mark, then every event, the call site when known), stopping after `stop` ops when given.
/// Returns where it stopped and the moment of peak reservation until then (see the module docs).
fn run<A: WasteProbe>(
    trace: &Trace,
    a: &mut A,
    stop: Option<u64>,
) -> Result<(PeakMoment, PeakMoment), ReplayError> {
    a.mark_iteration();
    // Trace address → (block, size, stream) of its allocation: a free is replayed with those.
    let mut ptrs: HashMap<u64, (u64, u64, u64)> = HashMap::with_capacity(1024);
    let mut now = PeakMoment {
        op: 0,
        reserved: a.reserved(),
        live: 0,
    };
    let mut best = now;
    // Held for reuse at `best` (kept only for the first run's choice of moment).
    let mut best_reuse = a.held_for_reuse();
    for (i, e) in trace.events.iter().enumerate() {
        if stop == Some(now.op) {
            break;
        }
        match e.kind {
            EventKind::Alloc => {
                let site = (e.site != 0).then_some(e.site);
                let p = a.alloc(e.size, e.stream, site).map_err(|x| op_err(i, x))?;
                if ptrs.insert(e.addr, (p, e.size, e.stream)).is_some() {
                    return Err(ReplayError::InvalidTrace {
                        event: i,
                        message: format!("allocation at live address {:#x}", e.addr),
                    });
                }
                now.live += e.size;
            }
            EventKind::Free => {
                let (p, size, stream) =
                    ptrs.remove(&e.addr)
                        .ok_or_else(|| ReplayError::InvalidTrace {
                            event: i,
                            message: format!("free of {:#x}, which is not live", e.addr),
                        })?;
                a.free(p, size, stream).map_err(|x| op_err(i, x))?;
                now.live -= size;
            }
        }
        now.op += 1;
        now.reserved = a.reserved();
        if now.reserved >= best.reserved {
            let reuse = a.held_for_reuse();
            if now.reserved > best.reserved
                || reuse < best_reuse
                || (reuse == best_reuse && now.live > best.live)
            {
                best = now;
                best_reuse = reuse;
            }
        }
    }
    Ok((now, best))
}

/// The state of the allocator made by `make` at its moment of peak reservation on `trace` (see the
/// module docs). `make` must build the same allocator each time (the simulations are deterministic).
pub fn waste_at_peak<A: WasteProbe>(
    trace: &Trace,
    make: &mut dyn FnMut() -> Result<A, crate::AnalyzeError>,
) -> Result<WasteSnapshot, crate::AnalyzeError> {
    let err = |source| crate::AnalyzeError::Replay {
        trace: trace.name.clone(),
        strategy: "waste",
        source,
    };
    let mut first = make()?;
    let (_, best) = run(trace, &mut first, None).map_err(err)?;
    drop(first);
    let mut again = make()?;
    let (moment, _) = run(trace, &mut again, Some(best.op)).map_err(err)?;
    Ok(WasteSnapshot {
        moment,
        waste: again.waste(moment.live),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waste_orders_and_serializes_as_a_map() {
        let w = Waste::from_parts([
            (WasteCause::Rounding, 5),
            (WasteCause::SplitFragments, 7),
            (WasteCause::IdleSegments, 0),
            (WasteCause::Rounding, 5),
        ]);
        assert_eq!(
            w.causes(),
            &[(WasteCause::Rounding, 10), (WasteCause::SplitFragments, 7)]
        );
        assert_eq!(w.dominant(), Some(WasteCause::Rounding));
        assert_eq!(w.total(), 17);
        assert!((w.share(WasteCause::SplitFragments) - 7.0 / 17.0).abs() < 1e-12);
        assert_eq!(w.bytes(WasteCause::IdleSegments), 0);
        assert_eq!(
            serde_json::to_string(&w).unwrap(),
            r#"{"rounding":10,"split_fragments":7}"#
        );
        let none = Waste::default();
        assert_eq!(none.dominant(), None);
        assert_eq!(none.share(WasteCause::Rounding), 0.0);
    }
}
