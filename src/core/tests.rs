//! Core unit tests over the simulated source. Every test runs the invariant checker after each step.

extern crate std;

use std::string::ToString;
use std::vec;
use std::vec::Vec;

use super::sim::SimSource;
use super::*;

const BASE: usize = 1 << 40;

type Sim = Bfc<SimSource, Vec<Chunk>>;

fn engine(config: Config) -> Sim {
    Bfc::new(
        config,
        SimSource::new(BASE, 1 << 36),
        vec![Chunk::EMPTY; 4096],
    )
    .unwrap()
}

/// Runs a sweep of free chunks of at least `min` bytes; returns what it gave back.
fn swept(b: &mut Sim, min: usize, aging: bool) -> Vec<(usize, usize)> {
    let mut v = Vec::new();
    b.sweep_dirty(min, aging, |p, s| {
        v.push((p, s));
        true
    });
    checked(b);
    v
}

fn checked(b: &Sim) {
    if let Err(e) = b.check() {
        panic!("{e}");
    }
}

/// What the checker finds wrong with an engine a test corrupted.
fn broken(b: &Sim) -> &'static str {
    b.check()
        .expect_err("the checker passed a corrupted engine")
        .what
}

/// Allocates through [`Bfc::allocate_block`], checking the size it reports against the chunk's.
fn alloc(b: &mut Sim, size: usize, align: usize) -> usize {
    let got = b
        .allocate_block(size, align)
        .unwrap_or_else(|e| panic!("alloc {size}/{align}: {e}"));
    checked(b);
    assert_eq!(got.ptr % align, 0);
    assert_eq!(Ok(got.size), b.usable_size(got.ptr), "the reported size");
    assert!(got.size >= size);
    got.ptr
}

fn free(b: &mut Sim, p: usize) -> Freed {
    let f = b.deallocate(p).unwrap();
    checked(b);
    f
}

#[test]
fn rounds_to_granule_and_reuses_freed_memory() {
    let mut b = engine(Config::device(1 << 30));
    let p = alloc(&mut b, 1, 1);
    assert_eq!(b.usable_size(p), Ok(256));
    let q = alloc(&mut b, 257, 1);
    assert_eq!(b.usable_size(q), Ok(512));
    assert_eq!(q, p + 256, "second block follows the first");
    free(&mut b, p);
    let r = alloc(&mut b, 200, 1);
    assert_eq!(r, p, "freed chunk is reused");
    let s = b.stats();
    assert_eq!(s.num_allocs, 3);
    assert_eq!(s.bytes_in_use, 768);
    assert_eq!(s.largest_alloc_size, 512);
}

#[test]
fn coalesces_both_neighbours() {
    let mut b = engine(Config::device(1 << 30));
    let ps: Vec<usize> = (0..4).map(|_| alloc(&mut b, 1024, 1)).collect();
    free(&mut b, ps[0]);
    free(&mut b, ps[2]);
    let f = free(&mut b, ps[1]);
    assert_eq!((f.merged_ptr, f.merged_size), (ps[0], 3 * 1024));
    assert_eq!(
        b.chunks().filter(|c| !c.in_use()).count(),
        2,
        "merged block and region tail"
    );
    free(&mut b, ps[3]);
    let s = b.stats();
    assert_eq!(s.num_free_chunks, 1);
    assert_eq!(s.largest_free_block, s.bytes_reserved);
}

#[test]
fn split_rule_follows_ratio_and_waste_bound() {
    // Device rule: a 1000-granule free chunk serving a 600-granule request is not split (< 2x, waste
    // below 128 MiB), but serving 400 granules it is.
    let mut cfg = Config::device(1 << 30);
    cfg.allow_growth = false;
    let mut b = engine(cfg);
    let a = alloc(&mut b, 1000 * 256, 1);
    let guard = alloc(&mut b, 256, 1);
    free(&mut b, a);
    let x = alloc(&mut b, 600 * 256, 1);
    assert_eq!(x, a);
    assert_eq!(b.usable_size(x), Ok(1000 * 256), "not split below 2x");
    free(&mut b, x);
    let y = alloc(&mut b, 400 * 256, 1);
    assert_eq!(b.usable_size(y), Ok(400 * 256), "split at 2x");
    // Waste bound: with max_internal_fragmentation = 1 granule everything is split.
    let mut cfg = Config::device(1 << 30);
    cfg.max_internal_fragmentation = 256;
    let mut b = engine(cfg);
    let a = alloc(&mut b, 1000 * 256, 1);
    let _g = alloc(&mut b, 256, 1);
    free(&mut b, a);
    let x = alloc(&mut b, 999 * 256, 1);
    assert_eq!(b.usable_size(x), Ok(999 * 256));
    let _ = guard;
}

#[test]
fn large_alignment_splits_padding_into_a_free_chunk() {
    let mut b = engine(Config::host(1 << 34));
    let small = alloc(&mut b, 16, 1);
    let big = alloc(&mut b, 100, 1 << 20);
    assert_eq!(big % (1 << 20), 0);
    // The padding between `small` and `big` is a free chunk, not wasted inside `big`.
    assert_eq!(b.usable_size(big), Ok(112));
    let pad: Vec<Chunk> = b
        .chunks()
        .filter(|c| !c.in_use() && c.ptr() < big)
        .collect();
    assert_eq!(pad.len(), 1);
    assert_eq!(pad[0].ptr(), small + 16);
    // Huge alignments beyond the region alignment.
    let huge = alloc(&mut b, 4096, 1 << 30);
    assert_eq!(huge % (1 << 30), 0);
    free(&mut b, big);
    free(&mut b, huge);
    free(&mut b, small);
    assert_eq!(b.stats().bytes_in_use, 0);
}

#[test]
fn bad_alignment_and_sizes_fail_cleanly() {
    let mut b = engine(Config::host(1 << 30));
    assert_eq!(b.allocate(8, 3), Err(AllocError::BadAlignment { align: 3 }));
    assert_eq!(
        b.allocate(8, MAX_ALIGN * 2),
        Err(AllocError::BadAlignment {
            align: MAX_ALIGN * 2
        })
    );
    assert_eq!(
        b.allocate(usize::MAX - 3, 8),
        Err(AllocError::TooLarge {
            size: usize::MAX - 3
        })
    );
    assert!(matches!(
        b.allocate(1 << 31, 8),
        Err(AllocError::OutOfMemory(_))
    ));
    // The messages say what a valid request is, and what to change.
    let msg = b.allocate(8, 3).unwrap_err().to_string();
    assert!(msg.contains("must be a power of two"), "{msg}");
    let msg = b.allocate(usize::MAX - 3, 8).unwrap_err().to_string();
    assert!(msg.contains("exceeds isize::MAX"), "{msg}");
    let msg = b.allocate(1 << 31, 8).unwrap_err().to_string();
    assert!(msg.contains("raise the limit"), "{msg}");
    checked(&b);
    let p = alloc(&mut b, 64, 8);
    free(&mut b, p);
}

#[test]
fn bad_frees_are_detected_and_change_nothing() {
    let mut b = engine(Config::host(1 << 30));
    let p = alloc(&mut b, 64, 1);
    let q = alloc(&mut b, 4096, 1);
    let before = b.stats();
    assert_eq!(b.deallocate(12345), Err(FreeError::NotOwned { ptr: 12345 }));
    assert_eq!(
        b.deallocate(p + 16),
        Err(FreeError::Interior {
            ptr: p + 16,
            block: p
        })
    );
    assert_eq!(
        b.deallocate(q + 2048),
        Err(FreeError::Interior {
            ptr: q + 2048,
            block: q
        })
    );
    assert_eq!(
        b.deallocate(p + 3),
        Err(FreeError::Interior {
            ptr: p + 3,
            block: p
        })
    );
    assert_eq!(b.stats(), before);
    checked(&b);
    free(&mut b, p);
    assert_eq!(b.deallocate(p), Err(FreeError::DoubleFree { ptr: p }));
    // `p` merged into nothing (its successor `q` is in use): still detected after `q` goes too and
    // the two merge.
    free(&mut b, q);
    assert_eq!(b.deallocate(q), Err(FreeError::DoubleFree { ptr: q }));
    assert_eq!(b.deallocate(p), Err(FreeError::DoubleFree { ptr: p }));
    // A pointer into a far block of the free tail (a long backward map scan: skipped under Miri).
    if !cfg!(miri) {
        let far = BASE + (1 << 29);
        assert_eq!(b.deallocate(far), Err(FreeError::DoubleFree { ptr: far }));
    }
    checked(&b);
}

#[test]
fn growth_doubles_and_backs_off() {
    let mut cfg = Config::device(1 << 30);
    cfg.initial_region_size = 1 << 20;
    let mut b = engine(cfg);
    alloc(&mut b, 1000, 1);
    // Three 1 MiB blocks: the 1 MiB region is nearly full, the 2 MiB one holds two, then 4 MiB.
    for _ in 0..3 {
        alloc(&mut b, 1 << 20, 1);
    }
    assert_eq!(b.source().requests, vec![1 << 20, 2 << 20, 4 << 20]);
    // 3 MiB are left in the 4 MiB region; a 4 MiB block needs an 8 MiB region.
    // The source refuses anything above 5 MiB: 8 MiB backs off by 0.9 until it fits.
    b.source_mut().refuse_above = 5 << 20;
    alloc(&mut b, 4 << 20, 1);
    let reqs = &b.source().requests;
    let granted = *reqs.last().unwrap();
    assert!(((4 << 20)..=(5 << 20)).contains(&granted), "{reqs:?}");
    assert!(reqs.len() > 5, "backed off in several steps: {reqs:?}");
    for w in reqs[3..].windows(2) {
        assert!(w[1] < w[0] && w[1] >= w[0] / 10 * 9 - 256, "{reqs:?}");
    }
}

#[test]
fn a_source_that_refuses_everything_is_asked_a_bounded_number_of_times() {
    // Regions have doubled to 4 GiB (the next asks 8 GiB); then the source refuses everything (a
    // device out of memory).
    let mut b = engine(Config::device(1 << 40));
    for _ in 0..10 {
        alloc(&mut b, 1 << 29, 1);
    }
    let next = 2 * b.source().requests.last().unwrap();
    assert!(next >= 1 << 30, "{:?}", b.source().requests);
    // Fill what is left of the regions.
    loop {
        let largest = b.stats().largest_free_block;
        if largest == 0 {
            break;
        }
        alloc(&mut b, largest, 1);
    }
    b.source_mut().refuse_above = 0;
    b.source_mut().requests.clear();
    // The regions are full: a 256-byte request needs a region. 0.9 steps all the way from 8 GiB
    // down to 256 bytes would ask 149 times.
    assert!(b.allocate(256, 1).is_err());
    let reqs = &b.source().requests;
    assert!(reqs.len() <= 40, "asked {} times: {reqs:?}", reqs.len());
    // The first size, 16 steps of 0.9, then halving down to the request.
    assert_eq!(reqs[0], next);
    assert_eq!(*reqs.last().unwrap(), 256);
    for (i, w) in reqs.windows(2).enumerate() {
        let factor = if i < 16 { 9 } else { 5 };
        assert!(
            w[1] < w[0] && w[1] >= (w[0] / 10 * factor).saturating_sub(256),
            "{reqs:?}"
        );
    }
    // A source with room left gives a region within twice of it: not a region of the request
    // alone (the next growth would start from that).
    b.source_mut().refuse_above = 1 << 30;
    b.source_mut().requests.clear();
    alloc(&mut b, 1 << 20, 1);
    let got = *b.source().requests.last().unwrap();
    assert!(
        ((512 << 20)..=(1 << 30)).contains(&got),
        "{:?}",
        b.source().requests
    );
    assert!(b.source().requests.len() <= 20);
    checked(&b);
}

