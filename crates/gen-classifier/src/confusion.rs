//! The confusion matrix of predictions against observed lifetimes.

use crate::Lifetime;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

/// Counts and bytes of scored allocations, indexed `[predicted][actual]` by [`Lifetime::index`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Confusion {
    /// Allocation counts, `[predicted][actual]`.
    pub counts: [[u64; 3]; 3],
    /// Allocated bytes, `[predicted][actual]`.
    pub bytes: [[u64; 3]; 3],
}

fn ratio(num: u64, den: u64) -> f64 {
    if den == 0 {
        0.0
    } else {
        num as f64 / den as f64
    }
}

impl Confusion {
    /// Number of scored allocations.
    pub fn total_count(&self) -> u64 {
        self.counts.iter().flatten().sum()
    }
    /// Bytes of scored allocations.
    pub fn total_bytes(&self) -> u64 {
        self.bytes.iter().flatten().sum()
    }
    /// Fraction of scored allocations predicted correctly (0.0 when nothing was scored).
    pub fn accuracy_count(&self) -> f64 {
        ratio((0..3).map(|i| self.counts[i][i]).sum(), self.total_count())
    }
    /// Fraction of scored bytes predicted correctly (0.0 when nothing was scored).
    pub fn accuracy_bytes(&self) -> f64 {
        ratio((0..3).map(|i| self.bytes[i][i]).sum(), self.total_bytes())
    }
    /// Share of scored bytes whose observed lifetime is `actual`.
    pub fn byte_share(&self, actual: Lifetime) -> f64 {
        let a = actual.index();
        ratio((0..3).map(|p| self.bytes[p][a]).sum(), self.total_bytes())
    }
    /// Share of scored allocations whose observed lifetime is `actual`.
    pub fn count_share(&self, actual: Lifetime) -> f64 {
        let a = actual.index();
        ratio((0..3).map(|p| self.counts[p][a]).sum(), self.total_count())
    }
    /// Of the allocations that were actually `c`, the fraction predicted `c` (by count).
    pub fn recall(&self, c: Lifetime) -> f64 {
        let a = c.index();
        ratio(self.counts[a][a], (0..3).map(|p| self.counts[p][a]).sum())
    }
    /// Of the allocations predicted `c`, the fraction that actually were `c` (by count).
    pub fn precision(&self, c: Lifetime) -> f64 {
        let p = c.index();
        ratio(self.counts[p][p], self.counts[p].iter().sum())
    }
}

impl fmt::Display for Confusion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "predicted \\ actual      Short            Mid           Long   (count | GiB)"
        )?;
        for p in Lifetime::ALL {
            write!(f, "{:>18}", format!("{p:?}"))?;
            for a in Lifetime::ALL {
                write!(f, " {:>14}", self.counts[p.index()][a.index()])?;
            }
            write!(f, "  |")?;
            for a in Lifetime::ALL {
                let gib = self.bytes[p.index()][a.index()] as f64 / (1u64 << 30) as f64;
                write!(f, " {gib:>9.2}")?;
            }
            writeln!(f)?;
        }
        Ok(())
    }
}

/// Shared atomic accumulator behind [`Confusion`].
#[derive(Debug, Default)]
#[repr(align(64))]
pub(crate) struct AtomicConfusion {
    /// Per (predicted, actual): the count and the bytes side by side, so a free touches one cache line
    /// (16-byte cells in a 64-byte-aligned table never straddle two).
    cells: [[[AtomicU64; 2]; 3]; 3],
}

impl AtomicConfusion {
    pub(crate) fn add(&self, predicted: Lifetime, actual: Lifetime, size: u64) {
        let cell = &self.cells[predicted.index()][actual.index()];
        cell[0].fetch_add(1, Ordering::Relaxed);
        cell[1].fetch_add(size, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> Confusion {
        let mut c = Confusion::default();
        for p in 0..3 {
            for a in 0..3 {
                c.counts[p][a] = self.cells[p][a][0].load(Ordering::Relaxed);
                c.bytes[p][a] = self.cells[p][a][1].load(Ordering::Relaxed);
            }
        }
        c
    }
}
