//! The use protocol (a buffer used on streams other than its home stream) on the simulated device,
//! whose streams record what waits for what: every use of a block must be complete, or ordered
//! before its next owner's work, when the block is handed out again.

use bfc_alloc::cuda::{DeviceBuffer, DevicePool, PoolOptions, SimBackend, SimDevice, SimStream};

const MIB: usize = 1 << 20;

type Pool = DevicePool<SimBackend>;
type Buf = DeviceBuffer<u8, SimBackend>;

const A: SimStream = SimStream(1);
const B: SimStream = SimStream(2);
const C: SimStream = SimStream(3);
/// A stream of another context.
const X: SimStream = SimStream::in_context(1, 7);

fn setup() -> (SimDevice, Pool) {
    let dev = SimDevice::new(1 << 30);
    let pool = DevicePool::with_backend(dev.backend(), PoolOptions::with_limit(256 * MIB)).unwrap();
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

#[test]
fn random_uses_never_overlap_the_next_owner() {
    let streams = [A, B, C, SimStream(4), X];
    let home_context = [A, B, C, SimStream(4)];
    let sizes = [256, 4096, 100_000, MIB, 3 * MIB];
    for seed in 1..=200u64 {
        let (dev, pool) = setup();
        let mut rng = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let mut next = move |n: usize| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng % n as u64) as usize
        };
        let mut live: Vec<(Buf, Vec<Use>)> = Vec::new();
        // Uses of freed blocks, kept until they complete.
        let mut history: Vec<Use> = Vec::new();
        // Which contexts hold a recorded error: [the pool's, X's].
        let mut errors = [false, false];
        for step in 0..3000 {
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
    dev.set_fail_finish_uses(true);
    drop(buf); // the pool waits for the device
    dev.set_fail_finish_uses(false);
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
    dev.set_fail_finish_uses(true);
    drop(buf);
    dev.set_fail_finish_uses(false);
    let again = alloc(&pool, B, 2 * MIB);
    assert_eq!(again.device_address(), addr, "the block was not reused");
    assert!(
        before_next(&dev, (X, used), B),
        "the block went to B while the use on X may still run"
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
