//! The cache representation of a model: which layers store what, per token.
//!
//! A model is a list of layers, each with its own attention representation
//! and retention rule; byte counts are always a sum over layers, never one
//! uniform product. Specs come from a Hugging Face `config.json`
//! ([`from_hf_config`]), a TOML spec ([`from_toml_spec`]) or a built-in real
//! model ([`builtin`]). All of it is pure: callers read the files.

mod builtin;
mod hf;
mod inventory;
mod spec;

pub use builtin::{builtin, BUILTINS};
pub use hf::from_hf_config;
pub use inventory::{inventory, Inventory, InventoryError, KindRow, LayerInventory};
pub use spec::from_toml_spec;

use crate::format::CacheFormat;
use serde::Serialize;

/// Most layers a model may have: far above any real model, low enough that
/// a hostile config cannot make a reader allocate without bound.
pub const MAX_LAYERS: u64 = 4096;
/// Most KV heads per layer.
pub const MAX_HEADS: u32 = 1 << 16;
/// Most elements per row (head_dim, v_head_dim, MLA latent width).
pub const MAX_DIM: u32 = 1 << 20;
/// Most tokens in one request.
pub const MAX_TOKENS: u64 = 1 << 40;
/// Largest constant per-layer state.
pub const MAX_STATE_BYTES: u64 = 1 << 40;
/// Largest block size in tokens.
pub const MAX_BLOCK_SIZE: u32 = 1 << 20;
/// Largest row alignment in bytes.
pub const MAX_ROW_ALIGN: u32 = 1 << 20;
/// Largest block alignment in bytes (1 GiB pages).
pub const MAX_BLOCK_ALIGN: u32 = 1 << 30;

/// What one layer stores per token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Attention {
    /// Dense (MHA/GQA/MQA) attention: K rows of `head_dim` and V rows of
    /// `v_head_dim`, one per KV head per token.
    Dense {
        /// KV heads (never query heads).
        kv_heads: u32,
        /// Elements per K row.
        head_dim: u32,
        /// Elements per V row.
        v_head_dim: u32,
    },
    /// Multi-head latent attention: one latent row of
    /// `kv_lora_rank + qk_rope_head_dim` elements per token, no head dimension.
    Mla {
        /// Compressed KV width.
        kv_lora_rank: u32,
        /// Decoupled rotary key width.
        qk_rope_head_dim: u32,
    },
    /// Reuses the KV of an earlier layer and stores nothing itself.
    SharedWith {
        /// The layer whose cache this layer reads.
        layer: u32,
    },
    /// No attention cache (e.g. a pure SSM/MLP layer).
    None,
}

/// Which token positions a layer keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Retention {
    /// Every position.
    All,
    /// The first `sinks` positions plus the most recent `window` positions.
    ///
    /// Convention: `window` is the Hugging Face `sliding_window` value, taken
    /// as the number of most recent positions kept, so a layer retains
    /// `min(tokens, sinks + window)` positions. A kernel that needs only
    /// `window - 1` past keys for the next query still finds them all.
    Window {
        /// Most recent positions kept.
        window: u64,
        /// Leading attention-sink positions kept as well.
        sinks: u64,
    },
}

impl Retention {
    /// The retained positions of a sequence of `tokens`, as at most two
    /// half-open ranges in increasing order.
    #[allow(clippy::single_range_in_vec_init)] // a list of ranges, often of one
    pub fn ranges(&self, tokens: u64) -> Vec<std::ops::Range<u64>> {
        match *self {
            Retention::All => vec![0..tokens],
            Retention::Window { window, sinks } => {
                if tokens <= sinks + window {
                    vec![0..tokens]
                } else if sinks == 0 {
                    vec![tokens - window..tokens]
                } else {
                    vec![0..sinks, tokens - window..tokens]
                }
            }
        }
    }

    /// Number of retained positions of a sequence of `tokens`.
    pub fn retained(&self, tokens: u64) -> u64 {
        self.ranges(tokens).iter().map(|r| r.end - r.start).sum()
    }
}

/// One layer of a model's cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct LayerSpec {
    /// What it stores per token.
    pub attention: Attention,
    /// Which positions it keeps.
    pub retention: Retention,
    /// Per-layer constant state (e.g. SSM/conv state) in bytes, independent
    /// of tokens and of the cache format.
    pub state_bytes: u64,
}

impl LayerSpec {
    /// A dense layer that keeps every position.
    pub fn dense(kv_heads: u32, head_dim: u32, v_head_dim: u32) -> Self {
        LayerSpec {
            attention: Attention::Dense { kv_heads, head_dim, v_head_dim },
            retention: Retention::All,
            state_bytes: 0,
        }
    }

