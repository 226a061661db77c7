//! Edge cases of the host allocator's public API (private instances, not the global allocator).

use std::alloc::{GlobalAlloc, Layout};
use std::ptr::NonNull;

use allocator_api2::alloc::Allocator;
use bfc_alloc::{AllocFailure, FailureCause, GlobalBfc, HostConfig};

fn small(thread_cache: bool) -> GlobalBfc {
    GlobalBfc::with_config(HostConfig {
        arena_size: 64 << 20,
        min_arena_size: 64 << 20,
        chunk_capacity: 1 << 12,
        thread_cache,
        ..HostConfig::DEFAULT
    })
}

fn fill(p: NonNull<[u8]>, v: u8) {
    // SAFETY: every block the probes fill is live and `p.len()` bytes long.
    unsafe { std::ptr::write_bytes(p.cast::<u8>().as_ptr(), v, p.len()) }
}

/// Frees a block the probe got from `a` with layout `l`.
fn free<A: Allocator>(a: &A, p: NonNull<u8>, l: Layout) {
    // SAFETY: every caller passes a live block of `a` allocated with `l`.
    unsafe { a.deallocate(p, l) }
}

/// `GlobalAlloc::dealloc` of a block the probe got from `a` with layout `l`.
fn gfree(a: &GlobalBfc, p: *mut u8, l: Layout) {
    // SAFETY: every caller passes a live block of `a` allocated with `l`.
    unsafe { GlobalAlloc::dealloc(a, p, l) }
}

/// The `len` bytes at `p`, which a live block holds.
fn bytes<'a>(p: *const u8, len: usize) -> &'a [u8] {
    // SAFETY: every caller passes a live, initialised (zeroed or written) block of `len` bytes.
    unsafe { std::slice::from_raw_parts(p, len) }
}

#[test]
fn allocator_zero_sizes_and_shrink_to_zero() {
    for tc in [false, true] {
        let a = small(tc);
        for &(size, align) in &[
            (0usize, 1usize),
            (0, 4096),
            (0, 1 << 20),
            (16, 8),
            (20_000, 8),
            (1 << 20, 64),
        ] {
            let l = Layout::from_size_align(size, align).unwrap();
            let p = a.allocate(l).unwrap();
            assert_eq!(p.cast::<u8>().as_ptr() as usize % align, 0);
            fill(p, 0xAB);
            // Shrink to zero bytes, same alignment (allowed by the Allocator contract).
            let z = Layout::from_size_align(0, align).unwrap();
            // SAFETY: the block of `a` with layout `l`; `z` is no larger and of the same alignment.
            let q = unsafe { a.shrink(p.cast(), l, z) }.unwrap();
            assert_eq!(q.cast::<u8>().as_ptr() as usize % align, 0);
            // Grow it back (zeroed) with another alignment.
            let g = Layout::from_size_align(size + 100, align.max(64) * 2).unwrap();
            // SAFETY: `q` is `a`'s block of layout `z`; `g` is no smaller.
            let r = unsafe { a.grow_zeroed(q.cast(), z, g) }.unwrap();
            assert_eq!(r.cast::<u8>().as_ptr() as usize % g.align(), 0);
            let s = bytes(r.cast::<u8>().as_ptr(), g.size());
            assert!(
                s.iter().all(|&b| b == 0),
                "grow_zeroed from 0 bytes not zero"
            );
            free(&a, r.cast(), g);
        }
        a.check().unwrap();
        assert_eq!(a.stats().bytes_in_use, 0, "tc={tc}");
    }
}

