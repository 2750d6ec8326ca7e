//! The out-of-band handshake over TCP: the shared exchange of
//! [`crate::hello`] (challenge, the source's hello proving its session,
//! the destination's proving it back), each hello carrying its queue
//! pair's address (QPN, PSN, GID, LID, MTU); the destination's also lists
//! the regions granted to that session's node, and no others. Both bring their
//! QP to RTR/RTS against the other's. After the handshake the stream
//! carries one thing more: a source's empty `Hello`, asking for the
//! regions granted to the node now (a kept connection's later
//! transfers), answered with the destination's hello listing them.

use super::shared::Shared;
use super::notes::NoteRing;
use super::qp::Qp;
use super::TRANSPORT;
use crate::auth::Credential;
use crate::hello::{self, Deadline, Proven};
use crate::TransportError;
use kvwire_core::protocol::{Hello, VerbsAddr};
use sideway::ibverbs::queue_pair::QueuePair;
use std::net::TcpStream;

impl Shared {
    /// This endpoint's hello for a connection through `qp`: with the
    /// regions granted to node `peer` (a destination's), or none (a source's).
    pub(super) fn hello(&self, qp: &Qp, peer: Option<u64>) -> Hello {
        let qp = VerbsAddr { qpn: qp.qp.qp_number(), psn: qp.psn, gid: self.info.gid, lid: self.info.lid, mtu: self.info.mtu };
        let regions = peer.map(|p| self.descs(p)).unwrap_or_default();
        hello::ours(TRANSPORT, &self.limits.node, regions, Some(qp))
    }
}

/// The source's side: proves `cred`, reads the peer's hello and brings
/// `qp` to RTS against it. Returns the peer's hello.
pub(super) fn initiate(shared: &Shared, stream: &TcpStream, qp: &mut Qp, cred: &Credential) -> Result<Hello, TransportError> {
    let hs = Deadline::new(stream, shared.limits.handshake_timeout);
    let remote = hello::initiate(&mut hs.again(), &mut hs.again(), TRANSPORT, cred, shared.hello(qp, None))?;
    let pv = peer_verbs(&remote)?;
    qp.connect(shared, &pv)?;
    Ok(remote)
}

/// The destination's side: checks the peer's proof (refused by
/// [`hello::challenge`]), makes a QP that receives its notes into `ring`,
/// and answers with our hello — or with a `Nack` saying why not. Returns
/// the peer's hello, the QP and the node's id (what grants name).
pub(super) fn answer(shared: &Shared, stream: &TcpStream, ring: &NoteRing) -> Result<(Hello, Qp, u64), TransportError> {
    let hs = Deadline::new(stream, shared.limits.handshake_timeout);
    let proven = hello::challenge(&mut hs.again(), &mut hs.again(), TRANSPORT, &shared.registry)?;
    let qp = qp_for(shared, &proven, ring).inspect_err(|e| {
        let _ = hello::send_refusal(&mut hs.again(), &e.to_string());
    })?;
    let peer_id = proven.session.peer_id;
    hello::send_hello(&mut hs.again(), &hello::prove(TRANSPORT, &proven, shared.hello(&qp, Some(peer_id))))?;
    Ok((proven.hello, qp, peer_id))
}

/// A QP receiving `proven`'s notes into `ring`, at RTR before we answer,
/// so the peer's first write finds it ready.
fn qp_for(shared: &Shared, proven: &Proven, ring: &NoteRing) -> Result<Qp, TransportError> {
    let pv = peer_verbs(&proven.hello)?;
    let mut qp = Qp::new(shared, 1, ring.slots, 1)?;
    qp.post_recvs(ring, 0..ring.slots)?;
    qp.connect(shared, &pv)?;
    Ok(qp)
}

fn peer_verbs(hello: &Hello) -> Result<VerbsAddr, TransportError> {
    let v = hello.verbs.ok_or_else(|| {
        TransportError::Refused(format!("peer {} sent a verbs hello without queue-pair data (qpn, psn, gid)", hello.node))
    })?;
    if !(1..=5).contains(&v.mtu) {
        return Err(TransportError::Refused(format!("peer {} sent MTU enum {} (valid: 1 = 256 … 5 = 4096)", hello.node, v.mtu)));
    }
    Ok(v)
}
