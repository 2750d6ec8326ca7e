//! The out-of-band handshake over TCP: each side's hello carries its
//! regions and its queue pair's address (QPN, PSN, GID, LID, MTU); the
//! source sends first, the destination answers with its hello or a `Nack`
//! saying why. Both bring their QP to RTR/RTS against the other's.

use super::shared::Shared;
use super::notes::NoteRing;
use super::qp::Qp;
use super::TRANSPORT;
use crate::hello;
use crate::TransportError;
use kvwire_core::protocol::{Hello, VerbsAddr};
use sideway::ibverbs::queue_pair::QueuePair;
use std::net::TcpStream;

impl Shared {
    /// This endpoint's hello for a connection through `qp`.
    pub(super) fn hello(&self, qp: &Qp) -> Hello {
        let qp = VerbsAddr { qpn: qp.qp.qp_number(), psn: qp.psn, gid: self.info.gid, lid: self.info.lid, mtu: self.info.mtu };
        hello::ours(TRANSPORT, &self.limits.node, self.descs(), Some(qp))
    }
}

/// The source's side: sends our hello, reads the peer's and brings `qp`
/// to RTS against it. Returns the peer's hello.
pub(super) fn initiate(shared: &Shared, stream: &mut TcpStream, qp: &mut Qp) -> Result<Hello, TransportError> {
    hello::send_hello(stream, &shared.hello(qp))?;
    let remote = hello::read_hello(stream, TRANSPORT)?;
    let pv = peer_verbs(&remote)?;
    qp.connect(shared, &pv)?;
    Ok(remote)
}

/// The destination's side: reads the peer's hello, makes a QP that
/// receives its notes into `ring`, and answers with our hello — or with a
/// `Nack` saying why not.
pub(super) fn answer(shared: &Shared, stream: &mut TcpStream, ring: &NoteRing) -> Result<(Hello, Qp), TransportError> {
    match ready_for(shared, stream, ring) {
        Ok((peer, qp)) => {
            hello::send_hello(stream, &shared.hello(&qp))?;
            Ok((peer, qp))
        }
        Err(e) => {
            let _ = hello::send_refusal(stream, &e.to_string());
            Err(e)
        }
    }
}

fn ready_for(shared: &Shared, stream: &mut TcpStream, ring: &NoteRing) -> Result<(Hello, Qp), TransportError> {
    let peer = hello::read_hello(stream, TRANSPORT)?;
    let pv = peer_verbs(&peer)?;
    let mut qp = Qp::new(shared, 1, ring.slots)?;
    qp.post_recvs(ring, 0..ring.slots)?;
    // RTR before answering, so the peer's first write finds us ready.
    qp.connect(shared, &pv)?;
    Ok((peer, qp))
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
