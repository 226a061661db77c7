//! Device-pool tests that need threads with stream caches of their own. A thread takes one of the
//! pool's 64 stream caches that no live thread holds (threads share one only while every cache is
//! held), so these run in a binary of their own: among the other simulator tests, a machine that
//! runs 63 tests or more at once could leave two of their threads sharing a cache.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use bfc_alloc::cuda::{DeviceBuffer, PoolError, PoolOptions, SimBackend, SimDevice, SimStream};

#[path = "common/rng.rs"]
mod rng;
use rng::Rng;
#[path = "common/sim_pool.rs"]
mod sim_pool;
use sim_pool::{alloc, assert_all_back, pool, Pool, C, D, GIB, MIB};
#[path = "common/counting.rs"]
mod counting;
use counting::{counted_alloc, counting_pool, with_switch, Counted, PANIC_IN_RECORD_EVENT};

/// Two threads on one stream each keep their frees in their own stream cache, and each reuses its
/// own without the pool's lock: the second thread's first allocation does not get the first's
/// cached block (it misses, on the lock), and once each freed one, each gets its own back while
/// the main thread holds the pool's lock. A buffer freed by another thread goes back to the cache
/// of the thread that allocated it. (A thread takes a cache no live thread holds and gives it back
/// when it exits: threads share one only while 64 live threads hold every cache.)
#[test]
fn threads_on_one_stream_keep_their_own_stream_caches() {
    use std::sync::mpsc::{channel, Receiver, Sender};
    type Buf = DeviceBuffer<u8, SimBackend>;
    type Job = Box<dyn FnOnce() -> Option<Buf> + Send>;
    type Worker = (Sender<Job>, Receiver<Option<Buf>>);
    /// A thread that runs the closures it receives, in order, and sends back what they return.
    fn worker<'scope>(scope: &'scope std::thread::Scope<'scope, '_>) -> Worker {
        let (to, from_main) = channel::<Job>();
        let (to_main, from) = channel::<Option<Buf>>();
        scope.spawn(move || {
            for f in from_main {
                to_main.send(f()).unwrap();
            }
        });
        (to, from)
    }
    /// Runs `f` on `w`'s thread; fails if it takes more than 10 s (waiting for the pool's lock).
    fn run(w: &Worker, f: Job) -> Option<Buf> {
        w.0.send(f).unwrap();
        w.1.recv_timeout(std::time::Duration::from_secs(10))
            .expect("the thread waited for the pool's lock")
    }
    let alloc_on_c = |p: &Pool| -> Job {
        let p = p.clone();
        Box::new(move || Some(alloc(&p, C, 4096).unwrap()))
    };
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(256 * MIB));
    dev.enqueue(C);
    std::thread::scope(|scope| {
        let (t1, t2) = (worker(scope), worker(scope));
        let x = run(&t1, alloc_on_c(&p)).unwrap();
        let at_x = x.device_address();
        run(
            &t1,
            Box::new(move || {
                drop(x);
                None
            }),
        );
        let y = run(&t2, alloc_on_c(&p)).unwrap();
        let at_y = y.device_address();
        assert_ne!(
            at_y, at_x,
            "the second thread took the first's cached block"
        );
        // Freed by the main thread: back to the second thread's cache.
        drop(y);
        let (x, y) = p.inspect_backend(|_| {
            let x = run(&t1, alloc_on_c(&p)).unwrap();
            let y = run(&t2, alloc_on_c(&p)).unwrap();
            (x, y)
        });
        assert_eq!((x.device_address(), y.device_address()), (at_x, at_y));
        drop((x, y, t1, t2));
    });
    p.check().unwrap();
}

