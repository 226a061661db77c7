//! A simulated device: addresses without memory, and events that tests complete by hand.
//!
//! [`SimDevice`] is the test's handle on the device; [`SimBackend`] is what the pool owns. Work
//! queued on a [`SimStream`] is a count: a test queues work with [`SimDevice::enqueue`] (a kernel
//! that uses a buffer, say), and each recorded event is one more item. An event is done once the
//! test has completed the stream up to it ([`SimDevice::complete`]) or the pool waited for it
//! (which completes it, as a real wait would).
//!
//! A stream can be made to wait for an event of another stream (`cuStreamWaitEvent`): its later
//! items then complete only after that event, and [`SimDevice::ordered_before`] tells whether one
//! item is ordered before another this way. [`DeviceBuffer::simulate_use`] runs a use of a buffer
//! on any stream through the same protocol as the CUDA back end's `DevicePtr` guards, so tests
//! can check that a block goes to its next owner only after, or ordered after, every use of its
//! previous one. A stream's context is the high 32 bits of its id
//! ([`SimStream::in_context`]); the pool's context is 0. The use protocol sees the whole id, or,
//! after [`SimDevice::set_context_local_stream_ids`], only its low 32 bits, which repeat across
//! contexts (CUDA's stream ids need be unique only within a context).

use core::cell::Cell;
use core::sync::atomic::{AtomicBool as StdAtomicBool, Ordering as StdOrdering};
use std::string::ToString;
use std::sync::{Arc, PoisonError};

use crate::sync::{Mutex, MutexGuard};
use std::vec::Vec;

use super::backend::{BackendError, DeviceBackend, UsesError};
use super::buffer::DeviceBuffer;
use super::uses::{EndOfUse, Protocol, UseOps};
use crate::core::sim::SimSource;
use crate::core::MemorySource;

/// The error of a driver call `op` that a test made fail.
fn failed(op: &'static str) -> BackendError {
    BackendError::new(op, "CUDA_ERROR_LAUNCH_FAILED (simulated)")
}

/// A simulated stream: just an id, whose high 32 bits name its context.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SimStream(pub u64);

impl SimStream {
    /// Stream `n` of context `ctx` (the pool's context is 0: `SimStream(n)`).
    pub const fn in_context(ctx: u32, n: u32) -> SimStream {
        SimStream(((ctx as u64) << 32) | n as u64)
    }

    /// A handle of context `ctx` that stands for CUDA's per-thread default stream, which names the
    /// calling thread's stream: the use protocol cannot tell which stream a use on it ran on. (The
    /// simulator runs it as one stream.)
    pub const fn per_thread(ctx: u32) -> SimStream {
        SimStream::in_context(ctx, u32::MAX)
    }

    /// Its context.
    pub const fn context(self) -> u32 {
        (self.0 >> 32) as u32
    }
}

/// A simulated event: item `seq` of `stream`'s queue (from 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimEvent {
    /// The stream it was recorded on.
    pub stream: u64,
    /// Its sequence number there.
    pub seq: u64,
}

#[derive(Debug)]
struct SimState {
    ordinal: usize,
    cc_major: i32,
    total: usize,
    /// Device memory taken by "other processes" (lowers the free memory reported and available).
    used_by_others: usize,
    addresses: SimSource,
    /// Live allocations: `(ptr, size)`.
    live: Vec<(u64, usize)>,
    streams: Vec<SimStreamState>,
    /// Every allocation size asked of the device, in order.
    requests: Vec<usize>,
    /// Allocations larger than this are refused.
    refuse_above: usize,
    frees: usize,
    event_syncs: usize,
    /// Event queries (`event_done`) so far.
    event_queries: usize,
    device_syncs: usize,
    events_recycled: usize,
    fail_event_record: bool,
    fail_stream_query: bool,
    fail_finish_uses: bool,
    fail_synchronize: bool,
    /// Events of the use protocol, by handle: their latest record `(stream, item)`, if any.
    use_events: Vec<Option<(u64, u64)>>,
    /// Makes the use protocol's event records and waits fail.
    fail_use_ordering: bool,
    fail_prepare_use: bool,
    /// Whether the end of a use is waited for on the host instead of marked by an event (a cudarc
    /// context that does not manage stream synchronisation).
    unmanaged_sync: bool,
    /// Contexts holding a recorded error (cudarc then skips a use guard's record or wait).
    context_errors: Vec<u32>,
    /// Contexts whose synchronisation by the use protocol fails.
    fail_context_syncs: Vec<u32>,
    /// Memsets queued: `(address, bytes)`.
    memsets: Vec<(u64, usize)>,
    /// Makes the pool's event queries and waits fail.
    fail_event_queries: bool,
    /// Creations of use-protocol events (`cuEventCreate`) still to fail (`usize::MAX`: all).
    fail_new_events: usize,
    /// Makes memory queries (`cuMemGetInfo`) fail.
    fail_mem_info: bool,
}

