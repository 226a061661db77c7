//! Loom models of the shipped locking: the spinlock, the lazy arena initialisation, and the stats,
//! all through `GlobalBfc` itself (its lock and atomics come from the crate's sync shim, which under
//! `--cfg loom` re-exports loom's types).
//!
//! Models stay at two threads: with a third, spinning waiters multiply loom's schedules past what a
//! CI run can afford. Run (release, bounded), as `.ci/test-all.sh` does:
//! `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=3 cargo test --release --features cuda --test loom -- --test-threads=1`
#![cfg(loom)]

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::Ordering;

use bfc_alloc::{GlobalBfc, HostConfig};
use loom::sync::Arc;
use loom::thread;

/// A small arena so each model iteration maps little.
fn allocator() -> GlobalBfc {
    GlobalBfc::with_config(HostConfig {
        arena_size: 2 << 20,
        min_arena_size: 2 << 20,
        chunk_capacity: 256,
        ..HostConfig::DEFAULT
    })
}

/// Allocates `size` bytes, fills them with `tag`, and returns the block.
fn alloc_tagged(a: &GlobalBfc, size: usize, tag: u8) -> (usize, Layout) {
    let l = Layout::from_size_align(size, 16).unwrap();
    // SAFETY: a valid non-zero layout.
    let p = unsafe { a.alloc(l) };
    assert!(!p.is_null());
    // SAFETY: the block holds `size` bytes and is ours.
    unsafe { p.write_bytes(tag, size) };
    (p as usize, l)
}

fn assert_tagged(block: (usize, Layout), tag: u8) {
    let (p, l) = block;
    // SAFETY: the block is live and ours.
    let bytes = unsafe { std::slice::from_raw_parts(p as *const u8, l.size()) };
    assert!(
        bytes.iter().all(|&b| b == tag),
        "block {p:#x} was overwritten: blocks overlap"
    );
}

fn free(a: &GlobalBfc, block: (usize, Layout)) {
    // SAFETY: the block came from `a` with this layout and is freed once.
    unsafe { a.dealloc(block.0 as *mut u8, block.1) };
}

/// Model 1: two threads allocating and freeing through the locked allocator (small blocks through the
/// slab layer and larger ones through the engine): no two live blocks overlap, and the invariant
/// checker passes at the end.
#[test]
fn concurrent_alloc_free_never_overlaps() {
    loom::model(|| {
        let a = Arc::new(allocator());
        let handles: Vec<_> = (0..2u8)
            .map(|t| {
                let a = a.clone();
                thread::spawn(move || {
                    let small = alloc_tagged(&a, 48, t + 1);
                    let large = alloc_tagged(&a, 8192, t + 11);
                    assert_tagged(small, t + 1);
                    free(&a, small);
                    assert_tagged(large, t + 11);
                    large
                })
            })
            .collect();
        let kept: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        for (t, &b) in kept.iter().enumerate() {
            assert_tagged(b, t as u8 + 11);
        }
        a.check().expect("heap invariants");
        for b in kept {
            free(&a, b);
        }
        assert_eq!(a.stats().bytes_in_use, 0);
        a.check().expect("heap invariants");
    });
}

/// Model 2: two threads race the first allocation: the arena is initialised exactly once and both
/// get valid, distinct blocks.
#[test]
fn lazy_initialisation_happens_once() {
    loom::model(|| {
        let a = Arc::new(allocator());
        let handles: Vec<_> = (0..2u8)
            .map(|t| {
                let a = a.clone();
                thread::spawn(move || alloc_tagged(&a, 100, t + 1))
            })
            .collect();
        let blocks: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(a.initialisations(), 1);
        assert_ne!(blocks[0].0, blocks[1].0);
        assert_tagged(blocks[0], 1);
        assert_tagged(blocks[1], 2);
        for b in blocks {
            free(&a, b);
        }
        a.check().expect("heap invariants");
    });
}

