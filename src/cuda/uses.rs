//! Ordering a buffer's uses on streams other than its home stream, over any back end.
//!
//! The protocol is written once, against [`UseOps`], so that the CUDA back end
//! ([`CudaUses`](super::CudaUses), through cudarc's `DevicePtr` guards) and the simulated device
//! ([`SimUses`](super::SimUses), whose streams track what waits for what) run the same code:
//!
//! - before a use on another stream of the home stream's context, that stream waits for the work
//!   queued so far on the home stream (an event `before`, recorded on the home stream);
//! - after it, an event of that other stream's own is recorded there (one event per other
//!   stream, so that uses on two streams at once, by two threads, each leave their own mark), and
//!   the home stream waits for every such event before the buffer's free is ordered
//!   ([`Protocol::finish`], which then records an event on the home stream: a stream query need
//!   not count a wait as work), before the next use on yet another stream, and before later uses
//!   on the home stream that go through the protocol ([`Protocol::before_home_use`]);
//! - a use on a stream of another context (events cannot cross contexts) is waited for on the
//!   host: the home stream before the use, and the use when its guard ends;
//! - when an event cannot mark the end of a use (it could not be created, the other stream's
//!   context does not manage stream synchronisation, the stream's handle names no one stream, or
//!   the buffer has events for [`MAX_STREAM_EVENTS`] other streams already), the use is waited for
//!   on the host when its guard ends;
//! - cudarc skips a guard's record or wait while the guard's context holds a recorded error: the
//!   free, and home-stream work outside a guard ([`Protocol::before_home_use`]), then wait for that
//!   whole context (another context) or fail so that the pool waits for the device (the home one);
//! - if a step fails, [`Protocol::finish`] fails: the pool then waits for the whole device, or,
//!   for another context it could not wait for, never reuses the block.
//!
//! Once a context's recorded error is taken out (`check_err`), nothing tells that a guard skipped
//! its record or wait: the docs ask users to synchronise the stream of such a call first.

use std::boxed::Box;
use std::sync::{OnceLock, PoisonError};
use std::vec::Vec;

use super::backend::{BackendError, UsesError};
use crate::sync::{AtomicBool, Mutex, Ordering};

/// The stream and event operations the protocol needs. The calls must not change the error state
/// the driver keeps for the user (for cudarc: the context's recorded error).
pub(crate) trait UseOps {
    /// A stream (borrowed for the duration of a call).
    type Stream: ?Sized;
    /// An event that can be recorded again (a wait waits for its latest record).
    type Event: Send + Sync;
    /// What tells streams of one context apart, kept to find a stream's event again.
    type StreamId: PartialEq + Send + Sync;
    /// A context, kept to wait for it at the free.
    type Context: Send;

    /// Whether two streams belong to the same context.
    fn same_context(&self, a: &Self::Stream, b: &Self::Stream) -> bool;
    /// `stream`'s id: equal for two streams of one context only if they are the same stream (or
    /// one was destroyed before the other was created). `None` for a handle that does not name one
    /// stream (CUDA's per-thread default stream names the calling thread's).
    fn stream_id(&self, stream: &Self::Stream) -> Option<Self::StreamId>;
    /// A new event of `stream`'s context.
    fn new_event(&self, stream: &Self::Stream) -> Result<Self::Event, BackendError>;
    /// Records `event` after the work queued so far on `stream`.
    fn record(&self, event: &Self::Event, stream: &Self::Stream) -> Result<(), BackendError>;
    /// Makes `stream`'s later work wait for `event`'s latest record.
    fn wait(&self, stream: &Self::Stream, event: &Self::Event) -> Result<(), BackendError>;
    /// Blocks until the work queued so far on `stream` has finished.
    fn sync(&self, stream: &Self::Stream) -> Result<(), BackendError>;
    /// Whether the end of a use on `stream` will be marked by recording the event handed to its
    /// guard (cudarc records it only while its context manages stream synchronisation).
    fn records_end_of_use(&self, stream: &Self::Stream) -> bool;
    /// Prepares `stream`'s context for the use queued right after [`Protocol::enter`] returns.
    fn prepare_use(&self, stream: &Self::Stream) -> Result<(), BackendError>;
    /// `stream`'s context.
    fn context(&self, stream: &Self::Stream) -> Self::Context;
    /// Whether `stream` belongs to `ctx`.
    fn in_context(&self, stream: &Self::Stream, ctx: &Self::Context) -> bool;
    /// Fails if `ctx` holds an error that makes the end of a use go unmarked (cudarc skips a
    /// guard's record or wait while its context holds a recorded error); leaves the error there.
    fn context_error(&self, ctx: &Self::Context) -> Result<(), BackendError>;
    /// Blocks until all the work queued in `ctx` has finished (leaving the calling thread's
    /// current context as it was, if it had one).
    fn sync_context(&self, ctx: &Self::Context) -> Result<(), BackendError>;
}

