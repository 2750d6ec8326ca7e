//! Engine tensors: a rank's cache described as the engine holds it.
//!
//! A rank's cache is a list of dense tensors, each in some memory (a memfd,
//! by index in the registration) at some byte offset, with a dtype, a shape
//! and strides **in elements**, a role and the layers it holds. The axes of
//! every tensor come from one *order* that the layout string names with
//! `kv=`: a word of axis letters, outermost first, always ending in `d`:
//!
//! | letter | axis | size |
//! |---|---|---|
//! | `l` | layer (only in cross-layer tensors) | layers the rank holds |
//! | `k` | K or V (K first) | 2 |
//! | `b` | block | the registration's `num_blocks` |
//! | `t` | position inside a block | `block` |
//! | `h` | KV head | heads the rank holds |
//! | `d` | element of a head's row | `head_dim` |
//!
//! Strides are row-major in the order's axes unless the layout pads them:
//! `pad=` lists axes with the elements of padding after each step of them,
//! letter then count, separated by `:` (`pad=b256:t384`). An axis's stride
//! is then the inner axes' extent plus its padding: `pad=b256` is a page
//! padded past its rows, `pad=t…` a view of some heads of a wider tensor.
//! Padding applies to every tensor of the rank (a latent ignores `k` and
//! `l`); the bytes in it are never read or written.
//!
//! Without `k`, K and V are separate tensors (roles `k` and `v`); without
//! `l`, there is one tensor (or one K and one V) per layer. An MLA layer's
//! latent is a tensor of its own (role `latent`) with the order's axes
//! without `k`, its head axis of size 1 and `d` of `kv_lora_rank +
//! qk_rope_head_dim`: vLLM's per-layer MLA cache `(num_blocks, block,
//! kv_lora_rank + rope_dim)` under any preset but the cross-layer one,
//! which refuses MLA. Named presets:
//!
//! | preset | order | engine shape |
//! |---|---|---|
//! | `vllm_nhd` | `kbthd` | vLLM FlashAttention, per layer `(2, num_blocks, block, heads, dim)` |
//! | `vllm_hnd` | `kbhtd` | vLLM FlashAttention HND, per layer `(2, num_blocks, heads, block, dim)` |
//! | `flashinfer` | `bkthd` | FlashInfer NHD, per layer `(num_blocks, 2, block, heads, dim)` |
//! | `flashinfer_hnd` | `bkhtd` | FlashInfer HND, per layer `(num_blocks, 2, heads, block, dim)` |
//! | `vllm_cpu` | `bhtkd` | vLLM CPU, per layer `(num_blocks, heads, block, 2*dim)`: K and V packed in the last dim (role `kv_packed`) |
//! | `vllm_cross` | `blkthd` | vLLM cross-layer, per rank `(num_blocks, layers, 2, block, heads, dim)` |
//! | `contiguous` | — | kvwire's own layout (no `kv=` key): one memfd, regions back to back |
//!
//! `vllm_cpu` reads vLLM's CPU shape as one row of `2*dim` per position.
//! vLLM 0.32's CPU kernel (`cpu_attn`, fp32) fills each (block, head) of
//! that shape differently: K transposed (`dim x block`), then V (`block x
//! dim`). Under this preset only whole blocks between two such caches are
//! exact, which is what `kvwire.vllm` moves.
//!
//! The plan never sees the order: each (layer, K or V) becomes three byte
//! strides (block, position, head) from its first element, inside a region
//! — a window of one tensor registered with the daemon. Where K and V share
//! a tensor, a layer's K and V are one region (named by K), so runs may
//! cross from K into V: when both sides keep a block's K and V side by side
//! (the `k` axis inside `b`), the plan moves them together and a whole
//! FlashInfer or vLLM CPU block is one run. Regions of a cross-layer tensor
//! interleave (layers alternate per block); their bytes never do.

use crate::format::{CacheFormat, Scales};
use crate::layout::{Attention, ModelSpec, Tensor};
use crate::shard::{RankShard, RegionId};
use serde::{Deserialize, Serialize};
use std::ops::Range;

