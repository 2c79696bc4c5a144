//! Stream ordering: the stream regime (one stream / several), the device-wide and per-stream fences,
//! the epochs that say what is idle, and the bound on how far they may lag.

use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;

use gen_device::{EventHandle, StreamId};

use crate::{Inner, PagePool, VmmError, MAX_EPOCH_LAG, UNKNOWN_STREAM};

/// The fences recorded on one stream (several streams: see [`PagePool::settle`]). Epochs come from the
/// pool's one counter ([`Inner::epoch`]), so a page freed at epoch `e` in a region of this stream is
/// idle once a fence of epoch `>= e` recorded here has completed: every fence records everything queued
/// on the stream before it, and the free was queued before.
#[derive(Debug)]
pub(crate) struct StreamFences {
    pub(crate) stream: StreamId,
    /// Recorded, not yet seen complete, oldest first.
    pub(crate) fences: VecDeque<(u64, EventHandle)>,
    /// Everything of this stream stamped with an epoch `< done` is complete.
    done: u64,
    /// `(t, e)`: stream `t` was made to wait on a fence of this stream of epoch `e` (the newest such):
    /// everything of this stream up to `e` is ordered before `t`'s later work, and needs no wait again.
    waited: Vec<(StreamId, u64)>,
    /// The pool's epoch when a waiter last found this stream's oldest fence pending
    /// (`PagePool::learn_complete`): not asked again before a newer fence is recorded.
    asked: u64,
    /// Stream questions ([`PagePool::learn_idle`]) that found the stream busy in a row (at most
    /// [`BUSY_BACKOFF`]), and how many waits to make before asking again.
    pub(crate) busy: u32,
    skip: u32,
}

/// A stream found busy this many times in a row is asked at most once every 2^this waits.
const BUSY_BACKOFF: u32 = 6;

impl StreamFences {
    /// The oldest fence has completed: everything of this stream up to its epoch is idle; its event
    /// goes to `spare`. Returns that epoch (`None`: no fence pending).
    fn retire_front(&mut self, spare: &mut Vec<EventHandle>) -> Option<u64> {
        let (e, ev) = self.fences.pop_front()?;
        self.done = self.done.max(e + 1);
        spare.push(ev);
        Some(e)
    }
}

/// The pool's epoch, stream fences `i` and the spare events, borrowed apart.
fn fences_of(g: &mut Inner, i: usize) -> (u64, &mut StreamFences, &mut Vec<EventHandle>) {
    let Inner {
        epoch,
        stream_fences,
        spare_events,
        ..
    } = g;
    (*epoch, &mut stream_fences[i], spare_events)
}

/// Fences kept outstanding at most, per queue; past this the newest is recorded again instead of a new
/// one (bounds the queue when the device lags far behind, with no host wait).
const MAX_FENCES: usize = 256;

impl PagePool {
    /// Say which stream all device work using this pool's pages runs on (`Some`), or that there may be
    /// several (`None`). With one stream, pages still in use by queued work move without a device
    /// synchronize (see the crate docs). Switching from `Some` to `None` must follow a device
    /// synchronize and [`PagePool::synchronized`], so that nothing moved by aliasing is still pending.
    pub fn set_fence_stream(&self, stream: Option<StreamId>) {
        // Fences recorded on an earlier stream still complete; they simply cover less from now on.
        self.lock().fence_stream = stream;
    }

    /// The stream regime, decided here for every tier over these pages: the first stream seen. Until a
    /// second appears, all work using the pages runs on it ([`set_fence_stream`](Self::set_fence_stream)):
    /// pages still in use move by aliasing, regions' frees need no stamps.
    pub fn one_stream(&self, stream: StreamId) {
        self.set_fence_stream(Some(stream));
    }