/// Work on one simulated stream. Items are numbered from 1 in queue order and complete in order.
#[derive(Debug)]
struct SimStreamState {
    id: u64,
    /// Items queued so far (work and events).
    queued: u64,
    /// Items completed so far (`<= queued`).
    done: u64,
    /// Events recorded so far.
    events: u64,
    /// Waits for other streams, in queue order: `(after, stream, item)`: the items after item
    /// `after` of this stream complete only after item `item` of `stream`.
    waits: Vec<(u64, u64, u64)>,
}

impl SimState {
    fn stream(&mut self, id: u64) -> &mut SimStreamState {
        let i = match self.streams.iter().position(|s| s.id == id) {
            Some(i) => i,
            None => {
                self.streams.push(SimStreamState {
                    id,
                    queued: 0,
                    done: 0,
                    events: 0,
                    // Room enough that the tests counting the pool's host allocations do not
                    // count the simulator's own.
                    waits: Vec::with_capacity(256),
                });
                self.streams.len() - 1
            }
        };
        &mut self.streams[i]
    }

    fn live_bytes(&self) -> usize {
        self.live.iter().map(|l| l.1).sum()
    }

    /// Items of stream `id` completed (0 for a stream never used).
    fn done(&self, id: u64) -> u64 {
        self.streams
            .iter()
            .find(|s| s.id == id)
            .map_or(0, |s| s.done)
    }

    /// The waits of stream `id` that items up to `n` come after, as `(stream, item)`.
    fn waits_before(&self, id: u64, n: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.streams
            .iter()
            .filter(move |s| s.id == id)
            .flat_map(|s| s.waits.iter())
            .filter(move |w| w.0 < n)
            .map(|w| (w.1, w.2))
    }

    /// How far stream `id` can complete: up to its first wait for an item not yet completed.
    fn completable(&mut self, id: u64) -> u64 {
        let queued = self.stream(id).queued;
        let unmet = self
            .streams
            .iter()
            .filter(|s| s.id == id)
            .find_map(|s| s.waits.iter().find(|w| self.done(w.1) < w.2).map(|w| w.0));
        unmet.map_or(queued, |after| after.min(queued))
    }

    /// Completes stream `id` up to item `n` and, first, everything that waits for (a real wait
    /// for `n` would let the device run it all).
    fn force(&mut self, id: u64, n: u64) {
        let mut todo = std::vec![(id, n)];
        while let Some((id, n)) = todo.pop() {
            let s = self.stream(id);
            let n = n.min(s.queued);
            if s.done >= n {
                continue;
            }
            let open: Vec<(u64, u64)> = self
                .waits_before(id, n)
                .filter(|&(other, item)| self.done(other) < item)
                .collect();
            if open.is_empty() {
                self.stream(id).done = n;
            } else {
                todo.push((id, n));
                todo.extend(open);
            }
        }
    }

    /// Completes every stream of context `ctx` (every stream with `None`).
    fn force_all(&mut self, ctx: Option<u32>) {
        let ids: Vec<u64> = self
            .streams
            .iter()
            .map(|s| s.id)
            .filter(|&id| ctx.is_none_or(|c| SimStream(id).context() == c))
            .collect();
        for id in ids {
            self.force(id, u64::MAX);
        }
    }

    /// Queues one item on `stream`; returns its number.
    fn enqueue(&mut self, stream: u64) -> u64 {
        let s = self.stream(stream);
        s.queued += 1;
        s.queued
    }
}

