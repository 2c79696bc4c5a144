//! Property tests of the engine against a reference model (issue #6).
//!
//! Each case draws a random program of [`Action`]s — allocations of every size class (0, slab, extent,
//! many MiB, near and beyond the device), frees on the allocating stream, on another stream and on
//! another thread, double frees, unknown, interior and null frees, trims, iteration marks, paused and
//! resumed streams, and injected device faults — and runs it against a [`Pool`] on a [`SimDevice`] and a
//! plain reference model side by side. After **every** step:
//!
//! 1. the result is the one the model expects: `InvalidSize` for 0 and for sizes beyond the device,
//!    `InvalidFree { Null | Unknown | DoubleFree }` for bad frees (and nothing changes), `OutOfMemory` only
//!    when the live blocks plus the request, each given two spare pages, would not fit the device (or a
//!    stream is paused, or a fault was injected);
//! 2. every live block is 512-byte aligned, spans the request rounded up to 512 B, and overlaps no other
//!    live block;
//! 3. a block freed on a paused stream `S` is not handed out on another stream until `S` resumes, unless
//!    that stream's work is ordered after `S`'s (it waits on an event recorded on `S`, on the device);
//! 4. the engine's statistics equal the model's: bytes live and peak, allocations, frees, refused frees,
//!    out-of-memory count, live blocks, and per tier allocations, frees and live bytes; `lookup` finds the
//!    live blocks; the reservation covers the live bytes;
//! 5. at the end, after freeing every block and `trim`, the engine holds 0 bytes and so does the device
//!    (no physical handle, mapping or driver-pool block left).
//!
//! The backed variant also fills every block with its own byte pattern and checks it on free (no block
//! ever shares a byte with another, across tiers, page moves and cross-stream reuse).
//!
//! The number of engine operations is printed at the end of each test (`eprintln!`). `PROPTEST_CASES`
//! scales the number of programs; a release build runs longer programs than a debug one.

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use gen_device::sim::SimDevice;
use gen_device::{CallKind, Device, DeviceError, EventHandle, StreamId};
use genpool::{Block, Config, FreeFault, GenpoolError, Hint, Lifetime, Pool, Tier, ALIGN};
use proptest::prelude::*;
use proptest::test_runner::{Config as PtConfig, TestCaseError};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// The simulated device's page (VMM granularity).
const PAGE: u64 = 2 * MIB;

/// Engine operations (alloc, free, trim, mark) run by all tests of this binary.
static TOTAL_OPS: AtomicU64 = AtomicU64::new(0);

/// How a size is drawn.
#[derive(Clone, Copy, Debug)]
enum SizeKind {
    Zero,
    /// 1 ..= 4 KiB: the slab.
    Small(u64),
    /// 4 KiB ..= 1 MiB: the slab with a large `slab_max_size`, else the extent arena.
    Medium(u64),
    /// 1 ..= 24 MiB: the extent arena, the buddy, the driver pool.
    Large(u64),
    /// A fraction (per mille) of the device: exhaustion.
    Huge(u16),
    /// Past the device's memory by this much (saturating): `InvalidSize`.
    Beyond(u64),
}

/// Where an invalid free points.
#[derive(Clone, Copy, Debug)]
enum BadPtr {
    Null,
    /// Inside a live block (a multiple of 512 past its start).
    Interior(usize, u64),
    /// An arbitrary address (possibly unaligned).
    Random(u64),
}

/// One step of a program.
#[derive(Clone, Debug)]
enum Action {
    Alloc {
        size: SizeKind,
        stream: u8,
        lifetime: Option<u8>,
        site: Option<u8>,
    },
    Free {
        pick: usize,
        stream: u8,
    },
    /// Free from a thread of its own.
    FreeOnThread {
        pick: usize,
        stream: u8,
    },
    /// Free a block, then free it again at once.
    DoubleFree {
        pick: usize,
        stream: u8,
    },
    BadFree(BadPtr),
    Trim,
    Mark,
    Pause(u8),
    Resume(u8),
    /// The next `cuMemCreate` (out of memory) or `cuMemMap` (driver error) fails.
    Fault(bool),
}

/// What a test varies.
#[derive(Clone, Copy)]
struct Setup {
    conf: &'static str,
    capacity: u64,
    backed: bool,
    /// Draw `SizeKind::Huge` (exhaustion) at all.
    huge: bool,
    faults: bool,
}

fn size_strategy(s: Setup) -> BoxedStrategy<SizeKind> {
    let huge = if s.huge { 2 } else { 0 };
    let large_max = if s.backed { 4 * MIB } else { 24 * MIB };
    prop_oneof![
        1 => Just(SizeKind::Zero),
        12 => (1..=4 * KIB).prop_map(SizeKind::Small),
        6 => (4 * KIB + 1..=MIB).prop_map(SizeKind::Medium),
        4 => (MIB + 1..=large_max).prop_map(SizeKind::Large),
        // A few sizes that recur (a model's shapes): exact-size reuse (a thread's or a busy stream's
        // kept blocks) is reached only where a size comes again.
        3 => prop_oneof![Just(3 * MIB / 2), Just(2 * MIB), Just(4 * MIB + 512)].prop_map(SizeKind::Large),
        huge => (100u16..=1000).prop_map(SizeKind::Huge),
        1 => prop_oneof![Just(u64::MAX), 1..=u64::MAX].prop_map(SizeKind::Beyond),
    ]
    .boxed()
}

