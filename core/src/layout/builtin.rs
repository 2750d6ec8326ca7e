//! Built-in real models: their published `config.json` files, embedded from
//! `config/models/` so the figures come from the same file a user would pass.

use super::{from_hf_config, ModelSpec, SpecError};

/// (name, config.json text) of every built-in model.
pub const BUILTINS: &[(&str, &str)] = &[
    ("llama-3.1-8b", include_str!("../../../config/models/llama-3.1-8b.json")),
    ("llama-3.1-70b", include_str!("../../../config/models/llama-3.1-70b.json")),
    ("mistral-7b-v0.1", include_str!("../../../config/models/mistral-7b-v0.1.json")),
    ("qwen2.5-7b", include_str!("../../../config/models/qwen2.5-7b.json")),
    ("qwen3-8b", include_str!("../../../config/models/qwen3-8b.json")),
    ("gemma-2-9b", include_str!("../../../config/models/gemma-2-9b.json")),
    ("gemma-3-1b", include_str!("../../../config/models/gemma-3-1b.json")),
    ("gemma-3-27b", include_str!("../../../config/models/gemma-3-27b.json")),
    ("deepseek-v2-lite", include_str!("../../../config/models/deepseek-v2-lite.json")),
    ("deepseek-v3", include_str!("../../../config/models/deepseek-v3.json")),
    ("gpt-oss-20b", include_str!("../../../config/models/gpt-oss-20b.json")),
];

/// The built-in model `name`.
pub fn builtin(name: &str) -> Result<ModelSpec, SpecError> {
    let (_, text) = BUILTINS.iter().find(|(n, _)| *n == name).ok_or_else(|| SpecError::UnknownBuiltin {
        name: name.to_string(),
        known: BUILTINS.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", "),
    })?;
    from_hf_config(name, text)
}
