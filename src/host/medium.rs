//! Medium blocks (`std` builds): engine blocks of 16..64 KiB that thread caches keep for reuse,
//! and upper-class blocks (64 KiB..1 MiB) that they keep in threads that meet contention.
//!
//! A request above the slab layer's 16 KiB and at most [`MEDIUM_MAX`] (64 KiB), aligned to at most
//! [`MEDIUM_ALIGN`] (4 KiB: SIMD vectors, cache lines, `crossbeam`'s `CachePadded`, page-aligned
//! I/O buffers where pages are 4 KiB), is
//! rounded up to one of [`NUM_LOWER`] classes (four per power of two: 20, 24, 28, 32, 40, 48, 56
//! and 64 KiB) and served by the engine as a block of exactly that size, starting on the
//! [`MEDIUM_GRID`] (32 KiB) grid where the arena has room for the padding (else at a page
//! boundary). Such a block is interchangeable with any other of its class, so a
//! thread's cache keeps a few freed ones per class and hands them out again without the lock, the
//! engine's best-fit search, its splitting or its coalescing (cachegrind on bench-peers `med`:
//! about 900 instructions for an allocation and a free through the engine before the grid below,
//! about 1,300 with it (at 2d0d5a5: 980 for the allocation, 540 of them the search for a grid
//! start, 330 for the free), about 90 through the cache). A request whose class has none cached takes one of the next class up, if cached: on
//! `med` (random classes) that raised the share of steps the cache serves from about 74% to 87%
//! (simulated), and cut the run's instructions by 23% and its peak RSS by 8%. The class rounding gives a request about 9% more address space than it asked for on
//! average (sizes spread evenly on a log scale), and at most a quarter more (16 KiB + 1 byte).
//! Blocks of the 64 KiB class start on the 64 KiB grid, as every engine block of 64 KiB or more.
//!
//! **The grid.** A buffer is often used from its start and left partly untouched (sized for the
//! largest message, reserved capacity). Placed wherever they fit, the starts of successive blocks
//! wander over every page of the heap, and every page that ever held a used start stays resident;
//! on a 32 KiB grid the starts fall on at most one page in eight, the same pages again and again.
//! bench-peers `med` (1,000 live blocks of 16..64 KiB, the first byte of each written): peak RSS
//! 41.8 -> 9.5 MiB (glibc 39.8, mimalloc with THP off 10.0), its time level; the price is address
//! space, not resident memory: the padding before a block is never written (it stays free, and
//! coalesces when its neighbours are freed), and the heap's committed extent grew from 50 to 58
//! MiB. A 16 KiB grid gave 15.1 MiB (56 MiB committed), a 64 KiB one 7.1 MiB (70 MiB committed).
//! The engine still coalesces every block the caches give back, and a cache holds at most
//! [`MEDIUM_BIN`] (8) blocks per class and [`MEDIUM_BUDGET`] (768 KiB) of them in all; twice that
//! ([`CONTENDED_MEDIUM_BIN`], [`CONTENDED_MEDIUM_BUDGET`]) in a thread that meets contention on the
//! heap lock (below), where a miss may wait for another thread.
//!
//! **Upper classes.** Engine blocks above 64 KiB take the heap lock on every allocation and free
//! (about 1,300 instructions under it), so threads that use them at once wait for each other:
//! with two threads each churning 16 live blocks of 64 KiB..1 MiB (bench-peers `large2`) a step
//! took 2.3-2.8 times as long as with one thread. A thread whose request above 64 KiB and up to
//! [`UPPER_MAX`] (1 MiB, alignment at most [`MEDIUM_ALIGN`]) finds the lock held (its first
//! attempt to take it fails) caches such blocks as it does medium ones, in sixteen more classes
//! (80 KiB to 1 MiB, four per power of two): a miss takes a block of the class size from the
//! engine (on the 64 KiB grid, noted in the table), a free joins its class's stack while the
//! thread's budget (`HostConfig::upper_cache_bytes`, by default and at most [`UPPER_BUDGET`],
//! 8 MiB of upper-class blocks; [`MEDIUM_BIN`] per class) has room (a class larger than the
//! budget is neither rounded nor cached, and a budget below 80 KiB, 0 say, turns the upper
//! classes off: no thread starts caching),
//! and a request takes a cached block of its class or of the next two up (at most 1.75 times its
//! size, a request of 64 KiB + 1 byte served by a 112 KiB block; the pages past what the caller
//! writes stay untouched unless an earlier owner wrote them). A medium request's lock operation
//! that finds the lock held starts the same (and doubles the thread's medium caps). After
//! `CONTENDED_HEAT` (1,024) medium or upper-class lock operations in a row that found the lock free
//! the thread stops: its requests take blocks of their own size again and its frees go to the
//! engine, and what it still caches serves its requests, decays or goes back at exit. A thread
//! that never meets contention (every single-threaded program) never rounds or caches these
//! blocks; `alloc_zeroed` never takes them from a cache. Blocks in other threads' caches are out
//! of reach of an allocation that runs out of room (as small and medium ones are), and there can
//! be up to 8 MiB (by default) of them per such thread. bench-peers, 2 threads, six interleaved pairs against
//! the build before (ns per step and thread, peak RSS): `large2` (first byte written) 321-364 ->
//! 63-249 ns (median 85; mimalloc with THP off 154-234), 4.0-4.2 -> 4.6-5.2 MiB; `large2w`
//! (every page written) 1,440-2,000 -> 920-1,510 ns, 25.2-25.8 -> 40.1-43.8 MiB (glibc 24-25,
//! jemalloc 33, talc 24-25, mimalloc with THP off 59). A budget of 4 MiB gave 120-260 ns on
//! `large2` and 31-37 MiB on `large2w`; leaving the caching after 64 uncontended operations
//! instead of 1,024 made `large2` bimodal (70 or 310 ns: with fewer misses the lock is contended
//! less, and the caching switched itself off). Single-threaded, the branch to these paths costs
//! `bufw` 2.9% and `large` 2.5% more instructions (cachegrind); six interleaved pairs: `bufw`
//! 438-465 against 439-463 ns per step, `large` 375-466 against 341-477 (noisy).
//!
//! **The table.** A freed block may join a cache only if it is what its layout says, or larger: a
//! live medium block of the layout's class or a larger one (it then joins its own class's stack). Its layout alone cannot say so (a block resized in
//! place, or a wrong layout), and the engine's records need the lock. So the heap keeps a lock-free
//! table with one 16-bit entry per 16 KiB window of the arena: for a window in which a medium block
//! starts, the block's class and its offset in the window ([`entry`]); 0 elsewhere. Every engine
//! block above 16 KiB starts in a window of its own (two such blocks' starts are more than 16 KiB
//! apart), so the entry names that block alone (a smaller engine block, one aligned beyond the slab
//! layer, may start in the same window: the entry's offset tells them apart). The heap writes
//! entries under its lock: when it hands out a medium block of exactly its class size, and (to 0)
//! when the engine frees the block the entry names or resizes it in place (then, if the new size is
//! a class size, it writes the new class). A thread freeing a block reads the entry of the block's
//! window: the block is live and the freeing thread owns it, so the entry written when it was
//! handed out is there (what handed the block over to that thread ordered that write before this
//! read), and no other block's entry can replace it while the block lives. A cached block keeps
//! its entry: it is still live to the engine.
//!
//! The table takes 2 bytes per 16 KiB of arena (8 MiB for a 64 GiB arena). It is readable from
//! the start (read-only pages cost no commit charge; a read of one never written sees zeros) and
//! made writable in step with the arena, as the span table is; only the pages of windows where
//! medium blocks started are touched.

