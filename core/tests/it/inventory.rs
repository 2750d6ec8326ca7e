//! Inventory tests: byte counts of real models against hand-derived formulas.
//!
//! Every expected figure is written out as arithmetic from the model's
//! published config facts; none comes from the code under test.

// `1 /*kv head*/ * …` keeps each factor of a formula visible.
#![allow(clippy::identity_op)]

use kvwire_core::format::{CacheFormat, FormatError, Scales, FORMATS};
use kvwire_core::layout::{
    builtin, from_hf_config, from_toml_spec, inventory, Geometry, GeometryError, Inventory, ModelSpec, SpecError,
};
use serde_json::{Map, Value};

const LLAMA_8B: &str = include_str!("../../../config/models/llama-3.1-8b.json");
const QWEN25_7B: &str = include_str!("../../../config/models/qwen2.5-7b.json");
const GPT_OSS_20B: &str = include_str!("../../../config/models/gpt-oss-20b.json");

fn fmt(name: &str) -> CacheFormat {
    CacheFormat::parse(name).unwrap()
}

fn geo(format: &str, block_size: u32) -> Geometry {
    Geometry::new(fmt(format), block_size).unwrap()
}

fn inv(model: &ModelSpec, format: &str, tokens: u64) -> Inventory {
    inventory(model, &geo(format, 16), tokens).unwrap()
}

fn model(name: &str) -> ModelSpec {
    builtin(name).unwrap()
}

/// A real config with some fields changed; `Value::Null` removes a field.
fn hf_edited(base: &str, edits: &[(&str, Value)]) -> Result<ModelSpec, SpecError> {
    let mut root: Map<String, Value> = serde_json::from_str(base).unwrap();
    for (key, value) in edits {
        if value.is_null() {
            root.remove(*key);
        } else {
            root.insert((*key).to_string(), value.clone());
        }
    }
    from_hf_config("edited", &serde_json::to_string(&root).unwrap())
}

fn kinds_of(inv: &Inventory) -> Vec<&'static str> {
    inv.per_layer.iter().map(|l| l.kind).collect()
}

// ---- dense GQA ----

#[test]
fn llama_3_1_8b_counts_kv_heads_not_query_heads() {
    let m = model("llama-3.1-8b");
    let tokens = 4096;
    let i = inv(&m, "bf16", tokens);
    // 32 query heads in the config; only the 8 KV heads are cached.
    let per_token = 32 /*layers*/ * 8 /*kv heads*/ * 128 /*head_dim = 4096/32*/ * 2 /*K,V*/ * 2 /*bf16*/;
    assert_eq!(per_token, 131_072);
    assert_eq!(i.per_token_bytes, Some(per_token));
    assert_eq!(i.payload_bytes, per_token * tokens);
    assert_eq!(i.payload_bytes, 536_870_912); // 512 MiB, the commonly quoted figure
    assert_eq!(i.fixed_bytes, 0);
    // 4096 is a whole number of 16-token blocks: nothing rounds up.
    assert_eq!(i.allocated_bytes, i.payload_bytes);
    assert_eq!(i.format, "bf16/v1");
    assert_eq!(i.wire_bytes, None);
    assert_eq!(i.per_layer.len(), 32);
    assert!(i.per_layer.iter().all(|l| l.kind == "full" && l.retained_tokens == tokens));
    assert!(i.per_layer.iter().all(|l| l.payload_bytes == 8 * 128 * 2 * 2 * tokens));
}

#[test]
fn llama_3_1_70b_counts_kv_heads_not_query_heads() {
    let m = model("llama-3.1-70b");
    let tokens = 1000;
    let i = inv(&m, "bf16", tokens);
    let per_token = 80 /*layers*/ * 8 /*kv heads, not 64 query heads*/ * 128 /*8192/64*/ * 2 /*K,V*/ * 2 /*bf16*/;
    assert_eq!(i.per_token_bytes, Some(per_token));
    assert_eq!(i.payload_bytes, per_token * tokens);
    // With query heads it would be 8× larger.
    assert_ne!(i.payload_bytes, 80 * 64 * 128 * 2 * 2 * tokens);
}

#[test]
fn qwen3_8b_uses_explicit_head_dim() {
    let m = model("qwen3-8b");
    let i = inv(&m, "bf16", 100);
    let per_token = 36 /*layers*/ * 8 /*kv heads*/ * 128 /*head_dim*/ * 2 /*K,V*/ * 2 /*bf16*/;
    assert_eq!(i.per_token_bytes, Some(per_token));
    assert_eq!(i.payload_bytes, per_token * 100);
}

#[test]
fn missing_num_key_value_heads_defaults_to_query_heads() {
    let m = hf_edited(LLAMA_8B, &[("num_key_value_heads", Value::Null)]).unwrap();
    let i = inv(&m, "bf16", 10);
    // Plain MHA: 32 KV heads.
    assert_eq!(i.per_token_bytes, Some(32 /*layers*/ * 32 /*heads*/ * 128 * 2 * 2));
}

