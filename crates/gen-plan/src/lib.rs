//! Periodic allocation plans.
//!
//! A training loop allocates the same sequence of blocks every iteration. A best-fit allocator lays that
//! sequence out anew each time, reacting to the holes it left itself; the address space it touches over an
//! iteration is several percent larger than what is live at the peak, and a page-mapped pool pays for the
//! difference either in memory (keep every touched page) or in page moves (unmap and remap while the
//! iteration runs, ~46 µs each on an H200). Knowing one whole iteration in advance removes both.
//!
//! A [`Planner`] watches the sizes of the allocations it is shown and:
//!
//! 1. **detects** a period: the smallest gap `p` at which the sequence has repeated for at least
//!    `max(p, confirm)` allocations (inner repetitions, such as the identical layers of a transformer,
//!    stop repeating before that and are not taken);
//! 2. **records** one period, learning when each of its blocks is freed (lifetimes in allocation
//!    positions, possibly wrapping into the next period), while checking that the next period repeats it;
//! 3. **packs** the period offline ([`solve::pack`]: greedy by size, best-fitting gap, on a circle) into
//!    one address range — its footprint is within a few percent of the most bytes alive at one moment;
//! 4. asks its owner to **activate** the plan at the position of the period where the fewest planned
//!    bytes are alive (the iteration boundary), the owner maps the footprint once, and from then on
//!    **serves** each allocation whose size matches the plan's next position at its planned offset — no
//!    search, no page work. An allocation that does not match (a shape changed, an extra tensor) is not
//!    planned: the owner serves it elsewhere; the planner resynchronises on the next recognisable window of
//!    sizes. A planned slot is only handed out when no block whose range overlaps it is live (checked
//!    against a precomputed conflict list), so a block that lives longer than recorded is never
//!    overwritten. When more than half of the allocations of two periods miss, the plan is dropped and the
//!    planner starts detecting again; the owner releases the range once its last planned block is freed.
//!
//! The planner only computes offsets: it knows nothing of devices, streams or threads (its owner serialises
//! calls, e.g. under a mutex, and keeps planning to a single stream — see genpool's engine). [`PlanServer`]
//! (`server.rs`) is that owner's half: the range of page-mapped address space a plan serves from.

pub mod server;
pub mod solve;

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Hashes a window fingerprint (already a hash of the window's sizes: [`window_hash`]) with one
/// multiply, for the planner's maps keyed by fingerprints. The standard map's SipHash was most of
/// detection's cost on every large allocation while the planner is awake (its order is not relied on:
/// the maps are only looked up).
#[derive(Default)]
struct FingerprintHasher(u64);

impl Hasher for FingerprintHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(self.0.rotate_left(8) ^ u64::from(b));
        }
    }

    fn write_u64(&mut self, k: u64) {
        self.0 = (k ^ (k >> 32)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// A map keyed by window fingerprints.
type ByFingerprint = HashMap<u64, u64, BuildHasherDefault<FingerprintHasher>>;

pub use server::{PlanServer, PlanServerConfig, PlanServerStats};
use solve::Interval;

/// Configuration of a [`Planner`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanConfig {
    /// Shortest period considered (allocations).
    pub min_period: u64,
    /// Longest period considered (allocations); also bounds the history kept.
    pub max_period: u64,
    /// A period is adopted once the sequence has repeated at that gap for at least this many allocations
    /// (and at least one whole period).
    pub confirm: u64,
    /// Allocations hashed together to recognise a position (detection and resynchronisation).
    pub window: usize,
    /// Pack recorded periods on a helper thread instead of inside the [`Planner::on_alloc`] that ends
    /// the recording. Packing is quadratic in the blocks of a period (milliseconds for a ResNet-50 step,
    /// a few hundred for a GPT-2-medium one on a server core): on the allocating thread it stalls the
    /// program. In the background the plan arrives some allocations later and starts following the
    /// sequence where it then is; results no longer depend only on the sequence, so tests and
    /// reproducible replays keep it off (the default).
    pub background: bool,
}

impl Default for PlanConfig {
    fn default() -> Self {
        PlanConfig {
            min_period: 16,
            max_period: 8192,
            confirm: 2048,
            window: 8,
            background: true,
        }
    }
}

/// What to do with one allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Serve the block at `offset` in the plan's range.
    Planned {
        /// Offset in the plan's range.
        offset: u64,
        /// Give it back to [`Planner::on_free`].
        ticket: Ticket,
    },
    /// Serve the block elsewhere.
    Unplanned {
        /// Give it back to [`Planner::on_free`] (the planner may be recording this block's lifetime).
        ticket: Ticket,
    },
}