fn action_strategy(s: Setup) -> BoxedStrategy<Action> {
    let faults = if s.faults { 1 } else { 0 };
    prop_oneof![
        40 => (size_strategy(s), 0u8..3, proptest::option::of(0u8..3), proptest::option::of(0u8..8))
            .prop_map(|(size, stream, lifetime, site)| Action::Alloc { size, stream, lifetime, site }),
        26 => (any::<usize>(), 0u8..3).prop_map(|(pick, stream)| Action::Free { pick, stream }),
        1 => (any::<usize>(), 0u8..3).prop_map(|(pick, stream)| Action::FreeOnThread { pick, stream }),
        2 => (any::<usize>(), 0u8..3).prop_map(|(pick, stream)| Action::DoubleFree { pick, stream }),
        2 => prop_oneof![
            Just(BadPtr::Null),
            (any::<usize>(), 1u64..4096).prop_map(|(p, k)| BadPtr::Interior(p, k)),
            any::<u64>().prop_map(BadPtr::Random),
        ]
        .prop_map(Action::BadFree),
        1 => Just(Action::Trim),
        1 => Just(Action::Mark),
        1 => (1u8..3).prop_map(Action::Pause),
        2 => (1u8..3).prop_map(Action::Resume),
        faults => any::<bool>().prop_map(Action::Fault),
    ]
    .boxed()
}

/// A live block as the model knows it.
#[derive(Clone, Copy, Debug)]
struct Live {
    block: Block,
    pattern: u8,
}

/// The reference model and the engine under test.
struct Harness {
    s: Setup,
    dev: Arc<SimDevice>,
    pool: Pool,
    streams: [StreamId; 3],
    /// One event per stream, recorded on it when it is paused.
    events: [EventHandle; 3],
    paused: [bool; 3],
    /// Live blocks by address.
    live: BTreeMap<u64, Live>,
    /// Address ranges `[start, end)` freed on a stream while it was paused, by stream index.
    quarantine: Vec<(u64, u64, usize)>,
    live_bytes: u64,
    live_peak: u64,
    allocs: u64,
    frees: u64,
    invalid_frees: u64,
    ooms: u64,
    tier_allocs: [u64; 4],
    tier_frees: [u64; 4],
    tier_live: [u64; 4],
    /// Injected faults not yet consumed: (kind, calls of that kind when injected).
    pending_faults: Vec<(CallKind, u64)>,
    next_pattern: u8,
    ops: u64,
    /// Allocations refused because they had to wait for a paused stream.
    refused_waits: u64,
    /// Injected device faults that fired.
    faults: u64,
}

/// What a case did, summed over a test.
#[derive(Default)]
struct Counts {
    ops: u64,
    ooms: u64,
    invalid_frees: u64,
    faults: u64,
    refused_waits: u64,
    /// Allocations a busy stream served from its own kept blocks (`busykeep.rs`).
    busy_kept_reuses: u64,
}

fn fail(msg: String) -> TestCaseError {
    TestCaseError::fail(msg)
}

impl Harness {
    fn new(s: Setup) -> Result<Self, TestCaseError> {
        let dev = Arc::new(
            SimDevice::config()
                .capacity(s.capacity)
                .backed(s.backed)
                .build()
                .map_err(|e| fail(format!("device: {e}")))?,
        );
        let cfg = Config::parse(s.conf).map_err(|e| fail(format!("config {}: {e}", s.conf)))?;
        let pool = Pool::new(dev.clone() as Arc<dyn Device>, cfg)
            .map_err(|e| fail(format!("pool: {e}")))?;
        let s1 = dev.stream_create().map_err(|e| fail(e.to_string()))?;
        let s2 = dev.stream_create().map_err(|e| fail(e.to_string()))?;
        let mut events = [EventHandle(0); 3];
        for e in &mut events {
            *e = dev.event_create().map_err(|e| fail(e.to_string()))?;
        }
        let mut h = Harness {
            events,
            s,
            dev,
            pool,
            streams: [0, s1, s2],
            paused: [false; 3],
            live: BTreeMap::new(),
            quarantine: Vec::new(),
            live_bytes: 0,
            live_peak: 0,
            allocs: 0,
            frees: 0,
            invalid_frees: 0,
            ooms: 0,
            tier_allocs: [0; 4],
            tier_frees: [0; 4],
            tier_live: [0; 4],
            pending_faults: Vec::new(),
            next_pattern: 0,
            ops: 0,
            refused_waits: 0,
            faults: 0,
        };
        // Show the engine every stream once while none is paused, as a multi-stream program would at
        // start-up, so its one-stream shortcut is over before the program pauses anything. (Its front
        // caches are left to meet the streams as the program goes: see
        // `cache_solo_drain_is_stream_ordered`.)
        for i in 0..3 {
            h.alloc(512, i, Hint::NONE)?;
            let p = *h.live.keys().next().expect("just allocated");
            h.free(p, i)?;
        }
        Ok(h)
    }

    fn any_paused(&self) -> bool {
        self.paused.iter().any(|&p| p)
    }

    /// Memory the live blocks plus `extra` could need at worst: each rounded up to pages, plus two.
    /// Blocks of the driver-pool tier count as the pool's reservation `stream_reserved` instead when it is
    /// given: the simulated pool (like a real one) may serve a small request from a large free block, and
    /// what it holds under live blocks cannot be given back.
    fn worst_need(&self, extra: u64, stream_reserved: Option<u64>) -> u64 {
        let need = |size: u64| size.div_ceil(PAGE).saturating_add(2).saturating_mul(PAGE);
        self.live
            .values()
            .filter(|l| stream_reserved.is_none() || l.block.tier != Tier::Stream)
            .map(|l| need(l.block.size))
            .fold(need(extra), u64::saturating_add)
            .saturating_add(stream_reserved.unwrap_or(0))
    }