#[test]
fn separate_v_head_dim_is_honoured() {
    let m = hf_edited(LLAMA_8B, &[("v_head_dim", Value::from(64))]).unwrap();
    let i = inv(&m, "bf16", 10);
    let per_token = 32 /*layers*/ * 8 /*kv heads*/ * (128 /*K*/ + 64 /*V*/) * 2 /*bf16*/;
    assert_eq!(i.per_token_bytes, Some(per_token));
}

// ---- MLA ----

#[test]
fn deepseek_v2_lite_stores_one_latent_per_layer() {
    let m = model("deepseek-v2-lite");
    let tokens = 2048;
    let i = inv(&m, "bf16", tokens);
    // The config lists 16 KV heads; MLA caches one latent with no head dimension.
    let per_token = 27 /*layers*/ * (512 /*kv_lora_rank*/ + 64 /*qk_rope_head_dim*/) * 2 /*bf16*/;
    assert_eq!(i.per_token_bytes, Some(per_token));
    assert_eq!(i.payload_bytes, per_token * tokens);
    assert_ne!(i.payload_bytes, per_token * 16 * tokens);
    assert!(i.per_layer.iter().all(|l| l.kind == "mla"));
}

#[test]
fn deepseek_v3_stores_one_latent_per_layer() {
    let m = model("deepseek-v3");
    let tokens = 4096;
    let i = inv(&m, "bf16", tokens);
    let per_token = 61 /*layers*/ * (512 /*kv_lora_rank*/ + 64 /*qk_rope_head_dim*/) * 2 /*bf16*/;
    assert_eq!(per_token, 70_272);
    assert_eq!(i.per_token_bytes, Some(per_token));
    assert_eq!(i.payload_bytes, per_token * tokens);
    // Not multiplied by the 128 KV heads the config lists.
    assert_ne!(i.payload_bytes, per_token * 128 * tokens);
}

#[test]
fn deepseek_v3_weight_quantization_does_not_change_cache_dtype() {
    // quantization_config says fp8 weights; the cache default stays torch_dtype.
    assert_eq!(model("deepseek-v3").dtype.as_deref(), Some("bfloat16"));
}

#[test]
fn mla_static_fp8_scale_is_one_per_latent_per_layer() {
    let m = model("deepseek-v3");
    let i = inv(&m, "fp8_e4m3", 1000);
    let fixed = 61 /*layers*/ * 1 /*latent tensor*/ * 4 /*f32 scale*/;
    assert_eq!(i.fixed_bytes, fixed);
    assert_eq!(i.payload_bytes, 61 * (512 + 64) * 1 /*fp8*/ * 1000 + fixed);
}

// ---- sliding windows ----

#[test]
fn gemma_2_9b_default_format_is_its_float32_dtype() {
    let m = model("gemma-2-9b");
    assert_eq!(m.dtype.as_deref(), Some("float32"));
    assert_eq!(CacheFormat::parse(m.dtype.as_deref().unwrap()).unwrap().id(), "fp32/v1");
}

#[test]
fn gemma_2_9b_alternates_starting_with_a_sliding_layer() {
    let i = inv(&model("gemma-2-9b"), "bf16", 10_000);
    let expected: Vec<&str> = (0..42).map(|l| if l % 2 == 0 { "sliding" } else { "full" }).collect();
    assert_eq!(kinds_of(&i), expected);
}

#[test]
fn gemma_2_9b_below_window_keeps_every_token() {
    let m = model("gemma-2-9b");
    let tokens = 2000; // < window 4096
    let per_token_layer_bf16 = 8 /*kv heads*/ * 256 /*head_dim, not 3584/16*/ * 2 /*K,V*/ * 2 /*bf16*/;
    let i = inv(&m, "bf16", tokens);
    assert!(i.per_layer.iter().all(|l| l.retained_tokens == 2000));
    assert_eq!(i.per_token_bytes, Some(42 * per_token_layer_bf16));
    assert_eq!(i.payload_bytes, 42 /*layers*/ * per_token_layer_bf16 * tokens);
    // 2000 = 125 whole blocks of 16.
    assert_eq!(i.allocated_bytes, i.payload_bytes);

    // Its own dtype, fp32: twice the bytes of bf16 (no scales involved).
    let i32 = inv(&m, "fp32", tokens);
    assert_eq!(i32.payload_bytes, 42 * 8 * 256 * 2 * 4 /*fp32*/ * tokens);
}

#[test]
fn gemma_2_9b_above_window_sliding_layers_keep_the_window() {
    let m = model("gemma-2-9b");
    let tokens = 10_000; // > window 4096
    let per_token_layer = 8 /*kv heads*/ * 256 /*head_dim*/ * 2 /*K,V*/ * 2 /*bf16*/;
    let i = inv(&m, "bf16", tokens);
    for l in &i.per_layer {
        let want = if l.layer % 2 == 0 { 4096 } else { 10_000 };
        assert_eq!(l.retained_tokens, want, "layer {}", l.layer);
    }
    let expected = 21 /*sliding*/ * 4096 * per_token_layer + 21 /*full*/ * 10_000 * per_token_layer;
    assert_eq!(i.payload_bytes, expected);
    // Layers differ in retained tokens: no single per-token figure.
    assert_eq!(i.per_token_bytes, None);
    // Window start 10000-4096 = 5904 = 369 × 16 and 10000 = 625 × 16: block aligned.
    assert_eq!(i.allocated_bytes, expected);

    let fp32 = inv(&m, "fp32", tokens);
    assert_eq!(fp32.payload_bytes, (21 * 4096 + 21 * 10_000) * 8 * 256 * 2 * 4 /*fp32*/);
}

