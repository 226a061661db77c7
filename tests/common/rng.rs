//! The xorshift generator and log-uniform sizes shared by tests, benches and examples. `log_size`
//! maps a draw to a size as bench-peers' does (its generator is splitmix64, so the sequences
//! differ; the size distribution is the same).
// Each includer uses some of the methods.
#![allow(dead_code)]

pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Log-uniform in `lo..=hi` (bench-peers' `log_size`).
    pub fn log_size(&mut self, lo: usize, hi: usize) -> usize {
        let u = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        let (a, b) = ((lo as f64).ln(), (hi as f64).ln());
        ((a + u * (b - a)).exp() as usize).clamp(lo, hi)
    }

    /// Log-uniform in `lo..hi`: the same draw, with `hi` itself taken as `hi - 1`.
    pub fn log_uniform(&mut self, lo: usize, hi: usize) -> usize {
        self.log_size(lo, hi).min(hi - 1)
    }
}
