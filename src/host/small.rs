//! Small objects: size-class slabs carved from BFC chunks.
//!
//! Requests of at most [`SMALL_MAX`] (16 KiB) bytes with alignment at most [`SMALL_ALIGN`] (4 KiB)
//! are served from *spans*: 64 KiB, 64 KiB-aligned chunks taken from the BFC engine, each cut into
//! equal objects of one size class (an aligned request takes a class whose size is a multiple of its
//! alignment).
//! Everything about a span lives outside it: in the span table (one [`Span`] per 64 KiB of arena)
//! its free count and a bitmap with one bit per object (set = allocated), and in the span class
//! table (one byte per 64 KiB) its class. So:
//!
//! - allocation finds a clear bit in the class's current span (a few instructions, no list walk);
//! - free finds the span by address arithmetic, checks that the pointer is an object start whose bit
//!   is set (an interior pointer or a double free is detected, never absorbed), and clears the bit;
//! - object memory is never written by the allocator, so untouched objects stay untouched pages.
//!
//! **Lowest address first.** A class always allocates the lowest free object of its lowest span
//! with room: the class's *current* span is the lowest-addressed of its spans with a free object,
//! found in a per-class hierarchical bitmap over the span table ([`SpanSets`]). So a class only
//! touches an object above all its others once every lower object is taken, and the memory a class
//! has touched stays close to its peak live bytes rather than rounding up to whole spans; its
//! highest spans get no new objects while lower ones have room, so they drain and go back to the
//! engine, where any class (or a large block) can reuse them.
//!
//! A span whose objects are all free goes back to the engine (and so can coalesce), unless it is the
//! class's current span. Memory held this way is bounded by the live objects' spans plus one current
//! span per class (36 x 64 KiB); an allocation that would fail otherwise takes the empty current spans
//! back first ([`SmallHeap::take_empty_current`]).
//!
//! Invariants: a span of class `c` is in `sets[c]` iff it has a free object, and `current[c]` is the
//! lowest span in `sets[c]` (0 when the set is empty); only the current span may have no object
//! allocated.

use core::sync::atomic::{AtomicU8, Ordering::Relaxed};

/// Largest small request.
pub(crate) const SMALL_MAX: usize = 16 << 10;
/// Largest alignment of a small request.
pub(crate) const SMALL_ALIGN: usize = 4096;
/// Span size (and alignment).
pub(crate) const SPAN_SHIFT: u32 = 16;
pub(crate) const SPAN: usize = 1 << SPAN_SHIFT;
/// Words of the per-span bitmap: enough for 16-byte objects.
const WORDS: usize = SPAN / 16 / 64;

/// The class sizes: steps of 16 up to 128, then four classes per power of two (waste under 25%).
/// A span holds 4 to 12 objects of the classes above 4 KiB; the tail it cannot fill is at most
/// 8 KiB (14 KiB objects: four, 56 KiB). Up to 16 KiB, rather than 4 KiB: a churn of blocks of
/// 2..16 KiB took 170 ns a step in the engine (its locked best fit and coalescing, over chunk
/// records spread across the heap) and 37 ns in slabs, with 45 MB peak RSS instead of 77
/// (bench-peers `mid`).
pub(crate) const CLASS_SIZES: [u32; 36] = [
    16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024,
    1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096, 5120, 6144, 7168, 8192, 10240, 12288, 14336,
    16384,
];
pub(crate) const NUM_CLASSES: usize = CLASS_SIZES.len();

/// `CLASS_OF[(size + 15) / 16]` is the class of a request of `size` bytes (`1..=SMALL_MAX`).
const CLASS_OF: [u8; SMALL_MAX / 16 + 1] = {
    let mut t = [0u8; SMALL_MAX / 16 + 1];
    let mut i = 0;
    let mut c = 0;
    while i < t.len() {
        while (CLASS_SIZES[c] as usize) < i * 16 {
            c += 1;
        }
        t[i] = c as u8;
        i += 1;
    }
    t
};

/// `ceil(2^32 / size)`: `offset * RECIP[c] >> 32 == offset / size` for every offset below [`SPAN`]
/// (the error term stays below `1 / size`).
const RECIP: [u64; NUM_CLASSES] = {
    let mut r = [0u64; NUM_CLASSES];
    let mut c = 0;
    while c < NUM_CLASSES {
        r[c] = (1u64 << 32).div_ceil(CLASS_SIZES[c] as u64);
        c += 1;
    }
    r
};

/// Rows of [`ALIGNED`]: alignments 32, 64, ..., [`SMALL_ALIGN`] (a power of two).
const ALIGN_ROWS: usize = (SMALL_ALIGN.trailing_zeros() - 4) as usize;
static_assertions::const_assert!(ALIGN_ROWS.is_power_of_two());

/// `ALIGNED[k][c]` is the size in 16-byte units of the smallest class at or above `c` whose size is
/// a multiple of `32 << k`. Spans start on a [`SPAN`] boundary, so every object of such a class is
/// aligned to `32 << k`.
const ALIGNED: [[u16; NUM_CLASSES]; ALIGN_ROWS] = {
    let mut t = [[0u16; NUM_CLASSES]; ALIGN_ROWS];
    let mut k = 0;
    while k < ALIGN_ROWS {
        let mut c = 0;
        while c < NUM_CLASSES {
            let mut d = c;
            // Terminates: the last class, `SMALL_MAX`, is a multiple of every row's alignment.
            while CLASS_SIZES[d] % (32 << k) != 0 {
                d += 1;
            }
            t[k][c] = (CLASS_SIZES[d] / 16) as u16;
            c += 1;
        }
        k += 1;
    }
    t
};

/// The class of a small request, or `None` if it goes to the engine: at most [`SMALL_MAX`] bytes
/// with an alignment of at most [`SMALL_ALIGN`]. Above 16 bytes of alignment, the smallest class
/// that fits and whose size is a multiple of the alignment (a 64-byte-aligned 100-byte request
/// takes the 128-byte class, a page-aligned one the 4 KiB class).
#[inline]
pub(crate) fn class_for(size: usize, align: usize) -> Option<usize> {
    // The hints lay the fast paths out for the usual small request (at most 16-byte aligned) as
    // straight-line code: the others branch off it.
    if size > SMALL_MAX {
        cold_path();
        return None;
    }
    // Both ways end in one load from `CLASS_OF`. (`(size + 15) >> 4` rather than `div_ceil`,
    // whose bound the compiler loses here.)
    let units = if align <= 16 {
        (size + 15) >> 4
    } else if align <= SMALL_ALIGN {
        cold_path();
        aligned_units(size, align)
    } else {
        cold_path();
        return None;
    };
    Some(class_of(units))
}

/// `CLASS_OF[units]`, which the compiler is told is a class: so it drops the bounds checks on the
/// class in the fast paths (no panic path there, and no saved register for one).
#[inline(always)]
fn class_of(units: usize) -> usize {
    let c = CLASS_OF[units] as usize;
    // SAFETY: every entry of `CLASS_OF` is a class (`CLASS_OF_IN_RANGE`).
    unsafe { core::hint::assert_unchecked(c < NUM_CLASSES) };
    c
}

/// Every entry of [`CLASS_OF`] is a class, which [`class_of`] tells the compiler.
const CLASS_OF_IN_RANGE: bool = {
    let mut i = 0;
    while i < CLASS_OF.len() && (CLASS_OF[i] as usize) < NUM_CLASSES {
        i += 1;
    }
    i == CLASS_OF.len()
};
static_assertions::const_assert!(CLASS_OF_IN_RANGE);

/// Marks the branch that calls it as unlikely (`core::hint::cold_path`, which is stable only since
/// Rust 1.95: a call to a cold function has the same effect on the layout).
#[cold]
#[inline(always)]
fn cold_path() {}

/// The size in 16-byte units of [`class_for`]'s class for a request of at most [`SMALL_MAX`] bytes
/// aligned to a power of two in `32..=SMALL_ALIGN`. (The mask and the `min` change nothing for such
/// a request; they show the compiler that the indices are in bounds.)
#[inline(always)]
fn aligned_units(size: usize, align: usize) -> usize {
    let row = (align.trailing_zeros() as usize).wrapping_sub(5) & (ALIGN_ROWS - 1);
    let c = class_of((size + 15) >> 4);
    (ALIGNED[row][c] as usize).min(SMALL_MAX / 16)
}

/// Size of class `c`'s objects.
#[cfg_attr(not(feature = "std"), allow(dead_code))]
#[inline(always)]
pub(crate) const fn class_size(c: usize) -> usize {
    CLASS_SIZES[c] as usize
}

