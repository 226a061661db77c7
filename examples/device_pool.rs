//! Allocates device buffers from a BFC pool, copies data through them, launches a kernel when NVRTC
//! is available, and prints the pool's statistics. Without a driver or GPU it says so and exits 0.
//!
//! ```sh
//! cargo run --release --features cuda --example device_pool
//! ```

use bfc_alloc::cuda::{device_count, driver_available, DeviceBuffer, DevicePool, PoolOptions};
use cudarc::driver::{LaunchConfig, PushKernelArg};

const SCALE: &str = r#"
extern "C" __global__ void scale(float *x, unsigned long long n, float a) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) x[i] *= a;
}
"#;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if !driver_available() {
        println!("no CUDA driver found (libcuda is not installed): nothing to run on; exiting");
        return Ok(());
    }
    match device_count() {
        Ok(0) => {
            println!("the CUDA driver reports no device: nothing to run on; exiting");
            return Ok(());
        }
        Err(e) => {
            println!("cannot query CUDA devices ({e}): nothing to run on; exiting");
            return Ok(());
        }
        Ok(_) => {}
    }

    let pool = DevicePool::new(0, PoolOptions::default())?;
    let ctx = pool.context();
    let stream = ctx.default_stream();
    println!(
        "device 0: {}, pool limit {} MiB",
        ctx.name()?,
        pool.limit() >> 20
    );

    // Copies through pool buffers.
    let n = 1 << 20;
    let host: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let mut x = pool.clone_htod(&stream, &host)?;
    // SAFETY: overwritten by the copy below before any read.
    let mut y: DeviceBuffer<f32> = unsafe { pool.alloc(&stream, n) }?;
    stream.memcpy_dtod(&x, &mut y)?;
    assert_eq!(stream.clone_dtoh(&y)?, host);
    println!(
        "copied {} MiB host -> device -> device -> host",
        (n * 4) >> 20
    );

    // A kernel on a pool buffer, if NVRTC is there to compile it.
    // SAFETY: only tries to load the NVRTC library.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        let ptx = cudarc::nvrtc::compile_ptx(SCALE)?;
        let f = ctx.load_module(ptx)?.load_function("scale")?;
        let len = n as u64;
        let mut launch = stream.launch_builder(&f);
        launch.arg(&mut x).arg(&len).arg(&2.0f32);
        // SAFETY: `scale` reads and writes `n` floats of a buffer of `n` floats.
        unsafe { launch.launch(LaunchConfig::for_num_elems(n as u32)) }?;
        let back = stream.clone_dtoh(&x)?;
        assert!(back.iter().enumerate().all(|(i, &v)| v == 2.0 * i as f32));
        println!("scaled {n} floats with a kernel");
    } else {
        println!("NVRTC not found: skipping the kernel launch");
    }

    // Churn: many sizes, freed and reused.
    for round in 0..100usize {
        let bufs: Vec<DeviceBuffer<u8>> = (0..16)
            .map(|i| pool.alloc_zeros::<u8>(&stream, 256 << ((round + i) % 16)))
            .collect::<Result<_, _>>()?;
        drop(bufs);
    }
    drop((x, y));
    stream.synchronize()?;
    println!("\n{}", pool.stats());
    let released = pool.synchronize();
    println!("\nreturned {} MiB to the driver", released >> 20);
    pool.check_err()?;
    Ok(())
}