#[test]
fn a_failed_growth_leaves_the_next_region_size_alone() {
    // The source refuses any region above 16 MiB. Three refused 64 MiB requests must not inflate
    // the size of the next region: it still doubles from the first one's 2 MiB to 4 MiB.
    let mut b = engine(Config::device(1 << 34));
    b.source_mut().refuse_above = 16 << 20;
    alloc(&mut b, 1 << 20, 1);
    assert_eq!(b.source().requests, [2 << 20]);
    for _ in 0..3 {
        assert!(b.allocate(64 << 20, 1).is_err());
    }
    checked(&b);
    b.source_mut().requests.clear();
    alloc(&mut b, 2 << 20, 1);
    assert_eq!(b.source().requests, [4 << 20]);
}

#[test]
fn a_refused_pointer_map_backs_off_to_a_smaller_region() {
    // A region's map has one entry per map block: the source refuses maps for regions above
    // 4 MiB, as a host out of memory would.
    let mut cfg = Config::device(1 << 30);
    cfg.initial_region_size = 8 << 20;
    let mut b = engine(cfg);
    let block = cfg.granule * cfg.map_block_granules;
    b.source_mut().refuse_maps_above = (4 << 20) / block;
    // An 8 MiB region's map is refused: smaller regions are tried, down to the request.
    alloc(&mut b, 1 << 20, 1);
    let reserved = b.stats().bytes_reserved;
    assert!(
        ((1 << 20)..=(4 << 20)).contains(&reserved),
        "{reserved} B, after {:?}",
        b.source().requests
    );
    // A request whose own map would be refused fails, and does not poison later growth: the next
    // region starts from twice what the first growth got (not from twice what it tried).
    assert!(b.allocate(16 << 20, 1).is_err());
    b.source_mut().requests.clear();
    alloc(&mut b, 4 << 20, 1);
    assert_eq!(b.stats().num_regions, 2);
    assert_eq!(b.source().requests[0], 2 * reserved);
    checked(&b);
}

#[test]
fn growth_after_a_backed_off_region_starts_from_what_the_source_gave() {
    // The source refuses any region above 16 MiB. Each 15 MiB block needs a region of its own;
    // once one growth backed off, the next starts near what the source gave, so each growth takes
    // a few source calls, not a walk down from the whole limit.
    let mut b = engine(Config::device(1 << 34));
    b.source_mut().refuse_above = 16 << 20;
    for _ in 0..12 {
        b.source_mut().requests.clear();
        alloc(&mut b, 15 << 20, 1);
        let calls = b.source().requests.len();
        assert!(
            calls <= 10,
            "{calls} source calls: {:?}",
            b.source().requests
        );
    }
    checked(&b);
}

#[test]
fn memory_limit_caps_reservation_and_oom_reports_occupancy() {
    let mut cfg = Config::device(8 << 20);
    cfg.initial_region_size = 1 << 20;
    let mut b = engine(cfg);
    let mut live = Vec::new();
    loop {
        match b.allocate(300 << 10, 1) {
            Ok(p) => live.push(p),
            Err(AllocError::OutOfMemory(r)) => {
                assert_eq!(r.requested, 300 << 10);
                assert!(r.stats.bytes_reserved <= 8 << 20);
                assert_eq!(r.stats.bytes_limit, 8 << 20);
                // Chunks below 2x the request are handed out whole, so in-use may exceed the sum.
                let usable: usize = live.iter().map(|&p| b.usable_size(p).unwrap()).sum();
                assert_eq!(r.stats.bytes_in_use, usable);
                assert!(usable >= live.len() * (300 << 10));
                let free: usize = r.free_by_size.iter().map(|s| s.bytes).sum();
                assert_eq!(free, r.stats.bytes_free());
                let text = std::format!("{r}");
                assert!(text.contains("requested 307200 B"), "{text}");
                break;
            }
            Err(e) => panic!("{e}"),
        }
        checked(&b);
    }
    assert!(live.len() >= 20);
    // Keeps working after frees.
    for p in live.drain(..) {
        free(&mut b, p);
    }
    alloc(&mut b, 300 << 10, 1);
}

#[test]
fn free_regions_are_released_and_retried_before_oom() {
    let mut cfg = Config::device(4 << 20);
    cfg.initial_region_size = 1 << 20;
    let mut b = engine(cfg);
    let a = alloc(&mut b, 1 << 20, 1); // region 1: 1 MiB
    let c = alloc(&mut b, 1 << 20, 1); // region 2: 2 MiB
    assert_eq!(b.stats().num_regions, 2);
    free(&mut b, a);
    free(&mut b, c);
    // 3 MiB reserved, 1 MiB left under the limit: a 3 MiB request only fits after releasing both.
    let big = alloc(&mut b, 3 << 20, 1);
    assert!(b.source().regions_freed >= 2);
    assert_eq!(b.stats().num_regions, 1);
    free(&mut b, big);
    assert_eq!(
        b.release_free_regions(),
        b.source().requests.last().copied().unwrap()
    );
    assert_eq!(b.stats().bytes_reserved, 0);
    assert_eq!(b.source().regions_live(), 0);
    checked(&b);
}

#[test]
fn a_request_that_cannot_fit_keeps_the_free_regions() {
    // With growth: 3 MiB reserved and free, limit 4 MiB. A 5 MiB request fits under the limit
    // neither way; a 4 MiB one fits only after both regions go back.
    let mut cfg = Config::device(4 << 20);
    cfg.initial_region_size = 1 << 20;
    let mut b = engine(cfg);
    let a = alloc(&mut b, 1 << 20, 1);
    let c = alloc(&mut b, 1 << 20, 1);
    free(&mut b, a);
    free(&mut b, c);
    assert!(b.allocate(5 << 20, 1).is_err());
    assert_eq!(
        b.source().regions_freed,
        0,
        "nothing to gain, nothing given back"
    );
    assert_eq!(b.stats().bytes_reserved, 3 << 20);
    checked(&b);
    let big = alloc(&mut b, 4 << 20, 1);
    assert_eq!(b.source().regions_freed, 2);
    free(&mut b, big);
    checked(&b);

    // Without growth: a request above the limit keeps the free region too.
    let mut cfg = Config::device(8 << 20);
    cfg.allow_growth = false;
    let mut b = engine(cfg);
    let p = alloc(&mut b, 1000, 1);
    free(&mut b, p);
    assert!(b.allocate(9 << 20, 1).is_err());
    assert_eq!(b.source().regions_freed, 0);
    assert_eq!(b.stats().bytes_reserved, 8 << 20);
    checked(&b);
}

#[test]
fn a_new_region_needs_padding_room_only_for_alignment_above_2_mib() {
    // A new region is aligned to the request's alignment up to 2 MiB. A fresh engine without
    // growth used to demand `size + align - granule` under the limit, and refused these.
    let mut cfg = Config::device(4 << 20);
    cfg.allow_growth = false;
    let mut b = engine(cfg);
    let p = alloc(&mut b, 4 << 20, 1 << 20);
    assert_eq!(b.stats().bytes_reserved, 4 << 20);
    free(&mut b, p);

    let mut cfg = Config::device(8 << 20);
    cfg.allow_growth = false;
    let mut b = engine(cfg);
    // 5 MiB at 4 MiB alignment needs at most 2 MiB of padding in a 2 MiB-aligned region.
    let p = alloc(&mut b, 5 << 20, 4 << 20);
    free(&mut b, p);

    // With growth the region is not oversized for the alignment: 1 MiB at 1 MiB takes 1 MiB.
    let mut cfg = Config::device(64 << 20);
    cfg.initial_region_size = 1 << 20;
    let mut b = engine(cfg);
    let p = alloc(&mut b, 1 << 20, 1 << 20);
    assert_eq!(b.stats().bytes_reserved, 1 << 20);
    free(&mut b, p);
    // And 1 MiB at 4 MiB alignment needs 1 + 4 - 2 MiB: the region size doubles from 1 MiB to 4
    // MiB, not to 8 MiB (for 5 MiB less a granule).
    let mut b = engine(cfg);
    let p = alloc(&mut b, 1 << 20, 4 << 20);
    assert_eq!(b.stats().bytes_reserved, 4 << 20);
    free(&mut b, p);
}

/// A [`SimSource`] whose `free_region` panics while `panic_on_free` is set, as a device back end's
/// free may.
struct PanickyFree {
    sim: SimSource,
    panic_on_free: bool,
}

// SAFETY: every call goes to the simulated source, which keeps the promises; a panic in
// `free_region` comes before the region is touched and hands out nothing.
unsafe impl MemorySource for PanickyFree {
    fn alloc_region(&mut self, size: usize, align: usize) -> Option<usize> {
        self.sim.alloc_region(size, align)
    }

    unsafe fn free_region(&mut self, base: usize, size: usize) {
        assert!(!self.panic_on_free, "the source fails to free");
        // SAFETY: the caller's promise, passed on.
        unsafe { self.sim.free_region(base, size) }
    }

    fn alloc_map(
        &mut self,
        region_base: usize,
        entries: usize,
    ) -> Option<NonNull<Option<ChunkHandle>>> {
        self.sim.alloc_map(region_base, entries)
    }

    unsafe fn free_map(
        &mut self,
        region_base: usize,
        map: NonNull<Option<ChunkHandle>>,
        entries: usize,
    ) {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.sim.free_map(region_base, map, entries) }
    }
}

#[test]
fn a_source_that_panics_in_free_leaves_a_consistent_engine() {
    let mut cfg = Config::device(64 << 20);
    cfg.initial_region_size = 1 << 20;
    let source = PanickyFree {
        sim: SimSource::new(BASE, 1 << 36),
        panic_on_free: false,
    };
    let mut b = Bfc::new(cfg, source, vec![Chunk::EMPTY; 64]).unwrap();
    let a = b.allocate(1 << 20, 1).unwrap();
    let keep = b.allocate(2 << 20, 1).unwrap();
    b.deallocate(a).unwrap();
    b.source_mut().panic_on_free = true;
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| b.release_free_regions()));
    assert!(r.is_err());
    b.source_mut().panic_on_free = false;
    // The engine no longer has the region it was giving back, and says so.
    b.check().unwrap();
    assert_eq!(b.stats().num_regions, 1);
    assert_eq!(b.stats().bytes_reserved, 2 << 20);
    // Its record is reused without tangling the chunk lists, and no byte is handed out twice.
    let mut live = vec![(keep, 2 << 20)];
    for size in [1 << 20, 3 << 20, 256 << 10, 4 << 20] {
        let p = b.allocate(size, 1).unwrap();
        assert!(live.iter().all(|&(q, n)| p + size <= q || q + n <= p));
        live.push((p, size));
        b.check().unwrap();
    }
    for (p, _) in live {
        b.deallocate(p).unwrap();
    }
    b.release_free_regions();
    b.check().unwrap();
    assert_eq!(b.stats().bytes_reserved, 0);
}