    fn size_of(&self, k: SizeKind) -> u64 {
        match k {
            SizeKind::Zero => 0,
            SizeKind::Small(n) | SizeKind::Medium(n) | SizeKind::Large(n) => n,
            SizeKind::Huge(pm) => (self.s.capacity / 1000 * pm as u64).max(1),
            SizeKind::Beyond(n) => self.s.capacity.saturating_add(n),
        }
    }

    fn pick(&self, pick: usize) -> Option<u64> {
        if self.live.is_empty() {
            return None;
        }
        self.live.keys().nth(pick % self.live.len()).copied()
    }

    /// Consume the injected faults whose kind was called since they were injected; true if any was.
    fn faults_fired(&mut self) -> bool {
        let calls = self.dev.calls();
        let before = self.pending_faults.len();
        self.pending_faults.retain(|&(k, at)| calls.get(k) == at);
        self.pending_faults.len() != before
    }

    fn alloc(&mut self, size: u64, si: usize, hint: Hint) -> Result<(), TestCaseError> {
        let stream = self.streams[si];
        self.ops += 1;
        let res = self.pool.alloc(size, stream, hint);
        let fired = self.faults_fired();
        self.faults += u64::from(fired);
        let blk = match res {
            Ok(b) => b,
            Err(GenpoolError::InvalidSize { size: s, .. }) => {
                prop_assert_eq!(s, size);
                prop_assert!(
                    size == 0 || size > self.s.capacity,
                    "InvalidSize for {} on a {} B device",
                    size,
                    self.s.capacity
                );
                return Ok(());
            }
            Err(GenpoolError::OutOfMemory(r)) => {
                prop_assert!(
                    size != 0 && size <= self.s.capacity,
                    "OOM for size {}",
                    size
                );
                let pool_held = r
                    .tiers
                    .iter()
                    .find(|t| t.tier == "stream")
                    .map(|t| t.reserved);
                let need = self.worst_need(size, pool_held);
                prop_assert!(
                    need > self.s.capacity || self.any_paused() || fired,
                    "out of memory for {} B with {} B live in {} blocks (worst case {} B of {}): {}",
                    size,
                    self.live_bytes,
                    self.live.len(),
                    need,
                    self.s.capacity,
                    r
                );
                prop_assert_eq!(r.requested, size.div_ceil(ALIGN) * ALIGN);
                prop_assert_eq!(r.live, self.live_bytes);
                self.ooms += 1;
                return Ok(());
            }
            // An injected driver error reached the caller: allowed, as long as nothing changed.
            Err(GenpoolError::Device(_)) if fired => return Ok(()),
            // The simulator refuses to wait for a paused stream (a real device would block until the
            // kernel ends): allowed while one is paused, as long as nothing changed.
            Err(GenpoolError::Device(d))
                if matches!(&*d, DeviceError::InvalidArgument { call, .. } if call.ends_with("ynchronize"))
                    && self.any_paused() =>
            {
                self.refused_waits += 1;
                return Ok(());
            }
            Err(e) => return Err(fail(format!("alloc({size}, stream {si}): unexpected {e}"))),
        };
        prop_assert!(
            size != 0 && size <= self.s.capacity,
            "size {} was served",
            size
        );
        prop_assert_eq!(blk.ptr % ALIGN, 0, "alignment of {:?}", blk);
        prop_assert!(blk.ptr != 0);
        prop_assert_eq!(blk.size, size.div_ceil(ALIGN) * ALIGN, "size of {:?}", blk);
        let end = blk.ptr + blk.size;
        if let Some((&p, l)) = self.live.range(..end).next_back() {
            prop_assert!(
                p + l.block.size <= blk.ptr,
                "{:?} overlaps live {:?}",
                blk,
                l.block
            );
        }
        // Cross-stream safety: nothing freed on a paused stream reaches another stream, unless that
        // stream's work is ordered after the paused one's (it waits on an event recorded there).
        for &(a, b, qs) in &self.quarantine {
            prop_assert!(
                qs == si
                    || b <= blk.ptr
                    || end <= a
                    || self.dev.waits_on(self.streams[si], self.streams[qs]),
                "{:?} on stream {} reuses [{:#x}, {:#x}) freed on paused stream {}",
                blk,
                si,
                a,
                b,
                qs
            );
        }
        // The new owner takes over the ordering of the bytes it reuses on its own stream. The extent
        // arena hands out exactly the block; the other tiers hand out a unit that may be larger (a slab
        // slot of the size class, a buddy block, a granule-rounded driver-pool block), so a reuse there
        // re-owns the whole quarantined range it touches.
        // A stream ordered after the quarantining one (it waits on an event recorded there) takes over
        // the ordering too.
        let exact = blk.tier == Tier::Extent;
        let mut q = Vec::with_capacity(self.quarantine.len() + 1);
        for &(a, b, qs) in &self.quarantine {
            let owns = qs == si || self.dev.waits_on(self.streams[si], self.streams[qs]);
            if !owns || b <= blk.ptr || end <= a {
                q.push((a, b, qs));
                continue;
            }
            if exact && a < blk.ptr {
                q.push((a, blk.ptr, qs));
            }
            if exact && end < b {
                q.push((end, b, qs));
            }
        }
        self.quarantine = q;
        self.next_pattern = self.next_pattern.wrapping_add(1).max(1);
        let pattern = self.next_pattern;
        if self.s.backed {
            self.dev
                .write(blk.ptr, &vec![pattern; blk.size as usize])
                .map_err(|e| fail(format!("write to {blk:?}: {e}")))?;
        }
        self.live.insert(
            blk.ptr,
            Live {
                block: blk,
                pattern,
            },
        );
        self.live_bytes += blk.size;
        self.live_peak = self.live_peak.max(self.live_bytes);
        self.allocs += 1;
        self.tier_allocs[blk.tier as usize] += 1;
        self.tier_live[blk.tier as usize] += blk.size;
        Ok(())
    }

