//! The commit and decommit paths: pages revived in place, backed from a cached handle, an old mapping,
//! a move or a new page; references dropped, and pages left free join the free set.

use std::sync::atomic::Ordering::Relaxed;

use gen_device::{PhysHandle, StreamId};

use crate::old_mappings::{zombie_at, zombie_epoch};
use crate::page::{release_sole, revive_sole};
use crate::{pop_free_mapped, Inner, PagePool, Settled, VmmError, UNKNOWN_STREAM};

impl PagePool {
    /// Commit pages `first..=last` of region `rid`; returns the region's pages in use after it.
    /// `revivals`: with a `target`, order it after the streams that freed pages revived in place (a tier
    /// that orders the reuse of its bytes itself passes false).
    pub(crate) fn commit(
        &self,
        rid: u32,
        first: u64,
        last: u64,
        grow: bool,
        target: Option<StreamId>,
        revivals: bool,
    ) -> Result<(u64, bool), VmmError> {
        let mut g = self.inner.lock();
        g.commit_ordered = false;
        // The pages the last decommit left, committed again by the same region (a block freed and its
        // range cut again — a loop's temporary buffer, a KV cache grown into its old place): their
        // references never drop, so neither walk happens and the pages never visit the free set. The
        // state after is the decommit's and this commit's — the same references, in-use counts and
        // peaks (the pages were mapped and referenced throughout; a deferral needs a region of a stream
        // of its own, whose revivals need no ordering). Any other deferred decommit is applied first.
        if g.deferred == Some((rid, first, last)) {
            g.deferred = None;
            g.stats.deferrals_cancelled += 1;
            let in_use = g.regions[rid as usize]
                .as_ref()
                .expect("registered region")
                .in_use;
            return Ok((in_use, false));
        }
        self.apply_deferred(&mut g);
        // Several streams, a region of no stream of its own (the slab's), committed for `target`: a page
        // revived in place whose last block was freed on another stream still warm there is reused
        // only after `target` waits on that stream's fence.
        if let Some(t) = target.filter(|_| revivals && g.fence_stream.is_none()) {
            if g.regions[rid as usize]
                .as_ref()
                .is_some_and(|r| r.stream.is_none())
            {
                self.order_revivals(&mut g, rid, first, last, t)?;
            }
        }
        g.committing_for = target.or(g.regions[rid as usize].as_ref().and_then(|r| r.stream));
        // The common case of a training loop's steady state: every page is backed already (in use, or
        // free and still mapped right here), so the commit only takes references — one walk, no driver
        // call, nothing to plan.
        {
            let r = g.regions[rid as usize].as_ref().expect("registered region");
            // A fold, not `all`: no early exit, so it vectorizes (the warm case reads every page).
            if r.hot[first as usize..=last as usize]
                .iter()
                .fold(true, |ok, p| ok & p.backed())
            {
                let unbacked = take_backed(&mut g, rid, first, last);
                debug_assert!(unbacked.is_empty());
                let in_use = g.regions[rid as usize]
                    .as_ref()
                    .expect("registered region")
                    .in_use;
                return Ok((in_use, g.commit_ordered));
            }
        }
        if g.sleep.is_some() {
            return Err(VmmError::Asleep);
        }
        // Plan: pages that need a physical page mapped under them.
        let need = {
            let r = g.regions[rid as usize].as_ref().expect("registered region");
            r.hot[first as usize..=last as usize]
                .iter()
                .filter(|p| !p.backed())
                .count() as u64
        };
        let own_free_mapped = {
            let r = g.regions[rid as usize].as_ref().expect("registered region");
            r.hot[first as usize..=last as usize]
                .iter()
                .filter(|p| p.refs == 0 && p.backed())
                .count() as u64
        };
        let spare = g.free_handles.len() as u64 + (g.free_mapped.len() - own_free_mapped);
        let to_create = need.saturating_sub(spare);
        if to_create > 0 {
            if !grow {
                return Err(VmmError::WouldGrow { pages: to_create });
            }
            let held = g.stats.pages_held * self.page;
            if let Some(limit) = self.cfg.limit {
                if held + to_create * self.page > limit {
                    return Err(VmmError::OutOfMemory {
                        requested: to_create * self.page,
                        reserved: held,
                        limit: Some(limit),
                    });
                }
            }
        }
        // Steals unmap pages whose last block may have been freed with work still queued: the first
        // steal of this commit synchronizes the device once.
        let mut synced = false;
        // Pass 1: pages already backed (in use, or free-mapped right here) take a reference with no
        // driver call. Doing these first keeps pass 2 from stealing a page this very range will revive.
        let unbacked = take_backed(&mut g, rid, first, last);
        // Pass 2: back the rest. First learn which fences completed and drop the old mappings they free.
        let stay = self.pages_stay();
        if !unbacked.is_empty() && !stay && (!g.fences.is_empty() || !g.zombies.is_empty()) {
            self.poll_fences(&mut g);
            if let Err(e) = self.reap_zombies(&mut g, false) {
                log::error!("gen-vmm: unmapping old mappings: {e}");
            }
        }
        let steals_before = g.stats.steals;
        let t0 = (!unbacked.is_empty()).then(std::time::Instant::now);
        let res = self.back_pages(&mut g, rid, first, last, &unbacked, grow, &mut synced);
        if let Some(t0) = t0.filter(|_| g.stats.steals != steals_before) {
            g.stats.move_ns += t0.elapsed().as_nanos() as u64;
        }
        if self.capturing() {
            // A fence on the capturing stream would join the graph: the first commit after the
            // capture records it (the old mappings stay warm until then).
        } else if std::mem::take(&mut g.unfenced) && !self.record_fence(&mut g) {
            // No fence: the zombies wait for the next synchronize (release, region drop, or a commit that
            // needs one of their addresses).
            log::debug!("gen-vmm: no fence for the old mappings of this commit");
        }
        res.map(|()| {
            let in_use = g.regions[rid as usize]
                .as_ref()
                .expect("registered region")
                .in_use;
            (in_use, g.commit_ordered)
        })
    }

