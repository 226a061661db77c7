//! The workloads, shared by every `peer-*` binary. Each binary installs one allocator as the
//! process's `#[global_allocator]` and calls [`main`], which runs the workload named by `argv[1]` and
//! prints `<workload> <time per unit> <peak RSS KiB>` (peak RSS = `VmHWM` of the process at the end).
//!
//! - `churn`: a live set of 10,000 blocks, sizes log-uniform in 8..=4096, random replacement.
//! - `pairs`: allocate 32 bytes, write, free.
//! - `vec`: a `Vec<u64>` pushed from empty to 2^20 elements, 200 times (realloc growth).
//! - `large`: the churn over 64 blocks of 64 KiB..=16 MiB.
//! - `largew`: `large` with one byte written in every 4 KiB page of each block (a program that fills
//!   its blocks), 10,000 steps: its time counts the page faults and its peak RSS the live bytes,
//!   which `large`'s first-byte writes leave out.
//! - `churn2`, `churn4`, `churn16`: the churn in 2 / 4 / 16 threads, each with its own live set;
//!   wall time of the measured loops over the steps of one thread (16 threads on a 2-core machine:
//!   a lock holder is often descheduled). The threads start their loops together and free their
//!   live sets only after every loop has ended.
//! - `achurn2`: `churn2` with every block aligned to 64 bytes (cache-line padded values).
//! - `large2`: the churn of 16 live blocks of 64 KiB..=1 MiB in each of 2 threads, 100,000 steps
//!   per thread. In bfc-alloc every block above 64 KiB (all but a few) is above the medium classes:
//!   it takes the heap lock unless the thread met contention there and caches such blocks.
//! - `large2w`: `large2` with a byte written in every 4 KiB page, 20,000 steps per thread.
//! - `xfree`: one thread allocates (8..=512 bytes) and sends batches of 256 to one that frees them;
//!   wall time per object. `xfreem`: the same with blocks of 16..=64 KiB in batches of 16
//!   (buffers handed from thread to thread), 200,000 of them.
//! - `mid`: the churn with sizes log-uniform in 2..=16 KiB (10,000 live blocks, 1,000,000 steps).
//! - `med`: the churn with sizes log-uniform in 16..=64 KiB (1,000 live blocks, 1,000,000 steps).
//! - `pagebuf`: `med` with every block aligned to 4 KiB (page-aligned I/O buffers); `pagebuf2`: the
//!   same in 2 threads, 500 live blocks and 500,000 steps each.
//! - `json`: `serde_json` parse of an 11.5 MB document into a `Value` and back to a `String`.
//! - `bufw`: 8 live I/O buffers of 16 KiB..=1 MiB, a byte written in every 4 KiB page.
//! - `zero`, `zerol`: `vec![0u8; n]`, 8 live, a byte written per page, n in 4 KiB..=1 MiB and
//!   1..=16 MiB; `zeros`: `zerol` with a byte written per 64 pages (a sparse table).
//!
//! Every block gets its first byte written (and, where said, one in every page); the PRNG is a
//! fixed-seed splitmix64.

use std::alloc::{alloc, dealloc, Layout};
use std::hint::black_box;
use std::sync::{mpsc, Arc, Barrier};
use std::time::Instant;

/// The workloads, their units, in table order.
pub const WORKLOADS: &[(&str, &str)] = &[
    ("churn", "ns/step"),
    ("pairs", "ns/pair"),
    ("vec", "ns/push"),
    ("large", "ns/step"),
    ("largew", "ns/step"),
    ("churn2", "ns/step/thread"),
    ("churn4", "ns/step/thread"),
    ("churn16", "ns/step/thread"),
    ("achurn2", "ns/step/thread"),
    ("large2", "ns/step/thread"),
    ("large2w", "ns/step/thread"),
    ("xfree", "ns/object"),
    ("xfreem", "ns/object"),
    ("json", "ms/round (11.5 MB parse + serialize)"),
    ("bufw", "ns/step"),
    ("zero", "ns/KiB"),
    ("zerol", "ns/KiB"),
    ("zeros", "ns/KiB"),
    ("mid", "ns/step"),
    ("med", "ns/step"),
    ("pagebuf", "ns/step"),
    ("pagebuf2", "ns/step/thread"),
];

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // splitmix64
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Log-uniform in `lo..=hi`.
    fn log_size(&mut self, lo: usize, hi: usize) -> usize {
        let u = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        let (a, b) = ((lo as f64).ln(), (hi as f64).ln());
        ((a + u * (b - a)).exp() as usize).clamp(lo, hi)
    }
}

