//! Integrity manifests: what a transfer claims to carry, checked by the
//! destination before any `layer_ready` flag is published.
//!
//! Byte counts alone can describe the wrong model revision, adapter, tenant
//! or rotary positions, so every transfer carries a [`Manifest`]: the cache
//! identity (model and adapter digests, cache format, tenant), the per-layer
//! shapes, both shard maps, the token positions with their RoPE parameters,
//! and checksums of every byte the plan moves. The destination compares it
//! with what it registered ([`Manifest::check`] against an [`Expected`]) and
//! with checksums it recomputes over the bytes placed
//! ([`checksums_at_destination`], [`Manifest::verify_checksums`]).
//!
//! # Checksum definition
//!
//! `checksum_algo` is `"xxh3-64"`: XXH3 64-bit, seed 0, default secret
//! (`twox_hash::XxHash3_64::oneshot`). What each (destination rank, layer,
//! tensor) that the plan writes to receives is one stream: the
//! concatenation of every run of every segment whose destination is that
//! region, taken in plan order (segments in [`Plan::segments`] order, runs
//! in [`Segment::runs`](crate::plan::Segment::runs) order), each run being
//! `len` bytes. The stream is cut into chunks at segment boundaries: a
//! segment whose first byte is at stream offset `o` belongs to chunk
//! `o / `[`CHECKSUM_CHUNK`]. There is one [`LayerChecksum`] per chunk, the
//! XXH3-64 of its segments' bytes, listed in increasing (dst rank, layer,
//! tensor, chunk) order, with tensors ordered `k < v < latent < state`.
//! Chunk numbers skip where a segment is longer than a chunk. Chunks are
//! what lets one region be hashed on several cores at once (a layer that
//! is one region, FlashInfer's K and V in one tensor, was one stream).
//!
//! Each run is read:
//!
//! - the sender reads run `i` from the **source** region at
//!   `src_offset + i × src_stride`;
//! - the receiver reads it from the **destination** region, after
//!   placement, at `dst_offset + i × dst_stride`.
//!
//! A correct transfer copies exactly those bytes, so the two agree; `bytes`
//! is the length of the concatenation. Bytes the plan does not move
//! (padding, spare blocks, a reused prefix) are not covered.
//!
//! Cost, measured once (release build, one core of a 2-core EPYC VM; the
//! AVX2 path, which `twox-hash` picks at run time): 40–46 GB/s over cached
//! bytes, twice its SSE2 path and about a cached `memcpy`; 15–19 GB/s from
//! memory. Fed one 128-byte row at a time it manages about 9 GB/s, so row
//! runs are gathered into large pieces before hashing ([`checksums_of`]).
//! A receiver that cannot afford it may skip [`Manifest::verify_checksums`];
//! [`Manifest::check`] is cheap.
//!
//! The manifest is plain data (serde). Its file form is JSON
//! ([`Manifest::to_json`], [`Manifest::from_json`], at most
//! [`MAX_MANIFEST_JSON`] bytes); between daemons it travels in a compact
//! binary form ([`Manifest::to_wire`], [`Manifest::from_wire`]): the same
//! fields in declaration order (postcard). For a small transfer's manifest
//! that is 292 bytes against 1810 of JSON, and a quarter of the parse
//! (1.1 against 4.8 µs, measured hot), on every transfer's path.

use crate::format::CacheFormat;
use crate::layout::{Attention, ModelSpec, Tensor};
use crate::plan::{Buffers, Plan, Side};
use crate::reuse::CacheIdentity;
use crate::shard::{RegionId, ShardMap};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use std::hash::Hasher as _;
use twox_hash::XxHash3_64;

/// Version of the manifest format this crate writes and accepts.
/// 2: a checksum per chunk of a region's stream ([`LayerChecksum::chunk`]).
pub const MANIFEST_VERSION: u32 = 2;

/// Bytes of a region's stream per checksum chunk (module docs): parts of
/// a layer hashed side by side are whole chunks, and each is at least
/// this large so that a thread's start is small against it.
pub const CHECKSUM_CHUNK: u64 = 1 << 20;

/// The chunk of its region's stream a segment starting at stream offset
/// `at` belongs to (module docs): where hashing and splitting agree.
fn chunk_at(at: u64) -> u64 {
    at / CHECKSUM_CHUNK
}

/// The one checksum algorithm this version uses (see the module docs).
pub const CHECKSUM_ALGO: &str = "xxh3-64";
/// Largest manifest JSON [`Manifest::from_json`] accepts (16 MiB).
pub const MAX_MANIFEST_JSON: usize = 16 << 20;

/// Everything a transfer claims about the cache it carries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Manifest format version ([`MANIFEST_VERSION`]).
    pub version: u32,
    /// The request (transfer) id this manifest belongs to.
    pub transfer: String,
    /// Digest of the model weights/revision the cache was computed with.
    pub model_digest: String,
    /// Digest of the adapter (empty for none).
    pub adapter_digest: String,
    /// Cache format id, `name/vN` (e.g. `fp32/v1`), of every moved row.
    pub format: String,
    /// Access scope the cache belongs to.
    pub tenant: String,
    /// Every layer of the model, in order, with what it stores for this request.
    pub layers: Vec<LayerShape>,
    /// Who holds what at the source.
    pub src_map: MapSummary,
    /// Who holds what at the destination.
    pub dst_map: MapSummary,
    /// Tokens in the request.
    pub tokens: u64,
    /// Leading positions the destination already holds and are not moved.
    pub prefix_tokens: u64,
    /// Absolute token positions and rotary parameters.
    pub positions: Positions,
    /// Checksum algorithm: [`CHECKSUM_ALGO`].
    pub checksum_algo: String,
    /// One checksum per chunk of each (dst rank, layer, tensor) written, in that order (module docs).
    pub checksums: Vec<LayerChecksum>,
}

/// What one layer stores for the request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerShape {
    /// Layer index.
    pub layer: u32,
    /// Kind name ([`crate::layout::LayerSpec::kind`]: `full`, `sliding`, `mla`, …).
    pub kind: String,
    /// Per-token tensors (none for shared or cache-less layers).
    pub tensors: Vec<TensorDims>,
    /// Retained positions at `tokens`, as half-open `[start, end)` ranges.
    pub retained: Vec<[u64; 2]>,
    /// Constant per-layer state in bytes (0 for none).
    pub state_bytes: u64,
}

