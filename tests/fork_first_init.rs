//! `fork()` while another thread runs the first allocator initialisation of the whole process: the
//! `fork` handlers must already be registered when that initialisation takes its first lock, or a
//! child forked inside the window inherits the lock held by a thread it does not have, and its own
//! first use of an allocator spins forever.
//!
//! No `#[global_allocator]` here (that would initialise the first heap at start-up, single
//! threaded), and each trial runs in a fresh process (this binary, re-run with an environment
//! variable), since only a process's first initialisation has the window.

use std::alloc::{GlobalAlloc, Layout};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use bfc_alloc::{GlobalBfc, HostConfig};

const TRIAL_ENV: &str = "BFC_FORK_FIRST_INIT_TRIAL";
const TEST_NAME: &str = "fork_during_the_first_initialisation_of_the_process";
/// Trials (processes). Without the fix about 3% of trials hung a child.
const TRIALS: usize = 300;

#[test]
fn fork_during_the_first_initialisation_of_the_process() {
    if std::env::var_os(TRIAL_ENV).is_some() {
        trial();
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let mut forks = 0;
    for i in 0..TRIALS {
        let out = Command::new(&exe)
            .args(["--exact", TEST_NAME, "--nocapture", "--test-threads=1"])
            .env(TRIAL_ENV, "1")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "trial {i} failed ({}):\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        forks += stdout
            .lines()
            .find_map(|l| l.split("forks=").nth(1))
            .and_then(|n| n.trim().parse::<usize>().ok())
            .expect("the trial reports its forks");
    }
    println!("{TRIALS} trials, {forks} forks before the first use finished, no child hung");
}

/// One process: a worker runs the process's first initialisation (of `a`) while this thread forks
/// in a loop; each child initialises and uses `b`, under an alarm that kills it if it hangs.
fn trial() {
    let config = HostConfig {
        arena_size: 64 << 20,
        min_arena_size: 64 << 20,
        chunk_capacity: 1 << 12,
        ..HostConfig::DEFAULT
    };
    let a: &'static GlobalBfc = Box::leak(Box::new(GlobalBfc::with_config(config)));
    let b: &'static GlobalBfc = Box::leak(Box::new(GlobalBfc::with_config(config)));
    let layout = Layout::from_size_align(4096, 8).unwrap();
    let (go, done) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let worker = {
        let (go, done) = (go.clone(), done.clone());
        std::thread::spawn(move || {
            while !go.load(Ordering::Acquire) {
                std::hint::spin_loop();
            }
            // SAFETY: a non-zero layout; the block is freed with it.
            unsafe { a.dealloc(a.alloc(layout), layout) };
            done.store(true, Ordering::Release);
        })
    };
    go.store(true, Ordering::Release);
    let (mut forks, mut hung) = (0, 0);
    while !done.load(Ordering::Acquire) || forks == 0 {
        // SAFETY: the child runs only the code below and leaves with `_exit`.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            // SAFETY: plain libc calls; the block is freed with its layout.
            unsafe {
                libc::alarm(10);
                let p = b.alloc(layout);
                b.dealloc(p, layout);
                libc::_exit(if p.is_null() { 1 } else { 0 });
            }
        }
        let mut status = 0;
        // SAFETY: waits for the child just forked.
        let r = unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(r, pid);
        forks += 1;
        if !(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0) {
            hung += 1;
        }
    }
    worker.join().unwrap();
    println!("forks={forks}");
    assert_eq!(hung, 0, "{hung} of {forks} children hung or failed");
}
