//! The replay seam ([`ReplayAllocator`]) and the replay driver ([`replay`]).
//!
//! The trace is first compiled into a [`ReplayPlan`]: a compact op array in which every traced address
//! is mapped to a dense *slot* (slots are reused as blocks die, so the slot table is as long as the most
//! blocks ever live at once). The timed loop is then array indexing only: no hashing, no allocation.
//!
//! - Pass 1 is instrumented: `reserved()` is sampled after every op, and every returned block is
//!   checked against the live set for overlap and for [`MIN_ALIGN`] alignment (a typed
//!   [`ReplayError`] if the allocator breaks either).
//! - Passes 2..N are timed with one `Instant` around the whole pass, nothing per op.
//! - Blocks still live at the end of a pass (never freed in the trace) are freed before the next pass,
//!   untimed; the allocator itself is not reset (it is warm, as in a 2nd+ training iteration).
//! - `ns_per_op` = median over passes 2..N of pass time / (allocs + frees).
//! - `peak_reserved` = max of `allocator.peak_reserved()` (read after every pass) and the sampled
//!   `reserved()` of pass 1.
//!
//! Per pass the driver calls `mark_iteration()` before the first op and `end_pass()` after the
//! leftovers are freed, both untimed.

use std::collections::BTreeMap;
use std::time::Instant;

use crate::trace::{EventKind, Trace};
use crate::ReplayError;

/// The alignment every returned address must have (PyTorch rounds requests to 512 B and aligns blocks
/// at least that much).
pub const MIN_ALIGN: u64 = 512;

/// Per-tier figures an allocator may report.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct TierReport {
    /// Tier name (`slab`, `extent`, `stream`, `buddy`, ...).
    pub name: String,
    /// The tier's own high-water mark of bytes held from the device.
    pub peak_reserved: u64,
    /// Allocations the tier served (over all passes).
    pub allocs: u64,
}

/// Lifetime-classifier figures an allocator may report. Classes are `[short, mid, long]`; the confusion
/// matrices are indexed `[predicted][actual]`.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct ClassifierReport {
    /// Fraction of allocations whose class was predicted right.
    pub accuracy_count: f64,
    /// Fraction of allocated bytes whose class was predicted right.
    pub accuracy_bytes: f64,
    /// `[predicted][actual]` allocation counts.
    pub confusion_count: [[u64; 3]; 3],
    /// `[predicted][actual]` allocated bytes.
    pub confusion_bytes: [[u64; 3]; 3],
}

/// An allocator a trace can be replayed through. Addresses are device addresses (or simulated ones);
/// the replay never dereferences them.
pub trait ReplayAllocator {
    /// A short name for reports (`bfc`, `buddy`, `genpool`).
    fn name(&self) -> String;
    /// Where the memory comes from, for reports (`host` for simulated address arithmetic, `sim`,
    /// `cuda:0 NVIDIA H200`, ...).
    fn device(&self) -> String {
        "host".to_owned()
    }
    /// Hands out a block of at least `size` bytes, used on `stream`; `site` is the call-site hash when
    /// the caller knows it (`None` under `--ignore-site` and for events whose site is 0, "unknown"). Returns its address, aligned to at least [`MIN_ALIGN`].
    fn alloc(&mut self, size: u64, stream: u64, site: Option<u64>) -> Result<u64, ReplayError>;
    /// Takes back the block at `ptr` (`size` and `stream` as passed to / used with its `alloc`).
    fn free(&mut self, ptr: u64, size: u64, stream: u64) -> Result<(), ReplayError>;
    /// Bytes held from the device now.
    fn reserved(&self) -> u64;
    /// The allocator's own high-water mark of [`reserved`](Self::reserved).
    fn peak_reserved(&self) -> u64;
    /// Called at the start of every pass (an iteration boundary of the traced program).
    fn mark_iteration(&mut self) {}
    /// Called after every pass, once all its blocks are freed.
    fn end_pass(&mut self) {}
    /// Per-tier figures (empty for single-tier allocators).
    fn tiers(&self) -> Vec<TierReport> {
        Vec::new()
    }
    /// Classifier figures, for allocators that predict lifetimes.
    fn classifier(&self) -> Option<ClassifierReport> {
        None
    }
    /// Cumulative counts of the driver calls the allocator's device made (`(name, count)`, e.g.
    /// `device_syncs`), for allocators over a device: the replay reports how many the warm passes made.
    /// Empty for host-only allocators.
    fn call_counts(&self) -> Vec<(&'static str, u64)> {
        Vec::new()
    }
    /// The allocator's own cumulative counters after the last pass (`(name, value)`, e.g. genpool's
    /// `old_generation_allocs`), for reports. Empty by default.
    fn counters(&self) -> Vec<(&'static str, u64)> {
        Vec::new()
    }
}

