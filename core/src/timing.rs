//! The timing model (DESIGN.md §6): what a transfer's hops predict, next to
//! what was measured.
//!
//! A transfer moves in `chunks` (here: layers) through a chain of stages
//! (pack, post, wire, unpack, verify, …), each with a total busy time.
//! - sequential prediction: setup + the sum of every stage's total — no
//!   overlap at all;
//! - pipelined estimate: setup + one chunk through every stage (fill and
//!   drain) + (chunks − 1) × the slowest stage's time per chunk — perfect
//!   overlap of equal chunks, not a promise;
//! - lower bound: setup + the slowest stage's total. Every stage works
//!   through its chunks one at a time after setup, so no schedule beats it;
//!   the fill/drain estimate is not a bound (chunks are not equal: a last
//!   chunk verified faster than the average drains faster than estimated).
//!
//! The stage with the largest total bounds the transfer. A measured time
//! between the pipelined estimate and the sequential figure gives the
//! overlap achieved: `(sequential − measured) / (sequential − pipelined)`.
//! A time below the lower bound is a model error ([`Fit::BelowLowerBound`]),
//! never "100% overlap"; one between the bound and the estimate beat the
//! estimate ([`Fit::BelowEstimate`]); one above the sequential figure is
//! time no hop accounts for.
//! A stage's total is wall time: concurrent work on one hop (several ranks
//! at once) counts as the union of its intervals ([`union_ns`]), not their
//! sum.
//!
//! [`staged`] models a device-resident cache moved without GPUDirect: the
//! bytes are cut into staging-ring chunks and each chunk crosses a chain of
//! hops (`stage` device → host, `wire`, `device_complete` host → device),
//! each at its own rate. Its pipelined figure replays that chain chunk by
//! chunk, so the ring's depth and a short last chunk count.

use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// One stage's busy time over the whole transfer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Stage {
    /// Hop name (`wire`, `verify`, …).
    pub hop: String,
    /// Total busy nanoseconds.
    pub total_ns: u64,
    /// Bytes it handled.
    pub bytes: u64,
}

impl Stage {
    /// Effective bandwidth, GB/s (bytes / busy time); 0 when idle.
    pub fn gbps(&self) -> f64 {
        if self.total_ns == 0 {
            0.0
        } else {
            self.bytes as f64 / self.total_ns as f64
        }
    }
}

/// Both predictions, the bounding stage, and (when given) the measurement.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    /// Chunks the transfer was split into.
    pub chunks: u64,
    /// Non-overlapped setup (handshake, planning), ns.
    pub setup_ns: u64,
    /// Sum of every stage plus setup, ns.
    pub sequential_ns: u64,
    /// Pipelined estimate (fill, drain, equal chunks), ns.
    pub pipelined_ns: u64,
    /// Lower bound: setup + the slowest stage's total, ns.
    pub lower_ns: u64,
    /// The stage with the largest total.
    pub bounding: Option<String>,
    /// Measured end to end, ns.
    pub measured_ns: Option<u64>,
    /// Share of the possible overlap achieved, 0..=1: only for a
    /// measurement between the bounds ([`Fit::Overlap`]).
    pub overlap: Option<f64>,
    /// Where the measurement fell against the bounds.
    pub fit: Option<Fit>,
}

/// Where a measurement falls against a [`Prediction`]'s bounds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Fit {
    /// Between the bounds: the share of the possible overlap achieved.
    Overlap {
        /// 0..=1.
        share: f64,
    },
    /// At or above the lower bound but faster than the pipelined estimate:
    /// the chunks were not equal; no overlap share is claimed.
    BelowEstimate {
        /// Measured, ns.
        measured_ns: u64,
        /// The estimate it beat, ns.
        pipelined_ns: u64,
    },
    /// Faster than the lower bound: the model is wrong (a hop counted
    /// twice, concurrent work summed, a span that is not serial).
    BelowLowerBound {
        /// Measured, ns.
        measured_ns: u64,
        /// The lower bound it undercut, ns.
        lower_ns: u64,
    },
    /// Slower than the sequential prediction: time outside every timed hop
    /// (waits, wake-ups, control round trips).
    AboveSequential {
        /// Measured, ns.
        measured_ns: u64,
        /// The sequential prediction, ns.
        sequential_ns: u64,
    },
}

/// Wall time covered by `spans` (start, end), ns: the union of the
/// intervals, so concurrent work counts once. Empty or inverted spans add
/// nothing.
pub fn union_ns(spans: &[(u64, u64)]) -> u64 {
    let mut s: Vec<(u64, u64)> = spans.iter().copied().filter(|(a, b)| b > a).collect();
    s.sort_unstable();
    let (mut total, mut reach) = (0u64, 0u64);
    for (a, b) in s {
        let a = a.max(reach);
        if b > a {
            total += b - a;
            reach = b;
        }
    }
    total
}

