//! Per-thread caches of small blocks (`std` builds).
//!
//! Each thread has one [`ThreadCache`]: for every small size class, a stack of pointers to free
//! blocks, kept in the thread's own storage. An allocation or free that the stack can serve touches
//! only the thread's cache: no lock, no atomic read-modify-write, no shared cache line, and not the
//! block itself (a freed block's memory is never written, so freeing a block that fell out of the CPU
//! cache costs no cache miss). The heap lock is taken only to move a batch of blocks between the cache
//! and the slab layer:
//!
//! - an empty stack is refilled with half its capacity;
//! - a full stack gives half its blocks to the class's transfer cache in the heap (unchecked: the
//!   next refill of the class takes them whole) or, when that is full, back to the slab layer, which
//!   checks each one (live, an object start, of the stack's class), so a block that was freed twice
//!   or with the wrong layout is reported there;
//! - a class the thread stopped using decays: every [`DECAY_PERIOD`] (256) refills and flushes of
//!   the thread's cache, any class that had none of them gives half its blocks back to the slab layer
//!   (checked), so after a phase change a stale stack drains in a few periods and its spans can go
//!   back to the engine for any size (a thread that stops allocating altogether keeps its cache until
//!   it exits or flushes it);
//! - a thread's whole cache goes back when the thread exits;
//! - [`GlobalBfc::flush_thread_cache`](super::GlobalBfc::flush_thread_cache) empties it on demand.
//!
//! **Cross-thread frees** need no protocol: a block freed by another thread simply joins that thread's
//! cache (as in tcmalloc and jemalloc), and every stack only ever holds blocks of its own class. The
//! slab layer, not the cache, remembers which span a block belongs to.
//!
//! **Bounds.** A class's stack holds at most [`bin_capacity`] blocks: about 16 KiB of blocks, at least
//! 16 (8 for the classes above 4 KiB) and at most 128 of them (128 for the classes up to 128 B, 2 to
//! 16 KiB; 16 from 1 KiB to 4 KiB, 20 to 64 KiB; 8 above, 40 to 128 KiB), so one thread caches at
//! most 1,199 KiB of small blocks. The stacks take 15 KiB of thread-local storage per thread (the
//! whole cache, medium stacks included, 17 KiB).
//!
//! **Medium blocks** (engine blocks of a medium class, 20 to 64 KiB: see `medium.rs`) have stacks
//! of their own, of [`MEDIUM_BIN`] (8) blocks per class and at most [`MEDIUM_BUDGET`] (768 KiB) in
//! all; [`CONTENDED_MEDIUM_BIN`] (16) and [`CONTENDED_MEDIUM_BUDGET`] (1,536 KiB) in a thread that
//! meets contention on the heap lock ([`ThreadCache::contended`]). So do the upper classes (80 KiB
//! to 1 MiB), in such a thread only ([`ThreadCache::caches_upper`]), with a budget of their own,
//! `HostConfig::upper_cache_bytes` (by default and at most [`UPPER_BUDGET`], 8 MiB). So a
//! thread caches at most [`MAX_CACHED_BYTES`] (10,927 KiB: 1,199 KiB small, 1,536 KiB medium,
//! 8 MiB upper; 1,967 KiB in a thread that never met contention). A medium
//! allocation that neither its class's stack nor the next class's can serve takes a block from the
//! heap's medium transfer cache (`medium::Transfer`), with up to half its stack's cap more of its
//! class, or else one block from the engine under the lock (no batch there: the engine splits
//! blocks from free memory of any size, and a batch would only hold it); a free that finds the
//! stack or the budget full gives half the class's stack to the transfer cache while it has room
//! (in a thread that meets contention only) and the rest back to the engine (or the block itself,
//! when other classes hold the budget). A
//! free joins a stack only if the heap's medium table, read without the lock, names the block as a
//! live block of the class its layout says or a larger one, and it joins the stack of its own class
//! ([`ThreadCache::medium_class`]); any other goes to the checked pointer-based free. Decay, exit
//! flushes and `flush_thread_cache` treat them like small classes, giving them back to the engine,
//! which checks that each is live (a double free not caught at the free is caught there, unless the
//! block was handed out again first).
//!
//! **Double frees.** A free of the block on top of its stack (a block freed twice in a row on one
//! thread, with no flush or decay of its class between the two frees) is caught at once. Any other
//! double free, and a free of a live block with a wrong small layout whose pointer is an object
//! start of that class, is caught when the block reaches the slab layer (a flush that finds the
//! transfer cache full, the class's decay, thread exit, `flush_thread_cache` or
//! `release_free_memory`) if the slab layer has not handed it out again by then (it may have when
//! the first free already went back to the slab layer); until then the block may be handed out
//! twice, as with jemalloc's and tcmalloc's thread caches. Debug builds also check a free's layout
//! against its span's class before the block joins a stack (see [`ThreadCache::plausible`]);
//! without that check, a large block freed with a small layout joins the stack when its start
//! falls on an object start of the class (any block on a 64 KiB boundary does), and the check
//! when it leaves the cache aborts.
//!
//! **Binding.** A cache serves one allocator instance: the first one that allocates or frees a small
//! block on the thread, identified by a process-unique id (never an address, which a dropped
//! instance's successor could reuse). Other instances take the locked path on that thread. Every bound
//! cache is on its instance's registry (under the heap lock), which is how `stats()` subtracts cached
//! blocks and how dropping an instance marks its caches orphaned, after which they forget their blocks
//! and may bind again. Thread exit and instance drop serialise on one process-wide lock, so an exiting
//! thread never flushes into an instance that is being dropped; an orphaned cache takes the same lock
//! before it binds again, so the drop's walk of the old registry has ended before the cache's links
//! change.
//!
//! The stacks are `Cell`s (the owner thread alone reads and writes them). The counts are atomics
//! written only by the owner (a plain store, not a read-modify-write) so `stats()` may read them from
//! any thread.

use core::cell::Cell;

