//! Sleep and wake: give every physical page back to the driver while keeping the address space.
//!
//! [`PagePool::sleep`] unmaps and releases every page the pool holds — cached handles, free-mapped
//! pages, old mappings left by moves, and the pages referenced by live blocks — after copying the
//! latter's bytes to pinned host memory when asked to (`offload`). The regions keep their reserved
//! VA and every page keeps its reference count, so every block keeps its address. While asleep:
//!
//! - a commit fails with [`VmmError::Asleep`] (the engine refuses allocations before reaching here);
//! - a decommit is bookkeeping only (a referenced page that loses its last reference while asleep is
//!   simply forgotten: nothing to map at wake, its offloaded bytes are not restored);
//! - a region may be dropped.
//!
//! [`PagePool::wake`] creates one page per page still referenced, maps it at the same address (one
//! access call per run of consecutive pages) and copies the offloaded bytes back. Pages that were not
//! offloaded come back with undefined contents (fresh driver memory), as in vLLM's sleep level 2. A wake
//! that cannot get its pages (another process holds the memory) fails with
//! [`VmmError::OutOfMemory`] and leaves the pool asleep, to be woken later; nothing is lost.
//!
//! The pinned buffer is one allocation per sleep (`cuMemAllocHost` is expensive per call); after a
//! wake it is kept for the next sleep's offload ([`PagePoolStats::host_bytes`](crate::PagePoolStats)),
//! until [`PagePool::release_host`] or the pool's drop.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use gen_device::{HostHandle, PhysHandle};

use crate::{pop_free_mapped, Inner, PagePool, VmmError};

/// Most pages one copy or unmap call covers (512 MiB of 2 MiB pages).
const MAX_RUN_PAGES: u64 = 256;

/// A pool's state while asleep.
pub(crate) struct Sleep {
    /// The pinned buffer holding offloaded contents, and its length.
    pub(crate) host: Option<(HostHandle, u64)>,
    /// (region, page) → offset of its contents in `host`.
    pub(crate) slots: HashMap<(u32, u32), u64>,
    /// Pages referenced and asleep (no physical page under them).
    pub(crate) pages: u64,
}

impl Sleep {
    /// The asleep page `(rid, pidx)` lost its last reference (or its region): nothing to restore.
    pub(crate) fn forget(&mut self, rid: u32, pidx: u32) {
        self.pages = self.pages.saturating_sub(1);
        self.slots.remove(&(rid, pidx));
    }
}

/// What [`PagePool::sleep`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Slept {
    /// Pages referenced by live blocks, now asleep.
    pub pages_asleep: u64,
    /// Of those, pages whose bytes were copied to pinned host memory.
    pub pages_offloaded: u64,
    /// Physical pages released to the driver (the asleep ones and every cached one).
    pub pages_released: u64,
    /// Old mappings (left by moves) unmapped.
    pub old_mappings_unmapped: u64,
}

/// What [`PagePool::wake`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Woken {
    /// Pages mapped again.
    pub pages_mapped: u64,
    /// Of those, pages whose bytes were restored from pinned host memory.
    pub pages_restored: u64,
}

impl PagePool {
    /// Whether the pool is asleep (one relaxed load, no lock).
    #[inline]
    pub fn is_asleep(&self) -> bool {
        self.asleep.load(Ordering::Relaxed)
    }

