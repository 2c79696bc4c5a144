//! Cost of the device calls the tiers make on their slow paths, through the `Device` trait.
//!
//! `cargo run --release -p gen-device --example device_costs -- [sim|cuda|auto] [iterations]`
//! prints one line per operation: nanoseconds per call pair (median of 5 runs).

use std::time::Instant;

use gen_device::{open, DeviceKind, Result};

fn median_ns(runs: usize, iters: u64, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let mut v = Vec::with_capacity(runs);
    for _ in 0..runs {
        let t = Instant::now();
        for _ in 0..iters {
            f()?;
        }
        v.push(t.elapsed().as_nanos() as f64 / iters as f64);
    }
    v.sort_by(f64::total_cmp);
    Ok(v[v.len() / 2])
}

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let kind: DeviceKind = args
        .next()
        .as_deref()
        .unwrap_or("auto")
        .parse()
        .unwrap_or_else(|e| {
            eprintln!("{e}");
            std::process::exit(2)
        });
    let iters: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(2000);
    let d = open(kind, 0)?;
    let g = d.props().vmm_granularity;
    println!(
        "device: {} ({} GiB, granularity {} KiB)",
        d.props().name,
        d.props().total_mem >> 30,
        g >> 10
    );

    let s = d.stream_create()?;
    let pool = d.pool_create(u64::MAX)?;
    for &bytes in &[256u64, 1 << 20, 64 << 20] {
        let ns = median_ns(5, iters, || {
            let p = d.pool_alloc_async(pool, bytes, s)?;
            d.pool_free_async(p, s)
        })?;
        println!("pool_alloc_async + pool_free_async ({bytes} B): {ns:.0} ns");
    }
    let e = d.event_create()?;
    let ns = median_ns(5, iters, || {
        d.event_record(e, s)?;
        d.event_query(e).map(|_| ())
    })?;
    println!("event_record + event_query: {ns:.0} ns");
    // Session 27: what a stream question costs against the fence and wait it replaces, and whether a
    // question right after a map or an unmap pays for the driver's page-table work.
    let s2 = d.stream_create()?;
    let ns = median_ns(5, iters, || d.event_query(e).map(|_| ()))?;
    println!("event_query (complete): {ns:.0} ns");
    let ns = median_ns(5, iters, || {
        d.event_record(e, s)?;
        d.stream_wait_event(s2, e)
    })?;
    println!("event_record + stream_wait_event: {ns:.0} ns");
    let ns = median_ns(5, iters, || d.stream_query(s).map(|_| ()))?;
    println!("stream_query (idle): {ns:.0} ns");
    {
        let va = d.va_reserve(g, 0)?;
        let h = d.phys_create(g)?;
        let n = iters / 10 + 1;
        let base = median_ns(5, n, || {
            d.map(va, g, h)?;
            d.unmap(va, g)
        })?;
        let with_stream = median_ns(5, n, || {
            d.map(va, g, h)?;
            d.unmap(va, g)?;
            d.stream_query(s).map(|_| ())
        })?;
        let with_event = median_ns(5, n, || {
            d.map(va, g, h)?;
            d.unmap(va, g)?;
            d.event_record(e, s)?;
            d.stream_wait_event(s2, e)
        })?;
        println!(
            "map + unmap: {base:.0} ns; then a stream_query: +{:.0} ns; then event_record + stream_wait_event: +{:.0} ns",
            with_stream - base,
            with_event - base
        );
        d.phys_release(h)?;
        d.va_release(va, g)?;
    }
    d.stream_destroy(s2)?;
    let va = d.va_reserve(g, 0)?;
    let ns = median_ns(5, iters / 10 + 1, || {
        let h = d.phys_create(g)?;
        d.map(va, g, h)?;
        d.unmap(va, g)?;
        d.phys_release(h)
    })?;
    println!("phys_create + map + unmap + phys_release (granule): {ns:.0} ns");
    let h = d.phys_create(g)?;
    let ns = median_ns(5, iters / 10 + 1, || {
        d.map(va, g, h)?;
        d.unmap(va, g)
    })?;
    println!("map + unmap of a cached handle (granule): {ns:.0} ns");
    // A run of 32 pages (64 MiB), as a large block's commit needs: page by page, and as one run
    // (one access call for the run, one unmap for the run). Per page.
    const RUN: u64 = 32;
    let run_va = d.va_reserve(RUN * g, 0)?;
    let hs: Vec<_> = (0..RUN).map(|_| d.phys_create(g)).collect::<Result<_>>()?;
    let ns = median_ns(5, iters / 200 + 1, || {
        for (i, &h) in hs.iter().enumerate() {
            d.map(run_va + i as u64 * g, g, h)?;
        }
        for i in 0..RUN {
            d.unmap(run_va + i * g, g)?;
        }
        Ok(())
    })? / RUN as f64;
    println!("map + unmap per page, {RUN} pages one by one: {ns:.0} ns per page");
    let ns = median_ns(5, iters / 200 + 1, || {
        d.map_run(run_va, g, &hs)?;
        d.unmap(run_va, RUN * g)
    })? / RUN as f64;
    println!("map_run + one unmap, {RUN} pages as a run: {ns:.0} ns per page");
    let ns = median_ns(5, iters / 200 + 1, || {
        d.map_run(run_va, g, &hs)?;
        for i in 0..RUN {
            d.unmap(run_va + i * g, g)?;
        }
        Ok(())
    })? / RUN as f64;
    println!("map_run + unmap per page, {RUN} pages: {ns:.0} ns per page");
    // Where a move's time goes (session 26): the map (with its access call) and the unmap timed apart,
    // a page at a time and as a run; the unmap of an alias (the page still mapped at another address, as
    // the page pool leaves an old mapping); an unmap with work queued on the device (does the driver
    // wait for it?); and a map on this thread while another thread unmaps (do they serialize?).
    d.va_release(run_va, RUN * g)?;
    let run_va = d.va_reserve(2 * RUN * g, 0)?;
    let split = |pages: u64, alias: bool| -> Result<(f64, f64)> {
        let (mut tm, mut tu) = (Vec::new(), Vec::new());
        for _ in 0..5 {
            let (mut m, mut u) = (0u128, 0u128);
            for _ in 0..(iters / 200 + 1) {
                let t = Instant::now();
                d.map_run(run_va, g, &hs[..pages as usize])?;
                m += t.elapsed().as_nanos();
                if alias {
                    d.map_run(run_va + RUN * g, g, &hs[..pages as usize])?;
                }
                let t = Instant::now();
                d.unmap(run_va, pages * g)?;
                u += t.elapsed().as_nanos();
                if alias {
                    d.unmap(run_va + RUN * g, pages * g)?;
                }
            }
            let n = ((iters / 200 + 1) * pages) as f64;
            tm.push(m as f64 / n);
            tu.push(u as f64 / n);
        }
        tm.sort_by(f64::total_cmp);
        tu.sort_by(f64::total_cmp);
        Ok((tm[2], tu[2]))
    };
    for (pages, alias) in [(1, false), (RUN, false), (1, true), (RUN, true)] {
        let (m, u) = split(pages, alias)?;
        let what = if alias {
            "the page also mapped elsewhere"
        } else {
            "sole mapping"
        };
        println!(
            "split, {pages} page(s), {what}: map {m:.0} ns per page, unmap {u:.0} ns per page"
        );
    }
    // Unmap with the device busy: 16 x 64 MiB memsets queued on `s` into pages mapped at the run's
    // second half, then an unmap of the first half (nothing queued uses it).
    d.map_run(run_va + RUN * g, g, &hs)?;
    let mut busy = Vec::new();
    for _ in 0..5 {
        d.map_run(run_va, g, &hs[..1])?;
        for _ in 0..16 {
            d.memset_async(run_va + RUN * g, 0, RUN * g, s)?;
        }
        let t = Instant::now();
        d.unmap(run_va, g)?;
        busy.push(t.elapsed().as_nanos() as f64);
        let t = Instant::now();
        d.synchronize()?;
        let left = t.elapsed().as_nanos() as f64;
        let ns = busy.last().copied().unwrap_or(0.0);
        println!(
            "unmap with 16 x {} MiB memsets queued: {ns:.0} ns (work left after it: {left:.0} ns)",
            (RUN * g) >> 20
        );
    }
    d.unmap(run_va + RUN * g, RUN * g)?;
    // A map and unmap here, alone and while a helper thread maps and unmaps runs of pages of another
    // range: whether the driver serializes the two threads' calls (an unmap moved off the allocating
    // thread would only help if it does not).
    {
        let pairs = iters / 10 + 1;
        let one = |d: &dyn gen_device::Device| -> Result<f64> {
            let t = Instant::now();
            for _ in 0..pairs {
                d.map(run_va, g, hs[0])?;
                d.unmap(run_va, g)?;
            }
            Ok(t.elapsed().as_nanos() as f64 / pairs as f64)
        };
        let alone = one(&*d)?;
        let stop = std::sync::atomic::AtomicBool::new(false);
        let other = d.va_reserve(RUN * g, 0)?;
        let extra: Vec<_> = (0..RUN).map(|_| d.phys_create(g)).collect::<Result<_>>()?;
        let (with, helper) = std::thread::scope(|sc| -> Result<(f64, f64)> {
            let helper = sc.spawn(|| -> Result<f64> {
                let (t, mut pages) = (Instant::now(), 0u64);
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    d.map_run(other, g, &extra)?;
                    d.unmap(other, RUN * g)?;
                    pages += RUN;
                }
                Ok(t.elapsed().as_nanos() as f64 / pages.max(1) as f64)
            });
            // Let the helper start first.
            std::thread::sleep(std::time::Duration::from_millis(20));
            let r = one(&*d);
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            let h = helper.join().expect("helper thread")?;
            Ok((r?, h))
        })?;
        println!(
            "map + unmap of one page, alone: {alone:.0} ns; while another thread maps and unmaps runs: {with:.0} ns (that thread: {helper:.0} ns per page)"
        );
        for h in extra {
            d.phys_release(h)?;
        }
        d.va_release(other, RUN * g)?;
    }
    for h in hs {
        d.phys_release(h)?;
    }
    d.va_release(run_va, 2 * RUN * g)?;
    let mut sink = 0u64;
    let ns = median_ns(5, iters, || {
        sink = sink.wrapping_add(d.reserved().current);
        Ok(())
    })?;
    println!("reserved(): {ns:.0} ns (checksum {sink})");
    d.phys_release(h)?;
    d.va_release(va, g)?;
    d.synchronize()?;
    d.event_destroy(e)?;
    d.pool_destroy(pool)?;
    d.stream_destroy(s)?;
    Ok(())
}