use super::medium::{
    self, CONTENDED_MEDIUM_BIN, CONTENDED_MEDIUM_BUDGET, MEDIUM_BIN, MEDIUM_BUDGET, NUM_LOWER,
    NUM_MEDIUM, UPPER_BUDGET, WINDOW_SHIFT,
};
use super::small::{class_size, NUM_CLASSES, SPAN, SPAN_SHIFT};
use crate::sync::{AtomicBool, AtomicUsize, Ordering};
/// The medium table is read the same way (see `medium.rs`).
use core::sync::atomic::AtomicU16;
/// The counts are statistics: written by the owner with plain stores and summed by `stats()`; no
/// ordering is relied on, so loom need not model them (modelling them would make every cached
/// block a scheduling point).
use core::sync::atomic::{AtomicU32, Ordering as CountOrdering};
/// The span class table is read as a hint (a stale byte can only send a free to the checked slow
/// path, or miss a bad free as the check did before), so it is not modelled either.
use core::sync::atomic::{AtomicU8, Ordering::Relaxed};

/// `owner` before the cache binds to an instance. It is 0, like every other field of a new cache,
/// so the thread-local's initial value is all zeros: it lives in `.tbss`, not as a 16 KiB image in
/// the binary's `.tdata` that every process maps and copies into each thread's block.
pub(crate) const UNBOUND: usize = 0;
/// `owner` while binding (the exit hook's registration may allocate; those calls take the lock).
pub(crate) const BINDING: usize = 1;
/// `owner` once the thread's exit flush ran: the cache is never used again.
pub(crate) const DEAD: usize = 2;
/// The id an instance reads before it has one: no cache's `owner` (instance ids start above
/// [`DEAD`] and never reach it).
pub(crate) const NO_ID: usize = usize::MAX;

/// Target bytes of blocks in one class's stack.
const BIN_BYTES: usize = 16 << 10;

/// Fewest blocks one class's stack holds.
const MIN_BIN: usize = 16;
/// Fewest blocks the stack of a class above [`LARGE_BIN_CLASS`] holds.
const MIN_LARGE_BIN: usize = 8;
/// Classes larger than this (4 KiB) get stacks of at least [`MIN_LARGE_BIN`] blocks.
const LARGE_BIN_CLASS: usize = 4096;
/// Most blocks one class's stack holds.
#[cfg(not(loom))]
const MAX_BIN: usize = 128;
/// Loom build: smaller stacks keep the models light.
#[cfg(loom)]
const MAX_BIN: usize = 16;

/// Most blocks class `c`'s stack holds: about [`BIN_BYTES`] of them, between [`MIN_BIN`] (or
/// [`MIN_LARGE_BIN`] above [`LARGE_BIN_CLASS`]) and [`MAX_BIN`].
#[inline(always)]
pub(crate) const fn bin_capacity(c: usize) -> usize {
    CAPACITY[c] as usize
}

/// [`bin_capacity`] by class (a table: the fast paths must not divide).
const CAPACITY: [u8; NUM_CLASSES] = {
    let mut cap = [0u8; NUM_CLASSES];
    let mut c = 0;
    while c < NUM_CLASSES {
        let n = BIN_BYTES / class_size(c);
        let min = if class_size(c) > LARGE_BIN_CLASS {
            MIN_LARGE_BIN
        } else {
            MIN_BIN
        };
        cap[c] = if n < min {
            min as u8
        } else if n > MAX_BIN {
            MAX_BIN as u8
        } else {
            n as u8
        };
        c += 1;
    }
    cap
};

/// `OFFSET[c]` is where class `c`'s stack starts in [`ThreadCache::slots`]; `OFFSET[NUM_CLASSES]` is
/// the total.
const OFFSET: [usize; NUM_CLASSES + 1] = {
    let mut o = [0; NUM_CLASSES + 1];
    let mut c = 0;
    while c < NUM_CLASSES {
        o[c + 1] = o[c] + bin_capacity(c);
        c += 1;
    }
    o
};
const SLOTS: usize = OFFSET[NUM_CLASSES];

/// `STACK[c]` is where class `c`'s stack starts in [`ThreadCache::slots`]: after the stacks below it
/// and one more slot per class, so the slot just below every stack is a guard that stays 0 (never a
/// block). [`ThreadCache::push`] compares the block with the slot below its stack's free end without
/// first checking that the stack is not empty.
const STACK: [usize; NUM_CLASSES] = {
    let mut s = [0; NUM_CLASSES];
    let mut c = 0;
    while c < NUM_CLASSES {
        s[c] = OFFSET[c] + c + 1;
        c += 1;
    }
    s
};
/// Length of [`ThreadCache::slots`]: the stacks and their guards.
const CACHE_SLOTS: usize = SLOTS + NUM_CLASSES;

/// Most bytes one thread's cache holds (the sum of every class's capacity times its size, small,
/// medium and upper; upper-class blocks only in a thread that meets contention on the heap lock).
pub const MAX_CACHED_BYTES: usize = {
    let mut sum = 0;
    let mut c = 0;
    while c < NUM_CLASSES {
        sum += bin_capacity(c) * class_size(c);
        c += 1;
    }
    let mut medium_sum = 0;
    let mut upper_sum = 0;
    let mut m = 0;
    while m < NUM_MEDIUM {
        if m < NUM_LOWER {
            medium_sum += most_medium(m) * medium::class_size(m);
        } else {
            upper_sum += most_medium(m) * medium::class_size(m);
        }
        m += 1;
    }
    sum + if medium_sum < CONTENDED_MEDIUM_BUDGET {
        medium_sum
    } else {
        CONTENDED_MEDIUM_BUDGET
    } + if upper_sum < UPPER_BUDGET {
        upper_sum
    } else {
        UPPER_BUDGET
    }
};

/// Most blocks medium or upper class `m`'s stack ever holds: [`CONTENDED_MEDIUM_BIN`] for a medium
/// class (in a thread that meets contention), [`MEDIUM_BIN`] for an upper one.
pub(crate) const fn most_medium(m: usize) -> usize {
    if m < NUM_LOWER {
        CONTENDED_MEDIUM_BIN
    } else {
        MEDIUM_BIN
    }
}

/// Where medium or upper class `m`'s stack starts in `medium_slots` (room for
/// [`most_medium`] blocks per class).
#[inline(always)]
const fn medium_base(m: usize) -> usize {
    if m < NUM_LOWER {
        m * CONTENDED_MEDIUM_BIN
    } else {
        NUM_LOWER * CONTENDED_MEDIUM_BIN + (m - NUM_LOWER) * MEDIUM_BIN
    }
}

/// Slots of the medium and upper stacks.
const MEDIUM_SLOTS: usize = medium_base(NUM_MEDIUM);

