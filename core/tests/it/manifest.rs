//! Integrity manifests: identity checks, checksums at both ends, JSON.
//!
//! Every transfer here is a real plan executed on coded buffers
//! (`verify::fill_source`); checksums computed from the source must agree
//! with checksums recomputed from the destination after placement, and one
//! flipped byte must be caught and located. Expected figures (entry counts,
//! byte counts, offsets of the flipped byte) are derived by hand from the
//! model's published numbers and the layout's definition.

use kvwire_core::format::{CacheFormat, FORMATS};
use kvwire_core::layout::{builtin, from_toml_spec, ModelSpec, Tensor};
use kvwire_core::manifest::{
    checksums_at_destination, checksums_at_source, checksums_of, chunks_of, Checksums, layer_shapes, read_buffers, Expected, HeldRun, LayerChecksum, Manifest, ManifestError,
    MapSummary, RankSummary, Reading, RopeParams, CHECKSUM_CHUNK, MAX_MANIFEST_JSON,
};
use kvwire_core::plan::{build, execute, Buffers, CostModel, Plan, PlanInput, Side};
use kvwire_core::reuse::CacheIdentity;
use kvwire_core::shard::{LayoutSpec, RegionId};
use kvwire_core::verify::{fill_source, CANARY};
use proptest::prelude::*;
use proptest::sample::Index;
use std::sync::OnceLock;
use twox_hash::XxHash3_64;

const SRC: &str = "tp=4";
const DST: &str = "tp=2,layout=hnd,block=32";
const TOKENS: u64 = 100;
const TRANSFER: &str = "req-7f3a";

// llama-3.1-8b: 32 layers, 8 KV heads, head_dim 4096 / 32 = 128; fp32 rows are 512 bytes.
const LAYERS: u64 = 32;
const ROW: u64 = 128 * 4;
// Destination tp=2: 4 heads per rank; HND block of 32 tokens = 32 × 4 rows.
const DST_HEADS: u64 = 4;
const DST_BLOCK_BYTES: u64 = 32 * DST_HEADS * ROW;

fn fp32() -> CacheFormat {
    CacheFormat::parse("fp32").unwrap()
}

fn identity() -> CacheIdentity {
    CacheIdentity {
        model_digest: "sha256:llama-3.1-8b@0e9e39f".into(),
        adapter_digest: "lora:support-v2".into(),
        format: "fp32/v1".into(),
        tenant: "acme".into(),
        rope: "theta=500000;scaling=llama3(factor=8,low_freq_factor=1,high_freq_factor=4,original_max_position_embeddings=8192)"
            .into(),
        position_offset: 0,
    }
}

fn side(model: &ModelSpec, layout: &str, format: CacheFormat, tokens: u64) -> Side {
    Side::new(model, &LayoutSpec::parse(layout).unwrap(), format, tokens).unwrap()
}

/// A transfer that ran: sides, plan, source bytes and placed destination bytes.
struct Run {
    model: ModelSpec,
    src: Side,
    dst: Side,
    plan: Plan,
    src_bufs: Buffers,
    dst_bufs: Buffers,
}

fn run(model: ModelSpec, src: &str, dst: &str, format: CacheFormat, tokens: u64, prefix_tokens: u64) -> Run {
    let s = side(&model, src, format, tokens);
    let d = side(&model, dst, format, tokens);
    let plan = build(&PlanInput { model: &model, tokens, prefix_tokens, src: &s, dst: &d, cost: CostModel::default() }).unwrap();
    let src_bufs = fill_source(&model, &s, tokens);
    let mut dst_bufs = Buffers::alloc(&model, &d, CANARY);
    execute(&plan, &src_bufs, &mut dst_bufs).unwrap();
    Run { model, src: s, dst: d, plan, src_bufs, dst_bufs }
}

impl Run {
    fn manifest(&self, id: &CacheIdentity) -> Manifest {
        Manifest::for_plan(id, &self.model, &self.src, &self.dst, &self.plan, TRANSFER, read_buffers(&self.src_bufs)).unwrap()
    }

    fn expected(&self, id: &CacheIdentity) -> Expected {
        Expected::new(id, &self.model, &self.dst, TRANSFER, self.plan.tokens, self.plan.prefix_tokens).unwrap()
    }

    fn at_destination(&self, bufs: &Buffers) -> Vec<LayerChecksum> {
        checksums_at_destination(&self.plan, read_buffers(bufs), |_, _| true).unwrap()
    }
}

/// TP4 NHD block 16 → TP2 HND block 32, 100 tokens of llama-3.1-8b in fp32 (built once).
fn llama() -> &'static Run {
    static RUN: OnceLock<Run> = OnceLock::new();
    RUN.get_or_init(|| run(builtin("llama-3.1-8b").unwrap(), SRC, DST, fp32(), TOKENS, 0))
}

fn llama_manifest() -> &'static Manifest {
    static M: OnceLock<Manifest> = OnceLock::new();
    M.get_or_init(|| llama().manifest(&identity()))
}

// ------------------------------------------------------------ checksums

#[test]
fn checksums_from_source_agree_with_destination_after_tp4_to_tp2_hnd_block32() {
    let r = llama();
    let m = llama_manifest();
    m.check(&r.expected(&identity())).unwrap();

    // One entry per (dst rank, layer, tensor), each one chunk (under 1 MiB): 2 ranks × 32 layers × (K, V),
    // in (rank, layer, tensor) order; each covers 100 tokens × 4 heads × 512 bytes.
    assert_eq!(m.checksums.len() as u64, 2 * LAYERS * 2);
    let mut i = 0;
    for rank in 0..2 {
        for layer in 0..LAYERS as u32 {
            for tensor in [Tensor::K, Tensor::V] {
                let c = &m.checksums[i];
                assert_eq!((c.dst_rank, c.layer, c.tensor, c.bytes), (rank, layer, tensor, TOKENS * DST_HEADS * ROW));
                i += 1;
            }
        }
    }

    let recomputed = r.at_destination(&r.dst_bufs);
    assert_eq!(recomputed, m.checksums);
    m.verify_checksums(&recomputed).unwrap();
}

