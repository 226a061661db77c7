//! Where the memory of a small-object workload goes: runs the workload of bench-peers' `churn` (a
//! live set of 10,000 blocks, sizes log-uniform in 8..=4096 B, random replacement; the same
//! distribution, drawn from the tests' random generator, so not the same sequence) with `GlobalBfc`
//! as the global allocator and splits the process's resident memory into the bytes callers asked for,
//! size-class rounding, blocks held in thread and transfer caches, allocator metadata, and the rest
//! (free memory that stays resident: free objects in slab spans and free engine chunks).
//!
//! The last column, "live pages", counts the pages that hold the first byte of a live block (the
//! only byte the workload writes). No allocator that places the blocks where this one does can keep
//! fewer pages resident, whatever it does with its free memory.
//!
//! ```sh
//! cargo run --release --example memory_breakdown [steps]
//! ```

use std::alloc::{alloc, dealloc, Layout};

#[global_allocator]
static A: bfc_alloc::GlobalBfc = bfc_alloc::GlobalBfc::new();

#[path = "../tests/common/rng.rs"]
mod rng;
use rng::Rng;

/// `(VmRSS, VmHWM)` in KiB.
fn rss_kib() -> (usize, usize) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

fn layout(size: usize) -> Layout {
    Layout::from_size_align(size, 8).expect("valid layout")
}

/// Bytes of the distinct pages holding the first byte of a block in `slots`. `scratch` (as long as
/// `slots`, allocated up front so the count allocates nothing) is overwritten.
fn live_page_bytes(slots: &[(*mut u8, usize)], scratch: &mut [usize]) -> usize {
    // SAFETY: sysconf has no preconditions.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
    for (s, &(p, _)) in scratch.iter_mut().zip(slots) {
        *s = p as usize / page;
    }
    scratch.sort_unstable();
    let distinct = 1 + scratch.windows(2).filter(|w| w[0] != w[1]).count();
    distinct * page
}

fn report(label: &str, base: usize, requested: usize, live_pages: usize) {
    let s = A.stats();
    let (rss, hwm) = rss_kib();
    let kib = |b: usize| b / 1024;
    let grown = rss.saturating_sub(base);
    let rounding = s.bytes_in_use.saturating_sub(requested);
    let accounted = kib(requested) + kib(rounding) + kib(s.bytes_cached) + kib(s.metadata_bytes);
    println!(
        "{label:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10}",
        kib(requested),
        kib(rounding),
        kib(s.bytes_cached),
        kib(s.metadata_bytes),
        grown as isize - accounted as isize,
        grown,
        hwm,
        kib(live_pages)
    );
}

fn main() {
    let steps: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse().expect("steps: a number"))
        .unwrap_or(3_000_000);
    let (base, _) = rss_kib();
    println!("resident at start: {base} KiB; columns in KiB");
    println!(
        "{:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10}",
        "step",
        "requested",
        "rounding",
        "cached",
        "metadata",
        "rest",
        "rss-start",
        "peak rss",
        "live pages"
    );
    let mut rng = Rng(1);
    let mut slots: Vec<(*mut u8, usize)> = Vec::with_capacity(10_000);
    let mut scratch = vec![0usize; 10_000];
    // The slot table and the scratch table are requests too.
    let mut requested = slots.capacity() * std::mem::size_of::<(*mut u8, usize)>()
        + scratch.len() * std::mem::size_of::<usize>();
    for _ in 0..10_000 {
        let s = rng.log_size(8, 4096);
        // SAFETY: a non-zero layout; the block is written within its size and freed once below.
        let p = unsafe { alloc(layout(s)) };
        assert!(!p.is_null(), "out of memory");
        // SAFETY: the block holds at least one byte.
        unsafe { p.write(1) };
        requested += s;
        slots.push((p, s));
    }
    report(
        "filled",
        base,
        requested,
        live_page_bytes(&slots, &mut scratch),
    );
    for k in 1..=steps {
        let i = (rng.next() % slots.len() as u64) as usize;
        let (p, s) = slots[i];
        // SAFETY: `p` came from `alloc(layout(s))` and is freed once.
        unsafe { dealloc(p, layout(s)) };
        requested -= s;
        let s = rng.log_size(8, 4096);
        // SAFETY: as above.
        let p = unsafe { alloc(layout(s)) };
        assert!(!p.is_null(), "out of memory");
        // SAFETY: the block holds at least one byte.
        unsafe { p.write(1) };
        requested += s;
        slots[i] = (p, s);
        if k % (steps / 6).max(1) == 0 || k == steps {
            let live = live_page_bytes(&slots, &mut scratch);
            report(&k.to_string(), base, requested, live);
        }
    }
    for (p, s) in slots.drain(..) {
        // SAFETY: as above.
        unsafe { dealloc(p, layout(s)) };
        requested -= s;
    }
    report("freed", base, requested, 0);
}