/// Most blocks moved per refill or flush.
pub(crate) const MAX_BATCH: usize = MAX_BIN / 2;

/// Blocks moved per refill or flush.
#[inline(always)]
pub(crate) const fn batch(c: usize) -> usize {
    bin_capacity(c) / 2
}

/// Slow-path events (refills and flushes of any class) in one decay period of a thread's cache: at
/// the end of each period, every class that had none of them gives back half its blocks.
pub(crate) const DECAY_PERIOD: u32 = 256;

/// Upper-class lock operations a thread goes on caching upper-class blocks after one that found the
/// heap lock held (see [`ThreadCache::caches_upper`]).
pub(crate) const CONTENDED_HEAT: u32 = 1024;

/// Bit of medium class `m` in `ThreadCache::active` and in the classes [`ThreadCache::note_slow`]
/// returns is `MEDIUM_BIT + m`; small class `c`'s is `c`.
pub(crate) const MEDIUM_BIT: usize = NUM_CLASSES;
/// Bits in `ThreadCache::active`.
const ACTIVE_BITS: usize = NUM_CLASSES + NUM_MEDIUM;

// One bit per class in `ThreadCache::active`.
static_assertions::const_assert!(ACTIVE_BITS <= 64);

/// One thread's cache. See the module docs.
pub(crate) struct ThreadCache {
    /// Id of the bound instance, or [`UNBOUND`] / [`BINDING`] / [`DEAD`].
    pub(crate) owner: Cell<usize>,
    /// The bound instance's heap anchor (`*const Anchor`, fixed while the instance moves), for the
    /// exit flush.
    pub(crate) instance: Cell<usize>,
    /// The bound instance's arena.
    pub(crate) arena: Cell<usize>,
    pub(crate) arena_len: Cell<usize>,
    /// The bound instance's span class table (one byte per 64 KiB of `arena_len`: class + 1, or 0
    /// where no span is), alive as long as the instance.
    pub(crate) classes: Cell<*const AtomicU8>,
    /// Set (under the process-wide bindings lock) when the bound instance was dropped.
    pub(crate) orphaned: AtomicBool,
    /// Registry links (addresses of other caches bound to the same instance), under its heap lock.
    pub(crate) prev: AtomicUsize,
    pub(crate) next: AtomicUsize,
    /// Blocks on each class's stack. Statistics for other threads: written by the owner with plain
    /// stores and summed by `stats()`; no ordering is relied on, so loom need not model them
    /// (modelling them would make every cached block a scheduling point).
    counts: [AtomicU32; NUM_CLASSES],
    /// The stacks: class `c`'s is `slots[STACK[c]..STACK[c] + counts[c]]`, top last;
    /// `slots[STACK[c] - 1]` is 0.
    slots: [Cell<usize>; CACHE_SLOTS],
    /// The bound instance's medium table (one entry per 16 KiB of `arena_len`; see `medium.rs`),
    /// alive as long as the instance.
    pub(crate) medium: Cell<*const AtomicU16>,
    /// Blocks on each medium class's stack (statistics for other threads, like `counts`).
    medium_counts: [AtomicU32; NUM_MEDIUM],
    /// The medium stacks: class `m`'s is `medium_slots[medium_base(m)..][..medium_counts[m]]`, top
    /// last.
    medium_slots: [Cell<usize>; MEDIUM_SLOTS],
    /// Bytes of the medium classes' stacks and of the upper classes' (owner thread only).
    medium_bytes: [Cell<usize>; 2],
    /// Lock operations of medium and upper-class requests left before the thread counts as
    /// uncontended again ([`ThreadCache::contended`]): set to [`CONTENDED_HEAT`] when such an
    /// operation found the heap lock held, less one for each that did not (owner thread only; see
    /// `medium.rs`).
    heat: Cell<u32>,
    /// Most bytes of the upper classes' stacks: the bound instance's
    /// `HostConfig::upper_cache_bytes` (at most [`UPPER_BUDGET`]; 0 until bound, and when the
    /// upper classes are off). Owner thread only.
    pub(crate) upper_budget: Cell<usize>,
    /// Slow-path events in the current decay period (owner thread only).
    events: Cell<u32>,
    /// Bit `c` (`MEDIUM_BIT + m`): small class `c` (medium class `m`) had a slow-path event in the
    /// current decay period (owner thread only).
    active: Cell<u64>,
}

impl ThreadCache {
    crate::sync::const_unless_loom! {
        /// An unbound, empty cache.
        pub(crate) fn new() -> Self {
            ThreadCache {
                owner: Cell::new(UNBOUND),
                instance: Cell::new(0),
                arena: Cell::new(0),
                arena_len: Cell::new(0),
                classes: Cell::new(core::ptr::null()),
                orphaned: AtomicBool::new(false),
                prev: AtomicUsize::new(0),
                next: AtomicUsize::new(0),
                counts: [const { AtomicU32::new(0) }; NUM_CLASSES],
                slots: [const { Cell::new(0) }; CACHE_SLOTS],
                medium: Cell::new(core::ptr::null()),
                medium_counts: [const { AtomicU32::new(0) }; NUM_MEDIUM],
                medium_slots: [const { Cell::new(0) }; MEDIUM_SLOTS],
                medium_bytes: [const { Cell::new(0) }; 2],
                heat: Cell::new(0),
                upper_budget: Cell::new(0),
                events: Cell::new(0),
                active: Cell::new(0),
            }
        }
    }

    /// Whether `owner` names an instance (not one of the sentinels).
    #[inline]
    pub(crate) fn is_bound(&self) -> bool {
        self.owner.get() > DEAD
    }

    /// Blocks on class `c`'s stack (any thread).
    #[inline(always)]
    pub(crate) fn count(&self, c: usize) -> usize {
        self.counts[c].load(CountOrdering::Relaxed) as usize
    }

    #[inline(always)]
    fn set_count(&self, c: usize, n: usize) {
        self.counts[c].store(n as u32, CountOrdering::Relaxed);
    }

    /// Slot `i` of class `c`'s stack.
    #[inline(always)]
    fn slot(&self, c: usize, i: usize) -> &Cell<usize> {
        debug_assert!(i < bin_capacity(c));
        // SAFETY: `i < bin_capacity(c)` (callers index below the count, which never exceeds the
        // capacity, or at or above the count after checking that the new count fits the
        // capacity), so the index is inside class `c`'s part of `slots`.
        unsafe { self.slots.get_unchecked(STACK[c] + i) }
    }

