//! A small, real, dependency-free f32 transformer and its paged KV cache.
//!
//! Architecture (Llama-like): token embedding, then per layer
//! `x += Wo · attn(RoPE(Wq·n), RoPE(Wk·n), Wv·n)` with `n = RMSNorm(x)`, and
//! `x += W_down · (silu(W_gate·m) ⊙ W_up·m)` with `m = RMSNorm(x)`; a final
//! RMSNorm and an LM head give the logits. Attention is causal GQA: query
//! head `h` reads KV head `h / (q_heads / kv_heads)`.
//!
//! RoPE uses the rotate-half convention (GPT-NeoX / Hugging Face Llama):
//! element `i < d/2` is paired with `i + d/2` and rotated by
//! `(pos + rope_position_offset) · theta^(-2i/d)`.
//!
//! Determinism: prefill and decode run the same per-row kernels in the same
//! loop order and nothing reassociates float sums, so the decode step after a
//! prefill of `n` tokens gives bitwise the logits of a prefill of `n + 1`.
//!
//! Paged cache: [`scatter`] and [`gather`] move the cache to and from
//! kvwire's region layout (see [`kvwire_core::shard`]) in the `fp32` format:
//! each element is its f32 bit pattern, little-endian, so the copy is lossless.

use kvwire_core::layout::{Attention, LayerSpec, Tensor};
use kvwire_core::plan::Side;
use kvwire_core::shard::{MemLayout, RegionId};
use kvwire_core::ModelSpec;
use std::collections::BTreeMap;

/// Model shape and position semantics.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Config {
    /// Vocabulary size.
    pub vocab: usize,
    /// Residual stream width.
    pub hidden: usize,
    /// Transformer layers.
    pub layers: usize,
    /// Query heads.
    pub q_heads: usize,
    /// KV heads; must divide `q_heads`.
    pub kv_heads: usize,
    /// Elements per head; must be even (RoPE pairs).
    pub head_dim: usize,
    /// MLP inner width.
    pub ffn: usize,
    /// RoPE base.
    pub rope_theta: f64,
    /// Added to every position before rotation. Part of a request's position
    /// semantics, not of the model: [`digest`] leaves it out.
    pub rope_position_offset: u64,
    /// RMSNorm epsilon.
    pub eps: f32,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            vocab: 512,
            hidden: 256,
            layers: 4,
            q_heads: 8,
            kv_heads: 4,
            head_dim: 32,
            ffn: 512,
            rope_theta: 10_000.0,
            rope_position_offset: 0,
            eps: 1e-5,
        }
    }
}

impl Config {
    fn check(&self) {
        assert!(self.vocab > 0 && self.hidden > 0 && self.layers > 0 && self.ffn > 0, "tinylm: zero size in {self:?}");
        assert!(self.kv_heads > 0 && self.q_heads % self.kv_heads == 0, "tinylm: kv_heads must divide q_heads");
        assert!(self.head_dim > 0 && self.head_dim % 2 == 0, "tinylm: head_dim must be even (RoPE pairs)");
    }

    fn q_dim(&self) -> usize {
        self.q_heads * self.head_dim
    }

    fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

/// splitmix64: a tiny deterministic generator, so weights need no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// `n` values uniform in ±`scale`.
    fn fill(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform() * scale).collect()
    }

    /// A `[out][fan_in]` matrix with unit-variance outputs for unit-variance inputs.
    fn matrix(&mut self, out: usize, fan_in: usize) -> Vec<f32> {
        self.fill(out * fan_in, (3.0 / fan_in as f32).sqrt())
    }

    /// A norm weight near 1, so it still matters.
    fn norm(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| 1.0 + 0.1 * self.uniform()).collect()
    }
}

#[derive(Clone)]
struct LayerWeights {
    attn_norm: Vec<f32>,
    wq: Vec<f32>,
    wk: Vec<f32>,
    wv: Vec<f32>,
    wo: Vec<f32>,
    mlp_norm: Vec<f32>,
    w_gate: Vec<f32>,
    w_up: Vec<f32>,
    w_down: Vec<f32>,
}

