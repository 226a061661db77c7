//! A BFC pool over CUDA device memory (feature `cuda`).
//!
//! One [`DevicePool`] per device (context) runs the same engine as the host allocator, with
//! TensorFlow's device settings: a 256-byte granule, regions from the driver (`cuMemAlloc`) that
//! start at 2 MiB and double (or one region of the whole limit up front), a 0.9 back-off when the
//! driver refuses a size (16 steps at most, then halving down to the request, so a device out of
//! memory is asked about 40 times per growth where TensorFlow asks about 150), and a limit on the memory taken ([`MemoryLimit`]: TensorFlow's default of
//! the free memory minus a [system reserve](min_system_memory), a fraction of the total, or bytes).
//! Chunk metadata stays in host memory; the pool never touches device memory itself.
//!
//! ```text
//! DeviceBackend (cuMemAlloc/cuMemFree, events) --regions--> Bfc --blocks--> DeviceBuffer<T>
//!                                                            ^                    | drop on stream A
//!                                      event on A completed  |                    v
//!                                          pending list: (block, stream A, no event yet | event)
//! ```
//!
//! # Stream model
//!
//! Every [`DeviceBuffer`] has a *home stream*, the one it was allocated on. Device work is
//! asynchronous, so when a buffer is dropped, work queued on its home stream may still read or write
//! it. The pool therefore does not return the block to the engine at once:
//!
//! 1. On drop, the block goes to a *pending list*, tagged with its stream A and no event (*open*).
//!    As a rule the drop records no event. Its driver calls, if any, order the buffer's uses on
//!    other streams (an event on A marks them), poll pending events, or close A's open blocks,
//!    this one included, once more than [`OPEN_LIMIT`] pile up (see 3: one event for all of them
//!    if A is busy).
//! 2. An allocation on the same stream A may take a fitting pending block of A immediately: its work
//!    is queued before anything the new owner queues on A, so stream order protects it.
//!
//!    *Stream caches.* 1 and 2 first go through the calling thread's stream cache: there are 64
//!    per pool, each with a lock of its own and room for 16 open blocks of any streams; a thread
//!    takes one that no live thread holds and gives it back when it exits (so up to 64 threads
//!    alive at once have one each). A free of a buffer never used on
//!    another stream puts its block in the cache of the thread that allocated it, and an
//!    allocation takes a fitting block of its stream from its thread's cache (a block freed
//!    through a handle of the same stream and context: the null and legacy handles are the same
//!    in every context), without the pool's lock, so threads allocating at once, on their own
//!    streams or on one, do not wait for each other. What does not fit in the cache, and every
//!    free of a buffer used on another stream, takes the pool's lock as before. A free that finds
//!    the cache full (under the pool's lock) goes to its stream's queue, unless the cache's oldest
//!    block is stale (64 frees came for the cache after it): then it takes that one's place, and
//!    that one goes to its own stream's queue. So a thread that moved on to another stream or to
//!    other sizes, or took the cache of a thread that exited, gets its cache back after a few
//!    dozen frees, and a thread that cycles through more blocks than the cache holds keeps
//!    hitting on those it has. An allocation on the lock
//!    leaves the thread's cache alone (none of its blocks fits), unless the engine has no free
//!    chunk for it: then it moves the blocks in every thread's cache to their queues, takes a
//!    fitting block of its own stream from there without an event or a wait, and closes the
//!    streams of the blocks it moved (3). What below closes a stream's open blocks for other
//!    streams (3, 5), and the statistics, include those in every cache; the stream's own miss
//!    closes those in its queue, and [`OPEN_LIMIT`] counts those in its queue (so a stream used by
//!    many threads may hold up to 16 more open blocks in each of their caches). A buffer is
//!    counted in its thread's cache, which holds the pool for it while it counts any (the pool
//!    goes with the last of its handles and buffers), and a hit through a clone of the handle its
//!    block was freed on keeps that clone, so a hit and its free write no counter that several
//!    threads share.
//! 3. A's open blocks (and those whose event could not be recorded) are *closed* together: if A is
//!    idle (all its queued work has finished), every pending block of A goes straight back to the
//!    engine; otherwise one event is recorded on A for all of them. This happens: when A misses
//!    (none of its pending blocks fits a request); when a stream misses and the engine has no free
//!    chunk for it, if some of A's open blocks came out of a stream cache for that miss or (unless
//!    the missing stream's own blocks from the caches served it) one of A's open blocks is large
//!    enough; when A has more than [`OPEN_LIMIT`] open blocks; and on
//!    [`trim`](DevicePool::trim), [`synchronize`](DevicePool::synchronize), out-of-memory and the
//!    pool's drop. An event recorded
//!    later than the free covers all the work queued before it, so this only delays the release.
//! 4. A closed block goes back to the engine, for every stream, once its event has completed.
//!    Pending events are polled on every allocation and free that takes the pool's lock: the
//!    oldest unfinished event of up to 4 streams per poll, in turn (a stream's events complete in order),
//!    so that a thousand busy streams do not cost every call a thousand queries; an allocation
//!    that no free chunk can serve, and a trim, poll every stream's.
//! 5. Before reporting out-of-memory, the pool waits for every pending block's work, returns them
//!    all, and tries again: from the returned blocks if they fit, and otherwise after giving fully
//!    free regions back to the driver to grow by a region that fits.
//!
//! A stream that allocates and frees the same sizes in a loop is served with no driver call while
//! no closed block is pending (and, on a stream with a cache, with no lock but its cache's).
//! Memory freed on a stream that stops allocating stays its own until one of the events in 3 (at
//! most [`OPEN_LIMIT`] blocks per stream in its queue and 16 per stream cache, and never past the
//! pool's limit: out-of-memory waits for them). Pending blocks keep their stream handle alive (so does a
//! stream's queue left empty once they were taken or came back, until [`DevicePool::trim`],
//! [`DevicePool::synchronize`], or a call while more than 16 streams have queues); a stream that
//! cudarc does not own (`CudaContext::wrap_borrowed_stream`) must outlive them: call
//! [`DevicePool::synchronize`] before destroying it.
//!
//! Per-thread default streams (`CudaContext::per_thread_stream`) are refused: their one handle
//! names a different stream on every thread.
//!
//! Like cudarc's own calls, the pool's driver calls (in an allocation, a buffer's drop, a use on
//! another stream) make the pool's context, or the stream's, current on the calling thread and
//! leave it current. cudarc binds its context before each call, so only code that calls the
//! driver directly notices: with pools on two devices, set the context you need before such a
//! call.
//!
//! Stream capture (CUDA graphs) is not supported: the pool queries streams and events, allocates
//! from the driver and records events as it goes, which a capturing stream refuses (and a capture
//! in the global mode can be invalidated by), and a block freed during a capture would be reused
//! before the graph replays. (A hit or a free through a stream cache makes no driver call, so a
//! capturing stream does not even refuse it.) Allocate the buffers a graph uses before capturing
//! it, and free them after its last replay.
//!
//! Uses on other streams are ordered when they go through cudarc's `DevicePtr::device_ptr` /
//! `DevicePtrMut::device_ptr_mut` (as `memcpy_*` do): the other stream first waits for the home
//! stream, and the home stream waits for that use before the free is recorded and before
//! [`DeviceBuffer::zero`] ([`CudaUses`]). A stream of another context is waited for on the host
//! instead, around the use. A kernel argument makes the home stream wait for the uses on other
//! streams, which orders a launch on the home stream. A raw
//! address ([`DeviceBuffer::device_address`]), a kernel argument on another stream, or a peer copy
//! to another context's memory (`memcpy_dtod` on that context's stream) is yours to order. If you
//! order it by making the home stream wait for an event recorded after the use, queue some work on
//! the home stream after that wait (or wait for the use on the host) before dropping the buffer:
//! the pool returns an idle stream's freed blocks without an event, and CUDA does not document
//! that a stream query counts a wait as work (driver 580 does; a GPU test checks it).
//!
//! # Errors
//!
//! Nothing panics when the driver is missing: [`DevicePool::new`] and
//! [`DevicePool::for_all_devices`] return [`PoolError::DriverNotFound`] ([`driver_available`] tells
//! beforehand). Out-of-memory is [`PoolError::OutOfMemory`] with a [`DeviceOom`]: requested bytes,
//! in use, reserved, limit, device total and free, the largest free block and the engine's per-bin
//! summary. Driver errors where none can be returned (a failed event record or query while
//! ordering frees, a failed `cuMemFree`) are recorded and returned later by
//! [`DevicePool::take_errors`] / [`DevicePool::check_err`]; a block whose free could not be ordered
//! by an event waits for the next close of its stream or a device-wide synchronisation instead. A
//! free whose uses on other streams could not be ordered waits for the whole device, and if even
//! that fails, its block is never handed out again ([`DeviceStats::stranded_bytes`]).
//!
//! # Testing without a GPU
//!
//! All of the above is written against [`DeviceBackend`]; [`SimBackend`] simulates a device
//! (addresses only) with events that tests complete by hand, so the whole pool is tested on the CPU.
//! The ordering of uses on other streams is one protocol for both back ends ([`CudaUses`],
//! [`SimUses`]); the simulated streams record what waits for what
//! ([`SimDevice::ordered_before`]), and [`DeviceBuffer::simulate_use`] runs a use through it.
//!
//! ```no_run
//! use bfc_alloc::cuda::{DevicePool, PoolOptions};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = DevicePool::new(0, PoolOptions::default())?;
//! let stream = pool.context().default_stream();
//! let buf = pool.clone_htod(&stream, &[1.0f32, 2.0, 3.0])?;
//! let back = stream.clone_dtoh(&buf)?;
//! assert_eq!(back, [1.0, 2.0, 3.0]);
//! println!("{}", pool.stats());
//! # Ok(())
//! # }
//! ```

mod backend;
mod buffer;
mod driver;
mod error;
mod pool;
mod sim;
mod source;
mod uses;

pub use backend::{BackendError, DeviceBackend, UsesError};
pub use buffer::DeviceBuffer;
pub use driver::{device_count, driver_available, CudaBackend, CudaUses};
pub use error::{DeviceOom, DeviceStats, PoolError};
pub use pool::{min_system_memory, DevicePool, MemoryLimit, PoolOptions, GRANULE, OPEN_LIMIT};
pub use sim::{SimBackend, SimDevice, SimEvent, SimStream, SimUse, SimUses};
