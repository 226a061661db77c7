//! Loom models of the shipped locking: the spinlock, the lazy arena initialisation, the stats, the
//! thread caches and the `fork` prepare step, all through `GlobalBfc` itself (its lock and atomics
//! come from the crate's sync shim, which under `--cfg loom` re-exports loom's types); and, with
//! feature `cuda`, the device pool (its lock and its stream caches) and the ordering of a buffer's
//! uses on other streams, over the simulated device.
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

/// Runs `model` with a negative-control switch set, and clears it afterwards, also when the model
/// panics (as the negative controls expect), so later models run unbroken.
fn with_switch(switch: &'static std::sync::atomic::AtomicBool, model: impl FnOnce()) {
    struct Clear(&'static std::sync::atomic::AtomicBool);
    impl Drop for Clear {
        fn drop(&mut self) {
            self.0.store(false, Ordering::Relaxed);
        }
    }
    let _clear = Clear(switch);
    switch.store(true, Ordering::Relaxed);
    model();
}

/// An allocator that a model drops in place and never deallocates, so a flush that came too late
/// would find the dropped state (and fail the model) rather than freed memory. Threads reach it
/// through [`Leaked::get`] only in scopes that end before it is dropped.
#[derive(Clone, Copy)]
struct Leaked(*mut GlobalBfc);

// SAFETY: `GlobalBfc` is `Sync`; the pointer is only turned into a shared reference (`get`), or
// dropped in place once no such reference is left (`drop_in_place`).
unsafe impl Send for Leaked {}

impl Leaked {
    fn new() -> Self {
        Leaked(Box::into_raw(Box::new(allocator())))
    }

    /// # Safety
    /// Not after [`Leaked::drop_in_place`].
    unsafe fn get<'a>(self) -> &'a GlobalBfc {
        // SAFETY: a live, leaked allocator (the caller does not outlive the drop).
        unsafe { &*self.0 }
    }

    /// # Safety
    /// Once, after every reference from [`Leaked::get`] is gone.
    unsafe fn drop_in_place(self) {
        // SAFETY: guaranteed by the caller; the memory stays allocated (leaked).
        unsafe { std::ptr::drop_in_place(self.0) }
    }
}

/// A block size above the slab layer's 16 KiB and the medium classes' 64 KiB: the engine serves
/// it under the lock, unless the thread met contention there (then it is an upper-class block,
/// which the thread's cache keeps when freed).
const ENGINE: usize = 68 << 10;
/// A medium block's size (a thread cache keeps such blocks when they are freed).
const MEDIUM: usize = 20 << 10;

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

/// Frees the remaining blocks; then nothing is in use and the invariants hold.
fn free_all_and_check(a: &GlobalBfc, blocks: impl IntoIterator<Item = (usize, Layout)>) {
    for b in blocks {
        free(a, b);
    }
    assert_eq!(a.stats().bytes_in_use, 0);
    a.check().expect("heap invariants");
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
                    let large = alloc_tagged(&a, ENGINE, t + 11);
                    assert_tagged(small, t + 1);
                    free(&a, small);
                    assert_tagged(large, t + 11);
                    bfc_alloc::host::loom_exit_thread();
                    large
                })
            })
            .collect();
        let kept: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        for (t, &b) in kept.iter().enumerate() {
            assert_tagged(b, t as u8 + 11);
        }
        a.check().expect("heap invariants");
        free_all_and_check(&a, kept);
    });
}

/// Model 1b: a medium block freed on another thread joins that thread's cache (which reads the
/// heap's medium table without the lock) while the allocating thread takes and frees another
/// medium block; the freeing thread's exit gives its block back to the engine. Nothing overlaps or
/// stays in use, and the invariant checker (which checks each cached block against the table and
/// the engine) passes. (The table's atomics are not loom's, like the span class table's: a free
/// reads the entry its block's allocation wrote, ordered by the handover of the block itself.)
#[test]
fn medium_blocks_freed_on_another_thread() {
    loom::model(|| {
        let a = Arc::new(allocator());
        let sent = alloc_tagged(&a, MEDIUM, 1);
        let other = {
            let a = a.clone();
            thread::spawn(move || {
                assert_tagged(sent, 1);
                free(&a, sent);
                assert_eq!(a.thread_cache_bytes(), 20 << 10, "not cached");
                a.check().expect("heap invariants");
                bfc_alloc::host::loom_exit_thread();
            })
        };
        let mine = alloc_tagged(&a, MEDIUM, 2);
        assert_tagged(mine, 2);
        free(&a, mine);
        other.join().unwrap();
        let s = a.stats();
        assert_eq!(s.bytes_in_use, 0);
        // The other thread's block went back at its exit; this thread's may still be cached.
        assert!(s.bytes_cached <= 20 << 10, "{s:?}");
        a.check().expect("heap invariants");
        bfc_alloc::host::loom_exit_thread();
        assert_eq!(a.stats().bytes_cached, 0);
    });
}

