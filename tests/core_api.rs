//! Edge cases of the no_std engine's public API, with the simulated source.

use bfc_alloc::core::sim::SimSource;
use bfc_alloc::core::{AllocError, OomCause};
use bfc_alloc::{Bfc, Chunk, Config};

fn run(config: Config, base: usize, cap: usize, table_len: usize) {
    let mut bfc = match Bfc::new(
        config,
        SimSource::new(base, cap),
        vec![Chunk::EMPTY; table_len],
    ) {
        Ok(b) => b,
        Err(e) => {
            println!("refused: {e}");
            return;
        }
    };
    let mut live: Vec<(usize, usize)> = Vec::new();
    let mut x = 12345u64;
    for i in 0..3000usize {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let size = [
            0,
            1,
            7,
            255,
            256,
            4097,
            1 << 20,
            3 << 20,
            usize::MAX,
            usize::MAX - 10,
        ][x as usize % 10];
        let align = [0, 1, 3, 8, 256, 4096, 1 << 21, 1 << 30, 1 << 63][(x >> 8) as usize % 9];
        if std::env::var("AUDIT_TRACE").is_ok() {
            println!("alloc {size:#x} {align:#x} live {}", live.len());
        }
        if let Ok(b) = bfc.allocate_block(size, align) {
            assert!(align == 0 || b.ptr % align == 0);
            assert!(b.size >= size.max(1));
            assert!(b.ptr >= base && b.ptr - base + b.size <= cap);
            for &(p, s) in &live {
                assert!(b.ptr + b.size <= p || p + s <= b.ptr, "overlap");
            }
            live.push((b.ptr, b.size));
        }
        if i % 2 == 0 && !live.is_empty() {
            let (p, _) = live.swap_remove((x >> 20) as usize % live.len());
            bfc.deallocate(p).unwrap();
        }
        if i % 7 == 0 && !live.is_empty() {
            let k = (x >> 30) as usize % live.len();
            let ns = [0usize, 1, 100, 5000, 1 << 21, usize::MAX][(x >> 40) as usize % 6];
            if let Ok(r) = bfc.resize_in_place(live[k].0, ns) {
                let _ = r;
                live[k].1 = bfc.usable_size(live[k].0).unwrap();
            }
        }
        // Foreign pointers are refused.
        for q in [
            base.wrapping_sub(1),
            base.wrapping_add(cap),
            0usize,
            usize::MAX,
            base + 1,
        ] {
            if !live.iter().any(|&(p, _)| p == q) {
                assert!(bfc.usable_size(q).is_err());
            }
        }
    }
    bfc.check().unwrap();
    for (p, _) in live {
        bfc.deallocate(p).unwrap();
    }
    bfc.flush_quick_lists();
    bfc.release_free_regions();
    bfc.check().unwrap();
    assert_eq!(bfc.source().bytes_live(), 0);
}

#[test]
fn odd_configs_tables_and_address_ranges() {
    let configs = [
        Config::device(1 << 30),
        Config::host(1 << 30),
        Config {
            granule: 8,
            map_block_granules: 1,
            split_ratio: 0,
            max_internal_fragmentation: 0,
            fit_scan: usize::MAX,
            ..Config::host(64 << 20)
        },
        Config {
            granule: 1 << 21,
            map_block_granules: 1 << 20,
            ..Config::device(usize::MAX)
        },
        Config {
            initial_region_size: usize::MAX,
            ..Config::device(usize::MAX)
        },
        Config {
            initial_region_size: 1,
            split_ratio: 1,
            ..Config::device(1 << 30)
        },
        Config {
            allow_growth: false,
            initial_region_size: 0,
            memory_limit: 0,
            ..Config::device(0)
        },
        Config {
            allow_growth: false,
            initial_region_size: usize::MAX,
            ..Config::device(usize::MAX)
        },
        Config {
            quick_max_size: 64 * 16,
            quick_depth: 65535,
            ..Config::host(usize::MAX)
        },
    ];
    for c in configs {
        for &(base, cap) in &[
            (1usize << 40, 1usize << 32),
            (0, 1 << 30),
            (usize::MAX - (1 << 30) + 1, (1 << 30) - 1),
        ] {
            for table in [0usize, 1, 2, 3, 64, 100_000] {
                println!("{c:?} base {base:#x} table {table}");
                run(c, base, cap, table);
            }
        }
    }
}

