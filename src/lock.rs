//! A test-and-test-and-set spinlock built on the crate's sync shim (`src/sync.rs`).

use core::marker::PhantomData;

use crate::sync::{spin_wait, AtomicBool, Ordering, UnsafeCell};

/// A spinlock that yields the thread after a short spin.
///
/// Invariant: `locked` is `true` iff a [`SpinGuard`] exists; only the guard's owner touches `value`.
pub struct SpinLock<T> {
    locked: AtomicBool,
    value: UnsafeCell<T>,
    /// Re-entry detection (with `std` or the host allocator's `libc`, not under loom): an id of the
    /// holding thread, and what to call
    /// when a thread waits for a lock it holds itself (a deadlock, e.g. an allocation made while the
    /// allocator's lock is held by a panic inside it).
    #[cfg(all(any(feature = "std", all(feature = "host", unix)), not(loom)))]
    owner: crate::sync::AtomicUsize,
    #[cfg(all(any(feature = "std", all(feature = "host", unix)), not(loom)))]
    on_reentry: Option<fn() -> !>,
    /// Unit tests: how many times a waiter ran the re-entry check.
    #[cfg(all(test, any(feature = "std", all(feature = "host", unix)), not(loom)))]
    reentry_checks: crate::sync::AtomicUsize,
    /// Loom build: the holder's [`loom_thread_token`] (0 when free), so that the models can check
    /// who holds the lock at a `fork`.
    #[cfg(loom)]
    holder: crate::sync::UnmodelledAtomicUsize,
}

