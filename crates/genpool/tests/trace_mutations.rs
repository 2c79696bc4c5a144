//! Trace-driven property test of the engine (issue #6): random mutations of the real traces in
//! `benches/traces` (or `$GENPOOL_TRACE_DIR`) replayed through a [`Pool`] on a [`SimDevice`].
//!
//! A case takes a slice of one trace (2 000–5 000 events from a random start; the blocks live at the
//! slice start are allocated first) and mutates it:
//!
//! - **sizes scaled**: a share of the allocations get their size multiplied by a factor in ×0.5..×2 (at
//!   least 1 byte; no longer a multiple of 512, so the engine's rounding is exercised too);
//! - **frees reordered within a window**: each free moves up to `window` events earlier or later, never
//!   before its allocation;
//! - **streams interleaved**: allocations are spread over 1–3 streams (1: every trace stream maps to
//!   one simulated stream), and a share of the frees happen on another stream than the allocation;
//! - **sites** passed to the classifier or withheld (the PyTorch plug-in gives none);
//! - the engine **configuration**: default, all four tiers, every stream in one shared arena.
//!
//! After **every** step: the block is 512-byte aligned, spans the request rounded up to 512 B, and
//! overlaps no live block; a free returns the block's size; the engine's statistics equal the model's
//! (bytes live, live blocks, allocations, frees, per-tier live bytes summing to the total; no refused
//! free, no out-of-memory on a device with 4× the slice's peak plus 16 GiB); the reservation covers the
//! live bytes. At the end: every block freed, `trim`, and then 0 bytes held by the engine and by the
//! device, and no physical handle, mapping or driver-pool block left.
//!
//! The backed variant runs on host-backed memory (the two smaller traces): every block gets its
//! identity stamped on its first and last 16 bytes, checked on free — no live block shares those bytes
//! with another, across tiers, page moves and cross-stream reuse.
//!
//! Each test prints its engine operations (`eprintln!`). Failures shrink (slice length and start,
//! mutation strengths, configuration) to a minimal case; `PROPTEST_CASES` overrides the number of cases.
//! Without the traces the tests print why and pass.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};

use gen_device::sim::SimDevice;
use gen_device::{Device, StreamId};
use gen_trace::{EventKind, Trace};
// The mutations' source of randomness: splitmix64, gen-trace's (proptest draws its seed).
use gen_trace::synth::Rng;
use genpool::{Block, Config, Hint, Pool, ALIGN};
use proptest::prelude::*;
use proptest::test_runner::{Config as PtConfig, TestCaseError, TestRunner};

const GIB: u64 = 1 << 30;

/// Engine configurations a case runs under (index 0, the default, is where failures shrink to).
const CONFS: [&str; 3] = [
    "",
    "experimental.mid_tier:stream,experimental.long_tier:buddy,slab_max_size:1M",
    "experimental.stream_arenas:false,experimental.long_tier:buddy",
];

/// Trace files, smallest first.
const FILES: [&str; 4] = [
    "gpt2_generate_kv.csv.gz",
    "resnet50_train.csv.gz",
    "gpt2_train_fixed.csv.gz",
    "gpt2m_train_varlen.csv.gz",
];

/// Engine operations (alloc, free, trim) run by all tests of this binary.
static TOTAL_OPS: AtomicU64 = AtomicU64::new(0);

/// A loaded trace with, for every event, the index of its partner (an allocation's free, a free's
/// allocation; `NONE` for a block never freed).
struct Loaded {
    trace: Trace,
    partner: Vec<u32>,
}

const NONE: u32 = u32::MAX;

fn trace_dir() -> PathBuf {
    std::env::var_os("GENPOOL_TRACE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../benches/traces"))
}