/// Per class, for the divisibility test of [`is_object_start`]: `M = ceil(2^64 / size)`.
const START_MUL: [u64; NUM_CLASSES] = {
    let mut t = [0u64; NUM_CLASSES];
    let mut c = 0;
    while c < NUM_CLASSES {
        t[c] = u64::MAX / CLASS_SIZES[c] as u64 + 1;
        c += 1;
    }
    t
};

/// Per class, the bound of [`is_object_start`]'s product: with `e = size * M - 2^64` (the
/// rounding of [`START_MUL`], below `size`), `capacity * e`, or `M` when `e` is 0 (a power of two,
/// which divides [`SPAN`] and leaves no tail).
const START_LIMIT: [u64; NUM_CLASSES] = {
    let mut t = [0u64; NUM_CLASSES];
    let mut c = 0;
    while c < NUM_CLASSES {
        let size = CLASS_SIZES[c] as u64;
        let e = size.wrapping_mul(START_MUL[c]);
        t[c] = if e == 0 {
            START_MUL[c]
        } else {
            (SPAN as u64 / size) * e
        };
        c += 1;
    }
    t
};

/// Whether `offset` (from a span's start, below [`SPAN`]) is the start of an object of class `c`:
/// a multiple of the class size below the end of the span's last object (a class size that does
/// not divide [`SPAN`] leaves a tail that holds no object).
///
/// One multiplication decides both. With `M = ceil(2^64 / size)`, `offset * M` (modulo 2^64) is
/// at least `M` when `size` does not divide `offset` (offsets below 2^32; Lemire, Kaser and Kurz,
/// "Faster remainder by direct computation", 2019), and is `q * e` when `offset = q * size`, with
/// `e = size * M - 2^64` in `1..size` unless `size` is a power of two. So `q * e < capacity * e`
/// (at most [`SPAN`], far below `M`) holds exactly for the objects' starts.
#[cfg_attr(not(feature = "std"), allow(dead_code))]
#[inline(always)]
pub(crate) fn is_object_start(offset: usize, c: usize) -> bool {
    debug_assert!(offset < SPAN);
    (offset as u64).wrapping_mul(START_MUL[c]) < START_LIMIT[c]
}

/// Metadata of one 64 KiB window of the arena (its class is in [`SmallHeap::classes`]). All-zero
/// bytes mean "no object".
#[repr(C)]
pub(crate) struct Span {
    /// Free objects. (As wide as its loads: a frees' loop that stored 16 bits and then loaded 32
    /// for the next free of the same span stalled on every free, the store not forwarded.)
    free: u32,
    /// Pages (bit `p`: the span's page `p`) given back to the kernel since an object on them was
    /// last allocated.
    purged: u16,
    /// Objects from this index on were never handed out since the span was made, and lie in memory
    /// the heap had not reached then: they read as zero.
    fresh: u16,
    /// Bit `w` set iff `bits[w]` has a clear bit (for the words in use).
    avail: u64,
    /// Bit `i` set iff object `i` is allocated; bits past the capacity are set.
    bits: [u64; WORDS],
}

impl Span {
    /// Marks the pages of the object at `offset` (of `size` bytes) as in use again.
    #[inline(always)]
    fn unpurge(&mut self, offset: usize, size: usize, page_shift: u32) {
        let (first, last) = (offset >> page_shift, (offset + size - 1) >> page_shift);
        self.purged &= !(((2u32 << last) - (1u32 << first)) as u16);
    }
}

/// Per-class sets of span indices, as hierarchical bitmaps in one zero-filled reservation: level 0
/// has a bit per span, and a bit of level `k + 1` is set iff word of level `k` under it is non-zero,
/// up to a top level of one word. Finding the lowest member takes one word per level (four for a
/// 64 GiB arena); adding or removing one stops at the first level whose word was (or stays)
/// non-zero.
///
/// The classes' words are interleaved (word `j` of a level holds class `c` at `j * NUM_CLASSES + c`),
/// so a heap whose spans lie in the first 56 MiB of the arena touches one page of level 0.
pub(crate) struct SpanSets {
    words: &'static mut [u64],
    /// Offset (in words, before interleaving) of each level; `levels` levels are in use.
    offset: [usize; MAX_LEVELS],
    levels: usize,
}

/// Levels for up to `64^MAX_LEVELS` spans (far beyond any address space).
const MAX_LEVELS: usize = 6;

impl SpanSets {
    /// Layout of one class's sets over `spans` span indices: the offset (in words) of each level,
    /// the number of levels, and the words of all levels.
    const fn layout(spans: usize) -> ([usize; MAX_LEVELS], usize, usize) {
        let mut offset = [0; MAX_LEVELS];
        let mut n = if spans == 0 { 1 } else { spans };
        let (mut levels, mut total) = (0, 0);
        loop {
            let w = n.div_ceil(64);
            offset[levels] = total;
            total += w;
            levels += 1;
            if w == 1 || levels == MAX_LEVELS {
                return (offset, levels, total);
            }
            n = w;
        }
    }

    /// Words (`u64`) of storage for sets over `spans` span indices.
    pub(crate) const fn words_for(spans: usize) -> usize {
        Self::layout(spans).2 * NUM_CLASSES
    }

    /// Wraps zero-filled storage of [`Self::words_for`]`(spans)` words (all sets empty).
    pub(crate) fn new(words: &'static mut [u64], spans: usize) -> Self {
        let (offset, levels, total) = Self::layout(spans);
        debug_assert!(total * NUM_CLASSES <= words.len());
        SpanSets {
            words,
            offset,
            levels,
        }
    }

    /// Index in `words` of word `j` of class `c`'s level `level`.
    #[inline(always)]
    fn at(&self, c: usize, level: usize, j: usize) -> usize {
        (self.offset[level] + j) * NUM_CLASSES + c
    }

    /// Adds span `i` to class `c`'s set.
    #[inline]
    pub(crate) fn insert(&mut self, c: usize, i: usize) {
        let mut i = i;
        for level in 0..self.levels {
            let w = &mut self.words[self.at(c, level, i / 64)];
            let was = *w;
            *w = was | 1 << (i % 64);
            if was != 0 {
                return;
            }
            i /= 64;
        }
    }

    /// Removes span `i` from class `c`'s set.
    #[inline]
    pub(crate) fn remove(&mut self, c: usize, i: usize) {
        let mut i = i;
        for level in 0..self.levels {
            let w = &mut self.words[self.at(c, level, i / 64)];
            *w &= !(1 << (i % 64));
            if *w != 0 {
                return;
            }
            i /= 64;
        }
    }

    /// The lowest span in class `c`'s set.
    #[inline]
    pub(crate) fn first(&self, c: usize) -> Option<usize> {
        let mut i = 0;
        for level in (0..self.levels).rev() {
            let w = self.words[self.at(c, level, i)];
            if w == 0 {
                return None;
            }
            i = i * 64 + w.trailing_zeros() as usize;
        }
        Some(i)
    }

    /// Whether span `i` is in class `c`'s set (level 0 only).
    fn contains(&self, c: usize, i: usize) -> bool {
        self.words[self.at(c, 0, i / 64)] & 1 << (i % 64) != 0
    }

    /// Checks that every summary bit over level-0 words `0..words0` (and the levels above them)
    /// says exactly whether the word under it is non-zero.
    fn check(&self, words0: usize) -> Result<(), &'static str> {
        for c in 0..NUM_CLASSES {
            let mut n = words0;
            for level in 0..self.levels - 1 {
                for j in 0..n {
                    let below = self.words[self.at(c, level, j)] != 0;
                    let bit = self.words[self.at(c, level + 1, j / 64)] & 1 << (j % 64) != 0;
                    if below != bit {
                        return Err("span-set summary bit disagrees with the level below");
                    }
                }
                n = n.div_ceil(64);
            }
        }
        Ok(())
    }

    /// Storage bytes that may be resident for level-0 words `0..words0` and the levels above.
    fn resident_bytes(&self, words0: usize) -> usize {
        let mut n = words0.max(1);
        let mut words = 0;
        for _ in 0..self.levels {
            words += n;
            n = n.div_ceil(64);
        }
        words * NUM_CLASSES * 8
    }
}

/// What a small free found.
pub(crate) enum SmallFree {
    /// Freed; `Some(span base)` when the span became empty and must go back to the engine.
    Freed(Option<usize>),
    /// Not a span: the pointer belongs to the engine.
    NotSmall,
    /// The pointer is inside an object but not at its start.
    Interior { block: usize },
    /// The object is not allocated.
    DoubleFree,
    /// A live object of another class than the caller named.
    OtherClass,
}

