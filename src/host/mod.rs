//! The host allocator: the BFC engine behind a spinlock over one reserved `mmap` arena.
//!
//! On first use [`GlobalBfc`] reserves [`HostConfig::arena_size`] bytes of address space, plus a
//! separate reservation for metadata: the pointer map (4 bytes per 512 arena bytes), the chunk table
//! ([`HostConfig::chunk_capacity`] records of 32 bytes, at most one per 256 arena bytes), and the
//! slab layer's span table and span sets (under 1% of the arena). If the kernel refuses either,
//! both are tried again with half the arena, down to [`HostConfig::min_arena_size`]; below that, a
//! warning goes to standard error and every allocation fails. Under an address-space limit
//! (`RLIMIT_AS`, `ulimit -v`) the two reservations take at most half of the address space still
//! free, so the rest of the process (thread stacks, libraries) keeps room (but for
//! [`HostConfig::min_arena_size`], which is tried in any case); the arena does not grow later.
//!
//! Reserved memory is inaccessible (`PROT_NONE`) until the heap reaches it: the arena is committed
//! (made readable and writable) from its start in 2 MiB steps as blocks are handed out higher up,
//! and the pointer map, span table and chunk table in step with what they describe (the metadata
//! sized by the arena alone, about 4.7 MiB with those tables' first steps for a 64 GiB arena, is
//! committed at initialisation). So strict overcommit (`vm.overcommit_memory = 2`) charges, and
//! `RLIMIT_DATA` counts, the memory the heap has reached, not the 64 GiB it reserved; when the
//! kernel refuses a commit, the allocation returns null. Committed memory stays committed (freed
//! blocks are reused); its pages still go back to the kernel as described below, and only pages
//! that are touched become resident.
//! Initialisation allocates nothing.
//!
//! The whole arena is the engine's single region, so any two neighbouring free blocks coalesce.
//!
//! Requests of at most 4 KiB (alignment at most 4 KiB) are served by a slab layer on top of the
//! engine (see `small.rs`): 64 KiB spans taken from the engine, objects tracked by out-of-band
//! bitmaps, so a small allocation or free is a bit operation and a double free is still detected.
//! A request aligned to more than 16 bytes takes the smallest class whose size is a multiple of its
//! alignment (a cache-line-aligned 64-byte value takes the 64-byte class, a page-aligned one the
//! 4 KiB class), so it gets the same thread caches and speed. Each class takes
//! the lowest free object of its lowest span with room, so a class's touched memory follows its peak
//! live bytes, and its spans above that drain and go back to the engine for any size to reuse.
//! Everything larger goes to the engine, with its best fit and coalescing; new blocks of 64 KiB or
//! more start at a 64 KiB boundary where the arena has room for the padding, so the first pages of a
//! new large block are likely already touched.
//!
//! # Thread caches (`std`)
//!
//! In front of the slab layer each thread keeps bounded per-class stacks of free small blocks, so most
//! small allocations and frees take no lock (see `tcache.rs` for the protocol):
//! - at most [`MAX_CACHED_BYTES`] (575 KiB) per thread; half a stack moves per lock acquisition;
//! - a block freed on another thread joins that thread's cache; a full cache gives half a stack to
//!   a per-class transfer cache in the heap, which the next refill of that class takes whole (at most
//!   two stacks per class, about 1.1 MiB in all);
//! - every 256 refills and flushes of a thread's cache, each class that had none of them gives half
//!   its blocks back to the slab layer, so a class the thread stopped using drains;
//! - a thread's cache is flushed when the thread exits, on demand by
//!   [`GlobalBfc::flush_thread_cache`] (and [`GlobalBfc::release_free_memory`]), and before an
//!   allocation on that thread fails for want of room (with the transfer cache);
//! - blocks going back to the slab layer are checked there, and a block freed twice in a row on one
//!   thread is caught at the second free (other double frees when the block reaches the slab layer);
//! - [`GlobalBfc::stats`] counts cached blocks as cached, not in use;
//! - a thread's cache serves the first instance that uses it; other instances take the lock there.
//!
//! A small block is always freed with a layout of its own size class: `realloc` keeps a small block in
//! place only within its class, and moves a large block that shrinks to a small size.
//!
//! # Giving memory back
//!
//! With `T` = [`HostConfig::release_threshold`], pages go back to the kernel
//! (`madvise(MADV_DONTNEED)`) as follows. `R`, the retained amount, starts at `T` and grows to twice
//! the largest block freed so far (up to 64 MiB; blocks below `T`, or of 64 MiB or more, do not
//! count), like glibc's dynamic thresholds.
//! - The free top of the arena (when at least `T` bytes) keeps `R` bytes of touched memory and
//!   returns the rest once at least `2R` of it were touched; after a free of 64 MiB or more it keeps
//!   only `T`.
//! - A single freed block of 64 MiB or more (and at least `16T`) returns its pages at once.
//! - Elsewhere, blocks freed into free chunks of at least `T` bytes are counted. Once the count
//!   reaches four times the bytes in use (and at least `16T` and `2R`), a sweep runs. It returns the
//!   pages of the free chunks that were already free and unchanged at the previous sweep, and marks
//!   the others.
//!   So memory a program frees and allocates again in cycles keeps its pages, and memory that stays
//!   free goes back within two sweeps (a decay counted in freed bytes, not time).
//!
//! Smaller free chunks, and free objects in spans, keep their pages for reuse.
//! [`GlobalBfc::release_free_memory`] returns every free page at once, including the pages of spans
//! that hold no allocated object.
//!
//! The heap keeps the end of its touched memory: every byte ever handed out (a whole block, up to
//! its `usable_size`) lies below it, and it moves down only over pages of the free top that the
//! kernel took back (it refuses locked pages: `mlock`, `mlockall`). So
//! `alloc_zeroed` writes only the part of a large block below that end; memory above it is still
//! zero, and stays untouched until the caller writes it (a `vec![0; n]` of fresh memory costs no
//! page). Below it, a block of at least `T` bytes is zeroed by returning its whole pages.
//!
//! # Errors
//!
//! Out of memory (including requests larger than the arena) returns null. Before an allocation
//! fails for want of room, the heap takes back what it holds only for reuse, and tries once more:
//! the calling thread's cached blocks, the transfer cache, and each size class's empty current
//! span (a `realloc` that must move tries to grow in place once more after that). Blocks in
//! another thread's cache stay there until that thread flushes
//! ([`GlobalBfc::flush_thread_cache`]) or exits: its fast paths take no lock. Freeing a pointer the
//! allocator does not own, a double free, or a pointer into the middle of a block aborts the process
//! with a message naming the problem; the heap is never silently corrupted.
//!
//! # `fork`
//!
//! A `pthread_atfork` handler (installed before the first heap's initialisation takes any lock)
//! takes every heap's lock before a `fork` and releases it in both processes afterwards, so the
//! child can allocate even when another thread was inside the allocator at the moment of the fork.
//! Threads that fork at the same time take turns: each fork holds the locks from its prepare step to
//! its own parent or child step. In the child the other threads' cached blocks are lost (their
//! threads do not exist there, and a cache may have been mid-update: it cannot be flushed), and
//! [`GlobalBfc::stats`] goes on counting them in use; the first use rebuilds the cache registry. First-use
//! initialisation runs under the global heap-list lock, which the handler also takes, so a `fork`
//! never interrupts an initialisation either.

mod os;
mod small;
#[cfg(feature = "std")]
mod tcache;

use core::alloc::{GlobalAlloc, Layout};
use core::ptr::{self, NonNull};

use crate::core::{
    AllocError, Allocated, Bfc, CheckError, Chunk, ChunkHandle, Config, FreeError, Freed,
    MemorySource, Resize, Stats,
};
use crate::lock::SpinLock;
use small::{SmallFree, SmallHeap, SPAN};
#[cfg(all(feature = "std", loom))]
#[doc(hidden)]
pub use tcache::exit_thread as loom_exit_thread;
#[cfg(feature = "std")]
use tcache::ThreadCache;
#[cfg(feature = "std")]
pub use tcache::MAX_CACHED_BYTES;

/// Host allocator parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostConfig {
    /// Address space reserved for the heap (default 64 GiB), rounded up to a multiple of 2 MiB.
    /// Allocations beyond it fail.
    pub arena_size: usize,
    /// Smallest arena accepted when the kernel refuses a larger one (default 16 MiB; the arena
    /// tried last is the smallest multiple of 2 MiB at least this large).
    pub min_arena_size: usize,
    /// Capacity of the chunk table (default 2^25 records = 1 GiB of address space, touched as used),
    /// at most one record per 256 bytes of the arena reserved.
    pub chunk_capacity: usize,
    /// Free chunks at least this large give their pages back to the kernel (default 1 MiB).
    pub release_threshold: usize,
    /// Allocation granule in bytes (default 16).
    pub granule: usize,
    /// Per-thread caches of small blocks (`std` builds; default on). See the module docs.
    pub thread_cache: bool,
}

impl HostConfig {
    /// The defaults.
    pub const DEFAULT: HostConfig = HostConfig {
        arena_size: 64 << 30,
        min_arena_size: 16 << 20,
        chunk_capacity: 1 << 25,
        release_threshold: 1 << 20,
        granule: 16,
        thread_cache: true,
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

/// Arena commit step: the arena is made accessible (and, under strict overcommit, charged) this
/// much at a time, as the heap's highest handed-out byte approaches the committed end.
const COMMIT_STEP: usize = 2 << 20;

/// Chunk-table commit step, in bytes (2,048 records).
const TABLE_STEP: usize = 64 << 10;

/// Chunk records kept committed beyond the touched ones before an engine call: a call makes at most
/// two (see `Bfc::records_touched`).
const RECORD_SLACK: usize = 4;

/// A part of a reservation made accessible from its start on demand (see `os::commit`): its first
/// `done` bytes are readable and writable, the rest not yet. It only grows.
#[derive(Clone, Copy)]
struct Prefix {
    at: usize,
    /// Bytes of the part (a multiple of the page size).
    len: usize,
    done: usize,
}

impl Prefix {
    /// Commits the part up to at least `bytes` (capped at its length), `step` (a multiple of the
    /// page size) at a time. `false` if the kernel refuses; nothing changes then.
    #[inline]
    fn cover(&mut self, bytes: usize, step: usize) -> bool {
        let bytes = bytes.min(self.len);
        if bytes <= self.done {
            return true;
        }
        let to = bytes.next_multiple_of(step).min(self.len);
        // SAFETY: `done` and `to` are multiples of the page size (steps and `len` are) within the
        // part, which lies in a reservation made by `os::reserve_uncommitted`.
        if !unsafe { os::commit(self.at + self.done, to - self.done) } {
            return false;
        }
        self.done = to;
        true
    }
}

/// The memory source over the arena: hands out the whole arena as one region.
///
/// Both reservations start inaccessible (`os::reserve_uncommitted`), except the parts of the
/// metadata reservation sized by the arena alone (span classes and sets, transfer cache, anchor).
/// The arena, the pointer map, the span table and the chunk table are committed from their starts
/// as the heap reaches further ([`HostSource::commit_arena`], [`HostSource::commit_records`]), so a
/// heap is charged for what it uses, not for the 64 GiB it reserves.
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
    /// Arena bytes per map entry.
    map_block: usize,
    /// Committed prefixes: of the arena, the map, the chunk table and the span table.
    arena_commit: Prefix,
    map_commit: Prefix,
    table_commit: Prefix,
    spans_commit: Prefix,
}

impl HostSource {
    /// Commits the arena below `end` (an address; capped at the arena's end) with the map and
    /// span-table entries that describe it. `false` if the kernel refuses (the heap then hands
    /// nothing out above what is committed).
    #[inline]
    fn commit_arena(&mut self, end: usize) -> bool {
        let bytes = end.saturating_sub(self.arena);
        bytes <= self.arena_commit.done || self.commit_arena_slow(bytes)
    }

    #[cold]
    fn commit_arena_slow(&mut self, bytes: usize) -> bool {
        let to = bytes.next_multiple_of(COMMIT_STEP).min(self.arena_size);
        // Metadata first: a refusal then leaves the arena as it was.
        let (map_bytes, spans_bytes) = self.described_by(to);
        let page = self.page;
        self.map_commit.cover(map_bytes, page)
            && self.spans_commit.cover(spans_bytes, page)
            && self.arena_commit.cover(to, COMMIT_STEP)
    }

    /// Bytes of the pointer map and of the span table that describe the arena's first `bytes`.
    /// A chunk may start at `bytes` itself (the free rest of a block that ends there), so its map
    /// entry and span entry count too.
    fn described_by(&self, bytes: usize) -> (usize, usize) {
        (
            (bytes / self.map_block + 1) * core::mem::size_of::<Option<ChunkHandle>>(),
            ((bytes >> small::SPAN_SHIFT) + 1) * SmallHeap::ENTRY,
        )
    }

    /// Whether what is committed covers what the heap uses: the arena below `brk`, the map and
    /// span entries of the committed arena, and the chunk table's first `records` records.
    fn check_commit(&self, brk: usize, records: usize) -> Result<(), &'static str> {
        let (map_bytes, spans_bytes) = self.described_by(self.arena_commit.done);
        if brk > self.committed_end() {
            Err("memory in use lies past the committed end of the arena")
        } else if map_bytes.min(self.map_commit.len) > self.map_commit.done
            || spans_bytes.min(self.spans_commit.len) > self.spans_commit.done
        {
            Err("the pointer map or span table is not committed as far as the arena")
        } else if records.saturating_mul(core::mem::size_of::<Chunk>()) > self.table_commit.done {
            Err("chunk records in use lie past the committed part of the chunk table")
        } else {
            Ok(())
        }
    }

    /// The committed end of the arena (an address).
    #[inline]
    fn committed_end(&self) -> usize {
        self.arena + self.arena_commit.done
    }

    /// Commits the chunk table's first `records` records.
    #[inline]
    fn commit_records(&mut self, records: usize) -> bool {
        self.table_commit.cover(
            records.saturating_mul(core::mem::size_of::<Chunk>()),
            // (A whole number of pages also where pages are larger than the step.)
            TABLE_STEP.max(self.page),
        )
    }
}

// SAFETY: the arena and its map are one reservation each that only this source hands out: the region
// once (until freed), the map once (zeroed by `discard` when freed). The map is committed for every
// block below the committed end of the arena and one more; chunks start only there (the heap
// commits past every block it lets the engine hand out, see `Heap::engine_block` and
// `Heap::realloc_step`), so every entry the engine touches is writable (see
// `MemorySource::alloc_map`). No method calls an allocator.
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
        // Only the committed prefix holds pages: past it the reservation stays inaccessible (where
        // `discard` maps fresh pages, discarding it would make it writable).
        let size = size.min(self.arena_commit.done);
        // SAFETY: the range is our arena's committed prefix (page-aligned start) and holds nothing
        // in use. (A refusal only keeps the pages resident; `brk` does not move.)
        let _ = unsafe { os::discard(base, size & !(self.page - 1)) };
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
        let bytes =
            (entries * core::mem::size_of::<Option<ChunkHandle>>()).min(self.map_commit.done);
        // SAFETY: the map starts the metadata reservation (page-aligned), and its first
        // `map_commit.done` bytes are accessible (the rest was never written, so it reads as zero
        // once committed); zeroing them makes the map ready for the next `alloc_map`. The engine no
        // longer uses it.
        unsafe { os::discard_or_zero(map.as_ptr() as usize, bytes.next_multiple_of(self.page)) };
    }
}

/// Arena bytes per chunk record at most reserved: the chunk table holds
/// `min(chunk_capacity, arena_size / ARENA_BYTES_PER_RECORD)` records, so a smaller arena (one
/// sized down under an address-space limit) does not reserve the default table's 1 GiB. Engine
/// blocks are larger than 4 KiB or aligned to more than 4 KiB (so they have a free chunk of
/// padding, or a neighbour, at least that large), spans are 64 KiB, two free chunks are never
/// neighbours, and the engine keeps no quick lists: a table of one record per 256 bytes runs out
/// long after the arena does. (When it does run out, allocations return null.)
const ARENA_BYTES_PER_RECORD: usize = 256;

/// Fewest records a table gets (`HostConfig::validate`'s minimum).
const MIN_RECORDS: usize = 16;

/// Where each part of the metadata reservation starts (page-aligned offsets), in order: the
/// pointer map, the chunk table, the span table, the span classes, the span sets, the transfer
/// cache and the anchor.
struct MetaLayout {
    map_entries: usize,
    table_at: usize,
    spans_at: usize,
    span_entries: usize,
    classes_at: usize,
    sets_at: usize,
    set_words: usize,
    transfer_at: usize,
    anchor_at: usize,
    /// Bytes of the whole reservation.
    size: usize,
}

impl MetaLayout {
    /// The layout for an arena of `arena_size` bytes, a table of `capacity` records, a pointer map
    /// with an entry per `block` bytes, and pages of `page` bytes.
    fn new(arena_size: usize, capacity: usize, block: usize, page: usize) -> Self {
        let map_entries = arena_size.div_ceil(block);
        let map_bytes = (map_entries * 4).next_multiple_of(page);
        let table_bytes = (capacity * core::mem::size_of::<Chunk>()).next_multiple_of(page);
        let span_entries = arena_size >> small::SPAN_SHIFT;
        let spans_bytes = (span_entries * SmallHeap::ENTRY).next_multiple_of(page);
        let classes_bytes = span_entries.next_multiple_of(page);
        let set_words = small::SpanSets::words_for(span_entries);
        let sets_bytes = (set_words * core::mem::size_of::<u64>()).next_multiple_of(page);
        #[cfg(feature = "std")]
        let transfer_bytes =
            (tcache::TRANSFER_SLOTS * core::mem::size_of::<usize>()).next_multiple_of(page);
        #[cfg(not(feature = "std"))]
        let transfer_bytes = 0;
        let anchor_bytes = core::mem::size_of::<Anchor>().next_multiple_of(page);
        let table_at = map_bytes;
        let spans_at = table_at + table_bytes;
        let classes_at = spans_at + spans_bytes;
        let sets_at = classes_at + classes_bytes;
        let transfer_at = sets_at + sets_bytes;
        let anchor_at = transfer_at + transfer_bytes;
        MetaLayout {
            map_entries,
            table_at,
            spans_at,
            span_entries,
            classes_at,
            sets_at,
            set_words,
            transfer_at,
            anchor_at,
            size: anchor_at + anchor_bytes,
        }
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
    /// Touched free bytes the policy retains (see the module docs): starts at `release_threshold`
    /// and grows to twice the largest block freed, up to [`MAX_RETAIN`].
    retain: usize,
    release_threshold: usize,
    /// Process-unique id (thread caches bound to this heap hold it).
    #[cfg(feature = "std")]
    id: usize,
    /// Head of the registry of thread caches bound to this heap (a `ThreadCache` address, 0 for
    /// none); linked through the caches' `prev`/`next`.
    #[cfg(feature = "std")]
    caches: usize,
    /// Fork generation the registry belongs to.
    #[cfg(feature = "std")]
    fork_gen: usize,
    /// Blocks thread caches gave back when full, for the next refill (see `tcache::Transfer`).
    #[cfg(feature = "std")]
    transfer: tcache::Transfer,
    /// End of the arena.
    arena_end: usize,
    /// Every byte ever handed out lies below this address (the arena above it was never touched, or
    /// its pages were returned).
    brk: usize,
    page: usize,
}

/// Keeps its value on cache lines of its own (the pair the CPU prefetches together).
#[repr(align(128))]
struct CacheLine<T>(T);

/// Source of heap ids (never reused, unlike addresses).
#[cfg(feature = "std")]
static NEXT_ID: core::sync::atomic::AtomicUsize = core::sync::atomic::AtomicUsize::new(1);

/// Fork generation: incremented in every fork child by an atfork handler (installed by the first
/// heap's initialisation). A heap that sees a new generation rebuilds its cache registry (see
/// `Heap::after_fork`).
#[cfg(all(feature = "std", not(loom)))]
static FORK_GEN: core::sync::atomic::AtomicUsize = core::sync::atomic::AtomicUsize::new(0);
/// The forking thread's cache (its address and owner id), recorded in the child: the one cache that
/// survives a fork.
#[cfg(all(feature = "std", not(loom)))]
static FORK_SURVIVOR: [core::sync::atomic::AtomicUsize; 2] = [
    core::sync::atomic::AtomicUsize::new(0),
    core::sync::atomic::AtomicUsize::new(0),
];

/// Every live heap's anchor, linked through `Anchor::next`, so that a `fork` can hold every heap
/// lock across it. `head` (an anchor's address, 0 for none) and the links change only under `lock`.
struct HeapList {
    lock: SpinLock<()>,
    head: core::sync::atomic::AtomicUsize,
}

#[cfg(not(loom))]
fn heaps() -> &'static HeapList {
    static HEAPS: HeapList = HeapList {
        lock: SpinLock::with_reentry_handler((), reentered),
        head: core::sync::atomic::AtomicUsize::new(0),
    };
    &HEAPS
}

