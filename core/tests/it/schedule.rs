//! The per-transfer schedule both sides compute: per-layer writes and the
//! bytes each layer's flag waits for. Figures are derived by hand from
//! llama-3.1-8b's shape (32 layers, 8 KV heads, head_dim 128, bf16).

use kvwire_core::codec::Codec;
use kvwire_core::layout::builtin;
use kvwire_core::plan::{build, CostModel, Plan, PlanInput, Side};
use kvwire_core::schedule::{Schedule, ScheduleError, WriteTarget, PLACED_MIN_BYTES};
use kvwire_core::shard::LayoutSpec;
use kvwire_core::{CacheFormat, ModelSpec};

const ROW: u64 = 128 * 2;
const PER_TOKEN_LAYER: u64 = 8 * 2 * ROW; // kv heads × (K, V) × row

fn planned(model: &ModelSpec, format: CacheFormat, src: &str, dst: &str, tokens: u64) -> Plan {
    let s = Side::new(model, &LayoutSpec::parse(src).unwrap(), format, tokens).unwrap();
    let d = Side::new(model, &LayoutSpec::parse(dst).unwrap(), format, tokens).unwrap();
    build(&PlanInput { model, tokens, prefix_tokens: 0, src: &s, dst: &d, cost: CostModel::default() }).unwrap()
}

fn write_len(w: &WriteTarget) -> u64 {
    match *w {
        WriteTarget::Direct { len, .. } | WriteTarget::Staged { len, .. } | WriteTarget::Placed { len, .. } => len,
        WriteTarget::Strided { len, count, .. } => len * count,
    }
}

#[test]
fn each_layer_waits_for_exactly_its_share_and_its_writes_carry_it() {
    let m = builtin("llama-3.1-8b").unwrap();
    let bf16 = CacheFormat::parse("bf16").unwrap();
    let tokens = 40;
    for (src, dst) in [("tp=1", "tp=1"), ("tp=8", "tp=2"), ("tp=8,block=16", "tp=2,layout=hnd,block=32")] {
        let plan = planned(&m, bf16, src, dst, tokens);
        let s = Schedule::new(&m, &bf16, &plan, None).unwrap();
        assert_eq!(s.layers.len(), 32);
        for (l, ls) in s.layers.iter().enumerate() {
            assert_eq!(ls.wire_bytes, tokens * PER_TOKEN_LAYER, "{src} -> {dst} layer {l}");
            assert_eq!(s.writes(&plan, l).map(|w| write_len(&w)).sum::<u64>(), ls.wire_bytes, "{src} -> {dst} layer {l}");
        }
        assert_eq!(s.wire_bytes(), 32 * tokens * PER_TOKEN_LAYER);
        // Without a codec only packed segments are staged, back to back.
        assert_eq!(s.stage_bytes, plan.counters.packed_bytes, "{src} -> {dst}");
        let mut at = 0;
        for st in s.staged.iter() {
            assert_eq!(st.offset, at);
            at += st.size;
        }
        // Each layer lists exactly its own segments, in plan order, and a
        // segment is found in staging exactly when it was packed.
        for (l, ls) in s.layers.iter().enumerate() {
            let own: Vec<usize> = (0..plan.segments.len()).filter(|&i| plan.segments.at(i).dst_region.layer as usize == l).collect();
            assert_eq!(ls.segments(), own, "{src} -> {dst} layer {l}");
        }
        // In plan order, backwards and strided (a lookup remembers where it ended).
        let n = plan.segments.len();
        for i in (0..n).chain((0..n).rev()).chain((0..n).map(|i| i * 7919 % n)) {
            let packed = plan.segments.at(i).mode == kvwire_core::plan::Mode::Packed;
            assert_eq!(s.staged_of(i).map(|st| st.seg), packed.then_some(i), "{src} -> {dst} segment {i}");
        }
    }
}