impl Decision {
    /// The ticket, planned or not.
    pub fn ticket(&self) -> Ticket {
        match *self {
            Decision::Planned { ticket, .. } | Decision::Unplanned { ticket } => ticket,
        }
    }
}

/// Identifies a block to the planner at its free. `Ticket::NONE` needs no call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Hash)]
pub struct Ticket(u64);

const PLANNED: u64 = 1 << 63;
const RECORDED: u64 = 1 << 62;

impl Ticket {
    /// A block the planner does not track.
    pub const NONE: Ticket = Ticket(0);
    /// Whether the block was served from the plan's range.
    pub fn is_planned(self) -> bool {
        self.0 & PLANNED != 0
    }
    /// Whether [`Planner::on_free`] must be called for it.
    pub fn is_tracked(self) -> bool {
        self.0 != 0
    }
}

/// Counters of a [`Planner`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PlanStats {
    /// Period of the current plan (0: none).
    pub period: u64,
    /// Bytes of the current plan's range.
    pub footprint: u64,
    /// Most bytes of planned blocks alive at one moment of the recorded period (the footprint's bound).
    pub lower_bound: u64,
    /// Whether a plan is serving allocations.
    pub active: bool,
    /// Allocations served at a planned offset.
    pub hits: u64,
    /// Allocations that did not match the plan's next position (and could not resynchronise).
    pub misses: u64,
    /// Matching allocations whose slot (or an overlapping one) was still live: served elsewhere.
    pub blocked: u64,
    /// Matching allocations at positions the plan does not cover (blocks that outlive a period).
    pub outside: u64,
    /// Planned blocks live now.
    pub planned_live: u64,
    /// Plans activated so far.
    pub activations: u64,
    /// Plans dropped so far.
    pub deactivations: u64,
    /// Recordings abandoned because the sequence stopped repeating.
    pub aborted_recordings: u64,
    /// Whether a period is being recorded or packed now (a plan may follow).
    pub recording: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Status {
    Ready,
    Active,
    Draining,
}

struct Plan {
    generation: u64,
    period: u64,
    sizes: Vec<u64>,
    /// Planned offset per position; `u64::MAX` = not planned.
    offsets: Vec<u64>,
    /// Conflicts of each position (planned positions whose ranges overlap), CSR.
    conflict_start: Vec<u32>,
    conflicts: Vec<u32>,
    live: Vec<bool>,
    live_count: u64,
    /// Position the next allocation is expected at.
    cursor: u64,
    /// Position at which to activate (fewest planned bytes alive).
    phase: u64,
    /// Window fingerprint ending at a position → that position (unique windows only).
    by_fingerprint: ByFingerprint,
    footprint: u64,
    lower_bound: u64,
    /// Longest run of allocations with no free in between while the period was recorded.
    max_run: u64,
    status: Status,
    window_allocs: u64,
    window_misses: u64,
    /// Allocations matched in a row at the cursor (a resynchronisation on a window counts as `window`).
    streak: u64,
    /// Allocations in a fingerprint window.
    window: u64,
    /// Matches in a row needed before planned slots are handed out again after a miss.
    confidence: u64,
}

const UNPLANNED: u64 = u64::MAX;

