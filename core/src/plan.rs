//! Transfer plans: every destination-owned byte mapped to exactly one source byte.
//!
//! A plan is pure data: a list of [`Segment`]s, each one contiguous run of
//! `len` bytes repeated `count` times at fixed strides on both sides (a 2-D
//! copy; `count == 1` is a plain run). The data plane executes it without
//! thinking: a `Direct` segment is `count` one-sided writes (or one
//! scatter-gather list), a `Packed` one is gathered into staging at the
//! source, sent as one write, and scattered at the destination.
//!
//! Planning works per (destination rank, layer, tensor, run of heads held by
//! the same source replicas): it walks the retained positions in chunks
//! bounded by both sides' block boundaries, emits each chunk as a 2-D
//! pattern, and coalesces. Layers with the same shape reuse one computed
//! pattern, so planning cost grows with distinct layer shapes and block-table
//! fragments, not with layers × tokens. The plan keeps those patterns as
//! templates, each stamped with its ranks, regions and base offsets per
//! group ([`Segments`]): a shuffled 128k-token table is millions of
//! segments but a few thousand stored records.
//!
//! Replica choice: a head held by several source ranks is read from the one
//! with the fewest bytes assigned so far, decided per (layer, tensor), so
//! load spreads by layers across ranks and NICs.
//!
//! Cost model (documented defaults in [`CostModel`]): a strided segment of
//! `count` runs is packed when the per-write overhead it saves exceeds the
//! cost of the extra pack and unpack copies:
//! `(count - 1) × per_write_ns > 2 × bytes / copy_bytes_per_ns`.

use crate::format::CacheFormat;
use crate::layout::{ModelSpec, Retention, Tensor};
use crate::shard::{LayoutSpec, MemLayout, RegionId, ShardError, ShardMap, TableKind};
use crate::tensors::{rank_tensors, Expected, KvOrder, RankTensors, Strides, TensorError};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// One side (source or destination) of a transfer, resolved for a request.
#[derive(Debug, Clone)]
pub struct Side {
    /// Who holds what.
    pub shard: ShardMap,
    /// Format, block size and padding.
    pub geo: crate::Geometry,
    /// Row order inside a block.
    pub mem: MemLayout,
    /// The request's block ids, in position order (shared by every rank of the side).
    pub block_table: Vec<u32>,
    /// Capacity of every region in blocks (≥ every id in the table + 1).
    pub num_blocks: u32,
    /// Engine tensors (`kv=`); `None` is kvwire's contiguous layout.
    pub kv: Option<KvOrder>,
    /// With `kv`: per rank, its engine tensors, where each row lives in them, and its regions.
    pub engine: Vec<RankTensors>,
}