impl LayerWeights {
    fn tensors(&self) -> [&[f32]; 9] {
        [&self.attn_norm, &self.wq, &self.wk, &self.wv, &self.wo, &self.mlp_norm, &self.w_gate, &self.w_up, &self.w_down]
    }
}

/// A model's weights; matrices are row-major `[out][in]`.
#[derive(Clone)]
pub struct Weights {
    /// The shape and position semantics they run with.
    pub cfg: Config,
    embed: Vec<f32>,
    layers: Vec<LayerWeights>,
    final_norm: Vec<f32>,
    lm_head: Vec<f32>,
}

impl std::fmt::Debug for Weights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Weights").field("cfg", &self.cfg).field("digest", &digest(self)).finish_non_exhaustive()
    }
}

impl Weights {
    /// Deterministic weights for `cfg` from `seed`.
    ///
    /// # Panics
    /// When `cfg` is not a valid shape (zero sizes, `kv_heads` not dividing
    /// `q_heads`, odd `head_dim`).
    pub fn seeded(cfg: &Config, seed: u64) -> Weights {
        cfg.check();
        let mut rng = Rng(seed);
        let embed = rng.fill(cfg.vocab * cfg.hidden, 1.0);
        let layers = (0..cfg.layers)
            .map(|_| LayerWeights {
                attn_norm: rng.norm(cfg.hidden),
                wq: rng.matrix(cfg.q_dim(), cfg.hidden),
                wk: rng.matrix(cfg.kv_dim(), cfg.hidden),
                wv: rng.matrix(cfg.kv_dim(), cfg.hidden),
                wo: rng.matrix(cfg.hidden, cfg.q_dim()),
                mlp_norm: rng.norm(cfg.hidden),
                w_gate: rng.matrix(cfg.ffn, cfg.hidden),
                w_up: rng.matrix(cfg.ffn, cfg.hidden),
                w_down: rng.matrix(cfg.hidden, cfg.ffn),
            })
            .collect();
        let final_norm = rng.norm(cfg.hidden);
        let lm_head = rng.matrix(cfg.vocab, cfg.hidden);
        Weights { cfg: *cfg, embed, layers, final_norm, lm_head }
    }
}

/// One low-rank delta `B · A`: `a` is `[rank][in]`, `b` is `[out][rank]`.
struct Lora {
    a: Vec<f32>,
    b: Vec<f32>,
}

/// A LoRA-style adapter: deltas on Wq, Wk and Wv of every layer, so a
/// different adapter changes the K and V cache, not only the output.
pub struct Adapter {
    rank: usize,
    /// Per layer: q, k, v.
    layers: Vec<[Lora; 3]>,
}

impl std::fmt::Debug for Adapter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Adapter").field("rank", &self.rank).field("digest", &adapter_digest(self)).finish_non_exhaustive()
    }
}

impl Adapter {
    /// A deterministic adapter of `rank` for `cfg`. Deltas are about half the
    /// size of the base projections, so an adapter visibly changes the cache.
    ///
    /// # Panics
    /// When `rank` is zero or `cfg` is not a valid shape.
    pub fn seeded(cfg: &Config, rank: usize, seed: u64) -> Adapter {
        cfg.check();
        assert!(rank > 0, "tinylm: adapter rank must be > 0");
        let mut rng = Rng(seed ^ 0xADA9_7E00_0000_0000);
        let mut lora = |out: usize| Lora {
            a: rng.matrix(rank, cfg.hidden),
            b: rng.fill(out * rank, 0.5 * (3.0 / rank as f32).sqrt()),
        };
        let layers = (0..cfg.layers).map(|_| [lora(cfg.q_dim()), lora(cfg.kv_dim()), lora(cfg.kv_dim())]).collect();
        Adapter { rank, layers }
    }
}

/// 64-bit FNV-1a, enough to tell models apart in tests (not a security digest).
struct Fnv(u64);

