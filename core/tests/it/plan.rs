//! Shard maps, transfer plans, prefix reuse and plan execution.
//!
//! Every expected figure is derived by hand from the model's published
//! numbers (layers × heads × dims × bytes × tokens), never by asking the
//! planner; every plan built here is also executed and checked byte by byte
//! by `verify`.

use kvwire_core::format::{CacheFormat, FORMATS};
use kvwire_core::layout::{builtin, from_toml_spec, ModelSpec};
use kvwire_core::plan::{build, execute, Buffers, CostModel, ExecError, Mode, Plan, PlanError, PlanInput, Segments, Side};
use kvwire_core::reuse::{check_prefix, CacheIdentity, ReuseRefusal};
use kvwire_core::shard::{LayerShard, LayoutSpec, ShardError, TableKind};
use kvwire_core::verify::{verify, CANARY};
use proptest::prelude::*;
use proptest::sample::Index;

/// Verification buffers are small here; this only guards against a runaway case.
const VERIFY_LIMIT: u64 = 1 << 31;

fn bf16() -> CacheFormat {
    CacheFormat::parse("bf16").unwrap()
}

fn side(model: &ModelSpec, layout: &str, tokens: u64) -> Side {
    Side::new(model, &LayoutSpec::parse(layout).unwrap(), bf16(), tokens).unwrap()
}

fn plan_of(model: &ModelSpec, src: &Side, dst: &Side, tokens: u64, prefix_tokens: u64) -> Plan {
    build(&PlanInput { model, tokens, prefix_tokens, src, dst, cost: CostModel::default() }).unwrap()
}

/// Builds both sides and the plan, and insists the plan verifies.
fn planned(model: &ModelSpec, src: &str, dst: &str, tokens: u64, prefix: u64) -> (Side, Side, Plan) {
    let s = side(model, src, tokens);
    let d = side(model, dst, tokens);
    let plan = plan_of(model, &s, &d, tokens, prefix);
    let report = verify(model, &s, &d, &plan, VERIFY_LIMIT).unwrap();
    assert_eq!(report.bytes_copied, plan.counters.total_bytes_moved);
    assert_counters_consistent(&plan);
    (s, d, plan)
}

fn sent(plan: &Plan) -> Vec<u64> {
    plan.counters.src_ranks.iter().map(|r| r.bytes).collect()
}

fn received(plan: &Plan) -> Vec<u64> {
    plan.counters.dst_ranks.iter().map(|r| r.bytes).collect()
}

fn assert_counters_consistent(plan: &Plan) {
    let c = &plan.counters;
    let moved: u64 = plan.segments.iter().map(|s| s.len * s.count).sum();
    assert_eq!(c.total_bytes_moved, moved);
    assert_eq!(sent(plan).iter().sum::<u64>(), c.total_bytes_moved);
    assert_eq!(received(plan).iter().sum::<u64>(), c.total_bytes_moved);
    assert_eq!(c.packed_bytes + c.direct_bytes, c.total_bytes_moved);
    assert_eq!(c.segments, plan.segments.len() as u64);
    let packed: u64 = plan.segments.iter().filter(|s| s.mode == Mode::Packed).map(|s| s.bytes()).sum();
    assert_eq!(c.packed_bytes, packed);
    assert_eq!(c.writes, plan.segments.iter().map(|s| s.writes()).sum::<u64>());
    // Kept as templates: random access and the flat list agree with the walk.
    let flat = plan.segments.to_vec();
    assert!(flat.iter().enumerate().all(|(i, s)| plan.segments.get(i) == Some(*s)));
    // Lookups out of plan order too (backwards, then strided): each finds its own.
    assert!(flat.iter().enumerate().rev().all(|(i, s)| plan.segments.get(i) == Some(*s)));
    assert!((0..flat.len()).map(|i| i * 7919 % flat.len()).all(|i| plan.segments.get(i) == Some(flat[i])));
    assert_eq!(plan.segments.get(flat.len()), None);
    assert_eq!(Segments::from(flat), plan.segments);
}

#[test]
fn a_long_shuffled_request_is_stored_as_templates_not_as_flat_segments() {
    // llama-3.1-70b, 128k tokens, tp=8 -> tp=2, both tables shuffled: one
    // segment per (block, layer, tensor, source rank), 10.5M in all, from
    // four templates of one shape per block.
    let model = builtin("llama-3.1-70b").unwrap();
    let tokens = 131_072;
    let (s, d) = (side(&model, "tp=8,table=shuffle", tokens), side(&model, "tp=2,table=shuffle:7", tokens));
    let plan = plan_of(&model, &s, &d, tokens, 0);
    assert_eq!(plan.segments.len(), 8192 * 80 * 2 * 8);
    let (shapes, groups) = plan.segments.stored();
    assert_eq!((shapes, groups), (4 * 8192, 2 * 80 * 2 * 4));
    // Every segment is one block of one source rank's head: 16 rows of 128 x bf16, strided at the destination.
    assert!(plan.segments.iter().all(|s| s.count == 16 && s.len == 128 * 2 && s.dst_stride == 4 * 128 * 2));
    assert_counters_consistent(&plan);
}

fn llama8b() -> ModelSpec {
    builtin("llama-3.1-8b").unwrap()
}

// llama-3.1-8b: 32 layers, 8 KV heads, head_dim 4096 / 32 = 128, bf16 (2 bytes).
const L8B_ROW: u64 = 128 * 2;
const L8B_PER_TOKEN: u64 = 32 * 8 * 2 * L8B_ROW; // layers × kv heads × (K, V) × row

