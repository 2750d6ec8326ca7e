//! Timing model: hand-computed bounds.

use kvwire_core::timing::{predict, staged, union_ns, Fit, HopRate, Ring, Stage, StagedError};

fn stage(hop: &str, ms: u64) -> Stage {
    Stage { hop: hop.into(), total_ns: ms * 1_000_000, bytes: 1_000_000_000 }
}

#[test]
fn bounds_by_hand() {
    // 4 chunks; pack 40 ms, wire 200 ms, verify 80 ms in all; setup 5 ms.
    let p = predict(&[stage("pack", 40), stage("wire", 200), stage("verify", 80)], 4, 5_000_000);
    assert_eq!(p.sequential_ns, (5 + 40 + 200 + 80) * 1_000_000);
    // Fill/drain: one chunk through all (10 + 50 + 20), then 3 more of the slowest (50).
    assert_eq!(p.pipelined_ns, (5 + 10 + 50 + 20 + 3 * 50) * 1_000_000);
    // No schedule beats setup + the slowest stage's whole busy time.
    assert_eq!(p.lower_ns, (5 + 200) * 1_000_000);
    assert_eq!(p.bounding.as_deref(), Some("wire"));
    // Measured halfway between the bounds: half the possible overlap.
    let mid = (p.sequential_ns + p.pipelined_ns) / 2;
    let m = p.clone().measured(mid);
    assert!((m.overlap.unwrap() - 0.5).abs() < 1e-9);
    assert!(matches!(m.fit, Some(Fit::Overlap { share }) if (share - 0.5).abs() < 1e-9));
    // On the bounds: all of the overlap, none of it.
    assert_eq!(p.clone().measured(p.pipelined_ns).overlap, Some(1.0));
    assert_eq!(p.clone().measured(p.sequential_ns).overlap, Some(0.0));
    // Between the bound and the estimate: uneven chunks beat the estimate;
    // no share of overlap is claimed.
    let beat = p.clone().measured(p.pipelined_ns - 1);
    assert_eq!(beat.overlap, None);
    assert_eq!(beat.fit, Some(Fit::BelowEstimate { measured_ns: p.pipelined_ns - 1, pipelined_ns: p.pipelined_ns }));
    assert!(matches!(p.clone().measured(p.lower_ns).fit, Some(Fit::BelowEstimate { .. })));
    // Below the lower bound is a model error with its numbers, not 100%.
    let below = p.clone().measured(p.lower_ns - 1);
    assert_eq!(below.overlap, None);
    assert_eq!(below.fit, Some(Fit::BelowLowerBound { measured_ns: p.lower_ns - 1, lower_ns: p.lower_ns }));
    // Above the sequential sum: time no hop accounts for, not 0%.
    let above = p.clone().measured(p.sequential_ns + 1);
    assert_eq!(above.overlap, None);
    assert_eq!(above.fit, Some(Fit::AboveSequential { measured_ns: p.sequential_ns + 1, sequential_ns: p.sequential_ns }));
    // Effective bandwidth: 1e9 bytes in 200 ms = 5 GB/s.
    assert!((stage("wire", 200).gbps() - 5.0).abs() < 1e-9);
}

#[test]
fn one_chunk_has_nothing_to_overlap() {
    let p = predict(&[stage("wire", 10), stage("verify", 3)], 1, 0);
    assert_eq!(p.sequential_ns, p.pipelined_ns);
    assert_eq!(p.clone().measured(20_000_000).overlap, None);
    assert!(matches!(p.clone().measured(20_000_000).fit, Some(Fit::AboveSequential { .. })));
    assert_eq!(p.clone().measured(p.sequential_ns).fit, None, "on both bounds at once: nothing to say");
    assert_eq!(predict(&[], 3, 7).bounding, None);
}

