//! The device pool on a simulated device: every piece of its logic, on the CPU.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use bfc_alloc::core::OomCause;
use bfc_alloc::cuda::{
    min_system_memory, DeviceBuffer, DevicePool, MemoryLimit, PoolError, PoolOptions, SimBackend,
    SimDevice, SimStream, OPEN_LIMIT,
};

#[path = "common/rng.rs"]
mod rng;
use rng::Rng;
#[path = "common/sim_bufs.rs"]
mod sim_bufs;
use sim_bufs::AnyBuf;

#[path = "common/sim_pool.rs"]
mod sim_pool;
use sim_pool::{alloc, assert_all_back, pool, Pool, A, B, C, D, GIB, MIB};
#[path = "common/counting.rs"]
mod counting;
use counting::*;

/// Runs `body` with two streams that take the pool's lock for every call (`A` and `B`: the
/// simulator gives streams 0 to 2 no stream cache), and again with two that take stream caches
/// (`C` and `D`, in the calling thread's cache): the stream model is the same on both paths.
fn on_both_paths(body: impl Fn(SimStream, SimStream)) {
    for (sa, sb) in [(A, B), (C, D)] {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(sa, sb)));
        if let Err(e) = r {
            eprintln!("with streams {sa:?} and {sb:?}");
            std::panic::resume_unwind(e);
        }
    }
}

/// The system allocator, counting the allocations of each thread (tests run in parallel).
struct Counting;

std::thread_local! {
    static HOST_ALLOCS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    /// Bytes allocated less bytes freed, by this thread.
    static HOST_BYTES: std::cell::Cell<isize> = const { std::cell::Cell::new(0) };
}

/// Adds `delta` to this thread's count of host bytes held.
fn count_bytes(delta: isize) {
    let _ = HOST_BYTES.try_with(|n| n.set(n.get() + delta));
}

// SAFETY: every call goes to `System` unchanged; the counters are const-initialised thread locals
// (no allocation, no destructor).
unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        let _ = HOST_ALLOCS.try_with(|n| n.set(n.get() + 1));
        count_bytes(layout.size() as isize);
        // SAFETY: the caller's contract, passed on.
        unsafe { std::alloc::System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        count_bytes(-(layout.size() as isize));
        // SAFETY: the caller's contract, passed on.
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new: usize) -> *mut u8 {
        let _ = HOST_ALLOCS.try_with(|n| n.set(n.get() + 1));
        count_bytes(new as isize - layout.size() as isize);
        // SAFETY: the caller's contract, passed on.
        unsafe { std::alloc::System.realloc(ptr, layout, new) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// Host allocations (and reallocations) of this thread while `f` runs.
fn host_allocs(f: impl FnOnce()) -> usize {
    let before = HOST_ALLOCS.with(|n| n.get());
    f();
    HOST_ALLOCS.with(|n| n.get()) - before
}

/// Host bytes this thread allocated and did not free while `f` ran.
fn host_bytes_kept(f: impl FnOnce()) -> isize {
    let before = HOST_BYTES.with(|n| n.get());
    f();
    HOST_BYTES.with(|n| n.get()) - before
}

/// Emptied block lists are kept for reuse up to a bound: a pool that releases many batches of
/// pending blocks at once keeps no more host memory than one that releases a few dozen.
#[test]
fn releasing_many_batches_keeps_a_bounded_number_of_spare_block_lists() {
    // Host bytes a fresh pool keeps after `batches` batches of one block each, on one stream, are
    // returned to it at once.
    let kept = |batches: usize| {
        let dev = SimDevice::new(GIB);
        let p = pool(&dev, PoolOptions::with_limit(256 * MIB));
        // Keeps the region (a trim would give it back); warms up the stream's bookkeeping in the
        // simulator, the pool's queue list and its spares with one batch.
        let _region = alloc(&p, A, 256).unwrap();
        dev.enqueue(A);
        drop(alloc(&p, A, 256).unwrap());
        p.trim();
        dev.complete(A);
        p.trim();
        let kept = host_bytes_kept(|| {
            let bufs: Vec<_> = (0..batches).map(|_| alloc(&p, A, 256).unwrap()).collect();
            dev.enqueue(A); // A is busy: each trim below closes one batch with an event
            for buf in bufs {
                drop(buf);
                p.trim();
            }
            assert_eq!(p.stats().pending_blocks, batches);
            dev.complete(A);
            p.trim(); // every event is done: all the batches go back to the engine at once
            assert_eq!(p.stats().pending_blocks, 0);
        });
        p.check().unwrap();
        kept
    };
    let few = kept(32);
    let many = kept(256);
    assert_eq!(
        many, few,
        "host bytes kept after 256 batches (vs 32): the spare block lists are not bounded"
    );
}

/// A long emptied block list is not kept for reuse: releasing one batch of many blocks (unordered
/// ones, merged while event records fail) keeps no more host memory than releasing a short one.
#[test]
fn a_long_emptied_block_list_is_not_kept_for_reuse() {
    // Host bytes a fresh pool keeps after `blocks` unordered blocks of one busy stream are
    // released together by a device synchronisation.
    let kept = |blocks: usize| {
        let dev = SimDevice::new(GIB);
        let p = pool(&dev, PoolOptions::with_limit(256 * MIB));
        // Keeps the region (a trim would give it back).
        let _region = alloc(&p, A, 256).unwrap();
        let mut bufs: Vec<_> = (0..blocks).map(|_| alloc(&p, A, 256).unwrap()).collect();
        dev.enqueue(A);
        dev.set_fail_event_record(true);
        let kept = host_bytes_kept(|| {
            for buf in bufs.drain(..) {
                drop(buf);
                // The record fails: the block joins the stream's unordered batch.
                p.trim();
            }
            assert_eq!(p.stats().pending_blocks, blocks);
            p.synchronize();
            assert_eq!(p.stats().pending_blocks, 0);
            // The deferred errors (one per failed record, up to a bound) are not what is measured.
            assert!(!p.take_errors().is_empty());
        });
        drop(bufs);
        dev.set_fail_event_record(false);
        p.check().unwrap();
        kept
    };
    let (short, long) = (kept(8), kept(400));
    assert!(
        long <= short,
        "a 400-block list left {long} host bytes, an 8-block one {short}"
    );
}

/// Emptied batch queues are kept for reuse up to a bound: a pool whose pending blocks on many
/// streams go back to it at once keeps no more host memory than one with a few dozen streams.
#[test]
fn releasing_many_streams_blocks_keeps_a_bounded_number_of_spare_queues() {
    // Host bytes a fresh pool keeps after one pending block on each of `streams` streams is
    // returned to it at once.
    let kept = |streams: u64| {
        let dev = SimDevice::new(GIB);
        let p = pool(&dev, PoolOptions::with_limit(256 * MIB));
        let streams: Vec<SimStream> = (10..10 + streams).map(SimStream).collect();
        // Keeps the region (a trim would give it back).
        let _region = alloc(&p, A, 256).unwrap();
        // Twenty batches pending on every stream at once, so that each stream's queue grows past
        // what is kept for reuse: warms up the simulator's streams and the pool's list of queues,
        // not its spare queues.
        let rounds: Vec<Vec<_>> = (0..20)
            .map(|_| {
                streams
                    .iter()
                    .map(|&s| alloc(&p, s, 256).unwrap())
                    .collect()
            })
            .collect();
        for &s in &streams {
            dev.enqueue(s);
        }
        for round in rounds {
            drop(round);
            p.trim(); // every stream is busy: one batch each, with an event
        }
        settle_all(&dev, &streams);
        p.trim();
        assert_eq!(p.stats().pending_blocks, 0);
        let kept = host_bytes_kept(|| {
            let bufs: Vec<_> = streams
                .iter()
                .map(|&s| alloc(&p, s, 256).unwrap())
                .collect();
            for &s in &streams {
                dev.enqueue(s);
            }
            drop(bufs);
            p.trim();
            assert_eq!(p.stats().pending_blocks, streams.len());
            settle_all(&dev, &streams);
            p.trim(); // every event is done: all the queues empty at once
            assert_eq!(p.stats().pending_blocks, 0);
        });
        p.check().unwrap();
        kept
    };
    // (Both above the 16 spare queues kept; fewer streams under Miri, which is slow.)
    let (few, many) = if cfg!(miri) { (20, 48) } else { (32, 256) };
    let (kept_few, kept_many) = (kept(few), kept(many));
    assert_eq!(
        kept_many, kept_few,
        "host bytes kept after {many} streams' blocks (vs {few}): the spare queues are not bounded"
    );
}

/// Completes the work queued on `streams`.
fn settle_all(dev: &SimDevice, streams: &[SimStream]) {
    for &s in streams {
        dev.complete(s);
    }
}

/// A pool hit (a stream frees a buffer and allocates it again) takes no host memory, nor does a
/// step that allocates 64 buffers and frees them all, once the pool has seen one such step.
#[test]
fn pool_hits_allocate_no_host_memory() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(256 * MIB));
    drop(alloc(&p, A, 256).unwrap());
    let pairs = host_allocs(|| {
        for _ in 0..1000 {
            let x = alloc(&p, A, 256).unwrap();
            assert_eq!(p.stats().pending_blocks, 0, "not a hit");
            drop(x);
        }
    });
    assert_eq!(pairs, 0, "host allocations in 1000 pool hits");
    let mut bufs = Vec::with_capacity(64);
    bufs.extend((0..64).map(|i| alloc(&p, A, 256 << (i % 8)).unwrap()));
    bufs.clear();
    let steps = host_allocs(|| {
        for _ in 0..10 {
            bufs.extend((0..64).map(|i| alloc(&p, A, 256 << (i % 8)).unwrap()));
            bufs.clear();
        }
    });
    assert_eq!(steps, 0, "host allocations in 10 steps of 64 buffers");
    p.check().unwrap();
}

/// A buffer takes seven words of host memory (with either back end, on 64-bit targets) until it is
/// used on another stream: the record of such uses is allocated by the first one
/// (`tests/cuda_uses_sim.rs` checks that those uses are ordered). It was 184 bytes, 144 of them
/// that record, inline.
#[test]
#[cfg(target_pointer_width = "64")]
fn a_buffer_is_seven_words_on_the_host() {
    let words = 7 * std::mem::size_of::<usize>();
    assert!(std::mem::size_of::<DeviceBuffer<u8, SimBackend>>() <= words);
    assert!(std::mem::size_of::<DeviceBuffer<u8>>() <= words);
}

/// Uses of a buffer on its home stream make no record of uses on other streams (no host
/// allocation); the first use on another stream makes it, later uses on that stream nothing more.
#[test]
fn only_a_use_on_another_stream_makes_a_record() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(256 * MIB));
    // Warm up the simulated device's own bookkeeping of streams A, B and C, and of events.
    {
        let b = alloc(&p, A, 256).unwrap();
        b.simulate_use(A);
        b.simulate_use(B);
        b.simulate_use(C);
        b.simulate_use(A);
        let c = alloc(&p, A, 256).unwrap();
        c.simulate_use(B);
        c.simulate_use(C);
    }
    p.synchronize();
    drop(alloc(&p, A, 256).unwrap());
    let x = alloc(&p, A, 256).unwrap();
    let home = host_allocs(|| {
        for _ in 0..10 {
            x.simulate_use(A);
        }
    });
    assert_eq!(home, 0, "host allocations in uses on the home stream");
    let first = host_allocs(|| {
        x.simulate_use(B);
    });
    assert_eq!(
        first, 1,
        "host allocations in the first use on another stream"
    );
    let later = host_allocs(|| {
        x.simulate_use(B);
        x.simulate_use(A);
    });
    assert_eq!(later, 0, "host allocations in later uses");
    // Each other stream has an event of its own: one more allocation for the first use on a
    // second other stream, none for later uses.
    let third = host_allocs(|| {
        x.simulate_use(C);
    });
    assert_eq!(
        third, 1,
        "host allocations in the first use on a second other stream"
    );
    let later = host_allocs(|| {
        x.simulate_use(C);
        x.simulate_use(B);
        x.simulate_use(A);
    });
    assert_eq!(later, 0, "host allocations in later uses on three streams");
}

/// A synchronisation that waits for a busy stream's pending blocks keeps that stream's queue
/// storage for reuse: the hits after it allocate no host memory either.
#[test]
fn pool_hits_after_a_synchronisation_allocate_no_host_memory() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(256 * MIB));
    // A buffer on B, so that A's queue is not the only storage around.
    let _keep = alloc(&p, B, 256).unwrap();
    drop(alloc(&p, A, 256).unwrap());
    for _ in 0..3 {
        let x = alloc(&p, A, 256).unwrap();
        dev.enqueue(A);
        drop(x);
        p.synchronize();
        let n = host_allocs(|| {
            for _ in 0..100 {
                drop(alloc(&p, A, 256).unwrap());
            }
        });
        assert_eq!(n, 0, "host allocations in 100 hits after a synchronisation");
    }
}

#[test]
fn growth_starts_small_and_doubles() {
    let dev = SimDevice::new(4 * GIB);
    let p = pool(&dev, PoolOptions::with_limit(GIB));
    assert_eq!(
        dev.requests(),
        Vec::<usize>::new(),
        "nothing before the first buffer"
    );
    let a = alloc(&p, A, 1000).unwrap();
    assert_eq!(dev.requests(), vec![2 * MIB]);
    assert_eq!(a.block_size(), 1024);
    assert_eq!(a.device_address() % 256, 0);
    let b = alloc(&p, A, 2 * MIB).unwrap();
    let c = alloc(&p, A, 3 * MIB).unwrap();
    assert_eq!(dev.requests(), vec![2 * MIB, 4 * MIB, 8 * MIB]);
    let s = p.stats();
    assert_eq!(s.allocator.bytes_reserved, 14 * MIB);
    assert_eq!(s.allocator.num_regions, 3);
    assert_eq!(s.device_total, 4 * GIB);
    assert_eq!(s.device_free, 4 * GIB - 14 * MIB);
    drop((a, b, c));
    p.check().unwrap();
}

#[test]
fn no_growth_takes_one_region_of_the_limit() {
    let dev = SimDevice::new(4 * GIB);
    let p = pool(
        &dev,
        PoolOptions {
            allow_growth: false,
            ..PoolOptions::with_limit(256 * MIB)
        },
    );
    let _a = alloc(&p, A, 100).unwrap();
    let _b = alloc(&p, A, 100 * MIB).unwrap();
    assert_eq!(dev.requests(), vec![256 * MIB]);
    let err = alloc(&p, A, 200 * MIB).unwrap_err();
    assert!(matches!(err, PoolError::OutOfMemory(_)));
}

#[test]
fn limits_auto_fraction_bytes() {
    // Auto: free memory minus TensorFlow's system reserve.
    let dev = SimDevice::new(GIB);
    assert_eq!(pool(&dev, PoolOptions::default()).limit(), GIB - 225 * MIB);
    let dev = SimDevice::new(16 * GIB);
    dev.set_used_by_others(GIB);
    dev.set_compute_capability_major(7);
    assert_eq!(
        pool(&dev, PoolOptions::default()).limit(),
        15 * GIB - 1050 * MIB
    );
    assert_eq!(min_system_memory(80 * GIB, 9), 1800 * MIB);
    assert_eq!(min_system_memory(80 * GIB, 8), 1536 * MIB);
    assert_eq!(min_system_memory(80 * GIB, 6), 500 * MIB);
    // A fraction of the total.
    let opts = PoolOptions {
        limit: MemoryLimit::Fraction(0.5),
        ..PoolOptions::default()
    };
    assert_eq!(pool(&dev, opts).limit(), 8 * GIB);
    // Outside (0, 1], or not a number: refused for the fraction, before anything is asked of the
    // driver.
    for f in [1.5, 0.0, -0.5, f64::NAN] {
        let bad = PoolOptions {
            limit: MemoryLimit::Fraction(f),
            ..PoolOptions::default()
        };
        match DevicePool::with_backend(dev.backend(), bad) {
            Err(PoolError::Config(what)) => assert!(what.contains("fraction"), "{f}: {what}"),
            Err(e) => panic!("{f}: {e}"),
            Ok(_) => panic!("{f}: accepted"),
        }
    }
    // Bytes, rounded down to the granule; the limit caps what is reserved.
    let p = pool(&dev, PoolOptions::with_limit(10 * MIB + 100));
    assert_eq!(p.limit(), 10 * MIB);
    let _a = alloc(&p, A, 6 * MIB).unwrap();
    let e = alloc(&p, A, 6 * MIB).unwrap_err();
    let PoolError::OutOfMemory(oom) = e else {
        panic!("{e}")
    };
    assert_eq!(oom.report.cause, OomCause::LimitReached);
    assert!(p.stats().allocator.bytes_reserved <= 10 * MIB);
}

#[test]
fn backs_off_by_nine_tenths_when_the_driver_refuses() {
    let dev = SimDevice::new(4 * GIB);
    dev.set_refuse_above(100 * MIB);
    let p = pool(
        &dev,
        PoolOptions {
            allow_growth: false,
            ..PoolOptions::with_limit(128 * MIB)
        },
    );
    let _a = alloc(&p, A, MIB).unwrap();
    let req = dev.requests();
    assert_eq!(req[0], 128 * MIB);
    for w in req.windows(2) {
        assert!(w[1] < w[0] && w[1] >= w[0] / 10 * 9 - 256, "{req:?}");
    }
    assert!(*req.last().unwrap() <= 100 * MIB);
    assert_eq!(p.stats().allocator.bytes_reserved, *req.last().unwrap());
}

#[test]
fn trim_returns_free_regions_to_the_driver() {
    let dev = SimDevice::new(4 * GIB);
    let p = pool(&dev, PoolOptions::with_limit(GIB));
    let a = alloc(&p, A, MIB).unwrap();
    let b = alloc(&p, A, 3 * MIB).unwrap();
    assert_eq!(dev.allocations_live(), 2);
    dev.enqueue(A); // a kernel using `b`
    drop(b);
    // Still pending on A: trimming cannot release it yet.
    assert_eq!(p.trim(), 0);
    dev.complete(A);
    assert_eq!(p.empty_cache(), 4 * MIB);
    assert_eq!(dev.allocations_live(), 1);
    drop(a);
    assert_eq!(p.synchronize(), 2 * MIB);
    assert_eq!(dev.bytes_live(), 0);
    assert_eq!(p.stats().allocator.bytes_reserved, 0);
    p.check().unwrap();
}

#[test]
fn oom_report_has_the_numbers() {
    let dev = SimDevice::new(64 * MIB);
    let p = pool(&dev, PoolOptions::with_limit(32 * MIB));
    let mut keep = Vec::new();
    for _ in 0..6 {
        keep.push(alloc(&p, A, 3 * MIB).unwrap());
        let _gap = alloc(&p, A, MIB).unwrap();
    }
    let err = alloc(&p, A, 20 * MIB).unwrap_err();
    let PoolError::OutOfMemory(oom) = &err else {
        panic!("{err}")
    };
    let s = p.stats();
    assert_eq!(oom.requested, 20 * MIB);
    // Blocks are whole chunks (a 4 MiB chunk is not split for 3 MiB), so at least 18 MiB.
    assert!(oom.in_use >= 18 * MIB);
    assert_eq!(oom.in_use, s.allocator.bytes_in_use);
    assert_eq!(oom.reserved, s.allocator.bytes_reserved);
    assert_eq!(oom.limit, 32 * MIB);
    assert_eq!(oom.device_total, 64 * MIB);
    assert_eq!(oom.device_free, 64 * MIB - s.allocator.bytes_reserved);
    assert_eq!(oom.largest_free_block, s.allocator.largest_free_block);
    assert_eq!(
        oom.pending_bytes, 0,
        "pending frees are waited for before OOM"
    );
    let free_chunks: u32 = oom.report.free_by_size.iter().map(|b| b.count).sum();
    assert_eq!(free_chunks as usize, s.allocator.num_free_chunks);
    let text = err.to_string();
    for needle in [
        "out of memory",
        "20971520",
        "limit 33554432",
        "device total 67108864",
        "free chunks",
    ] {
        assert!(text.contains(needle), "{needle:?} not in {text}");
    }
    let _: &dyn std::error::Error = &err;
}

