//! Sealed peer-control frames (kvwired::peer): arbitrary bytes opened as
//! a frame fail their seal before any of them is parsed; a message that
//! parses (from JSON or its binary form), sealed, opens to itself at its own place in the stream and at
//! no other, and not under another key.
#![no_main]

use kvwire_client::wire::parse;
use kvwire_core::session::msg::PeerMsg;
use kvwired::peer::{open_frame, seal_frame};
use libfuzzer_sys::fuzz_target;

const KEY: [u8; 32] = [7; 32];

fuzz_target!(|data: &[u8]| {
    assert!(open_frame(&KEY, 0, &mut &data[..]).is_err(), "unsealed bytes opened");
    // A message read from JSON (the seeds) or from its binary form.
    for msg in [parse::<PeerMsg>(data).ok(), PeerMsg::from_binary(data).ok()].into_iter().flatten() {
        let frame = seal_frame(&KEY, 3, &msg);
        assert_eq!(open_frame(&KEY, 3, &mut &frame[..]).expect("a sealed frame opens"), msg);
        assert!(open_frame(&KEY, 4, &mut &frame[..]).is_err(), "a frame opened at another sequence number");
        assert!(open_frame(&[8; 32], 3, &mut &frame[..]).is_err(), "a frame opened under another key");
    }
});