/// A source whose range ends at the top of the address space (the `MemorySource` contract only
/// forbids regions that wrap). An aligned request for a chunk starting at the highest multiple of
/// the alignment overflowed in `align_up` (`x + align - 1` computed `x + align` first): a panic
/// with overflow checks on.
#[test]
fn aligned_request_near_top_of_address_space() {
    let base = usize::MAX - (1 << 30) + 1;
    let mut bfc = Bfc::new(
        Config::device(1 << 30),
        SimSource::new(base, (1 << 30) - 1),
        vec![Chunk::EMPTY; 64],
    )
    .unwrap();
    let a = bfc.allocate(1, 1).unwrap();
    assert_eq!(a, base);
    bfc.deallocate(a).unwrap();
    let b = bfc.allocate_block(0x100, 1 << 30).unwrap();
    assert_eq!(b.ptr, base);
    bfc.deallocate(b.ptr).unwrap();
    bfc.check().unwrap();
}

/// The map methods of a `MemorySource` that wraps a [`SimSource`] in its field `inner`.
macro_rules! forward_maps {
    () => {
        fn alloc_map(
            &mut self,
            region_base: usize,
            entries: usize,
        ) -> Option<std::ptr::NonNull<Option<bfc_alloc::ChunkHandle>>> {
            self.inner.alloc_map(region_base, entries)
        }
        unsafe fn free_map(
            &mut self,
            region_base: usize,
            map: std::ptr::NonNull<Option<bfc_alloc::ChunkHandle>>,
            entries: usize,
        ) {
            // SAFETY: forwarded contract.
            unsafe { self.inner.free_map(region_base, map, entries) }
        }
    };
}

/// A source that counts the regions it has out, through a handle the test keeps.
struct Counting {
    inner: SimSource,
    out: std::rc::Rc<std::cell::Cell<usize>>,
}

// SAFETY: forwards to `SimSource` (which keeps the promises), only counting.
unsafe impl bfc_alloc::MemorySource for Counting {
    fn alloc_region(&mut self, size: usize, align: usize) -> Option<usize> {
        let r = self.inner.alloc_region(size, align);
        if r.is_some() {
            self.out.set(self.out.get() + 1);
        }
        r
    }
    unsafe fn free_region(&mut self, base: usize, size: usize) {
        self.out.set(self.out.get() - 1);
        // SAFETY: forwarded contract.
        unsafe { self.inner.free_region(base, size) }
    }
    forward_maps!();
}

/// A device engine over a [`Counting`] source, and the source's count of regions out.
fn counted_engine() -> (
    Bfc<Counting, Vec<Chunk>>,
    std::rc::Rc<std::cell::Cell<usize>>,
) {
    let out = std::rc::Rc::new(std::cell::Cell::new(0));
    let source = Counting {
        inner: SimSource::new(1 << 40, 1 << 32),
        out: out.clone(),
    };
    let bfc = Bfc::new(Config::device(1 << 32), source, vec![Chunk::EMPTY; 64]).unwrap();
    (bfc, out)
}

/// Dropping an engine whose regions are all free gives them back to the source (as TensorFlow's
/// `BFCAllocator` destructor frees every region).
#[test]
fn dropping_an_idle_engine_returns_its_regions() {
    let (mut bfc, out) = counted_engine();
    let a = bfc.allocate(1 << 20, 256).unwrap();
    let b = bfc.allocate(8 << 20, 256).unwrap();
    bfc.deallocate(a).unwrap();
    bfc.deallocate(b).unwrap();
    assert_eq!(out.get(), 2);
    drop(bfc);
    assert_eq!(
        out.get(),
        0,
        "regions still out after the engine was dropped"
    );
}

/// A region that still holds a block in use stays out when the engine is dropped (the block's user
/// may still need it); the free one goes back.
#[test]
fn dropping_an_engine_keeps_the_regions_that_hold_blocks() {
    let (mut bfc, out) = counted_engine();
    let _kept = bfc.allocate(1 << 20, 256).unwrap();
    let b = bfc.allocate(8 << 20, 256).unwrap();
    assert_eq!(bfc.stats().num_regions, 2);
    bfc.deallocate(b).unwrap();
    drop(bfc);
    assert_eq!(out.get(), 1);
}

