//! A back end over the simulated device whose stream handles can be counted and whose calls can be
//! made to panic, for the device-pool tests of panics and handles (`cuda_pool_sim`,
//! `cuda_pool_threads`).
// Each includer uses some of these.
#![allow(dead_code)]

use std::sync::Arc;

use bfc_alloc::cuda::{DeviceBuffer, DevicePool, PoolOptions, SimBackend, SimDevice, SimStream};

/// A stream handle whose clones can be counted, over the simulated back end: alive ones with
/// `Arc::strong_count` of the second field, and every clone made on a thread in `CLONES`.
#[derive(Debug)]
pub struct Counted(pub SimStream, pub Arc<()>);

std::thread_local! {
    /// Clones of `Counted` handles made on this thread.
    pub static CLONES: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

impl Clone for Counted {
    fn clone(&self) -> Self {
        assert!(
            !PANIC_IN_STREAM_CLONE.with(|f| f.replace(false)),
            "a stream handle panicked in its clone"
        );
        CLONES.with(|c| c.set(c.get() + 1));
        Counted(self.0, self.1.clone())
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        // (Once: the unwinding drops more handles.)
        assert!(
            !PANIC_IN_STREAM_DROP.with(|f| f.replace(false)),
            "a stream handle panicked in its drop"
        );
    }
}

pub struct CountingBackend(pub SimBackend);

/// A pool over `dev` through a [`CountingBackend`], with a limit of `limit` bytes.
pub fn counting_pool(dev: &SimDevice, limit: usize) -> DevicePool<CountingBackend> {
    DevicePool::with_backend(
        CountingBackend(dev.backend()),
        PoolOptions::with_limit(limit),
    )
    .unwrap()
}

/// `bytes` from a [`counting_pool`] on stream `s`.
pub fn counted_alloc(
    pool: &DevicePool<CountingBackend>,
    s: &Counted,
    bytes: usize,
) -> DeviceBuffer<u8, CountingBackend> {
    // SAFETY: simulated memory is never read.
    unsafe { pool.alloc::<u8>(s, bytes) }.unwrap()
}

// SAFETY: every call goes to the simulated back end it wraps, which keeps the promises.
unsafe impl bfc_alloc::cuda::DeviceBackend for CountingBackend {
    type Stream = Counted;
    type Event = bfc_alloc::cuda::SimEvent;
    type Uses = bfc_alloc::cuda::SimUses;
    fn ordinal(&self) -> usize {
        self.0.ordinal()
    }
    fn compute_capability_major(&self) -> Result<i32, bfc_alloc::cuda::BackendError> {
        self.0.compute_capability_major()
    }
    fn mem_info(&mut self) -> Result<(usize, usize), bfc_alloc::cuda::BackendError> {
        self.0.mem_info()
    }
    fn mem_alloc(&mut self, bytes: usize) -> Result<u64, bfc_alloc::cuda::BackendError> {
        self.0.mem_alloc(bytes)
    }
    unsafe fn mem_free(&mut self, ptr: u64) -> Result<(), bfc_alloc::cuda::BackendError> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.0.mem_free(ptr) }
    }
    fn check_stream(&self, s: &Counted) -> Result<(), bfc_alloc::cuda::BackendError> {
        self.0.check_stream(&s.0)
    }
    fn stream_id(s: &Counted) -> u64 {
        // The stream's number alone: as CUDA's null and legacy handles are, the same in every
        // context (`check_stream` tells the contexts apart).
        SimBackend::stream_id(&s.0) as u32 as u64
    }
    fn same_stream(a: &Counted, b: &Counted) -> bool {
        assert_ne!(
            a.0, PANICS_IN_SAME_STREAM,
            "a back end panicked comparing streams"
        );
        assert!(
            !PANIC_IN_SAME_STREAM.with(std::cell::Cell::get),
            "a back end panicked comparing streams"
        );
        // Streams 3 and 4 of any context (`C` and `D` in the pool's) take stream caches, as on
        // `SimBackend`; the others keep to the pool's lock, where the tests of queue handles
        // below count them.
        a.0 == b.0 && matches!(a.0 .0 as u32, 3 | 4)
    }
    fn same_handle(a: &Counted, b: &Counted) -> bool {
        a.0 == b.0 && Arc::ptr_eq(&a.1, &b.1)
    }
    fn uses_none(uses: &bfc_alloc::cuda::SimUses) -> bool {
        SimBackend::uses_none(uses)
    }
    fn stream_done(&mut self, s: &Counted) -> Result<bool, bfc_alloc::cuda::BackendError> {
        self.0.stream_done(&s.0)
    }
    fn record_event(
        &mut self,
        s: &Counted,
    ) -> Result<bfc_alloc::cuda::SimEvent, bfc_alloc::cuda::BackendError> {
        assert!(
            !PANIC_IN_RECORD_EVENT.with(std::cell::Cell::get),
            "a back end panicked recording an event"
        );
        self.0.record_event(&s.0)
    }
    fn event_done(
        &mut self,
        e: &bfc_alloc::cuda::SimEvent,
    ) -> Result<bool, bfc_alloc::cuda::BackendError> {
        self.0.event_done(e)
    }
    fn event_sync(
        &mut self,
        e: &bfc_alloc::cuda::SimEvent,
    ) -> Result<(), bfc_alloc::cuda::BackendError> {
        assert!(
            !PANIC_IN_EVENT_SYNC.with(std::cell::Cell::get),
            "a back end panicked waiting for an event"
        );
        let at = EVENT_SYNC_PANICS_AT.with(|f| f.replace(f.get().saturating_sub(1)));
        assert_ne!(at, 1, "a back end panicked waiting for an event");
        self.0.event_sync(e)
    }
    fn recycle_event(&mut self, e: bfc_alloc::cuda::SimEvent) {
        assert!(
            !PANIC_IN_RECYCLE_EVENT.with(std::cell::Cell::get),
            "a back end panicked recycling an event"
        );
        self.0.recycle_event(e)
    }
    fn synchronize(&mut self) -> Result<(), bfc_alloc::cuda::BackendError> {
        self.0.synchronize()
    }
    unsafe fn memset_zero(
        &mut self,
        s: &Counted,
        uses: &bfc_alloc::cuda::SimUses,
        ptr: u64,
        bytes: usize,
    ) -> Result<(), bfc_alloc::cuda::BackendError> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.0.memset_zero(&s.0, uses, ptr, bytes) }
    }
    fn finish_uses(
        &mut self,
        s: &Counted,
        uses: &bfc_alloc::cuda::SimUses,
    ) -> Result<(), bfc_alloc::cuda::UsesError> {
        assert_ne!(s.0, PANICS_IN_FREE, "a back end panicked in a free");
        self.0.finish_uses(&s.0, uses)
    }
}

