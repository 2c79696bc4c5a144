//! Tagged memory, sleep and wake across the C ABI (issue 22).
//!
//! A *tag* names what a region of the program allocates (`"weights"`, `"kv_cache"`): each tag gets its
//! own engine ([`genpool::Pool`]) per device, created lazily over the same device as the default pool —
//! a secondary engine of the router, numbered [`TAG_ENGINES`]` + id` — so a tag's pages never share with
//! another tag's and a tag sleeps as a whole ([`genpool::Pool::sleep`]). Untagged memory is the tag
//! `"default"`: the router's default engines.
//!
//! - [`genpool_tag_set`] sets the calling thread's tag for the allocations that follow (`NULL`, `""` or
//!   `"default"`: the default pools). `genpool_malloc` reads it (one thread-local load when none is set).
//!   The tag is per thread: PyTorch's autograd worker threads allocate under the default tag.
//! - `genpool_free` finds a tagged block's engine by address, as the router finds every block's.
//! - [`genpool_sleep`] / [`genpool_wake`] act on a comma-separated list of tags (`NULL` or `""`: every
//!   tag, the default one included). They are all-or-nothing: every tag is checked first (unknown, or
//!   asleep already / not asleep: nothing done), and a sleep that fails for one tag wakes the tags it had
//!   put to sleep before returning the error. A wake that fails for lack of memory leaves the tags not
//!   woken asleep: call it again once the memory is back.
//! - While a tag sleeps, allocating under it returns NULL with the last error set ("asleep"); frees of
//!   its blocks are accepted.
//!
//! Return codes: 0, or one of the negative `GENPOOL_ERR_*` values, with [`genpool_last_error`] set.
//!
//! [`genpool_last_error`]: crate::genpool_last_error

use std::cell::Cell;
use std::ffi::{c_char, c_int, CStr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use genpool::{Engine, Hint, Pool, SleepError, SleepOptions};
use parking_lot::{Mutex, RwLock};

use crate::abi::{fail, guard};
use crate::error::PluginError;
use crate::pools::TAG_ENGINES;
use crate::registry::{self, ROUTER};
use crate::report;

/// `genpool_sleep` flag: copy the tags' memory to pinned host memory first (restored by the wake).
pub const GENPOOL_SLEEP_OFFLOAD: c_int = 1;
/// `genpool_sleep` / `genpool_wake` flag: a CUDA graph capture is in progress (the call is refused).
pub const GENPOOL_SLEEP_CAPTURING: c_int = 2;

/// A bad argument: a tag name that is not UTF-8, empty inside a list, too long, has a comma, or too
/// many tags.
pub const GENPOOL_ERR_INVALID: c_int = -1;
/// A tag never set with `genpool_tag_set`.
pub const GENPOOL_ERR_UNKNOWN_TAG: c_int = -2;
/// `genpool_sleep` of a tag asleep already.
pub const GENPOOL_ERR_ASLEEP: c_int = -3;
/// `genpool_wake` of a tag that is not asleep.
pub const GENPOOL_ERR_NOT_ASLEEP: c_int = -4;
/// During a CUDA graph capture.
pub const GENPOOL_ERR_CAPTURING: c_int = -5;
/// Not enough device memory to wake.
pub const GENPOOL_ERR_OUT_OF_MEMORY: c_int = -6;
/// Anything else (a device error, an engine that cannot sleep, an internal panic).
pub const GENPOOL_ERR_FAILED: c_int = -7;

/// The tag of untagged memory.
const DEFAULT_TAG: &str = "default";
/// Most tags besides the default one.
const MAX_TAGS: usize = 64;
/// Longest tag name, in bytes.
const MAX_TAG_LEN: usize = 128;

struct Tag {
    name: String,
    asleep: AtomicBool,
}

/// A tag's engine on one device: the router's default engine for the default tag, else a secondary one.
enum TagEngine {
    Default(&'static Pool),
    Tagged(Arc<Engine>),
}

impl std::ops::Deref for TagEngine {
    type Target = Pool;

    fn deref(&self) -> &Pool {
        match self {
            TagEngine::Default(p) => p,
            TagEngine::Tagged(e) => e.pool(),
        }
    }
}

/// The router's number for tag `id`'s engines.
fn engine_id(id: u32) -> u64 {
    TAG_ENGINES + u64::from(id)
}

/// Tag `id`'s engines (the router's default ones for the default tag), with their devices.
fn engines_of(id: u32) -> Vec<(usize, TagEngine)> {
    let devices = registry::all_existing();
    if id == 0 {
        return devices
            .map(|s| (s.index(), TagEngine::Default(s.pool)))
            .collect();
    }
    devices
        .filter_map(|s| {
            let e = ROUTER.engine(s.index(), engine_id(id)).ok().flatten()?;
            Some((s.index(), TagEngine::Tagged(e)))
        })
        .collect()
}

/// Tags by id − 1 (id 0 is the default tag). Tags are never removed (as the router's engines).
static TAGS: RwLock<Vec<&'static Tag>> = RwLock::new(Vec::new());
/// The default tag's sleep state (its engines are the router's default ones).
static DEFAULT_ASLEEP: AtomicBool = AtomicBool::new(false);
/// Serializes sleep and wake calls.
static SLEEP_LOCK: Mutex<()> = Mutex::new(());

thread_local! {
    /// The calling thread's tag id (0: default).
    static CURRENT: Cell<u32> = const { Cell::new(0) };
}

fn tag(id: u32) -> Option<&'static Tag> {
    TAGS.read().get(id.checked_sub(1)? as usize).copied()
}

fn valid_name(name: &str) -> Result<(), PluginError> {
    if name.is_empty() || name.len() > MAX_TAG_LEN || name.contains(',') {
        return Err(PluginError::BadTag(format!(
            "{name:?}: a tag is 1 to {MAX_TAG_LEN} bytes with no comma"
        )));
    }
    Ok(())
}

/// The id of tag `name`, made if new (0 for the default tag).
fn tag_id(name: &str) -> Result<u32, PluginError> {
    let name = name.trim();
    if name.is_empty() || name == DEFAULT_TAG {
        return Ok(0);
    }
    valid_name(name)?;
    if let Some(i) = TAGS.read().iter().position(|t| t.name == name) {
        return Ok(i as u32 + 1);
    }
    let mut tags = TAGS.write();
    if let Some(i) = tags.iter().position(|t| t.name == name) {
        return Ok(i as u32 + 1);
    }
    if tags.len() >= MAX_TAGS {
        return Err(PluginError::BadTag(format!(
            "{name:?}: at most {MAX_TAGS} tags"
        )));
    }
    let t: &'static Tag = Box::leak(Box::new(Tag {
        name: name.to_string(),
        asleep: AtomicBool::new(false),
    }));
    tags.push(t);
    Ok(tags.len() as u32)
}