/// Model 1c: two threads churn blocks above the medium classes. A request that finds the lock
/// held binds the thread's cache (taking the lock again) and starts caching such blocks, so in
/// some schedules a block is freed into a cache and handed out again from it, and thread exit
/// gives it back. In every schedule nothing overlaps or stays in use or cached, and the invariant
/// checker passes; and some schedule did cache one.
#[test]
fn upper_blocks_cached_under_contention() {
    static CACHED_ONE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    loom::model(|| {
        let a = Arc::new(allocator());
        let handles: Vec<_> = (0..2u8)
            .map(|t| {
                let a = a.clone();
                thread::spawn(move || {
                    let first = alloc_tagged(&a, ENGINE, t + 1);
                    assert_tagged(first, t + 1);
                    free(&a, first);
                    let second = alloc_tagged(&a, ENGINE, t + 11);
                    assert_tagged(second, t + 11);
                    free(&a, second);
                    if a.thread_cache_bytes() >= ENGINE {
                        CACHED_ONE.store(true, Ordering::Relaxed);
                    }
                    bfc_alloc::host::loom_exit_thread();
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        let s = a.stats();
        assert_eq!((s.bytes_in_use, s.bytes_cached), (0, 0), "{s:?}");
        a.check().expect("heap invariants");
        bfc_alloc::host::loom_exit_thread();
    });
    assert!(
        CACHED_ONE.load(Ordering::Relaxed),
        "no schedule met contention and cached a block"
    );
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
                thread::spawn(move || {
                    let b = alloc_tagged(&a, 100, t + 1);
                    bfc_alloc::host::loom_exit_thread();
                    b
                })
            })
            .collect();
        let blocks: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(a.initialisations(), 1);
        assert_ne!(blocks[0].0, blocks[1].0);
        assert_tagged(blocks[0], 1);
        assert_tagged(blocks[1], 2);
        free_all_and_check(&a, blocks);
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
                let second = alloc_tagged(&a, ENGINE, 2);
                bfc_alloc::host::loom_exit_thread();
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
        // Blocks the writer's thread cache took in its refill are not in use.
        assert!(
            s.num_chunks_in_use <= 2 && (s.num_chunks_in_use == 0) == (s.bytes_in_use == 0),
            "{s:?}"
        );
        let after = a.stats();
        assert_eq!((after.bytes_in_use, after.num_chunks_in_use), (s1 + s2, 2));
        free_all_and_check(&a, [first, second]);
    });
}

/// Model 5 (thread caches): a block allocated on one thread is freed on another (it joins the
/// freeing thread's cache), and that thread reads stats (which walk the registry of caches) while the
/// other frees and unregisters. No block is handed out twice, stats never count a cached block as in
/// use, and after both threads' exit flushes every block is back in the slab layer.
#[test]
fn cross_thread_free_through_thread_caches() {
    loom::model(|| {
        let a = Arc::new(allocator());
        let (tx, rx) = loom::sync::mpsc::channel::<(usize, Layout)>();
        let producer = {
            let a = a.clone();
            thread::spawn(move || {
                let sent = alloc_tagged(&a, 48, 1);
                let own = alloc_tagged(&a, 48, 2);
                tx.send(sent).unwrap();
                assert_tagged(own, 2);
                free(&a, own);
                bfc_alloc::host::loom_exit_thread();
            })
        };
        let consumer = {
            let a = a.clone();
            thread::spawn(move || {
                let own = alloc_tagged(&a, 48, 3);
                let got = rx.recv().unwrap();
                assert_tagged(got, 1);
                // Races the producer's free and exit flush: only caller-held blocks count.
                let s = a.stats();
                assert!(s.num_chunks_in_use <= 3, "{s:?}");
                assert_eq!(s.bytes_in_use, s.num_chunks_in_use * 48, "{s:?}");
                assert_ne!(got.0, own.0);
                free(&a, got); // a cross-thread free, into this thread's cache
                assert_tagged(own, 3);
                let again = alloc_tagged(&a, 48, 4); // may be the block just freed
                assert_ne!(again.0, own.0);
                free(&a, again);
                free(&a, own);
                bfc_alloc::host::loom_exit_thread();
            })
        };
        producer.join().unwrap();
        consumer.join().unwrap();
        let s = a.stats();
        assert_eq!((s.bytes_in_use, s.num_chunks_in_use), (0, 0), "{s:?}");
        a.check().expect("heap invariants");
    });
}