/// The stream on which `CountingBackend` panics in a buffer's free.
pub const PANICS_IN_FREE: SimStream = SimStream(99);

/// The stream that `CountingBackend` panics on comparing (in an allocation, under a stream cache's
/// lock).
pub const PANICS_IN_SAME_STREAM: SimStream = SimStream(98);

std::thread_local! {
    /// Makes `CountingBackend` panic in `event_sync` on this thread.
    pub static PANIC_IN_EVENT_SYNC: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Makes the next `Counted` handle dropped on this thread panic.
    pub static PANIC_IN_STREAM_DROP: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Makes the next clone of a `Counted` handle on this thread panic.
    pub static PANIC_IN_STREAM_CLONE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Makes `CountingBackend` panic in `same_stream` on this thread.
    pub static PANIC_IN_SAME_STREAM: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Makes `CountingBackend` panic in `record_event` on this thread.
    pub static PANIC_IN_RECORD_EVENT: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Makes `CountingBackend` panic in `recycle_event` on this thread.
    pub static PANIC_IN_RECYCLE_EVENT: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Makes `CountingBackend` panic in the `event_sync` call this many calls from now on this
    /// thread (1: the next one; 0: none).
    pub static EVENT_SYNC_PANICS_AT: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Runs `f` with one of the switches above set to `on` on this thread (then back as it was), and
/// returns what `catch_unwind` made of it.
pub fn with_switch<T: Copy, R>(
    switch: &'static std::thread::LocalKey<std::cell::Cell<T>>,
    on: T,
    f: impl FnOnce() -> R,
) -> std::thread::Result<R> {
    let was = switch.with(|s| s.replace(on));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    switch.with(|s| s.set(was));
    r
}
