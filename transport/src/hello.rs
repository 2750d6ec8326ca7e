//! Control framing every backend shares: the authenticated handshake,
//! answers (`Ack`, `Nack`) and reading a frame with its payload. Each
//! control frame is a [`Header`] whose `len` bytes of payload follow (see
//! [`kvwire_core::protocol`]).
//!
//! # The handshake (every backend, on its out-of-band stream)
//!
//! 1. destination → `Challenge`: its nonce `nd` (32 random bytes);
//! 2. source → `Hello`: its session id, its nonce `ns`, and
//!    `HMAC(session key, "kvwire-data-source-v1" ‖ transport ‖ nd ‖ ns ‖ source node)`;
//!    the destination reads at most [`MAX_UNAUTHENTICATED_HELLO`] bytes of
//!    it, and checks the session is open, the proof, and that the node is
//!    the one that opened the session;
//! 3. destination → `Hello`: `HMAC(session key, "kvwire-data-destination-v1" ‖ transport ‖ ns ‖ nd ‖ destination node)`,
//!    and what the source needs to write (verbs: its queue pair, and the
//!    regions granted to this session) — or `Nack` with the reason, and
//!    the connection closes.
//!
//! Nothing about the destination's memory leaves before step 3, the whole
//! exchange runs under one deadline, and a fresh `nd` per connection means
//! a recorded hello proves nothing twice.

use crate::accept::Refusal;
use crate::auth::{self, Credential};
pub(crate) use crate::auth::Deadline;
use crate::registry::{Registry, Session};
use crate::TransportError;
use kvwire_core::protocol::{Header, Hello, Kind, RegionDesc, Tag, VerbsAddr, HEADER_LEN, MAX_UNAUTHENTICATED_HELLO, NONCE_LEN, PROTOCOL_VERSION};
use std::io::{Read, Write};

const SOURCE_PROOF: &str = "kvwire-data-source-v1";
const DESTINATION_PROOF: &str = "kvwire-data-destination-v1";

/// Largest `Nack` payload (what [`Header::decode`] accepts).
pub(crate) const MAX_NACK: usize = 4096;

/// This side's hello.
pub(crate) fn ours(transport: &str, node: &str, regions: Vec<RegionDesc>, verbs: Option<VerbsAddr>) -> Hello {
    Hello { version: PROTOCOL_VERSION, transport: transport.into(), node: node.into(), regions, verbs, session: None, nonce: String::new(), proof: String::new() }
}

/// The source's side, on a fresh stream: reads the challenge, sends `ours`
/// with the proof of `cred`, and returns the destination's hello once it
/// proved the same session.
pub fn initiate(r: &mut impl Read, w: &mut impl Write, transport: &str, cred: &Credential, mut ours: Hello) -> Result<Hello, TransportError> {
    let (h, nd) = read_frame(r, 0, "receive challenge")?;
    match h.kind {
        Kind::Challenge if nd.len() == NONCE_LEN => {}
        Kind::Nack => return Err(refused(&nd)),
        k => return Err(TransportError::Refused(format!("expected the destination's challenge, got {k:?} with {} bytes", nd.len()))),
    }
    let ns = auth::random_bytes::<NONCE_LEN>();
    let proof = auth::mac(cred.key(), SOURCE_PROOF, &[transport.as_bytes(), &nd, &ns, ours.node.as_bytes()]);
    ours.session = Some(cred.session);
    ours.nonce = auth::hex(&ns);
    ours.proof = auth::hex(&proof);
    send_hello(w, &ours)?;
    let theirs = read_hello(r, transport)?;
    let proof = auth::unhex(&theirs.proof, 32).unwrap_or_default();
    if !auth::verify(cred.key(), DESTINATION_PROOF, &[transport.as_bytes(), &ns, &nd, theirs.node.as_bytes()], &proof) {
        return Err(TransportError::Refused(format!("destination `{}` did not prove the session: not the daemon that accepted this transfer", printable(&theirs.node))));
    }
    Ok(theirs)
}