/// One axis of an engine tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Axis {
    /// Layer, in cross-layer tensors.
    Layer,
    /// K (index 0) or V (index 1).
    Kv,
    /// Block (page).
    Block,
    /// Position inside a block.
    Token,
    /// KV head.
    Head,
    /// Element of a row.
    Dim,
}

impl Axis {
    fn letter(self) -> char {
        match self {
            Axis::Layer => 'l',
            Axis::Kv => 'k',
            Axis::Block => 'b',
            Axis::Token => 't',
            Axis::Head => 'h',
            Axis::Dim => 'd',
        }
    }
}

/// Most elements of padding `pad=` takes per axis step (a 1 GiB page of bf16 rows).
pub const MAX_PAD: u64 = 1 << 29;

fn pad_text(pads: impl Iterator<Item = (Axis, u64)>) -> String {
    pads.filter(|p| p.1 != 0).map(|(a, p)| format!("{}{p}", a.letter())).collect::<Vec<_>>().join(":")
}

/// The named presets and their orders.
pub const PRESETS: &[(&str, &str)] = &[
    ("vllm_nhd", "kbthd"),
    ("vllm_hnd", "kbhtd"),
    ("flashinfer", "bkthd"),
    ("flashinfer_hnd", "bkhtd"),
    ("vllm_cpu", "bhtkd"),
    ("vllm_cross", "blkthd"),
];

/// The axis order of a rank's engine tensors (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KvOrder {
    axes: Vec<Axis>,
    /// Elements of padding after each step of each axis, parallel to `axes`.
    pad: Vec<u64>,
}

/// Why an order, or a rank's tensors, were refused. Every variant names what was wrong.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum TensorError {
    /// `kv=` names no preset and is not a valid order word.
    #[error("kv=`{0}`: expected a preset ({presets}) or an order word of the letters l k b t h d, each at most once, with b, t, h present and d last", presets = PRESETS.iter().map(|p| p.0).collect::<Vec<_>>().join(", "))]
    Order(String),
    /// The model or layout cannot be held in engine tensors.
    #[error("kv={order}: {reason}")]
    Unsupported {
        /// The order.
        order: String,
        /// Why.
        reason: String,
    },
    /// `pad=` is malformed or names an axis the order cannot pad.
    #[error("pad=`{text}`: {reason}")]
    Pad {
        /// The value.
        text: String,
        /// What is wrong.
        reason: String,
    },
    /// A tensor the client sent does not match what the layout expects.
    #[error("tensor {index} ({what}): {reason}")]
    Tensor {
        /// Index in the client's list.
        index: usize,
        /// Its role and layers, as the client gave them.
        what: String,
        /// What is wrong.
        reason: String,
    },
    /// The list as a whole is wrong (missing tensors, overlaps).
    #[error("tensors: {0}")]
    List(String),
}

impl KvOrder {
    /// Parses a preset name or an order word.
    pub fn parse(text: &str) -> Result<KvOrder, TensorError> {
        let word = PRESETS.iter().find(|p| p.0 == text).map_or(text, |p| p.1);
        let mut axes = Vec::new();
        for c in word.chars() {
            let a = match c {
                'l' => Axis::Layer,
                'k' => Axis::Kv,
                'b' => Axis::Block,
                't' => Axis::Token,
                'h' => Axis::Head,
                'd' => Axis::Dim,
                _ => return Err(TensorError::Order(text.into())),
            };
            if axes.contains(&a) {
                return Err(TensorError::Order(text.into()));
            }
            axes.push(a);
        }
        let has = |a| axes.contains(&a);
        if axes.last() != Some(&Axis::Dim) || !has(Axis::Block) || !has(Axis::Token) || !has(Axis::Head) {
            return Err(TensorError::Order(text.into()));
        }
        let pad = vec![0; axes.len()];
        Ok(KvOrder { axes, pad })
    }

