//! Per-thread caches of small blocks (`std` builds).
//!
//! Each thread has one [`ThreadCache`]: for every small size class, a LIFO list of free blocks linked
//! through their first word. An allocation or free that the list can serve touches only the thread's
//! own cache and the block: no lock, no atomic read-modify-write, no shared cache line. The heap lock
//! is taken only to move a batch of blocks between the cache and the slab layer:
//!
//! - an empty list is refilled with half its capacity;
//! - a full list gives half its blocks back, each checked by the slab layer (live, an object start,
//!   of the list's class), so a block that was freed twice or with the wrong layout is reported there;
//! - a thread's whole cache goes back when the thread exits;
//! - [`GlobalBfc::flush_thread_cache`](super::GlobalBfc::flush_thread_cache) empties it on demand.
//!
//! **Cross-thread frees** need no protocol: a block freed by another thread simply joins that thread's
//! cache (as in tcmalloc), and every list only ever holds blocks of its own class. The slab layer, not
//! the cache, remembers which span a block belongs to.
//!
//! **Bounds.** A class's list holds at most [`bin_capacity`] blocks (about 16 KiB of blocks, at least
//! 8 and at most 256 of them), so one thread caches at most [`MAX_CACHED_BYTES`] (460 KiB).
//!
//! **Double frees.** A cached block carries a per-process key in its second word. A free that finds
//! the key searches the thread's list for the block (a double free there aborts) and otherwise
//! defers to the slab layer under the lock, which aborts if the block is not live. A block freed twice
//! into two different threads' caches is only caught when one of them is flushed.
//!
//! **Binding.** A cache serves one allocator instance: the first one that allocates a small block on
//! the thread, identified by a process-unique id (never an address, which a dropped instance's
//! successor could reuse). Other instances take the locked path on that thread. Every bound cache is
//! on its instance's registry (under the heap lock), which is how `stats()` subtracts cached blocks and
//! how dropping an instance marks its caches orphaned, after which they forget their blocks and may bind
//! again. Thread exit and instance drop serialise on one process-wide lock, so an exiting thread never
//! flushes into an instance that is being dropped.
//!
//! The list heads are `Cell`s (the owner thread alone reads and writes them). The counts are atomics
//! written only by the owner (a plain store, not a read-modify-write) so `stats()` may read them from
//! any thread.

use core::cell::Cell;

use super::small::{class_size, NUM_CLASSES, SPAN};
use crate::sync::{AtomicBool, AtomicUsize, Ordering};
/// The counts are statistics: written by the owner with plain stores and summed by `stats()`; no
/// ordering is relied on, so loom need not model them (modelling them would make every cached
/// block a scheduling point).
use core::sync::atomic::{AtomicU32, Ordering as CountOrdering};

/// `owner` before the cache binds to an instance.
pub(crate) const UNBOUND: usize = usize::MAX;
/// `owner` while binding (the exit hook's registration may allocate; those calls take the lock).
pub(crate) const BINDING: usize = usize::MAX - 1;
/// `owner` once the thread's exit flush ran: the cache is never used again.
pub(crate) const DEAD: usize = usize::MAX - 2;

/// Target bytes of blocks in one class's list.
const BIN_BYTES: usize = 16 << 10;

/// Most blocks class `c`'s list holds: about [`BIN_BYTES`] of them, between 8 and 256.
#[inline(always)]
pub(crate) const fn bin_capacity(c: usize) -> usize {
    let n = BIN_BYTES / class_size(c);
    if n < 8 {
        8
    } else if n > 256 {
        256
    } else {
        n
    }
}

/// Most bytes one thread's cache holds (the sum of every class's capacity times its size).
pub const MAX_CACHED_BYTES: usize = {
    let mut sum = 0;
    let mut c = 0;
    while c < NUM_CLASSES {
        sum += bin_capacity(c) * class_size(c);
        c += 1;
    }
    sum
};

/// Blocks moved per refill or flush.
#[inline(always)]
pub(crate) const fn batch(c: usize) -> usize {
    bin_capacity(c) / 2
}

/// The key stored in a cached block's second word: an address that varies with ASLR, scrambled.
#[inline(always)]
fn key() -> usize {
    static ANCHOR: u8 = 0;
    (&ANCHOR as *const u8 as usize).rotate_left(23) ^ 0x5bd1_e995_2f0a_3c6d_u64 as usize
}

struct Bin {
    /// First free block (0 for none); each block's first word holds the next.
    head: Cell<usize>,
    /// Blocks on the list (written by the owner thread only).
    count: AtomicU32,
}

impl Bin {
    const fn new() -> Self {
        Bin {
            head: Cell::new(0),
            count: AtomicU32::new(0),
        }
    }

    #[inline(always)]
    fn count(&self) -> usize {
        self.count.load(CountOrdering::Relaxed) as usize
    }

