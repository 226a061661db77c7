//! The engine's memory source over a device back end.

use core::ptr::NonNull;
use std::format;
use std::vec::Vec;

use super::backend::{BackendError, DeviceBackend};
use crate::core::maps::HeapMaps;
use crate::core::{ChunkHandle, MemorySource};

/// Regions from the driver (`cuMemAlloc`), pointer maps in host memory.
pub(crate) struct DeviceSource<B> {
    pub(crate) backend: B,
    /// Live regions: `(base handed to the engine, pointer from the driver, bytes from the driver)`.
    /// Base and pointer differ only when the driver's pointer was not aligned enough and the region
    /// was over-allocated.
    raw: Vec<(usize, u64, usize)>,
    /// Sum of the live regions' bytes from the driver, padding included.
    raw_bytes: usize,
    /// The pool's limit on `raw_bytes` (the engine's `memory_limit` counts only region sizes, not
    /// the padding of an over-allocated region).
    limit: usize,
    /// Live pointer maps.
    maps: HeapMaps,
    /// The driver's last refusal of a region (for the out-of-memory report).
    pub(crate) last_refusal: Option<BackendError>,
    /// Failures to free a region (surfaced through the pool's deferred errors).
    pub(crate) free_errors: Vec<BackendError>,
}

impl<B: DeviceBackend> DeviceSource<B> {
    pub(crate) fn new(backend: B, limit: usize) -> Self {
        DeviceSource {
            backend,
            raw: Vec::new(),
            raw_bytes: 0,
            limit,
            maps: HeapMaps::new(),
            last_refusal: None,
            free_errors: Vec::new(),
        }
    }

    fn alloc_raw(&mut self, bytes: usize) -> Option<u64> {
        if self
            .raw_bytes
            .checked_add(bytes)
            .is_none_or(|b| b > self.limit)
        {
            self.last_refusal = Some(BackendError::new(
                "cuMemAlloc",
                format!(
                    "not called: {bytes} more bytes would take the pool past its limit of {} \
                     (an over-aligned region's padding counts)",
                    self.limit
                ),
            ));
            return None;
        }
        match self.backend.mem_alloc(bytes) {
            Ok(p) => Some(p),
            Err(e) => {
                self.last_refusal = Some(e);
                None
            }
        }
    }

    fn free_raw(&mut self, ptr: u64) {
        // SAFETY: every pointer passed here came from `mem_alloc` and is freed once (it is removed
        // from `raw` first, or was never recorded); the engine promises nothing in it is in use.
        if let Err(e) = unsafe { self.backend.mem_free(ptr) } {
            self.free_errors.push(e);
        }
    }
}

// SAFETY: regions come from the driver, which never hands out overlapping live ranges; an
// over-allocated region is cut to `[aligned, aligned + size)` inside its allocation; regions stay ours
// until `free_region`. Maps are fresh zeroed boxes owned here until `free_map`. Nothing calls back into
// the engine.
unsafe impl<B: DeviceBackend> MemorySource for DeviceSource<B> {
    fn alloc_region(&mut self, size: usize, align: usize) -> Option<usize> {
        let p = self.alloc_raw(size)?;
        match usize::try_from(p) {
            Ok(base) if base % align == 0 && base.checked_add(size).is_some() => {
                self.raw.push((base, p, size));
                self.raw_bytes += size;
                return Some(base);
            }
            _ => self.free_raw(p),
        }
        // Not aligned enough: over-allocate and align inside.
        let padded = size.checked_add(align)?;
        let p = self.alloc_raw(padded)?;
        let aligned = usize::try_from(p)
            .ok()
            .and_then(|b| b.checked_add(align - 1))
            .map(|b| b & !(align - 1))
            .filter(|b| b.checked_add(size).is_some());
        match aligned {
            Some(base) => {
                self.raw.push((base, p, padded));
                self.raw_bytes += padded;
                Some(base)
            }
            None => {
                self.free_raw(p);
                None
            }
        }
    }

    unsafe fn free_region(&mut self, base: usize, _size: usize) {
        if let Some(i) = self.raw.iter().position(|&(b, _, _)| b == base) {
            let (_, p, bytes) = self.raw.swap_remove(i);
            self.raw_bytes -= bytes;
            self.free_raw(p);
        }
    }

    fn alloc_map(
        &mut self,
        region_base: usize,
        entries: usize,
    ) -> Option<NonNull<Option<ChunkHandle>>> {
        let map = self.maps.alloc(region_base, entries);
        if map.is_none() {
            // The engine gives the region back and tries a smaller one: the report must not blame
            // the driver for this refusal.
            self.last_refusal = Some(BackendError::new(
                "host allocation",
                format!("not the driver: no host memory for the pointer map ({entries} entries) of a region"),
            ));
        }
        map
    }

    unsafe fn free_map(
        &mut self,
        region_base: usize,
        map: NonNull<Option<ChunkHandle>>,
        _entries: usize,
    ) {
        self.maps.free(region_base, map);
    }
}