pub(crate) struct SmallHeap {
    arena: usize,
    /// One entry per 64 KiB of arena (zero-filled reservation).
    spans: &'static mut [Span],
    /// Per 64 KiB of arena: the span's class + 1, or 0 when the window is not a span. Also read
    /// without the heap lock (the thread caches' check of a free's layout), hence atomic; written
    /// only here, under the lock, when a span is made or released, so a block's byte stays put
    /// while the block is allocated.
    classes: &'static [AtomicU8],
    /// Per class: span index + 1 of the current span (the lowest in `sets`), 0 for none.
    current: [u32; NUM_CLASSES],
    /// Per class: the spans with a free object.
    sets: SpanSets,
    /// log2 of the page size, when a span has 1 to 16 pages (otherwise 0: no page is ever purged).
    page_shift: u32,
    /// Bytes of live small objects (class sizes) and their number.
    pub(crate) bytes: usize,
    pub(crate) objects: usize,
    /// Spans held (each `SPAN` bytes of the engine's in-use bytes).
    pub(crate) spans_live: usize,
    /// Allocations served.
    pub(crate) allocs: u64,
}

impl SmallHeap {
    /// Wraps span-table storage for an arena at `arena` (64 KiB-aligned) and the zero-filled
    /// storage of its span sets ([`SpanSets::words_for`]`(spans.len())` words).
    pub(crate) fn new(
        arena: usize,
        page: usize,
        spans: &'static mut [Span],
        classes: &'static [AtomicU8],
        sets: &'static mut [u64],
    ) -> Self {
        let n = spans.len();
        assert!(classes.len() == n, "one span class byte per span entry");
        let pages = SPAN / page.max(1);
        SmallHeap {
            arena,
            page_shift: if page.is_power_of_two() && (1..=16).contains(&pages) {
                page.trailing_zeros()
            } else {
                0
            },
            spans,
            classes,
            current: [0; NUM_CLASSES],
            sets: SpanSets::new(sets, n),
            bytes: 0,
            objects: 0,
            spans_live: 0,
            allocs: 0,
        }
    }

    /// Start of the arena.
    #[cfg_attr(not(feature = "std"), allow(dead_code))]
    pub(crate) fn arena(&self) -> usize {
        self.arena
    }

    /// The span class table (one byte per 64 KiB of arena: class + 1, or 0), for lock-free readers.
    #[cfg_attr(not(feature = "std"), allow(dead_code))]
    pub(crate) fn classes(&self) -> *const AtomicU8 {
        self.classes.as_ptr()
    }

    /// Bytes of one span-table entry.
    pub(crate) const ENTRY: usize = core::mem::size_of::<Span>();

    /// Whether class `c` has a span with a free object.
    #[inline]
    pub(crate) fn has_room(&self, c: usize) -> bool {
        self.current[c] != 0
    }

    /// Allocates an object of class `c` from the current span; `None` when a new span is needed.
    #[inline]
    pub(crate) fn alloc(&mut self, c: usize) -> Option<usize> {
        let cur = self.current[c];
        if cur == 0 {
            return None;
        }
        let i = cur as usize - 1;
        let span = &mut self.spans[i];
        // The current span has a free object, so some word in use has a clear bit and `avail` is
        // non-zero.
        let w = span.avail.trailing_zeros() as usize % WORDS;
        let word = span.bits[w];
        let bit = (!word).trailing_zeros() as usize % 64;
        let word = word | (1 << bit);
        span.bits[w] = word;
        if word == u64::MAX {
            span.avail &= !(1 << w);
        }
        span.free -= 1;
        let size = CLASS_SIZES[c] as usize;
        let index = w * 64 + bit;
        let offset = index * size;
        // (At most 4,096 objects a span.)
        span.fresh = span.fresh.max(index as u16 + 1);
        if span.purged != 0 {
            // The object's pages are in use again (the caller will touch them).
            span.unpurge(offset, size, self.page_shift);
        }
        if span.free == 0 {
            self.filled(c, i);
        }
        self.bytes += size;
        self.objects += 1;
        self.allocs += 1;
        Some(self.arena + (i << SPAN_SHIFT) + offset)
    }

    /// [`Self::alloc`], and the pages of the object's span on which the object's bytes are known to
    /// be zero (bit `p`: the span's page `p`): all of them for an object never handed out since
    /// the span was made over memory the heap had not reached ([`Span::fresh`]), else the pages
    /// given back since an object on them was last allocated ([`Span::purged`]). To zero the
    /// object, only its bytes on the other pages need writing.
    #[cfg_attr(not(feature = "std"), allow(dead_code))]
    pub(crate) fn alloc_known_zero(&mut self, c: usize) -> Option<(usize, u16)> {
        let cur = self.current[c] as usize;
        // `alloc` takes its object from the current span.
        let span = self.spans.get(cur.checked_sub(1)?)?;
        let (purged, fresh) = (span.purged, span.fresh as usize);
        let p = self.alloc(c)?;
        let index = ((p - self.arena) & (SPAN - 1)) / CLASS_SIZES[c] as usize;
        Some((p, if index >= fresh { u16::MAX } else { purged }))
    }

    /// Allocates up to `out.len()` objects of class `c` from its spans with room, lowest address
    /// first (the order [`Self::alloc`] would give them), into `out`; returns how many. Fewer than
    /// asked means the class has no span with room left. One pass over each span's bitmap words
    /// instead of a call per object: a thread cache's refill takes a batch at a time.
    #[cfg_attr(not(feature = "std"), allow(dead_code))]
    pub(crate) fn alloc_batch(&mut self, c: usize, out: &mut [usize]) -> usize {
        let size = CLASS_SIZES[c] as usize;
        let mut n = 0;
        while n < out.len() {
            let cur = self.current[c];
            if cur == 0 {
                break;
            }
            let i = cur as usize - 1;
            let base = self.arena + (i << SPAN_SHIFT);
            let page_shift = self.page_shift;
            let span = &mut self.spans[i];
            let start = n;
            // A span with room has a clear bit in some word in use, and `avail` marks exactly those
            // words (bits past the capacity are set), so the span is full once `avail` is zero.
            while n < out.len() && span.avail != 0 {
                let w = span.avail.trailing_zeros() as usize % WORDS;
                let mut word = span.bits[w];
                while n < out.len() && word != u64::MAX {
                    let bit = (!word).trailing_zeros() as usize % 64;
                    word |= 1 << bit;
                    out[n] = base + (w * 64 + bit) * size;
                    n += 1;
                }
                span.bits[w] = word;
                if word == u64::MAX {
                    span.avail &= !(1 << w);
                }
            }
            if n == start {
                // The current span must have room: its metadata was overwritten. Stop rather than
                // spin under the heap lock or hand out an object twice.
                super::os::fatal(format_args!(
                    "slab metadata corrupted: the current span of class {c} has no free object"
                ));
            }
            span.free -= (n - start) as u32;
            // Objects come lowest first: the last is the highest.
            let last = (out[n - 1] - base) / size;
            span.fresh = span.fresh.max(last as u16 + 1);
            if span.purged != 0 {
                // The objects' pages are in use again (the callers will touch them).
                for &p in &out[start..n] {
                    span.unpurge(p - base, size, page_shift);
                }
            }
            if span.free == 0 {
                self.filled(c, i);
            }
        }
        self.bytes += n * size;
        self.objects += n;
        self.allocs += n as u64;
        n
    }

    /// Class `c`'s current span `i` has just become full: the next lowest span with room becomes
    /// current.
    #[inline(always)]
    fn filled(&mut self, c: usize, i: usize) {
        self.sets.remove(c, i);
        self.current[c] = self.sets.first(c).map_or(0, |j| j as u32 + 1);
    }

    /// Gives class `c`, which has no span with room ([`Self::alloc`] returned `None`, or
    /// [`Self::alloc_batch`] came back short), the fresh
    /// span at `base` (a new 64 KiB-aligned chunk from the engine), which becomes current. Its pages
    /// that start at or above `zero_from` (the heap's end of touched memory before the span) are
    /// known to be zero.
    pub(crate) fn add_span(&mut self, c: usize, base: usize, zero_from: usize) {
        debug_assert_eq!(self.current[c], 0);
        let i = (base - self.arena) >> SPAN_SHIFT;
        let cap = capacity(c);
        self.classes[i].store(c as u8 + 1, Relaxed);
        let span = &mut self.spans[i];
        span.free = cap as u32;
        span.avail = u64::MAX >> (64 - words_for(c));
        span.purged = 0;
        span.fresh = zero_from
            .saturating_sub(base)
            .div_ceil(CLASS_SIZES[c] as usize)
            .min(cap) as u16;
        for (w, word) in span.bits.iter_mut().enumerate() {
            // Bits past the capacity read as allocated so they are never handed out.
            let first = w * 64;
            *word = if first >= cap {
                u64::MAX
            } else if first + 64 > cap {
                u64::MAX << (cap - first)
            } else {
                0
            };
        }
        self.sets.insert(c, i);
        self.current[c] = i as u32 + 1;
        self.spans_live += 1;
    }

