//! Chunks and the fixed-capacity chunk table.
//!
//! A *chunk* is a contiguous, granule-aligned range of a region, either in use (handed to a caller) or
//! free (in exactly one bin). Chunk records live in a caller-provided table, never in the memory they
//! describe; a [`ChunkHandle`] is an index into that table. Freed records are recycled through an
//! intrusive free-slot list threaded through `free_next`.

#[cfg(feature = "std")]
extern crate std;

use core::num::NonZeroU32;

/// Index of a chunk record in the chunk table. `Option<ChunkHandle>` is 4 bytes (the niche is 0).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
#[repr(transparent)]
pub struct ChunkHandle(NonZeroU32);

impl ChunkHandle {
    /// The table index this handle names.
    #[inline]
    pub fn index(self) -> usize {
        (self.0.get() - 1) as usize
    }

    /// The handle of table slot `index`. `index` must be below `u32::MAX`.
    #[inline]
    pub(crate) fn from_index(index: usize) -> Self {
        debug_assert!(index < u32::MAX as usize);
        // `index + 1` is at least 1 and, by the check above (enforced at table creation), fits in u32.
        match NonZeroU32::new(index as u32 + 1) {
            Some(n) => ChunkHandle(n),
            None => unreachable_handle(),
        }
    }
}

#[cold]
fn unreachable_handle() -> ! {
    panic!("bfc-alloc: chunk handle overflow")
}

/// Bit 0 of [`Chunk::size_flags`]: the chunk is in use. Granules are at least 8 bytes, so the low three
/// bits of a size are always zero.
const IN_USE: usize = 1;
/// Bit 1: the chunk sits in a quick list. Such a chunk also has [`IN_USE`] set, so neighbours never
/// merge with it and it is in no bin; to callers it is free.
const CACHED: usize = 2;
/// Bit 1 of a *free* chunk (no [`IN_USE`]): the chunk was free and unchanged at the last
/// [`Bfc::sweep_dirty`](super::Bfc::sweep_dirty), so the next one may return its pages. Cleared like
/// [`CLEAN`].
const AGED: usize = 2;
/// Bit 2: a free chunk whose whole pages the memory's owner has already returned to the OS (see
/// [`Bfc::sweep_dirty`](super::Bfc::sweep_dirty)). Cleared when the chunk is handed out or merged with
/// a chunk that is not clean; kept by both halves of a split.
const CLEAN: usize = 4;
const FLAGS: usize = 0b111;

/// One chunk record: 32 bytes on 64-bit targets.
///
/// Invariants (checked by [`Bfc::check`](super::Bfc::check)):
/// - `prev`/`next` are the address neighbours inside the same region:
///   `prev.ptr + prev.size == ptr` and `ptr + size == next.ptr`;
/// - a free chunk is linked into exactly the bin of its size through `free_prev`/`free_next`;
///   an in-use chunk has both set to `None`;
/// - no two address neighbours are both free.
#[derive(Clone, Copy, Debug, Default)]
pub struct Chunk {
    pub(crate) ptr: usize,
    /// Size in bytes (a multiple of the granule, so its low three bits are zero) or-ed with the
    /// flag bits: [`IN_USE`], [`CACHED`] or [`AGED`] (bit 1), [`CLEAN`].
    size_flags: usize,
    pub(crate) prev: Option<ChunkHandle>,
    pub(crate) next: Option<ChunkHandle>,
    pub(crate) free_prev: Option<ChunkHandle>,
    pub(crate) free_next: Option<ChunkHandle>,
}

#[cfg(target_pointer_width = "64")]
static_assertions::const_assert_eq!(core::mem::size_of::<Chunk>(), 32);
static_assertions::const_assert_eq!(core::mem::size_of::<Option<ChunkHandle>>(), 4);

impl Chunk {
    /// An unused record. All-zero bytes are also a valid `Chunk`, so zero-filled memory (a fresh
    /// anonymous mapping) can back a table without initialisation.
    pub const EMPTY: Chunk = Chunk {
        ptr: 0,
        size_flags: 0,
        prev: None,
        next: None,
        free_prev: None,
        free_next: None,
    };

    /// Start address of the chunk.
    #[inline]
    pub fn ptr(&self) -> usize {
        self.ptr
    }

    /// Size in bytes.
    #[inline]
    pub fn size(&self) -> usize {
        self.size_flags & !FLAGS
    }

    /// Whether the chunk is unavailable to the bins: handed out, or held in a quick list.
    #[inline]
    pub fn in_use(&self) -> bool {
        self.size_flags & IN_USE != 0
    }

    /// Whether the chunk is held in a quick list (free to callers, not yet coalesced).
    #[inline]
    pub fn cached(&self) -> bool {
        self.size_flags & (IN_USE | CACHED) == IN_USE | CACHED
    }

    /// Whether the chunk is handed out to a caller.
    #[inline]
    pub fn allocated(&self) -> bool {
        self.size_flags & (IN_USE | CACHED) == IN_USE
    }

    #[inline]
    pub(crate) fn set_size(&mut self, size: usize) {
        debug_assert_eq!(size & FLAGS, 0);
        self.size_flags = size | (self.size_flags & FLAGS);
    }

