//! `GlobalBfc` as this test binary's global allocator: std collections, threads, realloc patterns,
//! huge and over-aligned blocks, memory given back to the OS, and the abort paths (in child processes).

use std::alloc::{alloc, alloc_zeroed, dealloc, realloc, GlobalAlloc, Layout};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::process::Command;
use std::sync::Mutex;

use bfc_alloc::GlobalBfc;

#[global_allocator]
static A: GlobalBfc = GlobalBfc::new();

/// Tests that measure RSS or use GiBs run one at a time.
static HEAVY: Mutex<()> = Mutex::new(());

fn heavy() -> std::sync::MutexGuard<'static, ()> {
    HEAVY.lock().unwrap_or_else(|e| e.into_inner())
}

/// A private instance whose arena is exactly `bytes` (no smaller fallback), with or without
/// thread caches.
fn fixed_arena(bytes: usize, thread_cache: bool) -> GlobalBfc {
    GlobalBfc::with_config(bfc_alloc::HostConfig {
        arena_size: bytes,
        min_arena_size: bytes,
        thread_cache,
        ..bfc_alloc::HostConfig::DEFAULT
    })
}

fn rss_bytes() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: usize = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

#[test]
fn std_collections_and_strings() {
    let mut m: HashMap<String, Vec<u64>> = HashMap::new();
    for i in 0..20_000u64 {
        m.entry(format!("key-{}", i % 5000)).or_default().push(i);
    }
    assert_eq!(m.len(), 5000);
    assert_eq!(m["key-42"], vec![42, 5042, 10042, 15042]);
    let mut t: BTreeMap<u32, String> = (0..50_000).map(|i| (i, i.to_string())).collect();
    t.retain(|k, _| k % 3 == 0);
    assert_eq!(t.len(), 16_667);
    let mut q: VecDeque<Box<[u8]>> = VecDeque::new();
    for i in 0..10_000usize {
        q.push_back(vec![i as u8; i % 300].into_boxed_slice());
        if q.len() > 100 {
            let b = q.pop_front().unwrap();
            assert!(b.iter().all(|&x| x == b.first().copied().unwrap_or(0)));
        }
    }
    let s: String = (0..1000)
        .map(|i| char::from(b'a' + (i % 26) as u8))
        .collect::<String>()
        .repeat(100);
    assert_eq!(s.len(), 100_000);
    A.check().unwrap();
}

