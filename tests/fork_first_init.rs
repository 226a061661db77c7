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
    let mut forks = 0;
    for _ in 0..TRIALS {
        forks += run_trial(TEST_NAME, TRIAL_ENV, "1", "forks")
            .parse::<usize>()
            .expect("the trial reports its forks");
    }
    println!("{TRIALS} trials, {forks} forks before the first use finished, no child hung");
}

/// Runs this binary's test `name` alone in a new process, with `env` set to `value` (which makes
/// it run one trial), fails if the process failed, and returns what it printed after `key=`.
fn run_trial(name: &str, env: &str, value: &str, key: &str) -> String {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(env, value)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "trial {env}={value} failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let prefix = format!("{key}=");
    stdout
        .lines()
        .find_map(|l| l.split(prefix.as_str()).nth(1))
        .unwrap_or_else(|| panic!("the trial printed no {prefix}: {stdout}"))
        .trim()
        .to_owned()
}

/// Two small allocators, neither used yet (`a` for the worker's first initialisation, `b` for
/// the child), for the rest of the process.
fn two_instances() -> (&'static GlobalBfc, &'static GlobalBfc) {
    let config = HostConfig {
        arena_size: 64 << 20,
        min_arena_size: 64 << 20,
        chunk_capacity: 1 << 12,
        ..HostConfig::DEFAULT
    };
    let leak = || -> &'static GlobalBfc { Box::leak(Box::new(GlobalBfc::with_config(config))) };
    (leak(), leak())
}

/// One process: a worker runs the process's first initialisation (of `a`) while this thread forks
/// in a loop; each child initialises and uses `b`, under an alarm that kills it if it hangs.
fn trial() {
    let (a, b) = two_instances();
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

const LATE_TRIAL_ENV: &str = "BFC_FORK_LATE_REGISTRATION_TRIAL";
const LATE_TEST_NAME: &str = "first_initialisation_that_registers_the_handlers_during_a_fork";
/// Trials (processes), each with its own delay (see `late_trial`).
const LATE_TRIALS: usize = 200;

/// The process's first initialisation runs on one thread while another thread is inside `fork`,
/// past the point where glibc chose which atfork handlers that fork runs (it runs another
/// library's prepare handler, registered earlier). The handlers that the initialisation registers
/// then do not run for that fork, so the initialisation's locks must not be taken before the fork
/// is over: a child forked with them held would hang on its first use of an allocator.
#[test]
fn first_initialisation_that_registers_the_handlers_during_a_fork() {
    if let Some(delay) = std::env::var_os(LATE_TRIAL_ENV) {
        late_trial(delay.to_str().unwrap().parse().unwrap());
        return;
    }
    let mut hung = Vec::new();
    for i in 0..LATE_TRIALS {
        // Delays from 0 to 3.9 us in 0.1 us steps: the initialisation is somewhere in there.
        let delay_ns = (i % 40) * 100;
        let result = run_trial(
            LATE_TEST_NAME,
            LATE_TRIAL_ENV,
            &delay_ns.to_string(),
            "child",
        );
        if result != "ok" {
            hung.push(format!("trial {i}, {delay_ns} ns: {result}"));
            // Each hung child costs its 5 s alarm: one is enough to fail, and a broken build then
            // fails in seconds rather than in minutes.
            break;
        }
    }
    assert!(
        hung.is_empty(),
        "a child hung or failed (the trials stop at the first): {hung:?}"
    );
}

static LATE_ARMED: AtomicBool = AtomicBool::new(false);
static LATE_PIPE: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);
static LATE_READY: AtomicBool = AtomicBool::new(false);
static LATE_GO: AtomicBool = AtomicBool::new(false);
static LATE_STARTED: AtomicBool = AtomicBool::new(false);
static LATE_DELAY_NS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Another library's prepare handler, registered before the allocator's: glibc calls it with its
/// atfork lock released, after it chose the handlers of this fork. It starts the worker's first
/// initialisation and lets it run for a while before the fork goes on.
extern "C" fn late_prepare() {
    if !LATE_ARMED.swap(false, Ordering::SeqCst) {
        return;
    }
    LATE_GO.store(true, Ordering::SeqCst);
    let fd = LATE_PIPE.load(Ordering::SeqCst);
    // SAFETY: a one-byte write from a valid buffer to the pipe's write end.
    unsafe { libc::write(fd, [1u8].as_ptr().cast(), 1) };
    while !LATE_STARTED.load(Ordering::SeqCst) {
        std::hint::spin_loop();
    }
    let start = std::time::Instant::now();
    let delay = std::time::Duration::from_nanos(LATE_DELAY_NS.load(Ordering::SeqCst));
    while start.elapsed() < delay {
        std::hint::spin_loop();
    }
}

/// One process: registers [`late_prepare`], then forks once while a worker runs the process's
/// first initialisation (of `a`); the child uses `b` and `a` under an alarm.
fn late_trial(delay_ns: u64) {
    let (a, b) = two_instances();
    // Large: the locked path, with no thread cache (whose exit hook would take libc's malloc lock,
    // which the fork holds from after the prepare handlers on).
    let layout = Layout::from_size_align(1 << 20, 8).unwrap();
    LATE_DELAY_NS.store(delay_ns, Ordering::SeqCst);
    // SAFETY: a handler that touches atomics and a pipe, and allocates nothing.
    let rc = unsafe { libc::pthread_atfork(Some(late_prepare), None, None) };
    assert_eq!(rc, 0);
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    LATE_PIPE.store(fds[1], Ordering::SeqCst);
    let worker = std::thread::spawn(move || {
        LATE_READY.store(true, Ordering::SeqCst);
        let mut byte = 0u8;
        // SAFETY: a one-byte read into a valid buffer from the pipe's read end.
        let n = unsafe { libc::read(fds[0], (&mut byte as *mut u8).cast(), 1) };
        assert_eq!(n, 1);
        LATE_STARTED.store(true, Ordering::SeqCst);
        // SAFETY: a non-zero layout; the block is freed with it.
        unsafe { a.dealloc(a.alloc(layout), layout) };
    });
    while !LATE_READY.load(Ordering::SeqCst) {
        std::hint::spin_loop();
    }
    LATE_ARMED.store(true, Ordering::SeqCst);
    // SAFETY: the child runs only the code below and leaves with `_exit`.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // SAFETY: plain libc calls; each block is freed with its layout.
        unsafe {
            libc::alarm(5);
            let p = b.alloc(layout);
            b.dealloc(p, layout);
            let q = a.alloc(layout);
            a.dealloc(q, layout);
            libc::_exit(if p.is_null() || q.is_null() { 1 } else { 0 });
        }
    }
    let mut status = 0;
    // SAFETY: waits for the child just forked.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    worker.join().unwrap();
    if libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0 {
        println!("child=ok");
    } else {
        println!("child=status {status:#x}");
    }
}