#[test]
fn same_stream_reuses_at_once_other_streams_wait_for_the_event() {
    on_both_paths(|sa, sb| {
        let dev = SimDevice::new(4 * GIB);
        let p = pool(&dev, PoolOptions::with_limit(GIB));
        let a = alloc(&p, sa, 4096).unwrap();
        let addr = a.device_address();
        dev.enqueue(sa); // a kernel using `a`
        drop(a);
        assert_eq!(p.stats().pending_blocks, 1);
        // Freed without an event: only stream sa may reuse it so far.
        assert_eq!(dev.recorded(sa), 0);

        // Another stream must not get it while sa's work may still use it.
        let b = alloc(&p, sb, 4096).unwrap();
        assert_ne!(b.device_address(), addr);
        // The same stream gets it back at once, without waiting.
        let a2 = alloc(&p, sa, 4096).unwrap();
        assert_eq!(a2.device_address(), addr);
        assert_eq!((dev.recorded(sa), dev.event_syncs()), (0, 0));
        assert_eq!(p.stats().pending_blocks, 0);

        dev.enqueue(sa);
        drop(a2);
        // Trimming records the event on busy stream sa; sb still cannot have the block.
        p.trim();
        assert_eq!(dev.recorded(sa), 1);
        let b2 = alloc(&p, sb, 4096).unwrap();
        assert_ne!(b2.device_address(), addr);
        // Once sa's work is done, the block is everybody's.
        dev.complete(sa);
        let b3 = alloc(&p, sb, 4096).unwrap();
        assert_eq!(b3.device_address(), addr);
        assert_eq!(p.stats().pending_blocks, 0);
        drop((b, b2, b3));
        p.check().unwrap();
    });
}

#[test]
fn another_streams_miss_closes_open_blocks_only_when_the_engine_has_no_room() {
    on_both_paths(|sa, sb| {
        let dev = SimDevice::new(4 * GIB);
        let p = pool(
            &dev,
            PoolOptions {
                allow_growth: false,
                ..PoolOptions::with_limit(16 * MIB)
            },
        );
        let small = alloc(&p, sa, MIB).unwrap();
        let big = alloc(&p, sa, 4 * MIB).unwrap();
        dev.enqueue(sa);
        drop((small, big));
        // The engine has room for 1 MiB: sa's blocks stay open.
        let b = alloc(&p, sb, MIB).unwrap();
        assert_eq!(dev.recorded(sa), 0);
        drop(b);
        // Not for 14 MiB: sa's batch gets its event (sa is busy), and sb waits for it rather than fail.
        let c = alloc(&p, sb, 14 * MIB).unwrap();
        assert_eq!(dev.recorded(sa), 1);
        assert_eq!(dev.event_syncs(), 1);
        drop(c);
        p.check().unwrap();
    });
}

#[test]
fn another_idle_streams_blocks_serve_a_miss_before_the_pool_grows() {
    on_both_paths(|sa, sb| {
        let dev = SimDevice::new(4 * GIB);
        let p = pool(&dev, PoolOptions::with_limit(GIB)); // grows from a 2 MiB region
        drop(alloc(&p, sa, 2 * MIB).unwrap()); // the whole first region; sa does no work: idle
        let regions = dev.requests().len();
        // The engine has no free chunk for 2 MiB, but sa's open block fits and sa is idle: it goes back
        // and serves sb, with no growth.
        let b = alloc(&p, sb, 2 * MIB).unwrap();
        assert_eq!(dev.requests().len(), regions);
        assert_eq!((dev.recorded(sa), p.stats().pending_blocks), (0, 0));
        drop(b);
        p.check().unwrap();
    });
}

#[test]
fn a_stream_reusing_its_own_blocks_makes_no_driver_call() {
    on_both_paths(|sa, _| {
        let dev = SimDevice::new(4 * GIB);
        let p = pool(&dev, PoolOptions::with_limit(GIB));
        let first = alloc(&p, sa, 64 << 10).unwrap().device_address();
        let requests = dev.requests().len();
        for _ in 0..1000 {
            let b = alloc(&p, sa, 64 << 10).unwrap();
            assert_eq!(b.device_address(), first);
            dev.enqueue(sa);
        }
        assert_eq!(dev.recorded(sa), 0, "no event for same-stream reuse");
        assert_eq!(dev.requests().len(), requests);
        let s = p.stats();
        assert_eq!((s.pending_blocks, s.pending_bytes), (1, 64 << 10));
        assert_eq!(s.bytes_in_buffers(), 0);
        assert!(s.to_string().contains("bytes in buffers:    0\n"), "{s}");
        // sa is busy: trimming records the event, and the block goes back once sa's work is done.
        p.trim();
        assert_eq!(dev.recorded(sa), 1);
        assert_eq!(p.stats().pending_blocks, 1);
        dev.complete(sa);
        p.trim();
        assert_eq!(p.stats().pending_blocks, 0);
        assert_eq!(dev.bytes_live(), 0);
    });
}

#[test]
fn an_idle_streams_blocks_go_back_without_an_event() {
    on_both_paths(|sa, _| {
        let dev = SimDevice::new(4 * GIB);
        let p = pool(&dev, PoolOptions::with_limit(GIB));
        let a = alloc(&p, sa, MIB).unwrap();
        dev.enqueue(sa);
        drop(a);
        // The stream's work is done (as after `stream.synchronize()`): trim returns the memory at once.
        dev.complete(sa);
        assert_eq!(p.trim(), 2 * MIB);
        assert_eq!(dev.recorded(sa), 0);
        assert_eq!((p.stats().pending_blocks, dev.bytes_live()), (0, 0));
        p.check().unwrap();
    });
}

#[test]
fn open_blocks_are_closed_by_one_event_per_batch() {
    let dev = SimDevice::new(4 * GIB);
    let p = pool(&dev, PoolOptions::with_limit(GIB));
    let n = OPEN_LIMIT + 1;
    let held: Vec<_> = (0..n).map(|_| alloc(&p, A, 4096).unwrap()).collect();
    let addrs: Vec<u64> = held.iter().map(|b| b.device_address()).collect();
    dev.enqueue(A); // a kernel using them all
    drop(held);
    // The free that went over the limit recorded one event for all of them.
    assert_eq!(dev.recorded(A), 1);
    assert_eq!(p.stats().pending_blocks, n);
    // Not done yet: stream B gets other memory.
    let b = alloc(&p, B, 4096).unwrap();
    assert!(!addrs.contains(&b.device_address()));
    assert_eq!(dev.recorded(A), 1);
    // Done: one poll returns the whole batch to the engine.
    dev.complete(A);
    let b2 = alloc(&p, B, 4096).unwrap();
    assert_eq!(p.stats().pending_blocks, 0);
    assert!(addrs.contains(&b2.device_address()));
    drop((b, b2));
    p.check().unwrap();
}

/// On the lock, a miss closes the stream's open blocks; in a stream cache, a block the miss
/// cannot use stays for the stream's next requests, until newer frees take its place, a full
/// engine, or a trim (here).
#[test]
fn same_stream_reuse_does_not_hand_out_a_much_larger_block_and_the_miss_returns_it() {
    on_both_paths(|sa, sb| {
        let dev = SimDevice::new(4 * GIB);
        let p = pool(&dev, PoolOptions::with_limit(GIB));
        let big = alloc(&p, sa, MIB).unwrap();
        let addr = big.device_address();
        dev.enqueue(sa);
        drop(big);
        // Too big to hand out whole for 1 KiB: a miss, which records sa's event (on the lock).
        let small = alloc(&p, sa, 1024).unwrap();
        assert_ne!(small.device_address(), addr);
        assert_eq!(small.block_size(), 1024);
        let cached = sa == C;
        assert_eq!(dev.recorded(sa), u64::from(!cached));
        assert_eq!(p.stats().pending_blocks, 1);
        dev.complete(sa);
        if cached {
            // (The stream is idle: straight back, with no event.)
            p.trim();
        }
        // The next allocation polls, the block joins the engine, and the engine splits it.
        let again = alloc(&p, sb, 2048).unwrap();
        let s = p.stats();
        assert_eq!(s.pending_blocks, 0);
        assert_eq!(s.allocator.bytes_in_use, 1024 + 2048);
        drop((small, again));
        p.check().unwrap();
    });
}

#[test]
fn oom_waits_for_pending_frees_then_succeeds() {
    on_both_paths(|sa, sb| {
        let dev = SimDevice::new(64 * MIB);
        let p = pool(
            &dev,
            PoolOptions {
                allow_growth: false,
                ..PoolOptions::with_limit(16 * MIB)
            },
        );
        let a = alloc(&p, sa, 12 * MIB).unwrap();
        let addr = a.device_address();
        dev.enqueue(sa);
        drop(a);
        // Stream sb cannot take sa's pending block, and nothing else fits: the pool waits for sa's event.
        let b = alloc(&p, sb, 12 * MIB).unwrap();
        assert_eq!(b.device_address(), addr);
        assert_eq!(dev.event_syncs(), 1);
        assert_eq!(dev.outstanding(sa), 0);
    });
}

#[test]
fn recovers_after_oom() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(64 * MIB));
    let mut held = Vec::new();
    let err = loop {
        match alloc(&p, A, 5 * MIB) {
            Ok(b) => held.push(b),
            Err(e) => break e,
        }
    };
    assert!(matches!(err, PoolError::OutOfMemory(_)));
    assert!(held.len() >= 8);
    held.truncate(2);
    // The next allocation on another stream waits for the frees and succeeds.
    let again: Vec<_> = (0..4).map(|_| alloc(&p, B, 5 * MIB).unwrap()).collect();
    drop(again);
    drop(held);
    p.synchronize();
    assert_eq!(p.stats().allocator.bytes_in_use, 0);
    assert_eq!(dev.bytes_live(), 0);
    p.check_err().unwrap();
    p.check().unwrap();
}

#[test]
fn driver_refusal_is_in_the_report() {
    let dev = SimDevice::new(GIB);
    dev.set_used_by_others(GIB - 8 * MIB);
    let p = pool(&dev, PoolOptions::with_limit(512 * MIB));
    let _a = alloc(&p, A, 4 * MIB).unwrap();
    let e = alloc(&p, A, 6 * MIB).unwrap_err();
    let PoolError::OutOfMemory(oom) = e else {
        panic!("{e}")
    };
    assert_eq!(oom.report.cause, OomCause::SourceRefused);
    assert!(oom
        .driver_error
        .as_deref()
        .unwrap()
        .contains("OUT_OF_MEMORY"));
}

#[test]
fn failed_event_record_is_deferred_and_the_block_waits_to_be_ordered() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(64 * MIB));
    let pending = || p.stats().pending_blocks;
    dev.set_fail_event_record(true);
    let a = alloc(&p, A, MIB).unwrap();
    dev.enqueue(A);
    drop(a);
    // Trimming records the free's event, which fails: deferred, no panic, the block stays.
    p.trim();
    assert_eq!(pending(), 1);
    // A still busy and records still failing: only a device-wide sync can release it.
    p.synchronize();
    assert_eq!((dev.device_syncs(), pending()), (1, 0));

    // An unordered block of an idle stream goes back at the next close, without an event.
    let b = alloc(&p, A, MIB).unwrap();
    dev.enqueue(A);
    drop(b);
    p.trim();
    assert_eq!(pending(), 1);
    dev.complete(A);
    p.trim();
    assert_eq!((dev.device_syncs(), pending()), (1, 0));

    // An unordered block of a busy stream joins the next event recorded there, and goes back
    // when that event completes, even though A has more work queued after it.
    let c = alloc(&p, A, MIB).unwrap();
    dev.enqueue(A);
    drop(c);
    p.trim();
    dev.set_fail_event_record(false);
    p.trim();
    assert_eq!((dev.recorded(A), pending()), (1, 1));
    let event = dev.queued(A);
    dev.enqueue(A);
    dev.complete_to(A, event);
    p.trim();
    assert_eq!((dev.device_syncs(), pending()), (1, 0));

    let errs = p.take_errors();
    assert_eq!(errs.len(), 4, "{errs:?}");
    assert!(errs.iter().all(|e| e.to_string().contains("cuEventRecord")));
    p.check_err().unwrap();
    p.check().unwrap();
}

#[test]
fn a_failed_stream_query_counts_as_busy() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(64 * MIB));
    let a = alloc(&p, A, MIB).unwrap();
    drop(a); // no work queued: A is idle, but the pool cannot know that
    dev.set_fail_stream_query(true);
    p.trim();
    // Not released on a failed query: an event was recorded instead.
    assert_eq!((p.stats().pending_blocks, dev.recorded(A)), (1, 1));
    dev.complete(A);
    p.trim();
    assert_eq!(p.stats().pending_blocks, 0);
    let errs = p.take_errors();
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert!(errs[0].to_string().contains("cuStreamQuery"), "{}", errs[0]);
    p.check().unwrap();
}

#[test]
fn a_free_whose_uses_cannot_be_ordered_waits_for_the_device_or_is_never_reused() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(64 * MIB));
    dev.set_fail_finish_uses(true);
    let a = alloc(&p, A, MIB).unwrap();
    let addr = a.device_address();
    dev.enqueue(A);
    drop(a);
    // The uses could not be ordered: the pool waited for the device, so the block is safe to reuse.
    assert_eq!((dev.device_syncs(), p.stats().pending_blocks), (1, 1));

    // Neither ordered nor waited for: the block is never handed out again.
    dev.set_fail_synchronize(true);
    let b = alloc(&p, A, MIB).unwrap();
    assert_eq!(b.device_address(), addr);
    dev.enqueue(A);
    drop(b);
    let s = p.stats();
    assert_eq!((s.pending_blocks, s.stranded_bytes), (0, MIB));
    assert_eq!(s.bytes_in_buffers(), 0);
    assert!(
        s.to_string().contains("stranded:            1048576 B"),
        "{s}"
    );
    // An out-of-memory report says so too: the stranded block is part of what is in use.
    match alloc(&p, A, 128 * MIB) {
        Err(PoolError::OutOfMemory(oom)) => {
            assert_eq!((oom.stranded_bytes, oom.in_use), (MIB, MIB));
            assert!(oom.to_string().contains("stranded 1048576 B"), "{oom}");
        }
        other => panic!("{:?}", other.map(|b| b.device_address())),
    }
    dev.set_fail_finish_uses(false);
    dev.set_fail_synchronize(false);
    dev.complete_all();
    for _ in 0..8 {
        let c = alloc(&p, A, MIB).unwrap();
        let d = alloc(&p, B, MIB).unwrap();
        assert!(c.device_address() != addr && d.device_address() != addr);
    }
    p.synchronize();
    assert_eq!(p.stats().allocator.bytes_in_use, MIB);
    let errs: Vec<String> = p.take_errors().iter().map(|e| e.to_string()).collect();
    assert_eq!(errs.len(), 3, "{errs:?}");
    assert!(errs[0].contains("cuStreamWaitEvent") && errs[2].contains("cuCtxSynchronize"));
    p.check().unwrap();
}

/// Each buffer keeps the pool alive: a handle from a buffer (`DeviceBuffer::pool`) keeps the pool
/// after the buffer, and the last buffer, on whatever thread, lets it go.
#[test]
fn buffers_keep_the_pool_alive_together() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(256 * MIB));
    for _ in 0..3 {
        drop(alloc(&p, A, MIB).unwrap());
    }
    let a = alloc(&p, A, MIB).unwrap();
    let handle = a.pool();
    drop(p);
    drop(a);
    assert!(
        dev.bytes_live() > 0,
        "the handle from the buffer keeps the pool"
    );
    let b = alloc(&handle, B, MIB).unwrap();
    let c = alloc(&handle, B, MIB).unwrap();
    drop(handle);
    drop(c);
    assert!(dev.bytes_live() > 0, "a buffer keeps the pool");
    std::thread::spawn(move || drop(b)).join().unwrap();
    assert_eq!(dev.bytes_live(), 0);
    assert_eq!(dev.allocations_live(), 0);
}

/// The last buffers of a pool whose handles are gone are freed on several threads at once: every
/// free finishes with the pool (its lock, its state) before the pool can go, whichever free is the
/// last, and the pool then returns everything to the driver. (Buffers hold no reference of their
/// own: a stream cache's one reference covers the buffers counted there, and a free ends its count
/// only after its last use of the pool. The first such design, reverted in 9331dd6, let a free
/// still be inside the pool when another thread's free dropped it; Miri runs of this test did not
/// hit that window.)
#[test]
fn the_last_buffers_freed_at_once_on_several_threads_let_the_pool_go() {
    let rounds = if cfg!(miri) { 3 } else { 200 };
    for round in 0..rounds {
        let dev = SimDevice::new(GIB);
        let p = pool(&dev, PoolOptions::with_limit(64 * MIB));
        let threads = 4;
        let buffers: Vec<_> = (0..threads)
            .map(|t| alloc(&p, SimStream(t as u64 % 2), (t + 1) * 4096).unwrap())
            .collect();
        drop(p);
        let start = std::sync::Barrier::new(threads);
        std::thread::scope(|scope| {
            for b in buffers {
                let start = &start;
                scope.spawn(move || {
                    start.wait();
                    drop(b);
                });
            }
        });
        assert_eq!(dev.bytes_live(), 0, "round {round}");
        assert_eq!(dev.allocations_live(), 0, "round {round}");
    }
}

#[test]
fn dropping_the_pool_returns_everything_to_the_driver() {
    on_both_paths(|sa, sb| {
        let dev = SimDevice::new(GIB);
        {
            let p = pool(&dev, PoolOptions::with_limit(512 * MIB));
            let a = alloc(&p, sa, 3 * MIB).unwrap();
            let b = alloc(&p, sb, 30 * MIB).unwrap();
            drop(a);
            drop(p);
            // The buffer keeps the pool alive.
            assert!(dev.bytes_live() > 0);
            drop(b);
        }
        assert_eq!(dev.bytes_live(), 0);
        assert_eq!(dev.allocations_live(), 0);
    });
}

/// A panic while the pool's lock is held (here in a closure given the back end) poisons the
/// mutex; the pool goes on (its state is consistent between engine operations): the next
/// allocations, frees and checks work, from this thread and from another.
#[test]
fn a_panic_under_the_lock_leaves_the_pool_usable() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(64 * MIB));
    let kept = alloc(&p, A, MIB).unwrap();
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        p.inspect_backend(|_| panic!("a back end panicked"))
    }));
    assert!(panicked.is_err());
    let b = alloc(&p, A, MIB).unwrap();
    assert_ne!(b.device_address(), kept.device_address());
    drop(b);
    std::thread::scope(|scope| {
        scope.spawn(|| drop(alloc(&p, B, 2 * MIB).unwrap()));
    });
    drop(kept);
    p.synchronize();
    assert_eq!(p.stats().allocator.bytes_in_use, 0);
    p.check().unwrap();
}

