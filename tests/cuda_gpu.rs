//! The device pool on a real GPU. Each test prints `skipping: <reason>` and returns when there is no
//! CUDA driver or no device, so the suite passes on machines without a GPU. Any other failure to
//! open the device fails the test; with `BFC_REQUIRE_GPU=1` (set it on a GPU machine) a missing
//! driver or device fails it too.

use std::sync::{Arc, Mutex, MutexGuard};

use bfc_alloc::cuda::{
    device_count, driver_available, DeviceBuffer, DevicePool, PoolError, PoolOptions,
};
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};

const MIB: usize = 1 << 20;

/// Runs the calling test alone. The tests share the device's primary context, and another test's
/// work can delay a copy until a racing kernel is done, which hides the missing order a test is
/// there to catch (on an H200, with the stream query or the launch's wait removed from the pool,
/// the tests running in parallel missed it in 3 runs of 9; one at a time, in none of 8).
fn serial() -> MutexGuard<'static, ()> {
    static GPU: Mutex<()> = Mutex::new(());
    GPU.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Skips the calling test for `reason` (printed), or fails it when `BFC_REQUIRE_GPU=1`.
fn skip<T>(reason: &str) -> Option<T> {
    if std::env::var("BFC_REQUIRE_GPU").is_ok_and(|v| v == "1") {
        panic!("BFC_REQUIRE_GPU=1, but {reason}");
    }
    println!("skipping: {reason}");
    None
}

/// A pool on device 0; `None` (the test skips) when there is no driver or no device. Any other
/// failure fails the test: a pool that cannot open a present device is a bug to see.
fn pool(options: PoolOptions) -> Option<DevicePool> {
    if !driver_available() {
        return skip("the CUDA driver library (libcuda) is not present");
    }
    match device_count() {
        Ok(0) => return skip("no CUDA device"),
        Err(e) => panic!("the driver is present, but counting devices failed: {e}"),
        Ok(_) => {}
    }
    Some(DevicePool::new(0, options).expect("a pool on device 0"))
}

#[test]
fn no_driver_is_an_error_not_a_panic() {
    let _gpu = serial();
    if driver_available() {
        println!("skipping: a driver is present");
        return;
    }
    assert_eq!(
        DevicePool::new(0, PoolOptions::default()).unwrap_err(),
        PoolError::DriverNotFound
    );
    assert_eq!(
        DevicePool::for_all_devices(PoolOptions::default()).unwrap_err(),
        PoolError::DriverNotFound
    );
    assert_eq!(device_count().unwrap_err(), PoolError::DriverNotFound);
}

#[test]
fn data_round_trips() {
    let _gpu = serial();
    let Some(pool) = pool(PoolOptions::with_limit(512 * MIB)) else {
        return;
    };
    let stream = pool.context().default_stream();
    for n in [1usize, 63, 64, 1000, 1 << 18, (10 << 20) / 4 + 3] {
        let host: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
        let buf = pool.clone_htod(&stream, &host).unwrap();
        assert_eq!(stream.clone_dtoh(&buf).unwrap(), host);
        // Device to device between pool buffers.
        // SAFETY: overwritten by the copy before it is read.
        let mut copy: DeviceBuffer<f32> = unsafe { pool.alloc(&stream, n) }.unwrap();
        stream.memcpy_dtod(&buf, &mut copy).unwrap();
        let mut back = vec![0f32; n];
        stream.memcpy_dtoh(&copy, &mut back).unwrap();
        assert_eq!(back, host);
        let zeros = pool.alloc_zeros::<u32>(&stream, n).unwrap();
        assert!(stream.clone_dtoh(&zeros).unwrap().iter().all(|&x| x == 0));
    }
    stream.synchronize().unwrap();
    pool.synchronize();
    let s = pool.stats();
    assert_eq!(s.allocator.bytes_in_use, 0);
    assert!(s.device_total > 0);
    pool.check_err().unwrap();
}

