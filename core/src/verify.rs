//! An independent oracle for plans: fills source caches with codes that name
//! every byte, computes the destination cache a correct transfer must leave,
//! and checks an executed plan against it.
//!
//! Each row's offset is computed directly from the layout's definition
//! (`block_table[p / B] * block_bytes + row index * row_stride`), one row at
//! a time, not by the planner's run machinery; it does read the planner's
//! `Side` (shard map, geometry), so a wrong shard map or geometry agrees
//! with itself here. core/tests/it/oracle.rs writes those out by hand.

use crate::layout::{ModelSpec, Tensor};
use crate::plan::{execute_segments, Buffers, ExecError, Plan, RegionBytes, Segment, Side};
use crate::shard::{MemLayout, RegionId};
use crate::tensors::{element_index, Axis, KvOrder, Role};
use std::collections::BTreeMap;

/// Value every destination byte starts as; no code ever equals it, so a
/// stray write always shows.
pub const CANARY: u8 = 0xA5;

/// The code of one byte of the cache: a hash of everything that identifies it.
pub fn code(layer: u32, tensor: Tensor, head: u32, pos: u64, byte: u64) -> u8 {
    let mut z = u64::from(layer) << 48 ^ (tensor as u64) << 44 ^ u64::from(head) << 32 ^ pos.rotate_left(16) ^ byte;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    let c = (z ^ (z >> 31)) as u8;
    if c == CANARY {
        !CANARY
    } else {
        c
    }
}

fn row_offset(side: &Side, rank: u32, region: RegionId, local_heads: u32, dim: u32, local_head: u32, pos: u64) -> u64 {
    let b = u64::from(side.geo.block_size);
    let block = u64::from(side.block_table[(pos / b) as usize]);
    let slot = pos % b;
    if let Some(order) = &side.kv {
        return engine_row_offset(side, order, rank, region, block, slot, u64::from(local_head));
    }
    let row_index = match side.mem {
        MemLayout::Nhd => slot * u64::from(local_heads) + u64::from(local_head),
        MemLayout::Hnd => u64::from(local_head) * b + slot,
    };
    block * side.geo.block_bytes(local_heads, dim) + row_index * side.geo.row_stride(dim)
}

/// A row's offset in its region under an engine order: its element's
/// row-major index in the tensor, less that of the region's first element
/// (the layer's K where K and V share the tensor).
fn engine_row_offset(side: &Side, order: &KvOrder, rank: u32, region: RegionId, block: u64, slot: u64, head: u64) -> u64 {
    let tensors = &side.engine[rank as usize].tensors;
    let kv = u64::from(region.tensor == Tensor::V);
    let t = tensors
        .iter()
        .find(|t| t.layers.contains(&region.layer) && (order.kv_together() || (t.role == Role::V) == (kv == 1)))
        .expect("an engine tensor holds every held layer");
    if t.role == Role::Latent {
        // A latent's tensor has the order's axes without K/V (and layer).
        let axes: Vec<Axis> = order.axes().iter().copied().filter(|&a| a != Axis::Kv && a != Axis::Layer).collect();
        let index = |b, s, h| {
            element_index(order, &axes, &t.shape, |a| match a {
                Axis::Block => b,
                Axis::Token => s,
                Axis::Head => h,
                _ => 0,
            })
        };
        return (index(block, slot, head) - index(0, 0, 0)) * t.elem_bytes;
    }
    let li = u64::from(region.layer - t.layers.start);
    let kv = if order.kv_together() { kv } else { 0 };
    let index = |kv, b, s, h| {
        element_index(order, order.axes(), &t.shape, |a| match a {
            Axis::Layer => li,
            Axis::Kv => kv,
            Axis::Block => b,
            Axis::Token => s,
            Axis::Head => h,
            Axis::Dim => 0,
        })
    };
    (index(kv, block, slot, head) - index(0, 0, 0, 0)) * t.elem_bytes
}

