//! The host allocator: the BFC engine behind a spinlock over one reserved `mmap` arena.
//!
//! On first use [`GlobalBfc`] reserves [`HostConfig::arena_size`] bytes of address space with
//! `MAP_NORESERVE` (halving down to [`HostConfig::min_arena_size`] if the kernel refuses), plus a
//! separate reservation for metadata: the pointer map (4 bytes per 512 arena bytes) and the chunk table
//! ([`HostConfig::chunk_capacity`] records of 32 bytes). Nothing is committed up front: pages are backed
//! when first touched, so the resident cost follows the bytes and chunks actually used. Initialisation
//! allocates nothing.
//!
//! The whole arena is the engine's single region, so any two neighbouring free blocks coalesce.
//!
//! Requests of at most 4 KiB (alignment at most 16) are served by a slab layer on top of the engine
//! (see `small.rs`): 64 KiB spans taken from the engine, objects tracked by out-of-band bitmaps, so a
//! small allocation or free is a bit operation and a double free is still detected. Everything larger
//! goes to the engine, with its best fit and coalescing.
//!
//! # Giving memory back
//!
//! With `T` = [`HostConfig::release_threshold`], pages go back to the kernel
//! (`madvise(MADV_DONTNEED)`):
//! - the free top of the arena keeps `T` bytes of touched memory and returns the rest once more than
//!   `2T` of it were touched;
//! - elsewhere, blocks freed into free chunks of at least `T` bytes are counted, and after `16T` bytes
//!   of them (16 MiB by default) every free chunk of at least `T` bytes is swept; a single freed block
//!   of at least `16T` bytes returns its pages at once.
//!
//! Smaller free chunks keep their pages for reuse.
//! [`GlobalBfc::release_free_memory`] sweeps every free page on demand.
//!
//! # Errors
//!
//! Out of memory (including requests larger than the arena) returns null. Freeing a pointer the
//! allocator does not own, a double free, or a pointer into the middle of a block aborts the process
//! with a message naming the problem; the heap is never silently corrupted.

mod os;
mod small;

use core::alloc::{GlobalAlloc, Layout};
use core::ptr::{self, NonNull};

use crate::core::{
    Bfc, CheckError, Chunk, ChunkHandle, Config, FreeError, Freed, MemorySource, Resize, Stats,
};
use crate::lock::SpinLock;
use small::{SmallFree, SmallHeap, SPAN};

/// Host allocator parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostConfig {
    /// Address space reserved for the heap (default 64 GiB). Allocations beyond it fail.
    pub arena_size: usize,
    /// Smallest arena accepted when the kernel refuses the full size (default 1 GiB).
    pub min_arena_size: usize,
    /// Capacity of the chunk table (default 2^25 records = 1 GiB of address space, touched as used).
    pub chunk_capacity: usize,
    /// Free chunks at least this large give their pages back to the kernel (default 1 MiB).
    pub release_threshold: usize,
    /// Allocation granule in bytes (default 16).
    pub granule: usize,
}

impl HostConfig {
    /// The defaults.
    pub const DEFAULT: HostConfig = HostConfig {
        arena_size: 64 << 30,
        min_arena_size: 1 << 30,
        chunk_capacity: 1 << 25,
        release_threshold: 1 << 20,
        granule: 16,
    };

    /// Panics (at compile time when used in a `static`) on bad parameters.
    pub const fn validate(&self) {
        assert!(
            self.arena_size >= self.min_arena_size,
            "arena_size < min_arena_size"
        );
        assert!(
            self.min_arena_size >= 1 << 21,
            "min_arena_size must be at least 2 MiB"
        );
        assert!(self.chunk_capacity >= 16, "chunk_capacity too small");
        assert!(
            self.chunk_capacity < u32::MAX as usize,
            "chunk_capacity must fit in u32"
        );
        assert!(
            self.granule.is_power_of_two() && self.granule >= 8 && self.granule <= 4096,
            "granule must be a power of two in 8..=4096"
        );
    }
}

impl Default for HostConfig {
    fn default() -> Self {
        HostConfig::DEFAULT
    }
}