/// Makes `ctx` a member of the set `list`, or not.
fn set_member(list: &mut Vec<u32>, ctx: u32, member: bool) {
    list.retain(|&c| c != ctx);
    if member {
        list.push(ctx);
    }
}

/// The test's handle on a simulated device (shared with the [`SimBackend`]s made from it).
#[derive(Clone, Debug)]
pub struct SimDevice {
    state: Arc<Mutex<SimState>>,
    /// Whether the use protocol sees stream ids that are unique only within a context (the low
    /// 32 bits of a stream's id), as CUDA allows, so that streams of two contexts share ids. (A
    /// plain atomic outside the state's lock, so that the protocol's id look-ups add no steps to
    /// loom's models, none of which sets it.)
    context_local_stream_ids: Arc<StdAtomicBool>,
}

impl SimDevice {
    /// A device with `total` bytes of memory, ordinal 0, compute capability 8.
    pub fn new(total: usize) -> Self {
        SimDevice::with_ordinal(0, total)
    }

    /// A device with `total` bytes and the given ordinal.
    ///
    /// # Panics
    ///
    /// If `ordinal` is 2^23 or more (device `ordinal`'s addresses start at `(ordinal + 1) * 2^40`;
    /// the bound keeps that base well inside the address space), or if `total` bytes do not fit
    /// above that base (see [`SimSource::new`](crate::core::sim::SimSource::new)).
    pub fn with_ordinal(ordinal: usize, total: usize) -> Self {
        assert!(
            ordinal < 1 << 23,
            "SimDevice: ordinal {ordinal} beyond the simulated address space"
        );
        SimDevice {
            state: Arc::new(Mutex::new(SimState {
                ordinal,
                cc_major: 8,
                total,
                used_by_others: 0,
                // Device-looking addresses, aligned to 1 TiB.
                addresses: SimSource::new((ordinal + 1) << 40, total),
                live: Vec::new(),
                streams: Vec::new(),
                requests: Vec::new(),
                refuse_above: usize::MAX,
                frees: 0,
                event_syncs: 0,
                event_queries: 0,
                device_syncs: 0,
                events_recycled: 0,
                fail_event_record: false,
                fail_stream_query: false,
                fail_finish_uses: false,
                fail_synchronize: false,
                // (Room, as for a stream's waits.)
                use_events: Vec::with_capacity(256),
                fail_use_ordering: false,
                fail_prepare_use: false,
                unmanaged_sync: false,
                context_errors: Vec::new(),
                fail_context_syncs: Vec::new(),
                memsets: Vec::new(),
                fail_event_queries: false,
                fail_new_events: 0,
                fail_mem_info: false,
            })),
            context_local_stream_ids: Arc::new(StdAtomicBool::new(false)),
        }
    }

    fn lock(&self) -> MutexGuard<'_, SimState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A back end for a pool over this device.
    pub fn backend(&self) -> SimBackend {
        SimBackend {
            device: self.clone(),
        }
    }

    /// Sets the compute capability reported (for the default system reserve).
    pub fn set_compute_capability_major(&self, major: i32) {
        self.lock().cc_major = major;
    }

    /// Pretends other processes use `bytes` of the device.
    pub fn set_used_by_others(&self, bytes: usize) {
        self.lock().used_by_others = bytes;
    }

    /// Refuses allocations larger than `bytes`.
    pub fn set_refuse_above(&self, bytes: usize) {
        self.lock().refuse_above = bytes;
    }

    /// Makes recording events fail (to exercise deferred errors).
    pub fn set_fail_event_record(&self, fail: bool) {
        self.lock().fail_event_record = fail;
    }

    /// Queues one item of work on `stream` (it completes with [`complete`](Self::complete)).
    /// Returns its number: the work queued on `stream` so far.
    pub fn enqueue(&self, stream: SimStream) -> u64 {
        self.lock().enqueue(stream.0)
    }

    /// Makes the use protocol's event records and waits fail (`cuEventRecord`,
    /// `cuStreamWaitEvent` in [`DeviceBuffer::simulate_use`] and [`DeviceBuffer::zero`]).
    pub fn set_fail_use_ordering(&self, fail: bool) {
        self.lock().fail_use_ordering = fail;
    }

