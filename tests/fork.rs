//! `fork()` in a process whose threads use the allocator:
//! - the child's first use rebuilds the cache registry, so new threads in the child can bind caches
//!   and `stats()` walks a sane registry;
//! - a fork while other threads are inside the allocator (holding its lock) leaves the child able to
//!   allocate: the atfork handlers hold every heap lock across the fork;
//! - a fork while another thread initialises an instance leaves that instance usable in the child;
//! - threads that fork at the same time (glibc interleaves their atfork handlers) each leave a child
//!   that can allocate.
//!
//! Its own binary, so that only these tests' threads run during the forks.

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};

use bfc_alloc::GlobalBfc;

#[global_allocator]
static A: GlobalBfc = GlobalBfc::new();

fn small_traffic(seed: usize) -> usize {
    let v: Vec<Box<[u8]>> = (0..300)
        .map(|i| vec![i as u8; 16 + (i * 37 + seed) % 900].into_boxed_slice())
        .collect();
    v.iter().map(|b| b.len()).sum()
}

/// Forks. The child runs `body` under an alarm of `alarm_s` seconds (a hang, such as a lock inherited
/// in the held state, is killed) and leaves with `_exit`: 0 if `body` returned, 1 if it panicked.
/// Returns whether the child exited with 0, and its wait status.
fn in_fork_child(alarm_s: u32, body: impl FnOnce()) -> (bool, i32) {
    // SAFETY: the child only runs `body` and leaves with `_exit`.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // SAFETY: a plain libc call.
        unsafe { libc::alarm(alarm_s) };
        let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)).is_ok();
        // SAFETY: leaves the child at once, without running the parent's exit handlers.
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    let mut status = 0;
    // SAFETY: waits for our own child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    (
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        status,
    )
}

#[test]
fn fork_with_thread_caches_keeps_the_registry_sane() {
    // Threads that bind caches, then wait (idle) across the fork.
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let release_rx = std::sync::Arc::new(std::sync::Mutex::new(release_rx));
    let (ready_tx, ready_rx) = mpsc::channel::<()>();
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let ready_tx = ready_tx.clone();
            let release_rx = release_rx.clone();
            std::thread::spawn(move || {
                black_box(small_traffic(t));
                ready_tx.send(()).unwrap();
                let _ = release_rx.lock().unwrap().recv();
            })
        })
        .collect();
    for _ in 0..4 {
        ready_rx.recv().unwrap();
    }
    black_box(small_traffic(99));

    // Child: a hang (a corrupt, cyclic registry) is killed by the alarm.
    let (ok, status) = in_fork_child(20, || {
        for round in 0..3 {
            let hs: Vec<_> = (0..4)
                .map(|t| std::thread::spawn(move || small_traffic(round * 10 + t)))
                .collect();
            for h in hs {
                black_box(h.join().unwrap());
            }
            let s = A.stats();
            assert!(s.bytes_cached < 64 << 20, "{s:?}");
            A.check().unwrap();
        }
        black_box(small_traffic(7));
        A.check().unwrap();
    });
    for _ in 0..4 {
        release_tx.send(()).unwrap();
    }
    for t in threads {
        t.join().unwrap();
    }
    assert!(ok, "child failed or hung (status {status:#x})");
    A.check().unwrap();
}