struct Record {
    period: u64,
    /// Sequence number of the first recorded allocation.
    start: u64,
    sizes: Vec<u64>,
    /// Sequence number at which each recorded block was freed (the count of allocations before it).
    freed_at: Vec<u64>,
    /// Longest run of allocations with no free in between seen while recording (see
    /// [`Planner::note_run`]).
    max_run: u64,
}

/// Detects, records, packs and serves a periodic allocation sequence. See the crate docs.
pub struct Planner {
    cfg: PlanConfig,
    /// Allocations seen.
    seq: u64,
    /// Sizes of the last `hist.len()` allocations (ring).
    hist: Vec<u64>,
    mask: u64,
    /// Fingerprint → last sequence number whose window had it.
    last_seen: ByFingerprint,
    /// Per ring slot: (sequence number, previous sequence number with the same fingerprint).
    chain: Vec<(u64, u64)>,
    /// Candidate gaps and how long the sequence has repeated at each.
    gaps: Vec<(u64, u64)>,
    /// Gaps below this were tried and failed.
    floor: u64,
    /// No recording starts before this allocation (backoff after ready plans that lost the sequence).
    hold_until: u64,
    /// Periods to wait after the next ready plan that loses the sequence (doubles each time, up to 64;
    /// back to 1 when a plan is served).
    backoff: u64,
    record: Option<Record>,
    plan: Option<Plan>,
    generations: u64,
    /// A plan was dropped inside `on_alloc` with no planned block live: its range may go.
    release_pending: bool,
    /// A period being packed on a helper thread ([`PlanConfig::background`]).
    packing: Option<Packing>,
    /// Tests: leave a packed plan waiting (as if the helper thread were slow).
    #[cfg(test)]
    hold_packed: bool,
    /// Tests: a packed plan received by `wait_packed`, adopted by the next poll.
    #[cfg(test)]
    received: Option<Option<Plan>>,
    stats: PlanStats,
}

/// A recorded period handed to a helper thread to pack.
struct Packing {
    /// Sequence number of the allocation at position 0 after the recording (the plan's cursor 0).
    next: u64,
    period: u64,
    rx: std::sync::mpsc::Receiver<Option<Plan>>,
}

impl std::fmt::Debug for Planner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Planner")
            .field("seq", &self.seq)
            .field("stats", &self.stats())
            .finish()
    }
}

const NO_SEQ: u64 = u64::MAX;

/// Earlier positions with the same window visited per allocation when looking for candidate periods.
/// Each step is a likely cache miss on a cold allocator path (the planner's detection costs ~0.5-0.9 µs
/// per large allocation with cold caches, `genpool/examples/coldops.rs`), but fewer steps find a loop of
/// identical layers' period later (4 steps: 9 iterations instead of 3 on the tests' synthetic loop), which
/// delays plans and hides the backoff; 16 is kept.
const CHAIN_STEPS: usize = 16;

impl Planner {
    /// A planner with `cfg` (sizes are clamped to sane ranges: `window` ≥ 2, `min_period` ≥ `window`).
    pub fn new(cfg: PlanConfig) -> Self {
        let mut cfg = cfg;
        cfg.window = cfg.window.clamp(2, 64);
        cfg.min_period = cfg.min_period.max(cfg.window as u64).max(2);
        cfg.max_period = cfg.max_period.clamp(cfg.min_period, 1 << 20);
        let ring = (cfg.max_period + cfg.window as u64 + 2).next_power_of_two();
        Planner {
            seq: 0,
            hist: vec![0; ring as usize],
            mask: ring - 1,
            last_seen: ByFingerprint::default(),
            chain: vec![(NO_SEQ, NO_SEQ); ring as usize],
            gaps: Vec::new(),
            floor: cfg.min_period,
            hold_until: 0,
            backoff: 1,
            record: None,
            plan: None,
            generations: 0,
            release_pending: false,
            packing: None,
            #[cfg(test)]
            hold_packed: false,
            #[cfg(test)]
            received: None,
            stats: PlanStats::default(),
            cfg,
        }
    }