#[test]
fn eight_threads_with_their_own_streams() {
    let _gpu = serial();
    let Some(pool) = pool(PoolOptions::with_limit(1 << 30)) else {
        return;
    };
    let ctx = pool.context();
    std::thread::scope(|scope| {
        for t in 0..8u32 {
            let pool = pool.clone();
            let stream = ctx.new_stream().unwrap();
            scope.spawn(move || {
                let mut held = Vec::new();
                for i in 0..200u32 {
                    let n = 1 + ((t as usize * 7919 + i as usize * 104_729) % (256 << 10));
                    let tag = (t << 24) | i;
                    let host = vec![tag; n];
                    held.push((pool.clone_htod(&stream, &host).unwrap(), tag));
                    if held.len() > 6 {
                        let (b, tag) = held.remove(i as usize % held.len());
                        let back = stream.clone_dtoh(&b).unwrap();
                        assert!(back.iter().all(|&x| x == tag), "thread {t}: corrupted");
                    }
                }
                for (b, tag) in held {
                    assert!(stream.clone_dtoh(&b).unwrap().iter().all(|&x| x == tag));
                }
            });
        }
    });
    pool.synchronize();
    assert_eq!(pool.stats().allocator.bytes_in_use, 0);
    pool.check_err().unwrap();
}

#[test]
fn oom_at_the_limit_then_recovery() {
    let _gpu = serial();
    let Some(pool) = pool(PoolOptions::with_limit(64 * MIB)) else {
        return;
    };
    let stream = pool.context().default_stream();
    let mut held = Vec::new();
    let err = loop {
        match pool.alloc_zeros::<u8>(&stream, 6 * MIB) {
            Ok(b) => held.push(b),
            Err(e) => break e,
        }
        assert!(held.len() < 100, "the limit was not enforced");
    };
    let PoolError::OutOfMemory(oom) = &err else {
        panic!("expected out of memory, got {err}")
    };
    println!("{err}");
    assert_eq!(oom.limit, 64 * MIB);
    assert!(oom.reserved <= 64 * MIB);
    assert!(oom.device_total > 0);
    held.clear();
    let again: Vec<_> = (0..4)
        .map(|_| pool.alloc_zeros::<u8>(&stream, 6 * MIB).unwrap())
        .collect();
    drop(again);
    stream.synchronize().unwrap();
    pool.synchronize();
    pool.check_err().unwrap();
}

const SPIN_FILL: &str = r#"
extern "C" __global__ void spin_fill(unsigned int *p, unsigned long long n, unsigned int v,
                                     long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        p[i] = v;
    }
}
"#;

fn spin_fill_kernel(ctx: &Arc<CudaContext>) -> Option<CudaFunction> {
    // SAFETY: only tries to load the NVRTC library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return skip("NVRTC (libnvrtc) is not present");
    }
    let ptx = cudarc::nvrtc::compile_ptx(SPIN_FILL).expect("NVRTC compiles the test kernel");
    Some(
        ctx.load_module(ptx)
            .unwrap()
            .load_function("spin_fill")
            .unwrap(),
    )
}

fn launch_spin_fill(
    stream: &Arc<CudaStream>,
    f: &CudaFunction,
    buf: &DeviceBuffer<u32>,
    value: u32,
    cycles: i64,
) {
    let n = buf.len() as u64;
    let mut b = stream.launch_builder(f);
    b.arg(buf).arg(&n).arg(&value).arg(&cycles);
    // SAFETY: the kernel writes `n` u32 values to a buffer of `n` u32.
    unsafe { b.launch(LaunchConfig::for_num_elems(4096)) }.unwrap();
}

/// Waits for the context's work and the pool's pending frees, then checks that neither recorded
/// an error.
fn settle(pool: &DevicePool) {
    let ctx = pool.context();
    ctx.synchronize().unwrap();
    pool.synchronize();
    pool.check_err().unwrap();
    ctx.check_err().unwrap();
}

