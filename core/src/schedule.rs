//! The per-transfer schedule: which bytes go out in which layer's batch,
//! through staging or straight into place, and how many bytes each layer's
//! flag waits for.
//!
//! Both sides of a transfer call [`Schedule::new`] on the same plan, so the
//! source's batches and the destination's expected counts come from one
//! function and cannot drift apart. A staged segment (the plan's packed
//! segments, and with a codec every segment) takes the same offset in the
//! source's staging buffer and in the destination's, unless it lands in
//! place ([`Staged::placed`]): gathered at the source, written straight
//! into its destination runs, which lie back to back there.

use crate::codec::{self, Codec};
use crate::plan::{Hint, Mode, Plan, Segment};
use crate::shard::RegionId;
use crate::{CacheFormat, ModelSpec};

/// Why a plan cannot be scheduled.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum ScheduleError {
    /// The codec cannot convert this cache format.
    #[error("codec: {0}")]
    Codec(String),
    /// A segment names a tensor its layer does not have.
    #[error("segment {seg}: layer {layer} has no {tensor} tensor")]
    NoTensor {
        /// Index into the plan's segments.
        seg: usize,
        /// Its destination layer.
        layer: u32,
        /// The tensor named.
        tensor: String,
    },
    /// With a codec, runs must be whole rows.
    #[error("segment {seg}: runs of {len} bytes are not whole rows of {row}")]
    PartialRows {
        /// Index into the plan's segments.
        seg: usize,
        /// Run length.
        len: u64,
        /// Row bytes of its tensor.
        row: u64,
    },
    /// A segment's destination layer is outside the model.
    #[error("segment {seg}: layer {layer} is outside the model's {layers} layers")]
    NoLayer {
        /// Index into the plan's segments.
        seg: usize,
        /// Its destination layer.
        layer: u32,
        /// Layers in the model.
        layers: usize,
    },
}

/// One staged segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Staged {
    /// Index into `plan.segments`.
    pub seg: usize,
    /// Offset in the staging buffers.
    pub offset: u64,
    /// Bytes it occupies there (encoded size with a codec).
    pub size: u64,
    /// Elements per row of its tensor.
    pub dim: u32,
    /// Lands in place: no codec converts it and its destination runs lie
    /// back to back, so the source writes its gathered bytes straight
    /// there (one write, as staged) and the destination neither stages nor
    /// unpacks it. Its offset is the source's staging alone.
    pub placed: bool,
}

/// Segment indices in increasing order, kept as runs of consecutive
/// indices: a fragmented plan's millions of segments are a few runs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SegList {
    /// (first index, count).
    runs: Vec<(usize, usize)>,
    len: usize,
}

impl SegList {
    /// Appends `seg`, above every index already in.
    pub fn push(&mut self, seg: usize) {
        match self.runs.last_mut() {
            Some((first, count)) if *first + *count == seg => *count += 1,
            _ => self.runs.push((seg, 1)),
        }
        self.len += 1;
    }

    /// Indices held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The indices, in order.
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        self.runs.iter().flat_map(|&(first, count)| first..first + count)
    }

    /// Runs stored (what it costs in memory).
    pub fn runs(&self) -> usize {
        self.runs.len()
    }
}

/// Staged segments in staging order, kept as runs: consecutive segments
/// of one size and row width lie back to back in staging, so a run is its
/// first segment, its first offset and a count.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StagedList {
    runs: Vec<StagedRun>,
    len: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct StagedRun {
    first: Staged,
    count: usize,
}

impl StagedRun {
    fn at(&self, k: usize) -> Staged {
        Staged { seg: self.first.seg + k, offset: self.first.offset + k as u64 * self.first.size, ..self.first }
    }

    fn holds(&self, seg: usize) -> bool {
        (self.first.seg..self.first.seg + self.count).contains(&seg)
    }
}

impl StagedList {
    /// Appends `st`, after every entry already in (in segment and offset order).
    pub fn push(&mut self, st: Staged) {
        self.len += 1;
        if let Some(r) = self.runs.last_mut() {
            let next = r.at(r.count);
            if next.seg == st.seg && next.offset == st.offset && r.first.size == st.size && r.first.dim == st.dim && r.first.placed == st.placed {
                r.count += 1;
                return;
            }
        }
        self.runs.push(StagedRun { first: st, count: 1 });
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The entries, in staging order.
    pub fn iter(&self) -> impl Iterator<Item = Staged> + '_ {
        self.runs.iter().flat_map(|r| (0..r.count).map(move |k| r.at(k)))
    }

    /// Runs stored (what it costs in memory).
    pub fn runs(&self) -> usize {
        self.runs.len()
    }

