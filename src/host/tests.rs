use super::arena::Prefix;
use super::*;
use std::os::unix::process::ExitStatusExt;
use std::string::String;

/// Names the case a child process runs (see [`run_child`]).
const CHILD_ENV: &str = "BFC_ALLOC_HOST_UNIT_CHILD";

/// An instance with a small arena (reservable anywhere).
fn small_instance() -> GlobalBfc {
    small_instance_with_caches(true)
}

/// [`small_instance`] with thread caches on or off.
fn small_instance_with_caches(thread_cache: bool) -> GlobalBfc {
    GlobalBfc::with_config(HostConfig {
        arena_size: 64 << 20,
        min_arena_size: 64 << 20,
        chunk_capacity: 1 << 12,
        thread_cache,
        ..HostConfig::DEFAULT
    })
}

#[test]
fn bad_configs_are_refused_with_their_reason() {
    let d = HostConfig::DEFAULT;
    let cases = [
        (
            HostConfig {
                arena_size: 1 << 30,
                min_arena_size: 2 << 30,
                ..d
            },
            "arena_size must be at least min_arena_size",
        ),
        (
            HostConfig {
                arena_size: 1 << 20,
                min_arena_size: 1 << 20,
                ..d
            },
            "min_arena_size must be at least 2 MiB",
        ),
        (
            HostConfig {
                chunk_capacity: 15,
                ..d
            },
            "chunk_capacity must be at least 16",
        ),
        (
            HostConfig {
                chunk_capacity: u32::MAX as usize,
                ..d
            },
            "chunk_capacity must be below u32::MAX",
        ),
        (HostConfig { granule: 24, ..d }, "granule must be"),
        (HostConfig { granule: 4, ..d }, "granule must be"),
        (HostConfig { granule: 8192, ..d }, "granule must be"),
        (
            HostConfig {
                upper_cache_bytes: (8 << 20) + 1,
                ..d
            },
            "upper_cache_bytes must be at most 8 MiB",
        ),
    ];
    for (config, reason) in cases {
        let err = std::panic::catch_unwind(|| GlobalBfc::with_config(config))
            .err()
            .unwrap_or_else(|| panic!("accepted a config that should fail with {reason:?}"));
        let msg = err
            .downcast_ref::<&str>()
            .map(|s| String::from(*s))
            .or_else(|| err.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        assert!(msg.contains(reason), "{msg:?} does not name {reason:?}");
    }
    // The limits themselves are accepted.
    for config in [
        HostConfig {
            arena_size: 2 << 20,
            min_arena_size: 2 << 20,
            chunk_capacity: 16,
            granule: 8,
            ..d
        },
        HostConfig {
            chunk_capacity: u32::MAX as usize - 1,
            granule: 4096,
            ..d
        },
    ] {
        let _ = GlobalBfc::with_config(config);
    }
}

/// An arena size that is not a multiple of 2 MiB is rounded up, never below the minimum.
#[test]
fn an_odd_arena_size_is_rounded_up() {
    for (size, min, want) in [
        (3 << 20, 3 << 20, 4 << 20),
        ((5 << 20) + 1, 2 << 20, 6 << 20),
    ] {
        let a = GlobalBfc::with_config(HostConfig {
            arena_size: size,
            min_arena_size: min,
            chunk_capacity: 1 << 10,
            ..HostConfig::DEFAULT
        });
        assert_eq!(a.arena_size(), want, "arena_size {size}, min {min}");
        let layout = Layout::from_size_align(size - (1 << 20), 8).unwrap();
        // SAFETY: a non-zero size; the block is freed with its layout.
        unsafe {
            let p = a.alloc(layout);
            assert!(
                !p.is_null(),
                "{} bytes from an arena of {size}",
                layout.size()
            );
            a.dealloc(p, layout);
        }
    }
}

/// A release threshold of 0 (every freed chunk counts) and one larger than the arena (none
/// does) are both usable: blocks come and go, stay intact, and the heap checks clean.
#[test]
#[cfg_attr(
    miri,
    ignore = "writes and checks 100 MiB byte by byte: over 15 minutes under Miri"
)]
fn extreme_release_thresholds_work() {
    for release_threshold in [0, usize::MAX] {
        let a = GlobalBfc::with_config(HostConfig {
            arena_size: 64 << 20,
            min_arena_size: 64 << 20,
            chunk_capacity: 1 << 12,
            release_threshold,
            ..HostConfig::DEFAULT
        });
        let sizes = [20_000, 1 << 20, 3 << 20, 70_000, 9 << 20];
        let mut blocks = std::vec::Vec::new();
        for round in 0..4u8 {
            for &size in &sizes {
                let layout = Layout::from_size_align(size, 64).unwrap();
                // SAFETY: a non-zero size.
                let p = unsafe { a.alloc_zeroed(layout) };
                assert!(!p.is_null());
                // SAFETY: `p` holds `size` bytes.
                let block = unsafe { core::slice::from_raw_parts_mut(p, size) };
                assert!(block.iter().all(|&b| b == 0), "old data in a zeroed block");
                block.fill(round + 1);
                blocks.push((p, layout, round + 1));
            }
            // Free every other block, oldest first, so frees land beside live neighbours.
            let mut i = 0;
            blocks.retain(|&(p, layout, fill)| {
                i += 1;
                // SAFETY: each block holds `layout.size()` bytes.
                let block = unsafe { core::slice::from_raw_parts(p, layout.size()) };
                assert!(block.iter().all(|&b| b == fill), "a live block changed");
                if i % 2 == 0 {
                    // SAFETY: `p` came from `a.alloc_zeroed(layout)` and is freed once.
                    unsafe { a.dealloc(p, layout) };
                    false
                } else {
                    true
                }
            });
            a.check().unwrap();
        }
        for (p, layout, _) in blocks {
            // SAFETY: as above.
            unsafe { a.dealloc(p, layout) };
        }
        a.check().unwrap();
        assert_eq!(a.stats().bytes_in_use, 0, "threshold {release_threshold}");
    }
}

/// Whether this process is the child running `case`.
pub(super) fn is_child(case: &str) -> bool {
    std::env::var(CHILD_ENV).is_ok_and(|c| c == case)
}

/// Runs the test `host::tests::<case>` in a child process: `(status, stdout, stderr)`.
fn run_child(case: &str) -> (std::process::ExitStatus, String, String) {
    run_child_at("host::tests", case)
}

/// Runs the test `module::case` in a child process, which must abort (SIGABRT) with `message`
/// on stderr, before it prints "survived".
pub(super) fn assert_child_aborts(module: &str, case: &str, message: &str) {
    let (status, stdout, stderr) = run_child_at(module, case);
    assert_eq!(status.signal(), Some(libc::SIGABRT), "{stdout}{stderr}");
    assert!(stderr.contains(message), "{stderr}");
    assert!(!stdout.contains("survived"), "{stdout}");
}