#[test]
fn a_buffer_still_written_on_stream_a_does_not_corrupt_the_next_owner_on_b() {
    let _gpu = serial();
    let Some(pool) = pool(PoolOptions::with_limit(256 * MIB)) else {
        return;
    };
    let ctx = pool.context();
    let Some(f) = spin_fill_kernel(&ctx) else {
        return;
    };
    let a = ctx.new_stream().unwrap();
    let b = ctx.new_stream().unwrap();
    let n = 4 * MIB;
    // About half a second of spinning at ~2 GHz before the kernel writes.
    let cycles = 1_000_000_000i64;

    // SAFETY: written by the kernel before any read.
    let old: DeviceBuffer<u32> = unsafe { pool.alloc(&a, n) }.unwrap();
    let old_addr = old.device_address();
    launch_spin_fill(&a, &f, &old, 0xdead_beef, cycles);
    drop(old); // freed while the kernel still runs on A

    // The next owner on B must not get that memory while A's kernel may still write it.
    let host = vec![0x1234_5678u32; n];
    let new = pool.clone_htod(&b, &host).unwrap();
    b.synchronize().unwrap();
    a.synchronize().unwrap();
    let back = b.clone_dtoh(&new).unwrap();
    assert!(
        back.iter().all(|&x| x == 0x1234_5678),
        "stream A's kernel corrupted stream B's buffer (reused address: {})",
        new.device_address() == old_addr
    );
    drop(new);

    // Same stream: the block is reused at once, and stream order keeps the data correct.
    // SAFETY: written by the kernel before any read.
    let old: DeviceBuffer<u32> = unsafe { pool.alloc(&a, n) }.unwrap();
    let old_addr = old.device_address();
    launch_spin_fill(&a, &f, &old, 0xdead_beef, cycles / 4);
    drop(old);
    let again = pool.clone_htod(&a, &host).unwrap();
    assert_eq!(again.device_address(), old_addr, "same-stream reuse");
    assert!(a
        .clone_dtoh(&again)
        .unwrap()
        .iter()
        .all(|&x| x == 0x1234_5678));

    // A use on another stream through `DevicePtrMut` is ordered after the home stream's work.
    // SAFETY: written by the kernel before any read.
    let mut buf: DeviceBuffer<u32> = unsafe { pool.alloc(&a, n) }.unwrap();
    launch_spin_fill(&a, &f, &buf, 0xdead_beef, cycles / 4);
    b.memcpy_htod(&host, &mut buf).unwrap(); // waits for A's kernel first
    b.synchronize().unwrap();
    assert!(a
        .clone_dtoh(&buf)
        .unwrap()
        .iter()
        .all(|&x| x == 0x1234_5678));
    drop(buf);
    drop(again);
    settle(&pool);
}

#[test]
fn a_pool_for_every_device() {
    let _gpu = serial();
    let Some(_) = pool(PoolOptions::default()) else {
        return;
    };
    let pools = DevicePool::for_all_devices(PoolOptions::with_limit(64 * MIB)).unwrap();
    assert_eq!(pools.len(), device_count().unwrap());
    for (i, p) in pools.iter().enumerate() {
        assert_eq!(p.ordinal(), i);
        let s = p.context().default_stream();
        let b = p.clone_htod(&s, &[i as u32; 100]).unwrap();
        assert_eq!(s.clone_dtoh(&b).unwrap(), vec![i as u32; 100]);
    }
}

#[test]
fn a_per_thread_stream_is_refused() {
    let _gpu = serial();
    let Some(pool) = pool(PoolOptions::with_limit(64 * MIB)) else {
        return;
    };
    let s = pool.context().per_thread_stream();
    // SAFETY: never read.
    let e = unsafe { pool.alloc::<u8>(&s, 1024) }.unwrap_err();
    assert!(e.to_string().contains("per-thread"), "{e}");
}

#[test]
fn trim_after_the_stream_is_idle_returns_the_memory() {
    let _gpu = serial();
    let Some(pool) = pool(PoolOptions::with_limit(256 * MIB)) else {
        return;
    };
    let s = pool.context().new_stream().unwrap();
    let buf = pool.clone_htod(&s, &vec![7u32; 1 << 20]).unwrap();
    drop(buf);
    assert_eq!(pool.stats().pending_blocks, 1);
    s.synchronize().unwrap();
    assert!(
        pool.trim() > 0,
        "an idle stream's free block goes back at once"
    );
    let st = pool.stats();
    assert_eq!((st.pending_blocks, st.allocator.bytes_reserved), (0, 0));
    pool.check_err().unwrap();
}

