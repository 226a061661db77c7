//! The device pool's cost per operation against the number of pending frees, on the simulated
//! device (no GPU needed): frees of blocks whose stream is still busy wait in per-stream queues,
//! and an allocation or a free must not scan them all.
//!
//! Run: `cargo bench --features cuda --bench pool_pending`. For each pending count `n`, stream A
//! allocates `n` 256-byte buffers, queues work, and frees them all (the GPU is "behind", so all
//! stay pending); then stream B allocates 2,000 buffers of 512 B (which pending blocks of A cannot
//! serve) and A allocates `min(n, 2,000)` of 256 B again (each served from its own pending blocks).
//! A second pool frees `n` blocks of distinct sizes on a busy stream and then misses 2,000 times on
//! that stream (sizes of 2 MiB and more, which none of them fits). A miss is a new large block from
//! the engine, which grows its regions as it goes; that costs far more than the scan of pending
//! blocks a miss adds (bounded: the stream's 256 most recent), and it varies with the host memory
//! the run has touched (mostly page faults; from about 0.3 to 1.2 us per miss between rows and runs
//! on a 2-core machine). So that column is shown for scale and left out of the last one. The last
//! column is the worst of the first three against the `n` = 100 row: flat means the cost does not
//! grow with the pending count. The rows are interleaved: each round runs
//! every `n` once, and each cell is the median over the rounds.
//!
//! A second table times a pool hit (alloc and free on one stream) while 0 to 1,000 other streams
//! hold a pending block each, all freed by the same thread: the pool finds the stream's queue in a
//! list of stream ids, and a poll queries nothing while no batch has an event and no queue is
//! empty. With no other stream, a stream that takes stream caches finds its block in the thread's
//! cache, without the pool's lock; with 16 or more, their blocks fill that cache, and once they
//! are stale (after 64 frees) the stream's frees take their places, so its hits go through the
//! cache from then on. The last column first closes the other streams' blocks (an unfinished
//! event each): a poll then queries up to 4 streams' events, in turn. A third table runs hits in 1 and 2 threads at once, each on its own
//! stream, on the pool's lock and with stream caches (the ratio is the second over the first).
//!
//! Every run checks what it measures: the frees are pending, the same-stream allocations took
//! them, and the pools' invariants hold (so the quick run under `cargo test --benches` checks the
//! paths too).

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
    assert_eq!(pool.stats().pending_blocks, n, "every free waits for A");
    let m = 2000;
    let t = Instant::now();
    let other: Vec<_> = (0..m).map(|_| alloc(b, 512)).collect();
    let on_other = t.elapsed().as_nanos() as f64 / m as f64;
    let same_n = n.min(m);
    let t = Instant::now();
    let same: Vec<_> = (0..same_n).map(|_| alloc(a, 256)).collect();
    let on_same = t.elapsed().as_nanos() as f64 / same_n as f64;
    assert_eq!(
        pool.stats().pending_blocks,
        n - same_n,
        "A's allocations were served from its pending blocks"
    );
    drop(black_box((other, same)));
    pool.check().expect("pool invariants");
    pool.check_err().expect("no deferred error");

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
    assert_eq!(
        pool.stats().pending_blocks,
        n,
        "no miss took a pending block"
    );
    drop(black_box(missed));
    pool.check().expect("pool invariants");
    pool.check_err().expect("no deferred error");
    [free, on_other, on_same, misses]
}

/// ns per pool hit (alloc and free of 4 KiB on stream `s`) while `k` other streams, all busy, hold
/// one pending block each (16 in this thread's stream cache, the others in their queues; with
/// `events`, all in their queues, each with an event that has not completed): the cost of finding
/// the stream's block in the cache, or its queue among the others, and of polling their events.
fn hit_with_streams(s: SimStream, k: usize, events: bool, hits: usize) -> f64 {
    let dev = SimDevice::new(64 << 30);
    let pool = DevicePool::with_backend(dev.backend(), PoolOptions::with_limit(32 << 30))
        .expect("simulated pool");
    let others: Vec<SimStream> = (0..k as u64).map(|i| SimStream(10 + i)).collect();
    // SAFETY: simulated memory is never read.
    let bufs: Vec<_> = others
        .iter()
        .map(|s| unsafe { pool.alloc::<u8>(s, 256) }.expect("alloc"))
        .collect();
    for &s in &others {
        dev.enqueue(s);
    }
    drop(bufs);
    if events {
        pool.trim(); // The streams are busy: an event each.
    }
    let t = Instant::now();
    for _ in 0..hits {
        // SAFETY: as above.
        drop(black_box(
            unsafe { pool.alloc::<u8>(&s, 4096) }.expect("alloc"),
        ));
    }
    let ns = t.elapsed().as_nanos() as f64 / hits as f64;
    assert_eq!(
        pool.stats().pending_blocks,
        k + 1,
        "the other streams' blocks stay pending; the hits reused one block"
    );
    pool.check().expect("pool invariants");
    ns
}