    /// The span containing `ptr`, if `ptr` is in the arena and the window is a span.
    #[inline]
    fn span_of(&self, ptr: usize) -> Option<(usize, usize)> {
        let i = ptr.wrapping_sub(self.arena) >> SPAN_SHIFT;
        let k = self.classes.get(i)?.load(Relaxed);
        (k != 0).then(|| (i, k as usize - 1))
    }

    /// Classifies `ptr`: `Ok(None)` if it is not in a span, `Ok(Some(size))` for a live object.
    #[inline]
    pub(crate) fn lookup(&self, ptr: usize) -> Result<Option<usize>, SmallFree> {
        self.locate(ptr)
            .map(|l| l.map(|(_, c, _)| CLASS_SIZES[c] as usize))
    }

    /// The class of the live object at `ptr` (`Ok(None)` if `ptr` is not in a span).
    #[inline]
    pub(crate) fn class_of_live(&self, ptr: usize) -> Result<Option<usize>, SmallFree> {
        self.locate(ptr).map(|l| l.map(|(_, c, _)| c))
    }

    /// `(span index, class, object index)` of the live object at `ptr`.
    #[inline]
    fn locate(&self, ptr: usize) -> Result<Option<(usize, usize, usize)>, SmallFree> {
        let Some((i, c)) = self.span_of(ptr) else {
            return Ok(None);
        };
        let offset = ptr - self.arena - (i << SPAN_SHIFT);
        let idx = ((offset as u64 * RECIP[c]) >> 32) as usize;
        let size = CLASS_SIZES[c] as usize;
        if idx >= capacity(c) {
            // The span's tail, past its last object: never handed out. (Its bits read as
            // allocated, so the bitmap cannot tell.)
            return Err(SmallFree::DoubleFree);
        }
        if idx * size != offset {
            return Err(SmallFree::Interior {
                block: ptr - (offset - idx * size),
            });
        }
        // (`% WORDS` changes nothing for an object index and spares a bounds check.)
        if self.spans[i].bits[idx / 64 % WORDS] & (1 << (idx % 64)) == 0 {
            return Err(SmallFree::DoubleFree);
        }
        Ok(Some((i, c, idx)))
    }

    /// Frees the object at `ptr` (see [`SmallFree`]).
    #[inline]
    pub(crate) fn free(&mut self, ptr: usize) -> SmallFree {
        self.free_of(ptr, None)
    }

    /// Frees the object at `ptr`, which must be of class `c` ([`SmallFree::OtherClass`] if it is
    /// live but of another class; nothing changes then).
    #[cfg(all(test, feature = "std"))]
    pub(crate) fn free_of_class(&mut self, ptr: usize, c: usize) -> SmallFree {
        self.free_of(ptr, Some(c))
    }

    /// Frees objects of class `c` from `ptrs`, each checked to be a live object of that class,
    /// until one frees an emptied span or fails a check; returns how many were consumed (that one
    /// included) and the last outcome (`Freed(None)` when all went through with nothing to
    /// report). One call per batch: a thread cache's flush gives back a batch at a time.
    #[cfg_attr(not(feature = "std"), allow(dead_code))]
    pub(crate) fn free_batch(&mut self, c: usize, ptrs: &[usize]) -> (usize, SmallFree) {
        // `free_of`'s checks with the class known: its size, divisor and capacity are looked up
        // once, and the counters are updated once per run of plain frees.
        let (size, recip, cap, tag) = (CLASS_SIZES[c] as usize, RECIP[c], capacity(c), c as u8 + 1);
        // (Copies, so that the loop's writes through `span` do not make the compiler reload them.)
        let (arena, classes) = (self.arena, self.classes);
        let mut freed = 0;
        for (k, &p) in ptrs.iter().enumerate() {
            let at = p.wrapping_sub(arena);
            let (i, offset) = (at >> SPAN_SHIFT, at & (SPAN - 1));
            let idx = ((offset as u64 * recip) >> 32) as usize;
            let (w, bit) = (idx / 64 % WORDS, 1u64 << (idx % 64));
            let start = classes.get(i).is_some_and(|t| t.load(Relaxed) == tag)
                && idx < cap
                && idx * size == offset;
            let Some(span) = self
                .spans
                .get_mut(i)
                .filter(|span| start && span.bits[w] & bit != 0)
            else {
                // Not a live object of class `c`: `free_of` tells which error (and changes
                // nothing).
                self.bytes -= freed * size;
                self.objects -= freed;
                return (k + 1, self.free_of(p, Some(c)));
            };
            span.bits[w] &= !bit;
            span.avail |= 1 << w;
            span.free += 1;
            freed += 1;
            let free = span.free as usize;
            if free == 1 || free == cap {
                self.bytes -= freed * size;
                self.objects -= freed;
                freed = 0;
                if let released @ SmallFree::Freed(Some(_)) = self.settle(c, i, free) {
                    return (k + 1, released);
                }
            }
        }
        self.bytes -= freed * size;
        self.objects -= freed;
        (ptrs.len(), SmallFree::Freed(None))
    }

    #[inline(always)]
    fn free_of(&mut self, ptr: usize, class: Option<usize>) -> SmallFree {
        let (i, c, idx) = match self.locate(ptr) {
            Ok(Some(l)) => l,
            Ok(None) => return SmallFree::NotSmall,
            Err(e) => return e,
        };
        if class.is_some_and(|k| k != c) {
            return SmallFree::OtherClass;
        }
        let size = CLASS_SIZES[c] as usize;
        let span = &mut self.spans[i];
        span.bits[idx / 64 % WORDS] &= !(1u64 << (idx % 64));
        span.avail |= 1 << (idx / 64);
        span.free += 1;
        let free = span.free as usize;
        self.bytes -= size;
        self.objects -= 1;
        self.settle(c, i, free)
    }

    /// After a free left span `i` of class `c` with `free` free objects: a span that was full goes
    /// back in its class's set (and becomes current if it is the lowest with room), and an empty
    /// span that is not current goes back to the engine (`Freed(Some(base))`).
    #[inline]
    fn settle(&mut self, c: usize, i: usize, free: usize) -> SmallFree {
        if free == 1 {
            // It was full: back in the set, and current if it is now the lowest with room.
            self.sets.insert(c, i);
            let cur = self.current[c];
            if cur == 0 || i < cur as usize - 1 {
                self.current[c] = i as u32 + 1;
                if cur != 0 {
                    // Only the current span is kept empty: a replaced empty one goes back.
                    let old = cur as usize - 1;
                    if self.spans[old].free as usize == capacity(c) {
                        return SmallFree::Freed(Some(self.release_span(c, old)));
                    }
                }
            }
        }
        if free == capacity(c) && self.current[c] != i as u32 + 1 {
            // Empty and not current (capacities exceed 1, so it was in the set before this free):
            // back to the engine.
            return SmallFree::Freed(Some(self.release_span(c, i)));
        }
        SmallFree::Freed(None)
    }

    /// Takes each class's current span out of the slab layer if no object on it is allocated (the
    /// class's next lowest span with room becomes current), and writes their bases to `out` for the
    /// engine; returns how many. For an allocation that would fail otherwise: the spans kept for
    /// the next small object go where they can coalesce.
    pub(crate) fn take_empty_current(&mut self, out: &mut [usize; NUM_CLASSES]) -> usize {
        let mut n = 0;
        for c in 0..NUM_CLASSES {
            let Some(i) = (self.current[c] as usize).checked_sub(1) else {
                continue;
            };
            if self.spans[i].free as usize == capacity(c) {
                out[n] = self.release_span(c, i);
                n += 1;
                self.current[c] = self.sets.first(c).map_or(0, |j| j as u32 + 1);
            }
        }
        n
    }

    /// Takes the empty, non-current span `i` of class `c` out of the slab layer; returns its base
    /// for the engine.
    fn release_span(&mut self, c: usize, i: usize) -> usize {
        self.sets.remove(c, i);
        self.classes[i].store(0, Relaxed);
        self.spans_live -= 1;
        self.arena + (i << SPAN_SHIFT)
    }