#[test]
fn allocator_grow_shrink_changed_alignment_keeps_contents() {
    let a = small(true);
    for &(s0, a0, s1, a1) in &[
        (24usize, 8usize, 100usize, 4096usize),
        (100, 4096, 24, 8),
        (20_000, 8, 24_000, 16),
        (24_000, 16, 8, 8),
        (8, 8, 3 << 20, 1 << 21),
        (3 << 20, 1 << 21, 8, 1),
    ] {
        let l0 = Layout::from_size_align(s0, a0).unwrap();
        let l1 = Layout::from_size_align(s1, a1).unwrap();
        let p = a.allocate(l0).unwrap();
        for i in 0..s0 {
            // SAFETY: `i < s0`, within the block.
            unsafe { *p.cast::<u8>().as_ptr().add(i) = i as u8 };
        }
        // SAFETY: `p` is `a`'s block of layout `l0`; grow or shrink as the sizes say.
        let q = unsafe {
            if s1 >= s0 {
                a.grow(p.cast(), l0, l1)
            } else {
                a.shrink(p.cast(), l0, l1)
            }
        }
        .unwrap();
        assert_eq!(q.cast::<u8>().as_ptr() as usize % a1, 0);
        for i in 0..s0.min(s1) {
            // SAFETY: `i < min(s0, s1)`, within the new block.
            assert_eq!(unsafe { *q.cast::<u8>().as_ptr().add(i) }, i as u8);
        }
        free(&a, q.cast(), l1);
    }
    a.flush_thread_cache();
    a.check().unwrap();
    assert_eq!(a.stats().bytes_in_use, 0);
}

#[test]
fn allocator_refuses_impossible_layouts_without_panicking() {
    let a = small(true);
    for &(size, align) in &[
        (1usize, 1usize << 40),
        (0, 1 << 62),
        (isize::MAX as usize - 4096, 1),
        (isize::MAX as usize / 2, 1 << 20),
        (65 << 20, 8),
    ] {
        let l = Layout::from_size_align(size, align).unwrap();
        assert!(a.allocate(l).is_err(), "{size} {align}");
        assert!(a.allocate_zeroed(l).is_err(), "{size} {align}");
        // SAFETY: a layout of non-zero alignment (zero sizes are served by this allocator).
        assert!(unsafe { GlobalAlloc::alloc(&a, l) }.is_null());
        // SAFETY: as above.
        assert!(unsafe { GlobalAlloc::alloc_zeroed(&a, l) }.is_null());
    }
    // realloc / grow to an impossible size fails and keeps the block.
    let l = Layout::from_size_align(64, 8).unwrap();
    let p = a.allocate(l).unwrap();
    let big = Layout::from_size_align(isize::MAX as usize - 4096, 8).unwrap();
    // SAFETY: `p` is `a`'s block of layout `l`; `big` is larger.
    assert!(unsafe { a.grow(p.cast(), l, big) }.is_err());
    // SAFETY: as above; `isize::MAX - 4096` rounded up to 8 fits an `isize`.
    assert!(unsafe {
        GlobalAlloc::realloc(&a, p.cast::<u8>().as_ptr(), l, isize::MAX as usize - 4096)
    }
    .is_null());
    free(&a, p.cast(), l);
    a.check().unwrap();
}

#[test]
fn usable_size_of_foreign_pointers_is_none() {
    let a = small(true);
    let l = Layout::from_size_align(4096, 8).unwrap();
    let p = a.allocate(l).unwrap().cast::<u8>().as_ptr();
    assert!(a.usable_size(p).is_some());
    let x = 5u64;
    for q in [
        std::ptr::null(),
        std::ptr::dangling::<u8>(),
        usize::MAX as *const u8,
        (usize::MAX - 15) as *const u8,
        &x as *const u64 as *const u8,
        p.wrapping_add(16),
        p.wrapping_add(1),
        p.wrapping_add(64 << 20),
        p.wrapping_sub(1 << 40),
    ] {
        assert_eq!(a.usable_size(q), None, "{q:p}");
    }
    free(&a, NonNull::new(p).unwrap(), l);
}