    /// A second stream appeared: from now on per-stream fences decide when memory freed on one stream
    /// may serve another. Everything freed under the one-stream regime is made idle by one device
    /// synchronize (a one-time cost, never in a warm pass), so that no page or slot freed then needs an
    /// ordering it was never stamped for. During a capture the synchronize is skipped (it would break
    /// the capture): pages freed so far then stay warm, and move only after the next synchronize.
    /// Returns whether the device was synchronized.
    pub fn several_streams(&self) -> bool {
        self.set_fence_stream(None);
        if self.capturing() {
            log::debug!("gen-vmm: a second stream during a capture; no synchronize");
            return false;
        }
        match self.device.synchronize() {
            Ok(()) => {
                self.synchronized();
                true
            }
            Err(e) => {
                log::error!("gen-vmm: synchronize on a second stream's first use: {e}");
                false
            }
        }
    }

    /// Make future work on `stream` wait for everything queued on `after` so far: a fence recorded on
    /// `after` (or the newest one, when nothing was freed since), waited on by `stream` on the device
    /// (`cuStreamWaitEvent`). No host wait. Nothing to do when they are the same stream.
    ///
    /// Returns the fence's epoch (`None`: the same stream, nothing waited for):
    /// [`order_after_fence`](Self::order_after_fence) with it orders another stream after the same work
    /// with no new fence.
    pub fn order_after(&self, stream: StreamId, after: StreamId) -> Result<Option<u64>, VmmError> {
        if stream == after {
            return Ok(None);
        }
        if self.capturing() {
            return Err(VmmError::Capturing(
                "ordering a stream after another's queued work",
            ));
        }
        let mut g = self.lock();
        let now = g.epoch;
        self.wait_fence(&mut g, stream, after, now).map(Some)
    }

    /// Make future work on `stream` wait for `after`'s work up to the fence of epoch `epoch` (one that
    /// [`order_after`](Self::order_after) returned): no device call when `stream` already waited for a
    /// fence of `after` that recent, or when that work is known complete.
    pub fn order_after_fence(
        &self,
        stream: StreamId,
        after: StreamId,
        epoch: u64,
    ) -> Result<(), VmmError> {
        if stream == after {
            return Ok(());
        }
        let mut g = self.lock();
        if Self::idle(&g, Some(after), epoch) {
            return Ok(());
        }
        if self.capturing() {
            return Err(VmmError::Capturing(
                "ordering a stream after another's queued work",
            ));
        }
        self.wait_fence(&mut g, stream, after, epoch).map(|_| ())
    }

    /// Whether any stream is known busy (see [`known_busy`](Self::known_busy)); no lock taken.
    #[inline]
    pub fn any_known_busy(&self) -> bool {
        self.busy_streams.load(Relaxed) != 0
    }

    /// The streams among `streams` known busy now, as the bits `bit(i)` of the `i`-th: the last
    /// question about it (`learn_idle`, asked before every wait for it) found it
    /// busy, and its backoff has not run out — where it has, it is asked again (one `cuStreamQuery`):
    /// idle, it is busy no more. Streams never found busy are not. No device call otherwise; none at
    /// all while no stream is known busy (every replay).
    pub fn known_busy(
        &self,
        streams: impl IntoIterator<Item = StreamId>,
        bit: impl Fn(usize) -> u64,
    ) -> u64 {
        if !self.any_known_busy() {
            return 0;
        }
        let mut g = self.lock();
        let mut bits = 0;
        for (k, s) in streams.into_iter().enumerate() {
            if self.still_busy(&mut g, s) {
                bits |= bit(k);
            }
        }
        bits
    }

    /// Ask each stream known busy again now, past its backoff (one `cuStreamQuery` each), under the
    /// pool's lock: for a commit about to make a page because it passed over a busy stream's free
    /// pages, and placement about to give best fit up for a busy stream's sake
    /// ([`Region::ask_busy_again`](crate::Region::ask_busy_again)). The backoff counts questions, not
    /// time, so a stream that went idle would otherwise stay "busy" for up to 2^[`BUSY_BACKOFF`] more
    /// of them, and each of its pages passed over is a page made. Returns whether any of them is idle
    /// now.
    pub(crate) fn ask_busy_again_locked(&self, g: &mut Inner) -> bool {
        let mut idle = false;
        for i in 0..g.stream_fences.len() {
            if g.stream_fences[i].busy != 0 {
                g.stream_fences[i].skip = 0;
                let s = g.stream_fences[i].stream;
                idle |= self.learn_idle(g, i, s);
            }
        }
        idle
    }