#[test]
fn the_transport_prices_a_write_and_a_contiguous_source_saves_a_copy() {
    use kvwire_core::protocol::TransportKind;
    // tp=8 NHD/16 -> tp=2 HND/32 at 2048 tokens: a source rank holds one
    // head, a block of it 16 rows x 256 B back to back; a destination block
    // holds 32 rows of each of 4 heads. Per (layer, K/V, head) one segment
    // of 64 runs of 32 x 256 = 8 KiB, contiguous at the source, 16 KiB x 4
    // apart at the destination: 32 x 2 x 8 = 512 segments.
    let m = llama8b();
    let (s, d) = (side(&m, "tp=8,block=16", 2048), side(&m, "tp=2,layout=hnd,block=32", 2048));
    let with = |cost| build(&PlanInput { model: &m, tokens: 2048, prefix_tokens: 0, src: &s, dst: &d, cost }).unwrap();
    // verbs (500 ns a write): 63 writes saved, 31.5 us, against one
    // unpack of 512 KiB at 8 B/ns, 65.5 us: direct, one write a run.
    let p = with(CostModel::for_transport(TransportKind::Verbs));
    assert_eq!((p.counters.segments, p.counters.writes, p.counters.packed_bytes), (512, 512 * 64, 0));
    // tcp carries strided writes: one a segment.
    let p = with(CostModel::for_transport(TransportKind::Tcp));
    assert_eq!((p.counters.segments, p.counters.writes, p.counters.packed_bytes), (512, 512, 0));
    assert!(p.segments.iter().all(|seg| seg.mode == Mode::Strided));
    // Packing at 2000 ns a write (shm's price): 126 us saved against 65.5:
    // packed, one write a segment.
    let p = with(CostModel { strided: false, ..CostModel::for_transport(TransportKind::Shm) });
    assert_eq!((p.counters.writes, p.counters.packed_bytes), (512, 2048 * L8B_PER_TOKEN));
    assert!(p.segments.iter().all(|seg| seg.mode == Mode::Packed && seg.src_contiguous()));
    verify(&m, &s, &d, &p, VERIFY_LIMIT).unwrap();
    // shm carries strided writes: one write a segment, nothing packed.
    let p = with(CostModel::for_transport(TransportKind::Shm));
    assert_eq!((p.counters.writes, p.counters.packed_bytes), (512, 0));
    assert!(p.segments.iter().all(|seg| seg.mode == Mode::Strided));
    verify(&m, &s, &d, &p, VERIFY_LIMIT).unwrap();
    // But not rows a head apart at the destination (tp8 -> tp2 NHD): those
    // would be read back row by row for their checksums, so they are packed.
    let nhd = side(&m, "tp=2,block=16", 2048);
    let p = build(&PlanInput { model: &m, tokens: 2048, prefix_tokens: 0, src: &s, dst: &nhd, cost: CostModel::for_transport(TransportKind::Shm) }).unwrap();
    assert!(p.segments.iter().all(|seg| seg.len < kvwire_core::plan::STRIDED_MIN_RUN && seg.mode == Mode::Packed));
    verify(&m, &s, &nhd, &p, VERIFY_LIMIT).unwrap();
    // A shuffled source table leaves segments of one or two 4 KiB runs,
    // apart at the source: a pair saves one write, 2 us, against a gather
    // and an unpack of 8 KiB, 2.05 us: every byte direct again.
    let shuffled = side(&m, "tp=8,block=16,table=shuffle:3", 2048);
    let p = build(&PlanInput { model: &m, tokens: 2048, prefix_tokens: 0, src: &shuffled, dst: &d, cost: CostModel { strided: false, ..CostModel::for_transport(TransportKind::Shm) } }).unwrap();
    assert!(p.segments.iter().all(|seg| seg.count <= 2 && (seg.count == 1 || !seg.src_contiguous())));
    assert_eq!(p.counters.packed_bytes, 0);
    verify(&m, &shuffled, &d, &p, VERIFY_LIMIT).unwrap();
}

// ---------------------------------------------------------------- shard maps

#[test]
fn tp8_over_8_heads_gives_one_head_per_rank() {
    let map = LayoutSpec::parse("tp=8").unwrap().shard_map(&llama8b()).unwrap();
    assert_eq!(map.ranks.len(), 8);
    for (r, rank) in map.ranks.iter().enumerate() {
        assert_eq!(rank.rank, r as u32);
        assert_eq!(rank.layers.len(), 32);
        for (l, ls) in rank.layers.iter().enumerate() {
            assert_eq!(*ls, LayerShard { layer: l as u32, heads: r as u32..r as u32 + 1 });
        }
    }
}

#[test]
fn tp16_over_8_heads_replicates_each_head_on_two_consecutive_ranks() {
    let map = LayoutSpec::parse("tp=16").unwrap().shard_map(&llama8b()).unwrap();
    assert_eq!(map.ranks.len(), 16);
    for (r, rank) in map.ranks.iter().enumerate() {
        let h = r as u32 / 2; // 16 / 8 = 2 ranks per head
        assert!(rank.layers.iter().all(|ls| ls.heads == (h..h + 1)), "rank {r}: {:?}", rank.layers[0]);
    }
}

#[test]
fn tp3_over_8_heads_is_refused_naming_the_numbers() {
    let err = LayoutSpec::parse("tp=3").unwrap().shard_map(&llama8b()).unwrap_err();
    assert_eq!(err, ShardError::Heads { layer: 0, tp: 3, kv_heads: 8 });
    let text = err.to_string();
    assert!(text.contains("tp=3") && text.contains("8 KV heads"), "{text}");
}

#[test]
fn mla_latent_is_on_every_tp_rank() {
    let model = builtin("deepseek-v2-lite").unwrap();
    let map = LayoutSpec::parse("tp=8").unwrap().shard_map(&model).unwrap();
    assert_eq!(map.ranks.len(), 8);
    for rank in &map.ranks {
        assert_eq!(rank.layers.len(), 27);
        assert!(rank.layers.iter().all(|ls| ls.heads == (0..1)));
    }
}

#[test]
fn even_pp_split_of_80_layers_over_3_stages_is_27_27_26() {
    let model = builtin("llama-3.1-70b").unwrap();
    let map = LayoutSpec::parse("pp=3").unwrap().shard_map(&model).unwrap();
    assert_eq!(map.pp_layers, vec![27, 27, 26]);
    let firsts: Vec<(u32, u32)> = map.ranks.iter().map(|r| (r.layers[0].layer, r.layers.last().unwrap().layer)).collect();
    assert_eq!(firsts, vec![(0, 26), (27, 53), (54, 79)]);
}

#[test]
fn explicit_pp_layers_parse_with_commas_inside_the_value() {
    let spec = LayoutSpec::parse("tp=2,pp_layers=27,27,26,block=32,layout=hnd").unwrap();
    assert_eq!((spec.tp, spec.pp, spec.block_size), (2, 3, 32));
    assert_eq!(spec.pp_layers, Some(vec![27, 27, 26]));
    let colons = LayoutSpec::parse("tp=2,pp=3,pp_layers=27:27:26,block=32,layout=hnd").unwrap();
    assert_eq!(colons, spec);
    let map = spec.shard_map(&builtin("llama-3.1-70b").unwrap()).unwrap();
    assert_eq!(map.pp_layers, vec![27, 27, 26]);
    assert_eq!(map.ranks.len(), 6);
}