/// Two layers of llama-3.1-8b's shape, 1100 tokens in fp32: each
/// destination region of TP4 NHD/16 → TP2 HND/32 receives 1100 × 4 heads
/// × 512 bytes = 2,252,800 bytes, a little over two chunks (built once).
fn two_chunk_regions() -> &'static Run {
    static RUN: OnceLock<Run> = OnceLock::new();
    RUN.get_or_init(|| {
        let spec = "[[layers]]\nattention = \"dense\"\nkv_heads = 8\nhead_dim = 128\n".repeat(2);
        run(from_toml_spec("two-layers", &spec).unwrap(), "tp=4,block=16", DST, fp32(), 1100, 0)
    })
}

/// The checksum list by the module's definition, written out here: each
/// destination region's segments in plan order, a segment starting at
/// stream offset `o` in chunk `o / CHECKSUM_CHUNK`, each chunk one XXH3 of
/// its segments' destination runs.
fn chunked_by_hand(plan: &Plan, bufs: &Buffers) -> Vec<LayerChecksum> {
    use std::collections::BTreeMap;
    let read = read_buffers(bufs);
    let mut chunks: BTreeMap<(u32, u32, Tensor, u64), Vec<u8>> = BTreeMap::new();
    let mut at: BTreeMap<(u32, RegionId), u64> = BTreeMap::new();
    for i in 0..plan.segments.len() {
        let s = plan.segments.get(i).unwrap();
        let offset = at.entry((s.dst_rank, s.dst_region)).or_insert(0);
        let bytes = chunks.entry((s.dst_rank, s.dst_region.layer, s.dst_region.tensor, *offset / CHECKSUM_CHUNK)).or_default();
        for (_, d) in s.runs() {
            bytes.extend_from_slice(read(s.dst_rank, s.dst_region, d, s.len).unwrap());
        }
        *offset += s.bytes();
    }
    chunks
        .into_iter()
        .map(|((dst_rank, layer, tensor, chunk), b)| LayerChecksum { dst_rank, layer, tensor, chunk: chunk as u32, bytes: b.len() as u64, xxh3: XxHash3_64::oneshot(&b) })
        .collect()
}

#[test]
fn a_region_longer_than_a_chunk_has_a_checksum_per_chunk_and_chunks_hash_apart_to_the_same_list() {
    let r = two_chunk_regions();
    let m = r.manifest(&identity());
    m.check(&r.expected(&identity())).unwrap();
    // 2 dst ranks × 2 layers × (K, V), each region three chunks: two of
    // about 1 MiB (cut at segment boundaries), then the rest.
    assert_eq!(m.checksums.len(), 2 * 2 * 2 * 3);
    let region = 1100 * DST_HEADS * ROW;
    for c in m.checksums.chunks(3) {
        assert_eq!(c.iter().map(|c| c.chunk).collect::<Vec<_>>(), [0, 1, 2]);
        assert_eq!(c.iter().map(|c| c.bytes).sum::<u64>(), region);
        assert!(c[..2].iter().all(|c| c.bytes >= CHECKSUM_CHUNK - DST_BLOCK_BYTES && c.bytes <= CHECKSUM_CHUNK + DST_BLOCK_BYTES), "{c:?}");
    }
    assert_eq!(m.checksums, chunked_by_hand(&r.plan, &r.dst_bufs));
    let recomputed = r.at_destination(&r.dst_bufs);
    assert_eq!(recomputed, m.checksums);

    // Each chunk hashed on its own, told where it starts, in any order:
    // the lists put together are the one-pass list, at either end.
    for (side, bufs) in [(Reading::Source, &r.src_bufs), (Reading::Destination, &r.dst_bufs)] {
        let mut apart = Vec::new();
        for layer in 0..2 {
            let segs: Vec<usize> = (0..r.plan.segments.len()).filter(|&i| r.plan.segments.at(i).dst_region.layer == layer).collect();
            let runs = chunks_of(&r.plan, &segs);
            assert_eq!(runs.len(), 2 * 2 * 3, "layer {layer}");
            // Two "threads": the odd chunks in reverse, then the even ones.
            let (odd, even): (Vec<_>, Vec<_>) = runs.iter().enumerate().partition(|(k, _)| k % 2 == 1);
            for part in [odd.into_iter().rev().collect::<Vec<_>>(), even] {
                let mut sums = Checksums::new(&r.plan, side).starting_at(part.iter().map(|(_, c)| (c.seg, c.start)));
                for (_, c) in &part {
                    sums.add(c.segs.iter().copied(), read_buffers(bufs), |_| None::<&[u8]>).unwrap();
                }
                apart.extend(sums.finish());
            }
        }
        apart.sort_by_key(LayerChecksum::key);
        assert_eq!(apart, m.checksums, "{side:?}");
    }

    // A flipped byte in the last chunk of a region (its last segment's
    // last run) fails that chunk, by number.
    let k1 = RegionId { layer: 1, tensor: Tensor::K };
    let last = (0..r.plan.segments.len()).map(|i| r.plan.segments.at(i)).filter(|s| (s.dst_rank, s.dst_region) == (1, k1)).last().unwrap();
    let (_, at) = last.runs().last().unwrap();
    let mut bad = r.dst_bufs.clone();
    bad.ranks[1].get_mut(&k1).unwrap()[at as usize] ^= 1;
    let err = m.verify_checksums(&r.at_destination(&bad)).unwrap_err();
    assert!(matches!(err, ManifestError::Checksum { dst_rank: 1, layer: 1, tensor: Tensor::K, chunk: 2, .. }), "{err}");
}

