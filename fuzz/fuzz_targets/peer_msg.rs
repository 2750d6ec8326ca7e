//! Peer-control messages from another daemon (`PeerMsg` JSON, as
//! `wire::read_msg` hands it over, and the binary form of sealed
//! connections, `PeerMsg::from_binary`), and the strings the daemons then parse
//! from an `offer`, `accept` or `expect` (layout, format, manifest); then the
//! peer session state machines take the message in every phase.
#![no_main]

use kvwire_core::format::CacheFormat;
use kvwire_core::manifest::Manifest;
use kvwire_core::shard::LayoutSpec;
use kvwire_core::protocol::TransportKind;
use kvwire_core::reuse::CacheIdentity;
use kvwire_core::session::msg::{Offer, PeerMsg};
use kvwire_core::session::{DestinationSession, SourceSession, Timeouts};
use std::time::{Duration, Instant};
use kvwire_client::wire::{frame, parse};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(msg) = PeerMsg::from_binary(data) {
        assert_eq!(PeerMsg::from_binary(&msg.to_binary()).as_ref(), Ok(&msg), "binary round trip");
        sessions(msg);
    }
    let Ok(msg) = parse::<PeerMsg>(data) else {
        return;
    };
    assert_eq!(PeerMsg::from_binary(&msg.to_binary()).as_ref(), Ok(&msg), "binary round trip");
    // Whatever parses re-encodes and parses back to the same message.
    let bytes = frame(&msg);
    let again: PeerMsg = parse(&bytes[4..]).expect("a framed message parses");
    assert_eq!(again, msg, "peer message round trip");
    match &msg {
        PeerMsg::Accept(a) => {
            let _ = LayoutSpec::parse(&a.layout);
            let _ = CacheFormat::parse(&a.format);
        }
        PeerMsg::Offer(o) => {
            let _ = LayoutSpec::parse(&o.src_layout);
        }
        PeerMsg::Expect(e) => {
            if let Ok(m) = e.manifest.manifest() {
                assert_eq!(Manifest::from_wire(&m.to_wire()).as_ref(), Ok(&m), "manifest round trip");
            }
        }
        _ => {}
    }
    sessions(msg);
});

/// A source waiting for an accept, and one moving bytes, and a
/// destination with nothing yet: each takes the message without panicking,
/// and a refusal or error leaves them in a state that still answers.
fn sessions(msg: PeerMsg) {
    let now = Instant::now();
    let t = Timeouts { reply: Duration::from_secs(1), peer: Duration::from_secs(1), transfer: Duration::from_secs(10) };
    let offer = Offer {
        dst_group: "g".into(),
        dst_request: "r".into(),
        src_request: "s".into(),
        identity: CacheIdentity {
            model_digest: "m".into(),
            adapter_digest: String::new(),
            format: "bf16/v1".into(),
            tenant: "t".into(),
            rope: "theta=10000".into(),
            position_offset: 0,
        },
        tokens: 1,
        codec: None,
        src_layout: "tp=1".into(),
        src_num_blocks: 1,
        src_block_table: vec![0],
    };
    let (mut s, _) = SourceSession::start(now, offer, TransportKind::Tcp, t);
    if s.handle(now, msg.clone()).is_ok() {
        if s.expect(now, sample_expect(), 16).is_ok() {
            let _ = s.layer_sums(0, Vec::new());
            let _ = s.handle(now, msg.clone());
            // Every write completed: waiting for the verdict.
            let _ = s.moved();
            let _ = s.handle(now, msg.clone());
        }
    }
    let _ = s.abort("fuzz");
    let _ = s.handle_timeout(now + Duration::from_secs(11));
    let mut d = DestinationSession::new(now, "fuzz", t);
    let _ = d.handle(now, msg.clone());
    if let Some(slot) = msg.slot() {
        let _ = d.judged(slot, None);
    }
    let _ = d.handle(now, msg);
    let _ = d.handle_timeout(now + Duration::from_secs(11));
    let _ = d.closed();
}

fn sample_expect() -> kvwire_core::session::msg::Expect {
    kvwire_core::session::msg::Expect { slot: 0, manifest: kvwire_core::session::msg::ManifestWire::from_bytes(Vec::new()), layer_sums: false }
}
