//! The invariant checker: a full walk of regions, chunks, bins, the pointer map and the counters.

use super::bins::{bin_for, NUM_BINS};
use super::{Bfc, CheckError, Chunk, ChunkHandle, ChunkStorage, MemorySource};

/// Blocks of one chunk whose map entries are checked individually; the interior of larger chunks is
/// sampled at its ends so that a check stays proportional to the number of chunks, not of bytes.
const MAP_CHECK_BLOCKS: usize = 64;

/// A broken invariant about the chunk or region at `at`.
fn fail(what: &'static str, at: usize) -> Result<(), CheckError> {
    Err(CheckError { what, at: Some(at) })
}

/// A broken invariant about no one chunk (a count, a list).
fn fail_global(what: &'static str) -> Result<(), CheckError> {
    Err(CheckError { what, at: None })
}

impl<S: MemorySource, T: ChunkStorage> Bfc<S, T> {
    /// Verifies every structural invariant and recounts the statistics.
    ///
    /// Checked: regions sorted and disjoint; each region's chunks contiguous, granule-aligned, sizes
    /// summing to the region, `prev`/`next` mutually consistent; no two adjacent free chunks; each free
    /// chunk in exactly the bin of its size and each bin entry free; the bitmaps agree with the bins;
    /// the pointer map names the first chunk of each block; the chunk table's live and recycled
    /// records add up; `bytes_in_use`, `bytes_reserved` and the chunk counts match a recount.
    ///
    /// # Time Complexity
    /// O(chunks + bins).
    pub fn check(&self) -> Result<(), CheckError> {
        let granule = self.config.granule;
        let mut in_use_bytes = 0usize;
        let mut in_use_chunks = 0usize;
        let mut cached_bytes = 0usize;
        let mut cached_chunks = 0usize;
        let mut free_chunks = 0usize;
        let mut reserved = 0usize;
        let mut total_chunks = 0usize;
        let mut last_end = 0usize;
        if self.table.high_water() > self.table.capacity() {
            return fail_global("chunk table high-water mark beyond its capacity");
        }
        for (i, r) in self.regions[..self.num_regions].iter().enumerate() {
            if i > 0 && r.base < last_end {
                return fail("regions overlap or are unsorted", r.base);
            }
            let Some(end) = r.base.checked_add(r.size) else {
                return fail("region wraps around the address space", r.base);
            };
            if r.map_used > r.map_len || r.size.div_ceil(1 << self.block_shift) > r.map_len {
                return fail("region's pointer map shorter than the region", r.base);
            }
            last_end = end;
            reserved += r.size;
            let Some(first) = r.first else {
                return fail("region without chunks", r.base);
            };
            let mut cur = Some(first);
            let mut prev: Option<(ChunkHandle, Chunk)> = None;
            let mut sum = 0usize;
            let mut last_block = usize::MAX;
            while let Some(h) = cur {
                let c = *self.record(h)?;
                total_chunks += 1;
                if total_chunks > self.table.live() {
                    return fail("chunk list longer than the live records (cycle?)", c.ptr());
                }
                if c.size() == 0 || c.size() % granule != 0 || c.ptr() % granule != 0 {
                    return fail("chunk size or address not a granule multiple", c.ptr());
                }
                // (Before the map check, which reads the map entries of the blocks the chunk spans.)
                if c.ptr() < r.base || c.ptr().checked_add(c.size()).is_none_or(|e| e > end) {
                    return fail("chunk runs past its region", c.ptr());
                }
                match prev {
                    None if c.ptr() != r.base || c.prev.is_some() => {
                        return fail("first chunk does not start the region", c.ptr())
                    }
                    Some((ph, pc)) => {
                        if c.prev != Some(ph) || pc.end() != c.ptr() {
                            return fail("address neighbours not contiguous", c.ptr());
                        }
                        if !pc.in_use() && !c.in_use() {
                            return fail("two adjacent free chunks", c.ptr());
                        }
                    }
                    None => {}
                }
                if c.cached() {
                    if !c.in_use() || c.free_prev.is_some() {
                        return fail("cached chunk not marked unavailable, or in a bin", c.ptr());
                    }
                    cached_bytes += c.size();
                    cached_chunks += 1;
                } else if c.in_use() {
                    in_use_bytes += c.size();
                    in_use_chunks += 1;
                    if c.free_prev.is_some() || c.free_next.is_some() {
                        return fail("in-use chunk linked into a bin", c.ptr());
                    }
                } else {
                    free_chunks += 1;
                    // Linked where its bin's list says (the walk of the bins below checks that the
                    // lists hold exactly the free chunks); O(1), so a check stays linear.
                    let linked = match c.free_prev {
                        None => self.bins.head(bin_for(c.size() / granule)) == Some(h),
                        Some(p) => self
                            .table
                            .get_checked(p)
                            .is_some_and(|pc| pc.free_next == Some(h)),
                    };
                    if !linked {
                        return fail("free chunk not in the bin of its size", c.ptr());
                    }
                }
                self.check_map(r, h, &c, &mut last_block)?;
                sum += c.size();
                prev = Some((h, c));
                cur = c.next;
            }
            if sum != r.size {
                return fail("chunk sizes do not sum to the region size", r.base);
            }
        }
        // Bins: every entry a free chunk, in the right bin, with consistent back links. An entry is
        // a live record (a recycled one is empty, checked below), and every live record lies in a
        // region (checked below), so with no list longer than the free chunks (a cycle would be)
        // and as many entries as free chunks, the bins hold each free chunk exactly once.
        let mut binned = 0usize;
        for b in 0..NUM_BINS {
            let mut cur = self.bins.head(b);
            let mut back: Option<ChunkHandle> = None;
            while let Some(h) = cur {
                let c = self.record(h)?;
                binned += 1;
                if binned > free_chunks {
                    return fail("more binned chunks than free chunks (cycle?)", c.ptr());
                }
                if c.size() == 0 {
                    return fail("recycled chunk record in a bin", c.ptr());
                }
                if c.in_use() {
                    return fail("in-use chunk in a bin", c.ptr());
                }
                if bin_for(c.size() / granule) != b {
                    return fail("chunk in the wrong bin", c.ptr());
                }
                if c.free_prev != back {
                    return fail("bin back link broken", c.ptr());
                }
                back = Some(h);
                cur = c.free_next;
            }
        }
        if binned != free_chunks {
            return fail_global("free chunks missing from the bins");
        }
        // Quick lists: right sizes and lengths, cached flag set, totals matching the region walk.
        let (mut listed, mut listed_bytes) = (0usize, 0usize);
        for (g, &head) in self.quick_heads.iter().enumerate() {
            let mut cur = head;
            let mut len = 0usize;
            while let Some(h) = cur {
                let c = self.record(h)?;
                len += 1;
                if !c.cached() || c.size() != g * granule || len > self.config.quick_depth {
                    return fail("quick list holds a wrong chunk or is too long", c.ptr());
                }
                listed_bytes += c.size();
                cur = c.free_next;
            }
            if len != self.quick_len[g] as usize || (g > self.quick_max_g && len > 0) {
                return fail_global("quick list length disagrees");
            }
            listed += len;
        }
        if (listed, listed_bytes) != (cached_chunks, cached_bytes)
            || (cached_chunks, cached_bytes) != (self.cached_chunks, self.cached_bytes)
        {
            return fail_global("cached chunks disagree with the quick lists or the counters");
        }
        if !self.bins.bitmaps_consistent() {
            return fail_global("bin bitmaps disagree with the bins");
        }
        if total_chunks != self.table.live() {
            return fail_global("live chunk records not all reachable from regions");
        }
        // Recycled records: in range and empty (the walk of the bins relies on it: a record with a
        // size is a live one), and as many as the table says.
        let mut recycled = 0usize;
        for h in self.table.free_slots().take(self.table.high_water() + 1) {
            let c = self.record(h)?;
            if c.size() != 0 {
                return fail("recycled chunk record not empty", c.ptr());
            }
            recycled += 1;
        }
        if recycled + self.table.live() != self.table.high_water() {
            return fail_global("recycled and live chunk records do not add up");
        }
        if in_use_bytes != self.stats.bytes_in_use || in_use_chunks != self.in_use_chunks {
            return fail_global("bytes_in_use or chunk count disagrees with a recount");
        }
        if reserved != self.stats.bytes_reserved {
            return fail_global("bytes_reserved disagrees with the regions");
        }
        if self.stats.bytes_in_use > self.stats.peak_bytes_in_use
            || self.stats.bytes_reserved > self.stats.peak_bytes_reserved
            || self.stats.bytes_reserved > self.config.memory_limit
        {
            return fail_global("a peak or the limit is below the current value");
        }
        Ok(())
    }