/// Model 6 (thread caches): a thread's exit flush races the drop of the allocator its cache is
/// bound to (the thread no longer holds a reference, as when its exit flush runs after the
/// thread's closure). Either the flush runs against the live allocator or the drop first marks
/// the cache orphaned and the flush skips it; it never touches a dropped allocator.
#[test]
fn thread_exit_races_allocator_drop() {
    loom::model(|| {
        let a = Leaked::new();
        let (done_tx, done_rx) = loom::sync::mpsc::channel::<()>();
        let worker = thread::spawn(move || {
            {
                // SAFETY: the drop waits for the signal below.
                let a = unsafe { a.get() };
                let b = alloc_tagged(a, 32, 5);
                free(a, b); // stays in this thread's cache
            }
            done_tx.send(()).unwrap(); // the closure is done with `a`...
            bfc_alloc::host::loom_exit_thread(); // ...and its exit flush runs
        });
        done_rx.recv().unwrap();
        // SAFETY: the worker's reference ended before its signal; dropped once.
        unsafe { a.drop_in_place() };
        worker.join().unwrap();
    });
}

/// Negative control for model 6: with the drop's bindings lock skipped, loom finds the schedule in
/// which the exit flush meets the dropped allocator.
#[test]
#[should_panic(expected = "exit flush reached a dropped allocator")]
fn exit_flush_without_the_bindings_lock_is_caught() {
    with_switch(
        &bfc_alloc::host::LOOM_SKIP_DROP_BINDINGS,
        thread_exit_races_allocator_drop,
    );
}

/// Model 6b (thread caches): a cache whose instance is being dropped binds to another instance. The
/// drop marks the old instance's caches orphaned while it walks their registry links; the orphaned
/// cache, rebinding, rewrites its links into the new instance's registry. The rebinding waits for
/// the walk to end, so the drop never follows the new links and orphans a cache of the live
/// instance (whose blocks would then never be flushed back, and whose registry entry would outlive
/// its thread).
#[test]
fn rebinding_races_the_old_instances_drop() {
    loom::model(|| {
        let old = Leaked::new();
        let new = Arc::new(allocator());
        // This thread's cache binds to `new` and keeps one block.
        let own = alloc_tagged(&new, 32, 7);
        free(&new, own);
        let (done_tx, done_rx) = loom::sync::mpsc::channel::<()>();
        let worker = {
            let new = new.clone();
            thread::spawn(move || {
                {
                    // SAFETY: the drop waits for the signal below.
                    let old = unsafe { old.get() };
                    let b = alloc_tagged(old, 32, 5);
                    free(old, b); // the worker's cache binds to `old`
                }
                done_tx.send(()).unwrap(); // done with `old`
                                           // Binds to `new` if `old`'s drop has marked the cache orphaned, else takes the lock.
                let b = alloc_tagged(&new, 32, 6);
                free(&new, b);
                bfc_alloc::host::loom_exit_thread();
            })
        };
        done_rx.recv().unwrap();
        // SAFETY: the worker's reference ended before its signal; dropped once.
        unsafe { old.drop_in_place() };
        worker.join().unwrap();
        bfc_alloc::host::loom_exit_thread(); // flushes this thread's block into `new`
        let s = new.stats();
        assert_eq!(
            s.num_cached_chunks, 0,
            "a live instance's cache was orphaned: its blocks stayed cached after its thread's exit \
             flush ({s:?})"
        );
        assert_eq!(s.bytes_in_use, 0, "{s:?}");
        new.check().expect("heap invariants");
    });
}