#[test]
fn no_growth_takes_one_region_of_the_limit() {
    let mut cfg = Config::device(16 << 20);
    cfg.allow_growth = false;
    let mut b = engine(cfg);
    let p = alloc(&mut b, 1000, 1);
    assert_eq!(b.source().requests, vec![16 << 20]);
    let err = b.allocate(16 << 20, 1);
    assert!(
        matches!(err, Err(AllocError::OutOfMemory(r)) if r.cause == OomCause::LimitReached),
        "{err:?}"
    );
    assert_eq!(b.source().requests.len(), 1, "no second region");
    free(&mut b, p);
}

#[test]
fn resize_in_place_grows_into_free_successor_and_shrinks() {
    let mut cfg = Config::host(1 << 30);
    cfg.quick_max_size = 0;
    let mut b = engine(cfg);
    let p = alloc(&mut b, 64, 16);
    let q = alloc(&mut b, 64, 16);
    let _r = alloc(&mut b, 64, 16);
    // Shrink splits the tail off.
    assert!(matches!(
        b.resize_in_place(p, 32),
        Ok(Resize::Done {
            size: 32,
            freed: Some(_)
        })
    ));
    checked(&b);
    // Grow back into the freed tail.
    assert_eq!(
        b.resize_in_place(p, 64),
        Ok(Resize::Done {
            size: 64,
            freed: None
        })
    );
    checked(&b);
    // Successor in use: must move.
    assert_eq!(b.resize_in_place(p, 65), Ok(Resize::Moved));
    free(&mut b, q);
    assert_eq!(
        b.resize_in_place(p, 128),
        Ok(Resize::Done {
            size: 128,
            freed: None
        })
    );
    checked(&b);
    assert_eq!(b.resize_in_place(p, 129), Ok(Resize::Moved));
    assert_eq!(b.stats().bytes_in_use, 128 + 64);
    assert_eq!(
        b.resize_in_place(q + (1 << 20), 8),
        Err(FreeError::DoubleFree { ptr: q + (1 << 20) })
    );
}

/// A successor held in a quick list is free to callers: a block grows into it in place, as the
/// rustdoc of `resize_in_place` says ("when the next chunk is free and large enough").
#[test]
fn resize_in_place_grows_into_a_quick_listed_successor() {
    let mut cfg = Config::host(1 << 30);
    cfg.quick_depth = 2;
    let mut b = engine(cfg);
    let p = alloc(&mut b, 64, 16);
    let q = alloc(&mut b, 64, 16);
    let _r = alloc(&mut b, 64, 16);
    let x = alloc(&mut b, 64, 16);
    let _guard = alloc(&mut b, 64, 16);
    // `q` is cached, behind `x` in the same quick list.
    free(&mut b, q);
    free(&mut b, x);
    assert_eq!(b.stats().num_cached_chunks, 2);
    assert_eq!(b.grown_end(p, 128), Some(p + 128));
    assert_eq!(
        b.resize_in_place(p, 128),
        Ok(Resize::Done {
            size: 128,
            freed: None
        })
    );
    checked(&b);
    assert_eq!(b.stats().num_cached_chunks, 1, "`x` stays cached");
    assert_eq!(b.stats().bytes_in_use, 128 + 64 + 64);
    assert_eq!(b.allocate(64, 16), Ok(x));
    // A cached successor followed by a free chunk: the rest split off the grown block merges
    // with that free chunk.
    cfg.quick_depth = 1;
    let mut b = engine(cfg);
    let p = alloc(&mut b, 64, 16);
    let q = alloc(&mut b, 64, 16);
    let r2 = alloc(&mut b, 64, 16);
    let _guard = alloc(&mut b, 64, 16);
    free(&mut b, q); // cached
    free(&mut b, r2); // the list is full: into the bins
    assert_eq!(b.stats().num_cached_chunks, 1);
    assert_eq!(
        b.resize_in_place(p, 96),
        Ok(Resize::Done {
            size: 96,
            freed: None
        })
    );
    checked(&b);
    assert_eq!(b.stats().num_cached_chunks, 0);
    assert_eq!(b.stats().bytes_in_use, 96 + 64);
}

/// Random allocations, frees and small grows with short quick lists, so that blocks often grow
/// into a cached successor: the checker passes after every step, `grown_end` names where each grow
/// ends, a block grows whenever its successor is cached and large enough, the cached counters drop
/// by exactly the chunk taken, and a grown block overlaps no live or cached block.
#[test]
fn random_grows_into_cached_successors_keep_the_counters_exact() {
    use std::collections::BTreeMap;
    let configs = [
        (16, 1, 2, 16),
        (16, 2, 2, 16),
        (16, 4, 2, 16),
        (8, 3, 0, 64),
        (16, 2, 4, 1 << 10),
    ];
    let steps = if cfg!(miri) { 60 } else { 3000 };
    for (ci, &(granule, depth, split_ratio, max_frag)) in configs.iter().enumerate() {
        for seed in 1..=if cfg!(miri) { 1u64 } else { 4 } {
            // Small regions that end inside a map block (`map_block_granules` granules): blocks
            // often grow at the region's end, and the checker sees its last partial map block.
            let mut cfg = Config::host(granule * (24 * 32 + 17));
            cfg.granule = granule;
            cfg.quick_max_size = 64 * granule;
            cfg.quick_depth = depth;
            cfg.split_ratio = split_ratio;
            cfg.max_internal_fragmentation = max_frag;
            let mut b = engine(cfg);
            let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            let mut next = move || {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng
            };
            let mut live: BTreeMap<usize, usize> = BTreeMap::new();
            let mut cached: BTreeMap<usize, usize> = BTreeMap::new();
            for step in 0..steps {
                let at = |what: &str| std::format!("config {ci}, seed {seed}, step {step}: {what}");
                let before = b.stats();
                match next() % 8 {
                    0..=2 => {
                        let size = granule * (1 + next() as usize % 12);
                        let got = b.allocate_block(size, 1);
                        if let Ok(g) = got {
                            cached.remove(&g.ptr);
                        }
                        if b.stats().num_cached_chunks == 0 {
                            // The slow path flushed every quick list.
                            cached.clear();
                        }
                        if let Ok(got) = got {
                            live.insert(got.ptr, got.size);
                        }
                    }
                    3 | 4 => {
                        if live.is_empty() {
                            continue;
                        }
                        let p = *live.keys().nth(next() as usize % live.len()).unwrap();
                        let s = live.remove(&p).unwrap();
                        b.deallocate(p).unwrap();
                        if b.stats().num_cached_chunks > before.num_cached_chunks {
                            cached.insert(p, s);
                        }
                    }
                    _ => {
                        if live.is_empty() {
                            continue;
                        }
                        let p = *live.keys().nth(next() as usize % live.len()).unwrap();
                        let old = live[&p];
                        let want = old + granule * (1 + next() as usize % 6);
                        let grown = b.grown_end(p, want);
                        let successor = cached.get(&(p + old)).copied();
                        match b.resize_in_place(p, want).unwrap() {
                            Resize::Done { size, freed } => {
                                assert!(size >= want, "{}", at("too small"));
                                assert_eq!(freed, None, "{}", at("a grow freed"));
                                assert_eq!(grown, Some(p + size), "{}", at("grown_end"));
                                let after = b.stats();
                                assert_eq!(after.bytes_in_use, before.bytes_in_use + size - old);
                                assert_eq!(after.num_chunks_in_use, before.num_chunks_in_use);
                                if let Some(cs) = successor {
                                    cached.remove(&(p + old));
                                    assert!(
                                        size <= old + cs,
                                        "{}",
                                        at("grew past the cached chunk")
                                    );
                                    assert_eq!(
                                        (after.num_cached_chunks, after.bytes_cached),
                                        (before.num_cached_chunks - 1, before.bytes_cached - cs),
                                        "{}",
                                        at("cached counters")
                                    );
                                } else {
                                    assert_eq!(
                                        (after.num_cached_chunks, after.bytes_cached),
                                        (before.num_cached_chunks, before.bytes_cached),
                                        "{}",
                                        at("cached counters")
                                    );
                                }
                                for (&q, &qs) in live.iter().chain(cached.iter()) {
                                    if q != p {
                                        assert!(
                                            q + qs <= p || p + size <= q,
                                            "{}",
                                            at("the grown block overlaps another")
                                        );
                                    }
                                }
                                live.insert(p, size);
                            }
                            Resize::Moved => {
                                assert_eq!(grown, None, "{}", at("grown_end"));
                                assert!(
                                    successor.is_none_or(|cs| old + cs < want),
                                    "{}",
                                    at("a cached successor large enough was not taken")
                                );
                                assert_eq!(b.stats().num_cached_chunks, before.num_cached_chunks);
                            }
                        }
                    }
                }
                if let Err(e) = b.check() {
                    panic!("{}", at(&e.to_string()));
                }
                let s = b.stats();
                assert_eq!(
                    s.bytes_in_use,
                    live.values().sum::<usize>(),
                    "{}",
                    at("in use")
                );
                assert_eq!(s.num_chunks_in_use, live.len(), "{}", at("chunks in use"));
                assert_eq!(s.num_cached_chunks, cached.len(), "{}", at("cached chunks"));
                assert_eq!(
                    s.bytes_cached,
                    cached.values().sum::<usize>(),
                    "{}",
                    at("cached")
                );
            }
        }
    }
}

#[test]
fn chunk_table_exhaustion_is_an_error_not_a_crash() {
    let mut b: Sim = Bfc::new(
        Config::host(1 << 30),
        SimSource::new(BASE, 1 << 32),
        vec![Chunk::EMPTY; 8],
    )
    .unwrap();
    let mut live = Vec::new();
    let err = loop {
        match b.allocate(16, 16) {
            Ok(p) => live.push(p),
            Err(e) => break e,
        }
        checked(&b);
    };
    assert!(
        matches!(err, AllocError::OutOfMemory(r) if r.cause == OomCause::ChunkTableFull),
        "{err}"
    );
    assert!(err.to_string().contains("more records"), "{err}");
    assert!(live.len() >= 6);
    for p in live {
        free(&mut b, p);
    }
    alloc(&mut b, 16, 16);
}

/// A full chunk table whose records are held by quick-listed chunks: the allocation flushes the
/// quick lists (which frees records as the cached chunks coalesce) before it reports that the
/// table is full. It used to fail at once when the chunk it picked could not be split.
#[test]
fn a_full_chunk_table_flushes_the_quick_lists_before_failing() {
    let mut b: Sim = Bfc::new(
        Config::host(1 << 30),
        SimSource::new(BASE, 1 << 32),
        vec![Chunk::EMPTY; 8],
    )
    .unwrap();
    // Seven 16-byte blocks and the free rest of the region: all eight records.
    let ps: Vec<usize> = (0..7).map(|_| alloc(&mut b, 16, 16)).collect();
    assert_eq!(b.records_touched(), 8);
    // Six of them cached, uncoalesced: they still hold their records.
    for &p in &ps[..6] {
        free(&mut b, p);
    }
    assert_eq!(b.stats().num_cached_chunks, 6);
    // A size no quick list holds: the free rest of the region must be split, and the table is
    // full until the cached chunks coalesce.
    let p = alloc(&mut b, 4096, 16);
    free(&mut b, p);
    free(&mut b, ps[6]);
}