    /// The slot below the free end of class `c`'s stack of `n` blocks: its top block, or the guard
    /// (0) when the stack is empty.
    #[inline(always)]
    fn below(&self, c: usize, n: usize) -> usize {
        debug_assert!(n <= bin_capacity(c));
        // SAFETY: `STACK[c] >= 1` and `n <= bin_capacity(c)`, so the index is class `c`'s guard or
        // one of its stack's slots.
        unsafe { self.slots.get_unchecked(STACK[c] - 1 + n) }.get()
    }

    /// Pops a block of class `c` (owner thread only).
    #[inline(always)]
    pub(crate) fn pop(&self, c: usize) -> Option<usize> {
        let n = self.count(c);
        if n == 0 {
            return None;
        }
        let p = self.slot(c, n - 1).get();
        self.set_count(c, n - 1);
        Some(p)
    }

    /// Pushes a block the caller frees (owner thread only). `false` (nothing changed) when the slow
    /// path must see it: the stack is full, the block is not plainly a small block of the
    /// instance, or it is the block on top of the stack (freed twice in a row).
    #[inline(always)]
    pub(crate) fn push(&self, c: usize, p: usize) -> bool {
        let n = self.count(c);
        if n >= bin_capacity(c) || !self.plausible(c, p) || self.below(c, n) == p {
            return false;
        }
        self.slot(c, n).set(p);
        self.set_count(c, n + 1);
        true
    }

    /// Whether `p` could be a class `c` object of the bound instance: inside its arena, at an object
    /// start of that class, and, in debug builds, in a span of that class. (Whether it is live is
    /// checked when it leaves the cache.) Owner thread only, while the bound instance is alive.
    ///
    /// The span's class is checked only with `debug_assertions`, the way std checks the
    /// preconditions of its unsafe functions: it catches a free with a wrong small layout (or of a
    /// large block's pointer) before the block joins another class's stack, but costs a dependent
    /// load per free (bench-peers `pairs`: 6 instructions, about 10% of a pair's time).
    #[inline(always)]
    pub(crate) fn plausible(&self, c: usize, p: usize) -> bool {
        let offset = p.wrapping_sub(self.arena.get());
        offset < self.arena_len.get()
            && super::small::is_object_start(offset & (SPAN - 1), c)
            && (!cfg!(debug_assertions)
                // SAFETY: `offset` is inside the arena, so its 64 KiB window has an entry in the
                // table, which lives as long as the instance this cache is bound to (the caller's).
                || unsafe { &*self.classes.get().add(offset >> SPAN_SHIFT) }.load(Relaxed)
                    == c as u8 + 1)
    }

    /// Adds a block without checks (a slow-path free that was checked under the lock). The stack
    /// must have room.
    pub(crate) fn fill(&self, c: usize, p: usize) {
        self.fill_reversed(c, &[p]);
    }

    /// Pops up to `out.len()` blocks of class `c` into `out` (owner thread only); returns how many.
    pub(crate) fn pop_into(&self, c: usize, out: &mut [usize]) -> usize {
        let n = self.count(c);
        let k = n.min(out.len());
        for (j, o) in out[..k].iter_mut().enumerate() {
            *o = self.slot(c, n - 1 - j).get();
        }
        self.set_count(c, n - k);
        k
    }

    /// Adds `blocks` without checks, last first (a refill from the heap, which hands out ascending
    /// addresses: the stack then pops them in that order). The stack must have room for them all.
    pub(crate) fn fill_reversed(&self, c: usize, blocks: &[usize]) {
        let n = self.count(c);
        if n + blocks.len() > bin_capacity(c) {
            // Callers make room first; reaching this is a bug, and writing on would corrupt the
            // next class's stack.
            super::os::fatal(format_args!("thread cache overfilled (class {c})"));
        }
        for (k, &p) in blocks.iter().rev().enumerate() {
            self.slot(c, n + k).set(p);
        }
        self.set_count(c, n + blocks.len());
    }

    /// Calls `f` on the blocks of class `c`'s stack (owner thread only).
    pub(crate) fn walk(&self, c: usize, mut f: impl FnMut(usize)) {
        for i in 0..self.count(c) {
            f(self.slot(c, i).get());
        }
    }

    /// Whether some block is twice on class `c`'s stack (owner thread only; quadratic, for checks).
    pub(crate) fn has_duplicate(&self, c: usize) -> bool {
        let n = self.count(c);
        (0..n).any(|i| (i + 1..n).any(|j| self.slot(c, i).get() == self.slot(c, j).get()))
    }

    /// Whether `p` is on class `c`'s stack (owner thread only).
    pub(crate) fn contains(&self, c: usize, p: usize) -> bool {
        let mut found = false;
        self.walk(c, |q| found |= q == p);
        found
    }

    /// Blocks on medium class `m`'s stack (any thread).
    #[inline(always)]
    pub(crate) fn medium_count(&self, m: usize) -> usize {
        self.medium_counts[m].load(CountOrdering::Relaxed) as usize
    }

    #[inline(always)]
    fn set_medium_count(&self, m: usize, n: usize) {
        self.medium_counts[m].store(n as u32, CountOrdering::Relaxed);
    }

    /// Slot `i` of medium class `m`'s stack.
    #[inline(always)]
    fn medium_slot(&self, m: usize, i: usize) -> &Cell<usize> {
        debug_assert!(m < NUM_MEDIUM && i < most_medium(m));
        // SAFETY: `m < NUM_MEDIUM` (a class from `medium::class_for` or `upper_class_for`, one
        // of the next classes up that `pop_medium_for` and `pop_upper_for` bound by `NUM_LOWER`
        // and `NUM_MEDIUM`, a class `entry_class` decoded, which it bounds by `NUM_MEDIUM`, or a
        // loop over the classes) and `i < most_medium(m)` (callers index below the count, or at
        // the count after checking it is below `medium_cap(m)`, itself at most `most_medium(m)`;
        // so the count never exceeds `most_medium(m)`, though it may exceed `medium_cap(m)` after
        // a contention ends), so the index is inside class `m`'s part of `medium_slots`.
        unsafe { self.medium_slots.get_unchecked(medium_base(m) + i) }
    }

