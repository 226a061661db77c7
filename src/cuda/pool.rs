//! The pool: the engine behind a mutex, plus the frees still pending on their streams.

use core::ptr::NonNull;
use std::boxed::Box;
use std::collections::VecDeque;
use std::sync::PoisonError;

use crate::sync::{Arc, AtomicUsize, Mutex, MutexGuard, Ordering};
use std::vec::Vec;

use super::backend::{DeviceBackend, UsesError};
use super::buffer::DeviceBuffer;
use super::error::{DeviceOom, DeviceStats, PoolError};
use super::source::DeviceSource;
use crate::core::{AllocError, Bfc, CheckError, Chunk, Config, OomReport};

/// Allocation unit of the device pool (TensorFlow's 256 bytes).
pub const GRANULE: usize = 256;

/// Deferred errors kept at most (older ones are dropped).
const MAX_DEFERRED: usize = 64;

/// Events kept for reuse by a back end at most.
pub(crate) const EVENT_CACHE: usize = 256;

/// Pending blocks of its own stream an allocation looks through at most, newest first.
const TAKE_SCAN: usize = 256;

/// Attempts to take the pool's lock by spinning (with exponential backoff, 1 to 64 pauses each)
/// before a thread parks on it.
#[cfg(not(loom))]
const LOCK_SPINS: u32 = 40;

/// Emptied block lists and batch queues kept for reuse, at most, of each.
const SPARES: usize = 16;

/// Streams' queues a poll on an allocation or a free looks at, at most, in turn from where the
/// last one stopped: each stream's oldest unfinished event is a query to the driver, and with a
/// thousand busy streams, querying them all took every call on the pool's lock hundreds of
/// microseconds. A trim, and an allocation that finds no free chunk for its request before it
/// grows the pool, look at every queue.
const POLL_QUEUES: usize = 4;

/// Stream queues kept while some are empty, at most: with more, the poll of an allocation or a
/// free drops the empty ones (and their stream handles), as do a trim, a synchronisation, an
/// out-of-memory wait and the pool's drop. Up to this many, a stream whose pending blocks were all
/// taken or came back keeps its queue, so that threads allocating and freeing on their own streams
/// at once do not drop and re-create each other's queues.
const KEPT_QUEUES: usize = 16;

/// Stream caches of a pool (a power of two, at most the alignment of [`Shared`]): each thread
/// takes one (see [`thread_cache`]), and its allocations on streams the back end can compare (see
/// [`DeviceBackend::same_stream`]), and the frees of those buffers, go through that cache under
/// its lock instead of the pool's. Fewer under loom, to keep its models small.
const STREAM_CACHES: usize = if cfg!(loom) { 2 } else { 64 };

/// Blocks a stream cache holds at most (of all its streams); a free that finds it full goes to the
/// pool's lock, and its block to its stream's queue or, if the oldest cached block is stale (see
/// [`STALE_FREES`]), in that one's place. One under loom, so that its models (two threads sharing
/// a cache) make frees find the cache full.
const STREAM_CACHE_BLOCKS: usize = if cfg!(loom) { 1 } else { 16 };

/// A cached block is stale once this many frees came for its cache after it (four cachefuls): a
/// free that finds the cache full takes the place of the oldest block only if that one is stale,
/// and otherwise goes to its stream's queue. So a cache full of blocks its threads no longer ask
/// for (of a stream they left, of sizes they no longer use, or of a thread that exited) empties
/// as they go on freeing, while a thread that cycles through more blocks than the cache holds
/// keeps hitting on those it has. One under loom, so that its models evict.
const STALE_FREES: u64 = if cfg!(loom) {
    1
} else {
    4 * STREAM_CACHE_BLOCKS as u64
};

/// Batch queues with room for more than this many batches are not kept for reuse.
const SPARE_BATCHES_CAPACITY: usize = 16;

/// Block lists with room for more than this are not kept for reuse (a batch is usually at most
/// [`OPEN_LIMIT`] + 1 blocks).
const SPARE_BLOCKS_CAPACITY: usize = 64;

/// How much device memory a pool may take.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MemoryLimit {
    /// TensorFlow's default: the memory free when the pool is created, minus a reserve for the
    /// system (see [`min_system_memory`]).
    Auto,
    /// A fraction of the device's total memory (TensorFlow's `per_process_gpu_memory_fraction`),
    /// in `(0, 1]`.
    Fraction(f64),
    /// An absolute number of bytes (TensorFlow's `memory_limit_mb`, in bytes).
    Bytes(usize),
}

/// Options of a [`DevicePool`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PoolOptions {
    /// Grow by regions that start at `initial_region_size` and double (`true`, the default here), or
    /// take one region of the whole limit on first use (`false`, TensorFlow's default).
    pub allow_growth: bool,
    /// First region size when growing (default 2 MiB).
    pub initial_region_size: usize,
    /// The cap on memory obtained from the driver (padding of over-aligned regions included).
    pub limit: MemoryLimit,
    /// Capacity of the chunk table, in chunk records of 32 bytes of host memory each (default 2^18;
    /// from 2 to `u32::MAX - 1`, and the table must be allocatable: `PoolError::Config` otherwise).
    /// The table is zero-filled memory from the global allocator, so its pages become resident only
    /// as records are used, where the allocator hands out fresh pages for a large zeroed request
    /// without writing them (as glibc does unless `MALLOC_PERTURB_` is set, and as this crate's
    /// host allocator does).
    pub chunk_capacity: usize,
}

impl Default for PoolOptions {
    fn default() -> Self {
        PoolOptions {
            allow_growth: true,
            initial_region_size: 2 << 20,
            limit: MemoryLimit::Auto,
            chunk_capacity: 1 << 18,
        }
    }
}

impl PoolOptions {
    /// The defaults with an absolute limit.
    pub fn with_limit(bytes: usize) -> Self {
        PoolOptions {
            limit: MemoryLimit::Bytes(bytes),
            ..PoolOptions::default()
        }
    }

    /// The pool's limit on a device with `free` and `total` bytes and compute capability `cc_major`.
    pub fn resolve_limit(
        &self,
        free: usize,
        total: usize,
        cc_major: i32,
    ) -> Result<usize, PoolError> {
        let bytes = match self.limit {
            MemoryLimit::Auto => free.saturating_sub(min_system_memory(free, cc_major)),
            MemoryLimit::Fraction(f) => {
                if !(f > 0.0 && f <= 1.0) {
                    return Err(PoolError::Config("memory fraction must be in (0, 1]"));
                }
                (total as f64 * f) as usize
            }
            MemoryLimit::Bytes(b) => b,
        };
        Ok(bytes & !(GRANULE - 1))
    }
}

/// Device memory TensorFlow leaves to the system when no limit is given, for `available` free bytes
/// on a device of compute capability `cc_major`: 225 MiB below 2 GiB available; otherwise 500 MiB up
/// to capability 6, 1050 MiB for 7, 1536 MiB for 8 and 1800 MiB from 9 on.
pub fn min_system_memory(available: usize, cc_major: i32) -> usize {
    const MIB: usize = 1 << 20;
    if available < (1 << 31) {
        225 * MIB
    } else if cc_major <= 6 {
        500 * MIB
    } else if cc_major <= 7 {
        1050 * MIB
    } else if cc_major <= 8 {
        1536 * MIB
    } else {
        1800 * MIB
    }
}

/// Blocks of one stream that wait in its queue, freed without an event, for that stream to reuse
/// them; the free of one more closes them all: they go back to the engine if the stream is idle,
/// otherwise one event is recorded for all of them (see the [module documentation](super)).
/// Blocks in a stream cache (16 at most per cache) do not count until a drain of the caches moves
/// them to the queue (which then closes a stream left with more).
pub const OPEN_LIMIT: usize = 32;

/// How a batch of pending blocks is ordered after the work queued before their frees on their
/// stream.
enum Order<E> {
    /// No event yet: only its own stream may take them (stream order protects them). The stream's
    /// open and unordered blocks are closed together (see [`State::close`]) when the stream
    /// misses, when another stream misses and the engine has no free chunk for it, when the stream
    /// has more than [`OPEN_LIMIT`] of them, and on trim, synchronisation, out-of-memory and pool
    /// drop.
    Open,
    /// An event recorded on the stream after the frees.
    Event(E),
    /// Recording the event failed: the next close of the stream (or a device-wide
    /// synchronisation) orders them.
    Unordered,
}

/// Blocks freed on one stream and closed together (or still open), sharing one [`Order`].
struct Batch<E> {
    order: Order<E>,
    /// `(address, size)`, in no particular order.
    blocks: Vec<(usize, usize)>,
}

/// The blocks freed on one stream whose work may still be running, in batches, oldest first.
/// Invariants: no batch is empty (except transiently inside a method); the batches with an event
/// come first (events of one stream complete in order), the open and unordered ones after them.
struct Queue<S, E> {
    /// Kept alive while blocks are pending (and, once they are all taken or back, until the queue
    /// is dropped: see [`State::queues`]), so that an event can still be recorded on it, and the id
    /// of a stream the pool's handles own cannot be reused by a new stream meanwhile.
    stream: S,
    batches: VecDeque<Batch<E>>,
}

impl<S, E> Queue<S, E> {
    /// Blocks in the batches without an event (a suffix: usually one batch).
    fn open(&self) -> usize {
        self.batches
            .iter()
            .rev()
            .take_while(|b| !matches!(b.order, Order::Event(_)))
            .map(|b| b.blocks.len())
            .sum()
    }
}

