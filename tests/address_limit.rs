//! The host heap under an address-space limit (`RLIMIT_AS`, `ulimit -v`): the arena and its
//! metadata are sized to fit beside the rest of the process, and when even the smallest arena does
//! not fit, a warning says why every allocation fails. Under a data limit (`RLIMIT_DATA`, which
//! counts writable private memory, as strict overcommit does), only the memory the heap committed
//! counts. Out of pthread keys, threads get no cache (nothing would flush it at their exit).
//!
//! No `#[global_allocator]` here (the system allocator serves the test harness), and each case runs
//! in a fresh process (this binary, re-run with an environment variable) whose limit it lowers.

use std::alloc::{GlobalAlloc, Layout};
use std::process::Command;

use bfc_alloc::{AllocFailure, FailureCause, GlobalBfc, HostConfig};

#[path = "common/keyed.rs"]
mod keyed;
use keyed::{
    allocating_key, assert_no_block_left, cached_by_an_allocating_thread, first_use_at_exit, KEYED,
};

const CASE_ENV: &str = "BFC_ADDRESS_LIMIT_CASE";

/// A `/proc/self/status` field in bytes (`VmSize`, `VmData`).
fn status_bytes(field: &str) -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib: usize = status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kib << 10
}

/// Sets `resource` to `extra` bytes more than `field` says the process uses now; returns the limit.
/// (Also ends the process after a minute: a child must never hang its test.)
fn limit(resource: libc::__rlimit_resource_t, field: &str, extra: usize) -> usize {
    // SAFETY: `alarm` has no preconditions; SIGALRM's default action ends the process.
    unsafe { libc::alarm(60) };
    let limit = status_bytes(field) + extra;
    let r = libc::rlimit {
        rlim_cur: limit as libc::rlim_t,
        rlim_max: limit as libc::rlim_t,
    };
    // SAFETY: `r` is a valid `rlimit`.
    assert_eq!(unsafe { libc::setrlimit(resource, &r) }, 0);
    limit
}

/// Limits this process's address space to `extra` bytes more than it uses now; returns the limit.
fn limit_address_space(extra: usize) -> usize {
    limit(libc::RLIMIT_AS, "VmSize", extra)
}

