//! Property test: `StreamCache` against a reference model, on the simulated device with streams paused
//! and resumed at random.
//!
//! The model knows, for every cached block, its size, the stream S it was freed on and whether it is a
//! *hazard*: S was paused when it was freed, with work queued (a kernel that may still use the block),
//! and has not been resumed since. Invariants checked after every action:
//! 1. **exact size, no duplicates**: `take` returns only a cached block of the requested size, never one
//!    the user holds;
//! 2. **stream safety**: a hazard freed on S is never handed to T != S;
//! 3. **same-stream liveness**: `take(size, T)` hits when a block of `size` freed on T is cached;
//! 4. **cross-stream liveness**: it also hits when a block of `size` is cached whose free stream is not
//!    paused now (its work is done, one event query proves it);
//! 5. **drain**: hands back only non-hazards, every block whose free stream is not paused, and reports
//!    an error exactly when something stays;
//! 6. **accounting**: `cached_bytes` and `cached_blocks` equal the model's.

use std::collections::BTreeMap;
use std::sync::Arc;

use gen_device::sim::SimDevice;
use gen_device::{Device, EventHandle, StreamId};
use gen_stream::{StreamCache, StreamCacheConfig};
use proptest::prelude::*;

const BLOCKS: usize = 12;
const STREAMS: usize = 3;
const SIZES: [u64; 3] = [512, 4096, 65536];

#[derive(Clone, Debug)]
enum Action {
    Put { block: usize, stream: usize },
    Take { size: usize, stream: usize },
    Pause(usize),
    Resume(usize),
    Drain,
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        6 => (0..BLOCKS, 0..STREAMS).prop_map(|(block, stream)| Action::Put { block, stream }),
        6 => (0..SIZES.len(), 0..STREAMS).prop_map(|(size, stream)| Action::Take { size, stream }),
        2 => (0..STREAMS).prop_map(Action::Pause),
        2 => (0..STREAMS).prop_map(Action::Resume),
        1 => Just(Action::Drain),
    ]
}

#[derive(Clone, Copy, Debug)]
struct Cached {
    size: u64,
    stream: usize,
    hazard: bool,
}

struct World {
    dev: Arc<SimDevice>,
    cache: StreamCache,
    streams: Vec<StreamId>,
    /// One event per stream: recording it on a paused stream queues work that stays incomplete.
    kernels: Vec<EventHandle>,
    paused: Vec<bool>,
    /// Blocks the user holds: ptr -> size.
    held: BTreeMap<u64, u64>,
    cached: BTreeMap<u64, Cached>,
}

fn ptr_of(block: usize) -> u64 {
    0x1_0000_0000 + (block as u64) * 0x10_0000
}

impl World {
    fn new(single_stream_sync: bool, bound: u64) -> Self {
        let dev = Arc::new(SimDevice::new());
        let streams = (0..STREAMS).map(|_| dev.stream_create().unwrap()).collect();
        let kernels = (0..STREAMS).map(|_| dev.event_create().unwrap()).collect();
        let cache = StreamCache::new(
            dev.clone() as Arc<dyn Device>,
            StreamCacheConfig {
                max_cached_bytes: bound,
                shards: 2,
                single_stream_sync,
            },
        );
        let held = (0..BLOCKS)
            .map(|b| (ptr_of(b), SIZES[b % SIZES.len()]))
            .collect();
        World {
            dev,
            cache,
            streams,
            kernels,
            paused: vec![false; STREAMS],
            held,
            cached: BTreeMap::new(),
        }
    }

