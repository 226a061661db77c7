//! A private `GlobalBfc` (the global allocator here is the system's, so nothing else binds the test
//! threads' caches first): a thread's cache serves the instance and goes back when the thread exits.

use std::alloc::{GlobalAlloc, Layout};
use std::hint::black_box;

use bfc_alloc::{GlobalBfc, HostConfig};

/// A private instance's settings for the tests that make several (a 256 MiB arena each).
const SMALL_ARENA: HostConfig = HostConfig {
    arena_size: 256 << 20,
    min_arena_size: 256 << 20,
    ..HostConfig::DEFAULT
};

/// Allocates ten 48-byte blocks from `a` and frees them: they end up in this thread's cache.
fn use_small(a: &GlobalBfc) {
    let l = Layout::from_size_align(48, 8).unwrap();
    let mut blocks = [0usize; 10];
    for b in blocks.iter_mut() {
        // SAFETY: a valid layout.
        *b = unsafe { black_box(a.alloc(l)) } as usize;
    }
    for &p in &blocks {
        // SAFETY: allocated above with `l`, freed once.
        unsafe { a.dealloc(p as *mut u8, l) };
    }
}

#[test]
fn a_threads_cache_goes_back_when_it_exits() {
    static LOCAL: GlobalBfc = GlobalBfc::with_config(HostConfig {
        arena_size: 1 << 30,
        ..HostConfig::DEFAULT
    });
    let l = Layout::from_size_align(64, 8).unwrap();
    std::thread::spawn(move || {
        // No global-allocator traffic on this thread before `LOCAL`'s first small allocation, so
        // the thread's cache binds to `LOCAL`.
        let mut blocks = [0usize; 100];
        for b in blocks.iter_mut() {
            // SAFETY: a valid layout.
            *b = unsafe { black_box(LOCAL.alloc(l)) } as usize;
        }
        for &p in &blocks {
            // SAFETY: allocated above with `l`, freed once.
            unsafe { LOCAL.dealloc(p as *mut u8, l) };
        }
        let s = LOCAL.stats();
        assert_eq!(s.bytes_in_use, 0, "cached blocks are not in use: {s:?}");
        assert!(s.bytes_cached >= 8 * 64, "{s:?}");
        // Cached: this thread's cache, plus what it gave to the heap's transfer cache.
        assert!(LOCAL.thread_cache_bytes() <= s.bytes_cached);
        LOCAL.check().unwrap();
    })
    .join()
    .unwrap();
    let s = LOCAL.stats();
    assert_eq!(
        (s.bytes_in_use, s.bytes_cached, s.num_cached_chunks),
        (0, 0, 0),
        "{s:?}"
    );
    LOCAL.check().unwrap();
}

#[test]
fn dropping_an_instance_frees_the_threads_cache_for_the_next() {
    std::thread::spawn(move || {
        let first = Box::new(GlobalBfc::with_config(SMALL_ARENA));
        use_small(&first);
        assert!(
            first.thread_cache_bytes() > 0,
            "the cache binds to the first instance"
        );
        drop(first); // orphans the cache; its blocks went with the arena
        let second = Box::new(GlobalBfc::with_config(SMALL_ARENA));
        use_small(&second);
        assert!(
            second.thread_cache_bytes() > 0,
            "the orphaned cache rebinds"
        );
        assert_eq!(second.stats().bytes_in_use, 0);
        second.check().unwrap();
        drop(second); // the thread then exits with an orphaned cache: its flush skips it
    })
    .join()
    .unwrap();
}