/// Loom build: one list per model execution.
#[cfg(loom)]
fn heaps() -> &'static HeapList {
    loom::lazy_static! {
        static ref HEAPS: HeapList = HeapList {
            lock: SpinLock::with_reentry_handler((), reentered),
            head: core::sync::atomic::AtomicUsize::new(0),
        };
    }
    &HEAPS
}

/// Calls `f` on every heap on the list. The caller holds the list's lock (or is a `fork` handler,
/// whose prepare step took it).
fn for_each_heap(mut f: impl FnMut(&Anchor)) {
    use core::sync::atomic::Ordering::Relaxed;
    let mut a = heaps().head.load(Relaxed);
    while a != 0 {
        // SAFETY: anchors leave the list (under its lock, held by the caller) before they are
        // unmapped.
        let anchor = unsafe { &*(a as *const Anchor) };
        f(anchor);
        a = anchor.next.load(Relaxed);
    }
}

/// The `fork` prepare step: takes the bindings lock, the heap list's lock and every heap lock, in
/// the order the rest of the crate takes them, so that the child inherits no lock held by a thread
/// it does not have. (An allocation that needs a heap lock, made on this thread by a prepare
/// handler that runs after this one, aborts with the re-entry message instead of hanging.)
fn fork_prepare() {
    #[cfg(all(feature = "std", loom))]
    let inverted = LOOM_BREAK_FORK_ORDER.load(crate::sync::UnmodelledOrdering::Relaxed);
    #[cfg(all(feature = "std", not(loom)))]
    let inverted = false;
    #[cfg(feature = "std")]
    if !inverted && !loom_try_fork_bindings() {
        bindings().lock_held();
    }
    #[cfg(all(feature = "std", loom))]
    if loom_try_fork_bindings() {
        // The negative control: the bindings lock only if it is free.
        if let Some(g) = bindings().try_lock() {
            core::mem::forget(g);
        }
    }
    heaps().lock.lock_held();
    for_each_heap(|a| a.heap.lock_held());
    #[cfg(feature = "std")]
    if inverted {
        bindings().lock_held();
    }
}

/// Releases what [`fork_prepare`] took, in the parent and in the child.
///
/// # Safety
///
/// [`fork_prepare`] ran on this thread (in the child: on the thread that forked, which is this one)
/// and nothing released its locks since.
unsafe fn fork_release() {
    // SAFETY: by the contract, this thread holds each of these locks.
    unsafe {
        for_each_heap(|a| a.heap.unlock_held());
        heaps().lock.unlock_held();
        #[cfg(feature = "std")]
        if !loom_try_fork_bindings() || loom_bindings_held_by_me() {
            bindings().unlock_held();
        }
    }
}

/// Negative control for the fork model (loom builds only): when set, the prepare step takes the
/// bindings lock last instead of first, inverting the order a thread-exit flush takes it in.
#[cfg(all(feature = "std", loom))]
#[doc(hidden)]
pub static LOOM_BREAK_FORK_ORDER: crate::sync::UnmodelledAtomicBool =
    crate::sync::UnmodelledAtomicBool::new(false);

/// Negative control for the fork models (loom builds only): when set, the prepare step takes the
/// bindings lock only if it is free, and goes ahead without it while another thread (an exit
/// flush, a drop) holds it: a fork child would inherit it held.
#[cfg(all(feature = "std", loom))]
#[doc(hidden)]
pub static LOOM_TRY_FORK_BINDINGS: crate::sync::UnmodelledAtomicBool =
    crate::sync::UnmodelledAtomicBool::new(false);

#[cfg(feature = "std")]
#[inline(always)]
fn loom_try_fork_bindings() -> bool {
    #[cfg(loom)]
    return LOOM_TRY_FORK_BINDINGS.load(crate::sync::UnmodelledOrdering::Relaxed);
    #[cfg(not(loom))]
    return false;
}

/// Whether this thread holds the bindings lock (loom builds; elsewhere unused).
#[cfg(feature = "std")]
#[inline(always)]
fn loom_bindings_held_by_me() -> bool {
    #[cfg(loom)]
    return bindings().loom_held_by_me();
    #[cfg(not(loom))]
    return true;
}

/// Loom build: at a `fork`, the forking thread must hold every allocator lock (the bindings lock,
/// the heap list's lock and every heap lock), so that the child inherits none held by a thread it
/// does not have, and the release steps unlock only what this thread took. Notes the first lock
/// found otherwise; [`loom_check_forks`] reports it. (Not a panic at the fork itself: a panic while
/// loom still holds a thread that has not started aborts the process instead of failing the model.)
#[cfg(loom)]
fn loom_note_fork_locks() {
    let missing = loom_first_lock_not_held();
    if missing != 0 {
        let _ = loom_fork_lock_missing().compare_exchange(
            0,
            missing,
            crate::sync::UnmodelledOrdering::Relaxed,
            crate::sync::UnmodelledOrdering::Relaxed,
        );
    }
}

/// Loom build: the first allocator lock the calling thread does not hold, numbered as
/// [`loom_check_forks`] names them (0: it holds them all).
#[cfg(loom)]
fn loom_first_lock_not_held() -> usize {
    #[cfg(feature = "std")]
    if !bindings().loom_held_by_me() {
        return 1;
    }
    if !heaps().lock.loom_held_by_me() {
        return 2;
    }
    let mut heaps_held = true;
    for_each_heap(|a| heaps_held &= a.heap.loom_held_by_me());
    if heaps_held {
        0
    } else {
        3
    }
}

/// Loom build: the first lock a fork of this model execution went ahead without (0: none).
#[cfg(loom)]
fn loom_fork_lock_missing() -> &'static crate::sync::UnmodelledAtomicUsize {
    loom::lazy_static! {
        static ref MISSING: crate::sync::UnmodelledAtomicUsize =
            crate::sync::UnmodelledAtomicUsize::new(0);
    }
    &MISSING
}

/// Loom build: panics if a fork of this model execution went ahead without holding one of the
/// allocator's locks. Models call it at their end, on the main thread.
#[cfg(loom)]
#[doc(hidden)]
pub fn loom_check_forks() {
    let what = match loom_fork_lock_missing().load(crate::sync::UnmodelledOrdering::Relaxed) {
        0 => return,
        1 => "the bindings lock",
        2 => "the heap list's lock",
        _ => "a heap lock",
    };
    panic!("fork without holding {what}");
}

/// Loom build: the `fork` prepare step, as the forking thread runs it (the models cannot fork).
#[cfg(loom)]
#[doc(hidden)]
pub fn loom_fork_prepare() {
    fork_prepare();
    loom_note_fork_locks();
    // Loom runs one thread at a time, so the count is exact at this point of the schedule.
    assert!(
        loom_state_held().load(crate::sync::UnmodelledOrdering::Relaxed) == 0,
        "fork while another thread initialises an allocator (its child would inherit a held state \
         lock)"
    );
}

/// Loom build: the release step that follows the `fork` in the parent.
///
/// # Safety
///
/// [`loom_fork_prepare`] ran on this thread and this is the first release since.
#[cfg(loom)]
#[doc(hidden)]
pub unsafe fn loom_fork_release() {
    // SAFETY: the caller's contract is `fork_release`'s.
    unsafe { fork_release() };
}

/// The thread whose `fork` holds the locks (its `pthread_self`, 0 for none).
///
/// Two things rule out a plain "held" flag. glibc runs a fork's prepare (and parent, and child)
/// handlers with its own atfork lock released, so two threads' forks can interleave their handlers:
/// with a shared flag, the second fork would skip the prepare step, then release in its parent
/// handler the locks the first fork still relies on, and the first fork's child could inherit a heap
/// lock held by a thread it does not have (and hang). And one thread may run the prepare handler
/// again before the parent or child handler of the first call: when the handlers are registered
/// twice (a child forked while `pthread_once` ran the registration reruns it), or when a `fork`
/// nests inside this thread's fork (another library's prepare handler, or a signal handler, forks).
///
/// So the first prepare call of a thread takes the locks (waiting while another thread's fork holds
/// them) and sets the owner; further prepare calls on the owner's thread count up its depth;
/// each parent or child call on the owner's thread counts down, and the one that reaches zero clears
/// the owner and releases the locks. glibc runs one parent or child call per prepare call, so the
/// locks stay held until the outermost fork has happened. Only the holder writes the owner and the
/// depth, so a thread that reads its own id holds the locks. (Loom model 8 checks two interleaved
/// forks, with the handlers run once, registered twice, or nested.)
struct ForkOwner {
    /// The owner's `pthread_self` (0 for none).
    thread: ForkAtomic,
    /// Prepare calls of the owner's fork not yet matched by a parent or child call (only the owner
    /// touches it).
    depth: ForkAtomic,
}

#[cfg(not(loom))]
type ForkAtomic = core::sync::atomic::AtomicUsize;
#[cfg(loom)]
type ForkAtomic = crate::sync::AtomicUsize;

#[cfg(not(loom))]
fn fork_owner() -> &'static ForkOwner {
    static OWNER: ForkOwner = ForkOwner {
        thread: ForkAtomic::new(0),
        depth: ForkAtomic::new(0),
    };
    &OWNER
}

/// Loom build: one owner per model execution.
#[cfg(loom)]
fn fork_owner() -> &'static ForkOwner {
    loom::lazy_static! {
        static ref OWNER: ForkOwner = ForkOwner {
            thread: ForkAtomic::new(0),
            depth: ForkAtomic::new(0),
        };
    }
    &OWNER
}

/// Negative control for loom model 8 (loom builds only): when set, the handlers treat the owner as
/// a shared "held" flag (any non-zero owner counts as this thread's), so a second thread's fork
/// goes ahead on the locks the first one took.
#[cfg(loom)]
#[doc(hidden)]
pub static LOOM_SHARED_FORK_FLAG: crate::sync::UnmodelledAtomicBool =
    crate::sync::UnmodelledAtomicBool::new(false);

/// Negative control for loom model 8 (loom builds only): when set, the first parent or child call
/// releases the locks even while an outer prepare call of the same thread is unmatched (a nested
/// fork then lets the outer one go ahead without them).
#[cfg(loom)]
#[doc(hidden)]
pub static LOOM_IGNORE_FORK_DEPTH: crate::sync::UnmodelledAtomicBool =
    crate::sync::UnmodelledAtomicBool::new(false);

/// Whether an owner value `owner` means that thread `me`'s fork holds the locks.
fn owned_by(owner: usize, me: usize) -> bool {
    #[cfg(loom)]
    if LOOM_SHARED_FORK_FLAG.load(crate::sync::UnmodelledOrdering::Relaxed) {
        return owner != 0;
    }
    owner == me
}

/// The prepare handler's work, on thread `me` (non-zero).
fn fork_handler_prepare(me: usize) {
    use core::sync::atomic::Ordering::Relaxed;
    if owned_by(fork_owner().thread.load(Relaxed), me) {
        fork_owner()
            .depth
            .store(fork_owner().depth.load(Relaxed) + 1, Relaxed);
        return;
    }
    fork_prepare();
    fork_owner().depth.store(1, Relaxed);
    fork_owner().thread.store(me, Relaxed);
}

/// What a parent or child call on thread `me` finds.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum ForkEnd {
    /// Another thread's fork (or none) holds the locks: nothing to do.
    NotOwner,
    /// This thread's fork holds them, and an outer prepare call is still unmatched.
    Nested,
    /// This thread's outermost fork is done: the owner is cleared, and the caller releases the
    /// locks next.
    Release,
}

/// Matches one prepare call of thread `me` (see [`fork_owner`]).
fn end_fork_call(me: usize) -> ForkEnd {
    use core::sync::atomic::Ordering::Relaxed;
    if !owned_by(fork_owner().thread.load(Relaxed), me) {
        return ForkEnd::NotOwner;
    }
    #[allow(unused_mut)]
    let mut depth = fork_owner().depth.load(Relaxed).saturating_sub(1);
    #[cfg(loom)]
    if LOOM_IGNORE_FORK_DEPTH.load(crate::sync::UnmodelledOrdering::Relaxed) {
        depth = 0;
    }
    fork_owner().depth.store(depth, Relaxed);
    if depth > 0 {
        return ForkEnd::Nested;
    }
    // Before the locks are released, so the next fork's prepare step (which waits for them) sets
    // its own id after this store.
    fork_owner().thread.store(0, Relaxed);
    ForkEnd::Release
}

/// The parent handler's work, on thread `me`.
fn fork_handler_parent(me: usize) {
    if end_fork_call(me) == ForkEnd::Release {
        // SAFETY: this thread's prepare handler took the locks (the owner was this thread) and
        // nothing released them since (the owner is cleared just before each release).
        unsafe { fork_release() };
    }
}

/// Loom build: a fork's prepare handler, on the thread with id `me` (non-zero, one per thread).
#[cfg(loom)]
#[doc(hidden)]
pub fn loom_fork_handler_prepare(me: usize) {
    fork_handler_prepare(me);
}

/// Loom build: a fork's parent handler, on the thread with id `me`.
#[cfg(loom)]
#[doc(hidden)]
pub fn loom_fork_handler_parent(me: usize) {
    fork_handler_parent(me);
}

/// This thread's id for the fork owner: the same in a `fork` child as in the thread that forked.
#[cfg(not(loom))]
fn fork_thread_id() -> usize {
    // SAFETY: `pthread_self` has no preconditions.
    unsafe { libc::pthread_self() as usize }
}

#[cfg(not(loom))]
extern "C" fn on_fork_prepare() {
    fork_handler_prepare(fork_thread_id());
}

#[cfg(not(loom))]
extern "C" fn on_fork_parent() {
    fork_handler_parent(fork_thread_id());
}

/// In the child, also records the one thread cache that survives (see `Heap::after_fork`), on every
/// call that finds this thread the owner: the child of a nested fork is a new process too.
#[cfg(not(loom))]
extern "C" fn on_fork_child() {
    let end = end_fork_call(fork_thread_id());
    if end == ForkEnd::NotOwner {
        return;
    }
    #[cfg(feature = "std")]
    {
        use core::sync::atomic::Ordering::Relaxed;
        let (addr, owner) = tcache::with(|tc| (tc as *const ThreadCache as usize, tc.owner.get()))
            .unwrap_or((0, tcache::UNBOUND));
        FORK_SURVIVOR[0].store(addr, Relaxed);
        FORK_SURVIVOR[1].store(owner, Relaxed);
        FORK_GEN.fetch_add(1, Relaxed);
    }
    if end == ForkEnd::Release {
        // SAFETY: the child's only thread is the one that forked, whose prepare handler took the
        // locks (the owner was this thread).
        unsafe { fork_release() };
    }
}

/// Registers the `fork` handlers, once per process, before any lock they take is first taken (the
/// first instance's initialisation calls it before taking the heap-list lock). `pthread_once`, not
/// a flag of our own: glibc reruns it in a child forked while another thread was inside it, where a
/// hand-made "registering" state would stay stuck.
#[cfg(not(loom))]
fn install_fork_handlers() {
    struct Once(core::cell::UnsafeCell<libc::pthread_once_t>);
    // SAFETY: only `pthread_once` touches the cell, and it synchronises itself.
    unsafe impl Sync for Once {}
    static ONCE: Once = Once(core::cell::UnsafeCell::new(libc::PTHREAD_ONCE_INIT));
    extern "C" fn register() {
        // SAFETY: registers handlers that take and release this crate's locks and touch atomics
        // and this thread's cache; none of them allocates. Nothing of ours is locked here.
        let rc = unsafe {
            libc::pthread_atfork(
                Some(on_fork_prepare),
                Some(on_fork_parent),
                Some(on_fork_child),
            )
        };
        // It fails only when libc's own malloc does (ENOMEM). The allocator works the same without
        // the handlers; only a `fork` while another thread holds one of its locks could then leave
        // the child unable to allocate (it would hang, as with any allocator that has no handlers).
        let _ = rc;
    }
    // Miri runs no `fork` and implements neither `pthread_once` nor `pthread_atfork`.
    #[cfg(miri)]
    let _ = (ONCE.0.get(), register as extern "C" fn());
    // SAFETY: `ONCE` is a static `pthread_once_t` initialised with `PTHREAD_ONCE_INIT`, and
    // `register` neither unwinds nor calls `pthread_once` on it.
    #[cfg(not(miri))]
    unsafe {
        libc::pthread_once(ONCE.0.get(), register)
    };
}

/// Puts a new heap on the list. The caller holds the list's lock.
fn link_heap(anchor: &Anchor) {
    use core::sync::atomic::Ordering::Relaxed;
    anchor.next.store(heaps().head.load(Relaxed), Relaxed);
    heaps()
        .head
        .store(anchor as *const Anchor as usize, Relaxed);
}

/// Takes a heap off the list (before its memory is unmapped).
fn unlink_heap(anchor: &Anchor) {
    use core::sync::atomic::Ordering::Relaxed;
    let me = anchor as *const Anchor as usize;
    let list = heaps();
    list.lock.lock().with(|_| {
        let next = anchor.next.load(Relaxed);
        if list.head.load(Relaxed) == me {
            list.head.store(next, Relaxed);
            return;
        }
        let mut prev = list.head.load(Relaxed);
        while prev != 0 {
            // SAFETY: a listed anchor, under the list's lock.
            let p = unsafe { &*(prev as *const Anchor) };
            if p.next.load(Relaxed) == me {
                p.next.store(next, Relaxed);
                return;
            }
            prev = p.next.load(Relaxed);
        }
    });
}