/// `genpool_malloc`'s branch for a tagged thread: `None` when the thread has no tag (the default pool
/// serves it).
#[inline]
pub(crate) fn tagged_alloc(
    size: u64,
    device: i64,
    stream: u64,
) -> Option<Result<u64, PluginError>> {
    let id = CURRENT.with(Cell::get);
    if id == 0 {
        return None;
    }
    Some(alloc_in(id, size, device, stream))
}

#[inline(never)]
fn alloc_in(id: u32, size: u64, device: i64, stream: u64) -> Result<u64, PluginError> {
    alloc_block(id, size, device, stream).map(|b| b.ptr)
}

fn alloc_block(
    id: u32,
    size: u64,
    device: i64,
    stream: u64,
) -> Result<genpool::Block, PluginError> {
    let t = tag(id).ok_or_else(|| PluginError::UnknownTag(format!("id {id}")))?;
    if t.asleep.load(Ordering::Acquire) {
        return Err(genpool::GenpoolError::Asleep.into());
    }
    // Made on first use over the device's default engine (which is made first if need be).
    let engine = ROUTER.add_engine(registry::slot_index(device)?, engine_id(id))?;
    Ok(engine.alloc(size, stream, Hint::NONE)?)
}

/// Whether the calling thread has a tag (one thread-local read).
#[inline]
pub(crate) fn tagged() -> bool {
    CURRENT.with(Cell::get) != 0
}

/// The PyTorch backend's branch for a tagged thread (`backend_abi`): the block, or `None` when the
/// thread has no tag.
#[inline]
pub(crate) fn tagged_alloc_block(
    size: u64,
    device: i64,
    stream: u64,
) -> Option<Result<genpool::Block, PluginError>> {
    let id = CURRENT.with(Cell::get);
    if id == 0 {
        return None;
    }
    Some(alloc_block(id, size, device, stream))
}