    /// Short kind name for tables: `full`, `sliding`, `mla`, `mla-sliding`,
    /// `shared`, `state`, `none`.
    pub fn kind(&self) -> &'static str {
        match (self.attention, self.retention) {
            (Attention::Dense { .. }, Retention::All) => "full",
            (Attention::Dense { .. }, Retention::Window { .. }) => "sliding",
            (Attention::Mla { .. }, Retention::All) => "mla",
            (Attention::Mla { .. }, Retention::Window { .. }) => "mla-sliding",
            (Attention::SharedWith { .. }, _) => "shared",
            (Attention::None, _) if self.state_bytes > 0 => "state",
            (Attention::None, _) => "none",
        }
    }

    /// The tensors this layer stores per token: (tensor, rows per token, elements per row).
    pub fn tensors(&self) -> Vec<TensorShape> {
        match self.attention {
            Attention::Dense { kv_heads, head_dim, v_head_dim } => vec![
                TensorShape { tensor: Tensor::K, heads: kv_heads, dim: head_dim },
                TensorShape { tensor: Tensor::V, heads: kv_heads, dim: v_head_dim },
            ],
            Attention::Mla { kv_lora_rank, qk_rope_head_dim } => vec![TensorShape {
                tensor: Tensor::Latent,
                heads: 1,
                dim: kv_lora_rank + qk_rope_head_dim,
            }],
            Attention::SharedWith { .. } | Attention::None => vec![],
        }
    }
}

/// Which tensor of a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Tensor {
    /// Keys.
    K,
    /// Values.
    V,
    /// MLA latent (compressed KV + rotary key).
    Latent,
    /// Constant per-layer state (e.g. SSM/conv state), one blob per layer.
    State,
}

/// Shape of one stored tensor of a layer, per token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TensorShape {
    /// Which tensor.
    pub tensor: Tensor,
    /// Rows per token (KV heads; 1 for an MLA latent).
    pub heads: u32,
    /// Elements per row.
    pub dim: u32,
}

/// A model's cache description.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ModelSpec {
    /// Display name.
    pub name: String,
    /// `model_type` for HF configs, `toml` for specs.
    pub family: String,
    /// The dtype the config declares for activations (`torch_dtype`/`dtype`),
    /// the default cache format. Weight quantization does not change it.
    pub dtype: Option<String>,
    /// Layers in order.
    pub layers: Vec<LayerSpec>,
}

/// Why a model spec was refused. Every variant names the field.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum SpecError {
    /// The text is not valid JSON / TOML.
    #[error("cannot parse {what}: {reason}")]
    Syntax {
        /// `config.json` or `TOML spec`.
        what: &'static str,
        /// Parser message.
        reason: String,
    },
    /// A required field is absent.
    #[error("missing required field `{0}`")]
    Missing(String),
    /// A field has the wrong type or an impossible value.
    #[error("field `{field}`: {reason}")]
    Invalid {
        /// Field name (dotted path for nested fields).
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Without `head_dim`, `hidden_size` must be a multiple of `num_attention_heads`.
    #[error("field `head_dim` is absent and hidden_size {hidden_size} is not divisible by num_attention_heads {heads}")]
    HeadsDoNotDivide {
        /// `hidden_size`.
        hidden_size: u64,
        /// `num_attention_heads`.
        heads: u64,
    },
    /// The config's `model_type` has no reader; write a TOML spec instead.
    #[error("field `model_type`: unsupported model type `{0}` (supported: {supported}); describe it with a TOML spec instead", supported = hf::SUPPORTED.join(", "))]
    UnknownModelType(String),
    /// No built-in model has this name.
    #[error("unknown built-in model `{name}` (built-ins: {known})")]
    UnknownBuiltin {
        /// Name as given.
        name: String,
        /// Comma-separated built-in names.
        known: String,
    },
}