/// What comes after a copy into a buffer on another stream than its home: a read on a third
/// stream, or a kernel on the home stream.
#[derive(Clone, Copy)]
enum After {
    ReadOnAnotherStream,
    KernelOnHome,
}

/// Stream 1 is busy for about half a second, then copies into `buf` (a use on another stream than
/// buf's home); what comes `after` must see that copy.
fn a_use_after_a_copy_on_another_stream_sees_it(after: After) {
    let _gpu = serial();
    let Some(pool) = pool(PoolOptions::with_limit(256 * MIB)) else {
        return;
    };
    let ctx = pool.context();
    let Some(f) = spin_fill_kernel(&ctx) else {
        return;
    };
    let (home, s1, s2) = (
        ctx.new_stream().unwrap(),
        ctx.new_stream().unwrap(),
        ctx.new_stream().unwrap(),
    );
    let n = MIB;
    let mut buf = pool.clone_htod(&home, &vec![0x1234_5678u32; n]).unwrap();
    // SAFETY: written by the kernel before any read.
    let slow: DeviceBuffer<u32> = unsafe { pool.alloc(&s1, n) }.unwrap();
    launch_spin_fill(&s1, &f, &slow, 0xdead_beef, 1_000_000_000);
    s1.memcpy_dtod(&slow, &mut buf).unwrap();
    let (seen, expected, what) = match after {
        After::ReadOnAnotherStream => (
            s2.clone_dtoh(&buf).unwrap(),
            0xdead_beef,
            "the read on stream 2 ran before the copy on stream 1",
        ),
        After::KernelOnHome => {
            launch_spin_fill(&home, &f, &buf, 0x42, 0);
            ctx.synchronize().unwrap();
            (
                home.clone_dtoh(&buf).unwrap(),
                0x42,
                "the kernel on the home stream ran before the copy on stream 1",
            )
        }
    };
    assert!(seen.iter().all(|&v| v == expected), "{what}");
    drop((buf, slow));
    settle(&pool);
}

#[test]
fn a_second_use_on_another_stream_waits_for_the_first() {
    a_use_after_a_copy_on_another_stream_sees_it(After::ReadOnAnotherStream);
}

#[test]
fn a_kernel_on_the_home_stream_comes_after_a_use_on_another_stream() {
    a_use_after_a_copy_on_another_stream_sees_it(After::KernelOnHome);
}

#[test]
fn zeroing_waits_for_a_read_on_another_stream() {
    let _gpu = serial();
    let Some(pool) = pool(PoolOptions::with_limit(256 * MIB)) else {
        return;
    };
    let ctx = pool.context();
    let Some(f) = spin_fill_kernel(&ctx) else {
        return;
    };
    let (home, s1) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
    let n = MIB;
    let mut buf = pool.clone_htod(&home, &vec![0x1234_5678u32; n]).unwrap();
    // SAFETY: written by the kernel before any read.
    let slow: DeviceBuffer<u32> = unsafe { pool.alloc(&s1, n) }.unwrap();
    // SAFETY: written by the copy before any read.
    let mut copy: DeviceBuffer<u32> = unsafe { pool.alloc(&s1, n) }.unwrap();
    // Stream 1 is busy for about half a second, then reads `buf` (a use on another stream than
    // buf's home); zeroing `buf` on its idle home stream must wait for that read.
    launch_spin_fill(&s1, &f, &slow, 0xdead_beef, 1_000_000_000);
    s1.memcpy_dtod(&buf, &mut copy).unwrap();
    buf.zero().unwrap();
    let read = s1.clone_dtoh(&copy).unwrap();
    assert!(
        read.iter().all(|&v| v == 0x1234_5678),
        "the memset ran before the read on stream 1"
    );
    let zeroed = home.clone_dtoh(&buf).unwrap();
    assert!(zeroed.iter().all(|&v| v == 0), "the buffer was not zeroed");
    drop((buf, slow, copy));
    settle(&pool);
}