#[test]
fn gemma_3_1b_every_sixth_layer_is_global() {
    let m = model("gemma-3-1b");
    let tokens = 10_000;
    let i = inv(&m, "bf16", tokens);
    let full: Vec<u32> = i.per_layer.iter().filter(|l| l.kind == "full").map(|l| l.layer).collect();
    assert_eq!(full, vec![5, 11, 17, 23]);
    let per_token_layer = 1 /*kv head*/ * 256 /*head_dim*/ * 2 /*K,V*/ * 2 /*bf16*/;
    let expected = 22 /*sliding*/ * 512 /*window*/ * per_token_layer + 4 /*full*/ * 10_000 * per_token_layer;
    assert_eq!(i.payload_bytes, expected);
    assert_eq!(i.per_token_bytes, None);

    let below = inv(&m, "bf16", 500);
    assert_eq!(below.per_token_bytes, Some(26 * per_token_layer));
    assert_eq!(below.payload_bytes, 26 * per_token_layer * 500);
}

#[test]
fn gemma_3_27b_reads_the_multimodal_text_config() {
    let m = model("gemma-3-27b");
    assert_eq!(m.dtype.as_deref(), Some("bfloat16"));
    let i = inv(&m, "bf16", 5000);
    let per_token_layer = 16 /*kv heads*/ * 128 /*head_dim*/ * 2 /*K,V*/ * 2 /*bf16*/;
    // 62 layers, pattern 6 (default): globals at 5, 11, …, 59 → 10 full, 52 sliding at window 1024.
    let expected = 52 * 1024 * per_token_layer + 10 * 5000 * per_token_layer;
    assert_eq!(i.payload_bytes, expected);
}

#[test]
fn gpt_oss_20b_follows_layer_types() {
    let m = model("gpt-oss-20b");
    let tokens = 1000;
    let i = inv(&m, "bf16", tokens);
    let expected_kinds: Vec<&str> = (0..24).map(|l| if l % 2 == 0 { "sliding" } else { "full" }).collect();
    assert_eq!(kinds_of(&i), expected_kinds);
    let per_token_layer = 8 /*kv heads*/ * 64 /*head_dim*/ * 2 /*K,V*/ * 2 /*bf16*/;
    let expected = 12 /*sliding*/ * 128 /*window*/ * per_token_layer + 12 /*full*/ * 1000 * per_token_layer;
    assert_eq!(i.payload_bytes, expected);
    assert_eq!(i.per_token_bytes, None);
}

#[test]
fn qwen2_5_7b_sliding_window_is_ignored_without_use_sliding_window() {
    let m = model("qwen2.5-7b");
    // Above the config's sliding_window (131072): still every token, every layer.
    let tokens = 200_000;
    let i = inv(&m, "bf16", tokens);
    assert!(i.per_layer.iter().all(|l| l.kind == "full" && l.retained_tokens == tokens));
    let per_token = 28 /*layers*/ * 4 /*kv heads*/ * 128 /*3584/28*/ * 2 /*K,V*/ * 2 /*bf16*/;
    assert_eq!(i.per_token_bytes, Some(per_token));
    assert_eq!(i.payload_bytes, per_token * tokens);
}

#[test]
fn qwen2_use_sliding_window_slides_from_max_window_layers() {
    let m = hf_edited(
        QWEN25_7B,
        &[
            ("use_sliding_window", Value::Bool(true)),
            ("sliding_window", Value::from(4096)),
            ("max_window_layers", Value::from(20)),
        ],
    )
    .unwrap();
    let i = inv(&m, "bf16", 10_000);
    let expected: Vec<&str> = (0..28).map(|l| if l >= 20 { "sliding" } else { "full" }).collect();
    assert_eq!(kinds_of(&i), expected);
    let per_token_layer = 4 * 128 * 2 * 2;
    assert_eq!(i.payload_bytes, (20 * 10_000 + 8 * 4096) * per_token_layer);
}

#[test]
fn mistral_7b_v0_1_slides_every_layer() {
    let m = model("mistral-7b-v0.1");
    let per_token_layer = 8 /*kv heads*/ * 128 /*4096/32*/ * 2 /*K,V*/ * 2 /*bf16*/;
    let i = inv(&m, "bf16", 10_000);
    assert!(i.per_layer.iter().all(|l| l.kind == "sliding" && l.retained_tokens == 4096));
    assert_eq!(i.payload_bytes, 32 /*layers*/ * 4096 /*window*/ * per_token_layer);
    assert_eq!(i.per_token_bytes, None);
    // Exactly at the window every token is kept.
    let at = inv(&m, "bf16", 4096);
    assert_eq!(at.per_token_bytes, Some(32 * per_token_layer));
}

// ---- formats ----