impl Fnv {
    fn new() -> Fnv {
        Fnv(0xCBF2_9CE4_8422_2325)
    }

    fn bytes(&mut self, b: &[u8]) {
        for &x in b {
            self.0 = (self.0 ^ u64::from(x)).wrapping_mul(0x0000_0100_0000_01B3);
        }
    }

    fn u64(&mut self, v: u64) {
        self.bytes(&v.to_le_bytes());
    }

    fn floats(&mut self, v: &[f32]) {
        for x in v {
            self.bytes(&x.to_le_bytes());
        }
    }

    fn hex(&self) -> String {
        format!("{:016x}", self.0)
    }
}

/// Model identity: FNV-1a 64 over the shape, `rope_theta`, `eps` and every
/// weight's bytes, as 16 hex digits.
pub fn digest(w: &Weights) -> String {
    let c = &w.cfg;
    let mut h = Fnv::new();
    for v in [c.vocab, c.hidden, c.layers, c.q_heads, c.kv_heads, c.head_dim, c.ffn] {
        h.u64(v as u64);
    }
    h.u64(c.rope_theta.to_bits());
    h.u64(u64::from(c.eps.to_bits()));
    h.floats(&w.embed);
    for l in w.layers.iter() {
        for t in l.tensors() {
            h.floats(t);
        }
    }
    h.floats(&w.final_norm);
    h.floats(&w.lm_head);
    h.hex()
}

/// Adapter identity: FNV-1a 64 over its rank and every delta's bytes.
pub fn adapter_digest(a: &Adapter) -> String {
    let mut h = Fnv::new();
    h.u64(a.rank as u64);
    for l in &a.layers {
        for d in l {
            h.floats(&d.a);
            h.floats(&d.b);
        }
    }
    h.hex()
}

/// The cache description kvwire plans with: `layers` dense layers of
/// `kv_heads × head_dim` K and V, every position retained.
pub fn model_spec(cfg: &Config) -> ModelSpec {
    ModelSpec {
        name: "tinylm".into(),
        family: "tinylm".into(),
        dtype: Some("float32".into()),
        layers: vec![LayerSpec::dense(cfg.kv_heads as u32, cfg.head_dim as u32, cfg.head_dim as u32); cfg.layers],
    }
}

/// A KV cache: per layer, K and V as `[pos][kv_head][head_dim]`, positions `0..tokens`.
#[derive(Debug, Clone, PartialEq)]
pub struct KvCache {
    /// KV heads per layer.
    pub kv_heads: usize,
    /// Elements per row.
    pub head_dim: usize,
    /// Positions held.
    pub tokens: usize,
    /// Per layer K.
    pub k: Vec<Vec<f32>>,
    /// Per layer V.
    pub v: Vec<Vec<f32>>,
}

impl KvCache {
    fn zeroed(layers: usize, kv_heads: usize, head_dim: usize, tokens: usize) -> KvCache {
        let n = tokens * kv_heads * head_dim;
        KvCache { kv_heads, head_dim, tokens, k: vec![vec![0.0; n]; layers], v: vec![vec![0.0; n]; layers] }
    }

    fn at(&self, pos: usize, head: usize) -> std::ops::Range<usize> {
        let start = (pos * self.kv_heads + head) * self.head_dim;
        start..start + self.head_dim
    }

    /// The K row of (`layer`, `pos`, `head`).
    pub fn k_row(&self, layer: usize, pos: usize, head: usize) -> &[f32] {
        &self.k[layer][self.at(pos, head)]
    }

    /// The V row of (`layer`, `pos`, `head`).
    pub fn v_row(&self, layer: usize, pos: usize, head: usize) -> &[f32] {
        &self.v[layer][self.at(pos, head)]
    }