#[test]
fn eight_threads_never_overlap() {
    // Fewer steps under Miri, which is about 1000x slower.
    let steps = if cfg!(miri) { 200 } else { 3000 };
    let dev = SimDevice::new(4 * GIB);
    let p = pool(&dev, PoolOptions::with_limit(256 * MIB));
    let live: Arc<Mutex<BTreeMap<u64, u64>>> = Arc::default();
    std::thread::scope(|scope| {
        for t in 0..8u64 {
            let p = p.clone();
            let live = live.clone();
            let dev = dev.clone();
            scope.spawn(move || {
                // Threads share streams pairwise, so both same-stream and cross-stream reuse happen.
                let stream = SimStream(t / 2);
                let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ t;
                let mut held: Vec<DeviceBuffer<u8, SimBackend>> = Vec::new();
                for i in 0..steps {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    if held.len() < 16 && rng % 3 != 0 {
                        let size = 1 + (rng >> 20) as usize % (256 << 10);
                        let b = alloc(&p, stream, size).unwrap();
                        let (lo, hi) = (
                            b.device_address(),
                            b.device_address() + b.block_size() as u64,
                        );
                        let mut map = live.lock().unwrap();
                        if let Some((&s, &e)) = map.range(..hi).next_back() {
                            assert!(e <= lo, "[{lo:#x},{hi:#x}) overlaps [{s:#x},{e:#x})");
                        }
                        map.insert(lo, hi);
                        drop(map);
                        held.push(b);
                    } else if !held.is_empty() {
                        let b = held.swap_remove((rng >> 32) as usize % held.len());
                        live.lock().unwrap().remove(&b.device_address());
                        drop(b);
                    }
                    if i % 64 == 0 {
                        dev.complete(stream);
                    }
                }
                for b in held {
                    live.lock().unwrap().remove(&b.device_address());
                }
            });
        }
    });
    p.synchronize();
    let s = p.stats();
    assert_eq!(s.allocator.bytes_in_use, 0);
    assert_eq!(s.pending_blocks, 0);
    // Same-stream reuse of pending blocks bypasses the engine, so fewer than all allocations count.
    assert!(s.allocator.num_allocs > steps / 3);
    p.check().unwrap();
    p.check_err().unwrap();
}

#[test]
fn pool_and_buffers_are_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<Pool>();
    check::<DeviceBuffer<f32, SimBackend>>();
    check::<DevicePool>();
    check::<DeviceBuffer<f32>>();
}

#[test]
fn random_ops_never_hand_a_busy_block_to_another_stream() {
    let dev = SimDevice::new(GIB);
    // A small limit, so that out-of-memory flushes and trims happen often. Miri runs a tenth of
    // the operations (it is about 1000x slower), under a smaller limit so that they still run out.
    let limit = if cfg!(miri) { 16 * MIB } else { 40 * MIB };
    let p = pool(&dev, PoolOptions::with_limit(limit));
    // Streams 1 and 2 on the pool's lock alone, 3 and 4 through the thread's stream cache.
    let streams = [SimStream(1), SimStream(2), SimStream(3), SimStream(4)];
    // Freed ranges whose stream's work may not have completed: (lo, hi, stream, last work item).
    let mut freed: Vec<(u64, u64, SimStream, u64)> = Vec::new();
    let mut live: Vec<DeviceBuffer<u8, SimBackend>> = Vec::new();
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let (mut ooms, mut same_stream_reuses) = (0, 0);
    let mut failing = false;
    let free = |b: DeviceBuffer<u8, SimBackend>, freed: &mut Vec<(u64, u64, SimStream, u64)>| {
        let (lo, hi, hs) = (
            b.device_address(),
            b.device_address() + b.block_size() as u64,
            *b.home_stream(),
        );
        // A kernel still using the buffer when it is freed: the block may go to another stream
        // only once that work is done.
        let work = dev.enqueue(hs);
        drop(b);
        freed.push((lo, hi, hs, work));
    };
    let ops = if cfg!(miri) { 2_000 } else { 20_000 };
    for _ in 0..ops {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let s = streams[(rng >> 8) as usize % streams.len()];
        match rng % 10 {
            0..=4 => {
                let size = 256usize << ((rng >> 16) % 14);
                let size = size + (rng >> 32) as usize % size;
                match alloc(&p, s, size) {
                    Ok(b) => {
                        let (lo, hi) = (
                            b.device_address(),
                            b.device_address() + b.block_size() as u64,
                        );
                        for &(flo, fhi, fs, seq) in &freed {
                            if flo < hi && lo < fhi {
                                if fs == s {
                                    same_stream_reuses += 1;
                                } else {
                                    assert!(
                                        dev.completed(fs) >= seq,
                                        "stream {s:?} got [{lo:#x},{hi:#x}) while {fs:?}'s work on \
                                         [{flo:#x},{fhi:#x}) may still run"
                                    );
                                }
                            }
                        }
                        for l in &live {
                            let (llo, lhi) = (
                                l.device_address(),
                                l.device_address() + l.block_size() as u64,
                            );
                            assert!(hi <= llo || lhi <= lo, "overlapping live buffers");
                        }
                        live.push(b);
                    }
                    Err(PoolError::OutOfMemory(_)) => ooms += 1,
                    Err(e) => panic!("{e}"),
                }
            }
            5..=7 if !live.is_empty() => {
                let b = live.swap_remove((rng >> 24) as usize % live.len());
                free(b, &mut freed);
            }
            // Part of a stream's work completes (its events complete in order).
            8 => {
                let (done, queued) = (dev.completed(s), dev.queued(s));
                dev.complete_to(s, done + (rng >> 40) % (queued - done + 1));
            }
            _ if rng & (1 << 62) != 0 => {
                // Recording events fails now and then (the blocks then wait to be ordered).
                failing = !failing;
                dev.set_fail_event_record(failing);
            }
            _ => {
                p.trim();
            }
        }
        freed.retain(|&(_, _, fs, seq)| dev.completed(fs) < seq);
        if live.len() > 40 {
            for b in live.drain(..) {
                free(b, &mut freed);
            }
        }
    }
    assert!(
        ooms > 0 && same_stream_reuses > 0 && dev.device_syncs() > 0,
        "ooms {ooms}, same-stream reuses {same_stream_reuses}, device syncs {}",
        dev.device_syncs()
    );
    let errors = p.take_errors();
    assert!(
        !errors.is_empty()
            && errors
                .iter()
                .all(|e| e.to_string().contains("cuEventRecord")),
        "{errors:?}"
    );
    drop(live);
    dev.set_fail_event_record(false);
    p.synchronize();
    assert_eq!(p.stats().allocator.bytes_in_use, 0);
    p.check().unwrap();
    p.check_err().unwrap();
}

#[test]
fn invalid_requests_are_errors() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(64 * MIB));
    // SAFETY: never read.
    let e = unsafe { p.alloc::<u64>(&A, usize::MAX / 4) }.unwrap_err();
    assert!(
        matches!(e, PoolError::InvalidRequest { reason, .. } if reason.contains("overflows")),
        "{e}"
    );
    assert!(
        e.to_string().ends_with("len * size_of::<T>() overflows"),
        "{e}"
    );
    // SAFETY: never read.
    let e = unsafe { p.alloc::<u8>(&A, usize::MAX - 10) }.unwrap_err();
    assert!(
        matches!(e, PoolError::InvalidRequest { reason, .. } if reason.contains("rounded")),
        "{e}"
    );
    let z = alloc(&p, A, 0).unwrap();
    assert_eq!(z.block_size(), 256);
    assert!(z.is_empty());
}

/// A `T` aligned to 4 KiB (more than the driver's 512 bytes).
#[repr(C, align(4096))]
struct Page([u8; 4096]);

/// A pool limited to 4 MiB whose regions come after another pool's region of 1 MiB + 512 bytes
/// (kept alive with one buffer), so the driver's next address is off 4 KiB: `(other, its buffer,
/// the pool)`.
fn beside_an_odd_region(dev: &SimDevice) -> (Pool, DeviceBuffer<u8, SimBackend>, Pool) {
    let other = pool(
        dev,
        PoolOptions {
            allow_growth: false,
            ..PoolOptions::with_limit(MIB + 512)
        },
    );
    let o = alloc(&other, A, 100).unwrap();
    (other, o, pool(dev, PoolOptions::with_limit(4 * MIB)))
}

#[test]
fn padding_of_over_aligned_regions_counts_against_the_limit() {
    let dev = SimDevice::new(GIB);
    let (_other, _o, p) = beside_an_odd_region(&dev);
    // SAFETY: simulated memory is never read.
    let a = unsafe { p.alloc::<Page>(&A, 256) }.unwrap();
    assert_eq!(a.device_address() % 4096, 0);
    assert_eq!(
        dev.requests()[1..],
        [2 * MIB, 2 * MIB + 4096],
        "the first region was not over-allocated"
    );
    // The engine sees 2 MiB of its 4 MiB limit reserved, and grows by the 2 MiB left for a block
    // that does not fit the first region; that region's padding would take the pool's memory from
    // the driver past the limit, so a smaller region is taken.
    let mut held = Vec::new();
    for _ in 0..4 {
        // SAFETY: as above.
        if let Ok(b) = unsafe { p.alloc::<Page>(&A, 384) } {
            held.push(b);
        }
        let mine = dev.bytes_live() - (MIB + 512);
        assert!(
            mine <= 4 * MIB,
            "the pool holds {mine} bytes, over its 4 MiB limit"
        );
    }
    assert_eq!(
        held.len(),
        1,
        "1.5 MiB blocks: one fits beside the first block's region"
    );
    assert_eq!(p.stats().allocator.num_regions, 2);
    drop(a);
    p.check().unwrap();
}

// ---- Tests written to kill surviving mutants (a mutation-testing pass over the pool) ----

#[test]
fn same_stream_reuse_honours_the_alignment() {
    on_both_paths(|sa, _| {
        let dev = SimDevice::new(GIB);
        let p = pool(&dev, PoolOptions::with_limit(64 * MIB));
        let _s = alloc(&p, sa, 256).unwrap();
        let x = alloc(&p, sa, 16384).unwrap();
        assert_ne!(
            x.device_address() % 4096,
            0,
            "the setup needs a block off 4 KiB"
        );
        drop(x);
        // SAFETY: simulated memory is never read.
        let page = unsafe { p.alloc::<Page>(&sa, 4) }.unwrap();
        assert_eq!(page.device_address() % 4096, 0);
    });
}

#[test]
fn same_stream_reuse_takes_the_smallest_block_that_fits() {
    on_both_paths(|sa, _| {
        // Freed in either order: the search must not stop at the first block that fits (nor take
        // the exact fit only because it came last).
        for small_first in [false, true] {
            let dev = SimDevice::new(GIB);
            let p = pool(
                &dev,
                PoolOptions {
                    initial_region_size: 16 * MIB,
                    ..PoolOptions::with_limit(64 * MIB)
                },
            );
            let big = alloc(&p, sa, 3 * MIB / 2).unwrap();
            let small = alloc(&p, sa, MIB).unwrap();
            assert_eq!((big.block_size(), small.block_size()), (3 * MIB / 2, MIB));
            let small_at = small.device_address();
            if small_first {
                drop(small);
                drop(big);
            } else {
                drop(big);
                drop(small);
            }
            let again = alloc(&p, sa, MIB).unwrap();
            assert_eq!(
                (again.device_address(), again.block_size()),
                (small_at, MIB),
                "small block freed first: {small_first}"
            );
        }
    });
}

#[test]
fn a_later_batch_does_not_delay_an_earlier_one() {
    // `x` and `y` are closed with two events; once the first completes, `x` serves another stream
    // although `y`'s work is still queued.
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(64 * MIB));
    let x = alloc(&p, A, MIB).unwrap();
    let x_at = x.device_address();
    let y = alloc(&p, A, MIB).unwrap();
    dev.enqueue(A);
    drop(x);
    p.trim();
    let first = dev.queued(A);
    dev.enqueue(A);
    drop(y);
    p.trim();
    assert_eq!(dev.recorded(A), 2);
    dev.complete_to(A, first);
    assert_eq!(alloc(&p, B, MIB).unwrap().device_address(), x_at);
}

#[test]
fn events_of_returned_blocks_are_recycled() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(64 * MIB));
    let x = alloc(&p, A, MIB).unwrap();
    dev.enqueue(A);
    drop(x);
    p.trim(); // the stream is busy: an event orders the block
    assert_eq!(dev.recorded(A), 1);
    dev.complete_all();
    p.trim(); // the event completed: the block goes back, the event is recycled
    assert_eq!(p.stats().pending_blocks, 0);
    assert_eq!(dev.events_recycled(), 1);
}

#[test]
fn deferred_errors_keep_the_newest() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(64 * MIB));
    // One old error, then more new ones than the pool keeps.
    dev.set_fail_stream_query(true);
    drop(alloc(&p, A, MIB).unwrap());
    p.trim();
    dev.set_fail_stream_query(false);
    dev.set_fail_event_record(true);
    let c = alloc(&p, A, 2 * MIB).unwrap();
    dev.enqueue(A);
    drop(c);
    for _ in 0..64 {
        p.trim();
    }
    dev.set_fail_event_record(false);
    let errors: Vec<String> = p.take_errors().iter().map(|e| e.to_string()).collect();
    assert_eq!(errors.len(), 64);
    assert!(
        errors.iter().all(|e| e.contains("cuEventRecord")),
        "the oldest error was kept: {:?}",
        &errors[..2]
    );
}

#[test]
fn a_region_freed_while_out_of_memory_is_reused_not_returned() {
    // At the limit, `b` misses; waiting for the pending free of `a` gives its whole region back to
    // the engine, which serves the request from it without a round trip through the driver.
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(6 * MIB));
    let a = alloc(&p, A, 2 * MIB).unwrap();
    let a_at = a.device_address();
    let _b = alloc(&p, B, 4 * MIB).unwrap();
    dev.enqueue(A);
    drop(a);
    let c = alloc(&p, B, MIB).unwrap();
    assert_eq!(c.device_address(), a_at);
    assert_eq!(dev.requests(), vec![2 * MIB, 4 * MIB]);
    assert_eq!(dev.frees(), 0);
}

/// A region given back stops counting against the limit, so the pool can take it again.
#[test]
fn regions_given_back_free_their_share_of_the_limit() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(16 * MIB));
    for round in 0..3 {
        let a = alloc(&p, A, 12 * MIB).unwrap_or_else(|e| panic!("round {round}: {e}"));
        drop(a);
        p.synchronize();
        assert_eq!(dev.bytes_live(), 0);
    }
}

/// The out-of-memory report names the limit when the pool's own limit (padding included), not the
/// driver, refused a region.
#[test]
fn a_refusal_by_the_padding_limit_is_reported() {
    let dev = SimDevice::new(GIB);
    let (_other, _o, p) = beside_an_odd_region(&dev);
    // SAFETY: simulated memory is never read.
    let a = unsafe { p.alloc::<Page>(&A, 256) }.unwrap();
    // SAFETY: as above.
    let err = unsafe { p.alloc::<Page>(&A, 511) }.unwrap_err();
    let PoolError::OutOfMemory(oom) = &err else {
        panic!("{err}")
    };
    assert!(
        oom.driver_error
            .as_deref()
            .is_some_and(|e| e.contains("past its limit")),
        "{err}"
    );
    drop(a);
}

/// A failed `cuMemFree` is not lost: it comes back through `take_errors` right after the call that
/// gave the region back (`synchronize` or `trim`).
#[test]
fn a_failed_region_free_is_a_deferred_error() {
    let release: [fn(&Pool) -> usize; 2] = [|p| p.synchronize(), |p| p.trim()];
    for release in release {
        let dev = SimDevice::new(GIB);
        let p = pool(&dev, PoolOptions::with_limit(64 * MIB));
        let a = alloc(&p, A, 1000).unwrap();
        let addr = a.device_address();
        // SAFETY: this breaks `with_backend_mut`'s contract on purpose, to make the pool's own free
        // of the region fail; on the simulated device no memory is behind the addresses, so nothing
        // can be read or written through them.
        unsafe { p.with_backend_mut(|b| bfc_alloc::cuda::DeviceBackend::mem_free(b, addr)) }
            .unwrap();
        drop(a);
        release(&p);
        let errs = p.take_errors();
        assert!(
            errs.iter().any(|e| e.to_string().contains("cuMemFree")),
            "{errs:?}"
        );
    }
}

#[test]
fn buffer_accessors_report_elements_and_block() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(64 * MIB));
    // SAFETY: never read.
    let b = unsafe { p.alloc::<u64>(&A, 100) }.unwrap();
    assert_eq!(b.len(), 100);
    assert_eq!(b.num_bytes(), 800);
    assert_eq!(b.block_size(), 1024);
    let d = format!("{b:?}");
    assert!(
        d.contains("len: 100") && d.contains("block_size: 1024"),
        "{d}"
    );
}

/// `zero` writes the whole block (the bytes past the elements too), once, on the home stream.
#[test]
fn zero_clears_the_whole_block() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(64 * MIB));
    // SAFETY: never read.
    let mut b = unsafe { p.alloc::<u64>(&A, 100) }.unwrap();
    b.zero().unwrap();
    assert_eq!(dev.memsets(), vec![(b.device_address(), b.block_size())]);
    assert_eq!(
        dev.queued(A),
        1,
        "the memset is one item on the home stream"
    );
}

// ---- Edge cases of the pending queues (each kills a mutant the tests above let through) ----

/// A 512-byte block is one granule over a 256-byte request, and the engine would split it (half of
/// it still fits): same-stream reuse must not hand it out whole.
#[test]
fn same_stream_reuse_refuses_a_block_the_engine_would_split_by_one_granule() {
    on_both_paths(|sa, _| {
        let dev = SimDevice::new(GIB);
        let p = pool(&dev, PoolOptions::with_limit(64 * MIB));
        let x = alloc(&p, sa, 512).unwrap();
        assert_eq!(x.block_size(), 512);
        drop(x);
        let y = alloc(&p, sa, 256).unwrap();
        assert_eq!(
            y.block_size(),
            256,
            "a block the engine would split was reused whole"
        );
    });
}

/// Same-stream reuse that empties a batch with an event hands the event back at the next call on
/// the pool's lock (not while the allocation holds the block: see
/// `a_panic_recycling_the_event_of_a_batch_a_reuse_emptied_loses_no_block`).
#[test]
fn reusing_the_last_block_of_a_closed_batch_recycles_its_event() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(64 * MIB));
    let x = alloc(&p, A, MIB).unwrap();
    let x_at = x.device_address();
    dev.enqueue(A);
    drop(x);
    p.trim(); // A is busy: one event for the block
    assert_eq!(dev.recorded(A), 1);
    let y = alloc(&p, A, MIB).unwrap();
    assert_eq!(y.device_address(), x_at);
    assert_eq!(p.stats().pending_blocks, 0);
    assert_eq!(
        dev.events_recycled(),
        0,
        "recycled while the block was in hand"
    );
    let z = alloc(&p, B, MIB).unwrap();
    assert_eq!(
        dev.events_recycled(),
        1,
        "the emptied batch's event was not recycled"
    );
    assert_eq!(dev.recorded(A), 1);
    drop((y, z));
    p.check().unwrap();
}