    /// Whether `stream` is known busy: the last question found it so and its backoff has not run out,
    /// or it ran out and the question asked now (`learn_idle`) hears busy again. A stream never found
    /// busy (or never seen) is not.
    pub(crate) fn still_busy(&self, g: &mut Inner, stream: StreamId) -> bool {
        match g.stream_fences.iter().position(|sf| sf.stream == stream) {
            Some(i) => g.stream_fences[i].busy != 0 && !self.learn_idle(g, i, stream),
            None => false,
        }
    }

    /// Make `target` wait on the device for a fence of `after` covering epoch `epoch` (the newest one
    /// recorded there if recent enough, else a new one) — unless it already waited for one that covers
    /// it, or the device answers that the work is done (a covering fence completed,
    /// [`learn_complete`](Self::learn_complete); `after` idle, [`learn_idle`](Self::learn_idle)): then
    /// nothing is recorded or waited for. Returns an epoch of `after` that `target` is ordered after
    /// (or that is complete).
    pub(crate) fn wait_fence(
        &self,
        g: &mut Inner,
        target: StreamId,
        after: StreamId,
        epoch: u64,
    ) -> Result<u64, VmmError> {
        let i = Self::stream_entry(g, after);
        if let Some(&(_, w)) = g.stream_fences[i]
            .waited
            .iter()
            .find(|&&(t, w)| t == target && w >= epoch)
        {
            return Ok(w);
        }
        if self.learn_complete(g, i, epoch) {
            return Ok(epoch);
        }
        if self.learn_idle(g, i, after) {
            return Ok(epoch);
        }
        let (ev, e) = self.fence_on(g, after, epoch)?;
        self.device.stream_wait_event(target, ev)?;
        g.stats.stream_waits += 1;
        let sf = &mut g.stream_fences[i];
        match sf.waited.iter_mut().find(|(t, _)| *t == target) {
            Some(w) => w.1 = w.1.max(e),
            None => sf.waited.push((target, e)),
        }
        Ok(e)
    }

    /// Whether `stream`'s work stamped up to `epoch` is known complete, or learned so by asking the
    /// device (`learn_complete`, `learn_idle`: the questions `wait_fence` asks before it waits) — for a
    /// page about to move, which needs no fence of its last users' stream when they are done.
    pub(crate) fn ask_idle(&self, g: &mut Inner, stream: StreamId, epoch: u64) -> bool {
        if Self::idle(g, Some(stream), epoch) {
            return true;
        }
        let i = Self::stream_entry(g, stream);
        self.learn_complete(g, i, epoch) || self.learn_idle(g, i, stream)
    }

    /// Whether the work of stream fences `i` up to epoch `epoch` has completed, asking the device when a
    /// fence recorded there covers it: the pending fences oldest first, up to the first one covering
    /// it. A wait on a completed fence orders nothing, and `cuStreamWaitEvent` costs about as much host
    /// time as the question, which one answer settles for every later waiter. A fence found pending is
    /// not asked about again before a newer fence is recorded anywhere (the pool's epoch moves): under
    /// load, questions stay at most one per fence recorded, not one per waiter. Never during a capture.
    fn learn_complete(&self, g: &mut Inner, i: usize, epoch: u64) -> bool {
        let (now, sf, spare) = fences_of(g, i);
        if epoch < sf.done {
            return true;
        }
        let covered = sf.fences.back().is_some_and(|&(e, _)| e >= epoch);
        if !covered || sf.asked == now || self.capturing() {
            return false;
        }
        while let Some(&(_, ev)) = sf.fences.front() {
            match self.device.event_query(ev) {
                Ok(true) => {
                    if sf.retire_front(spare).is_some_and(|e| e >= epoch) {
                        break;
                    }
                }
                answer => {
                    if let Err(e) = answer {
                        log::debug!("gen-vmm: asking whether a stream's fence completed: {e}");
                    }
                    sf.asked = now;
                    break;
                }
            }
        }
        epoch < sf.done
    }

