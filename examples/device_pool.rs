//! Allocates device buffers from a BFC pool, copies data through them, launches a kernel when NVRTC
//! is available (and can compile it for this driver), and prints the pool's statistics. Without a
//! driver or GPU it says so and exits 0, or fails when `BFC_REQUIRE_GPU=1`.
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

/// Whether `BFC_REQUIRE_GPU=1`: on a GPU machine, a skipped step must fail instead.
fn gpu_required() -> bool {
    std::env::var("BFC_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

/// Says why there is nothing to run on: `Ok` (exit 0), or an error when a GPU is required.
fn nothing_to_run(reason: &str) -> Result<(), Box<dyn std::error::Error>> {
    if gpu_required() {
        return Err(format!("BFC_REQUIRE_GPU=1, but {reason}").into());
    }
    println!("{reason}: nothing to run on; exiting");
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if !driver_available() {
        return nothing_to_run("no CUDA driver found (libcuda is not installed)");
    }
    match device_count() {
        Ok(0) => return nothing_to_run("the CUDA driver reports no device"),
        Err(e) => return nothing_to_run(&format!("cannot query CUDA devices ({e})")),
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
    let kernel = if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        // An NVRTC newer than the driver makes PTX the driver cannot load: skip, as without NVRTC.
        match cudarc::nvrtc::compile_ptx(SCALE)
            .map_err(|e| e.to_string())
            .and_then(|ptx| {
                ctx.load_module(ptx)
                    .and_then(|m| m.load_function("scale"))
                    .map_err(|e| e.to_string())
            }) {
            Ok(f) => Some(f),
            Err(e) if gpu_required() => {
                return Err(
                    format!("BFC_REQUIRE_GPU=1, but the kernel cannot be built: {e}").into(),
                );
            }
            Err(e) => {
                println!("cannot build the kernel ({e}): skipping the kernel launch");
                None
            }
        }
    } else {
        println!("NVRTC not found: skipping the kernel launch");
        None
    };
    if let Some(f) = kernel {
        let len = n as u64;
        let mut launch = stream.launch_builder(&f);
        launch.arg(&mut x).arg(&len).arg(&2.0f32);
        // SAFETY: `scale` reads and writes `n` floats of a buffer of `n` floats.
        unsafe { launch.launch(LaunchConfig::for_num_elems(n as u32)) }?;
        let back = stream.clone_dtoh(&x)?;
        assert!(back.iter().enumerate().all(|(i, &v)| v == 2.0 * i as f32));
        println!("scaled {n} floats with a kernel");
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
