//! Timing model: hand-computed bounds.

use kvwire_core::timing::{predict, Stage};

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
    assert_eq!(p.bounding.as_deref(), Some("wire"));
    // Measured halfway between the bounds: half the possible overlap.
    let mid = (p.sequential_ns + p.pipelined_ns) / 2;
    let m = p.clone().measured(mid);
    assert!((m.overlap.unwrap() - 0.5).abs() < 1e-9);
    assert_eq!(p.clone().measured(1).overlap, Some(1.0));
    assert_eq!(p.measured(u64::MAX / 2).overlap, Some(0.0));
    // Effective bandwidth: 1e9 bytes in 200 ms = 5 GB/s.
    assert!((stage("wire", 200).gbps() - 5.0).abs() < 1e-9);
}

#[test]
fn one_chunk_has_nothing_to_overlap() {
    let p = predict(&[stage("wire", 10), stage("verify", 3)], 1, 0);
    assert_eq!(p.sequential_ns, p.pipelined_ns);
    assert_eq!(p.measured(20_000_000).overlap, None);
    assert_eq!(predict(&[], 3, 7).bounding, None);
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
