//! A private `GlobalBfc` (the global allocator here is the system's, so nothing else binds the test
//! threads' caches first): a thread's cache serves the instance and goes back when the thread exits.

use std::alloc::{GlobalAlloc, Layout};
use std::hint::black_box;

use bfc_alloc::{GlobalBfc, HostConfig};

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
    let config = HostConfig {
        arena_size: 256 << 20,
        min_arena_size: 256 << 20,
        ..HostConfig::DEFAULT
    };
    let l = Layout::from_size_align(48, 8).unwrap();
    std::thread::spawn(move || {
        let use_small = |a: &GlobalBfc| {
            let mut blocks = [0usize; 10];
            for b in blocks.iter_mut() {
                // SAFETY: a valid layout.
                *b = unsafe { black_box(a.alloc(l)) } as usize;
            }
            for &p in &blocks {
                // SAFETY: allocated above with `l`, freed once.
                unsafe { a.dealloc(p as *mut u8, l) };
            }
        };
        let first = Box::new(GlobalBfc::with_config(config));
        use_small(&first);
        assert!(
            first.thread_cache_bytes() > 0,
            "the cache binds to the first instance"
        );
        drop(first); // orphans the cache; its blocks went with the arena
        let second = Box::new(GlobalBfc::with_config(config));
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
