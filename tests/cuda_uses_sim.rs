//! The use protocol (a buffer used on streams other than its home stream) on the simulated device,
//! whose streams record what waits for what: every use of a block must be complete, or ordered
//! before its next owner's work, when the block is handed out again.

use bfc_alloc::cuda::{
    DeviceBuffer, DeviceOom, DevicePool, PoolError, PoolOptions, SimBackend, SimDevice, SimStream,
    GRANULE,
};

const MIB: usize = 1 << 20;

type Pool = DevicePool<SimBackend>;
type Buf = DeviceBuffer<u8, SimBackend>;

#[path = "common/sim_bufs.rs"]
mod sim_bufs;
use sim_bufs::AnyBuf;

const A: SimStream = SimStream(1);
const B: SimStream = SimStream(2);
const C: SimStream = SimStream(3);
/// A stream of another context.
const X: SimStream = SimStream::in_context(1, 7);

fn setup() -> (SimDevice, Pool) {
    setup_with_limit(256 * MIB)
}

/// A pool over a 1 GiB simulated device that may take `limit` bytes of it.
fn setup_with_limit(limit: usize) -> (SimDevice, Pool) {
    let dev = SimDevice::new(1 << 30);
    let pool = DevicePool::with_backend(dev.backend(), PoolOptions::with_limit(limit)).unwrap();
    (dev, pool)
}

fn alloc(pool: &Pool, s: SimStream, bytes: usize) -> Buf {
    // SAFETY: simulated memory is never read.
    unsafe { pool.alloc::<u8>(&s, bytes) }.unwrap()
}

/// Checks that every use in `history` of a block overlapping `addr..addr + size` (the block of a
/// later owner) is done or ordered before item `k` of `s`, a use by that owner.
fn check_after_history(
    dev: &SimDevice,
    history: &[Use],
    (addr, size): (u64, usize),
    (s, k): (SimStream, u64),
    what: &str,
) {
    for u in history {
        if u.addr < addr + size as u64 && addr < u.addr + u.size as u64 {
            assert!(
                dev.completed(u.stream) >= u.item || dev.ordered_before((u.stream, u.item), (s, k)),
                "{what}: {u:?} may overlap the next owner's item {k} on {s:?}"
            );
        }
    }
}

/// Frees `buf` with the stream waits that order its uses before the free failing
/// (`cuStreamWaitEvent`).
fn free_with_a_failed_stream_wait(dev: &SimDevice, buf: Buf) {
    dev.set_fail_finish_uses(true);
    drop(buf);
    dev.set_fail_finish_uses(false);
}

/// Whether item `k` of `s` is done or ordered before the next item queued on `next`.
fn before_next(dev: &SimDevice, (s, k): (SimStream, u64), next: SimStream) -> bool {
    dev.completed(s) >= k || dev.ordered_before((s, k), (next, dev.queued(next) + 1))
}

#[test]
fn the_home_stream_waits_for_a_use_on_another_stream_before_reusing_the_block() {
    let (dev, pool) = setup();
    let buf = alloc(&pool, A, MIB);
    let addr = buf.device_address();
    let used = buf.simulate_use(B);
    assert!(
        !before_next(&dev, (B, used), A),
        "the use is neither done nor ordered yet"
    );
    drop(buf);
    // The home stream takes its own freed block back at once (stream order protects it), so it
    // must already wait for the use on B.
    let again = alloc(&pool, A, MIB);
    assert_eq!(again.device_address(), addr, "the block was not reused");
    assert!(
        before_next(&dev, (B, used), A),
        "the next owner's work on A may run during the use on B"
    );
    assert!(
        dev.completed(B) < used,
        "ordered, not waited for on the host"
    );
    drop(again);
    pool.check().unwrap();
}

#[test]
fn a_use_on_another_stream_comes_after_the_home_stream_s_work_and_before_later_uses() {
    let (dev, pool) = setup();
    let buf = alloc(&pool, A, MIB);
    let written = dev.enqueue(A); // a kernel writing the buffer on its home stream
    let on_b = buf.simulate_use(B);
    assert!(dev.ordered_before((A, written), (B, on_b)));
    // The next use on yet another stream, and the next on the home stream, come after it.
    let on_c = buf.simulate_use(C);
    assert!(dev.ordered_before((B, on_b), (C, on_c)));
    let on_a = buf.simulate_use(A);
    assert!(dev.ordered_before((B, on_b), (A, on_a)));
    assert!(dev.ordered_before((C, on_c), (A, on_a)));
    // Nothing was waited for on the host.
    assert_eq!((dev.completed(A), dev.completed(B)), (0, 0));
}

#[test]
fn zeroing_waits_for_the_last_use_on_another_stream() {
    let (dev, pool) = setup();
    let mut buf = alloc(&pool, A, MIB);
    let read = buf.simulate_use(B); // a copy reading the buffer on B
    buf.zero().unwrap();
    let memset = dev.queued(A);
    assert!(
        dev.ordered_before((B, read), (A, memset)),
        "the memset may overwrite the buffer while B still reads it"
    );
    // Without a use elsewhere the memset is queued on A with no wait.
    let mut other = alloc(&pool, A, MIB);
    other.zero().unwrap();
    assert_eq!(dev.queued(A), memset + 1);
}

#[test]
fn a_failed_wait_before_zeroing_queues_nothing() {
    let (dev, pool) = setup();
    let mut buf = alloc(&pool, A, MIB);
    buf.simulate_use(B);
    dev.set_fail_use_ordering(true);
    let queued = dev.queued(A);
    assert!(buf.zero().is_err());
    assert_eq!(
        dev.queued(A),
        queued,
        "a memset was queued without its wait"
    );
}

#[test]
fn a_use_whose_end_is_not_an_event_is_waited_for_on_the_host() {
    let (dev, pool) = setup();
    dev.set_unmanaged_sync(true);
    let buf = alloc(&pool, A, MIB);
    let used = buf.simulate_use(B);
    assert!(dev.completed(B) >= used, "the use was not waited for");
    drop(buf);
    let again = alloc(&pool, C, MIB);
    assert!(before_next(&dev, (B, used), C));
    drop(again);
}

#[test]
fn a_use_whose_host_wait_was_skipped_makes_the_free_wait_for_the_device() {
    let (dev, pool) = setup();
    dev.set_unmanaged_sync(true);
    let buf = alloc(&pool, A, MIB);
    // The context holds a recorded error: cudarc's guard skips its wait for the use.
    dev.set_context_error(0, true);
    let used = buf.simulate_use(B);
    assert!(dev.completed(B) < used, "the guard's wait was not skipped");
    let syncs = dev.device_syncs();
    drop(buf);
    assert_eq!(dev.device_syncs(), syncs + 1);
    assert!(
        dev.completed(B) >= used,
        "the free did not wait for the use"
    );
}

