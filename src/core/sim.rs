//! A simulated memory source: address ranges only, nothing behind them.
//!
//! Used by the core's tests, the loom models and the device pool's CPU tests. It hands out ranges of a
//! made-up address space, can be told to refuse requests, and records what it was asked.

extern crate std;

use core::ptr::NonNull;
use std::vec::Vec;

use super::maps::HeapMaps;
use super::{ChunkHandle, MemorySource};

/// A fake address space `[base, base + capacity)` carved into regions first-fit.
#[derive(Debug)]
pub struct SimSource {
    base: usize,
    capacity: usize,
    /// Free address ranges, sorted by start.
    free: Vec<(usize, usize)>,
    /// Live regions.
    live: Vec<(usize, usize)>,
    /// Live maps.
    maps: HeapMaps,
    /// Requests larger than this are refused.
    pub refuse_above: usize,
    /// Pointer maps of more entries than this are refused (as by a host out of memory).
    pub refuse_maps_above: usize,
    /// Every `alloc_region` size asked for, in order.
    pub requests: Vec<usize>,
    /// Number of regions freed.
    pub regions_freed: usize,
}

impl SimSource {
    /// An address space of `capacity` bytes at `base` (which should be aligned generously, e.g. to
    /// 1 GiB, so that aligned requests are easy to satisfy).
    ///
    /// # Panics
    ///
    /// If `base + capacity` overflows: the source promises regions that do not wrap around the
    /// address space.
    pub fn new(base: usize, capacity: usize) -> Self {
        assert!(
            base.checked_add(capacity).is_some(),
            "SimSource: base + capacity wraps around the address space"
        );
        SimSource {
            base,
            capacity,
            free: std::vec![(base, capacity)],
            live: Vec::new(),
            maps: HeapMaps::new(),
            refuse_above: usize::MAX,
            refuse_maps_above: usize::MAX,
            requests: Vec::new(),
            regions_freed: 0,
        }
    }

    /// Bytes currently handed out as regions.
    pub fn bytes_live(&self) -> usize {
        self.live.iter().map(|r| r.1).sum()
    }

    /// Number of live regions.
    pub fn regions_live(&self) -> usize {
        self.live.len()
    }

    /// The whole simulated range.
    pub fn range(&self) -> (usize, usize) {
        (self.base, self.capacity)
    }
}

// SAFETY: regions are carved from disjoint free ranges and returned there only on `free_region`;
// maps are fresh zeroed boxes owned here until `free_map`; nothing calls into the engine.
unsafe impl MemorySource for SimSource {
    fn alloc_region(&mut self, size: usize, align: usize) -> Option<usize> {
        self.requests.push(size);
        if size > self.refuse_above || size == 0 {
            return None;
        }
        for i in 0..self.free.len() {
            let (start, len) = self.free[i];
            let aligned = start.checked_add(align - 1)? & !(align - 1);
            let pad = aligned - start;
            if len < pad || len - pad < size {
                continue;
            }
            self.free.remove(i);
            let tail = len - pad - size;
            if tail > 0 {
                self.free.insert(i, (aligned + size, tail));
            }
            if pad > 0 {
                self.free.insert(i, (start, pad));
            }
            self.live.push((aligned, size));
            return Some(aligned);
        }
        None
    }

    unsafe fn free_region(&mut self, base: usize, size: usize) {
        let i = self
            .live
            .iter()
            .position(|&r| r == (base, size))
            .expect("SimSource: free of a region it did not hand out");
        self.live.swap_remove(i);
        self.regions_freed += 1;
        let at = self.free.partition_point(|r| r.0 < base);
        self.free.insert(at, (base, size));
        // Merge with neighbours.
        if at + 1 < self.free.len() && self.free[at].0 + self.free[at].1 == self.free[at + 1].0 {
            self.free[at].1 += self.free[at + 1].1;
            self.free.remove(at + 1);
        }
        if at > 0 && self.free[at - 1].0 + self.free[at - 1].1 == self.free[at].0 {
            self.free[at - 1].1 += self.free[at].1;
            self.free.remove(at);
        }
    }

    fn alloc_map(
        &mut self,
        region_base: usize,
        entries: usize,
    ) -> Option<NonNull<Option<ChunkHandle>>> {
        if entries > self.refuse_maps_above {
            return None;
        }
        self.maps.alloc(region_base, entries)
    }

    unsafe fn free_map(
        &mut self,
        region_base: usize,
        map: NonNull<Option<ChunkHandle>>,
        _entries: usize,
    ) {
        assert!(
            self.maps.free(region_base, map),
            "SimSource: free of a map it did not hand out"
        );
    }
}