#[test]
fn a_segment_longer_than_a_chunk_stays_in_one_chunk() {
    // The same layout at both ends: each region is one segment of
    // 1100 × 8 heads × 512 bytes (4.3 MiB), so one chunk, numbered 0.
    let spec = "[[layers]]\nattention = \"dense\"\nkv_heads = 8\nhead_dim = 128\n".repeat(2);
    let r = run(from_toml_spec("two-layers", &spec).unwrap(), "tp=1", "tp=1", fp32(), 1100, 0);
    assert_eq!(r.plan.segments.len(), 2 * 2);
    let m = r.manifest(&identity());
    assert_eq!(m.checksums.iter().map(|c| (c.chunk, c.bytes)).collect::<Vec<_>>(), vec![(0, 1100 * 8 * ROW); 4]);
    assert_eq!(r.at_destination(&r.dst_bufs), m.checksums);
}

#[test]
fn layer_sums_sent_one_layer_at_a_time_make_the_whole_manifest() {
    let r = llama();
    let whole = llama_manifest();
    // A streaming source's manifest carries no checksums; each layer's follow.
    let mut m = Manifest { checksums: vec![], ..whole.clone() };
    m.check(&r.expected(&identity())).unwrap();
    for layer in (0..LAYERS as u32).rev() {
        let sums = checksums_at_source(&r.plan, read_buffers(&r.src_bufs), |_, l| l == layer).unwrap();
        assert_eq!(sums.len(), 4, "2 dst ranks × (K, V) of layer {layer}");
        m.add_layer_checksums(layer, &sums).unwrap();
        // Each layer verifies as soon as its own sums are in.
        let this = |_, l: u32| l == layer;
        let recomputed = checksums_at_destination(&r.plan, read_buffers(&r.dst_bufs), this).unwrap();
        m.verify_checksums_of(&recomputed, this).unwrap();
    }
    assert_eq!(m.checksums, whole.checksums);
    m.check(&r.expected(&identity())).unwrap();

    // What a hostile or broken source might send instead; each refused by
    // name, and nothing of it kept.
    let mut m = Manifest { checksums: vec![], ..whole.clone() };
    let layer1 = checksums_at_source(&r.plan, read_buffers(&r.src_bufs), |_, l| l == 1).unwrap();
    let refused = |m: &mut Manifest, layer: u32, sums: &[LayerChecksum], needle: &str| {
        let before = m.checksums.clone();
        let e = m.add_layer_checksums(layer, sums).unwrap_err().to_string();
        assert!(e.contains(needle), "{e}");
        assert_eq!(m.checksums, before);
    };
    refused(&mut m, 0, &layer1, "sent for layer 0 name layer 1");
    let twice: Vec<LayerChecksum> = layer1.iter().chain(&layer1[..1]).copied().collect();
    refused(&mut m, 1, &twice, "out of order or repeated");
    let mut stray = layer1.clone();
    stray[0].dst_rank = 9;
    refused(&mut m, 1, &stray, "dst rank 9 does not hold layer 1");
    m.add_layer_checksums(1, &layer1).unwrap();
    refused(&mut m, 1, &layer1, "checksums of layer 1 were sent twice");
}

#[test]
fn segments_read_whole_from_a_gathered_copy_hash_as_their_runs_do() {
    let r = llama();
    // Each segment's runs gathered into one buffer, as a source's staging
    // holds a packed segment: read whole, the digests are the runs' digests.
    let read = read_buffers(&r.src_bufs);
    let gathered: Vec<Vec<u8>> = r.plan.segments.iter().map(|s| s.runs().flat_map(|(so, _)| read(s.src_rank, s.src_region, so, s.len).unwrap().to_vec()).collect()).collect();
    assert!(r.plan.segments.iter().any(|s| s.count > 1 && s.src_stride != s.len), "some segment's runs are apart at the source");
    let all = 0..r.plan.segments.len();
    let whole = checksums_of(&r.plan, Reading::Source, all.clone(), read_buffers(&r.src_bufs), |i| Some(gathered[i].as_slice())).unwrap();
    assert_eq!(whole, llama_manifest().checksums);
    // Every other segment whole, the rest run by run: still the same.
    let mixed = checksums_of(&r.plan, Reading::Source, all.clone(), read_buffers(&r.src_bufs), |i| (i % 2 == 0).then(|| gathered[i].as_slice())).unwrap();
    assert_eq!(mixed, whole);
    // One layer's segments alone give that layer's entries.
    let layer3: Vec<usize> = all.clone().filter(|&i| r.plan.segments.at(i).dst_region.layer == 3).collect();
    let sums = checksums_of(&r.plan, Reading::Destination, layer3, read_buffers(&r.dst_bufs), |_| None::<&[u8]>).unwrap();
    assert_eq!(sums, checksums_at_destination(&r.plan, read_buffers(&r.dst_bufs), |_, l| l == 3).unwrap());
    // A whole read of the wrong size, or a segment the plan lacks, is refused by name.
    let short = checksums_of(&r.plan, Reading::Source, [0], read_buffers(&r.src_bufs), |_| Some(&gathered[0][1..])).unwrap_err();
    assert!(matches!(short, ManifestError::Unreadable { side: "source", .. }), "{short}");
    let past = checksums_of(&r.plan, Reading::Source, [r.plan.segments.len()], read_buffers(&r.src_bufs), |_| None::<&[u8]>).unwrap_err();
    assert_eq!(past.to_string(), format!("segment {0} of a plan of {0}", r.plan.segments.len()));
}

#[test]
fn checksums_fed_in_pieces_equal_one_pass_over_every_segment() {
    let r = llama();
    let want = llama_manifest().checksums.clone();
    let n = r.plan.segments.len();
    assert!(n > 7, "the plan has several segments to split");
    // Pieces of uneven sizes, some of one segment, some cutting a region's
    // segments in two: the digests do not depend on where the pieces end.
    for cuts in [vec![1, n], vec![3, 4, n / 2, n - 1, n], (1..=n).collect::<Vec<_>>()] {
        let mut sums = Checksums::new(&r.plan, Reading::Source);
        let mut from = 0;
        for to in cuts {
            sums.add(from..to, read_buffers(&r.src_bufs), |_| None::<&[u8]>).unwrap();
            from = to;
        }
        assert_eq!(sums.finish(), want);
    }
    // A piece that fails names what it could not read; nothing is finished.
    let mut sums = Checksums::new(&r.plan, Reading::Source);
    sums.add(0..1, read_buffers(&r.src_bufs), |_| None::<&[u8]>).unwrap();
    let past = sums.add([n], read_buffers(&r.src_bufs), |_| None::<&[u8]>).unwrap_err();
    assert_eq!(past.to_string(), format!("segment {n} of a plan of {n}"));
}