    fn check_pattern(&self, l: &Live) -> Result<(), TestCaseError> {
        if !self.s.backed {
            return Ok(());
        }
        let mut buf = vec![0u8; l.block.size as usize];
        self.dev
            .read(l.block.ptr, &mut buf)
            .map_err(|e| fail(format!("read of {:?}: {e}", l.block)))?;
        if let Some(i) = buf.iter().position(|&b| b != l.pattern) {
            return Err(fail(format!(
                "{:?}: byte {i} is {:#x}, expected the pattern {:#x}: another block wrote here",
                l.block, buf[i], l.pattern
            )));
        }
        Ok(())
    }

    fn freed(
        &mut self,
        ptr: u64,
        si: usize,
        got: genpool::Result<u64>,
    ) -> Result<(), TestCaseError> {
        let l = self.live.remove(&ptr).expect("freed a live block");
        match got {
            Ok(n) => prop_assert_eq!(n, l.block.size),
            Err(e) => return Err(fail(format!("free of live {:?}: {e}", l.block))),
        }
        self.live_bytes -= l.block.size;
        self.frees += 1;
        self.tier_frees[l.block.tier as usize] += 1;
        self.tier_live[l.block.tier as usize] -= l.block.size;
        if self.paused[si] {
            self.quarantine.push((ptr, ptr + l.block.size, si));
        }
        Ok(())
    }

    fn free(&mut self, ptr: u64, si: usize) -> Result<(), TestCaseError> {
        let l = self.live[&ptr];
        self.check_pattern(&l)?;
        self.ops += 1;
        let got = self.pool.free(ptr, self.streams[si]);
        self.freed(ptr, si, got)
    }

    fn free_on_thread(&mut self, ptr: u64, si: usize) -> Result<(), TestCaseError> {
        let l = self.live[&ptr];
        self.check_pattern(&l)?;
        self.ops += 1;
        let (pool, stream) = (&self.pool, self.streams[si]);
        let got = std::thread::scope(|sc| sc.spawn(|| pool.free(ptr, stream)).join())
            .map_err(|_| fail("the freeing thread panicked".into()))?;
        self.freed(ptr, si, got)
    }

    /// A free the engine must refuse, with one of `faults`, changing nothing.
    fn bad_free(&mut self, ptr: u64, si: usize, faults: &[FreeFault]) -> Result<(), TestCaseError> {
        self.ops += 1;
        match self.pool.free(ptr, self.streams[si]) {
            Err(GenpoolError::InvalidFree { ptr: p, fault }) => {
                prop_assert_eq!(p, ptr);
                prop_assert!(
                    faults.contains(&fault),
                    "free of {:#x}: {:?}, expected one of {:?}",
                    ptr,
                    fault,
                    faults
                );
            }
            other => {
                return Err(fail(format!(
                    "free of {ptr:#x}: {other:?}, expected refusal"
                )))
            }
        }
        self.invalid_frees += 1;
        Ok(())
    }

    fn step(&mut self, a: &Action) -> Result<(), TestCaseError> {
        match *a {
            Action::Alloc {
                size,
                stream,
                lifetime,
                site,
            } => {
                let hint = Hint {
                    lifetime: lifetime
                        .map(|l| [Lifetime::Short, Lifetime::Mid, Lifetime::Long][l as usize]),
                    site: site.map(|s| 0x1234_5678 * (s as u64 + 1)),
                };
                self.alloc(self.size_of(size), stream as usize, hint)?;
            }
            Action::Free { pick, stream } => {
                if let Some(p) = self.pick(pick) {
                    self.free(p, stream as usize)?;
                }
            }
            Action::FreeOnThread { pick, stream } => {
                if let Some(p) = self.pick(pick) {
                    self.free_on_thread(p, stream as usize)?;
                }
            }
            Action::DoubleFree { pick, stream } => {
                if let Some(p) = self.pick(pick) {
                    self.free(p, stream as usize)?;
                    // Just freed: it is in its shard's ring of recent frees, so the fault is exact.
                    self.bad_free(p, stream as usize, &[FreeFault::DoubleFree])?;
                }
            }
            Action::BadFree(BadPtr::Null) => self.bad_free(0, 0, &[FreeFault::Null])?,
            Action::BadFree(BadPtr::Interior(pick, k)) => {
                if let Some(p) = self.pick(pick) {
                    let size = self.live[&p].block.size;
                    if size > ALIGN {
                        let off = ALIGN * (1 + k % (size / ALIGN - 1));
                        // An interior address may once have started a block since freed.
                        self.bad_free(p + off, 1, &[FreeFault::Unknown, FreeFault::DoubleFree])?;
                    }
                }
            }
            Action::BadFree(BadPtr::Random(addr)) => {
                if addr != 0 && !self.live.contains_key(&addr) {
                    self.bad_free(addr, 2, &[FreeFault::Unknown, FreeFault::DoubleFree])?;
                }
            }
            Action::Trim => {
                self.ops += 1;
                self.pool.trim();
            }
            Action::Mark => {
                self.ops += 1;
                self.pool.mark_iteration();
            }
            Action::Pause(i) => {
                let i = i as usize;
                // A paused stream with nothing queued is idle; queue an operation behind the pause
                // (an event record) so it has work in flight, like a long-running kernel.
                let (dev, s) = (&self.dev, self.streams[i]);
                dev.pause_stream(s)
                    .and_then(|()| dev.event_record(self.events[i], s))
                    .map_err(|e| fail(e.to_string()))?;
                self.paused[i] = true;
            }
            Action::Resume(i) => self.resume(i as usize)?,
            Action::Fault(create) => {
                let kind = if create {
                    CallKind::PhysCreate
                } else {
                    CallKind::Map
                };
                if self.pending_faults.is_empty() {
                    self.dev.fail_next(kind);
                    self.pending_faults.push((kind, self.dev.calls().get(kind)));
                }
            }
        }
        self.check()
    }