    /// Sets the padding from a layout's `pad=` value (see the module docs).
    pub fn with_pad(mut self, text: &str) -> Result<KvOrder, TensorError> {
        let bad = |reason: String| TensorError::Pad { text: text.into(), reason };
        self.pad.iter_mut().for_each(|p| *p = 0);
        let mut seen = Vec::new();
        for item in text.split(':').filter(|i| !i.is_empty()) {
            let mut chars = item.chars();
            let letter = chars.next().expect("non-empty");
            let Some(i) = self.axes.iter().position(|a| a.letter() == letter) else {
                return Err(bad(format!("`{letter}` is not an axis of kv={}", self.name())));
            };
            if self.axes[i] == Axis::Dim {
                return Err(bad("`d` cannot be padded: a row's elements are contiguous".into()));
            }
            if seen.contains(&letter) {
                return Err(bad(format!("`{letter}` given twice")));
            }
            seen.push(letter);
            self.pad[i] = chars.as_str().parse::<u64>().ok().filter(|&n| n <= MAX_PAD).ok_or_else(|| bad(format!("`{item}`: expected the axis letter then at most {MAX_PAD} elements")))?;
        }
        Ok(self)
    }

    /// Elements of padding after each step of `axis`.
    pub fn pad_of(&self, axis: Axis) -> u64 {
        self.axes.iter().position(|&a| a == axis).map_or(0, |i| self.pad[i])
    }

    /// The `pad=` value that gives this padding; empty when dense.
    pub fn pad_text(&self) -> String {
        pad_text(self.axes.iter().zip(&self.pad).map(|(&a, &p)| (a, p)))
    }

    /// The preset name, or the order word.
    pub fn name(&self) -> String {
        let word: String = self.axes.iter().map(|a| a.letter()).collect();
        PRESETS.iter().find(|p| p.1 == word).map_or(word, |p| p.0.to_string())
    }

    /// The axes, outermost first.
    pub fn axes(&self) -> &[Axis] {
        &self.axes
    }

    /// True when one tensor holds all the rank's layers.
    pub fn cross_layer(&self) -> bool {
        self.axes.contains(&Axis::Layer)
    }

    /// True when K and V share a tensor.
    pub fn kv_together(&self) -> bool {
        self.axes.contains(&Axis::Kv)
    }

    /// True when K and V share a tensor inside each block (the K/V axis after
    /// the block axis): a block's K and V rows then sit side by side.
    pub fn pairs_kv(&self) -> bool {
        let at = |a| self.axes.iter().position(|&x| x == a);
        matches!((at(Axis::Block), at(Axis::Kv)), (Some(b), Some(k)) if b < k)
    }
}

/// What a tensor holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Keys only.
    K,
    /// Values only.
    V,
    /// K and V along their own axis of size 2.
    Kv,
    /// K and V packed in the last dimension (`2 * head_dim`, K first).
    KvPacked,
    /// An MLA layer's latent (compressed KV and rotary key, one row per
    /// position): the order's axes without `k`, its head axis of size 1
    /// (vLLM's per-layer `(num_blocks, block, kv_lora_rank + rope_dim)`).
    Latent,
}

/// One engine tensor as a client registers it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorDesc {
    /// Which of the registration's memories (file descriptors, in order).
    pub memory: u32,
    /// Byte offset of element 0 in that memory.
    pub offset: u64,
    /// Element type (`bf16`, `fp16`, `fp32`, `fp8_e4m3`, `fp8_e5m2`, or torch's spelling).
    pub dtype: String,
    /// Sizes, outermost first.
    pub shape: Vec<u64>,
    /// Strides in elements, one per dimension.
    pub strides: Vec<u64>,
    /// What it holds.
    pub role: Role,
    /// Half-open layer range `[start, end)` it holds.
    pub layers: [u32; 2],
}

/// A tensor the layout expects a rank to hold: row-major in the order's axes, padded as the layout says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expected {
    /// `Kv` when the order holds K and V together; otherwise `K` or `V`.
    pub role: Role,
    /// Layers it holds.
    pub layers: Range<u32>,
    /// Its axes: the order's, or a latent's (without `k` and `l`).
    pub axes: Vec<Axis>,
    /// Sizes in those axes.
    pub shape: Vec<u64>,
    /// Strides in elements: row-major plus the layout's padding.
    pub strides: Vec<u64>,
    /// Bytes per element.
    pub elem_bytes: u64,
}