    /// Allocations a served plan did not expect so far (`stats().misses`, without building the rest).
    pub fn misses(&self) -> u64 {
        self.stats.misses
    }

    /// Counters.
    pub fn stats(&self) -> PlanStats {
        let mut s = self.stats;
        s.recording = self.record.is_some() || self.packing.is_some();
        if let Some(p) = &self.plan {
            s.period = p.period;
            s.footprint = p.footprint;
            s.lower_bound = p.lower_bound;
            s.active = p.status == Status::Active;
            s.planned_live = p.live_count;
        }
        s
    }

    #[inline]
    fn size_at(&self, seq: u64) -> u64 {
        self.hist[(seq & self.mask) as usize]
    }

    /// Fingerprint of the `window` sizes ending at `seq` (which must be in the history).
    fn fingerprint(&self, seq: u64) -> u64 {
        let w = self.cfg.window as u64;
        window_hash((seq + 1 - w..=seq).map(|s| self.size_at(s)))
    }

    /// Tell the planner how many allocations the caller has seen since the last free of any block (before
    /// the [`on_alloc`](Self::on_alloc) it precedes). While recording, the longest such run is kept with
    /// the plan: [`max_run`](Self::max_run).
    pub fn note_run(&mut self, run: u64) {
        if let Some(r) = self.record.as_mut() {
            r.max_run = r.max_run.max(run);
        }
    }

    /// The longest run of allocations with no free in between within the recorded period of the current
    /// plan (`None` without a plan). A longer run at run time is not part of the period — state being
    /// built (weights, optimizer moments) — and should not take planned slots.
    pub fn max_run(&self) -> Option<u64> {
        self.plan.as_ref().map(|p| p.max_run)
    }

    /// One allocation of `size` bytes (already rounded as its owner rounds). Returns where to serve it.
    pub fn on_alloc(&mut self, size: u64) -> Decision {
        let n = self.seq;
        if self.packing.is_some() {
            self.poll_packing(n);
        }
        self.seq += 1;
        let slot = (n & self.mask) as usize;
        self.hist[slot] = size;
        let fp = (n + 1 >= self.cfg.window as u64).then(|| self.fingerprint(n));

        let mut decision = Decision::Unplanned {
            ticket: Ticket::NONE,
        };
        let mut serving = false;
        if let Some(plan) = self.plan.as_mut() {
            match plan.status {
                Status::Active => {
                    serving = true;
                    decision = plan.serve(size, fp, &mut self.stats);
                    if plan.window_allocs >= 2 * plan.period {
                        let drop = plan.window_misses * 2 > plan.window_allocs;
                        plan.window_allocs = 0;
                        plan.window_misses = 0;
                        if drop {
                            self.stats.deactivations += 1;
                            self.release_pending |= self.deactivate();
                        }
                    }
                }
                Status::Ready => {
                    serving = true;
                    if !plan.follow(size, fp) {
                        // The sequence changed before the plan could start: drop it, and wait a
                        // growing number of periods before packing another (packing is the planner's
                        // one costly step; a loop that keeps leaving its plan would repack for ever).
                        self.hold_until = n + self.backoff * plan.period;
                        self.backoff = (self.backoff * 2).min(64);
                        self.plan = None;
                        self.stats.aborted_recordings += 1;
                    }
                }
                Status::Draining => {}
            }
        }
        if !serving {
            decision = Decision::Unplanned {
                ticket: self.observe(n, size, fp),
            };
        }
        decision
    }