#[test]
fn concurrent_spans_count_once() {
    // Two ranks' copies: 0..10 and 5..20 overlap (20 of wall time, not 25);
    // 30..35 stands apart; 40..40 and an inverted span add nothing.
    assert_eq!(union_ns(&[(5, 20), (30, 35), (0, 10), (40, 40), (50, 45)]), 25);
    // One span inside another.
    assert_eq!(union_ns(&[(0, 100), (10, 20), (30, 40)]), 100);
    assert_eq!(union_ns(&[]), 0);
}

#[test]
fn layerwise_overlap_by_hand() {
    use kvwire_core::timing::layerwise;
    // Compute 10 per layer, transfer 4 per layer: each layer's bytes finish
    // before the next layer's compute does; only the last 4 stay exposed.
    let o = layerwise(&[10, 10, 10], &[4, 4, 4]);
    assert_eq!((o.transfer_ns, o.overlapped_ns, o.tail_ns), (12, 8, 4));
    // Transfer slower than compute: the transfers queue behind each other.
    // compute ends 2, 4, 6; transfers end 2+5=7, 12, 17 -> tail 11.
    let o = layerwise(&[2, 2, 2], &[5, 5, 5]);
    assert_eq!((o.transfer_ns, o.overlapped_ns, o.tail_ns), (15, 4, 11));
}

#[test]
fn layerwise_hops_by_hand() {
    use kvwire_core::timing::layerwise_hops;
    // Compute 10 per layer; per layer, hash 1, wire 3, verify 2: every layer
    // goes through before the next is computed, so the last one's whole trip
    // (6) stays exposed, where one hop of 6 per layer would say the same and
    // the slowest hop's share (3) would say half.
    let o = layerwise_hops(&[10, 10, 10], &[1, 3, 2]);
    assert_eq!((o.transfer_ns, o.overlapped_ns, o.tail_ns), (18, 12, 6));
    // Compute 1 per layer: layers queue at the wire (3 each). Compute ends
    // 1, 2, 3; hash ends 2, 3, 4; wire ends 5, 8, 11; verify ends 7, 10, 13.
    let o = layerwise_hops(&[1, 1, 1], &[1, 3, 2]);
    assert_eq!((o.transfer_ns, o.overlapped_ns, o.tail_ns), (18, 8, 10));
    // No hops: nothing to hide, nothing exposed.
    let o = layerwise_hops(&[5, 5], &[]);
    assert_eq!((o.transfer_ns, o.overlapped_ns, o.tail_ns), (0, 0, 0));
}

fn rate(hop: &str, gb_per_s_x10: u64, per_chunk_ns: u64) -> HopRate {
    HopRate { hop: hop.into(), bytes_per_sec: gb_per_s_x10 * 100_000_000, per_chunk_ns }
}

/// D2H at 25 GB/s + 2 µs launch, wire at 12.5 GB/s + 1 µs post, H2D at 20 GB/s + 2 µs launch.
fn gpu_path() -> Vec<HopRate> {
    vec![rate("stage", 250, 2_000), rate("wire", 125, 1_000), rate("device_complete", 200, 2_000)]
}

#[test]
fn staged_gpu_pipeline_by_hand() {
    // 8 chunks of 1 MB: per chunk 40+2, 80+1, 50+2 µs.
    let ring = Ring { chunk: 1_000_000, slots: 2 };
    let s = staged(&gpu_path(), ring, 8_000_000, 10_000).unwrap();
    let totals: Vec<(&str, u64, u64)> = s.stages.iter().map(|st| (st.hop.as_str(), st.total_ns, st.bytes)).collect();
    assert_eq!(totals, vec![("stage", 8 * 42_000, 8_000_000), ("wire", 8 * 81_000, 8_000_000), ("device_complete", 8 * 52_000, 8_000_000)]);
    let p = &s.prediction;
    assert_eq!(p.chunks, 8);
    assert_eq!(p.sequential_ns, 10_000 + 8 * (42_000 + 81_000 + 52_000));
    // Two slots per ring keep the wire busy: one chunk through all three,
    // then 7 more at the wire's 81 µs.
    assert_eq!(p.pipelined_ns, 10_000 + (42_000 + 81_000 + 52_000) + 7 * 81_000);
    assert_eq!(p.bounding.as_deref(), Some("wire"));
    // Equal chunks and enough slots: the per-layer model gives the same bound.
    assert_eq!(predict(&s.stages, 8, 10_000).pipelined_ns, p.pipelined_ns);
}

