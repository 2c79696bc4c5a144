//! Small helpers shared by the cache and the pool: cache-line padding and shard counts (the fast `u64`
//! hasher is gen-device's, `gen_device::hash`).

pub(crate) use gen_device::hash::{mix, U64Map};
use std::ops::{Deref, DerefMut};

/// Aligns its content to 128 bytes (two cache lines: the adjacent-line prefetcher pairs them), so
/// neighbouring shards' locks do not share a line.
#[derive(Default)]
#[repr(align(128))]
pub(crate) struct Padded<T>(pub(crate) T);

impl<T> Deref for Padded<T> {
    type Target = T;

    #[inline]
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T> DerefMut for Padded<T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        &mut self.0
    }
}

/// Number of shards for a requested count: 0 picks `default`; otherwise rounded up to a power of two
/// and clamped to `1..=1024`.
pub(crate) fn shard_count(requested: usize, default: usize) -> usize {
    let n = if requested == 0 { default } else { requested };
    n.clamp(1, 1024).next_power_of_two()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_count_is_a_clamped_power_of_two() {
        assert_eq!(shard_count(0, 16), 16);
        assert_eq!(shard_count(3, 16), 4);
        assert_eq!(shard_count(1, 16), 1);
        assert_eq!(shard_count(1 << 20, 16), 1024);
    }

    #[test]
    fn padded_is_aligned() {
        assert_eq!(std::mem::align_of::<Padded<u8>>(), 128);
    }
}
