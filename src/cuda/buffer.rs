//! Typed device buffers that return to their pool on drop.

use core::marker::PhantomData;
use core::mem::ManuallyDrop;

use super::backend::DeviceBackend;
use super::pool::{DevicePool, PoolRef, Shared};

/// `len` values of `T` in device memory from a [`DevicePool`], for use on one stream (its *home*
/// stream, the one it was allocated on). Dropping it frees the block, ordered after the work queued
/// on the home stream (see the [module documentation](super)).
///
/// With the CUDA back end it implements cudarc's `DeviceSlice`, `DevicePtr` and `DevicePtrMut`, so
/// `stream.memcpy_htod(&host, &mut buf)` and `stream.memcpy_dtoh(&buf, &mut host)` accept it like a
/// `CudaSlice`, and copies on other streams are ordered ([`CudaUses`](super::CudaUses)).
/// `stream.launch_builder(&f).arg(&buf)` accepts it too. cudarc does not tell an argument the
/// launch's stream: pushing one makes the home stream wait for the buffer's uses on other streams,
/// which orders a launch on the home stream; order a launch on another stream yourself.
pub struct DeviceBuffer<T, B: DeviceBackend = super::CudaBackend> {
    /// Device address. A field (not computed) so that `&ptr` can be a kernel argument.
    pub(crate) ptr: u64,
    len: usize,
    /// Bytes of the block (at least `len * size_of::<T>()`).
    size: usize,
    /// Taken by the pool when the buffer is dropped.
    pub(crate) stream: ManuallyDrop<B::Stream>,
    pub(crate) uses: B::Uses,
    pool: PoolRef<B>,
    _elem: PhantomData<fn() -> T>,
}

impl<T, B: DeviceBackend> DeviceBuffer<T, B> {
    pub(crate) fn new(
        ptr: u64,
        len: usize,
        size: usize,
        stream: B::Stream,
        uses: B::Uses,
        pool: PoolRef<B>,
    ) -> Self {
        DeviceBuffer {
            ptr,
            len,
            size,
            stream: ManuallyDrop::new(stream),
            uses,
            pool,
            _elem: PhantomData,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of the elements: `len * size_of::<T>()`.
    pub fn num_bytes(&self) -> usize {
        self.len * core::mem::size_of::<T>()
    }

    /// Bytes of the underlying block (a multiple of the 256-byte granule).
    pub fn block_size(&self) -> usize {
        self.size
    }

    /// The device address. Using it on a stream other than [`home_stream`](Self::home_stream) is
    /// only ordered if you order it (or go through `DevicePtr::device_ptr`, which does).
    pub fn device_address(&self) -> u64 {
        self.ptr
    }

    /// The stream the buffer was allocated on, after whose work its memory is freed.
    pub fn home_stream(&self) -> &B::Stream {
        &self.stream
    }

    /// The pool the buffer belongs to (a new handle).
    pub fn pool(&self) -> DevicePool<B> {
        self.pool.handle()
    }

    /// The pool, without a new handle.
    pub(crate) fn shared(&self) -> &Shared<B> {
        self.pool.get()
    }

    /// Queues on the home stream a write of zeros to the whole block, after the buffer's last use
    /// on another stream (see [`CudaUses`](super::CudaUses)). On failure no write is queued (the
    /// home stream may already wait for some of those uses). Only for element types whose all-zero
    /// bit pattern is a valid value.
    pub fn zero(&mut self) -> Result<(), super::PoolError>
    where
        T: cudarc::driver::ValidAsZeroBits,
    {
        let (stream, uses, ptr, size) = (&self.stream, &self.uses, self.ptr, self.size);
        self.shared()
            // SAFETY: `[ptr, ptr + size)` is this buffer's block, whose home stream is `stream`
            // and whose uses `uses` records.
            .with_backend(|b| unsafe { b.memset_zero(stream, uses, ptr, size) })
            .map_err(Into::into)
    }
}

impl<T, B: DeviceBackend> Drop for DeviceBuffer<T, B> {
    fn drop(&mut self) {
        // SAFETY: the handle is taken once, here, and the field is not used (nor, being
        // `ManuallyDrop`, dropped) afterwards.
        let stream = unsafe { ManuallyDrop::take(&mut self.stream) };
        // The pool keeps the handle if the block's queue needs one (a free of a pool hit swaps it
        // for the queue's own, with no count changed beyond the buffer's own drop).
        // SAFETY: the buffer was counted in the pool when it was allocated on its home stream
        // (`stream`), this is its one free, and `self.pool` is not used afterwards.
        unsafe {
            Shared::free_block(
                self.pool.as_ptr(),
                self.pool.cache(),
                self.ptr,
                self.size,
                stream,
                &self.uses,
            );
        }
    }
}

impl<T, B: DeviceBackend> core::fmt::Debug for DeviceBuffer<T, B> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("block_size", &self.size)
            .finish_non_exhaustive()
    }
}