/// Checks that item `k` of `s` is done or ordered before the last item queued on `A`.
fn before_last_on_a(dev: &SimDevice, (s, k): (SimStream, u64), what: &str) {
    let memset = dev.queued(A);
    assert!(
        dev.completed(s) >= k || dev.ordered_before((s, k), (A, memset)),
        "{what}: the memset on A may overwrite the buffer while item {k} on {s:?} still uses it"
    );
}

#[test]
fn zeroing_waits_for_uses_that_no_event_orders() {
    // A use in another context whose guard skipped its wait.
    let (dev, pool) = setup();
    let mut buf = alloc(&pool, A, MIB);
    dev.set_context_error(X.context(), true);
    let read = buf.simulate_use(X);
    buf.zero().unwrap();
    before_last_on_a(&dev, (X, read), "another context");
    // A use waited for on the host, whose guard skipped that.
    let (dev, pool) = setup();
    dev.set_unmanaged_sync(true);
    let mut buf = alloc(&pool, A, MIB);
    dev.set_context_error(0, true);
    let read = buf.simulate_use(B);
    buf.zero().unwrap();
    before_last_on_a(&dev, (B, read), "unmanaged");
    // A use that could not be ordered.
    let (dev, pool) = setup();
    let mut buf = alloc(&pool, A, MIB);
    buf.simulate_use(B);
    dev.set_fail_use_ordering(true);
    let read = buf.simulate_use(C);
    dev.set_fail_use_ordering(false);
    buf.zero().unwrap();
    before_last_on_a(&dev, (C, read), "unordered");
    // The same, on the home stream through a guard.
    let (dev, pool) = setup();
    let buf = alloc(&pool, A, MIB);
    dev.set_fail_use_ordering(true);
    let read = buf.simulate_use(C);
    dev.set_fail_use_ordering(false);
    buf.simulate_use(A);
    before_last_on_a(&dev, (C, read), "a home-stream use after an unordered one");
}

#[test]
fn a_use_in_another_context_that_cannot_be_waited_for_strands_the_block() {
    let (dev, pool) = setup();
    let buf = alloc(&pool, A, MIB);
    let addr = buf.device_address();
    dev.set_context_error(X.context(), true);
    let used = buf.simulate_use(X);
    dev.set_fail_context_sync(X.context(), true);
    drop(buf);
    assert!(dev.completed(X) < used);
    assert_eq!(pool.stats().stranded_bytes, MIB);
    assert!(!pool.take_errors().is_empty());
    // The pool's own device synchronisation does not reach the other context: the block is
    // never handed out again.
    pool.synchronize();
    for s in [A, B, C] {
        let b = alloc(&pool, s, MIB);
        assert_ne!(b.device_address(), addr, "a stranded block was handed out");
    }
}

#[test]
fn a_use_in_another_context_is_waited_for_even_when_its_guard_skips_the_wait() {
    let (dev, pool) = setup();
    let buf = alloc(&pool, A, MIB);
    let written = dev.enqueue(A);
    // The other context holds a recorded error: cudarc's guard skips its wait for the use.
    dev.set_context_error(X.context(), true);
    let used = buf.simulate_use(X);
    assert!(
        dev.completed(A) >= written,
        "the home stream was not waited for"
    );
    assert!(dev.completed(X) < used, "the guard's wait was not skipped");
    drop(buf);
    assert!(
        dev.completed(X) >= used,
        "the block went back while the use in the other context may still run"
    );
    let again = alloc(&pool, A, MIB);
    assert!(before_next(&dev, (X, used), A));
    drop(again);
}

/// A buffer used in two other contexts: the free waits for each context whose guard skipped
/// its wait, not only the first context the buffer was used in.
#[test]
fn uses_in_two_other_contexts_are_each_waited_for_at_the_free() {
    const Y: SimStream = SimStream::in_context(2, 7);
    let (dev, pool) = setup();
    let buf = alloc(&pool, A, MIB);
    let in_x = buf.simulate_use(X);
    // The second context holds a recorded error: the guard's wait for the use there is skipped.
    dev.set_context_error(Y.context(), true);
    let in_y = buf.simulate_use(Y);
    assert!(dev.completed(Y) < in_y, "the guard's wait was not skipped");
    drop(buf);
    assert!(dev.completed(X) >= in_x);
    assert!(
        dev.completed(Y) >= in_y,
        "the block went back while the use in the second other context may still run"
    );
}

#[test]
fn an_unmarked_end_of_use_makes_the_free_wait_for_the_device() {
    let (dev, pool) = setup();
    let buf = alloc(&pool, A, MIB);
    // The home context holds a recorded error: the guard's event record is skipped.
    dev.set_context_error(0, true);
    let used = buf.simulate_use(B);
    let syncs = dev.device_syncs();
    drop(buf);
    assert_eq!(dev.device_syncs(), syncs + 1);
    assert!(dev.completed(B) >= used);
    assert!(
        !pool.take_errors().is_empty(),
        "the reason was not reported"
    );
}

#[test]
fn failed_ordering_makes_the_free_wait_for_the_device() {
    let (dev, pool) = setup();
    let buf = alloc(&pool, A, MIB);
    dev.set_fail_use_ordering(true);
    let used = buf.simulate_use(B);
    dev.set_fail_use_ordering(false);
    drop(buf);
    assert!(
        dev.completed(B) >= used,
        "the free did not wait for the use"
    );
    assert!(!pool.take_errors().is_empty());
}

/// A stream that could not be readied for a use (its context not made current) leaves the use
/// not known to be ordered: the failure is reported, and the free waits for the device.
#[test]
fn a_failed_prepare_use_makes_the_free_wait_for_the_device() {
    let (dev, pool) = setup();
    let buf = alloc(&pool, A, MIB);
    dev.set_fail_prepare_use(true);
    let used = buf.simulate_use(B);
    dev.set_fail_prepare_use(false);
    let syncs = dev.device_syncs();
    drop(buf);
    assert_eq!(dev.device_syncs(), syncs + 1, "the free did not wait");
    assert!(dev.completed(B) >= used);
    let errors = pool.take_errors();
    assert!(
        errors
            .iter()
            .any(|e| e.to_string().contains("cuCtxSetCurrent")),
        "{errors:?}"
    );
}

/// What the docs ask of a user before taking a context's recorded error out (the pool cannot see
/// a use whose end cudarc skipped once the error is gone): synchronise its streams.
fn settle(dev: &SimDevice, streams: &[SimStream]) {
    loop {
        let before: Vec<u64> = streams.iter().map(|&s| dev.completed(s)).collect();
        for &s in streams {
            dev.complete(s);
        }
        if streams.iter().map(|&s| dev.completed(s)).eq(before) {
            return;
        }
    }
}

/// One use of a block: its address range and the item of work that used it.
#[derive(Clone, Copy, Debug)]
struct Use {
    addr: u64,
    size: usize,
    stream: SimStream,
    item: u64,
}

/// The random tests' generator, from a fixed seed: `next(n)` is in `0..n`.
fn xorshift(seed: u64) -> impl FnMut(usize) -> usize {
    let mut rng = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    move |n| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % n as u64) as usize
    }
}