    #[inline]
    pub(crate) fn set_in_use(&mut self, in_use: bool) {
        self.size_flags = self.size() | in_use as usize;
    }

    /// Whether the chunk is free and known to have its pages returned (see
    /// [`Bfc::sweep_dirty`](super::Bfc::sweep_dirty)).
    #[inline]
    pub fn clean(&self) -> bool {
        self.size_flags & CLEAN != 0
    }

    #[inline]
    pub(crate) fn set_clean(&mut self, clean: bool) {
        self.size_flags = (self.size_flags & !CLEAN) | if clean { CLEAN } else { 0 };
    }

    /// Whether the chunk is free and was already free and unchanged at the last sweep.
    #[inline]
    pub fn aged(&self) -> bool {
        self.size_flags & (IN_USE | AGED) == AGED
    }

    #[inline]
    pub(crate) fn set_aged(&mut self, aged: bool) {
        debug_assert!(!self.in_use());
        self.size_flags = (self.size_flags & !AGED) | if aged { AGED } else { 0 };
    }

    #[inline]
    pub(crate) fn set_cached(&mut self) {
        self.size_flags = self.size() | IN_USE | CACHED;
    }

    #[inline]
    pub(crate) fn end(&self) -> usize {
        self.ptr + self.size()
    }

    /// Which of the flag bits describe the chunk's memory (the sweep state) rather than its use:
    /// [`CLEAN`], and for a free chunk [`AGED`] (bit 1 of a chunk in use is [`CACHED`]).
    #[inline]
    fn memory_bits(&self) -> usize {
        if self.in_use() {
            CLEAN
        } else {
            CLEAN | AGED
        }
    }

    /// A record for the part of this chunk from `offset` bytes on, about to be split off it: not in
    /// use, clean if this chunk is, and (where this chunk is free) aged if this chunk is. No links.
    #[inline]
    pub(crate) fn tail_from(&self, offset: usize) -> Chunk {
        debug_assert!(offset < self.size() && offset & FLAGS == 0);
        Chunk {
            ptr: self.ptr + offset,
            size_flags: (self.size() - offset) | (self.size_flags & self.memory_bits()),
            ..Chunk::EMPTY
        }
    }

    /// Grows this chunk by `next`, its address successor, merged into it: the result is clean only
    /// if both were and, where this chunk is free, aged only if both were. Its other state stays.
    #[inline]
    pub(crate) fn absorb(&mut self, next: &Chunk) {
        debug_assert_eq!(self.end(), next.ptr);
        // This chunk's memory bits survive where `next` has them too.
        let theirs = next.size_flags & next.memory_bits();
        self.size_flags = (self.size_flags + next.size()) & !(self.memory_bits() & !theirs);
    }
}

/// The chunk table: caller-provided storage plus the recycling state.
///
/// Invariant: slots `[0, high_water)` have been used at least once; every slot in that range is either
/// live (reachable from a region's chunk list) or on the free-slot list starting at `free_slot`.
pub(crate) struct ChunkTable<T> {
    storage: T,
    /// Head of the recycled-slot list (linked through `free_next`).
    free_slot: Option<ChunkHandle>,
    /// Number of slots ever handed out.
    high_water: usize,
    /// Number of live records.
    live: usize,
}

/// Storage for the engine's chunk table: a fixed slice of records, handed to [`Bfc::new`].
///
/// # Safety
///
/// For as long as the engine holds the value, `as_ref` and `as_mut` return the same records on
/// every call: a slice of the same length (it may move with the value, as an array does), whose
/// contents change only through the engine. The table indexes it without bounds checks, below
/// the length it reads from it, and follows handles it stored in the records. (`AsRef` and `AsMut` are
/// safe traits, so a safe implementation could return a shorter or another slice; hence this
/// promise.)
///
/// [`Bfc::new`]: super::Bfc::new
pub unsafe trait ChunkStorage: AsRef<[Chunk]> + AsMut<[Chunk]> {}

// SAFETY: a borrowed slice is the same slice for the whole borrow, and the borrow is exclusive.
unsafe impl ChunkStorage for &mut [Chunk] {}

// SAFETY: an array's slice is the array itself, of fixed length.
unsafe impl<const N: usize> ChunkStorage for [Chunk; N] {}

// SAFETY: a vector's slice changes only through `&mut Vec` methods that change its length or
// capacity; the engine calls none (it only indexes the slice), and it owns the vector.
#[cfg(feature = "std")]
unsafe impl ChunkStorage for std::vec::Vec<Chunk> {}

// SAFETY: a boxed slice has a fixed length and moves only with its box, which the engine owns.
#[cfg(feature = "std")]
unsafe impl ChunkStorage for std::boxed::Box<[Chunk]> {}

impl<T: ChunkStorage> ChunkTable<T> {
    pub(crate) fn new(storage: T) -> Self {
        ChunkTable {
            storage,
            free_slot: None,
            high_water: 0,
            live: 0,
        }
    }

