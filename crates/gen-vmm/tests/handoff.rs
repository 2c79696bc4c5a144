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
    let (s, t, u) = (
        dev.stream_create().unwrap(),
        dev.stream_create().unwrap(),
        dev.stream_create().unwrap(),
    );
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