#[test]
fn random_uses_never_overlap_the_next_owner() {
    let streams = [A, B, C, SimStream(4), X];
    let home_context = [A, B, C, SimStream(4)];
    let sizes = [256, 4096, 100_000, MIB, 3 * MIB];
    // (Fewer under Miri, which is slow.)
    let (seeds, steps) = if cfg!(miri) { (3, 600) } else { (200, 3000) };
    for seed in 1..=seeds {
        let (dev, pool) = setup();
        let mut next = xorshift(seed);
        let mut live: Vec<(Buf, Vec<Use>)> = Vec::new();
        // Uses of freed blocks, kept until they complete.
        let mut history: Vec<Use> = Vec::new();
        // Which contexts hold a recorded error: [the pool's, X's].
        let mut errors = [false, false];
        for step in 0..steps {
            match next(12) {
                0..=2 if live.len() < 48 => {
                    let home = streams[next(4)];
                    let buf = alloc(&pool, home, sizes[next(sizes.len())]);
                    let (addr, size) = (buf.device_address(), buf.block_size());
                    history.retain(|u| dev.completed(u.stream) < u.item);
                    let next_item = (home, dev.queued(home) + 1);
                    let what = format!("seed {seed} step {step}, a new block");
                    check_after_history(&dev, &history, (addr, size), next_item, &what);
                    live.push((buf, Vec::new()));
                }
                3..=5 if !live.is_empty() => {
                    let i = next(live.len());
                    let stream = streams[next(streams.len())];
                    let (buf, uses) = &mut live[i];
                    let item = buf.simulate_use(stream);
                    let block = (buf.device_address(), buf.block_size());
                    let what = format!("seed {seed} step {step}, a use");
                    check_after_history(&dev, &history, block, (stream, item), &what);
                    uses.push(Use {
                        addr: buf.device_address(),
                        size: buf.block_size(),
                        stream,
                        item,
                    });
                }
                6 if !live.is_empty() => {
                    let i = next(live.len());
                    let (buf, uses) = &mut live[i];
                    if buf.zero().is_ok() {
                        let home = *buf.home_stream();
                        let block = (buf.device_address(), buf.block_size());
                        let what = format!("seed {seed} step {step}, a memset");
                        check_after_history(&dev, &history, block, (home, dev.queued(home)), &what);
                        uses.push(Use {
                            addr: buf.device_address(),
                            size: buf.block_size(),
                            stream: home,
                            item: dev.queued(home),
                        });
                    }
                }
                7..=8 if !live.is_empty() => {
                    let (buf, uses) = live.swap_remove(next(live.len()));
                    drop(buf);
                    history.extend(uses);
                }
                9 => {
                    let s = streams[next(streams.len())];
                    let to = dev.completed(s) + 1 + next(4) as u64;
                    dev.complete_to(s, to);
                }
                10 => match next(4) {
                    0 => dev.set_fail_use_ordering(next(2) == 0),
                    1 => dev.set_unmanaged_sync(next(2) == 0),
                    k => {
                        let (i, ctx, streams) = if k == 2 {
                            (1, X.context(), &[X][..])
                        } else {
                            (0, 0, &home_context[..])
                        };
                        let on = next(2) == 0;
                        if errors[i] && !on {
                            settle(&dev, streams);
                        }
                        errors[i] = on;
                        dev.set_context_error(ctx, on);
                    }
                },
                _ => {
                    if next(8) == 0 {
                        pool.trim();
                    }
                }
            }
        }
        drop(live);
        dev.complete_all();
        pool.synchronize();
        pool.check().unwrap();
    }
}

/// An element type aligned beyond the pool's 256-byte granule.
#[repr(C, align(8192))]
struct Page([u8; 8192]);

/// A live buffer of bytes or of pages.
type Owned = AnyBuf<Page>;

/// A live buffer and the uses of its block so far.
struct Live {
    buf: Owned,
    uses: Vec<Use>,
}

impl Live {
    /// Notes item `item` of `stream` as a use of the block.
    fn used(&mut self, stream: SimStream, item: u64) {
        let (addr, size) = self.buf.block();
        self.uses.push(Use {
            addr,
            size,
            stream,
            item,
        });
    }
}

/// `len` values of `T` on `s`; out of memory is the only error expected.
fn try_alloc<T>(
    pool: &Pool,
    s: SimStream,
    len: usize,
    what: &str,
) -> Result<DeviceBuffer<T, SimBackend>, Box<DeviceOom>> {
    // SAFETY: simulated memory is never read.
    match unsafe { pool.alloc::<T>(&s, len) } {
        Ok(buf) => Ok(buf),
        Err(PoolError::OutOfMemory(oom)) => Err(oom),
        Err(e) => panic!("{what}: an allocation failed other than for memory: {e}"),
    }
}

/// Checks the report of a request for `requested` bytes at `align` refused for memory: it agrees
/// with the pool's counters, and no free block could have served the request.
fn check_oom(pool: &Pool, oom: &DeviceOom, requested: usize, align: usize, what: &str) {
    let stats = pool.stats();
    assert_eq!(
        (oom.in_use, oom.pending_bytes, oom.stranded_bytes),
        (
            stats.allocator.bytes_in_use,
            stats.pending_bytes,
            stats.stranded_bytes
        ),
        "{what}: the report disagrees with the stats: {oom}"
    );
    // (A free chunk this large holds an aligned block of the request, its start being a granule
    // multiple.)
    let fits = requested.next_multiple_of(GRANULE) + align.max(GRANULE) - GRANULE;
    assert!(
        oom.largest_free_block < fits,
        "{what}: refused while a free block fits: {oom}"
    );
}

/// Checks the pool against the live buffers after a step: no two overlap, the engine's invariants
/// hold, the bytes in use are those of the live, pending and stranded blocks, every allocation is
/// counted, the stranded bytes are `stranded` (blocks strand only at their free, and never come
/// back), and the engine rejected no free.
fn check_pool(pool: &Pool, live: &[Live], allocs: u64, stranded: usize, what: &str) {
    let mut blocks: Vec<(u64, usize)> = live.iter().map(|l| l.buf.block()).collect();
    blocks.sort_unstable();
    for w in blocks.windows(2) {
        assert!(
            w[0].0 + w[0].1 as u64 <= w[1].0,
            "{what}: live blocks {:x?} and {:x?} overlap",
            w[0],
            w[1]
        );
    }
    if let Err(e) = pool.check() {
        panic!("{what}: {e:?}");
    }
    let stats = pool.stats();
    let in_buffers: usize = blocks.iter().map(|b| b.1).sum();
    assert_eq!(
        stats.allocator.bytes_in_use,
        in_buffers + stats.pending_bytes + stats.stranded_bytes,
        "{what}: bytes in use are not live + pending + stranded: {stats:?}"
    );
    assert_eq!(stats.bytes_in_buffers(), in_buffers, "{what}: {stats:?}");
    assert_eq!(stats.allocator.num_allocs, allocs, "{what}: allocations");
    assert_eq!(stats.stranded_bytes, stranded, "{what}: stranded bytes");
    for e in pool.take_errors() {
        assert!(
            !matches!(e, PoolError::Free(_)),
            "{what}: the engine rejected a free: {e}"
        );
    }
}