/// Errors building a side or a plan.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum PlanError {
    /// The layout does not fit the model.
    #[error(transparent)]
    Shard(#[from] ShardError),
    /// A size that must be positive was zero.
    #[error(transparent)]
    Geometry(#[from] crate::layout::GeometryError),
    /// `tokens` was zero.
    #[error("`tokens` must be > 0")]
    ZeroTokens,
    /// The prefix is longer than the request.
    #[error("prefix_tokens {prefix} exceeds tokens {tokens}")]
    PrefixTooLong {
        /// Prefix tokens asked for.
        prefix: u64,
        /// Tokens in the request.
        tokens: u64,
    },
    /// The block table cannot hold the request.
    #[error("block table: {0}")]
    BlockTable(String),
    /// The two sides store different formats (conversion is a codec's job).
    #[error("source format {src} differs from destination format {dst}")]
    FormatMismatch {
        /// Source format id.
        src: String,
        /// Destination format id.
        dst: String,
    },
    /// The model cannot be held in the engine tensors the layout names.
    #[error(transparent)]
    Tensors(#[from] TensorError),
    /// No source rank holds a byte the destination needs.
    #[error("no source rank holds head {head} of layer {layer}")]
    NoSource {
        /// Layer.
        layer: u32,
        /// Head.
        head: u32,
    },
}

/// Most blocks in one request's table (2^26: a billion tokens at 16 per block).
pub const MAX_TABLE_BLOCKS: u64 = 1 << 26;

fn shuffled(n: u32, seed: u64) -> Vec<u32> {
    // Fisher–Yates with splitmix64: deterministic, no dependency.
    let mut v: Vec<u32> = (0..n).collect();
    let mut s = seed;
    for i in (1..v.len()).rev() {
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        v.swap(i, (z % (i as u64 + 1)) as usize);
    }
    v
}

impl Side {
    /// Resolves `layout` for a request of `tokens` in `format`, with the
    /// table the layout names.
    pub fn new(model: &ModelSpec, layout: &LayoutSpec, format: CacheFormat, tokens: u64) -> Result<Side, PlanError> {
        let geo = layout.geometry(format)?;
        if tokens == 0 {
            return Err(PlanError::ZeroTokens);
        }
        if tokens > crate::layout::MAX_TOKENS {
            return Err(PlanError::BlockTable(format!("{tokens} tokens is more than the {} kvwire accepts", crate::layout::MAX_TOKENS)));
        }
        let n = tokens.div_ceil(u64::from(geo.block_size));
        if n > MAX_TABLE_BLOCKS {
            return Err(PlanError::BlockTable(format!(
                "{tokens} tokens at {} per block need {n} blocks, more than the {MAX_TABLE_BLOCKS} kvwire accepts",
                geo.block_size
            )));
        }
        let n = n as u32;
        let (table, capacity) = match layout.table {
            TableKind::Contiguous => ((0..n).collect(), n),
            TableKind::Shuffled { seed } => {
                let pool = n + n / 4 + 1;
                (shuffled(pool, seed)[..n as usize].to_vec(), pool)
            }
        };
        Side::with_table(model, layout, format, tokens, table, capacity)
    }

    /// Resolves `layout` with an explicit block table and region capacity.
    pub fn with_table(
        model: &ModelSpec,
        layout: &LayoutSpec,
        format: CacheFormat,
        tokens: u64,
        block_table: Vec<u32>,
        num_blocks: u32,
    ) -> Result<Side, PlanError> {
        let geo = layout.geometry(format)?;
        let shard = layout.shard_map(model)?;
        let need = tokens.div_ceil(u64::from(geo.block_size));
        if num_blocks as u64 > MAX_TABLE_BLOCKS * 2 {
            return Err(PlanError::BlockTable(format!("{num_blocks} blocks per region is more than {} ", MAX_TABLE_BLOCKS * 2)));
        }
        if (block_table.len() as u64) < need {
            return Err(PlanError::BlockTable(format!(
                "{} blocks listed but {tokens} tokens at {} per block need {need}",
                block_table.len(),
                geo.block_size
            )));
        }
        let mut seen = vec![false; num_blocks as usize];
        for &b in &block_table[..need as usize] {
            if b >= num_blocks {
                return Err(PlanError::BlockTable(format!("block id {b} is past the region's {num_blocks} blocks")));
            }
            if std::mem::replace(&mut seen[b as usize], true) {
                return Err(PlanError::BlockTable(format!("block id {b} appears twice")));
            }
        }
        let engine = match &layout.kv {
            Some(order) => shard.ranks.iter().map(|r| rank_tensors(order, model, r, format, num_blocks, geo.block_size)).collect::<Result<_, _>>()?,
            None => Vec::new(),
        };
        let side = Side { shard, geo, mem: layout.mem, block_table, num_blocks, kv: layout.kv.clone(), engine };
        // Every region length, and their sum over the side, must fit in u64:
        // then every offset, and every plan counter, does too.
        let mut total = 0u64;
        for rank in 0..side.shard.ranks.len() as u32 {
            for (id, len) in side.regions_checked(model, rank) {
                let len = len.ok_or_else(|| {
                    PlanError::BlockTable(format!("rank {rank} region {id:?}: {num_blocks} blocks overflow 64 bits"))
                })?;
                total = total
                    .checked_add(len)
                    .ok_or_else(|| PlanError::BlockTable("regions of this side overflow 64 bits".into()))?;
            }
        }
        Ok(side)
    }

    fn regions_checked(&self, model: &ModelSpec, rank: u32) -> Vec<(RegionId, Option<u64>)> {
        if let Some(rt) = self.engine.get(rank as usize) {
            let mut out: Vec<(RegionId, Option<u64>)> = rt.windows.iter().map(|w| (w.id, Some(w.len))).collect();
            // A tensor's size must fit too: regions are windows of it.
            if rt.tensors.iter().any(|t| t.bytes_checked().is_none()) {
                out.push((RegionId { layer: 0, tensor: Tensor::K }, None));
            }
            return out;
        }
        let mut out = Vec::new();
        for ls in &self.shard.ranks[rank as usize].layers {
            let spec = &model.layers[ls.layer as usize];
            for t in spec.tensors() {
                let lh = ls.heads.end - ls.heads.start;
                let len = u64::from(self.num_blocks).checked_mul(self.geo.block_bytes(lh, t.dim));
                out.push((RegionId { layer: ls.layer, tensor: t.tensor }, len));
            }
            if spec.state_bytes > 0 {
                out.push((RegionId { layer: ls.layer, tensor: Tensor::State }, Some(spec.state_bytes)));
            }
        }
        out
    }

    /// Byte strides of `region` on `rank`, which holds `local_heads` rows of `dim` elements per position.
    pub fn strides(&self, rank: u32, region: RegionId, local_heads: u32, dim: u32) -> Strides {
        if let Some(p) = self.engine.get(rank as usize).and_then(|rt| rt.place(region)) {
            return p.strides;
        }
        let row = self.geo.row_stride(dim);
        let block = self.geo.block_bytes(local_heads, dim);
        match self.mem {
            MemLayout::Nhd => Strides { block, token: u64::from(local_heads) * row, head: row },
            MemLayout::Hnd => Strides { block, token: row, head: u64::from(self.geo.block_size) * row },
        }
    }

    /// The region holding (layer, tensor) `of` on `rank`, and the byte offset
    /// of its first element there: itself at 0, except where an engine
    /// tensor holds K and V together (one region per layer, named by K).
    pub fn window_of(&self, rank: u32, of: RegionId) -> (RegionId, u64) {
        self.engine.get(rank as usize).and_then(|rt| rt.window_of(of)).unwrap_or((of, 0))
    }

    /// True when this side keeps a block's K and V side by side in one
    /// tensor (an engine order with the K/V axis inside the block axis).
    pub fn pairs_kv(&self) -> bool {
        self.kv.as_ref().is_some_and(KvOrder::pairs_kv)
    }

    /// Bytes from `layer`'s first K element to its first V element in their shared region on `rank`.
    fn kv_offset(&self, rank: u32, layer: u32) -> u64 {
        let at = |tensor| self.window_of(rank, RegionId { layer, tensor }).1;
        at(Tensor::V) - at(Tensor::K)
    }

    /// Bytes rank `rank`'s cache occupies in one memory: its regions back to
    /// back, or its engine tensors back to back (their regions interleave).
    pub fn rank_bytes(&self, model: &ModelSpec, rank: u32) -> u64 {
        match self.engine.get(rank as usize) {
            Some(rt) => rt.tensors.iter().map(Expected::bytes).sum(),
            None => self.regions(model, rank).iter().map(|(_, l)| l).sum(),
        }
    }

    /// The regions rank `rank` holds and their byte lengths (checked to fit
    /// when the side was built).
    pub fn regions(&self, model: &ModelSpec, rank: u32) -> Vec<(RegionId, u64)> {
        self.regions_checked(model, rank).into_iter().map(|(id, len)| (id, len.unwrap_or(u64::MAX))).collect()
    }
}

/// How a segment is carried.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// `count` one-sided writes straight into place.
    Direct,
    /// Gather → one write into staging → scatter.
    Packed,
    /// One strided write straight into place, run by run (shm: the
    /// destination copies the rows from the source's mapping, no pack and
    /// no unpack).
    Strided,
}

/// One run of bytes, repeated `count` times at fixed strides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Segment {
    /// Source rank.
    pub src_rank: u32,
    /// Source region.
    pub src_region: RegionId,
    /// Byte offset of the first run in the source region.
    pub src_offset: u64,
    /// Destination rank.
    pub dst_rank: u32,
    /// Destination region.
    pub dst_region: RegionId,
    /// Byte offset of the first run in the destination region.
    pub dst_offset: u64,
    /// Bytes per run.
    pub len: u64,
    /// Runs (≥ 1).
    pub count: u64,
    /// Distance between runs at the source (0 when `count == 1`).
    pub src_stride: u64,
    /// Distance between runs at the destination (0 when `count == 1`).
    pub dst_stride: u64,
    /// How the data plane carries it.
    pub mode: Mode,
}