    /// Detection and recording for allocation `n`; returns the ticket to record its lifetime.
    fn observe(&mut self, n: u64, size: u64, fp: Option<u64>) -> Ticket {
        let mut ticket = Ticket::NONE;
        if let Some(rec) = self.record.as_mut() {
            let idx = n - rec.start;
            let repeats =
                n >= rec.period && self.hist[((n - rec.period) & self.mask) as usize] == size;
            if !repeats {
                self.floor = self.floor.max(rec.period + 1);
                self.record = None;
                self.stats.aborted_recordings += 1;
            } else if idx < rec.period {
                rec.sizes.push(size);
                rec.freed_at.push(NO_SEQ);
                ticket = Ticket(RECORDED | n);
            } else if idx + 1 == 2 * rec.period {
                let rec = self.record.take().expect("recording");
                self.finish_recording(rec);
            }
        }
        if let Some(fp) = fp {
            self.detect(n, size, fp);
        }
        ticket
    }

    fn detect(&mut self, n: u64, size: u64, fp: u64) {
        // Extend or end the runs of the candidate gaps.
        let (hist, mask) = (&self.hist, self.mask);
        self.gaps.retain_mut(|(g, run)| match n.checked_sub(*g) {
            Some(m) if hist[(m & mask) as usize] == size => {
                *run += 1;
                true
            }
            _ => false,
        });
        // New candidates: earlier positions with the same window, walking back along the chain.
        let prev = self.last_seen.insert(fp, n).unwrap_or(NO_SEQ);
        self.chain[(n & self.mask) as usize] = (n, prev);
        let mut q = prev;
        for _ in 0..CHAIN_STEPS {
            if q == NO_SEQ || n - q > self.cfg.max_period {
                break;
            }
            let g = n - q;
            if g >= self.floor && self.gaps.len() < 32 && !self.gaps.iter().any(|&(x, _)| x == g) {
                self.gaps.push((g, self.cfg.window as u64));
            }
            let (at, before) = self.chain[(q & self.mask) as usize];
            if at != q {
                break;
            }
            q = before;
        }
        if self.last_seen.len() > 4 * self.hist.len() {
            self.last_seen.clear();
        }
        if self.record.is_some()
            || self.plan.is_some()
            || self.packing.is_some()
            || n < self.hold_until
        {
            return;
        }
        let confirmed = self
            .gaps
            .iter()
            .filter(|&&(g, run)| run >= g.max(self.cfg.confirm))
            .map(|&(g, _)| g)
            .min();
        if let Some(period) = confirmed {
            self.record = Some(Record {
                period,
                start: n + 1,
                sizes: Vec::with_capacity(period as usize),
                freed_at: Vec::with_capacity(period as usize),
                max_run: 0,
            });
        }
    }

    fn finish_recording(&mut self, rec: Record) {
        let p = rec.period;
        let window = self.cfg.window as u64;
        if self.cfg.background {
            let (tx, rx) = std::sync::mpsc::sync_channel(1);
            let next = self.seq; // on_alloc has counted the allocation that ended the recording
            let job = move || {
                // A closed channel (the planner is gone) is fine: nobody wants the plan any more.
                let _ = tx.send(build_plan(rec, window));
            };
            match std::thread::Builder::new()
                .name("genpool-plan".into())
                .spawn(job)
            {
                Ok(_) => {
                    self.packing = Some(Packing {
                        next,
                        period: p,
                        rx,
                    });
                    return;
                }
                // No thread to be had: the job, and the record moved into it, went with the error. This
                // recording is lost (counted as aborted); detection records the period again later.
                Err(e) => {
                    log::debug!("gen-plan: no packing thread ({e}); the period is recorded again");
                    self.stats.aborted_recordings += 1;
                    return;
                }
            }
        }
        let plan = build_plan(rec, window);
        self.install(plan, 0, p);
    }

    /// Tests: block until the helper thread has packed the current period (up to `timeout`); the plan
    /// is adopted by the next allocation, as if it had arrived then. False on timeout or with nothing
    /// being packed.
    #[cfg(test)]
    fn wait_packed(&mut self, timeout: std::time::Duration) -> bool {
        if self.received.is_some() {
            return true;
        }
        let Some(job) = self.packing.as_ref() else {
            return false;
        };
        match job.rx.recv_timeout(timeout) {
            Ok(plan) => {
                self.received = Some(plan);
                true
            }
            Err(_) => false,
        }
    }