/// The shared traces, loaded once per test binary; `Err` says why they are not there.
fn traces() -> Result<&'static [Loaded], &'static str> {
    static T: OnceLock<Result<Vec<Loaded>, String>> = OnceLock::new();
    T.get_or_init(|| {
        let dir = trace_dir();
        let mut out = Vec::new();
        for f in FILES {
            let path = dir.join(f);
            if !path.is_file() {
                return Err(format!(
                    "{} not found (set GENPOOL_TRACE_DIR)",
                    path.display()
                ));
            }
            let trace = gen_trace::load_path(&path)
                .map_err(|e| e.to_string())?
                .remove(0);
            let mut partner = vec![NONE; trace.events.len()];
            let mut live: HashMap<u64, u32> = HashMap::new();
            for (i, e) in trace.events.iter().enumerate() {
                match e.kind {
                    EventKind::Alloc => {
                        live.insert(e.addr, i as u32);
                    }
                    EventKind::Free => {
                        let a = live
                            .remove(&e.addr)
                            .ok_or_else(|| format!("{f}: event {i} frees a dead address"))?;
                        partner[a as usize] = i as u32;
                        partner[i] = a;
                    }
                }
            }
            out.push(Loaded { trace, partner });
        }
        Ok(out)
    })
    .as_deref()
    .map_err(String::as_str)
}

/// One case: which slice, how it is mutated, and under which configuration.
#[derive(Clone, Copy, Debug)]
struct Case {
    /// Index into [`FILES`] (among the traces a test allows).
    trace: usize,
    /// Where the slice starts (modulo the trace's length).
    start: u32,
    /// Events in the slice.
    len: usize,
    /// Index into [`CONFS`].
    conf: usize,
    /// Share of allocations whose size is scaled, in percent.
    scale_pct: u8,
    /// How far a free may move (events); 0 keeps the order.
    window: u32,
    /// Streams the allocations are spread over (1: the trace's own streams on one stream each).
    streams: u8,
    /// Share of frees issued on another stream than the allocation, in percent.
    cross_pct: u8,
    /// Pass the trace's call sites to the classifier.
    sites: bool,
    /// Seeds the draws of the mutations.
    seed: u64,
}

fn case_strategy(traces: std::ops::Range<usize>, confs: usize) -> impl Strategy<Value = Case> {
    (
        traces,
        any::<u32>(),
        // Mostly 2 000–5 000 events; a failure can still shrink to a short slice.
        prop_oneof![1 => 1usize..2000, 9 => 2000usize..=5000],
        0..confs,
        prop_oneof![Just(0u8), 0u8..=100],
        prop_oneof![Just(0u32), 1u32..=64],
        1u8..=3,
        0u8..=50,
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(
            |(trace, start, len, conf, scale_pct, window, streams, cross_pct, sites, seed)| Case {
                trace,
                start,
                len,
                conf,
                scale_pct,
                window,
                streams,
                cross_pct,
                sites,
                seed,
            },
        )
}

/// A draw that comes true `pct` times in a hundred.
fn percent(rng: &mut Rng, pct: u8) -> bool {
    rng.below(100) < u64::from(pct)
}

/// One engine call of a mutated slice; `id` numbers the slice's blocks.
#[derive(Clone, Copy, Debug)]
enum Op {
    Alloc {
        id: u32,
        size: u64,
        stream: u8,
        site: Option<u64>,
    },
    Free {
        id: u32,
        stream: u8,
    },
}

/// Builds the ops of one case.
struct Builder<'a> {
    c: &'a Case,
    rng: Rng,
    /// Trace streams in order of appearance (the stream index when `streams == 1`).
    trace_streams: Vec<u64>,
    /// Slice id of each allocation event (by event index).
    ids: HashMap<u32, u32>,
    /// Stream and sort key of each block, by id.
    blocks: Vec<(u8, i64)>,
    /// Ops with their sort keys.
    ops: Vec<(i64, Op)>,
}