#[test]
fn stats_track_peaks_and_metadata() {
    let mut b = engine(Config::host(1 << 30));
    let ps: Vec<usize> = (0..100).map(|i| alloc(&mut b, 100 + i * 10, 8)).collect();
    let s = b.stats();
    assert_eq!(s.num_chunks_in_use, 100);
    assert!(s.metadata_bytes > 100 * 32);
    for p in ps {
        free(&mut b, p);
    }
    let cached = b.stats();
    assert!(cached.num_cached_chunks > 0 && cached.bytes_cached > 0);
    b.flush_quick_lists();
    checked(&b);
    let s2 = b.stats();
    assert_eq!((s2.num_cached_chunks, s2.bytes_cached), (0, 0));
    assert_eq!(s2.bytes_in_use, 0);
    assert_eq!(s2.peak_bytes_in_use, s.bytes_in_use);
    assert_eq!(s2.fragmentation(), 0.0);
}

#[test]
fn checker_detects_corruption() {
    let mut b = engine(Config::host(1 << 30));
    let p = alloc(&mut b, 64, 8);
    let _q = alloc(&mut b, 64, 8);
    // Corrupt the counters and the chunk list directly.
    b.stats.bytes_in_use += 16;
    assert_eq!(
        broken(&b),
        "bytes_in_use or chunk count disagrees with a recount"
    );
    b.stats.bytes_in_use -= 16;
    checked(&b);
    let h = b.lookup_in_use(p).unwrap();
    b.table.get_mut(h).set_size(32);
    assert_eq!(broken(&b), "address neighbours not contiguous");
}

#[test]
fn checker_reports_a_looped_bin_list_instead_of_hanging() {
    // Two free chunks of one size, kept apart by blocks in use: one bin, two entries.
    let mut b = engine(Config::device(1 << 30));
    let blocks: Vec<usize> = (0..4).map(|_| alloc(&mut b, 256, 1)).collect();
    free(&mut b, blocks[0]);
    free(&mut b, blocks[2]);
    let bin = bins::bin_for(1);
    let head = b.bins.head(bin).unwrap();
    let second = b.table.get(head).free_next.unwrap();
    assert_eq!(b.table.get(second).free_next, None);

    // The head links to itself: the second chunk is no longer reachable from its bin.
    b.table.get_mut(head).free_next = Some(head);
    assert_eq!(broken(&b), "free chunk not in the bin of its size");
    // A cycle through both: every chunk is linked from its predecessor, and the walk of the bin
    // stops where it comes back to the head (whose back link names no predecessor).
    b.table.get_mut(head).free_next = Some(second);
    b.table.get_mut(second).free_next = Some(head);
    assert_eq!(broken(&b), "bin back link broken");
    b.table.get_mut(second).free_next = None;
    checked(&b);
}

#[test]
fn checker_finds_a_free_chunk_hidden_behind_a_recycled_record() {
    // Two free 256 B chunks in one bin (blocks 0 and 2), and two recycled records (blocks 4..6
    // merged). A recycled record dressed up as the bin's second entry, and another one standing
    // in for the real second entry's predecessor, keep every link and count consistent: only the
    // recycled record's size gives it away.
    let mut b = engine(Config::device(1 << 30));
    let blocks: Vec<usize> = (0..8).map(|_| alloc(&mut b, 256, 1)).collect();
    for i in [0, 2, 5, 6, 4] {
        free(&mut b, blocks[i]);
    }
    let head = b.bins.head(bins::bin_for(1)).unwrap();
    let second = b.table.get(head).free_next.unwrap();
    let slots: Vec<ChunkHandle> = b.table.free_slots().collect();
    assert_eq!(slots.len(), 2);
    let (s2, s) = (slots[0], slots[1]);
    assert_eq!(b.table.get(s2).free_next, Some(s));
    b.table.get_mut(head).free_next = Some(s);
    {
        let fake = b.table.get_mut(s);
        fake.set_size(256);
        fake.free_prev = Some(head);
        fake.free_next = None;
    }
    b.table.get_mut(s2).free_next = Some(second);
    b.table.get_mut(second).free_prev = Some(s2);
    assert_eq!(broken(&b), "recycled chunk record not empty");
}

#[test]
fn checker_reports_out_of_range_handles_in_every_list() {
    let far = ChunkHandle::from_index(1 << 20);
    // A quick list's link (host settings keep freed small chunks there).
    let mut b = engine(Config::host(1 << 30));
    let p = alloc(&mut b, 100, 16);
    let _keep = alloc(&mut b, 100, 16);
    free(&mut b, p);
    assert_eq!(b.stats().num_cached_chunks, 1);
    let h = b.quick_heads.iter().flatten().next().copied().unwrap();
    b.table.get_mut(h).free_next = Some(far);
    assert_eq!(broken(&b), "chunk handle out of range");
    // (A corrupted engine is forgotten, not dropped: its drop would walk the broken lists.)
    std::mem::forget(b);
    // The recycled-record list's link.
    let mut b = engine(Config::device(1 << 30));
    let blocks: Vec<usize> = (0..3).map(|_| alloc(&mut b, 256, 1)).collect();
    free(&mut b, blocks[0]);
    free(&mut b, blocks[1]);
    let slot = b.table.free_slots().next().unwrap();
    b.table.get_mut(slot).free_next = Some(far);
    assert_eq!(broken(&b), "chunk handle out of range");
    std::mem::forget(b);
    // A bin's link.
    let mut b = engine(Config::device(1 << 30));
    let blocks: Vec<usize> = (0..4).map(|_| alloc(&mut b, 256, 1)).collect();
    free(&mut b, blocks[0]);
    free(&mut b, blocks[2]);
    let head = b.bins.head(bins::bin_for(1)).unwrap();
    let second = b.table.get(head).free_next.unwrap();
    b.table.get_mut(second).free_next = Some(far);
    assert_eq!(broken(&b), "chunk handle out of range");
    std::mem::forget(b);
}

#[test]
fn checker_reports_chunks_and_maps_past_their_region_instead_of_reading_past_them() {
    let mut b = engine(Config::device(1 << 30));
    let p = alloc(&mut b, 256, 1);
    let h = b.lookup_in_use(p).unwrap();
    let size = b.table.get(h).size();
    let region = b.regions[0].size;
    for bad in [size + 4 * region, usize::MAX & !255] {
        b.table.get_mut(h).set_size(bad);
        assert_eq!(broken(&b), "chunk runs past its region");
    }
    b.table.get_mut(h).set_size(size);
    checked(&b);
    let used = b.regions[0].map_used;
    b.regions[0].map_used = b.regions[0].map_len + 1;
    assert_eq!(broken(&b), "region's pointer map shorter than the region");
    b.regions[0].map_used = used;
    checked(&b);
}

#[test]
fn an_all_zero_record_is_the_empty_record() {
    // Zero-filled memory backs chunk tables without initialisation (the host's mapping, the device
    // pool's zeroed allocation): that relies on this.
    // SAFETY: every field of `Chunk` is an integer or an `Option` of a non-zero integer, for which
    // all-zero bytes are valid (0 and `None`).
    let zero: Chunk = unsafe { core::mem::zeroed() };
    assert_eq!(std::format!("{zero:?}"), std::format!("{:?}", Chunk::EMPTY));
}

/// Each line of the counters' `Display` shows its own field: every field gets a distinct value.
#[test]
fn stats_display_names_each_field_with_its_value() {
    use std::string::ToString;
    let stats = Stats {
        num_allocs: 101,
        bytes_in_use: 1000,
        peak_bytes_in_use: 1002,
        largest_alloc_size: 1003,
        bytes_limit: 1004,
        bytes_reserved: 1005,
        peak_bytes_reserved: 1006,
        largest_free_block: 2,
        num_chunks_in_use: 7,
        num_free_chunks: 8,
        num_cached_chunks: 9,
        bytes_cached: 1010,
        num_regions: 11,
        metadata_bytes: 50,
    };
    let text = stats.to_string();
    let line = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("no {name} in {text}"))
            .split_whitespace()
            .nth(1)
            .unwrap()
            .to_string()
    };
    for (name, value) in [
        ("num_allocs:", 101),
        ("bytes_in_use:", 1000),
        ("peak_bytes_in_use:", 1002),
        ("largest_alloc_size:", 1003),
        ("bytes_limit:", 1004),
        ("bytes_reserved:", 1005),
        ("peak_bytes_reserved:", 1006),
        ("largest_free_block:", 2),
        ("regions:", 11),
        ("metadata_bytes:", 50),
    ] {
        assert_eq!(line(name), value.to_string(), "{name} in {text}");
    }
    // 1 - 2 / (1005 - 1000) free bytes.
    assert_eq!(line("fragmentation:"), "0.6000", "{text}");
    assert!(
        text.contains("chunks in use/free/cached: 7/8/9 (1010 B cached)"),
        "{text}"
    );
    assert!(text.ends_with("(5.00% of in use)"), "{text}");
}

#[test]
fn reports_format_any_values_without_panicking() {
    use std::string::ToString;
    // A fresh engine: nothing in use, so no percentage of it.
    let b = engine(Config::device(1 << 30));
    let text = b.stats().to_string();
    assert!(text.ends_with("(nothing in use)"), "{text}");
    // Hand-built values a real engine never makes: in use above reserved, chunks in the top size
    // groups with a large granule. Formatting saturates instead of overflowing.
    let stats = Stats {
        bytes_in_use: 10,
        bytes_reserved: 5,
        ..Stats::default()
    };
    assert_eq!(stats.bytes_free(), 0);
    assert!(stats.to_string().contains("% of in use"));
    let mut free_by_size = [BinSummary::default(); bins::NUM_GROUPS];
    for g in [52, bins::NUM_GROUPS - 1] {
        free_by_size[g] = BinSummary { count: 1, bytes: 1 };
    }
    let report = OomReport {
        requested: usize::MAX,
        needed: usize::MAX,
        stats,
        cause: OomCause::LimitReached,
        granule: 256,
        free_by_size,
    };
    let text = report.to_string();
    assert!(
        text.contains(&std::format!("..{}) B: 1 chunks", usize::MAX)),
        "{text}"
    );
    // A check error about no chunk names no address.
    let e = CheckError {
        what: "x",
        at: None,
    };
    assert_eq!(e.to_string(), "heap invariant broken: x");
    let e = CheckError {
        what: "x",
        at: Some(0x40),
    };
    assert_eq!(e.to_string(), "heap invariant broken at 0x40: x");
    // A chunk at address 0 (a region there) is named.
    let e = CheckError {
        what: "x",
        at: Some(0),
    };
    assert_eq!(e.to_string(), "heap invariant broken at 0x0: x");
}

#[test]
fn a_granule_above_the_region_alignment_is_refused() {
    // Regions are aligned to at most 2 MiB; a larger granule used to pass `validate` and then
    // panic on the first allocation.
    let mut cfg = Config::device(1 << 30);
    cfg.granule = 4 << 20;
    assert_eq!(
        cfg.validate(),
        Err("granule must be a power of two from 8 to 2 MiB")
    );
    assert!(Bfc::new(cfg, SimSource::new(BASE, 1 << 36), vec![Chunk::EMPTY; 16]).is_err());
    cfg.granule = 2 << 20;
    let mut b = engine(cfg);
    let p = alloc(&mut b, 100, 8);
    assert_eq!(b.usable_size(p), Ok(2 << 20));
}

#[test]
#[should_panic(expected = "wraps around the address space")]
fn a_simulated_source_that_would_wrap_is_refused() {
    let _ = SimSource::new(usize::MAX - 4095, 1 << 20);
}

