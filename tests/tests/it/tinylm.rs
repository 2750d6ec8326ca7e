//! tinylm: the model's own invariants, its paged cache, and a kvwire plan
//! moving that cache between layouts without changing one logit bit.

use kvwire_core::layout::inventory;
use kvwire_core::plan::{self, Buffers, CostModel, PlanInput, Side};
use kvwire_core::shard::{LayoutSpec, RegionId};
use kvwire_core::{CacheFormat, ModelSpec};
use kvwire_e2e::tinylm::{self, Adapter, Config, KvCache, Weights};
use std::collections::BTreeMap;

/// A partial final block at both block sizes used here (16 and 32).
const TOKENS: usize = 37;

fn prompt(cfg: &Config, n: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 7919 + 13) % cfg.vocab) as u32).collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn side(model: &ModelSpec, layout: &str, tokens: usize) -> Side {
    let layout = LayoutSpec::parse(layout).expect("layout parses");
    Side::new(model, &layout, CacheFormat::parse("fp32").expect("fp32 is known"), tokens as u64).expect("layout fits tinylm")
}

fn scatter_all(cache: &KvCache, model: &ModelSpec, side: &Side) -> Vec<BTreeMap<RegionId, Vec<u8>>> {
    (0..side.shard.ranks.len() as u32).map(|r| tinylm::scatter(cache, model, side, r)).collect()
}

mod model {
    use super::*;

    #[test]
    fn decode_after_prefill_matches_longer_prefill_bitwise() {
        let _shared = crate::shared();
        let cfg = Config::default();
        let w = Weights::seeded(&cfg, 1);
        let tokens = prompt(&cfg, TOKENS + 1);
        for n in [1, 16, TOKENS] {
            let (cache, _) = tinylm::prefill(&w, None, &tokens[..n]);
            let step = tinylm::decode_step(&w, None, &cache, tokens[n], n as u64);
            let (_, longer) = tinylm::prefill(&w, None, &tokens[..=n]);
            assert_eq!(bits(&step), bits(&longer), "n = {n}");
        }
    }

    #[test]
    fn prefix_of_a_prefill_is_the_prefill_of_the_prefix() {
        let _shared = crate::shared();
        // Causality: a decode side that computed the first P positions itself
        // holds exactly what the prefill side would send for them.
        let cfg = Config::default();
        let w = Weights::seeded(&cfg, 1);
        let tokens = prompt(&cfg, TOKENS);
        let (full, _) = tinylm::prefill(&w, None, &tokens);
        let (head, _) = tinylm::prefill(&w, None, &tokens[..16]);
        let n = 16 * cfg.kv_heads * cfg.head_dim;
        for l in 0..cfg.layers {
            assert_eq!(bits(&full.k[l][..n]), bits(&head.k[l]), "layer {l} K");
            assert_eq!(bits(&full.v[l][..n]), bits(&head.v[l]), "layer {l} V");
        }
    }

    #[test]
    fn seeded_weights_are_deterministic_and_seed_sensitive() {
        let _shared = crate::shared();
        let cfg = Config::default();
        let a = Weights::seeded(&cfg, 1);
        let b = Weights::seeded(&cfg, 1);
        let c = Weights::seeded(&cfg, 2);
        assert_eq!(tinylm::digest(&a), tinylm::digest(&b));
        assert_ne!(tinylm::digest(&a), tinylm::digest(&c));
        let tokens = prompt(&cfg, 8);
        assert_eq!(bits(&tinylm::prefill(&a, None, &tokens).1), bits(&tinylm::prefill(&b, None, &tokens).1));
        // The RoPE offset is request position semantics, not model identity.
        let mut shifted = a.clone();
        shifted.cfg.rope_position_offset = 1;
        assert_eq!(tinylm::digest(&a), tinylm::digest(&shifted));
    }

    #[test]
    fn activations_stay_sane() {
        let _shared = crate::shared();
        let cfg = Config::default();
        let w = Weights::seeded(&cfg, 1);
        let (cache, logits) = tinylm::prefill(&w, None, &prompt(&cfg, TOKENS));
        assert_eq!(logits.len(), cfg.vocab);
        assert!(logits.iter().chain(cache.k.iter().flatten()).chain(cache.v.iter().flatten()).all(|x| x.is_finite()));
        let rms = (logits.iter().map(|x| x * x).sum::<f32>() / logits.len() as f32).sqrt();
        assert!((0.1..100.0).contains(&rms), "logit rms {rms}");
    }