    #[inline(always)]
    fn set_count(&self, n: usize) {
        self.count.store(n as u32, CountOrdering::Relaxed);
    }
}

/// What a free into the cache did.
pub(crate) enum Push {
    /// The block is on the list.
    Done,
    /// Take the slow path: the list is full, or the block is not plainly a small block of the
    /// instance, or it carries the cache key without being on this list.
    Slow,
}

/// One thread's cache. See the module docs.
pub(crate) struct ThreadCache {
    /// Id of the bound instance, or [`UNBOUND`] / [`BINDING`] / [`DEAD`].
    pub(crate) owner: Cell<usize>,
    /// The bound instance (`*const GlobalBfc`), for the exit flush.
    pub(crate) instance: Cell<usize>,
    /// The bound instance's arena.
    pub(crate) arena: Cell<usize>,
    pub(crate) arena_len: Cell<usize>,
    /// Set (under the process-wide bindings lock) when the bound instance was dropped.
    pub(crate) orphaned: AtomicBool,
    /// Registry links (addresses of other caches bound to the same instance), under its heap lock.
    pub(crate) prev: AtomicUsize,
    pub(crate) next: AtomicUsize,
    bins: [Bin; NUM_CLASSES],
}

impl ThreadCache {
    #[cfg(not(loom))]
    pub(crate) const fn new() -> Self {
        ThreadCache {
            owner: Cell::new(UNBOUND),
            instance: Cell::new(0),
            arena: Cell::new(0),
            arena_len: Cell::new(0),
            orphaned: AtomicBool::new(false),
            prev: AtomicUsize::new(0),
            next: AtomicUsize::new(0),
            bins: [const { Bin::new() }; NUM_CLASSES],
        }
    }

    #[cfg(loom)]
    pub(crate) fn new() -> Self {
        ThreadCache {
            owner: Cell::new(UNBOUND),
            instance: Cell::new(0),
            arena: Cell::new(0),
            arena_len: Cell::new(0),
            orphaned: AtomicBool::new(false),
            prev: AtomicUsize::new(0),
            next: AtomicUsize::new(0),
            bins: core::array::from_fn(|_| Bin::new()),
        }
    }

    /// Whether `owner` names an instance (not one of the sentinels).
    #[inline]
    pub(crate) fn is_bound(&self) -> bool {
        self.owner.get() < DEAD
    }

    /// Pops a block of class `c` (owner thread only).
    #[inline(always)]
    pub(crate) fn pop(&self, c: usize) -> Option<usize> {
        let bin = &self.bins[c];
        let head = bin.head.get();
        if head == 0 {
            return None;
        }
        // SAFETY: blocks on the list are free blocks of at least 16 bytes that the cache owns; the
        // first word links the list and the second holds the key, cleared so the caller's data
        // cannot carry it by accident.
        unsafe {
            bin.head.set(*(head as *const usize));
            *(head as *mut usize).add(1) = 0;
        }
        bin.set_count(bin.count() - 1);
        Some(head)
    }

    /// Pushes a block the caller frees, unless the slow path must see it (owner thread only).
    ///
    /// # Safety
    /// `p` was allocated by the bound instance with a layout of class `c`, and is not used again.
    #[inline(always)]
    pub(crate) unsafe fn push(&self, c: usize, p: usize) -> Push {
        let bin = &self.bins[c];
        let n = bin.count();
        if n >= bin_capacity(c) || !self.plausible(c, p) {
            return Push::Slow;
        }
        let key = key();
        // SAFETY: `p` is an object start of class `c` (at least 16 bytes) in the arena, freed by the
        // caller (see the contract).
        if unsafe { *(p as *const usize).add(1) } == key {
            return Push::Slow;
        }
        // SAFETY: as above; the block now belongs to the cache.
        unsafe { self.link(bin, p, key) };
        bin.set_count(n + 1);
        Push::Done
    }

    /// Whether `p` could be a class `c` object of the bound instance: inside its arena, at an object
    /// start of that class. (Whether it is live is checked when it leaves the cache.)
    #[inline(always)]
    pub(crate) fn plausible(&self, c: usize, p: usize) -> bool {
        let offset = p.wrapping_sub(self.arena.get());
        offset < self.arena_len.get() && super::small::is_object_start(offset & (SPAN - 1), c)
    }

    /// # Safety
    /// `p` is a free block of at least 16 bytes that the cache now owns.
    #[inline(always)]
    unsafe fn link(&self, bin: &Bin, p: usize, key: usize) {
        // SAFETY: see the contract.
        unsafe {
            *(p as *mut usize) = bin.head.get();
            *(p as *mut usize).add(1) = key;
        }
        bin.head.set(p);
    }