impl Builder<'_> {
    fn alloc(&mut self, i: usize, e: &gen_trace::Event, key: i64) {
        let c = self.c;
        let id = self.blocks.len() as u32;
        self.ids.insert(i as u32, id);
        let stream = if c.streams <= 1 {
            let k = match self.trace_streams.iter().position(|&s| s == e.stream) {
                Some(k) => k,
                None => {
                    self.trace_streams.push(e.stream);
                    self.trace_streams.len() - 1
                }
            };
            (k % 3) as u8
        } else {
            self.rng.below(u64::from(c.streams)) as u8
        };
        self.blocks.push((stream, key));
        let size = if percent(&mut self.rng, c.scale_pct) {
            // ×2^u, u uniform in [-1, 1]: ×0.5 ..= ×2.
            let f = ((self.rng.below(2001) as f64 - 1000.0) / 1000.0).exp2();
            ((e.size as f64 * f) as u64).max(1)
        } else {
            e.size
        };
        let site = (c.sites && e.site != 0).then_some(e.site);
        self.ops.push((
            key,
            Op::Alloc {
                id,
                size,
                stream,
                site,
            },
        ));
    }

    /// The free of allocation event `a`, at slice position `p`.
    fn free(&mut self, a: u32, p: i64) {
        let c = self.c;
        let id = self.ids[&a];
        let (mut stream, alloc_key) = self.blocks[id as usize];
        if percent(&mut self.rng, c.cross_pct) {
            stream = (stream + 1 + self.rng.below(2) as u8) % 3;
        }
        let w = i64::from(c.window);
        let d = if w > 0 {
            self.rng.below(2 * w as u64 + 1) as i64 - w
        } else {
            0
        };
        // Never before the allocation.
        let key = (2 * (p + d) + 1).max(alloc_key.saturating_add(1));
        self.ops.push((key, Op::Free { id, stream }));
    }
}

/// The mutated slice: the blocks live at its start allocated first (returned: how many), then its
/// events. An allocation at
/// slice position `p` sorts at key `2p`, a free at `2(p + d) + 1` with `d` within the window (never
/// before its allocation's key); the sort is stable.
fn build_ops(l: &Loaded, c: &Case) -> (Vec<Op>, usize) {
    let ev = &l.trace.events;
    let start = c.start as usize % ev.len();
    let end = (start + c.len).min(ev.len());
    let mut b = Builder {
        c,
        rng: Rng(c.seed),
        trace_streams: Vec::new(),
        ids: HashMap::new(),
        blocks: Vec::new(),
        ops: Vec::with_capacity(end - start + 2048),
    };
    // Live at the slice start: allocated before it, freed at or after it (or never).
    for (i, e) in ev[..start].iter().enumerate() {
        if e.kind == EventKind::Alloc && (l.partner[i] == NONE || l.partner[i] as usize >= start) {
            b.alloc(i, e, i64::MIN);
        }
    }
    let initial = b.blocks.len();
    for (i, e) in ev.iter().enumerate().take(end).skip(start) {
        let p = (i - start) as i64;
        match e.kind {
            EventKind::Alloc => b.alloc(i, e, 2 * p),
            EventKind::Free => b.free(l.partner[i], p),
        }
    }
    let mut ops = b.ops;
    ops.sort_by_key(|&(k, _)| k);
    (ops.into_iter().map(|(_, o)| o).collect(), initial)
}

/// Peak of the live bytes the ops ask for (before rounding).
fn peak_bytes(ops: &[Op]) -> u64 {
    let mut size: HashMap<u32, u64> = HashMap::new();
    let (mut live, mut peak) = (0u64, 0u64);
    for o in ops {
        match *o {
            Op::Alloc { id, size: s, .. } => {
                size.insert(id, s);
                live += s.div_ceil(ALIGN) * ALIGN;
                peak = peak.max(live);
            }
            Op::Free { id, .. } => live -= size[&id].div_ceil(ALIGN) * ALIGN,
        }
    }
    peak
}

fn fail(msg: String) -> TestCaseError {
    TestCaseError::fail(msg)
}

/// A live block as the model knows it.
#[derive(Clone, Copy)]
struct Live {
    block: Block,
    id: u32,
}

/// Steps between two checks of the whole statistics.
const FULL_CHECK: usize = 8;

/// Bytes stamped at each end of a block in the backed variant.
const STAMP: usize = 16;

/// The engine under test and the model.
struct Harness {
    dev: Arc<SimDevice>,
    pool: Pool,
    streams: [StreamId; 3],
    backed: bool,
    /// Live blocks by address.
    live: BTreeMap<u64, Live>,
    /// Address of each live block by id.
    ptr_of: HashMap<u32, u64>,
    live_bytes: u64,
    allocs: u64,
    frees: u64,
    ops: u64,
}