impl Segment {
    /// Bytes this segment moves.
    pub fn bytes(&self) -> u64 {
        self.len * self.count
    }

    /// One-sided writes it takes.
    pub fn writes(&self) -> u64 {
        match self.mode {
            Mode::Direct => self.count,
            Mode::Packed | Mode::Strided => 1,
        }
    }

    /// Whether its runs lie back to back at the source: then its bytes in
    /// run order are one range there, and a packed segment can be written
    /// from the source as it is, with no gather.
    pub fn src_contiguous(&self) -> bool {
        self.count <= 1 || self.src_stride == self.len
    }

    /// Whether its runs lie back to back at the destination: then its bytes
    /// in run order are one range there (one copy, one write).
    pub fn dst_contiguous(&self) -> bool {
        self.count <= 1 || self.dst_stride == self.len
    }

    /// `(src_offset, dst_offset)` of each run.
    pub fn runs(self) -> impl Iterator<Item = (u64, u64)> {
        (0..self.count).map(move |i| (self.src_offset + i * self.src_stride, self.dst_offset + i * self.dst_stride))
    }
}

/// One shape of a template, with how it is carried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Shaped {
    shape: Shape,
    mode: Mode,
}

/// A template stamped for one (source rank, destination rank, layer,
/// tensor, head run): the ranks and regions, and where its offsets start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Group {
    src_rank: u32,
    src_region: RegionId,
    src_base: u64,
    dst_rank: u32,
    dst_region: RegionId,
    dst_base: u64,
    template: u32,
}

impl Group {
    fn stamp(&self, t: &Shaped) -> Segment {
        let s = t.shape;
        Segment {
            src_rank: self.src_rank,
            src_region: self.src_region,
            src_offset: self.src_base + s.src,
            dst_rank: self.dst_rank,
            dst_region: self.dst_region,
            dst_offset: self.dst_base + s.dst,
            len: s.len,
            count: s.count,
            src_stride: s.src_stride,
            dst_stride: s.dst_stride,
            mode: t.mode,
        }
    }
}

/// A plan's segments, kept as templates stamped per group. A fragmented
/// block table gives every layer, tensor and rank pair the same shapes, so
/// the flat list (millions of records for a long shuffled request) is never
/// built: segments are made on the way out, by value, in plan order.
#[derive(Debug, Clone, Default)]
pub struct Segments {
    templates: Vec<Arc<[Shaped]>>,
    groups: Vec<Group>,
    /// Segments before each group; one more entry, the total, at the end.
    starts: Vec<usize>,
    hint: Hint,
}

/// Where the last lookup by index ended. Packing, unpacking and hashing
/// look segments up by index in plan order: each one is then in the same
/// entry as the last or the next, found without a search. Threads that
/// walk one plan side by side (each its own regions) keep theirs apart, a
/// slot each by thread and a cache line each: one shared word, written at
/// every lookup, went back and forth between their cores and cost more
/// than the lookups. A slot is written only when it changes. A stale hint
/// costs only the search.
#[derive(Debug, Default)]
pub struct Hint([Padded; HINT_SLOTS]);

/// Threads whose hints are kept apart; more share slots (correct, slower).
/// Slots go to threads in turn, so a long-lived thread and the short-lived
/// ones working beside it share one only every this many of the latter.
const HINT_SLOTS: usize = 16;

#[derive(Debug, Default)]
#[repr(align(64))]
struct Padded(AtomicUsize);

thread_local! {
    // This thread's slot in every hint, handed out in turn at first use.
    static HINT_SLOT: Cell<usize> = const { Cell::new(usize::MAX) };
}

fn hint_slot() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    HINT_SLOT.with(|s| {
        if s.get() == usize::MAX {
            s.set(NEXT.fetch_add(1, Ordering::Relaxed) % HINT_SLOTS);
        }
        s.get()
    })
}

impl Hint {
    /// The last entry found (by this thread, unless it shares its slot).
    pub fn get(&self) -> usize {
        self.0[hint_slot()].0.load(Ordering::Relaxed)
    }

    /// Remembers the entry found.
    pub fn set(&self, at: usize) {
        let slot = &self.0[hint_slot()].0;
        if slot.load(Ordering::Relaxed) != at {
            slot.store(at, Ordering::Relaxed);
        }
    }
}

impl Clone for Hint {
    fn clone(&self) -> Hint {
        Hint::default()
    }
}

/// A hint is no part of what its owner holds.
impl PartialEq for Hint {
    fn eq(&self, _: &Hint) -> bool {
        true
    }
}

impl Eq for Hint {}

impl Segments {
    fn push_group(&mut self, g: Group) {
        let n = self.templates[g.template as usize].len();
        if n == 0 {
            return;
        }
        if self.starts.is_empty() {
            self.starts.push(0);
        }
        self.groups.push(g);
        self.starts.push(self.len() + n);
    }

    /// Segments in the plan.
    pub fn len(&self) -> usize {
        self.starts.last().copied().unwrap_or(0)
    }

