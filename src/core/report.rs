//! Statistics, errors and the out-of-memory report.

use core::fmt;

use super::bins::NUM_GROUPS;

/// Counters in the spirit of TensorFlow's `AllocatorStats`, plus fragmentation and metadata cost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Number of successful allocations since creation. (The host allocator counts small blocks as
    /// they leave its slab layer, so blocks served from a thread cache are not counted; see
    /// `GlobalBfc::stats`.)
    pub num_allocs: u64,
    /// Bytes in chunks currently handed out (chunk sizes, i.e. after rounding).
    pub bytes_in_use: usize,
    /// High-water mark of `bytes_in_use`.
    pub peak_bytes_in_use: usize,
    /// Largest single chunk ever handed out.
    pub largest_alloc_size: usize,
    /// Cap on `bytes_reserved`.
    pub bytes_limit: usize,
    /// Bytes in regions currently obtained from the memory source.
    pub bytes_reserved: usize,
    /// High-water mark of `bytes_reserved`.
    pub peak_bytes_reserved: usize,
    /// Size of the largest free chunk.
    pub largest_free_block: usize,
    /// Number of chunks in use.
    pub num_chunks_in_use: usize,
    /// Number of free chunks in the bins.
    pub num_free_chunks: usize,
    /// Number of freed chunks held in quick lists or, on the host, thread caches (free to callers,
    /// not yet back in the bins or slabs).
    pub num_cached_chunks: usize,
    /// Their total size.
    pub bytes_cached: usize,
    /// Number of regions.
    pub num_regions: usize,
    /// Bytes of metadata kept outside the managed memory: chunk records ever used plus the touched
    /// prefix of the regions' pointer maps (what can be resident; the rest is never written).
    pub metadata_bytes: usize,
}

impl Stats {
    /// Free bytes inside reserved regions (0 for counters that say more is in use than reserved,
    /// which only a hand-built value can).
    pub fn bytes_free(&self) -> usize {
        self.bytes_reserved.saturating_sub(self.bytes_in_use)
    }

    /// External fragmentation: `1 - largest_free_block / bytes_free` (0 when nothing is free).
    pub fn fragmentation(&self) -> f64 {
        let free = self.bytes_free();
        if free == 0 {
            0.0
        } else {
            1.0 - self.largest_free_block as f64 / free as f64
        }
    }

    /// Metadata as a fraction of the bytes in use (0 when nothing is in use; `Display` then says
    /// "nothing in use" instead of a percentage).
    pub fn metadata_overhead(&self) -> f64 {
        if self.bytes_in_use == 0 {
            0.0
        } else {
            self.metadata_bytes as f64 / self.bytes_in_use as f64
        }
    }
}

impl fmt::Display for Stats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "num_allocs:          {}", self.num_allocs)?;
        writeln!(f, "bytes_in_use:        {}", self.bytes_in_use)?;
        writeln!(f, "peak_bytes_in_use:   {}", self.peak_bytes_in_use)?;
        writeln!(f, "largest_alloc_size:  {}", self.largest_alloc_size)?;
        writeln!(f, "bytes_limit:         {}", self.bytes_limit)?;
        writeln!(f, "bytes_reserved:      {}", self.bytes_reserved)?;
        writeln!(f, "peak_bytes_reserved: {}", self.peak_bytes_reserved)?;
        writeln!(f, "largest_free_block:  {}", self.largest_free_block)?;
        writeln!(f, "fragmentation:       {:.4}", self.fragmentation())?;
        writeln!(
            f,
            "chunks in use/free/cached: {}/{}/{} ({} B cached)",
            self.num_chunks_in_use, self.num_free_chunks, self.num_cached_chunks, self.bytes_cached
        )?;
        writeln!(f, "regions:             {}", self.num_regions)?;
        write!(f, "metadata_bytes:      {}", self.metadata_bytes)?;
        if self.bytes_in_use == 0 {
            write!(f, " (nothing in use)")
        } else {
            write!(f, " ({:.2}% of in use)", self.metadata_overhead() * 100.0)
        }
    }
}

/// Free chunks of one power-of-two size range, for the out-of-memory report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BinSummary {
    /// Number of free chunks in the range.
    pub count: u32,
    /// Their total size in bytes.
    pub bytes: usize,
}

/// What the engine looked like when an allocation failed (TensorFlow's `DumpMemoryLog` in a value).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OomReport {
    /// Bytes asked for.
    pub requested: usize,
    /// Bytes that had to be found (rounded to the granule, plus alignment slack).
    pub needed: usize,
    /// Counters at the time of failure.
    pub stats: Stats,
    /// Why growth failed.
    pub cause: OomCause,
    /// Granule in bytes (the summary's size ranges are in granules times this).
    pub granule: usize,
    /// Free chunks grouped by size: entry 0 holds chunks of 1..16 granules, entry `i >= 1` chunks of
    /// `2^(i+3) ..= 2^(i+4) - 1` granules.
    pub free_by_size: [BinSummary; NUM_GROUPS],
}

/// Why the engine could not find or obtain memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OomCause {
    /// Growing would exceed the memory limit.
    LimitReached,
    /// The memory source refused every size down to the request.
    SourceRefused,
    /// Growth is disabled and the up-front region has no fitting chunk.
    NoGrowth,
    /// The chunk table is full.
    ChunkTableFull,
    /// The fixed region table is full.
    RegionTableFull,
}