/// `genpool_stats_json`'s branch: the tag engines of device `device`, summed (their own figures are in
/// `genpool_tags_json`).
pub(crate) fn device_summary(device: i64) -> serde_json::Value {
    let (mut allocated, mut reserved, mut sleeping, mut offloaded, mut engines) = (0, 0, 0, 0, 0);
    let tagged = usize::try_from(device)
        .ok()
        .and_then(|i| ROUTER.engines(i).ok())
        .unwrap_or_default();
    for e in tagged.iter().filter(|e| e.id() >= TAG_ENGINES) {
        let s = e.pool().stats();
        allocated += s.allocated_current;
        reserved += s.reserved_current;
        sleeping += s.sleeping_bytes;
        offloaded += s.offloaded_bytes;
        engines += 1;
    }
    serde_json::json!({
        "engines": engines,
        "allocated_current": allocated,
        "reserved_current": reserved,
        "sleeping_bytes": sleeping,
        "offloaded_bytes": offloaded,
    })
}

/// `genpool_reset`'s branch (`empty_cache`): trim every tag's engines; returns the bytes released.
pub(crate) fn trim_all() -> u64 {
    let n = TAGS.read().len() as u32;
    (1..=n).flat_map(engines_of).map(|(_, p)| p.trim()).sum()
}

/// The tag ids named by `csv` (`NULL` / `""`: all, the default one included), in order, deduplicated.
///
/// # Safety
/// `csv` is NULL or a NUL-terminated string.
unsafe fn parse_tags(csv: *const c_char) -> Result<Vec<u32>, PluginError> {
    let all = || {
        let n = TAGS.read().len() as u32;
        (0..=n).collect::<Vec<u32>>()
    };
    if csv.is_null() {
        return Ok(all());
    }
    // SAFETY: the caller guarantees a NUL-terminated string.
    let s = unsafe { CStr::from_ptr(csv) }
        .to_str()
        .map_err(|_| PluginError::BadTag("the tag list is not UTF-8".into()))?;
    if s.trim().is_empty() {
        return Ok(all());
    }
    let mut ids = Vec::new();
    for name in s.split(',').map(str::trim) {
        if name.is_empty() {
            return Err(PluginError::BadTag(format!("empty tag in {s:?}")));
        }
        let id = if name == DEFAULT_TAG {
            0
        } else {
            valid_name(name)?;
            match TAGS.read().iter().position(|t| t.name == name) {
                Some(i) => i as u32 + 1,
                None => return Err(PluginError::UnknownTag(name.to_string())),
            }
        };
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
    Ok(ids)
}

fn name_of(id: u32) -> String {
    tag(id).map_or_else(|| DEFAULT_TAG.to_string(), |t| t.name.clone())
}

fn asleep_flag(id: u32) -> &'static AtomicBool {
    match tag(id) {
        Some(t) => &t.asleep,
        None => &DEFAULT_ASLEEP,
    }
}

/// Every existing engine of tag `id` (the router's default ones for the default tag).
fn pools_of(id: u32) -> Vec<TagEngine> {
    engines_of(id).into_iter().map(|(_, e)| e).collect()
}

fn tag_err(id: u32, e: SleepError) -> PluginError {
    PluginError::Sleep {
        tag: name_of(id),
        source: Box::new(e),
    }
}

fn sleep_tags(ids: &[u32], opts: SleepOptions) -> Result<(), PluginError> {
    let _g = SLEEP_LOCK.lock();
    if opts.capturing {
        return Err(tag_err(
            ids.first().copied().unwrap_or(0),
            SleepError::Capturing,
        ));
    }
    if let Some(&id) = ids
        .iter()
        .find(|&&id| asleep_flag(id).load(Ordering::Acquire))
    {
        return Err(tag_err(id, SleepError::AlreadyAsleep));
    }
    let mut slept: Vec<(u32, TagEngine)> = Vec::new();
    for &id in ids {
        // Refuse allocations first, then sleep the engines.
        asleep_flag(id).store(true, Ordering::SeqCst);
        for pool in pools_of(id) {
            match pool.sleep(opts) {
                Ok(_) => slept.push((id, pool)),
                Err(e) => {
                    // All or nothing: wake what this call put to sleep.
                    for (_, p) in slept.iter().rev() {
                        if let Err(e2) = p.wake(false) {
                            log::error!("genpool: waking after a failed sleep: {e2}");
                        }
                    }
                    // A device failure part-way may have left this pool asleep with some pages mapped.
                    if pool.is_asleep() {
                        if let Err(e2) = pool.wake(false) {
                            log::error!("genpool: waking a partly slept pool: {e2}");
                        }
                    }
                    for &(sid, _) in &slept {
                        asleep_flag(sid).store(false, Ordering::SeqCst);
                    }
                    // The flag says what the pool is (a pool that could not be woken stays asleep, and a
                    // later wake of the tag finishes it).
                    asleep_flag(id).store(pool.is_asleep(), Ordering::SeqCst);
                    return Err(tag_err(id, e));
                }
            }
        }
    }
    Ok(())
}

