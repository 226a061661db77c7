//! The device pool's chunk table costs no resident host memory until its records are used. (A test
//! binary of its own: the resident-memory reading must not see other tests' allocations.)

use bfc_alloc::cuda::{DevicePool, PoolOptions, SimDevice, SimStream};

/// This process's resident memory, in bytes (`VmRSS`).
fn rss() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: usize = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb << 10
}

#[test]
fn a_large_chunk_table_stays_untouched_until_used() {
    // glibc's calloc writes every byte when a perturb byte is set, fresh pages or not.
    if std::env::var_os("MALLOC_PERTURB_").is_some_and(|v| !v.is_empty() && v != "0") {
        println!("skipping: MALLOC_PERTURB_ is set, so calloc touches every page");
        return;
    }
    let dev = SimDevice::new(1 << 30);
    let before = rss();
    // 2^21 records of 32 bytes: a 64 MiB table.
    let pool = DevicePool::with_backend(
        dev.backend(),
        PoolOptions {
            chunk_capacity: 1 << 21,
            ..PoolOptions::with_limit(256 << 20)
        },
    )
    .unwrap();
    // SAFETY: simulated memory is never read.
    let bufs: Vec<_> = (0..1000)
        .map(|_| unsafe { pool.alloc::<u8>(&SimStream(1), 4096) }.unwrap())
        .collect();
    let grown = rss().saturating_sub(before);
    assert!(
        grown < 16 << 20,
        "resident memory grew by {} MiB for a 64 MiB table with 1,000 records used",
        grown >> 20
    );
    drop(bufs);
    pool.synchronize();
    pool.check().unwrap();
    assert_eq!(pool.stats().allocator.bytes_in_use, 0);
}
