use super::*;

fn sample(start_ns: u64, end_ns: u64) -> Sample {
    Sample { start_ns, end_ns, framing: 0, wire_ns: 0 }
}

fn hop(sum_ns: u64, bytes: u64) -> HopStat {
    HopStat { count: 1, sum_ns, p50_ns: 0, p99_ns: None, max_ns: 0, bytes }
}

#[test]
fn the_model_of_a_point_by_hand() {
    use kvwire_core::timing::Fit;
    // Two 4000-byte transfers of 1000-byte writes (4 chunks), 100 and 140 ns
    // (mean 120), with writes in flight 80 and 100 ns of them (mean 90).
    // Per transfer on average: post 40/2 = 20, place 60/2 = 30, notify 8/2 = 4.
    let rounds = vec![vec![Sample { wire_ns: 80, ..sample(0, 100) }], vec![Sample { wire_ns: 100, ..sample(200, 340) }]];
    let hops = PointHops { post: hop(40, 8000), wire: hop(0, 8000), place: hop(60, 8000), notify: hop(8, 0) };
    let m = model(4000, 1000, &rounds, &hops);
    assert_eq!((m.chunks, m.lower_ns, m.sequential_ns, m.measured_ns), (4, 90, 20 + 90 + 30 + 4, Some(120)));
    assert_eq!(m.bounding.as_deref(), Some("wire"));
    // Pipelined: per chunk 5 + 22 + 7 + 1 = 35, plus 3 more of the slowest (22).
    assert_eq!(m.pipelined_ns, 35 + 3 * 22);
    // 120 lies between 101 and 144: (144 - 120) / (144 - 101) of the overlap.
    assert_eq!(m.fit, Some(Fit::Overlap { share: 24.0 / 43.0 }));
    assert_eq!(fit_label(&m), "overlap 56%");
    assert_eq!(model_error("tcp 4K conc 1", &m), None);
    // Writes in flight for longer than the transfers took cannot be: the
    // mean undercuts the bound, and it says so with the numbers.
    let rounds = vec![vec![Sample { wire_ns: 150, ..sample(0, 100) }]];
    let m = model(4000, 1000, &rounds, &hops);
    assert_eq!(m.fit, Some(Fit::BelowLowerBound { measured_ns: 100, lower_ns: 150 }));
    assert_eq!(fit_label(&m), "MODEL ERROR");
    let line = model_error("tcp 4K conc 1", &m).unwrap();
    assert!(line.starts_with("MODEL ERROR: tcp 4K conc 1: mean latency 100 ns is below the lower bound 150 ns (wire"), "{line}");
}

#[test]
fn figures_from_hand_derived_rounds() {
    // 1000-byte transfers. Round 1: two at once, 0..100 and 10..210 ns;
    // round 2: 1000..1050 and 1000..1100.
    // Latencies 100, 200, 50, 100: sum 450 → avg 4000/450 GB/s; fastest 50 → 20 GB/s.
    // Round walls 210 and 100 ns carry 2000 bytes each → 4000/310 GB/s.
    let rounds = vec![vec![sample(0, 100), sample(10, 210)], vec![sample(1000, 1050), sample(1000, 1100)]];
    let f = figures(1000, &rounds);
    assert!((f.gbps_avg - 4000.0 / 450.0).abs() < 1e-12);
    assert!((f.gbps_peak - 20.0).abs() < 1e-12);
    assert!((f.gbps_aggregate - 4000.0 / 310.0).abs() < 1e-12);
    // Small values are exact in an hdrhistogram with 3 significant digits.
    // Four transfers support no tail percentile.
    assert_eq!(f.lat, LatNs { min: 50, p50: 100, p99: None, p999: None, max: 200 });
}

#[test]
fn tail_percentiles_only_from_enough_transfers() {
    // 1, 2, …, n ns: p99 is the sample of rank 0.99 n, p99.9 of rank 0.999 n.
    let round = |n: u64| vec![(1..=n).map(|i| sample(0, i)).collect::<Vec<_>>()];
    let f = figures(1, &round(99));
    assert_eq!((f.lat.p99, f.lat.p999, f.lat.max), (None, None, 99));
    let f = figures(1, &round(100));
    assert_eq!((f.lat.p99, f.lat.p999), (Some(99), None));
    let f = figures(1, &round(1000));
    assert_eq!((f.lat.p50, f.lat.p99, f.lat.p999, f.lat.max), (500, Some(990), Some(999), 1000));
    assert!(supports(100, 0.99) && !supports(99, 0.99) && supports(1000, 0.999) && !supports(999, 0.999));
}

#[test]
fn chunks_cover_the_transfer_once() {
    let c: Vec<_> = chunks(10, 4).collect();
    assert_eq!(c, vec![(0, 4), (4, 4), (8, 2)]);
    assert_eq!(chunks(4, 16).collect::<Vec<_>>(), vec![(0, 4)]);
}

#[test]
fn size_labels() {
    assert_eq!(size_label(4096), "4K");
    assert_eq!(size_label(64 << 20), "64M");
    assert_eq!(size_label(1 << 30), "1G");
    assert_eq!(size_label(1000), "1000");
}
