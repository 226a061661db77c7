//! The process-wide locks (the list of live heaps, the bindings lock) and the `fork` handlers that
//! hold every allocator lock across a `fork`.

#[cfg(loom)]
use super::loom_state_held;
#[cfg(all(feature = "std", not(loom)))]
use super::tcache::{self, ThreadCache};
use super::{reentered, Anchor};
use crate::lock::SpinLock;

/// Fork generation: incremented in every fork child by an atfork handler (installed when the
/// program is loaded on Linux, elsewhere by the first heap's initialisation). A heap that sees a
/// new generation rebuilds its cache registry (see `Heap::after_fork`).
#[cfg(all(feature = "std", not(loom)))]
static FORK_GEN: core::sync::atomic::AtomicUsize = core::sync::atomic::AtomicUsize::new(0);
/// The forking thread's cache (its address and owner id), recorded in the child: the one cache that
/// survives a fork.
#[cfg(all(feature = "std", not(loom)))]
pub(super) static FORK_SURVIVOR: [core::sync::atomic::AtomicUsize; 2] = [
    core::sync::atomic::AtomicUsize::new(0),
    core::sync::atomic::AtomicUsize::new(0),
];

/// Every live heap's anchor, linked through `Anchor::next`, so that a `fork` can hold every heap
/// lock across it. `head` (an anchor's address, 0 for none) and the links change only under `lock`.
pub(super) struct HeapList {
    pub(super) lock: SpinLock<()>,
    head: core::sync::atomic::AtomicUsize,
}

#[cfg(not(loom))]
pub(super) fn heaps() -> &'static HeapList {
    static HEAPS: HeapList = HeapList {
        lock: SpinLock::with_reentry_handler((), reentered),
        head: core::sync::atomic::AtomicUsize::new(0),
    };
    &HEAPS
}

/// Loom build: one list per model execution.
#[cfg(loom)]
pub(super) fn heaps() -> &'static HeapList {
    loom::lazy_static! {
        static ref HEAPS: HeapList = HeapList {
            lock: SpinLock::with_reentry_handler((), reentered),
            head: core::sync::atomic::AtomicUsize::new(0),
        };
    }
    &HEAPS
}

/// Calls `f` on every heap on the list. The caller holds the list's lock (or is a `fork` handler,
/// whose prepare step took it).
fn for_each_heap(mut f: impl FnMut(&Anchor)) {
    use core::sync::atomic::Ordering::Relaxed;
    let mut a = heaps().head.load(Relaxed);
    while a != 0 {
        // SAFETY: anchors leave the list (under its lock, held by the caller) before they are
        // unmapped.
        let anchor = unsafe { &*(a as *const Anchor) };
        f(anchor);
        a = anchor.next.load(Relaxed);
    }
}

/// The `fork` prepare step: takes the bindings lock, the heap list's lock and every heap lock, in
/// the order the rest of the crate takes them, so that the child inherits no lock held by a thread
/// it does not have. (An allocation that needs a heap lock, made on this thread by a prepare
/// handler that runs after this one, aborts with the re-entry message instead of hanging.)
fn fork_prepare() {
    #[cfg(all(feature = "std", loom))]
    let inverted = LOOM_BREAK_FORK_ORDER.load(crate::sync::UnmodelledOrdering::Relaxed);
    #[cfg(all(feature = "std", not(loom)))]
    let inverted = false;
    #[cfg(feature = "std")]
    if !inverted && !loom_try_fork_bindings() {
        bindings().lock_held();
    }
    #[cfg(all(feature = "std", loom))]
    if loom_try_fork_bindings() {
        // The negative control: the bindings lock only if it is free.
        if let Some(g) = bindings().try_lock() {
            core::mem::forget(g);
        }
    }
    heaps().lock.lock_held();
    for_each_heap(|a| a.heap.lock_held());
    #[cfg(feature = "std")]
    if inverted {
        bindings().lock_held();
    }
}

