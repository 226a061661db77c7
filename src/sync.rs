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
#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, Ordering};
#[cfg(all(loom, feature = "host"))]
pub(crate) use loom::sync::atomic::{AtomicPtr, AtomicUsize};

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
#[derive(Debug)]
pub(crate) struct UnsafeCell<T>(
    #[cfg(not(loom))] core::cell::UnsafeCell<T>,
    #[cfg(loom)] loom::cell::UnsafeCell<T>,
);

impl<T> UnsafeCell<T> {
    #[cfg(not(loom))]
    pub(crate) const fn new(value: T) -> Self {
        UnsafeCell(core::cell::UnsafeCell::new(value))
    }

    #[cfg(loom)]
    pub(crate) fn new(value: T) -> Self {
        UnsafeCell(loom::cell::UnsafeCell::new(value))
    }

    /// Runs `f` with a mutable raw pointer to the value.
    #[inline]
    pub(crate) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        #[cfg(not(loom))]
        return f(self.0.get());
        #[cfg(loom)]
        return self.0.with_mut(f);
    }

    /// Loom build: runs `f` with a shared raw pointer to the value (loom records a read).
    #[cfg(all(loom, feature = "host"))]
    pub(crate) fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
        self.0.with(f)
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