    /// Whether the plan moves nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Segment `i`, if the plan has it.
    pub fn get(&self, i: usize) -> Option<Segment> {
        if i >= self.len() {
            return None;
        }
        let inside = |g: usize| g < self.groups.len() && self.starts[g] <= i && i < self.starts[g + 1];
        let h = self.hint.get();
        let g = match (inside(h), inside(h.saturating_add(1))) {
            (true, _) => h,
            (_, true) => h + 1,
            _ => self.starts.partition_point(|&s| s <= i) - 1,
        };
        self.hint.set(g);
        let group = &self.groups[g];
        Some(group.stamp(&self.templates[group.template as usize][i - self.starts[g]]))
    }

    /// Segment `i`; panics past the end, as indexing does.
    pub fn at(&self, i: usize) -> Segment {
        self.get(i).unwrap_or_else(|| panic!("segment {i} of a plan of {}", self.len()))
    }

    /// Every segment, in plan order.
    pub fn iter(&self) -> SegmentIter<'_> {
        SegmentIter { segs: self, group: 0, next: 0, left: self.len() }
    }

    /// The flat list (tests, and tools that edit a plan).
    pub fn to_vec(&self) -> Vec<Segment> {
        self.iter().collect()
    }

    /// What is stored: (template shapes, groups). Planning time and memory
    /// follow these, not [`Segments::len`].
    pub fn stored(&self) -> (usize, usize) {
        (self.templates.iter().map(|t| t.len()).sum(), self.groups.len())
    }
}

/// Iterator over [`Segments`].
#[derive(Debug, Clone)]
pub struct SegmentIter<'a> {
    segs: &'a Segments,
    group: usize,
    next: usize,
    left: usize,
}

impl Iterator for SegmentIter<'_> {
    type Item = Segment;

    fn next(&mut self) -> Option<Segment> {
        while let Some(g) = self.segs.groups.get(self.group) {
            let t = &self.segs.templates[g.template as usize];
            if let Some(shaped) = t.get(self.next) {
                self.next += 1;
                self.left -= 1;
                return Some(g.stamp(shaped));
            }
            self.group += 1;
            self.next = 0;
        }
        None
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}

impl ExactSizeIterator for SegmentIter<'_> {}

impl<'a> IntoIterator for &'a Segments {
    type Item = Segment;
    type IntoIter = SegmentIter<'a>;

    fn into_iter(self) -> SegmentIter<'a> {
        self.iter()
    }
}

impl From<Vec<Segment>> for Segments {
    /// One group per segment: for plans written by hand.
    fn from(flat: Vec<Segment>) -> Segments {
        let mut out = Segments::default();
        for s in flat {
            let shape = Shape { src: 0, dst: 0, len: s.len, count: s.count, src_stride: s.src_stride, dst_stride: s.dst_stride };
            out.templates.push(Arc::from([Shaped { shape, mode: s.mode }]));
            out.push_group(Group {
                src_rank: s.src_rank,
                src_region: s.src_region,
                src_base: s.src_offset,
                dst_rank: s.dst_rank,
                dst_region: s.dst_region,
                dst_base: s.dst_offset,
                template: (out.templates.len() - 1) as u32,
            });
        }
        out
    }
}

impl PartialEq for Segments {
    fn eq(&self, other: &Segments) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

impl Serialize for Segments {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.iter())
    }
}

/// Cost model behind the direct / packed choice: a strided segment goes
/// as one packed write when the writes it saves cost more than the copies
/// it adds. The copies are the destination's unpack, and the source's
/// gather unless its runs already lie back to back there (then it writes
/// them from the cache as they are). Where the transport carries strided
/// writes, a segment of several runs whose destination runs are long
/// ([`STRIDED_MIN_RUN`]) or back to back is one of those: one write, and
/// no copy beyond the one that moves it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct CostModel {
    /// Fixed cost of one write: posting, NIC work-request processing, completion (default 500 ns).
    pub per_write_ns: f64,
    /// Local copy bandwidth for pack and unpack, in bytes per ns (= GB/s) (default 8).
    pub copy_bytes_per_ns: f64,
    /// The transport carries strided writes (shm, tcp).
    pub strided: bool,
    /// Strided writes of runs shorter than [`STRIDED_MIN_RUN`] pay off
    /// where the runs lie back to back at the destination (shm: a copy a
    /// run; over tcp each run is a slice sent, and a frame's runs under a
    /// few KiB in all are read one by one through the receive buffer).
    pub strided_short_runs: bool,
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel { per_write_ns: 500.0, copy_bytes_per_ns: 8.0, strided: false, strided_short_runs: false }
    }
}

/// The shortest destination run a strided write carries (unless its runs
/// are back to back there). Measured on
/// loopback shm through two daemons (llama-3.1-8b, 2048 tokens, checksums
/// on): tp8 NHD/16 -> HND/32 (8 KiB runs) strided took 52 ms against 63
/// packed; tp8 -> tp2 NHD (256-byte rows 1 KiB apart) 93 against 62, its
/// destination checksums reading the rows at a quarter of a stage's speed.
pub const STRIDED_MIN_RUN: u64 = 2048;

impl CostModel {
    /// The model for writes over `transport`. Both ends of a transfer plan
    /// with it, so they must agree: it depends on nothing but the transport.
    ///
    /// shm's writes cost more than a NIC's: each is a request the
    /// destination reads, checks, copies and answers. Measured through two
    /// daemons (llama-3.1-8b, 2048 tokens, tp=8 NHD/16 -> tp=2 HND/32, 32,768
    /// direct 8 KiB writes against 64 whole-region writes of the same
    /// bytes), each write added about 2.2 us over shm and about 1 us over
    /// tcp, whose frames the socket coalesces; tcp keeps the default, as
    /// unpacking there measured no faster than writing. shm and tcp carry
    /// strided writes (shm as one request, tcp as frames of whole runs);
    /// verbs does not. Over tcp, short runs strided cost more than packed:
    /// kvwire-soak's 1 MiB remap (2 KiB segments of 128-byte runs, back to
    /// back at the destination) went 1.05 -> 1.51 ms with them strided.
    pub fn for_transport(transport: crate::protocol::TransportKind) -> CostModel {
        match transport {
            crate::protocol::TransportKind::Shm => CostModel { per_write_ns: 2000.0, strided: true, strided_short_runs: true, ..CostModel::default() },
            crate::protocol::TransportKind::Tcp => CostModel { strided: true, ..CostModel::default() },
            crate::protocol::TransportKind::Verbs => CostModel::default(),
        }
    }