    /// Whether everything queued on `after` (stream fences `i`) so far has completed, by one
    /// `cuStreamQuery` — asked where no fence covers the work a stream must wait for, which would
    /// otherwise cost a new fence and a wait (`cuEventRecord` and `cuStreamWaitEvent`, each about a
    /// question's host time). When it has, every fence of `after` is complete too and goes. A stream
    /// found busy is asked less often (after 1, 2, 4, … 64 more such waits; once idle again, every
    /// time), so that under load the questions stay a small part of the waits they could not save.
    /// Never during a capture.
    pub(crate) fn learn_idle(&self, g: &mut Inner, i: usize, after: StreamId) -> bool {
        let (now, sf, spare) = fences_of(g, i);
        if sf.skip > 0 {
            sf.skip -= 1;
            return false;
        }
        if self.capturing() {
            return false;
        }
        match self.device.stream_query(after) {
            Ok(true) => {
                // Everything of `after` stamped up to now is complete; the epoch moves on (as a
                // synchronize moves it, `all_complete`) so that what is freed after this answer is not.
                if sf.busy != 0 {
                    self.busy_streams.fetch_sub(1, Relaxed);
                }
                sf.busy = 0;
                while sf.retire_front(spare).is_some() {}
                sf.done = sf.done.max(now + 1);
                g.epoch = now + 1;
                true
            }
            answer => {
                if let Err(e) = answer {
                    // Taken as busy: the fence and the wait that follow report a device that fails.
                    log::debug!("gen-vmm: asking whether stream {after:#x} is idle: {e}");
                }
                if sf.busy == 0 {
                    self.busy_streams.fetch_add(1, Relaxed);
                }
                sf.busy = (sf.busy + 1).min(BUSY_BACKOFF);
                sf.skip = (1 << sf.busy) - 1;
                false
            }
        }
    }

    /// Synchronize the device (a host wait) and take everything freed so far as idle. For callers whose
    /// device-side ordering failed; nothing on a warm path calls it.
    pub fn synchronize(&self) -> Result<(), VmmError> {
        if self.capturing() {
            return Err(VmmError::Capturing("a device synchronize"));
        }
        let mut g = self.lock();
        let mut synced = false;
        self.sync_all(&mut g, &mut synced)?;
        if let Err(e) = self.reap_zombies(&mut g, false) {
            log::error!("gen-vmm: unmapping old mappings after a synchronize: {e}");
        }
        Ok(())
    }

    /// Tell the pool the device has just been synchronized: every page freed so far is idle, and old
    /// mappings left by moves can go (those past the number kept, with
    /// [`PagePoolConfig::keep_old_mappings`]).
    ///
    /// [`PagePoolConfig::keep_old_mappings`]: crate::PagePoolConfig::keep_old_mappings
    pub fn synchronized(&self) {
        let mut g = self.lock();
        self.all_complete(&mut g);
        if let Err(e) = self.reap_zombies(&mut g, false) {
            log::error!("gen-vmm: unmapping old mappings after a synchronize: {e}");
        }
    }

    /// Everything queued so far is complete (the caller synchronized the device).
    pub(crate) fn all_complete(&self, g: &mut Inner) {
        g.done_epoch = g.epoch + 1;
        g.epoch += 1;
        while let Some((_, ev)) = g.fences.pop_front() {
            g.spare_events.push(ev);
        }
        let Inner {
            stream_fences,
            spare_events,
            done_epoch,
            ..
        } = g;
        for sf in stream_fences.iter_mut() {
            spare_events.extend(sf.fences.drain(..).map(|(_, ev)| ev));
            sf.done = *done_epoch;
        }
    }

    /// Whether a page or mapping stamped with `epoch` is idle: a device-wide fence (one stream) or a
    /// synchronize has passed it, or a fence of `stream` has.
    pub(crate) fn idle(g: &Inner, stream: Option<StreamId>, epoch: u64) -> bool {
        epoch < g.done_epoch
            || stream.is_some_and(|s| {
                g.stream_fences
                    .iter()
                    .any(|sf| sf.stream == s && epoch < sf.done)
            })
    }