    /// Makes readying a stream for a use fail (the CUDA back end makes the stream's context
    /// current, `cuCtxSetCurrent`): the use is then not known to be ordered.
    pub fn set_fail_prepare_use(&self, fail: bool) {
        self.lock().fail_prepare_use = fail;
    }

    /// Makes the pool's event queries (`cuEventQuery`) and waits (`cuEventSynchronize`) fail.
    pub fn set_fail_event_queries(&self, fail: bool) {
        self.lock().fail_event_queries = fail;
    }

    /// Makes the use protocol's event creations (`cuEventCreate`) fail, or not.
    pub fn set_fail_new_event(&self, fail: bool) {
        self.lock().fail_new_events = if fail { usize::MAX } else { 0 };
    }

    /// Makes the next `n` event creations of the use protocol (`cuEventCreate`) fail, and later
    /// ones succeed (to make one event of a buffer's record fail, not the others).
    pub fn fail_next_new_events(&self, n: usize) {
        self.lock().fail_new_events = n;
    }

    /// Makes the use protocol see stream ids that are unique only within a context, as CUDA
    /// allows (see `UseOps::stream_id`): stream `n` of every context then has the id `n`, so
    /// [`SimStream::in_context`]`(c, n)` and `SimStream(n)` share one. The simulator itself still
    /// tells them apart.
    pub fn set_context_local_stream_ids(&self, local: bool) {
        self.context_local_stream_ids
            .store(local, StdOrdering::Relaxed);
    }

    /// Makes memory queries (`cuMemGetInfo`) fail, or not.
    pub fn set_fail_mem_info(&self, fail: bool) {
        self.lock().fail_mem_info = fail;
    }

    /// Makes the end of a use on another stream be waited for on the host instead of marked by
    /// an event (as in a cudarc context that does not manage stream synchronisation).
    pub fn set_unmanaged_sync(&self, unmanaged: bool) {
        self.lock().unmanaged_sync = unmanaged;
    }

    /// Makes context `ctx` hold a recorded error, or not: while it does, the end of a use on one
    /// of its streams is not marked (cudarc skips a guard's record or wait).
    pub fn set_context_error(&self, ctx: u32, error: bool) {
        set_member(&mut self.lock().context_errors, ctx, error);
    }

    /// Makes the use protocol's synchronisation of context `ctx` fail, or not.
    pub fn set_fail_context_sync(&self, ctx: u32, fail: bool) {
        set_member(&mut self.lock().fail_context_syncs, ctx, fail);
    }

    /// Whether item `a` (a stream and an item number) is ordered before item `b` on the device:
    /// the same stream and not later, or `b`'s stream waited, before `b`, for an event recorded
    /// after an item ordered after `a`. (Completion is another way to be done before: see
    /// [`completed`](Self::completed).)
    pub fn ordered_before(&self, a: (SimStream, u64), b: (SimStream, u64)) -> bool {
        let st = self.lock();
        let mut todo = std::vec![(b.0 .0, b.1)];
        let mut seen: Vec<(u64, u64)> = Vec::new();
        while let Some((id, n)) = todo.pop() {
            if id == a.0 .0 && a.1 <= n {
                return true;
            }
            if seen.contains(&(id, n)) {
                continue;
            }
            seen.push((id, n));
            todo.extend(st.waits_before(id, n));
        }
        false
    }

    /// Makes stream queries fail (the pool must then treat the stream as busy).
    pub fn set_fail_stream_query(&self, fail: bool) {
        self.lock().fail_stream_query = fail;
    }

    /// Makes ordering a freed buffer's uses on other streams fail (`cuStreamWaitEvent`), also for a
    /// buffer with no such use, on streams 0 to 2. (On other streams, which take stream caches,
    /// the pool does not call `finish_uses` for a buffer with no use on another stream unless
    /// the allocating thread's stream cache is full: see [`DeviceBackend::uses_none`].)
    pub fn set_fail_finish_uses(&self, fail: bool) {
        self.lock().fail_finish_uses = fail;
    }

    /// Makes device-wide synchronisations fail.
    pub fn set_fail_synchronize(&self, fail: bool) {
        self.lock().fail_synchronize = fail;
    }

