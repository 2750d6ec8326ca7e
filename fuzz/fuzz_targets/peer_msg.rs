//! Peer-control messages from another daemon (`PeerMsg` JSON, as
//! `wire::read_msg` hands it over), and the strings the destination then
//! parses from an `accept` or `expect` (layout, format, manifest).
#![no_main]

use kvwire_core::format::CacheFormat;
use kvwire_core::manifest::Manifest;
use kvwire_core::shard::LayoutSpec;
use kvwired::peer::PeerMsg;
use kvwire_client::wire::{frame, parse};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(msg) = parse::<PeerMsg>(data) else {
        return;
    };
    // Whatever parses re-encodes and parses back to the same message.
    let bytes = frame(&msg);
    let again: PeerMsg = parse(&bytes[4..]).expect("a framed message parses");
    assert_eq!(again, msg, "peer message round trip");
    match &msg {
        PeerMsg::Accept(a) => {
            let _ = LayoutSpec::parse(&a.layout);
            let _ = CacheFormat::parse(&a.format);
        }
        PeerMsg::Expect(e) => {
            let _ = LayoutSpec::parse(&e.src_layout);
            if let Ok(m) = Manifest::from_json(e.manifest.as_bytes()) {
                assert_eq!(Manifest::from_json(m.to_json().as_bytes()).as_ref(), Ok(&m), "manifest round trip");
            }
        }
        _ => {}
    }
});
