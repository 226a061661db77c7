//! A simulated device: addresses without memory, and events that tests complete by hand.
//!
//! [`SimDevice`] is the test's handle on the device; [`SimBackend`] is what the pool owns. Work
//! queued on a [`SimStream`] is a count: a test queues work with [`SimDevice::enqueue`] (a kernel
//! that uses a buffer, say), and each recorded event is one more item. An event is done once the
//! test has completed the stream up to it ([`SimDevice::complete`]) or the pool waited for it
//! (which completes it, as a real wait would).

use std::string::ToString;
use std::sync::{Arc, PoisonError};

use crate::sync::{Mutex, MutexGuard};
use std::vec::Vec;

use super::backend::{BackendError, DeviceBackend};
use crate::core::sim::SimSource;
use crate::core::MemorySource;

/// The error of a driver call `op` that a test made fail.
fn failed(op: &'static str) -> BackendError {
    BackendError::new(op, "CUDA_ERROR_LAUNCH_FAILED (simulated)")
}

/// A simulated stream: just an id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SimStream(pub u64);

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
    device_syncs: usize,
    events_recycled: usize,
    fail_event_record: bool,
    fail_stream_query: bool,
    fail_finish_uses: bool,
    fail_synchronize: bool,
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
                });
                self.streams.len() - 1
            }
        };
        &mut self.streams[i]
    }

    fn live_bytes(&self) -> usize {
        self.live.iter().map(|l| l.1).sum()
    }
}

/// The test's handle on a simulated device (shared with the [`SimBackend`]s made from it).
#[derive(Clone, Debug)]
pub struct SimDevice {
    state: Arc<Mutex<SimState>>,
}

impl SimDevice {
    /// A device with `total` bytes of memory, ordinal 0, compute capability 8.
    pub fn new(total: usize) -> Self {
        SimDevice::with_ordinal(0, total)
    }

    /// A device with `total` bytes and the given ordinal.
    pub fn with_ordinal(ordinal: usize, total: usize) -> Self {
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
                device_syncs: 0,
                events_recycled: 0,
                fail_event_record: false,
                fail_stream_query: false,
                fail_finish_uses: false,
                fail_synchronize: false,
            })),
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
        let mut st = self.lock();
        let s = st.stream(stream.0);
        s.queued += 1;
        s.queued
    }

    /// Makes stream queries fail (the pool must then treat the stream as busy).
    pub fn set_fail_stream_query(&self, fail: bool) {
        self.lock().fail_stream_query = fail;
    }

    /// Makes ordering a freed buffer's uses on other streams fail (`cuStreamWaitEvent`).
    pub fn set_fail_finish_uses(&self, fail: bool) {
        self.lock().fail_finish_uses = fail;
    }

    /// Makes device-wide synchronisations fail.
    pub fn set_fail_synchronize(&self, fail: bool) {
        self.lock().fail_synchronize = fail;
    }

    /// Completes all work queued on `stream` so far.
    pub fn complete(&self, stream: SimStream) {
        let mut st = self.lock();
        let s = st.stream(stream.0);
        s.done = s.queued;
    }

    /// Completes the work queued on `stream` up to item `n` (at most all of it).
    pub fn complete_to(&self, stream: SimStream, n: u64) {
        let mut st = self.lock();
        let s = st.stream(stream.0);
        s.done = s.done.max(n.min(s.queued));
    }

    /// Completes all work on every stream.
    pub fn complete_all(&self) {
        for s in self.lock().streams.iter_mut() {
            s.done = s.queued;
        }
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

    /// Number of device-wide synchronisations so far.
    pub fn device_syncs(&self) -> usize {
        self.lock().device_syncs
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

impl DeviceBackend for SimBackend {
    type Stream = SimStream;
    type Event = SimEvent;
    type Uses = ();

    fn ordinal(&self) -> usize {
        self.device.lock().ordinal
    }

    fn compute_capability_major(&self) -> Result<i32, BackendError> {
        Ok(self.device.lock().cc_major)
    }

    fn mem_info(&mut self) -> Result<(usize, usize), BackendError> {
        let st = self.device.lock();
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

    fn check_stream(&self, _stream: &SimStream) -> Result<(), BackendError> {
        Ok(())
    }

    fn stream_id(stream: &SimStream) -> u64 {
        stream.0
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
        Ok(st.stream(event.stream).done >= event.seq)
    }

    fn event_sync(&mut self, event: &SimEvent) -> Result<(), BackendError> {
        let mut st = self.device.lock();
        st.event_syncs += 1;
        let s = st.stream(event.stream);
        s.done = s.done.max(event.seq);
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
        for s in st.streams.iter_mut() {
            s.done = s.queued;
        }
        Ok(())
    }

    unsafe fn memset_zero(_: &SimStream, _: u64, _: usize) -> Result<(), BackendError> {
        Ok(())
    }

    fn finish_uses(&mut self, _: &SimStream, _: &()) -> Result<(), BackendError> {
        if self.device.lock().fail_finish_uses {
            return Err(failed("cuStreamWaitEvent"));
        }
        Ok(())
    }
}