    /// Whether a recorded period is being packed on a helper thread.
    pub fn packing(&self) -> bool {
        self.packing.is_some()
    }

    /// Take a plan packed in the background when it is ready; `n`: the allocation about to be seen.
    fn poll_packing(&mut self, n: u64) {
        let Some(job) = self.packing.as_ref() else {
            return;
        };
        #[cfg(test)]
        if self.hold_packed {
            return;
        }
        #[cfg(test)]
        let early = self.received.take();
        #[cfg(not(test))]
        let early: Option<Option<Plan>> = None;
        let plan = match early.map_or_else(|| job.rx.try_recv(), Ok) {
            Ok(plan) => plan,
            Err(std::sync::mpsc::TryRecvError::Empty) => return,
            // The helper thread died (it cannot panic short of an allocation failure): start over.
            Err(std::sync::mpsc::TryRecvError::Disconnected) => None,
        };
        let job = self.packing.take().expect("checked above");
        // The sequence went on while the period was packed: the plan follows it from where it is now.
        let cursor = (n - job.next) % job.period;
        self.install(plan, cursor, job.period);
    }

    /// Adopt a packed plan (`None`: the period had nothing to plan) as ready, expecting position `cursor`
    /// next.
    fn install(&mut self, plan: Option<Plan>, cursor: u64, period: u64) {
        match plan {
            Some(mut plan) => {
                self.generations += 1;
                plan.generation = self.generations & 0xffff;
                plan.cursor = cursor;
                self.plan = Some(plan);
            }
            None => {
                self.floor = self.floor.max(period + 1);
                self.stats.aborted_recordings += 1;
            }
        }
    }

    /// The footprint of a ready plan that has reached its activation point (the next allocation is at the
    /// plan's phase); the owner then calls [`activate`](Self::activate).
    pub fn wants_activation(&self) -> Option<u64> {
        self.plan
            .as_ref()
            .filter(|p| p.status == Status::Ready && p.cursor == p.phase)
            .map(|p| p.footprint)
    }

    /// Serve from the ready plan from the next allocation on.
    pub fn activate(&mut self) {
        if let Some(p) = self.plan.as_mut().filter(|p| p.status == Status::Ready) {
            p.status = Status::Active;
            self.stats.activations += 1;
            self.backoff = 1;
        }
    }

    /// Stop serving from the plan (e.g. memory pressure, a second stream). Returns true when the owner
    /// may release the plan's range now (no planned block is live); otherwise the last
    /// [`on_free`](Self::on_free) of a planned block says so.
    pub fn deactivate(&mut self) -> bool {
        self.floor = self.cfg.min_period;
        self.gaps.clear();
        match self.plan.as_mut() {
            Some(p) if p.live_count > 0 => {
                p.status = Status::Draining;
                false
            }
            Some(_) => {
                self.plan = None;
                true
            }
            None => false,
        }
    }

    /// The owner stops showing allocations to the planner for a while (it sleeps while nothing needs a
    /// plan). What depends on seeing every allocation is dropped: a period being recorded or packed (its
    /// lifetimes would have a hole) and a ready plan not yet served (it could not follow the sequence
    /// across the gap); so are the candidate periods. An active or draining plan is kept (the owner does
    /// not pause while one serves). Each drop counts as an aborted recording. Detection starts afresh on
    /// the next [`on_alloc`](Self::on_alloc).
    pub fn pause(&mut self) {
        let recorded = self.record.take().is_some();
        let packing = self.packing.take().is_some();
        let ready = self
            .plan
            .as_ref()
            .is_some_and(|p| p.status == Status::Ready);
        if ready {
            self.plan = None;
        }
        if recorded || packing || ready {
            self.stats.aborted_recordings += 1;
        }
        self.gaps.clear();
        self.floor = self.cfg.min_period;
    }

    /// True (once) when a plan was dropped during [`on_alloc`](Self::on_alloc) with no planned block
    /// live: the owner releases the plan's range.
    pub fn take_release(&mut self) -> bool {
        std::mem::take(&mut self.release_pending)
    }