impl ModelSpec {
    /// Checks invariants every reader must hold: at least one layer,
    /// non-zero sizes, shared layers pointing at an earlier storing layer.
    pub fn validate(&self) -> Result<(), SpecError> {
        if self.layers.is_empty() {
            return Err(SpecError::Invalid { field: "layers".into(), reason: "a model needs at least one layer".into() });
        }
        if self.layers.len() as u64 > MAX_LAYERS {
            return Err(SpecError::Invalid {
                field: "layers".into(),
                reason: format!("{} layers, more than the {MAX_LAYERS} kvwire accepts", self.layers.len()),
            });
        }
        for (i, layer) in self.layers.iter().enumerate() {
            let bad = |field: &str, reason: &str| {
                Err(SpecError::Invalid { field: format!("layers[{i}].{field}"), reason: reason.into() })
            };
            let dim_ok = |d: u32| d > 0 && d <= MAX_DIM;
            match layer.attention {
                Attention::Dense { kv_heads, head_dim, v_head_dim } => {
                    if kv_heads == 0 || kv_heads > MAX_HEADS {
                        return bad("kv_heads", &format!("must be in 1..={MAX_HEADS}"));
                    }
                    if !dim_ok(head_dim) {
                        return bad("head_dim", &format!("must be in 1..={MAX_DIM}"));
                    }
                    if !dim_ok(v_head_dim) {
                        return bad("v_head_dim", &format!("must be in 1..={MAX_DIM}"));
                    }
                }
                Attention::Mla { kv_lora_rank, qk_rope_head_dim } => {
                    if !dim_ok(kv_lora_rank) {
                        return bad("kv_lora_rank", &format!("must be in 1..={MAX_DIM}"));
                    }
                    if qk_rope_head_dim > MAX_DIM {
                        return bad("qk_rope_head_dim", &format!("must be at most {MAX_DIM}"));
                    }
                }
                Attention::SharedWith { layer: src } => {
                    let ok = (src as usize) < i
                        && matches!(
                            self.layers[src as usize].attention,
                            Attention::Dense { .. } | Attention::Mla { .. }
                        );
                    if !ok {
                        return bad("shares_with", "must name an earlier layer that stores its own cache");
                    }
                }
                Attention::None => {}
            }
            if layer.state_bytes > MAX_STATE_BYTES {
                return bad("state_bytes", &format!("must be at most {MAX_STATE_BYTES}"));
            }
            if let Retention::Window { window, .. } = layer.retention {
                if window == 0 {
                    return bad("window", "must be > 0");
                }
            }
        }
        Ok(())
    }
}

/// How a cache is laid out in memory, beyond the format: paging and padding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Geometry {
    /// The cache format of every stored row.
    pub format: CacheFormat,
    /// Tokens per block (page).
    pub block_size: u32,
    /// Each row is padded up to a multiple of this many bytes (1 = none).
    pub row_align: u32,
    /// Each block of each tensor is padded up to a multiple of this many bytes (1 = none).
    pub block_align: u32,
}

/// Why a geometry was refused.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum GeometryError {
    /// A size that must be positive was zero.
    #[error("`{0}` must be > 0")]
    Zero(&'static str),
    /// A size is beyond what kvwire accepts.
    #[error("`{name}` is {value}, more than the {max} kvwire accepts")]
    TooLarge {
        /// Setting name.
        name: &'static str,
        /// Value given.
        value: u32,
        /// Largest accepted value.
        max: u32,
    },
}

impl Geometry {
    /// A geometry with no padding.
    pub fn new(format: CacheFormat, block_size: u32) -> Result<Self, GeometryError> {
        Geometry { format, block_size, row_align: 1, block_align: 1 }.validated()
    }

    /// Checks that every size is positive and within kvwire's limits.
    pub fn validated(self) -> Result<Self, GeometryError> {
        for (name, value, max) in [
            ("block_size", self.block_size, MAX_BLOCK_SIZE),
            ("row_align", self.row_align, MAX_ROW_ALIGN),
            ("block_align", self.block_align, MAX_BLOCK_ALIGN),
        ] {
            if value == 0 {
                return Err(GeometryError::Zero(name));
            }
            if value > max {
                return Err(GeometryError::TooLarge { name, value, max });
            }
        }
        Ok(self)
    }

    /// Payload bytes of one row of `dim` elements (no padding).
    pub fn row_bytes(&self, dim: u32) -> u64 {
        self.format.row_bytes(dim)
    }

    /// Distance between consecutive rows in memory.
    pub fn row_stride(&self, dim: u32) -> u64 {
        self.row_bytes(dim).next_multiple_of(u64::from(self.row_align))
    }

    /// Bytes one block of one tensor occupies on a rank holding `heads` rows per token.
    /// Within the limits of [`Geometry::validated`] and [`ModelSpec::validate`]
    /// this stays below 2^60.
    pub fn block_bytes(&self, heads: u32, dim: u32) -> u64 {
        (u64::from(self.block_size) * u64::from(heads) * self.row_stride(dim))
            .next_multiple_of(u64::from(self.block_align))
    }

    /// Number of distinct blocks the retained positions of `retention` touch
    /// at `tokens`, with positions paged at their absolute index (position
    /// `p` lives in block `p / block_size`). A window that starts mid-block
    /// occupies that whole block.
    pub fn blocks_touched(&self, retention: &Retention, tokens: u64) -> u64 {
        let b = u64::from(self.block_size);
        let mut last_end = 0; // first block not yet counted
        let mut blocks = 0;
        for r in retention.ranges(tokens) {
            if r.is_empty() {
                continue;
            }
            let first = (r.start / b).max(last_end);
            let end = r.end.div_ceil(b);
            blocks += end.saturating_sub(first);
            last_end = last_end.max(end);
        }
        blocks
    }
}