/// Runs the test `module::case` alone in a child process, which [`is_child`] tells apart.
/// A child still running after a minute (a hang where an abort was expected) is killed and
/// fails the test.
pub(super) fn run_child_at(module: &str, case: &str) -> (std::process::ExitStatus, String, String) {
    use std::process::Stdio;
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", &std::format!("{module}::{case}"), "--nocapture"])
        .env(CHILD_ENV, case)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > std::time::Duration::from_secs(60) {
            child.kill().unwrap();
            panic!("child {case} still running after 60 s");
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status,
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
#[cfg_attr(miri, ignore = "spawns a child process")]
fn a_panic_under_the_heap_lock_aborts() {
    let case = "a_panic_under_the_heap_lock_aborts";
    if is_child(case) {
        let a = small_instance();
        a.with_heap(|_| panic!("a bug under the lock"));
        std::println!("child survived");
        return;
    }
    assert_child_aborts(
        "host::tests",
        case,
        "bfc-alloc: fatal: panic inside the allocator, with its heap locked",
    );
}

/// A block handed out past the committed end of the arena (a bug: every caller commits first)
/// aborts with a clear message before the caller's first write would fault.
#[test]
#[cfg_attr(miri, ignore = "spawns a child process")]
fn a_block_past_the_committed_arena_aborts() {
    let case = "a_block_past_the_committed_arena_aborts";
    if is_child(case) {
        let a = small_instance();
        a.with_heap(|h| {
            let end = h.bfc.source().committed_end();
            h.note_allocated(end - 16, 32);
        });
        std::println!("child survived");
        return;
    }
    assert_child_aborts("host::tests", case, "beyond the committed arena; aborting");
}

/// A thread cache registered twice (as when a thread that exited unflushed left its cache in the
/// registry and a new thread reuses its storage) makes a cycle of the registry: `stats` aborts
/// with a message that says so, rather than walk it for ever. So does a second registration at
/// the head.
#[test]
#[cfg_attr(miri, ignore = "spawns a child process")]
fn a_cache_registered_twice_aborts_rather_than_loop() {
    for case in [
        "a_cache_registered_twice_aborts_rather_than_loop_in_a_walk",
        "a_cache_registered_twice_aborts_rather_than_loop_at_the_head",
    ] {
        assert_child_aborts(
            "host::tests",
            case,
            "the thread cache registry is corrupted",
        );
    }
}

/// Registers `caches` in order on a private instance's heap, then walks the registry (`stats`).
fn register_then_walk(caches: &[&ThreadCache]) {
    let a = small_instance();
    a.with_heap(|h| {
        for tc in caches {
            h.register(tc);
        }
    });
    let _ = a.stats();
    std::println!("child survived");
}

#[test]
#[cfg_attr(miri, ignore = "run as a child process")]
fn a_cache_registered_twice_aborts_rather_than_loop_in_a_walk() {
    if is_child("a_cache_registered_twice_aborts_rather_than_loop_in_a_walk") {
        let (x, y) = (ThreadCache::new(), ThreadCache::new());
        register_then_walk(&[&x, &y, &x]);
    }
}

#[test]
#[cfg_attr(miri, ignore = "run as a child process")]
fn a_cache_registered_twice_aborts_rather_than_loop_at_the_head() {
    if is_child("a_cache_registered_twice_aborts_rather_than_loop_at_the_head") {
        let x = ThreadCache::new();
        register_then_walk(&[&x, &x]);
    }
}

/// The checker sees a block in the calling thread's cache that its span holds as free (a double
/// free not caught yet).
#[test]
fn the_checker_sees_a_thread_cache_holding_a_free_block() {
    std::thread::spawn(|| {
        let a = small_instance();
        let l = Layout::from_size_align(64, 8).unwrap();
        // SAFETY: a valid layout; the block is freed once with it.
        let p = unsafe { a.alloc(l) } as usize;
        assert_ne!(p, 0);
        // SAFETY: as above.
        unsafe { a.dealloc(p as *mut u8, l) };
        a.flush_thread_cache();
        a.check().unwrap();
        let c = small::class_for(64, 8).unwrap();
        tcache::with(|tc| tc.fill(c, p)).unwrap();
        assert_eq!(
            a.check().unwrap_err().what,
            "thread cache holds a block that is not a live object of its class"
        );
        // Take it out again before the thread's exit flush meets it.
        assert_eq!(tcache::with(|tc| tc.pop(c)).unwrap(), Some(p));
        a.check().unwrap();
    })
    .join()
    .unwrap();
}

/// The checker sees a block in use past the heap's recorded end of touched memory, and a block
/// in the transfer cache that its span holds as free.
#[test]
fn the_checker_sees_a_block_past_brk_and_a_free_block_in_the_transfer_cache() {
    let a = GlobalBfc::with_config(HostConfig {
        thread_cache: false,
        ..*small_instance().config()
    });
    let big = Layout::from_size_align(1 << 20, 8).unwrap();
    // SAFETY: a valid layout; freed once with it below.
    let p = unsafe { a.alloc(big) };
    assert!(!p.is_null());
    a.check().unwrap();
    let brk = a
        .with_heap(|h| core::mem::replace(&mut h.brk, p as usize))
        .unwrap();
    assert_eq!(
        a.check().unwrap_err().what,
        "a block in use ends past the heap's recorded end of touched memory"
    );
    a.with_heap(|h| h.brk = brk).unwrap();
    a.check().unwrap();
    // SAFETY: allocated above with `big`.
    unsafe { a.dealloc(p, big) };

    let l = Layout::from_size_align(64, 8).unwrap();
    // SAFETY: a valid layout; freed once with it.
    let q = unsafe { a.alloc(l) } as usize;
    assert_ne!(q, 0);
    // SAFETY: as above.
    unsafe { a.dealloc(q as *mut u8, l) };
    let c = small::class_for(64, 8).unwrap();
    a.with_heap(|h| assert_eq!(h.transfer.push_from(c, &[q]), 1))
        .unwrap();
    assert_eq!(
        a.check().unwrap_err().what,
        "transfer cache holds a block that is not a live object of its class"
    );
    let mut out = [0usize; 1];
    a.with_heap(|h| assert_eq!(h.transfer.pop_into(c, &mut out), 1))
        .unwrap();
    assert_eq!(out[0], q);
    a.check().unwrap();
}

#[test]
#[cfg_attr(miri, ignore = "spawns a child process")]
fn a_thread_that_reenters_the_heap_lock_aborts() {
    let case = "a_thread_that_reenters_the_heap_lock_aborts";
    if is_child(case) {
        let a = small_instance();
        // What an allocation from inside the allocator would do: wait for the lock it holds.
        a.with_heap(|_| a.with_heap(|_| ()));
        std::println!("child survived");
        return;
    }
    assert_child_aborts(
        "host::tests",
        case,
        "bfc-alloc: fatal: allocator re-entered by the thread holding its lock",
    );
}

/// The pointer map has one entry per 4 KiB of arena (`MAP_BLOCK`); a lookup walks from the first
/// chunk starting in a block. Here three chunks start in one map block, the most the host makes:
/// engine blocks aligned to at most a page are larger than the slab limit (16 KiB), and start on a
/// page boundary unless a large one is placed off the grid (no grid point has room for it);
/// over-aligned ones start 8 KiB or more apart; and no two free chunks are neighbours. So: a 32-byte
/// block aligned to 8 KiB, a large block placed off the grid right behind it (in a full arena),
/// then the first block shrunk in place to 16 bytes, which leaves a free chunk between the two.
/// Each block is found by its own address, and freed in an order that leaves the map block's
/// later chunk for last.
#[test]
fn blocks_starting_in_one_map_block_are_each_found() {
    let a = small_instance();
    let mut live = fill_engine(&a);
    let x = free_mib_blocks(&a, &mut live, 1);
    // The first ones take what room the filling left (best fit), then one takes the freed place.
    let tiny = layout(32, 8192);
    let mut tries = 0;
    let t = loop {
        let p = alloc_ok(&a, tiny);
        if p as usize == x {
            break p;
        }
        live.push((p, tiny));
        tries += 1;
        assert!(tries < 1000, "no tiny block took the freed place");
    };
    // No 64 KiB grid point in the rest of the place has room for it: off the grid, behind `t`.
    let large = layout((1 << 20) - 32, 16);
    let n = alloc_ok(&a, large);
    assert_eq!(n as usize, x + 32, "the large block is not right behind");
    // An over-aligned block shrinks in place (no slab class serves 8 KiB alignment).
    // SAFETY: `t` came from `a` with `tiny`.
    assert_eq!(unsafe { a.realloc(t, tiny, 16) }, t);
    let tiny = layout(16, 8192);
    let starts = a
        .with_heap(|h| {
            let mut starts = std::collections::BTreeMap::<usize, usize>::new();
            for c in h.bfc.chunks() {
                *starts.entry(c.ptr() / MAP_BLOCK).or_default() += 1;
            }
            starts
        })
        .unwrap();
    assert_eq!(
        starts[&(x / MAP_BLOCK)],
        3,
        "the map block does not hold three starts"
    );
    assert_eq!(starts.values().max(), Some(&3));
    assert!(a.usable_size(t).is_some_and(|u| u >= 16));
    assert!(a.usable_size(n).is_some_and(|u| u >= large.size()));
    assert_eq!(a.check(), Ok(()));
    // SAFETY: `t` came from `a` with `tiny` (its layout since the shrink) and is freed once.
    unsafe { a.dealloc(t, tiny) };
    assert_eq!(a.check(), Ok(()));
    live.push((n, large));
    free_all(&a, live);
}

#[test]
fn the_recorded_end_of_touched_memory_covers_whole_blocks() {
    // A request that is not a multiple of the granule gets a larger block; its caller may write
    // all of it (`usable_size`), so the heap's end of touched memory must cover it.
    let a = small_instance();
    // Engine blocks of the requested size: above the slab limit, aligned beyond what medium
    // blocks serve.
    let (size, grown) = (small::SMALL_MAX + 905, small::SMALL_MAX + 4905);
    let layout = Layout::from_size_align(size, BEYOND_MEDIUM).unwrap();
    // SAFETY: a non-zero size.
    let p = unsafe { a.alloc(layout) };
    assert!(!p.is_null());
    assert_eq!(a.usable_size(p), Some(size + 7));
    assert_eq!(a.check(), Ok(()));
    // SAFETY: `p` came from `a.alloc(layout)`; grows it to a size that is no granule multiple.
    let q = unsafe { a.realloc(p, layout, grown) };
    assert!(!q.is_null());
    assert_eq!(a.usable_size(q), Some(grown + 7));
    assert_eq!(a.check(), Ok(()));
    // SAFETY: `q` came from the realloc above, with the new size.
    unsafe { a.dealloc(q, Layout::from_size_align(grown, BEYOND_MEDIUM).unwrap()) };
}

/// How many of the pages of `p..p + len` (page-aligned) are resident.
fn resident_pages(p: *mut u8, len: usize) -> usize {
    let page = os::page_size();
    let mut v = std::vec![0u8; len.div_ceil(page)];
    // SAFETY: `p..p + len` is a page-aligned mapped range; `v` has one byte per page.
    let rc = unsafe { libc::mincore(p.cast(), len, v.as_mut_ptr()) };
    assert_eq!(rc, 0, "mincore");
    v.iter().filter(|&&b| b & 1 != 0).count()
}

/// `check()` reports memory in use past what is committed: the arena below `brk`, the map, span
/// and medium-table entries of the committed arena, the chunk records touched.
#[test]
fn check_reports_use_past_the_committed_parts() {
    let a = GlobalBfc::with_config(HostConfig {
        arena_size: 64 << 20,
        min_arena_size: 64 << 20,
        chunk_capacity: 1 << 12,
        ..HostConfig::DEFAULT
    });
    let big = Layout::from_size_align(3 << 20, 8).unwrap();
    let small = Layout::from_size_align(100, 8).unwrap();
    // SAFETY: non-zero layouts; the blocks stay live until the allocator is dropped.
    let (p, q) = unsafe { (a.alloc(big), a.alloc(small)) };
    assert!(!p.is_null() && !q.is_null());
    a.check().unwrap();
    // Each part, the bytes of it the heap uses now, and what `check()` says without them.
    type Part = fn(&mut HostSource) -> &mut Prefix;
    type Need = fn(&Heap) -> usize;
    let parts: [(Part, Need, &str); 5] = [
        (
            |s| &mut s.arena_commit,
            |h| h.brk - h.bfc.source().arena,
            "past the committed end of the arena",
        ),
        (
            |s| &mut s.map_commit,
            |h| {
                h.bfc
                    .source()
                    .described_by(h.bfc.source().arena_commit.done)
                    .0
            },
            "not committed as far as the arena",
        ),
        (
            |s| &mut s.spans_commit,
            |h| {
                h.bfc
                    .source()
                    .described_by(h.bfc.source().arena_commit.done)
                    .1
            },
            "not committed as far as the arena",
        ),
        (
            |s| &mut s.medium_commit,
            |h| {
                h.bfc
                    .source()
                    .described_by(h.bfc.source().arena_commit.done)
                    .2
            },
            "not committed as far as the arena",
        ),
        (
            |s| &mut s.table_commit,
            |h| h.bfc.records_touched() * core::mem::size_of::<Chunk>(),
            "chunk records",
        ),
    ];
    for (part, need, what) in parts {
        // Pretend the part were committed exactly as far as needed, then one byte less.
        let done = a.with_heap(|h| part(h.bfc.source_mut()).done).unwrap();
        for short in [0, 1] {
            a.with_heap(|h| {
                let need = need(h);
                assert!(need > 0 && need <= done, "{what}: {need} of {done}");
                part(h.bfc.source_mut()).done = need - short;
            });
            match (short, a.check()) {
                (0, Ok(())) => {}
                (1, Err(e)) if e.what.contains(what) => {}
                (_, r) => panic!("{what}, {short} byte short: {r:?}"),
            }
        }
        a.with_heap(|h| part(h.bfc.source_mut()).done = done);
    }
    a.check().unwrap();
}

/// Bytes of `lo..hi` in readable and writable mappings (`/proc/self/maps`).
fn accessible_bytes(lo: usize, hi: usize) -> usize {
    bytes_in_maps(lo, hi, |perms| perms.starts_with("rw"))
}

/// Bytes of `lo..hi` in the mappings (`/proc/self/maps`) whose permissions `keep` accepts.
fn bytes_in_maps(lo: usize, hi: usize, keep: impl Fn(&str) -> bool) -> usize {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .filter_map(|line| {
            let mut f = line.split_whitespace();
            let (a, b) = f.next()?.split_once('-')?;
            let kept = keep(f.next()?);
            let (a, b) = (
                usize::from_str_radix(a, 16).ok()?,
                usize::from_str_radix(b, 16).ok()?,
            );
            kept.then(|| b.min(hi).saturating_sub(a.max(lo)))
        })
        .sum()
}

/// Only what the heap reached is accessible: the arena's committed prefix follows its highest
/// block in 2 MiB steps, and so do the pointer map, the span table, the medium table and the chunk
/// table; the rest of each reservation stays `PROT_NONE` (the medium table's, read-only): no
/// commit charge under strict overcommit, not counted by `RLIMIT_DATA`. When the free top goes back to the kernel, the committed prefix
/// follows it down; a free elsewhere keeps its memory committed for reuse.
#[test]
#[cfg_attr(miri, ignore = "Miri has no mprotect")]
fn only_what_the_heap_reached_is_committed() {
    let a = GlobalBfc::with_config(HostConfig {
        arena_size: 1 << 30,
        min_arena_size: 1 << 30,
        ..HostConfig::DEFAULT
    });
    let parts = |a: &GlobalBfc| {
        a.with_heap(|h| {
            let s = h.bfc.source();
            (
                s.arena_commit,
                [
                    s.map_commit,
                    s.table_commit,
                    s.spans_commit,
                    s.medium_commit,
                ],
            )
        })
        .unwrap()
    };
    let agree = |a: &GlobalBfc| {
        let (arena, meta) = parts(a);
        for p in core::iter::once(arena).chain(meta) {
            assert!(p.done < p.len, "a whole part is committed");
            assert_eq!(accessible_bytes(p.at, p.at + p.len), p.done);
        }
        // The medium table's rest is readable (thread caches read any entry), not writable.
        let medium = meta[3];
        assert_eq!(
            bytes_in_maps(medium.at + medium.done, medium.at + medium.len, |perms| {
                perms.starts_with("r-")
            }),
            medium.len - medium.done
        );
        // The arena's commit moves (up and down) in whole steps.
        assert_eq!(
            arena.done % super::arena::COMMIT_STEP,
            0,
            "committed {}",
            arena.done
        );
        arena.done
    };
    let l = Layout::from_size_align(3 << 20, 8).unwrap();
    let small = Layout::from_size_align(100, 8).unwrap();
    // SAFETY: non-zero layouts; each block is freed once with its layout.
    unsafe {
        let p = a.alloc(l);
        let q = a.alloc(small);
        assert!(!p.is_null() && !q.is_null());
        let done = agree(&a);
        assert!((3 << 20..=8 << 20).contains(&done), "committed {done}");
        let big = Layout::from_size_align(100 << 20, 8).unwrap();
        let r = a.alloc(big);
        assert!(!r.is_null());
        r.add((100 << 20) - 1).write(1);
        let done = agree(&a);
        assert!((103 << 20..=110 << 20).contains(&done), "committed {done}");
        let first_end = r as usize + (100 << 20) - 1;
        // A free of 64 MiB or more at the top keeps only 1 MiB of the top touched, and the arena is
        // committed only to the 2 MiB step past that.
        a.dealloc(r, big);
        let trimmed = agree(&a);
        assert!(
            (4 << 20..=8 << 20).contains(&trimmed),
            "committed {trimmed}"
        );
        // A block freed below the top keeps its commit: a block of its size needs no more.
        let hole = Layout::from_size_align(50 << 20, 8).unwrap();
        let s = a.alloc(hole);
        let t = a.alloc(l);
        assert!(!s.is_null() && !t.is_null());
        s.add((50 << 20) - 1).write(1);
        t.write(1);
        let done = agree(&a);
        assert!((56 << 20..=62 << 20).contains(&done), "committed {done}");
        a.dealloc(s, hole);
        assert_eq!(agree(&a), done, "a free below the top gave up the commit");
        let s = a.alloc(hole);
        assert!(s as usize + (50 << 20) <= parts(&a).0.at + done);
        assert_eq!(agree(&a), done);
        // The top commits again as a block reaches it, zero-filled.
        let r = a.alloc_zeroed(big);
        assert!(!r.is_null());
        let first_end = first_end as *const u8;
        assert!(r.cast_const() <= first_end && first_end < r.add(100 << 20));
        assert_eq!(*first_end, 0, "the first block's byte came back");
        assert!(agree(&a) >= done + (100 << 20));
        for (x, lx) in [(r, big), (s, hole), (t, l), (p, l), (q, small)] {
            a.dealloc(x, lx);
        }
    }
    a.check().unwrap();
}

/// Bytes of `lo..hi` in any mapping, accessible or not (`/proc/self/maps`).
fn mapped_bytes(lo: usize, hi: usize) -> usize {
    bytes_in_maps(lo, hi, |_| true)
}

/// A decommit of the free top whose fixed mapping fails, each way it can, leaves the heap working:
/// the committed end moves down all the same. Left mapped, the range (its pages discarded) is
/// committed again by a growth there and given back by the next trim; left unmapped, it is
/// reserved again at once (not left for another mapping to take). In a child process of its
/// own: the hole the switch makes must not meet another test's `mmap`.
#[test]
#[cfg_attr(miri, ignore = "Miri has no fixed mappings")]
fn a_failed_decommit_leaves_the_heap_working() {
    use os::tests::{arm, Refusal};
    let case = "a_failed_decommit_leaves_the_heap_working";
    if !is_child(case) {
        let (status, stdout, stderr) = run_child(case);
        assert!(status.success(), "{stdout}{stderr}");
        assert!(stdout.contains("both refusals checked"), "{stdout}{stderr}");
        return;
    }
    let big = Layout::from_size_align(100 << 20, 8).unwrap();
    for how in [Refusal::Kept, Refusal::Hole] {
        let a = GlobalBfc::with_config(HostConfig {
            arena_size: 256 << 20,
            min_arena_size: 256 << 20,
            thread_cache: false,
            ..HostConfig::DEFAULT
        });
        let committed = |a: &GlobalBfc| a.with_heap(|h| h.bfc.source().arena_commit.done).unwrap();
        // SAFETY: non-zero layouts; each block is written within its size and freed once with it.
        unsafe {
            let p = a.alloc(big);
            assert!(!p.is_null());
            p.write_bytes(1, 100 << 20);
            let last = p.add((100 << 20) - 1) as usize;
            let (arena, len) = a
                .with_heap(|h| (h.bfc.source().arena, h.bfc.source().arena_size))
                .unwrap();
            arm(arena, arena + len, how);
            a.dealloc(p, big);
            let done = committed(&a);
            assert!(done <= 4 << 20, "{how:?}: committed {done}");
            // The whole arena is mapped (reserved again after a hole); what the failed decommit
            // left stays readable and writable only when it was kept.
            assert_eq!(mapped_bytes(arena, arena + len), len, "{how:?}");
            let accessible = accessible_bytes(arena, arena + len);
            match how {
                Refusal::Kept => assert!(accessible >= 100 << 20, "{how:?}: {accessible}"),
                Refusal::Hole => assert_eq!(accessible, done),
            }
            a.check().unwrap();
            // The heap grows over the range again, zero-filled.
            let p = a.alloc_zeroed(big);
            assert!(!p.is_null(), "{how:?}: no growth after the failure");
            assert!((p as usize..p as usize + (100 << 20)).contains(&last));
            assert_eq!(*(last as *const u8), 0, "{how:?}: the old byte came back");
            p.write_bytes(2, 100 << 20);
            a.dealloc(p, big);
            // And the next trim gives it back.
            let done = committed(&a);
            assert!(done <= 4 << 20, "{how:?}: the next trim kept {done}");
            assert_eq!(accessible_bytes(arena, arena + len), done, "{how:?}");
            a.check().unwrap();
        }
    }
    std::println!("both refusals checked");
}

/// The metadata reservation is marked "no huge pages" (`nh` in its smaps `VmFlags`): with
/// transparent huge pages on for every mapping, each of its sparse touches (a page of the
/// pointer map, of the chunk table, of the span table) would make 2 MiB resident.
#[test]
#[cfg_attr(miri, ignore = "Miri has no /proc")]
fn metadata_is_not_backed_by_huge_pages() {
    if !std::path::Path::new("/sys/kernel/mm/transparent_hugepage").exists() {
        std::println!("skipped: this kernel has no transparent huge pages");
        return;
    }
    let a = small_instance();
    assert!(a.arena_size() > 0);
    let anchor = a.anchor.load(crate::sync::Ordering::Acquire) as usize;
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut inside = false;
    let mut flags = None;
    for line in smaps.lines() {
        let range = line.split_once(' ').and_then(|(r, _)| r.split_once('-'));
        if let Some((Ok(lo), Ok(hi))) =
            range.map(|(lo, hi)| (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16)))
        {
            inside = (lo..hi).contains(&anchor);
        } else if let (true, Some(f)) = (inside, line.strip_prefix("VmFlags:")) {
            flags = Some(String::from(f));
            break;
        }
    }
    let flags = flags.expect("no mapping holds the heap's anchor");
    assert!(
        flags.split_whitespace().any(|f| f == "nh"),
        "VmFlags:{flags}"
    );
}

#[test]
#[cfg_attr(miri, ignore = "Miri has no mincore")]
fn zeroed_blocks_of_untouched_memory_are_not_written() {
    let a = small_instance();
    let size = 512 << 10; // below the release threshold: zeroed by writing
    let layout = Layout::from_size_align(size, 4096).unwrap();
    // SAFETY: a non-zero size.
    let p = unsafe { a.alloc_zeroed(layout) };
    assert!(!p.is_null());
    assert_eq!(resident_pages(p, size), 0, "fresh memory was written");
    // SAFETY: `p` holds `size` bytes.
    let block = unsafe { core::slice::from_raw_parts_mut(p, size) };
    assert!(block.iter().all(|&b| b == 0));
    block.fill(0xa5);
    // SAFETY: `p` came from `a.alloc_zeroed(layout)`.
    unsafe { a.dealloc(p, layout) };
    // The same memory again, now dirty, and more: the block straddles the end of touched memory.
    let layout = Layout::from_size_align(2 * size, 4096).unwrap();
    // SAFETY: a non-zero size.
    let q = unsafe { a.alloc_zeroed(layout) };
    assert!(!q.is_null());
    assert!(
        q <= p && p < q.wrapping_add(size),
        "the dirty block was not reused"
    );
    // SAFETY: `q` holds `2 * size` bytes.
    let block = unsafe { core::slice::from_raw_parts(q, 2 * size) };
    assert!(block.iter().all(|&b| b == 0), "old data in a zeroed block");
    // The `Allocator` trait's zeroed allocation too, of fresh memory (`q` is still live), 2 MiB
    // past the memory written above (with transparent huge pages always on, a write faults
    // in its whole 2 MiB-aligned page).
    let gap = Layout::from_size_align(2 << 20, 4096).unwrap();
    // SAFETY: a non-zero size; never written.
    let spacer = unsafe { a.alloc(gap) };
    assert!(!spacer.is_null());
    let small = Layout::from_size_align(size, 4096).unwrap();
    let r = allocator_api2::alloc::Allocator::allocate_zeroed(&a, small).unwrap();
    let r = r.cast::<u8>();
    assert!(
        r.as_ptr() >= q.wrapping_add(2 * size),
        "not above the touched memory"
    );
    assert_eq!(
        resident_pages(r.as_ptr(), size),
        0,
        "fresh memory was written"
    );
    // SAFETY: `r` came from `allocate_zeroed(small)`, `spacer` from `a.alloc(gap)`, `q` from
    // `a.alloc_zeroed(layout)`.
    unsafe {
        allocator_api2::alloc::Allocator::deallocate(&a, r, small);
        a.dealloc(spacer, gap);
        a.dealloc(q, layout);
    }
}

#[test]
#[cfg_attr(miri, ignore = "Miri has no mlock")]
fn pages_the_kernel_keeps_are_still_zeroed() {
    // A locked page cannot be discarded (`madvise` fails on it and skips the rest of the range),
    // so the free top keeps its end of touched memory and `alloc_zeroed` writes the zeros.
    let a = GlobalBfc::with_config(HostConfig {
        arena_size: 256 << 20,
        min_arena_size: 256 << 20,
        chunk_capacity: 1 << 12,
        ..HostConfig::DEFAULT
    });
    let size = MAX_RETAIN; // freed whole at once: the trim covers it
    let layout = Layout::from_size_align(size, 4096).unwrap();
    // SAFETY: a non-zero size.
    let p = unsafe { a.alloc(layout) };
    assert!(!p.is_null());
    // SAFETY: `p` holds `size` bytes.
    unsafe { p.write_bytes(0xa5, size) };
    let locked = p.wrapping_add(size / 2);
    // SAFETY: one page inside the block.
    if unsafe { libc::mlock(locked.cast(), 4096) } != 0 {
        std::println!(
            "skipped: mlock refused ({}); raise RLIMIT_MEMLOCK to run this test",
            std::io::Error::last_os_error()
        );
        // SAFETY: `p` came from `a.alloc(layout)`.
        unsafe { a.dealloc(p, layout) };
        return;
    }
    // SAFETY: `p` came from `a.alloc(layout)`.
    unsafe { a.dealloc(p, layout) };
    // SAFETY: a non-zero size.
    let q = unsafe { a.alloc_zeroed(layout) };
    assert_eq!(q, p, "the freed block was not reused");
    // SAFETY: `q` holds `size` bytes.
    let block = unsafe { core::slice::from_raw_parts(q, size) };
    let stale = block.iter().position(|&b| b != 0);
    // SAFETY: the page locked above.
    unsafe { libc::munlock(locked.cast(), 4096) };
    assert_eq!(stale, None, "alloc_zeroed returned old data");
    assert_eq!(a.check(), Ok(()));
    // SAFETY: `q` came from `a.alloc_zeroed(layout)`.
    unsafe { a.dealloc(q, layout) };
}

/// An instance with a 512 MiB arena, for the give-back policy's large blocks.
fn big_instance() -> GlobalBfc {
    GlobalBfc::with_config(HostConfig {
        arena_size: 512 << 20,
        min_arena_size: 512 << 20,
        chunk_capacity: 1 << 12,
        ..HostConfig::DEFAULT
    })
}

/// The heap's end of touched memory.
fn brk(a: &GlobalBfc) -> usize {
    a.with_heap(|h| h.brk).unwrap()
}

/// Whether the `len` bytes at `p` all equal `byte`.
///
/// # Safety
/// `p..p + len` is readable.
unsafe fn filled_with(p: *const u8, len: usize, byte: u8) -> bool {
    // SAFETY: guaranteed by the caller.
    unsafe { core::slice::from_raw_parts(p, len) }
        .iter()
        .all(|&b| b == byte)
}

/// The neighbour of [`block_beside_a_neighbour`]: an engine block just above the slab limit,
/// aligned beyond what medium blocks serve (a medium block would start on the medium grid, not
/// right after the block).
fn neighbour() -> Layout {
    Layout::from_size_align(small::SMALL_MAX + 904, BEYOND_MEDIUM).unwrap()
}

/// An alignment beyond what medium blocks serve: a request of 16..64 KiB with it is an engine
/// block placed where it fits (not on the medium grid, not cached).
const BEYOND_MEDIUM: usize = 2 * medium::MEDIUM_ALIGN;

/// Allocates a block of `layout` (whose usable size must end on a [`BEYOND_MEDIUM`] boundary,
/// the neighbour's alignment) and the [`neighbour`] right after it (asserted); fills the
/// block, all of its usable size, with 0xa5 and the neighbour with 0x5a. Returns the block, its
/// usable size and the neighbour; the caller frees both.
fn block_beside_a_neighbour(a: &GlobalBfc, layout: Layout) -> (*mut u8, usize, *mut u8) {
    // Blocks an earlier step left in this thread's cache go back to the engine first, so the two
    // land where the engine's fit puts them.
    a.flush_thread_cache();
    // SAFETY: non-zero sizes.
    let (p, n) = unsafe { (a.alloc(layout), a.alloc(neighbour())) };
    assert!(!p.is_null() && !n.is_null());
    let usable = a.usable_size(p).unwrap();
    assert_eq!(
        n as usize,
        p as usize + usable,
        "the neighbour does not follow"
    );
    // SAFETY: each block holds at least the bytes written.
    unsafe {
        p.write_bytes(0xa5, usable);
        n.write_bytes(0x5a, neighbour().size());
    }
    (p, usable, n)
}

/// Writes a block of `layout` whole and frees it, runs `between`, then takes `layout` again
/// through `alloc_zeroed`: asserts that the same block came back, and that it reads zero.
fn dirty_then_zeroed(a: &GlobalBfc, layout: Layout, between: impl FnOnce()) -> *mut u8 {
    // SAFETY: a non-zero size.
    let p = unsafe { a.alloc(layout) };
    assert!(!p.is_null());
    // SAFETY: `p` holds its usable size; it came from `a.alloc(layout)` and is freed once.
    unsafe {
        p.write_bytes(0xa5, a.usable_size(p).unwrap());
        a.dealloc(p, layout);
    }
    between();
    // SAFETY: a non-zero size.
    let z = unsafe { a.alloc_zeroed(layout) };
    assert_eq!(z, p, "not reused");
    // SAFETY: `z` holds `layout.size()` bytes.
    let ok = unsafe { filled_with(z, layout.size(), 0) };
    assert!(ok, "old data in a zeroed block");
    z
}

#[test]
#[cfg_attr(miri, ignore = "Miri has no mincore")]
fn the_free_top_keeps_four_times_the_largest_freed_block() {
    let a = big_instance();
    let mb = 1 << 20;
    let l = Layout::from_size_align(2 * mb, 4096).unwrap();
    // SAFETY: a non-zero size.
    let ps: std::vec::Vec<*mut u8> = (0..8).map(|_| unsafe { a.alloc(l) }).collect();
    for &p in &ps {
        assert!(!p.is_null());
        // SAFETY: `p` holds `2 * mb` bytes.
        unsafe { p.write_bytes(0xa5, 2 * mb) };
    }
    let start = ps[0] as usize;
    assert_eq!(ps[7] as usize, start + 14 * mb, "blocks are not contiguous");
    for &p in &ps {
        // SAFETY: `p` came from `a.alloc(l)`, freed once.
        unsafe { a.dealloc(p, l) };
    }
    // The last free merged everything into the free top: 16 MiB touched, four times the largest
    // freed block (8 MiB) kept, the rest given back.
    assert_eq!(brk(&a), start + 8 * mb);
    assert_eq!(resident_pages((start + 8 * mb) as *mut u8, 8 * mb), 0);
    assert_eq!(a.check(), Ok(()));
}

#[test]
#[cfg_attr(miri, ignore = "Miri has no mincore")]
fn a_huge_block_freed_at_the_top_goes_back_whole() {
    let a = big_instance();
    let mb = 1 << 20;
    // Raise the retained amount to 40 MiB with an interior free.
    let mid = Layout::from_size_align(10 * mb, 4096).unwrap();
    let guard = Layout::from_size_align(64 << 10, 4096).unwrap();
    // SAFETY: non-zero sizes.
    let (x, g) = unsafe { (a.alloc(mid), a.alloc(guard)) };
    // SAFETY: `x` holds `10 * mb` bytes; it came from `a.alloc(mid)`.
    unsafe {
        x.write_bytes(1, 10 * mb);
        a.dealloc(x, mid);
    }
    let huge = Layout::from_size_align(MAX_RETAIN, 4096).unwrap();
    // SAFETY: a non-zero size.
    let p = unsafe { a.alloc(huge) };
    assert!(p as usize > g as usize, "not at the top");
    // SAFETY: `p` holds `MAX_RETAIN` bytes; it came from `a.alloc(huge)`.
    unsafe {
        p.write_bytes(0xa5, MAX_RETAIN);
        a.dealloc(p, huge);
    }
    // Like a glibc mmapped chunk: only the release threshold stays touched.
    let threshold = a.config().release_threshold;
    assert_eq!(brk(&a), p as usize + threshold);
    assert_eq!(
        resident_pages(p.wrapping_add(threshold), MAX_RETAIN - threshold),
        0
    );
    // SAFETY: `g` came from `a.alloc(guard)`.
    unsafe { a.dealloc(g, guard) };
    assert_eq!(a.check(), Ok(()));
}

#[test]
#[cfg_attr(miri, ignore = "Miri has no mincore")]
fn a_huge_interior_block_gives_back_its_pages_at_once_and_spares_its_neighbours() {
    let a = big_instance();
    // Not a page multiple: the block's last page is shared with the next block.
    let huge = Layout::from_size_align(MAX_RETAIN + BEYOND_MEDIUM, 8).unwrap();
    let keep = Layout::from_size_align(32 << 20, 4096).unwrap();
    let (p, usable, n) = block_beside_a_neighbour(&a, huge);
    // SAFETY: a non-zero size.
    let k = unsafe { a.alloc(keep) };
    assert!(!k.is_null());
    // SAFETY: `p` came from `a.alloc(huge)`.
    unsafe { a.dealloc(p, huge) };
    let page = os::page_size();
    // Every page wholly inside the freed block went back at once.
    assert_eq!(resident_pages(p, usable & !(page - 1)), 0);
    // SAFETY: `n` is live and holds the neighbour's bytes.
    let ok = unsafe { filled_with(n, neighbour().size(), 0x5a) };
    assert!(ok, "a live neighbour lost its data");
    // SAFETY: `n` and `k` came from `a.alloc`.
    unsafe {
        a.dealloc(n, neighbour());
        a.dealloc(k, keep);
    }
    assert_eq!(a.check(), Ok(()));
}

/// A sweep gives back only the whole pages of a free chunk: the page it shares with the live
/// block after it (the chunk ends mid-page) keeps that block's bytes. (Below the size whose pages
/// go back at the free, so the release's sweep is what returns them.) A live engine block starts
/// mid-page only when it is a large one placed off the grid: here in a full arena, in the rest of
/// the place the block took, where no 64 KiB grid point has room for it.
#[test]
#[cfg_attr(miri, ignore = "Miri has no mincore")]
fn a_sweep_spares_the_page_a_free_chunk_shares_with_a_live_block() {
    let a = small_instance();
    let mut live = fill_engine(&a);
    let x = free_mib_blocks(&a, &mut live, 2);
    let block = layout((3 << 19) + 904, 16);
    let p = alloc_ok(&a, block);
    assert_eq!(p as usize, x, "the block did not take the freed place");
    let usable = a.usable_size(p).unwrap();
    let nl = layout(x + (2 << 20) - (p as usize + usable), 16);
    let n = alloc_ok(&a, nl);
    assert_eq!(
        n as usize,
        p as usize + usable,
        "the neighbour does not follow"
    );
    let page = os::page_size();
    assert_ne!(
        n as usize % page,
        0,
        "the neighbour starts on a page boundary"
    );
    // SAFETY: each block holds at least the bytes written; `p` came from `a.alloc(block)`.
    unsafe {
        p.write_bytes(0xa5, usable);
        n.write_bytes(0x5a, nl.size());
        a.dealloc(p, block);
    }
    let first = (p as usize).next_multiple_of(page);
    let last = (p as usize + usable) & !(page - 1);
    assert!(
        resident_pages(first as *mut u8, last - first) > 0,
        "already given back"
    );
    assert!(a.release_free_memory() >= last - first);
    assert_eq!(resident_pages(first as *mut u8, last - first), 0);
    // SAFETY: `n` is live and holds the neighbour's bytes.
    let ok = unsafe { filled_with(n, nl.size(), 0x5a) };
    assert!(ok, "a live neighbour lost its data");
    live.push((n, nl));
    free_all(&a, live);
}

#[test]
#[cfg_attr(miri, ignore = "a 128 MiB block in a 512 MiB arena")]
fn a_huge_shrink_in_place_keeps_the_blocks_last_page() {
    let a = big_instance();
    let old = Layout::from_size_align(2 * MAX_RETAIN, 8).unwrap();
    let new_size = MAX_RETAIN / 2 + 100; // the freed tail starts mid-page
    let guard = Layout::from_size_align(64 << 10, 8).unwrap();
    // SAFETY: non-zero sizes.
    let (p, g) = unsafe { (a.alloc(old), a.alloc(guard)) };
    assert!(!p.is_null() && !g.is_null());
    // SAFETY: `p` holds `2 * MAX_RETAIN` bytes.
    unsafe { p.add(new_size - 8192).write_bytes(0xa5, 8192) };
    // SAFETY: `p` came from `a.alloc(old)`.
    let q = unsafe { a.realloc(p, old, new_size) };
    assert_eq!(q, p, "shrinks in place");
    // SAFETY: `q` holds `new_size` bytes.
    let ok = unsafe { filled_with(q.add(new_size - 8192), 8192, 0xa5) };
    assert!(ok, "the shrunk block lost data");
    // SAFETY: from `realloc` (new size) and `a.alloc(guard)`.
    unsafe {
        a.dealloc(q, Layout::from_size_align(new_size, 8).unwrap());
        a.dealloc(g, guard);
    }
    assert_eq!(a.check(), Ok(()));
}

/// Frees a written 2 MiB block `x` (guarded from its neighbours) while `live` more bytes stay in
/// use, then frees and allocates a 3 MiB block elsewhere again and again: for each `(n, pages)` of
/// `steps`, `n` more times, after which `x` must have `pages` pages resident.
fn a_long_free_block_beside_churn(live: usize, steps: &[(usize, usize)]) {
    let a = big_instance();
    let mb = 1 << 20;
    let la = Layout::from_size_align(2 * mb, 4096).unwrap();
    let lb = Layout::from_size_align(3 * mb, 4096).unwrap();
    let guard = Layout::from_size_align(64 << 10, 4096).unwrap();
    let ll = Layout::from_size_align(live.max(1), 4096).unwrap();
    // SAFETY: non-zero sizes.
    let (l, x, g1, mut y, g2) = unsafe {
        (
            if live > 0 {
                a.alloc(ll)
            } else {
                core::ptr::null_mut()
            },
            a.alloc(la),
            a.alloc(guard),
            a.alloc(lb),
            a.alloc(guard),
        )
    };
    assert!([x, g1, y, g2].iter().all(|p| !p.is_null()) && (live == 0 || !l.is_null()));
    // SAFETY: `x` holds `2 * mb` bytes; it came from `a.alloc(la)`.
    unsafe {
        x.write_bytes(0xa5, 2 * mb);
        a.dealloc(x, la);
    }
    let mut freed = 2 * mb;
    for &(n, pages) in steps {
        for _ in 0..n {
            // SAFETY: `y` holds `3 * mb` bytes; it came from `a.alloc(lb)`.
            unsafe {
                y.write_bytes(1, 3 * mb);
                a.dealloc(y, lb);
                y = a.alloc(lb);
            }
            assert!(!y.is_null());
        }
        freed += n * 3 * mb;
        assert_eq!(
            resident_pages(x, 2 * mb),
            pages,
            "{} MiB freed with {} MiB in use",
            freed / mb,
            live / mb
        );
    }
    // SAFETY: from `a.alloc`.
    unsafe {
        a.dealloc(y, lb);
        a.dealloc(g1, guard);
        a.dealloc(g2, guard);
        if live > 0 {
            a.dealloc(l, ll);
        }
    }
    assert_eq!(a.check(), Ok(()));
}

/// Churn elsewhere: every few frees start a sweep, and the second one returns `x`, which stayed
/// free since the first.
#[test]
#[cfg_attr(miri, ignore = "Miri has no mincore")]
fn interior_frees_are_swept_once_they_stay_free() {
    let all = (2 << 20) / os::page_size();
    a_long_free_block_beside_churn(0, &[(0, all), (24, 0)]);
}

/// A free chunk whose head is reused between sweeps (a buffer allocated from it, written and freed
/// back again and again) never stays unchanged from one sweep to the next, so it never ages; past
/// its first `2 * MAX_RETAIN` (128 MiB) its pages go back at every sweep anyway. (Before, all
/// 160 MiB stayed resident for good.)
#[test]
#[cfg_attr(miri, ignore = "Miri has no mincore")]
fn a_free_chunk_whose_head_is_reused_keeps_at_most_its_first_128_mib() {
    let a = big_instance();
    let mb = 1 << 20;
    let lc = Layout::from_size_align(2 * mb, 4096).unwrap();
    let guard = Layout::from_size_align(64 << 10, 4096).unwrap();
    // A free chunk of 160 MiB, freed in pieces under the huge-free threshold (nothing goes back
    // at the frees themselves).
    let lp = Layout::from_size_align(16 * mb, 4096).unwrap();
    // SAFETY: a non-zero size.
    let g0 = unsafe { a.alloc(guard) };
    // SAFETY: a non-zero size.
    let pieces: std::vec::Vec<*mut u8> = (0..10).map(|_| unsafe { a.alloc(lp) }).collect();
    // SAFETY: a non-zero size.
    let g1 = unsafe { a.alloc(guard) };
    assert!(!g0.is_null() && !g1.is_null() && pieces.iter().all(|p| !p.is_null()));
    let x = pieces[0];
    for &p in &pieces {
        // SAFETY: `p` holds `16 * mb` bytes; it came from `a.alloc(lp)`.
        unsafe {
            p.write_bytes(0xa5, 16 * mb);
            a.dealloc(p, lp);
        }
    }
    for _ in 0..200 {
        // SAFETY: a non-zero size; `c` holds `2 * mb` bytes and came from `a.alloc(lc)`.
        unsafe {
            let c = a.alloc(lc);
            assert_eq!(c, x, "the churn takes the free chunk's head");
            c.write_bytes(1, os::page_size());
            a.dealloc(c, lc);
        }
    }
    // SAFETY: `x + 128 * mb .. x + 160 * mb` lies in the free chunk, in the arena.
    let tail = unsafe { x.add(2 * MAX_RETAIN) };
    assert_eq!(
        resident_pages(tail, 160 * mb - 2 * MAX_RETAIN),
        0,
        "the free chunk's pages past its first 128 MiB stayed resident"
    );
    // SAFETY: from `a.alloc`.
    unsafe {
        a.dealloc(g0, guard);
        a.dealloc(g1, guard);
    }
    assert_eq!(a.check(), Ok(()));
}

/// With much memory in use the sweep interval is a multiple of it ([`SWEEP_AFTER_IN_USE`], 8), and a
/// block that stays free still goes back at the second sweep: 16 MiB in use. With about 16.1 MiB
/// in use at each free, sweeps come every 129 MiB freed: the first marks `x`, the second returns
/// it. (Fails with a factor of 16, or with no sweeps.)
#[test]
#[cfg_attr(miri, ignore = "Miri has no mincore")]
fn a_block_that_stays_free_goes_back_at_the_second_sweep_when_much_is_in_use() {
    let all = (2 << 20) / os::page_size();
    // 122 MiB freed: no sweep yet; 302 MiB: two.
    a_long_free_block_beside_churn(16 << 20, &[(40, all), (60, 0)]);
}

#[test]
fn zeroed_blocks_below_the_end_of_touched_memory_are_zero() {
    let a = small_instance();
    // An engine block.
    let l = Layout::from_size_align(small::SMALL_MAX + 904, 8).unwrap();
    // The end of touched memory in the middle of a page: a reused block up to it.
    let q = dirty_then_zeroed(&a, l, || {});
    // Again with a release between the free and the zeroed allocation: it lowers the end of
    // touched memory to the free top's first whole page, never below the data under it.
    let z = dirty_then_zeroed(&a, l, || {
        a.release_free_memory();
    });
    // SAFETY: both came from `alloc_zeroed(l)`.
    unsafe {
        a.dealloc(q, l);
        a.dealloc(z, l);
    }
    assert_eq!(a.check(), Ok(()));
}

#[test]
#[cfg_attr(
    miri,
    ignore = "writes and checks 64 MiB byte by byte: too slow under Miri"
)]
fn a_large_zeroed_block_spares_the_next_blocks_page() {
    let a = big_instance();
    // Zeroed by giving pages back, and no page multiple.
    let big = Layout::from_size_align(ZERO_BY_DISCARD + BEYOND_MEDIUM, 8).unwrap();
    let (p, _, n) = block_beside_a_neighbour(&a, big);
    // SAFETY: `p` came from `a.alloc(big)`.
    unsafe { a.dealloc(p, big) };
    // SAFETY: a non-zero size.
    let z = unsafe { a.alloc_zeroed(big) };
    assert_eq!(z, p, "not reused");
    // SAFETY: `z` holds `big.size()` bytes, `n` the neighbour's.
    unsafe {
        assert!(filled_with(z, big.size(), 0), "old data in a zeroed block");
        assert!(
            filled_with(n, neighbour().size(), 0x5a),
            "the next block lost its data"
        );
        a.dealloc(z, big);
        a.dealloc(n, neighbour());
    }
    assert_eq!(a.check(), Ok(()));
}

