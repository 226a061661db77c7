//! The real back end over the CUDA driver (through cudarc), and cudarc's capability traits for
//! [`DeviceBuffer`].

use std::string::ToString;
use std::sync::{Arc, OnceLock};
use std::vec::Vec;

use cudarc::driver::result::{self, DriverError};
use cudarc::driver::sys;
use cudarc::driver::{
    CudaContext, CudaEvent, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice,
    LaunchArgs, PushKernelArg, SyncOnDrop, ValidAsZeroBits,
};

use super::backend::{BackendError, DeviceBackend, UsesError};
use super::buffer::DeviceBuffer;
use super::error::PoolError;
use super::pool::{DevicePool, PoolOptions, EVENT_CACHE};
use super::uses::{EndOfUse, Protocol, UseOps};

/// Whether the CUDA driver library can be loaded. Checked (once) before any driver call, because
/// cudarc panics when it is missing.
pub fn driver_available() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: this only tries to load the driver library by its usual names; loading it runs the
    // library's initialisers, which is what any use of the driver does.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

fn err(op: &'static str) -> impl FnOnce(DriverError) -> BackendError {
    move |e| BackendError::new(op, e.to_string())
}

fn no_device(ordinal: Option<usize>) -> impl FnOnce(DriverError) -> PoolError {
    move |e| match e.0 {
        sys::CUresult::CUDA_ERROR_NO_DEVICE | sys::CUresult::CUDA_ERROR_INVALID_DEVICE => {
            PoolError::NoDevice { ordinal }
        }
        _ => PoolError::Backend(BackendError::new("cuInit/cuDeviceGet", e.to_string())),
    }
}

/// Number of CUDA devices; `Err(DriverNotFound)` without a driver.
pub fn device_count() -> Result<usize, PoolError> {
    if !driver_available() {
        return Err(PoolError::DriverNotFound);
    }
    match CudaContext::device_count() {
        Ok(n) => Ok(n.max(0) as usize),
        Err(DriverError(sys::CUresult::CUDA_ERROR_NO_DEVICE)) => Ok(0),
        Err(e) => Err(no_device(None)(e)),
    }
}

/// The CUDA driver, for one context.
///
/// Regions come from `cuMemAlloc` and go back through `cuMemFree`; events are created without
/// timing and reused.
#[derive(Debug)]
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    /// Idle events for reuse.
    events: Vec<CudaEvent>,
}

impl CudaBackend {
    /// A back end for `ctx`.
    pub fn new(ctx: Arc<CudaContext>) -> Self {
        CudaBackend {
            ctx,
            events: Vec::new(),
        }
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}

/// `CU_STREAM_PER_THREAD`: the handle of the calling thread's per-thread default stream.
const PER_THREAD_STREAM: usize = 0x2;

/// Makes `ctx` current on this thread. Unlike `CudaContext::bind_to_thread`, this leaves the
/// context's recorded error (from cudarc's `Drop`s) for its owner to see.
fn bind(ctx: &CudaContext) -> Result<(), BackendError> {
    if result::ctx::get_current().map_err(err("cuCtxGetCurrent"))? != Some(ctx.cu_ctx()) {
        // SAFETY: `ctx` holds the context alive.
        unsafe { result::ctx::set_current(ctx.cu_ctx()) }.map_err(err("cuCtxSetCurrent"))?;
    }
    Ok(())
}

// The driver calls go through cudarc's `result` layer with `bind`, so that the pool never consumes
// an error cudarc recorded for the user.
// SAFETY:
// - Memory comes from `cuMemAlloc`: disjoint live ranges, ours until `cuMemFree`.
// - Streams: `check_stream` refuses other driver contexts and the per-thread handle, and a
//   stream handle is unique within its context while the stream lives; the pool keeps an `Arc`
//   of every stream with pending blocks (a borrowed stream is the caller's to keep alive, as
//   `wrap_borrowed_stream`'s own contract says). The legacy stream has two ids (null and
//   `CU_STREAM_LEGACY`), which only keeps blocks from moving between them. `same_stream`
//   compares the handle and the context (the null and legacy handles are the same in every
//   context), and refuses the per-thread handle; within a context a handle names one live stream,
//   which the pool's handle of an owned stream keeps alive, and a borrowed one's owner as above.
// - Stream, event and synchronisation answers are the driver's own; a failed query is an error,
//   which the pool treats as "not finished".
// - `finish_uses` and the ordering before `memset_zero` come from the use protocol
//   (`CudaUses`), which sees the uses cudarc reports through `device_ptr`. Two cases escape it,
//   both documented (`CudaUses`, README) and both from cudarc's API, with the same effect on
//   cudarc's own buffers: a peer copy to another context's memory (cudarc reports it as a use on
//   the buffer's own stream and runs it on the other context's stream), and a use whose end
//   cudarc skipped for a recorded error that safe code then took out of the context before the
//   free. Ordering those is the caller's part of the contract.
// - Nothing here calls into the pool.
unsafe impl DeviceBackend for CudaBackend {
    type Stream = Arc<CudaStream>;
    type Event = CudaEvent;
    type Uses = CudaUses;

    fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    fn compute_capability_major(&self) -> Result<i32, BackendError> {
        // SAFETY: the device handle is valid while the context lives.
        unsafe {
            result::device::get_attribute(
                self.ctx.cu_device(),
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
            )
        }
        .map_err(err("cuDeviceGetAttribute"))
    }

    fn mem_info(&mut self) -> Result<(usize, usize), BackendError> {
        bind(&self.ctx)?;
        result::mem_get_info().map_err(err("cuMemGetInfo"))
    }

    fn mem_alloc(&mut self, bytes: usize) -> Result<u64, BackendError> {
        bind(&self.ctx)?;
        // SAFETY: the context is current; the memory is owned by the pool until `mem_free`.
        unsafe { result::malloc_sync(bytes) }.map_err(err("cuMemAlloc"))
    }

    unsafe fn mem_free(&mut self, ptr: u64) -> Result<(), BackendError> {
        bind(&self.ctx)?;
        // SAFETY: the caller promises `ptr` came from `mem_alloc` and nothing uses it any more.
        unsafe { result::free_sync(ptr) }.map_err(err("cuMemFree"))
    }

    fn check_stream(&self, stream: &Arc<CudaStream>) -> Result<(), BackendError> {
        if **stream.context() != *self.ctx {
            Err(BackendError::new(
                "DevicePool::alloc",
                "the stream belongs to another context than the pool's: allocate on a stream of \
                 the pool's context (DevicePool::context), or use that context's own pool",
            ))
        } else if stream.cu_stream() as usize == PER_THREAD_STREAM {
            // The handle means "the calling thread's stream": the pool could not tell two threads'
            // streams apart, nor record a free's event on the right one from another thread.
            Err(BackendError::new(
                "DevicePool::alloc",
                "per-thread default streams (CudaContext::per_thread_stream) are not supported: \
                 use CudaContext::new_stream or default_stream",
            ))
        } else {
            Ok(())
        }
    }

    fn stream_done(&mut self, stream: &Arc<CudaStream>) -> Result<bool, BackendError> {
        bind(stream.context())?;
        // SAFETY: the stream is alive (the caller holds a handle) and belongs to this context.
        match unsafe { sys::cuStreamQuery(stream.cu_stream()) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            e => Err(err("cuStreamQuery")(DriverError(e))),
        }
    }

    fn stream_id(stream: &Arc<CudaStream>) -> u64 {
        stream.cu_stream() as usize as u64
    }

    fn same_stream(a: &Arc<CudaStream>, b: &Arc<CudaStream>) -> bool {
        // The null and legacy handles are the same in every context: compare the contexts too.
        // The per-thread handle names each thread's own stream.
        a.cu_stream() == b.cu_stream()
            && a.cu_stream() as usize != PER_THREAD_STREAM
            && **a.context() == **b.context()
    }

    fn same_handle(a: &Arc<CudaStream>, b: &Arc<CudaStream>) -> bool {
        Arc::ptr_eq(a, b)
    }

    fn uses_none(uses: &CudaUses) -> bool {
        uses.protocol.is_unused()
    }

