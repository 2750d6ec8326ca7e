//! Reader for Hugging Face `config.json` files.
//!
//! Each supported `model_type` has its family's rule for which layers slide;
//! `layer_types`, when a config carries it, always wins. A `sliding_window`
//! value alone never makes a layer slide unless the family says so (Mistral
//! applies it to every layer; Qwen2/Qwen3 only with `use_sliding_window`).

use super::{Attention, LayerSpec, ModelSpec, Retention, SpecError};
use serde_json::{Map, Value};

/// The `model_type`s this reader understands.
pub const SUPPORTED: &[&str] = &[
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3_text",
    "gemma3",
    "deepseek_v2",
    "deepseek_v3",
    "gpt_oss",
];

/// Builds a [`ModelSpec`] from the text of a Hugging Face `config.json`.
pub fn from_hf_config(name: &str, text: &str) -> Result<ModelSpec, SpecError> {
    let root: Value = serde_json::from_str(text)
        .map_err(|e| SpecError::Syntax { what: "config.json", reason: e.to_string() })?;
    let root = root.as_object().ok_or_else(|| SpecError::Invalid {
        field: "(top level)".into(),
        reason: "expected a JSON object".into(),
    })?;
    let model_type = str_field(root, "model_type", "")?
        .ok_or_else(|| SpecError::Missing("model_type".into()))?;
    // Multimodal Gemma 3 keeps the language model under `text_config`.
    let (cfg, prefix) = if model_type == "gemma3" {
        let text = root
            .get("text_config")
            .and_then(Value::as_object)
            .ok_or_else(|| SpecError::Missing("text_config".into()))?;
        (text, "text_config.")
    } else {
        (root, "")
    };
    let c = Cfg { map: cfg, prefix };
    let dtype = c
        .str_opt("torch_dtype")?
        .or(c.str_opt("dtype")?)
        .or(str_field(root, "torch_dtype", "")?)
        .or(str_field(root, "dtype", "")?);

    let layers = match model_type.as_str() {
        "llama" | "mistral" | "qwen2" | "qwen3" | "gemma2" | "gemma3_text" | "gemma3" | "gpt_oss" => {
            dense_layers(&c, &model_type)?
        }
        "deepseek_v2" | "deepseek_v3" => mla_layers(&c)?,
        other => return Err(SpecError::UnknownModelType(other.to_string())),
    };
    let spec = ModelSpec { name: name.to_string(), family: model_type, dtype, layers };
    spec.validate()?;
    Ok(spec)
}

struct Cfg<'a> {
    map: &'a Map<String, Value>,
    prefix: &'static str,
}

impl Cfg<'_> {
    fn field(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    /// A positive integer field; `null` counts as absent.
    fn u64_opt(&self, key: &str) -> Result<Option<u64>, SpecError> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => match v.as_u64() {
                Some(0) => Err(SpecError::Invalid { field: self.field(key), reason: "must be > 0".into() }),
                Some(n) => Ok(Some(n)),
                None => Err(SpecError::Invalid {
                    field: self.field(key),
                    reason: format!("expected a positive integer, got {v}"),
                }),
            },
        }
    }

    fn u64_req(&self, key: &str) -> Result<u64, SpecError> {
        self.u64_opt(key)?.ok_or_else(|| SpecError::Missing(self.field(key)))
    }

    fn u32_req(&self, key: &str) -> Result<u32, SpecError> {
        to_u32(self.u64_req(key)?, &self.field(key))
    }

    fn bool_opt(&self, key: &str) -> Result<Option<bool>, SpecError> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(SpecError::Invalid { field: self.field(key), reason: format!("expected true or false, got {v}") }),
        }
    }

    fn str_opt(&self, key: &str) -> Result<Option<String>, SpecError> {
        str_field(self.map, key, self.prefix)
    }
}

fn str_field(map: &Map<String, Value>, key: &str, prefix: &str) -> Result<Option<String>, SpecError> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => Err(SpecError::Invalid { field: format!("{prefix}{key}"), reason: format!("expected a string, got {v}") }),
    }
}

/// `num_hidden_layers`, bounded before anything is sized by it.
fn layer_count(c: &Cfg<'_>) -> Result<usize, SpecError> {
    let n = c.u64_req("num_hidden_layers")?;
    if n > super::MAX_LAYERS {
        return Err(SpecError::Invalid {
            field: c.field("num_hidden_layers"),
            reason: format!("{n} layers, more than the {} kvwire accepts", super::MAX_LAYERS),
        });
    }
    Ok(n as usize)
}

fn to_u32(n: u64, field: &str) -> Result<u32, SpecError> {
    u32::try_from(n).map_err(|_| SpecError::Invalid { field: field.into(), reason: format!("{n} is too large") })
}

