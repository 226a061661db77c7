//! Side-by-side device comparison, in one run: a pool hit (alloc + free of a `DeviceBuffer` that the
//! pool serves from its cache) against `cuMemAlloc` + `cuMemFree` and against cudarc's
//! `stream.alloc` + drop, which is what a cudarc user pays: `cuMemAllocAsync`/`cuMemFreeAsync`
//! where the device has memory pools, plus cudarc's own event tracking (two events created and
//! destroyed per buffer, and, once the context has a stream of its own, two stream waits per
//! drop).
//!
//! Run: `cargo bench --features cuda --bench device_pool`. Sizes 256 B .. 64 MiB; the table shows the
//! median nanoseconds per alloc+free pair (each pair timed alone) and the speed-up of the pool. The
//! three methods alternate by round so the machine's noise hits them alike.
//!
//! A second table runs a training-step pattern: each step allocates 64 buffers of mixed sizes
//! (256 B up to 8 MiB, the same sizes every step) on one stream and then frees them all, so the pool's
//! batched events, misses and pending-list scans are in the numbers (median ns per alloc+free over
//! the steps). A third table runs pool hits in 1 to 8 threads at once, each on its own stream
//! (each served by its thread's stream cache), against the same threads all on the default stream
//! (clones of one handle) and against cudarc in the same threads. Without a driver or a GPU it
//! prints why and exits 0 (1 with `BFC_REQUIRE_GPU=1`).

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use bfc_alloc::cuda::{device_count, driver_available, DeviceBuffer, DevicePool, PoolOptions};
use cudarc::driver::{result, CudaSlice, CudaStream};

/// Buffers per step of the training-step pattern.
const STEP_BUFFERS: usize = 64;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn time_pairs(iters: usize, mut pair: impl FnMut()) -> Vec<f64> {
    (0..iters)
        .map(|_| {
            let t = Instant::now();
            pair();
            t.elapsed().as_nanos() as f64
        })
        .collect()
}

fn pool_pair(pool: &DevicePool, stream: &Arc<CudaStream>, bytes: usize) {
    // SAFETY: the buffer is never read.
    let b: DeviceBuffer<u8> = unsafe { pool.alloc(stream, bytes) }.expect("pool alloc");
    drop(black_box(b));
}

fn driver_pair(bytes: usize) {
    // SAFETY: the context is current (bound in main on this thread); the memory is freed at once and
    // never used.
    unsafe {
        let p = result::malloc_sync(bytes).expect("cuMemAlloc");
        result::free_sync(black_box(p)).expect("cuMemFree");
    }
}

fn cudarc_pair(stream: &Arc<CudaStream>, bytes: usize) {
    // SAFETY: the slice is never read.
    let s: CudaSlice<u8> = unsafe { stream.alloc(bytes) }.expect("stream.alloc");
    drop(black_box(s));
}

/// Says why there is nothing to measure; exits 1 instead when `BFC_REQUIRE_GPU=1` (on a GPU
/// machine, a bench that measured nothing must not pass unnoticed).
fn nothing_to_measure(reason: &str) {
    if std::env::var("BFC_REQUIRE_GPU").is_ok_and(|v| v == "1") {
        eprintln!("device_pool bench: BFC_REQUIRE_GPU=1, but {reason}");
        std::process::exit(1);
    }
    println!("device_pool bench: {reason}; nothing to measure");
}

