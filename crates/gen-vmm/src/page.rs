//! A page's state: what every commit and decommit reads ([`PageHot`], eight to a cache line), the rest
//! ([`Page`]), a region's pages ([`RegionPages`]), and the branch-free steps over runs of pages that the
//! commit and decommit walks take.

use gen_device::{DevicePtr, PhysHandle, StreamId};

use crate::old_mappings::Zombie;

/// What every commit and decommit reads and writes of a page, eight pages to a cache line (the rest is
/// in [`Page`]). A training loop's steady state revives and frees the same pages on each large block's
/// allocation and free (ResNet-50: ~6 pages per allocation): with the page's 48 bytes in one struct that
/// walk touched a line per page or so; inside PyTorch each is a likely miss.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct PageHot {
    pub(crate) refs: u32,
    /// Bit 0: a physical page is mapped here (`Page::handle` is `Some`). Bits 1-31: the fence epoch in
    /// force when the page last became free (see [`Inner::epoch`]), modulo 2^31 — see [`PageHot::warm`].
    ///
    /// [`Inner::epoch`]: crate::Inner::epoch
    word: u32,
}

impl PageHot {
    #[inline]
    pub(crate) fn backed(self) -> bool {
        self.word & 1 != 0
    }

    #[inline]
    pub(crate) fn set_backed(&mut self, backed: bool) {
        self.word = (self.word & !1) | u32::from(backed);
    }

    #[inline]
    pub(crate) fn set_freed(&mut self, epoch: u64) {
        self.word = (self.word & 1) | ((epoch as u32) << 1);
    }

    /// The full epoch the page was last freed at, given the pool's epoch `now` (the page keeps it modulo
    /// 2^31; exact for a page freed within the last 2^31 fences, which every warm page is).
    #[inline]
    pub(crate) fn freed_epoch(self, now: u64) -> u64 {
        let m = u64::from(self.word >> 1);
        let back = (now & 0x7FFF_FFFF).wrapping_sub(m) & 0x7FFF_FFFF;
        now.saturating_sub(back)
    }

    /// Whether the page was freed at an epoch ≥ `done_epoch` (its last users may still run). The epoch is
    /// kept modulo 2^31 and compared within a window of 2^30 fences: a page freed more than 2^30 fences
    /// before `done_epoch` reads as warm, the safe side (it waits for a fence or a synchronize before it
    /// moves); a warm page is at most [`MAX_EPOCH_LAG`] ahead.
    ///
    /// [`MAX_EPOCH_LAG`]: crate::MAX_EPOCH_LAG
    #[inline]
    pub(crate) fn warm(self, done_epoch: u64) -> bool {
        let freed = self.word >> 1;
        let done = (done_epoch as u32) & (u32::MAX >> 1);
        (freed.wrapping_sub(done) & (u32::MAX >> 1)) < (1 << 30)
    }
}

/// The rest of a page's state (see [`PageHot`]).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Page {
    pub(crate) handle: Option<PhysHandle>,
    /// Regions of no stream of their own (the slab's): the streams whose work used the page's freed
    /// bytes since it was last idle, a bit per entry of [`Inner::stream_fences`] ([`Region::decommit_for`]),
    /// [`UNKNOWN_STREAM`] for a free with no stream. 0: none.
    ///
    /// [`Inner::stream_fences`]: crate::Inner::stream_fences
    /// [`Region::decommit_for`]: crate::Region::decommit_for
    /// [`UNKNOWN_STREAM`]: crate::UNKNOWN_STREAM
    pub(crate) freed_on: u64,
    /// The address still maps a physical page that a move gave to another address (a *zombie*
    /// mapping); the page has no handle of its own meanwhile.
    pub(crate) zombie: Option<Zombie>,
}

pub(crate) struct RegionPages {
    pub(crate) name: &'static str,
    /// The stream all work on this region's blocks runs on, when its owner says so
    /// ([`Region::set_stream`]): with several streams, a page freed here and moved to another region is
    /// ordered after this stream's work by an event instead of a device synchronize.
    ///
    /// [`Region::set_stream`]: crate::Region::set_stream
    pub(crate) stream: Option<StreamId>,
    pub(crate) base: DevicePtr,
    pub(crate) pages: Vec<Page>,
    pub(crate) hot: Vec<PageHot>,
    /// Pages with at least one reference.
    pub(crate) in_use: u64,
}

/// If every page of `hot` is mapped and referenced once, drop that reference and stamp each as freed at
/// `epoch` (as the general walk would, page by page) and return `true`; otherwise change nothing and
/// return `false`. Branch-free over the pages, so both loops vectorize.
#[inline]
pub(crate) fn release_sole(hot: &mut [PageHot], epoch: u64) -> bool {
    if !hot
        .iter()
        .fold(true, |ok, p| ok & (p.refs == 1) & p.backed())
    {
        return false;
    }
    let freed = PageHot {
        refs: 0,
        word: 1 | ((epoch as u32) << 1),
    };
    hot.fill(freed);
    true
}

/// If every page of `hot` is mapped and unreferenced, reference each once and return `true`; otherwise
/// change nothing and return `false` (see [`release_sole`]).
#[inline]
pub(crate) fn revive_sole(hot: &mut [PageHot]) -> bool {
    if !hot
        .iter()
        .fold(true, |ok, p| ok & (p.refs == 0) & p.backed())
    {
        return false;
    }
    for p in hot {
        p.refs = 1;
    }
    true
}

#[cfg(test)]
mod page_hot_tests {
    use super::PageHot;

    #[test]
    fn warm_compares_epochs_across_the_31_bit_wrap() {
        let mut p = PageHot::default();
        p.set_backed(true);
        for base in [
            0u64,
            5,
            (1 << 31) - 3,
            (1 << 31) + 7,
            u64::from(u32::MAX) - 1,
            1 << 40,
        ] {
            p.set_freed(base);
            assert!(p.backed(), "the epoch leaves the mapped bit alone");
            // Freed at or after the completed fences: warm.
            assert!(p.warm(base), "{base}: freed at done_epoch");
            assert!(
                p.warm(base.saturating_sub(3)),
                "{base}: freed after done_epoch"
            );
            assert!(p.warm(base.saturating_sub(257)), "{base}: MAX_FENCES ahead");
            // Freed before them: cold.
            assert!(!p.warm(base + 1), "{base}: one fence later");
            assert!(!p.warm(base + 1_000_000), "{base}: long ago");
        }
        p.set_backed(false);
        p.set_freed(12);
        assert!(!p.backed() && p.warm(12) && !p.warm(13));
    }
}