/// What ends a use, once the use is queued (cudarc's `SyncOnDrop` does it when dropped).
pub(crate) enum EndOfUse<'a, O: UseOps + ?Sized> {
    /// Nothing: a use on the home stream.
    Nothing,
    /// Record the event on the stream of the use.
    Record(&'a O::Event, &'a O::Stream),
    /// Wait on the host for the stream of the use.
    Sync(&'a O::Stream),
}

/// One buffer's record of its uses on other streams: nothing until the first such use, so a buffer
/// used only on its home stream carries one word and a flag, and its free and its home-stream uses
/// look at nothing else.
pub(crate) struct Protocol<O: UseOps> {
    record: OnceLock<Box<Record<O>>>,
}

impl<O: UseOps> Default for Protocol<O> {
    fn default() -> Self {
        Protocol {
            record: OnceLock::new(),
        }
    }
}

impl<O: UseOps> core::fmt::Debug for Protocol<O> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self.record.get() {
            Some(r) => r.fmt(f),
            None => f.write_str("Uses { none on other streams }"),
        }
    }
}

impl<O: UseOps> Protocol<O> {
    /// Whether no use on another stream was ever entered (the buffer has no record): then
    /// [`finish`](Self::finish) does nothing.
    pub(crate) fn is_unused(&self) -> bool {
        self.record.get().is_none()
    }

    /// See [`Record::before_home_use`]; nothing to do before any use on another stream.
    pub(crate) fn before_home_use(&self, ops: &O, home: &O::Stream) -> Result<(), BackendError> {
        match self.record.get() {
            Some(r) => r.before_home_use(ops, home),
            None => Ok(()),
        }
    }

    /// See [`Record::enter`]. The first use on another stream creates the record (a host
    /// allocation); a use on the home stream never does.
    pub(crate) fn enter<'a>(
        &'a self,
        ops: &O,
        home: &'a O::Stream,
        other: &'a O::Stream,
    ) -> EndOfUse<'a, O> {
        if let Some(r) = self.record.get() {
            return r.enter(ops, home, other);
        }
        if ops.same_context(home, other) && same_stream(ops, home, other) {
            // What an empty record does for a use on the home stream: nothing.
            return EndOfUse::Nothing;
        }
        self.record
            .get_or_init(|| Box::new(Record::default()))
            .enter(ops, home, other)
    }

    /// Before work on the home stream that the protocol does not see end (a kernel launch that
    /// takes the buffer as an argument): makes the home stream wait for the uses on other streams;
    /// if that fails, the free waits for the whole context.
    pub(crate) fn home_waits_for_foreign_uses(&self, ops: &O, home: &O::Stream) {
        if let Some(r) = self.record.get() {
            r.home_waits_for_foreign_uses(ops, home);
        }
    }

    /// See [`Record::finish`]; nothing to do if the buffer was never used on another stream.
    pub(crate) fn finish(&self, ops: &O, home: &O::Stream) -> Result<(), UsesError> {
        match self.record.get() {
            Some(r) => r.finish(ops, home),
            None => Ok(()),
        }
    }
}