#[test]
fn checksum_is_xxh3_of_the_moved_bytes_for_a_contiguous_copy() {
    // Same layout both sides, one rank: every region's moved bytes are its
    // first tokens × heads rows (NHD, contiguous table), one run.
    let model = from_toml_spec("c", "[[layers]]\nrepeat = 2\nattention = \"dense\"\nkv_heads = 2\nhead_dim = 8\nv_head_dim = 4\n").unwrap();
    let r = run(model, "tp=1,block=16", "tp=1,block=16", fp32(), 37, 0);
    let m = r.manifest(&identity());
    assert_eq!(m.checksums.len(), 4);
    for c in &m.checksums {
        let dim = if c.tensor == Tensor::K { 8 } else { 4 };
        let len = 37 * 2 * dim * 4;
        let region = &r.src_bufs.ranks[0][&RegionId { layer: c.layer, tensor: c.tensor }];
        assert_eq!(c.bytes, len);
        assert_eq!(c.xxh3, XxHash3_64::oneshot(&region[..len as usize]), "{c:?}");
    }
}

#[test]
fn prefix_hit_checksums_cover_only_the_moved_positions() {
    let r = run(builtin("llama-3.1-8b").unwrap(), SRC, DST, fp32(), TOKENS, 64);
    let id = CacheIdentity { position_offset: 1000, ..identity() };
    let m = r.manifest(&id);
    assert_eq!(m.positions.first_position, 1064);
    assert_eq!(m.prefix_tokens, 64);
    assert!(m.checksums.iter().all(|c| c.bytes == (TOKENS - 64) * DST_HEADS * ROW));
    m.check(&r.expected(&id)).unwrap();
    m.verify_checksums(&r.at_destination(&r.dst_bufs)).unwrap();
}

#[test]
fn one_flipped_destination_byte_fails_naming_dst_rank_layer_tensor() {
    let r = llama();
    let m = llama_manifest();
    // HND, contiguous table: token 0 of local head 0 is byte 0 of block 0.
    let mut bufs = r.dst_bufs.clone();
    bufs.ranks[1].get_mut(&RegionId { layer: 3, tensor: Tensor::V }).unwrap()[0] ^= 0x01;
    let err = m.verify_checksums(&r.at_destination(&bufs)).unwrap_err();
    let want = m.checksums.iter().find(|c| (c.dst_rank, c.layer, c.tensor) == (1, 3, Tensor::V)).unwrap().xxh3;
    match &err {
        ManifestError::Checksum { dst_rank: 1, layer: 3, tensor: Tensor::V, chunk: 0, expected, got } => {
            assert_eq!(*expected, want);
            assert_ne!(*got, want);
        }
        other => panic!("wrong error: {other:?}"),
    }
    assert!(err.to_string().starts_with(&format!("checksum mismatch: dst rank 1 layer 3 tensor v chunk 0: expected {want:#018x}, got 0x")), "{err}");
}

#[test]
fn a_byte_the_plan_does_not_move_is_not_covered() {
    let r = llama();
    // Token 100 is slot 4 of block 3: past the request, never written.
    let mut bufs = r.dst_bufs.clone();
    let off = 3 * DST_BLOCK_BYTES + 4 * ROW;
    let region = bufs.ranks[0].get_mut(&RegionId { layer: 0, tensor: Tensor::K }).unwrap();
    assert_eq!(region[off as usize], CANARY);
    region[off as usize] ^= 0xFF;
    llama_manifest().verify_checksums(&r.at_destination(&bufs)).unwrap();
}

#[test]
fn a_receiver_holding_one_rank_verifies_only_that_rank() {
    let r = llama();
    let m = llama_manifest();
    let mine = checksums_at_destination(&r.plan, read_buffers(&r.dst_bufs), |rank, _| rank == 1).unwrap();
    assert_eq!(mine.len() as u64, LAYERS * 2);
    assert!(mine.iter().all(|c| c.dst_rank == 1));
    m.verify_checksums_where(&mine, |rank| rank == 1).unwrap();
    assert_eq!(
        m.verify_checksums(&mine),
        Err(ManifestError::ChecksumNotRecomputed { dst_rank: 0, layer: 0, tensor: Tensor::K, chunk: 0 })
    );
}

#[test]
fn recomputed_lists_that_disagree_in_shape_are_refused() {
    let m = llama_manifest();
    let mut extra = m.checksums.clone();
    extra.push(LayerChecksum { dst_rank: 2, layer: 0, tensor: Tensor::K, chunk: 0, bytes: 1, xxh3: 0 });
    assert_eq!(
        m.verify_checksums(&extra),
        Err(ManifestError::ChecksumNotInManifest { dst_rank: 2, layer: 0, tensor: Tensor::K, chunk: 0 })
    );
    let mut short = m.checksums.clone();
    short[5].bytes -= 1;
    let err = m.verify_checksums(&short).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("checksum byte count mismatch: dst rank 0 layer 2 tensor v chunk 0: expected {0} bytes, got {1}", TOKENS * DST_HEADS * ROW, TOKENS * DST_HEADS * ROW - 1)
    );
}

