//! `Handoff`: the stream rule for blocks of a range several streams use, on the simulated device. A
//! stream may reuse a block freed on another only once it waits (on the device) for that stream's work;
//! the sole allocator freeing its own blocks makes no device call.

use std::sync::Arc;

use gen_device::sim::SimDevice;
use gen_device::Device;
use gen_vmm::{Handoff, PagePool, PagePoolConfig, VmmError};

fn setup() -> (Arc<SimDevice>, Arc<PagePool>) {
    let dev = Arc::new(SimDevice::new());
    let pages = PagePool::new(dev.clone() as Arc<dyn Device>, PagePoolConfig::default()).unwrap();
    (dev, pages)
}

fn three_streams(dev: &SimDevice) -> (u64, u64, u64) {
    (
        dev.stream_create().unwrap(),
        dev.stream_create().unwrap(),
        dev.stream_create().unwrap(),
    )
}

/// `t`'s work so far is still running (paused, with an event recorded so it has pending work).
fn busy(dev: &SimDevice, t: u64) {
    dev.pause_stream(t).unwrap();
    let ev = dev.event_create().unwrap();
    dev.event_record(ev, t).unwrap();
}

#[test]
fn the_sole_allocator_makes_no_device_call() {
    let (dev, pages) = setup();
    let s = dev.stream_create().unwrap();
    let h = Handoff::owned_by(s);
    let before = dev.call_counts();
    for _ in 0..100 {
        h.enter(&pages, s).unwrap();
        h.freed(&pages, s).unwrap();
    }
    let after = dev.call_counts();
    assert_eq!(
        (after.event_records, after.stream_waits, after.waits),
        (before.event_records, before.stream_waits, before.waits)
    );
    assert_eq!(h.sole(), Some(s));
}

#[test]
fn a_foreign_free_orders_the_allocator_after_the_freeing_stream() {
    let (dev, pages) = setup();
    let (s, t) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
    let h = Handoff::owned_by(s);
    busy(&dev, t);
    assert!(!dev.waits_on(s, t));
    let host_waits = dev.call_counts().waits;
    h.freed(&pages, t).unwrap();
    assert!(dev.waits_on(s, t), "s waits for t's queued work");
    assert_eq!(dev.call_counts().waits, host_waits, "on the device only");
    // `t` only freed: it does not become an allocator, and `s` keeps its fast path.
    assert_eq!(h.sole(), Some(s));
    dev.resume_stream(t).unwrap();
}

#[test]
fn a_new_allocator_waits_once_for_earlier_frees_and_then_each_free_orders_the_others() {
    let (dev, pages) = setup();
    let (s, t, u) = three_streams(&dev);
    let h = Handoff::new();
    h.enter(&pages, s).unwrap();
    assert_eq!(h.sole(), Some(s));
    busy(&dev, s);
    // `s` frees on the fast path (sole allocator); `t` arriving later still waits for it.
    h.freed(&pages, s).unwrap();
    h.enter(&pages, t).unwrap();
    assert!(
        dev.waits_on(t, s),
        "a new allocator waits for the frees before it"
    );
    assert_eq!(h.sole(), None, "two allocators: no fast path");
    let waits = dev.call_counts().stream_waits;
    h.enter(&pages, t).unwrap();
    assert_eq!(dev.call_counts().stream_waits, waits, "only the first time");
    dev.resume_stream(s).unwrap();
    // A free on `u` (not an allocator) orders both allocators after `u`.
    busy(&dev, u);
    h.freed(&pages, u).unwrap();
    assert!(dev.waits_on(s, u) && dev.waits_on(t, u));
    dev.resume_stream(u).unwrap();
    // A free on `t` orders `s` after `t`.
    busy(&dev, t);
    h.freed(&pages, t).unwrap();
    assert!(dev.waits_on(s, t));
    dev.resume_stream(t).unwrap();
}

