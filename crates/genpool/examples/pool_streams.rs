//! Small blocks on many streams, as a program that takes a stream from PyTorch's pool for each
//! iteration (`torch.cuda.Stream()`: 32 streams a priority, handed out in turn) does: each iteration
//! allocates and frees small blocks on its stream. Prints ns a call (wall) and, on the simulated device,
//! the device calls the engine made; `GENPOOL_DEVICE=cuda` runs it on GPU 0.
//! `cargo run --release -p genpool --example pool_streams -- [STREAMS] [ITERATIONS] [BLOCKS]` (BLOCKS
//! an iteration, default 192: 32 of each of six classes, more than a thread's magazine keeps).

use std::sync::Arc;
use std::time::Instant;

use gen_device::sim::SimDevice;
use gen_device::{CallKind, Device};
use genpool::{Config, Hint, Pool};

fn main() {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("a number"))
        .collect();
    let (streams, iters) = (
        args.first().copied().unwrap_or(32),
        args.get(1).copied().unwrap_or(5_000),
    );
    let blocks = args.get(2).copied().unwrap_or(192) as usize;
    let sim = Arc::new(SimDevice::new());
    let on_gpu = std::env::var("GENPOOL_DEVICE").as_deref() == Ok("cuda");
    let dev: Arc<dyn Device> = if on_gpu {
        gen_device::open(gen_device::DeviceKind::Cuda, 0).expect("GPU 0")
    } else {
        sim.clone()
    };
    let pool = Pool::new(dev.clone(), Config::default()).expect("pool");
    let ids: Vec<u64> = (0..streams)
        .map(|_| dev.stream_create().expect("stream"))
        .collect();
    let sizes = [512u64, 1024, 1536, 2048, 3072, 4096];
    let mut live = Vec::with_capacity(blocks);
    let mut calls = 0u64;
    let mut run = |iters: u64, calls: &mut u64| {
        for i in 0..iters {
            let s = ids[(i % streams) as usize];
            for k in 0..blocks {
                let size = sizes[(i as usize + k) % sizes.len()];
                live.push(pool.alloc(size, s, Hint::default()).expect("alloc").ptr);
            }
            for p in live.drain(..).rev() {
                pool.free(p, s).expect("free");
            }
            *calls += 2 * blocks as u64;
        }
    };
    run(iters / 10, &mut calls); // warm-up
    let before = sim.calls();
    calls = 0;
    let t0 = Instant::now();
    run(iters, &mut calls);
    let ns = t0.elapsed().as_nanos() as f64 / calls as f64;
    let d = sim.calls().since(&before);
    if on_gpu {
        println!("streams {streams}: {ns:.1} ns a call over {calls} calls (GPU 0)");
    } else {
        println!(
            "streams {streams}: {ns:.1} ns a call over {calls} calls; event records {}, synchronizes {}, stream waits {}",
            d.get(CallKind::EventRecord),
            d.get(CallKind::Synchronize),
            d.get(CallKind::StreamWaitEvent)
        );
    }
}
