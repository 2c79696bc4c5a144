//! The engine behind `gen_trace`'s replay seam (feature `replay`).

use gen_trace::{ClassifierReport, ReplayAllocator, ReplayError, TierReport};

use crate::{Hint, Pool};

/// A [`Pool`] driven by a trace replay.
#[derive(Debug)]
pub struct EngineReplay {
    pool: Pool,
    name: String,
}

impl EngineReplay {
    /// Wrap `pool`; `name` labels the reports (e.g. `genpool`, `genpool-single`).
    pub fn new(pool: Pool, name: impl Into<String>) -> Self {
        EngineReplay {
            pool,
            name: name.into(),
        }
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
        self.pool.mark_iteration();
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

    fn classifier(&self) -> Option<ClassifierReport> {
        let c = self.pool.classifier().confusion();
        Some(ClassifierReport {
            accuracy_count: c.accuracy_count(),
            accuracy_bytes: c.accuracy_bytes(),
            confusion_count: c.counts,
            confusion_bytes: c.bytes,
        })
    }
}
