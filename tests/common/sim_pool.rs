//! Pools on the simulated device for the device-pool tests (`cuda_pool_sim`, `cuda_pool_threads`).
// Each includer uses some of these.
#![allow(dead_code)]

use bfc_alloc::cuda::{
    DeviceBackend, DeviceBuffer, DevicePool, PoolError, PoolOptions, SimBackend, SimDevice,
    SimStream,
};

pub const MIB: usize = 1 << 20;
pub const GIB: usize = 1 << 30;

pub type Pool = DevicePool<SimBackend>;

pub fn pool(dev: &SimDevice, options: PoolOptions) -> Pool {
    DevicePool::with_backend(dev.backend(), options).unwrap()
}

pub fn alloc(
    pool: &Pool,
    s: SimStream,
    bytes: usize,
) -> Result<DeviceBuffer<u8, SimBackend>, PoolError> {
    // SAFETY: simulated memory is never read.
    unsafe { pool.alloc::<u8>(&s, bytes) }
}

/// Asserts that the pool is consistent and that every block came back: none pending, none in use.
pub fn assert_all_back<B: DeviceBackend>(p: &DevicePool<B>) {
    p.check().unwrap();
    let s = p.stats();
    assert_eq!((s.pending_blocks, s.allocator.bytes_in_use), (0, 0));
}

/// Streams that take the pool's lock for every call (the simulator gives streams 0 to 2 no stream
/// cache).
pub const A: SimStream = SimStream(1);
pub const B: SimStream = SimStream(2);
/// Streams that take stream caches (see `SimBackend::same_stream`).
pub const C: SimStream = SimStream(3);
pub const D: SimStream = SimStream(4);
