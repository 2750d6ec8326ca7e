//! Device (GPU) memory, streams and events, shaped after CUDA's semantics,
//! and the staging scheduler that moves a device-resident cache through
//! pinned host buffers and the wire.
//!
//! The contract every backend keeps (DESIGN.md §1):
//! - a copy on a [`Stream`] is *enqueued*: the call returns before any byte
//!   moved. Its source is not safe to overwrite and its destination not safe
//!   to read until an [`Event`] recorded after it on the same stream
//!   completes;
//! - a stream runs its work in order, and an event completes only after all
//!   work enqueued on its stream before it;
//! - a failed copy poisons its stream (CUDA's sticky errors): every later
//!   event on it reports the failure, never completion;
//! - the stream keeps every buffer of an enqueued copy alive (it holds their
//!   `Arc`s) until an event recorded after the copy was seen complete, or
//!   the stream is dropped, which waits for its work first.
//!
//! Backends: [`host::HostDevice`], a stand-in whose "device memory" is a
//! [`HostMem`] and whose streams are worker threads (for tests without a
//! GPU), and `cuda::CudaDevice` (feature `cuda`), the CUDA driver loaded at
//! run time.
//!
//! [`stage::StageOut`] and [`stage::StageIn`] are the staging schedulers of
//! the source (`stage`: device → pinned host, then the wire) and of the
//! destination (host → device, ending at `device_complete`).
//!
//! [`bound::Backend`] picks a backend at run time and imports a client's
//! allocation (a [`bound::DeviceHandle`]) as an object-safe
//! [`bound::BoundMem`], for a daemon that holds ranks of several clients.

use crate::mem::{HostMem, MemError};
use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

pub mod bound;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod host;
pub mod stage;

/// Why a device operation failed.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum DeviceError {
    /// The CUDA driver library is absent or unusable on this host.
    #[error("no CUDA driver: {0}")]
    NoDriver(String),
    /// kvwire-transport was built without the backend that was asked for.
    #[error("not built in: {0}")]
    NotBuilt(&'static str),
    /// The driver works but has no device with this ordinal.
    #[error("no CUDA device {ordinal}: the driver sees {count}")]
    NoDevice {
        /// The ordinal asked for.
        ordinal: u32,
        /// Devices the driver reports.
        count: u32,
    },
    /// A driver call failed.
    #[error("{call}: {message}")]
    Driver {
        /// The driver function (e.g. `cuMemcpyDtoHAsync`).
        call: &'static str,
        /// Its error name and text.
        message: String,
    },
    /// A copy on a stream failed; the stream is poisoned from then on.
    #[error("{op} of {len} bytes failed on the stream: {message}")]
    CopyFailed {
        /// `copy_d2h` or `copy_h2d`.
        op: &'static str,
        /// Bytes of the failed copy.
        len: u64,
        /// Why.
        message: String,
    },
    /// A range outside device memory.
    #[error("device access of {len} bytes at offset {offset} exceeds {size}-byte allocation")]
    OutOfBounds {
        /// Offset.
        offset: u64,
        /// Length.
        len: u64,
        /// Allocation size.
        size: u64,
    },
    /// Host memory could not be used.
    #[error("host memory: {0}")]
    Mem(#[from] MemError),
    /// Waiting for something took longer than allowed.
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout {
        /// What was awaited.
        what: String,
        /// The limit.
        after: Duration,
    },
    /// The wire refused or failed a staged chunk.
    #[error("wire: {0}")]
    Wire(String),
    /// The stream's worker is gone (stand-in backend only).
    #[error("stream closed")]
    StreamClosed,
    /// A staged chunk failed (its copy, its post or its wire completion).
    #[error("chunk {chunk} of layer {layer}: {source}")]
    Chunk {
        /// Chunk number, in send order.
        chunk: usize,
        /// Its layer.
        layer: u32,
        /// What failed.
        source: Box<DeviceError>,
    },
    /// A host → device copy of a layer failed: the layer never becomes device_complete.
    #[error("layer {layer}: {source}")]
    Layer {
        /// The layer.
        layer: u32,
        /// What failed.
        source: Box<DeviceError>,
    },
    /// A request the scheduler cannot honour (bad geometry, unknown layer).
    #[error("invalid: {0}")]
    Invalid(String),
}

/// Device memory: one allocation on one device.
pub trait DeviceMem: Debug + Send + Sync {
    /// Bytes.
    fn len(&self) -> u64;
    /// Never true: empty allocations are refused.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Ordinal of the device that holds it.
    fn ordinal(&self) -> u32;
    /// PCI address of that device (`0000:3b:00.0`), for locality; None when unknown.
    fn pci_bus_id(&self) -> Option<&str>;
    /// The host memory that plays this allocation, where it is host
    /// memory (the stand-in): a NIC registers it as it is.
    fn host_mem(&self) -> Option<&Arc<HostMem>> {
        None
    }
    /// The allocation's device address, where it has one (CUDA): the
    /// address a dmabuf registration's writes name (its iova).
    fn device_addr(&self) -> Option<u64> {
        None
    }
    /// Checks `offset..offset+len` lies inside the allocation.
    fn check(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(()),
            _ => Err(DeviceError::OutOfBounds { offset, len, size: self.len() }),
        }
    }
}