    fn record_event(&mut self, stream: &Arc<CudaStream>) -> Result<CudaEvent, BackendError> {
        let ev = match self.events.pop() {
            Some(e) => e,
            None => new_event(&self.ctx)?,
        };
        let recorded = bind(&self.ctx).and_then(|()| {
            // SAFETY: the event and the stream are alive and belong to this context
            // (`check_stream` vetted the stream when its buffer was allocated).
            unsafe { result::event::record(ev.cu_event(), stream.cu_stream()) }
                .map_err(err("cuEventRecord"))
        });
        match recorded {
            Ok(()) => Ok(ev),
            Err(e) => {
                // Keep the (unrecorded, still valid) event rather than destroy it through
                // cudarc's `Drop`, which may overwrite the context's recorded error.
                self.recycle_event(ev);
                Err(e)
            }
        }
    }

    fn event_done(&mut self, event: &CudaEvent) -> Result<bool, BackendError> {
        // The pool polls events in every allocation and free that takes its lock, possibly on a
        // thread with no (or another) context current: `cuEventQuery` lists CUDA_ERROR_INVALID_CONTEXT.
        bind(&self.ctx)?;
        // SAFETY: the event is alive.
        match unsafe { result::event::query(event.cu_event()) } {
            Ok(()) => Ok(true),
            Err(DriverError(sys::CUresult::CUDA_ERROR_NOT_READY)) => Ok(false),
            Err(e) => Err(err("cuEventQuery")(e)),
        }
    }

    fn event_sync(&mut self, event: &CudaEvent) -> Result<(), BackendError> {
        bind(&self.ctx)?;
        // SAFETY: the event is alive.
        unsafe { result::event::synchronize(event.cu_event()) }.map_err(err("cuEventSynchronize"))
    }

    fn recycle_event(&mut self, event: CudaEvent) {
        if self.events.len() < EVENT_CACHE {
            self.events.push(event);
        }
    }

    fn synchronize(&mut self) -> Result<(), BackendError> {
        bind(&self.ctx)?;
        result::ctx::synchronize().map_err(err("cuCtxSynchronize"))
    }

    unsafe fn memset_zero(
        &mut self,
        stream: &Arc<CudaStream>,
        uses: &CudaUses,
        ptr: u64,
        bytes: usize,
    ) -> Result<(), BackendError> {
        uses.protocol.before_home_use(&CudaOps, stream)?;
        bind(stream.context())?;
        // SAFETY: the caller owns `[ptr, ptr + bytes)`; the write is queued on `stream`.
        unsafe { result::memset_d8_async(ptr, 0, bytes, stream.cu_stream()) }
            .map_err(err("cuMemsetD8Async"))
    }

