//! `fork()` in a process whose threads hold thread caches: the child's first use rebuilds the cache
//! registry, so new threads in the child can bind caches and `stats()` walks a sane registry. (The
//! parent's other threads are idle at the fork: a thread holding the heap lock at the fork would
//! still deadlock the child, as the docs say.) Its own binary: no other test may allocate during
//! the fork.

use std::hint::black_box;
use std::sync::mpsc;

use bfc_alloc::GlobalBfc;

#[global_allocator]
static A: GlobalBfc = GlobalBfc::new();

fn small_traffic(seed: usize) -> usize {
    let v: Vec<Box<[u8]>> = (0..300)
        .map(|i| vec![i as u8; 16 + (i * 37 + seed) % 900].into_boxed_slice())
        .collect();
    v.iter().map(|b| b.len()).sum()
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

    // SAFETY: the child only runs code below and leaves with `_exit`.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // Child: a hang (a corrupt, cyclic registry) is killed by the alarm.
        // SAFETY: plain libc calls.
        unsafe { libc::alarm(20) };
        let ok = std::panic::catch_unwind(|| {
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
        })
        .is_ok();
        // SAFETY: leaves the child at once, without running the parent's exit handlers.
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    let mut status = 0;
    // SAFETY: waits for our own child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    for _ in 0..4 {
        release_tx.send(()).unwrap();
    }
    for t in threads {
        t.join().unwrap();
    }
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "child failed or hung (status {status:#x})"
    );
    A.check().unwrap();
}