    /// Completes the work queued on `stream` so far, up to its first wait for work of another
    /// stream that has not completed.
    pub fn complete(&self, stream: SimStream) {
        self.complete_to(stream, u64::MAX);
    }

    /// Completes the work queued on `stream` up to item `n` (at most all of it, and up to its
    /// first wait for work that has not completed).
    pub fn complete_to(&self, stream: SimStream, n: u64) {
        let mut st = self.lock();
        let limit = st.completable(stream.0);
        let s = st.stream(stream.0);
        s.done = s.done.max(n.min(limit));
    }

    /// Completes all work on every stream.
    pub fn complete_all(&self) {
        self.lock().force_all(None);
    }

    /// Items (work and events) queued on `stream` and not yet completed.
    pub fn outstanding(&self, stream: SimStream) -> u64 {
        let mut st = self.lock();
        let s = st.stream(stream.0);
        s.queued - s.done
    }

    /// Events recorded on `stream` so far.
    pub fn recorded(&self, stream: SimStream) -> u64 {
        self.lock().stream(stream.0).events
    }

    /// Items of `stream` queued so far (the last one's number).
    pub fn queued(&self, stream: SimStream) -> u64 {
        self.lock().stream(stream.0).queued
    }

    /// Items of `stream` completed so far (completed ones are a prefix).
    pub fn completed(&self, stream: SimStream) -> u64 {
        self.lock().stream(stream.0).done
    }

    /// Every allocation size asked of the device, in order.
    pub fn requests(&self) -> Vec<usize> {
        self.lock().requests.clone()
    }

    /// Bytes currently allocated from the device.
    pub fn bytes_live(&self) -> usize {
        self.lock().live_bytes()
    }

    /// Number of live device allocations.
    pub fn allocations_live(&self) -> usize {
        self.lock().live.len()
    }

    /// Number of device frees so far.
    pub fn frees(&self) -> usize {
        self.lock().frees
    }

    /// Number of event waits so far.
    pub fn event_syncs(&self) -> usize {
        self.lock().event_syncs
    }

    /// Number of event queries (`cuEventQuery`) so far.
    pub fn event_queries(&self) -> usize {
        self.lock().event_queries
    }

    /// Number of device-wide synchronisations so far.
    pub fn device_syncs(&self) -> usize {
        self.lock().device_syncs
    }

    /// The memsets queued so far, `(address, bytes)`, in order.
    pub fn memsets(&self) -> Vec<(u64, usize)> {
        self.lock().memsets.clone()
    }

    /// Number of events the pool handed back for reuse so far.
    pub fn events_recycled(&self) -> usize {
        self.lock().events_recycled
    }
}

/// The pool's side of a [`SimDevice`].
#[derive(Debug)]
pub struct SimBackend {
    device: SimDevice,
}

impl SimBackend {
    /// The device this back end drives.
    pub fn device(&self) -> &SimDevice {
        &self.device
    }
}

// SAFETY: memory comes from a `SimSource` over a fixed, non-wrapping address range (disjoint live
// regions, freed once); streams, events and waits are answered from the simulated queues, which
// count an item done only once completed or forced; nothing here calls into the pool.
unsafe impl DeviceBackend for SimBackend {
    type Stream = SimStream;
    type Event = SimEvent;
    type Uses = SimUses;

    fn ordinal(&self) -> usize {
        self.device.lock().ordinal
    }

    fn compute_capability_major(&self) -> Result<i32, BackendError> {
        Ok(self.device.lock().cc_major)
    }

    fn mem_info(&mut self) -> Result<(usize, usize), BackendError> {
        let st = self.device.lock();
        if st.fail_mem_info {
            return Err(failed("cuMemGetInfo"));
        }
        let used = st.live_bytes() + st.used_by_others;
        Ok((st.total.saturating_sub(used), st.total))
    }