/// Shape of one per-token tensor of a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorDims {
    /// Which tensor (`k`, `v`, `latent`).
    #[serde(with = "tensor_name")]
    pub tensor: Tensor,
    /// Rows per token (KV heads; 1 for an MLA latent).
    pub heads: u32,
    /// Elements per row.
    pub dim: u32,
}

/// A shard map, summarized: per rank, maximal runs of consecutive layers
/// holding the same heads (the shape of an explicit map).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MapSummary {
    /// TP degree (1 for explicit maps).
    pub tp: u32,
    /// Layers per PP stage.
    pub pp_layers: Vec<u32>,
    /// Every rank, indexed by rank number.
    pub ranks: Vec<RankSummary>,
}

/// What one rank holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RankSummary {
    /// Rank number.
    pub rank: u32,
    /// Runs of layers, in increasing layer order.
    pub held: Vec<HeldRun>,
}

/// `heads` of every layer in `layers`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeldRun {
    /// Half-open layer range `[start, end)`.
    pub layers: [u32; 2],
    /// Half-open KV head range `[start, end)` (`[0, 1)` for MLA, `[0, 0)` for no per-token cache).
    pub heads: [u32; 2],
}

/// Token positions of the request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Positions {
    /// Absolute position of the first position this transfer moves:
    /// `rope.position_offset + prefix_tokens`.
    pub first_position: u64,
    /// Rotary parameters the keys were rotated with.
    pub rope: RopeParams,
}

/// Rotary embedding parameters, compared exactly as text.
///
/// Canonical text (what [`CacheIdentity::rope`] holds): `theta=<theta>`,
/// optionally followed by `;scaling=<scaling>` (everything after
/// `scaling=`); no scaling means `none`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RopeParams {
    /// Base frequency, as the shortest decimal that reads back to the same
    /// f64 (Rust's `f64` display: `500000`, `10000.5`).
    pub theta: String,
    /// Scaling rule and its parameters, e.g. `none` or
    /// `llama3(factor=8,low_freq_factor=1,high_freq_factor=4,original_max_position_embeddings=8192)`.
    pub scaling: String,
    /// Absolute position of token 0 of the request.
    pub position_offset: u64,
}

/// Checksum of what one destination region receives (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerChecksum {
    /// Destination rank.
    pub dst_rank: u32,
    /// Layer.
    pub layer: u32,
    /// Tensor (`k`, `v`, `latent`, `state`).
    #[serde(with = "tensor_name")]
    pub tensor: Tensor,
    /// Chunk of the region's stream (module docs).
    pub chunk: u32,
    /// Bytes covered.
    pub bytes: u64,
    /// XXH3-64 (seed 0) of those bytes.
    pub xxh3: u64,
}

impl LayerChecksum {
    /// What it is a checksum of, in list order.
    pub fn key(&self) -> (u32, u32, Tensor, u32) {
        (self.dst_rank, self.layer, self.tensor, self.chunk)
    }
}

/// What the destination registered for a request: a manifest must agree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expected {
    /// Request id.
    pub transfer: String,
    /// Model digest.
    pub model_digest: String,
    /// Adapter digest (empty for none).
    pub adapter_digest: String,
    /// Cache format id (`name/vN`).
    pub format: String,
    /// Tenant.
    pub tenant: String,
    /// Rotary parameters and position offset.
    pub rope: RopeParams,
    /// Tokens in the request.
    pub tokens: u64,
    /// Leading positions the destination keeps.
    pub prefix_tokens: u64,
    /// The destination's shard map.
    pub dst_map: MapSummary,
    /// The model's layer shapes at `tokens`.
    pub layers: Vec<LayerShape>,
}