/// Switches every injected failure off, settling the streams first (as the docs ask before a
/// context's recorded error is taken out).
fn no_failures(dev: &SimDevice, streams: &[SimStream]) {
    for ctx in [0, X.context()] {
        dev.set_fail_context_sync(ctx, false);
    }
    settle(dev, streams);
    for ctx in [0, X.context()] {
        dev.set_context_error(ctx, false);
    }
    dev.set_fail_use_ordering(false);
    dev.set_fail_new_event(false);
    dev.set_fail_mem_info(false);
    dev.set_fail_prepare_use(false);
    dev.set_unmanaged_sync(false);
    dev.set_fail_event_record(false);
    dev.set_fail_stream_query(false);
    dev.set_fail_event_queries(false);
    dev.set_fail_synchronize(false);
    dev.set_fail_finish_uses(false);
    dev.set_refuse_above(usize::MAX);
    dev.set_used_by_others(0);
}

/// Random allocations (bytes, and pages aligned to 8192), uses on streams of the pool's context
/// and of another, launches, memsets, frees, trims and synchronisations, while every failure the
/// simulator can inject is switched on and off at random. After every step: each earlier use of
/// a block handed out again is done or ordered before its new owner's first work, and
/// [`check_pool`] holds. At the end, with the failures off, every block goes back, and the pool's
/// drop leaves the device no memory unless blocks were stranded.
#[test]
fn random_uses_under_failing_driver_calls_keep_the_pool_consistent() {
    let home_context = [A, B, C, SimStream(4)];
    let streams = [A, B, C, SimStream(4), X];
    let sizes = [256, 4096, 100_000, MIB, 3 * MIB, 7 * MIB];
    // Across all seeds: allocations refused, blocks handed out while an earlier use of them may
    // still run, and seeds that stranded blocks or not.
    let (mut ooms, mut contested, mut stranding_seeds) = (0, 0, 0);
    // (About half a second in the test profile; fewer seeds under Miri, which is slow.)
    const SEEDS: u64 = if cfg!(miri) { 12 } else { 200 };
    const STEPS: usize = 600;
    for seed in 1..=SEEDS {
        let (dev, pool) = setup_with_limit(64 * MIB);
        let mut next = xorshift(seed);
        let mut live: Vec<Live> = Vec::new();
        // Uses of freed blocks, kept until they complete.
        let mut history: Vec<Use> = Vec::new();
        // Which contexts hold a recorded error: [the pool's, X's].
        let mut errors = [false, false];
        let (mut allocs, mut stranded) = (0, 0);
        for step in 0..STEPS {
            let what = format!("seed {seed} step {step}");
            match next(16) {
                0..=3 if live.len() < 24 => {
                    let home = home_context[next(4)];
                    let (got, requested, align) = if next(4) == 0 {
                        let len = 1 + next(3);
                        let got = try_alloc::<Page>(&pool, home, len, &what).map(Owned::Pages);
                        (got, len * size_of::<Page>(), align_of::<Page>())
                    } else {
                        let bytes = sizes[next(sizes.len())];
                        let got = try_alloc::<u8>(&pool, home, bytes, &what).map(Owned::Bytes);
                        (got, bytes, 1)
                    };
                    match got {
                        Err(oom) => {
                            ooms += 1;
                            check_oom(&pool, &oom, requested, align, &what);
                        }
                        Ok(buf) => {
                            allocs += 1;
                            let (addr, size) = buf.block();
                            assert_eq!(addr % align as u64, 0, "{what}: misaligned");
                            assert!(size >= requested, "{what}: a block too small");
                            history.retain(|u| dev.completed(u.stream) < u.item);
                            let overlaps = |u: &Use| {
                                u.addr < addr + size as u64 && addr < u.addr + u.size as u64
                            };
                            if history.iter().any(overlaps) {
                                contested += 1;
                            }
                            // The new owner's first work: a kernel writing the buffer.
                            let first = dev.enqueue(home);
                            let new_block = format!("{what}, a new block");
                            let owner = (home, first);
                            check_after_history(&dev, &history, (addr, size), owner, &new_block);
                            let mut l = Live {
                                buf,
                                uses: Vec::new(),
                            };
                            l.used(home, first);
                            live.push(l);
                        }
                    }
                }
                4..=6 if !live.is_empty() => {
                    let i = next(live.len());
                    let l = &mut live[i];
                    let used = match &l.buf {
                        // Sometimes two uses at once (two threads sharing the buffer).
                        Owned::Bytes(b) if next(8) == 0 => {
                            let (overlap, b_ends_first) = OVERLAPS[next(OVERLAPS.len())];
                            let (on_b, on_c) = uses_on_b_and_c(b, overlap, b_ends_first);
                            vec![(B, on_b), (C, on_c)]
                        }
                        buf => {
                            let stream = streams[next(streams.len())];
                            vec![(stream, buf.simulate_use(stream))]
                        }
                    };
                    let a_use = format!("{what}, a use");
                    for (stream, item) in used {
                        check_after_history(&dev, &history, l.buf.block(), (stream, item), &a_use);
                        l.used(stream, item);
                    }
                }
                7 if !live.is_empty() => {
                    let i = next(live.len());
                    let l = &mut live[i];
                    let home = l.buf.home();
                    let queued = dev.queued(home);
                    let item = match &mut l.buf {
                        Owned::Bytes(b) if next(2) == 0 => match b.zero() {
                            Ok(()) => Some(dev.queued(home)),
                            Err(_) => None,
                        },
                        buf => Some(buf.simulate_launch()),
                    };
                    if let Some(item) = item {
                        let home_work = format!("{what}, work on the home stream");
                        check_after_history(
                            &dev,
                            &history,
                            l.buf.block(),
                            (home, item),
                            &home_work,
                        );
                        l.used(home, item);
                    } else {
                        assert_eq!(
                            dev.queued(home),
                            queued,
                            "{what}: a failed memset queued work"
                        );
                    }
                }
                8..=10 if !live.is_empty() => {
                    let l = live.swap_remove(next(live.len()));
                    let size = l.buf.block().1;
                    drop(l.buf);
                    history.extend(l.uses);
                    let now = pool.stats().stranded_bytes;
                    assert!(
                        now == stranded || now == stranded + size,
                        "{what}: a free stranded {} B, not its block's {size}",
                        now - stranded
                    );
                    stranded = now;
                }
                11 => {
                    let s = streams[next(streams.len())];
                    let to = dev.completed(s) + 1 + next(4) as u64;
                    dev.complete_to(s, to);
                }
                12 | 13 => {
                    let on = next(3) == 0;
                    match next(15) {
                        14 => dev.set_fail_mem_info(on),
                        13 => dev.set_fail_new_event(on),
                        12 => dev.set_fail_prepare_use(on),
                        0 => dev.set_fail_use_ordering(on),
                        1 => dev.set_unmanaged_sync(on),
                        2 => dev.set_fail_event_record(on),
                        3 => dev.set_fail_stream_query(on),
                        4 => dev.set_fail_event_queries(on),
                        // (Rarely: with these, a free may strand its block for good.)
                        5 => dev.set_fail_synchronize(on && next(4) == 0),
                        6 => dev.set_fail_finish_uses(on),
                        7 => dev.set_fail_context_sync(next(2) as u32, on && next(4) == 0),
                        8 => dev.set_refuse_above(if on { MIB } else { usize::MAX }),
                        9 => dev.set_used_by_others(if on { (1 << 30) - 40 * MIB } else { 0 }),
                        k => {
                            let (i, ctx, streams) = if k == 10 {
                                (1, X.context(), &[X][..])
                            } else {
                                (0, 0, &home_context[..])
                            };
                            if errors[i] && !on {
                                settle(&dev, streams);
                            }
                            errors[i] = on;
                            dev.set_context_error(ctx, on);
                        }
                    }
                }
                14 => {
                    let before = dev.bytes_live();
                    let released = pool.trim();
                    assert!(
                        dev.bytes_live() + released <= before,
                        "{what}: trim released {released} B the device still holds"
                    );
                }
                15 => {
                    pool.synchronize();
                }
                _ => {}
            }
            check_pool(&pool, &live, allocs, stranded, &what);
        }
        // With the failures off, every block but the stranded ones must come back.
        no_failures(&dev, &streams);
        drop(live);
        dev.complete_all();
        pool.synchronize();
        let what = format!("seed {seed} at the end");
        check_pool(&pool, &[], allocs, stranded, &what);
        let stats = pool.stats();
        assert_eq!(
            stats.allocator.bytes_in_use, stats.stranded_bytes,
            "{what}: blocks still pending: {stats:?}"
        );
        drop(pool);
        if stats.stranded_bytes == 0 {
            assert_eq!(dev.bytes_live(), 0, "{what}: the device still holds memory");
        } else {
            stranding_seeds += 1;
            assert!(dev.bytes_live() >= stats.stranded_bytes, "{what}");
        }
    }
    // The failures the test is for happened: otherwise it checks less than it claims.
    assert!(ooms > 0, "no allocation was refused");
    assert!(
        contested > 0,
        "no block was handed out while an earlier use could run"
    );
    assert!(
        (1..SEEDS).contains(&stranding_seeds),
        "all or no seeds stranded blocks"
    );
}