    /// Give every physical page back to the driver, keeping every region's addresses and every page's
    /// references (see the module docs). With `offload`, the bytes of every referenced page are copied
    /// to pinned host memory first and restored by [`PagePool::wake`].
    ///
    /// Synchronizes the device first: work queued on the pages must be done before they go. Errors:
    /// [`VmmError::AlreadyAsleep`]; a failed synchronize, pinned allocation or copy leaves the pool
    /// awake and unchanged (cached pages may have been released). A failed unmap or release once the
    /// pool is asleep leaves that page mapped (or cached) and is returned after the rest is done: the
    /// pool is asleep then, and [`PagePool::wake`] handles both.
    pub fn sleep(&self, offload: bool) -> Result<Slept, VmmError> {
        let mut g = self.inner.lock();
        if g.sleep.is_some() {
            return Err(VmmError::AlreadyAsleep);
        }
        self.device.synchronize()?;
        self.all_complete(&mut g);
        let zombies_before = g.stats.zombies;
        self.reap_zombies(&mut g, true)?;
        let mut out = Slept {
            old_mappings_unmapped: zombies_before - g.stats.zombies,
            ..Slept::default()
        };
        // Every page referenced by a live block, in (region, page) order.
        let live = referenced_pages(&g, true);
        // Offload first, so that a failure leaves everything mapped.
        let mut slots = HashMap::new();
        let mut host = None;
        if offload && !live.is_empty() {
            let bytes = live.len() as u64 * self.page;
            let buf = self.host_buffer(&mut g, bytes)?;
            let pages: Vec<(u32, u32, u64)> = live
                .iter()
                .enumerate()
                .map(|(k, &(rid, pidx))| (rid, pidx, k as u64 * self.page))
                .collect();
            // One copy per run of pages consecutive in VA and in the buffer.
            for (rid, p0, at, n) in self.runs(&pages) {
                let va = self.page_va(&g, rid, p0);
                if let Err(e) = self.device.copy_to_host(buf.0, at, va, n * self.page) {
                    g.spare_host = Some(buf);
                    return Err(e.into());
                }
            }
            slots.extend(pages.iter().map(|&(rid, pidx, at)| ((rid, pidx), at)));
            host = Some(buf);
        }
        // Asleep from here: commits are refused.
        self.asleep.store(true, Ordering::SeqCst);
        let mut first_err: Option<VmmError> = None;
        // Free-mapped pages: unmap, cache the handle (released below).
        let mut free = Vec::new();
        while let Some(p) = pop_free_mapped(&mut g) {
            free.push(p);
        }
        for (rid, pidx) in free {
            match self.unmap_page(&mut g, rid, pidx) {
                Ok(h) => g.free_handles.push(h),
                Err(e) => {
                    g.free_mapped.insert((pidx, rid));
                    first_err.get_or_insert(e);
                }
            }
        }
        // Referenced pages: unmap (one call per run of consecutive pages), keep the references.
        let mut asleep = 0;
        let pages: Vec<(u32, u32, u64)> = live
            .iter()
            .map(|&(rid, pidx)| (rid, pidx, u64::from(pidx) * self.page))
            .collect();
        for (rid, p0, _, n) in self.runs(&pages) {
            let va = self.page_va(&g, rid, p0);
            let run = p0..p0 + n as u32;
            if let Err(e) = self.device.unmap(va, n * self.page) {
                for pidx in run {
                    slots.remove(&(rid, pidx));
                }
                first_err.get_or_insert(e.into());
                continue;
            }
            for pidx in run {
                let h = crate::detach(&mut g, rid, pidx);
                g.stats.unmaps += 1;
                g.free_handles.push(h);
                asleep += 1;
            }
        }
        out.pages_asleep = asleep;
        out.pages_offloaded = slots.len() as u64;
        g.sleep = Some(Sleep {
            host,
            slots,
            pages: asleep,
        });
        if let Err(e) = self.release_cached(&mut g, &mut out.pages_released) {
            first_err.get_or_insert(e);
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }

    /// Map a physical page again under every page still referenced, at the same addresses, and restore
    /// the offloaded bytes. Errors: [`VmmError::NotAsleep`]; out of memory (the pages could not be
    /// created — another process may hold the memory now): the pool stays asleep, unchanged, and may be
    /// woken later. A failed map also leaves it asleep (the pages of this attempt released). A failed
    /// restore copy is returned after the pool is awake: that page's bytes are undefined.
    pub fn wake(&self) -> Result<Woken, VmmError> {
        let mut g = self.inner.lock();
        let Some(sleep) = g.sleep.take() else {
            return Err(VmmError::NotAsleep);
        };
        let todo = referenced_pages(&g, false);
        debug_assert_eq!(todo.len() as u64, sleep.pages, "asleep pages counted");
        let n = todo.len() as u64;
        // Pages: cached handles first (a release that failed at sleep), then new ones.
        let from_cache = (g.free_handles.len() as u64).min(n);
        let to_create = n - from_cache;
        if let Some(limit) = self.cfg.limit {
            let held = g.stats.pages_held * self.page;
            if held + to_create * self.page > limit {
                g.sleep = Some(sleep);
                return Err(VmmError::OutOfMemory {
                    requested: to_create * self.page,
                    reserved: held,
                    limit: Some(limit),
                });
            }
        }
        let mut got: Vec<PhysHandle> = Vec::with_capacity(todo.len());
        for _ in 0..from_cache {
            got.push(g.free_handles.pop().expect("counted"));
        }
        for _ in 0..to_create {
            match self.device.phys_create(self.page) {
                Ok(h) => {
                    g.stats.creates += 1;
                    g.stats.pages_held += 1;
                    g.stats.pages_peak = g.stats.pages_peak.max(g.stats.pages_held);
                    got.push(h);
                }
                Err(e) => {
                    let err = if e.is_oom() {
                        VmmError::OutOfMemory {
                            requested: to_create * self.page,
                            reserved: g.stats.pages_held * self.page,
                            limit: self.cfg.limit,
                        }
                    } else {
                        VmmError::Device(e)
                    };
                    return Err(self.wake_failed(&mut g, sleep, got, &[], err));
                }
            }
        }
        // Map in runs of consecutive pages of one region.
        let mut runs: Vec<(u64, usize, usize)> = Vec::new(); // (va, first index in todo, count)
        let mut i = 0;
        while i < todo.len() {
            let (rid, p0) = todo[i];
            let mut j = i + 1;
            while j < todo.len() && todo[j] == (rid, p0 + (j - i) as u32) {
                j += 1;
            }
            let va = self.page_va(&g, rid, p0);
            if let Err(e) = self.device.map_run(va, self.page, &got[i..j]) {
                return Err(self.wake_failed(&mut g, sleep, got, &runs, e.into()));
            }
            runs.push((va, i, j - i));
            i = j;
        }
        for (&(rid, pidx), &h) in todo.iter().zip(&got) {
            let r = g.regions[rid as usize].as_mut().expect("registered region");
            r.pages[pidx as usize].handle = Some(h);
            r.hot[pidx as usize].set_backed(true);
            g.owners.insert(h.0, (rid, pidx));
        }
        g.stats.maps += n;
        self.asleep.store(false, Ordering::SeqCst);
        // Restore the offloaded bytes.
        let mut first_err = None;
        let mut restored = 0;
        if let Some((buf, _)) = sleep.host {
            let pages: Vec<(u32, u32, u64)> = todo
                .iter()
                .filter_map(|&(rid, pidx)| sleep.slots.get(&(rid, pidx)).map(|&at| (rid, pidx, at)))
                .collect();
            for (rid, p0, at, n) in self.runs(&pages) {
                let va = self.page_va(&g, rid, p0);
                match self.device.copy_from_host(va, buf, at, n * self.page) {
                    Ok(()) => restored += n,
                    Err(e) => {
                        first_err.get_or_insert(VmmError::from(e));
                    }
                }
            }
        }
        // Keep the pinned buffer for the next sleep (the larger one, if one is kept already).
        if let Some(buf) = sleep.host {
            self.keep_host(&mut g, buf);
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(Woken {
                pages_mapped: n,
                pages_restored: restored,
            }),
        }
    }

    /// Free the pinned host buffer kept from the last wake (if any); returns its bytes. One asleep with
    /// offloaded contents is not touched.
    pub fn release_host(&self) -> Result<u64, VmmError> {
        let mut g = self.inner.lock();
        match g.spare_host.take() {
            Some((h, bytes)) => match self.device.host_free(h) {
                Ok(()) => Ok(bytes),
                Err(e) => {
                    g.spare_host = Some((h, bytes));
                    Err(e.into())
                }
            },
            None => Ok(0),
        }
    }

    /// A wake that could not map its pages: unmap the runs mapped so far, give every page of the
    /// attempt back to the driver, and stay asleep. Returns `err`.
    fn wake_failed(
        &self,
        g: &mut Inner,
        sleep: Sleep,
        got: Vec<PhysHandle>,
        runs: &[(u64, usize, usize)],
        err: VmmError,
    ) -> VmmError {
        log::warn!("gen-vmm: wake failed ({err}); the pool stays asleep");
        for &(va, _, count) in runs {
            if let Err(e) = self.device.unmap(va, count as u64 * self.page) {
                log::error!("gen-vmm: unmapping a run after a failed wake: {e}");
            }
        }
        g.free_handles.extend(got);
        g.sleep = Some(sleep);
        let mut released = 0;
        if let Err(e) = self.release_cached(g, &mut released) {
            log::error!("gen-vmm: releasing pages after a failed wake: {e}");
        }
        err
    }

    /// Release every cached (unmapped) handle to the driver; a failure keeps the handle cached.
    fn release_cached(&self, g: &mut Inner, released: &mut u64) -> Result<(), VmmError> {
        let mut first_err = None;
        let mut kept = Vec::new();
        while let Some(h) = g.free_handles.pop() {
            match self.device.phys_release(h) {
                Ok(()) => {
                    g.stats.pages_held -= 1;
                    g.stats.releases += 1;
                    *released += 1;
                }
                Err(e) => {
                    kept.push(h);
                    first_err.get_or_insert(VmmError::from(e));
                }
            }
        }
        g.free_handles = kept;
        first_err.map_or(Ok(()), Err)
    }

    /// A pinned buffer of at least `bytes`: the one kept from the last wake if large enough, else a new
    /// one (the kept one freed).
    fn host_buffer(&self, g: &mut Inner, bytes: u64) -> Result<(HostHandle, u64), VmmError> {
        if let Some((h, len)) = g.spare_host.take() {
            if len >= bytes {
                return Ok((h, len));
            }
            if let Err(e) = self.device.host_free(h) {
                g.spare_host = Some((h, len));
                return Err(e.into());
            }
        }
        Ok((self.device.host_alloc(bytes)?, bytes))
    }

    fn keep_host(&self, g: &mut Inner, buf: (HostHandle, u64)) {
        let drop = match g.spare_host {
            Some(old) if old.1 >= buf.1 => buf,
            Some(old) => {
                g.spare_host = Some(buf);
                old
            }
            None => {
                g.spare_host = Some(buf);
                return;
            }
        };
        if let Err(e) = self.device.host_free(drop.0) {
            log::error!("gen-vmm: freeing a pinned buffer: {e}");
        }
    }

    /// Runs of `(region, page, host offset)` (in order) that are consecutive in the region and in the
    /// host buffer, at most [`MAX_RUN_PAGES`] long: (region, first page, its offset, pages).
    fn runs(&self, pages: &[(u32, u32, u64)]) -> Vec<(u32, u32, u64, u64)> {
        let mut out: Vec<(u32, u32, u64, u64)> = Vec::new();
        for &(rid, pidx, at) in pages {
            if let Some(last) = out.last_mut() {
                let (r0, p0, a0, n) = *last;
                if r0 == rid
                    && u64::from(p0) + n == u64::from(pidx)
                    && a0 + n * self.page == at
                    && n < MAX_RUN_PAGES
                {
                    last.3 += 1;
                    continue;
                }
            }
            out.push((rid, pidx, at, 1));
        }
        out
    }

    fn page_va(&self, g: &Inner, rid: u32, pidx: u32) -> u64 {
        g.regions[rid as usize]
            .as_ref()
            .expect("registered region")
            .base
            + pidx as u64 * self.page
    }
}

/// Every page a live block references whose physical page is mapped (`backed`) or not, in (region,
/// page) order: what a sleep unmaps, what a wake maps again.
fn referenced_pages(g: &Inner, backed: bool) -> Vec<(u32, u32)> {
    g.regions
        .iter()
        .enumerate()
        .filter_map(|(rid, r)| r.as_ref().map(|r| (rid as u32, r)))
        .flat_map(|(rid, r)| {
            r.hot
                .iter()
                .enumerate()
                .filter(move |(_, p)| p.refs > 0 && p.backed() == backed)
                .map(move |(pidx, _)| (rid, pidx as u32))
        })
        .collect()
}