/// A source that proved its session (step 2).
#[derive(Debug)]
pub struct Proven {
    /// Its hello.
    pub hello: Hello,
    /// The session it proved.
    pub session: Session,
    ns: Vec<u8>,
    nd: [u8; NONCE_LEN],
}

/// The destination's steps 1 and 2: challenges, then reads and checks the
/// source's hello. A hello it refuses (malformed, another version, no
/// proof) is answered with a `Nack` saying why, so the peer's error names
/// the cause; the caller then closes the connection.
pub fn challenge(r: &mut impl Read, w: &mut impl Write, transport: &str, registry: &Registry) -> Result<Proven, TransportError> {
    let proven = check_source(r, w, transport, registry);
    if let Err(e) = &proven {
        registry.handshake_refused();
        if let TransportError::Hello(_) | TransportError::Refused(_) | TransportError::Frame(_) = e {
            let _ = send_refusal(w, &e.to_string());
        }
    }
    proven
}

fn check_source(r: &mut impl Read, w: &mut impl Write, transport: &str, registry: &Registry) -> Result<Proven, TransportError> {
    let nd = auth::random_bytes::<NONCE_LEN>();
    send(w, &control(Kind::Challenge, &nd), "send challenge")?;
    let (h, payload) = read_frame_within(r, 0, MAX_UNAUTHENTICATED_HELLO, "receive hello")?;
    if h.kind != Kind::Hello {
        return Err(TransportError::Refused(format!("expected a Hello frame in the handshake, got {:?}", h.kind)));
    }
    let hello = Hello::decode(&payload, transport)?;
    let node = printable(&hello.node);
    let id = hello.session.ok_or_else(|| TransportError::Refused(format!("`{node}`'s hello names no session: connect through a daemon's peer handshake")))?;
    let session = registry.session(id).ok_or_else(|| TransportError::Refused(format!("`{node}` names session {id:016x}, which is not open here")))?;
    let ns = auth::unhex(&hello.nonce, NONCE_LEN).filter(|n| n.len() == NONCE_LEN);
    let proof = auth::unhex(&hello.proof, 32).unwrap_or_default();
    let Some(ns) = ns.filter(|ns| auth::verify(session.credential.key(), SOURCE_PROOF, &[transport.as_bytes(), &nd, ns, hello.node.as_bytes()], &proof)) else {
        return Err(TransportError::Refused(format!("`{node}` did not prove session {id:016x}")));
    };
    if hello.node != session.peer {
        return Err(TransportError::Refused(format!("`{node}` proved session {id:016x}, which belongs to `{}`", session.peer)));
    }
    Ok(Proven { hello, session, ns, nd })
}

/// The destination's step 3: `ours`, proving the session back.
pub fn prove(transport: &str, proven: &Proven, mut ours: Hello) -> Hello {
    let proof = auth::mac(proven.session.credential.key(), DESTINATION_PROOF, &[transport.as_bytes(), &proven.ns, &proven.nd, ours.node.as_bytes()]);
    ours.proof = auth::hex(&proof);
    ours
}

/// An outsider's string as logs and errors may show it: printable ASCII,
/// at most 64 characters.
pub(crate) fn printable(s: &str) -> String {
    let mut out: String = s.chars().take(64).map(|c| if c.is_ascii_graphic() || c == ' ' { c } else { '?' }).collect();
    if s.chars().count() > 64 {
        out.push('…');
    }
    out
}

/// A `Nack` payload: the reason, cut at a character boundary to what a
/// header may carry.
pub(crate) fn nack_text(reason: &str) -> &[u8] {
    let mut end = reason.len().min(MAX_NACK);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    &reason.as_bytes()[..end]
}

/// A handshake frame: `kind` with `payload`, every other field zero.
pub(crate) fn control(kind: Kind, payload: &[u8]) -> Vec<u8> {
    frame(Header { kind, tag: Tag { slot: 0, layer: 0 }, key: 0, seq: 0, offset: 0, len: payload.len() as u64 }, payload)
}