/// The forking thread's cache survives a fork in the child's registry: `after_fork` re-registers
/// it (the other threads' caches are dropped). Its cached blocks still count as cached, not in use,
/// in the child's `stats()`, and flushing it there moves them back to the heap without changing
/// what is in use, leaving a heap that `check()` accepts.
#[test]
fn fork_keeps_the_forking_threads_cache_registered() {
    use std::io::{Read, Write};
    // Small blocks freed into this thread's cache.
    let blocks: Vec<Box<[u8; 48]>> = (0..20).map(|i| Box::new([i as u8; 48])).collect();
    black_box(&blocks);
    drop(blocks);
    assert!(
        A.thread_cache_bytes() > 0,
        "the freed blocks are not cached"
    );

    // The child reports what it found through a socket (its panic message would go to the test
    // harness's capture of the child's own copy of this thread, and be lost).
    let (mut report_rx, mut report_tx) = std::os::unix::net::UnixStream::pair().unwrap();
    let (ok, status) = in_fork_child(20, || {
        let r = (|| -> Result<(), String> {
            let x = A.thread_cache_bytes();
            if x == 0 {
                return Err("the forking thread's cache is empty in the child".into());
            }
            let before = A.stats();
            if before.bytes_cached < x {
                return Err(format!(
                    "the forking thread's {x} cached bytes are missing from the child's stats \
                     (its cache left the registry?): {before:?}"
                ));
            }
            A.check()
                .map_err(|e| format!("check before the flush: {e:?}"))?;
            A.flush_thread_cache();
            let after = A.stats();
            if A.thread_cache_bytes() != 0 {
                return Err("the flush left blocks in the forking thread's cache".into());
            }
            if before.bytes_cached.saturating_sub(after.bytes_cached) < x {
                return Err(format!(
                    "flushing {x} cached bytes did not lower the child's bytes_cached by as much: \
                     {before:?} -> {after:?}"
                ));
            }
            // Exact, where the counts above are not (the transfer cache's blocks count as cached
            // too): the flush only moves cached blocks, so what is in use stays put.
            if after.bytes_in_use != before.bytes_in_use {
                return Err(format!(
                    "flushing the forking thread's cache changed bytes_in_use: {before:?} -> \
                     {after:?}"
                ));
            }
            A.check()
                .map_err(|e| format!("check after the flush: {e:?}"))
        })();
        if let Err(e) = r {
            let _ = report_tx.write_all(e.as_bytes());
            panic!("{e}");
        }
    });
    drop(report_tx);
    // Children of the other tests' forks may hold the writing end too: read only what is there.
    report_rx.set_nonblocking(true).unwrap();
    let mut report = Vec::new();
    let _ = report_rx.read_to_end(&mut report);
    assert!(
        ok,
        "child failed or hung (status {status:#x}): {}",
        String::from_utf8_lossy(&report)
    );
    A.check().unwrap();
}

/// Engine-path and slab-path traffic that keeps the heap lock busy: large blocks (always locked),
/// small ones, and explicit cache flushes (which take the lock for a whole batch).
fn locked_traffic(seed: usize) -> usize {
    let big: Vec<Vec<u8>> = (0..4)
        .map(|i| vec![i as u8; 64 * 1024 + (seed * 4099 + i * 8191) % (512 * 1024)])
        .collect();
    let small = small_traffic(seed);
    A.flush_thread_cache();
    big.iter().map(Vec::len).sum::<usize>() + small
}

/// Two threads running [`locked_traffic`] until the returned flag is set.
fn busy_workers() -> (Arc<AtomicBool>, Vec<std::thread::JoinHandle<()>>) {
    let stop = Arc::new(AtomicBool::new(false));
    let workers = (0..2)
        .map(|t| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut i = t;
                while !stop.load(Ordering::Relaxed) {
                    black_box(locked_traffic(i));
                    i += 2;
                }
            })
        })
        .collect();
    (stop, workers)
}

#[test]
fn fork_while_other_threads_hold_the_heap_lock() {
    let (stop, workers) = busy_workers();
    // Let the workers get going.
    std::thread::sleep(std::time::Duration::from_millis(50));
    for round in 0..100 {
        // Child: a heap lock inherited in the held state would hang here; the alarm kills it.
        let (ok, status) = in_fork_child(10, || {
            black_box(locked_traffic(round));
            A.check().unwrap();
        });
        assert!(ok, "child {round} failed or hung (status {status:#x})");
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().unwrap();
    }
    A.check().unwrap();
}

#[test]
fn fork_during_first_use_initialisation() {
    use std::alloc::{GlobalAlloc, Layout};
    use std::sync::atomic::AtomicUsize;
    const N: usize = 2000;
    let config = bfc_alloc::HostConfig {
        arena_size: 64 << 20,
        min_arena_size: 64 << 20,
        chunk_capacity: 1 << 12,
        ..bfc_alloc::HostConfig::DEFAULT
    };
    let allocators: Arc<Vec<GlobalBfc>> =
        Arc::new((0..N).map(|_| GlobalBfc::with_config(config)).collect());
    let layout = Layout::from_size_align(64, 8).unwrap();
    let use_one = move |a: &GlobalBfc| {
        // SAFETY: a non-zero layout; the block is freed with it at once.
        unsafe {
            let p = a.alloc(layout);
            assert!(!p.is_null());
            a.dealloc(p, layout);
        }
    };
    // A worker initialises the instances one after another (publishing which one it is at) while
    // this thread forks.
    let progress = Arc::new(AtomicUsize::new(0));
    let worker = {
        let (allocators, progress) = (allocators.clone(), progress.clone());
        std::thread::spawn(move || {
            for (i, a) in allocators.iter().enumerate() {
                progress.store(i, Ordering::SeqCst);
                use_one(a);
            }
        })
    };
    let mut forks = 0;
    while !worker.is_finished() || forks == 0 {
        // Child: the instances around the worker's position at the fork, one of which may have
        // been mid-initialisation. One whose initialisation lock was held at the fork would hang
        // here (the alarm kills the child then).
        let (ok, status) = in_fork_child(10, || {
            let at = progress.load(Ordering::SeqCst);
            for a in &allocators[at.saturating_sub(1)..(at + 2).min(N)] {
                use_one(a);
            }
        });
        assert!(ok, "child {forks} failed or hung (status {status:#x})");
        forks += 1;
    }
    worker.join().unwrap();
    for a in allocators.iter() {
        use_one(a);
    }
    eprintln!("{forks} forks during {N} initialisations");
}

