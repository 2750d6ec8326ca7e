//! The data plane's handshake (kvwire_transport::hello) against whatever
//! a stranger sends: the destination's side (challenge, then the source's
//! hello, read with the pre-authentication limit) and the source's side
//! (facing a hostile destination). Neither may accept bytes that prove
//! nothing, and the destination sends its challenge and, at most, a
//! refusal saying why: nothing about its memory.
#![no_main]

use kvwire_core::protocol::{Header, Hello, Kind, HEADER_LEN, NONCE_LEN, PROTOCOL_VERSION};
use kvwire_transport::hello::{challenge, initiate};
use kvwire_transport::{Credential, Registry};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let registry = Registry::new(4);
    let cred = Credential::derive(b"fuzz-secret", b"server-nonce", b"client-nonce", "src", "dst");
    registry.open_session(&cred, "src").expect("one session fits");
    for transport in ["tcp", "shm", "verbs"] {
        let mut out = Vec::new();
        let verdict = challenge(&mut &data[..], &mut out, transport, &registry);
        // The nonce is fresh per call: no input can carry a proof for it.
        assert!(verdict.is_err(), "{transport}: a stranger's bytes proved a session");
        // What went out: the challenge, then at most a refusal naming why.
        let challenge_frame = Header::decode(&out, 0).expect("the challenge is a frame");
        assert_eq!((challenge_frame.kind, challenge_frame.len), (Kind::Challenge, NONCE_LEN as u64), "{transport}: the first frame is not the challenge");
        let rest = &out[HEADER_LEN + NONCE_LEN..];
        if !rest.is_empty() {
            let nack = Header::decode(rest, 0).expect("what follows the challenge is a frame");
            assert_eq!(nack.kind, Kind::Nack, "{transport}: the destination said more than its challenge and a refusal");
            assert_eq!(rest.len() as u64, HEADER_LEN as u64 + nack.len, "{transport}: bytes after the refusal");
        }

        let ours = Hello {
            version: PROTOCOL_VERSION,
            transport: transport.into(),
            node: "src".into(),
            regions: vec![],
            verbs: None,
            session: None,
            nonce: String::new(),
            proof: String::new(),
        };
        let mut sent = Vec::new();
        let theirs = initiate(&mut &data[..], &mut sent, transport, &cred, ours);
        assert!(theirs.is_err(), "{transport}: a source took a destination that proved nothing");
    }
});
