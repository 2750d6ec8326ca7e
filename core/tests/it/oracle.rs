//! An independent plan oracle. `verify` builds its expectation with the
//! planner's own `Side`, shard map and geometry, so a wrong head partition or
//! a wrong row stride would agree with itself there. Here every offset is
//! written out from first principles, as the C test does: the model's
//! numbers, the head partition and replication rule of DESIGN §3, and the
//! NHD/HND row order. Only the engine's inputs (block tables, pool size) are
//! read from the sides; `verify::code` is only a hash naming each byte.

use kvwire_core::format::CacheFormat;
use kvwire_core::layout::{from_toml_spec, ModelSpec, Tensor};
use kvwire_core::plan::{build, execute, Buffers, CostModel, PlanInput, Side};
use kvwire_core::shard::{LayoutSpec, RegionId};
use kvwire_core::verify::{code, CANARY};
use std::collections::BTreeMap;

/// Two dense GQA layers (4 KV heads, K rows of 64 and V rows of 32
/// elements) and one MLA layer (a latent of 96 + 32 elements, no heads,
/// held whole by every TP rank). bf16: 2 bytes an element.
const MODEL: &str = r#"
name = "oracle"
dtype = "bf16"

[[layers]]
repeat = 2
attention = "dense"
kv_heads = 4
head_dim = 64
v_head_dim = 32

[[layers]]
attention = "mla"
kv_lora_rank = 96
qk_rope_head_dim = 32
"#;

const KV_HEADS: u32 = 4;

/// (layer, tensor, row bytes, is per head) of every stored tensor, by hand.
const TENSORS: [(u32, Tensor, u64, bool); 5] =
    [(0, Tensor::K, 64 * 2, true), (0, Tensor::V, 32 * 2, true), (1, Tensor::K, 64 * 2, true), (1, Tensor::V, 32 * 2, true), (2, Tensor::Latent, 128 * 2, false)];

/// One side as the oracle sees it: the TP degree, block size and row order
/// it was given, and the engine's block table and pool size.
struct Hand {
    tp: u32,
    block: u64,
    hnd: bool,
    table: Vec<u32>,
    num_blocks: u64,
}

impl Hand {
    /// KV heads rank `r` holds: a real split when `tp <= kv_heads`
    /// (`kv_heads / tp` consecutive heads each), else each head replicated
    /// on `tp / kv_heads` consecutive ranks.
    fn heads(&self, r: u32) -> Vec<u32> {
        if self.tp <= KV_HEADS {
            let n = KV_HEADS / self.tp;
            (r * n..(r + 1) * n).collect()
        } else {
            vec![r / (self.tp / KV_HEADS)]
        }
    }

    /// Rows per token of a tensor on rank `r`: its heads, or 1 for a latent.
    fn rows(&self, r: u32, per_head: bool) -> u64 {
        if per_head {
            self.heads(r).len() as u64
        } else {
            1
        }
    }

    /// Region bytes: the whole pool of blocks of `rows × row` bytes per token.
    fn region_len(&self, r: u32, row: u64, per_head: bool) -> u64 {
        self.num_blocks * self.block * self.rows(r, per_head) * row
    }

    /// Offset of (position, local row) in a region.
    fn offset(&self, rows: u64, row: u64, local: u64, pos: u64) -> u64 {
        let (blk, slot) = (u64::from(self.table[(pos / self.block) as usize]), pos % self.block);
        let index = if self.hnd { local * self.block + slot } else { slot * rows + local };
        blk * self.block * rows * row + index * row
    }

    /// Buffers of every rank filled with `fill`, then every retained byte of
    /// positions `from..tokens` written with its code.
    fn buffers(&self, fill: u8, tokens: u64, from: u64) -> Buffers {
        let ranks = (0..self.tp)
            .map(|r| {
                let mut m = BTreeMap::new();
                for (layer, tensor, row, per_head) in TENSORS {
                    let mut buf = vec![fill; self.region_len(r, row, per_head) as usize];
                    let heads = if per_head { self.heads(r) } else { vec![0] };
                    let rows = heads.len() as u64;
                    for pos in from..tokens {
                        for (local, &head) in heads.iter().enumerate() {
                            let at = self.offset(rows, row, local as u64, pos) as usize;
                            for byte in 0..row {
                                buf[at + byte as usize] = code(layer, tensor, head, pos, byte);
                            }
                        }
                    }
                    m.insert(RegionId { layer, tensor }, buf);
                }
                m
            })
            .collect();
        Buffers { ranks }
    }
}