/// The current fork generation (always 0 under loom, which has no fork).
#[cfg(feature = "std")]
fn fork_generation() -> usize {
    #[cfg(not(loom))]
    return FORK_GEN.load(core::sync::atomic::Ordering::Relaxed);
    #[cfg(loom)]
    return 0;
}

/// Serialises thread-exit flushes and the rebinding of orphaned caches with instance drops (see
/// `tcache`'s docs).
#[cfg(all(feature = "std", not(loom)))]
fn bindings() -> &'static SpinLock<()> {
    static BINDINGS: SpinLock<()> = SpinLock::with_reentry_handler((), reentered);
    &BINDINGS
}

#[cfg(all(feature = "std", loom))]
fn bindings() -> &'static SpinLock<()> {
    loom::lazy_static! {
        static ref BINDINGS: SpinLock<()> = SpinLock::with_reentry_handler((), reentered);
    }
    &BINDINGS
}

/// Negative control for the fork model (loom builds only): when set, an initialisation takes the
/// heap list's lock only around linking the new heap, not for the whole initialisation, so a fork
/// can come while another thread holds an instance's state lock.
#[cfg(loom)]
#[doc(hidden)]
pub static LOOM_SHORT_INIT_LIST_LOCK: crate::sync::UnmodelledAtomicBool =
    crate::sync::UnmodelledAtomicBool::new(false);

/// Negative control for the loom models (loom builds only): when set, dropping an allocator does
/// not take the bindings lock, which the thread-exit model must catch.
#[cfg(all(feature = "std", loom))]
#[doc(hidden)]
pub static LOOM_SKIP_DROP_BINDINGS: crate::sync::UnmodelledAtomicBool =
    crate::sync::UnmodelledAtomicBool::new(false);

/// Negative control for the loom models (loom builds only): when set, a thread cache rebinding
/// after its instance's drop does not wait on the bindings lock, which the rebinding model must
/// catch.
#[cfg(all(feature = "std", loom))]
#[doc(hidden)]
pub static LOOM_SKIP_REBIND_BINDINGS: crate::sync::UnmodelledAtomicBool =
    crate::sync::UnmodelledAtomicBool::new(false);

/// New engine blocks of at least this size start at a multiple of it (64 KiB, like Windows'
/// allocation granularity), unless the padding does not fit near the arena's limit (then they are
/// placed as asked). A block grown in place keeps its address. Large blocks are often used from the
/// start and left partly untouched (buffers sized for the largest message, reserved capacity): on a
/// coarse grid, a new block's first pages are likely pages an earlier block already touched, so it
/// faults fewer pages in, and the process keeps fewer of them resident. The padding before a block
/// stays a free chunk for smaller requests. (bench-peers `large`, which writes each block's first
/// byte: 1800 -> 1100 ns per step, peak RSS 30.5 -> 15.4 MiB.)
const LARGE_ALIGN: usize = 64 << 10;

/// A sweep of large interior free chunks runs after this many thresholds of frees into them, and at
/// least twice the retained amount, and at least [`SWEEP_AFTER_IN_USE`] times the bytes in use.
const SWEEP_AFTER_THRESHOLDS: usize = 16;
/// See [`SWEEP_AFTER_THRESHOLDS`].
const SWEEP_AFTER_IN_USE: usize = 4;

/// Most touched free memory the give-back policy retains for reuse; a single freed block at least
/// this large returns its pages at once.
const MAX_RETAIN: usize = 64 << 20;

/// First-use initialisation state.
enum State {
    Uninit,
    Ready,
    /// The arena could not be reserved; every allocation returns null.
    Failed,
}

/// The heap behind its lock. It lives in the metadata reservation, not in the `GlobalBfc`, so its
/// address stays fixed while the `GlobalBfc` moves (a value used through `Allocator` may be moved
/// with its collection): thread caches and their exit flushes refer to it.
struct Anchor {
    /// Taken through [`Anchor::with`] only.
    heap: SpinLock<Heap>,
    /// The next heap on the list of live heaps (see [`HeapList`]).
    next: core::sync::atomic::AtomicUsize,
    /// Set when the allocator was dropped (loom builds, where the reservation is kept so that the
    /// models can see a flush that comes too late).
    #[cfg(loom)]
    dropped: crate::sync::UnmodelledAtomicBool,
}

impl Anchor {
    /// Runs `f` on the heap under its lock. Every use goes through here, so the first one after a
    /// `fork` repairs the cache registry (see `Heap::after_fork`).
    #[inline]
    fn with<R>(&self, f: impl FnOnce(&mut Heap) -> R) -> R {
        self.heap.lock().with(|h| {
            // Dropped (and so aborting) while the lock is still held: nobody sees the heap a
            // panic left half-updated. Not in loom builds: loom reports a failed model (a
            // deadlock, say) by panicking wherever the thread is, and the model's test expects it.
            #[cfg(not(loom))]
            let unwinding = AbortOnUnwind;
            #[cfg(feature = "std")]
            h.after_fork();
            let r = f(h);
            #[cfg(not(loom))]
            core::mem::forget(unwinding);
            r
        })
    }
}

/// Armed around every use of a heap and forgotten when it returns: dropped only if a panic (a bug:
/// nothing under the lock panics by design) unwinds through it, and then it aborts with a message,
/// instead of letting the unwind leave `GlobalAlloc` (undefined behaviour) or a heap half-updated.
#[cfg(not(loom))]
struct AbortOnUnwind;

#[cfg(not(loom))]
impl Drop for AbortOnUnwind {
    fn drop(&mut self) {
        os::fatal(format_args!(
            "panic inside the allocator, with its heap locked"
        ))
    }
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
#[repr(C)]
pub struct GlobalBfc {
    config: HostConfig,
    /// The heap's id once initialised (0 before): read by every small allocation and free, so it
    /// shares a cache line with the read-only config and not with the lock.
    #[cfg(feature = "std")]
    id: core::sync::atomic::AtomicUsize,
    /// The heap once initialised (null before, or if the arena could not be reserved).
    anchor: crate::sync::AtomicPtr<Anchor>,
    /// Serialises the first-use initialisation.
    state: CacheLine<SpinLock<State>>,
    /// Set when the arena could not be reserved (final): calls then return at once, without the
    /// global lock the initialisation takes.
    failed: crate::sync::AtomicBool,
    /// Initialisations so far (loom builds only).
    #[cfg(loom)]
    inits: crate::sync::UnmodelledAtomicUsize,
}

impl GlobalBfc {
    crate::sync::const_unless_loom! {
        /// An allocator with [`HostConfig::DEFAULT`]. Reserves nothing until first used. (`const`
        /// except in loom builds.)
        pub fn new() -> Self {
            Self::with_config(HostConfig::DEFAULT)
        }
    }

    crate::sync::const_unless_loom! {
        /// An allocator with `config` (checked at compile time in a `static`; `const` except in
        /// loom builds).
        pub fn with_config(config: HostConfig) -> Self {
            config.validate();
            GlobalBfc {
                config,
                #[cfg(feature = "std")]
                id: core::sync::atomic::AtomicUsize::new(0),
                anchor: crate::sync::AtomicPtr::new(ptr::null_mut()),
                state: CacheLine(SpinLock::with_reentry_handler(State::Uninit, reentered)),
                failed: crate::sync::AtomicBool::new(false),
                #[cfg(loom)]
                inits: crate::sync::UnmodelledAtomicUsize::new(0),
            }
        }
    }

    /// How many times the heap was initialised (loom builds only; the models check it is once).
    #[cfg(loom)]
    #[doc(hidden)]
    pub fn initialisations(&self) -> usize {
        self.inits.load(crate::sync::UnmodelledOrdering::Relaxed)
    }

    /// Loom build: a `fork` on thread `me`, between its prepare and its parent handlers. Panics if
    /// that thread's fork does not own the locks (its child's handler would not release them), and
    /// returns what the child would see of the heap (the end of its touched memory), read without
    /// the heap lock, as the child reads its copy: loom reports the read if another thread could be
    /// changing the heap at the same time.
    #[cfg(loom)]
    #[doc(hidden)]
    pub fn loom_fork_child_view(&self, me: usize) -> usize {
        use core::sync::atomic::Ordering::Relaxed;
        // The child's handler releases the locks only if this thread's fork holds them.
        assert!(
            fork_owner().thread.load(Relaxed) == me && fork_owner().depth.load(Relaxed) > 0,
            "fork on thread {me} without holding the allocator's locks"
        );
        loom_note_fork_locks();
        let a = self.anchor.load(crate::sync::Ordering::Acquire);
        assert!(!a.is_null(), "the allocator was not initialised");
        // SAFETY: a non-null anchor was published after being written, and stays valid until
        // `drop`, which needs `&mut self`.
        let anchor = unsafe { &*a };
        anchor.heap.loom_peek(|h| h.brk)
    }

    /// The parameters.
    pub fn config(&self) -> &HostConfig {
        &self.config
    }

    /// Current counters. Initialises the heap (reserving the arena) if it was not yet used; all
    /// zero if the arena cannot be reserved. `bytes_limit` is the arena's size, and `bytes_reserved`
    /// equals it from the first allocation on (the arena is the engine's single region).
    ///
    /// `bytes_in_use` and `num_chunks_in_use` count blocks held by callers only: blocks waiting in
    /// thread caches are subtracted. `num_allocs` counts a small block when it leaves the slab layer
    /// (for a caller or a thread cache), and `peak_bytes_in_use` includes cached blocks.
    pub fn stats(&self) -> Stats {
        self.with_heap(|h| h.stats()).unwrap_or_default()
    }

    /// Runs the engine's invariant checker and checks the slab layer's counters.
    pub fn check(&self) -> Result<(), CheckError> {
        self.with_heap(|h| h.check()).unwrap_or(Ok(()))
    }

    /// Flushes the calling thread's cache, then returns to the kernel the pages of every free chunk
    /// of at least one page, and every page of a span on which no small object is allocated.
    /// Returns the bytes of address space covered.
    pub fn release_free_memory(&self) -> usize {
        #[cfg(feature = "std")]
        self.flush_thread_cache();
        self.with_heap(|h| {
            #[cfg(feature = "std")]
            h.drain_transfer();
            let brk = h.brk;
            let purged = h.small.purge(brk, |a, l| {
                // SAFETY: whole pages of a span holding no allocated object. (If the kernel refuses,
                // they only stay resident: nothing relies on a span's free pages reading as zero.)
                let _ = unsafe { os::discard(a, l) };
            });
            h.sweep(1, false) + purged
        })
        .unwrap_or(0)
    }

    /// Returns the calling thread's cached small blocks to the heap (if its cache serves this
    /// allocator), with the blocks in the heap's transfer cache. Returns how many blocks went back
    /// from the thread's cache. Threads flush automatically when they exit.
    #[cfg(feature = "std")]
    pub fn flush_thread_cache(&self) -> usize {
        self.bound_cache(|tc| {
            let n = tc.held().1;
            self.with_heap(|h| h.flush_all(tc));
            n
        })
        .unwrap_or(0)
    }

    /// Bytes in the calling thread's cache for this allocator.
    #[cfg(feature = "std")]
    pub fn thread_cache_bytes(&self) -> usize {
        self.bound_cache(|tc| tc.held().0).unwrap_or(0)
    }

    /// Runs `f` on the calling thread's cache if it serves this allocator (the fast paths' test:
    /// one thread-local load and one compare).
    #[cfg(feature = "std")]
    #[inline(always)]
    fn bound_cache<R>(&self, f: impl FnOnce(&ThreadCache) -> R) -> Option<R> {
        let id = self.id.load(core::sync::atomic::Ordering::Relaxed);
        tcache::with(|tc| (tc.owner.get() == id).then(|| f(tc))).flatten()
    }

    /// Size of the reserved arena. Initialises the heap if it was not yet used; 0 if the arena
    /// cannot be reserved.
    pub fn arena_size(&self) -> usize {
        self.with_heap(|h| h.bfc.source().arena_size).unwrap_or(0)
    }

    /// Usable size of the block at `ptr`, or `None` if `ptr` is not the start of a block the
    /// allocator holds for a caller or in a cache.
    ///
    /// A diagnostic: a small block freed into a thread cache or the transfer cache still counts
    /// (it reads as its class size) until the cache gives it back to its span; a freed large
    /// block, and a small block whose span has it free, give `None`.
    pub fn usable_size(&self, ptr: *const u8) -> Option<usize> {
        self.with_heap(|h| h.usable_size(ptr as usize)).flatten()
    }

    /// Runs `f` on the heap, initialising it on first use; `None` if the arena is unavailable.
    #[inline]
    fn with_heap<R>(&self, f: impl FnOnce(&mut Heap) -> R) -> Option<R> {
        let mut a = self.anchor.load(crate::sync::Ordering::Acquire);
        if a.is_null() {
            if self.failed.load(crate::sync::Ordering::Relaxed) {
                return None;
            }
            a = self.init();
            if a.is_null() {
                return None;
            }
        }
        // SAFETY: a non-null anchor was published (with release) after being written, and stays
        // valid until `drop`, which needs `&mut self`.
        let anchor = unsafe { &*a };
        Some(anchor.with(f))
    }

    /// First use: reserves the arena and builds the heap (once; racing callers wait). Returns the
    /// anchor, or null if the arena could not be reserved. Out of line, so the fast paths do not
    /// carry its large stack frame.
    #[cold]
    #[inline(never)]
    fn init(&self) -> *mut Anchor {
        // The handlers must be in place before the first lock they take is taken: a `fork` while
        // this thread held the list's lock, with no handler yet, would leave it held in the child.
        #[cfg(not(loom))]
        install_fork_handlers();
        // Held for the whole initialisation, so a `fork` (whose prepare step takes it) never
        // happens while an instance's `state` lock is held by another thread.
        #[cfg(not(loom))]
        let _heaps = heaps().lock.lock();
        #[cfg(loom)]
        let _heaps = (!LOOM_SHORT_INIT_LIST_LOCK.load(crate::sync::UnmodelledOrdering::Relaxed))
            .then(|| heaps().lock.lock());
        self.state.0.lock().with(|state| {
            // The models check that no fork happens while this runs (see `loom_fork_prepare`).
            #[cfg(loom)]
            let _held = LoomStateHeld::enter();
            self.init_locked(state)
        })
    }

    /// The initialisation proper, under the heap list's lock and this instance's state lock.
    fn init_locked(&self, state: &mut State) -> *mut Anchor {
        match state {
            State::Ready => self.anchor.load(crate::sync::Ordering::Acquire),
            State::Failed => ptr::null_mut(),
            State::Uninit => {
                #[cfg(loom)]
                self.inits
                    .fetch_add(1, crate::sync::UnmodelledOrdering::Relaxed);
                match Heap::init(&self.config) {
                    Some((a, _id)) => {
                        // The negative control takes the list's lock only here.
                        #[cfg(loom)]
                        let _heaps = LOOM_SHORT_INIT_LIST_LOCK
                            .load(crate::sync::UnmodelledOrdering::Relaxed)
                            .then(|| heaps().lock.lock());
                        // SAFETY: the anchor was just built and stays mapped until `drop`; the heap
                        // list's lock is held.
                        link_heap(unsafe { a.as_ref() });
                        #[cfg(feature = "std")]
                        self.id.store(_id, core::sync::atomic::Ordering::Relaxed);
                        self.anchor
                            .store(a.as_ptr(), crate::sync::Ordering::Release);
                        *state = State::Ready;
                        a.as_ptr()
                    }
                    None => {
                        *state = State::Failed;
                        self.failed.store(true, crate::sync::Ordering::Relaxed);
                        ptr::null_mut()
                    }
                }
            }
        }
    }
}

/// Loom build: counts the threads inside an instance's initialisation, which holds its state lock;
/// [`loom_fork_prepare`] checks that none is at the fork. (A fork child would inherit that state
/// lock held by a thread it does not have, and its first use of the instance would wait forever.)
///
/// One count per model execution: an execution that panics (a negative control) abandons its
/// threads where they are, and a static count would carry their holds into the next model.
#[cfg(loom)]
fn loom_state_held() -> &'static crate::sync::UnmodelledAtomicUsize {
    loom::lazy_static! {
        static ref HELD: crate::sync::UnmodelledAtomicUsize =
            crate::sync::UnmodelledAtomicUsize::new(0);
    }
    &HELD
}

/// Loom build: one thread inside an initialisation, from `enter` until dropped.
#[cfg(loom)]
struct LoomStateHeld;

#[cfg(loom)]
impl LoomStateHeld {
    fn enter() -> Self {
        loom_state_held().fetch_add(1, crate::sync::UnmodelledOrdering::Relaxed);
        LoomStateHeld
    }
}

