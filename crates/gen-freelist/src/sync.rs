//! The one place where synchronisation primitives are imported.
//!
//! Under `--cfg loom` every atomic comes from [`loom`], so the model checker sees every load, store and
//! read-modify-write of the crate; otherwise the `std` atomics are used. The rest of the crate imports
//! atomics only from here.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU32, AtomicU64, Ordering};

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