#[test]
fn near_isize_max_requests_fail() {
    let mut b = engine(Config::host(1 << 30));
    let r = b.allocate(isize::MAX as usize - 4096, 8);
    assert!(matches!(r, Err(AllocError::OutOfMemory(_))), "{r:?}");
}

#[test]
fn quick_lists_reuse_exact_sizes_and_stay_bounded() {
    let mut cfg = Config::host(1 << 30);
    cfg.quick_depth = 4;
    let mut b = engine(cfg);
    let ps: Vec<usize> = (0..10).map(|_| alloc(&mut b, 48, 8)).collect();
    for &p in &ps {
        free(&mut b, p);
    }
    let s = b.stats();
    assert_eq!(s.num_cached_chunks, 4, "depth bounds the list");
    assert_eq!(s.bytes_cached, 4 * 48);
    assert_eq!(s.bytes_in_use, 0);
    // LIFO reuse of the last cached block.
    assert_eq!(alloc(&mut b, 40, 8), ps[3]);
    // Larger than quick_max_size: coalesced at once.
    let big = alloc(&mut b, 2048, 8);
    free(&mut b, big);
    assert_eq!(b.stats().num_cached_chunks, 3);
    // A double free of a cached block is detected.
    assert_eq!(
        b.deallocate(ps[2]),
        Err(FreeError::DoubleFree { ptr: ps[2] })
    );
    assert_eq!(
        b.resize_in_place(ps[2], 8),
        Err(FreeError::DoubleFree { ptr: ps[2] })
    );
    // Growth flushes quick lists first: fill a small no-growth engine with cached blocks.
    let mut cfg = Config::host(64 << 10);
    cfg.allow_growth = false;
    cfg.quick_depth = 1000;
    let mut b = engine(cfg);
    let ps: Vec<usize> = (0..64).map(|_| alloc(&mut b, 1024, 8)).collect();
    for p in ps {
        free(&mut b, p);
    }
    assert_eq!(b.stats().bytes_cached, 64 << 10);
    let all = alloc(&mut b, 64 << 10, 8);
    assert_eq!(b.stats().bytes_cached, 0);
    free(&mut b, all);
}

#[test]
fn aging_sweeps_return_only_chunks_that_stayed_free() {
    let mut b = engine(Config::device(1 << 30));
    let mb = 1 << 20;
    let keep = [
        alloc(&mut b, mb, 1),
        alloc(&mut b, mb, 1),
        alloc(&mut b, mb, 1),
    ];
    let (x, y) = (alloc(&mut b, mb, 1), alloc(&mut b, mb, 1));
    let _guard = alloc(&mut b, mb, 1);
    free(&mut b, keep[0]); // free, separated from x by keep[1]
    free(&mut b, x);
    let swept = |b: &mut Sim, aging: bool| swept(b, mb, aging);
    // First aging sweep: only marks (the free top chunk too).
    assert!(swept(&mut b, true).is_empty());
    // `keep[0]` stays free; `x`'s chunk is allocated again and freed: it changed.
    let x2 = alloc(&mut b, mb, 1);
    assert_eq!(x2, x);
    free(&mut b, x2);
    let second = swept(&mut b, true);
    assert!(second.contains(&(keep[0], mb)), "{second:?}");
    assert!(!second.iter().any(|&(p, _)| p == x), "{second:?}");
    // `x` is returned by the next aging sweep, or at once without aging; nothing is returned twice.
    free(&mut b, y);
    let third = swept(&mut b, false);
    assert!(
        third.iter().any(|&(p, s)| p == x && s == 2 * mb),
        "{third:?}"
    );
    assert!(!third.iter().any(|&(p, _)| p == keep[0]), "{third:?}");
    assert!(swept(&mut b, false).is_empty());
}

#[test]
fn an_exactly_fitting_aligned_hole_is_reused() {
    let mut b = engine(Config::device(1 << 30));
    let span = 64 << 10;
    let blocks: Vec<usize> = (0..4).map(|_| alloc(&mut b, span, span)).collect();
    let _guard = alloc(&mut b, 1000, 1);
    free(&mut b, blocks[1]); // a 64 KiB hole at a 64 KiB boundary, between live blocks
    let again = alloc(&mut b, span, span);
    assert_eq!(
        again, blocks[1],
        "the aligned hole fits the aligned request exactly"
    );
    // A hole that is big enough but not aligned right is not taken for the aligned request.
    free(&mut b, again);
    let small = alloc(&mut b, 256, 1);
    assert_eq!(small, blocks[1]);
    let aligned = alloc(&mut b, span, span);
    assert_ne!(aligned, blocks[1] + 256);
    assert_eq!(aligned % span, 0);
}

// ---- Tests written to kill surviving mutants (a mutation-testing pass over this module) ----

/// `config` without quick lists, so frees go straight to the bins.
fn without_quick_lists(mut config: Config) -> Config {
    config.quick_max_size = 0;
    config
}

#[test]
fn a_block_of_the_largest_quick_size_is_reused_from_its_quick_list() {
    let mut b = engine(Config::host(1 << 30));
    let largest = b.config().quick_max_size;
    let p = alloc(&mut b, largest, 16);
    let _guard = alloc(&mut b, 16, 16);
    free(&mut b, p);
    assert_eq!(b.stats().num_cached_chunks, 1);
    assert_eq!(alloc(&mut b, largest, 16), p);
    assert_eq!(
        b.stats().num_cached_chunks,
        0,
        "taken from the bins instead"
    );
}

#[test]
fn the_best_fit_within_a_bin_is_taken() {
    // Holes of 65 and 67 granules share a bin; 64 granules fit both, best in the smaller.
    let mut b = engine(without_quick_lists(Config::host(1 << 30)));
    let small = alloc(&mut b, 65 * 16, 16);
    let _g1 = alloc(&mut b, 16, 16);
    let large = alloc(&mut b, 67 * 16, 16);
    let _g2 = alloc(&mut b, 16, 16);
    free(&mut b, large);
    free(&mut b, small);
    assert_eq!(alloc(&mut b, 64 * 16, 16), small);
}

#[test]
fn the_fit_scan_goes_on_until_a_chunk_fits() {
    // Eight 64-granule holes ahead of a 67-granule one in the same bin: none of the first eight
    // fits 66 granules, so the scan must not stop at its limit before finding one.
    let mut b = engine(without_quick_lists(Config::host(1 << 30)));
    let big = alloc(&mut b, 67 * 16, 16);
    let _g = alloc(&mut b, 16, 16);
    let smalls: Vec<usize> = (0..8)
        .map(|_| {
            let s = alloc(&mut b, 64 * 16, 16);
            alloc(&mut b, 16, 16);
            s
        })
        .collect();
    free(&mut b, big);
    for s in smalls {
        free(&mut b, s);
    }
    assert_eq!(alloc(&mut b, 66 * 16, 16), big);
}

#[test]
fn an_aligned_block_fits_a_hole_in_the_highest_searched_bin() {
    let mut b = engine(Config::device(1 << 30));
    let hole = alloc(&mut b, 500 * 256, 1 << 16);
    let _g = alloc(&mut b, 256, 1);
    free(&mut b, hole);
    assert_eq!(alloc(&mut b, 1 << 16, 1 << 16), hole);
}

/// 1 MiB blocks `a`, `x` and a guard: `a` is freed, a sweep (`aging` or not) runs, then `x` is
/// freed next to `a`. Returns the engine and `a`.
fn neighbour_freed_after_a_sweep(aging: bool) -> (Sim, usize) {
    let mut b = engine(Config::device(1 << 30));
    let mb = 1 << 20;
    let (a, x, _g) = (
        alloc(&mut b, mb, 1),
        alloc(&mut b, mb, 1),
        alloc(&mut b, mb, 1),
    );
    free(&mut b, a);
    swept(&mut b, 0, aging);
    free(&mut b, x);
    (b, a)
}

#[test]
fn a_chunk_merged_with_a_swept_neighbour_is_swept_again() {
    // `a` was swept (clean); `x`, freed next to it, is dirty, so the merged chunk is dirty.
    let (mut b, a) = neighbour_freed_after_a_sweep(false);
    let v = swept(&mut b, 0, false);
    assert!(v.contains(&(a, 2 << 20)), "{v:?}");
}

#[test]
fn a_chunk_merged_with_a_fresh_free_is_not_aged() {
    // With aging, a chunk goes back only if it stayed free since the previous sweep: `x` did not.
    let (mut b, a) = neighbour_freed_after_a_sweep(true);
    let v = swept(&mut b, 0, true);
    assert!(!v.iter().any(|&(p, _)| p == a), "{v:?}");
}

#[test]
fn a_chunk_whose_return_was_refused_is_offered_again() {
    for aging in [false, true] {
        let mut b = engine(Config::device(1 << 30));
        let mb = 1 << 20;
        let (a, _g, x, _h) = (
            alloc(&mut b, mb, 1),
            alloc(&mut b, mb, 1),
            alloc(&mut b, mb, 1),
            alloc(&mut b, mb, 1),
        );
        free(&mut b, a);
        free(&mut b, x);
        if aging {
            // The first aging sweep only marks them.
            assert_eq!(swept(&mut b, 0, true), []);
        }
        // The owner takes `x`'s pages and refuses `a`'s.
        let mut offered = Vec::new();
        b.sweep_dirty(0, aging, |p, _| {
            offered.push(p);
            p != a
        });
        checked(&b);
        offered.sort_unstable();
        assert_eq!(offered, [a, x], "aging {aging}");
        // Only `a` is dirty still.
        assert_eq!(swept(&mut b, 0, aging), [(a, mb)], "aging {aging}");
        assert_eq!(swept(&mut b, 0, aging), [], "aging {aging}");
    }
}

#[test]
fn the_rest_of_a_clean_successor_a_block_grew_into_stays_clean() {
    let mut b = engine(Config::device(1 << 30));
    let mb = 1 << 20;
    // One region, so that the blocks are neighbours.
    let r = alloc(&mut b, 16 * mb, 1);
    free(&mut b, r);
    let (a, x, g) = (
        alloc(&mut b, mb, 1),
        alloc(&mut b, 4 * mb, 1),
        alloc(&mut b, mb, 1),
    );
    assert_eq!((x, g), (a + mb, a + 5 * mb));
    free(&mut b, x);
    let v = swept(&mut b, 0, false);
    assert!(v.contains(&(x, 4 * mb)), "{v:?}");
    // `a` takes the first megabyte of `x`; the free rest was returned already.
    assert_eq!(
        b.resize_in_place(a, 2 * mb),
        Ok(Resize::Done {
            size: 2 * mb,
            freed: None
        })
    );
    checked(&b);
    assert!(swept(&mut b, 0, false).is_empty());
}

/// A dirty free chunk of 1.5 MiB at the returned address, followed by a live guard block.
fn dirty_free_chunk(b: &mut Sim) -> usize {
    let a = alloc(b, 1536 << 10, 1);
    let _guard = alloc(b, 256 << 10, 1);
    free(b, a);
    a
}

#[test]
fn the_tail_split_off_a_free_chunk_keeps_its_sweep_state() {
    // Dirty (never swept) and aged (free at the previous aging sweep): the tail left after
    // 512 KiB are taken from the chunk is still given back by the next sweep of the same kind.
    for aging in [false, true] {
        let mut b = engine(Config::device(1 << 30));
        let a = dirty_free_chunk(&mut b);
        if aging {
            swept(&mut b, 0, true);
        }
        assert_eq!(alloc(&mut b, 512 << 10, 1), a);
        let v = swept(&mut b, 0, aging);
        assert!(
            v.iter().any(|&(p, _)| p == a + (512 << 10)),
            "aging {aging}: {v:?}"
        );
    }
}