impl Expected {
    /// Bytes from its first element to the end of its last (padding past the last is not its).
    pub fn bytes(&self) -> u64 {
        self.bytes_checked().expect("sides check their tensors' sizes")
    }

    /// [`Expected::bytes`], or `None` when that overflows 64 bits.
    pub fn bytes_checked(&self) -> Option<u64> {
        let last = self.shape.iter().zip(&self.strides).try_fold(0u64, |a, (&n, &s)| a.checked_add(n.checked_sub(1)?.checked_mul(s)?))?;
        last.checked_add(1)?.checked_mul(self.elem_bytes)
    }
}

/// Byte strides of one region's block, position and head axes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Strides {
    /// Block to next block.
    pub block: u64,
    /// Position to next position inside a block.
    pub token: u64,
    /// Head to next head.
    pub head: u64,
}

/// Where one (layer, K or V) lives: in which expected tensor, from which byte, how long.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// The layer and tensor.
    pub id: RegionId,
    /// Index into the rank's expected tensors.
    pub tensor: usize,
    /// Byte offset of its first element (block 0, position 0, head 0) in that tensor.
    pub base: u64,
    /// Bytes from `base` to the end of its last row.
    pub len: u64,
    /// Its strides.
    pub strides: Strides,
}

/// A registered region of an engine rank: a window of one tensor. Where K
/// and V share a tensor, a layer's K and V are one window, named by K
/// (`RegionId { layer, tensor: K }`), so runs may cross from K into V.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Window {
    /// The region.
    pub id: RegionId,
    /// Index into the rank's expected tensors.
    pub tensor: usize,
    /// Byte offset of the window in that tensor.
    pub start: u64,
    /// Bytes it spans.
    pub len: u64,
}

/// A rank's engine tensors and where its rows live in them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankTensors {
    /// The tensors the layout expects, in registration order.
    pub tensors: Vec<Expected>,
    /// Every held (layer, K or V), sorted by id.
    pub places: Vec<Placement>,
    /// The registered regions, sorted by id.
    pub windows: Vec<Window>,
}

impl RankTensors {
    /// The placement of (layer, K or V).
    pub fn place(&self, id: RegionId) -> Option<&Placement> {
        self.places.binary_search_by_key(&id, |p| p.id).ok().map(|i| &self.places[i])
    }

    /// The window (layer, K or V) is registered in, and the byte offset of its first element there.
    pub fn window_of(&self, id: RegionId) -> Option<(RegionId, u64)> {
        let p = self.place(id)?;
        let w = self.windows.iter().find(|w| w.tensor == p.tensor && w.id.layer == id.layer)?;
        Some((w.id, p.base - w.start))
    }
}

/// The engine element size of `format`, or why engine tensors cannot hold it.
pub fn elem_bytes(format: CacheFormat) -> Result<u64, String> {
    if format.scales != Scales::None || format.elem_bits % 8 != 0 {
        return Err(format!("format {} stores scales or sub-byte elements inside its rows; engine tensors hold plain elements only", format.id()));
    }
    Ok(u64::from(format.elem_bits / 8))
}