#[test]
fn fp8_per_token_head_scale_is_not_half_of_bf16() {
    let m = model("llama-3.1-8b");
    let tokens = 1000;
    let bf16 = inv(&m, "bf16", tokens);
    let pth = inv(&m, "fp8_e4m3_pth", tokens);
    let bf16_expected = 32 /*layers*/ * 8 /*kv heads*/ * 2 /*K,V*/ * (128 * 2) /*bf16 row*/ * tokens;
    let pth_expected = 32 /*layers*/ * 8 /*kv heads*/ * 2 /*K,V*/ * (128 /*fp8*/ + 4 /*f32 scale*/) * tokens;
    assert_eq!(bf16.payload_bytes, bf16_expected);
    assert_eq!(pth.payload_bytes, pth_expected);
    assert_ne!(pth.payload_bytes * 2, bf16.payload_bytes);
    assert_eq!(pth.per_token_bytes, Some(32 * 8 * 2 * 132));
    assert_eq!(pth.fixed_bytes, 0);
    assert_eq!(pth.format, "fp8_e4m3_pth/v1");
}

#[test]
fn fp8_static_scale_is_counted_once_per_tensor_per_layer() {
    let m = model("llama-3.1-8b");
    let fixed = 32 /*layers*/ * 2 /*K,V tensors*/ * 4 /*f32 scale*/;
    let per_token = 32 /*layers*/ * 8 /*kv heads*/ * 2 /*K,V*/ * 128 /*fp8 row*/;
    for tokens in [1, 1000, 4096] {
        let i = inv(&m, "fp8_e4m3", tokens);
        assert_eq!(i.fixed_bytes, fixed);
        assert_eq!(i.per_token_bytes, Some(per_token));
        assert_eq!(i.payload_bytes, per_token * tokens + fixed, "tokens {tokens}");
    }
    let e5m2 = inv(&m, "fp8_e5m2", 1000);
    assert_eq!(e5m2.payload_bytes, per_token * 1000 + fixed);
}

#[test]
fn int4_g32_packs_two_per_byte_with_scale_and_zero_per_group() {
    let m = model("llama-3.1-8b");
    let tokens = 1000;
    let i = inv(&m, "int4_g32", tokens);
    // Row: 128/2 data bytes + ceil(128/32)=4 groups × (f16 scale + f16 zero).
    let row = 128 / 2 + 4 * (2 + 2);
    assert_eq!(row, 80);
    let per_token = 32 /*layers*/ * 8 /*kv heads*/ * 2 /*K,V*/ * row;
    assert_eq!(i.per_token_bytes, Some(per_token));
    assert_eq!(i.payload_bytes, per_token * tokens);
    assert_ne!(i.payload_bytes * 4, inv(&m, "bf16", tokens).payload_bytes);
}

#[test]
fn int4_g32_partial_final_group_gets_a_full_record() {
    let f = fmt("int4_g32");
    // 80 elements: 40 data bytes, ceil(80/32)=3 groups × 4 bytes.
    assert_eq!(f.row_bytes(80), 40 + 3 * 4);
    // MLA latent 576: 288 data bytes + 18 groups × 4.
    assert_eq!(f.row_bytes(576), 288 + 18 * 4);
    // Odd element count: the half byte rounds up.
    assert_eq!(f.row_bytes(33), 17 + 2 * 4);
}

#[test]
fn format_row_bytes_by_hand() {
    assert_eq!(fmt("bf16").row_bytes(128), 128 * 2);
    assert_eq!(fmt("fp16").row_bytes(128), 128 * 2);
    assert_eq!(fmt("fp32").row_bytes(128), 128 * 4);
    assert_eq!(fmt("fp8_e4m3").row_bytes(128), 128);
    assert_eq!(fmt("fp8_e4m3").tensor_static_bytes(), 4);
    assert_eq!(fmt("fp8_e4m3_pth").row_bytes(128), 128 + 4);
    assert_eq!(fmt("fp8_e4m3_pth").tensor_static_bytes(), 0);
    assert_eq!(fmt("int4_g32").row_bytes(128), 64 + 16);
}

#[test]
fn format_table_names_every_required_format() {
    let ids: Vec<String> = FORMATS.iter().map(|f| f.id()).collect();
    for want in ["bf16/v1", "fp16/v1", "fp32/v1", "fp8_e4m3/v1", "fp8_e5m2/v1", "fp8_e4m3_pth/v1", "int4_g32/v1"] {
        assert!(ids.iter().any(|id| id == want), "missing {want} in {ids:?}");
    }
    assert_eq!(fmt("fp8_e4m3_pth").scales, Scales::PerRow { bytes: 4 });
    assert_eq!(fmt("int4_g32").scales, Scales::PerGroup { group: 32, bytes: 4 });
}

#[test]
fn format_parse_versions_and_aliases() {
    let f = CacheFormat::parse("fp8_e4m3_pth/v1").unwrap();
    assert_eq!(f.name, "fp8_e4m3_pth");
    assert_eq!(f.version, 1);
    assert_eq!(f.id(), "fp8_e4m3_pth/v1");
    assert_eq!(f.to_string(), "fp8_e4m3_pth/v1");
    assert_eq!(CacheFormat::parse("bfloat16").unwrap(), fmt("bf16"));
    assert_eq!(CacheFormat::parse("bfloat16/v1").unwrap(), fmt("bf16"));
    assert_eq!(CacheFormat::parse("float16").unwrap(), fmt("fp16"));
    assert_eq!(CacheFormat::parse("half").unwrap(), fmt("fp16"));
    assert_eq!(CacheFormat::parse("float32").unwrap(), fmt("fp32"));
    assert_eq!(CacheFormat::parse("BF16").unwrap(), fmt("bf16"));
}

