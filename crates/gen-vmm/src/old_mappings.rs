//! Old mappings ("zombies") left at an address by a page move: made, reaped once their fence has
//! completed, or cleared at once when their address needs a page (see the crate docs, "Moving a page
//! without stopping the device" and "Moves undone").

use gen_device::{PhysHandle, StreamId};

use crate::page::RegionPages;
use crate::{Inner, PagePool, Settled, VmmError};

/// An old mapping left at an address by a move (see [`Page::zombie`]).
///
/// [`Page::zombie`]: crate::page::Page::zombie
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Zombie {
    /// Work queued before the move may still use the mapping: it may be unmapped once a fence of this
    /// epoch or later has completed (on `stream`, when set: see [`StreamFences`]).
    ///
    /// [`StreamFences`]: crate::fences::StreamFences
    pub(crate) epoch: u64,
    /// The stream whose fence covers the mapping's last users (several streams); `None`: the device-wide
    /// fences (one stream) or a synchronize.
    pub(crate) stream: Option<StreamId>,
    /// The physical page it maps (now owned by another address, cached, or mapped nowhere else).
    pub(crate) handle: PhysHandle,
}

/// Old mappings kept at least, with [`PagePoolConfig::keep_old_mappings`] (else as many as pages held).
///
/// [`PagePoolConfig::keep_old_mappings`]: crate::PagePoolConfig::keep_old_mappings
const MIN_OLD_MAPPINGS: u64 = 64;

impl PagePool {
    /// Unmap the zombie mappings whose fence has completed, oldest first: all of them (`all`, or without
    /// [`PagePoolConfig::keep_old_mappings`]), else only those past the number kept.
    ///
    /// [`PagePoolConfig::keep_old_mappings`]: crate::PagePoolConfig::keep_old_mappings
    pub(crate) fn reap_zombies(&self, g: &mut Inner, all: bool) -> Result<(), VmmError> {
        let keep = if all || !self.cfg.keep_old_mappings {
            0
        } else {
            g.stats.pages_held.max(MIN_OLD_MAPPINGS)
        };
        let mut live = g.stats.zombies;
        let mut ready = Vec::new();
        let mut seen = std::collections::HashSet::new();
        while live > keep {
            let Some(&(epoch, rid, pidx)) = g.zombies.front() else {
                break;
            };
            let stream = g.regions[rid as usize]
                .as_ref()
                .and_then(|r| r.pages[pidx as usize].zombie)
                .filter(|z| z.epoch == epoch)
                .and_then(|z| z.stream);
            if !Self::idle(g, stream, epoch) {
                break;
            }
            g.zombies.pop_front();
            // An address can be queued twice with one epoch (a zombie taken back, then made again
            // before any fence): count it once.
            if zombie_epoch(&g.regions, rid, pidx) == Some(epoch) && seen.insert((rid, pidx)) {
                ready.push((rid, pidx));
                live -= 1;
            }
        }
        // Entries of moves since undone stay queued until they reach the front: drop them when they
        // outnumber the live ones (kept mappings may never reach the front).
        if g.zombies.len() as u64 > 2 * g.stats.zombies + 64 {
            let Inner {
                zombies, regions, ..
            } = g;
            zombies.retain(|&(epoch, rid, pidx)| zombie_epoch(regions, rid, pidx) == Some(epoch));
        }
        self.unmap_zombies(g, ready)
    }