/// The geometry of a rank's held layers: (layers, local heads, dim), refusing what engine tensors cannot hold.
fn rank_geometry(order: &KvOrder, model: &ModelSpec, rank: &RankShard) -> Result<Vec<(u32, u64, u64)>, TensorError> {
    let unsupported = |reason: String| TensorError::Unsupported { order: order.name(), reason };
    let mut out = Vec::new();
    for ls in &rank.layers {
        let spec = &model.layers[ls.layer as usize];
        if spec.state_bytes > 0 {
            return Err(unsupported(format!("layer {} holds {} bytes of constant state; engine tensors hold dense K/V only", ls.layer, spec.state_bytes)));
        }
        match spec.attention {
            Attention::Dense { head_dim, v_head_dim, .. } => {
                if order.kv_together() && head_dim != v_head_dim {
                    return Err(unsupported(format!("layer {}: K rows of {head_dim} and V rows of {v_head_dim} elements cannot share a tensor; use an order without `k`", ls.layer)));
                }
                out.push((ls.layer, u64::from(ls.heads.end - ls.heads.start), u64::from(head_dim)));
            }
            Attention::Mla { kv_lora_rank, qk_rope_head_dim } => {
                if order.cross_layer() {
                    return Err(unsupported(format!("layer {} is an MLA latent; a cross-layer tensor holds dense K/V only (latents take one tensor per layer)", ls.layer)));
                }
                out.push((ls.layer, u64::from(ls.heads.end - ls.heads.start), u64::from(kv_lora_rank + qk_rope_head_dim)));
            }
            Attention::SharedWith { .. } | Attention::None => {}
        }
    }
    if order.cross_layer() {
        if let Some(&(_, h, d)) = out.first() {
            if let Some(&(l, ..)) = out.iter().find(|g| (g.1, g.2) != (h, d)) {
                return Err(unsupported(format!("layer {l} has another head count or dim than the rank's first layer; a cross-layer tensor needs them equal")));
            }
        }
        if out.windows(2).any(|w| w[1].0 != w[0].0 + 1) {
            return Err(unsupported("the rank's layers are not consecutive; a cross-layer tensor needs them to be".into()));
        }
    }
    Ok(out)
}

/// Sizes of the order's axes for a group of `layers` layers.
fn shape_of(order: &KvOrder, layers: u64, num_blocks: u32, block_size: u32, heads: u64, dim: u64) -> Vec<u64> {
    order
        .axes
        .iter()
        .map(|a| match a {
            Axis::Layer => layers,
            Axis::Kv => 2,
            Axis::Block => u64::from(num_blocks),
            Axis::Token => u64::from(block_size),
            Axis::Head => heads,
            Axis::Dim => dim,
        })
        .collect()
}

/// Element strides of `shape` in `axes`: each axis spans the inner ones, plus its padding.
/// Saturates: a side checks its tensors' sizes (`Expected::bytes_checked`).
fn strides_of(order: &KvOrder, axes: &[Axis], shape: &[u64]) -> Vec<u64> {
    let mut strides = vec![1u64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1].saturating_mul(shape[i + 1]).saturating_add(order.pad_of(axes[i]));
    }
    strides
}

/// The byte stride of `axis` in a tensor of `axes` with element `strides`; 0 when it has no such axis.
fn byte_stride(axes: &[Axis], strides: &[u64], elem_bytes: u64, axis: Axis) -> u64 {
    axes.iter().position(|&a| a == axis).map_or(0, |i| strides[i].saturating_mul(elem_bytes))
}

/// A region's block, position and head byte strides in a tensor of `axes` with element `strides`.
fn region_strides(axes: &[Axis], strides: &[u64], elem_bytes: u64) -> Strides {
    let at = |axis| byte_stride(axes, strides, elem_bytes, axis);
    Strides { block: at(Axis::Block), token: at(Axis::Token), head: at(Axis::Head) }
}

