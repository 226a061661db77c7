//! The arena and its metadata reservation: the memory source the host heap's engine draws from.

use core::ptr::NonNull;

use super::small::{self, SmallHeap};
#[cfg(feature = "std")]
use super::tcache;
use super::{os, Anchor};
use crate::core::{Chunk, ChunkHandle, MemorySource};

/// Largest alignment of the arena base (and so of any region-aligned request).
pub(super) const ARENA_ALIGN: usize = 2 << 20;

/// Arena commit step: the arena is made accessible (and, under strict overcommit, charged) this
/// much at a time, as the heap's highest handed-out byte approaches the committed end.
pub(super) const COMMIT_STEP: usize = 2 << 20;

/// Chunk-table commit step, in bytes (2,048 records).
pub(super) const TABLE_STEP: usize = 64 << 10;

/// Arena bytes per medium-table entry (see `medium.rs`).
#[cfg(feature = "std")]
const MEDIUM_WINDOW_SHIFT: u32 = super::medium::WINDOW_SHIFT;
#[cfg(not(feature = "std"))]
const MEDIUM_WINDOW_SHIFT: u32 = 14;

/// Chunk records kept committed beyond the touched ones before an engine call: a call makes at most
/// two (see `Bfc::records_touched`).
pub(super) const RECORD_SLACK: usize = 4;

/// A part of a reservation made accessible from its start on demand (see `os::commit`): its first
/// `done` bytes are readable and writable, the rest not (yet, or no longer: the arena's prefix
/// shrinks when the heap's free top goes back, [`HostSource::decommit_arena`]).
#[derive(Clone, Copy)]
pub(super) struct Prefix {
    pub(super) at: usize,
    /// Bytes of the part (a multiple of the page size).
    pub(super) len: usize,
    pub(super) done: usize,
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
/// metadata reservation sized by the arena alone (span classes and sets, transfer cache, anchor),
/// committed whole, and the medium table, read-only until committed. The arena, the pointer map,
/// the span table, the medium table and the chunk table are committed from their starts
/// as the heap reaches further ([`HostSource::commit_arena`], [`HostSource::commit_records`]), so a
/// heap is charged for what it uses, not for the 64 GiB it reserves.
pub(super) struct HostSource {
    /// Start of the arena (aligned to [`ARENA_ALIGN`]).
    pub(super) arena: usize,
    pub(super) arena_size: usize,
    /// Start of the whole arena reservation (for unmapping).
    pub(super) arena_mapping: NonNull<u8>,
    pub(super) arena_mapping_size: usize,
    /// Pointer-map storage.
    map: NonNull<Option<ChunkHandle>>,
    map_entries: usize,
    /// Whole metadata reservation: the map, then the chunk table.
    pub(super) meta_mapping: NonNull<u8>,
    pub(super) meta_mapping_size: usize,
    /// Whether the arena is currently the engine's region.
    region_out: bool,
    page: usize,
    /// Arena bytes per map entry.
    map_block: usize,
    /// Committed prefixes: of the arena, the map, the chunk table, the span table and the medium
    /// table.
    pub(super) arena_commit: Prefix,
    pub(super) map_commit: Prefix,
    pub(super) table_commit: Prefix,
    pub(super) spans_commit: Prefix,
    /// The medium table's: readable throughout (thread caches read any entry of the arena), written
    /// only where committed.
    pub(super) medium_commit: Prefix,
    /// The highest committed end of the arena so far (an address): the pointer map and span table
    /// stay committed as far as they describe it when the arena's commit moves down.
    reached: usize,
}

impl HostSource {
    /// The source over an arena (its start, aligned to [`ARENA_ALIGN`], and size) in the reservation
    /// `arena_mapping`, with its metadata laid out by `layout` in the reservation `meta_mapping`:
    /// nothing committed yet, the region not handed out.
    pub(super) fn new(
        (arena, arena_size): (usize, usize),
        (arena_mapping, arena_mapping_size): (NonNull<u8>, usize),
        (meta_mapping, meta_mapping_size): (NonNull<u8>, usize),
        layout: &MetaLayout,
        page: usize,
        map_block: usize,
    ) -> Self {
        let meta_base = meta_mapping.as_ptr() as usize;
        let prefix = |at, len| Prefix { at, len, done: 0 };
        HostSource {
            arena,
            arena_size,
            arena_mapping,
            arena_mapping_size,
            map: meta_mapping.cast(),
            map_entries: layout.map_entries,
            meta_mapping,
            meta_mapping_size,
            region_out: false,
            reached: arena,
            page,
            map_block,
            arena_commit: prefix(arena, arena_size),
            map_commit: prefix(meta_base, layout.table_at),
            table_commit: prefix(
                meta_base + layout.table_at,
                layout.spans_at - layout.table_at,
            ),
            spans_commit: prefix(
                meta_base + layout.spans_at,
                layout.medium_at - layout.spans_at,
            ),
            medium_commit: prefix(
                meta_base + layout.medium_at,
                layout.classes_at - layout.medium_at,
            ),
        }
    }