#[test]
fn eight_threads_of_churn() {
    let handles: Vec<_> = (0..8u64)
        .map(|t| {
            std::thread::spawn(move || {
                let mut seed = 0x9e37_79b9 ^ t;
                let mut live: Vec<Vec<u64>> = Vec::new();
                for i in 0..40_000u64 {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    let n = (seed % 512) as usize + 1;
                    live.push(vec![t * 1_000_000 + i; n]);
                    if live.len() > 500 {
                        let v = live.swap_remove((seed >> 20) as usize % live.len());
                        assert!(v.iter().all(|&x| x == v[0]), "block contents changed");
                    }
                }
                for v in &live {
                    assert!(v.iter().all(|&x| x / 1_000_000 == t));
                }
                live.len()
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), 500);
    }
    A.check().unwrap();
}

#[test]
fn realloc_patterns_preserve_contents() {
    // Vec growth by push.
    let mut v: Vec<u32> = Vec::new();
    for i in 0..1_000_000u32 {
        v.push(i);
    }
    assert!(v.iter().enumerate().all(|(i, &x)| x == i as u32));
    v.truncate(10);
    v.shrink_to_fit();
    assert_eq!(v, (0..10).collect::<Vec<_>>());
    // Grow and shrink in place and by moving, with a live neighbour in between. (In an instance of
    // its own: in the global one, a test on another thread may take the tail the shrink frees
    // before the block grows back into it.)
    let local = fixed_arena(16 << 20, false);
    // SAFETY: every block is allocated with a non-zero layout, used within its size, and freed or
    // reallocated once with the layout it has.
    unsafe {
        let l = Layout::from_size_align(100, 16).unwrap();
        let p = local.alloc(l);
        for i in 0..100 {
            *p.add(i) = i as u8;
        }
        let small = Layout::from_size_align(16, 16).unwrap();
        let blocker = local.alloc(small);
        // (Engine blocks from here: above the 16 KiB slab limit.)
        let p2 = local.realloc(p, l, 40_000); // must move: the neighbour is in use
        assert!((0..100).all(|i| *p2.add(i) == i as u8));
        let p3 = local.realloc(p2, Layout::from_size_align(40_000, 16).unwrap(), 20_000);
        assert_eq!(p3, p2, "shrink stays in place");
        assert!((0..100).all(|i| *p3.add(i) == i as u8));
        let p4 = local.realloc(p3, Layout::from_size_align(20_000, 16).unwrap(), 36_000);
        assert_eq!(p4, p3, "grows in place into the tail freed by the shrink");
        assert!((0..100).all(|i| *p4.add(i) == i as u8));
        local.dealloc(p4, Layout::from_size_align(36_000, 16).unwrap());
        local.dealloc(blocker, small);
        local.check().unwrap();
    }
    // SAFETY: as above.
    unsafe {
        let l = Layout::from_size_align(36_000, 16).unwrap();
        let p4 = alloc(l);
        for i in 0..100 {
            *p4.add(i) = i as u8;
        }
        // Shrinking to a small size moves the block to the slab layer (a small block is always
        // freed with a layout of its own size class, which thread caches rely on).
        let p5 = realloc(p4, l, 50);
        assert_ne!(p5, p4);
        assert_eq!(A.usable_size(p5), Some(64));
        assert!((0..50).all(|i| *p5.add(i) == i as u8));
        // Within a size class a small block stays in place; across classes it moves.
        let p6 = realloc(p5, Layout::from_size_align(50, 16).unwrap(), 60);
        assert_eq!(p6, p5);
        let p7 = realloc(p6, Layout::from_size_align(60, 16).unwrap(), 30);
        assert_ne!(p7, p6);
        assert!((0..30).all(|i| *p7.add(i) == i as u8));
        dealloc(p7, Layout::from_size_align(30, 16).unwrap());
    }
    A.check().unwrap();
}

#[test]
fn over_aligned_blocks() {
    // SAFETY: non-zero layouts; each block is written within its size and freed once with its
    // layout.
    unsafe {
        for shift in [5u32, 12, 16, 20, 21, 24, 26, 30] {
            let align = 1usize << shift;
            let l = Layout::from_size_align(100, align).unwrap();
            let p = alloc(l);
            assert!(!p.is_null(), "align {align}");
            assert_eq!(p as usize % align, 0, "align {align}");
            p.write_bytes(0xab, 100);
            let p2 = realloc(p, l, 1 << 20);
            assert_eq!(p2 as usize % align, 0, "realloc keeps align {align}");
            assert_eq!(*p2.add(99), 0xab);
            dealloc(p2, Layout::from_size_align(1 << 20, align).unwrap());
        }
        // Padding in front of aligned blocks is reusable, not wasted.
        // (Measured on the block itself: other tests change the global counters concurrently.)
        let l = Layout::from_size_align(64, 1 << 20).unwrap();
        let p = alloc(l);
        assert!(A.usable_size(p).unwrap() < 4096);
        dealloc(p, l);
    }
    A.check().unwrap();
}

/// Small requests aligned to more than 16 bytes (up to 4 KiB) are slab objects of a class whose
/// size is a multiple of the alignment: aligned, disjoint, keeping their bytes, and freed into the
/// thread's cache like any small block.
#[test]
fn small_over_aligned_blocks_are_slab_objects() {
    let mut live = Vec::new();
    // SAFETY: non-zero layouts; each block is written within its size and freed once with its
    // layout.
    unsafe {
        for shift in 5..=12u32 {
            let align = 1usize << shift;
            for size in [1, 17, 64, 100, 1000, 4000, 4096] {
                let l = Layout::from_size_align(size, align).unwrap();
                for _ in 0..40 {
                    let p = alloc(l);
                    assert!(!p.is_null(), "size {size} align {align}");
                    assert_eq!(p as usize % align, 0, "size {size} align {align}");
                    let usable = A.usable_size(p).unwrap();
                    assert!(
                        usable >= size && usable % align == 0 && usable <= 4096,
                        "size {size} align {align}: usable {usable}"
                    );
                    p.write_bytes(shift as u8, size);
                    live.push((p, l, usable));
                }
            }
        }
        live.sort_by_key(|&(p, ..)| p as usize);
        for w in live.windows(2) {
            assert!(
                w[0].0 as usize + w[0].2 <= w[1].0 as usize,
                "overlapping blocks"
            );
        }
        for (p, l, _) in live {
            let fill = l.align().trailing_zeros() as u8;
            assert!(
                (0..l.size()).all(|i| *p.add(i) == fill),
                "a block lost its bytes"
            );
            dealloc(p, l);
        }
    }
    A.check().unwrap();
    // The thread cache takes a freed aligned block, and hands it to the next request of its class.
    #[cfg(feature = "std")]
    std::thread::spawn(|| {
        let l = Layout::from_size_align(64, 64).unwrap();
        // SAFETY: a non-zero layout; the block is freed once with it.
        unsafe {
            let p = alloc(l);
            let before = A.thread_cache_bytes();
            dealloc(p, l);
            assert_eq!(A.thread_cache_bytes(), before + 64);
            let q = alloc(l);
            assert_eq!(q, p, "the cached block was not reused");
            dealloc(q, l);
        }
    })
    .join()
    .unwrap();
}

#[test]
fn multi_gib_virtual_allocations() {
    let _g = heavy();
    // SAFETY: non-zero layouts; the writes and reads stay inside the 8 GiB blocks, each freed once
    // with its layout.
    unsafe {
        let l = Layout::from_size_align(8 << 30, 4096).unwrap();
        let p = alloc(l);
        assert!(!p.is_null());
        for gib in 0..8 {
            *p.add(gib << 30) = gib as u8;
        }
        assert_eq!(*p.add(7 << 30), 7);
        dealloc(p, l);
        // A zeroed multi-GiB block: zero without touching every page.
        let rss0 = rss_bytes();
        let z = alloc_zeroed(l);
        assert!(!z.is_null());
        assert_eq!(*z.add(5 << 30), 0);
        assert!(
            rss_bytes() < rss0 + (64 << 20),
            "alloc_zeroed must not commit the block"
        );
        dealloc(z, l);
    }
    let v = vec![0u64; 512 << 20]; // 4 GiB through alloc_zeroed
    assert_eq!(v[400 << 20], 0);
    drop(v);
    A.check().unwrap();
}

#[test]
fn zeroed_memory_is_zero_after_reuse() {
    let _g = heavy();
    // SAFETY: non-zero layouts; each block is written within its size and freed once with its
    // layout.
    unsafe {
        for size in [24usize, 4000, 200_000, 3 << 20] {
            let l = Layout::from_size_align(size, 8).unwrap();
            let p = alloc(l);
            p.write_bytes(0xff, size);
            dealloc(p, l);
            let z = alloc_zeroed(l);
            assert!((0..size).all(|i| *z.add(i) == 0), "size {size}");
            dealloc(z, l);
        }
    }
}

#[test]
fn larger_than_the_arena_returns_null() {
    // SAFETY: non-zero layouts; null results are only compared, never used.
    unsafe {
        // `black_box`: an allocation whose pointer never escapes may be elided by the optimiser.
        let l = Layout::from_size_align(1 << 40, 8).unwrap(); // 1 TiB > 64 GiB arena
        assert!(std::hint::black_box(alloc(l)).is_null());
        let l = Layout::from_size_align(isize::MAX as usize - 4096, 8).unwrap();
        assert!(std::hint::black_box(alloc(l)).is_null());
        assert!(A.alloc(l).is_null());
    }
    // And keeps working.
    let v = vec![1u8; 1000];
    assert_eq!(v.iter().map(|&x| x as usize).sum::<usize>(), 1000);
}

#[test]
fn rss_falls_after_a_large_free() {
    let _g = heavy();
    let size = 256 << 20;
    let mut v = vec![0u8; size];
    for i in (0..size).step_by(4096) {
        v[i] = 1; // commit every page
    }
    std::hint::black_box(&mut v); // the writes must happen (release builds elide them otherwise)
    let with = rss_bytes();
    drop(v);
    let without = rss_bytes();
    println!(
        "RSS with a 256 MiB block: {} MiB, after free: {} MiB",
        with >> 20,
        without >> 20
    );
    // (Saturating: RSS that grew must fail the test, not wrap to a huge fall in release builds.)
    let fell = with.saturating_sub(without);
    assert!(fell > 200 << 20, "RSS fell by only {} MiB", fell >> 20);
    // Small blocks freed into a big free chunk are returned by the sweep.
    let blocks: Vec<Box<[u8; 4096]>> = (0..32_768).map(|_| Box::new([1u8; 4096])).collect();
    let with = rss_bytes();
    drop(blocks);
    A.release_free_memory();
    let without = rss_bytes();
    println!(
        "RSS with 128 MiB of 4 KiB blocks: {} MiB, after free + release: {} MiB",
        with >> 20,
        without >> 20
    );
    let fell = with.saturating_sub(without);
    assert!(fell > 100 << 20, "RSS fell by only {} MiB", fell >> 20);
}

#[test]
fn stats_follow_allocations() {
    let _g = heavy();
    let before = A.stats();
    let v = vec![0u8; 10 << 20];
    let during = A.stats();
    // Other tests run concurrently, so only lower bounds that they cannot break are asserted.
    assert!(during.bytes_in_use >= 10 << 20);
    assert!(during.num_allocs > before.num_allocs);
    assert!(during.largest_alloc_size >= 10 << 20);
    assert!(during.peak_bytes_in_use >= during.bytes_in_use);
    assert_eq!(during.bytes_reserved, A.arena_size());
    assert_eq!(A.usable_size(v.as_ptr()), Some(10 << 20));
    drop(v);
    assert!(A.stats().metadata_bytes > 0);
}

#[test]
fn allocator_api2_allocate_and_grow() {
    use allocator_api2::alloc::Allocator;
    let l = Layout::from_size_align(48, 16).unwrap();
    let p = A.allocate(l).unwrap();
    // SAFETY: `p` came from `A.allocate(l)`; each grow or shrink gets the block's current layout,
    // and the block is freed once with its last one.
    unsafe {
        p.cast::<u8>().as_ptr().write_bytes(7, 48);
        let g = A
            .grow(p.cast(), l, Layout::from_size_align(4096, 16).unwrap())
            .unwrap();
        assert_eq!(*g.cast::<u8>().as_ptr().add(47), 7);
        let g2 = A
            .grow(
                g.cast(),
                Layout::from_size_align(4096, 16).unwrap(),
                Layout::from_size_align(8192, 4096).unwrap(),
            )
            .unwrap();
        assert_eq!(g2.cast::<u8>().as_ptr() as usize % 4096, 0);
        assert_eq!(*g2.cast::<u8>().as_ptr().add(47), 7);
        A.deallocate(g2.cast(), Layout::from_size_align(8192, 4096).unwrap());
        // Lowering the alignment turns a large (over-aligned: above 4 KiB) block into a small
        // one: it must move, because the small layout it is freed with sends it to the thread
        // cache.
        let big_align = Layout::from_size_align(64, 8192).unwrap();
        let small = Layout::from_size_align(64, 8).unwrap();
        let p = A.allocate(big_align).unwrap();
        p.cast::<u8>().as_ptr().write_bytes(9, 64);
        let s = A.shrink(p.cast(), big_align, small).unwrap();
        assert_eq!(*s.cast::<u8>().as_ptr().add(63), 9);
        A.deallocate(s.cast(), small);
        // A smaller size and a lower alignment: only the new size is copied, so the small blocks
        // around the new one keep their bytes.
        let (from, to) = (
            Layout::from_size_align(4096, 4096).unwrap(),
            Layout::from_size_align(100, 16).unwrap(),
        );
        let p = A.allocate(from).unwrap().cast::<u8>();
        for i in 0..4096 {
            p.as_ptr().add(i).write(i as u8);
        }
        // Live blocks of the new class on both sides of a hole, which the move takes (the thread
        // cache hands out the block freed last).
        let mut around: Vec<_> = (0..17)
            .map(|_| A.allocate(to).unwrap().cast::<u8>())
            .collect();
        A.deallocate(around.remove(8), to);
        for b in &around {
            b.as_ptr().write_bytes(0x5a, 100);
        }
        let s = A.shrink(p, from, to).unwrap().cast::<u8>();
        for i in 0..100 {
            assert_eq!(*s.as_ptr().add(i), i as u8);
        }
        for b in around {
            assert!(
                (0..100).all(|i| *b.as_ptr().add(i) == 0x5a),
                "a neighbour was overwritten"
            );
            A.deallocate(b, to);
        }
        A.deallocate(s, to);
        #[cfg(feature = "std")]
        A.flush_thread_cache(); // aborted here (wrong size class) before the fix
        A.check().unwrap();
    }
}

#[test]
fn blocks_of_64_kib_or_more_start_at_64_kib_boundaries() {
    let local = GlobalBfc::with_config(bfc_alloc::HostConfig {
        arena_size: 1 << 30,
        ..bfc_alloc::HostConfig::DEFAULT
    });
    let mut live = Vec::new();
    // SAFETY: non-zero layouts; each block is written within its size and freed once with its
    // layout.
    unsafe {
        // Interleaved with odd-sized engine blocks, so the free space is never aligned by chance.
        for (i, size) in [65_536usize, 70_001, 1 << 20, 3 << 20, 65_537, 200_000]
            .into_iter()
            .cycle()
            .take(60)
            .enumerate()
        {
            // (Engine blocks placed as they fit: above the 16 KiB slab limit, and aligned beyond
            // what medium blocks, which start on a grid of their own, serve: 128 bytes.)
            let odd = Layout::from_size_align((16 << 10) + 4 + i * 48, 256).unwrap();
            let m = local.alloc(odd);
            assert!(!m.is_null());
            let l = Layout::from_size_align(size, 8).unwrap();
            let p = local.alloc(l);
            assert!(!p.is_null());
            assert_eq!(p as usize % 65_536, 0, "{size} bytes at {p:p}");
            p.write(i as u8);
            live.push((p, l));
            if i % 3 == 0 {
                let (q, lq) = live.swap_remove(i % live.len());
                local.dealloc(q, lq);
            }
            local.dealloc(m, odd);
        }
        // A grown block is on the grid, whether it moved (a new block) or stayed.
        let (p, l) = live.pop().unwrap();
        let q = local.realloc(p, l, 40 << 20);
        assert_eq!(q as usize % 65_536, 0);
        assert_eq!(*q, 59);
        local.dealloc(q, Layout::from_size_align(40 << 20, 8).unwrap());
        for (p, l) in live {
            local.dealloc(p, l);
        }
    }
    local.check().unwrap();
    assert_eq!(local.stats().bytes_in_use, 0);
}

#[test]
fn large_blocks_near_the_arena_limit_still_fit() {
    // The 64 KiB grid is a preference: a block whose padding would not fit is placed as asked.
    for size in [4 << 20, (4 << 20) - 16, (4 << 20) - (32 << 10)] {
        let local = fixed_arena(4 << 20, true);
        let l = Layout::from_size_align(size, 8).unwrap();
        // SAFETY: a non-zero layout; the block is written within its size and freed once with it.
        unsafe {
            let p = local.alloc(l);
            assert!(!p.is_null(), "{size} bytes in a 4 MiB arena");
            p.write(1);
            local.dealloc(p, l);
        }
        local.check().unwrap();
    }
}

#[test]
fn a_private_instance_works_beside_the_global_one() {
    let local = GlobalBfc::with_config(bfc_alloc::HostConfig {
        arena_size: 1 << 30,
        ..bfc_alloc::HostConfig::DEFAULT
    });
    // SAFETY: a non-zero layout; the block is used within its size and freed once with it.
    unsafe {
        let l = Layout::from_size_align(1000, 8).unwrap();
        let p = local.alloc(l);
        assert!(!p.is_null());
        assert_eq!(local.arena_size(), 1 << 30);
        assert!(local
            .alloc(Layout::from_size_align(2 << 30, 8).unwrap())
            .is_null());
        local.dealloc(p, l);
    }
    local.check().unwrap();
}

#[test]
fn a_request_larger_than_an_idle_arena_keeps_the_arena() {
    // Every block free: the arena is one free region. A request that can never fit must fail
    // without giving that region back (which would report nothing reserved and drop its pages).
    let local = fixed_arena(64 << 20, false);
    let l = Layout::from_size_align(8 << 20, 8).unwrap();
    // SAFETY: non-zero layouts; the block is written within its size and freed once with it; the
    // null results are only compared.
    unsafe {
        let p = local.alloc(l);
        assert!(!p.is_null());
        p.write_bytes(0xa5, 8 << 20);
        local.dealloc(p, l);
        let before = local.stats();
        assert!(local
            .alloc(Layout::from_size_align(128 << 20, 8).unwrap())
            .is_null());
        let after = local.stats();
        assert_eq!(after.bytes_reserved, local.arena_size());
        assert_eq!(after.num_regions, before.num_regions);
        let q = local.alloc_zeroed(l);
        assert!(!q.is_null());
        assert!(std::slice::from_raw_parts(q, 8 << 20)
            .iter()
            .all(|&b| b == 0));
        local.dealloc(q, l);
    }
    local.check().unwrap();
}

#[test]
fn a_first_aligned_request_that_fits_the_arena_is_served() {
    // The arena is aligned to 2 MiB, so the first block needs padding room only for alignment
    // beyond that. These used to fail on a fresh heap and succeed once the arena existed.
    for (size, align) in [(16 << 20, 4096), (16 << 20, 2 << 20), (10 << 20, 8 << 20)] {
        let local = fixed_arena(16 << 20, false);
        let l = Layout::from_size_align(size, align).unwrap();
        // SAFETY: a non-zero layout; the block is written within its size and freed once with it.
        unsafe {
            let p = local.alloc(l);
            assert!(!p.is_null(), "{size} B at {align} in a fresh 16 MiB arena");
            assert_eq!(p as usize % align, 0);
            p.write_bytes(0xa5, size);
            assert_eq!(local.stats().bytes_reserved, local.arena_size());
            local.dealloc(p, l);
        }
        local.check().unwrap();
    }
}

#[test]
fn a_freed_small_block_aligned_above_4_kib_coalesces_at_once() {
    // Such a block comes from the engine, not the slabs: freed, it joins its free neighbours at
    // once instead of waiting, uncoalesced, in a cache the host never takes it back from.
    let local = fixed_arena(64 << 20, false);
    let l = Layout::from_size_align(512, 8 << 10).unwrap();
    // SAFETY: a non-zero layout; the block is written within its size and freed once with it.
    unsafe {
        let p = local.alloc(l);
        assert!(!p.is_null());
        assert_eq!(p as usize % (8 << 10), 0);
        p.write(1);
        local.dealloc(p, l);
    }
    let s = local.stats();
    assert_eq!((s.num_cached_chunks, s.bytes_cached), (0, 0));
    assert_eq!(s.bytes_in_use, 0);
    assert_eq!(s.largest_free_block, local.arena_size());
    local.check().unwrap();
}

#[test]
fn metadata_bytes_do_not_fall_when_the_top_is_trimmed() {
    // The span table's entries stay touched when the arena's top goes back to the kernel, so the
    // metadata that may be resident does not shrink with it.
    let local = fixed_arena(256 << 20, false);
    let l = Layout::from_size_align(48, 8).unwrap();
    // SAFETY: a non-zero layout; each block is written within its size and freed once with it.
    let blocks: Vec<usize> = (0..400_000)
        .map(|_| unsafe {
            let p = local.alloc(l);
            assert!(!p.is_null());
            p.write(1);
            p as usize
        })
        .collect();
    let during = local.stats().metadata_bytes;
    for p in blocks {
        // SAFETY: allocated above with `l`, freed once.
        unsafe { local.dealloc(p as *mut u8, l) };
    }
    local.release_free_memory();
    let after = local.stats();
    assert_eq!(after.bytes_in_use, 0);
    assert!(
        after.metadata_bytes >= during,
        "metadata_bytes fell from {during} to {}",
        after.metadata_bytes
    );
    local.check().unwrap();
}

#[test]
fn largest_alloc_size_is_the_largest_block_handed_out() {
    // As the engine's stats: the block's size (what `usable_size` reports), not the request.
    for cache in [false, true] {
        let local = fixed_arena(64 << 20, cache);
        // SAFETY: non-zero layouts; each block is freed once with the layout it was made with
        // (the realloc'd one with its new size).
        unsafe {
            let small = Layout::from_size_align(1000, 8).unwrap();
            let p = local.alloc(small);
            assert!(!p.is_null());
            let usable = local.usable_size(p).unwrap();
            assert!(usable > 1000, "a size class above the request");
            assert_eq!(local.stats().largest_alloc_size, usable, "cache {cache}");
            local.dealloc(p, small);

            let large = Layout::from_size_align(100_001, 8).unwrap();
            let q = local.alloc(large);
            assert!(!q.is_null());
            let usable = local.usable_size(q).unwrap();
            assert_eq!(local.stats().largest_alloc_size, usable, "cache {cache}");
            // Grown in place (nothing follows it): the grown block counts.
            let r = local.realloc(q, large, 300_001);
            assert_eq!(r, q, "grown in place");
            let usable = local.usable_size(r).unwrap();
            assert!(usable >= 300_001);
            assert_eq!(local.stats().largest_alloc_size, usable, "cache {cache}");
            local.dealloc(r, Layout::from_size_align(300_001, 8).unwrap());
        }
        local.check().unwrap();
    }
}

// ---- abort paths, each in a child process ----

const CHILD_ENV: &str = "BFC_ALLOC_CHILD_CASE";

/// Runs this test binary again with `case` selected and returns (exit status, stderr).
fn run_child(case: &str) -> (std::process::ExitStatus, String) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, case)
        .output()
        .unwrap();
    (
        out.status,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The child side: does the bad thing named by the environment. A no-op in a normal run.
#[test]
fn child_entry() {
    let Ok(case) = std::env::var(CHILD_ENV) else {
        return;
    };
    // SAFETY: the child deliberately breaks the contract (a double free, a wrong pointer) to show
    // the abort; it never returns to use the heap afterwards.
    unsafe {
        // `black_box`: the optimiser may elide an allocation whose pointer does not escape.
        let l = Layout::from_size_align(64, 8).unwrap();
        let p = std::hint::black_box(alloc(l));
        let _keep = std::hint::black_box(alloc(l));
        match case.as_str() {
            "double_free" => {
                dealloc(p, l);
                dealloc(p, l);
            }
            "interior" => dealloc(std::hint::black_box(p.add(16)), l),
            "interior_large" => {
                let big = Layout::from_size_align(100_000, 8).unwrap();
                let q = std::hint::black_box(alloc(big));
                dealloc(std::hint::black_box(q.add(4096)), big);
            }
            "double_free_large" => {
                let big = Layout::from_size_align(100_000, 8).unwrap();
                let q = std::hint::black_box(alloc(big));
                dealloc(q, big);
                dealloc(std::hint::black_box(q), big);
            }
            "double_free_in_a_row" => {
                dealloc(p, l);
                dealloc(std::hint::black_box(p), l);
                // Caught at the second free, not later: `_exit` runs no thread-exit destructor,
                // so no exit flush catches it.
                libc::_exit(0);
            }
            #[cfg(feature = "std")]
            "double_free_flushed" => {
                // The first free went into the thread cache and from there back to the slab layer.
                dealloc(p, l);
                A.flush_thread_cache();
                dealloc(std::hint::black_box(p), l);
                // The second free went into the cache unchecked; it is caught when it leaves.
                A.flush_thread_cache();
            }
            #[cfg(feature = "std")]
            "double_free_span_released" => {
                // The first frees empty two spans of the 4 KiB class, which go back to the engine
                // and are made again as spans of the 2 KiB class (release builds; debug builds
                // check a free's span at once); the second free of a block of the second span is
                // caught when the cache gives it back, and finds a live 2 KiB block there.
                let page = Layout::from_size_align(4096, 8).unwrap();
                let blocks: Vec<*mut u8> = (0..40).map(|_| alloc(page)).collect();
                for &b in &blocks {
                    dealloc(b, page);
                }
                A.flush_thread_cache();
                let half = Layout::from_size_align(2048, 8).unwrap();
                let _others: Vec<*mut u8> = (0..200).map(|_| alloc(half)).collect();
                dealloc(std::hint::black_box(blocks[25]), page);
                A.flush_thread_cache();
            }
            #[cfg(feature = "std")]
            "double_free_interleaved" => {
                // Not in a row, so the free itself cannot tell; `check()` sees the block twice in
                // the thread's cache, and the flush aborts.
                let q = std::hint::black_box(alloc(l));
                dealloc(p, l);
                dealloc(q, l);
                dealloc(std::hint::black_box(p), l);
                eprintln!("check: {:?}", A.check());
                A.flush_thread_cache();
            }
            #[cfg(feature = "std")]
            "double_free_decayed" => {
                // The block is twice on the 64-byte stack, not in a row. Traffic of another class
                // only: the 64-byte class decays, and its blocks go back to the slab layer, which
                // catches the second free.
                let q = std::hint::black_box(alloc(l));
                dealloc(p, l);
                dealloc(q, l);
                dealloc(std::hint::black_box(p), l);
                let busy = Layout::from_size_align(3584, 8).unwrap();
                let mut blocks = [std::ptr::null_mut(); 17];
                for _ in 0..768 {
                    for b in blocks.iter_mut() {
                        *b = std::hint::black_box(alloc(busy));
                    }
                    for &b in &blocks {
                        dealloc(b, busy);
                    }
                }
                // Not caught: leave without the exit flush, which would catch it.
                println!("child survived: {case}");
                libc::_exit(0);
            }
            #[cfg(feature = "std")]
            "wrong_layout" => {
                // A 64-byte block freed as a 16-byte one: its span is of another class, so it does
                // not join the 16-byte stack (where the next 16-byte allocation would take it); the
                // free goes by the pointer.
                dealloc(p, Layout::from_size_align(16, 8).unwrap());
                report_and_exit(p);
            }
            "wrong_layout_flushed" => {
                // Release builds: the fast path takes the layout's word and caches the block as a
                // 16-byte one; it is caught when the cache gives it back.
                dealloc(p, Layout::from_size_align(16, 8).unwrap());
                #[cfg(feature = "std")]
                A.flush_thread_cache();
                libc::_exit(0);
            }
            "large_freed_as_small" => {
                // Any 16-byte-aligned offset is a 16-byte object start; a large block's start freed
                // with a 16-byte layout must not join the 16-byte stack either.
                let big = Layout::from_size_align(100_000, 8).unwrap();
                let q = std::hint::black_box(alloc(big));
                dealloc(q, Layout::from_size_align(16, 8).unwrap());
                report_and_exit(q);
            }
            "interior_large_as_small" => {
                // A pointer into a large block, freed with a small layout: caught at the free (the
                // child leaves through `_exit`, so no exit flush catches it later).
                let big = Layout::from_size_align(100_000, 8).unwrap();
                let q = std::hint::black_box(alloc(big));
                dealloc(q.add(16), Layout::from_size_align(16, 8).unwrap());
                libc::_exit(0);
            }
            "span_tail" => {
                // 3072-byte objects fill 63 KiB of a 64 KiB span; the address just past the last
                // one is no block, though it is a multiple of the size.
                let (_, tail) = span_tail_3072();
                dealloc(tail as *mut u8, Layout::from_size_align(3072, 16).unwrap());
                // Caught at the free, not later when a thread cache gives the block back (`_exit`
                // runs no thread-exit destructor, so no exit flush).
                libc::_exit(0);
            }
            "foreign" => {
                let mut x = 0u64;
                dealloc(&mut x as *mut u64 as *mut u8, l);
            }
            "realloc_foreign" => {
                let mut x = 0u64;
                let _ = realloc(&mut x as *mut u64 as *mut u8, l, 128);
            }
            "free_uninit" | "realloc_uninit" => {
                // An instance whose arena could not be reserved never has a heap: no pointer can
                // be its block.
                let local = GlobalBfc::with_config(bfc_alloc::HostConfig {
                    arena_size: 1 << 61,
                    min_arena_size: 1 << 60,
                    ..bfc_alloc::HostConfig::DEFAULT
                });
                assert!(local.alloc(l).is_null());
                if case == "free_uninit" {
                    local.dealloc(p, l);
                } else {
                    let _ = local.realloc(p, l, 128);
                }
            }
            "realloc_double_free" => {
                dealloc(p, l);
                // Back in its span (not a cached block, which still reads as allocated there).
                #[cfg(feature = "std")]
                A.flush_thread_cache();
                let _ = realloc(p, l, 128);
            }
            "realloc_interior" => {
                let _ = realloc(p.add(16), l, 128);
            }
            "realloc_double_free_large" => {
                let big = Layout::from_size_align(100_000, 8).unwrap();
                let q = std::hint::black_box(alloc(big));
                dealloc(q, big);
                let _ = realloc(q, big, 200_000);
            }
            "realloc_interior_large" => {
                let big = Layout::from_size_align(100_000, 8).unwrap();
                let q = std::hint::black_box(alloc(big));
                let _ = realloc(q.add(4096), big, 200_000);
            }
            "uncommitted" => {
                // Inside the arena (64 GiB from a start near `p`), far above the memory the heap
                // has committed: its pointer-map entries are not accessible.
                let far = p.wrapping_add(8 << 30);
                dealloc(far, Layout::from_size_align(1 << 20, 8).unwrap());
            }
            _ => panic!("unknown case"),
        }
    }
    println!("child survived: {case}");
}

/// The child's report after a free of `p` with another class's layout: the heap's check and
/// whether `p` is still a block. Leaves through `_exit`, so no thread-exit flush runs first.
fn report_and_exit(p: *mut u8) -> ! {
    eprintln!("check: {:?}", A.check());
    eprintln!("still a block: {:?}", A.usable_size(p));
    // SAFETY: ends the process at once; nothing is left to run.
    unsafe { libc::_exit(0) }
}

fn assert_aborts(case: &str, message: &str) {
    let (status, stderr) = run_child(case);
    assert!(!status.success(), "{case}: child exited successfully");
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc_sigabrt()), "{case}: {status:?}");
    }
    assert!(
        stderr.contains("bfc-alloc: fatal:") && stderr.contains(message),
        "{case}: stderr was {stderr:?}"
    );
}

