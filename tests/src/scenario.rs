//! One end-to-end transfer through real daemons: a prefill client computes
//! tinylm's KV cache, scatters each TP rank's shard into its paged layout and
//! registers it with daemon A; a decode client registers its own layout with
//! daemon B, prepares the request, and after the transfer gathers the cache,
//! runs one decode step and compares the logits with a local computation.

use crate::engine::EngineCache;
use crate::tinylm::{self, Adapter, KvCache, Weights};
use kvwire_core::layout::{inventory, Inventory};
use kvwire_core::plan::Side;
use kvwire_core::reuse::CacheIdentity;
use kvwire_core::shard::{LayoutSpec, RegionId};
use kvwire_core::timing::{layerwise_hops, predict, LayerOverlap, Prediction, Stage};
use kvwire_core::{CacheFormat, Geometry, ModelSpec};
#[cfg(feature = "cuda")]
use kvwire_transport::device::cuda::{CudaDevice, CudaMem};
#[cfg(feature = "cuda")]
use kvwire_transport::device::{Device, DeviceMem};
use kvwire_transport::HostMem;
#[cfg(feature = "cuda")]
use std::sync::Arc;
use kvwire_client::client::{Client, ClientError, Submitted};
use kvwire_client::control::*;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// What to run.
#[derive(Debug, Clone)]
pub struct Scenario {
    /// Prompt length.
    pub tokens: u64,
    /// Positions the decode side already holds (computed locally, validated).
    pub prefix: u64,
    /// Source layout (`tp=4,block=16,layout=nhd,table=shuffle:1`).
    pub src_layout: String,
    /// Destination layout.
    pub dst_layout: String,
    /// Use a LoRA adapter on both sides.
    pub adapter: bool,
    /// Changes the source's identity claims (negative cases).
    pub src_identity: fn(&mut CacheIdentity),
    /// Changes the destination's identity (negative cases).
    pub dst_identity: fn(&mut CacheIdentity),
    /// Group names must be unique per daemon.
    pub name: String,
    /// Transfer codec (`fp8_e4m3_row`), or none for a lossless copy.
    pub codec: Option<String>,
    /// Prompt seed: different prompts for quality sweeps.
    pub seed: u64,
    /// Where both caches live.
    pub memory: Memory,
    /// A negative control: an engine-tensor destination reads its tensors
    /// as this preset lays them out instead of its own.
    pub dst_read_as: Option<&'static str>,
    /// Stream the prefill: submit first, then compute layer by layer,
    /// writing each layer into the registered cache (host or device
    /// memory) and announcing it (`produced`) before the next is computed.
    pub stream: bool,
}

/// Where a scenario's caches live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Memory {
    /// memfds registered with `register`.
    Host,
    /// "Device memory" of the daemons' stand-in backend (`[device] backend
    /// = "host"`): memfds registered with `register_device`, staged device
    /// → host at the source and host → device at the destination. The
    /// decode side reads its device memory.
    StandIn,
    /// One group of both kinds: even ranks in stand-in device memory, odd
    /// ranks in host memfds.
    Mixed,
    /// CUDA memory on device 0 (`[device] backend = "cuda"`), handed over
    /// by IPC handle; read back with cuMemcpyDtoH.
    #[cfg(feature = "cuda")]
    Cuda,
}

/// One rank's cache memory, wherever it lives; kept until the scenario ends.
enum RankMem {
    Host(HostMem),
    #[cfg(feature = "cuda")]
    Cuda { dev: CudaDevice, mem: Arc<CudaMem> },
}

impl RankMem {
    fn new(memory: Memory, image: &[u8]) -> Result<RankMem, ScenarioError> {
        let setup = |e: String| ScenarioError::Setup(e);
        match memory {
            Memory::Host | Memory::StandIn | Memory::Mixed => {
                let mem = HostMem::new("kvwire-e2e-rank", image.len() as u64).map_err(|e| setup(e.to_string()))?;
                mem.write(0, image).map_err(|e| setup(e.to_string()))?;
                Ok(RankMem::Host(mem))
            }
            #[cfg(feature = "cuda")]
            Memory::Cuda => {
                let dev = CudaDevice::open(0).map_err(|e| setup(format!("CUDA device 0: {e}")))?;
                let mem = dev.alloc(image.len() as u64).map_err(|e| setup(e.to_string()))?;
                dev.write(&mem, 0, image).map_err(|e| setup(e.to_string()))?;
                Ok(RankMem::Cuda { dev, mem })
            }
        }
    }