    fn mode(&self, len: u64, count: u64, src_contiguous: bool, dst_contiguous: bool) -> Mode {
        // Strided when the destination reads its runs back (its checksums)
        // in pieces long enough to stream (row-sized runs a head apart, a
        // tp8 -> tp2 NHD remap's, read 4x slower than a packed stage), and
        // when its one request costs less than the copies packing adds
        // (packed segments share one write, strided ones take one each).
        let copies = if src_contiguous { 1.0 } else { 2.0 };
        let packing = copies * (len * count) as f64 / self.copy_bytes_per_ns;
        if self.strided && (len >= STRIDED_MIN_RUN || dst_contiguous && self.strided_short_runs) && packing > self.per_write_ns {
            return Mode::Strided;
        }
        let saved = (count.saturating_sub(1)) as f64 * self.per_write_ns;
        let copies = if src_contiguous { 1.0 } else { 2.0 };
        let extra = copies * (len * count) as f64 / self.copy_bytes_per_ns;
        if saved > extra {
            Mode::Packed
        } else {
            Mode::Direct
        }
    }
}

/// Bytes a rank sent or received.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RankBytes {
    /// Rank.
    pub rank: u32,
    /// Bytes.
    pub bytes: u64,
}

/// A plan's counters.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PlanCounters {
    /// Segment records.
    pub segments: u64,
    /// One-sided writes the data plane will post.
    pub writes: u64,
    /// Bytes moved (sum over segments).
    pub total_bytes_moved: u64,
    /// Bytes in packed segments.
    pub packed_bytes: u64,
    /// Bytes in direct segments.
    pub direct_bytes: u64,
    /// Destination bytes not moved because the destination holds the prefix.
    pub reused_bytes: u64,
    /// Static per-tensor scales that travel in the manifest, not in segments.
    pub metadata_bytes: u64,
    /// Bytes sent per source rank (every rank listed).
    pub src_ranks: Vec<RankBytes>,
    /// Bytes received per destination rank (every rank listed).
    pub dst_ranks: Vec<RankBytes>,
}

/// A transfer plan.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    /// Tokens in the request.
    pub tokens: u64,
    /// Leading positions the destination already holds.
    pub prefix_tokens: u64,
    /// The cost model used.
    pub cost: CostModel,
    /// Counters.
    pub counters: PlanCounters,
    /// The segments, grouped by destination rank, layer, tensor.
    pub segments: Segments,
}

/// Everything [`build`] needs.
#[derive(Debug, Clone, Copy)]
pub struct PlanInput<'a> {
    /// The model.
    pub model: &'a ModelSpec,
    /// Tokens in the request.
    pub tokens: u64,
    /// Leading positions the destination already holds (after [`crate::reuse::check_prefix`]).
    pub prefix_tokens: u64,
    /// Source side.
    pub src: &'a Side,
    /// Destination side.
    pub dst: &'a Side,
    /// Direct/packed cost model.
    pub cost: CostModel,
}

/// Positions of a layer the destination needs: retained, at or after the prefix.
fn needed_ranges(retention: &Retention, tokens: u64, prefix: u64) -> Vec<Range<u64>> {
    retention
        .ranges(tokens)
        .into_iter()
        .map(|r| r.start.max(prefix)..r.end)
        .filter(|r| !r.is_empty())
        .collect()
}

/// Offsets relative to a region, before ranks and regions are stamped on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Shape {
    src: u64,
    dst: u64,
    len: u64,
    count: u64,
    src_stride: u64,
    dst_stride: u64,
}

impl Shape {
    fn run(src: u64, dst: u64, len: u64) -> Shape {
        Shape { src, dst, len, count: 1, src_stride: 0, dst_stride: 0 }
    }

    fn strided(src: u64, dst: u64, len: u64, count: u64, src_stride: u64, dst_stride: u64) -> Shape {
        if count == 1 || (src_stride == len && dst_stride == len) {
            Shape::run(src, dst, len * count)
        } else {
            Shape { src, dst, len, count, src_stride, dst_stride }
        }
    }
}

/// `b` continues the strided pattern of `a`: merge them.
fn merge_strided(a: &Shape, b: &Shape) -> Option<Shape> {
    if a.len != b.len {
        return None;
    }
    let (ss, ds) = if a.count > 1 {
        (a.src_stride, a.dst_stride)
    } else if b.count > 1 {
        (b.src_stride, b.dst_stride)
    } else {
        (b.src.checked_sub(a.src)?, b.dst.checked_sub(a.dst)?)
    };
    if ss == 0 || ds == 0 {
        return None;
    }
    let strides_agree = |s: &Shape| s.count == 1 || (s.src_stride == ss && s.dst_stride == ds);
    if !strides_agree(a) || !strides_agree(b) {
        return None;
    }
    if b.src != a.src + a.count * ss || b.dst != a.dst + a.count * ds {
        return None;
    }
    Some(Shape::strided(a.src, a.dst, a.len, a.count + b.count, ss, ds))
}

/// Collects shapes, merging contiguous runs at once and settled runs into strides.
#[derive(Default)]
struct Coalescer {
    out: Vec<Shape>,
}