/// Model 3: a reader's stats snapshot is always consistent with a prefix of the writer's work:
/// bytes in use is 0, the first block, or both blocks, never a torn or impossible value.
#[test]
fn stats_stay_consistent_with_live_blocks() {
    loom::model(|| {
        let a = Arc::new(allocator());
        let writer = {
            let a = a.clone();
            thread::spawn(move || {
                let first = alloc_tagged(&a, 64, 1);
                let second = alloc_tagged(&a, 8192, 2);
                (first, second)
            })
        };
        let s = a.stats();
        assert!(s.bytes_in_use <= s.peak_bytes_in_use);
        let (first, second) = writer.join().unwrap();
        let s1 = a.usable_size(first.0 as *const u8).unwrap();
        let s2 = a.usable_size(second.0 as *const u8).unwrap();
        assert!(
            [0, s1, s1 + s2].contains(&s.bytes_in_use),
            "stats saw {} bytes in use; the writer's blocks are {s1} then {s2}",
            s.bytes_in_use
        );
        assert!(s.num_allocs <= 2 && (s.num_allocs == 0) == (s.bytes_in_use == 0));
        let after = a.stats();
        assert_eq!((after.bytes_in_use, after.num_allocs), (s1 + s2, 2));
        free(&a, first);
        free(&a, second);
        assert_eq!(a.stats().bytes_in_use, 0);
        a.check().expect("heap invariants");
    });
}

/// Negative control: with the lock's acquire ordering weakened to `Relaxed`, loom must find the data
/// race on the heap state. Proves the models above can fail.
#[test]
#[should_panic(expected = "Causality violation")]
fn broken_lock_ordering_is_caught() {
    struct Restore;
    impl Drop for Restore {
        fn drop(&mut self) {
            bfc_alloc::lock::LOOM_BREAK_ACQUIRE.store(false, Ordering::Relaxed);
        }
    }
    let _restore = Restore;
    bfc_alloc::lock::LOOM_BREAK_ACQUIRE.store(true, Ordering::Relaxed);
    loom::model(|| {
        let a = Arc::new(allocator());
        // Initialise outside the race so the threads only contend on the lock.
        let first = alloc_tagged(&a, 32, 9);
        let handles: Vec<_> = (0..2u8)
            .map(|t| {
                let a = a.clone();
                thread::spawn(move || {
                    let b = alloc_tagged(&a, 32, t + 1);
                    free(&a, b);
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        free(&a, first);
    });
}

/// Model 4 (device pool, feature `cuda`): two threads allocate, free and reallocate buffers on their
/// own streams of one pool over the simulated device. The pool's state is behind the shim's mutex
/// (loom's here); blocks never overlap while live, the engine's invariants hold, and every block goes
/// back once the streams' work completes.
#[cfg(feature = "cuda")]
#[test]
fn device_pool_threads_on_two_streams() {
    use bfc_alloc::cuda::{DevicePool, PoolOptions, SimDevice, SimStream};

    loom::model(|| {
        let dev = SimDevice::new(1 << 30);
        let pool =
            DevicePool::with_backend(dev.backend(), PoolOptions::with_limit(64 << 20)).unwrap();
        let handles: Vec<_> = (1..=2u64)
            .map(|t| {
                let pool = pool.clone();
                thread::spawn(move || {
                    let s = SimStream(t);
                    // SAFETY: simulated device memory is never read.
                    let first = unsafe { pool.alloc::<u8>(&s, 4096) }.unwrap();
                    drop(first);
                    // SAFETY: as above.
                    let kept = unsafe { pool.alloc::<u8>(&s, 4096) }.unwrap();
                    (kept.device_address(), kept.block_size(), kept)
                })
            })
            .collect();
        let kept: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let (a, b) = (&kept[0], &kept[1]);
        assert!(
            a.0 + a.1 as u64 <= b.0 || b.0 + b.1 as u64 <= a.0,
            "live device blocks overlap"
        );
        pool.check().expect("pool invariants");
        drop(kept);
        dev.complete_all();
        pool.synchronize();
        assert_eq!(pool.stats().allocator.bytes_in_use, 0);
        pool.check().expect("pool invariants");
    });
}