/// Releases what [`fork_prepare`] took, in the parent and in the child.
///
/// # Safety
///
/// [`fork_prepare`] ran on this thread (in the child: on the thread that forked, which is this one)
/// and nothing released its locks since.
unsafe fn fork_release() {
    // SAFETY: by the contract, this thread holds each of these locks.
    unsafe {
        for_each_heap(|a| a.heap.unlock_held());
        heaps().lock.unlock_held();
        #[cfg(feature = "std")]
        if !loom_try_fork_bindings() || loom_bindings_held_by_me() {
            bindings().unlock_held();
        }
    }
}

/// Negative control for the fork model (loom builds only): when set, the prepare step takes the
/// bindings lock last instead of first, inverting the order a thread-exit flush takes it in.
#[cfg(all(feature = "std", loom))]
#[doc(hidden)]
pub static LOOM_BREAK_FORK_ORDER: crate::sync::UnmodelledAtomicBool =
    crate::sync::UnmodelledAtomicBool::new(false);

/// Negative control for the fork models (loom builds only): when set, the prepare step takes the
/// bindings lock only if it is free, and goes ahead without it while another thread (an exit
/// flush, a drop) holds it: a fork child would inherit it held.
#[cfg(all(feature = "std", loom))]
#[doc(hidden)]
pub static LOOM_TRY_FORK_BINDINGS: crate::sync::UnmodelledAtomicBool =
    crate::sync::UnmodelledAtomicBool::new(false);

#[cfg(feature = "std")]
#[inline(always)]
fn loom_try_fork_bindings() -> bool {
    #[cfg(loom)]
    return LOOM_TRY_FORK_BINDINGS.load(crate::sync::UnmodelledOrdering::Relaxed);
    #[cfg(not(loom))]
    return false;
}

/// Whether this thread holds the bindings lock (loom builds; elsewhere unused).
#[cfg(feature = "std")]
#[inline(always)]
fn loom_bindings_held_by_me() -> bool {
    #[cfg(loom)]
    return bindings().loom_held_by_me();
    #[cfg(not(loom))]
    return true;
}

/// Loom build: at a `fork`, the forking thread must hold every allocator lock (the bindings lock,
/// the heap list's lock and every heap lock), so that the child inherits none held by a thread it
/// does not have, and the release steps unlock only what this thread took. Notes the first lock
/// found otherwise; [`loom_check_forks`] reports it. (Not a panic at the fork itself: a panic while
/// loom still holds a thread that has not started aborts the process instead of failing the model.)
#[cfg(loom)]
pub(super) fn loom_note_fork_locks() {
    let missing = loom_first_lock_not_held();
    if missing != 0 {
        let _ = loom_fork_lock_missing().compare_exchange(
            0,
            missing,
            crate::sync::UnmodelledOrdering::Relaxed,
            crate::sync::UnmodelledOrdering::Relaxed,
        );
    }
}

/// Loom build: the first allocator lock the calling thread does not hold, numbered as
/// [`loom_check_forks`] names them (0: it holds them all).
#[cfg(loom)]
fn loom_first_lock_not_held() -> usize {
    #[cfg(feature = "std")]
    if !bindings().loom_held_by_me() {
        return 1;
    }
    if !heaps().lock.loom_held_by_me() {
        return 2;
    }
    let mut heaps_held = true;
    for_each_heap(|a| heaps_held &= a.heap.loom_held_by_me());
    if heaps_held {
        0
    } else {
        3
    }
}

/// Loom build: the first lock a fork of this model execution went ahead without (0: none).
#[cfg(loom)]
fn loom_fork_lock_missing() -> &'static crate::sync::UnmodelledAtomicUsize {
    loom::lazy_static! {
        static ref MISSING: crate::sync::UnmodelledAtomicUsize =
            crate::sync::UnmodelledAtomicUsize::new(0);
    }
    &MISSING
}

