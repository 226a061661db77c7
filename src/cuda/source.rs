//! The engine's memory source over a device back end.

use core::ptr::NonNull;
use std::boxed::Box;
use std::vec::Vec;

use super::backend::{BackendError, DeviceBackend};
use crate::core::{ChunkHandle, MemorySource};

/// Regions from the driver (`cuMemAlloc`), pointer maps in host memory.
pub(crate) struct DeviceSource<B> {
    pub(crate) backend: B,
    /// Live regions: `(base handed to the engine, pointer from the driver)`. They differ only when
    /// the driver's pointer was not aligned enough and the region was over-allocated.
    raw: Vec<(usize, u64)>,
    /// Live pointer maps: `(region base, storage from Box::into_raw)`.
    maps: Vec<(usize, *mut [Option<ChunkHandle>])>,
    /// The driver's last refusal of a region (for the out-of-memory report).
    pub(crate) last_refusal: Option<BackendError>,
    /// Failures to free a region (surfaced through the pool's deferred errors).
    pub(crate) free_errors: Vec<BackendError>,
}

impl<B: DeviceBackend> DeviceSource<B> {
    pub(crate) fn new(backend: B) -> Self {
        DeviceSource {
            backend,
            raw: Vec::new(),
            maps: Vec::new(),
            last_refusal: None,
            free_errors: Vec::new(),
        }
    }

    fn alloc_raw(&mut self, bytes: usize) -> Option<u64> {
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
                self.raw.push((base, p));
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
                self.raw.push((base, p));
                Some(base)
            }
            None => {
                self.free_raw(p);
                None
            }
        }
    }

    unsafe fn free_region(&mut self, base: usize, _size: usize) {
        if let Some(i) = self.raw.iter().position(|&(b, _)| b == base) {
            let (_, p) = self.raw.swap_remove(i);
            self.free_raw(p);
        }
    }

    fn alloc_map(
        &mut self,
        region_base: usize,
        entries: usize,
    ) -> Option<NonNull<Option<ChunkHandle>>> {
        let storage: Box<[Option<ChunkHandle>]> = std::vec![None; entries].into_boxed_slice();
        let raw = Box::into_raw(storage);
        self.maps.push((region_base, raw));
        NonNull::new(raw as *mut Option<ChunkHandle>)
    }

    unsafe fn free_map(
        &mut self,
        region_base: usize,
        map: NonNull<Option<ChunkHandle>>,
        _entries: usize,
    ) {
        let found = self
            .maps
            .iter()
            .position(|&(b, m)| b == region_base && m as *mut Option<ChunkHandle> == map.as_ptr());
        if let Some(i) = found {
            let (_, raw) = self.maps.swap_remove(i);
            // SAFETY: `raw` came from `Box::into_raw` in `alloc_map` and is dropped once (it was just
            // removed from `maps`).
            drop(unsafe { Box::from_raw(raw) });
        }
    }
}

impl<B> Drop for DeviceSource<B> {
    fn drop(&mut self) {
        for (_, raw) in self.maps.drain(..) {
            // SAFETY: each entry came from `Box::into_raw` and is dropped once.
            drop(unsafe { Box::from_raw(raw) });
        }
    }
}

// SAFETY: the map boxes are owned by this value alone (the raw pointers are only an ownership form);
// the back end is `Send`.
unsafe impl<B: Send> Send for DeviceSource<B> {}
