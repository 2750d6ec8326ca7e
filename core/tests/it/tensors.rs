//! Engine tensors: presets, validation of what a client sends, and plans
//! between engine layouts proven on real tensor buffers.
//!
//! Every expected offset comes from a formula written here per preset, from
//! the engine's published tensor shape, never from the module under test.

use kvwire_core::format::CacheFormat;
use kvwire_core::layout::{from_toml_spec, ModelSpec, Tensor};
use kvwire_core::plan::{build, CostModel, Plan, PlanInput, Side};
use kvwire_core::shard::{LayoutSpec, RegionId};
use kvwire_core::tensors::{match_tensors, KvOrder, Role, TensorDesc, TensorError};
use kvwire_core::verify::verify;
use proptest::prelude::*;

fn model(layers: u32, heads: u32, dim: u32) -> ModelSpec {
    from_toml_spec("tiny", &format!("[[layers]]\nrepeat = {layers}\nattention = \"dense\"\nkv_heads = {heads}\nhead_dim = {dim}\n")).unwrap()
}

fn bf16() -> CacheFormat {
    CacheFormat::parse("bf16").unwrap()
}

fn side(model: &ModelSpec, layout: &str, tokens: u64) -> Side {
    Side::new(model, &LayoutSpec::parse(layout).unwrap(), bf16(), tokens).unwrap()
}

/// Element index of (layer-in-tensor l, kv, block b, position t, head h) per
/// preset, from each engine's tensor shape (B blocks, T per block, H heads,
/// D dim, L layers in a cross-layer tensor).
fn formula(preset: &str, l: u64, kv: u64, b: u64, t: u64, h: u64, [nl, nb, nt, nh, nd]: [u64; 5]) -> u64 {
    match preset {
        // (2, B, T, H, D) per layer
        "vllm_nhd" => (((kv * nb + b) * nt + t) * nh + h) * nd,
        // (2, B, H, T, D) per layer
        "vllm_hnd" => (((kv * nb + b) * nh + h) * nt + t) * nd,
        // (B, 2, T, H, D) per layer
        "flashinfer" => (((b * 2 + kv) * nt + t) * nh + h) * nd,
        // (B, 2, H, T, D) per layer
        "flashinfer_hnd" => (((b * 2 + kv) * nh + h) * nt + t) * nd,
        // (B, H, T, 2*D) per layer, K in the first half of the last dim
        "vllm_cpu" => ((b * nh + h) * nt + t) * 2 * nd + kv * nd,
        // (B, L, 2, T, H, D) per rank
        "vllm_cross" => ((((b * nl + l) * 2 + kv) * nt + t) * nh + h) * nd,
        _ => unreachable!(),
    }
}

const PRESETS: [&str; 6] = ["vllm_nhd", "vllm_hnd", "flashinfer", "flashinfer_hnd", "vllm_cpu", "vllm_cross"];

#[test]
fn every_preset_places_every_row_where_the_engine_shape_says() {
    let m = model(3, 4, 8);
    for preset in PRESETS {
        let s = side(&m, &format!("tp=2,block=4,kv={preset}"), 10);
        for rank in 0..2u32 {
            let (tensors, places) = (&s.engine[rank as usize].tensors, &s.engine[rank as usize].places);
            let cross = preset == "vllm_cross";
            assert_eq!(tensors.len(), if cross { 1 } else { 3 }, "{preset}");
            for layer in 0..3u32 {
                for (kv, tensor) in [(0, Tensor::K), (1, Tensor::V)] {
                    let id = RegionId { layer, tensor };
                    let p = places.iter().find(|p| p.id == id).unwrap();
                    let (li, nl) = if cross { (u64::from(layer), 3) } else { (0, 1) };
                    assert_eq!(p.tensor, if cross { 0 } else { layer as usize });
                    let dims = [nl, u64::from(s.num_blocks), 4, 2, 8];
                    let st = s.strides(rank, id, 2, 8);
                    for (b, t, h) in [(0, 0, 0), (1, 0, 0), (0, 3, 0), (0, 0, 1), (2, 1, 1)] {
                        let got = p.base + b * st.block + t * st.token + h * st.head;
                        assert_eq!(got, formula(preset, li, kv, b, t, h, dims) * 2, "{preset} layer {layer} kv {kv} ({b},{t},{h})");
                    }
                    // The window ends with the region's last row.
                    let last = formula(preset, li, kv, dims[1] - 1, 3, 1, dims) * 2 + 16;
                    assert_eq!(p.base + p.len, last, "{preset} region length");
                }
            }
        }
    }
}