#[test]
fn pp_layers_with_the_wrong_sum_or_count_are_refused() {
    let model = builtin("llama-3.1-70b").unwrap();
    let err = LayoutSpec::parse("pp_layers=27,27,27").unwrap().shard_map(&model).unwrap_err();
    let ShardError::PpSplit(msg) = &err else { panic!("{err:?}") };
    assert!(msg.contains("81") && msg.contains("80"), "{msg}");
    let err = LayoutSpec::parse("pp=2,pp_layers=27,27,26").unwrap().shard_map(&model).unwrap_err();
    assert!(matches!(err, ShardError::PpSplit(_)), "{err:?}");
    let err = LayoutSpec::parse("pp=81").unwrap().shard_map(&model).unwrap_err();
    assert!(matches!(err, ShardError::PpSplit(_)), "{err:?}");
}

#[test]
fn bad_layout_options_are_refused() {
    for text in ["tp=0", "tp=x", "layout=xyz", "table=sideways", "bogus=1", "27"] {
        assert!(matches!(LayoutSpec::parse(text), Err(ShardError::Option { .. })), "{text}");
    }
    assert_eq!(LayoutSpec::parse("table=shuffle:9").unwrap().table, TableKind::Shuffled { seed: 9 });
}

#[test]
fn rank_is_stage_times_tp_plus_tp_rank() {
    let map = LayoutSpec::parse("tp=2,pp=2").unwrap().shard_map(&llama8b()).unwrap();
    // (stage, tp_rank) of rank r = (r / 2, r % 2); 32 layers / 2 stages = 16; 8 heads / 2 = 4.
    for (r, rank) in map.ranks.iter().enumerate() {
        let (stage, tp_rank) = (r as u32 / 2, r as u32 % 2);
        assert_eq!(rank.rank, r as u32);
        assert_eq!(rank.layers.first().unwrap().layer, stage * 16);
        assert_eq!(rank.layers.last().unwrap().layer, stage * 16 + 15);
        assert!(rank.layers.iter().all(|ls| ls.heads == (tp_rank * 4..tp_rank * 4 + 4)));
    }
}

fn two_layer_4_head_model() -> ModelSpec {
    from_toml_spec("tiny", "[[layers]]\nrepeat = 2\nattention = \"dense\"\nkv_heads = 4\nhead_dim = 8\n").unwrap()
}

const EXPLICIT_MAP: &str = r#"
[[rank]]
rank = 0
layers = [0, 2]
heads = [0, 2]

[[rank]]
rank = 1
layers = [0, 1]
heads = [2, 4]

[[rank]]
rank = 2
layers = [1, 2]
heads = [2, 4]
"#;

#[test]
fn explicit_toml_map_resolves_and_plans() {
    let model = two_layer_4_head_model();
    let spec = LayoutSpec::parse("block=4").unwrap().with_explicit_toml(EXPLICIT_MAP).unwrap();
    let map = spec.shard_map(&model).unwrap();
    let held: Vec<Vec<LayerShard>> = map.ranks.iter().map(|r| r.layers.clone()).collect();
    assert_eq!(
        held,
        vec![
            vec![LayerShard { layer: 0, heads: 0..2 }, LayerShard { layer: 1, heads: 0..2 }],
            vec![LayerShard { layer: 0, heads: 2..4 }],
            vec![LayerShard { layer: 1, heads: 2..4 }],
        ]
    );

    let tokens = 18; // 4.5 blocks of 4
    let src = Side::new(&model, &spec, bf16(), tokens).unwrap();
    let dst = side(&model, "tp=2,block=8,layout=hnd", tokens);
    let plan = plan_of(&model, &src, &dst, tokens, 0);
    verify(&model, &src, &dst, &plan, VERIFY_LIMIT).unwrap();
    assert_counters_consistent(&plan);
    let row = 8 * 2; // head_dim × bf16
    // rank 0: 2 layers × 2 heads × (K, V); ranks 1 and 2: 1 layer × 2 heads × (K, V).
    assert_eq!(sent(&plan), vec![2 * 2 * 2 * row * tokens, 2 * 2 * row * tokens, 2 * 2 * row * tokens]);
    assert_eq!(plan.counters.total_bytes_moved, 2 * 4 * 2 * row * tokens);
}

/// An explicit map that leaves out a layer storing only constant state is
/// accepted; as a destination the state is then silently never sent, and as
/// a source the plan fails with a misleading "no source rank holds head 0".
#[test]
fn explicit_map_missing_a_state_layer_is_accepted() {
    let model = from_toml_spec(
        "s",
        "[[layers]]\nattention = \"dense\"\nkv_heads = 2\nhead_dim = 4\n\n[[layers]]\nattention = \"none\"\nstate_bytes = 100\n",
    )
    .unwrap();
    let map = "[[rank]]\nrank = 0\nlayers = [0, 1]\nheads = [0, 2]\n";
    let err = LayoutSpec::default().with_explicit_toml(map).unwrap().shard_map(&model);
    assert!(matches!(err, Err(ShardError::Explicit(_))), "layer 1's 100 state bytes live nowhere: {err:?}");
}

#[test]
fn explicit_map_missing_a_head_is_refused() {
    let model = two_layer_4_head_model();
    let without_rank_2 = EXPLICIT_MAP.split("[[rank]]\nrank = 2").next().unwrap();
    let err = LayoutSpec::default().with_explicit_toml(without_rank_2).unwrap().shard_map(&model).unwrap_err();
    assert_eq!(err, ShardError::Explicit("no rank holds head 2 of layer 1".into()));
    let past = "[[rank]]\nrank = 0\nlayers = [0, 2]\nheads = [0, 5]\n";
    let err = LayoutSpec::default().with_explicit_toml(past).unwrap().shard_map(&model).unwrap_err();
    assert!(matches!(err, ShardError::Explicit(_)), "{err:?}");
    let bad = LayoutSpec::default().with_explicit_toml("[[rank]]\nrank = 0\nlayers = [0, 2]\n").unwrap_err();
    assert!(matches!(bad, ShardError::Explicit(_)), "{bad:?}");
}

// ---------------------------------------------------------- hand-derived plans