/// Loom build: panics if a fork of this model execution went ahead without holding one of the
/// allocator's locks. Models call it at their end, on the main thread.
#[cfg(loom)]
#[doc(hidden)]
pub fn loom_check_forks() {
    let what = match loom_fork_lock_missing().load(crate::sync::UnmodelledOrdering::Relaxed) {
        0 => return,
        1 => "the bindings lock",
        2 => "the heap list's lock",
        _ => "a heap lock",
    };
    panic!("fork without holding {what}");
}

/// Loom build: the `fork` prepare step, as the forking thread runs it (the models cannot fork).
#[cfg(loom)]
#[doc(hidden)]
pub fn loom_fork_prepare() {
    fork_prepare();
    loom_note_fork_locks();
    // Loom runs one thread at a time, so the count is exact at this point of the schedule.
    assert!(
        loom_state_held().load(crate::sync::UnmodelledOrdering::Relaxed) == 0,
        "fork while another thread initialises an allocator (its child would inherit a held state \
         lock)"
    );
}

/// Loom build: the release step that follows the `fork` in the parent.
///
/// # Safety
///
/// [`loom_fork_prepare`] ran on this thread and this is the first release since.
#[cfg(loom)]
#[doc(hidden)]
pub unsafe fn loom_fork_release() {
    // SAFETY: the caller's contract is `fork_release`'s.
    unsafe { fork_release() };
}

/// The thread whose `fork` holds the locks (its `pthread_self`, 0 for none).
///
/// Two things rule out a plain "held" flag. glibc runs a fork's prepare (and parent, and child)
/// handlers with its own atfork lock released, so two threads' forks can interleave their handlers:
/// with a shared flag, the second fork would skip the prepare step, then release in its parent
/// handler the locks the first fork still relies on, and the first fork's child could inherit a heap
/// lock held by a thread it does not have (and hang). And one thread may run the prepare handler
/// again before the parent or child handler of the first call: when the handlers are registered
/// twice (a child forked while `pthread_once` ran the registration reruns it), or when a `fork`
/// nests inside this thread's fork (another library's prepare handler, or a signal handler, forks).
///
/// So the first prepare call of a thread takes the locks (waiting while another thread's fork holds
/// them) and sets the owner; further prepare calls on the owner's thread count up its depth;
/// each parent or child call on the owner's thread counts down, and the one that reaches zero clears
/// the owner and releases the locks. glibc runs one parent or child call per prepare call, so the
/// locks stay held until the outermost fork has happened. Only the holder writes the owner and the
/// depth, so a thread that reads its own id holds the locks. (Loom model 8 checks two interleaved
/// forks, with the handlers run once, registered twice, or nested.)
pub(super) struct ForkOwner {
    /// The owner's `pthread_self` (0 for none).
    pub(super) thread: ForkAtomic,
    /// Prepare calls of the owner's fork not yet matched by a parent or child call (only the owner
    /// touches it).
    pub(super) depth: ForkAtomic,
}

#[cfg(not(loom))]
pub(super) type ForkAtomic = core::sync::atomic::AtomicUsize;
#[cfg(loom)]
pub(super) type ForkAtomic = crate::sync::AtomicUsize;

#[cfg(not(loom))]
pub(super) fn fork_owner() -> &'static ForkOwner {
    static OWNER: ForkOwner = ForkOwner {
        thread: ForkAtomic::new(0),
        depth: ForkAtomic::new(0),
    };
    &OWNER
}

/// Loom build: one owner per model execution.
#[cfg(loom)]
pub(super) fn fork_owner() -> &'static ForkOwner {
    loom::lazy_static! {
        static ref OWNER: ForkOwner = ForkOwner {
            thread: ForkAtomic::new(0),
            depth: ForkAtomic::new(0),
        };
    }
    &OWNER
}

/// Negative control for loom model 8 (loom builds only): when set, the handlers treat the owner as
/// a shared "held" flag (any non-zero owner counts as this thread's), so a second thread's fork
/// goes ahead on the locks the first one took.
#[cfg(loom)]
#[doc(hidden)]
pub static LOOM_SHARED_FORK_FLAG: crate::sync::UnmodelledAtomicBool =
    crate::sync::UnmodelledAtomicBool::new(false);

