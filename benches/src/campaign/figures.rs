//! A point's figures from its timed transfers, and the size arithmetic the
//! campaign shares (pure).

use super::records::{LatNs, PointHops};
use hdrhistogram::Histogram;
use kvwire_core::timing::{predict, Fit, Prediction, Stage};

/// One timed transfer, as nanoseconds since a common origin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    /// First post.
    pub start_ns: u64,
    /// Destination flag seen.
    pub end_ns: u64,
    /// Framing the connection sent and got back for this transfer's
    /// writes, as the connection reports it.
    pub framing: u64,
    /// Time with a write of this transfer in flight (post returned →
    /// completion seen, clipped at `end_ns`): the union of its writes'
    /// spans, so writes in flight together count once.
    pub wire_ns: u64,
}

impl Sample {
    fn took(&self) -> u64 {
        self.end_ns.saturating_sub(self.start_ns).max(1)
    }
}

/// Figures of a point from its rounds (each a list of concurrent transfers of `size` bytes).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Figures {
    /// Bytes / summed transfer time, GB/s.
    pub gbps_avg: f64,
    /// Fastest transfer, GB/s.
    pub gbps_peak: f64,
    /// Round bytes / round wall time, GB/s.
    pub gbps_aggregate: f64,
    /// Latency.
    pub lat: LatNs,
}

/// Whether `n` samples support quantile `q`: at least `1 / (1 - q)` of
/// them (p99 needs 100, p99.9 1000). With fewer, the "percentile" is only
/// the max under another name.
pub fn supports(n: u64, q: f64) -> bool {
    n as f64 * (1.0 - q) >= 1.0 - 1e-9
}

/// Computes a point's figures. `rounds` must hold at least one transfer.
pub fn figures(size: u64, rounds: &[Vec<Sample>]) -> Figures {
    let mut hist = Histogram::<u64>::new_with_bounds(1, 3_600_000_000_000, 3).expect("valid histogram bounds");
    let (mut n, mut sum, mut fastest) = (0u64, 0u64, u64::MAX);
    let (mut round_bytes, mut round_ns) = (0u64, 0u64);
    for round in rounds.iter().filter(|r| !r.is_empty()) {
        for s in round {
            hist.saturating_record(s.took());
            n += 1;
            sum += s.took();
            fastest = fastest.min(s.took());
        }
        let first = round.iter().map(|s| s.start_ns).min().expect("non-empty");
        let last = round.iter().map(|s| s.end_ns).max().expect("non-empty");
        round_bytes += size * round.len() as u64;
        round_ns += last.saturating_sub(first).max(1);
    }
    let gb = |bytes: u64, ns: u64| if ns == 0 { 0.0 } else { bytes as f64 / ns as f64 };
    Figures {
        gbps_avg: gb(size * n, sum),
        gbps_peak: if n == 0 { 0.0 } else { gb(size, fastest) },
        gbps_aggregate: gb(round_bytes, round_ns),
        lat: LatNs {
            min: hist.min(),
            p50: hist.value_at_quantile(0.50),
            p99: supports(n, 0.99).then(|| hist.value_at_quantile(0.99)),
            p999: supports(n, 0.999).then(|| hist.value_at_quantile(0.999)),
            max: hist.max(),
        },
    }
}

/// The timing model of a point, per transfer on average (DESIGN.md §6,
/// [`kvwire_core::timing`]): chunks are the transfer's writes, stages its
/// hops — `post` (source CPU), `wire` (time with a write in flight, its
/// [`Sample::wire_ns`]), `place` (destination), `notify` (flag published →
/// seen) — each the point's busy total over its transfers, and the
/// measurement the mean latency.
///
/// Every hop's time lies inside its transfer and one hop's work for one
/// transfer is serial (one posting thread, one receiving thread per
/// connection), so each stage's mean is at most the mean latency: the
/// lower bound holds, and a mean below it is a model error, never overlap.
pub fn model(size: u64, chunk: u64, rounds: &[Vec<Sample>], hops: &PointHops) -> Prediction {
    let samples: Vec<&Sample> = rounds.iter().flatten().collect();
    let n = (samples.len() as u64).max(1);
    let stage = |hop: &str, total_ns: u64, bytes: u64| Stage { hop: hop.into(), total_ns: total_ns / n, bytes: bytes / n };
    let stages = [
        stage("post", hops.post.sum_ns, hops.post.bytes),
        stage("wire", samples.iter().map(|s| s.wire_ns).sum(), size * n),
        stage("place", hops.place.sum_ns, hops.place.bytes),
        stage("notify", hops.notify.sum_ns, 0),
    ];
    let mean = samples.iter().map(|s| s.took()).sum::<u64>() / n;
    predict(&stages, size.div_ceil(chunk.max(1)), 0).measured(mean)
}

/// Where a point's mean fell against its model, in a few words: the
/// overlap achieved between the bounds, `beat estimate` (at or above the
/// bound, below the equal-chunk estimate), `above sequential` (time no hop
/// holds), or `MODEL ERROR` (below the lower bound).
pub fn fit_label(m: &Prediction) -> String {
    match m.fit {
        Some(Fit::Overlap { share }) => format!("overlap {:.0}%", share * 100.0),
        Some(Fit::BelowEstimate { .. }) => "beat estimate".into(),
        Some(Fit::AboveSequential { .. }) => "above sequential".into(),
        Some(Fit::BelowLowerBound { .. }) => "MODEL ERROR".into(),
        None => "-".into(),
    }
}

/// A loud line for a point whose mean undercut its lower bound, naming
/// the numbers; `None` when the model holds.
pub fn model_error(what: &str, m: &Prediction) -> Option<String> {
    match m.fit {
        Some(Fit::BelowLowerBound { measured_ns, lower_ns }) => Some(format!(
            "MODEL ERROR: {what}: mean latency {measured_ns} ns is below the lower bound {lower_ns} ns ({} per transfer): \
             a hop's time is counted where it did not run serially",
            m.bounding.as_deref().unwrap_or("no hop")
        )),
        _ => None,
    }
}

/// The write lengths of one `size`-byte transfer split into `chunk`-byte writes.
pub fn chunks(size: u64, chunk: u64) -> impl Iterator<Item = (u64, u64)> {
    let chunk = chunk.max(1);
    (0..size.div_ceil(chunk)).map(move |i| (i * chunk, chunk.min(size - i * chunk)))
}

/// `4K`, `64M`, `1G` for whole binary units, else bytes.
pub fn size_label(n: u64) -> String {
    for (shift, unit) in [(30, 'G'), (20, 'M'), (10, 'K')] {
        if n >= 1 << shift && n % (1 << shift) == 0 {
            return format!("{}{unit}", n >> shift);
        }
    }
    n.to_string()
}