#[test]
fn tp8_to_tp2_moves_the_payload_once() {
    // llama-3.1-70b: 80 layers, 8 KV heads, head_dim 8192 / 64 = 128, bf16.
    let model = builtin("llama-3.1-70b").unwrap();
    let tokens = 17; // one full block of 16 and a partial one
    let payload = tokens * 80 * 8 * 2 * 128 * 2;
    let (_, _, plan) = planned(&model, "tp=8", "tp=2", tokens, 0);
    assert_eq!(plan.counters.total_bytes_moved, payload);
    assert_eq!(plan.counters.reused_bytes, 0);
    assert_eq!(received(&plan), vec![payload / 2; 2]);
    assert_eq!(sent(&plan), vec![payload / 8; 8]);
}

#[test]
fn tp16_to_tp4_with_replicated_source_moves_the_payload_once_and_spreads_load() {
    let model = llama8b();
    let tokens = 40;
    let payload = tokens * L8B_PER_TOKEN;
    let (_, _, plan) = planned(&model, "tp=16", "tp=4", tokens, 0);
    // Each head lives on two source ranks, but is sent once, not twice.
    assert_eq!(plan.counters.total_bytes_moved, payload);
    assert_eq!(received(&plan), vec![payload / 4; 4]);
    // 16 source ranks share the payload evenly: every one sends the same.
    assert_eq!(sent(&plan), vec![payload / 16; 16]);
}

#[test]
fn tp2_to_tp16_with_replicated_destination_moves_the_payload_twice() {
    let model = llama8b();
    let tokens = 40;
    let payload = tokens * L8B_PER_TOKEN;
    let (_, _, plan) = planned(&model, "tp=2", "tp=16", tokens, 0);
    assert_eq!(plan.counters.total_bytes_moved, 2 * payload);
    // A destination rank holds one head of eight: payload / 8.
    assert_eq!(received(&plan), vec![payload / 8; 16]);
    // A source rank holds half the heads, each wanted by two destinations.
    assert_eq!(sent(&plan), vec![payload; 2]);
}

#[test]
fn mla_tp8_to_tp4_sends_every_destination_the_whole_latent() {
    // deepseek-v2-lite: 27 MLA layers, latent = kv_lora_rank 512 + qk_rope_head_dim 64.
    let model = builtin("deepseek-v2-lite").unwrap();
    let tokens = 40;
    let layer_bytes = 576 * 2 * tokens;
    let per_dst = 27 * layer_bytes;
    let (_, _, plan) = planned(&model, "tp=8", "tp=4", tokens, 0);
    assert_eq!(received(&plan), vec![per_dst; 4]);
    assert_eq!(plan.counters.total_bytes_moved, 4 * per_dst);
    let s = sent(&plan);
    assert_eq!(s.len(), 8);
    let (min, max) = (*s.iter().min().unwrap(), *s.iter().max().unwrap());
    // 4 × 27 = 108 layer copies over 8 replicas: 13 or 14 each.
    assert!(max - min <= layer_bytes, "src load {s:?}");
    assert!(min >= 13 * layer_bytes, "src load {s:?}");
}

#[test]
fn unequal_pp_split_to_pp1() {
    let model = llama8b();
    let tokens = 40;
    let (src, _, plan) = planned(&model, "tp=2,pp_layers=11,10,11", "tp=1", tokens, 0);
    assert_eq!(src.shard.pp_layers, vec![11, 10, 11]);
    // A source rank holds its stage's layers × 4 heads × (K, V).
    let per_layer = 4 * 2 * L8B_ROW * tokens;
    assert_eq!(sent(&plan), vec![11 * per_layer, 11 * per_layer, 10 * per_layer, 10 * per_layer, 11 * per_layer, 11 * per_layer]);
    assert_eq!(received(&plan), vec![tokens * L8B_PER_TOKEN]);
}

#[test]
fn prefix_hit_with_partial_final_block() {
    // 2 layers × 4 KV heads × (K, V) × head_dim 64 × bf16 = 2048 bytes per token.
    let model = from_toml_spec("p", "[[layers]]\nrepeat = 2\nattention = \"dense\"\nkv_heads = 4\nhead_dim = 64\n").unwrap();
    let per_token = 2 * 4 * 2 * 64 * 2;
    let tokens = 1000; // 62 full blocks of 16 and one of 8
    for dst in ["tp=2,block=16", "tp=2,block=32,layout=hnd,table=shuffle:7"] {
        for prefix in [512, 500, 0, 1000] {
            let (_, _, plan) = planned(&model, "tp=4,block=16", dst, tokens, prefix);
            assert_eq!(plan.counters.reused_bytes, prefix * per_token, "{dst} prefix {prefix}");
            assert_eq!(plan.counters.total_bytes_moved, (tokens - prefix) * per_token, "{dst} prefix {prefix}");
            assert_eq!(received(&plan), vec![(tokens - prefix) * per_token / 2; 2]);
            if prefix == tokens {
                assert!(plan.segments.is_empty());
            }
        }
    }
}

#[test]
fn sliding_window_with_sinks_moves_only_retained_positions() {
    let model = from_toml_spec(
        "w",
        "[[layers]]\nattention = \"dense\"\nkv_heads = 2\nhead_dim = 8\nwindow = 10\nsinks = 2\n",
    )
    .unwrap();
    let tokens = 40;
    let per_pos = 2 * 2 * 8 * 2; // heads × (K, V) × head_dim × bf16
    // Kept: sinks 0..2 and the window 30..40, which starts mid-block.
    for (prefix, moved, reused) in [(0, 2 + 10, 0), (5, 10, 2), (35, 5, 2 + 5), (40, 0, 12)] {
        let (_, _, plan) = planned(&model, "tp=2,block=16", "tp=1,block=8,layout=hnd,table=shuffle:3", tokens, prefix);
        assert_eq!(plan.counters.total_bytes_moved, moved * per_pos, "prefix {prefix}");
        assert_eq!(plan.counters.reused_bytes, reused * per_pos, "prefix {prefix}");
    }
}

