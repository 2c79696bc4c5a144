//! Size-class arithmetic.
//!
//! Classes start at [`MIN_CLASS`] (512 B) and are spaced `2^B` per doubling (`B` =
//! `log2(classes_per_doubling)`), never closer than 512 B: for a request `r` in `(2^k, 2^(k+1)]` the class
//! is `r` rounded up to a multiple of `step(k) = max(512, 2^k / 2^B)`. Every class size is therefore a
//! multiple of 512 (so every slot is 512-byte aligned), and the internal waste is bounded:
//!
//! ```text
//! class_size(r) - r  <  max(512, r / 2^B)
//! ```
//!
//! i.e. below 512 B for small requests and below `100 / 2^B` % of the request above `512 * 2^B` bytes
//! (25 % with the default 4 classes per doubling, 12.5 % with 8). Requests that are multiples of 512 B
//! (all of PyTorch's) up to `512 * 2^B` get an exact class.
//!
//! The lookup is arithmetic: the group `k` is the position of the highest set bit of `r - 1` (a
//! leading-zeros count), the index within the group a shift; a 64-entry table gives each group's first
//! class index. No search.

/// The smallest class size and the granularity of every class size.
pub const MIN_CLASS: u64 = 512;
const MIN_SHIFT: u32 = MIN_CLASS.trailing_zeros();

/// The size classes of one slab: ascending sizes from [`MIN_CLASS`] up to the class of `max_size`.
#[derive(Clone, Debug)]
pub struct SizeClasses {
    sizes: Box<[u64]>,
    /// `group_base[k]`: index of the first class of group `k` (requests in `(2^k, 2^(k+1)]`).
    group_base: [u32; 64],
    /// `log2(classes per doubling)`.
    b: u32,
    /// The largest class size (>= the configured `max_size`).
    max_class: u64,
}

impl SizeClasses {
    /// Classes from 512 B up to the class holding `max_size`, `classes_per_doubling` per power of two.
    ///
    /// Returns `None` when `classes_per_doubling` is not a power of two in `1..=64`, or `max_size` is
    /// zero or above 2^40.
    pub fn new(max_size: u64, classes_per_doubling: u32) -> Option<Self> {
        if !classes_per_doubling.is_power_of_two() || classes_per_doubling > 64 {
            return None;
        }
        if max_size == 0 || max_size > 1 << 40 {
            return None;
        }
        let b = classes_per_doubling.trailing_zeros();
        let mut sizes = vec![MIN_CLASS];
        let mut group_base = [0u32; 64];
        // Groups below MIN_SHIFT are all served by class 0.
        let mut k = MIN_SHIFT;
        while *sizes.last().expect("non-empty") < max_size {
            group_base[k as usize] = sizes.len() as u32;
            let step_shift = step_shift(k, b);
            let count = 1u64 << (k - step_shift);
            for j in 1..=count {
                sizes.push((1u64 << k) + (j << step_shift));
            }
            k += 1;
        }
        // Groups above the last one are never looked up (their requests exceed max_class).
        group_base[k as usize..].fill(sizes.len() as u32);
        let max_class = *sizes.last().expect("non-empty");
        // Trim classes above the class of max_size (the last group may overshoot).
        let mut s = SizeClasses {
            sizes: sizes.into_boxed_slice(),
            group_base,
            b,
            max_class,
        };
        let (last, last_size) = s.lookup(max_size).expect("max_size <= max_class");
        let mut v = s.sizes.into_vec();
        v.truncate(last + 1);
        s.sizes = v.into_boxed_slice();
        s.max_class = last_size;
        Some(s)
    }

    /// Number of classes.
    pub fn len(&self) -> usize {
        self.sizes.len()
    }

    /// Always false: there is at least the 512 B class.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Size of class `idx` (panics on an index `>= len()`; internal use only).
    #[inline]
    pub fn size(&self, idx: usize) -> u64 {
        self.sizes[idx]
    }

    /// All class sizes, ascending.
    pub fn sizes(&self) -> &[u64] {
        &self.sizes
    }

    /// The largest class size.
    pub fn max_class(&self) -> u64 {
        self.max_class
    }

    /// `log2(classes per doubling)`.
    pub fn doubling_shift(&self) -> u32 {
        self.b
    }

    /// The smallest class holding `size` bytes: `(index, class size)`, or `None` for 0 or a size above
    /// the largest class.
    #[inline]
    pub fn lookup(&self, size: u64) -> Option<(usize, u64)> {
        if size == 0 || size > self.max_class {
            return None;
        }
        if size <= MIN_CLASS {
            return Some((0, MIN_CLASS));
        }
        let r1 = size - 1;
        let k = 63 - r1.leading_zeros();
        let ss = step_shift(k, self.b);
        let j = (r1 - (1u64 << k)) >> ss;
        let idx = self.group_base[k as usize] as usize + j as usize;
        let cls = (1u64 << k) + ((j + 1) << ss);
        debug_assert_eq!(self.sizes.get(idx), Some(&cls));
        Some((idx, cls))
    }

    /// The documented waste bound for a request of `size` bytes: `class - size < waste_bound(size)`.
    pub fn waste_bound(&self, size: u64) -> u64 {
        MIN_CLASS.max(size >> self.b)
    }
}

#[inline]
fn step_shift(k: u32, b: u32) -> u32 {
    k.saturating_sub(b).max(MIN_SHIFT)
}

/// Exact division by a fixed 32-bit divisor (Lemire, Kaser, Kurz: "Faster remainder by direct
/// computation", 2019): `n / d` and `n % d == 0` for any `n < 2^32` with one multiplication each.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Divisor {
    m: u64,
}

