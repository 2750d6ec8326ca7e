//! Transfer codecs: convert rows before the write, convert back after.
//!
//! `fp8_e4m3_row`: each token-head row of an fp32 or bf16 cache becomes
//! `dim` fp8 e4m3 bytes (the "fn" variant: no infinities, max 448,
//! round-to-nearest-even, saturating) followed by one little-endian f32
//! scale = max|x| / 448. Lossy: a transfer through it is judged by the
//! decode logits, not by bytes.

use crate::format::CacheFormat;

/// Largest finite e4m3fn value.
const E4M3_MAX: f32 = 448.0;

/// A transfer codec.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Codec {
    /// fp8 e4m3 elements with one f32 scale per row.
    Fp8E4m3Row,
}

/// Why a codec cannot be used.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum CodecError {
    /// Unknown codec name.
    #[error("unknown codec `{0}` (known: fp8_e4m3_row)")]
    Unknown(String),
    /// The cache format is not one the codec converts.
    #[error("codec {codec} converts fp32 or bf16 caches, not {format}")]
    Format {
        /// Codec name.
        codec: &'static str,
        /// Cache format id.
        format: String,
    },
}

impl Codec {
    /// Parses a codec name.
    pub fn parse(name: &str) -> Result<Codec, CodecError> {
        match name {
            "fp8_e4m3_row" => Ok(Codec::Fp8E4m3Row),
            other => Err(CodecError::Unknown(other.into())),
        }
    }

    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            Codec::Fp8E4m3Row => "fp8_e4m3_row",
        }
    }

    /// Bytes per element of `format` this codec reads, or an error.
    pub fn element_bytes(self, format: &CacheFormat) -> Result<usize, CodecError> {
        match format.name {
            "fp32" => Ok(4),
            "bf16" => Ok(2),
            _ => Err(CodecError::Format { codec: self.name(), format: format.id() }),
        }
    }

    /// Encoded size of one row of `dim` elements.
    pub fn encoded_row(self, dim: u32) -> u64 {
        u64::from(dim) + 4
    }
}

fn load(src: &[u8], elem: usize, i: usize) -> f32 {
    match elem {
        4 => f32::from_le_bytes(src[i * 4..i * 4 + 4].try_into().expect("4 bytes")),
        _ => f32::from_bits(u32::from(u16::from_le_bytes([src[i * 2], src[i * 2 + 1]])) << 16),
    }
}

fn store(dst: &mut [u8], elem: usize, i: usize, v: f32) {
    match elem {
        4 => dst[i * 4..i * 4 + 4].copy_from_slice(&v.to_le_bytes()),
        _ => {
            // Round to nearest even into bf16.
            let b = v.to_bits();
            let r = b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16;
            dst[i * 2..i * 2 + 2].copy_from_slice(&(r as u16).to_le_bytes());
        }
    }
}

/// f32 → e4m3fn, round to nearest even, saturating at ±448.
pub fn to_e4m3(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    if a.is_nan() {
        return 0x7F;
    }
    if a >= E4M3_MAX {
        return sign | 0x7E;
    }
    // Smallest subnormal is 2^-9; values are multiples of 2^-9 below 2^-6.
    if a < 2f32.powi(-6) {
        let q = (a / 2f32.powi(-9)).round_ties_even() as u8; // 0..=8
        return sign | q;
    }
    let e = a.log2().floor() as i32; // -6..=8
    let m = a / 2f32.powi(e) - 1.0; // [0, 1)
    let mut q = (m * 8.0).round_ties_even() as i32;
    let mut e = e;
    if q == 8 {
        q = 0;
        e += 1;
    }
    let code = ((e + 7) as u8) << 3 | q as u8;
    sign | code.min(0x7E)
}

/// e4m3fn → f32.
pub fn from_e4m3(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((b >> 3) & 0x0F) as i32;
    let m = (b & 0x07) as f32;
    if e == 0x0F && b & 0x07 == 0x07 {
        return f32::NAN;
    }
    if e == 0 {
        sign * m * 2f32.powi(-9)
    } else {
        sign * (1.0 + m / 8.0) * 2f32.powi(e - 7)
    }
}

/// Encodes one row (`dim` elements of `elem` bytes) into `dim + 4` bytes.
pub fn encode_row(src: &[u8], elem: usize, dim: usize, dst: &mut [u8]) {
    let max = (0..dim).map(|i| load(src, elem, i).abs()).fold(0.0f32, f32::max);
    let scale = if max > 0.0 { max / E4M3_MAX } else { 1.0 };
    for (i, d) in dst[..dim].iter_mut().enumerate() {
        *d = to_e4m3(load(src, elem, i) / scale);
    }
    dst[dim..dim + 4].copy_from_slice(&scale.to_le_bytes());
}

/// Decodes one row back into `dim` elements of `elem` bytes.
pub fn decode_row(src: &[u8], elem: usize, dim: usize, dst: &mut [u8]) {
    let scale = f32::from_le_bytes(src[dim..dim + 4].try_into().expect("4 bytes"));
    for (i, &b) in src[..dim].iter().enumerate() {
        store(dst, elem, i, from_e4m3(b) * scale);
    }
}

/// Encodes whole rows: `src.len()` must be a multiple of `dim * elem`.
pub fn encode_rows(src: &[u8], elem: usize, dim: usize) -> Vec<u8> {
    let row = dim * elem;
    let mut out = vec![0u8; src.len() / row * (dim + 4)];
    for (s, d) in src.chunks_exact(row).zip(out.chunks_exact_mut(dim + 4)) {
        encode_row(s, elem, dim, d);
    }
    out
}

/// Decodes whole rows back.
pub fn decode_rows(src: &[u8], elem: usize, dim: usize) -> Vec<u8> {
    let mut out = vec![0u8; src.len() / (dim + 4) * dim * elem];
    for (s, d) in src.chunks_exact(dim + 4).zip(out.chunks_exact_mut(dim * elem)) {
        decode_row(s, elem, dim, d);
    }
    out
}