/// Releasing the free regions and then dropping the engine (as the device pool's drop does before
/// the engine's own) gives each region back once: the drop finds none left to give.
#[test]
fn releasing_then_dropping_gives_each_region_back_once() {
    let (mut bfc, out) = counted_engine();
    let a = bfc.allocate(1 << 20, 256).unwrap();
    let b = bfc.allocate(8 << 20, 256).unwrap();
    bfc.deallocate(a).unwrap();
    bfc.deallocate(b).unwrap();
    assert_eq!(out.get(), 2);
    assert!(bfc.release_free_regions() > 0);
    assert_eq!(out.get(), 0);
    // (A second free of a region would underflow the count, and the simulated source refuses it.)
    drop(bfc);
    assert_eq!(out.get(), 0);
}

/// A host-configured engine whose chunk table is exactly full once it holds a block of each of
/// `sizes`, each followed by a separator block that is never freed, and the rest of the region;
/// returns the engine and the blocks' addresses.
fn full_table_with_blocks(sizes: &[usize]) -> (Bfc<SimSource, Vec<Chunk>>, Vec<usize>) {
    let mut b = Bfc::new(
        Config::host(1 << 20),
        SimSource::new(1 << 40, 1 << 30),
        vec![Chunk::EMPTY; 2 * sizes.len() + 1],
    )
    .unwrap();
    let xs = sizes
        .iter()
        .map(|&size| {
            let x = b.allocate(size, 1).unwrap();
            b.allocate(1, 1).unwrap();
            x
        })
        .collect();
    (b, xs)
}

/// With the chunk table full, a request that the first fit found would have to split (a new
/// record) is served by a free chunk that fits it whole, deeper in its class's list.
#[test]
fn a_full_chunk_table_still_serves_a_request_a_free_chunk_fits_whole() {
    let g = 16; // the host granule
    let req = 128 * g;
    // The first block fits the request exactly, the other 8 are a granule larger (a tail the host
    // configuration splits off): 19 records, the whole table.
    let sizes: Vec<usize> = (0..9).map(|i| if i == 0 { req } else { req + g }).collect();
    let (mut b, xs) = full_table_with_blocks(&sizes);
    // The exact one freed first: last in its class's list (last freed first).
    for &x in &xs {
        b.deallocate(x).unwrap();
    }
    b.check().unwrap();
    assert_eq!(b.records_touched(), 19);
    let p = b.allocate(req, 1).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(p, xs[0]);
    b.check().unwrap();
    // A request only a split could serve still reports the full table.
    match b.allocate(req - g, 1) {
        Err(AllocError::OutOfMemory(r)) => assert_eq!(r.cause, OomCause::ChunkTableFull),
        r => panic!("{r:?}"),
    }
    b.check().unwrap();
}

/// With the chunk table full and a bound, the free chunk taken whole is one that ends below the
/// bound: a whole fit past it, nearer the head of the list, is passed over.
#[test]
fn a_full_chunk_table_serves_a_bounded_request_from_a_whole_fit_below_the_bound() {
    let g = 16; // the host granule
    let req = 128 * g;
    // Exact fits first and last, eight blocks a granule larger (split by the host configuration)
    // between, so that the first fit the engine looks at (`fit_scan`, 8) needs a record: 21
    // records, the whole table.
    let sizes: Vec<usize> = (0..10)
        .map(|i| if i == 0 || i == 9 { req } else { req + g })
        .collect();
    let (mut b, xs) = full_table_with_blocks(&sizes);
    // List order from the head: the larger ones, then the high exact fit, then the low one.
    b.deallocate(xs[0]).unwrap();
    b.deallocate(xs[9]).unwrap();
    for &x in &xs[1..9] {
        b.deallocate(x).unwrap();
    }
    assert_eq!(b.records_touched(), 21);
    let bound = xs[9];
    match b.allocate_block_below(req, 1, bound) {
        Ok(a) => assert_eq!((a.ptr, a.size), (xs[0], req)),
        r => panic!("{r:?}"),
    }
    b.check().unwrap();
}

/// How [`Broken`] breaks the `MemorySource` contract.
#[cfg(debug_assertions)]
#[derive(Clone, Copy)]
enum Breach {
    /// Regions a granule off the requested alignment.
    Unaligned,
    /// The first region's base again for the second.
    Overlapping,
    /// A region at the top of the address space that runs past its end.
    Wrapping,
}