impl OomCause {
    /// What the cause means, and what can be changed.
    fn explain(self) -> &'static str {
        match self {
            OomCause::LimitReached => {
                "growing would pass the memory limit; free blocks or raise the limit"
            }
            OomCause::SourceRefused => "the memory source refused to grow the pool",
            OomCause::NoGrowth => {
                "growth is off and no free chunk fits; free blocks or raise the limit"
            }
            OomCause::ChunkTableFull => {
                "the chunk table is full; give it more records (the table given to Bfc::new; \
                 chunk_capacity in the host and device options)"
            }
            OomCause::RegionTableFull => {
                "all 64 regions are in use; use a larger initial_region_size"
            }
        }
    }
}

impl fmt::Display for OomReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.stats;
        write!(
            f,
            "out of memory ({:?}: {}): requested {} B (needs {} B); in use {} B, reserved {} B, \
             limit {} B, largest free block {} B, fragmentation {:.3}; free chunks:",
            self.cause,
            self.cause.explain(),
            self.requested,
            self.needed,
            s.bytes_in_use,
            s.bytes_reserved,
            s.bytes_limit,
            s.largest_free_block,
            s.fragmentation()
        )?;
        let mut any = false;
        for (i, b) in self.free_by_size.iter().enumerate() {
            if b.count == 0 {
                continue;
            }
            any = true;
            // (Saturating: a hand-built report may name groups past the address space.)
            let granules = |shift: usize| {
                u32::try_from(shift)
                    .ok()
                    .and_then(|s| 1usize.checked_shl(s))
                    .unwrap_or(usize::MAX)
            };
            let (lo, hi) = if i == 0 {
                (1, 16)
            } else {
                (granules(i + 3), granules(i + 4))
            };
            write!(
                f,
                " [{}..{}) B: {} chunks, {} B;",
                lo.saturating_mul(self.granule),
                hi.saturating_mul(self.granule),
                b.count,
                b.bytes
            )?;
        }
        if !any {
            write!(f, " none")?;
        }
        Ok(())
    }
}

/// Why an allocation failed.
#[derive(Clone, Copy, Debug, PartialEq)]
#[allow(
    clippy::large_enum_variant,
    reason = "no allocator to box the report with; errors are rare"
)]
pub enum AllocError {
    /// No memory: the report says how the engine was occupied.
    OutOfMemory(OomReport),
    /// The alignment is not a power of two, or too large for any region.
    BadAlignment {
        /// The requested alignment.
        align: usize,
    },
    /// The size overflows the address space once rounded.
    TooLarge {
        /// The requested size.
        size: usize,
    },
    /// The block the engine picked would end past the caller's bound
    /// ([`Bfc::allocate_block_below`](super::Bfc::allocate_block_below)); nothing was handed out.
    BeyondBound {
        /// The bound.
        bound: usize,
        /// Where the block the engine picked would have ended (past `bound`).
        end: usize,
    },
}

impl fmt::Display for AllocError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AllocError::OutOfMemory(r) => r.fmt(f),
            AllocError::BadAlignment { align } => write!(
                f,
                "unsupported alignment {align}: it must be a power of two, at most {}",
                super::MAX_ALIGN
            ),
            AllocError::TooLarge { size } => write!(
                f,
                "size {size} is too large: rounded up to the granule, with room for its \
                 alignment, it exceeds isize::MAX"
            ),
            AllocError::BeyondBound { bound, end } => {
                write!(
                    f,
                    "the block would end at {end:#x}, past the bound {bound:#x}"
                )
            }
        }
    }
}

/// Why a pointer handed back to the engine was rejected. Nothing is changed when this is returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FreeError {
    /// The address is in none of the engine's regions.
    NotOwned {
        /// The rejected address.
        ptr: usize,
    },
    /// The address lies in a free chunk: a double free, or a pointer that was never handed out.
    DoubleFree {
        /// The rejected address.
        ptr: usize,
    },
    /// The address points into the middle of an allocated block, not to its start.
    Interior {
        /// The rejected address.
        ptr: usize,
        /// Start of the block it points into.
        block: usize,
    },
}

impl fmt::Display for FreeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            FreeError::NotOwned { ptr } => {
                write!(
                    f,
                    "free of pointer {ptr:#x} that this allocator does not own"
                )
            }
            FreeError::DoubleFree { ptr } => write!(
                f,
                "double free of pointer {ptr:#x} (it is not currently allocated)"
            ),
            FreeError::Interior { ptr, block } => write!(
                f,
                "free of pointer {ptr:#x} into the middle of the block at {block:#x}"
            ),
        }
    }
}

/// A broken invariant found by [`Bfc::check`](super::Bfc::check).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CheckError {
    /// Which invariant.
    pub what: &'static str,
    /// Address of the chunk (or region) concerned; `None` when not about one.
    pub at: Option<usize>,
}

impl fmt::Display for CheckError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.at {
            None => write!(f, "heap invariant broken: {}", self.what),
            Some(at) => write!(f, "heap invariant broken at {at:#x}: {}", self.what),
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for AllocError {}
#[cfg(feature = "std")]
impl std::error::Error for FreeError {}
#[cfg(feature = "std")]
impl std::error::Error for CheckError {}