fn layout_aligned(size: usize, align: usize) -> Layout {
    Layout::from_size_align(size, align).unwrap()
}

/// Allocates `size` bytes and writes the first byte.
fn get(size: usize) -> *mut u8 {
    get_aligned(size, 8)
}

/// Allocates `size` bytes aligned to `align` and writes the first byte.
fn get_aligned(size: usize, align: usize) -> *mut u8 {
    get_touched::<false>(size, align)
}

/// Allocates `size` bytes aligned to `align` and writes the first byte, and with `EVERY_PAGE` one
/// byte in every 4 KiB of the block (a constant, so the first-byte workloads' code is unchanged).
fn get_touched<const EVERY_PAGE: bool>(size: usize, align: usize) -> *mut u8 {
    // SAFETY: a non-zero layout.
    let p = unsafe { alloc(layout_aligned(size, align)) };
    assert!(!p.is_null(), "out of memory");
    // SAFETY: the block holds at least one byte.
    unsafe { p.write(size as u8) };
    if EVERY_PAGE {
        for off in (4096..size).step_by(4096) {
            // SAFETY: `off < size`.
            unsafe { p.add(off).write(off as u8) };
        }
    }
    black_box(p)
}

fn put(p: *mut u8, size: usize) {
    put_aligned(p, size, 8)
}

fn put_aligned(p: *mut u8, size: usize, align: usize) {
    // SAFETY: `p` came from `get_aligned(size, align)` (or `get(size)` for `align` 8) and is freed
    // once.
    unsafe { dealloc(p, layout_aligned(size, align)) };
}

/// Random replacement in a live set of `live` blocks of log-uniform sizes in `lo..=hi`. Fills the
/// live set, waits at `start` (if any), then times `steps` replacements, then waits at `start` again
/// (so that no thread frees its live set while another is still measured): returns the measured
/// loop's start and end. `EVERY_PAGE`: see [`get_touched`].
fn churn_span<const EVERY_PAGE: bool>(
    seed: u64,
    live: usize,
    lo: usize,
    hi: usize,
    steps: usize,
    align: usize,
    start: Option<&Barrier>,
) -> (Instant, Instant) {
    let mut rng = Rng(seed);
    let mut slots: Vec<(*mut u8, usize)> = (0..live)
        .map(|_| {
            let s = rng.log_size(lo, hi);
            (get_touched::<EVERY_PAGE>(s, align), s)
        })
        .collect();
    if let Some(b) = start {
        b.wait();
    }
    let t0 = Instant::now();
    for _ in 0..steps {
        let i = (rng.next() % live as u64) as usize;
        let (p, s) = slots[i];
        put_aligned(p, s, align);
        let s = rng.log_size(lo, hi);
        slots[i] = (get_touched::<EVERY_PAGE>(s, align), s);
    }
    let t1 = Instant::now();
    if let Some(b) = start {
        b.wait();
    }
    for (p, s) in slots {
        put_aligned(p, s, align);
    }
    (t0, t1)
}

/// [`churn`] (first byte written) with every block aligned to `align`.
fn aligned_churn(seed: u64, live: usize, lo: usize, hi: usize, steps: usize, align: usize) -> f64 {
    let (t0, t1) = churn_span::<false>(seed, live, lo, hi, steps, align, None);
    (t1 - t0).as_nanos() as f64 / steps as f64
}

/// [`churn_span`] in one thread: ns per step.
fn churn<const EVERY_PAGE: bool>(
    seed: u64,
    live: usize,
    lo: usize,
    hi: usize,
    steps: usize,
) -> f64 {
    let (t0, t1) = churn_span::<EVERY_PAGE>(seed, live, lo, hi, steps, 8, None);
    (t1 - t0).as_nanos() as f64 / steps as f64
}