#[test]
fn a_thread_exiting_after_its_allocator_moved_flushes_into_the_moved_heap() {
    use std::sync::mpsc::channel;
    let a = GlobalBfc::with_config(HostConfig {
        arena_size: 256 << 20,
        min_arena_size: 256 << 20,
        ..HostConfig::DEFAULT
    });
    let l = Layout::from_size_align(48, 8).unwrap();
    let (used_tx, used_rx) = channel::<()>();
    let (exit_tx, exit_rx) = channel::<()>();
    let at = &a as *const GlobalBfc as usize;
    let t = std::thread::spawn(move || {
        // SAFETY: `a` stays at `at`, unused by anyone else, until this thread signals `used`.
        let a = unsafe { &*(at as *const GlobalBfc) };
        let mut blocks = [0usize; 10];
        for b in blocks.iter_mut() {
            // SAFETY: a valid layout.
            *b = unsafe { black_box(a.alloc(l)) } as usize;
        }
        for &p in &blocks {
            // SAFETY: allocated above with `l`, freed once.
            unsafe { a.dealloc(p as *mut u8, l) };
        }
        assert!(
            a.thread_cache_bytes() > 0,
            "the cache binds to the instance"
        );
        used_tx.send(()).unwrap();
        exit_rx.recv().unwrap(); // the thread-exit flush runs after `a` moved
    });
    used_rx.recv().unwrap();
    let moved = Box::new(a); // `a` moves while the thread's cache is still bound to it
    exit_tx.send(()).unwrap();
    t.join().unwrap();
    let s = moved.stats();
    assert_eq!((s.bytes_in_use, s.bytes_cached), (0, 0), "{s:?}");
    moved.check().unwrap();
}

/// Filling a small arena through the thread cache: the refill that meets out-of-memory keeps the
/// blocks it already took, no block is handed out twice, and once everything is freed the same
/// number of blocks fits again.
#[test]
fn refills_that_run_out_of_memory_lose_nothing() {
    std::thread::spawn(|| {
        // Miri: the 16-byte fill (over 100,000 blocks) would take hours there.
        let sizes: &[usize] = if cfg!(miri) {
            &[4096, 3000, 1024]
        } else {
            &[4096, 3000, 1024, 16]
        };
        for &size in sizes {
            // A fresh instance per size: this thread's cache binds to the first one and, once it
            // is dropped, to the next.
            let a = GlobalBfc::with_config(HostConfig {
                arena_size: 2 << 20,
                min_arena_size: 2 << 20,
                ..HostConfig::DEFAULT
            });
            let l = Layout::from_size_align(size, 8).unwrap();
            let fill = |a: &GlobalBfc| {
                let mut got = Vec::new();
                loop {
                    // SAFETY: a valid layout.
                    let p = unsafe { a.alloc(l) };
                    if p.is_null() {
                        break;
                    }
                    got.push(p as usize);
                }
                let mut sorted = got.clone();
                sorted.sort_unstable();
                for w in sorted.windows(2) {
                    assert!(w[0] + size <= w[1], "{size} B blocks {w:x?} overlap");
                }
                a.check().unwrap();
                got
            };
            let first = fill(&a);
            assert!(first.len() > 16, "{size} B: only {} blocks", first.len());
            assert_eq!(a.thread_cache_bytes(), 0, "{size} B: blocks cached at OOM");
            for &p in first.iter().rev() {
                // SAFETY: allocated above with `l`, freed once.
                unsafe { a.dealloc(p as *mut u8, l) };
            }
            a.flush_thread_cache();
            let s = a.stats();
            assert_eq!((s.bytes_in_use, s.bytes_cached), (0, 0), "{size} B: {s:?}");
            let second = fill(&a);
            assert_eq!(second.len(), first.len(), "{size} B: blocks lost");
            for &p in &second {
                // SAFETY: as above.
                unsafe { a.dealloc(p as *mut u8, l) };
            }
            a.flush_thread_cache();
            a.check().unwrap();
        }
    })
    .join()
    .unwrap();
}