    /// True when both caches hold the same shape and the same f32 bit patterns
    /// (unlike `==`, which calls `-0.0` and `0.0` equal).
    pub fn same_bits(&self, other: &KvCache) -> bool {
        let bits = |c: &KvCache| -> Vec<u32> { c.k.iter().chain(&c.v).flatten().map(|x| x.to_bits()).collect() };
        (self.kv_heads, self.head_dim, self.tokens, self.k.len()) == (other.kv_heads, other.head_dim, other.tokens, other.k.len())
            && bits(self) == bits(other)
    }
}

/// Dot product with eight fixed lanes summed in a fixed tree: fast, and the
/// same bits wherever it is called.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; 8];
    let (ac, at) = a.split_at(a.len() / 8 * 8);
    let (bc, bt) = b.split_at(ac.len());
    for (ca, cb) in ac.chunks_exact(8).zip(bc.chunks_exact(8)) {
        for ((s, x), y) in acc.iter_mut().zip(ca).zip(cb) {
            *s += x * y;
        }
    }
    let mut s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (x, y) in at.iter().zip(bt) {
        s += x * y;
    }
    s
}

/// `w · x` for a row-major `[out][x.len()]` matrix.
fn matvec(w: &[f32], x: &[f32]) -> Vec<f32> {
    w.chunks_exact(x.len()).map(|row| dot(row, x)).collect()
}

fn rmsnorm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let inv = 1.0 / (dot(x, x) / x.len() as f32 + eps).sqrt();
    x.iter().zip(w).map(|(v, g)| v * inv * g).collect()
}

/// `W · x`, plus `B · (A · x)` when an adapter delta applies.
fn project(w: &[f32], lora: Option<&Lora>, x: &[f32]) -> Vec<f32> {
    let mut y = matvec(w, x);
    if let Some(l) = lora {
        let t = matvec(&l.a, x);
        for (yi, d) in y.iter_mut().zip(matvec(&l.b, &t)) {
            *yi += d;
        }
    }
    y
}

/// Rotates every `head_dim` chunk of `x` to absolute position `pos` (rotate-half).
fn rope(x: &mut [f32], head_dim: usize, theta: f64, pos: u64) {
    let half = head_dim / 2;
    let cs: Vec<(f32, f32)> = (0..half)
        .map(|i| {
            let angle = pos as f64 * theta.powf(-2.0 * i as f64 / head_dim as f64);
            (angle.cos() as f32, angle.sin() as f32)
        })
        .collect();
    for head in x.chunks_exact_mut(head_dim) {
        let (lo, hi) = head.split_at_mut(half);
        for ((a, b), &(c, s)) in lo.iter_mut().zip(hi.iter_mut()).zip(&cs) {
            let (x1, x2) = (*a, *b);
            *a = x1 * c - x2 * s;
            *b = x2 * c + x1 * s;
        }
    }
}

/// Q (roped), K (roped), V of one token at `pos` in layer `l`.
fn qkv(w: &Weights, l: usize, adapter: Option<&Adapter>, x: &[f32], pos: u64) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let cfg = &w.cfg;
    let lw = &w.layers[l];
    let lora = |i: usize| adapter.map(|a| &a.layers[l][i]);
    let n = rmsnorm(x, &lw.attn_norm, cfg.eps);
    let mut q = project(&lw.wq, lora(0), &n);
    let mut k = project(&lw.wk, lora(1), &n);
    let v = project(&lw.wv, lora(2), &n);
    let abs = pos + cfg.rope_position_offset;
    rope(&mut q, cfg.head_dim, cfg.rope_theta, abs);
    rope(&mut k, cfg.head_dim, cfg.rope_theta, abs);
    (q, k, v)
}