/// Why a manifest was refused or could not be built; each variant names the field.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum ManifestError {
    /// A manifest version this crate does not speak.
    #[error("unsupported manifest version {got} (this side speaks {MANIFEST_VERSION})")]
    Version {
        /// Version found.
        got: u32,
    },
    /// A checksum algorithm other than [`CHECKSUM_ALGO`].
    #[error("unsupported checksum algorithm: expected {CHECKSUM_ALGO}, got {got}")]
    ChecksumAlgo {
        /// Algorithm named.
        got: String,
    },
    /// The manifest belongs to another request.
    #[error("transfer id mismatch: expected {expected}, got {got}")]
    Transfer {
        /// Registered.
        expected: String,
        /// In the manifest.
        got: String,
    },
    /// Different model.
    #[error("model digest mismatch: expected {expected}, got {got}")]
    ModelDigest {
        /// Registered.
        expected: String,
        /// In the manifest.
        got: String,
    },
    /// Different adapter.
    #[error("adapter digest mismatch: expected {expected}, got {got}")]
    AdapterDigest {
        /// Registered.
        expected: String,
        /// In the manifest.
        got: String,
    },
    /// Different cache format (also: an identity whose format is not the plan's).
    #[error("cache format mismatch: expected {expected}, got {got}")]
    Format {
        /// Registered (or the plan's).
        expected: String,
        /// In the manifest (or the identity's).
        got: String,
    },
    /// Different tenant.
    #[error("tenant mismatch: expected {expected}, got {got}")]
    Tenant {
        /// Registered.
        expected: String,
        /// In the manifest.
        got: String,
    },
    /// Different RoPE base frequency.
    #[error("rope theta mismatch: expected {expected}, got {got}")]
    RopeTheta {
        /// Registered.
        expected: String,
        /// In the manifest.
        got: String,
    },
    /// Different RoPE scaling.
    #[error("rope scaling mismatch: expected {expected}, got {got}")]
    RopeScaling {
        /// Registered.
        expected: String,
        /// In the manifest.
        got: String,
    },
    /// Keys rotated at other absolute positions.
    #[error("rope position offset mismatch: expected {expected}, got {got}")]
    RopePositionOffset {
        /// Registered.
        expected: u64,
        /// In the manifest.
        got: u64,
    },
    /// A RoPE canonical text that does not parse.
    #[error("rope parameters `{text}`: {reason}")]
    RopeText {
        /// The text.
        text: String,
        /// What is wrong.
        reason: String,
    },
    /// Different request length.
    #[error("tokens mismatch: expected {expected}, got {got}")]
    Tokens {
        /// Registered.
        expected: u64,
        /// In the manifest.
        got: u64,
    },
    /// Different reused prefix.
    #[error("prefix tokens mismatch: expected {expected}, got {got}")]
    PrefixTokens {
        /// Registered.
        expected: u64,
        /// In the manifest.
        got: u64,
    },
    /// `first_position` is not `position_offset + prefix_tokens`.
    #[error("first position mismatch: expected {expected}, got {got}")]
    FirstPosition {
        /// Registered offset + prefix.
        expected: u64,
        /// In the manifest.
        got: u64,
    },
    /// Per-layer shapes differ.
    #[error("layer shape mismatch: {detail}")]
    LayerShape {
        /// The first difference.
        detail: String,
    },
    /// The destination shard map differs.
    #[error("shard map mismatch: {detail}")]
    ShardMap {
        /// The first difference.
        detail: String,
    },
    /// Recomputed bytes differ from what the sender hashed.
    #[error("checksum mismatch: dst rank {dst_rank} layer {layer} tensor {} chunk {chunk}: expected {expected:#018x}, got {got:#018x}", tensor_name::of(*.tensor))]
    Checksum {
        /// Destination rank.
        dst_rank: u32,
        /// Layer.
        layer: u32,
        /// Tensor.
        tensor: Tensor,
        /// Chunk of the region's stream.
        chunk: u32,
        /// In the manifest (sender).
        expected: u64,
        /// Recomputed (receiver).
        got: u64,
    },
    /// The checksum covers another number of bytes.
    #[error("checksum byte count mismatch: dst rank {dst_rank} layer {layer} tensor {} chunk {chunk}: expected {expected} bytes, got {got}", tensor_name::of(*.tensor))]
    ChecksumBytes {
        /// Destination rank.
        dst_rank: u32,
        /// Layer.
        layer: u32,
        /// Tensor.
        tensor: Tensor,
        /// Chunk of the region's stream.
        chunk: u32,
        /// In the manifest.
        expected: u64,
        /// Recomputed.
        got: u64,
    },
    /// The manifest has a checksum the receiver did not recompute.
    #[error("checksum missing: dst rank {dst_rank} layer {layer} tensor {} chunk {chunk} is in the manifest but was not recomputed", tensor_name::of(*.tensor))]
    ChecksumNotRecomputed {
        /// Destination rank.
        dst_rank: u32,
        /// Layer.
        layer: u32,
        /// Tensor.
        tensor: Tensor,
        /// Chunk of the region's stream.
        chunk: u32,
    },
    /// The receiver recomputed a checksum the manifest does not have.
    #[error("checksum missing: dst rank {dst_rank} layer {layer} tensor {} chunk {chunk} was recomputed but is not in the manifest", tensor_name::of(*.tensor))]
    ChecksumNotInManifest {
        /// Destination rank.
        dst_rank: u32,
        /// Layer.
        layer: u32,
        /// Tensor.
        tensor: Tensor,
        /// Chunk of the region's stream.
        chunk: u32,
    },
    /// A checksum names a (rank, layer, tensor) the destination does not hold, or repeats one.
    #[error("checksum list: {detail}")]
    ChecksumList {
        /// What is wrong.
        detail: String,
    },
    /// The reader had no bytes for a run.
    #[error("cannot read {side} rank {rank} layer {layer} tensor {} bytes [{offset}, {offset} + {len})", tensor_name::of(*.tensor))]
    Unreadable {
        /// `source` or `destination`.
        side: &'static str,
        /// Rank.
        rank: u32,
        /// Layer.
        layer: u32,
        /// Tensor.
        tensor: Tensor,
        /// First byte.
        offset: u64,
        /// Bytes asked for.
        len: u64,
    },
    /// A segment index past the plan's end.
    #[error("segment {index} of a plan of {segments}")]
    NoSegment {
        /// Index asked for.
        index: usize,
        /// Segments in the plan.
        segments: usize,
    },
    /// A manifest, JSON or binary, longer than [`MAX_MANIFEST_JSON`].
    #[error("manifest {form} of {len} bytes exceeds the limit of {limit}")]
    TooLarge {
        /// `JSON` or `binary form`: what was offered.
        form: &'static str,
        /// Bytes offered.
        len: usize,
        /// Limit.
        limit: usize,
    },
    /// A binary manifest that does not decode.
    #[error("malformed binary manifest: {reason}")]
    Wire {
        /// Decoder message.
        reason: String,
    },
    /// Manifest JSON that does not parse or has unknown fields.
    #[error("malformed manifest JSON: {reason}")]
    Json {
        /// Parser message.
        reason: String,
    },
}

/// Serde for [`Tensor`] as its lower-case name.
mod tensor_name {
    use crate::layout::Tensor;
    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn of(t: Tensor) -> &'static str {
        match t {
            Tensor::K => "k",
            Tensor::V => "v",
            Tensor::Latent => "latent",
            Tensor::State => "state",
        }
    }

    pub(super) fn serialize<S: Serializer>(t: &Tensor, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(of(*t))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Tensor, D::Error> {
        let name = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        [Tensor::K, Tensor::V, Tensor::Latent, Tensor::State]
            .into_iter()
            .find(|&t| of(t) == name)
            .ok_or_else(|| serde::de::Error::unknown_variant(&name, &["k", "v", "latent", "state"]))
    }
}

impl RopeParams {
    /// Parameters from a theta, a scaling text (`""` = `none`) and a position offset.
    pub fn new(theta: f64, scaling: &str, position_offset: u64) -> RopeParams {
        let scaling = if scaling.is_empty() { "none" } else { scaling };
        RopeParams { theta: format!("{theta}"), scaling: scaling.to_string(), position_offset }
    }