    #[test]
    fn model_spec_matches_the_cache_kvwire_counts() {
        let _shared = crate::shared();
        let cfg = Config::default();
        let model = tinylm::model_spec(&cfg);
        model.validate().expect("tinylm's spec is valid");
        let w = Weights::seeded(&cfg, 1);
        let (cache, _) = tinylm::prefill(&w, None, &prompt(&cfg, TOKENS));
        let elems: usize = cache.k.iter().chain(&cache.v).map(Vec::len).sum();
        // Hand-derived: layers × (K + V) × tokens × kv_heads × head_dim × 4 bytes.
        assert_eq!(elems * 4, cfg.layers * 2 * TOKENS * cfg.kv_heads * cfg.head_dim * 4);
        let geo = LayoutSpec::default().geometry(CacheFormat::parse("fp32").unwrap()).unwrap();
        let inv = inventory(&model, &geo, TOKENS as u64).expect("inventory");
        assert_eq!(inv.payload_bytes, (elems * 4) as u64);
    }

    #[test]
    fn a_different_adapter_changes_kv_cache_and_logits() {
        let _shared = crate::shared();
        let cfg = Config::default();
        let w = Weights::seeded(&cfg, 1);
        let a = Adapter::seeded(&cfg, 8, 10);
        let b = Adapter::seeded(&cfg, 8, 11);
        assert_ne!(tinylm::adapter_digest(&a), tinylm::adapter_digest(&b));
        assert_eq!(tinylm::adapter_digest(&a), tinylm::adapter_digest(&Adapter::seeded(&cfg, 8, 10)));
        let tokens = prompt(&cfg, TOKENS);
        let (base, lb) = tinylm::prefill(&w, None, &tokens);
        let (ca, la) = tinylm::prefill(&w, Some(&a), &tokens);
        let (cb, lbb) = tinylm::prefill(&w, Some(&b), &tokens);
        for (x, y, what) in [(&base, &ca, "none vs a"), (&ca, &cb, "a vs b")] {
            for l in 0..cfg.layers {
                assert!(max_abs_diff(&x.k[l], &y.k[l]) > 1e-2, "{what}: layer {l} K unchanged");
                assert!(max_abs_diff(&x.v[l], &y.v[l]) > 1e-2, "{what}: layer {l} V unchanged");
            }
        }
        assert!(max_abs_diff(&lb, &la) > 1e-2);
        assert!(max_abs_diff(&la, &lbb) > 1e-2);
        // Decoding a-cache with adapter b is not the a computation.
        let next = tokens[0];
        let right = tinylm::decode_step(&w, Some(&a), &ca, next, TOKENS as u64);
        let wrong_cache = tinylm::decode_step(&w, Some(&a), &cb, next, TOKENS as u64);
        assert!(max_abs_diff(&right, &wrong_cache) > 1e-2);
    }

    #[test]
    fn rope_offset_shift_by_one_changes_logits() {
        let _shared = crate::shared();
        let cfg = Config::default();
        let w = Weights::seeded(&cfg, 1);
        let mut shifted = w.clone();
        shifted.cfg.rope_position_offset = 1;
        let tokens = prompt(&cfg, TOKENS + 1);
        let (cache, _) = tinylm::prefill(&w, None, &tokens[..TOKENS]);
        let right = tinylm::decode_step(&w, None, &cache, tokens[TOKENS], TOKENS as u64);
        // A cache built at positions 0.. decoded as if it sat at 1..: the query
        // is rotated one step further than its keys.
        let forced = tinylm::decode_step(&shifted, None, &cache, tokens[TOKENS], TOKENS as u64);
        let forced_err = max_abs_diff(&right, &forced);
        // Shifting both sides keeps every q·k angle (RoPE is relative), so only
        // rounding differs: the mismatch above is not rounding.
        let (scache, _) = tinylm::prefill(&shifted, None, &tokens[..TOKENS]);
        let consistent = tinylm::decode_step(&shifted, None, &scache, tokens[TOKENS], TOKENS as u64);
        let rounding = max_abs_diff(&right, &consistent);
        assert!(rounding < 1e-3, "consistent shift moved logits by {rounding}");
        assert!(forced_err > 1e-2 && forced_err > 100.0 * rounding, "forced {forced_err}, rounding {rounding}");
    }
}

mod paged {
    use super::*;