#[test]
fn odd_host_configs() {
    let cfgs = [
        HostConfig {
            arena_size: usize::MAX,
            min_arena_size: 2 << 20,
            chunk_capacity: 1 << 12,
            ..HostConfig::DEFAULT
        },
        HostConfig {
            arena_size: (2 << 20) + 1,
            min_arena_size: (2 << 20) + 1,
            chunk_capacity: 16,
            ..HostConfig::DEFAULT
        },
        HostConfig {
            arena_size: 8 << 20,
            min_arena_size: 4 << 20,
            chunk_capacity: 16,
            release_threshold: 0,
            granule: 4096,
            thread_cache: false,
            upper_cache_bytes: 0,
        },
        HostConfig {
            arena_size: 8 << 20,
            min_arena_size: 4 << 20,
            chunk_capacity: 16,
            release_threshold: usize::MAX,
            granule: 8,
            thread_cache: true,
            upper_cache_bytes: 8 << 20,
        },
        HostConfig {
            arena_size: 8 << 20,
            min_arena_size: 4 << 20,
            chunk_capacity: u32::MAX as usize - 1,
            release_threshold: 1,
            granule: 8,
            thread_cache: true,
            upper_cache_bytes: 1,
        },
    ];
    for c in cfgs {
        let a = GlobalBfc::with_config(c);
        let mut live = Vec::new();
        // Fill the heap with mixed sizes until it refuses (no abort, no panic).
        for i in 0..20_000usize {
            let size = [0, 1, 24, 700, 3000, 9000, 70_000, 1 << 20][i % 8];
            let l = Layout::from_size_align(size, [1, 8, 64, 4096][i % 4]).unwrap();
            // SAFETY: a valid layout (zero sizes are served by this allocator).
            let p = unsafe { GlobalAlloc::alloc_zeroed(&a, l) };
            if p.is_null() {
                continue;
            }
            assert!(bytes(p, size).iter().all(|&b| b == 0));
            // SAFETY: `p` is a live block of `size` bytes.
            unsafe { std::ptr::write_bytes(p, 0xCD, size) };
            live.push((p, l));
            if i % 3 == 0 {
                let (p, l) = live.swap_remove(i % live.len());
                gfree(&a, p, l);
            }
        }
        a.check().unwrap();
        for (p, l) in live {
            gfree(&a, p, l);
        }
        a.release_free_memory();
        a.check().unwrap();
        assert_eq!(a.stats().bytes_in_use, 0, "{c:?}");
    }
}

#[test]
fn several_instances_on_one_thread_and_drop_with_cached_blocks() {
    let l = Layout::from_size_align(32, 8).unwrap();
    for _round in 0..20 {
        let a = small(true);
        let b = small(true);
        // `a` binds this thread's cache; `b` takes the locked path.
        let pa: Vec<_> = (0..200).map(|_| a.allocate(l).unwrap()).collect();
        let pb: Vec<_> = (0..200).map(|_| b.allocate(l).unwrap()).collect();
        for p in &pa {
            fill(*p, 1)
        }
        for p in &pb {
            fill(*p, 2)
        }
        for p in pa.iter().take(100) {
            free(&a, p.cast(), l)
        }
        for p in pb.iter().take(100) {
            free(&b, p.cast(), l)
        }
        assert!(a.thread_cache_bytes() > 0);
        assert_eq!(b.thread_cache_bytes(), 0);
        // Blocks of `b` freed on another thread, whose cache binds to `b`.
        let rest: Vec<usize> = pb[100..]
            .iter()
            .map(|p| p.cast::<u8>().as_ptr() as usize)
            .collect();
        std::thread::scope(|s| {
            s.spawn(|| {
                for &p in &rest {
                    free(&b, NonNull::new(p as *mut u8).unwrap(), l)
                }
                let x = b.allocate(l).unwrap();
                free(&b, x.cast(), l);
            });
        });
        drop(b);
        // Drop `a` with blocks in this thread's cache and live blocks (never freed: leaked with it).
        drop(a);
        // A new instance binds this thread's cache again and must not see `a`'s blocks.
        let c = small(true);
        let mut seen = std::collections::HashSet::new();
        for _ in 0..300 {
            let p = c.allocate(l).unwrap();
            assert!(
                seen.insert(p.cast::<u8>().as_ptr() as usize),
                "block handed out twice"
            );
            fill(p, 3);
        }
        c.check().unwrap();
    }
}