impl<A: ReplayAllocator + ?Sized> ReplayAllocator for Box<A> {
    fn name(&self) -> String {
        (**self).name()
    }
    fn device(&self) -> String {
        (**self).device()
    }
    fn alloc(&mut self, size: u64, stream: u64, site: Option<u64>) -> Result<u64, ReplayError> {
        (**self).alloc(size, stream, site)
    }
    fn free(&mut self, ptr: u64, size: u64, stream: u64) -> Result<(), ReplayError> {
        (**self).free(ptr, size, stream)
    }
    fn reserved(&self) -> u64 {
        (**self).reserved()
    }
    fn peak_reserved(&self) -> u64 {
        (**self).peak_reserved()
    }
    fn mark_iteration(&mut self) {
        (**self).mark_iteration()
    }
    fn end_pass(&mut self) {
        (**self).end_pass()
    }
    fn tiers(&self) -> Vec<TierReport> {
        (**self).tiers()
    }
    fn classifier(&self) -> Option<ClassifierReport> {
        (**self).classifier()
    }
    fn call_counts(&self) -> Vec<(&'static str, u64)> {
        (**self).call_counts()
    }
    fn counters(&self) -> Vec<(&'static str, u64)> {
        (**self).counters()
    }
}

/// Replay settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplayOptions {
    /// Passes over the trace (≥ 1); pass 1 is instrumented, passes 2.. are timed.
    pub passes: u32,
    /// Pass `None` as the site (what PyTorch's pluggable-allocator hook can offer).
    pub ignore_site: bool,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        ReplayOptions {
            passes: 5,
            ignore_site: false,
        }
    }
}

/// The result of one replay. Serializes to one JSON object with the keys of issue #4.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ReplayReport {
    /// Trace name.
    pub trace: String,
    /// Allocator name.
    pub allocator: String,
    /// Where the memory came from ([`ReplayAllocator::device`]).
    pub device: String,
    /// Alloc + free calls per pass.
    pub ops: u64,
    /// The trace's peak live bytes.
    pub peak_live: u64,
    /// Most bytes the allocator held at once, over all passes.
    pub peak_reserved: u64,
    /// `peak_reserved / peak_live` (`null` for a trace with no allocations).
    pub ratio: Option<f64>,
    /// Median warm ns per op over passes 2..N (`null` with a single pass).
    pub ns_per_op: Option<f64>,
    /// ns per op of each timed pass, in order.
    pub ns_per_op_passes: Vec<f64>,
    /// Passes run.
    pub passes: u32,
    /// Whether sites were withheld from the allocator.
    pub ignore_site: bool,
    /// Per-tier figures.
    pub tiers: Vec<TierReport>,
    /// Classifier figures.
    pub classifier: Option<ClassifierReport>,
    /// Driver calls made during the timed (warm) passes, summed over passes 2..N, by kind
    /// ([`ReplayAllocator::call_counts`]; empty for host-only allocators). A warm pass of a training
    /// loop should make no `device_syncs` (`waits`: host waits of any kind).
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub warm_calls: std::collections::BTreeMap<&'static str, u64>,
    /// The allocator's own counters after the last pass ([`ReplayAllocator::counters`]; empty when it
    /// reports none), summed over all passes.
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub counters: std::collections::BTreeMap<&'static str, u64>,
}

/// One compiled op: an alloc into `slot`, or a free of the block in `slot` (with its alloc's size and
/// stream).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Op {
    size: u64,
    stream: u64,
    site: u64,
    slot: u32,
    free: bool,
}

/// A trace compiled for replay: ops over dense slots.
#[derive(Clone, Debug)]
pub struct ReplayPlan {
    ops: Vec<Op>,
    slots: usize,
    /// Blocks live at the end of the trace: (slot, size, stream).
    leftover: Vec<(u32, u64, u64)>,
    peak_live: u64,
    trace: String,
}