impl Harness {
    fn new(conf: &str, capacity: u64, backed: bool) -> Result<Self, TestCaseError> {
        let dev = Arc::new(
            SimDevice::config()
                .capacity(capacity)
                .backed(backed)
                .build()
                .map_err(|e| fail(format!("device: {e}")))?,
        );
        let cfg = Config::parse(conf).map_err(|e| fail(format!("config {conf}: {e}")))?;
        let pool = Pool::new(dev.clone() as Arc<dyn Device>, cfg)
            .map_err(|e| fail(format!("pool: {e}")))?;
        let s1 = dev.stream_create().map_err(|e| fail(e.to_string()))?;
        let s2 = dev.stream_create().map_err(|e| fail(e.to_string()))?;
        Ok(Harness {
            dev,
            pool,
            streams: [0, s1, s2],
            backed,
            live: BTreeMap::new(),
            ptr_of: HashMap::new(),
            live_bytes: 0,
            allocs: 0,
            frees: 0,
            ops: 0,
        })
    }

    /// The identity stamp of block `id` (never all zeros, so fresh memory does not pass for it).
    fn stamp(id: u32) -> [u8; STAMP] {
        let mut s = [0u8; STAMP];
        s[..8].copy_from_slice(&(u64::from(id) | 1 << 63).to_le_bytes());
        s[8..].copy_from_slice(&(!u64::from(id)).to_le_bytes());
        s
    }

    fn alloc(
        &mut self,
        id: u32,
        size: u64,
        si: u8,
        site: Option<u64>,
    ) -> Result<(), TestCaseError> {
        self.ops += 1;
        let hint = Hint {
            lifetime: None,
            site,
        };
        let blk = self
            .pool
            .alloc(size, self.streams[si as usize], hint)
            .map_err(|e| {
                fail(format!(
                    "alloc #{id} of {size} B on stream {si} with {} B live in {} blocks: {e}",
                    self.live_bytes,
                    self.live.len()
                ))
            })?;
        prop_assert_eq!(blk.ptr % ALIGN, 0, "alignment of {:?}", blk);
        prop_assert!(blk.ptr != 0);
        prop_assert_eq!(blk.size, size.div_ceil(ALIGN) * ALIGN, "size of {:?}", blk);
        let end = blk.ptr + blk.size;
        if let Some((&p, l)) = self.live.range(..end).next_back() {
            prop_assert!(
                p + l.block.size <= blk.ptr,
                "#{} {:?} overlaps live #{} {:?}",
                id,
                blk,
                l.id,
                l.block
            );
        }
        if self.backed {
            let s = Self::stamp(id);
            let n = (blk.size as usize).min(STAMP) as u64;
            for at in [blk.ptr, end - n] {
                self.dev
                    .write(at, &s[..n as usize])
                    .map_err(|e| fail(format!("stamp of {blk:?}: {e}")))?;
            }
        }
        self.live.insert(blk.ptr, Live { block: blk, id });
        self.ptr_of.insert(id, blk.ptr);
        self.live_bytes += blk.size;
        self.allocs += 1;
        Ok(())
    }

    fn check_stamp(&self, l: &Live) -> Result<(), TestCaseError> {
        if !self.backed {
            return Ok(());
        }
        let s = Self::stamp(l.id);
        let n = (l.block.size as usize).min(STAMP);
        let mut buf = [0u8; STAMP];
        for at in [l.block.ptr, l.block.ptr + l.block.size - n as u64] {
            self.dev
                .read(at, &mut buf[..n])
                .map_err(|e| fail(format!("read of {:?}: {e}", l.block)))?;
            prop_assert_eq!(
                &buf[..n],
                &s[..n],
                "#{} {:?}: stamp at {:#x} overwritten by another block",
                l.id,
                l.block,
                at
            );
        }
        Ok(())
    }