#[cfg(loom)]
impl Drop for LoomStateHeld {
    fn drop(&mut self) {
        loom_state_held().fetch_sub(1, crate::sync::UnmodelledOrdering::Relaxed);
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

// The heap is only reached under its lock, and nothing panics while holding it (errors abort, and
// so would a panic: `AbortOnUnwind`), so a panic elsewhere cannot leave it half-updated for the
// code that catches the panic.
impl core::panic::RefUnwindSafe for GlobalBfc {}
impl core::panic::UnwindSafe for GlobalBfc {}

impl Default for GlobalBfc {
    fn default() -> Self {
        Self::new()
    }
}

impl Heap {
    /// Reserves the arena and metadata, builds the heap in its anchor (in the metadata reservation)
    /// and returns the anchor and the heap's id. Allocates nothing.
    fn init(config: &HostConfig) -> Option<(NonNull<Anchor>, usize)> {
        let page = os::page_size();
        let engine_config = Config::host(0);
        let block = config.granule * engine_config.map_block_granules;
        // Under an address-space limit (`RLIMIT_AS`), the heap's reservations take at most half of
        // the address space still free, so the rest of the process (thread stacks, libraries,
        // file mappings) keeps room; the smallest arena allowed is tried in any case.
        let budget = os::address_space_left() / 2;
        // Whole steps of `ARENA_ALIGN`, rounded up so that the arena is never below
        // `min_arena_size` (a size that cannot be rounded up is halved like a refusal, below).
        let round_up = |size: usize| {
            size.checked_next_multiple_of(ARENA_ALIGN)
                .unwrap_or(usize::MAX & !(ARENA_ALIGN - 1))
        };
        let mut arena_size = round_up(config.arena_size);
        // The arena tried last.
        let smallest = round_up(config.min_arena_size);
        // Both reservations or neither: when the metadata does not fit beside an arena, a smaller
        // arena (with a smaller map and table) is tried.
        let (arena_mapping, arena_mapping_size, capacity, meta, meta_mapping) = loop {
            let capacity = config
                .chunk_capacity
                .min((arena_size / ARENA_BYTES_PER_RECORD).max(MIN_RECORDS));
            let meta = MetaLayout::new(arena_size, capacity, block, page);
            let last = arena_size <= smallest;
            // (A size near `usize::MAX` cannot be reserved either: halve it like a refusal.)
            let want = arena_size.checked_add(ARENA_ALIGN);
            let within = want
                .and_then(|w| w.checked_add(meta.size))
                .is_some_and(|total| total <= budget);
            if let (Some(want), true) = (want, within || last) {
                if let Some(p) = os::reserve_uncommitted(want) {
                    if let Some(m) = os::reserve_uncommitted(meta.size) {
                        // Metadata is touched sparsely, a page here and there: with transparent
                        // huge pages on for every mapping, each touch would make 2 MiB resident.
                        os::no_huge_pages(m, meta.size);
                        let fixed = m.as_ptr() as usize + meta.classes_at;
                        // The parts sized by the arena alone, committed whole: the span classes
                        // (read by thread caches without the lock), the span sets, the transfer
                        // cache and the anchor.
                        // SAFETY: `classes_at..size` is page-aligned, inside the fresh reservation.
                        if unsafe { os::commit(fixed, meta.size - meta.classes_at) } {
                            break (p, want, capacity, meta, m);
                        }
                        // SAFETY: the metadata reservation was just made and is unused.
                        unsafe { os::unreserve(m, meta.size) };
                    }
                    // SAFETY: the arena reservation was just made and is unused.
                    unsafe { os::unreserve(p, want) };
                }
            }
            if last {
                os::warn(format_args!(
                    "cannot reserve a heap arena of {} MiB or more (the kernel refused the \
                     address space or its first pages: an address-space or commit limit?); every \
                     allocation from this allocator fails",
                    smallest >> 20
                ));
                return None;
            }
            // Half the size just tried, but never below the smallest arena, which is tried last
            // (a 64 MiB arena with a 24 MiB minimum tries 64, 32, then 24 MiB). The size just
            // tried is a multiple of `ARENA_ALIGN` above `smallest`, so at least twice
            // `ARENA_ALIGN`: its half rounded up is smaller, and the loop ends.
            arena_size = (arena_size / 2).next_multiple_of(ARENA_ALIGN).max(smallest);
        };
        let arena = (arena_mapping.as_ptr() as usize).next_multiple_of(ARENA_ALIGN);
        let MetaLayout {
            map_entries,
            table_at,
            spans_at,
            span_entries,
            classes_at,
            sets_at,
            set_words,
            transfer_at,
            anchor_at,
            size: meta_mapping_size,
        } = meta;
        // SAFETY: the table area lies inside the fresh metadata reservation, is aligned (page-aligned
        // offset), and used by nothing else for the life of the heap, which never outlives the
        // mapping (unmapped only in `Drop`). Most of it is still inaccessible (`PROT_NONE`): a
        // record is read or written only once its page is committed (`prepare_records` before the
        // engine may use more records), and committed pages are zero-filled, a valid `[Chunk]`
        // (see `Chunk::EMPTY`).
        let table: &'static mut [Chunk] = unsafe {
            core::slice::from_raw_parts_mut(
                meta_mapping.as_ptr().add(table_at).cast::<Chunk>(),
                capacity,
            )
        };
        // SAFETY: as for the table: an aligned, exclusively owned part of the metadata reservation,
        // alive as long as the heap, whose entries are touched only once committed (in step with
        // the arena, `commit_arena`) and are then zero-filled (a valid `Span`: no object).
        let spans: &'static mut [small::Span] = unsafe {
            core::slice::from_raw_parts_mut(
                meta_mapping.as_ptr().add(spans_at).cast::<small::Span>(),
                span_entries,
            )
        };
        // SAFETY: as for the table: a zero-filled (all "not a span"), exclusively owned part of the
        // metadata reservation, alive as long as the heap; `AtomicU8` has `u8`'s layout, and any
        // byte is a valid one.
        let classes: &'static [core::sync::atomic::AtomicU8] = unsafe {
            core::slice::from_raw_parts(
                meta_mapping
                    .as_ptr()
                    .add(classes_at)
                    .cast::<core::sync::atomic::AtomicU8>(),
                span_entries,
            )
        };
        // SAFETY: as for the table: a zero-filled (all sets empty), aligned, exclusively owned part
        // of the metadata reservation, alive as long as the heap; any bytes are valid `u64`s.
        let sets: &'static mut [u64] = unsafe {
            core::slice::from_raw_parts_mut(
                meta_mapping.as_ptr().add(sets_at).cast::<u64>(),
                set_words,
            )
        };
        // SAFETY: as for the table: an aligned, exclusively owned part of the metadata reservation,
        // alive as long as the heap; any bytes are valid `usize`s.
        #[cfg(feature = "std")]
        let transfer: &'static mut [usize] = unsafe {
            core::slice::from_raw_parts_mut(
                meta_mapping.as_ptr().add(transfer_at).cast::<usize>(),
                tcache::TRANSFER_SLOTS,
            )
        };
        #[cfg(not(feature = "std"))]
        let _ = transfer_at;
        let meta_base = meta_mapping.as_ptr() as usize;
        let mut source = HostSource {
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
            map_block: block,
            arena_commit: Prefix {
                at: arena,
                len: arena_size,
                done: 0,
            },
            map_commit: Prefix {
                at: meta_base,
                len: table_at,
                done: 0,
            },
            table_commit: Prefix {
                at: meta_base + table_at,
                len: spans_at - table_at,
                done: 0,
            },
            spans_commit: Prefix {
                at: meta_base + spans_at,
                len: classes_at - spans_at,
                done: 0,
            },
        };
        // The engine's first region writes a record and the first map entry.
        if !(source.commit_records(RECORD_SLACK) && source.commit_arena(arena + 1)) {
            os::warn(format_args!(
                "cannot commit the heap's first pages (a commit limit?); every allocation from \
                 this allocator fails"
            ));
            // SAFETY: both reservations were just made; nothing in them is used.
            unsafe {
                os::unreserve(arena_mapping, arena_mapping_size);
                os::unreserve(meta_mapping, meta_mapping_size);
            }
            return None;
        }
        let engine_config = Config {
            granule: config.granule,
            memory_limit: arena_size,
            initial_region_size: arena_size,
            max_internal_fragmentation: config.granule,
            // No quick lists: the slab layer serves every request of up to 4 KiB aligned to at most
            // 4 KiB, so the engine's blocks of 1 KiB or less are aligned to more than 4 KiB, which
            // a quick list never serves (it holds exact, granule-aligned sizes). It would only keep
            // such blocks from coalescing with their free neighbours.
            quick_max_size: 0,
            quick_depth: 0,
            ..engine_config
        };
        let bfc = match Bfc::new(engine_config, source, table) {
            Ok(b) => b,
            Err(_) => {
                // (Unreachable with a validated `HostConfig`, but nothing is kept reserved.)
                // SAFETY: both reservations were just made; nothing in them is used (the engine
                // that would have used them was not built).
                unsafe {
                    os::unreserve(arena_mapping, arena_mapping_size);
                    os::unreserve(meta_mapping, meta_mapping_size);
                }
                return None;
            }
        };
        let heap = Heap {
            bfc,
            small: SmallHeap::new(arena, page, spans, classes, sets),
            peak: 0,
            largest: 0,
            span_allocs: 0,
            dirty: 0,
            retain: config.release_threshold,
            release_threshold: config.release_threshold,
            #[cfg(feature = "std")]
            id: NEXT_ID.fetch_add(1, core::sync::atomic::Ordering::Relaxed),
            #[cfg(feature = "std")]
            caches: 0,
            #[cfg(feature = "std")]
            fork_gen: fork_generation(),
            #[cfg(feature = "std")]
            transfer: tcache::Transfer::new(transfer),
            arena_end: arena + arena_size,
            brk: arena,
            page,
        };
        let id = heap.id();
        let anchor = meta_mapping
            .as_ptr()
            .wrapping_add(anchor_at)
            .cast::<Anchor>();
        // SAFETY: the anchor area lies inside the fresh metadata reservation, page-aligned (so
        // aligned for `Anchor`), large enough, and used by nothing else; it stays mapped until
        // `drop`.
        unsafe {
            anchor.write(Anchor {
                heap: SpinLock::with_reentry_handler(heap, reentered),
                next: core::sync::atomic::AtomicUsize::new(0),
                #[cfg(loom)]
                dropped: crate::sync::UnmodelledAtomicBool::new(false),
            })
        };
        NonNull::new(anchor).map(|a| (a, id))
    }

    /// The heap's process-unique id (0 without `std`, which has no thread caches).
    fn id(&self) -> usize {
        #[cfg(feature = "std")]
        return self.id;
        #[cfg(not(feature = "std"))]
        return 0;
    }

    /// Notes that `ptr..ptr + size` was handed out.
    #[inline]
    fn note_allocated(&mut self, ptr: usize, size: usize) {
        let end = ptr + size;
        if end > self.bfc.source().committed_end() {
            // Blocks are asked for below the committed end, and a resize commits its new end
            // first; reaching this is a bug, and the caller's first write would fault.
            os::fatal(format_args!(
                "block {ptr:#x}..{end:#x} beyond the committed arena"
            ));
        }
        self.brk = self.brk.max(end);
    }

    /// Commits room for the chunk records an engine call may make. `false` if the kernel refuses;
    /// then the call must not be made.
    #[inline]
    fn prepare_records(&mut self) -> bool {
        let records = self.bfc.records_touched() + RECORD_SLACK;
        self.bfc.source_mut().commit_records(records)
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
            self.note_peak(small::class_size(c));
            return p as *mut u8;
        }
        let grid = if size >= LARGE_ALIGN {
            align.max(LARGE_ALIGN)
        } else {
            align
        };
        let mut found = self.large_block(size, grid, align);
        // (A request larger than the arena, or aligned beyond what the engine serves, never fits:
        // no reclaim for it.)
        if found.is_none()
            && size <= self.arena_end - self.small.arena()
            && align <= crate::core::MAX_ALIGN
            && self.reclaim()
        {
            found = self.large_block(size, grid, align);
        }
        match found {
            Some(b) => {
                // All of the block: its caller may write up to `usable_size`.
                self.note_allocated(b.ptr, b.size);
                self.note_peak(b.size);
                b.ptr as *mut u8
            }
            None => ptr::null_mut(),
        }
    }

    /// An engine block for a large request: on the preferred grid `grid`, else (near the arena's
    /// limit the padding it needs may not fit) at the requested alignment `align`.
    #[inline]
    fn large_block(&mut self, size: usize, grid: usize, align: usize) -> Option<Allocated> {
        let found = self.engine_block(size, grid);
        if found.is_none() && grid != align {
            return self.engine_block(size, align);
        }
        found
    }

    /// An engine block of `size` bytes on a grid of `grid` bytes inside the committed arena. When
    /// the engine's pick lies past the committed end, commits up to the end of that pick and asks
    /// again (still bounded: a block is never handed out past the committed memory). `None` when
    /// out of memory or the kernel refuses the commit.
    #[inline]
    fn engine_block(&mut self, size: usize, grid: usize) -> Option<Allocated> {
        if !self.prepare_records() {
            return None;
        }
        let bound = self.bfc.source().committed_end();
        match self.bfc.allocate_block_below(size, grid, bound) {
            Ok(b) => Some(b),
            Err(AllocError::BeyondBound { end, .. }) => self.engine_block_beyond(size, grid, end),
            Err(_) => None,
        }
    }

    /// [`Heap::engine_block`] when the engine's pick would end at `end`, past the committed end.
    /// Commits only that far (not a bound on any pick: under a commit limit, a block that fits must
    /// not fail for memory it would never use). Asked again, the engine picks the same chunk or one
    /// ending lower, so a second refusal is not expected; a few rounds at most in any case.
    #[cold]
    fn engine_block_beyond(
        &mut self,
        size: usize,
        grid: usize,
        mut end: usize,
    ) -> Option<Allocated> {
        for _ in 0..4 {
            if !(self.prepare_records() && self.bfc.source_mut().commit_arena(end)) {
                return None;
            }
            let bound = self.bfc.source().committed_end();
            match self.bfc.allocate_block_below(size, grid, bound) {
                Ok(b) => return Some(b),
                Err(AllocError::BeyondBound { end: e, .. }) => end = e,
                Err(_) => return None,
            }
        }
        None
    }

    /// Gives class `c`, whose spans are all full, a new span from the engine and allocates.
    #[cold]
    fn small_refill(&mut self, c: usize) -> Option<usize> {
        if !self.small_new_span(c) {
            return None;
        }
        self.small.alloc(c)
    }

    /// Gives class `c`, whose spans are all full, room: a new span from the engine, or (when out of
    /// memory) whatever [`Heap::reclaim`] gave back to the class; `false` when neither.
    #[cold]
    fn small_new_span(&mut self, c: usize) -> bool {
        let b = match self.engine_block(SPAN, SPAN) {
            Some(b) => b,
            None => {
                if !self.reclaim() {
                    return false;
                }
                if self.small.has_room(c) {
                    return true;
                }
                match self.engine_block(SPAN, SPAN) {
                    Some(b) => b,
                    None => return false,
                }
            }
        };
        let base = b.ptr;
        self.note_allocated(base, SPAN);
        self.span_allocs += 1;
        self.small.add_span(c, base);
        true
    }

    /// Out of memory: gives back to the engine what the heap holds only for reuse, so that an
    /// allocation can try again. The transfer cache and, if it serves this heap, the calling
    /// thread's cache go back to the slab layer, and each class's empty current span to the engine
    /// (where it coalesces). Other threads' caches are out of reach: their fast paths take no lock.
    /// `true` if anything went back.
    #[cold]
    #[inline(never)]
    fn reclaim(&mut self) -> bool {
        let before = (self.small.objects, self.small.spans_live);
        #[cfg(feature = "std")]
        {
            let id = self.id;
            let own = tcache::with(|tc| {
                if tc.owner.get() == id {
                    self.flush_all(tc);
                    true
                } else {
                    false
                }
            });
            if own != Some(true) {
                self.drain_transfer();
            }
        }
        let mut spans = [0; small::NUM_CLASSES];
        let n = self.small.take_empty_current(&mut spans);
        for &base in &spans[..n] {
            self.free_engine(base);
        }
        (self.small.objects, self.small.spans_live) != before
    }

    /// Counters as callers see them: spans replaced by the small objects in them.
    fn stats(&self) -> Stats {
        let mut s = self.bfc.stats();
        let spans = self.small.spans_live;
        s.bytes_in_use = self.in_use();
        #[cfg(feature = "std")]
        let (cached_bytes, cached_blocks) = self.cached();
        #[cfg(not(feature = "std"))]
        let (cached_bytes, cached_blocks) = (0, 0);
        // Other threads' counts are read while they run, so a block moving between two caches
        // during the walk may be counted twice: never underflow.
        s.bytes_in_use = s.bytes_in_use.saturating_sub(cached_bytes);
        // Blocks in thread caches are free to callers.
        s.bytes_cached += cached_bytes;
        s.num_cached_chunks += cached_blocks;
        s.peak_bytes_in_use = self.peak;
        s.largest_alloc_size = self.largest;
        s.num_allocs = s.num_allocs - self.span_allocs + self.small.allocs;
        s.num_chunks_in_use =
            (s.num_chunks_in_use - spans + self.small.objects).saturating_sub(cached_blocks);
        // Entries up to the committed end: `brk` moves down when the top is trimmed, but the span
        // table's touched pages stay.
        s.metadata_bytes += self.small.metadata_bytes(self.bfc.source().committed_end());
        s
    }

    fn check(&self) -> Result<(), CheckError> {
        self.bfc.check()?;
        // `brk` bounds every byte a caller may have touched (up to the chunk's end: `usable_size`).
        if let Some(c) = self
            .bfc
            .chunks()
            .find(|c| c.allocated() && c.ptr() + c.size() > self.brk)
        {
            return Err(CheckError {
                what: "a block in use ends past the heap's recorded end of touched memory",
                at: c.ptr(),
            });
        }
        self.bfc
            .source()
            .check_commit(self.brk, self.bfc.records_touched())
            .map_err(|what| CheckError { what, at: 0 })?;
        self.small
            .check(self.brk)
            .map_err(|what| CheckError { what, at: 0 })?;
        #[cfg(feature = "std")]
        self.check_own_cache()?;
        #[cfg(feature = "std")]
        for c in 0..small::NUM_CLASSES {
            let mut ok = true;
            self.transfer.walk(c, |p| {
                ok &= matches!(self.small.class_of_live(p), Ok(Some(k)) if k == c);
            });
            if !ok {
                return Err(CheckError {
                    what: "transfer cache holds a block that is not a live object of its class",
                    at: 0,
                });
            }
        }
        Ok(())
    }

    /// Applies the give-back policy (module docs) after `f` was released.
    #[inline]
    fn after_free(&mut self, f: Freed) {
        let threshold = self.release_threshold;
        if f.merged_size < threshold {
            return;
        }
        // Like glibc's dynamic thresholds: a program that frees big blocks gets to keep about two
        // of them touched, so a buffer that is freed and allocated again (a growing Vec, a
        // per-request arena) does not fault its pages in every time.
        // Blocks of `MAX_RETAIN` or more are treated like glibc's mmapped ones: their pages go back
        // at once and they do not raise the retained amount.
        if f.size >= threshold && f.size < MAX_RETAIN {
            self.retain = self.retain.max((2 * f.size).min(MAX_RETAIN));
        }
        let retain = self.retain;
        let page = self.page;
        if f.merged_ptr + f.merged_size == self.arena_end {
            // The free top of the arena: once more than twice the retained amount was touched,
            // return all but the retained amount (glibc's trim, with hysteresis).
            // A block of `MAX_RETAIN` or more goes back whole, like a glibc mmapped chunk.
            let retain = if f.size >= MAX_RETAIN {
                threshold
            } else {
                retain
            };
            let keep = (f.merged_ptr + retain).next_multiple_of(page);
            if self.brk > keep && self.brk - f.merged_ptr >= 2 * retain {
                // SAFETY: `keep..brk` is page-aligned (brk rounded up) and inside the free top chunk.
                // `brk` moves down only if the pages now read as zero (`alloc_zeroed` relies on it).
                if unsafe { os::discard(keep, self.brk.next_multiple_of(page) - keep) } {
                    self.brk = keep;
                }
            }
            return;
        }
        self.dirty += f.size;
        if f.size >= MAX_RETAIN.max(SWEEP_AFTER_THRESHOLDS * threshold) {
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
                // arena and holding nothing in use. (A refusal only keeps the pages resident.)
                let _ = unsafe { os::discard(lo, hi - lo) };
                self.dirty -= f.size;
            }
            return;
        }
        // Sweep after four times as many bytes were freed as are in use (at least 16 thresholds,
        // and twice the retained amount), returning only chunks that stayed free since the
        // previous sweep: memory a program frees and allocates again in cycles keeps its pages.
        // (Once the bytes in use, 1x, re-faulted pages that large-block churn takes again a little
        // later: bench-peers `large` 1150 -> 600 ns per step at 2x, peak RSS 15 -> 21 MiB against
        // glibc's 154; the same churn writing whole blocks kept the same peak RSS. 2x -> 4x, on a
        // noisier machine: 12,405 -> 10,041 page faults, medians of 7 interleaved runs 1133 -> 1002
        // ns per step (rlsf 1120), peak RSS 21.4 -> 22.1 MiB; 8x faults no less than 4x.)
        let interval = (SWEEP_AFTER_THRESHOLDS * threshold)
            .max(2 * retain)
            .max(SWEEP_AFTER_IN_USE * self.in_use());
        if self.dirty >= interval {
            self.sweep(threshold, true);
        }
    }

    /// Returns the whole, possibly touched pages of every free chunk of at least `min` bytes that
    /// was not swept since it last changed (with `aging`, only of those already free and unchanged at
    /// the previous sweep). Returns the bytes covered.
    fn sweep(&mut self, min: usize, aging: bool) -> usize {
        self.dirty = 0;
        let page = self.page;
        let brk = self.brk.next_multiple_of(page);
        let mut covered = 0;
        let mut new_brk = brk;
        let arena_end = self.arena_end;
        self.bfc.sweep_dirty(min.max(page), aging, |ptr, size| {
            let lo = ptr.next_multiple_of(page);
            let hi = ((ptr + size) & !(page - 1)).min(brk);
            // SAFETY: whole pages inside a free chunk of the arena.
            let zeroed = hi <= lo || unsafe { os::discard(lo, hi - lo) };
            if hi > lo && zeroed {
                covered += hi - lo;
            }
            // `brk` moves down only over pages that now read as zero (`alloc_zeroed` relies on it).
            if ptr + size == arena_end && zeroed {
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
            // `free` names no class.
            SmallFree::DoubleFree | SmallFree::OtherClass => {
                small_error(p, SmallFree::DoubleFree, "")
            }
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
        match self.small.class_of_live(p) {
            Ok(Some(c)) => {
                // In place while the size stays in the class: a small block is always freed with a
                // layout of its own class (thread caches rely on it).
                if small::class_for(new_size, align) == Some(c) {
                    return ptr;
                }
                return self.allocate(new_size, align);
            }
            Ok(None) => {
                // An engine block shrinking to a small size moves to the slab layer, for the same
                // reason.
                if small::class_for(new_size, align).is_some() {
                    if let Err(e) = self.bfc.usable_size(p) {
                        os::fatal(format_args!("realloc: {e}"));
                    }
                    return self.allocate(new_size, align);
                }
            }
            Err(e) => small_error(p, e, "realloc: "),
        }
        if let Some(q) = self.resize_in_place(ptr, new_size) {
            return q;
        }
        // Allocate the new block under the same lock acquisition.
        let q = self.allocate(new_size, align);
        if !q.is_null() {
            return q;
        }
        // Before failing, the allocation took back what the heap held only for reuse (see
        // `Heap::reclaim`): an empty span that stood after the block may have gone back and
        // coalesced with the free chunk there.
        self.resize_in_place(ptr, new_size)
            .unwrap_or(ptr::null_mut())
    }

    /// Resizes the engine block at `ptr` to `new_size` bytes where it lies: `ptr` when done, null
    /// when out of memory, `None` when the block must move.
    #[inline]
    fn resize_in_place(&mut self, ptr: *mut u8, new_size: usize) -> Option<*mut u8> {
        let p = ptr as usize;
        // A shrink makes a record.
        if !self.prepare_records() {
            return Some(ptr::null_mut());
        }
        // Growing in place takes (part of) the free chunk after the block: commit exactly as far as
        // the grown block would reach, and only when it can grow. If the kernel refuses, the block
        // moves (a free chunk below the committed end may hold it) instead of failing.
        if let Some(end) = self.bfc.grown_end(p, new_size) {
            if !self.bfc.source_mut().commit_arena(end) {
                return None;
            }
        }
        match self.bfc.resize_in_place(p, new_size) {
            Ok(Resize::Done { freed, size }) => {
                match freed {
                    Some(f) => self.after_free(f),
                    // The whole block: its caller may write up to `usable_size`.
                    None => self.note_allocated(p, size),
                }
                self.note_peak(size);
                Some(ptr)
            }
            Ok(Resize::Moved) => None,
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
        // Threads whose caches are bound to this heap must not flush into it once it is gone: mark
        // them orphaned, under the lock their exit flush takes.
        #[cfg(all(feature = "std", not(loom)))]
        let _bindings = bindings().lock();
        #[cfg(all(feature = "std", loom))]
        let _bindings = (!LOOM_SKIP_DROP_BINDINGS.load(crate::sync::UnmodelledOrdering::Relaxed))
            .then(|| bindings().lock());
        let a = self
            .anchor
            .swap(ptr::null_mut(), crate::sync::Ordering::Acquire);
        self.state.0.lock().with(|state| *state = State::Failed);
        if a.is_null() {
            return;
        }
        // SAFETY: the anchor stays valid until the unmapping below.
        let anchor = unsafe { &*a };
        let maps = anchor.with(|h| {
            #[cfg(feature = "std")]
            h.for_each_cache(|tc| tc.orphaned.store(true, crate::sync::Ordering::Relaxed));
            let s = h.bfc.source();
            (
                s.arena_mapping,
                s.arena_mapping_size,
                s.meta_mapping,
                s.meta_mapping_size,
            )
        });
        unlink_heap(anchor);
        // SAFETY: `&mut self` proves no allocation from this allocator is still used through it
        // (its blocks cannot outlive it); exiting threads' flushes are excluded by the bindings
        // lock and skip the orphaned caches; the heap (in the metadata mapping, with no resources
        // of its own) is not used again.
        unsafe {
            os::unreserve(maps.0, maps.1);
            // Loom builds keep the metadata (and the anchor) mapped so that a model can observe a
            // flush that comes too late.
            #[cfg(not(loom))]
            os::unreserve(maps.2, maps.3);
        }
        #[cfg(loom)]
        {
            let _ = (maps.2, maps.3);
            anchor
                .dropped
                .store(true, crate::sync::UnmodelledOrdering::Relaxed);
        }
    }
}

// SAFETY: blocks come from the engine, which hands out each byte to one block at a time, honours the
// layout's alignment, and never returns memory that is still allocated; a thread cache only holds
// blocks freed to it, each on one list, and hands each out once. Every error path returns null or
// aborts, and nothing here panics. The one call that may allocate is the registration of a thread
// cache's exit flush, made while the cache is marked `BINDING`: an allocation it makes takes the
// locked path (and so never reaches the half-bound cache), and never re-enters with the lock held.
unsafe impl GlobalAlloc for GlobalBfc {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        #[cfg(feature = "std")]
        if let Some(c) = small::class_for(layout.size(), layout.align()) {
            return self.alloc_small(c);
        }
        self.alloc_locked(layout.size(), layout.align())
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        #[cfg(feature = "std")]
        if let Some(c) = small::class_for(layout.size(), layout.align()) {
            let p = self.alloc_small(c);
            if !p.is_null() {
                // SAFETY: the block holds at least `size` bytes.
                unsafe { ptr::write_bytes(p, 0, layout.size()) };
            }
            return p;
        }
        let threshold = self.config.release_threshold;
        // `fresh`: the heap's end of touched memory before this allocation. Nothing was ever
        // written at or above it (or its pages were returned), so that part of the block is zero.
        let Some((p, page, fresh)) = self.with_heap(|h| {
            let fresh = h.brk;
            (h.allocate(layout.size(), layout.align()), h.page, fresh)
        }) else {
            return ptr::null_mut();
        };
        if p.is_null() {
            return p;
        }
        // Only the block's part below `fresh` may hold old data.
        let dirty = (p as usize + layout.size())
            .min(fresh)
            .saturating_sub(p as usize);
        let lo = (p as usize).next_multiple_of(page);
        let hi = (p as usize + dirty) & !(page - 1);
        if dirty >= threshold && hi > lo {
            // Large: zero the whole pages by giving them back (they fault in as zero pages), and
            // write only the partial pages at the ends.
            // SAFETY: `lo..hi` is page-aligned inside the block we own; `p..lo` and `hi..p + dirty`
            // too.
            unsafe {
                os::discard_or_zero(lo, hi - lo);
                ptr::write_bytes(p, 0, lo - p as usize);
                ptr::write_bytes(hi as *mut u8, 0, p as usize + dirty - hi);
            }
        } else {
            // SAFETY: the block holds at least `layout.size() >= dirty` bytes.
            unsafe { ptr::write_bytes(p, 0, dirty) };
        }
        p
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        #[cfg(feature = "std")]
        if let Some(c) = small::class_for(layout.size(), layout.align()) {
            if self.bound_cache(|tc| tc.push(c, ptr as usize)) != Some(true) {
                self.free_small_slow(ptr, c);
            }
            return;
        }
        let _ = layout;
        self.free_locked(ptr);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let align = layout.align();
        // A small block the thread's cache vouches for stays in place within its class or moves
        // through the fast paths; anything else takes the step under the lock (which checks it).
        #[cfg(feature = "std")]
        let fast = small::class_for(layout.size(), align)
            .filter(|&c| self.bound_cache(|tc| tc.plausible(c, ptr as usize)) == Some(true));
        #[cfg(not(feature = "std"))]
        let fast: Option<usize> = None;
        let new = match fast {
            Some(c) if small::class_for(new_size, align) == Some(c) => return ptr,
            // SAFETY: forwarded contract: `new_size`, rounded up to `align`, fits an `isize`.
            Some(_) => unsafe {
                GlobalAlloc::alloc(self, Layout::from_size_align_unchecked(new_size, align))
            },
            None => match self.with_heap(|h| h.realloc_step(ptr, align, new_size)) {
                Some(p) => p,
                None => os::fatal(format_args!(
                    "realloc of pointer {ptr:p} but the heap was never initialised"
                )),
            },
        };
        if new.is_null() || new == ptr {
            return new;
        }
        // SAFETY: both blocks are live, distinct, and hold at least the copied length; `ptr` is
        // freed once, with its layout.
        unsafe {
            ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
            self.dealloc(ptr, layout);
        }
        new
    }
}

impl GlobalBfc {
    /// An allocation under the lock.
    // Out of line, so the small fast paths it sits beside need no stack frame.
    #[inline(never)]
    fn alloc_locked(&self, size: usize, align: usize) -> *mut u8 {
        self.with_heap(|h| h.allocate(size, align))
            .unwrap_or(ptr::null_mut())
    }

    /// A free under the lock.
    // Out of line, so the small fast paths it sits beside need no stack frame.
    #[inline(never)]
    fn free_locked(&self, ptr: *mut u8) {
        if self.with_heap(|h| h.free(ptr)).is_none() {
            os::fatal(format_args!(
                "free of pointer {ptr:p} but the heap was never initialised"
            ));
        }
    }

    /// A small allocation: the thread cache's list for class `c`, else the slow path.
    #[cfg(feature = "std")]
    #[inline(always)]
    fn alloc_small(&self, c: usize) -> *mut u8 {
        match self.bound_cache(|tc| tc.pop(c)).flatten() {
            Some(p) => p as *mut u8,
            None => self.alloc_small_slow(c),
        }
    }

    /// Refills the thread's list (binding the cache first if it is free to bind), or allocates under
    /// the lock when the thread's cache serves another instance or is gone.
    #[cfg(feature = "std")]
    #[cold]
    #[inline(never)]
    fn alloc_small_slow(&self, c: usize) -> *mut u8 {
        let from_cache =
            tcache::with(|tc| self.with_bound_cache(tc, |h| h.refill_cache(tc, c))).flatten();
        match from_cache {
            Some(p) => p,
            None => self.alloc_locked(small::class_size(c), 16),
        }
    }

    /// A small free the cache's fast path declined: the list is full, the pointer needs checking,
    /// or the cache is not bound yet (a thread that only frees binds here).
    #[cfg(feature = "std")]
    #[cold]
    #[inline(never)]
    fn free_small_slow(&self, ptr: *mut u8, c: usize) {
        let done = tcache::with(|tc| {
            self.with_bound_cache(tc, |h| h.free_to_cache(tc, c, ptr as usize))
                .is_some()
        });
        if done != Some(true) {
            self.free_locked(ptr);
        }
    }

    /// Runs `f` under the lock if the calling thread's cache `tc` is bound to this allocator,
    /// binding it first if it is unbound or its instance was dropped. `None` (nothing run) if the
    /// cache serves another live instance, the thread is exiting, caches are off, or the arena is
    /// unavailable.
    #[cfg(feature = "std")]
    fn with_bound_cache<R>(&self, tc: &ThreadCache, f: impl FnOnce(&mut Heap) -> R) -> Option<R> {
        let owner = tc.owner.get();
        if owner == self.id.load(core::sync::atomic::Ordering::Relaxed) {
            return self.with_heap(f);
        }
        let orphaned = tc.is_bound() && tc.orphaned.load(crate::sync::Ordering::Relaxed);
        if !self.config.thread_cache || !(owner == tcache::UNBOUND || orphaned) {
            return None;
        }
        if orphaned {
            // The instance it served was dropped: its blocks went with its arena. The drop marks
            // its caches orphaned while it walks their registry links under the bindings lock;
            // taking that lock waits for the walk to end, so the links this cache is about to
            // rewrite for its new instance are never read as the old registry's.
            #[cfg(not(loom))]
            let _walk_done = bindings().lock();
            #[cfg(loom)]
            let _walk_done = (!LOOM_SKIP_REBIND_BINDINGS
                .load(crate::sync::UnmodelledOrdering::Relaxed))
            .then(|| bindings().lock());
            tc.forget();
        }
        tc.owner.set(tcache::BINDING);
        // Registering the exit hook may allocate; those calls see `BINDING` and take the lock
        // (which is not held here).
        if !tcache::register_exit_flush() {
            tc.owner.set(tcache::DEAD);
            return None;
        }
        let r = self.with_heap(|h| {
            h.register(tc);
            tc.owner.set(h.id);
            // The heap's anchor, which stays put when this `GlobalBfc` moves.
            tc.instance
                .set(self.anchor.load(crate::sync::Ordering::Relaxed) as usize);
            tc.arena.set(h.small.arena());
            tc.arena_len.set(h.arena_end - h.small.arena());
            tc.classes.set(h.small.classes());
            f(h)
        });
        if r.is_none() {
            tc.owner.set(tcache::UNBOUND);
        }
        r
    }
}

/// Flushes an exiting thread's cache into its instance, unless the instance was dropped.
#[cfg(feature = "std")]
fn on_thread_exit(tc: &ThreadCache) {
    if tc.is_bound() {
        bindings().lock().with(|_| {
            if !tc.orphaned.load(crate::sync::Ordering::Relaxed) {
                // SAFETY: the heap is alive: dropping its allocator marks its caches orphaned under
                // the bindings lock, which we hold, before unmapping it; and its anchor does not
                // move with the allocator.
                let a = unsafe { &*(tc.instance.get() as *const Anchor) };
                // The models check that a flush never meets a dropped allocator.
                #[cfg(loom)]
                assert!(
                    !a.dropped.load(crate::sync::UnmodelledOrdering::Relaxed),
                    "exit flush reached a dropped allocator"
                );
                a.with(|h| {
                    h.flush_all(tc);
                    h.unregister(tc);
                });
            }
        });
    }
    tc.owner.set(tcache::DEAD);
}

/// The cache at a registry address.
///
/// # Safety
/// `addr` is on a live heap's registry, read under its lock: caches leave the registry (under that
/// lock) before their thread's storage goes away.
#[cfg(feature = "std")]
unsafe fn cache_at<'a>(addr: usize) -> &'a ThreadCache {
    // SAFETY: see the contract.
    unsafe { &*(addr as *const ThreadCache) }
}

#[cfg(feature = "std")]
impl Heap {
    /// In a fork child only the forking thread survives: the other threads' caches are gone (the
    /// child loses their blocks) and their storage may be reused by new threads. On the first use
    /// after a fork the registry keeps only the forking thread's cache, if it serves this heap.
    fn after_fork(&mut self) {
        let generation = fork_generation();
        if generation == self.fork_gen {
            return;
        }
        self.fork_gen = generation;
        self.caches = 0;
        #[cfg(not(loom))]
        {
            use core::sync::atomic::Ordering::Relaxed;
            if FORK_SURVIVOR[1].load(Relaxed) == self.id {
                // SAFETY: the forking thread's cache, alive in the child (it is this process's
                // original thread of the fork), bound to this heap.
                let tc = unsafe { cache_at(FORK_SURVIVOR[0].load(Relaxed)) };
                self.register(tc);
            }
        }
    }

    /// Adds `tc` to the registry.
    fn register(&mut self, tc: &ThreadCache) {
        use crate::sync::Ordering::Relaxed;
        let me = tc as *const ThreadCache as usize;
        tc.prev.store(0, Relaxed);
        tc.next.store(self.caches, Relaxed);
        if self.caches != 0 {
            // SAFETY: a registered cache, under the heap lock.
            unsafe { cache_at(self.caches) }.prev.store(me, Relaxed);
        }
        self.caches = me;
    }

    /// Removes `tc` from the registry.
    fn unregister(&mut self, tc: &ThreadCache) {
        use crate::sync::Ordering::Relaxed;
        let (prev, next) = (tc.prev.load(Relaxed), tc.next.load(Relaxed));
        if prev == 0 {
            self.caches = next;
        } else {
            // SAFETY: a registered cache, under the heap lock.
            unsafe { cache_at(prev) }.next.store(next, Relaxed);
        }
        if next != 0 {
            // SAFETY: as above.
            unsafe { cache_at(next) }.prev.store(prev, Relaxed);
        }
    }

    /// Runs `f` on every registered cache (touching only their atomics).
    fn for_each_cache(&self, mut f: impl FnMut(&ThreadCache)) {
        let mut cur = self.caches;
        while cur != 0 {
            // SAFETY: a registered cache, under the heap lock.
            let tc = unsafe { cache_at(cur) };
            f(tc);
            cur = tc.next.load(crate::sync::Ordering::Relaxed);
        }
    }

    /// `(bytes, blocks)` held by all thread caches and the transfer cache.
    fn cached(&self) -> (usize, usize) {
        let mut total = self.transfer.held();
        self.for_each_cache(|tc| {
            let (b, n) = tc.held();
            total.0 += b;
            total.1 += n;
        });
        total
    }

    /// Moves a batch of class `c` blocks into the calling thread's cache `tc` and returns one more
    /// for the caller (null when out of memory).
    fn refill_cache(&mut self, tc: &ThreadCache, c: usize) -> *mut u8 {
        // The slab hands out ascending addresses; the stack is filled in reverse so the thread
        // gets them in that order too (consecutive allocations stay adjacent in memory).
        let mut got = [0usize; tcache::MAX_BATCH + 1];
        let want = tcache::batch(c) + 1;
        // Blocks another thread's cache gave back first, then the slab layer.
        let mut n = self.transfer.pop_into(c, &mut got[..want]);
        while n < want {
            n += self.small.alloc_batch(c, &mut got[n..want]);
            if n < want && !self.small_new_span(c) {
                break;
            }
        }
        if n == 0 {
            return ptr::null_mut();
        }
        tc.fill_reversed(c, &got[1..n]);
        self.note_peak(small::class_size(c));
        self.note_slow(tc, c);
        got[0] as *mut u8
    }

    /// Counts a refill or flush of class `c` in the calling thread's cache `tc`; at the end of a
    /// decay period, moves half the blocks of every class that had none back to the slab layer
    /// (checked), so blocks a thread stopped using go back for any size to reuse.
    fn note_slow(&mut self, tc: &ThreadCache, c: usize) {
        if let Some(mut idle) = tc.note_slow(c) {
            while idle != 0 {
                let k = idle.trailing_zeros() as usize;
                idle &= idle - 1;
                self.flush_bin(tc, k, tc.count(k).div_ceil(2), false);
            }
        }
    }

    /// Moves `n` blocks of class `c` out of the calling thread's cache `tc`: into the transfer
    /// cache while it has room, if `transfer`, and otherwise back to the slab layer, each checked to
    /// be a live object of class `c`.
    fn flush_bin(&mut self, tc: &ThreadCache, c: usize, n: usize, transfer: bool) {
        let mut buf = [0usize; tcache::MAX_BATCH];
        let mut left = n;
        while left > 0 {
            let k = tc.pop_into(c, &mut buf[..left.min(tcache::MAX_BATCH)]);
            if k == 0 {
                break;
            }
            left -= k;
            let mut rest = &buf[..k];
            if transfer {
                rest = &rest[self.transfer.push_from(c, rest)..];
            }
            self.free_batch_to_slab(c, rest);
        }
    }

    /// Frees cached blocks of class `c` into the slab layer, aborting at the first one that is not a
    /// live object of that class.
    fn free_batch_to_slab(&mut self, c: usize, mut blocks: &[usize]) {
        while !blocks.is_empty() {
            let (k, outcome) = self.small.free_batch(c, blocks);
            let p = blocks[k - 1];
            blocks = &blocks[k..];
            self.after_slab_free(p, outcome);
        }
    }

    /// Returns every block in the transfer cache to the slab layer (checked).
    fn drain_transfer(&mut self) {
        let mut buf = [0usize; tcache::MAX_BATCH];
        for c in 0..small::NUM_CLASSES {
            loop {
                let k = self.transfer.pop_into(c, &mut buf);
                if k == 0 {
                    break;
                }
                self.free_batch_to_slab(c, &buf[..k]);
            }
        }
    }

    /// Finishes a checked free of the cached block `p` into the slab layer: gives an emptied span
    /// back to the engine, or aborts if `p` was not a live object of the cache's class.
    #[inline]
    fn after_slab_free(&mut self, p: usize, outcome: SmallFree) {
        match outcome {
            SmallFree::Freed(None) => {}
            SmallFree::Freed(Some(span)) => self.free_engine(span),
            SmallFree::OtherClass | SmallFree::NotSmall => os::fatal(format_args!(
                "free of pointer {p:#x} with a layout whose size class is not the block's"
            )),
            e => small_error(p, e, ""),
        }
    }

    /// Empties the calling thread's cache `tc` into the slab layer (checked), with the transfer
    /// cache.
    fn flush_all(&mut self, tc: &ThreadCache) {
        for c in 0..small::NUM_CLASSES {
            self.flush_bin(tc, c, tc.count(c), false);
        }
        self.drain_transfer();
    }

    /// The slow path of a small free into the calling thread's cache `tc`: checks the block against
    /// the slab layer, makes room, and caches it.
    fn free_to_cache(&mut self, tc: &ThreadCache, c: usize, p: usize) {
        match self.small.class_of_live(p) {
            Ok(Some(k)) if k == c => {
                if tc.contains(c, p) {
                    small_error(p, SmallFree::DoubleFree, "");
                }
                if tc.count(c) >= tcache::bin_capacity(c) {
                    self.flush_bin(tc, c, tcache::batch(c), true);
                }
                tc.fill(c, p);
                self.note_slow(tc, c);
            }
            // Not a live small block of class `c`: the pointer-based free reports a bad pointer, or
            // frees a block whose layout named another class.
            _ => self.free(p as *mut u8),
        }
    }

    /// Checks the calling thread's cache, if bound to this heap: every cached block is a live
    /// object of its stack's class, no stack is overfull, and no block is cached twice (a double
    /// free not caught yet).
    fn check_own_cache(&self) -> Result<(), CheckError> {
        let id = self.id;
        tcache::with(|tc| {
            if tc.owner.get() != id {
                return Ok(());
            }
            for c in 0..small::NUM_CLASSES {
                let mut n = 0;
                let mut ok = true;
                tc.walk(c, |p| {
                    n += 1;
                    ok &= matches!(self.small.class_of_live(p), Ok(Some(k)) if k == c);
                });
                if !ok {
                    return Err(CheckError {
                        what: "thread cache holds a block that is not a live object of its class",
                        at: 0,
                    });
                }
                if n > tcache::bin_capacity(c) || tc.has_duplicate(c) {
                    return Err(CheckError {
                        what: "thread cache stack overfull or holding a block twice",
                        at: 0,
                    });
                }
            }
            Ok(())
        })
        .unwrap_or(Ok(()))
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

    fn allocate_zeroed(
        &self,
        layout: Layout,
    ) -> Result<NonNull<[u8]>, allocator_api2::alloc::AllocError> {
        // `alloc_zeroed` writes only memory that may hold old data (see the module docs).
        // SAFETY: as for `allocate`.
        let p = unsafe { GlobalAlloc::alloc_zeroed(self, layout) };
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
        // SAFETY: forwarded contract; `new` is at least as large as `old`.
        unsafe { self.resize(ptr, old, new) }
    }

    unsafe fn shrink(
        &self,
        ptr: NonNull<u8>,
        old: Layout,
        new: Layout,
    ) -> Result<NonNull<[u8]>, allocator_api2::alloc::AllocError> {
        // SAFETY: forwarded contract; `new` is at most as large as `old`.
        unsafe { self.resize(ptr, old, new) }
    }
}

impl GlobalBfc {
    /// `Allocator::grow` and `shrink`: the block's first `min(old, new)` bytes in a block of
    /// layout `new`.
    ///
    /// # Safety
    /// `ptr` was allocated by `self` with layout `old`; on success it must no longer be used.
    unsafe fn resize(
        &self,
        ptr: NonNull<u8>,
        old: Layout,
        new: Layout,
    ) -> Result<NonNull<[u8]>, allocator_api2::alloc::AllocError> {
        use allocator_api2::alloc::{AllocError, Allocator};
        // Another alignment may change whether the block is a small one (and a small block must be
        // freed with a layout of its own class), so it moves.
        if new.align() != old.align() {
            let fresh = self.allocate(new)?;
            // SAFETY: the caller's contract; both blocks hold at least `min(old, new)` bytes, and
            // `fresh` is a new block, disjoint from `ptr`'s.
            unsafe {
                ptr::copy_nonoverlapping(
                    ptr.as_ptr(),
                    fresh.as_ptr().cast(),
                    old.size().min(new.size()),
                );
                self.deallocate(ptr, old);
            }
            return Ok(fresh);
        }
        // SAFETY: the caller's contract; same alignment. It may move the block (a large block
        // shrunk to a small size, a small one into another class, a block that cannot grow in
        // place) and return null if that allocation fails, which is handled below.
        let p = unsafe { GlobalAlloc::realloc(self, ptr.as_ptr(), old, new.size()) };
        NonNull::new(p)
            .map(|p| NonNull::slice_from_raw_parts(p, new.size()))
            .ok_or(AllocError)
    }
}

#[cfg(all(test, feature = "std", not(loom)))]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;
    use std::string::String;

    /// Names the case a child process runs (see [`run_child`]).
    const CHILD_ENV: &str = "BFC_ALLOC_HOST_UNIT_CHILD";

    /// An instance with a small arena (reservable anywhere).
    fn small_instance() -> GlobalBfc {
        GlobalBfc::with_config(HostConfig {
            arena_size: 64 << 20,
            min_arena_size: 64 << 20,
            chunk_capacity: 1 << 12,
            ..HostConfig::DEFAULT
        })
    }

    #[test]
    fn bad_configs_are_refused_with_their_reason() {
        let d = HostConfig::DEFAULT;
        let cases = [
            (
                HostConfig {
                    arena_size: 1 << 30,
                    min_arena_size: 2 << 30,
                    ..d
                },
                "arena_size < min_arena_size",
            ),
            (
                HostConfig {
                    arena_size: 1 << 20,
                    min_arena_size: 1 << 20,
                    ..d
                },
                "min_arena_size must be at least 2 MiB",
            ),
            (
                HostConfig {
                    chunk_capacity: 15,
                    ..d
                },
                "chunk_capacity too small",
            ),
            (
                HostConfig {
                    chunk_capacity: u32::MAX as usize,
                    ..d
                },
                "chunk_capacity must fit in u32",
            ),
            (HostConfig { granule: 24, ..d }, "granule must be"),
            (HostConfig { granule: 4, ..d }, "granule must be"),
            (HostConfig { granule: 8192, ..d }, "granule must be"),
        ];
        for (config, reason) in cases {
            let err = std::panic::catch_unwind(|| GlobalBfc::with_config(config))
                .err()
                .unwrap_or_else(|| panic!("accepted a config that should fail with {reason:?}"));
            let msg = err
                .downcast_ref::<&str>()
                .map(|s| String::from(*s))
                .or_else(|| err.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            assert!(msg.contains(reason), "{msg:?} does not name {reason:?}");
        }
        // The limits themselves are accepted.
        for config in [
            HostConfig {
                arena_size: 2 << 20,
                min_arena_size: 2 << 20,
                chunk_capacity: 16,
                granule: 8,
                ..d
            },
            HostConfig {
                chunk_capacity: u32::MAX as usize - 1,
                granule: 4096,
                ..d
            },
        ] {
            let _ = GlobalBfc::with_config(config);
        }
    }

    /// An arena size that is not a multiple of 2 MiB is rounded up, never below the minimum.
    #[test]
    fn an_odd_arena_size_is_rounded_up() {
        for (size, min, want) in [
            (3 << 20, 3 << 20, 4 << 20),
            ((5 << 20) + 1, 2 << 20, 6 << 20),
        ] {
            let a = GlobalBfc::with_config(HostConfig {
                arena_size: size,
                min_arena_size: min,
                chunk_capacity: 1 << 10,
                ..HostConfig::DEFAULT
            });
            assert_eq!(a.arena_size(), want, "arena_size {size}, min {min}");
            let layout = Layout::from_size_align(size - (1 << 20), 8).unwrap();
            // SAFETY: a non-zero size; the block is freed with its layout.
            unsafe {
                let p = a.alloc(layout);
                assert!(
                    !p.is_null(),
                    "{} bytes from an arena of {size}",
                    layout.size()
                );
                a.dealloc(p, layout);
            }
        }
    }

    /// A release threshold of 0 (every freed chunk counts) and one larger than the arena (none
    /// does) are both usable: blocks come and go, stay intact, and the heap checks clean.
    #[test]
    #[cfg_attr(
        miri,
        ignore = "writes and checks 100 MiB byte by byte: over 15 minutes under Miri"
    )]
    fn extreme_release_thresholds_work() {
        for release_threshold in [0, usize::MAX] {
            let a = GlobalBfc::with_config(HostConfig {
                arena_size: 64 << 20,
                min_arena_size: 64 << 20,
                chunk_capacity: 1 << 12,
                release_threshold,
                ..HostConfig::DEFAULT
            });
            let sizes = [5000, 1 << 20, 3 << 20, 70_000, 9 << 20];
            let mut blocks = std::vec::Vec::new();
            for round in 0..4u8 {
                for &size in &sizes {
                    let layout = Layout::from_size_align(size, 64).unwrap();
                    // SAFETY: a non-zero size.
                    let p = unsafe { a.alloc_zeroed(layout) };
                    assert!(!p.is_null());
                    // SAFETY: `p` holds `size` bytes.
                    let block = unsafe { core::slice::from_raw_parts_mut(p, size) };
                    assert!(block.iter().all(|&b| b == 0), "old data in a zeroed block");
                    block.fill(round + 1);
                    blocks.push((p, layout, round + 1));
                }
                // Free every other block, oldest first, so frees land beside live neighbours.
                let mut i = 0;
                blocks.retain(|&(p, layout, fill)| {
                    i += 1;
                    // SAFETY: each block holds `layout.size()` bytes.
                    let block = unsafe { core::slice::from_raw_parts(p, layout.size()) };
                    assert!(block.iter().all(|&b| b == fill), "a live block changed");
                    if i % 2 == 0 {
                        // SAFETY: `p` came from `a.alloc_zeroed(layout)` and is freed once.
                        unsafe { a.dealloc(p, layout) };
                        false
                    } else {
                        true
                    }
                });
                a.check().unwrap();
            }
            for (p, layout, _) in blocks {
                // SAFETY: as above.
                unsafe { a.dealloc(p, layout) };
            }
            a.check().unwrap();
            assert_eq!(a.stats().bytes_in_use, 0, "threshold {release_threshold}");
        }
    }

    /// Whether this process is the child running `case`.
    pub(super) fn is_child(case: &str) -> bool {
        std::env::var(CHILD_ENV).is_ok_and(|c| c == case)
    }

    /// Runs the test `host::tests::<case>` in a child process: `(status, stdout, stderr)`.
    fn run_child(case: &str) -> (std::process::ExitStatus, String, String) {
        run_child_at("host::tests", case)
    }

    /// Runs the test `module::case` in a child process, which must abort (SIGABRT) with `message`
    /// on stderr, before it prints "survived".
    pub(super) fn assert_child_aborts(module: &str, case: &str, message: &str) {
        let (status, stdout, stderr) = run_child_at(module, case);
        assert_eq!(status.signal(), Some(libc::SIGABRT), "{stdout}{stderr}");
        assert!(stderr.contains(message), "{stderr}");
        assert!(!stdout.contains("survived"), "{stdout}");
    }

    /// Runs the test `module::case` alone in a child process, which [`is_child`] tells apart.
    /// A child still running after a minute (a hang where an abort was expected) is killed and
    /// fails the test.
    pub(super) fn run_child_at(
        module: &str,
        case: &str,
    ) -> (std::process::ExitStatus, String, String) {
        use std::process::Stdio;
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", &std::format!("{module}::{case}"), "--nocapture"])
            .env(CHILD_ENV, case)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let start = std::time::Instant::now();
        while child.try_wait().unwrap().is_none() {
            if start.elapsed() > std::time::Duration::from_secs(60) {
                child.kill().unwrap();
                panic!("child {case} still running after 60 s");
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let out = child.wait_with_output().unwrap();
        (
            out.status,
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    #[test]
    #[cfg_attr(miri, ignore = "spawns a child process")]
    fn a_panic_under_the_heap_lock_aborts() {
        let case = "a_panic_under_the_heap_lock_aborts";
        if is_child(case) {
            let a = small_instance();
            a.with_heap(|_| panic!("a bug under the lock"));
            std::println!("child survived");
            return;
        }
        assert_child_aborts(
            "host::tests",
            case,
            "bfc-alloc: fatal: panic inside the allocator, with its heap locked",
        );
    }

    /// A block handed out past the committed end of the arena (a bug: every caller commits first)
    /// aborts with a clear message before the caller's first write would fault.
    #[test]
    #[cfg_attr(miri, ignore = "spawns a child process")]
    fn a_block_past_the_committed_arena_aborts() {
        let case = "a_block_past_the_committed_arena_aborts";
        if is_child(case) {
            let a = small_instance();
            a.with_heap(|h| {
                let end = h.bfc.source().committed_end();
                h.note_allocated(end - 16, 32);
            });
            std::println!("child survived");
            return;
        }
        assert_child_aborts("host::tests", case, "beyond the committed arena; aborting");
    }

    /// The checker sees a block in the calling thread's cache that its span holds as free (a double
    /// free not caught yet).
    #[test]
    fn the_checker_sees_a_thread_cache_holding_a_free_block() {
        std::thread::spawn(|| {
            let a = small_instance();
            let l = Layout::from_size_align(64, 8).unwrap();
            // SAFETY: a valid layout; the block is freed once with it.
            let p = unsafe { a.alloc(l) } as usize;
            assert_ne!(p, 0);
            // SAFETY: as above.
            unsafe { a.dealloc(p as *mut u8, l) };
            a.flush_thread_cache();
            a.check().unwrap();
            let c = small::class_for(64, 8).unwrap();
            tcache::with(|tc| tc.fill(c, p)).unwrap();
            assert_eq!(
                a.check().unwrap_err().what,
                "thread cache holds a block that is not a live object of its class"
            );
            // Take it out again before the thread's exit flush meets it.
            assert_eq!(tcache::with(|tc| tc.pop(c)).unwrap(), Some(p));
            a.check().unwrap();
        })
        .join()
        .unwrap();
    }

    /// The checker sees a block in use past the heap's recorded end of touched memory, and a block
    /// in the transfer cache that its span holds as free.
    #[test]
    fn the_checker_sees_a_block_past_brk_and_a_free_block_in_the_transfer_cache() {
        let a = GlobalBfc::with_config(HostConfig {
            thread_cache: false,
            ..*small_instance().config()
        });
        let big = Layout::from_size_align(1 << 20, 8).unwrap();
        // SAFETY: a valid layout; freed once with it below.
        let p = unsafe { a.alloc(big) };
        assert!(!p.is_null());
        a.check().unwrap();
        let brk = a
            .with_heap(|h| core::mem::replace(&mut h.brk, p as usize))
            .unwrap();
        assert_eq!(
            a.check().unwrap_err().what,
            "a block in use ends past the heap's recorded end of touched memory"
        );
        a.with_heap(|h| h.brk = brk).unwrap();
        a.check().unwrap();
        // SAFETY: allocated above with `big`.
        unsafe { a.dealloc(p, big) };

        let l = Layout::from_size_align(64, 8).unwrap();
        // SAFETY: a valid layout; freed once with it.
        let q = unsafe { a.alloc(l) } as usize;
        assert_ne!(q, 0);
        // SAFETY: as above.
        unsafe { a.dealloc(q as *mut u8, l) };
        let c = small::class_for(64, 8).unwrap();
        a.with_heap(|h| assert_eq!(h.transfer.push_from(c, &[q]), 1))
            .unwrap();
        assert_eq!(
            a.check().unwrap_err().what,
            "transfer cache holds a block that is not a live object of its class"
        );
        let mut out = [0usize; 1];
        a.with_heap(|h| assert_eq!(h.transfer.pop_into(c, &mut out), 1))
            .unwrap();
        assert_eq!(out[0], q);
        a.check().unwrap();
    }

    #[test]
    #[cfg_attr(miri, ignore = "spawns a child process")]
    fn a_thread_that_reenters_the_heap_lock_aborts() {
        let case = "a_thread_that_reenters_the_heap_lock_aborts";
        if is_child(case) {
            let a = small_instance();
            // What an allocation from inside the allocator would do: wait for the lock it holds.
            a.with_heap(|_| a.with_heap(|_| ()));
            std::println!("child survived");
            return;
        }
        assert_child_aborts(
            "host::tests",
            case,
            "bfc-alloc: fatal: allocator re-entered by the thread holding its lock",
        );
    }

    #[test]
    fn the_recorded_end_of_touched_memory_covers_whole_blocks() {
        // A request that is not a multiple of the granule gets a larger block; its caller may write
        // all of it (`usable_size`), so the heap's end of touched memory must cover it.
        let a = small_instance();
        let layout = Layout::from_size_align(5001, 8).unwrap();
        // SAFETY: a non-zero size.
        let p = unsafe { a.alloc(layout) };
        assert!(!p.is_null());
        assert_eq!(a.usable_size(p), Some(5008));
        assert_eq!(a.check(), Ok(()));
        // SAFETY: `p` came from `a.alloc(layout)`; grows it to a size that is no granule multiple.
        let q = unsafe { a.realloc(p, layout, 9001) };
        assert!(!q.is_null());
        assert_eq!(a.usable_size(q), Some(9008));
        assert_eq!(a.check(), Ok(()));
        // SAFETY: `q` came from the realloc above, with the new size.
        unsafe { a.dealloc(q, Layout::from_size_align(9001, 8).unwrap()) };
    }

    /// How many of the pages of `p..p + len` (page-aligned) are resident.
    fn resident_pages(p: *mut u8, len: usize) -> usize {
        let page = os::page_size();
        let mut v = std::vec![0u8; len.div_ceil(page)];
        // SAFETY: `p..p + len` is a page-aligned mapped range; `v` has one byte per page.
        let rc = unsafe { libc::mincore(p.cast(), len, v.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore");
        v.iter().filter(|&&b| b & 1 != 0).count()
    }

    /// `check()` reports memory in use past what is committed: the arena below `brk`, the map and
    /// span entries of the committed arena, the chunk records touched.
    #[test]
    fn check_reports_use_past_the_committed_parts() {
        let a = GlobalBfc::with_config(HostConfig {
            arena_size: 64 << 20,
            min_arena_size: 64 << 20,
            chunk_capacity: 1 << 12,
            ..HostConfig::DEFAULT
        });
        let big = Layout::from_size_align(3 << 20, 8).unwrap();
        let small = Layout::from_size_align(100, 8).unwrap();
        // SAFETY: non-zero layouts; the blocks stay live until the allocator is dropped.
        let (p, q) = unsafe { (a.alloc(big), a.alloc(small)) };
        assert!(!p.is_null() && !q.is_null());
        a.check().unwrap();
        // Each part, the bytes of it the heap uses now, and what `check()` says without them.
        type Part = fn(&mut HostSource) -> &mut Prefix;
        type Need = fn(&Heap) -> usize;
        let parts: [(Part, Need, &str); 4] = [
            (
                |s| &mut s.arena_commit,
                |h| h.brk - h.bfc.source().arena,
                "past the committed end of the arena",
            ),
            (
                |s| &mut s.map_commit,
                |h| {
                    h.bfc
                        .source()
                        .described_by(h.bfc.source().arena_commit.done)
                        .0
                },
                "pointer map or span table",
            ),
            (
                |s| &mut s.spans_commit,
                |h| {
                    h.bfc
                        .source()
                        .described_by(h.bfc.source().arena_commit.done)
                        .1
                },
                "pointer map or span table",
            ),
            (
                |s| &mut s.table_commit,
                |h| h.bfc.records_touched() * core::mem::size_of::<Chunk>(),
                "chunk records",
            ),
        ];
        for (part, need, what) in parts {
            // Pretend the part were committed exactly as far as needed, then one byte less.
            let done = a.with_heap(|h| part(h.bfc.source_mut()).done).unwrap();
            for short in [0, 1] {
                a.with_heap(|h| {
                    let need = need(h);
                    assert!(need > 0 && need <= done, "{what}: {need} of {done}");
                    part(h.bfc.source_mut()).done = need - short;
                });
                match (short, a.check()) {
                    (0, Ok(())) => {}
                    (1, Err(e)) if e.what.contains(what) => {}
                    (_, r) => panic!("{what}, {short} byte short: {r:?}"),
                }
            }
            a.with_heap(|h| part(h.bfc.source_mut()).done = done);
        }
        a.check().unwrap();
    }

    /// Bytes of `lo..hi` in readable and writable mappings (`/proc/self/maps`).
    fn accessible_bytes(lo: usize, hi: usize) -> usize {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        maps.lines()
            .filter_map(|line| {
                let mut f = line.split_whitespace();
                let (a, b) = f.next()?.split_once('-')?;
                let rw = f.next()?.starts_with("rw");
                let (a, b) = (
                    usize::from_str_radix(a, 16).ok()?,
                    usize::from_str_radix(b, 16).ok()?,
                );
                rw.then(|| b.min(hi).saturating_sub(a.max(lo)))
            })
            .sum()
    }

    /// Only what the heap reached is accessible: the arena's committed prefix follows its highest
    /// block in 2 MiB steps, and so do the pointer map, the span table and the chunk table; the
    /// rest of each reservation stays `PROT_NONE` (no commit charge under strict overcommit, not
    /// counted by `RLIMIT_DATA`). A freed block keeps its memory committed for reuse.
    #[test]
    #[cfg_attr(miri, ignore = "Miri has no mprotect")]
    fn only_what_the_heap_reached_is_committed() {
        let a = GlobalBfc::with_config(HostConfig {
            arena_size: 1 << 30,
            min_arena_size: 1 << 30,
            ..HostConfig::DEFAULT
        });
        let parts = |a: &GlobalBfc| {
            a.with_heap(|h| {
                let s = h.bfc.source();
                (
                    s.arena_commit,
                    [s.map_commit, s.table_commit, s.spans_commit],
                )
            })
            .unwrap()
        };
        let agree = |a: &GlobalBfc| {
            let (arena, meta) = parts(a);
            for p in core::iter::once(arena).chain(meta) {
                assert!(p.done < p.len, "a whole part is committed");
                assert_eq!(accessible_bytes(p.at, p.at + p.len), p.done);
            }
            arena.done
        };
        let l = Layout::from_size_align(3 << 20, 8).unwrap();
        let small = Layout::from_size_align(100, 8).unwrap();
        // SAFETY: non-zero layouts; each block is freed once with its layout.
        unsafe {
            let p = a.alloc(l);
            let q = a.alloc(small);
            assert!(!p.is_null() && !q.is_null());
            let done = agree(&a);
            assert!((3 << 20..=8 << 20).contains(&done), "committed {done}");
            let big = Layout::from_size_align(100 << 20, 8).unwrap();
            let r = a.alloc(big);
            assert!(!r.is_null());
            r.add((100 << 20) - 1).write(1);
            let done = agree(&a);
            assert!((103 << 20..=110 << 20).contains(&done), "committed {done}");
            a.dealloc(r, big);
            assert_eq!(agree(&a), done, "a free gave up the commit");
            // A block within the committed memory needs no more.
            let r = a.alloc(Layout::from_size_align(50 << 20, 8).unwrap());
            assert!(r as usize + (50 << 20) <= parts(&a).0.at + done);
            assert_eq!(agree(&a), done);
            a.dealloc(r, Layout::from_size_align(50 << 20, 8).unwrap());
            a.dealloc(p, l);
            a.dealloc(q, small);
        }
        a.check().unwrap();
    }

    /// The metadata reservation is marked "no huge pages" (`nh` in its smaps `VmFlags`): with
    /// transparent huge pages on for every mapping, each of its sparse touches (a page of the
    /// pointer map, of the chunk table, of the span table) would make 2 MiB resident.
    #[test]
    #[cfg_attr(miri, ignore = "Miri has no /proc")]
    fn metadata_is_not_backed_by_huge_pages() {
        if !std::path::Path::new("/sys/kernel/mm/transparent_hugepage").exists() {
            std::println!("skipped: this kernel has no transparent huge pages");
            return;
        }
        let a = small_instance();
        assert!(a.arena_size() > 0);
        let anchor = a.anchor.load(crate::sync::Ordering::Acquire) as usize;
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        let mut flags = None;
        for line in smaps.lines() {
            let range = line.split_once(' ').and_then(|(r, _)| r.split_once('-'));
            if let Some((Ok(lo), Ok(hi))) =
                range.map(|(lo, hi)| (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16)))
            {
                inside = (lo..hi).contains(&anchor);
            } else if let (true, Some(f)) = (inside, line.strip_prefix("VmFlags:")) {
                flags = Some(String::from(f));
                break;
            }
        }
        let flags = flags.expect("no mapping holds the heap's anchor");
        assert!(
            flags.split_whitespace().any(|f| f == "nh"),
            "VmFlags:{flags}"
        );
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri has no mincore")]
    fn zeroed_blocks_of_untouched_memory_are_not_written() {
        let a = small_instance();
        let size = 512 << 10; // below the release threshold: zeroed by writing
        let layout = Layout::from_size_align(size, 4096).unwrap();
        // SAFETY: a non-zero size.
        let p = unsafe { a.alloc_zeroed(layout) };
        assert!(!p.is_null());
        assert_eq!(resident_pages(p, size), 0, "fresh memory was written");
        // SAFETY: `p` holds `size` bytes.
        let block = unsafe { core::slice::from_raw_parts_mut(p, size) };
        assert!(block.iter().all(|&b| b == 0));
        block.fill(0xa5);
        // SAFETY: `p` came from `a.alloc_zeroed(layout)`.
        unsafe { a.dealloc(p, layout) };
        // The same memory again, now dirty, and more: the block straddles the end of touched memory.
        let layout = Layout::from_size_align(2 * size, 4096).unwrap();
        // SAFETY: a non-zero size.
        let q = unsafe { a.alloc_zeroed(layout) };
        assert!(!q.is_null());
        assert!(
            q <= p && p < q.wrapping_add(size),
            "the dirty block was not reused"
        );
        // SAFETY: `q` holds `2 * size` bytes.
        let block = unsafe { core::slice::from_raw_parts(q, 2 * size) };
        assert!(block.iter().all(|&b| b == 0), "old data in a zeroed block");
        // The `Allocator` trait's zeroed allocation too, of fresh memory (`q` is still live), 2 MiB
        // past the memory written above (with transparent huge pages always on, a write faults
        // in its whole 2 MiB-aligned page).
        let gap = Layout::from_size_align(2 << 20, 4096).unwrap();
        // SAFETY: a non-zero size; never written.
        let spacer = unsafe { a.alloc(gap) };
        assert!(!spacer.is_null());
        let small = Layout::from_size_align(size, 4096).unwrap();
        let r = allocator_api2::alloc::Allocator::allocate_zeroed(&a, small).unwrap();
        let r = r.cast::<u8>();
        assert!(
            r.as_ptr() >= q.wrapping_add(2 * size),
            "not above the touched memory"
        );
        assert_eq!(
            resident_pages(r.as_ptr(), size),
            0,
            "fresh memory was written"
        );
        // SAFETY: `r` came from `allocate_zeroed(small)`, `spacer` from `a.alloc(gap)`, `q` from
        // `a.alloc_zeroed(layout)`.
        unsafe {
            allocator_api2::alloc::Allocator::deallocate(&a, r, small);
            a.dealloc(spacer, gap);
            a.dealloc(q, layout);
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri has no mlock")]
    fn pages_the_kernel_keeps_are_still_zeroed() {
        // A locked page cannot be discarded (`madvise` fails on it and skips the rest of the range),
        // so the free top keeps its end of touched memory and `alloc_zeroed` writes the zeros.
        let a = GlobalBfc::with_config(HostConfig {
            arena_size: 256 << 20,
            min_arena_size: 256 << 20,
            chunk_capacity: 1 << 12,
            ..HostConfig::DEFAULT
        });
        let size = MAX_RETAIN; // freed whole at once: the trim covers it
        let layout = Layout::from_size_align(size, 4096).unwrap();
        // SAFETY: a non-zero size.
        let p = unsafe { a.alloc(layout) };
        assert!(!p.is_null());
        // SAFETY: `p` holds `size` bytes.
        unsafe { p.write_bytes(0xa5, size) };
        let locked = p.wrapping_add(size / 2);
        // SAFETY: one page inside the block.
        if unsafe { libc::mlock(locked.cast(), 4096) } != 0 {
            std::println!(
                "skipped: mlock refused ({}); raise RLIMIT_MEMLOCK to run this test",
                std::io::Error::last_os_error()
            );
            // SAFETY: `p` came from `a.alloc(layout)`.
            unsafe { a.dealloc(p, layout) };
            return;
        }
        // SAFETY: `p` came from `a.alloc(layout)`.
        unsafe { a.dealloc(p, layout) };
        // SAFETY: a non-zero size.
        let q = unsafe { a.alloc_zeroed(layout) };
        assert_eq!(q, p, "the freed block was not reused");
        // SAFETY: `q` holds `size` bytes.
        let block = unsafe { core::slice::from_raw_parts(q, size) };
        let stale = block.iter().position(|&b| b != 0);
        // SAFETY: the page locked above.
        unsafe { libc::munlock(locked.cast(), 4096) };
        assert_eq!(stale, None, "alloc_zeroed returned old data");
        assert_eq!(a.check(), Ok(()));
        // SAFETY: `q` came from `a.alloc_zeroed(layout)`.
        unsafe { a.dealloc(q, layout) };
    }

    /// An instance with a 512 MiB arena, for the give-back policy's large blocks.
    fn big_instance() -> GlobalBfc {
        GlobalBfc::with_config(HostConfig {
            arena_size: 512 << 20,
            min_arena_size: 512 << 20,
            chunk_capacity: 1 << 12,
            ..HostConfig::DEFAULT
        })
    }

    /// The heap's end of touched memory.
    fn brk(a: &GlobalBfc) -> usize {
        a.with_heap(|h| h.brk).unwrap()
    }

    /// Whether the `len` bytes at `p` all equal `byte`.
    ///
    /// # Safety
    /// `p..p + len` is readable.
    unsafe fn filled_with(p: *const u8, len: usize, byte: u8) -> bool {
        // SAFETY: guaranteed by the caller.
        unsafe { core::slice::from_raw_parts(p, len) }
            .iter()
            .all(|&b| b == byte)
    }

    /// The 5000-byte neighbour of [`block_beside_a_neighbour`].
    fn neighbour() -> Layout {
        Layout::from_size_align(5000, 8).unwrap()
    }

    /// Allocates a block of `layout` and the [`neighbour`] right after it (asserted); fills the
    /// block, all of its usable size, with 0xa5 and the neighbour with 0x5a. Returns the block, its
    /// usable size and the neighbour; the caller frees both.
    fn block_beside_a_neighbour(a: &GlobalBfc, layout: Layout) -> (*mut u8, usize, *mut u8) {
        // SAFETY: non-zero sizes.
        let (p, n) = unsafe { (a.alloc(layout), a.alloc(neighbour())) };
        assert!(!p.is_null() && !n.is_null());
        let usable = a.usable_size(p).unwrap();
        assert_eq!(
            n as usize,
            p as usize + usable,
            "the neighbour does not follow"
        );
        // SAFETY: each block holds at least the bytes written.
        unsafe {
            p.write_bytes(0xa5, usable);
            n.write_bytes(0x5a, neighbour().size());
        }
        (p, usable, n)
    }

    /// Writes a block of `layout` whole and frees it, runs `between`, then takes `layout` again
    /// through `alloc_zeroed`: asserts that the same block came back, and that it reads zero.
    fn dirty_then_zeroed(a: &GlobalBfc, layout: Layout, between: impl FnOnce()) -> *mut u8 {
        // SAFETY: a non-zero size.
        let p = unsafe { a.alloc(layout) };
        assert!(!p.is_null());
        // SAFETY: `p` holds its usable size; it came from `a.alloc(layout)` and is freed once.
        unsafe {
            p.write_bytes(0xa5, a.usable_size(p).unwrap());
            a.dealloc(p, layout);
        }
        between();
        // SAFETY: a non-zero size.
        let z = unsafe { a.alloc_zeroed(layout) };
        assert_eq!(z, p, "not reused");
        // SAFETY: `z` holds `layout.size()` bytes.
        let ok = unsafe { filled_with(z, layout.size(), 0) };
        assert!(ok, "old data in a zeroed block");
        z
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri has no mincore")]
    fn the_free_top_keeps_twice_the_largest_freed_block() {
        let a = big_instance();
        let mb = 1 << 20;
        let l = Layout::from_size_align(2 * mb, 4096).unwrap();
        // SAFETY: a non-zero size.
        let ps: std::vec::Vec<*mut u8> = (0..8).map(|_| unsafe { a.alloc(l) }).collect();
        for &p in &ps {
            assert!(!p.is_null());
            // SAFETY: `p` holds `2 * mb` bytes.
            unsafe { p.write_bytes(0xa5, 2 * mb) };
        }
        let start = ps[0] as usize;
        assert_eq!(ps[7] as usize, start + 14 * mb, "blocks are not contiguous");
        for &p in &ps {
            // SAFETY: `p` came from `a.alloc(l)`, freed once.
            unsafe { a.dealloc(p, l) };
        }
        // The last free merged everything into the free top: 16 MiB touched, twice the largest
        // freed block (4 MiB) kept, the rest given back.
        assert_eq!(brk(&a), start + 4 * mb);
        assert_eq!(resident_pages((start + 4 * mb) as *mut u8, 12 * mb), 0);
        assert_eq!(a.check(), Ok(()));
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri has no mincore")]
    fn a_huge_block_freed_at_the_top_goes_back_whole() {
        let a = big_instance();
        let mb = 1 << 20;
        // Raise the retained amount to 20 MiB with an interior free.
        let mid = Layout::from_size_align(10 * mb, 4096).unwrap();
        let guard = Layout::from_size_align(64 << 10, 4096).unwrap();
        // SAFETY: non-zero sizes.
        let (x, g) = unsafe { (a.alloc(mid), a.alloc(guard)) };
        // SAFETY: `x` holds `10 * mb` bytes; it came from `a.alloc(mid)`.
        unsafe {
            x.write_bytes(1, 10 * mb);
            a.dealloc(x, mid);
        }
        let huge = Layout::from_size_align(MAX_RETAIN, 4096).unwrap();
        // SAFETY: a non-zero size.
        let p = unsafe { a.alloc(huge) };
        assert!(p as usize > g as usize, "not at the top");
        // SAFETY: `p` holds `MAX_RETAIN` bytes; it came from `a.alloc(huge)`.
        unsafe {
            p.write_bytes(0xa5, MAX_RETAIN);
            a.dealloc(p, huge);
        }
        // Like a glibc mmapped chunk: only the release threshold stays touched.
        let threshold = a.config().release_threshold;
        assert_eq!(brk(&a), p as usize + threshold);
        assert_eq!(
            resident_pages(p.wrapping_add(threshold), MAX_RETAIN - threshold),
            0
        );
        // SAFETY: `g` came from `a.alloc(guard)`.
        unsafe { a.dealloc(g, guard) };
        assert_eq!(a.check(), Ok(()));
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri has no mincore")]
    fn a_huge_interior_block_gives_back_its_pages_at_once_and_spares_its_neighbours() {
        let a = big_instance();
        // Not a page multiple: the block's last page is shared with the next block.
        let huge = Layout::from_size_align(MAX_RETAIN + 100, 8).unwrap();
        let keep = Layout::from_size_align(32 << 20, 4096).unwrap();
        let (p, usable, n) = block_beside_a_neighbour(&a, huge);
        // SAFETY: a non-zero size.
        let k = unsafe { a.alloc(keep) };
        assert!(!k.is_null());
        // SAFETY: `p` came from `a.alloc(huge)`.
        unsafe { a.dealloc(p, huge) };
        let page = os::page_size();
        // Every page wholly inside the freed block went back at once.
        assert_eq!(resident_pages(p, usable & !(page - 1)), 0);
        // SAFETY: `n` is live and holds the neighbour's bytes.
        let ok = unsafe { filled_with(n, neighbour().size(), 0x5a) };
        assert!(ok, "a live neighbour lost its data");
        // SAFETY: `n` and `k` came from `a.alloc`.
        unsafe {
            a.dealloc(n, neighbour());
            a.dealloc(k, keep);
        }
        assert_eq!(a.check(), Ok(()));
    }

    #[test]
    #[cfg_attr(miri, ignore = "a 128 MiB block in a 512 MiB arena")]
    fn a_huge_shrink_in_place_keeps_the_blocks_last_page() {
        let a = big_instance();
        let old = Layout::from_size_align(2 * MAX_RETAIN, 8).unwrap();
        let new_size = MAX_RETAIN / 2 + 100; // the freed tail starts mid-page
        let guard = Layout::from_size_align(64 << 10, 8).unwrap();
        // SAFETY: non-zero sizes.
        let (p, g) = unsafe { (a.alloc(old), a.alloc(guard)) };
        assert!(!p.is_null() && !g.is_null());
        // SAFETY: `p` holds `2 * MAX_RETAIN` bytes.
        unsafe { p.add(new_size - 8192).write_bytes(0xa5, 8192) };
        // SAFETY: `p` came from `a.alloc(old)`.
        let q = unsafe { a.realloc(p, old, new_size) };
        assert_eq!(q, p, "shrinks in place");
        // SAFETY: `q` holds `new_size` bytes.
        let ok = unsafe { filled_with(q.add(new_size - 8192), 8192, 0xa5) };
        assert!(ok, "the shrunk block lost data");
        // SAFETY: from `realloc` (new size) and `a.alloc(guard)`.
        unsafe {
            a.dealloc(q, Layout::from_size_align(new_size, 8).unwrap());
            a.dealloc(g, guard);
        }
        assert_eq!(a.check(), Ok(()));
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri has no mincore")]
    fn interior_frees_are_swept_once_they_stay_free() {
        let a = big_instance();
        let mb = 1 << 20;
        let la = Layout::from_size_align(2 * mb, 4096).unwrap();
        let lb = Layout::from_size_align(3 * mb, 4096).unwrap();
        let guard = Layout::from_size_align(64 << 10, 4096).unwrap();
        // SAFETY: non-zero sizes.
        let (x, g1, y, g2) = unsafe { (a.alloc(la), a.alloc(guard), a.alloc(lb), a.alloc(guard)) };
        // SAFETY: `x` holds `2 * mb` bytes; it came from `a.alloc(la)`.
        unsafe {
            x.write_bytes(0xa5, 2 * mb);
            a.dealloc(x, la);
        }
        assert_eq!(resident_pages(x, 2 * mb), 2 * mb / os::page_size());
        // Churn elsewhere: every few frees start a sweep, and the second one returns `x`, which
        // stayed free since the first.
        let mut y = y;
        for _ in 0..24 {
            // SAFETY: `y` holds `3 * mb` bytes; it came from `a.alloc(lb)`.
            unsafe {
                y.write_bytes(1, 3 * mb);
                a.dealloc(y, lb);
                y = a.alloc(lb);
            }
        }
        assert_eq!(
            resident_pages(x, 2 * mb),
            0,
            "a long-free block kept its pages"
        );
        // SAFETY: from `a.alloc`.
        unsafe {
            a.dealloc(y, lb);
            a.dealloc(g1, guard);
            a.dealloc(g2, guard);
        }
        assert_eq!(a.check(), Ok(()));
    }

    #[test]
    fn zeroed_blocks_below_the_end_of_touched_memory_are_zero() {
        let a = small_instance();
        let l = Layout::from_size_align(5000, 8).unwrap();
        // The end of touched memory in the middle of a page: a reused block up to it.
        let q = dirty_then_zeroed(&a, l, || {});
        // Again with a release between the free and the zeroed allocation: it lowers the end of
        // touched memory to the free top's first whole page, never below the data under it.
        let z = dirty_then_zeroed(&a, l, || {
            a.release_free_memory();
        });
        // SAFETY: both came from `alloc_zeroed(l)`.
        unsafe {
            a.dealloc(q, l);
            a.dealloc(z, l);
        }
        assert_eq!(a.check(), Ok(()));
    }

    #[test]
    fn a_large_zeroed_block_spares_the_next_blocks_page() {
        let a = small_instance();
        let threshold = a.config().release_threshold;
        // At least the threshold (zeroed by giving pages back) and no page multiple.
        let big = Layout::from_size_align(threshold + 100, 8).unwrap();
        let (p, _, n) = block_beside_a_neighbour(&a, big);
        // SAFETY: `p` came from `a.alloc(big)`.
        unsafe { a.dealloc(p, big) };
        // SAFETY: a non-zero size.
        let z = unsafe { a.alloc_zeroed(big) };
        assert_eq!(z, p, "not reused");
        // SAFETY: `z` holds `big.size()` bytes, `n` the neighbour's.
        unsafe {
            assert!(filled_with(z, big.size(), 0), "old data in a zeroed block");
            assert!(
                filled_with(n, neighbour().size(), 0x5a),
                "the next block lost its data"
            );
            a.dealloc(z, big);
            a.dealloc(n, neighbour());
        }
        assert_eq!(a.check(), Ok(()));
    }

    #[test]
    fn a_small_realloc_under_the_lock_moves_to_the_new_class() {
        // This thread's cache serves `a`, so `b`'s realloc takes the step under the lock.
        std::thread::spawn(|| {
            let (a, b) = (small_instance(), small_instance());
            let l = Layout::from_size_align(16, 8).unwrap();
            let grown = Layout::from_size_align(100, 8).unwrap();
            // SAFETY: non-zero sizes; each block is freed once with its layout.
            unsafe {
                let x = a.alloc(l);
                let p = b.alloc(l);
                p.write_bytes(7, 16);
                let q = b.realloc(p, l, 100);
                assert!(b.usable_size(q).is_some_and(|u| u >= 100), "grew in place");
                assert!(core::slice::from_raw_parts(q, 16).iter().all(|&v| v == 7));
                b.dealloc(q, grown);
                a.dealloc(x, l);
            }
            assert_eq!(b.check(), Ok(()));
        })
        .join()
        .unwrap();
    }

    #[test]
    #[cfg_attr(
        miri,
        ignore = "Miri aborts on the 2^61-byte reservation instead of refusing it"
    )]
    fn a_failed_instance_answers_without_the_global_lock() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let a = GlobalBfc::with_config(HostConfig {
            arena_size: 1 << 61,
            min_arena_size: 1 << 60,
            ..HostConfig::DEFAULT
        });
        let l = Layout::from_size_align(64, 8).unwrap();
        // SAFETY: a non-zero layout (the initialisation fails: nothing to free).
        assert!(unsafe { a.alloc(l) }.is_null());
        // With the heap list's lock held (as a `fork` or another instance's first use holds it),
        // calls on the failed instance still return.
        let held = heaps().lock.lock();
        let done = AtomicBool::new(false);
        let answered = std::thread::scope(|s| {
            s.spawn(|| {
                // SAFETY: as above.
                assert!(unsafe { a.alloc(l) }.is_null());
                let big = Layout::from_size_align(1 << 20, 8).unwrap();
                // SAFETY: as above.
                assert!(unsafe { a.alloc(big) }.is_null());
                assert_eq!(a.stats(), Stats::default());
                done.store(true, Ordering::SeqCst);
            });
            let start = std::time::Instant::now();
            while !done.load(Ordering::SeqCst) && start.elapsed().as_secs() < 10 {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            let answered = done.load(Ordering::SeqCst);
            drop(held);
            answered
        });
        assert!(
            answered,
            "a failed instance waited for the heap list's lock"
        );
    }

    #[test]
    #[cfg_attr(miri, ignore = "spawns a child process")]
    fn fork_handlers_run_twice_hold_the_locks_until_the_last_call() {
        // A child forked while `pthread_once` ran the registration registers the handlers again,
        // and libc then runs each twice per fork (prepare handlers in reverse order, the others in
        // order); a fork nested in this thread's fork (from another library's prepare handler)
        // runs them twice too. A second prepare step must not re-take the locks (it would abort:
        // re-entered lock), and the locks must stay held until the last parent or child call.
        // Runs in a child process.
        use std::sync::atomic::{AtomicBool, Ordering};
        let case = "fork_handlers_run_twice_hold_the_locks_until_the_last_call";
        if is_child(case) {
            let a = small_instance();
            let l = Layout::from_size_align(100_000, 8).unwrap();
            // SAFETY: a non-zero layout; the block is freed with it.
            unsafe { a.dealloc(a.alloc(l), l) };
            for child in [false, true] {
                let end = if child { on_fork_child } else { on_fork_parent };
                on_fork_prepare();
                on_fork_prepare();
                end();
                // One call is still unmatched: another thread must not get into the heap.
                let entered = AtomicBool::new(false);
                let entered_early = std::thread::scope(|s| {
                    s.spawn(|| {
                        a.stats();
                        entered.store(true, Ordering::SeqCst);
                    });
                    std::thread::sleep(std::time::Duration::from_millis(100));
                    let early = entered.load(Ordering::SeqCst);
                    end();
                    early
                });
                assert!(
                    !entered_early,
                    "locks released before the last call (child: {child})"
                );
                assert!(entered.load(Ordering::SeqCst));
                // SAFETY: as above.
                let p = unsafe { a.alloc(l) };
                assert!(!p.is_null());
                // SAFETY: `p` came from `a.alloc(l)`.
                unsafe { a.dealloc(p, l) };
                a.check().unwrap();
            }
            std::println!("child done");
            return;
        }
        let (status, stdout, stderr) = run_child(case);
        assert!(status.success(), "{status:?}: {stderr}");
        assert!(stdout.contains("child done"), "{stdout}");
    }

    // ---- Tests written to kill surviving mutants (a mutation-testing pass over the host heap) ----

    /// A free that leaves a merged chunk of exactly `release_threshold` bytes is subject to the
    /// give-back policy: it raises the retained amount and counts as dirty.
    #[test]
    fn a_free_of_exactly_the_threshold_counts_toward_the_policy() {
        let a = big_instance();
        let mb = 1 << 20;
        let l = Layout::from_size_align(mb, 4096).unwrap();
        let guard = Layout::from_size_align(64 << 10, 4096).unwrap();
        // SAFETY: non-zero sizes.
        let (g0, x, g1) = unsafe { (a.alloc(guard), a.alloc(l), a.alloc(guard)) };
        assert_eq!(x as usize, g0 as usize + (64 << 10));
        assert_eq!(g1 as usize, x as usize + mb);
        assert_eq!(a.usable_size(x), Some(mb));
        let (retain, dirty) = a.with_heap(|h| (h.retain, h.dirty)).unwrap();
        // SAFETY: from `a.alloc`, freed once.
        unsafe { a.dealloc(x, l) };
        assert_eq!(
            a.with_heap(|h| (h.retain, h.dirty)).unwrap(),
            (retain.max(2 * mb), dirty + mb)
        );
        // SAFETY: from `a.alloc`, freed once.
        unsafe {
            a.dealloc(g0, guard);
            a.dealloc(g1, guard);
        }
        assert_eq!(a.check(), Ok(()));
    }

    /// The free top is trimmed only once at least twice the retained amount is touched above its
    /// start (hysteresis), and then down to the retained amount.
    #[test]
    fn the_free_top_is_trimmed_with_hysteresis() {
        let a = big_instance();
        let kb = 1 << 10;
        let l = Layout::from_size_align(512 * kb, 4096).unwrap();
        // SAFETY: a non-zero size.
        let b: std::vec::Vec<*mut u8> = (0..5).map(|_| unsafe { a.alloc(l) }).collect();
        for i in 1..5 {
            assert_eq!(b[i] as usize, b[i - 1] as usize + 512 * kb);
        }
        let top = b[4] as usize + 512 * kb;
        assert_eq!(brk(&a), top);
        assert_eq!(a.with_heap(|h| h.retain).unwrap(), 1 << 20);
        // SAFETY: from `a.alloc(l)`, each freed once.
        unsafe {
            a.dealloc(b[4], l);
            a.dealloc(b[3], l);
            // 1.5 MiB touched above the free top's start: more than the retained 1 MiB, less than
            // twice it: kept.
            a.dealloc(b[2], l);
        }
        assert_eq!(brk(&a), top, "trimmed without hysteresis");
        // SAFETY: as above.
        unsafe { a.dealloc(b[1], l) };
        // 2 MiB touched: trimmed to the retained 1 MiB.
        assert_eq!(brk(&a), b[1] as usize + (1 << 20));
        // SAFETY: as above.
        unsafe { a.dealloc(b[0], l) };
        assert_eq!(a.check(), Ok(()));
    }

    /// With much memory in use, interior frees do not start a sweep after 16 thresholds: the
    /// interval grows with the bytes in use. (The factor, four, is not pinned here: reaching it
    /// with interior frees needs more freed than kept.)
    #[test]
    fn sweeps_wait_longer_when_much_memory_is_in_use() {
        let a = big_instance();
        let mb = 1 << 20;
        let l = Layout::from_size_align(mb, 4096).unwrap();
        // SAFETY: a non-zero size.
        let ps: std::vec::Vec<*mut u8> = (0..48).map(|_| unsafe { a.alloc(l) }).collect();
        assert!(ps.iter().all(|p| !p.is_null()));
        for i in (0..40).step_by(2) {
            // SAFETY: from `a.alloc(l)`, freed once.
            unsafe { a.dealloc(ps[i], l) };
        }
        // 20 MiB freed (past 16 thresholds) with 28 MiB or more in use: no sweep yet.
        assert_eq!(a.with_heap(|h| h.dirty).unwrap(), 20 * mb);
        for i in (1..40).step_by(2).chain(40..48) {
            // SAFETY: as above.
            unsafe { a.dealloc(ps[i], l) };
        }
        assert_eq!(a.check(), Ok(()));
    }

    /// A huge interior block whose pages went back at once is not counted as dirty.
    #[test]
    #[cfg_attr(miri, ignore = "a 64 MiB block in a 512 MiB arena")]
    fn a_huge_interior_block_given_back_at_once_is_not_dirty() {
        let a = big_instance();
        let huge = Layout::from_size_align(MAX_RETAIN + 100, 8).unwrap();
        let (p, _, n) = block_beside_a_neighbour(&a, huge);
        let dirty = a.with_heap(|h| h.dirty).unwrap();
        // SAFETY: `p` came from `a.alloc(huge)`.
        unsafe { a.dealloc(p, huge) };
        assert_eq!(a.with_heap(|h| h.dirty).unwrap(), dirty);
        // SAFETY: `n` came from `a.alloc`.
        unsafe { a.dealloc(n, neighbour()) };
        assert_eq!(a.check(), Ok(()));
    }

    /// The checker sees a block twice on the calling thread's cache.
    #[test]
    fn the_checker_sees_a_thread_cache_holding_a_block_twice() {
        std::thread::spawn(|| {
            let a = small_instance();
            let l = Layout::from_size_align(64, 8).unwrap();
            // SAFETY: a valid layout; the blocks are freed once with it.
            let (p, q) = unsafe { (a.alloc(l), a.alloc(l)) };
            assert!(!p.is_null() && !q.is_null());
            // SAFETY: as above.
            unsafe { a.dealloc(q, l) };
            a.flush_thread_cache();
            a.check().unwrap();
            let c = small::class_for(64, 8).unwrap();
            tcache::with(|tc| {
                tc.fill(c, p as usize);
                tc.fill(c, p as usize);
            })
            .unwrap();
            assert_eq!(
                a.check().unwrap_err().what,
                "thread cache stack overfull or holding a block twice"
            );
            tcache::with(|tc| {
                tc.pop(c);
                tc.pop(c);
            })
            .unwrap();
            a.check().unwrap();
            // SAFETY: as above.
            unsafe { a.dealloc(p, l) };
        })
        .join()
        .unwrap();
    }

    /// `brk` (the end of touched memory, above which `alloc_zeroed` trusts pages to read as zero)
    /// stays where it is when the kernel refuses to discard the free top's pages.
    #[test]
    #[cfg(any(target_os = "linux", target_os = "android"))]
    #[cfg_attr(miri, ignore = "Miri has no mlock")]
    fn a_refused_discard_of_the_free_top_keeps_brk() {
        let a = small_instance();
        let size = 256 << 10;
        let l = Layout::from_size_align(size, 4096).unwrap();
        // SAFETY: a non-zero size.
        let p = unsafe { a.alloc(l) };
        assert!(!p.is_null());
        // SAFETY: `p` holds `size` bytes; it came from `a.alloc(l)`, freed once.
        unsafe {
            p.write_bytes(0xa5, size);
            a.dealloc(p, l);
        }
        // Below the retained amount: the free top keeps its pages.
        let before = brk(&a);
        assert!(before >= p as usize + size);
        let page = os::page_size();
        // A locked page makes MADV_DONTNEED refuse the whole range.
        // SAFETY: `p..p + page` is mapped, committed memory of the arena.
        if unsafe { libc::mlock(p.cast(), page) } != 0 {
            std::eprintln!(
                "skipped: mlock of one page failed ({}); RLIMIT_MEMLOCK too low?",
                std::io::Error::last_os_error()
            );
            return;
        }
        let released = a.release_free_memory();
        let after = brk(&a);
        // SAFETY: as above.
        assert_eq!(unsafe { libc::munlock(p.cast(), page) }, 0, "munlock");
        assert_eq!(
            after, before,
            "brk moved down over pages that were not discarded"
        );
        assert!(
            released < size,
            "pages the kernel kept counted as released: {released}"
        );
        // SAFETY: a non-zero size.
        let z = unsafe { a.alloc_zeroed(l) };
        assert_eq!(z, p);
        // SAFETY: `z` holds `size` bytes.
        let zeroed = unsafe { filled_with(z, size, 0) };
        assert!(zeroed, "alloc_zeroed returned stale bytes");
        // SAFETY: from `a.alloc_zeroed(l)`.
        unsafe { a.dealloc(z, l) };
        assert_eq!(a.check(), Ok(()));
    }

    /// A small block resized within its size class stays where it is, with or without a thread
    /// cache (without one, the step under the lock decides).
    #[test]
    fn a_small_realloc_within_its_class_stays_in_place() {
        for thread_cache in [true, false] {
            let a = GlobalBfc::with_config(HostConfig {
                arena_size: 64 << 20,
                min_arena_size: 64 << 20,
                chunk_capacity: 1 << 12,
                thread_cache,
                ..HostConfig::DEFAULT
            });
            small_realloc_stays_in_place(&a);
        }
    }

    fn small_realloc_stays_in_place(a: &GlobalBfc) {
        let l = Layout::from_size_align(40, 8).unwrap();
        let c = small::class_for(40, 8).unwrap();
        let new_size = small::class_size(c);
        assert!(new_size > 40);
        // SAFETY: a non-zero size.
        let p = unsafe { a.alloc(l) };
        assert!(!p.is_null());
        // SAFETY: `p` came from `a.alloc(l)`.
        let q = unsafe { a.realloc(p, l, new_size) };
        assert_eq!(q, p);
        // SAFETY: `q` is live with this layout.
        unsafe { a.dealloc(q, Layout::from_size_align(new_size, 8).unwrap()) };
        assert_eq!(a.check(), Ok(()));
    }
}