/// Predicts a transfer of `chunks` chunks through `stages` after `setup_ns`.
pub fn predict(stages: &[Stage], chunks: u64, setup_ns: u64) -> Prediction {
    let chunks = chunks.max(1);
    let sequential_ns = setup_ns + stages.iter().map(|s| s.total_ns).sum::<u64>();
    let per_chunk: Vec<u64> = stages.iter().map(|s| s.total_ns / chunks).collect();
    let slowest = per_chunk.iter().copied().max().unwrap_or(0);
    let pipelined_ns = setup_ns + per_chunk.iter().sum::<u64>() + (chunks - 1) * slowest;
    let bounding = stages.iter().filter(|s| s.total_ns > 0).max_by_key(|s| s.total_ns).map(|s| s.hop.clone());
    let lower_ns = setup_ns + stages.iter().map(|s| s.total_ns).max().unwrap_or(0);
    Prediction { chunks, setup_ns, sequential_ns, pipelined_ns, lower_ns, bounding, measured_ns: None, overlap: None, fit: None }
}

impl Prediction {
    /// Adds the measured end-to-end time and where it fell: the overlap
    /// achieved when between the bounds, else which bound it crossed.
    pub fn measured(mut self, ns: u64) -> Prediction {
        self.measured_ns = Some(ns);
        self.fit = if ns < self.lower_ns {
            Some(Fit::BelowLowerBound { measured_ns: ns, lower_ns: self.lower_ns })
        } else if ns < self.pipelined_ns {
            Some(Fit::BelowEstimate { measured_ns: ns, pipelined_ns: self.pipelined_ns })
        } else if ns > self.sequential_ns {
            Some(Fit::AboveSequential { measured_ns: ns, sequential_ns: self.sequential_ns })
        } else if self.sequential_ns > self.pipelined_ns {
            Some(Fit::Overlap { share: (self.sequential_ns - ns) as f64 / (self.sequential_ns - self.pipelined_ns) as f64 })
        } else {
            None
        };
        self.overlap = match self.fit {
            Some(Fit::Overlap { share }) => Some(share),
            _ => None,
        };
        self
    }
}

/// Layer-wise transfer against per-layer compute: layer `L`'s bytes can only
/// move once its compute finished, and after the previous layer's bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LayerOverlap {
    /// Sum of per-layer transfer times, ns.
    pub transfer_ns: u64,
    /// Transfer time hidden under compute, ns.
    pub overlapped_ns: u64,
    /// Time from the end of the last layer's compute to its bytes landing:
    /// what stays on the critical path, ns.
    pub tail_ns: u64,
}

/// Simulates layer-wise transfer: `compute[L]` and `transfer[L]` are layer
/// `L`'s compute and transfer times (same length).
pub fn layerwise(compute: &[u64], transfer: &[u64]) -> LayerOverlap {
    let (mut compute_end, mut transfer_end) = (0u64, 0u64);
    for (c, t) in compute.iter().zip(transfer) {
        compute_end += c;
        transfer_end = transfer_end.max(compute_end) + t;
    }
    let transfer_ns: u64 = transfer.iter().sum();
    let tail_ns = transfer_end.saturating_sub(compute_end);
    LayerOverlap { transfer_ns, overlapped_ns: transfer_ns.saturating_sub(tail_ns), tail_ns }
}

/// Layer-wise transfer through a path of hops against per-layer compute:
/// layer `L` enters the first hop once its compute finished, each hop takes
/// one layer at a time, and `hops[k]` is hop `k`'s time per layer. The
/// tail is the last layer's own trip through every hop (plus any queue in
/// front of it), not the gap between two layers' flags, which a pipelined
/// transfer shrinks to its slowest hop's share.
pub fn layerwise_hops(compute: &[u64], hops: &[u64]) -> LayerOverlap {
    let mut free = vec![0u64; hops.len()];
    let (mut compute_end, mut done) = (0u64, 0u64);
    for c in compute {
        compute_end += c;
        let mut t = compute_end;
        for (h, f) in hops.iter().zip(free.iter_mut()) {
            t = t.max(*f) + h;
            *f = t;
        }
        done = t;
    }
    let transfer_ns = hops.iter().sum::<u64>() * compute.len() as u64;
    let tail_ns = done.saturating_sub(compute_end);
    LayerOverlap { transfer_ns, overlapped_ns: transfer_ns.saturating_sub(tail_ns), tail_ns }
}

/// One hop of a chunked path, as a rate: a chunk of `n` bytes takes
/// `per_chunk_ns + n / bytes_per_sec` (rounded up to whole ns).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HopRate {
    /// Hop name (`stage`, `wire`, `device_complete`, …).
    pub hop: String,
    /// Bytes per second (1 GB/s = 1e9).
    pub bytes_per_sec: u64,
    /// Fixed cost of every chunk (copy launch, post), ns.
    pub per_chunk_ns: u64,
}

