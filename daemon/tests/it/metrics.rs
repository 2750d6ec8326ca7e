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
    assert_eq!((w.count, w.bytes, w.latency_from), (3, 3000, LatencyFrom::Histogram));
    let rel = |a: Option<f64>, b: f64| a.is_some_and(|a| ((a - b) / b).abs() < 1e-9);
    assert!(rel(Some(w.sum_seconds), 222e-6), "{}", w.sum_seconds);
    // Quantiles from the histogram, not the buckets (which would say 30 µs
    // and 488 µs): the middle sample, and the largest for p99 and max,
    // within hdrhistogram's 3 significant digits.
    let near = |a: Option<f64>, b: f64| a.is_some_and(|a| a >= b && (a - b) / b <= 1e-3);
    assert!(near(w.p50_seconds, 20e-6), "{:?}", w.p50_seconds);
    assert!(near(w.p99_seconds, 200e-6), "{:?}", w.p99_seconds);
    assert!(near(w.max_seconds, 200e-6), "{:?}", w.max_seconds);
    assert!(rel(w.bandwidth_bytes_per_second, 3000.0 / 222e-6));
    // A hop without samples has no quantile series: nothing to estimate.
    let p = s.hops.iter().find(|h| h.hop == "pack").unwrap();
    assert_eq!((p.count, p.p50_seconds, p.max_seconds), (0, None, None));
}

/// `kvwire stats`' quantiles are the histogram's own: for the samples
/// 1, 2, …, 1000 µs the q-quantile is the sample of rank ceil(q × 1000)
/// (nearest rank), which hdrhistogram reports to 3 significant digits.
#[test]
fn stats_quantiles_are_the_histograms_own() {
    use kvwire_transport::metrics::{Hop, Hops};
    let hops = Hops::default();
    // Recorded out of order: the order must not matter.
    for i in 0..1000u64 {
        hops.record(Hop::Verify, Duration::from_micros(1 + (i * 617) % 1000), 0);
    }
    let s = Stats::from_text(&kvwired::metrics::Metrics::default().render("n", &hops, &[])).unwrap();
    let v = s.hops.iter().find(|h| h.hop == "verify").unwrap();
    assert_eq!((v.count, v.latency_from), (1000, LatencyFrom::Histogram));
    let sum: u64 = (1..=1000).sum();
    assert!((v.sum_seconds - sum as f64 * 1e-6).abs() < 1e-12, "{}", v.sum_seconds);
    for (q, got, rank) in [
        ("p50", v.p50_seconds, 500),
        ("p90", v.p90_seconds, 900),
        ("p99", v.p99_seconds, 990),
        ("p99.9", v.p999_seconds, 999),
        ("max", v.max_seconds, 1000),
    ] {
        let want = rank as f64 * 1e-6;
        let got = got.unwrap_or_else(|| panic!("{q} missing"));
        assert!(got >= want && (got - want) / want <= 1e-3, "{q}: {got} s, the sample of rank {rank} is {want} s");
    }
    // And exactly what the histogram holds, to the nanosecond.
    let h = hops.summary(Hop::Verify);
    let ns = |x: Option<f64>| (x.unwrap() * 1e9).round() as u64;
    assert_eq!(
        [ns(v.p50_seconds), ns(v.p90_seconds), ns(v.p99_seconds), ns(v.p999_seconds), ns(v.max_seconds)],
        [h.p50_ns, h.p90_ns, h.p99_ns, h.p999_ns, h.max_ns]
    );
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