    /// Finds the pages of spans that hold no allocated object and were not given back since an
    /// object on them was last allocated; calls `discard(addr, len)` for each run of them (within
    /// one span), which says whether the pages went back, and returns the bytes that did. A run
    /// that did not go back stays a candidate for the next purge. Walks the spans below `brk` (the
    /// highest address ever handed out).
    pub(crate) fn purge(
        &mut self,
        brk: usize,
        mut discard: impl FnMut(usize, usize) -> bool,
    ) -> usize {
        let shift = self.page_shift;
        if shift == 0 {
            return 0;
        }
        let (page, pages) = (1usize << shift, SPAN >> shift);
        let mut covered = 0;
        for i in 0..self.spans_below(brk) {
            let k = self.classes[i].load(Relaxed);
            if k == 0 {
                continue;
            }
            let c = k as usize - 1;
            let span = &mut self.spans[i];
            let (size, cap) = (CLASS_SIZES[c] as usize, capacity(c));
            let mut free = 0u16;
            for p in 0..pages {
                let lo = p * page / size;
                let hi = (((p + 1) * page - 1) / size).min(cap - 1);
                if lo > hi || range_clear(&span.bits, lo, hi) {
                    free |= 1 << p;
                }
            }
            let take = free & !span.purged;
            span.purged |= take;
            let base = self.arena + (i << SPAN_SHIFT);
            let mut m = take as u32;
            while m != 0 {
                let first = m.trailing_zeros();
                let run = (m >> first).trailing_ones();
                let bits = ((1u32 << run) - 1) << first;
                if discard(base + ((first as usize) << shift), (run as usize) << shift) {
                    covered += (run as usize) << shift;
                } else {
                    span.purged &= !(bits as u16);
                }
                m &= !bits;
            }
        }
        covered
    }

    /// Checks the span table against the counters. Spans lie below `brk` (the highest address ever
    /// handed out), so only that prefix of the table is walked.
    pub(crate) fn check(&self, brk: usize) -> Result<(), &'static str> {
        let (mut objects, mut bytes, mut spans) = (0usize, 0usize, 0usize);
        // Only the prefix of the table that can hold spans in use is walked (and the sets' words
        // over it: no span beyond it is in a set).
        let limit = self.spans_below(brk);
        self.sets.check(limit.div_ceil(64))?;
        for c in 0..NUM_CLASSES {
            let first = self.sets.first(c);
            if first.is_some_and(|i| i >= limit) {
                return Err("span set holds a span beyond the arena's high-water mark");
            }
            if self.current[c] != first.map_or(0, |i| i as u32 + 1) {
                return Err("current span is not the lowest span of its class with room");
            }
            for i in 0..limit {
                let s = &self.spans[i];
                let mine = self.classes[i].load(Relaxed) as usize == c + 1;
                if self.sets.contains(c, i) != (mine && s.free > 0) {
                    return Err("span set disagrees with the span table");
                }
                if mine && s.free as usize == capacity(c) && self.current[c] != i as u32 + 1 {
                    return Err("an empty span other than the current one is held");
                }
            }
        }
        for (s, k) in self.spans.iter().zip(self.classes).take(limit) {
            let k = k.load(Relaxed);
            if k == 0 {
                continue;
            }
            let c = k as usize - 1;
            let cap = capacity(c);
            let set: usize = s
                .bits
                .iter()
                .map(|w| w.count_ones() as usize)
                .sum::<usize>()
                - (WORDS * 64 - cap);
            if cap - set != s.free as usize {
                return Err("span free count disagrees with its bitmap");
            }
            let avail = (0..words_for(c))
                .filter(|&w| s.bits[w] != u64::MAX)
                .fold(0u64, |a, w| a | 1 << w);
            if avail != s.avail {
                return Err("span word summary disagrees with its bitmap");
            }
            spans += 1;
            objects += set;
            bytes += set * CLASS_SIZES[c] as usize;
        }
        if (objects, bytes, spans) != (self.objects, self.bytes, self.spans_live) {
            return Err("small-object counters disagree with the span table");
        }
        Ok(())
    }

    /// Span-table and span-set bytes that may be resident: the entries of every span below `end`
    /// (the host passes the committed end of the arena, which never moves down and lies above every
    /// span ever used).
    pub(crate) fn metadata_bytes(&self, end: usize) -> usize {
        let entries = self.spans_below(end);
        entries * (Self::ENTRY + 1) + self.sets.resident_bytes(entries.div_ceil(64))
    }

    /// Span-table entries that can hold a span, given `brk` (the highest address ever handed out).
    fn spans_below(&self, brk: usize) -> usize {
        ((brk.saturating_sub(self.arena) >> SPAN_SHIFT) + 1).min(self.spans.len())
    }
}

/// Whether objects `lo..=hi` are all free in `bits`.
fn range_clear(bits: &[u64; WORDS], lo: usize, hi: usize) -> bool {
    (lo / 64..=hi / 64).all(|w| {
        let from = if w == lo / 64 { lo % 64 } else { 0 };
        let to = if w == hi / 64 { hi % 64 } else { 63 };
        let mask = (u64::MAX >> (63 - to)) & (u64::MAX << from);
        bits[w] & mask == 0
    })
}

/// Objects per span of class `c`.
#[inline]
pub(crate) fn capacity(c: usize) -> usize {
    const CAP: [u16; NUM_CLASSES] = {
        let mut cap = [0u16; NUM_CLASSES];
        let mut c = 0;
        while c < NUM_CLASSES {
            cap[c] = (SPAN / CLASS_SIZES[c] as usize) as u16;
            c += 1;
        }
        cap
    };
    CAP[c] as usize
}

/// Bitmap words searched for class `c`.
#[inline]
fn words_for(c: usize) -> usize {
    const W: [u8; NUM_CLASSES] = {
        let mut w = [0u8; NUM_CLASSES];
        let mut c = 0;
        while c < NUM_CLASSES {
            w[c] = (SPAN / CLASS_SIZES[c] as usize).div_ceil(64) as u8;
            c += 1;
        }
        w
    };
    W[c] as usize
}

#[cfg(all(test, feature = "std"))]
mod tests {
    use super::*;
    use std::{vec, vec::Vec};

    #[test]
    fn classes_cover_every_small_size() {
        for size in 1..=SMALL_MAX {
            let c = class_for(size, 8).unwrap();
            assert!(CLASS_SIZES[c] as usize >= size);
            if c > 0 {
                assert!(
                    (CLASS_SIZES[c - 1] as usize) < size,
                    "size {size} not in its smallest class"
                );
            }
            assert_eq!(CLASS_SIZES[c] % 16, 0);
        }
        assert_eq!(class_for(SMALL_MAX + 1, 8), None);
    }

    /// An aligned request takes the smallest class that holds it and whose size is a multiple of
    /// the alignment (so every object of the class is aligned); beyond 4 KiB of alignment, or
    /// 16 KiB of size, it goes to the engine.
    #[test]
    fn aligned_requests_take_the_smallest_class_of_aligned_objects() {
        let mut align = 32;
        while align <= SMALL_ALIGN {
            for size in 1..=SMALL_MAX {
                let c = class_for(size, align).unwrap();
                let fits = |d: usize| {
                    CLASS_SIZES[d] as usize >= size && CLASS_SIZES[d] as usize % align == 0
                };
                assert!(
                    fits(c),
                    "size {size} align {align}: class {}",
                    CLASS_SIZES[c]
                );
                assert!(
                    (0..c).all(|d| !fits(d)),
                    "size {size} align {align}: class {} is not the smallest",
                    CLASS_SIZES[c]
                );
                // Every object of the class starts at an aligned offset of its span.
                assert!((0..SPAN / CLASS_SIZES[c] as usize)
                    .all(|i| i * CLASS_SIZES[c] as usize % align == 0));
            }
            assert_eq!(class_for(SMALL_MAX + 1, align), None);
            align *= 2;
        }
        assert_eq!(class_for(100, 64), class_for(128, 8));
        assert_eq!(class_for(1, SMALL_ALIGN), class_for(SMALL_ALIGN, 8));
        // Above 4 KiB of alignment every size goes to the engine; a page-aligned 4097 bytes takes
        // the 8 KiB class.
        assert_eq!(class_for(8, 2 * SMALL_ALIGN), None);
        assert_eq!(class_for(SMALL_MAX, 2 * SMALL_ALIGN), None);
        assert_eq!(class_for(4097, SMALL_ALIGN), class_for(8192, 8));
        // At most 16 bytes of alignment changes nothing.
        assert!((1..=SMALL_MAX).all(|s| class_for(s, 16) == class_for(s, 1)));
    }

