//! kvwire's data plane: one-sided writes into a peer's registered memory.
//!
//! Every backend offers the same contract:
//! - an [`Endpoint`] owns a [`Registry`] of local regions (what peers may
//!   write into, and what local writes read from) and a [`Placement`] that
//!   counts bytes placed per (transfer slot, layer) and publishes the layer's
//!   flag once the count reaches what the plan declared with
//!   [`Placement::expect`];
//! - [`Endpoint::connect`] does the out-of-band handshake (protocol
//!   version, transport, proof of a data-plane session, verbs QP data and
//!   the regions granted to the session's node) and returns a [`Connection`];
//! - [`Connection::post`] takes a [`Batch`] of writes tagged with
//!   (slot, layer); [`Connection::poll`] returns one [`Completion`] per
//!   batch once every write in it completed locally — the `source_released`
//!   boundary for the source ranges it read.
//!
//! Every backend's destination accepts a write through [`accept`], one
//! path: key, bounds, tag, room, place, then count the range once. A
//! refused write (unknown or revoked key, out of bounds, zero length, a
//! tag outside the flag table, more bytes than its layer declared) fails
//! its batch with the [`accept::Refusal`]'s text and counts no byte; where
//! the destination places the bytes itself (tcp, shm) it touches none.

#![warn(missing_docs)]

pub mod accept;
mod answers;
pub mod auth;
pub mod device;
pub mod flags;
pub mod hello;
pub mod idle;
mod ledger;
pub mod logbudget;
pub mod mem;
pub mod metrics;
pub mod placement;
pub mod registry;
pub mod shm;
pub mod tcp;
pub mod topology;
pub mod verbs;

pub use flags::FlagTable;
pub use kvwire_core::protocol::TransportKind;
pub use kvwire_core::protocol::{Hello, RegionDesc, Tag};
pub use mem::HostMem;
pub use metrics::{Hop, Hops};
pub use placement::Placement;
pub use auth::Credential;
pub use registry::{Grant, Region, Registry};

use std::sync::Arc;
use std::time::{Duration, Instant};

/// One one-sided write: `len` bytes from a local region into a peer's
/// region, or with a [`Stride`], `count` such runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteOp {
    /// Key of the local (source) region, in this endpoint's registry.
    pub src_key: u32,
    /// Offset in the source region (of the first run).
    pub src_offset: u64,
    /// Remote key of the destination region.
    pub dst_key: u32,
    /// Offset in the destination region (of the first run).
    pub dst_offset: u64,
    /// Bytes (per run).
    pub len: u64,
    /// None: one run.
    pub stride: Option<Stride>,
}

/// The runs of a strided write: `count` runs of the write's `len` bytes,
/// `src` bytes apart at the source and `dst` bytes apart at the
/// destination (a remap's rows of one head in a block). shm carries one
/// as one request, tcp as frames of whole runs gathered from the source
/// and scattered into place; verbs refuses it
/// ([`TransportError::Unsupported`]). The destination counts its bytes
/// once, and refuses one whose runs overlap other bytes placed
/// ([`placement::Placement::placed_strided`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Stride {
    /// Runs (≥ 1).
    pub count: u64,
    /// Distance between runs at the source.
    pub src: u64,
    /// Distance between runs at the destination.
    pub dst: u64,
}

impl Stride {
    /// Bytes from the first run's start to the last run's end, for runs of
    /// `len` bytes `step` apart; None on overflow.
    pub fn span(count: u64, step: u64, len: u64) -> Option<u64> {
        count.checked_sub(1)?.checked_mul(step)?.checked_add(len)
    }
}

impl WriteOp {
    /// Runs.
    pub fn count(&self) -> u64 {
        self.stride.map_or(1, |s| s.count)
    }

    /// Bytes it moves.
    pub fn bytes(&self) -> u64 {
        self.len.saturating_mul(self.count())
    }

    /// Bytes from its first run's start to its last run's end at the
    /// source; None on overflow.
    pub fn src_span(&self) -> Option<u64> {
        self.stride.map_or(Some(self.len), |s| Stride::span(s.count, s.src, self.len))
    }
}

/// Writes posted together under one tag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// (transfer slot, layer) the destination counts these bytes toward.
    pub tag: Tag,
    /// The writes.
    pub writes: Vec<WriteOp>,
}