    fn finish_uses(&mut self, stream: &Arc<CudaStream>, uses: &CudaUses) -> Result<(), UsesError> {
        uses.protocol.finish(&CudaOps, stream)
    }
}

/// Makes `stream` wait for `event`, without touching the error cudarc recorded in the context.
fn wait_raw(stream: &CudaStream, event: &CudaEvent) -> Result<(), BackendError> {
    bind(stream.context())?;
    // SAFETY: the stream and the event are alive.
    unsafe {
        result::stream::wait_event(
            stream.cu_stream(),
            event.cu_event(),
            sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
        )
    }
    .map_err(err("cuStreamWaitEvent"))
}

/// Records `event` on `stream` (of the event's context), without touching the recorded error.
fn record_raw(event: &CudaEvent, stream: &CudaStream) -> Result<(), BackendError> {
    bind(stream.context())?;
    // SAFETY: the stream and the event are alive and of the same context (the callers check).
    unsafe { result::event::record(event.cu_event(), stream.cu_stream()) }
        .map_err(err("cuEventRecord"))
}

/// Blocks until the work queued on `stream` is done, without touching the recorded error.
fn sync_raw(stream: &CudaStream) -> Result<(), BackendError> {
    bind(stream.context())?;
    // SAFETY: the stream is alive.
    unsafe { result::stream::synchronize(stream.cu_stream()) }.map_err(err("cuStreamSynchronize"))
}

/// Orders a buffer's uses on streams other than its home stream (through `DevicePtr::device_ptr` or
/// `DevicePtrMut::device_ptr_mut`, as cudarc's copies and memsets take them):
///
/// - before such a use, the other stream waits for the work queued so far on the home stream;
/// - after it, an event is recorded on the other stream (each other stream has an event of its own,
///   so uses on two streams at once, from two threads, are both waited for), and the home stream
///   waits for these events before the buffer's free is recorded, before the next use on yet
///   another stream, before [`DeviceBuffer::zero`], and before later uses on the home stream that
///   go through `device_ptr`/`device_ptr_mut`.
///
/// A stream of another context (even a default stream, whose handle is null in every context), or
/// of another `CudaContext` object for the same driver context (cudarc keeps a recorded error per
/// object), is another stream: the home stream's work is waited for on the host before the use,
/// and the use itself before the call returns (if cudarc skipped that wait, see below, the buffer's free and
/// [`DeviceBuffer::zero`] wait for that whole context; if even that fails, the block is never
/// handed out again).
///
/// The calls go through the driver directly, not through cudarc's context, so a failure here does
/// not become the context's recorded error, which would make cudarc skip the event record that
/// ends the use. If any step fails, the free waits for the whole context instead of an event, and
/// reports the first failure through [`DevicePool::take_errors`]. When no event can mark the end
/// of a use (it could not be created, or the context does not manage stream synchronisation), the
/// use is waited for on the host when it is queued.
///
/// cudarc marks the end of a use with the guard `device_ptr` returns, and skips that when the
/// context holds a recorded error at that moment: while the home context holds one, the free of a
/// buffer used on another stream waits for the whole context, and so does `zero`. So after a call that used the buffer
/// on another stream left an error in the context (`check_err`), synchronise that stream before you
/// take the error out or drop the buffer: the pool can no longer tell once the error is gone (any
/// fallible cudarc call in the context may take it). That includes another thread's call: with
/// several threads in one context, the thread that owns the buffer may never see the error, so a
/// program that sees a cudarc error in such a context should synchronise the context before it
/// frees buffers used on other streams.
///
/// Kernel arguments are tracked only on the home stream: cudarc gives an argument no access to the
/// launch's stream, so pushing one (`launch_builder(..).arg(&buf)`) makes the home stream wait for
/// the buffer's uses on other streams, which orders a launch on the home stream; launch there, or
/// order a launch on another stream yourself. Not tracked: a peer copy from the buffer to memory of
/// another context (`memcpy_dtod` on a stream of that context, which cudarc runs there but reports
/// as a use on the buffer's own stream).
///
/// Each other stream has an event of its own, so uses on several streams at once (from several
/// threads, through `&DeviceBuffer`) are all ordered before the free. A use on the per-thread
/// default stream (`CudaContext::per_thread_stream`, one handle for each thread's stream), or on
/// a stream beyond the first 16 other streams a buffer is used on, is waited for on the host when
/// the cudarc call returns.
#[derive(Debug, Default)]
pub struct CudaUses {
    protocol: Protocol<CudaOps>,
}

/// The protocol's operations over cudarc, none of which touches the context's recorded error.
struct CudaOps;

impl UseOps for CudaOps {
    type Stream = CudaStream;
    type Event = CudaEvent;
    /// The stream's handle, as an address.
    type StreamId = usize;
    type Context = Arc<CudaContext>;

    // One `CudaContext` object, not just one driver context: cudarc keeps a recorded error per
    // object, and the checks for a skipped end of use look at the home stream's. A stream of
    // another object for the same driver context goes the way of another context (waited for on
    // the host).
    fn same_context(&self, a: &CudaStream, b: &CudaStream) -> bool {
        Arc::ptr_eq(a.context(), b.context())
    }

    fn stream_id(&self, stream: &CudaStream) -> Option<usize> {
        // The per-thread default stream's handle names the calling thread's stream: two threads'
        // uses through it are on two streams.
        Some(stream.cu_stream() as usize).filter(|&h| h != PER_THREAD_STREAM)
    }