/// `vec![0u8; n]` (`alloc_zeroed`) for `steps` log-uniform sizes in `lo..=hi`, each replacing one
/// of 8 live buffers at random, with one byte written per `stride` bytes: ns per KiB allocated.
fn zeroed(steps: usize, lo: usize, hi: usize, stride: usize) -> f64 {
    let mut rng = Rng(21);
    let mut live: Vec<Vec<u8>> = (0..8).map(|_| Vec::new()).collect();
    let mut bytes = 0usize;
    let t = Instant::now();
    for _ in 0..steps {
        let n = rng.log_size(lo, hi);
        bytes += n;
        let mut v = vec![0u8; n];
        for off in (0..n).step_by(stride) {
            v[off] = off as u8 | 1;
        }
        let i = (rng.next() % 8) as usize;
        live[i] = black_box(v);
    }
    black_box(&live);
    t.elapsed().as_nanos() as f64 / (bytes as f64 / 1024.0)
}

fn pairs(n: usize) -> f64 {
    let t = Instant::now();
    for _ in 0..n {
        put(get(32), 32);
    }
    t.elapsed().as_nanos() as f64 / n as f64
}

fn vec_growth(rounds: usize, len: usize) -> f64 {
    let t = Instant::now();
    for r in 0..rounds {
        let mut v: Vec<u64> = Vec::new();
        for i in 0..len {
            v.push(i as u64 ^ r as u64);
        }
        black_box(&v);
    }
    t.elapsed().as_nanos() as f64 / (rounds * len) as f64
}

/// The churn in `threads` threads at once, each with its own live set, blocks aligned to `align`:
/// the wall time from the first measured loop's start to the last one's end, per step of one thread.
fn threaded_churn(threads: usize, steps: usize, align: usize) -> f64 {
    threaded_churn_of::<false>(threads, steps, align, (10_000, 8, 4096))
}

/// [`threaded_churn`] with `(live, lo, hi)` per thread, and every page of each block written if
/// `EVERY_PAGE`.
fn threaded_churn_of<const EVERY_PAGE: bool>(
    threads: usize,
    steps: usize,
    align: usize,
    (live, lo, hi): (usize, usize, usize),
) -> f64 {
    let start = Arc::new(Barrier::new(threads));
    let hs: Vec<_> = (0..threads)
        .map(|t| {
            let start = start.clone();
            std::thread::spawn(move || {
                churn_span::<EVERY_PAGE>(7 + t as u64, live, lo, hi, steps, align, Some(&start))
            })
        })
        .collect();
    let spans: Vec<(Instant, Instant)> = hs.into_iter().map(|h| h.join().unwrap()).collect();
    let first = spans.iter().map(|s| s.0).min().unwrap();
    let last = spans.iter().map(|s| s.1).max().unwrap();
    (last - first).as_nanos() as f64 / steps as f64
}

/// One producer allocates, one consumer frees: ns per object (wall time / objects), from the
/// first of the two threads' starts after a barrier (thread creation is not timed) to when both
/// have exited.
fn cross_thread_free(objects: usize) -> f64 {
    cross_thread_free_of(objects, 256, (8, 512))
}

/// [`cross_thread_free`] of sizes log-uniform in `lo..=hi`, in batches of `per_batch` objects.
fn cross_thread_free_of(objects: usize, per_batch: usize, (lo, hi): (usize, usize)) -> f64 {
    let batches = objects / per_batch;
    let (tx, rx) = mpsc::sync_channel::<Vec<(usize, usize)>>(16);
    let start = Arc::new(Barrier::new(2));
    let consumer_start = start.clone();
    let producer = std::thread::spawn(move || {
        start.wait();
        let t = Instant::now();
        let mut rng = Rng(11);
        for _ in 0..batches {
            let batch: Vec<(usize, usize)> = (0..per_batch)
                .map(|_| {
                    let s = rng.log_size(lo, hi);
                    (get(s) as usize, s)
                })
                .collect();
            tx.send(batch).unwrap();
        }
        t
    });
    let consumer = std::thread::spawn(move || {
        consumer_start.wait();
        let t = Instant::now();
        for batch in rx {
            for (p, s) in batch {
                put(p as *mut u8, s);
            }
        }
        t
    });
    let first = producer.join().unwrap().min(consumer.join().unwrap());
    // The objects sent: whole batches only.
    first.elapsed().as_nanos() as f64 / (batches * per_batch) as f64
}