/// Emptied block lists and batch queues, kept so that a stream that frees a buffer and allocates
/// it again (a pool hit) allocates no host memory for its pending list.
struct Spares<E> {
    blocks: Vec<Vec<(usize, usize)>>,
    batches: Vec<VecDeque<Batch<E>>>,
}

impl<E> Spares<E> {
    /// A block list (a spare one if there is one) holding only `block`.
    fn blocks_with(&mut self, block: (usize, usize)) -> Vec<(usize, usize)> {
        let mut v = self.blocks.pop().unwrap_or_default();
        v.push(block);
        v
    }

    /// Keeps an emptied (or to be emptied) block list for reuse.
    fn put_blocks(&mut self, mut v: Vec<(usize, usize)>) {
        if self.blocks.len() < SPARES && v.capacity() <= SPARE_BLOCKS_CAPACITY {
            v.clear();
            self.blocks.push(v);
        }
    }

    /// An empty batch queue.
    fn batches(&mut self) -> VecDeque<Batch<E>> {
        self.batches.pop().unwrap_or_default()
    }

    /// Keeps an emptied batch queue for reuse.
    fn put_batches(&mut self, q: VecDeque<Batch<E>>) {
        debug_assert!(q.is_empty());
        if self.batches.len() < SPARES && (1..=SPARE_BATCHES_CAPACITY).contains(&q.capacity()) {
            self.batches.push(q);
        }
    }
}

/// A block freed on its stream and not yet ordered (open, as in [`Order::Open`]), in a stream
/// cache.
struct Cached<S> {
    /// [`DeviceBackend::stream_id`] of `stream`.
    sid: u64,
    ptr: usize,
    size: usize,
    /// The freeing buffer's handle: keeps the stream (and so its id) alive while the block waits.
    stream: S,
    /// The cache's [`frees`](StreamCache::frees) when the block came in.
    stamp: u64,
}

/// One stream cache: open blocks (of any streams the back end can compare) that buffers allocated
/// by its threads left when they were freed, oldest first, and the count of those threads' live
/// buffers. Its lock is taken on its own (an allocation by one of its threads, or a free of one
/// of their buffers) or inside the pool's lock (which moves the blocks to their streams' queues),
/// never the other way round.
struct StreamCache<B: DeviceBackend> {
    blocks: Vec<Cached<B::Stream>>,
    /// Allocations this cache served.
    hits: u64,
    /// Frees of its buffers that were for this cache (cache-eligible), counted as they come: how
    /// old a cached block is (see [`STALE_FREES`]).
    frees: u64,
    /// Live buffers allocated by this cache's threads (see [`PoolRef`]).
    buffers: usize,
    /// The pool, kept alive for those buffers: taken by the first buffer's allocation, and dropped
    /// when there are no buffers and no pool handles, by whichever of the last buffer's free or the
    /// last handle's drop comes second. (One reference per cache, not per buffer: threads that
    /// allocate and free on their own streams then write no shared counter.)
    pool: Option<Arc<Shared<B>>>,
}

impl<B: DeviceBackend> StreamCache<B> {
    /// Counts a free for this cache and makes its block, stamped with the count.
    fn stamped(&mut self, sid: u64, ptr: u64, size: usize, stream: B::Stream) -> Cached<B::Stream> {
        self.frees += 1;
        Cached {
            sid,
            ptr: ptr as usize,
            size,
            stream,
            stamp: self.frees,
        }
    }
}

/// A stream cache's block for an allocation ([`Shared::take_cached`]): address, size, the buffer's
/// handle, and the handle the block's free left if the buffer does not keep it.
type CacheHit<S> = (usize, usize, S, Option<S>);

/// Ends one buffer's count in its stream cache when dropped, and lets the pool go if that was its
/// last reference.
struct CountEnd<'a, B: DeviceBackend> {
    cache: &'a Mutex<StreamCache<B>>,
    /// The pool's [`Shared::handles`].
    handles: &'a AtomicUsize,
}

impl<B: DeviceBackend> Drop for CountEnd<'_, B> {
    fn drop(&mut self) {
        // (The lock guard goes at the end of its scope, not through `drop(c)`: passed by value,
        // its reference to the cache would be a protected function argument while another thread,
        // which may take the lock as soon as it is released, frees the cache (a Stacked Borrows
        // violation). For the same reason no `CountEnd` is passed by value, except to
        // `mem::forget` while the count still holds.)
        let kept = {
            let mut c = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
            uncount(&mut c, self.handles)
        };
        // (Possibly the pool's last reference, which frees the cache this guard refers to: it is
        // not used again.)
        drop(kept);
    }
}

/// One buffer's count in stream cache `c` ends; returns the pool reference to drop, after `c`'s
/// lock is released, if the count was the cache's last and the pool has no handle (`handles`).
fn uncount<B: DeviceBackend>(
    c: &mut StreamCache<B>,
    handles: &AtomicUsize,
) -> Option<Arc<Shared<B>>> {
    c.buffers -= 1;
    if c.buffers == 0 && handles.load(Ordering::Acquire) == 0 {
        c.pool.take()
    } else {
        None
    }
}

/// A stream cache on cache lines of its own.
#[repr(align(128))]
struct Padded<T>(T);

/// A pool's stream caches.
type Caches<B> = Box<[Padded<Mutex<StreamCache<B>>>]>;

/// The stream cache of the calling thread, the same in every pool: a thread takes the first cache
/// no live thread holds on its first allocation, and gives it back when it exits, so up to
/// [`STREAM_CACHES`] threads alive at once each have their own, whichever streams they use (with
/// more, the others share, in turn). Caches picked by a hash of the stream left two of 8 threads on
/// their own streams sharing a cache about one run in three, and all the threads on one stream
/// sharing one; caches handed out in turn for good, the 65th thread ever shared the first's.
#[cfg(not(loom))]
fn thread_cache() -> usize {
    use core::cell::Cell;
    use core::sync::atomic::{AtomicU64, AtomicUsize as Counter, Ordering::*};
    const _: () = assert!(STREAM_CACHES == 64, "one bit of `TAKEN` per cache");
    /// Caches held by live threads, a bit each.
    static TAKEN: AtomicU64 = AtomicU64::new(0);
    /// Turns among the shared caches, when every one is taken.
    static NEXT: Counter = Counter::new(0);
    /// The thread's cache (`usize::MAX`: none yet); from [`STREAM_CACHES`] on, a shared one
    /// (`index + STREAM_CACHES`), which is not given back, and which the thread leaves for a cache
    /// of its own once one is free.
    struct Held(Cell<usize>);
    impl Drop for Held {
        fn drop(&mut self) {
            let i = self.0.get();
            if i < STREAM_CACHES {
                TAKEN.fetch_and(!(1 << i), Release);
            }
        }
    }
    std::thread_local! {
        static CACHE: Held = const { Held(Cell::new(usize::MAX)) };
    }
    /// A cache no live thread holds, now taken, if there is one.
    fn take_free() -> Option<usize> {
        let mut taken = TAKEN.load(Relaxed);
        while taken != u64::MAX {
            let i = (!taken).trailing_zeros() as usize;
            match TAKEN.compare_exchange_weak(taken, taken | 1 << i, Acquire, Relaxed) {
                Ok(_) => return Some(i),
                Err(now) => taken = now,
            }
        }
        None
    }
    // (0 while the thread's locals are being destroyed.)
    CACHE
        .try_with(|c| {
            let held = c.0.get();
            if held == usize::MAX {
                c.0.set(
                    take_free().unwrap_or_else(|| {
                        STREAM_CACHES + NEXT.fetch_add(1, Relaxed) % STREAM_CACHES
                    }),
                );
            } else if held >= STREAM_CACHES && TAKEN.load(Relaxed) != u64::MAX {
                // A shared cache, and a thread has given one back since: take it, so that up to
                // `STREAM_CACHES` threads alive at once each have their own. (Buffers keep the
                // cache they were counted in; blocks left in the shared one stay for its other
                // threads, or a drain.)
                if let Some(i) = take_free() {
                    c.0.set(i);
                }
            }
            c.0.get() % STREAM_CACHES
        })
        .unwrap_or(0)
}

/// Loom build: from the model thread's number (deterministic in every execution), so that the
/// main thread has a cache and the first two spawned threads share the other: the models run
/// threads in one cache at once, and frees into another thread's cache.
#[cfg(loom)]
fn thread_cache() -> usize {
    let id = std::format!("{:?}", loom::thread::current().id());
    let n = id.trim_start_matches("ThreadId(").trim_end_matches(')');
    n.parse::<usize>()
        .map_or(0, |n| n.div_ceil(2) % STREAM_CACHES)
}

/// Whether a pending block of `size` bytes at `ptr` serves `want` bytes (granules) at `align` as a
/// whole block would: aligned, large enough, and not so large that the engine would split it.
fn fits_whole(config: &Config, ptr: usize, size: usize, want: usize, align: usize) -> bool {
    if size < want || ptr % align != 0 {
        return false;
    }
    let left = size - want;
    let would_split = left >= GRANULE
        && ((config.split_ratio != 0 && size / config.split_ratio >= want)
            || left >= config.max_internal_fragmentation);
    !would_split
}