impl ReplayPlan {
    /// Compiles `trace`. Fails on events a validated [`Trace`] cannot contain (a free of a dead address,
    /// an alloc of a live one, size 0), which a hand-built trace might.
    pub fn new(trace: &Trace) -> Result<ReplayPlan, ReplayError> {
        let mut slot_of: crate::trace::AddrMap<(u32, u64, u64)> = Default::default();
        let mut free_slots: Vec<u32> = Vec::new();
        let mut slots: u32 = 0;
        let mut ops = Vec::with_capacity(trace.events.len());
        let (mut live, mut peak_live) = (0u64, 0u64);
        for (i, e) in trace.events.iter().enumerate() {
            let bad = |message: String| ReplayError::InvalidTrace { event: i, message };
            match e.kind {
                EventKind::Alloc => {
                    if e.size == 0 {
                        return Err(bad("allocation of size 0".into()));
                    }
                    let slot = match free_slots.pop() {
                        Some(s) => s,
                        None => {
                            slots = slots
                                .checked_add(1)
                                .ok_or_else(|| bad("more than 2^32 live blocks".into()))?;
                            slots - 1
                        }
                    };
                    if slot_of.insert(e.addr, (slot, e.size, e.stream)).is_some() {
                        return Err(bad(format!("allocation at live address {:#x}", e.addr)));
                    }
                    live += e.size;
                    peak_live = peak_live.max(live);
                    ops.push(Op {
                        size: e.size,
                        stream: e.stream,
                        site: e.site,
                        slot,
                        free: false,
                    });
                }
                EventKind::Free => {
                    let (slot, size, stream) = slot_of
                        .remove(&e.addr)
                        .ok_or_else(|| bad(format!("free of {:#x}, which is not live", e.addr)))?;
                    free_slots.push(slot);
                    live -= size;
                    // The block is freed with its allocation's size and stream.
                    ops.push(Op {
                        size,
                        stream,
                        site: 0,
                        slot,
                        free: true,
                    });
                }
            }
        }
        let mut leftover: Vec<(u32, u64, u64)> = slot_of.into_values().collect();
        leftover.sort_unstable();
        Ok(ReplayPlan {
            ops,
            slots: slots as usize,
            leftover,
            peak_live,
            trace: trace.name.clone(),
        })
    }

    /// Ops per pass.
    pub fn ops(&self) -> u64 {
        self.ops.len() as u64
    }

    /// The most blocks live at once (the slot table's length).
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Peak live bytes.
    pub fn peak_live(&self) -> u64 {
        self.peak_live
    }
}

/// Compiles `trace` and replays it through `alloc` (see the module docs for the protocol).
pub fn replay(
    trace: &Trace,
    alloc: &mut dyn ReplayAllocator,
    opts: &ReplayOptions,
) -> Result<ReplayReport, ReplayError> {
    let plan = ReplayPlan::new(trace)?;
    replay_plan(&plan, alloc, opts, &mut |_| {})
}

/// Replays a compiled plan; `on_pass(p)` is called after pass `p` (1-based) completes, e.g. to move a
/// progress bar.
pub fn replay_plan(
    plan: &ReplayPlan,
    alloc: &mut dyn ReplayAllocator,
    opts: &ReplayOptions,
    on_pass: &mut dyn FnMut(u32),
) -> Result<ReplayReport, ReplayError> {
    if opts.passes == 0 {
        return Err(ReplayError::NoPasses);
    }
    let mut ptrs = vec![0u64; plan.slots];
    let mut peak = instrumented_pass(plan, alloc, opts.ignore_site, &mut ptrs)?;
    finish_pass(plan, alloc, &ptrs, 1)?;
    peak = peak.max(alloc.peak_reserved());
    on_pass(1);
    let mut ns = Vec::with_capacity(opts.passes as usize - 1);
    let mut warm_calls = std::collections::BTreeMap::new();
    for pass in 2..=opts.passes {
        let before = alloc.call_counts();
        let elapsed = timed_pass(plan, alloc, opts.ignore_site, &mut ptrs, pass)?;
        for ((name, after), (_, b)) in alloc.call_counts().into_iter().zip(before) {
            *warm_calls.entry(name).or_insert(0) += after.saturating_sub(b);
        }
        finish_pass(plan, alloc, &ptrs, pass)?;
        peak = peak.max(alloc.peak_reserved());
        ns.push(if plan.ops.is_empty() {
            0.0
        } else {
            elapsed / plan.ops.len() as f64
        });
        on_pass(pass);
    }
    Ok(ReplayReport {
        trace: plan.trace.clone(),
        allocator: alloc.name(),
        device: alloc.device(),
        ops: plan.ops(),
        peak_live: plan.peak_live,
        peak_reserved: peak,
        ratio: (plan.peak_live > 0).then(|| peak as f64 / plan.peak_live as f64),
        ns_per_op: median(&ns),
        ns_per_op_passes: ns,
        passes: opts.passes,
        ignore_site: opts.ignore_site,
        tiers: alloc.tiers(),
        classifier: alloc.classifier(),
        warm_calls,
        counters: alloc.counters().into_iter().collect(),
    })
}

