//! Parallel layouts and shard maps: which rank holds which layers and KV heads.
//!
//! Rank numbering: `rank = pp_stage * tp + tp_rank`. A PP split gives each
//! stage a contiguous run of layers; by default the split is as even as
//! possible with the earlier stages taking one extra layer when the count
//! does not divide (80 layers over 3 stages → 27, 27, 26).
//!
//! Heads: with `tp <= kv_heads` and `kv_heads % tp == 0` each TP rank holds
//! `kv_heads / tp` consecutive heads; with `tp > kv_heads` and
//! `tp % kv_heads == 0` each head is replicated on `tp / kv_heads`
//! consecutive ranks; MLA latents are replicated on every TP rank. Anything
//! else is refused. An explicit map (TOML) covers layouts no formula does.
//!
//! Memory layout of one region (one tensor of one layer on one rank):
//! block `b` starts at `b * block_bytes`; inside a block, `nhd` stores rows
//! as `[token][head]` and `hnd` as `[head][token]`. A row is the format's
//! elements followed by its per-row (or per-group) scales, padded to the
//! row alignment — scales of quantized formats live inside their row.

use crate::layout::{Attention, Geometry, ModelSpec, Tensor};
use crate::tensors::KvOrder;
use serde::{Deserialize, Serialize};
use std::ops::Range;

/// Order of rows inside a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemLayout {
    /// `[block][token][head][dim]`.
    Nhd,
    /// `[block][head][token][dim]`.
    Hnd,
}

/// What a layout string or explicit map says, before it meets a model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayoutSpec {
    /// Tensor-parallel degree.
    pub tp: u32,
    /// Pipeline-parallel degree.
    pub pp: u32,
    /// Layers per PP stage; `None` = as even as possible.
    pub pp_layers: Option<Vec<u32>>,
    /// Tokens per block.
    pub block_size: u32,
    /// Row order inside a block.
    pub mem: MemLayout,
    /// Row padding unit in bytes.
    pub row_align: u32,
    /// Block padding unit in bytes.
    pub block_align: u32,
    /// How the request's block table is laid out.
    pub table: TableKind,
    /// Explicit rank → (layers × heads) entries; overrides `tp`/`pp`.
    pub explicit: Option<Vec<ExplicitEntry>>,
    /// Engine tensors (`kv=`, see [`crate::tensors`]); `None` is kvwire's contiguous layout.
    pub kv: Option<KvOrder>,
}

/// How a request's block table is chosen when none is given explicitly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableKind {
    /// Blocks `0, 1, 2, …`: a fresh allocation.
    Contiguous,
    /// A deterministic permutation of a pool with a quarter spare blocks:
    /// what a long-running engine's allocator hands out.
    Shuffled {
        /// Permutation seed.
        seed: u64,
    },
}

impl Default for LayoutSpec {
    fn default() -> Self {
        LayoutSpec { tp: 1, pp: 1, pp_layers: None, block_size: 16, mem: MemLayout::Nhd, row_align: 1, block_align: 1, table: TableKind::Contiguous, explicit: None, kv: None }
    }
}

/// One entry of an explicit shard map: `rank` holds `heads` of every layer in `layers`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExplicitEntry {
    /// Rank number.
    pub rank: u32,
    /// Half-open layer range `[start, end)`.
    pub layers: [u32; 2],
    /// Half-open KV head range `[start, end)`; MLA layers must use `[0, 1)`.
    pub heads: [u32; 2],
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ExplicitFile {
    rank: Vec<ExplicitEntry>,
}

/// Why a layout was refused; every variant names the numbers involved.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum ShardError {
    /// A layout option is malformed.
    #[error("layout option `{key}`: {reason}")]
    Option {
        /// Option key.
        key: String,
        /// What is wrong.
        reason: String,
    },
    /// TP does not divide the KV heads nor is a multiple of them.
    #[error("layer {layer}: tp={tp} cannot shard {kv_heads} KV heads (need kv_heads % tp == 0, or tp % kv_heads == 0 to replicate)")]
    Heads {
        /// First layer where it fails.
        layer: u32,
        /// TP degree.
        tp: u32,
        /// KV heads of that layer.
        kv_heads: u32,
    },
    /// The PP split does not fit the model.
    #[error("pp split: {0}")]
    PpSplit(String),
    /// An explicit map is inconsistent.
    #[error("explicit shard map: {0}")]
    Explicit(String),
}