#[test]
fn releasing_free_regions_flushes_the_quick_lists_first() {
    let mut b = engine(Config::host(1 << 20));
    let p = alloc(&mut b, 100, 16);
    free(&mut b, p);
    assert_eq!(b.stats().num_cached_chunks, 1);
    assert_eq!(b.release_free_regions(), 1 << 20);
    checked(&b);
}

#[test]
fn growing_for_a_large_request_does_not_double_again() {
    let mut config = Config::device(1 << 30);
    config.initial_region_size = 1 << 20;
    let mut b = engine(config);
    alloc(&mut b, 3 << 20, 1);
    alloc(&mut b, 3 << 20, 1);
    assert_eq!(b.source().requests, vec![4 << 20, 4 << 20]);
}

#[test]
fn a_request_of_exactly_the_limit_fits() {
    let mut b = engine(Config::host(64 << 10));
    alloc(&mut b, 64 << 10, 16);
}

/// A 64 KiB engine with exactly two free holes, of `first` and `second` bytes (freed in that
/// order), the rest in use.
fn two_holes(first: usize, second: usize) -> Sim {
    let mut b = engine(without_quick_lists(Config::host(64 << 10)));
    let a = alloc(&mut b, first, 16);
    let _g = alloc(&mut b, 16, 16);
    let c = alloc(&mut b, second, 16);
    let _rest = alloc(&mut b, (64 << 10) - first - 16 - second, 16);
    free(&mut b, a);
    free(&mut b, c);
    b
}

#[test]
fn the_largest_free_block_is_the_largest_of_its_bin_and_group() {
    // Same bin, the larger freed last (head of the list).
    assert_eq!(
        two_holes(65 * 16, 67 * 16).stats().largest_free_block,
        67 * 16
    );
    // Different bins of one group, the larger in the higher bin.
    assert_eq!(
        two_holes(100 * 16, 65 * 16).stats().largest_free_block,
        100 * 16
    );
}

#[test]
fn cached_chunks_are_not_counted_as_free_chunks() {
    let mut b = engine(Config::host(1 << 30));
    let p = alloc(&mut b, 48, 16);
    let _q = alloc(&mut b, 48, 16);
    free(&mut b, p);
    let s = b.stats();
    assert_eq!(
        (s.num_cached_chunks, s.num_free_chunks),
        (1, 1),
        "the region's tail is free"
    );
}

#[test]
fn the_checker_sees_two_adjacent_free_chunks() {
    let mut b = engine(without_quick_lists(Config::host(1 << 30)));
    let p = alloc(&mut b, 64, 16);
    let q = alloc(&mut b, 64, 16);
    let _g = alloc(&mut b, 64, 16);
    free(&mut b, p);
    // Free `q` behind the engine's back, without coalescing it with `p`.
    let h = b.lookup_in_use(q).unwrap();
    b.table.get_mut(h).set_in_use(false);
    b.bins.insert(&mut b.table, h, 4);
    b.stats.bytes_in_use -= 64;
    b.in_use_chunks -= 1;
    assert_eq!(broken(&b), "two adjacent free chunks");
}

#[test]
fn the_checker_sees_reserved_bytes_above_their_peak() {
    let mut b = engine(Config::host(1 << 30));
    alloc(&mut b, 64, 16);
    b.stats.peak_bytes_reserved -= 16;
    assert_eq!(broken(&b), "a peak or the limit is below the current value");
}

#[test]
fn the_checker_sees_a_chunk_in_another_sizes_quick_list() {
    let mut b = engine(Config::host(1 << 30));
    let p = alloc(&mut b, 48, 16);
    let _g = alloc(&mut b, 48, 16);
    free(&mut b, p);
    b.quick_heads[4] = b.quick_heads[3].take();
    b.quick_len[4] = 1;
    b.quick_len[3] = 0;
    assert_eq!(broken(&b), "quick list holds a wrong chunk or is too long");
}

/// A bounded allocation takes a chunk only if the block ends at or below the bound: the quick
/// lists, the best fit, the aligned fit and an unsplit rest all count. A refusal changes nothing,
/// and a higher bound then gives the block the unbounded call would have given.
#[test]
fn a_bounded_allocation_never_ends_past_its_bound() {
    let mut cfg = Config::host(1 << 30);
    cfg.quick_depth = 4;
    // A rest under 64 bytes is not split off (the host's 16 splits every rest).
    cfg.max_internal_fragmentation = 64;
    let mut b = engine(cfg);
    let beyond =
        |r: Result<Allocated, AllocError>| matches!(r, Err(AllocError::BeyondBound { .. }));
    // The first block comes from the one free chunk, at the region's start.
    let a = alloc(&mut b, 4096, 16);
    assert_eq!(a, BASE);
    let before = b.stats();
    assert!(beyond(b.allocate_block_below(100, 16, BASE + 4096 + 99)));
    assert!(beyond(b.allocate_block_below(100, 8192, BASE + 8192 + 99)));
    // A refusal says where the block would have ended.
    assert!(matches!(
        b.allocate_block_below(100, 8192, BASE + 8192 + 99),
        Err(AllocError::BeyondBound { end, .. }) if end == BASE + 8192 + 112
    ));
    checked(&b);
    assert_eq!(b.stats(), before, "a refusal changed the engine");
    let got = b
        .allocate_block_below(100, 8192, BASE + 8192 + 112)
        .unwrap();
    assert_eq!((got.ptr, got.size), (BASE + 8192, 112));
    checked(&b);
    // A free chunk below the bound is taken while the top is out of reach.
    let c = alloc(&mut b, 2000, 16);
    let d = alloc(&mut b, 64, 16);
    free(&mut b, c);
    let got = b.allocate_block_below(1500, 16, BASE + 8192 + 112).unwrap();
    assert_eq!(got.ptr, c, "the hole below the bound");
    checked(&b);
    // A cached (quick-list) chunk past the bound is left alone, one within it is used.
    let _ = d;
    let mut b = engine(cfg);
    let d = alloc(&mut b, 64, 16);
    let _g = alloc(&mut b, 64, 16);
    free(&mut b, d);
    assert_eq!(b.stats().num_cached_chunks, 1);
    assert!(beyond(b.allocate_block_below(64, 16, d + 63)));
    assert_eq!(b.stats().num_cached_chunks, 1);
    assert_eq!(b.allocate_block_below(64, 16, d + 64).unwrap().ptr, d);
    checked(&b);
    // A rest not worth splitting off stays with the block, and counts against the bound.
    let e = alloc(&mut b, 1040, 16);
    let _f = alloc(&mut b, 2000, 16);
    free(&mut b, e);
    assert!(beyond(b.allocate_block_below(1024, 16, e + 1024)));
    let got = b.allocate_block_below(1024, 16, e + 1040).unwrap();
    assert_eq!((got.ptr, got.size), (e, 1040));
    checked(&b);
}

/// `grown_end` says where an in-place grow would end, and `None` where it would not grow in place.
#[test]
fn grown_end_matches_resize_in_place() {
    let mut b = engine(Config::host(1 << 30));
    let a = alloc(&mut b, 4096, 16);
    let c = alloc(&mut b, 4096, 16);
    // `a`'s successor is in use; a shrink does not grow.
    assert_eq!(b.grown_end(a, 8192), None);
    assert_eq!(b.grown_end(a, 100), None);
    assert_eq!(b.grown_end(a + 16, 8192), None);
    // `c` is followed by the free rest of the region.
    assert_eq!(b.grown_end(c, 10_000), Some(c + 10_000));
    match b.resize_in_place(c, 10_000).unwrap() {
        Resize::Done { size, .. } => assert_eq!(c + size, c + 10_000),
        Resize::Moved => panic!("moved"),
    }
    checked(&b);
}

#[test]
fn a_fitting_chunk_deep_in_its_class_is_found_before_out_of_memory() {
    // 512 and 528 bytes share a class. 65 freed 512-byte chunks lie ahead of a freed 528-byte one
    // in its list (last freed first), and nothing else is free: a 528-byte request must find it.
    let mut b = engine(without_quick_lists(Config::host(1 << 20)));
    let target = alloc(&mut b, 528, 16);
    alloc(&mut b, 16, 16);
    let holes: Vec<usize> = (0..65)
        .map(|_| {
            let h = alloc(&mut b, 512, 16);
            alloc(&mut b, 16, 16);
            h
        })
        .collect();
    while b.allocate_block(4096, 16).is_ok() {}
    while b.allocate_block(16, 16).is_ok() {}
    checked(&b);
    free(&mut b, target);
    for h in holes {
        free(&mut b, h);
    }
    assert_eq!(alloc(&mut b, 528, 16), target);
    // The same for an aligned request (a 64-byte boundary: the 528-byte chunk starts on one).
    free(&mut b, target);
    assert_eq!(target % 64, 0);
    assert_eq!(alloc(&mut b, 528, 64), target);
}

#[test]
fn free_chunks_near_the_end_of_the_address_space_do_not_overflow_an_aligned_search() {
    // A region that ends 4 KiB below the top of the address space: no chunk in it can hold a
    // block at the largest alignment, and looking for one must not overflow.
    let base = 0usize.wrapping_sub(1 << 30);
    let mut b = Bfc::new(
        Config::host(1 << 29),
        SimSource::new(base, (1 << 30) - 4096),
        vec![Chunk::EMPTY; 4096],
    )
    .unwrap();
    alloc(&mut b, 16, 16);
    assert!(matches!(
        b.allocate_block(16, MAX_ALIGN),
        Err(AllocError::OutOfMemory(_))
    ));
    checked(&b);
}

// ---- Tests written to kill surviving mutants (a second mutation-testing pass) ----

#[test]
fn fit_scan_stops_at_the_first_fitting_chunk_once_it_has_looked_far_enough() {
    // Device settings: 256-byte granule, no split below 2x. 65 and 67 granules share the class of
    // a 64-granule request. With `fit_scan` 1 the head of the class (the last freed, 67 granules)
    // is taken although a tighter fit lies behind it.
    let mut config = Config::device(1 << 30);
    config.fit_scan = 1;
    let mut b = engine(config);
    let g = 256;
    let tight = alloc(&mut b, 65 * g, 1);
    alloc(&mut b, g, 1);
    let loose = alloc(&mut b, 67 * g, 1);
    alloc(&mut b, g, 1);
    free(&mut b, tight);
    free(&mut b, loose);
    assert_eq!(alloc(&mut b, 64 * g, 1), loose);
    assert_eq!(b.usable_size(loose), Ok(67 * g));
    // With the default `fit_scan` the tighter one is found.
    let mut b = engine(Config::device(1 << 30));
    let tight = alloc(&mut b, 65 * g, 1);
    alloc(&mut b, g, 1);
    let loose = alloc(&mut b, 67 * g, 1);
    alloc(&mut b, g, 1);
    free(&mut b, tight);
    free(&mut b, loose);
    assert_eq!(alloc(&mut b, 64 * g, 1), tight);
}