/// The pending block to hand out for `bytes` at `align`, among `blocks` given newest first as
/// `(key, address, size)`: the smallest that serves the request whole (see [`fits_whole`]), the
/// newest among equals; an exact fit ends the search. `None` also when `bytes` overflows once
/// rounded to the granule.
fn best_fit<K>(
    config: &Config,
    bytes: usize,
    align: usize,
    blocks: impl Iterator<Item = (K, usize, usize)>,
) -> Option<K> {
    let want = bytes.max(1).checked_next_multiple_of(GRANULE)?;
    let mut best: Option<(K, usize)> = None;
    for (key, ptr, size) in blocks {
        if fits_whole(config, ptr, size, want, align)
            && best.as_ref().is_none_or(|&(_, s)| size < s)
        {
            best = Some((key, size));
            if size == want {
                break;
            }
        }
    }
    best.map(|(key, _)| key)
}

/// Moves every cached block in `caches` to its stream's queue in `st` as an open block, oldest
/// first, then closes the streams left with more than [`OPEN_LIMIT`] open blocks, as a free into
/// the queue would. Returns whether it closed any. With `moved`, adds to it the id of each stream
/// it moved blocks of (once). The caller holds the pool's lock (`st`).
fn drain<B: DeviceBackend>(
    caches: &Caches<B>,
    st: &mut State<B>,
    mut moved: Option<&mut Vec<u64>>,
) -> bool {
    let mut over = false;
    for cache in caches {
        let mut c = cache.0.lock().unwrap_or_else(PoisonError::into_inner);
        // (One at a time, oldest first: the cache keeps its capacity, and a panic in the back end
        // leaves the blocks not yet moved where they are.)
        while !c.blocks.is_empty() {
            let b = c.blocks.remove(0);
            if let Some(moved) = moved.as_deref_mut() {
                if !moved.contains(&b.sid) {
                    moved.push(b.sid);
                }
            }
            let (open, unkept) = st.push_open(b.stream, b.ptr, b.size);
            over |= open > OPEN_LIMIT;
            // Not the stream's last owning handle: the cached block's stream was accepted, and
            // accepted streams with one id are one stream, so the handle the queue keeps is of
            // the same stream (or the dropped one is a borrowed stream's, whose drop destroys
            // nothing; if the kept one is borrowed, its owner keeps the stream alive). It may be
            // the last handle of its context object (CUDA's null stream through a second
            // `CudaContext` of the pool's driver context): that drop releases a retain of the
            // context, which the pool's own context object also holds, so nothing is destroyed.
            drop(unkept);
        }
    }
    // (After the caches' locks: closing calls the driver.)
    over && st.close_over_limit()
}

/// Everything behind the pool's lock.
pub(crate) struct State<B: DeviceBackend> {
    /// The engine (about 8 KiB: boxed, so that building a pool moves a pointer, not the engine).
    bfc: Box<Bfc<DeviceSource<B>, Box<[Chunk]>>>,
    /// Freed blocks waiting for their stream, one queue per stream with any. Invariants: each block
    /// is in use in `bfc`; a queue is empty only once its blocks were taken or came back: the next
    /// free on its stream fills it again, and a trim, a synchronisation, or a poll while there are
    /// more than [`KEPT_QUEUES`] queues drops it.
    queues: Vec<Queue<B::Stream, B::Event>>,
    /// The stream id of each queue, in the same order (looked up on every call without touching
    /// the queues, which other threads' calls write).
    queue_ids: Vec<u64>,
    /// Batches with an event, in all queues (a poll has nothing to query without them).
    event_batches: usize,
    /// Queues without a batch (a poll with more than [`KEPT_QUEUES`] queues has nothing to drop
    /// without them, and need not look through them all).
    empty_queues: usize,
    /// The queue the next poll looks at first (see [`POLL_QUEUES`]).
    poll_cursor: usize,
    spares: Spares<B::Event>,
    /// Events of batches that left their queues, for the back end to take back. One that a
    /// stream's own allocation emptied waits here until the next poll: while the allocation holds
    /// the block it took, the pool calls no back end (which may panic, and the block would be lost
    /// with it).
    retired: Vec<B::Event>,
    /// Blocks freed while the driver could neither order nor wait for their uses: kept in use in
    /// the engine forever.
    stranded_bytes: usize,
    /// Allocations served from a stream's pending blocks (the engine does not see them).
    reuses: u64,
    /// Errors that happened where none could be returned (in `Drop`), oldest first.
    errors: Vec<PoolError>,
}

/// A buffer's reference to its pool, and the stream cache it is counted in (in the address's low
/// bits, which [`Shared`]'s alignment leaves zero). Not a reference count of its own, which each
/// allocation and free, in every thread, would write: the buffer is counted in the stream cache of
/// the thread that allocated it (see [`StreamCache::buffers`]), which holds the pool while it
/// counts any buffer. Invariant: the buffer is counted from its allocation until its drop, whose
/// last step ends the count ([`Shared::free_block`]).
pub(crate) struct PoolRef<B: DeviceBackend>(NonNull<Shared<B>>);

// SAFETY: a `PoolRef` stands for an `Arc<Shared<B>>` (the one its stream cache holds) and is used
// as one: shared access to the pool, from whichever thread holds the buffer.
unsafe impl<B: DeviceBackend> Send for PoolRef<B> where Arc<Shared<B>>: Send {}
// SAFETY: as for `Send`.
unsafe impl<B: DeviceBackend> Sync for PoolRef<B> where Arc<Shared<B>>: Sync {}

impl<B: DeviceBackend> PoolRef<B> {
    /// The reference of a buffer that [`Shared::alloc_block`] just counted in `shared`'s stream
    /// cache `cache`.
    fn counted(shared: &Arc<Shared<B>>, cache: usize) -> Self {
        const { assert!(core::mem::align_of::<Shared<B>>() >= STREAM_CACHES) };
        debug_assert!(cache < STREAM_CACHES);
        // (From the `Arc`, not from a reference: `handle` turns it back into one.)
        let p = NonNull::new(Arc::as_ptr(shared).cast_mut()).expect("an Arc is not null");
        PoolRef(p.map_addr(|a| a | cache))
    }

    /// The stream cache the buffer is counted in.
    pub(crate) fn cache(&self) -> usize {
        self.0.addr().get() & (STREAM_CACHES - 1)
    }

    /// The address of the pool, for [`Shared::free_block`].
    pub(crate) fn as_ptr(&self) -> NonNull<Shared<B>> {
        // (The pool's address is a multiple of `STREAM_CACHES`, and not 0.)
        self.0.map_addr(|a| {
            core::num::NonZeroUsize::new(a.get() & !(STREAM_CACHES - 1)).expect("not null")
        })
    }

    /// The pool.
    pub(crate) fn get(&self) -> &Shared<B> {
        // SAFETY: the buffer is counted while this reference can be used (see the type's
        // invariant), and its stream cache holds the pool meanwhile.
        unsafe { self.as_ptr().as_ref() }
    }

    /// A new handle of the pool.
    pub(crate) fn handle(&self) -> DevicePool<B> {
        self.get().handles.0.fetch_add(1, Ordering::Relaxed);
        let p = self.as_ptr().as_ptr().cast_const();
        // SAFETY: the pointer came from `Arc::as_ptr` (its tag cleared), and the pool has a strong
        // reference (its stream cache's) while the buffer is counted.
        unsafe {
            Arc::increment_strong_count(p);
            DevicePool {
                shared: Arc::from_raw(p),
            }
        }
    }
}

/// The shared part of a pool; its handles and its buffers' stream caches keep it alive.
pub(crate) struct Shared<B: DeviceBackend> {
    // Immutable after construction.
    ordinal: usize,
    limit: usize,
    /// The engine's configuration (a copy, for the stream caches' fit test).
    config: Config,
    // Mutable, behind the lock (on cache lines of its own: the hits read the fields above).
    state: Padded<Mutex<State<B>>>,
    /// Open blocks of streams the back end can compare, and the count of buffers, each cache behind
    /// a lock of its own (see [`StreamCache`]).
    caches: Caches<B>,
    /// [`DevicePool`] handles (buffers are counted in the stream caches), on a cache line of its
    /// own, which only a handle's creation (a clone, or [`DeviceBuffer::pool`]) and drop write.
    handles: Padded<AtomicUsize>,
    /// The thread running an `inspect_backend` / `with_backend_mut` closure, which holds the lock
    /// (0: none): a call into the pool from inside the closure (a buffer dropped there, say) would
    /// wait for that lock forever, so it panics instead.
    #[cfg(not(loom))]
    in_closure: core::sync::atomic::AtomicUsize,
}

impl<B: DeviceBackend> State<B> {
    fn backend(&mut self) -> &mut B {
        &mut self.bfc.source_mut().backend
    }

    fn defer(&mut self, e: PoolError) {
        if self.errors.len() == MAX_DEFERRED {
            self.errors.remove(0);
        }
        self.errors.push(e);
    }

    /// Moves source free failures into the deferred errors.
    fn collect_source_errors(&mut self) {
        let errs = core::mem::take(&mut self.bfc.source_mut().free_errors);
        for e in errs {
            self.defer(PoolError::Backend(e));
        }
    }

    /// The queue of stream `sid`. Looks through the ids eight at a time, with no early exit
    /// inside a group, which the compiler turns into vector compares: with a thousand streams'
    /// queues, a lookup one at a time was most of a pool hit on the lock.
    fn queue_of(&self, sid: u64) -> Option<usize> {
        const GROUP: usize = 8;
        let mut groups = self.queue_ids.chunks_exact(GROUP);
        for (gi, group) in groups.by_ref().enumerate() {
            if group.iter().fold(false, |found, &id| found | (id == sid)) {
                return group
                    .iter()
                    .position(|&id| id == sid)
                    .map(|i| gi * GROUP + i);
            }
        }
        let rest = groups.remainder();
        let start = self.queue_ids.len() - rest.len();
        rest.iter().position(|&id| id == sid).map(|i| start + i)
    }

