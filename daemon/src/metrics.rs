//! Daemon counters (DESIGN.md §1 vocabulary) and their Prometheus text.

use kvwire_transport::metrics::{Hop, Hops};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

/// Counters since start.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Payload bytes sent by plans executed from here (after prefix reuse).
    pub payload_bytes: AtomicU64,
    /// Bytes that crossed the link: payload + framing and acks (tcp), control messages.
    pub wire_bytes: AtomicU64,
    /// Destination bytes skipped by prefix reuse.
    pub reused_bytes: AtomicU64,
    /// Wire payload after a converting codec, for transfers that used one.
    pub compressed_bytes: AtomicU64,
    /// Bytes sent again: slices re-sent after their rail failed, and what
    /// the transport itself retransmitted (tcp: the kernel's count).
    pub retransmitted_bytes: AtomicU64,
    /// Bytes expected by transfers received here.
    pub received_bytes: AtomicU64,
    /// Transfers finished, by outcome and role.
    pub source_done: AtomicU64,
    /// Source transfers failed.
    pub source_failed: AtomicU64,
    /// Destination transfers finished.
    pub destination_done: AtomicU64,
    /// Destination transfers failed.
    pub destination_failed: AtomicU64,
    /// Transfers cancelled by clients.
    pub cancelled: AtomicU64,
    /// Receives announced to their source node (destination).
    pub announced: AtomicU64,
    /// Source transfers that claimed an announced receive: no round trip.
    pub claimed: AtomicU64,
    /// Source transfers that offered and waited for the accept.
    pub offered: AtomicU64,
    /// Plans taken from an earlier request like this one, not planned
    /// again: a source's against its destination,
    pub plans_reused_sent: AtomicU64,
    /// a destination's at a claim or offer,
    pub plans_reused_received: AtomicU64,
    /// and its own at an announcement.
    pub plans_reused_announced: AtomicU64,
    /// Authenticated peer connections a source opened for a transfer,
    pub peer_conns_opened: AtomicU64,
    /// and those a transfer ran on kept from an earlier one.
    pub peer_conns_reused: AtomicU64,
    /// Data-plane connections a source opened (handshake, and a QP on verbs),
    pub data_conns_opened: AtomicU64,
    /// and those it took kept from an earlier transfer.
    pub data_conns_reused: AtomicU64,
    /// Peer handshakes refused (wrong secret or protocol).
    pub peers_refused: AtomicU64,
    /// Control clients refused (uid).
    pub clients_refused: AtomicU64,
    /// Data-plane connections refused before or in their handshake: the
    /// data plane's own counter ([`kvwire_transport::Registry::handshakes_refused`]).
    pub data_refused: std::sync::Arc<AtomicU64>,
    /// Host memory pinned for device copies now: sources' staging rings
    /// (in use or kept for the next transfer), and destinations' mirrors.
    pub pinned_ring_bytes: std::sync::Arc<AtomicU64>,
    /// See `pinned_ring_bytes`.
    pub pinned_mirror_bytes: std::sync::Arc<AtomicU64>,
    /// Per rail (by the destination's rail name, with its address), what
    /// this daemon sent over it.
    pub rails: std::sync::Mutex<std::collections::BTreeMap<(String, String), RailTotals>>,
}

/// What one rail carried, since start.
#[derive(Debug, Default, Clone)]
pub struct RailTotals {
    /// Bytes completed.
    pub bytes: u64,
    /// Slices completed.
    pub slices: u64,
    /// Slices posted and not yet completed, now.
    pub inflight: u64,
    /// Nanoseconds busy (first post to last completion, per transfer).
    pub busy_ns: u64,
    /// Times it failed mid-transfer or could not be reached.
    pub failures: u64,
    /// Bytes of its slices re-sent on other rails.
    pub resent_bytes: u64,
}

