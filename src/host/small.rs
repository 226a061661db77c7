//! Small objects: size-class slabs carved from BFC chunks.
//!
//! Requests of at most [`SMALL_MAX`] (4 KiB) bytes with alignment at most 16 are served from *spans*: 64 KiB,
//! 64 KiB-aligned chunks taken from the BFC engine, each cut into equal objects of one size class.
//! Everything about a span lives outside it, in the span table (one [`Span`] per 64 KiB of arena):
//! its class, its free count, and a bitmap with one bit per object (set = allocated). So:
//!
//! - allocation finds a clear bit in the class's current span (a few instructions, no list walk);
//! - free finds the span by address arithmetic, checks that the pointer is an object start whose bit
//!   is set (an interior pointer or a double free is detected, never absorbed), and clears the bit;
//! - object memory is never written by the allocator, so untouched objects stay untouched pages.
//!
//! A span whose objects are all free goes back to the engine (and so can coalesce), unless it is the
//! class's current span. Memory held this way is bounded by the live objects' spans plus one current
//! span per class (28 x 64 KiB).
//!
//! Invariants: `classes[c].current`, and every span on `classes[c].partial`, have `class == c + 1`;
//! a span is on its class's partial list iff it is not current and `0 < free < capacity`.

/// Largest small request.
pub(crate) const SMALL_MAX: usize = 4096;
/// Span size (and alignment).
pub(crate) const SPAN_SHIFT: u32 = 16;
pub(crate) const SPAN: usize = 1 << SPAN_SHIFT;
/// Words of the per-span bitmap: enough for 16-byte objects.
const WORDS: usize = SPAN / 16 / 64;