#[test]
fn stats_count_every_cached_block_and_a_release_drains_the_transfer_cache() {
    static LOCAL: GlobalBfc = GlobalBfc::with_config(HostConfig {
        arena_size: 1 << 30,
        ..HostConfig::DEFAULT
    });
    let l = Layout::from_size_align(64, 8).unwrap();
    let (to_main, from_worker) = std::sync::mpsc::channel();
    let (to_worker, from_main) = std::sync::mpsc::channel::<()>();
    let worker = std::thread::spawn(move || {
        let mut blocks = [0usize; 300];
        for b in blocks.iter_mut() {
            // SAFETY: a valid layout.
            *b = unsafe { black_box(LOCAL.alloc(l)) } as usize;
        }
        let s = LOCAL.stats();
        assert_eq!(
            (s.bytes_in_use, s.num_chunks_in_use),
            (300 * 64, 300),
            "{s:?}"
        );
        assert!(s.peak_bytes_in_use >= 300 * 64, "{s:?}");
        for &p in &blocks {
            // SAFETY: allocated above with `l`, freed once.
            unsafe { LOCAL.dealloc(p as *mut u8, l) };
        }
        let s = LOCAL.stats();
        assert_eq!((s.bytes_in_use, s.num_chunks_in_use), (0, 0), "{s:?}");
        assert_eq!(s.bytes_cached, 64 * s.num_cached_chunks, "{s:?}");
        let mine = LOCAL.thread_cache_bytes();
        assert!(
            s.bytes_cached > mine,
            "300 frees overflow the stack into the transfer cache: {s:?}"
        );
        to_main.send(mine).unwrap();
        // Stay alive, cache unflushed, while the main thread releases memory.
        let _ = from_main.recv();
    });
    let Ok(mine) = from_worker.recv() else {
        worker.join().unwrap();
        unreachable!("the worker failed without panicking");
    };
    // This thread's cache does not serve `LOCAL`: the release drains the transfer cache itself.
    LOCAL.release_free_memory();
    let s = LOCAL.stats();
    assert_eq!(s.bytes_cached, mine, "{s:?}");
    to_worker.send(()).unwrap();
    worker.join().unwrap();
    let s = LOCAL.stats();
    assert_eq!(
        (
            s.bytes_in_use,
            s.bytes_cached,
            s.num_cached_chunks,
            s.num_chunks_in_use
        ),
        (0, 0, 0, 0),
        "{s:?}"
    );
    LOCAL.check().unwrap();
}

/// A thread's cache that served an instance which was dropped, then serves another, is no longer
/// orphaned: at the thread's exit it flushes into the second instance (nothing leaks) and leaves
/// the registry.
#[test]
fn a_cache_rebound_after_its_instance_dropped_flushes_at_exit() {
    let second = GlobalBfc::with_config(SMALL_ARENA);
    // Joined inside the scope: `join` returns once the thread exited, its cache's exit flush
    // included.
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                let first = Box::new(GlobalBfc::with_config(SMALL_ARENA));
                use_small(&first);
                drop(first);
                use_small(&second);
                assert!(second.thread_cache_bytes() > 0);
            })
            .join()
            .unwrap();
    });
    let s = second.stats();
    assert_eq!((s.bytes_in_use, s.bytes_cached), (0, 0), "{s:?}");
    second.check().unwrap();
}

/// Whether allocating one `l` block from `a` on this thread refilled the thread's cache (the
/// class's stack was empty) rather than taking a cached block. Returns the block too.
fn alloc_refilled(a: &GlobalBfc, l: Layout) -> (bool, usize) {
    let before = a.thread_cache_bytes();
    // SAFETY: a valid layout.
    let p = unsafe { black_box(a.alloc(l)) } as usize;
    assert_ne!(p, 0);
    let after = a.thread_cache_bytes();
    // A cached block leaves the cache; a refill adds a batch of blocks to it.
    assert!(
        after == before - l.size() || after > before,
        "{before} -> {after}"
    );
    (after > before, p)
}

