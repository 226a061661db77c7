//! The host allocator: the BFC engine behind a spinlock over one reserved `mmap` arena.
//!
//! On first use [`GlobalBfc`] reserves [`HostConfig::arena_size`] bytes of address space, plus a
//! separate reservation for metadata: the pointer map (4 bytes per 4 KiB of arena), the chunk table
//! ([`HostConfig::chunk_capacity`] records of 32 bytes, at most one per 256 arena bytes), and the
//! slab layer's span table and span sets (under 1% of the arena). If the kernel refuses either,
//! both are tried again with half the arena, down to [`HostConfig::min_arena_size`]; below that, a
//! warning goes to standard error and every allocation fails. Under an address-space limit
//! (`RLIMIT_AS`, `ulimit -v`) the two reservations take at most half of the address space still
//! free, so the rest of the process (thread stacks, libraries) keeps room (but for
//! [`HostConfig::min_arena_size`], which is tried in any case); the arena does not grow later.
//!
//! Reserved memory is inaccessible (`PROT_NONE`) until the heap reaches it (the medium table is
//! read-only instead): the arena is committed (made readable and writable) from its start in 2 MiB
//! steps as blocks are handed out higher up, and the pointer map, span table, medium table and
//! chunk table in step with what they describe (the metadata
//! sized by the arena alone, about 5.7 MiB with those tables' first steps for a 64 GiB arena, is
//! committed at initialisation). So strict overcommit (`vm.overcommit_memory = 2`) charges, and
//! `RLIMIT_DATA` counts, the memory the heap has reached, not the 64 GiB it reserved; when the
//! kernel refuses a commit, the allocation returns null. When the free top of the arena goes back
//! to the kernel (below), the arena's committed end follows it down to the next 2 MiB step, and
//! neither counts that memory any more; the metadata stays committed. Elsewhere committed memory
//! stays committed (freed blocks are reused) while its pages go back as described below. Only
//! pages that are touched become resident.
//! Initialisation allocates nothing.
//!
//! The whole arena is the engine's single region, so any two neighbouring free blocks coalesce.
//!
//! Requests of at most 16 KiB (alignment at most 4 KiB) are served by a slab layer on top of the
//! engine (see `small.rs`): 64 KiB spans taken from the engine, objects tracked by out-of-band
//! bitmaps, so a small allocation or free is a bit operation and a double free is still detected.
//! A request aligned to more than 16 bytes takes the smallest class whose size is a multiple of its
//! alignment (a cache-line-aligned 64-byte value takes the 64-byte class, a page-aligned one the
//! 4 KiB class), so it gets the same thread caches and speed. Each class takes
//! the lowest free object of its lowest span with room, so a class's touched memory follows its peak
//! live bytes, and its spans above that drain and go back to the engine for any size to reuse.
//! Everything larger goes to the engine, with its best fit and coalescing; new blocks of 64 KiB or
//! more start at a 64 KiB boundary where the arena has room for the padding, so the first pages of a
//! new large block are likely already touched. With `std`, requests above 16 KiB and up to 64 KiB
//! (alignment at most 4 KiB) are *medium*: rounded up to one of eight classes (20 to 64 KiB,
//! four per power of two) so that thread caches can keep freed ones for reuse, and start on a
//! 32 KiB grid, for the same reason as large blocks (see `medium.rs`). In a thread whose medium or
//! larger requests find the heap lock held, those up to 1 MiB (the *upper* classes, 80 KiB to 1 MiB)
//! are rounded and cached the same way, so threads that use such blocks at once stop waiting for
//! each other.
//!
//! # Thread caches (`std`)
//!
//! In front of the slab layer each thread keeps bounded per-class stacks of free small blocks, so most
//! small allocations and frees take no lock (see `tcache.rs` for the protocol), and stacks of freed
//! medium blocks, so a medium block freed and taken again by its thread skips the lock and the
//! engine:
//! - at most [`MAX_CACHED_BYTES`] (10,927 KiB) per thread: 1,199 KiB of small blocks, where a
//!   refill or an overflow moves half a stack, and 8 blocks of each medium class, 768 KiB of them in
//!   all (16 and 1,536 KiB in a thread whose medium or larger requests meet contention on the heap
//!   lock), where a miss takes one block from the engine and an overflow gives half the class's
//!   stack back to it (with a heap-wide medium transfer cache of at most 4 MiB between them, which
//!   the overflows of threads that meet contention fill and any thread's misses take from: see
//!   `medium::Transfer`); and, only in a thread that meets that contention, 8 blocks of each upper
//!   class (80 KiB to 1 MiB), [`HostConfig::upper_cache_bytes`] (by default
//!   8 MiB) of them in all (see `medium.rs`);
//! - a block freed on another thread joins that thread's cache; a full cache gives half a stack to
//!   a per-class transfer cache in the heap, from which the refills of that class take their batches
//!   before the slab layer (at most two stacks per class, about 2.3 MiB in all);
//! - every 256 refills and flushes (medium misses and overflows count too) of a thread's cache,
//!   each class that had none of them gives half its blocks back to the slab layer or the engine,
//!   so a class the thread stopped using drains;
//! - a thread's cache is flushed when the thread exits, on demand by
//!   [`GlobalBfc::flush_thread_cache`] (and [`GlobalBfc::release_free_memory`]), and before an
//!   allocation on that thread fails for want of room (with the transfer cache);
//! - blocks going back to the slab layer or the engine are checked there, and a block freed twice in
//!   a row on one thread is caught at the second free unless a flush or decay of its class came
//!   between (other double frees when the block reaches the slab layer or the engine); a medium
//!   block joins a stack only if the heap's medium table names it as a live block of the class its
//!   layout says;
//! - [`GlobalBfc::stats`] counts cached blocks as cached, not in use;
//! - a thread's cache serves the first instance that uses it; other instances take the lock there.
//!
//! A small block is always freed with a layout of its own size class: `realloc` keeps a small block in
//! place only within its class, and moves a large block that shrinks to a small size. So a shrink
//! that moves can fail (null) when memory runs out, as any allocation can.
//!
//! # Giving memory back
//!
//! With `T` = [`HostConfig::release_threshold`], pages go back to the kernel
//! (`madvise(MADV_DONTNEED)`) as follows. `R`, the retained amount, starts at `T` and grows to four
//! times the largest block freed so far whose free chunk (after coalescing) is at least `T` (up to
//! 64 MiB; blocks of 64 MiB or more do not count), like glibc's dynamic thresholds.
//! - The free top of the arena (when at least `T` bytes) keeps `R` bytes of touched memory and
//!   returns the rest once at least `2R` of it were touched; after a free of 64 MiB or more it keeps
//!   only `T`.
//! - A single freed block of 64 MiB or more (and at least `16T`) returns its pages at once.
//! - Elsewhere, blocks freed into free chunks of at least `T` bytes are counted. Once the count
//!   reaches eight times the bytes in use (and at least `16T` and `2R`), a sweep runs. It returns the
//!   pages of the free chunks that were already free and unchanged at the previous sweep, and marks
//!   the others.
//!   So memory a program frees and allocates again in cycles keeps its pages, and a free chunk that
//!   stays unchanged goes back within two sweeps (a decay counted in freed bytes, not time). A
//!   chunk that changes between every two sweeps (its head taken and freed back, or a block freed
//!   beside it) never ages; every sweep returns its pages past its first 128 MiB.
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
//! page). Below it, that part is written with zeros, unless it is at least 64 MiB and `T`, or it
//! is at least 1 MiB and most of its pages are not resident (`mincore`; memory a sweep returned,
//! say): then its whole pages are zeroed by returning them, and only its partial pages are
//! written. A small block of at most a page (4 KiB) comes from the thread cache and is written
//! whole; a larger small block (to 16 KiB) too if the cache holds one, and otherwise it is taken
//! under the lock and written only where it may hold old data: not at all if it was never handed
//! out since its span was made over untouched memory, and not on its pages that went back since.
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
//! with a message naming the problem, with one exception: a thread cache checks a small free only
//! against its layout's class (the pointer in the arena, on an object start of that class, not the
//! block on top of the cache), so a double free, a wrong small layout, or a pointer inside a larger
//! block that passes those checks is cached, may be handed out again, and is caught (the process
//! aborts) only when the block leaves the cache. Debug builds also check, on every free, that the
//! pointer's span is of the layout's class. See the README's "Checks".
//!
//! # `fork`
//!
//! A `pthread_atfork` handler (installed when the program is loaded on Linux, elsewhere before the
//! first heap's initialisation takes any lock)
//! takes every heap's lock before a `fork` and releases it in both processes afterwards, so the
//! child can allocate even when another thread was inside the allocator at the moment of the fork.
//! Threads that fork at the same time take turns: each fork holds the locks from its prepare step to
//! its own parent or child step. In the child the other threads' cached blocks are lost (their
//! threads do not exist there, and a cache may have been mid-update: it cannot be flushed), and
//! [`GlobalBfc::stats`] goes on counting them in use; the first use rebuilds the cache registry. First-use
//! initialisation runs under the global heap-list lock, which the handler also takes, so a `fork`
//! never interrupts an initialisation either.
//!
//! # Files
//!
//! This file holds the heap (its allocation paths and give-back policy) and the `GlobalAlloc` and
//! `Allocator` glue. `arena.rs` is the engine's memory source over the arena and lays out the
//! metadata reservation; `small.rs` the slab layer; `tcache.rs` the thread caches; `fork.rs` the
//! process-wide locks and the `fork` handlers; `os.rs` every call to the operating system.

mod arena;
mod fork;
#[cfg(feature = "std")]
mod medium;
mod os;
mod small;
#[cfg(feature = "std")]
mod tcache;

use core::alloc::{GlobalAlloc, Layout};
use core::ptr::{self, addr_of_mut, NonNull};

