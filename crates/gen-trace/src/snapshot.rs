//! PyTorch memory snapshots: the pickle `torch.cuda.memory._dump_snapshot` writes.
//!
//! A snapshot is a dict; its `device_traces` entry is a list (one per device) of lists of event dicts
//! with `action`, `addr`, `size`, `stream`, `time_us` and `frames` (a list of dicts with `filename`,
//! `line`, `name`, innermost first). Of the actions, `alloc` and `free_completed` (the block may be
//! reused from here on) become events; `free_requested`, `segment_*`, `snapshot`, `oom` and any
//! other action are skipped. One [`Trace`] is made per device that has events.
//!
//! Recording usually starts in the middle of a program (and the ring buffer of `max_entries` drops the
//! oldest events), so a `free_completed` of a block allocated before the first recorded event is
//! dropped, not an error ([`UnknownFree::Skip`]). Everything else is validated as in the CSV reader.

use std::collections::BTreeMap;
use std::io::Read;

use serde_pickle::{DeOptions, HashableValue, Value};

use crate::site::{site_hash, Frame};
use crate::trace::{Event, EventKind, Trace, TraceBuilder, UnknownFree};
use crate::TraceError;

type Dict = BTreeMap<HashableValue, Value>;

fn get<'a>(d: &'a Dict, key: &str) -> Option<&'a Value> {
    d.get(&HashableValue::String(key.to_owned()))
}

fn as_u64(v: &Value) -> Option<u64> {
    match v {
        Value::I64(i) => u64::try_from(*i).ok(),
        Value::Bool(b) => Some(u64::from(*b)),
        _ => None,
    }
}

fn as_str(v: &Value) -> Option<&str> {
    match v {
        Value::String(s) => Some(s),
        _ => None,
    }
}

/// Reads a snapshot pickle from `r` (plain, not gzip'd; [`load_reader`](crate::load_reader) detects
/// gzip). Traces are named `name` when the snapshot has one device, else `name:devN`.
pub fn read_snapshot(file: &str, name: &str, r: impl Read) -> Result<Vec<Trace>, TraceError> {
    let opts = DeOptions::new()
        .replace_unresolved_globals()
        .replace_recursive_structures();
    let root = serde_pickle::value_from_reader(r, opts)
        .map_err(|e| TraceError::new(file, 0, None, format!("not a readable pickle: {e}")))?;
    let not_snapshot = |what: &str| {
        TraceError::new(
            file,
            0,
            None,
            format!("not a PyTorch memory snapshot: {what}"),
        )
    };
    let Value::Dict(root) = root else {
        return Err(not_snapshot("the pickle is not a dict"));
    };
    let Some(Value::List(devices)) = get(&root, "device_traces") else {
        return Err(not_snapshot("no `device_traces` list"));
    };
    let mut traces = Vec::new();
    for (dev, events) in devices.iter().enumerate() {
        let Value::List(events) = events else {
            return Err(not_snapshot(&format!("device_traces[{dev}] is not a list")));
        };
        if events.is_empty() && devices.len() > 1 {
            continue;
        }
        let tname = if devices.len() == 1 {
            name.to_owned()
        } else {
            format!("{name}:dev{dev}")
        };
        traces.push(read_device(file, &tname, dev, events)?);
    }
    Ok(traces)
}

fn read_device(file: &str, name: &str, dev: usize, events: &[Value]) -> Result<Trace, TraceError> {
    let mut b = TraceBuilder::new(file).unknown_free(UnknownFree::Skip);
    b.reserve(events.len());
    let mut frames = Vec::new();
    for (i, ev) in events.iter().enumerate() {
        let line = i as u64 + 1;
        let err = |field: Option<&str>, msg: String| {
            TraceError::new(file, line, field, format!("device {dev} event {i}: {msg}"))
        };
        let Value::Dict(d) = ev else {
            return Err(err(None, "not a dict".into()));
        };
        let action = get(d, "action")
            .and_then(as_str)
            .ok_or_else(|| err(Some("action"), "no `action` string".into()))?;
        let kind = match action {
            "alloc" => EventKind::Alloc,
            "free_completed" => EventKind::Free,
            _ => continue,
        };
        let int = |key: &str, required: bool| -> Result<u64, TraceError> {
            match get(d, key) {
                Some(v) => as_u64(v).ok_or_else(|| {
                    err(
                        Some(key),
                        format!("`{key}` is not a non-negative integer: {v}"),
                    )
                }),
                None if required => Err(err(Some(key), format!("no `{key}`"))),
                None => Ok(0),
            }
        };
        let site = if kind == EventKind::Alloc {
            frames.clear();
            let mut unresolved = false;
            if let Some(Value::List(fs)) = get(d, "frames") {
                for f in fs.iter().take(crate::site::SITE_FRAMES) {
                    let f = match f {
                        Value::Dict(f) => f,
                        // serde-pickle 1.2 turns a memoized object that the pickle shares between
                        // events (PyTorch 2.11 reuses frame dicts) into `None` once its reference
                        // count, which cloning a containing list does not raise, runs out. The
                        // frame is real but unreadable: the site is unknown (0), not wrong.
                        Value::None => {
                            unresolved = true;
                            break;
                        }
                        other => {
                            return Err(err(
                                Some("frames"),
                                format!("a frame is not a dict: {other:?}"),
                            ))
                        }
                    };
                    frames.push(Frame {
                        filename: get(f, "filename").and_then(as_str).unwrap_or("").to_owned(),
                        line: match get(f, "line") {
                            Some(Value::I64(l)) => *l,
                            _ => 0,
                        },
                        name: get(f, "name").and_then(as_str).unwrap_or("").to_owned(),
                    });
                    // The same loss can hit a frame's fields (strings shared between frames).
                    if !matches!(get(f, "filename"), Some(Value::String(_)))
                        || !matches!(get(f, "name"), Some(Value::String(_)))
                        || !matches!(get(f, "line"), Some(Value::I64(_)))
                    {
                        unresolved = true;
                        break;
                    }
                }
            }
            if unresolved {
                0
            } else {
                site_hash(&frames)
            }
        } else {
            0
        };
        b.push(
            Event {
                t_us: int("time_us", false)?,
                kind,
                addr: int("addr", true)?,
                size: int("size", true)?,
                stream: int("stream", false)?,
                site,
            },
            line,
        )?;
    }
    Ok(b.finish(name))
}
