//! Concrete, versioned cache formats.
//!
//! A format says exactly how one token-head *row* of a K, V or MLA-latent
//! tensor is stored: element bits, packing, and the scales / zero points that
//! travel with it. The inventory and the planner derive every byte count from
//! here, so "fp8 is half of bf16" can never sneak in: a per-token-head scale
//! makes the fp8 row longer than half.
//!
//! Row layout (v1 of every format): the packed elements first, then the row's
//! metadata (per-row scale, or per-group scale + zero pairs in group order).
//! Row and block padding are not part of the format; they belong to
//! [`crate::layout::Geometry`].

use serde::Serialize;

/// How scales and zero points are attached to the elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Scales {
    /// Plain elements, nothing else stored.
    None,
    /// One static scale of `bytes` per tensor (K, V or latent) per layer.
    /// Calibrated once; counted once per transfer, never per token.
    PerTensor {
        /// Bytes of the scale.
        bytes: u32,
    },
    /// One scale of `bytes` per (token, KV head) row, stored after the row's elements.
    PerRow {
        /// Bytes of the scale.
        bytes: u32,
    },
    /// One scale+zero record of `bytes` per group of `group` elements of a row;
    /// a partial final group still gets a full record.
    PerGroup {
        /// Elements per group.
        group: u32,
        /// Bytes of one scale+zero record.
        bytes: u32,
    },
}

/// A concrete cache format, e.g. `fp8_e4m3_pth/v1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct CacheFormat {
    /// Short name (`bf16`, `fp8_e4m3_pth`, …).
    pub name: &'static str,
    /// Layout version; bumps whenever the byte layout of a row changes.
    pub version: u32,
    /// Bits per stored element.
    pub elem_bits: u32,
    /// Scales/zero points stored with the elements.
    pub scales: Scales,
    /// One-line description for tables and docs.
    #[serde(skip)]
    pub summary: &'static str,
}

/// Every format kvwire knows, in the order `kvwire formats` lists them.
pub const FORMATS: &[CacheFormat] = &[
    CacheFormat { name: "bf16", version: 1, elem_bits: 16, scales: Scales::None, summary: "bfloat16 elements" },
    CacheFormat { name: "fp16", version: 1, elem_bits: 16, scales: Scales::None, summary: "IEEE half elements" },
    CacheFormat { name: "fp32", version: 1, elem_bits: 32, scales: Scales::None, summary: "IEEE single elements" },
    CacheFormat {
        name: "fp8_e4m3",
        version: 1,
        elem_bits: 8,
        scales: Scales::PerTensor { bytes: 4 },
        summary: "fp8 e4m3 elements, static f32 scale per tensor per layer",
    },
    CacheFormat {
        name: "fp8_e5m2",
        version: 1,
        elem_bits: 8,
        scales: Scales::PerTensor { bytes: 4 },
        summary: "fp8 e5m2 elements, static f32 scale per tensor per layer",
    },
    CacheFormat {
        name: "fp8_e4m3_pth",
        version: 1,
        elem_bits: 8,
        scales: Scales::PerRow { bytes: 4 },
        summary: "fp8 e4m3 elements + f32 scale per (token, KV head)",
    },
    CacheFormat {
        name: "int4_g32",
        version: 1,
        elem_bits: 4,
        scales: Scales::PerGroup { group: 32, bytes: 4 },
        summary: "4-bit elements two per byte + f16 scale and f16 zero per 32 elements",
    },
];

/// Why a format name was refused.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum FormatError {
    /// The name matches no known format or dtype alias.
    #[error("unknown cache format `{0}` (known: {known})", known = known_names())]
    Unknown(String),
    /// The name is known but the version is not.
    #[error("cache format `{name}` has no version {version} (known: v{known})")]
    UnknownVersion {
        /// Format name as given.
        name: String,
        /// Version as given.
        version: String,
        /// The version kvwire implements.
        known: u32,
    },
}

fn known_names() -> String {
    FORMATS.iter().map(|f| f.name).collect::<Vec<_>>().join(", ")
}

impl CacheFormat {
    /// Parses `name` or `name/vN`. Hugging Face dtype spellings
    /// (`bfloat16`, `float16`, `half`, `float32`, `float`) map to the plain formats.
    pub fn parse(text: &str) -> Result<Self, FormatError> {
        let (name, version) = match text.split_once('/') {
            Some((n, v)) => (n, Some(v)),
            None => (text, None),
        };
        let canonical = match name.trim().to_ascii_lowercase().as_str() {
            "bfloat16" | "torch.bfloat16" => "bf16".to_string(),
            "float16" | "half" | "torch.float16" => "fp16".to_string(),
            "float32" | "float" | "torch.float32" => "fp32".to_string(),
            other => other.to_string(),
        };
        let format = FORMATS
            .iter()
            .find(|f| f.name == canonical)
            .copied()
            .ok_or_else(|| FormatError::Unknown(text.to_string()))?;
        if let Some(v) = version {
            if v.strip_prefix('v').and_then(|n| n.parse::<u32>().ok()) != Some(format.version) {
                return Err(FormatError::UnknownVersion {
                    name: name.to_string(),
                    version: v.to_string(),
                    known: format.version,
                });
            }
        }
        Ok(format)
    }

    /// `name/vN`, the identity a manifest and the JSON output carry.
    pub fn id(&self) -> String {
        format!("{}/v{}", self.name, self.version)
    }

    /// Bytes of one stored row of `dim` elements: packed elements plus the
    /// row's own metadata, before any row alignment.
    pub fn row_bytes(&self, dim: u32) -> u64 {
        let dim = u64::from(dim);
        let data = (dim * u64::from(self.elem_bits)).div_ceil(8);
        let meta = match self.scales {
            Scales::None | Scales::PerTensor { .. } => 0,
            Scales::PerRow { bytes } => u64::from(bytes),
            Scales::PerGroup { group, bytes } => dim.div_ceil(u64::from(group)) * u64::from(bytes),
        };
        data + meta
    }

    /// Bytes stored once per tensor per layer (static scales), independent of tokens.
    pub fn tensor_static_bytes(&self) -> u64 {
        match self.scales {
            Scales::PerTensor { bytes } => u64::from(bytes),
            _ => 0,
        }
    }
}

impl std::fmt::Display for CacheFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/v{}", self.name, self.version)
    }
}