use crate::core::{
    AllocError, Allocated, Bfc, CheckError, Chunk, Config, FreeError, Freed, OomCause, Resize,
    Stats,
};
use crate::lock::SpinLock;
use arena::{
    HostSource, MetaLayout, ARENA_ALIGN, ARENA_BYTES_PER_RECORD, MIN_RECORDS, RECORD_SLACK,
};
use fork::*;
#[cfg(loom)]
#[doc(hidden)]
pub use fork::{
    loom_check_forks, loom_fork_handler_parent, loom_fork_handler_prepare, loom_fork_prepare,
    loom_fork_release, LOOM_IGNORE_FORK_DEPTH, LOOM_SHARED_FORK_FLAG, LOOM_SHORT_INIT_LIST_LOCK,
};
#[cfg(all(feature = "std", loom))]
#[doc(hidden)]
pub use fork::{
    LOOM_BREAK_FORK_ORDER, LOOM_SKIP_DROP_BINDINGS, LOOM_SKIP_REBIND_BINDINGS,
    LOOM_TRY_FORK_BINDINGS,
};
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
    /// at most one record per 256 bytes of the arena reserved. Each block the engine holds (a large
    /// block, or a span of small blocks) and each free chunk between them takes a record, and a
    /// block aligned past the granule can take one more for the padding before it. When the table
    /// is full, an allocation that needs a new record fails (returns null) though the arena may
    /// have room.
    pub chunk_capacity: usize,
    /// Free chunks at least this large give their pages back to the kernel (default 1 MiB; the
    /// `T` of the module docs' "Giving memory back"). Any value is accepted (only whole pages go
    /// back, whatever it is); `usize::MAX` turns the automatic give-back off (pages go back only
    /// through [`GlobalBfc::release_free_memory`]).
    pub release_threshold: usize,
    /// Allocation granule in bytes (default 16).
    pub granule: usize,
    /// Per-thread caches of small blocks (`std` builds; default on). See the module docs.
    pub thread_cache: bool,
    /// Most bytes of upper-class blocks (above 64 KiB, at most 1 MiB) one thread's cache holds,
    /// once the thread's requests of such sizes have found the heap lock held (`std` builds with
    /// thread caches; by default and at most 8 MiB, the amount `MAX_CACHED_BYTES` counts). A
    /// request whose class is larger than this is not rounded or cached; below the smallest upper
    /// class, 80 KiB (0, say), the upper classes are off: those requests always take a block of
    /// their own size under the lock. See `medium.rs` (upper classes).
    pub upper_cache_bytes: usize,
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
        upper_cache_bytes: 8 << 20,
    };

    /// Checks the parameters. [`GlobalBfc::with_config`] calls it, so a bad configuration in a
    /// `static` fails to compile, with the message below.
    ///
    /// # Panics
    ///
    /// (At compile time in a `const` context.) If:
    /// - `arena_size < min_arena_size`;
    /// - `min_arena_size` is below 2 MiB;
    /// - `chunk_capacity` is below 16 or not below `u32::MAX`;
    /// - `granule` is not a power of two from 8 to 4096;
    /// - `upper_cache_bytes` is above 8 MiB.
    ///
    /// The message names the field and the range it must be in.
    pub const fn validate(&self) {
        assert!(
            self.arena_size >= self.min_arena_size,
            "HostConfig: arena_size must be at least min_arena_size (raise arena_size or lower \
             min_arena_size)"
        );
        assert!(
            self.min_arena_size >= 1 << 21,
            "HostConfig: min_arena_size must be at least 2 MiB (2 << 20)"
        );
        assert!(
            self.chunk_capacity >= 16,
            "HostConfig: chunk_capacity must be at least 16 (records)"
        );
        assert!(
            self.chunk_capacity < u32::MAX as usize,
            "HostConfig: chunk_capacity must be below u32::MAX (it must fit in u32)"
        );
        assert!(
            self.granule.is_power_of_two() && self.granule >= 8 && self.granule <= 4096,
            "HostConfig: granule must be a power of two from 8 to 4096 bytes"
        );
        assert!(
            self.upper_cache_bytes <= 8 << 20,
            "HostConfig: upper_cache_bytes must be at most 8 MiB (8 << 20)"
        );
    }
}

impl Default for HostConfig {
    fn default() -> Self {
        HostConfig::DEFAULT
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
    /// and grows to [`RETAIN_BLOCKS`] times the largest block freed, up to [`MAX_RETAIN`].
    retain: usize,
    release_threshold: usize,
    /// Process-unique id (thread caches bound to this heap hold it).
    #[cfg(feature = "std")]
    id: usize,
    /// Head of the registry of thread caches bound to this heap (a `ThreadCache` address, 0 for
    /// none); linked through the caches' `prev`/`next`.
    #[cfg(feature = "std")]
    caches: usize,
    /// Caches in the registry: a walk that meets more has found the list corrupted.
    #[cfg(feature = "std")]
    registered: usize,
    /// Fork generation the registry belongs to.
    #[cfg(feature = "std")]
    fork_gen: usize,
    /// Blocks thread caches gave back when full, for the next refill (see `tcache::Transfer`).
    #[cfg(feature = "std")]
    transfer: tcache::Transfer,
    /// Which medium blocks thread caches may take (see `medium.rs`).
    #[cfg(feature = "std")]
    medium: medium::Table,
    /// Medium blocks thread caches gave back when full, for the next miss of their class (see
    /// `medium::Transfer`).
    #[cfg(feature = "std")]
    medium_transfer: medium::Transfer,
    /// Whether the lock's current holder found it held by another thread when it asked for it
    /// (upper-class requests read it: see `medium.rs`).
    #[cfg(feature = "std")]
    contended: bool,
    /// End of the arena.
    arena_end: usize,
    /// Every byte ever handed out lies below this address (the arena above it was never touched, or
    /// its pages were returned).
    brk: usize,
    page: usize,
    /// Why the engine last refused a block (read when an allocation returns null).
    cause: FailureCause,
    /// The latest allocation that returned null.
    last_failure: Option<AllocFailure>,
}

/// An allocation that returned null: what the heap looked for, and why it failed
/// ([`GlobalBfc::last_failure`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllocFailure {
    /// Bytes asked for (for a `realloc`, the new size).
    pub size: usize,
    /// Alignment asked for.
    pub align: usize,
    /// Why no block was found.
    pub cause: FailureCause,
}

/// Why a host allocation failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureCause {
    /// No free part of the arena fits the block: the arena is full, or its free memory is in
    /// pieces too small. The arena does not grow ([`HostConfig::arena_size`]).
    ArenaFull,
    /// The chunk table is full ([`HostConfig::chunk_capacity`]), though the arena may have room.
    ChunkTableFull,
    /// The kernel refused to commit memory for the block or its records (a commit limit: strict
    /// overcommit, `RLIMIT_DATA`, `RLIMIT_AS`).
    CommitRefused,
    /// The request can never fit: no address of the arena at its alignment leaves room for it
    /// (larger than the arena, or aligned beyond what the heap serves or the arena's place
    /// allows).
    NeverFits,
}

impl FailureCause {
    /// What the cause means, and what can be changed.
    fn explain(self) -> &'static str {
        match self {
            FailureCause::ArenaFull => {
                "no free part of the arena fits it; free blocks or reserve a larger arena_size"
            }
            FailureCause::ChunkTableFull => {
                "the chunk table is full; give it more records (chunk_capacity)"
            }
            FailureCause::CommitRefused => {
                "the kernel refused to commit memory (a commit limit: strict overcommit, \
                 RLIMIT_DATA or RLIMIT_AS)"
            }
            FailureCause::NeverFits => {
                "no address of the arena at its alignment has room for it (larger than the \
                 arena, or aligned beyond what its place allows)"
            }
        }
    }
}

impl core::fmt::Display for AllocFailure {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(
            f,
            "allocation of {} B aligned to {} failed ({:?}: {})",
            self.size,
            self.align,
            self.cause,
            self.cause.explain()
        )
    }
}

/// Keeps its value on cache lines of its own (the pair the CPU prefetches together).
#[repr(align(128))]
struct CacheLine<T>(T);

/// Source of heap ids (never reused, unlike addresses).
#[cfg(feature = "std")]
static NEXT_ID: core::sync::atomic::AtomicUsize =
    core::sync::atomic::AtomicUsize::new(tcache::DEAD + 1);

/// Arena bytes per pointer-map entry (the engine's `map_block_granules` times the granule, which is
/// at most 4 KiB). The engine's default, 32 granules (512 bytes), suits chunks of a few granules.
/// Here every engine block but an over-aligned one is larger than 16 KiB (the slab layer serves the
/// rest), so a 4 KiB map block holds at most three chunk starts for a lookup to walk. With the
/// default 16-byte granule the map is an eighth of the size (with a granule above 128 bytes it is
/// larger than 32 granules per entry would make it, and at most 0.1% of the arena). The map is
/// touched at random (every split, merge and free of a large block): on bench-peers `large` (64
/// blocks of 64 KiB to 16 MiB) the smaller map took the step from 377 to 295 ns and peak RSS from
/// 24.0 to 21.5 MiB (medians of 7 interleaved runs, 2026-11-25), with `largew`, `json`, `vec` and
/// `churn` level or slightly better.
const MAP_BLOCK: usize = 4096;

/// `alloc_zeroed` of a small object takes it from the thread cache and writes it whole up to this
/// size (one page). A larger object (more than one page) is taken from the thread cache only if
/// the cache holds one (written whole: it was handed out before), and otherwise under the lock,
/// without a refill, where the slab layer knows which of its pages are still zero, and only the
/// rest is written. Before, objects
/// of 5..16 KiB from new spans were written whole: 1,000 zeroed 16 KiB buffers made 4,000 pages
/// resident that the caller never touched.
#[cfg(feature = "std")]
const ZERO_FROM_CACHE_MAX: usize = 4096;

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
const SWEEP_AFTER_IN_USE: usize = 8;