#[test]
fn a_small_realloc_under_the_lock_moves_to_the_new_class() {
    // This thread's cache serves `a`, so `b`'s realloc takes the step under the lock.
    std::thread::spawn(|| {
        let (a, b) = (small_instance(), small_instance());
        let l = Layout::from_size_align(16, 8).unwrap();
        let grown = Layout::from_size_align(100, 8).unwrap();
        // SAFETY: non-zero sizes; each block is freed once with its layout.
        unsafe {
            let x = a.alloc(l);
            let p = b.alloc(l);
            p.write_bytes(7, 16);
            let q = b.realloc(p, l, 100);
            assert!(b.usable_size(q).is_some_and(|u| u >= 100), "grew in place");
            assert!(core::slice::from_raw_parts(q, 16).iter().all(|&v| v == 7));
            b.dealloc(q, grown);
            a.dealloc(x, l);
        }
        assert_eq!(b.check(), Ok(()));
    })
    .join()
    .unwrap();
}

#[test]
#[cfg_attr(
    miri,
    ignore = "Miri aborts on the 2^61-byte reservation instead of refusing it"
)]
fn a_failed_instance_answers_without_the_global_lock() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let a = GlobalBfc::with_config(HostConfig {
        arena_size: 1 << 61,
        min_arena_size: 1 << 60,
        ..HostConfig::DEFAULT
    });
    let l = Layout::from_size_align(64, 8).unwrap();
    // SAFETY: a non-zero layout (the initialisation fails: nothing to free).
    assert!(unsafe { a.alloc(l) }.is_null());
    // With the heap list's lock held (as a `fork` or another instance's first use holds it),
    // calls on the failed instance still return.
    let held = heaps().lock.lock();
    let done = AtomicBool::new(false);
    let answered = std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: as above.
            assert!(unsafe { a.alloc(l) }.is_null());
            let big = Layout::from_size_align(1 << 20, 8).unwrap();
            // SAFETY: as above.
            assert!(unsafe { a.alloc(big) }.is_null());
            assert_eq!(a.stats(), Stats::default());
            done.store(true, Ordering::SeqCst);
        });
        let start = std::time::Instant::now();
        while !done.load(Ordering::SeqCst) && start.elapsed().as_secs() < 10 {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let answered = done.load(Ordering::SeqCst);
        drop(held);
        answered
    });
    assert!(
        answered,
        "a failed instance waited for the heap list's lock"
    );
}