/// Writes the code of every retained row byte (and of every state byte) the
/// ranks of `side` hold into `bufs`, for positions in `from..`; other bytes
/// are left as they are. With `only`, that layer's regions only (`bufs`
/// need hold no others).
fn write_codes(model: &ModelSpec, side: &Side, tokens: u64, from: u64, only: Option<u32>, bufs: &mut impl RegionBytes) {
    for rank in &side.shard.ranks {
        for ls in rank.layers.iter().filter(|ls| only.is_none_or(|l| l == ls.layer)) {
            let spec = &model.layers[ls.layer as usize];
            let lh = ls.heads.end - ls.heads.start;
            for t in spec.tensors() {
                let (window, _) = side.window_of(rank.rank, RegionId { layer: ls.layer, tensor: t.tensor });
                let len = side.geo.row_bytes(t.dim);
                for r in spec.retention.ranges(tokens) {
                    for pos in r.start.max(from)..r.end {
                        for (i, head) in ls.heads.clone().enumerate() {
                            let off = row_offset(side, rank.rank, RegionId { layer: ls.layer, tensor: t.tensor }, lh, t.dim, i as u32, pos);
                            let row = bufs.run_mut(rank.rank, window, off, len).expect("region allocated for every held row");
                            for (byte, b) in row.iter_mut().enumerate() {
                                *b = code(ls.layer, t.tensor, head, pos, byte as u64);
                            }
                        }
                    }
                }
            }
            if spec.state_bytes > 0 {
                let region = bufs.run_mut(rank.rank, RegionId { layer: ls.layer, tensor: Tensor::State }, 0, spec.state_bytes).expect("state region allocated");
                for (byte, b) in region.iter_mut().enumerate() {
                    *b = code(ls.layer, Tensor::State, 0, 0, byte as u64);
                }
            }
        }
    }
}

/// Source caches: every held, retained byte carries its code; the rest is zero.
pub fn fill_source(model: &ModelSpec, side: &Side, tokens: u64) -> Buffers {
    let mut bufs = Buffers::alloc(model, side, 0);
    write_codes(model, side, tokens, 0, None, &mut bufs);
    bufs
}

/// What the destination must hold after a correct transfer that skipped the
/// first `prefix` positions: codes for every needed byte, [`CANARY`] elsewhere.
pub fn expected_destination(model: &ModelSpec, side: &Side, tokens: u64, prefix: u64) -> Buffers {
    let mut bufs = Buffers::alloc(model, side, CANARY);
    write_codes(model, side, tokens, prefix, None, &mut bufs);
    bufs
}

/// What [`verify`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyReport {
    /// Bytes the plan copied.
    pub bytes_copied: u64,
    /// Destination bytes that had to receive a code.
    pub bytes_expected: u64,
    /// Destination bytes checked (all of them).
    pub bytes_checked: u64,
}

/// How a plan failed verification.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum VerifyError {
    /// The plan could not run.
    #[error(transparent)]
    Exec(#[from] ExecError),
    /// One step's buffers would be too large to check here.
    #[error("verification needs {needed} bytes of buffers at once (one layer on every rank), more than the {limit} allowed; raise the limit or use fewer tokens")]
    TooLarge {
        /// Bytes needed.
        needed: u64,
        /// Limit.
        limit: u64,
    },
    /// A destination byte differs from what it must hold.
    #[error("dst rank {rank} {region:?} byte {offset}: expected {expected:#04x}, found {found:#04x} ({mismatches} bytes differ)")]
    Mismatch {
        /// Rank.
        rank: u32,
        /// Region.
        region: RegionId,
        /// First differing offset.
        offset: u64,
        /// Expected byte.
        expected: u8,
        /// Found byte.
        found: u8,
        /// Differing bytes in all.
        mismatches: u64,
    },
    /// Bytes were written more than once (or were needless writes).
    #[error("plan copied {copied} bytes but the destination needs exactly {expected}")]
    Count {
        /// Bytes copied.
        copied: u64,
        /// Bytes needed.
        expected: u64,
    },
}

