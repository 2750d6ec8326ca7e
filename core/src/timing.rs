//! The timing model (DESIGN.md §6): what a transfer's hops predict, next to
//! what was measured.
//!
//! A transfer moves in `chunks` (here: layers) through a chain of stages
//! (pack, post, wire, unpack, verify, …), each with a total busy time.
//! - sequential prediction: setup + the sum of every stage's total — no
//!   overlap at all;
//! - pipelined lower bound: setup + one chunk through every stage (fill and
//!   drain) + (chunks − 1) × the slowest stage's time per chunk — perfect
//!   overlap, not a promise.
//!
//! The stage with the largest total bounds the transfer. A measured time
//! between the two bounds gives the overlap achieved:
//! `(sequential − measured) / (sequential − pipelined)`.

use serde::Serialize;

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
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Prediction {
    /// Chunks the transfer was split into.
    pub chunks: u64,
    /// Non-overlapped setup (handshake, planning), ns.
    pub setup_ns: u64,
    /// Sum of every stage plus setup, ns.
    pub sequential_ns: u64,
    /// Pipelined lower bound, ns.
    pub pipelined_ns: u64,
    /// The stage with the largest total.
    pub bounding: Option<String>,
    /// Measured end to end, ns.
    pub measured_ns: Option<u64>,
    /// Share of the possible overlap achieved, 0..=1 (None without a measurement or room to overlap).
    pub overlap: Option<f64>,
}

/// Predicts a transfer of `chunks` chunks through `stages` after `setup_ns`.
pub fn predict(stages: &[Stage], chunks: u64, setup_ns: u64) -> Prediction {
    let chunks = chunks.max(1);
    let sequential_ns = setup_ns + stages.iter().map(|s| s.total_ns).sum::<u64>();
    let per_chunk: Vec<u64> = stages.iter().map(|s| s.total_ns / chunks).collect();
    let slowest = per_chunk.iter().copied().max().unwrap_or(0);
    let pipelined_ns = setup_ns + per_chunk.iter().sum::<u64>() + (chunks - 1) * slowest;
    let bounding = stages.iter().filter(|s| s.total_ns > 0).max_by_key(|s| s.total_ns).map(|s| s.hop.clone());
    Prediction { chunks, setup_ns, sequential_ns, pipelined_ns, bounding, measured_ns: None, overlap: None }
}

impl Prediction {
    /// Adds the measured end-to-end time and the overlap it achieved.
    pub fn measured(mut self, ns: u64) -> Prediction {
        self.measured_ns = Some(ns);
        if self.sequential_ns > self.pipelined_ns {
            let o = (self.sequential_ns as f64 - ns as f64) / (self.sequential_ns - self.pipelined_ns) as f64;
            self.overlap = Some(o.clamp(0.0, 1.0));
        }
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