fn libc_sigabrt() -> i32 {
    6
}

#[test]
fn double_free_aborts_with_a_clear_message() {
    assert_aborts("double_free", "double free of pointer");
    assert_aborts("double_free_in_a_row", "double free of pointer");
}

#[test]
fn interior_pointer_free_aborts() {
    assert_aborts("interior", "into the middle of the block");
}

#[test]
fn large_block_double_free_and_interior_free_abort() {
    assert_aborts("double_free_large", "double free of pointer");
    assert_aborts("interior_large", "into the middle of the block");
}

#[cfg(feature = "std")]
#[test]
fn thread_cache_double_frees_abort() {
    assert_aborts("double_free_flushed", "double free of pointer");
    assert_aborts("double_free_interleaved", "double free of pointer");
    // Caught when the block's class decays in a thread busy with another class.
    assert_aborts("double_free_decayed", "double free of pointer");
    // The block's span went back to the engine in between: the message names both causes.
    #[cfg(not(debug_assertions))]
    assert_aborts(
        "double_free_span_released",
        "a double free (its span was given back",
    );
    let (_, stderr) = run_child("double_free_interleaved");
    assert!(
        stderr.contains("holding a block twice"),
        "check() did not report the doubled block: {stderr:?}"
    );
}

/// Release builds (`.ci/test-all.sh` runs this file with `--release` too): a free with a small
/// layout of another class than the block's goes into the thread cache on the layout's word, and
/// aborts when the cache gives the block back to its span.
#[cfg(all(feature = "std", not(debug_assertions)))]
#[test]
fn a_free_with_another_class_aborts_when_the_cache_gives_it_back() {
    assert_aborts(
        "wrong_layout_flushed",
        "not a live block of the layout's size class",
    );
}

