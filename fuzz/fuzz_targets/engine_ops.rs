//! The engine driven by arbitrary programs on a host-backed simulated device: every block is filled
//! with its own byte pattern and checked when freed; results are the typed errors the API documents;
//! live blocks never overlap; at the end, after freeing every block and `trim`, nothing is held.
#![no_main]

use std::collections::BTreeMap;
use std::sync::Arc;

use arbitrary::Arbitrary;
use gen_device::sim::SimDevice;
use gen_device::{Device, EventHandle};
use genpool::{Config, FreeFault, GenpoolError, Hint, Lifetime, Pool, ALIGN};
use libfuzzer_sys::fuzz_target;

const MIB: u64 = 1 << 20;
const CAPACITY: u64 = 96 * MIB;
const STREAMS: usize = 12;

#[derive(Arbitrary, Debug)]
enum Action {
    Alloc {
        size: u32,
        /// Scale: 0-1 the bytes as given, 2 a multiple of 256 below 2 MiB, 3 beyond the device.
        scale: u8,
        stream: u8,
        lifetime: u8,
        site: Option<u8>,
    },
    Free {
        pick: u16,
        stream: u8,
    },
    DoubleFree {
        pick: u16,
        stream: u8,
    },
    ForeignFree {
        addr: u64,
    },
    Trim,
    Mark,
    Pause(u8),
    Resume(u8),
}

#[derive(Arbitrary, Debug)]
struct Input {
    config: u8,
    actions: Vec<Action>,
}

const CONFIGS: [&str; 5] = [
    "",
    "experimental.mid_tier:stream,experimental.long_tier:buddy,slab_max_size:64K",
    "experimental.stream_arenas:false,experimental.long_tier:buddy",
    "experimental.routing:single,eager_unmap:true",
    // The extent arenas' old generation firing all the time: blocks in both ranges of every arena.
    "old_generation:2",
];

fn check(dev: &SimDevice, ptr: u64, size: u64, pattern: u8) {
    let mut buf = vec![0u8; size as usize];
    dev.read(ptr, &mut buf).expect("a live block is readable");
    // One memcmp: a byte-by-byte scan would run the fuzzer's comparison hooks per byte.
    if buf != vec![pattern; size as usize] {
        let i = buf.iter().position(|&b| b != pattern).unwrap_or(0);
        panic!(
            "block {ptr:#x}+{size}: byte {i} is {:#x}, not {pattern:#x}",
            buf[i]
        );
    }
}

fuzz_target!(|input: Input| {
    let dev = Arc::new(
        SimDevice::config()
            .capacity(CAPACITY)
            .backed(true)
            .build()
            .unwrap(),
    );
    let cfg = Config::parse(CONFIGS[input.config as usize % CONFIGS.len()]).unwrap();
    let pool = Pool::new(dev.clone() as Arc<dyn Device>, cfg).unwrap();
    // The legacy stream and eleven more: past the slab's table of eight (frees there gather on a list
    // of their stream's own).
    let streams: Vec<u64> = std::iter::once(0)
        .chain((1..STREAMS).map(|_| dev.stream_create().unwrap()))
        .collect();
    let events: Vec<EventHandle> = (0..STREAMS).map(|_| dev.event_create().unwrap()).collect();
    let mut paused = [false; STREAMS];
    let mut live: BTreeMap<u64, (u64, u8)> = BTreeMap::new();
    let mut pattern = 0u8;
    for a in input.actions.iter().take(128) {
        match *a {
            Action::Alloc {
                size,
                scale,
                stream,
                lifetime,
                site,
            } => {
                let size = match scale % 4 {
                    0 | 1 => size as u64,
                    2 => (size as u64 % (2 * MIB / 256)) * 256,
                    _ => CAPACITY.saturating_add(size as u64),
                };
                let hint = Hint {
                    lifetime: [
                        None,
                        Some(Lifetime::Short),
                        Some(Lifetime::Mid),
                        Some(Lifetime::Long),
                    ][lifetime as usize % 4],
                    site: site.map(u64::from),
                };
                match pool.alloc(size, streams[stream as usize % STREAMS], hint) {
                    Ok(b) => {
                        assert!(size != 0 && size <= CAPACITY);
                        assert_eq!(b.ptr % ALIGN, 0);
                        assert_eq!(b.size, size.div_ceil(ALIGN) * ALIGN);
                        if let Some((&p, &(s, _))) = live.range(..b.ptr + b.size).next_back() {
                            assert!(p + s <= b.ptr, "{b:?} overlaps {p:#x}+{s}");
                        }
                        pattern = pattern.wrapping_add(1).max(1);
                        dev.write(b.ptr, &vec![pattern; b.size as usize]).unwrap();
                        live.insert(b.ptr, (b.size, pattern));
                    }
                    Err(GenpoolError::InvalidSize { .. }) => assert!(size == 0 || size > CAPACITY),
                    Err(GenpoolError::OutOfMemory(_)) => {}
                    // A wait on a paused stream is refused by the simulator rather than hanging.
                    Err(GenpoolError::Device(_)) if paused.iter().any(|&p| p) => {}
                    Err(e) => panic!("alloc({size}): {e}"),
                }
            }
            Action::Free { pick, stream } | Action::DoubleFree { pick, stream }
                if !live.is_empty() =>
            {
                let p = *live.keys().nth(pick as usize % live.len()).unwrap();
                let (size, pat) = live.remove(&p).unwrap();
                check(&dev, p, size, pat);
                assert_eq!(pool.free(p, streams[stream as usize % STREAMS]).unwrap(), size);
                if matches!(a, Action::DoubleFree { .. }) {
                    assert!(matches!(
                        pool.free(p, 0),
                        Err(GenpoolError::InvalidFree {
                            fault: FreeFault::DoubleFree,
                            ..
                        })
                    ));
                }
            }
            Action::Free { .. } | Action::DoubleFree { .. } => {}
            Action::ForeignFree { addr } => {
                if !live.contains_key(&addr) {
                    assert!(matches!(
                        pool.free(addr, 0),
                        Err(GenpoolError::InvalidFree { .. })
                    ));
                }
            }
            Action::Trim => {
                pool.trim();
            }
            Action::Mark => pool.mark_iteration(),
            Action::Pause(i) => {
                let i = i as usize % (STREAMS - 1) + 1;
                dev.pause_stream(streams[i]).unwrap();
                dev.event_record(events[i], streams[i]).unwrap();
                paused[i] = true;
            }
            Action::Resume(i) => {
                let i = i as usize % (STREAMS - 1) + 1;
                dev.resume_stream(streams[i]).unwrap();
                paused[i] = false;
            }
        }
        assert_eq!(pool.allocated(), live.values().map(|l| l.0).sum::<u64>());
        assert_eq!(pool.live_blocks(), live.len());
    }
    for &s in &streams[1..] {
        dev.resume_stream(s).unwrap();
    }
    for (p, (size, pat)) in std::mem::take(&mut live) {
        check(&dev, p, size, pat);
        pool.free(p, 0).unwrap();
    }
    pool.trim();
    assert_eq!(pool.reserved_now(), 0, "memory held after free all + trim");
    assert_eq!(
        dev.reserved().current,
        0,
        "device memory held after free all + trim"
    );
});