#[test]
fn an_unreadable_source_run_is_an_error_naming_it() {
    let r = llama();
    let mut src = r.src_bufs.clone();
    src.ranks[2].remove(&RegionId { layer: 5, tensor: Tensor::K });
    let err = Manifest::for_plan(&identity(), &r.model, &r.src, &r.dst, &r.plan, TRANSFER, read_buffers(&src)).unwrap_err();
    assert!(
        matches!(err, ManifestError::Unreadable { side: "source", rank: 2, layer: 5, tensor: Tensor::K, .. }),
        "{err:?}"
    );
    // A reader that hands back owned bytes works too, and a short read is refused.
    let owned = |rank: u32, region, off, len| read_buffers(&r.src_bufs)(rank, region, off, len).map(<[u8]>::to_vec);
    let m = Manifest::for_plan(&identity(), &r.model, &r.src, &r.dst, &r.plan, TRANSFER, owned).unwrap();
    assert_eq!(&m, llama_manifest());
    let short = |_, _, _, len: u64| Some(vec![0u8; len as usize - 1]);
    assert!(matches!(
        Manifest::for_plan(&identity(), &r.model, &r.src, &r.dst, &r.plan, TRANSFER, short),
        Err(ManifestError::Unreadable { .. })
    ));
}

// ------------------------------------------------------------ identity checks

#[test]
fn each_identity_field_mismatch_is_refused_naming_the_field() {
    let r = llama();
    let expected = r.expected(&identity());
    type Edit = fn(&mut CacheIdentity);
    let cases: &[(Edit, &str)] = &[
        (|i| i.model_digest = "sha256:llama-3.1-8b@ffffff0".into(), "model digest mismatch: expected sha256:llama-3.1-8b@0e9e39f, got sha256:llama-3.1-8b@ffffff0"),
        (|i| i.adapter_digest = "lora:support-v3".into(), "adapter digest mismatch: expected lora:support-v2, got lora:support-v3"),
        (|i| i.adapter_digest = String::new(), "adapter digest mismatch: expected lora:support-v2, got "),
        (|i| i.tenant = "globex".into(), "tenant mismatch: expected acme, got globex"),
        (|i| i.rope = "theta=10000".into(), "rope theta mismatch: expected 500000, got 10000"),
        (|i| i.rope = "theta=500000".into(), "rope scaling mismatch: expected llama3(factor=8,low_freq_factor=1,high_freq_factor=4,original_max_position_embeddings=8192), got none"),
        (|i| i.position_offset = 1, "rope position offset mismatch: expected 0, got 1"),
    ];
    for (edit, msg) in cases {
        let mut id = identity();
        edit(&mut id);
        let err = r.manifest(&id).check(&expected).unwrap_err();
        assert_eq!(err.to_string(), *msg);
    }
    let mut id = identity();
    id.position_offset = 1;
    assert_eq!(r.manifest(&id).check(&expected), Err(ManifestError::RopePositionOffset { expected: 0, got: 1 }));
}

#[test]
fn each_manifest_field_mismatch_is_refused_naming_the_field() {
    let r = llama();
    let expected = r.expected(&identity());
    type Edit = fn(&mut Manifest);
    let cases: &[(Edit, &str)] = &[
        (|m| m.version = 3, "unsupported manifest version 3 (this side speaks 2)"),
        (|m| m.checksum_algo = "crc32c".into(), "unsupported checksum algorithm: expected xxh3-64, got crc32c"),
        (|m| m.transfer = "req-0001".into(), "transfer id mismatch: expected req-7f3a, got req-0001"),
        (|m| m.format = "bf16/v1".into(), "cache format mismatch: expected fp32/v1, got bf16/v1"),
        (|m| m.tokens = 101, "tokens mismatch: expected 100, got 101"),
        (|m| m.prefix_tokens = 16, "prefix tokens mismatch: expected 0, got 16"),
        (|m| m.positions.first_position = 1, "first position mismatch: expected 0, got 1"),
        (|m| m.layers[3].tensors[1].heads = 4, "layer shape mismatch: layer 3: expected full k 8x128 v 8x128 retained [0, 100), got full k 8x128 v 4x128 retained [0, 100)"),
        (|m| { m.layers.pop(); }, "layer shape mismatch: expected 32 layers, got 31"),
        (|m| m.dst_map.ranks[1].held[0].heads = [0, 4], "shard map mismatch: destination rank 1: expected rank 1 holds layers [0, 32) heads [4, 8), got rank 1 holds layers [0, 32) heads [0, 4)"),
        (|m| m.checksums.swap(0, 1), "checksum list: dst rank 0 layer 0 tensor k chunk 0 is out of order or repeated"),
        (|m| m.checksums[0].layer = 40, "checksum list: dst rank 0 does not hold layer 40 tensor k"),
        (|m| m.checksums[2].layer = 0, "checksum list: dst rank 0 layer 0 tensor k chunk 0 is out of order or repeated"),
        (|m| m.checksums.last_mut().unwrap().dst_rank = 2, "checksum list: dst rank 2 does not hold layer 31 tensor v"),
        (|m| m.checksums.last_mut().unwrap().tensor = Tensor::State, "checksum list: dst rank 1 does not hold layer 31 tensor state"),
    ];
    for (edit, msg) in cases {
        let mut m = llama_manifest().clone();
        edit(&mut m);
        assert_eq!(m.check(&expected).unwrap_err().to_string(), *msg);
    }
}

#[test]
fn a_destination_with_another_shard_map_refuses_the_manifest() {
    let r = llama();
    let model = &r.model;
    for (dst, msg) in [
        ("tp=4,layout=hnd,block=32", "shard map mismatch: destination tp: expected 4, got 2"),
        ("tp=2,pp=2,layout=hnd,block=32", "shard map mismatch: destination pp_layers: expected [16, 16], got [32]"),
    ] {
        let other = side(model, dst, fp32(), TOKENS);
        let expected = Expected::new(&identity(), model, &other, TRANSFER, TOKENS, 0).unwrap();
        assert_eq!(llama_manifest().check(&expected).unwrap_err().to_string(), msg);
    }
}

