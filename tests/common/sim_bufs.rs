//! A live buffer of the random device-pool tests on the simulated device: bytes, or an element type
//! aligned beyond the pool's granule (each includer has its own `P`).
// Each includer uses some of the methods.
#![allow(dead_code)]

use bfc_alloc::cuda::{DeviceBuffer, SimBackend, SimStream};

pub enum AnyBuf<P> {
    Bytes(DeviceBuffer<u8, SimBackend>),
    Pages(DeviceBuffer<P, SimBackend>),
}

impl<P> AnyBuf<P> {
    /// Its block: `(address, size)`.
    pub fn block(&self) -> (u64, usize) {
        match self {
            AnyBuf::Bytes(b) => (b.device_address(), b.block_size()),
            AnyBuf::Pages(b) => (b.device_address(), b.block_size()),
        }
    }

    /// `[lo, hi)`: the whole block.
    pub fn range(&self) -> (u64, u64) {
        let (lo, size) = self.block();
        (lo, lo + size as u64)
    }

    pub fn home(&self) -> SimStream {
        match self {
            AnyBuf::Bytes(b) => *b.home_stream(),
            AnyBuf::Pages(b) => *b.home_stream(),
        }
    }

    pub fn simulate_use(&self, stream: SimStream) -> u64 {
        match self {
            AnyBuf::Bytes(b) => b.simulate_use(stream),
            AnyBuf::Pages(b) => b.simulate_use(stream),
        }
    }

    pub fn simulate_launch(&self) -> u64 {
        match self {
            AnyBuf::Bytes(b) => b.simulate_launch(),
            AnyBuf::Pages(b) => b.simulate_launch(),
        }
    }
}