#[test]
fn format_parse_unknown_name() {
    let err = CacheFormat::parse("nonsense").unwrap_err();
    assert_eq!(err, FormatError::Unknown("nonsense".into()));
    let text = err.to_string();
    assert!(text.contains("nonsense") && text.contains("bf16"), "{text}");
}

#[test]
fn format_parse_unknown_version() {
    let err = CacheFormat::parse("bf16/v2").unwrap_err();
    assert_eq!(err, FormatError::UnknownVersion { name: "bf16".into(), version: "v2".into(), known: 1 });
    assert!(err.to_string().contains("v2"), "{err}");
    assert!(matches!(CacheFormat::parse("int4_g32/x"), Err(FormatError::UnknownVersion { .. })));
}

// ---- blocks, padding ----

#[test]
fn partial_final_block_rounds_allocated_up() {
    let m = model("llama-3.1-8b");
    let tokens = 1000;
    let i = inv(&m, "bf16", tokens);
    let per_token_layer = 8 /*kv heads*/ * 128 * 2 /*K,V*/ * 2 /*bf16*/;
    let blocks = 63; // ceil(1000 / 16): the last block holds 8 of 16 tokens
    assert!(i.per_layer.iter().all(|l| l.blocks == blocks));
    assert_eq!(i.payload_bytes, 32 * per_token_layer * 1000);
    assert_eq!(i.allocated_bytes, 32 * per_token_layer * blocks * 16);
    assert!(i.allocated_bytes > i.payload_bytes);
    assert_eq!(i.allocated_bytes - i.payload_bytes, 32 * per_token_layer * 8 /*empty slots*/);
}

#[test]
fn sliding_window_starting_mid_block_occupies_that_block() {
    let m = model("gpt-oss-20b");
    let i = inv(&m, "bf16", 1000);
    let per_token_layer = 8 /*kv heads*/ * 64 /*head_dim*/ * 2 /*K,V*/ * 2 /*bf16*/;
    // Window 128 keeps positions 872..1000: blocks 872/16=54 … 999/16=62 → 9 blocks.
    let sliding = &i.per_layer[0];
    assert_eq!(sliding.kind, "sliding");
    assert_eq!(sliding.retained_tokens, 128);
    assert_eq!(sliding.blocks, 9);
    assert_eq!(sliding.payload_bytes, 128 * per_token_layer);
    assert_eq!(sliding.allocated_bytes, 9 * 16 * per_token_layer);
    let full = &i.per_layer[1];
    assert_eq!(full.blocks, 63);
    assert_eq!(full.allocated_bytes, 63 * 16 * per_token_layer);
    assert_eq!(i.allocated_bytes, 12 * (9 + 63) * 16 * per_token_layer);
}

#[test]
fn row_align_pads_allocated_only() {
    let m = model("llama-3.1-8b");
    let tokens = 1024; // whole blocks, so any allocated excess is padding
    let plain = inventory(&m, &geo("fp8_e4m3_pth", 16), tokens).unwrap();
    let g = Geometry { row_align: 64, ..geo("fp8_e4m3_pth", 16) }.validated().unwrap();
    let padded = inventory(&m, &g, tokens).unwrap();
    let payload = 32 /*layers*/ * 8 /*kv heads*/ * 2 /*K,V*/ * (128 + 4) /*row*/ * tokens;
    assert_eq!(plain.payload_bytes, payload);
    assert_eq!(plain.allocated_bytes, payload);
    assert_eq!(padded.payload_bytes, payload);
    // 132-byte rows padded to 192 (3 × 64).
    assert_eq!(padded.allocated_bytes, 32 * 8 * 2 * 192 * tokens);
}

#[test]
fn block_align_pads_allocated_only() {
    let m = model("llama-3.1-8b");
    let tokens = 1024;
    let g = Geometry { block_align: 12_288, ..geo("bf16", 16) }.validated().unwrap();
    let i = inventory(&m, &g, tokens).unwrap();
    assert_eq!(i.payload_bytes, 32 * 8 * 128 * 2 * 2 * tokens);
    // One block of one tensor: 16 tokens × 8 heads × 256 B = 32768, padded to 36864 (3 × 12288).
    let blocks = 1024 / 16;
    assert_eq!(i.allocated_bytes, 32 /*layers*/ * 2 /*K,V*/ * blocks * 36_864);
}

#[test]
fn geometry_refuses_zero_sizes() {
    assert_eq!(Geometry::new(fmt("bf16"), 0).unwrap_err(), GeometryError::Zero("block_size"));
    let g = Geometry { row_align: 0, ..geo("bf16", 16) };
    assert_eq!(g.validated().unwrap_err(), GeometryError::Zero("row_align"));
    let g = Geometry { block_align: 0, ..geo("bf16", 16) };
    assert_eq!(g.validated().unwrap_err(), GeometryError::Zero("block_align"));
    assert!(GeometryError::Zero("block_size").to_string().contains("block_size"));
}