#[test]
fn a_destination_with_another_model_refuses_the_manifest() {
    // Same digest (a misconfigured registry), different shapes: caught by the layers.
    let other = builtin("mistral-7b-v0.1").unwrap();
    let d = side(&other, DST, fp32(), TOKENS);
    let expected = Expected::new(&identity(), &other, &d, TRANSFER, TOKENS, 0).unwrap();
    let err = llama_manifest().check(&expected).unwrap_err();
    assert!(matches!(err, ManifestError::LayerShape { .. }), "{err}");
}

#[test]
fn an_identity_in_another_format_than_the_plan_is_refused() {
    let r = llama();
    let id = CacheIdentity { format: "bf16".into(), ..identity() };
    let err = Manifest::for_plan(&id, &r.model, &r.src, &r.dst, &r.plan, TRANSFER, read_buffers(&r.src_bufs)).unwrap_err();
    assert_eq!(err.to_string(), "cache format mismatch: expected fp32/v1, got bf16");
    assert_eq!(Expected::new(&id, &r.model, &r.dst, TRANSFER, TOKENS, 0).unwrap_err(), err);
    // Aliases of the same format are fine.
    let id = CacheIdentity { format: "float32".into(), ..identity() };
    assert_eq!(r.expected(&id), r.expected(&identity()));
}

#[test]
fn rope_text_is_parsed_to_canonical_form() {
    let p = RopeParams::parse("theta=500000.0", 7).unwrap();
    assert_eq!(p, RopeParams { theta: "500000".into(), scaling: "none".into(), position_offset: 7 });
    assert_eq!(p.canonical(), "theta=500000");
    let p = RopeParams::parse("theta=1e4;scaling=linear(factor=2)", 0).unwrap();
    assert_eq!((p.theta.as_str(), p.scaling.as_str()), ("10000", "linear(factor=2)"));
    assert_eq!(RopeParams::parse(&p.canonical(), 0).unwrap(), p);
    for bad in ["", "10000", "theta=", "theta=abc", "theta=-1", "theta=inf", "theta=1;factor=2"] {
        assert!(matches!(RopeParams::parse(bad, 0), Err(ManifestError::RopeText { .. })), "{bad}");
    }
    let r = llama();
    let id = CacheIdentity { rope: "rope_theta: 500000".into(), ..identity() };
    let err = Manifest::for_plan(&id, &r.model, &r.src, &r.dst, &r.plan, TRANSFER, read_buffers(&r.src_bufs)).unwrap_err();
    assert_eq!(err.to_string(), "rope parameters `rope_theta: 500000`: expected `theta=<number>[;scaling=<text>]`");
}

#[test]
fn shard_map_summary_merges_layers_with_the_same_heads() {
    let map = LayoutSpec::parse("tp=2,pp=2,pp_layers=20,12").unwrap().shard_map(&builtin("llama-3.1-8b").unwrap()).unwrap();
    let s = MapSummary::of(&map);
    let held = |layers, heads| vec![HeldRun { layers, heads }];
    assert_eq!(s.tp, 2);
    assert_eq!(s.pp_layers, vec![20, 12]);
    assert_eq!(
        s.ranks,
        vec![
            RankSummary { rank: 0, held: held([0, 20], [0, 4]) },
            RankSummary { rank: 1, held: held([0, 20], [4, 8]) },
            RankSummary { rank: 2, held: held([20, 32], [0, 4]) },
            RankSummary { rank: 3, held: held([20, 32], [4, 8]) },
        ]
    );
}

#[test]
fn layer_shapes_describe_sliding_mla_and_state_layers() {
    let model = from_toml_spec(
        "h",
        "[[layers]]\nattention = \"dense\"\nkv_heads = 2\nhead_dim = 4\nwindow = 8\nsinks = 2\n\
         [[layers]]\nattention = \"mla\"\nkv_lora_rank = 16\nqk_rope_head_dim = 4\n\
         [[layers]]\nattention = \"shared\"\nshares_with = 0\n\
         [[layers]]\nattention = \"none\"\nstate_bytes = 64\n",
    )
    .unwrap();
    let shown: Vec<String> = layer_shapes(&model, 20).iter().map(ToString::to_string).collect();
    assert_eq!(shown, ["sliding k 2x4 v 2x4 retained [0, 2) [12, 20)", "mla latent 1x20 retained [0, 20)", "shared retained", "state retained state 64 bytes"]);
}

// ------------------------------------------------------------ JSON