#[test]
fn during_a_capture_an_ordering_is_a_typed_error_and_changes_nothing() {
    let (dev, pages) = setup();
    let (s, t) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
    let h = Handoff::owned_by(s);
    dev.begin_capture(s).unwrap();
    dev.captures().begin();
    // The sole allocator's own free needs nothing: allowed.
    h.freed(&pages, s).unwrap();
    assert!(matches!(h.freed(&pages, t), Err(VmmError::Capturing(_))));
    assert!(matches!(h.enter(&pages, t), Err(VmmError::Capturing(_))));
    assert_eq!(h.sole(), Some(s), "t did not join");
    assert!(dev.captures().end());
    dev.end_capture()
        .expect("the capture stayed valid: no forbidden call");
    h.freed(&pages, t).unwrap();
}

/// Lazy ordering (the arena the streams after the first share): a free makes no device call and only
/// stamps the bytes; the stream that gets them waits for the streams the stamp names, once per
/// hand-over, and never for its own frees.
#[test]
fn lazy_frees_stamp_and_the_next_user_waits_only_for_the_streams_named() {
    let (dev, pages) = setup();
    let (s, t, u) = three_streams(&dev);
    let h = Handoff::new();
    for st in [s, t, u] {
        h.join_lazily(st);
    }
    assert_eq!(h.sole(), None, "three allocators");
    busy(&dev, s);
    busy(&dev, t);
    let before = dev.call_counts();
    let by_s = h.freed_lazily(s);
    let by_t = h.freed_lazily(t);
    assert_eq!(dev.call_counts(), before, "a free makes no device call");
    assert!(!by_s.is_none() && !by_t.is_none());
    // s's own bytes: nothing to wait for.
    h.before_use(&pages, s, by_s).unwrap();
    assert_eq!(dev.call_counts(), before);
    // u gets s's bytes: it waits for s (one fence on s, one wait), not for t.
    assert!(h.pending(u, by_s));
    h.before_use(&pages, u, by_s).unwrap();
    assert!(dev.waits_on(u, s), "u is ordered after s's queued work");
    assert!(
        !dev.waits_on(u, t),
        "not after t's: the bytes never were t's"
    );
    let once = dev.call_counts();
    assert_eq!(
        (
            once.event_records - before.event_records,
            once.stream_waits - before.stream_waits,
            once.waits
        ),
        (1, 1, before.waits),
        "one fence, one wait, no host wait"
    );
    // Again, or bytes s freed before that wait: nothing more.
    assert!(!h.pending(u, by_s));
    h.before_use(&pages, u, by_s).unwrap();
    assert_eq!(dev.call_counts(), once);
    // Bytes both freed (an extent that coalesced the two): u still owes t a wait, and only that.
    let both = by_s.merge(by_t);
    h.before_use(&pages, u, both).unwrap();
    assert!(dev.waits_on(u, t));
    let after_t = dev.call_counts();
    assert_eq!(after_t.stream_waits - once.stream_waits, 1);
    // t needs s's work up to the same free: it waits on the fence u's ordering recorded, no new one.
    h.before_use(&pages, t, by_s).unwrap();
    assert!(dev.waits_on(t, s));
    let last = dev.call_counts();
    assert_eq!(
        last.event_records, after_t.event_records,
        "the fence is shared"
    );
    assert_eq!(last.stream_waits, after_t.stream_waits + 1);
    // A later free by s is a new hand-over.
    let again = h.freed_lazily(s);
    assert!(h.pending(u, again));
    dev.resume_stream(s).unwrap();
    dev.resume_stream(t).unwrap();
}

/// A stamp names streams by their place in the handoff: more freers than it has bits (16) share them by
/// residue, and a user of their bytes waits for every freer of the bit — and for no other.
#[test]
fn lazy_stamps_past_their_bits_name_the_freers_sharing_a_bit() {
    let (dev, pages) = setup();
    let streams: Vec<u64> = (0..40).map(|_| dev.stream_create().unwrap()).collect();
    for &s in &streams {
        busy(&dev, s);
    }
    let h = Handoff::new();
    let stamps: Vec<_> = streams.iter().map(|&s| h.freed_lazily(s)).collect();
    let user = dev.stream_create().unwrap();
    // The 20th freer's bytes (bit 3): ordered after the freers 3, 19 and 35, no other.
    h.before_use(&pages, user, stamps[19]).unwrap();
    for (i, &s) in streams.iter().enumerate() {
        assert_eq!(dev.waits_on(user, s), i % 16 == 3, "stream {i}");
    }
    assert!(!h.pending(user, stamps[19]));
    assert!(
        !h.pending(user, stamps[35]),
        "a stamp of the same bit needs nothing more"
    );
    assert!(h.pending(user, stamps[4]));
    for &s in &streams {
        dev.resume_stream(s).unwrap();
    }
}