/// A source that breaks its contract (the engine checks the regions it gets in debug builds).
#[cfg(debug_assertions)]
struct Broken {
    inner: SimSource,
    breach: Breach,
    first: Option<usize>,
}

// SAFETY: not kept, on purpose: the engine must catch the breach before it uses the region (the
// tests below run only in debug builds, where it does).
#[cfg(debug_assertions)]
unsafe impl bfc_alloc::MemorySource for Broken {
    fn alloc_region(&mut self, size: usize, align: usize) -> Option<usize> {
        match (self.breach, self.first) {
            (Breach::Unaligned, _) => Some(self.inner.alloc_region(size, align)? + 8),
            (Breach::Wrapping, _) => Some(usize::MAX & !(align - 1)),
            (Breach::Overlapping, Some(base)) => Some(base),
            (Breach::Overlapping, None) => {
                let base = self.inner.alloc_region(size, align)?;
                self.first = Some(base);
                Some(base)
            }
        }
    }
    unsafe fn free_region(&mut self, base: usize, size: usize) {
        // SAFETY: forwarded contract (only the first, proper region is ever freed).
        unsafe { self.inner.free_region(base, size) }
    }
    forward_maps!();
}

/// A device engine over a [`Broken`] source, with one block that fills its first region.
#[cfg(debug_assertions)]
fn broken_engine(breach: Breach) -> Bfc<Broken, Vec<Chunk>> {
    let source = Broken {
        inner: SimSource::new(1 << 40, 1 << 32),
        breach,
        first: None,
    };
    let config = Config {
        initial_region_size: 1 << 20,
        ..Config::device(1 << 32)
    };
    Bfc::new(config, source, vec![Chunk::EMPTY; 64]).unwrap()
}

#[test]
#[cfg(debug_assertions)]
#[should_panic(expected = "not aligned to")]
fn a_source_region_off_its_alignment_is_caught() {
    let mut bfc = broken_engine(Breach::Unaligned);
    let _ = bfc.allocate(1, 1);
}

#[test]
#[cfg(debug_assertions)]
#[should_panic(expected = "past the address space")]
fn a_source_region_past_the_end_of_the_address_space_is_caught() {
    let mut bfc = broken_engine(Breach::Wrapping);
    let _ = bfc.allocate(1, 1);
}

#[test]
#[cfg(debug_assertions)]
#[should_panic(expected = "overlapping a live one")]
fn a_source_region_overlapping_a_live_one_is_caught() {
    let mut bfc = broken_engine(Breach::Overlapping);
    let a = bfc.allocate(1 << 20, 1).unwrap();
    let _ = bfc.allocate(1 << 20, 1);
    let _ = a;
}

/// `for_each_free_chunk` and `sweep_dirty` pass over a free chunk below their minimum size that
/// shares the minimum's size class (99,000 and 100,000 bytes, one class with a 16-byte granule).
#[test]
fn walks_and_sweeps_skip_free_chunks_below_the_minimum_in_its_class() {
    let mut b = Bfc::new(
        Config::host(1 << 30),
        SimSource::new(1 << 40, 1 << 30),
        vec![Chunk::EMPTY; 64],
    )
    .unwrap();
    let small = b.allocate(99_000, 1).unwrap();
    b.allocate(1, 1).unwrap();
    let big = b.allocate(100_000, 1).unwrap();
    b.allocate(1, 1).unwrap();
    b.deallocate(small).unwrap();
    b.deallocate(big).unwrap();
    let check = |seen: &[(usize, usize)], what: &str| {
        assert!(seen.iter().all(|&(_, s)| s >= 100_000), "{what}: {seen:?}");
        assert!(seen.contains(&(big, 100_000)), "{what}: {seen:?}");
    };
    let mut seen = Vec::new();
    b.for_each_free_chunk(100_000, |p, s| seen.push((p, s)));
    check(&seen, "for_each_free_chunk");
    let mut swept = Vec::new();
    let n = b.sweep_dirty(100_000, false, |p, s| {
        swept.push((p, s));
        true
    });
    assert_eq!(n, swept.len());
    check(&swept, "sweep_dirty");
    b.check().unwrap();
}