    fn layouts() -> Vec<String> {
        let mut out = Vec::new();
        for tp in [1, 2, 4, 8] {
            for mem in ["nhd", "hnd"] {
                for block in [16, 32] {
                    for table in ["contig", "shuffle:3"] {
                        out.push(format!("tp={tp},block={block},layout={mem},table={table}"));
                    }
                }
            }
        }
        // Unequal PP split with TP, and PP alone.
        out.push("tp=2,pp=2,pp_layers=3,1,block=16,layout=hnd,table=shuffle:5".into());
        out.push("pp=3,pp_layers=1,2,1,block=32,layout=nhd".into());
        // Padding must not shift rows.
        out.push("tp=2,block=16,layout=nhd,row_align=256,block_align=4096,table=shuffle:9".into());
        out
    }

    #[test]
    fn scatter_gather_round_trip_is_bitwise() {
        let _shared = crate::shared();
        let cfg = Config::default();
        let model = tinylm::model_spec(&cfg);
        let w = Weights::seeded(&cfg, 1);
        let (cache, _) = tinylm::prefill(&w, None, &prompt(&cfg, TOKENS));
        for layout in layouts() {
            let side = side(&model, &layout, TOKENS);
            let ranks = scatter_all(&cache, &model, &side);
            for (r, regions) in ranks.iter().enumerate() {
                let sizes: Vec<(RegionId, u64)> = regions.iter().map(|(id, b)| (*id, b.len() as u64)).collect();
                assert_eq!(sizes, side.regions(&model, r as u32), "{layout}: rank {r} region sizes");
            }
            let back = tinylm::gather(&ranks, &model, &side, TOKENS as u64);
            assert!(back.same_bits(&cache), "{layout}: round trip changed the cache");
        }
    }

    #[test]
    fn tp1_contiguous_nhd_is_the_flat_cache() {
        let _shared = crate::shared();
        // Hand-derived: with one rank, a contiguous table and no padding, NHD
        // blocks laid end to end are exactly [pos][head][dim].
        let cfg = Config::default();
        let model = tinylm::model_spec(&cfg);
        let w = Weights::seeded(&cfg, 1);
        let (cache, _) = tinylm::prefill(&w, None, &prompt(&cfg, TOKENS));
        let side = side(&model, "tp=1,block=16,layout=nhd", TOKENS);
        let regions = tinylm::scatter(&cache, &model, &side, 0);
        for l in 0..cfg.layers {
            let k: Vec<u8> = cache.k[l].iter().flat_map(|x| x.to_le_bytes()).collect();
            let region = &regions[&RegionId { layer: l as u32, tensor: kvwire_core::layout::Tensor::K }];
            assert_eq!(&region[..k.len()], &k[..], "layer {l}");
            assert!(region[k.len()..].iter().all(|&b| b == 0), "layer {l}: bytes past the last position");
        }
    }

    #[test]
    fn tp1_contiguous_hnd_row_sits_at_head_major_offset() {
        let _shared = crate::shared();
        // Hand-derived: block b of HND holds [head][slot]; row (pos, head) at
        // ((pos/B)·heads·B + head·B + pos%B) · head_dim · 4.
        let cfg = Config::default();
        let model = tinylm::model_spec(&cfg);
        let w = Weights::seeded(&cfg, 1);
        let (cache, _) = tinylm::prefill(&w, None, &prompt(&cfg, TOKENS));
        let side = side(&model, "tp=1,block=16,layout=hnd", TOKENS);
        let regions = tinylm::scatter(&cache, &model, &side, 0);
        let v = &regions[&RegionId { layer: 2, tensor: kvwire_core::layout::Tensor::V }];
        for (pos, head) in [(0, 0), (5, 3), (16, 1), (36, 2)] {
            let row = ((pos / 16) * cfg.kv_heads * 16 + head * 16 + pos % 16) * cfg.head_dim * 4;
            let want: Vec<u8> = cache.v_row(2, pos, head).iter().flat_map(|x| x.to_le_bytes()).collect();
            assert_eq!(&v[row..row + want.len()], &want[..], "pos {pos} head {head}");
        }
    }

    #[test]
    fn tp8_replicas_hold_identical_bytes() {
        let _shared = crate::shared();
        // 4 KV heads over 8 ranks: ranks 2h and 2h+1 both hold head h.
        let cfg = Config::default();
        let model = tinylm::model_spec(&cfg);
        let w = Weights::seeded(&cfg, 1);
        let (cache, _) = tinylm::prefill(&w, None, &prompt(&cfg, TOKENS));
        let side = side(&model, "tp=8,block=16,layout=hnd,table=shuffle:3", TOKENS);
        let ranks = scatter_all(&cache, &model, &side);
        for h in 0..cfg.kv_heads {
            assert_eq!(side.shard.ranks[2 * h].heads_of(0), Some(h as u32..h as u32 + 1));
            assert_eq!(ranks[2 * h], ranks[2 * h + 1], "head {h}");
        }
        assert_ne!(ranks[0], ranks[2]);
    }
}