#[test]
fn a_class_the_thread_stopped_using_drains_from_its_cache() {
    std::thread::spawn(move || {
        let a = Box::new(GlobalBfc::with_config(SMALL_ARENA));
        let stale = Layout::from_size_align(4096, 8).unwrap();
        let busy = Layout::from_size_align(3584, 8).unwrap();
        // Eight blocks of the 4 KiB class: one refill, and after the frees its stack holds nine
        // blocks (no flush).
        let mut blocks = [0usize; 8];
        for b in blocks.iter_mut() {
            // SAFETY: a valid layout.
            *b = unsafe { black_box(a.alloc(stale)) } as usize;
        }
        for &p in &blocks {
            // SAFETY: allocated above with `stale`, freed once.
            unsafe { a.dealloc(p as *mut u8, stale) };
        }
        let held = a.thread_cache_bytes();
        assert_eq!(held, 9 * 4096);
        // Seventeen allocations and frees of another class (16 blocks a stack) take at least one
        // refill and one flush each round: 768 rounds make at least six decay periods, in which
        // the 4 KiB class has no refill or flush and halves its stack in each: 9, 4, 2, 1, 0.
        let mut busy_blocks = [0usize; 17];
        for round in 0..768 {
            for b in busy_blocks.iter_mut() {
                // SAFETY: a valid layout.
                *b = unsafe { black_box(a.alloc(busy)) } as usize;
            }
            for &p in &busy_blocks {
                // SAFETY: allocated above with `busy`, freed once.
                unsafe { a.dealloc(p as *mut u8, busy) };
            }
            if round == 0 {
                // Not yet: the first period has not ended.
                let (refilled, p) = alloc_refilled(&a, stale);
                assert!(!refilled, "the 4 KiB class still had cached blocks");
                // SAFETY: allocated just above with `stale`, freed once.
                unsafe { a.dealloc(p as *mut u8, stale) };
            }
        }
        let (refilled, p) = alloc_refilled(&a, stale);
        assert!(
            refilled,
            "the 4 KiB class's stack should have drained: {} B cached",
            a.thread_cache_bytes()
        );
        a.check().unwrap();
        // SAFETY: allocated above with `stale`, freed once.
        unsafe { a.dealloc(p as *mut u8, stale) };
        // The drained blocks went back to the slab layer: none is in use, none lost.
        let s = a.stats();
        assert_eq!(s.bytes_in_use, 0, "{s:?}");
        assert!(a.flush_thread_cache() > 0);
        a.release_free_memory();
        let s = a.stats();
        assert_eq!((s.bytes_in_use, s.bytes_cached), (0, 0), "{s:?}");
        a.check().unwrap();
    })
    .join()
    .unwrap();
}

/// A private instance with a 4 MiB arena: a 4 MiB block needs all of it.
fn four_mib_arena(thread_cache: bool) -> GlobalBfc {
    GlobalBfc::with_config(HostConfig {
        arena_size: 4 << 20,
        min_arena_size: 4 << 20,
        thread_cache,
        ..HostConfig::DEFAULT
    })
}

/// Allocates a block of the whole 4 MiB arena of `a`, writes its ends and frees it; whether it fit.
fn whole_arena_fits(a: &GlobalBfc) -> bool {
    let l = Layout::from_size_align(4 << 20, 8).unwrap();
    // SAFETY: a valid layout; the block is written within its size and freed once with it.
    unsafe {
        let p = a.alloc(l);
        if p.is_null() {
            return false;
        }
        p.write(1);
        p.add(l.size() - 1).write(2);
        a.dealloc(p, l);
    }
    true
}

/// Allocates `n` blocks of each size in `sizes` from `a`, then frees them all.
fn small_round_trip(a: &GlobalBfc, sizes: &[usize], n: usize) {
    let mut live = Vec::new();
    for &size in sizes {
        let l = Layout::from_size_align(size, 8).unwrap();
        for _ in 0..n {
            // SAFETY: a valid layout.
            let p = unsafe { black_box(a.alloc(l)) };
            assert!(!p.is_null(), "{size} B");
            live.push((p, l));
        }
    }
    for (p, l) in live {
        // SAFETY: allocated above with `l`, freed once.
        unsafe { a.dealloc(p, l) };
    }
}

/// Each class keeps its current span when its last object is freed. An allocation that does not
/// fit otherwise takes those empty spans back first.
#[test]
fn an_allocation_that_needs_the_room_takes_back_empty_current_spans() {
    let a = four_mib_arena(false);
    small_round_trip(&a, &[16, 48, 1000, 4096], 3);
    assert!(whole_arena_fits(&a), "the empty spans were not taken back");
    a.check().unwrap();
    // The classes work again afterwards.
    small_round_trip(&a, &[16, 48, 1000, 4096], 3);
    a.check().unwrap();
}