    /// Returns a batch's blocks to the engine and recycles its event and its block list.
    fn release_batch(&mut self, batch: Batch<B::Event>) {
        for &(ptr, _) in &batch.blocks {
            if let Err(e) = self.bfc.deallocate(ptr) {
                self.defer(PoolError::Free(e));
            }
        }
        self.recycle(batch.order);
        self.spares.put_blocks(batch.blocks);
    }

    /// Removes queue `qi` (without blocks left) and keeps its batch queue for reuse.
    fn remove_queue(&mut self, qi: usize) {
        let q = self.queues.swap_remove(qi);
        self.queue_ids.swap_remove(qi);
        self.spares.put_batches(q.batches);
    }

    /// Retires a batch's order, and hands the back end every retired event (for callers that hold
    /// no block).
    fn recycle(&mut self, order: Order<B::Event>) {
        self.retire(order);
        self.recycle_retired();
    }

    /// Takes the order of a batch that left its queue: its event, if any, waits in
    /// [`State::retired`] until [`recycle_retired`](Self::recycle_retired).
    fn retire(&mut self, order: Order<B::Event>) {
        if let Order::Event(e) = order {
            self.event_batches -= 1;
            self.retired.push(e);
        }
    }

    /// Hands the back end the retired events.
    fn recycle_retired(&mut self) {
        while let Some(e) = self.retired.pop() {
            self.backend().recycle_event(e);
        }
    }

    /// Drops the queues left without blocks (and so their stream handles).
    fn drop_empty_queues(&mut self) {
        let mut qi = 0;
        while qi < self.queues.len() {
            if self.queues[qi].batches.is_empty() {
                // (Uncounted before the queue's stream handle is dropped, which may panic.)
                self.empty_queues -= 1;
                self.remove_queue(qi);
            } else {
                qi += 1;
            }
        }
        debug_assert_eq!(self.empty_queues, 0, "the count of empty queues");
        self.empty_queues = 0;
    }

    /// Adds the block at `ptr` (of `size` bytes), freed on `stream`, to its stream's open blocks.
    /// Returns how many open (and unordered) blocks the stream has now, and a handle the pool did
    /// not keep, for the caller to drop once it has released the lock (dropping a stream's last
    /// handle destroys the stream).
    fn push_open(
        &mut self,
        stream: B::Stream,
        ptr: usize,
        size: usize,
    ) -> (usize, Option<B::Stream>) {
        let sid = B::stream_id(&stream);
        let (qi, unkept) = match self.queue_of(sid) {
            // A kept empty queue may hold the handle of a stream that has gone since (a borrowed
            // one, destroyed once nothing of it was pending) and whose id this stream now has: the
            // queue takes this stream's handle while its blocks are pending.
            Some(qi) if self.queues[qi].batches.is_empty() => {
                self.empty_queues -= 1;
                (
                    qi,
                    Some(core::mem::replace(&mut self.queues[qi].stream, stream)),
                )
            }
            Some(qi) => (qi, Some(stream)),
            None => {
                let batches = self.spares.batches();
                self.queues.push(Queue { stream, batches });
                self.queue_ids.push(sid);
                (self.queues.len() - 1, None)
            }
        };
        let q = &mut self.queues[qi];
        match q.batches.back_mut() {
            Some(b) if matches!(b.order, Order::Open) => b.blocks.push((ptr, size)),
            _ => q.batches.push_back(Batch {
                order: Order::Open,
                blocks: self.spares.blocks_with((ptr, size)),
            }),
        }
        (q.open(), unkept)
    }

    /// Pending blocks and their bytes (for statistics and reports).
    fn pending(&self) -> (usize, usize) {
        let blocks = self
            .queues
            .iter()
            .flat_map(|q| &q.batches)
            .flat_map(|b| &b.blocks);
        blocks.fold((0, 0), |(n, bytes), &(_, size)| (n + 1, bytes + size))
    }

    /// Orders stream `sid`'s open (and unordered) blocks. If the stream is idle, all the work
    /// queued before their frees is done and every pending block of the stream goes back to the
    /// engine; otherwise one event is recorded for all of them. Returns whether it had any.
    fn close(&mut self, sid: u64) -> bool {
        let Some(qi) = self.queue_of(sid) else {
            return false;
        };
        if self.queues[qi].open() == 0 {
            return false;
        }
        let stream = self.queues[qi].stream.clone();
        match self.backend().stream_done(&stream) {
            Ok(true) => {
                while let Some(b) = self.queues[qi].batches.pop_front() {
                    // (Counted before the back end recycles retired events, which may panic.)
                    if self.queues[qi].batches.is_empty() {
                        self.empty_queues += 1;
                    }
                    self.release_batch(b);
                }
                self.empty_queues -= 1;
                self.remove_queue(qi);
                return true;
            }
            Ok(false) => {}
            Err(e) => self.defer(PoolError::Backend(e)),
        }
        let order = match self.backend().record_event(&stream) {
            Ok(e) => {
                self.event_batches += 1;
                Order::Event(e)
            }
            Err(e) => {
                self.defer(PoolError::Backend(e));
                Order::Unordered
            }
        };
        // An event recorded now also covers the unordered blocks freed before it: one batch.
        let mut blocks = self.spares.blocks.pop().unwrap_or_default();
        let q = &mut self.queues[qi];
        blocks.reserve(q.open());
        while q
            .batches
            .back()
            .is_some_and(|b| !matches!(b.order, Order::Event(_)))
        {
            if let Some(b) = q.batches.pop_back() {
                blocks.extend_from_slice(&b.blocks);
                self.spares.put_blocks(b.blocks);
            }
        }
        q.batches.push_back(Batch { order, blocks });
        true
    }

    /// Closes the open and unordered blocks of every stream with one that `pick(stream_id, size)`
    /// selects; returns whether any stream had some.
    fn close_where(&mut self, pick: impl Fn(u64, usize) -> bool) -> bool {
        let sids: Vec<u64> = self
            .queues
            .iter()
            .zip(&self.queue_ids)
            .filter(|&(q, &sid)| {
                q.batches
                    .iter()
                    .filter(|b| !matches!(b.order, Order::Event(_)))
                    .any(|b| b.blocks.iter().any(|&(_, size)| pick(sid, size)))
            })
            .map(|(_, &sid)| sid)
            .collect();
        let mut closed = false;
        for sid in sids {
            closed |= self.close(sid);
        }
        closed
    }

    /// Closes the open and unordered blocks of every stream with more than [`OPEN_LIMIT`] of them
    /// (a drain of the stream caches may leave some so); returns whether it closed any.
    fn close_over_limit(&mut self) -> bool {
        let mut closed = false;
        let mut qi = 0;
        while qi < self.queues.len() {
            let sid = self.queue_ids[qi];
            if self.queues[qi].open() > OPEN_LIMIT {
                closed |= self.close(sid);
                if self.queue_ids.get(qi) != Some(&sid) {
                    // Its stream was idle: the queue went, and the last one took its place.
                    continue;
                }
            }
            qi += 1;
        }
        closed
    }

    /// Closes the open and unordered blocks of every stream.
    fn close_all(&mut self) {
        self.close_where(|_, _| true);
    }

    /// Returns pending batches whose event has completed to the engine, looking at up to
    /// [`POLL_QUEUES`] streams' queues, in turn from where the last poll stopped (see
    /// [`poll`](Self::poll)).
    fn poll_pending(&mut self) {
        self.poll(POLL_QUEUES);
    }

    /// Returns every pending batch whose event has completed to the engine.
    fn poll_all(&mut self) {
        self.poll(usize::MAX);
    }

    /// Returns the pending batches whose event has completed, in up to `most` queues from the
    /// cursor on, to the engine. Events of one stream complete in order, so each stream is
    /// queried until its first unfinished event. Drops the empty queues if there are more than
    /// [`KEPT_QUEUES`].
    fn poll(&mut self, most: usize) {
        self.recycle_retired();
        debug_assert_eq!(
            self.empty_queues,
            self.queues.iter().filter(|q| q.batches.is_empty()).count(),
            "the count of empty queues"
        );
        if self.queues.len() > KEPT_QUEUES && self.empty_queues > 0 {
            self.drop_empty_queues();
        }
        debug_assert_eq!(
            self.event_batches,
            self.queues
                .iter()
                .flat_map(|q| &q.batches)
                .filter(|b| matches!(b.order, Order::Event(_)))
                .count(),
            "the count of batches with an event"
        );
        if self.event_batches == 0 {
            return;
        }
        let n = self.queues.len();
        let walk = most.min(n);
        let start = if walk == n { 0 } else { self.poll_cursor % n };
        self.poll_cursor = (start + walk) % n.max(1);
        // (Releasing batches moves no queue.)
        for qi in (start..n).chain(0..start).take(walk) {
            // Only a batch with an event can be done (open and unordered ones come last).
            while let Some(Batch {
                order: Order::Event(ev),
                ..
            }) = self.queues[qi].batches.front()
            {
                match self.bfc.source_mut().backend.event_done(ev) {
                    Ok(true) => {}
                    Ok(false) => break,
                    Err(e) => {
                        self.defer(PoolError::Backend(e));
                        break;
                    }
                }
                if let Some(b) = self.queues[qi].batches.pop_front() {
                    // (Counted before the back end recycles the batch's event, which may panic.)
                    if self.queues[qi].batches.is_empty() {
                        self.empty_queues += 1;
                    }
                    self.release_batch(b);
                }
            }
        }
    }