    /// The entry of segment `seg` and its run, looking in run `hint` and
    /// the one after it before searching.
    fn find(&self, seg: usize, hint: usize) -> Option<(Staged, usize)> {
        let i = match (self.runs.get(hint), self.runs.get(hint.saturating_add(1))) {
            (Some(r), _) if r.holds(seg) => hint,
            (_, Some(r)) if r.holds(seg) => hint + 1,
            // Between the two: a direct segment.
            (Some(a), Some(b)) if a.first.seg < seg && seg < b.first.seg => return None,
            _ => self.runs.partition_point(|r| r.first.seg <= seg).checked_sub(1)?,
        };
        let r = &self.runs[i];
        r.holds(seg).then(|| (r.at(seg - r.first.seg), i))
    }
}

/// One layer's share of a transfer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LayerSchedule {
    /// Segments written straight into place (indices into `plan.segments`).
    pub direct: SegList,
    /// Segments that go through staging, in staging order.
    pub staged: StagedList,
    /// Bytes this layer's writes carry: what its flag waits for.
    pub wire_bytes: u64,
}

impl LayerSchedule {
    /// The layer's segments, direct and staged, in plan order (what the
    /// layer's checksums are computed over).
    pub fn segments(&self) -> Vec<usize> {
        let mut segs: Vec<usize> = self.direct.iter().chain(self.staged.iter().map(|st| st.seg)).collect();
        segs.sort_unstable();
        segs
    }
}

/// Where one write of a layer's batch reads and lands, before keys are known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteTarget {
    /// A run of a direct segment: source (rank, region, offset) to
    /// destination (rank, region, offset).
    Direct {
        /// Source rank and region.
        src: (u32, RegionId),
        /// Offset in the source region.
        src_offset: u64,
        /// Destination rank and region.
        dst: (u32, RegionId),
        /// Offset in the destination region.
        dst_offset: u64,
        /// Bytes.
        len: u64,
    },
    /// A strided segment whole: its first run, and `count` runs `src_stride`
    /// and `dst_stride` apart.
    Strided {
        /// Source rank and region.
        src: (u32, RegionId),
        /// Offset of the first run in the source region.
        src_offset: u64,
        /// Destination rank and region.
        dst: (u32, RegionId),
        /// Offset of the first run in the destination region.
        dst_offset: u64,
        /// Bytes per run.
        len: u64,
        /// Runs.
        count: u64,
        /// Distance between runs at the source.
        src_stride: u64,
        /// Distance between runs at the destination.
        dst_stride: u64,
    },
    /// A staged segment landing in place ([`Staged::placed`]): from the
    /// source's staging at `offset` to its destination runs, whole.
    Placed {
        /// Index into `plan.segments`.
        seg: usize,
        /// Offset in the source's staging buffer.
        offset: u64,
        /// Destination rank and region.
        dst: (u32, RegionId),
        /// Offset of its first run in the destination region.
        dst_offset: u64,
        /// Bytes.
        len: u64,
    },
    /// A staged segment: the same offset in both staging buffers.
    Staged {
        /// Index into `plan.segments`.
        seg: usize,
        /// Offset in both staging buffers.
        offset: u64,
        /// Bytes.
        len: u64,
    },
}

/// The whole transfer's schedule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    /// Per destination layer, in layer order.
    pub layers: Vec<LayerSchedule>,
    /// Every staged segment, in staging order.
    pub staged: StagedList,
    /// Bytes of each staging buffer.
    pub stage_bytes: u64,
    /// The run of `staged` last looked in (see [`Schedule::staged_of`]).
    pub hint: Hint,
}

impl Schedule {
    /// The schedule of `plan`: with `codec`, every segment is staged
    /// (converted rows); else only the packed ones.
    pub fn new(model: &ModelSpec, format: &CacheFormat, plan: &Plan, codec: Option<Codec>) -> Result<Schedule, ScheduleError> {
        if let Some(c) = codec {
            c.element_bytes(format).map_err(|e| ScheduleError::Codec(e.to_string()))?;
        }
        let n = model.layers.len();
        let mut layers = vec![LayerSchedule::default(); n];
        let mut staged = StagedList::default();
        let mut offset = 0;
        // Each layer's tensors once, not once per segment.
        let shapes: Vec<_> = model.layers.iter().map(|l| l.tensors()).collect();
        for (i, s) in plan.segments.iter().enumerate() {
            let layer = s.dst_region.layer as usize;
            let ls = layers.get_mut(layer).ok_or(ScheduleError::NoLayer { seg: i, layer: s.dst_region.layer, layers: n })?;
            if codec.is_none() && s.mode != Mode::Packed {
                ls.direct.push(i);
                ls.wire_bytes += s.bytes();
                continue;
            }
            let dim = shapes[layer].iter().find(|t| t.tensor == s.dst_region.tensor).map(|t| t.dim).ok_or_else(|| {
                ScheduleError::NoTensor { seg: i, layer: s.dst_region.layer, tensor: format!("{:?}", s.dst_region.tensor) }
            })?;
            let size = match codec {
                Some(c) => {
                    let row = format.row_bytes(dim);
                    if s.len % row != 0 {
                        return Err(ScheduleError::PartialRows { seg: i, len: s.len, row });
                    }
                    s.len / row * s.count * c.encoded_row(dim)
                }
                None => s.bytes(),
            };
            let st = Staged { seg: i, offset, size, dim, placed: codec.is_none() && lands_in_place(&s) };
            ls.staged.push(st);
            ls.wire_bytes += size;
            staged.push(st);
            offset += size;
        }
        Ok(Schedule { layers, staged, stage_bytes: offset, hint: Hint::default() })
    }