    fn step(&mut self, a: &Action) -> Result<(), TestCaseError> {
        match *a {
            Action::Put { block, stream } => {
                let p = ptr_of(block);
                let Some(&size) = self.held.get(&p) else {
                    return Ok(());
                };
                if self.paused[stream] {
                    // A kernel queued on the paused stream may still use the block.
                    self.dev
                        .event_record(self.kernels[stream], self.streams[stream])
                        .unwrap();
                }
                let bound = self.cache.config().max_cached_bytes;
                let total: u64 = self.cached.values().map(|c| c.size).sum();
                match self.cache.put(p, size, self.streams[stream]) {
                    Ok(()) => {
                        prop_assert!(bound == 0 || total + size <= bound);
                        self.held.remove(&p);
                        let hazard = self.paused[stream];
                        self.cached.insert(
                            p,
                            Cached {
                                size,
                                stream,
                                hazard,
                            },
                        );
                    }
                    Err(o) => {
                        prop_assert!(bound != 0 && total + size > bound, "{o}");
                    }
                }
            }
            Action::Take { size, stream } => {
                let size = SIZES[size];
                let own = self
                    .cached
                    .values()
                    .any(|c| c.size == size && c.stream == stream);
                let idle = self
                    .cached
                    .values()
                    .any(|c| c.size == size && !self.paused[c.stream]);
                match self.cache.take(size, self.streams[stream]) {
                    Some(p) => {
                        let c = self.cached.remove(&p);
                        prop_assert!(
                            c.is_some(),
                            "{p:#x} is not cached (held: {})",
                            self.held.contains_key(&p)
                        );
                        let c = c.unwrap();
                        prop_assert_eq!(c.size, size);
                        prop_assert!(
                            c.stream == stream || !c.hazard,
                            "{p:#x} freed on paused stream {} handed to {stream}",
                            c.stream
                        );
                        self.held.insert(p, size);
                    }
                    None => {
                        prop_assert!(!own, "a block freed on stream {stream} was not reused");
                        prop_assert!(!idle, "an idle block of {size} was not migrated");
                    }
                }
            }
            Action::Pause(s) => {
                self.dev.pause_stream(self.streams[s]).unwrap();
                self.paused[s] = true;
            }
            Action::Resume(s) => {
                self.dev.resume_stream(self.streams[s]).unwrap();
                self.paused[s] = false;
                for c in self.cached.values_mut().filter(|c| c.stream == s) {
                    c.hazard = false;
                }
            }
            Action::Drain => {
                let mut got = Vec::new();
                let r = self.cache.drain(&mut |p, size| got.push((p, size)));
                for &(p, size) in &got {
                    let c = self.cached.remove(&p);
                    prop_assert!(c.is_some(), "drained {p:#x} twice or never cached");
                    let c = c.unwrap();
                    prop_assert_eq!(c.size, size);
                    prop_assert!(!c.hazard, "drained {p:#x} while its stream still uses it");
                    self.held.insert(p, size);
                }
                for (p, c) in &self.cached {
                    prop_assert!(
                        self.paused[c.stream],
                        "{p:#x} (stream {} not paused) was not drained",
                        c.stream
                    );
                }
                prop_assert_eq!(r.is_err(), !self.cached.is_empty());
            }
        }
        let bytes: u64 = self.cached.values().map(|c| c.size).sum();
        prop_assert_eq!(self.cache.cached_bytes(), bytes);
        prop_assert_eq!(self.cache.stats().cached_blocks, self.cached.len() as u64);
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: if cfg!(miri) { 4 } else { 256 },
        ..ProptestConfig::default()
    })]

    #[test]
    fn cache_matches_model(
        actions in proptest::collection::vec(action(), 1..120),
        shortcut in any::<bool>(),
        bounded in any::<bool>(),
    ) {
        let mut w = World::new(shortcut, if bounded { 3 * 65536 } else { 0 });
        for a in &actions {
            w.step(a)?;
        }
        // Resume everything: then a drain gives back every block, safe.
        for s in 0..STREAMS {
            w.step(&Action::Resume(s))?;
        }
        w.step(&Action::Drain)?;
        prop_assert!(w.cached.is_empty());
        prop_assert_eq!(w.held.len(), BLOCKS);
    }
}