/// Negative control for loom model 8 (loom builds only): when set, the first parent or child call
/// releases the locks even while an outer prepare call of the same thread is unmatched (a nested
/// fork then lets the outer one go ahead without them).
#[cfg(loom)]
#[doc(hidden)]
pub static LOOM_IGNORE_FORK_DEPTH: crate::sync::UnmodelledAtomicBool =
    crate::sync::UnmodelledAtomicBool::new(false);

/// Whether an owner value `owner` means that thread `me`'s fork holds the locks.
fn owned_by(owner: usize, me: usize) -> bool {
    #[cfg(loom)]
    if LOOM_SHARED_FORK_FLAG.load(crate::sync::UnmodelledOrdering::Relaxed) {
        return owner != 0;
    }
    owner == me
}

/// The prepare handler's work, on thread `me` (non-zero).
fn fork_handler_prepare(me: usize) {
    use core::sync::atomic::Ordering::Relaxed;
    if owned_by(fork_owner().thread.load(Relaxed), me) {
        fork_owner()
            .depth
            .store(fork_owner().depth.load(Relaxed) + 1, Relaxed);
        return;
    }
    fork_prepare();
    fork_owner().depth.store(1, Relaxed);
    fork_owner().thread.store(me, Relaxed);
}

/// What a parent or child call on thread `me` finds.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum ForkEnd {
    /// Another thread's fork (or none) holds the locks: nothing to do.
    NotOwner,
    /// This thread's fork holds them, and an outer prepare call is still unmatched.
    Nested,
    /// This thread's outermost fork is done: the owner is cleared, and the caller releases the
    /// locks next.
    Release,
}

/// Matches one prepare call of thread `me` (see [`fork_owner`]).
fn end_fork_call(me: usize) -> ForkEnd {
    use core::sync::atomic::Ordering::Relaxed;
    if !owned_by(fork_owner().thread.load(Relaxed), me) {
        return ForkEnd::NotOwner;
    }
    #[allow(unused_mut)]
    let mut depth = fork_owner().depth.load(Relaxed).saturating_sub(1);
    #[cfg(loom)]
    if LOOM_IGNORE_FORK_DEPTH.load(crate::sync::UnmodelledOrdering::Relaxed) {
        depth = 0;
    }
    fork_owner().depth.store(depth, Relaxed);
    if depth > 0 {
        return ForkEnd::Nested;
    }
    // Before the locks are released, so the next fork's prepare step (which waits for them) sets
    // its own id after this store.
    fork_owner().thread.store(0, Relaxed);
    ForkEnd::Release
}

/// The parent handler's work, on thread `me`.
fn fork_handler_parent(me: usize) {
    if end_fork_call(me) == ForkEnd::Release {
        // SAFETY: this thread's prepare handler took the locks (the owner was this thread) and
        // nothing released them since (the owner is cleared just before each release).
        unsafe { fork_release() };
    }
}

/// Loom build: a fork's prepare handler, on the thread with id `me` (non-zero, one per thread).
#[cfg(loom)]
#[doc(hidden)]
pub fn loom_fork_handler_prepare(me: usize) {
    fork_handler_prepare(me);
}

/// Loom build: a fork's parent handler, on the thread with id `me`.
#[cfg(loom)]
#[doc(hidden)]
pub fn loom_fork_handler_parent(me: usize) {
    fork_handler_parent(me);
}

/// This thread's id for the fork owner: the same in a `fork` child as in the thread that forked.
#[cfg(not(loom))]
fn fork_thread_id() -> usize {
    // SAFETY: `pthread_self` has no preconditions.
    unsafe { libc::pthread_self() as usize }
}

#[cfg(not(loom))]
pub(super) extern "C" fn on_fork_prepare() {
    fork_handler_prepare(fork_thread_id());
}

#[cfg(not(loom))]
pub(super) extern "C" fn on_fork_parent() {
    fork_handler_parent(fork_thread_id());
}

