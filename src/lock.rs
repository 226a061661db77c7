//! A test-and-test-and-set spinlock built on the [`sync`](crate::sync) shim.

use crate::sync::{spin_wait, AtomicBool, Ordering, UnsafeCell};

/// A spinlock that yields the thread after a short spin.
///
/// Invariant: `locked` is `true` iff a [`SpinGuard`] exists; only the guard's owner touches `value`.
pub struct SpinLock<T> {
    locked: AtomicBool,
    value: UnsafeCell<T>,
}

// SAFETY: the lock hands `&mut T` to one thread at a time (acquire on lock, release on unlock), so
// sharing the lock only requires that `T` may move between threads.
unsafe impl<T: Send> Sync for SpinLock<T> {}
// SAFETY: owning the lock owns the value.
unsafe impl<T: Send> Send for SpinLock<T> {}

/// Negative control for the loom models (loom builds only): when set, lock acquisition uses `Relaxed`
/// instead of `Acquire`, which loom must report as a data race on the protected value.
#[cfg(loom)]
#[doc(hidden)]
pub static LOOM_BREAK_ACQUIRE: crate::sync::UnmodelledAtomicBool =
    crate::sync::UnmodelledAtomicBool::new(false);

/// Ordering of a successful lock acquisition.
#[inline(always)]
fn acquire() -> Ordering {
    #[cfg(loom)]
    if LOOM_BREAK_ACQUIRE.load(crate::sync::UnmodelledOrdering::Relaxed) {
        return Ordering::Relaxed;
    }
    Ordering::Acquire
}

impl<T> SpinLock<T> {
    /// A new unlocked lock.
    #[cfg(not(loom))]
    pub const fn new(value: T) -> Self {
        SpinLock {
            locked: AtomicBool::new(false),
            value: UnsafeCell::new(value),
        }
    }

    /// A new unlocked lock (loom's atomics are not `const`).
    #[cfg(loom)]
    pub fn new(value: T) -> Self {
        SpinLock {
            locked: AtomicBool::new(false),
            value: UnsafeCell::new(value),
        }
    }

    /// Acquires the lock, spinning (then yielding) while another thread holds it.
    #[inline]
    pub fn lock(&self) -> SpinGuard<'_, T> {
        if self
            .locked
            .compare_exchange_weak(false, true, acquire(), Ordering::Relaxed)
            .is_err()
        {
            self.lock_contended();
        }
        SpinGuard { lock: self }
    }

    #[cold]
    fn lock_contended(&self) {
        let mut spins = 0;
        loop {
            while self.locked.load(Ordering::Relaxed) {
                spin_wait(&mut spins);
            }
            if self
                .locked
                .compare_exchange_weak(false, true, acquire(), Ordering::Relaxed)
                .is_ok()
            {
                return;
            }
            spin_wait(&mut spins);
        }
    }

    /// Acquires the lock if it is free.
    #[inline]
    pub fn try_lock(&self) -> Option<SpinGuard<'_, T>> {
        self.locked
            .compare_exchange(false, true, acquire(), Ordering::Relaxed)
            .ok()
            .map(|_| SpinGuard { lock: self })
    }
}

/// Exclusive access to a [`SpinLock`]'s value; unlocks on drop.
pub struct SpinGuard<'a, T> {
    lock: &'a SpinLock<T>,
}

impl<T> SpinGuard<'_, T> {
    /// Runs `f` on the protected value.
    #[inline]
    pub fn with<R>(&mut self, f: impl FnOnce(&mut T) -> R) -> R {
        // SAFETY: the guard proves exclusive access (see `SpinLock`'s invariant), and the `&mut self`
        // receiver prevents two live borrows through the same guard.
        self.lock.value.with_mut(|p| f(unsafe { &mut *p }))
    }
}

impl<T> Drop for SpinGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        self.lock.locked.store(false, Ordering::Release);
    }
}
