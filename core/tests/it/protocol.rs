//! Wire protocol: header round trips, hostile headers, hello checks, write checks.

use kvwire_core::protocol::*;
use proptest::prelude::*;

fn header(kind: Kind, len: u64) -> Header {
    Header { kind, tag: Tag { slot: 7, layer: 81 }, key: 0xABCD_1234, seq: 99, offset: 1 << 40, len }
}

#[test]
fn header_round_trips_and_names_its_fields_on_the_wire() {
    let h = header(Kind::Write, 4096);
    let b = h.encode();
    assert_eq!(&b[0..4], b"KVW1");
    assert_eq!(u16::from_le_bytes([b[4], b[5]]), 2);
    // Tag: slot in the high half, layer in the low half.
    assert_eq!(u32::from_le_bytes(b[8..12].try_into().unwrap()), 7 << 16 | 81);
    assert_eq!(Header::decode(&b, 1 << 20).unwrap(), h);
}

#[test]
fn hostile_headers_are_refused_by_name() {
    let mut b = header(Kind::Write, 16).encode();
    b[0] = b'X';
    assert!(matches!(Header::decode(&b, 1 << 20), Err(FrameError::Magic(_))));
    let mut b = header(Kind::Write, 16).encode();
    b[4] = 9;
    assert_eq!(Header::decode(&b, 1 << 20), Err(FrameError::Kind(9)));
    let mut b = header(Kind::Write, 16).encode();
    b[6] = 1;
    assert_eq!(Header::decode(&b, 1 << 20), Err(FrameError::Flags(1)));
    let b = header(Kind::Write, 1 << 21).encode();
    assert_eq!(Header::decode(&b, 1 << 20), Err(FrameError::TooLong { kind: Kind::Write, len: 1 << 21, limit: 1 << 20 }));
    let b = header(Kind::Hello, MAX_HELLO + 1).encode();
    assert!(matches!(Header::decode(&b, u64::MAX), Err(FrameError::TooLong { kind: Kind::Hello, .. })));
    let b = header(Kind::Ack, 1).encode();
    assert!(matches!(Header::decode(&b, u64::MAX), Err(FrameError::TooLong { kind: Kind::Ack, .. })));
    assert_eq!(Header::decode(&b[..10], 1), Err(FrameError::Truncated(10)));
}

#[test]
fn hello_checks_version_and_transport() {
    let h = Hello { version: PROTOCOL_VERSION, transport: "tcp".into(), node: "a".into(), regions: vec![], verbs: None, session: None, nonce: String::new(), proof: String::new() };
    assert_eq!(Hello::decode(&h.encode(), "tcp").unwrap(), h);
    let old = Hello { version: 0, ..h.clone() };
    let e = Hello::decode(&old.encode(), "tcp").unwrap_err();
    assert_eq!(e, HelloError::Version { node: "a".into(), theirs: 0, ours: PROTOCOL_VERSION });
    assert!(e.to_string().contains("version 0"), "{e}");
    let e = Hello::decode(&h.encode(), "verbs").unwrap_err();
    assert!(matches!(e, HelloError::Transport { .. }), "{e}");
    assert!(matches!(Hello::decode(b"{\"version\":1}", "tcp"), Err(HelloError::Malformed(_))));
    assert!(matches!(Hello::decode(b"\xff\xfe", "tcp"), Err(HelloError::Malformed(_))));
}

#[test]
fn write_checks() {
    assert_eq!(check_write(5, Some(100), 10, 90), Ok(10..100));
    assert_eq!(check_write(5, None, 0, 1), Err(WriteError::UnknownKey(5)));
    assert_eq!(check_write(5, Some(100), 0, 0), Err(WriteError::ZeroLength));
    assert_eq!(check_write(5, Some(100), 10, 91), Err(WriteError::OutOfBounds { key: 5, offset: 10, len: 91, region_len: 100 }));
    assert!(matches!(check_write(5, Some(100), u64::MAX, 2), Err(WriteError::OutOfBounds { .. })));
}

proptest! {
    /// Any 40 bytes decode to a header or a named error, never a panic;
    /// whatever decodes re-encodes to the same bytes.
    #[test]
    fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64), limit in any::<u64>()) {
        if let Ok(h) = Header::decode(&bytes, limit) {
            prop_assert_eq!(&h.encode()[..], &bytes[..HEADER_LEN]);
            prop_assert!(h.len <= limit.max(MAX_HELLO));
        }
    }
}

#[test]
fn write_notes_round_trip_and_refuse_partial_notes() {
    use kvwire_core::protocol::{WriteNote, NOTE_LEN};
    let notes = [
        WriteNote { tag: Tag { slot: 3, layer: 70 }, key: 0xdead_beef, offset: 1 << 40, len: 4096 },
        WriteNote { tag: Tag { slot: 0, layer: 0 }, key: 1, offset: 0, len: u64::MAX },
    ];
    let mut buf = vec![0u8; notes.len() * NOTE_LEN];
    for (n, c) in notes.iter().zip(buf.chunks_exact_mut(NOTE_LEN)) {
        n.encode(c);
    }
    assert_eq!(WriteNote::decode_all(&buf).unwrap(), notes);
    assert_eq!(WriteNote::decode_all(&[]).unwrap(), vec![]);
    let e = WriteNote::decode_all(&buf[..NOTE_LEN + 5]).unwrap_err();
    assert_eq!(e.to_string(), format!("write-note message of {} bytes is not a multiple of {NOTE_LEN}", NOTE_LEN + 5));
}