// ---- TOML specs ----

const HYBRID: &str = r#"
name = "hybrid"
dtype = "bf16"

[[layers]]
repeat = 2
attention = "dense"
kv_heads = 4
head_dim = 64
v_head_dim = 32

[[layers]]
attention = "dense"
kv_heads = 2
head_dim = 128
window = 100
sinks = 4

[[layers]]
attention = "mla"
kv_lora_rank = 256
qk_rope_head_dim = 32

[[layers]]
attention = "shared"
shares_with = 0

[[layers]]
attention = "none"
state_bytes = 65536
"#;

#[test]
fn toml_hybrid_spec_sums_every_representation() {
    let m = from_toml_spec("fallback", HYBRID).unwrap();
    assert_eq!(m.name, "hybrid");
    assert_eq!(m.dtype.as_deref(), Some("bf16"));
    let i = inv(&m, "bf16", 1000);
    assert_eq!(kinds_of(&i), vec!["full", "full", "sliding", "mla", "shared", "state"]);

    let dense = 4 /*heads*/ * (64 /*K*/ + 32 /*V*/) * 2 /*bf16*/; // per token
    let sliding = 2 /*heads*/ * (128 + 128) * 2;
    let mla = (256 + 32) * 2;
    let state = 65_536;
    let l = &i.per_layer;
    assert_eq!(l[0].payload_bytes, dense * 1000);
    assert_eq!(l[1].payload_bytes, dense * 1000);
    // Sinks + window: positions 0..4 and 900..1000.
    assert_eq!(l[2].retained_tokens, 4 + 100);
    assert_eq!(l[2].payload_bytes, sliding * 104);
    assert_eq!(l[3].payload_bytes, mla * 1000);
    assert_eq!(l[4].payload_bytes, 0);
    assert_eq!(l[4].allocated_bytes, 0);
    assert_eq!(l[5].payload_bytes, state);
    assert_eq!(l[5].allocated_bytes, state);
    assert_eq!(i.payload_bytes, 2 * dense * 1000 + sliding * 104 + mla * 1000 + state);
    assert_eq!(i.fixed_bytes, state);

    // Blocks: 63 for full layers; sinks in block 0 plus 900/16=56 … 62 → 1 + 7.
    assert_eq!(l[2].blocks, 8);
    assert_eq!(l[2].allocated_bytes, 8 * 16 * sliding);
    assert_eq!(i.allocated_bytes, 2 * 63 * 16 * dense + 8 * 16 * sliding + 63 * 16 * mla + state);
}

#[test]
fn toml_constant_state_is_counted_once_whatever_the_length() {
    let m = from_toml_spec("x", HYBRID).unwrap();
    let short = inv(&m, "bf16", 50); // below sinks + window: every layer keeps every token
    let per_token = 2 * 4 * 96 * 2 + 2 * 256 * 2 + 288 * 2;
    assert_eq!(short.per_token_bytes, Some(per_token));
    assert_eq!(short.payload_bytes, per_token * 50 + 65_536);
    let longer = inv(&m, "bf16", 60);
    assert_eq!(longer.payload_bytes - short.payload_bytes, per_token * 10);
}

#[test]
fn toml_static_fp8_scales_skip_shared_and_state_layers() {
    let m = from_toml_spec("x", HYBRID).unwrap();
    let i = inv(&m, "fp8_e4m3", 50);
    let scales = 3 /*dense layers*/ * 2 /*K,V*/ * 4 + 1 /*mla latent*/ * 4;
    assert_eq!(i.fixed_bytes, scales + 65_536);
}

#[test]
fn toml_spec_name_falls_back_and_repeat_expands() {
    let m = from_toml_spec("from-file", "[[layers]]\nrepeat = 5\nattention = \"dense\"\nkv_heads = 1\nhead_dim = 8\n").unwrap();
    assert_eq!(m.name, "from-file");
    assert_eq!(m.layers.len(), 5);
    assert_eq!(m.dtype, None);
}

#[test]
fn toml_denies_unknown_fields() {
    let err = from_toml_spec("x", "[[layers]]\nattention = \"dense\"\nkv_head = 8\nhead_dim = 128\n").unwrap_err();
    assert!(matches!(err, SpecError::Syntax { .. }), "{err:?}");
    assert!(err.to_string().contains("kv_head"), "{err}");

    let err = from_toml_spec("x", "nmae = \"typo\"\n[[layers]]\nattention = \"none\"\n").unwrap_err();
    assert!(matches!(err, SpecError::Syntax { .. }), "{err:?}");
    assert!(err.to_string().contains("nmae"), "{err}");
}

#[test]
fn toml_missing_required_field_names_it() {
    let err = from_toml_spec("x", "[[layers]]\nattention = \"dense\"\nkv_heads = 8\n").unwrap_err();
    assert_eq!(err, SpecError::Missing("layers[0].head_dim".into()));
    assert!(err.to_string().contains("head_dim"), "{err}");

    let err = from_toml_spec("x", "[[layers]]\nattention = \"none\"\n[[layers]]\nattention = \"shared\"\n").unwrap_err();
    assert_eq!(err, SpecError::Missing("layers[1].shares_with".into()));

    let err = from_toml_spec("x", "[[layers]]\nkv_heads = 8\n").unwrap_err();
    assert!(err.to_string().contains("attention"), "{err}");
}

