//! Integrity manifests from a peer, in either form: `Manifest::from_json`
//! and `Manifest::from_wire` (the binary form daemons send) of the same
//! bytes, then `check` against a fixed `Expected` (the destination of a
//! real TP2 → TP1 transfer of 5 tokens, 2 of them a kept prefix, of a
//! three-layer model: dense, MLA, state; built once), then the round trip
//! through both forms.
#![no_main]

use kvwire_core::format::CacheFormat;
use kvwire_core::layout::from_toml_spec;
use kvwire_core::manifest::{Expected, Manifest};
use kvwire_core::plan::Side;
use kvwire_core::reuse::CacheIdentity;
use kvwire_core::shard::LayoutSpec;
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

const TINY: &str = "[[layers]]\nattention = \"dense\"\nkv_heads = 2\nhead_dim = 4\n\
[[layers]]\nattention = \"mla\"\nkv_lora_rank = 4\nqk_rope_head_dim = 2\n\
[[layers]]\nattention = \"none\"\nstate_bytes = 8\n";

/// The destination of the seed manifest `corpus/manifest_json/tiny-mla-state.json`
/// (`.bin`: the same in binary).
fn expected() -> &'static Expected {
    static E: OnceLock<Expected> = OnceLock::new();
    E.get_or_init(|| {
        let model = from_toml_spec("tiny", TINY).expect("spec");
        let fp32 = CacheFormat::parse("fp32").expect("fp32");
        let layout = LayoutSpec::parse("tp=1,layout=hnd,block=4").expect("layout");
        let dst = Side::new(&model, &layout, fp32, 5).expect("side");
        let identity = CacheIdentity {
            model_digest: "sha256:llama-3.1-8b@0e9e39f".into(),
            adapter_digest: "lora:support-v2".into(),
            format: "fp32/v1".into(),
            tenant: "acme".into(),
            rope: "theta=500000;scaling=llama3(factor=8,low_freq_factor=1,high_freq_factor=4,original_max_position_embeddings=8192)".into(),
            position_offset: 0,
        };
        Expected::new(&identity, &model, &dst, "req-tiny", 5, 2).expect("expected")
    })
}

fuzz_target!(|data: &[u8]| {
    for m in [Manifest::from_json(data), Manifest::from_wire(data)].into_iter().flatten() {
        let _ = m.check(expected());
        let _ = m.verify_checksums(&m.checksums);
        let json = m.to_json();
        assert_eq!(Manifest::from_json(json.as_bytes()).as_ref(), Ok(&m), "manifest JSON round trip");
        assert_eq!(Manifest::from_wire(&m.to_wire()).as_ref(), Ok(&m), "manifest binary round trip");
    }
});
