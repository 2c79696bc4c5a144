//! The plan server: a [`Planner`] (the pure core: offsets only) over a range of page-mapped address space
//! (gen-vmm), serving planned slots to its owner (genpool's engine) and deciding when the planner looks at
//! all. The planner knows nothing of pages; this module maps them — pinned once per plan
//! (`plan_pin`) or committed per planned block — and gives them back when the plan goes.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use gen_vmm::{PagePool, PageTally, Region, VmmError};
use parking_lot::Mutex;

use crate::{Decision, PlanConfig, PlanStats, Planner, Ticket};

/// Large allocations in a row with no free in between after which the planner's slots are not used, at
/// least (see [`PlanServer::alloc`]: the limit is the longest such run of the recorded period, when
/// longer).
const PLAN_BURST: u64 = 8;

/// Large allocations between the planner's wake-up checks (see [`PlanServer::awake`]).
const PLAN_WAKE_WINDOW: u64 = 1024;

/// Quiet windows (no page moved, no plan in use) after which the planner sleeps.
const PLAN_QUIET_WINDOWS: u64 = 4;

/// Awake windows in a row with no period found after which the planner gives up for a while even though
/// pages move (random shapes: no period to plan). A period of up to `plan_max_period` (8 192) large
/// allocations is confirmed after about that many plus 2 048 more, ten windows at most.
const PLAN_GIVE_UP_WINDOWS: u64 = 24;

/// Windows the planner sleeps after its first give-up; each give-up in a row doubles it, up to
/// [`PLAN_SNOOZE_MAX`]. A period found resets it.
const PLAN_SNOOZE_FIRST: u64 = 32;
const PLAN_SNOOZE_MAX: u64 = 512;

/// How a [`PlanServer`] serves.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanServerConfig {
    /// The planner's own configuration (longest period, background packing).
    pub planner: PlanConfig,
    /// Map each page of the range once and keep it while the plan is served (genpool's `plan_pin`).
    pub pin: bool,
    /// Serve a ready plan only after two periods in a row each moved at least this fraction of its
    /// footprint in pages (0: as soon as ready).
    pub min_moves: f64,
}

/// What the plan server did: the planner's counters and the pages the range holds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PlanServerStats {
    /// The planner's counters.
    pub planner: PlanStats,
    /// Bytes of the range mapped now.
    pub committed: u64,
    /// Most bytes of the range mapped at once.
    pub committed_peak: u64,
    /// Whether the planner looks at large allocations now.
    pub awake: bool,
    /// Times it gave up for a while (no period in many windows that moved pages).
    pub snoozes: u64,
}

/// The planner, its address range and its wake-up clocks. Planned blocks commit their pages as the
/// extent arena's do, or with `pin` the range maps each page once and keeps it while the plan lives.
pub struct PlanServer {
    /// Large allocations counted by [`PlanServer::awake`] (first: read on every large allocation).
    clock: AtomicU64,
    /// Windows in a row with no page moved and no plan in use.
    quiet: AtomicU64,
    /// Page moves at the last window check.
    steals: AtomicU64,
    /// Windows in a row awake with nothing to show: no period recorded, packed, ready or served.
    fruitless: AtomicU64,
    /// Windows left to sleep after giving up, whatever moves; the next give-up's length; give-ups.
    snooze: AtomicU64,
    backoff: AtomicU64,
    snoozes: AtomicU64,
    inner: Mutex<PlanInner>,
    region: Region,
    pin: bool,
    min_moves: f64,
}

struct PlanInner {
    planner: Planner,
    /// Pages referenced by live planned blocks (per-block mode).
    tally: PageTally,
    /// `pin`: one bit per page of the range, mapped once and kept while the plan lives.
    pinned: Option<Vec<u64>>,
    pinned_pages: u64,
    peak_pages: u64,
    /// Page moves of the whole pool counted at the ready plan's previous activation point (one period
    /// ago), to measure the moves of the last period.
    moves_at_phase: Option<u64>,
    /// Consecutive periods, up to now, that moved enough pages to serve the plan.
    moving_periods: u32,
}

impl std::fmt::Debug for PlanServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlanServer")
            .field("base", &self.region.base())
            .field("len", &self.region.len())
            .field("pin", &self.pin)
            .finish()
    }
}

impl PlanInner {
    /// Pages the plan holds now.
    fn pages(&self) -> u64 {
        if self.pinned.is_some() {
            self.pinned_pages
        } else {
            self.tally.pages()
        }
    }

