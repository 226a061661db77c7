//! The host heap under an address-space limit (`RLIMIT_AS`, `ulimit -v`): the arena and its
//! metadata are sized to fit beside the rest of the process, and when even the smallest arena does
//! not fit, a warning says why every allocation fails.
//!
//! No `#[global_allocator]` here (the system allocator serves the test harness), and each case runs
//! in a fresh process (this binary, re-run with an environment variable) whose limit it lowers.

use std::alloc::{GlobalAlloc, Layout};
use std::process::Command;

use bfc_alloc::GlobalBfc;

const CASE_ENV: &str = "BFC_ADDRESS_LIMIT_CASE";

/// The process's address space in use (`VmSize`), bytes.
fn vm_size() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib: usize = status
        .lines()
        .find_map(|l| l.strip_prefix("VmSize:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kib << 10
}

/// Limits this process's address space to `extra` bytes more than it uses now; returns the limit.
fn limit_address_space(extra: usize) -> usize {
    let limit = vm_size() + extra;
    let r = libc::rlimit {
        rlim_cur: limit as libc::rlim_t,
        rlim_max: limit as libc::rlim_t,
    };
    // SAFETY: `r` is a valid `rlimit`.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &r) }, 0);
    limit
}

/// Runs `case` in a child process; returns whether it succeeded, and its standard error.
fn run_case(case: &str, test: &str) -> (bool, String) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(CASE_ENV, case)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    (out.status.success(), format!("{stdout}\n{stderr}"))
}

/// With 1.5 GiB of address space left, the default configuration (a 64 GiB arena, a 1 GiB chunk
/// table) still gets a heap: an arena of at most half the limit, with a table sized to it, and
/// the process keeps room for other mappings and threads. (Before, the arena stopped halving at
/// 1 GiB and the full 1 GiB table did not fit beside it: every allocation failed.)
#[test]
fn a_limited_address_space_gets_a_smaller_arena() {
    if std::env::var_os(CASE_ENV).is_none() {
        let (ok, out) = run_case("fits", "a_limited_address_space_gets_a_smaller_arena");
        assert!(ok, "{out}");
        assert!(out.contains("arena of "), "{out}");
        assert!(!out.contains("bfc-alloc: warning"), "{out}");
        return;
    }
    let limit = limit_address_space(1536 << 20);
    let a = GlobalBfc::new();
    let big = Layout::from_size_align(64 << 20, 8).unwrap();
    let small = Layout::from_size_align(100, 8).unwrap();
    // SAFETY: non-zero layouts; each block is written within its size and freed once with its
    // layout.
    unsafe {
        let p = a.alloc(big);
        assert!(!p.is_null(), "no heap under the limit");
        p.write_bytes(1, 64 << 20);
        let q: Vec<*mut u8> = (0..1000).map(|_| a.alloc(small)).collect();
        assert!(q.iter().all(|p| !p.is_null()));
        for p in q {
            a.dealloc(p, small);
        }
        a.dealloc(p, big);
    }
    let arena = a.arena_size();
    println!("arena of {} MiB", arena >> 20);
    assert!(
        (16 << 20..=limit / 2).contains(&arena),
        "arena of {arena} bytes under a limit of {limit}"
    );
    // Room is left: a 256 MiB mapping and a thread (its stack is a mapping too).
    // SAFETY: a fresh anonymous mapping, unmapped right away.
    unsafe {
        let m = libc::mmap(
            std::ptr::null_mut(),
            256 << 20,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        assert_ne!(m, libc::MAP_FAILED, "no room left beside the heap");
        libc::munmap(m, 256 << 20);
    }
    std::thread::spawn(|| ()).join().unwrap();
    a.check().unwrap();
}

/// When not even the smallest arena fits, every allocation fails, and standard error says why
/// (once).
#[test]
fn no_room_for_the_smallest_arena_is_reported() {
    if std::env::var_os(CASE_ENV).is_none() {
        let (ok, out) = run_case("none", "no_room_for_the_smallest_arena_is_reported");
        assert!(ok, "{out}");
        assert_eq!(
            out.matches("bfc-alloc: warning: cannot reserve a heap arena of 16 MiB")
                .count(),
            1,
            "{out}"
        );
        return;
    }
    limit_address_space(8 << 20);
    let a = GlobalBfc::new();
    let l = Layout::from_size_align(100, 8).unwrap();
    for _ in 0..3 {
        // SAFETY: a non-zero layout; nothing is returned to free.
        assert!(unsafe { a.alloc(l) }.is_null());
    }
    assert_eq!(a.arena_size(), 0);
}