/// Dense-attention families: KV heads, head dims, and the sliding rule.
fn dense_layers(c: &Cfg<'_>, model_type: &str) -> Result<Vec<LayerSpec>, SpecError> {
    let n_layers = layer_count(c)?;
    let q_heads = c.u64_req("num_attention_heads")?;
    // KV heads default to query heads (plain MHA) when the config omits them.
    let kv_heads = to_u32(c.u64_opt("num_key_value_heads")?.unwrap_or(q_heads), &c.field("num_key_value_heads"))?;
    let head_dim = match c.u64_opt("head_dim")? {
        Some(d) => to_u32(d, &c.field("head_dim"))?,
        None => {
            let hidden = c.u64_req("hidden_size")?;
            if hidden % q_heads != 0 {
                return Err(SpecError::HeadsDoNotDivide { hidden_size: hidden, heads: q_heads });
            }
            to_u32(hidden / q_heads, &c.field("head_dim"))?
        }
    };
    let v_head_dim = match c.u64_opt("v_head_dim")? {
        Some(d) => to_u32(d, &c.field("v_head_dim"))?,
        None => head_dim,
    };
    let sliding = sliding_pattern(c, model_type, n_layers)?;
    let window = if sliding.iter().any(|s| *s) {
        Some(c.u64_opt("sliding_window")?.ok_or_else(|| SpecError::Missing(c.field("sliding_window")))?)
    } else {
        None
    };
    Ok(sliding
        .into_iter()
        .map(|slides| LayerSpec {
            attention: Attention::Dense { kv_heads, head_dim, v_head_dim },
            retention: match (slides, window) {
                (true, Some(window)) => Retention::Window { window, sinks: 0 },
                _ => Retention::All,
            },
            state_bytes: 0,
        })
        .collect())
}

/// Which layers use a sliding window, by `layer_types` or the family rule.
fn sliding_pattern(c: &Cfg<'_>, model_type: &str, n_layers: usize) -> Result<Vec<bool>, SpecError> {
    if let Some(types) = c.map.get("layer_types").filter(|v| !v.is_null()) {
        let field = c.field("layer_types");
        let types = types
            .as_array()
            .ok_or_else(|| SpecError::Invalid { field: field.clone(), reason: "expected an array of strings".into() })?;
        if types.len() != n_layers {
            return Err(SpecError::Invalid {
                field,
                reason: format!("has {} entries but num_hidden_layers is {n_layers}", types.len()),
            });
        }
        return types
            .iter()
            .enumerate()
            .map(|(i, t)| match t.as_str() {
                Some("sliding_attention") => Ok(true),
                Some("full_attention") => Ok(false),
                _ => Err(SpecError::Invalid {
                    field: format!("{field}[{i}]"),
                    reason: format!("expected \"sliding_attention\" or \"full_attention\", got {t}"),
                }),
            })
            .collect();
    }
    let has_window = c.u64_opt("sliding_window")?.is_some();
    let pattern: Vec<bool> = match model_type {
        // Mistral applies `sliding_window` to every layer when it is set.
        "mistral" => vec![has_window; n_layers],
        // Qwen2/Qwen3: only with `use_sliding_window`, and only from layer
        // `max_window_layers` on.
        "qwen2" | "qwen3" => {
            let on = c.bool_opt("use_sliding_window")?.unwrap_or(false) && has_window;
            let from = if on { c.u64_req("max_window_layers")?.min(n_layers as u64) as usize } else { n_layers };
            (0..n_layers).map(|i| on && i >= from).collect()
        }
        // Gemma 2 alternates, starting with a sliding layer at index 0.
        "gemma2" => (0..n_layers).map(|i| i % 2 == 0).collect(),
        // Gemma 3: every `sliding_window_pattern`-th layer is global, the rest slide.
        "gemma3_text" | "gemma3" => {
            let period = c.u64_opt("sliding_window_pattern")?.unwrap_or(6).min(n_layers as u64 + 1) as usize;
            (0..n_layers).map(|i| (i + 1) % period != 0).collect()
        }
        // gpt-oss publishes `layer_types`; without it every layer is full.
        _ => vec![false; n_layers],
    };
    Ok(pattern)
}

/// DeepSeek-V2/V3: one MLA latent per token per layer, whatever the KV head count says.
fn mla_layers(c: &Cfg<'_>) -> Result<Vec<LayerSpec>, SpecError> {
    let n_layers = layer_count(c)?;
    let kv_lora_rank = c.u32_req("kv_lora_rank")?;
    let qk_rope_head_dim = c.u32_req("qk_rope_head_dim")?;
    Ok(vec![
        LayerSpec {
            attention: Attention::Mla { kv_lora_rank, qk_rope_head_dim },
            retention: Retention::All,
            state_bytes: 0,
        };
        n_layers
    ])
}