/// In the child, also records the one thread cache that survives (see `Heap::after_fork`), on every
/// call that finds this thread the owner: the child of a nested fork is a new process too.
#[cfg(not(loom))]
pub(super) extern "C" fn on_fork_child() {
    let end = end_fork_call(fork_thread_id());
    if end == ForkEnd::NotOwner {
        return;
    }
    #[cfg(feature = "std")]
    {
        use core::sync::atomic::Ordering::Relaxed;
        let (addr, owner) = tcache::with(|tc| (tc as *const ThreadCache as usize, tc.owner.get()))
            .unwrap_or((0, tcache::UNBOUND));
        FORK_SURVIVOR[0].store(addr, Relaxed);
        FORK_SURVIVOR[1].store(owner, Relaxed);
        FORK_GEN.fetch_add(1, Relaxed);
    }
    if end == ForkEnd::Release {
        // SAFETY: the child's only thread is the one that forked, whose prepare handler took the
        // locks (the owner was this thread).
        unsafe { fork_release() };
    }
}

/// Whether `pthread_atfork` took this crate's handlers.
#[cfg(not(loom))]
static HANDLERS_INSTALLED: core::sync::atomic::AtomicBool =
    core::sync::atomic::AtomicBool::new(false);

/// Whether a `fork` runs this crate's handlers (registered when the program was loaded, or at the
/// first heap's initialisation, before any cache binds). Without them a fork child would keep a
/// registry of thread caches whose threads are gone, and glibc gives their storage to the child's
/// new threads: a new thread's cache would be linked twice (`registry_corrupted`). So threads get
/// no cache then, and take the lock. Always true under loom and Miri, which run no `fork`.
#[cfg(feature = "std")]
pub(super) fn fork_handlers_installed() -> bool {
    #[cfg(any(loom, miri))]
    return true;
    #[cfg(not(any(loom, miri)))]
    return HANDLERS_INSTALLED.load(core::sync::atomic::Ordering::Acquire);
}

/// Registers the `fork` handlers, once per process, before any lock they take is first taken (the
/// first instance's initialisation calls it before taking the heap-list lock). `pthread_once`, not
/// a flag of our own: glibc reruns it in a child forked while another thread was inside it, where a
/// hand-made "registering" state would stay stuck.
#[cfg(not(loom))]
pub(super) fn install_fork_handlers() {
    struct Once(core::cell::UnsafeCell<libc::pthread_once_t>);
    // SAFETY: only `pthread_once` touches the cell, and it synchronises itself.
    unsafe impl Sync for Once {}
    static ONCE: Once = Once(core::cell::UnsafeCell::new(libc::PTHREAD_ONCE_INIT));
    extern "C" fn register() {
        // SAFETY: registers handlers that take and release this crate's locks and touch atomics
        // and this thread's cache; none of them allocates. Nothing of ours is locked here.
        let rc = unsafe {
            libc::pthread_atfork(
                Some(on_fork_prepare),
                Some(on_fork_parent),
                Some(on_fork_child),
            )
        };
        // It fails only when libc's own malloc does (ENOMEM). Without the handlers a `fork` while
        // another thread holds one of the allocator's locks leaves the child unable to allocate
        // (it hangs, as with any allocator that has no handlers), and a child would keep the
        // registry of the parent's thread caches, whose threads it does not have: threads get no
        // cache then (see `fork_handlers_installed`).
        if rc == 0 {
            HANDLERS_INSTALLED.store(true, core::sync::atomic::Ordering::Release);
        }
    }
    // Miri runs no `fork` and implements neither `pthread_once` nor `pthread_atfork`.
    #[cfg(miri)]
    let _ = (ONCE.0.get(), register as extern "C" fn());
    // SAFETY: `ONCE` is a static `pthread_once_t` initialised with `PTHREAD_ONCE_INIT`, and
    // `register` neither unwinds nor calls `pthread_once` on it.
    #[cfg(not(miri))]
    unsafe {
        libc::pthread_once(ONCE.0.get(), register)
    };
}