/// Loom build: a non-zero token of the current loom thread (loom threads share one OS thread, so
/// the std id cannot tell them apart).
#[cfg(loom)]
fn loom_thread_token() -> usize {
    use core::hash::{Hash, Hasher};
    /// FNV-1a (no `std` needed: loom builds of the core alone have none).
    struct Fnv(u64);
    impl Hasher for Fnv {
        fn finish(&self) -> u64 {
            self.0
        }
        fn write(&mut self, bytes: &[u8]) {
            for &b in bytes {
                self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
    }
    let mut h = Fnv(0xcbf2_9ce4_8422_2325);
    loom::thread::current().id().hash(&mut h);
    h.finish() as usize | 1
}

/// An id of the current thread: the address of a thread-local (no allocation, no registration).
#[cfg(all(feature = "std", not(loom)))]
#[inline(always)]
pub(crate) fn thread_id() -> usize {
    std::thread_local! {
        static ID: u8 = const { 0 };
    }
    ID.with(|id| id as *const u8 as usize)
}

/// An id of the current thread (the host allocator without `std`): its `pthread_t`, never 0.
#[cfg(all(not(feature = "std"), feature = "host", unix, not(loom)))]
#[inline(always)]
fn thread_id() -> usize {
    // SAFETY: `pthread_self` has no preconditions and cannot fail.
    unsafe { libc::pthread_self() as usize }
}

/// Spins after which a waiter checks whether it holds the lock itself.
#[cfg(all(any(feature = "std", all(feature = "host", unix)), not(loom)))]
const REENTRY_CHECK_SPINS: u32 = 1 << 12;

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
        Self::build(value, None)
    }

    /// A new unlocked lock that calls `on_reentry` (which must not return, e.g. print and abort)
    /// when a thread waits for the lock while holding it, instead of spinning forever. Detection
    /// needs `std` or feature `host` (on Unix); elsewhere this is [`new`](Self::new).
    #[cfg(not(loom))]
    pub const fn with_reentry_handler(value: T, on_reentry: fn() -> !) -> Self {
        Self::build(value, Some(on_reentry))
    }

    #[cfg(not(loom))]
    const fn build(value: T, on_reentry: Option<fn() -> !>) -> Self {
        let _ = on_reentry;
        SpinLock {
            locked: AtomicBool::new(false),
            value: UnsafeCell::new(value),
            #[cfg(any(feature = "std", all(feature = "host", unix)))]
            owner: crate::sync::AtomicUsize::new(0),
            #[cfg(any(feature = "std", all(feature = "host", unix)))]
            on_reentry,
            #[cfg(all(test, any(feature = "std", all(feature = "host", unix))))]
            reentry_checks: crate::sync::AtomicUsize::new(0),
        }
    }

    /// Writes a new unlocked lock to `dst`, as [`with_reentry_handler`](Self::with_reentry_handler)
    /// builds it, with its value written in place by `init`: for a value too large to build on
    /// the stack first. When `init` fails, the lock is not written.
    ///
    /// # Safety
    ///
    /// `dst` is valid for writes of `Self` and aligned; whatever it held is overwritten, not
    /// dropped. `init` gets a pointer valid for writes of `T`: it must initialise it when it
    /// returns `Ok`, and leave nothing there that needs dropping when it returns `Err`.
    #[cfg_attr(
        not(all(feature = "host", unix)),
        allow(dead_code, reason = "the host heap builds its lock in place")
    )]
    pub(crate) unsafe fn write_with<E>(
        dst: *mut Self,
        on_reentry: fn() -> !,
        init: impl FnOnce(*mut T) -> Result<(), E>,
    ) -> Result<(), E> {
        use core::ptr::addr_of_mut;
        let _ = on_reentry;
        // SAFETY: `dst` is valid for writes and aligned (the caller's contract), so is each field;
        // the cell writes the value through `init` (whose contract is the caller's), then each
        // other field is written once, with the value `build` gives it.
        unsafe {
            UnsafeCell::write_with(addr_of_mut!((*dst).value), init)?;
            addr_of_mut!((*dst).locked).write(AtomicBool::new(false));
            #[cfg(all(any(feature = "std", all(feature = "host", unix)), not(loom)))]
            {
                addr_of_mut!((*dst).owner).write(crate::sync::AtomicUsize::new(0));
                addr_of_mut!((*dst).on_reentry).write(Some(on_reentry));
            }
            #[cfg(all(test, any(feature = "std", all(feature = "host", unix)), not(loom)))]
            addr_of_mut!((*dst).reentry_checks).write(crate::sync::AtomicUsize::new(0));
            #[cfg(loom)]
            addr_of_mut!((*dst).holder).write(crate::sync::UnmodelledAtomicUsize::new(0));
        }
        // Every field is written above: this pattern names them all, so a new field fails to
        // compile here until it is written too.
        let _every_field = |l: &Self| {
            let SpinLock {
                locked: _,
                value: _,
                #[cfg(all(any(feature = "std", all(feature = "host", unix)), not(loom)))]
                    owner: _,
                #[cfg(all(any(feature = "std", all(feature = "host", unix)), not(loom)))]
                    on_reentry: _,
                #[cfg(all(test, any(feature = "std", all(feature = "host", unix)), not(loom)))]
                    reentry_checks: _,
                #[cfg(loom)]
                    holder: _,
            } = l;
        };
        Ok(())
    }

    /// Loom build: as [`new`](Self::new) (loom threads share one OS thread, so no detection).
    #[cfg(loom)]
    pub fn with_reentry_handler(value: T, _on_reentry: fn() -> !) -> Self {
        Self::new(value)
    }

    /// A new unlocked lock (loom's atomics are not `const`).
    #[cfg(loom)]
    pub fn new(value: T) -> Self {
        SpinLock {
            locked: AtomicBool::new(false),
            value: UnsafeCell::new(value),
            holder: crate::sync::UnmodelledAtomicUsize::new(0),
        }
    }

    /// Loom build: whether the calling thread holds the lock (taken and not yet released by it,
    /// with or without a guard).
    #[cfg(loom)]
    #[doc(hidden)]
    pub fn loom_held_by_me(&self) -> bool {
        self.locked.load(Ordering::Relaxed)
            && self.holder.load(crate::sync::UnmodelledOrdering::Relaxed) == loom_thread_token()
    }

    /// Acquires the lock, spinning (then yielding) while another thread holds it.
    #[inline]
    pub fn lock(&self) -> SpinGuard<'_, T> {
        self.lock_reporting().0
    }

    /// As [`lock`](Self::lock), and whether the first attempt failed: another thread held the
    /// lock. (A strong compare-and-swap, so a spurious failure on machines with load-linked /
    /// store-conditional pairs is never reported as contention; on x86-64 the two are the same
    /// instruction.)
    #[inline]
    pub fn lock_reporting(&self) -> (SpinGuard<'_, T>, bool) {
        let contended = self
            .locked
            .compare_exchange(false, true, acquire(), Ordering::Relaxed)
            .is_err();
        if contended {
            self.lock_contended();
        }
        (self.held(), contended)
    }

    /// The guard of a lock just taken, with the owner recorded for the re-entry check.
    #[inline]
    fn held(&self) -> SpinGuard<'_, T> {
        #[cfg(all(any(feature = "std", all(feature = "host", unix)), not(loom)))]
        if self.on_reentry.is_some() {
            self.owner.store(thread_id(), Ordering::Relaxed);
        }
        #[cfg(loom)]
        self.holder.store(
            loom_thread_token(),
            crate::sync::UnmodelledOrdering::Relaxed,
        );
        SpinGuard::new(self)
    }

    #[cold]
    fn lock_contended(&self) {
        let mut spins = 0;
        #[cfg(all(any(feature = "std", all(feature = "host", unix)), not(loom)))]
        let mut waited = 0u32;
        loop {
            while self.locked.load(Ordering::Relaxed) {
                spin_wait(&mut spins);
                #[cfg(all(any(feature = "std", all(feature = "host", unix)), not(loom)))]
                {
                    waited = waited.wrapping_add(1);
                    if waited % REENTRY_CHECK_SPINS == 0 {
                        #[cfg(test)]
                        self.reentry_checks.fetch_add(1, Ordering::Relaxed);
                        if let Some(handler) = self.on_reentry {
                            // Only this thread writes its own id, so seeing it means it holds the lock.
                            if self.owner.load(Ordering::Relaxed) == thread_id() {
                                handler();
                            }
                        }
                    }
                }
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

    /// Acquires the lock and keeps it with no guard: a `fork` prepare handler holds the heap locks
    /// across the `fork` this way. Release it with [`SpinLock::unlock_held`].
    #[cfg(feature = "host")]
    pub(crate) fn lock_held(&self) {
        core::mem::forget(self.lock());
    }

    /// Releases a lock taken with [`SpinLock::lock_held`].
    ///
    /// # Safety
    /// The calling thread (or, in a `fork` child, the thread that forked) took the lock with
    /// [`SpinLock::lock_held`] and has not released it since.
    #[cfg(feature = "host")]
    pub(crate) unsafe fn unlock_held(&self) {
        drop(SpinGuard::new(self));
    }

    /// Loom build: runs `f` on the value *without* the lock, as a `fork` child reads the copy of
    /// the value it inherited. Loom executes one thread at a time and reports a read that races a
    /// write (one not ordered by the lock) as a causality violation, so the models can check that
    /// whoever reads this way holds the lock through some other path.
    #[cfg(all(loom, feature = "host"))]
    pub(crate) fn loom_peek<R>(&self, f: impl FnOnce(&T) -> R) -> R {
        // SAFETY: loom runs the model's threads one at a time, so no access overlaps this one in
        // fact; an unsynchronised one is reported (panic) before `f` runs.
        self.value.with(|p| f(unsafe { &*p }))
    }

    /// Unit tests: how many times a waiter ran the re-entry check (a waiter spun this long).
    #[cfg(all(test, feature = "std", not(loom)))]
    pub(crate) fn reentry_checks(&self) -> usize {
        self.reentry_checks.load(Ordering::Relaxed)
    }

    /// Acquires the lock if it is free.
    #[inline]
    pub fn try_lock(&self) -> Option<SpinGuard<'_, T>> {
        self.locked
            .compare_exchange(false, true, acquire(), Ordering::Relaxed)
            .ok()
            .map(|_| self.held())
    }
}

/// Exclusive access to a [`SpinLock`]'s value; unlocks on drop.
///
/// Not `Send`: it unlocks on the thread that locked, which the re-entry check relies on (a guard
/// moved to another thread would make the locking thread look like the holder).
pub struct SpinGuard<'a, T> {
    lock: &'a SpinLock<T>,
    _not_send: PhantomData<*const ()>,
}