/// Causal GQA attention of one query over the first `npos` rows of `k`, `v`
/// (`[pos][kv_head][head_dim]`).
fn attend(cfg: &Config, q: &[f32], k: &[f32], v: &[f32], npos: usize) -> Vec<f32> {
    let d = cfg.head_dim;
    let group = cfg.q_heads / cfg.kv_heads;
    let scale = 1.0 / (d as f32).sqrt();
    let row = |j: usize, kvh: usize| {
        let s = (j * cfg.kv_heads + kvh) * d;
        s..s + d
    };
    let mut out = vec![0.0f32; cfg.q_dim()];
    let mut scores = vec![0.0f32; npos];
    for (h, (qh, oh)) in q.chunks_exact(d).zip(out.chunks_exact_mut(d)).enumerate() {
        let kvh = h / group;
        let mut max = f32::NEG_INFINITY;
        for (j, s) in scores.iter_mut().enumerate() {
            *s = dot(qh, &k[row(j, kvh)]) * scale;
            max = max.max(*s);
        }
        let mut sum = 0.0f32;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        for (j, s) in scores.iter().enumerate() {
            let p = s / sum;
            for (o, x) in oh.iter_mut().zip(&v[row(j, kvh)]) {
                *o += p * x;
            }
        }
    }
    out
}

/// Output projection and MLP of layer `l`, both residual, applied to `x`.
fn finish_layer(w: &Weights, l: usize, x: &mut [f32], attn: &[f32]) {
    let lw = &w.layers[l];
    for (xi, o) in x.iter_mut().zip(matvec(&lw.wo, attn)) {
        *xi += o;
    }
    let m = rmsnorm(x, &lw.mlp_norm, w.cfg.eps);
    let gate = matvec(&lw.w_gate, &m);
    let up = matvec(&lw.w_up, &m);
    let act: Vec<f32> = gate.iter().zip(&up).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
    for (xi, o) in x.iter_mut().zip(matvec(&lw.w_down, &act)) {
        *xi += o;
    }
}

fn embed(w: &Weights, token: u32) -> Vec<f32> {
    let t = token as usize;
    assert!(t < w.cfg.vocab, "tinylm: token {t} is past the vocabulary of {}", w.cfg.vocab);
    w.embed[t * w.cfg.hidden..(t + 1) * w.cfg.hidden].to_vec()
}

fn logits(w: &Weights, x: &[f32]) -> Vec<f32> {
    matvec(&w.lm_head, &rmsnorm(x, &w.final_norm, w.cfg.eps))
}

/// Runs `tokens` at positions `0..n` (plus the RoPE offset): the KV cache of
/// every layer and the logits of the last token. Layer by layer over all
/// positions, as a prefill engine does.
///
/// # Panics
/// When `tokens` is empty or holds a token past the vocabulary.
pub fn prefill(w: &Weights, adapter: Option<&Adapter>, tokens: &[u32]) -> (KvCache, Vec<f32>) {
    prefill_with(w, adapter, tokens, |_, _| {})
}

/// [`prefill`], calling `layer_done(l, cache)` as soon as layer `l`'s K
/// and V are computed (the cache then holds layers `0..=l`), before layer
/// `l + 1` starts: what an engine streaming its cache hooks into.
///
/// # Panics
/// As [`prefill`].
pub fn prefill_with(w: &Weights, adapter: Option<&Adapter>, tokens: &[u32], mut layer_done: impl FnMut(usize, &KvCache)) -> (KvCache, Vec<f32>) {
    assert!(!tokens.is_empty(), "tinylm: prefill needs at least one token");
    let cfg = &w.cfg;
    let mut xs: Vec<Vec<f32>> = tokens.iter().map(|&t| embed(w, t)).collect();
    let mut cache = KvCache { kv_heads: cfg.kv_heads, head_dim: cfg.head_dim, tokens: tokens.len(), k: vec![], v: vec![] };
    for l in 0..cfg.layers {
        let mut kl = Vec::with_capacity(tokens.len() * cfg.kv_dim());
        let mut vl = Vec::with_capacity(tokens.len() * cfg.kv_dim());
        let mut qs = Vec::with_capacity(tokens.len());
        for (pos, x) in xs.iter().enumerate() {
            let (q, k, v) = qkv(w, l, adapter, x, pos as u64);
            qs.push(q);
            kl.extend(k);
            vl.extend(v);
        }
        for (pos, (x, q)) in xs.iter_mut().zip(&qs).enumerate() {
            let a = attend(cfg, q, &kl, &vl, pos + 1);
            finish_layer(w, l, x, &a);
        }
        cache.k.push(kl);
        cache.v.push(vl);
        layer_done(l, &cache);
    }
    let last = logits(w, xs.last().expect("tokens is not empty"));
    (cache, last)
}