    /// Unmap the zombie mappings at `pages` (region, page), whose work is known complete; a run of
    /// consecutive pages per call. On failure they stay zombies, queued again.
    fn unmap_zombies(&self, g: &mut Inner, mut pages: Vec<(u32, u32)>) -> Result<(), VmmError> {
        pages.sort_unstable();
        pages.dedup();
        let mut first_err = None;
        let mut i = 0;
        while i < pages.len() {
            let (rid, p0) = pages[i];
            let mut j = i + 1;
            while j < pages.len() && pages[j] == (rid, p0 + (j - i) as u32) {
                j += 1;
            }
            let r = g.regions[rid as usize].as_mut().expect("registered region");
            let va = r.base + p0 as u64 * self.page;
            match self.device.unmap(va, (j - i) as u64 * self.page) {
                Ok(()) => {
                    for &(_, q) in &pages[i..j] {
                        r.pages[q as usize].zombie = None;
                    }
                    g.stats.unmaps += (j - i) as u64;
                    g.stats.zombies -= (j - i) as u64;
                }
                Err(e) => {
                    // Left as zombies (mapped, no handle): a later synchronize path retries them.
                    for &(_, q) in &pages[i..j] {
                        let z = r.pages[q as usize].zombie.expect("a zombie");
                        g.zombies.push_back((z.epoch, rid, q));
                    }
                    first_err.get_or_insert(VmmError::from(e));
                }
            }
            i = j;
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Make `(rid, pidx)` a zombie mapping of `handle`, which moves elsewhere (or back). `warm`: work
    /// queued before now may still use it (a fence recorded at the end of the commit covers it).
    pub(crate) fn make_zombie(
        g: &mut Inner,
        rid: u32,
        pidx: u32,
        handle: PhysHandle,
        how: Settled,
    ) {
        let (epoch, stream) = match how {
            Settled::Warm => {
                g.unfenced = true;
                (g.epoch, None)
            }
            Settled::Fenced { stream, epoch } => (epoch, Some(stream)),
            // Idle already: any completed epoch (a page is cold only once some fence has completed).
            Settled::Idle => (g.done_epoch.saturating_sub(1), None),
        };
        let r = g.regions[rid as usize].as_mut().expect("registered region");
        let p = &mut r.pages[pidx as usize];
        debug_assert!(p.handle.is_none() && p.zombie.is_none());
        p.zombie = Some(Zombie {
            epoch,
            stream,
            handle,
        });
        g.zombies.push_back((epoch, rid, pidx));
        g.stats.zombies += 1;
    }

    /// Make the zombie mapping under `(rid, pidx)` go now: waits for its fence (recording one first if
    /// none covers it yet), or synchronizes the device, then unmaps it with every other idle zombie.
    pub(crate) fn clear_zombie(
        &self,
        g: &mut Inner,
        rid: u32,
        pidx: u32,
        synced: &mut bool,
    ) -> Result<(), VmmError> {
        self.clear_zombies(g, rid, &[pidx], synced)
    }

    /// [`clear_zombie`](Self::clear_zombie) for several pages of region `rid` (ascending) at once: each
    /// waited for as there, then unmapped together — one driver call per run of consecutive pages
    /// (session 26: on an H100 an unmap costs ~22 µs for one page and ~15 µs a page in a run of 32; a
    /// commit clearing old mappings clears runs of 3 pages on average on bert_serve_4streams and of 15
    /// on random sizes).
    pub(crate) fn clear_zombies(
        &self,
        g: &mut Inner,
        rid: u32,
        pages: &[u32],
        synced: &mut bool,
    ) -> Result<(), VmmError> {
        for &pidx in pages {
            self.await_zombie(g, rid, pidx, synced)?;
        }
        self.reap_zombies(g, false)?;
        // Kept (keep_old_mappings) and idle now: these go.
        let left: Vec<(u32, u32)> = pages
            .iter()
            .filter(|&&p| zombie_epoch(&g.regions, rid, p).is_some())
            .map(|&p| (rid, p))
            .collect();
        if !left.is_empty() {
            self.unmap_zombies(g, left)?;
        }
        debug_assert!(
            pages
                .iter()
                .all(|&p| zombie_epoch(&g.regions, rid, p).is_none()),
            "an idle zombie is reaped"
        );
        Ok(())
    }

    /// Wait until nothing queued uses the zombie mapping under `(rid, pidx)` (if there is one): its
    /// fence, recorded first if none covers it yet, or a synchronize.
    fn await_zombie(
        &self,
        g: &mut Inner,
        rid: u32,
        pidx: u32,
        synced: &mut bool,
    ) -> Result<(), VmmError> {
        let (epoch, stream) = {
            let r = g.regions[rid as usize].as_ref().expect("registered region");
            match r.pages[pidx as usize].zombie {
                Some(z) => (z.epoch, z.stream),
                None => return Ok(()),
            }
        };
        self.poll_fences(g);
        if let Some(s) = stream.filter(|_| !Self::idle(g, stream, epoch)) {
            // Several streams: wait for the fence of the mapping's stream that covers it.
            let covering = g
                .stream_fences
                .iter()
                .find(|sf| sf.stream == s)
                .and_then(|sf| sf.fences.iter().find(|&&(e, _)| e >= epoch).copied());
            let covering = match covering {
                Some((_, ev)) => Some(ev),
                // No fence of `s` covers it yet: record one (a synchronize if that fails).
                None => self.fence_on(g, s, epoch).ok().map(|(ev, _)| ev),
            };
            match covering {
                Some(ev) => {
                    self.device.event_synchronize(ev)?;
                    g.stats.syncs += 1;
                    self.poll_fences(g);
                }
                None => self.sync_all(g, synced)?,
            }
            if !Self::idle(g, stream, epoch) {
                self.sync_all(g, synced)?;
            }
        } else if epoch >= g.done_epoch && stream.is_none() {
            if epoch >= g.epoch && !self.record_fence(g) {
                self.sync_all(g, synced)?;
            }
            // Wait for the oldest fences up to the one covering this zombie.
            while epoch >= g.done_epoch {
                let Some(&(_, ev)) = g.fences.front() else {
                    self.sync_all(g, synced)?;
                    break;
                };
                self.device.event_synchronize(ev)?;
                Self::retire_oldest_fence(g);
                g.stats.syncs += 1;
            }
        }
        Ok(())
    }
}

/// The old mapping left at page `pidx` of region `rid` (registered), if any.
pub(crate) fn zombie_at(g: &Inner, rid: u32, pidx: u32) -> Option<Zombie> {
    g.regions[rid as usize]
        .as_ref()
        .expect("registered region")
        .pages[pidx as usize]
        .zombie
}

/// The epoch of the zombie mapping at `(rid, pidx)`, if there is one (`None` too for a dropped region).
pub(crate) fn zombie_epoch(regions: &[Option<RegionPages>], rid: u32, pidx: u32) -> Option<u64> {
    regions
        .get(rid as usize)
        .and_then(Option::as_ref)
        .and_then(|r| r.pages[pidx as usize].zombie)
        .map(|z| z.epoch)
}
