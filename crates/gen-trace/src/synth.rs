//! Synthetic traces of shapes the captured ones (`benches/traces`) do not cover: a check of the general
//! case, not something to tune on. Deterministic (fixed seeds, this module's own generator), so a test,
//! `genpool synth` and a GPU call all see the same events.
//!
//! | shape | what it is |
//! |---|---|
//! | `serve8` | eight serving streams taking requests at random (batch 1–8, 16–512 tokens), each request's activations kept until the stream's next flush, two temporaries a request; 150 weights on the default stream |
//! | `crossfree` | a loader stream allocates each batch, the compute stream frees it two steps later (the `record_stream` hand-off); 5–30 activations a step, freed in reverse order |
//! | `random_sizes` | one stream, sizes log-uniform 1 KiB – 256 MiB, random lifetimes (at most 400 live): no layout ever repeats |
//! | `kvgrow` | generate-like decoding: 24 caches grown by one token a step (the longer block allocated, then the old one freed), a temporary a layer, 60 requests of random batch and prompt length |

use crate::{Event, EventKind, Trace, TraceError};

const MIB: u64 = 1 << 20;

/// The shapes [`shape`] makes, in a fixed order.
pub const SHAPES: &[&str] = &["serve8", "crossfree", "random_sizes", "kvgrow"];

/// The trace of shape `name` (one of [`SHAPES`]); `None` for another name.
pub fn shape(name: &str) -> Option<Trace> {
    let b = match name {
        "serve8" => serve8(1),
        "crossfree" => crossfree(2),
        "random_sizes" => random_sizes(3),
        "kvgrow" => kvgrow(4),
        _ => return None,
    };
    // Every event is built consistent (allocated before freed, addresses never reused): a failure here
    // is a bug in this module.
    Some(b.finish(name).expect("a synthetic trace is consistent"))
}

