//! Peer data-plane frames: `Header::decode` over arbitrary bytes with an
//! arbitrary write limit, `Hello::decode` of the payload, and `check_write`
//! of what a write header asks for; and a verbs write-note message
//! (`WriteNote::decode_all`), checked as the destination checks each note.
//!
//! Input: 8 bytes little-endian `max_write` (the receiver's limit, also used
//! as the region length), then the frame as it arrives: 40-byte header, payload.
#![no_main]

use kvwire_core::protocol::{check_write, Header, Hello, Kind, Tag, WriteNote, HEADER_LEN, MAX_HELLO, NOTE_LEN, STRIDE_PREFIX};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (limit, frame) = match data.split_first_chunk::<8>() {
        Some((l, rest)) => (u64::from_le_bytes(*l), rest),
        None => (0, data),
    };
    let header = match Header::decode(frame, limit) {
        Ok(h) => h,
        Err(_) => {
            // A hello payload alone (the handshake's body) is outside bytes too.
            let _ = Hello::decode(frame, "tcp");
            notes(frame, limit);
            return;
        }
    };
    // A decoded header re-encodes to the same 40 bytes, and its length is
    // within the limit for its kind.
    assert_eq!(header.encode()[..], frame[..HEADER_LEN], "re-encoded header differs");
    assert_eq!(Tag::from_wire(header.tag.to_wire()), header.tag);
    let kind_limit = match header.kind {
        Kind::Hello => MAX_HELLO,
        Kind::Write => limit,
        Kind::StridedWrite => limit.saturating_add(STRIDE_PREFIX as u64),
        Kind::Ack => 0,
        Kind::Nack => 4096,
        Kind::Challenge => 32,
    };
    assert!(header.len <= kind_limit, "{:?} len {} past its limit {kind_limit}", header.kind, header.len);

    let rest = &frame[HEADER_LEN..];
    let payload = &rest[..rest.len().min(usize::try_from(header.len).unwrap_or(usize::MAX))];
    match header.kind {
        Kind::Hello => {
            for transport in ["tcp", "shm", "verbs"] {
                if let Ok(hello) = Hello::decode(payload, transport) {
                    assert_eq!(hello.transport, transport);
                    let again = Hello::decode(&hello.encode(), transport).expect("an encoded hello decodes");
                    assert_eq!(again, hello, "hello round trip");
                }
            }
        }
        Kind::Write => {
            // The destination checks the write against the region its key names.
            for region_len in [None, Some(limit), Some(header.offset), Some(u64::MAX)] {
                if let Ok(r) = check_write(header.key, region_len, header.offset, header.len) {
                    let region_len = region_len.expect("no region refuses");
                    assert!(header.len > 0, "zero-length write accepted");
                    assert_eq!((r.start, r.end - r.start), (header.offset, header.len));
                    assert!(r.end <= region_len, "write range {r:?} past region of {region_len}");
                }
            }
        }
        Kind::StridedWrite => {
            // The prefix (runs, distance), then equal runs: the span from the
            // first run to the last is what the destination checks.
            if payload.len() >= STRIDE_PREFIX {
                let runs = u64::from_le_bytes(payload[..8].try_into().expect("8 bytes"));
                let stride = u64::from_le_bytes(payload[8..16].try_into().expect("8 bytes"));
                let bytes = header.len - STRIDE_PREFIX as u64;
                if runs > 0 && bytes % runs == 0 {
                    let run = bytes / runs;
                    if let Some(span) = (runs - 1).checked_mul(stride).and_then(|s| s.checked_add(run)) {
                        if let Ok(r) = check_write(header.key, Some(limit), header.offset, span) {
                            assert!(span > 0 && r.end <= limit, "strided span {r:?} past region of {limit}");
                        }
                    }
                }
            }
        }
        Kind::Nack => {
            let _ = String::from_utf8_lossy(payload);
        }
        Kind::Ack | Kind::Challenge => {}
    }
});

/// A received note buffer: whole notes only, each re-encoding to its bytes,
/// and checked against a region of `region_len` bytes.
fn notes(b: &[u8], region_len: u64) {
    let Ok(notes) = WriteNote::decode_all(b) else {
        assert!(b.len() % NOTE_LEN != 0, "whole notes refused");
        return;
    };
    assert_eq!(notes.len() * NOTE_LEN, b.len());
    for (n, raw) in notes.iter().zip(b.chunks_exact(NOTE_LEN)) {
        let mut again = [0u8; NOTE_LEN];
        n.encode(&mut again);
        assert_eq!(&again[..], raw, "note round trip");
        if let Ok(r) = check_write(n.key, Some(region_len), n.offset, n.len) {
            assert!(n.len > 0 && r.end <= region_len, "note range {r:?} past region of {region_len}");
        }
    }
}