/// Frees two holes of `hole` granules of 256 bytes, the lower one first, then asks for `want`
/// granules: returns the two holes and the address the request got.
fn two_holes_then(hole: usize, want: usize) -> (usize, usize, usize) {
    let mut b = engine(Config::device(1 << 30));
    let g = 256;
    let low = alloc(&mut b, hole * g, 1);
    alloc(&mut b, g, 1);
    let high = alloc(&mut b, hole * g, 1);
    alloc(&mut b, g, 1);
    free(&mut b, low);
    free(&mut b, high);
    (low, high, alloc(&mut b, want * g, 1))
}

#[test]
fn equally_good_fits_go_to_the_lowest_address() {
    // Two 66-granule holes in the class of a 64-granule request; the higher one, freed last, heads
    // the list. The documented tie-break is the lowest address.
    let (low, _, got) = two_holes_then(66, 64);
    assert_eq!(got, low);
}

#[test]
fn an_exact_fit_is_taken_as_soon_as_it_is_met() {
    // Two holes of exactly the request's size: the scan stops at the first it meets, the one freed
    // last (a class's list is last freed first), not the lowest.
    let (_, high, got) = two_holes_then(64, 64);
    assert_eq!(got, high);
}

#[test]
fn for_each_free_chunk_includes_chunks_of_exactly_the_minimum_size() {
    let mut b = engine(without_quick_lists(Config::host(1 << 20)));
    let p = alloc(&mut b, 256, 16);
    alloc(&mut b, 16, 16);
    let q = alloc(&mut b, 128, 16);
    alloc(&mut b, 16, 16);
    free(&mut b, p);
    free(&mut b, q);
    let mut seen = Vec::new();
    b.for_each_free_chunk(256, |ptr, size| seen.push((ptr, size)));
    assert!(seen.contains(&(p, 256)), "{seen:?}");
    assert!(!seen.iter().any(|&(ptr, _)| ptr == q), "{seen:?}");
}

#[test]
fn the_checker_sees_a_chunk_in_another_sizes_bin() {
    let mut b = engine(without_quick_lists(Config::host(1 << 30)));
    let y = alloc(&mut b, 64, 16);
    alloc(&mut b, 16, 16);
    let x = alloc(&mut b, 128, 16);
    alloc(&mut b, 16, 16);
    let (hy, hx) = (b.lookup_in_use(y).unwrap(), b.lookup_in_use(x).unwrap());
    // (Both neighbours of each are in use: the handles survive the frees.)
    free(&mut b, y);
    free(&mut b, x);
    // Move `x` (8 granules) behind `y` in the 4-granule bin, keeping every link consistent.
    b.bins.remove(&mut b.table, hx, 8);
    b.table.get_mut(hy).free_next = Some(hx);
    b.table.get_mut(hx).free_prev = Some(hy);
    assert_eq!(broken(&b), "chunk in the wrong bin");
}

#[test]
fn the_checker_sees_reserved_bytes_that_disagree_with_the_regions() {
    let mut b = engine(Config::host(1 << 30));
    alloc(&mut b, 64, 16);
    b.stats.bytes_reserved -= 16;
    assert_eq!(broken(&b), "bytes_reserved disagrees with the regions");
}

#[test]
fn the_checker_sees_a_quick_list_length_that_disagrees() {
    let mut b = engine(Config::host(1 << 30));
    let p = alloc(&mut b, 48, 16);
    let _g = alloc(&mut b, 48, 16);
    free(&mut b, p);
    b.quick_len[3] += 1;
    assert_eq!(broken(&b), "quick list length disagrees");
}

#[test]
fn the_tail_split_off_a_clean_chunk_stays_clean() {
    let mut b = engine(without_quick_lists(Config::host(1 << 20)));
    let p = alloc(&mut b, 64 << 10, 16);
    alloc(&mut b, 16, 16);
    free(&mut b, p);
    assert!(swept(&mut b, 4096, false).contains(&(p, 64 << 10)));
    assert!(swept(&mut b, 4096, false).is_empty());
    // The block comes from the front of the clean chunk; the rest stays clean.
    assert_eq!(alloc(&mut b, 4096, 16), p);
    assert_eq!(swept(&mut b, 4096, false), vec![]);
}

#[test]
fn grown_end_is_none_for_a_resize_to_the_current_size() {
    let mut b = engine(without_quick_lists(Config::host(1 << 20)));
    let p = alloc(&mut b, 256, 16);
    // The free top follows `p`.
    assert_eq!(b.grown_end(p, 256), None);
    assert_eq!(b.grown_end(p, 250), None);
    assert_eq!(b.grown_end(p, 257), Some(p + 272));
}

#[test]
fn a_zero_fit_scan_is_refused() {
    let mut config = Config::host(1 << 20);
    config.fit_scan = 0;
    assert_eq!(config.validate(), Err("fit_scan must be at least 1"));
}

#[test]
fn each_bad_config_field_is_named() {
    let base = without_quick_lists(Config::host(1 << 20));
    let refused = |change: &dyn Fn(&mut Config)| {
        let mut c = base;
        change(&mut c);
        let why = c.validate().expect_err("a bad config passed");
        assert!(Bfc::new(c, SimSource::new(BASE, 1 << 36), vec![Chunk::EMPTY; 16]).is_err());
        why
    };
    for granule in [0, 4, 24] {
        assert_eq!(
            refused(&|c| c.granule = granule),
            "granule must be a power of two from 8 to 2 MiB"
        );
    }
    for blocks in [0, 3] {
        assert_eq!(
            refused(&|c| c.map_block_granules = blocks),
            "map_block_granules must be a power of two"
        );
    }
    assert_eq!(
        refused(&|c| {
            c.granule = 1 << 20;
            c.map_block_granules = 1 << (usize::BITS - 20);
        }),
        "granule * map_block_granules overflows"
    );
    let quick = "quick_max_size above 64 granules or quick_depth above 65535";
    assert_eq!(
        refused(&|c| c.quick_max_size = (QUICK_MAX_GRANULES + 1) * c.granule),
        quick
    );
    assert_eq!(refused(&|c| c.quick_depth = 1 << 16), quick);
    // The limits themselves pass.
    let mut c = base;
    c.quick_max_size = QUICK_MAX_GRANULES * c.granule;
    c.quick_depth = u16::MAX as usize;
    c.map_block_granules = 1;
    assert_eq!(c.validate(), Ok(()));
    c.granule = 8;
    c.quick_max_size = QUICK_MAX_GRANULES * 8;
    assert_eq!(c.validate(), Ok(()));
    c.granule = 2 << 20;
    c.quick_max_size = 0;
    assert_eq!(c.validate(), Ok(()));
}

#[test]
fn an_oom_report_sums_the_free_chunks_by_size() {
    let mut b = engine(without_quick_lists(Config::host(1 << 20)));
    let p = alloc(&mut b, 4096, 16);
    alloc(&mut b, 16, 16);
    free(&mut b, p);
    let Err(AllocError::OutOfMemory(r)) = b.allocate_block(2 << 20, 16) else {
        panic!("a request above the limit fitted");
    };
    let (mut n, mut bytes) = (0, 0);
    b.for_each_free_chunk(0, |_, s| {
        n += 1;
        bytes += s;
    });
    let count: u32 = r.free_by_size.iter().map(|e| e.count).sum();
    let total: usize = r.free_by_size.iter().map(|e| e.bytes).sum();
    assert_eq!((count as usize, total), (n, bytes));
    assert!(total > 4096);
}

#[test]
fn a_limit_that_is_not_a_granule_multiple_gives_a_region_of_whole_granules() {
    let mut b = engine(Config::host((1 << 20) + 8));
    alloc(&mut b, 16, 16);
    assert_eq!(b.stats().bytes_reserved, 1 << 20);
}

/// A device engine with 1 MiB first region holding four 256 B blocks in use and, after growth, a
/// second region; returns it with the blocks.
fn two_regions() -> (Sim, Vec<usize>) {
    let mut cfg = Config::device(1 << 30);
    cfg.initial_region_size = 1 << 20;
    let mut b = engine(cfg);
    let blocks: Vec<usize> = (0..4).map(|_| alloc(&mut b, 256, 1)).collect();
    alloc(&mut b, 1 << 20, 1);
    assert_eq!(b.stats().num_regions, 2);
    (b, blocks)
}

#[test]
fn the_checker_sees_broken_regions() {
    let (mut b, _) = two_regions();
    // Unsorted (the second region starts where the first does).
    let base1 = b.regions[1].base;
    b.regions[1].base = b.regions[0].base;
    assert_eq!(broken(&b), "regions overlap or are unsorted");
    b.regions[1].base = base1;
    checked(&b);
    // A region whose end wraps around the address space.
    let size0 = b.regions[0].size;
    b.regions[0].size = usize::MAX - b.regions[0].base + 1;
    assert_eq!(broken(&b), "region wraps around the address space");
    b.regions[0].size = size0;
    checked(&b);
    // A region whose chunk list is empty.
    let first = b.regions[0].first.take();
    assert_eq!(broken(&b), "region without chunks");
    b.regions[0].first = first;
    checked(&b);
    // A region whose first chunk is not at its base.
    let second = b.table.get(first.unwrap()).next;
    b.regions[0].first = second;
    assert_eq!(broken(&b), "first chunk does not start the region");
    b.regions[0].first = first;
    checked(&b);
    // Chunks that stop short of the region's end (the last chunk of the first region, free, a
    // granule smaller: still in its bin).
    let mut last = first.unwrap();
    while let Some(n) = b.table.get(last).next {
        last = n;
    }
    let size = b.table.get(last).size();
    assert!(!b.table.get(last).in_use());
    b.table.get_mut(last).set_size(size - 256);
    assert_eq!(broken(&b), "chunk sizes do not sum to the region size");
    b.table.get_mut(last).set_size(size);
    checked(&b);
}

#[test]
fn the_checker_sees_chunks_in_the_wrong_state() {
    // An in-use chunk with a bin link.
    let (mut b, blocks) = two_regions();
    let h0 = b.lookup_in_use(blocks[0]).unwrap();
    let h1 = b.lookup_in_use(blocks[1]).unwrap();
    b.table.get_mut(h0).free_next = Some(h1);
    assert_eq!(broken(&b), "in-use chunk linked into a bin");
    b.table.get_mut(h0).free_next = None;
    checked(&b);
    // A misaligned chunk size.
    let size = b.table.get(h0).size();
    b.table.get_mut(h0).set_size(size - 16);
    assert_eq!(broken(&b), "chunk size or address not a granule multiple");
    b.table.get_mut(h0).set_size(size);
    checked(&b);

    // A cached chunk (host settings) linked into a bin, then cached-chunk counters that disagree.
    let mut b = engine(Config::host(1 << 30));
    let p = alloc(&mut b, 64, 16);
    let q = alloc(&mut b, 64, 16);
    free(&mut b, p);
    assert_eq!(b.stats().num_cached_chunks, 1);
    let hp = b.quick_heads.iter().flatten().next().copied().unwrap();
    let hq = b.lookup_in_use(q).unwrap();
    b.table.get_mut(hp).free_prev = Some(hq);
    assert_eq!(
        broken(&b),
        "cached chunk not marked unavailable, or in a bin"
    );
    b.table.get_mut(hp).free_prev = None;
    checked(&b);
    b.cached_bytes += 16;
    assert_eq!(
        broken(&b),
        "cached chunks disagree with the quick lists or the counters"
    );
    b.cached_bytes -= 16;
    checked(&b);
}