/// Most ranks on one side of a transfer.
pub const MAX_RANKS: u32 = 1 << 16;

fn opt_err(key: &str, reason: impl Into<String>) -> ShardError {
    ShardError::Option { key: key.to_string(), reason: reason.into() }
}

impl LayoutSpec {
    /// Parses `tp=8,pp=2,pp_layers=27,27,26,block=16,layout=nhd,row_align=64,block_align=4096`,
    /// or with engine tensors `tp=2,block=16,kv=vllm_nhd,pad=b256`.
    /// Values of `pp_layers` may also be separated by `:`.
    pub fn parse(text: &str) -> Result<Self, ShardError> {
        let mut spec = LayoutSpec::default();
        let mut pairs: Vec<(String, String)> = Vec::new();
        let mut layout_key = false;
        let mut pad = None;
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            match part.split_once('=') {
                Some((k, v)) => pairs.push((k.trim().to_string(), v.trim().to_string())),
                // A bare number continues the previous list value (pp_layers=27,27,26).
                None => match pairs.last_mut() {
                    Some((k, v)) if k == "pp_layers" => {
                        v.push(':');
                        v.push_str(part);
                    }
                    _ => return Err(opt_err(part, "expected key=value")),
                },
            }
        }
        for (key, value) in pairs {
            let num = |v: &str| -> Result<u32, ShardError> {
                match v.parse::<u32>() {
                    Ok(0) => Err(opt_err(&key, "must be > 0")),
                    Ok(n) => Ok(n),
                    Err(_) => Err(opt_err(&key, format!("expected a positive integer, got `{v}`"))),
                }
            };
            match key.as_str() {
                "tp" => spec.tp = num(&value)?.min(MAX_RANKS + 1),
                "pp" => spec.pp = num(&value)?.min(MAX_RANKS + 1),
                "pp_layers" => spec.pp_layers = Some(value.split(':').map(num).collect::<Result<_, _>>()?),
                "block" | "block_size" => spec.block_size = num(&value)?,
                "row_align" => spec.row_align = num(&value)?,
                "block_align" => spec.block_align = num(&value)?,
                "table" => {
                    spec.table = match value.split_once(':') {
                        None if value == "contig" => TableKind::Contiguous,
                        None if value == "shuffle" => TableKind::Shuffled { seed: 1 },
                        Some(("shuffle", seed)) => TableKind::Shuffled {
                            seed: seed.parse().map_err(|_| opt_err(&key, format!("bad seed `{seed}`")))?,
                        },
                        _ => return Err(opt_err(&key, format!("expected contig, shuffle or shuffle:SEED, got `{value}`"))),
                    }
                }
                "kv" => {
                    spec.kv = match value.as_str() {
                        "contiguous" => None,
                        v => Some(KvOrder::parse(v).map_err(|e| opt_err(&key, e.to_string()))?),
                    }
                }
                "pad" => pad = Some(value),
                "layout" => {
                    layout_key = true;
                    spec.mem = match value.as_str() {
                        "nhd" => MemLayout::Nhd,
                        "hnd" => MemLayout::Hnd,
                        _ => return Err(opt_err(&key, format!("expected nhd or hnd, got `{value}`"))),
                    }
                }
                _ => {
                    return Err(opt_err(
                        &key,
                        "unknown key (tp, pp, pp_layers, block, layout, row_align, block_align, table, kv, pad)",
                    ))
                }
            }
        }
        if let Some(pad) = pad {
            let order = spec.kv.take().ok_or_else(|| opt_err("pad", "needs kv=: it pads engine tensors (kvwire's own layout pads with row_align and block_align)"))?;
            spec.kv = Some(order.with_pad(&pad).map_err(|e| opt_err("pad", e.to_string()))?);
        }
        if let Some(order) = &spec.kv {
            // An engine order places heads; `pad=`, not these, pads it.
            let clash = [("layout", layout_key), ("row_align", spec.row_align != 1), ("block_align", spec.block_align != 1)];
            if let Some((k, _)) = clash.iter().find(|c| c.1) {
                return Err(opt_err(k, format!("cannot be combined with kv={}: the engine order says where every row lives (pad it with pad=)", order.name())));
            }
        }
        if let Some(l) = &spec.pp_layers {
            if spec.pp == 1 && l.len() > 1 {
                spec.pp = l.len() as u32;
            }
        }
        Ok(spec)
    }

    /// Reads an explicit map (`[[rank]]` entries with `rank`, `layers`, `heads`).
    pub fn with_explicit_toml(mut self, text: &str) -> Result<Self, ShardError> {
        let file: ExplicitFile = toml::from_str(text).map_err(|e| ShardError::Explicit(e.message().to_string()))?;
        self.explicit = Some(file.rank);
        Ok(self)
    }

    /// The cache geometry this layout uses with `format`.
    pub fn geometry(&self, format: crate::CacheFormat) -> Result<Geometry, crate::layout::GeometryError> {
        Geometry { format, block_size: self.block_size, row_align: self.row_align, block_align: self.block_align }.validated()
    }

    /// Resolves the layout against a model.
    pub fn shard_map(&self, model: &ModelSpec) -> Result<ShardMap, ShardError> {
        match &self.explicit {
            Some(entries) => explicit_map(model, entries),
            None => formula_map(model, self.tp, self.pp, self.pp_layers.as_deref()),
        }
    }
}