/// Negative control for model 6b: when the rebinding does not wait on the bindings lock, loom finds
/// the schedule in which the drop follows the rebound cache's new links (into the new instance's
/// list, more caches than the old one registered: the registry walk's check panics).
#[test]
#[should_panic(expected = "the thread cache registry is corrupted")]
fn rebinding_without_the_bindings_lock_is_caught() {
    with_switch(
        &bfc_alloc::host::LOOM_SKIP_REBIND_BINDINGS,
        rebinding_races_the_old_instances_drop,
    );
}

/// Model 7 (fork): the fork prepare step, which takes the bindings lock, the heap list's lock and
/// every heap lock and holds them across the `fork`, races a thread that initialises, uses and drops
/// a second allocator (heap list, then its state lock; bindings, state, heap, heap list) and uses
/// the first one through the engine and its thread cache before exiting (bindings, then heap). The
/// prepare step never deadlocks with them, never comes while the other thread initialises an
/// allocator (holding its state lock, which a fork child would inherit held), holds every allocator
/// lock itself at the fork, and the heaps are intact afterwards.
#[test]
fn fork_prepare_races_init_use_drop_and_exit() {
    loom::model(|| {
        let a = Arc::new(allocator());
        let first = alloc_tagged(&a, 32, 1);
        let worker = {
            let a = a.clone();
            thread::spawn(move || {
                let b = allocator();
                let x = alloc_tagged(&b, 32, 2);
                free_all_and_check(&b, [x]);
                drop(b);
                let big = alloc_tagged(&a, ENGINE, 3);
                let small = alloc_tagged(&a, 32, 4);
                assert_tagged(big, 3);
                free(&a, small);
                free(&a, big);
                bfc_alloc::host::loom_exit_thread();
            })
        };
        bfc_alloc::host::loom_fork_prepare();
        // SAFETY: the prepare step just ran on this thread.
        unsafe { bfc_alloc::host::loom_fork_release() };
        worker.join().unwrap();
        bfc_alloc::host::loom_check_forks();
        assert_tagged(first, 1);
        free_all_and_check(&a, [first]);
        bfc_alloc::host::loom_exit_thread();
    });
}

/// Negative control for model 7: with an initialisation holding the heap list's lock only while it
/// links the new heap, the fork can come while the worker initialises its allocator, and the
/// prepare step's check finds the held state lock.
#[test]
#[should_panic(expected = "fork while another thread initialises an allocator")]
fn fork_during_an_initialisation_is_caught() {
    with_switch(
        &bfc_alloc::host::LOOM_SHORT_INIT_LIST_LOCK,
        fork_prepare_races_init_use_drop_and_exit,
    );
}

/// Negative control for model 7: with the prepare step taking the bindings lock after the heap
/// locks, loom finds the schedule in which it and an exiting thread's flush wait for each other
/// (two spinning waiters: loom reports the endless schedule).
#[test]
#[should_panic(expected = "Model exceeded maximum number of branches")]
fn fork_prepare_with_inverted_lock_order_is_caught() {
    with_switch(
        &bfc_alloc::host::LOOM_BREAK_FORK_ORDER,
        fork_prepare_races_init_use_drop_and_exit,
    );
}

/// Negative control for model 7: with the prepare step taking the bindings lock only when it
/// is free, loom finds the schedule in which the worker's exit flush (or its allocator's drop)
/// holds it at the fork, and the check at the fork finds the lock held by another thread.
#[test]
#[should_panic(expected = "fork without holding the bindings lock")]
fn fork_without_the_bindings_lock_is_caught() {
    with_switch(
        &bfc_alloc::host::LOOM_TRY_FORK_BINDINGS,
        fork_prepare_races_init_use_drop_and_exit,
    );
}