    fn register(&self, c: &Client, memory: Memory, r: RegisterCache) -> Result<(), ScenarioError> {
        match (self, memory) {
            (RankMem::Host(mem), Memory::Host) => c.register(r, mem).map(|_| ()).map_err(step("register")),
            (RankMem::Host(mem), Memory::Mixed) if r.rank % 2 == 1 => c.register(r, mem).map(|_| ()).map_err(step("register")),
            (RankMem::Host(mem), _) => {
                let d = RegisterDeviceCache { cache: r, ordinal: 0, len: mem.len(), ipc: None };
                c.register_device(d, Some(mem.fd())).map(|_| ()).map_err(step("register_device"))
            }
            #[cfg(feature = "cuda")]
            (RankMem::Cuda { mem, .. }, _) => {
                let (dmabuf, ipc) = kvwire_transport::device::cuda::export(mem).map_err(|e| ScenarioError::Setup(e.to_string()))?;
                let d = RegisterDeviceCache { cache: r, ordinal: 0, len: mem.len(), ipc: Some(ipc) };
                use std::os::fd::AsFd;
                c.register_device(d, dmabuf.as_ref().map(|f| f.as_fd())).map(|_| ()).map_err(step("register_device"))
            }
        }
    }

    /// Writes `bytes` at `off`, as the engine's kernels write its cache.
    fn write(&self, off: u64, bytes: &[u8]) -> Result<(), String> {
        match self {
            RankMem::Host(mem) => mem.write(off, bytes).map_err(|e| e.to_string()),
            #[cfg(feature = "cuda")]
            RankMem::Cuda { dev, mem } => dev.write(mem, off, bytes).map_err(|e| e.to_string()),
        }
    }

    fn read(&self, off: u64, out: &mut [u8]) {
        match self {
            RankMem::Host(mem) => mem.read(off, out).expect("read rank memory"),
            #[cfg(feature = "cuda")]
            RankMem::Cuda { dev, mem } => dev.read(mem, off, out).expect("cuMemcpyDtoH of rank memory"),
        }
    }
}

impl Scenario {
    /// A lossless TP4 NHD/16 → TP2 HND/32 transfer of 100 tokens (partial final block).
    pub fn new(name: &str) -> Scenario {
        Scenario {
            tokens: 100,
            prefix: 0,
            src_layout: "tp=4,block=16,layout=nhd,table=shuffle:1".into(),
            dst_layout: "tp=2,block=32,layout=hnd,table=shuffle:2".into(),
            adapter: true,
            src_identity: |_| {},
            dst_identity: |_| {},
            name: name.into(),
            codec: None,
            seed: 0x2545_F491_4F6C_DD1D,
            memory: Memory::Host,
            dst_read_as: None,
            stream: false,
        }
    }
}

/// What came out.
#[derive(Debug)]
pub struct Outcome {
    /// Inventory of the transferred cache.
    pub inventory: Inventory,
    /// Local logits.
    pub local: Vec<f32>,
    /// Logits decoded from the transferred cache.
    pub remote: Vec<f32>,
    /// Source-side status (bytes, segments).
    pub source: TransferStatus,
    /// Destination-side status.
    pub destination: TransferStatus,
    /// Per layer: time from submit until `layer_ready(L)` was seen.
    pub layer_ready: Vec<Duration>,
    /// Submit → `decoder_usable` seen.
    pub end_to_end: Duration,
    /// The prefill's compute time (all layers), measured on the client.
    pub prefill: Duration,
    /// From the last layer written into the source cache to
    /// `decoder_usable` seen: the transfer's share of the critical path
    /// (without streaming the submit comes after the prefill, so this is
    /// `end_to_end`).
    pub after_last_layer: Duration,
    /// Where the destination is an engine's own tensors: their bytes that
    /// are no row's (padding, and gaps between tensors' rows) and no longer
    /// zero. The transfer must never write them.
    pub dst_stray_bytes: Option<u64>,
}

impl Outcome {
    /// Bitwise equality of the logits.
    pub fn bitwise(&self) -> bool {
        self.local.len() == self.remote.len() && self.local.iter().zip(&self.remote).all(|(a, b)| a.to_bits() == b.to_bits())
    }

    /// Largest absolute logit difference.
    pub fn max_abs_diff(&self) -> f32 {
        self.local.iter().zip(&self.remote).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max)
    }
}