    fn resume(&mut self, i: usize) -> Result<(), TestCaseError> {
        self.dev
            .resume_stream(self.streams[i])
            .map_err(|e| fail(e.to_string()))?;
        self.paused[i] = false;
        self.quarantine.retain(|&(_, _, s)| s != i);
        Ok(())
    }

    /// The engine's books against the model's.
    fn check(&self) -> Result<(), TestCaseError> {
        let st = self.pool.stats();
        prop_assert_eq!(st.allocated_current, self.live_bytes);
        prop_assert_eq!(self.pool.allocated(), self.live_bytes);
        prop_assert_eq!(st.allocated_peak, self.live_peak);
        prop_assert_eq!(st.num_allocs, self.allocs);
        prop_assert_eq!(st.num_frees, self.frees);
        prop_assert_eq!(st.num_invalid_frees, self.invalid_frees);
        prop_assert_eq!(st.num_ooms, self.ooms);
        prop_assert_eq!(self.pool.live_blocks(), self.live.len());
        prop_assert_eq!(st.tiers.len(), 4);
        for t in Tier::ALL {
            let ts = &st.tiers[t as usize];
            prop_assert_eq!(ts.tier, t.name());
            prop_assert_eq!(
                ts.allocs,
                self.tier_allocs[t as usize],
                "{} allocs",
                t.name()
            );
            prop_assert_eq!(ts.frees, self.tier_frees[t as usize], "{} frees", t.name());
            prop_assert_eq!(
                ts.live_bytes,
                self.tier_live[t as usize],
                "{} live",
                t.name()
            );
        }
        prop_assert!(
            st.reserved_current >= st.allocated_current,
            "reserved {} < live {}",
            st.reserved_current,
            st.allocated_current
        );
        prop_assert!(st.reserved_peak >= st.reserved_current);
        // Spot-check lookups: the first and last live blocks.
        for l in [self.live.values().next(), self.live.values().next_back()]
            .into_iter()
            .flatten()
        {
            prop_assert_eq!(self.pool.lookup(l.block.ptr), Some(l.block));
        }
        Ok(())
    }

    /// Free everything (checking patterns), resume every stream, trim: nothing may be held.
    fn finish(mut self) -> Result<Counts, TestCaseError> {
        for i in 1..3 {
            if self.paused[i] {
                self.resume(i)?;
            }
        }
        let ptrs: Vec<u64> = self.live.keys().copied().collect();
        for (n, p) in ptrs.into_iter().enumerate() {
            self.free(p, n % 3)?;
        }
        self.check()?;
        self.ops += 1;
        let busy_kept_reuses = self.pool.stats().busy_kept_reuses;
        common::trim_and_assert_nothing_held(&self.pool, &self.dev)?;
        for e in self.events {
            self.dev.event_destroy(e).map_err(|e| fail(e.to_string()))?;
        }
        Ok(Counts {
            ops: self.ops,
            ooms: self.ooms,
            invalid_frees: self.invalid_frees,
            faults: self.faults,
            refused_waits: self.refused_waits,
            busy_kept_reuses,
        })
    }
}

/// Programs are longer in a release build, where each step is cheap, and shorter when every block is
/// filled and read back.
fn program_len(s: Setup) -> std::ops::Range<usize> {
    match (cfg!(debug_assertions), s.backed) {
        (true, false) => 10..100,
        (true, true) => 5..30,
        (false, false) => 400..2400,
        (false, true) => 60..360,
    }
}