/// A miss on a stream whose pending blocks all have their event records no new event.
#[test]
fn a_miss_records_no_event_when_the_stream_has_no_open_block() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(64 * MIB));
    let x = alloc(&p, A, MIB).unwrap();
    dev.enqueue(A);
    drop(x);
    p.trim();
    assert_eq!(dev.recorded(A), 1);
    let _y = alloc(&p, A, 4 * MIB).unwrap(); // misses: the 1 MiB block does not fit
    assert_eq!(
        dev.recorded(A),
        1,
        "an event was recorded with nothing open"
    );
    assert_eq!(p.stats().pending_blocks, 1);
}

/// Another stream's miss closes only the open blocks that could serve it: not a smaller open
/// block, and not because of a large block that already has its event.
#[test]
fn another_streams_miss_closes_only_open_blocks_large_enough() {
    let dev = SimDevice::new(GIB);
    let p = pool(
        &dev,
        PoolOptions {
            initial_region_size: 16 * MIB,
            ..PoolOptions::with_limit(64 * MIB)
        },
    );
    let big = alloc(&p, A, 8 * MIB).unwrap();
    let small = alloc(&p, A, MIB).unwrap();
    assert_eq!(dev.requests(), vec![16 * MIB]);
    dev.enqueue(A);
    drop(big);
    p.trim(); // A is busy: the 8 MiB block gets its event
    assert_eq!(dev.recorded(A), 1);
    drop(small); // open on A

    // The engine has no 8 MiB chunk (7 MiB left): A's open block (1 MiB) cannot help, and the
    // 8 MiB one is already ordered, so A gets no second event; the pool grows instead.
    let b = alloc(&p, B, 8 * MIB).unwrap();
    assert_eq!(
        dev.recorded(A),
        1,
        "A was closed for a block that could not serve B"
    );
    assert_eq!(dev.requests().len(), 2);
    drop(b);
}

/// When the engine's largest free chunk is exactly the request, other streams' open blocks stay.
#[test]
fn a_miss_the_engine_can_serve_exactly_leaves_other_streams_open() {
    let dev = SimDevice::new(GIB);
    let p = pool(
        &dev,
        PoolOptions {
            allow_growth: false,
            ..PoolOptions::with_limit(16 * MIB)
        },
    );
    let _x = alloc(&p, A, 8 * MIB).unwrap();
    let y = alloc(&p, A, 4 * MIB).unwrap();
    let y_at = y.device_address();
    assert_eq!(p.stats().allocator.largest_free_block, 4 * MIB);
    dev.enqueue(A);
    drop(y); // open on A
    let b = alloc(&p, B, 4 * MIB).unwrap();
    assert_ne!(b.device_address(), y_at);
    assert_eq!(
        dev.recorded(A),
        0,
        "A was closed although the engine could serve B"
    );
}

/// A free polls the pending events too: a batch whose event completed goes back on a later free
/// that takes the pool's lock (each polls up to 4 streams' queues, in turn).
#[test]
fn a_free_returns_the_batches_whose_event_completed() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(64 * MIB));
    let x = alloc(&p, A, MIB).unwrap();
    let y = alloc(&p, B, MIB).unwrap();
    dev.enqueue(A);
    drop(x);
    p.trim();
    dev.complete(A);
    drop(y); // open on B; the free polls A's completed event
    let s = p.stats();
    assert_eq!((s.pending_blocks, s.pending_bytes), (1, MIB));
}

/// One poll returns every batch of a stream whose event completed, not just the oldest.
#[test]
fn one_poll_returns_every_completed_batch_of_a_stream() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(64 * MIB));
    let x = alloc(&p, A, MIB).unwrap();
    let y = alloc(&p, A, MIB).unwrap();
    dev.enqueue(A);
    drop(x);
    p.trim();
    dev.enqueue(A);
    drop(y);
    p.trim();
    assert_eq!((dev.recorded(A), p.stats().pending_blocks), (2, 2));
    dev.complete(A);
    p.trim();
    assert_eq!(
        p.stats().pending_blocks,
        0,
        "a completed batch stayed pending"
    );
}

/// A miss tries to order its own stream's blocks once: after a failed record, the same miss does
/// not record again for them as "another stream's" open blocks.
#[test]
fn a_miss_orders_its_own_streams_blocks_once() {
    let dev = SimDevice::new(GIB);
    let p = pool(
        &dev,
        PoolOptions {
            allow_growth: false,
            ..PoolOptions::with_limit(16 * MIB)
        },
    );
    let x = alloc(&p, A, 8 * MIB).unwrap();
    let _z = alloc(&p, B, 6 * MIB).unwrap(); // takes the other 8 MiB chunk whole
    assert_eq!(p.stats().allocator.largest_free_block, 0);
    dev.enqueue(A);
    drop(x);
    dev.set_fail_event_record(true);
    // The 8 MiB block would be split for 3 MiB: a miss. Closing A fails (1), and out of memory
    // closes it again before waiting for the device (2).
    let c = alloc(&p, A, 3 * MIB).unwrap();
    dev.set_fail_event_record(false);
    assert_eq!(dev.device_syncs(), 1);
    let errs = p.take_errors();
    assert_eq!(errs.len(), 2, "{errs:?}");
    drop(c);
}

/// A back end that panics recycling the event of a stream's last batch, when a poll (or a
/// synchronisation) returns that batch and leaves its queue empty, leaves the pool usable: its
/// count of empty queues still agrees with its queues, so the next call on the pool's lock neither
/// trips the debug check of that count nor underflows it. (Found by a review of 5b19ed7.)
#[test]
fn a_panic_recycling_an_event_keeps_the_empty_queue_count() {
    for in_synchronize in [false, true] {
        let dev = SimDevice::new(GIB);
        let p = counting_pool(&dev, 64 * MIB);
        let a = Counted(A, Arc::new(()));
        let b = Counted(B, Arc::new(()));
        let x = counted_alloc(&p, &a, MIB);
        dev.enqueue(A);
        drop(x); // Open on A (no stream cache).
        p.trim(); // A is busy: one batch with an event, A's only one.
        assert_eq!(p.stats().pending_blocks, 1);
        dev.complete_all();
        // The poll of this allocation (or the synchronisation) returns A's batch and recycles its
        // event: a panic.
        let panicked = with_switch(&PANIC_IN_RECYCLE_EVENT, true, || {
            if in_synchronize {
                p.synchronize();
            } else {
                drop(counted_alloc(&p, &b, MIB));
            }
        });
        assert!(panicked.is_err());
        // A's queue is empty now. Calls on the pool's lock go on working.
        let y = counted_alloc(&p, &b, MIB);
        let z = counted_alloc(&p, &a, MIB);
        drop(z); // Into A's empty queue.
        drop(y);
        p.synchronize();
        p.check().unwrap();
    }
}

/// A stream's own allocation that empties a batch with an event leaves the event in
/// `State::retired` (no back-end call while it holds the block). A trim that then finds the stream
/// idle returns its last (open) batch through `release_batch` -> `recycle` -> `recycle_retired`,
/// which hands that retired event to the back end: if that panics, the queue has just been emptied
/// but `close` never reaches `remove_queue`, so the queue stays, empty, with `empty_queues` not
/// counting it. The next free on the stream (push_open: `empty_queues -= 1`) underflows, and every
/// later poll trips the debug check of the count. (The same class as
/// `a_panic_recycling_an_event_keeps_the_empty_queue_count`, on a path that only
/// calls the back end since 5203cc7 made `recycle` also drain `retired`.) Found by a review.
#[test]
fn a_panic_recycling_a_retired_event_in_a_trim_keeps_the_empty_queue_count() {
    let dev = SimDevice::new(GIB);
    let p = counting_pool(&dev, 64 * MIB);
    let a = Counted(A, Arc::new(()));
    let x = counted_alloc(&p, &a, MIB);
    let y = counted_alloc(&p, &a, 2 * MIB);
    dev.enqueue(A); // A is busy.
    drop(x);
    p.trim(); // A busy: x's batch gets an event.
    drop(y); // An open batch after it.
             // A's own allocation takes x's block out of its batch with an event (the event is not done):
             // the batch goes, its event waits in `retired`.
    let x2 = counted_alloc(&p, &a, MIB);
    dev.complete_all(); // A is idle now.
                        // The trim closes A: idle, so its only batch (y, open) goes back, and `recycle` hands the
                        // back end the retired event: a panic.
    let panicked = with_switch(&PANIC_IN_RECYCLE_EVENT, true, || p.trim());
    assert!(panicked.is_err(), "the back end was not called");
    // Calls on the pool's lock go on working (as they do after the other recycle panics).
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        drop(x2); // Into A's (empty) queue.
        let z = counted_alloc(&p, &a, 3 * MIB);
        drop(z);
        p.trim();
        p.synchronize();
    }));
    assert!(
        r.is_ok(),
        "the pool broke after a back end panicked recycling an event in a trim"
    );
    assert_all_back(&p);
}

/// A poll with more than 16 stream queues, some empty, drops the empty ones
/// (`drop_empty_queues`), dropping their stream handles under the lock before it resets
/// `empty_queues`. A stream handle that panics when dropped leaves the queue gone but still
/// counted, and every later poll trips the debug check of the count.
#[test]
fn a_panic_dropping_an_empty_queues_stream_handle_keeps_the_empty_queue_count() {
    let dev = SimDevice::new(GIB);
    let p = counting_pool(&dev, 256 * MIB);
    // 18 streams on the pool's lock (CountingBackend caches only streams 3 and 4), each with a
    // queue holding one open block.
    let streams: Vec<Counted> = (10..28)
        .map(|n| Counted(SimStream(n), Arc::new(())))
        .collect();
    for s in &streams {
        drop(counted_alloc(&p, s, 4096));
    }
    // The first stream takes its block back: its queue is left empty (and kept).
    let held = counted_alloc(&p, &streams[0], 4096);
    // The next call on the lock polls: 18 queues, one empty -> drop_empty_queues, whose drop of
    // the empty queue's stream handle panics.
    let panicked = with_switch(&PANIC_IN_STREAM_DROP, true, || {
        drop(counted_alloc(&p, &streams[1], 4096))
    });
    assert!(panicked.is_err(), "no stream handle was dropped");
    // (`held` is not captured: its drop would run the same failing check during the unwind,
    // a panic in a destructor during cleanup, which aborts the process.)
    let catch =
        |f: &mut dyn FnMut()| std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_ok();
    let mut held = Some(held);
    let ok = [
        catch(&mut || drop(counted_alloc(&p, &streams[2], 4096))),
        catch(&mut || drop(held.take())),
        catch(&mut || {
            p.synchronize();
        }),
    ];
    assert_eq!(
        ok, [true; 3],
        "the pool broke after a stream handle panicked in a drop of empty queues \
         (an allocation, a free, a synchronisation)"
    );
    assert_all_back(&p);
}

/// A stream's allocation that takes the last block of one of its batches with an event calls no
/// back end while it holds that block: the event goes back at the next poll, so a back end that
/// panics recycling it loses no block (the panic comes from the next call on the pool's lock, with
/// the block already in a buffer). Once the back end behaves, everything goes back to the engine.
/// (From a review: the event was recycled before the block was handed out, and a panic there lost
/// the block.)
#[test]
fn a_panic_recycling_the_event_of_a_batch_a_reuse_emptied_loses_no_block() {
    let dev = SimDevice::new(GIB);
    let p = counting_pool(&dev, 64 * MIB);
    let a = Counted(A, Arc::new(()));
    let x = counted_alloc(&p, &a, MIB);
    let x_at = x.device_address();
    dev.enqueue(A);
    drop(x);
    p.trim(); // A is busy: x's batch gets an event.
    let taken = with_switch(&PANIC_IN_RECYCLE_EVENT, true, || counted_alloc(&p, &a, MIB));
    let later = with_switch(&PANIC_IN_RECYCLE_EVENT, true, || p.trim());
    let y = taken.expect("the allocation that took x's block called the back end");
    assert_eq!(y.device_address(), x_at);
    assert!(later.is_err(), "the emptied batch's event was not recycled");
    drop(y);
    dev.complete_all();
    p.synchronize();
    assert_all_back(&p);
}

/// A back end that panics waiting for the second of a stream's events in a synchronisation, after
/// the first one's wait failed, leaves the stream's batches in their order (events first): so
/// once the work is done and the driver works again, a trim returns them all. (From a review: the
/// synchronisation turned each queue around in place, and a panic half-way left the batch with
/// the failed wait behind an unordered one, where no poll looked at it again.)
#[test]
fn a_panic_half_way_through_a_synchronisation_keeps_the_queue_in_order() {
    let dev = SimDevice::new(GIB);
    let p = counting_pool(&dev, 64 * MIB);
    let a = Counted(A, Arc::new(()));
    for size in [MIB, 2 * MIB] {
        let x = counted_alloc(&p, &a, size);
        dev.enqueue(A);
        drop(x);
        p.trim(); // A is busy: one batch with an event per block.
    }
    drop(counted_alloc(&p, &a, 3 * MIB)); // An open block.
    assert_eq!(p.stats().pending_blocks, 3);
    // The synchronisation: the open block's event is refused (an unordered batch), the device
    // waits fail, the first event's wait fails, the second one's panics.
    dev.set_fail_event_record(true);
    dev.set_fail_synchronize(true);
    dev.set_fail_event_queries(true);
    let panicked = with_switch(&EVENT_SYNC_PANICS_AT, 2, || p.synchronize());
    dev.set_fail_event_record(false);
    dev.set_fail_synchronize(false);
    dev.set_fail_event_queries(false);
    assert!(panicked.is_err());
    assert_eq!(p.stats().pending_blocks, 3);
    dev.complete_all();
    p.trim();
    let s = p.stats();
    assert_eq!(
        (s.pending_blocks, s.pending_bytes, s.allocator.bytes_in_use),
        (0, 0, 0),
        "blocks left pending after the work finished"
    );
    p.check().unwrap();
    drop(p.take_errors());
}

/// A back end that panics while the pool waits for a batch's event (in a synchronisation) loses
/// none of the batch's blocks: they stay pending, the next synchronisation returns them, and
/// dropping the pool then gives every region back to the driver.
#[test]
fn a_panic_while_waiting_for_an_event_keeps_the_blocks_pending() {
    let dev = SimDevice::new(GIB);
    let a = Counted(A, Arc::new(()));
    {
        let p = counting_pool(&dev, 64 * MIB);
        let x = counted_alloc(&p, &a, MIB);
        dev.enqueue(A);
        drop(x);
        let panicked = with_switch(&PANIC_IN_EVENT_SYNC, true, || p.synchronize());
        assert!(panicked.is_err());
        assert_eq!(p.stats().pending_blocks, 1, "the block is still pending");
        dev.complete_all();
        p.synchronize();
        let s = p.stats();
        assert_eq!(s.pending_blocks, 0);
        assert_eq!(
            s.allocator.bytes_in_use, 0,
            "the block went back to the engine"
        );
        p.check().unwrap();
    }
    assert_eq!(dev.bytes_live(), 0, "the pool gave its region back");
    assert_eq!(dev.allocations_live(), 0);
}

/// A back end that panics in a buffer's free does not keep the pool alive: the buffer counts as
/// gone, and when it was the last one the pool is dropped (returning its fully free regions).
/// Whether it panics under the pool's lock (ordering the buffer's uses) or before the free chooses
/// between the stream cache and the lock (comparing streams; found by a review).
#[test]
fn a_panic_in_the_last_free_still_lets_the_pool_go() {
    for comparing in [false, true] {
        let dev = SimDevice::new(GIB);
        let p = counting_pool(&dev, 256 * MIB);
        let s = Counted(if comparing { A } else { PANICS_IN_FREE }, Arc::new(()));
        let a = Counted(A, Arc::new(()));
        let x = counted_alloc(&p, &s, MIB);
        let region_of_x = dev.bytes_live();
        let y = counted_alloc(&p, &a, 40 * MIB);
        drop(p);
        drop(y);
        assert!(
            dev.bytes_live() > region_of_x,
            "y's region is kept while x lives"
        );
        let panicked = with_switch(&PANIC_IN_SAME_STREAM, comparing, || drop(x));
        assert!(panicked.is_err(), "comparing streams: {comparing}");
        // x's block is lost with the panic, so its region stays; the pool itself went, and y's
        // region with it.
        assert!(
            dev.bytes_live() < 40 * MIB,
            "{} bytes live: the pool was kept (comparing streams: {comparing})",
            dev.bytes_live()
        );
    }
}

/// A stream-cache hit through the handle whose clone the cached block's free left (the same
/// `Arc`) gives the buffer that clone: no clone and no drop of the caller's handle, whose count
/// every thread on the stream would otherwise write. Through another handle of the stream, the
/// buffer clones the caller's and the cached one goes.
#[test]
fn a_cache_hit_through_the_same_handle_keeps_the_cached_clone() {
    let dev = SimDevice::new(GIB);
    let p = counting_pool(&dev, 64 * MIB);
    let c = Counted(C, Arc::new(()));
    let clones = || CLONES.with(std::cell::Cell::get);
    drop(counted_alloc(&p, &c, 4096));
    assert_eq!(
        Arc::strong_count(&c.1),
        2,
        "the cache holds the freed buffer's clone"
    );
    let before = clones();
    let x = counted_alloc(&p, &c, 4096);
    assert_eq!(clones(), before, "a hit through the same handle cloned it");
    assert_eq!(p.stats().pending_blocks, 0, "a hit");
    drop(x);
    // Another handle of stream C (an owned and a borrowed wrapper, say).
    let other = Counted(C, Arc::new(()));
    let y = counted_alloc(&p, &other, 4096);
    assert_eq!(p.stats().pending_blocks, 0, "a hit");
    assert_eq!(clones(), before + 1);
    assert_eq!(
        (Arc::strong_count(&c.1), Arc::strong_count(&other.1)),
        (1, 2),
        "the buffer holds a clone of the caller's handle, and the cached one went"
    );
    drop(y);
    p.check().unwrap();
}

/// A stream handle that panics when a stream-cache hit through another handle of the stream drops
/// the one its block's free left leaves no buffer counted: the pool still goes with its last
/// handle. (Found by a review.) Nor does it lose the block: the handle is dropped once the buffer
/// exists, whose drop in the unwinding frees it. (It was dropped before, and the block was lost.)
#[test]
fn a_panic_dropping_a_cached_blocks_handle_leaves_no_count_behind() {
    let dev = SimDevice::new(GIB);
    let p = counting_pool(&dev, 256 * MIB);
    let a = Counted(A, Arc::new(()));
    let c = Counted(C, Arc::new(()));
    let x = counted_alloc(&p, &c, MIB);
    let y = counted_alloc(&p, &a, 40 * MIB); // A region of its own.
    drop(y); // Pending on A (no cache).
    drop(x); // Into the cache.
    assert_eq!(p.stats().pending_blocks, 2);
    let other = Counted(C, Arc::new(()));
    let panicked = with_switch(&PANIC_IN_STREAM_DROP, true, || {
        counted_alloc(&p, &other, MIB)
    });
    assert!(panicked.is_err());
    p.check().unwrap();
    drop(p);
    // The pool went, and every region with it: the hit's block came back with its buffer.
    assert_eq!(
        dev.bytes_live(),
        0,
        "a buffer that was never made kept the pool, or the hit's block was lost"
    );
}

