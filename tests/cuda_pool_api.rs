//! Edge cases of the device pool's public API, on the simulated device.

use std::sync::mpsc;
use std::time::Duration;

use bfc_alloc::cuda::{
    DeviceBuffer, DevicePool, MemoryLimit, PoolError, PoolOptions, SimBackend, SimDevice, SimStream,
};

const MIB: usize = 1 << 20;
const S: SimStream = SimStream(1);
const S2: SimStream = SimStream(2);

type Pool = DevicePool<SimBackend>;

/// `pool.alloc`, on a simulated device.
fn alloc<T>(
    pool: &Pool,
    s: &SimStream,
    len: usize,
) -> Result<DeviceBuffer<T, SimBackend>, PoolError> {
    // SAFETY: simulated memory is never read.
    unsafe { pool.alloc::<T>(s, len) }
}

fn pool(dev: &SimDevice) -> Pool {
    DevicePool::with_backend(dev.backend(), PoolOptions::with_limit(256 * MIB)).unwrap()
}

#[repr(C, align(4096))]
struct Page([u8; 4096]);
#[repr(C, align(2097152))]
struct Huge(u8);
#[repr(C, align(8388608))]
struct Huger(u8);

#[test]
fn zero_sized_and_empty_buffers_get_distinct_blocks() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev);
    let a = alloc::<()>(&p, &S, usize::MAX).unwrap();
    let b = alloc::<()>(&p, &S, 0).unwrap();
    let c = alloc::<u64>(&p, &S, 0).unwrap();
    assert_eq!(a.len(), usize::MAX);
    assert_eq!(a.num_bytes(), 0);
    assert!(c.is_empty());
    let mut addrs = [a.device_address(), b.device_address(), c.device_address()];
    addrs.sort();
    assert!(addrs.windows(2).all(|w| w[1] >= w[0] + 256), "{addrs:x?}");
    drop((a, b, c));
    p.synchronize();
    p.check().unwrap();
    assert_eq!(p.stats().allocator.bytes_in_use, 0);
}

const GIB: usize = 1 << 30;

#[test]
fn len_times_size_overflow_is_an_error() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev);
    let r = alloc::<u64>(&p, &S, usize::MAX / 4);
    assert!(matches!(r, Err(PoolError::InvalidRequest { .. })), "{r:?}");
    let r = alloc::<u8>(&p, &S, usize::MAX);
    assert!(r.is_err(), "{r:?}");
    let r = alloc::<u8>(&p, &S, usize::MAX - 255);
    assert!(r.is_err(), "{r:?}");
    let r = alloc::<u8>(&p, &S, isize::MAX as usize);
    assert!(r.is_err(), "{r:?}");
    p.check().unwrap();
}

#[test]
fn over_aligned_element_types_are_aligned_or_refused() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev);
    for round in 0..3 {
        let a = alloc::<Page>(&p, &S, 3).unwrap();
        assert_eq!(a.device_address() % 4096, 0, "round {round}");
        let h = alloc::<Huge>(&p, &S, 1).unwrap();
        assert_eq!(h.device_address() % (2 * MIB) as u64, 0, "round {round}");
        match alloc::<Huger>(&p, &S, 1) {
            Ok(b) => assert_eq!(b.device_address() % (8 * MIB) as u64, 0, "round {round}"),
            Err(e) => println!("align 8 MiB refused: {e}"),
        }
        let small = alloc::<u8>(&p, &S, 100).unwrap();
        drop(small);
        drop(a);
        drop(h);
    }
    p.synchronize();
    p.check().unwrap();
}