#[test]
#[cfg_attr(miri, ignore = "spawns a child process")]
fn fork_handlers_run_twice_hold_the_locks_until_the_last_call() {
    // A child forked while `pthread_once` ran the registration registers the handlers again,
    // and libc then runs each twice per fork (prepare handlers in reverse order, the others in
    // order); a fork nested in this thread's fork (from another library's prepare handler)
    // runs them twice too. A second prepare step must not re-take the locks (it would abort:
    // re-entered lock), and the locks must stay held until the last parent or child call.
    // Runs in a child process.
    use std::sync::atomic::{AtomicBool, Ordering};
    let case = "fork_handlers_run_twice_hold_the_locks_until_the_last_call";
    if is_child(case) {
        let a = small_instance();
        let l = Layout::from_size_align(100_000, 8).unwrap();
        // SAFETY: a non-zero layout; the block is freed with it.
        unsafe { a.dealloc(a.alloc(l), l) };
        for child in [false, true] {
            let end = if child { on_fork_child } else { on_fork_parent };
            on_fork_prepare();
            on_fork_prepare();
            end();
            // One call is still unmatched: another thread must not get into the heap.
            let entered = AtomicBool::new(false);
            let entered_early = std::thread::scope(|s| {
                s.spawn(|| {
                    a.stats();
                    entered.store(true, Ordering::SeqCst);
                });
                std::thread::sleep(std::time::Duration::from_millis(100));
                let early = entered.load(Ordering::SeqCst);
                end();
                early
            });
            assert!(
                !entered_early,
                "locks released before the last call (child: {child})"
            );
            assert!(entered.load(Ordering::SeqCst));
            // SAFETY: as above.
            let p = unsafe { a.alloc(l) };
            assert!(!p.is_null());
            // SAFETY: `p` came from `a.alloc(l)`.
            unsafe { a.dealloc(p, l) };
            a.check().unwrap();
        }
        std::println!("child done");
        return;
    }
    let (status, stdout, stderr) = run_child(case);
    assert!(status.success(), "{status:?}: {stderr}");
    assert!(stdout.contains("child done"), "{stdout}");
}

#[test]
#[cfg_attr(miri, ignore = "spawns a child process")]
fn dropping_an_unused_instance_installs_the_fork_handlers_first() {
    // Dropping an instance takes the bindings lock, even when the instance was never used. In a
    // process where no instance was initialised yet, that is the first allocator lock taken, and
    // the `fork` handlers must be in place before it: a `fork` on another thread while the drop
    // holds it would otherwise leave it held in the child, whose next exit of a thread with a
    // bound cache, drop or `fork` would wait forever. Runs in a child process, where no instance
    // was initialised before; its own child tells whether a handler ran at the `fork`.
    let case = "dropping_an_unused_instance_installs_the_fork_handlers_first";
    if is_child(case) {
        drop(small_instance());
        // SAFETY: the child only reads an atomic and leaves with `_exit`.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            // The child handler counts the forks it saw.
            let code = if fork_generation() == 0 { 1 } else { 0 };
            // SAFETY: leaves the child at once, without running the parent's exit handlers.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waits for our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "no fork handler ran: the drop took the bindings lock before they were installed"
        );
        std::println!("child done");
        return;
    }
    let (status, stdout, stderr) = run_child(case);
    assert!(status.success(), "{status:?}: {stdout}{stderr}");
    assert!(stdout.contains("child done"), "{stdout}");
}

// ---- Tests written to kill surviving mutants (a mutation-testing pass over the host heap) ----

/// A free that leaves a merged chunk of exactly `release_threshold` bytes is subject to the
/// give-back policy: it raises the retained amount and counts as dirty.
#[test]
fn a_free_of_exactly_the_threshold_counts_toward_the_policy() {
    let a = big_instance();
    let mb = 1 << 20;
    let l = Layout::from_size_align(mb, 4096).unwrap();
    let guard = Layout::from_size_align(64 << 10, 4096).unwrap();
    // SAFETY: non-zero sizes.
    let (g0, x, g1) = unsafe { (a.alloc(guard), a.alloc(l), a.alloc(guard)) };
    assert_eq!(x as usize, g0 as usize + (64 << 10));
    assert_eq!(g1 as usize, x as usize + mb);
    assert_eq!(a.usable_size(x), Some(mb));
    let (retain, dirty) = a.with_heap(|h| (h.retain, h.dirty)).unwrap();
    // SAFETY: from `a.alloc`, freed once.
    unsafe { a.dealloc(x, l) };
    assert_eq!(
        a.with_heap(|h| (h.retain, h.dirty)).unwrap(),
        (retain.max(RETAIN_BLOCKS * mb), dirty + mb)
    );
    // SAFETY: from `a.alloc`, freed once.
    unsafe {
        a.dealloc(g0, guard);
        a.dealloc(g1, guard);
    }
    assert_eq!(a.check(), Ok(()));
}

/// The free top is trimmed only once at least twice the retained amount is touched above its
/// start (hysteresis), and then down to the retained amount.
#[test]
fn the_free_top_is_trimmed_with_hysteresis() {
    let a = big_instance();
    let kb = 1 << 10;
    // A quarter of the threshold: the retained amount stays the threshold, 1 MiB.
    let l = Layout::from_size_align(256 * kb, 4096).unwrap();
    // SAFETY: a non-zero size.
    let b: std::vec::Vec<*mut u8> = (0..9).map(|_| unsafe { a.alloc(l) }).collect();
    for i in 1..9 {
        assert_eq!(b[i] as usize, b[i - 1] as usize + 256 * kb);
    }
    let top = b[8] as usize + 256 * kb;
    assert_eq!(brk(&a), top);
    assert_eq!(a.with_heap(|h| h.retain).unwrap(), 1 << 20);
    // SAFETY: from `a.alloc(l)`, each freed once.
    unsafe {
        for i in (2..9).rev() {
            a.dealloc(b[i], l);
        }
    }
    // 1.75 MiB touched above the free top's start: more than the retained 1 MiB, less than
    // twice it: kept.
    assert_eq!(brk(&a), top, "trimmed without hysteresis");
    assert_eq!(a.with_heap(|h| h.retain).unwrap(), 1 << 20);
    // SAFETY: as above.
    unsafe { a.dealloc(b[1], l) };
    // 2 MiB touched: trimmed to the retained 1 MiB.
    assert_eq!(brk(&a), b[1] as usize + (1 << 20));
    // SAFETY: as above.
    unsafe { a.dealloc(b[0], l) };
    assert_eq!(a.check(), Ok(()));
}

/// Blocks below the release threshold raise the retained amount too: a program that churns a
/// few buffers of up to 1 MiB (bench-peers `bufw`) keeps them touched instead of having its free
/// top trimmed to 1 MiB again and again.
#[test]
#[cfg_attr(miri, ignore = "Miri has no mincore")]
fn blocks_below_the_threshold_raise_the_retained_amount() {
    let a = big_instance();
    let kb = 1 << 10;
    let l = Layout::from_size_align(768 * kb, 4096).unwrap();
    // SAFETY: a non-zero size.
    let b: std::vec::Vec<*mut u8> = (0..4).map(|_| unsafe { a.alloc(l) }).collect();
    for &p in &b {
        assert!(!p.is_null());
        // SAFETY: `p` holds `l.size()` bytes.
        unsafe { p.write_bytes(0xa5, l.size()) };
    }
    let start = b[0] as usize;
    assert_eq!(
        b[3] as usize,
        start + 3 * 768 * kb,
        "blocks are not contiguous"
    );
    // SAFETY: from `a.alloc(l)`, each freed once.
    unsafe {
        for &p in b.iter().rev() {
            a.dealloc(p, l);
        }
    }
    // Four times 768 KiB retained; the 3 MiB touched are below twice that: all kept.
    assert_eq!(a.with_heap(|h| h.retain).unwrap(), 4 * 768 * kb);
    assert_eq!(brk(&a), start + 4 * 768 * kb, "the free top was trimmed");
    assert_eq!(resident_pages(b[0], 4 * 768 * kb), 4 * 768 * kb / 4096);
    assert_eq!(a.check(), Ok(()));
}

/// A reused block below 64 MiB is zeroed by writing it: its pages stay resident (giving them
/// back and faulting them in again costs several times more when the caller uses the block).
#[test]
#[cfg_attr(miri, ignore = "Miri has no mincore")]
fn a_reused_block_below_64_mib_is_zeroed_by_writing_it() {
    let a = big_instance();
    let l = Layout::from_size_align(8 << 20, 4096).unwrap();
    let (p, _, n) = block_beside_a_neighbour(&a, l);
    assert_eq!(resident_after_zeroing(&a, l, p, n, || {}), l.size() / 4096);
    // From 64 MiB on, the pages go back instead (a block that large already gave its pages back
    // when it was freed: writing it would fault every page in).
    let huge = Layout::from_size_align(ZERO_BY_DISCARD, 4096).unwrap();
    let (p, _, n) = block_beside_a_neighbour(&a, huge);
    assert_eq!(resident_after_zeroing(&a, huge, p, n, || {}), 0);
    assert_eq!(a.check(), Ok(()));
}

/// Frees block `p` of `layout` (with the [`neighbour`] `n` after it, so that it is not the free
/// top), runs `between`, takes `layout` again through `alloc_zeroed` (asserted to be the same
/// block) and returns its resident pages, counted before anything reads it (a read maps zero
/// pages); then asserts that it reads zero, and frees it and `n`.
fn resident_after_zeroing(
    a: &GlobalBfc,
    layout: Layout,
    p: *mut u8,
    n: *mut u8,
    between: impl FnOnce(),
) -> usize {
    // SAFETY: `p` came from `a.alloc(layout)` and is freed once.
    unsafe { a.dealloc(p, layout) };
    between();
    // SAFETY: a non-zero size.
    let z = unsafe { a.alloc_zeroed(layout) };
    assert_eq!(z, p, "not reused");
    let resident = resident_pages(z, layout.size());
    // SAFETY: `z` holds `layout.size()` bytes; `z` and `n` are freed once.
    unsafe {
        assert!(
            filled_with(z, layout.size(), 0),
            "old data in a zeroed block"
        );
        a.dealloc(z, layout);
        a.dealloc(n, neighbour());
    }
    resident
}

/// A reused block most of whose pages are not resident (a sparse buffer) is zeroed by giving its
/// pages back, not by writing them: writing would fault every page in.
#[test]
#[cfg_attr(miri, ignore = "Miri has no mincore")]
fn a_sparsely_used_block_is_not_faulted_in_by_zeroing() {
    let a = big_instance();
    let l = Layout::from_size_align(8 << 20, 4096).unwrap();
    // SAFETY: non-zero sizes.
    let (p, n) = unsafe { (a.alloc(l), a.alloc(neighbour())) };
    assert!(!p.is_null() && !n.is_null());
    // One byte per 64 pages.
    for off in (0..l.size()).step_by(64 << 12) {
        // SAFETY: inside the block.
        unsafe { p.add(off).write(0xa5) };
    }
    assert_eq!(
        resident_after_zeroing(&a, l, p, n, || {}),
        0,
        "zeroing faulted pages in"
    );
    assert_eq!(a.check(), Ok(()));
}

/// A block carved from a free chunk whose pages a sweep gave back (not resident) is zeroed by
/// giving them back again (cheap), not by writing them: that would fault every page in, for a
/// caller that may use few of them (a sparse table).
#[test]
#[cfg_attr(miri, ignore = "Miri has no mincore")]
fn a_block_from_a_swept_chunk_is_not_faulted_in_by_zeroing() {
    let a = big_instance();
    let l = Layout::from_size_align(32 << 20, 4096).unwrap();
    let (p, _, n) = block_beside_a_neighbour(&a, l);
    let swept = || {
        assert!(a.release_free_memory() >= l.size());
        assert_eq!(resident_pages(p, l.size()), 0);
    };
    assert_eq!(
        resident_after_zeroing(&a, l, p, n, swept),
        0,
        "zeroing faulted pages in"
    );
    // A block that only partly covers the swept chunk, at an offset: zeroed all the same.
    let (p, usable, n) = block_beside_a_neighbour(&a, l);
    // SAFETY: from `a.alloc(l)`, freed once.
    unsafe { a.dealloc(p, l) };
    a.release_free_memory();
    let part = Layout::from_size_align(usable / 2 + 100, 64).unwrap();
    // SAFETY: non-zero sizes.
    let (z, rest) = unsafe { (a.alloc_zeroed(part), a.alloc_zeroed(part)) };
    assert!(!z.is_null() && !rest.is_null());
    // SAFETY: each holds `part.size()` bytes; every block is freed once.
    unsafe {
        assert!(filled_with(z, part.size(), 0), "old data in a zeroed block");
        assert!(
            filled_with(rest, part.size(), 0),
            "old data in a zeroed block"
        );
        a.dealloc(z, part);
        a.dealloc(rest, part);
        a.dealloc(n, neighbour());
    }
    assert_eq!(a.check(), Ok(()));
}

/// With much memory in use, interior frees do not start a sweep after 16 thresholds: the
/// interval grows with the bytes in use. (The factor, eight, is not pinned here: reaching it
/// with interior frees needs more freed than kept.)
#[test]
fn sweeps_wait_longer_when_much_memory_is_in_use() {
    let a = big_instance();
    let mb = 1 << 20;
    let l = Layout::from_size_align(mb, 4096).unwrap();
    // SAFETY: a non-zero size.
    let ps: std::vec::Vec<*mut u8> = (0..48).map(|_| unsafe { a.alloc(l) }).collect();
    assert!(ps.iter().all(|p| !p.is_null()));
    for i in (0..40).step_by(2) {
        // SAFETY: from `a.alloc(l)`, freed once.
        unsafe { a.dealloc(ps[i], l) };
    }
    // 20 MiB freed (past 16 thresholds) with 28 MiB or more in use: no sweep yet.
    assert_eq!(a.with_heap(|h| h.dirty).unwrap(), 20 * mb);
    for i in (1..40).step_by(2).chain(40..48) {
        // SAFETY: as above.
        unsafe { a.dealloc(ps[i], l) };
    }
    assert_eq!(a.check(), Ok(()));
}

/// A huge interior block whose pages went back at once is not counted as dirty.
#[test]
#[cfg_attr(miri, ignore = "a 64 MiB block in a 512 MiB arena")]
fn a_huge_interior_block_given_back_at_once_is_not_dirty() {
    let a = big_instance();
    let huge = Layout::from_size_align(MAX_RETAIN + BEYOND_MEDIUM, 8).unwrap();
    let (p, _, n) = block_beside_a_neighbour(&a, huge);
    let dirty = a.with_heap(|h| h.dirty).unwrap();
    // SAFETY: `p` came from `a.alloc(huge)`.
    unsafe { a.dealloc(p, huge) };
    assert_eq!(a.with_heap(|h| h.dirty).unwrap(), dirty);
    // SAFETY: `n` came from `a.alloc`.
    unsafe { a.dealloc(n, neighbour()) };
    assert_eq!(a.check(), Ok(()));
}

/// The checker sees a block twice on the calling thread's cache.
#[test]
fn the_checker_sees_a_thread_cache_holding_a_block_twice() {
    std::thread::spawn(|| {
        let a = small_instance();
        let l = Layout::from_size_align(64, 8).unwrap();
        // SAFETY: a valid layout; the blocks are freed once with it.
        let (p, q) = unsafe { (a.alloc(l), a.alloc(l)) };
        assert!(!p.is_null() && !q.is_null());
        // SAFETY: as above.
        unsafe { a.dealloc(q, l) };
        a.flush_thread_cache();
        a.check().unwrap();
        let c = small::class_for(64, 8).unwrap();
        tcache::with(|tc| {
            tc.fill(c, p as usize);
            tc.fill(c, p as usize);
        })
        .unwrap();
        assert_eq!(
            a.check().unwrap_err().what,
            "thread cache stack overfull or holding a block twice"
        );
        tcache::with(|tc| {
            tc.pop(c);
            tc.pop(c);
        })
        .unwrap();
        a.check().unwrap();
        // SAFETY: as above.
        unsafe { a.dealloc(p, l) };
    })
    .join()
    .unwrap();
}

/// `brk` (the end of touched memory, above which `alloc_zeroed` trusts pages to read as zero)
/// stays where it is when the kernel refuses to discard the free top's pages.
#[test]
#[cfg(any(target_os = "linux", target_os = "android"))]
#[cfg_attr(miri, ignore = "Miri has no mlock")]
fn a_refused_discard_of_the_free_top_keeps_brk() {
    let a = small_instance();
    let size = 256 << 10;
    let l = Layout::from_size_align(size, 4096).unwrap();
    // SAFETY: a non-zero size.
    let p = unsafe { a.alloc(l) };
    assert!(!p.is_null());
    // SAFETY: `p` holds `size` bytes; it came from `a.alloc(l)`, freed once.
    unsafe {
        p.write_bytes(0xa5, size);
        a.dealloc(p, l);
    }
    // Below the retained amount: the free top keeps its pages.
    let before = brk(&a);
    assert!(before >= p as usize + size);
    let page = os::page_size();
    // A locked page makes MADV_DONTNEED refuse the whole range.
    // SAFETY: `p..p + page` is mapped, committed memory of the arena.
    if unsafe { libc::mlock(p.cast(), page) } != 0 {
        std::eprintln!(
            "skipped: mlock of one page failed ({}); RLIMIT_MEMLOCK too low?",
            std::io::Error::last_os_error()
        );
        return;
    }
    // SAFETY: the page is free memory of the arena (its contents do not matter).
    if unsafe { libc::madvise(p.cast(), page, libc::MADV_DONTNEED) } == 0 {
        // AddressSanitizer's `mlock` does nothing.
        std::eprintln!(
            "skipped: the page was not locked (mlock returned 0, MADV_DONTNEED went through)"
        );
        // SAFETY: as above.
        unsafe { libc::munlock(p.cast(), page) };
        return;
    }
    let released = a.release_free_memory();
    let after = brk(&a);
    // SAFETY: as above.
    assert_eq!(unsafe { libc::munlock(p.cast(), page) }, 0, "munlock");
    assert_eq!(
        after, before,
        "brk moved down over pages that were not discarded"
    );
    assert!(
        released < size,
        "pages the kernel kept counted as released: {released}"
    );
    // SAFETY: a non-zero size.
    let z = unsafe { a.alloc_zeroed(l) };
    assert_eq!(z, p);
    // SAFETY: `z` holds `size` bytes.
    let zeroed = unsafe { filled_with(z, size, 0) };
    assert!(zeroed, "alloc_zeroed returned stale bytes");
    // SAFETY: from `a.alloc_zeroed(l)`.
    unsafe { a.dealloc(z, l) };
    assert_eq!(a.check(), Ok(()));
}

