//! TOML model specs: for models no config reader covers, and for explicit
//! per-layer lists (hybrid models, shared KV, constant per-layer state).
//!
//! ```toml
//! name = "hybrid-example"
//! dtype = "bf16"            # optional: default cache format
//!
//! [[layers]]
//! repeat = 3                # optional, default 1: this entry stands for 3 layers
//! attention = "dense"       # dense | mla | shared | none
//! kv_heads = 8
//! head_dim = 128
//! v_head_dim = 128          # optional, defaults to head_dim
//! window = 4096             # optional: keep only the last `window` positions
//! sinks = 4                 # optional, with `window`: also keep the first `sinks`
//!
//! [[layers]]
//! attention = "shared"
//! shares_with = 0           # index of an earlier layer whose KV this one reads
//!
//! [[layers]]
//! attention = "none"
//! state_bytes = 1048576     # constant per-layer state, counted once
//! ```

use super::{Attention, LayerSpec, ModelSpec, Retention, SpecError};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSpec {
    name: Option<String>,
    dtype: Option<String>,
    layers: Vec<RawLayer>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLayer {
    repeat: Option<u32>,
    attention: String,
    kv_heads: Option<u32>,
    head_dim: Option<u32>,
    v_head_dim: Option<u32>,
    kv_lora_rank: Option<u32>,
    qk_rope_head_dim: Option<u32>,
    shares_with: Option<u32>,
    window: Option<u64>,
    sinks: Option<u64>,
    state_bytes: Option<u64>,
}

/// Builds a [`ModelSpec`] from the text of a TOML spec; `fallback_name` is
/// used when the spec has no `name`.
pub fn from_toml_spec(fallback_name: &str, text: &str) -> Result<ModelSpec, SpecError> {
    let raw: RawSpec =
        toml::from_str(text).map_err(|e| SpecError::Syntax { what: "TOML spec", reason: e.message().to_string() })?;
    let mut layers = Vec::new();
    for (i, l) in raw.layers.iter().enumerate() {
        let field = |name: &str| format!("layers[{i}].{name}");
        let need = |v: Option<u32>, name: &str| v.ok_or_else(|| SpecError::Missing(field(name)));
        let attention = match l.attention.as_str() {
            "dense" => {
                let head_dim = need(l.head_dim, "head_dim")?;
                Attention::Dense {
                    kv_heads: need(l.kv_heads, "kv_heads")?,
                    head_dim,
                    v_head_dim: l.v_head_dim.unwrap_or(head_dim),
                }
            }
            "mla" => Attention::Mla {
                kv_lora_rank: need(l.kv_lora_rank, "kv_lora_rank")?,
                qk_rope_head_dim: l.qk_rope_head_dim.unwrap_or(0),
            },
            "shared" => Attention::SharedWith { layer: need(l.shares_with, "shares_with")? },
            "none" => Attention::None,
            other => {
                return Err(SpecError::Invalid {
                    field: field("attention"),
                    reason: format!("unknown kind `{other}` (dense, mla, shared, none)"),
                })
            }
        };
        let retention = match (l.window, l.sinks) {
            (Some(window), sinks) => Retention::Window { window, sinks: sinks.unwrap_or(0) },
            (None, Some(_)) => {
                return Err(SpecError::Invalid { field: field("sinks"), reason: "needs `window`".into() })
            }
            (None, None) => Retention::All,
        };
        let repeat = l.repeat.unwrap_or(1);
        if repeat == 0 {
            return Err(SpecError::Invalid { field: field("repeat"), reason: "must be > 0".into() });
        }
        // Bound the expansion before allocating it.
        if layers.len() as u64 + u64::from(repeat) > super::MAX_LAYERS {
            return Err(SpecError::Invalid {
                field: field("repeat"),
                reason: format!("the spec would have more than {} layers", super::MAX_LAYERS),
            });
        }
        let layer = LayerSpec { attention, retention, state_bytes: l.state_bytes.unwrap_or(0) };
        layers.extend(std::iter::repeat_n(layer, repeat as usize));
    }
    let spec = ModelSpec {
        name: raw.name.unwrap_or_else(|| fallback_name.to_string()),
        family: "toml".into(),
        dtype: raw.dtype,
        layers,
    };
    spec.validate()?;
    Ok(spec)
}