#[test]
fn instance_dropped_while_other_threads_keep_bound_caches() {
    use std::sync::{Arc, Barrier};
    let l = Layout::from_size_align(48, 16).unwrap();
    for _ in 0..10 {
        let a = Arc::new(small(true));
        let c = Arc::new(small(true));
        let bar = Arc::new(Barrier::new(2));
        let t = {
            let (a, c, bar) = (a.clone(), c.clone(), bar.clone());
            std::thread::spawn(move || {
                // Bind this thread's cache to `a`, leave blocks cached, give up the handle.
                let ps: Vec<_> = (0..64).map(|_| a.allocate(l).unwrap()).collect();
                for p in ps {
                    free(&*a, p.cast(), l)
                }
                assert!(a.thread_cache_bytes() > 0);
                drop(a);
                bar.wait(); // the main thread drops `a` (the instance) now
                bar.wait();
                // The orphaned cache binds to `c` and hands out only `c`'s blocks.
                let mut seen = std::collections::HashSet::new();
                let ps: Vec<_> = (0..200).map(|_| c.allocate(l).unwrap()).collect();
                for p in &ps {
                    assert!(c.usable_size(p.cast::<u8>().as_ptr()).is_some());
                    assert!(seen.insert(p.cast::<u8>().as_ptr() as usize));
                    fill(*p, 9);
                }
                for p in ps {
                    free(&*c, p.cast(), l)
                }
                // Exit with blocks of `c` cached: the exit flush goes to `c`.
            })
        };
        bar.wait();
        let a = Arc::try_unwrap(a)
            .ok()
            .expect("the thread gave its handle up");
        drop(a); // GlobalBfc::drop with another live thread's cache bound to it
                 // A new instance, possibly at the same addresses, must not receive `a`'s cached blocks.
        let d = small(true);
        let x = d.allocate(l).unwrap();
        free(&d, x.cast(), l);
        bar.wait();
        t.join().unwrap();
        c.check().unwrap();
        assert_eq!(c.stats().bytes_in_use, 0);
        d.check().unwrap();
    }
}

/// An instance moved after threads bound their caches to it keeps serving them (the heap does not
/// live in the moved value).
#[test]
fn instance_moved_after_use() {
    let l = Layout::from_size_align(64, 8).unwrap();
    let a = small(true);
    let ps: Vec<_> = (0..100).map(|_| a.allocate(l).unwrap()).collect();
    for p in &ps[..50] {
        free(&a, p.cast(), l);
    }
    let cached = a.thread_cache_bytes();
    assert!(cached > 0);
    let boxed = Box::new(a); // move
    assert_eq!(boxed.thread_cache_bytes(), cached);
    for p in &ps[50..] {
        free(&*boxed, p.cast(), l);
    }
    let moved_again = *boxed;
    let q: Vec<_> = (0..200).map(|_| moved_again.allocate(l).unwrap()).collect();
    let mut seen = std::collections::HashSet::new();
    for p in &q {
        assert!(seen.insert(p.cast::<u8>().as_ptr() as usize));
    }
    for p in q {
        free(&moved_again, p.cast(), l);
    }
    moved_again.flush_thread_cache();
    moved_again.check().unwrap();
    assert_eq!(moved_again.stats().bytes_in_use, 0);
}