// ---- The protocol's edge cases, and the simulator kept no stronger than CUDA (each kills a mutant) ----

/// `zero` queues nothing when the wait for the home context, which an unordered use needs, fails.
#[test]
fn a_failed_context_wait_before_zeroing_queues_nothing() {
    let (dev, pool) = setup();
    let mut buf = alloc(&pool, A, MIB);
    dev.set_fail_use_ordering(true);
    buf.simulate_use(B); // not ordered by events
    dev.set_fail_use_ordering(false);
    dev.set_fail_context_sync(0, true);
    assert!(buf.zero().is_err(), "the failed wait was not reported");
    assert!(
        dev.memsets().is_empty(),
        "a memset was queued without its wait"
    );
    dev.set_fail_context_sync(0, false);
}

/// Another context is waited for at the free only if it holds an error (the guard waited for the
/// use itself): later, unrelated work there is not waited for.
#[test]
fn another_context_without_an_error_is_not_waited_for_at_the_free() {
    let (dev, pool) = setup();
    let buf = alloc(&pool, A, MIB);
    let used = buf.simulate_use(X);
    assert!(dev.completed(X) >= used, "the guard waits for the use");
    let later = dev.enqueue(X);
    drop(buf);
    assert!(
        dev.completed(X) < later,
        "the free waited for unrelated work"
    );
}

/// A home-stream use whose wait for the last use on another stream failed is reported, and the
/// free waits for the device.
#[test]
fn a_failed_wait_before_a_home_stream_use_makes_the_free_wait_for_the_device() {
    let (dev, pool) = setup();
    let buf = alloc(&pool, A, MIB);
    buf.simulate_use(B);
    dev.set_fail_use_ordering(true);
    buf.simulate_use(A);
    dev.set_fail_use_ordering(false);
    let syncs = dev.device_syncs();
    drop(buf);
    assert_eq!(dev.device_syncs(), syncs + 1);
    assert!(
        !pool.take_errors().is_empty(),
        "the failure was not reported"
    );
}

/// A skipped end of use (its context holds an error) queues no event record.
#[test]
fn a_skipped_end_of_use_records_nothing() {
    let (dev, pool) = setup();
    let buf = alloc(&pool, A, MIB);
    dev.set_context_error(0, true);
    let used = buf.simulate_use(B);
    assert_eq!(
        (dev.queued(B), dev.recorded(B)),
        (used, 0),
        "the skipped record was queued"
    );
    dev.set_context_error(0, false);
    dev.complete_all();
    drop(buf);
}

/// `ordered_before` follows a wait only from the items queued after it, and only to the items
/// before the event it waits for.
#[test]
fn ordered_before_follows_only_the_waits_before_an_item() {
    let (dev, pool) = setup();
    let buf = alloc(&pool, A, MIB);
    let w1 = dev.enqueue(A);
    let b1 = dev.enqueue(B);
    let used = buf.simulate_use(B); // B waits, after b1, for an event recorded after w1
    let w2 = dev.enqueue(A);
    assert!(dev.ordered_before((A, w1), (B, used)));
    assert!(dev.ordered_before((A, w1), (A, w2)));
    assert!(
        !dev.ordered_before((A, w1), (B, b1)),
        "b1 was queued before the wait"
    );
    assert!(
        !dev.ordered_before((A, w2), (B, used)),
        "w2 was queued after the event"
    );
    assert!(!dev.ordered_before((A, w2), (A, w1)));
}

/// Completing a stream up to an item it has passed undoes nothing.
#[test]
fn complete_to_never_undoes_completed_work() {
    let (dev, _pool) = setup();
    for _ in 0..3 {
        dev.enqueue(A);
    }
    dev.complete(A);
    dev.complete_to(A, 1);
    assert_eq!(dev.completed(A), 3);
}

/// A device-wide synchronisation (`cuCtxSynchronize`) covers the pool's context only.
#[test]
fn a_device_synchronisation_does_not_reach_other_contexts() {
    let (dev, pool) = setup();
    let elsewhere = dev.enqueue(X);
    let buf = alloc(&pool, A, MIB);
    free_with_a_failed_stream_wait(&dev, buf); // the pool waits for the device
    assert_eq!(dev.device_syncs(), 1);
    assert!(
        dev.completed(X) < elsewhere,
        "the device sync reached another context"
    );
}