    /// `pin`: give every pinned page of `region` back to the page pool.
    fn unpin(&mut self, region: &Region) {
        let page = region.pool().page_size();
        if let Some(bits) = self.pinned.as_mut() {
            for (w, word) in bits.iter_mut().enumerate() {
                let taken = std::mem::take(word);
                for b in 0..64 {
                    if taken & (1 << b) != 0 {
                        region.decommit((w as u64 * 64 + b) * page, page);
                    }
                }
            }
            self.pinned_pages = 0;
        }
    }

    /// `pin`, the plan going away: keep references only on the pages that live planned blocks touch
    /// (accounted per block from now on, as without pinning) and give every other pinned page back to the
    /// pool at once, for the tiers to use.
    fn unpin_to_blocks(&mut self, region: &Region) {
        if self.pinned.is_none() {
            return;
        }
        let live = self.planner.live_ranges();
        for (k, &(off, len)) in live.iter().enumerate() {
            // Every page of a live planned block is pinned: this only takes references.
            if let Err(e) = region.commit(off, len, true) {
                log::error!("gen-plan: keeping a planned block's pages: {e}");
                for &(o, l) in &live[..k] {
                    region.decommit(o, l);
                    self.tally.remove(o, l);
                }
                return;
            }
            self.tally.add(off, len);
        }
        self.unpin(region);
        self.pinned = None;
    }

    /// Hand a planned slot back to the planner (it will not be used), releasing pinned pages when that
    /// was the last block of a dropped plan; the block goes to the tiers.
    fn give_back(&mut self, region: &Region, ticket: Ticket) -> Decision {
        if self.planner.on_free(ticket) {
            self.unpin(region);
        }
        Decision::Unplanned {
            ticket: Ticket::NONE,
        }
    }

    /// `pin`: map (once) the pages of `[offset, offset + size)` that the plan has not pinned yet.
    fn pin(&mut self, region: &Region, offset: u64, size: u64) -> Result<(), VmmError> {
        let page = region.pool().page_size();
        let (first, last) = (offset / page, (offset + size - 1) / page);
        let Some(bits) = self.pinned.as_mut() else {
            return Ok(());
        };
        let pinned = |bits: &Vec<u64>, p: u64| bits[(p / 64) as usize] & (1 << (p % 64)) != 0;
        let mut p = first;
        while p <= last {
            if pinned(bits, p) {
                p += 1;
                continue;
            }
            let mut q = p;
            while q < last && !pinned(bits, q + 1) {
                q += 1;
            }
            region.commit(p * page, (q - p + 1) * page, true)?;
            for x in p..=q {
                bits[(x / 64) as usize] |= 1 << (x % 64);
            }
            self.pinned_pages += q - p + 1;
            p = q + 1;
        }
        Ok(())
    }
}

impl Drop for PlanServer {
    fn drop(&mut self) {
        // The owner is going away: drop the plan's page references so the region unmaps cleanly.
        let g = self.inner.get_mut();
        if g.pinned.is_some() {
            g.unpin(&self.region);
        } else {
            for (off, len) in g.planner.live_ranges() {
                self.region.decommit(off, len);
            }
        }
    }
}

impl PlanServer {
    /// A server over `va_bytes` of address space from `pages`.
    pub fn new(
        pages: &Arc<PagePool>,
        va_bytes: u64,
        cfg: PlanServerConfig,
    ) -> Result<Self, VmmError> {
        let page = pages.page_size();
        Ok(PlanServer {
            clock: AtomicU64::new(0),
            quiet: AtomicU64::new(0),
            steals: AtomicU64::new(0),
            fruitless: AtomicU64::new(0),
            snooze: AtomicU64::new(0),
            backoff: AtomicU64::new(PLAN_SNOOZE_FIRST),
            snoozes: AtomicU64::new(0),
            inner: Mutex::new(PlanInner {
                planner: Planner::new(cfg.planner),
                tally: PageTally::dense(page, va_bytes / page),
                pinned: cfg
                    .pin
                    .then(|| vec![0; (va_bytes / page).div_ceil(64) as usize]),
                pinned_pages: 0,
                peak_pages: 0,
                moves_at_phase: None,
                moving_periods: 0,
            }),
            region: Region::new(pages, va_bytes, "gen-plan")?,
            pin: cfg.pin,
            min_moves: cfg.min_moves,
        })
    }