    /// Waits for every pending block's work and returns them all to the engine. A block whose work
    /// cannot be waited for (the driver fails both the event and a device-wide synchronisation) stays
    /// pending.
    fn flush_pending(&mut self) {
        self.recycle_retired();
        if self.queues.is_empty() {
            return;
        }
        self.close_all();
        let mut device_synced = false;
        let unordered = self.queues.iter().any(|q| {
            q.batches
                .iter()
                .any(|b| matches!(b.order, Order::Unordered))
        });
        if unordered {
            match self.backend().synchronize() {
                Ok(()) => device_synced = true,
                Err(e) => self.defer(PoolError::Backend(e)),
            }
        }
        for qi in 0..self.queues.len() {
            self.flush_queue(qi, &mut device_synced);
        }
        if device_synced {
            // (A synchronisation part-way also covers the queues before it.)
            for qi in 0..self.queues.len() {
                self.flush_queue(qi, &mut device_synced);
            }
        }
        self.drop_empty_queues();
    }

    /// Waits for the work of queue `qi`'s batches (unless the device was synchronised) and
    /// returns those whose work is done to the engine. The back end is called for every batch
    /// before any leaves the queue, and batches leave it one at a time, so a back end that panics
    /// leaves every batch it did not return pending, in the queue's order.
    fn flush_queue(&mut self, qi: usize, device_synced: &mut bool) {
        let n = self.queues[qi].batches.len();
        let mut done = Vec::with_capacity(if *device_synced { 0 } else { n });
        for bi in 0..n {
            if *device_synced {
                break;
            }
            let waited = match &self.queues[qi].batches[bi].order {
                Order::Event(ev) => self.bfc.source_mut().backend.event_sync(ev).map(|()| true),
                Order::Open | Order::Unordered => Ok(false),
            };
            let ok = waited.unwrap_or_else(|e| {
                self.defer(PoolError::Backend(e));
                match self.backend().synchronize() {
                    Ok(()) => {
                        *device_synced = true;
                        true
                    }
                    Err(e) => {
                        self.defer(PoolError::Backend(e));
                        false
                    }
                }
            });
            done.push(ok);
        }
        // From the back, so that the indices below stay put.
        for bi in (0..n).rev() {
            if *device_synced || done[bi] {
                if let Some(b) = self.queues[qi].batches.remove(bi) {
                    // (Counted before the back end recycles the batch's event, which may panic.)
                    if self.queues[qi].batches.is_empty() {
                        self.empty_queues += 1;
                    }
                    self.release_batch(b);
                }
            }
        }
    }

    /// Where [`take_pending`](Self::take_pending) would find its block: (queue, batch, index).
    fn find_pending(
        &self,
        stream: u64,
        bytes: usize,
        align: usize,
    ) -> Option<(usize, usize, usize)> {
        let qi = self.queue_of(stream)?;
        // Keyed by (batch, index in it).
        let newest_first = self.queues[qi]
            .batches
            .iter()
            .enumerate()
            .rev()
            .flat_map(|(bi, b)| {
                let blocks = b.blocks.iter().enumerate().rev();
                blocks.map(move |(i, &(ptr, size))| ((bi, i), ptr, size))
            });
        let (bi, i) = best_fit(
            self.bfc.config(),
            bytes,
            align,
            newest_first.take(TAKE_SCAN),
        )?;
        Some((qi, bi, i))
    }

    /// Takes a pending block of `stream` that fits `bytes` at `align` as a whole block would (the
    /// engine would not split it): the smallest among the stream's [`TAKE_SCAN`] most recently
    /// freed pending blocks (an exact fit ends the search), so a stream with thousands of pending
    /// frees pays a bounded scan. Calls no back end: the event of a batch it empties waits in
    /// [`State::retired`].
    fn take_pending(&mut self, stream: u64, bytes: usize, align: usize) -> Option<(usize, usize)> {
        let (qi, bi, i) = self.find_pending(stream, bytes, align)?;
        let q = &mut self.queues[qi];
        let b = &mut q.batches[bi];
        let (ptr, size) = b.blocks.swap_remove(i);
        if b.blocks.is_empty() {
            let removed = q.batches.remove(bi);
            if q.batches.is_empty() {
                self.empty_queues += 1;
            }
            if let Some(b) = removed {
                self.retire(b.order);
                self.spares.put_blocks(b.blocks);
            }
            // A queue left empty stays (see `State::queues`): a stream that frees the buffer it
            // just got (a pool hit, alloc and free in turn) keeps its queue.
        }
        Some((ptr, size))
    }

    #[allow(
        clippy::result_large_err,
        reason = "the engine's report; the pool boxes it before it leaves"
    )]
    fn allocate(&mut self, bytes: usize, align: usize) -> Result<(usize, usize), AllocError> {
        let b = self.bfc.allocate_block(bytes, align)?;
        Ok((b.ptr, b.size))
    }

    fn oom(&mut self, ordinal: usize, requested: usize, report: OomReport) -> PoolError {
        let (device_free, device_total) = self.backend().mem_info().unwrap_or((0, 0));
        let s = report.stats;
        PoolError::OutOfMemory(Box::new(DeviceOom {
            ordinal,
            requested,
            in_use: s.bytes_in_use,
            reserved: s.bytes_reserved,
            limit: s.bytes_limit,
            device_total,
            device_free,
            largest_free_block: s.largest_free_block,
            pending_bytes: self.pending().1,
            stranded_bytes: self.stranded_bytes,
            driver_error: self
                .bfc
                .source_mut()
                .last_refusal
                .take()
                .map(|e| std::format!("{e}")),
            report,
        }))
    }
}

impl<B: DeviceBackend> Shared<B> {
    fn lock(&self) -> MutexGuard<'_, State<B>> {
        // A panic while the lock was held (in a back end) leaves the engine consistent: every
        // engine operation completes before the back end is called again.
        //
        // Most holds are a few hundred nanoseconds (a hit, a free), so a waiter spins for the lock
        // (with backoff: about 2,200 pause instructions, some microseconds) before it parks:
        // parked waiters make every unlock a futex wake, and with several threads allocating at
        // once the handoffs, not the work, took the time (8 threads: 16 us per alloc+free per
        // thread, against 0.16 us for one). A hold that waits for the driver (an out-of-memory
        // flush, a synchronisation) still parks its waiters.
        #[cfg(not(loom))]
        for spin in 0..LOCK_SPINS {
            if spin == LOCK_SPINS / 2 {
                self.check_reentry();
            }
            match self.state.0.try_lock() {
                Ok(guard) => return guard,
                Err(std::sync::TryLockError::Poisoned(e)) => return e.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => {
                    for _ in 0..1u32 << spin.min(6) {
                        core::hint::spin_loop();
                    }
                }
            }
        }
        self.state.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Panics if the calling thread runs a closure of `inspect_backend` / `with_backend_mut` of
    /// this pool (it holds the lock this thread is about to wait for).
    #[cfg(not(loom))]
    #[cold]
    fn check_reentry(&self) {
        use core::sync::atomic::Ordering::Relaxed;
        // Only this thread stores its own id, so seeing it means this thread holds the lock.
        if self.in_closure.load(Relaxed) == crate::lock::thread_id() {
            panic!(
                "bfc-alloc: the device pool was used from inside its own inspect_backend or \
                 with_backend_mut closure (which holds the pool's lock)"
            );
        }
    }