#[test]
fn presets_and_order_words_parse_and_name_themselves() {
    assert_eq!(KvOrder::parse("flashinfer").unwrap(), KvOrder::parse("bkthd").unwrap());
    assert_eq!(KvOrder::parse("bkthd").unwrap().name(), "flashinfer");
    assert_eq!(KvOrder::parse("bthd").unwrap().name(), "bthd");
    for bad in ["", "kbth", "kbthdd", "kbtd", "xbthd", "kbtdh"] {
        assert!(matches!(KvOrder::parse(bad), Err(TensorError::Order(_))), "{bad}");
    }
    let e = LayoutSpec::parse("kv=flashinfer,layout=hnd").unwrap_err().to_string();
    assert!(e.contains("layout") && e.contains("kv=flashinfer"), "{e}");
    let e = LayoutSpec::parse("kv=vllm_nhd,row_align=64").unwrap_err().to_string();
    assert!(e.contains("row_align"), "{e}");
    assert_eq!(LayoutSpec::parse("kv=contiguous").unwrap(), LayoutSpec::parse("").unwrap());
}

#[test]
fn models_engine_tensors_cannot_hold_are_refused_by_name() {
    let mla = from_toml_spec("m", "[[layers]]\nrepeat = 2\nattention = \"mla\"\nkv_lora_rank = 64\nqk_rope_head_dim = 16\n").unwrap();
    let e = Side::new(&mla, &LayoutSpec::parse("kv=vllm_cross").unwrap(), bf16(), 4).unwrap_err().to_string();
    assert!(e.contains("MLA latent") && e.contains("one tensor per layer"), "{e}");
    let fp8 = CacheFormat::parse("fp8_e4m3_pth").unwrap();
    let e = Side::new(&model(2, 4, 8), &LayoutSpec::parse("kv=vllm_nhd").unwrap(), fp8, 4).unwrap_err().to_string();
    assert!(e.contains("scales"), "{e}");
}

/// A plan run on real tensors: each rank's engine tensors are plain byte
/// vectors, and a segment's region offset lands at the region's base in its tensor.
fn run_on_tensors(src: &Side, dst: &Side, plan: &Plan, src_fill: impl Fn(u32, usize, u64) -> u8) -> Vec<Vec<Vec<u8>>> {
    let alloc = |s: &Side| -> Vec<Vec<Vec<u8>>> { s.engine.iter().map(|rt| rt.tensors.iter().map(|t| vec![0xA5u8; t.bytes() as usize]).collect()).collect() };
    // A segment's region is a window of one tensor.
    let place = |s: &Side, rank: u32, id: RegionId| {
        let w = s.engine[rank as usize].windows.iter().find(|w| w.id == id).unwrap();
        (w.tensor, w.start)
    };
    let mut src_bufs = alloc(src);
    // Source: every byte of every tensor, by (rank, tensor, offset).
    for (rank, bufs) in src_bufs.iter_mut().enumerate() {
        for (t, buf) in bufs.iter_mut().enumerate() {
            for (o, b) in buf.iter_mut().enumerate() {
                *b = src_fill(rank as u32, t, o as u64);
            }
        }
    }
    let mut dst_bufs = alloc(dst);
    for s in &plan.segments {
        let (st, sb) = place(src, s.src_rank, s.src_region);
        let (dt, db) = place(dst, s.dst_rank, s.dst_region);
        for (so, d) in s.runs() {
            let from = src_bufs[s.src_rank as usize][st][(sb + so) as usize..(sb + so + s.len) as usize].to_vec();
            dst_bufs[s.dst_rank as usize][dt][(db + d) as usize..(db + d + s.len) as usize].copy_from_slice(&from);
        }
    }
    dst_bufs
}

/// (rank, tensor, byte offset) of row (layer, kv, position p, global head) in a side's rank tensors, by the formulas above.
fn locate(preset: &str, side: &Side, tp: u32, [heads, layers]: [u32; 2], (layer, kv, p, head): (u32, u64, u64, u32)) -> (usize, usize, u64) {
    let per = heads / tp;
    let rank = (head / per) as usize;
    let h = u64::from(head % per);
    let bs = u64::from(side.geo.block_size);
    let b = u64::from(side.block_table[(p / bs) as usize]);
    let cross = preset == "vllm_cross";
    let (tensor, li, nl) = if cross { (0, u64::from(layer), u64::from(layers)) } else { (layer as usize, 0, 1) };
    let dims = [nl, u64::from(side.num_blocks), bs, u64::from(per), 8];
    (rank, tensor, formula(preset, li, kv, b, p % bs, h, dims) * 2)
}