/// A small block resized within its size class stays where it is, with or without a thread
/// cache (without one, the step under the lock decides).
#[test]
fn a_small_realloc_within_its_class_stays_in_place() {
    for thread_cache in [true, false] {
        let a = GlobalBfc::with_config(HostConfig {
            arena_size: 64 << 20,
            min_arena_size: 64 << 20,
            chunk_capacity: 1 << 12,
            thread_cache,
            ..HostConfig::DEFAULT
        });
        small_realloc_stays_in_place(&a);
    }
}

fn small_realloc_stays_in_place(a: &GlobalBfc) {
    let l = Layout::from_size_align(40, 8).unwrap();
    let c = small::class_for(40, 8).unwrap();
    let new_size = small::class_size(c);
    assert!(new_size > 40);
    // SAFETY: a non-zero size.
    let p = unsafe { a.alloc(l) };
    assert!(!p.is_null());
    // SAFETY: `p` came from `a.alloc(l)`.
    let q = unsafe { a.realloc(p, l, new_size) };
    assert_eq!(q, p);
    // SAFETY: `q` is live with this layout.
    unsafe { a.dealloc(q, Layout::from_size_align(new_size, 8).unwrap()) };
    assert_eq!(a.check(), Ok(()));
}

/// The slab layer's metadata in `stats()` follows how far the heap has reached: an 8 MiB block
/// adds a span-table entry and class byte for each 64 KiB of it.
#[test]
#[cfg_attr(miri, ignore = "an 8 MiB block")]
fn span_metadata_follows_what_the_heap_reached() {
    let a = big_instance();
    let l = Layout::from_size_align(8 << 20, 8).unwrap();
    // SAFETY: a non-zero size; the block is written within it and freed once with it.
    let p = unsafe { a.alloc(l) };
    assert!(!p.is_null());
    // SAFETY: as above.
    unsafe { p.write(1) };
    let (reached, start, span_part) = a
        .with_heap(|h| {
            (
                h.bfc.source().reached_end(),
                h.small.arena(),
                h.stats().metadata_bytes - h.bfc.stats().metadata_bytes,
            )
        })
        .unwrap();
    let end = p as usize + (8 << 20);
    assert!(
        reached >= end,
        "reached {reached:#x}, the block ends at {end:#x}"
    );
    assert!(
        span_part >= (end - start) / SPAN * (small::SmallHeap::ENTRY + 1),
        "{span_part} bytes of span metadata for {} MiB",
        (end - start) >> 20
    );
    // SAFETY: as above.
    unsafe { a.dealloc(p, l) };
}

/// Requests of up to 16 KiB (aligned to at most 4 KiB) are objects of the slab layer, of their
/// class's size and in a span of that class; the next byte, or more alignment, gets an engine
/// block.
#[test]
fn blocks_up_to_16_kib_come_from_slabs() {
    let a = small_instance_with_caches(false);
    let cases = [
        (4097, 8, Some(5120)),
        (5000, 16, Some(5120)),
        (8192, 8, Some(8192)),
        (9000, 4096, Some(12288)),
        (12_000, 64, Some(12288)),
        (14_337, 8, Some(16384)),
        (small::SMALL_MAX, 8, Some(small::SMALL_MAX)),
        (small::SMALL_MAX + 1, 8, None),
        (small::SMALL_MAX + 1, 32, None),
        (5000, 8192, None),
    ];
    let mut blocks = std::vec::Vec::new();
    for (size, align, class) in cases {
        let l = Layout::from_size_align(size, align).unwrap();
        // SAFETY: a non-zero size.
        let p = unsafe { a.alloc(l) };
        assert!(!p.is_null());
        assert_eq!(p as usize % align, 0);
        let in_slab = a
            .with_heap(|h| h.small.class_of_live(p as usize).ok())
            .unwrap()
            .expect("a live block");
        assert_eq!(
            in_slab.map(small::class_size),
            class,
            "{size} B aligned to {align}"
        );
        if class.is_none() {
            // An engine block: a medium class's size, or the request rounded up to the granule.
            let want = medium::class_for(size, align)
                .map_or(size.next_multiple_of(16), medium::class_size);
            assert_eq!(a.usable_size(p), Some(want));
        } else {
            assert_eq!(a.usable_size(p), class);
        }
        blocks.push((p, l));
    }
    assert_eq!(a.check(), Ok(()));
    for (p, l) in blocks {
        // SAFETY: each block came from `a` with `l` and is freed once.
        unsafe { a.dealloc(p, l) };
    }
    assert_eq!(a.stats().bytes_in_use, 0);
    assert_eq!(a.check(), Ok(()));
}

/// A zeroed object of a class above one page from memory the heap had not reached, or whose pages
/// went back, is not written (none of its pages becomes resident); a reused dirty one is written
/// whole. With and without thread caches (zeroed objects of these classes are taken under the
/// lock either way).
#[test]
#[cfg_attr(miri, ignore = "Miri has no mincore")]
fn zeroed_multi_page_objects_are_written_only_where_dirty() {
    for thread_cache in [false, true] {
        for size in [5000, 8192, 14_000, small::SMALL_MAX] {
            // A new heap for each size: the spans of the last would be reused memory.
            let a = small_instance_with_caches(thread_cache);
            let l = Layout::from_size_align(size, 8).unwrap();
            let mut blocks = std::vec::Vec::new();
            for _ in 0..40 {
                // SAFETY: a non-zero size.
                let p = unsafe { a.alloc_zeroed(l) };
                assert!(!p.is_null());
                blocks.push(p);
            }
            // (Residency first: `mincore` counts a page read as resident.)
            let (lo, hi) = (blocks[0] as usize, blocks[39] as usize + size);
            let page = os::page_size();
            let (lo, hi) = (lo & !(page - 1), hi.next_multiple_of(page));
            let touched = resident_pages(lo as *mut u8, hi - lo);
            assert_eq!(touched, 0, "{size} B, caches {thread_cache}");
            for &p in &blocks {
                // SAFETY: `p` holds `size` bytes.
                assert!(unsafe { filled_with(p, size, 0) });
            }
            // Dirty the first, free it and take it again: written whole.
            // SAFETY: `blocks[0]` holds `size` bytes; it came from `a` with `l` and is freed once.
            unsafe {
                blocks[0].write_bytes(0xa5, size);
                a.dealloc(blocks[0], l);
            }
            if thread_cache {
                // Out of the cache, so the next zeroed object is the lowest again.
                a.flush_thread_cache();
            }
            // SAFETY: a non-zero size.
            let q = unsafe { a.alloc_zeroed(l) };
            assert_eq!(q, blocks[0], "{size} B: the lowest free object");
            // SAFETY: `q` holds `size` bytes.
            assert!(unsafe { filled_with(q, size, 0) }, "{size} B: old data");
            blocks[0] = q;
            for p in blocks {
                // SAFETY: each came from `a` with `l` and is freed once.
                unsafe { a.dealloc(p, l) };
            }
            assert_eq!(a.check(), Ok(()));
            assert_eq!(a.stats().bytes_in_use, 0);
        }
    }
}

/// A zeroed 16 KiB object whose pages went back (`release_free_memory` after its free) is not
/// written again: its pages stay non-resident, and it reads as zero.
#[test]
#[cfg_attr(miri, ignore = "Miri has no mincore")]
fn zeroed_objects_on_given_back_pages_are_not_written() {
    let a = small_instance_with_caches(false);
    let size = small::SMALL_MAX;
    let l = Layout::from_size_align(size, 8).unwrap();
    // One span: four objects, each written whole; the last stays live so the span stays.
    // SAFETY: non-zero sizes; each block holds `size` bytes.
    let b: std::vec::Vec<*mut u8> = (0..4)
        .map(|_| unsafe {
            let p = a.alloc(l);
            assert!(!p.is_null());
            p.write_bytes(0xa5, size);
            p
        })
        .collect();
    assert_eq!(b[3] as usize, b[0] as usize + 3 * size, "one span");
    for &p in &b[..3] {
        // SAFETY: each came from `a` with `l` and is freed once.
        unsafe { a.dealloc(p, l) };
    }
    a.release_free_memory();
    assert_eq!(
        resident_pages(b[0], 3 * size),
        0,
        "the free pages went back"
    );
    // SAFETY: non-zero sizes.
    let z: std::vec::Vec<*mut u8> = (0..3).map(|_| unsafe { a.alloc_zeroed(l) }).collect();
    assert_eq!(z, b[..3], "the same objects again");
    assert_eq!(resident_pages(b[0], 3 * size), 0, "written while zeroed");
    for &p in &z {
        // SAFETY: `p` holds `size` bytes.
        assert!(unsafe { filled_with(p, size, 0) });
    }
    for &p in z.iter().chain(&b[3..]) {
        // SAFETY: each came from `a` with `l` and is freed once.
        unsafe { a.dealloc(p, l) };
    }
    assert_eq!(a.check(), Ok(()));
}

/// Objects a thread cache's refill took (a batch) and handed out count as touched: zeroed again
/// later, they are written.
#[test]
fn zeroed_objects_after_a_cached_use_are_zero() {
    let a = small_instance();
    for size in [5000, small::SMALL_MAX] {
        let l = Layout::from_size_align(size, 8).unwrap();
        // SAFETY: non-zero sizes; each block holds `size` bytes.
        let b: std::vec::Vec<*mut u8> = (0..3)
            .map(|_| unsafe {
                let p = a.alloc(l);
                assert!(!p.is_null());
                p.write_bytes(0xa5, size);
                p
            })
            .collect();
        for &p in &b {
            // SAFETY: each came from `a` with `l` and is freed once.
            unsafe { a.dealloc(p, l) };
        }
        a.flush_thread_cache();
        // SAFETY: non-zero sizes.
        let z: std::vec::Vec<*mut u8> = (0..3).map(|_| unsafe { a.alloc_zeroed(l) }).collect();
        let mut sorted = b.clone();
        sorted.sort();
        assert_eq!(z, sorted, "{size} B: the same objects, lowest first");
        for &p in &z {
            // SAFETY: `p` holds `size` bytes; it came from `a` with `l` and is freed once.
            unsafe {
                assert!(filled_with(p, size, 0), "{size} B: old data");
                a.dealloc(p, l);
            }
        }
    }
    assert_eq!(a.check(), Ok(()));
}

/// A span made over memory the heap used before (a freed, written engine block) has no fresh
/// objects: zeroed objects from it are written.
#[test]
fn zeroed_objects_in_reused_memory_are_zero() {
    let a = small_instance_with_caches(false);
    let big = Layout::from_size_align(256 << 10, 4096).unwrap();
    let guard = Layout::from_size_align(64 << 10, 4096).unwrap();
    // SAFETY: non-zero sizes; `b` holds 256 KiB; each block is freed once with its layout.
    let (b, g) = unsafe {
        let (b, g) = (a.alloc(big), a.alloc(guard));
        assert!(!b.is_null() && !g.is_null());
        b.write_bytes(0xa5, big.size());
        a.dealloc(b, big);
        (b, g)
    };
    for size in [5000, small::SMALL_MAX] {
        let l = Layout::from_size_align(size, 8).unwrap();
        // SAFETY: a non-zero size.
        let p = unsafe { a.alloc_zeroed(l) };
        assert!(
            (b as usize..b as usize + big.size()).contains(&(p as usize)),
            "{size} B: a span in the freed block"
        );
        // SAFETY: `p` holds `size` bytes; it came from `a` with `l` and is freed below.
        assert!(unsafe { filled_with(p, size, 0) }, "{size} B: old data");
        // SAFETY: as above.
        unsafe { a.dealloc(p, l) };
    }
    // SAFETY: `g` came from `a` with `guard`.
    unsafe { a.dealloc(g, guard) };
    assert_eq!(a.check(), Ok(()));
}

/// A thread cache's refill takes at most one span's objects: the first 16 KiB allocation on a
/// thread makes one span (four objects: one for the caller, three cached), not two.
#[test]
fn a_refill_makes_no_span_only_to_fill_the_cache() {
    let a = small_instance();
    let l = Layout::from_size_align(small::SMALL_MAX, 8).unwrap();
    // SAFETY: a non-zero size.
    let p = unsafe { a.alloc(l) };
    assert!(!p.is_null());
    assert_eq!(a.with_heap(|h| h.span_allocs).unwrap(), 1);
    assert_eq!(a.stats().bytes_cached, 3 * small::SMALL_MAX);
    // SAFETY: `p` came from `a` with `l`.
    unsafe { a.dealloc(p, l) };
    assert_eq!(a.check(), Ok(()));
}

/// A layout of `size` bytes at `align`.
fn layout(size: usize, align: usize) -> Layout {
    Layout::from_size_align(size, align).unwrap()
}

/// Allocates a block of `l` from `a` (asserted non-null).
fn alloc_ok(a: &GlobalBfc, l: Layout) -> *mut u8 {
    // SAFETY: every layout these tests use has a non-zero size.
    let p = unsafe { a.alloc(l) };
    assert!(!p.is_null(), "{l:?}");
    p
}

/// After every thread that used `a` exited: nothing is in use or cached, the block at `gone` (one
/// a thread's cache held at its exit) is the engine's again, and the invariants hold.
fn assert_all_given_back(a: &GlobalBfc, gone: usize) {
    let s = a.stats();
    assert_eq!((s.bytes_in_use, s.bytes_cached), (0, 0));
    assert_eq!(a.usable_size(gone as *const u8), None);
    assert_eq!(a.check(), Ok(()));
}

/// Medium blocks (above 16 KiB, at most 64 KiB, aligned to at most `MEDIUM_ALIGN`) take their class's
/// size; a freed one waits in the thread's cache, still the engine's, and is handed out again for
/// any request of its class without the engine (the allocation count stays put); another class
/// gets another block.
#[test]
fn medium_blocks_are_cached_and_reused_by_their_class() {
    let a = small_instance();
    let l = layout(small::SMALL_MAX + 1, 8);
    let p = alloc_ok(&a, l);
    assert_eq!(a.usable_size(p), Some(20 << 10));
    // SAFETY: `p` came from `a` with `l` and is freed once.
    unsafe { a.dealloc(p, l) };
    assert_eq!(a.thread_cache_bytes(), 20 << 10);
    let s = a.stats();
    assert_eq!((s.bytes_in_use, s.num_chunks_in_use), (0, 0));
    assert_eq!(s.bytes_cached, 20 << 10);
    assert_eq!(a.usable_size(p), Some(20 << 10));
    assert_eq!(a.check(), Ok(()));
    let same = layout(20 << 10, 16);
    assert_eq!(alloc_ok(&a, same), p);
    assert_eq!(a.stats().num_allocs, s.num_allocs);
    assert_eq!(a.thread_cache_bytes(), 0);
    let other = layout(30_000, 8);
    let r = alloc_ok(&a, other);
    assert_ne!(r, p);
    assert_eq!(a.usable_size(r), Some(32 << 10));
    assert_eq!(a.stats().num_allocs, s.num_allocs + 1);
    // Aligned beyond what medium blocks serve: an engine block of the request's size, not cached.
    let aligned = layout(30_000, BEYOND_MEDIUM);
    let e = alloc_ok(&a, aligned);
    assert_eq!(a.usable_size(e), Some(30_000));
    // SAFETY: each block came from `a` with its layout and is freed once.
    unsafe {
        a.dealloc(p, same);
        a.dealloc(r, other);
        a.dealloc(e, aligned);
    }
    assert_eq!(a.thread_cache_bytes(), (20 << 10) + (32 << 10));
    assert_eq!(a.usable_size(e), None);
    assert_eq!(a.check(), Ok(()));
    assert_eq!(a.flush_thread_cache(), 2);
    assert_eq!((a.usable_size(p), a.usable_size(r)), (None, None));
    assert_eq!(a.stats().bytes_cached, 0);
    assert_eq!(a.check(), Ok(()));
}

/// New medium blocks start on the medium grid (32 KiB; 64 KiB for the 64 KiB class), also where
/// the free space before them is not aligned (the padding stays free), so the pages that hold
/// their starts are few and the same ones again. Page-aligned requests too (I/O buffers).
#[test]
fn medium_blocks_start_on_the_medium_grid() {
    let a = small_instance();
    // One request per class, 20 to 64 KiB.
    let sizes = [
        16 << 10 | 1,
        24 << 10,
        27_000,
        32 << 10,
        33 << 10,
        48 << 10,
        50_000,
        64 << 10,
    ];
    let mut live = std::vec::Vec::new();
    let mut off_grid = 0;
    for i in 0..48 {
        // An engine block on no grid (aligned beyond what medium blocks serve, an odd size): the
        // free space after it is not aligned. Every other one is freed again.
        let odd = layout(small::SMALL_MAX + 16 + i * 48, BEYOND_MEDIUM);
        let o = alloc_ok(&a, odd);
        // (Medium blocks are not freed in the loop: each request is a new engine block.)
        let l = layout(sizes[i % sizes.len()], if i % 3 == 0 { 4096 } else { 8 });
        let p = alloc_ok(&a, l);
        let grid = if a.usable_size(p) == Some(64 << 10) {
            64 << 10
        } else {
            medium::MEDIUM_GRID
        };
        assert_eq!(p as usize % grid, 0, "{l:?} at {p:p}");
        off_grid += usize::from(o as usize % medium::MEDIUM_GRID != 0);
        live.push((p, l));
        if i % 2 == 0 {
            // SAFETY: `o` came from `a` with `odd` and is freed once.
            unsafe { a.dealloc(o, odd) };
        } else {
            live.push((o, odd));
        }
    }
    // (The odd blocks themselves were off the grid: the test placed medium blocks after them.)
    assert!(off_grid > 24, "only {off_grid} odd blocks off the grid");
    assert_eq!(a.check(), Ok(()));
    free_all(&a, live);
}