impl Coalescer {
    fn push(&mut self, s: Shape) {
        if let Some(last) = self.out.last_mut() {
            if last.count == 1 && s.count == 1 && last.src + last.len == s.src && last.dst + last.len == s.dst {
                last.len += s.len;
                return;
            }
        }
        self.settle();
        self.out.push(s);
    }

    /// The last shape can no longer grow: fold it into the one before if it continues its stride.
    fn settle(&mut self) {
        let n = self.out.len();
        if n >= 2 {
            if let Some(m) = merge_strided(&self.out[n - 2], &self.out[n - 1]) {
                self.out[n - 2] = m;
                self.out.pop();
            }
        }
    }

    fn finish(mut self) -> Vec<Shape> {
        self.settle();
        self.out
    }
}

/// Address model of one side for one (layer tensor, head run).
struct Addr<'a> {
    table: &'a [u32],
    block: u64,
    strides: Strides,
    head_off: u64,
}

impl Addr<'_> {
    /// Offset of (position `p`, first head of the run), token stride, head stride.
    fn at(&self, p: u64) -> (u64, u64, u64) {
        let s = self.strides;
        let base = u64::from(self.table[(p / self.block) as usize]) * s.block;
        (base + (p % self.block) * s.token + self.head_off * s.head, s.token, s.head)
    }
}

/// Emits the `nt × nh` rows starting at (src, dst) with the fewest shapes.
fn emit_2d(c: &mut Coalescer, src: (u64, u64, u64), dst: (u64, u64, u64), nt: u64, nh: u64, len: u64) {
    let (sb, sst, ssh) = src;
    let (db, dst_t, dsh) = dst;
    let heads_contig = nh == 1 || (ssh == len && dsh == len);
    if heads_contig {
        let unit = nh * len;
        c.push(Shape::strided(sb, db, unit, nt, sst, dst_t));
    } else if nt == 1 || (sst == len && dst_t == len) {
        c.push(Shape::strided(sb, db, nt * len, nh, ssh, dsh));
    } else {
        for h in 0..nh {
            c.push(Shape::strided(sb + h * ssh, db + h * dsh, len, nt, sst, dst_t));
        }
    }
}

/// Emits the rows of `dims` (count, source stride, destination stride)
/// from (src, dst) with few shapes: dimensions contiguous on both sides
/// fold into the run; the longest of the rest becomes one strided shape,
/// repeated over the others in the source's memory order.
fn emit_nd(c: &mut Coalescer, (src, dst): (u64, u64), mut len: u64, dims: &[(u64, u64, u64)]) {
    let mut dims: Vec<(u64, u64, u64)> = dims.iter().copied().filter(|d| d.0 > 1).collect();
    while let Some(i) = dims.iter().position(|&(_, ss, ds)| ss == len && ds == len) {
        len *= dims.remove(i).0;
    }
    dims.sort_by_key(|d| std::cmp::Reverse(d.1));
    if let Some(i) = (0..dims.len()).rev().max_by_key(|&i| dims[i].0) {
        let inner = dims.remove(i);
        dims.push(inner);
    }
    let Some((&(n, ss, ds), outer)) = dims.split_last() else {
        c.push(Shape::run(src, dst, len));
        return;
    };
    for i in 0..outer.iter().map(|d| d.0).product::<u64>() {
        let (mut so, mut dof, mut rest) = (src, dst, i);
        for &(count, s, d) in outer.iter().rev() {
            so += (rest % count) * s;
            dof += (rest % count) * d;
            rest /= count;
        }
        c.push(Shape::strided(so, dof, len, n, ss, ds));
    }
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct TemplateKey {
    src_strides: Strides,
    src_head_off: u32,
    dst_strides: Strides,
    dst_head_off: u32,
    /// With K and V paired: V's offset from K on each side; else (0, 0).
    kv: (u64, u64),
    heads: u32,
    dim: u32,
    ranges: Vec<Range<u64>>,
}

fn template(key: &TemplateKey, src: &Side, dst: &Side) -> Vec<Shape> {
    fn addr(side: &Side, strides: Strides, off: u32) -> Addr<'_> {
        Addr { table: &side.block_table, block: u64::from(side.geo.block_size), strides, head_off: u64::from(off) }
    }
    let sa = addr(src, key.src_strides, key.src_head_off);
    let da = addr(dst, key.dst_strides, key.dst_head_off);
    let len = src.geo.row_bytes(key.dim);
    let mut c = Coalescer::default();
    for r in &key.ranges {
        let mut p = r.start;
        while p < r.end {
            let end = r.end.min((p / sa.block + 1) * sa.block).min((p / da.block + 1) * da.block);
            if key.kv == (0, 0) {
                emit_2d(&mut c, sa.at(p), da.at(p), end - p, u64::from(key.heads), len);
            } else {
                let ((sb, st, sh), (db, dt, dh)) = (sa.at(p), da.at(p));
                emit_nd(&mut c, (sb, db), len, &[(end - p, st, dt), (u64::from(key.heads), sh, dh), (2, key.kv.0, key.kv.1)]);
            }
            p = end;
        }
    }
    c.finish()
}

/// Source ranks holding each layer: (rank, heads) — built once per plan.
fn holders(src: &ShardMap, n_layers: usize) -> Vec<Vec<(u32, Range<u32>)>> {
    let mut by_layer = vec![Vec::new(); n_layers];
    for r in &src.ranks {
        for ls in &r.layers {
            by_layer[ls.layer as usize].push((r.rank, ls.heads.clone()));
        }
    }
    by_layer
}