    fn new_event(&self, stream: &CudaStream) -> Result<CudaEvent, BackendError> {
        new_event(stream.context())
    }

    fn record(&self, event: &CudaEvent, stream: &CudaStream) -> Result<(), BackendError> {
        record_raw(event, stream)
    }

    fn wait(&self, stream: &CudaStream, event: &CudaEvent) -> Result<(), BackendError> {
        wait_raw(stream, event)
    }

    fn sync(&self, stream: &CudaStream) -> Result<(), BackendError> {
        sync_raw(stream)
    }

    fn records_end_of_use(&self, stream: &CudaStream) -> bool {
        stream.context().is_managing_stream_synchronization()
    }

    fn prepare_use(&self, stream: &CudaStream) -> Result<(), BackendError> {
        // cudarc queues the use right after `device_ptr` returns, expecting its context current.
        bind(stream.context())
    }

    fn context_error(&self, ctx: &Arc<CudaContext>) -> Result<(), BackendError> {
        match ctx.check_err() {
            Ok(()) => Ok(()),
            Err(e) => {
                // Put it back: it is the user's.
                ctx.record_err::<()>(Err(e));
                Err(BackendError::new(
                    "cuEventRecord",
                    std::format!("the context holds a recorded error ({e})"),
                ))
            }
        }
    }

    fn context(&self, stream: &CudaStream) -> Arc<CudaContext> {
        stream.context().clone()
    }

    fn in_context(&self, stream: &CudaStream, ctx: &Arc<CudaContext>) -> bool {
        Arc::ptr_eq(stream.context(), ctx)
    }

    fn sync_context(&self, ctx: &Arc<CudaContext>) -> Result<(), BackendError> {
        let current = result::ctx::get_current().map_err(err("cuCtxGetCurrent"))?;
        bind(ctx)?;
        let synced = result::ctx::synchronize().map_err(err("cuCtxSynchronize"));
        if let Some(c) = current.filter(|&c| c != ctx.cu_ctx()) {
            // (A failure to restore it does not undo the wait, which is what the caller relies on;
            // cudarc binds its own context before each call anyway.)
            // SAFETY: `c` was this thread's current context when this call began, and nothing here
            // destroys a context.
            let _ = unsafe { result::ctx::set_current(c) };
        }
        synced
    }
}

/// A new event of `ctx`. cudarc's `new_event` refuses to run while the context holds a recorded
/// error (and takes that error): the error is set aside and put back, so it stays its owner's, and
/// a failure here is only the caller's.
fn new_event(ctx: &Arc<CudaContext>) -> Result<CudaEvent, BackendError> {
    let recorded = ctx.check_err();
    let event = ctx.new_event(None).map_err(err("cuEventCreate"));
    ctx.record_err(recorded);
    event
}

impl CudaUses {
    /// Before a kernel launch that takes the buffer as an argument (on the home stream, if it is to
    /// be ordered).
    fn before_launch(&self, home: &CudaStream) {
        self.protocol.home_waits_for_foreign_uses(&CudaOps, home);
    }

    fn enter<'a>(&'a self, home: &'a CudaStream, other: &'a CudaStream) -> SyncOnDrop<'a> {
        match self.protocol.enter(&CudaOps, home, other) {
            EndOfUse::Nothing => SyncOnDrop::Record(None),
            EndOfUse::Record(event, stream) => SyncOnDrop::Record(Some((event, stream))),
            EndOfUse::Sync(stream) => SyncOnDrop::Sync(Some(stream)),
        }
    }
}

impl<T> DeviceSlice<T> for DeviceBuffer<T, CudaBackend> {
    fn len(&self) -> usize {
        DeviceBuffer::len(self)
    }

    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T> DevicePtr<T> for DeviceBuffer<T, CudaBackend> {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, self.uses.enter(&self.stream, stream))
    }
}

impl<T> DevicePtrMut<T> for DeviceBuffer<T, CudaBackend> {
    fn device_ptr_mut<'a>(
        &'a mut self,
        stream: &'a CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, self.uses.enter(&self.stream, stream))
    }
}