/// The class sizes: steps of 16 up to 128, then four classes per power of two (waste under 25%).
pub(crate) const CLASS_SIZES: [u32; 28] = [
    16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024,
    1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096,
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

/// The class of a small request, or `None` if it goes to the engine.
#[inline]
pub(crate) fn class_for(size: usize, align: usize) -> Option<usize> {
    if size <= SMALL_MAX && align <= 16 {
        Some(CLASS_OF[size.div_ceil(16)] as usize)
    } else {
        None
    }
}

/// Size of class `c`'s objects.
#[cfg_attr(not(feature = "std"), allow(dead_code))]
#[inline(always)]
pub(crate) const fn class_size(c: usize) -> usize {
    CLASS_SIZES[c] as usize
}

/// Whether `offset` (from a span's start, below [`SPAN`]) is the start of an object of class `c`.
#[cfg_attr(not(feature = "std"), allow(dead_code))]
#[inline(always)]
pub(crate) fn is_object_start(offset: usize, c: usize) -> bool {
    let idx = ((offset as u64 * RECIP[c]) >> 32) as usize;
    idx * CLASS_SIZES[c] as usize == offset
}

/// Metadata of one 64 KiB window of the arena. All-zero bytes mean "not a span".
#[repr(C)]
pub(crate) struct Span {
    /// Class + 1, or 0 when the window is not a span.
    class: u8,
    /// Free objects.
    free: u16,
    /// Bit `w` set iff `bits[w]` has a clear bit (for the words in use).
    avail: u64,
    /// Partial-list links: span index + 1, 0 for none.
    prev: u32,
    next: u32,
    /// Bit `i` set iff object `i` is allocated; bits past the capacity are set.
    bits: [u64; WORDS],
}

#[derive(Clone, Copy)]
struct ClassState {
    /// Span index + 1 of the current span, 0 for none.
    current: u32,
    /// Head of the partial list (span index + 1), 0 for none.
    partial: u32,
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
    classes: [ClassState; NUM_CLASSES],
    /// Bytes of live small objects (class sizes) and their number.
    pub(crate) bytes: usize,
    pub(crate) objects: usize,
    /// Spans held (each `SPAN` bytes of the engine's in-use bytes), and their high-water mark.
    pub(crate) spans_live: usize,
    pub(crate) spans_peak: usize,
    /// Allocations served.
    pub(crate) allocs: u64,
}

impl SmallHeap {
    /// Wraps span-table storage for an arena at `arena` (64 KiB-aligned).
    pub(crate) fn new(arena: usize, spans: &'static mut [Span]) -> Self {
        SmallHeap {
            arena,
            spans,
            classes: [ClassState {
                current: 0,
                partial: 0,
            }; NUM_CLASSES],
            bytes: 0,
            objects: 0,
            spans_live: 0,
            spans_peak: 0,
            allocs: 0,
        }
    }

    /// Start of the arena.
    #[cfg_attr(not(feature = "std"), allow(dead_code))]
    pub(crate) fn arena(&self) -> usize {
        self.arena
    }

    /// Bytes of one span-table entry.
    pub(crate) const ENTRY: usize = core::mem::size_of::<Span>();

    /// Allocates an object of class `c` from the current span; `None` when a new span is needed.
    #[inline]
    pub(crate) fn alloc(&mut self, c: usize) -> Option<usize> {
        let cur = self.classes[c].current;
        if cur == 0 {
            return None;
        }
        let i = cur as usize - 1;
        let span = &mut self.spans[i];
        if span.free == 0 {
            return None;
        }
        // `free > 0`, so some word in use has a clear bit and `avail` is non-zero.
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
        self.bytes += size;
        self.objects += 1;
        self.allocs += 1;
        Some(self.arena + (i << SPAN_SHIFT) + (w * 64 + bit) * size)
    }

    /// Makes a span with free objects current for class `c`: a partial one if any, else `fresh`
    /// (a new 64 KiB-aligned chunk from the engine) if given. Returns whether a span is now current.
    pub(crate) fn refill(&mut self, c: usize, fresh: Option<usize>) -> bool {
        let head = self.classes[c].partial;
        if head != 0 {
            self.unlink_partial(c, head as usize - 1);
            self.classes[c].current = head;
            return true;
        }
        let Some(base) = fresh else {
            return false;
        };
        let i = (base - self.arena) >> SPAN_SHIFT;
        let cap = capacity(c);
        let span = &mut self.spans[i];
        span.class = c as u8 + 1;
        span.free = cap as u16;
        span.avail = u64::MAX >> (64 - words_for(c));
        span.prev = 0;
        span.next = 0;
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
        self.classes[c].current = i as u32 + 1;
        self.spans_live += 1;
        self.spans_peak = self.spans_peak.max(self.spans_live);
        true
    }

    /// Whether class `c` has a partial span to switch to.
    #[inline]
    pub(crate) fn has_partial(&self, c: usize) -> bool {
        self.classes[c].partial != 0
    }

    /// The span containing `ptr`, if `ptr` is in the arena and the window is a span.
    #[inline]
    fn span_of(&self, ptr: usize) -> Option<(usize, usize)> {
        let i = ptr.wrapping_sub(self.arena) >> SPAN_SHIFT;
        let span = self.spans.get(i)?;
        (span.class != 0).then(|| (i, span.class as usize - 1))
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
        if idx * size != offset {
            return Err(SmallFree::Interior {
                block: ptr - (offset - idx * size),
            });
        }
        if self.spans[i].bits[idx / 64] & (1 << (idx % 64)) == 0 {
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
    #[inline]
    #[cfg_attr(not(feature = "std"), allow(dead_code))]
    pub(crate) fn free_of_class(&mut self, ptr: usize, c: usize) -> SmallFree {
        self.free_of(ptr, Some(c))
    }

    #[inline]
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
        span.bits[idx / 64] &= !(1u64 << (idx % 64));
        span.avail |= 1 << (idx / 64);
        span.free += 1;
        let free = span.free as usize;
        self.bytes -= size;
        self.objects -= 1;
        if self.classes[c].current == i as u32 + 1 {
            return SmallFree::Freed(None);
        }
        if free == capacity(c) {
            // Empty and not current, so on the partial list (capacities exceed 1): back to the engine.
            self.unlink_partial(c, i);
            self.spans[i].class = 0;
            self.spans_live -= 1;
            return SmallFree::Freed(Some(self.arena + (i << SPAN_SHIFT)));
        }
        if free == 1 {
            self.push_partial(c, i);
        }
        SmallFree::Freed(None)
    }

    fn push_partial(&mut self, c: usize, i: usize) {
        let head = self.classes[c].partial;
        self.spans[i].prev = 0;
        self.spans[i].next = head;
        if head != 0 {
            self.spans[head as usize - 1].prev = i as u32 + 1;
        }
        self.classes[c].partial = i as u32 + 1;
    }

    fn unlink_partial(&mut self, c: usize, i: usize) {
        let (p, n) = (self.spans[i].prev, self.spans[i].next);
        if p == 0 {
            self.classes[c].partial = n;
        } else {
            self.spans[p as usize - 1].next = n;
        }
        if n != 0 {
            self.spans[n as usize - 1].prev = p;
        }
        self.spans[i].prev = 0;
        self.spans[i].next = 0;
    }

    /// Checks the span table against the counters. Spans lie below `brk` (the highest address ever
    /// handed out), so only that prefix of the table is walked.
    pub(crate) fn check(&self, brk: usize) -> Result<(), &'static str> {
        let (mut objects, mut bytes, mut spans) = (0usize, 0usize, 0usize);
        for c in 0..NUM_CLASSES {
            let mut cur = self.classes[c].partial;
            let mut prev = 0;
            let mut n = 0;
            while cur != 0 {
                let s = &self.spans[cur as usize - 1];
                if s.class as usize != c + 1 || s.prev != prev {
                    return Err("partial list holds a span of another class or has a broken link");
                }
                if s.free == 0 || s.free as usize >= capacity(c) || cur == self.classes[c].current {
                    return Err("partial list holds a full, empty or current span");
                }
                n += 1;
                if n > self.spans.len() {
                    return Err("partial list cycles");
                }
                prev = cur;
                cur = s.next;
            }
        }
        // Only the prefix of the table that can hold spans in use is walked.
        let limit = (brk.saturating_sub(self.arena) >> SPAN_SHIFT) + 1;
        for s in self.spans.iter().take(limit) {
            if s.class == 0 {
                continue;
            }
            let c = s.class as usize - 1;
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

    /// Span-table bytes that may be resident (entries up to the highest span ever used).
    pub(crate) fn metadata_bytes(&self, brk: usize) -> usize {
        ((brk.saturating_sub(self.arena) >> SPAN_SHIFT) + 1) * Self::ENTRY
    }
}

/// Objects per span of class `c`.
#[inline]
fn capacity(c: usize) -> usize {
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

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(class_for(64, 32), None);
    }

    #[test]
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
}