/// During a capture a needed ordering is a typed error (the capture stays valid); bytes that need none
/// are still usable.
#[test]
fn lazy_ordering_during_a_capture_is_a_typed_error() {
    let (dev, pages) = setup();
    let (s, t) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
    let h = Handoff::new();
    let by_s = h.freed_lazily(s);
    let by_t = h.freed_lazily(t);
    dev.begin_capture(t).unwrap();
    dev.captures().begin();
    assert!(matches!(
        h.before_use(&pages, t, by_s),
        Err(VmmError::Capturing(_))
    ));
    h.before_use(&pages, t, by_t).unwrap();
    assert!(dev.captures().end());
    dev.end_capture()
        .expect("the capture stayed valid: no forbidden call");
    h.before_use(&pages, t, by_s).unwrap();
    assert!(!h.pending(t, by_s));
}

/// A freeing stream the device never gets to (paused; its fences never complete): each of a thousand
/// foreign frees still orders the allocator after that stream's work so far — the last one included —
/// on the device, with no host wait (a full fence queue records its newest fence again). A host wait
/// here would hang (the simulator refuses it): the failure the property test found in the buddy.
#[test]
fn foreign_frees_past_the_fence_queue_order_on_the_device_with_no_host_wait() {
    let (dev, pages) = setup();
    let (s, t) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
    let h = Handoff::owned_by(s);
    dev.pause_stream(t).unwrap();
    let host_waits = dev.call_counts().waits;
    let work = dev.event_create().unwrap();
    for i in 0..1000 {
        // t's latest work (an event record stands in for a kernel)...
        dev.event_record(work, t).unwrap();
        h.freed(&pages, t)
            .unwrap_or_else(|e| panic!("free {i} on the paused stream: {e}"));
        // ...is what s waits for now.
        assert!(
            dev.waits_for_event(s, work),
            "free {i}: s waits for t's latest work"
        );
    }
    let c = dev.call_counts();
    assert_eq!(c.waits, host_waits, "no host wait");
    assert!(
        c.event_records >= 2000,
        "a fence each free: {}",
        c.event_records
    );
    assert!(pages.stats().fences >= 1000);
    dev.resume_stream(t).unwrap();
    dev.synchronize().unwrap();
    assert!(!dev.waits_on(s, t));
}