    fn mem_alloc(&mut self, bytes: usize) -> Result<u64, BackendError> {
        let mut st = self.device.lock();
        st.requests.push(bytes);
        let free = st.total.saturating_sub(st.live_bytes() + st.used_by_others);
        if bytes > st.refuse_above || bytes > free || bytes == 0 {
            return Err(BackendError::new(
                "cuMemAlloc",
                "CUDA_ERROR_OUT_OF_MEMORY (simulated)",
            ));
        }
        match st.addresses.alloc_region(bytes, 512) {
            Some(p) => {
                st.live.push((p as u64, bytes));
                Ok(p as u64)
            }
            None => Err(BackendError::new(
                "cuMemAlloc",
                "CUDA_ERROR_OUT_OF_MEMORY (simulated, fragmented)",
            )),
        }
    }

    unsafe fn mem_free(&mut self, ptr: u64) -> Result<(), BackendError> {
        let mut st = self.device.lock();
        let Some(i) = st.live.iter().position(|l| l.0 == ptr) else {
            return Err(BackendError::new(
                "cuMemFree",
                "CUDA_ERROR_INVALID_VALUE (simulated)".to_string(),
            ));
        };
        let (p, size) = st.live.swap_remove(i);
        // SAFETY: `(p, size)` is a live region of the address source, freed once (removed above).
        unsafe { st.addresses.free_region(p as usize, size) };
        st.frees += 1;
        Ok(())
    }

    /// Refuses what the CUDA back end refuses: a stream of another context, and the per-thread
    /// default stream.
    fn check_stream(&self, stream: &SimStream) -> Result<(), BackendError> {
        if stream.context() != 0 {
            Err(BackendError::new(
                "DevicePool::alloc",
                "the stream belongs to another context than the pool's: allocate on a stream of \
                 the pool's context (DevicePool::context), or use that context's own pool",
            ))
        } else if *stream == SimStream::per_thread(0) {
            Err(BackendError::new(
                "DevicePool::alloc",
                "per-thread default streams are not supported: use another stream of the context",
            ))
        } else {
            Ok(())
        }
    }

    fn stream_id(stream: &SimStream) -> u64 {
        stream.0
    }

    /// Equal streams, except the per-thread handle ([`SimStream::per_thread`]) and streams 0 to 2
    /// of each context, which the simulator keeps on the pool's lock alone (so that tests run
    /// both paths). Every other stream takes a stream cache.
    fn same_stream(a: &SimStream, b: &SimStream) -> bool {
        let n = a.0 as u32;
        a == b && n > 2 && n != u32::MAX
    }

    /// Equal values: a simulated stream handle is a number, which owns nothing.
    fn same_handle(a: &SimStream, b: &SimStream) -> bool {
        a == b
    }

    fn uses_none(uses: &SimUses) -> bool {
        uses.protocol.is_unused()
    }

    fn stream_done(&mut self, stream: &SimStream) -> Result<bool, BackendError> {
        let mut st = self.device.lock();
        if st.fail_stream_query {
            return Err(failed("cuStreamQuery"));
        }
        let s = st.stream(stream.0);
        Ok(s.done == s.queued)
    }

    fn record_event(&mut self, stream: &SimStream) -> Result<SimEvent, BackendError> {
        let mut st = self.device.lock();
        if st.fail_event_record {
            return Err(failed("cuEventRecord"));
        }
        let s = st.stream(stream.0);
        s.queued += 1;
        s.events += 1;
        Ok(SimEvent {
            stream: stream.0,
            seq: s.queued,
        })
    }

    fn event_done(&mut self, event: &SimEvent) -> Result<bool, BackendError> {
        let mut st = self.device.lock();
        st.event_queries += 1;
        if st.fail_event_queries {
            return Err(failed("cuEventQuery"));
        }
        Ok(st.stream(event.stream).done >= event.seq)
    }

    fn event_sync(&mut self, event: &SimEvent) -> Result<(), BackendError> {
        let mut st = self.device.lock();
        if st.fail_event_queries {
            return Err(failed("cuEventSynchronize"));
        }
        st.event_syncs += 1;
        st.force(event.stream, event.seq);
        Ok(())
    }

    fn recycle_event(&mut self, _event: SimEvent) {
        self.device.lock().events_recycled += 1;
    }