#[test]
fn quantized_formats_move_rows_with_their_scales_and_no_padding() {
    let model = llama8b();
    let tokens = 20;
    // (format, row bytes of 128 elements, static scale bytes per tensor)
    let cases = [
        ("fp32", 128 * 4, 0),
        ("fp8_e4m3", 128, 4),
        ("fp8_e4m3_pth", 128 + 4, 0),       // f32 scale per row
        ("int4_g32", 128 / 2 + 128 / 32 * 4, 0), // 4 groups × (f16 scale + f16 zero)
    ];
    for (name, row, scale) in cases {
        let format = CacheFormat::parse(name).unwrap();
        let s = Side::new(&model, &LayoutSpec::parse("tp=8").unwrap(), format, tokens).unwrap();
        let padded = LayoutSpec::parse("tp=2,row_align=64,block_align=4096,layout=hnd").unwrap();
        let d = Side::new(&model, &padded, format, tokens).unwrap();
        let plan = plan_of(&model, &s, &d, tokens, 0);
        verify(&model, &s, &d, &plan, VERIFY_LIMIT).unwrap();
        assert_counters_consistent(&plan);
        assert_eq!(plan.counters.total_bytes_moved, tokens * 32 * 8 * 2 * row, "{name}");
        // Each destination rank gets a static scale per (layer, tensor).
        assert_eq!(plan.counters.metadata_bytes, 2 * 32 * 2 * scale, "{name}");
    }
}

#[test]
fn nhd_tp8_to_tp2_head_rows_are_packed() {
    let model = llama8b();
    let tokens = 40;
    let (_, _, plan) = planned(&model, "tp=8", "tp=2", tokens, 0);
    // A 256-byte row per token: (40 - 1) × 500 ns saved > 2 × 40 × 256 B / 8 B/ns copied.
    for s in &plan.segments {
        assert_eq!((s.len, s.mode), (L8B_ROW, Mode::Packed), "{s:?}");
    }
    assert_eq!(plan.counters.packed_bytes, plan.counters.total_bytes_moved);
    // A packed segment is one write.
    assert_eq!(plan.counters.writes, plan.counters.segments);
    // Contiguous tables: one strided segment per (dst rank, layer, tensor, head), at any token count.
    assert_eq!(plan.counters.segments, 2 * 32 * 2 * 4);
    let (_, _, longer) = planned(&model, "tp=8", "tp=2", 72, 0);
    assert_eq!(longer.counters.segments, 2 * 32 * 2 * 4);
}

#[test]
fn hnd_tp8_to_tp2_block_slabs_are_direct() {
    let model = llama8b();
    let tokens = 64; // whole blocks only, so every slab is full
    let (_, _, plan) = planned(&model, "tp=8,layout=hnd", "tp=2,layout=hnd", tokens, 0);
    // One head's block is 16 tokens × 256 bytes = 4096 contiguous bytes:
    // (4 - 1) × 500 ns saved < 2 × 4 × 4096 B / 8 B/ns copied.
    for s in &plan.segments {
        assert_eq!((s.len, s.mode), (16 * L8B_ROW, Mode::Direct), "{s:?}");
    }
    assert_eq!(plan.counters.direct_bytes, plan.counters.total_bytes_moved);
    assert_eq!(plan.counters.packed_bytes, 0);
    // One segment per (dst rank, layer, tensor, head), one write per block of it.
    assert_eq!(plan.counters.segments, 2 * 32 * 2 * 4);
    assert_eq!(plan.counters.writes, 2 * 32 * 2 * 4 * (64 / 16));
}

#[test]
fn same_layout_contiguous_is_one_segment_per_layer_tensor() {
    let model = llama8b();
    let tokens = 40;
    let (_, _, plan) = planned(&model, "tp=1", "tp=1", tokens, 0);
    assert_eq!(plan.counters.segments, 32 * 2);
    for s in &plan.segments {
        assert_eq!((s.len, s.count, s.mode), (tokens * 8 * L8B_ROW, 1, Mode::Direct), "{s:?}");
    }
}

// -------------------------------------------------------------- prefix reuse

fn identity() -> CacheIdentity {
    CacheIdentity {
        model_digest: "m1".into(),
        adapter_digest: "a1".into(),
        format: "bf16/v1".into(),
        tenant: "t1".into(),
        rope: "theta=500000".into(),
        position_offset: 0,
    }
}

#[test]
fn prefix_reuse_matches_give_min_of_held_and_tokens() {
    assert_eq!(check_prefix(&identity(), &identity(), 100, 200), Ok(100));
    assert_eq!(check_prefix(&identity(), &identity(), 300, 200), Ok(200));
    assert_eq!(check_prefix(&identity(), &identity(), 0, 200), Ok(0));
}

#[test]
fn each_identity_mismatch_is_refused_naming_its_field() {
    type Mutate = fn(&mut CacheIdentity);
    let cases: [(Mutate, &str); 6] = [
        (|h| h.model_digest = "m2".into(), "model digest mismatch: expected m1, got m2"),
        (|h| h.adapter_digest = "a2".into(), "adapter digest mismatch: expected a1, got a2"),
        (|h| h.format = "fp8_e4m3/v1".into(), "cache format mismatch: expected bf16/v1, got fp8_e4m3/v1"),
        (|h| h.tenant = "t2".into(), "tenant mismatch: expected t1, got t2"),
        (|h| h.rope = "theta=10000".into(), "rope parameters mismatch: expected theta=500000, got theta=10000"),
        (|h| h.position_offset = 7, "position offset mismatch: expected 0, got 7"),
    ];
    let mut variants = Vec::new();
    for (mutate, text) in cases {
        let mut held = identity();
        mutate(&mut held);
        let err = check_prefix(&identity(), &held, 100, 200).unwrap_err();
        assert_eq!(err.to_string(), text);
        variants.push(std::mem::discriminant(&err));
    }
    let distinct: std::collections::HashSet<_> = variants.iter().collect();
    assert_eq!(distinct.len(), 6, "every field has its own variant");
    let mut held = identity();
    held.tenant = "t9".into();
    assert_eq!(
        check_prefix(&identity(), &held, 1, 1),
        Err(ReuseRefusal::Tenant { expected: "t1".into(), got: "t9".into() })
    );
}

// ---------------------------------------------------------------- bad input