    /// The index of `stream`'s entry in the stream fences, made if new.
    pub(crate) fn stream_entry(g: &mut Inner, stream: StreamId) -> usize {
        match g.stream_fences.iter().position(|sf| sf.stream == stream) {
            Some(i) => i,
            None => {
                g.stream_fences.push(StreamFences {
                    stream,
                    fences: VecDeque::new(),
                    done: 0,
                    waited: Vec::new(),
                    asked: u64::MAX,
                    busy: 0,
                    skip: 0,
                });
                g.stream_fences.len() - 1
            }
        }
    }

    /// The [`Page::freed_on`] bit of `stream` (its entry in the stream fences, made if new).
    ///
    /// [`Page::freed_on`]: crate::page::Page::freed_on
    pub(crate) fn stream_bit(g: &mut Inner, stream: StreamId) -> u64 {
        let i = Self::stream_entry(g, stream);
        if i < 63 {
            1 << i
        } else {
            UNKNOWN_STREAM
        }
    }

    /// The streams of a [`Page::freed_on`] mask, or `None` when it holds [`UNKNOWN_STREAM`].
    ///
    /// [`Page::freed_on`]: crate::page::Page::freed_on
    pub(crate) fn mask_streams(g: &Inner, mask: u64) -> Option<Vec<StreamId>> {
        if mask & UNKNOWN_STREAM != 0 {
            return None;
        }
        Some(
            (0..63)
                .filter(|i| mask & (1 << i) != 0)
                .filter_map(|i| g.stream_fences.get(i).map(|sf| sf.stream))
                .collect(),
        )
    }

    /// The one stream `mask` names, if it names exactly one known stream (no list built: this runs for
    /// every page a move settles).
    pub(crate) fn mask_stream(g: &Inner, mask: u64) -> Option<StreamId> {
        if mask & UNKNOWN_STREAM != 0 || mask.count_ones() != 1 {
            return None;
        }
        g.stream_fences
            .get(mask.trailing_zeros() as usize)
            .map(|sf| sf.stream)
    }

    /// A fence on `stream` covering everything queued there up to epoch `epoch`: the newest one recorded
    /// there if it is that recent, else a new one. Returns its event and epoch.
    pub(crate) fn fence_on(
        &self,
        g: &mut Inner,
        stream: StreamId,
        epoch: u64,
    ) -> Result<(EventHandle, u64), VmmError> {
        let i = Self::stream_entry(g, stream);
        if let Some(&(e, ev)) = g.stream_fences[i].fences.back() {
            if e >= epoch {
                return Ok((ev, e));
            }
        }
        self.bound_epoch_lag(g)?;
        if g.stream_fences[i].fences.len() >= MAX_FENCES {
            self.poll_fences(g);
        }
        self.push_fence(g, Some(i), stream)
    }

    /// Record a fence on `stream` into a queue (`None`: the device-wide fences; `Some(i)`: stream fences
    /// `i`) at the current epoch, which it then advances: a new event, or — the queue full — its newest
    /// recorded again, here, so that the queue stays bounded without a host wait (the device lags far
    /// behind, or the stream waits on work the host has yet to queue). Stream waits already queued on
    /// that event keep the point it had then (a wait takes an event's latest record at the time of the
    /// call), and its completion now says more (the later epoch), never less than is true: what it
    /// covered stays pending until this point is done. Returns the event and its epoch.
    fn push_fence(
        &self,
        g: &mut Inner,
        queue: Option<usize>,
        stream: StreamId,
    ) -> Result<(EventHandle, u64), VmmError> {
        let e = g.epoch;
        let q = match queue {
            None => &mut g.fences,
            Some(i) => &mut g.stream_fences[i].fences,
        };
        let ev = if q.len() >= MAX_FENCES {
            let back = q.back_mut().expect("a full queue");
            self.device.event_record(back.1, stream)?;
            back.0 = e;
            back.1
        } else {
            let ev = match g.spare_events.pop() {
                Some(ev) => ev,
                None => self.device.event_create()?,
            };
            if let Err(err) = self.device.event_record(ev, stream) {
                g.spare_events.push(ev);
                return Err(err.into());
            }
            q.push_back((e, ev));
            ev
        };
        g.epoch += 1;
        g.stats.fences += 1;
        Ok((ev, e))
    }

