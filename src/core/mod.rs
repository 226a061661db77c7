//! The BFC engine: best-fit with coalescing over address ranges it never touches.
//!
//! Lineage: TensorFlow's `BFCAllocator`, itself a lean dlmalloc. High-level model:
//!
//! ```text
//! MemorySource --regions--> Bfc --chunks--> bins (free chunks only)
//!                             \--pointer map (per region, one entry per map block)
//! ```
//!
//! - A *region* is one range obtained from the [`MemorySource`]; chunks never span two regions.
//! - A *chunk* ([`Chunk`]) is a granule-aligned piece of a region, in use or free. Records live in a
//!   caller-provided fixed-capacity table; handles ([`ChunkHandle`]) are indices.
//! - *Bins* hold free chunks by size class (16 classes per power of two, see `bins.rs`), with
//!   a two-level bitmap so finding a fitting bin is O(1) in the number of free chunks.
//! - The *pointer map* finds the chunk of an address on free. TensorFlow keeps one entry per granule,
//!   which at a 16-byte host granule would cost 25% of the memory. Here a region is cut into *map blocks*
//!   of `map_block_granules` granules (32 by default) and the map keeps, per block, the handle of the
//!   first chunk that starts in it (4 bytes per 512 bytes at a 16-byte granule: 0.8%). Lookup walks
//!   at most one block's worth of chunks along the address list. (The host allocator uses 4 KiB
//!   blocks: its engine chunks are mostly larger than that, and a smaller map misses less.)
//!
//! # Fit policy ("good fit")
//!
//! A request of `g` granules first looks at the first [`Config::fit_scan`] chunks of its own class and
//! takes a chunk of exactly its size as soon as it meets one (a class's list is last freed first),
//! otherwise the smallest that fits (ties: lowest address), going on up to 64 chunks until one fits;
//! failing that it takes the head of the first non-empty higher class, every chunk of which is
//! guaranteed to fit. Before the engine grows, or reports out of memory, it looks at every chunk of
//! the request's own class, so a free chunk that fits is never passed over for good; and when the
//! chunk table is full and the chunk found would need a record for its padding or its tail, it
//! looks for one that serves the request whole. TensorFlow's exact best fit
//! (smallest size, then lowest address, kept in `std::set`s) costs O(log n) per operation; the
//! fragmentation difference on a random workload is measured in `tests/fragmentation.rs`.
//!
//! # Split and merge
//!
//! A chunk of `s` bytes chosen for a request of `r` (rounded) bytes is split when
//! `s >= split_ratio * r` or `s - r >= max_internal_fragmentation` (TensorFlow: 2 and 128 MiB);
//! otherwise the whole chunk is handed out. Alignment padding in front is always split off as a free
//! chunk. On free a chunk merges with both address neighbours when they are free, so no two adjacent
//! chunks are ever both free.
//!
//! # Quick lists
//!
//! Freed chunks of at most [`Config::quick_max_size`] bytes can be held, uncoalesced, in per-size LIFO
//! *quick lists* (dlmalloc's fastbins, glibc's tcache), at most [`Config::quick_depth`] per size, so a
//! block freed and requested again costs a list pop instead of a merge and a split. The bound on
//! memory held this way is `quick_depth * sum(sizes up to quick_max_size)` (1 MiB with the host
//! defaults). Quick lists are threaded through the chunk records, never through the managed memory,
//! and are flushed into the bins before growing, before releasing regions, and on
//! [`Bfc::flush_quick_lists`]. They are off in [`Config::device`].
//!
//! # Growth
//!
//! With `allow_growth` the first region is `initial_region_size` and each new one doubles (as big as
//! the request needs); without it one region of `memory_limit` is taken on first use. When the source
//! refuses, the size backs off by 0.9 at most [`MAX_BACKOFF_STEPS`] times, then halves, down to
//! the request (TensorFlow backs off by 0.9 all the way): a source that refuses everything is asked
//! `17 + log2(first size / request)` times at most per growth (an allocation grows at most twice:
//! again after returning fully free regions). `memory_limit` caps `bytes_reserved`.
//! Before reporting out-of-memory, fully free regions are returned to the source and growth is tried
//! once more.

mod bins;
mod check;
mod chunk;
mod report;
mod source;

use core::ptr::NonNull;

pub use bins::NUM_BINS;
pub use chunk::{Chunk, ChunkHandle, ChunkStorage};
pub use report::{AllocError, BinSummary, CheckError, FreeError, OomCause, OomReport, Stats};
pub use source::MemorySource;

use bins::{bin_for, bin_lower_bound, Bins, NUM_GROUPS};
use chunk::ChunkTable;

/// Maximum number of live regions.
pub const MAX_REGIONS: usize = 64;

/// Largest supported alignment: 2^40 bytes on 64-bit targets, a quarter of the address space on
/// smaller ones.
pub const MAX_ALIGN: usize = if usize::BITS > 41 {
    1 << 40
} else {
    1 << (usize::BITS - 2)
};

/// Largest alignment asked of the source for a region; bigger alignments are met by padding.
const REGION_ALIGN_MAX: usize = 1 << 21;

/// Engine parameters. Use [`Config::device`] or [`Config::host`] and adjust.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// Allocation unit in bytes: a power of two from 8 to 2 MiB. Every chunk size and address is a
    /// multiple.
    pub granule: usize,
    /// Cap on the bytes obtained from the source.
    pub memory_limit: usize,
    /// Grow by doubling regions (`true`) or take one region of `memory_limit` on first use.
    pub allow_growth: bool,
    /// First region size when growing.
    pub initial_region_size: usize,
    /// Split when the chunk is at least this many times the request (0: never by ratio).
    pub split_ratio: usize,
    /// Split when the leftover would be at least this many bytes.
    pub max_internal_fragmentation: usize,
    /// How many chunks of the request's own class are examined for the best fit (at least 1).
    pub fit_scan: usize,
    /// Granules per pointer-map block: a power of two. Larger saves map memory, smaller shortens lookups.
    pub map_block_granules: usize,
    /// Largest chunk (bytes) kept in a quick list when freed; 0 disables them. At most
    /// [`QUICK_MAX_GRANULES`] granules.
    pub quick_max_size: usize,
    /// Chunks kept per quick-list size.
    pub quick_depth: usize,
}

/// Chunks of a class whose chunks may not all fit that an allocation looks at before it moves to a
/// higher class (at least `fit_scan`); before growing, or failing, it looks at them all.
const FAST_SCAN: usize = 64;

/// Largest quick-list size in granules.
pub const QUICK_MAX_GRANULES: usize = 64;

/// Steps of the 0.9 back-off when the source refuses a region (to 0.9^16, about 0.19 of the size
/// first asked for), before the engine halves the size at each refusal down to the request: a
/// growth from 8 GiB for a 256-byte request asks the source at most 40 times (TensorFlow's
/// unbounded 0.9 steps: 149).
pub const MAX_BACKOFF_STEPS: usize = 16;

impl Config {
    /// TensorFlow's device settings: 256-byte granule, split at 2x or 128 MiB waste, growth from 2 MiB.
    pub const fn device(memory_limit: usize) -> Self {
        Config {
            granule: 256,
            memory_limit,
            allow_growth: true,
            initial_region_size: 2 << 20,
            split_ratio: 2,
            max_internal_fragmentation: 128 << 20,
            fit_scan: 8,
            map_block_granules: 32,
            quick_max_size: 0,
            quick_depth: 0,
        }
    }

    /// Host settings: 16-byte granule, a split whenever at least one granule would be left over, and
    /// quick lists up to 1 KiB, 32 deep.
    pub const fn host(memory_limit: usize) -> Self {
        Config {
            granule: 16,
            memory_limit,
            allow_growth: false,
            initial_region_size: memory_limit,
            split_ratio: 2,
            max_internal_fragmentation: 16,
            fit_scan: 8,
            map_block_granules: 32,
            quick_max_size: 1024,
            quick_depth: 32,
        }
    }

