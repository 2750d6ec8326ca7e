//! kvwire's pure core: the KV byte inventory, shard maps, transfer plans.
//!
//! No I/O, no clocks, no `unsafe`: transports and the daemon feed it bytes
//! and timestamps. Everything here is deterministic and testable on plain
//! buffers.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod codec;
pub mod format;
pub mod layout;
pub mod manifest;
pub mod plan;
pub mod protocol;
pub mod reuse;
pub mod schedule;
pub mod session;
pub mod shard;
pub mod tensors;
pub mod timing;
pub mod topology;
pub mod verify;

pub use format::{CacheFormat, FormatError};
pub use layout::{Geometry, ModelSpec, SpecError};