/// Fills `a`'s arena with engine blocks aligned beyond what medium blocks serve (1 MiB, then
/// 64 KiB, then just above the slab limit, each size until none fits): what is left free is too
/// small for any medium block. Returns them for the caller to free.
fn fill_engine(a: &GlobalBfc) -> std::vec::Vec<(*mut u8, Layout)> {
    let mut live = std::vec::Vec::new();
    for size in [1 << 20, 64 << 10, small::SMALL_MAX + 16] {
        let l = layout(size, BEYOND_MEDIUM);
        loop {
            // SAFETY: a non-zero size; the caller frees each block once with `l`.
            let p = unsafe { a.alloc(l) };
            if p.is_null() {
                break;
            }
            live.push((p, l));
        }
    }
    live
}

/// Frees the highest of `live`'s blocks (taking it out of `live`) and returns its address.
fn free_highest(a: &GlobalBfc, live: &mut std::vec::Vec<(*mut u8, Layout)>) -> usize {
    let i = (0..live.len()).max_by_key(|&i| live[i].0 as usize).unwrap();
    let (x, l) = live.swap_remove(i);
    // SAFETY: `x` came from `a` with `l` (the caller's promise for `live`) and is freed once.
    unsafe { a.dealloc(x, l) };
    x as usize
}

/// Frees `n` neighbouring 1 MiB blocks of `live` (from [`fill_engine`]), taking them out of
/// `live`, and returns the start of the place they leave.
fn free_mib_blocks(a: &GlobalBfc, live: &mut std::vec::Vec<(*mut u8, Layout)>, n: usize) -> usize {
    let mib = 1 << 20;
    let starts: std::collections::BTreeSet<usize> = live
        .iter()
        .filter(|&&(_, l)| l.size() == mib)
        .map(|&(p, _)| p as usize)
        .collect();
    let x = *starts
        .iter()
        .find(|&&s| (1..n).all(|k| starts.contains(&(s + k * mib))))
        .expect("no neighbouring 1 MiB blocks");
    let (freed, kept) = live
        .drain(..)
        .partition::<std::vec::Vec<_>, _>(|&(p, _)| (x..x + n * mib).contains(&(p as usize)));
    *live = kept;
    assert_eq!(freed.len(), n);
    for (p, l) in freed {
        // SAFETY: `p` came from `a` with `l` (the caller's promise for `live`) and is freed once.
        unsafe { a.dealloc(p, l) };
    }
    x
}

/// Frees every block of `live` (each from `a`, with its layout), empties this thread's cache, and
/// asserts that nothing is in use and the heap checks.
fn free_all(a: &GlobalBfc, live: std::vec::Vec<(*mut u8, Layout)>) {
    for (p, l) in live {
        // SAFETY: each block came from `a` with its layout and is freed once.
        unsafe { a.dealloc(p, l) };
    }
    a.flush_thread_cache();
    assert_eq!(a.stats().bytes_in_use, 0);
    assert_eq!(a.check(), Ok(()));
}

/// The medium grid is a preference: a medium request that only an unaligned hole can serve
/// (with or without thread caches) takes it, and the block is a medium block as any other.
#[test]
fn a_medium_request_takes_a_hole_off_the_grid() {
    for cache in [false, true] {
        let a = small_instance_with_caches(cache);
        let mut live = fill_engine(&a);
        let i = live.iter().position(|&(_, l)| l.size() == 1 << 20).unwrap();
        let (x, xl) = live.swap_remove(i);
        // SAFETY: `x` came from `a` with `xl` and is freed once.
        unsafe { a.dealloc(x, xl) };
        // Refill the freed 1 MiB but for a 24 KiB hole just past a grid point: no grid point in it
        // has 20 KiB behind it.
        let x = x as usize;
        let hole = 24 << 10;
        let h = (x + (64 << 10)).next_multiple_of(medium::MEDIUM_GRID) + BEYOND_MEDIUM;
        let (la, lh) = (layout(h - x, BEYOND_MEDIUM), layout(hole, BEYOND_MEDIUM));
        let ld = layout(x + (1 << 20) - h - hole, BEYOND_MEDIUM);
        let (pa, ph, pd) = (alloc_ok(&a, la), alloc_ok(&a, lh), alloc_ok(&a, ld));
        assert_eq!(
            (pa as usize, ph as usize, pd as usize),
            (x, h, h + hole),
            "cache {cache}: the refill did not take the freed block's place"
        );
        live.extend([(pa, la), (pd, ld)]);
        let m = layout(20_000, 8);
        // SAFETY: a non-zero size (nothing to free: asserted null).
        let none = unsafe { a.alloc(m) };
        assert!(none.is_null(), "cache {cache}: room left elsewhere");
        // SAFETY: `ph` came from `a` with `lh` and is freed once.
        unsafe { a.dealloc(ph, lh) };
        let p = alloc_ok(&a, m);
        assert_eq!(
            p as usize, h,
            "cache {cache}: the medium request missed the hole"
        );
        assert_eq!(a.usable_size(p), Some(20 << 10));
        assert_eq!(a.check(), Ok(()));
        // It is a medium block: freed and taken again by another request of its class.
        // SAFETY: `p` came from `a` with `m` and is freed once.
        unsafe { a.dealloc(p, m) };
        let other = layout(19_000, 16);
        let q = alloc_ok(&a, other);
        assert_eq!(q as usize, h, "cache {cache}");
        live.push((q, other));
        free_all(&a, live);
    }
}

/// The same at the arena's end: the last 24 KiB (the grid points around them have no 20 KiB
/// behind them inside the arena) still serve a medium request.
#[test]
fn a_medium_request_takes_the_end_of_the_arena_off_the_grid() {
    for cache in [false, true] {
        let a = small_instance_with_caches(cache);
        let mut live = fill_engine(&a);
        let end = a.with_heap(|h| h.arena_end).unwrap();
        assert_eq!(end % (64 << 10), 0);
        let x = free_highest(&a, &mut live);
        let h = end - (24 << 10);
        assert!(h > x);
        let la = layout(h - x, BEYOND_MEDIUM);
        let pa = alloc_ok(&a, la);
        assert_eq!(pa as usize, x);
        assert_eq!(a.usable_size(pa), Some(h - x));
        live.push((pa, la));
        let m = layout(20_000, 8);
        let p = alloc_ok(&a, m);
        assert_eq!(
            p as usize, h,
            "cache {cache}: the medium request missed the arena's end"
        );
        assert_eq!(a.check(), Ok(()));
        live.push((p, m));
        free_all(&a, live);
    }
}

/// Medium requests aligned to more than 16 bytes, up to `MEDIUM_ALIGN` (a page), are medium
/// blocks too: cached, and handed out again for requests of the class at any of those alignments.
#[test]
fn aligned_medium_requests_are_cached() {
    let a = small_instance();
    let l64 = layout(30_000, 64);
    let p = alloc_ok(&a, l64);
    assert_eq!(p as usize % medium::MEDIUM_ALIGN, 0);
    assert_eq!(a.usable_size(p), Some(32 << 10));
    let mut last = l64;
    for align in [128, 4096, 16] {
        // SAFETY: `p` came from `a` with `last` and is freed once.
        unsafe { a.dealloc(p, last) };
        assert_eq!(a.thread_cache_bytes(), 32 << 10);
        last = layout(32 << 10, align);
        let allocs = a.stats().num_allocs;
        assert_eq!(alloc_ok(&a, last), p, "aligned to {align}");
        assert_eq!(
            a.stats().num_allocs,
            allocs,
            "aligned to {align}: not from the cache"
        );
    }
    free_all(&a, std::vec![(p, last)]);
}

/// A block that a resize in place leaves at a medium class's size but off `MEDIUM_ALIGN` (a large
/// block placed at 16 bytes near the arena's end) gets no medium table entry: a cache could hand
/// it out for a request aligned to more. Freed with the medium layout, it goes to the engine.
#[test]
fn a_block_resized_into_a_medium_class_off_its_alignment_is_not_named() {
    let a = small_instance();
    let mut live = fill_engine(&a);
    let end = a.with_heap(|h| h.arena_end).unwrap();
    let x = free_highest(&a, &mut live);
    // The arena's last 100,016 bytes: no 64 KiB grid point in them has 100,000 behind it.
    let large = layout(100_000, 16);
    let h = end - 100_016;
    assert_ne!(h % medium::MEDIUM_ALIGN, 0);
    let la = layout(h - x, BEYOND_MEDIUM);
    let pa = alloc_ok(&a, la);
    assert_eq!(pa as usize, x);
    live.push((pa, la));
    let p = alloc_ok(&a, large);
    assert_eq!(p as usize, h, "not placed off the grid");
    // SAFETY: `p` came from `a` with `large`; shrunk to a medium class's size.
    let q = unsafe { a.realloc(p, large, 40_000) };
    assert_eq!(q, p, "not shrunk in place");
    assert_eq!(a.usable_size(q), Some(40 << 10));
    assert_eq!(a.check(), Ok(()));
    // SAFETY: `q` came from the realloc with this size and is freed once.
    unsafe { a.dealloc(q, layout(40_000, 16)) };
    assert_eq!(a.thread_cache_bytes(), 0);
    assert_eq!(a.usable_size(q), None);
    free_all(&a, live);
}

/// A thread caches at most `MEDIUM_BIN` blocks of a medium class and `MEDIUM_BUDGET` bytes of
/// them in all (twice that while it meets contention); the rest go back to the engine, and every
/// block is accounted for. In a thread that meets contention they go to the heap's medium transfer
/// cache first, while it has room: at most `TRANSFER_BIN` blocks of a class and `TRANSFER_BUDGET`
/// bytes.
#[test]
fn medium_caches_are_bounded() {
    for contended in [false, true] {
        let a = small_instance();
        let small = if contended { cache_upper_blocks(&a) } else { 0 };
        let (bin, budget) = if contended {
            (
                medium::CONTENDED_MEDIUM_BIN,
                medium::CONTENDED_MEDIUM_BUDGET,
            )
        } else {
            (medium::MEDIUM_BIN, medium::MEDIUM_BUDGET)
        };
        let mut blocks = std::vec::Vec::new();
        for m in 0..medium::NUM_LOWER {
            let l = layout(medium::class_size(m), 16);
            for _ in 0..2 * bin {
                blocks.push((alloc_ok(&a, l), l));
            }
        }
        for &(p, l) in &blocks {
            // SAFETY: each block came from `a` with `l` and is freed once.
            unsafe { a.dealloc(p, l) };
            assert!(a.thread_cache_bytes() - small <= budget);
            let counts = tcache::with(|tc| {
                (0..medium::NUM_MEDIUM)
                    .map(|m| tc.medium_count(m))
                    .max()
                    .unwrap()
            });
            assert!(counts.unwrap() <= bin);
        }
        let cached = a.thread_cache_bytes() - small;
        // The budget is nearly used: no class's block fits beside the cached ones.
        assert!(cached + (64 << 10) > budget, "{cached}");
        let (moved, most) = a
            .with_heap(|h| {
                let t = &h.medium_transfer;
                (t.held().0, (0..medium::NUM_LOWER).map(|m| t.count(m)).max())
            })
            .unwrap();
        if contended {
            assert!(moved <= medium::TRANSFER_BUDGET, "{moved}");
            assert!(moved + (64 << 10) > medium::TRANSFER_BUDGET, "{moved}");
            assert!(most.unwrap() <= medium::TRANSFER_BIN);
        } else {
            assert_eq!(moved, 0);
        }
        let s = a.stats();
        assert_eq!(
            (s.bytes_in_use, s.bytes_cached),
            (0, small + cached + moved)
        );
        assert_eq!(a.check(), Ok(()));
        // An explicit flush empties the transfer cache too.
        a.flush_thread_cache();
        assert_eq!(a.stats().bytes_cached, 0);
        for &(p, _) in &blocks {
            assert_eq!(a.usable_size(p), None, "{p:p} still held");
        }
        assert_eq!(a.check(), Ok(()));
    }
}

/// A medium block resized in place is cached by the class of its new size, and one grown past
/// 64 KiB is an engine block again (its table entry goes: `check` would find it stale).
#[test]
fn resized_medium_blocks_are_cached_by_their_new_class() {
    let a = small_instance();
    let l = layout(17_000, 8);
    let p = alloc_ok(&a, l);
    // Within the class: in place, without the lock.
    // SAFETY: `p` came from `a` with the layout passed, each realloc with the one before.
    let q = unsafe { a.realloc(p, l, 20_000) };
    assert_eq!(q, p);
    // Into the next class, in place (the free top follows the block).
    // SAFETY: as above.
    let r = unsafe { a.realloc(p, layout(20_000, 8), 30_000) };
    assert_eq!(r, p);
    assert_eq!(a.usable_size(p), Some(32 << 10));
    assert_eq!(a.check(), Ok(()));
    // SAFETY: `p` has the layout of its last realloc; freed once.
    unsafe { a.dealloc(p, layout(30_000, 8)) };
    assert_eq!(a.thread_cache_bytes(), 32 << 10);
    let again = layout(32 << 10, 16);
    assert_eq!(alloc_ok(&a, again), p);
    // Past the medium classes, in place.
    // SAFETY: as above.
    let g = unsafe { a.realloc(p, again, 100_000) };
    assert_eq!(g, p);
    assert_eq!(a.usable_size(p), Some(100_000));
    assert_eq!(a.check(), Ok(()));
    // And back into a class: shrunk in place to the class's size.
    // SAFETY: as above.
    let s = unsafe { a.realloc(p, layout(100_000, 8), 40_000) };
    assert_eq!(s, p);
    assert_eq!(a.usable_size(p), Some(40 << 10));
    assert_eq!(a.check(), Ok(()));
    // SAFETY: as above.
    unsafe { a.dealloc(p, layout(40_000, 8)) };
    assert_eq!(a.thread_cache_bytes(), 40 << 10);
    a.flush_thread_cache();
    assert_eq!(a.stats().bytes_in_use, 0);
    assert_eq!(a.check(), Ok(()));
}

/// A medium block freed with the layout of another medium class is not cached under that class
/// (the table names its own): it takes the pointer-based free.
#[test]
fn a_medium_block_freed_with_another_class_is_not_cached() {
    let a = small_instance();
    let p = alloc_ok(&a, layout(20_000, 8));
    // SAFETY: `p` came from `a` and is freed once (with a layout of the wrong class on purpose:
    // the heap frees engine blocks by their pointer).
    unsafe { a.dealloc(p, layout(60_000, 8)) };
    assert_eq!(a.thread_cache_bytes(), 0);
    assert_eq!(a.usable_size(p), None);
    assert_eq!(a.stats().bytes_in_use, 0);
    assert_eq!(a.check(), Ok(()));
}

/// `check` finds a medium table entry that names no live block of its class, and a cached
/// medium block the table does not name.
#[test]
fn check_finds_wrong_medium_entries() {
    let a = small_instance();
    let l = layout(40_000, 8);
    let p = alloc_ok(&a, l);
    let m = medium::class_for(40_000, 8).unwrap();
    let set = |class: usize| a.with_heap(|h| h.medium.set(class, p as usize)).unwrap();
    set(0);
    let e = a.check().unwrap_err();
    assert_eq!(
        (e.what, e.at),
        (
            "the medium table names a block that is not a live, aligned block of its class",
            Some(p as usize)
        )
    );
    set(m);
    assert_eq!(a.check(), Ok(()));
    // SAFETY: `p` came from `a` with `l` and is freed once.
    unsafe { a.dealloc(p, l) };
    a.with_heap(|h| h.medium.clear(p as usize)).unwrap();
    let e = a.check().unwrap_err();
    assert_eq!(
        e.what,
        "thread cache holds a block that is not a live medium block of its class"
    );
    set(m);
    assert_eq!(a.check(), Ok(()));
}

/// Binds the calling thread's cache to `a` (a small allocation and free), then makes it cache
/// upper-class blocks, as after an upper-class request that found the heap lock held. Returns the
/// bytes the cache holds then (small blocks from the refill).
fn cache_upper_blocks(a: &GlobalBfc) -> usize {
    let l = layout(64, 8);
    let p = alloc_ok(a, l);
    // SAFETY: `p` came from `a` with `l` and is freed once.
    unsafe { a.dealloc(p, l) };
    assert_eq!(a.bound_cache(|tc| tc.note_lock(true)), Some(()));
    a.thread_cache_bytes()
}

/// Ends the calling thread's caching of upper-class blocks and its larger medium stacks (its
/// cache is bound to `a`), as `CONTENDED_HEAT` medium or upper-class lock operations in a row that
/// found the lock free do; after `left` fewer of them, one more ends it.
fn stop_caching_upper(a: &GlobalBfc, left: u32) {
    a.bound_cache(|tc| {
        for _ in left..tcache::CONTENDED_HEAT {
            tc.note_lock(false);
        }
    })
    .unwrap();
}

/// Whether the calling thread's cache (bound to `a`) caches upper-class blocks now.
fn caches_upper(a: &GlobalBfc) -> bool {
    a.bound_cache(|tc| tc.caches_upper()).unwrap()
}