/// Builds the plan.
pub fn build(input: &PlanInput<'_>) -> Result<Plan, PlanError> {
    let PlanInput { model, tokens, prefix_tokens, src, dst, cost } = *input;
    if tokens == 0 {
        return Err(PlanError::ZeroTokens);
    }
    if prefix_tokens > tokens {
        return Err(PlanError::PrefixTooLong { prefix: prefix_tokens, tokens });
    }
    if src.geo.format != dst.geo.format {
        return Err(PlanError::FormatMismatch { src: src.geo.format.id(), dst: dst.geo.format.id() });
    }
    for side in [src, dst] {
        let need = tokens.div_ceil(u64::from(side.geo.block_size));
        if (side.block_table.len() as u64) < need {
            return Err(PlanError::BlockTable(format!("{} blocks listed, {need} needed", side.block_table.len())));
        }
    }
    let holders = holders(&src.shard, model.layers.len());
    let mut load = vec![0u64; src.shard.ranks.len()];
    let mut received = vec![0u64; dst.shard.ranks.len()];
    let mut templates: HashMap<TemplateKey, u32> = HashMap::new();
    let mut segments = Segments::default();
    // Per template: (bytes, packed bytes, writes), so counters add per group.
    let mut sums: Vec<(u64, u64, u64)> = Vec::new();
    fn add_template(segments: &mut Segments, sums: &mut Vec<(u64, u64, u64)>, shaped: Vec<Shaped>) -> u32 {
        let bytes = shaped.iter().map(|t| t.shape.len * t.shape.count).sum();
        let packed = shaped.iter().filter(|t| t.mode == Mode::Packed).map(|t| t.shape.len * t.shape.count).sum();
        let writes = shaped.iter().map(|t| if t.mode == Mode::Direct { t.shape.count } else { 1 }).sum();
        sums.push((bytes, packed, writes));
        segments.templates.push(Arc::from(shaped));
        (segments.templates.len() - 1) as u32
    }
    let (mut total_bytes_moved, mut packed_bytes, mut writes) = (0u64, 0u64, 0u64);
    let mut reused_bytes = 0;
    let mut metadata_bytes = 0;

    for d in &dst.shard.ranks {
        for ls in &d.layers {
            let layer = ls.layer;
            let spec = &model.layers[layer as usize];
            let ranges = needed_ranges(&spec.retention, tokens, prefix_tokens);
            let needed: u64 = ranges.iter().map(|r| r.end - r.start).sum();
            let reused = spec.retention.retained(tokens) - needed;
            // Where both sides keep a block's K and V side by side in one
            // tensor, they move together: runs then cross from K into V.
            let paired = spec.tensors().len() == 2 && src.pairs_kv() && dst.pairs_kv();
            for t in spec.tensors() {
                metadata_bytes += dst.geo.format.tensor_static_bytes();
                let row = dst.geo.row_bytes(t.dim);
                reused_bytes += reused * u64::from(ls.heads.end - ls.heads.start) * row;
                if paired && t.tensor == Tensor::V {
                    continue; // moved with K
                }
                let planes = if paired { 2 } else { 1 };
                let mut h = ls.heads.start;
                while h < ls.heads.end {
                    // The run of heads from `h` whose candidate replicas are the same ranks.
                    let cands: Vec<&(u32, Range<u32>)> =
                        holders[layer as usize].iter().filter(|(_, hs)| hs.contains(&h)).collect();
                    if cands.is_empty() {
                        return Err(PlanError::NoSource { layer, head: h });
                    }
                    let run_end = cands.iter().map(|(_, hs)| hs.end).min().unwrap_or(h + 1).min(ls.heads.end);
                    let &(rank, ref sheads) = *cands
                        .iter()
                        .min_by_key(|(r, _)| (load[*r as usize], *r))
                        .expect("cands is not empty");
                    let heads = run_end - h;
                    let bytes = planes * needed * u64::from(heads) * row;
                    load[rank as usize] += bytes;
                    received[d.rank as usize] += bytes;
                    if bytes > 0 {
                        let region = RegionId { layer, tensor: t.tensor };
                        let key = TemplateKey {
                            src_strides: src.strides(rank, region, sheads.end - sheads.start, t.dim),
                            src_head_off: h - sheads.start,
                            dst_strides: dst.strides(d.rank, region, ls.heads.end - ls.heads.start, t.dim),
                            dst_head_off: h - ls.heads.start,
                            kv: if paired { (src.kv_offset(rank, layer), dst.kv_offset(d.rank, layer)) } else { (0, 0) },
                            heads,
                            dim: t.dim,
                            ranges: ranges.clone(),
                        };
                        let template = match templates.get(&key) {
                            Some(&t) => t,
                            None => {
                                let shaped = template(&key, src, dst)
                                    .into_iter()
                                    .map(|s| Shaped { shape: s, mode: if s.count > 1 { cost.mode(s.len, s.count, s.src_stride == s.len, s.dst_stride == s.len) } else { Mode::Direct } })
                                    .collect();
                                let t = add_template(&mut segments, &mut sums, shaped);
                                templates.insert(key, t);
                                t
                            }
                        };
                        let (src_region, src_base) = src.window_of(rank, region);
                        let (dst_region, dst_base) = dst.window_of(d.rank, region);
                        let (b, pb, w) = sums[template as usize];
                        (total_bytes_moved, packed_bytes, writes) = (total_bytes_moved + b, packed_bytes + pb, writes + w);
                        segments.push_group(Group { src_rank: rank, src_region, src_base, dst_rank: d.rank, dst_region, dst_base, template });
                    }
                    h = run_end;
                }
            }
            if spec.state_bytes > 0 {
                // Constant state: copied whole from the least-loaded holder of the layer.
                let &(rank, _) = holders[layer as usize]
                    .iter()
                    .min_by_key(|(r, _)| (load[*r as usize], *r))
                    .ok_or(PlanError::NoSource { layer, head: 0 })?;
                load[rank as usize] += spec.state_bytes;
                received[d.rank as usize] += spec.state_bytes;
                let region = RegionId { layer, tensor: Tensor::State };
                let template = add_template(&mut segments, &mut sums, vec![Shaped { shape: Shape::run(0, 0, spec.state_bytes), mode: Mode::Direct }]);
                (total_bytes_moved, writes) = (total_bytes_moved + spec.state_bytes, writes + 1);
                segments.push_group(Group { src_rank: rank, src_region: region, src_base: 0, dst_rank: d.rank, dst_region: region, dst_base: 0, template });
            }
        }
    }

    let counters = PlanCounters {
        segments: segments.len() as u64,
        writes,
        total_bytes_moved,
        packed_bytes,
        direct_bytes: total_bytes_moved - packed_bytes,
        reused_bytes,
        metadata_bytes,
        src_ranks: load.iter().enumerate().map(|(r, &bytes)| RankBytes { rank: r as u32, bytes }).collect(),
        dst_ranks: received.iter().enumerate().map(|(r, &bytes)| RankBytes { rank: r as u32, bytes }).collect(),
    };
    Ok(Plan { tokens, prefix_tokens, cost, counters, segments })
}