    /// Whether the planner should see this large allocation. After `PLAN_QUIET_WINDOWS` windows of
    /// `PLAN_WAKE_WINDOW` large allocations in which the tiers moved no page and no plan was in use it
    /// sleeps, costing one counter increment per large allocation (a plan could only cost memory there:
    /// ResNet-50's layout repeats in place); the first window that moves a page wakes it. Falling asleep
    /// drops a period being recorded or packed and a ready plan (`Planner::pause`): they need every
    /// allocation, and one that never moved a page would not be served anyway. (Recording used to keep
    /// the planner awake, and on a loop whose period it kept re-recording — ResNet-50 in the simulator —
    /// that cost ~0.4 µs per large allocation for hundreds of iterations.) And where pages move but no
    /// period shows up in `PLAN_GIVE_UP_WINDOWS` awake windows (random shapes: GPT-2 medium's, ~0.25 µs
    /// per large allocation for nothing) it gives up for `PLAN_SNOOZE_FIRST` windows, doubling with each
    /// give-up in a row, then looks again.
    pub fn awake(&self) -> bool {
        // A window clock: a plain load and store (no locked instruction on every large allocation); a
        // race can repeat or skip one count, moving a window check by one allocation.
        let n = self.clock.load(Relaxed);
        self.clock.store(n.wrapping_add(1), Relaxed);
        if n % PLAN_WAKE_WINDOW == 0 {
            let steals = self.region.pool().stats().steals;
            let moving = steals > self.steals.swap(steals, Relaxed);
            let snooze = self.snooze.load(Relaxed);
            if snooze > 0 {
                // Given up for a while: wake when it is over, to look for a period again.
                self.snooze.store(snooze - 1, Relaxed);
                if snooze == 1 {
                    self.quiet.store(0, Relaxed);
                }
                return false;
            }
            let awake = self.quiet.load(Relaxed) < PLAN_QUIET_WINDOWS;
            // With `min_moves` 0 plans are served without waiting for moves, so a period being recorded
            // or packed, or a ready plan, keeps the planner awake to follow the sequence to the plan's
            // activation point.
            let mut g = self.inner.lock();
            let s = g.planner.stats();
            let serving = s.active || s.planned_live > 0;
            let has_period = s.recording || s.period > 0;
            let busy = serving || (self.min_moves == 0.0 && has_period);
            // Awake while pages move but no period shows up (random shapes): after a while the planner
            // costs more than it can win; it gives up for a growing number of windows.
            if serving || has_period {
                self.fruitless.store(0, Relaxed);
                self.backoff.store(PLAN_SNOOZE_FIRST, Relaxed);
            } else if awake && self.fruitless.fetch_add(1, Relaxed) + 1 >= PLAN_GIVE_UP_WINDOWS {
                self.fruitless.store(0, Relaxed);
                let backoff = self.backoff.load(Relaxed);
                self.backoff
                    .store((backoff * 2).min(PLAN_SNOOZE_MAX), Relaxed);
                self.snooze.store(backoff, Relaxed);
                self.snoozes.fetch_add(1, Relaxed);
                self.quiet.store(PLAN_QUIET_WINDOWS, Relaxed);
                g.planner.pause();
                return false;
            }
            if moving || busy {
                self.quiet.store(0, Relaxed);
            } else if self.quiet.fetch_add(1, Relaxed) + 1 == PLAN_QUIET_WINDOWS {
                g.planner.pause();
            }
        }
        self.quiet.load(Relaxed) < PLAN_QUIET_WINDOWS
    }

    /// One large-block allocation through the planner: the plan's slot (its pages committed: the block's
    /// address and its ticket), or the ticket to pass to [`PlanServer::free`] when the tiers serve it.
    /// `run`: large allocations since the last free. A run longer than any in the recorded period —
    /// state being built (weights, optimizer moments), which would squat on a planned slot for good — is
    /// not planned; a forward pass's own runs (GPT-2: dozens) are.
    pub fn alloc(&self, size: u64, run: u64) -> (Option<u64>, Ticket) {
        match self.decide(size, run) {
            Decision::Planned { offset, ticket } => (Some(self.region.base() + offset), ticket),
            Decision::Unplanned { ticket } => (None, ticket),
        }
    }

