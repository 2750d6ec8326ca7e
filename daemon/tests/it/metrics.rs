//! The daemon's metrics text, read back by the parser `kvwire stats` uses.

use kvwire_client::promtext::{LatencyFrom, Stats};
use std::time::Duration;

const HOPS: [&str; 9] = ["pack", "stage", "post", "wire", "place", "device_complete", "unpack", "verify", "notify"];

#[test]
fn promtext_reads_what_kvwired_renders() {
    // The daemon's own renderer, fresh: parses, and every hop is present.
    let text = kvwired::metrics::Metrics::default().render("n", &kvwire_transport::metrics::Hops::default(), &[]);
    let s = Stats::from_text(&text).unwrap();
    assert_eq!(s.node.as_deref(), Some("n"));
    assert_eq!(s.hops.iter().map(|h| h.hop.as_str()).collect::<Vec<_>>(), HOPS);
    assert!(s.hops.iter().all(|h| h.count == 0 && h.buckets.len() == 12));

    // With samples: wire took 2 µs, 20 µs and 200 µs, moving 1000 bytes each.
    use kvwire_transport::metrics::{Hop, Hops};
    let hops = Hops::default();
    for us in [2, 20, 200] {
        hops.record(Hop::Wire, Duration::from_micros(us), 1000);
    }
    let s = Stats::from_text(&kvwired::metrics::Metrics::default().render("n", &hops, &[])).unwrap();
    let w = s.hops.iter().find(|h| h.hop == "wire").unwrap();
    assert_eq!((w.count, w.bytes, w.latency_from), (3, 3000, LatencyFrom::Buckets));
    let rel = |a: Option<f64>, b: f64| a.is_some_and(|a| ((a - b) / b).abs() < 1e-9);
    assert!(rel(Some(w.sum_seconds), 222e-6), "{}", w.sum_seconds);
    // Bounds 10 µs (1 sample) and 50 µs (2): rank 1.5 → 10 + 40 * 0.5/1 = 30 µs.
    assert!(rel(w.p50_seconds, 30e-6), "{:?}", w.p50_seconds);
    // Bounds 100 µs (2) and 500 µs (3): rank 2.97 → 100 + 400 * 0.97 = 488 µs.
    assert!(rel(w.p99_seconds, 488e-6), "{:?}", w.p99_seconds);
    assert!(rel(w.bandwidth_bytes_per_second, 3000.0 / 222e-6));
}

#[test]
fn peer_chosen_rail_and_peer_names_cannot_forge_series() {
    use kvwire_client::promtext::parse;
    let m = kvwired::metrics::Metrics::default();
    let evil = "r\"} 1\nkvwire_forged_total{node=\"x\"} 99\n#";
    m.rails.lock().unwrap().insert((evil.to_string(), "1.2.3.4:5\\".to_string()), Default::default());
    let hops = std::sync::Arc::new(kvwire_transport::metrics::Hops::default());
    hops.record(kvwire_transport::metrics::Hop::Wire, Duration::from_micros(3), 10);
    let text = m.render("n", &kvwire_transport::metrics::Hops::default(), &[(evil.to_string(), hops)]);
    let samples = parse(&text).unwrap();
    assert!(samples.iter().all(|s| s.name != "kvwire_forged_total"), "a forged series appeared:\n{text}");
    let rail = samples.iter().find(|s| s.name == "kvwire_rail_bytes_total").unwrap();
    let get = |k: &str| rail.labels.iter().find(|(key, _)| key == k).map(|(_, v)| v.clone());
    assert_eq!(get("rail").as_deref(), Some(evil), "the label round-trips exactly");
    assert_eq!(get("addr").as_deref(), Some("1.2.3.4:5\\"));
    let peer = samples.iter().find(|s| s.name == "kvwire_peer_hop_seconds_count").unwrap();
    assert!(peer.labels.iter().any(|(k, v)| k == "peer" && v == evil));
}