/// A pool with one region, room for two buffers of `n` u32 (16 MiB each): a third must wait for a
/// freed one. One buffer on stream X and one (the victim) on its home stream; `late_use` queues on
/// X, after about half a second, a use of the victim that the free must not outrun, and the victim
/// is freed at once. Stream B then needs the victim's block (the only one that fits), and its data
/// must survive: `what` names the use that would overwrite them.
fn a_freed_block_goes_to_b_after_a_late_use_on_x(
    late_use: impl FnOnce(&CudaFunction, &Streams, &DeviceBuffer<u32>, &mut DeviceBuffer<u32>),
    what: &str,
) {
    let _gpu = serial();
    let n = 4 * MIB;
    let Some(pool) = pool_for_two_buffers() else {
        return;
    };
    let ctx = pool.context();
    let Some(f) = spin_fill_kernel(&ctx) else {
        return;
    };
    let streams = Streams {
        home: ctx.new_stream().unwrap(),
        x: ctx.new_stream().unwrap(),
    };
    let b = ctx.new_stream().unwrap();
    // SAFETY: written by the kernel before any read.
    let on_x: DeviceBuffer<u32> = unsafe { pool.alloc(&streams.x, n) }.unwrap();
    // SAFETY: written by the late use before any read.
    let mut victim: DeviceBuffer<u32> = unsafe { pool.alloc(&streams.home, n) }.unwrap();
    let addr = victim.device_address();
    late_use(&f, &streams, &on_x, &mut victim);
    drop(victim);
    let new = next_owner_keeps_its_data(&pool, &b, n, addr, what);
    drop((on_x, new));
    settle(&pool);
}

/// A pool of one 32 MiB region, which does not grow: room for two buffers of 4 Mi u32.
fn pool_for_two_buffers() -> Option<DevicePool> {
    pool(PoolOptions {
        allow_growth: false,
        ..PoolOptions::with_limit(32 * MIB)
    })
}

/// Stream `b` fills a new buffer of `n` u32, which must take the freed block at `addr`; once the
/// context is idle, the buffer must still hold that fill (`what` names the use that would have
/// overwritten it). Returns the buffer.
fn next_owner_keeps_its_data(
    pool: &DevicePool,
    b: &Arc<CudaStream>,
    n: usize,
    addr: u64,
    what: &str,
) -> DeviceBuffer<u32> {
    let new = pool.clone_htod(b, &vec![0x1234_5678u32; n]).unwrap();
    assert_eq!(
        new.device_address(),
        addr,
        "the test must reuse the freed block"
    );
    pool.context().synchronize().unwrap();
    let back = b.clone_dtoh(&new).unwrap();
    assert!(
        back.iter().all(|&v| v == 0x1234_5678),
        "{what} overwrote the block's next owner"
    );
    new
}

/// The victim's home stream and stream X of [`a_freed_block_goes_to_b_after_a_late_use_on_x`].
struct Streams {
    home: Arc<CudaStream>,
    x: Arc<CudaStream>,
}

#[test]
fn a_copy_on_another_stream_into_a_freed_buffer_finishes_before_its_memory_is_reused() {
    // A copy into the victim on X (a use on another stream than its home, which the pool orders).
    a_freed_block_goes_to_b_after_a_late_use_on_x(
        |f, s, src, dst| {
            launch_spin_fill(&s.x, f, src, 0xdead_beef, 1_000_000_000);
            s.x.memcpy_dtod(src, dst).unwrap();
        },
        "stream X's copy",
    );
}

/// The README leaves a kernel argument on another stream than the buffer's home to the caller, who
/// may order it by making the home stream wait for it before the free. An idle home stream's frees
/// go back without an event, after a stream query: this checks that the query counts the wait.
#[test]
fn a_free_after_the_home_stream_waits_for_a_kernel_elsewhere_is_not_reused_early() {
    a_freed_block_goes_to_b_after_a_late_use_on_x(
        |f, s, _, victim| {
            // The home stream has no work of its own, only the wait.
            launch_spin_fill(&s.x, f, victim, 0xdead_beef, 1_000_000_000);
            s.home.join(&s.x).unwrap();
        },
        "the kernel on stream X",
    );
}

