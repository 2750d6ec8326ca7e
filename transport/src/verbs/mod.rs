//! Verbs (RDMA) transport: RC queue pairs, one-sided `RDMA_WRITE`s, each
//! batch followed by a SEND of [`WriteNote`]s naming what it wrote.
//!
//! - [`VerbsEndpoint::new`] opens an RDMA device (through `sideway`, which
//!   loads libibverbs at run time, so this builds and runs on hosts without
//!   rdma-core and fails there with [`TransportError::NoDevice`]), a
//!   protection domain, and a TCP listener for the out-of-band handshake.
//! - [`VerbsEndpoint::register`] puts a window of a [`HostMem`] in the
//!   endpoint's [`Registry`] *and* registers it with the NIC
//!   (`LOCAL_WRITE | REMOTE_WRITE`). Peers address it by the MR's rkey and
//!   the window's virtual address: the descriptors in this endpoint's
//!   [`Hello`] carry `key = rkey`, `addr = mapping + offset`.
//!   [`VerbsEndpoint::revoke`] deregisters the MR, so every later remote
//!   write to it fails at the destination NIC with a remote access error.
//! - Several devices (rails): [`VerbsEndpoint::rail`] opens another device
//!   sharing the first one's registry and placement;
//!   [`VerbsEndpoint::attach`] registers a region of the shared registry
//!   with that device too. Its hello names the region by the shared `key`
//!   and gives its own device's `rkey`, so a write names the same key on
//!   every rail and counts toward the same layer.
//! - [`Endpoint::connect`] exchanges [`Hello`]s (version, transport, regions,
//!   QPN/PSN/GID/LID/MTU) and brings an RC QP on each side to RTS. The
//!   accepting side runs one thread per connection that pre-posts receives
//!   into a registered buffer ring and polls its CQ. After a batch's
//!   writes, the source SENDs notes naming each write's (tag, key, offset,
//!   length); RC ordering places the writes before the SEND completes at
//!   the destination, which then counts each named range once with
//!   [`Placement::placed_range`]. Layer flags therefore follow counted
//!   completions, never an assumed ordering, and a slice written again
//!   after its first rail failed is not counted twice (an immediate value
//!   would carry only a tag and a length).
//! - [`Connection::post`] validates every write locally (source inside a
//!   registered local region, destination key and bounds inside the peer's
//!   descriptor, no zero length) and refuses the whole batch before posting
//!   anything; then each write becomes signaled `RDMA_WRITE` work requests
//!   (split at 1 GiB), followed by the batch's note SENDs. [`Connection::poll`] reports a batch
//!   once all its work requests completed locally; a failed work request
//!   (e.g. remote access error after a revoke) fails the batch with an
//!   actionable [`TransportError::Verbs`], and the queue pair is then in the
//!   error state: later posts on that connection are refused, reconnect.
//!
//! All verbs `unsafe` of the crate lives in this module and its children:
//! `endpoint` (device, PD, MRs), `handshake` (hellos with QP data), `qp`
//! (queue pairs and completions), `notes` (write-note buffers), `passive`
//! (the destination: counts noted ranges) and `active` (the source: posts
//! writes and notes).
//!
//! [`WriteNote`]: kvwire_core::protocol::WriteNote
//! [`HostMem`]: crate::HostMem
//! [`Registry`]: crate::Registry
//! [`Hello`]: crate::Hello
//! [`Endpoint::connect`]: crate::Endpoint::connect
//! [`Placement::placed_range`]: crate::Placement::placed_range
//! [`Connection::post`]: crate::Connection::post
//! [`Connection::poll`]: crate::Connection::poll

mod active;
mod endpoint;
mod handshake;
mod notes;
mod passive;
mod qp;
mod shared;

pub use active::VerbsConnection;
pub use endpoint::VerbsEndpoint;

use crate::TransportError;
use kvwire_core::protocol::NOTE_LEN;
use std::time::Duration;

