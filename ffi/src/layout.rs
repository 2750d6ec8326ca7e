//! Layout arithmetic (no daemon): how big a rank's cache is.

use crate::args::{model_source, out, text};
use crate::boundary::{guard, Fail};
use crate::codes::kvw_result::{self, *};
#[cfg(doc)] // for the doc links
use crate::kvw_mem;
use kvwire_client::control::ModelSource;
use kvwire_core::layout::{self, ModelSpec};
use kvwire_core::plan::Side;
use kvwire_core::shard::LayoutSpec;
use kvwire_core::CacheFormat;
use std::ffi::c_char;

/// How many regions rank `rank` of `layout` holds and how many bytes they
/// take back to back — the size of the [`kvw_mem`] to register for it —
/// computed locally with the daemon's own rules. With `kv=` (engine
/// tensors) the bytes are the rank's tensors back to back.
///
/// `model_json` is the model source as JSON: `{"builtin": "llama-3.1-8b"}`,
/// `{"hf_config": "<config.json text>"}` or `{"toml": "<spec text>"}`;
/// `format` a cache format id (`bf16`, `fp8_e4m3_pth/v1`, …); `layout` a
/// parallel layout (`tp=2,block=16,layout=hnd`). Every argument stays the
/// caller's; nothing is kept.
///
/// # Safety
/// Strings are NULL or NUL-terminated; out-parameters NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvw_cache_size(
    model_json: *const c_char,
    format: *const c_char,
    layout: *const c_char,
    rank: u32,
    num_blocks: u32,
    out_regions: *mut u32,
    out_bytes: *mut u64,
) -> kvw_result {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let (model_json, format, layout_s) =
            unsafe { (text(model_json, "model_json")?, text(format, "format")?, text(layout, "layout")?) };
        let (out_regions, out_bytes) = (out(out_regions, "out_regions")?, out(out_bytes, "out_bytes")?);
        let model = resolve_model("model", &model_source(model_json)?)?;
        let fmt = CacheFormat::parse(format).map_err(|e| Fail::new(KVW_BAD_LAYOUT, format!("format: {e}")))?;
        let spec = LayoutSpec::parse(layout_s).map_err(|e| Fail::new(KVW_BAD_LAYOUT, format!("layout: {e}")))?;
        if num_blocks == 0 {
            return Err(Fail::new(KVW_BAD_LAYOUT, "num_blocks must be > 0"));
        }
        let side = Side::with_table(&model, &spec, fmt, 1, vec![0], num_blocks)
            .map_err(|e| Fail::new(KVW_BAD_LAYOUT, format!("layout: {e}")))?;
        if rank as usize >= side.shard.ranks.len() {
            return Err(Fail::new(
                KVW_BAD_LAYOUT,
                format!("rank {rank} but layout `{layout_s}` has {} ranks", side.shard.ranks.len()),
            ));
        }
        let regions = side.regions(&model, rank);
        let bytes = side.rank_bytes(&model, rank);
        // SAFETY: checked non-NULL; writable per the contract.
        unsafe {
            *out_regions = regions.len() as u32;
            *out_bytes = bytes;
        }
        Ok(())
    })
}

fn resolve_model(group: &str, src: &ModelSource) -> Result<ModelSpec, Fail> {
    match src {
        ModelSource::Builtin(n) => layout::builtin(n),
        ModelSource::HfConfig(t) => layout::from_hf_config(group, t),
        ModelSource::Toml(t) => layout::from_toml_spec(group, t),
    }
    .map_err(|e| Fail::new(KVW_BAD_MODEL, format!("model: {e}")))
}