#[test]
fn staged_with_one_slot_waits_for_the_next_hop() {
    // One slot per ring: chunk i's wire waits for chunk i−1's H2D to free the
    // destination slot, and its D2H (42 µs) hides under that H2D (52 µs).
    // The cycle is wire + H2D = 133 µs per chunk.
    let ring = Ring { chunk: 1_000_000, slots: 1 };
    let p = staged(&gpu_path(), ring, 8_000_000, 10_000).unwrap().prediction;
    assert_eq!(p.sequential_ns, 10_000 + 8 * 175_000);
    assert_eq!(p.pipelined_ns, 10_000 + 175_000 + 7 * (81_000 + 52_000));
    assert_eq!(p.bounding.as_deref(), Some("wire"));
}

#[test]
fn staged_short_last_chunk_by_hand() {
    // 2.5 MB in 1 MB chunks, no fixed costs. Timeline in µs:
    //   chunk 0: stage 0–40,  wire 40–120,  h2d 120–170
    //   chunk 1: stage 40–80, wire 120–200, h2d 200–250
    //   chunk 2 (0.5 MB): stage 80–100, wire 200–240, h2d 250–275
    let hops = [rate("stage", 250, 0), rate("wire", 125, 0), rate("device_complete", 200, 0)];
    let s = staged(&hops, Ring { chunk: 1_000_000, slots: 4 }, 2_500_000, 0).unwrap();
    assert_eq!(s.prediction.chunks, 3);
    assert_eq!(s.stages.iter().map(|st| st.total_ns).collect::<Vec<_>>(), vec![100_000, 200_000, 125_000]);
    assert_eq!(s.prediction.sequential_ns, 425_000);
    assert_eq!(s.prediction.pipelined_ns, 275_000);
}

#[test]
fn hop_rate_from_a_measured_stage() {
    // 100 MB in 4 ms of busy time: 25 GB/s, so a 1 MB chunk takes 40 µs.
    let r = HopRate::from_stage(&Stage { hop: "stage".into(), total_ns: 4_000_000, bytes: 100_000_000 }).unwrap();
    assert_eq!((r.hop.as_str(), r.bytes_per_sec, r.per_chunk_ns), ("stage", 25_000_000_000, 0));
    assert_eq!(r.chunk_ns(1_000_000), 40_000);
    assert_eq!(HopRate::from_stage(&Stage { hop: "wire".into(), total_ns: 0, bytes: 5 }), None);
    // Partial nanoseconds round up.
    assert_eq!(HopRate { hop: "x".into(), bytes_per_sec: 3, per_chunk_ns: 7 }.chunk_ns(1), 333_333_334 + 7);
}

#[test]
fn staged_refuses_what_could_never_finish() {
    let ring = Ring { chunk: 1 << 20, slots: 2 };
    assert_eq!(staged(&gpu_path(), Ring { chunk: 0, ..ring }, 10, 0).unwrap_err(), StagedError::ZeroChunk);
    assert_eq!(staged(&gpu_path(), Ring { slots: 0, ..ring }, 10, 0).unwrap_err(), StagedError::ZeroSlots);
    let mut hops = gpu_path();
    hops[1].bytes_per_sec = 0;
    assert_eq!(staged(&hops, ring, 10, 0).unwrap_err(), StagedError::ZeroRate("wire".into()));
    // Nothing to move: setup only, no bounding hop.
    let p = staged(&gpu_path(), ring, 0, 5).unwrap().prediction;
    assert_eq!((p.chunks, p.sequential_ns, p.pipelined_ns, p.bounding), (0, 5, 5, None));
}
