//! Side-by-side host comparison: `GlobalBfc` against the system allocator, in one run.
//!
//! Run: `cargo bench --bench host_compare`. Each workload runs alternately on both allocators for
//! several rounds (which one goes first alternates too); the table shows medians and the ratio
//! bfc/system (lower is better; <= 1.00 means bfc-alloc is no slower). Both are called through
//! `GlobalAlloc` in the same process, so the machine's noise hits them alike.
//!
//! This is a quick in-process check, not the comparison of record: here both allocators share one
//! process, and the system allocator's threads of the threaded workloads start with fresh per-thread
//! arenas each round while `GlobalBfc` keeps one warm arena. `bench-peers/` installs each allocator
//! as the `#[global_allocator]` of its own binary; its table is the one the README reports.
//!
//! The workloads are not bench-peers' own, so the two sets of numbers do not compare:
//! - the generator is xorshift (bench-peers: splitmix64) with other seeds, and every thread of a
//!   threaded churn draws the same sequence (bench-peers: one seed per thread);
//! - a threaded row is the mean of the threads' own loop times (bench-peers: the wall time from the
//!   first loop's start to the last one's end, which also counts a thread left behind);
//! - the pairs write nothing to their block (bench-peers writes the first byte);
//! - Vec growth is a byte buffer grown by doubling reallocs to 1 MiB, one byte written per push
//!   (bench-peers: a `Vec<u64>` pushed to 2^20 elements, 8 MiB);
//! - there is no `largew`, 16-thread churn, cross-thread free or JSON row, and there are two rows of
//!   its own (`churn 4K..64K core`, `64B-aligned pairs`).

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::time::Instant;

use bfc_alloc::GlobalBfc;

#[path = "../tests/common/rng.rs"]
mod rng;
use rng::Rng;

/// Mixed-size churn: live set of 10,000 blocks, sizes log-uniform 8..4096, random replacement, first
/// byte written. Returns ns per replacement step.
fn churn(a: &dyn GlobalAlloc, steps: usize) -> f64 {
    churn_sizes(a, steps, 8, 4096)
}

/// The same churn over sizes 16 KiB..64 KiB: every request goes to the BFC engine (no slab layer).
fn churn_core(a: &dyn GlobalAlloc, steps: usize) -> f64 {
    churn_sizes(a, steps, 16385, 65536)
}

/// The churn in two threads at once, each with its own live set: ns per step of one thread.
fn churn_two_threads(a: &dyn GlobalAlloc, steps: usize) -> f64 {
    churn_threads(a, steps, 2)
}

/// Four threads on this machine's cores: must not collapse when waiters outnumber cores.
fn churn_four_threads(a: &dyn GlobalAlloc, steps: usize) -> f64 {
    churn_threads(a, steps, 4)
}

/// The churn with every block 64-byte aligned (cache-line padded objects), in two threads: ns per step
/// of one thread.
fn churn_aligned_two_threads(a: &dyn GlobalAlloc, steps: usize) -> f64 {
    in_threads(a, 2, |a| churn_aligned(a, steps, 8, 4096, 64))
}

fn churn_threads(a: &dyn GlobalAlloc, steps: usize, threads: usize) -> f64 {
    in_threads(a, threads, |a| churn_sizes(a, steps, 8, 4096))
}

/// Runs `f` in `threads` threads at once; the mean of their results.
fn in_threads(
    a: &dyn GlobalAlloc,
    threads: usize,
    f: impl Fn(&dyn GlobalAlloc) -> f64 + Sync,
) -> f64 {
    // `&dyn GlobalAlloc` is not `Sync`; both allocators compared here are, so share the pointer.
    struct Shared<'a>(&'a dyn GlobalAlloc);
    // SAFETY: only `GlobalBfc` and `System` are passed in, and both are `Sync`.
    unsafe impl Sync for Shared<'_> {}
    let shared = Shared(a);
    let (shared, f) = (&shared, &f);
    let start = Arc::new(Barrier::new(threads));
    std::thread::scope(|s| {
        let t: Vec<_> = (0..threads)
            .map(|_| {
                let start = start.clone();
                s.spawn(move || {
                    START.with(|s| *s.borrow_mut() = Some(start));
                    f(shared.0)
                })
            })
            .collect();
        t.into_iter().map(|h| h.join().unwrap()).sum::<f64>() / threads as f64
    })
}