/// A stream handle that panics when a stream-cache hit through another handle of the stream clones
/// the caller's (for the buffer, instead of the one the block's free left) leaves the block in the
/// cache, and no buffer counted. (The clone came after the block left the cache, and a panic lost
/// it.)
#[test]
fn a_panic_cloning_the_callers_handle_in_a_cache_hit_keeps_the_block() {
    let dev = SimDevice::new(GIB);
    let p = counting_pool(&dev, 256 * MIB);
    let c = Counted(C, Arc::new(()));
    drop(counted_alloc(&p, &c, MIB)); // Into the cache.
    assert_eq!(p.stats().pending_blocks, 1);
    let other = Counted(C, Arc::new(()));
    let panicked = with_switch(&PANIC_IN_STREAM_CLONE, true, || {
        counted_alloc(&p, &other, MIB)
    });
    assert!(panicked.is_err());
    assert_eq!(p.stats().pending_blocks, 1, "the block left the cache");
    let y = counted_alloc(&p, &other, MIB);
    assert_eq!(p.stats().pending_blocks, 0, "a hit");
    drop(y);
    p.check().unwrap();
    drop(p);
    assert_eq!(dev.bytes_live(), 0, "a block was lost, or the pool kept");
}

/// A back end that panics while an allocation looks in a stream cache leaves no buffer counted
/// there: the pool still goes with its last handle (and the cache, whose lock the panic poisoned,
/// still works).
#[test]
fn a_panic_in_a_stream_cache_leaves_no_count_behind() {
    let dev = SimDevice::new(GIB);
    let p = counting_pool(&dev, 256 * MIB);
    let a = Counted(A, Arc::new(()));
    let x = counted_alloc(&p, &a, MIB);
    let s = Counted(PANICS_IN_SAME_STREAM, Arc::new(()));
    // SAFETY: simulated memory is never read.
    let panicked = std::panic::catch_unwind(|| unsafe { p.alloc::<u8>(&s, 4096) }.map(drop));
    assert!(panicked.is_err());
    drop(x);
    drop(p);
    assert_eq!(
        dev.bytes_live(),
        0,
        "a buffer that was never made kept the pool"
    );
}

/// The pool keeps a stream's handle while it has pending blocks of that stream, and once an
/// allocation emptied its queue, until a trim, a synchronisation, or a poll with more than 16
/// streams' queues (so that pool hits, alloc and free in turn, keep their queues even while other
/// streams' calls come in between): then the handle goes.
#[test]
fn pending_queues_let_their_stream_handle_go_once_empty() {
    let dev = SimDevice::new(GIB);
    let p = counting_pool(&dev, 64 * MIB);
    let a = Counted(A, Arc::new(()));
    let handles = || Arc::strong_count(&a.1) - 1;
    let x = counted_alloc(&p, &a, MIB);
    assert_eq!(handles(), 1, "the buffer's");
    drop(x);
    assert_eq!(handles(), 1, "the pending queue's");
    // Same-stream reuse empties the queue, which stays.
    let y = counted_alloc(&p, &a, MIB);
    assert_eq!(handles(), 2, "the buffer's and the emptied queue's");
    // Another stream's calls poll, and the emptied queue stays while few streams have queues.
    let b = Counted(B, Arc::new(()));
    let on_b = counted_alloc(&p, &b, MIB);
    drop(on_b);
    assert_eq!(handles(), 2, "an emptied queue went with 2 streams' queues");
    // With 16 more streams' queues (18 in all), the next poll drops the empty one.
    let others: Vec<Counted> = (0..16)
        .map(|i| Counted(SimStream(100 + i), Arc::new(())))
        .collect();
    let bufs: Vec<_> = others.iter().map(|s| counted_alloc(&p, s, MIB)).collect();
    assert_eq!(handles(), 2);
    for (i, buf) in bufs.into_iter().enumerate() {
        drop(buf); // a free polls after it queued its block
        let expected = if i < 15 { 2 } else { 1 };
        assert_eq!(handles(), expected, "after {} more streams' queues", i + 1);
    }
    p.synchronize();
    assert_eq!(p.stats().pending_blocks, 0);
    // A poll empties it.
    dev.enqueue(A);
    drop(y);
    p.trim(); // an event: A is busy
    assert_eq!(handles(), 1);
    dev.complete(A);
    p.trim();
    assert_eq!(p.stats().pending_blocks, 0);
    assert_eq!(
        handles(),
        0,
        "an empty queue kept its stream handle after a poll"
    );
    // Reuse, then synchronise while the buffer lives: nothing pending, no handle kept.
    let z = counted_alloc(&p, &a, MIB);
    drop(z);
    let w = counted_alloc(&p, &a, MIB);
    p.synchronize();
    assert_eq!(handles(), 1, "the pool kept a handle with nothing pending");
    drop(w);
    p.synchronize();
    assert_eq!(handles(), 0);
}

/// Pool hits on two streams in turn (as two threads allocating on their own streams make) keep both
/// streams' queues: neither stream's calls drop the other's emptied queue to have it re-created.
#[test]
fn hits_on_two_streams_in_turn_keep_both_queues() {
    let dev = SimDevice::new(GIB);
    let p = counting_pool(&dev, 64 * MIB);
    let (a, b) = (Counted(A, Arc::new(())), Counted(B, Arc::new(())));
    let handles = |s: &Counted| Arc::strong_count(&s.1) - 1;
    for s in [&a, &b] {
        drop(counted_alloc(&p, s, MIB));
    }
    for round in 0..10 {
        let x = counted_alloc(&p, &a, MIB);
        let y = counted_alloc(&p, &b, MIB);
        assert_eq!(
            (handles(&a), handles(&b)),
            (2, 2),
            "round {round}: a buffer and a kept queue each"
        );
        drop(x);
        drop(y);
    }
    assert_eq!(
        p.stats().allocator.num_allocs,
        20 + 2,
        "every round's allocations were hits"
    );
}

/// A stream whose queue was kept empty (its blocks came back) may go (a borrowed stream, destroyed
/// once nothing of it is pending) and a new stream get its id: the new stream's frees then fill
/// the kept queue, and the pool must hold the new stream's handle, not the old one, or nothing
/// keeps the new stream alive while its blocks are pending (and the pool would query and record
/// on the old handle).
#[test]
fn a_kept_empty_queue_holds_the_handle_of_the_stream_that_frees_into_it() {
    let dev = SimDevice::new(GIB);
    let p = counting_pool(&dev, 64 * MIB);
    let old = Counted(A, Arc::new(()));
    let b = Counted(B, Arc::new(()));
    let x = counted_alloc(&p, &old, MIB);
    dev.enqueue(A);
    drop(x);
    p.trim(); // A is busy: an event for the block
    dev.complete(A);
    // B's allocation polls: the block comes back, and A's queue stays, empty.
    let on_b = counted_alloc(&p, &b, MIB);
    assert_eq!(p.stats().pending_blocks, 0);
    let old_handles = Arc::strong_count(&old.1) - 1;
    assert_eq!(old_handles, 1, "the kept queue's");
    // The old stream goes; a new one gets its id.
    let new = Counted(A, Arc::new(()));
    let y = counted_alloc(&p, &new, MIB);
    drop(y);
    assert_eq!(p.stats().pending_blocks, 1);
    assert_eq!(
        Arc::strong_count(&new.1) - 1,
        1,
        "the pool holds no handle of the stream whose block is pending"
    );
    assert_eq!(
        Arc::strong_count(&old.1) - 1,
        0,
        "the pool still holds the old stream's handle"
    );
    drop(on_b);
}

/// A failed event query keeps the batch pending (another stream does not get it) and is
/// reported; the next query that works returns it.
#[test]
fn a_failed_event_query_keeps_the_block_pending() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(64 * MIB));
    let a = alloc(&p, A, MIB).unwrap();
    let addr = a.device_address();
    dev.enqueue(A);
    drop(a);
    p.trim(); // A is busy: one event for the block
    dev.complete(A);
    dev.set_fail_event_queries(true);
    let b = alloc(&p, B, MIB).unwrap();
    assert_ne!(
        b.device_address(),
        addr,
        "a block whose event was not seen done was reused"
    );
    assert_eq!(p.stats().pending_blocks, 1);
    assert!(p
        .take_errors()
        .iter()
        .any(|e| e.to_string().contains("cuEventQuery")));
    dev.set_fail_event_queries(false);
    p.trim();
    assert_eq!(p.stats().pending_blocks, 0);
    drop(b);
    p.check().unwrap();
}

/// When waiting for an event fails, the pool waits for the whole device instead; when that fails
/// too, the block stays pending (never handed out unordered) until a later wait works.
#[test]
fn a_failed_event_wait_falls_back_to_the_device_then_keeps_the_block() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(64 * MIB));
    let a = alloc(&p, A, MIB).unwrap();
    dev.enqueue(A);
    drop(a);
    p.trim(); // A is busy: one event for the block
    dev.set_fail_event_queries(true);
    let syncs = dev.device_syncs();
    p.synchronize();
    assert_eq!(dev.device_syncs(), syncs + 1, "no device-wide wait instead");
    assert_eq!(p.stats().pending_blocks, 0);
    assert!(p
        .take_errors()
        .iter()
        .any(|e| e.to_string().contains("cuEventSynchronize")));

    let b = alloc(&p, A, MIB).unwrap();
    let addr = b.device_address();
    dev.enqueue(A);
    drop(b);
    p.trim();
    dev.set_fail_synchronize(true);
    p.synchronize();
    assert_eq!(p.stats().pending_blocks, 1, "released without any wait");
    let c = alloc(&p, B, MIB).unwrap();
    assert_ne!(c.device_address(), addr);
    dev.set_fail_synchronize(false);
    dev.set_fail_event_queries(false);
    p.synchronize();
    assert_eq!(p.stats().pending_blocks, 0);
    assert_eq!(
        dev.completed(A),
        dev.queued(A),
        "the wait did not complete A"
    );
    drop(c);
    p.check().unwrap();
}

/// Same-stream reuse looks at the newest pending blocks first: a block freed last is found
/// behind thousands of older pending frees (the search is bounded, see the `pool_pending` bench).
#[test]
fn same_stream_reuse_finds_the_newest_free_behind_thousands_of_older_ones() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(256 * MIB));
    // (Under Miri, which is slow, still more than the 256 newest that a reuse looks through.)
    let n = if cfg!(miri) { 600 } else { 5000 };
    let old: Vec<_> = (0..n).map(|_| alloc(&p, A, 256).unwrap()).collect();
    let x = alloc(&p, A, MIB).unwrap();
    let x_at = x.device_address();
    dev.enqueue(A); // A is busy: the frees stay pending
    drop(old);
    drop(x);
    assert_eq!(p.stats().pending_blocks, n + 1);
    let y = alloc(&p, A, MIB).unwrap();
    assert_eq!(y.device_address(), x_at, "the newest free was not reused");
}

/// `num_allocs` counts every allocation, also those a stream's own pending blocks serve (which the
/// engine does not see).
#[test]
fn num_allocs_counts_allocations_served_from_pending_blocks() {
    on_both_paths(|sa, sb| {
        let dev = SimDevice::new(GIB);
        let p = pool(&dev, PoolOptions::with_limit(256 * MIB));
        let first = alloc(&p, sa, 4096).unwrap();
        let addr = first.device_address();
        drop(first);
        for _ in 0..9 {
            let b = alloc(&p, sa, 4096).unwrap();
            assert_eq!(
                b.device_address(),
                addr,
                "not served from the pending block"
            );
        }
        assert_eq!(p.stats().allocator.num_allocs, 10);
        let other = alloc(&p, sb, 4096).unwrap();
        assert_eq!(p.stats().allocator.num_allocs, 11);
        drop(other);
    });
}

/// Out of memory with no pending frees: nothing can come back, so the pool reports it after one
/// round of driver requests, not two.
#[test]
fn out_of_memory_with_nothing_pending_asks_the_driver_once() {
    let dev = SimDevice::new(64 * MIB);
    let p = pool(&dev, PoolOptions::with_limit(GIB));
    let _a = alloc(&p, A, 40 * MIB).unwrap();
    let before = dev.requests().len();
    assert!(alloc(&p, B, 40 * MIB).is_err());
    let req = dev.requests()[before..].to_vec();
    assert!(!req.is_empty());
    assert!(
        req.windows(2).all(|w| w[1] < w[0]),
        "the driver was asked again for the same sizes: {req:?}"
    );
}

#[test]
fn streams_the_cuda_back_end_refuses_are_refused_as_home_streams() {
    // As `CudaBackend::check_stream`: a stream of another context, or the per-thread default
    // stream (one handle for every thread's stream), cannot be a buffer's home stream.
    let dev = SimDevice::new(1 << 30);
    let p = pool(&dev, PoolOptions::with_limit(64 << 20));
    for s in [SimStream::in_context(1, 1), SimStream::per_thread(0)] {
        match alloc(&p, s, 4096) {
            Err(PoolError::Backend(e)) => assert_eq!(e.op, "DevicePool::alloc", "{e}"),
            other => panic!("{s:?}: {:?}", other.map(|b| b.device_address())),
        }
    }
    assert_eq!(
        dev.requests(),
        Vec::<usize>::new(),
        "nothing asked of the driver"
    );
    assert!(alloc(&p, A, 4096).is_ok());
}

#[test]
fn a_chunk_capacity_beyond_what_the_engine_can_index_is_an_error() {
    let dev = SimDevice::new(GIB);
    for cap in [0, 1, u32::MAX as usize, usize::MAX] {
        let options = PoolOptions {
            chunk_capacity: cap,
            ..PoolOptions::with_limit(64 * MIB)
        };
        match DevicePool::with_backend(dev.backend(), options) {
            Err(PoolError::Config(what)) => assert!(what.contains("chunk_capacity"), "{what}"),
            Err(e) => panic!("{cap}: {e}"),
            Ok(_) => panic!("{cap}: accepted"),
        }
    }
    assert_eq!(
        dev.requests(),
        Vec::<usize>::new(),
        "nothing asked of the driver"
    );
}

// ---- Tests written to kill surviving mutants (a second mutation-testing pass over the pool) ----

/// Same-stream reuse honours the engine's internal-fragmentation bound, not only its split ratio: a
/// block that leaves 128 MiB unused (but is less than twice the request) would be split by the
/// engine, so it is not handed out whole; the miss returns it and the engine splits it.
#[test]
fn same_stream_reuse_refuses_a_block_that_wastes_the_fragmentation_bound() {
    on_both_paths(|sa, _| {
        let dev = SimDevice::new(4 * GIB);
        let p = pool(&dev, PoolOptions::with_limit(GIB));
        drop(alloc(&p, sa, 328 * MIB).unwrap());
        let b = alloc(&p, sa, 200 * MIB).unwrap();
        assert_eq!(
            b.block_size(),
            200 * MIB,
            "a block 128 MiB too large handed out whole"
        );
        p.check().unwrap();
    });
}

/// A trim drops every queue an allocation emptied, not only when the last queue is the empty one.
#[test]
fn a_poll_drops_an_emptied_queue_before_a_busy_one() {
    let dev = SimDevice::new(GIB);
    let p = counting_pool(&dev, 64 * MIB);
    let a = Counted(A, Arc::new(()));
    let b = Counted(B, Arc::new(()));
    let handles = || Arc::strong_count(&a.1) - 1;
    drop(counted_alloc(&p, &a, MIB));
    let on_b = counted_alloc(&p, &b, MIB);
    dev.enqueue(B);
    // B's queue comes after A's, and B stays busy.
    drop(on_b);
    let y = counted_alloc(&p, &a, MIB);
    assert_eq!(handles(), 2, "the buffer's and the emptied queue's");
    p.trim();
    assert_eq!(p.stats().pending_blocks, 1, "B's block is still pending");
    assert_eq!(
        handles(),
        1,
        "an emptied queue kept its stream handle after a poll"
    );
    drop(y);
}

/// A memory fraction of exactly 1 is valid: the whole device (rounded down to the granule).
#[test]
fn a_memory_fraction_of_one_is_the_whole_device() {
    let opts = PoolOptions {
        limit: MemoryLimit::Fraction(1.0),
        ..PoolOptions::default()
    };
    assert_eq!(opts.resolve_limit(GIB, 4 * GIB + 100, 8), Ok(4 * GIB));
}

/// When an event wait fails in a synchronisation and the pool waits for the device instead, that
/// device-wide wait covers the other streams' batches too: no further event wait, failure or device
/// synchronisation.
#[test]
fn one_device_wait_after_a_failed_event_wait_covers_every_batch() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(64 * MIB));
    let (a, b) = (alloc(&p, A, MIB).unwrap(), alloc(&p, B, MIB).unwrap());
    dev.enqueue(A);
    dev.enqueue(B);
    drop(a);
    drop(b);
    dev.set_fail_event_queries(true);
    p.synchronize();
    assert_eq!(p.stats().pending_blocks, 0);
    assert_eq!(dev.device_syncs(), 1);
    let errs = p.take_errors();
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert!(
        errs[0].to_string().contains("cuEventSynchronize"),
        "{}",
        errs[0]
    );
}

/// A failed device-wide synchronisation for unordered blocks in a synchronisation is reported, and
/// the blocks stay pending.
#[test]
fn a_failed_device_wait_for_unordered_blocks_is_a_deferred_error() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(64 * MIB));
    let a = alloc(&p, A, MIB).unwrap();
    dev.enqueue(A);
    drop(a);
    dev.set_fail_event_record(true);
    dev.set_fail_synchronize(true);
    p.synchronize();
    assert_eq!(
        p.stats().pending_blocks,
        1,
        "an unordered block was handed back"
    );
    let errs = p.take_errors();
    assert!(
        errs.iter()
            .any(|e| e.to_string().contains("cuCtxSynchronize")),
        "{errs:?}"
    );
}

/// A driver refusal is forgotten once an allocation succeeds: a later out-of-memory at the pool's
/// limit, which asks the driver nothing, names no driver error.
#[test]
fn a_driver_refusal_is_forgotten_after_a_success() {
    let dev = SimDevice::new(GIB);
    dev.set_refuse_above(MIB + MIB / 2);
    let p = pool(&dev, PoolOptions::with_limit(64 * MIB));
    let _a = alloc(&p, A, MIB).unwrap(); // 2 MiB refused, a smaller region taken
    let e = alloc(&p, A, 100 * MIB).unwrap_err();
    let PoolError::OutOfMemory(oom) = e else {
        panic!("{e}")
    };
    assert_eq!(oom.report.cause, OomCause::LimitReached);
    assert_eq!(oom.driver_error, None);
}

/// The out-of-memory message names the driver's refusal.
#[test]
fn the_out_of_memory_message_names_the_driver_refusal() {
    let dev = SimDevice::new(GIB);
    dev.set_used_by_others(GIB - 8 * MIB);
    let p = pool(&dev, PoolOptions::with_limit(512 * MIB));
    let e = alloc(&p, A, 16 * MIB).unwrap_err();
    let PoolError::OutOfMemory(oom) = &e else {
        panic!("{e}")
    };
    let refusal = oom.driver_error.clone().unwrap();
    assert!(
        e.to_string().contains(&std::format!("; driver: {refusal}")),
        "{e}"
    );
}

/// A rejected free's error is the source of the pool error that carries it.
#[test]
fn a_rejected_free_is_the_error_source() {
    use std::error::Error;
    let e = PoolError::Free(bfc_alloc::core::FreeError::DoubleFree { ptr: 0x100 });
    assert!(e.source().is_some_and(|s| s.to_string() == {
        let PoolError::Free(f) = &e else {
            unreachable!()
        };
        f.to_string()
    }));
}