/// The record of a buffer's uses on other streams.
struct Record<O: UseOps> {
    /// Serialises the bookkeeping of concurrent uses (and the additions to `after`).
    lock: Mutex<()>,
    /// Recorded on the home stream before a foreign use; the foreign stream waits for it.
    before: OnceLock<O::Event>,
    /// One event per foreign stream of the home context, recorded there after each use; the home
    /// stream waits for them all. The first inline (the record is already a host allocation).
    after: OnceLock<After<O>>,
    /// Whether an event of `after` has been handed out for recording.
    foreign: AtomicBool,
    /// Whether a use on another stream of the same context is waited for by its guard.
    synced: AtomicBool,
    /// Other contexts the buffer was used in (behind `lock`), waited for at the free.
    contexts: Mutex<Vec<O::Context>>,
    /// Whether `contexts` has any (so that a buffer used only on same-context streams takes no
    /// lock at its free).
    any_contexts: AtomicBool,
    /// The first failure to order a use by events: the free then waits for the whole context.
    unordered: OnceLock<BackendError>,
}

impl<O: UseOps> Default for Record<O> {
    fn default() -> Self {
        Record {
            lock: Mutex::new(()),
            before: OnceLock::new(),
            after: OnceLock::new(),
            foreign: AtomicBool::new(false),
            synced: AtomicBool::new(false),
            contexts: Mutex::new(Vec::new()),
            any_contexts: AtomicBool::new(false),
            unordered: OnceLock::new(),
        }
    }
}

impl<O: UseOps> core::fmt::Debug for Record<O> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Uses")
            .field("foreign", &self.foreign.load(Ordering::Relaxed))
            .field("synced", &self.synced.load(Ordering::Relaxed))
            .field("unordered", &self.unordered.get())
            .finish_non_exhaustive()
    }
}

/// Other streams that get an event of their own in a buffer's record; uses on further streams are
/// waited for on the host when their guards end. (Each event costs a stream wait in every later
/// use on the home stream and at the free, so a buffer used from many short-lived streams keeps
/// that cost bounded.)
pub(crate) const MAX_STREAM_EVENTS: usize = 16;

/// The event that marks the end of the uses on one other stream, and the next such stream's.
///
/// The list only grows (by one node per stream, under the record's lock), so references into it
/// live as long as the record, and it is read without the lock.
///
/// One event per stream, not one per buffer: a use's guard records its event after the use is
/// queued, when the record's lock is no longer held, so a use on one stream may begin before the
/// end of a use on another is recorded. With one shared event, the later record would replace the
/// earlier one, and the home stream would wait for only one of the two uses. Records on one stream
/// follow each other in stream order: the latest marks the end of every use before it there.
struct After<O: UseOps> {
    stream: O::StreamId,
    event: O::Event,
    next: OnceLock<Box<After<O>>>,
}

impl<O: UseOps> After<O> {
    fn new(stream: O::StreamId, event: O::Event) -> Self {
        After {
            stream,
            event,
            next: OnceLock::new(),
        }
    }
}

/// The events in the list that starts at `first`.
fn afters<O: UseOps>(first: &OnceLock<After<O>>) -> impl Iterator<Item = &After<O>> {
    core::iter::successors(first.get(), |a| a.next.get().map(|a| &**a))
}

/// Whether `a` and `b`, of one context, are the same stream (a handle that names no one stream is
/// no stream's).
fn same_stream<O: UseOps>(ops: &O, a: &O::Stream, b: &O::Stream) -> bool {
    matches!((ops.stream_id(a), ops.stream_id(b)), (Some(x), Some(y)) if x == y)
}

/// The event in `cell`, created on first use.
fn lazy_event<'a, O: UseOps>(
    ops: &O,
    cell: &'a OnceLock<O::Event>,
    stream: &O::Stream,
) -> Result<&'a O::Event, BackendError> {
    if let Some(e) = cell.get() {
        return Ok(e);
    }
    let event = ops.new_event(stream)?;
    Ok(cell.get_or_init(|| event))
}

impl<O: UseOps> Record<O> {
    /// Notes that a use could not be ordered by events (the first failure is kept).
    fn unordered(&self, e: BackendError) {
        let _ = self.unordered.set(e);
    }