/// A transfer's stages from both daemons' statuses, and the timing model.
///
/// Each stage's busy time is measured on its own daemon's clock; chunks are
/// layers; setup is what the source spent before posting that is not a
/// stage (handshake, planning); end to end is the client's clock, submit to
/// `decoder_usable` seen. The lower bound takes the wire as the destination
/// saw it (below), every other hop whole.
pub fn timing(o: &Outcome, layers: u64) -> (Vec<(&'static str, Stage)>, Prediction) {
    let mut stages = Vec::new();
    for (side, st) in [("source", &o.source), ("destination", &o.destination)] {
        for h in &st.hops {
            stages.push((side, Stage { hop: h.hop.clone(), total_ns: h.ns, bytes: h.bytes }));
        }
    }
    let posting = o.source.marks.iter().find(|m| m.name == "posting").map_or(0, |m| m.at_ns);
    // Busy before the first post, hence not setup: packing, checksums, and a
    // device-resident source's device → host copies.
    let before: u64 = o.source.hops.iter().filter(|h| ["pack", "verify", "stage"].contains(&h.hop.as_str())).map(|h| h.ns).sum();
    // `wire` runs from the post to the completion, so `post` lies inside it:
    // listed, but not a stage of its own in the model.
    let plain: Vec<Stage> = stages
        .iter()
        .filter(|(_, s)| s.hop != "post")
        .map(|(side, s)| Stage { hop: format!("{} ({side})", s.hop), ..s.clone() })
        .collect();
    let setup = posting.saturating_sub(before);
    let mut p = predict(&plain, layers, setup);
    // The source's `wire` span ends when the last answer reached it, which
    // can be after the destination published: the answer's trip back is no
    // part of the end to end. The bound counts the wire only as the
    // destination saw bytes arrive, on its own clock: from layer 0 complete
    // to the last layer complete (a part of the span, so still a bound).
    let received = |l: u64| o.destination.marks.iter().find(|m| m.name == format!("host_received({l})")).map(|m| m.at_ns);
    let arriving = match (received(0), received(layers.saturating_sub(1))) {
        (Some(first), Some(last)) => last.saturating_sub(first),
        _ => 0,
    };
    p.lower_ns = setup + plain.iter().map(|s| if s.hop == "wire (source)" { s.total_ns.min(arriving) } else { s.total_ns }).max().unwrap_or(0);
    (stages, p.measured(o.end_to_end.as_nanos() as u64))
}

/// Layer-wise transfer against the prefill's real per-layer compute: each
/// layer goes through the hops this transfer timed, in path order (source
/// stage, checksums, pack, wire; destination unpack, checksums, device
/// copy), each taking its busy time over the layers per layer. `post` and
/// `place` lie inside `wire`; per-layer fixed costs of a streamed transfer
/// (the announcement, the checksum message) are not hops, so the measured
/// tail of a streamed run is the check on this prediction.
pub fn layer_overlap(o: &Outcome) -> LayerOverlap {
    let layers = o.layer_ready.len().max(1) as u64;
    let compute = vec![o.prefill.as_nanos() as u64 / layers; o.layer_ready.len()];
    let busy = |st: &TransferStatus, hop: &str| st.hops.iter().find(|h| h.hop == hop).map_or(0, |h| h.ns);
    let path = [
        (&o.source, "stage"),
        (&o.source, "verify"),
        (&o.source, "pack"),
        (&o.source, "wire"),
        (&o.destination, "unpack"),
        (&o.destination, "verify"),
        (&o.destination, "device_complete"),
    ];
    let hops: Vec<u64> = path.iter().map(|(st, hop)| busy(st, hop) / layers).filter(|&ns| ns > 0).collect();
    layerwise_hops(&compute, &hops)
}

/// Why a scenario stopped.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    /// A daemon refused or failed.
    #[error("{step}: {source}")]
    Daemon {
        /// What was being done.
        step: &'static str,
        /// The error.
        source: ClientError,
    },
    /// Local set-up failed.
    #[error("{0}")]
    Setup(String),
}

fn step(step: &'static str) -> impl Fn(ClientError) -> ScenarioError {
    move |source| ScenarioError::Daemon { step, source }
}

/// The tinylm config the scenarios use.
pub fn config() -> tinylm::Config {
    tinylm::Config::default()
}