// ---- Tests written to kill surviving mutants (a third mutation-testing pass over the pool) ----

/// Same-stream reuse looks at exactly the 256 most recently freed pending blocks of the stream
/// (the pool's bound on the scan): a block 256th from the newest is found, one 257th is not, and
/// the request misses to the engine instead.
#[test]
fn same_stream_reuse_scans_exactly_the_256_newest_pending_blocks() {
    for (newer, found) in [(255, true), (256, false)] {
        let dev = SimDevice::new(GIB);
        let p = pool(&dev, PoolOptions::with_limit(256 * MIB));
        let x = alloc(&p, A, MIB).unwrap();
        let x_at = x.device_address();
        let small: Vec<_> = (0..newer).map(|_| alloc(&p, A, 256).unwrap()).collect();
        dev.enqueue(A); // A is busy: the frees stay pending
        drop(x);
        drop(small);
        assert_eq!(p.stats().pending_blocks, newer + 1);
        let y = alloc(&p, A, MIB).unwrap();
        assert_eq!(
            y.device_address() == x_at,
            found,
            "{newer} newer pending blocks: the block behind them found: {}",
            !found
        );
    }
}

/// Among pending blocks of one size that fit a request without being exact, same-stream reuse
/// takes the most recently freed one, as it does for an exact fit.
#[test]
fn same_stream_reuse_takes_the_newest_of_equal_blocks() {
    on_both_paths(|sa, _| {
        let dev = SimDevice::new(GIB);
        let p = pool(&dev, PoolOptions::with_limit(64 * MIB));
        let x = alloc(&p, sa, MIB).unwrap();
        let y = alloc(&p, sa, MIB).unwrap();
        let y_at = y.device_address();
        dev.enqueue(sa); // sa is busy: the frees stay pending
        drop(x);
        drop(y);
        let z = alloc(&p, sa, MIB - 256).unwrap();
        assert_eq!(z.block_size(), MIB, "not served whole from a pending block");
        assert_eq!(
            z.device_address(),
            y_at,
            "an older block of the same size taken"
        );
    });
}

/// When waiting for an event fails and the device-wide wait that replaces it fails too, both
/// failures are deferred errors.
#[test]
fn a_failed_device_wait_after_a_failed_event_wait_is_a_deferred_error() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(64 * MIB));
    let a = alloc(&p, A, MIB).unwrap();
    dev.enqueue(A);
    drop(a);
    p.trim(); // A is busy: one event for the block
    dev.set_fail_event_queries(true);
    dev.set_fail_synchronize(true);
    p.synchronize();
    assert_eq!(p.stats().pending_blocks, 1);
    let errs: Vec<_> = p.take_errors().iter().map(|e| e.to_string()).collect();
    assert!(
        errs.iter().any(|e| e.contains("cuEventSynchronize")),
        "{errs:?}"
    );
    assert!(
        errs.iter().any(|e| e.contains("cuCtxSynchronize")),
        "{errs:?}"
    );
    dev.set_fail_synchronize(false);
    dev.set_fail_event_queries(false);
    p.synchronize();
    assert_eq!(p.stats().pending_blocks, 0);
    p.check().unwrap();
}

/// TensorFlow's system reserve is the small one only below 2 GiB of free memory: at exactly 2 GiB
/// the reserve of the device's compute capability applies.
#[test]
fn the_small_system_reserve_ends_at_two_gib_available() {
    assert_eq!(min_system_memory(2 * GIB - 1, 6), 225 * MIB);
    assert_eq!(min_system_memory(2 * GIB, 6), 500 * MIB);
    assert_eq!(min_system_memory(2 * GIB, 9), 1800 * MIB);
}

/// Later uses of a buffer in another context it was used in already do not grow its record: each
/// allocates as much host memory as the one before (the simulator's own bookkeeping), no more.
#[test]
fn uses_in_an_already_seen_context_do_not_grow_the_record() {
    const X: SimStream = SimStream::in_context(1, 7);
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(256 * MIB));
    let x = alloc(&p, A, 256).unwrap();
    x.simulate_use(X);
    x.simulate_use(X);
    let per_use = host_allocs(|| {
        x.simulate_use(X);
    });
    for i in 0..64 {
        let n = host_allocs(|| {
            x.simulate_use(X);
        });
        assert_eq!(n, per_use, "use {i}: the record grew");
    }
}

/// `check_err` returns the oldest deferred error, and clears them all.
#[test]
fn check_err_returns_the_oldest_deferred_error() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(64 * MIB));
    let a = alloc(&p, A, MIB).unwrap();
    dev.enqueue(A);
    drop(a);
    dev.set_fail_event_record(true);
    dev.set_fail_synchronize(true);
    // A is busy: recording its event fails (cuEventRecord), and so does the device-wide wait for
    // the unordered block (cuCtxSynchronize).
    p.synchronize();
    dev.set_fail_event_record(false);
    dev.set_fail_synchronize(false);
    let e = p.check_err().unwrap_err();
    assert!(e.to_string().contains("cuEventRecord"), "{e}");
    assert!(p.check_err().is_ok(), "the other errors were not cleared");
}

/// A zero-byte request is served like a one-byte one: by a stream's own pending block of one
/// granule.
#[test]
fn a_zero_byte_request_reuses_a_pending_granule_of_its_stream() {
    on_both_paths(|sa, _| {
        let dev = SimDevice::new(GIB);
        let p = pool(&dev, PoolOptions::with_limit(64 * MIB));
        let _keep = alloc(&p, sa, MIB).unwrap();
        let a = alloc(&p, sa, 1).unwrap();
        assert_eq!(a.block_size(), 256);
        let a_at = a.device_address();
        dev.enqueue(sa); // sa is busy: the free stays pending
        drop(a);
        let z = alloc(&p, sa, 0).unwrap();
        assert_eq!(
            z.device_address(),
            a_at,
            "the pending granule was not reused"
        );
        assert_eq!(p.stats().pending_blocks, 0);
    });
}

/// A region the engine gives back to make room for growth, during an allocation that succeeds,
/// reports its failed free at once (not at the next trim or synchronisation).
#[test]
fn a_failed_region_free_during_a_successful_allocation_is_deferred_at_once() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(7 * MIB));
    let a = alloc(&p, A, 2 * MIB).unwrap();
    let addr = a.device_address();
    let _b = alloc(&p, A, 4 * MIB).unwrap();
    assert_eq!(dev.requests(), vec![2 * MIB, 4 * MIB]);
    // SAFETY: this breaks `with_backend_mut`'s contract on purpose, to make the pool's own free
    // of the region fail; on the simulated device no memory is behind the addresses, so nothing
    // can be read or written through them.
    unsafe { p.with_backend_mut(|b| bfc_alloc::cuda::DeviceBackend::mem_free(b, addr)) }.unwrap();
    drop(a); // A is idle: the miss below returns the block, and its region is free
    let _c = alloc(&p, A, 3 * MIB).unwrap();
    assert_eq!(dev.requests(), vec![2 * MIB, 4 * MIB, 3 * MIB]);
    let errs = p.take_errors();
    assert!(
        errs.iter().any(|e| e.to_string().contains("cuMemFree")),
        "{errs:?}"
    );
}

/// A trim drops every queue its poll empties, also one that removing an earlier emptied queue
/// moved into that queue's place.
#[test]
fn a_poll_drops_every_queue_it_empties() {
    let dev = SimDevice::new(GIB);
    let p = counting_pool(&dev, 64 * MIB);
    let streams = [A, B, C].map(|s| Counted(s, Arc::new(())));
    for s in &streams {
        let buf = counted_alloc(&p, s, MIB);
        dev.enqueue(s.0);
        drop(buf);
    }
    p.trim(); // every stream is busy: one event each, queues A, B, C in that order
    assert_eq!(p.stats().pending_blocks, 3);
    dev.complete(A);
    dev.complete(C);
    p.trim();
    assert_eq!(p.stats().pending_blocks, 1, "B's block is still pending");
    let handles = |s: &Counted| Arc::strong_count(&s.1) - 1;
    assert_eq!(handles(&streams[0]), 0, "A's emptied queue kept its handle");
    assert_eq!(handles(&streams[2]), 0, "C's emptied queue kept its handle");
    assert_eq!(handles(&streams[1]), 1);
}

/// A failed memory query (`cuMemGetInfo`) leaves the rest of the counters: the device's memory
/// reads 0 of 0, as documented.
#[test]
fn stats_report_no_device_memory_when_the_memory_query_fails() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(64 * MIB));
    let a = alloc(&p, A, MIB).unwrap();
    dev.set_fail_mem_info(true);
    let s = p.stats();
    assert_eq!((s.device_free, s.device_total), (0, 0));
    assert_eq!(s.allocator.bytes_in_use, MIB);
    dev.set_fail_mem_info(false);
    let s = p.stats();
    assert_eq!(s.device_total, GIB);
    assert!(s.device_free > 0 && s.device_free < GIB);
    drop(a);
}

/// The out-of-memory report reads 0 of 0 device memory when the memory query fails too, and a
/// pool cannot be made without it.
#[test]
fn a_failed_memory_query_reads_zero_in_the_oom_report_and_fails_pool_creation() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(64 * MIB));
    dev.set_fail_mem_info(true);
    let e = alloc(&p, A, 100 * MIB).unwrap_err();
    let PoolError::OutOfMemory(oom) = e else {
        panic!("{e}")
    };
    assert_eq!((oom.device_free, oom.device_total), (0, 0));
    let e = DevicePool::with_backend(dev.backend(), PoolOptions::with_limit(64 * MIB)).unwrap_err();
    assert!(e.to_string().contains("cuMemGetInfo"), "{e}");
}

/// A region whose pointer map the host cannot allocate is given back, and the out-of-memory
/// report blames the host allocation, not the driver. (A region of 2^62 bytes, of a simulated
/// device of 2^63, needs a map of 2^49 entries of 4 bytes, 2 PiB: more than a process's address
/// space on 64-bit Linux, which gives a mapping without an address hint at most 2^47 bytes even
/// with 5-level page tables, so the host allocation fails however memory is overcommitted.)
#[test]
#[cfg_attr(
    miri,
    ignore = "asks the host for 2 PiB on purpose, which Miri reports as resource exhaustion"
)]
fn a_refused_pointer_map_is_reported_as_a_host_allocation_failure() {
    let dev = SimDevice::new(1 << 63);
    let p = pool(&dev, PoolOptions::with_limit(1 << 63));
    let e = alloc(&p, A, 1 << 62).unwrap_err();
    let PoolError::OutOfMemory(oom) = e else {
        panic!("{e}")
    };
    assert_eq!(oom.report.cause, OomCause::SourceRefused);
    let refusal = oom.driver_error.as_deref().unwrap_or("(none)");
    assert!(
        refusal.contains("host allocation") && refusal.contains("pointer map"),
        "{refusal}"
    );
    assert_eq!(dev.bytes_live(), 0, "the region was not given back");
    assert!(dev.requests().contains(&(1 << 62)), "{:?}", dev.requests());
    // An ordinary allocation still works.
    drop(alloc(&p, A, MIB).unwrap());
}

// ---- Stream caches: each thread frees into and reuses from a cache of its own ----

/// Streams that share a stream cache (200 streams, all in this thread's) each get back their own
/// block: another stream's may still be in use by that stream's work.
#[test]
fn streams_sharing_a_cache_take_only_their_own_blocks() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(256 * MIB));
    let streams: Vec<SimStream> = (10..210).map(SimStream).collect();
    let bufs: Vec<_> = streams
        .iter()
        .map(|&s| alloc(&p, s, 4096).unwrap())
        .collect();
    let addrs: Vec<u64> = bufs.iter().map(|b| b.device_address()).collect();
    for &s in &streams {
        dev.enqueue(s); // a kernel using the stream's buffer
    }
    drop(bufs);
    assert_eq!(p.stats().pending_blocks, streams.len());
    // In the order of the frees, so that a stream that took the newest block of its cache would
    // take another stream's.
    // (Held until the check below, so that no block goes back to a cache.)
    let mut again = Vec::new();
    for (&s, &at) in streams.iter().zip(&addrs) {
        let b = alloc(&p, s, 4096).unwrap();
        assert_eq!(
            b.device_address(),
            at,
            "stream {s:?} got another stream's block"
        );
        again.push(b);
    }
    let s = p.stats();
    assert_eq!((s.pending_blocks, s.allocator.num_allocs), (0, 400));
    assert!(streams.iter().all(|&s| dev.recorded(s) == 0));
    drop(again);
    p.check().unwrap();
}

/// A poll on the pool's lock queries the events of a few streams at a time, in turn, however many
/// wait for one: with 100 busy streams holding a closed block each, an allocation and a free on
/// the lock make at most 8 queries (they made 200), and once the work is done every block goes
/// back within 13 such pairs.
#[test]
fn polls_query_a_few_streams_in_turn() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(256 * MIB));
    let streams: Vec<SimStream> = (10..110).map(SimStream).collect();
    let bufs: Vec<_> = streams
        .iter()
        .map(|&s| alloc(&p, s, MIB).unwrap())
        .collect();
    for &s in &streams {
        dev.enqueue(s);
    }
    drop(bufs);
    p.trim(); // Every stream is busy: an event each.
    assert_eq!(p.stats().pending_blocks, 100);
    let queries = dev.event_queries();
    drop(alloc(&p, A, 4096).unwrap());
    let made = dev.event_queries() - queries;
    assert!((1..=8).contains(&made), "{made} event queries");
    dev.complete_all();
    for _ in 0..13 {
        drop(alloc(&p, A, 4096).unwrap());
    }
    // (A's own block waits in its queue.)
    assert_eq!(p.stats().pending_blocks, 1);
    p.check().unwrap();
}

/// An allocation that no free chunk can serve first polls every stream's events, so the blocks of
/// work already done serve it (here, with the pool at its limit, rather than a wait for every
/// pending free as for out of memory).
#[test]
fn an_allocation_the_engine_cannot_serve_polls_every_stream() {
    let dev = SimDevice::new(GIB);
    let options = PoolOptions {
        allow_growth: false,
        ..PoolOptions::with_limit(100 * MIB)
    };
    let p = pool(&dev, options);
    let streams: Vec<SimStream> = (10..110).map(SimStream).collect();
    let bufs: Vec<_> = streams
        .iter()
        .map(|&s| alloc(&p, s, MIB).unwrap())
        .collect();
    for &s in &streams {
        dev.enqueue(s);
    }
    drop(bufs);
    p.trim();
    dev.complete_all();
    let syncs = dev.event_syncs();
    let x = alloc(&p, A, 8 * MIB).unwrap();
    assert_eq!(dev.event_syncs(), syncs, "no wait: the blocks were done");
    assert_eq!(p.stats().pending_blocks, 0);
    drop(x);
    p.check().unwrap();
}

/// A stream's frees past what its cache holds go to its queue, and the stream reuses all of them
/// with no event (up to `OPEN_LIMIT` in the queue).
#[test]
fn a_full_stream_cache_sends_frees_to_the_queue() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(256 * MIB));
    let n = 16 + OPEN_LIMIT;
    let bufs: Vec<_> = (0..n).map(|_| alloc(&p, C, 4096).unwrap()).collect();
    let mut addrs: Vec<u64> = bufs.iter().map(|b| b.device_address()).collect();
    dev.enqueue(C);
    drop(bufs);
    let s = p.stats();
    assert_eq!((s.pending_blocks, s.pending_bytes), (n, n * 4096));
    let requests = dev.requests().len();
    let again: Vec<_> = (0..n).map(|_| alloc(&p, C, 4096).unwrap()).collect();
    let mut got: Vec<u64> = again.iter().map(|b| b.device_address()).collect();
    addrs.sort_unstable();
    got.sort_unstable();
    assert_eq!(got, addrs);
    assert_eq!((dev.recorded(C), dev.requests().len()), (0, requests));
    assert_eq!(p.stats().pending_blocks, 0);
    // One more free puts `OPEN_LIMIT + 1` open blocks in the queue: they get their event.
    let one_more = alloc(&p, C, 4096).unwrap();
    drop(again);
    assert_eq!(dev.recorded(C), 0);
    drop(one_more);
    assert_eq!(dev.recorded(C), 1);
    p.check().unwrap();
}

/// Frees that came for a stream cache after its oldest block before that block is stale and a
/// free into the full cache takes its place (the pool's `STALE_FREES`).
const STALE_FREES: usize = 64;

/// Allocates `bytes` on `s`, first inside a closure that holds the pool's lock: if the allocation
/// needs the lock it panics there, `on_lock` counts it, and it is made again outside.
fn alloc_counting_the_lock(
    p: &Pool,
    s: SimStream,
    bytes: usize,
    on_lock: &mut usize,
) -> DeviceBuffer<u8, SimBackend> {
    let hit = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        p.inspect_backend(|_| alloc(p, s, bytes).unwrap())
    }));
    hit.unwrap_or_else(|_| {
        *on_lock += 1;
        alloc(p, s, bytes).unwrap()
    })
}

/// A thread that cycles through more blocks than its cache holds, one at a time (here one block
/// on each of 17 streams), keeps hitting on those the cache has: a free into the full cache goes
/// to the queue while the cached blocks are recent, so one allocation per round takes the lock.
/// (Had every such free taken the place of the oldest, each block would be gone from the cache
/// by the time its stream asked again: every allocation on the lock.)
#[test]
fn a_thread_cycling_through_more_blocks_than_its_cache_holds_keeps_hitting() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(256 * MIB));
    let streams: Vec<SimStream> = (0..17).map(|i| SimStream(10 + i)).collect();
    let mut on_lock = 0;
    for round in 0..4 {
        for &s in &streams {
            if round == 0 {
                drop(alloc(&p, s, 4096).unwrap());
            } else {
                drop(alloc_counting_the_lock(&p, s, 4096, &mut on_lock));
            }
        }
    }
    assert_eq!(on_lock, 3, "allocations on the pool's lock in three rounds");
    p.check().unwrap();
}

/// A stream whose working set (16 buffers, a cacheful) moves on to a new size gets its cache back
/// once the old size's blocks are stale: within four rounds (64 frees), after which its rounds
/// are served from the cache again. (The price of keeping recent blocks for threads that cycle
/// through more than the cache holds: with a free into the full cache always taking the oldest
/// block's place, one round; with never, not at all.)
#[test]
fn a_working_set_that_moves_on_to_a_new_size_gets_its_cache_back() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(256 * MIB));
    dev.enqueue(C);
    for size in 1..=3 {
        let mut on_lock = [0; 6];
        for count in &mut on_lock {
            let set: Vec<_> = (0..16)
                .map(|_| alloc_counting_the_lock(&p, C, 4096 * size, count))
                .collect();
            drop(set);
        }
        assert_eq!(on_lock[0], 16, "size {size}: the first round misses");
        assert!(
            on_lock[..4].iter().sum::<usize>() <= 4 * 16,
            "size {size}: {on_lock:?}"
        );
        assert_eq!(
            on_lock[4..],
            [0, 0],
            "size {size}: later rounds hit ({on_lock:?})"
        );
    }
    p.check().unwrap();
}