    /// Before work on the home stream that touches the buffer (a memset, or a use through a
    /// guard): makes the home stream wait for the end of the last use on another stream, and waits
    /// on the host for uses that no event orders (a guard skipped its wait, or ordering failed).
    /// On failure some of these waits may already be queued: queue nothing that touches the
    /// buffer.
    fn before_home_use(&self, ops: &O, home: &O::Stream) -> Result<(), BackendError> {
        self.sync_unmarked_contexts(ops)?;
        let unordered = self.unordered.get().is_some();
        let foreign = self.foreign.load(Ordering::Acquire);
        if unordered || foreign || self.synced.load(Ordering::Acquire) {
            // A failed ordering, or the end of a use that may have gone unmarked: wait for the
            // whole home context (where those uses ran).
            if unordered || self.end_may_be_unmarked(ops, home).is_err() {
                ops.sync_context(&ops.context(home))?;
            }
        }
        if !foreign {
            return Ok(());
        }
        // (An event not recorded yet waits for nothing; its use began after this use on the home
        // stream, or at the same time, unordered by the user.)
        self.home_waits_for_afters(ops, home).map(drop)
    }

    /// `Err` (with the reason) if the end of the last use on another stream may have gone
    /// unmarked: a guard's record (or wait) is skipped while the home context holds a recorded
    /// error (left by another guard of the same call, or another thread), and cudarc records a
    /// guard's event only if the context still manages stream synchronisation when the guard
    /// drops (a count of owned streams, which another thread lowers by dropping one), however it
    /// was when the use began.
    fn end_may_be_unmarked(&self, ops: &O, home: &O::Stream) -> Result<(), BackendError> {
        if self.foreign.load(Ordering::Acquire) && !ops.records_end_of_use(home) {
            return Err(BackendError::new(
                "cuEventRecord",
                "the context stopped managing stream synchronisation",
            ));
        }
        ops.context_error(&ops.context(home))
    }

    /// Makes `home` wait for every other stream's end-of-use event; whether there was any.
    fn home_waits_for_afters(&self, ops: &O, home: &O::Stream) -> Result<bool, BackendError> {
        let mut any = false;
        for after in afters(&self.after) {
            ops.wait(home, &after.event)?;
            any = true;
        }
        Ok(any)
    }

    /// The event that marks the end of the uses on `other` (a stream of the home stream's
    /// context), created on its first use there. Called with `lock` held.
    /// `None` when the record already holds [`MAX_STREAM_EVENTS`] events, none of them `other`'s.
    fn after_event(
        &self,
        ops: &O,
        home: &O::Stream,
        id: O::StreamId,
    ) -> Result<Option<&O::Event>, BackendError> {
        let mut last = None;
        let mut n = 0;
        for after in afters(&self.after) {
            // A destroyed stream's id may come back with a new stream. Its event's last record
            // came after all its uses (their guards borrowed the stream), and the home stream has
            // already waited for that record (in `enter`), so the event can serve the new stream.
            if after.stream == id {
                return Ok(Some(&after.event));
            }
            last = Some(after);
            n += 1;
        }
        if n == MAX_STREAM_EVENTS {
            return Ok(None);
        }
        let event = ops.new_event(home)?;
        let after = match last {
            None => self.after.get_or_init(|| After::new(id, event)),
            Some(last) => last.next.get_or_init(|| Box::new(After::new(id, event))),
        };
        Ok(Some(&after.event))
    }

    /// Waits for each other context the buffer was used in that holds a recorded error (a guard's
    /// wait there may have been skipped).
    fn sync_unmarked_contexts(&self, ops: &O) -> Result<(), BackendError> {
        if !self.any_contexts.load(Ordering::Acquire) {
            return Ok(());
        }
        let contexts = self.contexts.lock().unwrap_or_else(PoisonError::into_inner);
        for ctx in contexts.iter() {
            if ops.context_error(ctx).is_err() {
                ops.sync_context(ctx)?;
            }
        }
        Ok(())
    }

    /// [`before_home_use`](Self::before_home_use) before a use that cannot fail (a guard): on
    /// failure the home stream's later work may overlap that use, and the free waits for the
    /// whole context.
    fn home_waits_for_foreign_uses(&self, ops: &O, home: &O::Stream) {
        if let Err(e) = self.before_home_use(ops, home) {
            self.unordered(e);
        }
    }