    /// Pops a block of class `m` (owner thread only): a medium class, or an upper one if `UPPER`.
    #[inline(always)]
    fn pop_in<const UPPER: bool>(&self, m: usize) -> Option<usize> {
        debug_assert_eq!(m >= NUM_LOWER, UPPER);
        let n = self.medium_count(m);
        if n == 0 {
            return None;
        }
        let p = self.medium_slot(m, n - 1).get();
        self.set_medium_count(m, n - 1);
        self.sub_bytes(UPPER, medium::class_size(m));
        Some(p)
    }

    /// Most blocks medium or upper class `m`'s stack takes now: [`CONTENDED_MEDIUM_BIN`] for a
    /// medium class in a thread that meets contention, else [`MEDIUM_BIN`] (owner thread only). A
    /// stack may hold more for a while after the contention ends: it takes no more until it is
    /// below.
    #[inline(always)]
    pub(crate) fn medium_cap(&self, m: usize) -> usize {
        if m < NUM_LOWER && self.contended() {
            CONTENDED_MEDIUM_BIN
        } else {
            MEDIUM_BIN
        }
    }

    /// Whether a block of medium class `m` fits the medium stacks' byte budget.
    #[inline(always)]
    pub(crate) fn medium_room(&self, m: usize) -> bool {
        self.room(m >= NUM_LOWER, m)
    }

    /// Whether a block of class `m` fits its budget: the upper classes' if `upper`, else the
    /// medium classes'.
    #[inline(always)]
    fn room(&self, upper: bool, m: usize) -> bool {
        let budget = if upper {
            self.upper_budget.get()
        } else if self.contended() {
            CONTENDED_MEDIUM_BUDGET
        } else {
            MEDIUM_BUDGET
        };
        self.bytes_cell(upper).get() + medium::class_size(m) <= budget
    }

    /// The byte count of the upper classes' budget if `upper`, else of the medium classes'.
    #[inline(always)]
    fn bytes_cell(&self, upper: bool) -> &Cell<usize> {
        &self.medium_bytes[upper as usize]
    }

    /// Adds `n` to the byte count of the upper classes' budget if `upper`, else the medium
    /// classes'.
    #[inline(always)]
    fn add_bytes(&self, upper: bool, n: usize) {
        let bytes = self.bytes_cell(upper);
        bytes.set(bytes.get() + n);
    }

    /// Takes `n` from the byte count of the upper classes' budget if `upper`, else the medium
    /// classes'.
    #[inline(always)]
    fn sub_bytes(&self, upper: bool, n: usize) {
        let bytes = self.bytes_cell(upper);
        bytes.set(bytes.get() - n);
    }

    /// Bytes of the upper classes' blocks if `upper`, else of the medium classes' (owner thread
    /// only).
    pub(crate) fn medium_bytes(&self, upper: bool) -> usize {
        self.bytes_cell(upper).get()
    }

    /// Whether the thread meets contention on the heap lock: a medium or upper-class request's
    /// lock operation found the lock held within the last [`CONTENDED_HEAT`] of them (owner
    /// thread only). Its medium stacks then take up to [`CONTENDED_MEDIUM_BIN`] blocks each and
    /// [`CONTENDED_MEDIUM_BUDGET`] in all, and it caches upper-class blocks.
    #[inline(always)]
    pub(crate) fn contended(&self) -> bool {
        self.heat.get() > 0
    }

    /// Whether the thread caches upper-class blocks now: it meets contention, and the upper
    /// classes are on (a budget that holds a block of the smallest; owner thread only).
    #[inline(always)]
    pub(crate) fn caches_upper(&self) -> bool {
        self.contended() && medium::upper_classes_on(self.upper_budget.get())
    }

    /// Notes whether a lock operation of a medium or upper-class request found the heap lock held
    /// (owner thread only).
    #[inline]
    pub(crate) fn note_lock(&self, contended: bool) {
        self.heat.set(if contended {
            CONTENDED_HEAT
        } else {
            self.heat.get().saturating_sub(1)
        });
    }

    /// Pushes a medium block the caller frees with a layout of medium class `m` (owner thread
    /// only), onto the stack of its own class (see [`ThreadCache::medium_class`]). `false`
    /// (nothing changed) when the slow path must see it: the table does not name the block as a
    /// live medium block of class `m` or larger (or names an upper-class one), its stack or the
    /// budget is full, or it is the block on top of its stack (freed twice in a row).
    #[inline(always)]
    pub(crate) fn push_medium(&self, m: usize, p: usize) -> bool {
        self.push_in::<false>(m, p)
    }

    /// [`ThreadCache::push_medium`] for a block freed with a layout of upper class `m`, which the
    /// table must name as an upper-class block of class `m` or larger.
    #[inline(always)]
    pub(crate) fn push_upper(&self, m: usize, p: usize) -> bool {
        self.push_in::<true>(m, p)
    }

    #[inline(always)]
    fn push_in<const UPPER: bool>(&self, m: usize, p: usize) -> bool {
        let Some(k) = self.medium_class(m, p) else {
            return false;
        };
        let n = self.medium_count(k);
        if (k >= NUM_LOWER) != UPPER
            || n >= self.medium_cap(k)
            || !self.room(UPPER, k)
            || (n > 0 && self.medium_slot(k, n - 1).get() == p)
        {
            return false;
        }
        self.medium_slot(k, n).set(p);
        self.set_medium_count(k, n + 1);
        self.add_bytes(UPPER, medium::class_size(k));
        true
    }

    /// The class of the live medium block at `p` that the bound instance's medium table names, if
    /// it names one of class `m` or larger (see `medium.rs`): a block handed out for a class `m`
    /// request may be of a larger class ([`ThreadCache::pop_medium_for`]). Owner thread only, while
    /// the bound instance is alive; `p` is a block the caller frees or resizes with a layout of
    /// class `m`.
    #[inline(always)]
    pub(crate) fn medium_class(&self, m: usize, p: usize) -> Option<usize> {
        let offset = p.wrapping_sub(self.arena.get());
        // (The entry names a block start to 8 bytes; medium blocks start on `MEDIUM_ALIGN`.)
        if offset >= self.arena_len.get() || p & (medium::MEDIUM_ALIGN - 1) != 0 {
            return None;
        }
        // SAFETY: `offset` is inside the arena, so its 16 KiB window has an entry in the table,
        // which lives as long as the instance this cache is bound to (the caller's).
        let e = unsafe { &*self.medium.get().add(offset >> WINDOW_SHIFT) }.load(Relaxed);
        let k = medium::entry_class(e)?;
        (e == medium::entry(k, p) && k >= m).then_some(k)
    }