#[test]
fn a_transfer_between_any_two_presets_with_a_tp_change_places_every_row_where_the_destination_says() {
    let (layers, heads, tokens) = (2u32, 4u32, 21u64);
    let m = model(layers, heads, 8);
    for (sp, dp, stp, dtp) in [("vllm_cpu", "flashinfer", 2, 1), ("flashinfer", "vllm_cross", 1, 4), ("vllm_cross", "vllm_hnd", 4, 2), ("vllm_nhd", "flashinfer_hnd", 2, 4), ("flashinfer_hnd", "vllm_cpu", 4, 2)] {
        let src = side(&m, &format!("tp={stp},block=4,table=shuffle:3,kv={sp}"), tokens);
        let dst = side(&m, &format!("tp={dtp},block=8,table=shuffle:9,kv={dp}"), tokens);
        let plan = build(&PlanInput { model: &m, tokens, prefix_tokens: 0, src: &src, dst: &dst, cost: CostModel::default() }).unwrap();
        verify(&m, &src, &dst, &plan, 1 << 30).unwrap();
        // Fill the source through the formula: byte i of row (layer, kv, p, head) is a code of them.
        let code = |layer: u32, kv: u64, p: u64, head: u32, i: u64| (u64::from(layer) * 131 + kv * 71 + p * 29 + u64::from(head) * 7 + i) as u8 | 1;
        let mut src_rows = std::collections::HashMap::new();
        for layer in 0..layers {
            for kv in 0..2 {
                for p in 0..tokens {
                    for head in 0..heads {
                        let (r, t, off) = locate(sp, &src, stp, [heads, layers], (layer, kv, p, head));
                        for i in 0..16 {
                            src_rows.insert((r, t, off + i), code(layer, kv, p, head, i));
                        }
                    }
                }
            }
        }
        let dst_bufs = run_on_tensors(&src, &dst, &plan, |rank, t, o| src_rows.get(&(rank as usize, t, o)).copied().unwrap_or(0));
        let mut checked = 0;
        for layer in 0..layers {
            for kv in 0..2 {
                for p in 0..tokens {
                    for head in 0..heads {
                        let (r, t, off) = locate(dp, &dst, dtp, [heads, layers], (layer, kv, p, head));
                        for i in 0..16 {
                            assert_eq!(dst_bufs[r][t][(off + i) as usize], code(layer, kv, p, head, i), "{sp} tp{stp} -> {dp} tp{dtp}: layer {layer} kv {kv} pos {p} head {head} byte {i}");
                            checked += 1;
                        }
                    }
                }
            }
        }
        assert_eq!(checked, u64::from(layers) * 2 * tokens * u64::from(heads) * 16);
        assert_eq!(plan.counters.total_bytes_moved, checked);
    }
}