/// Upper-class requests (above 64 KiB, at most 1 MiB) are cached only by a thread whose
/// upper-class requests found the heap lock held: before, a block of the request's own size goes
/// back to the engine when freed; after, a block of the class size waits in the cache and serves
/// requests of its class and of the two classes below without the engine; and once
/// `CONTENDED_HEAT` lock operations of such requests in a row found the lock free, the thread
/// stops caching them.
#[test]
fn upper_blocks_are_cached_only_after_contention() {
    let a = small_instance();
    let l = layout(200_000, 8);
    let m = medium::upper_class_for(200_000, 8).unwrap();
    assert_eq!(medium::class_size(m), 224 << 10);
    let p = alloc_ok(&a, l);
    assert_eq!(a.usable_size(p), Some(200_000));
    // SAFETY: `p` came from `a` with `l` and is freed once.
    unsafe { a.dealloc(p, l) };
    assert_eq!((a.thread_cache_bytes(), a.usable_size(p)), (0, None));

    let small = cache_upper_blocks(&a);
    let q = alloc_ok(&a, l);
    assert_eq!(a.usable_size(q), Some(224 << 10));
    // SAFETY: `q` came from `a` with `l` and is freed once.
    unsafe { a.dealloc(q, l) };
    assert_eq!(a.thread_cache_bytes(), small + (224 << 10));
    let s = a.stats();
    assert_eq!((s.bytes_in_use, s.bytes_cached), (0, small + (224 << 10)));
    assert_eq!(a.usable_size(q), Some(224 << 10));
    assert_eq!(a.check(), Ok(()));
    // A request two classes down (160 KiB) takes it, without the engine.
    let down = layout(150_000, 16);
    assert_eq!(medium::upper_class_for(150_000, 16), Some(m - 2));
    assert_eq!(alloc_ok(&a, down), q);
    assert_eq!(a.stats().num_allocs, s.num_allocs);
    // Three classes down (128 KiB) does not.
    // SAFETY: `q` came from `a` with `down` and is freed once.
    unsafe { a.dealloc(q, down) };
    let three_down = layout(128 << 10, 16);
    let r = alloc_ok(&a, three_down);
    assert_ne!(r, q);
    assert_eq!(a.usable_size(r), Some(128 << 10));
    assert_eq!(a.stats().num_allocs, s.num_allocs + 1);
    // SAFETY: `r` came from `a` with `three_down` and is freed once.
    unsafe { a.dealloc(r, three_down) };
    assert_eq!(a.flush_thread_cache(), 2 + small / 64);
    assert_eq!((a.usable_size(q), a.usable_size(r)), (None, None));

    // One lock operation left: an upper-class miss that finds the lock free ends the caching, and
    // its block has the request's size.
    a.bound_cache(|tc| tc.note_lock(true)).unwrap();
    stop_caching_upper(&a, 1);
    assert!(caches_upper(&a));
    let e = alloc_ok(&a, l);
    assert!(!caches_upper(&a));
    assert_eq!(a.usable_size(e), Some(200_000));
    // SAFETY: `e` came from `a` with `l` and is freed once.
    unsafe { a.dealloc(e, l) };
    assert_eq!((a.thread_cache_bytes(), a.usable_size(e)), (0, None));
    assert_eq!(a.check(), Ok(()));
}

/// Runs `f` on this thread while another thread holds `a`'s heap lock, which it releases once a
/// thread waiting for it ran the lock's re-entry check once more (so `f`'s first attempt to take it
/// failed),
/// or after a minute (then `f` may not have waited; the caller's assertions fail).
fn while_the_lock_is_held<R>(a: &std::sync::Arc<GlobalBfc>, f: impl FnOnce() -> R) -> R {
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    let held = std::sync::Arc::new(AtomicBool::new(false));
    let (b, h) = (a.clone(), held.clone());
    let holder = std::thread::spawn(move || {
        let anchor = b.anchor.load(crate::sync::Ordering::Acquire);
        b.with_heap(|_| {
            h.store(true, SeqCst);
            // SAFETY: the anchor lives as long as `b`; only the lock's own counter is read.
            let lock = unsafe { &(*anchor).heap };
            let (checks, start) = (lock.reentry_checks(), std::time::Instant::now());
            while lock.reentry_checks() == checks && start.elapsed().as_secs() < 60 {
                std::thread::yield_now();
            }
        })
        .unwrap();
    });
    while !held.load(SeqCst) {
        std::thread::yield_now();
    }
    let r = f();
    holder.join().unwrap();
    r
}

/// An upper-class allocation or free that finds the heap lock held (here by another thread) makes
/// its thread cache upper-class blocks from then on; the same requests finding it free do not,
/// and a thread whose cache was not bound yet (it made only upper-class requests) binds it.
#[test]
#[cfg_attr(miri, ignore = "waits for thousands of spins")]
fn an_upper_request_that_waits_for_the_lock_starts_the_caching() {
    let a = std::sync::Arc::new(small_instance());
    let l = layout(300_000, 8);
    // A thread with no bound cache: uncontended requests leave it unbound and not caching.
    let b = a.clone();
    std::thread::spawn(move || {
        let p = alloc_ok(&b, l);
        // SAFETY: `p` came from `b` with `l` and is freed once.
        unsafe { b.dealloc(p, l) };
        assert_eq!(b.bound_cache(|_| ()), None);
        let q = while_the_lock_is_held(&b, || alloc_ok(&b, l));
        assert!(caches_upper(&b));
        // SAFETY: `q` came from `b` with `l` and is freed once.
        unsafe { b.dealloc(q, l) };
    })
    .join()
    .unwrap();

    cache_upper_blocks(&a);
    stop_caching_upper(&a, 0);
    assert!(!caches_upper(&a));
    let p = alloc_ok(&a, l);
    // SAFETY: `p` came from `a` with `l` and is freed once.
    unsafe { a.dealloc(p, l) };
    assert!(!caches_upper(&a));
    // An allocation that waits.
    let q = while_the_lock_is_held(&a, || alloc_ok(&a, l));
    assert!(caches_upper(&a));
    // The block taken while waiting has the request's size; the next one the class size, and it
    // is cached when freed.
    assert_eq!(a.usable_size(q), Some(300_000));
    let r = alloc_ok(&a, l);
    assert_eq!(a.usable_size(r), Some(320 << 10));
    let before = a.thread_cache_bytes();
    // SAFETY: each came from `a` with `l` and is freed once.
    unsafe {
        a.dealloc(q, l);
        a.dealloc(r, l);
    }
    assert_eq!(a.thread_cache_bytes(), before + (320 << 10));
    assert_eq!(a.usable_size(q), None);
    // A free that waits.
    a.flush_thread_cache();
    stop_caching_upper(&a, 0);
    let s = alloc_ok(&a, l);
    // SAFETY: `s` came from `a` with `l` and is freed once.
    while_the_lock_is_held(&a, || unsafe { a.dealloc(s, l) });
    assert!(caches_upper(&a));
    assert_eq!(a.usable_size(s), None);
    a.flush_thread_cache();
    assert_eq!(a.stats().bytes_in_use, 0);
    assert_eq!(a.check(), Ok(()));
}

/// A thread that meets contention on the heap lock caches up to `CONTENDED_MEDIUM_BIN` blocks of
/// a medium class, and more than `MEDIUM_BUDGET` bytes of them (at most
/// `CONTENDED_MEDIUM_BUDGET`). Once the contention ends, a stack takes no more until it is below
/// the usual cap: a free then halves it and the block itself goes to the engine.
#[test]
fn medium_caches_hold_more_while_the_thread_meets_contention() {
    let a = small_instance();
    let small = cache_upper_blocks(&a);
    let cached = |m: usize| tcache::with(|tc| tc.medium_count(m)).unwrap();
    let n = medium::CONTENDED_MEDIUM_BIN;
    assert!(n > medium::MEDIUM_BIN);
    let (l20, l64) = (layout(20 << 10, 16), layout(64 << 10, 16));
    let take = |l: Layout, k: usize| {
        (0..k)
            .map(|_| alloc_ok(&a, l))
            .collect::<std::vec::Vec<_>>()
    };
    let free = |ps: &[*mut u8], l: Layout| {
        for &p in ps {
            // SAFETY: each block came from `a` with `l` and is freed once.
            unsafe { a.dealloc(p, l) };
        }
    };
    let (b20, b64) = (take(l20, n + 1), take(l64, n));
    free(&b20[..n], l20);
    free(&b64, l64);
    let top = medium::NUM_LOWER - 1;
    assert_eq!((cached(0), cached(top)), (n, n));
    let medium = a.thread_cache_bytes() - small;
    assert_eq!(medium, n * ((20 << 10) + (64 << 10)));
    assert!(medium > medium::MEDIUM_BUDGET && medium <= medium::CONTENDED_MEDIUM_BUDGET);
    assert_eq!(a.stats().bytes_cached, small + medium);
    assert_eq!(a.check(), Ok(()));
    // The contention ends.
    stop_caching_upper(&a, 0);
    free(&b20[n..], l20);
    assert_eq!(cached(0), n / 2);
    assert_eq!(a.usable_size(b20[n]), None, "cached");
    assert_eq!(a.check(), Ok(()));
    a.flush_thread_cache();
    assert_eq!(a.stats().bytes_in_use, 0);
    assert_eq!(a.check(), Ok(()));
}

/// A medium allocation or free that finds the heap lock held (here by another thread) makes its
/// thread count as meeting contention; the same requests finding it free do not.
#[test]
#[cfg_attr(miri, ignore = "waits for thousands of spins")]
fn a_medium_request_that_waits_for_the_lock_marks_the_thread_contended() {
    let a = std::sync::Arc::new(small_instance());
    let contended = |a: &GlobalBfc| a.bound_cache(|tc| tc.contended()).unwrap();
    let l = layout(40 << 10, 16);
    let k = medium::MEDIUM_BIN + 1;
    let ps: std::vec::Vec<_> = (0..k).map(|_| alloc_ok(&a, l)).collect();
    assert!(!contended(&a));
    // An allocation that waits (the class's stack is empty: a miss).
    let q = while_the_lock_is_held(&a, || alloc_ok(&a, l));
    assert!(contended(&a));
    stop_caching_upper(&a, 0);
    assert!(!contended(&a));
    // SAFETY: each block came from `a` with `l` and is freed once.
    unsafe {
        a.dealloc(q, l);
        for &p in &ps[..k - 2] {
            a.dealloc(p, l);
        }
    }
    assert!(!contended(&a));
    assert_eq!(
        tcache::with(|tc| tc.medium_count(medium::class_for(40 << 10, 16).unwrap())),
        Some(medium::MEDIUM_BIN)
    );
    // A free that waits (the stack is full: the slow path).
    let p = ps[k - 2];
    // SAFETY: `p` came from `a` with `l` and is freed once.
    while_the_lock_is_held(&a, || unsafe { a.dealloc(p, l) });
    assert!(contended(&a));
    // SAFETY: the last block came from `a` with `l` and is freed once.
    unsafe { a.dealloc(ps[k - 1], l) };
    a.flush_thread_cache();
    assert_eq!(a.stats().bytes_in_use, 0);
    assert_eq!(a.check(), Ok(()));
}

/// A medium layout freed on an upper-class block (a wrong layout) does not put it in the
/// upper-class stacks of a thread that does not cache them; it goes back to the engine.
#[test]
fn an_upper_block_freed_with_a_medium_layout_is_not_cached() {
    let a = small_instance();
    let small = cache_upper_blocks(&a);
    let p = alloc_ok(&a, layout(200_000, 8));
    assert_eq!(a.usable_size(p), Some(224 << 10));
    stop_caching_upper(&a, 0);
    // SAFETY: `p` came from `a`; the layout is the wrong one under test (a medium class's).
    unsafe { a.dealloc(p, layout(60_000, 8)) };
    assert_eq!(a.thread_cache_bytes(), small);
    assert_eq!(a.usable_size(p), None);
    assert_eq!(a.check(), Ok(()));
}

/// A class-size upper-class block resized in place loses its table entry (so it is not cached as
/// a block of its old class), and an exiting thread gives its cached upper-class blocks back.
#[test]
fn resized_and_exiting_upper_blocks_go_back_to_the_engine() {
    let a = std::sync::Arc::new(small_instance());
    let b = a.clone();
    let l = layout(100_000, 8);
    let kept = std::thread::spawn(move || {
        let small = cache_upper_blocks(&b);
        let p = alloc_ok(&b, l);
        assert_eq!(b.usable_size(p), Some(112 << 10));
        // SAFETY: `p` came from `b` with `l`; shrunk in place to 90,000 bytes (no move: the
        // engine shrinks a block where it lies).
        let q = unsafe { b.realloc(p, l, 90_000) };
        assert_eq!(q, p);
        assert_eq!(b.usable_size(q), Some(90_000));
        // SAFETY: `q` holds 90,000 bytes; freed once with that layout.
        unsafe { b.dealloc(q, layout(90_000, 8)) };
        assert_eq!((b.thread_cache_bytes(), b.usable_size(q)), (small, None));
        // A cached block, kept across the thread's exit.
        let r = alloc_ok(&b, l);
        // SAFETY: `r` came from `b` with `l` and is freed once.
        unsafe { b.dealloc(r, l) };
        assert_eq!(b.thread_cache_bytes(), small + (112 << 10));
        r as usize
    })
    .join()
    .unwrap();
    assert_all_given_back(&a, kept);
}

/// A thread caches at most `MEDIUM_BIN` blocks of an upper class and `UPPER_BUDGET` bytes of them
/// in all (beside the medium classes' budget); the rest go back to the engine, and every block is
/// accounted for.
#[test]
fn upper_caches_are_bounded() {
    let a = GlobalBfc::with_config(HostConfig {
        arena_size: 256 << 20,
        min_arena_size: 256 << 20,
        chunk_capacity: 1 << 12,
        ..HostConfig::DEFAULT
    });
    let small = cache_upper_blocks(&a);
    let upper_bytes = || {
        a.bound_cache(|tc| {
            (medium::NUM_LOWER..medium::NUM_MEDIUM)
                .map(|m| tc.medium_count(m) * medium::class_size(m))
                .sum::<usize>()
        })
        .unwrap()
    };
    let mut blocks = std::vec::Vec::new();
    for m in medium::NUM_LOWER..medium::NUM_MEDIUM {
        let l = layout(medium::class_size(m), 16);
        let n = if medium::class_size(m) <= 256 << 10 {
            medium::MEDIUM_BIN + 2
        } else {
            4
        };
        for _ in 0..n {
            blocks.push((alloc_ok(&a, l), l));
        }
    }
    for &(p, l) in &blocks {
        // SAFETY: each block came from `a` with `l` and is freed once.
        unsafe { a.dealloc(p, l) };
        assert!(upper_bytes() <= medium::UPPER_BUDGET);
        let most = a
            .bound_cache(|tc| {
                (medium::NUM_LOWER..medium::NUM_MEDIUM)
                    .map(|m| tc.medium_count(m))
                    .max()
                    .unwrap()
            })
            .unwrap();
        assert!(most <= medium::MEDIUM_BIN);
    }
    assert!(caches_upper(&a));
    let cached = upper_bytes();
    // The budget is nearly used: the largest class's block does not fit beside the cached ones.
    assert!(
        cached + medium::UPPER_MAX > medium::UPPER_BUDGET,
        "{cached}"
    );
    assert_eq!(a.thread_cache_bytes(), small + cached);
    let s = a.stats();
    assert_eq!((s.bytes_in_use, s.bytes_cached), (0, small + cached));
    assert_eq!(a.check(), Ok(()));
    a.flush_thread_cache();
    assert_eq!(a.stats().bytes_cached, 0);
    for &(p, _) in &blocks {
        assert_eq!(a.usable_size(p), None, "{p:p} still held");
    }
    assert_eq!(a.check(), Ok(()));
}

/// `HostConfig::upper_cache_bytes` bounds a thread's upper-class blocks (here 1 MiB: two blocks
/// of the 512 KiB class), and 0 turns the upper classes off: a request that finds the lock held
/// starts no caching, and its blocks have the request's size.
#[test]
#[cfg_attr(miri, ignore = "waits for thousands of spins")]
fn the_upper_budget_is_configurable() {
    let with_budget = |upper_cache_bytes| {
        std::sync::Arc::new(GlobalBfc::with_config(HostConfig {
            arena_size: 64 << 20,
            min_arena_size: 64 << 20,
            chunk_capacity: 1 << 12,
            upper_cache_bytes,
            ..HostConfig::DEFAULT
        }))
    };
    let l = layout(500_000, 8);
    let a = with_budget(1 << 20);
    cache_upper_blocks(&a);
    let blocks: std::vec::Vec<*mut u8> = (0..3).map(|_| alloc_ok(&a, l)).collect();
    for &p in &blocks {
        assert_eq!(a.usable_size(p), Some(512 << 10));
        // SAFETY: each came from `a` with `l` and is freed once.
        unsafe { a.dealloc(p, l) };
        assert!(a.bound_cache(|tc| tc.medium_bytes(true)).unwrap() <= 1 << 20);
        assert_eq!(a.check(), Ok(()));
    }
    assert_eq!(a.bound_cache(|tc| tc.medium_bytes(true)), Some(1 << 20));
    a.flush_thread_cache();
    assert_eq!(a.stats().bytes_in_use, 0);
    // (Dropped, so that this thread's cache may bind to the next instance.)
    drop(a);

    // A budget of 512 KiB: a 900,000-byte request (1 MiB class) is not rounded; a 400,000-byte
    // one (448 KiB class) is, and its block is cached.
    let half = with_budget(512 << 10);
    let small = cache_upper_blocks(&half);
    let big = alloc_ok(&half, layout(900_000, 8));
    assert_eq!(half.usable_size(big), Some(900_000));
    let fits = alloc_ok(&half, layout(400_000, 8));
    assert_eq!(half.usable_size(fits), Some(448 << 10));
    // SAFETY: each came from `half` with its layout and is freed once.
    unsafe {
        half.dealloc(big, layout(900_000, 8));
        half.dealloc(fits, layout(400_000, 8));
    }
    assert_eq!(half.thread_cache_bytes(), small + (448 << 10));
    assert_eq!(half.usable_size(big), None);
    half.flush_thread_cache();
    drop(half);

    // Below the smallest upper class (80 KiB), caching never starts.
    let tiny = with_budget(64 << 10);
    cache_upper_blocks(&tiny);
    assert!(!caches_upper(&tiny));
    drop(tiny);

    let off = with_budget(0);
    let small = cache_upper_blocks(&off);
    assert!(!caches_upper(&off));
    let p = while_the_lock_is_held(&off, || alloc_ok(&off, l));
    assert!(!caches_upper(&off));
    assert_eq!(off.usable_size(p), Some(500_000));
    // SAFETY: `p` came from `off` with `l` and is freed once.
    unsafe { off.dealloc(p, l) };
    assert_eq!(
        (off.thread_cache_bytes(), off.usable_size(p)),
        (small, None)
    );
    assert_eq!(off.check(), Ok(()));
}

/// A cached upper-class block freed again on the same thread is caught at the second free.
#[test]
#[cfg_attr(miri, ignore = "spawns a child process")]
fn an_upper_block_freed_twice_aborts() {
    let case = "an_upper_block_freed_twice_aborts";
    if is_child(case) {
        let a = small_instance();
        cache_upper_blocks(&a);
        let l = layout(500_000, 8);
        let p = alloc_ok(&a, l);
        // SAFETY: the first free is valid; the second is the error under test.
        unsafe {
            a.dealloc(p, l);
            a.dealloc(p, l);
        }
        std::println!("child survived");
        return;
    }
    assert_child_aborts("host::tests", case, "already in this thread's cache");
}

