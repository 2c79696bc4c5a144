//! The crate's tests: unit tests per type, proptest models, multi-thread stress tests (all `not(loom)`),
//! and loom models (`--cfg loom`).

#[cfg(loom)]
mod loom_models;
#[cfg(not(loom))]
mod properties;
#[cfg(not(loom))]
mod stress;
#[cfg(not(loom))]
mod unit;

/// Drains `list` with `pop`, returning the slots in pop order.
#[cfg(not(loom))]
fn drain(list: &crate::FreeList) -> Vec<u32> {
    std::iter::from_fn(|| list.pop()).collect()
}

/// Sorts `v` and checks it is exactly `0..n`.
#[cfg(test)]
#[track_caller]
fn assert_permutation(mut v: Vec<u32>, n: usize) {
    v.sort_unstable();
    let want: Vec<u32> = (0..n as u32).collect();
    assert_eq!(v, want, "every slot exactly once");
}