/// `p`, or the process aborts with the standard out-of-memory message (a null block would be
/// written to).
fn must(p: *mut u8, l: Layout) -> *mut u8 {
    if p.is_null() {
        std::alloc::handle_alloc_error(l);
    }
    p
}

std::thread_local! {
    /// Set on the threads of [`in_threads`]: each waits here, its live set filled, so that the
    /// timed loops of all threads start together.
    static START: std::cell::RefCell<Option<Arc<Barrier>>> = const { std::cell::RefCell::new(None) };
}

/// Waits for the other threads of [`in_threads`], if this is one of them.
fn start_together() {
    START.with(|s| {
        if let Some(b) = &*s.borrow() {
            b.wait();
        }
    });
}

fn churn_sizes(a: &dyn GlobalAlloc, steps: usize, lo: usize, hi: usize) -> f64 {
    churn_aligned(a, steps, lo, hi, 8)
}

fn churn_aligned(a: &dyn GlobalAlloc, steps: usize, lo: usize, hi: usize, align: usize) -> f64 {
    const LIVE: usize = 10_000;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut live: Vec<(*mut u8, Layout)> = Vec::with_capacity(LIVE);
    // SAFETY: non-zero layouts; each block is written within its size and freed once with its
    // layout.
    unsafe {
        for _ in 0..LIVE {
            let l = Layout::from_size_align(rng.log_uniform(lo, hi), align).unwrap();
            let p = must(a.alloc(l), l);
            *p = 1;
            live.push((p, l));
        }
        start_together();
        let t = Instant::now();
        for _ in 0..steps {
            let i = rng.next() as usize % LIVE;
            let (p, l) = live[i];
            a.dealloc(p, l);
            let l = Layout::from_size_align(rng.log_uniform(lo, hi), align).unwrap();
            let p = must(a.alloc(l), l);
            *p = 1;
            live[i] = (p, l);
        }
        let ns = t.elapsed().as_nanos() as f64 / steps as f64;
        for (p, l) in live {
            a.dealloc(p, l);
        }
        ns
    }
}

/// 32-byte alloc/free pairs. ns per pair.
fn pairs(a: &dyn GlobalAlloc, n: usize) -> f64 {
    pairs_of(a, n, Layout::from_size_align(32, 8).unwrap())
}

/// 64-byte blocks aligned to 64 bytes (a cache-line padded value), alloc/free pairs. ns per pair.
fn aligned_pairs(a: &dyn GlobalAlloc, n: usize) -> f64 {
    pairs_of(a, n, Layout::from_size_align(64, 64).unwrap())
}

/// `n` alloc/free pairs of layout `l`. ns per pair.
fn pairs_of(a: &dyn GlobalAlloc, n: usize, l: Layout) -> f64 {
    let t = Instant::now();
    for _ in 0..n {
        // SAFETY: a non-zero layout; the block is freed once with it.
        unsafe {
            let p = must(a.alloc(l), l);
            black_box(p);
            a.dealloc(p, l);
        }
    }
    t.elapsed().as_nanos() as f64 / n as f64
}

/// Vec-style growth by doubling reallocs, pushing 1 MiB of bytes, repeated. ns per pushed byte.
fn vec_growth(a: &dyn GlobalAlloc, rounds: usize) -> f64 {
    let mut pushes = 0usize;
    let t = Instant::now();
    for _ in 0..rounds {
        // SAFETY: the buffer is allocated with a non-zero layout, reallocated with its current
        // layout, written within its capacity, and freed once with its last layout.
        unsafe {
            let mut cap = 8usize;
            let mut l = Layout::from_size_align(cap, 8).unwrap();
            let mut p = must(a.alloc(l), l);
            let mut len = 0usize;
            while len < 1 << 20 {
                if len == cap {
                    let grown = Layout::from_size_align(cap * 2, 8).unwrap();
                    p = must(a.realloc(p, l, cap * 2), grown);
                    cap *= 2;
                    l = grown;
                }
                *p.add(len) = len as u8;
                len += 1;
            }
            pushes += len;
            a.dealloc(p, l);
        }
    }
    t.elapsed().as_nanos() as f64 / pushes as f64
}