use core::sync::atomic::{AtomicU16, Ordering::Relaxed};

use super::small::SMALL_MAX;

/// Largest medium request.
pub(crate) const MEDIUM_MAX: usize = 64 << 10;
/// Largest alignment of a medium request; every medium block is aligned to it (4 KiB, a page on
/// x86-64: SIMD vectors, cache lines and page-aligned I/O buffers all take the cached path and the
/// grid; with larger pages, a page-aligned request goes to the engine, placed as it fits). A
/// block on the grid is aligned to it anyway; the alignment only costs the blocks placed off the
/// grid (the arena near its limit) up to a page of padding instead of 128 bytes.
pub(crate) const MEDIUM_ALIGN: usize = 4096;
/// Where a new medium block starts, when the arena has room for the padding (see the module docs):
/// a multiple of 32 KiB (64 KiB for the 64 KiB class, as for every larger engine block).
pub(crate) const MEDIUM_GRID: usize = 32 << 10;
/// Bytes per table entry's window.
pub(crate) const WINDOW_SHIFT: u32 = 14;
/// Most blocks one class's stack in a thread cache holds (a medium class's, in a thread that meets
/// contention on the heap lock: [`CONTENDED_MEDIUM_BIN`]).
pub(crate) const MEDIUM_BIN: usize = 8;
/// Most blocks one medium class's stack holds in a thread that meets contention on the heap lock
/// (`ThreadCache::contended`), where a miss may wait for the lock: with [`CONTENDED_MEDIUM_BUDGET`],
/// bench-peers `pagebuf2` (2 threads) took 59-64 instead of 109-112 ns per step and thread (three
/// interleaved rounds; 8 and 1.5 MiB: 80-88 ns, 16 and 768 KiB: 118-126 ns). Single-threaded, the
/// same caps would cost `zero` 0.4 MiB and `bufw` 0.25 MiB of peak RSS, so they stay for threads
/// that wait.
pub(crate) const CONTENDED_MEDIUM_BIN: usize = 2 * MEDIUM_BIN;
/// Most bytes of medium blocks one thread's cache takes ([`CONTENDED_MEDIUM_BUDGET`] while the
/// thread meets contention). (bench-peers, interleaved with 4 blocks
/// and 512 KiB: `med` 66.3-66.5 -> 53.0-53.5 ns/step, mimalloc with THP off 54.7-55.2; peak RSS of
/// `bufw` 11.30-11.42 -> 11.49-11.53 MiB and of `zero` 11.25-11.29 -> 11.40-11.46 MiB. 8 and 1 MiB:
/// 48-51 ns, `zero` 11.97 MiB; 8 and 640 KiB: 58.5 ns.)
pub(crate) const MEDIUM_BUDGET: usize = 768 << 10;
/// Most bytes of medium blocks one thread's cache holds while the thread meets contention on the
/// heap lock (see [`CONTENDED_MEDIUM_BIN`]).
pub(crate) const CONTENDED_MEDIUM_BUDGET: usize = 2 * MEDIUM_BUDGET;