/// Per-rank byte buffers, one per region: what [`execute`] runs on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Buffers {
    /// `ranks[r][region]` = that region's bytes.
    pub ranks: Vec<BTreeMap<RegionId, Vec<u8>>>,
}

impl Buffers {
    /// Allocates every region of every rank of `side`, filled with `fill`.
    pub fn alloc(model: &ModelSpec, side: &Side, fill: u8) -> Buffers {
        let ranks = (0..side.shard.ranks.len() as u32)
            .map(|r| side.regions(model, r).into_iter().map(|(id, len)| (id, vec![fill; len as usize])).collect())
            .collect();
        Buffers { ranks }
    }

    /// Total bytes allocated.
    pub fn len(&self) -> u64 {
        self.ranks.iter().flat_map(|r| r.values()).map(|v| v.len() as u64).sum()
    }

    /// True when no region holds a byte.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Why a plan could not run on the given buffers.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum ExecError {
    /// A segment names a region its rank does not have.
    #[error("segment {index}: {side} rank {rank} has no region {region:?}")]
    UnknownRegion {
        /// Segment index.
        index: usize,
        /// `source` or `destination`.
        side: &'static str,
        /// Rank.
        rank: u32,
        /// Region.
        region: RegionId,
    },
    /// A segment reaches past its region.
    #[error("segment {index}: {side} bytes [{start}, {end}) past region length {region_len}")]
    OutOfBounds {
        /// Segment index.
        index: usize,
        /// `source` or `destination`.
        side: &'static str,
        /// First byte.
        start: u64,
        /// One past the last byte.
        end: u64,
        /// Region length.
        region_len: u64,
    },
}

fn span(s: &Segment, start: u64, stride: u64) -> (u64, u64) {
    (start, start + (s.count - 1) * stride + s.len)
}

/// Region bytes a plan's runs are read from and written to: whole
/// regions ([`Buffers`]), or only where each region's rows lie (the
/// oracle's, for regions that interleave with other layers').
pub trait RegionBytes {
    /// `len` bytes from `offset` of `region` on `rank`. `Err(None)`: no
    /// such region here; `Err(Some(region_len))`: not all of them held.
    fn run(&self, rank: u32, region: RegionId, offset: u64, len: u64) -> Result<&[u8], Option<u64>>;
    /// As [`RegionBytes::run`], to write.
    fn run_mut(&mut self, rank: u32, region: RegionId, offset: u64, len: u64) -> Result<&mut [u8], Option<u64>>;
}

impl RegionBytes for Buffers {
    fn run(&self, rank: u32, region: RegionId, offset: u64, len: u64) -> Result<&[u8], Option<u64>> {
        let buf = self.ranks.get(rank as usize).and_then(|r| r.get(&region)).ok_or(None)?;
        let end = offset.checked_add(len).filter(|&e| e <= buf.len() as u64).ok_or(Some(buf.len() as u64))?;
        Ok(&buf[offset as usize..end as usize])
    }

    fn run_mut(&mut self, rank: u32, region: RegionId, offset: u64, len: u64) -> Result<&mut [u8], Option<u64>> {
        let buf = self.ranks.get_mut(rank as usize).and_then(|r| r.get_mut(&region)).ok_or(None)?;
        let end = offset.checked_add(len).filter(|&e| e <= buf.len() as u64).ok_or(Some(buf.len() as u64))?;
        Ok(&mut buf[offset as usize..end as usize])
    }
}

/// Runs `plan` on plain buffers: copies every run from `src` into `dst`.
/// Checks every run's bounds first, so a bad plan touches nothing.
/// Returns the bytes copied.
pub fn execute(plan: &Plan, src: &Buffers, dst: &mut Buffers) -> Result<u64, ExecError> {
    execute_segments(&plan.segments.iter().enumerate().collect::<Vec<_>>(), src, dst)
}

/// [`execute`] for some of a plan's segments, each with its index in the
/// plan (for errors): buffers need hold only the regions these name.
pub fn execute_segments<B: RegionBytes>(segments: &[(usize, Segment)], src: &B, dst: &mut B) -> Result<u64, ExecError> {
    for &(index, ref s) in segments {
        for (side, bufs, rank, region, start, stride) in [
            ("source", src, s.src_rank, s.src_region, s.src_offset, s.src_stride),
            ("destination", &*dst, s.dst_rank, s.dst_region, s.dst_offset, s.dst_stride),
        ] {
            for i in 0..s.count {
                let at = start + i * stride;
                match bufs.run(rank, region, at, s.len) {
                    Ok(_) => {}
                    Err(None) => return Err(ExecError::UnknownRegion { index, side, rank, region }),
                    Err(Some(region_len)) => {
                        let (start, end) = span(s, start, stride);
                        return Err(ExecError::OutOfBounds { index, side, start, end, region_len });
                    }
                }
            }
        }
    }
    let mut copied = 0;
    for (_, s) in segments {
        for (so, d) in s.runs() {
            let from = src.run(s.src_rank, s.src_region, so, s.len).expect("checked above");
            dst.run_mut(s.dst_rank, s.dst_region, d, s.len).expect("checked above").copy_from_slice(from);
        }
        copied += s.bytes();
    }
    Ok(copied)
}