    /// A heap over a fake arena at `ARENA` of `spans` spans (the slab layer never touches object
    /// memory, so none is needed), with 4 KiB pages.
    fn heap(spans: usize) -> SmallHeap {
        heap_with_pages(spans, 4096)
    }

    fn heap_with_pages(spans: usize, page: usize) -> SmallHeap {
        let table: Vec<Span> = (0..spans)
            .map(|_| Span {
                free: 0,
                purged: 0,
                fresh: 0,
                avail: 0,
                bits: [0; WORDS],
            })
            .collect();
        let sets = vec![0u64; SpanSets::words_for(spans)];
        let classes: Vec<AtomicU8> = (0..spans).map(|_| AtomicU8::new(0)).collect();
        SmallHeap::new(ARENA, page, table.leak(), classes.leak(), sets.leak())
    }

    const ARENA: usize = 1 << 40;

    /// The span-table metadata counts, for every span below the end it is given (the span the end
    /// lies in too), the span's entry and its class byte, plus the span sets' words.
    #[test]
    fn metadata_counts_an_entry_and_a_class_byte_per_span_reached() {
        let h = heap(256);
        let per_span = SmallHeap::ENTRY + 1;
        let sets = h.sets.resident_bytes(1);
        assert_eq!(h.metadata_bytes(ARENA), per_span + sets);
        for k in 1..64 {
            assert_eq!(
                h.metadata_bytes(base(k)) - h.metadata_bytes(base(k) - 1),
                per_span,
                "span {k}"
            );
            assert_eq!(
                h.metadata_bytes(base(k) + SPAN - 1),
                (k + 1) * per_span + sets
            );
        }
        // Never more than the table.
        assert_eq!(h.metadata_bytes(base(1000)), h.metadata_bytes(base(255)));
    }

    fn base(i: usize) -> usize {
        ARENA + (i << SPAN_SHIFT)
    }

    /// Allocates from class `c`, adding the span `fresh` when every span of the class is full.
    fn alloc(h: &mut SmallHeap, c: usize, fresh: usize) -> usize {
        h.alloc(c).unwrap_or_else(|| {
            h.add_span(c, base(fresh), usize::MAX);
            h.alloc(c).unwrap()
        })
    }

    #[test]
    fn allocation_takes_the_lowest_free_object_of_the_lowest_span() {
        let c = class_for(2048, 8).unwrap();
        let cap = capacity(c);
        let mut h = heap(64);
        // Three full spans, added out of address order.
        let mut objs = Vec::new();
        for &i in &[9, 2, 5] {
            for k in 0..cap {
                let p = alloc(&mut h, c, i);
                assert_eq!(p, base(i) + k * 2048);
                objs.push(p);
            }
        }
        assert!(h.alloc(c).is_none(), "all spans full");
        h.check(base(10)).unwrap();
        // Holes in the highest and the middle span: the middle one's is taken first, lowest first.
        for p in [base(9) + 3 * 2048, base(5) + 7 * 2048, base(5) + 2048] {
            assert!(matches!(h.free(p), SmallFree::Freed(None)));
            h.check(base(10)).unwrap();
        }
        assert_eq!(h.alloc(c), Some(base(5) + 2048));
        assert_eq!(h.alloc(c), Some(base(5) + 7 * 2048));
        assert_eq!(h.alloc(c), Some(base(9) + 3 * 2048));
        assert_eq!(h.alloc(c), None);
        h.check(base(10)).unwrap();
    }

    /// The batch paths a thread cache's refills and flushes take give the same objects, counters,
    /// released spans and page state as one call per object.
    #[test]
    fn batches_match_one_object_at_a_time() {
        for c in [0, class_for(100, 8).unwrap(), class_for(4096, 8).unwrap()] {
            let (mut one, mut many) = (heap(2048), heap(2048));
            let mut rng = 0x9e37_79b9_7f4a_7c15u64;
            let mut next = move || {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng as usize
            };
            let mut live: Vec<usize> = Vec::new();
            let mut fresh = 1;
            for round in 0..200 {
                // Allocate a batch: one at a time in `one`, in one call (plus new spans) in `many`.
                let want = 1 + next() % 64;
                let mut expect = Vec::new();
                let mut added = Vec::new();
                while expect.len() < want {
                    match one.alloc(c) {
                        Some(p) => expect.push(p),
                        None => {
                            one.add_span(c, base(fresh), usize::MAX);
                            added.push(fresh);
                            fresh += 1;
                        }
                    }
                }
                let mut got = vec![0; want];
                let mut n = 0;
                let mut spans = added.into_iter();
                while n < want {
                    n += many.alloc_batch(c, &mut got[n..]);
                    if n < want {
                        // A short batch means no span has room: take the one `one` took then.
                        assert!(many.alloc(c).is_none(), "a batch stopped with room left");
                        let i = spans.next().expect("the batch needed a span `one` did not");
                        many.add_span(c, base(i), usize::MAX);
                    }
                }
                assert!(
                    spans.next().is_none(),
                    "`one` needed a span the batch did not"
                );
                assert_eq!(got, expect, "class {c} round {round}");
                live.extend(got);
                // Free a random batch: one at a time in `one`, in batches in `many`.
                let k = next() % (live.len() + 1);
                let mut batch = Vec::new();
                for _ in 0..k {
                    batch.push(live.swap_remove(next() % live.len()));
                }
                let mut released = Vec::new();
                for &p in &batch {
                    match one.free_of_class(p, c) {
                        SmallFree::Freed(Some(b)) => released.push(b),
                        SmallFree::Freed(None) => {}
                        _ => panic!("bad free"),
                    }
                }
                let mut released_batch = Vec::new();
                let mut rest = &batch[..];
                while !rest.is_empty() {
                    let (k, outcome) = many.free_batch(c, rest);
                    match outcome {
                        SmallFree::Freed(Some(b)) => released_batch.push(b),
                        SmallFree::Freed(None) => assert_eq!(k, rest.len()),
                        _ => panic!("bad free"),
                    }
                    rest = &rest[k..];
                }
                assert_eq!(released_batch, released);
                if round % 7 == 0 {
                    let (mut a, mut b) = (Vec::new(), Vec::new());
                    one.purge(base(fresh), |x, l| {
                        a.push((x, l));
                        true
                    });
                    many.purge(base(fresh), |x, l| {
                        b.push((x, l));
                        true
                    });
                    assert_eq!(a, b);
                }
                let counters = |h: &SmallHeap| (h.bytes, h.objects, h.allocs, h.spans_live);
                assert_eq!(counters(&many), counters(&one));
                many.check(base(fresh)).unwrap();
            }
            for i in 0..fresh {
                assert_eq!(many.spans[i].bits, one.spans[i].bits);
                assert_eq!(many.spans[i].purged, one.spans[i].purged);
            }
        }
    }

    #[test]
    fn a_batch_free_stops_at_a_bad_pointer_or_a_released_span() {
        let c = class_for(4096, 8).unwrap();
        let cap = capacity(c);
        let mut h = heap(16);
        let lo: Vec<usize> = (0..cap).map(|_| alloc(&mut h, c, 3)).collect();
        let hi: Vec<usize> = (0..2).map(|_| alloc(&mut h, c, 7)).collect();
        // A double free in the middle: the ones before it are freed, the rest untouched.
        let batch = [lo[0], lo[1], lo[0], lo[2]];
        assert!(matches!(
            h.free_batch(c, &batch),
            (3, SmallFree::DoubleFree)
        ));
        assert_eq!(h.objects, cap + 2 - 2);
        // A pointer of another class or inside an object is reported as such.
        assert!(matches!(
            h.free_batch(class_for(2048, 8).unwrap(), &[lo[3]]),
            (1, SmallFree::OtherClass)
        ));
        assert!(matches!(
            h.free_batch(c, &[lo[2], lo[3] + 16]),
            (2, SmallFree::Interior { block }) if block == lo[3]
        ));
        // Emptying the higher span (not current: the lower one has room) releases it and stops.
        match h.free_batch(c, &[hi[0], hi[1], lo[3]]) {
            (2, SmallFree::Freed(Some(b))) => assert_eq!(b, base(7)),
            _ => panic!("the emptied span was not reported"),
        }
        assert!(matches!(
            h.free_batch(c, &[lo[3]]),
            (1, SmallFree::Freed(None))
        ));
        h.check(base(8)).unwrap();
    }