    /// Commits the arena below `end` (an address; capped at the arena's end) with the map,
    /// span-table and medium-table entries that describe it. `false` if the kernel refuses (the
    /// heap then hands nothing out above what is committed).
    #[inline]
    pub(super) fn commit_arena(&mut self, end: usize) -> bool {
        let bytes = end.saturating_sub(self.arena);
        bytes <= self.arena_commit.done || self.commit_arena_slow(bytes)
    }

    #[cold]
    fn commit_arena_slow(&mut self, bytes: usize) -> bool {
        let to = bytes.next_multiple_of(COMMIT_STEP).min(self.arena_size);
        // Metadata first: a refusal then leaves the arena as it was.
        let (map_bytes, spans_bytes, medium_bytes) = self.described_by(to);
        let page = self.page;
        let done = self.map_commit.cover(map_bytes, page)
            && self.spans_commit.cover(spans_bytes, page)
            && self.medium_commit.cover(medium_bytes, page)
            && self.arena_commit.cover(to, COMMIT_STEP);
        self.reached = self.reached.max(self.committed_end());
        done
    }

    /// The highest committed end of the arena so far (an address).
    #[inline]
    pub(super) fn reached_end(&self) -> usize {
        self.reached
    }

    /// Bytes of the pointer map, of the span table and of the medium table that describe the
    /// arena's first `bytes`. A chunk may start at `bytes` itself (the free rest of a block that
    /// ends there), so its entries count too.
    pub(super) fn described_by(&self, bytes: usize) -> (usize, usize, usize) {
        (
            (bytes / self.map_block + 1) * core::mem::size_of::<Option<ChunkHandle>>(),
            ((bytes >> small::SPAN_SHIFT) + 1) * SmallHeap::ENTRY,
            ((bytes >> MEDIUM_WINDOW_SHIFT) + 1) * core::mem::size_of::<u16>(),
        )
    }

    /// Whether what is committed covers what the heap uses: the arena below `brk`, the map, span
    /// and medium-table entries of the committed arena, and the chunk table's first `records`
    /// records.
    pub(super) fn check_commit(&self, brk: usize, records: usize) -> Result<(), &'static str> {
        let (map_bytes, spans_bytes, medium_bytes) = self.described_by(self.arena_commit.done);
        if brk > self.committed_end() {
            Err("memory in use lies past the committed end of the arena")
        } else if map_bytes.min(self.map_commit.len) > self.map_commit.done
            || spans_bytes.min(self.spans_commit.len) > self.spans_commit.done
            || medium_bytes.min(self.medium_commit.len) > self.medium_commit.done
        {
            Err("the pointer map, span table or medium table is not committed as far as the arena")
        } else if records.saturating_mul(core::mem::size_of::<Chunk>()) > self.table_commit.done {
            Err("chunk records in use lie past the committed part of the chunk table")
        } else {
            Ok(())
        }
    }