#[test]
fn json_round_trip_keeps_every_field() {
    let m = llama_manifest();
    let text = m.to_json();
    assert!(text.contains(r#""checksum_algo":"xxh3-64""#));
    assert!(text.contains(r#""tensor":"v""#));
    assert!(text.contains(r#""rope":{"theta":"500000","scaling":"llama3("#));
    let back = Manifest::from_json(text.as_bytes()).unwrap();
    assert_eq!(&back, m);
    let r = llama();
    back.check(&r.expected(&identity())).unwrap();
    back.verify_checksums(&r.at_destination(&r.dst_bufs)).unwrap();
}

#[test]
fn an_expect_carries_its_manifest_in_binary_and_the_destination_reads_it_back_whole() {
    use kvwire_core::manifest::{ManifestError, MANIFEST_VERSION};
    use kvwire_core::session::msg::{Expect, ManifestWire, PeerMsg};
    let m = llama_manifest();
    let msg = PeerMsg::Expect(Expect { slot: 7, manifest: ManifestWire::of(m), layer_sums: false });
    let text = serde_json::to_string(&msg).unwrap();
    // Hex of the binary form: a fraction of the JSON, nothing escaped.
    assert!(text.len() < m.to_json().len(), "{} against {}", text.len(), m.to_json().len());
    let PeerMsg::Expect(e) = serde_json::from_str::<PeerMsg>(&text).unwrap() else { panic!("not an expect") };
    assert_eq!(e.manifest.bytes(), m.to_wire());
    assert_eq!(&e.manifest.manifest().unwrap(), m);
    // What is not hex is refused where the message is read.
    for bad in ["0", "zz", "0A", "[1,2]"] {
        let text = format!(r#"{{"msg":"expect","slot":7,"manifest":"{bad}","layer_sums":false}}"#).replace(r#""[1,2]""#, "[1,2]");
        assert!(serde_json::from_str::<PeerMsg>(&text).is_err(), "{bad}");
    }
    // Bytes that are not a manifest are refused by name when read, never
    // a panic: cut anywhere, one byte more, another version, nothing.
    let wire = m.to_wire();
    for cut in [0, 1, wire.len() / 2, wire.len() - 1] {
        let e = ManifestWire::from_bytes(wire[..cut].to_vec()).manifest().unwrap_err();
        assert!(matches!(e, ManifestError::Wire { .. }), "cut at {cut}: {e}");
    }
    assert_eq!(
        Manifest::from_wire(&vec![0; MAX_MANIFEST_JSON + 1]).unwrap_err().to_string(),
        format!("manifest binary form of {} bytes exceeds the limit of {}", MAX_MANIFEST_JSON + 1, MAX_MANIFEST_JSON)
    );
    let mut longer = wire.clone();
    longer.push(0);
    assert_eq!(ManifestWire::from_bytes(longer).manifest().unwrap_err().to_string(), "malformed binary manifest: 1 bytes after the manifest");
    let mut other = m.clone();
    other.version = MANIFEST_VERSION + 1;
    assert_eq!(Manifest::from_wire(&other.to_wire()), Err(ManifestError::Version { got: MANIFEST_VERSION + 1 }));
    // Another version whose fields no longer decode is still named as such.
    let mut v9 = ManifestWire::of(&other).bytes()[..1].to_vec();
    v9.extend_from_slice(&[0xff; 8]);
    assert_eq!(Manifest::from_wire(&v9), Err(ManifestError::Version { got: MANIFEST_VERSION + 1 }));
}

#[test]
fn json_of_exactly_the_limit_is_accepted_and_one_more_byte_is_not() {
    let mut text = llama_manifest().to_json().into_bytes();
    text.resize(MAX_MANIFEST_JSON, b' ');
    assert_eq!(&Manifest::from_json(&text).unwrap(), llama_manifest());
    text.push(b' ');
    assert_eq!(Manifest::from_json(&text), Err(ManifestError::TooLarge { form: "JSON", len: MAX_MANIFEST_JSON + 1, limit: MAX_MANIFEST_JSON }));
}

#[test]
fn hostile_json_is_refused_cleanly() {
    let good = llama_manifest().to_json();
    let json_err = |text: &[u8]| match Manifest::from_json(text) {
        Err(ManifestError::Json { reason }) => reason,
        other => panic!("expected a JSON error, got {other:?}"),
    };

    // Truncated anywhere.
    for cut in [0, 1, good.len() / 3, good.len() / 2, good.len() - 1] {
        json_err(&good.as_bytes()[..cut]);
    }
    // Unknown fields, at the top and nested.
    assert!(json_err(good.replacen('{', r#"{"extra":1,"#, 1).as_bytes()).contains("unknown field `extra`"));
    let nested = good.replacen(r#""xxh3":"#, r#""crc":1,"xxh3":"#, 1);
    assert!(json_err(nested.as_bytes()).contains("unknown field `crc`"));
    // Wrong types, unknown tensors, out-of-range numbers, missing fields.
    assert!(json_err(good.replacen(r#""tensor":"k""#, r#""tensor":"q""#, 1).as_bytes()).contains("unknown variant `q`"));
    json_err(good.replacen(r#""tokens":100"#, r#""tokens":-1"#, 1).as_bytes());
    json_err(good.replacen(r#""tokens":100"#, r#""tokens":18446744073709551616"#, 1).as_bytes());
    json_err(good.replacen(r#""tokens":100,"#, "", 1).as_bytes());
    json_err(br#"{"version":2}"#);
    json_err(b"[]");
    json_err(b"\xff\xfe{}");
    json_err(&[b'['; 100_000]);
    json_err(b"{\"version\":2,\"transfer\":\"\xc3\"}");
    // 20 MiB: refused before parsing.
    let big = vec![b' '; 20 << 20];
    assert_eq!(
        Manifest::from_json(&big).unwrap_err().to_string(),
        format!("manifest JSON of {} bytes exceeds the limit of {}", 20 << 20, 16 << 20)
    );
}

#[test]
fn another_version_is_refused_before_its_fields_are_read() {
    // A v3 manifest may add fields; the answer is still "unsupported version".
    let v3 = llama_manifest().to_json().replacen(r#""version":2,"#, r#""version":3,"hmac":"x","#, 1);
    assert_eq!(Manifest::from_json(v3.as_bytes()), Err(ManifestError::Version { got: 3 }));
    // Whatever else it lacks, or however well formed the rest is.
    assert_eq!(Manifest::from_json(br#"{"version":4}"#), Err(ManifestError::Version { got: 4 }));
    let v3_whole = llama_manifest().to_json().replacen(r#""version":2,"#, r#""version":3,"#, 1);
    assert_eq!(Manifest::from_json(v3_whole.as_bytes()), Err(ManifestError::Version { got: 3 }));
    // A v1 manifest has one checksum per region, no chunks: refused by version too.
    let v1 = llama_manifest().to_json().replacen(r#""version":2,"#, r#""version":1,"#, 1).replace(r#""chunk":0,"#, "");
    assert_eq!(Manifest::from_json(v1.as_bytes()), Err(ManifestError::Version { got: 1 }));
    assert_eq!(ManifestError::Version { got: 1 }.to_string(), "unsupported manifest version 1 (this side speaks 2)");
}

// ------------------------------------------------------------ properties

/// A small random model: dense layers of one head count (so TP formulas
/// apply), optionally sliding, plus MLA, shared and state layers.
#[derive(Debug, Clone)]
struct Toy {
    kv_heads: u32,
    layers: Vec<ToyLayer>,
}

/// (kind: 0 dense, 1 dense with a wider V, 2 MLA, 3 shared, 4 state; dim; (window, sinks)).
type ToyLayer = (u8, u32, Option<(u64, u64)>);

impl Toy {
    fn toml(&self) -> String {
        let mut t = String::new();
        for (i, (kind, dim, window)) in self.layers.iter().enumerate() {
            t += "[[layers]]\n";
            match kind {
                0 | 1 => t += &format!("attention = \"dense\"\nkv_heads = {}\nhead_dim = {dim}\nv_head_dim = {}\n", self.kv_heads, dim + u32::from(*kind)),
                2 => t += &format!("attention = \"mla\"\nkv_lora_rank = {dim}\nqk_rope_head_dim = 2\n"),
                3 if i > 0 && self.layers[0].0 < 3 => t += "attention = \"shared\"\nshares_with = 0\n",
                _ => t += &format!("attention = \"none\"\nstate_bytes = {}\n", dim * 3),
            }
            if let (Some((w, s)), 0..=2) = (window, kind) {
                t += &format!("window = {w}\nsinks = {s}\n");
            }
        }
        t
    }
}

fn toy() -> impl Strategy<Value = Toy> {
    let layer = (0u8..5, 1u32..9, prop::option::weighted(0.3, (1u64..20, 0u64..4)));
    (prop::sample::select(vec![1u32, 2, 4]), prop::collection::vec(layer, 1..4)).prop_map(|(kv_heads, layers)| Toy { kv_heads, layers })
}

fn layout() -> impl Strategy<Value = String> {
    (
        prop::sample::select(vec![1u32, 2, 4, 8]),
        1u32..3,
        prop::sample::select(vec![1u32, 3, 16]),
        any::<bool>(),
        prop::sample::select(vec![1u32, 8]),
        prop::option::of(0u64..5),
    )
        .prop_map(|(tp, pp, block, hnd, row_align, shuffle)| {
            let mut s = format!("tp={tp},pp={pp},block={block},layout={},row_align={row_align}", if hnd { "hnd" } else { "nhd" });
            if let Some(seed) = shuffle {
                s += &format!(",table=shuffle:{seed}");
            }
            s
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, max_global_rejects: 4096, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn checksums_agree_for_any_small_layout_and_a_flipped_byte_is_located(
        toy in toy(),
        src_layout in layout(),
        dst_layout in layout(),
        format in prop::sample::select(FORMATS.to_vec()),
        tokens in 1u64..80,
        prefix in any::<Index>(),
        flip in (any::<Index>(), any::<Index>(), any::<Index>(), 1u8..=255),
    ) {
        let model = from_toml_spec("toy", &toy.toml()).map_err(|e| TestCaseError::fail(format!("{e}\n{}", toy.toml())))?;
        let resolve = |l: &str| Side::new(&model, &LayoutSpec::parse(l).unwrap(), format, tokens);
        let (Ok(src), Ok(dst)) = (resolve(&src_layout), resolve(&dst_layout)) else {
            return Err(TestCaseError::reject("layout does not fit the model"));
        };
        let prefix_tokens = prefix.index(tokens as usize + 1) as u64;
        let plan = build(&PlanInput { model: &model, tokens, prefix_tokens, src: &src, dst: &dst, cost: CostModel::default() })
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let src_bufs = fill_source(&model, &src, tokens);
        let mut dst_bufs = Buffers::alloc(&model, &dst, CANARY);
        execute(&plan, &src_bufs, &mut dst_bufs).map_err(|e| TestCaseError::fail(e.to_string()))?;

        let id = CacheIdentity { format: format.id(), ..identity() };
        let m = Manifest::for_plan(&id, &model, &src, &dst, &plan, "t", read_buffers(&src_bufs))
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(m.check(&Expected::new(&id, &model, &dst, "t", tokens, prefix_tokens).unwrap()), Ok(()));
        prop_assert_eq!(Manifest::from_json(m.to_json().as_bytes()), Ok(m.clone()));
        let recomputed = checksums_at_destination(&plan, read_buffers(&dst_bufs), |_, _| true).unwrap();
        prop_assert_eq!(&recomputed, &m.checksums);
        // Every moved byte is covered, once.
        prop_assert_eq!(m.checksums.iter().map(|c| c.bytes).sum::<u64>(), plan.counters.total_bytes_moved);

        if !plan.segments.is_empty() {
            let (seg, run, byte, mask) = flip;
            let s = &plan.segments.at(seg.index(plan.segments.len()));
            let (_, d) = s.runs().nth(run.index(s.count as usize)).unwrap();
            let at = (d + byte.index(s.len as usize) as u64) as usize;
            dst_bufs.ranks[s.dst_rank as usize].get_mut(&s.dst_region).unwrap()[at] ^= mask;
            let err = m.verify_checksums(&checksums_at_destination(&plan, read_buffers(&dst_bufs), |_, _| true).unwrap());
            let located = matches!(err, Err(ManifestError::Checksum { dst_rank, layer, tensor, .. })
                if (dst_rank, layer, tensor) == (s.dst_rank, s.dst_region.layer, s.dst_region.tensor));
            prop_assert!(located, "{:?}", err);
        }
    }

    #[test]
    fn mangled_manifest_json_never_panics(
        edits in prop::collection::vec((any::<Index>(), any::<u8>()), 1..8),
        cut in any::<Index>(),
    ) {
        let mut text = small_manifest_json().into_bytes();
        for (at, b) in edits {
            let i = at.index(text.len());
            text[i] = b;
        }
        text.truncate(cut.index(text.len() + 1).max(text.len() / 2));
        let _ = Manifest::from_json(&text);
    }
}

fn small_manifest_json() -> String {
    let model = from_toml_spec("s", "[[layers]]\nrepeat = 2\nattention = \"dense\"\nkv_heads = 2\nhead_dim = 4\n").unwrap();
    let r = run(model, "tp=2", "tp=1,layout=hnd", fp32(), 5, 1);
    r.manifest(&identity()).to_json()
}
