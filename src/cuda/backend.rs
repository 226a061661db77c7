//! The device back end: the only place the pool talks to a driver.
//!
//! Every driver call the pool makes goes through [`DeviceBackend`], so the whole pool (growth, limits,
//! back-off, stream-ordered reuse, out-of-memory handling) runs on the CPU over
//! [`SimBackend`](super::SimBackend) and on a GPU over [`CudaBackend`](super::CudaBackend) alike.

use std::fmt;
use std::string::String;

/// A failed driver call: which operation, and the driver's own words.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackendError {
    /// The operation that failed (`"cuMemAlloc"`, `"cuEventRecord"`, ...).
    pub op: &'static str,
    /// The driver's description of the failure.
    pub message: String,
}

impl BackendError {
    /// An error for operation `op`.
    pub fn new(op: &'static str, message: impl Into<String>) -> Self {
        BackendError {
            op,
            message: message.into(),
        }
    }
}

impl fmt::Display for BackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} failed: {}", self.op, self.message)
    }
}

impl std::error::Error for BackendError {}

/// What the pool needs from a device: memory, its totals, and stream-ordered events.
///
/// All methods taking `&mut self` are called with the pool's lock held, one at a time. The associated
/// functions without `self` are called without the lock, from any thread.
///
/// # Events
///
/// [`record_event`](Self::record_event) marks "everything queued on this stream so far";
/// [`event_done`](Self::event_done) says whether that work has finished and
/// [`event_sync`](Self::event_sync) waits for it. The pool relies on these to decide when a block
/// freed on one stream may be handed to another.
///
/// # Safety
///
/// The pool hands out device memory on the strength of these answers, so an implementation
/// promises:
/// - [`mem_alloc`](Self::mem_alloc) returns the start of `bytes` of device memory that does not
///   overlap any other live allocation of this back end, does not wrap around the address space,
///   and stays the pool's until [`mem_free`](Self::mem_free);
/// - streams: [`check_stream`](Self::check_stream) accepts only streams on which work is queued
///   in order, and [`stream_id`](Self::stream_id) gives two accepted streams the same id only if
///   they are the same stream (a clone names the same stream): a block freed on a stream is handed
///   to that stream's next allocation without any wait;
/// - [`same_stream`](Self::same_stream) says `true` only of two handles of one stream that
///   [`check_stream`](Self::check_stream) accepts if it accepts either, and `check_stream`'s
///   answer for a stream does not change while the pool holds a handle of it (a cache hit relies
///   on the check made when the cached block was allocated); and
///   [`uses_none`](Self::uses_none) only when [`finish_uses`](Self::finish_uses) would have
///   nothing to order: the pool then skips `finish_uses` for a free that goes to a stream cache
///   (a cache hit skips `check_stream` on the strength of `same_stream`);
/// - [`same_handle`](Self::same_handle) says `true` only of two clones of one handle, so that
///   keeping either and dropping the other are the same;
/// - [`record_event`](Self::record_event) marks everything queued on its stream so far;
///   [`stream_done`](Self::stream_done), [`event_done`](Self::event_done),
///   [`event_sync`](Self::event_sync), [`synchronize`](Self::synchronize) and
///   [`finish_uses`](Self::finish_uses) report work as finished or ordered only when it is (an
///   error is a safe answer, except that [`UsesError::Unordered`] promises that waiting for the
///   whole device covers every use left unordered), for the uses the back end is told of: uses it
///   cannot see must be documented as the caller's to order (see [`CudaUses`](super::CudaUses));
/// - [`memset_zero`](Self::memset_zero) writes only the range it is given, on the stream it is
///   given;
/// - no method calls back into the pool.
pub unsafe trait DeviceBackend: Send + 'static {
    /// A stream handle (cheap to clone); buffers keep the one they were allocated on.
    type Stream: Clone + Send + Sync + 'static;
    /// A recorded point in a stream.
    type Event: Send + 'static;
    /// Per-buffer bookkeeping of uses on streams other than the buffer's own (see
    /// [`finish_uses`](Self::finish_uses)).
    type Uses: Default + Send + Sync + 'static;

    /// Index of the device.
    fn ordinal(&self) -> usize;

    /// Major compute capability (used for the default system reserve).
    fn compute_capability_major(&self) -> Result<i32, BackendError>;

    /// Device memory `(free, total)` in bytes.
    fn mem_info(&mut self) -> Result<(usize, usize), BackendError>;

    /// Allocates `bytes` of device memory; the address is at least 256-byte aligned.
    fn mem_alloc(&mut self, bytes: usize) -> Result<u64, BackendError>;

    /// Frees memory from [`mem_alloc`](Self::mem_alloc).
    ///
    /// # Safety
    ///
    /// - `ptr` was returned by `mem_alloc` on this back end and has not been freed;
    /// - no queued or running device work uses the memory any more.
    unsafe fn mem_free(&mut self, ptr: u64) -> Result<(), BackendError>;

    /// Fails if `stream` does not belong to this back end's device or context.
    fn check_stream(&self, stream: &Self::Stream) -> Result<(), BackendError>;

    /// A value identifying `stream`: equal for handles of the same stream (one stream may have
    /// two, as CUDA's legacy stream, whose null and `CU_STREAM_LEGACY` handles never share
    /// blocks), distinct for two streams that [`check_stream`](Self::check_stream) accepts
    /// (streams it refuses may share an id, as CUDA's null handle does in every context).
    fn stream_id(stream: &Self::Stream) -> u64;

    /// Whether `a` and `b` are handles of the same stream, one that
    /// [`check_stream`](Self::check_stream) accepts if it accepts either (so `false` for a handle
    /// that names a different stream on each thread). The pool keeps a stream's freed blocks in a
    /// stream cache (the allocating thread's, with a lock of its own) only if `same_stream(s, s)`,
    /// and hands a cached block to an allocation on stream `t` only if `same_stream(cached, t)`
    /// for the handle its free left (which keeps the stream alive, or whose owner must: a borrowed
    /// one), without calling `check_stream`. The default, `false`, keeps every call on the pool's
    /// lock.
    fn same_stream(a: &Self::Stream, b: &Self::Stream) -> bool {
        let _ = (a, b);
        false
    }

    /// Whether `a` and `b` are clones of one handle (of one `Arc`, say), so that either can stand
    /// for the other. A buffer served from a stream cache then keeps the handle the cache held
    /// instead of a clone of the caller's (a clone and a drop fewer: with the handle an `Arc` that
    /// several threads share, those are writes to one counter from every thread). The default,
    /// `false`, clones the caller's.
    fn same_handle(a: &Self::Stream, b: &Self::Stream) -> bool {
        let _ = (a, b);
        false
    }

    /// Whether `uses` records no use on any stream but the buffer's own, so that
    /// [`finish_uses`](Self::finish_uses) would do nothing and succeed. The default, `false`,
    /// always calls it.
    fn uses_none(uses: &Self::Uses) -> bool {
        let _ = uses;
        false
    }

    /// Whether all the work queued on `stream` so far has finished (no waiting).
    fn stream_done(&mut self, stream: &Self::Stream) -> Result<bool, BackendError>;

    /// Records an event after the work currently queued on `stream`.
    fn record_event(&mut self, stream: &Self::Stream) -> Result<Self::Event, BackendError>;

    /// Whether the work before `event` has finished (no waiting).
    fn event_done(&mut self, event: &Self::Event) -> Result<bool, BackendError>;

    /// Waits until the work before `event` has finished.
    fn event_sync(&mut self, event: &Self::Event) -> Result<(), BackendError>;

    /// Takes back an event that is no longer needed (for reuse); the default drops it.
    fn recycle_event(&mut self, event: Self::Event) {
        drop(event);
    }

    /// Waits until all work on the device (every stream) has finished.
    fn synchronize(&mut self) -> Result<(), BackendError>;

    /// Queues on `stream` a write of zeros to `bytes` bytes at `ptr`, after the uses on other
    /// streams that `uses` recorded.
    ///
    /// # Safety
    ///
    /// `[ptr, ptr + bytes)` is device memory owned by the caller, a buffer whose home stream is
    /// `stream` and whose uses `uses` records.
    unsafe fn memset_zero(
        &mut self,
        stream: &Self::Stream,
        uses: &Self::Uses,
        ptr: u64,
        bytes: usize,
    ) -> Result<(), BackendError>;

    /// Called when a buffer is freed, before the pool orders the free on `stream` (the buffer's own
    /// stream): makes `stream` wait for the buffer's uses on other streams that `uses` recorded. On
    /// [`UsesError::Unordered`] the pool waits for the whole device instead (and if that fails too,
    /// never reuses the block); on [`UsesError::Unbounded`] it never reuses the block.
    fn finish_uses(&mut self, stream: &Self::Stream, uses: &Self::Uses) -> Result<(), UsesError>;
}

/// Why [`DeviceBackend::finish_uses`] could not order a buffer's uses before its free.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UsesError {
    /// Some use was not ordered by an event, but waiting for the whole device
    /// ([`DeviceBackend::synchronize`]) covers it.
    Unordered(BackendError),
    /// Some use may still run where waiting for the device does not reach (another context that
    /// could not be waited for): the block must never be handed out again.
    Unbounded(BackendError),
}

impl UsesError {
    /// The driver failure behind it.
    pub fn error(&self) -> &BackendError {
        match self {
            UsesError::Unordered(e) | UsesError::Unbounded(e) => e,
        }
    }
}

impl From<BackendError> for UsesError {
    fn from(e: BackendError) -> Self {
        UsesError::Unordered(e)
    }
}