    /// A current span whose bitmap says it is full while its count says it has room (overwritten
    /// metadata) aborts the batch allocation instead of spinning under the heap lock.
    #[test]
    #[cfg_attr(miri, ignore = "spawns a child process")]
    #[cfg(not(loom))]
    fn a_batch_from_a_corrupted_span_aborts() {
        let case = "a_batch_from_a_corrupted_span_aborts";
        if crate::host::tests::is_child(case) {
            let c = class_for(64, 8).unwrap();
            let mut h = heap(4);
            alloc(&mut h, c, 1);
            h.spans[1].avail = 0;
            let mut out = [0usize; 8];
            let n = h.alloc_batch(c, &mut out);
            std::println!("child survived with {n} objects");
            return;
        }
        crate::host::tests::assert_child_aborts(
            "host::small::tests",
            case,
            "slab metadata corrupted: the current span of class",
        );
    }

    #[test]
    fn only_the_current_span_stays_empty() {
        let c = class_for(4096, 8).unwrap();
        let cap = capacity(c);
        let mut h = heap(16);
        let lo: Vec<usize> = (0..cap).map(|_| alloc(&mut h, c, 3)).collect();
        let hi: Vec<usize> = (0..cap).map(|_| alloc(&mut h, c, 7)).collect();
        // Emptying the higher span: it is the only one with room, so it is current and stays.
        for &p in &hi {
            assert!(matches!(h.free(p), SmallFree::Freed(None)));
        }
        assert_eq!(h.spans_live, 2);
        h.check(base(8)).unwrap();
        // A hole in the lower span makes it current; the empty higher one goes back at once.
        match h.free(lo[5]) {
            SmallFree::Freed(Some(b)) => assert_eq!(b, base(7)),
            _ => panic!("the replaced empty span was not given back"),
        }
        assert_eq!(h.spans_live, 1);
        h.check(base(8)).unwrap();
        // Emptying the current span keeps it; nothing goes back.
        for (k, &p) in lo.iter().enumerate() {
            if k != 5 {
                assert!(matches!(h.free(p), SmallFree::Freed(None)));
            }
        }
        assert_eq!((h.spans_live, h.objects), (1, 0));
        h.check(base(8)).unwrap();
    }

    #[test]
    fn empty_current_spans_are_taken_and_the_next_span_becomes_current() {
        let c = class_for(4096, 8).unwrap();
        let d = class_for(16, 8).unwrap();
        let cap = capacity(c);
        let mut h = heap(16);
        let lo: Vec<usize> = (0..cap).map(|_| alloc(&mut h, c, 3)).collect();
        let hi = alloc(&mut h, c, 7);
        let kept = alloc(&mut h, d, 9);
        // Class `c`'s lower span empties and becomes current; the higher one keeps an object.
        for &p in &lo {
            assert!(matches!(h.free(p), SmallFree::Freed(None)));
        }
        h.check(base(10)).unwrap();
        let mut out = [0; NUM_CLASSES];
        assert_eq!(
            h.take_empty_current(&mut out),
            1,
            "only class c's span is empty"
        );
        assert_eq!(out[0], base(3));
        assert_eq!((h.spans_live, h.objects), (2, 2));
        h.check(base(10)).unwrap();
        // The span with room left becomes current.
        assert_eq!(h.alloc(c), Some(hi + 4096));
        assert_eq!(h.take_empty_current(&mut out), 0);
        // A class whose last object goes keeps its span again, until the next call.
        assert!(matches!(h.free(kept), SmallFree::Freed(None)));
        assert_eq!(h.take_empty_current(&mut out), 1);
        assert_eq!(out[0], base(9));
        assert_eq!(h.alloc(d), None, "class d has no span left");
        h.check(base(10)).unwrap();
    }

    #[test]
    fn span_sets_agree_with_a_reference_set() {
        // 300,000 spans: four levels.
        let n = 300_000;
        let mut sets = SpanSets::new(vec![0u64; SpanSets::words_for(n)].leak(), n);
        assert_eq!(sets.levels, 4);
        let mut reference = vec![std::collections::BTreeSet::new(); NUM_CLASSES];
        let mut x = 0x2545_f491_4f6c_dd1du64;
        // (Under Miri, fewer operations and a sample of the final comparison.)
        let (ops, stride) = if cfg!(miri) {
            (2_000, 997)
        } else {
            (200_000, 1)
        };
        for _ in 0..ops {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let c = (x % 3) as usize * 13;
            // Mostly low indices, some anywhere: both dense and sparse words.
            let i = if x & 0x100 != 0 {
                (x >> 20) as usize % 2000
            } else {
                (x >> 20) as usize % n
            };
            if reference[c].contains(&i) {
                sets.remove(c, i);
                reference[c].remove(&i);
            } else {
                sets.insert(c, i);
                reference[c].insert(i);
            }
            assert_eq!(sets.first(c), reference[c].first().copied());
        }
        for (c, r) in reference.iter().enumerate() {
            for i in (0..n).step_by(stride).chain(r.iter().copied()) {
                assert_eq!(sets.contains(c, i), r.contains(&i));
            }
        }
        sets.check(n.div_ceil(64)).unwrap();
        // A summary bit left set over an empty word is caught.
        let top = *reference[13].last().unwrap();
        let w = sets.at(13, 0, top / 64);
        let saved = sets.words[w];
        sets.words[w] = 0;
        assert!(sets.check(n.div_ceil(64)).is_err());
        sets.words[w] = saved;
        sets.check(n.div_ceil(64)).unwrap();
    }

    #[test]
    fn check_catches_a_span_missing_from_its_set() {
        let c = class_for(100, 8).unwrap();
        let mut h = heap(8);
        let p = alloc(&mut h, c, 4);
        h.check(base(5)).unwrap();
        // The current span missing from the set.
        h.sets.remove(c, 4);
        assert_eq!(
            h.check(base(5)),
            Err("current span is not the lowest span of its class with room")
        );
        h.sets.insert(c, 4);
        h.check(base(5)).unwrap();
        // A window that is not a span, in the set above the current one.
        h.sets.insert(c, 3 + 3);
        assert_eq!(
            h.check(base(7)),
            Err("span set disagrees with the span table")
        );
        h.sets.remove(c, 6);
        h.check(base(7)).unwrap();
        assert!(matches!(h.free(p), SmallFree::Freed(None)));
    }

    #[test]
    fn purge_gives_back_whole_free_pages_once() {
        // 4 KiB objects: one page each.
        let c = class_for(4096, 8).unwrap();
        let mut h = heap(8);
        let objs: Vec<usize> = (0..capacity(c)).map(|_| alloc(&mut h, c, 1)).collect();
        for k in [3, 4, 5, 9] {
            h.free(objs[k]);
        }
        let mut runs = Vec::new();
        let covered = h.purge(base(2), |a, l| {
            runs.push((a, l));
            true
        });
        assert_eq!(
            runs,
            vec![(base(1) + 3 * 4096, 3 * 4096), (base(1) + 9 * 4096, 4096)]
        );
        assert_eq!(covered, 4 * 4096);
        // Already given back: nothing the second time.
        assert_eq!(h.purge(base(2), |_, _| panic!("purged twice")), 0);
        // Allocating the lowest free object makes its page resident again, and freeing it makes
        // it a candidate again.
        assert_eq!(h.alloc(c), Some(objs[3]));
        assert_eq!(h.purge(base(2), |_, _| panic!("page of a live object")), 0);
        h.free(objs[3]);
        let mut runs = Vec::new();
        h.purge(base(2), |a, l| {
            runs.push((a, l));
            true
        });
        assert_eq!(runs, vec![(objs[3], 4096)]);
        h.check(base(2)).unwrap();
    }

    #[test]
    fn a_refused_purge_is_not_counted_and_is_tried_again() {
        let c = class_for(4096, 8).unwrap();
        let mut h = heap(8);
        let objs: Vec<usize> = (0..capacity(c)).map(|_| alloc(&mut h, c, 1)).collect();
        for k in [3, 4, 9] {
            h.free(objs[k]);
        }
        // The kernel refuses the run at object 3 and takes the one at object 9.
        let covered = h.purge(base(2), |a, _| a != objs[3]);
        assert_eq!(covered, 4096);
        let mut runs = Vec::new();
        let covered = h.purge(base(2), |a, l| {
            runs.push((a, l));
            true
        });
        assert_eq!(runs, vec![(objs[3], 2 * 4096)]);
        assert_eq!(covered, 2 * 4096);
        h.check(base(2)).unwrap();
    }