/// A block freed while its stream's kernel still writes it sits in the thread's stream cache. A
/// hundred frees on another stream make it stale, and the cache gives it up to its stream's queue;
/// a third stream that then needs it (the pool is at its limit) must not write it before that
/// kernel has. This runs the stream cache's eviction (and the drain of a full engine) against a
/// real kernel.
#[test]
fn a_stale_block_given_up_by_its_cache_waits_for_its_stream_before_another_reuses_it() {
    let _gpu = serial();
    let n = 4 * MIB; // u32: 16 MiB
    let Some(pool) = pool_for_two_buffers() else {
        return;
    };
    let ctx = pool.context();
    let Some(f) = spin_fill_kernel(&ctx) else {
        return;
    };
    let (a, b, c) = (
        ctx.new_stream().unwrap(),
        ctx.new_stream().unwrap(),
        ctx.new_stream().unwrap(),
    );
    // SAFETY: written by the kernel before any read.
    let victim: DeviceBuffer<u32> = unsafe { pool.alloc(&a, n) }.unwrap();
    let addr = victim.device_address();
    // Leaves 8 MiB of the region free: room for the small blocks below, not for B's buffer.
    // SAFETY: never read.
    let blocker: DeviceBuffer<u32> = unsafe { pool.alloc(&b, n / 2) }.unwrap();
    launch_spin_fill(&a, &f, &victim, 0xdead_beef, 1_000_000_000);
    drop(victim); // into the cache, while the kernel still runs on A

    // Fill the cache with 15 blocks of stream C, then free 100 blocks of another size on C. The
    // frees find the cache full, and go to C's queue, until the victim is stale (64 frees after
    // its own, the pool's STALE_FREES: the 49th here); that free takes the victim's place, which
    // goes to A's queue, and the rest hit the cache. (Were the victim still cached, B's miss
    // below would drain it all the same: only the mutant check in the commit that added this test
    // tells the two apart.)
    let small: Vec<DeviceBuffer<u32>> = (0..15)
        // SAFETY: never read.
        .map(|_| unsafe { pool.alloc::<u32>(&c, 1024) }.unwrap())
        .collect();
    drop(small);
    for _ in 0..100 {
        // SAFETY: never read.
        drop(unsafe { pool.alloc::<u32>(&c, 2048) }.unwrap());
    }

    let new = next_owner_keeps_its_data(&pool, &b, n, addr, "stream A's kernel");
    drop((blocker, new));
    settle(&pool);
}

const CHECK: &str = r#"
extern "C" __global__ void check(const unsigned int *p, unsigned long long n, unsigned int v,
                                 long long cycles, unsigned int *errors) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        if (p[i] != v) { atomicAdd(errors, 1u); }
    }
}
"#;