    /// Parses the canonical text `theta=<f64>[;scaling=<text>]` (see the type docs).
    pub fn parse(text: &str, position_offset: u64) -> Result<RopeParams, ManifestError> {
        let bad = |reason: &str| ManifestError::RopeText { text: text.to_string(), reason: reason.to_string() };
        let rest = text.trim().strip_prefix("theta=").ok_or_else(|| bad("expected `theta=<number>[;scaling=<text>]`"))?;
        let (theta, scaling) = match rest.split_once(';') {
            None => (rest, ""),
            Some((t, s)) => (t, s.trim().strip_prefix("scaling=").ok_or_else(|| bad("expected `;scaling=` after theta"))?),
        };
        let theta: f64 = theta.trim().parse().map_err(|_| bad("theta is not a number"))?;
        if !(theta.is_finite() && theta > 0.0) {
            return Err(bad("theta must be a positive finite number"));
        }
        Ok(RopeParams::new(theta, scaling.trim(), position_offset))
    }

    /// The request's parameters: `identity.rope` parsed, `identity.position_offset`.
    pub fn from_identity(identity: &CacheIdentity) -> Result<RopeParams, ManifestError> {
        RopeParams::parse(&identity.rope, identity.position_offset)
    }

    /// The canonical text (`theta=…`, then `;scaling=…` unless `none`).
    pub fn canonical(&self) -> String {
        if self.scaling == "none" {
            format!("theta={}", self.theta)
        } else {
            format!("theta={};scaling={}", self.theta, self.scaling)
        }
    }
}

impl MapSummary {
    /// Summarizes a resolved shard map.
    pub fn of(map: &ShardMap) -> MapSummary {
        let ranks = map
            .ranks
            .iter()
            .map(|r| {
                let mut held: Vec<HeldRun> = Vec::new();
                for ls in &r.layers {
                    let heads = [ls.heads.start, ls.heads.end];
                    match held.last_mut() {
                        Some(run) if run.layers[1] == ls.layer && run.heads == heads => run.layers[1] += 1,
                        _ => held.push(HeldRun { layers: [ls.layer, ls.layer + 1], heads }),
                    }
                }
                RankSummary { rank: r.rank, held }
            })
            .collect();
        MapSummary { tp: map.tp, pp_layers: map.pp_layers.clone(), ranks }
    }

    /// The heads `rank` holds of `layer`, if it holds the layer.
    fn heads_of(&self, rank: u32, layer: u32) -> Option<[u32; 2]> {
        let r = self.ranks.get(rank as usize)?;
        r.held.iter().find(|h| (h.layers[0]..h.layers[1]).contains(&layer)).map(|h| h.heads)
    }

    /// The first difference from `expected`, described; `None` when equal.
    fn diff(&self, expected: &MapSummary) -> Option<String> {
        if self.tp != expected.tp {
            return Some(format!("tp: expected {}, got {}", expected.tp, self.tp));
        }
        if self.pp_layers != expected.pp_layers {
            return Some(format!("pp_layers: expected {:?}, got {:?}", expected.pp_layers, self.pp_layers));
        }
        if self.ranks.len() != expected.ranks.len() {
            return Some(format!("expected {} ranks, got {}", expected.ranks.len(), self.ranks.len()));
        }
        for (got, want) in self.ranks.iter().zip(&expected.ranks) {
            if got != want {
                return Some(format!("rank {}: expected {}, got {}", want.rank, want, got));
            }
        }
        None
    }
}

impl fmt::Display for RankSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {} holds ", self.rank)?;
        if self.held.is_empty() {
            return write!(f, "nothing");
        }
        for (i, h) in self.held.iter().enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            write!(f, "{sep}layers [{}, {}) heads [{}, {})", h.layers[0], h.layers[1], h.heads[0], h.heads[1])?;
        }
        Ok(())
    }
}

impl fmt::Display for LayerShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.kind)?;
        for t in &self.tensors {
            write!(f, " {} {}x{}", tensor_name::of(t.tensor), t.heads, t.dim)?;
        }
        write!(f, " retained")?;
        for r in &self.retained {
            write!(f, " [{}, {})", r[0], r[1])?;
        }
        if self.state_bytes > 0 {
            write!(f, " state {} bytes", self.state_bytes)?;
        }
        Ok(())
    }
}

/// Every layer's shape for a request of `tokens`.
pub fn layer_shapes(model: &ModelSpec, tokens: u64) -> Vec<LayerShape> {
    model
        .layers
        .iter()
        .enumerate()
        .map(|(i, spec)| LayerShape {
            layer: i as u32,
            kind: spec.kind().to_string(),
            tensors: spec.tensors().iter().map(|t| TensorDims { tensor: t.tensor, heads: t.heads, dim: t.dim }).collect(),
            retained: match spec.attention {
                Attention::Dense { .. } | Attention::Mla { .. } => {
                    spec.retention.ranges(tokens).into_iter().map(|r| [r.start, r.end]).collect()
                }
                Attention::SharedWith { .. } | Attention::None => vec![],
            },
            state_bytes: spec.state_bytes,
        })
        .collect()
}

/// The plan's format id, after checking the identity names the same format.
fn format_of(identity: &CacheIdentity, side: &Side) -> Result<String, ManifestError> {
    let id = side.geo.format.id();
    if CacheFormat::parse(&identity.format).map(|f| f.id()).as_deref() != Ok(id.as_str()) {
        return Err(ManifestError::Format { expected: id, got: identity.format.clone() });
    }
    Ok(id)
}

/// A reader over plain [`Buffers`], for [`Manifest::for_plan`] and
/// [`checksums_at_destination`]: `None` for a missing region or a range past its end.
pub fn read_buffers<'a>(bufs: &'a Buffers) -> impl Fn(u32, RegionId, u64, u64) -> Option<&'a [u8]> + 'a {
    move |rank, region, offset, len| {
        let buf = bufs.ranks.get(rank as usize)?.get(&region)?;
        let start = usize::try_from(offset).ok()?;
        let end = start.checked_add(usize::try_from(len).ok()?)?;
        buf.get(start..end)
    }
}

/// Which side of a plan's segments checksums read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reading {
    /// The source runs (the sender's checksums).
    Source,
    /// The destination runs (the receiver's recomputation).
    Destination,
}

impl Reading {
    /// `source` or `destination`, as errors name the side.
    fn name(self) -> &'static str {
        match self {
            Reading::Source => "source",
            Reading::Destination => "destination",
        }
    }
}