    /// Bytes of arena each pointer-map entry describes.
    const fn map_block(&self) -> usize {
        self.granule * self.map_block_granules
    }

    /// An engine's first region size (0 without growth).
    const fn first_region_size(&self) -> usize {
        if !self.allow_growth {
            return 0;
        }
        match round_up(self.initial_region_size, self.granule) {
            Some(size) => size,
            None => usize::MAX,
        }
    }

    /// A new engine's statistics.
    fn initial_stats(&self) -> Stats {
        Stats {
            bytes_limit: self.memory_limit,
            ..Stats::default()
        }
    }

    /// The largest size the quick lists keep, in granules (0 without quick lists).
    const fn quick_max_granules(&self) -> usize {
        if self.quick_depth == 0 {
            0
        } else {
            self.quick_max_size >> self.granule.trailing_zeros()
        }
    }

    /// Checks the parameters; `Err` names the first bad one.
    pub const fn validate(&self) -> Result<(), &'static str> {
        if !self.granule.is_power_of_two() || self.granule < 8 || self.granule > REGION_ALIGN_MAX {
            return Err("granule must be a power of two from 8 to 2 MiB");
        }
        if self.fit_scan == 0 {
            return Err("fit_scan must be at least 1");
        }
        if !self.map_block_granules.is_power_of_two() {
            return Err("map_block_granules must be a power of two");
        }
        if self.granule.checked_mul(self.map_block_granules).is_none() {
            return Err("granule * map_block_granules overflows");
        }
        if self.quick_max_size / self.granule > QUICK_MAX_GRANULES
            || self.quick_depth > u16::MAX as usize
        {
            return Err("quick_max_size above 64 granules or quick_depth above 65535");
        }
        if self.allow_growth && self.initial_region_size == 0 {
            return Err("initial_region_size must not be 0 with allow_growth");
        }
        Ok(())
    }
}

/// Why `take` (or the slow path) handed nothing out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Refusal {
    /// Out of memory (reported with an [`OomReport`]).
    Oom(OomCause),
    /// The block would end past the caller's bound, at the address given
    /// ([`AllocError::BeyondBound`]).
    BeyondBound(usize),
}

/// One region obtained from the source.
#[derive(Clone, Copy)]
struct Region {
    base: usize,
    size: usize,
    map: NonNull<Option<ChunkHandle>>,
    map_len: usize,
    /// One past the highest map entry ever written (the map's touched prefix).
    map_used: usize,
    first: Option<ChunkHandle>,
}

impl Region {
    const EMPTY: Region = Region {
        base: 0,
        size: 0,
        map: NonNull::dangling(),
        map_len: 0,
        map_used: 0,
        first: None,
    };

    #[inline]
    fn contains(&self, addr: usize) -> bool {
        addr.wrapping_sub(self.base) < self.size
    }

    /// The map entry of `block` (below `map_len`). Entries from `map_used` on were never written,
    /// so they are `None` without being read: a source may leave that part of the map uncommitted
    /// (see [`MemorySource::alloc_map`]).
    #[inline]
    fn entry(&self, block: usize) -> Option<ChunkHandle> {
        debug_assert!(block < self.map_len);
        if block >= self.map_used {
            return None;
        }
        // SAFETY: `block < map_used <= map_len`, and the map is valid for `map_len` entries until
        // the region is freed.
        unsafe { *self.map.as_ptr().add(block) }
    }
}

/// A block handed out by [`Bfc::allocate_block`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allocated {
    /// Its address.
    pub ptr: usize,
    /// Its size: the chunk's, at least the request rounded up to the granule (what
    /// [`Bfc::usable_size`] reports).
    pub size: usize,
}

/// What a free (or an in-place shrink) did: the bytes released and the free chunk they ended up in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Freed {
    /// Start of the released range.
    pub ptr: usize,
    /// Length of the released range.
    pub size: usize,
    /// Start of the free chunk containing it after coalescing.
    pub merged_ptr: usize,
    /// Size of that free chunk.
    pub merged_size: usize,
}

/// Outcome of [`Bfc::resize_in_place`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resize {
    /// The block now has `size` usable bytes; `freed` is set when its tail was given back.
    Done {
        /// The new chunk size.
        size: usize,
        /// Released tail, if any.
        freed: Option<Freed>,
    },
    /// The block cannot grow in place (its successor is not free or too small).
    Moved,
}

/// The engine. `S` supplies regions, `T` is the storage of the chunk table (a `&mut [Chunk]`, a
/// `Vec<Chunk>`, or memory the caller mapped).
///
/// Not synchronised: wrap it in a lock to share it (see [`GlobalBfc`](crate::GlobalBfc)).
///
/// Dropping the engine gives its free regions (and their pointer maps) back to the source, as
/// [`release_free_regions`](Self::release_free_regions) does. A region that still holds a block in
/// use stays with the source: the engine cannot know when that block's last use ends.
/// With feature `std`, an engine dropped while a panic unwinds gives nothing back (it may be the
/// engine that panicked, and a source that panicked may panic again, which would abort).
///
/// Addresses are numbers to the engine: a source may hand out a region at address 0 (offsets into
/// memory the CPU never touches, a device whose memory starts there), and 0 is then a block
/// address like any other. A caller that needs non-null addresses must not get a region at 0.
///
/// # Example
///
/// The engine over offsets `0..1 MiB` of some memory, with no allocation anywhere (the chunk
/// table and the pointer map are the caller's arrays):
///
/// ```
/// use core::ptr::NonNull;
/// use bfc_alloc::core::{Bfc, Chunk, ChunkHandle, Config, MemorySource};
///
/// /// One region at offset 0, of up to 1 MiB; its pointer map in the caller's array.
/// struct Offsets<'a> {
///     taken: bool,
///     map: &'a mut [Option<ChunkHandle>],
/// }
///
/// // SAFETY: one region at a time, at 0 (aligned to anything), never past 1 MiB, owned by the
/// // engine until freed; the map is the caller's array, zero-filled (all `None`) on each use,
/// // used by nothing else.
/// unsafe impl MemorySource for Offsets<'_> {
///     fn alloc_region(&mut self, size: usize, _align: usize) -> Option<usize> {
///         if self.taken || size > 1 << 20 {
///             return None;
///         }
///         self.taken = true;
///         Some(0)
///     }
///     unsafe fn free_region(&mut self, _base: usize, _size: usize) {
///         self.taken = false;
///     }
///     fn alloc_map(&mut self, _base: usize, entries: usize) -> Option<NonNull<Option<ChunkHandle>>> {
///         let map = self.map.get_mut(..entries)?;
///         map.fill(None);
///         NonNull::new(map.as_mut_ptr())
///     }
///     unsafe fn free_map(&mut self, _base: usize, _map: NonNull<Option<ChunkHandle>>, _n: usize) {}
/// }
///
/// // Device settings: 256-byte granule; one map entry per 8 KiB (32 granules).
/// let mut map = [None; 128];
/// let mut table = [Chunk::EMPTY; 64];
/// let source = Offsets { taken: false, map: &mut map };
/// let mut bfc = Bfc::new(Config::device(1 << 20), source, &mut table[..]).unwrap();
/// let a = bfc.allocate(1000, 256).unwrap();
/// let b = bfc.allocate(5000, 256).unwrap();
/// assert_eq!((a, bfc.usable_size(a).unwrap()), (0, 1024));
/// assert!(b >= 1024 && b % 256 == 0);
/// assert!(bfc.allocate(2 << 20, 256).is_err()); // past the memory limit
/// bfc.deallocate(a).unwrap();
/// bfc.deallocate(b).unwrap();
/// assert!(bfc.deallocate(b).is_err()); // a double free is reported, and changes nothing
/// assert_eq!(bfc.stats().bytes_in_use, 0);
/// assert_eq!(bfc.check(), Ok(()));
/// ```
pub struct Bfc<S: MemorySource, T: ChunkStorage> {
    // Immutable after construction.
    config: Config,
    /// `log2(granule)`.
    granule_shift: u32,
    /// `log2(granule * map_block_granules)`.
    block_shift: u32,