/// Largest alignment of the arena base (and so of any region-aligned request).
const ARENA_ALIGN: usize = 2 << 20;

/// The memory source over the arena: hands out the whole arena as one region.
struct HostSource {
    /// Start of the arena (aligned to [`ARENA_ALIGN`]).
    arena: usize,
    arena_size: usize,
    /// Start of the whole arena reservation (for unmapping).
    arena_mapping: NonNull<u8>,
    arena_mapping_size: usize,
    /// Pointer-map storage.
    map: NonNull<Option<ChunkHandle>>,
    map_entries: usize,
    /// Whole metadata reservation: the map, then the chunk table.
    meta_mapping: NonNull<u8>,
    meta_mapping_size: usize,
    /// Whether the arena is currently the engine's region.
    region_out: bool,
    page: usize,
}

// SAFETY: the arena and its map are one reservation each that only this source hands out: the region
// once (until freed), the map once (zeroed by `discard` when freed). No method calls an allocator.
unsafe impl MemorySource for HostSource {
    fn alloc_region(&mut self, size: usize, align: usize) -> Option<usize> {
        if self.region_out || size > self.arena_size || align > ARENA_ALIGN {
            return None;
        }
        self.region_out = true;
        Some(self.arena)
    }

    unsafe fn free_region(&mut self, base: usize, size: usize) {
        debug_assert_eq!(base, self.arena);
        // SAFETY: the region is our arena's prefix (page-aligned start) and holds nothing in use.
        unsafe { os::discard(base, size & !(self.page - 1)) };
        self.region_out = false;
    }

    fn alloc_map(
        &mut self,
        _region_base: usize,
        entries: usize,
    ) -> Option<NonNull<Option<ChunkHandle>>> {
        (entries <= self.map_entries).then_some(self.map)
    }

    unsafe fn free_map(
        &mut self,
        _region_base: usize,
        map: NonNull<Option<ChunkHandle>>,
        entries: usize,
    ) {
        let bytes = entries * core::mem::size_of::<Option<ChunkHandle>>();
        // SAFETY: the map starts the metadata reservation (page-aligned); zeroing its pages makes it
        // ready for the next `alloc_map`. The engine no longer uses it.
        unsafe { os::discard(map.as_ptr() as usize, bytes.next_multiple_of(self.page)) };
    }
}

type Engine = Bfc<HostSource, &'static mut [Chunk]>;

struct Heap {
    bfc: Engine,
    small: SmallHeap,
    /// High-water mark of the bytes handed out to callers (small objects counted by class size).
    peak: usize,
    /// Largest block handed out to a caller.
    largest: usize,
    /// Engine allocations that were spans.
    span_allocs: u64,
    /// Bytes freed into large interior free chunks since the last sweep without their pages being
    /// returned.
    dirty: usize,
    release_threshold: usize,
    /// End of the arena.
    arena_end: usize,
    /// Every byte ever handed out lies below this address (the arena above it was never touched, or
    /// its pages were returned).
    brk: usize,
    page: usize,
}

/// A sweep of large interior free chunks runs after this many thresholds of frees into them; a single
/// freed block this large returns its pages at once.
const SWEEP_AFTER_THRESHOLDS: usize = 16;

#[allow(
    clippy::large_enum_variant,
    reason = "lives in a static; boxing would need an allocator"
)]
enum State {
    Uninit,
    Ready(Heap),
    /// The arena could not be reserved; every allocation returns null.
    Failed,
}

/// A `#[global_allocator]`: the BFC engine over a lazily reserved arena, behind a spinlock.
///
/// ```no_run
/// #[global_allocator]
/// static A: bfc_alloc::GlobalBfc = bfc_alloc::GlobalBfc::new();
/// ```
///
/// See the [module docs](self) for the memory layout, when memory goes back to the kernel, and error
/// behaviour.
pub struct GlobalBfc {
    config: HostConfig,
    state: SpinLock<State>,
    /// Initialisations so far (loom builds only).
    #[cfg(loom)]
    inits: crate::sync::UnmodelledAtomicUsize,
}