fn run(name: &str, s: Setup) {
    let sum = parking_lot::Mutex::new(Counts::default());
    let mut cfg = PtConfig {
        failure_persistence: None,
        ..PtConfig::default()
    };
    // A debug build (the workspace's plain `cargo test`) runs a smoke-sized sample; the release build
    // runs the full count (≥ 10^6 engine operations), and PROPTEST_CASES always wins.
    if cfg!(debug_assertions) && std::env::var_os("PROPTEST_CASES").is_none() {
        cfg.cases = cfg.cases.min(32);
    }
    let cases = cfg.cases;
    // GENPOOL_PROP_SEED=N: the same programs on every run (to rerun a failure; each run otherwise draws
    // new ones).
    let mut runner = match std::env::var("GENPOOL_PROP_SEED")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        Some(seed) => {
            let mut bytes = [0u8; 32];
            bytes[..8].copy_from_slice(&seed.to_le_bytes());
            let rng = proptest::test_runner::TestRng::from_seed(
                proptest::test_runner::RngAlgorithm::ChaCha,
                &bytes,
            );
            proptest::test_runner::TestRunner::new_with_rng(cfg, rng)
        }
        None => proptest::test_runner::TestRunner::new(cfg),
    };
    let t0 = std::time::Instant::now();
    let res = runner.run(
        &proptest::collection::vec(action_strategy(s), program_len(s)),
        |actions| {
            let mut h = Harness::new(s)?;
            for a in &actions {
                h.step(a)?;
            }
            let c = h.finish()?;
            let mut t = sum.lock();
            t.ops += c.ops;
            t.ooms += c.ooms;
            t.invalid_frees += c.invalid_frees;
            t.faults += c.faults;
            t.refused_waits += c.refused_waits;
            t.busy_kept_reuses += c.busy_kept_reuses;
            Ok(())
        },
    );
    let c = sum.into_inner();
    let total = TOTAL_OPS.fetch_add(c.ops, Relaxed) + c.ops;
    eprintln!(
        "{name}: {} engine ops in {cases} cases, {:.1} s ({} out of memory, {} refused frees, {} \
         injected faults fired, {} waits on a paused stream refused, {} allocations from a busy \
         stream's kept blocks; this binary so far: {total} ops)",
        c.ops,
        t0.elapsed().as_secs_f64(),
        c.ooms,
        c.invalid_frees,
        c.faults,
        c.refused_waits,
        c.busy_kept_reuses,
    );
    if let Err(e) = res {
        panic!("{name}: {e}");
    }
}

/// The default configuration: slab, extent arena.
#[test]
fn prop_default_config() {
    run(
        "prop_default_config",
        Setup {
            conf: "",
            capacity: 512 * MIB,
            backed: false,
            huge: true,
            faults: true,
        },
    );
}

/// All four tiers: a 1 MiB slab, the driver pool for mid-lived and the buddy for long-lived blocks.
#[test]
fn prop_all_tiers() {
    run(
        "prop_all_tiers",
        Setup {
            conf: "experimental.routing:generational,experimental.mid_tier:stream,experimental.long_tier:buddy,slab_max_size:1M",
            capacity: 512 * MIB,
            backed: false,
            huge: true,
            faults: true,
        },
    );
}

/// Ranges every stream shares — long-lived blocks in the buddy, and one extent arena for all streams
/// (`stream_arenas:false`) — under pauses and exhaustion: their handoffs order each stream after the
/// others' frees.
#[test]
fn prop_shared_handoffs() {
    run(
        "prop_shared_handoffs",
        Setup {
            conf: "experimental.routing:generational,experimental.stream_arenas:false,experimental.long_tier:buddy",
            capacity: 384 * MIB,
            backed: false,
            huge: true,
            faults: true,
        },
    );
}

/// An extent arena per stream after the first (`stream_arenas:own`, the default until session 12): a
/// block goes back to its own arena at once, a foreign free orders the arena's stream at the free, and
/// pages move between the arenas.
#[test]
fn prop_own_arenas() {
    run(
        "prop_own_arenas",
        Setup {
            conf: "experimental.stream_arenas:own",
            capacity: 384 * MIB,
            backed: false,
            huge: true,
            faults: true,
        },
    );
}

/// The extent arenas' old generation firing all the time (`old_generation:2`: a size whose last block
/// outlived two of its arena's allocations goes to the old range), under pauses, exhaustion and faults:
/// blocks move between the two ranges of each arena and fall back from a full one to the other.
#[test]
fn prop_old_generation() {
    run(
        "prop_old_generation",
        Setup {
            conf: "old_generation:2",
            capacity: 384 * MIB,
            backed: false,
            huge: true,
            faults: true,
        },
    );
}

/// Passing over busy freers (`experimental.busy_freers:pass`): streams paused mid-program are busy, so
/// the shared arena's placement, the page pool's steals and take-backs, and placement around
/// addresses whose commit would wait for a busy stream take their passing paths (the last ~60 times a
/// case, counted in a scratch build);
/// every reuse must still be ordered, under pauses, faults and exhaustion.
#[test]
fn prop_busy_freers_pass() {
    run(
        "prop_busy_freers_pass",
        Setup {
            conf: "experimental.busy_freers:pass",
            capacity: 384 * MIB,
            backed: false,
            huge: true,
            faults: true,
        },
    );
}

/// The same with host-backed memory: a block of either range never overlaps another's bytes (every
/// block filled with its own pattern, checked on free).
#[test]
fn prop_old_generation_backed() {
    run(
        "prop_old_generation_backed",
        Setup {
            conf: "old_generation:2",
            capacity: 256 * MIB,
            backed: true,
            huge: false,
            faults: false,
        },
    );
}

/// Host-backed memory: every block filled with its own pattern, checked on free.
#[test]
fn prop_backed_patterns() {
    run(
        "prop_backed_patterns",
        Setup {
            conf: "experimental.routing:generational,experimental.mid_tier:stream,experimental.long_tier:buddy,slab_max_size:64K",
            capacity: 256 * MIB,
            backed: true,
            huge: false,
            faults: false,
        },
    );
}