/// What one rank holds of one layer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LayerShard {
    /// Layer index.
    pub layer: u32,
    /// KV heads held, consecutive; `0..1` for an MLA latent; empty for layers
    /// that store no per-token tensors.
    pub heads: Range<u32>,
}

/// Everything one rank holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RankShard {
    /// Rank number.
    pub rank: u32,
    /// Held layers in increasing order.
    pub layers: Vec<LayerShard>,
}

impl RankShard {
    /// The heads this rank holds of `layer`, if it holds the layer.
    pub fn heads_of(&self, layer: u32) -> Option<Range<u32>> {
        self.layers
            .binary_search_by_key(&layer, |l| l.layer)
            .ok()
            .map(|i| self.layers[i].heads.clone())
    }
}

/// A resolved shard map: rank → layers × heads.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ShardMap {
    /// TP degree (1 for explicit maps).
    pub tp: u32,
    /// Layers per PP stage (one entry for explicit maps).
    pub pp_layers: Vec<u32>,
    /// Every rank, indexed by rank number.
    pub ranks: Vec<RankShard>,
}

/// Layers per stage, as even as possible, earlier stages larger.
pub fn even_split(layers: u32, pp: u32) -> Vec<u32> {
    (0..pp).map(|s| layers / pp + u32::from(s < layers % pp)).collect()
}

/// Heads one TP rank holds of one layer (see module docs).
fn tp_heads(attention: &Attention, layer: u32, tp: u32, tp_rank: u32) -> Result<Range<u32>, ShardError> {
    match *attention {
        Attention::Dense { kv_heads, .. } => {
            if tp <= kv_heads && kv_heads % tp == 0 {
                let per = kv_heads / tp;
                Ok(tp_rank * per..(tp_rank + 1) * per)
            } else if tp > kv_heads && tp % kv_heads == 0 {
                let h = tp_rank / (tp / kv_heads);
                Ok(h..h + 1)
            } else {
                Err(ShardError::Heads { layer, tp, kv_heads })
            }
        }
        Attention::Mla { .. } => Ok(0..1),
        Attention::SharedWith { .. } | Attention::None => Ok(0..0),
    }
}