/// Debug builds: frees with a small layout of another class than the block's (or of a large block)
/// are caught before they reach a thread cache: a bad pointer aborts at once, and a block's own
/// start is freed as the block it is.
#[cfg(all(feature = "std", debug_assertions))]
#[test]
fn a_free_with_another_class_never_reaches_a_thread_cache() {
    for case in ["wrong_layout", "large_freed_as_small"] {
        let (status, stderr) = run_child(case);
        assert!(status.success(), "{case}: {status:?} {stderr}");
        assert!(stderr.contains("check: Ok(())"), "{case}: {stderr}");
        assert!(stderr.contains("still a block: None"), "{case}: {stderr}");
    }
    assert_aborts("interior_large_as_small", "into the middle of the block");
}

/// Allocates 3072-byte blocks (21 to a 64 KiB span, which leaves a 1 KiB tail) until one is a
/// span's last object; returns it and the address just past it, in the span's tail. The blocks stay
/// allocated.
fn span_tail_3072() -> (usize, usize) {
    let l = Layout::from_size_align(3072, 16).unwrap();
    for _ in 0..200 {
        // SAFETY: a non-zero layout; the block is never freed (the span stays full).
        let p = std::hint::black_box(unsafe { alloc(l) }) as usize;
        assert_ne!(p, 0);
        if p % (64 << 10) == 20 * 3072 {
            return (p, p + 3072);
        }
    }
    panic!("no 3072-byte block at a span's last slot");
}