/// A completion marker recorded on a stream.
pub trait Event: Debug + Send {
    /// Whether every piece of work enqueued on the stream before this event
    /// finished. Err when any of it failed (the stream is poisoned).
    fn query(&self) -> Result<bool, DeviceError>;
    /// Waits up to `timeout` for [`Event::query`] to be true.
    fn synchronize(&self, timeout: Duration) -> Result<(), DeviceError>;
    /// When the stream reached this event, where the backend knows it (the
    /// stand-in does); else `None`, and a caller has only the moment it
    /// saw the event complete.
    fn completed_at(&self) -> Option<std::time::Instant> {
        None
    }
    /// How long the stream took from reaching `start` (an earlier event on
    /// the same stream) to reaching this one, where the backend times it
    /// (CUDA); `None` before both completed.
    fn elapsed_since(&self, _start: &Self) -> Option<Duration> {
        None
    }
}

/// An in-order queue of copies on one device.
pub trait Stream: Debug + Send {
    /// Device memory of this backend.
    type Mem: DeviceMem;
    /// Events of this backend.
    type Event: Event;
    /// Enqueues a copy of `len` bytes from device memory into host memory.
    /// Returns at once; bounds are checked now, the bytes move later.
    fn copy_d2h(&self, src: &Arc<Self::Mem>, src_off: u64, dst: &Arc<HostMem>, dst_off: u64, len: u64) -> Result<(), DeviceError>;
    /// Enqueues a copy of `len` bytes from host memory into device memory.
    fn copy_h2d(&self, src: &Arc<HostMem>, src_off: u64, dst: &Arc<Self::Mem>, dst_off: u64, len: u64) -> Result<(), DeviceError>;
    /// Records an event after all work enqueued so far.
    fn record(&self) -> Result<Self::Event, DeviceError>;
}

/// One device of a backend: allocates memory and streams.
pub trait Device: Debug + Send + Sync {
    /// Device memory.
    type Mem: DeviceMem;
    /// Streams.
    type Stream: Stream<Mem = Self::Mem>;
    /// A host range registered (pinned) with the device; unregistered on drop.
    type Pinned: Debug + Send + Sync;
    /// Ordinal.
    fn ordinal(&self) -> u32;
    /// PCI address, when known.
    fn pci_bus_id(&self) -> Option<&str>;
    /// Allocates `len` bytes of device memory (contents unspecified).
    fn alloc(&self, len: u64) -> Result<Arc<Self::Mem>, DeviceError>;
    /// A new stream.
    fn stream(&self) -> Result<Self::Stream, DeviceError>;
    /// Registers all of `mem` as pinned memory, so async copies into or
    /// out of it are true DMA and do not serialise.
    fn pin(&self, mem: &Arc<HostMem>) -> Result<Self::Pinned, DeviceError>;
    /// Synchronous copy of `data` into device memory (setup and checks).
    fn write(&self, dst: &Self::Mem, dst_off: u64, data: &[u8]) -> Result<(), DeviceError>;
    /// Synchronous copy out of device memory (setup and checks).
    fn read(&self, src: &Self::Mem, src_off: u64, out: &mut [u8]) -> Result<(), DeviceError>;
    /// Synchronous device → host copy between `HostMem` and device memory
    /// (the `cuMemcpyDtoH` baseline).
    fn copy_d2h_sync(&self, src: &Self::Mem, src_off: u64, dst: &HostMem, dst_off: u64, len: u64) -> Result<(), DeviceError>;
    /// Synchronous host → device copy (the `cuMemcpyHtoD` baseline).
    fn copy_h2d_sync(&self, src: &HostMem, src_off: u64, dst: &Self::Mem, dst_off: u64, len: u64) -> Result<(), DeviceError>;
}

/// Whether a CUDA driver can be opened here: Ok, or the reason it cannot —
/// [`DeviceError::NotBuilt`] without the `cuda` feature,
/// [`DeviceError::NoDriver`] when libcuda is missing or refuses to start.
/// Never panics.
pub fn probe_cuda() -> Result<(), DeviceError> {
    #[cfg(feature = "cuda")]
    {
        cuda::probe()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(DeviceError::NotBuilt("kvwire-transport was built without the `cuda` feature"))
    }
}