/// Large blocks 64 KiB..16 MiB, live set 64, first byte written. ns per step.
fn large(a: &dyn GlobalAlloc, steps: usize) -> f64 {
    const LIVE: usize = 64;
    let mut rng = Rng(0x1234_5678_9abc_def1);
    let mut live: Vec<(*mut u8, Layout)> = Vec::with_capacity(LIVE);
    // SAFETY: non-zero layouts; each block is written within its size and freed once with its
    // layout.
    unsafe {
        for _ in 0..LIVE {
            let l = Layout::from_size_align(rng.log_uniform(64 << 10, 16 << 20), 8).unwrap();
            let p = must(a.alloc(l), l);
            *p = 1;
            live.push((p, l));
        }
        let t = Instant::now();
        for _ in 0..steps {
            let i = rng.next() as usize % LIVE;
            let (p, l) = live[i];
            a.dealloc(p, l);
            let l = Layout::from_size_align(rng.log_uniform(64 << 10, 16 << 20), 8).unwrap();
            let p = must(a.alloc(l), l);
            *p = 1;
            live[i] = (p, l);
        }
        let ns = t.elapsed().as_nanos() as f64 / steps as f64;
        for (p, l) in live {
            a.dealloc(p, l);
        }
        ns
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    // `cargo test --benches` passes `--bench`-less args; keep that run short.
    let quick = !std::env::args().any(|a| a == "--bench");
    let rounds = if quick { 1 } else { 9 };
    let scale = if quick { 1 } else { 20 };
    let bfc = GlobalBfc::new();
    let sys = System;
    type Workload = (
        &'static str,
        &'static str,
        fn(&dyn GlobalAlloc, usize) -> f64,
        usize,
    );
    let workloads: [Workload; 9] = [
        ("mixed-size churn", "ns/step", churn, 50_000 * scale),
        (
            "churn x4 threads",
            "ns/step",
            churn_four_threads,
            25_000 * scale,
        ),
        (
            "churn x2 threads",
            "ns/step",
            churn_two_threads,
            50_000 * scale,
        ),
        ("churn 16K..64K core", "ns/step", churn_core, 20_000 * scale),
        ("32-byte pairs", "ns/pair", pairs, 500_000 * scale),
        (
            "64B-aligned pairs",
            "ns/pair",
            aligned_pairs,
            500_000 * scale,
        ),
        (
            "aligned churn x2",
            "ns/step",
            churn_aligned_two_threads,
            50_000 * scale,
        ),
        ("Vec growth", "ns/push", vec_growth, 2 * scale),
        ("large 64K..16M", "ns/step", large, 500 * scale),
    ];
    println!(
        "{:<18} {:>8} {:>12} {:>12} {:>10}",
        "workload", "unit", "bfc-alloc", "system", "bfc/sys"
    );
    for (name, unit, f, n) in workloads {
        let (mut b, mut s) = (Vec::new(), Vec::new());
        for round in 0..rounds {
            // Alternate which allocator goes first, so neither always meets a cold or a warm
            // machine (caches, frequency, the other allocator's pages still resident).
            if round % 2 == 0 {
                b.push(f(&bfc, n));
                s.push(f(&sys, n));
            } else {
                s.push(f(&sys, n));
                b.push(f(&bfc, n));
            }
        }
        let (mb, ms) = (median(b), median(s));
        println!(
            "{name:<18} {unit:>8} {mb:>12.2} {ms:>12.2} {:>10.2}",
            mb / ms
        );
    }
    bfc.check().expect("heap invariants after the benchmark");
    println!("\nbfc-alloc stats after the run:\n{}", bfc.stats());
}