/// An instance's first use (its initialisation) fits a thread with a small stack: the heap, over
/// 8 KiB, is built in place, not on the stack (before, a release build needed more than 32 KiB).
#[test]
fn first_use_fits_a_thread_with_a_32_kib_stack() {
    let t = std::thread::Builder::new()
        .stack_size(32 << 10)
        .spawn(|| {
            let a = small(true);
            let l = Layout::from_size_align(100_000, 8).unwrap();
            // SAFETY: a non-zero size; freed once with the same layout.
            unsafe {
                let p = a.alloc(l);
                assert!(!p.is_null());
                a.dealloc(p, l);
            }
            assert_eq!(a.check(), Ok(()));
        })
        .unwrap();
    t.join().unwrap();
}

/// Allocates blocks of layout `l` from `a` until it returns null; returns them.
fn until_null(a: &GlobalBfc, l: Layout) -> Vec<*mut u8> {
    let mut got = Vec::new();
    loop {
        // SAFETY: a non-zero size; the caller frees each block with the same layout.
        let p = unsafe { a.alloc(l) };
        if p.is_null() {
            return got;
        }
        got.push(p);
        assert!(got.len() < 1 << 20, "{l:?} never failed");
    }
}

/// A failed allocation says why: the chunk table full with most of the arena free, the arena used
/// up, a request larger than the arena, small requests through the thread cache and the lock.
#[test]
fn a_failed_allocation_says_why() {
    // Each 64 KiB-aligned block takes two records (the block and the padding before it).
    let a = GlobalBfc::with_config(HostConfig {
        chunk_capacity: 16,
        ..*small(false).config()
    });
    assert_eq!(a.last_failure(), None);
    let l = Layout::from_size_align(100_000, 8).unwrap();
    let got = until_null(&a, l);
    let failure = a.last_failure().unwrap();
    assert_eq!(
        failure,
        AllocFailure {
            size: 100_000,
            align: 8,
            cause: FailureCause::ChunkTableFull
        }
    );
    assert!(a.stats().largest_free_block > 32 << 20, "{}", a.stats());
    let text = failure.to_string();
    assert!(
        text.contains("100000 B") && text.contains("chunk_capacity"),
        "{text}"
    );
    for p in got {
        gfree(&a, p, l);
    }

    for thread_cache in [false, true] {
        let a = small(thread_cache);
        let big = Layout::from_size_align(4 << 20, 8).unwrap();
        let got = until_null(&a, big);
        assert_eq!(
            a.last_failure(),
            Some(AllocFailure {
                size: 4 << 20,
                align: 8,
                cause: FailureCause::ArenaFull
            })
        );
        // Small blocks fill what is left (the thread cache's refills, or the lock's path).
        let tiny = Layout::from_size_align(40, 8).unwrap();
        let smalls = until_null(&a, tiny);
        assert_eq!(
            a.last_failure(),
            Some(AllocFailure {
                size: 40,
                align: 8,
                cause: FailureCause::ArenaFull
            })
        );
        // The caller's layout, not its size class's.
        let aligned = Layout::from_size_align(100, 64).unwrap();
        // SAFETY: a non-zero size.
        assert!(unsafe { a.alloc(aligned) }.is_null());
        assert_eq!(
            a.last_failure(),
            Some(AllocFailure {
                size: 100,
                align: 64,
                cause: FailureCause::ArenaFull
            })
        );
        // A request larger than the arena can never fit.
        let huge = Layout::from_size_align(1 << 30, 8).unwrap();
        // SAFETY: a non-zero size.
        assert!(unsafe { a.alloc(huge) }.is_null());
        assert_eq!(
            a.last_failure(),
            Some(AllocFailure {
                size: 1 << 30,
                align: 8,
                cause: FailureCause::NeverFits
            })
        );
        // A success leaves the last failure as it was.
        for p in smalls {
            gfree(&a, p, tiny);
        }
        for p in got {
            gfree(&a, p, big);
        }
        // SAFETY: a non-zero size; freed at once with the same layout.
        unsafe { gfree(&a, a.alloc(big), big) };
        assert_eq!(a.last_failure().unwrap().cause, FailureCause::NeverFits);
        a.check().unwrap();
    }
}