#[test]
fn mla_latents_in_engine_tensors_move_across_presets_and_tp_to_every_replica() {
    // Two dense layers, then an MLA layer: its latent is one tensor of the
    // order's axes without `k` and a head axis of 1, vLLM's per-layer
    // `(num_blocks, block, kv_lora_rank + rope_dim)`, held whole by every
    // TP rank. Offsets by hand: a latent row (b, t) starts at element
    // `(b * block + t) * 40`, for any order (the head axis has size 1).
    let m = from_toml_spec(
        "mixed",
        "[[layers]]\nrepeat = 2\nattention = \"dense\"\nkv_heads = 4\nhead_dim = 8\n\n[[layers]]\nattention = \"mla\"\nkv_lora_rank = 32\nqk_rope_head_dim = 8\n",
    )
    .unwrap();
    let tokens = 21u64;
    for (sp, dp, stp, dtp) in [("vllm_nhd", "flashinfer", 2, 1), ("vllm_cpu", "vllm_hnd", 1, 4), ("flashinfer_hnd", "vllm_nhd", 4, 2)] {
        let src = side(&m, &format!("tp={stp},block=4,table=shuffle:3,kv={sp}"), tokens);
        let dst = side(&m, &format!("tp={dtp},block=8,table=shuffle:9,kv={dp}"), tokens);
        for (s, tp) in [(&src, stp), (&dst, dtp)] {
            for rank in 0..tp as usize {
                let t = &s.engine[rank].tensors[2];
                assert_eq!((t.role, t.layers.clone()), (Role::Latent, 2..3), "{sp}/{dp}");
                assert_eq!(t.shape.iter().product::<u64>(), u64::from(s.num_blocks) * u64::from(s.geo.block_size) * 40, "{:?}", t.shape);
            }
        }
        let plan = build(&PlanInput { model: &m, tokens, prefix_tokens: 0, src: &src, dst: &dst, cost: CostModel::default() }).unwrap();
        verify(&m, &src, &dst, &plan, 1 << 30).unwrap();
        let row = |s: &Side, p: u64| {
            let bs = u64::from(s.geo.block_size);
            (u64::from(s.block_table[(p / bs) as usize]) * bs + p % bs) * 40 * 2
        };
        // Each source replica holds the same latent rows.
        let code = |p: u64, i: u64| (p * 37 + i * 3) as u8 | 1;
        let mut src_rows = std::collections::HashMap::new();
        for rank in 0..stp as usize {
            for p in 0..tokens {
                for i in 0..80 {
                    src_rows.insert((rank, 2usize, row(&src, p) + i), code(p, i));
                }
            }
        }
        let dst_bufs = run_on_tensors(&src, &dst, &plan, |rank, t, o| src_rows.get(&(rank as usize, t, o)).copied().unwrap_or(0));
        for (rank, bufs) in dst_bufs.iter().enumerate().take(dtp as usize) {
            for p in 0..tokens {
                for i in 0..80 {
                    assert_eq!(bufs[2][(row(&dst, p) + i) as usize], code(p, i), "{sp} tp{stp} -> {dp} tp{dtp}: rank {rank} latent position {p} byte {i}");
                }
            }
        }
    }
    // A client's latent tensor is matched by its role and shape like the others.
    let s = side(&m, "tp=1,block=4,kv=vllm_nhd", tokens);
    let t = &s.engine[0].tensors[2];
    let latent = TensorDesc { memory: 0, offset: 0, dtype: "bf16".into(), shape: vec![u64::from(s.num_blocks), 4, 40], strides: vec![160, 40, 1], role: Role::Latent, layers: [2, 3] };
    let dense = |l: u32| {
        let e = &s.engine[0].tensors[l as usize];
        TensorDesc { memory: l + 1, offset: 0, dtype: "bf16".into(), shape: e.shape.clone(), strides: e.strides.clone(), role: Role::Kv, layers: [l, l + 1] }
    };
    let sizes = [t.bytes(), s.engine[0].tensors[0].bytes(), s.engine[0].tensors[1].bytes()];
    assert_eq!(match_tensors(&[latent.clone(), dense(0), dense(1)], &s.engine[0].tensors, bf16(), &sizes).unwrap(), vec![(1, 0), (2, 0), (0, 0)]);
    let mut wrong = latent;
    wrong.shape = vec![u64::from(s.num_blocks), 4, 2, 20];
    wrong.strides = vec![160, 40, 20, 1];
    let e = match_tensors(&[wrong, dense(0), dense(1)], &s.engine[0].tensors, bf16(), &sizes).unwrap_err().to_string();
    assert!(e.contains("latent of layers [2, 3)") && e.contains("shape"), "{e}");
}

#[test]
fn same_preset_same_tp_moves_whole_blocks_per_region_as_one_run() {
    let m = model(4, 4, 8);
    let (src, dst) = (side(&m, "tp=2,block=16,kv=vllm_nhd", 64), side(&m, "tp=2,block=16,kv=vllm_nhd", 64));
    let plan = build(&PlanInput { model: &m, tokens: 64, prefix_tokens: 0, src: &src, dst: &dst, cost: CostModel::default() }).unwrap();
    // 4 blocks of a contiguous table are one run per (rank, layer, K/V).
    assert_eq!(plan.segments.len(), 2 * 4 * 2);
    assert!(plan.segments.iter().all(|s| s.count == 1 && s.len == 64 * 2 * 8 * 2));
    // FlashInfer and vLLM CPU keep a block's K and V side by side: K and V
    // move together, so each (rank, layer) tensor is one run.
    for preset in ["flashinfer", "vllm_cpu", "flashinfer_hnd"] {
        let l = format!("tp=2,block=16,kv={preset}");
        let (src, dst) = (side(&m, &l, 64), side(&m, &l, 64));
        let plan = build(&PlanInput { model: &m, tokens: 64, prefix_tokens: 0, src: &src, dst: &dst, cost: CostModel::default() }).unwrap();
        assert_eq!(plan.segments.len(), 2 * 4, "{preset}");
        assert!(plan.segments.iter().all(|s| s.count == 1 && s.len == 4 * 16 * 2 * 2 * 8 * 2), "{preset}");
        verify(&m, &src, &dst, &plan, 1 << 30).unwrap();
    }
    // With shuffled tables: one run per block (K and V together), as many
    // writes as blocks when writes cost nothing (none is worth packing).
    let (src, dst) = (side(&m, "tp=2,block=16,kv=flashinfer,table=shuffle:1", 64), side(&m, "tp=2,block=16,kv=flashinfer,table=shuffle:2", 64));
    let free = CostModel { per_write_ns: 0.0, ..CostModel::default() };
    let plan = build(&PlanInput { model: &m, tokens: 64, prefix_tokens: 0, src: &src, dst: &dst, cost: free }).unwrap();
    assert_eq!(plan.counters.writes, 2 * 4 * 4);
    verify(&m, &src, &dst, &plan, 1 << 30).unwrap();
}

