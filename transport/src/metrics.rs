//! Hop histograms: each hop of the path timed into its own hdrhistogram (ns).

use hdrhistogram::Histogram;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// The hops of DESIGN.md §1, in path order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Hop {
    /// Gather source slices into staging.
    Pack,
    /// Device → pinned host copy.
    Stage,
    /// CPU time to post work requests.
    Post,
    /// Post → local completion: the link.
    Wire,
    /// Remote completion seen → bytes counted as placed.
    Place,
    /// The destination's host → device copy: from the placed bytes to the
    /// CUDA event that says the device copy completed. `layer_ready` for a
    /// device-resident cache may be published only after it.
    DeviceComplete,
    /// Scatter into the destination layout.
    Unpack,
    /// Checksum.
    Verify,
    /// Flag published → seen by a waiter.
    Notify,
}

impl Hop {
    /// Every hop, in path order.
    pub const ALL: [Hop; Hop::COUNT] = [Hop::Pack, Hop::Stage, Hop::Post, Hop::Wire, Hop::Place, Hop::DeviceComplete, Hop::Unpack, Hop::Verify, Hop::Notify];

    /// Number of hops.
    pub const COUNT: usize = 9;

    /// Lower-case name used in reports and metrics.
    pub fn name(self) -> &'static str {
        match self {
            Hop::Pack => "pack",
            Hop::Stage => "stage",
            Hop::Post => "post",
            Hop::Wire => "wire",
            Hop::Place => "place",
            Hop::DeviceComplete => "device_complete",
            Hop::Unpack => "unpack",
            Hop::Verify => "verify",
            Hop::Notify => "notify",
        }
    }
}

// `Hops` indexes its array by discriminant: `ALL` must list every hop in declaration order.
const _: () = {
    let mut i = 0;
    while i < Hop::COUNT {
        assert!(Hop::ALL[i] as usize == i);
        i += 1;
    }
};

/// Summary of one hop's histogram. Quantiles and max are the hdrhistogram's
/// own (3 significant digits: within 0.1% of a recorded sample).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HopSummary {
    /// Samples.
    pub count: u64,
    /// Median, ns.
    pub p50_ns: u64,
    /// 90th percentile, ns.
    pub p90_ns: u64,
    /// 99th percentile, ns.
    pub p99_ns: u64,
    /// 99.9th percentile, ns.
    pub p999_ns: u64,
    /// Maximum, ns.
    pub max_ns: u64,
    /// Sum of samples, ns (for occupancy and effective bandwidth).
    pub sum_ns: u64,
    /// Bytes attributed to the hop.
    pub bytes: u64,
}

#[derive(Debug)]
struct HopData {
    hist: Histogram<u64>,
    sum_ns: u64,
    bytes: u64,
}

/// One histogram per hop.
#[derive(Debug)]
pub struct Hops {
    hops: [Mutex<HopData>; Hop::COUNT],
    // `post` and `wire` are timed by the user of the connections, once per
    // transfer, not per batch here ([`Hops::link_per_transfer`]).
    link_per_transfer: AtomicBool,
}

impl Default for Hops {
    fn default() -> Self {
        Hops {
            hops: std::array::from_fn(|_| {
                // 1 ns .. 1 hour at 3 significant digits.
                let hist = Histogram::new_with_bounds(1, 3_600_000_000_000, 3).expect("valid histogram bounds");
                Mutex::new(HopData { hist, sum_ns: 0, bytes: 0 })
            }),
            link_per_transfer: AtomicBool::new(false),
        }
    }
}

impl Hops {
    /// Records one sample of `hop` that handled `bytes`.
    pub fn record(&self, hop: Hop, took: Duration, bytes: u64) {
        let ns = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX).max(1);
        let mut d = self.hops[hop as usize].lock().expect("hop histogram lock");
        d.hist.saturating_record(ns);
        d.sum_ns = d.sum_ns.saturating_add(ns);
        d.bytes = d.bytes.saturating_add(bytes);
    }

    /// From now on a transport's per-batch samples of `post` and `wire`
    /// are left out: the caller records one per transfer, `wire` as the
    /// union of its batches' spans over every rail. A transfer's batches
    /// are in flight together, so summing their spans as well would count
    /// the link several times over, and the same time twice.
    pub fn link_per_transfer(&self) {
        self.link_per_transfer.store(true, Ordering::Relaxed);
    }

    /// A transport's sample of `post` or `wire` for one batch (or one post
    /// of several), unless [`Hops::link_per_transfer`] was asked.
    pub fn record_batch(&self, hop: Hop, took: Duration, bytes: u64) {
        if !self.link_per_transfer.load(Ordering::Relaxed) {
            self.record(hop, took, bytes);
        }
    }

    /// Cumulative sample counts at or below each bound (ns), for histogram exposition.
    pub fn buckets(&self, hop: Hop, bounds_ns: &[u64]) -> Vec<u64> {
        let d = self.hops[hop as usize].lock().expect("hop histogram lock");
        bounds_ns.iter().map(|&b| d.hist.iter_recorded().filter(|v| v.value_iterated_to() <= b).map(|v| v.count_at_value()).sum()).collect()
    }

    /// The summary of `hop`.
    pub fn summary(&self, hop: Hop) -> HopSummary {
        let d = self.hops[hop as usize].lock().expect("hop histogram lock");
        HopSummary {
            count: d.hist.len(),
            p50_ns: d.hist.value_at_quantile(0.5),
            p90_ns: d.hist.value_at_quantile(0.9),
            p99_ns: d.hist.value_at_quantile(0.99),
            p999_ns: d.hist.value_at_quantile(0.999),
            max_ns: d.hist.max(),
            sum_ns: d.sum_ns,
            bytes: d.bytes,
        }
    }
}