    /// Stops committing the arena past `end` (an address, rounded up to the commit step): the range
    /// goes back to `PROT_NONE` (`os::decommit`), so strict overcommit and `RLIMIT_DATA` stop
    /// counting it, and a later block there commits it again. The pointer map, span table and
    /// medium table stay committed as far as they were (about 1% of the arena bytes they describe,
    /// and only their touched pages resident).
    ///
    /// # Safety
    /// `end` is at or above the heap's touched end (`Heap::brk`): nothing handed out lies past it,
    /// and what lies past it reads as zero (a refused decommit leaves those pages as they were).
    pub(super) unsafe fn decommit_arena(&mut self, end: usize) {
        let from = end
            .saturating_sub(self.arena)
            .next_multiple_of(COMMIT_STEP)
            .min(self.arena_commit.done);
        let done = self.arena_commit.done;
        // SAFETY: `from` and `done` are multiples of the page size inside the arena's reservation,
        // and the caller guarantees nothing needed lies in between. Whether or not the kernel
        // agreed, the committed end moves down: a range left mapped (as it was, its pages reading
        // as zero) is committed again by a no-op `mprotect`, and a hole the kernel left is mapped
        // again by `decommit` (see there for the one case it does not cover).
        let _ = unsafe { os::decommit(self.arena + from, done - from) };
        self.arena_commit.done = from;
    }

    /// The committed end of the arena (an address).
    #[inline]
    pub(super) fn committed_end(&self) -> usize {
        self.arena + self.arena_commit.done
    }

    /// Commits the chunk table's first `records` records.
    #[inline]
    pub(super) fn commit_records(&mut self, records: usize) -> bool {
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
/// blocks are larger than 16 KiB or aligned to more than 4 KiB (so they have a free chunk of
/// padding, or a neighbour, at least that large), spans are 64 KiB, two free chunks are never
/// neighbours, and the engine keeps no quick lists: a table of one record per 256 bytes runs out
/// long after the arena does. (When it does run out, allocations return null.)
pub(super) const ARENA_BYTES_PER_RECORD: usize = 256;

/// Fewest records a table gets (`HostConfig::validate`'s minimum).
pub(super) const MIN_RECORDS: usize = 16;

/// Where each part of the metadata reservation starts (page-aligned offsets), in order: the
/// pointer map, the chunk table, the span table, the medium table, the span classes, the span
/// sets, the transfer cache and the anchor.
pub(super) struct MetaLayout {
    pub(super) map_entries: usize,
    pub(super) table_at: usize,
    pub(super) spans_at: usize,
    pub(super) span_entries: usize,
    pub(super) classes_at: usize,
    pub(super) sets_at: usize,
    pub(super) set_words: usize,
    pub(super) transfer_at: usize,
    /// The medium table (`std`; none without): an entry per 16 KiB of arena. Read-only until
    /// committed in step with the arena.
    pub(super) medium_at: usize,
    pub(super) medium_entries: usize,
    pub(super) anchor_at: usize,
    /// Bytes of the whole reservation.
    pub(super) size: usize,
}

impl MetaLayout {
    /// The layout for an arena of `arena_size` bytes, a table of `capacity` records, a pointer map
    /// with an entry per `block` bytes, and pages of `page` bytes.
    pub(super) fn new(arena_size: usize, capacity: usize, block: usize, page: usize) -> Self {
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
        #[cfg(feature = "std")]
        let medium_entries = arena_size >> super::medium::WINDOW_SHIFT;
        #[cfg(not(feature = "std"))]
        let medium_entries = 0;
        let medium_bytes = (medium_entries * core::mem::size_of::<u16>()).next_multiple_of(page);
        let anchor_bytes = core::mem::size_of::<Anchor>().next_multiple_of(page);
        let table_at = map_bytes;
        let spans_at = table_at + table_bytes;
        let medium_at = spans_at + spans_bytes;
        let classes_at = medium_at + medium_bytes;
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
            medium_at,
            medium_entries,
            anchor_at,
            size: anchor_at + anchor_bytes,
        }
    }
}

// SAFETY: the heap only moves between threads under the lock; its raw pointers name memory owned by
// the heap alone.
unsafe impl Send for HostSource {}
