//! The only place that calls the operating system. Each function states what it needs.

use core::ptr::NonNull;

/// The system page size.
pub(crate) fn page_size() -> usize {
    // SAFETY: `sysconf` has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p <= 0 {
        4096
    } else {
        p as usize
    }
}

/// The process's address-space limit (`RLIMIT_AS`) in bytes, `usize::MAX` if none.
pub(crate) fn address_space_limit() -> usize {
    // Miri implements no `getrlimit`.
    #[cfg(miri)]
    return usize::MAX;
    #[cfg(not(miri))]
    {
        let mut r = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: `getrlimit` writes the limit into `r`, a valid `rlimit`.
        if unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut r) } != 0
            || r.rlim_cur == libc::RLIM_INFINITY
        {
            return usize::MAX;
        }
        usize::try_from(r.rlim_cur).unwrap_or(usize::MAX)
    }
}

/// Address space the process may still map under its `RLIMIT_AS`: the limit less what it maps now
/// (`/proc/self/statm`, read without allocating). `usize::MAX` if there is no limit.
pub(crate) fn address_space_left() -> usize {
    let limit = address_space_limit();
    if limit == usize::MAX {
        return limit;
    }
    limit.saturating_sub(address_space_used().unwrap_or(0))
}

/// Bytes the process maps now (the first field of `/proc/self/statm`, in pages).
fn address_space_used() -> Option<usize> {
    #[cfg(miri)]
    return None;
    #[cfg(not(miri))]
    {
        let mut buf = [0u8; 64];
        // SAFETY: a NUL-terminated path; the descriptor is closed below.
        let fd = unsafe {
            libc::open(
                c"/proc/self/statm".as_ptr(),
                libc::O_RDONLY | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return None;
        }
        // SAFETY: `buf` is valid for `buf.len()` bytes; `fd` is open.
        let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
        // SAFETY: `fd` is ours, closed once.
        unsafe { libc::close(fd) };
        let digits = buf.get(..usize::try_from(n).ok()?)?;
        let pages = digits
            .iter()
            .take_while(|b| b.is_ascii_digit())
            .try_fold(0usize, |v, &b| {
                v.checked_mul(10)?.checked_add((b - b'0') as usize)
            })?;
        pages.checked_mul(page_size())
    }
}

/// Asks the kernel not to back `ptr..ptr + size` with transparent huge pages (where it has them;
/// a refusal changes nothing but the resident size).
pub(crate) fn no_huge_pages(ptr: NonNull<u8>, size: usize) {
    #[cfg(all(not(miri), any(target_os = "linux", target_os = "android")))]
    // SAFETY: advice on a mapping of ours; MADV_NOHUGEPAGE changes no contents.
    unsafe {
        libc::madvise(ptr.as_ptr().cast(), size, libc::MADV_NOHUGEPAGE);
    }
    #[cfg(not(all(not(miri), any(target_os = "linux", target_os = "android"))))]
    let _ = (ptr, size);
}

/// Reserves `size` bytes of address space that cannot be accessed until [`commit`]ted
/// (`PROT_NONE`: neither the commit charge of `vm.overcommit_memory = 2` nor `RLIMIT_DATA` counts
/// it). `None` if the kernel refuses. (Under Miri, which has no `mprotect` and no other flags, it
/// is read-write and zero-filled from the start.)
pub(crate) fn reserve_uncommitted(size: usize) -> Option<NonNull<u8>> {
    let (prot, flags) = if cfg!(miri) {
        (
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
        )
    } else {
        (
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
        )
    };
    // SAFETY: an anonymous private mapping at an address of the kernel's choosing has no
    // preconditions and aliases nothing.
    let p = unsafe { libc::mmap(core::ptr::null_mut(), size, prot, flags, -1, 0) };
    if p == libc::MAP_FAILED {
        None
    } else {
        NonNull::new(p.cast())
    }
}

/// Makes `ptr..ptr + size` (page-aligned, inside a [`reserve_uncommitted`] reservation) readable
/// and writable, zero-filled where never written. Returns whether the kernel agreed (it refuses
/// past the commit limit under `vm.overcommit_memory = 2`, or past `RLIMIT_DATA`).
///
/// # Safety
/// The range is page-aligned and inside a mapping made by [`reserve_uncommitted`].
#[must_use = "the range is usable only if the commit worked"]
pub(crate) unsafe fn commit(ptr: usize, size: usize) -> bool {
    if cfg!(miri) || size == 0 {
        return true;
    }
    // SAFETY: guaranteed by the caller: the range is part of our own reservation; adding access
    // to it changes no data.
    unsafe {
        libc::mprotect(
            ptr as *mut libc::c_void,
            size,
            libc::PROT_READ | libc::PROT_WRITE,
        ) == 0
    }
}

/// Makes `ptr..ptr + size` (page-aligned, inside a [`reserve_uncommitted`] reservation)
/// readable but not writable: reads see zeros (the kernel's shared zero page) and cost no commit
/// charge; [`commit`] makes parts of it writable. Returns whether the kernel agreed.
///
/// # Safety
/// The range is page-aligned and inside a mapping made by [`reserve_uncommitted`], not yet
/// committed.
#[must_use = "the range is readable only if this worked"]
pub(crate) unsafe fn make_readable(ptr: usize, size: usize) -> bool {
    if cfg!(miri) || size == 0 {
        return true;
    }
    // SAFETY: guaranteed by the caller: the range is part of our own reservation, holding no data.
    unsafe { libc::mprotect(ptr as *mut libc::c_void, size, libc::PROT_READ) == 0 }
}

/// Makes `ptr..ptr + size` inaccessible again, as [`reserve_uncommitted`] left it: a new
/// `PROT_NONE` mapping replaces it, so its pages go back to the kernel and neither the commit
/// charge of `vm.overcommit_memory = 2` nor `RLIMIT_DATA` counts it any more (taking write access
/// away with `mprotect` would leave the commit charged). Returns whether that worked; either way
/// nothing may use the range before [`commit`] makes it usable again (zero-filled where it
/// worked; where it did not, the caller already made the pages read as zero).
///
/// The new mapping replaces the old one in one step (`MAP_FIXED`): unmapping first and mapping
/// again would leave a window in which another thread's `mmap` (a new thread's stack) takes the
/// range. When that fails the old mapping is normally as it was (the kernel checks its limits,
/// `vm.max_map_count` and `RLIMIT_AS`, first); a kernel may also have removed it and then failed
/// for want of memory for its own records (which happens when the process is being killed for
/// memory): the range is then mapped again here, where nothing else was mapped meanwhile
/// (`MAP_FIXED_NOREPLACE`; elsewhere than Linux, a hint). The one case this does not cover: another
/// thread of that dying process maps memory into the hole before this call does; the heap could
/// then commit and hand out that mapping later (jemalloc, which decommits the same way, takes the
/// same risk). (Under Miri, which has no fixed mappings, it is a [`discard`]: the range reads as
/// zero and stays accessible.)
///
/// # Safety
/// The range is page-aligned, inside a mapping made by [`reserve_uncommitted`], and holds nothing
/// anyone needs.
pub(crate) unsafe fn decommit(ptr: usize, size: usize) -> bool {
    if size == 0 {
        return true;
    }
    #[cfg(miri)]
    // SAFETY: guaranteed by the caller (under Miri the whole reservation is accessible).
    return unsafe { discard(ptr, size) };
    #[cfg(not(miri))]
    {
        let reserve = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
        #[cfg(all(test, feature = "std", not(loom)))]
        // SAFETY: the caller's range (this function's contract).
        let failed = unsafe { tests::failing_decommit(ptr, size) };
        #[cfg(not(all(test, feature = "std", not(loom))))]
        let failed = false;
        if !failed {
            // SAFETY: guaranteed by the caller: a fixed mapping over part of our reservation that
            // nothing uses, with the reservation's own flags.
            let p = unsafe {
                libc::mmap(
                    ptr as *mut libc::c_void,
                    size,
                    libc::PROT_NONE,
                    reserve | libc::MAP_FIXED,
                    -1,
                    0,
                )
            };
            if p == ptr as *mut libc::c_void {
                return true;
            }
        }
        #[cfg(any(target_os = "linux", target_os = "android"))]
        let exactly = libc::MAP_FIXED_NOREPLACE;
        #[cfg(not(any(target_os = "linux", target_os = "android")))]
        let exactly = 0;
        // SAFETY: a new anonymous mapping exactly at `ptr` where nothing is mapped (it fails over
        // the old mapping, as it should), or (a kernel that takes the flag as a hint) wherever the
        // kernel chooses, aliases nothing; one placed elsewhere is unmapped at once.
        unsafe {
            let p = libc::mmap(
                ptr as *mut libc::c_void,
                size,
                libc::PROT_NONE,
                reserve | exactly,
                -1,
                0,
            );
            if p != libc::MAP_FAILED && p != ptr as *mut libc::c_void {
                libc::munmap(p, size);
            }
        }
        false
    }
}

/// Unmaps a reservation.
///
/// # Safety
/// `ptr..ptr + size` is (part of) a mapping made by [`reserve_uncommitted`] that nothing uses any more.
pub(crate) unsafe fn unreserve(ptr: NonNull<u8>, size: usize) {
    // SAFETY: guaranteed by the caller. A failure leaves the mapping in place, which is only a leak.
    unsafe { libc::munmap(ptr.as_ptr().cast(), size) };
}

/// Returns the pages of `ptr..ptr + size` to the kernel. Returns whether it worked: only then do
/// they read as zero afterwards. The kernel refuses locked pages (`mlock`, `mlockall`), and then
/// may have returned only part of the range.
///
/// # Safety
/// The range is page-aligned, inside a mapping made by [`reserve_uncommitted`], committed (made
/// read-write by [`commit`]: elsewhere than Linux a discard maps its range afresh, read-write), and
/// holds nothing anyone needs.
#[must_use = "only a successful discard zeroes the range"]
pub(crate) unsafe fn discard(ptr: usize, size: usize) -> bool {
    if size == 0 {
        return true;
    }
    // Miri implements no `madvise`: zero the range, which is what the caller may observe.
    #[cfg(miri)]
    // SAFETY: guaranteed by the caller: the range is ours and unused.
    unsafe {
        core::ptr::write_bytes(ptr as *mut u8, 0, size);
        true
    }
    #[cfg(all(not(miri), any(target_os = "linux", target_os = "android")))]
    // SAFETY: guaranteed by the caller; MADV_DONTNEED on private anonymous memory zero-fills.
    unsafe {
        libc::madvise(ptr as *mut libc::c_void, size, libc::MADV_DONTNEED) == 0
    }
    #[cfg(all(not(miri), not(any(target_os = "linux", target_os = "android"))))]
    // SAFETY: guaranteed by the caller; a fixed anonymous mapping over our own range replaces its
    // pages with fresh zero pages.
    unsafe {
        libc::mmap(
            ptr as *mut libc::c_void,
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
            -1,
            0,
        ) != libc::MAP_FAILED
    }
}

/// Whether at least half of the `page`-sized pages of `ptr..ptr + size` look resident
/// (`mincore`); `false` if the kernel cannot tell. A range of more than [`PROBE_PAGES`] pages is
/// judged by a sample, [`PROBE_WINDOWS`] runs of pages, one in the middle of each quarter, so the
/// answer costs the same for 1 MiB as for 1 GiB; a range resident from its start (or up to its
/// end) is judged mostly resident from about 38% on (half the runs). (Asking about every page,
/// 1,024 per call, took a fifth of bench-peers `zeros`' time: 54-55 ms of task clock per run
/// against 45 ms with this sample; sixteen runs of 16 pages took 57-60 ms, the calls costing
/// more than the pages.) The answer steers a heuristic (the caller zeroes correctly either way),
/// so a pattern that dodges the sample costs only time or resident pages. Allocates nothing (a
/// 128-byte stack buffer).
///
/// # Safety
/// The range is page-aligned and inside a mapping made by [`reserve_uncommitted`].
pub(crate) unsafe fn mostly_resident(ptr: usize, size: usize, page: usize) -> bool {
    // Miri implements no `mincore`: the caller writes resident memory, the one way Miri sees.
    #[cfg(miri)]
    {
        let _ = (ptr, size, page);
        true
    }
    #[cfg(not(miri))]
    {
        let pages = size / page;
        // Runs of `run` pages, one in the middle of each of `runs` equal parts of the range (so a
        // range resident from its start and one resident up to its end are judged alike): the
        // whole range when it is small.
        let (runs, run, stride) = if pages <= PROBE_PAGES {
            (1, pages, pages)
        } else {
            (
                PROBE_WINDOWS,
                PROBE_PAGES / PROBE_WINDOWS,
                pages / PROBE_WINDOWS,
            )
        };
        let mut v = [0u8; PROBE_PAGES];
        let mut resident = 0;
        for i in 0..runs {
            let at = ptr + (i * stride + (stride - run) / 2) * page;
            // SAFETY: `run <= stride` (`pages / PROBE_WINDOWS >= PROBE_PAGES / PROBE_WINDOWS` for
            // a sampled range), so run `i` lies in part `i`, `i * stride..(i + 1) * stride`, and
            // `runs * stride <= pages`: the run lies in the caller's range, in our mapping; `v`
            // holds `run <= PROBE_PAGES` bytes, one per page.
            let rc = unsafe {
                libc::mincore(at as *mut libc::c_void, run * page, v.as_mut_ptr().cast())
            };
            if rc != 0 {
                return false;
            }
            resident += v[..run].iter().filter(|&&b| b & 1 != 0).count();
        }
        2 * resident >= runs * run
    }
}

/// The most pages [`mostly_resident`] asks the kernel about.
const PROBE_PAGES: usize = 128;

/// How many runs of pages [`mostly_resident`] samples from a range of more than [`PROBE_PAGES`].
const PROBE_WINDOWS: usize = 4;

/// Makes `ptr..ptr + size` read as zero: returns its pages to the kernel, or, where the kernel
/// refuses, writes the zeros.
///
/// # Safety
/// As for [`discard`].
pub(crate) unsafe fn discard_or_zero(ptr: usize, size: usize) {
    // SAFETY: forwarded contract; on failure the range is still ours and committed (writable).
    unsafe {
        if !discard(ptr, size) {
            core::ptr::write_bytes(ptr as *mut u8, 0, size);
        }
    }
}

/// Writes `bfc-alloc: {prefix}{args}` and a newline to standard error, cut at 512 bytes.
/// Allocates nothing.
fn write_stderr(prefix: &str, args: core::fmt::Arguments<'_>) {
    struct Buf {
        bytes: [u8; 512],
        len: usize,
    }
    impl core::fmt::Write for Buf {
        fn write_str(&mut self, s: &str) -> core::fmt::Result {
            let room = self.bytes.len() - self.len;
            let n = s.len().min(room);
            self.bytes[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
            self.len += n;
            Ok(())
        }
    }
    let mut buf = Buf {
        bytes: [0; 512],
        len: 0,
    };
    let _ = core::fmt::write(&mut buf, format_args!("bfc-alloc: {prefix}{args}\n"));
    // SAFETY: writing a valid buffer to fd 2 has no preconditions.
    unsafe { libc::write(2, buf.bytes.as_ptr().cast(), buf.len) };
}

/// Writes a warning to standard error. Allocates nothing.
pub(crate) fn warn(args: core::fmt::Arguments<'_>) {
    write_stderr("warning: ", args);
}

/// Writes `msg` to standard error and aborts the process. Allocates nothing.
pub(crate) fn fatal(args: core::fmt::Arguments<'_>) -> ! {
    write_stderr("fatal: ", format_args!("{args}; aborting"));
    // SAFETY: aborting has no preconditions.
    unsafe { libc::abort() }
}

#[cfg(all(test, feature = "std", not(loom)))]
pub(crate) mod tests {
    //! A switch that makes [`decommit`](super::decommit)'s fixed mapping fail inside one address
    //! range, the ways a kernel can.

    use core::sync::atomic::{AtomicUsize, Ordering::SeqCst};

    /// How the fixed mapping of a decommit in the armed range fails.
    #[derive(Clone, Copy, Debug, PartialEq)]
    pub(crate) enum Refusal {
        /// The old mapping stays as it was (as at `vm.max_map_count`).
        Kept,
        /// The old mapping is gone (a kernel that fails after removing it).
        Hole,
    }

    static ARMED: [AtomicUsize; 3] = [const { AtomicUsize::new(0) }; 3];

    /// Makes the next decommit inside `lo..hi` fail as `how` (once).
    pub(crate) fn arm(lo: usize, hi: usize, how: Refusal) {
        ARMED[0].store(lo, SeqCst);
        ARMED[1].store(hi, SeqCst);
        ARMED[2].store(how as usize + 1, SeqCst);
    }

    /// Whether the fixed mapping over `ptr..ptr + size` is to fail (having done what the armed
    /// refusal leaves: for [`Refusal::Hole`], the range unmapped).
    ///
    /// # Safety
    /// As for [`decommit`](super::decommit): the range is page-aligned, part of our reservation,
    /// and holds nothing anyone needs.
    pub(super) unsafe fn failing_decommit(ptr: usize, size: usize) -> bool {
        let (lo, hi) = (ARMED[0].load(SeqCst), ARMED[1].load(SeqCst));
        if !(lo <= ptr && ptr + size <= hi) {
            return false;
        }
        match ARMED[2].swap(0, SeqCst) {
            0 => false,
            1 => true,
            _ => {
                // SAFETY: the caller's range, ours and unused (the contract above).
                assert_eq!(unsafe { libc::munmap(ptr as *mut libc::c_void, size) }, 0);
                true
            }
        }
    }
}

#[cfg(all(test, not(miri), not(loom)))]
mod probe_tests {
    use super::*;

    /// A committed, untouched mapping of `pages` pages; unmapped on drop.
    struct Pages(usize, usize);

    impl Pages {
        fn new(pages: usize) -> Self {
            let size = pages * page_size();
            let r = reserve_uncommitted(size).expect("reserve");
            // A touch must fault in one page, not a huge one (transparent huge pages `always`).
            no_huge_pages(r, size);
            let p = r.as_ptr() as usize;
            // SAFETY: the range is the reservation just made.
            assert!(unsafe { commit(p, size) });
            Pages(p, pages)
        }

        fn touch(&self, page: usize) {
            // SAFETY: `page` lies in the committed mapping.
            unsafe { *((self.0 + page * page_size()) as *mut u8) = 1 };
        }

        fn mostly_resident(&self) -> bool {
            // SAFETY: the whole mapping, page-aligned.
            unsafe { mostly_resident(self.0, self.1 * page_size(), page_size()) }
        }
    }

    impl Drop for Pages {
        fn drop(&mut self) {
            // SAFETY: our own mapping, no longer used.
            unsafe { libc::munmap(self.0 as *mut libc::c_void, self.1 * page_size()) };
        }
    }

    #[test]
    fn a_range_is_mostly_resident_when_at_least_half_its_pages_are() {
        for (pages, touched, expected) in [
            (100, 0, false),
            (100, 49, false),
            (100, 50, true),
            (100, 100, true),
            (4096, 0, false),
            (4096, 4096, true),
            // Large ranges are judged by a sample: the runs asked about are spread over the whole
            // range, the same way from either end.
            (4096, 1024, false),
            (4096, 1500, false),
            (4096, 2600, true),
            (4096, 3072, true),
            (4099, 1025, false),
            (4099, 3075, true),
        ] {
            for (which, range) in [("first", 0..touched), ("last", pages - touched..pages)] {
                let m = Pages::new(pages);
                range.for_each(|i| m.touch(i));
                let got = m.mostly_resident();
                assert_eq!(got, expected, "the {which} {touched} of {pages} pages");
            }
        }
    }

    #[test]
    fn a_sparsely_written_range_is_not_mostly_resident_and_a_discarded_one_neither() {
        let m = Pages::new(4096);
        (0..4096).step_by(64).for_each(|i| m.touch(i));
        assert!(!m.mostly_resident());
        (0..4096).for_each(|i| m.touch(i));
        assert!(m.mostly_resident());
        // SAFETY: the whole mapping, committed, holding nothing needed.
        assert!(unsafe { discard(m.0, 4096 * page_size()) });
        assert!(!m.mostly_resident());
    }
}