impl Metrics {
    /// Adds `n` to a counter.
    pub fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    /// Prometheus text exposition of the counters and `hops`.
    pub fn render(&self, node: &str, hops: &Hops, per_peer: &[(String, std::sync::Arc<Hops>)]) -> String {
        let node = &label(node);
        let mut out = String::new();
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        // (metric, help, [(labels, value)])
        type Series<'a> = (&'a str, &'a str, &'a [(&'a str, u64)]);
        let counters: [Series<'_>; 12] = [
            ("kvwire_payload_bytes_total", "Payload bytes sent by plans from this daemon (after prefix reuse).", &[("", g(&self.payload_bytes))]),
            ("kvwire_wire_bytes_total", "Bytes that crossed the link for transfers this daemon sent: payload, framing, acks, control.", &[("", g(&self.wire_bytes))]),
            ("kvwire_reused_bytes_total", "Destination bytes skipped by validated prefix reuse.", &[("", g(&self.reused_bytes))]),
            ("kvwire_compressed_bytes_total", "Wire payload after a converting codec (transfers that used one).", &[("", g(&self.compressed_bytes))]),
            ("kvwire_retransmitted_bytes_total", "Bytes sent again.", &[("", g(&self.retransmitted_bytes))]),
            ("kvwire_received_bytes_total", "Bytes expected by transfers received here.", &[("", g(&self.received_bytes))]),
            (
                "kvwire_transfers_total",
                "Transfers by role and outcome.",
                &[
                    ("role=\"source\",outcome=\"done\"", g(&self.source_done)),
                    ("role=\"source\",outcome=\"failed\"", g(&self.source_failed)),
                    ("role=\"destination\",outcome=\"done\"", g(&self.destination_done)),
                    ("role=\"destination\",outcome=\"failed\"", g(&self.destination_failed)),
                    ("role=\"any\",outcome=\"cancelled\"", g(&self.cancelled)),
                ],
            ),
            (
                "kvwire_starts_total",
                "How transfers began: receives announced here, and transfers sent from here that claimed an announcement or offered.",
                &[("how=\"announced\"", g(&self.announced)), ("how=\"claimed\"", g(&self.claimed)), ("how=\"offered\"", g(&self.offered))],
            ),
            (
                "kvwire_plans_reused_total",
                "Plans taken from an earlier request with the same layouts, block tables and token counts, not planned again.",
                &[("when=\"sent\"", g(&self.plans_reused_sent)), ("when=\"received\"", g(&self.plans_reused_received)), ("when=\"announced\"", g(&self.plans_reused_announced))],
            ),
            (
                "kvwire_peer_connections_total",
                "Authenticated peer connections this daemon's transfers negotiated on: opened for them (a handshake), or kept from an earlier transfer to the same peer.",
                &[("how=\"opened\"", g(&self.peer_conns_opened)), ("how=\"reused\"", g(&self.peer_conns_reused))],
            ),
            (
                "kvwire_data_connections_total",
                "Data-plane connections this daemon's transfers wrote over: opened for them, or kept from an earlier transfer to the same peer rail.",
                &[("how=\"opened\"", g(&self.data_conns_opened)), ("how=\"reused\"", g(&self.data_conns_reused))],
            ),
            (
                "kvwire_refused_total",
                "Peers, clients and data-plane connections refused (in or before their handshake, or for their uid).",
                &[("who=\"peer\"", g(&self.peers_refused)), ("who=\"client\"", g(&self.clients_refused)), ("who=\"data\"", g(&self.data_refused))],
            ),
        ];
        for (name, help, series) in counters {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            for (labels, v) in series {
                let l = if labels.is_empty() { format!("node=\"{node}\"") } else { format!("node=\"{node}\",{labels}") };
                let _ = writeln!(out, "{name}{{{l}}} {v}");
            }
        }
        let _ = writeln!(out, "# HELP kvwire_pinned_host_bytes Host memory pinned for device copies now: staging rings of device-resident sources, host mirrors of device-resident destinations.\n# TYPE kvwire_pinned_host_bytes gauge");
        let _ = writeln!(out, "kvwire_pinned_host_bytes{{node=\"{node}\",for=\"ring\"}} {}", g(&self.pinned_ring_bytes));
        let _ = writeln!(out, "kvwire_pinned_host_bytes{{node=\"{node}\",for=\"mirror\"}} {}", g(&self.pinned_mirror_bytes));
        let _ = writeln!(out, "# HELP kvwire_hop_seconds Time spent in each hop of the path; post and wire once per transfer (wire: its first post to its last completion, over all its rails).\n# TYPE kvwire_hop_seconds histogram");
        const BOUNDS_NS: [u64; 12] =
            [1_000, 10_000, 50_000, 100_000, 500_000, 1_000_000, 5_000_000, 10_000_000, 50_000_000, 100_000_000, 1_000_000_000, 10_000_000_000];
        for hop in Hop::ALL {
            let b = hops.buckets(hop, &BOUNDS_NS);
            let s = hops.summary(hop);
            for (bound, count) in BOUNDS_NS.iter().zip(&b) {
                let _ = writeln!(out, "kvwire_hop_seconds_bucket{{node=\"{node}\",hop=\"{}\",le=\"{}\"}} {count}", hop.name(), *bound as f64 / 1e9);
            }
            let _ = writeln!(out, "kvwire_hop_seconds_bucket{{node=\"{node}\",hop=\"{}\",le=\"+Inf\"}} {}", hop.name(), s.count);
            let _ = writeln!(out, "kvwire_hop_seconds_sum{{node=\"{node}\",hop=\"{}\"}} {}", hop.name(), s.sum_ns as f64 / 1e9);
            let _ = writeln!(out, "kvwire_hop_seconds_count{{node=\"{node}\",hop=\"{}\"}} {}", hop.name(), s.count);
            let _ = writeln!(out, "kvwire_hop_bytes_total{{node=\"{node}\",hop=\"{}\"}} {}", hop.name(), s.bytes);
        }
        // The histograms' own quantiles, so `kvwire stats` need not estimate
        // them from the coarse buckets above; quantile="1" is the max.
        let _ = writeln!(
            out,
            "# HELP kvwire_hop_quantile_seconds Quantiles of each hop's histogram (3 significant digits); quantile=\"1\" is the max.\n\
             # TYPE kvwire_hop_quantile_seconds gauge"
        );
        for hop in Hop::ALL {
            let s = hops.summary(hop);
            if s.count == 0 {
                continue;
            }
            for (q, ns) in [("0.5", s.p50_ns), ("0.9", s.p90_ns), ("0.99", s.p99_ns), ("0.999", s.p999_ns), ("1", s.max_ns)] {
                let _ = writeln!(out, "kvwire_hop_quantile_seconds{{node=\"{node}\",hop=\"{}\",quantile=\"{q}\"}} {}", hop.name(), ns as f64 / 1e9);
            }
        }
        let rails = self.rails.lock().expect("rail metrics lock").clone();
        for (name, help, kind, get) in [
            ("kvwire_rail_bytes_total", "Bytes completed per rail.", "counter", (|t: &RailTotals| t.bytes as f64) as fn(&RailTotals) -> f64),
            ("kvwire_rail_slices_total", "Slices completed per rail.", "counter", |t| t.slices as f64),
            ("kvwire_rail_inflight_slices", "Slices posted and not completed per rail, now.", "gauge", |t| t.inflight as f64),
            ("kvwire_rail_busy_seconds_total", "Seconds each rail was busy with transfers.", "counter", |t| t.busy_ns as f64 / 1e9),
            ("kvwire_rail_failures_total", "Rail failures mid-transfer (unreachable, reset, stalled).", "counter", |t| t.failures as f64),
            ("kvwire_rail_resent_bytes_total", "Bytes of a failed rail's slices re-sent on other rails.", "counter", |t| t.resent_bytes as f64),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for ((rail, addr), t) in &rails {
                // Rail names and addresses come from peers: escaped, so they
                // cannot end the label and forge another series.
                let (rail, addr) = (label(rail), label(addr));
                let _ = writeln!(out, "{name}{{node=\"{node}\",rail=\"{rail}\",addr=\"{addr}\"}} {}", get(t));
            }
        }
        let _ = writeln!(out, "# HELP kvwire_peer_hop_seconds Time spent in each hop, per peer daemon.\n# TYPE kvwire_peer_hop_seconds summary");
        for (peer, h) in per_peer {
            for hop in Hop::ALL {
                let s = h.summary(hop);
                if s.count == 0 {
                    continue;
                }
                let l = format!("node=\"{node}\",peer=\"{}\",hop=\"{}\"", label(peer), hop.name());
                let _ = writeln!(out, "kvwire_peer_hop_seconds{{{l},quantile=\"0.5\"}} {}", s.p50_ns as f64 / 1e9);
                let _ = writeln!(out, "kvwire_peer_hop_seconds{{{l},quantile=\"0.99\"}} {}", s.p99_ns as f64 / 1e9);
                let _ = writeln!(out, "kvwire_peer_hop_seconds_sum{{{l}}} {}", s.sum_ns as f64 / 1e9);
                let _ = writeln!(out, "kvwire_peer_hop_seconds_count{{{l}}} {}", s.count);
            }
        }
        out
    }
}

/// One registered device allocation's source path: group, rank, its
/// index in the rank, whether the NIC reads it in place, and how or why not.
#[derive(Debug)]
pub struct DeviceMemoryRow<'a> {
    /// The group.
    pub group: &'a str,
    /// The rank.
    pub rank: u32,
    /// The allocation's index in the rank.
    pub memory: usize,
    /// Read in place by the NIC.
    pub direct: bool,
    /// How it is registered, or why it stages.
    pub detail: &'a str,
}

/// `kvwire_writes_refused_total`: writes the data plane refused, by reason
/// (every reason, zeros too, so a rate of any of them can be graphed).
pub fn writes_refused(node: &str, by_reason: impl Iterator<Item = (&'static str, u64)>) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "# HELP kvwire_writes_refused_total Writes the data plane refused before counting them, by reason (unknown or revoked key, out of bounds, overrun...).\n# TYPE kvwire_writes_refused_total counter");
    for (reason, n) in by_reason {
        let _ = writeln!(out, "kvwire_writes_refused_total{{node=\"{}\",reason=\"{reason}\"}} {n}", label(node));
    }
    out
}

/// `kvwire_device_memory`: one series per registered device allocation,
/// `path="direct"` (read in place by the NIC, `how` the registration) or
/// `path="staged"` (through the ring, `why` the NIC does not).
pub fn device_memory(node: &str, rows: &[DeviceMemoryRow<'_>]) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "# HELP kvwire_device_memory Registered device allocations and how a source reads them: in place by the NIC (path=\"direct\", GPUDirect; how=the registration) or through a staging ring (path=\"staged\"; why=the NIC does not read it in place).\n# TYPE kvwire_device_memory gauge");
    for r in rows {
        let (path, key) = if r.direct { ("direct", "how") } else { ("staged", "why") };
        let _ = writeln!(out, "kvwire_device_memory{{node=\"{}\",group=\"{}\",rank=\"{}\",memory=\"{}\",path=\"{path}\",{key}=\"{}\"}} 1", label(node), label(r.group), r.rank, r.memory, label(r.detail));
    }
    out
}

/// A label value in the text format: backslash, double quote and newline escaped.
fn label(v: &str) -> String {
    let mut s = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '"' => s.push_str("\\\""),
            '\n' => s.push_str("\\n"),
            c => s.push(c),
        }
    }
    s
}