impl Divisor {
    /// A divisor `d` in `2..2^32`.
    pub(crate) fn new(d: u64) -> Self {
        debug_assert!(d > 1 && d < 1 << 32);
        Divisor {
            m: (u64::MAX / d).wrapping_add(1),
        }
    }

    /// `n / d` for `n < 2^32`.
    #[inline]
    pub(crate) fn div(self, n: u32) -> u32 {
        ((self.m as u128 * n as u128) >> 64) as u32
    }

    /// `n % d == 0` for `n < 2^32`.
    #[inline]
    pub(crate) fn divides(self, n: u32) -> bool {
        (n as u64).wrapping_mul(self.m) < self.m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_classes_are_aligned_ascending_and_bounded() {
        for b in [1u32, 2, 4, 8, 16] {
            let c = SizeClasses::new(1 << 20, b).unwrap();
            assert_eq!(c.size(0), 512);
            assert_eq!(c.max_class(), 1 << 20);
            assert!(c.sizes().windows(2).all(|w| w[0] < w[1]));
            assert!(c.sizes().iter().all(|s| s % 512 == 0));
        }
        // 4 per doubling: 512, 1024, 1536, 2048, then 512-steps to 4096, then quarter steps.
        let c = SizeClasses::new(1 << 20, 4).unwrap();
        assert_eq!(
            &c.sizes()[..12],
            &[512, 1024, 1536, 2048, 2560, 3072, 3584, 4096, 5120, 6144, 7168, 8192]
        );
        assert_eq!(c.len(), 40);
    }

    #[test]
    fn lookup_is_the_smallest_class_that_fits_and_waste_is_bounded() {
        for b in [1u32, 2, 4, 8] {
            let max = 1u64 << 18;
            let c = SizeClasses::new(max, b).unwrap();
            let mut idx = 0usize;
            // Every size natively; under Miri a stride that still lands on both sides of each class edge
            // often enough (509 is prime, so it walks through every residue).
            for r in (1..=max).step_by(if cfg!(miri) { 509 } else { 1 }) {
                while c.size(idx) < r {
                    idx += 1;
                }
                let (i, s) = c.lookup(r).unwrap();
                assert_eq!((i, s), (idx, c.size(idx)), "r={r} b={b}");
                assert!(s - r < c.waste_bound(r), "r={r} s={s} b={b}");
                // Relative bound above 512 * 2^B: under 1/2^B of the request.
                if r > 512 * b as u64 {
                    assert!(((s - r) as f64) < r as f64 / b as f64, "r={r} b={b}");
                }
            }
            assert_eq!(c.lookup(0), None);
            assert_eq!(c.lookup(max + 1), None);
        }
    }

    #[test]
    fn waste_bound_is_tight_enough_to_fail() {
        // The worst case of 4 per doubling: one byte above a class boundary of group k >= 11.
        let c = SizeClasses::new(1 << 20, 4).unwrap();
        let r = (1u64 << 19) + 1;
        let (_, s) = c.lookup(r).unwrap();
        assert_eq!(s, (1 << 19) + (1 << 17));
        assert!(
            s - r >= r >> 3,
            "the bound for 8 per doubling must not hold for 4"
        );
    }

    #[test]
    fn lookup_of_large_values_above_the_max_is_none() {
        let c = SizeClasses::new(1 << 20, 4).unwrap();
        for r in [(1u64 << 20) + 1, 1 << 40, u64::MAX] {
            assert_eq!(c.lookup(r), None);
        }
    }

    #[test]
    fn max_size_between_classes_rounds_up() {
        let c = SizeClasses::new(3000, 4).unwrap();
        assert_eq!(c.max_class(), 3072);
        assert_eq!(c.lookup(3072), Some((c.len() - 1, 3072)));
        assert_eq!(c.lookup(3073), None);
        let c = SizeClasses::new(1, 4).unwrap();
        assert_eq!(c.sizes(), &[512]);
        assert_eq!(c.lookup(512), Some((0, 512)));
        assert_eq!(c.lookup(513), None);
    }

    #[test]
    fn bad_parameters_are_rejected() {
        assert!(SizeClasses::new(1 << 20, 3).is_none());
        assert!(SizeClasses::new(1 << 20, 0).is_none());
        assert!(SizeClasses::new(1 << 20, 128).is_none());
        assert!(SizeClasses::new(0, 4).is_none());
        assert!(SizeClasses::new((1 << 40) + 1, 4).is_none());
    }

    #[test]
    fn divisor_matches_hardware_division() {
        let ds = [
            2u64,
            3,
            512,
            1536,
            5120,
            7168,
            229_376,
            1 << 20,
            917_504,
            (1 << 32) - 1,
        ];
        let ns = [
            0u32,
            1,
            511,
            512,
            1535,
            1536,
            3072,
            65_535,
            1 << 30,
            u32::MAX - 1,
            u32::MAX,
        ];
        for &d in &ds {
            let dv = Divisor::new(d);
            for &n in &ns {
                assert_eq!(dv.div(n) as u64, n as u64 / d, "{n}/{d}");
                assert_eq!(dv.divides(n), n as u64 % d == 0, "{n}%{d}");
            }
            for i in 0..1000u64 {
                let n = (i * d).min(u32::MAX as u64) as u32;
                assert_eq!(dv.div(n) as u64, n as u64 / d);
                assert_eq!(dv.divides(n), n as u64 % d == 0);
                let n1 = n.saturating_add(1);
                assert_eq!(dv.divides(n1), n1 as u64 % d == 0);
            }
        }
    }
}