/// Executes `plan` on coded buffers and checks every destination byte.
///
/// Correct values everywhere, canaries untouched outside, and bytes copied
/// equal to bytes needed together prove each needed byte was written exactly
/// once from the right source byte.
///
/// It streams: a segment never leaves its layer (a region is one layer's
/// window of a tensor), so the check runs one layer at a time, holding that
/// layer's rows on every source rank and two copies (expected, executed)
/// of them on every destination rank: only the rows, where a cross-layer
/// tensor's window interleaves with other layers'. `limit` bounds the bytes
/// held at once, not the cache's size.
pub fn verify(model: &ModelSpec, src: &Side, dst: &Side, plan: &Plan, limit: u64) -> Result<VerifyReport, VerifyError> {
    // layer → (rank, region, length) of every region of a side.
    let regions = |side: &Side| {
        let mut by_layer: BTreeMap<u32, Vec<(u32, RegionId, u64)>> = BTreeMap::new();
        for rank in 0..side.shard.ranks.len() as u32 {
            for (id, len) in side.regions(model, rank) {
                by_layer.entry(id.layer).or_default().push((rank, id, len));
            }
        }
        by_layer
    };
    let (src_regions, dst_regions) = (regions(src), regions(dst));
    let mut steps: BTreeMap<u32, Vec<(usize, Segment)>> = dst_regions.keys().map(|l| (*l, Vec::new())).collect();
    for (i, s) in plan.segments.iter().enumerate() {
        steps.entry(s.dst_region.layer).or_default().push((i, s));
    }
    let none = Vec::new();
    let mut report = VerifyReport { bytes_copied: 0, bytes_expected: 0, bytes_checked: 0 };
    for (&layer, segments) in &steps {
        let (srcs, dsts) = (src_regions.get(&layer).unwrap_or(&none), dst_regions.get(&layer).unwrap_or(&none));
        let (src_rows, dst_rows) = (rows_of(model, src, layer, srcs), rows_of(model, dst, layer, dsts));
        let held = |rows: &[(u32, RegionId, u64, Vec<(u64, u64)>)]| rows.iter().flat_map(|r| r.3.iter().map(|&(_, n)| n)).fold(0u64, u64::saturating_add);
        let needed = held(&src_rows).saturating_add(held(&dst_rows).saturating_mul(2));
        if needed > limit {
            return Err(VerifyError::TooLarge { needed, limit });
        }
        // Buffers holding this layer's rows only.
        let step = |side: &Side, rows: &[(u32, RegionId, u64, Vec<(u64, u64)>)], fill: u8, from: Option<u64>| {
            let mut b = Held { ranks: (0..side.shard.ranks.len()).map(|_| BTreeMap::new()).collect() };
            for (rank, id, len, ranges) in rows {
                b.ranks[*rank as usize].insert(*id, HeldRegion::new(ranges, *len, fill));
            }
            if let Some(from) = from {
                write_codes(model, side, plan.tokens, from, Some(layer), &mut b);
            }
            b
        };
        let source = step(src, &src_rows, 0, Some(0));
        let expected = step(dst, &dst_rows, CANARY, Some(plan.prefix_tokens));
        let mut got = step(dst, &dst_rows, CANARY, None);
        report.bytes_copied += execute_segments(segments, &source, &mut got)?;
        drop(source);
        for (rank, (want, have)) in expected.ranks.iter().zip(&got.ranks).enumerate() {
            for ((region, w), h) in want.iter().zip(have.values()) {
                report.bytes_expected += w.bytes.iter().filter(|&&b| b != CANARY).count() as u64;
                report.bytes_checked += w.bytes.len() as u64;
                let mut diffs = w.bytes.iter().zip(&h.bytes).enumerate().filter(|(_, (a, b))| a != b);
                if let Some((at, (&expected, &found))) = diffs.next() {
                    return Err(VerifyError::Mismatch {
                        rank: rank as u32,
                        region: *region,
                        offset: w.offset_of(at),
                        expected,
                        found,
                        mismatches: 1 + diffs.count() as u64,
                    });
                }
            }
        }
    }
    if report.bytes_copied != report.bytes_expected {
        return Err(VerifyError::Count { copied: report.bytes_copied, expected: report.bytes_expected });
    }
    Ok(report)
}

