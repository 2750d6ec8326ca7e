//! Staged segments: the plan's packed segments (many small runs gathered
//! into one write) and, with a codec, every segment (converted rows). Both
//! sides compute the same layout from the same plan, so a staged segment's
//! offset in the source's staging buffer is also its offset in the
//! destination's.

use kvwire_core::codec::{self, Codec};
use kvwire_core::plan::{Mode, Plan, Segment};
use kvwire_core::{CacheFormat, ModelSpec};
use kvwire_transport::HostMem;

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
}

/// The staging layout of `plan`: with `codec`, every segment; else the packed ones.
pub fn layout(model: &ModelSpec, format: &CacheFormat, plan: &Plan, codec: Option<Codec>) -> Result<Vec<Staged>, String> {
    if let Some(c) = codec {
        c.element_bytes(format).map_err(|e| e.to_string())?;
    }
    let mut out = Vec::new();
    let mut offset = 0;
    for (i, s) in plan.segments.iter().enumerate() {
        if codec.is_none() && s.mode != Mode::Packed {
            continue;
        }
        let dim = model.layers[s.dst_region.layer as usize]
            .tensors()
            .iter()
            .find(|t| t.tensor == s.dst_region.tensor)
            .map(|t| t.dim)
            .ok_or_else(|| format!("segment {i}: layer {} has no {:?} tensor", s.dst_region.layer, s.dst_region.tensor))?;
        let size = match codec {
            Some(c) => {
                let row = format.row_bytes(dim);
                if s.len % row != 0 {
                    return Err(format!("segment {i}: runs of {} bytes are not whole rows of {row}", s.len));
                }
                s.len / row * s.count * c.encoded_row(dim)
            }
            None => s.bytes(),
        };
        out.push(Staged { seg: i, offset, size, dim });
        offset += size;
    }
    Ok(out)
}

/// Total staging bytes.
pub fn total(staged: &[Staged]) -> u64 {
    staged.last().map_or(0, |s| s.offset + s.size)
}

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

/// Reads `len` bytes of a mapping.
pub fn read(mem: &HostMem, offset: u64, len: u64) -> Option<Vec<u8>> {
    let mut b = vec![0u8; len as usize];
    mem.read(offset, &mut b).ok()?;
    Some(b)
}