fn main() {
    if !driver_available() {
        return nothing_to_measure("no CUDA driver (libcuda) found");
    }
    match device_count() {
        Ok(0) => return nothing_to_measure("the CUDA driver reports no device"),
        Err(e) => return nothing_to_measure(&format!("cannot query devices ({e})")),
        Ok(_) => {}
    }
    let pool = DevicePool::new(0, PoolOptions::with_limit(1 << 30)).expect("pool on device 0");
    let ctx = pool.context();
    ctx.bind_to_thread().expect("bind context");
    let stream = ctx.default_stream();
    println!(
        "device 0: {} (async alloc: {})",
        ctx.name().unwrap_or_default(),
        ctx.has_async_alloc()
    );
    println!(
        "{:>10} {:>14} {:>16} {:>16} {:>9} {:>9}",
        "size", "pool hit ns", "cuMemAlloc ns", "stream.alloc ns", "vs cuMem", "vs cudarc"
    );
    let mut size = 256usize;
    while size <= 64 << 20 {
        let iters = if size <= 1 << 20 { 400 } else { 60 };
        let rounds = 5;
        let (mut p, mut d, mut c) = (Vec::new(), Vec::new(), Vec::new());
        // Warm-up: the pool grows to hold the size; cudarc's async pool too.
        pool_pair(&pool, &stream, size);
        cudarc_pair(&stream, size);
        for _ in 0..rounds {
            p.extend(time_pairs(iters, || pool_pair(&pool, &stream, size)));
            d.extend(time_pairs(iters, || driver_pair(size)));
            c.extend(time_pairs(iters, || cudarc_pair(&stream, size)));
        }
        stream.synchronize().expect("synchronize");
        let (p, d, c) = (median(&mut p), median(&mut d), median(&mut c));
        let label = if size >= 1 << 20 {
            format!("{} MiB", size >> 20)
        } else if size >= 1 << 10 {
            format!("{} KiB", size >> 10)
        } else {
            format!("{size} B")
        };
        println!(
            "{label:>10} {p:>14.0} {d:>16.0} {c:>16.0} {:>8.1}x {:>8.1}x",
            d / p,
            c / p
        );
        size *= 4;
    }
    // The training-step pattern.
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let sizes: Vec<usize> = (0..STEP_BUFFERS)
        .map(|_| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let exp = 8 + (rng % 15) as u32; // [2^exp, 2^(exp+1)): 256 B up to 8 MiB
            (1usize << exp) + (rng >> 32) as usize % (1usize << exp)
        })
        .collect();
    let per_pair = |steps: usize, mut step: Box<dyn FnMut() + '_>| -> Vec<f64> {
        step(); // warm-up
        time_pairs(steps, &mut *step)
            .into_iter()
            .map(|ns| ns / STEP_BUFFERS as f64)
            .collect()
    };
    let (mut p, mut d, mut c) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..5 {
        p.extend(per_pair(
            40,
            Box::new(|| {
                let held: Vec<DeviceBuffer<u8>> = sizes
                    .iter()
                    // SAFETY: never read.
                    .map(|&n| unsafe { pool.alloc(&stream, n) }.expect("pool alloc"))
                    .collect();
                drop(black_box(held));
            }),
        ));
        d.extend(per_pair(
            4,
            Box::new(|| {
                // SAFETY: as in `driver_pair`.
                let held: Vec<u64> = sizes
                    .iter()
                    .map(|&n| unsafe { result::malloc_sync(n) }.expect("cuMemAlloc"))
                    .collect();
                for p in black_box(held) {
                    // SAFETY: allocated above, never used.
                    unsafe { result::free_sync(p) }.expect("cuMemFree");
                }
            }),
        ));
        c.extend(per_pair(
            40,
            Box::new(|| {
                let held: Vec<CudaSlice<u8>> = sizes
                    .iter()
                    // SAFETY: never read.
                    .map(|&n| unsafe { stream.alloc(n) }.expect("stream.alloc"))
                    .collect();
                drop(black_box(held));
            }),
        ));
    }
    stream.synchronize().expect("synchronize");
    let (p, d, c) = (median(&mut p), median(&mut d), median(&mut c));
    println!(
        "\ntraining step: {STEP_BUFFERS} buffers of 256 B up to 8 MiB allocated, then all freed, \
         ns per alloc+free"
    );
    println!(
        "{:>10} {:>14} {:>16} {:>16} {:>9} {:>9}",
        "", "pool", "cuMemAlloc", "stream.alloc", "vs cuMem", "vs cudarc"
    );
    println!(
        "{:>10} {p:>14.0} {d:>16.0} {c:>16.0} {:>8.1}x {:>8.1}x",
        "step",
        d / p,
        c / p
    );
    threads_table(&pool);
    println!("\n{}", pool.stats());
    pool.check_err().expect("deferred pool errors");
}

/// Pool hits (4 KiB) in 1 to 8 threads at once, each on its own stream (each served by its
/// thread's stream cache), against the same threads all on the context's default stream (clones of
/// one `Arc<CudaStream>`, whose count a hit does not write) and against cudarc's `stream.alloc` +
/// drop on their own streams. Prints the wall time per alloc+free per thread (medians of 5 rounds); flat means no
/// contention.
fn threads_table(pool: &DevicePool) {
    const PAIRS: usize = 20_000;
    const BYTES: usize = 4096;
    let ctx = pool.context();
    println!(
        "\nthreads: {PAIRS} alloc+free of {BYTES} B per thread, each thread on its own stream, \
         wall ns per pair per thread"
    );
    println!(
        "{:>10} {:>14} {:>20} {:>16} {:>9}",
        "threads", "pool", "pool, default stream", "stream.alloc", "vs cudarc"
    );
    let default_stream = ctx.default_stream();
    for threads in [1, 2, 4, 8] {
        let own: Vec<Arc<CudaStream>> = (0..threads)
            .map(|_| ctx.new_stream().expect("new stream"))
            .collect();
        let shared: Vec<Arc<CudaStream>> = (0..threads).map(|_| default_stream.clone()).collect();
        // Wall time of `pair` run PAIRS times in every thread at once, thread `i` on `streams[i]`.
        let wall = |streams: &[Arc<CudaStream>], pair: &(dyn Fn(&Arc<CudaStream>) + Sync)| -> f64 {
            let start = std::sync::Barrier::new(threads + 1);
            let t = std::thread::scope(|scope| {
                for s in streams {
                    let (start, ctx) = (&start, &ctx);
                    scope.spawn(move || {
                        ctx.bind_to_thread().expect("bind context");
                        pair(s); // warm-up
                        start.wait();
                        for _ in 0..PAIRS {
                            pair(s);
                        }
                    });
                }
                start.wait();
                Instant::now()
            });
            t.elapsed().as_nanos() as f64 / PAIRS as f64
        };
        let (mut p, mut d, mut c) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..5 {
            p.push(wall(&own, &|s| pool_pair(pool, s, BYTES)));
            d.push(wall(&shared, &|s| pool_pair(pool, s, BYTES)));
            c.push(wall(&own, &|s| cudarc_pair(s, BYTES)));
        }
        for s in own.iter().chain([&default_stream]) {
            s.synchronize().expect("synchronize");
        }
        let (p, d, c) = (median(&mut p), median(&mut d), median(&mut c));
        println!(
            "{threads:>10} {p:>14.0} {d:>20.0} {c:>16.0} {:>8.1}x",
            c / p
        );
    }
}