fn wake_tags(ids: &[u32], capturing: bool) -> Result<(), PluginError> {
    let _g = SLEEP_LOCK.lock();
    if capturing {
        return Err(tag_err(
            ids.first().copied().unwrap_or(0),
            SleepError::Capturing,
        ));
    }
    if let Some(&id) = ids
        .iter()
        .find(|&&id| !asleep_flag(id).load(Ordering::Acquire))
    {
        return Err(tag_err(id, SleepError::NotAsleep));
    }
    for &id in ids {
        for pool in pools_of(id).into_iter().filter(|p| p.is_asleep()) {
            // Out of memory: this tag (and those after it) stay asleep; a later wake finishes.
            pool.wake(false).map_err(|e| tag_err(id, e))?;
        }
        asleep_flag(id).store(false, Ordering::SeqCst);
    }
    Ok(())
}

fn code(e: &PluginError) -> c_int {
    match e {
        PluginError::BadTag(_) => GENPOOL_ERR_INVALID,
        PluginError::UnknownTag(_) => GENPOOL_ERR_UNKNOWN_TAG,
        PluginError::Sleep { source, .. } => match **source {
            SleepError::AlreadyAsleep => GENPOOL_ERR_ASLEEP,
            SleepError::NotAsleep => GENPOOL_ERR_NOT_ASLEEP,
            SleepError::Capturing => GENPOOL_ERR_CAPTURING,
            SleepError::OutOfMemory { .. } => GENPOOL_ERR_OUT_OF_MEMORY,
            _ => GENPOOL_ERR_FAILED,
        },
        PluginError::InvalidDevice { .. } => GENPOOL_ERR_INVALID,
        _ => GENPOOL_ERR_FAILED,
    }
}

fn status(res: Result<(), PluginError>) -> c_int {
    match res {
        Ok(()) => 0,
        Err(e) => {
            fail(&e);
            code(&e)
        }
    }
}

/// Set the calling thread's tag for the allocations that follow: `NULL`, `""` or `"default"` for
/// untagged memory; any other name (1 to 128 bytes, no comma) makes the tag if it is new (at most 64).
/// Returns 0 or a negative `GENPOOL_ERR_*` (the thread's tag is unchanged then).
///
/// # Safety
/// `tag` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn genpool_tag_set(tag: *const c_char) -> c_int {
    guard("genpool_tag_set", GENPOOL_ERR_FAILED, || {
        let res = if tag.is_null() {
            Ok(0)
        } else {
            // SAFETY: forwarded from this function's contract.
            match unsafe { CStr::from_ptr(tag) }.to_str() {
                Ok(name) => tag_id(name),
                Err(_) => Err(PluginError::BadTag("the tag is not UTF-8".into())),
            }
        };
        status(res.map(|id| CURRENT.with(|c| c.set(id))))
    })
}

/// Put the tags of `tags_csv` (comma-separated; `NULL` or `""`: every tag, `"default"` included) to
/// sleep on every device: their physical memory goes back to the driver, their addresses stay reserved,
/// so every tensor keeps its pointer. `flags`: [`GENPOOL_SLEEP_OFFLOAD`] copies their contents to pinned
/// host memory first (restored by [`genpool_wake`]; without it the contents are lost);
/// [`GENPOOL_SLEEP_CAPTURING`] says a CUDA graph capture is in progress (refused). Returns 0 or a negative
/// `GENPOOL_ERR_*` with the last error set; on error no tag of the list is left asleep by this call.
///
/// # Safety
/// `tags_csv` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn genpool_sleep(tags_csv: *const c_char, flags: c_int) -> c_int {
    guard("genpool_sleep", GENPOOL_ERR_FAILED, || {
        // SAFETY: forwarded from this function's contract.
        let res = unsafe { parse_tags(tags_csv) }.and_then(|ids| {
            sleep_tags(
                &ids,
                SleepOptions {
                    offload: flags & GENPOOL_SLEEP_OFFLOAD != 0,
                    capturing: flags & GENPOOL_SLEEP_CAPTURING != 0,
                },
            )
        });
        status(res)
    })
}

