//! No `GlobalBfc` method, as the global allocator, calls the global allocator (itself): a wrapper
//! counts calls that arrive while another call is running on the same thread.

use std::alloc::{GlobalAlloc, Layout};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use bfc_alloc::GlobalBfc;

struct Nesting {
    inner: GlobalBfc,
}

std::thread_local! {
    // `const`, no destructor: using it allocates nothing.
    static DEPTH: Cell<u32> = const { Cell::new(0) };
}
static NESTED: AtomicUsize = AtomicUsize::new(0);

struct Enter;
impl Enter {
    fn new() -> Enter {
        DEPTH.with(|d| {
            if d.get() > 0 {
                NESTED.fetch_add(1, Relaxed);
            }
            d.set(d.get() + 1)
        });
        Enter
    }
}
impl Drop for Enter {
    fn drop(&mut self) {
        DEPTH.with(|d| d.set(d.get() - 1));
    }
}

// SAFETY: forwards every call to `GlobalBfc` unchanged.
unsafe impl GlobalAlloc for Nesting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let _e = Enter::new();
        // SAFETY: forwarded.
        unsafe { self.inner.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        let _e = Enter::new();
        // SAFETY: forwarded.
        unsafe { self.inner.alloc_zeroed(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        let _e = Enter::new();
        // SAFETY: forwarded.
        unsafe { self.inner.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        let _e = Enter::new();
        // SAFETY: forwarded.
        unsafe { self.inner.realloc(p, l, n) }
    }
}

#[global_allocator]
static A: Nesting = Nesting {
    inner: GlobalBfc::new(),
};

#[test]
fn global_alloc_methods_do_not_reenter_the_global_allocator() {
    let before = NESTED.load(Relaxed);
    let mut handles = Vec::new();
    for t in 0..8 {
        handles.push(std::thread::spawn(move || {
            let mut v: Vec<Box<[u8]>> = Vec::new();
            for i in 0..5000usize {
                let n = [8, 24, 100, 1000, 4096, 5000, 70_000, 1 << 20][(i + t) % 8];
                v.push(vec![i as u8; n].into_boxed_slice());
                if i % 3 == 0 {
                    let mut s = v.swap_remove(i % v.len()).into_vec();
                    s.resize(s.len() * 2 + 1, 1);
                    s.truncate(3);
                    s.shrink_to_fit();
                }
            }
            A.inner.release_free_memory();
            A.inner.flush_thread_cache();
            let _ = A.inner.stats();
        }));
    }
    for h in handles {
        h.join().unwrap();
    }
    let nested = NESTED.load(Relaxed) - before;
    println!("nested calls: {nested}");
    assert_eq!(
        nested, 0,
        "GlobalAlloc methods called the global allocator {nested} times"
    );
}
