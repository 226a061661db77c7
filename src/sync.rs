//! The one place that names atomics, `UnsafeCell` and spin hints.
//!
//! Normally these are `core`'s types; under `--cfg loom` they are loom's, so the lock that loom
//! model-checks is the lock that ships.

#[cfg(all(not(loom), feature = "host"))]
pub(crate) use core::sync::atomic::AtomicPtr;
#[cfg(all(not(loom), any(feature = "std", all(feature = "host", unix))))]
pub(crate) use core::sync::atomic::AtomicUsize;
#[cfg(not(loom))]
pub(crate) use core::sync::atomic::{AtomicBool, Ordering};
#[cfg(all(loom, feature = "host"))]
pub(crate) use loom::sync::atomic::AtomicPtr;
#[cfg(all(loom, any(feature = "host", feature = "cuda")))]
pub(crate) use loom::sync::atomic::AtomicUsize;
#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, Ordering};

#[cfg(all(feature = "cuda", loom))]
pub(crate) use loom::sync::Arc;
/// The device pool's reference count: std's, or loom's under `--cfg loom`.
#[cfg(all(feature = "cuda", not(loom)))]
pub(crate) use std::sync::Arc;

#[cfg(loom)]
#[allow(unused_imports)]
pub(crate) use loom::sync::{Mutex, MutexGuard};
/// Blocking mutex for the device pool's shared state: std's, or loom's under `--cfg loom`.
#[cfg(all(feature = "std", not(loom)))]
#[allow(unused_imports)]
pub(crate) use std::sync::{Mutex, MutexGuard};

/// Plain atomics that loom does not model, for loom-build instrumentation only (the negative-control
/// switch and the initialisation counter).
#[cfg(loom)]
pub(crate) use core::sync::atomic::{
    AtomicBool as UnmodelledAtomicBool, AtomicUsize as UnmodelledAtomicUsize,
    Ordering as UnmodelledOrdering,
};

/// `UnsafeCell` with loom's closure-based access API on both builds.
///
/// The value is in a plain `UnsafeCell` on both builds, so that it can be written in place
/// ([`UnsafeCell::write_with`]); loom builds add a cell of `()` through which every access goes,
/// so that loom still checks each access for a race.
#[derive(Debug)]
pub(crate) struct UnsafeCell<T> {
    value: core::cell::UnsafeCell<T>,
    #[cfg(loom)]
    track: loom::cell::UnsafeCell<()>,
}

impl<T> UnsafeCell<T> {
    #[cfg(not(loom))]
    pub(crate) const fn new(value: T) -> Self {
        UnsafeCell {
            value: core::cell::UnsafeCell::new(value),
        }
    }

    #[cfg(loom)]
    pub(crate) fn new(value: T) -> Self {
        UnsafeCell {
            value: core::cell::UnsafeCell::new(value),
            track: loom::cell::UnsafeCell::new(()),
        }
    }

    /// Writes a new cell to `this`, with its value written in place by `init` (for a value too
    /// large to build on the stack first). When `init` fails, the cell is not written.
    ///
    /// # Safety
    ///
    /// `this` is valid for writes of `Self` and aligned; whatever it held is overwritten, not
    /// dropped. `init` gets a pointer valid for writes of `T`: it must initialise it when it
    /// returns `Ok`, and leave nothing there that needs dropping when it returns `Err`.
    #[cfg_attr(
        not(all(feature = "host", unix)),
        allow(dead_code, reason = "the host heap builds its lock in place")
    )]
    pub(crate) unsafe fn write_with<E>(
        this: *mut Self,
        init: impl FnOnce(*mut T) -> Result<(), E>,
    ) -> Result<(), E> {
        // SAFETY: by the contract, `this` is valid for writes, so are its fields; no reference to
        // the uninitialised value is made.
        unsafe {
            init(core::cell::UnsafeCell::raw_get(core::ptr::addr_of!(
                (*this).value
            )))?;
            #[cfg(loom)]
            core::ptr::addr_of_mut!((*this).track).write(loom::cell::UnsafeCell::new(()));
        }
        Ok(())
    }

    /// Runs `f` with a mutable raw pointer to the value.
    #[inline]
    pub(crate) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        #[cfg(not(loom))]
        return f(self.value.get());
        #[cfg(loom)]
        return self.track.with_mut(|_| f(self.value.get()));
    }

    /// Loom build: runs `f` with a shared raw pointer to the value (loom records a read).
    #[cfg(all(loom, feature = "host"))]
    pub(crate) fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
        self.track.with(|_| f(self.value.get()))
    }
}

/// Backs off inside a spin loop; `spins` counts the caller's failed attempts.
///
/// Spins with the CPU hint for the first attempts, then yields the thread (with `std`, or with
/// `libc` for the host allocator; a bare-metal build keeps spinning), so a waiter
/// does not burn the core its lock holder was descheduled from. Under loom every call yields, as loom
/// requires.
#[inline]
pub(crate) fn spin_wait(spins: &mut u32) {
    #[cfg(loom)]
    {
        let _ = spins;
        loom::thread::yield_now();
    }
    #[cfg(not(loom))]
    {
        // Exponential backoff: 1, 2, 4, .. 64 pause instructions per attempt, then yield. About a
        // thousand pauses pass before the first yield, enough for a holder that is running to finish
        // a heap operation, so a waiter does not give up its time slice while the lock is about to
        // be released (with two threads on two cores, yielding early starves the waiter).
        const BACKOFF_STEPS: u32 = 20;
        if *spins < BACKOFF_STEPS {
            for _ in 0..1u32 << (*spins).min(6) {
                core::hint::spin_loop();
            }
            *spins += 1;
        } else {
            #[cfg(feature = "std")]
            std::thread::yield_now();
            // The host allocator without `std` still has the OS scheduler.
            #[cfg(all(not(feature = "std"), feature = "host", unix))]
            // SAFETY: `sched_yield` has no preconditions (it cannot fail on Linux).
            unsafe {
                libc::sched_yield();
            }
            #[cfg(not(any(feature = "std", all(feature = "host", unix))))]
            core::hint::spin_loop();
        }
    }
}

/// Defines a function that is `const` except under loom, whose atomics cannot be built in a `const`
/// context: one body for both builds.
#[allow(unused_macros)]
macro_rules! const_unless_loom {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty $body:block) => {
        #[cfg(not(loom))]
        $(#[$m])*
        $vis const fn $name($($arg: $ty),*) -> $ret $body

        #[cfg(loom)]
        $(#[$m])*
        $vis fn $name($($arg: $ty),*) -> $ret $body
    };
}
#[allow(unused_imports)]
pub(crate) use const_unless_loom;