/// A stream reusing bytes whose freer's fence another stream already waited on asks the device whether
/// that fence has completed before waiting on it (session 27): a completed fence needs no wait, and
/// from then on no question either; a pending one is asked about once — not by every waiter — until a
/// newer fence is recorded.
#[test]
fn a_completed_fence_is_learned_once_and_needs_no_wait() {
    let (dev, pages) = setup();
    let (s, t, u) = three_streams(&dev);
    let (v, w) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
    let h = Handoff::new();
    for st in [s, t, u, v, w] {
        h.join_lazily(st);
    }
    busy(&dev, s);
    let by_s = h.freed_lazily(s);
    let c0 = dev.call_counts();
    // The first user: a fence on s, a wait on it.
    h.before_use(&pages, t, by_s).unwrap();
    let c1 = dev.call_counts();
    assert_eq!(
        (
            c1.event_records - c0.event_records,
            c1.stream_waits - c0.stream_waits
        ),
        (1, 1)
    );
    assert!(dev.waits_on(t, s));
    // s still runs: the second user asks once, finds the fence pending, and waits on it.
    h.before_use(&pages, u, by_s).unwrap();
    let c2 = dev.call_counts();
    assert!(dev.waits_on(u, s), "a pending fence is waited on");
    assert_eq!(
        (
            c2.event_queries - c1.event_queries,
            c2.stream_waits - c1.stream_waits,
            c2.event_records - c1.event_records
        ),
        (1, 1, 0),
        "one question, one wait, the fence shared"
    );
    // A third user before any newer fence: no second question about the same pending fence.
    h.before_use(&pages, v, by_s).unwrap();
    let c3 = dev.call_counts();
    assert!(dev.waits_on(v, s));
    assert_eq!(
        (
            c3.event_queries - c2.event_queries,
            c3.stream_waits - c2.stream_waits
        ),
        (0, 1)
    );
    // s's work completes (no host wait by anyone). Not asked again before a newer fence: the next
    // hand-over (u reusing t's bytes) records one.
    dev.resume_stream(s).unwrap();
    busy(&dev, t);
    let by_t = h.freed_lazily(t);
    h.before_use(&pages, u, by_t).unwrap();
    assert!(dev.waits_on(u, t));
    // The next user of s's bytes learns with one question that s's fence completed, and makes no
    // device-side wait.
    let c4 = dev.call_counts();
    h.before_use(&pages, w, by_s).unwrap();
    let c5 = dev.call_counts();
    assert!(
        !dev.waits_on(w, s),
        "s's work is complete: nothing to wait for"
    );
    assert_eq!(c5.stream_waits, c4.stream_waits);
    assert_eq!(c5.event_records, c4.event_records);
    assert_eq!(c5.waits, c4.waits, "no host wait");
    assert!(c5.event_queries > c4.event_queries, "learned by asking");
    // Known complete now: the same bytes for another stream cost no call at all.
    let x = dev.stream_create().unwrap();
    h.join_lazily(x);
    h.before_use(&pages, x, by_s).unwrap();
    assert_eq!(dev.call_counts(), c5);
    assert!(!dev.waits_on(x, s));
    dev.resume_stream(t).unwrap();
}

/// A stream about to wait for another whose queued work no fence covers yet asks first whether that
/// stream is idle (`cuStreamQuery`, session 27): idle, no fence and no wait — and what the stream
/// frees after that answer is still ordered; busy, the fence and the wait as before, and the stream is
/// asked less often while it stays busy.
#[test]
fn an_idle_freer_needs_no_fence_and_a_busy_one_is_asked_less_often() {
    let (dev, pages) = setup();
    let (s, t, u) = three_streams(&dev);
    let h = Handoff::new();
    for st in [s, t, u] {
        h.join_lazily(st);
    }
    // s idle: one question, nothing recorded, nothing waited on.
    let first = h.freed_lazily(s);
    let c0 = dev.call_counts();
    h.before_use(&pages, t, first).unwrap();
    let c1 = dev.call_counts();
    assert_eq!(c1.stream_queries - c0.stream_queries, 1);
    assert_eq!(
        (c1.event_records, c1.stream_waits, c1.waits),
        (c0.event_records, c0.stream_waits, c0.waits),
        "an idle freer: no fence, no wait, no host wait"
    );
    assert!(!dev.waits_on(t, s));
    // The answer covered what s had freed: u needs no call for the same bytes.
    h.before_use(&pages, u, first).unwrap();
    assert_eq!(dev.call_counts(), c1);
    // s runs again and frees more: that free is after the answer, and is ordered.
    busy(&dev, s);
    let second = h.freed_lazily(s);
    let c2 = dev.call_counts();
    h.before_use(&pages, t, second).unwrap();
    let c3 = dev.call_counts();
    assert!(dev.waits_on(t, s), "a busy freer is waited for");
    assert_eq!(
        (
            c3.stream_queries - c2.stream_queries,
            c3.event_records - c2.event_records,
            c3.stream_waits - c2.stream_waits
        ),
        (1, 1, 1),
        "asked, found busy: a fence and a wait"
    );
    // Busy: the next new hand-over from s waits without asking (backoff: one wait skips the question).
    let third = h.freed_lazily(s);
    h.before_use(&pages, u, third).unwrap();
    let c4 = dev.call_counts();
    assert!(dev.waits_on(u, s));
    assert_eq!(
        c4.stream_queries, c3.stream_queries,
        "not asked again at once"
    );
    assert_eq!(c4.stream_waits - c3.stream_waits, 1);
    dev.resume_stream(s).unwrap();
}
