//! The records of a campaign: one [`Point`] per measured point and one
//! [`Skipped`] per transport that could not run, each a JSONL line.

use kvwire_core::timing::Prediction;
use kvwire_transport::{Hop, Hops};
use serde::{Deserialize, Serialize};

/// Latency figures of a point, nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LatNs {
    /// Fastest transfer.
    pub min: u64,
    /// Median.
    pub p50: u64,
    /// 99th percentile; `None` below 100 transfers (it would be the max).
    pub p99: Option<u64>,
    /// 99.9th percentile; `None` below 1000 transfers.
    pub p999: Option<u64>,
    /// Slowest transfer.
    pub max: u64,
}

/// One in-run baseline.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Baseline {
    /// `memcpy`, `tcp socket pair` or `ib_write_bw`.
    pub name: String,
    /// Its per-stream throughput, GB/s.
    pub gbps: f64,
}

/// One hop's histogram summary over a point.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct HopStat {
    /// Samples.
    pub count: u64,
    /// Total time in the hop, ns.
    pub sum_ns: u64,
    /// Median, ns.
    pub p50_ns: u64,
    /// 99th percentile, ns; `None` below 100 samples.
    pub p99_ns: Option<u64>,
    /// Largest sample, ns (0 in records written before it was kept).
    #[serde(default)]
    pub max_ns: u64,
    /// Bytes the hop handled.
    pub bytes: u64,
}

impl HopStat {
    pub(super) fn of(hops: &Hops, hop: Hop) -> HopStat {
        let s = hops.summary(hop);
        let p99_ns = super::figures::supports(s.count, 0.99).then_some(s.p99_ns);
        HopStat { count: s.count, sum_ns: s.sum_ns, p50_ns: s.p50_ns, p99_ns, max_ns: s.max_ns, bytes: s.bytes }
    }

    /// Effective bandwidth, GB/s (bytes / total time in the hop); `None` without bytes or time.
    pub fn gbps(&self) -> Option<f64> {
        (self.bytes > 0 && self.sum_ns > 0).then(|| self.bytes as f64 / self.sum_ns as f64)
    }
}

/// The four hops a campaign point records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PointHops {
    /// CPU time to post (source).
    pub post: HopStat,
    /// Post → completion seen (source), clipped at the transfer's end (its
    /// destination flag seen): a late ack does not make a hop outlast its
    /// transfer.
    pub wire: HopStat,
    /// Remote completion seen → bytes counted (destination).
    pub place: HopStat,
    /// Flag published → seen (destination).
    pub notify: HopStat,
}

impl PointHops {
    /// (name, figures) in path order.
    pub fn list(&self) -> [(&'static str, HopStat); 4] {
        [("post", self.post), ("wire", self.wire), ("place", self.place), ("notify", self.notify)]
    }
}

/// One measured point: a JSONL line of campaign.jsonl.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Point {
    /// Always `point`.
    pub kind: &'static str,
    /// Transport name.
    pub transport: &'static str,
    /// Bytes per transfer.
    pub size: u64,
    /// Transfers at once.
    pub concurrency: u32,
    /// Bytes per write, as used: `min(--chunk, size)`.
    pub chunk: u64,
    /// Most batches outstanding per transfer.
    pub depth: u32,
    /// Timed transfers per connection.
    pub iterations: u32,
    /// Per-transfer effective bandwidth: bytes / summed transfer time, GB/s.
    pub gbps_avg: f64,
    /// The fastest transfer's bandwidth, GB/s.
    pub gbps_peak: f64,
    /// What the shared link carried: round bytes / round wall time, GB/s.
    pub gbps_aggregate: f64,
    /// Per-transfer latency.
    pub lat_ns: LatNs,
    /// Logical bytes of the timed transfers.
    pub payload_bytes: u64,
    /// Payload plus kvwire framing of the timed transfers.
    pub wire_bytes: u64,
    /// In-run baselines; the last is the transport's own raw path.
    pub baselines: Vec<Baseline>,
    /// Hop histograms of this point's endpoints.
    pub hops: PointHops,
    /// The timing model per transfer on average, against the mean latency
    /// ([`super::figures::model`]).
    pub model: Prediction,
}

impl Point {
    /// `gbps_avg` over the last baseline; `gbps_aggregate` over
    /// `ib_write_bw`'s, which is its QPs' sum.
    pub fn ratio(&self) -> Option<f64> {
        let ours = |b: &Baseline| if b.name == "ib_write_bw" { self.gbps_aggregate } else { self.gbps_avg };
        self.baselines.last().filter(|b| b.gbps > 0.0).map(|b| ours(b) / b.gbps)
    }
}

/// A transport whose points could not run, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Skipped {
    /// Always `skipped`.
    pub kind: &'static str,
    /// Transport name.
    pub transport: &'static str,
    /// Why.
    pub reason: String,
}