#[test]
fn the_tail_of_a_span_is_no_block() {
    let (last, tail) = span_tail_3072();
    assert_eq!(A.usable_size(last as *const u8), Some(3072));
    assert_eq!(A.usable_size(tail as *const u8), None);
    assert_aborts("span_tail", "double free of pointer");
}

#[test]
fn foreign_pointer_free_aborts() {
    assert_aborts("foreign", "does not own");
}

/// A pointer into the arena's reserved but never committed part is refused with the message, not
/// a fault on the inaccessible metadata that describes it.
#[test]
fn a_free_far_above_the_used_arena_aborts_with_a_message() {
    assert_aborts("uncommitted", "it is not currently allocated");
}

#[test]
fn foreign_pointer_realloc_aborts() {
    assert_aborts("realloc_foreign", "realloc: free of pointer");
}

#[test]
fn a_free_into_an_instance_that_has_no_heap_aborts() {
    assert_aborts("free_uninit", "free of pointer");
    assert_aborts("free_uninit", "but the heap was never initialised");
    assert_aborts("realloc_uninit", "realloc of pointer");
    assert_aborts("realloc_uninit", "but the heap was never initialised");
}

#[test]
fn realloc_of_a_freed_block_or_an_interior_pointer_aborts() {
    assert_aborts("realloc_double_free", "double free of pointer");
    assert_aborts("realloc_interior", "into the middle of the block");
    assert_aborts(
        "realloc_double_free_large",
        "realloc: double free of pointer",
    );
    assert_aborts("realloc_interior_large", "into the middle of the block");
}