    /// Whether the bound instance's medium table names `p` as a live medium block of class `m` or
    /// larger ([`ThreadCache::medium_class`]).
    #[inline(always)]
    pub(crate) fn plausible_medium(&self, m: usize, p: usize) -> bool {
        self.medium_class(m, p).is_some()
    }

    /// A cached block for a medium class `m` request: one of class `m`, or else one of the next
    /// medium class up (at most a class step larger, and spared a trip to the engine). Owner
    /// thread only.
    #[inline(always)]
    pub(crate) fn pop_medium_for(&self, m: usize) -> Option<usize> {
        self.pop_in::<false>(m).or_else(|| {
            (m + 1 < NUM_LOWER)
                .then(|| self.pop_in::<false>(m + 1))
                .flatten()
        })
    }

    /// For an upper class `m` request: a cached block of class `m` or one of the next two upper
    /// classes (at most two class steps larger), else `Err` of whether the thread caches
    /// upper-class blocks now (owner thread only).
    #[inline(always)]
    pub(crate) fn pop_upper_for(&self, m: usize) -> Result<usize, bool> {
        if self.bytes_cell(true).get() != 0 {
            for k in m..(m + 3).min(NUM_MEDIUM) {
                if let Some(p) = self.pop_in::<true>(k) {
                    return Ok(p);
                }
            }
        }
        Err(self.caches_upper())
    }

    /// Adds a medium block without checks (a slow-path free that was checked under the lock). The
    /// stack must have room.
    pub(crate) fn fill_medium(&self, m: usize, p: usize) {
        let n = self.medium_count(m);
        if n >= self.medium_cap(m) || !self.medium_room(m) {
            // Callers make room first; reaching this is a bug, and writing on would corrupt the
            // next class's stack.
            super::os::fatal(format_args!("thread cache overfilled (medium class {m})"));
        }
        self.medium_slot(m, n).set(p);
        self.set_medium_count(m, n + 1);
        self.add_bytes(m >= NUM_LOWER, medium::class_size(m));
    }

    /// Pops up to `out.len()` blocks of medium class `m` into `out` (owner thread only); returns
    /// how many.
    pub(crate) fn pop_medium_into(&self, m: usize, out: &mut [usize]) -> usize {
        let n = self.medium_count(m);
        let k = n.min(out.len());
        for (j, o) in out[..k].iter_mut().enumerate() {
            *o = self.medium_slot(m, n - 1 - j).get();
        }
        self.set_medium_count(m, n - k);
        self.sub_bytes(m >= NUM_LOWER, k * medium::class_size(m));
        k
    }

    /// Calls `f` on the blocks of medium class `m`'s stack (owner thread only).
    pub(crate) fn walk_medium(&self, m: usize, mut f: impl FnMut(usize)) {
        for i in 0..self.medium_count(m) {
            f(self.medium_slot(m, i).get());
        }
    }

    /// Whether `p` is on medium class `m`'s stack (owner thread only).
    pub(crate) fn contains_medium(&self, m: usize, p: usize) -> bool {
        let mut found = false;
        self.walk_medium(m, |q| found |= q == p);
        found
    }

    /// Whether some block is twice on medium class `m`'s stack (owner thread only).
    pub(crate) fn has_duplicate_medium(&self, m: usize) -> bool {
        let n = self.medium_count(m);
        (0..n).any(|i| {
            (i + 1..n).any(|j| self.medium_slot(m, i).get() == self.medium_slot(m, j).get())
        })
    }

    /// `(bytes, blocks)` held (any thread: reads the counts only).
    pub(crate) fn held(&self) -> (usize, usize) {
        let mut bytes = 0;
        let mut blocks = 0;
        for c in 0..NUM_CLASSES {
            let n = self.count(c);
            bytes += n * class_size(c);
            blocks += n;
        }
        for m in 0..NUM_MEDIUM {
            let n = self.medium_count(m);
            bytes += n * medium::class_size(m);
            blocks += n;
        }
        (bytes, blocks)
    }

    /// Notes a slow-path event (a refill or a flush) of the class with bit `c` (see [`MEDIUM_BIT`];
    /// owner thread only). At the end of a decay period, returns the classes that had no such
    /// event in it (by their bits), and starts the next period.
    pub(crate) fn note_slow(&self, c: usize) -> Option<u64> {
        let active = self.active.get() | 1 << c;
        let events = self.events.get() + 1;
        if events < DECAY_PERIOD {
            self.events.set(events);
            self.active.set(active);
            return None;
        }
        self.events.set(0);
        self.active.set(0);
        Some(!active & (u64::MAX >> (64 - ACTIVE_BITS)))
    }

    /// Forgets every block (their instance is gone) and unbinds.
    pub(crate) fn forget(&self) {
        for c in 0..NUM_CLASSES {
            self.set_count(c, 0);
        }
        for m in 0..NUM_MEDIUM {
            self.set_medium_count(m, 0);
        }
        self.bytes_cell(false).set(0);
        self.bytes_cell(true).set(0);
        self.heat.set(0);
        self.upper_budget.set(0);
        self.events.set(0);
        self.active.set(0);
        self.owner.set(UNBOUND);
        self.orphaned.store(false, Ordering::Relaxed);
    }
}

/// Slots of the heap's transfer cache: two thread-cache stacks' worth per class.
pub(crate) const TRANSFER_SLOTS: usize = 2 * SLOTS;

/// The heap's transfer cache (under the heap lock): per class, a stack of blocks a thread cache gave
/// back when full, from which refills take their batches (half a stack and one block each) before
/// the slab layer. A producer thread's refills and a consumer's
/// flushes then meet here at the cost of copying pointers, instead of each block going through the
/// slab layer's bitmaps. Blocks here are cached (free to callers); they get the slab layer's checks
/// when they leave for it: an explicit or thread-exit flush, or `release_free_memory`, drains the
/// transfer cache there.
pub(crate) struct Transfer {
    /// Class `c`'s stack is `slots[2 * OFFSET[c]..][..counts[c]]`.
    slots: &'static mut [usize],
    counts: [u16; NUM_CLASSES],
}