#[test]
fn toml_bad_values_name_the_field() {
    let cases = [
        ("[[layers]]\nattention = \"dense\"\nkv_heads = 0\nhead_dim = 8\n", "layers[0].kv_heads"),
        ("[[layers]]\nattention = \"dense\"\nkv_heads = 1\nhead_dim = 8\nwindow = 0\n", "layers[0].window"),
        ("[[layers]]\nattention = \"dense\"\nkv_heads = 1\nhead_dim = 8\nsinks = 4\n", "layers[0].sinks"),
        ("[[layers]]\nrepeat = 0\nattention = \"none\"\n", "layers[0].repeat"),
        ("[[layers]]\nattention = \"sparse\"\n", "layers[0].attention"),
        // A shared layer must point back at a layer that stores its own KV.
        ("[[layers]]\nattention = \"shared\"\nshares_with = 0\n", "layers[0].shares_with"),
    ];
    for (text, field) in cases {
        match from_toml_spec("x", text) {
            Err(SpecError::Invalid { field: f, .. }) => assert_eq!(f, field, "{text}"),
            other => panic!("{text}: expected Invalid {field}, got {other:?}"),
        }
    }
    assert!(matches!(from_toml_spec("x", "layers = []\n"), Err(SpecError::Invalid { field, .. }) if field == "layers"));
}

// ---- HF bad input ----

#[test]
fn hf_missing_num_hidden_layers() {
    let err = hf_edited(LLAMA_8B, &[("num_hidden_layers", Value::Null)]).unwrap_err();
    assert_eq!(err, SpecError::Missing("num_hidden_layers".into()));
    assert!(err.to_string().contains("num_hidden_layers"), "{err}");
}