/// Where layer `layer`'s rows lie in each of its regions `rs` on `side`:
/// (rank, region, length, sorted disjoint (offset, length) ranges). A
/// region of kvwire's own layout is one range; an engine tensor's window
/// of a layer holds only that layer's rows, every block's, which in a
/// cross-layer tensor interleave with every other layer's.
fn rows_of(model: &ModelSpec, side: &Side, layer: u32, rs: &[(u32, RegionId, u64)]) -> Vec<(u32, RegionId, u64, Vec<(u64, u64)>)> {
    let Some(order) = &side.kv else {
        return rs.iter().map(|&(rank, id, len)| (rank, id, len, vec![(0, len)])).collect();
    };
    let spec = &model.layers[layer as usize];
    rs.iter()
        .map(|&(rank, id, len)| {
            let mut rows = Vec::new();
            for ls in side.shard.ranks[rank as usize].layers.iter().filter(|ls| ls.layer == layer) {
                for t in spec.tensors() {
                    let of = RegionId { layer, tensor: t.tensor };
                    if side.window_of(rank, of).0 != id {
                        continue;
                    }
                    let row = side.geo.row_bytes(t.dim);
                    for block in 0..u64::from(side.num_blocks) {
                        for slot in 0..u64::from(side.geo.block_size) {
                            for head in 0..u64::from(ls.heads.end - ls.heads.start) {
                                rows.push((engine_row_offset(side, order, rank, of, block, slot, head), row));
                            }
                        }
                    }
                }
            }
            rows.sort_unstable();
            let mut ranges: Vec<(u64, u64)> = Vec::new();
            for (at, n) in rows {
                match ranges.last_mut() {
                    Some(last) if last.0 + last.1 >= at => last.1 = last.1.max(at + n - last.0),
                    _ => ranges.push((at, n)),
                }
            }
            (rank, id, len, ranges)
        })
        .collect()
}

/// One layer's regions on every rank of a side, each holding only the
/// bytes its rows occupy ([`rows_of`]).
struct Held {
    ranks: Vec<BTreeMap<RegionId, HeldRegion>>,
}

struct HeldRegion {
    /// (offset in the region, index in `bytes`, length), sorted by offset.
    ranges: Vec<(u64, usize, u64)>,
    bytes: Vec<u8>,
    len: u64,
}

impl HeldRegion {
    fn new(ranges: &[(u64, u64)], len: u64, fill: u8) -> HeldRegion {
        let mut at = 0;
        let ranges: Vec<(u64, usize, u64)> = ranges
            .iter()
            .map(|&(offset, n)| {
                let r = (offset, at, n);
                at += n as usize;
                r
            })
            .collect();
        HeldRegion { ranges, bytes: vec![fill; at], len }
    }

    /// Where `len` bytes from `offset` lie in `bytes`, when one range holds them all.
    fn index(&self, offset: u64, len: u64) -> Option<usize> {
        let i = self.ranges.partition_point(|r| r.0 <= offset).checked_sub(1)?;
        let (start, at, n) = self.ranges[i];
        (offset.checked_add(len)? <= start + n).then(|| at + (offset - start) as usize)
    }

    /// The region offset of `bytes[at]`.
    fn offset_of(&self, at: usize) -> u64 {
        let i = self.ranges.partition_point(|r| r.1 <= at) - 1;
        self.ranges[i].0 + (at - self.ranges[i].1) as u64
    }
}

impl RegionBytes for Held {
    fn run(&self, rank: u32, region: RegionId, offset: u64, len: u64) -> Result<&[u8], Option<u64>> {
        let r = self.ranks.get(rank as usize).and_then(|r| r.get(&region)).ok_or(None)?;
        let at = r.index(offset, len).ok_or(Some(r.len))?;
        Ok(&r.bytes[at..at + len as usize])
    }

    fn run_mut(&mut self, rank: u32, region: RegionId, offset: u64, len: u64) -> Result<&mut [u8], Option<u64>> {
        let r = self.ranks.get_mut(rank as usize).and_then(|r| r.get_mut(&region)).ok_or(None)?;
        let at = r.index(offset, len).ok_or(Some(r.len))?;
        Ok(&mut r.bytes[at..at + len as usize])
    }
}