/// A stream that allocates the same working set of more than 16 buffers every round, one of them
/// of a size of its own, takes the pool's lock for one allocation per round, whether it frees the
/// set in allocation order (a `Vec` of buffers dropped at once) or in reverse (locals): the cache
/// keeps the newest 16 frees, and an allocation that misses it leaves it alone. (With a miss that
/// moved the stream's cached blocks to its queue, as before, the first of those orders sent every
/// allocation of a round to the lock; with frees into a full cache going to the queue, the
/// second did.)
#[test]
fn a_working_set_freed_in_either_order_takes_the_lock_once_per_round() {
    for reverse in [false, true] {
        let dev = SimDevice::new(GIB);
        let p = pool(&dev, PoolOptions::with_limit(256 * MIB));
        dev.enqueue(C);
        let sizes: Vec<usize> = std::iter::once(MIB).chain([4096; 16]).collect();
        let free = |mut set: Vec<DeviceBuffer<u8, SimBackend>>| {
            if reverse {
                set.reverse();
            }
            drop(set);
        };
        for _ in 0..2 {
            free(sizes.iter().map(|&n| alloc(&p, C, n).unwrap()).collect());
        }
        let mut on_lock = 0;
        let set: Vec<_> = sizes
            .iter()
            .map(|&n| alloc_counting_the_lock(&p, C, n, &mut on_lock))
            .collect();
        assert_eq!(
            on_lock, 1,
            "allocations on the pool's lock (reverse order: {reverse})"
        );
        assert_eq!(p.stats().pending_blocks, 0);
        free(set);
        p.check().unwrap();
    }
}

/// A cache full of blocks its thread no longer asks for (of a stream it left, or of a size it no
/// longer uses) gives them up once they are stale. Until `STALE_FREES` frees came for the cache
/// after the oldest, a free into the full cache goes to its stream's queue (the cached blocks are
/// recent, and a thread that cycles through more blocks than the cache holds keeps hitting on
/// those); then it takes the oldest block's place, which goes to its own stream's queue, and the
/// new allocations are served from the cache, without the pool's lock. The old blocks still serve
/// their stream, with no event. (Without that, the cache stayed full until a trim or a full
/// engine, and every allocation and free took the pool's lock: on the default stream of a program
/// that had freed 16 large buffers, on a thread that moved on to another stream, or on one that
/// took the cache of a thread that had exited.)
#[test]
fn a_full_cache_gives_up_its_stale_blocks() {
    // (Old stream and size, new stream and size): another stream, then another size.
    for ((s0, n0), (s1, n1)) in [((C, 4096), (D, 4096)), ((C, MIB), (C, 4096))] {
        let case = format!("{s0:?}, {n0} B, then {s1:?}, {n1} B");
        let dev = SimDevice::new(GIB);
        let p = pool(&dev, PoolOptions::with_limit(256 * MIB));
        dev.enqueue(s0);
        let old: Vec<_> = (0..16).map(|_| alloc(&p, s0, n0).unwrap()).collect();
        drop(old);
        assert_eq!(p.stats().pending_blocks, 16, "{case}: the cache is full");
        // On the lock: the frees find the cache full of recent blocks, and go to the queue.
        for _ in 0..STALE_FREES - 16 {
            drop(alloc(&p, s1, n1).unwrap());
        }
        let hit = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            p.inspect_backend(|_| drop(alloc(&p, s1, n1).unwrap()))
        }));
        assert!(hit.is_err(), "{case}: given up before they were stale");
        // Stale now: the next free takes the place of the oldest block.
        for _ in 0..16 {
            drop(alloc(&p, s1, n1).unwrap());
        }
        // Served from the cache, and freed into it: no pool lock, which the closure holds (taking
        // it would panic).
        for _ in 0..3 {
            p.inspect_backend(|_| drop(alloc(&p, s1, n1).unwrap()));
        }
        assert_eq!(p.stats().pending_blocks, 17, "{case}");
        // The old blocks still serve their stream (from the cache, and the oldest from its
        // queue), open: the stream is still busy.
        let requests = dev.requests().len();
        let again: Vec<_> = (0..16).map(|_| alloc(&p, s0, n0).unwrap()).collect();
        assert_eq!(dev.requests().len(), requests, "{case}: a new region");
        assert_eq!(
            p.stats().pending_blocks,
            1,
            "{case}: only the new block is left"
        );
        assert_eq!(dev.recorded(s0), 0, "{case}: an event");
        drop(again);
        p.check().unwrap();
    }
}

/// The pool lives while it has a handle or a buffer, and goes with the last of them, whichever
/// that is: a buffer is counted in the cache of the thread that allocated it, which holds the pool
/// for it. Also after the handles went and a buffer gave out a new one, which allocates on another
/// stream; and after allocations and frees that leave a cache with no buffer (and the pool's
/// reference).
#[test]
fn the_pool_goes_with_its_last_handle_or_buffer() {
    on_both_paths(|sa, sb| {
        let dev = SimDevice::new(GIB);
        // The handle goes first.
        let p = pool(&dev, PoolOptions::with_limit(256 * MIB));
        for _ in 0..3 {
            drop(alloc(&p, sa, 4096).unwrap());
        }
        let x = alloc(&p, sa, 4096).unwrap();
        drop(p);
        assert!(dev.bytes_live() > 0, "the buffer keeps the pool");
        drop(x);
        assert_eq!(dev.bytes_live(), 0, "the last buffer let the pool go");
        // The buffer goes first.
        let p = pool(&dev, PoolOptions::with_limit(256 * MIB));
        drop(alloc(&p, sa, 4096).unwrap());
        assert!(dev.bytes_live() > 0);
        drop(p);
        assert_eq!(dev.bytes_live(), 0, "the last handle let the pool go");
        // A buffer gives out a handle once the others went.
        let p = pool(&dev, PoolOptions::with_limit(256 * MIB));
        let x = alloc(&p, sa, 4096).unwrap();
        drop(p);
        let p = x.pool();
        let y = alloc(&p, sb, MIB).unwrap();
        drop(p);
        drop(x);
        assert!(dev.bytes_live() > 0, "y keeps the pool");
        assert!(y.pool().stats().allocator.bytes_in_use >= MIB);
        drop(y);
        assert_eq!(dev.bytes_live(), 0);
    });
}

/// Threads dropping a pool's last buffer and its last handle at once let it go once, whichever
/// comes last (a double drop would crash or fail the device's count; a leak keeps its region).
#[test]
fn the_last_buffer_and_the_last_handle_dropped_at_once() {
    let dev = SimDevice::new(GIB);
    let rounds = if cfg!(miri) { 20 } else { 2000 };
    for round in 0..rounds {
        let s = [A, C][round % 2];
        let p = pool(&dev, PoolOptions::with_limit(256 * MIB));
        let x = alloc(&p, s, 4096).unwrap();
        let start = std::sync::Barrier::new(2);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                start.wait();
                drop(x);
            });
            start.wait();
            drop(p);
        });
        assert_eq!(dev.bytes_live(), 0, "round {round}: the pool was kept");
    }
}

/// An allocation that fails only for its alignment (the engine's largest free chunk is large
/// enough) still waits for the blocks in stream caches before it reports out of memory.
#[test]
fn out_of_memory_for_alignment_waits_for_cached_blocks() {
    on_both_paths(|sa, sb| {
        let dev = SimDevice::new(GIB);
        let p = pool(
            &dev,
            PoolOptions {
                allow_growth: false,
                ..PoolOptions::with_limit(16 * MIB)
            },
        );
        let y = alloc(&p, sb, 4 * MIB).unwrap();
        let h1 = alloc(&p, A, 256).unwrap();
        let f = alloc(&p, A, 4 * MIB + 256).unwrap();
        let h2 = alloc(&p, A, 8 * MIB - 512).unwrap();
        let base = y.device_address();
        assert_eq!(base % 4096, 0);
        assert_eq!(f.device_address(), base + 4 * MIB as u64 + 256);
        assert_eq!(
            h2.device_address() + h2.block_size() as u64,
            base + 16 * MIB as u64
        );
        drop(f);
        p.trim(); // `A` is idle: `f` goes back to the engine
                  // Free: 4 MiB + 256 bytes, starting 256 bytes past a 4 KiB boundary.
        assert_eq!(p.stats().allocator.largest_free_block, 4 * MIB + 256);
        let at = y.device_address();
        dev.enqueue(sb);
        drop(y);
        // 4 MiB at 4 KiB alignment: only `y`'s block, once `sb`'s work is done.
        // SAFETY: simulated memory is never read.
        let page = unsafe { p.alloc::<Page>(&sa, 1024) }.unwrap();
        assert_eq!(page.device_address(), at);
        assert_eq!(dev.event_syncs(), 1);
        drop((h1, h2, page));
        p.check().unwrap();
    });
}

/// A stream's cached blocks that another stream's miss moves into its queue count towards
/// `OPEN_LIMIT` like the frees that go there: a stream that frees many buffers while other streams
/// miss with no free chunk gets its event at the `OPEN_LIMIT + 1`st open block in its queue, not
/// never.
#[test]
fn blocks_moved_from_a_stream_cache_count_towards_the_open_limit() {
    on_both_paths(|sa, sb| {
        let dev = SimDevice::new(GIB);
        let p = pool(&dev, PoolOptions::with_limit(GIB));
        let n = 4 * 16;
        let mut bufs: Vec<_> = (0..n).map(|_| alloc(&p, sa, 4096).unwrap()).collect();
        dev.enqueue(sa); // a kernel using them: `sa` stays busy
        let mut big = Vec::new();
        while !bufs.is_empty() {
            // 16 frees: as many as a stream cache holds.
            drop(bufs.split_off(bufs.len() - 16));
            // `sb` misses and the engine has no free chunk for it (the pool grows): other
            // streams' open blocks large enough are closed, and the caches emptied into the queues.
            let want = p.stats().allocator.largest_free_block + MIB;
            big.push(alloc(&p, sb, want).unwrap());
        }
        assert_eq!(p.stats().pending_blocks, n);
        assert!(
            dev.recorded(sa) >= 1,
            "{n} blocks of {sa:?} in its queue, none of them ordered by an event"
        );
        drop(big);
        p.synchronize();
        p.check().unwrap();
    });
}

/// A buffer holds the handle it was allocated with, even when its block comes from the stream's
/// cache, freed there through another handle of the same stream (a borrowed wrapper of an owned
/// stream, say): a buffer keeps the stream it was allocated on alive, and a synchronisation of the
/// pool lets every other handle go (the remedy the docs give before a borrowed stream is
/// destroyed). With the other handle in the buffer, the stream's owner could go while the buffer
/// lives, and the free put a destroyed stream's handle, whose id a new stream of any context can
/// get, in the cache, where a hit skips the stream check.
#[test]
fn a_cache_hit_gives_the_buffer_the_handle_it_was_allocated_on() {
    let dev = SimDevice::new(GIB);
    let p = counting_pool(&dev, 64 * MIB);
    let owned = Counted(C, Arc::new(()));
    let borrowed = Counted(C, Arc::new(())); // another handle of the same stream
    drop(counted_alloc(&p, &borrowed, MIB)); // into `C`'s cache
    let buf = counted_alloc(&p, &owned, MIB); // a hit
    assert_eq!(p.stats().pending_blocks, 0);
    p.synchronize();
    assert_eq!(
        Arc::strong_count(&owned.1) - 1,
        1,
        "the buffer holds no handle of the stream it was allocated on"
    );
    assert_eq!(
        Arc::strong_count(&borrowed.1) - 1,
        0,
        "the pool or the buffer holds the other handle after a synchronisation"
    );
    drop(buf);
    assert_eq!(Arc::strong_count(&owned.1) - 1, 1, "the cache's");
}

/// A cached block goes only to its own stream, not to another stream with the same id: here
/// stream 3 of another context, whose id is the same as `C`'s on the counting back end (as CUDA's
/// null stream has one handle in every context), and which the pool refuses as a home stream.
#[test]
fn a_cached_block_does_not_go_to_another_contexts_stream_with_its_id() {
    let dev = SimDevice::new(GIB);
    let p = counting_pool(&dev, 64 * MIB);
    let ours = Counted(C, Arc::new(()));
    let theirs = Counted(SimStream::in_context(1, 3), Arc::new(()));
    drop(counted_alloc(&p, &ours, MIB)); // into `C`'s cache
    assert_eq!(p.stats().pending_blocks, 1);
    // SAFETY: simulated memory is never read.
    let err = unsafe { p.alloc::<u8>(&theirs, MIB) }.unwrap_err();
    assert!(err.to_string().contains("another context"), "{err}");
    assert_eq!(p.stats().pending_blocks, 1, "the cached block stays");
    let again = counted_alloc(&p, &ours, MIB);
    assert_eq!(p.stats().pending_blocks, 0, "its own stream takes it");
    drop(again);
}

// ---- Randomized and multi-threaded tests over many streams sharing the stream caches ----

/// A freed block: its range, home stream, the work items that may use it (on its home stream and
/// on others), and whether an allocation has overlapped it since.
struct Freed {
    lo: u64,
    hi: u64,
    works: Vec<(SimStream, u64)>,
    reused: bool,
}

/// Forty streams, 38 of them with a stream cache (the test thread's, which they all share), a
/// small limit, and random allocations (some 4 KiB-aligned), frees (some after uses on other
/// streams), partial completions, trims and synchronisations. On every allocation, every other
/// stream's work on the block is completed or ordered before the new owner's; live buffers never
/// overlap; the statistics agree with a model (allocations counted, pending blocks between the
/// freed blocks not reused whose work is unfinished and all the freed blocks not reused, bytes in
/// use = live + pending); out of memory leaves nothing pending; after a trim only busy streams'
/// blocks are pending; a stream's blocks freed since its last event (or since it was idle) never
/// exceed `OPEN_LIMIT` plus what its stream cache can hold.
#[test]
fn random_ops_over_many_streams_sharing_caches() {
    let dev = SimDevice::new(GIB);
    let limit = if cfg!(miri) { 8 * MIB } else { 32 * MIB };
    let p = pool(&dev, PoolOptions::with_limit(limit));
    let cached = 3u64..41;
    let streams: Vec<SimStream> = [1, 2].into_iter().chain(cached).map(SimStream).collect();
    let mut live: Vec<AnyBuf<Page>> = Vec::new();
    let mut freed: Vec<Freed> = Vec::new();
    // Per stream: blocks freed since its last event or since it was last seen idle, not reused.
    let mut open: Vec<Vec<(u64, u64)>> = vec![Vec::new(); streams.len()];
    let mut last_recorded: Vec<u64> = vec![0; streams.len()];
    // Frees `b` after a kernel on its home stream (and, first, a use on stream `other`).
    let free = |b: AnyBuf<Page>,
                other: Option<SimStream>,
                freed: &mut Vec<Freed>,
                open: &mut [Vec<(u64, u64)>]| {
        let home = b.home();
        let mut works = Vec::new();
        if let Some(other) = other {
            works.push((other, b.simulate_use(other)));
        }
        works.push((home, dev.enqueue(home)));
        let (lo, hi) = b.range();
        drop(b);
        freed.push(Freed {
            lo,
            hi,
            works,
            reused: false,
        });
        open[streams.iter().position(|&x| x == home).unwrap()].push((lo, hi));
    };
    let mut num_allocs = 0u64;
    let (mut ooms, mut cross, mut same, mut hits_over_limit) = (0, 0, 0, 0);
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let ops = if cfg!(miri) { 1_000 } else { 12_000 };
    for op in 0..ops {
        let r = rng.next();
        let si = (r >> 8) as usize % streams.len();
        let s = streams[si];
        match r % 20 {
            0..=8 => {
                let pages = (r >> 14) % 8 == 0;
                let size = if (r >> 18) % 64 == 0 {
                    0
                } else {
                    let size = 256usize << ((r >> 20) % 13);
                    size + (r >> 32) as usize % size
                };
                let got = if pages {
                    // SAFETY: simulated memory is never read.
                    unsafe { p.alloc::<Page>(&s, size.div_ceil(4096)) }.map(AnyBuf::Pages)
                } else {
                    alloc(&p, s, size).map(AnyBuf::Bytes)
                };
                match got {
                    Ok(b) => {
                        num_allocs += 1;
                        let (lo, hi) = b.range();
                        let next_item = (s, dev.queued(s) + 1);
                        for f in freed.iter_mut().filter(|f| f.lo < hi && lo < f.hi) {
                            f.reused = true;
                            for &(fs, item) in &f.works {
                                if fs == s {
                                    same += 1;
                                } else {
                                    cross += 1;
                                    assert!(
                                        dev.completed(fs) >= item
                                            || dev.ordered_before((fs, item), next_item),
                                        "op {op}: {s:?} got [{lo:#x},{hi:#x}) while item {item} \
                                         of {fs:?} on [{:#x},{:#x}) may still run",
                                        f.lo,
                                        f.hi
                                    );
                                }
                            }
                        }
                        for l in &live {
                            let (llo, lhi) = l.range();
                            assert!(hi <= llo || lhi <= lo, "op {op}: overlapping live buffers");
                        }
                        for o in &mut open {
                            o.retain(|&(flo, fhi)| hi <= flo || fhi <= lo);
                        }
                        live.push(b);
                    }
                    Err(PoolError::OutOfMemory(_)) => {
                        ooms += 1;
                        // Out of memory only after waiting for every pending free.
                        let st = p.stats();
                        assert_eq!((st.pending_blocks, st.pending_bytes), (0, 0), "op {op}");
                    }
                    Err(e) => panic!("{e}"),
                }
            }
            9..=14 if !live.is_empty() => {
                let b = live.swap_remove((r >> 24) as usize % live.len());
                let other =
                    ((r >> 40) % 10 == 0).then(|| streams[(r >> 44) as usize % streams.len()]);
                free(b, other, &mut freed, &mut open);
            }
            15..=16 => {
                let (done, queued) = (dev.completed(s), dev.queued(s));
                dev.complete_to(s, done + (r >> 40) % (queued - done + 1));
            }
            17 => {
                // Only busy streams' blocks stay pending after a trim.
                p.trim();
                let busy: Vec<&Freed> = freed
                    .iter()
                    .filter(|f| !f.reused)
                    .filter(|f| {
                        let home = f.works.last().unwrap().0;
                        dev.completed(home) < dev.queued(home)
                    })
                    .collect();
                let st = p.stats();
                assert!(
                    st.pending_blocks <= busy.len(),
                    "op {op}: {} pending after a trim, {} blocks of busy streams",
                    st.pending_blocks,
                    busy.len()
                );
            }
            18 if (r >> 30) % 4 == 0 => {
                p.synchronize();
                let st = p.stats();
                assert_eq!((st.pending_blocks, st.pending_bytes), (0, 0), "op {op}");
            }
            19 => {
                // A burst: a stream frees many small buffers at once (past its cache and
                // `OPEN_LIMIT`), while its work runs.
                let k = 16 + (r >> 24) as usize % 64;
                let mut burst = Vec::new();
                for _ in 0..k {
                    match alloc(&p, s, 256 + (r >> 32) as usize % 4096) {
                        Ok(b) => {
                            num_allocs += 1;
                            let (lo, hi) = (
                                b.device_address(),
                                b.device_address() + b.block_size() as u64,
                            );
                            for f in freed.iter_mut().filter(|f| f.lo < hi && lo < f.hi) {
                                f.reused = true;
                                for &(fs, item) in &f.works {
                                    assert!(
                                        fs == s
                                            || dev.completed(fs) >= item
                                            || dev
                                                .ordered_before((fs, item), (s, dev.queued(s) + 1)),
                                        "op {op}: {s:?} got a block of {fs:?} still in use"
                                    );
                                }
                            }
                            for o in &mut open {
                                o.retain(|&(flo, fhi)| hi <= flo || fhi <= lo);
                            }
                            burst.push(AnyBuf::Bytes(b));
                        }
                        Err(PoolError::OutOfMemory(_)) => ooms += 1,
                        Err(e) => panic!("{e}"),
                    }
                }
                // Sixteen frees at a time (what a stream cache holds), each group followed, now
                // and then, by another stream's miss with no free chunk, which drains the caches.
                while !burst.is_empty() {
                    for b in burst.split_off(burst.len().saturating_sub(16)) {
                        free(b, None, &mut freed, &mut open);
                    }
                    if (r >> 50) % 2 == 0 {
                        let other = streams[(si + 1) % streams.len()];
                        let want = p.stats().allocator.largest_free_block + 4096;
                        match alloc(&p, other, want) {
                            Ok(b) => {
                                num_allocs += 1;
                                let (lo, hi) = (
                                    b.device_address(),
                                    b.device_address() + b.block_size() as u64,
                                );
                                for f in freed.iter_mut().filter(|f| f.lo < hi && lo < f.hi) {
                                    f.reused = true;
                                    for &(fs, item) in &f.works {
                                        assert!(
                                            fs == other
                                                || dev.completed(fs) >= item
                                                || dev.ordered_before(
                                                    (fs, item),
                                                    (other, dev.queued(other) + 1)
                                                ),
                                            "op {op}: {other:?} got a block of {fs:?} in use"
                                        );
                                    }
                                }
                                for o in &mut open {
                                    o.retain(|&(flo, fhi)| hi <= flo || fhi <= lo);
                                }
                                free(AnyBuf::Bytes(b), None, &mut freed, &mut open);
                            }
                            Err(PoolError::OutOfMemory(_)) => ooms += 1,
                            Err(e) => panic!("{e}"),
                        }
                    }
                }
            }
            _ => {}
        }
        freed.retain(|f| !f.reused || f.works.iter().any(|&(fs, i)| dev.completed(fs) < i));
        if live.len() > 48 {
            for b in live.drain(24..) {
                free(b, None, &mut freed, &mut open);
            }
        }
        // The open-block bound: a stream's blocks freed since its last event (or since it was idle,
        // when the pool may return them without one) are in its queue, at most `OPEN_LIMIT` of
        // them, or in the thread's stream cache, which holds 16 blocks of all its streams.
        let mut over = 0;
        for (i, &s) in streams.iter().enumerate() {
            let rec = dev.recorded(s);
            if rec != last_recorded[i] || dev.completed(s) == dev.queued(s) {
                last_recorded[i] = rec;
                open[i].clear();
            }
            let excess = open[i].len().saturating_sub(OPEN_LIMIT);
            if s.0 <= 2 {
                assert_eq!(
                    excess,
                    0,
                    "op {op}: {s:?} has {} open blocks",
                    open[i].len()
                );
            } else {
                hits_over_limit += usize::from(excess > 0);
                over += excess;
            }
        }
        assert!(
            over <= 16,
            "op {op}: {over} more open blocks beyond OPEN_LIMIT than the cache holds"
        );
        // Statistics against the model.
        let st = p.stats();
        assert_eq!(st.allocator.num_allocs, num_allocs, "op {op}");
        let unreused: Vec<&Freed> = freed.iter().filter(|f| !f.reused).collect();
        let must: usize = unreused
            .iter()
            .filter(|f| f.works.iter().any(|&(fs, i)| dev.completed(fs) < i))
            .count();
        assert!(
            must <= st.pending_blocks && st.pending_blocks <= unreused.len(),
            "op {op}: pending {} not in [{must}, {}]",
            st.pending_blocks,
            unreused.len()
        );
        let live_bytes: u64 = live.iter().map(|b| b.range().1 - b.range().0).sum();
        assert_eq!(
            st.allocator.bytes_in_use as u64,
            live_bytes + st.pending_bytes as u64,
            "op {op}"
        );
        if op % 256 == 0 {
            p.check().unwrap();
        }
    }
    eprintln!(
        "ooms {ooms}, cross {cross}, same {same}, over-limit streams {hits_over_limit}, device syncs {}, \
         event syncs {}",
        dev.device_syncs(),
        dev.event_syncs()
    );
    assert!(ooms > 0 && cross > 0 && same > 0 && hits_over_limit > 0 && dev.event_syncs() > 0);
    drop(live);
    p.check_err().unwrap();
    p.synchronize();
    let st = p.stats();
    assert_eq!((st.allocator.bytes_in_use, st.pending_blocks), (0, 0));
    p.check().unwrap();
    drop(p);
    assert_eq!(dev.bytes_live(), 0);
}

