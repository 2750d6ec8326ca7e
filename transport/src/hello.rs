//! Control framing every backend shares: hellos, answers (`Ack`, `Nack`)
//! and reading a frame with its payload. Each control frame is a
//! [`Header`] whose `len` bytes of payload follow (see
//! [`kvwire_core::protocol`]); only the order of the handshake messages
//! differs between backends, and each backend's module docs give it.

use crate::accept::Refusal;
use crate::TransportError;
use kvwire_core::protocol::{Header, Hello, Kind, RegionDesc, Tag, VerbsAddr, HEADER_LEN, PROTOCOL_VERSION};
use std::io::{Read, Write};

/// Largest `Nack` payload (what [`Header::decode`] accepts).
pub(crate) const MAX_NACK: usize = 4096;

/// This side's hello.
pub(crate) fn ours(transport: &str, node: &str, regions: Vec<RegionDesc>, verbs: Option<VerbsAddr>) -> Hello {
    Hello { version: PROTOCOL_VERSION, transport: transport.into(), node: node.into(), regions, verbs }
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
    let mut b = [0u8; HEADER_LEN];
    r.read_exact(&mut b).map_err(TransportError::io(op))?;
    let h = Header::decode(&b, max_write)?;
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
