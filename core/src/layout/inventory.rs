//! The byte inventory: what a model's cache holds for a request, counted from
//! the concrete format, per layer, summed.
//!
//! Counters (see DESIGN.md §1) — never mixed:
//! - `payload_bytes`: retained tokens' rows (elements + their per-row or
//!   per-group scales), plus static per-tensor scales and constant per-layer
//!   state, once each. No padding.
//! - `allocated_bytes`: cache capacity those tokens occupy: every block the
//!   retained positions touch, whole (partial final block rounded up), with
//!   row and block padding, plus the same once-per-layer bytes as payload.
//! - `wire_bytes`: reserved for the transfer layer (payload actually sent
//!   after prefix reuse + framing, manifests, flags); the inventory alone
//!   cannot know it, so it is `None` here.

use super::{Geometry, LayerSpec, ModelSpec};
use serde::Serialize;

/// One layer's figures.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LayerInventory {
    /// Layer index.
    pub layer: u32,
    /// Kind name ([`LayerSpec::kind`]).
    pub kind: &'static str,
    /// Positions this layer keeps.
    pub retained_tokens: u64,
    /// Blocks those positions touch.
    pub blocks: u64,
    /// Payload bytes (see module docs).
    pub payload_bytes: u64,
    /// Allocated bytes (see module docs).
    pub allocated_bytes: u64,
    /// Payload bytes added per retained token.
    pub per_token_bytes: u64,
}

/// Layers of the same kind and per-token size, grouped for tables.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KindRow {
    /// Kind name.
    pub kind: &'static str,
    /// How many layers.
    pub layers: u32,
    /// Retained positions per layer.
    pub retained_tokens: u64,
    /// Payload bytes per retained token per layer.
    pub per_token_bytes: u64,
    /// Sum of the group's payload bytes.
    pub payload_bytes: u64,
    /// Sum of the group's allocated bytes.
    pub allocated_bytes: u64,
}

/// A request's cache inventory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Inventory {
    /// Model name.
    pub model: String,
    /// Format id (`name/vN`).
    pub format: String,
    /// Tokens in the request.
    pub tokens: u64,
    /// Tokens per block.
    pub block_size: u32,
    /// Row padding unit.
    pub row_align: u32,
    /// Block padding unit.
    pub block_align: u32,
    /// Total payload bytes.
    pub payload_bytes: u64,
    /// Total allocated bytes.
    pub allocated_bytes: u64,
    /// Bytes stored once per request whatever its length (static scales, constant state).
    pub fixed_bytes: u64,
    /// Payload bytes per token, when every layer retains every token at this
    /// length (so payload = fixed + tokens × per_token); `None` otherwise.
    pub per_token_bytes: Option<u64>,
    /// Reserved for the transfer layer; always `None` from the inventory.
    pub wire_bytes: Option<u64>,
    /// Per-kind rows for tables.
    pub kinds: Vec<KindRow>,
    /// Every layer.
    pub per_layer: Vec<LayerInventory>,
}

/// Errors of [`inventory`].
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum InventoryError {
    /// A request must hold at least one token.
    #[error("`tokens` must be > 0")]
    ZeroTokens,
    /// More tokens than kvwire accepts.
    #[error("`tokens` is {0}, more than the {max} kvwire accepts", max = super::MAX_TOKENS)]
    TooManyTokens(u64),
    /// A byte count does not fit in 64 bits.
    #[error("byte counts exceed 2^64 (at layer {layer}); the request is too large to describe")]
    Overflow {
        /// Layer where the sum overflowed (the layer count for the totals).
        layer: u32,
    },
}

fn layer_inventory(i: usize, layer: &LayerSpec, geo: &Geometry, tokens: u64) -> Result<LayerInventory, InventoryError> {
    let retained = layer.retention.retained(tokens);
    let blocks = geo.blocks_touched(&layer.retention, tokens);
    // u128: a large request of a large model can pass 2^64 bytes; say so
    // instead of wrapping.
    let (mut per_token, mut allocated, mut fixed) = (0u128, 0u128, 0u128);
    for t in layer.tensors() {
        per_token += u128::from(t.heads) * u128::from(geo.row_bytes(t.dim));
        allocated += u128::from(blocks) * u128::from(geo.block_bytes(t.heads, t.dim));
        fixed += u128::from(geo.format.tensor_static_bytes());
    }
    fixed += u128::from(layer.state_bytes);
    let fit = |v: u128| u64::try_from(v).map_err(|_| InventoryError::Overflow { layer: i as u32 });
    Ok(LayerInventory {
        layer: i as u32,
        kind: layer.kind(),
        retained_tokens: retained,
        blocks,
        payload_bytes: fit(u128::from(retained) * per_token + fixed)?,
        allocated_bytes: fit(allocated + fixed)?,
        per_token_bytes: fit(per_token)?,
    })
}

/// Counts the cache of `model` for a request of `tokens` in `geo`.
pub fn inventory(model: &ModelSpec, geo: &Geometry, tokens: u64) -> Result<Inventory, InventoryError> {
    if tokens == 0 {
        return Err(InventoryError::ZeroTokens);
    }
    if tokens > super::MAX_TOKENS {
        return Err(InventoryError::TooManyTokens(tokens));
    }
    let per_layer = model
        .layers
        .iter()
        .enumerate()
        .map(|(i, l)| layer_inventory(i, l, geo, tokens))
        .collect::<Result<Vec<_>, _>>()?;
    let total = |f: fn(&LayerInventory) -> u64| {
        per_layer
            .iter()
            .try_fold(0u64, |acc, l| acc.checked_add(f(l)))
            .ok_or(InventoryError::Overflow { layer: per_layer.len() as u32 })
    };
    let payload_bytes = total(|l| l.payload_bytes)?;
    let allocated_bytes = total(|l| l.allocated_bytes)?;
    let fixed_bytes = per_layer.iter().map(|l| l.payload_bytes - l.retained_tokens * l.per_token_bytes).sum();
    let uniform = per_layer.iter().all(|l| l.retained_tokens == tokens || l.per_token_bytes == 0);
    let per_token_bytes = if uniform { Some(total(|l| l.per_token_bytes)?) } else { None };

    let mut kinds: Vec<KindRow> = Vec::new();
    for l in &per_layer {
        match kinds
            .iter_mut()
            .find(|k| k.kind == l.kind && k.per_token_bytes == l.per_token_bytes && k.retained_tokens == l.retained_tokens)
        {
            Some(k) => {
                k.layers += 1;
                k.payload_bytes += l.payload_bytes;
                k.allocated_bytes += l.allocated_bytes;
            }
            None => kinds.push(KindRow {
                kind: l.kind,
                layers: 1,
                retained_tokens: l.retained_tokens,
                per_token_bytes: l.per_token_bytes,
                payload_bytes: l.payload_bytes,
                allocated_bytes: l.allocated_bytes,
            }),
        }
    }
    Ok(Inventory {
        model: model.name.clone(),
        format: geo.format.id(),
        tokens,
        block_size: geo.block_size,
        row_align: geo.row_align,
        block_align: geo.block_align,
        payload_bytes,
        allocated_bytes,
        fixed_bytes,
        per_token_bytes,
        wire_bytes: None,
        kinds,
        per_layer,
    })
}