/// `release_free_memory` returns the bytes it gave back: a free 512 KiB block between two live
/// ones (kept touched until a sweep or a release) counts in full, and a second call finds nothing.
#[test]
fn release_free_memory_counts_what_it_gives_back() {
    for thread_cache in [false, true] {
        let a = small(thread_cache);
        let big = Layout::from_size_align(512 << 10, 8).unwrap();
        let guard = Layout::from_size_align(64 << 10, 8).unwrap();
        // SAFETY: non-zero sizes; each block is written within its size and freed once with it.
        unsafe {
            let p = a.alloc(big);
            let g = a.alloc(guard);
            assert!(!p.is_null() && !g.is_null());
            p.write_bytes(1, 512 << 10);
            g.write_bytes(1, 64 << 10);
            gfree(&a, p, big);
            let covered = a.release_free_memory();
            assert!(covered >= 512 << 10, "{covered} bytes given back");
            assert_eq!(a.release_free_memory(), 0);
            gfree(&a, g, guard);
        }
        a.check().unwrap();
    }
}

/// An empty heap that refuses an alignment says that the request can never fit (not that the arena
/// is full): 2^39 bytes is far beyond where a 64 MiB arena can hold an aligned address, but for an
/// arena placed on such a boundary.
#[test]
fn an_alignment_the_arena_cannot_hold_never_fits() {
    for thread_cache in [false, true] {
        let a = small(thread_cache);
        for l in [
            Layout::from_size_align(16, 1 << 39).unwrap(),
            Layout::from_size_align(1 << 20, 1 << 39).unwrap(),
        ] {
            // SAFETY: a non-zero size; freed with its layout if it was served.
            let p = unsafe { a.alloc(l) };
            if p.is_null() {
                assert_eq!(
                    a.last_failure(),
                    Some(AllocFailure {
                        size: l.size(),
                        align: l.align(),
                        cause: FailureCause::NeverFits
                    })
                );
            } else {
                assert_eq!(p as usize % l.align(), 0);
                gfree(&a, p, l);
            }
        }
        assert_eq!(a.stats().bytes_in_use, 0);
    }
}

/// A `realloc` that succeeds (after the allocation of a new block failed, by growing in place into
/// room that failure's reclaim made) leaves the last failure as it was: an empty span after the
/// block goes back to the engine only when memory runs out.
#[test]
fn a_realloc_that_succeeds_notes_no_failure() {
    let a = small(false);
    let mib = Layout::from_size_align(1 << 20, 8).unwrap();
    let tiny = Layout::from_size_align(40, 8).unwrap();
    // SAFETY: non-zero sizes; each block is freed once with its current layout.
    unsafe {
        let p = a.alloc(mib);
        // A span of small blocks right after `p`.
        let s = a.alloc(tiny);
        assert!(!p.is_null() && !s.is_null());
        assert!(s as usize >= p as usize + (1 << 20));
        // The rest of the arena, in blocks of decreasing size.
        let mut fill = Vec::new();
        // (The smallest engine block: 16 KiB is the slab limit.)
        for size in [1 << 20, 64 << 10, (16 << 10) + 16] {
            let l = Layout::from_size_align(size, 8).unwrap();
            fill.extend(until_null(&a, l).into_iter().map(|q| (q, l)));
        }
        let before = a.last_failure();
        assert_eq!(before.map(|f| f.cause), Some(FailureCause::ArenaFull));
        // The span is empty now, but kept for reuse until memory runs out.
        gfree(&a, s, tiny);
        let grown = (1 << 20) + (32 << 10);
        let q = a.realloc(p, mib, grown);
        assert_eq!(q, p, "the realloc did not grow in place");
        assert_eq!(a.last_failure(), before);
        gfree(&a, q, Layout::from_size_align(grown, 8).unwrap());
        for (q, l) in fill {
            gfree(&a, q, l);
        }
    }
    a.check().unwrap();
    assert_eq!(a.stats().bytes_in_use, 0);
}