    // Mutable.
    source: S,
    table: ChunkTable<T>,
    bins: Bins,
    /// Live regions sorted by `base`; `regions[..num_regions]` are valid.
    regions: [Region; MAX_REGIONS],
    num_regions: usize,
    /// Size of the next region when growing (doubles).
    next_region_size: usize,
    stats: Stats,
    /// Number of chunks handed out to callers.
    in_use_chunks: usize,
    /// `quick_heads[g]`: LIFO list (through `free_next`) of cached chunks of `g` granules; its length is
    /// `quick_len[g] <= quick_depth`. Every chunk on it has the cached flag.
    quick_heads: [Option<ChunkHandle>; QUICK_MAX_GRANULES + 1],
    quick_len: [u16; QUICK_MAX_GRANULES + 1],
    /// `quick_max_size` in granules.
    quick_max_g: usize,
    /// Sum of the cached chunks' sizes, and their number.
    cached_bytes: usize,
    cached_chunks: usize,
}

// SAFETY: the raw map pointers in `regions` point to storage owned exclusively by this engine (the
// source's contract); moving the engine to another thread moves that ownership with it.
unsafe impl<S: MemorySource + Send, T: ChunkStorage + Send> Send for Bfc<S, T> {}

impl<S: MemorySource, T: ChunkStorage> Drop for Bfc<S, T> {
    fn drop(&mut self) {
        // Not while a panic unwinds (with `std`, which can tell): the engine may be the one that
        // panicked, half-updated, and a source that panicked in a free may panic again, which
        // during an unwind aborts the process. The regions then stay with the source. (Without
        // `std` the regions are released regardless.)
        #[cfg(feature = "std")]
        if ::std::thread::panicking() {
            return;
        }
        self.release_free_regions();
    }
}