#[test]
fn plan_refuses_bad_requests() {
    let model = two_layer_4_head_model();
    let (s, d) = (side(&model, "tp=2", 40), side(&model, "tp=1", 40));
    let input = |tokens, prefix_tokens, src, dst| PlanInput { model: &model, tokens, prefix_tokens, src, dst, cost: CostModel::default() };
    assert_eq!(build(&input(40, 41, &s, &d)).unwrap_err(), PlanError::PrefixTooLong { prefix: 41, tokens: 40 });
    assert_eq!(build(&input(0, 0, &s, &d)).unwrap_err(), PlanError::ZeroTokens);
    let layout = LayoutSpec::parse("tp=2").unwrap();
    assert_eq!(Side::new(&model, &layout, bf16(), 0).unwrap_err(), PlanError::ZeroTokens);

    let fp8 = Side::new(&model, &LayoutSpec::parse("tp=1").unwrap(), CacheFormat::parse("fp8_e4m3").unwrap(), 40).unwrap();
    assert_eq!(
        build(&input(40, 0, &s, &fp8)).unwrap_err(),
        PlanError::FormatMismatch { src: "bf16/v1".into(), dst: "fp8_e4m3/v1".into() }
    );

    // Sides sized for 16 tokens (one block) cannot carry 40.
    let short = side(&model, "tp=1", 16);
    assert!(matches!(build(&input(40, 0, &s, &short)), Err(PlanError::BlockTable(_))));
}

#[test]
fn block_tables_are_checked() {
    let model = two_layer_4_head_model();
    let layout = LayoutSpec::parse("tp=1,block=16").unwrap();
    let with = |table: Vec<u32>, cap| Side::with_table(&model, &layout, bf16(), 40, table, cap);
    let msg = |r: Result<Side, PlanError>| match r {
        Err(PlanError::BlockTable(m)) => m,
        other => panic!("expected a block table error, got {other:?}"),
    };
    assert!(msg(with(vec![0, 1, 1], 4)).contains("appears twice"));
    assert!(msg(with(vec![0, 1, 5], 4)).contains("past"));
    // 40 tokens at 16 per block need ceil(40 / 16) = 3 blocks.
    assert!(msg(with(vec![0, 1], 4)).contains("need 3"));
    // A scattered, valid table plans and verifies.
    let src = with(vec![3, 0, 2], 4).unwrap();
    let dst = side(&model, "tp=2,block=8,layout=hnd", 40);
    let plan = plan_of(&model, &src, &dst, 40, 0);
    verify(&model, &src, &dst, &plan, VERIFY_LIMIT).unwrap();
    assert_eq!(plan.counters.total_bytes_moved, 40 * 2 * 4 * 2 * 8 * 2);
}

#[test]
fn execute_refuses_out_of_bounds_segment_and_touches_nothing() {
    let model = two_layer_4_head_model();
    let tokens = 40;
    let (s, d) = (side(&model, "tp=1", tokens), side(&model, "tp=1", tokens));
    let plan = plan_of(&model, &s, &d, tokens, 0);
    let src = Buffers::alloc(&model, &s, 7);
    // 3 blocks × 16 tokens × 4 heads × 16-byte rows.
    let region_len = 3 * 16 * 4 * 16;

    let mut bad = plan.clone();
    let mut segs = bad.segments.to_vec();
    let last = segs.len() - 1;
    let len = segs[last].len;
    assert_eq!((len, segs[last].count), (tokens * 4 * 16, 1));
    segs[last].dst_offset = region_len - len + 1;
    bad.segments = segs.into();
    let mut dst = Buffers::alloc(&model, &d, CANARY);
    let before = dst.clone();
    assert_eq!(
        execute(&bad, &src, &mut dst),
        Err(ExecError::OutOfBounds { index: last, side: "destination", start: region_len - len + 1, end: region_len + 1, region_len })
    );
    assert_eq!(dst, before, "earlier in-bounds segments must not have run");

    let mut bad = plan.clone();
    let mut segs = bad.segments.to_vec();
    segs[last].src_offset = region_len;
    bad.segments = segs.into();
    let err = execute(&bad, &src, &mut dst).unwrap_err();
    assert!(matches!(err, ExecError::OutOfBounds { side: "source", .. }), "{err:?}");
    assert_eq!(dst, before);

    assert_eq!(execute(&plan, &src, &mut dst), Ok(2 * 2 * tokens * 4 * 16));
}

// ---------------------------------------------------------- property tests

#[derive(Debug, Clone, Copy)]
enum ToyKind {
    Dense { hd: u32, vd: u32 },
    Mla { rank: u32, rope: u32 },
    /// Shares an earlier storing layer, picked by this index (as generated).
    Shared(Index),
    /// Shares layer `.0` (after [`Toy::resolved`]).
    SharedWith(usize),
    None,
}

#[derive(Debug, Clone, Copy)]
struct ToyLayer {
    kind: ToyKind,
    /// (window, sinks)
    window: Option<(u64, Option<u64>)>,
    state: u64,
}

#[derive(Debug, Clone)]
struct Toy {
    kv_heads: u32,
    layers: Vec<ToyLayer>,
}

impl Toy {
    /// Resolves shared layers to an earlier storing layer; a model's first
    /// storing layer cannot be shared, so those become dense.
    fn resolved(mut self) -> Toy {
        let mut storing: Vec<usize> = Vec::new();
        for i in 0..self.layers.len() {
            if let ToyKind::Shared(idx) = self.layers[i].kind {
                if storing.is_empty() {
                    self.layers[i].kind = ToyKind::Dense { hd: 4, vd: 4 };
                } else {
                    self.layers[i].kind = ToyKind::SharedWith(storing[idx.index(storing.len())]);
                    self.layers[i].window = None;
                    continue;
                }
            }
            if matches!(self.layers[i].kind, ToyKind::Dense { .. } | ToyKind::Mla { .. }) {
                storing.push(i);
            }
        }
        self
    }

    fn toml(&self) -> String {
        let mut t = String::new();
        for l in &self.layers {
            t.push_str("[[layers]]\n");
            match l.kind {
                ToyKind::Dense { hd, vd } => {
                    t += &format!("attention = \"dense\"\nkv_heads = {}\nhead_dim = {hd}\n", self.kv_heads);
                    if vd != hd {
                        t += &format!("v_head_dim = {vd}\n");
                    }
                }
                ToyKind::Mla { rank, rope } => t += &format!("attention = \"mla\"\nkv_lora_rank = {rank}\nqk_rope_head_dim = {rope}\n"),
                ToyKind::SharedWith(j) => t += &format!("attention = \"shared\"\nshares_with = {j}\n"),
                ToyKind::Shared(_) => unreachable!("resolved before use"),
                ToyKind::None => t += "attention = \"none\"\n",
            }
            if let Some((w, sinks)) = l.window {
                t += &format!("window = {w}\n");
                if let Some(s) = sinks {
                    t += &format!("sinks = {s}\n");
                }
            }
            if l.state > 0 {
                t += &format!("state_bytes = {}\n", l.state);
            }
        }
        t
    }