/// Registers the handlers when the program (or this library) is loaded, before `main` and before
/// any thread of the program runs. Registering at the first initialisation is not enough: glibc's
/// `fork` picks the handlers it runs when it starts, and runs the prepare handlers that were
/// registered before with its atfork lock released. A first initialisation on another thread
/// meanwhile registers handlers that this fork skips, then takes the heap list's lock, and the
/// child inherits it held (its first use of an allocator hangs). The call in `init` stays for
/// targets without `.init_array`.
#[cfg(all(target_os = "linux", not(loom), not(miri)))]
#[used]
#[link_section = ".init_array"]
static REGISTER_AT_LOAD: extern "C" fn() = {
    extern "C" fn at_load() {
        install_fork_handlers();
    }
    at_load
};

/// Puts a new heap on the list. The caller holds the list's lock.
pub(super) fn link_heap(anchor: &Anchor) {
    use core::sync::atomic::Ordering::Relaxed;
    anchor.next.store(heaps().head.load(Relaxed), Relaxed);
    heaps()
        .head
        .store(anchor as *const Anchor as usize, Relaxed);
}

/// Takes a heap off the list (before its memory is unmapped).
pub(super) fn unlink_heap(anchor: &Anchor) {
    use core::sync::atomic::Ordering::Relaxed;
    let me = anchor as *const Anchor as usize;
    let list = heaps();
    list.lock.lock().with(|_| {
        let next = anchor.next.load(Relaxed);
        if list.head.load(Relaxed) == me {
            list.head.store(next, Relaxed);
            return;
        }
        let mut prev = list.head.load(Relaxed);
        while prev != 0 {
            // SAFETY: a listed anchor, under the list's lock.
            let p = unsafe { &*(prev as *const Anchor) };
            if p.next.load(Relaxed) == me {
                p.next.store(next, Relaxed);
                return;
            }
            prev = p.next.load(Relaxed);
        }
    });
}

/// The current fork generation (always 0 under loom, which has no fork).
#[cfg(feature = "std")]
pub(super) fn fork_generation() -> usize {
    #[cfg(not(loom))]
    return FORK_GEN.load(core::sync::atomic::Ordering::Relaxed);
    #[cfg(loom)]
    return 0;
}

/// Serialises thread-exit flushes and the rebinding of orphaned caches with instance drops (see
/// `tcache`'s docs).
#[cfg(all(feature = "std", not(loom)))]
pub(super) fn bindings() -> &'static SpinLock<()> {
    static BINDINGS: SpinLock<()> = SpinLock::with_reentry_handler((), reentered);
    &BINDINGS
}

#[cfg(all(feature = "std", loom))]
pub(super) fn bindings() -> &'static SpinLock<()> {
    loom::lazy_static! {
        static ref BINDINGS: SpinLock<()> = SpinLock::with_reentry_handler((), reentered);
    }
    &BINDINGS
}

/// Negative control for the fork model (loom builds only): when set, an initialisation takes the
/// heap list's lock only around linking the new heap, not for the whole initialisation, so a fork
/// can come while another thread holds an instance's state lock.
#[cfg(loom)]
#[doc(hidden)]
pub static LOOM_SHORT_INIT_LIST_LOCK: crate::sync::UnmodelledAtomicBool =
    crate::sync::UnmodelledAtomicBool::new(false);

/// Negative control for the loom models (loom builds only): when set, dropping an allocator does
/// not take the bindings lock, which the thread-exit model must catch.
#[cfg(all(feature = "std", loom))]
#[doc(hidden)]
pub static LOOM_SKIP_DROP_BINDINGS: crate::sync::UnmodelledAtomicBool =
    crate::sync::UnmodelledAtomicBool::new(false);

/// Negative control for the loom models (loom builds only): when set, a thread cache rebinding
/// after its instance's drop does not wait on the bindings lock, which the rebinding model must
/// catch.
#[cfg(all(feature = "std", loom))]
#[doc(hidden)]
pub static LOOM_SKIP_REBIND_BINDINGS: crate::sync::UnmodelledAtomicBool =
    crate::sync::UnmodelledAtomicBool::new(false);