/// Most blocks of one medium class the heap's [`Transfer`] holds.
pub(crate) const TRANSFER_BIN: usize = 32;
/// Most bytes of medium blocks the heap's [`Transfer`] holds in all.
pub(crate) const TRANSFER_BUDGET: usize = 4 << 20;

/// Medium blocks that thread caches gave back when full, kept in the heap (under its lock) for the
/// next thread whose cache misses on their class: a producer thread's allocations and a consumer's
/// frees then meet here, instead of each block going through the engine's search and coalescing
/// twice. At most [`TRANSFER_BIN`] blocks per class and [`TRANSFER_BUDGET`] bytes in all; blocks
/// here are live to the engine and cached (free to callers), as in a thread cache. An explicit or
/// thread-exit flush, `release_free_memory` and an allocation that runs out of room give them
/// back to the engine.
pub(crate) struct Transfer {
    slots: [[usize; TRANSFER_BIN]; NUM_LOWER],
    counts: [u8; NUM_LOWER],
}

impl Transfer {
    /// An empty one.
    pub(crate) const fn new() -> Self {
        Transfer {
            slots: [[0; TRANSFER_BIN]; NUM_LOWER],
            counts: [0; NUM_LOWER],
        }
    }

    /// Pushes block `p` of medium class `m` if there is room for it; whether it did.
    pub(crate) fn push(&mut self, m: usize, p: usize) -> bool {
        let n = self.count(m);
        if m >= NUM_LOWER || n >= TRANSFER_BIN || self.held().0 + class_size(m) > TRANSFER_BUDGET {
            return false;
        }
        self.slots[m][n] = p;
        self.counts[m] += 1;
        true
    }