fn desc(memory: u32, offset: u64, dtype: &str, shape: &[u64], role: Role, layers: [u32; 2]) -> TensorDesc {
    let mut strides = vec![1u64; shape.len()];
    for i in (0..shape.len() - 1).rev() {
        strides[i] = strides[i + 1] * shape[i + 1];
    }
    TensorDesc { memory, offset, dtype: dtype.into(), shape: shape.to_vec(), strides, role, layers }
}

#[test]
fn a_clients_tensors_are_checked_and_each_error_names_what_was_wrong() {
    let m = model(2, 4, 8);
    let s = side(&m, "tp=2,block=4,kv=vllm_cpu", 8);
    let expected = &s.engine[0].tensors;
    let nb = u64::from(s.num_blocks);
    let bytes = nb * 2 * 4 * 16 * 2;
    // vLLM CPU tensors as the engine shapes them: (B, H, T, 2*D), two memfds.
    let good = vec![desc(0, 0, "torch.bfloat16", &[nb, 2, 4, 16], Role::KvPacked, [0, 1]), desc(1, 64, "bfloat16", &[nb, 2, 4, 16], Role::KvPacked, [1, 2])];
    assert_eq!(match_tensors(&good, expected, bf16(), &[bytes, bytes + 64]).unwrap(), vec![(0, 0), (1, 64)]);
    // The same as a 5-D kv tensor.
    let five = vec![desc(0, 0, "bf16", &[nb, 2, 4, 2, 8], Role::Kv, [0, 1]), desc(0, bytes, "bf16", &[nb, 2, 4, 2, 8], Role::Kv, [1, 2])];
    match_tensors(&five, expected, bf16(), &[2 * bytes]).unwrap();
    let err = |given: &[TensorDesc], mems: &[u64]| match_tensors(given, expected, bf16(), mems).unwrap_err().to_string();
    let mut t = good.clone();
    t[1].dtype = "float32".into();
    assert!(err(&t, &[bytes, bytes + 64]).contains("dtype float32 (32 bits) but the cache format is bf16/v1"));
    let mut t = good.clone();
    t[0].shape[1] = 4;
    let e = err(&t, &[bytes, bytes + 64]);
    assert!(e.starts_with("tensor 0 (kv_packed of layers [0, 1)): shape"), "{e}");
    let mut t = good.clone();
    t[0].strides[0] += 1;
    assert!(err(&t, &[bytes, bytes + 64]).contains("strides"));
    assert!(err(&good, &[bytes, bytes]).contains("past memory 1's"));
    assert!(err(&good, &[bytes]).contains("memory 1 but the registration carries 1 file descriptors"));
    assert!(err(&good[..1], &[bytes, bytes + 64]).contains("missing the kv tensor of layers [1, 2)"));
    // vLLM's HND cache is an NHD-shaped view with permuted strides: the same bytes as `bhtkd`'s tensor.
    let s2 = side(&m, "tp=2,block=4,kv=vllm_hnd", 8);
    let nb2 = u64::from(s2.num_blocks);
    let per = nb2 * 2 * 4 * 8;
    let permuted = vec![TensorDesc { memory: 0, offset: 0, dtype: "bf16".into(), shape: vec![2, nb2, 4, 2, 8], strides: vec![per, 2 * 4 * 8, 8, 4 * 8, 1], role: Role::Kv, layers: [0, 1] }, desc(0, 2 * per * 2, "bf16", &[2, nb2, 2, 4, 8], Role::Kv, [1, 2])];
    match_tensors(&permuted, &s2.engine[0].tensors, bf16(), &[4 * per * 2]).unwrap();
    let mut t = permuted.clone();
    t[0].strides.swap(2, 3);
    let e = match_tensors(&t, &s2.engine[0].tensors, bf16(), &[4 * per * 2]).unwrap_err().to_string();
    assert!(e.contains("strides"), "{e}");
    let mut t = good.clone();
    t[1].memory = 0;
    t[1].offset = 64;
    assert!(err(&t, &[bytes + 64]).contains("overlap in memory 0"));
    let mut t = good.clone();
    t[1].layers = [2, 3];
    assert!(err(&t, &[bytes, bytes + 64]).contains("expects no such tensor"));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Every destination byte written exactly once from the right source byte,
    /// between any two layouts (engine presets and kvwire's own), checked by the oracle.
    #[test]
    fn plans_between_any_two_layouts_verify(si in 0usize..10, di in 0usize..10, stp in 0u32..3, dtp in 0u32..3, sb in 0u32..3, db in 0u32..3, tokens in 1u64..40, prefix in 0u64..40, seed in 0u64..50) {
        const KV: [&str; 10] = ["kv=vllm_nhd", "kv=vllm_hnd", "kv=flashinfer", "kv=flashinfer_hnd", "kv=vllm_cpu", "kv=vllm_cross", "kv=bthd", "layout=hnd", "kv=vllm_hnd,pad=k3:h5", "kv=vllm_cross,pad=l7:t1"];
        let m = model(3, 4, 8);
        let prefix = prefix % tokens;
        let src = side(&m, &format!("tp={},block={},table=shuffle:{seed},{}", 1 << stp, 2 << sb, KV[si]), tokens);
        let dst = side(&m, &format!("tp={},block={},{}", 1 << dtp, 3 << db, KV[di]), tokens);
        let plan = build(&PlanInput { model: &m, tokens, prefix_tokens: prefix, src: &src, dst: &dst, cost: CostModel::default() }).unwrap();
        let report = verify(&m, &src, &dst, &plan, 1 << 30).unwrap();
        prop_assert_eq!(report.bytes_copied, (tokens - prefix) * 3 * 2 * 4 * 16);
    }
}

