//! Pointer-map storage on the heap, for memory sources that have `std` (the simulated source and
//! the device pool): zero-filled boxes, owned here until freed.

extern crate std;

use core::alloc::Layout;
use core::ptr::NonNull;
use std::boxed::Box;
use std::vec::Vec;

use super::ChunkHandle;

/// Owns the maps handed to an engine; frees whatever is left on drop.
#[derive(Debug, Default)]
pub struct HeapMaps {
    /// `(region base, storage from Box::into_raw)`.
    maps: Vec<(usize, *mut [Option<ChunkHandle>])>,
}

impl HeapMaps {
    /// No maps yet.
    pub const fn new() -> Self {
        HeapMaps { maps: Vec::new() }
    }

    /// A zero-filled map of `entries` values (at least one) for the region at `region_base`.
    /// Zeroed memory is a valid `[None; entries]`; `alloc_zeroed` avoids an element-wise fill, which
    /// is slow for large maps (and very slow under Miri).
    pub fn alloc(
        &mut self,
        region_base: usize,
        entries: usize,
    ) -> Option<NonNull<Option<ChunkHandle>>> {
        let entries = entries.max(1);
        let layout = Layout::array::<Option<ChunkHandle>>(entries).ok()?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) } as *mut Option<ChunkHandle>;
        let raw = core::ptr::slice_from_raw_parts_mut(NonNull::new(ptr)?.as_ptr(), entries);
        // SAFETY: `raw` is a zero-filled allocation with the layout `Box<[Option<ChunkHandle>]>` uses
        // for this length, and all-zero bytes are valid `None`s; the box now owns it.
        let raw = Box::into_raw(unsafe { Box::from_raw(raw) });
        self.maps.push((region_base, raw));
        NonNull::new(raw as *mut Option<ChunkHandle>)
    }

    /// Frees the map `map` of the region at `region_base`; returns whether it was one of ours.
    pub fn free(&mut self, region_base: usize, map: NonNull<Option<ChunkHandle>>) -> bool {
        let found = self
            .maps
            .iter()
            .position(|&(b, m)| b == region_base && m as *mut Option<ChunkHandle> == map.as_ptr());
        let Some(i) = found else {
            return false;
        };
        let (_, raw) = self.maps.swap_remove(i);
        // SAFETY: `raw` came from `Box::into_raw` in `alloc` and was just removed from `maps`, so it
        // is dropped once.
        drop(unsafe { Box::from_raw(raw) });
        true
    }

    /// Number of live maps.
    pub fn len(&self) -> usize {
        self.maps.len()
    }

    /// Whether no map is live.
    pub fn is_empty(&self) -> bool {
        self.maps.is_empty()
    }
}

impl Drop for HeapMaps {
    fn drop(&mut self) {
        for (_, raw) in self.maps.drain(..) {
            // SAFETY: each entry came from `Box::into_raw` and is dropped once.
            drop(unsafe { Box::from_raw(raw) });
        }
    }
}

// SAFETY: the boxes are owned by this value alone (the raw pointers are only an ownership form).
unsafe impl Send for HeapMaps {}
