//! The engine behind `gen_trace`'s replay seam (feature `replay`).

use gen_device::hash::U64Map;
use std::sync::Arc;

use gen_device::{Device, StreamId};
use gen_trace::{ClassifierReport, ReplayAllocator, ReplayError, TierReport};

use crate::{Hint, Pool};

/// A [`Pool`] driven by a trace replay.
///
/// A trace names streams by the handles the recorded program had (`0` = the default stream). The replay
/// gives each other handle a stream of its own on the pool's device, created at its first use, so a
/// multi-stream trace is replayed on as many real streams, in the same roles — not on handles the
/// device never made.
#[derive(Debug)]
pub struct EngineReplay {
    // Declared before `streams`: the pool (and what its caches queue on those streams) goes first.
    pool: Pool,
    name: String,
    streams: Streams,
}

/// The replay's streams by trace handle; destroyed after the pool is gone. (gen-device's `u64` hasher:
/// with std's SipHash the lookup was ~140 instructions of every operation of a multi-stream replay, with
/// this one ~57; a list of the first sixteen handles in front of it saved ~10 more and was not kept.)
#[derive(Debug)]
struct Streams {
    device: Arc<dyn Device>,
    by_handle: U64Map<StreamId>,
}

impl Drop for Streams {
    fn drop(&mut self) {
        for (_, s) in self.by_handle.drain() {
            if let Err(e) = self.device.stream_destroy(s) {
                log::warn!("genpool replay: destroying a replay stream: {e}");
            }
        }
    }
}

impl EngineReplay {
    /// Wrap `pool`; `name` labels the reports (e.g. `genpool`, `genpool-single`).
    pub fn new(pool: Pool, name: impl Into<String>) -> Self {
        let device = pool.device().clone();
        EngineReplay {
            pool,
            name: name.into(),
            streams: Streams {
                device,
                by_handle: U64Map::default(),
            },
        }
    }

    /// The device stream that plays the trace's stream `handle`.
    fn stream(&mut self, handle: u64) -> Result<StreamId, ReplayError> {
        if handle == 0 {
            return Ok(0);
        }
        if let Some(&s) = self.streams.by_handle.get(&handle) {
            return Ok(s);
        }
        let s = self
            .streams
            .device
            .stream_create()
            .map_err(|e| ReplayError::Allocator {
                message: format!("creating a stream for trace stream {handle:#x}: {e}"),
            })?;
        self.streams.by_handle.insert(handle, s);
        Ok(s)
    }

    /// The engine.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }
}

impl ReplayAllocator for EngineReplay {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn device(&self) -> String {
        let p = self.pool.device().props();
        format!(
            "{}:{} {}",
            if p.name.starts_with("Sim") {
                "sim"
            } else {
                "cuda"
            },
            p.ordinal,
            p.name
        )
    }

    #[inline]
    fn alloc(&mut self, size: u64, stream: u64, site: Option<u64>) -> Result<u64, ReplayError> {
        let stream = self.stream(stream)?;
        self.pool
            .alloc(
                size,
                stream,
                Hint {
                    lifetime: None,
                    site,
                },
            )
            .map(|b| b.ptr)
            .map_err(|e| match e {
                crate::GenpoolError::OutOfMemory(r) => ReplayError::OutOfMemory {
                    requested: r.requested,
                },
                crate::GenpoolError::InvalidSize { .. } => ReplayError::InvalidRequest {
                    message: e.to_string(),
                },
                e => ReplayError::Allocator {
                    message: e.to_string(),
                },
            })
    }

    #[inline]
    fn free(&mut self, ptr: u64, _size: u64, stream: u64) -> Result<(), ReplayError> {
        let stream = self.stream(stream)?;
        self.pool
            .free(ptr, stream)
            .map(|_| ())
            .map_err(|e| match e {
                crate::GenpoolError::InvalidFree { ptr, .. } => ReplayError::InvalidFree { ptr },
                e => ReplayError::Allocator {
                    message: e.to_string(),
                },
            })
    }

    fn reserved(&self) -> u64 {
        self.pool.reserved_now()
    }

    fn peak_reserved(&self) -> u64 {
        self.pool.reserved_peak()
    }

    fn mark_iteration(&mut self) {
        // The driver marks each pass: a whole run, not an iteration of one.
        self.pool.mark_pass();
    }

    fn tiers(&self) -> Vec<TierReport> {
        self.pool
            .stats()
            .tiers
            .into_iter()
            .map(|t| TierReport {
                name: t.tier.to_string(),
                peak_reserved: t.reserved_peak,
                allocs: t.allocs,
            })
            .collect()
    }

    fn call_counts(&self) -> Vec<(&'static str, u64)> {
        self.pool.device().call_counts().pairs().to_vec()
    }

    fn counters(&self) -> Vec<(&'static str, u64)> {
        let st = self.pool.stats();
        let (o, p) = (st.old_generation, st.plan);
        vec![
            ("old_generation_allocs", o.allocs),
            ("old_generation_peak_live", o.peak_live_bytes),
            ("plan_hits", p.hits),
            ("plan_misses", p.misses),
            ("plan_activations", p.activations),
            ("plan_deactivations", p.deactivations),
        ]
    }

    fn classifier(&self) -> Option<ClassifierReport> {
        // Only routing by predicted lifetime makes predictions.
        if self.pool.config().routing != crate::Routing::Generational {
            return None;
        }
        let c = self.pool.classifier().confusion();
        Some(ClassifierReport {
            accuracy_count: c.accuracy_count(),
            accuracy_bytes: c.accuracy_bytes(),
            confusion_count: c.counts,
            confusion_bytes: c.bytes,
        })
    }
}
