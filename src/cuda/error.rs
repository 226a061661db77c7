//! Errors and statistics of the device pool.

use std::fmt;
use std::string::String;

use super::backend::BackendError;
use crate::core::{FreeError, OomReport, Stats};

/// Why the device pool could not do what was asked.
#[derive(Clone, Debug, PartialEq)]
pub enum PoolError {
    /// The CUDA driver library (`libcuda.so` / `nvcuda.dll`) could not be loaded.
    DriverNotFound,
    /// The driver is there but reports no usable device (or not the one asked for).
    NoDevice {
        /// The device asked for, if one was.
        ordinal: Option<usize>,
    },
    /// A driver call failed, or the back end refused the stream: a stream of another context
    /// than the pool's, or a per-thread default stream (`op` is then `"DevicePool::alloc"`).
    Backend(BackendError),
    /// No memory for the request, even after waiting for pending frees and trimming.
    OutOfMemory(std::boxed::Box<DeviceOom>),
    /// The request itself is invalid: an alignment that is not a power of two or too large, or a
    /// size that overflows once rounded.
    InvalidRequest {
        /// Bytes asked for (`usize::MAX` when `len * size_of::<T>()` overflowed).
        bytes: usize,
        /// Alignment asked for.
        align: usize,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The pool options are invalid.
    Config(&'static str),
    /// A buffer freed into the pool was rejected by the engine (a bug, recorded in `Drop`).
    Free(FreeError),
}

impl From<BackendError> for PoolError {
    fn from(e: BackendError) -> Self {
        PoolError::Backend(e)
    }
}

impl fmt::Display for PoolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PoolError::DriverNotFound => write!(
                f,
                "the CUDA driver library (libcuda) was not found; is an NVIDIA driver installed?"
            ),
            PoolError::NoDevice { ordinal: Some(o) } => write!(f, "no CUDA device {o}"),
            PoolError::NoDevice { ordinal: None } => write!(f, "no CUDA device"),
            PoolError::Backend(e) => write!(f, "CUDA driver error: {e}"),
            PoolError::OutOfMemory(oom) => oom.fmt(f),
            PoolError::InvalidRequest {
                bytes,
                align,
                reason,
            } => write!(
                f,
                "invalid device allocation request: {bytes} B aligned to {align} B: {reason}"
            ),
            PoolError::Config(what) => write!(f, "invalid device pool options: {what}"),
            PoolError::Free(e) => write!(f, "device pool free rejected: {e}"),
        }
    }
}

impl std::error::Error for PoolError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            PoolError::Backend(e) => Some(e),
            PoolError::Free(e) => Some(e),
            _ => None,
        }
    }
}

/// The state of a device pool when a request failed: the engine's [`OomReport`] (with its per-bin
/// summary of free chunks) plus what the device said.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceOom {
    /// Device index.
    pub ordinal: usize,
    /// Bytes asked for.
    pub requested: usize,
    /// Bytes in blocks handed out (including blocks freed but still pending on a stream).
    pub in_use: usize,
    /// Bytes in the pool's regions (`allocator.bytes_reserved` of [`DeviceStats`]). A region
    /// over-allocated for an element type aligned beyond the driver's 256 bytes holds its padding
    /// from the driver too.
    pub reserved: usize,
    /// The pool's limit on the bytes it holds from the driver: `reserved` plus any such padding.
    pub limit: usize,
    /// Device memory in total (0 if the driver could not be asked).
    pub device_total: usize,
    /// Device memory free according to the driver at the time of failure (0 if the driver could not
    /// be asked).
    pub device_free: usize,
    /// Largest free block inside the pool.
    pub largest_free_block: usize,
    /// Bytes of freed blocks still waiting for their stream (0 unless an event could not be waited
    /// for).
    pub pending_bytes: usize,
    /// Bytes of blocks never to be handed out again, because the end of their work could not be
    /// ordered or waited for (see [`DeviceStats::stranded_bytes`]); part of `in_use`.
    pub stranded_bytes: usize,
    /// The last refusal of the driver, if growth was refused.
    pub driver_error: Option<String>,
    /// The engine's report: counters, cause and free chunks by size.
    pub report: OomReport,
}

impl fmt::Display for DeviceOom {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "CUDA device {}: out of memory allocating {} B (in use {} B, reserved {} B, limit {} B, \
             device total {} B, device free {} B, largest free block {} B, pending {} B, \
             stranded {} B)",
            self.ordinal,
            self.requested,
            self.in_use,
            self.reserved,
            self.limit,
            self.device_total,
            self.device_free,
            self.largest_free_block,
            self.pending_bytes,
            self.stranded_bytes
        )?;
        if let Some(e) = &self.driver_error {
            write!(f, "; driver: {e}")?;
        }
        write!(f, "; {}", self.report)
    }
}

/// Counters of a device pool: the engine's [`Stats`] plus pending frees and the device's totals.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceStats {
    /// Device index.
    pub ordinal: usize,
    /// The engine's counters (blocks pending on a stream count as in use there). `num_allocs`
    /// counts every allocation, also those served from a stream's pending blocks.
    pub allocator: Stats,
    /// Freed blocks kept for reuse by their stream, or waiting for its work to finish (see the
    /// stream model in the [module documentation](super)).
    pub pending_blocks: usize,
    /// Their total size.
    pub pending_bytes: usize,
    /// Bytes of blocks never reused because the driver could neither order their free after
    /// their uses on other streams nor wait for the device (see [`DevicePool::take_errors`]).
    /// They stay in use, and their regions are not returned to the driver.
    ///
    /// [`DevicePool::take_errors`]: super::DevicePool::take_errors
    pub stranded_bytes: usize,
    /// Device memory free according to the driver (0 if the query failed).
    pub device_free: usize,
    /// Device memory in total (0 if the query failed).
    pub device_total: usize,
}

impl DeviceStats {
    /// Bytes held by live buffers: in use in the engine minus the pending and stranded blocks.
    pub fn bytes_in_buffers(&self) -> usize {
        self.allocator
            .bytes_in_use
            .saturating_sub(self.pending_bytes + self.stranded_bytes)
    }
}

impl fmt::Display for DeviceStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "device:              {}", self.ordinal)?;
        writeln!(f, "{}", self.allocator)?;
        writeln!(
            f,
            "pending frees:       {} blocks, {} B",
            self.pending_blocks, self.pending_bytes
        )?;
        writeln!(f, "bytes in buffers:    {}", self.bytes_in_buffers())?;
        if self.stranded_bytes != 0 {
            writeln!(f, "stranded:            {} B", self.stranded_bytes)?;
        }
        write!(
            f,
            "device memory:       {} B free of {} B",
            self.device_free, self.device_total
        )
    }
}