    /// Pops a block of medium class `m`, the latest pushed.
    pub(crate) fn pop(&mut self, m: usize) -> Option<usize> {
        let n = self.count(m).checked_sub(1)?;
        self.counts[m] = n as u8;
        Some(self.slots[m][n])
    }

    /// Blocks of medium class `m` (0 for an upper class).
    pub(crate) fn count(&self, m: usize) -> usize {
        self.counts.get(m).map_or(0, |&n| n as usize)
    }

    /// Class `m`'s blocks.
    pub(crate) fn blocks(&self, m: usize) -> &[usize] {
        self.slots.get(m).map_or(&[], |s| &s[..self.count(m)])
    }

    /// `(bytes, blocks)` held.
    pub(crate) fn held(&self) -> (usize, usize) {
        (0..NUM_LOWER).fold((0, 0), |(b, k), m| {
            (b + self.count(m) * class_size(m), k + self.count(m))
        })
    }
}

/// Largest request of the upper classes, cached only by threads that meet contention on the heap
/// lock (see the module docs).
pub(crate) const UPPER_MAX: usize = 1 << 20;
/// Most bytes of upper-class blocks one thread's cache holds (the default and the largest
/// [`HostConfig::upper_cache_bytes`](super::HostConfig::upper_cache_bytes)).
pub(crate) const UPPER_BUDGET: usize = 8 << 20;
// `HostConfig::validate` (built without `std` too) spells the bound out.
static_assertions::const_assert!(UPPER_BUDGET == super::HostConfig::DEFAULT.upper_cache_bytes);

/// The class sizes, in KiB: the medium classes up to [`MEDIUM_MAX`], then the upper ones up to
/// [`UPPER_MAX`].
const CLASS_KIB: [usize; 24] = [
    20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640,
    768, 896, 1024,
];
/// Classes in all (medium and upper).
pub(crate) const NUM_MEDIUM: usize = CLASS_KIB.len();
/// The medium classes (at most [`MEDIUM_MAX`]); the rest are upper classes.
pub(crate) const NUM_LOWER: usize = 8;
static_assertions::const_assert!(CLASS_KIB[NUM_LOWER - 1] << 10 == MEDIUM_MAX);
static_assertions::const_assert!(CLASS_KIB[NUM_MEDIUM - 1] << 10 == UPPER_MAX);
// An entry holds the class plus one in its top five bits.
static_assertions::const_assert!(NUM_MEDIUM < 32);

/// `CLASS_OF[(size - 1) >> 12]` is the class of a medium or upper request of `size` bytes.
const CLASS_OF: [u8; UPPER_MAX >> 12] = {
    let mut t = [0u8; UPPER_MAX >> 12];
    let mut i = SMALL_MAX >> 12;
    while i < t.len() {
        // The largest size with this index is `(i + 1) << 12`: the first class that holds it.
        let mut c = 0;
        while CLASS_KIB[c] << 10 < (i + 1) << 12 {
            c += 1;
        }
        t[i] = c as u8;
        i += 1;
    }
    t
};

/// Size of medium class `m`.
#[inline(always)]
pub(crate) const fn class_size(m: usize) -> usize {
    CLASS_KIB[m] << 10
}

/// The medium class of a request, or `None` when it is not one (see the module docs).
#[inline(always)]
pub(crate) fn class_for(size: usize, align: usize) -> Option<usize> {
    class_above(SMALL_MAX, MEDIUM_MAX, size, align)
}

/// The class of a request above `low` and at most `high` bytes, aligned to at most
/// [`MEDIUM_ALIGN`]; `None` for any other.
#[inline(always)]
fn class_above(low: usize, high: usize, size: usize, align: usize) -> Option<usize> {
    if size <= low || size > high || align > MEDIUM_ALIGN {
        return None;
    }
    Some(CLASS_OF[(size - 1) >> 12] as usize)
}

/// Whether a per-thread budget of `budget` bytes turns the upper classes on: it holds a block of
/// the smallest upper class (80 KiB).
#[inline(always)]
pub(crate) const fn upper_classes_on(budget: usize) -> bool {
    budget >= class_size(NUM_LOWER)
}