/// Checksums of the segments `segs` (indices into `plan.segments`, in plan
/// order, and every segment of each destination (rank, layer, tensor) they
/// touch: a layer's segments, or all of them), read at `side`.
///
/// A segment's bytes, in run order, come from `whole(i)` where they lie in
/// one piece (a packed segment in a staging buffer: one large read instead
/// of a gather of its runs), else run by run through
/// `read(rank, region, offset, len)`. Either way the digest is the same.
pub fn checksums_of<R: AsRef<[u8]>, W: AsRef<[u8]>>(
    plan: &Plan,
    side: Reading,
    segs: impl IntoIterator<Item = usize>,
    read: impl FnMut(u32, RegionId, u64, u64) -> Option<R>,
    whole: impl FnMut(usize) -> Option<W>,
) -> Result<Vec<LayerChecksum>, ManifestError> {
    let mut sums = Checksums::new(plan, side);
    sums.add(segs, read, whole)?;
    Ok(sums.finish())
}

/// Feeds `data` to `h`: not generic and never inlined, so the streaming
/// hash's hot loop is compiled here, once. Instantiated in each crate that
/// instantiates [`Checksums::add`] instead, its code followed unrelated
/// changes to that crate, and some daemon builds hashed at half speed
/// (the loop kept its accumulators in memory, not in registers).
#[inline(never)]
fn feed(h: &mut XxHash3_64, data: &[u8]) {
    h.write(data);
}

/// [`checksums_of`] fed in pieces: segments added in plan order, a few at
/// a time, give the same checksums as one call over all of them. A caller
/// that packs or unpacks as it goes hashes each piece while its bytes are
/// still in the CPU's cache, not in a second pass over the whole transfer.
///
/// Whole chunks ([`chunks_of`]) may also be hashed apart, on several
/// threads: each thread's `Checksums` is told where its chunks start in
/// their streams ([`Checksums::starting_at`]), and the lists of all of
/// them, put together and sorted, are the one list.
pub struct Checksums<'p> {
    plan: &'p Plan,
    side: Reading,
    streams: BTreeMap<(u32, RegionId), Stream>,
    done: Vec<LayerChecksum>,
    // (segment, its stream offset) for segments that start a chunk hashed
    // apart from the chunks before it; sorted by segment.
    starts: Vec<(usize, u64)>,
    chunk: Vec<u8>,
}

/// A region's stream as far as it was hashed.
struct Stream {
    h: XxHash3_64,
    // Bytes in the open chunk, and its number (none before the first segment).
    bytes: u64,
    open: Option<u64>,
    // Stream offset of the next segment.
    at: u64,
}

impl fmt::Debug for Checksums<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Checksums").field("side", &self.side).field("regions", &self.streams.len()).finish_non_exhaustive()
    }
}

impl<'p> Checksums<'p> {
    /// Gathered row runs are hashed in pieces of this many bytes: the
    /// streaming hash costs several times more fed a run at a time.
    const CHUNK: usize = 64 << 10;

    /// No segment hashed yet.
    pub fn new(plan: &'p Plan, side: Reading) -> Self {
        Checksums { plan, side, streams: BTreeMap::new(), done: Vec::new(), starts: Vec::new(), chunk: Vec::new() }
    }

    /// Segments that start a chunk hashed apart from the ones before it,
    /// with their stream offsets ([`ChunkRun`]'s `seg` and `start`): at
    /// each, its region's stream continues from that offset.
    pub fn starting_at(mut self, starts: impl IntoIterator<Item = (usize, u64)>) -> Self {
        self.starts = starts.into_iter().collect();
        self.starts.sort_unstable();
        self
    }

    /// Hashes segments `segs`, which continue the plan order of those
    /// added before; `read` and `whole` as in [`checksums_of`].
    pub fn add<R: AsRef<[u8]>, W: AsRef<[u8]>>(
        &mut self,
        segs: impl IntoIterator<Item = usize>,
        mut read: impl FnMut(u32, RegionId, u64, u64) -> Option<R>,
        mut whole: impl FnMut(usize) -> Option<W>,
    ) -> Result<(), ManifestError> {
        let (plan, side) = (self.plan, self.side);
        let source = side == Reading::Source;
        let Checksums { streams, done, starts, chunk, .. } = self;
        for i in segs {
            let s = plan.segments.get(i).ok_or(ManifestError::NoSegment { index: i, segments: plan.segments.len() })?;
            let (rank, region) = if source { (s.src_rank, s.src_region) } else { (s.dst_rank, s.dst_region) };
            let key = (s.dst_rank, s.dst_region);
            let st = streams.entry(key).or_insert_with(|| Stream { h: XxHash3_64::new(), bytes: 0, open: None, at: 0 });
            if let Ok(k) = starts.binary_search_by_key(&i, |&(seg, _)| seg) {
                st.at = starts[k].1;
            }
            let number = chunk_at(st.at);
            if st.open != Some(number) {
                if let Some(sum) = st.close(key) {
                    done.push(sum);
                }
                st.open = Some(number);
            }
            st.at += s.bytes();
            let (h, bytes) = (&mut st.h, &mut st.bytes);
            if let Some(data) = whole(i) {
                let data = data.as_ref();
                if data.len() as u64 != s.bytes() {
                    let offset = if source { s.src_offset } else { s.dst_offset };
                    return Err(ManifestError::Unreadable { side: side.name(), rank, layer: region.layer, tensor: region.tensor, offset, len: s.bytes() });
                }
                feed(h, data);
                *bytes += s.bytes();
                continue;
            }
            if chunk.capacity() == 0 {
                chunk.reserve(Self::CHUNK);
            }
            chunk.clear();
            // Runs that continue one another on the read side are read and
            // hashed as one (the digest is the same): a remap's row-sized runs
            // are often back to back on one side.
            let mut pending: Option<(u64, u64)> = None;
            let runs = s.runs().map(|(so, d)| Some(if source { so } else { d })).chain(std::iter::once(None));
            for next in runs {
                if let Some((start, len)) = pending {
                    if next == Some(start + len) {
                        pending = Some((start, len + s.len));
                        continue;
                    }
                    let unreadable = || ManifestError::Unreadable {
                        side: side.name(),
                        rank,
                        layer: region.layer,
                        tensor: region.tensor,
                        offset: start,
                        len,
                    };
                    let data = read(rank, region, start, len).ok_or_else(unreadable)?;
                    let data = data.as_ref();
                    if data.len() as u64 != len {
                        return Err(unreadable());
                    }
                    if chunk.len() + data.len() > Self::CHUNK {
                        feed(h, chunk);
                        chunk.clear();
                    }
                    if data.len() >= Self::CHUNK {
                        feed(h, data);
                    } else {
                        chunk.extend_from_slice(data);
                    }
                    *bytes += len;
                }
                pending = next.map(|offset| (offset, s.len));
            }
            feed(h, chunk);
        }
        Ok(())
    }