/// When the engine has no room, an allocation takes its stream's block from another thread's
/// stream cache, with no event and no wait (rather than waiting for every pending free as for out
/// of memory).
#[test]
fn a_full_pool_gives_a_thread_its_streams_block_from_another_threads_cache() {
    let dev = SimDevice::new(GIB);
    let options = PoolOptions {
        allow_growth: false,
        ..PoolOptions::with_limit(2 * MIB)
    };
    let p = pool(&dev, options);
    // This thread takes its stream cache first (a thread keeps its cache until it exits, in every
    // pool), so that it cannot take the one the other thread gives back when it exits.
    let other = pool(&dev, PoolOptions::with_limit(2 * MIB));
    drop(alloc(&other, C, 4096).unwrap());
    dev.enqueue(C);
    let at = std::thread::scope(|scope| {
        scope
            .spawn(|| {
                let x = alloc(&p, C, 2 * MIB).unwrap();
                let at = x.device_address();
                drop(x); // Into this thread's cache.
                at
            })
            .join()
            .unwrap()
    });
    assert_eq!(p.stats().pending_blocks, 1);
    let y = alloc(&p, C, 2 * MIB).unwrap();
    assert_eq!(y.device_address(), at);
    assert_eq!(
        dev.recorded(C),
        0,
        "no event: the block was the stream's own"
    );
    assert_eq!(dev.completed(C), 0, "no wait for the stream's work");
    drop(y);
    p.check().unwrap();
}

/// A miss on a full engine that another thread's cache serves (a block of the miss's own stream)
/// still closes every stream whose blocks came out of the caches for it, its own too: an idle
/// one's go back to the engine at once, a busy one's get an event. (They stayed open in their
/// queues, until some later miss or a trim.)
#[test]
fn a_miss_on_a_full_engine_served_from_another_threads_cache_closes_the_drained_streams() {
    for busy in [false, true] {
        let dev = SimDevice::new(GIB);
        let options = PoolOptions {
            allow_growth: false,
            ..PoolOptions::with_limit(8 * MIB)
        };
        let p = pool(&dev, options);
        // This thread takes its cache first; another thread's cache keeps two blocks of C, of
        // 1 and 2 MiB (and goes on to a later thread with them).
        drop(alloc(&p, D, MIB).unwrap());
        std::thread::scope(|s| {
            s.spawn(|| drop((alloc(&p, C, MIB).unwrap(), alloc(&p, C, 2 * MIB).unwrap())));
        });
        // This thread's cache: five of D, which fill the engine.
        let d: Vec<_> = (0..5).map(|_| alloc(&p, D, MIB).unwrap()).collect();
        if busy {
            dev.enqueue(D);
        }
        drop(d);
        assert_eq!(p.stats().pending_blocks, 7);
        // Served by C's 1 MiB block; the 2 MiB one (C is idle) goes back to the engine.
        let x = alloc(&p, C, MIB).unwrap();
        let st = p.stats();
        if busy {
            assert_eq!(dev.recorded(D), 1, "D's blocks were not closed");
            assert_eq!(st.pending_blocks, 5, "C's 2 MiB block is still pending");
            // The next call on the lock sees the event complete (and its block goes to the cache).
            dev.complete(D);
            drop(alloc(&p, C, MIB).unwrap());
        } else {
            assert_eq!(dev.recorded(D), 0);
        }
        let in_cache = usize::from(busy);
        assert_eq!(
            (p.stats().pending_blocks, p.stats().allocator.bytes_in_use),
            (in_cache, (1 + in_cache) * MIB),
            "busy: {busy}: D's or C's blocks are still pending"
        );
        drop(x);
        p.synchronize();
        p.check().unwrap();
    }
}

/// A miss on a full engine that a block of its own stream from another thread's cache serves
/// closes the other streams drained with it before it takes that block: a back end that panics
/// recording their event loses no block (it stays pending in its stream's queue, and goes back to
/// the engine once the work is done). (The take came first, and a panic in the closes lost the
/// block in hand: its region was never given back.)
#[test]
fn a_panic_closing_the_streams_a_full_engine_miss_drained_loses_no_block() {
    let dev = SimDevice::new(GIB);
    let (c, d) = (Counted(C, Arc::new(())), Counted(D, Arc::new(())));
    {
        let p = counting_pool(&dev, 64 * MIB);
        // This thread takes its stream cache first, so that it cannot take the other thread's.
        let other = pool(&dev, PoolOptions::with_limit(2 * MIB));
        drop(alloc(&other, C, 4096).unwrap());
        std::thread::scope(|scope| {
            scope.spawn(|| {
                // The pool's first region, 2 MiB, holds both.
                let (x, w) = (counted_alloc(&p, &c, MIB), counted_alloc(&p, &d, MIB));
                dev.enqueue(D);
                drop((x, w)); // Into this thread's cache.
            });
        });
        assert_eq!(p.stats().pending_blocks, 2);
        assert_eq!(p.stats().allocator.bytes_reserved, 2 * MIB);
        // The engine is full: the caches are drained, C's block serves the request, and D (busy)
        // needs an event, whose recording panics.
        let panicked = with_switch(&PANIC_IN_RECORD_EVENT, true, || counted_alloc(&p, &c, MIB));
        assert!(panicked.is_err());
        assert_eq!(p.stats().pending_blocks, 2, "a block was lost");
        dev.complete_all();
        p.trim();
        assert_all_back(&p);
    }
    assert_eq!(dev.bytes_live(), 0, "a region was kept");
}