    /// The oldest fence has completed: everything freed up to its epoch is idle; its event is reused.
    pub(crate) fn retire_oldest_fence(g: &mut Inner) {
        if let Some((epoch, ev)) = g.fences.pop_front() {
            g.spare_events.push(ev);
            g.done_epoch = g.done_epoch.max(epoch + 1);
        }
    }

    /// Learn which fences have completed (one `event_query` per fence, oldest first, stopping at the first
    /// pending one).
    pub(crate) fn poll_fences(&self, g: &mut Inner) {
        while let Some(&(_, ev)) = g.fences.front() {
            match self.device.event_query(ev) {
                Ok(true) => Self::retire_oldest_fence(g),
                Ok(false) => break,
                Err(e) => {
                    // A fence that cannot be queried is treated as pending; a synchronize clears it.
                    log::debug!("gen-vmm: querying a fence: {e}");
                    break;
                }
            }
        }
        let Inner {
            stream_fences,
            spare_events,
            ..
        } = g;
        for sf in stream_fences.iter_mut() {
            while let Some(&(_, ev)) = sf.fences.front() {
                match self.device.event_query(ev) {
                    Ok(true) => {
                        sf.retire_front(spare_events);
                    }
                    Ok(false) => break,
                    Err(err) => {
                        log::debug!("gen-vmm: querying a stream's fence: {err}");
                        break;
                    }
                }
            }
        }
    }

    /// Record a fence on the fence stream covering everything queued so far. Returns false when there is
    /// no fence stream or recording failed (the caller then synchronizes instead).
    pub(crate) fn record_fence(&self, g: &mut Inner) -> bool {
        let Some(stream) = g.fence_stream else {
            return false;
        };
        if let Err(e) = self.bound_epoch_lag(g) {
            log::debug!("gen-vmm: bounding the fences' lag: {e}");
            return false;
        }
        match self.push_fence(g, None, stream) {
            Ok(_) => true,
            Err(e) => {
                log::debug!("gen-vmm: recording a fence on stream {stream:#x}: {e}");
                false
            }
        }
    }

    /// Keep the epochs of work not known complete within [`MAX_EPOCH_LAG`] of the newest, the window in
    /// which [`PageHot`] compares them (its epochs are kept modulo 2^31): past it, synchronize. Fences
    /// are recorded again rather than waited for when their queues are full, so only this bounds the
    /// lag; it takes 2^29 fences recorded while none completes.
    ///
    /// [`PageHot`]: crate::page::PageHot
    fn bound_epoch_lag(&self, g: &mut Inner) -> Result<(), VmmError> {
        // Never during a capture (a synchronize would invalidate it): the bound waits for the next call.
        if g.epoch.saturating_sub(g.done_epoch) >= MAX_EPOCH_LAG && !self.capturing() {
            self.device.synchronize()?;
            g.stats.syncs += 1;
            self.all_complete(g);
        }
        Ok(())
    }

    /// Synchronize the device (once per commit: `synced`) and mark everything idle.
    pub(crate) fn sync_all(&self, g: &mut Inner, synced: &mut bool) -> Result<(), VmmError> {
        if !*synced {
            self.device.synchronize()?;
            g.stats.syncs += 1;
            *synced = true;
            self.all_complete(g);
        }
        Ok(())
    }
}

#[cfg(test)]
mod epoch_lag_tests {
    use super::*;
    use crate::PagePoolConfig;
    use gen_device::sim::SimDevice;
    use gen_device::Device;
    use std::sync::Arc;

    fn pool() -> (Arc<SimDevice>, Arc<PagePool>) {
        let dev = Arc::new(SimDevice::new());
        let pages =
            PagePool::new(dev.clone() as Arc<dyn Device>, PagePoolConfig::default()).unwrap();
        (dev, pages)
    }