    fn synchronize(&mut self) -> Result<(), BackendError> {
        let mut st = self.device.lock();
        if st.fail_synchronize {
            return Err(failed("cuCtxSynchronize"));
        }
        st.device_syncs += 1;
        // `cuCtxSynchronize`: the pool's context (0) only.
        st.force_all(Some(0));
        Ok(())
    }

    unsafe fn memset_zero(
        &mut self,
        stream: &SimStream,
        uses: &SimUses,
        ptr: u64,
        bytes: usize,
    ) -> Result<(), BackendError> {
        uses.protocol.before_home_use(&self.device, stream)?;
        let mut st = self.device.lock();
        st.enqueue(stream.0);
        st.memsets.push((ptr, bytes));
        Ok(())
    }

    fn finish_uses(&mut self, stream: &SimStream, uses: &SimUses) -> Result<(), UsesError> {
        let fail = self.device.lock().fail_finish_uses;
        // The protocol runs as the CUDA back end's does, up to its first stream wait, which fails
        // (nothing is waited for, no mark is recorded): uses in another context are waited for, or
        // reported as unbounded, before any stream wait.
        FAILING_FINISH.with(|f| f.set(fail));
        let r = uses.protocol.finish(&self.device, stream);
        FAILING_FINISH.with(|f| f.set(false));
        r?;
        if fail {
            // No stream wait was needed: the failure is reported anyway (the switch's contract).
            return Err(failed("cuStreamWaitEvent").into());
        }
        Ok(())
    }
}

std::thread_local! {
    /// Set while this thread's `finish_uses` runs with `fail_finish_uses` on: the protocol's stream
    /// waits fail on this thread only, so another thread's uses and frees go on as usual. (Loom
    /// threads share one OS thread; no model turns the switch on.)
    static FAILING_FINISH: Cell<bool> = const { Cell::new(false) };
}

/// The simulated device's record of a buffer's uses on other streams (the same protocol as
/// [`CudaUses`](super::CudaUses)).
#[derive(Debug, Default)]
pub struct SimUses {
    protocol: Protocol<SimDevice>,
}

/// A use-protocol event: an index into the device's table of their latest records.
#[derive(Debug)]
pub(crate) struct SimUseEvent(usize);

impl UseOps for SimDevice {
    type Stream = SimStream;
    type Event = SimUseEvent;
    type StreamId = u64;
    type Context = u32;

    fn same_context(&self, a: &SimStream, b: &SimStream) -> bool {
        a.context() == b.context()
    }

    fn stream_id(&self, stream: &SimStream) -> Option<u64> {
        let id = if self.context_local_stream_ids.load(StdOrdering::Relaxed) {
            stream.0 & u64::from(u32::MAX)
        } else {
            stream.0
        };
        (*stream != SimStream::per_thread(stream.context())).then_some(id)
    }

    fn new_event(&self, _: &SimStream) -> Result<SimUseEvent, BackendError> {
        let mut st = self.lock();
        if st.fail_new_events > 0 {
            if st.fail_new_events != usize::MAX {
                st.fail_new_events -= 1;
            }
            return Err(failed("cuEventCreate"));
        }
        st.use_events.push(None);
        Ok(SimUseEvent(st.use_events.len() - 1))
    }

    fn record(&self, event: &SimUseEvent, stream: &SimStream) -> Result<(), BackendError> {
        let mut st = self.lock();
        if st.fail_use_ordering {
            return Err(failed("cuEventRecord"));
        }
        let item = st.enqueue(stream.0);
        st.stream(stream.0).events += 1;
        st.use_events[event.0] = Some((stream.0, item));
        Ok(())
    }

    fn wait(&self, stream: &SimStream, event: &SimUseEvent) -> Result<(), BackendError> {
        let mut st = self.lock();
        if st.fail_use_ordering || FAILING_FINISH.with(Cell::get) {
            return Err(failed("cuStreamWaitEvent"));
        }
        // Waiting for an event never recorded waits for nothing, as in CUDA.
        if let Some((other, item)) = st.use_events[event.0] {
            let s = st.stream(stream.0);
            let after = s.queued;
            s.waits.push((after, other, item));
        }
        Ok(())
    }

    fn sync(&self, stream: &SimStream) -> Result<(), BackendError> {
        self.lock().force(stream.0, u64::MAX);
        Ok(())
    }