/// Random traffic on four streams: buffers filled by kernels on their home stream (after a random
/// delay), copied on other streams (half of the sources freed right after), and freed after a
/// kernel on the home stream that waits a while and then checks every value, all in a pool whose
/// limit forces reuse across streams and out-of-memory waits. Any block handed to a stream before its old owner's work (a late check,
/// a copy on another stream) has finished shows up as a wrong value in some check.
#[test]
fn random_traffic_on_four_streams_never_changes_a_live_buffer() {
    let _gpu = serial();
    let Some(pool) = pool(PoolOptions::with_limit(48 * MIB)) else {
        return;
    };
    let ctx = pool.context();
    let Some(fill) = spin_fill_kernel(&ctx) else {
        return;
    };
    let check = ctx
        .load_module(cudarc::nvrtc::compile_ptx(CHECK).expect("NVRTC compiles the check kernel"))
        .unwrap()
        .load_function("check")
        .unwrap();
    let streams: Vec<_> = (0..4).map(|_| ctx.new_stream().unwrap()).collect();
    // The error count lives outside the pool, as a raw address, so that cudarc orders nothing
    // between the streams on its account.
    ctx.bind_to_thread().unwrap();
    // SAFETY: 4 bytes, zeroed before use, freed at the end after the context is idle.
    let errors = unsafe { cudarc::driver::result::malloc_sync(4) }.unwrap();
    // SAFETY: `errors` is a live 4-byte allocation.
    unsafe { cudarc::driver::result::memset_d8_sync(errors, 0, 4) }.unwrap();
    let launch_check = |s: usize, buf: &DeviceBuffer<u32>, v: u32, cycles: i64| {
        let n = buf.len() as u64;
        let mut b = streams[s].launch_builder(&check);
        b.arg(buf).arg(&n).arg(&v).arg(&cycles).arg(&errors);
        // SAFETY: the kernel reads `n` u32 values of a buffer of `n`, and adds to a live u32.
        unsafe { b.launch(LaunchConfig::for_num_elems(4096)) }.unwrap();
    };

    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    // (buffer, home stream, value)
    let mut live: Vec<(DeviceBuffer<u32>, usize, u32)> = Vec::new();
    let (mut tag, mut ooms, mut copies) = (0u32, 0, 0);
    for _ in 0..4000 {
        let r = next();
        match r % 10 {
            0..=4 if live.len() < 40 => {
                let s = (r >> 8) as usize % streams.len();
                let n = 1024 + (r >> 16) as usize % (512 << 10); // 4 KiB .. 2 MiB
                                                                 // SAFETY: filled by the kernel before any read.
                match unsafe { pool.alloc::<u32>(&streams[s], n) } {
                    Ok(buf) => {
                        tag += 1;
                        launch_spin_fill(&streams[s], &fill, &buf, tag, (r >> 40) as i64 % 100_000);
                        live.push((buf, s, tag));
                    }
                    Err(PoolError::OutOfMemory(_)) => ooms += 1,
                    Err(e) => panic!("{e}"),
                }
            }
            5 | 6 if !live.is_empty() => {
                // A copy on another stream (a use of the source there), checked on that stream.
                let i = (r >> 8) as usize % live.len();
                let t = (live[i].1 + 1 + (r >> 16) as usize % 3) % streams.len();
                let n = live[i].0.len();
                // SAFETY: written by the copy before any read.
                match unsafe { pool.alloc::<u32>(&streams[t], n) } {
                    Ok(mut dst) => {
                        streams[t].memcpy_dtod(&live[i].0, &mut dst).unwrap();
                        let v = live[i].2;
                        launch_check(t, &dst, v, 0);
                        if r >> 32 & 1 == 1 {
                            // Copy out, then free the source at once: its next owner must not
                            // write it before the copy (queued behind stream t's work) has read it.
                            drop(live.swap_remove(i));
                        }
                        live.push((dst, t, v));
                        copies += 1;
                    }
                    Err(PoolError::OutOfMemory(_)) => ooms += 1,
                    Err(e) => panic!("{e}"),
                }
            }
            _ if !live.is_empty() => {
                // A late check on the home stream, then the free: the block's next owner must not
                // write it before the check has read it.
                let (buf, s, v) = live.swap_remove((r >> 8) as usize % live.len());
                launch_check(s, &buf, v, (r >> 40) as i64 % 1_000_000);
                drop(buf);
            }
            _ => {}
        }
    }
    for (buf, s, v) in live.drain(..) {
        launch_check(s, &buf, v, 0);
    }
    ctx.synchronize().unwrap();
    let mut found = [0u32; 1];
    // SAFETY: the context is idle; `errors` holds 4 bytes.
    unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut found, errors) }.unwrap();
    // SAFETY: nothing uses `errors` any more.
    unsafe { cudarc::driver::result::free_sync(errors) }.unwrap();
    println!("{tag} buffers, {copies} copies, {ooms} out-of-memory refusals");
    assert_eq!(found[0], 0, "wrong values seen by the checks");
    assert!(
        tag > 1000 && copies > 300,
        "the traffic was too thin to test"
    );
    pool.synchronize();
    assert_eq!(pool.stats().allocator.bytes_in_use, 0);
    pool.check().unwrap();
    pool.check_err().unwrap();
    ctx.check_err().unwrap();
}