    /// The planned blocks live now, as `(offset, size)` (for an owner shutting down).
    pub fn live_ranges(&self) -> Vec<(u64, u64)> {
        self.plan.as_ref().map_or_else(Vec::new, |p| {
            (0..p.period as usize)
                .filter(|&i| p.live[i])
                .map(|i| (p.offsets[i], p.sizes[i]))
                .collect()
        })
    }

    /// A block with `ticket` was freed. Returns true when the owner should release the plan's range now
    /// (the plan was dropped and this was its last live block).
    pub fn on_free(&mut self, ticket: Ticket) -> bool {
        if ticket.0 & PLANNED != 0 {
            let pos = (ticket.0 & 0xffff_ffff) as usize;
            let generation = (ticket.0 >> 32) & 0xffff;
            if let Some(p) = self.plan.as_mut() {
                if p.generation == generation && p.live.get(pos) == Some(&true) {
                    p.live[pos] = false;
                    p.live_count -= 1;
                    if p.status == Status::Draining && p.live_count == 0 {
                        self.plan = None;
                        return true;
                    }
                }
            }
        } else if ticket.0 & RECORDED != 0 {
            let seq = ticket.0 & !RECORDED;
            if let Some(rec) = self.record.as_mut() {
                if let Some(i) = seq.checked_sub(rec.start) {
                    if let Some(f) = rec.freed_at.get_mut(i as usize) {
                        *f = self.seq;
                    }
                }
            }
        }
        false
    }
}

/// Pack a recorded period into a ready plan (generation 0, cursor 0: the owner sets both); `None` when
/// no block of the period can be planned. Pure: runs on the allocating thread or on a helper.
fn build_plan(rec: Record, w: u64) -> Option<Plan> {
    let p = rec.period;
    let mut blocks = Vec::new();
    let mut positions = Vec::new();
    for (i, (&size, &freed)) in rec.sizes.iter().zip(&rec.freed_at).enumerate() {
        let (start, end) = (i as u64, freed.wrapping_sub(rec.start));
        if freed != NO_SEQ && end > start && end <= start + p {
            blocks.push(Interval { size, start, end });
            positions.push(i);
        }
    }
    if blocks.is_empty() {
        return None;
    }
    let (offs, footprint) = solve::pack(&blocks, p);
    let lower_bound = solve::peak_live(&blocks, p);
    let mut offsets = vec![UNPLANNED; p as usize];
    for (k, &i) in positions.iter().enumerate() {
        offsets[i] = offs[k];
    }
    // Conflicts: planned positions whose address ranges overlap (their lifetimes never do).
    let mut by_off: Vec<usize> = positions.clone();
    by_off.sort_unstable_by_key(|&i| offsets[i]);
    let mut lists: Vec<Vec<u32>> = vec![Vec::new(); p as usize];
    for (k, &i) in by_off.iter().enumerate() {
        let end = offsets[i] + rec.sizes[i];
        for &j in &by_off[k + 1..] {
            if offsets[j] >= end {
                break;
            }
            lists[i].push(j as u32);
            lists[j].push(i as u32);
        }
    }
    let mut conflict_start = Vec::with_capacity(p as usize + 1);
    let mut conflicts = Vec::new();
    for l in &lists {
        conflict_start.push(conflicts.len() as u32);
        conflicts.extend_from_slice(l);
    }
    conflict_start.push(conflicts.len() as u32);
    // Activate where the fewest planned bytes are alive.
    let live = solve::live_by_position(&blocks, p);
    let phase = (0..p).min_by_key(|&x| live[x as usize]).unwrap_or(0);
    let mut by_fingerprint = ByFingerprint::default();
    let mut dup = std::collections::HashSet::new();
    for x in 0..p {
        // The window ending at position x, wrapping around the period, oldest first — as at run time.
        let h = window_hash(
            (0..w)
                .rev()
                .map(|k| rec.sizes[((x + p * w - k) % p) as usize]),
        );
        if by_fingerprint.insert(h, x).is_some() {
            dup.insert(h);
        }
    }
    for h in dup {
        by_fingerprint.remove(&h);
    }
    Some(Plan {
        generation: 0,
        period: p,
        sizes: rec.sizes,
        offsets,
        conflict_start,
        conflicts,
        live: vec![false; p as usize],
        live_count: 0,
        // The recording ended at the last position of its second period: the next allocation is at
        // position 0.
        cursor: 0,
        phase,
        by_fingerprint,
        footprint,
        lower_bound,
        max_run: rec.max_run,
        status: Status::Ready,
        window_allocs: 0,
        window_misses: 0,
        streak: w,
        window: w,
        confidence: 4 * w,
    })
}