    #[test]
    fn purge_with_16_and_64_kib_pages() {
        let c = class_for(4096, 8).unwrap();
        for (page, pages) in [(16 << 10, 4), (64 << 10, 1)] {
            let mut h = heap_with_pages(4, page);
            let objs: Vec<usize> = (0..capacity(c)).map(|_| alloc(&mut h, c, 1)).collect();
            // Free every object but the last: every page but the last is whole and free.
            for &p in &objs[..capacity(c) - 1] {
                h.free(p);
            }
            let mut runs = Vec::new();
            h.purge(base(2), |a, l| {
                runs.push((a, l));
                true
            });
            let expect = if pages == 1 {
                vec![]
            } else {
                vec![(base(1), (pages - 1) * page)]
            };
            assert_eq!(runs, expect, "{page}-byte pages");
            // The last object's page comes back once it is freed, and only then.
            h.free(objs[capacity(c) - 1]);
            let mut runs = Vec::new();
            h.purge(base(2), |a, l| {
                runs.push((a, l));
                true
            });
            assert_eq!(runs, vec![(base(1) + (pages - 1) * page, page)]);
            h.check(base(2)).unwrap();
        }
    }

    #[test]
    fn purge_gives_back_the_last_page_of_a_span_with_a_tail() {
        // 3 KiB objects: 21 fill 63 KiB; the last page holds object 20's end and the 1 KiB tail,
        // which holds no object, so it is free once object 20 is.
        let c = class_for(3072, 8).unwrap();
        let mut h = heap(8);
        let objs: Vec<usize> = (0..capacity(c)).map(|_| alloc(&mut h, c, 1)).collect();
        for &p in &objs {
            h.free(p);
        }
        let mut runs = Vec::new();
        let covered = h.purge(base(2), |a, l| {
            runs.push((a, l));
            true
        });
        assert_eq!(runs, vec![(base(1), SPAN)]);
        assert_eq!(covered, SPAN);
        h.check(base(2)).unwrap();
    }

    #[test]
    fn purge_keeps_pages_shared_with_a_live_object() {
        // 3 KiB objects straddle pages: page 2 (8..12 KiB) meets objects 2 (6..9 KiB) and 3
        // (9..12 KiB).
        let c = class_for(3072, 8).unwrap();
        let mut h = heap(8);
        let objs: Vec<usize> = (0..capacity(c)).map(|_| alloc(&mut h, c, 1)).collect();
        h.free(objs[3]);
        assert_eq!(
            h.purge(base(2), |_, _| panic!("page 2 still meets object 2")),
            0
        );
        h.free(objs[2]);
        let mut runs = Vec::new();
        h.purge(base(2), |a, l| {
            runs.push((a, l));
            true
        });
        // Objects 2 and 3 cover 6..12 KiB: only page 2 is whole and free (page 1 meets object 1).
        assert_eq!(runs, vec![(base(1) + 2 * 4096, 4096)]);
        // The last page of the span holds no object start past the capacity (21 x 3 KiB = 63
        // KiB), but meets object 20, which is live.
        h.check(base(2)).unwrap();
    }

    #[test]
    #[cfg_attr(miri, ignore = "arithmetic on 2.4M cases, checked natively")]
    fn object_starts_are_the_multiples_below_the_last_objects_end() {
        for (c, &size) in CLASS_SIZES.iter().enumerate() {
            let size = size as usize;
            for offset in 0..SPAN {
                assert_eq!(
                    is_object_start(offset, c),
                    offset % size == 0 && offset / size < capacity(c),
                    "class {c} ({size} B), offset {offset}"
                );
            }
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "arithmetic on 2.4M cases, checked natively")]
    fn reciprocal_division_is_exact() {
        for (c, &size) in CLASS_SIZES.iter().enumerate() {
            for offset in 0..SPAN {
                assert_eq!(
                    ((offset as u64 * RECIP[c]) >> 32) as usize,
                    offset / size as usize
                );
            }
        }
    }

    /// A window released as a span and made a span again forgets which pages were purged, or
    /// pages dirtied in between would never be given back again.
    #[test]
    fn a_span_made_again_has_no_stale_purged_pages() {
        let c = class_for(4096, 8).unwrap();
        let cap = capacity(c);
        let mut h = heap(8);
        let lo: Vec<usize> = (0..cap).map(|_| alloc(&mut h, c, 1)).collect();
        let hi = alloc(&mut h, c, 2);
        assert!(matches!(h.free(lo[0]), SmallFree::Freed(None)));
        h.purge(base(3), |_, _| true);
        match h.free(hi) {
            SmallFree::Freed(Some(b)) => assert_eq!(b, base(2)),
            _ => panic!("span 2 not released"),
        }
        let d = class_for(2048, 8).unwrap();
        assert_eq!(alloc(&mut h, d, 2), base(2));
        let mut runs = Vec::new();
        h.purge(base(3), |a, l| {
            runs.push((a, l));
            true
        });
        assert_eq!(runs, vec![(base(2) + 4096, 15 * 4096)]);
    }

    /// The page-range test reads the last bit of each bitmap word: a live object there keeps its
    /// page.
    #[test]
    fn purge_keeps_a_page_whose_live_object_is_bit_63_of_a_word() {
        let c = class_for(16, 8).unwrap();
        let mut h = heap(4);
        let objs: Vec<usize> = (0..capacity(c)).map(|_| alloc(&mut h, c, 1)).collect();
        for (k, &p) in objs.iter().enumerate() {
            if k != 63 {
                h.free(p);
            }
        }
        let mut runs = Vec::new();
        h.purge(base(2), |a, l| {
            runs.push((a, l));
            true
        });
        assert_eq!(runs, vec![(base(1) + 4096, 15 * 4096)]);
    }

    #[test]
    fn check_catches_a_wrong_free_count_and_a_held_empty_span() {
        let c = class_for(4096, 8).unwrap();
        let cap = capacity(c);
        let mut h = heap(8);
        let lo: Vec<usize> = (0..cap).map(|_| alloc(&mut h, c, 3)).collect();
        let _hi = alloc(&mut h, c, 5);
        h.check(base(6)).unwrap();
        h.spans[5].free -= 1;
        assert_eq!(
            h.check(base(6)),
            Err("span free count disagrees with its bitmap")
        );
        h.spans[5].free += 1;
        h.check(base(6)).unwrap();
        assert!(matches!(h.free(lo[0]), SmallFree::Freed(None)));
        h.spans[5].bits[0] &= !1;
        h.spans[5].free += 1;
        h.objects -= 1;
        h.bytes -= 4096;
        assert_eq!(
            h.check(base(6)),
            Err("an empty span other than the current one is held")
        );
    }

    #[test]
    fn check_catches_a_span_set_reaching_past_the_high_water_mark() {
        let c = class_for(100, 8).unwrap();
        let mut h = heap(8);
        let p = alloc(&mut h, c, 4);
        h.check(base(5)).unwrap();
        // The class's set (and current span) moved to a window past the high-water mark.
        h.sets.remove(c, 4);
        h.sets.insert(c, 6);
        h.current[c] = 7;
        assert_eq!(
            h.check(base(5)),
            Err("span set holds a span beyond the arena's high-water mark")
        );
        h.sets.remove(c, 6);
        h.sets.insert(c, 4);
        h.current[c] = 5;
        h.check(base(5)).unwrap();
        assert!(matches!(h.free(p), SmallFree::Freed(None)));
    }

    #[test]
    fn check_catches_a_wrong_word_summary_and_wrong_counters() {
        let c = class_for(100, 8).unwrap();
        let mut h = heap(8);
        let p = alloc(&mut h, c, 4);
        h.check(base(5)).unwrap();
        // The span's first word has room, but its summary bit says it is full.
        assert_ne!(h.spans[4].avail & 1, 0);
        h.spans[4].avail &= !1;
        assert_eq!(
            h.check(base(5)),
            Err("span word summary disagrees with its bitmap")
        );
        h.spans[4].avail |= 1;
        h.check(base(5)).unwrap();
        // Each counter off by one.
        for k in 0..3 {
            match k {
                0 => h.objects += 1,
                1 => h.bytes += 1,
                _ => h.spans_live += 1,
            }
            assert_eq!(
                h.check(base(5)),
                Err("small-object counters disagree with the span table"),
                "counter {k}"
            );
            match k {
                0 => h.objects -= 1,
                1 => h.bytes -= 1,
                _ => h.spans_live -= 1,
            }
            h.check(base(5)).unwrap();
        }
        assert!(matches!(h.free(p), SmallFree::Freed(None)));
    }
}