mod transfer {
    use super::*;

    /// Prefill on `src_layout`, plan and execute into `dst_layout` (whose
    /// ranks already hold the first `prefix` positions, computed locally),
    /// gather, decode one token: it must be bitwise the local computation.
    fn transfer_and_decode(src_layout: &str, dst_layout: &str, prefix: usize) -> plan::Plan {
        let cfg = Config::default();
        let model = tinylm::model_spec(&cfg);
        let w = Weights::seeded(&cfg, 1);
        let adapter = Adapter::seeded(&cfg, 4, 7);
        let tokens = prompt(&cfg, TOKENS + 1);
        let (cache, _) = tinylm::prefill(&w, Some(&adapter), &tokens[..TOKENS]);
        let local = tinylm::decode_step(&w, Some(&adapter), &cache, tokens[TOKENS], TOKENS as u64);

        let src = side(&model, src_layout, TOKENS);
        let dst = side(&model, dst_layout, TOKENS);
        let source = Buffers { ranks: scatter_all(&cache, &model, &src) };
        // The destination's own prefix, rows past it zero; without one, a
        // fill no f32 cache row would hold whole.
        let mut dest = if prefix > 0 {
            let (own, _) = tinylm::prefill(&w, Some(&adapter), &tokens[..prefix]);
            Buffers { ranks: scatter_all(&own, &model, &dst) }
        } else {
            Buffers::alloc(&model, &dst, 0xA5)
        };
        let plan = plan::build(&PlanInput {
            model: &model,
            tokens: TOKENS as u64,
            prefix_tokens: prefix as u64,
            src: &src,
            dst: &dst,
            cost: CostModel::default(),
        })
        .expect("plan builds");
        plan::execute(&plan, &source, &mut dest).expect("plan runs");

        let got = tinylm::gather(&dest.ranks, &model, &dst, TOKENS as u64);
        assert!(got.same_bits(&cache), "{src_layout} -> {dst_layout} (prefix {prefix}): cache differs");
        let remote = tinylm::decode_step(&w, Some(&adapter), &got, tokens[TOKENS], TOKENS as u64);
        assert_eq!(bits(&remote), bits(&local), "{src_layout} -> {dst_layout} (prefix {prefix}): logits differ");
        plan
    }

    #[test]
    fn tp4_nhd16_to_tp2_hnd32_decode_is_bitwise_local() {
        let _shared = crate::shared();
        let plan = transfer_and_decode("tp=4,block=16,layout=nhd", "tp=2,block=32,layout=hnd,table=shuffle:3", 0);
        let cfg = Config::default();
        // Hand-derived: every K and V element of every layer moves once.
        assert_eq!(plan.counters.total_bytes_moved, (cfg.layers * 2 * TOKENS * cfg.kv_heads * cfg.head_dim * 4) as u64);
    }

    #[test]
    fn tp2_to_tp8_replication_decode_is_bitwise_local() {
        let _shared = crate::shared();
        transfer_and_decode("tp=2,block=16,layout=hnd,table=shuffle:1", "tp=8,block=16,layout=nhd,table=shuffle:2", 0);
    }

    #[test]
    fn tp8_replicas_to_tp1_decode_is_bitwise_local() {
        let _shared = crate::shared();
        transfer_and_decode("tp=8,block=32,layout=nhd", "tp=1,block=16,layout=hnd,table=shuffle:4", 0);
    }

    #[test]
    fn unequal_pp_split_decode_is_bitwise_local() {
        let _shared = crate::shared();
        transfer_and_decode("tp=4,block=16,layout=nhd", "tp=2,pp=2,pp_layers=3,1,block=32,layout=hnd,table=shuffle:6", 0);
    }

    #[test]
    fn prefix_hit_decode_is_bitwise_local() {
        let _shared = crate::shared();
        let prefix = 16;
        let plan = transfer_and_decode("tp=4,block=16,layout=nhd", "tp=2,block=32,layout=hnd,table=shuffle:3", prefix);
        let cfg = Config::default();
        let row_bytes = cfg.head_dim * 4;
        let per_pos = (cfg.layers * 2 * cfg.kv_heads * row_bytes) as u64;
        assert_eq!(plan.counters.reused_bytes, prefix as u64 * per_pos);
        assert_eq!(plan.counters.total_bytes_moved, (TOKENS - prefix) as u64 * per_pos);
    }
}