/// The tensors a rank holds under `order`, where each of its rows lives in them, and its regions.
pub fn rank_tensors(
    order: &KvOrder,
    model: &ModelSpec,
    rank: &RankShard,
    format: CacheFormat,
    num_blocks: u32,
    block_size: u32,
) -> Result<RankTensors, TensorError> {
    let es = elem_bytes(format).map_err(|reason| TensorError::Unsupported { order: order.name(), reason })?;
    if num_blocks == 0 || block_size == 0 {
        return Err(TensorError::Unsupported { order: order.name(), reason: "num_blocks and block must be > 0".into() });
    }
    let geo = rank_geometry(order, model, rank)?;
    // Groups of layers sharing a tensor: all of them, or one each.
    let groups: Vec<Vec<(u32, u64, u64)>> = if order.cross_layer() { vec![geo].into_iter().filter(|g| !g.is_empty()).collect() } else { geo.into_iter().map(|g| vec![g]).collect() };
    let mut tensors = Vec::new();
    let mut places = Vec::new();
    for group in groups {
        let (first, heads, dim) = group[0];
        // Bytes from a region's first element to the end of its last row; saturates like the strides.
        let span = |s: Strides, dim: u64| {
            [(u64::from(num_blocks) - 1, s.block), (u64::from(block_size) - 1, s.token), (heads.saturating_sub(1), s.head), (dim, es)].iter().fold(0u64, |a, &(n, st)| a.saturating_add(n.saturating_mul(st)))
        };
        let layers = first..first + group.len() as u32;
        if let Attention::Mla { .. } = model.layers[first as usize].attention {
            // A latent is one row per position: the order's axes without
            // K/V (and never cross-layer, refused above).
            let axes: Vec<Axis> = order.axes.iter().copied().filter(|&a| a != Axis::Kv && a != Axis::Layer).collect();
            let shape: Vec<u64> = axes
                .iter()
                .map(|a| match a {
                    Axis::Block => u64::from(num_blocks),
                    Axis::Token => u64::from(block_size),
                    Axis::Head => heads,
                    _ => dim,
                })
                .collect();
            let strides = strides_of(order, &axes, &shape);
            let s = region_strides(&axes, &strides, es);
            let len = span(s, dim);
            places.push(Placement { id: RegionId { layer: first, tensor: Tensor::Latent }, tensor: tensors.len(), base: 0, len, strides: s });
            tensors.push(Expected { role: Role::Latent, layers, axes, shape, strides, elem_bytes: es });
            continue;
        }
        let shape = shape_of(order, group.len() as u64, num_blocks, block_size, heads, dim);
        let strides = strides_of(order, &order.axes, &shape);
        let s = region_strides(&order.axes, &strides, es);
        let len = span(s, dim);
        let roles: &[(Role, Tensor)] = if order.kv_together() { &[(Role::Kv, Tensor::K)] } else { &[(Role::K, Tensor::K), (Role::V, Tensor::V)] };
        for &(role, _) in roles {
            // Without `k`, K and V have their own tensors; V's dim may differ.
            let (shape, strides, len, s) = if role == Role::V {
                let vdim = match model.layers[first as usize].attention {
                    Attention::Dense { v_head_dim, .. } => u64::from(v_head_dim),
                    _ => dim,
                };
                let shape = shape_of(order, group.len() as u64, num_blocks, block_size, heads, vdim);
                let strides = strides_of(order, &order.axes, &shape);
                let s = region_strides(&order.axes, &strides, es);
                (shape, strides, span(s, vdim), s)
            } else {
                (shape.clone(), strides.clone(), len, s)
            };
            let index = tensors.len();
            for (i, &(layer, ..)) in group.iter().enumerate() {
                let l_off = byte_stride(&order.axes, &strides, es, Axis::Layer).saturating_mul(i as u64);
                let kinds: &[(Tensor, u64)] = match role {
                    Role::Kv | Role::KvPacked => &[(Tensor::K, 0), (Tensor::V, 1)],
                    Role::K => &[(Tensor::K, 0)],
                    Role::V => &[(Tensor::V, 0)],
                    Role::Latent => &[(Tensor::Latent, 0)],
                };
                for &(tensor, kv) in kinds {
                    let base = l_off.saturating_add(kv * byte_stride(&order.axes, &strides, es, Axis::Kv));
                    places.push(Placement { id: RegionId { layer, tensor }, tensor: index, base, len, strides: s });
                }
            }
            tensors.push(Expected { role, layers: layers.clone(), axes: order.axes.clone(), shape, strides, elem_bytes: es });
        }
    }
    places.sort_by_key(|p| p.id);
    // One window per layer and tensor: K and V of a shared tensor together.
    let mut windows: Vec<Window> = Vec::new();
    for p in &places {
        match windows.iter_mut().find(|w| w.tensor == p.tensor && w.id.layer == p.id.layer) {
            Some(w) => {
                let end = (w.start + w.len).max(p.base.saturating_add(p.len));
                w.start = w.start.min(p.base);
                w.len = end - w.start;
            }
            None => windows.push(Window { id: p.id, tensor: p.tensor, start: p.base, len: p.len }),
        }
    }
    windows.sort_by_key(|w| w.id);
    Ok(RankTensors { tensors, places, windows })
}

