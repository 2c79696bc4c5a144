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
    /// once). Entries at zero are removed.
    boundary: HashMap<u64, u32>,
    pages: u64,
}

impl PageTally {
    pub fn new(page: u64) -> Self {
        PageTally {
            page: page.max(1),
            boundary: HashMap::new(),
            pages: 0,
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
            let refs = self.boundary.entry(p).or_insert(0);
            if *refs == 0 {
                self.pages += 1;
            }
            *refs += 1;
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
            if let Some(refs) = self.boundary.get_mut(&p) {
                *refs -= 1;
                if *refs == 0 {
                    self.boundary.remove(&p);
                    self.pages -= 1;
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
        let mut t = PageTally::new(page);
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
        assert!(t.boundary.is_empty());
    }
}