impl Batch {
    /// Bytes in the batch.
    pub fn bytes(&self) -> u64 {
        self.writes.iter().map(WriteOp::bytes).sum()
    }

    /// Refuses a strided write on a transport that carries none.
    pub fn unstrided(&self, transport: &str) -> Result<(), TransportError> {
        match self.writes.iter().any(|w| w.stride.is_some()) {
            true => Err(TransportError::Unsupported(format!("strided writes over {transport}: only shm carries them"))),
            false => Ok(()),
        }
    }
}

/// Identifies a posted batch on its connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BatchId(pub u64);

/// A batch finished at the source: every write in it completed locally
/// (or the batch failed). Only now may its source ranges be overwritten.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// The batch.
    pub batch: BatchId,
    /// Its tag.
    pub tag: Tag,
    /// Bytes the batch carried.
    pub bytes: u64,
    /// Success, or why the batch failed.
    pub result: Result<(), TransportError>,
    /// When the transport learned of it (tcp: the last answer read off the
    /// socket), which the caller's poll may reap later.
    pub at: Instant,
}

/// Why a transport operation failed.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum TransportError {
    /// A socket operation failed.
    #[error("{op}: {message}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// Kind of the OS error.
        kind: std::io::ErrorKind,
        /// OS message.
        message: String,
    },
    /// The peer's handshake was refused.
    #[error("handshake: {0}")]
    Hello(#[from] kvwire_core::protocol::HelloError),
    /// A malformed frame; the connection is closed.
    #[error("protocol: {0}")]
    Frame(#[from] kvwire_core::protocol::FrameError),
    /// The peer refused a write.
    #[error("peer refused write: {0}")]
    Refused(String),
    /// A write's source range is not in a local registered region.
    #[error("local source: {0}")]
    Source(String),
    /// Memory could not be made or touched.
    #[error("memory: {0}")]
    Mem(#[from] mem::MemError),
    /// Registration failed.
    #[error("register: {0}")]
    Register(#[from] registry::RegistryError),
    /// The peer went away with work outstanding.
    #[error("peer closed the connection with {pending} batches outstanding")]
    PeerClosed {
        /// Batches that will never complete.
        pending: usize,
    },
    /// No RDMA device or driver.
    #[error("no RDMA device: {0}")]
    NoDevice(String),
    /// A verbs call failed.
    #[error("{verb}: {message}")]
    Verbs {
        /// The verb.
        verb: &'static str,
        /// What it said, made actionable where possible.
        message: String,
    },
    /// The request is not something this transport can do.
    #[error("unsupported: {0}")]
    Unsupported(String),
}

impl TransportError {
    /// Wraps an I/O error with what was being done.
    pub fn io(op: &'static str) -> impl Fn(std::io::Error) -> TransportError {
        move |e| TransportError::Io { op, kind: e.kind(), message: e.to_string() }
    }
}

/// A connection to one peer, initiating one-sided writes.
pub trait Connection: Send {
    /// The peer's handshake (its regions, node name, version).
    fn remote(&self) -> &Hello;

    /// Posts a batch. Returns once the writes are handed to the transport;
    /// their completion is reported by [`Connection::poll`]. The source
    /// regions stay registered (and so alive) until then.
    fn post(&mut self, batch: Batch) -> Result<BatchId, TransportError>;

    /// Posts several batches in order, as [`Connection::post`] does each,
    /// where the transport can hand them over in one go (tcp: one gathered
    /// write, so a small transfer's layers cost one system call and one
    /// wake-up of the peer, not one each). On an error, the ids of the
    /// batches posted before it.
    fn post_all(&mut self, batches: Vec<Batch>) -> Result<Vec<BatchId>, (Vec<BatchId>, TransportError)> {
        let mut ids = Vec::with_capacity(batches.len());
        for b in batches {
            match self.post(b) {
                Ok(id) => ids.push(id),
                Err(e) => return Err((ids, e)),
            }
        }
        Ok(ids)
    }

    /// Waits up to `timeout` for at least one completion; returns every
    /// completion available (possibly none on timeout).
    fn poll(&mut self, timeout: Duration) -> Result<Vec<Completion>, TransportError>;

    /// Batches posted and not yet completed.
    fn pending(&self) -> usize;

    /// Bytes this connection's transport sent more than once so far (lost,
    /// reordered or timed-out segments). Transports that cannot see their
    /// retransmissions report 0.
    fn retransmitted_bytes(&self) -> u64 {
        0
    }

    /// Whether this connection may carry another transfer's writes: open,
    /// and nothing outstanding (verbs asks the peer again for regions its
    /// hello did not list; shm has the peer unmap the regions released
    /// here since it shared them). Only such a connection is kept between
    /// transfers.
    fn reusable(&mut self) -> bool {
        false
    }

    /// Bytes of framing this connection sent for its writes so far:
    /// everything it put on the link besides payload, counted as it went
    /// out — TCP frame headers, shm write requests (header and trailer),
    /// verbs write notes. The handshake is not counted. Cumulative, so a
    /// caller takes the difference around a transfer.
    fn framing_bytes(&self) -> u64 {
        0
    }

    /// Bytes the peer sent back in answer to this connection's writes so
    /// far (`Ack` headers, `Nack` headers and reasons); 0 where writes are
    /// not answered (verbs). Cumulative.
    fn answer_bytes(&self) -> u64 {
        0
    }

    /// A handle that breaks this connection from another thread, so a
    /// `post` blocked on a dead link returns with an error. None where the
    /// transport cannot do that (its posts do not block on the peer).
    fn interrupter(&self) -> Option<Box<dyn Fn() + Send + Sync>> {
        None
    }
}

/// One host's endpoint of a transport.
pub trait Endpoint: Send + Sync {
    /// Which transport this is.
    fn transport(&self) -> TransportKind;

    /// Where peers connect (e.g. `127.0.0.1:40123`).
    fn local_addr(&self) -> String;

    /// This endpoint's node name, as its hellos give it.
    fn node(&self) -> &str;

    /// Local regions: register here what peers may write into and what
    /// local writes read from.
    fn registry(&self) -> &Arc<Registry>;

    /// Incoming-byte accounting and flags.
    fn placement(&self) -> &Arc<Placement>;

    /// Connects to the endpoint at `peer` (as printed by its `local_addr`),
    /// proving the session of `cred`, which the peer must have open.
    fn connect(&self, peer: &str, cred: &Credential) -> Result<Box<dyn Connection>, TransportError>;

    /// Registers `mem[offset..offset+len]` for local reads, and for remote
    /// writes by the node and slot of `grant` (None: local only).
    /// Backends that must also register with hardware override it.
    fn register(&self, mem: Arc<HostMem>, offset: u64, len: u64, grant: Option<Grant>) -> Result<Arc<Region>, TransportError> {
        Ok(self.registry().register(mem, offset, len, grant)?)
    }

    /// Registers device memory for local reads by the NIC (GPUDirect): a
    /// dmabuf of `len` bytes whose writes name addresses from `iova`, under
    /// `key` (a rail registering what the first endpoint reserved) or a
    /// fresh reserved key. The key is a write's `src_key`, offsets from the
    /// allocation's start; [`Endpoint::revoke`] deregisters it. Only verbs
    /// can: the other transports read memory through a host mapping.
    fn register_dmabuf(&self, fd: std::os::fd::BorrowedFd<'_>, len: u64, iova: u64, key: Option<u32>) -> Result<u32, TransportError> {
        let _ = (fd, len, iova, key);
        Err(TransportError::Unsupported(format!("the {} transport reads memory through a host mapping and cannot read device memory; GPUDirect needs verbs", self.transport().as_str())))
    }

    /// Revokes a region: every later write to `key` fails. Returns whether it was registered.
    fn revoke(&self, key: u32) -> bool {
        self.registry().revoke(key)
    }

    /// Makes `region`, registered on the endpoint whose registry this one
    /// shares (a rail), usable here too. Nothing to do for transports that
    /// address memory through the shared registry alone; verbs registers
    /// the region with this rail's device.
    fn attach(&self, _region: &Arc<Region>) -> Result<(), TransportError> {
        Ok(())
    }

    /// Whether a connection keeps serving after one of its writes was
    /// refused (TCP and shm do; an RC queue pair goes to the error state).
    fn survives_refused_write(&self) -> bool {
        true
    }
}