fn what(t: &TensorDesc) -> String {
    let role = match t.role {
        Role::K => "k",
        Role::V => "v",
        Role::Kv => "kv",
        Role::KvPacked => "kv_packed",
        Role::Latent => "latent",
    };
    format!("{role} of layers [{}, {})", t.layers[0], t.layers[1])
}

/// A client's tensor with a packed last dimension seen as an order's `k` and `d` axes.
fn normalized(t: &TensorDesc) -> Option<(Vec<u64>, Vec<u64>)> {
    if t.role != Role::KvPacked {
        return Some((t.shape.clone(), t.strides.clone()));
    }
    let (&last, &ls) = (t.shape.last()?, t.strides.last()?);
    if last % 2 != 0 || ls != 1 {
        return None;
    }
    let n = t.shape.len();
    let mut shape = t.shape[..n - 1].to_vec();
    let mut strides = t.strides[..n - 1].to_vec();
    shape.extend([2, last / 2]);
    strides.extend([last / 2, 1]);
    Some((shape, strides))
}

/// (size, stride) of each dimension in memory order, outermost first, without
/// size-1 dimensions (their stride means nothing).
fn physical(shape: &[u64], strides: &[u64]) -> Vec<(u64, u64)> {
    let mut dims: Vec<(u64, u64)> = shape.iter().copied().zip(strides.iter().copied()).filter(|d| d.0 != 1).collect();
    dims.sort_by_key(|d| std::cmp::Reverse(d.1));
    dims
}

/// The `pad=` value under which `e`'s strides would be `given`'s (both in
/// memory order, as [`physical`] gives them), if any would: rows
/// contiguous, and every axis at least as far apart as the inner ones span.
/// The padding of an axis of size 1 folds into the next one out.
fn implied_pad(e: &Expected, given: &[(u64, u64)]) -> Option<String> {
    let axes: Vec<Axis> = e.axes.iter().zip(&e.shape).filter(|d| *d.1 != 1).map(|d| *d.0).collect();
    if axes.len() != given.len() || given.last().is_some_and(|d| d.1 != 1) {
        return None;
    }
    let mut pads = Vec::new();
    for (i, w) in given.windows(2).enumerate() {
        pads.push((axes[i], w[0].1.checked_sub(w[1].0.checked_mul(w[1].1)?)?));
    }
    Some(pad_text(pads.into_iter()))
}