/// The upper class of a request above [`MEDIUM_MAX`] and at most [`UPPER_MAX`], aligned to at
/// most [`MEDIUM_ALIGN`]; `None` for any other.
#[inline(always)]
pub(crate) fn upper_class_for(size: usize, align: usize) -> Option<usize> {
    class_above(MEDIUM_MAX, UPPER_MAX, size, align)
}

/// The table entry of a class `m` block starting at `p` (aligned to [`MEDIUM_ALIGN`]): the class
/// plus one, and the start's offset in its window in units of 8 bytes. Never 0. (A pointer off
/// the 8-byte grid shares its entry with the block start below it: readers compare the decoded
/// start, or check the alignment first.)
#[inline(always)]
pub(crate) const fn entry(m: usize, p: usize) -> u16 {
    ((m as u16 + 1) << 11) | ((p & ((1 << WINDOW_SHIFT) - 1)) >> 3) as u16
}

/// The class an entry names (`None` for 0, or a value no class has).
#[inline(always)]
pub(crate) const fn entry_class(e: u16) -> Option<usize> {
    match ((e >> 11) as usize).checked_sub(1) {
        Some(k) if k < NUM_MEDIUM => Some(k),
        _ => None,
    }
}

/// The start an entry names, in the window whose base is `window`, and its class (for an entry
/// [`entry`] made).
pub(crate) const fn decode(e: u16, window: usize) -> (usize, usize) {
    (
        window + ((e as usize & 0x7ff) << 3),
        (e as usize >> 11).wrapping_sub(1),
    )
}

/// The heap's table: an entry per window of the arena starting at `arena`.
pub(crate) struct Table {
    arena: usize,
    entries: &'static [AtomicU16],
}

impl Table {
    /// Wraps zero-filled entries for an arena of `entries.len() << WINDOW_SHIFT` bytes at `arena`.
    pub(crate) fn new(arena: usize, entries: &'static [AtomicU16]) -> Self {
        Table { arena, entries }
    }

    /// The entries (for thread caches, which read them without the lock).
    pub(crate) fn entries(&self) -> *const AtomicU16 {
        self.entries.as_ptr()
    }

    /// The entry of the window holding `p` (inside the arena).
    #[inline]
    fn slot(&self, p: usize) -> &AtomicU16 {
        &self.entries[(p - self.arena) >> WINDOW_SHIFT]
    }

    /// Notes a class `m` block of exactly its class size at `p` (aligned to [`MEDIUM_ALIGN`]: a
    /// cache may hand it out for any medium request).
    #[inline]
    pub(crate) fn set(&self, m: usize, p: usize) {
        debug_assert_eq!(p % MEDIUM_ALIGN, 0);
        self.slot(p).store(entry(m, p), Relaxed);
    }

    /// Forgets the entry of a block starting at `p`, if there is one (the engine freed the block
    /// or resized it). An entry of the same window naming another start is kept: a block of at
    /// most 16 KiB (an engine block aligned beyond the slab layer) may start in a medium block's
    /// window. Writes only to clear an entry, so the table's untouched pages stay untouched.
    #[inline]
    pub(crate) fn clear(&self, p: usize) {
        let e = self.slot(p);
        let v = e.load(Relaxed);
        if v != 0 && v & 0x7ff == entry(0, p) & 0x7ff {
            e.store(0, Relaxed);
        }
    }

    /// Whether `p` (any address) is noted as a class `m` block.
    #[inline]
    pub(crate) fn is(&self, m: usize, p: usize) -> bool {
        self.class_of(p) == Some(m)
    }

    /// The class of the medium block starting at `p` (any address), if the table names one (to the
    /// byte: the entry's start, decoded, is `p`, aligned to [`MEDIUM_ALIGN`]).
    #[inline]
    pub(crate) fn class_of(&self, p: usize) -> Option<usize> {
        if p % MEDIUM_ALIGN != 0 {
            return None;
        }
        let e = self
            .entries
            .get(p.wrapping_sub(self.arena) >> WINDOW_SHIFT)?
            .load(Relaxed);
        let k = entry_class(e)?;
        (decode(e, p & !((1 << WINDOW_SHIFT) - 1)).0 == p).then_some(k)
    }