    /// Adds a block without checks (a refill from the slab layer, or a slow-path free that was
    /// checked under the lock).
    ///
    /// # Safety
    /// `p` is a free block of class `c` that the cache now owns.
    pub(crate) unsafe fn fill(&self, c: usize, p: usize) {
        let bin = &self.bins[c];
        // SAFETY: see the contract.
        unsafe { self.link(bin, p, key()) };
        bin.set_count(bin.count() + 1);
    }

    /// Calls `f` on the blocks of class `c`'s list (owner thread only; stops after one more block
    /// than the capacity, so a corrupted, cyclic list still ends).
    pub(crate) fn walk(&self, c: usize, mut f: impl FnMut(usize)) {
        let mut cur = self.bins[c].head.get();
        let mut steps = 0;
        while cur != 0 && steps <= bin_capacity(c) {
            f(cur);
            // SAFETY: list blocks are owned by the cache; their first word is the link.
            cur = unsafe { *(cur as *const usize) };
            steps += 1;
        }
    }

    /// Whether `p` is on class `c`'s list (owner thread only).
    pub(crate) fn contains(&self, c: usize, p: usize) -> bool {
        let mut found = false;
        self.walk(c, |q| found |= q == p);
        found
    }

    /// Whether `p` carries the cache key in its second word.
    ///
    /// # Safety
    /// `p` is a block of at least 16 bytes the caller may read.
    pub(crate) unsafe fn has_key(p: usize) -> bool {
        // SAFETY: see the contract.
        unsafe { *(p as *const usize).add(1) == key() }
    }

    /// Blocks on class `c`'s list (any thread).
    #[inline]
    pub(crate) fn count(&self, c: usize) -> usize {
        self.bins[c].count()
    }

    /// `(bytes, blocks)` held (any thread: reads the counts only).
    pub(crate) fn held(&self) -> (usize, usize) {
        let mut bytes = 0;
        let mut blocks = 0;
        for (c, bin) in self.bins.iter().enumerate() {
            let n = bin.count();
            bytes += n * class_size(c);
            blocks += n;
        }
        (bytes, blocks)
    }

    /// Forgets every block (their instance is gone) and unbinds.
    pub(crate) fn forget(&self) {
        for bin in &self.bins {
            bin.head.set(0);
            bin.set_count(0);
        }
        self.owner.set(UNBOUND);
        self.orphaned.store(false, Ordering::Relaxed);
    }
}

#[cfg(not(loom))]
std::thread_local! {
    static CACHE: ThreadCache = const { ThreadCache::new() };
    /// Flushes the thread's cache when the thread exits (registered on first binding).
    static EXIT: ExitFlush = const { ExitFlush };
}

#[cfg(loom)]
loom::thread_local! {
    static CACHE: ThreadCache = ThreadCache::new();
}

/// Runs `f` on this thread's cache; `None` if it is gone (the thread is exiting).
#[inline(always)]
pub(crate) fn with<R>(f: impl FnOnce(&ThreadCache) -> R) -> Option<R> {
    CACHE.try_with(f).ok()
}

/// Makes sure the cache is flushed when the thread exits. Returns `false` if it cannot be (the
/// thread is already exiting). May allocate (the runtime's destructor list).
pub(crate) fn register_exit_flush() -> bool {
    #[cfg(not(loom))]
    return EXIT.try_with(|_| ()).is_ok();
    #[cfg(loom)]
    return true;
}

#[cfg(not(loom))]
struct ExitFlush;

#[cfg(not(loom))]
impl Drop for ExitFlush {
    fn drop(&mut self) {
        let _ = CACHE.try_with(super::on_thread_exit);
    }
}

/// Loom build: runs this thread's exit flush now. Loom drops a thread's locals after `join` has
/// already returned, possibly after the model's execution state is gone, so the models end each
/// thread with this call instead of relying on the destructor.
#[cfg(loom)]
pub fn exit_thread() {
    let _ = CACHE.try_with(super::on_thread_exit);
}

/// A loom model thread that ends with its cache still registered would leave a dangling registry
/// entry: fail loudly instead.
#[cfg(loom)]
impl Drop for ThreadCache {
    fn drop(&mut self) {
        if !std::thread::panicking() && self.is_bound() && !self.orphaned.load(Ordering::Relaxed) {
            panic!("a loom model thread ended without calling bfc_alloc::host::loom_exit_thread()");
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn capacities_follow_the_documented_bounds() {
        for c in 0..NUM_CLASSES {
            let n = bin_capacity(c);
            assert!((8..=256).contains(&n), "class {c}: {n}");
            assert!(n * class_size(c) <= BIN_BYTES.max(8 * class_size(c)));
            assert!(batch(c) >= 4);
        }
        // The figure the module docs and the README quote.
        assert_eq!(MAX_CACHED_BYTES.div_ceil(1024), 460);
    }
}
