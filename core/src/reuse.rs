//! Prefix reuse: may the destination keep positions it already holds?
//!
//! Only when the held cache was computed by the same model and adapter, in
//! the same cache format, for the same tenant, at the same absolute
//! positions with the same rotary parameters. Byte counts alone cannot tell
//! a wrong revision or RoPE offset apart, so every field is compared.

use serde::{Deserialize, Serialize};

/// What a cached prefix was computed with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CacheIdentity {
    /// Digest of the model weights/revision.
    pub model_digest: String,
    /// Digest of the adapter (empty for none).
    pub adapter_digest: String,
    /// Cache format id (`name/vN`).
    pub format: String,
    /// Access scope.
    pub tenant: String,
    /// Rotary parameters (theta, scaling), canonical text.
    pub rope: String,
    /// Absolute position of the first token.
    pub position_offset: u64,
}

/// Why a held prefix cannot be reused; each variant names the field.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum ReuseRefusal {
    /// Different model.
    #[error("model digest mismatch: expected {expected}, got {got}")]
    ModelDigest {
        /// The request's.
        expected: String,
        /// The held prefix's.
        got: String,
    },
    /// Different adapter.
    #[error("adapter digest mismatch: expected {expected}, got {got}")]
    AdapterDigest {
        /// The request's.
        expected: String,
        /// The held prefix's.
        got: String,
    },
    /// Different cache format.
    #[error("cache format mismatch: expected {expected}, got {got}")]
    Format {
        /// The request's.
        expected: String,
        /// The held prefix's.
        got: String,
    },
    /// Different tenant: never shared across scopes.
    #[error("tenant mismatch: expected {expected}, got {got}")]
    Tenant {
        /// The request's.
        expected: String,
        /// The held prefix's.
        got: String,
    },
    /// Different rotary parameters.
    #[error("rope parameters mismatch: expected {expected}, got {got}")]
    Rope {
        /// The request's.
        expected: String,
        /// The held prefix's.
        got: String,
    },
    /// Different absolute positions.
    #[error("position offset mismatch: expected {expected}, got {got}")]
    PositionOffset {
        /// The request's.
        expected: u64,
        /// The held prefix's.
        got: u64,
    },
}

/// The number of leading positions the destination may keep: `min(held, tokens)`
/// when every identity field agrees, else the first disagreement.
pub fn check_prefix(request: &CacheIdentity, held: &CacheIdentity, held_tokens: u64, tokens: u64) -> Result<u64, ReuseRefusal> {
    let s = |a: &String, b: &String| (a.clone(), b.clone());
    if request.model_digest != held.model_digest {
        let (expected, got) = s(&request.model_digest, &held.model_digest);
        return Err(ReuseRefusal::ModelDigest { expected, got });
    }
    if request.adapter_digest != held.adapter_digest {
        let (expected, got) = s(&request.adapter_digest, &held.adapter_digest);
        return Err(ReuseRefusal::AdapterDigest { expected, got });
    }
    if request.format != held.format {
        let (expected, got) = s(&request.format, &held.format);
        return Err(ReuseRefusal::Format { expected, got });
    }
    if request.tenant != held.tenant {
        let (expected, got) = s(&request.tenant, &held.tenant);
        return Err(ReuseRefusal::Tenant { expected, got });
    }
    if request.rope != held.rope {
        let (expected, got) = s(&request.rope, &held.rope);
        return Err(ReuseRefusal::Rope { expected, got });
    }
    if request.position_offset != held.position_offset {
        return Err(ReuseRefusal::PositionOffset { expected: request.position_offset, got: held.position_offset });
    }
    Ok(held_tokens.min(tokens))
}