/// Wake the tags of `tags_csv` (as [`genpool_sleep`]): map their memory again at the same addresses and
/// restore what was offloaded. `flags`: [`GENPOOL_SLEEP_CAPTURING`] (refused). Every tag must be asleep.
/// `GENPOOL_ERR_OUT_OF_MEMORY` (another process holds the memory): the tags not woken stay asleep; call
/// again later.
///
/// # Safety
/// `tags_csv` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn genpool_wake(tags_csv: *const c_char, flags: c_int) -> c_int {
    guard("genpool_wake", GENPOOL_ERR_FAILED, || {
        // SAFETY: forwarded from this function's contract.
        let res = unsafe { parse_tags(tags_csv) }
            .and_then(|ids| wake_tags(&ids, flags & GENPOOL_SLEEP_CAPTURING != 0));
        status(res)
    })
}

fn tags_value() -> serde_json::Value {
    use serde_json::json;
    let current = name_of(CURRENT.with(Cell::get));
    let n = TAGS.read().len() as u32;
    let tags: Vec<serde_json::Value> = (0..=n)
        .map(|id| {
            let devices: Vec<serde_json::Value> = engines_of(id)
                .into_iter()
                .map(|(i, p)| {
                    let s = p.stats();
                    json!({
                        "device": i,
                        "asleep": s.asleep,
                        "allocated_current": s.allocated_current,
                        "reserved_current": s.reserved_current,
                        "sleeping_bytes": s.sleeping_bytes,
                        "offloaded_bytes": s.offloaded_bytes,
                        "host_bytes": s.pages.host_bytes,
                        "live_blocks": p.live_blocks(),
                    })
                })
                .collect();
            json!({
                "name": name_of(id),
                "asleep": asleep_flag(id).load(Ordering::Acquire),
                "devices": devices,
            })
        })
        .collect();
    json!({ "current": current, "tags": tags })
}

/// Write the tags as one JSON object into `buf`, `snprintf`-style as `genpool_stats_json`: the calling
/// thread's current tag, and per tag whether it sleeps and, per device with an engine, its allocated,
/// reserved, sleeping and offloaded bytes. Returns the JSON's length in bytes.
///
/// # Safety
/// `buf` is NULL or valid for writes of `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn genpool_tags_json(buf: *mut c_char, len: usize) -> usize {
    guard("genpool_tags_json", 0, || {
        let v = tags_value().to_string();
        // SAFETY: forwarded from this function's contract.
        unsafe { report::copy_out(&v, buf, len) }
    })
}

#[cfg(test)]
mod tests {
    //! Slots 12 and 13 of the registry (see `crate::tests`). Tags are process-wide: each test uses its
    //! own names and never sleeps the default tag or every tag (other tests allocate meanwhile).

    use std::ffi::CString;
    use std::ptr::null_mut;
    use std::sync::Arc;

    use gen_device::sim::SimDevice;
    use gen_device::Device;
    use genpool::Config;
    use serde_json::Value;

    use super::*;
    use crate::registry::testing;
    use crate::tests::{last_error, ERRORS};
    use crate::{genpool_free, genpool_malloc};

    fn c(s: &str) -> CString {
        CString::new(s).unwrap()
    }

    fn set(tag: Option<&str>) -> c_int {
        let t = tag.map(c);
        // SAFETY: NULL or a NUL-terminated string.
        unsafe { genpool_tag_set(t.as_ref().map_or(std::ptr::null(), |t| t.as_ptr())) }
    }

    fn sleep(tags: &str, flags: c_int) -> c_int {
        let t = c(tags);
        // SAFETY: a NUL-terminated string.
        unsafe { genpool_sleep(t.as_ptr(), flags) }
    }

    fn wake(tags: &str, flags: c_int) -> c_int {
        let t = c(tags);
        // SAFETY: a NUL-terminated string.
        unsafe { genpool_wake(t.as_ptr(), flags) }
    }