/// The hash of a window of sizes (oldest first) that identifies a position in the sequence: FNV-1a's
/// constants, with a shift so that high bits reach the low ones.
fn window_hash(sizes: impl Iterator<Item = u64>) -> u64 {
    sizes.fold(0xcbf2_9ce4_8422_2325u64, |h, size| {
        let h = (h ^ size).wrapping_mul(0x0000_0100_0000_01b3);
        h ^ (h >> 29)
    })
}

impl Plan {
    /// Advance the cursor for an allocation of `size` (a ready plan): false when the sequence no longer
    /// matches and cannot be resynchronised.
    fn follow(&mut self, size: u64, fp: Option<u64>) -> bool {
        match self.locate(size, fp) {
            Some((pos, _)) => {
                self.cursor = (pos + 1) % self.period;
                true
            }
            None => false,
        }
    }

    /// The position of an allocation of `size`: the cursor when the size matches, else the position whose
    /// window of sizes matches the recent ones. The flag says whether it was a resynchronisation.
    fn locate(&self, size: u64, fp: Option<u64>) -> Option<(u64, bool)> {
        if self.sizes[self.cursor as usize] == size {
            return Some((self.cursor, false));
        }
        fp.and_then(|h| self.by_fingerprint.get(&h).copied())
            .filter(|&pos| self.sizes[pos as usize] == size)
            .map(|pos| (pos, true))
    }

    fn serve(&mut self, size: u64, fp: Option<u64>, stats: &mut PlanStats) -> Decision {
        self.window_allocs += 1;
        let Some((pos, resync)) = self.locate(size, fp) else {
            self.window_misses += 1;
            self.streak = 0;
            stats.misses += 1;
            return Decision::Unplanned {
                ticket: Ticket::NONE,
            };
        };
        // A size that happens to match the cursor right after a miss proves little (a weight of the
        // same shape as an activation): hand out planned slots only once the position is certain — a
        // whole window matched — or a block with another lifetime could squat on a slot for long.
        self.streak = if resync {
            self.streak.max(self.window)
        } else {
            self.streak + 1
        };
        if self.streak < self.confidence {
            self.cursor = (pos + 1) % self.period;
            stats.blocked += 1;
            return Decision::Unplanned {
                ticket: Ticket::NONE,
            };
        }
        self.cursor = (pos + 1) % self.period;
        let i = pos as usize;
        let offset = self.offsets[i];
        let range = self.conflict_start[i] as usize..self.conflict_start[i + 1] as usize;
        if offset == UNPLANNED {
            stats.outside += 1;
            return Decision::Unplanned {
                ticket: Ticket::NONE,
            };
        }
        if self.live[i] || self.conflicts[range].iter().any(|&j| self.live[j as usize]) {
            stats.blocked += 1;
            return Decision::Unplanned {
                ticket: Ticket::NONE,
            };
        }
        self.live[i] = true;
        self.live_count += 1;
        stats.hits += 1;
        Decision::Planned {
            offset,
            ticket: Ticket(PLANNED | (self.generation << 32) | pos),
        }
    }
}

#[cfg(test)]
mod tests;