impl GlobalBfc {
    /// An allocator with [`HostConfig::DEFAULT`]. Reserves nothing until first used.
    #[cfg(not(loom))]
    pub const fn new() -> Self {
        Self::with_config(HostConfig::DEFAULT)
    }

    /// An allocator with `config` (checked at compile time in a `static`).
    #[cfg(not(loom))]
    pub const fn with_config(config: HostConfig) -> Self {
        config.validate();
        GlobalBfc {
            config,
            state: SpinLock::with_reentry_handler(State::Uninit, reentered),
        }
    }

    /// An allocator with [`HostConfig::DEFAULT`] (loom build: not `const`).
    #[cfg(loom)]
    pub fn new() -> Self {
        Self::with_config(HostConfig::DEFAULT)
    }

    /// An allocator with `config` (loom build: not `const`).
    #[cfg(loom)]
    pub fn with_config(config: HostConfig) -> Self {
        config.validate();
        GlobalBfc {
            config,
            state: SpinLock::with_reentry_handler(State::Uninit, reentered),
            inits: crate::sync::UnmodelledAtomicUsize::new(0),
        }
    }

    /// How many times the heap was initialised (loom builds only; the models check it is once).
    #[cfg(loom)]
    #[doc(hidden)]
    pub fn initialisations(&self) -> usize {
        self.inits.load(crate::sync::UnmodelledOrdering::Relaxed)
    }

    /// The parameters.
    pub fn config(&self) -> &HostConfig {
        &self.config
    }

    /// Current counters (all zero before first use). `bytes_reserved` is the arena's address space.
    pub fn stats(&self) -> Stats {
        self.with_heap(|h| h.stats()).unwrap_or_default()
    }

    /// Runs the engine's invariant checker and checks the slab layer's counters.
    pub fn check(&self) -> Result<(), CheckError> {
        self.with_heap(|h| h.check()).unwrap_or(Ok(()))
    }

    /// Returns the pages of every free chunk of at least one page to the kernel. Returns the bytes
    /// of address space covered.
    pub fn release_free_memory(&self) -> usize {
        self.with_heap(|h| h.sweep(1)).unwrap_or(0)
    }

    /// Size of the reserved arena (0 before first use or if it could not be reserved).
    pub fn arena_size(&self) -> usize {
        self.with_heap(|h| h.bfc.source().arena_size).unwrap_or(0)
    }

    /// Usable size of the block at `ptr`, or `None` if `ptr` is not the start of a live block.
    pub fn usable_size(&self, ptr: *const u8) -> Option<usize> {
        self.with_heap(|h| h.usable_size(ptr as usize)).flatten()
    }

    /// Runs `f` on the heap, initialising it on first use; `None` if the arena is unavailable.
    #[inline]
    fn with_heap<R>(&self, f: impl FnOnce(&mut Heap) -> R) -> Option<R> {
        let mut guard = self.state.lock();
        guard.with(|state| {
            if let State::Ready(h) = state {
                return Some(f(h));
            }
            #[cfg(loom)]
            if let State::Uninit = state {
                self.inits
                    .fetch_add(1, crate::sync::UnmodelledOrdering::Relaxed);
            }
            init_state(state, &self.config);
            match state {
                State::Ready(h) => Some(f(h)),
                _ => None,
            }
        })
    }
}

/// A thread waited for the heap lock it holds itself: something allocated from inside the allocator
/// (most likely a panic in it, whose handler allocates). Abort instead of hanging.
fn reentered() -> ! {
    os::fatal(format_args!(
        "allocator re-entered by the thread holding its lock (a panic or an allocation inside \
         the allocator?)"
    ))
}

/// First use: reserves the arena and builds the heap in place. Kept out of line so the fast paths do
/// not carry its large stack frame.
#[cold]
#[inline(never)]
fn init_state(state: &mut State, config: &HostConfig) {
    if let State::Uninit = state {
        *state = match Heap::init(config) {
            Some(h) => State::Ready(h),
            None => State::Failed,
        };
    }
}

impl Default for GlobalBfc {
    fn default() -> Self {
        Self::new()
    }
}