/// Model 8 (forks on two threads): glibc runs each fork's atfork handlers with its own lock released,
/// so two threads' forks interleave their prepare and parent handlers. Each fork must hold the locks
/// from its prepare step to its parent step: at the fork, its thread owns them (so its child's
/// handler releases them), what its child inherits (read here without the lock, as the child reads
/// its copy) never races the other thread's use of the heap after its own fork, and no fork
/// releases the locks another fork relies on.
///
/// `nested`: each thread's fork runs the handlers twice, as when they are registered twice, with a
/// second fork nested inside the first (as from another library's prepare handler): the outer fork
/// must still hold the locks after the inner one's parent step.
fn two_forks(nested: bool) {
    loom::model(move || {
        let a = Arc::new(allocator());
        let first = alloc_tagged(&a, ENGINE, 1);
        let forkers: Vec<_> = [1, 2]
            .map(|me| {
                let a = a.clone();
                thread::spawn(move || {
                    bfc_alloc::host::loom_fork_handler_prepare(me);
                    if nested {
                        bfc_alloc::host::loom_fork_handler_prepare(me);
                        assert_ne!(a.loom_fork_child_view(me), 0);
                        bfc_alloc::host::loom_fork_handler_parent(me);
                    }
                    assert_ne!(a.loom_fork_child_view(me), 0);
                    bfc_alloc::host::loom_fork_handler_parent(me);
                    let big = alloc_tagged(&a, ENGINE, 1 + me as u8);
                    free(&a, big);
                    // (Contention there may have bound the thread's cache.)
                    bfc_alloc::host::loom_exit_thread();
                })
            })
            .into_iter()
            .collect();
        for f in forkers {
            f.join().unwrap();
        }
        bfc_alloc::host::loom_check_forks();
        assert_tagged(first, 1);
        free_all_and_check(&a, [first]);
        bfc_alloc::host::loom_exit_thread();
    });
}

#[test]
fn two_forks_interleave_their_handlers() {
    two_forks(false);
}

#[test]
fn two_nested_forks_interleave_their_handlers() {
    two_forks(true);
}

/// Negative control for model 8: with the fork owner read as one shared "held" flag (the logic the
/// handlers had before), the second thread's fork goes ahead on the locks the first one took, and
/// its child would inherit them held.
#[test]
#[should_panic(expected = "without holding the allocator's locks")]
fn forks_sharing_one_held_flag_are_caught() {
    with_switch(&bfc_alloc::host::LOOM_SHARED_FORK_FLAG, || two_forks(false));
}

/// Negative control for the nested model 8: when the first parent call releases the locks, the
/// outer fork goes ahead without them.
#[test]
#[should_panic(expected = "without holding the allocator's locks")]
fn nested_fork_releasing_early_is_caught() {
    with_switch(&bfc_alloc::host::LOOM_IGNORE_FORK_DEPTH, || two_forks(true));
}

/// The loom builds' record of a lock's holder, which the fork check relies on: a lock another
/// thread holds is not held by this one, in every interleaving.
#[test]
fn a_lock_knows_its_holder() {
    use bfc_alloc::lock::SpinLock;

    loom::model(|| {
        let lock = Arc::new(SpinLock::new(()));
        let other = {
            let lock = lock.clone();
            thread::spawn(move || {
                let g = lock.lock();
                assert!(lock.loom_held_by_me());
                drop(g);
                assert!(!lock.loom_held_by_me());
            })
        };
        assert!(
            !lock.loom_held_by_me(),
            "the other thread's lock seen as this one's"
        );
        let g = lock.lock();
        assert!(lock.loom_held_by_me());
        drop(g);
        other.join().unwrap();
    });
}

/// Two threads add 1 to a bare `SpinLock`'s value: only the lock orders the accesses, which loom
/// sees through the sync shim's tracking cell (a cell of `()` beside the value) alone.
fn spinlock_counter() {
    use bfc_alloc::lock::SpinLock;

    loom::model(|| {
        let lock = Arc::new(SpinLock::new(0u64));
        let other = {
            let lock = lock.clone();
            thread::spawn(move || lock.lock().with(|v| *v += 1))
        };
        lock.lock().with(|v| *v += 1);
        other.join().unwrap();
        assert_eq!(lock.lock().with(|v| *v), 2);
    });
}

/// The lock orders its value's accesses (the positive side of the control below).
#[test]
fn a_spinlock_orders_its_value() {
    spinlock_counter();
}

/// Negative control for the sync shim's cell: with the lock's acquire weakened to `Relaxed`, the
/// two updates of a bare `SpinLock`'s value race, and loom must say so through the tracking cell
/// (no heap, no other loom object in between).
#[test]
#[should_panic(expected = "Causality violation")]
fn a_spinlock_value_race_is_caught() {
    with_switch(&bfc_alloc::lock::LOOM_BREAK_ACQUIRE, spinlock_counter);
}