#[test]
fn a_packed_segment_lands_in_place_exactly_when_its_destination_runs_are_back_to_back() {
    let m = builtin("llama-3.1-8b").unwrap();
    let bf16 = CacheFormat::parse("bf16").unwrap();
    // NHD -> HND: rows a head apart at the source, a head's rows back to
    // back at the destination: 64 of them (16 KiB) placed, 16 (4 KiB)
    // staged as too small for a write of their own. tp8 -> tp2 NHD: rows
    // 1 KiB apart at both ends (staged and unpacked).
    let cases = [("tp=2,block=64", "tp=1,layout=hnd,block=64", true), ("tp=2,block=16", "tp=1,layout=hnd,block=32", false), ("tp=8", "tp=2", false)];
    for (src, dst, placed) in cases {
        let plan = planned(&m, bf16, src, dst, 40);
        let s = Schedule::new(&m, &bf16, &plan, None).unwrap();
        assert!(s.staged.len() > 0, "{src} -> {dst}: nothing packed");
        for st in s.staged.iter() {
            let seg = plan.segments.at(st.seg);
            assert_eq!(st.placed, (seg.count == 1 || seg.dst_stride == seg.len) && seg.bytes() >= PLACED_MIN_BYTES, "{src} -> {dst}: {seg:?}");
            assert_eq!(st.placed, placed, "{src} -> {dst}: {seg:?}");
        }
        for l in 0..s.layers.len() {
            for w in s.writes(&plan, l) {
                match w {
                    WriteTarget::Placed { seg, offset, dst, dst_offset, len } => {
                        let (sg, st) = (plan.segments.at(seg), s.staged_of(seg).unwrap());
                        assert!(st.placed);
                        assert_eq!((offset, len), (st.offset, sg.bytes()));
                        assert_eq!((dst, dst_offset), ((sg.dst_rank, sg.dst_region), sg.dst_offset));
                    }
                    WriteTarget::Staged { seg, .. } => assert!(!s.staged_of(seg).unwrap().placed),
                    _ => {}
                }
            }
        }
        // Staging keeps every packed segment: the source gathers there.
        assert_eq!(s.stage_bytes, plan.counters.packed_bytes, "{src} -> {dst}");
        // A codec converts rows: nothing lands in place.
        let coded = Schedule::new(&m, &bf16, &plan, Some(Codec::Fp8E4m3Row)).unwrap();
        assert!(coded.staged.iter().all(|st| !st.placed), "{src} -> {dst}");
    }
}

#[test]
fn a_fragmented_transfer_schedules_in_runs_not_one_record_per_segment() {
    // llama-3.1-70b at 128k tokens, tp=8 -> tp=2, both block tables
    // shuffled: 10,485,760 segments, every one packed. Held one record per
    // segment, the whole list and the layers' would be about 670 MB; as
    // runs of consecutive segments of one size they are a few per layer.
    let m = builtin("llama-3.1-70b").unwrap();
    let bf16 = CacheFormat::parse("bf16").unwrap();
    let tokens = 128 * 1024;
    let plan = planned(&m, bf16, "tp=8,table=shuffle:1", "tp=2,table=shuffle:2", tokens);
    let n = plan.segments.len();
    assert_eq!(n, 10_485_760);
    let s = Schedule::new(&m, &bf16, &plan, None).unwrap();
    assert_eq!((s.staged.len(), s.stage_bytes), (n, plan.counters.packed_bytes));
    assert!(s.stored_runs() <= 4 * m.layers.len(), "{} runs stored", s.stored_runs());
    // The runs stand for every segment at its place, back to back.
    let mut at = 0;
    for (i, st) in s.staged.iter().enumerate() {
        assert!(st.seg == i && st.offset == at, "entry {i}: {st:?} (expected offset {at})");
        if i % 4099 == 0 {
            assert_eq!(st.size, plan.segments.at(i).bytes(), "segment {i}");
        }
        at += st.size;
    }
    for i in [0, 1, n / 2, n - 1, n / 2 + 1] {
        assert_eq!(s.staged_of(i).map(|st| (st.seg, st.offset)), Some((i, s.staged.iter().nth(i).unwrap().offset)));
    }
    assert_eq!(s.layers.iter().map(|l| l.staged.len()).sum::<usize>(), n);
}

#[test]
fn a_codec_stages_every_segment_at_its_encoded_size() {
    let m = builtin("llama-3.1-8b").unwrap();
    let bf16 = CacheFormat::parse("bf16").unwrap();
    let tokens = 16;
    let plan = planned(&m, bf16, "tp=1", "tp=1", tokens);
    let s = Schedule::new(&m, &bf16, &plan, Some(Codec::Fp8E4m3Row)).unwrap();
    assert_eq!(s.staged.len(), plan.segments.len());
    // fp8 rows: 128 one-byte elements + one f32 scale, for every row moved.
    let rows = 32 * tokens * 8 * 2;
    assert_eq!(s.stage_bytes, rows * (128 + 4));
    assert_eq!(s.wire_bytes(), s.stage_bytes);
    assert!(s.layers.iter().all(|l| l.direct.is_empty() && l.wire_bytes == tokens * 8 * 2 * (128 + 4)));
}

#[test]
fn a_codec_that_cannot_convert_the_format_is_an_error() {
    let m = builtin("llama-3.1-8b").unwrap();
    let fp8 = CacheFormat::parse("fp8_e4m3").unwrap();
    let plan = planned(&m, fp8, "tp=1", "tp=1", 4);
    let e = Schedule::new(&m, &fp8, &plan, Some(Codec::Fp8E4m3Row)).unwrap_err();
    assert!(matches!(e, ScheduleError::Codec(ref t) if t.contains("converts fp32 or bf16")), "{e}");
}