#[test]
fn the_checker_sees_a_broken_pointer_map() {
    let mut b = engine(Config::device(1 << 30));
    let p = alloc(&mut b, 256, 1);
    let big = alloc(&mut b, 64 << 10, 1);
    let _after = alloc(&mut b, 256, 1);
    let (hp, hbig) = (b.lookup_in_use(p).unwrap(), b.lookup_in_use(big).unwrap());
    let shift = b.block_shift;
    let base = b.regions[0].base;
    let map = b.regions[0].map;
    // Block 0 names the block at `big` instead of `p`.
    // SAFETY: block 0 is below `map_used` (a chunk starts there), and the map is valid.
    unsafe { *map.as_ptr() = Some(hbig) };
    assert_eq!(
        broken(&b),
        "pointer map does not name the first chunk of a block"
    );
    // SAFETY: as above.
    unsafe { *map.as_ptr() = Some(hp) };
    checked(&b);
    // A block strictly inside `big` (which spans many blocks) names it.
    let inner = ((big - base) >> shift) + 2;
    assert!((inner + 1) << shift < big - base + (64 << 10));
    assert!(inner < b.regions[0].map_used);
    // SAFETY: `inner` is below `map_used`, and the map is valid.
    unsafe { *map.as_ptr().add(inner) = Some(hbig) };
    assert_eq!(broken(&b), "pointer map names a chunk inside another chunk");
    // SAFETY: as above.
    unsafe { *map.as_ptr().add(inner) = None };
    checked(&b);
}

/// A region that ends inside a map block: that last block starts inside the region's last chunk,
/// holds no chunk start, and a stale entry there must be reported like one in any other block
/// that starts inside a chunk.
#[test]
fn the_checker_sees_a_stale_map_entry_in_a_regions_last_partial_block() {
    let mut cfg = Config::device(12 << 10);
    cfg.allow_growth = false;
    let mut b = engine(cfg);
    let p = alloc(&mut b, 256, 1);
    // One region of 12 KiB: map blocks of 8 KiB, so block 1 is half a block, and it starts
    // inside the free rest of the region ([256, 12 KiB)), the region's last chunk.
    assert_eq!(b.regions[0].size, 12 << 10);
    assert_eq!(b.regions[0].map_len, 2);
    let hp = b.lookup_in_use(p).unwrap();
    let map = b.regions[0].map;
    // SAFETY: the map holds `map_len` (2) entries and is valid; the engine is not running.
    unsafe { *map.as_ptr().add(1) = Some(hp) };
    b.regions[0].map_used = 2;
    assert_eq!(broken(&b), "pointer map names a chunk inside another chunk");
    // SAFETY: as above.
    unsafe { *map.as_ptr().add(1) = None };
    checked(&b);
}

#[test]
fn the_checker_sees_a_live_record_outside_every_region() {
    let mut b = engine(Config::device(1 << 30));
    let blocks: Vec<usize> = (0..3).map(|_| alloc(&mut b, 256, 1)).collect();
    free(&mut b, blocks[0]);
    free(&mut b, blocks[1]);
    // A record taken from the table (a recycled slot) but linked into no region.
    let mut c = Chunk::EMPTY;
    c.set_size(256);
    let h = b.table.alloc(c).unwrap();
    assert_eq!(
        broken(&b),
        "live chunk records not all reachable from regions"
    );
    b.table.get_mut(h).set_size(0);
    b.table.free(h);
    checked(&b);
}

#[test]
fn the_checker_sees_bins_that_disagree_with_the_free_chunks() {
    // One free chunk (the region's tail) after two blocks in use, and one recycled record.
    let fresh = || {
        let mut b = engine(Config::device(1 << 30));
        let p = alloc(&mut b, 256, 1);
        let q = alloc(&mut b, 256, 1);
        let r = alloc(&mut b, 256, 1);
        free(&mut b, r);
        assert_eq!(b.stats().num_free_chunks, 1);
        (b, p, q)
    };
    // An in-use chunk linked (alone) into the empty bin of its size.
    let (mut b, p, _) = fresh();
    let h = b.lookup_in_use(p).unwrap();
    b.bins.insert(&mut b.table, h, 1);
    assert_eq!(broken(&b), "in-use chunk in a bin");
    // A recycled record (the last one of the recycled list) linked into a bin.
    let (mut b, _, _) = fresh();
    let s = b.table.free_slots().last().unwrap();
    assert_eq!(b.table.get(s).free_next, None);
    b.bins.insert(&mut b.table, s, 1);
    assert_eq!(broken(&b), "recycled chunk record in a bin");
    // The only free chunk linking to itself.
    let (mut b, _, q) = fresh();
    let tail = b.table.get(b.lookup_in_use(q).unwrap()).next.unwrap();
    b.table.get_mut(tail).free_next = Some(tail);
    assert_eq!(broken(&b), "more binned chunks than free chunks (cycle?)");
    b.table.get_mut(tail).free_next = None;
    checked(&b);
    // The free chunk unlinked from its bin, with a back link to a record (recycled) whose forward
    // link names it: the O(1) test of the region walk passes, the walk of the bins does not find it.
    let g = b.table.get(tail).size() / 256;
    b.bins.remove(&mut b.table, tail, g);
    let s = b.table.free_slots().next().unwrap();
    b.table.get_mut(s).free_next = Some(tail);
    b.table.get_mut(tail).free_prev = Some(s);
    assert_eq!(broken(&b), "free chunks missing from the bins");
}

/// Builds an engine with [`Bfc::write_new`] in uninitialised memory (as the host heap does).
fn written_engine(config: Config) -> std::boxed::Box<Sim> {
    let mut slot = std::boxed::Box::<Sim>::new_uninit();
    // SAFETY: the box's memory is valid for writes of `Sim` and aligned; it holds nothing.
    unsafe {
        Bfc::write_new(
            slot.as_mut_ptr(),
            config,
            SimSource::new(BASE, 1 << 36),
            vec![Chunk::EMPTY; 4096],
        )
        .unwrap();
        // SAFETY: `write_new` returned `Ok`, so every field is written.
        slot.assume_init()
    }
}

/// `write_new` builds the engine `new` builds: the same fields, statistics, checker verdict, and
/// the same answers (addresses, sizes, source requests) to one sequence of calls, for configs with
/// and without growth and quick lists. (Under Miri, a field `write_new` skipped is a read of
/// uninitialised memory.)
#[test]
fn write_new_builds_the_engine_new_builds() {
    let mut host = Config::host(8 << 20);
    host.initial_region_size = 8 << 20;
    let mut odd = Config::device(1 << 30);
    odd.initial_region_size = (1 << 20) + 1; // rounded up to a granule
    odd.map_block_granules = 8;
    for config in [Config::device(1 << 30), host, odd] {
        let mut a = engine(config);
        let mut b = written_engine(config);
        let b = &mut *b;
        assert_eq!(a.config, b.config);
        assert_eq!(a.granule_shift, b.granule_shift);
        assert_eq!(a.block_shift, b.block_shift);
        assert_eq!(a.num_regions, b.num_regions);
        assert_eq!(a.next_region_size, b.next_region_size);
        assert_eq!(a.in_use_chunks, b.in_use_chunks);
        assert_eq!(a.quick_heads, b.quick_heads);
        assert_eq!(a.quick_len, b.quick_len);
        assert_eq!(a.quick_max_g, b.quick_max_g);
        assert_eq!(
            (a.cached_bytes, a.cached_chunks),
            (b.cached_bytes, b.cached_chunks)
        );
        assert_eq!(a.stats(), b.stats());
        assert_eq!(a.check(), b.check());
        assert_eq!(a.records_touched(), b.records_touched());
        let mut live = Vec::new();
        for (i, size) in [1usize, 300, 4096, 1 << 20, 48, 3 << 20, 1000, 64]
            .into_iter()
            .enumerate()
        {
            let align = if i % 3 == 0 { 4096 } else { 16 };
            let pa = a.allocate_block(size, align);
            let pb = b.allocate_block(size, align);
            assert_eq!(pa, pb, "allocation {i}");
            if let Ok(p) = pa {
                live.push(p.ptr);
            }
            if i % 2 == 1 {
                let p = live.remove(0);
                assert_eq!(a.deallocate(p), b.deallocate(p));
            }
            assert_eq!(a.stats(), b.stats());
            checked(&a);
            checked(b);
        }
        for p in live {
            assert_eq!(a.deallocate(p), b.deallocate(p));
        }
        assert_eq!(a.release_free_regions(), b.release_free_regions());
        assert_eq!(a.stats(), b.stats());
        assert_eq!(a.source().requests, b.source().requests);
        let key = |c: Chunk| (c.ptr(), c.size(), c.in_use());
        assert!(a.chunks().map(key).eq(b.chunks().map(key)));
    }
}

/// `write_new` with a config `new` refuses returns the same error and writes nothing.
#[test]
fn write_new_refuses_what_new_refuses_and_writes_nothing() {
    let mut bad = Config::device(1 << 30);
    bad.granule = 24;
    let new_err = Bfc::new(bad, SimSource::new(BASE, 1 << 36), vec![Chunk::EMPTY; 4])
        .err()
        .unwrap();
    let mut slot = core::mem::MaybeUninit::<Sim>::uninit();
    // SAFETY: the slot is valid for writes of its size.
    unsafe {
        slot.as_mut_ptr()
            .cast::<u8>()
            .write_bytes(0xa5, core::mem::size_of::<Sim>())
    };
    // SAFETY: the slot is valid for writes of `Sim` and aligned.
    let r = unsafe {
        Bfc::write_new(
            slot.as_mut_ptr(),
            bad,
            SimSource::new(BASE, 1 << 36),
            vec![Chunk::EMPTY; 4],
        )
    };
    assert_eq!(r, Err(new_err));
    // SAFETY: every byte was written above.
    let bytes = unsafe {
        core::slice::from_raw_parts(slot.as_ptr().cast::<u8>(), core::mem::size_of::<Sim>())
    };
    assert!(
        bytes.iter().all(|&x| x == 0xa5),
        "write_new wrote into its destination"
    );
}

/// A source that panics in a free, called from [`Bfc::release_free_regions`] on an engine that the
/// unwind then drops: the panic reaches `catch_unwind` (the drop does not call the source again,
/// which would panic during the unwind and abort the process). Run in a child process, since the
/// failure is an abort.
#[test]
#[cfg_attr(miri, ignore = "runs a child process")]
fn a_source_panic_in_release_unwinds_through_the_engines_drop() {
    const CHILD: &str = "BFC_ALLOC_TEST_RELEASE_PANIC_CHILD";
    if std::env::var_os(CHILD).is_some() {
        let mut cfg = Config::device(64 << 20);
        cfg.initial_region_size = 1 << 20;
        let r = std::panic::catch_unwind(move || {
            let source = PanickyFree {
                sim: SimSource::new(BASE, 1 << 36),
                panic_on_free: false,
            };
            let mut b = Bfc::new(cfg, source, vec![Chunk::EMPTY; 64]).unwrap();
            let x = b.allocate(1 << 20, 1).unwrap();
            let y = b.allocate(2 << 20, 1).unwrap();
            b.deallocate(x).unwrap();
            b.deallocate(y).unwrap();
            assert_eq!(b.stats().num_regions, 2);
            b.source_mut().panic_on_free = true;
            b.release_free_regions();
        });
        assert!(r.is_err(), "the source did not panic");
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "core::tests::a_source_panic_in_release_unwinds_through_the_engines_drop",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "child: {:?}\n{}",
        out.status,
        std::string::String::from_utf8_lossy(&out.stderr)
    );
}