/// Negative control: with the lock's acquire ordering weakened to `Relaxed`, loom must find the data
/// race on the heap state. Proves the models above can fail.
#[test]
#[should_panic(expected = "Causality violation")]
fn broken_lock_ordering_is_caught() {
    with_switch(&bfc_alloc::lock::LOOM_BREAK_ACQUIRE, || {
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
                        bfc_alloc::host::loom_exit_thread();
                    })
                })
                .collect();
            for h in handles {
                h.join().unwrap();
            }
            free(&a, first);
        });
    });
}

/// Stream pairs of the device-pool models: streams 1 and 2 take the pool's lock for every call;
/// 3 and 4 take stream caches (each thread has one; two under loom: the main thread has one, and
/// the first two spawned threads share the other).
#[cfg(feature = "cuda")]
const STREAM_PAIRS: [[u64; 2]; 2] = [[1, 2], [3, 4]];

/// Model 4 (device pool, feature `cuda`): two threads allocate, free and reallocate buffers on their
/// own streams of one pool over the simulated device, each buffer used once on its stream. The
/// pool's state is behind the shim's mutex (loom's here), and so is each stream cache; blocks
/// never overlap while live, the engine's invariants hold, and every block goes back once the
/// streams' work completes. (The pool has room for all, so no block changes stream here: model 4b
/// makes them.)
#[cfg(feature = "cuda")]
#[test]
fn device_pool_threads_on_two_streams() {
    // (And two threads on one cached stream, which hit and free in one cache at once.)
    for streams in STREAM_PAIRS.into_iter().chain([[3, 3]]) {
        threads_on_two_streams(streams);
    }
}