/// One decode step: `token` at position `pos` (plus the RoPE offset) attends
/// over every cached position and itself; returns its logits. The cache is
/// only read. A correct caller passes `pos == cache.tokens`; any other value
/// is how a wrong-position load is simulated.
///
/// # Panics
/// When the cache does not have this model's shape, or `token` is past the vocabulary.
pub fn decode_step(w: &Weights, adapter: Option<&Adapter>, cache: &KvCache, token: u32, pos: u64) -> Vec<f32> {
    let cfg = &w.cfg;
    assert!(
        cache.k.len() == cfg.layers && cache.kv_heads == cfg.kv_heads && cache.head_dim == cfg.head_dim,
        "tinylm: cache shape does not match the model"
    );
    let n = cache.tokens * cfg.kv_dim();
    let mut x = embed(w, token);
    for l in 0..cfg.layers {
        let (q, k, v) = qkv(w, l, adapter, &x, pos);
        let mut kl = cache.k[l][..n].to_vec();
        let mut vl = cache.v[l][..n].to_vec();
        kl.extend(k);
        vl.extend(v);
        let a = attend(cfg, &q, &kl, &vl, cache.tokens + 1);
        finish_layer(w, l, &mut x, &a);
    }
    logits(w, &x)
}

/// `(kv_heads, head_dim)` of a model whose every layer is dense with equal K and V widths.
fn dense_shape(model: &ModelSpec) -> (usize, usize) {
    let mut shape = None;
    for (i, l) in model.layers.iter().enumerate() {
        let s = match l.attention {
            Attention::Dense { kv_heads, head_dim, v_head_dim } if head_dim == v_head_dim => (kv_heads as usize, head_dim as usize),
            other => panic!("tinylm: layer {i} is {other:?}; only dense layers with equal K and V widths are supported"),
        };
        assert!(shape.is_none_or(|p| p == s), "tinylm: layer {i} differs in shape from layer 0");
        shape = Some(s);
    }
    shape.expect("a validated model has at least one layer")
}

fn check_fp32(side: &Side) {
    let f = side.geo.format;
    assert!(
        f.elem_bits == 32 && f.tensor_static_bytes() == 0 && f.row_bytes(1) == 4,
        "tinylm: only the fp32 cache format is supported, not {f}"
    );
}

/// Byte offset of row (`pos`, `local_head`) in a region of `side` whose rank
/// holds `local_heads` heads: `block_table[pos / B] * block_bytes + row * row_stride`,
/// with `row = slot * local_heads + local_head` (NHD) or `local_head * B + slot` (HND).
fn row_offset(side: &Side, local_heads: u32, dim: u32, local_head: u32, pos: u64) -> usize {
    let b = u64::from(side.geo.block_size);
    let block = u64::from(side.block_table[(pos / b) as usize]);
    let slot = pos % b;
    let row = match side.mem {
        MemLayout::Nhd => slot * u64::from(local_heads) + u64::from(local_head),
        MemLayout::Hnd => u64::from(local_head) * b + slot,
    };
    (block * side.geo.block_bytes(local_heads, dim) + row * side.geo.row_stride(dim)) as usize
}

fn tensor_of(cache: &KvCache, layer: usize, tensor: Tensor) -> &[f32] {
    match tensor {
        Tensor::K => &cache.k[layer],
        Tensor::V => &cache.v[layer],
        other => panic!("tinylm: a dense layer has no {other:?} tensor"),
    }
}