    fn free(&mut self, id: u32, si: u8) -> Result<(), TestCaseError> {
        let ptr = self
            .ptr_of
            .remove(&id)
            .ok_or_else(|| fail(format!("model: #{id} freed but not live")))?;
        let l = self.live.remove(&ptr).expect("the model's maps agree");
        self.check_stamp(&l)?;
        self.ops += 1;
        let n = self
            .pool
            .free(ptr, self.streams[si as usize])
            .map_err(|e| fail(format!("free of #{id} {:?} on stream {si}: {e}", l.block)))?;
        prop_assert_eq!(n, l.block.size, "free of #{} {:?}", id, l.block);
        self.live_bytes -= l.block.size;
        self.frees += 1;
        Ok(())
    }

    /// The engine's books against the model's: live bytes and blocks after every step; the whole
    /// statistics (which walk every size class) every [`FULL_CHECK`] steps and at the end.
    fn check(&self, full: bool) -> Result<(), TestCaseError> {
        prop_assert_eq!(self.pool.allocated(), self.live_bytes);
        prop_assert_eq!(self.pool.live_blocks(), self.live.len());
        if !full {
            return Ok(());
        }
        let st = self.pool.stats();
        prop_assert_eq!(st.allocated_current, self.live_bytes);
        prop_assert_eq!(self.pool.live_blocks(), self.live.len());
        prop_assert_eq!(st.num_allocs, self.allocs);
        prop_assert_eq!(st.num_frees, self.frees);
        prop_assert_eq!(st.num_invalid_frees, 0);
        prop_assert_eq!(st.num_ooms, 0);
        let tier_live: u64 = st.tiers.iter().map(|t| t.live_bytes).sum();
        prop_assert_eq!(tier_live, self.live_bytes, "per-tier live bytes");
        prop_assert!(
            st.reserved_current >= st.allocated_current,
            "reserved {} < live {}",
            st.reserved_current,
            st.allocated_current
        );
        Ok(())
    }

    /// Free what is left, `trim`: nothing may be held.
    fn finish(mut self) -> Result<u64, TestCaseError> {
        let left: Vec<(u32, u64)> = self.live.values().map(|l| (l.id, l.block.ptr)).collect();
        for (k, (id, _)) in left.into_iter().enumerate() {
            self.free(id, (k % 3) as u8)?;
        }
        self.check(true)?;
        self.ops += 1;
        common::trim_and_assert_nothing_held(&self.pool, &self.dev)?;
        Ok(self.ops)
    }
}

/// Replays one case; returns the engine operations it ran.
fn run_case(all: &[Loaded], c: &Case, backed: bool) -> Result<u64, TestCaseError> {
    let l = &all[c.trace];
    let (ops, initial) = build_ops(l, c);
    let capacity = peak_bytes(&ops).saturating_mul(4).saturating_add(16 * GIB);
    let mut h = Harness::new(CONFS[c.conf], capacity, backed)?;
    for (n, op) in ops.iter().enumerate() {
        if n == initial {
            // The slice proper starts: an iteration boundary, as a replay pass has.
            h.pool.mark_iteration();
        }
        match *op {
            Op::Alloc {
                id,
                size,
                stream,
                site,
            } => h.alloc(id, size, stream, site)?,
            Op::Free { id, stream } => h.free(id, stream)?,
        }
        h.check(n % FULL_CHECK == 0)?;
    }
    h.finish()
}

/// Cases per test: `PROPTEST_CASES`, else `release` in a release build and a smoke-sized `debug`.
fn cases(release: u32, debug: u32) -> u32 {
    match std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        Some(n) => n,
        None if cfg!(debug_assertions) => debug,
        None => release,
    }
}

fn run(name: &str, traces: std::ops::Range<usize>, confs: usize, backed: bool, cases: u32) {
    let all = match self::traces() {
        Ok(t) => t,
        Err(why) => panic!("{name}: {why}"),
    };
    let ops = AtomicU64::new(0);
    let mut runner = TestRunner::new(PtConfig {
        cases,
        failure_persistence: None,
        ..PtConfig::default()
    });
    let t0 = std::time::Instant::now();
    let res = runner.run(&case_strategy(traces, confs), |c| {
        ops.fetch_add(run_case(all, &c, backed)?, Relaxed);
        Ok(())
    });
    let ops = ops.into_inner();
    let total = TOTAL_OPS.fetch_add(ops, Relaxed) + ops;
    eprintln!(
        "{name}: {ops} engine ops in {cases} cases, {:.1} s (this binary so far: {total} ops)",
        t0.elapsed().as_secs_f64()
    );
    if let Err(e) = res {
        panic!("{name}: {e}");
    }
}

