//! Parallel layout strings (`tp=4,pp=2,…`, what a client registers and a
//! peer sends) and explicit shard maps (TOML), resolved against two small
//! models: llama-3.1-8b (32 dense layers, 8 KV heads) and the hybrid example
//! (dense, sliding, MLA, shared and state layers). The layout is then used
//! as a side of a transfer at a short request.
//!
//! Input: the layout string; if it contains a line `---`, what follows is an
//! explicit map (`[[rank]]` entries).
#![no_main]

use kvwire_core::format::CacheFormat;
use kvwire_core::layout::{builtin, from_toml_spec, ModelSpec};
use kvwire_core::plan::Side;
use kvwire_core::shard::LayoutSpec;
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

fn models() -> &'static [ModelSpec; 2] {
    static MODELS: OnceLock<[ModelSpec; 2]> = OnceLock::new();
    MODELS.get_or_init(|| {
        let hybrid = include_str!("../../config/examples/hybrid.toml");
        [builtin("llama-3.1-8b").expect("built-in"), from_toml_spec("hybrid", hybrid).expect("example spec")]
    })
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let (layout, explicit) = match text.split_once("\n---\n") {
        Some((l, e)) => (l, Some(e)),
        None => (text, None),
    };
    let Ok(mut spec) = LayoutSpec::parse(layout) else {
        return;
    };
    if let Some(e) = explicit {
        match spec.with_explicit_toml(e) {
            Ok(s) => spec = s,
            Err(_) => return,
        }
    }
    for model in models() {
        let Ok(map) = spec.shard_map(model) else {
            continue;
        };
        kvwire_fuzz::check_shard_map(model, &map);
        let bf16 = CacheFormat::parse("bf16").expect("bf16");
        for tokens in [1, 100] {
            if let Ok(side) = Side::new(model, &spec, bf16, tokens) {
                for rank in 0..(map.ranks.len() as u32).min(4) {
                    let _ = side.regions(model, rank);
                }
            }
        }
    }
});