/// A block allocated on `s` and freed on `t` (its last user: PyTorch's `record_stream`, a hand-off)
/// goes straight back to `s`'s arena, but only once `s` waits on the device for `t`'s work so far: `s`
/// may reuse it at once, and never before `t`'s queued work is done. (Before session 10 such frees went
/// through exact-size front caches; issue #6's regressions were in them.)
#[test]
fn foreign_free_orders_the_home_stream_after_the_freeing_stream() {
    let dev = Arc::new(SimDevice::config().capacity(GIB).build().unwrap());
    let pool = Pool::new(dev.clone() as Arc<dyn Device>, Config::default()).unwrap();
    let (s, t) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
    see_streams(&pool, &[s, t]);
    let a = pool.alloc(8 * MIB, s, Hint::NONE).unwrap();
    // A kernel on `t` still uses `a` when it is freed there.
    let ev = busy(&dev, t);
    assert!(!dev.waits_on(s, t));
    let before = dev.call_counts();
    pool.free(a.ptr, t).unwrap();
    let after = dev.call_counts();
    assert!(dev.waits_on(s, t), "s is ordered after t's work");
    assert_eq!(after.waits, before.waits, "no host wait");
    let b = pool.alloc(8 * MIB, s, Hint::NONE).unwrap();
    assert_eq!(
        b.ptr, a.ptr,
        "s reuses the block at once (its arena, best fit)"
    );
    idle(&dev, t, ev);
    pool.free(b.ptr, s).unwrap();
    dev.synchronize().unwrap();
    pool.trim();
    assert_eq!(pool.reserved_now(), 0);
}

/// Regression (issue #6, found by the proptest): a front cache that had seen one stream only handed its
/// blocks back to the shared tier with no synchronization (its one-stream shortcut), although the engine
/// had already seen other streams; the tier then served the block to another stream while the freeing
/// stream might still use it.
#[test]
fn cache_solo_drain_is_stream_ordered() {
    let dev = Arc::new(SimDevice::config().capacity(512 * MIB).build().unwrap());
    // The cache path this regression was in: one extent arena for every stream. (With stream arenas,
    // `a` goes straight back to `s`'s own arena and `t` allocates elsewhere: `stream_arenas_...` below.)
    let pool = Pool::new(
        dev.clone() as Arc<dyn Device>,
        Config::parse("experimental.stream_arenas:false").unwrap(),
    )
    .unwrap();
    let (s, t) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
    // The engine sees both streams (small blocks: the slab, not the extent arena).
    see_streams(&pool, &[s, t]);
    let ev = busy(&dev, s);
    // A large block freed on the busy stream `s`, the shared arena's first allocator.
    let a = pool.alloc(9 * MIB, s, Hint::NONE).unwrap();
    pool.free(a.ptr, s).unwrap();
    let mid = Hint {
        lifetime: Some(Lifetime::Mid),
        site: None,
    };
    let long = Hint {
        lifetime: Some(Lifetime::Long),
        site: None,
    };
    let _ = pool.alloc(846, t, mid);
    let b = pool.alloc(490, t, long).unwrap();
    let overlap = b.ptr < a.ptr + a.size && a.ptr < b.ptr + b.size;
    let ordered = dev.waits_on(t, s);
    idle(&dev, s, ev);
    assert!(
        !overlap || ordered,
        "{b:?} on stream t reuses {a:?} freed on busy stream s without waiting for it"
    );
}

/// Stream arenas (the default): a large block freed on the stream that allocated it goes straight back
/// to that stream's arena — no cache holds its pages — and the stream reuses it at once (stream order),
/// while another stream, allocating from its own arena, never gets it while work queued on the freeing
/// stream may still use it. A block freed on another stream than its arena's orders the arena's stream
/// after the freeing one before it can be reused.
#[test]
fn stream_arenas_reuse_within_a_stream_and_never_across_it_early() {
    // With one arena for the first stream, or its three generation arenas.
    for conf in [
        "page_slack:1.0",
        "page_slack:1.0,experimental.extent_generations:true",
    ] {
        stream_arenas_case(conf);
    }
}

fn stream_arenas_case(conf: &str) {
    let dev = Arc::new(SimDevice::config().capacity(GIB).build().unwrap());
    // Headroom: the other stream's arena creates pages rather than wait for the paused stream's.
    let pool = Pool::new(dev.clone() as Arc<dyn Device>, Config::parse(conf).unwrap()).unwrap();
    let (s, t) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
    see_streams(&pool, &[s, t]);
    let short = Hint {
        lifetime: Some(Lifetime::Short),
        site: None,
    };
    for (home, other) in [(s, t), (t, s)] {
        let a = pool.alloc(8 * MIB, home, short).unwrap();
        let ev = busy(&dev, home);
        let before = dev.call_counts();
        pool.free(a.ptr, home).unwrap();
        let after = dev.call_counts();
        assert_eq!(
            (after.event_records, after.stream_waits),
            (before.event_records, before.stream_waits),
            "freed straight to its own arena, no device call"
        );
        let b = pool.alloc(8 * MIB, other, short).unwrap();
        assert!(
            !(b.ptr < a.ptr + a.size && a.ptr < b.ptr + b.size),
            "{b:?} on the other stream reuses {a:?} freed on a busy stream"
        );
        let again = pool.alloc(8 * MIB, home, short).unwrap();
        assert_eq!(
            again.ptr, a.ptr,
            "the freeing stream reuses its block at once"
        );
        idle(&dev, home, ev);
        pool.free(b.ptr, other).unwrap();
        pool.free(again.ptr, home).unwrap();
    }
    // Allocated on `s`, last used (and freed) on a busy `t`: `s` may have it again only after `t`.
    let c = pool.alloc(8 * MIB, s, short).unwrap();
    let ev = busy(&dev, t);
    pool.free(c.ptr, t).unwrap();
    let d = pool.alloc(8 * MIB, s, short).unwrap();
    let overlap = d.ptr < c.ptr + c.size && c.ptr < d.ptr + d.size;
    assert!(
        !overlap || dev.waits_on(s, t),
        "{d:?} on s reuses {c:?} freed on busy t without waiting for it"
    );
    idle(&dev, t, ev);
    pool.free(d.ptr, s).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(pool.allocated(), 0);
    pool.trim();
    assert_eq!(pool.reserved_now(), 0);
}