/// A `realloc` that cannot grow in place because an empty span stands after the block, and cannot
/// move because nothing else is big enough, takes the span back and grows in place.
#[test]
fn a_realloc_that_finds_no_room_takes_back_empty_spans_and_grows_in_place() {
    let a = four_mib_arena(false);
    let big = Layout::from_size_align(2 << 20, 8).unwrap();
    let small = Layout::from_size_align(16, 8).unwrap();
    // SAFETY: valid layouts; each block is written within its size and freed once with its layout.
    unsafe {
        let p = a.alloc(big);
        assert!(!p.is_null());
        p.write(7);
        p.add(big.size() - 1).write(9);
        // A 16-byte block's span comes right after `p`, and stays there, empty, as its class's
        // current span.
        let q = a.alloc(small);
        assert!(!q.is_null());
        assert!(q as usize > p as usize);
        a.dealloc(q, small);
        let grown = a.realloc(p, big, 3 << 20);
        assert!(!grown.is_null(), "realloc failed with room to spare");
        assert_eq!(grown, p, "grew in place");
        assert_eq!((grown.read(), grown.add(big.size() - 1).read()), (7, 9));
        grown.add((3 << 20) - 1).write(1);
        a.dealloc(grown, Layout::from_size_align(3 << 20, 8).unwrap());
    }
    assert_eq!(a.stats().bytes_in_use, 0);
    a.check().unwrap();
    assert!(whole_arena_fits(&a));
}

/// Blocks in the allocating thread's own cache (and the transfer cache) go back before an
/// allocation fails.
#[test]
fn an_allocation_that_needs_the_room_flushes_the_threads_own_cache() {
    std::thread::spawn(|| {
        let a = four_mib_arena(true);
        // Enough 64-byte blocks that a full stack moves to the transfer cache too.
        small_round_trip(&a, &[16, 64, 1000, 4096], 300);
        let s = a.stats();
        assert!(a.thread_cache_bytes() > 0, "{s:?}");
        assert!(
            s.bytes_cached > a.thread_cache_bytes(),
            "transfer cache empty: {s:?}"
        );
        // A request larger than the arena can never fit: it fails without emptying the caches.
        let cached = a.thread_cache_bytes();
        // SAFETY: a valid layout.
        let p = unsafe { a.alloc(Layout::from_size_align(8 << 20, 8).unwrap()) };
        assert!(p.is_null());
        assert_eq!(a.thread_cache_bytes(), cached);
        // Nor can a request aligned beyond what the engine serves.
        let huge_align = bfc_alloc::core::MAX_ALIGN << 1;
        // SAFETY: a valid layout.
        let p = unsafe { a.alloc(Layout::from_size_align(16, huge_align).unwrap()) };
        assert!(p.is_null());
        assert_eq!(a.thread_cache_bytes(), cached);
        assert!(
            whole_arena_fits(&a),
            "the cached blocks were not taken back"
        );
        let s = a.stats();
        assert_eq!((s.bytes_in_use, s.bytes_cached), (0, 0), "{s:?}");
        a.check().unwrap();
        small_round_trip(&a, &[16, 64, 1000, 4096], 300);
        a.check().unwrap();
    })
    .join()
    .unwrap();
}

/// Another thread's cache is its own (its fast paths take no lock): the blocks in it stay there
/// until that thread flushes or exits, and an allocation that needs their room fails meanwhile.
#[test]
fn blocks_in_another_threads_cache_wait_for_that_thread() {
    use std::sync::mpsc::channel;
    let a = four_mib_arena(true);
    let (cached_tx, cached_rx) = channel::<()>();
    let (flush_tx, flush_rx) = channel::<()>();
    let (flushed_tx, flushed_rx) = channel::<()>();
    std::thread::scope(|s| {
        let a = &a;
        s.spawn(move || {
            small_round_trip(a, &[48], 10);
            assert!(a.thread_cache_bytes() > 0);
            cached_tx.send(()).unwrap();
            flush_rx.recv().unwrap();
            a.flush_thread_cache();
            flushed_tx.send(()).unwrap();
            // The thread stays alive until the scope ends: its exit is not what frees the room.
            flush_rx.recv().unwrap_err();
        });
        cached_rx.recv().unwrap();
        assert!(
            !whole_arena_fits(a),
            "another thread's cached blocks were taken"
        );
        flush_tx.send(()).unwrap();
        flushed_rx.recv().unwrap();
        assert!(
            whole_arena_fits(a),
            "the flushed blocks' span was not taken back"
        );
        a.check().unwrap();
        drop(flush_tx);
    });
}