impl HopRate {
    /// The rate a measured stage achieved (bytes over busy time), with no
    /// fixed per-chunk cost; None when the stage moved nothing. Samples
    /// that overlap (copies queued behind each other on one stream) add up
    /// to more than the busy time, so such a hop reads slower than it is.
    pub fn from_stage(s: &Stage) -> Option<HopRate> {
        if s.bytes == 0 || s.total_ns == 0 {
            return None;
        }
        let bps = u128::from(s.bytes) * 1_000_000_000 / u128::from(s.total_ns);
        Some(HopRate { hop: s.hop.clone(), bytes_per_sec: u64::try_from(bps).unwrap_or(u64::MAX).max(1), per_chunk_ns: 0 })
    }

    /// Time for one chunk of `len` bytes, ns.
    pub fn chunk_ns(&self, len: u64) -> u64 {
        let ns = (u128::from(len) * 1_000_000_000).div_ceil(u128::from(self.bytes_per_sec));
        u64::try_from(ns).unwrap_or(u64::MAX).saturating_add(self.per_chunk_ns)
    }
}

/// The staging rings between consecutive hops.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Ring {
    /// Bytes per chunk (and per slot).
    pub chunk: u64,
    /// Slots in each ring. A chunk takes a slot when the hop before the
    /// ring starts on it and frees it once the hop after the ring finished
    /// with it (the source's slot waits for the wire completion, the
    /// destination's for the host → device copy).
    pub slots: u32,
}

/// Why [`staged`] refused its input.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum StagedError {
    /// The ring's chunk size is 0.
    #[error("staging chunk of 0 bytes")]
    ZeroChunk,
    /// The ring has no slot: nothing could ever be staged.
    #[error("staging ring of 0 slots")]
    ZeroSlots,
    /// A hop moves 0 bytes per second: it would never finish.
    #[error("hop `{0}` has a rate of 0 bytes/s")]
    ZeroRate(String),
}

/// A staged transfer's per-hop totals and its [`Prediction`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StagedPrediction {
    /// Each hop's busy time over the whole transfer, in path order.
    pub stages: Vec<Stage>,
    /// Sequential sum, pipelined schedule and bounding hop.
    pub prediction: Prediction,
}

/// Predicts `bytes` cut into `ring.chunk`-byte chunks through `hops`, in
/// order, after `setup_ns`.
///
/// - sequential: setup + every hop's total (each hop moves everything
///   before the next starts);
/// - pipelined: the end of the last chunk's last hop when every hop works
///   on one chunk at a time, in order, as early as the hop before it and a
///   free ring slot allow. With enough slots this is fill/drain plus
///   `(chunks − 1) ×` the slowest hop's chunk time, as in [`predict`]; with
///   one slot a chunk's hop waits for the previous chunk's next hop.
///
/// Costs O(chunks × hops).
pub fn staged(hops: &[HopRate], ring: Ring, bytes: u64, setup_ns: u64) -> Result<StagedPrediction, StagedError> {
    if ring.chunk == 0 {
        return Err(StagedError::ZeroChunk);
    }
    if ring.slots == 0 {
        return Err(StagedError::ZeroSlots);
    }
    if let Some(h) = hops.iter().find(|h| h.bytes_per_sec == 0) {
        return Err(StagedError::ZeroRate(h.hop.clone()));
    }
    let chunks = bytes.div_ceil(ring.chunk);
    let slots = ring.slots as usize;
    let m = hops.len();
    let mut totals = vec![0u64; m];
    // Finish times of the last `slots` chunks, newest at the back.
    let mut recent: VecDeque<Vec<u64>> = VecDeque::with_capacity(slots + 1);
    let mut end = 0u64;
    for i in 0..chunks {
        let len = (bytes - i * ring.chunk).min(ring.chunk);
        let mut done = vec![0u64; m];
        for (j, h) in hops.iter().enumerate() {
            let mut start = if j > 0 { done[j - 1] } else { 0 };
            if let Some(prev) = recent.back() {
                start = start.max(prev[j]);
            }
            // The ring after hop j holds `slots` chunks: chunk i − slots must have left hop j + 1.
            if j + 1 < m && recent.len() == slots {
                start = start.max(recent[0][j + 1]);
            }
            let t = h.chunk_ns(len);
            done[j] = start.saturating_add(t);
            totals[j] = totals[j].saturating_add(t);
        }
        end = done.last().copied().unwrap_or(0);
        if recent.len() == slots {
            recent.pop_front();
        }
        recent.push_back(done);
    }
    let stages: Vec<Stage> = hops.iter().zip(&totals).map(|(h, &total_ns)| Stage { hop: h.hop.clone(), total_ns, bytes }).collect();
    let sequential_ns = totals.iter().fold(setup_ns, |a, &t| a.saturating_add(t));
    let bounding = stages.iter().filter(|s| s.total_ns > 0).max_by_key(|s| s.total_ns).map(|s| s.hop.clone());
    let lower_ns = setup_ns.saturating_add(totals.iter().copied().max().unwrap_or(0));
    let prediction = Prediction {
        chunks,
        setup_ns,
        sequential_ns,
        pipelined_ns: setup_ns.saturating_add(end),
        lower_ns,
        bounding,
        measured_ns: None,
        overlap: None,
        fit: None,
    };
    Ok(StagedPrediction { stages, prediction })
}