#[test]
fn an_arena_that_cannot_be_reserved_makes_every_allocation_fail() {
    use allocator_api2::alloc::Allocator;
    // No address space holds 2^60 bytes, and `usize::MAX` (rounded) would overflow with the
    // alignment slack: both are refusals, never a panic.
    for arena_size in [usize::MAX, 1 << 61] {
        let local = GlobalBfc::with_config(bfc_alloc::HostConfig {
            arena_size,
            min_arena_size: 1 << 60,
            ..bfc_alloc::HostConfig::DEFAULT
        });
        for _ in 0..3 {
            for (size, align) in [(64, 8), (4096, 16), (1 << 20, 8), (100, 64)] {
                let l = Layout::from_size_align(size, align).unwrap();
                // SAFETY: non-zero layouts; nothing is returned to free.
                unsafe {
                    assert!(local.alloc(l).is_null(), "{size}/{align}");
                    assert!(local.alloc_zeroed(l).is_null(), "{size}/{align}");
                }
                assert!(local.allocate(l).is_err());
            }
        }
        assert_eq!(local.arena_size(), 0);
        assert_eq!(local.stats(), bfc_alloc::Stats::default());
        assert_eq!(local.release_free_memory(), 0);
        local.check().unwrap();
    }
    // The global instance is unaffected.
    let v = vec![7u8; 5000];
    assert_eq!(v.iter().map(|&x| x as usize).sum::<usize>(), 35_000);
}