/// tinylm's cache description as the TOML spec both daemons parse.
pub fn model_toml(cfg: &tinylm::Config) -> String {
    format!(
        "name = \"tinylm\"\ndtype = \"fp32\"\n[[layers]]\nrepeat = {}\nattention = \"dense\"\nkv_heads = {}\nhead_dim = {}\n",
        cfg.layers, cfg.kv_heads, cfg.head_dim
    )
}

/// A deterministic prompt of `n` tokens from `seed`.
pub fn prompt(n: u64, vocab: usize, seed: u64) -> Vec<u32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % vocab as u64) as u32
        })
        .collect()
}

fn identity(w: &Weights, a: Option<&Adapter>, cfg: &tinylm::Config) -> CacheIdentity {
    CacheIdentity {
        model_digest: tinylm::digest(w),
        adapter_digest: a.map(tinylm::adapter_digest).unwrap_or_default(),
        format: "fp32/v1".into(),
        tenant: "demo".into(),
        rope: format!("theta={}", cfg.rope_theta),
        position_offset: cfg.rope_position_offset,
    }
}

fn side(model: &ModelSpec, layout: &str, tokens: u64) -> Result<Side, ScenarioError> {
    let l = LayoutSpec::parse(layout).map_err(|e| ScenarioError::Setup(format!("layout `{layout}`: {e}")))?;
    Side::new(model, &l, CacheFormat::parse("fp32").expect("fp32"), tokens).map_err(|e| ScenarioError::Setup(e.to_string()))
}

/// One rank's memory holding `regions` back to back, in layout order.
fn rank_mem(memory: Memory, model: &ModelSpec, side: &Side, rank: u32, regions: Option<&BTreeMap<RegionId, Vec<u8>>>) -> Result<RankMem, ScenarioError> {
    let list = side.regions(model, rank);
    let total: u64 = list.iter().map(|(_, l)| l).sum();
    let mut image = vec![0u8; total as usize];
    if let Some(r) = regions {
        let mut off = 0usize;
        for (id, len) in &list {
            image[off..off + *len as usize].copy_from_slice(&r[id]);
            off += *len as usize;
        }
    }
    RankMem::new(memory, &image)
}

fn read_rank(model: &ModelSpec, side: &Side, rank: u32, mem: &RankMem) -> BTreeMap<RegionId, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut off = 0;
    for (id, len) in side.regions(model, rank) {
        let mut buf = vec![0u8; len as usize];
        mem.read(off, &mut buf);
        out.insert(id, buf);
        off += len;
    }
    out
}

#[allow(clippy::too_many_arguments)]
/// Whether an engine's tensors are device allocations (of the stand-in
/// backend); CUDA engine tensors are not part of the scenarios.
fn engine_device(memory: Memory) -> Result<bool, ScenarioError> {
    match memory {
        Memory::Host => Ok(false),
        Memory::StandIn => Ok(true),
        Memory::Mixed => Err(ScenarioError::Setup("engine tensors of mixed memory are not a scenario".into())),
        #[cfg(feature = "cuda")]
        Memory::Cuda => Err(ScenarioError::Setup("engine tensors in CUDA memory are not a scenario".into())),
    }
}

fn register_group(
    c: &Client,
    group: &str,
    model_toml: &str,
    layout: &str,
    side: &Side,
    mems: &[RankMem],
    id: &CacheIdentity,
    memory: Memory,
) -> Result<(), ScenarioError> {
    for (rank, mem) in mems.iter().enumerate() {
        let r = RegisterCache {
            group: group.into(),
            model: ModelSource::Toml(model_toml.into()),
            format: "fp32".into(),
            layout: layout.into(),
            rank: rank as u32,
            num_blocks: side.num_blocks,
            identity: id.clone(),
        };
        mem.register(c, memory, r)?;
    }
    Ok(())
}