// SAFETY: the argument pushed is a pointer to the buffer's `CUdeviceptr` field, which lives as long
// as the borrow `'b` that outlives the launch builder; the kernel receives a device address of
// `len` values of `T`, as with a `CudaSlice<T>`.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b DeviceBuffer<T, CudaBackend>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b DeviceBuffer<T, CudaBackend>) -> &mut Self {
        arg.uses.before_launch(&arg.stream);
        <Self as PushKernelArg<&'b u64>>::arg(self, &arg.ptr)
    }
}

// SAFETY: as for the shared reference.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b mut DeviceBuffer<T, CudaBackend>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut DeviceBuffer<T, CudaBackend>) -> &mut Self {
        arg.uses.before_launch(&arg.stream);
        <Self as PushKernelArg<&'b u64>>::arg(self, &arg.ptr)
    }
}

impl DevicePool<CudaBackend> {
    /// A pool for device `ordinal` (its primary context). `Err(DriverNotFound)` without a driver,
    /// `Err(NoDevice)` if there is no device `ordinal`, and `Err(Config)` for invalid `options`
    /// (see [`PoolOptions`]).
    pub fn new(ordinal: usize, options: PoolOptions) -> Result<Self, PoolError> {
        if !driver_available() {
            return Err(PoolError::DriverNotFound);
        }
        let ctx = CudaContext::new(ordinal).map_err(no_device(Some(ordinal)))?;
        Self::for_context(ctx, options)
    }

    /// A pool for `ctx` (one pool per context; the pool keeps the context alive).
    pub fn for_context(ctx: Arc<CudaContext>, options: PoolOptions) -> Result<Self, PoolError> {
        Self::with_backend(CudaBackend::new(ctx), options)
    }

    /// One pool per visible device, in ordinal order. `Err(DriverNotFound)` without a driver, an
    /// empty list with a driver but no device.
    pub fn for_all_devices(options: PoolOptions) -> Result<Vec<Self>, PoolError> {
        (0..device_count()?)
            .map(|i| Self::new(i, options))
            .collect()
    }

    /// The pool's context.
    pub fn context(&self) -> Arc<CudaContext> {
        self.inspect_backend(|b| b.context().clone())
    }

    /// A buffer of `len` zeros of `T` on `stream` (the zeroing is queued on `stream`).
    ///
    /// # Errors
    ///
    /// As [`alloc`](DevicePool::alloc), and [`PoolError::Backend`] if the zeroing cannot be
    /// queued (the buffer then goes back to the pool).
    pub fn alloc_zeros<T: ValidAsZeroBits>(
        &self,
        stream: &Arc<CudaStream>,
        len: usize,
    ) -> Result<DeviceBuffer<T>, PoolError> {
        // SAFETY: the contents are overwritten with zeros, a valid `T`, before any read on `stream`.
        let mut buf = unsafe { self.alloc::<T>(stream, len) }?;
        buf.zero()?;
        Ok(buf)
    }

    /// A buffer holding a copy of `src`, copied on `stream`.
    ///
    /// # Errors
    ///
    /// As [`alloc`](DevicePool::alloc), and [`PoolError::Backend`] if the copy cannot be queued
    /// (the buffer then goes back to the pool).
    pub fn clone_htod<T: DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        src: &[T],
    ) -> Result<DeviceBuffer<T>, PoolError> {
        // SAFETY: the whole buffer is overwritten by the copy, queued before any other use on `stream`.
        let buf = unsafe { self.alloc::<T>(stream, src.len()) }?;
        // Through the driver, not cudarc's `memcpy_htod`, which would take the context's recorded
        // error (the user's) first.
        bind(stream.context())?;
        // SAFETY: `buf` holds `src.len()` values of `T` in `stream`'s context (a new buffer: no use
        // to order before the copy), and `src` is a host slice of as many.
        unsafe { result::memcpy_htod_async(buf.ptr, src, stream.cu_stream()) }
            .map_err(|e| PoolError::Backend(err("cuMemcpyHtoDAsync")(e)))?;
        Ok(buf)
    }
}