fn main() {
    // `cargo test --benches` runs this without `--bench`: one quick run of each row.
    let runs = if std::env::args().any(|a| a == "--bench") {
        RUNS
    } else {
        1
    };
    println!("| pending frees | ns per free | ns per alloc, other stream | ns per alloc, same stream | ns per miss, distinct sizes pending | worst of the first three / n=100 |");
    println!("|---:|---:|---:|---:|---:|---:|");
    const ROWS: [usize; 4] = [100, 1_000, 10_000, 30_000];
    // cols[row][column]: one value per round.
    let mut cols: [[Vec<f64>; 4]; ROWS.len()] = Default::default();
    for _ in 0..runs {
        for (row, &n) in cols.iter_mut().zip(&ROWS) {
            for (c, v) in row.iter_mut().zip(run(n)) {
                c.push(v);
            }
        }
    }
    let mut base = None;
    for (row, n) in cols.into_iter().zip(ROWS) {
        let row = row.map(|mut c| median(&mut c));
        let base = *base.get_or_insert(row);
        let worst = row[..3]
            .iter()
            .zip(base)
            .map(|(r, b)| r / b)
            .fold(0.0f64, f64::max);
        println!(
            "| {n} | {:.0} | {:.0} | {:.0} | {:.0} | {worst:.2}x |",
            row[0], row[1], row[2], row[3]
        );
    }

    println!();
    println!("| other streams with a pending block | ns per hit (alloc + free on one stream), on the pool's lock | the same, stream with a cache | on the pool's lock, the others' blocks waiting for an event each |");
    println!("|---:|---:|---:|---:|");
    let hits = if runs == 1 { 1_000 } else { 200_000 };
    for k in [0, 16, 100, 1_000] {
        let (mut locked, mut cached, mut events) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..runs {
            locked.push(hit_with_streams(LOCKED[0], k, false, hits));
            cached.push(hit_with_streams(CACHED[0], k, false, hits));
            events.push(hit_with_streams(LOCKED[0], k, true, hits));
        }
        println!(
            "| {k} | {:.0} | {:.0} | {:.0} |",
            median(&mut locked),
            median(&mut cached),
            median(&mut events)
        );
    }

    println!();
    println!("| threads, each on its own stream | ns per hit per thread, on the pool's lock | the same, streams with caches | ratio |");
    println!("|---:|---:|---:|---:|");
    for threads in [1, 2] {
        let mut locked = Vec::new();
        let mut cached = Vec::new();
        for _ in 0..runs {
            locked.push(hits_in_threads(&LOCKED[..threads], hits));
            cached.push(hits_in_threads(&CACHED[..threads], hits));
        }
        let (l, c) = (median(&mut locked), median(&mut cached));
        println!("| {threads} | {l:.0} | {c:.0} | {:.2} |", c / l);
    }
}

/// Streams that take the pool's lock for every call (the simulator gives streams 0 to 2 no stream
/// cache, so that both paths can be measured).
const LOCKED: [SimStream; 2] = [SimStream(1), SimStream(2)];
/// Streams that take stream caches (the calling thread's).
const CACHED: [SimStream; 2] = [SimStream(3), SimStream(4)];

/// ns per pool hit (alloc and free of 4 KiB) per thread, with one thread on each of `streams` at
/// once, each stream busy (its frees stay its own).
fn hits_in_threads(streams: &[SimStream], hits: usize) -> f64 {
    let dev = SimDevice::new(64 << 30);
    let pool = DevicePool::with_backend(dev.backend(), PoolOptions::with_limit(32 << 30))
        .expect("simulated pool");
    for &s in streams {
        dev.enqueue(s);
    }
    let barrier = std::sync::Barrier::new(streams.len());
    let ns: Vec<f64> = std::thread::scope(|scope| {
        let handles: Vec<_> = streams
            .iter()
            .map(|s| {
                let (pool, barrier) = (&pool, &barrier);
                scope.spawn(move || {
                    // SAFETY: simulated memory is never read.
                    drop(unsafe { pool.alloc::<u8>(s, 4096) }.expect("alloc"));
                    barrier.wait();
                    let t = Instant::now();
                    for _ in 0..hits {
                        // SAFETY: as above.
                        drop(black_box(
                            unsafe { pool.alloc::<u8>(s, 4096) }.expect("alloc"),
                        ));
                    }
                    t.elapsed().as_nanos() as f64 / hits as f64
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("thread"))
            .collect()
    });
    let st = pool.stats();
    assert_eq!(
        (st.pending_blocks, st.allocator.num_allocs),
        (streams.len(), (streams.len() * (hits + 1)) as u64),
        "every hit reused its stream's one block"
    );
    pool.check().expect("pool invariants");
    ns.iter().sum::<f64>() / ns.len() as f64
}