/// A JSON document of about 11.5 MB: an array of objects with strings (some of varying length),
/// numbers, a nested object and nested arrays.
fn json_document() -> String {
    let mut s = String::from("[");
    for i in 0..40_000u64 {
        if i > 0 {
            s.push(',');
        }
        s.push_str(&format!(
            "{{\"id\":{i},\"name\":\"user-{i:08x}\",\"email\":\"user{i}@example.com\",\
             \"score\":{}.{:03},\"tags\":[\"t{}\",\"t{}\",\"t{}\"],\
             \"pos\":{{\"x\":{},\"y\":{},\"path\":[{},{},{},{}]}},\"active\":{},\"note\":\"{}\"}}",
            i % 1000,
            i % 997,
            i % 7,
            i % 11,
            i % 13,
            i * 3,
            i * 5,
            i,
            i + 1,
            i + 2,
            i + 3,
            i % 2 == 0,
            "lorem ipsum ".repeat((i % 17) as usize)
        ));
    }
    s.push(']');
    s
}

fn json(rounds: usize) -> f64 {
    let doc = json_document();
    let t = Instant::now();
    for _ in 0..rounds {
        let v: serde_json::Value = serde_json::from_str(&doc).unwrap();
        let out = serde_json::to_string(&v).unwrap();
        assert!(out.len() > doc.len() / 2);
        black_box(out);
    }
    t.elapsed().as_secs_f64() * 1e3 / rounds as f64
}

/// Peak resident set (VmHWM) in KiB.
fn peak_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Runs the workload named by `argv[1]` and prints its line.
pub fn main() {
    let name = std::env::args()
        .nth(1)
        .expect("usage: peer-<allocator> <workload>");
    let value = match name.as_str() {
        "churn" => churn::<false>(1, 10_000, 8, 4096, 3_000_000),
        "pairs" => pairs(30_000_000),
        "vec" => vec_growth(200, 1 << 20),
        "large" => churn::<false>(3, 64, 64 << 10, 16 << 20, 100_000),
        "largew" => churn::<true>(3, 64, 64 << 10, 16 << 20, 10_000),
        "churn2" => threaded_churn(2, 2_000_000, 8),
        "churn4" => threaded_churn(4, 750_000, 8),
        "churn16" => threaded_churn(16, 200_000, 8),
        "achurn2" => threaded_churn(2, 2_000_000, 64),
        // Engine blocks in 2 threads: 16 live blocks of 64 KiB..1 MiB each.
        "large2" => threaded_churn_of::<false>(2, 100_000, 8, (16, 64 << 10, 1 << 20)),
        // The same with every page of each block written.
        "large2w" => threaded_churn_of::<true>(2, 20_000, 8, (16, 64 << 10, 1 << 20)),
        "xfree" => cross_thread_free(2_000_000),
        "xfreem" => cross_thread_free_of(200_000, 16, (16 << 10, 64 << 10)),
        "json" => json(2),
        // A few I/O buffers of 16 KiB..1 MiB (8 live), every page written.
        "bufw" => churn::<true>(4, 8, 16 << 10, 1 << 20, 100_000),
        // `vec![0u8; n]`, 8 live, a byte written per page: n 4 KiB..1 MiB, then 1..16 MiB.
        "zero" => zeroed(100_000, 4 << 10, 1 << 20, 4096),
        "zerol" => zeroed(1_000, 1 << 20, 16 << 20, 4096),
        // The same with a byte written per 64 pages (a sparse table).
        "zeros" => zeroed(1_000, 1 << 20, 16 << 20, 64 << 12),
        // The churn of blocks just above the small ones: 2..16 KiB.
        "mid" => churn::<false>(5, 10_000, 2 << 10, 16 << 10, 1_000_000),
        // Above the slab layer: 1,000 live blocks of 16..64 KiB, all engine blocks.
        "med" => churn::<false>(6, 1_000, 16 << 10, 64 << 10, 1_000_000),
        // `med` aligned to a page.
        "pagebuf" => aligned_churn(6, 1_000, 16 << 10, 64 << 10, 1_000_000, 4096),
        "pagebuf2" => threaded_churn_of::<false>(2, 500_000, 4096, (500, 16 << 10, 64 << 10)),
        other => panic!("unknown workload {other}"),
    };
    println!("{name} {value:.3} {}", peak_rss_kib());
}