    fn records_end_of_use(&self, _: &SimStream) -> bool {
        !self.lock().unmanaged_sync
    }

    fn prepare_use(&self, _: &SimStream) -> Result<(), BackendError> {
        if self.lock().fail_prepare_use {
            return Err(failed("cuCtxSetCurrent"));
        }
        Ok(())
    }

    fn context_error(&self, ctx: &u32) -> Result<(), BackendError> {
        if self.lock().context_errors.contains(ctx) {
            return Err(BackendError::new(
                "cuEventRecord",
                "the context holds a recorded error (simulated)",
            ));
        }
        Ok(())
    }

    fn context(&self, stream: &SimStream) -> u32 {
        stream.context()
    }

    fn in_context(&self, stream: &SimStream, ctx: &u32) -> bool {
        stream.context() == *ctx
    }

    fn sync_context(&self, ctx: &u32) -> Result<(), BackendError> {
        let mut st = self.lock();
        if st.fail_context_syncs.contains(ctx) {
            return Err(failed("cuCtxSynchronize"));
        }
        st.force_all(Some(*ctx));
        Ok(())
    }
}

impl<T> DeviceBuffer<T, SimBackend> {
    /// Simulates a use of the buffer on `stream`, as the CUDA back end's `DevicePtr::device_ptr`
    /// guard orders one around a cudarc call: the ordering before the use, one item of work on
    /// `stream` (returned: its number there), then the end of the use as cudarc's guard would end
    /// it (skipped while `stream`'s context holds an error, see
    /// [`SimDevice::set_context_error`]). The same as [`begin_use`](Self::begin_use) with the
    /// guard dropped at once.
    pub fn simulate_use(&self, stream: SimStream) -> u64 {
        self.begin_use(&stream).item()
    }

    /// Simulates a kernel launch on the buffer's home stream that takes the buffer as an argument,
    /// as the CUDA back end's `PushKernelArg` orders one (the home stream waits for the uses on
    /// other streams), and returns its item of work there.
    pub fn simulate_launch(&self) -> u64 {
        let device = self.sim_device();
        self.uses
            .protocol
            .home_waits_for_foreign_uses(&device, &self.stream);
        device.enqueue(*self.stream)
    }

    /// Starts a simulated use of the buffer on `stream` and returns its guard, as cudarc's
    /// `DevicePtr::device_ptr` does: the ordering before the use and one item of work on `stream`
    /// are queued now, and the end of the use (an event recorded after it, or a wait on the host)
    /// when the guard drops. Holding guards of several streams at once is what two threads using
    /// one buffer at the same time do.
    pub fn begin_use<'a>(&'a self, stream: &'a SimStream) -> SimUse<'a> {
        let device = self.sim_device();
        let end = self.uses.protocol.enter(&device, &self.stream, stream);
        let item = device.enqueue(*stream);
        SimUse { device, end, item }
    }

    /// The simulated device of the buffer's pool.
    fn sim_device(&self) -> SimDevice {
        self.shared().with_backend(|b| b.device().clone())
    }
}

/// A simulated use of a buffer in progress ([`DeviceBuffer::begin_use`]): ends when dropped.
pub struct SimUse<'a> {
    device: SimDevice,
    end: EndOfUse<'a, SimDevice>,
    item: u64,
}

impl SimUse<'_> {
    /// The use's item of work: its number on its stream.
    pub fn item(&self) -> u64 {
        self.item
    }
}

impl Drop for SimUse<'_> {
    fn drop(&mut self) {
        let device = &self.device;
        match self.end {
            EndOfUse::Nothing => {}
            // cudarc skips the guard's record or wait while the stream's context holds an error.
            EndOfUse::Record(event, s) => {
                let skipped = device.lock().context_errors.contains(&s.context());
                if !skipped && device.records_end_of_use(s) {
                    let _ = device.record(event, s);
                }
            }
            EndOfUse::Sync(s) => {
                if !device.lock().context_errors.contains(&s.context()) {
                    let _ = device.sync(s);
                }
            }
        }
    }
}

impl core::fmt::Debug for SimUse<'_> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("SimUse")
            .field("item", &self.item)
            .finish_non_exhaustive()
    }
}