/// The mutations keep to their rules: every block is allocated once and freed at most once, never
/// before its allocation; scaled sizes stay within ×0.5..×2 of the trace's (at least 1 byte); streams
/// are among the three; with no mutation the slice replays the trace's own order and sizes.
#[test]
fn mutations_keep_to_their_rules() {
    let all = match traces() {
        Ok(t) => t,
        Err(why) => panic!("mutations_keep_to_their_rules: {why}"),
    };
    let plain = Case {
        trace: 1,
        start: 7_000,
        len: 3_000,
        conf: 0,
        scale_pct: 0,
        window: 0,
        streams: 1,
        cross_pct: 0,
        sites: true,
        seed: 42,
    };
    let l = &all[plain.trace];
    let (ops, initial) = build_ops(l, &plain);
    let ev = &l.trace.events[7_000..10_000];
    // Unmutated: after the blocks live at the start, exactly the slice's events with their sizes.
    assert_eq!(ops.len() - initial, ev.len());
    for (op, e) in ops[initial..].iter().zip(ev) {
        match (*op, e.kind) {
            (Op::Alloc { size, stream, .. }, EventKind::Alloc) => {
                assert_eq!((size, stream), (e.size, 0))
            }
            (Op::Free { stream, .. }, EventKind::Free) => assert_eq!(stream, 0),
            (op, kind) => panic!("{op:?} where the trace has {kind:?}"),
        }
    }
    let sizes = |ops: &[Op]| -> Vec<u64> {
        ops.iter()
            .filter_map(|o| match *o {
                Op::Alloc { size, .. } => Some(size),
                Op::Free { .. } => None,
            })
            .collect()
    };
    for seed in 0..8 {
        let c = Case {
            scale_pct: 100,
            window: 64,
            streams: 3,
            cross_pct: 50,
            seed,
            ..plain
        };
        let (mutated, m_initial) = build_ops(l, &c);
        assert_eq!(m_initial, initial);
        assert_eq!(mutated.len(), ops.len());
        // Allocations keep their order: compare sizes pairwise.
        let mut scaled = 0;
        for (&a, &b) in sizes(&ops).iter().zip(&sizes(&mutated)) {
            assert!(b >= 1 && b >= a / 2 && b <= 2 * a, "{a} scaled to {b}");
            scaled += usize::from(a != b);
        }
        assert!(scaled > 0);
        let mut state: HashMap<u32, bool> = HashMap::new();
        let mut moved = 0;
        for (k, o) in mutated.iter().enumerate() {
            match *o {
                Op::Alloc { id, stream, .. } => {
                    assert!(stream < 3);
                    assert!(state.insert(id, true).is_none(), "#{id} allocated twice");
                }
                Op::Free { id, stream } => {
                    assert!(stream < 3);
                    assert_eq!(
                        state.insert(id, false),
                        Some(true),
                        "#{id} not live at its free"
                    );
                    moved += usize::from(!matches!(ops[k], Op::Free { id: j, .. } if j == id));
                }
            }
        }
        assert!(moved > 0, "a window of 64 moves some frees");
    }
}

/// Every trace, every configuration, unbacked (a large simulated device costs nothing).
#[test]
fn mutated_traces_replay_cleanly() {
    run(
        "mutated_traces_replay_cleanly",
        0..FILES.len(),
        CONFS.len(),
        false,
        cases(128, 6),
    );
}

/// The two smaller traces on host-backed memory, every block's ends stamped and checked on free.
#[test]
fn mutated_traces_keep_blocks_apart_in_backed_memory() {
    run(
        "mutated_traces_keep_blocks_apart_in_backed_memory",
        0..2,
        CONFS.len(),
        true,
        cases(24, 2),
    );
}