    /// One checksum per chunk hashed, in (destination rank, layer, tensor,
    /// chunk) order.
    pub fn finish(self) -> Vec<LayerChecksum> {
        let mut done = self.done;
        for (key, mut st) in self.streams {
            done.extend(st.close(key));
        }
        done.sort_unstable_by_key(LayerChecksum::key);
        done
    }
}

impl Stream {
    /// The open chunk's checksum, if one is open; the next starts afresh.
    fn close(&mut self, (dst_rank, region): (u32, RegionId)) -> Option<LayerChecksum> {
        let chunk = self.open.take()?;
        let sum = LayerChecksum {
            dst_rank,
            layer: region.layer,
            tensor: region.tensor,
            // A stream of more than 4 PiB is not a region anyone registers.
            chunk: u32::try_from(chunk).unwrap_or(u32::MAX),
            bytes: self.bytes,
            xxh3: self.h.finish(),
        };
        (self.h, self.bytes) = (XxHash3_64::new(), 0);
        Some(sum)
    }
}

/// One chunk of a region's stream (module docs), as [`chunks_of`] finds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkRun {
    /// Destination rank and region.
    pub region: (u32, RegionId),
    /// Its first segment.
    pub seg: usize,
    /// Stream offset of `seg`.
    pub start: u64,
    /// Its segments, in plan order (`seg` first).
    pub segs: Vec<usize>,
    /// Their bytes.
    pub bytes: u64,
}

/// The chunks of the regions that segments `segs` write (plan order, and
/// every segment of each region they touch: a layer's segments), in the
/// order their first segments come. Hashing each apart, its first
/// segment's offset given ([`Checksums::starting_at`]), gives the same
/// checksums as hashing `segs` in one pass.
pub fn chunks_of(plan: &Plan, segs: &[usize]) -> Vec<ChunkRun> {
    // A region's stream offset so far, and its open chunk (number, index in `out`).
    struct RegionAt {
        key: (u32, RegionId),
        offset: u64,
        open: Option<(u64, usize)>,
    }
    let mut out: Vec<ChunkRun> = Vec::new();
    // A layer writes a few regions, and a segment mostly goes where the one
    // before it went: a short list, the last one first.
    let mut regions: Vec<RegionAt> = Vec::new();
    let mut last = 0;
    for &i in segs {
        let Some(s) = plan.segments.get(i) else { continue };
        let key = (s.dst_rank, s.dst_region);
        if regions.get(last).is_none_or(|r| r.key != key) {
            last = match regions.iter().position(|r| r.key == key) {
                Some(k) => k,
                None => {
                    regions.push(RegionAt { key, offset: 0, open: None });
                    regions.len() - 1
                }
            };
        }
        let RegionAt { offset, open, .. } = &mut regions[last];
        let number = chunk_at(*offset);
        match open {
            Some((n, k)) if *n == number => {
                out[*k].segs.push(i);
                out[*k].bytes += s.bytes();
            }
            _ => {
                *open = Some((number, out.len()));
                out.push(ChunkRun { region: key, seg: i, start: *offset, segs: vec![i], bytes: s.bytes() });
            }
        }
        *offset += s.bytes();
    }
    out
}

/// Checksums of every destination region the plan writes that `keep`
/// accepts, reading each run through `read(rank, region, offset, len)`.
fn checksums<R: AsRef<[u8]>>(
    plan: &Plan,
    side: Reading,
    keep: impl Fn(u32, u32) -> bool,
    read: impl FnMut(u32, RegionId, u64, u64) -> Option<R>,
) -> Result<Vec<LayerChecksum>, ManifestError> {
    let segs = plan.segments.iter().enumerate().filter(|(_, s)| keep(s.dst_rank, s.dst_region.layer)).map(|(i, _)| i);
    checksums_of(plan, side, segs, read, |_| None::<&[u8]>)
}

/// Recomputes, at the receiver, the checksums of the (destination rank,
/// layer) pairs `keep` accepts — a rank subset, or one layer at a time —
/// reading placed bytes through `read_dst(dst_rank, region, offset, len)`
/// (see the module docs). Verify with the same filter
/// ([`Manifest::verify_checksums_of`]).
pub fn checksums_at_destination<R: AsRef<[u8]>>(
    plan: &Plan,
    read_dst: impl FnMut(u32, RegionId, u64, u64) -> Option<R>,
    keep: impl Fn(u32, u32) -> bool,
) -> Result<Vec<LayerChecksum>, ManifestError> {
    checksums(plan, Reading::Destination, keep, read_dst)
}

/// The sender's checksums of the (destination rank, layer) pairs `keep`
/// accepts, reading source runs through `read_src` as
/// [`Manifest::for_plan`] does: a source that streams layers as an engine
/// produces them sends each layer's once it exists
/// ([`Manifest::add_layer_checksums`] at the receiver).
pub fn checksums_at_source<R: AsRef<[u8]>>(
    plan: &Plan,
    read_src: impl FnMut(u32, RegionId, u64, u64) -> Option<R>,
    keep: impl Fn(u32, u32) -> bool,
) -> Result<Vec<LayerChecksum>, ManifestError> {
    checksums(plan, Reading::Source, keep, read_src)
}

/// The field-by-field comparison: `Ok` when equal, else the error `make` builds.
fn same<T: PartialEq + Clone>(expected: &T, got: &T, make: impl FnOnce(T, T) -> ManifestError) -> Result<(), ManifestError> {
    if expected == got {
        Ok(())
    } else {
        Err(make(expected.clone(), got.clone()))
    }
}