    /// Starts a use on `other` of a buffer whose home stream is `home`; the caller queues the use
    /// and then ends it as the result says.
    fn enter<'a>(&'a self, ops: &O, home: &'a O::Stream, other: &'a O::Stream) -> EndOfUse<'a, O> {
        let same_context = ops.same_context(home, other);
        if same_context && same_stream(ops, home, other) {
            // A use on the home stream waits for the last use on another stream.
            self.home_waits_for_foreign_uses(ops, home);
            return EndOfUse::Nothing;
        }
        let _guard = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
        // The previous use on another stream comes before this one too (and what is recorded on
        // or waited for on the home stream below comes after it).
        self.home_waits_for_foreign_uses(ops, home);
        let end = if same_context {
            self.enter_same_context(ops, home, other)
        } else {
            // Another context: events cannot be recorded across contexts. Wait for the home
            // stream's work here, for the use itself when its guard ends, and for the whole
            // context at the free.
            if let Err(e) = ops.sync(home) {
                self.unordered(e);
            }
            let mut contexts = self.contexts.lock().unwrap_or_else(PoisonError::into_inner);
            if !contexts.iter().any(|c| ops.in_context(other, c)) {
                contexts.push(ops.context(other));
                self.any_contexts.store(true, Ordering::Release);
            }
            EndOfUse::Sync(other)
        };
        if let Err(e) = ops.prepare_use(other) {
            self.unordered(e);
        }
        end
    }

    fn enter_same_context<'a>(
        &'a self,
        ops: &O,
        home: &'a O::Stream,
        other: &'a O::Stream,
    ) -> EndOfUse<'a, O> {
        let ordered = lazy_event(ops, &self.before, home).and_then(|before| {
            ops.record(before, home)
                .and_then(|()| ops.wait(other, before))
        });
        if let Err(e) = ordered {
            self.unordered(e);
            if let Err(e) = ops.sync(home) {
                self.unordered(e);
            }
        }
        let after = match ops.stream_id(other) {
            Some(id) if ops.records_end_of_use(other) => self.after_event(ops, home, id),
            _ => Ok(None),
        };
        match after {
            Ok(Some(a)) => {
                self.foreign.store(true, Ordering::Release);
                return EndOfUse::Record(a, other);
            }
            // No event can mark the end of the use: it would not be recorded, or the stream's
            // handle names no one stream, or the record holds events for `MAX_STREAM_EVENTS`
            // other streams already. The use is waited for when its guard ends.
            Ok(None) => self.synced.store(true, Ordering::Release),
            Err(e) => self.unordered(e),
        }
        EndOfUse::Sync(other)
    }

    /// At the free, before the pool orders it on `home`: makes `home` wait for the uses on other
    /// streams. Fails if a use could not be ordered: [`UsesError::Unordered`] if waiting for the
    /// home context covers it, [`UsesError::Unbounded`] if a use in another context may still run.
    fn finish(&self, ops: &O, home: &O::Stream) -> Result<(), UsesError> {
        // A guard's wait for another context's stream is skipped while that context holds an
        // error: then wait for that whole context here. If even that fails, the pool's wait for
        // its own device does not reach it.
        self.sync_unmarked_contexts(ops)
            .map_err(UsesError::Unbounded)?;
        if let Some(e) = self.unordered.get() {
            // Some use on another stream was not ordered by an event: the pool waits for the
            // whole context instead.
            return Err(UsesError::Unordered(e.clone()));
        }
        if self.foreign.load(Ordering::Acquire) || self.synced.load(Ordering::Acquire) {
            if let Err(e) = self.end_may_be_unmarked(ops, home) {
                return Err(UsesError::Unordered(BackendError::new(
                    e.op,
                    std::format!(
                        "{}; so the end of a use on another stream may not have been marked",
                        e.message
                    ),
                )));
            }
            if self.home_waits_for_afters(ops, home)? {
                // A stream query need not count a wait as work (the pool returns an idle stream's
                // blocks at once): an event recorded after the wait keeps the home stream busy
                // until the use has ended.
                let mark = lazy_event(ops, &self.before, home)?;
                ops.record(mark, home)?;
            }
        }
        Ok(())
    }
}
