//! A fast hasher for maps keyed by one `u64` — device addresses, sizes, physical-memory handles — shared
//! by the crates above the device seam (gen-vmm's page owners, gen-stream's caches and pools).

use std::hash::{BuildHasher, Hasher};

/// Odd 64-bit constant (2^64 / golden ratio) for multiplicative hashing.
const K: u64 = 0x9E37_79B9_7F4A_7C15;

/// Mixes a 64-bit key with a folded 128-bit multiply: both the high bits (hashbrown's control bytes)
/// and the low bits (its bucket index, our shard index) depend on every input bit, so keys that are
/// multiples of 512 (sizes) or of 256 (device addresses) still spread.
#[inline]
pub fn mix(x: u64) -> u64 {
    let m = u128::from(x ^ K).wrapping_mul(u128::from(K));
    // Truncations are the point of the fold: the low and high halves of the product.
    (m as u64) ^ ((m >> 64) as u64)
}

/// A [`Hasher`] for maps keyed by one `u64` (sizes, device addresses). SipHash costs ~20 ns a lookup,
/// a third of the whole per-operation budget; this costs ~1 ns and keys are not attacker-chosen.
#[derive(Clone, Copy, Default)]
pub struct U64Hasher(u64);

impl Hasher for U64Hasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }

    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        // Only reached for non-u64 keys (none in this crate); stay correct anyway.
        for &b in bytes {
            self.0 = mix(self.0 ^ u64::from(b));
        }
    }

    #[inline]
    fn write_u64(&mut self, x: u64) {
        self.0 = mix(self.0 ^ x);
    }
}

/// [`BuildHasher`] for [`U64Hasher`].
#[derive(Clone, Copy, Default)]
pub struct BuildU64;

impl BuildHasher for BuildU64 {
    type Hasher = U64Hasher;

    #[inline]
    fn build_hasher(&self) -> U64Hasher {
        U64Hasher(0)
    }
}

/// A `HashMap` keyed by `u64` with the fast hasher.
pub type U64Map<V> = std::collections::HashMap<u64, V, BuildU64>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn mix_spreads_aligned_keys_over_low_bits() {
        // Sizes that are multiples of 512: the low 4 bits of the hash must take every value.
        let low: HashSet<u64> = (1..=256u64).map(|i| mix(i * 512) & 15).collect();
        assert_eq!(low.len(), 16);
        // And high bits too.
        let high: HashSet<u64> = (1..=256u64).map(|i| mix(i * 512) >> 60).collect();
        assert_eq!(high.len(), 16);
    }

    #[test]
    fn a_map_keyed_by_handles_works() {
        let mut m: U64Map<u32> = U64Map::default();
        for i in 0..1000u64 {
            m.insert(0x7f00_0000_0000 + i * (2 << 20), i as u32);
        }
        assert_eq!(m.get(&(0x7f00_0000_0000 + 7 * (2 << 20))), Some(&7));
        assert_eq!(m.len(), 1000);
    }
}