/// Runs `sc`: `a` is the prefill side's daemon, `b` the decode side's, known to `a` as `peer`.
pub fn run(a: &Client, b: &Client, peer: &str, sc: &Scenario) -> Result<Outcome, ScenarioError> {
    let cfg = config();
    let w = Weights::seeded(&cfg, 7);
    let adapter = sc.adapter.then(|| Adapter::seeded(&cfg, 4, 11));
    let model = tinylm::model_spec(&cfg);
    let toml = model_toml(&cfg);
    let tokens = prompt(sc.tokens + 1, cfg.vocab, sc.seed);
    let t = Instant::now();
    let (cache, _) = tinylm::prefill(&w, adapter.as_ref(), &tokens[..sc.tokens as usize]);
    let prefill = t.elapsed();
    let next = tokens[sc.tokens as usize];
    let local = tinylm::decode_step(&w, adapter.as_ref(), &cache, next, sc.tokens);
    let geo = Geometry::new(CacheFormat::parse("fp32").expect("fp32"), 16).expect("geometry");
    let inv = inventory(&model, &geo, sc.tokens).map_err(|e| ScenarioError::Setup(e.to_string()))?;

    // Prefill side: scatter each rank's shard, register. A layout with
    // `kv=` is an engine writing its own per-layer tensors.
    let src = side(&model, &sc.src_layout, sc.tokens)?;
    let mut sid = identity(&w, adapter.as_ref(), &cfg);
    (sc.src_identity)(&mut sid);
    let src_group = format!("{}-prefill", sc.name);
    let shape = (cfg.kv_heads as u64, cfg.head_dim as u64);
    if sc.stream && src.kv.is_some() {
        return Err(ScenarioError::Setup("a streamed source is a cache the scenario writes layer by layer, not engine tensors".into()));
    }
    let (_src_engine, src_mems) = match &src.kv {
        Some(order) => {
            let device = engine_device(sc.memory)?;
            let e = EngineCache::register(a, &src_group, &toml, &sc.src_layout, &order.name(), &src, cfg.layers as u64, shape, &sid, device)?;
            e.scatter(&cache);
            (Some(e), Vec::new())
        }
        None => {
            // A streamed source holds nothing until its prefill writes it.
            let mems = (0..src.shard.ranks.len() as u32)
                .map(|r| rank_mem(sc.memory, &model, &src, r, (!sc.stream).then(|| tinylm::scatter(&cache, &model, &src, r)).as_ref()))
                .collect::<Result<Vec<_>, _>>()?;
            register_group(a, &src_group, &toml, &sc.src_layout, &src, &mems, &sid, sc.memory)?;
            (None, mems)
        }
    };

    // Decode side: its own layout; a prefix it computed itself, if any. A
    // layout with `kv=` is an engine holding its own per-layer tensors.
    let dst = side(&model, &sc.dst_layout, sc.tokens)?;
    let dst_group = format!("{}-decode", sc.name);
    let mut did = identity(&w, adapter.as_ref(), &cfg);
    (sc.dst_identity)(&mut did);
    let engine = match &dst.kv {
        Some(order) => {
            if sc.prefix > 0 {
                return Err(ScenarioError::Setup("an engine-tensor destination holds no prefix".into()));
            }
            let device = engine_device(sc.memory)?;
            Some(EngineCache::register(b, &dst_group, &toml, &sc.dst_layout, &order.name(), &dst, cfg.layers as u64, shape, &did, device)?)
        }
        None => None,
    };
    let held: Option<KvCache> = (sc.prefix > 0).then(|| tinylm::prefill(&w, adapter.as_ref(), &tokens[..sc.prefix as usize]).0);
    let dst_mems = match engine {
        Some(_) => Vec::new(),
        None => (0..dst.shard.ranks.len() as u32)
            .map(|r| {
                let regions = held.as_ref().map(|h| {
                    let short = side(&model, &sc.dst_layout, sc.prefix).expect("prefix side");
                    // Same table prefix: place the held positions where the request's blocks are.
                    let short = Side { block_table: dst.block_table.clone(), num_blocks: dst.num_blocks, ..short };
                    tinylm::scatter(h, &model, &short, r)
                });
                rank_mem(sc.memory, &model, &dst, r, regions.as_ref())
            })
            .collect::<Result<Vec<_>, _>>()?,
    };
    if engine.is_none() {
        register_group(b, &dst_group, &toml, &sc.dst_layout, &dst, &dst_mems, &did, sc.memory)?;
    }

    let request = format!("{}-req", sc.name);
    let slot = b
        .prepare(PrepareReceive {
            group: dst_group.clone(),
            request: request.clone(),
            block_table: dst.block_table.clone(),
            tokens: sc.tokens,
            prefix_tokens: sc.prefix,
            // Told ahead, so the source's submit starts with no round trip.
            source: Some(a.node.clone()),
        })
        .map_err(step("prepare"))?;
    let started = Instant::now();
    let submitted = a.submit(Submit {
        request: format!("{}-prefill", sc.name),
        group: src_group,
        block_table: src.block_table.clone(),
        tokens: sc.tokens,
        peer: peer.into(),
        dst_group,
        dst_request: request,
        codec: sc.codec.clone(),
        stream: sc.stream,
    });
    let Submitted { slot: sslot, peer_slot, .. } = match submitted {
        Ok(x) => x,
        Err(e) => {
            // A refused transfer must leave no flag behind.
            if b.ready(slot, FlagName::DecoderUsable) || (0..cfg.layers as u16).any(|l| b.ready(slot, FlagName::LayerReady(l))) {
                return Err(ScenarioError::Setup(format!("flags published for a refused transfer ({e})")));
            }
            return Err(ScenarioError::Daemon { step: "submit", source: e });
        }
    };
    debug_assert_eq!(peer_slot, slot);
    let last_written = if sc.stream {
        stream_prefill(a, &w, adapter.as_ref(), &tokens[..sc.tokens as usize], &model, &src, &src_mems, &format!("{}-prefill", sc.name))?
    } else {
        started
    };
    let wait = Duration::from_secs(60);
    let mut layer_ready = Vec::new();
    for l in 0..cfg.layers as u16 {
        b.wait(slot, FlagName::LayerReady(l), wait).map_err(step("wait layer_ready"))?;
        layer_ready.push(started.elapsed());
    }
    b.wait(slot, FlagName::DecoderUsable, wait).map_err(step("wait decoder_usable"))?;
    let end_to_end = started.elapsed();
    a.wait(sslot, FlagName::SourceReleased, wait).map_err(step("wait source_released"))?;
    // The source's status is final once the destination's verdict is back.
    a.wait(sslot, FlagName::DecoderUsable, wait).map_err(step("wait the source's verdict"))?;

    let got = match &engine {
        Some(e) => e.gather(sc.tokens, sc.dst_read_as),
        None => {
            let ranks: Vec<BTreeMap<RegionId, Vec<u8>>> =
                dst_mems.iter().enumerate().map(|(r, m)| read_rank(&model, &dst, r as u32, m)).collect();
            tinylm::gather(&ranks, &model, &dst, sc.tokens)
        }
    };
    let remote = tinylm::decode_step(&w, adapter.as_ref(), &got, next, sc.tokens);
    Ok(Outcome {
        inventory: inv,
        local,
        remote,
        source: a.status(sslot).map_err(step("status"))?,
        destination: b.status(slot).map_err(step("status"))?,
        layer_ready,
        end_to_end,
        prefill,
        after_last_layer: end_to_end.saturating_sub(last_written.duration_since(started)),
        dst_stray_bytes: engine.as_ref().map(EngineCache::stray_bytes),
    })
}