/// `usable_size` of freed blocks, as documented: a small block freed into the thread's cache still
/// reads as its class size (with `std`); a freed large block reads as no block. (The large block
/// comes from an instance of its own: in the global one, a test on another thread may be handed
/// the freed block's address before it is looked up.)
#[test]
fn usable_size_of_freed_blocks() {
    std::thread::spawn(|| {
        let small = Layout::from_size_align(48, 8).unwrap();
        let large = Layout::from_size_align(1 << 20, 8).unwrap();
        let local = fixed_arena(16 << 20, false);
        // Without `std` there are no thread caches: the freed small block is back in its span, and
        // in the global instance another test's thread may be handed it before the lookup.
        let (a, cached): (&GlobalBfc, _) = if cfg!(feature = "std") {
            (&A, Some(48))
        } else {
            (&local, None)
        };
        // SAFETY: each block is freed once, with its layout; the pointers are only looked up after.
        unsafe {
            let p = a.alloc(small);
            assert_eq!(a.usable_size(p), Some(48));
            a.dealloc(p, small);
            assert_eq!(a.usable_size(p), cached);
            let q = local.alloc(large);
            assert!(local.usable_size(q).unwrap() >= 1 << 20);
            local.dealloc(q, large);
            assert_eq!(local.usable_size(q), None);
        }
    })
    .join()
    .unwrap();
}