    /// Where staged segment `seg` lies in staging; `None` for a direct one.
    pub fn staged_of(&self, seg: usize) -> Option<Staged> {
        // Staging order is plan order: a walk in plan order asks again in
        // the run of the last one found, or in the next, or for a direct
        // segment between the two.
        let (st, run) = self.staged.find(seg, self.hint.get())?;
        self.hint.set(run);
        Some(st)
    }

    /// Runs the schedule stores, its layers' and the whole transfer's
    /// (what it costs in memory, whatever the segment count).
    pub fn stored_runs(&self) -> usize {
        self.staged.runs() + self.layers.iter().map(|l| l.staged.runs() + l.direct.runs()).sum::<usize>()
    }

    /// Bytes every layer's writes carry together.
    pub fn wire_bytes(&self) -> u64 {
        self.layers.iter().map(|l| l.wire_bytes).sum()
    }

    /// The writes of `layer`, in order: its direct segments' runs, then its
    /// staged segments. Their lengths add up to the layer's `wire_bytes`.
    pub fn writes<'a>(&'a self, plan: &'a Plan, layer: usize) -> impl Iterator<Item = WriteTarget> + 'a {
        let ls = &self.layers[layer];
        let direct = ls.direct.iter().flat_map(move |i| {
            let s = plan.segments.at(i);
            let (src, dst) = ((s.src_rank, s.src_region), (s.dst_rank, s.dst_region));
            let strided = (s.mode == Mode::Strided).then_some(WriteTarget::Strided {
                src,
                src_offset: s.src_offset,
                dst,
                dst_offset: s.dst_offset,
                len: s.len,
                count: s.count,
                src_stride: s.src_stride,
                dst_stride: s.dst_stride,
            });
            let runs = s.runs().filter(move |_| s.mode != Mode::Strided);
            strided.into_iter().chain(runs.map(move |(so, dof)| WriteTarget::Direct { src, src_offset: so, dst, dst_offset: dof, len: s.len }))
        });
        direct.chain(ls.staged.iter().map(move |st| match st.placed {
            true => {
                let s = plan.segments.at(st.seg);
                WriteTarget::Placed { seg: st.seg, offset: st.offset, dst: (s.dst_rank, s.dst_region), dst_offset: s.dst_offset, len: st.size }
            }
            false => WriteTarget::Staged { seg: st.seg, offset: st.offset, len: st.size },
        }))
    }
}

/// Whether a packed segment lands in place ([`Staged::placed`], without a
/// codec): its destination runs lie back to back, and it is large enough
/// that a write of its own costs less than the unpack copy it saves.
pub fn lands_in_place(s: &Segment) -> bool {
    s.dst_contiguous() && s.bytes() >= PLACED_MIN_BYTES
}

/// The smallest segment that lands in place. Staged segments lie back to
/// back and go as one write; placed ones go a write each. Measured with
/// kvwire-soak over tcp (TP2 NHD -> TP1 HND, 4 layers, p50 ms of 3 runs
/// each, placed against staged): 1 MiB of 2 KiB segments 0.75-0.87
/// against 0.57-0.60 (512 writes against 4); 4 MiB of 8 KiB segments
/// (blocks of 64) 2.34-2.65 against 2.57-2.71; of 16 KiB (blocks of 128)
/// 2.37-2.47 against 2.49-2.70.
pub const PLACED_MIN_BYTES: u64 = 8 << 10;

/// Gathers (and encodes) a segment's runs from `read(offset, len)`.
pub fn pack(s: &Segment, st: &Staged, format: &CacheFormat, codec: Option<Codec>, mut read: impl FnMut(u64, u64) -> Option<Vec<u8>>) -> Option<Vec<u8>> {
    let mut raw = Vec::with_capacity(s.bytes() as usize);
    for (so, _) in s.runs() {
        raw.extend_from_slice(&read(so, s.len)?);
    }
    Some(match codec {
        Some(c) => codec::encode_rows(&raw, c.element_bytes(format).ok()?, st.dim as usize),
        None => raw,
    })
}

/// Decodes a staged segment's bytes back into its runs' bytes, in run order.
pub fn unpack(bytes: &[u8], st: &Staged, format: &CacheFormat, codec: Option<Codec>) -> Option<Vec<u8>> {
    Some(match codec {
        Some(c) => codec::decode_rows(bytes, c.element_bytes(format).ok()?, st.dim as usize),
        None => bytes.to_vec(),
    })
}