    /// Calls `f(start, class)` for every entry of the windows below `end`.
    pub(crate) fn walk(&self, end: usize, mut f: impl FnMut(usize, usize)) {
        let windows = (end.saturating_sub(self.arena) >> WINDOW_SHIFT) + 1;
        for (i, e) in self.entries.iter().take(windows).enumerate() {
            let e = e.load(Relaxed);
            if e != 0 {
                let (p, m) = decode(e, self.arena + (i << WINDOW_SHIFT));
                f(p, m);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_cover_every_medium_size_with_the_smallest_fit() {
        assert_eq!(class_for(SMALL_MAX, 1), None);
        assert_eq!(class_for(MEDIUM_MAX + 1, 1), None);
        assert_eq!(class_for(20 << 10, MEDIUM_ALIGN), Some(0));
        assert_eq!(class_for(20 << 10, 2 * MEDIUM_ALIGN), None);
        for size in SMALL_MAX + 1..=MEDIUM_MAX {
            let m = class_for(size, 16).unwrap();
            assert!(class_size(m) >= size, "{size}");
            assert!(m == 0 || class_size(m - 1) < size, "{size}");
            assert_eq!(class_for(size, 1), Some(m));
        }
        for m in 0..NUM_LOWER {
            assert_eq!(class_for(class_size(m), 8), Some(m));
        }
        // The upper classes: above the medium ones, up to `UPPER_MAX`.
        assert_eq!(upper_class_for(MEDIUM_MAX, 1), None);
        assert_eq!(upper_class_for(UPPER_MAX + 1, 1), None);
        assert_eq!(
            upper_class_for(MEDIUM_MAX + 1, MEDIUM_ALIGN),
            Some(NUM_LOWER)
        );
        assert_eq!(upper_class_for(MEDIUM_MAX + 1, 2 * MEDIUM_ALIGN), None);
        for size in (MEDIUM_MAX + 1..=UPPER_MAX).step_by(61) {
            let m = upper_class_for(size, 16).unwrap();
            assert!(class_size(m) >= size, "{size}");
            assert!(class_size(m - 1) < size, "{size}");
            assert_eq!(class_for(size, 16), None);
        }
        for m in NUM_LOWER..NUM_MEDIUM {
            assert_eq!(upper_class_for(class_size(m), 8), Some(m));
            assert_eq!(
                upper_class_for(class_size(m) + 1, 8),
                (m + 1 < NUM_MEDIUM).then_some(m + 1)
            );
        }
    }

    #[test]
    fn entries_name_one_start_and_class() {
        let window = 5 << WINDOW_SHIFT;
        for m in 0..NUM_MEDIUM {
            for off in (0..1 << WINDOW_SHIFT).step_by(MEDIUM_ALIGN) {
                let e = entry(m, window + off);
                assert_ne!(e, 0);
                assert_eq!(decode(e, window), (window + off, m));
                // Another start or class in the same window has another entry.
                assert_ne!(entry(m, window + (off ^ MEDIUM_ALIGN)), e);
                assert_ne!(entry((m + 1) % NUM_MEDIUM, window + off), e);
            }
        }
    }

    #[test]
    fn clearing_another_start_in_the_window_keeps_the_entry() {
        let entries: std::vec::Vec<AtomicU16> = (0..4).map(|_| AtomicU16::new(0)).collect();
        let entries = std::boxed::Box::leak(entries.into_boxed_slice());
        let arena = 1 << 30;
        let t = Table::new(arena, entries);
        let p = arena + (2 << WINDOW_SHIFT) + MEDIUM_ALIGN;
        t.set(3, p);
        assert!(t.is(3, p) && !t.is(2, p));
        // A small engine block starting in the same window, before the medium one, is freed.
        t.clear(p - 0x40);
        assert!(t.is(3, p));
        t.clear(p);
        assert!(!t.is(3, p));
        assert_eq!(entries[2].load(Relaxed), 0);
        // Outside the arena: never named.
        assert!(!t.is(3, arena - 16) && !t.is(3, arena + (4 << WINDOW_SHIFT)));
    }
}