/// A cross-layer tensor's window of one layer spans every layer's blocks:
/// verification holds that layer's rows only (a bound of one layer's bytes
/// suffices, not the tensor's), checks every one of them, and a run aimed
/// at another layer's rows inside the window is refused as out of bounds.
#[test]
fn cross_layer_verification_holds_each_layers_rows_only() {
    let m = model(8, 4, 8);
    let tokens = 64;
    let (src, dst) = (side(&m, "tp=2,block=16,kv=vllm_nhd,table=shuffle:3", tokens), side(&m, "tp=1,block=16,kv=vllm_cross,table=shuffle:4", tokens));
    let plan = build(&PlanInput { model: &m, tokens, prefix_tokens: 0, src: &src, dst: &dst, cost: CostModel::default() }).unwrap();
    // One layer's rows on every rank: the source's, and the destination's twice.
    let layer = u64::from(src.num_blocks) * 16 * 4 * 8 * 2 * 2;
    let one_layer = layer + 2 * (u64::from(dst.num_blocks) * 16 * 4 * 8 * 2 * 2);
    let report = verify(&m, &src, &dst, &plan, one_layer).unwrap();
    assert_eq!(report.bytes_checked, u64::from(dst.num_blocks) * 16 * 4 * 8 * 2 * 2 * 8, "every row of every layer, nothing between");
    assert_eq!(report.bytes_copied, tokens * 4 * 8 * 2 * 2 * 8);
    // Held whole, the destination's two windows of one layer alone would
    // pass that bound: each spans the other layers' rows between its own.
    let window = dst.regions(&m, 0)[0].1;
    assert!(2 * window > one_layer, "a window of {window} bytes");

    // A run moved onto the next layer's K rows of the same block (in the
    // window, not this layer's): out of bounds, naming the destination.
    let mut bad = plan.clone();
    let mut segs = bad.segments.to_vec();
    let i = segs.iter().position(|s| s.dst_region.layer == 0).unwrap();
    segs[i].dst_offset += 16 * 4 * 8 * 2 * 2;
    bad.segments = segs.into();
    let e = verify(&m, &src, &dst, &bad, 1 << 30).unwrap_err().to_string();
    assert!(e.contains("destination bytes") && e.contains("past region length"), "{e}");
}