/// What the stress test below knows: the live buffers and the uses of freed blocks not yet done.
#[derive(Default)]
struct Model {
    live: Vec<(u64, u64)>,
    /// Uses of freed blocks: (lo, hi, stream, item).
    history: Vec<(u64, u64, SimStream, u64)>,
    cross: usize,
}

/// Threads on shared and own streams (cached and on the lock), with uses on other streams, trims
/// and synchronisations, while another thread switches driver failures on and off (event records,
/// stream and event queries, use ordering, event creation, `finish_uses`): no two live buffers
/// overlap, a block goes to another stream only once every earlier use of it is done or ordered
/// before the new owner's work, and at the end every block is back and every region returned.
/// `BFC_STRESS_SEEDS`, `BFC_STRESS_THREADS` and `BFC_STRESS_OPS` make it longer (defaults 10, 4
/// and 6000).
#[test]
fn threads_with_failing_driver_calls_never_hand_a_busy_block_to_another_stream() {
    let seeds = env_or("BFC_STRESS_SEEDS", 10);
    for seed in 0..seeds {
        one_run(seed);
    }
}

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

fn one_run(seed: u64) {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev, PoolOptions::with_limit(12 * MIB));
    let model = Mutex::new(Model::default());
    let stop = AtomicBool::new(false);
    let all: Vec<SimStream> = (1u64..=24).map(SimStream).collect();
    std::thread::scope(|scope| {
        let mut workers = Vec::new();
        let threads = env_or("BFC_STRESS_THREADS", 4);
        let ops = env_or("BFC_STRESS_OPS", 6000) as usize;
        for t in 0..threads {
            let (p, dev, model, all) = (&p, &dev, &model, &all);
            workers.push(scope.spawn(move || {
                let mine = [
                    SimStream(3 + t),
                    SimStream(3 + (t + 1) % 4),
                    SimStream(1),
                    SimStream(2),
                    SimStream(7 + 4 * t),
                    SimStream(8 + 4 * t),
                    SimStream(9 + 4 * t),
                    SimStream(10 + 4 * t),
                ];
                let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ ((t + 1 + 8 * seed) * 0x1234_5678_9abc));
                let mut live: Vec<DeviceBuffer<u8, SimBackend>> = Vec::new();
                for _ in 0..ops {
                    let r = rng.next();
                    let s = mine[(r >> 8) as usize % mine.len()];
                    match r % 16 {
                        0..=6 => {
                            let size = rng.log_size(1, 2 * MIB);
                            match alloc(p, s, size) {
                                Ok(b) => {
                                    let lo = b.device_address();
                                    let hi = lo + b.block_size() as u64;
                                    let mut m = model.lock().unwrap();
                                    for &(llo, lhi) in &m.live {
                                        assert!(hi <= llo || lhi <= lo, "overlapping live buffers");
                                    }
                                    let next = (s, dev.queued(s) + 1);
                                    let mut cross = 0;
                                    for &(flo, fhi, fs, item) in &m.history {
                                        if flo < hi && lo < fhi && fs != s {
                                            cross += 1;
                                            assert!(
                                                dev.completed(fs) >= item
                                                    || dev.ordered_before((fs, item), next),
                                                "{s:?} got [{lo:#x},{hi:#x}) while item {item} \
                                                 of {fs:?} on [{flo:#x},{fhi:#x}) may still run"
                                            );
                                        }
                                    }
                                    m.cross += cross;
                                    m.live.push((lo, hi));
                                    drop(m);
                                    live.push(b);
                                }
                                Err(PoolError::OutOfMemory(_)) => {}
                                Err(e) => panic!("{e}"),
                            }
                        }
                        7..=11 if !live.is_empty() => {
                            let b = live.swap_remove((r >> 20) as usize % live.len());
                            let lo = b.device_address();
                            let hi = lo + b.block_size() as u64;
                            let home = *b.home_stream();
                            let mut uses = Vec::new();
                            if (r >> 30) % 4 == 0 {
                                let other = all[(r >> 34) as usize % all.len()];
                                uses.push((other, b.simulate_use(other)));
                            }
                            uses.push((home, dev.enqueue(home)));
                            {
                                let mut m = model.lock().unwrap();
                                let i = m.live.iter().position(|&l| l == (lo, hi)).unwrap();
                                m.live.swap_remove(i);
                                for (us, item) in uses {
                                    m.history.push((lo, hi, us, item));
                                }
                            }
                            drop(b);
                        }
                        12 | 13 => {
                            let s = all[(r >> 40) as usize % all.len()];
                            let (done, queued) = (dev.completed(s), dev.queued(s));
                            dev.complete_to(s, done + (r >> 44) % (queued - done + 1));
                        }
                        14 => {
                            if (r >> 52) % 2 == 0 {
                                p.trim();
                            } else if let Some(b) = live.last() {
                                b.simulate_launch();
                            }
                        }
                        _ => {
                            if (r >> 50) % 8 == 0 {
                                p.synchronize();
                            }
                        }
                    }
                    let mut m = model.lock().unwrap();
                    m.history
                        .retain(|&(_, _, fs, item)| dev.completed(fs) < item);
                    drop(m);
                    if live.len() > 12 {
                        for b in live.drain(6..) {
                            let lo = b.device_address();
                            let hi = lo + b.block_size() as u64;
                            let home = *b.home_stream();
                            let item = dev.enqueue(home);
                            {
                                let mut m = model.lock().unwrap();
                                let i = m.live.iter().position(|&l| l == (lo, hi)).unwrap();
                                m.live.swap_remove(i);
                                m.history.push((lo, hi, home, item));
                            }
                            drop(b);
                        }
                    }
                }
                for b in live {
                    let lo = b.device_address();
                    let hi = lo + b.block_size() as u64;
                    let mut m = model.lock().unwrap();
                    let i = m.live.iter().position(|&l| l == (lo, hi)).unwrap();
                    m.live.swap_remove(i);
                    drop(m);
                    drop(b);
                }
            }));
        }
        // The failure switch.
        let (dev, stop) = (&dev, &stop);
        scope.spawn(move || {
            let mut rng = Rng(0xdead_beef_1234_5678 ^ (seed + 1));
            while !stop.load(Ordering::Relaxed) {
                let r = rng.next();
                let on = (r >> 10) % 3 == 0;
                match r % 6 {
                    0 => dev.set_fail_event_record(on),
                    1 => dev.set_fail_stream_query(on),
                    2 => dev.set_fail_event_queries(on),
                    3 => dev.set_fail_use_ordering(on),
                    4 => dev.set_fail_new_event(on),
                    _ => dev.set_fail_finish_uses(on),
                }
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
        });
        let mut panicked = None;
        for w in workers {
            if let Err(e) = w.join() {
                panicked.get_or_insert(e);
            }
        }
        stop.store(true, Ordering::Relaxed);
        if let Some(e) = panicked {
            std::panic::resume_unwind(e);
        }
    });
    dev.set_fail_event_record(false);
    dev.set_fail_stream_query(false);
    dev.set_fail_event_queries(false);
    dev.set_fail_use_ordering(false);
    dev.set_fail_new_event(false);
    dev.set_fail_finish_uses(false);
    dev.complete_all();
    p.synchronize();
    assert!(
        model.lock().unwrap().cross > 0,
        "no block went to another stream while a use of it was recorded"
    );
    assert_eq!(p.stats().stranded_bytes, 0);
    assert_all_back(&p);
    drop(p);
    assert_eq!(dev.bytes_live(), 0);
}