/// Six threads allocating and freeing on streams with stream caches (two pairs share a stream), one
/// on stream 2 (the pool's lock), and one calling trim, synchronize and stats at random; a quarter
/// of the frees go through a mailbox, so that a thread frees another's buffers into that thread's
/// stream cache while it allocates from it: live buffers never overlap, the statistics stay
/// consistent, and once the threads are done everything goes back.
#[test]
fn threads_on_cached_streams_with_trims_never_overlap() {
    let steps = if cfg!(miri) { 100 } else { 4000 };
    let dev = SimDevice::new(4 * GIB);
    let p = pool(&dev, PoolOptions::with_limit(4 * MIB));
    let streams = [3, 3, 4, 5, 5, 7, 2];
    // Buffers one thread left for another to free.
    let mailbox: Mutex<Vec<DeviceBuffer<u8, SimBackend>>> = Mutex::default();
    // Live buffers `lo -> hi`, and freed blocks whose work may still run: `(lo, hi, stream, item)`.
    type Tracked = (BTreeMap<u64, u64>, Vec<(u64, u64, u64, u64)>);
    let live: Arc<Mutex<Tracked>> = Arc::default();
    let done = std::sync::atomic::AtomicUsize::new(0);
    let ooms = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for (t, &sid) in streams.iter().enumerate() {
            let (p, live, dev, done, ooms, mailbox) = (&p, &live, &dev, &done, &ooms, &mailbox);
            scope.spawn(move || {
                let stream = SimStream(sid);
                let mut rng = Rng(0x2545_f491_4f6c_dd1d ^ (t as u64 * 0x9E37));
                /// Counts the thread as done even if it panics, so that the trimming thread stops.
                struct Done<'a>(&'a std::sync::atomic::AtomicUsize);
                impl Drop for Done<'_> {
                    fn drop(&mut self) {
                        self.0.fetch_add(1, std::sync::atomic::Ordering::Release);
                    }
                }
                let _done = Done(done);
                let mut held: Vec<DeviceBuffer<u8, SimBackend>> = Vec::new();
                for _ in 0..steps {
                    let rng = rng.next();
                    if held.len() < 24 && rng % 3 != 0 {
                        let size = if (rng >> 56) % 16 == 0 {
                            1 + (rng >> 20) as usize % MIB
                        } else {
                            1 + (rng >> 20) as usize % (256 << ((rng >> 50) % 4))
                        };
                        let b = match alloc(p, stream, size) {
                            Ok(b) => b,
                            Err(PoolError::OutOfMemory(_)) => {
                                ooms.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                                continue;
                            }
                            Err(e) => panic!("{e}"),
                        };
                        let (lo, hi) = (
                            b.device_address(),
                            b.device_address() + b.block_size() as u64,
                        );
                        let mut tracked = live.lock().unwrap();
                        let (map, freed) = &mut *tracked;
                        if let Some((&s, &e)) = map.range(..hi).next_back() {
                            assert!(e <= lo, "[{lo:#x},{hi:#x}) overlaps [{s:#x},{e:#x})");
                        }
                        map.insert(lo, hi);
                        for &(flo, fhi, fs, item) in freed.iter() {
                            assert!(
                                hi <= flo
                                    || fhi <= lo
                                    || fs == sid
                                    || dev.completed(SimStream(fs)) >= item,
                                "{stream:?} got [{lo:#x},{hi:#x}) while item {item} of stream {fs} \
                                 on [{flo:#x},{fhi:#x}) may still run"
                            );
                        }
                        freed.retain(|&(_, _, fs, item)| dev.completed(SimStream(fs)) < item);
                        drop(tracked);
                        held.push(b);
                    } else if !held.is_empty() {
                        let mut b = held.swap_remove((rng >> 32) as usize % held.len());
                        if (rng >> 44) % 4 == 0 {
                            // Leave it to another thread, and free one left by another.
                            let mut m = mailbox.lock().unwrap();
                            m.push(b);
                            b = m.swap_remove(0);
                        }
                        let home = *b.home_stream();
                        let mut tracked = live.lock().unwrap();
                        let (lo, hi) = (
                            b.device_address(),
                            b.device_address() + b.block_size() as u64,
                        );
                        tracked.0.remove(&lo);
                        let item = dev.enqueue(home); // a kernel still using it
                        drop(b);
                        tracked.1.push((lo, hi, home.0, item));
                    }
                    if (rng >> 40) % 48 == 0 {
                        dev.complete(stream);
                    }
                }
                for b in held {
                    let mut tracked = live.lock().unwrap();
                    tracked.0.remove(&b.device_address());
                    drop(b);
                }
            });
        }
        let (p, done) = (&p, &done);
        scope.spawn(move || {
            let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
            while done.load(std::sync::atomic::Ordering::Acquire) < streams.len() {
                let rng = rng.next();
                match rng % 8 {
                    0 => {
                        p.trim();
                    }
                    1 => {
                        p.synchronize();
                    }
                    _ => {
                        let s = p.stats();
                        assert!(s.pending_bytes <= s.allocator.bytes_in_use);
                        assert!(s.allocator.bytes_in_use <= s.allocator.bytes_reserved);
                    }
                }
                std::thread::yield_now();
            }
        });
    });
    for b in mailbox.into_inner().unwrap() {
        live.lock().unwrap().0.remove(&b.device_address());
    }
    assert!(live.lock().unwrap().0.is_empty());
    // The streams' work is done (their last kernels still run: a synchronisation waits for them).
    p.synchronize();
    let s = p.stats();
    assert_eq!(
        (s.allocator.bytes_in_use, s.pending_blocks, s.pending_bytes),
        (0, 0, 0)
    );
    p.check().unwrap();
    p.check_err().unwrap();
    eprintln!("ooms {}", ooms.into_inner());
    drop(p);
    assert_eq!(dev.bytes_live(), 0);
    assert_eq!(dev.allocations_live(), 0);
}

/// An allocation whose alignment no free chunk can meet polls every stream's events too, as one
/// no free chunk is large enough for does: here a free chunk of exactly the request's size is
/// misaligned for it, and the blocks of four streams whose work is done (aligned, and of the
/// size) would serve it, but the partial poll looks at four other streams, still busy. Without
/// the full poll the pool, at its limit, waits for every pending free as for out of memory (it
/// would grow, with growth allowed).
#[test]
fn an_allocation_no_free_chunk_can_align_polls_every_stream() {
    #[repr(C, align(1048576))]
    struct Aligned([u8; MIB]);
    let dev = SimDevice::new(GIB);
    let options = PoolOptions {
        allow_growth: false,
        ..PoolOptions::with_limit(16 * MIB)
    };
    let p = pool(&dev, options);
    let aligned = |s: SimStream| {
        // SAFETY: simulated memory is never read.
        unsafe { p.alloc::<Aligned>(&s, 1) }
    };
    let p0 = alloc(&p, A, 256).unwrap();
    let m = alloc(&p, A, MIB).unwrap();
    let p2 = alloc(&p, A, 256).unwrap();
    assert_ne!(m.device_address() % MIB as u64, 0, "the hole is misaligned");
    let streams: Vec<SimStream> = (10..18).map(SimStream).collect();
    let bufs: Vec<_> = streams.iter().map(|&s| aligned(s).unwrap()).collect();
    // Fill the rest of the pool, so that the hole `m` leaves is the only free chunk.
    let mut fill = Vec::new();
    let mut size = 8 * MIB;
    while size >= 256 {
        match alloc(&p, A, size) {
            Ok(b) => fill.push(b),
            Err(_) => size /= 2,
        }
    }
    drop(m);
    p.trim(); // A is idle: `m`'s block goes back, a free chunk of 1 MiB.
    for &s in &streams {
        dev.enqueue(s);
    }
    drop(bufs);
    p.trim(); // Every stream is busy: an event each.
    assert_eq!(p.stats().pending_blocks, 8);
    // The streams the next partial poll looks at last are done.
    for &s in &streams[4..] {
        dev.complete(s);
    }
    let syncs = dev.event_syncs();
    let x = aligned(B).unwrap();
    assert_eq!(
        dev.event_syncs(),
        syncs,
        "no wait: four streams' blocks were done"
    );
    drop((x, p0, p2, fill));
    p.check().unwrap();
}

/// A stream's own cached blocks serve its larger request once they are back in the engine, rather
/// than the pool growing: a miss that finds no free chunk empties the caches into the queues, and
/// the stream's own blocks there (open, of an idle stream) go back to the engine at once, as they
/// did when a miss moved them to the queue first.
#[test]
fn a_miss_on_a_full_engine_reuses_its_own_streams_cached_blocks_before_growing() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(256 * MIB));
    // Two 1 MiB blocks fill the first region; freed into the cache, they make the 2 MiB that the
    // next request needs.
    drop((alloc(&p, C, MIB).unwrap(), alloc(&p, C, MIB).unwrap()));
    assert_eq!(dev.requests(), vec![2 * MIB]);
    assert_eq!(p.stats().pending_blocks, 2, "in the cache");
    let x = alloc(&p, C, 2 * MIB).unwrap();
    assert_eq!(dev.requests(), vec![2 * MIB], "the pool grew");
    assert_eq!(p.stats().pending_blocks, 0);
    drop(x);
    p.check().unwrap();
}

/// The same at the pool's limit: the stream's own cached blocks serve it without the
/// out-of-memory wait for every pending free (here, for another stream's unfinished work).
#[test]
fn a_miss_at_the_limit_reuses_its_own_streams_cached_blocks_without_a_wait() {
    let dev = SimDevice::new(GIB);
    let options = PoolOptions {
        allow_growth: false,
        ..PoolOptions::with_limit(4 * MIB)
    };
    let p = pool(&dev, options);
    let (a, b) = (alloc(&p, C, MIB).unwrap(), alloc(&p, C, MIB).unwrap());
    let y = alloc(&p, D, 2 * MIB).unwrap();
    dev.enqueue(D); // a kernel using `y`: D stays busy
    drop(y);
    drop((a, b)); // Into the cache, with D's block.
    let x = alloc(&p, C, 2 * MIB).unwrap();
    assert_eq!(
        (dev.event_syncs(), dev.device_syncs(), dev.completed(D)),
        (0, 0, 0),
        "waited for D's work"
    );
    drop(x);
    p.synchronize();
    p.check().unwrap();
}

/// Another stream's cached blocks that its thread no longer asks for serve a larger request once
/// back in the engine, rather than the pool growing: C frees two 1 MiB blocks (into the cache) and
/// goes on with a smaller request, which the engine serves; D then wants 2 MiB, which only those
/// two blocks together can give (C is idle). (When C's miss moved its cached blocks to its queue,
/// it closed them, and they were back in the engine by then.)
#[test]
fn another_streams_stale_cached_blocks_serve_a_miss_before_the_pool_grows() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(256 * MIB));
    let (a, b) = (alloc(&p, C, MIB).unwrap(), alloc(&p, C, MIB).unwrap());
    // The second region: 1 MiB of it left free.
    let c = (alloc(&p, C, 2 * MIB).unwrap(), alloc(&p, C, MIB).unwrap());
    assert_eq!(dev.requests(), vec![2 * MIB, 4 * MIB]);
    drop((a, b)); // Into the cache.
    let small = alloc(&p, C, 4096).unwrap(); // A miss the engine serves, from the second region.
    assert_eq!(dev.requests(), vec![2 * MIB, 4 * MIB]);
    let x = alloc(&p, D, 2 * MIB).unwrap();
    assert_eq!(dev.requests(), vec![2 * MIB, 4 * MIB], "the pool grew");
    drop((c, small, x));
    p.check().unwrap();
}

/// Threads that come and go (their stream caches handed on to the next ones), freeing each other's
/// buffers on four streams that are busy now and then, in a pool small enough that misses find the
/// engine full: no two live buffers overlap, and once all are freed nothing is left in use or
/// pending, and every region goes back to the driver.
#[test]
fn threads_that_come_and_go_freeing_each_others_buffers_lose_nothing() {
    let dev = SimDevice::new(4 * GIB);
    let p = pool(&dev, PoolOptions::with_limit(8 * MIB));
    let shared: Mutex<Vec<DeviceBuffer<u8, SimBackend>>> = Mutex::default();
    let live: Mutex<BTreeMap<u64, u64>> = Mutex::default();
    for wave in 0..40u64 {
        std::thread::scope(|scope| {
            for t in 0..4u64 {
                let (p, dev, shared, live) = (&p, &dev, &shared, &live);
                scope.spawn(move || {
                    let mut rng = Rng(0x1234_5678 ^ (wave * 131 + t));
                    let mut held = Vec::new();
                    for _ in 0..200 {
                        let r = rng.next();
                        let s = SimStream(3 + (r >> 8) % 4);
                        match r % 6 {
                            0..=2 => {
                                let size = 256 << ((r >> 16) % 12);
                                if let Ok(b) = alloc(p, s, size) {
                                    let (lo, hi) = (
                                        b.device_address(),
                                        b.device_address() + b.block_size() as u64,
                                    );
                                    let mut l = live.lock().unwrap();
                                    if let Some((_, &h)) = l.range(..hi).next_back() {
                                        assert!(h <= lo, "overlap");
                                    }
                                    l.insert(lo, hi);
                                    drop(l);
                                    held.push(b);
                                }
                            }
                            3 if !held.is_empty() => {
                                let b: DeviceBuffer<u8, SimBackend> =
                                    held.swap_remove((r >> 20) as usize % held.len());
                                live.lock().unwrap().remove(&b.device_address());
                                if (r >> 30) % 2 == 0 {
                                    dev.enqueue(*b.home_stream());
                                }
                                drop(b);
                            }
                            4 if !held.is_empty() => {
                                let b = held.swap_remove((r >> 20) as usize % held.len());
                                shared.lock().unwrap().push(b);
                            }
                            5 => {
                                let mut sh = shared.lock().unwrap();
                                if let Some(b) = sh.pop() {
                                    drop(sh);
                                    live.lock().unwrap().remove(&b.device_address());
                                    drop(b);
                                }
                                dev.complete(SimStream(3 + (r >> 40) % 4));
                            }
                            _ => {}
                        }
                    }
                    for b in held {
                        live.lock().unwrap().remove(&b.device_address());
                        drop(b);
                    }
                });
            }
        });
    }
    for b in shared.lock().unwrap().drain(..) {
        live.lock().unwrap().remove(&b.device_address());
        drop(b);
    }
    p.synchronize();
    let s = p.stats();
    assert_eq!(
        (s.allocator.bytes_in_use, s.pending_blocks, s.pending_bytes),
        (0, 0, 0)
    );
    p.check().unwrap();
    p.check_err().unwrap();
    drop(p);
    assert_eq!(dev.bytes_live(), 0);
}
