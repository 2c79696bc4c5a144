//! The C ABI (what PyTorch calls) with hostile arguments on the simulated device (`GENPOOL_DEVICE=sim`):
//! any size, device index, stream handle, pointer, fraction and buffer length. Nothing may panic across
//! the boundary, crash or hang; pointers handed out are distinct, 512-byte aligned, and freeing them
//! works; foreign pointers are refused.
#![no_main]

use std::collections::BTreeMap;
use std::ffi::{c_char, c_void};
use std::sync::Once;

use arbitrary::Arbitrary;
use genpool_torch::*;
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
enum Call {
    Malloc {
        size: u32,
        big: bool,
        device: i8,
        stream: u8,
    },
    Free {
        pick: u16,
        size: u64,
        device: i8,
        stream: u8,
    },
    FreeRaw {
        addr: u64,
        size: u64,
        device: i32,
        stream: u64,
    },
    RecordStream {
        pick: u16,
        stream: u64,
    },
    Fraction {
        fraction: f64,
        device: i32,
    },
    Stats {
        device: i32,
        len: u16,
    },
    LastError {
        len: u16,
    },
    Trim {
        device: i32,
    },
    Mark {
        device: i32,
    },
    Reset,
    /// Only counts PyTorch never passes (negative, or above the devices used here), so later inputs keep
    /// their devices.
    Init {
        count: i32,
    },
}

static INIT: Once = Once::new();

fn stream(s: u8) -> cudaStream_t {
    // Stream 0 (NULL) and a few handles the simulated device has never created.
    std::ptr::without_provenance_mut(match s % 4 {
        0 => 0,
        n => 0x1000 * n as usize,
    })
}

fuzz_target!(|calls: Vec<Call>| {
    INIT.call_once(|| {
        // SAFETY (of the environment): set once, before any other thread reads the environment.
        std::env::set_var("GENPOOL_DEVICE", "sim");
    });
    // Device 0 serves the pointers this input frees again; indices are drawn from -128..127.
    let mut live: BTreeMap<u64, i32> = BTreeMap::new();
    for c in calls.iter().take(256) {
        match *c {
            Call::Malloc {
                size,
                big,
                device,
                stream: s,
            } => {
                let size = if big {
                    (size as usize) << 24
                } else {
                    size as usize
                };
                let device = (device % 4) as i32;
                let p = genpool_malloc(size, device, stream(s));
                if !p.is_null() {
                    let a = p.addr() as u64;
                    assert_eq!(a % 512, 0);
                    assert!(live.insert(a, device).is_none(), "{a:#x} handed out twice");
                }
            }
            Call::Free {
                pick,
                size,
                device,
                stream: s,
            } if !live.is_empty() => {
                let (&a, &d) = live.iter().nth(pick as usize % live.len()).unwrap();
                // Sometimes the wrong device index: refused, then freed on the right one.
                let dev = if device < 0 { d } else { (device % 4) as i32 };
                genpool_free(
                    std::ptr::without_provenance_mut(a as usize),
                    size as usize,
                    dev,
                    stream(s),
                );
                if dev != d {
                    genpool_free(
                        std::ptr::without_provenance_mut(a as usize),
                        0,
                        d,
                        stream(0),
                    );
                }
                live.remove(&a);
            }
            Call::Free { .. } => {}
            Call::FreeRaw {
                addr,
                size,
                device,
                stream: s,
            } => {
                if !live.contains_key(&addr) {
                    genpool_free(
                        std::ptr::without_provenance_mut(addr as usize),
                        size as usize,
                        device,
                        std::ptr::without_provenance_mut(s as usize),
                    );
                }
            }
            Call::RecordStream { pick, stream: s } => {
                let a = live
                    .keys()
                    .nth(pick as usize % live.len().max(1))
                    .copied()
                    .unwrap_or(pick as u64);
                genpool_record_stream(
                    std::ptr::without_provenance_mut(a as usize),
                    std::ptr::without_provenance_mut(s as usize),
                );
            }
            Call::Fraction { fraction, device } => genpool_set_memory_fraction(fraction, device),
            Call::Stats { device, len } => {
                let mut buf = vec![0u8; len as usize];
                let ptr = if len == 0 {
                    std::ptr::null_mut()
                } else {
                    buf.as_mut_ptr() as *mut c_char
                };
                // SAFETY: `ptr` is NULL or valid for `len` bytes.
                let n = unsafe { genpool_stats_json(device, ptr, len as usize) };
                if len > 0 {
                    let end = buf.iter().position(|&b| b == 0).expect("NUL-terminated");
                    assert_eq!(end, n.min(len as usize - 1));
                }
            }
            Call::LastError { len } => {
                let mut buf = vec![0u8; len as usize];
                let ptr = if len == 0 {
                    std::ptr::null_mut()
                } else {
                    buf.as_mut_ptr() as *mut c_char
                };
                // SAFETY: `ptr` is NULL or valid for `len` bytes.
                let _ = unsafe { genpool_last_error(ptr, len as usize) };
            }
            Call::Trim { device } => {
                genpool_trim(device);
            }
            Call::Mark { device } => genpool_mark_iteration(device),
            Call::Reset => genpool_reset(),
            Call::Init { count } if !(0..64).contains(&count) => genpool_init(count),
            Call::Init { .. } => {}
        }
    }
    for (a, d) in live {
        genpool_free(
            std::ptr::without_provenance_mut::<c_void>(a as usize),
            0,
            d,
            stream(0),
        );
    }
});
