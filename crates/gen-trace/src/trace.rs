//! The in-memory trace: [`Event`]s in program order plus a [`TraceSummary`], built and validated by
//! [`TraceBuilder`].

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::TraceError;

/// A fast hasher for device addresses (keys are `u64`s chosen by an allocator, not by an adversary):
/// one multiply, high half folded into the low half.
#[derive(Default, Clone, Copy)]
pub(crate) struct AddrHasher(u64);

impl Hasher for AddrHasher {
    fn finish(&self) -> u64 {
        let x = self.0.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        x ^ (x >> 29)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8)) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// A map keyed by device address.
pub(crate) type AddrMap<V> = HashMap<u64, V, BuildHasherDefault<AddrHasher>>;

/// What an event does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EventKind {
    /// A block of `size` bytes was handed out at `addr`.
    Alloc,
    /// The block at `addr` was given back (PyTorch's `free_completed`: reusable from here on).
    Free,
}

/// One allocation or free, as the traced program's allocator saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Event {
    /// Microseconds since an arbitrary origin.
    pub t_us: u64,
    /// Alloc or free.
    pub kind: EventKind,
    /// The device address the traced allocator returned (a free names the alloc it frees).
    pub addr: u64,
    /// Bytes (on a free: the size of the block freed).
    pub size: u64,
    /// CUDA stream handle as an integer (0 = default stream).
    pub stream: u64,
    /// 48-bit hash of the allocating call site (0 when unknown, and on frees).
    pub site: u64,
}

/// Figures of a whole trace, computed once when it is built.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct TraceSummary {
    /// Highest sum of live sizes: the physical lower bound of any allocator's reservation.
    pub peak_live: u64,
    /// Number of allocations.
    pub allocs: u64,
    /// Number of frees.
    pub frees: u64,
    /// Sum of all allocation sizes.
    pub alloc_bytes: u64,
    /// Blocks still live at the end (never freed: weights, optimizer state).
    pub live_at_end: u64,
    /// Bytes still live at the end.
    pub live_bytes_at_end: u64,
    /// Largest single allocation.
    pub max_size: u64,
    /// Distinct streams, ascending.
    pub streams: Vec<u64>,
    /// Distinct non-zero sites.
    pub sites: u64,
}

/// A validated allocation trace: every free names a live block, no address is handed out twice while
/// live, no allocation has size 0.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Trace {
    /// A short name (the file name without directory and extensions; `:devN` for multi-device snapshots).
    pub name: String,
    /// Events in program order.
    pub events: Vec<Event>,
    /// Figures of the whole trace.
    pub summary: TraceSummary,
}

impl Trace {
    /// Validates `events` and computes the summary. Errors name the 1-based event index as `line`.
    pub fn from_events(name: impl Into<String>, events: Vec<Event>) -> Result<Trace, TraceError> {
        let name = name.into();
        let mut b = TraceBuilder::new(&name);
        b.reserve(events.len());
        for (i, e) in events.iter().enumerate() {
            b.push(*e, i as u64 + 1)?;
        }
        Ok(b.finish(name))
    }

    /// Number of alloc + free events (the replay's op count).
    pub fn ops(&self) -> u64 {
        self.events.len() as u64
    }
}

/// What to do with a free of an address that is not live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnknownFree {
    /// It is an error (CSV traces, which are complete by construction).
    Error,
    /// Drop the event and count it ([`TraceBuilder::skipped_frees`]); for recordings that start in the
    /// middle of a program (PyTorch snapshots: blocks allocated before recording began).
    Skip,
}

/// Builds a [`Trace`] event by event, validating as it goes.
#[derive(Debug)]
pub struct TraceBuilder {
    file: String,
    events: Vec<Event>,
    live: AddrMap<u64>,
    live_bytes: u64,
    summary: TraceSummary,
    streams: Vec<u64>,
    sites: std::collections::HashSet<u64>,
    unknown_free: UnknownFree,
    skipped_frees: u64,
}