    /// See [`PagePool::commit`]: order `target` after the streams whose work used the bytes of pages
    /// `first..=last` of region `rid` freed since the page was last idle (a fence of each, waited on by
    /// `target`). A page freed with no stream known synchronizes the device.
    fn order_revivals(
        &self,
        g: &mut Inner,
        rid: u32,
        first: u64,
        last: u64,
        target: StreamId,
    ) -> Result<(), VmmError> {
        let mut after: Vec<(StreamId, u64)> = Vec::new();
        let mut unknown = false;
        for q in first..=last {
            let (hot, mask) = {
                let r = g.regions[rid as usize].as_ref().expect("registered region");
                (r.hot[q as usize], r.pages[q as usize].freed_on)
            };
            if mask == 0 {
                continue;
            }
            if !hot.warm(g.done_epoch) {
                // Idle since (a synchronize or the one-stream fences passed it): forget the streams.
                g.regions[rid as usize]
                    .as_mut()
                    .expect("registered region")
                    .pages[q as usize]
                    .freed_on = 0;
                continue;
            }
            let e = hot.freed_epoch(g.epoch);
            match Self::mask_streams(g, mask) {
                None => unknown = true,
                Some(streams) => {
                    for s in streams {
                        match after.iter_mut().find(|(x, _)| *x == s) {
                            Some((_, m)) => *m = (*m).max(e),
                            None => after.push((s, e)),
                        }
                    }
                }
            }
        }
        let capturing = self.capturing();
        if unknown {
            if capturing {
                return Err(VmmError::Capturing("a synchronize before reusing a page"));
            }
            let mut synced = false;
            self.sync_all(g, &mut synced)?;
            return Ok(());
        }
        for (s, e) in after {
            if Self::idle(g, Some(s), e) {
                continue;
            }
            // Still in use by queued work of `s`: the range is `target`'s alone from now on.
            g.commit_ordered = true;
            if s == target {
                continue;
            }
            if capturing {
                // The wait (and a fence on `s`) would join the graph.
                return Err(VmmError::Capturing(
                    "ordering a stream after another's queued work",
                ));
            }
            self.wait_fence(g, target, s, e)?;
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn back_pages(
        &self,
        g: &mut Inner,
        rid: u32,
        first: u64,
        last: u64,
        unbacked: &[u32],
        grow: bool,
        synced: &mut bool,
    ) -> Result<(), VmmError> {
        // Take a physical page for each unbacked page first (counted in use as it is taken, so the
        // headroom rule sees the commit grow), then map them in runs of consecutive pages: one access
        // call per run instead of one per page. A page taken back through its old mapping here needs
        // no map: it is committed at once.
        // Pages to map (`got_at[k]` gets `got[k]`), in `unbacked` order.
        let mut got_at: Vec<u32> = Vec::with_capacity(unbacked.len());
        let mut got: Vec<PhysHandle> = Vec::with_capacity(unbacked.len());
        let mut returned: Vec<u32> = Vec::new();
        let mut fail = None;
        // Old mappings at these addresses whose pages are in use elsewhere must go before anything is
        // mapped here (`take_page` would clear each alone): cleared together first, one unmap a run.
        // Not while pages stay (`take_page` refuses those with a typed error).
        if !self.pages_stay() {
            let clear = zombies_to_clear(g, rid, unbacked);
            if clear.len() > 1 {
                // A failure rolls the commit back below, as one in the loop does.
                fail = self.clear_zombies(g, rid, &clear, synced).err();
            }
        }
        let to_take = if fail.is_none() { unbacked } else { &[] };
        for &pidx in to_take {
            match self.take_page(g, rid, pidx, grow, synced) {
                Ok(Taken::Mapped(h)) => {
                    let r = g.regions[rid as usize].as_mut().expect("registered region");
                    r.pages[pidx as usize].handle = Some(h);
                    // Taken back through its old mapping, which never left this address: work queued
                    // on the address before the move may still run, so the streams that freed bytes
                    // here stay on it until it is idle (the commit ordered itself after them above;
                    // the next one, of other bytes of the page for another stream, must too — the
                    // slab's chunks share pages).
                    r.hot[pidx as usize].refs = 1;
                    r.hot[pidx as usize].set_backed(true);
                    r.in_use += 1;
                    g.owners.insert(h.0, (rid, pidx));
                    returned.push(pidx);
                }
                Ok(Taken::Unmapped(h)) => {
                    got_at.push(pidx);
                    got.push(h);
                }
                Err(e) => {
                    fail = Some(e);
                    break;
                }
            }
            if fail.is_none() {
                g.stats.pages_in_use += 1;
                g.stats.pages_in_use_peak = g.stats.pages_in_use_peak.max(g.stats.pages_in_use);
            }
        }
        let mut mapped = 0;
        if fail.is_none() {
            let base = g.regions[rid as usize]
                .as_ref()
                .expect("registered region")
                .base;
            let mut i = 0;
            while i < got.len() {
                let mut j = i + 1;
                while j < got.len() && got_at[j] == got_at[j - 1] + 1 {
                    j += 1;
                }
                let va = base + got_at[i] as u64 * self.page;
                if let Err(e) = self.device.map_run(va, self.page, &got[i..j]) {
                    fail = Some(e.into());
                    break;
                }
                let r = g.regions[rid as usize].as_mut().expect("registered region");
                for (&q, &h) in got_at[i..j].iter().zip(&got[i..j]) {
                    r.pages[q as usize].handle = Some(h);
                    r.pages[q as usize].freed_on = 0;
                    r.hot[q as usize].refs = 1;
                    r.hot[q as usize].set_backed(true);
                }
                r.in_use += (j - i) as u64;
                for (&q, &h) in got_at[i..j].iter().zip(&got[i..j]) {
                    g.owners.insert(h.0, (rid, q));
                }
                g.stats.maps += (j - i) as u64;
                mapped = j;
                i = j;
            }
        }
        if let Some(e) = fail {
            // Pages taken but not mapped: keep their handles cached rather than lose them.
            g.stats.pages_in_use -= (got.len() - mapped) as u64;
            g.free_handles.extend_from_slice(&got[mapped..]);
            // Roll back: every page of the range holds one reference from us except the unbacked pages
            // that were neither taken back nor mapped.
            let committed = |q: u32| {
                !unbacked.contains(&q) || returned.contains(&q) || got_at[..mapped].contains(&q)
            };
            for q in first..=last {
                if committed(q as u32) {
                    self.decommit_locked(g, rid, q, q);
                }
            }
            return Err(e);
        }
        Ok(())
    }

    /// A physical page for the unbacked page `pidx` of region `rid` (not mapped yet): a cached handle, a
    /// new one within the headroom, or one moved from another address.
    fn take_page(
        &self,
        g: &mut Inner,
        rid: u32,
        pidx: u32,
        grow: bool,
        synced: &mut bool,
    ) -> Result<Taken, VmmError> {
        debug_assert!(g.regions[rid as usize]
            .as_ref()
            .expect("registered region")
            .pages[pidx as usize]
            .handle
            .is_none());
        let under_limit = self
            .cfg
            .limit
            .is_none_or(|l| (g.stats.pages_held + 1) * self.page <= l);
        let pass = under_limit && self.passes_busy_freers();
        // An old mapping left here by a move: take its page back if it is free (and not warm with a
        // busy stream's work, where a new page may be made instead), else it must go before a page
        // can be mapped.
        if let Some(h) = self.take_back(g, rid, pidx, synced, pass)? {
            return Ok(Taken::Mapped(h));
        }
        let stay = self.pages_stay();
        if stay && zombie_epoch(&g.regions, rid, pidx).is_some() {
            // Its page is in use elsewhere: the old mapping would have to be unmapped first.
            return Err(VmmError::Capturing("unmapping an old mapping"));
        }
        self.clear_zombie(g, rid, pidx, synced)?;
        // Within the headroom (and the limit), a new page is cheaper than moving one.
        let headroom = (g.stats.pages_in_use_peak as f64 * (1.0 + self.slack())).ceil() as u64;
        let create_first = grow && g.stats.pages_held < headroom && under_limit;
        Ok(Taken::Unmapped(if let Some(h) = g.free_handles.pop() {
            h
        } else if stay {
            // No page leaves its address now (a capture, or a graph's pool): a new one.
            if !grow {
                return Err(VmmError::WouldGrow { pages: 1 });
            }
            self.create(g, false, rid, pidx, synced)?
        } else if !create_first {
            // Pages a busy stream freed are passed over where a new page may be made instead.
            let mut asked = false;
            loop {
                match self.steal(g, rid, pidx, synced, pass)? {
                    Stolen::Page(h) => break h,
                    Stolen::None => break self.create(g, false, rid, pidx, synced)?,
                    // Before a page is made for the belief, the busy streams are asked again, once
                    // (their backoff counts questions, not time): one that went idle gives its pages
                    // back to a second steal.
                    Stolen::PassedBusy if !asked && self.ask_busy_again_locked(g) => asked = true,
                    // A new page instead (as where no page is free); out of device memory, the page
                    // is stolen after all (and waited for).
                    Stolen::PassedBusy => break self.create(g, true, rid, pidx, synced)?,
                }
            }
        } else {
            self.create(g, true, rid, pidx, synced)?
        }))
    }

    /// With an old mapping of page `h` left at `(rid, pidx)` by a move: when `h` is free where it is now
    /// (or cached unmapped), take it back here with no driver call — its address there becomes the old
    /// mapping. `None`: no old mapping here, or its page is in use.
    fn take_back(
        &self,
        g: &mut Inner,
        rid: u32,
        pidx: u32,
        synced: &mut bool,
        pass_busy: bool,
    ) -> Result<Option<PhysHandle>, VmmError> {
        let Some(z) = zombie_at(g, rid, pidx) else {
            return Ok(None);
        };
        let h = z.handle;
        match old_page(g, h) {
            OldPage::InUse | OldPage::Gone => return Ok(None),
            OldPage::FreeAt(orid, opidx) => {
                let hot = g.regions[orid as usize]
                    .as_ref()
                    .expect("registered region")
                    .hot[opidx as usize];
                debug_assert!(hot.backed());
                if self.keep_mappings.load(Relaxed) {
                    // Its address there would keep an old mapping, retired (unmapped) later: never in
                    // a pool that keeps its mappings.
                    return Ok(None);
                }
                if self.capturing() && hot.warm(g.done_epoch) && g.fence_stream.is_none() {
                    // Several streams: a warm page moves after the committing stream waits on its last
                    // users' fence (or a synchronize), which the capture forbids.
                    return Ok(None);
                }
                // (Only where the old mapping here is idle: unmapping a warm one waits on the host.)
                if pass_busy
                    && Self::idle(g, z.stream, z.epoch)
                    && self.busy_elsewhere(g, orid, opidx)
                {
                    // Warm with a busy stream's work: taking it back would wait for that work.
                    g.stats.passed_busy += 1;
                    return Ok(None);
                }
                let target = g.committing_for;
                let how = self.settle(g, orid, opidx, synced, target)?;
                g.free_mapped.remove(&(opidx, orid));
                let left = Self::leave_mapped(g, orid, opidx, how);
                debug_assert_eq!(left, h);
            }
            OldPage::Cached(i) => {
                // Unmapped from its last owner and cached: the old mapping here is its only one.
                g.free_handles.swap_remove(i);
            }
        }
        let r = g.regions[rid as usize].as_mut().expect("registered region");
        r.pages[pidx as usize].zombie = None;
        g.stats.zombies -= 1;
        g.stats.returns += 1;
        Ok(Some(h))
    }

    /// Whether work may still use the free page `(rid, pidx)` and whose: [`Use::Idle`] when it is not
    /// warm or a fence of its stream has passed its last free; [`Use::Fenced`] when it is warm and one
    /// stream's fences order everything (`fence_stream`); else its last free's epoch and its stream —
    /// the region's, or the one stream that freed its bytes when the mask names one — with the mask.
    fn last_use(g: &Inner, rid: u32, pidx: u32) -> Use {
        let r = g.regions[rid as usize].as_ref().expect("registered region");
        let (hot, mask) = (r.hot[pidx as usize], r.pages[pidx as usize].freed_on);
        if !hot.warm(g.done_epoch) {
            return Use::Idle;
        }
        if g.fence_stream.is_some() {
            return Use::Fenced;
        }
        let stream = r.stream.or_else(|| Self::mask_stream(g, mask));
        let freed = hot.freed_epoch(g.epoch);
        if Self::idle(g, stream, freed) {
            return Use::Idle;
        }
        Use::Warm(LastUse {
            stream,
            mask,
            freed,
        })
    }

    /// How the free page `(rid, pidx)`, about to serve another address for work on `target`, stands with
    /// the work that last used it: idle; warm on the one stream (stream order keeps the two apart); or,
    /// with several streams, warm in a region of a known stream — then `target` is made to wait (on the
    /// device, `cuStreamWaitEvent`) for a fence of that stream covering the page's last free, and the
    /// move needs no host wait. A warm page of a region of no known stream, or for no known target,
    /// synchronizes the device first (once per commit) and is then idle.
    fn settle(
        &self,
        g: &mut Inner,
        rid: u32,
        pidx: u32,
        synced: &mut bool,
        target: Option<StreamId>,
    ) -> Result<Settled, VmmError> {
        let LastUse {
            stream,
            mask,
            freed,
        } = match Self::last_use(g, rid, pidx) {
            Use::Idle => return Ok(Settled::Idle),
            Use::Fenced => return Ok(Settled::Warm),
            Use::Warm(u) => u,
        };
        // A page of a shared region whose bytes several streams freed: the streams its mask names.
        let freers = match (stream, target) {
            (None, Some(_)) if mask != 0 => Self::mask_streams(g, mask),
            _ => None,
        };
        match (stream, target, freers) {
            (Some(s), Some(_), _) if self.ask_idle(g, s, freed) => {
                // Its last users' work is done (the device says so): nothing to order or fence.
                Ok(Settled::Idle)
            }
            (Some(s), Some(t), _) => {
                g.commit_ordered = true;
                let epoch = if t == s {
                    self.fence_on(g, s, freed)?.1
                } else {
                    self.wait_fence(g, t, s, freed)?
                };
                Ok(Settled::Fenced { stream: s, epoch })
            }
            (None, Some(t), Some(streams)) => {
                // `t` waits for each, and a fence on `t` after those waits covers them all (for the old
                // mapping).
                let mut busy = streams;
                busy.retain(|&s| !self.ask_idle(g, s, freed));
                if busy.is_empty() {
                    // Every stream that used its bytes is done (the device says so).
                    return Ok(Settled::Idle);
                }
                g.commit_ordered = true;
                for s in busy {
                    if s != t {
                        self.wait_fence(g, t, s, freed)?;
                    }
                }
                let now = g.epoch;
                let (_, epoch) = self.fence_on(g, t, now)?;
                Ok(Settled::Fenced { stream: t, epoch })
            }
            _ => {
                self.sync_all(g, synced)?;
                Ok(Settled::Idle)
            }
        }
    }

    /// Take the physical page of the free page `(rid, pidx)` (out of the free set already) for another
    /// address without unmapping it: the address keeps it as an old mapping. Returns the page.
    fn leave_mapped(g: &mut Inner, rid: u32, pidx: u32, how: Settled) -> PhysHandle {
        let h = crate::detach(g, rid, pidx);
        Self::make_zombie(g, rid, pidx, h, how);
        h
    }

    /// Take the free page with the highest index (never `(rid, pidx)`) for this address: unmapped from
    /// its own (or left there as an old mapping while warm); `Stolen::None` when no page is free.
    /// Synchronizes the device once per commit at most (`settle`). With `pass` a page whose last
    /// users' stream is known busy (a wait or a question found it so, and its backoff has not run
    /// out: [`PagePool::learn_idle`]) is left where it is: the committing stream would wait on the
    /// device for that stream's work, which it never shared. Several serving streams, each busy, then each keep to pages of their own
    /// (new ones, at the memory that costs) instead of running one after another. Where no stream was
    /// ever found busy — every replay — nothing is passed over.
    fn steal(
        &self,
        g: &mut Inner,
        rid: u32,
        pidx: u32,
        synced: &mut bool,
        pass: bool,
    ) -> Result<Stolen, VmmError> {
        let Some((orid, opidx)) = pop_free_mapped_excluding(g, rid, pidx) else {
            return Ok(Stolen::None);
        };
        if pass && self.busy_elsewhere(g, orid, opidx) {
            g.free_mapped.insert((opidx, orid));
            g.stats.passed_busy += 1;
            return Ok(Stolen::PassedBusy);
        }
        Ok(match self.steal_page(g, orid, opidx, synced)? {
            Some(h) => Stolen::Page(h),
            None => Stolen::None,
        })
    }

    /// Whether the free page `(rid, pidx)` is warm with work of one stream other than the one
    /// committing, which is known busy (see [`steal`](Self::steal)).
    fn busy_elsewhere(&self, g: &mut Inner, rid: u32, pidx: u32) -> bool {
        match g.committing_for {
            Some(target) => self.busy_for(g, rid, pidx, target),
            None => false,
        }
    }

    /// Whether the free page `(rid, pidx)` is warm with work of a stream other than `target` that is
    /// known busy: a wait or a question found it so and its backoff has not run out
    /// ([`PagePool::learn_idle`]; a stream never found busy is not). Moving the page to `target`'s
    /// work would make `target` wait on the device for that stream.
    pub(crate) fn busy_for(&self, g: &mut Inner, rid: u32, pidx: u32, target: StreamId) -> bool {
        if !self.any_known_busy() || self.capturing() {
            return false;
        }
        let Use::Warm(LastUse {
            stream,
            mask,
            freed,
        }) = Self::last_use(g, rid, pidx)
        else {
            return false;
        };
        let busy = |g: &mut Inner, s: StreamId| {
            if s == target || Self::idle(g, Some(s), freed) {
                return false;
            }
            // Never found busy: taken, asked and waited for as before. Found busy: passed over until
            // its backoff runs out, then asked (idle: taken).
            self.still_busy(g, s)
        };
        // The page's stream, or — a page of a shared region — each stream that freed bytes on it.
        if let Some(s) = stream {
            return busy(g, s);
        }
        match Self::mask_streams(g, mask) {
            Some(v) => v.into_iter().any(|s| busy(g, s)),
            None => false,
        }
    }

    /// Whether committing page `pidx` of region `rid` (unbacked) for work on `target` would wait for a
    /// stream known busy — its old mapping here is warm (unmapping it waits on the host) and the page it
    /// maps is either in use elsewhere or free but warm with a busy stream's work (taking it back waits
    /// on the device) — so that placement can leave that address alone while the stream is busy
    /// ([`Region::placement_costs`](crate::Region::placement_costs)).
    pub(crate) fn page_waits_for_busy(
        &self,
        g: &mut Inner,
        rid: u32,
        pidx: u32,
        target: StreamId,
    ) -> bool {
        let Some(z) = zombie_at(g, rid, pidx) else {
            return false;
        };
        if Self::idle(g, z.stream, z.epoch) {
            return false;
        }
        match old_page(g, z.handle) {
            OldPage::InUse => true,
            OldPage::FreeAt(orid, opidx) => self.busy_for(g, orid, opidx, target),
            OldPage::Cached(_) | OldPage::Gone => false,
        }
    }

    /// Steal the free page `(orid, opidx)`, out of the free set already.
    fn steal_page(
        &self,
        g: &mut Inner,
        orid: u32,
        opidx: u32,
        synced: &mut bool,
    ) -> Result<Option<PhysHandle>, VmmError> {
        let target = g.committing_for;
        let how = match self.settle(g, orid, opidx, synced, target) {
            Ok(how) => how,
            Err(e) => {
                g.free_mapped.insert((opidx, orid));
                return Err(e);
            }
        };
        let warm = how != Settled::Idle;
        if warm || self.cfg.keep_old_mappings {
            // Warm: alias. The physical page serves the new address from now on (one stream: stream
            // order puts the new work after the old; several: the new stream waits on a fence of the
            // old one); the old mapping stays until a fence covering it completes — or, keeping old
            // mappings, until it is needed (a move back through it costs no driver call).
            let h = Self::leave_mapped(g, orid, opidx, how);
            if warm {
                g.stats.aliases += 1;
            }
            g.stats.steals += 1;
            return Ok(Some(h));
        }
        match self.unmap_page(g, orid, opidx) {
            Ok(h) => {
                g.stats.steals += 1;
                Ok(Some(h))
            }
            Err(e) => {
                // Still mapped and unused: put it back.
                g.free_mapped.insert((opidx, orid));
                Err(e)
            }
        }
    }

    /// A new physical page. When the device is out of memory and `then_steal`, fall back to stealing.
    fn create(
        &self,
        g: &mut Inner,
        then_steal: bool,
        rid: u32,
        pidx: u32,
        synced: &mut bool,
    ) -> Result<PhysHandle, VmmError> {
        match self.device.phys_create(self.page) {
            Ok(h) => {
                g.stats.creates += 1;
                g.stats.pages_held += 1;
                g.stats.pages_peak = g.stats.pages_peak.max(g.stats.pages_held);
                Ok(h)
            }
            Err(e) if e.is_oom() => {
                if then_steal {
                    if let Stolen::Page(h) = self.steal(g, rid, pidx, synced, false)? {
                        return Ok(h);
                    }
                }
                Err(VmmError::OutOfMemory {
                    requested: self.page,
                    reserved: g.stats.pages_held * self.page,
                    limit: self.cfg.limit,
                })
            }
            Err(e) => Err(e.into()),
        }
    }

    pub(crate) fn decommit_locked(&self, g: &mut Inner, rid: u32, first: u64, last: u64) {
        self.decommit_locked_on(g, rid, first, last, FreedBy::Unknown);
    }

    /// [`decommit_locked`](Self::decommit_locked), stamping the pages that become free with the stream
    /// their last users ran on (`Some`), for regions of no stream of their own.
    pub(crate) fn decommit_locked_on(
        &self,
        g: &mut Inner,
        rid: u32,
        first: u64,
        last: u64,
        freed_on: FreedBy,
    ) {
        let bit = match freed_on {
            FreedBy::Stream(s) => Some(Self::stream_bit(g, s)),
            FreedBy::Unknown | FreedBy::Idle => None,
        };
        let idle = matches!(freed_on, FreedBy::Idle);
        // Decided once per call, not per page (a capture check is a call through the device).
        let lazy = self.leaves_pages_mapped();
        let mut eager: Vec<u32> = Vec::new();
        {
            let Inner {
                regions,
                free_mapped,
                stats,
                sleep,
                epoch,
                done_epoch,
                ..
            } = &mut *g;
            let (epoch, done_epoch) = (*epoch, *done_epoch);
            let r = regions[rid as usize].as_mut().expect("registered region");
            let own_stream = r.stream.is_some();
            // Pages left free and mapped join the free set in runs (one bit operation per 64 pages); the
            // in-use counters move once, after the walk.
            let mut run: Option<(u32, u32)> = None;
            let mut released = 0u64;
            let mut walk = first..=last;
            while let Some(pidx) = walk.next() {
                // The pages strictly inside the range at once, when each is this range's alone and
                // mapped (an extent block's inner pages): a check and a fill the compiler vectorizes,
                // one run for the free set, instead of the general walk's branches page by page
                // (simulator: gpt2_train_fixed's blocks span ~20 pages). Anything else — a page another
                // block shares, one asleep — takes the general walk below.
                if pidx == first + 1 && last > first + 1 && lazy && !idle {
                    let (a, b) = (pidx as usize, last as usize - 1);
                    if release_sole(&mut r.hot[a..=b], epoch) {
                        let stamp = left_free_stamp(bit, own_stream);
                        if stamp != 0 {
                            for p in &mut r.pages[a..=b] {
                                p.freed_on |= stamp;
                            }
                        }
                        extend_run_by(&mut run, a as u32, b as u32, |x, y| {
                            free_mapped.insert_run(rid, x, y);
                        });
                        released += (b - a + 1) as u64;
                        walk = last..=last;
                        continue;
                    }
                }
                let i = pidx as usize;
                if let Some(bit) = bit {
                    forget_completed(&mut r.pages[i], r.hot[i], done_epoch);
                    // The bytes freed here were used on that stream: whoever reuses them next waits for it.
                    r.pages[i].freed_on |= bit;
                    r.hot[i].set_freed(epoch);
                }
                let p = &mut r.hot[i];
                if p.refs == 0 {
                    debug_assert!(
                        false,
                        "decommit of an uncommitted page in region '{}'",
                        r.name
                    );
                    log::error!(
                        "gen-vmm: decommit of an uncommitted page {pidx} in region '{}'",
                        r.name
                    );
                    continue;
                }
                p.refs -= 1;
                if p.refs != 0 {
                    continue;
                }
                let backed = p.backed();
                if !idle {
                    // Idle bytes leave the page's free epoch and streams as they were: whatever else was
                    // freed on it still orders its reuse, these bytes need nothing.
                    let stamp = left_free_stamp(bit, own_stream);
                    if stamp != 0 && bit.is_none() {
                        forget_completed(&mut r.pages[i], *p, done_epoch);
                    }
                    p.set_freed(epoch);
                    r.pages[i].freed_on |= stamp;
                }
                released += 1;
                if !backed {
                    // Asleep (a referenced page is backed otherwise): nothing is mapped to free; its
                    // offloaded contents are not needed any more.
                    if let Some(z) = sleep.as_mut() {
                        z.forget(rid, pidx as u32);
                    }
                    continue;
                }
                if lazy {
                    extend_run(&mut run, pidx as u32, |a, b| {
                        free_mapped.insert_run(rid, a, b);
                    });
                } else {
                    eager.push(pidx as u32);
                }
            }
            if let Some((a, b)) = run {
                free_mapped.insert_run(rid, a, b);
            }
            r.in_use -= released;
            stats.pages_in_use -= released;
        }
        if eager.is_empty() {
            return;
        }
        // Unmapping needs the pages' earlier users to be done: one synchronize for all of them.
        let synced = self.device.synchronize().map_err(VmmError::from);
        if synced.is_ok() {
            self.all_complete(g);
        }
        for pidx in eager {
            let res = match &synced {
                Ok(()) => self.unmap_page(g, rid, pidx),
                Err(e) => Err(e.clone()),
            };
            match res {
                Ok(h) => g.free_handles.push(h),
                Err(e) => {
                    log::error!("gen-vmm: eager unmap failed: {e}");
                    g.free_mapped.insert((pidx, rid));
                }
            }
        }
    }
}

/// Before a decommit stamps `page` with a stream: when every free its stream bits name completed (the
/// last of them before the newest known completion, `done_epoch`), drop them — they order nothing any
/// more. Without this, the bits of a page revived in place and freed again pile up, and an unknown
/// stream's among them makes the next reuse for another stream synchronize the device for work long
/// done (the slab's chunks, reused in place on pages the classes share).
#[inline]
fn forget_completed(page: &mut crate::page::Page, hot: crate::page::PageHot, done_epoch: u64) {
    if !hot.warm(done_epoch) {
        page.freed_on = 0;
    }
}

/// Who last used the bytes a decommit frees ([`PagePool::decommit_locked_on`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FreedBy {
    /// Not known: a region of no stream of its own stamps the unknown stream (the next reuse
    /// elsewhere synchronizes); a region of one stream needs nothing.
    Unknown,
    /// Work on this stream (or ordered before work queued there).
    Stream(StreamId),
    /// Nothing queued uses them any more (a synchronize or a completed event since their last use).
    Idle,
}

/// The [`Page::freed_on`] bits a page a decommit leaves free gets: the freeing stream's bit (whoever
/// reuses it next waits for that stream), else — in a region with no stream of its own — the unknown
/// stream's (its next reuse elsewhere synchronizes), else none (a region of one stream: its stream is
/// the answer). The inner-page step and the page-by-page walk of `decommit_locked_on` both apply it.
///
/// [`Page::freed_on`]: crate::page::Page::freed_on
#[inline]
fn left_free_stamp(bit: Option<u64>, own_stream: bool) -> u64 {
    match bit {
        Some(bit) => bit,
        None if !own_stream => UNKNOWN_STREAM,
        None => 0,
    }
}

/// Take a reference on every backed page of region `rid`'s `first..=last` (reviving free-mapped ones in
/// place, no driver call); returns the pages with no physical page under them, for the caller to back.
fn take_backed(g: &mut Inner, rid: u32, first: u64, last: u64) -> Vec<u32> {
    let mut unbacked = Vec::new();
    let Inner {
        regions,
        free_mapped,
        stats,
        ..
    } = g;
    let r = regions[rid as usize].as_mut().expect("registered region");
    // Revived pages leave the free set in runs (one bit operation per 64 pages); the counters move once,
    // after the walk (gpt2's extent blocks span ~20 pages: simulator gpt2_train_fixed ~5 % faster).
    let mut run: Option<(u32, u32)> = None;
    let mut revived = 0u64;
    let mut walk = first as u32..=last as u32;
    while let Some(pidx) = walk.next() {
        // The pages strictly inside the range at once when each is free and mapped here (an extent
        // block's inner pages revived in place): as in `decommit_locked_on`.
        if u64::from(pidx) == first + 1 && last > first + 1 {
            let (a, b) = (pidx as usize, last as usize - 1);
            if revive_sole(&mut r.hot[a..=b]) {
                extend_run_by(&mut run, a as u32, b as u32, |x, y| {
                    free_mapped.remove_run(rid, x, y);
                });
                revived += (b - a + 1) as u64;
                walk = last as u32..=last as u32;
                continue;
            }
        }
        let p = &mut r.hot[pidx as usize];
        if p.refs > 0 {
            p.refs += 1;
        } else if p.backed() {
            p.refs = 1;
            revived += 1;
            extend_run(&mut run, pidx, |a, b| {
                free_mapped.remove_run(rid, a, b);
            });
        } else {
            unbacked.push(pidx);
        }
    }
    if let Some((a, b)) = run {
        free_mapped.remove_run(rid, a, b);
    }
    r.in_use += revived;
    stats.revivals += revived;
    stats.pages_in_use += revived;
    stats.pages_in_use_peak = stats.pages_in_use_peak.max(stats.pages_in_use);
    unbacked
}

/// Add page `p` to the run of consecutive pages being collected, handing a run it does not continue to
/// `flush(first, last)` first. The caller flushes what is left at the end.
#[inline]
fn extend_run(run: &mut Option<(u32, u32)>, p: u32, flush: impl FnMut(u32, u32)) {
    extend_run_by(run, p, p, flush);
}

/// [`extend_run`] with the pages `p..=q`.
#[inline]
fn extend_run_by(run: &mut Option<(u32, u32)>, p: u32, q: u32, mut flush: impl FnMut(u32, u32)) {
    *run = match *run {
        Some((a, b)) if b + 1 == p => Some((a, q)),
        Some((a, b)) => {
            flush(a, b);
            Some((p, q))
        }
        None => Some((p, q)),
    };
}

/// Where the physical page an old mapping maps is now (`PagePool::take_back` brings back the free and
/// the cached ones; a commit clears the others first, `zombies_to_clear`).
enum OldPage {
    /// Referenced at the address it moved to.
    InUse,
    /// Free and mapped at `(region, page)`, its own address now.
    FreeAt(u32, u32),
    /// Unmapped and cached: `free_handles[i]`.
    Cached(usize),
    /// Neither (released).
    Gone,
}

fn old_page(g: &Inner, h: PhysHandle) -> OldPage {
    if let Some(&(orid, opidx)) = g.owners.get(&h.0) {
        let refs = g.regions[orid as usize]
            .as_ref()
            .expect("registered region")
            .hot[opidx as usize]
            .refs;
        if refs > 0 {
            OldPage::InUse
        } else {
            OldPage::FreeAt(orid, opidx)
        }
    } else {
        match g.free_handles.iter().position(|&c| c == h) {
            Some(i) => OldPage::Cached(i),
            None => OldPage::Gone,
        }
    }
}

/// Of the unbacked pages `unbacked` of region `rid`, those holding an old mapping that cannot be taken
/// back (its page is in use at its new address, or was released): the ones a commit must unmap first.
fn zombies_to_clear(g: &Inner, rid: u32, unbacked: &[u32]) -> Vec<u32> {
    let r = g.regions[rid as usize].as_ref().expect("registered region");
    unbacked
        .iter()
        .copied()
        .filter(|&p| {
            r.pages[p as usize]
                .zombie
                .is_some_and(|z| matches!(old_page(g, z.handle), OldPage::InUse | OldPage::Gone))
        })
        .collect()
}

/// Take a free-mapped page for a steal; never `(rid, pidx)` itself (an unbacked page is never free).
fn pop_free_mapped_excluding(g: &mut Inner, rid: u32, pidx: u32) -> Option<(u32, u32)> {
    let (orid, opidx) = pop_free_mapped(g)?;
    debug_assert!(
        !(orid == rid && opidx == pidx),
        "an unbacked page is never free-mapped"
    );
    Some((orid, opidx))
}

/// Whether work may still use a free page ([`PagePool::last_use`]).
enum Use {
    Idle,
    /// Warm, with one stream's fences ordering everything.
    Fenced,
    Warm(LastUse),
}

/// A warm page's last users: its stream (`None`: a shared region's page several streams freed bytes
/// on, named by `mask`, or none known) and the epoch of its last free.
struct LastUse {
    stream: Option<StreamId>,
    mask: u64,
    freed: u64,
}

/// What [`PagePool::steal`] found.
enum Stolen {
    Page(PhysHandle),
    /// No free page.
    None,
    /// The free page to steal is warm with a busy stream's work: left there.
    PassedBusy,
}

/// A physical page found for an unbacked page (see `PagePool::take_page`).
enum Taken {
    /// Already mapped at the page's address (taken back through an old mapping).
    Mapped(PhysHandle),
    /// To be mapped there.
    Unmapped(PhysHandle),
}