impl Transfer {
    /// Wraps storage of [`TRANSFER_SLOTS`] entries.
    pub(crate) fn new(slots: &'static mut [usize]) -> Self {
        assert!(slots.len() >= TRANSFER_SLOTS);
        Transfer {
            slots,
            counts: [0; NUM_CLASSES],
        }
    }

    /// Most blocks class `c`'s stack holds.
    #[inline]
    fn capacity(c: usize) -> usize {
        2 * bin_capacity(c)
    }

    /// Pushes blocks from the front of `blocks` while the stack has room; returns how many.
    pub(crate) fn push_from(&mut self, c: usize, blocks: &[usize]) -> usize {
        let n = self.counts[c] as usize;
        let k = blocks.len().min(Self::capacity(c) - n);
        self.slots[2 * OFFSET[c] + n..][..k].copy_from_slice(&blocks[..k]);
        self.counts[c] += k as u16;
        k
    }

    /// Moves up to `out.len()` blocks of class `c` into `out`, top first; returns how many.
    pub(crate) fn pop_into(&mut self, c: usize, out: &mut [usize]) -> usize {
        let n = self.counts[c] as usize;
        let k = n.min(out.len());
        let stack = &self.slots[2 * OFFSET[c]..][..n];
        for (o, &p) in out[..k].iter_mut().zip(stack.iter().rev()) {
            *o = p;
        }
        self.counts[c] -= k as u16;
        k
    }

    /// Blocks on class `c`'s stack.
    pub(crate) fn count(&self, c: usize) -> usize {
        self.counts[c] as usize
    }

    /// Calls `f` on class `c`'s blocks.
    pub(crate) fn walk(&self, c: usize, mut f: impl FnMut(usize)) {
        for &p in &self.slots[2 * OFFSET[c]..][..self.count(c)] {
            f(p);
        }
    }

    /// `(bytes, blocks)` held.
    pub(crate) fn held(&self) -> (usize, usize) {
        let mut total = (0, 0);
        for c in 0..NUM_CLASSES {
            total.0 += self.count(c) * class_size(c);
            total.1 += self.count(c);
        }
        total
    }
}

#[cfg(not(loom))]
std::thread_local! {
    static CACHE: ThreadCache = const { ThreadCache::new() };
}

// Loom keeps thread-locals by value in frames of its own, on small coroutine stacks: box it.
#[cfg(loom)]
loom::thread_local! {
    static CACHE: std::boxed::Box<ThreadCache> = std::boxed::Box::new(ThreadCache::new());
}

/// Runs `f` on this thread's cache; `None` if it is gone (the thread is exiting).
#[inline(always)]
pub(crate) fn with<R>(f: impl FnOnce(&ThreadCache) -> R) -> Option<R> {
    #[cfg(not(loom))]
    return CACHE.try_with(f).ok();
    #[cfg(loom)]
    return CACHE.try_with(|c| f(c)).ok();
}

/// Makes sure the cache is flushed when the thread exits: sets a pthread key whose destructor
/// flushes it. Returns `false` if it cannot (no key could be made, or the C library refused to
/// set it): then the cache must not serve, for nothing would give its blocks back. May allocate
/// (a key's second-level block, in the C library's allocator).
///
/// glibc runs the destructors of thread-locals first, then the keys' (in passes over the keys in
/// the order they were made, while keys are set again, four passes at most). So the flush comes
/// after every thread-local's destructor that allocates or frees, and a cache first bound inside
/// another key's destructor (a thread started outside Rust, whose first allocation is there) is
/// flushed later in that pass (through a key made before the exit key) or in the next one. Not
/// when bound in a fourth pass through a key made after the exit key: that cache is never
/// flushed, stays in its heap's list after the thread's storage is gone, and once another thread
/// reuses that storage the heap's next walk of the list aborts (`registry_corrupted`; a program
/// whose own keys set themselves again three times at exit). (A thread-local's destructor as the
/// hook would not run at all inside a key's destructor: registered after the thread-locals'
/// destructors ran, glibc keeps its record, 32 bytes, and never runs it.) The main thread's cache
/// is not flushed at `exit` (which runs no key destructors): the process is ending.
pub(crate) fn register_exit_flush() -> bool {
    #[cfg(not(loom))]
    {
        let Some(key) = exit_key() else {
            return false;
        };
        // SAFETY: `key` is a live key (never deleted once published). A non-null value makes its
        // destructor run at thread exit.
        unsafe {
            libc::pthread_setspecific(key, core::ptr::NonNull::<u8>::dangling().as_ptr().cast())
                == 0
        }
    }
    #[cfg(loom)]
    return true;
}

/// Makes the exit key now, at a heap's initialisation, before the program may have used up the
/// system's keys (then caches would be refused: see [`register_exit_flush`]). Allocates nothing.
pub(crate) fn make_exit_key() {
    #[cfg(not(loom))]
    let _ = exit_key();
}

/// The process's exit-flush key plus one (0: none yet).
#[cfg(not(loom))]
static EXIT_KEY: core::sync::atomic::AtomicUsize = core::sync::atomic::AtomicUsize::new(0);

/// The pthread key whose destructor flushes the exiting thread's cache, made on first use. `None`
/// if the system has no key left.
#[cfg(not(loom))]
fn exit_key() -> Option<libc::pthread_key_t> {
    use core::sync::atomic::Ordering::{AcqRel, Acquire};
    let k = EXIT_KEY.load(Acquire);
    if k != 0 {
        return Some((k - 1) as libc::pthread_key_t);
    }
    let mut key: libc::pthread_key_t = 0;
    // SAFETY: `key` is a valid place for the new key; the destructor is an `extern "C"` function
    // that does not unwind.
    if unsafe { libc::pthread_key_create(&mut key, Some(exit_key_destructor)) } != 0 {
        return None;
    }
    match EXIT_KEY.compare_exchange(0, key as usize + 1, AcqRel, Acquire) {
        Ok(_) => Some(key),
        Err(won) => {
            // Another thread made one first: this one was never set anywhere.
            // SAFETY: `key` was just created and is not published.
            unsafe { libc::pthread_key_delete(key) };
            Some((won - 1) as libc::pthread_key_t)
        }
    }
}

#[cfg(not(loom))]
extern "C" fn exit_key_destructor(_: *mut core::ffi::c_void) {
    let _ = CACHE.try_with(super::on_thread_exit);
}