/// The small fast paths save no register and call nothing (every slow path is a tail jump), so the
/// entry points of allocation and free hold no `push` and no `call` at all: no stack frame, and no
/// panic path (until 9ba1e7f a bounds check on the size class, never taken, called
/// `panic_bounds_check`, which made both save registers on entry). Release builds on x86-64 only
/// (a debug build keeps every check); skipped, with the reason printed, without `objdump`.
#[test]
#[cfg(all(not(debug_assertions), target_arch = "x86_64", target_os = "linux"))]
fn allocation_and_free_entry_points_save_no_register_and_call_nothing() {
    let exe = std::env::current_exe().unwrap();
    let out = match Command::new("objdump")
        .args(["-d", "--no-show-raw-insn"])
        .arg(&exe)
        .output()
    {
        Ok(o) if o.status.success() => o.stdout,
        other => {
            println!("skipped: no usable objdump ({other:?})");
            return;
        }
    };
    let text = String::from_utf8_lossy(&out);
    for name in ["__rust_alloc", "__rust_dealloc"] {
        // The entry point's symbol, as objdump prints it without demangling: `__rust_alloc`, or
        // its v0 name `_RNv..._7___rustc12___rust_alloc` (`__rustc::__rust_alloc`).
        let header = [format!("{}_{name}>:", name.len()), format!("<{name}>:")];
        let body: Vec<&str> = text
            .lines()
            .skip_while(|l| !header.iter().any(|h| l.ends_with(h.as_str())))
            .skip(1)
            .take_while(|l| !l.trim().is_empty())
            .collect();
        assert!(!body.is_empty(), "{name} not found in the disassembly");
        // The fast path is in the entry point itself, not behind a jump to `GlobalBfc`'s method.
        assert!(
            body.len() > 16,
            "{name} holds {} instructions, not the fast path:\n{}",
            body.len(),
            body.join("\n")
        );
        let mnemonic = |l: &&str| l.split('\t').nth(1).unwrap_or("").to_owned();
        let bad: Vec<&str> = body
            .iter()
            .filter(|l| ["call", "push"].iter().any(|m| mnemonic(l).starts_with(m)))
            .copied()
            .collect();
        assert!(
            bad.is_empty(),
            "{name} ({} instructions) saves registers or calls:\n{}",
            body.len(),
            bad.join("\n")
        );
    }
}