#[test]
fn hf_missing_mla_field() {
    let err = from_hf_config("x", r#"{"model_type":"deepseek_v3","num_hidden_layers":2,"kv_lora_rank":512}"#).unwrap_err();
    assert_eq!(err, SpecError::Missing("qk_rope_head_dim".into()));
}

#[test]
fn hf_zero_heads() {
    for key in ["num_attention_heads", "num_key_value_heads", "num_hidden_layers", "head_dim"] {
        let err = hf_edited(LLAMA_8B, &[(key, Value::from(0))]).unwrap_err();
        match &err {
            SpecError::Invalid { field, .. } => assert_eq!(field, key),
            other => panic!("{key}: expected Invalid, got {other:?}"),
        }
        assert!(err.to_string().contains(key), "{err}");
    }
}

#[test]
fn hf_negative_or_non_integer_sizes() {
    for v in [Value::from(-8), Value::from(8.5), Value::from("8")] {
        let err = hf_edited(LLAMA_8B, &[("num_key_value_heads", v.clone())]).unwrap_err();
        assert!(
            matches!(&err, SpecError::Invalid { field, .. } if field == "num_key_value_heads"),
            "{v}: {err:?}"
        );
    }
}

#[test]
fn hf_heads_not_dividing_hidden_size_without_head_dim() {
    // 4096 % 24 = 16: no whole head dim.
    let err = hf_edited(LLAMA_8B, &[("num_attention_heads", Value::from(24))]).unwrap_err();
    assert_eq!(err, SpecError::HeadsDoNotDivide { hidden_size: 4096, heads: 24 });
    let text = err.to_string();
    assert!(text.contains("head_dim") && text.contains("hidden_size"), "{text}");

    // With an explicit head_dim the division does not matter.
    let m = hf_edited(LLAMA_8B, &[("num_attention_heads", Value::from(24)), ("head_dim", Value::from(128))]).unwrap();
    assert_eq!(inv(&m, "bf16", 1).payload_bytes, 32 * 8 * 128 * 2 * 2);
}

#[test]
fn hf_unknown_model_type_points_at_toml_spec() {
    let err = hf_edited(LLAMA_8B, &[("model_type", Value::from("mamba"))]).unwrap_err();
    assert_eq!(err, SpecError::UnknownModelType("mamba".into()));
    let text = err.to_string();
    assert!(text.contains("model_type") && text.contains("mamba") && text.contains("TOML"), "{text}");

    let err = hf_edited(LLAMA_8B, &[("model_type", Value::Null)]).unwrap_err();
    assert_eq!(err, SpecError::Missing("model_type".into()));
}

#[test]
fn hf_invalid_json() {
    let err = from_hf_config("x", "{\"model_type\": \"llama\",").unwrap_err();
    assert!(matches!(err, SpecError::Syntax { what: "config.json", .. }), "{err:?}");
    let err = from_hf_config("x", "[1, 2]").unwrap_err();
    assert!(matches!(err, SpecError::Invalid { .. }), "{err:?}");
}

#[test]
fn hf_layer_types_length_mismatch() {
    let short: Vec<Value> = (0..23).map(|_| Value::from("full_attention")).collect();
    let err = hf_edited(GPT_OSS_20B, &[("layer_types", Value::Array(short))]).unwrap_err();
    match &err {
        SpecError::Invalid { field, reason } => {
            assert_eq!(field, "layer_types");
            assert!(reason.contains("23") && reason.contains("24"), "{reason}");
        }
        other => panic!("expected Invalid layer_types, got {other:?}"),
    }

    let mut bad: Vec<Value> = (0..24).map(|_| Value::from("full_attention")).collect();
    bad[3] = Value::from("chunked_attention");
    let err = hf_edited(GPT_OSS_20B, &[("layer_types", Value::Array(bad))]).unwrap_err();
    assert!(matches!(&err, SpecError::Invalid { field, .. } if field == "layer_types[3]"), "{err:?}");
}

#[test]
fn hf_sliding_layers_need_a_window() {
    let err = hf_edited(GPT_OSS_20B, &[("sliding_window", Value::Null)]).unwrap_err();
    assert_eq!(err, SpecError::Missing("sliding_window".into()));
}

#[test]
fn unknown_builtin_lists_the_known_ones() {
    let err = builtin("llama-9000").unwrap_err();
    assert!(matches!(&err, SpecError::UnknownBuiltin { name, .. } if name == "llama-9000"));
    assert!(err.to_string().contains("llama-3.1-8b"), "{err}");
}

#[test]
fn zero_tokens_is_refused() {
    let err = inventory(&model("llama-3.1-8b"), &geo("bf16", 16), 0).unwrap_err();
    assert_eq!(err, kvwire_core::layout::InventoryError::ZeroTokens);
    assert!(err.to_string().contains("tokens"), "{err}");
}

#[test]
fn huge_token_count_is_an_error_not_an_overflow() {
    let m = model("llama-3.1-8b");
    let g = geo("bf16", 16);
    let r = std::panic::catch_unwind(|| inventory(&m, &g, u64::MAX));
    assert!(matches!(r, Ok(Err(_))), "expected an error, got {r:?}");
    // At the accepted maximum the figures still fit or fail cleanly, never wrap.
    let max = kvwire_core::layout::MAX_TOKENS;
    let i = inventory(&m, &geo("fp32", 1 << 20), max).unwrap();
    assert_eq!(i.payload_bytes, 32 /*layers*/ * 8 /*kv heads*/ * 128 * 2 /*K,V*/ * 4 /*fp32*/ * max);
    let huge = kvwire_core::layout::from_toml_spec(
        "huge",
        "[[layers]]\nrepeat = 4096\nattention = \"dense\"\nkv_heads = 65536\nhead_dim = 1048576\n",
    )
    .unwrap();
    let r = std::panic::catch_unwind(|| inventory(&huge, &geo("fp32", 1 << 20), max));
    assert!(matches!(r, Ok(Err(kvwire_core::layout::InventoryError::Overflow { .. }))), "got {r:?}");
}

#[test]
fn huge_layer_count_is_an_error_not_a_panic() {
    let r = std::panic::catch_unwind(|| hf_edited(LLAMA_8B, &[("num_hidden_layers", Value::from(u64::MAX))]));
    assert!(
        matches!(&r, Ok(Err(SpecError::Invalid { field, .. })) if field == "num_hidden_layers"),
        "expected Invalid num_hidden_layers, got {r:?}"
    );
}

// ---- JSON shape ----

#[test]
fn json_output_shape() {
    let i = inv(&model("llama-3.1-8b"), "bf16", 1000);
    let v = serde_json::to_value(&i).unwrap();
    assert_eq!(v["format"], "bf16/v1");
    assert_eq!(v["tokens"], 1000);
    assert_eq!(v["payload_bytes"], 32 * 8 * 128 * 2 * 2 * 1000);
    assert_eq!(v["allocated_bytes"], 32 * 8 * 128 * 2 * 2 * 63 * 16);
    assert_eq!(v["per_token_bytes"], 32 * 8 * 128 * 2 * 2);
    assert!(v.get("wire_bytes").is_some_and(Value::is_null), "{v}");
    let layers = v["per_layer"].as_array().unwrap();
    assert_eq!(layers.len(), 32);
    for (n, l) in layers.iter().enumerate() {
        assert_eq!(l["layer"], n);
        assert_eq!(l["kind"], "full");
        assert_eq!(l["retained_tokens"], 1000);
        assert_eq!(l["payload_bytes"], 8 * 128 * 2 * 2 * 1000);
        assert_eq!(l["allocated_bytes"], 8 * 128 * 2 * 2 * 63 * 16);
    }

    // Non-uniform retention: per_token_bytes is present and null.
    let g = serde_json::to_value(inv(&model("gemma-2-9b"), "fp32", 10_000)).unwrap();
    assert_eq!(g["format"], "fp32/v1");
    assert!(g.get("per_token_bytes").is_some_and(Value::is_null), "{g}");
    assert_eq!(g["per_layer"][0]["kind"], "sliding");
    assert_eq!(g["per_layer"][0]["retained_tokens"], 4096);
    assert_eq!(g["per_layer"][1]["retained_tokens"], 10_000);
}