fn model() -> ModelSpec {
    from_toml_spec("oracle", MODEL).unwrap()
}

fn side(m: &ModelSpec, layout: &str, tokens: u64) -> (Side, Hand) {
    let s = Side::new(m, &LayoutSpec::parse(layout).unwrap(), CacheFormat::parse("bf16").unwrap(), tokens).unwrap();
    let opt = |k: &str| layout.split(',').find_map(|kv| kv.strip_prefix(&format!("{k}="))).unwrap().to_string();
    let hand = Hand {
        tp: opt("tp").parse().unwrap(),
        block: opt("block").parse().unwrap(),
        hnd: opt("layout") == "hnd",
        table: s.block_table.clone(),
        num_blocks: u64::from(s.num_blocks),
    };
    (s, hand)
}

/// Plans `src → dst`, runs the plan on source buffers laid out by hand, and
/// compares every destination byte with the hand-made expectation: needed
/// bytes hold their codes, all else stays canary. Returns bytes copied.
fn check(src: &str, dst: &str, tokens: u64, prefix: u64) -> u64 {
    let m = model();
    let ((s, hs), (d, hd)) = (side(&m, src, tokens), side(&m, dst, tokens));
    let plan = build(&PlanInput { model: &m, tokens, prefix_tokens: prefix, src: &s, dst: &d, cost: CostModel::default() }).unwrap();
    let source = hs.buffers(0, tokens, 0);
    let want = hd.buffers(CANARY, tokens, prefix);
    // The planner's own allocation must have the hand-computed sizes.
    let theirs = Buffers::alloc(&m, &d, CANARY);
    for (r, (w, t)) in want.ranks.iter().zip(&theirs.ranks).enumerate() {
        let sizes = |b: &BTreeMap<RegionId, Vec<u8>>| b.iter().map(|(k, v)| (*k, v.len())).collect::<Vec<_>>();
        assert_eq!(sizes(w), sizes(t), "{dst}: rank {r}'s regions");
    }
    let mut got = theirs;
    let copied = execute(&plan, &source, &mut got).unwrap();
    for (r, (w, g)) in want.ranks.iter().zip(&got.ranks).enumerate() {
        for (region, wb) in w {
            let gb = &g[region];
            if let Some(i) = wb.iter().zip(gb).position(|(a, b)| a != b) {
                panic!("{src} -> {dst}: rank {r} {region:?} byte {i}: want {:#04x}, got {:#04x}", wb[i], gb[i]);
            }
        }
    }
    // Exactly the needed bytes were written: one row per (position, head
    // held) of each dense tensor and one latent row per position, per rank.
    let rows_needed: u64 = (0..hd.tp)
        .map(|r| TENSORS.iter().map(|&(_, _, row, per_head)| hd.rows(r, per_head) * row).sum::<u64>())
        .sum::<u64>()
        * (tokens - prefix);
    assert_eq!(copied, rows_needed, "{src} -> {dst}: bytes copied");
    copied
}

#[test]
fn tp4_nhd_to_tp2_hnd_matches_offsets_computed_by_hand() {
    // 100 tokens: a partial final block on both sides.
    let n = check("tp=4,block=16,layout=nhd,table=shuffle:1", "tp=2,block=32,layout=hnd,table=shuffle:2", 100, 0);
    // Per token: 2 dense layers × 4 heads × (128 + 64) bytes + a 256-byte
    // latent on each of the 2 destination ranks.
    assert_eq!(n, 100 * (2 * 4 * (128 + 64) + 2 * 256));
}

#[test]
fn tp2_to_tp8_replicates_each_head_on_two_ranks() {
    let n = check("tp=2,block=16,layout=hnd,table=contig", "tp=8,block=16,layout=nhd,table=shuffle:3", 37, 0);
    // 8 ranks, one head each (every head twice), and the latent on all 8.
    assert_eq!(n, 37 * (8 * 2 * (128 + 64) + 8 * 256));
}

#[test]
fn a_reused_prefix_leaves_its_positions_untouched() {
    check("tp=4,block=16,layout=nhd,table=shuffle:1", "tp=2,block=32,layout=hnd,table=shuffle:2", 100, 40);
    check("tp=1,block=16,layout=nhd,table=contig", "tp=4,block=32,layout=nhd,table=shuffle:5", 70, 32);
}
