//! Error types: [`TraceError`] for reading and validating traces, [`ReplayError`] for replaying them.

use std::fmt;

/// A problem with a trace file: where it is (`file:line`), which field, and what is wrong.
///
/// Displayed as `file:line: message` (or `file: message` when the problem has no line, e.g. an I/O
/// error). For pickled snapshots `line` is the 1-based index of the event in its device trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceError {
    /// The file (or the trace's name for in-memory input).
    pub file: String,
    /// 1-based line (CSV) or event number (pickle); 0 when the error concerns the whole file.
    pub line: u64,
    /// The field that is wrong, when there is one (`"size"`, `"addr"`, ...).
    pub field: Option<String>,
    /// What is wrong, in words.
    pub message: String,
}

impl TraceError {
    /// An error at `file:line` about `field`.
    pub fn new(
        file: impl Into<String>,
        line: u64,
        field: Option<&str>,
        message: impl Into<String>,
    ) -> Self {
        TraceError {
            file: file.into(),
            line,
            field: field.map(str::to_owned),
            message: message.into(),
        }
    }
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            write!(f, "{}: {}", self.file, self.message)
        } else {
            write!(f, "{}:{}: {}", self.file, self.line, self.message)
        }
    }
}

impl std::error::Error for TraceError {}

/// Everything that can go wrong while replaying a trace through a [`ReplayAllocator`].
///
/// Allocators return the first four variants; [`replay`] adds the others and wraps an allocator's error
/// in [`ReplayError::Op`] with the pass and op where it happened.
///
/// [`ReplayAllocator`]: crate::ReplayAllocator
/// [`replay`]: crate::replay()
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReplayError {
    /// The allocator cannot serve `requested` bytes.
    #[error("out of memory ({requested} bytes requested)")]
    OutOfMemory {
        /// Bytes asked for.
        requested: u64,
    },
    /// `free` was called with an address the allocator did not hand out (or already took back).
    #[error("free of {ptr:#x}, which is not a live allocation")]
    InvalidFree {
        /// The address passed to `free`.
        ptr: u64,
    },
    /// A request the allocator cannot express (zero or absurd size, ...).
    #[error("invalid request: {message}")]
    InvalidRequest {
        /// What is wrong.
        message: String,
    },
    /// Any other allocator failure (an engine adapter maps its own errors here).
    #[error("{message}")]
    Allocator {
        /// The allocator's own description.
        message: String,
    },
    /// An allocator call failed during a replay.
    #[error("pass {pass}, op {op}: {source}")]
    Op {
        /// 1-based pass.
        pass: u32,
        /// 0-based index in the op array (the trace's event index).
        op: usize,
        /// The allocator's error.
        source: Box<ReplayError>,
    },
    /// The allocator returned a block that overlaps another live block.
    #[error(
        "pass {pass}, op {op}: allocator returned [{addr:#x}, +{size}) overlapping live [{other_addr:#x}, +{other_size})"
    )]
    Overlap {
        /// 1-based pass.
        pass: u32,
        /// 0-based op index.
        op: usize,
        /// The new block.
        addr: u64,
        /// Its size.
        size: u64,
        /// The live block it overlaps.
        other_addr: u64,
        /// That block's size.
        other_size: u64,
    },
    /// The allocator returned an address that is not a multiple of [`MIN_ALIGN`](crate::MIN_ALIGN).
    #[error(
        "pass {pass}, op {op}: allocator returned misaligned address {addr:#x} (alignment < 512 B)"
    )]
    Misaligned {
        /// 1-based pass.
        pass: u32,
        /// 0-based op index.
        op: usize,
        /// The address.
        addr: u64,
    },
    /// The trace cannot be replayed (inconsistent events in a hand-built [`Trace`](crate::Trace)).
    #[error("trace cannot be replayed: event {event}: {message}")]
    InvalidTrace {
        /// 0-based event index.
        event: usize,
        /// What is wrong.
        message: String,
    },
    /// `passes` was 0.
    #[error("at least one pass is needed")]
    NoPasses,
}