/// The answer to write `seq` (which counted toward `tag` in region `key`):
/// `Ack` with the bytes placed, or `Nack` with the refusal's text.
pub(crate) fn answer(tag: Tag, key: u32, seq: u64, result: Result<u64, &Refusal>) -> Vec<u8> {
    match result {
        Ok(placed) => Header { kind: Kind::Ack, tag, key, seq, offset: placed, len: 0 }.encode().to_vec(),
        Err(why) => {
            let text = why.to_string();
            let text = nack_text(&text);
            frame(Header { kind: Kind::Nack, tag, key, seq, offset: 0, len: text.len() as u64 }, text)
        }
    }
}

fn frame(h: Header, payload: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(HEADER_LEN + payload.len());
    v.extend_from_slice(&h.encode());
    v.extend_from_slice(payload);
    v
}

/// Sends our hello.
pub(crate) fn send_hello(w: &mut impl Write, h: &Hello) -> Result<(), TransportError> {
    send(w, &control(Kind::Hello, &h.encode()), "send hello")
}

/// Sends a handshake `Nack` saying why.
pub(crate) fn send_refusal(w: &mut impl Write, why: &str) -> Result<(), TransportError> {
    send(w, &control(Kind::Nack, nack_text(why)), "send handshake refusal")
}

/// Writes and flushes `bytes`.
pub(crate) fn send(w: &mut impl Write, bytes: &[u8], op: &'static str) -> Result<(), TransportError> {
    w.write_all(bytes).and_then(|()| w.flush()).map_err(TransportError::io(op))
}

/// Reads one frame: a header (refused past the limits [`Header::decode`]
/// applies, `max_write` for `Write` frames) and its payload.
pub(crate) fn read_frame(r: &mut impl Read, max_write: u64, op: &'static str) -> Result<(Header, Vec<u8>), TransportError> {
    read_frame_within(r, max_write, u64::MAX, op)
}

/// [`read_frame`], refusing any payload over `max` before reading it.
pub(crate) fn read_frame_within(r: &mut impl Read, max_write: u64, max: u64, op: &'static str) -> Result<(Header, Vec<u8>), TransportError> {
    let mut b = [0u8; HEADER_LEN];
    r.read_exact(&mut b).map_err(TransportError::io(op))?;
    let h = Header::decode(&b, max_write)?;
    if h.len > max {
        return Err(kvwire_core::protocol::FrameError::TooLong { kind: h.kind, len: h.len, limit: max }.into());
    }
    let mut payload = vec![0u8; h.len as usize];
    r.read_exact(&mut payload).map_err(TransportError::io(op))?;
    Ok((h, payload))
}

/// Reads the peer's hello for `transport` and checks it. A `Nack` (the
/// peer refused ours) or any other frame is an error naming it.
pub(crate) fn read_hello(r: &mut impl Read, transport: &str) -> Result<Hello, TransportError> {
    let (h, payload) = read_frame(r, 0, "receive hello")?;
    match h.kind {
        Kind::Hello => Ok(Hello::decode(&payload, transport)?),
        Kind::Nack => Err(refused(&payload)),
        k => Err(TransportError::Refused(format!("expected a Hello frame in the handshake, got {k:?}"))),
    }
}

/// The error a handshake `Nack` becomes.
pub(crate) fn refused(payload: &[u8]) -> TransportError {
    TransportError::Refused(format!("peer refused the handshake: {}", String::from_utf8_lossy(payload)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nack_text_is_cut_at_a_character_boundary() {
        let long = "é".repeat(MAX_NACK);
        let t = nack_text(&long);
        assert!(t.len() <= MAX_NACK && t.len() >= MAX_NACK - 1);
        assert!(std::str::from_utf8(t).is_ok());
    }

    #[test]
    fn a_hello_round_trips_through_read_hello() {
        let h = ours("tcp", "n", vec![], None);
        let mut buf = Vec::new();
        send_hello(&mut buf, &h).unwrap();
        assert_eq!(read_hello(&mut buf.as_slice(), "tcp").unwrap(), h);
        let nack = control(Kind::Nack, b"full");
        assert_eq!(read_hello(&mut nack.as_slice(), "tcp").unwrap_err(), TransportError::Refused("peer refused the handshake: full".into()));
    }
}