/// In the test process: runs `test` again in a child process (which lowers its own limits),
/// asserts that it succeeded, and returns its output (stdout, then stderr). In that child: `None`,
/// and the test goes on to its case.
fn run_in_child(test: &str) -> Option<String> {
    if std::env::var_os(CASE_ENV).is_some() {
        return None;
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(CASE_ENV, "1")
        // A failed assertion at the limit must not hang in a backtrace that cannot allocate.
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let all = format!("{stdout}\n{stderr}");
    assert!(out.status.success(), "{all}");
    // The child ran the test (a filter that no longer matches would run none, and exit 0).
    assert!(
        all.contains("1 passed"),
        "{test} did not run in the child: {all}"
    );
    Some(all)
}

/// With 1.5 GiB of address space left under the limit, in a process that already maps 1 GiB more,
/// the default configuration (a 64 GiB arena, a 1 GiB chunk table) still gets a heap: its arena
/// and metadata take at most half of what was left, with a table sized to the arena, and the
/// process keeps room for other mappings and threads. (Before, the arena stopped halving at 1 GiB
/// and the full 1 GiB table did not fit beside it: every allocation failed. And a cap of half the
/// limit, not of what is left, left too little room here.)
#[test]
fn a_limited_address_space_gets_a_smaller_arena() {
    if let Some(out) = run_in_child("a_limited_address_space_gets_a_smaller_arena") {
        assert!(out.contains("arena of "), "{out}");
        assert!(!out.contains("bfc-alloc: warning"), "{out}");
        return;
    }
    // Address space the process maps already (as libraries, other allocators, thread stacks do).
    // SAFETY: a fresh inaccessible reservation, never touched, kept to the end.
    let used = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            1 << 30,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    assert_ne!(used, libc::MAP_FAILED);
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
    let left = limit - status_bytes("VmSize");
    println!("arena of {} MiB, {} MiB left", arena >> 20, left >> 20);
    assert!(
        (16 << 20..=768 << 20).contains(&arena),
        "arena of {arena} bytes"
    );
    assert!(left >= 768 << 20, "{left} bytes left");
    // Room is left: a 512 MiB mapping and a thread (its stack is a mapping too).
    // SAFETY: a fresh anonymous mapping, unmapped right away.
    unsafe {
        let m = libc::mmap(
            std::ptr::null_mut(),
            512 << 20,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        assert_ne!(m, libc::MAP_FAILED, "no room left beside the heap");
        libc::munmap(m, 512 << 20);
    }
    std::thread::spawn(|| ()).join().unwrap();
    a.check().unwrap();
}

/// In a child process (run as `test`) with 8 MiB of address space left: every allocation from a
/// heap with `config` fails, and standard error says why, once, naming the arena tried last
/// (`tried_last` MiB).
fn no_room_is_reported(test: &str, config: HostConfig, tried_last: usize) {
    if let Some(out) = run_in_child(test) {
        let warning =
            format!("bfc-alloc: warning: cannot reserve a heap arena of {tried_last} MiB");
        assert_eq!(out.matches(&warning).count(), 1, "{out}");
        return;
    }
    limit_address_space(8 << 20);
    let a = GlobalBfc::with_config(config);
    let l = Layout::from_size_align(100, 8).unwrap();
    for _ in 0..3 {
        // SAFETY: a non-zero layout; nothing is returned to free.
        assert!(unsafe { a.alloc(l) }.is_null());
    }
    assert_eq!(a.arena_size(), 0);
}

/// When not even the smallest arena fits, every allocation fails, and standard error says why
/// (once).
#[test]
fn no_room_for_the_smallest_arena_is_reported() {
    no_room_is_reported(
        "no_room_for_the_smallest_arena_is_reported",
        HostConfig::DEFAULT,
        16,
    );
}

/// The warning names the size of the arena tried last: the minimum rounded up to 2 MiB (10 MiB for
/// a 9 MiB minimum).
#[test]
fn the_warning_names_the_arena_tried_last() {
    let config = HostConfig {
        arena_size: 64 << 20,
        min_arena_size: 9 << 20,
        chunk_capacity: 1 << 10,
        ..HostConfig::DEFAULT
    };
    no_room_is_reported("the_warning_names_the_arena_tried_last", config, 10);
}

/// The arena tried last is the configured minimum (rounded up to 2 MiB), not the last halving
/// step above it: a 64 MiB arena with a 24 MiB minimum tries 64, 32, then 24 MiB. (Before, halving
/// stopped at 32 MiB, the first step whose half was below the minimum: with room for 24 MiB but
/// not 32, every allocation failed.)
#[test]
fn the_smallest_arena_tried_is_the_minimum() {
    if let Some(out) = run_in_child("the_smallest_arena_tried_is_the_minimum") {
        assert!(out.contains("arena of 24 MiB"), "{out}");
        assert!(!out.contains("bfc-alloc: warning"), "{out}");
        return;
    }
    // Room for a 24 MiB arena (and its 2 MiB of alignment slack and small metadata), not for 32.
    limit_address_space(31 << 20);
    let a = GlobalBfc::with_config(HostConfig {
        arena_size: 64 << 20,
        min_arena_size: 24 << 20,
        chunk_capacity: 1 << 10,
        ..HostConfig::DEFAULT
    });
    let l = Layout::from_size_align(20 << 20, 8).unwrap();
    // SAFETY: a non-zero layout; the block is written within its size and freed with it.
    unsafe {
        let p = a.alloc(l);
        assert!(!p.is_null(), "no heap with room for the minimum arena");
        p.write_bytes(1, 20 << 20);
        a.dealloc(p, l);
    }
    println!("arena of {} MiB", a.arena_size() >> 20);
    assert_eq!(a.arena_size(), 24 << 20);
    a.check().unwrap();
}

/// Under a data limit 96 MiB above what the process uses, the default heap still reserves its full
/// arena (reserved memory is not data until committed), and hands out about as much as the limit
/// allows: then allocations return null, not a crash, and work again after frees. (Before the
/// arena was committed on demand, the whole 64 GiB reservation counted as data, and the heap got
/// only what halving fit under the limit.)
#[test]
fn a_data_limit_counts_committed_memory_only() {
    if let Some(out) = run_in_child("a_data_limit_counts_committed_memory_only") {
        assert!(out.contains("blocks of 1 MiB"), "{out}");
        return;
    }
    limit(libc::RLIMIT_DATA, "VmData", 96 << 20);
    let a = GlobalBfc::new();
    let l = Layout::from_size_align(1 << 20, 8).unwrap();
    let mut blocks = Vec::new();
    // SAFETY: non-zero layouts; each block is written within its size and freed once with it.
    unsafe {
        loop {
            let p = a.alloc(l);
            if p.is_null() {
                break;
            }
            p.write(1);
            p.add((1 << 20) - 1).write(1);
            blocks.push(p);
            assert!(blocks.len() < 1000, "the data limit did not apply");
        }
        println!("{} blocks of 1 MiB", blocks.len());
        assert_eq!(
            a.last_failure(),
            Some(AllocFailure {
                size: 1 << 20,
                align: 8,
                cause: FailureCause::CommitRefused
            })
        );
        assert!(
            (32..=96).contains(&blocks.len()),
            "{} blocks of 1 MiB under a 96 MiB data limit",
            blocks.len()
        );
        assert!(a.arena_size() >= 1 << 30, "arena of {}", a.arena_size());
        for p in blocks.drain(..) {
            a.dealloc(p, l);
        }
        let small = Layout::from_size_align(100, 8).unwrap();
        for _ in 0..10 {
            let p = a.alloc(l);
            assert!(!p.is_null(), "no memory after the frees");
            let q = a.alloc(small);
            assert!(!q.is_null());
            a.dealloc(q, small);
            blocks.push(p);
        }
        for p in blocks {
            a.dealloc(p, l);
        }
    }
    a.check().unwrap();
}

/// A private heap of 256 MiB (so a test knows its layout).
fn heap_256() -> GlobalBfc {
    GlobalBfc::with_config(HostConfig {
        arena_size: 256 << 20,
        min_arena_size: 256 << 20,
        ..HostConfig::DEFAULT
    })
}

/// The free top of a heap gives its commit back with its pages, so under a data limit (and strict
/// overcommit) the memory one heap freed serves another mapping: after heap `a` frees a 100 MiB
/// block, heap `b` gets one under a limit of 150 MiB; a 40 MiB block that `a` keeps for reuse
/// goes back with `release_free_memory`, and `b` then grows to 120 MiB. (Before, a heap's commit
/// only grew: `b`'s block was refused.)
#[test]
fn a_free_top_gives_its_commit_back() {
    if run_in_child("a_free_top_gives_its_commit_back").is_some() {
        return;
    }
    let start = status_bytes("VmData");
    limit(libc::RLIMIT_DATA, "VmData", 150 << 20);
    let (a, b) = (heap_256(), heap_256());
    let data = || status_bytes("VmData").saturating_sub(start) >> 20;
    let layout = |mib: usize| Layout::from_size_align(mib << 20, 8).unwrap();
    // SAFETY: non-zero layouts; each block is written within its size and freed once with it.
    unsafe {
        let p = a.alloc(layout(100));
        assert!(!p.is_null());
        p.write_bytes(1, 100 << 20);
        assert!(data() >= 100, "{} MiB of data", data());
        a.dealloc(p, layout(100));
        assert!(data() < 20, "{} MiB of data after the free", data());
        let q = b.alloc(layout(100));
        assert!(
            !q.is_null(),
            "the other heap's freed commit was not given back"
        );
        q.write_bytes(2, 100 << 20);
        b.dealloc(q, layout(100));
        // Below 64 MiB a freed top is kept touched for reuse, until a release.
        let p = a.alloc(layout(40));
        assert!(!p.is_null());
        p.write_bytes(3, 40 << 20);
        a.dealloc(p, layout(40));
        assert!(data() >= 40, "{} MiB of data", data());
        a.release_free_memory();
        assert!(data() < 20, "{} MiB of data after the release", data());
        let q = b.alloc(layout(120));
        assert!(!q.is_null(), "the released commit was not given back");
        q.write_bytes(4, 120 << 20);
        b.dealloc(q, layout(120));
    }
    a.check().unwrap();
    b.check().unwrap();
}

/// Under a data limit, an allocation commits only as far as its own block reaches: after a
/// 100 MiB block was freed, 120 MiB fit under a limit of 150 MiB (committing 18 MiB more, not the
/// 120 MiB above the freed block's end).
#[test]
fn a_data_limit_does_not_refuse_a_block_that_fits() {
    if run_in_child("a_data_limit_does_not_refuse_a_block_that_fits").is_some() {
        return;
    }
    limit(libc::RLIMIT_DATA, "VmData", 150 << 20);
    let a = heap_256();
    let big = Layout::from_size_align(100 << 20, 8).unwrap();
    let bigger = Layout::from_size_align(120 << 20, 8).unwrap();
    // SAFETY: non-zero layouts; each block is written within its size and freed once with it.
    unsafe {
        let p = a.alloc(big);
        assert!(!p.is_null());
        p.write_bytes(1, 100 << 20);
        a.dealloc(p, big);
        let q = a.alloc(bigger);
        assert!(
            !q.is_null(),
            "120 MiB refused with 102 MiB committed under a 150 MiB limit"
        );
        q.write_bytes(1, 120 << 20);
        a.dealloc(q, bigger);
    }
    a.check().unwrap();
}

/// Under a data limit that is used up, a realloc shrinks in place, and a grow that cannot be
/// committed in place moves into a free hole instead of failing.
#[test]
fn a_data_limit_leaves_realloc_working() {
    if run_in_child("a_data_limit_leaves_realloc_working").is_some() {
        return;
    }
    limit(libc::RLIMIT_DATA, "VmData", 40 << 20);
    let a = heap_256();
    let l = Layout::from_size_align(1 << 20, 8).unwrap();
    let mut v = Vec::new();
    // SAFETY: non-zero layouts; each block is written within its size and freed once with its
    // current layout.
    unsafe {
        loop {
            let p = a.alloc(l);
            if p.is_null() {
                break;
            }
            p.write_bytes(1, 1 << 20);
            v.push(p);
            assert!(v.len() < 1000, "the data limit did not apply");
        }
        // The last block ends at the committed end: a shrink by a granule needs nothing more.
        let last = v.pop().unwrap();
        let q = a.realloc(last, l, (1 << 20) - 16);
        assert_eq!(q, last, "a shrink at the limit failed or moved");
        let l2 = Layout::from_size_align((1 << 20) - 16, 8).unwrap();
        // A hole of 4 MiB at the bottom; the grow cannot be committed in place, so it moves.
        for p in v.drain(..4) {
            a.dealloc(p, l);
        }
        let r = a.realloc(q, l2, 2 << 20);
        assert!(!r.is_null(), "a grow that could move returned null");
        assert!(*r == 1 && *r.add((1 << 20) - 17) == 1);
        r.write_bytes(2, 2 << 20);
        a.dealloc(r, Layout::from_size_align(2 << 20, 8).unwrap());
        for p in v {
            a.dealloc(p, l);
        }
    }
    a.check().unwrap();
}

/// Makes pthread keys until the system refuses; returns how many.
fn use_up_pthread_keys() -> usize {
    let mut made = 0;
    loop {
        let mut k = 0;
        // SAFETY: a valid place for the key; no destructor.
        if unsafe { libc::pthread_key_create(&mut k, None) } != 0 {
            return made;
        }
        made += 1;
        assert!(made < 1 << 20, "no limit on pthread keys");
    }
}

/// With no pthread key left when a heap starts, a thread gets no cache (nothing could flush it at
/// exit): its small blocks take the lock, and none stays behind when the thread exits, even when
/// its first allocation comes in another key's destructor. (Before, the cache bound there with a
/// thread-local's destructor that never runs: its blocks stayed cached after the thread was gone,
/// and the next such thread could link the heap's list of caches into a cycle.)
#[test]
fn no_pthread_key_left_means_no_thread_cache() {
    if run_in_child("no_pthread_key_left_means_no_thread_cache").is_some() {
        return;
    }
    // SAFETY: `alarm` has no preconditions; SIGALRM's default action ends a hung child.
    unsafe { libc::alarm(60) };
    allocating_key();
    println!("{} more keys made", use_up_pthread_keys());
    for round in 0..4 {
        first_use_at_exit();
        assert_no_block_left(round);
    }
    assert_eq!(
        cached_by_an_allocating_thread(),
        0,
        "a thread cached blocks"
    );
    assert_eq!(KEYED.stats().num_cached_chunks, 0);
}

/// A heap makes the thread caches' exit key when it starts, so a program that uses up the keys
/// later still gets caches on new threads, flushed at their exit.
#[test]
fn the_exit_key_is_made_when_the_heap_starts() {
    if run_in_child("the_exit_key_is_made_when_the_heap_starts").is_some() {
        return;
    }
    // SAFETY: as above.
    unsafe { libc::alarm(60) };
    assert!(KEYED.check().is_ok());
    println!("{} more keys made", use_up_pthread_keys());
    for round in 0..4 {
        let cached = cached_by_an_allocating_thread();
        assert!(cached > 0, "round {round}: the thread had no cache");
        assert_no_block_left(round);
    }
}