    /// Usable capacity in records (`u32::MAX - 1` at most, so every index fits a handle).
    #[inline]
    pub(crate) fn capacity(&self) -> usize {
        self.storage.as_ref().len().min(u32::MAX as usize - 1)
    }

    #[inline]
    pub(crate) fn high_water(&self) -> usize {
        self.high_water
    }

    #[inline]
    pub(crate) fn live(&self) -> usize {
        self.live
    }

    /// Takes a slot for a new record, or `None` when the table is full.
    #[inline]
    pub(crate) fn alloc(&mut self, chunk: Chunk) -> Option<ChunkHandle> {
        let h = match self.free_slot {
            Some(h) => {
                self.free_slot = self.get(h).free_next;
                h
            }
            None => {
                if self.high_water == self.capacity() {
                    return None;
                }
                self.high_water += 1;
                ChunkHandle::from_index(self.high_water - 1)
            }
        };
        self.live += 1;
        *self.get_mut(h) = chunk;
        Some(h)
    }

    /// Returns the slot of `h` for reuse.
    #[inline]
    pub(crate) fn free(&mut self, h: ChunkHandle) {
        let head = self.free_slot;
        let c = self.get_mut(h);
        *c = Chunk::EMPTY;
        c.free_next = head;
        self.free_slot = Some(h);
        self.live -= 1;
    }

    #[inline]
    pub(crate) fn get(&self, h: ChunkHandle) -> &Chunk {
        debug_assert!(h.index() < self.high_water);
        let slots = self.storage.as_ref();
        // SAFETY: handles are only created by `alloc`, which hands out indices below
        // `high_water <= capacity() <= slots.len()`, and the slice never changes (`ChunkStorage`).
        unsafe { slots.get_unchecked(h.index()) }
    }

    #[inline]
    pub(crate) fn get_mut(&mut self, h: ChunkHandle) -> &mut Chunk {
        debug_assert!(h.index() < self.high_water);
        let slots = self.storage.as_mut();
        // SAFETY: as in `get`.
        unsafe { slots.get_unchecked_mut(h.index()) }
    }

    /// The record of `h`, or `None` for a handle past every record handed out (a corrupted link,
    /// which the invariant checker reports instead of following).
    pub(crate) fn get_checked(&self, h: ChunkHandle) -> Option<&Chunk> {
        (h.index() < self.high_water).then(|| self.get(h))
    }

    /// Iterates the recycled-slot list (for the invariant checker). A handle out of range (a
    /// corrupted link) is yielded but not followed.
    pub(crate) fn free_slots(&self) -> impl Iterator<Item = ChunkHandle> + '_ {
        let mut cur = self.free_slot;
        core::iter::from_fn(move || {
            let h = cur?;
            cur = self.get_checked(h).and_then(|c| c.free_next);
            Some(h)
        })
    }
}

#[cfg(test)]
mod tests {
    /// (Here, not with the engine's tests: it corrupts the table's counters, private to this
    /// module.)
    #[test]
    #[cfg(feature = "std")]
    fn the_engine_checker_sees_table_counters_that_do_not_add_up() {
        extern crate std;
        use crate::core::{sim::SimSource, Bfc, Chunk, Config};
        let mut b: Bfc<SimSource, std::vec::Vec<Chunk>> = Bfc::new(
            Config::device(1 << 30),
            SimSource::new(1 << 40, 1 << 36),
            std::vec![Chunk::EMPTY; 64],
        )
        .unwrap();
        let p = b.allocate(256, 1).unwrap();
        b.allocate(256, 1).unwrap();
        b.deallocate(p).unwrap();
        assert_eq!(b.check(), Ok(()));
        // A high-water mark past the storage (the checker must not read past it).
        let hw = b.table.high_water;
        b.table.high_water = b.table.capacity() + 1;
        assert_eq!(
            b.check().unwrap_err().what,
            "chunk table high-water mark beyond its capacity"
        );
        // One slot handed out that is neither live nor recycled.
        b.table.high_water = hw + 1;
        assert_eq!(
            b.check().unwrap_err().what,
            "recycled and live chunk records do not add up"
        );
        b.table.high_water = hw;
        assert_eq!(b.check(), Ok(()));
        // One live record fewer than the regions hold: the walk of a region's chunk list stops
        // there (the bound that keeps a cycle from hanging the checker).
        b.table.live -= 1;
        assert_eq!(
            b.check().unwrap_err().what,
            "chunk list longer than the live records (cycle?)"
        );
        b.table.live += 1;
        assert_eq!(b.check(), Ok(()));
    }

    /// Debug builds: a handle past every record handed out is caught before the unchecked read.
    #[test]
    #[cfg(all(feature = "std", debug_assertions))]
    #[should_panic(expected = "h.index() < self.high_water")]
    fn a_handle_past_the_high_water_mark_is_caught_in_debug_builds() {
        extern crate std;
        let mut t = super::ChunkTable::new(std::vec![super::Chunk::EMPTY; 4]);
        let h = t.alloc(super::Chunk::EMPTY).unwrap();
        let _ = t.get(h);
        t.get(super::ChunkHandle::from_index(h.index() + 1));
    }
}