/// Rank `rank`'s regions of `side`, sized as [`Side::regions`] says, holding
/// its share of `cache`: every retained position of every (layer, head) the
/// rank holds, in the side's layout. Bytes outside those rows are zero.
///
/// # Panics
/// When the side's format is not `fp32`, the model is not dense with equal K
/// and V widths, the cache has another shape, or the side's table is too
/// short for the cache.
pub fn scatter(cache: &KvCache, model: &ModelSpec, side: &Side, rank: u32) -> BTreeMap<RegionId, Vec<u8>> {
    check_fp32(side);
    let (kv_heads, head_dim) = dense_shape(model);
    assert!(
        cache.k.len() == model.layers.len() && cache.kv_heads == kv_heads && cache.head_dim == head_dim,
        "tinylm: cache shape does not match the model spec"
    );
    let mut out: BTreeMap<RegionId, Vec<u8>> =
        side.regions(model, rank).into_iter().map(|(id, len)| (id, vec![0u8; len as usize])).collect();
    for ls in &side.shard.ranks[rank as usize].layers {
        let spec = &model.layers[ls.layer as usize];
        let lh = ls.heads.end - ls.heads.start;
        for t in spec.tensors() {
            let src = tensor_of(cache, ls.layer as usize, t.tensor);
            let region = out.get_mut(&RegionId { layer: ls.layer, tensor: t.tensor }).expect("Side::regions lists every held tensor");
            for pos in spec.retention.ranges(cache.tokens as u64).into_iter().flatten() {
                for (i, head) in ls.heads.clone().enumerate() {
                    let off = row_offset(side, lh, t.dim, i as u32, pos);
                    let row = &src[cache.at(pos as usize, head as usize)];
                    for (bytes, x) in region[off..off + 4 * head_dim].chunks_exact_mut(4).zip(row) {
                        bytes.copy_from_slice(&x.to_le_bytes());
                    }
                }
            }
        }
    }
    out
}

/// The cache of `tokens` positions held by the ranks of `side`: each
/// (layer, head, position) is read from the first rank that holds that head.
/// `ranks[r]` is rank `r`'s regions (e.g. [`kvwire_core::plan::Buffers::ranks`]).
/// Positions a layer does not retain stay zero.
///
/// # Panics
/// When the side's format is not `fp32`, the model is not dense with equal K
/// and V widths, no rank holds a head, or a region is missing or short.
pub fn gather(ranks: &[BTreeMap<RegionId, Vec<u8>>], model: &ModelSpec, side: &Side, tokens: u64) -> KvCache {
    check_fp32(side);
    let (kv_heads, head_dim) = dense_shape(model);
    let mut cache = KvCache::zeroed(model.layers.len(), kv_heads, head_dim, tokens as usize);
    for (l, spec) in model.layers.iter().enumerate() {
        let layer = l as u32;
        for head in 0..kv_heads as u32 {
            let (rank, held) = side
                .shard
                .ranks
                .iter()
                .find_map(|r| r.heads_of(layer).filter(|hs| hs.contains(&head)).map(|hs| (r.rank, hs)))
                .unwrap_or_else(|| panic!("tinylm: no rank holds head {head} of layer {layer}"));
            let lh = held.end - held.start;
            for t in spec.tensors() {
                let region = ranks
                    .get(rank as usize)
                    .and_then(|r| r.get(&RegionId { layer, tensor: t.tensor }))
                    .unwrap_or_else(|| panic!("tinylm: rank {rank} has no region for layer {layer} {:?}", t.tensor));
                for pos in spec.retention.ranges(tokens).into_iter().flatten() {
                    let off = row_offset(side, lh, t.dim, head - held.start, pos);
                    let at = cache.at(pos as usize, head as usize);
                    let dst = match t.tensor {
                        Tensor::K => &mut cache.k[l][at],
                        _ => &mut cache.v[l][at],
                    };
                    for (x, bytes) in dst.iter_mut().zip(region[off..off + 4 * head_dim].chunks_exact(4)) {
                        *x = f32::from_le_bytes(bytes.try_into().expect("chunks of 4"));
                    }
                }
            }
        }
    }
    cache
}
