//! Control-socket messages from a local client: the frame body parsed as a
//! `Request`, the stream framing (`read_msg`), and the strings the daemon
//! then parses from a `register_cache` (layout, format, model source).
//!
//! Input: a frame body (JSON). The same bytes are also read as a stream of
//! length-prefixed frames.
#![no_main]

use kvwire_core::format::CacheFormat;
use kvwire_core::layout::{builtin, from_hf_config, from_toml_spec};
use kvwire_core::shard::LayoutSpec;
use kvwire_client::control::{ModelSource, Request};
use kvwire_client::wire::{frame, parse, read_msg};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(req) = parse::<Request>(data) {
        // Whatever parses re-encodes and parses back to the same request.
        let bytes = frame(&req);
        let len = u32::from_le_bytes(bytes[..4].try_into().expect("4 bytes")) as usize;
        assert_eq!(len, bytes.len() - 4, "frame length prefix");
        let again: Request = parse(&bytes[4..]).expect("a framed request parses");
        assert_eq!(again, req, "request round trip");
        let mut stream = &bytes[..];
        let read: Request = read_msg(&mut stream).expect("a framed request reads");
        assert_eq!(read, req);
        if let Request::RegisterCache(r) = &req {
            let _ = CacheFormat::parse(&r.format);
            let model = match &r.model {
                ModelSource::Builtin(name) => builtin(name),
                ModelSource::HfConfig(text) => from_hf_config(&r.group, text),
                ModelSource::Toml(text) => from_toml_spec(&r.group, text),
            };
            if let (Ok(layout), Ok(model)) = (LayoutSpec::parse(&r.layout), model) {
                if let Ok(map) = layout.shard_map(&model) {
                    kvwire_fuzz::check_shard_map(&model, &map);
                }
            }
        }
    }
    // The same bytes as a stream of frames: a length past the limit is
    // refused before anything is allocated.
    let mut stream = data;
    for _ in 0..4 {
        if read_msg::<Request>(&mut stream).is_err() {
            break;
        }
    }
});
