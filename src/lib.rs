//! `bfc-alloc`: TensorFlow's best-fit-with-coalescing allocator, written once and used twice.
//!
//! - [`core`]: a `no_std` engine ([`Bfc`]) over address ranges it never touches. It gets regions from
//!   a [`MemorySource`], keeps all metadata outside them, and so manages host or device memory alike.
//! - [`GlobalBfc`] (feature `host`, on by default): the engine behind a spinlock over a reserved `mmap`
//!   arena, usable as `#[global_allocator]`.
//! - `bfc_alloc::cuda` (feature `cuda`): the same engine over CUDA device memory, one pool per
//!   device.
//!
//! ```no_run
//! # #[cfg(feature = "host")]
//! #[global_allocator]
//! static A: bfc_alloc::GlobalBfc = bfc_alloc::GlobalBfc::new();
//!
//! # #[cfg(feature = "host")]
//! fn main() {
//!     let v = vec![1u8; 1 << 20];
//!     println!("{}", A.stats());
//!     drop(v);
//! }
//! # #[cfg(not(feature = "host"))]
//! # fn main() {}
//! ```
#![no_std]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]
// The docs are written for the default features: builds without `host` or `std` lack some of the
// items they link to (`GlobalBfc`, its thread-cache methods), so those links stay plain text there.
#![cfg_attr(
    not(all(feature = "std", feature = "host")),
    allow(rustdoc::broken_intra_doc_links)
)]

#[cfg(feature = "std")]
extern crate std;

pub mod core;
pub mod lock;
mod sync;

#[cfg(all(feature = "host", unix))]
pub mod host;

pub use crate::core::{
    AllocError, Bfc, Chunk, ChunkHandle, ChunkStorage, Config, FreeError, MemorySource, OomReport,
    Stats,
};
#[cfg(all(feature = "host", feature = "std", unix))]
pub use host::MAX_CACHED_BYTES;
#[cfg(all(feature = "host", unix))]
pub use host::{AllocFailure, FailureCause, GlobalBfc, HostConfig};

#[cfg(feature = "cuda")]
pub mod cuda;