impl Heap {
    /// Reserves the arena and metadata and builds the engine. Allocates nothing.
    fn init(config: &HostConfig) -> Option<Heap> {
        let page = os::page_size();
        let engine_config = Config::host(0);
        let block = config.granule * engine_config.map_block_granules;
        let mut arena_size = config.arena_size & !(ARENA_ALIGN - 1);
        let (arena_mapping, arena_mapping_size) = loop {
            let want = arena_size + ARENA_ALIGN;
            if let Some(p) = os::reserve(want) {
                break (p, want);
            }
            arena_size /= 2;
            if arena_size < config.min_arena_size {
                return None;
            }
        };
        let arena = (arena_mapping.as_ptr() as usize).next_multiple_of(ARENA_ALIGN);
        let map_entries = arena_size.div_ceil(block);
        let map_bytes = (map_entries * 4).next_multiple_of(page);
        let table_bytes =
            (config.chunk_capacity * core::mem::size_of::<Chunk>()).next_multiple_of(page);
        let span_entries = arena_size >> small::SPAN_SHIFT;
        let spans_bytes = (span_entries * SmallHeap::ENTRY).next_multiple_of(page);
        let meta_mapping_size = map_bytes + table_bytes + spans_bytes;
        let Some(meta_mapping) = os::reserve(meta_mapping_size) else {
            // SAFETY: the arena reservation was just made and is unused.
            unsafe { os::unreserve(arena_mapping, arena_mapping_size) };
            return None;
        };
        // SAFETY: the table area lies inside the fresh metadata reservation, is aligned (page-aligned
        // offset), zero-filled (a valid `[Chunk]`, see `Chunk::EMPTY`), and used by nothing else for
        // the life of the heap, which never outlives the mapping (unmapped only in `Drop`).
        let table: &'static mut [Chunk] = unsafe {
            core::slice::from_raw_parts_mut(
                meta_mapping.as_ptr().add(map_bytes).cast::<Chunk>(),
                config.chunk_capacity,
            )
        };
        // SAFETY: as for the table: a zero-filled (all "not a span"), aligned, exclusively owned part
        // of the metadata reservation, alive as long as the heap.
        let spans: &'static mut [small::Span] = unsafe {
            core::slice::from_raw_parts_mut(
                meta_mapping
                    .as_ptr()
                    .add(map_bytes + table_bytes)
                    .cast::<small::Span>(),
                span_entries,
            )
        };
        let source = HostSource {
            arena,
            arena_size,
            arena_mapping,
            arena_mapping_size,
            map: meta_mapping.cast(),
            map_entries,
            meta_mapping,
            meta_mapping_size,
            region_out: false,
            page,
        };
        let engine_config = Config {
            granule: config.granule,
            memory_limit: arena_size,
            initial_region_size: arena_size,
            max_internal_fragmentation: config.granule,
            ..engine_config
        };
        let bfc = match Bfc::new(engine_config, source, table) {
            Ok(b) => b,
            Err(_) => return None,
        };
        Some(Heap {
            bfc,
            small: SmallHeap::new(arena, spans),
            peak: 0,
            largest: 0,
            span_allocs: 0,
            dirty: 0,
            release_threshold: config.release_threshold,
            arena_end: arena + arena_size,
            brk: arena,
            page,
        })
    }

    /// Notes that `ptr..ptr + size` was handed out.
    #[inline]
    fn note_allocated(&mut self, ptr: usize, size: usize) {
        self.brk = self.brk.max(ptr + size);
    }

    /// Bytes handed out to callers now.
    #[inline]
    fn in_use(&self) -> usize {
        self.bfc.bytes_in_use() - self.small.spans_live * SPAN + self.small.bytes
    }

    #[inline]
    fn note_peak(&mut self, size: usize) {
        self.peak = self.peak.max(self.in_use());
        self.largest = self.largest.max(size);
    }

    #[inline]
    fn allocate(&mut self, size: usize, align: usize) -> *mut u8 {
        if let Some(c) = small::class_for(size, align) {
            let p = match self.small.alloc(c) {
                Some(p) => p,
                None => match self.small_refill(c) {
                    Some(p) => p,
                    None => return ptr::null_mut(),
                },
            };
            self.note_peak(size);
            return p as *mut u8;
        }
        match self.bfc.allocate(size, align) {
            Ok(p) => {
                self.note_allocated(p, size);
                self.note_peak(size);
                p as *mut u8
            }
            Err(_) => ptr::null_mut(),
        }
    }

    /// Gives class `c` a span with room (a partial one or a new one from the engine) and allocates.
    #[cold]
    fn small_refill(&mut self, c: usize) -> Option<usize> {
        let fresh = if self.small.has_partial(c) {
            None
        } else {
            let base = self.bfc.allocate(SPAN, SPAN).ok()?;
            self.note_allocated(base, SPAN);
            self.span_allocs += 1;
            Some(base)
        };
        self.small.refill(c, fresh);
        self.small.alloc(c)
    }

    /// Counters as callers see them: spans replaced by the small objects in them.
    fn stats(&self) -> Stats {
        let mut s = self.bfc.stats();
        let spans = self.small.spans_live;
        s.bytes_in_use = self.in_use();
        s.peak_bytes_in_use = self.peak;
        s.largest_alloc_size = self.largest;
        s.num_allocs = s.num_allocs - self.span_allocs + self.small.allocs;
        s.num_chunks_in_use = s.num_chunks_in_use - spans + self.small.objects;
        s.metadata_bytes += self.small.metadata_bytes(self.brk);
        s
    }

    fn check(&self) -> Result<(), CheckError> {
        self.bfc.check()?;
        self.small
            .check(self.brk)
            .map_err(|what| CheckError { what, at: 0 })
    }

    /// Applies the give-back policy (module docs) after `f` was released.
    #[inline]
    fn after_free(&mut self, f: Freed) {
        if f.merged_size < self.release_threshold {
            return;
        }
        let page = self.page;
        if f.merged_ptr + f.merged_size == self.arena_end {
            // The free top of the arena: once more than two thresholds of it were touched, return
            // all but one threshold (glibc's trim, with hysteresis so a block that is freed and
            // allocated again at the top does not fault its pages in every time).
            let keep = (f.merged_ptr + self.release_threshold).next_multiple_of(page);
            if self.brk > keep && self.brk - f.merged_ptr >= 2 * self.release_threshold {
                // SAFETY: `keep..brk` is page-aligned (brk rounded up) and inside the free top chunk.
                unsafe { os::discard(keep, self.brk.next_multiple_of(page) - keep) };
                self.brk = keep;
            }
            return;
        }
        self.dirty += f.size;
        if f.size >= SWEEP_AFTER_THRESHOLDS * self.release_threshold {
            // Whole pages of the freed range, widened to the pages it shares with the merged chunk.
            let (down, up) = (f.ptr & !(page - 1), f.ptr.next_multiple_of(page));
            let lo = if down >= f.merged_ptr { down } else { up };
            let end = f.ptr + f.size;
            let (down, up) = (end & !(page - 1), end.next_multiple_of(page));
            let hi = if up <= f.merged_ptr + f.merged_size {
                up
            } else {
                down
            };
            if hi > lo {
                // SAFETY: `lo..hi` is page-aligned and inside the merged free chunk, hence inside the
                // arena and holding nothing in use.
                unsafe { os::discard(lo, hi - lo) };
                self.dirty -= f.size;
            }
            return;
        }
        if self.dirty >= SWEEP_AFTER_THRESHOLDS * self.release_threshold {
            self.sweep(self.release_threshold);
        }
    }

    /// Returns the whole, possibly touched pages of every free chunk of at least `min` bytes that
    /// was not swept since it last changed. Returns the bytes covered.
    fn sweep(&mut self, min: usize) -> usize {
        self.dirty = 0;
        let page = self.page;
        let brk = self.brk.next_multiple_of(page);
        let mut covered = 0;
        let mut new_brk = brk;
        let arena_end = self.arena_end;
        self.bfc.sweep_dirty(min.max(page), |ptr, size| {
            let lo = ptr.next_multiple_of(page);
            let hi = ((ptr + size) & !(page - 1)).min(brk);
            if hi > lo {
                // SAFETY: whole pages inside a free chunk of the arena.
                unsafe { os::discard(lo, hi - lo) };
                covered += hi - lo;
            }
            if ptr + size == arena_end {
                new_brk = new_brk.min(lo);
            }
        });
        self.brk = new_brk;
        covered
    }

    #[inline]
    fn free(&mut self, ptr: *mut u8) {
        let p = ptr as usize;
        match self.small.free(p) {
            SmallFree::Freed(None) => {}
            SmallFree::Freed(Some(span)) => self.free_engine(span),
            SmallFree::NotSmall => self.free_engine(p),
            SmallFree::Interior { block } => small_error(p, SmallFree::Interior { block }, ""),
            SmallFree::DoubleFree => small_error(p, SmallFree::DoubleFree, ""),
        }
    }

    #[inline]
    fn free_engine(&mut self, p: usize) {
        match self.bfc.deallocate(p) {
            Ok(f) => self.after_free(f),
            Err(e) => os::fatal(format_args!("{e}")),
        }
    }

    /// Usable size of the live block at `p`.
    fn usable_size(&self, p: usize) -> Option<usize> {
        match self.small.lookup(p) {
            Ok(Some(size)) => Some(size),
            Ok(None) => self.bfc.usable_size(p).ok(),
            Err(_) => None,
        }
    }

    /// The realloc step taken under the lock: returns `ptr` if the block was resized in place, a new
    /// block (the caller copies and frees the old one), or null.
    fn realloc_step(&mut self, ptr: *mut u8, align: usize, new_size: usize) -> *mut u8 {
        let p = ptr as usize;
        match self.small.lookup(p) {
            Ok(Some(size)) => {
                // Stay in place while the new size fits the class and wastes under half of it.
                if new_size <= size && new_size > size / 2 {
                    return ptr;
                }
                return self.allocate(new_size, align);
            }
            Ok(None) => {}
            Err(e) => small_error(p, e, "realloc: "),
        }
        match self.bfc.resize_in_place(p, new_size) {
            Ok(Resize::Done { freed, .. }) => {
                match freed {
                    Some(f) => self.after_free(f),
                    None => self.note_allocated(p, new_size),
                }
                self.note_peak(new_size);
                ptr
            }
            // Allocate the new block under the same lock acquisition.
            Ok(Resize::Moved) => self.allocate(new_size, align),
            Err(e) => os::fatal(format_args!("realloc: {e}")),
        }
    }
}