impl<S: MemorySource, T: ChunkStorage> Bfc<S, T> {
    /// Creates an engine over `source`, with chunk records stored in `table` (its length is the
    /// capacity; its contents are overwritten as needed). Nothing is obtained from the source yet.
    pub fn new(config: Config, source: S, table: T) -> Result<Self, &'static str> {
        config.validate()?;
        // (A literal, not `write_new` into a `MaybeUninit`: returning that costs the caller one
        // more copy of the engine on its stack. `write_new_builds_the_engine_new_builds` checks
        // that both build the same engine.)
        Ok(Bfc {
            config,
            granule_shift: config.granule.trailing_zeros(),
            block_shift: config.map_block().trailing_zeros(),
            source,
            table: ChunkTable::new(table),
            bins: Bins::new(),
            regions: [Region::EMPTY; MAX_REGIONS],
            num_regions: 0,
            next_region_size: config.first_region_size(),
            stats: config.initial_stats(),
            in_use_chunks: 0,
            quick_heads: [None; QUICK_MAX_GRANULES + 1],
            quick_len: [0; QUICK_MAX_GRANULES + 1],
            quick_max_g: config.quick_max_granules(),
            cached_bytes: 0,
            cached_chunks: 0,
        })
    }

    /// [`new`](Self::new), written to `dst` field by field: the engine is about 8 KiB, and a caller that
    /// keeps it elsewhere (the host heap keeps it in its metadata mapping) need not build it on
    /// its stack first. Writes nothing when it fails.
    ///
    /// # Safety
    ///
    /// `dst` is valid for writes of `Self` and aligned. Whatever it held is overwritten, not
    /// dropped.
    #[cfg_attr(
        not(all(feature = "host", unix)),
        allow(dead_code, reason = "the host heap builds its engine in place")
    )]
    pub(crate) unsafe fn write_new(
        dst: *mut Self,
        config: Config,
        source: S,
        table: T,
    ) -> Result<(), &'static str> {
        use core::ptr::addr_of_mut;
        config.validate()?;
        // Every field is written below: this pattern names them all, so a new field fails to
        // compile here until it is written too.
        let _every_field = |b: &Self| {
            let Bfc {
                config: _,
                granule_shift: _,
                block_shift: _,
                source: _,
                table: _,
                bins: _,
                regions: _,
                num_regions: _,
                next_region_size: _,
                stats: _,
                in_use_chunks: _,
                quick_heads: _,
                quick_len: _,
                quick_max_g: _,
                cached_bytes: _,
                cached_chunks: _,
            } = b;
        };
        // SAFETY: `dst` is valid for writes and aligned (the caller's contract), so is each of its
        // fields; each is written once, by value or element by element.
        unsafe {
            addr_of_mut!((*dst).config).write(config);
            addr_of_mut!((*dst).granule_shift).write(config.granule.trailing_zeros());
            addr_of_mut!((*dst).block_shift).write(config.map_block().trailing_zeros());
            addr_of_mut!((*dst).source).write(source);
            addr_of_mut!((*dst).table).write(ChunkTable::new(table));
            addr_of_mut!((*dst).bins).write(Bins::new());
            let regions = addr_of_mut!((*dst).regions).cast::<Region>();
            for i in 0..MAX_REGIONS {
                regions.add(i).write(Region::EMPTY);
            }
            addr_of_mut!((*dst).num_regions).write(0);
            addr_of_mut!((*dst).next_region_size).write(config.first_region_size());
            addr_of_mut!((*dst).stats).write(config.initial_stats());
            addr_of_mut!((*dst).in_use_chunks).write(0);
            addr_of_mut!((*dst).quick_heads).write([None; QUICK_MAX_GRANULES + 1]);
            addr_of_mut!((*dst).quick_len).write([0; QUICK_MAX_GRANULES + 1]);
            addr_of_mut!((*dst).quick_max_g).write(config.quick_max_granules());
            addr_of_mut!((*dst).cached_bytes).write(0);
            addr_of_mut!((*dst).cached_chunks).write(0);
        }
        Ok(())
    }

    /// The parameters.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The memory source.
    pub fn source(&self) -> &S {
        &self.source
    }

    /// The memory source, mutably. Not public: the engine holds the source's regions and pointer
    /// maps, so replacing the source (or anything that frees what it handed out) from safe code
    /// would leave the engine using freed memory.
    #[cfg_attr(
        not(any(
            all(feature = "host", unix),
            feature = "cuda",
            all(test, feature = "std")
        )),
        allow(dead_code, reason = "used by the host heap and the device pool")
    )]
    pub(crate) fn source_mut(&mut self) -> &mut S {
        &mut self.source
    }

    /// Allocates `size` bytes aligned to `align` (a power of two) and returns the address.
    ///
    /// The block is at least `size` bytes, rounded up to the granule (it can be larger: a free
    /// chunk is not split when too little would be left over); [`allocate_block`](Self::allocate_block)
    /// and [`usable_size`](Self::usable_size) tell the exact size. Zero-sized requests get one
    /// granule.
    ///
    /// # Time Complexity
    /// O(1) in the number of chunks, plus at most 64 list steps (`fit_scan`, if larger) per size
    /// class searched; before growing, or failing, every chunk of the searched classes is looked
    /// at (see the module docs), and growth calls the source.
    #[allow(
        clippy::result_large_err,
        reason = "the report is the point; the Ok path stays small"
    )]
    pub fn allocate(&mut self, size: usize, align: usize) -> Result<usize, AllocError> {
        self.allocate_block(size, align).map(|b| b.ptr)
    }

    /// [`allocate`](Self::allocate), also returning the block's size (saving a
    /// [`usable_size`](Self::usable_size) lookup).
    #[allow(
        clippy::result_large_err,
        reason = "the report is the point; the Ok path stays small"
    )]
    #[inline]
    pub fn allocate_block(&mut self, size: usize, align: usize) -> Result<Allocated, AllocError> {
        self.allocate_block_below(size, align, usize::MAX)
    }

    /// [`allocate_block`](Self::allocate_block), but only a block that ends at or below `bound`
    /// (an address). When the chunk the engine picks would leave the block past it, nothing is
    /// handed out and the error is [`AllocError::BeyondBound`], which says where that block would
    /// have ended; the caller can make memory up to there usable and try again. The retry usually
    /// picks the same chunk or one that ends lower, but not always: a refusal on the slow path has
    /// flushed the quick lists, and the retry's fast path may then pick a chunk of a larger size
    /// class that ends higher (another refusal to make memory usable for, never a wrong block).
    /// (The host heap passes the end of the arena memory it has committed.)
    #[allow(
        clippy::result_large_err,
        reason = "the report is the point; the Ok path stays small"
    )]
    #[inline]
    pub fn allocate_block_below(
        &mut self,
        size: usize,
        align: usize,
        bound: usize,
    ) -> Result<Allocated, AllocError> {
        if !align.is_power_of_two() || align > MAX_ALIGN {
            return Err(AllocError::BadAlignment { align });
        }
        let granule = self.config.granule;
        let align = align.max(granule);
        let rounded = match round_up(size.max(1), granule) {
            Some(r) if r <= isize::MAX as usize => r,
            _ => return Err(AllocError::TooLarge { size }),
        };
        let needed = match rounded.checked_add(align - granule) {
            Some(n) if n <= isize::MAX as usize => n,
            _ => return Err(AllocError::TooLarge { size }),
        };
        if needed == rounded {
            let g = rounded >> self.granule_shift;
            if g <= self.quick_max_g {
                if let Some(h) = self.quick_heads[g] {
                    if self.table.get(h).end() <= bound {
                        return Ok(self.quick_pop(h, g));
                    }
                }
            }
        }
        let found = match self.find(rounded, align, needed, FAST_SCAN) {
            // A full chunk table (the only way `take` runs out): the slow path is where every
            // failure goes first (it flushes the quick lists, whose cached chunks hold records
            // that coalescing frees, and tries again).
            Some(h) => match self.take(h, rounded, align, bound) {
                Err(Refusal::Oom(_)) => self.allocate_slow(rounded, align, needed, bound),
                r => r,
            },
            None => self.allocate_slow(rounded, align, needed, bound),
        };
        found.map_err(|e| match e {
            Refusal::Oom(cause) => self.oom_error(size, needed, cause),
            Refusal::BeyondBound(end) => AllocError::BeyondBound { bound, end },
        })
    }

    #[cold]
    fn oom_error(&self, size: usize, needed: usize, cause: OomCause) -> AllocError {
        AllocError::OutOfMemory(self.oom_report(size, needed, cause))
    }

    #[cold]
    fn allocate_slow(
        &mut self,
        rounded: usize,
        align: usize,
        needed: usize,
        bound: usize,
    ) -> Result<Allocated, Refusal> {
        if self.cached_chunks > 0 {
            self.flush_quick_lists();
        }
        // Before growing, or failing: every chunk of the classes the fast path looked at only in
        // part (a class holds a range of sizes, and the chunk that fits may lie deep in its list).
        if let Some(h) = self.find(rounded, align, needed, usize::MAX) {
            return match self.take(h, rounded, align, bound) {
                // The chunk found needs a record for its padding or its tail: one that serves the
                // request whole needs none.
                Err(Refusal::Oom(OomCause::ChunkTableFull)) => self
                    .find_whole(rounded, align, bound)
                    .map_or(Err(Refusal::Oom(OomCause::ChunkTableFull)), |h| {
                        self.take(h, rounded, align, bound)
                    }),
                r => r,
            };
        }
        // A new region is aligned to `align` up to 2 MiB, so it needs padding room only beyond that.
        let region_needed = rounded + (align - align.min(REGION_ALIGN_MAX));
        let mut result = self.extend(region_needed, align);
        if result.is_err()
            && self.releasing_could_help(region_needed)
            && self.release_free_regions() > 0
        {
            result = self.extend(region_needed, align);
        }
        // Nothing older fits (the search above), so the block comes from the new region.
        let h = result.map_err(Refusal::Oom)?;
        self.take(h, rounded, align, bound)
    }

    /// Frees the block at `ptr`, coalescing with free neighbours.
    ///
    /// Returns what was released, or an error (and changes nothing) for a pointer that is not the start
    /// of a block in use.
    pub fn deallocate(&mut self, ptr: usize) -> Result<Freed, FreeError> {
        let h = self.lookup_in_use(ptr)?;
        let size = self.table.get(h).size();
        self.stats.bytes_in_use -= size;
        self.in_use_chunks -= 1;
        let g = size >> self.granule_shift;
        if g <= self.quick_max_g && (self.quick_len[g] as usize) < self.config.quick_depth {
            let c = self.table.get_mut(h);
            c.set_cached();
            c.free_next = self.quick_heads[g];
            self.quick_heads[g] = Some(h);
            self.quick_len[g] += 1;
            self.cached_bytes += size;
            self.cached_chunks += 1;
            return Ok(Freed {
                ptr,
                size,
                merged_ptr: ptr,
                merged_size: size,
            });
        }
        self.table.get_mut(h).set_in_use(false);
        let (merged_ptr, merged_size) = self.free_and_coalesce(h);
        Ok(Freed {
            ptr,
            size,
            merged_ptr,
            merged_size,
        })
    }

    /// Size of the block at `ptr` (at least what was asked for).
    pub fn usable_size(&self, ptr: usize) -> Result<usize, FreeError> {
        self.lookup_in_use(ptr).map(|h| self.table.get(h).size())
    }

    /// Grows or shrinks the block at `ptr` to hold `new_size` bytes without moving it, if possible.
    ///
    /// Shrinking always succeeds (the tail is split off and freed when it is at least a granule;
    /// with the chunk table full, the block keeps its size: `Done` with the old size and no
    /// `freed`).
    /// Growing succeeds when the next chunk is free (a chunk held in a quick list counts, and is
    /// taken off it) and large enough. [`Resize::Moved`] means the caller must allocate, copy and
    /// free.
    pub fn resize_in_place(&mut self, ptr: usize, new_size: usize) -> Result<Resize, FreeError> {
        let h = self.lookup_in_use(ptr)?;
        let Some(want) = self.resized(new_size) else {
            return Ok(Resize::Moved);
        };
        let have = self.table.get(h).size();
        if want <= have {
            if want == have {
                return Ok(Resize::Done {
                    size: have,
                    freed: None,
                });
            }
            let Some(tail) = self.split(h, want) else {
                // Chunk table full: keep the block whole, which is still correct.
                return Ok(Resize::Done {
                    size: have,
                    freed: None,
                });
            };
            self.stats.bytes_in_use -= have - want;
            let (merged_ptr, merged_size) = self.free_and_coalesce(tail);
            return Ok(Resize::Done {
                size: want,
                freed: Some(Freed {
                    ptr: ptr + want,
                    size: have - want,
                    merged_ptr,
                    merged_size,
                }),
            });
        }
        let Some((n, mut size)) = self.grow_plan(h, want) else {
            return Ok(Resize::Moved);
        };
        let next_size = self.table.get(n).size();
        // The rest split off below lies inside `n`: its pages are as `n`'s were.
        let next_clean = self.table.get(n).clean();
        if self.table.get(n).cached() {
            self.quick_detach(n, next_size >> self.granule_shift);
            self.table.get_mut(n).set_in_use(false);
        } else {
            self.bins
                .remove(&mut self.table, n, next_size >> self.granule_shift);
        }
        self.merge_next(h);
        if size < have + next_size {
            // (The split cannot fail: the merge freed a record.)
            match self.split(h, want) {
                // The rest merges with the chunk after it if that is free (possible when the
                // successor was a cached chunk, which free neighbours do not merge with).
                Some(t) => {
                    self.table.get_mut(t).set_clean(next_clean);
                    let _ = self.free_and_coalesce(t);
                }
                None => size = have + next_size,
            }
        }
        self.note_in_use_grew(size - have, size);
        Ok(Resize::Done { size, freed: None })
    }

    /// Where the block at `ptr` would end if [`resize_in_place`](Self::resize_in_place) grew it to
    /// `new_size` bytes now: `None` when it would not grow in place (a shrink, a successor in use
    /// or too small, a bad pointer). A caller that must make memory usable before a block reaches
    /// it (the host arena) asks this first. Changes nothing.
    pub fn grown_end(&self, ptr: usize, new_size: usize) -> Option<usize> {
        let h = self.lookup_in_use(ptr).ok()?;
        let want = self.resized(new_size)?;
        if want <= self.table.get(h).size() {
            return None;
        }
        self.grow_plan(h, want).map(|(_, size)| ptr + size)
    }

    /// The size a resize to `new_size` bytes asks for: rounded up to the granule, `None` past
    /// `isize::MAX`.
    fn resized(&self, new_size: usize) -> Option<usize> {
        round_up(new_size.max(1), self.config.granule).filter(|&w| w <= isize::MAX as usize)
    }

    /// How block `h` grows in place to `want` bytes (more than it has): the free (or cached) chunk
    /// after it that it takes, and its size once grown (`want`, or the whole merged chunk when the
    /// rest is too small to split off). `None` when the next chunk is in use or too small.
    fn grow_plan(&self, h: ChunkHandle, want: usize) -> Option<(ChunkHandle, usize)> {
        let c = self.table.get(h);
        let n = c.next?;
        let next = self.table.get(n);
        let total = c.size() + next.size();
        // (A cached chunk is free to callers: `resize_in_place` takes it off its quick list.)
        if next.allocated() || total < want {
            return None;
        }
        let size = if self.should_split(total, want) {
            want
        } else {
            total
        };
        Some((n, size))
    }

    /// Moves every quick-listed chunk into the bins, coalescing it with free neighbours.
    pub fn flush_quick_lists(&mut self) {
        for g in 1..=self.quick_max_g {
            while let Some(h) = self.quick_heads[g] {
                let c = self.table.get_mut(h);
                self.quick_heads[g] = c.free_next;
                c.free_next = None;
                c.set_in_use(false);
                let _ = self.free_and_coalesce(h);
            }
            self.quick_len[g] = 0;
        }
        self.cached_bytes = 0;
        self.cached_chunks = 0;
    }

    /// The first chunk of region `r` if it is the region's only chunk and free (the quick lists
    /// flushed: a cached chunk counts as in use).
    fn free_region_chunk(&self, r: &Region) -> Option<ChunkHandle> {
        let f = r.first?;
        let first = self.table.get(f);
        (!first.in_use() && first.size() == r.size).then_some(f)
    }

    /// Whether giving the fully free regions back could make room for a new region of `needed`
    /// bytes under the limit. (Without growth there is at most one region, and a new one may be
    /// made once it is gone.) A request that cannot fit either way keeps the regions, and their
    /// touched pages, where they are: the host's arena is one region, and an impossible request
    /// must not give it back.
    fn releasing_could_help(&self, needed: usize) -> bool {
        let regions = &self.regions[..self.num_regions];
        let free: usize = regions
            .iter()
            .filter(|r| self.free_region_chunk(r).is_some())
            .map(|r| r.size)
            .sum();
        free > 0 && needed <= self.room_under_limit(self.stats.bytes_reserved - free)
    }

    /// The most a new region may take under the limit while `reserved` bytes are held (whole
    /// granules).
    fn room_under_limit(&self, reserved: usize) -> usize {
        (self.config.memory_limit - reserved) & !(self.config.granule - 1)
    }

    /// Returns every fully free region to the source (after flushing the quick lists). Returns the
    /// bytes released.
    pub fn release_free_regions(&mut self) -> usize {
        self.flush_quick_lists();
        let mut released = 0;
        let mut i = 0;
        while i < self.num_regions {
            let r = self.regions[i];
            if let Some(f) = self.free_region_chunk(&r) {
                self.bins
                    .remove(&mut self.table, f, r.size >> self.granule_shift);
                self.table.free(f);
                self.stats.bytes_reserved -= r.size;
                self.regions.copy_within(i + 1..self.num_regions, i);
                self.num_regions -= 1;
                released += r.size;
                // The engine forgets the region before the source is called: a source that panics
                // (a device back end's free) leaves a consistent engine that no longer has it.
                // SAFETY: the map and region were obtained from the source with exactly these
                // parameters, and the region's only chunk is free, so nothing in it is in use.
                unsafe {
                    self.source.free_map(r.base, r.map, r.map_len);
                    self.source.free_region(r.base, r.size);
                }
            } else {
                i += 1;
            }
        }
        released
    }

    /// Bytes in chunks handed out (same as `stats().bytes_in_use`, cheaper).
    #[inline]
    pub fn bytes_in_use(&self) -> usize {
        self.stats.bytes_in_use
    }

    /// Current counters. O(1) but for `largest_free_block`, which scans the top non-empty bin.
    pub fn stats(&self) -> Stats {
        let mut s = self.stats;
        s.largest_free_block = self.largest_free_block();
        s.num_chunks_in_use = self.in_use_chunks;
        s.num_free_chunks = self.num_free_chunks();
        s.num_cached_chunks = self.cached_chunks;
        s.bytes_cached = self.cached_bytes;
        s.num_regions = self.num_regions;
        let map_entries: usize = self.regions[..self.num_regions]
            .iter()
            .map(|r| r.map_used)
            .sum();
        s.metadata_bytes = self.table.high_water() * core::mem::size_of::<Chunk>()
            + map_entries * core::mem::size_of::<Option<ChunkHandle>>();
        s
    }

    /// Calls `f(ptr, size)` for every free chunk of at least `min_size` bytes, in no particular order.
    pub fn for_each_free_chunk(&self, min_size: usize, mut f: impl FnMut(usize, usize)) {
        let min_g = (min_size >> self.granule_shift).max(1);
        let mut b = bin_for(min_g);
        while let Some(found) = self.bins.first_non_empty_from(b) {
            let mut cur = self.bins.head(found);
            while let Some(h) = cur {
                let c = self.table.get(h);
                if c.size() >= min_size {
                    f(c.ptr(), c.size());
                }
                cur = c.free_next;
            }
            b = found + 1;
        }
    }

    /// Calls `f(ptr, size)` for every free chunk of at least `min_size` bytes that is not marked clean,
    /// and marks it clean if `f` returns `true`. The engine only keeps the flag: a caller that returns
    /// a chunk's pages to the OS in `f` can skip it next time, and one whose return was refused
    /// (`false`) is offered the chunk again. A chunk loses the mark when handed out or merged with a
    /// chunk that has none (a freshly freed one). Returns the number of chunks passed to `f`.
    ///
    /// With `aging`, a chunk is passed to `f` only if it was already free and unchanged at the
    /// previous aging sweep; chunks seen for the first time are only marked, so memory that is
    /// freed and soon allocated again keeps its pages (a decay in steps of sweeps).
    pub fn sweep_dirty(
        &mut self,
        min_size: usize,
        aging: bool,
        mut f: impl FnMut(usize, usize) -> bool,
    ) -> usize {
        let min_g = (min_size >> self.granule_shift).max(1);
        let mut b = bin_for(min_g);
        let mut n = 0;
        while let Some(found) = self.bins.first_non_empty_from(b) {
            let mut cur = self.bins.head(found);
            while let Some(h) = cur {
                let c = self.table.get_mut(h);
                if c.size() >= min_size && !c.clean() {
                    if aging && !c.aged() {
                        c.set_aged(true);
                    } else {
                        let (ptr, size) = (c.ptr(), c.size());
                        let clean = f(ptr, size);
                        self.table.get_mut(h).set_clean(clean);
                        n += 1;
                    }
                }
                cur = self.table.get(h).free_next;
            }
            b = found + 1;
        }
        n
    }

    /// Iterates the chunks of every region in address order (for diagnostics and tests).
    pub fn chunks(&self) -> impl Iterator<Item = Chunk> + '_ {
        self.regions[..self.num_regions].iter().flat_map(move |r| {
            let mut cur = r.first;
            core::iter::from_fn(move || {
                let h = cur?;
                let c = *self.table.get(h);
                cur = c.next;
                Some(c)
            })
        })
    }

    /// Builds an out-of-memory report for a request of `requested` bytes.
    pub fn oom_report(&self, requested: usize, needed: usize, cause: OomCause) -> OomReport {
        let mut free_by_size = [BinSummary::default(); NUM_GROUPS];
        let mut b = 0;
        while let Some(found) = self.bins.first_non_empty_from(b) {
            let mut cur = self.bins.head(found);
            while let Some(h) = cur {
                let c = self.table.get(h);
                let e = &mut free_by_size[found / 16];
                e.count += 1;
                e.bytes += c.size();
                cur = c.free_next;
            }
            b = found + 1;
        }
        OomReport {
            requested,
            needed,
            stats: self.stats(),
            cause,
            granule: self.config.granule,
            free_by_size,
        }
    }

    // ---- internals ----

    fn num_free_chunks(&self) -> usize {
        // Every live record is a chunk: handed out, cached, or free in a bin.
        self.table.live() - self.in_use_chunks - self.cached_chunks
    }

    /// Takes cached chunk `h` off quick list `g` and out of the cached counts; the caller marks it
    /// handed out or free. `h` is the list's head on an allocation; a resize may take it from
    /// anywhere in the list (a walk of at most `quick_depth` steps).
    #[inline]
    fn quick_detach(&mut self, h: ChunkHandle, g: usize) {
        let c = self.table.get_mut(h);
        let (next, size) = (c.free_next, c.size());
        c.free_next = None;
        if self.quick_heads[g] == Some(h) {
            self.quick_heads[g] = next;
        } else {
            let mut cur = self.quick_heads[g];
            while let Some(p) = cur {
                let pc = self.table.get_mut(p);
                if pc.free_next == Some(h) {
                    pc.free_next = next;
                    break;
                }
                cur = pc.free_next;
            }
        }
        self.quick_len[g] -= 1;
        self.cached_bytes -= size;
        self.cached_chunks -= 1;
    }

    /// Hands out cached chunk `h`, the head of quick list `g`.
    #[inline]
    fn quick_pop(&mut self, h: ChunkHandle, g: usize) -> Allocated {
        self.quick_detach(h, g);
        let c = self.table.get_mut(h);
        c.set_in_use(true);
        let (ptr, size) = (c.ptr(), c.size());
        self.note_handed_out(size);
        Allocated { ptr, size }
    }

    /// Counts a block of `size` bytes handed out by an allocation.
    fn note_handed_out(&mut self, size: usize) {
        self.in_use_chunks += 1;
        self.stats.num_allocs += 1;
        self.note_in_use_grew(size, size);
    }

    /// Counts `by` more bytes in use, now in a block of `size` bytes.
    fn note_in_use_grew(&mut self, by: usize, size: usize) {
        let s = &mut self.stats;
        s.bytes_in_use += by;
        s.peak_bytes_in_use = s.peak_bytes_in_use.max(s.bytes_in_use);
        s.largest_alloc_size = s.largest_alloc_size.max(size);
    }

    /// Chunk records ever used: the prefix of the chunk table the engine has touched. One call
    /// makes at most three more (a region's first chunk when it grows, a split for alignment
    /// padding and one for the remainder).
    pub fn records_touched(&self) -> usize {
        self.table.high_water()
    }

    /// Size of the largest free chunk (scans the top non-empty bin).
    pub fn largest_free_block(&self) -> usize {
        let Some(b) = self.bins.last_non_empty() else {
            return 0;
        };
        let mut best = 0;
        let mut cur = self.bins.head(b);
        while let Some(h) = cur {
            let c = self.table.get(h);
            best = best.max(c.size());
            cur = c.free_next;
        }
        best
    }

    #[inline]
    fn should_split(&self, chunk: usize, want: usize) -> bool {
        let left = chunk - want;
        let ratio = self.config.split_ratio;
        // `chunk >= ratio * want` (what `chunk / ratio >= want` says, without a division on the
        // allocation path; a product that overflows is above any chunk). The waste test first: on
        // the host it holds whenever the granule test does.
        left >= self.config.granule
            && (left >= self.config.max_internal_fragmentation
                || (ratio != 0 && want.checked_mul(ratio).is_some_and(|w| chunk >= w)))
    }

    /// Finds a free chunk for a request of `rounded` bytes at `align` (`needed` bytes fit at any
    /// address), looking at up to `scan` chunks of a class whose chunks may not all fit.
    #[inline]
    fn find(
        &self,
        rounded: usize,
        align: usize,
        needed: usize,
        scan: usize,
    ) -> Option<ChunkHandle> {
        if needed == rounded {
            self.find_fit(needed, scan)
        } else {
            self.find_aligned_fit(rounded, align, needed, scan)
                .or_else(|| self.find_fit(needed, scan))
        }
    }

    /// Finds a free chunk of at least `needed` bytes (see the module docs for the policy), looking
    /// at up to `scan` chunks (at least `fit_scan`) of the request's own class.
    #[inline]
    fn find_fit(&self, needed: usize, scan: usize) -> Option<ChunkHandle> {
        let g = needed >> self.granule_shift;
        let b = bin_for(g);
        let mut found = self.bins.first_non_empty_from(b)?;
        if found == b {
            // The request's own class may hold chunks smaller than the request.
            let mut best: Option<(usize, usize, ChunkHandle)> = None;
            let mut cur = self.bins.head(b);
            let mut scanned = 0;
            while let Some(h) = cur {
                let c = self.table.get(h);
                let s = c.size();
                if s >= needed {
                    if s == needed {
                        return Some(h);
                    }
                    if best.is_none_or(|(bs, bp, _)| (s, c.ptr()) < (bs, bp)) {
                        best = Some((s, c.ptr(), h));
                    }
                }
                scanned += 1;
                if scanned >= self.config.fit_scan && best.is_some() {
                    break;
                }
                if scanned >= self.config.fit_scan.max(scan) {
                    break;
                }
                cur = c.free_next;
            }
            if let Some((_, _, h)) = best {
                return Some(h);
            }
            found = self.bins.first_non_empty_from(b + 1)?;
        }
        self.bins.head(found)
    }

    /// For an aligned request: a free chunk smaller than `needed` (the size that fits at any address)
    /// that still holds `rounded` bytes at an `align` boundary. The smallest such chunk among up to
    /// `scan` per class, in the lowest class that has one. Without this, an exactly fitting aligned
    /// hole (say, a freed 64 KiB span) could never be reused for the same request.
    fn find_aligned_fit(
        &self,
        rounded: usize,
        align: usize,
        needed: usize,
        scan: usize,
    ) -> Option<ChunkHandle> {
        let last = bin_for(needed >> self.granule_shift);
        let mut b = bin_for(rounded >> self.granule_shift);
        while let Some(found) = self.bins.first_non_empty_from(b) {
            if found > last {
                return None;
            }
            let mut best: Option<(usize, usize, ChunkHandle)> = None;
            let mut cur = self.bins.head(found);
            let mut scanned = 0;
            while let Some(h) = cur {
                let c = self.table.get(h);
                // (No aligned start at all for a chunk within `align` of the address space's end.
                // `align` is a power of two: a mask, not the division `checked_next_multiple_of`
                // makes of a run-time divisor, once per chunk looked at.)
                let fits = round_up(c.ptr(), align)
                    .is_some_and(|start| start - c.ptr() + rounded <= c.size());
                if fits && best.is_none_or(|(bs, bp, _)| (c.size(), c.ptr()) < (bs, bp)) {
                    best = Some((c.size(), c.ptr(), h));
                }
                scanned += 1;
                if scanned >= scan {
                    break;
                }
                cur = c.free_next;
            }
            if let Some((_, _, h)) = best {
                return Some(h);
            }
            b = found + 1;
        }
        None
    }

    /// On a full chunk table: a free chunk that serves a request of `rounded` bytes at `align`
    /// whole, ending at or below `bound`: aligned at its start and too small to split, so taking it
    /// needs no new record. The first such chunk of the lowest class that has one.
    #[cold]
    fn find_whole(&self, rounded: usize, align: usize, bound: usize) -> Option<ChunkHandle> {
        let mut b = bin_for(rounded >> self.granule_shift);
        while let Some(found) = self.bins.first_non_empty_from(b) {
            let smallest =
                (bin_lower_bound(found).saturating_mul(self.config.granule)).max(rounded);
            if self.should_split(smallest, rounded) {
                // (Splitting is monotonic in the chunk's size: every chunk from here on is split.)
                return None;
            }
            let mut cur = self.bins.head(found);
            while let Some(h) = cur {
                let c = self.table.get(h);
                if c.size() >= rounded
                    && c.ptr() % align == 0
                    && !self.should_split(c.size(), rounded)
                    && c.ptr() + c.size() <= bound
                {
                    return Some(h);
                }
                cur = c.free_next;
            }
            b = found + 1;
        }
        None
    }

    /// Hands out (part of) free chunk `h` for a request of `rounded` bytes at `align`, if the block
    /// ends at or below `bound` (else nothing changes).
    #[inline(always)]
    fn take(
        &mut self,
        mut h: ChunkHandle,
        rounded: usize,
        align: usize,
        bound: usize,
    ) -> Result<Allocated, Refusal> {
        let c = *self.table.get(h);
        let pad = align_up(c.ptr(), align) - c.ptr();
        // What is left after the padding; the block keeps all of it when the rest is not worth
        // splitting off.
        let have = c.size() - pad;
        let split = self.should_split(have, rounded);
        let end = c.ptr() + pad + if split { rounded } else { have };
        if end > bound {
            return Err(Refusal::BeyondBound(end));
        }
        self.bins
            .remove(&mut self.table, h, c.size() >> self.granule_shift);
        if pad != 0 {
            // The front padding stays free. Its predecessor is in use (`h` was free), so no merge.
            match self.split(h, pad) {
                Some(n) => {
                    self.bins
                        .insert(&mut self.table, h, pad >> self.granule_shift);
                    h = n;
                }
                None => return Err(Refusal::Oom(self.table_full(h))),
            }
        }
        if split {
            // The successor of the tail is in use or absent (`h` was free), so no merge. On a full
            // table fail rather than hand out a possibly huge chunk for a small request.
            match self.split(h, rounded) {
                Some(t) => {
                    self.bins
                        .insert(&mut self.table, t, (have - rounded) >> self.granule_shift)
                }
                None => return Err(Refusal::Oom(self.table_full(h))),
            }
        }
        let c = self.table.get_mut(h);
        c.set_in_use(true);
        let (ptr, got) = (c.ptr(), c.size());
        self.note_handed_out(got);
        Ok(Allocated { ptr, size: got })
    }

    /// Puts free chunk `h` (out of any bin) back and reports a full chunk table.
    #[cold]
    fn table_full(&mut self, h: ChunkHandle) -> OomCause {
        let _ = self.free_and_coalesce(h);
        OomCause::ChunkTableFull
    }

    /// Splits `h` at `offset` bytes; the new chunk (returned) takes the rest and is not in any bin.
    /// `None` when the chunk table is full (nothing changed then).
    #[inline(always)]
    fn split(&mut self, h: ChunkHandle, offset: usize) -> Option<ChunkHandle> {
        let c = *self.table.get(h);
        debug_assert!(offset > 0 && offset < c.size());
        let mut rest = c.tail_from(offset);
        rest.prev = Some(h);
        rest.next = c.next;
        let n = self.table.alloc(rest)?;
        if let Some(x) = c.next {
            self.table.get_mut(x).prev = Some(n);
        }
        let c = self.table.get_mut(h);
        c.next = Some(n);
        c.set_size(offset);
        self.map_note_start(n);
        Some(n)
    }

    /// Merges `h` with its successor (which must be out of any bin); `h` keeps its state.
    #[inline(always)]
    fn merge_next(&mut self, h: ChunkHandle) {
        let Some(n) = self.table.get(h).next else {
            return;
        };
        let nc = *self.table.get(n);
        self.map_forget_start(n, &nc);
        if let Some(x) = nc.next {
            self.table.get_mut(x).prev = Some(h);
        }
        let c = self.table.get_mut(h);
        c.next = nc.next;
        c.absorb(&nc);
        self.table.free(n);
    }

    /// `h` was just marked free (and is in no bin): merges it with free neighbours and bins the result.
    /// Returns the merged chunk's `(ptr, size)`.
    #[inline(always)]
    fn free_and_coalesce(&mut self, mut h: ChunkHandle) -> (usize, usize) {
        let c = *self.table.get(h);
        if let Some(n) = c.next {
            let nc = *self.table.get(n);
            if !nc.in_use() {
                self.bins
                    .remove(&mut self.table, n, nc.size() >> self.granule_shift);
                self.merge_next(h);
            }
        }
        if let Some(p) = c.prev {
            let pc = *self.table.get(p);
            if !pc.in_use() {
                self.bins
                    .remove(&mut self.table, p, pc.size() >> self.granule_shift);
                self.merge_next(p);
                h = p;
            }
        }
        let c = *self.table.get(h);
        self.bins
            .insert(&mut self.table, h, c.size() >> self.granule_shift);
        (c.ptr(), c.size())
    }

    /// Index of the region containing `addr`.
    #[inline]
    fn region_of(&self, addr: usize) -> Option<usize> {
        let regions = &self.regions[..self.num_regions];
        if regions.len() == 1 {
            return regions[0].contains(addr).then_some(0);
        }
        let i = regions.partition_point(|r| r.base <= addr);
        (i > 0 && regions[i - 1].contains(addr)).then(|| i - 1)
    }

    #[inline]
    fn map_slot(&self, r: &Region, addr: usize) -> *mut Option<ChunkHandle> {
        let block = (addr - r.base) >> self.block_shift;
        debug_assert!(block < r.map_len);
        // SAFETY: `addr` is inside `r`, so `block < map_len` (the map has one entry per block of the
        // region), and the map is valid for `map_len` entries until the region is freed.
        unsafe { r.map.as_ptr().add(block) }
    }

    /// Records that chunk `n` (just created by a split) starts where it does.
    #[inline]
    fn map_note_start(&mut self, n: ChunkHandle) {
        let ptr = self.table.get(n).ptr();
        let Some(ri) = self.region_of(ptr) else {
            return;
        };
        let r = &mut self.regions[ri];
        let block = (ptr - r.base) >> self.block_shift;
        r.map_used = r.map_used.max(block + 1);
        let slot = self.map_slot(&self.regions[ri], ptr);
        // SAFETY: `slot` is a valid map entry (see `map_slot`); the engine is the only user of the map.
        unsafe {
            // No chunk starts between the split chunk's start and `ptr`, so `n` is the first chunk of
            // its block unless the split chunk itself starts in the same block.
            match *slot {
                Some(f) if self.table.get(f).ptr() < ptr => {}
                _ => *slot = Some(n),
            }
        }
    }

    /// Chunk `n` (record `nc`) is about to disappear into its predecessor.
    #[inline]
    fn map_forget_start(&mut self, n: ChunkHandle, nc: &Chunk) {
        let Some(ri) = self.region_of(nc.ptr()) else {
            return;
        };
        let r = &self.regions[ri];
        let slot = self.map_slot(r, nc.ptr());
        let block_of = |addr: usize| (addr - r.base) >> self.block_shift;
        // SAFETY: as in `map_note_start`.
        unsafe {
            if *slot == Some(n) {
                // Successors never leave the region, so `block_of` is defined for them.
                *slot = nc
                    .next
                    .filter(|&x| block_of(self.table.get(x).ptr()) == block_of(nc.ptr()));
            }
        }
    }

    /// Finds the chunk that starts at `ptr` and is in use.
    #[inline(always)]
    fn lookup_in_use(&self, ptr: usize) -> Result<ChunkHandle, FreeError> {
        let ri = self.region_of(ptr).ok_or(FreeError::NotOwned { ptr })?;
        let r = &self.regions[ri];
        let mut cur = r.entry((ptr - r.base) >> self.block_shift);
        if cur.is_none() {
            return Err(self.classify_bad_pointer(r, ptr));
        }
        while let Some(h) = cur {
            let c = self.table.get(h);
            if c.ptr() == ptr {
                return if c.allocated() {
                    Ok(h)
                } else {
                    Err(FreeError::DoubleFree { ptr })
                };
            }
            if c.ptr() > ptr {
                // `ptr` lies in the predecessor, which starts in an earlier block.
                let p = c.prev.map(|p| *self.table.get(p));
                return Err(interior_error(ptr, p));
            }
            if c.end() > ptr {
                return Err(interior_error(ptr, Some(*c)));
            }
            cur = c.next;
        }
        Err(FreeError::NotOwned { ptr })
    }

    /// `ptr` is in region `r` but no chunk starts in its map block: find the chunk that covers it.
    #[cold]
    fn classify_bad_pointer(&self, r: &Region, ptr: usize) -> FreeError {
        // (Blocks from `map_used` on hold no chunk start.)
        let mut block = ((ptr - r.base) >> self.block_shift).min(r.map_used);
        while block > 0 {
            block -= 1;
            if let Some(mut h) = r.entry(block) {
                loop {
                    let c = *self.table.get(h);
                    if c.end() > ptr {
                        return interior_error(ptr, Some(c));
                    }
                    match c.next {
                        Some(n) => h = n,
                        None => return FreeError::NotOwned { ptr },
                    }
                }
            }
        }
        FreeError::NotOwned { ptr }
    }

    /// Adds a region of at least `needed` bytes aligned to `align` (at most 2 MiB of it), and
    /// returns its one free chunk.
    fn extend(&mut self, needed: usize, align: usize) -> Result<ChunkHandle, OomCause> {
        if self.num_regions == MAX_REGIONS {
            return Err(OomCause::RegionTableFull);
        }
        let granule = self.config.granule;
        let available = self.room_under_limit(self.stats.bytes_reserved);
        if needed > available {
            return Err(OomCause::LimitReached);
        }
        let region_align = align.clamp(granule, REGION_ALIGN_MAX);
        // The size after this one, kept only if this growth succeeds: a failed request must not
        // inflate the next region.
        let mut next = self.next_region_size;
        let mut size = if self.config.allow_growth {
            let mut grew = false;
            while next < needed {
                next = next.saturating_mul(2);
                grew = true;
            }
            let size = next.min(available);
            if !grew {
                next = next.saturating_mul(2);
            }
            size
        } else if self.num_regions == 0 {
            available
        } else {
            return Err(OomCause::NoGrowth);
        };
        let first = size;
        let mut steps = 0;
        loop {
            if let Some(base) = self.source.alloc_region(size, region_align) {
                match self.add_region(base, size, region_align) {
                    Ok(h) => {
                        // After backing off, grow from what the source gave, not from what it
                        // refused: else each growth starts ever higher and backs off ever longer.
                        self.next_region_size = if size < first { size } else { next };
                        return Ok(h);
                    }
                    // No room for the region's pointer map: a smaller region needs a smaller map.
                    Err(OomCause::SourceRefused) => {}
                    Err(cause) => return Err(cause),
                }
            }
            if size == needed {
                return Err(OomCause::SourceRefused);
            }
            // Back off by 0.9, never below what the request needs; after `MAX_BACKOFF_STEPS`
            // steps (below 0.19 of the first size) halve instead: a source that refuses everything
            // (a device out of memory) is asked a number of times logarithmic in the sizes, and
            // one with room left still gives a region within twice of it.
            steps += 1;
            let factor = if steps > MAX_BACKOFF_STEPS { 5 } else { 9 };
            size = ((size / 10 * factor) & !(granule - 1)).max(needed);
        }
    }

    fn add_region(
        &mut self,
        base: usize,
        size: usize,
        align: usize,
    ) -> Result<ChunkHandle, OomCause> {
        // The source's promises (see `MemorySource`), checked in debug builds: a region that broke
        // them would hand out addresses twice or outside memory the engine owns.
        debug_assert!(
            base % align == 0,
            "the memory source returned region {base:#x} not aligned to {align:#x}"
        );
        debug_assert!(
            base.checked_add(size).is_some(),
            "the memory source returned region {base:#x} of {size:#x} bytes, past the address space"
        );
        debug_assert!(
            self.regions[..self.num_regions]
                .iter()
                .all(|r| base.saturating_add(size) <= r.base || r.base + r.size <= base),
            "the memory source returned region {base:#x} of {size:#x} bytes, overlapping a live one"
        );
        let block = 1usize << self.block_shift;
        let map_len = size.div_ceil(block);
        let Some(map) = self.source.alloc_map(base, map_len) else {
            // SAFETY: the region was just obtained with these parameters and holds nothing.
            unsafe { self.source.free_region(base, size) };
            return Err(OomCause::SourceRefused);
        };
        let mut first = Chunk::EMPTY;
        first.ptr = base;
        first.set_size(size);
        // Fresh from the source: nothing touched yet.
        first.set_clean(true);
        let Some(h) = self.table.alloc(first) else {
            // SAFETY: both were just obtained with these parameters and hold nothing.
            unsafe {
                self.source.free_map(base, map, map_len);
                self.source.free_region(base, size);
            }
            return Err(OomCause::ChunkTableFull);
        };
        // SAFETY: the map holds `map_len >= 1` zeroed entries, exclusively ours.
        unsafe { *map.as_ptr() = Some(h) };
        let i = self.regions[..self.num_regions].partition_point(|r| r.base < base);
        self.regions.copy_within(i..self.num_regions, i + 1);
        self.regions[i] = Region {
            base,
            size,
            map,
            map_len,
            map_used: 1,
            first: Some(h),
        };
        self.num_regions += 1;
        self.bins
            .insert(&mut self.table, h, size >> self.granule_shift);
        self.stats.bytes_reserved += size;
        self.stats.peak_bytes_reserved = self
            .stats
            .peak_bytes_reserved
            .max(self.stats.bytes_reserved);
        Ok(h)
    }
}

#[inline]
fn interior_error(ptr: usize, c: Option<Chunk>) -> FreeError {
    match c {
        Some(c) if c.allocated() => FreeError::Interior {
            ptr,
            block: c.ptr(),
        },
        Some(_) => FreeError::DoubleFree { ptr },
        None => FreeError::NotOwned { ptr },
    }
}

#[inline]
const fn round_up(x: usize, to: usize) -> Option<usize> {
    match x.checked_add(to - 1) {
        Some(v) => Some(v & !(to - 1)),
        None => None,
    }
}

/// `x` rounded up to `align` (a power of two); the result must be representable. (`align - 1` is
/// added as one term: `x + align` alone overflows for the highest aligned `x`.)
#[inline]
fn align_up(x: usize, align: usize) -> usize {
    (x + (align - 1)) & !(align - 1)
}

#[cfg(feature = "std")]
pub mod maps;
#[cfg(feature = "std")]
pub mod sim;

#[cfg(all(test, feature = "std"))]
mod tests;