/// Checks a client's tensors against what the layout expects of the rank,
/// and returns, for each expected tensor, the (memory, byte offset) the
/// client gave it. `memories` holds each memory's size in bytes.
pub fn match_tensors(given: &[TensorDesc], expected: &[Expected], format: CacheFormat, memories: &[u64]) -> Result<Vec<(u32, u64)>, TensorError> {
    let mut at: Vec<Option<(u32, u64)>> = vec![None; expected.len()];
    for (index, t) in given.iter().enumerate() {
        let bad = |reason: String| TensorError::Tensor { index, what: what(t), reason };
        let dtype = CacheFormat::parse(&t.dtype).map_err(|e| bad(format!("dtype: {e}")))?;
        if dtype.name != format.name || dtype.elem_bits != format.elem_bits {
            return Err(bad(format!("dtype {} ({} bits) but the cache format is {} ({} bits)", t.dtype, dtype.elem_bits, format.id(), format.elem_bits)));
        }
        if t.shape.len() != t.strides.len() {
            return Err(bad(format!("{} sizes but {} strides", t.shape.len(), t.strides.len())));
        }
        let want_role = |r: Role| if r == Role::KvPacked { Role::Kv } else { r };
        let Some(slot) = expected.iter().position(|e| e.role == want_role(t.role) && e.layers.start == t.layers[0] && e.layers.end == t.layers[1]) else {
            let list: Vec<String> = expected.iter().map(|e| format!("{:?} [{}, {})", e.role, e.layers.start, e.layers.end).to_lowercase()).collect();
            return Err(bad(format!("the layout expects no such tensor of this rank (it expects: {})", list.join(", "))));
        };
        if at[slot].is_some() {
            return Err(bad("given twice".into()));
        }
        let e = &expected[slot];
        let (shape, strides) = normalized(t).ok_or_else(|| bad("kv_packed needs an even last dimension of stride 1".into()))?;
        // Compared as laid out in memory: a permuted view (vLLM's HND is a
        // stride-permuted NHD shape) is the same bytes as the order's tensor.
        let (given, want) = (physical(&shape, &strides), physical(&e.shape, &e.strides));
        if given.iter().map(|d| d.0).collect::<Vec<_>>() != want.iter().map(|d| d.0).collect::<Vec<_>>() {
            return Err(bad(format!("shape {:?} (strides {:?}) but the layout expects {:?} (strides {:?})", t.shape, t.strides, e.shape, e.strides)));
        }
        if given != want {
            let hint = implied_pad(e, &given).map_or(String::new(), |p| if p.is_empty() { "; they are dense: drop `pad=` from the layout".into() } else { format!("; they are the order's with padding: give the layout `pad={p}`") });
            return Err(bad(format!("strides {:?} (elements) but the layout expects {:?} for shape {:?}{hint}", t.strides, e.strides, e.shape)));
        }
        let Some(&size) = memories.get(t.memory as usize) else {
            return Err(bad(format!("memory {} but the registration carries {} file descriptors", t.memory, memories.len())));
        };
        let end = t.offset.checked_add(e.bytes());
        if end.is_none_or(|end| end > size) {
            return Err(bad(format!("bytes [{}, {}) are past memory {}'s {size} bytes", t.offset, t.offset.saturating_add(e.bytes()), t.memory)));
        }
        if t.offset % e.elem_bytes != 0 {
            return Err(bad(format!("offset {} is not a multiple of the {}-byte element", t.offset, e.elem_bytes)));
        }
        at[slot] = Some((t.memory, t.offset));
    }
    if let Some(i) = at.iter().position(Option::is_none) {
        let e = &expected[i];
        return Err(TensorError::List(format!("missing the {:?} tensor of layers [{}, {})", e.role, e.layers.start, e.layers.end).to_lowercase()));
    }
    let at: Vec<(u32, u64)> = at.into_iter().map(|a| a.expect("checked")).collect();
    // Dense tensors occupy one interval each: no two may share a byte.
    let mut spans: Vec<(u32, u64, u64, usize)> = at.iter().enumerate().map(|(i, &(m, o))| (m, o, o + expected[i].bytes(), i)).collect();
    spans.sort();
    for w in spans.windows(2) {
        if w[0].0 == w[1].0 && w[1].1 < w[0].2 {
            let name = |i: usize| format!("{:?} of layers [{}, {})", expected[i].role, expected[i].layers.start, expected[i].layers.end).to_lowercase();
            return Err(TensorError::List(format!("the {} and {} tensors overlap in memory {} (bytes {}..{})", name(w[0].3), name(w[1].3), w[0].0, w[1].1, w[0].2)));
        }
    }
    Ok(at)
}

/// The default placement of a rank's expected tensors: back to back in one memory.
pub fn packed_offsets(expected: &[Expected]) -> Vec<(u32, u64)> {
    let mut off = 0;
    expected
        .iter()
        .map(|e| {
            let at = (0, off);
            off += e.bytes();
            at
        })
        .collect()
}

/// Index of an element given its coordinate on each of `axes` (the order's,
/// or a latent's subset), row-major with `order`'s padding. Written apart
/// from [`rank_tensors`]' strides, for oracles: from the innermost axis out,
/// each step of an axis skips the inner ones' extent and its own padding.
pub fn element_index(order: &KvOrder, axes: &[Axis], shape: &[u64], coord: impl Fn(Axis) -> u64) -> u64 {
    let (mut idx, mut step) = (0, 1);
    for (i, (&a, &n)) in axes.iter().zip(shape).enumerate().rev() {
        idx += coord(a) * step;
        if i > 0 {
            step = step * n + order.pad_of(axes[i - 1]);
        }
    }
    idx
}
