//! The data plane's handshake (kvwire_transport::hello) against whatever
//! a stranger sends: the destination's side (challenge, then the source's
//! hello, read with the pre-authentication limit) and the source's side
//! (facing a hostile destination). Neither may accept bytes that prove
//! nothing, and before its verdict the destination sends its challenge and
//! nothing else.
#![no_main]

use kvwire_core::protocol::{Hello, HEADER_LEN, NONCE_LEN, PROTOCOL_VERSION};
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
        assert_eq!(out.len(), HEADER_LEN + NONCE_LEN, "{transport}: the destination said more than its challenge");

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
