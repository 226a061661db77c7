//! Where regions come from.

use core::ptr::NonNull;

use super::chunk::ChunkHandle;

/// A supplier of address ranges ("regions") for the engine, and of the zero-filled side storage that
/// indexes them.
///
/// The engine never reads or writes region memory; it only does arithmetic on addresses. That is what
/// lets the same engine manage host memory, GPU memory, or plain numbers in a test.
///
/// # Safety
///
/// Implementors promise:
/// - `alloc_region` returns ranges `[base, base + size)` that do not overlap each other or any range
///   still live, whose end `base + size` is representable in a `usize` (a range may not wrap around
///   the address space, nor end at its very top), whose `base` is a multiple of the requested `align`,
///   and that stay owned by the engine until `free_region`;
/// - `alloc_map` returns memory for `entries` values of `Option<ChunkHandle>` that is zero-filled,
///   suitably aligned, writable, not aliased by anything else, and valid until `free_map`;
/// - no method calls back into the engine, or into an allocator the engine serves (a source behind a
///   global allocator must not allocate through it).
///
/// Debug builds of the engine check each region it gets (alignment, no wrap, no overlap with the
/// regions it holds) and panic on a breach; release builds trust the source.
pub unsafe trait MemorySource {
    /// Returns the base of a new region of exactly `size` bytes aligned to `align` (a power of two at
    /// least the engine's granule), or `None` if the source cannot supply it. A base of 0 is allowed:
    /// the engine then hands out 0 as a block address (see [`Bfc`](super::Bfc)).
    fn alloc_region(&mut self, size: usize, align: usize) -> Option<usize>;

    /// Gives a region back.
    ///
    /// # Safety
    ///
    /// - `base` and `size` are exactly those of a region obtained from `alloc_region` and not yet freed;
    /// - nothing in the region is in use any more.
    unsafe fn free_region(&mut self, base: usize, size: usize);

    /// Returns zero-filled storage for the pointer map of the region at `region_base` (`entries`
    /// values), or `None`.
    ///
    /// The map has one entry per block of the region, and the engine reads or writes the entry of a
    /// block only once a chunk has started in that block or an earlier one (the region's first
    /// chunk, or one made by a split): every entry past the highest block where a chunk started is
    /// left alone. So a source that knows how far chunks can start (the host arena: below its
    /// committed memory) may commit the map's storage lazily, in step with that.
    fn alloc_map(
        &mut self,
        region_base: usize,
        entries: usize,
    ) -> Option<NonNull<Option<ChunkHandle>>>;

    /// Releases map storage.
    ///
    /// # Safety
    ///
    /// `map` and `entries` are exactly those of a live `alloc_map` result, and the engine no longer
    /// uses it.
    unsafe fn free_map(
        &mut self,
        region_base: usize,
        map: NonNull<Option<ChunkHandle>>,
        entries: usize,
    );
}