/// Several threads fork at once while workers keep the heap lock busy: every child must be able to
/// allocate. (glibc runs one fork's prepare handlers without holding its own lock, so two forks'
/// handlers can interleave: each fork must hold, and release, the allocator's locks on its own
/// thread.)
#[test]
fn concurrent_forks_from_several_threads() {
    let (stop, workers) = busy_workers();
    let forkers: Vec<_> = (0..4)
        .map(|f| {
            std::thread::spawn(move || {
                for round in 0..150 {
                    black_box(small_traffic(f * 100 + round));
                    // Child: a lock inherited in the held state hangs; the alarm kills it.
                    let (ok, status) = in_fork_child(10, || {
                        black_box(locked_traffic(round));
                        A.check().unwrap();
                    });
                    assert!(
                        ok,
                        "forker {f}, child {round} failed or hung (status {status:#x})"
                    );
                }
            })
        })
        .collect();
    let results: Vec<_> = forkers.into_iter().map(|h| h.join()).collect();
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().unwrap();
    }
    for r in results {
        r.unwrap();
    }
    A.check().unwrap();
}

/// Set in a child run of this binary whose C library refuses the fork handlers.
const NO_ATFORK_ENV: &str = "BFC_TEST_NO_ATFORK";

/// Without fork handlers (`pthread_atfork` refused, as when the C library's malloc fails at load)
/// threads get no thread cache, so a fork cannot leave the child a registry of the parent's gone
/// threads' caches (a new thread in the child, on a dead one's storage, linked its cache twice
/// and the child aborted: "the thread cache registry is corrupted"). This binary runs again with a
/// preload library whose `__register_atfork` (what `pthread_atfork` calls) fails, and with it
/// [`fork_with_thread_caches_keeps_the_registry_sane`].
#[test]
fn without_fork_handlers_threads_get_no_cache() {
    if std::env::var_os(NO_ATFORK_ENV).is_some() {
        // SAFETY: registers no handler (all three null); only probes that the preload is in place.
        let rc = unsafe { libc::pthread_atfork(None, None, None) };
        assert_eq!(
            rc,
            libc::ENOMEM,
            "the preload does not refuse pthread_atfork"
        );
        let cached = std::thread::spawn(|| {
            black_box(small_traffic(1));
            A.thread_cache_bytes()
        })
        .join()
        .unwrap();
        assert_eq!(cached, 0, "a thread got a cache without fork handlers");
        return;
    }
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
    let src = dir.join("no_atfork.c");
    let lib = dir.join("no_atfork.so");
    std::fs::write(
        &src,
        "#include <errno.h>\n\
         int __register_atfork(void (*a)(void), void (*b)(void), void (*c)(void), void *d) {\n\
         (void)a; (void)b; (void)c; (void)d; return ENOMEM; }\n",
    )
    .unwrap();
    // The C compiler Rust links with on Linux.
    let cc = std::process::Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&lib)
        .arg(&src)
        .output()
        .expect("no C compiler (cc) to build the preload library");
    assert!(
        cc.status.success(),
        "{}",
        String::from_utf8_lossy(&cc.stderr)
    );
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "without_fork_handlers_threads_get_no_cache",
            "fork_with_thread_caches_keeps_the_registry_sane",
            "--exact",
            "--test-threads=1",
        ])
        .env(NO_ATFORK_ENV, "1")
        .env("LD_PRELOAD", &lib)
        .output()
        .unwrap();
    let all = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{all}");
    assert!(all.contains("2 passed"), "the tests did not run: {all}");
}