fn formula_map(model: &ModelSpec, tp: u32, pp: u32, pp_layers: Option<&[u32]>) -> Result<ShardMap, ShardError> {
    let n = model.layers.len() as u32;
    if u64::from(tp) * u64::from(pp) > u64::from(MAX_RANKS) {
        return Err(ShardError::Option {
            key: "tp".into(),
            reason: format!("tp={tp} × pp={pp} is more than the {MAX_RANKS} ranks kvwire accepts"),
        });
    }
    let split = match pp_layers {
        Some(split) => {
            if split.len() as u32 != pp {
                return Err(ShardError::PpSplit(format!("pp={pp} but pp_layers has {} entries", split.len())));
            }
            // u64: a hostile split like 33,4294967295 must not wrap to the layer count.
            let sum: u64 = split.iter().map(|&c| u64::from(c)).sum();
            if sum != u64::from(n) {
                return Err(ShardError::PpSplit(format!("pp_layers sums to {sum} but the model has {n} layers")));
            }
            split.to_vec()
        }
        None => {
            if pp > n {
                return Err(ShardError::PpSplit(format!("pp={pp} is more than the model's {n} layers")));
            }
            even_split(n, pp)
        }
    };
    let mut ranks = Vec::with_capacity((tp * pp) as usize);
    let mut first = 0;
    for (stage, &count) in split.iter().enumerate() {
        for tp_rank in 0..tp {
            let mut layers = Vec::with_capacity(count as usize);
            for layer in first..first + count {
                let heads = tp_heads(&model.layers[layer as usize].attention, layer, tp, tp_rank)?;
                layers.push(LayerShard { layer, heads });
            }
            ranks.push(RankShard { rank: stage as u32 * tp + tp_rank, layers });
        }
        first += count;
    }
    Ok(ShardMap { tp, pp_layers: split, ranks })
}

fn explicit_map(model: &ModelSpec, entries: &[ExplicitEntry]) -> Result<ShardMap, ShardError> {
    let n = model.layers.len() as u32;
    let n_ranks = entries.iter().map(|e| u64::from(e.rank) + 1).max().unwrap_or(0);
    if n_ranks > u64::from(MAX_RANKS) {
        return Err(ShardError::Explicit(format!("rank {} is past the {MAX_RANKS} ranks kvwire accepts", n_ranks - 1)));
    }
    let n_ranks = n_ranks as u32;
    let mut ranks: Vec<RankShard> = (0..n_ranks).map(|rank| RankShard { rank, layers: vec![] }).collect();
    for e in entries {
        let [l0, l1] = e.layers;
        let [h0, h1] = e.heads;
        if l0 >= l1 || l1 > n {
            return Err(ShardError::Explicit(format!("rank {}: layers [{l0}, {l1}) is empty or past the model's {n} layers", e.rank)));
        }
        for layer in l0..l1 {
            let max_heads = match model.layers[layer as usize].attention {
                Attention::Dense { kv_heads, .. } => kv_heads,
                Attention::Mla { .. } => 1,
                _ => 0,
            };
            let heads = if max_heads == 0 { 0..0 } else { h0..h1 };
            if max_heads > 0 && (h0 >= h1 || h1 > max_heads) {
                return Err(ShardError::Explicit(format!(
                    "rank {}: heads [{h0}, {h1}) of layer {layer} is empty or past its {max_heads} heads",
                    e.rank
                )));
            }
            let rs = &mut ranks[e.rank as usize];
            if rs.heads_of(layer).is_some() {
                return Err(ShardError::Explicit(format!("rank {} lists layer {layer} twice", e.rank)));
            }
            let at = rs.layers.partition_point(|l| l.layer < layer);
            rs.layers.insert(at, LayerShard { layer, heads });
        }
    }
    // Every stored head of every layer must live somewhere, or bytes would be lost.
    for (layer, spec) in model.layers.iter().enumerate() {
        let layer = layer as u32;
        for t in spec.tensors().iter().take(1) {
            for h in 0..t.heads {
                if !ranks.iter().any(|r| r.heads_of(layer).is_some_and(|hs| hs.contains(&h))) {
                    return Err(ShardError::Explicit(format!("no rank holds head {h} of layer {layer}")));
                }
            }
        }
        if spec.state_bytes > 0 && !ranks.iter().any(|r| r.heads_of(layer).is_some()) {
            return Err(ShardError::Explicit(format!("no rank holds layer {layer}'s {} bytes of state", spec.state_bytes)));
        }
    }
    Ok(ShardMap { tp: 1, pp_layers: vec![n], ranks })
}

/// Which region of a rank a byte lives in: one region per stored tensor per layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct RegionId {
    /// Layer index.
    pub layer: u32,
    /// Tensor of that layer.
    pub tensor: Tensor,
}