/// Element offset of a coordinate in a tensor of order `word` (letters
/// outermost first) whose axes have `size` elements and `pad` elements of
/// padding after each step, as an engine's `as_strided` view lays it.
fn strided_offset(word: &str, size: impl Fn(char) -> u64, pad: impl Fn(char) -> u64, coord: impl Fn(char) -> u64) -> u64 {
    let letters: Vec<char> = word.chars().collect();
    let mut stride = vec![1u64; letters.len()];
    for i in (0..letters.len() - 1).rev() {
        stride[i] = stride[i + 1] * size(letters[i + 1]) + pad(letters[i]);
    }
    letters.iter().zip(&stride).map(|(&c, &s)| coord(c) * s).sum()
}

#[test]
fn padded_tensors_hold_every_row_at_their_strides_and_their_padding_is_never_written() {
    let (layers, heads, tokens) = (2u32, 4u32, 21u64);
    let m = model(layers, heads, 8);
    let pad_of = |pads: &str, c: char| pads.split(':').find(|p| p.starts_with(c)).map_or(0, |p| p[1..].parse().unwrap());
    for (sp, stp, dp, word, pads, dtp) in [("flashinfer", 2, "vllm_nhd", "kbthd", "k9:b40:t3:h1", 1), ("vllm_hnd", 4, "vllm_cross", "blkthd", "l3:k2:b13", 2), ("vllm_cpu", 1, "flashinfer_hnd", "bkhtd", "t8", 4)] {
        let src = side(&m, &format!("tp={stp},block=4,table=shuffle:3,kv={sp}"), tokens);
        let dst = side(&m, &format!("tp={dtp},block=8,table=shuffle:9,kv={dp},pad={pads}"), tokens);
        let plan = build(&PlanInput { model: &m, tokens, prefix_tokens: 0, src: &src, dst: &dst, cost: CostModel::default() }).unwrap();
        verify(&m, &src, &dst, &plan, 1 << 30).unwrap();
        let code = |layer: u32, kv: u64, p: u64, head: u32, i: u64| (u64::from(layer) * 131 + kv * 71 + p * 29 + u64::from(head) * 7 + i) as u8 | 1;
        let mut src_rows = std::collections::HashMap::new();
        for (layer, kv, p, head) in (0..layers).flat_map(|l| (0..2).flat_map(move |kv| (0..tokens).flat_map(move |p| (0..heads).map(move |h| (l, kv, p, h))))) {
            let (r, t, off) = locate(sp, &src, stp, [heads, layers], (layer, kv, p, head));
            for i in 0..16 {
                src_rows.insert((r, t, off + i), code(layer, kv, p, head, i));
            }
        }
        let dst_bufs = run_on_tensors(&src, &dst, &plan, |rank, t, o| src_rows.get(&(rank as usize, t, o)).copied().unwrap_or(0));
        let per = heads / dtp;
        let cross = dp == "vllm_cross";
        let mut rows = std::collections::HashSet::new();
        for (layer, kv, p, head) in (0..layers).flat_map(|l| (0..2).flat_map(move |kv| (0..tokens).flat_map(move |p| (0..heads).map(move |h| (l, kv, p, h))))) {
            let bs = 8;
            let b = u64::from(dst.block_table[(p / bs) as usize]);
            let size = |c| match c {
                'l' => u64::from(layers),
                'k' => 2,
                'b' => u64::from(dst.num_blocks),
                't' => bs,
                'h' => u64::from(per),
                _ => 8,
            };
            let coord = |c| match c {
                'l' => u64::from(layer),
                'k' => kv,
                'b' => b,
                't' => p % bs,
                'h' => u64::from(head % per),
                _ => 0,
            };
            let (r, t) = ((head / per) as usize, if cross { 0 } else { layer as usize });
            let off = strided_offset(word, size, |c| pad_of(pads, c), coord) * 2;
            for i in 0..16 {
                assert_eq!(dst_bufs[r][t][(off + i) as usize], code(layer, kv, p, head, i), "{sp} -> {dp},pad={pads}: layer {layer} kv {kv} pos {p} head {head} byte {i}");
                rows.insert((r, t, off + i));
            }
        }
        // Every other byte, padding included, is as the destination left it.
        for (r, tensors) in dst_bufs.iter().enumerate() {
            for (t, buf) in tensors.iter().enumerate() {
                let stray = buf.iter().enumerate().filter(|&(o, &b)| b != 0xA5 && !rows.contains(&(r, t, o as u64))).count();
                assert_eq!(stray, 0, "{dp},pad={pads}: rank {r} tensor {t}");
            }
        }
        assert_eq!(plan.counters.total_bytes_moved, rows.len() as u64);
    }
}