/// The simulator's failed stream wait still waits for another context first, as the CUDA back
/// end's protocol does: otherwise the pool's device sync (which does not reach that context) would
/// let the block go to another stream while the use there may run.
#[test]
fn a_failed_stream_wait_still_waits_for_another_context() {
    let (dev, pool) = setup();
    let buf = alloc(&pool, A, 2 * MIB);
    let addr = buf.device_address();
    dev.set_context_error(X.context(), true);
    let used = buf.simulate_use(X); // the guard's wait is skipped
    free_with_a_failed_stream_wait(&dev, buf);
    let again = alloc(&pool, B, 2 * MIB);
    assert_eq!(again.device_address(), addr, "the block was not reused");
    assert!(
        before_next(&dev, (X, used), B),
        "the block went to B while the use on X may still run"
    );
}

/// A failed stream wait at the free of a buffer used on another stream of its context: the wait
/// is not queued (as in CUDA, the protocol stops at the failing call), and the pool falls back to
/// waiting for the device before the block goes to another stream.
#[test]
fn a_failed_stream_wait_for_a_same_context_use_falls_back_to_the_device() {
    // The simulator queues nothing for the failed wait: with the device wait failing too, the
    // home stream is not ordered after the use.
    let (dev, pool) = setup();
    let buf = alloc(&pool, A, 2 * MIB);
    let used = buf.simulate_use(B);
    let marks = dev.recorded(A);
    dev.set_fail_finish_uses(true);
    dev.set_fail_synchronize(true);
    drop(buf);
    dev.set_fail_finish_uses(false);
    dev.set_fail_synchronize(false);
    assert_eq!(
        dev.recorded(A),
        marks,
        "a mark was recorded after the failed wait"
    );
    assert!(
        !before_next(&dev, (B, used), A),
        "the failed stream wait was queued"
    );
    assert_eq!(pool.take_errors().len(), 2);

    // The pool's fallback: the device wait orders the block's reuse on another stream.
    let (dev, pool) = setup();
    let buf = alloc(&pool, A, 2 * MIB);
    let addr = buf.device_address();
    let used = buf.simulate_use(B);
    free_with_a_failed_stream_wait(&dev, buf);
    assert_eq!(dev.device_syncs(), 1);
    let again = alloc(&pool, C, 2 * MIB);
    assert_eq!(again.device_address(), addr, "the block was not reused");
    assert!(
        before_next(&dev, (B, used), C),
        "the block went to C while the use on B may still run"
    );
}

/// Waiting for another context leaves the home context's streams alone.
#[test]
fn waiting_for_another_context_does_not_complete_the_home_context() {
    let (dev, pool) = setup();
    let unrelated = dev.enqueue(B);
    let buf = alloc(&pool, A, MIB);
    dev.set_context_error(X.context(), true);
    let used = buf.simulate_use(X); // the guard's wait is skipped
    drop(buf); // waits for X's context
    assert!(dev.completed(X) >= used);
    assert!(
        dev.completed(B) < unrelated,
        "waiting for X's context completed B"
    );
    dev.set_context_error(X.context(), false);
}

/// Waiting for an event completes what its stream waited for first, as the device would.
#[test]
fn waiting_for_an_event_completes_what_it_waits_for() {
    let (dev, pool) = setup();
    let buf = alloc(&pool, A, MIB);
    let used = buf.simulate_use(B);
    drop(buf); // A waits for the use on B; the block is open on A
    pool.synchronize(); // an event on busy A, waited for
    assert_eq!(dev.completed(A), dev.queued(A));
    assert!(
        dev.completed(B) >= used,
        "A completed before the use it waits for"
    );
}

/// After uses waited for on the host only (no end-of-use event was ever recorded), work on the
/// home stream makes no event wait: a failing wait cannot fail it.
#[test]
fn zeroing_after_host_waited_uses_makes_no_event_wait() {
    let (dev, pool) = setup();
    dev.set_unmanaged_sync(true);
    let mut buf = alloc(&pool, A, MIB);
    buf.simulate_use(B); // waited for by its guard
    dev.set_fail_use_ordering(true);
    assert!(
        buf.zero().is_ok(),
        "zeroing waited for an event never recorded"
    );
    dev.set_fail_use_ordering(false);
    assert_eq!(dev.memsets().len(), 1);
}

/// Waiting for an event completes its stream up to the event only, and forces only the waits
/// queued before it: a wait queued right after the event does not run another stream.
#[test]
fn waiting_for_an_event_forces_only_the_waits_before_it() {
    let (dev, pool) = setup();
    let x = alloc(&pool, B, MIB);
    dev.enqueue(B);
    drop(x);
    pool.trim(); // B is busy: an event, the last item on B
    let event = dev.queued(B);
    let buf = alloc(&pool, A, MIB);
    let w1 = dev.enqueue(A);
    let used = buf.simulate_use(B); // B waits, right after the event, for A's work
    pool.synchronize(); // waits for B's event
    assert_eq!(dev.completed(B), event);
    assert!(dev.completed(A) < w1, "the wait after the event was forced");
    assert!(dev.completed(B) < used);
    drop(buf);
}

/// Uses of `buf` on B and C that overlap (two threads using one buffer, each on its own stream),
/// or not; the first (on B) ends first or last. Returns their items.
fn uses_on_b_and_c(buf: &Buf, overlap: bool, b_ends_first: bool) -> (u64, u64) {
    let on_b = buf.begin_use(&B);
    let b = on_b.item();
    let (on_b, on_c) = if overlap {
        (Some(on_b), buf.begin_use(&C))
    } else {
        drop(on_b);
        (None, buf.begin_use(&C))
    };
    let c = on_c.item();
    if b_ends_first {
        drop(on_b);
        drop(on_c);
    } else {
        drop(on_c);
        drop(on_b);
    }
    (b, c)
}

const OVERLAPS: [(bool, bool); 3] = [(true, true), (true, false), (false, true)];

/// Uses on two other streams at once: the free waits for both, whichever ends last.
#[test]
fn uses_on_two_other_streams_at_once_both_come_before_the_next_owner() {
    for (overlap, b_ends_first) in OVERLAPS {
        let what = format!("overlap: {overlap}, B ends first: {b_ends_first}");
        let (dev, pool) = setup();
        let buf = alloc(&pool, A, MIB);
        let addr = buf.device_address();
        let (b, c) = uses_on_b_and_c(&buf, overlap, b_ends_first);
        drop(buf);
        let again = alloc(&pool, A, MIB);
        assert_eq!(
            again.device_address(),
            addr,
            "{what}: the block was not reused"
        );
        assert!(
            before_next(&dev, (B, b), A),
            "{what}: the next owner may overlap the use on B"
        );
        assert!(
            before_next(&dev, (C, c), A),
            "{what}: the next owner may overlap the use on C"
        );
        assert_eq!(
            (dev.completed(B), dev.completed(C)),
            (0, 0),
            "{what}: waited on the host"
        );
        drop(again);
        pool.check().unwrap();
    }
}