impl TraceBuilder {
    /// A builder whose errors name `file`. Unknown frees are errors.
    pub fn new(file: &str) -> Self {
        TraceBuilder {
            file: file.to_owned(),
            events: Vec::new(),
            live: AddrMap::default(),
            live_bytes: 0,
            summary: TraceSummary::default(),
            streams: Vec::new(),
            sites: std::collections::HashSet::new(),
            unknown_free: UnknownFree::Error,
            skipped_frees: 0,
        }
    }

    /// Sets the policy for frees of addresses that are not live.
    pub fn unknown_free(mut self, policy: UnknownFree) -> Self {
        self.unknown_free = policy;
        self
    }

    /// Reserves room for `n` more events.
    pub fn reserve(&mut self, n: usize) {
        self.events.reserve(n);
    }

    /// Frees dropped under [`UnknownFree::Skip`].
    pub fn skipped_frees(&self) -> u64 {
        self.skipped_frees
    }

    /// Adds one event; `line` is where it came from (for the error).
    pub fn push(&mut self, e: Event, line: u64) -> Result<(), TraceError> {
        match e.kind {
            EventKind::Alloc => {
                if e.size == 0 {
                    return Err(TraceError::new(
                        &self.file,
                        line,
                        Some("size"),
                        "allocation of size 0",
                    ));
                }
                if let Some(old) = self.live.insert(e.addr, e.size) {
                    self.live.insert(e.addr, old);
                    return Err(TraceError::new(
                        &self.file,
                        line,
                        Some("addr"),
                        format!(
                            "allocation at {:#x}, which is already live (a block of {old} bytes)",
                            e.addr
                        ),
                    ));
                }
                self.live_bytes = self.live_bytes.checked_add(e.size).ok_or_else(|| {
                    TraceError::new(&self.file, line, Some("size"), "live bytes overflow u64")
                })?;
                let s = &mut self.summary;
                s.peak_live = s.peak_live.max(self.live_bytes);
                s.allocs += 1;
                s.alloc_bytes = s.alloc_bytes.saturating_add(e.size);
                s.max_size = s.max_size.max(e.size);
                if e.site != 0 {
                    self.sites.insert(e.site);
                }
            }
            EventKind::Free => match self.live.remove(&e.addr) {
                Some(size) if size == e.size => {
                    self.live_bytes -= size;
                    self.summary.frees += 1;
                }
                Some(size) => {
                    self.live.insert(e.addr, size);
                    return Err(TraceError::new(
                        &self.file,
                        line,
                        Some("size"),
                        format!(
                            "free of {:#x} with size {}, but the live block there has {size} bytes",
                            e.addr, e.size
                        ),
                    ));
                }
                None if self.unknown_free == UnknownFree::Skip => {
                    self.skipped_frees += 1;
                    return Ok(());
                }
                None => {
                    return Err(TraceError::new(
                        &self.file,
                        line,
                        Some("addr"),
                        format!("free of {:#x}, which is not live", e.addr),
                    ))
                }
            },
        }
        // Streams are few; a linear scan of a short vector beats hashing.
        if !self.streams.contains(&e.stream) {
            self.streams.push(e.stream);
        }
        self.events.push(e);
        Ok(())
    }

    /// The finished trace.
    pub fn finish(mut self, name: impl Into<String>) -> Trace {
        self.streams.sort_unstable();
        let mut summary = self.summary;
        summary.streams = self.streams;
        summary.sites = self.sites.len() as u64;
        summary.live_at_end = self.live.len() as u64;
        summary.live_bytes_at_end = self.live_bytes;
        Trace {
            name: name.into(),
            events: self.events,
            summary,
        }
    }
}

/// The trace name for a path: file name without directory and without `.gz`, `.csv`, `.pickle`, `.pkl`,
/// `.log` extensions.
pub fn trace_name(path: &std::path::Path) -> String {
    let mut name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string());
    loop {
        let before = name.len();
        for ext in [".gz", ".csv", ".pickle", ".pkl", ".log"] {
            if name.len() > ext.len() && name.ends_with(ext) {
                name.truncate(name.len() - ext.len());
            }
        }
        if name.len() == before {
            return name;
        }
    }
}