/// Loom build: runs this thread's exit flush now. Loom drops a thread's locals after `join` has
/// already returned, possibly after the model's execution state is gone, so the models end each
/// thread with this call instead of relying on the destructor.
#[cfg(loom)]
pub fn exit_thread() {
    let _ = with(super::on_thread_exit);
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
            let min = if class_size(c) > LARGE_BIN_CLASS {
                MIN_LARGE_BIN
            } else {
                MIN_BIN
            };
            assert!((min..=MAX_BIN).contains(&n), "class {c}: {n}");
            assert!(n * class_size(c) <= BIN_BYTES.max(min * class_size(c)));
            assert!(batch(c) >= 4);
        }
        // The figures the module docs and the README quote.
        assert_eq!(MAX_CACHED_BYTES.div_ceil(1024), 1199 + 1536 + 8192);
        assert_eq!((CACHE_SLOTS * 8).div_ceil(1024), 15);
        assert_eq!(core::mem::size_of::<ThreadCache>().div_ceil(1024), 17);
    }

    /// The cache's thread-local starts all zeros, so it takes no room in the binary: the test
    /// binary's TLS segment (`PT_TLS`) has a file image far smaller than one cache.
    #[test]
    #[cfg(all(
        target_os = "linux",
        target_pointer_width = "64",
        target_endian = "little"
    ))]
    #[cfg_attr(miri, ignore = "reads /proc")]
    fn the_cache_thread_local_has_no_initial_image() {
        let exe = std::fs::read("/proc/self/exe").unwrap();
        let u16_at = |at: usize| u16::from_le_bytes(exe[at..at + 2].try_into().unwrap()) as usize;
        let u64_at = |at: usize| u64::from_le_bytes(exe[at..at + 8].try_into().unwrap()) as usize;
        assert_eq!(&exe[..5], b"\x7fELF\x02", "a 64-bit ELF file");
        let (phoff, phentsize, phnum) = (u64_at(0x20), u16_at(0x36), u16_at(0x38));
        const PT_TLS: u32 = 7;
        let tls = (0..phnum)
            .map(|i| phoff + i * phentsize)
            .find(|&h| u32::from_le_bytes(exe[h..h + 4].try_into().unwrap()) == PT_TLS)
            .expect("a TLS segment");
        let (file_size, mem_size) = (u64_at(tls + 0x20), u64_at(tls + 0x28));
        let cache = core::mem::size_of::<ThreadCache>();
        assert!(
            mem_size >= cache,
            "{mem_size} bytes of TLS, a cache takes {cache}"
        );
        assert!(
            file_size < cache / 4,
            "{file_size} bytes of initial TLS image: is a field of a new cache not zero?"
        );
    }

    #[test]
    fn a_decay_period_names_the_classes_without_slow_events() {
        let tc = ThreadCache::new();
        let all = u64::MAX >> (64 - ACTIVE_BITS);
        for period in 0..3 {
            // Classes 2 and the last are used, once and twice; the rest idle.
            let last = NUM_CLASSES - 1;
            assert_eq!(tc.note_slow(2), None);
            assert_eq!(tc.note_slow(last), None);
            for _ in 2..DECAY_PERIOD - 1 {
                assert_eq!(tc.note_slow(last), None, "period {period}");
            }
            let idle = tc.note_slow(last).expect("the period's last event");
            assert_eq!(idle, all & !(1 << 2 | 1 << last), "period {period}");
        }
        // A new period starts with no class active.
        for _ in 0..DECAY_PERIOD - 1 {
            assert_eq!(tc.note_slow(0), None);
        }
        assert_eq!(tc.note_slow(0), Some(all & !1));
        // Forgetting the blocks also restarts the period.
        assert_eq!(tc.note_slow(5), None);
        tc.forget();
        for _ in 0..DECAY_PERIOD - 1 {
            assert_eq!(tc.note_slow(0), None);
        }
        assert_eq!(tc.note_slow(0), Some(all & !1));
    }

    #[test]
    fn every_stack_has_a_zero_guard_below_it_when_all_are_full() {
        let tc = ThreadCache::new();
        for c in 0..NUM_CLASSES {
            let blocks: std::vec::Vec<usize> = (1..=bin_capacity(c)).map(|i| c << 16 | i).collect();
            tc.fill_reversed(c, &blocks);
        }
        for c in 0..NUM_CLASSES {
            let n = bin_capacity(c);
            assert_eq!(tc.below(c, 0), 0, "class {c}: the guard");
            // The top is the first block given to the refill.
            assert_eq!(tc.below(c, n), c << 16 | 1, "class {c}: the top");
            assert_eq!(tc.pop(c), Some(c << 16 | 1));
        }
    }

    /// A refill that would write past a stack's capacity (a bug in a caller) aborts instead of
    /// writing into the next class's stack.
    #[test]
    #[cfg_attr(miri, ignore = "spawns a child process")]
    fn overfilling_a_stack_aborts() {
        let case = "overfilling_a_stack_aborts";
        if super::super::tests::is_child(case) {
            let tc = ThreadCache::new();
            let blocks: std::vec::Vec<usize> = (1..=bin_capacity(3) + 1).collect();
            tc.fill_reversed(3, &blocks);
            std::println!("child survived");
            return;
        }
        super::super::tests::assert_child_aborts(
            "host::tcache::tests",
            case,
            "bfc-alloc: fatal: thread cache overfilled (class 3)",
        );
    }

    #[test]
    fn plausible_stops_at_the_arena_end() {
        let classes: std::vec::Vec<AtomicU8> = (0..2).map(|_| AtomicU8::new(1)).collect();
        let tc = ThreadCache::new();
        tc.arena.set(1 << 40);
        tc.arena_len.set(SPAN);
        tc.classes.set(classes.as_ptr());
        assert!(tc.plausible(0, (1 << 40) + 16));
        assert!(!tc.plausible(0, (1 << 40) + SPAN));
    }

    #[test]
    fn stacks_pop_in_fill_order_and_walks_see_every_slot() {
        let tc = ThreadCache::new();
        tc.fill_reversed(0, &[16, 32, 48]);
        assert!(tc.contains(0, 16) && tc.contains(0, 32) && tc.contains(0, 48));
        assert!(!tc.has_duplicate(0));
        assert_eq!(
            (tc.pop(0), tc.pop(0), tc.pop(0)),
            (Some(16), Some(32), Some(48))
        );
        tc.fill_reversed(0, &[16, 16]);
        assert!(tc.has_duplicate(0));
    }
}