    /// Is position `p` of a `tokens` sequence kept by layer `i`? From the
    /// retention definition: the first `sinks` and the last `window` positions.
    fn keeps(&self, i: usize, tokens: u64, p: u64) -> bool {
        match self.layers[i].window {
            None => true,
            Some((w, sinks)) => {
                let s = sinks.unwrap_or(0);
                tokens <= s + w || p < s || p >= tokens - w
            }
        }
    }

    /// Elements per row of each stored tensor of layer `i`.
    fn dims(&self, i: usize) -> Vec<u32> {
        match self.layers[i].kind {
            ToyKind::Dense { hd, vd } => vec![hd, vd],
            ToyKind::Mla { rank, rope } => vec![rank + rope],
            ToyKind::Shared(_) | ToyKind::SharedWith(_) | ToyKind::None => vec![],
        }
    }
}

fn dim() -> impl Strategy<Value = u32> {
    prop::sample::select(vec![4u32, 8, 16])
}

fn window() -> impl Strategy<Value = Option<(u64, Option<u64>)>> {
    prop::option::weighted(0.35, (1u64..60, prop::option::of(0u64..5)))
}

fn toy_layer() -> impl Strategy<Value = ToyLayer> {
    let state = prop_oneof![5 => Just(0u64), 1 => 1u64..64];
    let kind = prop_oneof![
        5 => (dim(), prop_oneof![3 => Just(None), 1 => dim().prop_map(Some)])
            .prop_map(|(hd, vd)| ToyKind::Dense { hd, vd: vd.unwrap_or(hd) }),
        1 => (dim(), prop::sample::select(vec![0u32, 4])).prop_map(|(rank, rope)| ToyKind::Mla { rank, rope }),
        1 => any::<Index>().prop_map(ToyKind::Shared),
        1 => Just(ToyKind::None),
    ];
    (kind, window(), state).prop_map(|(kind, window, state)| match kind {
        // A layer with no attention keeps constant state (or nothing).
        ToyKind::None => ToyLayer { kind, window: None, state: if state == 0 { 24 } else { state } },
        _ => ToyLayer { kind, window, state },
    })
}

fn toy() -> impl Strategy<Value = Toy> {
    (prop::sample::select(vec![1u32, 2, 4, 8]), prop::collection::vec(toy_layer(), 1..=4))
        .prop_map(|(kv_heads, layers)| Toy { kv_heads, layers }.resolved())
}

#[derive(Debug, Clone)]
struct SideGen {
    tp: u32,
    /// Stage boundary after layer i (first `layers - 1` used).
    cuts: Vec<bool>,
    explicit_split: bool,
    block: u32,
    hnd: bool,
    shuffle: Option<u64>,
    row_align: u32,
    block_align: u32,
}

impl SideGen {
    fn layout(&self, layers: usize) -> String {
        let mut split = vec![1u32];
        for &cut in &self.cuts[..layers - 1] {
            if cut {
                split.push(1);
            } else {
                *split.last_mut().unwrap() += 1;
            }
        }
        let mut s = format!("tp={},pp={}", self.tp, split.len());
        if self.explicit_split {
            let list: Vec<String> = split.iter().map(u32::to_string).collect();
            s += &format!(",pp_layers={}", list.join(","));
        }
        s += &format!(
            ",block={},layout={},row_align={},block_align={}",
            self.block,
            if self.hnd { "hnd" } else { "nhd" },
            self.row_align,
            self.block_align
        );
        match self.shuffle {
            Some(seed) => s += &format!(",table=shuffle:{seed}"),
            None => s += ",table=contig",
        }
        s
    }
}

fn side_gen() -> impl Strategy<Value = SideGen> {
    (
        prop::sample::select(vec![1u32, 2, 3, 4, 8, 16]),
        prop::collection::vec(prop::bool::weighted(0.3), 3),
        any::<bool>(),
        prop::sample::select(vec![1u32, 2, 4, 8, 16, 3, 5]),
        any::<bool>(),
        prop::option::of(0u64..1000),
        prop::sample::select(vec![1u32, 8, 64]),
        prop::sample::select(vec![1u32, 128]),
    )
        .prop_map(|(tp, cuts, explicit_split, block, hnd, shuffle, row_align, block_align)| SideGen {
            tp,
            cuts,
            explicit_split,
            block,
            hnd,
            shuffle,
            row_align,
            block_align,
        })
}

/// (tokens, prefix): tokens in 1..200 with 1 favoured, prefix anywhere in 0..=tokens.
fn request() -> impl Strategy<Value = (u64, u64)> {
    (prop_oneof![1 => Just(1u64), 6 => 1u64..200], 0u8..4, any::<Index>()).prop_map(|(tokens, pick, idx)| {
        let prefix = match pick {
            0 => 0,
            1 => tokens,
            _ => idx.index(tokens as usize + 1) as u64,
        };
        (tokens, prefix)
    })
}

fn cost() -> impl Strategy<Value = CostModel> {
    prop::sample::select(vec![0.0f64, 500.0, 1e6]).prop_map(|per_write_ns| CostModel { per_write_ns, ..CostModel::default() })
}

/// Builds a side, rejecting the case when its TP cannot shard the model's heads.
fn side_or_reject(model: &ModelSpec, layout: &str, format: CacheFormat, tokens: u64) -> Result<Side, TestCaseError> {
    match Side::new(model, &LayoutSpec::parse(layout).unwrap(), format, tokens) {
        Ok(s) => Ok(s),
        Err(PlanError::Shard(ShardError::Heads { .. })) => Err(TestCaseError::reject("tp does not fit kv_heads")),
        Err(e) => Err(TestCaseError::fail(format!("{layout}: {e}"))),
    }
}