    /// The record of `h`, or the error for a handle past every record handed out (a corrupted
    /// link: reading it would leave the table).
    fn record(&self, h: ChunkHandle) -> Result<&Chunk, CheckError> {
        self.table.get_checked(h).ok_or(CheckError {
            what: "chunk handle out of range",
            at: None,
        })
    }

    /// The map entry of the block where `c` starts names the first chunk starting in that block, and
    /// the blocks starting inside `c` (the first [`MAP_CHECK_BLOCKS`] and the last) are empty.
    fn check_map(
        &self,
        r: &super::Region,
        h: ChunkHandle,
        c: &Chunk,
        last_block: &mut usize,
    ) -> Result<(), CheckError> {
        let shift = self.block_shift;
        let block = (c.ptr() - r.base) >> shift;
        // (Callers pass blocks of chunks inside `r`, hence below `map_len`.)
        let entry = |b: usize| r.entry(b);
        if block != *last_block {
            if entry(block) != Some(h) {
                return fail(
                    "pointer map does not name the first chunk of a block",
                    c.ptr(),
                );
            }
            *last_block = block;
        }
        // Blocks that start strictly inside `c` hold no chunk start. The block where `c` ends is
        // one of them when `c` ends inside it and no chunk follows (the region ends mid-block).
        let end_off = c.end() - r.base;
        let end_block = if end_off == r.size {
            end_off.div_ceil(1 << shift)
        } else {
            end_off >> shift
        };
        let inner_end = end_block.min(block + 1 + MAP_CHECK_BLOCKS);
        let last_inner = end_block.checked_sub(1).filter(|&l| l > block);
        for b in (block + 1..inner_end).chain(last_inner) {
            if entry(b).is_some() {
                return fail("pointer map names a chunk inside another chunk", c.ptr());
            }
        }
        Ok(())
    }
}