/// Uses on two other streams at once: zeroing the buffer on its home stream waits for both.
#[test]
fn zeroing_waits_for_uses_on_two_other_streams_at_once() {
    for (overlap, b_ends_first) in OVERLAPS {
        let what = format!("overlap: {overlap}, B ends first: {b_ends_first}");
        let (dev, pool) = setup();
        let mut buf = alloc(&pool, A, MIB);
        let (b, c) = uses_on_b_and_c(&buf, overlap, b_ends_first);
        buf.zero().unwrap();
        let memset = (A, dev.queued(A));
        assert!(
            dev.ordered_before((B, b), memset),
            "{what}: the memset may overlap the use on B"
        );
        assert!(
            dev.ordered_before((C, c), memset),
            "{what}: the memset may overlap the use on C"
        );
    }
}

/// Zeroing a buffer whose last use on another stream had its end unmarked (the guard's record
/// skipped while the home context held an error) waits for the whole home context, as the free
/// does.
#[test]
fn zeroing_after_an_unmarked_end_of_use_waits_for_the_home_context() {
    let (dev, pool) = setup();
    let mut buf = alloc(&pool, A, MIB);
    dev.set_context_error(0, true);
    let used = buf.simulate_use(B);
    buf.zero().unwrap();
    let memset = (A, dev.queued(A));
    assert!(
        dev.completed(B) >= used || dev.ordered_before((B, used), memset),
        "the memset may overwrite the buffer during the use on B"
    );
    dev.set_context_error(0, false);
}

/// A handle that names no one stream (CUDA's per-thread default stream: each thread's own) gets no
/// event: the use is waited for when its guard ends.
#[test]
fn a_use_on_a_per_thread_stream_is_waited_for_on_the_host() {
    let (dev, pool) = setup();
    let buf = alloc(&pool, A, MIB);
    let p = SimStream::per_thread(0);
    let on_p = buf.begin_use(&p);
    let used = on_p.item();
    assert!(dev.completed(p) < used);
    drop(on_p);
    assert!(
        dev.completed(p) >= used,
        "not waited for when the guard ended"
    );
    // Other streams keep their events (no host wait).
    let on_b = buf.simulate_use(B);
    assert!(dev.completed(B) < on_b);
    drop(buf);
    let again = alloc(&pool, A, MIB);
    assert!(before_next(&dev, (B, on_b), A));
    drop(again);
    pool.check().unwrap();
}

/// A buffer keeps events for at most 16 other streams: a use on one more is waited for on the
/// host, and the streams that have events keep them.
#[test]
fn uses_on_more_streams_than_a_buffer_keeps_events_for_are_waited_for_on_the_host() {
    let (dev, pool) = setup();
    let buf = alloc(&pool, A, MIB);
    let addr = buf.device_address();
    let mut uses = Vec::new();
    for s in (2..18).map(SimStream) {
        let used = buf.simulate_use(s);
        assert!(dev.completed(s) < used, "{s:?}: waited for on the host");
        uses.push((s, used));
    }
    let one_more = SimStream(18);
    let used = buf.simulate_use(one_more);
    assert!(
        dev.completed(one_more) >= used,
        "the 17th stream's use was not waited for"
    );
    let again_on_2 = buf.simulate_use(SimStream(2));
    assert!(dev.completed(SimStream(2)) < again_on_2);
    uses.push((SimStream(2), again_on_2));
    drop(buf);
    let next = alloc(&pool, A, MIB);
    assert_eq!(next.device_address(), addr);
    for (s, used) in uses {
        assert!(
            before_next(&dev, (s, used), A),
            "{s:?}: may overlap the next owner"
        );
    }
    drop(next);
    pool.check().unwrap();
}

/// A kernel launched on the home stream with the buffer as an argument comes after the buffer's
/// uses on other streams (cudarc gives an argument no access to the launch's stream: the home
/// stream waits when the argument is pushed).
#[test]
fn a_launch_on_the_home_stream_comes_after_uses_on_other_streams() {
    let (dev, pool) = setup();
    let buf = alloc(&pool, A, MIB);
    let on_b = buf.simulate_use(B);
    let on_c = buf.simulate_use(C);
    let launch = buf.simulate_launch();
    assert!(dev.ordered_before((B, on_b), (A, launch)));
    assert!(dev.ordered_before((C, on_c), (A, launch)));
    assert_eq!(
        (dev.completed(B), dev.completed(C)),
        (0, 0),
        "waited on the host"
    );
    // A buffer never used on another stream: nothing to wait for.
    let plain = alloc(&pool, A, MIB);
    let waits = dev.queued(A);
    plain.simulate_launch();
    assert_eq!(dev.queued(A), waits + 1, "only the launch was queued");
}

/// cudarc's guard records the end of a use only if the context still manages stream
/// synchronisation when the guard drops (a count of the context's owned streams, which another
/// thread lowers by dropping one), not when the use began. A guard handed out while the count was
/// above zero may so leave the end of its use unrecorded: the free must not trust that event.
#[test]
fn a_use_whose_end_cudarc_did_not_record_is_still_ordered_before_reuse() {
    let (dev, pool) = setup();
    // SAFETY: simulated memory is never read.
    let buf: Buf = unsafe { pool.alloc::<u8>(&A, 2 * MIB) }.unwrap();
    let addr = buf.device_address();
    let guard = buf.begin_use(&B); // the context manages synchronisation: a recording guard
    let used = guard.item();
    dev.set_unmanaged_sync(true); // another thread drops the context's last owned stream
    drop(guard); // so cudarc skips the record
    drop(buf);
    // The home stream's work completes; the use on B does not.
    dev.complete(A);
    // SAFETY: simulated memory is never read.
    let next: Buf = unsafe { pool.alloc::<u8>(&C, 2 * MIB) }.unwrap();
    assert_eq!(
        next.device_address(),
        addr,
        "the test expects the block to be reused"
    );
    assert!(
        dev.completed(B) >= used || dev.ordered_before((B, used), (C, dev.queued(C) + 1)),
        "the block went to stream C while the use on B (item {used}) may still run"
    );
}

/// A use on another stream whose end no event marks (the context does not manage stream
/// synchronisation) is waited for on the host by its guard: the free needs no device-wide wait and
/// reports nothing, though the context still does not record ends of uses.
#[test]
fn a_host_waited_use_needs_no_device_wait_at_the_free_in_an_unmanaged_context() {
    let (dev, pool) = setup();
    dev.set_unmanaged_sync(true);
    let buf = alloc(&pool, A, MIB);
    let used = buf.simulate_use(B);
    assert!(
        dev.completed(B) >= used,
        "the guard did not wait for the use"
    );
    let syncs = dev.device_syncs();
    drop(buf);
    assert_eq!(dev.device_syncs(), syncs, "the free waited for the device");
    let errs = pool.take_errors();
    assert!(errs.is_empty(), "{errs:?}");
    let again = alloc(&pool, C, MIB);
    assert!(before_next(&dev, (B, used), C));
    drop(again);
}