    fn decide(&self, size: u64, run: u64) -> Decision {
        let region = &self.region;
        let mut g = self.inner.lock();
        g.planner.note_run(run);
        let misses = g.planner.misses();
        let d = g.planner.on_alloc(size);
        if g.pinned_pages > 0 && g.planner.misses() > misses {
            // The sequence left the plan (a new phase of the program): every allocation it does not
            // cover would grow the tiers beside pages pinned for blocks that may not come. Drop the plan
            // and give its idle pages back now; a new plan is learnt if the sequence repeats again.
            g.planner.deactivate();
            g.unpin_to_blocks(region);
        }
        // Longer than any run of the recorded period (and than PLAN_BURST): state being built.
        let burst = run >= g.planner.max_run().map_or(0, |m| m + 1).max(PLAN_BURST);
        if g.planner.take_release() {
            g.unpin(region);
        }
        if let Some(footprint) = g.planner.wants_activation() {
            // A plan exists to stop page moves: serve it only once two whole periods in a row have each
            // moved at least `min_moves` (1/200) of its footprint (one period of moves is a transient: a
            // new phase settling). Where the tiers' layout already repeats in place (ResNet-50) the plan
            // stays ready and unused, costing neither memory nor moves.
            let pages = region.pool();
            let moves = pages.stats().steals;
            let moved = g.moves_at_phase.replace(moves).map(|m| moves - m);
            let moving = moved.is_some_and(|m| {
                (m * pages.page_size()) as f64 >= self.min_moves * footprint as f64
            });
            g.moving_periods = if moving { g.moving_periods + 1 } else { 0 };
            if self.min_moves == 0.0 || g.moving_periods >= 2 {
                g.planner.activate();
                if self.pin && g.pinned.is_none() && g.tally.pages() == 0 {
                    // Pinned again after a dropped plan's blocks are all gone.
                    let n = (region.len() / pages.page_size()).div_ceil(64) as usize;
                    g.pinned = Some(vec![0; n]);
                }
            }
        }
        match d {
            Decision::Planned { ticket, .. } if burst => g.give_back(region, ticket),
            Decision::Planned { offset, ticket } => {
                let mapped = if g.pinned.is_some() {
                    g.pin(region, offset, size)
                } else {
                    region
                        .commit(offset, size, true)
                        .map(|()| g.tally.add(offset, size))
                };
                match mapped {
                    Ok(()) => {
                        g.peak_pages = g.peak_pages.max(g.pages());
                        d
                    }
                    Err(e) => {
                        // No page for it now: give the slot back; the tiers' out-of-memory path takes
                        // over.
                        log::debug!("gen-plan: planned slot not mapped: {e}");
                        g.give_back(region, ticket)
                    }
                }
            }
            other => other,
        }
    }

    /// A block the planner tracks is gone; `range` = `(ptr, size)` of a planned block (served from the
    /// range: its pages are decommitted), `None` for one the tiers served.
    pub fn free(&self, ticket: Ticket, range: Option<(u64, u64)>) {
        if !ticket.is_tracked() {
            return;
        }
        let mut g = self.inner.lock();
        if let (Some((ptr, size)), None) = (range, &g.pinned) {
            let off = ptr - self.region.base();
            self.region.decommit(off, size);
            g.tally.remove(off, size);
        }
        if g.planner.on_free(ticket) {
            g.unpin(&self.region);
        }
    }

    /// Stop serving from the plan (its live blocks keep their slots until freed; pinned pages go back
    /// once none is live).
    pub fn drop_plan(&self) {
        let mut g = self.inner.lock();
        if g.planner.deactivate() {
            g.unpin(&self.region);
        } else {
            g.unpin_to_blocks(&self.region);
        }
    }

    /// Whether a plan is being recorded, or is ready and waiting for moves to prove it is needed (it will
    /// fix the moves itself: headroom bought meanwhile would be held for nothing).
    pub fn pending(&self) -> bool {
        let s = self.inner.lock().planner.stats();
        s.recording || (s.period > 0 && !s.active)
    }

    /// Whether plans pin their pages (a trim then drops the plan to give them back).
    pub fn pins(&self) -> bool {
        self.pin
    }

    /// Counters.
    pub fn stats(&self) -> PlanServerStats {
        let g = self.inner.lock();
        let page = self.region.pool().page_size();
        PlanServerStats {
            planner: g.planner.stats(),
            committed: g.pages() * page,
            committed_peak: g.peak_pages * page,
            awake: self.quiet.load(Relaxed) < PLAN_QUIET_WINDOWS,
            snoozes: self.snoozes.load(Relaxed),
        }
    }
}
