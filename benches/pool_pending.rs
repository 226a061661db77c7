//! The device pool's cost per operation against the number of pending frees, on the simulated
//! device (no GPU needed): frees of blocks whose stream is still busy wait in per-stream queues,
//! and an allocation or a free must not scan them all.
//!
//! Run: `cargo bench --features cuda --bench pool_pending`. For each pending count `n`, stream A
//! allocates `n` 256-byte buffers, queues work, and frees them all (the GPU is "behind", so all
//! stay pending); then stream B allocates 2,000 buffers of 512 B (which pending blocks of A cannot
//! serve) and A allocates 2,000 of 256 B again (served from its own pending blocks). A second
//! pool frees `n` blocks of distinct sizes on a busy stream and then misses 2,000 times on that
//! stream (sizes none of them fits). The last column is the worst against the `n` = 100 row: flat
//! means the cost does not grow with the pending count.

use std::hint::black_box;
use std::time::Instant;

use bfc_alloc::cuda::{DevicePool, PoolOptions, SimDevice, SimStream};

/// Medians of this many runs per row.
const RUNS: usize = 5;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// ns per free, per allocation on another stream, per allocation on the same stream, per miss on
/// a stream with `n` pending blocks of distinct sizes.
fn run(n: usize) -> [f64; 4] {
    let dev = SimDevice::new(64 << 30);
    let pool = DevicePool::with_backend(dev.backend(), PoolOptions::with_limit(32 << 30))
        .expect("simulated pool");
    let (a, b) = (SimStream(1), SimStream(2));
    let alloc = |s: SimStream, bytes: usize| {
        // SAFETY: simulated memory is never read.
        unsafe { pool.alloc::<u8>(&s, bytes) }.expect("alloc")
    };
    let bufs: Vec<_> = (0..n).map(|_| alloc(a, 256)).collect();
    dev.enqueue(a);
    let t = Instant::now();
    drop(black_box(bufs));
    let free = t.elapsed().as_nanos() as f64 / n as f64;
    let m = 2000;
    let t = Instant::now();
    let other: Vec<_> = (0..m).map(|_| alloc(b, 512)).collect();
    let on_other = t.elapsed().as_nanos() as f64 / m as f64;
    let t = Instant::now();
    let same: Vec<_> = (0..m).map(|_| alloc(a, 256)).collect();
    let on_same = t.elapsed().as_nanos() as f64 / m as f64;
    drop(black_box((other, same)));

    let pool = DevicePool::with_backend(dev.backend(), PoolOptions::with_limit(32 << 30))
        .expect("simulated pool");
    let alloc = |s: SimStream, bytes: usize| {
        // SAFETY: simulated memory is never read.
        unsafe { pool.alloc::<u8>(&s, bytes) }.expect("alloc")
    };
    let bufs: Vec<_> = (0..n).map(|i| alloc(a, 256 * (1 + i % 4000))).collect();
    dev.enqueue(a);
    drop(black_box(bufs));
    let t = Instant::now();
    let missed: Vec<_> = (0..m).map(|i| alloc(a, (2 << 20) | (i * 256))).collect();
    let misses = t.elapsed().as_nanos() as f64 / m as f64;
    drop(black_box(missed));
    [free, on_other, on_same, misses]
}

fn main() {
    // `cargo test --benches` runs this without `--bench`: one quick run of each row.
    let runs = if std::env::args().any(|a| a == "--bench") {
        RUNS
    } else {
        1
    };
    println!("| pending frees | ns per free | ns per alloc, other stream | ns per alloc, same stream | ns per miss, distinct sizes pending | worst / n=100 |");
    println!("|---:|---:|---:|---:|---:|---:|");
    let mut base = None;
    for n in [100, 1_000, 10_000, 30_000] {
        let mut cols: [Vec<f64>; 4] = Default::default();
        for _ in 0..runs {
            for (c, v) in cols.iter_mut().zip(run(n)) {
                c.push(v);
            }
        }
        let row = cols.map(|mut c| median(&mut c));
        let base = *base.get_or_insert(row);
        let worst = row
            .iter()
            .zip(base)
            .map(|(r, b)| r / b)
            .fold(0.0f64, f64::max);
        println!(
            "| {n} | {:.0} | {:.0} | {:.0} | {:.0} | {worst:.2}x |",
            row[0], row[1], row[2], row[3]
        );
    }
}