/// Plans `src` → `dst`, runs the oracle, and checks the counters against
/// bytes counted position by position from the toy model's definition.
#[allow(clippy::too_many_arguments)]
fn check_plan(
    toy: &Toy,
    model: &ModelSpec,
    src: &Side,
    dst: &Side,
    format: CacheFormat,
    tokens: u64,
    prefix: u64,
    cost: CostModel,
) -> Result<(), TestCaseError> {
    let plan = build(&PlanInput { model, tokens, prefix_tokens: prefix, src, dst, cost })
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let report = verify(model, src, dst, &plan, VERIFY_LIMIT);
    prop_assert!(report.is_ok(), "{:?}", report);

    let c = &plan.counters;
    prop_assert_eq!(sent(&plan).iter().sum::<u64>(), c.total_bytes_moved);
    prop_assert_eq!(received(&plan).iter().sum::<u64>(), c.total_bytes_moved);
    prop_assert_eq!(c.packed_bytes + c.direct_bytes, c.total_bytes_moved);
    prop_assert_eq!(report.unwrap().bytes_copied, c.total_bytes_moved);

    let mut reused = 0;
    for rank in &dst.shard.ranks {
        let mut want = 0;
        for ls in &rank.layers {
            let i = ls.layer as usize;
            let heads = u64::from(ls.heads.end - ls.heads.start);
            let row: u64 = toy.dims(i).iter().map(|&d| format.row_bytes(d)).sum();
            let kept = |r: std::ops::Range<u64>| r.filter(|&p| toy.keeps(i, tokens, p)).count() as u64;
            want += kept(prefix..tokens) * heads * row + toy.layers[i].state;
            reused += kept(0..prefix) * heads * row;
        }
        prop_assert_eq!(c.dst_ranks[rank.rank as usize].bytes, want, "dst rank {}", rank.rank);
    }
    prop_assert_eq!(c.reused_bytes, reused);
    Ok(())
}

/// Random choices for an explicit shard map, per layer: where the heads are
/// cut into chunks, which rank takes each chunk, and extra overlapping
/// replicas with their own head boundaries on the ranks left over.
#[derive(Debug, Clone)]
struct MapGen {
    ranks: usize,
    layers: Vec<LayerMapGen>,
}

/// (cut after head h, chunk → rank picks, extra replica (start, length) picks).
type LayerMapGen = (Vec<bool>, Vec<Index>, Vec<Option<(Index, Index)>>);

impl MapGen {
    fn toml(&self, toy: &Toy) -> String {
        let mut t = String::new();
        for (l, (cuts, picks, extras)) in self.layers.iter().take(toy.layers.len()).enumerate() {
            let heads = match toy.layers[l].kind {
                ToyKind::Dense { .. } => toy.kv_heads as usize,
                _ => 1,
            };
            let mut chunks = Vec::with_capacity(heads);
            chunks.push(0..1);
            for h in 1..heads {
                if cuts[h - 1] && chunks.len() < self.ranks {
                    chunks.push(h..h + 1);
                } else {
                    chunks.last_mut().unwrap().end = h + 1;
                }
            }
            let mut free: Vec<usize> = (0..self.ranks).collect();
            let mut entry = |rank: usize, hs: std::ops::Range<usize>| {
                t += &format!("[[rank]]\nrank = {rank}\nlayers = [{l}, {}]\nheads = [{}, {}]\n\n", l + 1, hs.start, hs.end);
            };
            for (chunk, pick) in chunks.into_iter().zip(picks) {
                entry(free.remove(pick.index(free.len())), chunk);
            }
            for (rank, extra) in free.into_iter().zip(extras) {
                if let Some((a, b)) = extra {
                    let start = a.index(heads);
                    entry(rank, start..start + 1 + b.index(heads - start));
                }
            }
        }
        t
    }
}

fn map_gen() -> impl Strategy<Value = MapGen> {
    let layer = (
        prop::collection::vec(any::<bool>(), 7),
        prop::collection::vec(any::<Index>(), 8),
        prop::collection::vec(prop::option::weighted(0.5, (any::<Index>(), any::<Index>())), 8),
    );
    (1usize..=5, prop::collection::vec(layer, 4)).prop_map(|(ranks, layers)| MapGen { ranks, layers })
}

/// A side from an explicit map, with the geometry of `geo`.
fn explicit_side(model: &ModelSpec, toy: &Toy, map: &MapGen, geo: &SideGen, format: CacheFormat, tokens: u64) -> Result<Side, TestCaseError> {
    let text = map.toml(toy);
    let layout = LayoutSpec::parse(&geo.layout(toy.layers.len()))
        .unwrap()
        .with_explicit_toml(&text)
        .map_err(|e| TestCaseError::fail(format!("{e}\n{text}")))?;
    Side::new(model, &layout, format, tokens).map_err(|e| TestCaseError::fail(format!("{e}\n{text}")))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, max_global_rejects: 4096, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn any_layout_to_any_layout_writes_every_destination_byte_once(
        toy in toy(),
        src_gen in side_gen(),
        dst_gen in side_gen(),
        format in prop::sample::select(FORMATS.to_vec()),
        (tokens, prefix) in request(),
        cost in cost(),
    ) {
        let model = from_toml_spec("toy", &toy.toml()).map_err(|e| TestCaseError::fail(format!("{e}\n{}", toy.toml())))?;
        let n = toy.layers.len();
        let src = side_or_reject(&model, &src_gen.layout(n), format, tokens)?;
        let dst = side_or_reject(&model, &dst_gen.layout(n), format, tokens)?;
        check_plan(&toy, &model, &src, &dst, format, tokens, prefix, cost)?;
    }

    #[test]
    fn explicit_maps_with_overlapping_replicas_write_every_destination_byte_once(
        toy in toy(),
        src_map in map_gen(),
        src_gen in side_gen(),
        dst_map in map_gen(),
        dst_gen in side_gen(),
        dst_explicit in any::<bool>(),
        format in prop::sample::select(FORMATS.to_vec()),
        (tokens, prefix) in request(),
    ) {
        let model = from_toml_spec("toy", &toy.toml()).map_err(|e| TestCaseError::fail(format!("{e}\n{}", toy.toml())))?;
        let src = explicit_side(&model, &toy, &src_map, &src_gen, format, tokens)?;
        let dst = if dst_explicit {
            explicit_side(&model, &toy, &dst_map, &dst_gen, format, tokens)?
        } else {
            side_or_reject(&model, &dst_gen.layout(toy.layers.len()), format, tokens)?
        };
        check_plan(&toy, &model, &src, &dst, format, tokens, prefix, CostModel::default())?;
    }
}

/// Found by the layout_spec fuzz target: the split's sum wrapped to the
/// layer count, then indexed past the model.
#[test]
fn pp_layers_sum_overflow_is_refused() {
    let model = builtin("llama-3.1-8b").unwrap();
    for text in ["tp=1,pp_layers=33,4294967295", "tp=1,pp_layers=4294967295,33"] {
        let err = LayoutSpec::parse(text).unwrap().shard_map(&model).unwrap_err();
        assert!(matches!(err, ShardError::PpSplit(_)), "{text}: {err:?}");
    }
}