/// Aborts for a bad pointer found by the slab layer, with the engine's wording.
#[cold]
fn small_error(ptr: usize, e: SmallFree, context: &str) -> ! {
    let e = match e {
        SmallFree::Interior { block } => FreeError::Interior { ptr, block },
        _ => FreeError::DoubleFree { ptr },
    };
    os::fatal(format_args!("{context}{e}"))
}

// SAFETY: the heap only moves between threads under the lock; its raw pointers name memory owned by
// the heap alone.
unsafe impl Send for HostSource {}

impl Drop for GlobalBfc {
    fn drop(&mut self) {
        self.state.lock().with(|state| {
            if let State::Ready(h) = core::mem::replace(state, State::Failed) {
                let s = h.bfc.source();
                // SAFETY: `&mut self` proves no allocation from this allocator is still used through
                // it (its blocks cannot outlive it), and the heap referencing the mappings is dropped
                // right after.
                unsafe {
                    os::unreserve(s.arena_mapping, s.arena_mapping_size);
                    os::unreserve(s.meta_mapping, s.meta_mapping_size);
                }
            }
        });
    }
}

// SAFETY: blocks come from the engine, which hands out each byte to one block at a time, honours the
// layout's alignment, and never returns memory that is still allocated; every error path returns null
// or aborts, and nothing here allocates through the global allocator or panics.
unsafe impl GlobalAlloc for GlobalBfc {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        self.with_heap(|h| h.allocate(layout.size(), layout.align()))
            .unwrap_or(ptr::null_mut())
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let threshold = self.config.release_threshold;
        let Some((p, page)) =
            self.with_heap(|h| (h.allocate(layout.size(), layout.align()), h.page))
        else {
            return ptr::null_mut();
        };
        if p.is_null() {
            return p;
        }
        let size = layout.size();
        let lo = (p as usize).next_multiple_of(page);
        let hi = (p as usize + size) & !(page - 1);
        if size >= threshold && hi > lo {
            // Large: zero the whole pages by giving them back (they fault in as zero pages), and
            // write only the partial pages at the ends.
            // SAFETY: `lo..hi` is page-aligned inside the block we own; `p..lo` and `hi..end` too.
            unsafe {
                os::discard(lo, hi - lo);
                ptr::write_bytes(p, 0, lo - p as usize);
                ptr::write_bytes(hi as *mut u8, 0, p as usize + size - hi);
            }
        } else {
            // SAFETY: the block holds at least `size` bytes.
            unsafe { ptr::write_bytes(p, 0, size) };
        }
        p
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        if self.with_heap(|h| h.free(ptr)).is_none() {
            os::fatal(format_args!(
                "free of pointer {ptr:p} but the heap was never initialised"
            ));
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let align = layout.align();
        let outcome = self.with_heap(|h| h.realloc_step(ptr, align, new_size));
        let new = match outcome {
            Some(p) => p,
            None => os::fatal(format_args!(
                "realloc of pointer {ptr:p} but the heap was never initialised"
            )),
        };
        if new.is_null() || new == ptr {
            return new;
        }
        // SAFETY: both blocks are live, distinct, and hold at least the copied length.
        unsafe {
            ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
            self.dealloc(ptr, layout);
        }
        new
    }
}

