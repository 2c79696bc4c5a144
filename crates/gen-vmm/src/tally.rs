//! O(1) count of the pages a set of non-overlapping blocks touches.
//!
//! A page strictly inside a block (neither its first nor its last page) is covered by that block alone,
//! since live blocks never overlap; only a block's first and last page can be shared with a neighbour. So
//! the number of touched pages is `sum of interior pages + number of distinct boundary pages in use`, and
//! only boundary pages need a reference count. This mirrors, exactly, the references [`Region::commit`](crate::Region::commit) /
//! `Region::decommit` keep for a region this tier alone commits into, without an O(pages) scan.

use std::collections::HashMap;

/// Pages touched by live blocks of one region.
#[derive(Debug)]
pub struct PageTally {
    page: u64,
    /// References on first/last pages of live blocks (a block whose first and last page coincide counts
    /// once).
    boundary: Boundary,
    pages: u64,
}

#[derive(Debug)]
enum Boundary {
    /// Page index → references; entries at zero are removed.
    Sparse(HashMap<u64, u32>),
    /// References by page index over a range of known length: an index instead of a hash probe on every
    /// allocation and free. Zeroed memory from the OS: parts of the table never touched cost nothing.
    Dense(Vec<u32>),
}

impl PageTally {
    /// A tally for blocks anywhere (references kept in a hash map).
    pub fn new(page: u64) -> Self {
        PageTally {
            page: page.max(1),
            boundary: Boundary::Sparse(HashMap::new()),
            pages: 0,
        }
    }

    /// A tally for blocks within the first `pages` pages (a region of known length), with a direct
    /// table. A block past them is a caller bug: debug builds assert, release builds do not count its
    /// boundary pages.
    pub fn dense(page: u64, pages: u64) -> Self {
        PageTally {
            page: page.max(1),
            boundary: Boundary::Dense(vec![0; pages as usize]),
            pages: 0,
        }
    }

    /// The reference count of boundary page `p`, created at zero when absent.
    fn refs_mut(&mut self, p: u64) -> Option<&mut u32> {
        match &mut self.boundary {
            Boundary::Sparse(m) => Some(m.entry(p).or_insert(0)),
            Boundary::Dense(v) => {
                debug_assert!(
                    (p as usize) < v.len(),
                    "page {p} past the tally's {} pages",
                    v.len()
                );
                v.get_mut(p as usize)
            }
        }
    }

    /// Pages touched now.
    pub fn pages(&self) -> u64 {
        self.pages
    }

    fn span(&self, off: u64, len: u64) -> (u64, u64) {
        (off / self.page, (off + len - 1) / self.page)
    }

    /// Record a block `[off, off + len)` (`len > 0`).
    pub fn add(&mut self, off: u64, len: u64) {
        let (first, last) = self.span(off, len);
        self.pages += (last - first).saturating_sub(1);
        for p in [Some(first), (last != first).then_some(last)]
            .into_iter()
            .flatten()
        {
            let Some(refs) = self.refs_mut(p) else {
                continue;
            };
            *refs += 1;
            if *refs == 1 {
                self.pages += 1;
            }
        }
    }

    /// Forget a block recorded by [`PageTally::add`].
    pub fn remove(&mut self, off: u64, len: u64) {
        let (first, last) = self.span(off, len);
        self.pages -= (last - first).saturating_sub(1);
        for p in [Some(first), (last != first).then_some(last)]
            .into_iter()
            .flatten()
        {
            match &mut self.boundary {
                Boundary::Sparse(m) => {
                    if let Some(refs) = m.get_mut(&p) {
                        *refs -= 1;
                        if *refs == 0 {
                            m.remove(&p);
                            self.pages -= 1;
                        }
                    }
                }
                Boundary::Dense(v) => {
                    if let Some(refs) = v.get_mut(p as usize).filter(|r| **r > 0) {
                        *refs -= 1;
                        if *refs == 0 {
                            self.pages -= 1;
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn union(blocks: &[(u64, u64)], page: u64) -> u64 {
        let pages: BTreeSet<u64> = blocks
            .iter()
            .flat_map(|&(o, l)| o / page..=(o + l - 1) / page)
            .collect();
        pages.len() as u64
    }

    #[test]
    fn matches_the_union_of_pages() {
        let page = 4096;
        let blocks = [
            (0, 512),
            (512, 512),
            (1024, 8192),
            (9216, 512),
            (20480, 4096),
            (30000, 20000),
        ];
        for mut t in [PageTally::new(page), PageTally::dense(page, 64)] {
            for (i, &(o, l)) in blocks.iter().enumerate() {
                t.add(o, l);
                assert_eq!(t.pages(), union(&blocks[..=i], page), "after adding {i}");
            }
            let mut rest = blocks.to_vec();
            for i in [2, 0, 5, 1, 4, 3] {
                t.remove(blocks[i].0, blocks[i].1);
                rest.retain(|&b| b != blocks[i]);
                assert_eq!(t.pages(), union(&rest, page), "after removing {i}");
            }
            assert_eq!(t.pages(), 0);
            match &t.boundary {
                Boundary::Sparse(m) => assert!(m.is_empty()),
                Boundary::Dense(v) => assert!(v.iter().all(|&r| r == 0)),
            }
        }
    }
}