/// The retained amount grows to this many times the largest block freed (up to [`MAX_RETAIN`]).
/// The free top of a heap that churns large blocks moves up and down by several of them: with
/// twice the largest block, bench-peers `largew` (64 live blocks of 64 KiB..16 MiB, every page
/// written) trimmed the top 12 times, about 600 MiB in all, and faulted it back in: 165,000 page
/// faults and 32 us per step, against talc's 95,000 and 17 us (talc gives nothing back). Four times:
/// 103,000 faults, 19 us, the same peak RSS (355 MiB; talc 384). `large`, `vec`, `json` and `churn`
/// kept their peaks within 2 MiB.
const RETAIN_BLOCKS: usize = 4;

/// Most touched free memory the give-back policy retains for reuse; a single freed block at least
/// this large returns its pages at once.
const MAX_RETAIN: usize = 64 << 20;

/// `alloc_zeroed` zeroes the part of a block that may hold old data by writing it below this
/// size (or `release_threshold`, if larger), and by giving its whole pages back (`madvise`, so
/// they fault in as zero pages) from it on.
/// Giving a resident page back and faulting it in again costs several times more than writing it:
/// bench-peers `zerol` (`vec![0u8; n]`, n 1..16 MiB, 8 live, a byte written per page) took 440 ns
/// per KiB with 1.37 million faults when blocks from 1 MiB were given back, 45 ns and 29,000
/// faults when written (glibc 129 ns). Blocks this large are given back when freed (see
/// [`MAX_RETAIN`]), so little of them is old data.
const ZERO_BY_DISCARD: usize = MAX_RETAIN;