    /// Runs `f` on the back end under the lock, noting this thread as inside the closure.
    pub(crate) fn with_backend<R>(&self, f: impl FnOnce(&mut B) -> R) -> R {
        let mut st = self.lock();
        #[cfg(not(loom))]
        let _mark = {
            use core::sync::atomic::Ordering::Relaxed;
            /// Clears the mark when the closure returns or unwinds (before the lock is released).
            struct Mark<'a>(&'a core::sync::atomic::AtomicUsize);
            impl Drop for Mark<'_> {
                fn drop(&mut self) {
                    self.0.store(0, Relaxed);
                }
            }
            self.in_closure.store(crate::lock::thread_id(), Relaxed);
            Mark(&self.in_closure)
        };
        f(st.backend())
    }

    /// Stream cache `index`.
    fn cache(&self, index: usize) -> &Mutex<StreamCache<B>> {
        &self.caches[index].0
    }

    /// A block of stream `sid`'s cache `c` that serves `bytes` at `align` as a whole block would
    /// (the smallest, the newest among equals): `(address, size, the buffer's handle, the handle
    /// its free left if the buffer does not keep that one)`, for the caller to drop once the
    /// buffer exists. The buffer keeps the handle the free left if it is the caller's (a clone of
    /// it), and otherwise a clone of the caller's, made before the block leaves the cache: so a
    /// handle that panics, cloned or compared, leaves the block cached, and one that panics
    /// dropped, unwinds through a buffer that frees it. `None` for a stream the back end cannot
    /// compare.
    fn take_cached(
        &self,
        c: &mut StreamCache<B>,
        stream: &B::Stream,
        sid: u64,
        bytes: usize,
        align: usize,
    ) -> Option<CacheHit<B::Stream>> {
        if !B::same_stream(stream, stream) {
            return None;
        }
        let own = c.blocks.iter().enumerate().rev();
        let own = own.filter(|(_, b)| b.sid == sid && B::same_stream(&b.stream, stream));
        let i = best_fit(
            &self.config,
            bytes,
            align,
            own.map(|(i, b)| (i, b.ptr, b.size)),
        )?;
        // The buffer takes the caller's handle, not the one the free left, which may be another
        // handle of the same stream (a borrowed wrapper of an owned stream, say): a buffer keeps
        // the handle it was allocated on, and nothing the pool holds outlives a synchronisation.
        let mine = (!B::same_handle(&c.blocks[i].stream, stream)).then(|| stream.clone());
        let b = c.blocks.remove(i);
        c.hits += 1;
        Some(match mine {
            Some(mine) => (b.ptr, b.size, mine, Some(b.stream)),
            None => (b.ptr, b.size, b.stream, None),
        })
    }

    /// Allocates a block of at least `bytes` for use on `stream`: `(address, usable size, the
    /// buffer's handle of `stream`, the buffer's reference to the pool, a handle for the caller to
    /// drop once it has made the buffer)`, and counts the buffer in the calling thread's stream
    /// cache (see [`PoolRef`]).
    #[allow(
        clippy::type_complexity,
        reason = "the parts of a buffer, which its caller makes"
    )]
    pub(crate) fn alloc_block(
        this: &Arc<Self>,
        stream: &B::Stream,
        bytes: usize,
        align: usize,
    ) -> Result<(u64, usize, B::Stream, PoolRef<B>, Option<B::Stream>), PoolError> {
        let sid = B::stream_id(stream);
        let align = align.max(1);
        let index = thread_cache();
        let cache = this.cache(index);
        let hit = {
            let mut c = cache.lock().unwrap_or_else(PoisonError::into_inner);
            // A cached block freed on the same stream (`same_stream`) was allocated on it, so the
            // stream passed `check_stream` then.
            let hit = this.take_cached(&mut c, stream, sid, bytes, align);
            // (Counted after the back end's calls above, which may panic.)
            c.buffers += 1;
            if c.pool.is_none() {
                c.pool = Some(Arc::clone(this));
            }
            hit
        };
        // Unless a buffer is made (a failure, or a panic), the count ends.
        let counted = CountEnd {
            cache,
            handles: &this.handles.0,
        };
        let (p, size, handle, leftover) = match hit {
            Some((p, size, handle, leftover)) => (p as u64, size, handle, leftover),
            None => {
                let handle = stream.clone();
                let (p, size) = this.alloc_locked(stream, sid, bytes, align)?;
                (p, size, handle, None)
            }
        };
        core::mem::forget(counted);
        Ok((p, size, handle, PoolRef::counted(this, index), leftover))
    }

    /// [`alloc_block`](Self::alloc_block) past the calling thread's stream cache, under the pool's
    /// lock. (None of the stream's blocks in that cache serves the request: they stay there for
    /// the requests they fit. A cache full of sizes the thread no longer asks for empties as its
    /// frees take their places, see [`free_locked`](Self::free_locked).)
    fn alloc_locked(
        &self,
        stream: &B::Stream,
        sid: u64,
        bytes: usize,
        align: usize,
    ) -> Result<(u64, usize), PoolError> {
        let mut st = self.lock();
        st.backend().check_stream(stream)?;
        st.poll_pending();
        if let Some((p, size)) = st.take_pending(sid, bytes, align) {
            st.reuses += 1;
            return Ok((p as u64, size));
        }
        // A miss: this stream's open blocks do not fit, so start their way back to the engine. If
        // the engine has no free chunk for the request either, do the same for other streams'
        // open blocks that could serve it, rather than grow.
        let mut closed = st.close(sid);
        // (A free chunk serves the request for sure only with room for its alignment's padding
        // too: one of `bytes` that is misaligned for it does not, and the engine would grow.)
        let granule = self.config.granule;
        let room = bytes
            .max(1)
            .checked_next_multiple_of(granule)
            .and_then(|r| r.checked_add(align.max(granule) - granule));
        let engine_full = room.is_none_or(|room| st.bfc.largest_free_block() < room);
        if engine_full {
            let mut moved = Vec::new();
            closed |= drain(&self.caches, &mut st, Some(&mut moved));
            // Other threads' caches may have held this stream's blocks: they are its own, with no
            // wait.
            let found = st.find_pending(sid, bytes, align);
            // This stream's open blocks besides the one that serves the request: with none, a
            // close would record an event for nothing.
            let others_open = found.map_or(0, |(qi, bi, _)| {
                let q = &st.queues[qi];
                q.open() - usize::from(!matches!(q.batches[bi].order, Order::Event(_)))
            });
            // Then the streams of the blocks that came out of the caches (this one's too, if
            // more of its blocks than the one that serves the request are open), at once where the
            // stream is idle: a miss leaves its cache alone, so blocks its thread no longer asks
            // for wait there for a full engine. If this stream's own blocks do not serve the
            // request, also other streams' open blocks that could. (Before the take: the closes
            // call the back end, which may panic, and a block in hand would be lost with it. A
            // close keeps this stream's blocks in its queue, or returns them all to the engine if
            // the stream is idle: either way they serve the request.)
            closed |= st.close_where(|other, size| {
                if other == sid {
                    moved.contains(&sid) && (found.is_none() || others_open > 0)
                } else {
                    moved.contains(&other) || (found.is_none() && size >= bytes)
                }
            });
            if found.is_some() {
                if let Some((p, size)) = st.take_pending(sid, bytes, align) {
                    st.reuses += 1;
                    return Ok((p as u64, size));
                }
            }
        }
        if engine_full {
            // Before the pool grows: every stream's completed batches.
            st.poll_all();
        } else if closed {
            st.poll_pending();
        }
        let r = st.allocate(bytes, align);
        if matches!(r, Err(AllocError::OutOfMemory(_))) {
            // (Out of memory is rare: other streams' cached blocks join the wait below.)
            drain(&self.caches, &mut st, None);
        }
        let r = match r {
            // (With nothing pending, nothing can come back: the driver was asked already.)
            Err(AllocError::OutOfMemory(_)) if st.pending().0 > 0 => {
                // Wait for every pending free and try once more: the blocks that came back serve
                // the request if they can, and otherwise the engine gives its fully free regions
                // back before it grows (so a freed region is reused, not returned and requested).
                st.flush_pending();
                let r = st.allocate(bytes, align);
                st.collect_source_errors();
                r
            }
            r => r,
        };
        st.collect_source_errors();
        match r {
            Ok((p, size)) => {
                st.bfc.source_mut().last_refusal = None;
                Ok((p as u64, size))
            }
            Err(AllocError::OutOfMemory(report)) => Err(st.oom(self.ordinal, bytes, report)),
            Err(e) => Err(PoolError::InvalidRequest {
                bytes,
                align,
                reason: match e {
                    AllocError::BadAlignment { .. } => {
                        "the alignment is not a power of two, or above what the pool serves"
                    }
                    AllocError::TooLarge { .. } => "the size overflows once rounded",
                    // (The pool asks for no bound; any other refusal is named as such.)
                    _ => "refused by the engine",
                },
            }),
        }
    }

    /// Frees the block at `ptr` (of `size` bytes) used on `stream`, whose handle it takes (the
    /// buffer's), and ends the buffer's count in stream cache `index`, which may let the pool go.
    /// The block goes to that cache if it can (the allocating thread's, which is likely to want it
    /// again), whichever thread frees it. Never fails; errors are deferred.
    ///
    /// # Safety
    ///
    /// `this` points to a live pool in which the buffer of this block is counted, in cache `index`
    /// (it was allocated on `stream`, and this is its only free), and the caller does not use
    /// `this` afterwards: this call may drop the pool.
    pub(crate) unsafe fn free_block(
        this: NonNull<Self>,
        index: usize,
        ptr: u64,
        size: usize,
        stream: B::Stream,
        uses: &B::Uses,
    ) {
        // SAFETY: the buffer's count keeps the pool alive until the end of the count below. Only
        // references to the cache and the handle count (both atomics or behind a lock) live
        // across that point, and neither is used after it.
        let (cache, handles) = unsafe {
            let shared = this.as_ref();
            (shared.cache(index), &shared.handles.0)
        };
        // The count ends last, even if the free panics (a back end's panic, in any of its calls
        // below, loses the block, not the pool).
        let count_end = CountEnd { cache, handles };
        let sid = B::stream_id(&stream);
        // The cache the block would have gone to, had it had room.
        let mut full_cache = None;
        let stream = if B::same_stream(&stream, &stream) && B::uses_none(uses) {
            let cached = {
                let mut c = cache.lock().unwrap_or_else(PoisonError::into_inner);
                if c.blocks.len() < STREAM_CACHE_BLOCKS {
                    let block = c.stamped(sid, ptr, size, stream);
                    c.blocks.push(block);
                    // (The count ends here, under the lock already held.)
                    core::mem::forget(count_end);
                    Ok(uncount(&mut c, handles))
                } else {
                    Err(stream)
                }
            };
            match cached {
                Ok(kept) => {
                    // (Possibly the pool's last reference.)
                    drop(kept);
                    return;
                }
                Err(stream) => {
                    full_cache = Some(index);
                    stream
                }
            }
        } else {
            stream
        };
        // SAFETY: as above, the buffer is still counted.
        unsafe { this.as_ref() }.free_locked(full_cache, sid, ptr, size, stream, uses);
    }

    /// [`free_block`](Self::free_block) past its stream cache, under the pool's lock (the buffer
    /// is still counted). With `full_cache` (the stream cache the block was for, which had no
    /// room), the block takes the place of the cache's oldest if that one is stale, which goes to
    /// its stream's queue instead (see [`STALE_FREES`]): so a thread that moved on to another
    /// stream, or took the cache of a thread that exited, does not find it full of blocks it will
    /// not ask for, with every free and every allocation of its stream on the pool's lock from
    /// then on.
    fn free_locked(
        &self,
        full_cache: Option<usize>,
        sid: u64,
        ptr: u64,
        size: usize,
        stream: B::Stream,
        uses: &B::Uses,
    ) {
        let mut st = self.lock();
        match st.backend().finish_uses(&stream, uses) {
            Ok(()) => {}
            Err(UsesError::Unordered(e)) => {
                st.defer(PoolError::Backend(e));
                // The buffer's uses on other streams are not ordered before anything queued on its
                // stream from now on: wait for the whole device instead.
                if let Err(e) = st.backend().synchronize() {
                    st.defer(PoolError::Backend(e));
                    // Nothing says when those uses end: never hand the block out again.
                    st.stranded_bytes += size;
                    return;
                }
            }
            Err(UsesError::Unbounded(e)) => {
                st.defer(PoolError::Backend(e));
                st.stranded_bytes += size;
                return;
            }
        }
        let (sid, ptr, size, stream) = match full_cache {
            Some(index) => {
                let mut c = self
                    .cache(index)
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                let block = c.stamped(sid, ptr, size, stream);
                if c.blocks.len() < STREAM_CACHE_BLOCKS {
                    // (It had room again.)
                    c.blocks.push(block);
                    drop(c);
                    st.poll_pending();
                    return;
                }
                if c.frees - c.blocks[0].stamp < STALE_FREES {
                    // The cached blocks are recent: this one goes to the queue.
                    (block.sid, block.ptr, block.size, block.stream)
                } else {
                    let old = c.blocks.remove(0);
                    c.blocks.push(block);
                    (old.sid, old.ptr, old.size, old.stream)
                }
            }
            None => (sid, ptr as usize, size, stream),
        };
        // No event yet: the stream itself may reuse the block at once, and an event is recorded
        // for a batch of open blocks only when another stream may want them (see `Order::Open`).
        let (open, unkept) = st.push_open(stream, ptr, size);
        if open > OPEN_LIMIT {
            st.close(sid);
        }
        st.poll_pending();
        // A handle the pool did not keep goes without the lock: dropping a stream's last handle
        // destroys the stream. (On the early returns above, `stream` itself, a parameter, is
        // dropped after the guard.)
        drop(st);
        drop(unkept);
    }
}