/// The streams after the first share one extent arena (the default since session 12): a block freed on
/// one of them goes back with no device call, and another stream gets its bytes at once — after it waits,
/// on the device, for the freeing stream's work, never before; a stream taking back bytes it freed
/// itself, or that it already waited for, makes no device call. No host wait anywhere.
#[test]
fn later_streams_share_one_arena_and_wait_only_for_the_freer() {
    let dev = Arc::new(SimDevice::config().capacity(GIB).build().unwrap());
    let pool = Pool::new(dev.clone() as Arc<dyn Device>, Config::default()).unwrap();
    let (a, b, c) = (
        dev.stream_create().unwrap(),
        dev.stream_create().unwrap(),
        dev.stream_create().unwrap(),
    );
    see_streams(&pool, &[a, b, c]);
    let first = pool.alloc(8 * MIB, a, Hint::NONE).unwrap();
    let x = pool.alloc(8 * MIB, b, Hint::NONE).unwrap();
    let ev = busy(&dev, b);
    let before = dev.call_counts();
    pool.free(x.ptr, b).unwrap();
    let freed = dev.call_counts();
    assert_eq!(
        (freed.event_records, freed.stream_waits, freed.waits),
        (before.event_records, before.stream_waits, before.waits),
        "a free makes no device call"
    );
    assert!(!dev.waits_on(c, b));
    let y = pool.alloc(8 * MIB, c, Hint::NONE).unwrap();
    assert_eq!(y.ptr, x.ptr, "c gets b's bytes at once: one arena");
    assert!(dev.waits_on(c, b), "after waiting for b's queued work");
    assert_eq!(dev.call_counts().waits, before.waits, "on the device only");
    assert!(
        !(first.ptr < y.ptr + y.size && y.ptr < first.ptr + first.size),
        "the first stream keeps its own arena"
    );
    idle(&dev, b, ev);
    pool.free(y.ptr, c).unwrap();
    let again = dev.call_counts();
    let z = pool.alloc(8 * MIB, c, Hint::NONE).unwrap();
    assert_eq!(z.ptr, y.ptr, "c takes its own bytes back");
    let after = dev.call_counts();
    assert_eq!(
        (after.event_records, after.stream_waits, after.waits),
        (again.event_records, again.stream_waits, again.waits),
        "its own bytes, and b's it already waited for: no device call"
    );
    pool.free(z.ptr, c).unwrap();
    pool.free(first.ptr, a).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(pool.allocated(), 0);
    pool.trim();
    assert_eq!(pool.reserved_now(), 0);
}

/// Pause `s` with work queued on it (an event recorded there): what is freed on `s` now is still in use.
fn busy(dev: &SimDevice, s: StreamId) -> gen_device::EventHandle {
    let ev = dev.event_create().unwrap();
    dev.pause_stream(s).unwrap();
    dev.event_record(ev, s).unwrap();
    ev
}

/// Let `s`'s queued work complete and drop the event [`busy`] recorded.
fn idle(dev: &SimDevice, s: StreamId, ev: gen_device::EventHandle) {
    dev.resume_stream(s).unwrap();
    dev.event_destroy(ev).unwrap();
}

/// Let `pool` see each of `streams` (a 512 B block allocated and freed on each: the slab, not the extent
/// arena), so the engine's one synchronize at a second stream's first use happens here.
fn see_streams(pool: &Pool, streams: &[StreamId]) {
    for &st in streams {
        let b = pool.alloc(512, st, Hint::NONE).unwrap();
        pool.free(b.ptr, st).unwrap();
    }
}

/// Found by `prop_shared_handoffs` when the slab's size classes came to share pages (session 24): a
/// chunk freed on a paused stream, its page moved to the extent arena and taken back through its old
/// mapping for another class's chunk on the first stream, then a third class's chunk on the page for
/// another stream — which must still wait for the paused one (the page layer used to forget, on the
/// way back, which streams had freed the page's bytes).
#[test]
fn a_page_taken_back_keeps_the_streams_that_freed_its_bytes() {
    let s = Setup {
        conf: "experimental.routing:generational,experimental.stream_arenas:false,experimental.long_tier:buddy",
        capacity: 384 * MIB,
        backed: false,
        huge: true,
        faults: true,
    };
    let a = |size, stream| Action::Alloc {
        size,
        stream,
        lifetime: None,
        site: None,
    };
    let actions = [
        a(SizeKind::Small(1537), 0),
        a(SizeKind::Small(513), 0),
        Action::Free {
            pick: 5350900632382291157,
            stream: 0,
        },
        a(SizeKind::Small(513), 0),
        Action::Free {
            pick: 1202639182499390311,
            stream: 0,
        },
        Action::Pause(1),
        Action::Free { pick: 0, stream: 1 },
        a(SizeKind::Medium(4097), 0),
        Action::Free { pick: 0, stream: 0 },
        a(SizeKind::Small(1025), 0),
        a(SizeKind::Small(1), 2),
    ];
    let mut h = Harness::new(s).unwrap();
    for x in &actions {
        h.step(x).unwrap();
    }
    h.finish().unwrap();
}