/// The prefill of a streamed scenario, after its submit: each layer, once
/// computed, is written into every source rank's memfd and announced for
/// each rank before the next layer is computed. Returns when the last
/// layer's bytes were written.
#[allow(clippy::too_many_arguments)] // the engine's half of the scenario
fn stream_prefill(a: &Client, w: &Weights, adapter: Option<&Adapter>, tokens: &[u32], model: &ModelSpec, src: &Side, mems: &[RankMem], group: &str) -> Result<Instant, ScenarioError> {
    let cfg = &w.cfg;
    let rows = tokens.len() * cfg.kv_heads * cfg.head_dim;
    let mut partial = KvCache { kv_heads: cfg.kv_heads, head_dim: cfg.head_dim, tokens: tokens.len(), k: vec![vec![0.0; rows]; cfg.layers], v: vec![vec![0.0; rows]; cfg.layers] };
    let mut first_error = None;
    let mut written = Instant::now();
    tinylm::prefill_with(w, adapter, tokens, |l, c| {
        if first_error.is_some() {
            return;
        }
        partial.k[l].clone_from(&c.k[l]);
        partial.v[l].clone_from(&c.v[l]);
        for (rank, mem) in mems.iter().enumerate() {
            let regions = tinylm::scatter(&partial, model, src, rank as u32);
            let mut off = 0;
            for (id, len) in src.regions(model, rank as u32) {
                if id.layer as usize == l {
                    if let Err(e) = mem.write(off, &regions[&id]) {
                        first_error = Some(ScenarioError::Setup(format!("write layer {l} of rank {rank}: {e}")));
                    }
                }
                off += len;
            }
        }
        written = Instant::now();
        for rank in 0..mems.len() as u32 {
            if let Err(e) = a.produced(group, group, rank, l as u16 + 1) {
                first_error.get_or_insert(ScenarioError::Daemon { step: "produced", source: e });
            }
        }
    });
    match first_error {
        Some(e) => Err(e),
        None => Ok(written),
    }
}