/// Below [`ZERO_BY_DISCARD`], `alloc_zeroed` asks the kernel (`mincore`) whether most of the whole
/// pages of a dirty part this large are resident: if not (a zeroed buffer used sparsely, freed
/// and taken again, or free memory whose pages a sweep gave back), they are given back instead
/// of written, since writing would fault each in (a 32 MiB block from swept memory: 17 ms and
/// 8,192 resident pages, against microseconds and none).
/// bench-peers `zeros` (as `zerol`, a byte written per 64 pages): 52 ns/KiB and 110 MiB peak RSS
/// when written, 10 ns and 5 MiB given back (jemalloc: 7 ns, 5 MiB). Smaller parts are written:
/// from 64 KiB on, the question cost `zero` (4 KiB..1 MiB, dense) 30% of its time.
const ZERO_PROBE_MIN: usize = 1 << 20;

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
    #[inline(always)]
    fn with<R>(&self, f: impl FnOnce(&mut Heap) -> R) -> R {
        let (mut guard, _contended) = self.heap.lock_reporting();
        guard.with(|h| {
            // Dropped (and so aborting) while the lock is still held: nobody sees the heap a
            // panic left half-updated. Not in loom builds: loom reports a failed model (a
            // deadlock, say) by panicking wherever the thread is, and the model's test expects it.
            #[cfg(not(loom))]
            let unwinding = AbortOnUnwind;
            #[cfg(feature = "std")]
            {
                h.after_fork();
                h.contended = _contended;
            }
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
///
/// An instance that is not a `static` (one used through `allocator_api2::alloc::Allocator`, say)
/// gives its whole arena back to the kernel when dropped: no block it handed out may be used after
/// that, and the thread caches bound to it stop serving it.
#[repr(C)]
pub struct GlobalBfc {
    config: HostConfig,
    /// The heap's id once initialised ([`tcache::NO_ID`] before): read by every small allocation
    /// and free, so it shares a cache line with the read-only config and not with the lock.
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
        ///
        /// # Panics
        ///
        /// If `config` is invalid: see [`HostConfig::validate`] (in a `static`, a compile error).
        pub fn with_config(config: HostConfig) -> Self {
            config.validate();
            GlobalBfc {
                config,
                #[cfg(feature = "std")]
                id: core::sync::atomic::AtomicUsize::new(tcache::NO_ID),
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
    /// (for a caller or a thread cache) and a larger one when it leaves the engine, so it misses
    /// blocks handed out from a thread cache or a transfer cache; `peak_bytes_in_use` includes
    /// cached blocks.
    pub fn stats(&self) -> Stats {
        self.with_heap(|h| h.stats()).unwrap_or_default()
    }

    /// Runs the engine's invariant checker and checks the slab layer's counters. On an instance not
    /// used yet, it initialises the heap first (reserving the arena), as every method here does.
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
                // they only stay resident, uncounted: nothing relies on a span's free pages reading
                // as zero.)
                unsafe { os::discard(a, l) }
            });
            h.sweep(1, false) + purged
        })
        .unwrap_or(0)
    }

    /// Returns the calling thread's cached blocks to the heap (if its cache serves this allocator):
    /// small ones to the slab layer, with the blocks in the heap's transfer cache, medium ones to
    /// the engine. Returns how many blocks went back from the thread's cache. Threads flush
    /// automatically when they exit.
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

    /// The latest allocation of this heap that returned null (from any thread, through any of the
    /// `GlobalAlloc` and `Allocator` methods), and why; `None` if none has. A heap whose arena
    /// could not be reserved fails every allocation without noting it here (its
    /// [`arena_size`](Self::arena_size) is 0). Takes the lock; allocates nothing.
    pub fn last_failure(&self) -> Option<AllocFailure> {
        self.with_heap(|h| h.last_failure).flatten()
    }

    /// Size of the reserved arena. Initialises the heap if it was not yet used; 0 if the arena
    /// cannot be reserved.
    pub fn arena_size(&self) -> usize {
        self.with_heap(|h| h.bfc.source().arena_size).unwrap_or(0)
    }

    /// Usable size of the block at `ptr`, or `None` if `ptr` is not the start of a block the
    /// allocator holds for a caller or in a cache.
    ///
    /// A diagnostic: a small, medium or upper-class block freed into a thread cache or the transfer
    /// cache still
    /// counts (it reads as its class size) until the cache gives it back to its span or the engine;
    /// another freed block, and a small block whose span has it free, give `None`.
    pub fn usable_size(&self, ptr: *const u8) -> Option<usize> {
        self.with_heap(|h| h.usable_size(ptr as usize)).flatten()
    }

    /// Runs `f` on the heap, initialising it on first use; `None` if the arena is unavailable.
    #[inline(always)]
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
pub(super) fn loom_state_held() -> &'static crate::sync::UnmodelledAtomicUsize {
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
        // The thread caches' exit key, made before the program may have used up its keys (a thread
        // gets no cache without it).
        #[cfg(feature = "std")]
        if config.thread_cache {
            tcache::make_exit_key();
        }
        let page = os::page_size();
        let engine_config = Config {
            map_block_granules: (MAP_BLOCK / config.granule).max(1),
            ..Config::host(0)
        };
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
                        let medium = m.as_ptr() as usize + meta.medium_at;
                        // The parts sized by the arena alone, committed whole: the span classes
                        // (read by thread caches without the lock), the span sets, the transfer
                        // cache and the anchor. The medium table, which thread caches read
                        // anywhere but the heap writes only where the arena is committed, is
                        // readable throughout and committed in step with the arena.
                        // SAFETY: `classes_at..size` and `medium_at..classes_at` are
                        // page-aligned, inside the fresh reservation, not committed yet.
                        if unsafe {
                            os::make_readable(medium, meta.classes_at - meta.medium_at)
                                && os::commit(fixed, meta.size - meta.classes_at)
                        } {
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
                     allocation from this allocator fails (raise that limit, or lower \
                     HostConfig::min_arena_size)",
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
            table_at,
            spans_at,
            span_entries,
            classes_at,
            sets_at,
            set_words,
            transfer_at,
            medium_at,
            medium_entries,
            anchor_at,
            size: meta_mapping_size,
            ..
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
        // SAFETY: as for the span classes: a zero-filled (no medium block), exclusively owned part
        // of the metadata reservation, alive as long as the heap; `AtomicU16` has `u16`'s layout,
        // the offset is page-aligned, and any bytes are valid entries.
        #[cfg(feature = "std")]
        let medium_table: &'static [core::sync::atomic::AtomicU16] = unsafe {
            core::slice::from_raw_parts(
                meta_mapping
                    .as_ptr()
                    .add(medium_at)
                    .cast::<core::sync::atomic::AtomicU16>(),
                medium_entries,
            )
        };
        #[cfg(not(feature = "std"))]
        let _ = (medium_at, medium_entries);
        let mut source = HostSource::new(
            (arena, arena_size),
            (arena_mapping, arena_mapping_size),
            (meta_mapping, meta_mapping_size),
            &meta,
            page,
            block,
        );
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
            // No quick lists: the slab layer serves every request of up to 16 KiB aligned to at
            // most 4 KiB, so the engine's blocks of 1 KiB or less are aligned to more than 4 KiB, which
            // a quick list never serves (it holds exact, granule-aligned sizes). It would only keep
            // such blocks from coalescing with their free neighbours.
            quick_max_size: 0,
            quick_depth: 0,
            ..engine_config
        };
        // The heap's process-unique id (0 without `std`, which has no thread caches).
        #[cfg(feature = "std")]
        let id = NEXT_ID.fetch_add(1, core::sync::atomic::Ordering::Relaxed);
        // (Only a 32-bit target could initialise this many heaps: an id must never wrap around
        // onto a cache's sentinels or equal the uninitialised `NO_ID`.)
        #[cfg(feature = "std")]
        if id <= tcache::DEAD || id == tcache::NO_ID {
            os::fatal(format_args!(
                "heap ids exhausted ({id}): too many heaps initialised"
            ));
        }
        #[cfg(not(feature = "std"))]
        let id = 0;
        let anchor = meta_mapping
            .as_ptr()
            .wrapping_add(anchor_at)
            .cast::<Anchor>();
        // Built in place: the heap is over 8 KiB, and this may run on a thread with a small
        // stack (whose first allocation this is).
        let write_heap = |heap: *mut Heap| {
            // SAFETY: `heap` is valid for writes and aligned (`write_with`'s contract); the engine
            // is written first, so a failure leaves nothing written.
            unsafe { Bfc::write_new(addr_of_mut!((*heap).bfc), engine_config, source, table)? };
            // SAFETY: as above; each other field is written once.
            unsafe {
                addr_of_mut!((*heap).small)
                    .write(SmallHeap::new(arena, page, spans, classes, sets));
                addr_of_mut!((*heap).peak).write(0);
                addr_of_mut!((*heap).largest).write(0);
                addr_of_mut!((*heap).span_allocs).write(0);
                addr_of_mut!((*heap).dirty).write(0);
                addr_of_mut!((*heap).retain).write(config.release_threshold);
                addr_of_mut!((*heap).release_threshold).write(config.release_threshold);
                #[cfg(feature = "std")]
                {
                    addr_of_mut!((*heap).id).write(id);
                    addr_of_mut!((*heap).caches).write(0);
                    addr_of_mut!((*heap).registered).write(0);
                    addr_of_mut!((*heap).fork_gen).write(fork_generation());
                    addr_of_mut!((*heap).transfer).write(tcache::Transfer::new(transfer));
                    addr_of_mut!((*heap).medium).write(medium::Table::new(arena, medium_table));
                    addr_of_mut!((*heap).medium_transfer).write(medium::Transfer::new());
                    addr_of_mut!((*heap).contended).write(false);
                }
                addr_of_mut!((*heap).arena_end).write(arena + arena_size);
                addr_of_mut!((*heap).brk).write(arena);
                addr_of_mut!((*heap).page).write(page);
                addr_of_mut!((*heap).cause).write(FailureCause::ArenaFull);
                addr_of_mut!((*heap).last_failure).write(None);
            }
            // Every field is written above: this pattern names them all, so a new field fails to
            // compile here until it is written too.
            let _every_field = |h: &Heap| {
                let Heap {
                    bfc: _,
                    small: _,
                    peak: _,
                    largest: _,
                    span_allocs: _,
                    dirty: _,
                    retain: _,
                    release_threshold: _,
                    #[cfg(feature = "std")]
                        id: _,
                    #[cfg(feature = "std")]
                        caches: _,
                    #[cfg(feature = "std")]
                        registered: _,
                    #[cfg(feature = "std")]
                        fork_gen: _,
                    #[cfg(feature = "std")]
                        transfer: _,
                    #[cfg(feature = "std")]
                        medium: _,
                    #[cfg(feature = "std")]
                        medium_transfer: _,
                    #[cfg(feature = "std")]
                        contended: _,
                    arena_end: _,
                    brk: _,
                    page: _,
                    cause: _,
                    last_failure: _,
                } = h;
            };
            Ok::<(), &'static str>(())
        };
        // SAFETY: the anchor area lies inside the fresh metadata reservation, page-aligned (so
        // aligned for `Anchor`), large enough, and used by nothing else; it stays mapped until
        // `drop`. `write_heap` initialises the heap when it returns `Ok`, and writes nothing when
        // it fails.
        let built =
            unsafe { SpinLock::write_with(addr_of_mut!((*anchor).heap), reentered, write_heap) };
        if built.is_err() {
            // (Unreachable with a validated `HostConfig`, but nothing is kept reserved.)
            // SAFETY: both reservations were just made; nothing in them is used (the engine that
            // would have used them was not built).
            unsafe {
                os::unreserve(arena_mapping, arena_mapping_size);
                os::unreserve(meta_mapping, meta_mapping_size);
            }
            return None;
        }
        // SAFETY: as above; the heap is written, and so is every other field of the anchor here.
        unsafe {
            addr_of_mut!((*anchor).next).write(core::sync::atomic::AtomicUsize::new(0));
            #[cfg(loom)]
            addr_of_mut!((*anchor).dropped).write(crate::sync::UnmodelledAtomicBool::new(false));
        }
        // Every field is written above (see the heap's).
        let _every_field = |a: &Anchor| {
            let Anchor {
                heap: _,
                next: _,
                #[cfg(loom)]
                    dropped: _,
            } = a;
        };
        NonNull::new(anchor).map(|a| (a, id))
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
                    None => return self.failed(size, align),
                },
            };
            self.note_peak(small::class_size(c));
            return p as *mut u8;
        }
        #[cfg(feature = "std")]
        if let Some(m) = medium::class_for(size, align) {
            return self.allocate_medium(m, size, align);
        }
        match self.allocate_engine(size, align, Self::grid(size, align), (size, align)) {
            Some(b) => b.ptr as *mut u8,
            None => ptr::null_mut(),
        }
    }

    /// A medium block of class `m` for a request of `size` bytes at `align`: an engine block of
    /// the class size on the [`medium::MEDIUM_GRID`] where the arena has room for the padding (else
    /// at [`medium::MEDIUM_ALIGN`]), noted in the medium table when it has exactly
    /// that size (a thread cache may then keep it when it is freed).
    #[cfg(feature = "std")]
    #[inline]
    fn allocate_medium(&mut self, m: usize, size: usize, align: usize) -> *mut u8 {
        let Some(b) =
            // On the medium grid; the 64 KiB class on the 64 KiB grid, as every larger block.
            self.allocate_engine(
                medium::class_size(m),
                medium::MEDIUM_ALIGN,
                Self::grid(medium::class_size(m), medium::MEDIUM_GRID),
                (size, align),
            )
        else {
            return ptr::null_mut();
        };
        if b.size == medium::class_size(m) {
            self.medium.set(m, b.ptr);
        }
        b.ptr as *mut u8
    }

    /// The grid a new engine block of `size` bytes starts on where the arena has room for the
    /// padding: 64 KiB for blocks of 64 KiB or more (module docs), else `grid` (the block's
    /// alignment, or the medium grid for a medium block).
    #[inline]
    fn grid(size: usize, grid: usize) -> usize {
        if size >= LARGE_ALIGN {
            grid.max(LARGE_ALIGN)
        } else {
            grid
        }
    }

    /// An engine block of `size` bytes at `align`, on the grid `grid` where the arena has room for
    /// the padding, noted as handed out; `None` (noted as a failure of `request`, the caller's size
    /// and alignment) when none is found.
    #[inline(always)]
    fn allocate_engine(
        &mut self,
        size: usize,
        align: usize,
        grid: usize,
        request: (usize, usize),
    ) -> Option<Allocated> {
        let mut found = self.large_block(size, grid, align);
        if found.is_none() {
            found = self.large_block_after_reclaim(size, grid, align);
        }
        match found {
            Some(b) => {
                // All of the block: its caller may write up to `usable_size`.
                self.note_allocated(b.ptr, b.size);
                self.note_peak(b.size);
                Some(b)
            }
            None => {
                self.failed(request.0, request.1);
                None
            }
        }
    }

    /// [`Heap::large_block`] again after [`Heap::reclaim`] has given memory back, for a request
    /// the first try found no room for. Out of line, as the rare path it is (the hot one inlines
    /// `large_block`).
    #[cold]
    #[inline(never)]
    fn large_block_after_reclaim(
        &mut self,
        size: usize,
        grid: usize,
        align: usize,
    ) -> Option<Allocated> {
        // A request that no aligned address of the arena has room for (larger than the arena, or
        // aligned beyond what the engine serves or what the arena's place allows) never fits: no
        // reclaim for it.
        let never = align > crate::core::MAX_ALIGN
            || self
                .small
                .arena()
                .checked_next_multiple_of(align)
                .and_then(|start| start.checked_add(size))
                .is_none_or(|end| end > self.arena_end);
        if never {
            self.cause = FailureCause::NeverFits;
            None
        } else if self.reclaim() {
            self.large_block(size, grid, align)
        } else {
            None
        }
    }

    /// Notes that the request for `size` bytes at `align` failed (for
    /// [`GlobalBfc::last_failure`]), with the cause the last refusal left; returns null.
    #[cold]
    fn failed(&mut self, size: usize, align: usize) -> *mut u8 {
        self.last_failure = Some(AllocFailure {
            size,
            align,
            cause: self.cause,
        });
        ptr::null_mut()
    }

    /// Notes why the engine refused a block.
    #[cold]
    fn refused(&mut self, e: &AllocError) {
        self.cause = match e {
            AllocError::OutOfMemory(r) if r.cause == OomCause::ChunkTableFull => {
                FailureCause::ChunkTableFull
            }
            AllocError::BadAlignment { .. } | AllocError::TooLarge { .. } => {
                FailureCause::NeverFits
            }
            _ => FailureCause::ArenaFull,
        };
    }

    /// An engine block for a large or medium request: on the preferred grid `grid`, else (no hole
    /// has room for the padding it needs, nor the arena near its limit) at the requested alignment
    /// `align`.
    #[inline(always)]
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
    #[inline(always)]
    fn engine_block(&mut self, size: usize, grid: usize) -> Option<Allocated> {
        if !self.prepare_records() {
            self.cause = FailureCause::CommitRefused;
            return None;
        }
        let bound = self.bfc.source().committed_end();
        match self.bfc.allocate_block_below(size, grid, bound) {
            Ok(b) => Some(b),
            Err(AllocError::BeyondBound { end, .. }) => self.engine_block_beyond(size, grid, end),
            Err(e) => {
                self.refused(&e);
                None
            }
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
                self.cause = FailureCause::CommitRefused;
                return None;
            }
            let bound = self.bfc.source().committed_end();
            match self.bfc.allocate_block_below(size, grid, bound) {
                Ok(b) => return Some(b),
                Err(AllocError::BeyondBound { end: e, .. }) => end = e,
                Err(e) => {
                    self.refused(&e);
                    return None;
                }
            }
        }
        self.cause = FailureCause::ArenaFull;
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
        let zero_from = self.brk;
        self.note_allocated(base, SPAN);
        self.span_allocs += 1;
        self.small.add_span(c, base, zero_from);
        true
    }

    /// [`Heap::allocate`] of a small request of class `c`, and which pages of the object's span were
    /// known to be zero (see [`SmallHeap::alloc_known_zero`]).
    #[cfg(feature = "std")]
    fn allocate_small_known_zero(&mut self, c: usize, size: usize, align: usize) -> (*mut u8, u16) {
        let found = match self.small.alloc_known_zero(c) {
            Some(r) => Some(r),
            None if self.small_new_span(c) => self.small.alloc_known_zero(c),
            None => None,
        };
        match found {
            Some((p, zero)) => {
                self.note_peak(small::class_size(c));
                (p as *mut u8, zero)
            }
            None => (self.failed(size, align), 0),
        }
    }

    /// Out of memory: gives back to the engine what the heap holds only for reuse, so that an
    /// allocation can try again. The transfer cache and, if it serves this heap, the calling
    /// thread's cache go back to the slab layer (its medium blocks to the engine), and each class's
    /// empty current span to the engine (where it coalesces). Other threads' caches are out of
    /// reach: their fast paths take no lock. `true` if anything went back.
    #[cold]
    #[inline(never)]
    fn reclaim(&mut self) -> bool {
        let before = (
            self.small.objects,
            self.small.spans_live,
            self.bfc.bytes_in_use(),
        );
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
        (
            self.small.objects,
            self.small.spans_live,
            self.bfc.bytes_in_use(),
        ) != before
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
        // Entries up to the highest committed end: `brk` and the committed end move down when the
        // top is trimmed, but the span table's touched pages stay.
        s.metadata_bytes += self.small.metadata_bytes(self.bfc.source().reached_end());
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
                at: Some(c.ptr()),
            });
        }
        self.bfc
            .source()
            .check_commit(self.brk, self.bfc.records_touched())
            .map_err(|what| CheckError { what, at: None })?;
        self.small
            .check(self.brk)
            .map_err(|what| CheckError { what, at: None })?;
        #[cfg(feature = "std")]
        self.check_own_cache()?;
        // Every medium table entry names a live block of exactly its class's size.
        #[cfg(feature = "std")]
        {
            let mut bad = None;
            self.medium.walk(self.brk, |p, m| {
                if bad.is_none()
                    && (self.bfc.usable_size(p) != Ok(medium::class_size(m))
                        || p % medium::MEDIUM_ALIGN != 0)
                {
                    bad = Some(p);
                }
            });
            if let Some(p) = bad {
                return Err(CheckError {
                    what: "the medium table names a block that is not a live, aligned block of its class",
                    at: Some(p),
                });
            }
        }
        #[cfg(feature = "std")]
        for c in 0..small::NUM_CLASSES {
            let mut ok = true;
            self.transfer.walk(c, |p| {
                ok &= matches!(self.small.class_of_live(p), Ok(Some(k)) if k == c);
            });
            if !ok {
                return Err(CheckError {
                    what: "transfer cache holds a block that is not a live object of its class",
                    at: None,
                });
            }
        }
        #[cfg(feature = "std")]
        for m in 0..medium::NUM_LOWER {
            let blocks = self.medium_transfer.blocks(m);
            let bad = blocks.iter().enumerate().find(|&(i, &p)| {
                self.medium.class_of(p).is_some()
                    || p % medium::MEDIUM_ALIGN != 0
                    || self.bfc.usable_size(p) != Ok(medium::class_size(m))
                    || blocks[i + 1..].contains(&p)
                    || tcache::with(|tc| tc.owner.get() == self.id && tc.contains_medium(m, p))
                        == Some(true)
            });
            if let Some((_, &p)) = bad {
                return Err(CheckError {
                    what: "medium transfer cache holds a block that is not a live, unnamed block \
                           of its class's size, or holds it twice",
                    at: Some(p),
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
        // Like glibc's dynamic thresholds: a program that frees big blocks gets to keep a few of
        // them touched, so a buffer that is freed and allocated again (a growing Vec, a
        // per-request arena) does not fault its pages in every time.
        // Blocks of `MAX_RETAIN` or more are treated like glibc's mmapped ones: their pages go back
        // at once and they do not raise the retained amount. Blocks below `T` count too (those
        // below `T / RETAIN_BLOCKS` cannot raise it): a program churning 8 buffers of 16 KiB..1 MiB
        // (bench-peers `bufw`) otherwise had its free top trimmed to 1 MiB again and again, 644,000
        // page faults and 12 us per step against 2,000 and 0.48 us with them counted.
        if f.size < MAX_RETAIN {
            self.retain = self.retain.max((RETAIN_BLOCKS * f.size).min(MAX_RETAIN));
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
                    // SAFETY: past `keep` lies the free top, its pages just discarded.
                    unsafe { self.lower_touched_end(keep) };
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
        // Sweep after eight times as many bytes were freed as are in use (at least 16 thresholds,
        // and twice the retained amount), returning only chunks that stayed free since the
        // previous sweep: memory a program frees and allocates again in cycles keeps its pages.
        // (Once the bytes in use, 1x, re-faulted pages that large-block churn takes again a little
        // later: bench-peers `large` 1150 -> 600 ns per step at 2x, peak RSS 15 -> 21 MiB against
        // glibc's 154; the same churn writing whole blocks kept the same peak RSS. 2x -> 4x, on a
        // noisier machine: 12,405 -> 10,041 page faults, medians of 7 interleaved runs 1133 -> 1002
        // ns per step (rlsf 1120), peak RSS 21.4 -> 22.1 MiB. 4x -> 8x: `largew`, which writes
        // every page of its blocks, 101,790 -> 90,683 page faults (as many as with no interior
        // sweep at all) and 15.8-16.1 -> 13.9-14.0 us per step, the same peak RSS (353 MiB); `large`
        // 6,016-6,021 -> 5,938-5,942 faults; `large`, `json` and `vec` kept their times and peaks.)
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
        // Returns the whole pages of `ptr..ptr + size`, a free chunk or the end of one; whether
        // they now read as zero.
        let mut give_back = |ptr: usize, size: usize| {
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
            // A refused discard leaves the chunk unmarked: the next sweep tries its pages again.
            zeroed
        };
        self.bfc.sweep_dirty(min.max(page), aging, &mut give_back);
        if aging {
            // A free chunk whose head a program reuses between sweeps (splits off, frees, merges
            // back) looks changed at every sweep and never ages: past its first `2 * MAX_RETAIN`
            // bytes its pages go back anyway (the chunk stays unmarked: its head is dirty).
            // (Past the first `MAX_RETAIN` bytes, or in every chunk of `MAX_RETAIN` and more
            // without aging, bench-peers `largew` took 9% and 170% longer: its free chunks are
            // reused that way, and their pages faulted back in.)
            let keep = 2 * MAX_RETAIN;
            self.bfc.sweep_dirty(keep, false, |ptr, size| {
                give_back(ptr + keep, size - keep);
                false
            });
        }
        if new_brk < self.brk {
            // SAFETY: past `new_brk` lies the free top, its pages just discarded.
            unsafe { self.lower_touched_end(new_brk) };
        }
        covered
    }

    /// Moves the touched end (`brk`) down to `end`, and the arena's commit after it.
    ///
    /// # Safety
    /// Past `end` lies only the free top of the arena, and its pages read as zero (the kernel took
    /// them back).
    unsafe fn lower_touched_end(&mut self, end: usize) {
        self.brk = end;
        // SAFETY: `end` is the touched end now, with nothing handed out and only zeros past it.
        unsafe { self.bfc.source_mut().decommit_arena(end) };
    }

    #[inline]
    fn free(&mut self, ptr: *mut u8) {
        let p = ptr as usize;
        match self.small.free(p) {
            SmallFree::Freed(None) => {}
            SmallFree::Freed(Some(span)) => self.free_engine(span),
            SmallFree::NotSmall => {
                #[cfg(feature = "std")]
                self.check_not_cached(p);
                self.free_engine(p)
            }
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
            Ok(f) => {
                // Only a block above 16 KiB may be a medium one (and `clear` forgets only an entry
                // that names `p`: see `medium.rs`).
                #[cfg(feature = "std")]
                if f.size > small::SMALL_MAX {
                    self.medium.clear(p);
                }
                self.after_free(f)
            }
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
                // A medium block in this thread's cache must not be resized or moved (realloc of
                // a freed block).
                #[cfg(feature = "std")]
                self.check_not_cached(p);
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
        if let Some(q) = self.resize_in_place(ptr, new_size, align) {
            if q.is_null() {
                return self.failed(new_size, align);
            }
            return q;
        }
        // Allocate the new block under the same lock acquisition.
        let noted = self.last_failure;
        let q = self.allocate(new_size, align);
        if !q.is_null() {
            return q;
        }
        // Before failing, the allocation took back what the heap held only for reuse (see
        // `Heap::reclaim`): an empty span that stood after the block may have gone back and
        // coalesced with the free chunk there.
        match self.resize_in_place(ptr, new_size, align) {
            Some(q) if q.is_null() => self.failed(new_size, align),
            Some(q) => {
                // The realloc succeeded: the failure the allocation noted is not one.
                self.last_failure = noted;
                q
            }
            // (The allocation above noted the failure.)
            None => ptr::null_mut(),
        }
    }

    /// Resizes the engine block at `ptr` to `new_size` bytes (its medium class's size, for a
    /// medium request at `align`) where it lies: `ptr` when done, null when out of memory, `None`
    /// when the block must move.
    #[inline]
    fn resize_in_place(&mut self, ptr: *mut u8, new_size: usize, align: usize) -> Option<*mut u8> {
        let p = ptr as usize;
        #[cfg(feature = "std")]
        let class = medium::class_for(new_size, align);
        #[cfg(feature = "std")]
        let new_size = class.map_or(new_size, medium::class_size);
        #[cfg(not(feature = "std"))]
        let _ = align;
        // A shrink makes a record.
        if !self.prepare_records() {
            self.cause = FailureCause::CommitRefused;
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
                // The block's old entry (if it was a medium block) no longer says its size; the
                // new one is written when the block is exactly a medium class's size.
                #[cfg(feature = "std")]
                {
                    self.medium.clear(p);
                    // (Only a block a cache may hand out for any medium request: aligned to
                    // `MEDIUM_ALIGN`, which a block placed for another request may not be.)
                    if let Some(m) = class
                        .filter(|&m| size == medium::class_size(m) && p % medium::MEDIUM_ALIGN == 0)
                    {
                        self.medium.set(m, p);
                    }
                }
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

/// Aborts for a free before the heap was ever initialised.
#[cold]
fn never_initialised(ptr: *mut u8) -> ! {
    os::fatal(format_args!(
        "free of pointer {ptr:p} but the heap was never initialised"
    ))
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

impl Drop for GlobalBfc {
    fn drop(&mut self) {
        // The bindings lock below is the first allocator lock a process takes when it drops an
        // instance before any was used: the handlers must be in place before it, as in `init`, or
        // a `fork` on another thread now would leave it held in the child.
        #[cfg(all(feature = "std", not(loom)))]
        install_fork_handlers();
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
    // Always inlined, so that the fast paths sit in the entry points (`__rust_alloc`,
    // `__rust_dealloc`) whatever codegen unit they land in: merely `#[inline]`, some binaries
    // (this crate's integration tests) reached them through a jump and two moves (a test
    // disassembles both).
    #[inline(always)]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        #[cfg(feature = "std")]
        if let Some(c) = small::class_for(layout.size(), layout.align()) {
            return self.alloc_small(c, layout.size(), layout.align());
        }
        // (Before the medium path, so that the size and alignment need not outlive it: the
        // small path then needs no saved register.)
        #[cfg(feature = "std")]
        if layout.size() > medium::MEDIUM_MAX {
            return Self::alloc_beyond_medium(layout.size(), layout.align(), self);
        }
        #[cfg(feature = "std")]
        if let Some(m) = medium::class_for(layout.size(), layout.align()) {
            return match self.bound_cache(|tc| tc.pop_medium_for(m)).flatten() {
                Some(p) => p as *mut u8,
                None => self.alloc_medium_slow(m, layout.size(), layout.align()),
            };
        }
        self.alloc_locked(layout.size(), layout.align())
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        #[cfg(feature = "std")]
        if let Some(c) = small::class_for(layout.size(), layout.align()) {
            let p = if small::class_size(c) > ZERO_FROM_CACHE_MAX {
                // A cached block was handed out before: written whole. Without one, the slab
                // layer's object is written only where it may hold old data.
                match self.bound_cache(|tc| tc.pop(c)).flatten() {
                    Some(p) => p as *mut u8,
                    None => {
                        return self.alloc_small_zeroed_locked(c, layout.size(), layout.align())
                    }
                }
            } else {
                self.alloc_small(c, layout.size(), layout.align())
            };
            if !p.is_null() {
                // SAFETY: the block holds at least `size` bytes.
                unsafe { ptr::write_bytes(p, 0, layout.size()) };
            }
            return p;
        }
        // A cached medium block was handed out before: written whole.
        #[cfg(feature = "std")]
        if let Some(m) = medium::class_for(layout.size(), layout.align()) {
            if let Some(p) = self.bound_cache(|tc| tc.pop_medium_for(m)).flatten() {
                // SAFETY: the block holds its class's size, at least `size` bytes.
                unsafe { ptr::write_bytes(p as *mut u8, 0, layout.size()) };
                return p as *mut u8;
            }
        }
        self.alloc_zeroed_locked(layout.size(), layout.align())
    }

    // Always inlined: see `alloc`.
    #[inline(always)]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        #[cfg(feature = "std")]
        if let Some(c) = small::class_for(layout.size(), layout.align()) {
            if self.bound_cache(|tc| tc.push(c, ptr as usize)) != Some(true) {
                self.free_small_slow(ptr, c);
            }
            return;
        }
        // (Before the medium path, so that the size and alignment need not outlive it: the
        // small path then needs no saved register.)
        #[cfg(feature = "std")]
        if layout.size() > medium::MEDIUM_MAX {
            return Self::free_beyond_medium(ptr, layout.size(), layout.align(), self);
        }
        #[cfg(feature = "std")]
        if let Some(m) = medium::class_for(layout.size(), layout.align()) {
            return Self::free_medium(ptr, m, self);
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
        // So does a medium block the table names, within its class (its block has the class size).
        #[cfg(feature = "std")]
        if let Some(m) = medium::class_for(layout.size(), align) {
            if medium::class_for(new_size, align) == Some(m)
                && self.bound_cache(|tc| tc.plausible_medium(m, ptr as usize)) == Some(true)
            {
                return ptr;
            }
        }
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
    /// `alloc_zeroed` of a block no thread cache served: allocated under the lock, and zeroed
    /// where it may hold old data (see the module docs, "Giving memory back").
    // Out of line and not generic, so that it is compiled once, in this crate: inlined into
    // `__rust_alloc_zeroed`, it made the program's crate compile a second copy of the engine's
    // allocation path.
    #[inline(never)]
    fn alloc_zeroed_locked(&self, size: usize, align: usize) -> *mut u8 {
        // `fresh`: the heap's end of touched memory before this allocation. Nothing was ever
        // written at or above it (or its pages were returned), so that part of the block is zero.
        let Some((p, page, fresh)) = self.with_heap(|h| {
            let fresh = h.brk;
            (h.allocate(size, align), h.page, fresh)
        }) else {
            return ptr::null_mut();
        };
        if p.is_null() {
            return p;
        }
        // Only the block's part below `fresh` may hold old data.
        let dirty = (p as usize + size).min(fresh).saturating_sub(p as usize);
        let lo = (p as usize).next_multiple_of(page);
        let hi = (p as usize + dirty) & !(page - 1);
        let mostly_resident = || {
            // SAFETY: `lo..hi` is page-aligned inside the arena.
            unsafe { os::mostly_resident(lo, hi - lo, page) }
        };
        if hi > lo
            && (dirty >= ZERO_BY_DISCARD.max(self.config.release_threshold)
                || (hi - lo >= ZERO_PROBE_MIN && !mostly_resident()))
        {
            // Huge, or mostly not resident (a sparse buffer, or memory a sweep gave back): zero the
            // whole pages by giving them back (they fault in as zero pages), and write only the
            // partial pages at the ends.
            // SAFETY: `lo..hi` is page-aligned inside the block we own; `p..lo` and `hi..p + dirty`
            // too.
            unsafe {
                os::discard_or_zero(lo, hi - lo);
                ptr::write_bytes(p, 0, lo - p as usize);
                ptr::write_bytes(hi as *mut u8, 0, p as usize + dirty - hi);
            }
        } else {
            // SAFETY: the block holds at least `size >= dirty` bytes.
            unsafe { ptr::write_bytes(p, 0, dirty) };
        }
        p
    }

    /// `alloc_zeroed` of a small request of class `c` above [`ZERO_FROM_CACHE_MAX`], under the
    /// lock: the slab layer knows which of the object's pages are still zero (never touched, or
    /// given back), and only the rest is written, so a zeroed buffer the caller uses sparsely is
    /// not faulted in whole.
    #[cfg(feature = "std")]
    #[cold]
    #[inline(never)]
    fn alloc_small_zeroed_locked(&self, c: usize, size: usize, align: usize) -> *mut u8 {
        let Some((p, zero, page)) = self.with_heap(|h| {
            let (p, zero) = h.allocate_small_known_zero(c, size, align);
            (p, zero, h.page)
        }) else {
            return ptr::null_mut();
        };
        if p.is_null() {
            return p;
        }
        let (start, end) = (p as usize, p as usize + size);
        let span = start & !(SPAN - 1);
        let mut at = start;
        while at < end {
            // The page holding `at`, and the end of its part of the object.
            let k = (at - span) / page;
            let next = (span + (k + 1) * page).min(end);
            if k >= 16 || zero & (1 << k) == 0 {
                // SAFETY: `at..next` lies in the block, which holds at least `size` bytes.
                unsafe { ptr::write_bytes(at as *mut u8, 0, next - at) };
            }
            at = next;
        }
        p
    }

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
            never_initialised(ptr);
        }
    }

    /// A small allocation of `size` bytes at `align` (of class `c`): the thread cache's list for
    /// class `c`, else the slow path.
    #[cfg(feature = "std")]
    #[inline(always)]
    fn alloc_small(&self, c: usize, size: usize, align: usize) -> *mut u8 {
        match self.bound_cache(|tc| tc.pop(c)).flatten() {
            Some(p) => p as *mut u8,
            None => self.alloc_small_slow(c, size, align),
        }
    }

    /// Refills the thread's list (binding the cache first if it is free to bind), or allocates under
    /// the lock when the thread's cache serves another instance or is gone.
    #[cfg(feature = "std")]
    #[cold]
    #[inline(never)]
    fn alloc_small_slow(&self, c: usize, size: usize, align: usize) -> *mut u8 {
        self.alloc_with_cache(size, align, |h, tc| h.refill_cache(tc, c, (size, align)))
    }

    /// A small free the cache's fast path declined: the list is full, the pointer needs checking,
    /// or the cache is not bound yet (a thread that only frees binds here).
    #[cfg(feature = "std")]
    #[cold]
    #[inline(never)]
    fn free_small_slow(&self, ptr: *mut u8, c: usize) {
        self.free_with_cache(ptr, |h, tc| h.free_to_cache(tc, c, ptr as usize));
    }

    /// A medium allocation the thread's cache had no block for: an engine block under the lock
    /// (binding the cache first if it is free to bind, and counting the miss for its decay).
    #[cfg(feature = "std")]
    #[cold]
    #[inline(never)]
    fn alloc_medium_slow(&self, m: usize, size: usize, align: usize) -> *mut u8 {
        self.alloc_with_cache(size, align, |h, tc| {
            tc.note_lock(h.contended);
            let p = match h.take_from_medium_transfer(tc, m) {
                Some(p) => p as *mut u8,
                None => h.allocate(size, align),
            };
            h.note_slow(tc, tcache::MEDIUM_BIT + m);
            p
        })
    }

    /// A medium free the cache's fast path declined: the stack is full, the table does not name
    /// the block as one of its class, or the cache is not bound yet.
    #[cfg(feature = "std")]
    #[cold]
    #[inline(never)]
    fn free_medium_slow(&self, ptr: *mut u8, m: usize) {
        self.free_with_cache(ptr, |h, tc| {
            tc.note_lock(h.contended);
            h.free_medium_to_cache(tc, m, ptr as usize);
        });
    }

    /// An allocation above [`medium::MEDIUM_MAX`]: an upper-class one (see `medium.rs`) from the
    /// thread's cache if it holds one (or a class-size block under the lock if the thread caches
    /// them now), else a block of `size` bytes under the lock; if an upper-class request found the
    /// lock contended, the thread caches upper-class blocks from now on.
    // Out of line, so the small and medium fast paths it sits beside stay lean; the allocator
    // last, so the arguments the caller got arrive in the registers they came in (the small path
    // then moves no register to keep them for this call: 2 instructions a call on `pairs`).
    #[cfg(feature = "std")]
    #[inline(never)]
    fn alloc_beyond_medium(size: usize, align: usize, this: &Self) -> *mut u8 {
        let upper = medium::upper_class_for(size, align);
        if let Some(m) = upper {
            // A thread that stopped caching them takes what is cached all the same.
            match this.bound_cache(|tc| tc.pop_upper_for(m)) {
                Some(Ok(p)) => return p as *mut u8,
                Some(Err(true)) => return this.alloc_upper_slow(m, size, align),
                _ => {}
            }
        }
        let Some((p, contended)) = this.with_heap(|h| (h.allocate(size, align), h.contended))
        else {
            return ptr::null_mut();
        };
        if contended && upper.is_some() {
            this.upper_contended();
        }
        p
    }

    /// The free of a block of medium class `m`: into the thread's cache if it vouches for the
    /// block and has room, else under the lock.
    // Out of line: inlined, its checks need one more register than the small path's, which
    // `dealloc` then saves and restores on every small free too.
    #[cfg(feature = "std")]
    #[inline(never)]
    fn free_medium(ptr: *mut u8, m: usize, this: &Self) {
        if this.bound_cache(|tc| tc.push_medium(m, ptr as usize)) != Some(true) {
            this.free_medium_slow(ptr, m);
        }
    }

    /// A free above [`medium::MEDIUM_MAX`]: an upper-class one into the thread's cache if it caches
    /// them now and has room, else under the lock (as for [`GlobalBfc::alloc_beyond_medium`], an
    /// upper-class free that found the lock contended starts the caching).
    // Out of line, and the allocator last: see `alloc_beyond_medium`.
    #[cfg(feature = "std")]
    #[inline(never)]
    fn free_beyond_medium(ptr: *mut u8, size: usize, align: usize, this: &Self) {
        let upper = medium::upper_class_for(size, align);
        if let Some(m) = upper {
            match this.bound_cache(|tc| tc.caches_upper().then(|| tc.push_upper(m, ptr as usize))) {
                Some(Some(true)) => return,
                Some(Some(false)) => return this.free_upper_slow(ptr, m),
                _ => {}
            }
        }
        match this.with_heap(|h| {
            h.free(ptr);
            h.contended
        }) {
            Some(contended) => {
                if contended && upper.is_some() {
                    this.upper_contended();
                }
            }
            None => never_initialised(ptr),
        }
    }

    /// An upper-class request that does not cache found the lock contended: the calling thread
    /// caches upper-class blocks from now on, if the upper classes are on and its cache serves
    /// this allocator (bound first if it is free to bind: a thread that makes only upper-class
    /// requests has not bound it yet). The lock is not held here (binding takes it).
    #[cfg(feature = "std")]
    #[cold]
    #[inline(never)]
    fn upper_contended(&self) {
        if !medium::upper_classes_on(self.config.upper_cache_bytes) {
            return;
        }
        let id = self.id.load(core::sync::atomic::Ordering::Relaxed);
        tcache::with(|tc| {
            if tc.owner.get() == id || self.with_bound_cache(tc, |_| ()).is_some() {
                tc.note_lock(true);
            }
        });
    }

    /// An upper-class allocation by a thread that caches upper-class blocks now, with none cached
    /// for it: under the lock, a block of the class size (see `medium.rs`), or of `size` bytes if
    /// the lock was not contended this time and that ends the caching. Counts the miss for the
    /// cache's decay.
    #[cfg(feature = "std")]
    #[cold]
    #[inline(never)]
    fn alloc_upper_slow(&self, m: usize, size: usize, align: usize) -> *mut u8 {
        self.alloc_with_cache(size, align, |h, tc| {
            tc.note_lock(h.contended);
            // (A class the budget cannot hold is not rounded: its block could never be cached.)
            if !tc.caches_upper() || medium::class_size(m) > tc.upper_budget.get() {
                return h.allocate(size, align);
            }
            let p = h.allocate_medium(m, size, align);
            h.note_slow(tc, tcache::MEDIUM_BIT + m);
            p
        })
    }

    /// An upper-class free the cache's fast path declined in a thread that caches upper-class
    /// blocks now: as a medium one, unless the lock was not contended this time and that ends the
    /// caching (then the plain free).
    #[cfg(feature = "std")]
    #[cold]
    #[inline(never)]
    fn free_upper_slow(&self, ptr: *mut u8, m: usize) {
        self.free_with_cache(ptr, |h, tc| {
            tc.note_lock(h.contended);
            if tc.caches_upper() {
                h.free_medium_to_cache(tc, m, ptr as usize);
            } else {
                h.free(ptr);
            }
        });
    }

    /// The slow paths' allocation: `f` under the lock with the calling thread's cache (bound first
    /// if it is free to bind), or a plain allocation of `size` at `align` under the lock when the
    /// thread's cache serves another instance or is gone.
    #[cfg(feature = "std")]
    #[inline(always)]
    fn alloc_with_cache(
        &self,
        size: usize,
        align: usize,
        f: impl FnOnce(&mut Heap, &ThreadCache) -> *mut u8,
    ) -> *mut u8 {
        match tcache::with(|tc| self.with_bound_cache(tc, |h| f(h, tc))).flatten() {
            Some(p) => p,
            None => self.alloc_locked(size, align),
        }
    }

    /// The slow paths' free: `f` under the lock with the calling thread's cache (bound first if it
    /// is free to bind), or the plain free of `ptr` under the lock when the thread's cache serves
    /// another instance or is gone.
    #[cfg(feature = "std")]
    #[inline(always)]
    fn free_with_cache(&self, ptr: *mut u8, f: impl FnOnce(&mut Heap, &ThreadCache)) {
        let done = tcache::with(|tc| self.with_bound_cache(tc, |h| f(h, tc)).is_some());
        if done != Some(true) {
            self.free_locked(ptr);
        }
    }

    /// Runs `f` under the lock if the calling thread's cache `tc` is bound to this allocator,
    /// binding it first if it is unbound or its instance was dropped. `None` (nothing run) if the
    /// cache serves another live instance, the thread is exiting, caches are off, the arena is
    /// unavailable, or no exit flush could be set up (no pthread key: the cache then never serves).
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
        // (which is not held here). No cache without fork handlers either: a fork child would
        // keep this one registered for a thread it does not have.
        if !fork::fork_handlers_installed() || !tcache::register_exit_flush() {
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
            tc.medium.set(h.medium.entries());
            tc.upper_budget.set(self.config.upper_cache_bytes);
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

/// Aborts on a corrupted registry of thread caches (a cache linked twice, or links into another
/// list), rather than walk it for ever. The known way there: a thread started outside Rust whose
/// first allocation came in glibc's last pass of pthread key destructors left its cache
/// registered (no pass flushed it), and a new thread reused its storage (see
/// `tcache::register_exit_flush`).
#[cfg(feature = "std")]
#[cold]
fn registry_corrupted() -> ! {
    // (The loom models' negative controls expect a panic.)
    #[cfg(loom)]
    panic!("the thread cache registry is corrupted");
    #[cfg(not(loom))]
    os::fatal(format_args!(
        "the thread cache registry is corrupted: a walk met more caches than were registered (a \
         thread that first allocated in the last pass of pthread key destructors exited unflushed?)"
    ))
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
        self.registered = 0;
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
        if self.caches == me {
            registry_corrupted();
        }
        self.registered += 1;
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
        self.registered -= 1;
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

    /// Runs `f` on every registered cache (touching only their atomics). Aborts when the list
    /// holds more caches than were registered (a cycle: see [`registry_corrupted`]).
    fn for_each_cache(&self, mut f: impl FnMut(&ThreadCache)) {
        let mut cur = self.caches;
        let mut seen = 0;
        while cur != 0 {
            seen += 1;
            if seen > self.registered {
                registry_corrupted();
            }
            // SAFETY: a registered cache, under the heap lock.
            let tc = unsafe { cache_at(cur) };
            f(tc);
            cur = tc.next.load(crate::sync::Ordering::Relaxed);
        }
    }

    /// `(bytes, blocks)` held by all thread caches and the transfer cache.
    fn cached(&self) -> (usize, usize) {
        let mut total = self.transfer.held();
        let (b, n) = self.medium_transfer.held();
        total.0 += b;
        total.1 += n;
        self.for_each_cache(|tc| {
            let (b, n) = tc.held();
            total.0 += b;
            total.1 += n;
        });
        total
    }

    /// Moves a batch of class `c` blocks into the calling thread's cache `tc` and returns one more
    /// for the caller (null when out of memory, noted as a failure of the caller's `request`,
    /// size and alignment).
    fn refill_cache(&mut self, tc: &ThreadCache, c: usize, request: (usize, usize)) -> *mut u8 {
        // The slab hands out ascending addresses; the stack is filled in reverse so the thread
        // gets them in that order too (consecutive allocations stay adjacent in memory).
        let mut got = [0usize; tcache::MAX_BATCH + 1];
        // At most a span's objects: the 14 and 16 KiB classes have four a span, and a fifth would
        // make a second span only to fill the cache.
        let want = (tcache::batch(c) + 1).min(small::capacity(c));
        // Blocks another thread's cache gave back first, then the slab layer.
        let mut n = self.transfer.pop_into(c, &mut got[..want]);
        while n < want {
            n += self.small.alloc_batch(c, &mut got[n..want]);
            if n < want && !self.small_new_span(c) {
                break;
            }
        }
        if n == 0 {
            return self.failed(request.0, request.1);
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
                if k < tcache::MEDIUM_BIT {
                    self.flush_bin(tc, k, tc.count(k).div_ceil(2), false);
                } else {
                    let m = k - tcache::MEDIUM_BIT;
                    self.flush_medium(tc, m, tc.medium_count(m).div_ceil(2), false);
                }
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

    /// Returns every block in the transfer caches to the slab layer and the engine (checked).
    fn drain_transfer(&mut self) {
        for m in 0..medium::NUM_LOWER {
            while let Some(p) = self.medium_transfer.pop(m) {
                self.free_engine(p);
            }
        }
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
                "free of pointer {p:#x}, which is not a live block of the layout's size class: a \
                 double free (its span was given back and made again), or a free with a layout \
                 of another size than the allocation's"
            )),
            e => small_error(p, e, ""),
        }
    }

    /// Empties the calling thread's cache `tc` into the slab layer and the engine (checked), with
    /// the transfer cache.
    fn flush_all(&mut self, tc: &ThreadCache) {
        for c in 0..small::NUM_CLASSES {
            self.flush_bin(tc, c, tc.count(c), false);
        }
        for m in 0..medium::NUM_MEDIUM {
            self.flush_medium(tc, m, tc.medium_count(m), false);
        }
        self.drain_transfer();
    }

    /// Moves up to `n` blocks of medium class `m` out of the calling thread's cache `tc`: into the
    /// medium transfer cache while it has room, if `transfer`, and otherwise into the engine
    /// (which checks that each is live, and coalesces it).
    fn flush_medium(&mut self, tc: &ThreadCache, m: usize, n: usize, transfer: bool) {
        let mut buf = [0usize; medium::CONTENDED_MEDIUM_BIN];
        let k = tc.pop_medium_into(m, &mut buf[..n.min(medium::CONTENDED_MEDIUM_BIN)]);
        for &p in &buf[..k] {
            if !(transfer && self.park_medium(m, p)) {
                self.free_engine(p);
            }
        }
    }

    /// Puts block `p` of medium class `m` in the medium transfer cache if it has room; whether it
    /// did. The medium table does not name it while it waits there: a thread cache's fast path
    /// then refuses a second free of it, which the locked path catches (`abort_if_transferred`).
    fn park_medium(&mut self, m: usize, p: usize) -> bool {
        let parked = self.medium_transfer.push(m, p);
        if parked {
            self.medium.clear(p);
        }
        parked
    }

    /// Takes a block of medium class `m` out of the medium transfer cache, named in the medium
    /// table again (a live medium block outside it).
    fn unpark_medium(&mut self, m: usize) -> Option<usize> {
        let p = self.medium_transfer.pop(m)?;
        self.medium.set(m, p);
        Some(p)
    }

    /// Aborts if the engine block `p`, freed by the pointer-based path or resized under the lock,
    /// is a medium block waiting in the calling thread's cache (freed before with its own layout,
    /// now freed again with another or reallocated: the engine would free or resize it while the
    /// cache may still hand it out). Other threads' caches are out of reach (their blocks are
    /// checked when they go back to the engine).
    fn check_not_cached(&self, p: usize) {
        let Some(m) = self.medium.class_of(p) else {
            self.abort_if_transferred(p);
            return;
        };
        let id = self.id;
        tcache::with(|tc| {
            if tc.owner.get() == id {
                Self::abort_if_cached(tc, m, p);
            }
        });
    }

    /// Aborts if `p` is in the heap's medium transfer cache (freed before and not handed out
    /// again: a double free). The medium table does not name blocks while they are there, so a
    /// second free of one misses the thread caches' fast paths and their table check, and comes
    /// here through the pointer-based free.
    fn abort_if_transferred(&self, p: usize) {
        if p % medium::MEDIUM_ALIGN != 0 || self.medium_transfer.held().1 == 0 {
            return;
        }
        if (0..medium::NUM_LOWER).any(|m| self.medium_transfer.blocks(m).contains(&p)) {
            os::fatal(format_args!(
                "double free of pointer {p:#x} (it is already in the heap's transfer cache)"
            ));
        }
    }

    /// Aborts if medium block `p` of class `m` is in the cache `tc` (freed before and not handed
    /// out again: a double free).
    fn abort_if_cached(tc: &ThreadCache, m: usize, p: usize) {
        if tc.contains_medium(m, p) {
            os::fatal(format_args!(
                "double free of pointer {p:#x} (it is already in this thread's cache)"
            ));
        }
    }

    /// A block for a medium class `m` request from the heap's medium transfer cache: one of class
    /// `m` or else of the next class up, as from a thread's cache. With a class `m` block it also
    /// moves up to half the thread cache `tc`'s cap of them into `tc`, so a thread that only
    /// allocates (a producer) takes the lock once for several.
    fn take_from_medium_transfer(&mut self, tc: &ThreadCache, m: usize) -> Option<usize> {
        let Some(p) = self.unpark_medium(m) else {
            return self.unpark_medium(m + 1);
        };
        while tc.medium_count(m) < tc.medium_cap(m) / 2 && tc.medium_room(m) {
            let Some(q) = self.unpark_medium(m) else {
                break;
            };
            tc.fill_medium(m, q);
        }
        Some(p)
    }

    /// The slow path of a medium free with a layout of class `m` into the calling thread's cache
    /// `tc`: checks the block against the table (a block it does not name as one of class `m` or
    /// larger takes the checked pointer-based free), makes room, and caches it by its own class.
    fn free_medium_to_cache(&mut self, tc: &ThreadCache, m: usize, p: usize) {
        // The block's own class: the layout's, or larger (a block from the next class's stack).
        // (Of the layout's group: an upper-class block freed with a medium layout, a wrong
        // layout, must not join an upper stack of a thread that does not cache them.)
        let Some(m) = self
            .medium
            .class_of(p)
            .filter(|&k| k >= m && (k >= medium::NUM_LOWER) == (m >= medium::NUM_LOWER))
        else {
            self.free(p as *mut u8);
            return;
        };
        Self::abort_if_cached(tc, m, p);
        if tc.medium_count(m) >= tc.medium_cap(m) || !tc.medium_room(m) {
            // In a thread that meets contention, into the transfer cache while it has room, for
            // another thread's misses. (Single-threaded, it would only be more cache: `zero` kept
            // 0.6 MiB more.)
            self.flush_medium(tc, m, tc.medium_count(m).div_ceil(2), tc.contended());
        }
        if tc.medium_count(m) < tc.medium_cap(m) && tc.medium_room(m) {
            tc.fill_medium(m, p);
        } else {
            // The budget is held by other classes' blocks (they leave as those classes are
            // allocated again, or decay), or the stack still holds what it took while the thread
            // met contention.
            self.free_engine(p);
        }
        self.note_slow(tc, tcache::MEDIUM_BIT + m);
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
                        at: None,
                    });
                }
                if n > tcache::bin_capacity(c) || tc.has_duplicate(c) {
                    return Err(CheckError {
                        what: "thread cache stack overfull or holding a block twice",
                        at: None,
                    });
                }
            }
            // Each budget's byte count is its classes' blocks.
            let bytes = |classes: core::ops::Range<usize>| {
                classes
                    .map(|m| tc.medium_count(m) * medium::class_size(m))
                    .sum::<usize>()
            };
            if tc.medium_bytes(false) != bytes(0..medium::NUM_LOWER)
                || tc.medium_bytes(true) != bytes(medium::NUM_LOWER..medium::NUM_MEDIUM)
                || tc.medium_bytes(false) > medium::CONTENDED_MEDIUM_BUDGET
                || tc.medium_bytes(true) > tc.upper_budget.get()
            {
                return Err(CheckError {
                    what: "thread cache's medium or upper byte count is off or over its budget",
                    at: None,
                });
            }
            for m in 0..medium::NUM_MEDIUM {
                let mut ok = true;
                tc.walk_medium(m, |p| {
                    ok &= self.medium.is(m, p)
                        && self.bfc.usable_size(p) == Ok(medium::class_size(m));
                });
                if !ok {
                    return Err(CheckError {
                        what: "thread cache holds a block that is not a live medium block of its \
                               class",
                        at: None,
                    });
                }
                if tc.medium_count(m) > tcache::most_medium(m) || tc.has_duplicate_medium(m) {
                    return Err(CheckError {
                        what: "thread cache stack overfull or holding a block twice",
                        at: None,
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
        // SAFETY: `alloc` has no requirement beyond a valid layout; a zero size gets a block of the
        // smallest class that meets the alignment (or an engine block above 4 KiB alignment).
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
mod tests;