/// Transport name in hellos.
const TRANSPORT: &str = crate::TransportKind::Verbs.as_str();
/// Largest single work request; longer writes are split (rxe allows 2 GiB).
const MAX_WR_BYTES: u64 = 1 << 30;
/// Most SGEs one RDMA write gathers (fewer where the device allows fewer):
/// writes that continue one another at the peer from scattered local
/// ranges go as one work request.
const MAX_SEND_SGE: u32 = 16;
/// Notes per SEND; a batch with more writes sends several.
const NOTES_PER_SEND: usize = 64;
/// Bytes of one note buffer (send ring slot, receive buffer).
const NOTE_BUF: usize = NOTES_PER_SEND * NOTE_LEN;
/// How to make a device, for error messages.
const HOW_TO_GET_A_DEVICE: &str = "create a soft-RoCE device with `scripts/softroce-up` or \
    `rdma link add rxe0 type rxe netdev IF` (needs the rdma_rxe kernel module), or run inside \
    `scripts/softroce-vm -- PROGRAM`";

/// Sizes and names of a [`VerbsEndpoint`].
#[derive(Debug, Clone)]
pub struct VerbsLimits {
    /// TCP address the handshake listener binds (`127.0.0.1:0` picks a port).
    pub listen: String,
    /// This endpoint's name in hellos and errors.
    pub node: String,
    /// Most regions registered at once.
    pub max_regions: usize,
    /// Transfer slots in the flag table.
    pub slots: u16,
    /// Layers per slot in the flag table.
    pub layers: u16,
    /// Send-queue depth of each connection (work requests in flight).
    pub send_depth: u32,
    /// Receives pre-posted per accepted connection (note credits), each
    /// with a buffer of its own.
    pub recv_depth: u32,
    /// How long a whole handshake may take.
    pub handshake_timeout: Duration,
    /// How long an accepted connection may go without a write note
    /// before the destination closes it.
    pub idle_timeout: Duration,
    /// Caps on the handshake listener's connections.
    pub caps: crate::auth::ConnectionCaps,
    /// Count bytes only toward (slot, layer)s declared before they arrive
    /// ([`crate::Placement::declared_only`]).
    pub declared_only: bool,
}

impl Default for VerbsLimits {
    fn default() -> Self {
        VerbsLimits {
            listen: "127.0.0.1:0".into(),
            node: "verbs".into(),
            max_regions: 1024,
            slots: 64,
            layers: 128,
            send_depth: 256,
            recv_depth: 256,
            handshake_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(300),
            caps: crate::auth::ConnectionCaps::default(),
            declared_only: false,
        }
    }
}

/// The device, port and address an endpoint uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerbsInfo {
    /// Device name (e.g. `rxe0`).
    pub device: String,
    /// Port number (from 1).
    pub port: u8,
    /// GID table index used as the source GID.
    pub gid_index: u32,
    /// That GID.
    pub gid: [u8; 16],
    /// Port LID (0 on RoCE).
    pub lid: u16,
    /// Active MTU enum value (1 = 256 … 5 = 4096).
    pub mtu: u8,
    /// SGEs per RDMA write this endpoint's QPs gather: the device's limit,
    /// at most 16.
    pub send_sge: u32,
}

fn verbs_err(verb: &'static str, message: impl Into<String>) -> TransportError {
    TransportError::Verbs { verb, message: message.into() }
}

/// `error: cause: cause…` — sideway's errors keep the OS error as a source.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = c.source();
    }
    s
}

/// The OS error number behind a sideway error. Its error kinds are
/// `#[error(transparent)]`, which hides the `io::Error` from `source()`, so
/// read the number from the text the chain ends with, "(os error N)".
fn os_code(e: &(dyn std::error::Error + 'static)) -> Option<i32> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cur {
        if let Some(io) = c.downcast_ref::<std::io::Error>() {
            return io.raw_os_error();
        }
        cur = c.source();
    }
    let text = chain(e);
    let at = text.rfind("(os error ")? + "(os error ".len();
    text[at..].split(')').next()?.parse().ok()
}

fn mtu_bytes(mtu: u8) -> u32 {
    128u32 << mtu.min(5)
}