/// A free after uses on other streams that were all waited for on the host (no event marks their
/// end) makes the home stream wait for nothing, so it records no event there either.
#[test]
fn a_free_after_only_host_waited_uses_records_nothing_on_the_home_stream() {
    let (dev, pool) = setup();
    dev.set_unmanaged_sync(true);
    let buf = alloc(&pool, A, MIB);
    buf.simulate_use(B); // waited for by its guard
    let recorded = dev.recorded(A);
    drop(buf);
    assert_eq!(
        dev.recorded(A),
        recorded,
        "an event recorded on the home stream"
    );
}

/// The home stream's event that a use on another stream waits for cannot be created
/// (`cuEventCreate`): the home stream's work is then waited for on the host before the use, and
/// the failure is deferred to the free, which waits for the device.
#[test]
fn a_failed_event_creation_before_a_use_waits_for_the_home_stream_on_the_host() {
    let (dev, pool) = setup();
    let buf = alloc(&pool, A, 2 * MIB);
    let written = dev.enqueue(A); // a kernel writing the buffer on its home stream
                                  // The first creation is the home stream's event; B's own event is created.
    dev.fail_next_new_events(1);
    let used = buf.simulate_use(B);
    assert!(
        dev.completed(A) >= written || dev.ordered_before((A, written), (B, used)),
        "the use on B may overlap the home stream's write"
    );
    let syncs = dev.device_syncs();
    drop(buf);
    assert_eq!(dev.device_syncs(), syncs + 1, "the free did not wait");
    assert!(dev.completed(B) >= used);
    let errors = pool.take_errors();
    assert!(
        errors
            .iter()
            .any(|e| e.to_string().contains("cuEventCreate")),
        "{errors:?}"
    );
}

/// The event that would mark the end of a use on another stream cannot be created
/// (`cuEventCreate`): the use is waited for on the host when its guard ends, and the failure is
/// deferred to the free, which waits for the device before the block goes to another stream.
#[test]
fn a_failed_event_creation_for_the_end_of_a_use_makes_the_free_wait_for_the_device() {
    let (dev, pool) = setup();
    let buf = alloc(&pool, A, 2 * MIB);
    let addr = buf.device_address();
    buf.simulate_use(B); // the home stream's event and B's exist from here on
    dev.set_fail_new_event(true);
    let used = buf.simulate_use(C); // C's own event cannot be created
    dev.set_fail_new_event(false);
    assert!(
        dev.completed(C) >= used,
        "the use was not waited for when its guard ended"
    );
    let syncs = dev.device_syncs();
    drop(buf);
    assert_eq!(dev.device_syncs(), syncs + 1, "the free did not wait");
    let errors = pool.take_errors();
    assert!(
        errors
            .iter()
            .any(|e| e.to_string().contains("cuEventCreate")),
        "the failure was not reported: {errors:?}"
    );
    let again = alloc(&pool, B, 2 * MIB);
    assert_eq!(again.device_address(), addr, "the block was not reused");
    assert!(before_next(&dev, (C, used), B));
}

/// CUDA's stream ids are unique only within a context: a stream of another context that has the
/// home stream's id is another stream all the same. A use of a buffer there waits for the home
/// stream's work, is waited for when its guard ends, and its context is waited for at the free if
/// it holds an error. `after_b`: the buffer was used on B first, so it already has a record (the
/// protocol's later-use path rather than its first-use fast path).
fn a_use_on_another_contexts_twin_of_the_home_stream_is_waited_for(after_b: bool) {
    let (dev, pool) = setup();
    dev.set_context_local_stream_ids(true);
    let twin = SimStream::in_context(1, 1); // A's id in context 1
    let buf = alloc(&pool, A, 2 * MIB);
    let addr = buf.device_address();
    if after_b {
        buf.simulate_use(B);
    }
    let written = dev.enqueue(A);
    let used = buf.simulate_use(twin);
    assert!(
        dev.completed(A) >= written,
        "the use in another context may overlap the home stream's write"
    );
    assert!(
        dev.completed(twin) >= used,
        "the use in another context was not waited for when its guard ended"
    );
    // The free waits for that context if it holds an error (a guard's wait may have been skipped).
    dev.set_context_error(twin.context(), true);
    let later = dev.enqueue(twin);
    drop(buf);
    dev.set_context_error(twin.context(), false);
    assert!(
        dev.completed(twin) >= later,
        "the free did not wait for the context"
    );
    // The block goes to another stream once the home stream's mark (after any wait for B) is done.
    dev.complete(B);
    dev.complete(A);
    let again = alloc(&pool, C, 2 * MIB);
    assert_eq!(again.device_address(), addr, "the block was not reused");
    assert!(before_next(&dev, (twin, used), C));
}

#[test]
fn a_first_use_on_another_contexts_stream_with_the_home_streams_id_is_waited_for() {
    a_use_on_another_contexts_twin_of_the_home_stream_is_waited_for(false);
}

#[test]
fn a_later_use_on_another_contexts_stream_with_the_home_streams_id_is_waited_for() {
    a_use_on_another_contexts_twin_of_the_home_stream_is_waited_for(true);
}

/// The home stream's event that a use on another stream waits for cannot be recorded
/// (`cuEventRecord`): no event orders the use after the home stream's work, so that work is
/// waited for on the host before the use (and the free waits for the device).
#[test]
fn a_failed_event_record_before_a_use_waits_for_the_home_stream_on_the_host() {
    let (dev, pool) = setup();
    let buf = alloc(&pool, A, 2 * MIB);
    let written = dev.enqueue(A); // a kernel writing the buffer on its home stream
    dev.set_fail_use_ordering(true);
    let used = buf.simulate_use(B);
    dev.set_fail_use_ordering(false);
    assert!(
        dev.completed(A) >= written || dev.ordered_before((A, written), (B, used)),
        "the use on B may overlap the home stream's write"
    );
    let syncs = dev.device_syncs();
    drop(buf);
    assert_eq!(dev.device_syncs(), syncs + 1, "the free did not wait");
    assert!(
        !pool.take_errors().is_empty(),
        "the failure was not reported"
    );
}

/// A stream query need not count a stream wait as work: the free of a buffer used on another
/// stream records an event on the home stream after the home stream's wait for that use, so the
/// home stream stays busy, and its freed block goes to no other stream, until the use has ended.
#[test]
fn a_free_keeps_the_home_stream_busy_until_a_use_on_another_stream_ends() {
    let (dev, pool) = setup();
    let buf = alloc(&pool, A, 2 * MIB);
    let addr = buf.device_address();
    let used = buf.simulate_use(B);
    dev.complete(A); // the home stream's own work is done: only what the free queues is left
    let marks = dev.recorded(A);
    drop(buf);
    assert_eq!(
        dev.recorded(A),
        marks + 1,
        "no event recorded on the home stream after its wait for the use"
    );
    assert!(
        dev.completed(A) < dev.queued(A),
        "the home stream looks idle while it waits for the use on B"
    );
    let next = alloc(&pool, C, 2 * MIB);
    assert!(
        next.device_address() != addr || before_next(&dev, (B, used), C),
        "the block went to C while the use on B (item {used}) may still run"
    );
    drop(next);
    pool.check().unwrap();
}
