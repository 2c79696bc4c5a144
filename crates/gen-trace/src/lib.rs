//! Allocation traces for genpool: formats, validation, replay and reference allocators.
//!
//! - **Formats** ([`load_path`], [`load_bytes`]): genpool's CSV (`t_us,action,addr,size,stream,site`,
//!   see `traces/README.md`), RMM's `logging_resource_adaptor` CSV, and PyTorch memory-snapshot pickles
//!   (`torch.cuda.memory._dump_snapshot`); gzip is detected by magic bytes. Every reader validates
//!   (unknown action, non-numeric field, free of a dead address, alloc of a live one, size 0, missing
//!   header) and reports a [`TraceError`] displayed as `file:line: message`. [`write_csv`] writes the
//!   CSV format back.
//! - **Replay** ([`replay`], [`ReplayPlan`], [`ReplayAllocator`]): the seam the genpool engine and the
//!   reference allocators plug into; produces a serializable [`ReplayReport`] (ratio, ns/op, tiers).
//! - **Reference allocators** ([`Bfc`], [`ReferenceBuddy`]): host-only address arithmetic, as baselines.
//! - **Synthetic shapes** ([`synth`]): deterministic traces of workloads the captured ones do not cover
//!   (many serving streams, cross-stream frees, random sizes, growing KV caches).
//!
//! This crate does not depend on the engine.

mod bfc;
mod buddy;
mod error;
mod read;
mod replay;
pub mod site;
mod snapshot;
pub mod synth;
mod trace;
mod write;

pub use bfc::{Bfc, BfcConfig, ReferenceStats, BFC_ROUND};
pub use buddy::{ReferenceBuddy, ReferenceBuddyConfig, BUDDY_MIN_BLOCK};
pub use error::{ReplayError, TraceError};
pub use read::{
    load_bytes, load_path, load_reader, read_csv, read_rmm, TraceFormat, CSV_HEADER, RMM_HEADER,
};
pub use replay::{
    replay, replay_plan, ClassifierReport, ReplayAllocator, ReplayOptions, ReplayPlan,
    ReplayReport, TierReport, MIN_ALIGN,
};
pub use snapshot::read_snapshot;
pub use trace::{trace_name, Event, EventKind, Trace, TraceBuilder, TraceSummary, UnknownFree};
pub use write::{write_csv, write_csv_path};