/// A thread's refill takes the blocks another thread's full cache gave to the transfer cache
/// before it cuts new ones from the slab layer: the refill moves cached blocks (the bytes cached
/// fall by the one handed out) instead of adding a batch of fresh ones.
#[test]
fn a_refill_takes_its_batch_from_the_transfer_cache() {
    let a = four_mib_arena(true);
    let l = Layout::from_size_align(64, 8).unwrap();
    // SAFETY: a valid layout; each block is freed once with it.
    let freed: Vec<usize> = (0..300).map(|_| unsafe { a.alloc(l) } as usize).collect();
    assert!(freed.iter().all(|&p| p != 0));
    for &p in &freed {
        // SAFETY: allocated above with `l`, freed once.
        unsafe { a.dealloc(p as *mut u8, l) };
    }
    let mine = a.thread_cache_bytes();
    let before = a.stats().bytes_cached;
    assert!(
        before > mine,
        "no block reached the transfer cache: {before} cached, {mine} in this thread's"
    );
    let (p, during) = std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: a valid layout; freed once with it, below.
            let p = unsafe { a.alloc(l) };
            let during = a.stats().bytes_cached;
            // SAFETY: allocated above with `l`.
            unsafe { a.dealloc(p, l) };
            (p as usize, during)
        })
        .join()
        .unwrap()
    });
    assert!(
        freed.contains(&p),
        "{p:#x} is not a block the transfer cache held"
    );
    assert_eq!(during, before - 64, "the refill did not move cached blocks");
    a.check().unwrap();
}

/// A thread whose cache serves another instance allocates under the lock. When the arena is full
/// and its class has no room in the slab layer, the blocks other threads gave to the transfer cache
/// are what is left: the allocation gets one of them.
#[test]
#[cfg_attr(
    miri,
    ignore = "fills a 4 MiB arena with 48-byte blocks: over half an hour under Miri"
)]
fn an_allocation_under_the_lock_gets_a_block_from_the_transfer_cache() {
    use std::sync::mpsc::channel;
    let a = four_mib_arena(true);
    let l = Layout::from_size_align(48, 8).unwrap();
    let (freed_tx, freed_rx) = channel::<Vec<usize>>();
    let (done_tx, done_rx) = channel::<()>();
    std::thread::scope(|s| {
        // Owned here, so a failed assertion drops it and the other thread ends.
        let done_tx = done_tx;
        let a = &a;
        s.spawn(move || {
            let mut got = Vec::new();
            loop {
                // SAFETY: a valid layout.
                let p = unsafe { a.alloc(l) };
                if p.is_null() {
                    break;
                }
                got.push(p as usize);
            }
            // A few stacks' worth: the cache passes some to the transfer cache, none to the slab.
            let freed = got.split_off(got.len() - 150);
            for &p in &freed {
                // SAFETY: allocated above with `l`, freed once.
                unsafe { a.dealloc(p as *mut u8, l) };
            }
            let st = a.stats();
            assert_eq!(
                st.bytes_in_use + st.bytes_cached,
                (got.len() + freed.len()) * 48,
                "a freed block reached the slab layer: {st:?}"
            );
            assert!(st.bytes_cached > a.thread_cache_bytes(), "{st:?}");
            freed_tx.send(freed).unwrap();
            // Alive (its cache holding blocks) until the other thread's allocation is done (or
            // failed: the sender is dropped).
            let _ = done_rx.recv();
            for &p in &got {
                // SAFETY: as above.
                unsafe { a.dealloc(p as *mut u8, l) };
            }
        });
        let freed = freed_rx.recv().unwrap();
        // This thread's cache serves `b`, so `a` is used under its lock.
        let b = four_mib_arena(true);
        use_small(&b);
        // SAFETY: a valid layout; the block is freed once with it.
        unsafe {
            let p = a.alloc(l);
            assert!(
                !p.is_null(),
                "no block although the transfer cache held some"
            );
            assert!(freed.contains(&(p as usize)), "{p:p} is not a freed block");
            a.dealloc(p, l);
        }
        a.check().unwrap();
        done_tx.send(()).unwrap();
    });
    a.check().unwrap();
}