// SAFETY: as for `GlobalAlloc`: blocks are valid for their layout until deallocated, and every
// failure is reported as `AllocError`.
unsafe impl allocator_api2::alloc::Allocator for GlobalBfc {
    fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, allocator_api2::alloc::AllocError> {
        // SAFETY: `alloc` has no requirement beyond a valid layout; zero sizes get a granule.
        let p = unsafe { GlobalAlloc::alloc(self, layout) };
        NonNull::new(p)
            .map(|p| NonNull::slice_from_raw_parts(p, layout.size()))
            .ok_or(allocator_api2::alloc::AllocError)
    }

    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: forwarded contract: `ptr` came from this allocator with `layout`.
        unsafe { GlobalAlloc::dealloc(self, ptr.as_ptr(), layout) }
    }

    unsafe fn grow(
        &self,
        ptr: NonNull<u8>,
        old: Layout,
        new: Layout,
    ) -> Result<NonNull<[u8]>, allocator_api2::alloc::AllocError> {
        if new.align() > old.align() {
            let fresh = self.allocate(new)?;
            // SAFETY: forwarded contract; the new block is at least `old.size()` bytes.
            unsafe {
                ptr::copy_nonoverlapping(ptr.as_ptr(), fresh.as_ptr().cast(), old.size());
                self.deallocate(ptr, old);
            }
            return Ok(fresh);
        }
        // SAFETY: forwarded contract; same alignment, larger size.
        let p = unsafe { GlobalAlloc::realloc(self, ptr.as_ptr(), old, new.size()) };
        NonNull::new(p)
            .map(|p| NonNull::slice_from_raw_parts(p, new.size()))
            .ok_or(allocator_api2::alloc::AllocError)
    }

    unsafe fn shrink(
        &self,
        ptr: NonNull<u8>,
        old: Layout,
        new: Layout,
    ) -> Result<NonNull<[u8]>, allocator_api2::alloc::AllocError> {
        if new.align() > old.align() {
            let fresh = self.allocate(new)?;
            // SAFETY: forwarded contract; the new block holds `new.size() <= old.size()` bytes.
            unsafe {
                ptr::copy_nonoverlapping(ptr.as_ptr(), fresh.as_ptr().cast(), new.size());
                self.deallocate(ptr, old);
            }
            return Ok(fresh);
        }
        // SAFETY: forwarded contract; same alignment, smaller size: in place, never fails.
        let p = unsafe { GlobalAlloc::realloc(self, ptr.as_ptr(), old, new.size()) };
        NonNull::new(p)
            .map(|p| NonNull::slice_from_raw_parts(p, new.size()))
            .ok_or(allocator_api2::alloc::AllocError)
    }
}