/// SplitMix64: a small, fixed generator (the traces must not change with a dependency's version);
/// public for tests that need a seeded stream of numbers.
#[derive(Clone, Debug)]
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`; multiply-high, no modulo bias).
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// In `lo..=hi` (modulo: what the shapes were generated with).
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }

    /// Uniform in `[0, 1)`.
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[(self.next_u64() % xs.len() as u64) as usize]
    }
}

/// Events in program order; each allocation gets an address of its own.
struct Build {
    events: Vec<Event>,
    next_addr: u64,
    live: std::collections::HashMap<u64, (u64, u64)>,
}

impl Build {
    fn new() -> Self {
        Build {
            events: Vec::new(),
            next_addr: 1 << 40,
            live: std::collections::HashMap::new(),
        }
    }

    fn push(&mut self, kind: EventKind, addr: u64, size: u64, stream: u64) {
        let t_us = self.events.len() as u64;
        self.events.push(Event {
            t_us,
            kind,
            addr,
            size,
            stream,
            site: 0,
        });
    }

    fn alloc(&mut self, size: u64, stream: u64) -> u64 {
        let size = size.div_ceil(512) * 512;
        let addr = self.next_addr;
        self.next_addr += size + 4096;
        self.push(EventKind::Alloc, addr, size, stream);
        self.live.insert(addr, (size, stream));
        addr
    }

    /// Free `addr` on `stream`, or on its allocation's stream when `None`.
    fn free(&mut self, addr: u64, stream: Option<u64>) {
        let (size, own) = self.live.remove(&addr).expect("freeing a live block");
        self.push(EventKind::Free, addr, size, stream.unwrap_or(own));
    }

    fn finish(self, name: &str) -> Result<Trace, TraceError> {
        Trace::from_events(name, self.events)
    }
}

fn serve8(seed: u64) -> Build {
    let (mut r, mut t) = (Rng(seed), Build::new());
    for _ in 0..150 {
        let size = r.pick(&[9 * MIB, 2 * MIB, 3 * MIB]);
        t.alloc(size, 0);
    }
    let streams: Vec<u64> = (0..8).map(|i| 1000 + i).collect();
    let mut held: Vec<Vec<u64>> = vec![Vec::new(); streams.len()];
    for _ in 0..3000 {
        let i = (r.next_u64() % streams.len() as u64) as usize;
        let s = streams[i];
        if !held[i].is_empty() && r.unit() < 0.3 {
            for x in std::mem::take(&mut held[i]) {
                t.free(x, None);
            }
            continue;
        }
        let (seq, batch) = (r.range(16, 512), r.range(1, 8));
        for _ in 0..6 {
            let x = t.alloc(batch * seq * 768 * 2, s);
            held[i].push(x);
        }
        let tmp: Vec<u64> = (0..2).map(|_| t.alloc(batch * seq * 3072 * 2, s)).collect();
        for x in tmp {
            t.free(x, None);
        }
    }
    for h in held {
        for x in h {
            t.free(x, None);
        }
    }
    t
}

fn crossfree(seed: u64) -> Build {
    let (mut r, mut t) = (Rng(seed), Build::new());
    for _ in 0..50 {
        let size = r.pick(&[4 * MIB, 16 * MIB, 64 * MIB]);
        t.alloc(size, 0);
    }
    let mut queue = std::collections::VecDeque::new();
    for _ in 0..2000 {
        let batch = r.pick(&[12 * MIB, 24 * MIB, 6 * MIB]);
        queue.push_back(t.alloc(batch, 7));
        let n = r.range(5, 30);
        let acts: Vec<u64> = (0..n)
            .map(|_| {
                let size = r.range(1, 40) * MIB + r.range(0, 511) * 512;
                t.alloc(size, 0)
            })
            .collect();
        for x in acts.into_iter().rev() {
            t.free(x, None);
        }
        if queue.len() > 2 {
            let b = queue.pop_front().expect("queued");
            t.free(b, Some(0));
        }
    }
    t
}

fn random_sizes(seed: u64) -> Build {
    let (mut r, mut t) = (Rng(seed), Build::new());
    let mut live: Vec<u64> = Vec::new();
    for _ in 0..60_000 {
        if !live.is_empty() && (r.unit() < 0.5 || live.len() > 400) {
            let i = (r.next_u64() % live.len() as u64) as usize;
            let x = live.swap_remove(i);
            t.free(x, None);
        } else {
            let size = 2f64.powf(10.0 + 18.0 * r.unit()) as u64;
            live.push(t.alloc(size.max(1), 0));
        }
    }
    t
}

fn kvgrow(seed: u64) -> Build {
    let (mut r, mut t) = (Rng(seed), Build::new());
    for _ in 0..100 {
        let size = r.pick(&[2 * MIB, 9 * MIB, 2304 * 1024]);
        t.alloc(size, 0);
    }
    for _ in 0..60 {
        let (batch, prompt, new) = (r.range(1, 16), r.range(16, 512), r.range(16, 128));
        let mut caches: Vec<u64> = (0..24)
            .map(|_| t.alloc(batch * prompt * 64 * 12 * 2, 0))
            .collect();
        for tok in 0..new {
            let len = prompt + tok + 1;
            for c in caches.iter_mut() {
                let grown = t.alloc(batch * len * 64 * 12 * 2, 0);
                let tmp = t.alloc(batch * len * 3072, 0);
                t.free(*c, None);
                *c = grown;
                t.free(tmp, None);
            }
        }
        for c in caches {
            t.free(c, None);
        }
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg_attr(
        miri,
        ignore = "builds ~600 000 events twice: hours under Miri, and no unsafe code to check"
    )]
    fn every_shape_is_a_valid_deterministic_trace() {
        for name in SHAPES {
            let a = shape(name).unwrap();
            let b = shape(name).unwrap();
            assert_eq!(a.events, b.events, "{name}: deterministic");
            assert!(a.summary.allocs > 1000, "{name}: {:?}", a.summary);
            assert_eq!(a.name, *name);
        }
        assert!(shape("nope").is_none());
        // The shapes are what they say: eight serving streams and the default one; a free on another
        // stream than its allocation's; sizes spanning 1 KiB to 256 MiB.
        let streams = |t: &Trace| {
            let mut s: Vec<u64> = t.events.iter().map(|e| e.stream).collect();
            s.sort_unstable();
            s.dedup();
            s.len()
        };
        assert_eq!(streams(&shape("serve8").unwrap()), 9);
        let cf = shape("crossfree").unwrap();
        let mut alloc_stream = std::collections::HashMap::new();
        let mut crossed = 0;
        for e in &cf.events {
            match e.kind {
                EventKind::Alloc => {
                    alloc_stream.insert(e.addr, e.stream);
                }
                EventKind::Free => crossed += usize::from(alloc_stream[&e.addr] != e.stream),
            }
        }
        assert!(crossed > 1000, "{crossed} frees on another stream");
        let rs = shape("random_sizes").unwrap();
        let max = rs.events.iter().map(|e| e.size).max().unwrap();
        let min = rs.events.iter().map(|e| e.size).min().unwrap();
        assert!(min <= 2048 && max >= 128 * MIB, "{min}..{max}");
    }
}