#[cfg(feature = "cuda")]
fn threads_on_two_streams(streams: [u64; 2]) {
    use bfc_alloc::cuda::{DevicePool, PoolOptions, SimDevice, SimStream};

    loom::model(move || {
        let dev = SimDevice::new(1 << 30);
        let pool =
            DevicePool::with_backend(dev.backend(), PoolOptions::with_limit(64 << 20)).unwrap();
        let handles: Vec<_> = streams
            .into_iter()
            .map(|t| {
                let pool = pool.clone();
                thread::spawn(move || {
                    let s = SimStream(t);
                    // SAFETY: simulated device memory is never read.
                    let first = unsafe { pool.alloc::<u8>(&s, 4096) }.unwrap();
                    first.simulate_use(s);
                    drop(first);
                    // SAFETY: as above.
                    let kept = unsafe { pool.alloc::<u8>(&s, 4096) }.unwrap();
                    kept.simulate_use(s);
                    (s, (kept.device_address(), kept.block_size()), kept)
                })
            })
            .collect();
        let kept: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let overlap =
            |a: (u64, usize), b: (u64, usize)| a.0 < b.0 + b.1 as u64 && b.0 < a.0 + a.1 as u64;
        let (a, b) = (&kept[0].1, &kept[1].1);
        assert!(
            !overlap((a.0, a.1), (b.0, b.1)),
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

/// Model 4b (device pool, feature `cuda`): two threads each allocate a 1.5 MiB buffer on their own
/// stream of a pool limited to one 2 MiB region, use it and free it. When both allocations come
/// before either free, one is refused; otherwise the second must take the block the first freed
/// while that block's work may still run. Every interleaving: the block goes to the other stream
/// only once the work queued on it before the free is done, or ordered before the new owner's work
/// (the pool waits for the freeing stream's event, or for the stream itself).
#[cfg(feature = "cuda")]
#[test]
fn device_pool_reuses_a_busy_block_across_streams() {
    for streams in STREAM_PAIRS {
        busy_block_across_streams(streams);
    }
}

#[cfg(feature = "cuda")]
fn busy_block_across_streams(streams: [u64; 2]) {
    use bfc_alloc::cuda::{DevicePool, PoolOptions, SimDevice, SimStream};
    use std::sync::atomic::AtomicUsize;

    // Executions in which the second buffer reused the first one's block.
    static REUSED: AtomicUsize = AtomicUsize::new(0);
    REUSED.store(0, Ordering::Relaxed);
    loom::model(move || {
        let dev = SimDevice::new(1 << 30);
        let options = PoolOptions {
            initial_region_size: 2 << 20,
            ..PoolOptions::with_limit(2 << 20)
        };
        let pool = DevicePool::with_backend(dev.backend(), options).unwrap();
        let handles: Vec<_> = streams
            .into_iter()
            .map(|t| {
                let pool = pool.clone();
                thread::spawn(move || {
                    let s = SimStream(t);
                    // SAFETY: simulated device memory is never read.
                    let b = unsafe { pool.alloc::<u8>(&s, 3 << 19) }.ok()?;
                    let used = (s, b.device_address(), b.block_size(), b.simulate_use(s));
                    drop(b);
                    Some(used)
                })
            })
            .collect();
        let uses: Vec<_> = handles
            .into_iter()
            .filter_map(|h| h.join().unwrap())
            .collect();
        if let [a, b] = uses[..] {
            assert!(
                a.1 < b.1 + b.2 as u64 && b.1 < a.1 + a.2 as u64,
                "the two buffers fit one region only by sharing its block"
            );
            REUSED.fetch_add(1, Ordering::Relaxed);
            // One of the two uses came first, and its work was done or ordered before the other's.
            let ordered = |x: (SimStream, u64, usize, u64), y: (SimStream, u64, usize, u64)| {
                dev.completed(x.0) >= x.3 || dev.ordered_before((x.0, x.3), (y.0, y.3))
            };
            assert!(
                ordered(a, b) || ordered(b, a),
                "a block went to another stream while the work queued on it may still run"
            );
        } else {
            assert_eq!(uses.len(), 1, "both allocations were refused");
        }
        dev.complete_all();
        pool.synchronize();
        assert_eq!(pool.stats().allocator.bytes_in_use, 0);
        pool.check().expect("pool invariants");
    });
    assert!(
        REUSED.load(Ordering::Relaxed) > 0,
        "streams {streams:?}: no execution reused a block across streams"
    );
}

/// Model 4c (device pool, feature `cuda`): a thread frees a buffer it allocated on its stream (one
/// that takes stream caches) and allocates the same size again, while another thread trims the
/// pool, which
/// moves every cached block to its stream's queue and closes it (the stream is busy: an event).
/// Every interleaving: the stream gets its block back once (from its cache or from its queue), the
/// counts agree, and everything goes back at the end.
#[cfg(feature = "cuda")]
#[test]
fn a_stream_cache_hit_races_a_trim() {
    use bfc_alloc::cuda::{DevicePool, PoolOptions, SimDevice, SimStream};

    const S: SimStream = SimStream(3);
    loom::model(|| {
        let dev = SimDevice::new(1 << 30);
        let pool =
            DevicePool::with_backend(dev.backend(), PoolOptions::with_limit(64 << 20)).unwrap();
        // SAFETY: simulated device memory is never read.
        let first = unsafe { pool.alloc::<u8>(&S, 4096) }.unwrap();
        // Keeps the region, which a trim would otherwise give back.
        // SAFETY: as above.
        let keep = unsafe { pool.alloc::<u8>(&S, 4096) }.unwrap();
        let at = first.device_address();
        first.simulate_use(S); // S is busy until `complete_all`
        let t = {
            let pool = pool.clone();
            thread::spawn(move || {
                pool.trim();
            })
        };
        // (On the thread that allocated `first`: its stream cache is the one the free uses.)
        drop(first);
        // SAFETY: as above.
        let again = unsafe { pool.alloc::<u8>(&S, 4096) }.unwrap();
        t.join().unwrap();
        assert_eq!(
            again.device_address(),
            at,
            "the stream did not get its own block back"
        );
        let s = pool.stats();
        assert_eq!((s.pending_blocks, s.allocator.num_allocs), (0, 3));
        drop((again, keep));
        dev.complete_all();
        pool.synchronize();
        assert_eq!(pool.stats().allocator.bytes_in_use, 0);
        pool.check().expect("pool invariants");
    });
}

/// Model 4d (device pool, feature `cuda`): a thread frees the pool's last buffer while the main
/// thread drops the pool's last handle. A buffer holds no reference count of its own: its stream
/// cache holds the pool for it, and the pool goes when the later of the two finds the other gone,
/// under that cache's lock. On a stream with a stream cache (the free goes to the cache) and on one
/// without (the free takes the pool's lock); and with the thread first taking a new handle from the
/// buffer (after the main thread's drop, that makes a pool without handles get one back) and
/// allocating a second buffer with it, which counts in the thread's own cache. Every
/// interleaving: the pool is dropped once, after the last of them (loom reports a leaked or
/// doubly dropped `Arc`), and it gives its region back.
#[cfg(feature = "cuda")]
#[test]
fn the_last_buffer_and_the_last_handle_go_at_once() {
    for stream in [1, 3] {
        for new_handle in [false, true] {
            last_buffer_and_last_handle(stream, new_handle);
        }
    }
}

#[cfg(feature = "cuda")]
fn last_buffer_and_last_handle(stream: u64, new_handle: bool) {
    use bfc_alloc::cuda::{DevicePool, PoolOptions, SimDevice, SimStream};

    loom::model(move || {
        let dev = SimDevice::new(1 << 30);
        let pool =
            DevicePool::with_backend(dev.backend(), PoolOptions::with_limit(64 << 20)).unwrap();
        let s = SimStream(stream);
        // SAFETY: simulated device memory is never read.
        let buf = unsafe { pool.alloc::<u8>(&s, 4096) }.unwrap();
        let t = thread::spawn(move || {
            if new_handle {
                let pool = buf.pool();
                // SAFETY: as above.
                let other = unsafe { pool.alloc::<u8>(&SimStream(4), 4096) }.unwrap();
                drop(pool);
                drop(buf);
                drop(other);
            } else {
                drop(buf);
            }
        });
        drop(pool);
        t.join().unwrap();
        assert_eq!(dev.bytes_live(), 0, "the pool gave its region back");
    });
}

/// Model 5 (device pool, feature `cuda`): two threads use one buffer at once, on two other
/// streams, on one other stream, or one on the home stream and one on another. A use's guard
/// records the event that marks its end only after the use is queued, outside the record's lock,
/// so a use can begin before another one's end is recorded. Every interleaving: once the buffer is
/// freed, its block goes to the next owner on the home stream only ordered after both uses.
#[cfg(feature = "cuda")]
#[test]
fn device_buffer_used_on_two_streams_at_once() {
    for streams in [[2, 3], [2, 2], [1, 2]] {
        two_threads_use_one_buffer(streams);
    }
}

/// Model 5 on streams `SimStream(streams[0])` and `SimStream(streams[1])`; the home stream is
/// `SimStream(1)`.
#[cfg(feature = "cuda")]
fn two_threads_use_one_buffer(streams: [u64; 2]) {
    use bfc_alloc::cuda::{DevicePool, PoolOptions, SimDevice, SimStream};

    const HOME: SimStream = SimStream(1);
    loom::model(move || {
        let dev = SimDevice::new(1 << 30);
        let pool =
            DevicePool::with_backend(dev.backend(), PoolOptions::with_limit(64 << 20)).unwrap();
        // (std's `Arc`: the buffer is freed after both threads are joined.)
        // SAFETY: simulated device memory is never read.
        let buf = std::sync::Arc::new(unsafe { pool.alloc::<u8>(&HOME, 4096) }.unwrap());
        let addr = buf.device_address();
        let handles: Vec<_> = streams
            .iter()
            .map(|&s| {
                let buf = buf.clone();
                thread::spawn(move || (SimStream(s), buf.simulate_use(SimStream(s))))
            })
            .collect();
        let uses: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        drop(std::sync::Arc::into_inner(buf).expect("the threads are done with the buffer"));
        // SAFETY: as above.
        let next = unsafe { pool.alloc::<u8>(&HOME, 4096) }.unwrap();
        assert_eq!(
            next.device_address(),
            addr,
            "the home stream reuses its block"
        );
        let next_item = (HOME, dev.queued(HOME) + 1);
        for (s, item) in uses {
            assert!(
                dev.completed(s) >= item || dev.ordered_before((s, item), next_item),
                "streams {streams:?}: the next owner's work may overlap the use on {s:?}"
            );
        }
        drop(next);
        dev.complete_all();
        pool.synchronize();
        assert_eq!(pool.stats().allocator.bytes_in_use, 0);
    });
}