fn median(v: &[f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    Some(if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    })
}

fn op_err(pass: u32, op: usize, e: ReplayError) -> ReplayError {
    ReplayError::Op {
        pass,
        op,
        source: Box::new(e),
    }
}

/// Pass 1: every op checked, `reserved()` sampled after each. Returns the sampled maximum.
fn instrumented_pass(
    plan: &ReplayPlan,
    alloc: &mut dyn ReplayAllocator,
    ignore_site: bool,
    ptrs: &mut [u64],
) -> Result<u64, ReplayError> {
    const PASS: u32 = 1;
    alloc.mark_iteration();
    // Live blocks by start address → end (exclusive), to find overlaps in O(log n).
    let mut live: BTreeMap<u64, u64> = BTreeMap::new();
    let mut peak = alloc.reserved();
    for (i, op) in plan.ops.iter().enumerate() {
        if op.free {
            let p = ptrs[op.slot as usize];
            live.remove(&p);
            alloc
                .free(p, op.size, op.stream)
                .map_err(|e| op_err(PASS, i, e))?;
        } else {
            let site = (!ignore_site && op.site != 0).then_some(op.site);
            let p = alloc
                .alloc(op.size, op.stream, site)
                .map_err(|e| op_err(PASS, i, e))?;
            if p % MIN_ALIGN != 0 {
                return Err(ReplayError::Misaligned {
                    pass: PASS,
                    op: i,
                    addr: p,
                });
            }
            let end = p.checked_add(op.size).ok_or(ReplayError::Overlap {
                pass: PASS,
                op: i,
                addr: p,
                size: op.size,
                other_addr: p,
                other_size: op.size,
            })?;
            let overlap = |(&s, &e): (&u64, &u64)| ReplayError::Overlap {
                pass: PASS,
                op: i,
                addr: p,
                size: op.size,
                other_addr: s,
                other_size: e - s,
            };
            if let Some(prev) = live.range(..=p).next_back() {
                if *prev.1 > p {
                    return Err(overlap(prev));
                }
            }
            if let Some(next) = live.range(p..).next() {
                if *next.0 < end {
                    return Err(overlap(next));
                }
            }
            live.insert(p, end);
            ptrs[op.slot as usize] = p;
        }
        peak = peak.max(alloc.reserved());
    }
    Ok(peak)
}

/// Passes 2..N: one `Instant` around the whole loop. Returns elapsed nanoseconds.
fn timed_pass(
    plan: &ReplayPlan,
    alloc: &mut dyn ReplayAllocator,
    ignore_site: bool,
    ptrs: &mut [u64],
    pass: u32,
) -> Result<f64, ReplayError> {
    alloc.mark_iteration();
    let t0 = Instant::now();
    for (i, op) in plan.ops.iter().enumerate() {
        // Slots come from the plan, which sized `ptrs`; `get` keeps this free of panics anyway.
        let Some(slot) = ptrs.get_mut(op.slot as usize) else {
            return Err(op_err(
                pass,
                i,
                ReplayError::InvalidTrace {
                    event: i,
                    message: "slot out of range".into(),
                },
            ));
        };
        if op.free {
            alloc
                .free(*slot, op.size, op.stream)
                .map_err(|e| op_err(pass, i, e))?;
        } else {
            let site = (!ignore_site && op.site != 0).then_some(op.site);
            *slot = alloc
                .alloc(op.size, op.stream, site)
                .map_err(|e| op_err(pass, i, e))?;
        }
    }
    Ok(t0.elapsed().as_nanos() as f64)
}

/// Frees the blocks the trace never frees, untimed, then tells the allocator the pass ended.
fn finish_pass(
    plan: &ReplayPlan,
    alloc: &mut dyn ReplayAllocator,
    ptrs: &[u64],
    pass: u32,
) -> Result<(), ReplayError> {
    for &(slot, size, stream) in &plan.leftover {
        alloc
            .free(ptrs[slot as usize], size, stream)
            .map_err(|e| op_err(pass, plan.ops.len(), e))?;
    }
    alloc.end_pass();
    Ok(())
}
