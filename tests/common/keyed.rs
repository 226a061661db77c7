//! Threads started with `pthread_create` (not `std::thread`, which needs pthread keys of its own)
//! whose first use of an allocator comes in a pthread key's destructor, which glibc runs after the
//! destructors of Rust's thread-locals (`thread_cache`, `address_limit`).
// Each includer uses some of these.
#![allow(dead_code)]

use std::alloc::{GlobalAlloc, Layout};
use std::sync::OnceLock;

use bfc_alloc::GlobalBfc;

/// The instance these threads use (and nothing else, so that its counts are theirs).
pub static KEYED: GlobalBfc = GlobalBfc::new();

/// Allocates 200 small blocks from [`KEYED`] and frees them.
fn allocate_and_free() {
    let l = Layout::from_size_align(16, 8).unwrap();
    let mut blocks = [std::ptr::null_mut::<u8>(); 200];
    for b in &mut blocks {
        // SAFETY: a non-zero size.
        *b = unsafe { KEYED.alloc(l) };
    }
    for &b in &blocks {
        assert!(!b.is_null());
        // SAFETY: from `KEYED.alloc(l)`, freed once.
        unsafe { KEYED.dealloc(b, l) };
    }
}

unsafe extern "C" fn allocating_key_destructor(_: *mut libc::c_void) {
    allocate_and_free();
}

/// The key whose destructor allocates from [`KEYED`] and frees, made on first use.
pub fn allocating_key() -> libc::pthread_key_t {
    static KEY: OnceLock<libc::pthread_key_t> = OnceLock::new();
    *KEY.get_or_init(|| {
        let mut key = 0;
        // SAFETY: a valid place for the key, and a destructor that does not unwind.
        let made = unsafe { libc::pthread_key_create(&mut key, Some(allocating_key_destructor)) };
        assert_eq!(made, 0);
        key
    })
}

/// Runs `f(arg)` on a new `pthread_create` thread, joins it, and returns what it returned.
fn on_pthread(f: extern "C" fn(*mut libc::c_void) -> *mut libc::c_void, arg: usize) -> usize {
    let mut t: libc::pthread_t = 0;
    let mut ret = std::ptr::null_mut();
    // SAFETY: default attributes, a thread function of the right type, joined at once.
    unsafe {
        assert_eq!(
            libc::pthread_create(&mut t, std::ptr::null(), f, arg as *mut _),
            0
        );
        assert_eq!(libc::pthread_join(t, &mut ret), 0);
    }
    ret as usize
}

/// Runs a thread that only sets the allocating key (and uses no allocator): its first use of
/// [`KEYED`] comes at its exit, in the key's destructor.
pub fn first_use_at_exit() {
    extern "C" fn set_key(_: *mut libc::c_void) -> *mut libc::c_void {
        let value = std::ptr::NonNull::<u8>::dangling().as_ptr().cast();
        // SAFETY: a live key; a non-null value makes its destructor run at this thread's exit.
        unsafe { libc::pthread_setspecific(allocating_key(), value) };
        std::ptr::null_mut()
    }
    allocating_key();
    on_pthread(set_key, 0);
}

/// Runs a thread that allocates and frees small blocks from [`KEYED`]; returns the bytes its cache
/// held just before it exited.
pub fn cached_by_an_allocating_thread() -> usize {
    extern "C" fn allocate(_: *mut libc::c_void) -> *mut libc::c_void {
        allocate_and_free();
        KEYED.thread_cache_bytes() as *mut libc::c_void
    }
    on_pthread(allocate, 0)
}

/// Asserts that no exited thread left a block cached or in use in [`KEYED`] (after draining the
/// transfer cache, which takes an exiting thread's blocks), and that the heap checks out.
pub fn assert_no_block_left(round: usize) {
    KEYED.release_free_memory();
    let s = KEYED.stats();
    assert_eq!(
        (s.num_cached_chunks, s.bytes_in_use),
        (0, 0),
        "round {round}: blocks left behind by an exited thread"
    );
    KEYED.check().unwrap();
}