#[test]
fn odd_pool_options_are_refused_or_work() {
    let dev = SimDevice::new(GIB);
    let mut cases = Vec::new();
    let d = PoolOptions::with_limit(256 * MIB);
    // Growth from nothing is refused, and says why.
    match DevicePool::with_backend(
        dev.backend(),
        PoolOptions {
            initial_region_size: 0,
            ..d
        },
    ) {
        Err(PoolError::Config(why)) => {
            assert_eq!(why, "initial_region_size must not be 0 with allow_growth")
        }
        r => panic!("{:?}", r.map(|_| ())),
    }
    cases.push(PoolOptions {
        initial_region_size: 1,
        ..d
    });
    cases.push(PoolOptions {
        initial_region_size: usize::MAX,
        ..d
    });
    cases.push(PoolOptions {
        initial_region_size: 3 * MIB + 7,
        ..d
    });
    cases.push(PoolOptions {
        limit: MemoryLimit::Bytes(0),
        ..d
    });
    cases.push(PoolOptions {
        limit: MemoryLimit::Bytes(255),
        ..d
    });
    cases.push(PoolOptions {
        limit: MemoryLimit::Bytes(usize::MAX),
        ..d
    });
    cases.push(PoolOptions {
        limit: MemoryLimit::Fraction(f64::NAN),
        ..d
    });
    cases.push(PoolOptions {
        limit: MemoryLimit::Fraction(f64::INFINITY),
        ..d
    });
    cases.push(PoolOptions {
        limit: MemoryLimit::Fraction(1e-300),
        ..d
    });
    cases.push(PoolOptions {
        allow_growth: false,
        ..d
    });
    cases.push(PoolOptions {
        allow_growth: false,
        limit: MemoryLimit::Bytes(0),
        ..d
    });
    cases.push(PoolOptions {
        allow_growth: false,
        limit: MemoryLimit::Bytes(usize::MAX),
        ..d
    });
    cases.push(PoolOptions {
        chunk_capacity: 2,
        ..d
    });
    cases.push(PoolOptions {
        chunk_capacity: 0,
        ..d
    });
    cases.push(PoolOptions {
        limit: MemoryLimit::Auto,
        ..d
    });
    for o in cases {
        match DevicePool::with_backend(dev.backend(), o) {
            Err(e) => println!("{o:?}: refused: {e}"),
            Ok(p) => {
                let mut bufs = Vec::new();
                for i in 0..50usize {
                    let s = if i % 2 == 0 { &S } else { &S2 };
                    if let Ok(b) = alloc::<u8>(&p, s, [1, 300, 5000, MIB, 3 * MIB][i % 5]) {
                        bufs.push(b);
                    }
                    if i % 3 == 0 && !bufs.is_empty() {
                        bufs.swap_remove(0);
                    }
                }
                // No two live buffers overlap.
                let mut r: Vec<(u64, u64)> = bufs
                    .iter()
                    .map(|b| {
                        (
                            b.device_address(),
                            b.device_address() + b.block_size() as u64,
                        )
                    })
                    .collect();
                r.sort();
                assert!(r.windows(2).all(|w| w[0].1 <= w[1].0), "{o:?}: overlap");
                p.check().unwrap();
                drop(bufs);
                p.synchronize();
                p.check().unwrap();
                println!("{o:?}: ok, {} in use", p.stats().allocator.bytes_in_use);
            }
        }
        assert_eq!(
            dev.bytes_live(),
            0,
            "{o:?}: device memory left after the pool is gone"
        );
    }
}

#[test]
fn buffers_outlive_their_pool_and_move_across_threads() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev);
    let bufs: Vec<DeviceBuffer<f32, SimBackend>> = (0..10)
        .map(|i| alloc::<f32>(&p, &S, 100 * (i + 1)).unwrap())
        .collect();
    drop(p);
    assert!(dev.bytes_live() > 0);
    std::thread::scope(|s| {
        for b in bufs {
            s.spawn(move || {
                let p2 = b.pool();
                let c = alloc::<f32>(&p2, &S2, 10).unwrap();
                drop(b);
                drop(c);
            });
        }
    });
    assert_eq!(
        dev.bytes_live(),
        0,
        "device memory not returned after the last buffer"
    );
    fn send_sync<X: Send + Sync>() {}
    send_sync::<DeviceBuffer<f32, SimBackend>>();
    send_sync::<DeviceBuffer<std::rc::Rc<u8>, SimBackend>>();
    send_sync::<Pool>();
}

/// `inspect_backend` is safe, and its closure can reach the pool (a clone, or a buffer's drop).
/// Re-entering the pool from inside it must not hang: it panics, and the pool stays usable.
#[test]
fn inspect_backend_reentry_panics_instead_of_hanging() {
    let dev = SimDevice::new(GIB);
    let p = pool(&dev);
    let buf = alloc::<u8>(&p, &S, 100).unwrap();
    let (tx, rx) = mpsc::channel();
    let p2 = p.clone();
    std::thread::spawn(move || {
        let a = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            p2.inspect_backend(|_| p2.stats().allocator.bytes_in_use)
        }));
        let b = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            p2.inspect_backend(move |_| drop(buf));
        }));
        let c = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // SAFETY: the closure leaves the back end alone.
            unsafe { p2.with_backend_mut(|_| p2.trim()) }
        }));
        let _ = tx.send((a.is_err(), b.is_err(), c.is_err()));
    });
    match rx.recv_timeout(Duration::from_secs(5)) {
        Ok(r) => assert_eq!(r, (true, true, true), "re-entry did not panic"),
        Err(_) => panic!("inspect_backend re-entered from its closure deadlocked"),
    }
    // The pool still works (the buffer dropped inside the closure is leaked, not lost twice).
    let b = alloc::<u8>(&p, &S, 100).unwrap();
    drop(b);
    p.synchronize();
    p.check().unwrap();
    // Other threads may use the pool while a closure runs.
    let p3 = p.clone();
    p.inspect_backend(|_| {
        std::thread::spawn(move || p3.limit()).join().unwrap();
    });
}