static_assertions::assert_not_impl_any!(SpinGuard<'static, u32>: Send);

impl<'a, T> SpinGuard<'a, T> {
    /// The guard of `lock`, which the calling thread has just taken.
    #[inline]
    fn new(lock: &'a SpinLock<T>) -> Self {
        SpinGuard {
            lock,
            _not_send: PhantomData,
        }
    }

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
        #[cfg(all(any(feature = "std", all(feature = "host", unix)), not(loom)))]
        if self.lock.on_reentry.is_some() {
            self.lock.owner.store(0, Ordering::Relaxed);
        }
        #[cfg(loom)]
        self.lock
            .holder
            .store(0, crate::sync::UnmodelledOrdering::Relaxed);
        self.lock.locked.store(false, Ordering::Release);
    }
}

/// With `std`, and without it in the host allocator's build (`--no-default-features --features
/// host`), where the thread id is the `pthread_t`.
#[cfg(all(test, any(feature = "std", all(feature = "host", unix)), not(loom)))]
mod tests {
    extern crate std;

    use super::*;

    fn reentered() -> ! {
        panic!("lock re-entered by its holder")
    }

    /// Runs `f` on a thread of its own and re-raises its panic, if any; panics if `f` has not
    /// returned in time. (A holder whose re-entry goes undetected spins for good: the test then
    /// fails instead of hanging the suite.)
    fn unless_stuck(f: fn()) {
        let limit = std::time::Duration::from_secs(if cfg!(miri) { 1200 } else { 60 });
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(std::panic::catch_unwind(f));
        });
        match rx.recv_timeout(limit) {
            Ok(Ok(())) => {}
            Ok(Err(payload)) => std::panic::resume_unwind(payload),
            Err(_) => panic!("still waiting after {limit:?}: a re-entered lock was not detected"),
        }
    }

    #[test]
    #[should_panic(expected = "lock re-entered by its holder")]
    fn waiting_for_a_lock_you_hold_calls_the_handler() {
        unless_stuck(|| {
            static L: SpinLock<u32> = SpinLock::with_reentry_handler(0, reentered);
            let _held = L.lock();
            let _again = L.lock();
        });
    }

    #[test]
    #[should_panic(expected = "lock re-entered by its holder")]
    fn waiting_for_a_lock_taken_with_try_lock_calls_the_handler() {
        unless_stuck(|| {
            static L: SpinLock<u32> = SpinLock::with_reentry_handler(0, reentered);
            let _held = L.try_lock().expect("a free lock");
            assert_eq!(
                L.owner.load(Ordering::Relaxed),
                thread_id(),
                "owner not recorded"
            );
            assert!(L.try_lock().is_none());
            let _again = L.lock();
        });
    }

    #[test]
    fn other_threads_wait_instead_of_tripping_the_handler() {
        static L: SpinLock<u64> = SpinLock::with_reentry_handler(0, reentered);
        // One thread holds the lock until another has waited long enough to run the re-entry
        // check: that waiter is not the holder, so the handler must not run (it would panic).
        let held = L.lock();
        let waiter = std::thread::spawn(|| L.lock().with(|v| *v += 1));
        while L.reentry_checks.load(Ordering::Relaxed) == 0 {
            std::thread::yield_now();
        }
        drop(held);
        waiter
            .join()
            .expect("the waiter tripped the re-entry handler");
        // And under contention.
        // (Fewer rounds under Miri, which runs each spin wait step by step.)
        let rounds = if cfg!(miri) { 300 } else { 20_000 };
        let threads: std::vec::Vec<_> = (0..4)
            .map(|_| {
                std::thread::spawn(move || {
                    for _ in 0..rounds {
                        L.lock().with(|v| *v += 1);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(L.lock().with(|v| *v), 1 + 4 * rounds);
    }

    #[test]
    fn unlocking_clears_the_owner() {
        let l = SpinLock::with_reentry_handler(0u32, reentered);
        drop(l.lock());
        assert_eq!(l.owner.load(Ordering::Relaxed), 0);
    }
}