impl Expected {
    /// What the destination registered: the request's identity, the model,
    /// its own side, the request length and the prefix it keeps.
    pub fn new(
        identity: &CacheIdentity,
        model: &ModelSpec,
        dst: &Side,
        transfer: &str,
        tokens: u64,
        prefix_tokens: u64,
    ) -> Result<Expected, ManifestError> {
        Ok(Expected {
            transfer: transfer.to_string(),
            model_digest: identity.model_digest.clone(),
            adapter_digest: identity.adapter_digest.clone(),
            format: format_of(identity, dst)?,
            tenant: identity.tenant.clone(),
            rope: RopeParams::from_identity(identity)?,
            tokens,
            prefix_tokens,
            dst_map: MapSummary::of(&dst.shard),
            layers: layer_shapes(model, tokens),
        })
    }
}

impl Manifest {
    /// The manifest of `plan`, with checksums of the source bytes read through
    /// `read_src(src_rank, region, offset, len)` (a `&[u8]` or a `Vec<u8>`;
    /// `None` fails with [`ManifestError::Unreadable`]). The identity's format
    /// must be the plan's ([`ManifestError::Format`] otherwise).
    pub fn for_plan<R: AsRef<[u8]>>(
        identity: &CacheIdentity,
        model: &ModelSpec,
        src: &Side,
        dst: &Side,
        plan: &Plan,
        transfer: &str,
        read_src: impl FnMut(u32, RegionId, u64, u64) -> Option<R>,
    ) -> Result<Manifest, ManifestError> {
        let mut m = Manifest::claims(identity, model, src, dst, plan, transfer)?;
        m.checksums = checksums(plan, Reading::Source, |_, _| true, read_src)?;
        Ok(m)
    }

    /// The manifest of `plan` without checksums: every identity claim, for
    /// a source that does not hash, or that sends each layer's checksums
    /// as the layer is produced ([`checksums_at_source`]).
    pub fn claims(identity: &CacheIdentity, model: &ModelSpec, src: &Side, dst: &Side, plan: &Plan, transfer: &str) -> Result<Manifest, ManifestError> {
        let rope = RopeParams::from_identity(identity)?;
        Ok(Manifest {
            version: MANIFEST_VERSION,
            transfer: transfer.to_string(),
            model_digest: identity.model_digest.clone(),
            adapter_digest: identity.adapter_digest.clone(),
            format: format_of(identity, src)?,
            tenant: identity.tenant.clone(),
            layers: layer_shapes(model, plan.tokens),
            src_map: MapSummary::of(&src.shard),
            dst_map: MapSummary::of(&dst.shard),
            tokens: plan.tokens,
            prefix_tokens: plan.prefix_tokens,
            positions: Positions { first_position: rope.position_offset.saturating_add(plan.prefix_tokens), rope },
            checksum_algo: CHECKSUM_ALGO.to_string(),
            checksums: Vec::new(),
        })
    }

    /// Checks every claim against what the destination registered, in the
    /// order of the fields, and that every checksum names a (rank, layer,
    /// tensor) the destination holds, once, in order. `src_map` is carried
    /// for diagnosis only: the destination registers no source map.
    /// Checksums themselves are checked by [`Manifest::verify_checksums`].
    pub fn check(&self, expected: &Expected) -> Result<(), ManifestError> {
        use ManifestError as E;
        if self.version != MANIFEST_VERSION {
            return Err(E::Version { got: self.version });
        }
        if self.checksum_algo != CHECKSUM_ALGO {
            return Err(E::ChecksumAlgo { got: self.checksum_algo.clone() });
        }
        let rope = &self.positions.rope;
        same(&expected.transfer, &self.transfer, |expected, got| E::Transfer { expected, got })?;
        same(&expected.model_digest, &self.model_digest, |expected, got| E::ModelDigest { expected, got })?;
        same(&expected.adapter_digest, &self.adapter_digest, |expected, got| E::AdapterDigest { expected, got })?;
        same(&expected.format, &self.format, |expected, got| E::Format { expected, got })?;
        same(&expected.tenant, &self.tenant, |expected, got| E::Tenant { expected, got })?;
        same(&expected.rope.theta, &rope.theta, |expected, got| E::RopeTheta { expected, got })?;
        same(&expected.rope.scaling, &rope.scaling, |expected, got| E::RopeScaling { expected, got })?;
        same(&expected.rope.position_offset, &rope.position_offset, |expected, got| E::RopePositionOffset { expected, got })?;
        same(&expected.tokens, &self.tokens, |expected, got| E::Tokens { expected, got })?;
        same(&expected.prefix_tokens, &self.prefix_tokens, |expected, got| E::PrefixTokens { expected, got })?;
        let first = expected.rope.position_offset.saturating_add(expected.prefix_tokens);
        same(&first, &self.positions.first_position, |expected, got| E::FirstPosition { expected, got })?;
        if self.layers.len() != expected.layers.len() {
            return Err(E::LayerShape { detail: format!("expected {} layers, got {}", expected.layers.len(), self.layers.len()) });
        }
        for (got, want) in self.layers.iter().zip(&expected.layers) {
            if got != want {
                return Err(E::LayerShape { detail: format!("layer {}: expected {want}, got {got}", want.layer) });
            }
        }
        if let Some(detail) = self.dst_map.diff(&expected.dst_map) {
            return Err(E::ShardMap { detail: format!("destination {detail}") });
        }
        self.check_checksum_list()
    }

    /// Every checksum names a chunk of a (rank, layer, tensor) the
    /// destination holds, once, in order.
    fn check_checksum_list(&self) -> Result<(), ManifestError> {
        use ManifestError as E;
        let mut prev: Option<(u32, u32, Tensor, u32)> = None;
        for c in &self.checksums {
            let key = c.key();
            if prev.is_some_and(|p| p >= key) {
                return Err(E::ChecksumList {
                    detail: format!("dst rank {} layer {} tensor {} chunk {} is out of order or repeated", c.dst_rank, c.layer, tensor_name::of(c.tensor), c.chunk),
                });
            }
            prev = Some(key);
            let held = self.dst_map.heads_of(c.dst_rank, c.layer).is_some();
            let stored = self.layers.get(c.layer as usize).is_some_and(|l| match c.tensor {
                Tensor::State => l.state_bytes > 0,
                t => l.tensors.iter().any(|d| d.tensor == t),
            });
            if !held || !stored {
                return Err(E::ChecksumList {
                    detail: format!("dst rank {} does not hold layer {} tensor {}", c.dst_rank, c.layer, tensor_name::of(c.tensor)),
                });
            }
        }
        Ok(())
    }