impl<B: DeviceBackend> Drop for Shared<B> {
    fn drop(&mut self) {
        // No buffer is left (each is counted in a stream cache, which holds an `Arc` of this while
        // it counts any), so after the pending frees every chunk is free and every region goes
        // back to the driver.
        let st = self
            .state
            .0
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        drain(&self.caches, st, None);
        st.flush_pending();
        st.bfc.release_free_regions();
    }
}

/// A chunk table of `n` empty records in zero-filled memory, so that its pages stay untouched (not
/// resident) until records are used. `None` if the host cannot allocate it.
fn zeroed_table(n: usize) -> Option<Box<[Chunk]>> {
    let layout = std::alloc::Layout::array::<Chunk>(n).ok()?;
    if layout.size() == 0 {
        return Some(Box::new([]));
    }
    // SAFETY: the layout has a non-zero size.
    let p = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<Chunk>();
    if p.is_null() {
        return None;
    }
    // SAFETY: `p` is a fresh allocation from the global allocator with the layout of `n` records,
    // zero-filled, and all-zero bytes are a valid (empty) `Chunk` (see `Chunk::EMPTY`); the box
    // frees it with the same layout.
    Some(unsafe { Box::from_raw(core::ptr::slice_from_raw_parts_mut(p, n)) })
}

/// A BFC pool over one device's memory. Cheap to clone (a shared handle); `Send + Sync`.
///
/// See the [module documentation](super) for the stream model.
pub struct DevicePool<B: DeviceBackend = super::CudaBackend> {
    pub(crate) shared: Arc<Shared<B>>,
}

impl<B: DeviceBackend> Clone for DevicePool<B> {
    fn clone(&self) -> Self {
        self.shared.handles.0.fetch_add(1, Ordering::Relaxed);
        DevicePool {
            shared: self.shared.clone(),
        }
    }
}

impl<B: DeviceBackend> Drop for DevicePool<B> {
    fn drop(&mut self) {
        if self.shared.handles.0.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        // The last handle: the stream caches without buffers let the pool go (those with buffers
        // do when their last buffer is freed; see `uncount`). A buffer's free that comes later
        // finds no handle, under the same cache's lock.
        for cache in &self.shared.caches {
            let kept = {
                let mut c = cache.0.lock().unwrap_or_else(PoisonError::into_inner);
                if c.buffers == 0 {
                    c.pool.take()
                } else {
                    None
                }
            };
            // (Not the last reference: this handle's own goes after the loop.)
            drop(kept);
        }
    }
}

impl<B: DeviceBackend> core::fmt::Debug for DevicePool<B> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("DevicePool")
            .field("ordinal", &self.shared.ordinal)
            .field("limit", &self.shared.limit)
            .finish_non_exhaustive()
    }
}

impl<B: DeviceBackend> DevicePool<B> {
    /// A pool over `backend`. Nothing is allocated until the first buffer.
    pub fn with_backend(mut backend: B, options: PoolOptions) -> Result<Self, PoolError> {
        if !(2..u32::MAX as usize).contains(&options.chunk_capacity) {
            return Err(PoolError::Config(
                "chunk_capacity must be from 2 to u32::MAX - 1",
            ));
        }
        let (free, total) = backend.mem_info()?;
        let cc_major = match options.limit {
            MemoryLimit::Auto => backend.compute_capability_major()?,
            _ => 0,
        };
        let limit = options.resolve_limit(free, total, cc_major)?;
        let mut config = Config::device(limit);
        config.allow_growth = options.allow_growth;
        config.initial_region_size = if options.allow_growth {
            options.initial_region_size
        } else {
            limit
        };
        let ordinal = backend.ordinal();
        // (Fallibly: a capacity the host cannot hold is an error, not an abort.)
        let table = zeroed_table(options.chunk_capacity).ok_or(PoolError::Config(
            "chunk_capacity: no host memory for the chunk table",
        ))?;
        let bfc = Box::new(
            Bfc::new(config, DeviceSource::new(backend, limit), table)
                .map_err(PoolError::Config)?,
        );
        let caches = (0..STREAM_CACHES)
            .map(|_| {
                Padded(Mutex::new(StreamCache {
                    blocks: Vec::with_capacity(STREAM_CACHE_BLOCKS),
                    hits: 0,
                    frees: 0,
                    buffers: 0,
                    pool: None,
                }))
            })
            .collect();
        Ok(DevicePool {
            shared: Arc::new(Shared {
                ordinal,
                limit,
                config: *bfc.config(),
                caches,
                state: Padded(Mutex::new(State {
                    bfc,
                    queues: Vec::new(),
                    queue_ids: Vec::new(),
                    event_batches: 0,
                    empty_queues: 0,
                    poll_cursor: 0,
                    spares: Spares {
                        blocks: Vec::with_capacity(SPARES),
                        batches: Vec::with_capacity(SPARES),
                    },
                    retired: Vec::new(),
                    stranded_bytes: 0,
                    reuses: 0,
                    errors: Vec::new(),
                })),
                handles: Padded(AtomicUsize::new(1)),
                #[cfg(not(loom))]
                in_closure: core::sync::atomic::AtomicUsize::new(0),
            }),
        })
    }

    /// Device index.
    pub fn ordinal(&self) -> usize {
        self.shared.ordinal
    }

    /// The cap on memory obtained from the driver.
    pub fn limit(&self) -> usize {
        self.shared.limit
    }

    /// A buffer of `len` values of `T` for use on `stream`, with unspecified contents.
    ///
    /// Tries, in order: a block freed earlier on the same `stream` (no waiting), the pool's free
    /// chunks (after closing `stream`'s pending blocks, and other streams' that could serve the
    /// request if no free chunk can), growth from the driver; then waits for all pending frees and
    /// tries again (the returned blocks, or growth after fully free regions went back).
    ///
    /// # Errors
    ///
    /// - [`PoolError::OutOfMemory`] when no memory can be found within the pool's limit, even after
    ///   waiting for every pending free;
    /// - [`PoolError::InvalidRequest`] when `len * size_of::<T>()` overflows, or `T`'s alignment
    ///   cannot be met;
    /// - [`PoolError::Backend`] when `stream` belongs to another context than the pool's, or is a
    ///   per-thread default stream, or when a driver call fails.
    ///
    /// # Safety
    ///
    /// The contents are whatever the memory held before (possibly another buffer's data, or bits
    /// that are not a valid `T`): write it before reading it as `T`.
    pub unsafe fn alloc<T>(
        &self,
        stream: &B::Stream,
        len: usize,
    ) -> Result<DeviceBuffer<T, B>, PoolError> {
        let bytes =
            len.checked_mul(core::mem::size_of::<T>())
                .ok_or(PoolError::InvalidRequest {
                    bytes: usize::MAX,
                    align: core::mem::align_of::<T>(),
                    reason: "len * size_of::<T>() overflows",
                })?;
        // (Made first: nothing between the count of the buffer and its making calls the back end's
        // code, which may panic.)
        let uses = B::Uses::default();
        let (ptr, size, handle, pool, leftover) =
            Shared::alloc_block(&self.shared, stream, bytes, core::mem::align_of::<T>())?;
        let buffer = DeviceBuffer::new(ptr, len, size, handle, uses, pool);
        // The handle a cached block's free left, if the buffer took the caller's instead: dropped
        // without any lock, once the buffer exists (a drop that panics frees the buffer). The
        // caller's handle names the same stream, so this is its last owning handle only if the
        // caller's is a borrowed one whose owner is gone, which the borrowed stream's contract
        // rules out.
        drop(leftover);
        Ok(buffer)
    }