    fn tags() -> Value {
        // Other tests may add tags between two calls: retry until the JSON fits.
        let mut buf = vec![0u8; 256];
        loop {
            // SAFETY: `buf` is valid for its length.
            let n = unsafe { genpool_tags_json(buf.as_mut_ptr().cast(), buf.len()) };
            if n < buf.len() {
                return serde_json::from_slice(&buf[..n]).unwrap();
            }
            buf = vec![0u8; n + 1];
        }
    }

    fn tag_dev(v: &Value, name: &str, device: u64) -> Value {
        let t = v["tags"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["name"] == name)
            .unwrap_or_else(|| panic!("{name} in {v}"));
        t["devices"]
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["device"] == device)
            .cloned()
            .unwrap_or(Value::Null)
    }

    fn malloc(size: usize, device: c_int) -> u64 {
        genpool_malloc(size, device, null_mut()).addr() as u64
    }

    fn free(p: u64, device: c_int) {
        genpool_free(
            std::ptr::without_provenance_mut(p as usize),
            0,
            device,
            null_mut(),
        );
    }

    #[test]
    fn tagged_memory_sleeps_and_wakes_with_its_bytes_at_the_same_addresses() {
        let _e = ERRORS.lock();
        let dev = Arc::new(
            SimDevice::config()
                .ordinal(12)
                .backed(true)
                .address_offset(12 * gen_device::sim::ORDINAL_STRIDE)
                .build()
                .unwrap(),
        );
        testing::install(12, dev.clone(), Config::default());
        assert_eq!(set(Some("abi-weights")), 0);
        let w = malloc(9 << 20, 12);
        assert_ne!(w, 0, "{}", last_error());
        let small = malloc(1000, 12);
        assert_ne!(small, 0);
        assert_eq!(set(Some("abi-kv")), 0);
        let kv = malloc(20 << 20, 12);
        assert_eq!(set(None), 0);
        let plain = malloc(4 << 20, 12);
        let data: Vec<u8> = (0..(9u32 << 20)).map(|i| (i % 251) as u8).collect();
        dev.write(w, &data).unwrap();
        dev.write(small, b"small block").unwrap();
        let v = tags();
        assert_eq!(
            tag_dev(&v, "abi-weights", 12)["allocated_current"],
            9 * (1 << 20) + 1024
        );
        assert_eq!(tag_dev(&v, "abi-kv", 12)["allocated_current"], 20 << 20);
        assert_eq!(v["current"], "default");
        let summary = &crate::tests::stats(12)["tagged"];
        assert_eq!(summary["engines"], 2);
        assert_eq!(summary["allocated_current"], 29 * (1 << 20) + 1024);
        let default_alloc = registry::existing(12).unwrap().unwrap().pool.allocated();
        assert_eq!(
            default_alloc,
            4 << 20,
            "untagged memory stays in the default pool"
        );

        assert_eq!(
            sleep("abi-weights, abi-kv", GENPOOL_SLEEP_OFFLOAD),
            0,
            "{}",
            last_error()
        );
        let v = tags();
        let wd = tag_dev(&v, "abi-weights", 12);
        assert_eq!(
            (wd["asleep"].as_bool(), wd["reserved_current"].as_u64()),
            (Some(true), Some(0))
        );
        assert_eq!(
            wd["allocated_current"],
            9 * (1 << 20) + 1024,
            "allocated stays"
        );
        assert_eq!(tag_dev(&v, "abi-kv", 12)["reserved_current"], 0);
        // Only the default pool's pages stay held.
        assert_eq!(
            dev.reserved().current,
            registry::existing(12).unwrap().unwrap().pool.reserved_now()
        );
        // Allocation under a sleeping tag: NULL and a clear error.
        assert_eq!(set(Some("abi-weights")), 0);
        assert_eq!(malloc(512, 12), 0);
        assert!(last_error().contains("asleep"), "{}", last_error());
        assert_eq!(set(None), 0);
        // Freeing a sleeping block works (bookkeeping only).
        free(kv, 12);
        assert_eq!(tag_dev(&tags(), "abi-kv", 12)["allocated_current"], 0);
        // Misuse: double sleep, unknown tag, bad lists, capture; nothing changes.
        assert_eq!(sleep("abi-weights", 0), GENPOOL_ERR_ASLEEP);
        assert!(last_error().contains("double sleep"), "{}", last_error());
        assert_eq!(sleep("abi-nope", 0), GENPOOL_ERR_UNKNOWN_TAG);
        assert!(last_error().contains("unknown tag"), "{}", last_error());
        assert_eq!(wake("abi-weights,,abi-kv", 0), GENPOOL_ERR_INVALID);
        assert_eq!(
            wake("abi-weights", GENPOOL_SLEEP_CAPTURING),
            GENPOOL_ERR_CAPTURING
        );
        assert!(last_error().contains("capture"), "{}", last_error());
        assert!(tag_dev(&tags(), "abi-weights", 12)["asleep"]
            .as_bool()
            .unwrap());

        assert_eq!(wake("abi-kv,abi-weights", 0), 0, "{}", last_error());
        let mut back = vec![0u8; data.len()];
        dev.read(w, &mut back).unwrap();
        assert!(back == data, "the weights came back bit for bit");
        let mut s = [0u8; 11];
        dev.read(small, &mut s).unwrap();
        assert_eq!(&s, b"small block");
        assert_eq!(wake("abi-weights", 0), GENPOOL_ERR_NOT_ASLEEP);
        assert!(
            last_error().contains("wake without sleep"),
            "{}",
            last_error()
        );
        // Awake: allocations work again; frees route to the tag's pool whatever the thread's tag.
        assert_eq!(set(Some("abi-weights")), 0);
        let again = malloc(1 << 20, 12);
        assert_ne!(again, 0, "{}", last_error());
        assert_eq!(set(None), 0);
        let invalid_before = crate::report::invalid_frees();
        for p in [w, small, again, plain] {
            free(p, 12);
        }
        assert_eq!(
            crate::report::invalid_frees(),
            invalid_before,
            "every free found its pool"
        );
        assert_eq!(tag_dev(&tags(), "abi-weights", 12)["allocated_current"], 0);
    }

    #[test]
    fn bad_tags_are_refused_and_leave_the_thread_tag_alone() {
        let _e = ERRORS.lock();
        testing::install(
            13,
            Arc::new(
                SimDevice::config()
                    .ordinal(13)
                    .address_offset(13 * gen_device::sim::ORDINAL_STRIDE)
                    .build()
                    .unwrap(),
            ),
            Config::default(),
        );
        assert_eq!(set(Some("abi-t13")), 0);
        assert_eq!(set(Some("a,b")), GENPOOL_ERR_INVALID);
        assert!(last_error().contains("no comma"), "{}", last_error());
        assert_eq!(set(Some(&"x".repeat(MAX_TAG_LEN + 1))), GENPOOL_ERR_INVALID);
        let bad = [0xffu8, 0xfe, 0];
        // SAFETY: a NUL-terminated (non-UTF-8) string.
        let rc = unsafe { genpool_tag_set(bad.as_ptr().cast()) };
        assert_eq!(rc, GENPOOL_ERR_INVALID);
        assert_eq!(tags()["current"], "abi-t13", "unchanged by the refusals");
        // "default" and "" are the default tag.
        assert_eq!(set(Some("default")), 0);
        assert_eq!(tags()["current"], "default");
        assert_eq!(set(Some("abi-t13")), 0);
        assert_eq!(set(Some("")), 0);
        assert_eq!(tags()["current"], "default");
        // A tag with no engine yet sleeps and wakes (nothing to do), with the same state checks.
        assert_eq!(sleep("abi-t13", GENPOOL_SLEEP_OFFLOAD), 0);
        assert_eq!(set(Some("abi-t13")), 0);
        assert_eq!(
            malloc(4096, 13),
            0,
            "a tag asleep refuses its first engine's allocations too"
        );
        assert_eq!(set(None), 0);
        assert_eq!(sleep("abi-t13", 0), GENPOOL_ERR_ASLEEP);
        assert_eq!(wake("abi-t13", 0), 0);
        assert_eq!(wake("abi-t13", 0), GENPOOL_ERR_NOT_ASLEEP);
        // A list with one bad tag does nothing to the good ones.
        assert_eq!(sleep("abi-t13,abi-missing", 0), GENPOOL_ERR_UNKNOWN_TAG);
        assert!(!tag_dev_asleep("abi-t13"));
    }

    fn tag_dev_asleep(name: &str) -> bool {
        tags()["tags"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["name"] == name)
            .unwrap()["asleep"]
            .as_bool()
            .unwrap()
    }
}