#[test]
fn padding_is_parsed_by_axis_and_a_clients_strides_name_the_padding_they_need() {
    let o = |l: &str| LayoutSpec::parse(l).map(|s| s.kv.unwrap().pad_text());
    assert_eq!(o("kv=vllm_nhd,pad=b256:t8").unwrap(), "b256:t8");
    assert_eq!(o("pad=t8,kv=flashinfer").unwrap(), "t8", "keys in any order");
    for (bad, says) in [("pad=b4", "needs kv="), ("kv=vllm_nhd,pad=l4", "`l` is not an axis of kv=vllm_nhd"), ("kv=vllm_nhd,pad=d4", "`d` cannot be padded"), ("kv=vllm_nhd,pad=b4:b8", "given twice"), ("kv=vllm_nhd,pad=bx", "`bx`"), ("kv=vllm_nhd,pad=b1099511627776", "at most")] {
        let e = LayoutSpec::parse(bad).unwrap_err().to_string();
        assert!(e.contains("pad") && e.contains(says), "{bad}: {e}");
    }
    // A pad that overflows the tensor is refused when the side is built, not wrapped.
    let e = Side::new(&model(2, 65536, 8), &LayoutSpec::parse("block=1048576,kv=vllm_nhd,pad=t536870912:h536870912").unwrap(), bf16(), 4).unwrap_err().to_string();
    assert!(e.contains("overflow"), "{e}");

    // A vLLM NHD layer holding heads 2..4 of a 4-head tensor whose pages are padded by 40 elements.
    let m = model(2, 2, 8);
    let dense = side(&m, "tp=1,block=4,kv=vllm_nhd", 8);
    let nb = u64::from(dense.num_blocks);
    let view = |layer: u32, offset: u64| TensorDesc { memory: 0, offset, dtype: "bf16".into(), shape: vec![2, nb, 4, 2, 8], strides: vec![nb * (4 * 32 + 40), 4 * 32 + 40, 32, 8, 1], role: Role::Kv, layers: [layer, layer + 1] };
    let span = (2 * nb * (4 * 32 + 40)) * 2;
    let given = [view(0, 32), view(1, span + 32)];
    let e = match_tensors(&given, &dense.engine[0].tensors, bf16(), &[2 * span + 64]).unwrap_err().to_string();
    assert!(e.contains("give the layout `pad=b40:t16`"), "{e}");
    let padded = side(&m, "tp=1,block=4,kv=vllm_nhd,pad=b40:t16", 8);
    assert_eq!(match_tensors(&given, &padded.engine[0].tensors, bf16(), &[2 * span + 64]).unwrap(), vec![(0, 32), (0, span + 32)]);
    // Its span ends at its last element: past the memory by one byte is refused.
    let last = padded.engine[0].tensors[1].bytes();
    let e = match_tensors(&given, &padded.engine[0].tensors, bf16(), &[span + 32 + last - 1]).unwrap_err().to_string();
    assert!(e.contains("past memory 0"), "{e}");
    // Dense strides against a padded layout say so.
    let d = dense.engine[0].tensors[0].clone();
    let plain = |layer: u32, offset: u64| TensorDesc { memory: 0, offset, dtype: "bf16".into(), shape: d.shape.clone(), strides: d.strides.clone(), role: Role::Kv, layers: [layer, layer + 1] };
    let e = match_tensors(&[plain(0, 0), plain(1, d.bytes())], &padded.engine[0].tensors, bf16(), &[2 * d.bytes()]).unwrap_err().to_string();
    assert!(e.contains("they are dense: drop `pad=`"), "{e}");
    // Strides no padding explains (heads closer than a row) get no hint.
    let mut t = view(0, 32);
    t.strides[3] = 4;
    let e = match_tensors(&[t, view(1, span + 32)], &padded.engine[0].tensors, bf16(), &[2 * span + 64]).unwrap_err().to_string();
    assert!(e.contains("strides") && !e.contains("pad="), "{e}");
}