    /// Returns to the engine every pending block whose work has finished, without waiting (the
    /// blocks of idle streams, and those whose event has completed; an event is recorded for the
    /// others), then returns every fully free region to the driver (TensorFlow's and PyTorch's
    /// `empty_cache`). Returns the bytes given back. [`synchronize`](Self::synchronize) waits.
    pub fn trim(&self) -> usize {
        let mut st = self.shared.lock();
        drain(&self.shared.caches, &mut st, None);
        st.close_all();
        st.poll_all();
        st.drop_empty_queues();
        let n = st.bfc.release_free_regions();
        st.collect_source_errors();
        n
    }

    /// Same as [`trim`](Self::trim).
    pub fn empty_cache(&self) -> usize {
        self.trim()
    }

    /// Waits for the work of every pending free, returns those blocks to the pool, then trims.
    /// Returns the bytes given back to the driver.
    pub fn synchronize(&self) -> usize {
        let mut st = self.shared.lock();
        drain(&self.shared.caches, &mut st, None);
        st.flush_pending();
        let n = st.bfc.release_free_regions();
        st.collect_source_errors();
        n
    }

    /// Counters: the engine's, pending frees, and the device's memory.
    pub fn stats(&self) -> DeviceStats {
        let mut st = self.shared.lock();
        let mut allocator = st.bfc.stats();
        allocator.num_allocs += st.reuses;
        let (device_free, device_total) = st.backend().mem_info().unwrap_or((0, 0));
        let (mut pending_blocks, mut pending_bytes) = st.pending();
        for cache in &self.shared.caches {
            let c = cache.0.lock().unwrap_or_else(PoisonError::into_inner);
            allocator.num_allocs += c.hits;
            pending_blocks += c.blocks.len();
            pending_bytes += c.blocks.iter().map(|b| b.size).sum::<usize>();
        }
        DeviceStats {
            ordinal: self.shared.ordinal,
            allocator,
            pending_blocks,
            pending_bytes,
            stranded_bytes: st.stranded_bytes,
            device_free,
            device_total,
        }
    }

    /// Takes the errors recorded where none could be returned (while freeing buffers), oldest first.
    ///
    /// The pool keeps the 64 most recent such errors; older ones are dropped as newer ones come.
    /// Errors of the pool's own final drop (when its last handle and buffer go) cannot be taken.
    pub fn take_errors(&self) -> Vec<PoolError> {
        core::mem::take(&mut self.shared.lock().errors)
    }

    /// `Err` with the oldest recorded error still kept (and clears them all), or `Ok` if there were
    /// none. See [`take_errors`](Self::take_errors).
    pub fn check_err(&self) -> Result<(), PoolError> {
        match self.take_errors().into_iter().next() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Runs the engine's invariant checker (for tests and debugging).
    pub fn check(&self) -> Result<(), CheckError> {
        self.shared.lock().bfc.check()
    }

    /// Calls `f` with the back end (under the pool's lock; `f` must not use this pool).
    ///
    /// # Panics
    ///
    /// If `f` calls into this pool in a way that takes its lock (most methods; an allocation or a
    /// drop of one of its buffers unless a stream cache serves it): that would wait for the lock
    /// `f` runs under. A buffer whose drop panics there loses its block: it stays in use in the
    /// engine, and its region is never given back. A second such drop in the same unwind (two
    /// buffers in a `Vec` dropped there, say) panics during a panic, which aborts the process:
    /// move buffers out of `f` to drop them.
    pub fn inspect_backend<R>(&self, f: impl FnOnce(&B) -> R) -> R {
        self.shared.with_backend(|b| f(b))
    }

    /// Calls `f` with the back end, mutably (under the pool's lock; `f` must not use this pool).
    ///
    /// # Safety
    ///
    /// `f` must leave the back end serving this pool: it must not replace it (say with a back end
    /// of another device or context), nor free or reuse memory, streams or events the pool got
    /// from it; it may queue work on a block only as the block's owner may (a live buffer's, on
    /// its home stream, ordered as [`DeviceBuffer::zero`] does). The pool frees its regions
    /// through the back end and trusts its answers.
    ///
    /// # Panics
    ///
    /// If `f` uses this pool, as for [`inspect_backend`](Self::inspect_backend).
    pub unsafe fn with_backend_mut<R>(&self, f: impl FnOnce(&mut B) -> R) -> R {
        self.shared.with_backend(f)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::thread_cache;

    /// A block the engine refuses when its batch goes back (a pool bug: a block returned twice, or
    /// one it never handed out) is not lost in silence: it becomes a deferred error, and the pool
    /// stays consistent. Both a block never handed out and one freed twice.
    #[test]
    fn a_block_the_engine_refuses_when_its_batch_goes_back_is_a_deferred_error() {
        use super::{Batch, DevicePool, Order, PoolError, PoolOptions};
        use crate::core::FreeError;
        use crate::cuda::{SimDevice, SimStream};
        let dev = SimDevice::new(1 << 30);
        let pool =
            DevicePool::with_backend(dev.backend(), PoolOptions::with_limit(64 << 20)).unwrap();
        // SAFETY: simulated memory is never read.
        let (buf, keep) = unsafe {
            (
                pool.alloc::<u8>(&SimStream(1), 4096).unwrap(),
                pool.alloc::<u8>(&SimStream(1), 4096).unwrap(),
            )
        };
        let at = buf.device_address() as usize;
        drop(buf);
        // The block back in the engine (the stream is idle); `keep` keeps the region.
        pool.trim();
        let mut st = pool.shared.lock();
        let never = at + (32 << 20);
        st.release_batch(Batch {
            order: Order::Open,
            blocks: std::vec![(never, 256), (at, 4096)],
        });
        let errors = core::mem::take(&mut st.errors);
        drop(st);
        assert!(
            matches!(
                errors.as_slice(),
                [
                    PoolError::Free(FreeError::NotOwned { ptr: p }),
                    PoolError::Free(FreeError::DoubleFree { ptr: q }),
                ] if *p == never && *q == at
            ),
            "{errors:?}"
        );
        pool.check().unwrap();
        drop(keep);
    }

    /// Serialises the tests that count the stream caches live threads hold (no other test of
    /// this binary takes one).
    fn serial() -> std::sync::MutexGuard<'static, ()> {
        static CACHES: std::sync::Mutex<()> = std::sync::Mutex::new(());
        CACHES
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A thread's stream cache goes back when the thread exits: 200 threads in turn, each alive
    /// with this one, never share its cache (handed out in turn for good, the 64th would).
    #[test]
    fn exited_threads_give_their_stream_caches_back() {
        let _serial = serial();
        let mine = thread_cache();
        for t in 0..200 {
            let theirs = std::thread::spawn(thread_cache).join().unwrap();
            assert_ne!(theirs, mine, "thread {t} shares this thread's stream cache");
        }
        assert_eq!(thread_cache(), mine, "a thread keeps its cache");
    }

    /// A thread that came while every cache was held, and so shares one, takes a cache of its own
    /// once a thread gives one back: with 64 threads alive at once (this one, that thread and 62
    /// fresh ones) no two share a cache, as the documentation says.
    #[test]
    fn exited_threads_caches_go_to_a_thread_that_shares_one() {
        use std::sync::mpsc::channel;
        use std::thread;
        use std::vec::Vec;
        let _serial = serial();
        let mine = thread_cache();
        // A thread that takes its cache, says which, and holds it until told to exit.
        let hold = || {
            let (tx, rx) = channel();
            let (go, wait) = channel::<()>();
            let h = thread::spawn(move || {
                tx.send(thread_cache()).unwrap();
                let _ = wait.recv();
            });
            (rx.recv().unwrap(), go, h)
        };
        // Every cache held: this thread's and 63 others.
        let holders: Vec<_> = (0..63).map(|_| hold()).collect();
        // A thread that comes now shares one; it asks again once the holders have gone.
        let (ask_tx, ask_rx) = channel::<()>();
        let (ans_tx, ans_rx) = channel();
        let late = thread::spawn(move || {
            let _ = thread_cache();
            while ask_rx.recv().is_ok() {
                ans_tx.send(thread_cache()).unwrap();
            }
        });
        for (_, go, h) in holders {
            drop(go);
            h.join().unwrap();
        }
        ask_tx.send(()).unwrap();
        let late_cache = ans_rx.recv().unwrap();
        // 62 fresh threads: with this one and the late one, 64 alive at once.
        let fresh: Vec<_> = (0..62).map(|_| hold()).collect();
        let mut caches: Vec<usize> = fresh.iter().map(|&(c, _, _)| c).collect();
        caches.push(mine);
        caches.push(late_cache);
        caches.sort_unstable();
        caches.dedup();
        assert_eq!(caches.len(), 64, "64 threads alive share stream caches");
        for (_, go, h) in fresh {
            drop(go);
            h.join().unwrap();
        }
        drop(ask_tx);
        late.join().unwrap();
    }
}