    /// Adds the checksums of `layer`, sent after the manifest by a source
    /// that streams layers: each must name that layer, the manifest may hold
    /// none of that layer yet (a layer's sums come once), and the list stays
    /// what [`Manifest::check`] accepts. On error nothing is added.
    pub fn add_layer_checksums(&mut self, layer: u32, sums: &[LayerChecksum]) -> Result<(), ManifestError> {
        use ManifestError as E;
        if let Some(c) = sums.iter().find(|c| c.layer != layer) {
            return Err(E::ChecksumList { detail: format!("checksums sent for layer {layer} name layer {}", c.layer) });
        }
        if self.checksums.iter().any(|c| c.layer == layer) {
            return Err(E::ChecksumList { detail: format!("checksums of layer {layer} were sent twice") });
        }
        self.checksums.extend_from_slice(sums);
        self.checksums.sort_by_key(LayerChecksum::key);
        if let Err(e) = self.check_checksum_list() {
            self.checksums.retain(|c| c.layer != layer);
            return Err(e);
        }
        Ok(())
    }

    /// Compares the manifest's checksums with `recomputed` (from
    /// [`checksums_at_destination`] over every destination rank): same
    /// entries, same byte counts, same values.
    pub fn verify_checksums(&self, recomputed: &[LayerChecksum]) -> Result<(), ManifestError> {
        self.verify_checksums_where(recomputed, |_| true)
    }

    /// [`Manifest::verify_checksums`] limited to the destination ranks
    /// `dst_ranks` accepts (a receiver holding only some ranks); pass the
    /// same filter as to [`checksums_at_destination`].
    pub fn verify_checksums_where(&self, recomputed: &[LayerChecksum], dst_ranks: impl Fn(u32) -> bool) -> Result<(), ManifestError> {
        self.verify_checksums_of(recomputed, |rank, _| dst_ranks(rank))
    }

    /// [`Manifest::verify_checksums`] limited to the (destination rank,
    /// layer) pairs `keep` accepts: a receiver verifying layer by layer,
    /// before publishing each layer's flag.
    pub fn verify_checksums_of(&self, recomputed: &[LayerChecksum], keep: impl Fn(u32, u32) -> bool) -> Result<(), ManifestError> {
        let mut sent: BTreeMap<_, &LayerChecksum> =
            self.checksums.iter().filter(|c| keep(c.dst_rank, c.layer)).map(|c| (c.key(), c)).collect();
        for got in recomputed.iter().filter(|c| keep(c.dst_rank, c.layer)) {
            let (dst_rank, layer, tensor, chunk) = got.key();
            let want = sent.remove(&got.key()).ok_or(ManifestError::ChecksumNotInManifest { dst_rank, layer, tensor, chunk })?;
            if want.bytes != got.bytes {
                return Err(ManifestError::ChecksumBytes { dst_rank, layer, tensor, chunk, expected: want.bytes, got: got.bytes });
            }
            if want.xxh3 != got.xxh3 {
                return Err(ManifestError::Checksum { dst_rank, layer, tensor, chunk, expected: want.xxh3, got: got.xxh3 });
            }
        }
        match sent.into_keys().next() {
            Some((dst_rank, layer, tensor, chunk)) => Err(ManifestError::ChecksumNotRecomputed { dst_rank, layer, tensor, chunk }),
            None => Ok(()),
        }
    }

    /// The JSON the daemon sends (compact).
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a manifest has only string keys and plain values")
    }

    /// The compact binary form sent between daemons: every field in
    /// declaration order, the version first.
    pub fn to_wire(&self) -> Vec<u8> {
        postcard::to_allocvec(self).expect("a manifest encodes to memory")
    }

    /// Reads a manifest's binary form ([`Manifest::to_wire`]), refusing
    /// more than [`MAX_MANIFEST_JSON`] bytes, another version (named as
    /// such, whatever follows it), bytes that do not decode and bytes left
    /// over. Never panics on hostile input; a length inside it reserves at
    /// most 1 MiB ahead of the elements really there (serde's cautious hint).
    pub fn from_wire(bytes: &[u8]) -> Result<Manifest, ManifestError> {
        if bytes.len() > MAX_MANIFEST_JSON {
            return Err(ManifestError::TooLarge { form: "binary form", len: bytes.len(), limit: MAX_MANIFEST_JSON });
        }
        let wire = |reason: String| ManifestError::Wire { reason };
        match postcard::take_from_bytes::<Manifest>(bytes) {
            Ok((m, _)) if m.version != MANIFEST_VERSION => Err(ManifestError::Version { got: m.version }),
            Ok((m, [])) => Ok(m),
            Ok((_, rest)) => Err(wire(format!("{} bytes after the manifest", rest.len()))),
            Err(e) => match postcard::take_from_bytes::<u32>(bytes) {
                Ok((got, _)) if got != MANIFEST_VERSION => Err(ManifestError::Version { got }),
                _ => Err(wire(e.to_string())),
            },
        }
    }

    /// Reads a manifest from JSON, refusing more than [`MAX_MANIFEST_JSON`]
    /// bytes, another version (before looking at its fields), malformed
    /// JSON and unknown fields. Never panics on hostile input.
    pub fn from_json(text: &[u8]) -> Result<Manifest, ManifestError> {
        if text.len() > MAX_MANIFEST_JSON {
            return Err(ManifestError::TooLarge { form: "JSON", len: text.len(), limit: MAX_MANIFEST_JSON });
        }
        #[derive(Deserialize)]
        struct VersionOnly {
            version: u32,
        }
        let json = |e: serde_json::Error| ManifestError::Json { reason: e.to_string() };
        // One parse when the manifest is good (it sits on every transfer's
        // path); only one that fails is read again for its version, so
        // another version is still named as such, whatever its fields.
        match serde_json::from_slice::<Manifest>(text) {
            Ok(m) if m.version == MANIFEST_VERSION => Ok(m),
            Ok(m) => Err(ManifestError::Version { got: m.version }),
            Err(e) => match serde_json::from_slice::<VersionOnly>(text) {
                Ok(probe) if probe.version != MANIFEST_VERSION => Err(ManifestError::Version { got: probe.version }),
                _ => Err(json(e)),
            },
        }
    }
}