    /// Fences recorded again instead of waited for leave only the lag bound to keep the epochs of work
    /// not known complete inside the window pages compare them in: at `MAX_EPOCH_LAG` a fence first
    /// synchronizes (everything is then complete), below it not; during a capture never.
    #[test]
    fn the_epoch_lag_is_bounded_by_one_synchronize_and_never_during_a_capture() {
        let (dev, pages) = pool();
        let (s, t) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
        // t runs (a stream found idle needs no fence at all).
        dev.pause_stream(t).unwrap();
        // Just below the bound: an ordering records a fence, no synchronize.
        {
            let mut g = pages.lock();
            g.epoch = g.done_epoch + MAX_EPOCH_LAG - 1;
        }
        let syncs = dev.call_counts().device_syncs;
        pages.order_after(s, t).unwrap();
        assert_eq!(dev.call_counts().device_syncs, syncs);
        // Found busy, t is not asked again at the next ordering (`learn_idle`'s backoff), which
        // records a fence as well: resumed, so that the synchronize below can complete.
        dev.resume_stream(t).unwrap();
        // At the bound: one synchronize, and every earlier epoch is then complete.
        {
            let mut g = pages.lock();
            g.epoch = g.done_epoch + MAX_EPOCH_LAG;
        }
        pages.order_after(s, t).unwrap();
        assert_eq!(dev.call_counts().device_syncs, syncs + 1);
        {
            let g = pages.lock();
            assert!(
                g.epoch - g.done_epoch < 4,
                "all complete after the synchronize"
            );
        }
        // During a capture the bound waits: the device-wide fence records without a synchronize.
        {
            let mut g = pages.lock();
            g.epoch = g.done_epoch + MAX_EPOCH_LAG;
        }
        dev.captures().begin();
        {
            let mut g = pages.lock();
            g.fence_stream = Some(s);
            assert!(pages.record_fence(&mut g), "a fence, no synchronize");
        }
        assert!(dev.captures().end());
        assert_eq!(dev.call_counts().device_syncs, syncs + 1);
    }

    /// A fence question for work between two fences (no fence of exactly its epoch): the pending fences
    /// are asked oldest first until one covering it has completed — the first alone does not cover it.
    /// Each fence is asked about once; a pending fence is not asked about again until a newer fence is
    /// recorded.
    #[test]
    fn a_fence_question_walks_the_pending_fences_up_to_the_covering_one() {
        let (dev, pages) = pool();
        let (s, t, u) = (
            dev.stream_create().unwrap(),
            dev.stream_create().unwrap(),
            dev.stream_create().unwrap(),
        );
        pages.several_streams();
        dev.pause_stream(t).unwrap();
        let mut g = pages.lock();
        let i = PagePool::stream_entry(&mut g, t);
        let k = PagePool::stream_entry(&mut g, u);
        // Two fences on t at epochs e1 < e2, work stamped strictly between them (a fence on u between).
        let (_, e1) = pages.push_fence(&mut g, Some(i), t).unwrap();
        let between = g.epoch;
        pages.push_fence(&mut g, Some(k), u).unwrap();
        let (_, e2) = pages.push_fence(&mut g, Some(i), t).unwrap();
        assert!(e1 < between && between < e2);
        // t runs: the question finds the oldest fence pending and stops there.
        let q0 = dev.call_counts().event_queries;
        assert!(!pages.learn_complete(&mut g, i, between));
        assert_eq!(dev.call_counts().event_queries, q0 + 1);
        // Asked again before any newer fence: no question.
        assert!(!pages.learn_complete(&mut g, i, between));
        assert_eq!(dev.call_counts().event_queries, q0 + 1);
        // t completes; a newer fence anywhere (on u) lets the question be asked again: both fences
        // are asked about, the second covers the work.
        dev.resume_stream(t).unwrap();
        pages.push_fence(&mut g, Some(k), u).unwrap();
        let q1 = dev.call_counts().event_queries;
        assert!(pages.learn_complete(&mut g, i, between));
        assert_eq!(dev.call_counts().event_queries, q1 + 2);
        assert!(
            PagePool::idle(&g, Some(t), e2),
            "done past the covering fence"
        );
        // Known now: no question, and a wait on it is none.
        let before = dev.call_counts();
        assert_eq!(pages.wait_fence(&mut g, s, t, between).unwrap(), between);
        assert_eq!(dev.call_counts(), before);
        assert!(!dev.waits_on(s, t));
    }
}