/// A medium block freed twice in a row on one thread is caught at the second free.
#[test]
#[cfg_attr(miri, ignore = "spawns a child process")]
fn a_medium_block_freed_twice_aborts() {
    let case = "a_medium_block_freed_twice_aborts";
    if is_child(case) {
        let a = small_instance();
        let l = layout(30_000, 8);
        let p = alloc_ok(&a, l);
        // SAFETY: the first free is valid; the second is the error under test.
        unsafe {
            a.dealloc(p, l);
            a.dealloc(p, l);
        }
        std::println!("child survived");
        return;
    }
    assert_child_aborts("host::tests", case, "already in this thread's cache");
}

/// `alloc_zeroed` takes a cached medium block too, and writes it whole.
#[test]
fn zeroed_medium_blocks_from_the_cache_are_zero() {
    let a = small_instance();
    let l = layout(50_000, 8);
    let p = alloc_ok(&a, l);
    // SAFETY: the block holds its class's 56 KiB; it came from `a` with `l` and is freed once.
    unsafe {
        p.write_bytes(0xa5, 56 << 10);
        a.dealloc(p, l);
    }
    // SAFETY: a non-zero size.
    let z = unsafe { a.alloc_zeroed(l) };
    assert_eq!(z, p);
    // SAFETY: `z` holds `l.size()` bytes; it came from `a` with `l` and is freed once.
    unsafe {
        assert!(filled_with(z, l.size(), 0), "old data");
        a.dealloc(z, l);
    }
    assert_eq!(a.check(), Ok(()));
}

/// A thread's cached medium blocks, including one another thread allocated, go back to the engine
/// when it exits.
#[test]
fn an_exiting_thread_gives_back_its_medium_blocks() {
    let a = std::sync::Arc::new(small_instance());
    let l = layout(24_000, 8);
    let p = alloc_ok(&a, l) as usize;
    let b = a.clone();
    std::thread::spawn(move || {
        let q = alloc_ok(&b, l);
        // SAFETY: each block came from `b` (the same allocator) with `l` and is freed once.
        unsafe {
            b.dealloc(q, l);
            b.dealloc(p as *mut u8, l);
        }
        assert_eq!(b.thread_cache_bytes(), 2 * (24 << 10));
    })
    .join()
    .unwrap();
    assert_all_given_back(&a, p);
}

/// A medium class with no refill or flush in a decay period gives back half its blocks.
#[test]
fn idle_medium_classes_decay() {
    let a = small_instance();
    let l = layout(40_000, 8);
    let m = medium::class_for(40_000, 8).unwrap();
    let blocks: std::vec::Vec<*mut u8> = (0..4).map(|_| alloc_ok(&a, l)).collect();
    for &p in &blocks {
        // SAFETY: each came from `a` with `l` and is freed once.
        unsafe { a.dealloc(p, l) };
    }
    tcache::with(|tc| {
        assert_eq!(tc.medium_count(m), 4);
        // Slow-path events of another class: the period the four allocations (misses of class
        // `m`) began ends with `m` active, the next one without.
        for _ in 0..2 * tcache::DECAY_PERIOD {
            a.with_heap(|h| h.note_slow(tc, 0)).unwrap();
        }
        assert_eq!(tc.medium_count(m), 2);
    })
    .unwrap();
    assert_eq!(a.check(), Ok(()));
}

/// An allocation that finds no room takes the calling thread's cached medium blocks back to the
/// engine first, where they coalesce, and tries again.
#[test]
fn an_allocation_out_of_room_takes_back_cached_medium_blocks() {
    let a = small_instance();
    let l = layout(64 << 10, 16);
    let cached: std::vec::Vec<*mut u8> = (0..4).map(|_| alloc_ok(&a, l)).collect();
    for w in cached.windows(2) {
        assert_eq!(w[1] as usize, w[0] as usize + (64 << 10), "not adjacent");
    }
    // Fill the rest of the arena with blocks larger than any gap the four could leave.
    let fill = layout(128 << 10, 16);
    let mut rest = std::vec::Vec::new();
    loop {
        // SAFETY: a non-zero size.
        let p = unsafe { a.alloc(fill) };
        if p.is_null() {
            break;
        }
        rest.push(p);
    }
    for &p in &cached {
        // SAFETY: each came from `a` with `l` and is freed once.
        unsafe { a.dealloc(p, l) };
    }
    assert_eq!(a.thread_cache_bytes(), 4 * (64 << 10));
    let whole = layout(256 << 10, 16);
    // SAFETY: a non-zero size.
    let p = unsafe { a.alloc(whole) };
    assert_eq!(p, cached[0], "the four cached blocks, coalesced");
    assert_eq!(a.thread_cache_bytes(), 0);
    assert_eq!(a.check(), Ok(()));
    // SAFETY: each came from `a` with its layout and is freed once.
    unsafe {
        a.dealloc(p, whole);
        for p in rest {
            a.dealloc(p, fill);
        }
    }
    assert_eq!(a.check(), Ok(()));
}

/// Once other classes hold the medium budget, a freed block of a class with nothing cached goes
/// straight back to the engine.
#[test]
fn a_full_medium_budget_sends_other_classes_to_the_engine() {
    let a = small_instance();
    // As many 64 KiB blocks as the budget and their stack take, then as many of 56 KiB.
    let n64 = medium::MEDIUM_BIN.min(medium::MEDIUM_BUDGET / (64 << 10));
    let n56 = medium::MEDIUM_BIN.min((medium::MEDIUM_BUDGET - n64 * (64 << 10)) / (56 << 10));
    let held: std::vec::Vec<(*mut u8, Layout)> =
        [(layout(64 << 10, 16), n64), (layout(56 << 10, 16), n56)]
            .into_iter()
            .flat_map(|(l, n)| (0..n).map(move |_| l))
            .map(|l| (alloc_ok(&a, l), l))
            .collect();
    let l = layout(40 << 10, 16);
    let p = alloc_ok(&a, l);
    for &(q, lq) in &held {
        // SAFETY: each came from `a` with its layout and is freed once.
        unsafe { a.dealloc(q, lq) };
    }
    let full = a.thread_cache_bytes();
    assert_eq!(full, n64 * (64 << 10) + n56 * (56 << 10));
    // (The test's premise: a 40 KiB block does not fit beside them.)
    assert!(full + (40 << 10) > medium::MEDIUM_BUDGET);
    // SAFETY: `p` came from `a` with `l` and is freed once.
    unsafe { a.dealloc(p, l) };
    assert_eq!(a.thread_cache_bytes(), full);
    assert_eq!(a.usable_size(p), None, "not back in the engine");
    assert_eq!(a.stats().bytes_in_use, 0);
    assert_eq!(a.check(), Ok(()));
}

/// A pointer inside a medium block (`off` bytes past its start) freed with a medium layout is not
/// cached: the pointer-based free finds it inside a live block and aborts. Runs as test `case`.
fn medium_free_off_the_block_start(case: &str, off: usize) {
    if is_child(case) {
        let a = small_instance();
        let l = layout(20 << 10, 16);
        let p = alloc_ok(&a, l);
        // SAFETY: the error under test (a pointer `off` bytes into a live block).
        unsafe { a.dealloc(p.add(off), l) };
        std::println!("child survived");
        return;
    }
    assert_child_aborts("host::tests", case, "into the middle of the block");
}

/// Off `MEDIUM_ALIGN` (the table names starts to 8 bytes).
#[test]
#[cfg_attr(miri, ignore = "spawns a child process")]
fn a_medium_free_4_bytes_into_a_block_aborts() {
    medium_free_off_the_block_start("a_medium_free_4_bytes_into_a_block_aborts", 4);
}

#[test]
#[cfg_attr(miri, ignore = "spawns a child process")]
fn a_medium_free_16_bytes_into_a_block_aborts() {
    medium_free_off_the_block_start("a_medium_free_16_bytes_into_a_block_aborts", 16);
}

/// On `MEDIUM_ALIGN`, in the block's window: the fast path's alignment check passes, so only the
/// table's exact start (the entry's offset) tells the pointer from the block's start.
#[test]
#[cfg_attr(miri, ignore = "spawns a child process")]
fn a_medium_free_medium_align_bytes_into_a_block_aborts() {
    medium_free_off_the_block_start(
        "a_medium_free_medium_align_bytes_into_a_block_aborts",
        medium::MEDIUM_ALIGN,
    );
}

/// A medium block waiting in the thread's cache, freed again with a layout of another class, is
/// caught: the engine must not free it while the cache may hand it out.
#[test]
#[cfg_attr(miri, ignore = "spawns a child process")]
fn a_cached_medium_block_freed_again_as_another_class_aborts() {
    let case = "a_cached_medium_block_freed_again_as_another_class_aborts";
    if is_child(case) {
        let a = small_instance();
        let l = layout(20 << 10, 16);
        let p = alloc_ok(&a, l);
        // SAFETY: the first free is valid; the second (another class's layout) is the error
        // under test.
        unsafe {
            a.dealloc(p, l);
            a.dealloc(p, layout(24 << 10, 16));
        }
        std::println!("child survived");
        return;
    }
    assert_child_aborts("host::tests", case, "already in this thread's cache");
}

/// Allocates `CONTENDED_MEDIUM_BIN + 1` medium blocks of `l` from `a` and frees them on another
/// thread, which meets contention: its stack overflows and sends the top half to the heap's medium
/// transfer cache. That thread then waits (an exiting thread's flush empties the transfer cache)
/// until the returned closure lets it exit and joins it. Returns the blocks, those now in the
/// transfer cache (half the stack, asserted) and that closure.
fn overflow_on_a_contended_thread(
    a: &std::sync::Arc<GlobalBfc>,
    l: Layout,
) -> (std::vec::Vec<usize>, std::vec::Vec<usize>, impl FnOnce()) {
    let n = medium::CONTENDED_MEDIUM_BIN;
    let ps: std::vec::Vec<usize> = (0..n + 1).map(|_| alloc_ok(a, l) as usize).collect();
    let (b, freed) = (a.clone(), ps.clone());
    let (done, parked) = (std::sync::mpsc::channel(), std::sync::mpsc::channel::<()>());
    let consumer = std::thread::spawn(move || {
        cache_upper_blocks(&b);
        for &p in &freed {
            // SAFETY: each block came from `b` with `l` and is freed once.
            unsafe { b.dealloc(p as *mut u8, l) };
        }
        done.0.send(()).unwrap();
        parked.1.recv().unwrap();
    });
    done.1.recv().unwrap();
    let m = medium::class_for(l.size(), l.align()).unwrap();
    let moved = a
        .with_heap(|h| h.medium_transfer.blocks(m).to_vec())
        .unwrap();
    assert_eq!(moved.len(), n / 2);
    let let_it_exit = move || {
        parked.0.send(()).unwrap();
        consumer.join().unwrap();
    };
    (ps, moved, let_it_exit)
}

/// The medium transfer cache: a miss with none of its class there takes a block of the next class
/// up (named in the table again, as that class); `check` finds a block there that the table
/// names; `release_free_memory` empties it.
#[test]
fn the_medium_transfer_cache_serves_the_next_class_is_checked_and_released() {
    let a = std::sync::Arc::new(small_instance());
    let n = medium::CONTENDED_MEDIUM_BIN;
    let (_, moved, let_it_exit) = overflow_on_a_contended_thread(&a, layout(24 << 10, 16));
    // A 20 KiB request: class 0 has none there, class 1 does.
    let l20 = layout(20 << 10, 16);
    let p = alloc_ok(&a, l20);
    assert_eq!(p as usize, moved[n / 2 - 1]);
    assert_eq!(a.usable_size(p), Some(24 << 10));
    assert_eq!(
        a.with_heap(|h| h.medium.class_of(p as usize)),
        Some(Some(1))
    );
    assert_eq!(a.check(), Ok(()));
    // A block there that the table names is caught.
    let q = moved[0];
    a.with_heap(|h| h.medium.set(1, q)).unwrap();
    let e = a.check().unwrap_err();
    assert!(
        e.what.starts_with("medium transfer cache holds a block"),
        "{e}"
    );
    assert_eq!(e.at, Some(q));
    a.with_heap(|h| h.medium.clear(q)).unwrap();
    assert_eq!(a.check(), Ok(()));
    assert!(a.release_free_memory() > 0);
    assert_eq!(a.with_heap(|h| h.medium_transfer.held()).unwrap(), (0, 0));
    assert_eq!(a.usable_size(q as *mut u8), None);
    let_it_exit();
    // SAFETY: `p` came from `a` with `l20` and is freed once.
    unsafe { a.dealloc(p, l20) };
    a.flush_thread_cache();
    assert_eq!(a.stats().bytes_in_use, 0);
    assert_eq!(a.check(), Ok(()));
}

/// A medium block waiting in the heap's medium transfer cache, freed again, is caught: the table
/// does not name it while it waits there, so the thread cache's fast path refuses it and the
/// locked path finds it. (Named, the fast path took it, and the block was handed out twice.)
#[test]
#[cfg_attr(miri, ignore = "spawns a child process")]
fn a_medium_block_in_the_transfer_cache_freed_again_aborts() {
    let case = "a_medium_block_in_the_transfer_cache_freed_again_aborts";
    if is_child(case) {
        let a = small_instance();
        cache_upper_blocks(&a);
        let l = layout(20 << 10, 16);
        let n = medium::CONTENDED_MEDIUM_BIN;
        let ps: std::vec::Vec<_> = (0..n + 1).map(|_| alloc_ok(&a, l)).collect();
        // SAFETY: each block came from `a` with `l` and is freed once, except the last free,
        // the error under test.
        unsafe {
            for &p in &ps {
                a.dealloc(p, l);
            }
            // The overflow sent the top half of the stack to the transfer cache.
            let moved = a
                .with_heap(|h| h.medium_transfer.blocks(0).to_vec())
                .unwrap();
            assert_eq!(moved.len(), n / 2);
            assert_eq!(a.check(), Ok(()));
            a.dealloc(moved[0] as *mut u8, l);
        }
        std::println!("child survived");
        return;
    }
    assert_child_aborts("host::tests", case, "already in the heap's transfer cache");
}

/// A producer thread's medium blocks freed by a consumer thread that meets contention: the
/// consumer's overflow goes to the heap's medium transfer cache, and the producer's next miss
/// takes a block from there, with up to half its stack's cap more for its cache, without the
/// engine.
#[test]
fn medium_blocks_move_from_a_consumer_to_a_producer_through_the_transfer_cache() {
    let a = std::sync::Arc::new(small_instance());
    let l = layout(20 << 10, 16);
    let n = medium::CONTENDED_MEDIUM_BIN;
    let (ps, moved, let_it_exit) = overflow_on_a_contended_thread(&a, l);
    assert!(moved.iter().all(|p| ps.contains(p)));
    let s = a.stats();
    // Every block is in the consumer's cache or the transfer cache: cached, none in use.
    assert_eq!(s.bytes_in_use, 0);
    assert!(s.bytes_cached >= (n + 1) * (20 << 10));
    let p = alloc_ok(&a, l);
    assert_eq!(p as usize, moved[n / 2 - 1], "not from the transfer cache");
    assert_eq!(a.stats().num_allocs, s.num_allocs, "from the engine");
    let mine = tcache::with(|tc| tc.medium_count(0)).unwrap();
    assert_eq!(mine, medium::MEDIUM_BIN / 2);
    let left = a.with_heap(|h| h.medium_transfer.count(0)).unwrap();
    assert_eq!(left, n / 2 - 1 - mine);
    assert_eq!(a.check(), Ok(()));
    let_it_exit();
    // The consumer's exit flush emptied the transfer cache.
    assert_eq!(a.with_heap(|h| h.medium_transfer.held()).unwrap(), (0, 0));
    free_all(&a, std::vec![(p, l)]);
}

/// A medium block waiting in the thread's cache, reallocated (grown or shrunk into another class)
/// is caught: the engine must not resize it in place while the cache may hand it out. Runs as
/// test `case`.
fn realloc_of_a_cached_medium_block(case: &str, new_size: usize) {
    if is_child(case) {
        let a = small_instance();
        let l = layout(40 << 10, 16);
        let p = alloc_ok(&a, l);
        // SAFETY: the free is valid; the realloc of the freed block is the error under test.
        unsafe {
            a.dealloc(p, l);
            a.realloc(p, l, new_size);
        }
        std::println!("child survived");
        return;
    }
    assert_child_aborts("host::tests", case, "already in this thread's cache");
}

#[test]
#[cfg_attr(miri, ignore = "spawns a child process")]
fn growing_a_cached_medium_block_aborts() {
    realloc_of_a_cached_medium_block("growing_a_cached_medium_block_aborts", 48 << 10);
}

#[test]
#[cfg_attr(miri, ignore = "spawns a child process")]
fn shrinking_a_cached_medium_block_aborts() {
    realloc_of_a_cached_medium_block("shrinking_a_cached_medium_block_aborts", 20 << 10);
}

/// A medium request whose class has nothing cached takes a cached block of the next class up (no
/// engine allocation: the count stays put), which stays in place within the request's class and
/// goes back to its own class's stack when freed; two classes up is too large.
#[test]
fn a_miss_takes_a_cached_block_of_the_next_class() {
    let a = small_instance();
    let up = layout(24 << 10, 16);
    let p = alloc_ok(&a, up);
    // SAFETY: `p` came from `a` with `up` and is freed once.
    unsafe { a.dealloc(p, up) };
    let allocs = a.stats().num_allocs;
    let l = layout(18 << 10, 8);
    assert_eq!(alloc_ok(&a, l), p);
    assert_eq!(a.stats().num_allocs, allocs);
    assert_eq!(a.usable_size(p), Some(24 << 10));
    // SAFETY: `p` came from `a` with `l`; then freed once with the layout of the realloc.
    unsafe {
        assert_eq!(a.realloc(p, l, 20 << 10), p);
        a.dealloc(p, layout(20 << 10, 8));
    }
    assert_eq!(a.thread_cache_bytes(), 24 << 10);
    tcache::with(|tc| assert_eq!((tc.medium_count(0), tc.medium_count(1)), (0, 1))).unwrap();
    assert_eq!(a.check(), Ok(()));
    // A block two classes up stays cached; the request goes to the engine.
    a.flush_thread_cache();
    let two_up = layout(28 << 10, 16);
    let q = alloc_ok(&a, two_up);
    // SAFETY: `q` came from `a` with `two_up` and is freed once.
    unsafe { a.dealloc(q, two_up) };
    let allocs = a.stats().num_allocs;
    let r = alloc_ok(&a, l);
    assert_ne!(r, q);
    assert_eq!(a.stats().num_allocs, allocs + 1);
    // SAFETY: `r` came from `a` with `l` and is freed once.
    unsafe { a.dealloc(r, l) };
    assert_eq!(a.check(), Ok(()));
}
